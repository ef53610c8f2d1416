//! `corefs mount`: serves a corefs filesystem at a mountpoint through FUSE (the `fuser` crate,
//! no libfuse), so unmodified programs can use it. Every request becomes one reactor
//! operation through the client API, and the reply carries the engine's errno.
//!
//! Mapping: FUSE's root inode 1 is the engine's root ([`ROOT_INO`]); every other inode number
//! is the engine's own. fsync and fsyncdir go to the engine's fsync (or fdatasync when the
//! kernel asks for datasync): one log record and one flush. flush (close) and release need no
//! I/O: durability is what fsync asks for, as on a kernel filesystem. sync(2) and syncfs(2)
//! never reach the server (Linux sends FUSE_SYNCFS to virtiofs alone): what was written
//! through the mount is durable at an fsync, at the next commit (the commit interval), at
//! unmount, or at [`SYNC_IOCTL`] (`corefs sync PATH`), which commits. The first FLUSH is
//! answered ENOSYS, so the kernel sends no more (close(2) then makes no request). Unmounting (`umount`,
//! `fusermount3 -u`) ends the session; the reactor then commits and unmounts, so everything
//! written is durable after a clean unmount.
//!
//! Who: creates (create, mkdir, mknod, symlink) are owned by the requesting process's uid
//! and gid as the kernel passes them (a set-group-ID directory gives its group instead, in the
//! engine). The kernel checks permissions against modes and owners (`default_permissions`),
//! as for a kernel filesystem. Killing privileges at a write, a truncate and a chown (the
//! file capability, set-user-ID, set-group-ID with group execute) is the server's
//! (FUSE_HANDLE_KILLPRIV_V2, [`kill_privs`]): the kernel says at a write whether the writer
//! lacks CAP_FSETID; at a truncate fuser does not pass that on, so a caller other than root
//! is taken to lack it. Without `--allow-other` only the mounter may use the mount.
//!
//! Kernel references: every reply that hands the kernel an inode (lookup, create, mkdir,
//! mknod, symlink, link, and each entry but "." and ".." of a readdirplus) adds one to the
//! kernel's lookup count of it, and `forget` takes
//! counts back ([`KernelRefs`]). An inode's first reference takes an engine hold before the
//! reply leaves, and its count reaching 0 releases the hold; so an inode the kernel still
//! knows (an open file above all) outlives its last name as an orphan with nlink 0: reads,
//! writes and fstat through a descriptor go on working after unlink or a rename over it, and
//! the inode goes when the kernel forgets it. What is still held at unmount is released then;
//! after a crash the next mount deletes the orphans.
//!
//! Invariants: the kernel caches attributes and entries (a missing name too, as a negative
//! entry) for [`TTL`] only (1 s), because the
//! filesystem may be changed through no other path while mounted, but the kernel's own
//! caches must not outlive an operation's effect by much. File pages outlive an open only
//! while no read through them would move atime ([`session::open_flags`]): a read the page cache answers
//! never reaches the engine. [`SESSION_THREADS`] threads read the
//! kernel's requests (from one descriptor) and each carries a request through: decode, the
//! reactor call with a reactor client of its own, the reply. So requests of different
//! callers are at the reactor together (their fsyncs share records), one slow
//! request does not stall the others, and a request crosses no thread but the reactor's (none
//! at all when its client runs the operation on the lent engine). Requests one caller makes in
//! sequence stay in sequence, since the caller waits for each reply. A reference is counted
//! before the reply that hands it over, so a forget (which the kernel sends only for
//! references it received) never finds a count lower than the kernel's.
//!
//! Files: this one holds the request handlers; `refs` the kernel's inode references,
//! `convert` the translations between FUSE's and the engine's types (and the xattr
//! namespaces), `session` the mount itself (starting, read-ahead, ending).

use convert::*;
use refs::KernelRefs;
pub use session::{mount_hint, serve, Access};

use engine::{FallocateMode, RenameFlags, SetAttr, XattrFlags};
use fuser::{
    BsdFileFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags,
    PollEvents, PollFlags, PollNotifier, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyPoll,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use reactor::{Client, Op, OpenHow, Opened, Reply, Runtime};

/// Times a create starts over when the inode it found went before its hold.
const OPEN_ATTEMPTS: u32 = 16;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// The ioctl that commits the whole filesystem (`corefs sync PATH`), issued on any file or
/// directory of the mount: `_IO(0xCF, 0x01)`, no argument. Linux passes sync(2) and
/// syncfs(2) (`sync`, `sync -f`) to no FUSE server but virtiofs: they return at once and
/// make nothing durable here, so this is how a whole tree copied through the mount is made
/// durable in one step (besides an fsync per file, the commit interval, and unmounting).
pub const SYNC_IOCTL: u32 = 0xCF << 8 | 0x01;

/// How long the kernel may cache attributes and names.
const TTL: Duration = Duration::from_secs(1);

/// Threads reading and serving the kernel's requests (module doc): enough for several
/// requests at the reactor at once (its batches group their fsyncs) and for a slow one (an
/// fsync) not to hold up the others. Until 2026-12 one session thread handed each request to
/// one of four workers and the reply went back through it: two more thread hops per request,
/// which on a 2-core machine were most of a small request's time.
pub const SESSION_THREADS: usize = 4;

/// Names a `readdir` asks the engine for at a time: more than a page of entries holds.
const READDIR_BATCH: usize = 128;

/// Names a `readdirplus` asks the engine for at a time. A reply carries what fits the
/// kernel's buffer (one page before Linux 6.16, then up to the caller's `getdents` buffer):
/// with attributes an entry takes ~150 bytes, so a 4 KiB page holds ~25 and a 32 KiB
/// buffer ~200; names fetched beyond what fits are fetched again by the next request.
const READDIRPLUS_BATCH: usize = 32;

/// Requests a session thread's reactor client may have in flight: a FUSE request makes its
/// calls one at a time, so a small queue is enough.
const CLIENT_DEPTH: usize = 4;

/// The session threads' reactor clients: a thread takes one for a request and puts it back,
/// so there are never more than [`SESSION_THREADS`] (plus one for `destroy`).
struct Clients(Mutex<Vec<Client>>);

impl Clients {
    fn new(runtime: &Runtime) -> Clients {
        Clients(Mutex::new(
            (0..SESSION_THREADS)
                .map(|_| runtime.client(CLIENT_DEPTH))
                .collect(),
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

pub struct CorefsFuse {
    runtime: Option<Runtime>,
    clients: Clients,
    refs: KernelRefs,
    /// The mount's atime rule, which decides what the kernel may cache across opens.
    atime: engine::Atime,
    /// The session's channel for notifications to the kernel, set once the session runs.
    notifier: std::sync::Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// Opens make no request (the kernel supports it and the mount is noatime): OPEN and
    /// OPENDIR are answered ENOSYS once, after which the kernel opens on its own, keeping
    /// the page cache and caching directory listings.
    zero_message_opens: bool,
    /// The kernel leaves killing privileges to the server (FUSE_HANDLE_KILLPRIV_V2 agreed):
    /// see [`kill_privs`].
    kills_privs: bool,
    /// Set at the first ioctl, which alone is logged (programs probe ioctls by the thousand).
    ioctl_logged: AtomicBool,
}

impl CorefsFuse {
    pub fn new(
        runtime: Runtime,
        atime: engine::Atime,
        notifier: std::sync::Arc<std::sync::OnceLock<fuser::Notifier>>,
    ) -> CorefsFuse {
        CorefsFuse {
            clients: Clients::new(&runtime),
            runtime: Some(runtime),
            refs: KernelRefs::default(),
            atime,
            notifier,
            zero_message_opens: false,
            kills_privs: false,
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
    ReplyIoctl,
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyEmpty,
    ReplyEntry,
    ReplyOpen,
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

// After the macros, which the files below use.
mod convert;
mod refs;
mod session;

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
            None => self.runtime.as_ref().map(|r| r.client(CLIENT_DEPTH)),
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
        let refs = &self.refs;
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

    /// setxattr of the POSIX access ACL. corefs stores no ACLs, but a minimal one (owner,
    /// group and other entries) says no more than a mode does, so it is taken as the chmod it
    /// stands for, as ext4 takes it; any other is EOPNOTSUPP, and the caller falls back to
    /// modes (`cp -a`, `tar`, `rsync -A`). Before, every one was refused and `cp -a` followed
    /// each with a chmod: one request per file copied. The kernel checked that the caller
    /// owns the file. A file with set-group-ID is refused too: chmod's rule for that bit
    /// (cleared unless the caller is in the file's group) is the kernel's, which the chmod
    /// that follows applies. The mode is read and then set in two calls: nothing can change
    /// it in between, since the kernel holds the inode's lock across a SETXATTR as across a
    /// chmod, and nothing but this mount changes the filesystem. The kernel keeps its cached
    /// mode across a SETXATTR, so the
    /// inode's attributes are invalidated before the reply: a permission check right after
    /// must see the new mode, not the cached one for up to [`TTL`].
    fn set_access_acl(&self, ino: INodeNo, value: &[u8], flags: i32, reply: ReplyEmpty) {
        let (Some(bits), 0, Some(notifier)) = (minimal_acl_bits(value), flags, self.notifier.get())
        else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        let engine_ino = to_engine(ino);
        let work = move |c: &mut Client| {
            let s = stat_reply(c, Op::Stat { ino: engine_ino })?;
            if s.mode & libc::S_ISGID != 0 {
                return Err(libc::EOPNOTSUPP);
            }
            let change = SetAttr {
                mode: Some(s.mode & 0o7000 | bits),
                ..SetAttr::default()
            };
            stat_reply(
                c,
                Op::SetAttr {
                    ino: engine_ino,
                    change,
                },
            )?;
            if let Err(e) = notifier.inval_inode(ino, -1, 0) {
                tracing::warn!("invalidating inode {engine_ino}'s attributes: {e}");
            }
            Ok(())
        };
        self.answer(reply, work, |reply, ()| reply.ok());
    }

    /// Replies success or the errno of `op`, which has no result.
    fn reply_empty(&self, op: Op, reply: ReplyEmpty) {
        self.answer(reply, |c| call(c, op), |reply, _| reply.ok());
    }
}

impl Filesystem for CorefsFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let kernel = config.capabilities();
        let wanted = session::INIT_FLAGS;
        let missing = wanted & !kernel;
        if !missing.is_empty() {
            tracing::warn!(
                ?missing,
                "this kernel's FUSE lacks features the mount would use; serving without them"
            );
        }
        // Cannot fail: only flags the kernel offers are asked for.
        let _ = config.add_capabilities(wanted & kernel);
        self.kills_privs = kernel.contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        self.zero_message_opens = self.atime == engine::Atime::Never
            && kernel
                .contains(InitFlags::FUSE_NO_OPEN_SUPPORT | InitFlags::FUSE_NO_OPENDIR_SUPPORT);
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
        let refs = &self.refs;
        let work = move |c: &mut Client| match stat_reply(c, op) {
            Ok(s) => {
                refs.add(c, s.ino)?;
                Ok(Some(s))
            }
            Err(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        };
        self.answer(reply, work, |reply, s| match s {
            Some(s) => reply.entry(&TTL, &attr(&s), Generation(0)),
            // A name that does not exist is answered as a negative entry (inode 0): the
            // kernel then knows for TTL that it is missing, so a program probing for it again
            // (a compiler's include search, a shell's PATH, SQLite's journal check) asks once
            // per TTL, not at every probe. A name made through the mount replaces the
            // negative entry at once, and an exclusive create looks the name up afresh.
            None => reply.entry(&TTL, &negative_entry(), Generation(0)),
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let ino = to_engine(ino);
        let refs = &self.refs;
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
        req: &Request,
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
        let ino = to_engine(ino);
        // A chown of a file and a truncate are where the kernel, under FUSE_HANDLE_KILLPRIV_V2,
        // leaves killing privileges to the server. It says whether the bits go (the caller
        // lacks CAP_FSETID) in a flag fuser does not pass on: a chown always takes them, as
        // the kernel asks; a truncate takes them when the caller is not root.
        let kill = self.kills_privs
            && mode.is_none()
            && (uid.is_some() || gid.is_some() || size.is_some());
        let killer = Killer::of(req, uid.is_some() || gid.is_some(), req.uid() != 0);
        let work = move |c: &mut Client| {
            if kill {
                kill_privs(c, ino, killer)?;
            }
            stat_reply(c, Op::SetAttr { ino, change })
        };
        self.answer(reply, work, |reply, s| reply.attr(&TTL, &attr(&s)));
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

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // The engine has no open state: the inode number is the handle, and the kernel's
        // reference (counted at lookup) keeps an open file's inode.
        if self.zero_message_opens {
            return reply.error(Errno::ENOSYS);
        }
        let atime = self.atime;
        let op = Op::Stat {
            ino: to_engine(ino),
        };
        self.answer(
            reply,
            |c| stat_reply(c, op),
            move |reply, s| reply.opened(FileHandle(0), session::open_flags(atime, &s)),
        );
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
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let len = match engine::file::rw_len(offset, data.len()) {
            Ok(len) => len,
            Err(e) => return reply.error(fuse_errno(errno(&e))),
        };
        let ino = to_engine(ino);
        let op = Op::Write {
            ino,
            offset,
            // Aligned when large, so the device writes from this copy.
            data: engine::Staged::copy_of(&data[..len]),
        };
        let kill = self.kills_privs;
        let without_fsetid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let killer = Killer::of(req, false, without_fsetid);
        let work = move |c: &mut Client| {
            if kill {
                kill_privs(c, ino, killer)?;
            }
            expect!(call(c, op)?, Reply::Written)
        };
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
        if self.zero_message_opens {
            return reply.error(Errno::ENOSYS);
        }
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
        let dir = to_engine(ino);
        self.run(move |c| {
            let mut added = 0usize;
            let walked = walk_dir(c, dir, offset, READDIR_BATCH, |_, entry| {
                added += 1;
                Ok(match entry {
                    Listed::Dot => reply.add(ino, 1, FileType::Directory, "."),
                    Listed::DotDot => reply.add(INodeNo::ROOT, 2, FileType::Directory, ".."),
                    Listed::Named(e) => reply.add(
                        to_fuse(e.ino),
                        e.cookie + 2,
                        kind_of((e.kind as u32) << 12),
                        OsStr::from_bytes(&e.name),
                    ),
                })
            });
            match walked {
                // What was listed before a failure goes; the next call meets it again.
                Err(e) if added == 0 => reply.error(fuse_errno(e)),
                _ => reply.ok(),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        // Each entry but "." and ".." hands the kernel its inode as a lookup would (the kernel
        // counts a lookup for it and makes a dentry that holds its attributes for TTL), so
        // `ls -l`, `find` and `du` stat what they list without one LOOKUP request per name.
        // The kernel links no dentry for "." and ".." and counts no reference: their
        // attributes are only carried.
        let dir = to_engine(ino);
        let refs = &self.refs;
        self.run(move |c| {
            let mut here = None;
            let mut added = 0usize;
            let walked = walk_dir(c, dir, offset, READDIRPLUS_BATCH, |c, entry| {
                let e = match entry {
                    Listed::Dot | Listed::DotDot => {
                        let here = match here {
                            Some(here) => here,
                            None => *here.insert(attr(&stat_reply(c, Op::Stat { ino: dir })?)),
                        };
                        added += 1;
                        return Ok(if matches!(entry, Listed::Dot) {
                            reply.add(ino, 1, ".", &TTL, &here, Generation(0))
                        } else {
                            // ".." shows as the root, as in `readdir` (the entry's inode
                            // number is its attributes').
                            let root = FileAttr {
                                ino: INodeNo::ROOT,
                                ..here
                            };
                            reply.add(INodeNo::ROOT, 2, "..", &TTL, &root, Generation(0))
                        });
                    }
                    Listed::Named(e) => e,
                };
                // The reference first, then the attributes: a name unlinked since the
                // listing whose inode went meanwhile is left out (as if listed after the
                // unlink), and the attributes are the held inode's.
                match refs.add(c, e.ino) {
                    Ok(()) => {}
                    Err(libc::ENOENT) => return Ok(false),
                    Err(errno) => return Err(errno),
                }
                let s = match stat_reply(c, Op::Stat { ino: e.ino }) {
                    Ok(s) => s,
                    Err(errno) => {
                        refs.forget(c, e.ino, 1);
                        return if errno == libc::ENOENT {
                            Ok(false)
                        } else {
                            Err(errno)
                        };
                    }
                };
                let name = OsStr::from_bytes(&e.name);
                let full = reply.add(
                    to_fuse(e.ino),
                    e.cookie + 2,
                    name,
                    &TTL,
                    &attr(&s),
                    Generation(0),
                );
                if full {
                    // The entry did not go, nor does its reference: the kernel asks again
                    // from the last entry it was given.
                    refs.forget(c, e.ino, 1);
                } else {
                    added += 1;
                }
                Ok(full)
            });
            match walked {
                // What was listed before a failure goes (an error would drop the entries
                // whose references are counted); the next call meets the failure again.
                Err(e) if added == 0 => reply.error(fuse_errno(e)),
                _ => reply.ok(),
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
        if name.as_bytes() == ACL_ACCESS {
            return self.set_access_acl(ino, value, flags, reply);
        }
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
        if is_posix_acl(name) {
            return reply.error(Errno::ENODATA);
        }
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
        if is_posix_acl(name) {
            return reply.error(Errno::ENODATA);
        }
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
        let refs = &self.refs;
        let atime = self.atime;
        let kills_privs = self.kills_privs;
        let killer = Killer::of(req, false, req.uid() != 0);
        // One request creates (or, without O_EXCL, opens what a racing create made since the
        // kernel's lookup, as open(2) would) and holds the file for the kernel's reference.
        let how = OpenHow {
            create: Some((mode & !umask & 0o7777, owner)),
            exclusive: flags & libc::O_EXCL != 0,
            writable: flags & libc::O_ACCMODE != libc::O_RDONLY,
            readable: flags & libc::O_ACCMODE != libc::O_WRONLY,
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
                    Reply::Opened(Opened::Created(s)) => {
                        refs.adopt(c, s.ino);
                        return Ok(s);
                    }
                    Reply::Opened(Opened::Found(s)) => {
                        refs.adopt(c, s.ino);
                        // An existing file truncated by the open: as a truncate's setattr.
                        if kills_privs && how.truncate && s.mode & libc::S_IFMT == libc::S_IFREG {
                            let killed = kill_privs(c, s.ino, killer)
                                .and_then(|()| stat_reply(c, Op::Stat { ino: s.ino }));
                            if killed.is_err() {
                                // No reply hands the reference over.
                                refs.forget(c, s.ino, 1);
                            }
                            return killed;
                        }
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
                session::open_flags(atime, &s),
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
        if cmd == SYNC_IOCTL {
            // `corefs sync`: a commit of everything, which sync(2) and syncfs(2) cannot ask
            // for through a FUSE mount (module doc).
            return self.answer(reply, |c| call(c, Op::Sync), |reply, _| reply.ioctl(0, &[]));
        }
        // No other ioctl is supported: ENOTTY, what a kernel filesystem answers to one it
        // does not know. Tools probe ioctls on every file (fsstress, cp's FICLONE), so only
        // the first is logged.
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

/// An entry of a directory listing as [`walk_dir`] hands it out.
enum Listed {
    /// "." (FUSE offset 1).
    Dot,
    /// ".." (FUSE offset 2).
    DotDot,
    /// A name, at FUSE offset `cookie + 2`.
    Named(engine::DirEntry),
}

/// Hands `add` the entries of directory `dir` from FUSE offset `offset` on ("." at 1, ".." at
/// 2, an entry with engine cookie c at c + 2), fetching `batch` names per engine call, until
/// `add` says the reply is full (true) or the names end. A failed call or `add`'s error ends
/// the walk with its errno.
fn walk_dir(
    c: &mut Client,
    dir: u64,
    offset: u64,
    batch: usize,
    mut add: impl FnMut(&mut Client, Listed) -> Result<bool, i32>,
) -> Result<(), i32> {
    if offset == 0 && add(c, Listed::Dot)? {
        return Ok(());
    }
    if offset <= 1 && add(c, Listed::DotDot)? {
        return Ok(());
    }
    let mut cookie = offset.saturating_sub(2);
    loop {
        let op = Op::Readdir {
            dir,
            cookie,
            max: batch,
        };
        let entries = expect!(call(c, op)?, Reply::Entries)?;
        if entries.is_empty() {
            return Ok(());
        }
        for e in entries {
            cookie = e.cookie;
            if add(c, Listed::Named(e))? {
                return Ok(());
            }
        }
    }
}

/// The file capability's extended attribute, which a write, a truncate and a chown remove.
const CAPABILITY_XATTR: &[u8] = b"security.capability";

/// Who asks for a change that kills privileges, as far as the VFS's rules need it.
#[derive(Debug, Clone, Copy)]
struct Killer {
    /// A chown (set-user-ID goes whoever asks), not a write or a truncate.
    chown: bool,
    /// The caller lacks CAP_FSETID: the kernel says so at a write; elsewhere a caller other
    /// than root is taken to lack it.
    without_fsetid: bool,
    /// The caller's gid and process, for whether it is in the file's group.
    gid: u32,
    pid: u32,
}

impl Killer {
    fn of(req: &Request, chown: bool, without_fsetid: bool) -> Killer {
        Killer {
            chown,
            without_fsetid,
            gid: req.gid(),
            pid: req.pid(),
        }
    }

    /// The set-ID bits of `mode` the change takes, as the VFS's `setattr_should_drop_sgid`
    /// and `setattr_should_drop_suidgid` decide: set-user-ID at a chown, or from a caller
    /// without CAP_FSETID; set-group-ID likewise when group execute is set, and without it
    /// (a mandatory-locking mark) only from a caller without CAP_FSETID outside the file's
    /// group.
    fn drops(&self, mode: u32, file_gid: u32) -> u32 {
        if !self.chown && !self.without_fsetid {
            return 0;
        }
        let mut bits = mode & libc::S_ISUID;
        if mode & libc::S_ISGID != 0
            && (mode & libc::S_IXGRP != 0
                || (self.without_fsetid && !in_group(self.gid, self.pid, file_gid)))
        {
            bits |= libc::S_ISGID;
        }
        bits
    }
}

/// Whether a caller (gid `gid`, process `pid`) is in group `file_gid`: its own group, or one
/// of its supplementary groups, which FUSE does not pass and /proc tells. A process gone
/// meanwhile counts as outside (its bits go, the safe side).
fn in_group(gid: u32, pid: u32, file_gid: u32) -> bool {
    if gid == file_gid {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|groups| {
            groups
                .split_whitespace()
                .any(|g| g.parse::<u32>() == Ok(file_gid))
        })
}

/// Kills `ino`'s privileges where the kernel, under FUSE_HANDLE_KILLPRIV_V2, leaves it to the
/// server, as its own VFS would: the file capability goes at every write, truncate and chown
/// of a file; set-user-ID and set-group-ID as [`Killer::drops`] says. Run before the change
/// it belongs to, inside the kernel's request: the kernel holds the inode's lock across a
/// write and a setattr, and nothing else changes this filesystem while it is mounted, so no
/// chmod comes in between. A directory keeps everything (a chown of one kills nothing).
///
/// Why: without the flag the kernel asks for `security.capability` (a GETXATTR request)
/// before every write(2), since FUSE filesystems never get `SB_NOSEC`: two requests per small
/// write. Here the same question is a call or two from memory, usually in the session thread
/// (a stat only when set-ID bits may go).
fn kill_privs(c: &mut Client, ino: u64, killer: Killer) -> Result<(), i32> {
    let stat = if killer.chown || killer.without_fsetid {
        let s = stat_reply(c, Op::Stat { ino })?;
        if s.mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(());
        }
        Some(s)
    } else {
        None
    };
    let name = CAPABILITY_XATTR.to_vec();
    match call(
        c,
        Op::GetXattr {
            ino,
            name: name.clone(),
        },
    ) {
        Ok(_) => {
            call(c, Op::RemoveXattr { ino, name })?;
        }
        Err(libc::ENODATA) => {}
        Err(e) => return Err(e),
    }
    let Some(s) = stat else {
        return Ok(());
    };
    let bits = killer.drops(s.mode, s.gid);
    if bits != 0 {
        let change = SetAttr {
            mode: Some(s.mode & 0o7777 & !bits),
            ..SetAttr::default()
        };
        call(c, Op::SetAttr { ino, change })?;
    }
    Ok(())
}
