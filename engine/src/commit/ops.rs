//! The commit's steps on the whole filesystem: starting a transaction's commit, writing its
//! shards' nodes and staged data in slices, the superblock's FUA write, and unpinning what the
//! generation freed. The states and their order are in [`super`] (the module docs draw them);
//! this file moves a [`Filesystem`] through them.
//!
//! Layering: [`super`] holds the commit's own state ([`super::Committer`]) and never names
//! [`Filesystem`]; this file is where the commit reaches the rest (trees, space, the fsync
//! log's truncation, write-back, delayed index items), through their state or
//! `Filesystem`'s methods. The invariants and fault model are [`super`]'s.

use super::{
    CommitInFlight, CommitProgress, CommitState, CommitStats, CommitWritten, COMMIT_CHUNK_BLOCKS,
    RETIRED_DROP_STEP,
};
use crate::blocks::block_lba;
use crate::error::{EngineError, Result};
use crate::format::{
    BlockPtr, ItemKind, Key, ShardRoot, Superblock, BLOCK_BYTES, SUPERBLOCK_ADDRS,
};
use crate::fs::{Filesystem, Shard, ShardIo, SPACE_OBJECTID};
use std::time::{Duration, Instant};

impl Filesystem {
    pub fn commit_state(&self) -> CommitState {
        self.commit.state
    }

    pub fn commit_stats(&self) -> CommitStats {
        self.commit.stats
    }

    /// True when the running transaction has changes to commit.
    pub fn is_dirty(&self) -> bool {
        self.namespace.delayed.len() > 0
            || self.staged.bytes() > 0
            || self.namespace.ino_counters_dirty.iter().any(|&d| d)
            || self.held().any(|s| s.tree.is_dirty())
    }

    /// Commits the running transaction and completes it (unpins its frees). Returns the
    /// generation now durable. A commit with nothing to write does nothing.
    pub fn commit(&mut self) -> Result<u64> {
        let generation = self.commit_to_super()?;
        self.complete_commit();
        Ok(generation)
    }

    /// Commits the running transaction and returns at SuperCommitted, leaving the unpinning
    /// to [`Filesystem::complete_commit`]: what a caller with waiters to release (fsync
    /// fallbacks, sync) uses, so they go before the unpinning. A commit already in flight
    /// ([`Filesystem::commit_start`]) finishes first. A partition commits through its
    /// coordinator instead ([`crate::partition`]).
    pub fn commit_to_super(&mut self) -> Result<u64> {
        if self.mode.is_partitioned() {
            return Err(EngineError::Invalid(
                "a partition commits through its coordinator".into(),
            ));
        }
        self.check_writable()?;
        self.finish_commit_in_flight()?;
        if !self.commit_start()? {
            return Ok(self.sb.generation);
        }
        self.finish_commit_in_flight()?;
        Ok(self.sb.generation)
    }

    /// Waits for the commit in flight, if any, to reach SuperCommitted (a whole mount) or to
    /// have its writes durable (a partition, whose coordinator writes the superblock).
    pub(crate) fn finish_commit_in_flight(&mut self) -> Result<()> {
        loop {
            match self.commit_progress(Some(Duration::from_millis(100)))? {
                CommitProgress::Idle | CommitProgress::SuperCommitted(_) => return Ok(()),
                CommitProgress::Written if self.mode.is_partitioned() => return Ok(()),
                CommitProgress::Written | CommitProgress::Writing => {}
            }
        }
    }

    /// Starts committing the running transaction (generation N) without waiting: the records
    /// in flight finish and the previous commit unpins; delayed index items and inode counters
    /// join the trees; staged data and every dirty node are serialized and handed to the
    /// device in the background, followed by a flush. From here on changes belong to N+1 and
    /// the caller may go on serving reads and writes while [`Filesystem::commit_progress`]
    /// carries N to SuperCommitted. Returns false when nothing changed. An fsync must not be
    /// logged while N is in flight (its record would belong to N+1, which replay ignores until
    /// N is durable): [`Filesystem::fsync_group_start`] finishes N first; a reactor holds its
    /// fsyncs until then. On error the filesystem is fail-stop.
    pub fn commit_start(&mut self) -> Result<bool> {
        let _span =
            tracing::debug_span!("commit_start", generation = self.commit.generation).entered();
        self.check_writable()?;
        if self.commit.in_flight.is_some() {
            return Err(EngineError::Invalid("a commit is already in flight".into()));
        }
        // Records in flight finish first: the commit truncates the logs they are written to.
        self.drain_log()?;
        // Generations unpin in order: the previous commit's frees go first.
        self.complete_commit();
        let started = Instant::now();
        let generation = self.commit.generation;
        if !self.is_dirty() {
            if !self.mode.is_partitioned() {
                return Ok(false);
            }
            // A partition with nothing to write still moves to N+1 now, with the others: a
            // change made before the coordinator's superblock must belong to N+1, never to
            // an N that is already decided (its fsync would log into a stale generation).
            self.begin_next_generation(CommitInFlight {
                generation,
                roots: Vec::new(),
                blocks: 0,
                started,
                writes: None,
                superblock: None,
                slicing: Vec::new(),
                chunk: Vec::new(),
            });
            return Ok(true);
        }
        self.commit.state = CommitState::CommitStart;
        // Delayed index items join the trees in per-directory batches before anything is
        // serialized.
        self.commit.in_commit = true;
        let flushed = self
            .flush_delayed_index()
            .and_then(|()| self.persist_ino_counters());
        self.commit.in_commit = false;
        if let Err(e) = self.fail_stop_on_error(flushed) {
            self.commit.state = CommitState::Running;
            return Err(e);
        }
        self.commit.state = CommitState::CommitDoing;
        let frozen = self
            .freeze_trees(generation)
            .and_then(|(roots, slicing, staged)| {
                // Staged data goes to the device at once: its blocks are out of the staging
                // map now, and reads of them are answered from the device pipeline from here.
                // With nothing to serialize, it and the flush are the whole commit.
                let count = (crate::blocks::pieces_bytes(&staged) / BLOCK_BYTES) as u64;
                let writes = if slicing.is_empty() {
                    Some(self.submit_record(staged)?)
                } else {
                    if !staged.is_empty() {
                        self.submit_commit_chunk(staged)?;
                    }
                    None
                };
                Ok((roots, slicing, count, writes))
            });
        let (roots, slicing, blocks, writes) = match frozen {
            Ok(w) => w,
            Err(e) => {
                self.failed.get_or_insert(e.clone());
                self.commit.state = CommitState::Running;
                tracing::error!(
                    generation,
                    "commit failed, filesystem is now read-only: {e}"
                );
                return Err(e);
            }
        };
        // N+1 starts: what changes from now on is tracked for its own fsyncs and commit;
        // everything tracked so far is in N.
        self.commit.stats.pause_ns_max = self
            .commit
            .stats
            .pause_ns_max
            .max(started.elapsed().as_nanos() as u64);
        self.begin_next_generation(CommitInFlight {
            generation,
            roots,
            blocks,
            started,
            writes,
            superblock: None,
            slicing,
            chunk: Vec::new(),
        });
        Ok(true)
    }

    /// Serializes one slice of the commit in flight's frozen trees (at most
    /// [`crate::MountOptions::commit_slice_nodes`] nodes) and hands full chunks to the device; after the last
    /// node, the rest goes with the commit's flush. Returns true while slices remain.
    fn commit_slice(&mut self) -> Result<bool> {
        let Some(c) = self.commit.in_flight.as_mut() else {
            return Ok(false);
        };
        let Some(&shard) = c.slicing.first() else {
            return Ok(false);
        };
        // Trace level: a commit runs many slices.
        let _span =
            tracing::trace_span!("commit_slice", generation = c.generation, shard).entered();
        let started = Instant::now();
        let mut out = std::mem::take(&mut c.chunk);
        let mut spare = std::mem::take(&mut self.dev.spare_blocks);
        let tree = &mut self.shards[shard as usize]
            .as_mut()
            .expect("a slicing shard stays held until its commit is written")
            .tree;
        let before = out.len();
        let progress =
            tree.write_frozen(self.options.commit_slice_nodes.max(1), &mut out, &mut spare);
        self.dev.spare_blocks = spare;
        let c = self.commit.in_flight.as_mut().expect("in flight");
        c.blocks += (out.len() - before) as u64;
        if let crate::tree::FrozenProgress::Done(ptr, level) = progress {
            let root = c
                .roots
                .iter_mut()
                .find(|(id, _)| *id == shard)
                .expect("a slicing shard has a root entry");
            root.1.tree = ptr;
            root.1.level = level;
            c.slicing.remove(0);
        }
        let more = !c.slicing.is_empty();
        let result = if !more {
            // The commit's own writes: never held back by the commit in flight, which they
            // are (a record would wait for this commit's superblock: a deadlock).
            self.submit_commit_io(out, false).map(|ticket| {
                self.commit.in_flight.as_mut().expect("in flight").writes = Some(ticket);
            })
        } else if out.len() >= COMMIT_CHUNK_BLOCKS {
            self.submit_commit_chunk(out).map(drop)
        } else {
            self.commit.in_flight.as_mut().expect("in flight").chunk = out;
            Ok(())
        };
        self.commit.stats.slices += 1;
        self.commit.stats.slice_ns_max = self
            .commit
            .stats
            .slice_ns_max
            .max(started.elapsed().as_nanos() as u64);
        result.map(|()| more)
    }

    /// True while the commit in flight has trees left to serialize: CPU work its caller should
    /// come back for soon rather than sleep on the device.
    pub fn commit_slicing(&self) -> bool {
        self.commit
            .in_flight
            .as_ref()
            .is_some_and(|c| !c.slicing.is_empty())
    }

    /// Runs the commit in flight's remaining slices now (before shards leave this engine).
    pub(crate) fn finish_commit_slices(&mut self) -> Result<()> {
        while self.commit_slice()? {}
        Ok(())
    }

    /// N+1 starts while `commit` carries N: what changes from now on is tracked for N+1's
    /// fsyncs and commit (everything tracked so far is in N), and N+1 logs into the other half
    /// of each log area from its start, leaving N's records where a crash before N's
    /// superblock still needs them.
    fn begin_next_generation(&mut self, commit: CommitInFlight) {
        self.commit.generation = commit.generation + 1;
        self.commit.transaction_started = Instant::now();
        self.log.reset_tracking();
        self.log.reset_heads();
        self.commit.in_flight = Some(commit);
    }

    /// The generation whose commit is in flight, if one is.
    pub fn commit_in_flight(&self) -> Option<u64> {
        self.commit.in_flight.as_ref().map(|c| c.generation)
    }

    /// Advances the commit in flight (`wait`: sleep up to that long on the device when nothing
    /// is ready). A whole mount writes the superblock once the trees are durable, and reaches
    /// SuperCommitted when it is; a partition stops at Written (its coordinator writes the
    /// superblock, then [`Filesystem::commit_finish`]). A device error fails the commit and
    /// the filesystem stops (read-only).
    pub fn commit_progress(&mut self, wait: Option<Duration>) -> Result<CommitProgress> {
        let Some(c) = &self.commit.in_flight else {
            return Ok(CommitProgress::Idle);
        };
        let generation = c.generation;
        // The trees' serialization goes first, a slice per call; the device is only polled
        // meanwhile (a wait would hold the caller with CPU work left).
        // The last generation's change tracking goes a piece per call.
        self.log.drop_retired(RETIRED_DROP_STEP);
        let slicing = match self.commit_slice() {
            Ok(more) => more,
            Err(e) => {
                self.commit.in_flight = None;
                self.commit.state = CommitState::Running;
                self.failed.get_or_insert(e.clone());
                tracing::error!(
                    generation,
                    "commit failed, filesystem is now read-only: {e}"
                );
                return Err(e);
            }
        };
        let wait = if slicing { None } else { wait };
        let c = self.commit.in_flight.as_ref().expect("in flight");
        let (writes, superblock) = (c.writes, c.superblock.as_ref().map(|(_, t)| *t));
        let durable_below = match self.log_progress(wait) {
            Ok(d) => d,
            Err(e) => {
                // Abandoned: the filesystem is fail-stop, the durable state is N-1.
                self.commit.in_flight = None;
                self.commit.state = CommitState::Running;
                tracing::error!(
                    generation,
                    "commit failed, filesystem is now read-only: {e}"
                );
                return Err(e);
            }
        };
        let _ = durable_below;
        if slicing {
            return Ok(CommitProgress::Writing);
        }
        // None: nothing was written here (a partition moving to N+1 with the others).
        if writes.is_some_and(|w| !self.ticket_done(w)) {
            return Ok(CommitProgress::Writing);
        }
        if self.mode.is_partitioned() {
            self.commit.state = CommitState::Unblocked;
            return Ok(CommitProgress::Written);
        }
        match superblock {
            None => {
                self.commit.state = CommitState::Unblocked;
                let c = self.commit.in_flight.as_ref().expect("in flight");
                let mut sb = Superblock {
                    generation: c.generation,
                    ..self.sb.clone()
                };
                for &(id, root) in &c.roots {
                    sb.shards[id as usize] = root;
                }
                // One FUA write (the trees' flush completed before it), into the copy the
                // previous generation does not use.
                let copy = SUPERBLOCK_ADDRS[(c.generation % 2) as usize];
                let _span =
                    tracing::debug_span!("super_write", generation = c.generation, copy).entered();
                let ticket = self.submit_commit_io(vec![(copy, sb.encode().into())], true)?;
                self.commit
                    .in_flight
                    .as_mut()
                    .expect("in flight")
                    .superblock = Some((sb, ticket));
                Ok(CommitProgress::Writing)
            }
            Some(ticket) if self.ticket_done(ticket) => {
                let c = self.commit.in_flight.as_ref().expect("in flight");
                let sb = c.superblock.as_ref().expect("written").0.clone();
                self.commit_finish(&sb);
                Ok(CommitProgress::SuperCommitted(sb.generation))
            }
            Some(_) => Ok(CommitProgress::Writing),
        }
    }

    /// A partition's half of a coordinated commit, waited for: started, written and flushed.
    /// Returns its shards' new roots, or None when it had nothing to write (it still takes
    /// [`Filesystem::commit_finish`]).
    pub fn commit_write(&mut self) -> Result<Option<CommitWritten>> {
        if !self.commit_start()? {
            return Ok(None);
        }
        self.finish_commit_in_flight()?;
        Ok(self.commit_written())
    }

    /// The roots of the commit in flight (a partition's half for its coordinator).
    pub fn commit_written(&self) -> Option<CommitWritten> {
        self.commit.in_flight.as_ref().map(|c| CommitWritten {
            generation: c.generation,
            roots: c.roots.clone(),
            blocks: c.blocks,
            started: c.started,
        })
    }

    /// Takes the staged data and freezes every held shard's dirty nodes as `generation`'s
    /// (after writing its space bitmap into its tree until that changes it no more). Returns
    /// the held shards' roots (final for shards with nothing frozen; the others' are filled
    /// by the last slice), the shards left to serialize, and the staged data's blocks.
    #[allow(clippy::type_complexity)]
    fn freeze_trees(
        &mut self,
        generation: u64,
    ) -> Result<(Vec<(u32, ShardRoot)>, Vec<u32>, Vec<(u64, bytes::Bytes)>)> {
        let staged = self.take_all_staged();
        let mut roots = Vec::with_capacity(self.shards.len());
        let mut slicing = Vec::new();
        for (id, held) in self.shards.iter_mut().enumerate() {
            let Some(Shard {
                tree,
                space,
                inodes,
            }) = held.as_mut()
            else {
                continue;
            };
            let inodes = *inodes;
            let mut io = ShardIo {
                dev: &mut *self.dev,
                space,
                generation,
                for_commit: true,
                commit_floor: 0,
                fetch: None,
                // Before the commit is in flight: nothing serialized yet.
                unsubmitted: &[],
            };
            // Groups emptied give themselves back now, before any bitmap item is written (none
            // of those may land in a group leaving); they reach the pool once this generation
            // is durable ([`crate::space`]). Every tree change of the fixpoint first checks
            // that its worst case is free: that much stays.
            let tree_op_blocks = 2 * (tree.level() as u64 + 1) + 2;
            io.space
                .release_empty_groups(generation, 2 * tree_op_blocks);
            // Persist the space bitmap until writing it changes it no more.
            let mut rounds = 0;
            loop {
                #[cfg(feature = "mutations")]
                let dropped: Vec<u64> =
                    if crate::mutation::active(crate::mutation::Mutation::DropGroupOwnership) {
                        io.space
                            .groups()
                            .filter(|&g| io.space.is_new_group(g))
                            .collect()
                    } else {
                        Vec::new()
                    };
                let changes = io.space.take_dirty();
                if changes.is_empty() {
                    break;
                }
                rounds += 1;
                assert!(rounds <= 16, "space bitmap fixpoint did not converge");
                for chunk in changes.legacy_chunks {
                    tree.remove(
                        &mut io,
                        &Key::new(SPACE_OBJECTID, ItemKind::SpaceBitmap, chunk),
                    )?;
                }
                for group in changes.removed {
                    tree.remove(
                        &mut io,
                        &Key::new(SPACE_OBJECTID, ItemKind::GroupBitmap, group),
                    )?;
                }
                for (group, bytes) in changes.items {
                    #[cfg(feature = "mutations")]
                    if dropped.contains(&group) {
                        // The mutation: the group's new owner is never recorded.
                        continue;
                    }
                    tree.insert(
                        &mut io,
                        Key::new(SPACE_OBJECTID, ItemKind::GroupBitmap, group),
                        bytes,
                    )?;
                }
            }
            self.commit.stats.bitmap_fixpoint_rounds_max =
                self.commit.stats.bitmap_fixpoint_rounds_max.max(rounds);
            // What the superblock records of the shard is as of now; the tree's root comes
            // when its frozen nodes are written.
            let used_blocks = io.space.allocated_blocks();
            let groups = io.space.owned_groups();
            let (ptr, level) = if tree.freeze(generation) {
                slicing.push(id as u32);
                (BlockPtr::default(), 0)
            } else {
                tree.write_dirty(generation, &mut Vec::new(), &mut Vec::new())
            };
            roots.push((
                id as u32,
                ShardRoot {
                    tree: ptr,
                    level,
                    used_blocks,
                    inodes,
                    groups,
                },
            ));
        }
        Ok((roots, slicing, staged))
    }

    /// The second half, run once for the whole filesystem (by the coordinator of partitions):
    /// flushes what every partition wrote, then writes the superblock naming the new roots
    /// (`roots` replace the last durable superblock's, shard by shard) with FUA, into the copy
    /// the previous generation does not use. Returns the superblock now durable. A device
    /// error is returned (the caller makes every partition fail-stop).
    pub fn write_super(&mut self, roots: &[(u32, ShardRoot)]) -> Result<Superblock> {
        let generation = self.commit.generation;
        let _span = tracing::debug_span!("write_super", generation, shards = roots.len()).entered();
        nvme::flush_sync(&mut *self.dev)?;
        self.commit.state = CommitState::Unblocked;
        let mut sb = Superblock {
            generation,
            ..self.sb.clone()
        };
        for &(id, root) in roots {
            sb.shards[id as usize] = root;
        }
        let copy = SUPERBLOCK_ADDRS[(generation % 2) as usize];
        let lba = block_lba(&*self.dev, copy);
        nvme::write_sync(&mut *self.dev, lba, &sb.encode(), true)?;
        Ok(sb)
    }

    /// SuperCommitted for the shards held here: `sb` is durable. The commit in flight (or,
    /// for a partition that had nothing to write, the running transaction) becomes durable:
    /// the next generation runs, the logs start over, and the frees wait for
    /// [`Filesystem::complete_commit`].
    pub fn commit_finish(&mut self, sb: &Superblock) {
        let (started, blocks) = match self.commit.in_flight.take() {
            Some(c) => {
                assert_eq!(c.generation, sb.generation, "commit of another generation");
                (c.started, c.blocks)
            }
            None => {
                assert_eq!(
                    sb.generation, self.commit.generation,
                    "commit of another generation"
                );
                // Nothing was written here: this partition moves to the next generation now.
                self.commit.generation = sb.generation + 1;
                self.commit.transaction_started = Instant::now();
                self.log.reset_tracking();
                self.log.reset_heads();
                (Instant::now(), 0)
            }
        };
        self.sb = sb.clone();
        self.commit.state = CommitState::SuperCommitted;
        // Everything N logged is now in its trees: its half of the log is stale (N+1 has
        // been logging into the other half since the commit started).
        let ns = started.elapsed().as_nanos() as u64;
        // Waiters may go now; unpinning waits for complete_commit.
        self.commit.unpin_pending = Some(sb.generation);
        self.commit.stats.commits += 1;
        self.commit.stats.commit_ns_total += ns;
        self.commit.stats.commit_ns_max = self.commit.stats.commit_ns_max.max(ns);
        self.commit.stats.last_commit_ns = ns;
        self.commit.stats.last_super_commit_ns = ns;
        self.commit.stats.blocks_written += blocks + 1;
        tracing::debug!(
            generation = sb.generation,
            blocks,
            commit_us = ns / 1000,
            "super-committed"
        );
    }

    /// Completes the last commit after its waiters were released: unpins the blocks it freed
    /// (they may be reused from now on) and trims the metadata cache. Returns the blocks
    /// unpinned; a no-op when nothing is pending.
    pub fn complete_commit(&mut self) -> u64 {
        // What the commit's progress calls left of the last tracking goes now, bounded too.
        self.log.drop_retired(RETIRED_DROP_STEP);
        let Some(generation) = self.commit.unpin_pending else {
            return 0;
        };
        // A read in flight may have been planned against a block this generation freed.
        self.finish_reads_through(generation);
        self.commit.unpin_pending = None;
        let started = Instant::now();
        let mut unpinned = 0;
        for shard in self.shards.iter_mut().flatten() {
            unpinned += shard.space.unpin(generation);
        }
        self.trim_cache();
        self.commit.state = CommitState::Completed;
        self.commit.stats.last_unpinned_blocks = unpinned;
        self.commit.stats.last_unpin_ns = started.elapsed().as_nanos() as u64;
        self.commit.state = CommitState::Running;
        unpinned
    }
}
