//! File data: extents, read, write, truncate, fallocate, punch hole, zero range.
//!
//! Data is copy-on-write at 4 KiB block granularity: a write allocates new blocks in the
//! inode's shard region, writes them, then replaces the extent items covering that range; the
//! blocks it replaced are freed pinned (reusable after the next super-commit). So a crash never
//! shows a half-overwritten block of a committed file, and data reaches the device before the
//! metadata that points at it (the commit flushes before its superblock).
//!
//! An extent item `(ino, ExtentData, file offset)` covers at most [`MAX_EXTENT_BLOCKS`] blocks
//! and carries the crc32c of each block; a read verifies every block it returns. Holes have no
//! item and read as zeroes; preallocated extents read as zeroes until written.
//!
//! # Invariants
//! - Extents of one inode never overlap; each disk block belongs to at most one extent.
//! - `inode.blocks` counts the data blocks the inode's extents hold.

use crate::error::{EngineError, Result};
use crate::format::items::{ExtentItem, InodeItem, Timespec, MAX_EXTENT_BLOCKS};
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use crate::fs::{Filesystem, Needs};
use crate::inode::{S_IFDIR, S_IFMT, S_IFREG};
use crate::space::MetaNeed;

const BLOCK: u64 = BLOCK_BYTES as u64;
/// Largest file offset (keeps every byte offset and block count in range): the format's.
pub use crate::format::items::MAX_FILE_BYTES;

/// The most bytes one read or write moves: Linux's `MAX_RW_COUNT` (`INT_MAX & PAGE_MASK`).
/// A longer request is shortened to it, as read(2) and write(2) shorten theirs, so no
/// caller's length makes the engine allocate more than this for one request.
pub const MAX_RW_BYTES: usize = 0x7fff_f000;

/// Bounds the position and length of one read or write from outside (an ABI call, a FUSE
/// request, a client's operation) the way Linux's `rw_verify_area` does before a read or
/// write runs: file positions are signed 64-bit (`loff_t`), so an offset past `i64::MAX`
/// (a negative position) or an `offset + len` past it is EINVAL; a length over
/// [`MAX_RW_BYTES`] is then shortened, not refused. Returns the length to use. Every
/// read and write entry point of the engine calls this before it sizes any buffer.
pub fn rw_len(offset: u64, len: usize) -> Result<usize> {
    let end = u64::try_from(len)
        .ok()
        .and_then(|len| offset.checked_add(len))
        .filter(|&end| end <= i64::MAX as u64);
    if end.is_none() {
        return Err(EngineError::Invalid(format!(
            "offset {offset} + length {len} is past the largest file position (2^63 - 1)"
        )));
    }
    Ok(len.min(MAX_RW_BYTES))
}

/// What one read maps to ([`Filesystem::map_read`]): bytes `offset..end` of file `ino` (the
/// request clipped to the file's size; empty when `end == offset`) and the extents over them.
pub(crate) struct ReadMap {
    ino: u64,
    offset: u64,
    end: u64,
    extents: Vec<Extent>,
    /// The read moves the file's access time ([`crate::inode::Atime`]), decided from the
    /// inode item the mapping read anyway, so a read that moves nothing looks nothing up
    /// again.
    pub moves_atime: bool,
}

/// A device read one request of a read set ([`crate::reads`]) waits for: `count` blocks at
/// `disk` (verified against `crcs`), whose bytes `src` go to the request's output bytes
/// `dst`.
pub(crate) struct ReadPiece {
    pub request: usize,
    pub ino: u64,
    pub disk: u64,
    pub count: u64,
    pub crcs: Vec<u32>,
    pub src: std::ops::Range<usize>,
    pub dst: std::ops::Range<usize>,
}

impl ReadPiece {
    /// One block of file `ino` at `disk`, read for itself (an edge block a write covers in
    /// part), copied nowhere.
    fn edge_block(ino: u64, disk: u64, crc: u32) -> ReadPiece {
        ReadPiece {
            request: usize::MAX,
            ino,
            disk,
            count: 1,
            crcs: vec![crc],
            src: 0..0,
            dst: 0..0,
        }
    }
}

/// fallocate(2) modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FallocateMode {
    pub keep_size: bool,
    pub punch_hole: bool,
    pub zero_range: bool,
}

/// One extent as found in the tree: its first file block and its item.
#[derive(Debug, Clone)]
struct Extent {
    file_block: u64,
    item: ExtentItem,
}

impl Extent {
    fn end(&self) -> u64 {
        self.file_block + self.item.blocks as u64
    }
}

fn extent_key(ino: u64, file_block: u64) -> Key {
    Key::new(ino, ItemKind::ExtentData, file_block * BLOCK)
}

impl Filesystem {
    fn file_inode(&mut self, ino: u64) -> Result<InodeItem> {
        let item = self.load_inode(ino)?;
        match item.mode & S_IFMT {
            S_IFREG => Ok(item),
            S_IFDIR => Err(EngineError::IsDir),
            _ => Err(EngineError::Invalid("not a regular file".into())),
        }
    }

    /// The data blocks of file `ino` between byte `from` and `to` that a read-ahead should
    /// fetch: extents' blocks not in the block cache. Run deferred
    /// ([`Filesystem::without_waiting`]): read-ahead is a guess, never worth a wait. Staged
    /// blocks are left out: they are not on the device yet, and read-ahead writes nothing.
    pub(crate) fn plan_readahead(&mut self, ino: u64, from: u64, to: u64) -> Vec<ReadPiece> {
        let found = self.file_inode(ino).and_then(|item| {
            let to = to.min(item.size);
            if from >= to {
                return Ok((0, 0, Vec::new()));
            }
            let (first, last) = (from / BLOCK, to.div_ceil(BLOCK));
            Ok((first, last, self.extents_in(ino, first, last)?))
        });
        let Ok((first, last, extents)) = found else {
            return Vec::new();
        };
        let mut pieces = Vec::new();
        for extent in extents {
            if extent.item.prealloc {
                continue;
            }
            let from = extent.file_block.max(first);
            let to = extent.end().min(last);
            let mut at = from;
            while at < to {
                // Runs of blocks the cache does not hold.
                let disk = extent.item.disk_block + (at - extent.file_block);
                let wanted = |fs: &Self, disk: u64| {
                    fs.block_cache.get(disk).is_none() && fs.staged_block(ino, disk).is_none()
                };
                if !wanted(self, disk) {
                    at += 1;
                    continue;
                }
                let mut end = at + 1;
                while end < to && wanted(self, extent.item.disk_block + (end - extent.file_block)) {
                    end += 1;
                }
                let skip = (at - extent.file_block) as usize;
                pieces.push(ReadPiece {
                    request: usize::MAX,
                    ino,
                    disk,
                    count: end - at,
                    crcs: extent.item.crcs[skip..skip + (end - at) as usize].to_vec(),
                    src: 0..0,
                    dst: 0..0,
                });
                at = end;
            }
        }
        pieces
    }

    /// Looks up file `ino`'s inode and the extents over `len` bytes at `offset` (at least
    /// one block), changing nothing ([`Filesystem::probe_range`]).
    pub(crate) fn probe_extents(&mut self, ino: u64, offset: u64, len: u64) -> Result<()> {
        self.file_inode(ino)?;
        let first = offset / BLOCK;
        let end = offset.saturating_add(len).div_ceil(BLOCK).max(first + 1);
        self.extents_in(ino, first, end).map(|_| ())
    }

    /// Extents overlapping file blocks `first..end`: the one starting at or before `first`
    /// (found with one backwards seek), then those starting inside the range.
    fn extents_in(&mut self, ino: u64, first: u64, end: u64) -> Result<Vec<Extent>> {
        self.extents_over(ino, first, end, false)
    }

    /// As [`Filesystem::extents_in`], each extent cut to the blocks of `first..end` (a
    /// sub-extent reads as the same blocks do) and decoded in its tree node: a 4 KiB read
    /// of a 256-block extent copied and decoded the whole item (1 KiB of checksums), most
    /// of a cached read's allocations.
    fn extents_for_read(&mut self, ino: u64, first: u64, end: u64) -> Result<Vec<Extent>> {
        self.extents_over(ino, first, end, true)
    }

    fn extents_over(&mut self, ino: u64, first: u64, end: u64, cut: bool) -> Result<Vec<Extent>> {
        let shard = self.shard_of(ino);
        let at = extent_key(ino, first);
        // An item decoded (cut to `first..end` when asked), with its file block; the key's
        // offset is checked before anything is sized by it.
        let decode = |key: &Key, bytes: &[u8]| -> Result<Extent> {
            if key.offset % BLOCK != 0 {
                return Err(EngineError::corrupt_inode(
                    "extent item",
                    ino,
                    format!("unaligned offset {}", key.offset),
                ));
            }
            let file_block = key.offset / BLOCK;
            // Blocks of the item before `first`, and how many from there reach `end`; an item
            // not overlapping the range (or too short to say) is decoded whole and checked.
            let blocks = ExtentItem::stated_blocks(bytes).unwrap_or(0) as u64;
            let skip = first.saturating_sub(file_block);
            let take = end.saturating_sub(file_block + skip);
            let window = cut && skip < blocks && take > 0;
            let item = if window {
                ExtentItem::decode_window(bytes, skip as u32, take.min(blocks) as u32)
            } else {
                ExtentItem::decode(bytes)
            }
            .map_err(|why| EngineError::corrupt_inode("extent item", ino, why))?;
            let file_block = if window {
                file_block + skip
            } else {
                file_block
            };
            Ok(Extent { file_block, item })
        };
        let (before, inside) = self.with_tree(shard, false, |tree, io| {
            let before = tree.seek_le_with(io, &at, |k, v| {
                (k.objectid == ino && k.kind == ItemKind::ExtentData).then(|| {
                    // Extents never overlap: one that covers the whole range leaves no
                    // room for another, so the forward scan is skipped (the common
                    // overwrite of one block).
                    let covers = ExtentItem::stated_blocks(v)
                        .is_some_and(|blocks| k.offset / BLOCK + blocks as u64 >= end);
                    (decode(k, v), covers)
                })
            })?;
            let (before, covers) = match before.flatten() {
                Some((extent, covers)) => (Some(extent), covers),
                None => (None, false),
            };
            let inside = if covers {
                Vec::new()
            } else {
                tree.range(io, extent_key(ino, first + 1), extent_key(ino, end))?
            };
            Ok((before, inside))
        })?;
        let mut out = Vec::new();
        let inside = inside.into_iter().map(|(key, bytes)| decode(&key, &bytes));
        for extent in before.into_iter().chain(inside) {
            let Extent { file_block, item } = extent?;
            // Blocks outside the shard's block groups would be read from (or freed into)
            // another shard's space, the log or past the device.
            let space = &self.shards[shard as usize]
                .as_ref()
                .expect("the tree walk above found the shard held")
                .space;
            if !space.contains(item.disk_block, item.blocks as u64) {
                return Err(EngineError::corrupt_inode(
                    "extent item",
                    ino,
                    format!(
                        "blocks {}+{} outside shard {shard}'s block groups",
                        item.disk_block, item.blocks
                    ),
                ));
            }
            let extent = Extent { file_block, item };
            if extent.end() > first && extent.file_block < end {
                out.push(extent);
            }
        }
        Ok(out)
    }

    /// Allocates `count` data blocks in shard `shard` as runs of at most
    /// [`MAX_EXTENT_BLOCKS`] (from the operation's data reservation when it holds one): all
    /// of them, or none and NoSpace. Allocating is not a change of the filesystem: blocks
    /// not used are given back ([`Filesystem::give_back`]).
    fn alloc_data_runs(&mut self, shard: u32, count: u64) -> Result<Vec<(u64, u64)>> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut allocated = 0u64;
        while allocated < count {
            let want = (count - allocated).min(MAX_EXTENT_BLOCKS as u64);
            match self.with_tree(shard, true, |_, io| {
                io.space.alloc_data(want, io.commit_floor)
            }) {
                Ok((disk, got)) => {
                    runs.push((disk, got));
                    allocated += got;
                }
                Err(e) => {
                    self.give_back(shard, &runs)?;
                    return Err(e);
                }
            }
        }
        Ok(runs)
    }

    /// Metadata blocks changing the extents of `ino` that overlap file blocks `first..end`
    /// may allocate: each extent cut at most twice (its left piece rewritten, its right
    /// piece inserted) when there are a few, else every leaf holding them copied.
    fn punch_needs_blocks(
        &mut self,
        ino: u64,
        overlapping: u64,
        first: u64,
        end: u64,
    ) -> Result<u64> {
        let shard = self.shard_of(ino);
        let per_extent = 2 * overlapping * self.tree_op_blocks(shard);
        if overlapping <= 4 {
            return Ok(per_extent);
        }
        let leaves = self.item_range_blocks(shard, extent_key(ino, first), extent_key(ino, end))?;
        Ok(per_extent.min(leaves + 2 * self.tree_op_blocks(shard)))
    }

    /// Frees data blocks allocated by a write that fails before using them.
    fn give_back(&mut self, shard: u32, runs: &[(u64, u64)]) -> Result<()> {
        self.with_tree(shard, true, |_, io| {
            for &(disk, got) in runs {
                io.space.free(disk, got, None);
            }
            Ok(())
        })
    }

    /// Reads up to `len` bytes at `offset`; short at end of file, and at most
    /// [`MAX_RW_BYTES`]. A position past `i64::MAX` (or `offset + len` past it) is EINVAL
    /// ([`rw_len`]).
    pub fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.read_many(&[(ino, offset, len)])
            .pop()
            .expect("one result per request")
    }

    /// The lookups of a read of `len` bytes at `offset` of file `ino`: its inode and the
    /// extents it covers, changing nothing, so it can run deferred
    /// ([`Filesystem::without_waiting`]) and be repeated.
    pub(crate) fn map_read(&mut self, ino: u64, offset: u64, len: usize) -> Result<ReadMap> {
        // Bounded before anything is sized by it: `end` below cannot overflow, and the
        // buffer is at most MAX_RW_BYTES (and the file's size) long.
        let len = rw_len(offset, len)?;
        let item = self.file_inode(ino)?;
        // An empty read is no access (as on Linux).
        let moves_atime = len > 0
            && self.options.atime != crate::inode::Atime::Never
            && self.options.atime.moves(&item, Timespec::now());
        if offset >= item.size || len == 0 {
            return Ok(ReadMap {
                ino,
                offset,
                end: offset,
                extents: Vec::new(),
                moves_atime,
            });
        }
        let end = (offset + len as u64).min(item.size);
        let extents = self.extents_for_read(ino, offset / BLOCK, end.div_ceil(BLOCK))?;
        Ok(ReadMap {
            ino,
            offset,
            end,
            extents,
            moves_atime,
        })
    }

    /// The second half of planning a read ([`crate::reads`]) for one request mapped by
    /// [`Filesystem::map_read`]: its output buffer with holes, preallocated ranges and
    /// in-memory blocks filled in, and the device reads it still needs pushed to `pieces`.
    pub(crate) fn plan_read(
        &mut self,
        request: usize,
        map: ReadMap,
        pieces: &mut Vec<ReadPiece>,
    ) -> Result<Vec<u8>> {
        let ReadMap {
            ino,
            offset,
            end,
            extents,
            ..
        } = map;
        if end == offset {
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; (end - offset) as usize];
        let first = offset / BLOCK;
        let last = end.div_ceil(BLOCK);
        for extent in extents {
            if extent.item.prealloc {
                continue;
            }
            let from = extent.file_block.max(first);
            let to = extent.end().min(last);
            let disk = extent.item.disk_block + (from - extent.file_block);
            let crcs = &extent.item.crcs[(from - extent.file_block) as usize..];
            let start_byte = (from * BLOCK).max(offset);
            let end_byte = (to * BLOCK).min(end);
            let src = (start_byte - from * BLOCK) as usize..(end_byte - from * BLOCK) as usize;
            let dst = (start_byte - offset) as usize..(end_byte - offset) as usize;
            if self.copy_cached(
                disk,
                &crcs[..(to - from) as usize],
                src.clone(),
                &mut out[dst.clone()],
            ) {
                continue;
            }
            let piece = ReadPiece {
                request,
                ino,
                disk,
                count: to - from,
                crcs: crcs[..(to - from) as usize].to_vec(),
                src,
                dst,
            };
            if self.fetch.deferring {
                // A run that must not wait notes the blocks it would read, changing nothing.
                self.fetch.missing_data.push(piece);
                continue;
            }
            // Staged blocks reach the device first, so the device read returns them.
            self.write_back(ino)?;
            pieces.push(piece);
        }
        Ok(out)
    }

    /// Removes the extents covering file blocks `first..end`, keeping the parts outside, and
    /// frees the covered disk blocks (pinned). Returns how many data blocks were freed.
    fn punch_blocks(&mut self, ino: u64, first: u64, end: u64) -> Result<u64> {
        let extents = self.extents_in(ino, first, end)?;
        self.punch_extents(ino, extents, first, end, None)
    }

    /// [`Filesystem::punch_blocks`] on extents already looked up. `replaced_at`: a file block
    /// whose extent item the caller is about to overwrite anyway, so it is not removed first.
    fn punch_extents(
        &mut self,
        ino: u64,
        extents: Vec<Extent>,
        first: u64,
        end: u64,
        replaced_at: Option<u64>,
    ) -> Result<u64> {
        let shard = self.shard_of(ino);
        let generation = self.commit.generation;
        let mut freed = 0;
        for extent in extents {
            let cut_from = extent.file_block.max(first);
            let cut_to = extent.end().min(end);
            if cut_from >= cut_to {
                continue;
            }
            let keep_left = cut_from - extent.file_block;
            let keep_right = extent.end() - cut_to;
            let item = &extent.item;
            let piece = |skip: u64, blocks: u64| ExtentItem {
                disk_block: item.disk_block + skip,
                blocks: blocks as u32,
                prealloc: item.prealloc,
                crcs: if item.prealloc {
                    Vec::new()
                } else {
                    item.crcs[skip as usize..(skip + blocks) as usize].to_vec()
                },
            };
            let left = (keep_left > 0).then(|| piece(0, keep_left));
            let right = (keep_right > 0).then(|| piece(cut_to - extent.file_block, keep_right));
            let freed_at = item.disk_block + keep_left;
            let freed_len = cut_to - cut_from;
            self.with_tree(shard, true, |tree, io| {
                match left {
                    // The left piece keeps the extent's key: replace the value in place.
                    Some(left) => {
                        tree.insert(io, extent_key(ino, extent.file_block), left.encode())?;
                    }
                    None if replaced_at == Some(extent.file_block) => {}
                    None => {
                        tree.remove(io, &extent_key(ino, extent.file_block))?;
                    }
                }
                if let Some(right) = right {
                    tree.insert(io, extent_key(ino, cut_to), right.encode())?;
                }
                // Blocks that overlapping extents, a tree node (freed by the copies above) or
                // the bitmap say are not this extent's are corruption, not a double free.
                io.space
                    .check_allocated(freed_at, freed_len)
                    .map_err(|why| EngineError::corrupt_inode("extent item", ino, why))?;
                io.space.free(freed_at, freed_len, Some(generation));
                Ok(())
            })?;
            freed += freed_len;
        }
        Ok(freed)
    }

    /// The extent that ends at file block `at`, grown by `next` (a new extent at `at`), when
    /// `next` continues it on disk and both fit one item; keyed by its own first block, so
    /// inserting it replaces the old item.
    fn grown_extent(
        &mut self,
        ino: u64,
        at: u64,
        next: &ExtentItem,
    ) -> Result<Option<(u64, ExtentItem)>> {
        if at == 0 || next.prealloc {
            return Ok(None);
        }
        // The block before `at` first, decoded alone: only when it sits right before
        // `next` on disk (an append, rarely an overwrite) is its whole item read, which
        // copies up to 1 KiB of checksums.
        let neighbour = self.extents_for_read(ino, at - 1, at)?;
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
    fn write_blocks(&mut self, ino: u64, first: u64, data: &[u8]) -> Result<i64> {
        assert_eq!(data.len() % BLOCK_BYTES, 0);
        let count = (data.len() / BLOCK_BYTES) as u64;
        let shard = self.shard_of(ino);
        let runs = self.alloc_data_runs(shard, count)?;
        let room = self
            .extents_in(ino, first, first + count)
            .and_then(|overlapping| {
                let punch =
                    self.punch_needs_blocks(ino, overlapping.len() as u64, first, first + count)?;
                let mut needs = Needs::default();
                needs.meta(
                    shard,
                    punch + (runs.len() as u64 + 1) * self.tree_op_blocks(shard),
                );
                self.reserve(&needs, MetaNeed::Grow)?;
                Ok(overlapping)
            });
        let overlapping = match room {
            Ok(overlapping) => overlapping,
            Err(e) => {
                // Nothing changed yet: give the blocks back.
                self.give_back(shard, &runs)?;
                return Err(e);
            }
        };
        let mut done = 0u64;
        let mut items = Vec::with_capacity(runs.len());
        // The write as a whole decides, not each allocation run it lands in.
        let streaming = data.len() >= crate::writeback::STREAM_WRITE_BYTES;
        for &(disk, got) in &runs {
            let bytes = &data[(done * BLOCK) as usize..((done + got) * BLOCK) as usize];
            let crcs = bytes.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect();
            self.stage_data(ino, disk, bytes, streaming)?;
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
            if let Some(grown) = self.grown_extent(ino, first_item.0, &first_item.1)? {
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

    /// Writes `data` at `offset` (any alignment). Returns bytes written. When space is short
    /// only because frees wait for a commit (an overwrite frees the old copy, pinned), a whole
    /// mount commits once and retries before reporting ENOSPC ([`Filesystem::run_op`]).
    /// Like write(2), a write longer than [`MAX_RW_BYTES`] writes that much and returns it;
    /// a position past `i64::MAX` is EINVAL ([`rw_len`]).
    pub fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<usize> {
        let data = &data[..rw_len(offset, data.len())?];
        self.run_op(|fs| fs.write_once(ino, offset, data))
    }

    /// Appends `data` at the end of the file, atomically: the end is read and written in
    /// one operation, so two appenders never write at the same place (O_APPEND). Returns
    /// the offset it wrote at and the bytes written.
    pub fn append(&mut self, ino: u64, data: &[u8]) -> Result<(u64, usize)> {
        let offset = self.file_inode(ino)?.size;
        let written = self.write(ino, offset, data)?;
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
            self.run_op(|fs| fs.write_once(ino, *offset, data))?;
        }
        Ok(())
    }

    fn write_once(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<usize> {
        let mut item = self.file_inode(ino)?;
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= MAX_FILE_BYTES)
            .ok_or_else(|| EngineError::TooBig("file offset".into()))?;
        let first = offset / BLOCK;
        let delta = if offset % BLOCK == 0 && end % BLOCK == 0 {
            // Whole blocks: written as they are, no staging copy.
            self.write_blocks(ino, first, data)?
        } else {
            self.write_partial(ino, offset, end, data, item.size)?
        };
        item.blocks = item.blocks.saturating_add_signed(delta);
        item.size = item.size.max(end);
        let now = Timespec::now();
        item.mtime = now;
        item.ctime = now;
        self.store_inode(ino, &item)?;
        Ok(data.len())
    }

    /// A write run by a thread the engine is lent to (a client while its reactor sleeps):
    /// only one that stages its bytes and reads nothing from the device. Its lookups (the
    /// inode, the extents it replaces) are in memory; every block it covers in part and that
    /// lies inside the file is in the block cache (an append to a log or a WAL, whose last
    /// block the previous append left there; [`Filesystem::edges_to_read`]); and staging keeps room below the write-back threshold, so no write-back
    /// starts (the device's queue is the owner's). `None`, untouched, otherwise: the owner
    /// runs it. What runs is [`Filesystem::write`], through [`Filesystem::change_lent`].
    pub fn write_lent(&mut self, ino: u64, offset: u64, data: &[u8]) -> Option<Result<usize>> {
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
        data: &[u8],
    ) -> Option<Result<usize>> {
        self.write_lent_edges(ino, offset, data, true)
    }

    fn write_lent_edges(
        &mut self,
        ino: u64,
        offset: u64,
        data: &[u8],
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
            fs.write(ino, offset, data)
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
        self.write_blocks(ino, first, &blocks)
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
        let runs = self.alloc_data_runs(shard, hole_blocks)?;
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

    /// Frees every extent of an inode being deleted.
    pub(crate) fn free_all_extents(&mut self, ino: u64) -> Result<()> {
        let item = self.load_inode(ino)?;
        if item.mode & S_IFMT == S_IFREG {
            self.punch_blocks(ino, 0, u64::MAX / BLOCK)?;
        }
        Ok(())
    }
}
