//! The C ABI. cbindgen turns this module (this file, then the files of its calls in the
//! order declared below) into `include/corefs.h`; every doc comment here is the header's
//! documentation.
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
use reactor::{Config, IdlePolicy, Op, OpenHow, Opened, Owner, Reply, Runtime, SAME_DIR};
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
        then.walked_to(ROOT_INO);
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
        if let Some((dirs, last)) = path::plain_entry(&parsed.parts) {
            return call(fs, walk(&dirs, op(0, last)));
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

// The calls, by what they are about. cbindgen reads the files in this order, which is the
// header's.
mod bufs;
mod files;
mod info;
mod lifecycle;
mod names;
mod submit;
mod xattr;
pub use bufs::*;
pub use files::*;
pub use info::*;
pub use lifecycle::*;
pub use names::*;
pub use submit::*;
pub use xattr::*;

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

/// Test hook (Rust only, not in the header): whether this thread's submitted operations on
/// `fs` are a stream of large transfers, waited for asleep; None when `fs` is not open.
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_streaming(fs: corefs_fs) -> Option<bool> {
    let fs = fs_of(fs).ok()?;
    with_client(&fs, |c| c.streaming()).ok()
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
    fn in_process_locks_are_one_owners_and_check_the_handle() {
        let o = corefs_options {
            format: 1,
            ..Default::default()
        };
        // SAFETY: valid NUL-terminated strings and the handles these calls return.
        unsafe {
            let fs = corefs_mount(c"mem:64MiB".as_ptr(), &o);
            assert!(fs > 0, "mount: {fs}");
            let rw = corefs_open(fs, c"/db".as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644);
            let ro = corefs_open(fs, c"/db".as_ptr(), libc::O_RDONLY, 0);
            assert!(rw > 0 && ro > 0);
            assert_eq!(corefs_setlk(fs, rw, COREFS_LOCK_WRITE, 0, 10), 0);
            // The process is one owner: its other handle's read lock replaces nothing and
            // does not conflict (POSIX: a process's own locks never block it).
            assert_eq!(corefs_setlk(fs, ro, COREFS_LOCK_READ, 5, 10), 0);
            assert_eq!(corefs_testlk(fs, ro, COREFS_LOCK_WRITE, 0, 0), 0);
            assert_eq!(corefs_setlk(fs, ro, COREFS_LOCK_WRITE, 0, 1), -libc::EBADF);
            assert_eq!(corefs_setlk(fs, rw, 7, 0, 1), -libc::EINVAL);
            assert_eq!(corefs_setlk(fs, 999, COREFS_LOCK_READ, 0, 1), -libc::EBADF);
            assert_eq!(corefs_setlk(fs, rw, COREFS_LOCK_UNLOCK, 0, 0), 0);
            assert_eq!(corefs_release(fs, ro), 0);
            assert_eq!(corefs_release(fs, rw), 0);
            assert_eq!(corefs_close(fs), 0);
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
