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
//!
//! # Layout
//! - `mod.rs`: the geometry of groups on the device, the reserves, and why blocks are wanted
//!   ([`MetaNeed`]).
//! - [`pool`]: the pool of free groups and the owner of every group ([`Pool`]).
//! - [`shard`]: one shard's allocator over the groups it owns ([`Space`]): allocation,
//!   pinning, reservations, the bitmap items a commit writes.
//! - `check.rs`: the pool checked against the shards' allocators.

mod check;
mod pool;
mod shard;
#[cfg(test)]
mod tests;

use crate::format::Superblock;
pub use pool::{Pool, PoolStats};
pub use shard::{BitmapChanges, DataGoal, Space, STREAM_ROOM_BLOCKS};

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
