//! Directories and names: lookup, create, mkdir, symlink, link, unlink, rmdir, rename,
//! readdir.
//!
//! A name is three items: a directory item `(dir, DirItem, hash(name))` for lookups (a bucket
//! of names sharing the hash), a directory index item `(dir, DirIndex, seq)` for readdir in
//! creation order with stable cookies, and an inode back-reference `(child, InodeRef, dir)`
//! listing the child's names in that directory with their sequence numbers (for link counts,
//! rename and log replay). All three change together in one transaction.
//!
//! # Invariants
//! - A name appears in exactly one directory-item bucket, one index item and one back-reference
//!   of its child; the checker verifies the three agree.
//! - A directory's `nlink` is 2 + its subdirectories; a file's `nlink` is its back-reference
//!   count. Readdir cookies are index sequences: 0 and 1 are `.` and `..`, names start at 2.

use crate::error::{EngineError, Result};
use crate::format::items::{
    decode_names, encode_names, find_name, name_hash, push_name, InodeItem, NameEntry, Timespec,
};
use crate::format::{ItemKind, Key};
use crate::fs::Filesystem;
use crate::inode::{Stat, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG};

/// One readdir entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    /// S_IFMT >> 12 of the child (DT_* values).
    pub kind: u8,
    /// Pass this to the next readdir call to continue after this entry.
    pub cookie: u64,
}

/// rename(2) flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// What [`Filesystem::add_name_at`] needs about the directory, loaded once per operation.
struct NameSlot {
    dir_item: InodeItem,
    hash: u64,
    /// The name's hash bucket, encoded (creates append to it without decoding it).
    bucket: Vec<u8>,
}

/// First readdir cookie of a real entry (0 = start, 1 = after `.`).
pub const FIRST_INDEX: u64 = 2;
/// Longest symlink target (its text is one item).
pub const MAX_SYMLINK_BYTES: usize = 1024;

fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > 255 {
        return Err(EngineError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(EngineError::Invalid(format!(
            "bad name {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(())
}

fn kind_of(mode: u32) -> u8 {
    ((mode & S_IFMT) >> 12) as u8
}

impl Filesystem {
    fn dir_item(&mut self, dir: u64, hash: u64) -> Result<Vec<NameEntry>> {
        self.list_at(self.shard_of(dir), Key::new(dir, ItemKind::DirItem, hash))
    }

    /// Stores a name list; an empty one removes the item.
    fn put_encoded(&mut self, shard: u32, key: Key, bytes: Vec<u8>) -> Result<()> {
        self.put_bucket(
            shard,
            key,
            bytes,
            "too many names share one hash or one parent",
        )
    }

    fn put_list(&mut self, shard: u32, key: Key, entries: &[NameEntry]) -> Result<()> {
        self.put_encoded(shard, key, encode_names(entries))
    }

    fn dir_inode(&mut self, dir: u64) -> Result<InodeItem> {
        let item = self.load_inode(dir)?;
        if item.mode & S_IFMT != S_IFDIR {
            return Err(EngineError::NotDir);
        }
        Ok(item)
    }

    /// Looks `name` up in `dir`.
    pub fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Stat> {
        let (ino, _) = self.find_name(dir, name)?.ok_or(EngineError::NotFound)?;
        self.stat(ino)
    }

    /// The child inode and kind `name` names in `dir`, if any.
    pub(crate) fn find_name(&mut self, dir: u64, name: &[u8]) -> Result<Option<(u64, u8)>> {
        if name.len() > 255 {
            return Err(EngineError::NameTooLong);
        }
        self.dir_inode(dir)?;
        let bucket = self.dir_item(dir, name_hash(name))?;
        Ok(bucket
            .into_iter()
            .find(|e| e.name == name)
            .map(|e| (e.target, e.kind)))
    }

    /// Adds `name` → `child` to `dir`: directory item, index item, back-reference; updates the
    /// directory's size and times. The caller has checked the name is free.
    /// Loads what adding or checking `name` in `dir` needs: the directory's inode (it must
    /// be a directory) and the name's hash bucket; also says whether the name exists.
    fn name_slot(&mut self, dir: u64, name: &[u8]) -> Result<(NameSlot, Option<(u64, u8)>)> {
        if name.len() > 255 {
            return Err(EngineError::NameTooLong);
        }
        let dir_item = self.dir_inode(dir)?;
        let hash = name_hash(name);
        let shard = self.shard_of(dir);
        let key = Key::new(dir, ItemKind::DirItem, hash);
        let bucket = self
            .with_tree(shard, false, |tree, io| tree.get(io, &key))?
            .unwrap_or_default();
        let existing = find_name(&bucket, name)
            .map_err(|why| EngineError::corrupt("directory item", dir, why))?;
        Ok((
            NameSlot {
                dir_item,
                hash,
                bucket,
            },
            existing,
        ))
    }

    /// Fails with NoSpace, before anything changes, unless adding a name to `dir` for `child`
    /// (plus `child_items` more changes of the child's own items) cannot run out of space
    /// halfway: directory item, directory inode and the delayed index item in the directory's
    /// shard, the back-reference in the child's.
    fn ensure_room_for_name(&mut self, dir: u64, child: u64, child_items: u64) -> Result<()> {
        let (dir_shard, child_shard) = (self.shard_of(dir), self.shard_of(child));
        if dir_shard == child_shard {
            self.ensure_meta_room(dir_shard, 4 + child_items)
        } else {
            self.ensure_meta_room(dir_shard, 3)?;
            self.ensure_meta_room(child_shard, 1 + child_items)
        }
    }

    fn add_name(
        &mut self,
        dir: u64,
        name: &[u8],
        child: u64,
        kind: u8,
        now: Timespec,
    ) -> Result<()> {
        self.ensure_room_for_name(dir, child, 1)?;
        let (slot, _) = self.name_slot(dir, name)?;
        self.add_name_at(dir, slot, name, child, kind, now, false, 0)
    }

    /// Adds `name` → `child` to `dir`: directory item, index item (delayed), back-reference;
    /// updates the directory's size, times and, by `dir_nlink_delta`, its link count. The
    /// caller has checked the name is free. A `new_child` has no back-references yet.
    #[allow(clippy::too_many_arguments)]
    fn add_name_at(
        &mut self,
        dir: u64,
        slot: NameSlot,
        name: &[u8],
        child: u64,
        kind: u8,
        now: Timespec,
        new_child: bool,
        dir_nlink_delta: u32,
    ) -> Result<()> {
        let NameSlot {
            mut dir_item,
            hash,
            mut bucket,
        } = slot;
        let index = dir_item.next_index.max(FIRST_INDEX);
        dir_item.next_index = index + 1;
        dir_item.size += name.len() as u64;
        dir_item.mtime = now;
        dir_item.ctime = now;
        dir_item.nlink += dir_nlink_delta;
        push_name(&mut bucket, child, kind, name);
        let dir_shard = self.shard_of(dir);
        self.put_encoded(dir_shard, Key::new(dir, ItemKind::DirItem, hash), bucket)?;
        // The index item waits for the commit, batched with the directory's other new names.
        self.log.note(Key::new(dir, ItemKind::DirIndex, index));
        self.delayed.insert(
            dir,
            index,
            NameEntry {
                target: child,
                kind,
                name: name.to_vec(),
            },
        );
        if self.delayed.pending_in(dir) >= crate::delayed::DIR_BATCH_MAX {
            let flushed = self.flush_delayed_dir(dir);
            self.fail_stop_on_error(flushed)?;
        } else if self.delayed.len() > crate::delayed::MAX_PENDING {
            let flushed = self.flush_delayed_index();
            self.fail_stop_on_error(flushed)?;
        }
        let child_shard = self.shard_of(child);
        let ref_key = Key::new(child, ItemKind::InodeRef, dir);
        let mut refs = if new_child {
            Vec::with_capacity(11 + name.len())
        } else {
            self.with_tree(child_shard, false, |tree, io| tree.get(io, &ref_key))?
                .unwrap_or_default()
        };
        push_name(&mut refs, index, 0, name);
        self.put_encoded(child_shard, ref_key, refs)?;
        self.store_inode(dir, &dir_item)
    }

    /// The name list at `key` (decoded in place), empty when there is none.
    fn list_at(&mut self, shard: u32, key: Key) -> Result<Vec<NameEntry>> {
        match self.with_tree(shard, false, |tree, io| {
            tree.get_with(io, &key, decode_names)
        })? {
            Some(names) => {
                names.map_err(|why| EngineError::corrupt("name list", key.objectid, why))
            }
            None => Ok(Vec::new()),
        }
    }

    /// Removes `name` from `dir`; returns the child and its kind.
    fn remove_name(&mut self, dir: u64, name: &[u8], now: Timespec) -> Result<(u64, u8)> {
        let mut dir_item = self.dir_inode(dir)?;
        let hash = name_hash(name);
        let mut bucket = self.dir_item(dir, hash)?;
        let at = bucket
            .iter()
            .position(|e| e.name == name)
            .ok_or(EngineError::NotFound)?;
        let entry = bucket.remove(at);
        let dir_shard = self.shard_of(dir);
        self.put_list(dir_shard, Key::new(dir, ItemKind::DirItem, hash), &bucket)?;
        let child = entry.target;
        let child_shard = self.shard_of(child);
        let ref_key = Key::new(child, ItemKind::InodeRef, dir);
        let mut refs = self.list_at(child_shard, ref_key)?;
        let ref_at = refs.iter().position(|r| r.name == name).ok_or_else(|| {
            EngineError::corrupt(
                "inode back-reference",
                child,
                format!("no back-reference for a name in {dir}"),
            )
        })?;
        let index = refs.remove(ref_at).target;
        self.put_list(child_shard, ref_key, &refs)?;
        self.log.note(Key::new(dir, ItemKind::DirIndex, index));
        if self.delayed.take(dir, index).is_none() {
            self.with_tree(dir_shard, true, |tree, io| {
                tree.remove(io, &Key::new(dir, ItemKind::DirIndex, index))
            })?
            .ok_or_else(|| {
                EngineError::corrupt("directory index", dir, format!("index {index} missing"))
            })?;
        }
        dir_item.size = dir_item.size.saturating_sub(name.len() as u64);
        dir_item.mtime = now;
        dir_item.ctime = now;
        self.store_inode(dir, &dir_item)?;
        Ok((child, entry.kind))
    }

    fn make_node(
        &mut self,
        dir: u64,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<(u64, InodeItem)> {
        self.check_writable()?;
        check_name(name)?;
        let (slot, existing) = self.name_slot(dir, name)?;
        if existing.is_some() {
            return Err(EngineError::Exists);
        }
        let now = Timespec::now();
        let ino = self.alloc_ino()?;
        // The inode item and the name must both fit, or neither is written.
        self.ensure_room_for_name(dir, ino, 2)?;
        let is_dir = mode & S_IFMT == S_IFDIR;
        let item = InodeItem {
            mode,
            uid,
            gid,
            nlink: if is_dir { 2 } else { 1 },
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            generation: self.generation,
            next_index: FIRST_INDEX,
            ..Default::default()
        };
        self.store_inode(ino, &item)?;
        self.add_name_at(
            dir,
            slot,
            name,
            ino,
            kind_of(mode),
            now,
            true,
            is_dir as u32,
        )?;
        Ok((ino, item))
    }

    /// Creates a regular file (mode's permission bits are kept).
    pub fn create(&mut self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Stat> {
        let (ino, item) = self.make_node(dir, name, S_IFREG | (mode & 0o7777), uid, gid)?;
        Ok(Self::stat_of(ino, &item))
    }

    pub fn mkdir(&mut self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Stat> {
        let (ino, item) = self.make_node(dir, name, S_IFDIR | (mode & 0o7777), uid, gid)?;
        Ok(Self::stat_of(ino, &item))
    }

    pub fn symlink(
        &mut self,
        dir: u64,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Stat> {
        if target.is_empty() || target.len() > MAX_SYMLINK_BYTES {
            return Err(EngineError::NameTooLong);
        }
        let (ino, mut item) = self.make_node(dir, name, S_IFLNK | 0o777, uid, gid)?;
        let shard = self.shard_of(ino);
        let bytes = target.to_vec();
        self.with_tree(shard, true, |tree, io| {
            tree.insert(io, Key::new(ino, ItemKind::SymlinkTarget, 0), bytes)
        })?;
        item.size = target.len() as u64;
        self.store_inode(ino, &item)?;
        Ok(Self::stat_of(ino, &item))
    }

    pub fn readlink(&mut self, ino: u64) -> Result<Vec<u8>> {
        let item = self.load_inode(ino)?;
        if item.mode & S_IFMT != S_IFLNK {
            return Err(EngineError::Invalid("not a symlink".into()));
        }
        let shard = self.shard_of(ino);
        self.with_tree(shard, false, |tree, io| {
            tree.get(io, &Key::new(ino, ItemKind::SymlinkTarget, 0))
        })?
        .ok_or_else(|| EngineError::corrupt("symlink", ino, "target missing"))
    }

    /// A new name `name` in `dir` for the existing file `ino`.
    pub fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<Stat> {
        self.check_writable()?;
        check_name(name)?;
        let mut item = self.load_inode(ino)?;
        if item.mode & S_IFMT == S_IFDIR {
            return Err(EngineError::Invalid(
                "hard links to directories are not allowed".into(),
            ));
        }
        if self.find_name(dir, name)?.is_some() {
            return Err(EngineError::Exists);
        }
        let now = Timespec::now();
        self.add_name(dir, name, ino, kind_of(item.mode), now)?;
        item.nlink += 1;
        item.ctime = now;
        self.store_inode(ino, &item)?;
        Ok(Self::stat_of(ino, &item))
    }

    /// Drops one link of `child`; deletes the inode when none is left.
    fn drop_link(&mut self, child: u64, now: Timespec) -> Result<()> {
        let mut item = self.load_inode(child)?;
        let is_dir = item.mode & S_IFMT == S_IFDIR;
        item.nlink = if is_dir {
            0
        } else {
            item.nlink.saturating_sub(1)
        };
        if item.nlink == 0 {
            self.delete_inode(child)
        } else {
            item.ctime = now;
            self.store_inode(child, &item)
        }
    }

    pub fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        self.check_writable()?;
        let (child, kind) = self.find_name(dir, name)?.ok_or(EngineError::NotFound)?;
        if kind as u32 == S_IFDIR >> 12 {
            return Err(EngineError::IsDir);
        }
        let now = Timespec::now();
        self.remove_name(dir, name, now)?;
        self.drop_link(child, now)
    }

    fn dir_is_empty(&mut self, dir: u64) -> Result<bool> {
        if self.delayed.has_any(dir) {
            return Ok(false);
        }
        let shard = self.shard_of(dir);
        let first = self.with_tree(shard, false, |tree, io| {
            tree.seek(io, &Key::new(dir, ItemKind::DirIndex, 0))
        })?;
        Ok(!first.is_some_and(|(k, _)| k.objectid == dir && k.kind == ItemKind::DirIndex))
    }

    pub fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        self.check_writable()?;
        let (child, kind) = self.find_name(dir, name)?.ok_or(EngineError::NotFound)?;
        if kind as u32 != S_IFDIR >> 12 {
            return Err(EngineError::NotDir);
        }
        if !self.dir_is_empty(child)? {
            return Err(EngineError::NotEmpty);
        }
        let now = Timespec::now();
        self.remove_name(dir, name, now)?;
        let mut parent = self.load_inode(dir)?;
        parent.nlink -= 1;
        self.store_inode(dir, &parent)?;
        self.drop_link(child, now)
    }

    /// True when `ancestor` is `ino` or one of its ancestors (walking `..` back-references).
    fn is_ancestor(&mut self, ancestor: u64, mut ino: u64) -> Result<bool> {
        for _ in 0..4096 {
            if ino == ancestor {
                return Ok(true);
            }
            if ino == self.root() {
                return Ok(false);
            }
            let shard = self.shard_of(ino);
            let parent = self.with_tree(shard, false, |tree, io| {
                tree.seek(io, &Key::new(ino, ItemKind::InodeRef, 0))
            })?;
            match parent {
                Some((key, _)) if key.objectid == ino && key.kind == ItemKind::InodeRef => {
                    ino = key.offset
                }
                _ => return Ok(false),
            }
        }
        Err(EngineError::corrupt(
            "directory tree",
            ino,
            "cycle in parent references",
        ))
    }

    /// rename(2), with RENAME_NOREPLACE and RENAME_EXCHANGE.
    pub fn rename(
        &mut self,
        src_dir: u64,
        src_name: &[u8],
        dst_dir: u64,
        dst_name: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        self.check_writable()?;
        check_name(dst_name)?;
        if flags.noreplace && flags.exchange {
            return Err(EngineError::Invalid(
                "RENAME_NOREPLACE with RENAME_EXCHANGE".into(),
            ));
        }
        let (src, src_kind) = self
            .find_name(src_dir, src_name)?
            .ok_or(EngineError::NotFound)?;
        let dst = self.find_name(dst_dir, dst_name)?;
        let src_is_dir = src_kind as u32 == S_IFDIR >> 12;
        if src_dir == dst_dir && src_name == dst_name {
            return if flags.noreplace {
                Err(EngineError::Exists)
            } else {
                Ok(())
            };
        }
        if src_is_dir && self.is_ancestor(src, dst_dir)? {
            return Err(EngineError::Invalid(
                "cannot move a directory into itself".into(),
            ));
        }
        let now = Timespec::now();
        if flags.exchange {
            let (dst_ino, dst_kind) = dst.ok_or(EngineError::NotFound)?;
            let dst_is_dir = dst_kind as u32 == S_IFDIR >> 12;
            if dst_is_dir && self.is_ancestor(dst_ino, src_dir)? {
                return Err(EngineError::Invalid(
                    "cannot move a directory into itself".into(),
                ));
            }
            self.remove_name(src_dir, src_name, now)?;
            self.remove_name(dst_dir, dst_name, now)?;
            self.add_name(dst_dir, dst_name, src, src_kind, now)?;
            self.add_name(src_dir, src_name, dst_ino, dst_kind, now)?;
            if src_dir != dst_dir && src_is_dir != dst_is_dir {
                let (gains, loses) = if src_is_dir {
                    (dst_dir, src_dir)
                } else {
                    (src_dir, dst_dir)
                };
                self.adjust_nlink(gains, 1)?;
                self.adjust_nlink(loses, -1)?;
            }
            self.touch_ctime(src, now)?;
            return self.touch_ctime(dst_ino, now);
        }
        if let Some((dst_ino, dst_kind)) = dst {
            if flags.noreplace {
                return Err(EngineError::Exists);
            }
            if dst_ino == src {
                // Two names of one file: rename does nothing (POSIX).
                return Ok(());
            }
            let dst_is_dir = dst_kind as u32 == S_IFDIR >> 12;
            match (src_is_dir, dst_is_dir) {
                (true, false) => return Err(EngineError::NotDir),
                (false, true) => return Err(EngineError::IsDir),
                (true, true) if !self.dir_is_empty(dst_ino)? => return Err(EngineError::NotEmpty),
                _ => {}
            }
            self.remove_name(dst_dir, dst_name, now)?;
            if dst_is_dir {
                self.adjust_nlink(dst_dir, -1)?;
            }
            self.drop_link(dst_ino, now)?;
        }
        self.remove_name(src_dir, src_name, now)?;
        self.add_name(dst_dir, dst_name, src, src_kind, now)?;
        if src_is_dir && src_dir != dst_dir {
            self.adjust_nlink(src_dir, -1)?;
            self.adjust_nlink(dst_dir, 1)?;
        }
        self.touch_ctime(src, now)
    }

    fn adjust_nlink(&mut self, ino: u64, delta: i32) -> Result<()> {
        let mut item = self.load_inode(ino)?;
        item.nlink = item
            .nlink
            .checked_add_signed(delta)
            .ok_or_else(|| EngineError::corrupt("inode item", ino, "link count underflow"))?;
        self.store_inode(ino, &item)
    }

    fn touch_ctime(&mut self, ino: u64, now: Timespec) -> Result<()> {
        let mut item = self.load_inode(ino)?;
        item.ctime = now;
        self.store_inode(ino, &item)
    }

    /// Up to `max` entries of `dir` after `cookie` (0 to start), in creation order. Cookies
    /// stay valid across changes: an entry created later has a larger cookie.
    pub fn readdir(&mut self, dir: u64, cookie: u64, max: usize) -> Result<Vec<DirEntry>> {
        self.dir_inode(dir)?;
        let shard = self.shard_of(dir);
        let start = Key::new(dir, ItemKind::DirIndex, cookie.max(FIRST_INDEX - 1) + 1);
        let end = Key::new(dir, ItemKind::DirIndex, u64::MAX);
        let mut out = Vec::new();
        let mut at = start;
        // Names whose index items are still delayed merge in by sequence.
        let mut delayed: std::iter::Peekable<std::vec::IntoIter<(u64, NameEntry)>> = self
            .delayed
            .range(dir, start.offset)
            .take(max)
            .map(|(seq, e)| (seq, e.clone()))
            .collect::<Vec<_>>()
            .into_iter()
            .peekable();
        while out.len() < max {
            let Some((key, bytes)) = self.with_tree(shard, false, |tree, io| tree.seek(io, &at))?
            else {
                break;
            };
            if key >= end {
                break;
            }
            while let Some((seq, entry)) = delayed.next_if(|(seq, _)| *seq < key.offset) {
                if out.len() < max {
                    out.push(DirEntry {
                        name: entry.name,
                        ino: entry.target,
                        kind: entry.kind,
                        cookie: seq,
                    });
                }
            }
            if out.len() >= max {
                break;
            }
            let entry = decode_names(&bytes)
                .ok()
                .and_then(|mut v| (v.len() == 1).then(|| v.remove(0)))
                .ok_or_else(|| {
                    EngineError::corrupt(
                        "directory index",
                        dir,
                        format!("bad index item {}", key.offset),
                    )
                })?;
            out.push(DirEntry {
                name: entry.name,
                ino: entry.target,
                kind: entry.kind,
                cookie: key.offset,
            });
            at = Key::new(dir, ItemKind::DirIndex, key.offset + 1);
        }
        for (seq, entry) in delayed {
            if out.len() >= max {
                break;
            }
            out.push(DirEntry {
                name: entry.name,
                ino: entry.target,
                kind: entry.kind,
                cookie: seq,
            });
        }
        Ok(out)
    }

    /// Resolves an absolute path (for tools and tests).
    pub fn resolve(&mut self, path: &str) -> Result<u64> {
        let mut ino = self.root();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            ino = self
                .find_name(ino, part.as_bytes())?
                .ok_or(EngineError::NotFound)?
                .0;
        }
        Ok(ino)
    }
}
