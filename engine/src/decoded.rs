//! Decoded metadata kept in memory: inode items and the name chains of directories, as
//! lookups use them ([`DecodedCache`]). A `stat` of `dir/file` loads three inode items
//! and two name chains; from the tree each is a root-to-leaf descent (a binary search in
//! every node, a cache miss per level) and a decode, and together they were most of the
//! 1.5 µs such a call cost in the caller's thread (perf, abi-stat) — the kernel's dentry
//! and inode caches answer it in 0.6 µs. From here each is one hash lookup.
//!
//! # Invariants
//! - **Coherent by construction.** Every tree change of an engine passes through
//!   [`crate::fs::Filesystem::with_tree`], which hands each changed key here
//!   ([`DecodedCache::forget`]) before anything reads again: an inode item changed or
//!   removed drops that inode; a directory item changed or removed drops its chain. So an
//!   entry is always what the tree holds now, however the change was made (an operation,
//!   log replay, an orphan's deletion). Debug builds check every hit against the tree.
//! - Only items of shards this engine holds are here: an engine that gives shards away or
//!   takes them in ([`crate::fs::Filesystem::take_shards`], `put_shards`) forgets all, since
//!   another engine may change them meanwhile.
//! - A chain entry holds *every* name of its hash in that directory, so a name missing from
//!   it is absent from the directory (a negative answer, which a create's lookup needs).
//! - Bounded: at most [`INODES_MAX`] inodes and [`CHAINS_MAX`] chains; a full map is emptied
//!   before the next insert (amortized O(1), no eviction order to keep on the hot path).
//! - Memory only: nothing here is written, and losing it all costs only lookups.

use crate::format::items::{chain_hash, InodeItem, NameEntry};
use crate::format::{ItemKind, Key};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Inode items kept decoded (about 130 bytes each with the map's overhead: 4 MiB at most).
pub const INODES_MAX: usize = 32 * 1024;
/// Name chains kept decoded (a chain holds the names of one hash: usually one).
pub const CHAINS_MAX: usize = 32 * 1024;

/// Hashes the integer keys here (inode numbers, and a directory's inode with a name hash
/// that is already keyed per filesystem) by one multiplication: SipHash's 20 ns per lookup
/// would be a tenth of the lookup it saves, and nobody outside picks these keys.
#[derive(Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // Fibonacci hashing: the high bits of the product mix every input bit; the map
        // takes its bucket from the low bits and its tag from the top ones, so both move.
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.rotate_left(23) ^ v;
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
}

type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// Hits and misses, for the mount's statistics and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodedStats {
    pub inode_hits: u64,
    pub inode_misses: u64,
    pub chain_hits: u64,
    pub chain_misses: u64,
    /// Times a full map was emptied.
    pub resets: u64,
}

/// See the module docs.
#[derive(Default)]
pub struct DecodedCache {
    inodes: IntMap<u64, InodeItem>,
    /// (directory, name hash) → every name of that hash in the directory.
    chains: IntMap<(u64, u32), Box<[NameEntry]>>,
    pub(crate) stats: DecodedStats,
}

impl DecodedCache {
    /// The inode item of `ino`, if kept.
    pub fn inode(&mut self, ino: u64) -> Option<InodeItem> {
        let found = self.inodes.get(&ino).copied();
        match found {
            Some(_) => self.stats.inode_hits += 1,
            None => self.stats.inode_misses += 1,
        }
        found
    }

    /// Keeps `item` as `ino`'s (just read from, or just written to, the tree).
    pub fn put_inode(&mut self, ino: u64, item: InodeItem) {
        if self.inodes.len() >= INODES_MAX && !self.inodes.contains_key(&ino) {
            self.inodes.clear();
            self.stats.resets += 1;
        }
        self.inodes.insert(ino, item);
    }

    /// The target and kind of `name` in `dir` if the chain of `hash` is kept: `Some(None)`
    /// when it is kept and the name is not in it.
    pub fn name(&mut self, dir: u64, hash: u32, name: &[u8]) -> Option<Option<(u64, u8)>> {
        let Some(chain) = self.chains.get(&(dir, hash)) else {
            self.stats.chain_misses += 1;
            return None;
        };
        self.stats.chain_hits += 1;
        Some(
            chain
                .iter()
                .find(|e| e.name == name)
                .map(|e| (e.target, e.kind)),
        )
    }

    /// Keeps the whole chain of `hash` in `dir` (every name it holds, just read).
    pub fn put_chain<'a>(
        &mut self,
        dir: u64,
        hash: u32,
        entries: impl Iterator<Item = &'a NameEntry>,
    ) {
        if self.chains.len() >= CHAINS_MAX && !self.chains.contains_key(&(dir, hash)) {
            self.chains.clear();
            self.stats.resets += 1;
        }
        self.chains.insert((dir, hash), entries.cloned().collect());
    }

    /// A tree item changed (inserted, replaced or removed): drops what it decodes to.
    pub fn forget(&mut self, key: &Key) {
        match key.kind {
            ItemKind::InodeItem => {
                self.inodes.remove(&key.objectid);
            }
            ItemKind::DirItem => {
                self.chains.remove(&(key.objectid, chain_hash(key.offset)));
            }
            _ => {}
        }
    }

    /// Drops everything (shards changed hands).
    pub fn clear(&mut self) {
        self.inodes.clear();
        self.chains.clear();
    }

    /// Inodes and chains kept now.
    pub fn len(&self) -> (usize, usize) {
        (self.inodes.len(), self.chains.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::items::chain_offset;

    fn entry(name: &str, target: u64) -> NameEntry {
        NameEntry {
            target,
            kind: 1,
            name: name.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_changed_item_drops_what_it_decodes_to_and_nothing_else() {
        let mut c = DecodedCache::default();
        c.put_inode(300, InodeItem::default());
        c.put_inode(301, InodeItem::default());
        c.put_chain(300, 7, [entry("a", 400), entry("b", 401)].iter());
        c.put_chain(300, 8, [entry("c", 402)].iter());
        assert_eq!(c.name(300, 7, b"b"), Some(Some((401, 1))));
        assert_eq!(
            c.name(300, 7, b"z"),
            Some(None),
            "a kept chain answers absence"
        );
        assert_eq!(
            c.name(300, 9, b"a"),
            None,
            "a chain not kept answers nothing"
        );

        // Any link of the chain changing drops the chain of that hash only.
        c.forget(&Key::new(300, ItemKind::DirItem, chain_offset(7, 3)));
        assert_eq!(c.name(300, 7, b"a"), None);
        assert_eq!(c.name(300, 8, b"c"), Some(Some((402, 1))));
        // Another kind of the same object leaves the inode alone.
        c.forget(&Key::new(300, ItemKind::DirIndex, 5));
        assert!(c.inode(300).is_some());
        c.forget(&Key::new(300, ItemKind::InodeItem, 0));
        assert!(c.inode(300).is_none());
        assert!(c.inode(301).is_some());
        assert_eq!(c.stats.inode_hits, 2);
        assert_eq!(c.stats.inode_misses, 1);
    }

    #[test]
    fn the_maps_stay_within_their_bounds() {
        let mut c = DecodedCache::default();
        for ino in 0..(INODES_MAX as u64 * 2 + 5) {
            c.put_inode(ino, InodeItem::default());
            c.put_chain(ino, 1, [entry("x", ino)].iter());
            let (inodes, chains) = c.len();
            assert!(inodes <= INODES_MAX && chains <= CHAINS_MAX);
        }
        assert_eq!(c.stats.resets, 4);
        // Replacing a kept entry in a full map keeps the others.
        let last = INODES_MAX as u64 * 2 + 4;
        let before = c.len();
        c.put_inode(last, InodeItem::default());
        assert_eq!(c.len(), before);
    }
}
