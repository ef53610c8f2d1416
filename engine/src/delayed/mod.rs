//! Delayed directory-index items, as btrfs's delayed items.
//!
//! A new name's index item `(dir, DirIndex, seq)` is not inserted into the tree when the name
//! is created: it waits here, per directory, and the commit inserts each directory's pending
//! items in one batch of consecutive keys. Consecutive keys land in the same leaf one after
//! another (and the tree's run-aware split keeps those leaves full), so 100,000 creates in one
//! directory cost a few thousand leaf copies instead of one per create, and the leaves end up
//! full. A name removed before its commit never touches the tree at all.
//!
//! # Invariants
//! - Every name has exactly one index entry: in the tree or here, never both.
//! - Pending items are bounded ([`MAX_PENDING`]); past the bound they are flushed into the
//!   trees without a commit, so memory does not grow with an unbounded transaction.
//! - The metadata blocks inserting them may take are part of the commit floor of their
//!   directory's shard ([`DelayedIndex::reserved_blocks`]): the operation that adds a name
//!   reserves [`DELAYED_ITEM_BLOCKS_MAX`] for it, and every allocation outside a commit leaves
//!   the floor free, so the insert can never run out of space.
//! - The bookkeeping of a batch is released when the batch is in the tree (the map entry is
//!   consumed by the insert); in debug builds every pending item is tracked by a [`Tracker`]
//!   that reports any item still held when the filesystem is dropped.

use crate::format::items::NameEntry;
use crate::refs::Tracker;
use std::collections::BTreeMap;

mod ops;

/// Pending index items kept before they are flushed into the trees without a commit.
pub const MAX_PENDING: usize = 65_536;

/// Pending items of one directory that are inserted as one batch without waiting for the
/// commit: about 4 full leaves. Bounding the batch bounds the stall the operation that
/// triggers it sees (flushing 65,536 items at once took ~50 ms, 2,048 a few ms, 512 1.1 to
/// 1.7 ms in a create run on this 2-core VM: the creates' worst latency; 256 about half),
/// while batches stay several leaves long, so the leaf-copy savings remain.
pub const DIR_BATCH_MAX: usize = 256;

/// Pending items one [`Filesystem::commit_prepare`](crate::Filesystem::commit_prepare) step inserts at most (whole directories:
/// a step may exceed it by one directory's batch, below [`DIR_BATCH_MAX`]). A step runs
/// between batches of requests, so it bounds how long they wait for it.
pub const PREPARE_STEP_ITEMS: usize = 256;

/// The most one more pending item adds to [`DelayedIndex::reserved_blocks`] (a new leaf's
/// share, a new directory's two, and the internal nodes' rounding).
pub const DELAYED_ITEM_BLOCKS_MAX: u64 = 4;

/// Batching figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DelayedStats {
    /// Directory batches inserted (one per directory per flush).
    pub batches: u64,
    pub items: u64,
    pub max_batch: u64,
    /// Names created and removed within one transaction: their index item never reached a tree.
    pub cancelled: u64,
}

pub(crate) struct DelayedIndex {
    pending: BTreeMap<u64, BTreeMap<u64, NameEntry>>,
    count: usize,
    /// Per shard: pending items, and directories with pending items (what the shard's commit
    /// floor reserves for them).
    by_shard: Vec<(u64, u64)>,
    /// Directories whose pending batch reached [`DIR_BATCH_MAX`]: flushed after the
    /// operation that filled them.
    due: Vec<u64>,
    pub stats: DelayedStats,
    tracker: Tracker,
}

impl DelayedIndex {
    pub fn new(shards: u32) -> DelayedIndex {
        DelayedIndex {
            pending: BTreeMap::new(),
            count: 0,
            by_shard: vec![(0, 0); shards as usize],
            due: Vec::new(),
            stats: DelayedStats::default(),
            tracker: Tracker::default(),
        }
    }

    fn shard_of(&self, dir: u64) -> usize {
        (dir % self.by_shard.len() as u64) as usize
    }

    pub fn insert(&mut self, dir: u64, seq: u64, entry: NameEntry) {
        self.tracker.acquire((dir, seq), "delayed index item");
        let shard = self.shard_of(dir);
        let items = self.pending.entry(dir).or_default();
        if items.is_empty() {
            self.by_shard[shard].1 += 1;
        }
        let previous = items.insert(seq, entry);
        assert!(
            previous.is_none(),
            "index {seq} of directory {dir} delayed twice"
        );
        if items.len() == DIR_BATCH_MAX {
            self.due.push(dir);
        }
        self.by_shard[shard].0 += 1;
        self.count += 1;
    }

    /// Takes the pending item `(dir, seq)`, if it is still pending.
    pub fn take(&mut self, dir: u64, seq: u64) -> Option<NameEntry> {
        let shard = self.shard_of(dir);
        let items = self.pending.get_mut(&dir)?;
        let entry = items.remove(&seq)?;
        if items.is_empty() {
            self.pending.remove(&dir);
            self.by_shard[shard].1 -= 1;
        }
        self.by_shard[shard].0 -= 1;
        self.count -= 1;
        self.stats.cancelled += 1;
        self.tracker.release((dir, seq));
        Some(entry)
    }

    /// Takes every pending item of `dir`.
    fn take_dir(&mut self, dir: u64) -> Option<BTreeMap<u64, NameEntry>> {
        let items = self.pending.remove(&dir)?;
        let shard = self.shard_of(dir);
        self.by_shard[shard].0 -= items.len() as u64;
        self.by_shard[shard].1 -= 1;
        self.count -= items.len();
        Some(items)
    }

    /// Metadata blocks inserting the pending items of shard `shard` may allocate (part of its
    /// commit floor, [`crate::fs::Filesystem::commit_floor_blocks`], which adds the paths):
    /// a batch of consecutive keys fills leaves one after another, at least 6 items of the
    /// longest names each (the tree splits at the end of a run); per directory, the leaf its
    /// run starts in is copied and split once; internal nodes add a sixteenth.
    pub fn reserved_blocks(&self, shard: u32) -> u64 {
        let Some(&(items, dirs)) = self.by_shard.get(shard as usize) else {
            return 0;
        };
        let leaves = items.div_ceil(6) + 2 * dirs;
        leaves + leaves.div_ceil(16)
    }

    /// Pending items of `dir` with sequence ≥ `from`, in order.
    pub fn range(&self, dir: u64, from: u64) -> impl Iterator<Item = (u64, &NameEntry)> {
        self.pending
            .get(&dir)
            .into_iter()
            .flat_map(move |items| items.range(from..).map(|(s, e)| (*s, e)))
    }

    pub fn has_any(&self, dir: u64) -> bool {
        self.pending.contains_key(&dir)
    }

    /// Pending items of `dir`.
    pub fn pending_in(&self, dir: u64) -> usize {
        self.pending.get(&dir).map_or(0, BTreeMap::len)
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Every pending item (for the checker).
    pub fn all(&self) -> impl Iterator<Item = (u64, u64, &NameEntry)> {
        self.pending
            .iter()
            .flat_map(|(dir, items)| items.iter().map(move |(s, e)| (*dir, *s, e)))
    }

    /// Leak report for debug builds (see [`Tracker::report`]).
    pub fn leak_report(&self) -> Option<String> {
        self.tracker.report()
    }
}

impl DelayedIndex {
    /// Takes the pending items of every directory `pick` selects (moving a shard to another
    /// partition, [`crate::partition`]).
    pub(crate) fn take_dirs(
        &mut self,
        pick: impl Fn(u64) -> bool,
    ) -> Vec<(u64, BTreeMap<u64, NameEntry>)> {
        let dirs: Vec<u64> = self.pending.keys().copied().filter(|d| pick(*d)).collect();
        let mut out = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let items = self.take_dir(dir).expect("listed");
            for seq in items.keys() {
                self.tracker.release((dir, *seq));
            }
            out.push((dir, items));
        }
        out
    }

    /// Adds items taken by [`DelayedIndex::take_dirs`] from another partition.
    pub(crate) fn put_dirs(&mut self, dirs: Vec<(u64, BTreeMap<u64, NameEntry>)>) {
        for (dir, items) in dirs {
            for (seq, entry) in items {
                self.insert(dir, seq, entry);
            }
        }
    }
}
