//! One shard's allocator over the groups it owns ([`Space`]): allocation (next-fit, data
//! and tree nodes apart), frees pinned to their generation, the reservation of an
//! operation's worst case, and the bitmap items a commit writes (see the invariants in
//! [`super`]).

use super::{Geometry, MetaNeed, Pool, GROUP_BLOCKS_MAX, RESERVE_BLOCKS_LOCAL};
use crate::error::{EngineError, Result};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One owned group: which blocks are allocated and which are busy (allocated or pinned).
#[derive(Debug, Clone)]
pub(super) struct Group {
    start: u64,
    len: u64,
    allocated: Vec<u64>,
    busy: Vec<u64>,
    allocated_count: u64,
    busy_count: u64,
    /// Its bitmap item is in a committed (or frozen) tree: giving it back removes the item.
    persisted: bool,
}

impl Group {
    fn new(start: u64, len: u64) -> Group {
        let words = len.div_ceil(64) as usize;
        Group {
            start,
            len,
            allocated: vec![0; words],
            busy: vec![0; words],
            allocated_count: 0,
            busy_count: 0,
            persisted: false,
        }
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

    fn has_room(&self) -> bool {
        self.busy_count < self.len
    }

    /// The first free index at or after `from` (bits past `len` are never free).
    fn first_free(&self, from: u64) -> Option<u64> {
        let mut index = from;
        while index < self.len {
            let word = self.busy[(index / 64) as usize] | ((1u64 << (index % 64)) - 1);
            if word != u64::MAX {
                let found = (index / 64) * 64 + (!word).trailing_zeros() as u64;
                return (found < self.len).then_some(found);
            }
            index = (index / 64 + 1) * 64;
        }
        None
    }

    /// A free run of up to `want` blocks, searching from `from` to the end and then from the
    /// start: (index, length).
    fn find_run(&self, from: u64, want: u64) -> Option<(u64, u64)> {
        let at = self
            .first_free(from.min(self.len))
            .or_else(|| self.first_free(0))?;
        let mut len = 1;
        while len < want && at + len < self.len && !Self::bit(&self.busy, at + len) {
            len += 1;
        }
        Some((at, len))
    }

    /// The bitmap item: one bit per block, 1 = allocated, `bytes` long (bits past `len`
    /// zero).
    fn encode(&self, bytes: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes);
        for word in &self.allocated {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.resize(bytes, 0);
        out
    }
}

/// What a commit writes of a shard's space ([`Space::take_dirty`]).
#[derive(Debug, Default)]
pub struct BitmapChanges {
    /// (group, item bytes) for every owned group changed or taken since the last commit.
    pub items: Vec<(u64, Vec<u8>)>,
    /// Groups given back: their items go.
    pub removed: Vec<u64>,
    /// Version ≤ 4 chunk items to delete (the upgrade).
    pub legacy_chunks: Vec<u64>,
}

impl BitmapChanges {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty() && self.removed.is_empty() && self.legacy_chunks.is_empty()
    }
}

/// Where a file's next data blocks would continue it on disk ([`Space::alloc_data_near`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataGoal {
    /// The block after the file's last one on disk.
    pub block: u64,
    /// The file is large and growing (a stream): when another file took `block`, it moves
    /// to fresh room rather than interleave with it.
    pub streaming: bool,
}

/// The room a stream that had to move is given to grow into before the next file's blocks
/// (1 MiB: the largest extent).
pub const STREAM_ROOM_BLOCKS: u64 = 256;

pub struct Space {
    pub(super) shard: u32,
    pool: Arc<Pool>,
    geo: Geometry,
    /// The groups this shard owns, by id.
    pub(super) groups: BTreeMap<u64, Group>,
    /// Owned groups with a block neither allocated nor pinned.
    room: BTreeSet<u64>,
    /// Blocks freed by each generation and not yet unpinned, oldest first.
    pinned: VecDeque<(u64, Vec<u64>)>,
    /// Groups given back by each generation's commit, reaching the pool when it unpins.
    pub(super) releasing: VecDeque<(u64, Vec<u64>)>,
    /// Owned groups whose bits changed since the last commit wrote their item (or taken since).
    dirty: BTreeSet<u64>,
    /// Given-back groups whose item the next commit deletes.
    removed: Vec<u64>,
    /// Bitmap items of an older format (version ≤ 4: one per 4096-block chunk of the shard's
    /// region), deleted by the next commit once the groups' items replace them.
    legacy_chunks: Vec<u64>,
    owned_blocks: u64,
    allocated_count: u64,
    busy_count: u64,
    /// Where the next data search starts (next-fit keeps a file's blocks together).
    hint: u64,
    /// Where the next tree node search starts: next-fit too, apart from data, so a commit's
    /// nodes lie side by side (its writes coalesce) and stay out of the groups files take.
    meta_hint: u64,
    pub(super) reserve_blocks: u64,
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
    /// Mount is reading the bitmap items: which groups are owned is not known yet
    /// ([`Space::owns`] answers for the data area).
    loading: bool,
}

impl std::fmt::Debug for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Space")
            .field("shard", &self.shard)
            .field("groups", &self.groups.len())
            .field("owned_blocks", &self.owned_blocks)
            .field("allocated", &self.allocated_count)
            .field("busy", &self.busy_count)
            .finish()
    }
}

impl Space {
    /// The allocator of shard `shard`, owning no group yet.
    pub fn new(shard: u32, pool: Arc<Pool>) -> Space {
        let geo = *pool.geometry();
        let reserve_blocks = RESERVE_BLOCKS_LOCAL;
        Space {
            shard,
            hint: geo.group_start(geo.home_group(shard)),
            meta_hint: geo.group_start(geo.home_group(shard)),
            pool,
            geo,
            groups: BTreeMap::new(),
            room: BTreeSet::new(),
            pinned: VecDeque::new(),
            releasing: VecDeque::new(),
            dirty: BTreeSet::new(),
            removed: Vec::new(),
            legacy_chunks: Vec::new(),
            owned_blocks: 0,
            allocated_count: 0,
            busy_count: 0,
            reserve_blocks,
            op_meta_blocks: 0,
            op_data_blocks: 0,
            op_active: false,
            overrun_blocks: 0,
            ballast_blocks: 0,
            loading: false,
        }
    }

    /// Mount reads the bitmap items with `true`: until `false`, [`Space::owns`] says whether
    /// a block is in the data area at all.
    pub(crate) fn set_loading(&mut self, on: bool) {
        self.loading = on;
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn shard(&self) -> u32 {
        self.shard
    }

    pub fn allocated_blocks(&self) -> u64 {
        self.allocated_count
    }

    /// Blocks of the groups this shard owns.
    pub fn owned_blocks(&self) -> u64 {
        self.owned_blocks
    }

    /// Groups this shard owns.
    pub fn owned_groups(&self) -> u64 {
        self.groups.len() as u64
    }

    /// Owned blocks neither in use, pinned, nor promised to the operation in progress.
    pub fn free_blocks(&self) -> u64 {
        self.owned_blocks
            .saturating_sub(self.busy_count + self.ballast_blocks)
            .saturating_sub(self.op_meta_blocks + self.op_data_blocks)
    }

    /// What the next commit may allocate for this shard's group bitmap items: every leaf
    /// holding them copied and split (the owned groups' items, and the deletions of those
    /// given back), and a spare leaf's worth for a group taken meanwhile.
    pub fn bitmap_floor_blocks(&self) -> u64 {
        let items = self.groups.len() as u64 + self.removed.len() as u64 + 1;
        let legacy = (self.legacy_chunks.len() as u64).div_ceil(7);
        2 * (items.div_ceil(self.geo.bitmap_items_per_leaf()) + legacy) + 2
    }

    /// Blocks a data allocation may take from the groups owned now, with `commit_floor`
    /// blocks kept for the next commit (the shard's part of statfs's "available").
    pub fn data_available(&self, commit_floor: u64) -> u64 {
        self.free_blocks()
            .saturating_sub(self.keep(MetaNeed::Data, commit_floor))
    }

    /// The reserve kept back from data allocations (beyond the commit floor).
    pub fn reserve_blocks(&self) -> u64 {
        self.reserve_blocks
    }

    /// Blocks an allocation of kind `need` must leave free in the owned groups.
    pub(super) fn keep(&self, need: MetaNeed, commit_floor: u64) -> u64 {
        let floor = commit_floor + self.bitmap_floor_blocks();
        match need {
            MetaNeed::Data => floor + self.reserve_blocks,
            MetaNeed::Grow => floor + self.reserve_blocks / 2,
            MetaNeed::Shrink => floor,
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

    /// Takes groups from the pool until `blocks` more are free beyond what `need` keeps,
    /// all or none: true when they are there. The groups taken are the running
    /// transaction's (their items go into its commit).
    fn grow_to(&mut self, blocks: u64, need: MetaNeed, commit_floor: u64) -> bool {
        let mut taken: Vec<u64> = Vec::new();
        while self.free_blocks() < self.keep(need, commit_floor) + blocks {
            let near = self.next_group_hint();
            match self.pool.take(self.shard, need, near) {
                Some(group) => {
                    self.adopt(group);
                    taken.push(group);
                }
                None => {
                    // Never used: straight back.
                    for group in taken {
                        self.disown_unused(group);
                    }
                    return false;
                }
            }
        }
        true
    }

    /// Where to look for the next group: after the one the allocator works in, so a file
    /// growing past a group continues in the next one.
    fn next_group_hint(&self) -> u64 {
        match self.geo.group_of(self.hint) {
            Some(g) if self.groups.contains_key(&g) => g + 1,
            Some(g) => g,
            None => self.geo.home_group(self.shard),
        }
    }

    /// Holds group `group`, just taken from the pool: empty, its item due at the next commit.
    fn adopt(&mut self, group: u64) {
        let g = Group::new(self.geo.group_start(group), self.geo.group_len(group));
        self.owned_blocks += g.len;
        self.groups.insert(group, g);
        self.room.insert(group);
        self.dirty.insert(group);
        self.pool.empty_owned.fetch_add(1, Ordering::Relaxed);
        // Allocation continues in the new group.
        self.hint = self.geo.group_start(group);
    }

    /// Gives back group `group`, taken by this call and never allocated in.
    fn disown_unused(&mut self, group: u64) {
        let g = self.groups.remove(&group).expect("just taken");
        assert!(g.busy_count == 0 && !g.persisted, "an unused group");
        self.owned_blocks -= g.len;
        self.room.remove(&group);
        self.dirty.remove(&group);
        self.pool.empty_owned.fetch_sub(1, Ordering::Relaxed);
        self.pool.put(group);
    }

    /// Reserves `meta_blocks` metadata and `data_blocks` data blocks for the operation about
    /// to run, keeping what an allocation of kind `need` must keep (`commit_floor` included),
    /// taking groups from the pool when the owned ones are short. All or nothing: false (and
    /// nothing reserved, no group kept) when they are not there. Reservations of one
    /// operation add up; [`Space::end_op`] returns what was not used.
    pub fn reserve_op(
        &mut self,
        meta_blocks: u64,
        data_blocks: u64,
        need: MetaNeed,
        commit_floor: u64,
    ) -> bool {
        // Data may not take the reserves, whatever else the operation does: the free blocks
        // must cover the data beyond what data keeps, and the whole change beyond what its
        // own kind keeps.
        let (need, blocks) = if data_blocks > 0 {
            let change = self.keep(need, commit_floor) + meta_blocks;
            (
                MetaNeed::Data,
                change.saturating_sub(self.keep(MetaNeed::Data, commit_floor)) + data_blocks,
            )
        } else {
            (need, meta_blocks)
        };
        if !self.grow_to(blocks, need, commit_floor) {
            return false;
        }
        self.op_meta_blocks += meta_blocks;
        self.op_data_blocks += data_blocks;
        self.op_active = true;
        true
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

    /// Allocates one metadata block: from the operation's reservation when it holds one,
    /// else from any free block, taking a group when none is (the caller checked
    /// [`Space::ensure_meta`] for its change; an operation past its reservation is counted
    /// as an overrun).
    pub fn alloc_meta(&mut self) -> Result<u64> {
        if self.op_meta_blocks > 0 {
            self.op_meta_blocks -= 1;
        } else {
            if self.op_active {
                self.overrun_blocks += 1;
                tracing::warn!(
                    shard = self.shard,
                    "an operation allocated more metadata than it reserved"
                );
            }
            if self.free_blocks() == 0 && !self.grow_to(1, MetaNeed::Commit, 0) {
                return Err(EngineError::NoSpace);
            }
        }
        Ok(self.take_run(1, true).0)
    }

    /// True when a change of kind `need` may allocate `blocks` metadata blocks with
    /// `commit_floor` blocks kept for the next commit, taking groups from the pool if the
    /// owned ones are short. Changes that grow the tree keep part of the reserves back;
    /// removals may dig deeper, so a full filesystem can always delete; the commit may use
    /// every block.
    pub fn ensure_meta(&mut self, blocks: u64, need: MetaNeed, commit_floor: u64) -> bool {
        self.grow_to(blocks, need, commit_floor)
    }

    /// Allocates up to `want` contiguous data blocks, at least one: from the operation's
    /// data reservation when it holds one, else keeping the floor and the reserves.
    pub fn alloc_data(&mut self, want: u64, commit_floor: u64) -> Result<(u64, u64)> {
        self.alloc_data_near(want, commit_floor, None)
    }

    /// [`Space::alloc_data`] for a file growing past its last block: where it goes is
    /// [`Space::take_data_run`]'s choice, from `goal` (where the allocation would continue
    /// the file on disk, and whether the file streams). How many blocks is decided as for
    /// any data, so space accounting is the same.
    pub fn alloc_data_near(
        &mut self,
        want: u64,
        commit_floor: u64,
        goal: Option<DataGoal>,
    ) -> Result<(u64, u64)> {
        let want = want.max(1);
        if self.op_data_blocks > 0 {
            let take = want.min(self.op_data_blocks);
            self.op_data_blocks -= take;
            let (start, got) = self.take_data_run(take, goal);
            // A shorter run leaves the rest of the reservation for the next call.
            self.op_data_blocks += take - got;
            return Ok((start, got));
        }
        if self.data_available(commit_floor) == 0 && !self.grow_to(1, MetaNeed::Data, commit_floor)
        {
            return Err(EngineError::NoSpace);
        }
        let available = self.data_available(commit_floor);
        Ok(self.take_data_run(want.min(available), goal))
    }

    /// Takes a free run of up to `want` data blocks for a file that continues at
    /// `goal.block`: there when that block is free (the file's blocks stay one extent), the
    /// shared next-fit hint left where it was, so other files do not land in this one's
    /// way; when another file took it and this one streams (`goal.streaming`), a
    /// [`STREAM_ROOM_BLOCKS`] jump past the hint, which then moves past the room left for the
    /// stream to grow into. Four `dd bs=64K` writers into one shard made 834-895 extents of
    /// each 64 MiB file (75 KiB each), the shared hint handing their allocations out in
    /// turn. Which free blocks are taken changes, never how many: space is accounted as
    /// for any allocation, and a full device finds its blocks wherever they are.
    fn take_data_run(&mut self, want: u64, goal: Option<DataGoal>) -> (u64, u64) {
        let Some(goal) = goal else {
            return self.take_run(want, false);
        };
        let shared = self.hint;
        // Whether another file's blocks are in the way: the goal is in a group this shard
        // owns, and busy. A goal past the end of the file's group, in a group the shard does
        // not own, is no one's: the file goes on in the next group with room.
        let taken = self.geo.group_of(goal.block).is_some_and(|g| {
            self.groups.get(&g).is_some_and(|group| {
                let index = goal.block - group.start;
                index < group.len && Group::bit(&group.busy, index)
            })
        });
        if !taken {
            self.hint = goal.block;
            let (start, got) = self.take_run(want, false);
            self.hint = shared;
            return (start, got);
        }
        if !goal.streaming {
            return self.take_run(want, false);
        }
        self.hint = shared.saturating_add(STREAM_ROOM_BLOCKS);
        let (start, got) = self.take_run(want, false);
        self.hint = start.saturating_add(STREAM_ROOM_BLOCKS).max(start + got);
        (start, got)
    }

    /// Takes a free run of up to `want` blocks in the owned groups, next-fit from a hint:
    /// data from the data hint (a file's blocks follow each other), tree nodes (`meta`) from
    /// their own, so a commit's nodes lie side by side and apart from files: the groups of a
    /// deleted file empty and go back to the pool. The caller has checked that `want`
    /// blocks are free (reservations and ballast only count blocks), so a free block exists.
    fn take_run(&mut self, want: u64, meta: bool) -> (u64, u64) {
        assert!(want >= 1);
        let hint = if meta { self.meta_hint } else { self.hint };
        let hint_group = self.geo.group_of(hint).unwrap_or(0);
        // The first group with room from the hint's on; a group with room always has a run
        // (its search wraps around to the blocks before the hint).
        let group = self
            .room
            .range(hint_group..)
            .next()
            .or_else(|| self.room.iter().next())
            .copied()
            .expect("free blocks were counted but no group has room");
        let g = &self.groups[&group];
        let from = if group == hint_group {
            hint.saturating_sub(g.start)
        } else {
            0
        };
        let (index, len) = g
            .find_run(from, want)
            .expect("a group with room has a free block");
        let start = g.start + index;
        self.mark_run(group, index, len);
        let mut total = len;
        if !meta {
            // A run reaching the end of its group goes on into the next group of the region
            // when this shard owns it too (groups a growing file took one after the other):
            // large files keep extents of up to the largest, whatever the group size.
            let (mut group, mut end) = (group, index + len);
            while total < want
                && end == self.groups[&group].len
                && (group + 1) % self.geo.groups_per_region != 0
            {
                let next = group + 1;
                let Some(n) = self.groups.get(&next) else {
                    break;
                };
                let mut more = 0;
                while more < want - total && more < n.len && !Group::bit(&n.busy, more) {
                    more += 1;
                }
                if more == 0 {
                    break;
                }
                self.mark_run(next, 0, more);
                total += more;
                (group, end) = (next, more);
            }
            self.hint = start + total;
        } else {
            self.meta_hint = start + total;
        }
        (start, total)
    }

    /// Marks blocks `index..index + len` of owned group `group` allocated (they are free).
    fn mark_run(&mut self, group: u64, index: u64, len: u64) {
        let g = self.groups.get_mut(&group).expect("owned");
        for i in index..index + len {
            assert!(
                !Group::bit(&g.allocated, i),
                "block {} double allocation",
                g.start + i
            );
            assert!(!Group::bit(&g.busy, i));
            Group::set(&mut g.allocated, i, true);
            Group::set(&mut g.busy, i, true);
        }
        if g.allocated_count == 0 {
            self.pool.empty_owned.fetch_sub(1, Ordering::Relaxed);
        }
        g.allocated_count += len;
        g.busy_count += len;
        if !g.has_room() {
            self.room.remove(&group);
        }
        self.allocated_count += len;
        self.busy_count += len;
        self.dirty.insert(group);
    }

    /// The group of `addr` if this shard owns it.
    fn owned_group(&self, addr: u64) -> Option<u64> {
        self.geo
            .group_of(addr)
            .filter(|g| self.groups.contains_key(g))
    }

    /// Allocates the specific free block `addr` (log replay: a logged extent references it).
    /// Its group must be owned here ([`Space::check_claimable`] takes it from the pool first
    /// when it is free).
    pub fn claim(&mut self, addr: u64) {
        let group = self
            .owned_group(addr)
            .expect("claiming a block of an owned group");
        let g = self.groups.get_mut(&group).expect("owned");
        let i = addr - g.start;
        assert!(!Group::bit(&g.busy, i), "claiming busy block {addr}");
        Group::set(&mut g.allocated, i, true);
        Group::set(&mut g.busy, i, true);
        if g.allocated_count == 0 {
            self.pool.empty_owned.fetch_sub(1, Ordering::Relaxed);
        }
        g.allocated_count += 1;
        g.busy_count += 1;
        if !g.has_room() {
            self.room.remove(&group);
        }
        self.allocated_count += 1;
        self.busy_count += 1;
        self.dirty.insert(group);
    }

    /// Frees `len` blocks at `addr`. With `pin_generation`, they stay busy until that
    /// generation is unpinned (a committed tree may reference them); without, they were
    /// allocated in the running transaction and never committed, and are free at once.
    pub fn free(&mut self, addr: u64, len: u64, pin_generation: Option<u64>) {
        let mut block = addr;
        while block < addr + len {
            let group = self
                .owned_group(block)
                .unwrap_or_else(|| panic!("block {block} double free (not in an owned group)"));
            let g = self.groups.get_mut(&group).expect("owned");
            let end = (addr + len).min(g.start + g.len);
            for i in block - g.start..end - g.start {
                assert!(
                    Group::bit(&g.allocated, i),
                    "block {} double free",
                    g.start + i
                );
                Group::set(&mut g.allocated, i, false);
                if pin_generation.is_none() {
                    Group::set(&mut g.busy, i, false);
                }
            }
            let count = end - block;
            g.allocated_count -= count;
            if g.allocated_count == 0 {
                self.pool.empty_owned.fetch_add(1, Ordering::Relaxed);
            }
            if pin_generation.is_none() {
                g.busy_count -= count;
                self.busy_count -= count;
                self.room.insert(group);
            }
            self.dirty.insert(group);
            block = end;
        }
        self.allocated_count -= len;
        if let Some(generation) = pin_generation {
            match self.pinned.back_mut() {
                Some((g, blocks)) if *g == generation => blocks.extend(addr..addr + len),
                Some((g, _)) => {
                    assert!(*g < generation, "pins must come in generation order");
                    self.pinned
                        .push_back((generation, (addr..addr + len).collect()));
                }
                None => self
                    .pinned
                    .push_back((generation, (addr..addr + len).collect())),
            }
        }
    }

    /// Releases the blocks pinned by `generation` (its superblock is durable), and gives the
    /// groups its commit released back to the pool. Generations are released in order;
    /// releasing one that pinned nothing is a no-op. Returns the blocks unpinned.
    pub fn unpin(&mut self, generation: u64) -> u64 {
        if let Some((g, _)) = self.pinned.front().filter(|(g, _)| *g < generation) {
            panic!("unpinning generation {generation} before {g}");
        }
        let mut unpinned = 0;
        if self.pinned.front().is_some_and(|(g, _)| *g == generation) {
            let (_, blocks) = self.pinned.pop_front().expect("checked");
            unpinned = blocks.len() as u64;
            for block in blocks {
                // A block of a group given back in this generation's commit goes with its
                // group (below).
                let Some(group) = self.owned_group(block) else {
                    continue;
                };
                let g = self.groups.get_mut(&group).expect("owned");
                let i = block - g.start;
                assert!(
                    !Group::bit(&g.allocated, i),
                    "unpinning block {block} that is allocated"
                );
                assert!(Group::bit(&g.busy, i));
                Group::set(&mut g.busy, i, false);
                g.busy_count -= 1;
                self.busy_count -= 1;
                self.room.insert(group);
            }
        }
        while let Some((g, _)) = self.releasing.front() {
            assert!(*g >= generation, "groups of generation {g} not given back");
            if *g != generation {
                break;
            }
            let (_, groups) = self.releasing.pop_front().expect("checked");
            for group in groups {
                self.pool.pending.fetch_sub(1, Ordering::Relaxed);
                self.pool.put(group);
            }
        }
        unpinned
    }

    /// The commit of `generation` gives back the owned groups with nothing allocated in
    /// them (their pinned blocks go with them once `generation` is unpinned), except those
    /// whose free blocks the commit itself needs (its bitmap items, and `headroom_blocks`
    /// beyond them). Runs before the commit writes the bitmap items, so none of those lands
    /// in a group leaving. Returns how many. (A shard whose use hovers at a group's edge takes
    /// and gives back that group commit after commit: 231 ns and one bitmap item each time,
    /// cheaper than keeping groups from the others.)
    pub fn release_empty_groups(&mut self, generation: u64, headroom_blocks: u64) -> usize {
        // A test that fixed every shard's free space (the pool's ballast) keeps it fixed:
        // giving groups back would shrink it under the test.
        if self.pool.lock().ballast {
            return 0;
        }
        let hint_group = self.geo.group_of(self.hint);
        let mut empty: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| g.allocated_count == 0)
            .map(|(&id, _)| id)
            .collect();
        // The commit writing the bitmap items allocates in the groups that stay: those
        // keep its room ([`Space::bitmap_floor_blocks`]; the rest of its floor was used
        // before the release), and `headroom_blocks` more, what each tree change checks is
        // free before it starts. Groups whose blocks are mostly pinned go first: they give
        // the least free room away.
        empty.sort_by_key(|id| {
            let g = &self.groups[id];
            g.len - g.busy_count
        });
        let mut released = Vec::with_capacity(empty.len());
        for group in empty {
            let g = &self.groups[&group];
            let room = g.len - g.busy_count;
            if self.free_blocks() < self.bitmap_floor_blocks() + headroom_blocks + room {
                break;
            }
            let g = self.groups.remove(&group).expect("owned");
            self.owned_blocks -= g.len;
            self.busy_count -= g.busy_count;
            self.room.remove(&group);
            self.dirty.remove(&group);
            if g.persisted {
                self.removed.push(group);
            }
            self.pool.empty_owned.fetch_sub(1, Ordering::Relaxed);
            self.pool.pending.fetch_add(1, Ordering::Relaxed);
            released.push(group);
        }
        let empty = released;
        if empty.is_empty() {
            return 0;
        }
        match self.releasing.back_mut() {
            Some((g, groups)) if *g == generation => groups.extend(&empty),
            _ => self.releasing.push_back((generation, empty.clone())),
        }
        let first = self
            .groups
            .values()
            .next()
            .map_or(self.geo.group_start(self.geo.home_group(self.shard)), |g| {
                g.start
            });
        if hint_group.is_some_and(|g| !self.groups.contains_key(&g)) {
            self.hint = first;
        }
        if self
            .geo
            .group_of(self.meta_hint)
            .is_some_and(|g| !self.groups.contains_key(&g))
        {
            self.meta_hint = first;
        }
        empty.len()
    }

    /// The bitmap items the commit must write, and those it must delete. Clears the lists;
    /// the written groups count as persisted from now on.
    pub fn take_dirty(&mut self) -> BitmapChanges {
        let bytes = self.geo.bitmap_bytes();
        let dirty = std::mem::take(&mut self.dirty);
        let mut items = Vec::with_capacity(dirty.len());
        for group in dirty {
            let g = self.groups.get_mut(&group).expect("dirty groups are owned");
            g.persisted = true;
            items.push((group, g.encode(bytes)));
        }
        BitmapChanges {
            items,
            removed: std::mem::take(&mut self.removed),
            legacy_chunks: std::mem::take(&mut self.legacy_chunks),
        }
    }

    /// True when group `group` was taken since the last commit wrote the owned items.
    pub fn is_new_group(&self, group: u64) -> bool {
        self.groups.get(&group).is_some_and(|g| !g.persisted)
    }

    /// Loads group `group`'s bitmap item read from disk at mount: the shard owns it.
    pub fn load_group(&mut self, group: u64, bytes: &[u8]) -> std::result::Result<(), String> {
        if group >= self.geo.group_count() {
            return Err(format!(
                "bitmap item of group {group}, past the device's groups"
            ));
        }
        if bytes.len() != self.geo.bitmap_bytes() {
            return Err(format!(
                "group {group}'s bitmap is {} bytes, not {}",
                bytes.len(),
                self.geo.bitmap_bytes()
            ));
        }
        let mut g = Group::new(self.geo.group_start(group), self.geo.group_len(group));
        for (i, word) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..word.len()].copy_from_slice(word);
            let word = u64::from_le_bytes(w);
            let first = i as u64 * 64;
            let valid = if first >= g.len {
                0
            } else if first + 64 > g.len {
                (1u64 << (g.len - first)) - 1
            } else {
                u64::MAX
            };
            if word & !valid != 0 {
                return Err(format!(
                    "group {group}'s bitmap marks blocks past the group"
                ));
            }
            if word != 0 {
                g.allocated[i] = word;
                g.busy[i] = word;
                g.allocated_count += word.count_ones() as u64;
            }
        }
        g.busy_count = g.allocated_count;
        g.persisted = true;
        self.pool.assign(group, self.shard)?;
        if g.allocated_count == 0 {
            self.pool.empty_owned.fetch_add(1, Ordering::Relaxed);
        }
        if g.has_room() {
            self.room.insert(group);
        }
        self.owned_blocks += g.len;
        self.allocated_count += g.allocated_count;
        self.busy_count += g.busy_count;
        self.groups.insert(group, g);
        Ok(())
    }

    /// Loads a version ≤ 4 bitmap chunk: chunk `chunk` of the shard's own region, 4096
    /// blocks, one bit each. The groups it covers (the geometry's group size divides 4096,
    /// and both start after the region's log area) are the shard's when a block of theirs
    /// is allocated, and free otherwise; the upgrade's commit writes their items and deletes
    /// the chunk's.
    pub fn load_legacy_chunk(
        &mut self,
        chunk: u64,
        bytes: &[u8],
    ) -> std::result::Result<(), String> {
        const CHUNK_BLOCKS: u64 = GROUP_BLOCKS_MAX;
        let per_chunk = CHUNK_BLOCKS / self.geo.group_blocks;
        if bytes.len() != (CHUNK_BLOCKS / 8) as usize
            || chunk * CHUNK_BLOCKS >= self.geo.region_data_blocks()
        {
            return Err(format!("bitmap chunk {chunk} marks blocks past the region"));
        }
        let first = self.geo.home_group(self.shard) + chunk * per_chunk;
        let group_bytes = self.geo.bitmap_bytes();
        for k in 0..per_chunk {
            let group = first + k;
            let part = &bytes[k as usize * group_bytes..(k as usize + 1) * group_bytes];
            let in_region = chunk * per_chunk + k < self.geo.groups_per_region;
            if !in_region {
                if part.iter().any(|&b| b != 0) {
                    return Err(format!("bitmap chunk {chunk} marks blocks past the region"));
                }
                continue;
            }
            if part.iter().all(|&b| b == 0) {
                continue;
            }
            self.load_group(group, part)?;
            self.groups.get_mut(&group).expect("loaded").persisted = false;
            self.dirty.insert(group);
        }
        self.legacy_chunks.push(chunk);
        Ok(())
    }

    /// True when `addr` is allocated (for checkers).
    pub fn is_allocated(&self, addr: u64) -> bool {
        self.owned_group(addr).is_some_and(|group| {
            let g = &self.groups[&group];
            Group::bit(&g.allocated, addr - g.start)
        })
    }

    /// True when blocks `addr..addr + len` are all in groups this shard owns (no overflow).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        if !self.geo.in_data_area(addr, len) {
            return false;
        }
        // One region: the groups of the run are consecutive.
        let (first, last) = (
            self.geo.group_of(addr).expect("in the data area"),
            self.geo.group_of(addr + len - 1).expect("in the data area"),
        );
        (first..=last).all(|g| self.groups.contains_key(&g))
    }

    /// True when block `addr` is in a group this shard owns.
    pub fn owns(&self, addr: u64) -> bool {
        if self.loading {
            return self.geo.group_of(addr).is_some();
        }
        self.owned_group(addr).is_some()
    }

    /// Why freeing `len` blocks at `addr` would be wrong, if it would: a block outside the
    /// shard's groups or not allocated. Whoever frees blocks that disk contents named (a
    /// node's old block, an extent's blocks) asks first, so a tree or extent that disagrees
    /// with the bitmap is reported as corruption instead of tripping the double-free assert.
    pub fn check_allocated(&self, addr: u64, len: u64) -> std::result::Result<(), String> {
        if !self.contains(addr, len) {
            return Err(format!(
                "blocks {addr}+{len} outside shard {}'s groups",
                self.shard
            ));
        }
        match (addr..addr + len).find(|&b| !self.is_allocated(b)) {
            Some(b) => Err(format!(
                "block {b} is in use but the space bitmap says free"
            )),
            None => Ok(()),
        }
    }

    /// Why [`Space::claim`] of `addr` would be wrong, if it would: outside the data area, in
    /// a group another shard owns, or busy. A free group is taken from the pool here (replay
    /// claims what a logged extent of this shard allocated in the running transaction).
    pub fn check_claimable(&mut self, addr: u64) -> std::result::Result<(), String> {
        let Some(group) = self.geo.group_of(addr) else {
            return Err(format!("block {addr} is outside the data area"));
        };
        if !self.groups.contains_key(&group) {
            if !self.pool.take_exact(self.shard, group) {
                return Err(format!(
                    "block {addr} is in group {group}, which shard {} owns",
                    self.pool
                        .owner_of(group)
                        .map_or("?".to_string(), |s| s.to_string())
                ));
            }
            self.adopt(group);
        }
        if self.is_busy(addr) {
            return Err(format!("block {addr} is already in use"));
        }
        Ok(())
    }

    fn is_busy(&self, addr: u64) -> bool {
        self.owned_group(addr).is_some_and(|group| {
            let g = &self.groups[&group];
            Group::bit(&g.busy, addr - g.start)
        })
    }

    /// Why the counts disagree with the groups, if they do (the checker).
    pub fn check_counts(&self) -> std::result::Result<(), String> {
        let allocated: u64 = self.groups.values().map(|g| g.allocated_count).sum();
        let busy: u64 = self.groups.values().map(|g| g.busy_count).sum();
        let owned: u64 = self.groups.values().map(|g| g.len).sum();
        for (id, g) in &self.groups {
            let a: u64 = g.allocated.iter().map(|w| w.count_ones() as u64).sum();
            let b: u64 = g.busy.iter().map(|w| w.count_ones() as u64).sum();
            if a != g.allocated_count || b != g.busy_count {
                return Err(format!(
                    "shard {} group {id}: counts {}/{} allocated/busy, bits {a}/{b}",
                    self.shard, g.allocated_count, g.busy_count
                ));
            }
            if g.has_room() != self.room.contains(id) {
                return Err(format!("shard {} group {id}: room list wrong", self.shard));
            }
        }
        if (allocated, busy, owned) != (self.allocated_count, self.busy_count, self.owned_blocks) {
            return Err(format!(
                "shard {}: counts {}/{}/{} allocated/busy/owned, groups {allocated}/{busy}/{owned}",
                self.shard, self.allocated_count, self.busy_count, self.owned_blocks
            ));
        }
        Ok(())
    }

    /// The groups this shard owns (for checkers and `dump`).
    pub fn groups(&self) -> impl Iterator<Item = u64> + '_ {
        self.groups.keys().copied()
    }
}
