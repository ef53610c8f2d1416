//! Size and space: truncate (shrink frees the blocks past the end and zeroes the last
//! block's tail; grow reads zeroes), and fallocate (preallocate, keep size, punch a hole,
//! zero a range).
//!
//! # Invariants
//! - Every operation reserves its worst case of metadata blocks first ([`Needs`]), so it
//!   fails with ENOSPC before it changes anything.

use super::{extent_key, FallocateMode, BLOCK, MAX_FILE_BYTES};
use crate::error::{EngineError, Result};
use crate::format::items::{ExtentItem, Timespec};
use crate::format::{ItemKind, Key};
use crate::fs::{Filesystem, Needs};
use crate::space::MetaNeed;

impl Filesystem {
    /// Sets the file size: shrinking frees the blocks past the end and zeroes the tail of the
    /// last block, so growing again reads zeroes.
    pub fn truncate(&mut self, ino: u64, size: u64) -> Result<()> {
        self.run_op(|fs| {
            let mut needs = Needs::default();
            fs.need_truncate(&mut needs, ino, size)?;
            fs.reserve(&needs, MetaNeed::Shrink)?;
            fs.truncate_reserved(ino, size)
        })
    }

    /// What truncating `ino` to `size` may allocate: every leaf holding extents past the new
    /// end copied, and for a cut inside a block that block rewritten (a data block, its
    /// extent and the inode twice).
    pub(crate) fn need_truncate(&mut self, needs: &mut Needs, ino: u64, size: u64) -> Result<()> {
        if size > MAX_FILE_BYTES {
            return Err(EngineError::TooBig("file size".into()));
        }
        let item = self.file_inode(ino)?;
        let shard = self.shard_of(ino);
        let op = self.tree_op_blocks(shard);
        if size < item.size {
            let keep_blocks = size.div_ceil(BLOCK);
            let punch = self.item_range_blocks(
                shard,
                extent_key(ino, keep_blocks),
                Key::new(ino, ItemKind::ExtentData, u64::MAX),
            )?;
            needs.meta(shard, punch + 7 * op).data(shard, 1);
        } else {
            needs.meta(shard, op);
        }
        Ok(())
    }

    /// [`Filesystem::truncate`] once its room is reserved.
    pub(crate) fn truncate_reserved(&mut self, ino: u64, size: u64) -> Result<()> {
        let mut item = self.file_inode(ino)?;
        if size < item.size {
            let keep_blocks = size.div_ceil(BLOCK);
            let freed = self.punch_blocks(ino, keep_blocks, u64::MAX / BLOCK)?;
            item.blocks -= freed.min(item.blocks);
            if size % BLOCK != 0 {
                // Zero the rest of the last block (copy-on-write like any write).
                let tail_start = size;
                let tail_len = (keep_blocks * BLOCK - size) as usize;
                if !self
                    .extents_in(ino, keep_blocks - 1, keep_blocks)?
                    .is_empty()
                {
                    item.size = keep_blocks * BLOCK;
                    self.store_inode(ino, &item)?;
                    self.write(ino, tail_start, &vec![0u8; tail_len])?;
                    item = self.file_inode(ino)?;
                }
            }
        }
        item.size = size;
        let now = Timespec::now();
        item.mtime = now;
        item.ctime = now;
        self.store_inode(ino, &item)
    }

    /// fallocate(2): preallocate (optionally keeping the size), punch a hole, or zero a range.
    pub fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        self.run_op(|fs| fs.fallocate_once(ino, mode, offset, len))
    }

    /// One fallocate, all or nothing: the blocks it preallocates are allocated, and the
    /// metadata (and edge data blocks) it may need reserved, before anything changes.
    fn fallocate_once(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        // fallocate(2): a zero length is EINVAL; a range past the largest file size (or
        // past what a 64-bit offset holds) is EFBIG; a hole punch must keep the size
        // (FALLOC_FL_KEEP_SIZE), EOPNOTSUPP otherwise.
        if len == 0 {
            return Err(EngineError::Invalid("fallocate of 0 bytes".into()));
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= MAX_FILE_BYTES)
            .ok_or_else(|| {
                EngineError::TooBig(format!(
                    "fallocate to {offset} + {len} bytes, past the largest file ({MAX_FILE_BYTES})"
                ))
            })?;
        if mode.punch_hole && !mode.keep_size {
            return Err(EngineError::NotSupported(
                "a hole punch without KEEP_SIZE".into(),
            ));
        }
        // Only regular files have extents (EISDIR for directories, EINVAL for symlinks).
        let size = self.file_inode(ino)?.size;
        let shard = self.shard_of(ino);
        let op = self.tree_op_blocks(shard);
        let first = offset / BLOCK;
        let last = end.div_ceil(BLOCK);
        // Whole blocks inside the range become holes (punch, zero); partial edges are
        // written as zeroes.
        let inner_first = offset.div_ceil(BLOCK);
        let inner_end = end / BLOCK;
        let punching = mode.punch_hole || mode.zero_range;
        let edges: Vec<(u64, u64)> = if !punching {
            Vec::new()
        } else if inner_first < inner_end {
            vec![(offset, inner_first * BLOCK), (inner_end * BLOCK, end)]
        } else {
            vec![(offset, end)]
        };
        let edges: Vec<(u64, u64)> = edges
            .into_iter()
            .map(|(from, to)| (from, if mode.zero_range { to } else { to.min(size) }))
            .filter(|(from, to)| from < to)
            .collect();
        // What preallocation will fill: for a zero range, the whole blocks the punch
        // empties; for a plain preallocation, every hole of the range. A punched hole stays
        // a hole.
        let extents = self.extents_in(ino, first, last)?;
        let mut holes = Vec::new();
        if mode.zero_range {
            if inner_first < inner_end {
                holes.push((inner_first, inner_end));
            }
        } else if !mode.punch_hole {
            let mut at = first;
            for extent in &extents {
                if extent.file_block > at {
                    holes.push((at, extent.file_block.min(last)));
                }
                at = at.max(extent.end());
            }
            if at < last {
                holes.push((at, last));
            }
        }
        let hole_blocks: u64 = holes.iter().map(|(f, t)| t - f).sum();
        let runs = self.alloc_data_runs(shard, hole_blocks, None)?;
        let mut needs = Needs::default();
        let punch = if punching && inner_first < inner_end {
            let overlapping = extents
                .iter()
                .filter(|e| e.end() > inner_first && e.file_block < inner_end)
                .count() as u64;
            self.punch_needs_blocks(ino, overlapping, inner_first, inner_end)?
        } else {
            0
        };
        // Each edge write: a data block, its extent cut (two changes), its insert, the inode.
        needs
            .meta(
                shard,
                punch + (4 * edges.len() as u64 + runs.len() as u64 + 3) * op,
            )
            .data(shard, edges.len() as u64);
        if let Err(e) = self.reserve(&needs, MetaNeed::Grow) {
            self.give_back(shard, &runs)?;
            return Err(e);
        }
        if punching && inner_first < inner_end {
            let freed = self.punch_blocks(ino, inner_first, inner_end)?;
            let mut item = self.file_inode(ino)?;
            item.blocks -= freed.min(item.blocks);
            self.store_inode(ino, &item)?;
        }
        for (from, to) in edges {
            self.write(ino, from, &vec![0u8; (to - from) as usize])?;
        }
        // Preallocate the holes with the runs allocated above, in order.
        let mut added = 0u64;
        let mut runs = runs.into_iter();
        let mut pending: Option<(u64, u64)> = None;
        for (mut from, to) in holes {
            while from < to {
                let (disk, got) = match pending.take().or_else(|| runs.next()) {
                    Some(run) => run,
                    None => unreachable!("runs cover every hole"),
                };
                let take = got.min(to - from);
                if take < got {
                    pending = Some((disk + take, got - take));
                }
                let item = ExtentItem {
                    disk_block: disk,
                    blocks: take as u32,
                    prealloc: true,
                    crcs: Vec::new(),
                };
                self.with_tree(shard, true, |tree, io| {
                    tree.insert(io, extent_key(ino, from), item.encode())
                })?;
                from += take;
                added += take;
            }
        }
        let mut item = self.file_inode(ino)?;
        item.blocks += added;
        // The edge writes may have grown the file; KEEP_SIZE puts it back.
        item.size = if mode.keep_size { size } else { size.max(end) };
        // As ext4: the data changed (a punch, a zeroed range) or the size grew, so mtime
        // moves with ctime; a preallocation that keeps the size changes ctime alone.
        let now = Timespec::now();
        item.ctime = now;
        if punching || item.size > size {
            item.mtime = now;
        }
        self.store_inode(ino, &item)
    }
}
