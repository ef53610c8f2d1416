//! The block allocator of one shard: a bitmap over the shard's region, with frees pinned to
//! the generation that made them, and the accounting that keeps ENOSPC an answer to one call.
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
//! - **The commit always has room.** Every allocation outside a commit keeps back the shard's
//!   *commit floor* (what the next commit may allocate: its space bitmap and inode counter
//!   items, and the delayed directory-index items waiting for it; the caller computes it,
//!   [`crate::fs::Filesystem::commit_floor_blocks`]), so a commit never fails for want of space
//!   and ENOSPC never turns the filesystem read-only.
//! - **An operation is all or nothing.** Before an operation changes anything it reserves the
//!   worst case of every metadata block (and data block) it may allocate, in every shard it
//!   touches ([`Space::reserve_op`]); its allocations then draw on the reservation and cannot
//!   fail, so ENOSPC is returned before the first change or not at all. An allocation beyond
//!   the reservation (an estimate too low: a bug) still succeeds while any block is free, and
//!   is counted in [`Space::overrun_blocks`], which the tests require to stay 0.
//! - Beyond the floor, data allocations keep the whole reserve, changes that grow the trees
//!   keep half of it, and removals may use all of it: a full filesystem can always delete.
use crate::error::{EngineError, Result};
use std::collections::{BTreeSet, VecDeque};

/// Blocks covered by one on-disk bitmap item (512 bytes of bits).
pub const BLOCKS_PER_CHUNK: u64 = 4096;
pub const CHUNK_BYTES: usize = (BLOCKS_PER_CHUNK / 8) as usize;

/// The reserve of a shard is 2% of its region, at least this (or a quarter of a small
/// region): removals need room to copy nodes before they free anything, and the half of the
/// reserve that growing changes leave them must hold an unlink's worst case.
pub const RESERVE_BLOCKS_MIN: u64 = 128;

/// Why blocks are wanted; decides how much of the reserve may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaNeed {
    /// File data: keeps the commit floor and the whole reserve.
    Data,
    /// A change that grows the trees (a create, a write's extents): keeps the floor and half
    /// of the reserve, which only removals may use.
    Grow,
    /// A removal (it frees space once committed, but copies nodes on write first): keeps the
    /// commit floor only.
    Shrink,
    /// The commit itself and mount's replay: may use every free block.
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
    /// Blocks promised to the operation in progress: metadata, and data blocks.
    op_meta_blocks: u64,
    op_data_blocks: u64,
    /// An operation holds a reservation here ([`Space::reserve_op`] .. [`Space::end_op`]).
    op_active: bool,
    /// Metadata blocks allocated by operations beyond what they reserved (a bug: tests
    /// require 0).
    overrun_blocks: u64,
    /// Blocks counted as in use without being allocated: a test shrinks the free space with
    /// it to run an operation at every level of fullness ([`Space::set_ballast`]).
    ballast_blocks: u64,
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
            reserve_blocks: (region_blocks / 50)
                .clamp(RESERVE_BLOCKS_MIN.min(region_blocks / 4), 4096),
            op_meta_blocks: 0,
            op_data_blocks: 0,
            op_active: false,
            overrun_blocks: 0,
            ballast_blocks: 0,
        }
    }

    pub fn region(&self) -> (u64, u64) {
        (self.region_start, self.region_blocks)
    }
    pub fn allocated_blocks(&self) -> u64 {
        self.allocated_count
    }
    /// Blocks neither in use, pinned, nor promised to the operation in progress.
    pub fn free_blocks(&self) -> u64 {
        self.region_blocks
            .saturating_sub(self.busy_count + self.ballast_blocks)
            .saturating_sub(self.op_meta_blocks + self.op_data_blocks)
    }

    /// Blocks a data allocation may take, with `commit_floor` blocks kept for the next
    /// commit (statfs's "available").
    pub fn data_available(&self, commit_floor: u64) -> u64 {
        self.free_blocks()
            .saturating_sub(self.keep(MetaNeed::Data, commit_floor))
    }

    /// The reserve kept back from data allocations (beyond the commit floor).
    pub fn reserve_blocks(&self) -> u64 {
        self.reserve_blocks
    }

    /// Blocks an allocation of kind `need` must leave free.
    fn keep(&self, need: MetaNeed, commit_floor: u64) -> u64 {
        match need {
            MetaNeed::Data => commit_floor + self.reserve_blocks,
            MetaNeed::Grow => commit_floor + self.reserve_blocks / 2,
            MetaNeed::Shrink => commit_floor,
            MetaNeed::Commit => 0,
        }
    }

    /// Counts `blocks` as in use without allocating them (0 removes the ballast): a test
    /// hook to run an operation at every level of fullness.
    #[doc(hidden)]
    pub fn set_ballast(&mut self, blocks: u64) {
        self.ballast_blocks = blocks;
    }

    /// Metadata blocks operations allocated beyond their reservations (a bug when not 0).
    pub fn overrun_blocks(&self) -> u64 {
        self.overrun_blocks
    }

    /// Reserves `meta_blocks` metadata and `data_blocks` data blocks for the operation about
    /// to run, keeping what an allocation of kind `need` must keep (`commit_floor` included).
    /// All or nothing: false (and nothing reserved) when they are not there. Reservations of
    /// one operation add up; [`Space::end_op`] returns what was not used.
    pub fn reserve_op(
        &mut self,
        meta_blocks: u64,
        data_blocks: u64,
        need: MetaNeed,
        commit_floor: u64,
    ) -> bool {
        let data_keep = if data_blocks > 0 {
            self.keep(MetaNeed::Data, commit_floor)
        } else {
            0
        };
        let free = self.free_blocks();
        let fits = free >= self.keep(need, commit_floor) + meta_blocks + data_blocks
            && free >= data_keep + data_blocks;
        if fits {
            self.op_meta_blocks += meta_blocks;
            self.op_data_blocks += data_blocks;
            self.op_active = true;
        }
        fits
    }

    /// The operation is over: what it reserved and did not use is free again.
    pub fn end_op(&mut self) {
        self.op_meta_blocks = 0;
        self.op_data_blocks = 0;
        self.op_active = false;
    }

    /// True while an operation holds a reservation here.
    pub fn in_op(&self) -> bool {
        self.op_active
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

    /// Allocates one metadata block: from the operation's reservation when it holds one,
    /// else from any free block (the caller checked [`Space::can_alloc_meta`] for its change;
    /// an operation past its reservation is counted as an overrun).
    pub fn alloc_meta(&mut self) -> Result<u64> {
        if self.op_meta_blocks > 0 {
            self.op_meta_blocks -= 1;
        } else {
            if self.op_active {
                self.overrun_blocks += 1;
                tracing::warn!(
                    region = self.region_start,
                    "an operation allocated more metadata than it reserved"
                );
            }
            if self.free_blocks() == 0 {
                return Err(EngineError::NoSpace);
            }
        }
        Ok(self.take_run(1).0)
    }

    /// True when a change of kind `need` may allocate `blocks` metadata blocks with
    /// `commit_floor` blocks kept for the next commit. Changes that grow the tree keep part of
    /// the reserve back; removals may dig deeper, so a full filesystem can always delete; the
    /// commit may use every block.
    pub fn can_alloc_meta(&self, blocks: u64, need: MetaNeed, commit_floor: u64) -> bool {
        self.free_blocks() >= self.keep(need, commit_floor) + blocks
    }

    /// Allocates up to `want` contiguous data blocks, at least one: from the operation's
    /// data reservation when it holds one, else keeping the floor and the reserve.
    pub fn alloc_data(&mut self, want: u64, commit_floor: u64) -> Result<(u64, u64)> {
        let want = want.max(1);
        if self.op_data_blocks > 0 {
            let take = want.min(self.op_data_blocks);
            self.op_data_blocks -= take;
            let (start, got) = self.take_run(take);
            // A shorter run leaves the rest of the reservation for the next call.
            self.op_data_blocks += take - got;
            return Ok((start, got));
        }
        let available = self.data_available(commit_floor);
        if available == 0 {
            return Err(EngineError::NoSpace);
        }
        Ok(self.take_run(want.min(available)))
    }

    /// Takes the first free run of up to `want` blocks from the next-fit hint. The caller has
    /// checked that `want` blocks are free (reservations and ballast only count blocks), so
    /// a free bit exists.
    fn take_run(&mut self, want: u64) -> (u64, u64) {
        assert!(want >= 1);
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
                return (self.region_start + index, len);
            }
            index = (index + 1) % n;
        }
        unreachable!("free blocks were counted but no free bit found");
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
        while let Ok((_, len)) = space.alloc_data(64, 0) {
            data += len;
        }
        assert_eq!(data, 1000 - reserve);
        assert!(space.alloc_meta().is_ok(), "metadata may use the reserve");
        space.free(2, 10, None);
        // Ten blocks came back, but one of the reserve now holds metadata: data may take nine.
        assert_eq!(
            space.alloc_data(100, 0).unwrap().1,
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
    fn a_reservation_is_all_or_nothing_and_its_allocations_cannot_fail() {
        let mut space = Space::new(0, 1000);
        let reserve = space.reserve_blocks;
        let floor = 10;
        // Growing changes keep the floor and half of the reserve.
        let room = 1000 - floor - reserve / 2;
        assert!(!space.reserve_op(room + 1, 0, MetaNeed::Grow, floor));
        assert_eq!(
            space.free_blocks(),
            1000,
            "a refused reservation holds nothing"
        );
        assert!(space.reserve_op(room, 0, MetaNeed::Grow, floor));
        assert_eq!(space.free_blocks(), 1000 - room);
        // Nobody else may take reserved blocks, not even a removal.
        assert!(!space.can_alloc_meta(reserve / 2 + 1, MetaNeed::Shrink, floor));
        for _ in 0..room {
            space.alloc_meta().unwrap();
        }
        assert_eq!(space.overrun_blocks(), 0);
        space.alloc_meta().unwrap();
        assert_eq!(
            space.overrun_blocks(),
            1,
            "past the reservation is an overrun"
        );
        space.end_op();
        assert!(!space.in_op());
    }

    #[test]
    fn a_data_reservation_keeps_the_floor_and_the_reserve() {
        let mut space = Space::new(0, 1000);
        let reserve = space.reserve_blocks;
        let floor = 10;
        let room = 1000 - floor - reserve;
        assert!(!space.reserve_op(0, room + 1, MetaNeed::Grow, floor));
        assert!(space.reserve_op(0, room, MetaNeed::Grow, floor));
        let mut got = 0;
        while got < room {
            got += space.alloc_data(room - got, floor).unwrap().1;
        }
        space.end_op();
        assert_eq!(space.data_available(floor), 0);
        assert_eq!(space.alloc_data(1, floor), Err(EngineError::NoSpace));
        assert!(space.can_alloc_meta(reserve, MetaNeed::Shrink, floor));
    }

    #[test]
    fn ballast_shrinks_the_free_space_without_allocating() {
        let mut space = Space::new(0, 100);
        space.set_ballast(99);
        assert_eq!(space.free_blocks(), 1);
        space.alloc_meta().unwrap();
        assert_eq!(space.alloc_meta(), Err(EngineError::NoSpace));
        space.set_ballast(0);
        assert_eq!(space.allocated_blocks(), 1);
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
