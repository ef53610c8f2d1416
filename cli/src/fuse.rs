//! `corefs mount`: serves a corefs filesystem at a mountpoint through FUSE (the `fuser` crate,
//! no libfuse), so unmodified programs can use it. Every request becomes one reactor
//! operation through the client API, and the reply carries the engine's errno.
//!
//! Mapping: FUSE's root inode 1 is the engine's root ([`ROOT_INO`]); every other inode number
//! is the engine's own. fsync and fsyncdir go to the engine's fsync (or fdatasync when the
//! kernel asks for datasync): one log record and one flush. flush (close) and release need no
//! I/O: durability is what fsync asks for, as on a kernel filesystem. The first FLUSH is
//! answered ENOSYS, so the kernel sends no more (close(2) then makes no request). Unmounting (`umount`,
//! `fusermount3 -u`) ends the session; the reactor then commits and unmounts, so everything
//! written is durable after a clean unmount.
//!
//! Who: creates (create, mkdir, mknod, symlink) are owned by the requesting process's uid
//! and gid as the kernel passes them (a set-group-ID directory gives its group instead, in the
//! engine). The kernel checks permissions against modes and owners (`default_permissions`),
//! as for a kernel filesystem, and turns the set-user-ID and set-group-ID clearing that
//! chown, truncate and write imply into a mode change it sends here (corefs does not ask for
//! FUSE's `handle_killpriv`). Without `--allow-other` only the mounter may use the mount.
//!
//! Kernel references: every reply that hands the kernel an inode (lookup, create, mkdir,
//! mknod, symlink, link) adds one to the kernel's lookup count of it, and `forget` takes
//! counts back ([`KernelRefs`]). An inode's first reference takes an engine hold before the
//! reply leaves, and its count reaching 0 releases the hold; so an inode the kernel still
//! knows (an open file above all) outlives its last name as an orphan with nlink 0: reads,
//! writes and fstat through a descriptor go on working after unlink or a rename over it, and
//! the inode goes when the kernel forgets it. What is still held at unmount is released then;
//! after a crash the next mount deletes the orphans.
//!
//! Invariants: the kernel caches attributes and entries for [`TTL`] only (1 s), because the
//! filesystem may be changed through no other path while mounted, but the kernel's own
//! caches must not outlive an operation's effect by much. [`SESSION_THREADS`] threads read the
//! kernel's requests (each from its own clone of the connection) and each carries a request
//! through: decode, the reactor call with a reactor client of its own, the reply. So requests
//! of different callers are at the reactor together (their fsyncs share records), one slow
//! request does not stall the others, and a request crosses no thread but the reactor's (none
//! at all when its client runs the operation on the lent engine). Requests one caller makes in
//! sequence stay in sequence, since the caller waits for each reply. A reference is counted before the reply that hands
//! it over, so a forget (which the kernel sends only for references it received) never finds
//! a count lower than the kernel's.

use engine::format::items::Timespec;
use engine::inode::ROOT_INO;
use engine::{EngineError, FallocateMode, RenameFlags, SetAttr, Stat, XattrFlags};
use fuser::{
    BsdFileFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, IoctlFlags, KernelConfig, LockOwner, OpenFlags, PollEvents,
    PollFlags, PollNotifier, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, SessionACL, TimeOrNow, WriteFlags,
};
use reactor::{Client, Op, OpenHow, Opened, Reply, Runtime};

/// Times a create starts over when the inode it found went before its hold.
const OPEN_ATTEMPTS: u32 = 16;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the kernel may cache attributes and names.
const TTL: Duration = Duration::from_secs(1);

/// Threads reading and serving the kernel's requests (module doc): enough for several
/// requests at the reactor at once (its batches group their fsyncs) and for a slow one (an
/// fsync) not to hold up the others. Until 2026-12 one session thread handed each request to
/// one of four workers and the reply went back through it: two more thread hops per request,
/// which on a 2-core machine were most of a small request's time.
pub const SESSION_THREADS: usize = 4;

/// The session threads' reactor clients: a thread takes one for a request and puts it back,
/// so there are never more than [`SESSION_THREADS`] (plus one for `destroy`).
struct Clients(Mutex<Vec<Client>>);

impl Clients {
    fn new(runtime: &Runtime) -> Clients {
        Clients(Mutex::new(
            (0..SESSION_THREADS).map(|_| runtime.client(4)).collect(),
        ))
    }

    fn take(&self) -> Option<Client> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    fn give_back(&self, client: Client) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(client);
    }

    fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Stripes of [`KernelRefs`]: an inode's first reference holds its stripe's lock across a
/// reactor call, which then delays only the inodes of that stripe.
const REF_STRIPES: usize = 64;

/// The kernel's references to inodes: its lookup count of each inode it was handed (FUSE's
/// `nlookup`), the first of which holds the inode in the engine (module doc). The root is
/// never counted: the kernel holds it for the whole mount, and the engine never deletes it.
struct KernelRefs {
    stripes: [Mutex<HashMap<u64, u64>>; REF_STRIPES],
}

impl Default for KernelRefs {
    fn default() -> KernelRefs {
        KernelRefs {
            stripes: std::array::from_fn(|_| Mutex::default()),
        }
    }
}

impl KernelRefs {
    fn lock(&self, ino: u64) -> MutexGuard<'_, HashMap<u64, u64>> {
        self.stripes[(ino % REF_STRIPES as u64) as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one reference to `ino` that is about to be handed to the kernel. The first one
    /// takes the engine hold, with the stripe's lock held so that no forget can release it
    /// before it exists.
    fn add(&self, client: &mut Client, ino: u64) -> Result<(), i32> {
        if ino == ROOT_INO {
            return Ok(());
        }
        let mut counts = self.lock(ino);
        match counts.get_mut(&ino) {
            Some(count) => *count = count.saturating_add(1),
            None => {
                call(client, Op::Hold { ino })?;
                counts.insert(ino, 1);
            }
        }
        Ok(())
    }

    /// Counts one reference to `ino`, which the engine already holds for it (an
    /// [`Op::Open`]'s hold): the first reference keeps that hold; a later one gives it back,
    /// the first's being enough.
    fn adopt(&self, client: &mut Client, ino: u64) {
        let mut counts = self.lock(ino);
        match counts.get_mut(&ino) {
            Some(count) => {
                *count = count.saturating_add(1);
                drop(counts);
                if let Err(e) = call(client, Op::Release { ino }) {
                    tracing::warn!("releasing a second hold of inode {ino}: errno {e}");
                }
            }
            None => {
                counts.insert(ino, 1);
            }
        }
    }

    /// The kernel forgot `nlookup` references to `ino`; the last one releases the hold (which
    /// deletes an orphan). An inode never counted (the root) is ignored.
    fn forget(&self, client: &mut Client, ino: u64, nlookup: u64) {
        let mut counts = self.lock(ino);
        let Some(count) = counts.get_mut(&ino) else {
            return;
        };
        *count = count.saturating_sub(nlookup);
        if *count > 0 {
            return;
        }
        counts.remove(&ino);
        if let Err(e) = call(client, Op::Release { ino }) {
            tracing::warn!("releasing inode {ino} after the kernel forgot it: errno {e}");
        }
    }

    /// Releases every hold left (at unmount, when the kernel forgets nothing more): orphans
    /// are deleted now rather than by the next mount. Returns the holds released.
    fn release_all(&self, client: &mut Client) -> usize {
        let mut released = 0;
        for stripe in &self.stripes {
            let mut counts = stripe.lock().unwrap_or_else(|p| p.into_inner());
            for (ino, _) in counts.drain() {
                released += 1;
                if let Err(e) = call(client, Op::Release { ino }) {
                    tracing::warn!("releasing inode {ino} at unmount: errno {e}");
                }
            }
        }
        released
    }
}

pub struct CorefsFuse {
    runtime: Option<Runtime>,
    clients: Clients,
    refs: Arc<KernelRefs>,
    /// Set at the first ioctl, which alone is logged (programs probe ioctls by the thousand).
    ioctl_logged: AtomicBool,
}

impl CorefsFuse {
    pub fn new(runtime: Runtime) -> CorefsFuse {
        CorefsFuse {
            clients: Clients::new(&runtime),
            runtime: Some(runtime),
            refs: Arc::default(),
            ioctl_logged: AtomicBool::new(false),
        }
    }
}

/// A fuser reply, as [`CorefsFuse::answer`] fails it: each reply type has its own `error`,
/// and no trait in fuser names them all.
trait ErrorReply: Send + 'static {
    fn error(self, errno: Errno);
}

macro_rules! error_reply {
    ($($reply:ty),*) => {
        $(impl ErrorReply for $reply {
            fn error(self, errno: Errno) {
                <$reply>::error(self, errno)
            }
        })*
    };
}

error_reply!(
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyEmpty,
    ReplyEntry,
    ReplyStatfs,
    ReplyWrite,
    ReplyXattr
);

/// The payload of a reply of the kind `$kind` (`Reply::Data` …), or EIO for any other kind:
/// the reactor answers each operation with one kind, so another is a bug, reported as an I/O
/// error rather than a panic in a FUSE worker.
macro_rules! expect {
    ($reply:expr, $kind:path) => {
        match $reply {
            $kind(payload) => Ok(payload),
            _ => Err(libc::EIO),
        }
    };
}

/// The request handlers' shape: each turns the kernel's request into an [`Op`] (or answers
/// at once what needs no reactor), then makes the reactor call with [`CorefsFuse::answer`],
/// which replies with the result or with the call's errno.
impl CorefsFuse {
    /// Runs `job` here, on the session thread that read the request, with a reactor client.
    /// A panic fails this request alone (its reply, dropped while unwinding, answers EIO) and
    /// the thread serves on.
    fn run(&self, job: impl FnOnce(&mut Client)) {
        let client = match self.clients.take() {
            Some(client) => Some(client),
            None => self.runtime.as_ref().map(|r| r.client(4)),
        };
        // None only after `destroy`: the reply is dropped, which fuser answers with EIO.
        let Some(mut client) = client else { return };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut client)));
        if let Err(panic) = ran {
            tracing::error!("FUSE request panicked: {}", reactor::panic_message(&*panic));
        }
        self.clients.give_back(client);
    }

    /// Runs `work` with a reactor client and answers the kernel: `done` with what it returns,
    /// or the errno it failed with.
    fn answer<R: ErrorReply, T>(
        &self,
        reply: R,
        work: impl FnOnce(&mut Client) -> Result<T, i32>,
        done: impl FnOnce(R, T),
    ) {
        self.run(move |c| match work(c) {
            Ok(value) => done(reply, value),
            Err(e) => reply.error(fuse_errno(e)),
        });
    }

    /// Replies with the inode `op` returns (lookup, mkdir, mknod, symlink, link), which the
    /// kernel then references.
    fn reply_entry(&self, op: Op, reply: ReplyEntry) {
        let refs = self.refs.clone();
        let work = move |c: &mut Client| {
            let s = stat_reply(c, op)?;
            refs.add(c, s.ino)?;
            Ok(s)
        };
        self.answer(reply, work, |reply, s| {
            reply.entry(&TTL, &attr(&s), Generation(0))
        });
    }

    /// Replies with the attributes `op` returns (getattr, setattr).
    fn reply_attr(&self, op: Op, reply: ReplyAttr) {
        self.answer(
            reply,
            |c| stat_reply(c, op),
            |reply, s| reply.attr(&TTL, &attr(&s)),
        );
    }

    /// Replies with the bytes `op` returns (read, readlink).
    fn reply_data(&self, op: Op, reply: ReplyData) {
        self.answer(
            reply,
            |c| expect!(call(c, op)?, Reply::Data),
            |reply, d| reply.data(&d),
        );
    }

    /// Replies success or the errno of `op`, which has no result.
    fn reply_empty(&self, op: Op, reply: ReplyEmpty) {
        self.answer(reply, |c| call(c, op), |reply, _| reply.ok());
    }
}

fn call(client: &mut Client, op: Op) -> Result<Reply, i32> {
    client.call(op).map_err(|e| errno(&e))
}

fn stat_reply(client: &mut Client, op: Op) -> Result<Stat, i32> {
    expect!(call(client, op)?, Reply::Stat)
}

/// An errno as fuser takes it (`e` is never 0: [`errno`] maps 0 to EIO).
fn fuse_errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn errno(e: &EngineError) -> i32 {
    match e.errno() {
        0 => libc::EIO,
        n => n,
    }
}

/// The inode owner a FUSE request creates with: the calling process's user and group, as
/// the kernel passes them.
fn owner_of(req: &Request) -> reactor::Owner {
    reactor::Owner {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn to_engine(ino: INodeNo) -> u64 {
    if ino == INodeNo::ROOT {
        ROOT_INO
    } else {
        ino.0
    }
}

fn to_fuse(ino: u64) -> INodeNo {
    if ino == ROOT_INO {
        INodeNo::ROOT
    } else {
        INodeNo(ino)
    }
}

/// An engine time (whole seconds rounded down, negative before 1970, and nanoseconds after
/// them) as the `SystemTime` fuser sends the kernel; times past what `SystemTime` holds are
/// clamped to the epoch rather than panicking.
fn time_of(t: Timespec) -> SystemTime {
    let nsec = Duration::from_nanos(u64::from(t.nsec));
    let time = if t.sec >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(t.sec.unsigned_abs()))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(t.sec.unsigned_abs()))
    };
    time.and_then(|t| t.checked_add(nsec)).unwrap_or(UNIX_EPOCH)
}

/// A time the kernel asks setattr to set, as the engine stores it.
///
/// fuser 0.18 turns the kernel's (seconds, nanoseconds) for a time before 1970 — seconds
/// negative, rounded down, nanoseconds after them — into `UNIX_EPOCH - (|seconds| +
/// nanoseconds)` where `UNIX_EPOCH - |seconds| + nanoseconds` is meant (its
/// `system_time_from_time`, marked as a to-do there). This takes the two fields back out of
/// that, so a pre-1970 time keeps its fraction. fuser is pinned (`=0.18.0`) and
/// cli/tests/mount.rs round-trips a pre-1970 time with nanoseconds through a mount, which
/// fails if fuser's conversion changes.
fn timespec_set(t: TimeOrNow) -> Timespec {
    let t = match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => return Timespec::now(),
    };
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            nsec: d.subsec_nanos(),
        },
        Err(before) => {
            let d = before.duration();
            Timespec {
                sec: i64::try_from(d.as_secs()).map_or(i64::MIN, |s| -s),
                nsec: d.subsec_nanos(),
            }
        }
    }
}

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn attr(s: &Stat) -> FileAttr {
    FileAttr {
        ino: to_fuse(s.ino),
        size: s.size,
        blocks: s.blocks_512,
        atime: time_of(s.atime),
        mtime: time_of(s.mtime),
        ctime: time_of(s.ctime),
        // Linux's FUSE protocol carries no birth time (statx shows none); macOS shows it.
        crtime: time_of(s.crtime),
        kind: kind_of(s.mode),
        perm: (s.mode & 0o7777) as u16,
        nlink: s.nlink,
        uid: s.uid,
        gid: s.gid,
        // The kernel's encoding of a device number (new_encode_dev), as mknod passed it.
        rdev: u32::try_from(s.rdev).unwrap_or(0),
        blksize: 4096,
        flags: 0,
    }
}

impl Filesystem for CorefsFuse {
    fn init(&mut self, _req: &Request, _config: &mut KernelConfig) -> std::io::Result<()> {
        Ok(())
    }

    fn destroy(&mut self) {
        // The session threads have ended (fuser joins them before calling this).
        self.clients.clear();
        if let Some(runtime) = self.runtime.take() {
            let released = self.refs.release_all(&mut runtime.client(1));
            match runtime.shutdown() {
                Ok(stats) => tracing::info!(
                    ops = stats.ops,
                    commits = stats.commit.commits,
                    log_writes = stats.log.log_writes,
                    kernel_refs_released = released,
                    "unmounted: committed"
                ),
                Err(e) => tracing::error!("unmount: {e}"),
            }
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let op = Op::Lookup {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.reply_entry(op, reply);
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let ino = to_engine(ino);
        let refs = self.refs.clone();
        self.run(move |c| refs.forget(c, ino, nlookup));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let op = Op::Stat {
            ino: to_engine(ino),
        };
        self.reply_attr(op, reply);
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let change = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(timespec_set),
            mtime: mtime.map(timespec_set),
        };
        let op = Op::SetAttr {
            ino: to_engine(ino),
            change,
        };
        self.reply_attr(op, reply);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let op = Op::Readlink {
            ino: to_engine(ino),
        };
        self.reply_data(op, reply);
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        // The file type stays; the engine refuses types mknod cannot make (EINVAL).
        let op = Op::Mknod {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
            mode: mode & (libc::S_IFMT | (0o7777 & !umask)),
            rdev: u64::from(rdev),
            owner: owner_of(req),
        };
        self.reply_entry(op, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let op = Op::Mkdir {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
            mode: mode & !umask & 0o7777,
            owner: owner_of(req),
        };
        self.reply_entry(op, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::Unlink {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.reply_empty(op, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::Rmdir {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.reply_empty(op, reply);
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let op = Op::Symlink {
            dir: to_engine(parent),
            name: link_name.as_bytes().to_vec(),
            target: target.as_os_str().as_bytes().to_vec(),
            owner: owner_of(req),
        };
        self.reply_entry(op, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        // RENAME_WHITEOUT (overlayfs) is not supported, as on most filesystems: EINVAL.
        let known = fuser::RenameFlags::RENAME_NOREPLACE | fuser::RenameFlags::RENAME_EXCHANGE;
        if !known.contains(flags) {
            return reply.error(Errno::EINVAL);
        }
        let op = Op::Rename {
            from_dir: to_engine(parent),
            from: name.as_bytes().to_vec(),
            to_dir: to_engine(newparent),
            to: newname.as_bytes().to_vec(),
            flags: RenameFlags {
                noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE),
                exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE),
            },
        };
        self.reply_empty(op, reply);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let op = Op::Link {
            ino: to_engine(ino),
            dir: to_engine(newparent),
            name: newname.as_bytes().to_vec(),
        };
        self.reply_entry(op, reply);
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // The engine has no open state: the inode number is the handle, and the kernel's
        // reference (counted at lookup) keeps an open file's inode.
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // fuser checks that `offset` is a valid off_t; the kernel bounds `size` by max_read,
        // but `offset + size` may still pass i64::MAX.
        let len = match engine::file::rw_len(offset, size as usize) {
            Ok(len) => len,
            Err(e) => return reply.error(fuse_errno(errno(&e))),
        };
        let op = Op::Read {
            ino: to_engine(ino),
            offset,
            len,
        };
        self.reply_data(op, reply);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let len = match engine::file::rw_len(offset, data.len()) {
            Ok(len) => len,
            Err(e) => return reply.error(fuse_errno(errno(&e))),
        };
        let op = Op::Write {
            ino: to_engine(ino),
            offset,
            data: data[..len].to_vec(),
        };
        let work = |c: &mut Client| expect!(call(c, op)?, Reply::Written);
        self.answer(reply, work, |reply, n| reply.written(n as u32));
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to do at close (no locks, no open state, durability is fsync's): ENOSYS
        // tells the kernel so, and it stops sending FLUSH at all (`no_flush`), one request
        // in ten of a `cp -a` and the one every close(2) waited for.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let ino = to_engine(ino);
        let op = if datasync {
            Op::Fdatasync { ino }
        } else {
            Op::Fsync { ino }
        };
        self.reply_empty(op, reply);
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        // Offsets: 1 is ".", 2 is "..", and an entry with engine cookie c is c + 2.
        let dir = to_engine(ino);
        self.run(move |c| {
            let mut offset = offset;
            if offset == 0 {
                if reply.add(ino, 1, FileType::Directory, ".") {
                    return reply.ok();
                }
                offset = 1;
            }
            if offset == 1 {
                if reply.add(INodeNo::ROOT, 2, FileType::Directory, "..") {
                    return reply.ok();
                }
                offset = 2;
            }
            let mut cookie = offset - 2;
            loop {
                let op = Op::Readdir {
                    dir,
                    cookie,
                    max: 128,
                };
                let entries = match call(c, op).and_then(|r| expect!(r, Reply::Entries)) {
                    Ok(entries) => entries,
                    Err(e) => return reply.error(fuse_errno(e)),
                };
                if entries.is_empty() {
                    return reply.ok();
                }
                for e in entries {
                    let kind = kind_of((e.kind as u32) << 12);
                    if reply.add(
                        to_fuse(e.ino),
                        e.cookie + 2,
                        kind,
                        OsStr::from_bytes(&e.name),
                    ) {
                        return reply.ok();
                    }
                    cookie = e.cookie;
                }
            }
        });
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.fsync(req, ino, fh, datasync, reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let work = |c: &mut Client| expect!(call(c, Op::Statfs)?, Reply::Statfs);
        self.answer(reply, work, |reply, s| {
            reply.statfs(
                s.total_blocks,
                s.free_blocks,
                s.free_blocks,
                s.inodes.saturating_add(s.free_inodes),
                s.free_inodes,
                s.block_bytes,
                s.name_max,
                s.block_bytes,
            )
        });
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        if !xattr_namespace_stored(name) {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let flags = match flags {
            0 => XattrFlags::Any,
            libc::XATTR_CREATE => XattrFlags::Create,
            libc::XATTR_REPLACE => XattrFlags::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        let op = Op::SetXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
            value: value.to_vec(),
            flags,
        };
        self.reply_empty(op, reply);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if !xattr_namespace_stored(name) {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let op = Op::GetXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
        };
        let work = |c: &mut Client| expect!(call(c, op)?, Reply::Data);
        self.answer(reply, work, move |reply, d| xattr_reply(reply, &d, size));
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let op = Op::ListXattr {
            ino: to_engine(ino),
        };
        let work = |c: &mut Client| expect!(call(c, op)?, Reply::Names);
        self.answer(reply, work, move |reply, names| {
            let mut list = Vec::new();
            for n in names {
                list.extend_from_slice(&n);
                list.push(0);
            }
            xattr_reply(reply, &list, size)
        });
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if !xattr_namespace_stored(name) {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let op = Op::RemoveXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
        };
        self.reply_empty(op, reply);
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let dir = to_engine(parent);
        let name = name.as_bytes().to_vec();
        let owner = owner_of(req);
        let refs = self.refs.clone();
        // One request creates (or, without O_EXCL, opens what a racing create made since the
        // kernel's lookup, as open(2) would) and holds the file for the kernel's reference.
        let how = OpenHow {
            create: Some((mode & !umask & 0o7777, owner)),
            exclusive: flags & libc::O_EXCL != 0,
            writable: flags & libc::O_ACCMODE != libc::O_RDONLY,
            truncate: flags & libc::O_TRUNC != 0,
            directory: false,
        };
        let work = move |c: &mut Client| {
            let open = Op::Open {
                dir,
                name: name.clone(),
                how,
            };
            // An inode another reactor holds can go between its lookup and its hold: the
            // open then starts over (a few times at most, as the C ABI's open).
            for _ in 0..OPEN_ATTEMPTS {
                match call(c, open.clone())? {
                    Reply::Opened(Opened::Found(s) | Opened::Created(s)) => {
                        refs.adopt(c, s.ino);
                        return Ok(s);
                    }
                    Reply::Opened(Opened::Gone) => continue,
                    other => {
                        tracing::error!("unexpected reply {other:?} to an open");
                        return Err(libc::EIO);
                    }
                }
            }
            Err(libc::ENOENT)
        };
        self.answer(reply, work, |reply, s| {
            reply.created(
                &TTL,
                &attr(&s),
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            )
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // The modes the engine implements; others (collapse, insert, unshare) are not
        // supported, which fallocate(2) says with EOPNOTSUPP. The kernel has already refused
        // a punch without KEEP_SIZE and a punch together with a zero.
        let known =
            libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        if length == 0 {
            return reply.error(Errno::EINVAL);
        }
        let op = Op::Fallocate {
            ino: to_engine(ino),
            mode: FallocateMode {
                keep_size: mode & libc::FALLOC_FL_KEEP_SIZE != 0,
                punch_hole: mode & libc::FALLOC_FL_PUNCH_HOLE != 0,
                zero_range: mode & libc::FALLOC_FL_ZERO_RANGE != 0,
            },
            offset,
            len: length,
        };
        self.reply_empty(op, reply);
    }

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // No ioctl is supported: ENOTTY, what a kernel filesystem answers to one it does not
        // know. Tools probe ioctls on every file (fsstress, cp's FICLONE), so only the first
        // is logged.
        if !self.ioctl_logged.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "ioctl {cmd:#x} on inode {} answered ENOTTY (no ioctl is supported; \
                 further ones are not logged)",
                to_engine(ino)
            );
        }
        reply.error(Errno::ENOTTY);
    }

    // The requests below are not supported; answering ENOSYS here (rather than through
    // fuser's defaults, which log a warning) tells the kernel so once, and it falls back to
    // its own generic code: lseek's SEEK_DATA/SEEK_HOLE see the whole file as data,
    // copy_file_range copies through read and write, poll reports always ready.

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: i64,
        _whence: i32,
        reply: ReplyLseek,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        _fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        reply.error(Errno::ENOSYS);
    }
}

/// Whether an extended attribute's name is in a namespace corefs stores: `user.`,
/// `trusted.` and `security.`, as ext4. The kernel hands a FUSE filesystem every name, where
/// a kernel filesystem's handlers answer EOPNOTSUPP to a namespace they do not know, so that
/// is done here. `system.` is refused whole: its names mean something to the kernel (POSIX
/// ACLs above all, which corefs does not support; refusing them makes cp -a, tar and rsync
/// fall back to chmod, instead of storing an ACL whose mode bits nothing would apply).
fn xattr_namespace_stored(name: &OsStr) -> bool {
    let name = name.as_bytes();
    [&b"user."[..], b"trusted.", b"security."]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// getxattr/listxattr's two-step protocol: size 0 asks for the length.
fn xattr_reply(reply: ReplyXattr, data: &[u8], size: u32) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(data);
    }
}

/// Who may use a mount besides its mounter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The mounter alone (FUSE's default).
    Mounter,
    /// Every user (`allow_other`), the kernel checking each one's permissions. A mounter
    /// other than root needs `user_allow_other` in /etc/fuse.conf for fusermount3 to allow it.
    Everyone,
}

/// The read-ahead window the mount asks for: one FUSE request (the kernel's 256-page cap on
/// a request, which fuser negotiates).
pub const READAHEAD_KB: u32 = 1024;

/// Widens the kernel's read-ahead for the mount at `mountpoint` to [`READAHEAD_KB`]. FUSE's
/// init caps a mount's window at the kernel's default (128 KiB), so a 1 MiB `dd` of a cold
/// 1 GiB file ran at half a kernel filesystem's speed (1.99 s, ext4 0.98 s); with 1 MiB it
/// took 0.92 s (4 MiB: 1.01 s). The window lives in sysfs (`/sys/class/bdi/MAJ:MIN/
/// read_ahead_kb`), writable by root only: a mount by another user keeps the kernel's and
/// says how to widen it. The mount's device number comes from /proc/self/mountinfo, not
/// from a stat of the mountpoint: a stat would hold the new mount while the server answers
/// it, and an unmount right after the mount then failed as busy.
fn widen_readahead(mountpoint: &Path) {
    let Some(dev) = mount_device(mountpoint) else {
        tracing::info!(
            "read-ahead left as the kernel set it ({} not in /proc/self/mountinfo)",
            mountpoint.display()
        );
        return;
    };
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    match std::fs::write(&knob, READAHEAD_KB.to_string()) {
        Ok(()) => tracing::debug!("{knob}: {READAHEAD_KB}"),
        Err(e) => tracing::info!(
            "read-ahead left at the kernel's 128 KiB ({knob}: {e}); as root: echo \
             {READAHEAD_KB} > {knob}"
        ),
    }
}

/// The `MAJ:MIN` of the newest mount at `mountpoint` (canonical), from /proc/self/mountinfo
/// (whose paths escape space, tab, newline and backslash as octal).
fn mount_device(mountpoint: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let mut want = Vec::new();
    for &b in mountpoint.as_os_str().as_bytes() {
        match b {
            b' ' | b'\t' | b'\n' | b'\\' => want.extend(format!("\\{b:03o}").bytes()),
            _ => want.push(b),
        }
    }
    let info = std::fs::read("/proc/self/mountinfo").ok()?;
    info.split(|&b| b == b'\n').rev().find_map(|line| {
        let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
        if fields.get(4) != Some(&want.as_slice()) {
            return None;
        }
        fields
            .get(2)
            .map(|dev| String::from_utf8_lossy(dev).into_owned())
    })
}

/// Mounts `runtime`'s filesystem at `mountpoint` and serves it until unmounted.
pub fn serve(runtime: Runtime, mountpoint: &Path, access: Access) -> std::io::Result<()> {
    // Default permissions: the kernel checks modes against the caller, as for a kernel
    // filesystem (the engine stores modes and owners but does not check them).
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("corefs".into()),
        fuser::MountOption::Subtype("corefs".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    config.n_threads = Some(SESSION_THREADS);
    config.clone_fd = true;
    config.acl = match access {
        Access::Mounter => SessionACL::Owner,
        Access::Everyone => SessionACL::All,
    };
    let mountpoint = std::fs::canonicalize(mountpoint)?;
    let mut session = fuser::spawn_mount(CorefsFuse::new(runtime), &mountpoint, &config)?;
    widen_readahead(&mountpoint);
    // The session ends when the kernel's connection does (after `destroy` has committed).
    // The handle is swapped for a finished thread's so `session`, which unmounts when
    // dropped, stays whole until it is decided below whether it should.
    let serving = std::mem::replace(&mut session.guard, std::thread::spawn(|| Ok(())));
    let ended = serving
        .join()
        .map_err(|_| std::io::Error::other("the FUSE session thread panicked"))?;
    // After `umount` or `fusermount3 -u` there is nothing left to unmount, but fuser 0.18
    // would try again (its check of the connection reads POLLERR, which says the connection
    // is gone, as "still mounted") and log "Unmount failed: Invalid argument" at every clean
    // unmount; worse, the second umount could hit a filesystem mounted there since. So the
    // session is dropped (and fuser unmounts) only while the mount is still there: when the
    // connection ended some other way (aborted through /sys/fs/fuse/connections).
    if is_mounted_at(&mountpoint) {
        drop(session);
    } else {
        std::mem::forget(session);
    }
    ended
}

/// What to do about a mount that failed with `e`, if something is known ("" otherwise): a
/// user other than root mounts through fusermount3, which fuser reaches only after opening
/// /dev/fuse itself, so the device must be open to them (mode 0666, as fuse3's udev rule
/// sets it; some containers leave it 0600).
pub fn mount_hint(e: &std::io::Error) -> &'static str {
    // SAFETY: geteuid has no preconditions; access reads a NUL-terminated path.
    let refused = e.kind() == std::io::ErrorKind::PermissionDenied
        && unsafe { libc::geteuid() } != 0
        && unsafe { libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) } != 0;
    if refused {
        " (/dev/fuse is not readable and writable by this user: a user other than root \
         mounts through fusermount3 once /dev/fuse is mode 0666, as fuse3's udev rule sets it)"
    } else {
        ""
    }
}

/// Whether a corefs FUSE mount (source "corefs") is at `mountpoint` (canonical), per
/// /proc/self/mountinfo.
fn is_mounted_at(mountpoint: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return true; // unknown: let fuser try, as it would
    };
    info.lines().any(|line| {
        // "id parent major:minor root mountpoint options [optional...] - fstype source ..."
        let mut halves = line.splitn(2, " - ");
        let (Some(left), Some(right)) = (halves.next(), halves.next()) else {
            return false;
        };
        let at = left.split(' ').nth(4).map(unescape_mountinfo);
        let mut fs = right.split(' ');
        // "fuse" when mounted directly (as root), "fuse.corefs" through fusermount3.
        let fuse = fs.next().is_some_and(|t| t == "fuse" || t == "fuse.corefs");
        let corefs = fs.next() == Some("corefs");
        at.as_deref() == Some(mountpoint.as_os_str().as_bytes()) && fuse && corefs
    })
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo` (octal).
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A time before 1970 with a fraction keeps it both ways: what fuser 0.18 makes of the
    /// kernel's (-2 s, 800 ms) for -1.2 s comes back as the same two fields, and the engine's
    /// fields go out as -1.2 s.
    #[test]
    fn times_before_1970_keep_their_fraction() {
        // fuser's conversion of the kernel's fields (seconds < 0): EPOCH - (|s| + ns).
        let from_fuser = UNIX_EPOCH - Duration::new(2, 800_000_000);
        let t = timespec_set(TimeOrNow::SpecificTime(from_fuser));
        assert_eq!((t.sec, t.nsec), (-2, 800_000_000));
        let later = UNIX_EPOCH + Duration::new(5, 7);
        let t = timespec_set(TimeOrNow::SpecificTime(later));
        assert_eq!((t.sec, t.nsec), (5, 7));
        assert_eq!(
            time_of(Timespec {
                sec: -2,
                nsec: 800_000_000
            }),
            UNIX_EPOCH - Duration::from_millis(1200)
        );
        // Past what SystemTime holds: some time, not a panic in a FUSE worker.
        time_of(Timespec {
            sec: i64::MIN,
            nsec: 999_999_999,
        });
        time_of(Timespec {
            sec: i64::MAX,
            nsec: 999_999_999,
        });
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(
            unescape_mountinfo(r"/mnt/a\040b\134c"),
            b"/mnt/a b\\c".to_vec()
        );
        assert_eq!(unescape_mountinfo(r"/x\04"), b"/x\\04".to_vec());
    }
}
