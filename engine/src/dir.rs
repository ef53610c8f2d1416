//! Directories and names: lookup, create, mkdir, symlink, link, unlink, rmdir, rename,
//! readdir.
//!
//! A name is three items: a directory item `(dir, DirItem, chain_offset(hash(name), link))`
//! for lookups (one link of the chain of names sharing the keyed hash, [`crate::bucket`]), a
//! directory index item `(dir, DirIndex, seq)` for readdir in creation order with stable
//! cookies, and an inode back-reference `(child, InodeRef, dir)` listing the child's names in
//! that directory with their sequence numbers (for link counts, rename and log replay). All
//! three change together in one transaction. Names of one inode in one directory past what
//! its InodeRef item holds (about 60 of 20 bytes) are extended back-references
//! `(child, InodeExtRef, chain_offset(hash(dir ‖ name), link))`, a chain per hash as directory
//! items are, so a file may have [`MAX_LINKS`] names in one directory, as on ext4.
//!
//! Every operation here is all or nothing ([`Filesystem::run_op`]): it looks up and checks
//! everything it needs (names, types, emptiness, link counts) and
//! reserves the worst case of the blocks it may allocate in every shard it touches, then
//! changes the trees. ENOSPC, EEXIST, EMLINK and the like come back with nothing changed.
//!
//! # Invariants
//! - A name appears in exactly one directory-item chain link, one index item and one
//!   back-reference of its child (its InodeRef item in that directory, or one extended
//!   back-reference); the checker verifies the three agree.
//! - A directory's `nlink` is 2 + its subdirectories; a file's `nlink` is its back-reference
//!   count. Readdir cookies are index sequences: 0 and 1 are `.` and `..`, names start at 2.

use crate::bucket::Chain;
use crate::delayed::DELAYED_ITEM_BLOCKS_MAX;
use crate::error::{EngineError, Result};
use crate::format::items::{
    decode_names, encode_names, push_name, ExtRef, InodeItem, NameEntry, Timespec,
};
use crate::format::node::MAX_ITEM_BYTES;
use crate::format::{ItemKind, Key};
use crate::fs::{Filesystem, Needs};
use crate::inode::{
    Stat, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG, S_IFSOCK, S_ISGID,
};
use crate::space::MetaNeed;

/// One readdir entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    /// S_IFMT >> 12 of the child (DT_* values).
    pub kind: u8,
    /// Pass this to the next readdir call to continue after this entry.
    pub cookie: u64,
}

/// rename(2) flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// What adding or checking a name in a directory needs, loaded once per operation.
struct NameSlot {
    dir_item: InodeItem,
    /// The chain of the name's hash.
    chain: Chain<NameEntry>,
}

/// First readdir cookie of a real entry (0 = start, 1 = after `.`).
pub const FIRST_INDEX: u64 = 2;
/// Longest symlink target (PATH_MAX less its NUL, as Linux allows).
pub const MAX_SYMLINK_BYTES: usize = 4095;
/// A symlink target is stored in items of at most this many bytes, keyed by piece number.
pub const SYMLINK_PIECE_BYTES: usize = 1536;
/// Most names one file may have (ext4's limit): link(2) fails with EMLINK beyond.
pub const MAX_LINKS: u32 = 65_000;

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

fn is_dir_kind(kind: u8) -> bool {
    kind as u32 == S_IFDIR >> 12
}

impl Filesystem {
    /// Stores a name list; an empty one removes the item.
    fn put_encoded(&mut self, shard: u32, key: Key, bytes: Vec<u8>) -> Result<()> {
        self.put_bucket(shard, key, bytes, "names of one inode in one directory")
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

    /// The hash placing `name` in its directory's chain (and an xattr's).
    pub(crate) fn name_hash(&self, name: &[u8]) -> u32 {
        self.sb.name_hasher().hash(name)
    }

    fn name_chain(&mut self, dir: u64, name: &[u8]) -> Result<Chain<NameEntry>> {
        let hash = self.name_hash(name);
        self.read_chain(dir, ItemKind::DirItem, hash)
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
        let hash = self.name_hash(name);
        if let Some(found) = self.decoded.name(dir, hash, name) {
            #[cfg(debug_assertions)]
            self.check_decoded_name(dir, hash, name, found);
            return Ok(found);
        }
        let chain = self.read_chain::<NameEntry>(dir, ItemKind::DirItem, hash)?;
        self.decoded.put_chain(dir, hash, chain.entries());
        Ok(chain.get(name).map(|e| (e.target, e.kind)))
    }

    /// Debug builds: a kept name chain answers as the tree does ([`crate::decoded`]).
    #[cfg(debug_assertions)]
    fn check_decoded_name(&mut self, dir: u64, hash: u32, name: &[u8], kept: Option<(u64, u8)>) {
        if let Ok(chain) = self.read_chain::<NameEntry>(dir, ItemKind::DirItem, hash) {
            let tree = chain.get(name).map(|e| (e.target, e.kind));
            assert_eq!(
                tree, kept,
                "name {name:?} in {dir} kept decoded differs from its tree"
            );
        }
    }

    /// Loads what adding or checking `name` in `dir` needs: the directory's inode (it must
    /// be a directory) and the name's chain; also says whether the name exists.
    fn name_slot(&mut self, dir: u64, name: &[u8]) -> Result<(NameSlot, Option<(u64, u8)>)> {
        if name.len() > 255 {
            return Err(EngineError::NameTooLong);
        }
        let dir_item = self.dir_inode(dir)?;
        if dir_item.nlink == 0 {
            // A removed directory still held open: nothing may be created in it (ENOENT,
            // as Linux says for a deleted working directory).
            return Err(EngineError::NotFound);
        }
        let chain = self.name_chain(dir, name)?;
        let existing = chain.get(name).map(|e| (e.target, e.kind));
        Ok((NameSlot { dir_item, chain }, existing))
    }

    /// Blocks `ops` tree changes in `shard` may allocate, added to `needs`.
    fn need_ops(&self, needs: &mut Needs, shard: u32, ops: u64) {
        needs.meta(shard, ops * self.tree_op_blocks(shard));
    }

    /// What adding a name to `dir` for `child` may allocate: its chain link (one: the first
    /// with room, or a new one), the directory's inode and its delayed index item (whose
    /// insert the commit floor then holds) in the directory's shard, the back-reference in
    /// the child's.
    fn need_add_name(&self, needs: &mut Needs, dir: u64, child: u64) {
        let dir_shard = self.shard_of(dir);
        self.need_ops(needs, dir_shard, 2);
        needs.meta(dir_shard, DELAYED_ITEM_BLOCKS_MAX);
        self.need_ops(needs, self.shard_of(child), 1);
    }

    /// What removing a name from `dir` may allocate: its chain link, its index item and the
    /// directory's inode; the child's back-reference.
    fn need_remove_name(&self, needs: &mut Needs, dir: u64, child: u64) {
        self.need_ops(needs, self.shard_of(dir), 3);
        self.need_ops(needs, self.shard_of(child), 1);
    }

    /// What dropping one link of `child` may allocate: its inode item; for its last link,
    /// removing every item it has (its back-reference among them), or, when it is held, its
    /// orphan mark and index item.
    fn need_drop_link(&mut self, needs: &mut Needs, child: u64, item: &InodeItem) -> Result<()> {
        let shard = self.shard_of(child);
        if item.mode & S_IFMT == S_IFDIR || item.nlink <= 1 {
            let blocks = self.item_range_blocks(
                shard,
                Key::new(child, ItemKind::InodeItem, 0),
                Key::new(child + 1, ItemKind::InodeItem, 0),
            )?;
            // The orphan index item (kept, or removed with the inode) is in another leaf.
            needs.meta(shard, blocks + self.tree_op_blocks(shard));
        } else {
            self.need_ops(needs, shard, 1);
        }
        Ok(())
    }

    /// Adds an extended back-reference: `child`'s name `name` (index `index`) in `dir`, for
    /// a name its InodeRef item in `dir` has no room for. One chain link changes.
    fn add_ext_ref(&mut self, child: u64, dir: u64, index: u64, name: &[u8]) -> Result<()> {
        let id = ExtRef::id_of(dir, name);
        let hash = self.name_hash(&id);
        let mut chain: Chain<ExtRef> = self.read_chain(child, ItemKind::InodeExtRef, hash)?;
        chain.insert(ExtRef::new(dir, index, name));
        self.write_chain(&chain)?;
        // The chain's key names no directory: couple them as an InodeRef change would.
        self.log.couple(child, dir);
        Ok(())
    }

    /// Removes `child`'s extended back-reference for `name` in `dir`; its index, or None
    /// when there is none.
    fn remove_ext_ref(&mut self, child: u64, dir: u64, name: &[u8]) -> Result<Option<u64>> {
        let id = ExtRef::id_of(dir, name);
        let hash = self.name_hash(&id);
        let mut chain: Chain<ExtRef> = self.read_chain(child, ItemKind::InodeExtRef, hash)?;
        let Some(entry) = chain.remove(&id) else {
            return Ok(None);
        };
        self.write_chain(&chain)?;
        self.log.couple(child, dir);
        Ok(Some(entry.index))
    }

    /// Adds `name` → `child` to `dir`: directory item, index item (delayed), back-reference;
    /// updates the directory's size, times and, by `dir_nlink_delta`, its link count. The
    /// caller checked the name is free and reserved the room ([`Filesystem::need_add_name`]).
    /// A `new_child` has no back-references yet.
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
            mut chain,
        } = slot;
        // Callers refuse a full directory before they change anything (EMLINK); past these
        // limits only a damaged image gets, which is reported, never wrapped around.
        let at_limit = |what: &str| {
            EngineError::corrupt_inode("directory", dir, format!("{what} at its limit"))
        };
        let index = dir_item.next_index.max(FIRST_INDEX);
        dir_item.next_index = index.checked_add(1).ok_or_else(|| at_limit("name index"))?;
        dir_item.size = (dir_item.size)
            .checked_add(name.len() as u64)
            .ok_or_else(|| at_limit("size"))?;
        dir_item.mtime = now;
        dir_item.ctime = now;
        dir_item.nlink = (dir_item.nlink)
            .checked_add(dir_nlink_delta)
            .ok_or_else(|| at_limit("link count"))?;
        chain.insert(NameEntry {
            target: child,
            kind,
            name: name.to_vec(),
        });
        self.write_chain(&chain)?;
        // The index item waits for the commit, batched with the directory's other new names
        // (its insert is reserved in the commit floor; a full batch goes in after the
        // operation, [`Filesystem::flush_due_delayed`]).
        self.log.note(Key::new(dir, ItemKind::DirIndex, index));
        self.namespace.delayed.insert(
            dir,
            index,
            NameEntry {
                target: child,
                kind,
                name: name.to_vec(),
            },
        );
        let child_shard = self.shard_of(child);
        let ref_key = Key::new(child, ItemKind::InodeRef, dir);
        let mut refs = if new_child {
            Vec::with_capacity(11 + name.len())
        } else {
            self.with_tree(child_shard, false, |tree, io| tree.get(io, &ref_key))?
                .unwrap_or_default()
        };
        if refs.len() + 11 + name.len() <= MAX_ITEM_BYTES {
            push_name(&mut refs, index, 0, name);
            self.put_encoded(child_shard, ref_key, refs)?;
        } else {
            // The names of `child` in `dir` fill their item (about 60 of 20 bytes): the rest
            // go to extended back-references, as btrfs's INODE_EXTREF.
            self.add_ext_ref(child, dir, index, name)?;
        }
        self.store_inode(dir, &dir_item)
    }

    fn add_name(
        &mut self,
        dir: u64,
        name: &[u8],
        child: u64,
        kind: u8,
        now: Timespec,
    ) -> Result<()> {
        let (slot, existing) = self.name_slot(dir, name)?;
        assert!(existing.is_none(), "add_name: the caller checked the name");
        self.add_name_at(dir, slot, name, child, kind, now, false, 0)
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
        let mut chain = self.name_chain(dir, name)?;
        let entry = chain.remove(name).ok_or(EngineError::NotFound)?;
        self.write_chain(&chain)?;
        let dir_shard = self.shard_of(dir);
        let child = entry.target;
        let child_shard = self.shard_of(child);
        let ref_key = Key::new(child, ItemKind::InodeRef, dir);
        let mut refs = self.list_at(child_shard, ref_key)?;
        let index = match refs.iter().position(|r| r.name == name) {
            Some(at) => {
                let index = refs.remove(at).target;
                self.put_list(child_shard, ref_key, &refs)?;
                index
            }
            None => self.remove_ext_ref(child, dir, name)?.ok_or_else(|| {
                EngineError::corrupt(
                    "inode back-reference",
                    child,
                    format!("no back-reference for a name in {dir}"),
                )
            })?,
        };
        self.log.note(Key::new(dir, ItemKind::DirIndex, index));
        if self.namespace.delayed.take(dir, index).is_none() {
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

    /// Creates an inode of `mode` named `name` in `dir`, owned by `owner` (uid, gid), with
    /// `target` as its symlink target and `rdev` as its device number. In a set-group-ID
    /// directory the new inode takes the directory's group, and a new directory the bit too
    /// (as ext4 and every System V descendant do).
    fn make_node(
        &mut self,
        dir: u64,
        name: &[u8],
        mut mode: u32,
        owner: (u32, u32),
        target: Option<&[u8]>,
        rdev: u64,
    ) -> Result<(u64, InodeItem)> {
        self.run_op(|fs| {
            check_name(name)?;
            let (slot, existing) = fs.name_slot(dir, name)?;
            if existing.is_some() {
                return Err(EngineError::Exists);
            }
            let is_dir = mode & S_IFMT == S_IFDIR;
            // A new subdirectory's ".." links the parent: at [`MAX_LINKS`] it is full (EMLINK,
            // as link(2) for files), refused before anything changes.
            if is_dir && slot.dir_item.nlink >= MAX_LINKS {
                return Err(EngineError::TooManyLinks);
            }
            let mut gid = owner.1;
            if slot.dir_item.mode & S_ISGID != 0 {
                gid = slot.dir_item.gid;
                if is_dir {
                    mode |= S_ISGID;
                }
            }
            let now = Timespec::now();
            let ino = fs.alloc_ino()?;
            let mut needs = Needs::default();
            fs.need_add_name(&mut needs, dir, ino);
            // The inode item, and for a symlink its target's pieces and the inode item again.
            let pieces = target.map_or(0, |t| t.len().div_ceil(SYMLINK_PIECE_BYTES) as u64);
            let child_ops = 1 + if target.is_some() { pieces + 1 } else { 0 };
            fs.need_ops(&mut needs, fs.shard_of(ino), child_ops);
            fs.reserve(&needs, MetaNeed::Grow)?;
            let mut item = InodeItem {
                mode,
                uid: owner.0,
                gid,
                nlink: if is_dir { 2 } else { 1 },
                rdev,
                atime: now,
                mtime: now,
                ctime: now,
                crtime: now,
                generation: fs.commit.generation,
                next_index: FIRST_INDEX,
                ..Default::default()
            };
            fs.store_inode(ino, &item)?;
            if mode & S_IFMT == S_IFREG {
                fs.log.note_born(ino);
            }
            fs.count_inodes(fs.shard_of(ino), 1);
            fs.add_name_at(
                dir,
                slot,
                name,
                ino,
                kind_of(mode),
                now,
                true,
                is_dir as u32,
            )?;
            if let Some(target) = target {
                let shard = fs.shard_of(ino);
                fs.with_tree(shard, true, |tree, io| {
                    for (i, piece) in target.chunks(SYMLINK_PIECE_BYTES).enumerate() {
                        let key = Key::new(ino, ItemKind::SymlinkTarget, i as u64);
                        tree.insert(io, key, piece.to_vec())?;
                    }
                    Ok(())
                })?;
                item.size = target.len() as u64;
                fs.store_inode(ino, &item)?;
            }
            Ok((ino, item))
        })
    }

    /// Creates a regular file (mode's permission bits are kept).
    pub fn create(&mut self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Stat> {
        let (ino, item) =
            self.make_node(dir, name, S_IFREG | (mode & 0o7777), (uid, gid), None, 0)?;
        Ok(Self::stat_of(ino, &item))
    }

    pub fn mkdir(&mut self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Stat> {
        let (ino, item) =
            self.make_node(dir, name, S_IFDIR | (mode & 0o7777), (uid, gid), None, 0)?;
        Ok(Self::stat_of(ino, &item))
    }

    /// mknod(2): a regular file, a FIFO, a socket, or a character or block device numbered
    /// `rdev` (kept for devices only). EINVAL for any other file type.
    pub fn mknod(
        &mut self,
        dir: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        uid: u32,
        gid: u32,
    ) -> Result<Stat> {
        let kind = mode & S_IFMT;
        let rdev = match kind {
            S_IFCHR | S_IFBLK => rdev,
            S_IFREG | S_IFIFO | S_IFSOCK => 0,
            0 => return self.create(dir, name, mode, uid, gid),
            _ => {
                return Err(EngineError::Invalid(format!(
                    "mknod of file type {:o}",
                    kind >> 12
                )))
            }
        };
        let (ino, item) =
            self.make_node(dir, name, kind | (mode & 0o7777), (uid, gid), None, rdev)?;
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
        let (ino, item) =
            self.make_node(dir, name, S_IFLNK | 0o777, (uid, gid), Some(target), 0)?;
        Ok(Self::stat_of(ino, &item))
    }

    pub fn readlink(&mut self, ino: u64) -> Result<Vec<u8>> {
        let item = self.load_inode(ino)?;
        if item.mode & S_IFMT != S_IFLNK {
            return Err(EngineError::Invalid("not a symlink".into()));
        }
        let shard = self.shard_of(ino);
        let pieces = self.with_tree(shard, false, |tree, io| {
            tree.range(
                io,
                Key::new(ino, ItemKind::SymlinkTarget, 0),
                Key::new(ino, ItemKind::SymlinkTarget, u64::MAX),
            )
        })?;
        // The size comes from the device: checked before anything is sized by it.
        if item.size > MAX_SYMLINK_BYTES as u64 {
            return Err(EngineError::corrupt_inode(
                "symlink",
                ino,
                format!(
                    "target of {} bytes (at most {MAX_SYMLINK_BYTES})",
                    item.size
                ),
            ));
        }
        let mut target = Vec::with_capacity(item.size as usize);
        for (i, (key, piece)) in pieces.into_iter().enumerate() {
            if key.offset != i as u64 {
                return Err(EngineError::corrupt_inode(
                    "symlink",
                    ino,
                    format!("target piece {} missing", i),
                ));
            }
            target.extend_from_slice(&piece);
        }
        if target.is_empty() || target.len() as u64 != item.size {
            return Err(EngineError::corrupt_inode(
                "symlink",
                ino,
                format!("target of {} bytes, inode says {}", target.len(), item.size),
            ));
        }
        Ok(target)
    }

    /// A new name `name` in `dir` for the existing file `ino`.
    pub fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<Stat> {
        self.run_op(|fs| {
            check_name(name)?;
            let mut item = fs.load_inode(ino)?;
            // Linux's order: the new name must not exist (EEXIST), then the old must not
            // be a directory (EPERM).
            let (slot, existing) = fs.name_slot(dir, name)?;
            if existing.is_some() {
                return Err(EngineError::Exists);
            }
            if item.mode & S_IFMT == S_IFDIR {
                // link(2): EPERM, "oldpath is a directory".
                return Err(EngineError::NotPermitted(
                    "hard links to directories are not allowed".into(),
                ));
            }
            if item.nlink >= MAX_LINKS {
                return Err(EngineError::TooManyLinks);
            }
            let mut needs = Needs::default();
            fs.need_add_name(&mut needs, dir, ino);
            fs.need_ops(&mut needs, fs.shard_of(ino), 1);
            fs.reserve(&needs, MetaNeed::Grow)?;
            let now = Timespec::now();
            fs.add_name_at(dir, slot, name, ino, kind_of(item.mode), now, false, 0)?;
            item.nlink += 1;
            item.ctime = now;
            fs.store_inode(ino, &item)?;
            Ok(Self::stat_of(ino, &item))
        })
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
        if item.nlink == 0 && self.holders(child) > 0 {
            self.make_orphan(child, item, now)
        } else if item.nlink == 0 {
            self.delete_inode(child)
        } else {
            item.ctime = now;
            self.store_inode(child, &item)
        }
    }

    pub fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        self.run_op(|fs| {
            let (child, kind) = fs.find_name(dir, name)?.ok_or(EngineError::NotFound)?;
            if is_dir_kind(kind) {
                return Err(EngineError::IsDir);
            }
            let item = fs.load_inode(child)?;
            let mut needs = Needs::default();
            fs.need_remove_name(&mut needs, dir, child);
            fs.need_drop_link(&mut needs, child, &item)?;
            fs.reserve(&needs, MetaNeed::Shrink)?;
            let now = Timespec::now();
            fs.remove_name(dir, name, now)?;
            fs.drop_link(child, now)
        })
    }

    fn dir_is_empty(&mut self, dir: u64) -> Result<bool> {
        if self.namespace.delayed.has_any(dir) {
            return Ok(false);
        }
        let shard = self.shard_of(dir);
        let first = self.with_tree(shard, false, |tree, io| {
            tree.seek(io, &Key::new(dir, ItemKind::DirIndex, 0))
        })?;
        Ok(!first.is_some_and(|(k, _)| k.objectid == dir && k.kind == ItemKind::DirIndex))
    }

    pub fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        self.run_op(|fs| {
            let (child, kind) = fs.find_name(dir, name)?.ok_or(EngineError::NotFound)?;
            if !is_dir_kind(kind) {
                return Err(EngineError::NotDir);
            }
            if !fs.dir_is_empty(child)? {
                return Err(EngineError::NotEmpty);
            }
            let item = fs.load_inode(child)?;
            let mut needs = Needs::default();
            fs.need_remove_name(&mut needs, dir, child);
            fs.need_ops(&mut needs, fs.shard_of(dir), 1);
            fs.need_drop_link(&mut needs, child, &item)?;
            fs.reserve(&needs, MetaNeed::Shrink)?;
            let now = Timespec::now();
            fs.remove_name(dir, name, now)?;
            fs.adjust_nlink(dir, -1)?;
            fs.drop_link(child, now)
        })
    }

    /// True when `ancestor` is `ino` or one of its ancestors (walking `..` back-references).
    fn is_ancestor(&mut self, ancestor: u64, ino: u64) -> Result<bool> {
        let mut found = false;
        self.walk_up(ino, |dir| {
            found = dir == ancestor;
            !found
        })?;
        Ok(found)
    }

    /// Calls `visit` on `ino` and each directory above it up to the root, while it returns
    /// true (a directory's parent is its one back-reference, read from its own shard).
    pub(crate) fn walk_up(
        &mut self,
        mut ino: u64,
        mut visit: impl FnMut(u64) -> bool,
    ) -> Result<()> {
        for _ in 0..4096 {
            if !visit(ino) || ino == self.root() {
                return Ok(());
            }
            let shard = self.shard_of(ino);
            let parent = self.with_tree(shard, false, |tree, io| {
                tree.seek(io, &Key::new(ino, ItemKind::InodeRef, 0))
            })?;
            match parent {
                Some((key, _)) if key.objectid == ino && key.kind == ItemKind::InodeRef => {
                    ino = key.offset
                }
                _ => return Ok(()),
            }
        }
        Err(EngineError::corrupt(
            "directory tree",
            ino,
            "cycle in parent references",
        ))
    }

    /// rename(2), with RENAME_NOREPLACE and RENAME_EXCHANGE. Everything that can refuse it
    /// (names, types, emptiness, loops, EMLINK, space) is checked before the first change.
    pub fn rename(
        &mut self,
        src_dir: u64,
        src_name: &[u8],
        dst_dir: u64,
        dst_name: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        self.run_op(|fs| fs.rename_op(src_dir, src_name, dst_dir, dst_name, flags))
    }

    fn rename_op(
        &mut self,
        src_dir: u64,
        src_name: &[u8],
        dst_dir: u64,
        dst_name: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
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
        let src_is_dir = is_dir_kind(src_kind);
        if src_dir == dst_dir && src_name == dst_name {
            return if flags.noreplace {
                Err(EngineError::Exists)
            } else {
                Ok(())
            };
        }
        // Linux's order (do_renameat2): an exchange needs its target and NOREPLACE refuses
        // an existing one before a move into the source's own subtree is refused.
        if flags.exchange && dst.is_none() {
            return Err(EngineError::NotFound);
        }
        if flags.noreplace && dst.is_some() {
            return Err(EngineError::Exists);
        }
        if src_is_dir && self.is_ancestor(src, dst_dir)? {
            return Err(EngineError::Invalid(
                "cannot move a directory into itself".into(),
            ));
        }
        // A target directory above the source is not empty (it holds the source): Linux
        // says so before it compares the two's types.
        if let Some((dst_ino, dst_kind)) = dst {
            if !flags.exchange
                && is_dir_kind(dst_kind)
                && dst_ino != src
                && self.is_ancestor(dst_ino, src_dir)?
            {
                return Err(EngineError::NotEmpty);
            }
        }
        let mut needs = Needs::default();
        let now = Timespec::now();
        if flags.exchange {
            let (dst_ino, dst_kind) = dst.ok_or(EngineError::NotFound)?;
            let dst_is_dir = is_dir_kind(dst_kind);
            if dst_is_dir && self.is_ancestor(dst_ino, src_dir)? {
                return Err(EngineError::Invalid(
                    "cannot move a directory into itself".into(),
                ));
            }
            // Each takes the other's name; within one directory, each loses its own first.
            self.need_remove_name(&mut needs, src_dir, src);
            self.need_remove_name(&mut needs, dst_dir, dst_ino);
            self.need_add_name(&mut needs, dst_dir, src);
            self.need_add_name(&mut needs, src_dir, dst_ino);
            self.need_ops(&mut needs, self.shard_of(src_dir), 1);
            self.need_ops(&mut needs, self.shard_of(dst_dir), 1);
            self.need_ops(&mut needs, self.shard_of(src), 1);
            self.need_ops(&mut needs, self.shard_of(dst_ino), 1);
            self.reserve(&needs, MetaNeed::Grow)?;
            self.remove_name(src_dir, src_name, now)?;
            self.remove_name(dst_dir, dst_name, now)?;
            self.add_name(dst_dir, dst_name, src, src_kind, now)?;
            self.add_name(src_dir, src_name, dst_ino, dst_kind, now)?;
            self.log.note_replacing(src);
            self.log.note_replacing(dst_ino);
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
            let dst_is_dir = is_dir_kind(dst_kind);
            match (src_is_dir, dst_is_dir) {
                (true, false) => return Err(EngineError::NotDir),
                (false, true) => return Err(EngineError::IsDir),
                (true, true) if !self.dir_is_empty(dst_ino)? => return Err(EngineError::NotEmpty),
                _ => {}
            }
            let dst_item = self.load_inode(dst_ino)?;
            self.log.note_replacing(src);
            self.need_remove_name(&mut needs, dst_dir, dst_ino);
            self.need_ops(&mut needs, self.shard_of(dst_dir), 1);
            self.need_drop_link(&mut needs, dst_ino, &dst_item)?;
        }
        self.need_remove_name(&mut needs, src_dir, src);
        self.need_add_name(&mut needs, dst_dir, src);
        self.need_ops(&mut needs, self.shard_of(src_dir), 1);
        self.need_ops(&mut needs, self.shard_of(dst_dir), 1);
        self.need_ops(&mut needs, self.shard_of(src), 1);
        self.reserve(&needs, MetaNeed::Grow)?;
        if let Some((dst_ino, dst_kind)) = dst {
            self.remove_name(dst_dir, dst_name, now)?;
            if is_dir_kind(dst_kind) {
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
            .namespace
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
