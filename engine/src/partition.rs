//! Partitions: one filesystem split so that several reactors each hold some of its shards and
//! run them on their own core and device queue, with no lock between them.
//!
//! A whole-filesystem mount (mount replays the logs) is split with
//! [`Filesystem::take_shards`]: each reactor builds its partition from its [`ShardSet`] on a
//! device queue of its own ([`Filesystem::from_shards`]); the coordinator keeps the whole
//! mount, holding no shard, to write superblocks and to run operations that span partitions.
//!
//! # Invariants
//! - A shard is held by exactly one engine at a time. Everything kept per shard travels with
//!   it: the tree and its cache, the space map (pinned frees included), the inode counter,
//!   the delayed index items of its directories, the staged data and the fsync-log change
//!   tracking of its inodes. Log heads stay with the owner (only the owner logs).
//! - Every partition runs the same generation. A commit is coordinated: each partition writes
//!   its half ([`Filesystem::commit_write`]), the coordinator flushes and writes the
//!   superblock ([`Filesystem::write_super`]), each partition then moves to the next
//!   generation ([`Filesystem::commit_finish`]).
//! - An operation spanning partitions runs on one engine holding all the shards it touches
//!   (lent for the operation and given back), so it is atomic to every observer and lands in
//!   one generation. Its inodes are marked: an fsync reaching one commits instead of logging,
//!   so no log record ever needs another partition's items, and the streams replay
//!   independently ([`crate::log`]).
//! - A new regular file, symlink or node goes to a shard of its directory's partition (the
//!   common create is local); directories are spread over every shard by the owner
//!   ([`Filesystem::place_next`]).
//! - The fsync log walks up to ancestors only within the partition. What makes stopping at
//!   the boundary safe: a directory rename is committed before it returns (the runtime does
//!   this in partitioned mode), and a name linking across the boundary was made by an operation
//!   spanning partitions, which marked the inode on this side until the next commit.

use crate::commit::Committer;
use crate::error::{EngineError, Result};
use crate::format::items::NameEntry;
use crate::format::Superblock;
use crate::fs::{Filesystem, Mode, MountOptions, PartitionState, Shard};
use crate::inode::Namespace;
use crate::log::Tracked;
use crate::writeback::StagedRuns;
use nvme::BlockDevice;
use std::collections::BTreeMap;

/// Shards moving between engines, with their per-shard state.
pub struct ShardSet {
    parts: Vec<ShardParts>,
    /// Set when the engine giving the shards back failed (the shards may be half-changed):
    /// the owner becomes fail-stop too.
    pub failed: Option<EngineError>,
}

struct ShardParts {
    id: u32,
    shard: Shard,
    ino_counter: Option<u64>,
    ino_counter_dirty: bool,
}

/// The state kept per inode (staged data, log tracking, holds) and per directory (delayed
/// index items) for the inodes of the moving shards.
struct InodeState {
    staged: StagedRuns,
    delayed: Vec<(u64, BTreeMap<u64, NameEntry>)>,
    tracked: Vec<(u64, Tracked)>,
    cross: Vec<u64>,
    /// Holds on the moving inodes: an unlink run elsewhere must see them to keep an open
    /// inode as an orphan.
    holds: Vec<(u64, u32)>,
}

/// A [`ShardSet`] with its inode state: what actually moves.
pub struct Lent {
    set: ShardSet,
    inodes: InodeState,
}

impl Lent {
    /// The shard ids moving.
    pub fn ids(&self) -> Vec<u32> {
        self.set.parts.iter().map(|p| p.id).collect()
    }
}

// A lent set crosses threads (reactor to coordinator and back).
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Lent>();
};

impl Filesystem {
    /// Takes shards `ids` out of this engine, with everything kept for them, so another
    /// engine can hold them ([`Filesystem::put_shards`]). Records in flight finish first.
    /// Shards not held here are skipped.
    pub fn take_shards(&mut self, ids: &[u32]) -> Result<Lent> {
        // A commit's frozen trees are serialized before a shard leaves: the slices run here.
        self.finish_commit_slices()?;
        self.drain_log()?;
        // Reads in flight finish here: the engine that takes the shards may free and reuse
        // the blocks they read (their results wait for this engine's caller).
        self.finish_reads_through(u64::MAX);
        // Unpinning is per engine and in generation order: the last commit's frees are
        // unpinned before a shard leaves, so none is left pinned for an engine that never
        // unpins that generation.
        self.complete_commit();
        // Another engine may change what these shards hold before they come back.
        self.decoded.clear();
        let count = self.shard_count() as u64;
        let mut parts = Vec::with_capacity(ids.len());
        for &id in ids {
            let Some(shard) = self.shards[id as usize].take() else {
                continue;
            };
            parts.push(ShardParts {
                id,
                shard,
                ino_counter: self.namespace.ino_counters[id as usize].take(),
                ino_counter_dirty: std::mem::take(
                    &mut self.namespace.ino_counters_dirty[id as usize],
                ),
            });
        }
        let moving: Vec<u32> = parts.iter().map(|p| p.id).collect();
        let pick = |ino: u64| moving.contains(&((ino % count) as u32));
        let tracked: Vec<(u64, Tracked)> = {
            let inos: Vec<u64> = self
                .log
                .inodes
                .keys()
                .copied()
                .filter(|i| pick(*i))
                .collect();
            inos.into_iter()
                .map(|ino| {
                    let t = self.log.inodes.remove(&ino).expect("listed");
                    self.log.tracked_keys -= t.keys.len();
                    (ino, t)
                })
                .collect()
        };
        let cross: Vec<u64> = self
            .log
            .cross
            .iter()
            .copied()
            .filter(|i| pick(*i))
            .collect();
        for ino in &cross {
            self.log.cross.remove(ino);
        }
        let held: Vec<u64> = self
            .namespace
            .inode_holds
            .keys()
            .copied()
            .filter(|i| pick(*i))
            .collect();
        let holds = held
            .into_iter()
            .map(|ino| {
                (
                    ino,
                    self.namespace.inode_holds.remove(&ino).expect("listed"),
                )
            })
            .collect();
        Ok(Lent {
            inodes: InodeState {
                staged: self.staged.take_inodes(pick),
                delayed: self.namespace.delayed.take_dirs(pick),
                tracked,
                cross,
                holds,
            },
            set: ShardSet {
                parts,
                failed: self.failed.clone(),
            },
        })
    }

    /// Holds the shards of `lent` (taken by [`Filesystem::take_shards`] here or elsewhere).
    /// If the engine that gave them back had failed, this one fails stop too.
    pub fn put_shards(&mut self, lent: Lent) {
        let Lent { set, inodes } = lent;
        self.decoded.clear();
        for part in set.parts {
            assert!(
                self.shards[part.id as usize].is_none(),
                "shard {} held twice",
                part.id
            );
            self.shards[part.id as usize] = Some(part.shard);
            self.namespace.ino_counters[part.id as usize] = part.ino_counter;
            self.namespace.ino_counters_dirty[part.id as usize] = part.ino_counter_dirty;
        }
        self.staged.put_inodes(inodes.staged);
        self.namespace.delayed.put_dirs(inodes.delayed);
        for (ino, t) in inodes.tracked {
            self.log.tracked_keys += t.keys.len();
            let previous = self.log.inodes.insert(ino, t);
            assert!(previous.is_none(), "inode {ino} tracked twice");
        }
        self.log.cross.extend(inodes.cross);
        for (ino, count) in inodes.holds {
            let previous = self.namespace.inode_holds.insert(ino, count);
            assert!(previous.is_none(), "inode {ino} held in two engines");
        }
        if let Some(e) = set.failed {
            self.failed.get_or_insert(e);
        }
    }

    /// A partition holding `lent`'s shards on its own device queue `dev`, in the generation
    /// and with the superblock of `like` (the whole mount it was split from), writing log
    /// stream `stream`. The device must reach the same storage as `like`'s.
    pub fn from_shards(
        dev: Box<dyn BlockDevice>,
        like: &PartitionTemplate,
        lent: Lent,
    ) -> Filesystem {
        let count = like.sb.shards.len();
        let mut log = crate::log::LogState::new(count);
        log.stream = like.stream;
        let mut fs = Filesystem {
            dev: Box::new(crate::mux::DeviceMux::new(dev)),
            sb: like.sb.clone(),
            pool: like.pool.clone(),
            shards: (0..count).map(|_| None).collect(),
            mode: Mode::Partitioned(PartitionState::default()),
            commit: Committer::new(like.generation, true),
            failed: None,
            options: like.options.clone(),
            namespace: Namespace::new(count, like.stream as u64),
            log,
            staged: Default::default(),
            block_cache: crate::writeback::BlockCache::new(like.options.data_cache_blocks),
            op: Default::default(),
            reads: Default::default(),
            fetch: Default::default(),
            decoded: Default::default(),
        };
        fs.put_shards(lent);
        // The mount's metadata cache budget is shared out by shards held.
        let held = fs.held_ids().len();
        fs.options.cache_nodes = (like.options.cache_nodes * held / count).max(64);
        fs
    }

    /// What [`Filesystem::from_shards`] needs from the whole mount, for log stream `stream`.
    pub fn partition_template(&self, stream: u32) -> PartitionTemplate {
        PartitionTemplate {
            sb: self.sb.clone(),
            pool: self.pool.clone(),
            generation: self.commit.generation,
            options: self.options.clone(),
            stream,
        }
    }

    /// Makes this whole mount the coordinator of partitions (after its shards were taken):
    /// it commits only through the coordinated protocol from now on.
    pub fn set_partitioned(&mut self) {
        if let Mode::Whole = self.mode {
            self.mode = Mode::Partitioned(PartitionState::default());
        }
    }

    pub fn is_partitioned(&self) -> bool {
        self.mode.is_partitioned()
    }

    /// The next new inode goes to shard `shard` (held here), once. Only an engine of a split
    /// filesystem is told where to place: a whole mount spreads its inodes itself.
    pub fn place_next(&mut self, shard: u32) {
        match &mut self.mode {
            Mode::Partitioned(p) => p.place_next = Some(shard),
            Mode::Whole => panic!("a whole-filesystem mount places its inodes itself"),
        }
    }

    /// Marks every inode whose changes are tracked here as changed across partitions: the
    /// engine that ran an operation spanning partitions does this before giving the shards
    /// back, so an fsync reaching any of them commits.
    pub fn mark_cross(&mut self) {
        let inos: Vec<u64> = self.log.inodes.keys().copied().collect();
        self.log.cross.extend(inos);
    }

    /// Fails stop with `e` (a coordinated commit failed elsewhere).
    pub fn fail_stop(&mut self, e: EngineError) {
        self.failed.get_or_insert(e);
    }

    /// The sticky error, if the filesystem failed.
    pub fn failure(&self) -> Option<&EngineError> {
        self.failed.as_ref()
    }

    /// Shard ids held here.
    pub fn held_ids(&self) -> Vec<u32> {
        (0..self.shard_count()).filter(|&s| self.holds(s)).collect()
    }

    /// True when `dir` and every directory above it are held here: what a rename of a
    /// directory walks (up from its new parent, to refuse a move into its own subtree) is
    /// then this partition's to read.
    pub fn ancestry_held(&mut self, dir: u64) -> Result<bool> {
        let held_shards: Vec<bool> = (0..self.shard_count()).map(|s| self.holds(s)).collect();
        let count = held_shards.len() as u64;
        let mut held = true;
        self.walk_up(dir, |ino| {
            held = held_shards[(ino % count) as usize];
            held
        })?;
        Ok(held)
    }

    /// The child `name` of `dir` names, without reading the child (the directory's shard
    /// only): how a partition's owner finds which shards an operation touches.
    pub fn lookup_ino(&mut self, dir: u64, name: &[u8]) -> Result<Option<u64>> {
        Ok(self.find_name(dir, name)?.map(|(ino, _)| ino))
    }
}

/// The whole mount's superblock, generation and options, for building partitions.
#[derive(Clone)]
pub struct PartitionTemplate {
    pub sb: Superblock,
    /// The filesystem's one pool of block groups: every partition draws from it.
    pub pool: std::sync::Arc<crate::space::Pool>,
    pub generation: u64,
    pub options: MountOptions,
    pub stream: u32,
}
