//! The interface between workloads and filesystems: a [`Target`] (a filesystem under test,
//! fresh per workload) hands out one [`Session`] per client thread, and sessions speak paths
//! relative to the target's root. The targets themselves live in [`super::target`] (corefs
//! through its client API, kernel filesystems through POSIX) and [`super::abi`] (corefs
//! through libcorefs); both look only down to this module.
//!
//! Invariants: a session is used by one thread; handles are small integers valid in the
//! session that made them ([`Handles`]).

use super::results::EngineFigures;
use std::path::Path;
use std::time::Instant;

pub type R<T> = Result<T, String>;

/// A file handle within one session.
pub type Fh = usize;

/// The first `len` bytes of a session's read buffer, grown as needed: every target reads
/// into a buffer its client reuses, as a program does (an allocation per read measured the
/// allocator, the same on every target).
pub fn read_buf(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

/// One client thread's view of a target.
pub trait Session: Send {
    /// Creates a new file (fails if it exists) and opens it for reading and writing.
    fn create(&mut self, path: &str) -> R<Fh>;
    fn open(&mut self, path: &str) -> R<Fh>;
    fn close(&mut self, fh: Fh) -> R<()>;
    fn pwrite(&mut self, fh: Fh, offset: u64, data: &[u8]) -> R<()>;
    /// Reads up to `len` bytes; returns how many.
    fn pread(&mut self, fh: Fh, offset: u64, len: usize) -> R<usize>;
    fn fsync(&mut self, fh: Fh) -> R<()>;
    fn fdatasync(&mut self, fh: Fh) -> R<()>;
    fn mkdir(&mut self, path: &str) -> R<()>;
    fn rmdir(&mut self, path: &str) -> R<()>;
    fn unlink(&mut self, path: &str) -> R<()>;
    fn rename(&mut self, from: &str, to: &str) -> R<()>;
    /// The size of what `path` names.
    fn stat(&mut self, path: &str) -> R<u64>;
    /// Names in a directory, with whether each is a directory.
    fn readdir(&mut self, path: &str) -> R<Vec<(String, bool)>>;
    /// Random 4 KiB reads of an open file with `qd` in flight until `until`; each completion's
    /// latency goes to `record`. Bypasses every data cache (kernel targets read with O_DIRECT;
    /// the suite mounts corefs with its data-block cache off for these workloads). Returns the
    /// reads done.
    fn random_reads(
        &mut self,
        fh: Fh,
        file_bytes: u64,
        qd: usize,
        until: Instant,
        seed: u64,
        record: &mut dyn FnMut(u64),
    ) -> R<u64>;
}

/// A filesystem under test.
pub trait Target {
    fn name(&self) -> String;
    /// A fresh, empty filesystem for the next workload.
    fn prepare(&mut self) -> R<()>;
    fn session(&mut self) -> R<Box<dyn Session>>;
    /// Engine figures since `prepare` or the last `remount` (corefs only).
    fn engine_figures(&mut self) -> R<Option<EngineFigures>>;
    /// Unmounts and mounts again (dropping caches); returns the mount time when the target
    /// can be remounted.
    fn remount(&mut self) -> R<Option<f64>>;
    /// Ends the workload: unmount or remove what it made.
    fn finish(&mut self) -> R<()>;
    /// Serves the next sessions (until `finish`) through the target's C ABI, on a fresh
    /// filesystem: corefs mounts through libcorefs; a kernel target's sessions are system
    /// calls already.
    fn through_c_abi(&mut self) -> R<()> {
        Ok(())
    }
    /// Cores the workload's clients are pinned to, round robin (empty: not pinned).
    fn client_cores(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Whether the next mounts keep file data in memory after reading it (corefs's block
    /// cache). Off for workloads that measure the device path, which a kernel target reads
    /// with O_DIRECT; a kernel target has nothing to turn off.
    fn set_data_cache(&mut self, _on: bool) {}

    /// CPU time (ns) a server process of this target has used so far (`corefs serve`,
    /// `corefs mount`): the run's CPU per operation counts it with the bench process's own.
    fn server_cpu_ns(&self) -> Option<u64> {
        None
    }

    /// The image file this target's filesystem lives in, when the suite made one for it (fio
    /// reads it raw as the random-read workloads' yardstick).
    fn image(&self) -> Option<&Path> {
        None
    }
}

/// A session's open files: a handle is an index, never reused while the table holds any open
/// entry; the table empties when every handle is closed, so it stays as small as the most
/// files a client holds open at once.
pub(crate) struct Handles<T>(Vec<Option<T>>);

impl<T> Handles<T> {
    pub(crate) fn new() -> Handles<T> {
        Handles(Vec::new())
    }

    pub(crate) fn add(&mut self, value: T) -> Fh {
        self.0.push(Some(value));
        self.0.len() - 1
    }

    pub(crate) fn get(&self, fh: Fh) -> R<&T> {
        self.0
            .get(fh)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("bad handle {fh}"))
    }

    pub(crate) fn close(&mut self, fh: Fh) -> R<()> {
        self.get(fh)?;
        self.0[fh] = None;
        if self.0.iter().all(Option::is_none) {
            self.0.clear();
        }
        Ok(())
    }
}
