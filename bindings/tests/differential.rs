//! corefs's C ABI against the kernel, call by call (one reactor and two): the run is
//! `support/differential.rs`'s. CI runs 3,000 operations per reactor count;
//! `scripts/big-tests.sh` 200,000.

use corefs::abi::*;
use std::ffi::CStr;

#[path = "support/differential.rs"]
mod differential;
use differential::{c, kind_of, Kernel, Side, OPEN_MASK};

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

struct Corefs(corefs_fs);

impl Side for Corefs {
    fn mkdir(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        unsafe { corefs_mkdir(self.0, c(path).as_ptr(), 0o755) as i64 }
    }
    fn open_write(&mut self, path: &str, flags: i32, data: &[u8], offset: u64) -> (i64, i64) {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { corefs_open(self.0, c(path).as_ptr(), flags & OPEN_MASK, 0o644) };
        if fd < 0 {
            return (fd, 0);
        }
        let wrote = if flags & 3 != COREFS_O_RDONLY && flags & COREFS_O_DIRECTORY == 0 {
            // SAFETY: a live buffer of the length given.
            unsafe { corefs_pwrite(self.0, fd, data.as_ptr(), data.len(), offset) }
        } else {
            0
        };
        assert_eq!(corefs_release(self.0, fd), 0, "{}", last_error());
        (0, wrote)
    }
    fn truncate(&mut self, path: &str, size: u64) -> i64 {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { corefs_open(self.0, c(path).as_ptr(), COREFS_O_WRONLY, 0) };
        if fd < 0 {
            return fd;
        }
        let r = corefs_ftruncate(self.0, fd, size) as i64;
        assert_eq!(corefs_release(self.0, fd), 0);
        r
    }
    fn unlink(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        unsafe { corefs_unlink(self.0, c(path).as_ptr()) as i64 }
    }
    fn rmdir(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        unsafe { corefs_rmdir(self.0, c(path).as_ptr()) as i64 }
    }
    fn rename(&mut self, from: &str, to: &str, flags: u32) -> i64 {
        // SAFETY: NUL-terminated paths.
        unsafe { corefs_rename(self.0, c(from).as_ptr(), c(to).as_ptr(), flags as i32) as i64 }
    }
    fn link(&mut self, from: &str, to: &str) -> i64 {
        // SAFETY: NUL-terminated paths.
        unsafe { corefs_link(self.0, c(from).as_ptr(), c(to).as_ptr()) as i64 }
    }
    fn symlink(&mut self, target: &str, path: &str) -> i64 {
        // SAFETY: NUL-terminated strings.
        unsafe { corefs_symlink(self.0, c(target).as_ptr(), c(path).as_ptr()) as i64 }
    }
    fn stat(&mut self, path: &str) -> Result<(char, u64), i64> {
        // SAFETY: all-zero is a valid corefs_stat; a NUL-terminated path and a live output.
        let mut st: corefs_stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe { corefs_stat(self.0, c(path).as_ptr(), &mut st) };
        if r < 0 {
            return Err(r as i64);
        }
        Ok((kind_of(st.mode), st.size))
    }
    fn read_all(&mut self, path: &str) -> Result<Vec<u8>, i64> {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { corefs_open(self.0, c(path).as_ptr(), COREFS_O_RDONLY, 0) };
        if fd < 0 {
            return Err(fd);
        }
        let mut out = vec![0u8; 1 << 20];
        // SAFETY: a live buffer of the length given.
        let n = unsafe { corefs_pread(self.0, fd, out.as_mut_ptr(), out.len(), 0) };
        assert_eq!(corefs_release(self.0, fd), 0);
        if n < 0 {
            return Err(n);
        }
        out.truncate(n as usize);
        Ok(out)
    }
    fn names(&mut self, path: &str) -> Result<Vec<String>, i64> {
        let p = c(if path.is_empty() { "/" } else { path });
        // SAFETY: all-zero is a valid corefs_dirent.
        let mut entries: Vec<corefs_dirent> = vec![unsafe { std::mem::zeroed() }; 512];
        // SAFETY: a NUL-terminated path and a live output of 512 entries.
        let n = unsafe { corefs_readdir(self.0, p.as_ptr(), 0, entries.as_mut_ptr(), 512) };
        if n < 0 {
            return Err(n);
        }
        let mut names: Vec<String> = entries[..n as usize]
            .iter()
            .map(|e| String::from_utf8_lossy(&e.name[..e.name_len as usize]).into_owned())
            .collect();
        names.sort();
        Ok(names)
    }
    fn setxattr(&mut self, path: &str, name: &str, value: &[u8]) -> i64 {
        // SAFETY: NUL-terminated strings and a live value.
        unsafe {
            corefs_setxattr(
                self.0,
                c(path).as_ptr(),
                c(name).as_ptr(),
                value.as_ptr(),
                value.len(),
                0,
            ) as i64
        }
    }
    fn getxattr(&mut self, path: &str, name: &str) -> Result<Vec<u8>, i64> {
        let mut buf = vec![0u8; 256];
        // SAFETY: NUL-terminated strings and a live buffer of the length given.
        let n = unsafe {
            corefs_getxattr(
                self.0,
                c(path).as_ptr(),
                c(name).as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(n);
        }
        buf.truncate(n as usize);
        Ok(buf)
    }
}

fn run(reactors: u8) {
    let seed = differential::seed();
    let ops = differential::ops();
    let scratch = tempfile::tempdir_in("/var/tmp").expect("a scratch directory");
    let base = scratch.path().join("k");
    std::fs::create_dir(&base).unwrap();
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let o = corefs_options {
        format: 1,
        shards: 8,
        reactors,
        ..unsafe { std::mem::zeroed() }
    };
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(c"mem:128MiB".as_ptr(), &o) };
    assert!(fs > 0, "mount: {}", last_error());
    let label = format!("C ABI, {reactors} reactor(s)");
    let skipped = differential::compare(&mut Corefs(fs), &mut Kernel(base), seed, ops, &label);
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
    eprintln!(
        "differential ({label}): seed {seed}, {ops} operations, {skipped} through symlinks skipped"
    );
}

#[test]
fn random_operations_answer_as_the_kernel_with_one_reactor() {
    run(1);
}

#[test]
fn random_operations_answer_as_the_kernel_with_two_reactors() {
    run(2);
}
