//! The checker (`corefs fsck` and every test): walks every shard's tree and verifies every
//! invariant the engine promises, reporting the first violation with what and where.
//!
//! - tree structure: checksums, addresses, generations, key order and bounds, fill limits;
//! - placement: every item of inode `i` is in shard `i % shards`;
//! - names: each directory-item entry has the matching index item and inode back-reference,
//!   and vice versa; each is in its hash's chain, chain links are never empty and a name or
//!   an attribute appears once; every name points at an existing inode;
//! - link counts: a file's nlink is its number of names; a directory's is 2 + subdirectories;
//!   every inode but the root has a name;
//! - data: extents of an inode never overlap; `blocks` matches them; every data block is
//!   in a block group the inode's shard owns, and used once;
//! - space: the bitmap marks exactly the tree blocks plus the data blocks; every block group
//!   is owned by one shard or free, as the pool's table says.

use crate::error::{EngineError, Result};
use crate::format::items::{
    chain_hash, decode_ext_refs, decode_names, decode_xattrs, ExtentItem, InodeItem, XattrValue,
};
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use crate::fs::{Filesystem, ShardIo, FIRST_INODE, SPACE_OBJECTID};
use crate::inode::{
    INO_COUNTER_OBJECTID, ORPHAN_OBJECTID, ROOT_INO, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK,
    S_IFMT, S_IFREG, S_IFSOCK,
};
use std::collections::{BTreeMap, BTreeSet};

/// What the checker saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub items: u64,
    pub inodes: u64,
    pub directories: u64,
    pub names: u64,
    pub tree_blocks: u64,
    pub data_blocks: u64,
}

/// An item-level fault of inode `ino`.
fn bad(what: &'static str, ino: u64, why: impl Into<String>) -> EngineError {
    EngineError::corrupt_inode(what, ino, why)
}

impl Filesystem {
    /// Reads every data block every extent references and verifies its crc32c (what
    /// `btrfs check --check-data-csum` does); names the inode and block of the first that
    /// fails. `progress` hears after each shard. Returns the blocks verified.
    pub fn check_data(&mut self, progress: &mut dyn FnMut(u32, u32)) -> Result<u64> {
        let mut verified = 0u64;
        let shards = self.shard_count();
        for shard in 0..shards {
            let items = self.range_items(
                shard,
                Key::new(FIRST_INODE, ItemKind::InodeItem, 0),
                Key::MAX,
            )?;
            let mut extents: Vec<(u64, ExtentItem)> = Vec::new();
            for (key, value) in items {
                if key.kind != ItemKind::ExtentData {
                    continue;
                }
                let item = ExtentItem::decode(&value)
                    .map_err(|why| bad("extent item", key.objectid, why))?;
                // Read nothing outside the shard's block groups (another shard's blocks, the
                // log, past the device): that is corruption, not a device error.
                let in_region = self.shards[shard as usize]
                    .as_ref()
                    .is_some_and(|s| s.space.contains(item.disk_block, item.blocks as u64));
                if !in_region {
                    return Err(bad(
                        "extent item",
                        key.objectid,
                        format!(
                            "data blocks {}+{} outside shard {shard}'s block groups",
                            item.disk_block, item.blocks
                        ),
                    ));
                }
                if !item.prealloc {
                    extents.push((key.objectid, item));
                }
            }
            // Reads go out 64 extents at a time, all in flight together.
            for chunk in extents.chunks(64) {
                let runs: Vec<(u64, u64)> = chunk
                    .iter()
                    .map(|(_, e)| (e.disk_block, e.blocks as u64))
                    .collect();
                let data = crate::blocks::read_runs(&mut *self.dev, &runs)?;
                for ((ino, extent), bytes) in chunk.iter().zip(data) {
                    for (i, block) in bytes.chunks(BLOCK_BYTES).enumerate() {
                        let crc = crc32c::crc32c(block);
                        if crc != extent.crcs[i] {
                            return Err(EngineError::corrupt(
                                "data block",
                                extent.disk_block + i as u64,
                                format!(
                                    "checksum mismatch in inode {ino} (stored {:#010x}, computed {crc:#010x})",
                                    extent.crcs[i]
                                ),
                            ));
                        }
                    }
                    verified += extent.blocks as u64;
                }
            }
            progress(shard + 1, shards);
        }
        Ok(verified)
    }

    /// Verifies every invariant; see the module docs.
    pub fn check(&mut self) -> Result<CheckReport> {
        let mut report = CheckReport::default();
        let shard_count = self.shard_count() as u64;
        let mut inodes: BTreeMap<u64, InodeItem> = BTreeMap::new();
        // (dir, name) → (child, kind) from directory items; from index items with their seq.
        let mut dir_items: BTreeMap<(u64, Vec<u8>), (u64, u8)> = BTreeMap::new();
        let mut index_items: BTreeMap<(u64, Vec<u8>), (u64, u8, u64)> = BTreeMap::new();
        // (child, dir, name) → seq from back-references.
        let mut back_refs: BTreeMap<(u64, u64, Vec<u8>), u64> = BTreeMap::new();
        let mut extents: BTreeMap<u64, Vec<(u64, ExtentItem)>> = BTreeMap::new();
        // (inode, attribute name): each attribute once over its whole chain.
        let mut xattr_names: BTreeSet<(u64, Vec<u8>)> = BTreeSet::new();
        let hasher = self.sb.name_hasher();
        // Orphans: inodes marked, and listed in their shard's index.
        let mut orphan_marks: BTreeSet<u64> = BTreeSet::new();
        let mut orphan_index: BTreeSet<u64> = BTreeSet::new();
        // Symlink target pieces, per inode: (piece, bytes).
        let mut symlink_pieces: BTreeMap<u64, Vec<(u64, usize)>> = BTreeMap::new();
        let mut inodes_per_shard: BTreeMap<u32, u64> = BTreeMap::new();
        // What each shard's count says (compared last: a wrong count follows from the more
        // specific faults the walk names first).
        let mut counted_inodes: BTreeMap<u32, u64> = BTreeMap::new();
        // Out-of-line xattr values: (ino, hash, slot) → length the entry says, and the pieces
        // found (piece, bytes).
        let mut xattr_values: BTreeMap<(u64, u32, u16), u32> = BTreeMap::new();
        let mut xattr_pieces: BTreeMap<(u64, u32, u16), Vec<(u16, usize)>> = BTreeMap::new();

        for shard in 0..self.shard_count() {
            let generation = self.commit.generation;
            let Some(crate::fs::Shard {
                tree,
                space,
                inodes: io_inodes,
            }) = self.shards[shard as usize].as_mut()
            else {
                continue;
            };
            let mut io = ShardIo {
                dev: &mut *self.dev,
                space,
                generation,
                for_commit: false,
                commit_floor: 0,
                fetch: None,
                unsubmitted: self.commit.in_flight.as_ref().map_or(&[], |c| &c.chunk),
            };
            let (count, mut blocks) = tree.check(&mut io)?;
            report.items += count;
            let items = tree.range(&mut io, Key::MIN, Key::MAX)?;
            let mut data_blocks: Vec<u64> = Vec::new();
            for (key, value) in items {
                let ino = key.objectid;
                if key.kind == ItemKind::Test {
                    continue; // items of the tree-level tests
                }
                if ino >= FIRST_INODE && ino % shard_count != shard as u64 {
                    return Err(bad(
                        "item placement",
                        ino,
                        format!("{key:?} is in shard {shard}"),
                    ));
                }
                match key.kind {
                    _ if ino == SPACE_OBJECTID || ino == INO_COUNTER_OBJECTID => {}
                    ItemKind::OrphanIndex if ino == ORPHAN_OBJECTID => {
                        if key.offset % shard_count != shard as u64 {
                            return Err(bad(
                                "orphan index",
                                key.offset,
                                format!("listed in shard {shard}"),
                            ));
                        }
                        orphan_index.insert(key.offset);
                    }
                    ItemKind::OrphanMark => {
                        orphan_marks.insert(ino);
                    }
                    ItemKind::InodeItem => {
                        *inodes_per_shard.entry(shard).or_default() += 1;
                        let item =
                            InodeItem::decode(&value).map_err(|why| bad("inode item", ino, why))?;
                        inodes.insert(ino, item);
                    }
                    ItemKind::DirItem => {
                        let names =
                            decode_names(&value).map_err(|why| bad("directory item", ino, why))?;
                        if names.is_empty() {
                            return Err(bad("directory item", ino, "an empty chain link"));
                        }
                        for e in names {
                            if hasher.hash(&e.name) != chain_hash(key.offset) {
                                return Err(bad(
                                    "directory item",
                                    ino,
                                    "name in the wrong hash bucket",
                                ));
                            }
                            if dir_items
                                .insert((ino, e.name.clone()), (e.target, e.kind))
                                .is_some()
                            {
                                return Err(bad("directory item", ino, "duplicate name"));
                            }
                        }
                    }
                    ItemKind::DirIndex => {
                        let mut list =
                            decode_names(&value).map_err(|why| bad("directory index", ino, why))?;
                        if list.len() != 1 {
                            return Err(bad(
                                "directory index",
                                ino,
                                "index item holds more than one name",
                            ));
                        }
                        let e = list.remove(0);
                        if index_items
                            .insert((ino, e.name), (e.target, e.kind, key.offset))
                            .is_some()
                        {
                            return Err(bad("directory index", ino, "name indexed twice"));
                        }
                    }
                    ItemKind::InodeRef => {
                        for e in decode_names(&value)
                            .map_err(|why| bad("inode back-reference", ino, why))?
                        {
                            if back_refs
                                .insert((ino, key.offset, e.name), e.target)
                                .is_some()
                            {
                                return Err(bad("inode back-reference", ino, "a name twice"));
                            }
                        }
                    }
                    ItemKind::InodeExtRef => {
                        let refs = decode_ext_refs(&value)
                            .map_err(|why| bad("extended back-reference", ino, why))?;
                        if refs.is_empty() {
                            return Err(bad("extended back-reference", ino, "an empty chain link"));
                        }
                        for e in refs {
                            if hasher.hash(e.id()) != chain_hash(key.offset) {
                                return Err(bad(
                                    "extended back-reference",
                                    ino,
                                    "name in the wrong hash chain",
                                ));
                            }
                            // Also a name its InodeRef item holds: one name, two references.
                            let at = (ino, e.dir(), e.name().to_vec());
                            if back_refs.insert(at, e.index).is_some() {
                                return Err(bad("extended back-reference", ino, "a name twice"));
                            }
                        }
                    }
                    ItemKind::ExtentData => {
                        if key.offset % BLOCK_BYTES as u64 != 0 {
                            return Err(bad(
                                "extent item",
                                ino,
                                format!("unaligned file offset {}", key.offset),
                            ));
                        }
                        let extent = ExtentItem::decode(&value)
                            .map_err(|why| bad("extent item", ino, why))?;
                        extents
                            .entry(ino)
                            .or_default()
                            .push((key.offset / BLOCK_BYTES as u64, extent));
                    }
                    ItemKind::SymlinkTarget => {
                        if value.is_empty() {
                            return Err(bad("symlink", ino, "an empty target piece"));
                        }
                        symlink_pieces
                            .entry(ino)
                            .or_default()
                            .push((key.offset, value.len()));
                    }
                    ItemKind::XattrValue => {
                        if value.is_empty() {
                            return Err(bad("xattr value", ino, "an empty piece"));
                        }
                        let at = (ino, chain_hash(key.offset), (key.offset >> 16) as u16);
                        xattr_pieces
                            .entry(at)
                            .or_default()
                            .push((key.offset as u16, value.len()));
                    }
                    ItemKind::XattrItem => {
                        let xattrs =
                            decode_xattrs(&value).map_err(|why| bad("xattr item", ino, why))?;
                        if xattrs.is_empty() {
                            return Err(bad("xattr item", ino, "an empty chain link"));
                        }
                        let mut names = BTreeSet::new();
                        for x in xattrs {
                            if hasher.hash(&x.name) != chain_hash(key.offset) {
                                return Err(bad(
                                    "xattr item",
                                    ino,
                                    "attribute in the wrong hash chain",
                                ));
                            }
                            if !xattr_names.insert((ino, x.name.clone())) || !names.insert(x.name) {
                                return Err(bad("xattr item", ino, "duplicate attribute"));
                            }
                            if let XattrValue::Pieces { slot, len } = x.value {
                                let at = (ino, chain_hash(key.offset), slot);
                                if xattr_values.insert(at, len).is_some() {
                                    return Err(bad("xattr item", ino, "two values in one slot"));
                                }
                            }
                        }
                    }
                    _ => {
                        return Err(bad(
                            "item",
                            ino,
                            format!("unexpected item kind {:?}", key.kind),
                        ))
                    }
                }
            }
            // Data blocks of this shard's inodes.
            for (&ino, list) in extents.range(0..) {
                if ino % shard_count != shard as u64 {
                    continue;
                }
                for (_, extent) in list {
                    for b in extent.disk_block..extent.disk_block + extent.blocks as u64 {
                        if !io.space.owns(b) {
                            return Err(bad(
                                "extent item",
                                ino,
                                format!("data block {b} outside shard {shard}'s block groups"),
                            ));
                        }
                        data_blocks.push(b);
                    }
                }
            }
            counted_inodes.insert(shard, *io_inodes);
            report.tree_blocks += blocks.len() as u64;
            report.data_blocks += data_blocks.len() as u64;
            blocks.extend(data_blocks);
            blocks.sort_unstable();
            if let Some(w) = blocks.windows(2).find(|w| w[0] == w[1]) {
                return Err(EngineError::corrupt(
                    "space",
                    w[0],
                    format!("shard {shard}: block used twice"),
                ));
            }
            for &block in &blocks {
                if !io.space.is_allocated(block) {
                    return Err(EngineError::corrupt(
                        "space bitmap",
                        block,
                        format!("shard {shard}: block in use but marked free"),
                    ));
                }
            }
            if io.space.allocated_blocks() != blocks.len() as u64 {
                return Err(EngineError::corrupt(
                    "space bitmap",
                    shard as u64,
                    format!(
                        "shard {shard}: {} blocks marked allocated, {} in use (leak)",
                        io.space.allocated_blocks(),
                        blocks.len()
                    ),
                ));
            }
        }

        // Every group is owned by the shard the pool says, or free.
        let spaces: Vec<&crate::space::Space> = self.held().map(|s| &s.space).collect();
        self.pool
            .check(&spaces)
            .map_err(|why| EngineError::corrupt("block groups", 0, why))?;

        // Delayed index items count as index items (they are the tree's, not yet inserted).
        for (dir, seq, entry) in self.namespace.delayed.all() {
            if index_items
                .insert((dir, entry.name.clone()), (entry.target, entry.kind, seq))
                .is_some()
            {
                return Err(bad(
                    "directory index",
                    dir,
                    "name both delayed and in the tree",
                ));
            }
        }

        // Names: the three views agree.
        for ((dir, name), (child, kind)) in &dir_items {
            match index_items.get(&(*dir, name.clone())) {
                Some((c, k, seq)) if c == child && k == kind => {
                    if back_refs.get(&(*child, *dir, name.clone())) != Some(seq) {
                        return Err(bad(
                            "inode back-reference",
                            *child,
                            format!("missing or wrong for a name in directory {dir}"),
                        ));
                    }
                }
                _ => {
                    return Err(bad(
                        "directory index",
                        *dir,
                        format!("no index item matching {:?}", String::from_utf8_lossy(name)),
                    ))
                }
            }
            let Some(child_item) = inodes.get(child) else {
                return Err(bad(
                    "directory item",
                    *dir,
                    format!("names missing inode {child}"),
                ));
            };
            if (child_item.mode & S_IFMT) >> 12 != *kind as u32 {
                return Err(bad(
                    "directory item",
                    *dir,
                    format!("type of inode {child} disagrees"),
                ));
            }
        }
        if index_items.len() != dir_items.len() || back_refs.len() != dir_items.len() {
            return Err(bad(
                "directory index",
                0,
                format!(
                    "{} names, {} index items, {} back-references",
                    dir_items.len(),
                    index_items.len(),
                    back_refs.len()
                ),
            ));
        }
        report.names = dir_items.len() as u64;

        // Link counts and reachability.
        let mut names_of: BTreeMap<u64, u32> = BTreeMap::new();
        let mut subdirs: BTreeMap<u64, u32> = BTreeMap::new();
        for ((dir, _), (child, kind)) in &dir_items {
            *names_of.entry(*child).or_default() += 1;
            if *kind as u32 == S_IFDIR >> 12 {
                *subdirs.entry(*dir).or_default() += 1;
            }
        }
        for (&ino, item) in &inodes {
            report.inodes += 1;
            let names = names_of.get(&ino).copied().unwrap_or(0);
            match item.mode & S_IFMT {
                S_IFDIR => {
                    report.directories += 1;
                    // A removed directory still held open is an empty orphan with nlink 0.
                    let orphan = orphan_marks.contains(&ino);
                    let want = if orphan {
                        0
                    } else {
                        2 + subdirs.get(&ino).copied().unwrap_or(0)
                    };
                    if item.nlink != want {
                        return Err(bad(
                            "inode item",
                            ino,
                            format!("directory nlink {} but {} expected", item.nlink, want),
                        ));
                    }
                    if ino != ROOT_INO && names != 1 && !orphan {
                        return Err(bad(
                            "inode item",
                            ino,
                            format!("directory with {names} names"),
                        ));
                    }
                }
                S_IFREG | S_IFLNK | S_IFIFO | S_IFCHR | S_IFBLK | S_IFSOCK => {
                    if item.nlink != names {
                        return Err(bad(
                            "inode item",
                            ino,
                            format!("nlink {} but {names} names", item.nlink),
                        ));
                    }
                }
                other => {
                    return Err(bad(
                        "inode item",
                        ino,
                        format!("unknown file type {other:o}"),
                    ))
                }
            }
            // An inode without a name is an orphan (open when its last name went): nlink 0,
            // marked and indexed, so the next mount deletes it. Anything else is lost.
            let orphan = orphan_marks.contains(&ino);
            if orphan != orphan_index.contains(&ino) {
                return Err(bad(
                    "orphan index",
                    ino,
                    "orphan mark and index item disagree",
                ));
            }
            if ino != ROOT_INO && names == 0 && !(orphan && item.nlink == 0) {
                return Err(bad("inode item", ino, "no name reaches it (orphan)"));
            }
            if orphan && (item.nlink != 0 || names != 0) {
                return Err(bad("orphan mark", ino, "on an inode that still has names"));
            }
            if item.mode & S_IFMT == S_IFLNK {
                let pieces = symlink_pieces.remove(&ino).unwrap_or_default();
                let bytes: usize = pieces.iter().map(|(_, len)| len).sum();
                let in_order = pieces.iter().enumerate().all(|(i, (p, _))| *p == i as u64);
                if !in_order || bytes == 0 || bytes as u64 != item.size {
                    return Err(bad(
                        "symlink",
                        ino,
                        format!(
                            "target pieces hold {bytes} bytes, the inode says {}",
                            item.size
                        ),
                    ));
                }
            }
            if item.mode & S_IFMT == S_IFREG {
                let mut list = extents.remove(&ino).unwrap_or_default();
                list.sort_by_key(|(b, _)| *b);
                let mut end = 0;
                let mut total = 0;
                for (first, extent) in &list {
                    if *first < end {
                        return Err(bad(
                            "extent item",
                            ino,
                            format!("extents overlap at file block {first}"),
                        ));
                    }
                    end = first + extent.blocks as u64;
                    total += extent.blocks as u64;
                }
                if total != item.blocks {
                    return Err(bad(
                        "inode item",
                        ino,
                        format!("blocks {} but extents hold {total}", item.blocks),
                    ));
                }
            }
        }
        if let Some(&ino) = orphan_marks
            .iter()
            .chain(&orphan_index)
            .find(|i| !inodes.contains_key(i))
        {
            return Err(bad("orphan mark", ino, "of a missing inode"));
        }
        for (at, pieces) in &xattr_pieces {
            let Some(&len) = xattr_values.get(at) else {
                return Err(bad("xattr value", at.0, "pieces no attribute owns"));
            };
            let bytes: usize = pieces.iter().map(|(_, b)| b).sum();
            let in_order = pieces
                .iter()
                .enumerate()
                .all(|(i, (p, _))| *p as usize == i);
            if !in_order || bytes != len as usize {
                return Err(bad(
                    "xattr value",
                    at.0,
                    format!("pieces hold {bytes} bytes, the attribute says {len}"),
                ));
            }
        }
        if let Some((at, _)) = xattr_values
            .iter()
            .find(|(at, _)| !xattr_pieces.contains_key(at))
        {
            return Err(bad(
                "xattr value",
                at.0,
                "an attribute's pieces are missing",
            ));
        }
        if let Some((&ino, _)) = symlink_pieces.iter().next() {
            return Err(bad(
                "symlink",
                ino,
                "target of a missing inode or non-symlink",
            ));
        }
        if let Some((&ino, _)) = extents.iter().next() {
            return Err(bad(
                "extent item",
                ino,
                "extents of a missing inode or non-file",
            ));
        }
        if !inodes.contains_key(&ROOT_INO) {
            return Err(bad("inode item", ROOT_INO, "root directory missing"));
        }
        let referenced: BTreeSet<u64> = dir_items.values().map(|(c, _)| *c).collect();
        if let Some(missing) = referenced.iter().find(|c| !inodes.contains_key(c)) {
            return Err(bad("directory item", *missing, "names a missing inode"));
        }
        for (&shard, &counted) in &counted_inodes {
            let held = inodes_per_shard.get(&shard).copied().unwrap_or(0);
            if counted != held {
                return Err(bad(
                    "inode count",
                    shard as u64,
                    format!("shard {shard} counts {counted} inodes, its tree holds {held}"),
                ));
            }
        }
        Ok(report)
    }
}
