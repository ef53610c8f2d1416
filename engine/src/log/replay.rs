//! Log replay at mount: the records written after the last super-commit are validated, applied
//! to the trees in sequence order, and committed.
//!
//! # Invariants
//! - Only records of generation durable + 1 with this filesystem's uuid are read, each shard's
//!   in shard-sequence order from the head of its area; across shards they apply in their
//!   stream's sequence order, and the first missing sequence ends that stream's replay (a later
//!   record may depend on it). Streams are independent: a partition writes its own stream
//!   about inodes it alone holds, and anything spanning partitions is committed, never logged
//!   ([`crate::partition`]).
//! - A record applies only if its crc and the crc32c of every data block it references match,
//!   and its ops are ones the engine writes (inode items only, values that decode, extents
//!   and data inside the data regions); the first that fails, and everything after it, is
//!   dropped (its fsync never returned, or the record is not the engine's).
//! - Space is rebuilt from the extents the records changed: blocks the final extents reference
//!   are allocated, blocks only earlier values referenced are freed pinned until the replay's
//!   commit is durable, so a crash during replay finds every block a record references as it
//!   was, and replays again to the same result (idempotent).
//! - Inode counters are advanced past every inode a record created.
//!
//! Fault model: a device error or a corrupt durable tree fails the mount with the error; a
//! torn, stale or garbage record ends the replay at that record, with a log line.

use super::record::{decode_header, decode_record, LogOp};
use crate::blocks::{block_lba, read_block};
use crate::error::{EngineError, Result};
use crate::format::items::{
    decode_ext_refs, decode_names, decode_xattrs, ExtentItem, InodeItem, MAX_INO,
};
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use crate::fs::{Filesystem, FIRST_INODE};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A validated record.
struct Found {
    stream: u32,
    global_seq: u64,
    shard: u32,
    ops: Vec<LogOp>,
}

impl Filesystem {
    /// Replays the logs, if any record is current; then commits. Returns the records applied.
    pub(crate) fn replay_logs(&mut self) -> Result<u64> {
        let _span = tracing::debug_span!("replay_logs", shards = self.shard_count()).entered();
        let mut found = Vec::new();
        for shard in 0..self.shard_count() {
            self.read_log(shard, &mut found)?;
        }
        if found.is_empty() {
            return Ok(0);
        }
        found.sort_by_key(|f| (f.stream, f.global_seq));
        let mut accepted = Vec::new();
        // Data blocks carried by the accepted records (and the one being checked): they are
        // checked against these bytes, and written in place by the replay.
        let mut embedded: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut expected = 0u64;
        let mut stream = None;
        let mut stream_ended = false;
        for record in found {
            if stream != Some(record.stream) {
                stream = Some(record.stream);
                expected = 0;
                stream_ended = false;
            }
            if stream_ended {
                continue;
            }
            if record.global_seq != expected && mutated!(ReplayPastGap) {
                // Mutation check: carry on past the missing record.
                expected = record.global_seq;
            }
            expected += 1;
            let expected = expected - 1;
            if record.global_seq != expected {
                tracing::warn!(
                    "fsync log: stream {} record {expected} is missing; later records of the \
                     stream are not replayed",
                    record.stream
                );
                stream_ended = true;
                continue;
            }
            if let Some(why) = self.invalid_ops(&record.ops) {
                tracing::warn!(
                    "fsync log: record {expected} (stream {}, shard {}) is intact but \
                     impossible ({why}); it and later records of the stream are not replayed",
                    record.stream,
                    record.shard
                );
                stream_ended = true;
                continue;
            }
            let mut carried = embedded.clone();
            for op in &record.ops {
                if let LogOp::Data(block, bytes) = op {
                    carried.insert(*block, bytes.clone());
                }
            }
            if let Some(why) = self.data_mismatch(&record.ops, &carried)? {
                if mutated!(ReplayPastGap) {
                    // Mutation check: drop this record and apply the later ones anyway.
                    continue;
                }
                tracing::warn!(
                    "fsync log: record {expected} (stream {}, shard {}) references data that \
                     is not on the device ({why}); it and later records of the stream are not \
                     replayed",
                    record.stream,
                    record.shard
                );
                stream_ended = true;
                continue;
            }
            embedded = carried;
            accepted.push(record);
        }
        if accepted.is_empty() {
            return Ok(0);
        }
        let count = accepted.len() as u64;
        let applied = self.apply_records(&accepted, embedded);
        self.fail_stop_on_error(applied)?;
        // The replayed state must be durable before any new record is written: new records
        // start at the head of the log areas, over the ones replayed here.
        if !mutated!(ReplayNotCommitted) {
            self.commit()?;
        }
        self.log.stats.replayed_records += count;
        tracing::info!(
            records = count,
            generation = self.sb.generation,
            "fsync log replayed"
        );
        Ok(count)
    }

    /// Reads shard `shard`'s current records, in order, until the first that is not.
    fn read_log(&mut self, shard: u32, out: &mut Vec<Found>) -> Result<()> {
        // The records of generation durable + 1 are in its half of the log area.
        let start = self.sb.log_start(shard, self.commit.generation);
        let (log_blocks, generation, uuid) = (
            self.sb.log_half_blocks(),
            self.commit.generation,
            self.sb.uuid,
        );
        let mut head = 0u64;
        let mut shard_seq = 0u64;
        while head < log_blocks {
            let first = read_block(&mut *self.dev, start + head)?;
            let Ok(header) = decode_header(&first) else {
                break;
            };
            if header.generation != generation
                || header.uuid != uuid
                || header.shard != shard
                || header.shard_seq != shard_seq
                || head + header.blocks as u64 > log_blocks
            {
                break;
            }
            let mut bytes = first;
            if header.blocks > 1 {
                let mut rest = vec![0u8; (header.blocks as usize - 1) * BLOCK_BYTES];
                let lba = block_lba(&*self.dev, start + head + 1);
                nvme::read_sync(&mut *self.dev, lba, &mut rest)?;
                bytes.extend_from_slice(&rest);
            }
            match decode_record(&bytes) {
                Ok((header, ops)) => out.push(Found {
                    stream: header.stream,
                    global_seq: header.global_seq,
                    shard,
                    ops,
                }),
                Err(why) => {
                    tracing::warn!("fsync log of shard {shard}: record {shard_seq} is torn: {why}");
                    break;
                }
            }
            head += header.blocks as u64;
            shard_seq += 1;
        }
        Ok(())
    }

    /// Why a record's ops could not have been written by the engine, if they could not: a
    /// change to an engine item or to a kind the log never carries, an inode number past
    /// [`MAX_INO`], a value its kind does not decode, an extent outside its inode's shard
    /// region, a data op for a block outside every shard's data region. Checked before the
    /// record is accepted, so a checksum-valid but malformed record ends the replay like a
    /// torn one instead of reaching the trees and the allocator.
    fn invalid_ops(&self, ops: &[LogOp]) -> Option<String> {
        for op in ops {
            let (key, value) = match op {
                LogOp::Put(key, value) => (key, Some(value)),
                LogOp::Delete(key) => (key, None),
                LogOp::Data(block, _) => {
                    if self.pool.geometry().group_of(*block).is_none() {
                        return Some(format!("data for block {block}, outside the block groups"));
                    }
                    continue;
                }
            };
            let ino = key.objectid;
            if !(FIRST_INODE..=MAX_INO).contains(&ino) {
                return Some(format!("a change to {key:?}, not an inode's item"));
            }
            let Some(value) = value else { continue };
            let decoded = match key.kind {
                ItemKind::InodeItem if key.offset == 0 => InodeItem::decode(value).map(drop),
                ItemKind::InodeRef | ItemKind::DirItem | ItemKind::DirIndex => {
                    decode_names(value).map(drop)
                }
                ItemKind::InodeExtRef => decode_ext_refs(value).map(drop),
                ItemKind::XattrItem => decode_xattrs(value).map(drop),
                ItemKind::SymlinkTarget | ItemKind::XattrValue if !value.is_empty() => Ok(()),
                ItemKind::OrphanMark if key.offset == 0 => Ok(()),
                ItemKind::ExtentData if key.offset % BLOCK_BYTES as u64 == 0 => {
                    ExtentItem::decode(value)
                        .and_then(|item| self.placeable(ino, item.disk_block, item.blocks as u64))
                }
                _ => Err("a kind or place the log never writes".into()),
            };
            if let Err(why) = decoded {
                return Some(format!("{key:?}: {why}"));
            }
        }
        None
    }

    /// Why inode `ino`'s extent could not lie at blocks `addr..addr + len`, if it could
    /// not: outside the block groups, or in a group another shard owns. A group no shard
    /// owns in the durable state is one the inode's shard took in the running transaction
    /// (a group given back reaches the pool only once that is durable, [`crate::space`]).
    fn placeable(&self, ino: u64, addr: u64, len: u64) -> std::result::Result<(), String> {
        let geo = self.pool.geometry();
        if !geo.in_data_area(addr, len) {
            return Err(format!("blocks {addr}+{len} outside the block groups"));
        }
        let shard = self.shard_of(ino);
        let (first, last) = (
            geo.group_of(addr).expect("in the data area"),
            geo.group_of(addr + len - 1).expect("in the data area"),
        );
        for group in first..=last {
            if let Some(owner) = self.pool.owner_of(group).filter(|&o| o != shard) {
                return Err(format!(
                    "blocks {addr}+{len} of shard {shard}'s inode in group {group}, which shard \
                     {owner} owns"
                ));
            }
        }
        Ok(())
    }

    /// Why a record's data is not what it says, if it is not: checks the crc32c of every block
    /// its extents reference, in `embedded` (carried by a record) or else on the device.
    fn data_mismatch(
        &mut self,
        ops: &[LogOp],
        embedded: &HashMap<u64, Vec<u8>>,
    ) -> Result<Option<String>> {
        for op in ops {
            let LogOp::Put(key, value) = op else { continue };
            if key.kind != ItemKind::ExtentData {
                continue;
            }
            let item = ExtentItem::decode(value)
                .map_err(|why| EngineError::corrupt("logged extent", key.objectid, why))?;
            if item.prealloc {
                continue;
            }
            let mut data = vec![0u8; item.blocks as usize * BLOCK_BYTES];
            self.check_in_region(key.objectid, item.disk_block, item.blocks as u64)?;
            let all_embedded =
                (0..item.blocks as u64).all(|i| embedded.contains_key(&(item.disk_block + i)));
            if !all_embedded {
                let lba = block_lba(&*self.dev, item.disk_block);
                nvme::read_sync(&mut *self.dev, lba, &mut data)?;
            }
            for (i, chunk) in data.chunks_mut(BLOCK_BYTES).enumerate() {
                if let Some(bytes) = embedded.get(&(item.disk_block + i as u64)) {
                    chunk.copy_from_slice(bytes);
                }
            }
            for (i, block) in data.chunks(BLOCK_BYTES).enumerate() {
                if crc32c::crc32c(block) != item.crcs[i] {
                    return Ok(Some(format!(
                        "inode {} block {}",
                        key.objectid,
                        item.disk_block + i as u64
                    )));
                }
            }
        }
        Ok(None)
    }

    fn check_in_region(&self, ino: u64, disk_block: u64, blocks: u64) -> Result<()> {
        self.placeable(ino, disk_block, blocks)
            .map_err(|why| EngineError::corrupt("logged extent", ino, why))
    }

    /// The data blocks the extent at `key` references now, with the shard whose groups hold
    /// them; they must be allocated (replay frees those no extent references afterwards).
    fn extent_blocks(&mut self, key: &Key, out: &mut BTreeMap<u64, u32>) -> Result<()> {
        let shard = self.shard_of(key.objectid);
        if let Some(value) = self.with_tree(shard, false, |tree, io| tree.get(io, key))? {
            let item = ExtentItem::decode(&value)
                .map_err(|why| EngineError::corrupt_inode("extent item", key.objectid, why))?;
            self.shard_mut(shard)
                .space
                .check_allocated(item.disk_block, item.blocks as u64)
                .map_err(|why| EngineError::corrupt_inode("extent item", key.objectid, why))?;
            out.extend((item.disk_block..item.disk_block + item.blocks as u64).map(|b| (b, shard)));
        }
        Ok(())
    }

    fn apply_records(&mut self, records: &[Found], embedded: HashMap<u64, Vec<u8>>) -> Result<()> {
        let extent_keys: BTreeSet<Key> = records
            .iter()
            .flat_map(|r| r.ops.iter().filter_map(LogOp::key))
            .filter(|k| k.kind == ItemKind::ExtentData)
            .copied()
            .collect();
        // Blocks the durable extents of the changed keys hold, and blocks the records'
        // extents reference: the latter are claimed before any tree change allocates, so no
        // node lands on a block a record still needs.
        let mut before = BTreeMap::new();
        for key in &extent_keys {
            self.extent_blocks(key, &mut before)?;
        }
        let mut referenced = BTreeMap::new();
        for op in records.iter().flat_map(|r| r.ops.iter()) {
            if let LogOp::Put(key, value) = op {
                if key.objectid < FIRST_INODE {
                    return Err(EngineError::corrupt(
                        "fsync log",
                        key.objectid,
                        "a record changes an engine item",
                    ));
                }
                if key.kind == ItemKind::ExtentData {
                    let item = ExtentItem::decode(value)
                        .map_err(|why| EngineError::corrupt("logged extent", key.objectid, why))?;
                    self.check_in_region(key.objectid, item.disk_block, item.blocks as u64)?;
                    let shard = self.shard_of(key.objectid);
                    referenced.extend(
                        (item.disk_block..item.disk_block + item.blocks as u64).map(|b| (b, shard)),
                    );
                }
            }
        }
        let mut claimed = BTreeMap::new();
        for (&block, &shard) in &referenced {
            if before.contains_key(&block) {
                continue;
            }
            let space = &mut self.shard_mut(shard).space;
            if let Err(why) = space.check_claimable(block) {
                return Err(EngineError::corrupt(
                    "fsync log",
                    block,
                    format!("a logged extent references a block it cannot have: {why}"),
                ));
            }
            space.claim(block);
            claimed.insert(block, shard);
        }
        // Carried data goes to its place now; the replay's commit flushes it before its
        // superblock. Only blocks a logged extent references are written.
        let carried: Vec<(u64, bytes::Bytes)> = embedded
            .into_iter()
            .filter(|(block, _)| referenced.contains_key(block))
            .map(|(block, data)| (block, data.into()))
            .collect();
        crate::blocks::write_blocks(&mut *self.dev, carried)?;
        let mut created: BTreeMap<u32, u64> = BTreeMap::new();
        for op in records.iter().flat_map(|r| r.ops.iter()) {
            let Some(&key) = op.key() else { continue };
            let shard = self.shard_of(key.objectid);
            self.log.stats.replayed_ops += 1;
            // An orphan mark brings its index item along (the index is not logged: it is
            // where mount finds orphans, and follows the marks).
            let index = crate::inode::orphan_index_key(key.objectid);
            match op {
                LogOp::Put(key, value) => {
                    let value = value.clone();
                    let previous =
                        self.with_tree(shard, true, |tree, io| tree.insert(io, *key, value))?;
                    if key.kind == ItemKind::InodeItem {
                        let top = created.entry(shard).or_default();
                        *top = (*top).max(key.objectid);
                        if previous.is_none() {
                            self.count_inodes(shard, 1);
                        }
                    }
                    if key.kind == ItemKind::OrphanMark {
                        let ino = key.objectid.to_le_bytes().to_vec();
                        self.with_tree(shard, true, |tree, io| tree.insert(io, index, ino))?;
                    }
                }
                LogOp::Delete(key) => {
                    let previous = self.with_tree(shard, true, |tree, io| tree.remove(io, key))?;
                    if key.kind == ItemKind::InodeItem && previous.is_some() {
                        self.count_inodes(shard, -1);
                    }
                    if key.kind == ItemKind::OrphanMark {
                        self.with_tree(shard, true, |tree, io| tree.remove(io, &index))?;
                    }
                }
                LogOp::Data(..) => {}
            }
        }
        let mut after = BTreeMap::new();
        for key in &extent_keys {
            self.extent_blocks(key, &mut after)?;
        }
        let unused: HashMap<u64, u32> = before
            .iter()
            .chain(claimed.iter())
            .filter(|(b, _)| !after.contains_key(b))
            .map(|(&b, &s)| (b, s))
            .collect();
        let generation = self.commit.generation;
        for (block, shard) in unused {
            let space = &mut self.shard_mut(shard).space;
            // A durable extent sharing a block with a tree node the replay copied on write
            // (freeing it) is corruption, not a double free.
            space.check_allocated(block, 1).map_err(|why| {
                EngineError::corrupt("extent item", block, format!("replay frees it: {why}"))
            })?;
            space.free(block, 1, Some(generation));
        }
        for (shard, ino) in created {
            self.advance_ino_counter(shard, ino)?;
        }
        Ok(())
    }
}
