//! Chains of bucket items. Every entry whose name hashes to `h` — a name in a directory, an
//! extended attribute of an inode — lives in one of the items
//! `(object, kind, chain_offset(h, link))`, link = 0, 1, 2 … An entry goes into the first link
//! with room for it, or into a new link; a link left empty is removed. So a directory holds
//! any set of distinct names however many share a hash (btrfs keeps colliding names in one
//! item and fails with EOVERFLOW once it is full), and the keyed hash
//! ([`crate::format::items::NameHasher`]) keeps chains short unless a test asks otherwise.
//!
//! # Invariants
//! - A name is in at most one link of its chain; every link on disk holds at least one entry
//!   and at most [`MAX_ITEM_BYTES`] bytes.
//! - Links need not be consecutive (an emptied link leaves a gap): a chain is always read
//!   whole, with one range read over its hash.
//! - A [`Chain`] changed in memory names the links it changed ([`Chain::changed`]); writing
//!   them back is one tree change per link, which operations count in their reservations
//!   ([`CHAIN_LINKS_PER_CHANGE_MAX`]).

use crate::error::{EngineError, Result};
use crate::format::items::{
    chain_hash, chain_offset, decode_ext_refs, decode_names, decode_xattrs, encode_ext_refs,
    encode_names, encode_xattrs, ExtRef, NameEntry, Xattr, XattrValue,
};
use crate::format::node::MAX_ITEM_BYTES;
use crate::format::{ItemKind, Key};
use crate::fs::Filesystem;

/// Links one entry's insertion or removal rewrites: an insertion fills one link (an existing
/// one with room, or a new one), a removal empties or shrinks one; a replacement that no
/// longer fits its link moves (two).
pub(crate) const CHAIN_LINKS_PER_CHANGE_MAX: u64 = 2;

/// What a chain holds: names with their directory entries, or xattrs.
pub(crate) trait Entry: Sized + Clone {
    /// What corruption reports call such an item.
    const WHAT: &'static str;
    fn name(&self) -> &[u8];
    /// Bytes the entry takes in its item.
    fn encoded_len(&self) -> usize;
    fn decode_all(bytes: &[u8]) -> std::result::Result<Vec<Self>, String>;
    fn encode_all(entries: &[Self]) -> Vec<u8>;
}

impl Entry for NameEntry {
    const WHAT: &'static str = "directory item";
    fn name(&self) -> &[u8] {
        &self.name
    }
    fn encoded_len(&self) -> usize {
        11 + self.name.len()
    }
    fn decode_all(bytes: &[u8]) -> std::result::Result<Vec<Self>, String> {
        decode_names(bytes)
    }
    fn encode_all(entries: &[Self]) -> Vec<u8> {
        encode_names(entries)
    }
}

impl Entry for ExtRef {
    const WHAT: &'static str = "extended back-reference";
    fn name(&self) -> &[u8] {
        self.id()
    }
    fn encoded_len(&self) -> usize {
        crate::format::items::EXT_REF_HEADER_BYTES + self.name().len()
    }
    fn decode_all(bytes: &[u8]) -> std::result::Result<Vec<Self>, String> {
        decode_ext_refs(bytes)
    }
    fn encode_all(entries: &[Self]) -> Vec<u8> {
        encode_ext_refs(entries)
    }
}

impl Entry for Xattr {
    const WHAT: &'static str = "xattr item";
    fn name(&self) -> &[u8] {
        &self.name
    }
    fn encoded_len(&self) -> usize {
        Xattr::encoded_len(self)
    }
    fn decode_all(bytes: &[u8]) -> std::result::Result<Vec<Self>, String> {
        decode_xattrs(bytes)
    }
    fn encode_all(entries: &[Self]) -> Vec<u8> {
        encode_xattrs(entries)
    }
}

/// One hash's chain of items, read whole, changed in memory, written back link by link.
pub(crate) struct Chain<E> {
    object: u64,
    kind: ItemKind,
    hash: u32,
    /// (link, its entries), by link.
    links: Vec<(u32, Vec<E>)>,
    /// Links changed since the chain was read.
    changed: Vec<u32>,
}

impl<E: Entry> Chain<E> {
    fn key(&self, link: u32) -> Key {
        Key::new(self.object, self.kind, chain_offset(self.hash, link))
    }

    /// The entry named `name`, if any.
    pub fn get(&self, name: &[u8]) -> Option<&E> {
        self.links
            .iter()
            .flat_map(|(_, entries)| entries.iter())
            .find(|e| e.name() == name)
    }

    /// Adds `entry` (its name is not in the chain) to the first link with room, or to a new
    /// link after the last.
    pub fn insert(&mut self, entry: E) {
        assert!(
            entry.encoded_len() <= MAX_ITEM_BYTES,
            "an entry larger than an item reached a chain"
        );
        let room = self.links.iter().position(|(_, entries)| {
            entries.iter().map(Entry::encoded_len).sum::<usize>() + entry.encoded_len()
                <= MAX_ITEM_BYTES
        });
        let at = match room {
            Some(at) => at,
            None => {
                // Links are u32 and each holds an entry: a chain cannot have 2^32 of them
                // before the shard's space runs out.
                let link = self.links.last().map_or(0, |(l, _)| l + 1);
                self.links.push((link, Vec::new()));
                self.links.len() - 1
            }
        };
        self.links[at].1.push(entry);
        self.note_changed(self.links[at].0);
    }

    /// Removes the entry named `name`; returns it.
    pub fn remove(&mut self, name: &[u8]) -> Option<E> {
        for (link, entries) in &mut self.links {
            if let Some(i) = entries.iter().position(|e| e.name() == name) {
                let entry = entries.remove(i);
                let link = *link;
                self.note_changed(link);
                return Some(entry);
            }
        }
        None
    }

    /// Every entry, link by link.
    pub fn entries(&self) -> impl Iterator<Item = &E> {
        self.links.iter().flat_map(|(_, entries)| entries.iter())
    }

    fn note_changed(&mut self, link: u32) {
        if !self.changed.contains(&link) {
            self.changed.push(link);
        }
    }

    /// The links changed, as (key, encoded bytes; empty = remove the item).
    pub fn changed(&self) -> Vec<(Key, Vec<u8>)> {
        self.changed
            .iter()
            .map(|&link| {
                let entries = self
                    .links
                    .iter()
                    .find(|(l, _)| *l == link)
                    .map_or(&[][..], |(_, e)| &e[..]);
                (self.key(link), E::encode_all(entries))
            })
            .collect()
    }
}

impl Chain<Xattr> {
    /// The lowest out-of-line value slot no entry of this chain holds.
    pub fn lowest_free_slot(&self) -> Result<u16> {
        let used: std::collections::BTreeSet<u16> = self
            .entries()
            .filter_map(|x| match x.value {
                XattrValue::Pieces { slot, .. } => Some(slot),
                XattrValue::Inline(_) => None,
            })
            .collect();
        (0..=u16::MAX)
            .find(|s| !used.contains(s))
            .ok_or(EngineError::NoSpace)
    }
}

impl Filesystem {
    /// Reads the chain of `hash` among `object`'s items of kind `kind` (in `object`'s shard).
    pub(crate) fn read_chain<E: Entry>(
        &mut self,
        object: u64,
        kind: ItemKind,
        hash: u32,
    ) -> Result<Chain<E>> {
        let shard = self.shard_of(object);
        let start = Key::new(object, kind, chain_offset(hash, 0));
        let end = Key::new(object, kind, chain_offset(hash, u32::MAX))
            .successor()
            .expect("a chain key has a successor");
        let items = self.with_tree(shard, false, |tree, io| tree.range(io, start, end))?;
        let mut links = Vec::with_capacity(items.len());
        for (key, bytes) in items {
            debug_assert_eq!(chain_hash(key.offset), hash);
            let entries = E::decode_all(&bytes)
                .map_err(|why| EngineError::corrupt_inode(E::WHAT, object, why))?;
            if entries.is_empty() || bytes.len() > MAX_ITEM_BYTES {
                return Err(EngineError::corrupt_inode(
                    E::WHAT,
                    object,
                    format!("chain link {:#x} is empty or overfull", key.offset),
                ));
            }
            links.push((key.offset as u32, entries));
        }
        Ok(Chain {
            object,
            kind,
            hash,
            links,
            changed: Vec::new(),
        })
    }

    /// Writes back the links `chain` changed (one tree change each).
    pub(crate) fn write_chain<E: Entry>(&mut self, chain: &Chain<E>) -> Result<()> {
        let shard = self.shard_of(chain.object);
        for (key, bytes) in chain.changed() {
            self.put_bucket(shard, key, bytes, E::WHAT)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain() -> Chain<NameEntry> {
        Chain {
            object: 300,
            kind: ItemKind::DirItem,
            hash: 7,
            links: Vec::new(),
            changed: Vec::new(),
        }
    }

    fn entry(i: u64) -> NameEntry {
        NameEntry {
            target: 1000 + i,
            kind: 8,
            name: format!("{i:0>255}").into_bytes(),
        }
    }

    #[test]
    fn colliding_names_spill_into_new_links_and_emptied_links_are_removed() {
        let mut c = chain();
        // 266-byte entries: 7 fit one 1995-byte item.
        for i in 0..20 {
            c.insert(entry(i));
        }
        assert_eq!(c.links.len(), 3);
        assert!(c
            .changed()
            .iter()
            .all(|(_, b)| b.len() <= MAX_ITEM_BYTES && !b.is_empty()));
        for i in 0..20 {
            assert_eq!(c.get(&entry(i).name).unwrap().target, 1000 + i);
        }
        let keys: Vec<u64> = c.changed().iter().map(|(k, _)| k.offset).collect();
        assert_eq!(
            keys,
            vec![chain_offset(7, 0), chain_offset(7, 1), chain_offset(7, 2)]
        );
        let mut c = Chain {
            changed: Vec::new(),
            ..c
        };
        for i in 7..14 {
            assert!(c.remove(&entry(i).name).is_some());
        }
        let changed = c.changed();
        assert_eq!(changed.len(), 1);
        assert!(changed[0].1.is_empty(), "an emptied link is removed");
        // A new entry fills the first link with room again.
        let mut c = Chain {
            changed: Vec::new(),
            ..c
        };
        c.remove(&entry(0).name);
        c.insert(entry(99));
        assert_eq!(c.changed.as_slice(), &[0]);
    }
}
