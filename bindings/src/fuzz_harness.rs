//! The C ABI under random calls (the `c_abi` cargo-fuzz target and a seeded test): each byte
//! string is a program of calls on a fresh in-memory filesystem with random handles (valid,
//! closed, zero, negative, huge), random flags, modes, offsets and sizes, NULL or valid
//! pointers, paths good and bad. Every call must return a value or a negative errno — never
//! panic, crash or hang — and the filesystem must close cleanly afterwards.
//!
//! Pointers are either NULL or valid for the length passed with them: a C caller that passes
//! a length longer than its buffer breaks the contract, which no library can check.

use crate::abi::*;
use std::ffi::{c_char, CString};

/// A cursor over the fuzz input.
struct Input<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn u8(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(b)
    }
    fn u64(&mut self) -> u64 {
        let mut v = 0u64;
        for _ in 0..8 {
            v = v << 8 | self.u8().unwrap_or(0) as u64;
        }
        v
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.u8().unwrap_or(0) as usize % from.len()]
    }
}

const BUF_BYTES: usize = 1 << 16;
const DIRENTS: usize = 16;
const COMPLETIONS: usize = 16;

/// Runs the program in `bytes`.
pub fn abi_calls(bytes: &[u8]) {
    let device = CString::new("mem:16MiB").expect("no NUL");
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let mut options: corefs_options = unsafe { std::mem::zeroed() };
    options.format = 1;
    options.shards = 2;
    // SAFETY: device is NUL-terminated; options is a valid struct.
    let fs = unsafe { corefs_mount(device.as_ptr(), &options) };
    assert!(fs > 0, "mounting a memory device failed: {fs}");

    let long = "n".repeat(300);
    let path_texts: [&[u8]; 16] = [
        b"a",
        b"b",
        b"d",
        b"d/x",
        b"d/y",
        b"",
        b"/",
        b"a/b",
        b"..",
        b".",
        b"d/../a",
        long.as_bytes(),
        b"/d//x/",
        b"a/",
        b"d/\xff\xfe",
        b"d/./x/..",
    ];
    let paths: Vec<CString> = path_texts
        .iter()
        .map(|p| CString::new(*p).expect("no NUL"))
        .collect();
    let names: Vec<CString> = ["user.a", "user.b", "", "trusted.x", &long]
        .iter()
        .map(|n| CString::new(*n).expect("no NUL"))
        .collect();
    // Buffers outlive every asynchronous request made with them (drained below).
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; BUF_BYTES]).collect();
    // SAFETY: all-zero values are valid for these plain C structs.
    let mut st: corefs_stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut stats: corefs_stats = unsafe { std::mem::zeroed() };
    let mut statfs = corefs_statfs::default();
    let mut dirents: Vec<corefs_dirent> = (0..DIRENTS)
        // SAFETY: as above.
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    let mut completions: Vec<corefs_completion> = (0..COMPLETIONS)
        // SAFETY: as above.
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    let mut fds: Vec<corefs_fd> = vec![0, -1, 1, i64::MAX, 1 << 40];
    let mut pending = 0i64;
    let flag_choices = [
        0,
        1,
        2,
        0o100,
        0o102,
        0o302,
        0o1102,
        0o2002,
        0o200000,
        0o100000,
        -1,
        0x7fff_ffff,
    ];
    let mut input = Input { bytes, at: 0 };
    let mut steps = 0;
    while let Some(op) = input.u8() {
        steps += 1;
        if steps > 400 {
            break;
        }
        let h = input.pick(&[fs, fs, fs, 0, -1, fs + 7]);
        let fd = input.pick(&fds);
        let path = &paths[input.u8().unwrap_or(0) as usize % paths.len()];
        let path2 = &paths[input.u8().unwrap_or(0) as usize % paths.len()];
        let p: *const c_char = if input.u8().unwrap_or(1) % 16 == 0 {
            std::ptr::null()
        } else {
            path.as_ptr()
        };
        let b = input.u8().unwrap_or(0) as usize % bufs.len();
        let null_buf = input.u8().unwrap_or(1) % 16 == 0;
        let len = input.u64() as usize % (BUF_BYTES + 1);
        let offset = match input.u8().unwrap_or(0) % 4 {
            0 => 0,
            1 => input.u64() % (1 << 20),
            2 => input.u64() % (1 << 40),
            _ => input.u64(),
        };
        let flags = input.pick(&flag_choices);
        let mode = input.u64() as u32;
        let buf_mut: *mut u8 = if null_buf {
            std::ptr::null_mut()
        } else {
            bufs[b].as_mut_ptr()
        };
        let buf: *const u8 = buf_mut;
        let name = &names[input.u8().unwrap_or(0) as usize % names.len()];
        // SAFETY: every call below gets pointers that are NULL or valid for the lengths given
        // with them, NUL-terminated strings, and async buffers that live until drained.
        unsafe {
            match op % 32 {
                0 | 1 => {
                    let r = corefs_open(h, p, flags, mode);
                    if r > 0 {
                        fds.push(r);
                    }
                }
                2 => {
                    corefs_release(h, fd);
                }
                3 => {
                    corefs_pread(h, fd, buf_mut, len, offset);
                }
                4 | 5 => {
                    corefs_pwrite(h, fd, buf, len, offset);
                }
                6 => {
                    corefs_fsync(h, fd);
                }
                7 => {
                    corefs_fdatasync(h, fd);
                }
                8 => {
                    corefs_ftruncate(h, fd, offset % (1 << 24));
                }
                9 => {
                    corefs_fallocate(h, fd, flags, offset, input.u64() % (1 << 22));
                }
                10 => {
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        &mut st
                    };
                    corefs_fstat(h, fd, out);
                }
                11 => {
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        &mut st
                    };
                    corefs_stat(h, p, out);
                }
                12 => {
                    corefs_mkdir(h, p, mode);
                }
                13 => {
                    corefs_rmdir(h, p);
                }
                14 => {
                    corefs_unlink(h, p);
                }
                15 => {
                    corefs_rename(h, p, path2.as_ptr(), flags);
                }
                16 => {
                    corefs_link(h, p, path2.as_ptr());
                }
                17 => {
                    corefs_symlink(h, path2.as_ptr(), p);
                }
                18 => {
                    corefs_readlink(h, p, buf_mut, len);
                }
                19 => {
                    let max = (len % (DIRENTS + 1)).min(DIRENTS);
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        dirents.as_mut_ptr()
                    };
                    corefs_readdir(h, p, offset, out, max);
                }
                20 => {
                    corefs_setxattr(h, p, name.as_ptr(), buf, len % 5000, flags);
                }
                21 => {
                    corefs_getxattr(h, p, name.as_ptr(), buf_mut, len);
                }
                22 => {
                    corefs_listxattr(h, p, buf_mut, len);
                }
                23 => {
                    corefs_removexattr(h, p, name.as_ptr());
                }
                24 => {
                    let r = if op % 2 == 0 {
                        corefs_submit_pread(h, fd, buf_mut, len, offset, steps as u64)
                    } else {
                        corefs_submit_pwrite(h, fd, buf, len, offset, steps as u64)
                    };
                    if r == 0 {
                        pending += 1;
                    }
                }
                25 => {
                    if corefs_submit_fsync(h, fd, flags, steps as u64) == 0 {
                        pending += 1;
                    }
                }
                26 => {
                    let max = (len % (COMPLETIONS + 1)).min(COMPLETIONS);
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        completions.as_mut_ptr()
                    };
                    let n = corefs_poll(h, out, max, 0);
                    if n > 0 && h == fs {
                        pending -= n;
                    }
                }
                27 => {
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        &mut statfs
                    };
                    corefs_statfs(h, out);
                }
                28 => {
                    corefs_mknod(h, p, mode, offset);
                }
                29 => {
                    corefs_mkfifo(h, p, mode);
                }
                30 => {
                    let id = |v: u64| {
                        if v % 3 == 0 {
                            COREFS_OWNER_DEFAULT
                        } else {
                            v as u32
                        }
                    };
                    corefs_set_owner(h, id(offset), id(offset >> 32));
                }
                _ => {
                    let out = if null_buf {
                        std::ptr::null_mut()
                    } else {
                        &mut stats
                    };
                    corefs_get_stats(h, out);
                    corefs_sync(h);
                }
            }
        }
    }
    // Every asynchronous request completes before its buffer goes away.
    let mut rounds = 0;
    while pending > 0 {
        // SAFETY: valid output array of COMPLETIONS entries.
        let n = unsafe { corefs_poll(fs, completions.as_mut_ptr(), COMPLETIONS, 100_000) };
        assert!(n >= 0, "poll failed: {n}");
        pending -= n;
        rounds += 1;
        assert!(
            rounds < 10_000,
            "{pending} asynchronous requests never completed"
        );
    }
    assert_eq!(corefs_close(fs), 0, "close after the program");
    assert!(corefs_close(fs) < 0, "a second close is an error");
    // SAFETY: a valid struct pointer.
    let closed = unsafe { corefs_get_stats(fs, &mut stats) };
    assert!(closed < 0, "a closed handle");
    drop(bufs.pop());
}
