//! Inodes on the whole filesystem: the shard an inode lives in, loading and storing inode
//! items, numbering (per-shard counters persisted at each commit), stat and setattr, holds
//! and releases, and orphans (open-unlinked inodes deleted at last release or at mount).
//!
//! Layering: [`super::Namespace`] (numbering state, holds, the delayed index) and the inode
//! types never name [`Filesystem`]; this file reads and writes inode items through the tree
//! layer and reports changes to the fsync log's tracking.

use super::{
    inode_key, orphan_index_key, Atime, SetAttr, Stat, INO_COUNTER_OBJECTID, ORPHAN_OBJECTID,
    ROOT_INO, S_IFMT,
};
use crate::error::{EngineError, Result};
use crate::format::items::{InodeItem, Timespec};
use crate::format::{ItemKind, Key};
use crate::fs::{Filesystem, Mode, FIRST_INODE};

impl Filesystem {
    pub fn shard_of(&self, ino: u64) -> u32 {
        (ino % self.shards.len() as u64) as u32
    }

    pub fn root(&self) -> u64 {
        ROOT_INO
    }

    pub(crate) fn load_inode(&mut self, ino: u64) -> Result<InodeItem> {
        if ino < FIRST_INODE {
            return Err(EngineError::NotFound);
        }
        if let Some(item) = self.decoded.inode(ino) {
            #[cfg(debug_assertions)]
            self.check_decoded_inode(ino, &item);
            return Ok(item);
        }
        let item = self.load_inode_from_tree(ino)?;
        self.decoded.put_inode(ino, item);
        Ok(item)
    }

    /// How lookups of inode items and name chains fared since mount ([`crate::decoded`]).
    pub fn decoded_stats(&self) -> crate::decoded::DecodedStats {
        self.decoded.stats
    }

    fn load_inode_from_tree(&mut self, ino: u64) -> Result<InodeItem> {
        let shard = self.shard_of(ino);
        self.with_tree(shard, false, |tree, io| {
            tree.get_with(io, &inode_key(ino), InodeItem::decode)
        })?
        .ok_or(EngineError::NotFound)?
        .map_err(|why| EngineError::corrupt("inode item", ino, why))
    }

    /// Debug builds: a kept inode item is what the tree holds ([`crate::decoded`]). A read
    /// the tree cannot answer from memory now (a lookup run from memory) checks nothing.
    #[cfg(debug_assertions)]
    fn check_decoded_inode(&mut self, ino: u64, kept: &InodeItem) {
        match self.load_inode_from_tree(ino) {
            Ok(item) => assert_eq!(
                &item, kept,
                "inode {ino} kept decoded differs from its tree"
            ),
            Err(EngineError::NotFound) => panic!("inode {ino} kept decoded is not in its tree"),
            Err(_) => {}
        }
    }

    pub(crate) fn store_inode(&mut self, ino: u64, item: &InodeItem) -> Result<()> {
        let shard = self.shard_of(ino);
        let bytes = item.encode();
        let old = self.with_tree(shard, true, |tree, io| {
            tree.insert(io, inode_key(ino), bytes)
        })?;
        self.decoded.put_inode(ino, *item);
        // fdatasync skips an inode whose only change is its timestamps.
        let times_only = old
            .and_then(|old| InodeItem::decode(&old).ok())
            .is_some_and(|old| crate::log::only_times_differ(&old, item));
        if !times_only {
            self.log.note_data(ino);
        }
        Ok(())
    }

    /// A fresh inode number in the next shard round-robin. The shard's counter is cached in
    /// memory and written to its tree at commit ([`Filesystem::persist_ino_counters`]).
    pub(crate) fn alloc_ino(&mut self) -> Result<u64> {
        let shards = self.shards.len() as u64;
        let placed = match &mut self.mode {
            Mode::Partitioned(p) => p.place_next.take(),
            Mode::Whole => None,
        };
        let shard = match placed {
            Some(shard) => shard,
            None => {
                // Round-robin over the shards held here (all of them unless partitioned).
                let mut tries = 0;
                loop {
                    let shard = (self.namespace.next_create_shard % shards) as u32;
                    self.namespace.next_create_shard =
                        self.namespace.next_create_shard.wrapping_add(1);
                    if self.holds(shard) {
                        break shard;
                    }
                    tries += 1;
                    if tries >= shards {
                        return Err(EngineError::Invalid(
                            "no shard is held here to create an inode in".into(),
                        ));
                    }
                }
            }
        };
        if !self.holds(shard) {
            return Err(EngineError::Invalid(format!(
                "shard {shard} is held by another partition"
            )));
        }
        let next = self.ino_counter(shard)?;
        self.namespace.ino_counters[shard as usize] = Some(next + shards);
        self.namespace.ino_counters_dirty[shard as usize] = true;
        debug_assert_eq!(self.shard_of(next), shard);
        Ok(next)
    }

    /// Makes shard `shard`'s next inode number greater than `ino` (log replay recreated it).
    pub(crate) fn advance_ino_counter(&mut self, shard: u32, ino: u64) -> Result<()> {
        let next = self.ino_counter(shard)?;
        if ino >= next {
            self.namespace.ino_counters[shard as usize] = Some(ino + self.shards.len() as u64);
            self.namespace.ino_counters_dirty[shard as usize] = true;
        }
        Ok(())
    }

    /// Makes the next commit rewrite shard `shard`'s inode counter unchanged: something for
    /// a commit to write when one must happen with nothing else changed (mount marking an
    /// older format's filesystem with this one's version).
    pub(crate) fn rewrite_ino_counter(&mut self, shard: u32) -> Result<()> {
        let next = self.ino_counter(shard)?;
        self.namespace.ino_counters[shard as usize] = Some(next);
        self.namespace.ino_counters_dirty[shard as usize] = true;
        Ok(())
    }

    /// Shard `shard`'s next inode number (read from its tree the first time).
    fn ino_counter(&mut self, shard: u32) -> Result<u64> {
        let shards = self.shards.len() as u64;
        Ok(match self.namespace.ino_counters[shard as usize] {
            Some(next) => next,
            None => {
                let counter = Key::new(INO_COUNTER_OBJECTID, ItemKind::InodeItem, 0);
                match self.with_tree(shard, false, |tree, io| tree.get(io, &counter))? {
                    Some(bytes) if bytes.len() == 8 => {
                        let next = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
                        if !(FIRST_INODE..=crate::format::items::MAX_INO).contains(&next)
                            || next % shards != shard as u64
                        {
                            return Err(EngineError::corrupt(
                                "inode counter",
                                shard as u64,
                                format!("{next} is not an inode number of this shard"),
                            ));
                        }
                        next
                    }
                    Some(_) => {
                        return Err(EngineError::corrupt(
                            "inode counter",
                            shard as u64,
                            "not 8 bytes",
                        ))
                    }
                    // First inode of this residue class at or above FIRST_INODE, skipping the root.
                    None => {
                        let mut first =
                            FIRST_INODE + (shard as u64 + shards - FIRST_INODE % shards) % shards;
                        if first == ROOT_INO {
                            first += shards;
                        }
                        first
                    }
                }
            }
        })
    }

    /// Writes every advanced inode counter into its shard's tree (part of each commit).
    pub(crate) fn persist_ino_counters(&mut self) -> Result<()> {
        let counter = Key::new(INO_COUNTER_OBJECTID, ItemKind::InodeItem, 0);
        for shard in 0..self.shard_count() {
            if !std::mem::take(&mut self.namespace.ino_counters_dirty[shard as usize]) {
                continue;
            }
            let next =
                self.namespace.ino_counters[shard as usize].expect("a dirty counter is cached");
            self.with_tree(shard, true, |tree, io| {
                tree.insert(io, counter, next.to_le_bytes().to_vec())
            })?;
        }
        Ok(())
    }

    pub(crate) fn stat_of(ino: u64, item: &InodeItem) -> Stat {
        Stat {
            ino,
            mode: item.mode,
            nlink: item.nlink,
            uid: item.uid,
            gid: item.gid,
            size: item.size,
            blocks_512: item.blocks * 8,
            rdev: item.rdev,
            atime: item.atime,
            mtime: item.mtime,
            ctime: item.ctime,
            crtime: item.crtime,
        }
    }

    /// Moves `ino`'s access time after a read of it, as the mount's [`Atime`] says. An
    /// access time is an inode change like any other: the running transaction carries it and
    /// the next commit (or an fsync of the file) writes it, so reads never commit. Best
    /// effort: with the filesystem read-only, or no room left for the inode's leaf, the read
    /// is answered and the time stays (what a full ext4 does too).
    pub(crate) fn touch_atime(&mut self, ino: u64) {
        if self.options.atime == Atime::Never || self.failed.is_some() || self.op.depth > 0 {
            return;
        }
        let now = Timespec::now();
        match self.load_inode(ino) {
            Ok(item) if self.options.atime.moves(&item, now) => {}
            _ => return,
        }
        let result = self.run_op_once(&mut |fs: &mut Filesystem| {
            let shard = fs.shard_of(ino);
            let mut needs = crate::fs::Needs::default();
            needs.meta(shard, fs.tree_op_blocks(shard));
            fs.reserve(&needs, crate::space::MetaNeed::Grow)?;
            let mut item = fs.load_inode(ino)?;
            item.atime = now;
            fs.store_inode(ino, &item)
        });
        if let Err(e) = result {
            tracing::debug!(ino, "access time left as it was: {e}");
        }
    }

    pub fn stat(&mut self, ino: u64) -> Result<Stat> {
        let item = self.load_inode(ino)?;
        Ok(Self::stat_of(ino, &item))
    }

    /// chmod, chown, utimens and truncate in one call, as FUSE's setattr.
    pub fn setattr(&mut self, ino: u64, change: SetAttr) -> Result<Stat> {
        self.run_op(|fs| fs.setattr_op(ino, change))
    }

    fn setattr_op(&mut self, ino: u64, change: SetAttr) -> Result<Stat> {
        let mut needs = crate::fs::Needs::default();
        if let Some(size) = change.size {
            self.need_truncate(&mut needs, ino, size)?;
        } else {
            self.load_inode(ino)?;
        }
        let shard = self.shard_of(ino);
        needs.meta(shard, self.tree_op_blocks(shard));
        self.reserve(&needs, crate::space::MetaNeed::Shrink)?;
        if let Some(size) = change.size {
            self.truncate_reserved(ino, size)?;
        }
        let mut item = self.load_inode(ino)?;
        if let Some(mode) = change.mode {
            item.mode = (item.mode & S_IFMT) | (mode & !S_IFMT);
        }
        if let Some(uid) = change.uid {
            item.uid = uid;
        }
        if let Some(gid) = change.gid {
            item.gid = gid;
        }
        if let Some(atime) = change.atime {
            item.atime = atime;
        }
        if let Some(mtime) = change.mtime {
            item.mtime = mtime;
        }
        item.ctime = Timespec::now();
        self.store_inode(ino, &item)?;
        Ok(Self::stat_of(ino, &item))
    }

    /// Deletes every item of an inode (its last name is gone and nobody holds it) and frees
    /// its data; an orphan's index item goes with it.
    pub(crate) fn delete_inode(&mut self, ino: u64) -> Result<()> {
        self.free_all_extents(ino)?;
        self.drop_staged(ino);
        let shard = self.shard_of(ino);
        let removed = self.with_tree(shard, true, |tree, io| {
            let items = tree.range(
                io,
                Key::new(ino, ItemKind::InodeItem, 0),
                Key::new(ino + 1, ItemKind::InodeItem, 0),
            )?;
            let mut inode = false;
            for (key, _) in items {
                inode |= key.kind == ItemKind::InodeItem;
                tree.remove(io, &key)?;
            }
            tree.remove(io, &orphan_index_key(ino))?;
            Ok(inode)
        })?;
        if removed {
            self.count_inodes(shard, -1);
        }
        Ok(())
    }

    /// Keeps shard `shard`'s inode count ([`crate::fs::Shard::inodes`]) current.
    pub(crate) fn count_inodes(&mut self, shard: u32, delta: i64) {
        if let Some(held) = self.shards[shard as usize].as_mut() {
            held.inodes = held.inodes.saturating_add_signed(delta);
        }
    }

    /// Takes a hold on `ino` (an open file, a kernel reference): while any hold remains, an
    /// inode that loses its last name stays, with nlink 0, as an orphan (recorded durably,
    /// so a crash before the last release frees it at the next mount), and reads, writes and
    /// stat through the holder go on working.
    pub fn hold(&mut self, ino: u64) -> Result<()> {
        self.load_inode(ino)?;
        *self.namespace.inode_holds.entry(ino).or_insert(0) += 1;
        Ok(())
    }

    /// Lets go of one hold on `ino`. The last release of an orphan deletes it.
    pub fn release(&mut self, ino: u64) -> Result<()> {
        let Some(count) = self.namespace.inode_holds.get_mut(&ino) else {
            return Err(EngineError::Invalid(format!("inode {ino} is not held")));
        };
        *count -= 1;
        if *count > 0 {
            return Ok(());
        }
        self.namespace.inode_holds.remove(&ino);
        match self.load_inode(ino) {
            Ok(item) if item.nlink == 0 && ino != ROOT_INO => self.delete_orphan(ino),
            Ok(_) | Err(EngineError::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Holds taken on `ino` and not yet released.
    pub fn holders(&self, ino: u64) -> u32 {
        self.namespace.inode_holds.get(&ino).copied().unwrap_or(0)
    }

    /// Deletes the orphan `ino` (nobody holds it any more), all or nothing.
    fn delete_orphan(&mut self, ino: u64) -> Result<()> {
        self.run_op(|fs| {
            let shard = fs.shard_of(ino);
            let blocks = fs.item_range_blocks(
                shard,
                Key::new(ino, ItemKind::InodeItem, 0),
                Key::new(ino + 1, ItemKind::InodeItem, 0),
            )? + fs.tree_op_blocks(shard);
            let mut needs = crate::fs::Needs::default();
            needs.meta(shard, blocks);
            fs.reserve(&needs, crate::space::MetaNeed::Shrink)?;
            fs.delete_inode(ino)
        })
    }

    /// Makes `ino`, which just lost its last name while held, an orphan: nlink 0, its mark
    /// (logged with it) and its index item (where mount finds it).
    pub(crate) fn make_orphan(
        &mut self,
        ino: u64,
        mut item: InodeItem,
        now: Timespec,
    ) -> Result<()> {
        item.nlink = 0;
        item.ctime = now;
        self.store_inode(ino, &item)?;
        let shard = self.shard_of(ino);
        self.with_tree(shard, true, |tree, io| {
            tree.insert(
                io,
                Key::new(ino, ItemKind::OrphanMark, 0),
                ino.to_le_bytes().to_vec(),
            )?;
            tree.insert(io, orphan_index_key(ino), ino.to_le_bytes().to_vec())
        })?;
        Ok(())
    }

    /// Deletes every orphan the index lists (run by mount, after replay: no holder survives
    /// a mount). An index item whose inode is not an orphan any more is dropped. Returns the
    /// orphans deleted.
    pub(crate) fn delete_orphans(&mut self) -> Result<u64> {
        let mut deleted = 0;
        for shard in 0..self.shard_count() {
            if !self.holds(shard) {
                continue;
            }
            let listed = self.with_tree(shard, false, |tree, io| {
                tree.range(
                    io,
                    Key::new(ORPHAN_OBJECTID, ItemKind::OrphanIndex, 0),
                    Key::new(ORPHAN_OBJECTID, ItemKind::OrphanIndex, u64::MAX),
                )
            })?;
            for (key, _) in listed {
                let ino = key.offset;
                let orphan = self.shard_of(ino) == shard
                    && matches!(self.load_inode(ino), Ok(item) if item.nlink == 0);
                if orphan {
                    self.delete_orphan(ino)?;
                    deleted += 1;
                } else {
                    self.with_tree(shard, true, |tree, io| tree.remove(io, &key))?;
                }
            }
        }
        Ok(deleted)
    }
}
