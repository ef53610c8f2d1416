//! Writes: whole blocks copied on write into new extents (grown in place when an append
//! continues the last one on disk), partial writes through their edge blocks, appends,
//! batches, and the writes a thread the engine is lent to may run ([`Filesystem::write_lent`]).
//!
//! # Invariants
//! - A write allocates before it changes anything and replaces the extents it covers only
//!   once its blocks are staged or written: a failed write leaves the file as it was.
//! - A lent write reads nothing from the queue: its edge blocks are cached, read beside the
//!   queue, or it goes to the owner untouched.

use super::Staged;
use super::{extent_key, rw_len, ReadPiece, BLOCK, MAX_FILE_BYTES};
use crate::error::{EngineError, Result};
use crate::format::items::{ExtentItem, Timespec, MAX_EXTENT_BLOCKS};
use crate::format::BLOCK_BYTES;
use crate::fs::{Filesystem, Needs};
use crate::space::MetaNeed;

/// A write's bytes as the engine gets them: borrowed from its caller, and copied once when
/// they are staged, or shared (a reactor's request owns them, as a [`Staged`]), and staged
/// as they are. Cloning either copies no byte (the closures [`Filesystem::run_op`] retries
/// take a clone).
#[derive(Clone)]
enum WriteBytes<'a> {
    Borrowed(&'a [u8]),
    Shared(Staged),
}

impl<'a> WriteBytes<'a> {
    fn as_slice(&self) -> &[u8] {
        match self {
            WriteBytes::Borrowed(b) => b,
            WriteBytes::Shared(b) => b,
        }
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Bytes `range` of these, borrowed or shared as these are.
    fn slice(&self, range: std::ops::Range<usize>) -> WriteBytes<'a> {
        match self {
            WriteBytes::Borrowed(b) => WriteBytes::Borrowed(&b[range]),
            WriteBytes::Shared(b) => WriteBytes::Shared(b.slice(range)),
        }
    }

    /// These bytes staged whole before they are cut into runs: a borrowed write is copied
    /// once, as a whole, so its size decides whether the copy is aligned
    /// ([`nvme::staging_copy`]) and its runs are slices of that copy (copied run by run, a
    /// 1 MiB write's short allocation runs were small copies the device could not write
    /// from).
    fn staged_whole(self) -> WriteBytes<'static> {
        WriteBytes::Shared(self.into_staged())
    }

    /// The bytes for staging: a borrowed write's copied (its caller keeps its buffer) into
    /// memory the device can write from when large, each block's crc taken as it is copied
    /// ([`Staged::copy_of`]), a shared one's as they are.
    fn into_staged(self) -> Staged {
        match self {
            WriteBytes::Borrowed(b) => Staged::copy_of(b),
            WriteBytes::Shared(b) => b,
        }
    }
}

impl Filesystem {
    /// The extent that ends at file block `at`, grown by `next` (a new extent at `at`), when
    /// `next` continues it on disk and both fit one item; keyed by its own first block, so
    /// inserting it replaces the old item.
    fn grown_extent(
        &mut self,
        ino: u64,
        at: u64,
        next: &ExtentItem,
        looked_up: Option<Vec<super::Extent>>,
    ) -> Result<Option<(u64, ExtentItem)>> {
        if at == 0 || next.prealloc {
            return Ok(None);
        }
        // The block before `at` first, decoded alone (`looked_up`: the caller has it): only
        // when it sits right before `next` on disk (an append, rarely an overwrite) is its
        // whole item read, which copies up to 1 KiB of checksums.
        let neighbour = match looked_up {
            Some(neighbour) => neighbour,
            None => self.extents_for_read(ino, at - 1, at)?,
        };
        let [block] = neighbour.as_slice() else {
            return Ok(None);
        };
        if block.item.prealloc || block.item.disk_block + 1 != next.disk_block {
            return Ok(None);
        }
        let before = self.extents_in(ino, at - 1, at)?;
        let [prev] = before.as_slice() else {
            return Ok(None);
        };
        let item = &prev.item;
        let continues = prev.end() == at
            && !item.prealloc
            && item.disk_block + item.blocks as u64 == next.disk_block
            && item.blocks + next.blocks <= MAX_EXTENT_BLOCKS;
        if !continues {
            return Ok(None);
        }
        let mut crcs = Vec::with_capacity((item.blocks + next.blocks) as usize);
        crcs.extend_from_slice(&item.crcs);
        crcs.extend_from_slice(&next.crcs);
        Ok(Some((
            prev.file_block,
            ExtentItem {
                disk_block: item.disk_block,
                blocks: item.blocks + next.blocks,
                prealloc: false,
                crcs,
            },
        )))
    }

    /// Allocates and writes `data` (whole blocks) as new extents at file block `first`,
    /// replacing whatever covered that range. Returns the net change in allocated blocks.
    ///
    /// Order matters for a full device: the data blocks are allocated (and given back when
    /// refused), then the metadata the change may allocate is reserved, before anything
    /// changes. The data is staged ([`crate::writeback`]) and reaches the device before any
    /// record or commit that makes the new extents durable.
    fn write_blocks(
        &mut self,
        ino: u64,
        first: u64,
        data: WriteBytes<'_>,
        size: u64,
    ) -> Result<i64> {
        assert_eq!(data.len() % BLOCK_BYTES, 0);
        let count = (data.len() / BLOCK_BYTES) as u64;
        // One lookup of what the write covers serves both paths (it changes nothing, and
        // allocating changes no extent).
        let overlapping = self.extents_in(ino, first, first + count)?;
        if self.write_into_prealloc(ino, first, &data, &overlapping)? {
            return Ok(0);
        }
        let shard = self.shard_of(ino);
        let (goal, before) = self.growth_goal(ino, first, size)?;
        let runs = self.alloc_data_runs(shard, count, goal)?;
        let room = self
            .punch_needs_blocks(ino, overlapping.len() as u64, first, first + count)
            .and_then(|punch| {
                let mut needs = Needs::default();
                needs.meta(
                    shard,
                    punch + (runs.len() as u64 + 1) * self.tree_op_blocks(shard),
                );
                self.reserve(&needs, MetaNeed::Grow)
            });
        if let Err(e) = room {
            // Nothing changed yet: give the blocks back.
            self.give_back(shard, &runs)?;
            return Err(e);
        }
        let mut done = 0u64;
        let mut items = Vec::with_capacity(runs.len());
        // The write as a whole decides, not each allocation run it lands in.
        let streaming = data.len() >= crate::writeback::STREAM_WRITE_BYTES;
        let data = data.staged_whole();
        for &(disk, got) in &runs {
            let bytes = data.slice((done * BLOCK) as usize..((done + got) * BLOCK) as usize);
            let bytes = bytes.into_staged();
            let crcs = bytes.block_crcs();
            self.stage_data(ino, disk, bytes.into_bytes(), streaming)?;
            items.push((
                first + done,
                ExtentItem {
                    disk_block: disk,
                    blocks: got as u32,
                    prealloc: false,
                    crcs,
                },
            ));
            done += got;
        }
        // A write that continues the extent before it on disk (an append, which the
        // allocator's next-fit places right after the file's last blocks) grows that extent
        // instead of adding one: a file written 4 KiB at a time is then made of 256-block
        // extents, not one item per block (whose removal, a tree operation each, held the
        // reactor 8.6 ms to unlink a 64 MiB file).
        let mut replaced_at = Some(first);
        if let Some(first_item) = items.first_mut() {
            // The block before the write, as the goal looked it up (only for the first run:
            // it is the block before it).
            let looked_up = before.filter(|_| first_item.0 == first);
            if let Some(grown) = self.grown_extent(ino, first_item.0, &first_item.1, looked_up)? {
                *first_item = grown;
                // Nothing is inserted at `first` now: an extent there goes.
                replaced_at = None;
            }
        }
        let freed = self.punch_extents(ino, overlapping, first, first + count, replaced_at)?;
        self.with_tree(shard, true, |tree, io| {
            for (file_block, item) in items {
                tree.insert(io, extent_key(ino, file_block), item.encode())?;
            }
            Ok(())
        })?;
        Ok(count as i64 - freed as i64)
    }

    /// Where a write at file block `first` of file `ino` (of `size` bytes) should have its
    /// blocks allocated ([`crate::space::DataGoal`]): right after the file's block before
    /// it on disk, when the write grows the file (it starts at its last block or past it:
    /// an append, `dd`, a log) and that block is written data. A file of at least
    /// [`crate::space::STREAM_ROOM_BLOCKS`] blocks written past its end streams: when
    /// another file took its next block, it moves to fresh room rather than interleave. `None` for an overwrite
    /// inside the file: its blocks go where any allocation goes (a random overwrite that
    /// jumped would scatter the file).
    /// Also returns the lookup of the block before the write it made, for
    /// [`Filesystem::grown_extent`] to use rather than look it up again.
    fn growth_goal(
        &mut self,
        ino: u64,
        first: u64,
        size: u64,
    ) -> Result<(Option<crate::space::DataGoal>, Option<Vec<super::Extent>>)> {
        if first == 0 || first < size.div_ceil(BLOCK).saturating_sub(1) {
            return Ok((None, None));
        }
        let before = self.extents_for_read(ino, first - 1, first)?;
        let goal = match before.as_slice() {
            [block] if !block.item.prealloc => Some(crate::space::DataGoal {
                block: block.item.disk_block + 1,
                // Only a write past the end moves: one that rewrites the file's partial
                // last block (an unaligned append, SQLite's WAL frames) finds that block's
                // old copy in its way every time, and would jump at every write.
                streaming: first >= crate::space::STREAM_ROOM_BLOCKS && first * BLOCK >= size,
            }),
            _ => None,
        };
        Ok((goal, Some(before)))
    }

    /// Writes `data` (whole blocks at file block `first`) into the preallocated blocks that
    /// cover it, when preallocated extents (fallocate) cover every one of its blocks: the
    /// blocks are the file's already, so the write allocates none, and a write into space
    /// fallocate promised never fails for want of space (posix_fallocate's guarantee; it
    /// failed with ENOSPC on a full device when every write allocated anew). Each extent
    /// covered is cut into its preallocated left and right parts and the written middle, at
    /// the same disk blocks; the tree changes may use the reserves, as a removal's may.
    /// False, with nothing changed, when any block is not preallocated: the write then
    /// allocates as any other.
    ///
    /// Copy-on-write is kept where it matters: a preallocated block holds nothing a reader
    /// or a durable state can see (it reads as zeroes until the written extent is durable,
    /// and the data is staged and written before any record or commit that references it),
    /// so writing it in place overwrites no live data. A block written once is an ordinary
    /// extent; writing it again copies on write.
    fn write_into_prealloc(
        &mut self,
        ino: u64,
        first: u64,
        data: &WriteBytes<'_>,
        extents: &[super::Extent],
    ) -> Result<bool> {
        let count = (data.len() / BLOCK_BYTES) as u64;
        let end = first + count;
        if extents.is_empty() {
            return Ok(false);
        }
        let mut covered = first;
        for extent in extents {
            if !extent.item.prealloc || extent.file_block > covered {
                return Ok(false);
            }
            covered = covered.max(extent.end());
        }
        if covered < end {
            return Ok(false);
        }
        let shard = self.shard_of(ino);
        let mut needs = Needs::default();
        // At most three items per extent (left, written, right), each a tree operation.
        needs.meta(
            shard,
            (3 * extents.len() as u64 + 1) * self.tree_op_blocks(shard),
        );
        self.reserve(&needs, MetaNeed::Shrink)?;
        let streaming = data.len() >= crate::writeback::STREAM_WRITE_BYTES;
        let data = data.clone().staged_whole();
        for extent in extents {
            let extent = extent.clone();
            let cut_from = extent.file_block.max(first);
            let cut_to = extent.end().min(end);
            let skip = cut_from - extent.file_block;
            let disk = extent.item.disk_block + skip;
            let bytes = data
                .slice(((cut_from - first) * BLOCK) as usize..((cut_to - first) * BLOCK) as usize);
            let bytes = bytes.into_staged();
            let crcs = bytes.block_crcs();
            self.stage_data(ino, disk, bytes.into_bytes(), streaming)?;
            let prealloc = |from: u64, to: u64| ExtentItem {
                disk_block: extent.item.disk_block + (from - extent.file_block),
                blocks: (to - from) as u32,
                prealloc: true,
                crcs: Vec::new(),
            };
            let written = ExtentItem {
                disk_block: disk,
                blocks: (cut_to - cut_from) as u32,
                prealloc: false,
                crcs,
            };
            let left =
                (cut_from > extent.file_block).then(|| prealloc(extent.file_block, cut_from));
            let right = (cut_to < extent.end()).then(|| prealloc(cut_to, extent.end()));
            self.with_tree(shard, true, |tree, io| {
                // An insert at an existing key replaces its item: the extent's key keeps the
                // left part, or the written one when the write starts at the extent.
                if let Some(left) = left {
                    tree.insert(io, extent_key(ino, extent.file_block), left.encode())?;
                }
                tree.insert(io, extent_key(ino, cut_from), written.encode())?;
                if let Some(right) = right {
                    tree.insert(io, extent_key(ino, cut_to), right.encode())?;
                }
                Ok(())
            })?;
        }
        Ok(true)
    }

    /// Writes `data` at `offset` (any alignment). Returns bytes written. When space is short
    /// only because frees wait for a commit (an overwrite frees the old copy, pinned), a whole
    /// mount commits once and retries before reporting ENOSPC ([`Filesystem::run_op`]).
    /// Like write(2), a write longer than [`MAX_RW_BYTES`] writes that much and returns it;
    /// a position past `i64::MAX` is EINVAL ([`rw_len`]).
    pub fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<usize> {
        self.write_bytes(ino, offset, WriteBytes::Borrowed(data))
    }

    /// [`Filesystem::write`] of bytes the caller hands over: they are staged as they are,
    /// not copied (a reactor's write request owns its bytes).
    pub fn write_shared(&mut self, ino: u64, offset: u64, data: Staged) -> Result<usize> {
        self.write_bytes(ino, offset, WriteBytes::Shared(data))
    }

    fn write_bytes(&mut self, ino: u64, offset: u64, data: WriteBytes<'_>) -> Result<usize> {
        let data = data.slice(0..rw_len(offset, data.len())?);
        self.run_op(|fs| fs.write_once(ino, offset, data.clone()))
    }

    /// Appends `data` at the end of the file, atomically: the end is read and written in
    /// one operation, so two appenders never write at the same place (O_APPEND). Returns
    /// the offset it wrote at and the bytes written.
    pub fn append(&mut self, ino: u64, data: &[u8]) -> Result<(u64, usize)> {
        self.append_bytes(ino, WriteBytes::Borrowed(data))
    }

    /// [`Filesystem::append`] of bytes the caller hands over, staged without a copy.
    pub fn append_shared(&mut self, ino: u64, data: Staged) -> Result<(u64, usize)> {
        self.append_bytes(ino, WriteBytes::Shared(data))
    }

    fn append_bytes(&mut self, ino: u64, data: WriteBytes<'_>) -> Result<(u64, usize)> {
        let offset = self.file_inode(ino)?.size;
        let written = self.write_bytes(ino, offset, data)?;
        Ok((offset, written))
    }

    /// Applies `writes` to `ino` in order, as one operation: all of them or, with NoSpace or
    /// an invalid argument, none (the worst case is reserved before the first change). No
    /// commit starts inside it, so no commit and no fsync record ever holds part of the
    /// writes: the base of atomic batches ([`crate::atomic`]). When space is short only
    /// because frees wait for a commit, commits before applying anything and tries once more.
    pub fn write_batch(&mut self, ino: u64, writes: &[(u64, Vec<u8>)]) -> Result<()> {
        for (offset, data) in writes {
            if rw_len(*offset, data.len())? < data.len() {
                return Err(EngineError::TooBig(
                    "a batched write longer than one write".into(),
                ));
            }
            offset
                .checked_add(data.len() as u64)
                .filter(|&e| e <= MAX_FILE_BYTES)
                .ok_or_else(|| EngineError::TooBig("file offset".into()))?;
        }
        self.run_op(|fs| fs.write_batch_once(ino, writes))
    }

    fn write_batch_once(&mut self, ino: u64, writes: &[(u64, Vec<u8>)]) -> Result<()> {
        self.file_inode(ino)?;
        let shard = self.shard_of(ino);
        let tree_op = self.tree_op_blocks(shard);
        let mut needs = Needs::default();
        for (offset, data) in writes.iter().filter(|(_, d)| !d.is_empty()) {
            let first = offset / BLOCK;
            let end = (offset + data.len() as u64).div_ceil(BLOCK);
            let count = end - first;
            let overlapping = self.extents_in(ino, first, end)?.len() as u64;
            // Two more than found: an earlier write of the batch may have split an extent at
            // either edge. The runs: whole extents, and one more for a fragmented allocation.
            let punch = self.punch_needs_blocks(ino, overlapping + 2, first, end)?;
            let runs = count.div_ceil(MAX_EXTENT_BLOCKS as u64) + 1;
            needs.data(shard, count);
            needs.meta(shard, punch + (runs + 1) * tree_op);
        }
        needs.meta(shard, tree_op);
        self.reserve(&needs, MetaNeed::Grow)?;
        for (offset, data) in writes {
            // Nested, so the write's own reservation is the one made above (only the
            // outermost operation reserves): at depth 1 it would reserve again, on top.
            self.run_op(|fs| fs.write_once(ino, *offset, WriteBytes::Borrowed(data)))?;
        }
        Ok(())
    }

    fn write_once(&mut self, ino: u64, offset: u64, data: WriteBytes<'_>) -> Result<usize> {
        let mut item = self.file_inode(ino)?;
        let len = data.len();
        if len == 0 {
            return Ok(0);
        }
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= MAX_FILE_BYTES)
            .ok_or_else(|| EngineError::TooBig("file offset".into()))?;
        let first = offset / BLOCK;
        let delta = if offset % BLOCK == 0 && end % BLOCK == 0 {
            // Whole blocks: staged as they are (a shared write's bytes are not copied).
            self.write_blocks(ino, first, data, item.size)?
        } else {
            self.write_partial(ino, offset, end, data.as_slice(), item.size)?
        };
        item.blocks = item.blocks.saturating_add_signed(delta);
        item.size = item.size.max(end);
        let now = Timespec::now();
        item.mtime = now;
        item.ctime = now;
        self.store_inode(ino, &item)?;
        Ok(len)
    }

    /// A write run by a thread the engine is lent to (a client while its reactor sleeps):
    /// only one that stages its bytes and reads nothing from the device. Its lookups (the
    /// inode, the extents it replaces) are in memory; every block it covers in part and that
    /// lies inside the file is in the block cache (an append to a log or a WAL, whose last
    /// block the previous append left there; [`Filesystem::edges_to_read`]); and staging keeps room below the write-back threshold, so no write-back
    /// starts (the device's queue is the owner's). `None`, untouched, otherwise: the owner
    /// runs it. What runs is [`Filesystem::write`], through [`Filesystem::change_lent`].
    /// The bytes are the request's, staged as they are ([`Filesystem::write_shared`]).
    pub fn write_lent(&mut self, ino: u64, offset: u64, data: Staged) -> Option<Result<usize>> {
        self.write_lent_edges(ino, offset, data, false)
    }

    /// [`Filesystem::write_lent`], and an edge block memory does not hold (a partial
    /// overwrite of data on the device: a SQLite WAL written again from its start after a
    /// checkpoint) is read synchronously beside the queue first, checked against its
    /// extent's crc and cached, as a kernel filesystem reads the block a partial write
    /// covers. A staged edge not in the cache still goes to the owner (reading it means
    /// writing it back first). A device error fails the filesystem, as on the owner's path.
    pub fn write_lent_reading_edges(
        &mut self,
        ino: u64,
        offset: u64,
        data: Staged,
    ) -> Option<Result<usize>> {
        self.write_lent_edges(ino, offset, data, true)
    }

    fn write_lent_edges(
        &mut self,
        ino: u64,
        offset: u64,
        data: Staged,
        read_edges: bool,
    ) -> Option<Result<usize>> {
        if !self.dev.reads_beside_queue() || self.failed.is_some() {
            return None;
        }
        // What the write stages: every block it covers, whole (an unaligned write of 100
        // bytes across a block boundary stages two), kept under the write-back threshold.
        // A write that makes a commit near lowers the threshold under it; staging then
        // starts no write-back for a lent engine (`stage_data`), the owner does at its next
        // write. (Bounding every lent write by the near-commit threshold instead, 256 KiB,
        // took dbench beside a neighbour from 0.82x to 0.61x ext4: staged data waits for a
        // commit, so most writes were sent to the reactor again.)
        let covered_blocks = (offset % BLOCK + data.len() as u64).div_ceil(BLOCK);
        let staged_after = self.staged_bytes() as u64 + covered_blocks * BLOCK;
        let bound = self
            .writeback_threshold_bytes()
            .min(self.options.staged_park_bytes);
        if staged_after > bound as u64 {
            self.fetch.stats.from_memory_misses += 1;
            return None;
        }
        // Until 2026-12-05 any edge inside the file sent the write to the owner, in memory or
        // not: every SQLite WAL frame (24 bytes, then a page, each starting inside the
        // block the previous one ended in) was a round trip to the reactor.
        let edges = self.from_memory(|fs| -> Result<Option<Vec<ReadPiece>>> {
            let len = rw_len(offset, data.len())? as u64;
            fs.file_inode(ino)?;
            fs.probe_extents(ino, offset, len)?;
            fs.edges_to_read(ino, offset, offset + len)
        })?;
        let reads = match edges {
            Ok(Some(reads))
                if reads.is_empty() || (read_edges && self.block_cache.capacity_blocks() > 0) =>
            {
                reads
            }
            Ok(_) => {
                self.fetch.stats.from_memory_misses += 1;
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        let out = self.change_lent(|fs| {
            fs.read_edges_beside(&reads)?;
            fs.write_shared(ino, offset, data.clone())
        });
        self.fetch.stats.lent_writes += out.is_some() as u64;
        self.fetch.stats.lent_write_edge_reads += reads.len() as u64;
        out
    }

    /// The edge blocks of a write of `offset..end` of file `ino` (see
    /// [`Filesystem::edge_disk_blocks`]) that the block cache does not hold, as read pieces;
    /// `None` when one is staged and not cached (the owner writes it back before reading
    /// it). Lookups only.
    fn edges_to_read(&mut self, ino: u64, offset: u64, end: u64) -> Result<Option<Vec<ReadPiece>>> {
        let mut pieces = Vec::new();
        for (disk, crc) in self.edge_disk_blocks(ino, offset, end)? {
            if self.block_cache.get_checked(disk, crc).is_some() {
                continue;
            }
            if self.staged_block(ino, disk).is_some() {
                return Ok(None);
            }
            pieces.push(ReadPiece::edge_block(ino, disk, crc));
        }
        Ok(Some(pieces))
    }

    /// The edge blocks a write of `offset..end` of file `ino` reads (the blocks it covers only
    /// in part, inside the file and on the device) that memory does not hold: the reads it
    /// would wait for, as read pieces. Lookups only, so it runs deferred. A staged block
    /// counts as held: a read of it from the device would find the old bytes (the write
    /// writes it back first, [`Filesystem::write_partial`] through the read path).
    pub(crate) fn edge_reads(&mut self, ino: u64, offset: u64, end: u64) -> Result<Vec<ReadPiece>> {
        let mut pieces = Vec::new();
        for (disk, crc) in self.edge_disk_blocks(ino, offset, end)? {
            if self.block_cache.get(disk).is_some() || self.staged_block(ino, disk).is_some() {
                continue;
            }
            pieces.push(ReadPiece::edge_block(ino, disk, crc));
        }
        Ok(pieces)
    }

    /// The device blocks (and their crc32c) under the blocks a write of `offset..end` covers
    /// only in part and that lie inside the file with data on the device (not past the end,
    /// not a hole, not preallocated: those read as zeroes). Lookups only.
    fn edge_disk_blocks(&mut self, ino: u64, offset: u64, end: u64) -> Result<Vec<(u64, u32)>> {
        let first = offset / BLOCK;
        let mut edges = Vec::with_capacity(2);
        if offset % BLOCK != 0 {
            edges.push(first);
        }
        if end % BLOCK != 0 && (end.div_ceil(BLOCK) - 1 != first || offset % BLOCK == 0) {
            edges.push(end / BLOCK);
        }
        // A write of whole blocks (the common case) reads nothing: no lookup either.
        if edges.is_empty() {
            return Ok(Vec::new());
        }
        let item = self.file_inode(ino)?;
        let mut out = Vec::with_capacity(2);
        for block in edges {
            if block * BLOCK >= item.size {
                continue; // past the end: reads as zeroes
            }
            for extent in self.extents_in(ino, block, block + 1)? {
                if extent.item.prealloc {
                    continue;
                }
                let skip = (block - extent.file_block) as usize;
                out.push((extent.item.disk_block + skip as u64, extent.item.crcs[skip]));
            }
        }
        Ok(out)
    }

    /// A write that starts or ends inside a block: the old content of the edge blocks is read
    /// and the new bytes laid over it. An edge block at or past the file's end (`size`)
    /// holds nothing to read: it starts as zeroes.
    fn write_partial(
        &mut self,
        ino: u64,
        offset: u64,
        end: u64,
        data: &[u8],
        size: u64,
    ) -> Result<i64> {
        let first = offset / BLOCK;
        let last = end.div_ceil(BLOCK);
        let mut blocks = vec![0u8; ((last - first) * BLOCK) as usize];
        let head = (offset - first * BLOCK) as usize;
        if head != 0 && first * BLOCK < size {
            let old = self.edge_bytes(ino, first, size)?;
            blocks[..old.len()].copy_from_slice(&old);
        }
        let tail_block = last - 1;
        if end % BLOCK != 0 && (tail_block != first || head == 0) && tail_block * BLOCK < size {
            let old = self.edge_bytes(ino, tail_block, size)?;
            let at = ((tail_block - first) * BLOCK) as usize;
            blocks[at..at + old.len()].copy_from_slice(&old);
        }
        blocks[head..head + data.len()].copy_from_slice(data);
        // Staged as built: no second copy.
        self.write_blocks(ino, first, WriteBytes::Shared(Staged::from(blocks)), size)
    }

    /// The old bytes of file block `block` (inside the file of `size` bytes, up to its end)
    /// under a write that covers it in part: from the block cache when it holds the block,
    /// checked against its crc, else through the read path. Not the read path first: that
    /// also follows read streams and starts read-ahead, device reads a write never needed
    /// and a thread the engine is lent to must not make ([`Filesystem::write_lent`] runs
    /// only writes whose edge blocks are cached or read beside the queue).
    fn edge_bytes(&mut self, ino: u64, block: u64, size: u64) -> Result<Vec<u8>> {
        let len = (size - block * BLOCK).min(BLOCK) as usize;
        match self.extents_in(ino, block, block + 1)?.as_slice() {
            // A hole, or space preallocated and never written: zeroes.
            [] => return Ok(vec![0u8; len]),
            [extent] if extent.item.prealloc => return Ok(vec![0u8; len]),
            [extent] => {
                let skip = (block - extent.file_block) as usize;
                let disk = extent.item.disk_block + skip as u64;
                let crc = extent.item.crcs[skip];
                let mut out = vec![0u8; len];
                if self.copy_cached(disk, &[crc], 0..len, &mut out) {
                    return Ok(out);
                }
            }
            _ => {}
        }
        self.read(ino, block * BLOCK, BLOCK_BYTES)
    }
}
