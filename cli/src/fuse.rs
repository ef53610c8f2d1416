//! `corefs mount`: serves a corefs filesystem at a mountpoint through FUSE (the `fuser` crate,
//! no libfuse), so unmodified programs can use it. Every request becomes one reactor
//! operation through the client API, and the reply carries the engine's errno.
//!
//! Mapping: FUSE's root inode 1 is the engine's root ([`ROOT_INO`]); every other inode number
//! is the engine's own. fsync and fsyncdir go to the engine's fsync (or fdatasync when the
//! kernel asks for datasync): one log record and one flush. flush (close) and release need no
//! I/O: durability is what fsync asks for, as on a kernel filesystem. Unmounting (`umount`,
//! `fusermount3 -u`) ends the session; the reactor then commits and unmounts, so everything
//! written is durable after a clean unmount.
//!
//! Invariants: the kernel caches attributes and entries for [`TTL`] only (1 s), because the
//! filesystem may be changed through no other path while mounted, but the kernel's own
//! caches must not outlive an operation's effect by much. The session thread decodes each
//! request and queues it (bounded: [`QUEUE_DEPTH`]) to one of [`WORKERS`] worker threads,
//! each with its own reactor client, which makes the reactor call and replies; so requests of
//! different callers are at the reactor together (their fsyncs share records) and one slow
//! request does not stall the others. Requests one caller makes in sequence stay in sequence,
//! since the caller waits for each reply.

use engine::inode::ROOT_INO;
use engine::{EngineError, FallocateMode, RenameFlags, SetAttr, Stat, XattrFlags};
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, TimeOrNow, FUSE_ROOT_ID,
};
use reactor::{Client, Op, Reply, Runtime};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the kernel may cache attributes and names.
const TTL: Duration = Duration::from_secs(1);

/// Worker threads serving requests: the session thread only decodes a request and queues it,
/// so several requests are at the reactor at once (its batches group their fsyncs) and a slow
/// one (an fsync) does not hold up the others.
pub const WORKERS: usize = 4;
/// Requests queued for the workers before the session thread waits (backpressure).
const QUEUE_DEPTH: usize = 64;

type Job = Box<dyn FnOnce(&mut Client) + Send>;

/// A fixed pool of workers, each with its own reactor client.
struct Pool {
    jobs: Option<std::sync::mpsc::SyncSender<Job>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    fn new(runtime: &Runtime) -> Pool {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(QUEUE_DEPTH);
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let workers = (0..WORKERS)
            .map(|i| {
                let rx = rx.clone();
                let mut client = runtime.client(4);
                std::thread::Builder::new()
                    .name(format!("corefs-fuse-{i}"))
                    .spawn(move || loop {
                        // The lock is held only to take one job.
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        match job {
                            // A panic fails this request alone (its reply, dropped while
                            // unwinding, answers EIO) and the worker serves on.
                            Ok(job) => {
                                let ran =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        job(&mut client)
                                    }));
                                if let Err(panic) = ran {
                                    tracing::error!(
                                        "FUSE request panicked: {}",
                                        reactor::panic_message(&*panic)
                                    );
                                }
                            }
                            Err(_) => return, // the session ended
                        }
                    })
                    .expect("starting a FUSE worker thread")
            })
            .collect();
        Pool {
            jobs: Some(tx),
            workers,
        }
    }

    /// Queues `job`; it replies to the kernel itself.
    fn run(&self, job: impl FnOnce(&mut Client) + Send + 'static) {
        if let Some(jobs) = &self.jobs {
            // Fails only once the workers are gone, after `stop`: the reply is then dropped,
            // which fuser answers with EIO.
            let _ = jobs.send(Box::new(job));
        }
    }

    /// Lets the workers finish what is queued, then joins them.
    fn stop(&mut self) {
        self.jobs = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

pub struct CorefsFuse {
    runtime: Option<Runtime>,
    pool: Pool,
}

impl CorefsFuse {
    pub fn new(runtime: Runtime) -> CorefsFuse {
        let pool = Pool::new(&runtime);
        CorefsFuse {
            runtime: Some(runtime),
            pool,
        }
    }
}

fn call(client: &mut Client, op: Op) -> Result<Reply, i32> {
    client.call(op).map_err(|e| errno(&e))
}

fn stat_reply(client: &mut Client, op: Op) -> Result<Stat, i32> {
    match call(client, op)? {
        Reply::Stat(s) => Ok(s),
        _ => Err(libc::EIO),
    }
}

/// Replies with the inode an operation returns (lookup, mkdir, symlink, link).
fn reply_entry(client: &mut Client, op: Op, reply: ReplyEntry) {
    match stat_reply(client, op) {
        Ok(s) => reply.entry(&TTL, &attr(&s), 0),
        Err(e) => reply.error(e),
    }
}

/// Replies with the attributes an operation returns (getattr, setattr).
fn reply_attr(client: &mut Client, op: Op, reply: ReplyAttr) {
    match stat_reply(client, op) {
        Ok(s) => reply.attr(&TTL, &attr(&s)),
        Err(e) => reply.error(e),
    }
}

/// Replies success or the errno of an operation with no result.
fn reply_empty(client: &mut Client, op: Op, reply: ReplyEmpty) {
    match call(client, op) {
        Ok(_) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn errno(e: &EngineError) -> i32 {
    match e.errno() {
        0 => libc::EIO,
        n => n,
    }
}

/// The inode owner a FUSE request creates with: the calling process's user and group, as
/// the kernel passes them.
fn owner_of(req: &Request<'_>) -> reactor::Owner {
    reactor::Owner {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn to_engine(ino: u64) -> u64 {
    if ino == FUSE_ROOT_ID {
        ROOT_INO
    } else {
        ino
    }
}

fn to_fuse(ino: u64) -> u64 {
    if ino == ROOT_INO {
        FUSE_ROOT_ID
    } else {
        ino
    }
}

fn time_of(sec: i64, nsec: u32) -> SystemTime {
    if sec >= 0 {
        UNIX_EPOCH + Duration::new(sec as u64, nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(sec.unsigned_abs()) + Duration::from_nanos(nsec as u64)
    }
}

fn timespec(t: TimeOrNow) -> engine::format::items::Timespec {
    let t = match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    };
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => engine::format::items::Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => engine::format::items::Timespec {
            sec: -(e.duration().as_secs() as i64),
            nsec: 0,
        },
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
        atime: time_of(s.atime.sec, s.atime.nsec),
        mtime: time_of(s.mtime.sec, s.mtime.nsec),
        ctime: time_of(s.ctime.sec, s.ctime.nsec),
        crtime: time_of(s.ctime.sec, s.ctime.nsec),
        kind: kind_of(s.mode),
        perm: (s.mode & 0o7777) as u16,
        nlink: s.nlink,
        uid: s.uid,
        gid: s.gid,
        rdev: s.rdev as u32,
        blksize: 4096,
        flags: 0,
    }
}

impl Filesystem for CorefsFuse {
    fn init(&mut self, _req: &Request<'_>, _config: &mut KernelConfig) -> Result<(), i32> {
        Ok(())
    }

    fn destroy(&mut self) {
        self.pool.stop();
        if let Some(runtime) = self.runtime.take() {
            match runtime.shutdown() {
                Ok(stats) => tracing::info!(
                    ops = stats.ops,
                    commits = stats.commit.commits,
                    log_writes = stats.log.log_writes,
                    "unmounted: committed"
                ),
                Err(e) => tracing::error!("unmount: {e}"),
            }
        }
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let op = Op::Lookup {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.pool.run(move |c| reply_entry(c, op, reply));
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        let op = Op::Stat {
            ino: to_engine(ino),
        };
        self.pool.run(move |c| reply_attr(c, op, reply));
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let change = SetAttr {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(timespec),
            mtime: mtime.map(timespec),
        };
        let op = Op::SetAttr {
            ino: to_engine(ino),
            change,
        };
        self.pool.run(move |c| reply_attr(c, op, reply));
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        let op = Op::Readlink {
            ino: to_engine(ino),
        };
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Data(d)) => reply.data(&d),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn mkdir(
        &mut self,
        req: &Request<'_>,
        parent: u64,
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
        self.pool.run(move |c| reply_entry(c, op, reply));
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::Unlink {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::Rmdir {
            dir: to_engine(parent),
            name: name.as_bytes().to_vec(),
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn symlink(
        &mut self,
        req: &Request<'_>,
        parent: u64,
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
        self.pool.run(move |c| reply_entry(c, op, reply));
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        let known = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
        if flags & !known != 0 {
            return reply.error(libc::EINVAL);
        }
        let op = Op::Rename {
            from_dir: to_engine(parent),
            from: name.as_bytes().to_vec(),
            to_dir: to_engine(newparent),
            to: newname.as_bytes().to_vec(),
            flags: RenameFlags {
                noreplace: flags & libc::RENAME_NOREPLACE != 0,
                exchange: flags & libc::RENAME_EXCHANGE != 0,
            },
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn link(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        newparent: u64,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let op = Op::Link {
            ino: to_engine(ino),
            dir: to_engine(newparent),
            name: newname.as_bytes().to_vec(),
        };
        self.pool.run(move |c| reply_entry(c, op, reply));
    }

    fn open(&mut self, _req: &Request<'_>, _ino: u64, _flags: i32, reply: ReplyOpen) {
        // The engine has no open state: the inode number is the handle.
        reply.opened(0, 0);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        if offset < 0 {
            return reply.error(libc::EINVAL);
        }
        // The kernel bounds `size` by max_read, but `offset + size` may still pass i64::MAX.
        let len = match engine::file::rw_len(offset as u64, size as usize) {
            Ok(len) => len,
            Err(e) => return reply.error(errno(&e)),
        };
        let op = Op::Read {
            ino: to_engine(ino),
            offset: offset as u64,
            len,
        };
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Data(d)) => reply.data(&d),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        if offset < 0 {
            return reply.error(libc::EINVAL);
        }
        let len = match engine::file::rw_len(offset as u64, data.len()) {
            Ok(len) => len,
            Err(e) => return reply.error(errno(&e)),
        };
        let op = Op::Write {
            ino: to_engine(ino),
            offset: offset as u64,
            data: data[..len].to_vec(),
        };
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Written(n)) => reply.written(n as u32),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn flush(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _lock_owner: u64,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, datasync: bool, reply: ReplyEmpty) {
        let ino = to_engine(ino);
        let op = if datasync {
            Op::Fdatasync { ino }
        } else {
            Op::Fsync { ino }
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn opendir(&mut self, _req: &Request<'_>, _ino: u64, _flags: i32, reply: ReplyOpen) {
        reply.opened(0, 0);
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        // Offsets: 1 is ".", 2 is "..", and an entry with engine cookie c is c + 2.
        let dir = to_engine(ino);
        self.pool.run(move |c| {
            let mut offset = offset.max(0) as u64;
            if offset == 0 {
                if reply.add(ino, 1, FileType::Directory, ".") {
                    return reply.ok();
                }
                offset = 1;
            }
            if offset == 1 {
                if reply.add(FUSE_ROOT_ID, 2, FileType::Directory, "..") {
                    return reply.ok();
                }
                offset = 2;
            }
            let mut cookie = offset - 2;
            loop {
                let entries = match call(
                    c,
                    Op::Readdir {
                        dir,
                        cookie,
                        max: 128,
                    },
                ) {
                    Ok(Reply::Entries(e)) => e,
                    Ok(_) => return reply.error(libc::EIO),
                    Err(e) => return reply.error(e),
                };
                if entries.is_empty() {
                    return reply.ok();
                }
                for e in entries {
                    let kind = kind_of((e.kind as u32) << 12);
                    if reply.add(
                        to_fuse(e.ino),
                        (e.cookie + 2) as i64,
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
        &mut self,
        req: &Request<'_>,
        ino: u64,
        fh: u64,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.fsync(req, ino, fh, datasync, reply);
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let op = Op::Statfs;
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Statfs(s)) => reply.statfs(
                s.total_blocks,
                s.free_blocks,
                s.free_blocks,
                s.inodes.saturating_add(s.free_inodes),
                s.free_inodes,
                s.block_bytes,
                s.name_max,
                s.block_bytes,
            ),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn setxattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        // POSIX ACLs are not supported: refusing them makes cp -a, tar and rsync fall back
        // to chmod, instead of storing an ACL whose mode bits nothing would apply.
        if name.as_bytes().starts_with(b"system.posix_acl_") {
            return reply.error(libc::EOPNOTSUPP);
        }
        let flags = match flags {
            0 => XattrFlags::Any,
            libc::XATTR_CREATE => XattrFlags::Create,
            libc::XATTR_REPLACE => XattrFlags::Replace,
            _ => return reply.error(libc::EINVAL),
        };
        let op = Op::SetXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
            value: value.to_vec(),
            flags,
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn getxattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        let op = Op::GetXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
        };
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Data(d)) => xattr_reply(reply, &d, size),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn listxattr(&mut self, _req: &Request<'_>, ino: u64, size: u32, reply: ReplyXattr) {
        let op = Op::ListXattr {
            ino: to_engine(ino),
        };
        self.pool.run(move |c| match call(c, op) {
            Ok(Reply::Names(names)) => {
                let mut list = Vec::new();
                for n in names {
                    list.extend_from_slice(&n);
                    list.push(0);
                }
                xattr_reply(reply, &list, size)
            }
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        });
    }

    fn removexattr(&mut self, _req: &Request<'_>, ino: u64, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::RemoveXattr {
            ino: to_engine(ino),
            name: name.as_bytes().to_vec(),
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }

    fn create(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let dir = to_engine(parent);
        let name = name.as_bytes().to_vec();
        let owner = owner_of(req);
        // The kernel sends O_CREAT without O_EXCL here only when the name did not exist at
        // its lookup; a racing create found in between is opened, as open(2) would.
        self.pool.run(move |c| {
            let made = stat_reply(
                c,
                Op::Create {
                    dir,
                    name: name.clone(),
                    mode: mode & !umask & 0o7777,
                    owner,
                },
            );
            let stat = match made {
                Err(libc::EEXIST) if flags & libc::O_EXCL == 0 => {
                    stat_reply(c, Op::Lookup { dir, name })
                }
                other => other,
            };
            match stat {
                Ok(s) => reply.created(&TTL, &attr(&s), 0, 0, 0),
                Err(e) => reply.error(e),
            }
        });
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let known =
            libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if offset < 0 || length <= 0 || mode & !known != 0 {
            return reply.error(if mode & !known != 0 {
                libc::EOPNOTSUPP
            } else {
                libc::EINVAL
            });
        }
        let op = Op::Fallocate {
            ino: to_engine(ino),
            mode: FallocateMode {
                keep_size: mode & libc::FALLOC_FL_KEEP_SIZE != 0,
                punch_hole: mode & libc::FALLOC_FL_PUNCH_HOLE != 0,
                zero_range: mode & libc::FALLOC_FL_ZERO_RANGE != 0,
            },
            offset: offset as u64,
            len: length as u64,
        };
        self.pool.run(move |c| reply_empty(c, op, reply));
    }
}

/// getxattr/listxattr's two-step protocol: size 0 asks for the length.
fn xattr_reply(reply: ReplyXattr, data: &[u8], size: u32) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(libc::ERANGE);
    } else {
        reply.data(data);
    }
}

/// Mounts `runtime`'s filesystem at `mountpoint` and serves it until unmounted.
pub fn serve(runtime: Runtime, mountpoint: &Path) -> std::io::Result<()> {
    // Default permissions: the kernel checks modes against the caller, as for a kernel
    // filesystem (the engine stores modes and owners but does not check them).
    let options = [
        fuser::MountOption::FSName("corefs".into()),
        fuser::MountOption::Subtype("corefs".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    fuser::mount2(CorefsFuse::new(runtime), mountpoint, &options)
}
