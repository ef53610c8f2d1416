//! File handles used, opened and released concurrently: reader threads read through handles
//! a closer thread releases under them (each the last handle of an unlinked file, so its
//! release deletes the inode), and open, read and release handles of their own. Every read
//! either returns the right bytes or -EBADF: never other bytes, never another error (a read
//! that reached an inode its release had deleted would be -ENOENT), never a crash.
//! Seeded (`COREFS_SEED` repeats a run); the seed is printed.

use corefs::abi::*;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes per file: four 4 KiB blocks.
const FILE_BYTES: usize = 16 << 10;
const BLOCK_BYTES: usize = 4096;
/// Handles the closer swaps under the readers.
const SLOTS: usize = 4;
const READERS: usize = 3;
/// Files the closer creates, publishes and releases (each a few reads' lifetime).
const SWAPS: u64 = 600;
/// The pause between resolving a handle and using it (the test hook's).
const PAUSE_AFTER_RESOLVE_US: u64 = 20;

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The byte at `offset` of file number `n`.
fn pattern(n: u64, offset: usize) -> u8 {
    let x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (offset as u64 / 8).wrapping_mul(0xbf58_476d);
    (x >> (offset % 8 * 8)) as u8 ^ (x >> 56) as u8
}

fn contents(n: u64) -> Vec<u8> {
    (0..FILE_BYTES).map(|o| pattern(n, o)).collect()
}

fn open(fs: corefs_fs, path: &str, flags: i32) -> corefs_fd {
    let p = CString::new(path).expect("no NUL");
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, p.as_ptr(), flags, 0o644) };
    assert!(fd > 0, "open {path}: {fd} {}", last_error());
    fd
}

/// Creates file `n` with its contents and returns a read-write handle to it.
fn create(fs: corefs_fs, path: &str, n: u64) -> corefs_fd {
    let fd = open(fs, path, COREFS_O_CREAT | COREFS_O_RDWR | COREFS_O_TRUNC);
    let data = contents(n);
    // SAFETY: `data` is readable for its length.
    let written = unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), 0) };
    assert_eq!(written, data.len() as i64, "pwrite: {}", last_error());
    fd
}

/// Reads a random block of file `n` through `fd`: Ok(true) with the right bytes, Ok(false)
/// on -EBADF, Err with what went wrong otherwise.
fn read_block(
    fs: corefs_fs,
    fd: corefs_fd,
    n: u64,
    rng: &mut Xoshiro256PlusPlus,
) -> Result<bool, String> {
    let block = rng.random_range(0..FILE_BYTES / BLOCK_BYTES);
    let offset = block * BLOCK_BYTES;
    let mut buf = vec![0u8; BLOCK_BYTES];
    // SAFETY: `buf` is writable for BLOCK_BYTES.
    let r = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), BLOCK_BYTES, offset as u64) };
    if r == -(libc::EBADF as i64) {
        return Ok(false);
    }
    if r != BLOCK_BYTES as i64 {
        return Err(format!(
            "pread of fd {fd} (file {n}) at {offset}: {r} ({})",
            last_error()
        ));
    }
    match (0..BLOCK_BYTES).find(|&i| buf[i] != pattern(n, offset + i)) {
        None => Ok(true),
        Some(i) => Err(format!(
            "fd {fd} (file {n}) byte {}: {:#x}, not {:#x}",
            offset + i,
            buf[i],
            pattern(n, offset + i)
        )),
    }
}

#[test]
fn reads_racing_releases_see_their_data_or_ebadf() {
    let seed = nvme::wrap::seed_from_env();

    // Calls on a handle pause between resolving it and reading, so releases land in that
    // window often (without the pin, such a read reaches a deleted inode: -ENOENT).
    corefs::test_hook_pause_after_resolve(PAUSE_AFTER_RESOLVE_US);
    let device = c"mem:64MiB";
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let mut o: corefs_options = unsafe { std::mem::zeroed() };
    o.format = 1;
    o.shards = 4;
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());

    // A named file every reader opens and releases handles of its own on (file number 0).
    let shared = create(fs, "/shared", 0);
    assert_eq!(corefs_release(fs, shared), 0);

    // Each slot holds (file number << 32 | fd); file numbers start at 1.
    let slots: Arc<Vec<AtomicU64>> = Arc::new(
        (0..SLOTS as u64)
            .map(|s| {
                let n = s + 1;
                let path = format!("/slot{n}");
                let fd = create(fs, &path, n);
                AtomicU64::new(n << 32 | fd as u64)
            })
            .collect(),
    );
    let done = Arc::new(AtomicBool::new(false));

    let readers: Vec<_> = (0..READERS as u64)
        .map(|r| {
            let (slots, done) = (slots.clone(), done.clone());
            std::thread::spawn(move || -> Result<(u64, u64), String> {
                let mut rng =
                    Xoshiro256PlusPlus::seed_from_u64(seed ^ ((r + 1) * 0x1234_5678_9abc));
                let (mut good, mut ebadf) = (0u64, 0u64);
                while !done.load(Ordering::Relaxed) {
                    if rng.random_ratio(1, 16) {
                        // A handle of its own: open, read, release.
                        let fd = open(fs, "/shared", COREFS_O_RDONLY);
                        if !read_block(fs, fd, 0, &mut rng)? {
                            return Err(format!("EBADF through its own open handle {fd}"));
                        }
                        let released = corefs_release(fs, fd);
                        if released != 0 {
                            return Err(format!("release {fd}: {released} {}", last_error()));
                        }
                        // Released: EBADF from now on.
                        if read_block(fs, fd, 0, &mut rng)? {
                            return Err(format!("a read through released handle {fd} worked"));
                        }
                        continue;
                    }
                    let packed = slots[rng.random_range(0..SLOTS)].load(Ordering::Acquire);
                    let (n, fd) = (packed >> 32, (packed & 0xffff_ffff) as i64);
                    // Several reads through one handle: the later ones may come after the
                    // closer swapped it out and released it.
                    for _ in 0..rng.random_range(1..=4) {
                        if read_block(fs, fd, n, &mut rng)? {
                            good += 1;
                        } else {
                            ebadf += 1;
                        }
                    }
                }
                Ok((good, ebadf))
            })
        })
        .collect();

    // The closer: a new unlinked file in a slot, then the release of the one it replaced,
    // which (its last handle, no name) deletes that inode while readers may be reading it.
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for swap in 0..SWAPS {
        let n = SLOTS as u64 + 1 + swap;
        let path = format!("/f{n}");
        let fd = create(fs, &path, n);
        let p = CString::new(path).expect("no NUL");
        // SAFETY: a NUL-terminated path.
        let unlinked = unsafe { corefs_unlink(fs, p.as_ptr()) };
        assert_eq!(unlinked, 0, "unlink: {}", last_error());
        let slot = rng.random_range(0..SLOTS);
        let old = slots[slot].swap(n << 32 | fd as u64, Ordering::AcqRel);
        let old_fd = (old & 0xffff_ffff) as i64;
        assert_eq!(corefs_release(fs, old_fd), 0, "release: {}", last_error());
        assert_eq!(corefs_release(fs, old_fd), -libc::EBADF, "a second release");
    }
    done.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    let (mut good, mut ebadf) = (0, 0);
    for r in readers {
        match r.join().expect("reader thread") {
            Ok((g, e)) => {
                good += g;
                ebadf += e;
            }
            Err(e) => failures.push(e),
        }
    }
    println!("{good} reads right, {ebadf} EBADF, {SWAPS} handles released under them");
    assert!(failures.is_empty(), "seed {seed}: {failures:?}");
    assert!(good > 0, "no read got through");
    for s in slots.iter() {
        let fd = (s.load(Ordering::Relaxed) & 0xffff_ffff) as i64;
        assert_eq!(corefs_release(fs, fd), 0);
    }
    assert_eq!(corefs_close(fs), 0, "close: {}", last_error());
}
