//! Open files: open and release, reads and writes, fsync and fdatasync, atomic batches, sync,
//! truncate and fallocate.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// Opens (and with COREFS_O_CREAT creates) `path`, relative to the root (see "Paths" in
/// the header's introduction). Returns a file handle or a negative errno.
///
/// The handle keeps its file: after the file's last name is gone (unlink, rename over it)
/// reads, writes, fsync and fstat (nlink 0) go on working until `corefs_release`, which
/// deletes it; a crash before that leaves it to the next mount, which deletes it.
///
/// As open(2): COREFS_O_CREAT without COREFS_O_EXCL opens the file if it exists (also when
/// another thread creates it at the same time); COREFS_O_CREAT on a directory, or on a path
/// ending in `/`, is -EISDIR (-EEXIST with COREFS_O_EXCL on a directory); a path ending in
/// `/` opens only a directory (-ENOTDIR); COREFS_O_CREAT with COREFS_O_DIRECTORY is -EINVAL
/// (as Linux since 6.4); a symbolic link is -ELOOP (corefs never follows one: open(2) with
/// O_NOFOLLOW). Writes through a COREFS_O_APPEND handle are atomic appends. The new
/// file's owner is the caller's (see `corefs_set_owner`). One request to the reactors
/// whatever the flags, for a path of plain names (no `.` or `..`).
///
/// # Safety
/// `path` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_open(
    fs: corefs_fs,
    path: *const c_char,
    flags: c_int,
    mode: u32,
) -> corefs_fd {
    guard("corefs_open", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        let known = COREFS_O_WRONLY
            | COREFS_O_RDWR
            | COREFS_O_CREAT
            | COREFS_O_EXCL
            | COREFS_O_TRUNC
            | COREFS_O_APPEND
            | COREFS_O_DIRECTORY;
        if flags & !known != 0 || flags & 3 == 3 {
            return Err(einval(format!("unsupported open flags {flags:#o}")));
        }
        // Linux (since 6.4) refuses O_CREAT with O_DIRECTORY before it looks at the path.
        if flags & COREFS_O_CREAT != 0 && flags & COREFS_O_DIRECTORY != 0 {
            return Err(einval("O_CREAT with O_DIRECTORY".into()));
        }
        let writable = flags & 3 != COREFS_O_RDONLY;
        let how = OpenHow {
            create: (flags & COREFS_O_CREAT != 0).then(|| (mode & 0o7777, handles::owner(&fs))),
            exclusive: flags & COREFS_O_EXCL != 0,
            writable,
            readable: flags & 3 != COREFS_O_WRONLY,
            truncate: flags & COREFS_O_TRUNC != 0,
            directory: flags & COREFS_O_DIRECTORY != 0,
        };
        // The reactor opens an inode by number only while it exists: one found by its name
        // can lose that name and go before the open reaches it (another thread's unlink, a
        // path with `..` walked here, an inode another reactor holds). Then the open starts
        // over, as if it had come after that unlink.
        for _ in 0..OPEN_ATTEMPTS {
            let stat = match call(&fs, open_request(&fs, path, how)?) {
                Ok(Reply::Opened(Opened::Found(stat) | Opened::Created(stat))) => stat,
                Ok(Reply::Opened(Opened::Gone)) => continue,
                Ok(other) => return Err(unexpected(other)),
                Err(e) => return Err(e.about(path)),
            };
            return Ok(handles::enter_file(
                &fs,
                OpenFile {
                    ino: stat.ino,
                    dir: stat.is_dir(),
                    readable: how.readable,
                    writable,
                    append: flags & COREFS_O_APPEND != 0,
                },
            ));
        }
        Err(Error::new(
            libc::ENOENT,
            format!(
                "{}: removed by others {OPEN_ATTEMPTS} times while opening",
                show(path)
            ),
        ))
    })
}

/// Times an open starts over when what it found vanishes under it (each time another
/// thread removed the name in between): bounded, so a storm of such races ends in ENOENT.
const OPEN_ATTEMPTS: u32 = 16;

/// The one request that opens `path` ([`Op::Open`]): the reactor walks a path of plain
/// names itself; a path with `.` or `..` is walked here first, a lookup per component.
fn open_request(fs: &Fs, path: &[u8], mut how: OpenHow) -> Result<Op, Error> {
    let parsed = path::parse(path)?;
    if parsed.trailing_slash {
        if how.create.is_some() {
            return Err(Error::new(
                libc::EISDIR,
                format!("{}: O_CREAT with a trailing slash", show(path)),
            ));
        }
        how.directory = true;
    }
    if let Some((dirs, last)) = path::plain_entry(&parsed.parts) {
        let open = Op::Open {
            dir: 0,
            name: last.to_vec(),
            how,
        };
        return Ok(walk(&dirs, open));
    }
    if how.create.is_some() {
        let e = entry(fs, path)?;
        let name = e.name(|_| {
            // `/`, `.` and `..` are directories, which exist.
            if how.exclusive {
                Error::new(libc::EEXIST, format!("{} exists", show(path)))
            } else {
                Error::new(libc::EISDIR, format!("{} is a directory", show(path)))
            }
        })?;
        return Ok(Op::Open {
            dir: e.dir,
            name: name.to_vec(),
            how,
        });
    }
    Ok(Op::Open {
        dir: resolve(fs, path)?.ino,
        name: Vec::new(),
        how,
    })
}

/// `corefs_setlk` and `corefs_testlk` kinds (Linux's F_RDLCK, F_WRLCK, F_UNLCK).
pub const COREFS_LOCK_READ: c_int = 0;
pub const COREFS_LOCK_WRITE: c_int = 1;
pub const COREFS_LOCK_UNLOCK: c_int = 2;

fn lock_kind(kind: c_int) -> Result<crate::locks::Kind, Error> {
    use crate::locks::Kind;
    match kind {
        COREFS_LOCK_READ => Ok(Kind::Read),
        COREFS_LOCK_WRITE => Ok(Kind::Write),
        COREFS_LOCK_UNLOCK => Ok(Kind::Unlock),
        other => Err(einval(format!(
            "lock kind {other}: use COREFS_LOCK_READ, COREFS_LOCK_WRITE or COREFS_LOCK_UNLOCK"
        ))),
    }
}

/// A byte-range lock on the file behind `fd`, or the question whether it could be taken.
fn lock_call(
    fs: &Fs,
    fd: corefs_fd,
    kind: c_int,
    start: u64,
    len: u64,
    test: bool,
) -> Result<(), Error> {
    use crate::locks::{Kind, Refused};
    let kind = lock_kind(kind)?;
    let f = file(fs, fd)?;
    // As fcntl(2): taking a lock needs the descriptor open for it; asking does not.
    if !test && (kind == Kind::Read && !f.readable || kind == Kind::Write && !f.writable) {
        return Err(Error::new(
            libc::EBADF,
            format!("{fd} is not open for the lock's kind ({kind:?})"),
        ));
    }
    if fs.remote.is_some() {
        return match with_client(fs, |c| {
            let remote = c.remote().expect("a service filesystem's client");
            remote.lock(f.ino, kind, start, len, test)
        })? {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::from(e)),
        };
    }
    let mut locks = fs.locks.lock().unwrap_or_else(|p| p.into_inner());
    let refused = if test {
        locks.test(f.ino, fs.id as u64, kind, start, len)
    } else {
        locks.set(f.ino, fs.id as u64, kind, start, len).err()
    };
    match refused {
        None => Ok(()),
        Some(Refused::Conflict { .. }) => Err(Error::new(
            libc::EAGAIN,
            format!("{fd}: a conflicting lock is held"),
        )),
        Some(Refused::Full) => Err(Error::new(libc::ENOLCK, "too many lock ranges".into())),
    }
}

/// Takes (COREFS_LOCK_READ, COREFS_LOCK_WRITE) or gives back (COREFS_LOCK_UNLOCK) an
/// advisory lock over `len` bytes at `start` of the file behind `fd` (`len` 0: to the end of
/// the file, however it grows), as fcntl(2)'s F_SETLK: never waits; -EAGAIN when another
/// owner holds a conflicting lock (a write lock conflicts with any lock, a read lock with a
/// write lock). The owner is this process's filesystem handle (every thread's locks are
/// one owner's, as POSIX locks are a process's); taking a lock over one's own replaces it
/// (read to write and back), unlocking part of a range keeps the rest. Locks go with their
/// owner: at `corefs_close`, and through a server (`corefs_connect`) when this process's
/// connection closes, so a killed process holds none. A read lock needs `fd` open for
/// reading, a write lock for writing (-EBADF). Through a server, locks reach across every
/// process connected to it: what SQLite's locking needs.
#[no_mangle]
pub extern "C" fn corefs_setlk(
    fs: corefs_fs,
    fd: corefs_fd,
    kind: c_int,
    start: u64,
    len: u64,
) -> c_int {
    status("corefs_setlk", || {
        let fs = fs_of(fs)?;
        lock_call(&fs, fd, kind, start, len, false)
    })
}

/// Whether `corefs_setlk` with these arguments would take its lock now, without taking it
/// (fcntl(2)'s F_GETLK): 0 when it would, 1 when another owner's lock is in the way, a
/// negative errno for bad arguments.
#[no_mangle]
pub extern "C" fn corefs_testlk(
    fs: corefs_fs,
    fd: corefs_fd,
    kind: c_int,
    start: u64,
    len: u64,
) -> c_int {
    guard("corefs_testlk", || {
        let fs = fs_of(fs)?;
        match lock_call(&fs, fd, kind, start, len, true) {
            Ok(()) => Ok(0),
            Err(e) if e.errno == libc::EAGAIN => Ok(1),
            Err(e) => Err(e),
        }
    }) as c_int
}

/// Closes a file handle (its data stays where it is: fsync first to make it durable). The
/// last handle of a file with no name left deletes it; asynchronous operations submitted
/// through the handle and not yet polled keep the file until the last of them is polled
/// (their completions report what they did, not -ENOENT).
#[no_mangle]
pub extern "C" fn corefs_release(fs: corefs_fs, fd: corefs_fd) -> c_int {
    status("corefs_release", || {
        let fs = fs_of(fs)?;
        // Returns once no call still uses the handle (see handles' module doc).
        // An open atomic batch goes with its handle, uncommitted.
        let removed = handles::remove_file(&fs, fd)?;
        // Asynchronous operations still in flight hold the file: the last one's poll
        // releases it ([`handles::InFlight`]).
        if !removed.in_flight.release() {
            return Ok(());
        }
        // The handle is gone whatever this says, as after close(2).
        with_client(&fs, |c| c.release(removed.file.ino))?.map_err(Error::from)
    })
}

/// Reads up to `len` bytes at `offset`. Returns the bytes read (0 at end of file). As
/// pread(2): at most 0x7ffff000 bytes per call, and `offset + len` past INT64_MAX is -EINVAL.
///
/// # Safety
/// `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_pread(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *mut u8,
    len: usize,
    offset: u64,
) -> i64 {
    guard("corefs_pread", || {
        let fs = fs_of(fs)?;
        let f = regular(&fs, fd)?;
        need_readable(&f, fd)?;
        let len = io_len(offset, len)?;
        // SAFETY: forwarded from this function's contract (`len` only shrank).
        let out = unsafe { bytes_mut(buf, len, "buf") }?;
        let read = with_client(&fs, |c| c.read_into(f.ino, offset, out))?;
        let n = read.map_err(Error::from)?;
        // Through a handle with an atomic batch open, the batch's writes are read back (SQLite
        // reads pages it wrote); at most `len` bytes.
        let overlaid = f.batch().with(|batch| {
            let mut data = out[..n].to_vec();
            batch.overlay(offset, len, &mut data);
            data
        });
        match overlaid {
            Some(data) => {
                out[..data.len()].copy_from_slice(&data);
                Ok(data.len() as i64)
            }
            None => Ok(n as i64),
        }
    })
}

/// Writes `len` bytes at `offset`. Returns `len`, or as pwrite(2) 0x7ffff000 for a longer
/// write (it writes that much); `offset + len` past INT64_MAX is -EINVAL. Through a
/// COREFS_O_APPEND handle the write goes at the end of the file, whatever `offset` says (as
/// Linux's pwrite(2) does), atomically: two appenders never write over each other.
///
/// # Safety
/// `buf` is valid for reading `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_pwrite(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *const u8,
    len: usize,
    offset: u64,
) -> i64 {
    guard("corefs_pwrite", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        // An append's offset is the end of file, which the engine bounds.
        let len = io_len(if f.append { 0 } else { offset }, len)?;
        // SAFETY: forwarded from this function's contract (`len` only shrank).
        let data = unsafe { bytes(buf, len, "buf") }?;
        // Staged, not written, while an atomic batch is open on the handle.
        if let Some(staged) = f.batch().with(|batch| batch.stage(offset, data)) {
            return staged.map(|()| len as i64).map_err(Error::from);
        }
        let reply = with_client(&fs, |c| c.write_from(f.ino, offset, f.append, data))?
            .map_err(Error::from)?;
        expect_reply!(reply, Reply::Written(n) | Reply::Appended { written: n, .. } => n as i64)
    })
}

/// The handle `fd` if it is a regular file open for writing (ftruncate(2) and fallocate(2)
/// on a read-only descriptor are EBADF).
pub(super) fn writable(fs: &Fs, fd: corefs_fd) -> Result<FileRef, Error> {
    let f = regular(fs, fd)?;
    if !f.writable {
        return Err(Error::new(
            libc::EBADF,
            format!("{fd} is not open for writing"),
        ));
    }
    Ok(f)
}

/// fsync(2) of `ino`, or fdatasync(2) when `datasync`.
pub(super) fn sync_op(ino: u64, datasync: bool) -> Op {
    if datasync {
        Op::Fdatasync { ino }
    } else {
        Op::Fsync { ino }
    }
}

fn sync_fd(name: &str, fs: corefs_fs, fd: corefs_fd, datasync: bool) -> c_int {
    status(name, || {
        let fs = fs_of(fs)?;
        let f = file(&fs, fd)?;
        call(&fs, sync_op(f.ino, datasync)).map(drop)
    })
}

/// Makes the file's data and metadata, its names and the path to it durable (one log record
/// and one flush; see docs/durability.md). Works on directories too (their entries).
#[no_mangle]
pub extern "C" fn corefs_fsync(fs: corefs_fs, fd: corefs_fd) -> c_int {
    sync_fd("corefs_fsync", fs, fd, false)
}

/// As `corefs_fsync`, skipping a change of timestamps alone.
#[no_mangle]
pub extern "C" fn corefs_fdatasync(fs: corefs_fs, fd: corefs_fd) -> c_int {
    sync_fd("corefs_fdatasync", fs, fd, true)
}

/// -EINVAL when an atomic batch is open on the handle: the calls that would mix with it
/// (truncate, fallocate, the asynchronous reads and writes) wait for its commit or abort.
pub(super) fn no_batch(f: &FileRef, fd: corefs_fd) -> Result<(), Error> {
    if f.batch().is_open() {
        return Err(einval(format!(
            "an atomic batch is open on {fd}: commit or abort it first"
        )));
    }
    Ok(())
}

/// Opens an atomic batch on a regular file handle open for writing (not COREFS_O_APPEND):
/// from here until `corefs_atomic_commit` or `corefs_atomic_abort`, `corefs_pwrite` through
/// this handle stages its bytes in memory instead of writing them. Reads (`corefs_pread`) and
/// `corefs_fstat`'s size through this handle see the staged writes; other handles and a crash
/// do not. A batch holds at most 64 MiB in at most 65,536 disjoint ranges: a `corefs_pwrite`
/// past that is -EFBIG and stages nothing (abort, and write without a batch). While it is
/// open, `corefs_ftruncate`, `corefs_fallocate` and the asynchronous reads and writes of this
/// handle are -EINVAL. What F2FS's atomic-write ioctls give SQLite (docs/fsync-log.md).
///
/// -EBADF: not an open handle, or not open for writing; -EISDIR: a directory; -EINVAL: a
/// batch is open on this handle already, or it is an append handle.
#[no_mangle]
pub extern "C" fn corefs_atomic_begin(fs: corefs_fs, fd: corefs_fd) -> c_int {
    status("corefs_atomic_begin", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        if f.append {
            return Err(einval(format!(
                "{fd} is an append handle: an atomic batch writes at offsets"
            )));
        }
        if !f.batch().begin() {
            return Err(einval(format!("an atomic batch is open on {fd} already")));
        }
        Ok(())
    })
}

/// Commits the handle's atomic batch: applies every staged write and makes all of them
/// durable together — one fsync log record, or a transaction commit when the record does not
/// fit the log — and returns once they are. A crash before it returns leaves none of them, or
/// all; after, all. Also makes the file durable as `corefs_fsync` does. The batch is closed
/// whatever this returns; on an error none of it was acknowledged (-ENOSPC: none applied; an
/// I/O error fails the filesystem stop, its durable state without the batch).
///
/// -EBADF: not an open handle; -EINVAL: no batch open on it.
#[no_mangle]
pub extern "C" fn corefs_atomic_commit(fs: corefs_fs, fd: corefs_fd) -> c_int {
    status("corefs_atomic_commit", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        let mut batch = f
            .batch()
            .take()
            .ok_or_else(|| einval(format!("no atomic batch is open on {fd}")))?;
        let writes = batch.take_writes();
        call(&fs, Op::WriteAtomic { ino: f.ino, writes }).map(drop)
    })
}

/// Drops the handle's atomic batch: nothing staged is written.
///
/// -EBADF: not an open handle; -EINVAL: no batch open on it.
#[no_mangle]
pub extern "C" fn corefs_atomic_abort(fs: corefs_fs, fd: corefs_fd) -> c_int {
    status("corefs_atomic_abort", || {
        let fs = fs_of(fs)?;
        file(&fs, fd)?
            .batch()
            .take()
            .map(drop)
            .ok_or_else(|| einval(format!("no atomic batch is open on {fd}")))
    })
}

/// Commits everything (returns when the superblock is durable).
#[no_mangle]
pub extern "C" fn corefs_sync(fs: corefs_fs) -> c_int {
    status("corefs_sync", || call(&*fs_of(fs)?, Op::Sync).map(drop))
}

/// Sets the file's size.
#[no_mangle]
pub extern "C" fn corefs_ftruncate(fs: corefs_fs, fd: corefs_fd, size: u64) -> c_int {
    status("corefs_ftruncate", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        no_batch(&f, fd)?;
        call(&fs, Op::Truncate { ino: f.ino, size }).map(drop)
    })
}

/// Allocates (mode 0 or COREFS_FALLOC_KEEP_SIZE), punches (COREFS_FALLOC_PUNCH_HOLE |
/// COREFS_FALLOC_KEEP_SIZE) or zeroes (COREFS_FALLOC_ZERO_RANGE) a range. As fallocate(2):
/// -EBADF through a handle not open for writing, -EINVAL for a zero length, -EFBIG for a
/// range past the largest file, -EOPNOTSUPP for a punch without COREFS_FALLOC_KEEP_SIZE or
/// a mode bit corefs does not know.
#[no_mangle]
pub extern "C" fn corefs_fallocate(
    fs: corefs_fs,
    fd: corefs_fd,
    mode: c_int,
    offset: u64,
    len: u64,
) -> c_int {
    status("corefs_fallocate", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        no_batch(&f, fd)?;
        let known = COREFS_FALLOC_KEEP_SIZE | COREFS_FALLOC_PUNCH_HOLE | COREFS_FALLOC_ZERO_RANGE;
        if mode & !known != 0 {
            return Err(Error::new(
                libc::EOPNOTSUPP,
                format!("unsupported fallocate mode {mode:#x}"),
            ));
        }
        let mode = FallocateMode {
            keep_size: mode & COREFS_FALLOC_KEEP_SIZE != 0,
            punch_hole: mode & COREFS_FALLOC_PUNCH_HOLE != 0,
            zero_range: mode & COREFS_FALLOC_ZERO_RANGE != 0,
        };
        call(
            &fs,
            Op::Fallocate {
                ino: f.ino,
                mode,
                offset,
                len,
            },
        )
        .map(drop)
    })
}
