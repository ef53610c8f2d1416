//! fsync and fdatasync on the whole filesystem: choosing what a record must carry (the
//! closure of name-coupled inodes and unlogged ancestors, and which of them go by name
//! alone), collecting their changed keys and staged data, and submitting the record, or
//! falling back to a commit when correctness demands it.
//!
//! Layering: change tracking and the log heads live in [`super::LogState`] and the record
//! format in [`super::record`], neither naming [`Filesystem`]; the device pipeline that
//! writes records is [`super::inflight`] and replay is [`super::replay`]. [`super`] states
//! the invariants and the fault model.

use super::record::{encode_record, record_blocks, LogOp, RecordHeader};
use super::{
    record_and_data, CarriedData, FsyncStart, LogStats, EMBED_MAX_BLOCKS, LENT_FSYNC_BYTES_MAX,
};
use crate::error::{EngineError, Result};
use crate::format::items::encode_names;
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use crate::fs::Filesystem;
use crate::inode::{S_IFMT, S_IFREG};
use std::collections::{BTreeSet, HashSet};

impl Filesystem {
    /// fsync: makes the inode's data and metadata durable, and its names and the path to it.
    /// Writes one log record and flushes, or nothing when nothing changed since the inode was
    /// last logged; commits instead only when the record does not fit the log.
    pub fn fsync(&mut self, ino: u64) -> Result<()> {
        self.check_exists(ino)?;
        self.fsync_group(&[(ino, false)])
    }

    /// fdatasync: as [`Filesystem::fsync`], except that an inode whose only change since it was
    /// last logged is its timestamps is not logged at all.
    pub fn fdatasync(&mut self, ino: u64) -> Result<()> {
        self.check_exists(ino)?;
        self.fsync_group(&[(ino, true)])
    }

    /// An fsync of an inode that does not exist is an error (a stale handle), not a no-op,
    /// unless its last name went in this transaction: then logging it persists the removal.
    pub fn check_exists(&mut self, ino: u64) -> Result<()> {
        match self.load_inode(ino) {
            Err(EngineError::NotFound) if self.log.inodes.contains_key(&ino) => Ok(()),
            other => other.map(drop),
        }
    }

    /// Several fsyncs (`(ino, datasync)`) made durable by one record and one flush: what a
    /// reactor does with the fsyncs that arrive while it is busy. Callers check each inode
    /// when its fsync arrives ([`Filesystem::check_exists`]); a member removed since, whose
    /// removal is already durable or logged, has nothing left to persist and is skipped.
    pub fn fsync_group(&mut self, group: &[(u64, bool)]) -> Result<()> {
        match self.fsync_group_start(group)? {
            FsyncStart::Durable => Ok(()),
            FsyncStart::Pending(ticket) => self.wait_durable(ticket),
            FsyncStart::NeedsCommit => self.commit_to_super().map(drop),
            // The commit first: the record counts only after it.
            FsyncStart::AfterCommit { ticket, .. } => {
                self.finish_commit_in_flight()?;
                match ticket {
                    Some(ticket) => self.wait_durable(ticket),
                    None => Ok(()),
                }
            }
        }
    }

    /// The fallback: a commit here, or, in a partition, the owner's coordinated commit. A
    /// lent engine ([`Filesystem::fsync_beside`]) commits nothing: the owner runs the fsync.
    fn fsync_fallback(&mut self) -> Result<FsyncStart> {
        if self.mode.is_partitioned() || self.commit.deferred || self.dev.lent_for_writes() {
            Ok(FsyncStart::NeedsCommit)
        } else {
            self.commit_to_super().map(|_| FsyncStart::Durable)
        }
    }

    /// [`Filesystem::fsync_group`] without waiting: the record's writes and flush are started
    /// in the background ([`inflight`](super::inflight)) and the group is durable once
    /// [`Filesystem::log_progress`] passes the returned ticket. The engine serves other
    /// operations meanwhile; a reactor releases the group's waiters then. A group with
    /// nothing new to log still waits for the newest record in flight, which may hold its
    /// changes.
    pub fn fsync_group_start(&mut self, group: &[(u64, bool)]) -> Result<FsyncStart> {
        self.check_writable()?;
        // While a commit (N) is in flight this logs for N+1 into the other half of the log
        // area; such a record counts only once N is durable too, which the caller waits for
        // (`FsyncStart::Pending` names the generation).
        self.log.stats.fsyncs += group.len() as u64;
        let mut wanted = Vec::with_capacity(group.len());
        for &(ino, _) in group {
            // A directory's new files carried by name alone come whole with its fsync. Looked
            // up, not taken: an fsync that returns without a record (a commit instead, or one
            // a lent engine leaves to its owner) must find them again.
            for &child in self.log.named_only_in.get(&ino).into_iter().flatten() {
                if self.log.inodes.get(&child).is_some_and(|t| t.born) && !wanted.contains(&child) {
                    wanted.push(child);
                }
            }
        }
        for &(ino, datasync) in group {
            let pending = self
                .log
                .inodes
                .get(&ino)
                .is_some_and(|t| !datasync || t.data || !t.links.is_empty());
            if self.log.relog_suppressed(ino) {
                self.log.stats.already_logged += 1;
            } else if pending || self.ancestor_pending(ino)? {
                wanted.push(ino);
            } else {
                self.log.stats.already_logged += 1;
            }
        }
        if wanted.is_empty() {
            // What it changed is in the commit in flight, or in a record logged for N+1 since
            // that commit started. The ticket named is the newest such record, which is
            // released only once the commit is durable; never the newest ticket of any kind:
            // that may be one of the commit's own chunks (or a write-back), durable long
            // before the superblock, and a reactor releasing the group there acknowledged an
            // fsync whose changes a power cut still lost (the file created just before).
            if let Some(generation) = self.commit_in_flight() {
                return Ok(FsyncStart::AfterCommit {
                    ticket: self.newest_in_flight_after(generation),
                    generation,
                });
            }
            return Ok(match self.newest_in_flight() {
                Some(ticket) => FsyncStart::Pending(ticket),
                None => FsyncStart::Durable,
            });
        }
        let Some(members) = self.log_closure(&wanted)? else {
            self.log.stats.fallback_cross += 1;
            tracing::debug!("fsync reaches a change spanning partitions: committing");
            return self.fsync_fallback();
        };
        let named_only = self.named_only_members(&members, &wanted)?;
        let mut ops = self.collect_ops(&members, &named_only)?;
        // A small fsync carries the staged data its extents reference inside the record, so
        // the record is its only write; a large one writes the members' data in place, in the
        // same batch as the record.
        let embedded = self.staged_data_ops(&ops)?;
        let embedding = embedded.is_some();
        if !embedding
            && self.dev.lent_for_writes()
            && members
                .difference(&named_only)
                .map(|&ino| self.staged_bytes_of(ino))
                .sum::<usize>()
                > LENT_FSYNC_BYTES_MAX
        {
            // Too much to write in a caller's thread while the reactor waits for its engine.
            return Ok(FsyncStart::NeedsCommit);
        }
        let (data_ops, carried_runs) = embedded.unwrap_or_default();
        ops.extend(data_ops);
        // Any log held here will do (a record's ops name their own shards, and replay reads
        // every log in sequence order): the emptiest one, so one busy file spreads its records
        // over every shard's log instead of filling its own and forcing a commit (SQLite's WAL
        // on 64 shards committed every 28 transactions).
        let shard = self.emptiest_log();
        let blocks = record_blocks(ops.iter());
        let log_blocks = self.sb.log_half_blocks();
        if blocks > log_blocks {
            self.log.stats.fallback_too_big += 1;
            tracing::debug!(
                blocks,
                log_blocks,
                "fsync record larger than the log: committing"
            );
            return self.fsync_fallback();
        }
        if self.log.heads[shard as usize] + blocks > log_blocks {
            self.log.stats.fallback_log_full += 1;
            tracing::debug!(shard, "fsync log full: committing");
            return self.fsync_fallback();
        }
        let header = RecordHeader {
            blocks: 0,
            generation: self.commit.generation,
            global_seq: self.log.next_seq,
            shard_seq: self.log.shard_seqs[shard as usize],
            shard,
            stream: self.log.stream,
            op_count: 0,
            payload_bytes: 0,
            uuid: self.sb.uuid,
        };
        let bytes = encode_record(header, &ops);
        assert_eq!(bytes.len() as u64, blocks * BLOCK_BYTES as u64);
        let at = self.sb.log_start(shard, self.commit.generation) + self.log.heads[shard as usize];
        // Otherwise the members' staged data goes in place, in flight together with the
        // record. Embedded blocks stay staged for the commit.
        let data = if embedding {
            Vec::new()
        } else {
            self.take_staged(members.difference(&named_only))
        };
        // How the writes become durable. A record that carries all its data is its only
        // write: written FUA it is durable when it completes — one device write per fsync, no
        // flush. A record with in-place data goes the same way on a device with native FUA:
        // every write FUA, the ticket durable when all complete (a crash before that leaves a
        // record whose data crcs fail: replay stops there, and its fsync had not returned).
        // Where FUA is emulated (a file: each FUA write is a write and a flush) those writes
        // go plain and one flush follows; so does any record when a data block was written in
        // place since the last flush was submitted (only a flush makes that block durable).
        // Records before it are durable first either way (tickets are released in order).
        let all_fua = data.is_empty() || nvme::BlockDevice::info(&*self.dev).fua_native;
        let ticket = if all_fua && !self.log.unflushed_writes {
            self.log.stats.fua_records += 1;
            self.submit_fua(record_and_data(at, bytes, data))?
        } else {
            self.submit_record(record_and_data(at, bytes, data))?
        };
        // The runs this record carries whole need not be carried again in this generation.
        self.mark_logged(&carried_runs);
        // Logged (durable once the ticket is): the coupled set's tracking starts over. Until
        // then an fsync finding nothing new waits for the newest ticket, so it cannot return
        // before the record holding its changes is durable.
        for ino in &members {
            if named_only.contains(ino) {
                // Its names are logged, its content is not: it stays tracked (and born), no
                // longer coupled to the directories just logged whole, each of which brings
                // it whole with its own fsync.
                if let Some(t) = self.log.inodes.get_mut(ino) {
                    for dir in std::mem::take(&mut t.links).iter() {
                        self.log.named_only_in.entry(*dir).or_default().push(*ino);
                    }
                }
                continue;
            }
            if let Some(t) = self.log.inodes.remove(ino) {
                self.log.tracked_keys -= t.keys.len();
            }
            #[cfg(feature = "mutations")]
            self.log.logged_this_generation.insert(*ino);
        }
        for (ino, _) in group {
            self.log.named_only_in.remove(ino);
        }
        self.log.heads[shard as usize] += blocks;
        self.log.shard_seqs[shard as usize] += 1;
        self.log.next_seq += 1;
        self.log.stats.log_writes += 1;
        self.log.stats.log_blocks += blocks;
        self.log.stats.inodes_logged += members.len() as u64;
        self.log.stats.inodes_named_only += named_only.len() as u64;
        Ok(match self.commit_in_flight() {
            Some(generation) => {
                assert_eq!(
                    self.newest_in_flight_after(generation),
                    Some(ticket),
                    "a record logged during commit {generation} waits for it"
                );
                FsyncStart::AfterCommit {
                    ticket: Some(ticket),
                    generation,
                }
            }
            None => FsyncStart::Pending(ticket),
        })
    }

    pub fn log_stats(&self) -> LogStats {
        self.log.stats
    }

    /// Blocks left in the emptiest log half this mount holds: a record larger than this falls
    /// back to a commit (`fallback_log_full`).
    pub fn log_room_blocks(&self) -> u64 {
        let head = self.log.heads[self.emptiest_log() as usize];
        self.sb.log_half_blocks().saturating_sub(head)
    }

    /// The held shard whose log half has the most room.
    fn emptiest_log(&self) -> u32 {
        (0..self.shard_count())
            .filter(|&s| self.holds(s))
            .min_by_key(|&s| self.log.heads[s as usize])
            .expect("a partition that logs holds a shard")
    }

    /// Data ops for every staged block the record's extents reference that no earlier
    /// record of this generation carries, and the staged runs they cover whole (to mark
    /// once the record is on its way); None when there are more than [`EMBED_MAX_BLOCKS`]
    /// (then the data is written in place instead). An extent grown by an append references
    /// its earlier blocks again: those an earlier record carried replay from that record,
    /// which comes first in the stream.
    fn staged_data_ops(&self, ops: &[LogOp]) -> Result<Option<CarriedData>> {
        let mut data = Vec::new();
        let mut whole = Vec::new();
        let mut staged = Vec::new();
        for op in ops {
            let LogOp::Put(key, value) = op else { continue };
            if key.kind != ItemKind::ExtentData {
                continue;
            }
            let item = crate::format::items::ExtentItem::decode(value)
                .map_err(|why| EngineError::corrupt("extent item", key.objectid, why))?;
            if item.prealloc {
                continue;
            }
            staged.clear();
            self.unlogged_staged(
                key.objectid,
                item.disk_block,
                item.blocks as u64,
                &mut staged,
                &mut whole,
            );
            for &(block, bytes) in &staged {
                if data.len() == EMBED_MAX_BLOCKS {
                    return Ok(None);
                }
                data.push(LogOp::Data(block, bytes.to_vec()));
            }
        }
        Ok(Some((data, whole)))
    }

    /// The parents of `ino` (the directories holding its names). In a partition, an inode
    /// held elsewhere ends the walk up: its name and every name above it are durable or were
    /// changed by an operation that marked an inode here ([`crate::partition`]).
    fn parents_of(&mut self, ino: u64) -> Result<Vec<u64>> {
        let shard = self.shard_of(ino);
        if !self.holds(shard) {
            return Ok(Vec::new());
        }
        let refs = self.with_tree(shard, false, |tree, io| {
            tree.range(
                io,
                Key::new(ino, ItemKind::InodeRef, 0),
                Key::new(ino, ItemKind::XattrItem, 0),
            )
        })?;
        let mut parents = Vec::new();
        for (key, value) in refs {
            match key.kind {
                ItemKind::InodeRef => parents.push(key.offset),
                // Names past a full InodeRef item; their directory may have no InodeRef item
                // left once the names there are removed.
                ItemKind::InodeExtRef => parents.extend(
                    crate::format::items::decode_ext_refs(&value)
                        .map_err(|why| {
                            EngineError::corrupt_inode("extended back-reference", ino, why)
                        })?
                        .iter()
                        .map(|e| e.dir()),
                ),
                _ => {}
            }
        }
        parents.sort_unstable();
        parents.dedup();
        Ok(parents)
    }

    /// True when some ancestor of `ino` has an unlogged change of its own name.
    fn ancestor_pending(&mut self, ino: u64) -> Result<bool> {
        let mut seen = HashSet::new();
        let mut stack = self.parents_of(ino)?;
        while let Some(dir) = stack.pop() {
            if !seen.insert(dir) {
                continue;
            }
            if self.log.own_name_changed(dir) {
                return Ok(true);
            }
            if mutated!(AncestorWalkStopsEarly) {
                // Mutation check: stop at the first directory whose own name is durable.
                continue;
            }
            stack.extend(self.parents_of(dir)?);
        }
        Ok(false)
    }

    /// The inodes a record for `inos` must hold: closed under name coupling and reachability
    /// (see the module comment). Only inodes with tracked changes are members. None when the
    /// set reaches an inode changed across partitions (or coupled to one held elsewhere):
    /// only a commit makes that durable atomically.
    fn log_closure(&mut self, inos: &[u64]) -> Result<Option<BTreeSet<u64>>> {
        let mut members = BTreeSet::new();
        let mut walked = HashSet::new();
        let mut stack: Vec<u64> = inos.to_vec();
        while let Some(ino) = stack.pop() {
            if !members.insert(ino) {
                continue;
            }
            if self.log.cross.contains(&ino) || !self.holds(self.shard_of(ino)) {
                return Ok(None);
            }
            if let Some(t) = self.log.inodes.get(&ino) {
                stack.extend(t.links.iter().copied());
            }
            // Walk up from each name's directory; an ancestor whose own name changed joins
            // (with everything coupled to it), and the walk goes on above it either way.
            let mut up = self.parents_of(ino)?;
            while let Some(dir) = up.pop() {
                if !walked.insert(dir) {
                    continue;
                }
                if self.log.own_name_changed(dir) {
                    stack.push(dir);
                } else if mutated!(AncestorWalkStopsEarly) {
                    // Mutation check: stop at the first directory whose own name is durable.
                    continue;
                }
                up.extend(self.parents_of(dir)?);
            }
        }
        members.retain(|ino| self.log.inodes.contains_key(ino) && !self.log.relog_suppressed(*ino));
        Ok(Some(members))
    }

    /// The members a record carries for their names alone: regular files born in this
    /// transaction and never logged whole ([`Tracked::born`](super::Tracked)), still named,
    /// that are in the set only because a directory they are named in is (the fsynced file's
    /// siblings created since the last commit, children of a new ancestor). The fsynced
    /// inodes come whole, and so do the children of an fsynced directory (its new files'
    /// content comes along, docs/durability.md).
    ///
    /// Why: every file created in a directory is coupled to it until logged, so an fsync of
    /// one new file carried every new sibling's data too. dbench's flush of one file in a
    /// directory of eight fresh ones wrote all eight (0.91 ms a record on a file image,
    /// against 0.37 ms for the one file's data). ext4 (delayed allocation) and btrfs
    /// (`LOG_INODE_EXISTS`) persist such a sibling with the size it had on disk, as here.
    fn named_only_members(
        &mut self,
        members: &BTreeSet<u64>,
        wanted: &[u64],
    ) -> Result<BTreeSet<u64>> {
        let mut named_only = BTreeSet::new();
        for &ino in members {
            if wanted.contains(&ino) {
                continue;
            }
            let Some(t) = self.log.inodes.get(&ino) else {
                continue;
            };
            if !t.born || t.links.iter().any(|dir| wanted.contains(dir)) {
                continue;
            }
            match self.load_inode(ino) {
                Ok(item) if item.mode & S_IFMT == S_IFREG && item.nlink > 0 => {
                    named_only.insert(ino);
                }
                Ok(_) | Err(EngineError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(named_only)
    }

    /// The record's ops: each tracked key of each member with its current value (a pending
    /// directory index item counts as present) or its deletion. A member in `named_only`
    /// gives its names and its inode item as born (empty: size 0, no blocks), nothing else:
    /// its extents, xattrs and data wait for a record that logs it whole, or the commit.
    fn collect_ops(
        &mut self,
        members: &BTreeSet<u64>,
        named_only: &BTreeSet<u64>,
    ) -> Result<Vec<LogOp>> {
        let mut ops = Vec::new();
        for &ino in members {
            let keys: Vec<Key> = self.log.inodes[&ino]
                .keys
                .sorted()
                .into_iter()
                .map(|(kind, offset)| Key::new(ino, kind, offset))
                .filter(|key| {
                    !named_only.contains(&ino)
                        || matches!(
                            key.kind,
                            ItemKind::InodeItem | ItemKind::InodeRef | ItemKind::InodeExtRef
                        )
                })
                .collect();
            let shard = self.shard_of(ino);
            for key in keys {
                if key.kind == ItemKind::InodeItem && named_only.contains(&ino) {
                    let mut item = self.load_inode(ino)?;
                    item.size = 0;
                    item.blocks = 0;
                    ops.push(LogOp::Put(key, item.encode()));
                    continue;
                }
                if key.kind == ItemKind::DirIndex {
                    if let Some((_, entry)) = self
                        .namespace
                        .delayed
                        .range(ino, key.offset)
                        .next()
                        .filter(|(s, _)| *s == key.offset)
                    {
                        ops.push(LogOp::Put(key, encode_names(std::slice::from_ref(entry))));
                        continue;
                    }
                }
                let value = self.with_tree(shard, false, |tree, io| tree.get(io, &key))?;
                ops.push(match value {
                    Some(value) => LogOp::Put(key, value),
                    None => LogOp::Delete(key),
                });
            }
        }
        Ok(ops)
    }
}
