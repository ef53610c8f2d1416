//! File extents on the whole filesystem: mapping a range to its extents for reads and
//! writes, read-ahead planning, allocating data runs in the inode's shard, and punching and
//! freeing the blocks an overwrite, truncate or unlink gives back (freed pinned).
//!
//! Layering: the extent and read-plan types are [`super`]'s and never name [`Filesystem`];
//! [`super::write`] and [`super::resize`] build writes, truncate and fallocate on the methods
//! here. [`super`] states the invariants (extents never overlap, `blocks` counts them).

use super::{extent_key, rw_len, Extent, ReadMap, ReadPiece, BLOCK};
use crate::error::{EngineError, Result};
use crate::format::items::{ExtentItem, InodeItem, Timespec, MAX_EXTENT_BLOCKS};
use crate::format::{ItemKind, Key};
use crate::fs::Filesystem;
use crate::inode::{S_IFDIR, S_IFMT, S_IFREG};
use crate::reads::RunSource;

impl Filesystem {
    pub(super) fn file_inode(&mut self, ino: u64) -> Result<InodeItem> {
        let item = self.load_inode(ino)?;
        match item.mode & S_IFMT {
            S_IFREG => Ok(item),
            S_IFDIR => Err(EngineError::IsDir),
            _ => Err(EngineError::Invalid("not a regular file".into())),
        }
    }

    /// The data blocks of file `ino` between byte `from` and `to` that a read-ahead should
    /// fetch: extents' blocks neither in the block cache nor on their way from another
    /// read-ahead. Run deferred ([`Filesystem::without_waiting`]): read-ahead is a guess,
    /// never worth a wait. Staged blocks are left out: they are not on the device yet, and
    /// read-ahead writes nothing.
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
                    fs.block_cache.get(disk).is_none()
                        && fs.staged_block(ino, disk).is_none()
                        && fs.reads.ahead_covering(disk).is_none()
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
                    joins: None,
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
    pub(super) fn extents_in(&mut self, ino: u64, first: u64, end: u64) -> Result<Vec<Extent>> {
        self.extents_over(ino, first, end, false)
    }

    /// As [`Filesystem::extents_in`], each extent cut to the blocks of `first..end` (a
    /// sub-extent reads as the same blocks do) and decoded in its tree node: a 4 KiB read
    /// of a 256-block extent copied and decoded the whole item (1 KiB of checksums), most
    /// of a cached read's allocations.
    pub(super) fn extents_for_read(
        &mut self,
        ino: u64,
        first: u64,
        end: u64,
    ) -> Result<Vec<Extent>> {
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
    pub(super) fn alloc_data_runs(
        &mut self,
        shard: u32,
        count: u64,
        goal: Option<crate::space::DataGoal>,
    ) -> Result<Vec<(u64, u64)>> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut allocated = 0u64;
        // The first run goes where `goal` says; the next ones continue the run before.
        let mut goal = goal;
        while allocated < count {
            let want = (count - allocated).min(MAX_EXTENT_BLOCKS as u64);
            match self.with_tree(shard, true, |_, io| {
                io.space.alloc_data_near(want, io.commit_floor, goal)
            }) {
                Ok((disk, got)) => {
                    runs.push((disk, got));
                    allocated += got;
                    goal = goal.map(|g| crate::space::DataGoal {
                        block: disk + got,
                        ..g
                    });
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
    pub(super) fn punch_needs_blocks(
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
    pub(super) fn give_back(&mut self, shard: u32, runs: &[(u64, u64)]) -> Result<()> {
        self.with_tree(shard, true, |_, io| {
            for &(disk, got) in runs {
                io.space.free(disk, got, None);
            }
            Ok(())
        })
    }

    /// Reads up to `len` bytes at `offset`; short at end of file, and at most
    /// [`MAX_RW_BYTES`](super::MAX_RW_BYTES). A position past `i64::MAX` (or `offset + len` past it) is EINVAL
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
        let mut out = vec![0u8; map.len()];
        self.plan_read_into(request, map, pieces, &mut out, true)?;
        Ok(out)
    }

    /// [`Filesystem::plan_read`] into `out` (exactly [`ReadMap::len`] bytes), the caller's
    /// buffer: a read from memory in the caller's thread copies each byte once, into it.
    /// `zeroed`: `out` holds zeroes already, so holes and preallocated ranges are left as
    /// they are; otherwise they are zeroed here (and nothing else is written twice).
    pub(crate) fn plan_read_into(
        &mut self,
        request: usize,
        map: ReadMap,
        pieces: &mut Vec<ReadPiece>,
        out: &mut [u8],
        zeroed: bool,
    ) -> Result<()> {
        assert_eq!(
            out.len(),
            map.len(),
            "a read's output is as long as its map"
        );
        let ReadMap {
            ino,
            offset,
            end,
            extents,
            ..
        } = map;
        if end == offset {
            return Ok(());
        }
        let first = offset / BLOCK;
        let last = end.div_ceil(BLOCK);
        // Bytes before this (relative to `offset`) are written or zeroed.
        let mut filled = 0usize;
        let zero = |out: &mut [u8], to: usize, filled: &mut usize| {
            if to > *filled {
                if !zeroed {
                    out[*filled..to].fill(0);
                }
                *filled = to;
            }
        };
        for extent in extents {
            // Extents come in file order and do not overlap: what lies between the last one
            // and this one is a hole.
            let from_byte = ((extent.file_block * BLOCK).max(offset) - offset) as usize;
            let to_byte = ((extent.end() * BLOCK).min(end) - offset) as usize;
            zero(out, from_byte, &mut filled);
            if extent.item.prealloc {
                zero(out, to_byte, &mut filled);
                continue;
            }
            filled = filled.max(to_byte);
            // The extent's blocks the read covers go in runs: blocks the cache holds are
            // copied now, blocks a read-ahead is fetching are taken from its device read
            // when it completes, and the rest are read. (All-or-nothing per extent made a
            // 1 MiB read whose first quarter was read ahead read the whole MiB again.)
            let from = extent.file_block.max(first);
            let to = extent.end().min(last);
            let mut at = from;
            while at < to {
                let skip = (at - extent.file_block) as usize;
                let disk = extent.item.disk_block + skip as u64;
                let crcs = &extent.item.crcs[skip..(to - extent.file_block) as usize];
                let (run, source) = self.read_run(disk, crcs);
                let run_end = at + run;
                let start_byte = (at * BLOCK).max(offset);
                let end_byte = (run_end * BLOCK).min(end);
                let src = (start_byte - at * BLOCK) as usize..(end_byte - at * BLOCK) as usize;
                let dst = (start_byte - offset) as usize..(end_byte - offset) as usize;
                at = run_end;
                let joins = match source {
                    RunSource::Ahead(first) => Some(first),
                    RunSource::Device => None,
                    RunSource::Cache => {
                        let copied =
                            self.copy_cached(disk, &crcs[..run as usize], src, &mut out[dst]);
                        assert!(copied, "a cached run is copied");
                        continue;
                    }
                };
                let piece = ReadPiece {
                    request,
                    ino,
                    disk,
                    count: run,
                    crcs: crcs[..run as usize].to_vec(),
                    src,
                    dst,
                    joins,
                };
                if self.fetch.deferring {
                    // A run that must not wait notes the blocks it would read, changing
                    // nothing (a read-ahead's blocks on their way are not in memory yet).
                    self.fetch.missing_data.push(piece);
                    continue;
                }
                if joins.is_none() {
                    // Staged blocks reach the device first, so the device read returns them.
                    self.write_back(ino)?;
                }
                pieces.push(piece);
            }
        }
        zero(out, out.len(), &mut filled);
        Ok(())
    }

    /// Removes the extents covering file blocks `first..end`, keeping the parts outside, and
    /// frees the covered disk blocks (pinned). Returns how many data blocks were freed.
    pub(super) fn punch_blocks(&mut self, ino: u64, first: u64, end: u64) -> Result<u64> {
        let extents = self.extents_in(ino, first, end)?;
        self.punch_extents(ino, extents, first, end, None)
    }

    /// [`Filesystem::punch_blocks`] on extents already looked up. `replaced_at`: a file block
    /// whose extent item the caller is about to overwrite anyway, so it is not removed first.
    pub(super) fn punch_extents(
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

    /// Frees every extent of an inode being deleted.
    pub(crate) fn free_all_extents(&mut self, ino: u64) -> Result<()> {
        let item = self.load_inode(ino)?;
        if item.mode & S_IFMT == S_IFREG {
            self.punch_blocks(ino, 0, u64::MAX / BLOCK)?;
        }
        Ok(())
    }
}
