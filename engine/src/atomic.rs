//! Atomic batch writes (docs/fsync-log.md, "Atomic batches"): a set of writes to one file
//! made durable together or not at all, what F2FS's atomic-write ioctls give SQLite
//! (`SQLITE_ENABLE_BATCH_ATOMIC_WRITE`: a rollback-journal transaction then writes no journal).
//!
//! A batch is staged in memory ([`AtomicBatch`]), outside the filesystem: until its commit
//! nothing of it is in the trees, so no transaction commit and no fsync record can carry part
//! of it. The commit ([`Filesystem::write_atomic`]) applies every staged write in one engine
//! operation — nothing else runs in between, and no commit is started inside it — and then
//! fsyncs the file: one fsync log record holds all of it (the record replays all or nothing),
//! or, when the record would not fit the log, a transaction commit does (atomic too).
//!
//! # Invariants
//! - The staged ranges are disjoint and not adjacent (merged on staging); later writes win
//!   where they overlap earlier ones, as they would on the file.
//! - A batch holds at most [`ATOMIC_BATCH_MAX_BYTES`] staged bytes in at most
//!   [`ATOMIC_BATCH_MAX_RANGES`] ranges: staging past either is EFBIG and leaves the batch as
//!   it was (the caller may abort it and write the ordinary way).
//! - Applying a batch is one operation ([`Filesystem::run_op`]): it reserves its worst case
//!   before its first change, so NoSpace comes back with nothing applied; a failure after a
//!   change (a device error) makes the filesystem fail-stop with the durable state intact, so
//!   a half-applied batch never reaches the device.
//!
//! Fault model: as the fsync log's. A crash before the commit's record (or commit) is durable
//! leaves none of the batch; after, all of it. The bytes are the caller's until the commit.

use crate::error::{EngineError, Result};
use crate::fs::Filesystem;
use crate::log::FsyncStart;
use std::collections::BTreeMap;

/// Staged bytes one batch may hold (after merging overlaps): 64 MiB. SQLite stages one
/// transaction's dirty pages (its page cache defaults to about 2 MiB, so its transactions
/// spill long before this); past it SQLite falls back to a journal on disk.
pub const ATOMIC_BATCH_MAX_BYTES: u64 = 64 << 20;
/// Disjoint ranges one batch may hold (each costs a map entry and, at commit, one write).
pub const ATOMIC_BATCH_MAX_RANGES: usize = 1 << 16;

/// Writes staged for one file, in memory, until they are committed or dropped.
#[derive(Debug, Default, Clone)]
pub struct AtomicBatch {
    /// Start offset → bytes; disjoint, not adjacent.
    ranges: BTreeMap<u64, Vec<u8>>,
    staged_bytes: u64,
}

impl AtomicBatch {
    pub fn new() -> AtomicBatch {
        AtomicBatch::default()
    }

    /// Staged bytes (after merging).
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The end of the last staged range (0 when empty): the file is at least this long once
    /// the batch is committed.
    pub fn end(&self) -> u64 {
        self.ranges
            .iter()
            .next_back()
            .map_or(0, |(&start, bytes)| start + bytes.len() as u64)
    }

    /// Stages `data` at `offset`. EFBIG (nothing staged) past the batch's bounds or past the
    /// largest file; EINVAL for a position past `i64::MAX`.
    pub fn stage(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let len = crate::file::rw_len(offset, data.len())?;
        if len < data.len() {
            return Err(EngineError::TooBig(
                "an atomic batch write longer than one write may be".into(),
            ));
        }
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= crate::file::MAX_FILE_BYTES)
            .ok_or_else(|| EngineError::TooBig("file offset".into()))?;
        // The ranges this one overlaps or touches: merged into one.
        let first = self
            .ranges
            .range(..=offset)
            .next_back()
            .filter(|(&s, b)| s + b.len() as u64 >= offset)
            .map(|(&s, _)| s)
            .unwrap_or(offset);
        let touched: Vec<u64> = self.ranges.range(first..=end).map(|(&s, _)| s).collect();
        let merged_start = first.min(offset);
        let merged_end = touched
            .iter()
            .map(|s| s + self.ranges[s].len() as u64)
            .fold(end, u64::max);
        let old_bytes: u64 = touched.iter().map(|s| self.ranges[s].len() as u64).sum();
        let merged_len = merged_end - merged_start;
        let staged_after = self.staged_bytes - old_bytes + merged_len;
        if staged_after > ATOMIC_BATCH_MAX_BYTES {
            return Err(EngineError::TooBig(format!(
                "an atomic batch holds at most {ATOMIC_BATCH_MAX_BYTES} bytes"
            )));
        }
        if touched.is_empty() && self.ranges.len() >= ATOMIC_BATCH_MAX_RANGES {
            return Err(EngineError::TooBig(format!(
                "an atomic batch holds at most {ATOMIC_BATCH_MAX_RANGES} ranges"
            )));
        }
        let mut merged = vec![0u8; merged_len as usize];
        for s in &touched {
            let old = self.ranges.remove(s).expect("listed above");
            let at = (s - merged_start) as usize;
            merged[at..at + old.len()].copy_from_slice(&old);
        }
        let at = (offset - merged_start) as usize;
        merged[at..at + data.len()].copy_from_slice(data);
        self.ranges.insert(merged_start, merged);
        self.staged_bytes = staged_after;
        Ok(())
    }

    /// Lays the staged bytes over `file`, what the file holds at `offset` (a read of `len`
    /// bytes, short at its end): the result is what a read of `len` bytes at `offset` sees once
    /// the batch is committed, so a reader through the batch's own handle sees its writes.
    /// Bytes between the file's end and staged data read as zeroes, as a hole would.
    pub fn overlay(&self, offset: u64, len: usize, file: &mut Vec<u8>) {
        let Some(want_end) = offset.checked_add(len as u64) else {
            return;
        };
        for (&start, bytes) in self.ranges.range(..want_end) {
            let end = start + bytes.len() as u64;
            if end <= offset {
                continue;
            }
            let from = start.max(offset);
            let to = end.min(want_end);
            let need = (to - offset) as usize;
            if file.len() < need {
                file.resize(need, 0);
            }
            let src = &bytes[(from - start) as usize..(to - start) as usize];
            file[(from - offset) as usize..need].copy_from_slice(src);
        }
    }

    /// The staged writes, in offset order.
    pub fn writes(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.ranges.iter().map(|(&s, b)| (s, b.as_slice()))
    }

    /// The staged writes, taken out (the batch is empty afterwards).
    pub fn take_writes(&mut self) -> Vec<(u64, Vec<u8>)> {
        self.staged_bytes = 0;
        std::mem::take(&mut self.ranges).into_iter().collect()
    }
}

impl Filesystem {
    /// Commits an atomic batch of writes to `ino`: applies them all ([`Filesystem::write_batch`])
    /// and makes them durable with one fsync record — or one commit, when the record would
    /// not fit the log. Returns once they are durable; a crash before then leaves none of them.
    pub fn write_atomic(&mut self, ino: u64, writes: &[(u64, Vec<u8>)]) -> Result<()> {
        self.write_batch(ino, writes)?;
        self.fsync_group(&[(ino, false)])
    }

    /// [`Filesystem::write_atomic`] without waiting: applies the writes and starts the fsync
    /// ([`Filesystem::fsync_group_start`]); the batch is durable when the returned start is.
    pub fn write_atomic_start(
        &mut self,
        ino: u64,
        writes: &[(u64, Vec<u8>)],
    ) -> Result<FsyncStart> {
        self.write_batch(ino, writes)?;
        self.fsync_group_start(&[(ino, false)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_merges_overlaps_and_later_writes_win() {
        let mut b = AtomicBatch::new();
        b.stage(10, &[1; 10]).unwrap();
        b.stage(30, &[2; 10]).unwrap();
        b.stage(15, &[3; 20]).unwrap(); // overlaps both
        let writes: Vec<(u64, Vec<u8>)> = b.writes().map(|(o, d)| (o, d.to_vec())).collect();
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].0, 10);
        let mut want = vec![1u8; 5];
        want.extend([3u8; 20]);
        want.extend([2u8; 5]);
        assert_eq!(writes[0].1, want);
        assert_eq!(b.staged_bytes(), 30);
        b.stage(40, &[4; 2]).unwrap(); // adjacent: merged
        assert_eq!(b.writes().count(), 1);
        b.stage(100, &[5; 1]).unwrap();
        assert_eq!(b.writes().count(), 2);
        assert_eq!(b.end(), 101);
    }

    #[test]
    fn overlay_shows_staged_bytes_and_zeroes_past_the_file() {
        let mut b = AtomicBatch::new();
        b.stage(2, &[9; 2]).unwrap();
        b.stage(8, &[7; 2]).unwrap();
        let mut file = vec![1u8; 5];
        b.overlay(0, 12, &mut file);
        assert_eq!(file, [1, 1, 9, 9, 1, 0, 0, 0, 7, 7]);
        let mut file = vec![1u8; 2];
        b.overlay(3, 2, &mut file);
        assert_eq!(file, [9, 1]);
    }

    #[test]
    fn staging_past_the_bound_is_efbig_and_changes_nothing() {
        let mut b = AtomicBatch::new();
        let big = vec![0u8; (ATOMIC_BATCH_MAX_BYTES / 2) as usize];
        b.stage(0, &big).unwrap();
        b.stage(ATOMIC_BATCH_MAX_BYTES, &big).unwrap();
        let err = b.stage(ATOMIC_BATCH_MAX_BYTES * 4, &[1]).unwrap_err();
        assert_eq!(err.errno(), 27);
        assert_eq!(b.staged_bytes(), ATOMIC_BATCH_MAX_BYTES);
        // An overwrite inside what is staged grows nothing and still fits.
        b.stage(10, &[1; 10]).unwrap();
        assert_eq!(b.staged_bytes(), ATOMIC_BATCH_MAX_BYTES);
    }
}
