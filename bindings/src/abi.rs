//! The C ABI. cbindgen turns this file into `include/corefs.h`; every doc comment here is the
//! header's documentation.
//!
//! Conventions: functions return 0, a count or a handle (≥ 1) on success and a negative errno
//! on failure; `corefs_last_error()` then holds a message for the calling thread. Every call may
//! be made from any thread, concurrently, unless its comment says otherwise.
//!
//! Paths are resolved by [`crate::path`] (bytes, `.` and `..`, trailing slashes, limits);
//! each path call maps the special cases of its last component (`/`, `.`, `..`, a trailing
//! slash) to the errno its Linux system call gives, explicitly, in its body (the calls that
//! make a new name, link, symlink and mknod, share theirs in `new_name`).
//!
//! Each call has one shape: its arguments checked in a fixed order (the out-pointer first,
//! then the filesystem, then the path: `Out`, `fs_and_path`), the path resolved, one request
//! to the reactor (`call`, `call_at`), its reply taken apart (`expect_reply!`: any other reply
//! is -EIO) and copied out; `guard`, `status` or `fill_out` around it turns errors and panics
//! into a negative errno.
#![allow(non_camel_case_types)]

use crate::handles::{self, set_error, with_client, Error, FileRef, Fs, FsRef, OpenFile};
use crate::path::{self, show, Entry, Last, Namespace};
use engine::format::items::MAX_XATTR_VALUE_BYTES;
use engine::inode::ROOT_INO;
use engine::{FallocateMode, MkfsOptions, MountOptions, RenameFlags, SetAttr, Stat, XattrFlags};
use reactor::{Config, IdlePolicy, Op, OpenHow, Opened, Owner, Reply, Runtime};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::time::Duration;

/// A mounted filesystem (≥ 1).
pub type corefs_fs = i64;
/// An open file or directory of one filesystem (≥ 1).
pub type corefs_fd = i64;

/// `corefs_open` flags (Linux values).
pub const COREFS_O_RDONLY: c_int = 0;
pub const COREFS_O_WRONLY: c_int = 1;
pub const COREFS_O_RDWR: c_int = 2;
pub const COREFS_O_CREAT: c_int = 0o100;
pub const COREFS_O_EXCL: c_int = 0o200;
pub const COREFS_O_TRUNC: c_int = 0o1000;
pub const COREFS_O_APPEND: c_int = 0o2000;
pub const COREFS_O_DIRECTORY: c_int = 0o200000;
/// `corefs_fallocate` modes (Linux values).
pub const COREFS_FALLOC_KEEP_SIZE: c_int = 1;
pub const COREFS_FALLOC_PUNCH_HOLE: c_int = 2;
pub const COREFS_FALLOC_ZERO_RANGE: c_int = 0x10;
/// `corefs_rename` flags (Linux values).
pub const COREFS_RENAME_NOREPLACE: c_int = 1;
pub const COREFS_RENAME_EXCHANGE: c_int = 2;
/// `corefs_setxattr` flags (Linux values).
pub const COREFS_XATTR_CREATE: c_int = 1;
pub const COREFS_XATTR_REPLACE: c_int = 2;

/// `corefs_set_owner`: this id is the mount's default again.
pub const COREFS_OWNER_DEFAULT: u32 = u32::MAX;

/// Mount options. Zero-initialise, then set what you need. Fields are only ever added at the
/// end, where zero keeps the earlier behaviour (a program built with an older header must be
/// rebuilt: the library reads the whole struct).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct corefs_options {
    /// Non-zero: format the device first (destroys its content).
    pub format: u8,
    /// Non-zero: the reactor busy-polls (a dedicated core); zero: spin then park.
    pub busy_poll: u8,
    /// Non-zero: pin the reactors to cores `core`, `core` + 1, ...; zero: not pinned.
    pub pin: u8,
    /// Reactors (0: one). Shard `s` is served by reactor `s % reactors`, each on its own
    /// device queue, with a commit coordinator thread; at most the shard count.
    pub reactors: u8,
    /// Shards when formatting (0: the default, 64).
    pub shards: u32,
    /// The (first) core to pin the reactor to when `pin` is set.
    pub core: u32,
    /// Commit interval in milliseconds (0: the default, 5000).
    pub commit_interval_ms: u32,
    /// Label when formatting (NULL: none); at most 32 bytes.
    pub label: *const c_char,
    /// The owner and group of the files, directories and symbolic links this mount creates,
    /// when `owner_set` is non-zero. Zero `owner_set`: the process's effective uid and gid
    /// at each call, as the kernel gives a file a process creates. A thread may override
    /// either with `corefs_set_owner`; a set-group-ID directory gives its group regardless.
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub owner_set: u8,
    /// Non-zero: no data-block cache. Every read of data not written since the last
    /// commit goes to the device, as an O_DIRECT read on a kernel filesystem does (what a
    /// database with a cache of its own wants, and what a fair read benchmark needs). Zero:
    /// the engine caches data blocks it reads.
    pub data_cache_off: u8,
    /// When reads move a file's access time: `COREFS_ATIME_RELATIME` (zero, the default:
    /// when it is not after the last modification or change, or is a day old),
    /// `COREFS_ATIME_NOATIME` (never), `COREFS_ATIME_STRICT` (every read); anything else is
    /// -EINVAL.
    pub atime: u8,
    /// Zero (room for later options).
    pub reserved: [u8; 5],
}

/// `corefs_options.atime`: Linux's relatime (the default).
pub const COREFS_ATIME_RELATIME: u8 = 0;
/// `corefs_options.atime`: reads never move the access time (Linux's noatime).
pub const COREFS_ATIME_NOATIME: u8 = 1;
/// `corefs_options.atime`: every read moves the access time (Linux's strictatime).
pub const COREFS_ATIME_STRICT: u8 = 2;

/// Filesystem statistics (statvfs(3)'s figures).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct corefs_statfs {
    /// Bytes per block (f_bsize and f_frsize).
    pub block_bytes: u64,
    pub total_blocks: u64,
    /// Blocks a new file could use (f_bfree and f_bavail).
    pub free_blocks: u64,
    /// Inodes in use; `inodes_used + inodes_free` is f_files.
    pub inodes_used: u64,
    /// Inodes that can still be created (f_ffree; an estimate: inodes take no fixed table).
    pub inodes_free: u64,
    /// The longest name (f_namemax).
    pub name_max_bytes: u64,
}

/// File attributes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct corefs_stat {
    pub ino: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub blocks_512: u64,
    pub atime_sec: i64,
    pub mtime_sec: i64,
    pub ctime_sec: i64,
    pub atime_nsec: u32,
    pub mtime_nsec: u32,
    pub ctime_nsec: u32,
    /// The device number of a character or block device (the kernel's 32-bit encoding, as
    /// makedev(3) gives for majors below 4096); 0 otherwise.
    pub rdev: u32,
    /// Birth time: when the file was created (statx's btime).
    pub btime_sec: i64,
    pub btime_nsec: u32,
    /// Zero.
    pub reserved: u32,
}

/// One directory entry.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct corefs_dirent {
    pub ino: u64,
    /// Pass the last entry's cookie to continue after it.
    pub cookie: u64,
    /// DT_* type (S_IFMT >> 12).
    pub kind: u8,
    pub name_len: u8,
    /// NUL-terminated.
    pub name: [u8; 256],
}

/// The outcome of an asynchronous operation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct corefs_completion {
    pub token: u64,
    /// Bytes transferred (reads, writes), 0 (fsync), or a negative errno.
    pub result: i64,
}

/// Reactor and engine statistics.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct corefs_stats {
    pub ops: u64,
    pub reactor_cpu_ns: u64,
    pub commits: u64,
    pub commit_ns_total: u64,
    pub commit_ns_max: u64,
    pub fsyncs: u64,
    pub log_writes: u64,
    pub log_blocks: u64,
    pub fallback_commits: u64,
    pub fsync_groups: u64,
    pub fsync_p50_ns: u64,
    pub fsync_p99_ns: u64,
    pub fsync_max_ns: u64,
    pub replayed_records: u64,
}

const _: () = assert!(std::mem::size_of::<corefs_options>() == 40);

/// Every option zero (the defaults, as `struct corefs_options opts = {0};` in C).
impl Default for corefs_options {
    fn default() -> Self {
        corefs_options {
            format: 0,
            busy_poll: 0,
            pin: 0,
            reactors: 0,
            shards: 0,
            core: 0,
            commit_interval_ms: 0,
            label: std::ptr::null(),
            owner_uid: 0,
            owner_gid: 0,
            owner_set: 0,
            data_cache_off: 0,
            atime: 0,
            reserved: [0; 5],
        }
    }
}
const _: () = assert!(std::mem::offset_of!(corefs_options, label) == 16);
const _: () = assert!(std::mem::offset_of!(corefs_options, owner_uid) == 24);
const _: () = assert!(std::mem::offset_of!(corefs_options, owner_set) == 32);
const _: () = assert!(std::mem::offset_of!(corefs_options, data_cache_off) == 33);
const _: () = assert!(std::mem::offset_of!(corefs_options, atime) == 34);
const _: () = assert!(std::mem::size_of::<corefs_options>() == 40);
const _: () = assert!(std::mem::size_of::<corefs_statfs>() == 48);
const _: () = assert!(std::mem::size_of::<corefs_stat>() == 96);
const _: () = assert!(std::mem::offset_of!(corefs_stat, rdev) == 76);
const _: () = assert!(std::mem::offset_of!(corefs_stat, btime_sec) == 80);
const _: () = assert!(std::mem::size_of::<corefs_dirent>() == 280);
const _: () = assert!(std::mem::size_of::<corefs_completion>() == 16);
const _: () = assert!(std::mem::size_of::<corefs_stats>() == 112);

/// Runs an ABI call: errors and panics become a negative errno and a thread-local message.
fn guard(name: &str, f: impl FnOnce() -> Result<i64, Error>) -> i64 {
    guard_or(name, -(libc::EIO as i64), || match f() {
        Ok(value) => value,
        Err(e) => {
            set_error(&format!("{name}: {}", e.message));
            -(e.errno as i64)
        }
    })
}

/// Runs the body of any `extern "C"` function: a panic, which must not unwind into C (it
/// would abort the process), becomes `on_panic` with the panic's message for
/// `corefs_last_error()`. Every exported function goes through this.
fn guard_or<T>(name: &str, on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(value) => value,
        Err(panic) => {
            let why = reactor::panic_message(&*panic);
            set_error(&format!("{name}: internal error (panic: {why})"));
            on_panic
        }
    }
}

fn status(name: &str, f: impl FnOnce() -> Result<(), Error>) -> c_int {
    guard(name, || f().map(|()| 0)) as c_int
}

fn efault(what: &str) -> Error {
    Error::new(libc::EFAULT, format!("{what} is NULL"))
}

fn einval(message: String) -> Error {
    Error::new(libc::EINVAL, message)
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(efault(what));
    }
    // SAFETY: the caller passes a NUL-terminated string (checked non-NULL above).
    let text = unsafe { CStr::from_ptr(p) };
    text.to_str()
        .map_err(|_| einval(format!("{what} is not UTF-8")))
}

/// A path or name: its bytes, any but NUL (UTF-8 or not, as the kernel takes them).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn c_bytes<'a>(p: *const c_char, what: &str) -> Result<&'a [u8], Error> {
    if p.is_null() {
        return Err(efault(what));
    }
    // SAFETY: the caller passes a NUL-terminated string (checked non-NULL above).
    Ok(unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// # Safety
/// `p` is NULL or valid for reading `len` bytes.
unsafe fn bytes<'a>(p: *const u8, len: usize, what: &str) -> Result<&'a [u8], Error> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(efault(what));
    }
    if len > isize::MAX as usize {
        return Err(einval(format!("{what}: length {len} is too large")));
    }
    // SAFETY: non-NULL, and the caller guarantees `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// # Safety
/// `p` is NULL or valid for writing `len` bytes.
unsafe fn bytes_mut<'a>(p: *mut u8, len: usize, what: &str) -> Result<&'a mut [u8], Error> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(efault(what));
    }
    if len > isize::MAX as usize {
        return Err(einval(format!("{what}: length {len} is too large")));
    }
    // SAFETY: non-NULL, and the caller guarantees `len` writable bytes.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// The length a read or write of `len` bytes at `offset` moves, bounded as pread(2) and
/// pwrite(2) bound theirs ([`engine::file::rw_len`]): `offset + len` past the largest
/// file position is -EINVAL, and more than 0x7ffff000 bytes is shortened to that.
fn io_len(offset: u64, len: usize) -> Result<usize, Error> {
    engine::file::rw_len(offset, len).map_err(Error::from)
}

/// A caller's out-pointer to one `T`, checked non-NULL where the call starts (so -EFAULT comes
/// before the errors the call's other arguments give), written at most once, at its end.
struct Out<'a, T> {
    ptr: NonNull<T>,
    _borrow: PhantomData<&'a mut T>,
}

impl<T> Out<'_, T> {
    /// -EFAULT when `p` is NULL.
    ///
    /// # Safety
    /// `p` is NULL or valid for writing one `T` while the result lives.
    unsafe fn new(p: *mut T, what: &str) -> Result<Self, Error> {
        let ptr = NonNull::new(p).ok_or_else(|| efault(what))?;
        Ok(Out {
            ptr,
            _borrow: PhantomData,
        })
    }

    fn write(self, value: T) {
        // SAFETY: non-NULL (checked in `new`) and writable by `new`'s contract.
        unsafe { self.ptr.as_ptr().write(value) }
    }
}

/// The filesystem `fs` and the path argument `path`, checked in that order (-EBADF before
/// -EFAULT), as every call on one path does.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string valid for the call.
unsafe fn fs_and_path<'p>(fs: corefs_fs, path: *const c_char) -> Result<(FsRef, &'p [u8]), Error> {
    let fs = fs_of(fs)?;
    // SAFETY: forwarded from this function's contract.
    let path = unsafe { c_bytes(path, "path") }?;
    Ok((fs, path))
}

/// The calls that fill one struct of the caller's: `out` is checked first, then `fs`; `fill`
/// computes the value, which `out` gets only on success.
///
/// # Safety
/// `out` is NULL or valid for writing one `T`.
unsafe fn fill_out<T>(
    name: &str,
    fs: corefs_fs,
    out: *mut T,
    fill: impl FnOnce(&Fs) -> Result<T, Error>,
) -> c_int {
    status(name, || {
        // SAFETY: forwarded from this function's contract.
        let out = unsafe { Out::new(out, "out") }?;
        let fs = fs_of(fs)?;
        out.write(fill(&fs)?);
        Ok(())
    })
}

fn call(fs: &Fs, op: Op) -> Result<Reply, Error> {
    with_client(fs, |c| c.call(op))?.map_err(Error::from)
}

/// Runs `op` on the inode `path` names: one request (the reactor walks the path, then
/// runs the op) for a path of plain names.
fn call_at(fs: &Fs, path: &[u8], op: impl FnOnce(u64) -> Op) -> Result<Reply, Error> {
    let parsed = path::parse(path)?;
    // A trailing slash asks for a directory, which only a walk here checks.
    if !parsed.trailing_slash {
        if let Some(names) = path::plain(&parsed.parts) {
            return call(fs, walk(&names, op(0)));
        }
    }
    let ino = resolve(fs, path)?.ino;
    call(fs, op(ino))
}

fn unexpected(reply: Reply) -> Error {
    Error::new(libc::EIO, format!("unexpected reply {reply:?}"))
}

/// The value a reply holds when it is of the kind its op gives (`expect_reply!(reply,
/// Reply::Data(d) => d)`); any other reply is -EIO (a reactor bug, never a panic).
macro_rules! expect_reply {
    ($reply:expr, $pattern:pat => $value:expr) => {
        match $reply {
            $pattern => Ok($value),
            other => Err(unexpected(other)),
        }
    };
}

fn stat_of(reply: Reply) -> Result<Stat, Error> {
    expect_reply!(reply, Reply::Stat(s) => s)
}

/// The reactor as [`path`] resolution sees it.
struct Names<'f>(&'f Fs);

impl Namespace for Names<'_> {
    fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Stat, Error> {
        stat_of(call(
            self.0,
            Op::Lookup {
                dir,
                name: name.to_vec(),
            },
        )?)
    }
    fn stat(&mut self, ino: u64) -> Result<Stat, Error> {
        stat_of(call(self.0, Op::Stat { ino })?)
    }
    fn walk(&mut self, names: &[&[u8]]) -> Result<Stat, Error> {
        stat_of(call(self.0, walk(names, Op::Stat { ino: 0 }))?)
    }
}

/// `then` on what `names` (plain names from the root) lead to, in one request: a walk by
/// the reactor, or `then` itself at the root.
fn walk(names: &[&[u8]], mut then: Op) -> Op {
    if names.is_empty() {
        if let Some(target) = then.target_mut() {
            *target = ROOT_INO;
        }
        return then;
    }
    Op::Walk {
        from: ROOT_INO,
        path: names.iter().map(|n| n.to_vec()).collect(),
        then: Box::new(then),
    }
}

/// Runs the name operation `op(dir, name)` on the entry `path` names, in one request when the
/// reactor can walk to its directory itself: the path is plain names ending in a name,
/// without a trailing slash unless `slash_ok` (mkdir and rmdir take `d/`). Otherwise the
/// directory is walked here ([`entry`]) and `special` gives the error for a path ending in
/// `/`, `.` or `..`; `check` runs on the entry walked before the operation (link's and
/// symlink's rule for a trailing slash).
fn call_entry(
    fs: &Fs,
    path: &[u8],
    slash_ok: bool,
    special: impl FnOnce(Last<'_>) -> Error,
    check: impl FnOnce(&Fs, &Entry<'_>, &[u8]) -> Result<(), Error>,
    op: impl Fn(u64, &[u8]) -> Op,
) -> Result<Reply, Error> {
    let parsed = path::parse(path)?;
    if slash_ok || !parsed.trailing_slash {
        if let Some(names) = path::plain(&parsed.parts) {
            if let Some((last, dirs)) = names.split_last() {
                return call(fs, walk(dirs, op(0, last)));
            }
        }
    }
    let e = entry(fs, path)?;
    let name = e.name(special)?;
    check(fs, &e, name)?;
    call(fs, op(e.dir, name))
}

/// No check of an entry.
fn any_entry(_: &Fs, _: &Entry<'_>, _: &[u8]) -> Result<(), Error> {
    Ok(())
}

/// What `path` names (a trailing slash requires a directory).
fn resolve(fs: &Fs, path: &[u8]) -> Result<Stat, Error> {
    path::lookup(&mut Names(fs), path)
}

/// The directory and last component of the entry `path` names.
fn entry<'p>(fs: &Fs, path: &'p [u8]) -> Result<Entry<'p>, Error> {
    path::entry(&mut Names(fs), path)
}

/// The error a name op gives when the path ends in `/`, `.` or `..`.
fn special(errno: i32, path: &[u8]) -> impl FnOnce(Last<'_>) -> Error + '_ {
    move |last| {
        let what = match last {
            Last::Root => "the root",
            Last::Dot => "\".\"",
            Last::DotDot => "\"..\"",
            Last::Name(_) => "a name",
        };
        Error::new(errno, format!("{} ends in {what}", show(path)))
    }
}

/// The entry `name` in `dir`, if there is one.
fn lookup_entry(fs: &Fs, dir: u64, name: &[u8]) -> Result<Option<Stat>, Error> {
    match Names(fs).lookup(dir, name) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.errno == libc::ENOENT => Ok(None),
        Err(e) => Err(e),
    }
}

/// For link(2) and symlink(2)'s new name with a trailing slash (Linux's rule: the name
/// would have to be a directory these calls cannot make): EEXIST if it exists, else ENOENT.
fn no_trailing_slash_for_new(fs: &Fs, e: &Entry<'_>, path: &[u8]) -> Result<(), Error> {
    let Last::Name(name) = e.last else {
        return Ok(());
    };
    if !e.trailing_slash {
        return Ok(());
    }
    Err(match lookup_entry(fs, e.dir, name)? {
        Some(_) => Error::new(libc::EEXIST, format!("{} exists", show(path))),
        None => Error::new(
            libc::ENOENT,
            format!("{}: a trailing slash names a directory", show(path)),
        ),
    })
}

/// The directory and name of `path` for a call that makes a new name (link(2), symlink(2),
/// mknod(2)): `/`, `.` and `..` exist (-EEXIST), and a trailing slash is refused as
/// [`no_trailing_slash_for_new`] says.
fn call_new(fs: &Fs, path: &[u8], op: impl Fn(u64, &[u8]) -> Op) -> Result<Reply, Error> {
    call_entry(
        fs,
        path,
        false,
        special(libc::EEXIST, path),
        |fs, e, _| no_trailing_slash_for_new(fs, e, path),
        op,
    )
}

/// The handle `fd`, pinned while the result lives: keep it across the engine call that uses
/// it (a release waits for it before the inode goes; see [`handles`]).
fn file(fs: &Fs, fd: corefs_fd) -> Result<FileRef, Error> {
    handles::file(fs, fd)
}

fn regular(fs: &Fs, fd: corefs_fd) -> Result<FileRef, Error> {
    let f = file(fs, fd)?;
    if f.dir {
        return Err(Error::new(libc::EISDIR, format!("{fd} is a directory")));
    }
    Ok(f)
}

/// -EBADF unless `f` (handle `fd`) is open for reading.
fn need_readable(f: &OpenFile, fd: corefs_fd) -> Result<(), Error> {
    if !f.readable {
        return Err(Error::new(
            libc::EBADF,
            format!("{fd} is not open for reading"),
        ));
    }
    Ok(())
}

/// Copies what fits of `value` into `out`; returns the whole length (so a caller with a short
/// or empty buffer learns the size it needs), as readlink(2) and getxattr(2) do.
fn copy_out(out: &mut [u8], value: &[u8]) -> i64 {
    let n = value.len().min(out.len());
    out[..n].copy_from_slice(&value[..n]);
    value.len() as i64
}

fn fs_of(fs: corefs_fs) -> Result<FsRef, Error> {
    handles::lookup(fs)
}

fn to_c_stat(s: &Stat) -> corefs_stat {
    corefs_stat {
        ino: s.ino,
        mode: s.mode,
        nlink: s.nlink,
        uid: s.uid,
        gid: s.gid,
        size: s.size,
        blocks_512: s.blocks_512,
        atime_sec: s.atime.sec,
        mtime_sec: s.mtime.sec,
        ctime_sec: s.ctime.sec,
        atime_nsec: s.atime.nsec,
        mtime_nsec: s.mtime.nsec,
        ctime_nsec: s.ctime.nsec,
        // Only corefs_mknod and the FUSE mount set rdev, both to 32-bit numbers; a wider one
        // (written by some other tool) shows as 0 rather than as a wrong number.
        rdev: u32::try_from(s.rdev).unwrap_or(0),
        btime_sec: s.crtime.sec,
        btime_nsec: s.crtime.nsec,
        reserved: 0,
    }
}

/// The message of the calling thread's last failed call ("" if none). Valid until that
/// thread's next corefs call.
#[no_mangle]
pub extern "C" fn corefs_last_error() -> *const c_char {
    guard_or("corefs_last_error", c"".as_ptr(), handles::last_error_ptr)
}

/// Starts a reactor on `device` (`file:/srv/fs.img,size=1GiB`, `nvme:/dev/ng0n1`,
/// `mem:256MiB`), formatting it if `options->format`, and mounts it (replaying the fsync logs).
/// `options` may be NULL (defaults). Returns the filesystem handle or a negative errno:
/// -EINVAL for a bad device string (an option out of its range is named), -EBUSY when
/// another mount, mkfs or fsck holds the device (in this process or another: the message
/// names the holder's pid). The device is held exclusively until `corefs_close`.
///
/// # Safety
/// `device` is NULL or a NUL-terminated string; `options` is NULL or points to a
/// `corefs_options` whose `label` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mount(
    device: *const c_char,
    options: *const corefs_options,
) -> corefs_fs {
    guard("corefs_mount", || {
        crate::logging::init_from_env();
        // SAFETY: forwarded from this function's contract.
        let device = unsafe { c_str(device, "device") }?;
        let options = if options.is_null() {
            None
        } else {
            // SAFETY: non-NULL and points to a corefs_options by contract.
            Some(unsafe { *options })
        };
        let mut config = Config {
            device: device.to_string(),
            ..Default::default()
        };
        let mut mount = MountOptions::default();
        let mut owner = None;
        if let Some(o) = options {
            if o.owner_set != 0 {
                owner = Some(Owner {
                    uid: o.owner_uid,
                    gid: o.owner_gid,
                });
            }
            if o.format != 0 {
                let label = if o.label.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-NULL and NUL-terminated by contract.
                    unsafe { c_str(o.label, "options.label") }?.to_string()
                };
                config.mkfs = Some(MkfsOptions {
                    shards: if o.shards == 0 {
                        MkfsOptions::default().shards
                    } else {
                        o.shards
                    },
                    label,
                    ..Default::default()
                });
            }
            if o.busy_poll != 0 {
                config.idle = IdlePolicy::BusyPoll;
            }
            config.reactors = (o.reactors as usize).max(1);
            if o.pin != 0 {
                // Checked here, so a core the process may not run on is -EINVAL naming it
                // and the allowed set.
                config.cores =
                    reactor::affinity::consecutive_cores(o.core as usize, config.reactors)?;
                config.core = config.cores.first().copied();
            }
            if o.commit_interval_ms != 0 {
                mount.commit_interval = Duration::from_millis(o.commit_interval_ms as u64);
            }
            if o.data_cache_off != 0 {
                mount.data_cache_blocks = 0;
            }
            mount.atime = match o.atime {
                COREFS_ATIME_RELATIME => engine::Atime::Relative,
                COREFS_ATIME_NOATIME => engine::Atime::Never,
                COREFS_ATIME_STRICT => engine::Atime::Strict,
                other => {
                    return Err(einval(format!(
                        "options.atime {other}: use COREFS_ATIME_RELATIME (0), \
                         COREFS_ATIME_NOATIME (1) or COREFS_ATIME_STRICT (2)"
                    )))
                }
            };
        }
        config.mount = mount;
        let runtime = Runtime::start(config)?;
        Ok(handles::register(runtime, owner))
    })
}

/// Formats `device` (see `corefs_mount`) and closes it again.
///
/// # Safety
/// As `corefs_mount`.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkfs(
    device: *const c_char,
    options: *const corefs_options,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    guard_or("corefs_mkfs", -libc::EIO, || unsafe {
        mkfs(device, options)
    })
}

/// # Safety
/// As `corefs_mkfs`.
unsafe fn mkfs(device: *const c_char, options: *const corefs_options) -> c_int {
    let mut o = if options.is_null() {
        corefs_options::default()
    } else {
        // SAFETY: non-NULL and points to a corefs_options by contract.
        unsafe { *options }
    };
    o.format = 1;
    // SAFETY: forwarded from this function's contract.
    let fs = unsafe { corefs_mount(device, &o) };
    if fs < 0 {
        return fs as c_int;
    }
    corefs_close(fs)
}

/// Drains the operations in flight, closes the file handles still open (an unlinked file
/// goes with its last handle, as at process exit), commits, unmounts and stops the reactor.
/// The handle and every file handle of it are invalid afterwards (-EBADF). Do not call it
/// while another thread still uses the filesystem.
#[no_mangle]
pub extern "C" fn corefs_close(fs: corefs_fs) -> c_int {
    status("corefs_close", || {
        let fs = handles::unregister(fs)?;
        // Released here rather than left to the next mount (which deletes the orphans a
        // crash leaves): a closed image then holds no orphan, and their space is free now.
        // A failure is the runtime's, which the shutdown below reports.
        // Returns once no call still uses a handle (see handles' module doc).
        for f in handles::drain_files(&fs) {
            let _ = call(&fs, Op::Release { ino: f.ino });
        }
        handles::forget_client(fs.id);
        let runtime = fs.runtime.lock().expect("runtime").take();
        // Other threads' clients go now, not when each next calls in (if ever).
        handles::take_thread_clients(&fs);
        match runtime {
            Some(runtime) => runtime.shutdown().map(drop).map_err(Error::from),
            None => Err(Error::new(libc::EBADF, "already closed".into())),
        }
    })
}

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
                    readable: flags & 3 != COREFS_O_WRONLY,
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
    if let Some(names) = path::plain(&parsed.parts) {
        if let Some((last, dirs)) = names.split_last() {
            let open = Op::Open {
                dir: 0,
                name: last.to_vec(),
                how,
            };
            return Ok(walk(dirs, open));
        }
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
        call(
            &fs,
            Op::Release {
                ino: removed.file.ino,
            },
        )
        .map(drop)
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
        let read = Op::Read {
            ino: f.ino,
            offset,
            len,
        };
        let mut data = expect_reply!(call(&fs, read)?, Reply::Data(d) => d)?;
        // Through a handle with an atomic batch open, the batch's writes are read back (SQLite
        // reads pages it wrote); at most `len` bytes.
        f.batch()
            .with(|batch| batch.overlay(offset, len, &mut data));
        out[..data.len()].copy_from_slice(&data);
        Ok(data.len() as i64)
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
        let reply = call(&fs, write_op(&f, offset, data.to_vec()))?;
        expect_reply!(reply, Reply::Written(n) | Reply::Appended { written: n, .. } => n as i64)
    })
}

/// The write of `data` through handle `f`: at `offset`, or an atomic append.
fn write_op(f: &OpenFile, offset: u64, data: Vec<u8>) -> Op {
    if f.append {
        Op::Append { ino: f.ino, data }
    } else {
        Op::Write {
            ino: f.ino,
            offset,
            data,
        }
    }
}

/// The handle `fd` if it is a regular file open for writing (ftruncate(2) and fallocate(2)
/// on a read-only descriptor are EBADF).
fn writable(fs: &Fs, fd: corefs_fd) -> Result<FileRef, Error> {
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
fn sync_op(ino: u64, datasync: bool) -> Op {
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
fn no_batch(f: &FileRef, fd: corefs_fd) -> Result<(), Error> {
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

/// Attributes of an open file.
///
/// # Safety
/// `out` is valid for writing one `corefs_stat`.
#[no_mangle]
pub unsafe extern "C" fn corefs_fstat(
    fs: corefs_fs,
    fd: corefs_fd,
    out: *mut corefs_stat,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_fstat", fs, out, |fs| {
            let f = file(fs, fd)?;
            let mut s = stat_of(call(fs, Op::Stat { ino: f.ino })?)?;
            // Through a handle with an atomic batch open, the size the batch's writes give it.
            if let Some(end) = f.batch().with(|batch| batch.end()) {
                s.size = s.size.max(end);
            }
            Ok(to_c_stat(&s))
        })
    }
}

/// Attributes of `path`.
///
/// # Safety
/// `path` is NUL-terminated; `out` is valid for writing one `corefs_stat`.
#[no_mangle]
pub unsafe extern "C" fn corefs_stat(
    fs: corefs_fs,
    path: *const c_char,
    out: *mut corefs_stat,
) -> c_int {
    let stat = |fs: &Fs| {
        // SAFETY: forwarded from this function's contract.
        let path = unsafe { c_bytes(path, "path") }?;
        Ok(to_c_stat(&resolve(fs, path)?))
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { fill_out("corefs_stat", fs, out, stat) }
}

/// Sets the mode bits (permissions) of `path`.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_chmod(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_chmod", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        let change = SetAttr {
            mode: Some(mode & 0o7777),
            ..Default::default()
        };
        call_at(&fs, path, |ino| Op::SetAttr { ino, change }).map(drop)
    })
}

/// Creates directory `path` (`d/` too). The owner is the caller's (see `corefs_set_owner`);
/// in a set-group-ID directory the group is the directory's, and so is the bit.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkdir(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_mkdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        let owner = handles::owner(&fs);
        // mkdir(2) of `/`, `.` or `..`: they exist.
        call_entry(
            &fs,
            path,
            true,
            special(libc::EEXIST, path),
            any_entry,
            |dir, name| Op::Mkdir {
                dir,
                name: name.to_vec(),
                mode: mode & 0o7777,
                owner,
            },
        )
        .map(drop)
    })
}

/// Removes the empty directory `path` (`d/` too).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_rmdir(fs: corefs_fs, path: *const c_char) -> c_int {
    status("corefs_rmdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        // rmdir(2): the root is busy, `.` is invalid, and `..` is not empty (it holds `.`).
        let special = |last: Last<'_>| match last {
            Last::Root => special(libc::EBUSY, path)(last),
            Last::Dot => special(libc::EINVAL, path)(last),
            _ => special(libc::ENOTEMPTY, path)(last),
        };
        call_entry(&fs, path, true, special, any_entry, |dir, name| Op::Rmdir {
            dir,
            name: name.to_vec(),
        })
        .map(drop)
    })
}

/// Removes the name `path`. The file goes with its last name unless a handle holds it (see
/// `corefs_open`). -ENOTDIR for `file/`, -EISDIR for a directory.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_unlink(fs: corefs_fs, path: *const c_char) -> c_int {
    status("corefs_unlink", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        // unlink(2) of `x/`: never removes anything; the error says what `x` is.
        let slash = |fs: &Fs, e: &Entry<'_>, name: &[u8]| {
            if !e.trailing_slash {
                return Ok(());
            }
            Err(match lookup_entry(fs, e.dir, name)? {
                None => Error::new(libc::ENOENT, format!("{} does not exist", show(path))),
                Some(s) if s.is_dir() => {
                    Error::new(libc::EISDIR, format!("{} is a directory", show(path)))
                }
                Some(_) => Error::new(libc::ENOTDIR, format!("{} is not a directory", show(path))),
            })
        };
        call_entry(
            &fs,
            path,
            false,
            special(libc::EISDIR, path),
            slash,
            |dir, name| Op::Unlink {
                dir,
                name: name.to_vec(),
            },
        )
        .map(drop)
    })
}

/// Renames `from` to `to` (flags: COREFS_RENAME_NOREPLACE, COREFS_RENAME_EXCHANGE). A file
/// renamed over stays as long as a handle holds it (see `corefs_open`). As rename(2): a
/// trailing slash on either path needs a directory (-ENOTDIR), and `/`, `.` or `..` as either
/// last component is -EBUSY.
///
/// # Safety
/// `from` and `to` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_rename(
    fs: corefs_fs,
    from: *const c_char,
    to: *const c_char,
    flags: c_int,
) -> c_int {
    status("corefs_rename", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (from, to) = unsafe { (c_bytes(from, "from")?, c_bytes(to, "to")?) };
        if flags & !(COREFS_RENAME_NOREPLACE | COREFS_RENAME_EXCHANGE) != 0 {
            return Err(einval(format!("unsupported rename flags {flags:#x}")));
        }
        let exchange = flags & COREFS_RENAME_EXCHANGE != 0;
        let src = entry(&fs, from)?;
        let dst = entry(&fs, to)?;
        let from_name = src.name(special(libc::EBUSY, from))?;
        let to_name = dst.name(special(libc::EBUSY, to))?;
        if src.trailing_slash || dst.trailing_slash {
            // What moves must be a directory; in an exchange, what comes back too.
            let source = Names(&fs).lookup(src.dir, from_name)?;
            let not_dir = |path: &[u8]| {
                Error::new(libc::ENOTDIR, format!("{} is not a directory", show(path)))
            };
            if !source.is_dir() {
                return Err(not_dir(if src.trailing_slash { from } else { to }));
            }
            if exchange && dst.trailing_slash {
                let target = Names(&fs).lookup(dst.dir, to_name)?;
                if !target.is_dir() {
                    return Err(not_dir(to));
                }
            }
        }
        call(
            &fs,
            Op::Rename {
                from_dir: src.dir,
                from: from_name.to_vec(),
                to_dir: dst.dir,
                to: to_name.to_vec(),
                flags: RenameFlags {
                    noreplace: flags & COREFS_RENAME_NOREPLACE != 0,
                    exchange,
                },
            },
        )
        .map(drop)
    })
}

/// Gives the file at `existing` the new name `path`.
///
/// # Safety
/// `existing` and `path` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_link(
    fs: corefs_fs,
    existing: *const c_char,
    path: *const c_char,
) -> c_int {
    status("corefs_link", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (existing, path) = unsafe { (c_bytes(existing, "existing")?, c_bytes(path, "path")?) };
        let ino = resolve(&fs, existing)?.ino;
        // link(2) to `/`, `.` or `..`: they exist.
        call_new(&fs, path, |dir, name| Op::Link {
            ino,
            dir,
            name: name.to_vec(),
        })
        .map(drop)
    })
}

/// Creates the symbolic link `path` pointing at `target` (1 to 4095 bytes, any but NUL; an
/// empty target is -ENOENT and a longer one -ENAMETOOLONG, as symlink(2)). The owner is the
/// caller's (see `corefs_set_owner`).
///
/// # Safety
/// `target` and `path` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_symlink(
    fs: corefs_fs,
    target: *const c_char,
    path: *const c_char,
) -> c_int {
    status("corefs_symlink", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (target, path) = unsafe { (c_bytes(target, "target")?, c_bytes(path, "path")?) };
        if target.is_empty() {
            return Err(Error::new(libc::ENOENT, "empty symlink target".into()));
        }
        if target.len() >= path::PATH_MAX_BYTES {
            return Err(Error::new(
                libc::ENAMETOOLONG,
                format!(
                    "symlink target of {} bytes (at most {})",
                    target.len(),
                    path::PATH_MAX_BYTES - 1
                ),
            ));
        }
        let owner = handles::owner(&fs);
        call_new(&fs, path, |dir, name| Op::Symlink {
            dir,
            name: name.to_vec(),
            target: target.to_vec(),
            owner,
        })
        .map(drop)
    })
}

/// Creates `path` as mknod(2) does: `mode` is a file type (S_IFIFO, S_IFSOCK, S_IFCHR,
/// S_IFBLK, S_IFREG or 0 for a regular file) and permission bits; `rdev` is the device
/// number of a character or block device (makedev(3); ignored for the other types).
/// corefs keeps these as names with a type and number (for a program that stores them, as
/// `corefs mount` does for the kernel); it runs no pipe or device behind them, and reads and
/// writes through a handle of one are -EINVAL. S_IFDIR is -EPERM (use `corefs_mkdir`),
/// another type -EINVAL, as is an `rdev` over 32 bits (as glibc's mknod). The owner is the
/// caller's (see `corefs_set_owner`).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mknod(
    fs: corefs_fs,
    path: *const c_char,
    mode: u32,
    rdev: u64,
) -> c_int {
    status("corefs_mknod", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        mknod(&fs, path, mode, rdev)
    })
}

/// Creates the FIFO `path` (mkfifo(3): `corefs_mknod` with S_IFIFO).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkfifo(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_mkfifo", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        mknod(&fs, path, libc::S_IFIFO | (mode & 0o7777), 0)
    })
}

fn mknod(fs: &Fs, path: &[u8], mode: u32, rdev: u64) -> Result<(), Error> {
    // Checked before the path, as Linux checks the type first.
    match mode & libc::S_IFMT {
        0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFCHR | libc::S_IFBLK => {}
        libc::S_IFDIR => {
            return Err(Error::new(
                libc::EPERM,
                "mknod of a directory (use corefs_mkdir)".into(),
            ))
        }
        kind => return Err(einval(format!("mknod of file type {:#o}", kind))),
    }
    // The kernel's device numbers are 32 bits; glibc refuses a dev_t that does not fit.
    let rdev = u32::try_from(rdev)
        .map_err(|_| einval(format!("device number {rdev:#x} is over 32 bits")))?;
    // mknod(2) of `/`, `.` or `..`: they exist.
    let owner = handles::owner(fs);
    call_new(fs, path, |dir, name| Op::Mknod {
        dir,
        name: name.to_vec(),
        mode: mode & (libc::S_IFMT | 0o7777),
        rdev: rdev as u64,
        owner,
    })
    .map(drop)
}

/// Copies the target of symbolic link `path` into `buf` (not NUL-terminated); returns its
/// length (which may exceed `len`: then only `len` bytes were copied).
///
/// # Safety
/// `path` is NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_readlink(
    fs: corefs_fs,
    path: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_readlink", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), out) = unsafe { (fs_and_path(fs, path)?, bytes_mut(buf, len, "buf")?) };
        let reply = call_at(&fs, path, |ino| Op::Readlink { ino })?;
        expect_reply!(reply, Reply::Data(target) => copy_out(out, &target))
    })
}

/// Reads up to `max` entries of directory `path` after `cookie` (0 to start) into `out`;
/// returns how many (0 at the end). `.` and `..` are not listed.
///
/// # Safety
/// `path` is NUL-terminated; `out` is valid for writing `max` entries.
#[no_mangle]
pub unsafe extern "C" fn corefs_readdir(
    fs: corefs_fs,
    path: *const c_char,
    cookie: u64,
    out: *mut corefs_dirent,
    max: usize,
) -> i64 {
    guard("corefs_readdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        if max == 0 {
            return Ok(0);
        }
        if out.is_null() {
            return Err(efault("out"));
        }
        let reply = call_at(&fs, path, |dir| Op::Readdir {
            dir,
            cookie: cookie.max(1),
            max: max.min(4096),
        })?;
        let entries = expect_reply!(reply, Reply::Entries(e) => e)?;
        for (i, e) in entries.iter().enumerate() {
            let mut d = corefs_dirent {
                ino: e.ino,
                cookie: e.cookie,
                kind: e.kind,
                name_len: e.name.len() as u8,
                name: [0; 256],
            };
            d.name[..e.name.len()].copy_from_slice(&e.name);
            // SAFETY: i < entries.len() ≤ max, and `out` holds `max` entries by contract.
            unsafe { out.add(i).write(d) };
        }
        Ok(entries.len() as i64)
    })
}

/// An attribute name as setxattr(2) checks it: 1 to 255 bytes, else -ERANGE.
fn xattr_name(name: &[u8]) -> Result<Vec<u8>, Error> {
    if name.is_empty() || name.len() > path::NAME_MAX_BYTES {
        return Err(Error::new(
            libc::ERANGE,
            format!(
                "attribute name of {} bytes (1 to {})",
                name.len(),
                path::NAME_MAX_BYTES
            ),
        ));
    }
    Ok(name.to_vec())
}

/// Copies `value` into `out` as getxattr(2) and listxattr(2) do: an empty `out` learns the
/// size; one too small is -ERANGE (nothing copied).
fn sized_out(out: &mut [u8], value: &[u8], what: &str) -> Result<i64, Error> {
    if !out.is_empty() && out.len() < value.len() {
        return Err(Error::new(
            libc::ERANGE,
            format!(
                "{what} needs {} bytes, the buffer holds {}",
                value.len(),
                out.len()
            ),
        ));
    }
    Ok(copy_out(out, value))
}

/// Sets extended attribute `name` of `path` (flags: COREFS_XATTR_CREATE, _REPLACE). Values
/// up to 65536 bytes; a longer one is -E2BIG, a name that is empty or over 255 bytes -ERANGE,
/// as setxattr(2).
///
/// # Safety
/// `path` and `name` are NUL-terminated; `value` is valid for reading `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_setxattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
    value: *const u8,
    len: usize,
    flags: c_int,
) -> c_int {
    status("corefs_setxattr", || {
        let fs = fs_of(fs)?;
        if len > MAX_XATTR_VALUE_BYTES {
            return Err(Error::new(
                libc::E2BIG,
                format!("attribute value of {len} bytes (at most {MAX_XATTR_VALUE_BYTES})"),
            ));
        }
        // SAFETY: forwarded from this function's contract.
        let (path, name, value) = unsafe {
            (
                c_bytes(path, "path")?,
                c_bytes(name, "name")?,
                bytes(value, len, "value")?,
            )
        };
        if flags & !(COREFS_XATTR_CREATE | COREFS_XATTR_REPLACE) != 0 {
            return Err(einval(format!("unsupported xattr flags {flags:#x}")));
        }
        let name = xattr_name(name)?;
        let flags = match flags {
            0 => XattrFlags::Any,
            COREFS_XATTR_CREATE => XattrFlags::Create,
            COREFS_XATTR_REPLACE => XattrFlags::Replace,
            _ => return Err(einval("COREFS_XATTR_CREATE and _REPLACE together".into())),
        };
        let value = value.to_vec();
        call_at(&fs, path, |ino| Op::SetXattr {
            ino,
            name,
            value,
            flags,
        })
        .map(drop)
    })
}

/// Copies the value of attribute `name` into `buf`; returns its size. With `len` 0 only
/// returns the size; a `len` too small for the value is -ERANGE, as getxattr(2).
///
/// # Safety
/// `path` and `name` are NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_getxattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_getxattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), name, out) = unsafe {
            (
                fs_and_path(fs, path)?,
                c_bytes(name, "name")?,
                bytes_mut(buf, len, "buf")?,
            )
        };
        let name = xattr_name(name)?;
        let reply = call_at(&fs, path, |ino| Op::GetXattr { ino, name })?;
        sized_out(
            out,
            &expect_reply!(reply, Reply::Data(v) => v)?,
            "the value",
        )
    })
}

/// Copies the attribute names of `path`, each NUL-terminated, into `buf`; returns the bytes
/// they take. With `len` 0 only returns that; a `len` too small is -ERANGE, as listxattr(2).
///
/// # Safety
/// `path` is NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_listxattr(
    fs: corefs_fs,
    path: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_listxattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), out) = unsafe { (fs_and_path(fs, path)?, bytes_mut(buf, len, "buf")?) };
        let reply = call_at(&fs, path, |ino| Op::ListXattr { ino })?;
        let names = expect_reply!(reply, Reply::Names(n) => n)?;
        let mut all = Vec::new();
        for n in names {
            all.extend_from_slice(&n);
            all.push(0);
        }
        sized_out(out, &all, "the names")
    })
}

/// Removes attribute `name` of `path`.
///
/// # Safety
/// `path` and `name` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_removexattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
) -> c_int {
    status("corefs_removexattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), name) = unsafe { (fs_and_path(fs, path)?, c_bytes(name, "name")?) };
        let name = xattr_name(name)?;
        call_at(&fs, path, |ino| Op::RemoveXattr { ino, name }).map(drop)
    })
}

/// Reactor and engine statistics.
///
/// # Safety
/// `out` is valid for writing one `corefs_stats`.
#[no_mangle]
pub unsafe extern "C" fn corefs_get_stats(fs: corefs_fs, out: *mut corefs_stats) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_get_stats", fs, out, |fs| {
            let s = expect_reply!(call(fs, Op::Stats)?, Reply::Stats(s) => s)?;
            Ok(corefs_stats {
                ops: s.ops,
                reactor_cpu_ns: s.cpu_ns,
                commits: s.commit.commits,
                commit_ns_total: s.commit.commit_ns_total,
                commit_ns_max: s.commit.commit_ns_max,
                fsyncs: s.log.fsyncs,
                log_writes: s.log.log_writes,
                log_blocks: s.log.log_blocks,
                fallback_commits: s.log.fallback_commits(),
                fsync_groups: s.fsync_groups,
                fsync_p50_ns: s.fsync_total.p50_ns,
                fsync_p99_ns: s.fsync_total.p99_ns,
                fsync_max_ns: s.fsync_total.max_ns,
                replayed_records: s.log.replayed_records,
            })
        })
    }
}

/// Filesystem statistics: space and inode counts (what df and df -i show).
///
/// # Safety
/// `out` is valid for writing one `corefs_statfs`.
#[no_mangle]
pub unsafe extern "C" fn corefs_statfs(fs: corefs_fs, out: *mut corefs_statfs) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_statfs", fs, out, |fs| {
            let s = expect_reply!(call(fs, Op::Statfs)?, Reply::Statfs(s) => s)?;
            Ok(corefs_statfs {
                block_bytes: s.block_bytes as u64,
                total_blocks: s.total_blocks,
                free_blocks: s.free_blocks,
                inodes_used: s.inodes,
                inodes_free: s.free_inodes,
                name_max_bytes: s.name_max as u64,
            })
        })
    }
}

/// Sets who the calling thread creates files, directories and symbolic links as on `fs`
/// from now on: owner `uid` and group `gid` (per thread, as setfsuid(2) and setfsgid(2)).
/// COREFS_OWNER_DEFAULT for either gives it back to the mount's default (`corefs_options`'s
/// owner, else the process's effective id). Nothing else changes: corefs checks no
/// permissions in the C ABI (the calling process has them all). -EBADF for a bad `fs`.
#[no_mangle]
pub extern "C" fn corefs_set_owner(fs: corefs_fs, uid: u32, gid: u32) -> c_int {
    status("corefs_set_owner", || {
        let fs = fs_of(fs)?;
        let id = |v: u32| (v != COREFS_OWNER_DEFAULT).then_some(v);
        handles::set_thread_owner(fs.id, (id(uid), id(gid)))
    })
}

// ---- Asynchronous I/O -------------------------------------------------------------------

/// An asynchronous operation in flight on this thread.
struct Pending {
    user_token: u64,
    /// Reads: where the data goes (the caller keeps the buffer alive until the completion).
    read_into: Option<(*mut u8, usize)>,
    /// Its hold on the handle's file, and the file.
    holds: (std::sync::Arc<handles::InFlight>, u64),
}

thread_local! {
    static PENDING: RefCell<HashMap<(i64, u64), Pending>> = RefCell::new(HashMap::new());
    static NEXT_TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(1) };
}

/// Submits `op` on file handle `f` (pinned for this call); the operation holds the file
/// until its completion is polled, so a release meanwhile does not delete it under the
/// operation ([`handles::InFlight`]).
fn submit(
    fs: &FsRef,
    f: &handles::FileRef,
    op: Op,
    user_token: u64,
    read_into: Option<(*mut u8, usize)>,
) -> Result<(), Error> {
    let token = NEXT_TOKEN.with(|t| {
        let v = t.get();
        t.set(v + 1);
        v
    });
    let in_flight = f.in_flight();
    in_flight.begin();
    let submitted = with_client(fs, |c| c.submit(op, token)).and_then(|r| {
        r.map_err(|e| match e {
            reactor::SubmitError::Full(_) => Error::new(
                libc::EAGAIN,
                "queue full: poll completions and submit again".into(),
            ),
            reactor::SubmitError::Stopped(_) => {
                Error::new(libc::EBADF, "the filesystem is closing".into())
            }
        })
    });
    if let Err(e) = submitted {
        // The pin keeps the handle from being released during this call.
        assert!(!in_flight.end(), "a handle released under a pinned call");
        return Err(e);
    }
    PENDING.with(|p| {
        p.borrow_mut().insert(
            (fs.id, token),
            Pending {
                user_token,
                read_into,
                holds: (in_flight, f.ino),
            },
        )
    });
    Ok(())
}

/// Submits a read of up to `len` bytes at `offset` into `buf` (bounded as `corefs_pread`);
/// its completion (on this thread's queue, see `corefs_poll`) carries `token` and the bytes
/// read. -EAGAIN when this thread has 256 operations in flight: poll, then submit again.
///
/// # Safety
/// `buf` stays valid for writing `len` bytes until the completion is polled, on this thread.
#[no_mangle]
pub unsafe extern "C" fn corefs_submit_pread(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *mut u8,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    status("corefs_submit_pread", || {
        if buf.is_null() && len > 0 {
            return Err(efault("buf"));
        }
        let len = io_len(offset, len)?;
        let fs = fs_of(fs)?;
        let f = regular(&fs, fd)?;
        no_batch(&f, fd)?;
        need_readable(&f, fd)?;
        submit(
            &fs,
            &f,
            Op::Read {
                ino: f.ino,
                offset,
                len,
            },
            token,
            Some((buf, len)),
        )
    })
}

/// Submits a write of `len` bytes at `offset` (bounded as `corefs_pwrite`, and an atomic
/// append through a COREFS_O_APPEND handle; the data is copied: `buf` may be reused at
/// once). Completion as `corefs_submit_pread`.
///
/// # Safety
/// `buf` is valid for reading `len` bytes during the call.
#[no_mangle]
pub unsafe extern "C" fn corefs_submit_pwrite(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *const u8,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    status("corefs_submit_pwrite", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        no_batch(&f, fd)?;
        // Bounded before the copy: a huge `len` never sizes an allocation.
        let len = io_len(if f.append { 0 } else { offset }, len)?;
        // SAFETY: forwarded from this function's contract (`len` only shrank).
        let data = unsafe { bytes(buf, len, "buf") }?.to_vec();
        submit(&fs, &f, write_op(&f, offset, data), token, None)
    })
}

/// Submits an fsync (`datasync` non-zero: fdatasync). fsyncs submitted together, from any
/// threads, share one log record and one flush. Operations of one thread run in the order
/// submitted, so an fsync covers the writes submitted before it.
#[no_mangle]
pub extern "C" fn corefs_submit_fsync(
    fs: corefs_fs,
    fd: corefs_fd,
    datasync: c_int,
    token: u64,
) -> c_int {
    status("corefs_submit_fsync", || {
        let fs = fs_of(fs)?;
        let f = file(&fs, fd)?;
        submit(&fs, &f, sync_op(f.ino, datasync != 0), token, None)
    })
}

/// Moves up to `max` completions of this thread's asynchronous operations into `out`, waiting
/// up to `timeout_us` microseconds for the first (0: do not wait). Returns how many. A poll
/// that finds completions left from an earlier poll (past its `max`) returns them without
/// waiting.
///
/// # Safety
/// `out` is valid for writing `max` completions.
#[no_mangle]
pub unsafe extern "C" fn corefs_poll(
    fs: corefs_fs,
    out: *mut corefs_completion,
    max: usize,
    timeout_us: u64,
) -> i64 {
    guard("corefs_poll", || {
        if max == 0 {
            return Ok(0);
        }
        if out.is_null() {
            return Err(efault("out"));
        }
        let fs = fs_of(fs)?;
        let mut done = Vec::new();
        // A completion left over from an earlier poll is an answer in hand: waiting for a new
        // one then held it back for a whole device round trip. fio reaps one completion per
        // call at queue depth 32, so each of its polls waited for the next read to finish
        // while the others sat here: 20k IOPS with under one read on the device, where the
        // same image reads 95k.
        let in_hand = OVERFLOW.with(|o| {
            o.borrow().get(&fs.id).is_some_and(|list| {
                PENDING.with(|p| {
                    let pending = p.borrow();
                    list.iter()
                        .any(|(token, _)| pending.contains_key(&(fs.id, *token)))
                })
            })
        });
        with_client(&fs, |c| {
            if timeout_us == 0 || in_hand {
                c.poll(&mut done);
            } else {
                c.wait(&mut done, Duration::from_micros(timeout_us));
            }
        })?;
        // Completions past `max` wait in this thread's overflow list for the next poll.
        let mut written = 0usize;
        let mut released_after = Vec::new();
        OVERFLOW.with(|o| {
            let mut overflow = o.borrow_mut();
            let list = overflow.entry(fs.id).or_default();
            list.extend(done.into_iter().map(|c| (c.token, c.result)));
            while written < max {
                let Some((token, result)) = list.pop_front() else {
                    break;
                };
                let Some(pending) = PENDING.with(|p| p.borrow_mut().remove(&(fs.id, token))) else {
                    continue; // a synchronous call's completion never lands here
                };
                let (in_flight, ino) = &pending.holds;
                if in_flight.end() {
                    released_after.push(*ino);
                }
                let value = match result {
                    Ok(Reply::Data(data)) => {
                        let (buf, len) = pending.read_into.unwrap_or((std::ptr::null_mut(), 0));
                        let n = data.len().min(len);
                        if n > 0 {
                            // SAFETY: the submitter promised `buf` valid for `len` bytes until
                            // this completion is polled.
                            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, n) };
                        }
                        n as i64
                    }
                    Ok(Reply::Written(n) | Reply::Appended { written: n, .. }) => n as i64,
                    Ok(_) => 0,
                    Err(e) => -(e.errno() as i64),
                };
                // SAFETY: written < max, and `out` holds `max` entries by contract.
                unsafe {
                    out.add(written).write(corefs_completion {
                        token: pending.user_token,
                        result: value,
                    })
                };
                written += 1;
            }
        });
        // Files whose handle was released while these were in flight: released now that
        // their last operation is answered (outside the thread-local borrows above).
        for ino in released_after {
            if let Err(e) = call(&fs, Op::Release { ino }) {
                tracing::warn!(
                    ino,
                    "releasing a file after its last asynchronous operation: {}",
                    e.message
                );
            }
        }
        Ok(written as i64)
    })
}

/// Completions polled from the client but not yet handed to C (more than `max` arrived).
type Overflow = HashMap<i64, std::collections::VecDeque<(u64, Result<Reply, engine::EngineError>)>>;

thread_local! {
    static OVERFLOW: RefCell<Overflow> = RefCell::new(HashMap::new());
}

// ---- Aligned buffers ----------------------------------------------------------------------

/// Allocates a 4 KiB-aligned buffer of `len` bytes (zeroed) for I/O; NULL on failure. Today
/// the engine copies data between such buffers and its DMA slab: they save the caller an
/// alignment step, not a copy.
#[no_mangle]
pub extern "C" fn corefs_buf_alloc(len: usize) -> *mut u8 {
    guard_or("corefs_buf_alloc", std::ptr::null_mut(), || {
        if len == 0 || len > (1 << 30) {
            set_error("corefs_buf_alloc: length must be 1 byte to 1 GiB");
            return std::ptr::null_mut();
        }
        match std::alloc::Layout::from_size_align(len, 4096) {
            // SAFETY: the layout has a non-zero size.
            Ok(layout) => unsafe { std::alloc::alloc_zeroed(layout) },
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// Frees a buffer from `corefs_buf_alloc` (`len` as allocated). NULL is ignored.
///
/// # Safety
/// `buf` is NULL or came from `corefs_buf_alloc(len)` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn corefs_buf_free(buf: *mut u8, len: usize) {
    guard_or("corefs_buf_free", (), || {
        if buf.is_null() || len == 0 {
            return;
        }
        if let Ok(layout) = std::alloc::Layout::from_size_align(len, 4096) {
            // SAFETY: allocated by corefs_buf_alloc with this layout, by contract.
            unsafe { std::alloc::dealloc(buf, layout) };
        }
    })
}

/// For Rust programs measuring libcorefs (not in the header): the reactors' statistics as
/// the runtime keeps them (`corefs_get_stats` gives C programs a summary).
#[doc(hidden)]
pub fn reactor_stats(fs: corefs_fs) -> Option<reactor::ReactorStats> {
    let fs = fs_of(fs).ok()?;
    match call(&fs, Op::Stats) {
        Ok(Reply::Stats(stats)) => Some(*stats),
        _ => None,
    }
}

/// Test hook (Rust only, not in the header): the requests this thread has sent to the
/// reactors of filesystem `fs` (each a round trip), or None when `fs` is not open.
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_requests_sent(fs: corefs_fs) -> Option<u64> {
    let fs = fs_of(fs).ok()?;
    with_client(&fs, |c| c.requests_sent()).ok()
}

/// Test hook (Rust only, not in the header): the requests this thread ran itself on the
/// reactor's engine while the reactor slept (no round trip), or None when `fs` is not open.
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_requests_ran_here(fs: corefs_fs) -> Option<u64> {
    let fs = fs_of(fs).ok()?;
    with_client(&fs, |c| c.requests_ran_here()).ok()
}

/// Test hook (Rust only, not in the header): the per-thread clients alive in this process,
/// over every filesystem.
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_thread_clients() -> i64 {
    handles::thread_clients()
}

/// Test hook (Rust only, not in the header): reactor `reactor` of filesystem `fs` panics
/// when it next runs a request. Does nothing and returns false unless the library was
/// built with the reactor's `test-hooks` feature, which only tests turn on.
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_panic_on_next_request(fs: corefs_fs, reactor: usize) -> bool {
    let Ok(fs) = fs_of(fs) else {
        return false;
    };
    let runtime = fs.runtime.lock().unwrap_or_else(|p| p.into_inner());
    runtime
        .as_ref()
        .is_some_and(|r| reactor < r.reactors() && r.panic_on_next_request(reactor))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads a committed block three times on a fresh mount of a memory device with
    /// `data_cache_off` as given; returns the engine's data-cache hits.
    fn cache_hits_of_rereads(data_cache_off: u8) -> u64 {
        let o = corefs_options {
            format: 1,
            data_cache_off,
            ..Default::default()
        };
        // SAFETY: valid NUL-terminated strings, live buffers of the lengths given, and the
        // handles these calls return.
        unsafe {
            let fs = corefs_mount(c"mem:64MiB".as_ptr(), &o);
            assert!(fs > 0, "mount: {fs}");
            let fd = corefs_open(fs, c"/f".as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644);
            assert!(fd > 0, "open: {fd}");
            let block = [0x5au8; 4096];
            assert_eq!(corefs_pwrite(fs, fd, block.as_ptr(), block.len(), 0), 4096);
            // Committed: the block is read back from the device, not from dirty memory.
            assert_eq!(corefs_sync(fs), 0);
            let mut back = [0u8; 4096];
            for _ in 0..3 {
                assert_eq!(corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 0), 4096);
                assert_eq!(back, block);
            }
            let fsr = fs_of(fs).unwrap();
            let stats =
                expect_reply!(call(&fsr, Op::Stats).unwrap(), Reply::Stats(s) => s).unwrap();
            drop(fsr);
            assert_eq!(corefs_release(fs, fd), 0);
            assert_eq!(corefs_close(fs), 0);
            stats.data_cache_hits
        }
    }

    #[test]
    fn data_cache_off_sends_every_read_of_committed_data_to_the_device() {
        assert!(
            cache_hits_of_rereads(0) > 0,
            "with the cache, a block read again is a hit"
        );
        assert_eq!(
            cache_hits_of_rereads(1),
            0,
            "data_cache_off: no read is a hit"
        );
    }
}
