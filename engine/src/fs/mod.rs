//! A corefs filesystem on one device: mkfs, mount, and the shards (tree + space) that the
//! commit state machine ([`crate::commit`]) makes durable.
//!
//! An engine is a whole filesystem or one engine of a filesystem split into partitions
//! ([`crate::partition`]). That mode is a type ([`Mode`]), not a flag: the commit, the fsync
//! log and inode placement each decide by it, and what only a split engine keeps lives in
//! its variant ([`PartitionState`]), so it is reached through a match and a whole mount has
//! none of it to set or read by mistake.
//!
//! Fault model: every metadata read is verified (checksum, address, generation, owner, level)
//! and a failure is reported as corruption naming the block, never used. A device error or a
//! failed commit makes the filesystem fail-stop: the error is sticky, every later change and
//! commit fails with it, and a remount recovers the last durable generation. Mount never
//! writes.

use crate::blocks::read_block;
use crate::commit::Committer;
use crate::error::{EngineError, Result};
use crate::format::{decode_node, BlockPtr, Key, NodeBody, Superblock, BLOCK_BYTES};
use crate::space::{MetaNeed, Pool, Space};
use crate::tree::{NodeIo, Tree};
use nvme::BlockDevice;

mod mount;
mod options;

pub use options::{MkfsOptions, MountOptions, LOG_BLOCKS_MAX};

/// Object id of the space bitmap items in every shard tree. Object ids below
/// [`FIRST_INODE`] are the engine's own.
pub const SPACE_OBJECTID: u64 = 1;
pub use crate::format::items::FIRST_INODE;

/// statfs(2) figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatFs {
    pub block_bytes: u32,
    pub total_blocks: u64,
    pub free_blocks: u64,
    /// Inodes in use, and how many more fit: inodes are allocated as needed (as on XFS),
    /// so "free" is what the free blocks would hold at [`INODES_PER_FREE_BLOCK`] each.
    pub inodes: u64,
    pub free_inodes: u64,
    pub name_max: u32,
}

/// One shard's space ([`Filesystem::space_report`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardSpace {
    pub shard: u32,
    /// The block groups it owns, in order.
    pub groups: Vec<u64>,
    pub owned_blocks: u64,
    pub allocated_blocks: u64,
    /// Freed and waiting for the next commit to be durable.
    pub pinned_blocks: u64,
}

/// Inodes one free block is counted as holding in statfs: an inode's items (inode item,
/// one name, its back-reference, with leaf headers) take about 250 bytes of tree.
pub const INODES_PER_FREE_BLOCK: u64 = 16;

pub(crate) struct Shard {
    pub tree: Tree,
    pub space: Space,
    /// Inodes living in the shard, kept current by every create and delete (and by replay)
    /// and written into the superblock at each commit.
    pub inodes: u64,
}

pub struct Filesystem {
    /// The device, with the fsync log's background I/O kept apart ([`crate::log::inflight`]).
    pub(crate) dev: Box<crate::mux::DeviceMux>,
    /// The last durable superblock.
    pub(crate) sb: Superblock,
    /// The block groups no shard owns, shared by every engine of the filesystem
    /// ([`crate::space`]).
    pub(crate) pool: std::sync::Arc<Pool>,
    /// Every shard of the filesystem by id; `None` for a shard another partition holds
    /// ([`crate::partition`]). A whole-filesystem mount holds them all.
    pub(crate) shards: Vec<Option<Shard>>,
    /// A whole filesystem, or one engine of a filesystem split into partitions ([`Mode`]).
    pub(crate) mode: Mode,
    /// The running transaction and the commit state machine ([`crate::commit`]).
    pub(crate) commit: Committer,
    /// The sticky error once the filesystem failed stop: every change and commit fails with it.
    pub(crate) failed: Option<EngineError>,
    pub(crate) options: MountOptions,
    /// Inode numbering, holds on inodes and the directory index items waiting for the
    /// commit ([`crate::inode::Namespace`]).
    pub(crate) namespace: crate::inode::Namespace,
    /// The fsync log: change tracking, log heads, statistics ([`crate::log`]).
    pub(crate) log: crate::log::LogState,
    /// File data written and not yet on the device ([`crate::writeback`]).
    pub(crate) staged: crate::writeback::Staged,
    /// Recently written and read data blocks ([`crate::writeback::BlockCache`]).
    pub(crate) block_cache: crate::writeback::BlockCache,
    /// The operation in progress ([`Filesystem::run_op`]).
    pub(crate) op: OpState,
    /// Data reads whose device I/O is in flight ([`crate::reads`]).
    pub(crate) reads: crate::reads::Reads,
    /// Deferred lookups: node blocks fetched in the background ([`crate::fetch`]).
    pub(crate) fetch: crate::fetch::NodeFetch,
    /// Inode items and name chains kept decoded for lookups ([`crate::decoded`]).
    pub(crate) decoded: crate::decoded::DecodedCache,
}

/// Whether an engine is a whole filesystem or one engine of a filesystem split into
/// partitions ([`crate::partition`]); the module docs say why this is a type.
#[derive(Debug)]
pub(crate) enum Mode {
    /// A whole-filesystem mount: it holds every shard (until [`Filesystem::take_shards`]
    /// lends them), commits on its own with its superblock, and places new inodes
    /// round-robin.
    Whole,
    /// A partition, or the coordinator of partitions: commits are coordinated (a partition
    /// stops once its half is written; the coordinator writes the superblock), an fsync that
    /// must commit hands the commit to the coordinator, and the fsync log keeps to the shards
    /// held here.
    Partitioned(PartitionState),
}

/// What only an engine of a split filesystem keeps.
#[derive(Debug, Default)]
pub(crate) struct PartitionState {
    /// The shard the next new inode goes to, set by whoever places it (a partition's owner
    /// spreading directories over every shard); otherwise round-robin over the held shards.
    pub place_next: Option<u32>,
}

impl Mode {
    pub(crate) fn is_partitioned(&self) -> bool {
        matches!(self, Mode::Partitioned(_))
    }
}

/// What [`Filesystem::run_op`] keeps about the operation in progress.
#[derive(Debug, Default)]
pub(crate) struct OpState {
    /// Nesting depth: an operation built from others (truncate writes its tail) reserves
    /// once, for all of them, at depth 1.
    pub depth: u32,
    /// Tree changes so far (every insert or removal): an operation that fails after this
    /// moved has changed the filesystem halfway.
    pub changes: u64,
    /// The engine is lent to a thread that does not own the device's queue
    /// ([`Filesystem::change_lent`]): a change refused for space does not commit inline.
    pub lent: bool,
}

/// Metadata and data blocks an operation may allocate, per shard: its worst case, reserved
/// before its first change ([`Filesystem::reserve`]).
#[derive(Debug, Default)]
pub(crate) struct Needs {
    /// (shard, metadata blocks, data blocks)
    shards: Vec<(u32, u64, u64)>,
}

impl Needs {
    fn entry(&mut self, shard: u32) -> &mut (u32, u64, u64) {
        let at = match self.shards.iter().position(|e| e.0 == shard) {
            Some(at) => at,
            None => {
                self.shards.push((shard, 0, 0));
                self.shards.len() - 1
            }
        };
        &mut self.shards[at]
    }
    /// `blocks` more metadata blocks in shard `shard`.
    pub fn meta(&mut self, shard: u32, blocks: u64) -> &mut Self {
        self.entry(shard).1 += blocks;
        self
    }
    /// `blocks` more data blocks in shard `shard`.
    pub fn data(&mut self, shard: u32, blocks: u64) -> &mut Self {
        self.entry(shard).2 += blocks;
        self
    }
}

/// What a shard's tree uses to reach the device and the shard's allocator.
pub(crate) struct ShardIo<'a> {
    pub dev: &'a mut dyn BlockDevice,
    pub space: &'a mut Space,
    pub generation: u64,
    /// The commit is allocating: it may use the whole metadata reserve.
    pub for_commit: bool,
    /// Blocks every allocation outside the commit leaves for it
    /// ([`Filesystem::commit_floor_blocks`]).
    pub commit_floor: u64,
    /// Node blocks fetched in the background, and whether a miss defers instead of
    /// reading ([`crate::fetch`]); `None` outside operations (mount, check, the commit).
    pub fetch: Option<&'a mut crate::fetch::NodeFetch>,
    /// Blocks the commit in flight has serialized and not yet handed to the device (its
    /// chunk, [`crate::commit`]): the newest bytes of those addresses, which a node read must
    /// take from here. Once a shard's frozen tree is written its nodes are clean and may be
    /// evicted while the commit still slices the other shards; read back from the device
    /// they would be the block's previous contents (an older node, or data from before the
    /// block was freed).
    pub unsubmitted: &'a [(u64, bytes::Bytes)],
}

impl NodeIo for ShardIo<'_> {
    fn read_node(&mut self, ptr: &BlockPtr, owner: u32, level: u8) -> Result<NodeBody> {
        if !self.space.owns(ptr.addr) {
            return Err(EngineError::corrupt(
                "tree node",
                ptr.addr,
                format!("pointer outside shard {owner}'s block groups"),
            ));
        }
        if let Some((_, block)) = self.unsubmitted.iter().rev().find(|(a, _)| *a == ptr.addr) {
            return decode_node(block, ptr, owner, Some(level))
                .map(|(_, body)| body)
                .map_err(|why| EngineError::corrupt("tree node", ptr.addr, why));
        }
        if let Some(fetch) = self.fetch.as_deref_mut() {
            if let Some(block) = fetch.take(ptr.addr) {
                match decode_node(&block, ptr, owner, Some(level)) {
                    Ok((_, body)) => {
                        fetch.stats.blocks_used += 1;
                        return Ok(body);
                    }
                    // Fetched before the block was reused: read what it holds now.
                    Err(_) => fetch.stats.blocks_stale += 1,
                }
            }
            if fetch.deferring {
                fetch.missing.push(ptr.addr);
                return Err(EngineError::WouldBlock);
            }
        }
        let block = read_block(self.dev, ptr.addr)?;
        decode_node(&block, ptr, owner, Some(level))
            .map(|(_, body)| body)
            .map_err(|why| EngineError::corrupt("tree node", ptr.addr, why))
    }
    fn read_ahead(&mut self, ptrs: &[BlockPtr]) {
        // Only a deferred run fetches in the background; a waiting one reads what it needs.
        let Some(fetch) = self.fetch.as_deref_mut().filter(|f| f.deferring) else {
            return;
        };
        let space = &*self.space;
        fetch
            .ahead
            .extend(ptrs.iter().map(|p| p.addr).filter(|&a| space.owns(a)));
    }
    fn alloc_block(&mut self) -> Result<u64> {
        self.space.alloc_meta()
    }
    fn ensure_free(&mut self, blocks: u64, shrinking: bool) -> Result<()> {
        if self.space.in_op() {
            // The operation reserved its worst case before its first change; a step past it
            // is counted as an overrun rather than failed halfway.
            return Ok(());
        }
        let need = match (self.for_commit, shrinking) {
            (true, _) => MetaNeed::Commit,
            (false, true) => MetaNeed::Shrink,
            (false, false) => MetaNeed::Grow,
        };
        if self.space.ensure_meta(blocks, need, self.commit_floor) {
            Ok(())
        } else {
            Err(EngineError::NoSpace)
        }
    }
    fn free_block(&mut self, addr: u64, written: bool) -> Result<()> {
        self.space
            .check_allocated(addr, 1)
            .map_err(|why| EngineError::corrupt("tree node", addr, why))?;
        self.space.free(addr, 1, written.then_some(self.generation));
        Ok(())
    }
}

impl Filesystem {
    /// With `true`, an fsync that must commit returns [`crate::log::FsyncStart::NeedsCommit`]
    /// instead of committing inline (the caller commits, [`Filesystem::commit_start`]).
    pub fn defer_commits(&mut self, deferred: bool) {
        self.commit.deferred = deferred;
    }

    /// The last durable generation.
    pub fn durable_generation(&self) -> u64 {
        self.sb.generation
    }
    /// The newest generation durable and completed: its frees unpinned and the groups it
    /// gave back in the pool ([`Filesystem::complete_commit`]).
    pub fn completed_generation(&self) -> u64 {
        match self.commit.unpin_pending {
            Some(pending) => pending - 1,
            None => self.sb.generation,
        }
    }
    /// The running transaction's generation.
    pub fn generation(&self) -> u64 {
        self.commit.generation
    }
    pub fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }
    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }
    pub fn device(&self) -> &dyn BlockDevice {
        &*self.dev
    }

    /// The shards held here.
    pub(crate) fn held(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter().flatten()
    }

    /// True when shard `shard` is held here (always, unless partitioned).
    pub fn holds(&self, shard: u32) -> bool {
        self.shards.get(shard as usize).is_some_and(Option::is_some)
    }

    /// Shard `shard`, which a whole-filesystem mount (mount, replay, check) always holds.
    pub(crate) fn shard_mut(&mut self, shard: u32) -> &mut Shard {
        self.shards[shard as usize]
            .as_mut()
            .expect("a whole-filesystem mount holds every shard")
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(EngineError::ReadOnly(e.to_string())),
            None => Ok(()),
        }
    }

    /// Runs `f` on shard `shard`'s tree with its I/O context. A device error, or corruption
    /// met while changing the tree (`mutating`), leaves the tree half-changed: the filesystem
    /// fails stop. NoSpace and invalid arguments are checked before anything changes.
    pub(crate) fn with_tree<T>(
        &mut self,
        shard: u32,
        mutating: bool,
        f: impl FnOnce(&mut Tree, &mut ShardIo) -> Result<T>,
    ) -> Result<T> {
        let commit_floor = self.commit_floor_blocks(shard);
        let Some(Shard { tree, space, .. }) = self.shards[shard as usize].as_mut() else {
            // A routing bug, never a user error: fail stop rather than change half an
            // operation's shards.
            let e = EngineError::Invalid(format!(
                "shard {shard} is held by another partition (an operation was routed wrong)"
            ));
            if mutating {
                self.failed.get_or_insert(e.clone());
            }
            return Err(e);
        };
        // A deferred run must be repeatable: it may look, never change.
        assert!(
            !(mutating && self.fetch.deferring),
            "a tree changed during a deferred lookup"
        );
        let mut io = ShardIo {
            dev: &mut *self.dev,
            space,
            generation: self.commit.generation,
            for_commit: self.commit.in_commit,
            commit_floor,
            fetch: Some(&mut self.fetch),
            unsubmitted: self.commit.in_flight.as_ref().map_or(&[], |c| &c.chunk),
        };
        let loaded_before = tree.loaded_nodes();
        let changes_before = tree.changes();
        let result = f(tree, &mut io);
        if tree.changes() != changes_before {
            self.op.changes += 1;
        }
        let mut changed = std::mem::take(&mut self.log.scratch);
        tree.take_changed(&mut changed);
        let grew = tree.loaded_nodes() > loaded_before;
        for key in changed.drain(..) {
            self.decoded.forget(&key);
            self.log.note(key);
        }
        self.log.scratch = changed;
        if grew {
            self.trim_cache();
        }
        if mutating && result.is_err() {
            // A change that failed may have changed part of what it touched without saying
            // which keys: nothing decoded is trusted past it.
            self.decoded.clear();
        }
        match &result {
            Err(e @ EngineError::Device(_)) => {
                self.failed.get_or_insert(e.clone());
            }
            Err(e @ EngineError::Corrupt { .. }) if mutating => {
                self.failed.get_or_insert(e.clone());
            }
            _ => {}
        }
        result
    }

    /// Keeps the metadata cache within [`MountOptions::cache_nodes`]: once the shards held
    /// have more nodes loaded, evicts clean ones from the shard holding the most until they
    /// are down to 7/8 of the bound (the slack makes the walk over the trees rare).
    pub(crate) fn trim_cache(&mut self) {
        let bound = self.options.cache_nodes;
        let loaded = |shards: &[Option<Shard>]| -> usize {
            shards.iter().flatten().map(|s| s.tree.loaded_nodes()).sum()
        };
        let mut total = loaded(&self.shards);
        if total <= bound {
            return;
        }
        let target = bound - bound / 8;
        while total > target {
            let Some(fullest) = self
                .shards
                .iter_mut()
                .flatten()
                .max_by_key(|s| s.tree.loaded_nodes())
            else {
                return;
            };
            let held = fullest.tree.loaded_nodes();
            fullest
                .tree
                .evict_clean(held.saturating_sub(total - target));
            let after = loaded(&self.shards);
            if after >= total {
                // Only dirty nodes left in the fullest shard: the dirty limit bounds them,
                // and their commit makes them evictable.
                return;
            }
            total = after;
        }
    }

    /// Metadata blocks one tree change (an insert or a removal) in shard `shard` may
    /// allocate: a copy and a split per level, a new root and one spare (the tree's own
    /// bound). A root split during an operation does not raise the cost of its later
    /// changes: the new root and both halves are already copied in the transaction.
    pub(crate) fn tree_op_blocks(&self, shard: u32) -> u64 {
        let level = self.shards[shard as usize]
            .as_ref()
            .map_or(crate::format::node::MAX_LEVEL, |s| s.tree.level());
        2 * (level as u64 + 1) + 2
    }

    /// Metadata blocks changing or removing every item of shard `shard` with a key in
    /// `start..end` may allocate: each leaf holding them is copied once in a transaction and
    /// may merge into a neighbour (a second copy), internal nodes add a sixteenth, and the
    /// path to them one tree change's worth.
    pub(crate) fn item_range_blocks(&mut self, shard: u32, start: Key, end: Key) -> Result<u64> {
        let leaves =
            self.with_tree(shard, false, |tree, io| tree.leaves_holding(io, start, end))?;
        Ok(2 * leaves + leaves.div_ceil(16) + self.tree_op_blocks(shard))
    }

    /// What the next commit may allocate in shard `shard`, which every other allocation
    /// leaves free, beyond its group bitmap items (which the shard's allocator adds,
    /// [`Space::bitmap_floor_blocks`]): its inode counter and the paths to them, and the
    /// delayed directory-index items waiting for it
    /// ([`crate::delayed::DelayedIndex::reserved_blocks`]).
    pub(crate) fn commit_floor_blocks(&self, shard: u32) -> u64 {
        4 * self.tree_op_blocks(shard) + self.namespace.delayed.reserved_blocks(shard)
    }

    /// Reserves `needs` for the operation in progress, as changes of kind `need`, in every
    /// shard or none: NoSpace before anything changed when one shard lacks them. Only the
    /// outermost operation reserves ([`OpState::depth`]); it covers the ones it is built of.
    pub(crate) fn reserve(&mut self, needs: &Needs, need: MetaNeed) -> Result<()> {
        if self.op.depth > 1 {
            return Ok(());
        }
        debug_assert_eq!(self.op.depth, 1, "reservations belong to an operation");
        let mut taken: Vec<u32> = Vec::with_capacity(needs.shards.len());
        for &(shard, meta, data) in &needs.shards {
            let floor = self.commit_floor_blocks(shard);
            let Some(held) = self.shards[shard as usize].as_mut() else {
                return Err(EngineError::Invalid(format!(
                    "shard {shard} is held by another partition"
                )));
            };
            let fits = held.space.reserve_op(meta, data, need, floor);
            if !fits {
                // Give back what the other shards reserved for this call; the operation has
                // changed nothing yet.
                for shard in taken {
                    if let Some(held) = self.shards[shard as usize].as_mut() {
                        held.space.end_op();
                    }
                }
                return Err(EngineError::NoSpace);
            }
            taken.push(shard);
        }
        Ok(())
    }

    /// Runs one operation (a create, a write, a rename...) all or nothing. The operation
    /// reserves its worst case ([`Filesystem::reserve`]) after its lookups and checks and
    /// before its first change, so NoSpace and invalid arguments come back with nothing
    /// changed. Should it fail after a change anyway (a device error, corruption met halfway,
    /// or a bug), the in-memory state is half-changed: the filesystem fails stop, and the
    /// durable state stays intact for a remount. Operations nest: the inner ones run as part
    /// of the outer one.
    ///
    /// An operation refused with NoSpace while a commit would give space back (blocks freed
    /// in the running transaction wait for it, or groups emptied wait to go back to the pool)
    /// commits and runs once more, on a whole mount; a partition's commit is coordinated, so
    /// its caller (the reactor) parks the request until one has run
    /// ([`Filesystem::space_reclaimable`]).
    pub(crate) fn run_op<T>(&mut self, mut f: impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
        self.check_writable()?;
        if self.op.depth > 0 {
            self.op.depth += 1;
            let result = f(self);
            self.op.depth -= 1;
            return result;
        }
        match self.run_op_once(&mut f) {
            Err(EngineError::NoSpace)
                if !self.mode.is_partitioned() && !self.op.lent && self.space_reclaimable() =>
            {
                self.commit()?;
                self.run_op_once(&mut f)
            }
            other => other,
        }
    }

    pub(crate) fn run_op_once<T>(
        &mut self,
        f: &mut impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        self.op.depth = 1;
        let changes = self.op.changes;
        let result = f(self);
        self.op.depth = 0;
        for held in self.shards.iter_mut().flatten() {
            held.space.end_op();
        }
        match result {
            Err(e) if self.op.changes != changes => {
                tracing::error!(
                    "an operation failed after changing the filesystem, which is now \
                     read-only (the durable state is intact): {e}"
                );
                self.failed.get_or_insert(e.clone());
                Err(e)
            }
            Err(e) => Err(e),
            Ok(value) => {
                self.flush_due_delayed()?;
                Ok(value)
            }
        }
    }

    /// True when a commit would make space: blocks freed in the running transaction wait
    /// for it in a shard held here, or some shard owns an emptied group (or gave one back in
    /// a commit not yet durable) that reaches the pool with it.
    pub fn space_reclaimable(&self) -> bool {
        self.pool.reclaimable() || self.held().any(|s| s.space.pinned_block_count() > 0)
    }

    /// The pool of block groups (shared by every engine of the filesystem).
    pub fn space_pool(&self) -> std::sync::Arc<Pool> {
        self.pool.clone()
    }

    /// What each shard held here owns and uses (`corefs dump`, checkers, tests).
    pub fn space_report(&self) -> Vec<ShardSpace> {
        self.shards
            .iter()
            .enumerate()
            .filter_map(|(id, s)| s.as_ref().map(|s| (id as u32, s)))
            .map(|(shard, s)| ShardSpace {
                shard,
                groups: s.space.groups().collect(),
                owned_blocks: s.space.owned_blocks(),
                allocated_blocks: s.space.allocated_blocks(),
                pinned_blocks: s.space.pinned_block_count(),
            })
            .collect()
    }

    /// Metadata blocks operations allocated beyond their reservations, over the shards held
    /// (a bug when not 0; the tests check it).
    pub fn reservation_overrun_blocks(&self) -> u64 {
        self.held().map(|s| s.space.overrun_blocks()).sum()
    }

    /// Shrinks every held shard's free space to its commit floor plus `free_blocks` (None:
    /// no limit) by counting blocks as in use without allocating them: a test hook to run
    /// operations at every level of fullness a filesystem can reach (the floor is always
    /// free).
    #[doc(hidden)]
    #[cfg(feature = "sim")]
    pub fn limit_free_blocks(&mut self, free_blocks: Option<u64>) {
        self.pool.set_ballast(false);
        for id in 0..self.shards.len() as u32 {
            let floor = self.commit_floor_blocks(id);
            let Some(held) = self.shards[id as usize].as_mut() else {
                continue;
            };
            held.space.set_ballast(0);
            if let Some(limit) = free_blocks {
                // The shard takes groups until it has the room, then counts the rest as in
                // use; the pool hands out nothing more.
                held.space.ensure_meta(limit, MetaNeed::Shrink, floor);
                let keep = floor + held.space.bitmap_floor_blocks() + limit;
                let free = held.space.free_blocks();
                held.space.set_ballast(free.saturating_sub(keep));
            }
        }
        self.pool.set_ballast(free_blocks.is_some());
    }

    /// Stores a bucket item (names sharing a hash or a parent, xattrs sharing a hash): removed
    /// when `bytes` is empty, refused with EFBIG (naming `what`) before anything changes when it
    /// would not fit one item.
    pub(crate) fn put_bucket(
        &mut self,
        shard: u32,
        key: Key,
        bytes: Vec<u8>,
        what: &str,
    ) -> Result<()> {
        if bytes.len() > crate::format::node::MAX_ITEM_BYTES {
            return Err(EngineError::TooBig(what.to_string()));
        }
        self.with_tree(shard, true, |tree, io| {
            if bytes.is_empty() {
                tree.remove(io, &key).map(drop)
            } else {
                tree.insert(io, key, bytes).map(drop)
            }
        })
    }

    /// A step of a multi-step change failed after earlier steps changed the tree: the
    /// in-memory state is half-changed, so the filesystem fails stop (the durable state is
    /// intact and a remount recovers it).
    pub(crate) fn fail_stop_on_error<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            tracing::error!("a change failed halfway, filesystem is now read-only: {e}");
            self.failed.get_or_insert(e.clone());
        }
        result
    }

    #[cfg(feature = "sim")]
    fn check_key(key: &Key) -> Result<()> {
        if key.objectid < FIRST_INODE {
            return Err(EngineError::Invalid(format!(
                "object id {} is reserved",
                key.objectid
            )));
        }
        Ok(())
    }

    /// Inserts or replaces an item in shard `shard`'s tree (joins the running transaction),
    /// bypassing every operation's checks and reservations: test machinery (`sim`).
    #[cfg(feature = "sim")]
    pub fn insert_item(&mut self, shard: u32, key: Key, value: Vec<u8>) -> Result<Option<Vec<u8>>> {
        self.check_writable()?;
        Self::check_key(&key)?;
        self.with_tree(shard, true, |tree, io| tree.insert(io, key, value))
    }

    /// Removes an item from shard `shard`'s tree, as [`Filesystem::insert_item`] inserts.
    #[cfg(feature = "sim")]
    pub fn remove_item(&mut self, shard: u32, key: &Key) -> Result<Option<Vec<u8>>> {
        self.check_writable()?;
        Self::check_key(key)?;
        self.with_tree(shard, true, |tree, io| tree.remove(io, key))
    }

    pub fn get_item(&mut self, shard: u32, key: &Key) -> Result<Option<Vec<u8>>> {
        self.with_tree(shard, false, |tree, io| tree.get(io, key))
    }

    /// Items with `start` ≤ key < `end` in shard `shard`.
    pub fn range_items(&mut self, shard: u32, start: Key, end: Key) -> Result<Vec<(Key, Vec<u8>)>> {
        self.with_tree(shard, false, |tree, io| tree.range(io, start, end))
    }

    /// How many distinct leaves of shard `shard` hold items in `start..end` (batching figures).
    pub fn leaves_holding(&mut self, shard: u32, start: Key, end: Key) -> Result<u64> {
        self.with_tree(shard, false, |tree, io| tree.leaves_holding(io, start, end))
    }

    /// Dirty tree nodes in the running transaction, over all shards.
    pub fn dirty_nodes(&self) -> usize {
        self.held().map(|s| s.tree.dirty_nodes()).sum()
    }

    /// Tree nodes in memory, over all shards.
    pub fn loaded_nodes(&self) -> usize {
        self.held().map(|s| s.tree.loaded_nodes()).sum()
    }

    /// True when the commit timer or the dirty limit says the running transaction should
    /// commit.
    pub fn commit_due(&self) -> bool {
        (self.is_dirty() || self.namespace.delayed.len() > 0)
            && (self.commit.transaction_started.elapsed() >= self.options.commit_interval
                || self.dirty_nodes() >= self.options.dirty_limit_nodes
                || self.log.tracked_keys() >= crate::log::MAX_TRACKED_KEYS
                || self.log.fullest_head() * 8 >= self.sb.log_half_blocks() * 7)
    }

    /// True when the running transaction is past 5/8 of what makes a commit due (its age,
    /// its dirty nodes or the fill of its log): staged data is then written back early
    /// ([`crate::writeback`]) so the commit itself stays short.
    pub fn commit_near(&self) -> bool {
        self.commit.transaction_started.elapsed() * 8 >= self.options.commit_interval * 5
            || self.dirty_nodes() * 8 >= self.options.dirty_limit_nodes * 5
            || self.log.tracked_keys() * 8 >= crate::log::MAX_TRACKED_KEYS * 5
            || self.log.fullest_head() * 8 >= self.sb.log_half_blocks() * 5
    }

    /// Commits if [`Filesystem::commit_due`]. The engine starts no threads: whoever drives it
    /// (a reactor's loop, a tool, a test) calls this between operations. Returns whether it
    /// committed.
    pub fn tick(&mut self) -> Result<bool> {
        self.complete_commit();
        if self.failed.is_none() && self.commit_due() {
            self.commit()?;
            return Ok(true);
        }
        Ok(false)
    }

    /// statfs: sizes in 4 KiB blocks. Free is what files could still get: the pool's free
    /// groups less its reserve, and what each shard's own groups hold beyond its commit floor
    /// and reserve. A partition counts its shards only ([`Filesystem::statfs_held`]); the
    /// pool is the whole filesystem's, added once by whoever sums the partitions.
    pub fn statfs(&self) -> StatFs {
        let mut statfs = self.statfs_held();
        if !self.mode.is_partitioned() {
            statfs.total_blocks = self.sb.data_area_blocks();
            statfs.free_blocks += self.pool.available_blocks();
            statfs.free_inodes = statfs.free_blocks.saturating_mul(INODES_PER_FREE_BLOCK);
        }
        statfs
    }

    /// The shards held here: their inodes and the free blocks in the groups they own (total 0:
    /// the device's size is the pool's, [`crate::space::Pool::stats`]).
    pub fn statfs_held(&self) -> StatFs {
        let free: u64 = self
            .shards
            .iter()
            .enumerate()
            .filter_map(|(id, s)| s.as_ref().map(|s| (id as u32, s)))
            .map(|(id, s)| s.space.data_available(self.commit_floor_blocks(id)))
            .sum();
        StatFs {
            block_bytes: BLOCK_BYTES as u32,
            total_blocks: 0,
            free_blocks: free,
            inodes: self.held().map(|s| s.inodes).sum(),
            free_inodes: free.saturating_mul(INODES_PER_FREE_BLOCK),
            name_max: 255,
        }
    }

    /// sync: commits everything.
    pub fn sync(&mut self) -> Result<()> {
        self.commit().map(drop)
    }

    /// Has the device queue signal `eventfd` on every completion ([`BlockDevice::signal_completions_to`]):
    /// the owner then sleeps on the eventfd for I/O and for its other wake-ups at once.
    pub fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        nvme::BlockDevice::signal_completions_to(&mut *self.dev, eventfd)
    }

    /// Where the kernel runs the device queue's blocking work
    /// ([`BlockDevice::run_blocking_work_on`]); from the thread that owns the queue.
    pub fn run_blocking_work_on(
        &mut self,
        cores: &[usize],
    ) -> std::result::Result<bool, nvme::DevError> {
        nvme::BlockDevice::run_blocking_work_on(&mut *self.dev, cores)
    }

    /// Gives the device back without committing: what a crash leaves (tests, tools).
    pub fn into_device(self) -> Box<dyn BlockDevice> {
        self.dev.into_inner()
    }

    /// Commits and gives the device back (clean unmount). In debug builds, any engine object
    /// still referenced afterwards is a leak and is reported with its holder.
    pub fn unmount(mut self) -> Result<Box<dyn BlockDevice>> {
        if self.failed.is_none() {
            self.commit()?;
            if let Some(leaks) = self.namespace.delayed.leak_report() {
                return Err(EngineError::Invalid(format!("unmount: {leaks}")));
            }
        }
        // A failed filesystem may still have log I/O in flight: let it finish, errors and all.
        let _ = self.drain_log();
        self.finish_reads_through(u64::MAX);
        Ok(self.dev.into_inner())
    }
}
