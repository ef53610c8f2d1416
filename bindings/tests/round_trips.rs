//! Every C ABI call is one round trip to the reactors: a call that acts on a path of plain
//! names sends the walk and the act as one request (the reactors walk, handing the walk on
//! where a directory is another reactor's), open(O_CREAT|O_TRUNC) included; a rename within
//! one directory too, one across directories two (two directories to walk). Counted by the
//! requests this thread's client submitted (`test_hook_requests_sent`), over a deep path
//! whose directories lie on every reactor, with one and with two reactors; the results are
//! checked too, so a call that got cheaper by doing less fails here. A lookup may also run
//! in the calling thread while the reactor sleeps (no request at all,
//! `test_hook_requests_ran_here`): each call is then one request or one run here, never
//! both and never more.

use corefs::abi::*;
use std::ffi::{CStr, CString};

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(path: &str) -> CString {
    CString::new(path).expect("no NUL in a test path")
}

fn fresh(reactors: u8) -> corefs_fs {
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let o = corefs_options {
        format: 1,
        shards: 4,
        reactors,
        ..unsafe { std::mem::zeroed() }
    };
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(c"mem:64MiB".as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    fs
}

fn sent(fs: corefs_fs) -> u64 {
    test_hook_requests_sent(fs).expect("the filesystem is open")
}

fn ran_here(fs: corefs_fs) -> u64 {
    test_hook_requests_ran_here(fs).expect("the filesystem is open")
}

/// Runs `call` and asserts it sent exactly one request, or ran once in this thread and
/// sent none; returns its result.
fn once<T>(fs: corefs_fs, what: &str, call: impl FnOnce() -> T) -> T {
    let (before, before_here) = (sent(fs), ran_here(fs));
    let result = call();
    let requests = sent(fs) - before;
    let here = ran_here(fs) - before_here;
    assert_eq!(
        requests + here,
        1,
        "{what} sent {requests} requests and ran {here} times in the caller"
    );
    result
}

/// Runs `call` and asserts it made at most `max` requests (or runs in this thread).
fn at_most<T>(fs: corefs_fs, max: u64, what: &str, call: impl FnOnce() -> T) -> T {
    let (before, before_here) = (sent(fs), ran_here(fs));
    let result = call();
    let made = sent(fs) - before + ran_here(fs) - before_here;
    assert!(
        (1..=max).contains(&made),
        "{what} made {made} requests (at most {max})"
    );
    result
}

fn open(fs: corefs_fs, path: &str, flags: i32) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_open(fs, p.as_ptr(), flags, 0o644) }
}

fn stat(fs: corefs_fs, path: &str) -> Result<corefs_stat, i32> {
    let p = c(path);
    // SAFETY: all-zero is a valid corefs_stat; a NUL-terminated path and a live output.
    let mut out: corefs_stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    match unsafe { corefs_stat(fs, p.as_ptr(), &mut out) } {
        0 => Ok(out),
        e => Err(e),
    }
}

fn path_call(
    fs: corefs_fs,
    path: &str,
    f: unsafe extern "C" fn(corefs_fs, *const std::ffi::c_char) -> i32,
) -> i32 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { f(fs, p.as_ptr()) }
}

fn calls_are_one_request_each(reactors: u8) {
    let fs = fresh(reactors);
    // Directories go round-robin over the shards: with two reactors, the walk to `a/b/c`
    // crosses from one reactor to the other and back.
    let mut dir = String::new();
    for name in ["a", "b", "c"] {
        dir = if dir.is_empty() {
            name.to_string()
        } else {
            format!("{dir}/{name}")
        };
        let p = c(&dir);
        // SAFETY: a NUL-terminated path.
        let made = once(fs, "mkdir", || unsafe {
            corefs_mkdir(fs, p.as_ptr(), 0o755)
        });
        assert_eq!(made, 0, "mkdir {dir}: {}", last_error());
    }
    let file = format!("{dir}/f");
    let creat = COREFS_O_CREAT | COREFS_O_EXCL | COREFS_O_RDWR;
    let fd = once(fs, "open(O_CREAT|O_EXCL) of a new file", || {
        open(fs, &file, creat)
    });
    assert!(fd >= 0, "create {file}: {}", last_error());
    let data = [7u8; 5000];
    // SAFETY: a live buffer of the length given.
    let wrote = once(fs, "pwrite", || unsafe {
        corefs_pwrite(fs, fd, data.as_ptr(), data.len(), 0)
    });
    assert_eq!(wrote, data.len() as i64, "{}", last_error());
    assert_eq!(once(fs, "fsync", || corefs_fsync(fs, fd)), 0);
    let mut back = [0u8; 5000];
    // SAFETY: a live buffer of the length given.
    let read = once(fs, "pread", || unsafe {
        corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 0)
    });
    assert_eq!((read, back), (data.len() as i64, data));
    // SAFETY: all-zero is a valid corefs_stat; a live output.
    let mut st: corefs_stat = unsafe { std::mem::zeroed() };
    // SAFETY: a live output.
    let r = once(fs, "fstat", || unsafe { corefs_fstat(fs, fd, &mut st) });
    assert_eq!((r, st.size), (0, 5000));
    // The rest of what goes through a handle.
    assert_eq!(once(fs, "fdatasync", || corefs_fdatasync(fs, fd)), 0);
    assert_eq!(once(fs, "ftruncate", || corefs_ftruncate(fs, fd, 6000)), 0);
    let r = once(fs, "fallocate", || corefs_fallocate(fs, fd, 0, 0, 8192));
    assert_eq!(r, 0, "{}", last_error());
    // SAFETY: a live output.
    let r = once(fs, "fstat after them", || unsafe {
        corefs_fstat(fs, fd, &mut st)
    });
    assert_eq!((r, st.size), (0, 8192), "ftruncate then fallocate");
    assert_eq!(
        once(fs, "ftruncate back", || corefs_ftruncate(fs, fd, 5000)),
        0
    );
    assert_eq!(once(fs, "release", || corefs_release(fs, fd)), 0);
    // And what acts on the whole filesystem.
    assert_eq!(once(fs, "sync", || corefs_sync(fs)), 0);
    // SAFETY: all-zero is a valid corefs_statfs; a live output.
    let mut sf: corefs_statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a live output.
    let r = once(fs, "statfs", || unsafe { corefs_statfs(fs, &mut sf) });
    assert_eq!(r, 0);
    assert!(sf.total_blocks > 0 && sf.free_blocks <= sf.total_blocks);

    // Opens of what exists, with each flag that adds work.
    let again = once(fs, "open(O_CREAT|O_EXCL) of an existing file", || {
        open(fs, &file, creat)
    });
    assert_eq!(again, -(libc::EEXIST as i64));
    let fd = once(fs, "open(O_CREAT) of an existing file", || {
        open(fs, &file, COREFS_O_CREAT | COREFS_O_RDWR)
    });
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(once(fs, "release", || corefs_release(fs, fd)), 0);
    let fd = once(fs, "open(O_RDONLY)", || open(fs, &file, COREFS_O_RDONLY));
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(corefs_release(fs, fd), 0);
    let s = once(fs, "stat", || stat(fs, &file)).expect("stat");
    assert_eq!(s.size, 5000);
    let fd = once(fs, "open(O_TRUNC)", || {
        open(fs, &file, COREFS_O_WRONLY | COREFS_O_TRUNC)
    });
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(stat(fs, &file).expect("stat").size, 0, "truncated");
    assert_eq!(corefs_release(fs, fd), 0);
    let fd = once(fs, "open(O_CREAT|O_TRUNC) of an existing file", || {
        open(fs, &file, COREFS_O_CREAT | COREFS_O_TRUNC | COREFS_O_RDWR)
    });
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(corefs_release(fs, fd), 0);
    let fd = once(fs, "open(O_DIRECTORY) of a directory", || {
        open(fs, &dir, COREFS_O_DIRECTORY)
    });
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(corefs_release(fs, fd), 0);

    // Errors are one request too, and the right ones.
    let missing = format!("{dir}/missing");
    assert_eq!(
        once(fs, "open of a missing file", || open(fs, &missing, 0)),
        -(libc::ENOENT as i64)
    );
    assert_eq!(
        once(fs, "open(O_DIRECTORY) of a file", || {
            open(fs, &file, COREFS_O_DIRECTORY)
        }),
        -(libc::ENOTDIR as i64)
    );
    assert_eq!(
        once(fs, "open(O_CREAT) of a directory", || {
            open(fs, &dir, COREFS_O_CREAT | COREFS_O_RDONLY)
        }),
        -(libc::EISDIR as i64)
    );
    assert_eq!(
        once(fs, "open(O_RDWR) of a directory", || {
            open(fs, &dir, COREFS_O_RDWR)
        }),
        -(libc::EISDIR as i64)
    );
    assert_eq!(
        once(fs, "open through a file", || {
            open(fs, &format!("{file}/x"), COREFS_O_CREAT | COREFS_O_RDWR)
        }),
        -(libc::ENOTDIR as i64)
    );
    assert!(
        stat(fs, &format!("{dir}/missing")).is_err(),
        "nothing was created by the failed opens"
    );

    // A file whose inode another reactor holds (a hard link from a directory elsewhere):
    // the open is handed on to it, still one request from here.
    let elsewhere = "a/linked";
    let (from, to) = (c(&file), c(elsewhere));
    // SAFETY: NUL-terminated paths.
    assert_eq!(unsafe { corefs_link(fs, from.as_ptr(), to.as_ptr()) }, 0);
    let fd = once(fs, "open of a name in another reactor's directory", || {
        open(fs, elsewhere, COREFS_O_RDWR | COREFS_O_TRUNC)
    });
    assert!(fd >= 0, "{}", last_error());
    assert_eq!(
        stat(fs, &file).expect("stat").ino,
        stat(fs, elsewhere).unwrap().ino
    );
    assert_eq!(corefs_release(fs, fd), 0);

    // The path calls.
    let p = c(&file);
    // SAFETY: NUL-terminated paths and live buffers of the lengths given.
    unsafe {
        assert_eq!(once(fs, "chmod", || corefs_chmod(fs, p.as_ptr(), 0o600)), 0);
        let (name, value) = (c"user.k", b"v");
        let set = once(fs, "setxattr", || {
            corefs_setxattr(fs, p.as_ptr(), name.as_ptr(), value.as_ptr(), 1, 0)
        });
        assert_eq!(set, 0, "{}", last_error());
        let mut got = [0u8; 8];
        let n = once(fs, "getxattr", || {
            corefs_getxattr(fs, p.as_ptr(), name.as_ptr(), got.as_mut_ptr(), got.len())
        });
        assert_eq!(&got[..n as usize], value);
        let link = c(&format!("{dir}/sym"));
        let target = c"f";
        let made = once(fs, "symlink", || {
            corefs_symlink(fs, target.as_ptr(), link.as_ptr())
        });
        assert_eq!(made, 0, "{}", last_error());
        let mut buf = [0u8; 8];
        let n = once(fs, "readlink", || {
            corefs_readlink(fs, link.as_ptr(), buf.as_mut_ptr(), buf.len())
        });
        assert_eq!(&buf[..n as usize], b"f");
        let mut list = [0u8; 64];
        let n = once(fs, "listxattr", || {
            corefs_listxattr(fs, p.as_ptr(), list.as_mut_ptr(), list.len())
        });
        assert_eq!(&list[..n as usize], b"user.k\0", "{}", last_error());
        let removed = once(fs, "removexattr", || {
            corefs_removexattr(fs, p.as_ptr(), name.as_ptr())
        });
        assert_eq!(removed, 0, "{}", last_error());
        let fifo = c(&format!("{dir}/fifo"));
        let made = once(fs, "mkfifo", || corefs_mkfifo(fs, fifo.as_ptr(), 0o600));
        assert_eq!(made, 0, "{}", last_error());
        let node = c(&format!("{dir}/node"));
        let made = once(fs, "mknod", || {
            corefs_mknod(fs, node.as_ptr(), libc::S_IFCHR | 0o600, 0x0501)
        });
        assert_eq!(made, 0, "{}", last_error());
        let mut entries: Vec<corefs_dirent> = Vec::with_capacity(16);
        let d = c(&dir);
        let n = once(fs, "readdir", || {
            corefs_readdir(fs, d.as_ptr(), 0, entries.as_mut_ptr(), 16)
        });
        assert!(
            n >= 4,
            "f, sym, fifo, node (and . and ..): {n} {}",
            last_error()
        );
        entries.set_len(n as usize);
        let names: Vec<&[u8]> = entries
            .iter()
            .map(|e| &e.name[..e.name_len as usize])
            .collect();
        for want in [&b"f"[..], b"sym", b"fifo", b"node"] {
            assert!(names.contains(&want), "readdir lists {want:?}: {names:?}");
        }
        // A hard link names two paths: the existing one walked, then the new name's walk
        // carries the link.
        let hard = c(&format!("{dir}/hard"));
        let linked = at_most(fs, 2, "link", || corefs_link(fs, p.as_ptr(), hard.as_ptr()));
        assert_eq!(linked, 0, "{}", last_error());
        for gone in [&hard, &fifo, &node] {
            assert_eq!(once(fs, "unlink", || corefs_unlink(fs, gone.as_ptr())), 0);
        }
    }
    assert_eq!(stat(fs, &file).unwrap().mode & 0o7777, 0o600);

    // Renames: within one directory one request (the walk carries the rename), across
    // directories two (the target's directory walked first), the root's names too.
    let rename = |from: &str, to: &str, flags: i32| {
        let (f, t) = (c(from), c(to));
        // SAFETY: NUL-terminated paths.
        unsafe { corefs_rename(fs, f.as_ptr(), t.as_ptr(), flags) }
    };
    let ino = stat(fs, &file).unwrap().ino;
    let aside = format!("{dir}/f.tmp");
    let r = once(fs, "rename within a directory", || rename(&file, &aside, 0));
    assert_eq!(r, 0, "{}", last_error());
    assert_eq!(stat(fs, &aside).unwrap().ino, ino);
    assert_eq!(stat(fs, &file).unwrap_err(), -libc::ENOENT);
    let r = at_most(fs, 2, "rename across directories", || {
        rename(&aside, "a/b/moved", 0)
    });
    assert_eq!(r, 0, "{}", last_error());
    let r = at_most(fs, 2, "rename into the root", || {
        rename("a/b/moved", "top", 0)
    });
    assert_eq!(r, 0, "{}", last_error());
    let r = once(fs, "rename within the root", || rename("top", "top2", 0));
    assert_eq!(r, 0, "{}", last_error());
    let r = at_most(fs, 2, "rename out of the root", || rename("top2", &file, 0));
    assert_eq!(r, 0, "{}", last_error());
    assert_eq!(stat(fs, &file).unwrap().ino, ino, "back where it was");
    // What a rename refuses, it refuses in as many requests: an existing target with
    // RENAME_NOREPLACE, a missing source, a missing directory on either side.
    let r = once(fs, "rename(NOREPLACE) over an existing name", || {
        rename(&file, &format!("{dir}/sym"), COREFS_RENAME_NOREPLACE)
    });
    assert_eq!(r, -libc::EEXIST);
    let r = once(fs, "rename of a missing name", || {
        rename(&format!("{dir}/nothing"), &aside, 0)
    });
    assert_eq!(r, -libc::ENOENT);
    // rename(2) resolves the source's directory first: its ENOENT, not the target's ENOTDIR.
    let r = at_most(fs, 3, "rename with both directories wrong", || {
        rename("a/missing/x", &format!("{file}/y"), 0)
    });
    assert_eq!(r, -libc::ENOENT, "{}", last_error());
    let r = at_most(fs, 2, "rename into a file's \"directory\"", || {
        rename(&file, &format!("{file}/y"), 0)
    });
    assert_eq!(r, -libc::ENOTDIR, "{}", last_error());
    assert_eq!(
        stat(fs, &file).unwrap().ino,
        ino,
        "refused renames moved nothing"
    );

    for (what, path) in [("unlink", format!("{dir}/sym")), ("unlink", file.clone())] {
        assert_eq!(once(fs, what, || path_call(fs, &path, corefs_unlink)), 0);
    }
    assert_eq!(path_call(fs, elsewhere, corefs_unlink), 0);
    assert_eq!(once(fs, "rmdir", || path_call(fs, &dir, corefs_rmdir)), 0);
    assert_eq!(stat(fs, &dir).unwrap_err(), -libc::ENOENT);
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
}

#[test]
fn every_call_is_one_request_with_one_reactor() {
    calls_are_one_request_each(1);
}

#[test]
fn every_call_is_one_request_with_two_reactors() {
    calls_are_one_request_each(2);
}
