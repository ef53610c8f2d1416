//! The pool of block groups no shard owns, with the reserve it keeps back and the owner of
//! every group (see the invariants in [`super`]). One mutex guards it: shards take and give
//! back groups rarely (a group at a time, when they run short or empty one), never per
//! allocation.

use super::{Geometry, MetaNeed, RESERVE_BLOCKS_POOL_MAX};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What no shard owns: free groups, the reserve, and the owner of every group.
pub struct Pool {
    pub(super) geo: Geometry,
    reserve_blocks: u64,
    inner: Mutex<PoolInner>,
    /// Groups owned with nothing allocated in them: the next commit of their shard gives
    /// them back ([`Pool::reclaimable`]).
    pub(super) empty_owned: AtomicU64,
    /// Groups given back by a commit that is not yet durable: they reach the pool then.
    pub(super) pending: AtomicU64,
    /// Hand-overs so far (statistics).
    taken: AtomicU64,
    returned: AtomicU64,
}

/// The owner table's mark for a free group.
pub(super) const FREE: u8 = u8::MAX;

pub(super) struct PoolInner {
    /// The owning shard of every group, or [`FREE`].
    pub(super) owner: Vec<u8>,
    pub(super) free: BTreeSet<u64>,
    pub(super) free_blocks: u64,
    /// A test hook: no group is handed out ([`Pool::set_ballast`]).
    pub(super) ballast: bool,
}

/// Pool figures, for statfs and the statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

    pub(super) fn lock(&self) -> MutexGuard<'_, PoolInner> {
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
    pub(super) fn take(&self, shard: u32, need: MetaNeed, near: u64) -> Option<u64> {
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
    pub(super) fn take_exact(&self, shard: u32, group: u64) -> bool {
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
    pub(super) fn put(&self, group: u64) {
        let mut p = self.lock();
        assert_ne!(p.owner[group as usize], FREE, "group {group} freed twice");
        p.owner[group as usize] = FREE;
        p.free.insert(group);
        p.free_blocks += self.geo.group_len(group);
        self.returned.fetch_add(1, Ordering::Relaxed);
    }
}
