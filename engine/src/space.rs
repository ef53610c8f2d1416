//! The block allocator of one shard: a bitmap over the shard's region, with frees pinned to
//! the generation that made them.
//!
//! # Invariants
//! - `allocated` is the truth the next commit persists: a bit is set iff the running
//!   transaction's trees or files reference the block. It is what the on-disk bitmap items say
//!   after the commit.
//! - `busy` = `allocated` ∪ pinned: a block freed in generation N stays busy until
//!   [`Space::unpin`] is called for N, which the commit does only after N's superblock is
//!   durable. So a freed block is never reused while a durable superblock may reference it.
//! - Pins are released strictly in generation order, one generation per call, so two
//!   generations never release the same block twice (btrfs once allocated the same space twice
//!   by unpinning overlapping ranges of two transactions at once).
//! - `reserve_blocks` blocks are kept back from data allocations, so a commit can always
//!   copy-on-write its metadata: ENOSPC reaches the caller before the device is too full to
//!   commit.

use crate::error::{EngineError, Result};
use std::collections::{BTreeSet, VecDeque};

/// Blocks covered by one on-disk bitmap item (512 bytes of bits).
pub const BLOCKS_PER_CHUNK: u64 = 4096;
pub const CHUNK_BYTES: usize = (BLOCKS_PER_CHUNK / 8) as usize;

/// Why metadata blocks are wanted; decides how much of the reserve may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaNeed {
    Grow,
    Shrink,
    Commit,
}

pub struct Space {
    region_start: u64,
    region_blocks: u64,
    allocated: Vec<u64>,
    busy: Vec<u64>,
    pinned: VecDeque<(u64, Vec<u64>)>,
    allocated_count: u64,
    busy_count: u64,
    /// Where the next search starts (next-fit keeps new blocks close together).
    hint: u64,
    /// Bitmap chunks whose `allocated` bits changed since the last commit persisted them.
    dirty_chunks: BTreeSet<u64>,
    reserve_blocks: u64,
}

impl Space {
    /// An empty region.
    pub fn new(region_start: u64, region_blocks: u64) -> Space {
        let words = region_blocks.div_ceil(64) as usize;
        Space {
            region_start,
            region_blocks,
            allocated: vec![0; words],
            busy: vec![0; words],
            pinned: VecDeque::new(),
            allocated_count: 0,
            busy_count: 0,
            hint: 0,
            dirty_chunks: BTreeSet::new(),
            reserve_blocks: (region_blocks / 50).clamp(64.min(region_blocks / 4), 4096),
        }
    }

    pub fn region(&self) -> (u64, u64) {
        (self.region_start, self.region_blocks)
    }
    pub fn allocated_blocks(&self) -> u64 {
        self.allocated_count
    }
    /// Blocks a data allocation may still take.
    pub fn free_blocks(&self) -> u64 {
        self.region_blocks - self.busy_count
    }
    pub fn pinned_generations(&self) -> usize {
        self.pinned.len()
    }

    /// Blocks freed and waiting for their generation to unpin.
    pub fn pinned_block_count(&self) -> u64 {
        self.busy_count - self.allocated_count
    }

    fn bit(map: &[u64], index: u64) -> bool {
        map[(index / 64) as usize] & (1 << (index % 64)) != 0
    }
    fn set(map: &mut [u64], index: u64, on: bool) {
        let word = &mut map[(index / 64) as usize];
        if on {
            *word |= 1 << (index % 64);
        } else {
            *word &= !(1 << (index % 64));
        }
    }

    fn index(&self, addr: u64) -> u64 {
        assert!(
            (self.region_start..self.region_start + self.region_blocks).contains(&addr),
            "block {addr} outside the region {}+{}",
            self.region_start,
            self.region_blocks
        );
        addr - self.region_start
    }

    /// Allocates one metadata block. Callers first check [`Space::can_alloc_meta`] for the
    /// whole change, so this only fails when that check was skipped.
    pub fn alloc_meta(&mut self) -> Result<u64> {
        self.alloc_run(1, 0).map(|(start, _)| start)
    }

    /// True when a change of kind `need` may allocate `blocks` metadata blocks. Changes that
    /// grow the tree keep half the reserve back; changes that free space (removals) may dig
    /// deeper, so a full filesystem can always delete; the commit may use all of it.
    pub fn can_alloc_meta(&self, blocks: u64, need: MetaNeed) -> bool {
        let keep = match need {
            MetaNeed::Grow => self.reserve_blocks / 2,
            MetaNeed::Shrink => self.reserve_blocks / 8,
            MetaNeed::Commit => 0,
        };
        self.free_blocks() >= keep + blocks
    }

    /// Allocates up to `want` contiguous data blocks, at least one; keeps the reserve.
    pub fn alloc_data(&mut self, want: u64) -> Result<(u64, u64)> {
        self.alloc_run(want.max(1), self.reserve_blocks)
    }

    fn alloc_run(&mut self, want: u64, keep: u64) -> Result<(u64, u64)> {
        if self.free_blocks() <= keep {
            return Err(EngineError::NoSpace);
        }
        let want = want.min(self.free_blocks() - keep);
        let n = self.region_blocks;
        let mut index = self.hint % n;
        for _ in 0..n {
            // Skip whole busy words quickly.
            if index % 64 == 0 && self.busy[(index / 64) as usize] == u64::MAX {
                index = (index + 64) % n;
                continue;
            }
            if !Self::bit(&self.busy, index) {
                let mut len = 1;
                while len < want && index + len < n && !Self::bit(&self.busy, index + len) {
                    len += 1;
                }
                for i in index..index + len {
                    self.mark(i, true);
                }
                self.hint = index + len;
                return Ok((self.region_start + index, len));
            }
            index = (index + 1) % n;
        }
        unreachable!("free_blocks() > 0 but no free bit found");
    }

    fn mark(&mut self, index: u64, on: bool) {
        assert_ne!(
            Self::bit(&self.allocated, index),
            on,
            "block {} double {}",
            self.region_start + index,
            if on { "allocation" } else { "free" }
        );
        Self::set(&mut self.allocated, index, on);
        self.dirty_chunks.insert(index / BLOCKS_PER_CHUNK);
        if on {
            assert!(!Self::bit(&self.busy, index));
            Self::set(&mut self.busy, index, true);
            self.allocated_count += 1;
            self.busy_count += 1;
        } else {
            self.allocated_count -= 1;
        }
    }

    /// Allocates the specific free block `addr` (log replay: a logged extent references it).
    pub fn claim(&mut self, addr: u64) {
        let index = self.index(addr);
        assert!(!Self::bit(&self.busy, index), "claiming busy block {addr}");
        self.mark(index, true);
    }

    /// Frees `len` blocks at `addr`. With `pin_generation`, they stay busy until that
    /// generation is unpinned (a committed tree may reference them); without, they were
    /// allocated in the running transaction and never committed, and are free at once.
    pub fn free(&mut self, addr: u64, len: u64, pin_generation: Option<u64>) {
        let start = self.index(addr);
        for i in start..start + len {
            self.mark(i, false);
        }
        match pin_generation {
            Some(generation) => match self.pinned.back_mut() {
                Some((g, blocks)) if *g == generation => blocks.extend(start..start + len),
                Some((g, _)) => {
                    assert!(*g < generation, "pins must come in generation order");
                    self.pinned
                        .push_back((generation, (start..start + len).collect()));
                }
                None => self
                    .pinned
                    .push_back((generation, (start..start + len).collect())),
            },
            None => {
                for i in start..start + len {
                    Self::set(&mut self.busy, i, false);
                }
                self.busy_count -= len;
            }
        }
    }

    /// Releases the blocks pinned by `generation` (its superblock is durable). Generations are
    /// released in order; releasing one that pinned nothing is a no-op.
    pub fn unpin(&mut self, generation: u64) -> u64 {
        if self.pinned.front().is_some_and(|(g, _)| *g < generation) {
            panic!(
                "unpinning generation {generation} before {}",
                self.pinned.front().expect("checked").0
            );
        }
        if self.pinned.front().is_none_or(|(g, _)| *g != generation) {
            return 0;
        }
        let (_, blocks) = self.pinned.pop_front().expect("checked");
        for &i in &blocks {
            assert!(
                !Self::bit(&self.allocated, i),
                "unpinning block {} that is allocated",
                self.region_start + i
            );
            assert!(Self::bit(&self.busy, i));
            Self::set(&mut self.busy, i, false);
        }
        self.busy_count -= blocks.len() as u64;
        blocks.len() as u64
    }

    /// Bitmap chunks to persist, and clears the list.
    pub fn take_dirty_chunks(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.dirty_chunks).into_iter().collect()
    }

    /// The on-disk form of chunk `chunk` (which blocks are allocated).
    pub fn chunk_bytes(&self, chunk: u64) -> Vec<u8> {
        let words_per_chunk = (BLOCKS_PER_CHUNK / 64) as usize;
        let first = chunk as usize * words_per_chunk;
        let mut out = Vec::with_capacity(CHUNK_BYTES);
        for w in first..first + words_per_chunk {
            out.extend_from_slice(&self.allocated.get(w).copied().unwrap_or(0).to_le_bytes());
        }
        out
    }

    /// Loads one chunk read from disk at mount.
    pub fn load_chunk(&mut self, chunk: u64, bytes: &[u8]) -> std::result::Result<(), String> {
        if bytes.len() != CHUNK_BYTES {
            return Err(format!("bitmap chunk {chunk} is {} bytes", bytes.len()));
        }
        let words_per_chunk = (BLOCKS_PER_CHUNK / 64) as usize;
        for (i, word) in bytes.chunks(8).enumerate() {
            let index = chunk as usize * words_per_chunk + i;
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            if index >= self.allocated.len() {
                if word != 0 {
                    return Err(format!("bitmap chunk {chunk} marks blocks past the region"));
                }
                continue;
            }
            let valid = if (index as u64 + 1) * 64 > self.region_blocks {
                (1u64 << (self.region_blocks % 64)) - 1
            } else {
                u64::MAX
            };
            if word & !valid != 0 {
                return Err(format!("bitmap chunk {chunk} marks blocks past the region"));
            }
            self.allocated_count +=
                word.count_ones() as u64 - self.allocated[index].count_ones() as u64;
            self.allocated[index] = word;
            self.busy[index] = word;
        }
        self.busy_count = self.allocated_count;
        Ok(())
    }

    /// True when `addr` is allocated (for checkers).
    pub fn is_allocated(&self, addr: u64) -> bool {
        Self::bit(&self.allocated, self.index(addr))
    }

    /// True when blocks `addr..addr + len` are all inside the region (no overflow).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.region_start
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.region_start + self.region_blocks)
    }

    /// Why freeing `len` blocks at `addr` would be wrong, if it would: a block outside the
    /// region or not allocated. Whoever frees blocks that disk contents named (a node's old
    /// block, an extent's blocks) asks first, so a tree or extent that disagrees with the
    /// bitmap is reported as corruption instead of tripping the double-free assert.
    pub fn check_allocated(&self, addr: u64, len: u64) -> std::result::Result<(), String> {
        if !self.contains(addr, len) {
            return Err(format!(
                "blocks {addr}+{len} outside the region {}+{}",
                self.region_start, self.region_blocks
            ));
        }
        match (addr..addr + len).find(|&b| !Self::bit(&self.allocated, b - self.region_start)) {
            Some(b) => Err(format!(
                "block {b} is in use but the space bitmap says free"
            )),
            None => Ok(()),
        }
    }

    /// Why [`Space::claim`] of `addr` would be wrong, if it would: outside the region, or busy.
    pub fn check_claimable(&self, addr: u64) -> std::result::Result<(), String> {
        if !self.contains(addr, 1) {
            return Err(format!(
                "block {addr} outside the region {}+{}",
                self.region_start, self.region_blocks
            ));
        }
        if Self::bit(&self.busy, addr - self.region_start) {
            return Err(format!("block {addr} is already in use"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_are_pinned_until_their_generation_unpins() {
        let mut space = Space::new(100, 64);
        let a = space.alloc_meta().unwrap();
        let b = space.alloc_meta().unwrap();
        assert_eq!((a, b), (100, 101));
        space.free(a, 1, Some(5));
        assert!(!space.is_allocated(a));
        // While pinned, the block is not handed out again.
        let mut got = Vec::new();
        while let Ok(block) = space.alloc_meta() {
            got.push(block);
        }
        assert!(!got.contains(&a), "a pinned block was reused");
        assert_eq!(space.unpin(4), 0, "nothing pinned by generation 4");
        assert_eq!(space.unpin(5), 1);
        assert_eq!(
            space.alloc_meta().unwrap(),
            a,
            "unpinned block is free again"
        );
    }

    #[test]
    fn data_keeps_the_metadata_reserve() {
        let mut space = Space::new(0, 1000);
        let reserve = space.reserve_blocks;
        let mut data = 0;
        while let Ok((_, len)) = space.alloc_data(64) {
            data += len;
        }
        assert_eq!(data, 1000 - reserve);
        assert!(space.alloc_meta().is_ok(), "metadata may use the reserve");
        space.free(2, 10, None);
        // Ten blocks came back, but one of the reserve now holds metadata: data may take nine.
        assert_eq!(
            space.alloc_data(100).unwrap().1,
            9,
            "freed unwritten blocks return at once"
        );
    }

    #[test]
    fn bitmap_chunks_round_trip() {
        let mut space = Space::new(10, 5000);
        for _ in 0..300 {
            space.alloc_meta().unwrap();
        }
        space.free(50, 20, None);
        let chunks = space.take_dirty_chunks();
        assert_eq!(chunks, vec![0]);
        let mut loaded = Space::new(10, 5000);
        for c in 0..2 {
            loaded.load_chunk(c, &space.chunk_bytes(c)).unwrap();
        }
        assert_eq!(loaded.allocated_blocks(), 280);
        assert!(loaded.is_allocated(10) && !loaded.is_allocated(55));
        let mut bad = space.chunk_bytes(1);
        bad[CHUNK_BYTES - 1] = 0x80;
        assert!(
            loaded.load_chunk(1, &bad).is_err(),
            "bits past the region are corruption"
        );
    }

    #[test]
    fn frees_and_claims_that_disk_contents_ask_for_are_checked_first() {
        let mut space = Space::new(100, 64);
        let a = space.alloc_meta().unwrap();
        assert!(space.check_allocated(a, 1).is_ok());
        assert!(space
            .check_allocated(a, 2)
            .unwrap_err()
            .contains("says free"));
        assert!(space
            .check_allocated(99, 1)
            .unwrap_err()
            .contains("outside"));
        assert!(space
            .check_allocated(u64::MAX, 2)
            .unwrap_err()
            .contains("outside"));
        assert!(!space.contains(160, 5) && space.contains(160, 4));
        space.free(a, 1, Some(3));
        // Freed once: a second free (a node reachable twice) is refused, not asserted.
        assert!(space.check_allocated(a, 1).is_err());
        // Pinned: busy, so replay may not claim it either.
        assert!(space.check_claimable(a).unwrap_err().contains("in use"));
        assert!(space.check_claimable(a + 1).is_ok());
        assert!(space.check_claimable(164).unwrap_err().contains("outside"));
    }

    #[test]
    #[should_panic(expected = "unpinning generation 6 before 5")]
    fn unpin_out_of_order_is_a_bug() {
        let mut space = Space::new(0, 100);
        let a = space.alloc_meta().unwrap();
        let b = space.alloc_meta().unwrap();
        space.free(a, 1, Some(5));
        space.free(b, 1, Some(6));
        space.unpin(6);
    }
}
