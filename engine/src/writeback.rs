//! Write-back of file data. `write` allocates new blocks (copy-on-write), records the extent,
//! and stages the bytes here instead of writing them at once; they go to the device together
//! with whatever first needs them durable or readable:
//! - an fsync writes the staged data of the inodes its record covers in the same batch as the
//!   record, so the device works on both at once, and one flush makes both durable;
//! - a commit writes all staged data with its tree nodes, before its flush;
//! - a read of an inode with staged data writes that inode's data back first;
//! - past [`MAX_STAGED_BYTES`] everything staged is written back (memory stays bounded).
//!
//! # Invariants
//! - A block referenced by a log record or a committed tree was written before the flush that
//!   made the record or the superblock durable (callers take the staged blocks of exactly the
//!   inodes they persist, or all of them).
//! - Staged blocks were freshly allocated by the running transaction and are never reused
//!   before its commit (data frees are pinned), so writing one late never overwrites live data.
//!
//! Fault model: a failed write-back makes the filesystem fail-stop; the fsync or commit that
//! needed it returns the error, so nothing is acknowledged that is not durable.

use crate::error::Result;
use crate::format::BLOCK_BYTES;
use crate::fs::Filesystem;
use std::collections::BTreeMap;

/// Staged data bytes past which everything staged is written back.
pub const MAX_STAGED_BYTES: usize = 16 << 20;

#[derive(Default)]
pub(crate) struct Staged {
    /// Per inode: (first disk block, whole blocks of data).
    by_ino: BTreeMap<u64, Vec<(u64, Vec<u8>)>>,
    bytes: usize,
}

impl Staged {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

fn split_blocks(runs: Vec<(u64, Vec<u8>)>, out: &mut Vec<(u64, Vec<u8>)>) {
    for (disk, data) in runs {
        assert_eq!(data.len() % BLOCK_BYTES, 0, "staged data is whole blocks");
        out.extend(
            data.chunks(BLOCK_BYTES)
                .enumerate()
                .map(|(i, b)| (disk + i as u64, b.to_vec())),
        );
    }
}

impl Filesystem {
    /// Stages whole blocks of `ino`'s data for disk block `disk`.
    pub(crate) fn stage_data(&mut self, ino: u64, disk: u64, data: &[u8]) -> Result<()> {
        self.staged.bytes += data.len();
        self.staged
            .by_ino
            .entry(ino)
            .or_default()
            .push((disk, data.to_vec()));
        if self.staged.bytes > MAX_STAGED_BYTES {
            let blocks = self.take_all_staged();
            let written = crate::commit::write_blocks(&mut *self.dev, blocks);
            self.fail_stop_on_error(written)?;
        }
        Ok(())
    }

    /// Takes the staged blocks of `inos`, one 4 KiB block per entry (for `write_blocks`).
    pub(crate) fn take_staged<'a>(
        &mut self,
        inos: impl Iterator<Item = &'a u64>,
    ) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for ino in inos {
            if let Some(runs) = self.staged.by_ino.remove(ino) {
                self.staged.bytes -= runs.iter().map(|(_, d)| d.len()).sum::<usize>();
                split_blocks(runs, &mut out);
            }
        }
        out
    }

    /// Takes every staged block.
    pub(crate) fn take_all_staged(&mut self) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for (_, runs) in std::mem::take(&mut self.staged.by_ino) {
            split_blocks(runs, &mut out);
        }
        self.staged.bytes = 0;
        out
    }

    /// Writes `ino`'s staged data back (before its blocks are read).
    pub(crate) fn write_back(&mut self, ino: u64) -> Result<()> {
        if !self.staged.by_ino.contains_key(&ino) {
            return Ok(());
        }
        self.check_writable()?;
        let blocks = self.take_staged(std::iter::once(&ino));
        let written = crate::commit::write_blocks(&mut *self.dev, blocks);
        self.fail_stop_on_error(written)
    }

    /// Drops `ino`'s staged data (the inode is gone; its blocks were freed).
    pub(crate) fn drop_staged(&mut self, ino: u64) {
        if let Some(runs) = self.staged.by_ino.remove(&ino) {
            self.staged.bytes -= runs.iter().map(|(_, d)| d.len()).sum::<usize>();
        }
    }

    /// Bytes of file data staged and not yet written.
    pub fn staged_bytes(&self) -> usize {
        self.staged.bytes()
    }
}
