//! Atomic batches through the C functions (`corefs_atomic_begin` / `_commit` / `_abort`):
//! staged writes are read back through their handle and seen by no other handle until the
//! commit, an abort drops them, and every misuse is an errno. Crashes: engine/tests/atomic.rs
//! (every cut of the device's writes) and the SQLite test (kill -9 behind a volatile cache).

use corefs::abi::*;
use std::ffi::{CStr, CString};

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn fresh() -> corefs_fs {
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let mut o: corefs_options = unsafe { std::mem::zeroed() };
    o.format = 1;
    o.shards = 4;
    let device = CString::new("mem:64MiB").unwrap();
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    fs
}

fn open(fs: corefs_fs, path: &str, flags: i32) -> corefs_fd {
    let p = CString::new(path).unwrap();
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, p.as_ptr(), flags, 0o644) };
    assert!(fd > 0, "open {path}: {fd} {}", last_error());
    fd
}

fn pwrite(fs: corefs_fs, fd: corefs_fd, data: &[u8], offset: u64) -> i64 {
    // SAFETY: `data` is valid for its length.
    unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), offset) }
}

fn pread(fs: corefs_fs, fd: corefs_fd, len: usize, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: `buf` is valid for `len` bytes.
    let n = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), len, offset) };
    assert!(n >= 0, "pread: {n} {}", last_error());
    buf.truncate(n as usize);
    buf
}

fn size(fs: corefs_fs, fd: corefs_fd) -> u64 {
    // SAFETY: all-zero is a valid corefs_stat.
    let mut st: corefs_stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable.
    let status = unsafe { corefs_fstat(fs, fd, &mut st) };
    assert_eq!(status, 0, "{}", last_error());
    st.size
}

#[test]
fn a_batch_is_read_back_through_its_handle_and_seen_elsewhere_only_after_its_commit() {
    let fs = fresh();
    let fd = open(fs, "db", COREFS_O_CREAT | COREFS_O_RDWR);
    let other = open(fs, "db", COREFS_O_RDONLY);
    assert_eq!(pwrite(fs, fd, &[1u8; 8192], 0), 8192);
    assert_eq!(corefs_atomic_begin(fs, fd), 0, "{}", last_error());
    assert_eq!(pwrite(fs, fd, &[2u8; 100], 4000), 100);
    assert_eq!(pwrite(fs, fd, &[3u8; 4096], 12288), 4096);
    // Through the batch's handle: the staged bytes, the hole before them, the new size.
    let seen = pread(fs, fd, 20000, 0);
    assert_eq!(seen.len(), 16384);
    assert_eq!(&seen[3990..4000], &[1u8; 10]);
    assert_eq!(&seen[4000..4100], &[2u8; 100]);
    assert_eq!(&seen[4100..8192], &[1u8; 4092][..]);
    assert_eq!(&seen[8192..12288], &[0u8; 4096][..]);
    assert_eq!(&seen[12288..], &[3u8; 4096][..]);
    assert_eq!(size(fs, fd), 16384);
    // Through another handle: the file as it was.
    assert_eq!(pread(fs, other, 20000, 0), vec![1u8; 8192]);
    assert_eq!(size(fs, other), 8192);
    assert_eq!(corefs_atomic_commit(fs, fd), 0, "{}", last_error());
    assert_eq!(pread(fs, other, 20000, 0), seen);
    assert_eq!(corefs_release(fs, other), 0);
    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
}

#[test]
fn an_abort_drops_the_batch_and_a_release_drops_an_open_one() {
    let fs = fresh();
    let fd = open(fs, "db", COREFS_O_CREAT | COREFS_O_RDWR);
    assert_eq!(pwrite(fs, fd, &[1u8; 4096], 0), 4096);
    assert_eq!(corefs_atomic_begin(fs, fd), 0);
    assert_eq!(pwrite(fs, fd, &[9u8; 4096], 0), 4096);
    assert_eq!(corefs_atomic_abort(fs, fd), 0);
    assert_eq!(pread(fs, fd, 8192, 0), vec![1u8; 4096]);
    // A batch left open goes with its handle; the next handle starts without one.
    assert_eq!(corefs_atomic_begin(fs, fd), 0);
    assert_eq!(pwrite(fs, fd, &[9u8; 4096], 0), 4096);
    assert_eq!(corefs_release(fs, fd), 0);
    let fd = open(fs, "db", COREFS_O_RDWR);
    assert_eq!(pread(fs, fd, 8192, 0), vec![1u8; 4096]);
    assert_eq!(corefs_atomic_commit(fs, fd), -libc::EINVAL);
    assert_eq!(corefs_close(fs), 0);
}

#[test]
fn misuse_is_an_errno() {
    let fs = fresh();
    let fd = open(fs, "db", COREFS_O_CREAT | COREFS_O_RDWR);
    let ro = open(fs, "db", COREFS_O_RDONLY);
    let app = open(fs, "db", COREFS_O_WRONLY | COREFS_O_APPEND);
    let dir = open(fs, "/", COREFS_O_RDONLY | COREFS_O_DIRECTORY);
    assert_eq!(corefs_atomic_begin(fs, 999), -libc::EBADF);
    assert_eq!(corefs_atomic_begin(999, fd), -libc::EBADF);
    assert_eq!(corefs_atomic_begin(fs, ro), -libc::EBADF);
    assert_eq!(corefs_atomic_begin(fs, app), -libc::EINVAL);
    assert_eq!(corefs_atomic_begin(fs, dir), -libc::EISDIR);
    assert_eq!(corefs_atomic_commit(fs, fd), -libc::EINVAL);
    assert_eq!(corefs_atomic_abort(fs, fd), -libc::EINVAL);
    assert_eq!(corefs_atomic_abort(fs, 999), -libc::EBADF);
    assert_eq!(corefs_atomic_begin(fs, fd), 0);
    assert_eq!(
        corefs_atomic_begin(fs, fd),
        -libc::EINVAL,
        "one batch per handle"
    );
    assert_eq!(corefs_ftruncate(fs, fd, 0), -libc::EINVAL);
    assert_eq!(corefs_fallocate(fs, fd, 0, 0, 4096), -libc::EINVAL);
    // SAFETY: the buffer is valid for its length.
    let submitted = unsafe { corefs_submit_pwrite(fs, fd, [0u8; 1].as_ptr(), 1, 0, 1) };
    assert_eq!(submitted, -libc::EINVAL);
    // Past the batch's bound: EFBIG, nothing staged, the batch still usable.
    let big = vec![5u8; 48 << 20];
    assert_eq!(pwrite(fs, fd, &big, 0), big.len() as i64);
    assert_eq!(pwrite(fs, fd, &big, 1 << 30), -libc::EFBIG as i64);
    assert_eq!(size(fs, fd), big.len() as u64);
    assert_eq!(corefs_atomic_abort(fs, fd), 0);
    assert_eq!(size(fs, fd), 0);
    // Other handles are not in a batch.
    assert_eq!(corefs_atomic_commit(fs, ro), -libc::EBADF);
    assert_eq!(corefs_close(fs), 0);
    assert_eq!(corefs_atomic_abort(fs, fd), -libc::EBADF);
}

/// Many batches overwriting the same pages on a small shard (1/64 of 1 GiB): their old
/// copies wait pinned for a commit, which a batch finding the shard full starts before
/// applying anything. (The reactor's pipelined commits are in play here, unlike in the
/// engine's tests.)
#[test]
fn batches_overwriting_pages_on_a_small_shard_never_fail() {
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let mut o: corefs_options = unsafe { std::mem::zeroed() };
    o.format = 1;
    let device = CString::new("mem:1GiB").unwrap();
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    let fd = open(fs, "db", COREFS_O_CREAT | COREFS_O_RDWR);
    for n in 0..6000u64 {
        assert_eq!(corefs_atomic_begin(fs, fd), 0, "{}", last_error());
        let page = [n as u8; 4096];
        for at in [0, 1 + n / 40, 2 + n / 40] {
            assert_eq!(pwrite(fs, fd, &page, at * 4096), 4096);
        }
        let rc = corefs_atomic_commit(fs, fd);
        assert_eq!(rc, 0, "batch {n}: {}", last_error());
    }
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
}
