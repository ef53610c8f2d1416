//! Space: one pool of block groups that every shard draws from ([`Pool`]), and the allocator
//! of one shard over the groups it owns ([`Space`]), with frees pinned to the generation that
//! made them and the accounting that keeps ENOSPC an answer to one call.
//!
//! The device's data area (every shard region after its fsync log area,
//! [`crate::format::Superblock`]) is cut into *block groups* of [`Geometry::group_blocks`]
//! (the last group of a region may be shorter). A group is free (in the pool) or owned by one
//! shard, which alone allocates in it: shards keep their own allocators and no lock is taken
//! per allocation; a shard takes a group from the pool when it runs short and gives back the
//! groups it emptied. A file's data and a directory's tree may therefore use every group of
//! the device.
//!
//! # Invariants
//! - **One owner.** A group is owned by exactly one shard, or by none. Ownership is what the
//!   shards' committed trees say: shard `s` owns group `g` iff its tree holds the group's
//!   bitmap item `(1, GroupBitmap, g)`; one superblock commits every shard's tree together,
//!   so a power cut leaves every group with one owner or none (mount checks it). The pool's
//!   owner table mirrors it in memory.
//! - **Taking is part of the running transaction**: a shard that takes group `g` in
//!   generation N marks its bitmap item dirty, and N's commit writes it. Before N is
//!   durable, replay of N's fsync records may find extents in `g`; it takes `g` for the
//!   extent's shard then, because a group the durable state holds free can only have been
//!   taken by that shard (below).
//! - **Giving back waits for durability, like a freed block.** A shard releases a group only
//!   in a commit (generation N), and only when nothing in it is allocated; the group reaches
//!   the pool when N is unpinned ([`Space::unpin`]), i.e. once N's superblock is durable. So
//!   no other shard allocates in a group before every durable tree that could reference it
//!   (N−1 and earlier) is superseded, and the fsync records of N (which may name blocks in
//!   it) are stale. A group taken and never used by a refused reservation goes back at once.
//! - `allocated` is the truth the next commit persists: a bit is set iff the running
//!   transaction's trees or files reference the block. `busy` = `allocated` ∪ pinned: a block
//!   freed in generation N stays busy until N is unpinned, which the commit does only after
//!   N's superblock is durable.
//! - Pins are released strictly in generation order, one generation per call, so two
//!   generations never release the same block twice (btrfs once allocated the same space
//!   twice by unpinning overlapping ranges of two transactions at once).
//! - **The commit always has room.** Every allocation outside a commit keeps back the shard's
//!   *commit floor* (what the next commit may allocate: its group bitmap items, computed here,
//!   and its inode counter and delayed directory-index items, which the caller adds:
//!   [`crate::fs::Filesystem::commit_floor_blocks`]), inside the groups the shard owns, so a
//!   commit never fails for want of space and ENOSPC never turns the filesystem read-only.
//! - **An operation is all or nothing.** Before an operation changes anything it reserves the
//!   worst case of every metadata block (and data block) it may allocate, in every shard it
//!   touches ([`Space::reserve_op`]), taking groups from the pool as needed; its allocations
//!   then draw on the reservation and cannot fail, so ENOSPC is returned before the first
//!   change or not at all. An allocation beyond the reservation (an estimate too low: a bug)
//!   still succeeds while any block is free, and is counted in [`Space::overrun_blocks`],
//!   which the tests require to stay 0.
//! - **Reserves.** The pool keeps [`Pool::reserve_blocks`] back: data and changes that grow
//!   the trees may not take a group from it, removals and the commit may.
//!   Each shard keeps a small reserve of its own ([`Space::reserve_blocks`]) from data, half
//!   of it from growing changes: a full filesystem can always delete.

use crate::error::{EngineError, Result};
use crate::format::Superblock;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The largest group: its bitmap item is 512 bytes (seven fit a leaf). Filesystems of
/// version 4 and older are read with groups of this size, which are exactly their bitmap
/// chunks.
pub const GROUP_BLOCKS_MAX: u64 = 4096;
/// The smallest group mkfs accepts: one byte of bitmap (tests use it to make every workload
/// move groups).
pub const GROUP_BLOCKS_MIN: u64 = 8;
/// Groups mkfs aims for per shard, at least: with fewer, the groups shards keep partly used
/// strand more of the device (64 shards holding a 16 MiB group each is a whole 1 GiB image).
pub const GROUPS_PER_SHARD_TARGET: u64 = 32;

/// The smallest group mkfs picks by itself (64 KiB, on devices of a few MiB per shard);
/// smaller only when asked.
pub const GROUP_BLOCKS_AUTO_MIN: u64 = 16;

/// A shard's own reserve: data keeps it, growing changes keep half of it, removals may use
/// it: the first steps of a removal in a shard whose groups are full, before it takes a
/// group from the pool's reserve. Small, since every shard holding anything keeps it (and
/// its commit floor) out of what statfs can promise.
pub const RESERVE_BLOCKS_LOCAL: u64 = 8;

/// The pool's reserve: 2% of the data area, at most 256 MiB, at least four groups (but no
/// more than a quarter of a tiny device).
pub const RESERVE_BLOCKS_POOL_MAX: u64 = 65_536;

/// Why blocks are wanted; decides how much of the reserves may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaNeed {
    /// File data: keeps the commit floor and the whole reserves.
    Data,
    /// A change that grows the trees (a create, a write's extents): keeps the floor and half
    /// of the reserves, which only removals may use.
    Grow,
    /// A removal (it frees space once committed, but copies nodes on write first): keeps the
    /// commit floor only.
    Shrink,
    /// The commit itself and mount's replay: may use every free block.
    Commit,
}

/// Where the groups are on the device: derived from the superblock, the same in every shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub shards: u32,
    pub region_blocks: u64,
    pub log_blocks: u64,
    pub group_blocks: u64,
    pub groups_per_region: u64,
}

impl Geometry {
    pub fn of(sb: &Superblock) -> Geometry {
        let data = sb.region_blocks - sb.log_blocks;
        Geometry {
            shards: sb.shards.len() as u32,
            region_blocks: sb.region_blocks,
            log_blocks: sb.log_blocks,
            group_blocks: sb.group_blocks,
            groups_per_region: data.div_ceil(sb.group_blocks),
        }
    }

    /// Groups on the device.
    pub fn group_count(&self) -> u64 {
        self.shards as u64 * self.groups_per_region
    }

    /// Blocks of each region the groups cover (after its log area).
    pub fn region_data_blocks(&self) -> u64 {
        self.region_blocks - self.log_blocks
    }

    /// Blocks all the groups cover.
    pub fn data_blocks(&self) -> u64 {
        self.shards as u64 * self.region_data_blocks()
    }

    /// The first block of group `group`.
    pub fn group_start(&self, group: u64) -> u64 {
        let (region, index) = (
            group / self.groups_per_region,
            group % self.groups_per_region,
        );
        crate::format::FIRST_REGION_BLOCK
            + region * self.region_blocks
            + self.log_blocks
            + index * self.group_blocks
    }

    /// Blocks in group `group` (the last of a region may be short).
    pub fn group_len(&self, group: u64) -> u64 {
        let index = group % self.groups_per_region;
        self.group_blocks
            .min(self.region_data_blocks() - index * self.group_blocks)
    }

    /// The group holding `block`, if it is in the data area (not a superblock, a log area or
    /// past the last region).
    pub fn group_of(&self, block: u64) -> Option<u64> {
        let off = block.checked_sub(crate::format::FIRST_REGION_BLOCK)?;
        let region = off / self.region_blocks;
        if region >= self.shards as u64 {
            return None;
        }
        let in_region = (off % self.region_blocks).checked_sub(self.log_blocks)?;
        Some(region * self.groups_per_region + in_region / self.group_blocks)
    }

    /// True when blocks `addr..addr + len` are all in the data area (no overflow).
    pub fn in_data_area(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr.checked_add(len).is_some()
            && self.group_of(addr).is_some()
            && self.group_of(addr + len - 1).is_some()
            && {
                // No log area in between: the run lies inside one region.
                let first = (addr - crate::format::FIRST_REGION_BLOCK) / self.region_blocks;
                let last =
                    (addr + len - 1 - crate::format::FIRST_REGION_BLOCK) / self.region_blocks;
                first == last
            }
    }

    /// The first group of shard `shard`'s region: where a shard that owns nothing looks first,
    /// so shards start spread over the device.
    pub fn home_group(&self, shard: u32) -> u64 {
        shard as u64 * self.groups_per_region
    }

    /// Bytes of a group's bitmap item.
    pub fn bitmap_bytes(&self) -> usize {
        (self.group_blocks / 8) as usize
    }

    /// Bitmap items one leaf holds.
    pub fn bitmap_items_per_leaf(&self) -> u64 {
        (crate::format::node::LEAF_SPACE_BYTES
            / (crate::format::node::LEAF_ITEM_HEADER_BYTES + self.bitmap_bytes()))
        .max(1) as u64
    }

    /// The group size mkfs picks for a device with `data_blocks` blocks in its groups and
    /// `shards` shards: the largest power of two from [`GROUP_BLOCKS_AUTO_MIN`] to
    /// [`GROUP_BLOCKS_MAX`] that leaves [`GROUPS_PER_SHARD_TARGET`] groups per shard.
    pub fn auto_group_blocks(data_blocks: u64, shards: u32) -> u64 {
        let per = data_blocks / (GROUPS_PER_SHARD_TARGET * shards as u64).max(1);
        let pow = if per == 0 {
            1
        } else {
            1u64 << (63 - per.leading_zeros())
        };
        pow.clamp(GROUP_BLOCKS_AUTO_MIN, GROUP_BLOCKS_MAX)
    }
}

/// What no shard owns: free groups, the reserve, and the owner of every group.
pub struct Pool {
    geo: Geometry,
    reserve_blocks: u64,
    inner: Mutex<PoolInner>,
    /// Groups owned with nothing allocated in them: the next commit of their shard gives
    /// them back ([`Pool::reclaimable`]).
    empty_owned: AtomicU64,
    /// Groups given back by a commit that is not yet durable: they reach the pool then.
    pending: AtomicU64,
    /// Hand-overs so far (statistics).
    taken: AtomicU64,
    returned: AtomicU64,
}

/// The owner table's mark for a free group.
const FREE: u8 = u8::MAX;

struct PoolInner {
    /// The owning shard of every group, or [`FREE`].
    owner: Vec<u8>,
    free: BTreeSet<u64>,
    free_blocks: u64,
    /// A test hook: no group is handed out ([`Pool::set_ballast`]).
    ballast: bool,
}

/// Pool figures, for statfs and the statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub groups: u64,
    pub group_blocks: u64,
    pub free_groups: u64,
    pub free_blocks: u64,
    pub reserve_blocks: u64,
    /// Groups emptied or given back that a commit makes free.
    pub reclaimable_groups: u64,
    /// Groups taken by shards and returned to the pool so far (since mount).
    pub taken: u64,
    pub returned: u64,
}

impl Pool {
    /// A pool where every group is free (mount then assigns the owned ones,
    /// [`Pool::assign`]).
    pub fn new(geo: Geometry) -> Pool {
        let count = geo.group_count();
        // At least four groups: a removal in a full shard takes whole groups, in up to two
        // shards, and its reservation (a worst case) may want more than one group in each.
        let reserve_blocks = (geo.data_blocks() / 50)
            .min(RESERVE_BLOCKS_POOL_MAX)
            .max(4 * geo.group_blocks)
            .min(geo.data_blocks() / 4);
        Pool {
            geo,
            reserve_blocks,
            inner: Mutex::new(PoolInner {
                owner: vec![FREE; count as usize],
                free: (0..count).collect(),
                free_blocks: geo.data_blocks(),
                ballast: false,
            }),
            empty_owned: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            returned: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        // A panic while holding the lock (a bug) poisons it; the table itself is only changed
        // in steps that cannot unwind halfway, so the data stays usable by whoever reports
        // the failure.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    /// Blocks the pool keeps back from data and, half of them, from growing changes.
    pub fn reserve_blocks(&self) -> u64 {
        self.reserve_blocks
    }

    /// Mount: group `group` is owned by `shard` (its tree holds the bitmap item). Fails when
    /// another shard owns it too.
    pub fn assign(&self, group: u64, shard: u32) -> std::result::Result<(), String> {
        let mut p = self.lock();
        let Some(owner) = p.owner.get(group as usize).copied() else {
            return Err(format!("group {group} is past the device's groups"));
        };
        if owner != FREE {
            return Err(format!(
                "group {group} is owned by shard {owner} and by shard {shard}"
            ));
        }
        p.owner[group as usize] = shard as u8;
        p.free.remove(&group);
        p.free_blocks -= self.geo.group_len(group);
        Ok(())
    }

    /// The shard owning `group`, or None when it is free (or not a group).
    pub fn owner_of(&self, group: u64) -> Option<u32> {
        let p = self.lock();
        match p.owner.get(group as usize) {
            Some(&o) if o != FREE => Some(o as u32),
            _ => None,
        }
    }

    /// Blocks a new file could get from the pool: its free groups less the reserve.
    pub fn available_blocks(&self) -> u64 {
        self.lock().free_blocks.saturating_sub(self.reserve_blocks)
    }

    pub fn stats(&self) -> PoolStats {
        let p = self.lock();
        PoolStats {
            groups: self.geo.group_count(),
            group_blocks: self.geo.group_blocks,
            free_groups: p.free.len() as u64,
            free_blocks: p.free_blocks,
            reserve_blocks: self.reserve_blocks,
            reclaimable_groups: self.empty_owned.load(Ordering::Relaxed)
                + self.pending.load(Ordering::Relaxed),
            taken: self.taken.load(Ordering::Relaxed),
            returned: self.returned.load(Ordering::Relaxed),
        }
    }

    /// True when a commit would give groups back to the pool: some shard owns an empty group
    /// or gave one back in a commit not yet durable.
    pub fn reclaimable(&self) -> bool {
        self.empty_owned.load(Ordering::Relaxed) + self.pending.load(Ordering::Relaxed) > 0
    }

    /// A test hook: with `true` the pool hands out no group (so a test can cut every shard's
    /// free space to an exact figure).
    pub fn set_ballast(&self, on: bool) {
        self.lock().ballast = on;
    }

    /// Takes a free group for `shard`, keeping what `need` must leave in the pool; prefers
    /// `near` (the next group after the shard's last) or the first free group after it.
    fn take(&self, shard: u32, need: MetaNeed, near: u64) -> Option<u64> {
        let mut p = self.lock();
        if p.ballast {
            return None;
        }
        // Growing changes keep all of it too: a removal may need a group in two shards (the
        // directory's and the inode's), and a group shared out to creates is one it lacks.
        let keep = match need {
            MetaNeed::Data | MetaNeed::Grow => self.reserve_blocks,
            MetaNeed::Shrink | MetaNeed::Commit => 0,
        };
        let group = p
            .free
            .range(near..)
            .next()
            .or_else(|| p.free.range(..near).next())
            .copied()?;
        let len = self.geo.group_len(group);
        if p.free_blocks < keep + len {
            return None;
        }
        p.free.remove(&group);
        p.free_blocks -= len;
        p.owner[group as usize] = shard as u8;
        self.taken.fetch_add(1, Ordering::Relaxed);
        Some(group)
    }

    /// Takes group `group` for `shard` if it is free (replay: a logged extent lies in it).
    fn take_exact(&self, shard: u32, group: u64) -> bool {
        let mut p = self.lock();
        if p.owner.get(group as usize) != Some(&FREE) {
            return false;
        }
        p.free.remove(&group);
        p.free_blocks -= self.geo.group_len(group);
        p.owner[group as usize] = shard as u8;
        self.taken.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Group `group` is free again (given back once its release is durable, or never used).
    fn put(&self, group: u64) {
        let mut p = self.lock();
        assert_ne!(p.owner[group as usize], FREE, "group {group} freed twice");
        p.owner[group as usize] = FREE;
        p.free.insert(group);
        p.free_blocks += self.geo.group_len(group);
        self.returned.fetch_add(1, Ordering::Relaxed);
    }

    /// Why the pool disagrees with the shards' allocators, if it does: a group owned by a
    /// shard whose allocator does not hold it, or held by an allocator the table does not
    /// name, or free and owned at once (the checker).
    pub fn check(&self, spaces: &[&Space]) -> std::result::Result<(), String> {
        let p = self.lock();
        let mut seen = vec![false; p.owner.len()];
        for space in spaces {
            space.check_counts()?;
            for &group in space.groups.keys() {
                if p.owner[group as usize] != space.shard as u8 {
                    return Err(format!(
                        "group {group} is held by shard {}'s allocator but the pool says {}",
                        space.shard,
                        match p.owner[group as usize] {
                            FREE => "free".to_string(),
                            o => format!("shard {o}"),
                        }
                    ));
                }
                seen[group as usize] = true;
            }
            for (_, groups) in &space.releasing {
                for &group in groups {
                    seen[group as usize] = true;
                }
            }
        }
        let mut free_blocks = 0;
        for (group, &owner) in p.owner.iter().enumerate() {
            let group = group as u64;
            if owner == FREE {
                if !p.free.contains(&group) {
                    return Err(format!("group {group} is free but not in the free set"));
                }
                free_blocks += self.geo.group_len(group);
            } else if !seen[group as usize] && spaces.iter().any(|s| s.shard == owner as u32) {
                return Err(format!(
                    "group {group} is owned by shard {owner}, whose allocator does not hold it"
                ));
            }
        }
        if free_blocks != p.free_blocks
            || p.free.len() != p.owner.iter().filter(|&&o| o == FREE).count()
        {
            return Err(format!(
                "the pool counts {} free blocks, its groups hold {free_blocks}",
                p.free_blocks
            ));
        }
        Ok(())
    }
}

/// One owned group: which blocks are allocated and which are busy (allocated or pinned).
#[derive(Debug, Clone)]
struct Group {
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

pub struct Space {
    shard: u32,
    pool: Arc<Pool>,
    geo: Geometry,
    /// The groups this shard owns, by id.
    groups: BTreeMap<u64, Group>,
    /// Owned groups with a block neither allocated nor pinned.
    room: BTreeSet<u64>,
    /// Blocks freed by each generation and not yet unpinned, oldest first.
    pinned: VecDeque<(u64, Vec<u64>)>,
    /// Groups given back by each generation's commit, reaching the pool when it unpins.
    releasing: VecDeque<(u64, Vec<u64>)>,
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
    fn keep(&self, need: MetaNeed, commit_floor: u64) -> u64 {
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
        let want = want.max(1);
        if self.op_data_blocks > 0 {
            let take = want.min(self.op_data_blocks);
            self.op_data_blocks -= take;
            let (start, got) = self.take_run(take, false);
            // A shorter run leaves the rest of the reservation for the next call.
            self.op_data_blocks += take - got;
            return Ok((start, got));
        }
        if self.data_available(commit_floor) == 0 && !self.grow_to(1, MetaNeed::Data, commit_floor)
        {
            return Err(EngineError::NoSpace);
        }
        let available = self.data_available(commit_floor);
        Ok(self.take_run(want.min(available), false))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool over `shards` regions of `region` blocks (8 of them log) in groups of `group`.
    fn pool(shards: u32, region: u64, group: u64) -> Arc<Pool> {
        Arc::new(Pool::new(Geometry {
            shards,
            region_blocks: region,
            log_blocks: 8,
            group_blocks: group,
            groups_per_region: (region - 8).div_ceil(group),
        }))
    }

    #[test]
    fn the_geometry_maps_blocks_to_groups_and_back() {
        let p = pool(3, 108, 32);
        let geo = *p.geometry();
        assert_eq!(geo.groups_per_region, 4);
        assert_eq!(geo.group_count(), 12);
        // Region 1 starts at 2 + 108 = 110; its log is 110..118; its groups 118.., the last
        // 4 blocks long.
        assert_eq!(geo.group_of(110), None, "a log block");
        assert_eq!(geo.group_of(118), Some(4));
        assert_eq!(geo.group_start(4), 118);
        assert_eq!(geo.group_len(7), 4);
        assert_eq!(geo.group_of(217), Some(7));
        assert_eq!(geo.group_of(218), None, "the next region's log");
        assert_eq!(geo.group_of(2 + 3 * 108), None, "past the last region");
        assert_eq!(geo.group_of(1), None, "a superblock");
        for g in 0..geo.group_count() {
            let start = geo.group_start(g);
            for b in start..start + geo.group_len(g) {
                assert_eq!(geo.group_of(b), Some(g));
            }
        }
        assert!(geo.in_data_area(118, 100) && !geo.in_data_area(118, 101));
        assert!(!geo.in_data_area(u64::MAX, 2));
        assert_eq!(Geometry::auto_group_blocks(245_760, 64), 64);
        assert_eq!(Geometry::auto_group_blocks(1 << 28, 64), 4096);
        assert_eq!(Geometry::auto_group_blocks(100, 64), 16);
        assert_eq!(Geometry::auto_group_blocks(15_360, 64), 16);
    }

    #[test]
    fn frees_are_pinned_until_their_generation_unpins() {
        let p = pool(1, 72, 64);
        let mut space = Space::new(0, p);
        let a = space.alloc_meta().unwrap();
        let b = space.alloc_meta().unwrap();
        assert_eq!((a, b), (10, 11));
        space.free(a, 1, Some(5));
        assert!(!space.is_allocated(a));
        // While pinned, the block is not handed out again.
        let mut got = Vec::new();
        while let Ok(block) = space.alloc_meta() {
            got.push(block);
        }
        assert!(!got.contains(&a), "a pinned block was reused");
        assert_eq!(got.len(), 62);
        assert_eq!(space.unpin(4), 0, "nothing pinned by generation 4");
        assert_eq!(space.unpin(5), 1);
        assert_eq!(
            space.alloc_meta().unwrap(),
            a,
            "unpinned block is free again"
        );
    }

    #[test]
    fn a_shard_takes_groups_as_it_grows_and_gives_back_what_it_emptied() {
        let p = pool(2, 264, 64);
        let total = p.stats().free_blocks;
        assert_eq!(total, 512);
        let mut a = Space::new(0, p.clone());
        let mut b = Space::new(1, p.clone());
        // Shard 0 writes past its own region: groups of shard 1's region join it.
        assert!(a.reserve_op(0, 260, MetaNeed::Grow, 0));
        let mut runs = Vec::new();
        let mut got = 0;
        while got < 260 {
            let (start, len) = a.alloc_data(260 - got, 0).unwrap();
            runs.push((start, len));
            got += len;
        }
        a.end_op();
        assert_eq!(a.owned_groups(), 5);
        assert!(
            runs.iter().any(|&(s, _)| s >= 2 + 264),
            "nothing past its region"
        );
        // Shard 1 gets the rest, less the pool's reserve.
        let before = p.available_blocks();
        assert!(b.reserve_op(0, 30, MetaNeed::Grow, 0));
        assert_eq!(b.alloc_data(30, 0).unwrap().1, 30);
        b.end_op();
        assert!(p.available_blocks() < before);
        // Everything freed (pinned by generation 3); the commit gives the empty groups back,
        // and they reach the pool only when generation 3 unpins. The group whose free blocks
        // the commit itself needs (its bitmap items) stays.
        for &(start, len) in &runs {
            a.free(start, len, Some(3));
        }
        assert!(p.reclaimable());
        let free_before = p.stats().free_blocks;
        let released = a.release_empty_groups(3, 0);
        assert_eq!(released, 4, "the four fully pinned groups");
        let changes = a.take_dirty();
        assert!(
            changes.removed.is_empty(),
            "never persisted: no item to delete"
        );
        assert_eq!(changes.items.len(), 1, "the group that stays");
        assert_eq!(
            p.stats().free_blocks,
            free_before,
            "not before the commit is durable"
        );
        a.unpin(3);
        assert_eq!(p.stats().free_blocks, free_before + released as u64 * 64);
        assert_eq!(a.owned_blocks(), 64);
        // The next commit may give back the last one once another group holds its room.
        assert!(b.ensure_meta(b.free_blocks() + 1, MetaNeed::Commit, 0));
        assert_eq!(a.release_empty_groups(4, 0), 0, "its own room");
        p.check(&[&a, &b]).unwrap();
    }

    #[test]
    fn a_refused_reservation_keeps_no_group_and_data_keeps_the_pool_reserve() {
        let p = pool(2, 264, 64);
        let reserve = p.reserve_blocks();
        let mut a = Space::new(0, p.clone());
        assert!(!a.reserve_op(0, 10_000, MetaNeed::Grow, 0));
        assert_eq!(a.owned_groups(), 0, "a refused reservation kept groups");
        assert_eq!(p.stats().free_blocks, 512);
        // Data fills the device down to the pool's reserve (whole groups) and the shard's own.
        let mut data = 0;
        while let Ok((_, len)) = a.alloc_data(64, 0) {
            data += len;
        }
        assert!(p.stats().free_blocks >= reserve);
        assert!(p.stats().free_blocks < reserve + 64);
        assert_eq!(data, a.owned_blocks() - a.keep(MetaNeed::Data, 0));
        // A removal may still get a group.
        assert!(a.ensure_meta(a.free_blocks() + 1, MetaNeed::Shrink, 0));
        p.check(&[&a]).unwrap();
    }

    #[test]
    fn bitmap_items_round_trip_through_a_mount() {
        let p = pool(1, 8 + 5000, 4096);
        let mut space = Space::new(0, p);
        for _ in 0..300 {
            space.alloc_meta().unwrap();
        }
        space.free(50, 20, None);
        let items = space.take_dirty().items;
        assert_eq!(items.len(), 1);
        let p2 = pool(1, 8 + 5000, 4096);
        let mut loaded = Space::new(0, p2.clone());
        loaded.load_group(items[0].0, &items[0].1).unwrap();
        assert_eq!(loaded.allocated_blocks(), 280);
        assert!(loaded.is_allocated(10) && !loaded.is_allocated(55));
        assert_eq!(p2.owner_of(0), Some(0));
        let mut other = Space::new(0, p2.clone());
        assert!(other
            .load_group(items[0].0, &items[0].1)
            .unwrap_err()
            .contains("owned by shard 0 and"));
        let mut bad = items[0].1.clone();
        // Group 1 is 904 blocks: bit 904 is past it.
        let bad_group = vec![0xffu8; 512];
        assert!(Space::new(0, p2.clone())
            .load_group(1, &bad_group)
            .unwrap_err()
            .contains("past the group"));
        bad.truncate(100);
        assert!(Space::new(0, p2).load_group(0, &bad).is_err());
    }

    #[test]
    fn a_reservation_is_all_or_nothing_and_its_allocations_cannot_fail() {
        let p = pool(1, 1008, 1000);
        p.set_ballast(false);
        let mut space = Space::new(0, p.clone());
        assert!(space.ensure_meta(1, MetaNeed::Commit, 0));
        p.set_ballast(true);
        let reserve = space.reserve_blocks;
        let floor = 10;
        let keep = floor + space.bitmap_floor_blocks();
        // Growing changes keep the floor and half of the reserve.
        let room = 1000 - keep - reserve / 2;
        assert!(!space.reserve_op(room + 1, 0, MetaNeed::Grow, floor));
        assert_eq!(
            space.free_blocks(),
            1000,
            "a refused reservation holds nothing"
        );
        assert!(space.reserve_op(room, 0, MetaNeed::Grow, floor));
        assert_eq!(space.free_blocks(), 1000 - room);
        // Nobody else may take reserved blocks, not even a removal.
        assert!(!space.ensure_meta(reserve / 2 + 1, MetaNeed::Shrink, floor));
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
    fn ballast_shrinks_the_free_space_without_allocating() {
        let p = pool(1, 108, 100);
        let mut space = Space::new(0, p.clone());
        assert!(space.ensure_meta(1, MetaNeed::Commit, 0));
        p.set_ballast(true);
        space.set_ballast(99);
        assert_eq!(space.free_blocks(), 1);
        space.alloc_meta().unwrap();
        assert_eq!(space.alloc_meta(), Err(EngineError::NoSpace));
        space.set_ballast(0);
        assert_eq!(space.allocated_blocks(), 1);
    }

    #[test]
    fn frees_and_claims_that_disk_contents_ask_for_are_checked_first() {
        let p = pool(2, 72, 64);
        let mut space = Space::new(0, p.clone());
        let mut other = Space::new(1, p.clone());
        let a = space.alloc_meta().unwrap();
        assert!(space.check_allocated(a, 1).is_ok());
        assert!(space
            .check_allocated(a, 2)
            .unwrap_err()
            .contains("says free"));
        assert!(space.check_allocated(9, 1).unwrap_err().contains("outside"));
        assert!(space
            .check_allocated(u64::MAX, 2)
            .unwrap_err()
            .contains("outside"));
        assert!(!space.contains(70, 5) && space.contains(70, 4));
        space.free(a, 1, Some(3));
        // Freed once: a second free (a node reachable twice) is refused, not asserted.
        assert!(space.check_allocated(a, 1).is_err());
        // Pinned: busy, so replay may not claim it either.
        assert!(space.check_claimable(a).unwrap_err().contains("in use"));
        assert!(space.check_claimable(a + 1).is_ok());
        assert!(space.check_claimable(5).unwrap_err().contains("outside"));
        // A block of a free group: the claim takes the group; of another shard's: refused.
        assert!(other.check_claimable(2 + 72 + 8).is_ok());
        assert_eq!(p.owner_of(1), Some(1));
        assert!(space
            .check_claimable(2 + 72 + 9)
            .unwrap_err()
            .contains("shard 1 owns"));
    }

    /// Random allocations, frees (pinned and not), commits (give back, unpin) and reserved
    /// operations by three shards on one pool, against a model of who holds which block:
    /// no block is handed out twice or while pinned, a pinned block comes back only with
    /// its generation, groups change hands only through the pool, and every count agrees
    /// with the bits after every step. `COREFS_SEED` replays.
    #[test]
    fn random_hand_overs_keep_every_block_with_one_owner() {
        use std::collections::HashMap;
        let seed = nvme::wrap::seed_from_env();
        let mut rng = seed | 1;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n.max(1)
        };
        let p = pool(3, 8 + 200, 16);
        let mut spaces: Vec<Space> = (0..3).map(|s| Space::new(s, p.clone())).collect();
        // block -> (shard, allocated?) for allocated and pinned blocks; pins per generation.
        let mut held: HashMap<u64, u32> = HashMap::new();
        let mut pinned: HashMap<u64, (u32, u64)> = HashMap::new();
        let mut generation = 1u64;
        for step in 0..20_000 {
            let s = next(3) as usize;
            match next(10) {
                0..=3 => {
                    let want = 1 + next(20);
                    let meta = next(2) == 0;
                    let got = if meta {
                        spaces[s].alloc_meta().map(|b| (b, 1))
                    } else {
                        spaces[s].alloc_data(want, 0)
                    };
                    if let Ok((start, len)) = got {
                        for b in start..start + len {
                            assert!(
                                !held.contains_key(&b) && !pinned.contains_key(&b),
                                "seed {seed} step {step}: block {b} handed out twice"
                            );
                            held.insert(b, s as u32);
                        }
                    }
                }
                4..=6 => {
                    let mine: Vec<u64> = held
                        .iter()
                        .filter(|(_, &o)| o == s as u32)
                        .map(|(&b, _)| b)
                        .collect();
                    if !mine.is_empty() {
                        let b = mine[next(mine.len() as u64) as usize];
                        held.remove(&b);
                        if next(2) == 0 {
                            spaces[s].free(b, 1, Some(generation));
                            pinned.insert(b, (s as u32, generation));
                        } else {
                            spaces[s].free(b, 1, None);
                        }
                    }
                }
                7 => {
                    // A reservation, used in part, or refused with nothing taken.
                    let before = spaces[s].owned_groups();
                    let (meta, data) = (next(8), next(60));
                    if spaces[s].reserve_op(meta, data, MetaNeed::Grow, 4) {
                        if data > 0 {
                            let (start, len) = spaces[s].alloc_data(data, 4).unwrap();
                            for b in start..start + len {
                                assert!(!held.contains_key(&b) && !pinned.contains_key(&b));
                                held.insert(b, s as u32);
                            }
                        }
                        spaces[s].end_op();
                    } else {
                        assert_eq!(spaces[s].owned_groups(), before, "seed {seed}");
                    }
                }
                _ => {
                    // A commit of `generation`: every shard gives back its empty groups;
                    // then it is durable and unpins.
                    for space in spaces.iter_mut() {
                        space.release_empty_groups(generation, next(4));
                        space.take_dirty();
                    }
                    for space in spaces.iter_mut() {
                        space.unpin(generation);
                    }
                    pinned.retain(|_, &mut (_, g)| g != generation);
                    generation += 1;
                }
            }
            for (i, space) in spaces.iter().enumerate() {
                space
                    .check_counts()
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
                assert_eq!(
                    space.allocated_blocks(),
                    held.values().filter(|&&o| o == i as u32).count() as u64,
                    "seed {seed} step {step}"
                );
            }
            for (&b, &o) in &held {
                assert!(
                    spaces[o as usize].is_allocated(b),
                    "seed {seed} step {step}"
                );
                assert_eq!(p.owner_of(p.geometry().group_of(b).unwrap()), Some(o));
            }
            let refs: Vec<&Space> = spaces.iter().collect();
            p.check(&refs)
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        }
        assert!(
            p.stats().taken > 20 && p.stats().returned > 10,
            "{:?}",
            p.stats()
        );
    }

    #[test]
    #[should_panic(expected = "unpinning generation 6 before 5")]
    fn unpin_out_of_order_is_a_bug() {
        let p = pool(1, 108, 100);
        let mut space = Space::new(0, p);
        let a = space.alloc_meta().unwrap();
        let b = space.alloc_meta().unwrap();
        space.free(a, 1, Some(5));
        space.free(b, 1, Some(6));
        space.unpin(6);
    }
}
