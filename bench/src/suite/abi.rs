//! A corefs target seen through its C ABI (libcorefs, linked in as the `corefs` crate): the
//! workloads that measure what an embedding program pays per call (`abi-open-close`,
//! `abi-stat`) run here on corefs and through the system calls on the kernel targets.
//!
//! Invariants: a [`CAbiMount`] is the only mount of its device while it lives (the target
//! stops its own runtime first); every call's result is checked, a negative errno ends the
//! run with the call's name, the path and `corefs_last_error`; the mount is closed when the
//! value is dropped.

use super::session::{Fh, Handles, Session, R};
use corefs::abi::*;
use std::ffi::{CStr, CString};
use std::time::Instant;

/// A filesystem mounted through `corefs_mount`; closed on drop.
pub struct CAbiMount {
    fs: corefs_fs,
}

/// How the target mounts through the C ABI: its own options, translated.
pub struct CAbiOptions<'a> {
    pub device: &'a str,
    /// Format first (a memory device lives only as long as its mount).
    pub format: bool,
    pub shards: u32,
    pub reactors: usize,
    /// Busy-polling reactors pinned from this core on (the dedicated placement).
    pub pinned_from: Option<usize>,
    pub data_cache_off: bool,
}

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn checked(what: &str, path: &str, r: i64) -> R<i64> {
    if r < 0 {
        return Err(format!("{what} {path}: errno {} ({})", -r, last_error()));
    }
    Ok(r)
}

fn c_path(path: &str) -> R<CString> {
    CString::new(path).map_err(|_| format!("{path:?}: a NUL in a path"))
}

impl CAbiMount {
    pub fn mount(o: &CAbiOptions<'_>) -> R<CAbiMount> {
        let device = c_path(o.device)?;
        let options = corefs_options {
            format: o.format as u8,
            busy_poll: o.pinned_from.is_some() as u8,
            pin: o.pinned_from.is_some() as u8,
            reactors: u8::try_from(o.reactors).map_err(|_| "too many reactors")?,
            shards: o.shards,
            core: o.pinned_from.unwrap_or(0) as u32,
            commit_interval_ms: 0,
            label: std::ptr::null(),
            owner_uid: 0,
            owner_gid: 0,
            owner_set: 0,
            data_cache_off: o.data_cache_off as u8,
            // relatime, as the kernel filesystems it is compared with are mounted.
            atime: 0,
            reserved: [0; 5],
        };
        // SAFETY: a NUL-terminated device string and options without a label.
        let fs = unsafe { corefs_mount(device.as_ptr(), &options) };
        checked("corefs_mount", o.device, fs)?;
        Ok(CAbiMount { fs })
    }

    /// Connects to a `corefs serve` at `socket` (`corefs_connect`).
    pub fn connect(socket: &std::path::Path) -> R<CAbiMount> {
        let path = socket.to_str().ok_or("a socket path that is not UTF-8")?;
        let p = c_path(path)?;
        // SAFETY: a NUL-terminated path; NULL options.
        let fs = unsafe { corefs_connect(p.as_ptr(), std::ptr::null()) };
        checked("corefs_connect", path, fs)?;
        Ok(CAbiMount { fs })
    }

    /// The reactors' statistics (None when the filesystem cannot give them).
    pub fn stats(&self) -> Option<reactor::ReactorStats> {
        corefs::abi::reactor_stats(self.fs)
    }

    pub fn session(&self) -> Box<dyn Session> {
        Box::new(CAbiSession {
            fs: self.fs,
            files: Handles::new(),
            read_buf: AbiBuf::default(),
        })
    }

    /// Unmounts, reporting what `corefs_close` says.
    pub fn close(self) -> R<()> {
        let fs = self.fs;
        std::mem::forget(self);
        checked("corefs_close", "", corefs_close(fs) as i64).map(drop)
    }
}

impl Drop for CAbiMount {
    fn drop(&mut self) {
        let _ = corefs_close(self.fs);
    }
}

/// One client's calls through the C ABI (each thread gets its own reactor client inside
/// libcorefs).
struct CAbiSession {
    fs: corefs_fs,
    files: Handles<corefs_fd>,
    read_buf: AbiBuf,
}

/// A read buffer from `corefs_buf_alloc`, grown as needed and reused, as a C program that
/// reads through a server keeps one: the server puts the data straight into it, with no copy
/// on the client's side (docs/service.md). In process it is memory like any other.
#[derive(Default)]
struct AbiBuf {
    ptr: Option<std::ptr::NonNull<u8>>,
    len: usize,
}

// SAFETY: the buffer is this value's alone; the C ABI's buffers may move between threads.
unsafe impl Send for AbiBuf {}

impl AbiBuf {
    /// Its first `len` bytes, grown (a new buffer) when it is shorter.
    fn get(&mut self, len: usize) -> R<&mut [u8]> {
        if self.len < len.max(1) {
            self.free();
            let want = len.max(4096);
            let ptr = std::ptr::NonNull::new(corefs_buf_alloc(want))
                .ok_or_else(|| format!("corefs_buf_alloc({want}): {}", last_error()))?;
            (self.ptr, self.len) = (Some(ptr), want);
        }
        let ptr = self.ptr.expect("allocated above");
        // SAFETY: `self.len >= len` bytes from corefs_buf_alloc, borrowed with `self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) })
    }

    fn free(&mut self) {
        if let Some(ptr) = self.ptr.take() {
            // SAFETY: from corefs_buf_alloc(self.len), not used after.
            unsafe { corefs_buf_free(ptr.as_ptr(), self.len) };
        }
        self.len = 0;
    }
}

impl Drop for AbiBuf {
    fn drop(&mut self) {
        self.free();
    }
}

impl CAbiSession {
    fn open_flags(&mut self, path: &str, flags: i32) -> R<Fh> {
        let p = c_path(path)?;
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { corefs_open(self.fs, p.as_ptr(), flags, 0o644) };
        Ok(self.files.add(checked("corefs_open", path, fd)?))
    }

    fn path_call(
        &mut self,
        what: &str,
        path: &str,
        f: unsafe extern "C" fn(corefs_fs, *const std::ffi::c_char) -> i32,
    ) -> R<()> {
        let p = c_path(path)?;
        // SAFETY: a NUL-terminated path.
        checked(what, path, unsafe { f(self.fs, p.as_ptr()) } as i64).map(drop)
    }
}

impl Session for CAbiSession {
    fn create(&mut self, path: &str) -> R<Fh> {
        self.open_flags(path, COREFS_O_CREAT | COREFS_O_EXCL | COREFS_O_RDWR)
    }

    fn open(&mut self, path: &str) -> R<Fh> {
        self.open_flags(path, COREFS_O_RDWR)
    }

    fn close(&mut self, fh: Fh) -> R<()> {
        let fd = *self.files.get(fh)?;
        self.files.close(fh)?;
        checked("corefs_release", "", corefs_release(self.fs, fd) as i64).map(drop)
    }

    fn pwrite(&mut self, fh: Fh, offset: u64, data: &[u8]) -> R<()> {
        let fd = *self.files.get(fh)?;
        // SAFETY: a live buffer of the length given.
        let n = unsafe { corefs_pwrite(self.fs, fd, data.as_ptr(), data.len(), offset) };
        match checked("corefs_pwrite", "", n)? {
            n if n as usize == data.len() => Ok(()),
            n => Err(format!("short write: {n} of {}", data.len())),
        }
    }

    fn pread(&mut self, fh: Fh, offset: u64, len: usize) -> R<usize> {
        let fd = *self.files.get(fh)?;
        let buf = self.read_buf.get(len)?;
        // SAFETY: a live buffer of the length given.
        let n = unsafe { corefs_pread(self.fs, fd, buf.as_mut_ptr(), len, offset) };
        checked("corefs_pread", "", n).map(|n| n as usize)
    }

    fn fsync(&mut self, fh: Fh) -> R<()> {
        let fd = *self.files.get(fh)?;
        checked("corefs_fsync", "", corefs_fsync(self.fs, fd) as i64).map(drop)
    }

    fn fdatasync(&mut self, fh: Fh) -> R<()> {
        let fd = *self.files.get(fh)?;
        checked("corefs_fdatasync", "", corefs_fdatasync(self.fs, fd) as i64).map(drop)
    }

    fn mkdir(&mut self, path: &str) -> R<()> {
        let p = c_path(path)?;
        // SAFETY: a NUL-terminated path.
        let r = unsafe { corefs_mkdir(self.fs, p.as_ptr(), 0o755) };
        checked("corefs_mkdir", path, r as i64).map(drop)
    }

    fn rmdir(&mut self, path: &str) -> R<()> {
        self.path_call("corefs_rmdir", path, corefs_rmdir)
    }

    fn unlink(&mut self, path: &str) -> R<()> {
        self.path_call("corefs_unlink", path, corefs_unlink)
    }

    fn rename(&mut self, from: &str, to: &str) -> R<()> {
        let (f, t) = (c_path(from)?, c_path(to)?);
        // SAFETY: NUL-terminated paths.
        let r = unsafe { corefs_rename(self.fs, f.as_ptr(), t.as_ptr(), 0) };
        checked("corefs_rename", from, r as i64).map(drop)
    }

    fn stat(&mut self, path: &str) -> R<u64> {
        let p = c_path(path)?;
        // SAFETY: all-zero is a valid corefs_stat; a NUL-terminated path and a live output.
        let mut out: corefs_stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe { corefs_stat(self.fs, p.as_ptr(), &mut out) };
        checked("corefs_stat", path, r as i64)?;
        Ok(out.size)
    }

    fn readdir(&mut self, path: &str) -> R<Vec<(String, bool)>> {
        let p = c_path(path)?;
        let mut out = Vec::new();
        let mut cookie = 0;
        // SAFETY: all-zero is a valid corefs_dirent.
        let mut entries: Vec<corefs_dirent> = vec![unsafe { std::mem::zeroed() }; 256];
        loop {
            // SAFETY: a NUL-terminated path and a live output of `entries.len()` entries.
            let n =
                unsafe { corefs_readdir(self.fs, p.as_ptr(), cookie, entries.as_mut_ptr(), 256) };
            let n = checked("corefs_readdir", path, n)? as usize;
            if n == 0 {
                return Ok(out);
            }
            for e in &entries[..n] {
                let name = &e.name[..e.name_len as usize];
                out.push((
                    String::from_utf8_lossy(name).into_owned(),
                    e.kind == (libc::S_IFDIR >> 12) as u8,
                ));
            }
            cookie = entries[n - 1].cookie;
        }
    }

    /// Random 4 KiB reads at queue depth `qd` through the asynchronous calls
    /// (`corefs_submit_pread`, `corefs_poll`), each completion's latency recorded.
    fn random_reads(
        &mut self,
        fh: Fh,
        file_bytes: u64,
        qd: usize,
        until: Instant,
        seed: u64,
        record: &mut dyn FnMut(u64),
    ) -> R<u64> {
        use rand::{Rng, SeedableRng};
        let fd = *self.files.get(fh)?;
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let blocks = file_bytes / 4096;
        // One buffer and one submission time per token; tokens are slots 0..qd.
        let mut buffers = vec![0u8; qd * 4096];
        let mut submitted: Vec<Instant> = vec![Instant::now(); qd];
        let mut free: Vec<u64> = (0..qd as u64).collect();
        let mut in_flight = 0usize;
        let mut done = 0u64;
        let mut completions = vec![corefs_completion::default(); qd];
        loop {
            // At least one read, however late the start (see workloads::keep_going).
            while Instant::now() < until || (done == 0 && in_flight == 0) {
                let Some(slot) = free.pop() else { break };
                let offset = rng.random_range(0..blocks) * 4096;
                submitted[slot as usize] = Instant::now();
                let buf = buffers[slot as usize * 4096..].as_mut_ptr();
                // SAFETY: the slot's 4 KiB stays untouched until its completion is polled.
                let r = unsafe { corefs_submit_pread(self.fs, fd, buf, 4096, offset, slot) };
                checked("corefs_submit_pread", "", r as i64)?;
                in_flight += 1;
            }
            if in_flight == 0 {
                return Ok(done);
            }
            // SAFETY: room for `qd` completions.
            let n = unsafe { corefs_poll(self.fs, completions.as_mut_ptr(), qd, 5_000_000) };
            let n = checked("corefs_poll", "", n)? as usize;
            let now = Instant::now();
            for c in &completions[..n] {
                if c.result != 4096 {
                    return Err(format!("random read: {} ({})", c.result, last_error()));
                }
                record(now.duration_since(submitted[c.token as usize]).as_nanos() as u64);
                free.push(c.token);
                in_flight -= 1;
                done += 1;
            }
        }
    }
}
