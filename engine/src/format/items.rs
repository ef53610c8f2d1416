//! Item values: the inode item, names (directory items, index items, inode back-references),
//! file extents and xattrs. All little-endian, each with a fixed header, decoded with bounds
//! checks so a corrupt item is an error, never a panic.
//!
//! Decoding also checks what the engine later does arithmetic with or trusts, so a
//! checksum-valid but impossible value is reported where it is read: file types, sizes and
//! block counts within [`MAX_FILE_BYTES`], counters with room to grow, names as
//! the engine accepts them, extents that neither wrap the block numbers nor start in the
//! superblocks.

use super::{le_u16, le_u32, le_u64, FIRST_REGION_BLOCK};

/// Largest file offset (keeps every byte offset and block count in range); an inode item
/// past it is damaged. The file layer's limit too ([`crate::file::MAX_FILE_BYTES`]).
pub const MAX_FILE_BYTES: u64 = 1 << 50;

/// The first inode number files may have; object ids below it are the engine's own (the
/// space bitmap items, [`crate::fs::SPACE_OBJECTID`]).
pub const FIRST_INODE: u64 = 256;

/// A timestamp: seconds and nanoseconds since the epoch.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Timespec {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        }
    }
}

/// The inode item: (ino, InodeItem, 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InodeItem {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    /// Data blocks allocated to the file.
    pub blocks: u64,
    pub rdev: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub crtime: Timespec,
    /// Generation that created the inode.
    pub generation: u64,
    /// Directories: the next directory-index sequence number (readdir cookie).
    pub next_index: u64,
}

pub const INODE_ITEM_BYTES: usize = 104;
/// The largest inode number disk contents may name (an inode counter, a logged inode): the
/// engine adds the shard count to inode numbers without checking.
pub const MAX_INO: u64 = u64::MAX / 2;
/// The largest directory-index sequence an inode item may hold: each name a directory ever
/// held takes one, and the engine adds to it without checking.
pub const MAX_INDEX: u64 = u64::MAX / 2;

impl InodeItem {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(INODE_ITEM_BYTES);
        for v in [self.mode, self.uid, self.gid, self.nlink] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.size, self.blocks, self.rdev] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for t in [self.atime, self.mtime, self.ctime, self.crtime] {
            b.extend_from_slice(&t.sec.to_le_bytes());
            b.extend_from_slice(&t.nsec.to_le_bytes());
        }
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.next_index.to_le_bytes());
        assert_eq!(b.len(), INODE_ITEM_BYTES);
        b
    }

    pub fn decode(b: &[u8]) -> Result<InodeItem, String> {
        if b.len() != INODE_ITEM_BYTES {
            return Err(format!(
                "inode item is {} bytes, not {INODE_ITEM_BYTES}",
                b.len()
            ));
        }
        let time = |at: usize| Timespec {
            sec: le_u64(b, at) as i64,
            nsec: le_u32(b, at + 8),
        };
        let item = InodeItem {
            mode: le_u32(b, 0),
            uid: le_u32(b, 4),
            gid: le_u32(b, 8),
            nlink: le_u32(b, 12),
            size: le_u64(b, 16),
            blocks: le_u64(b, 24),
            rdev: le_u64(b, 32),
            atime: time(40),
            mtime: time(52),
            ctime: time(64),
            crtime: time(76),
            generation: le_u64(b, 88),
            next_index: le_u64(b, 96),
        };
        if [item.atime, item.mtime, item.ctime, item.crtime]
            .iter()
            .any(|t| t.nsec >= 1_000_000_000)
        {
            return Err("timestamp nanoseconds out of range".into());
        }
        // The types the engine creates (see crate::inode); the checker knows no others.
        const S_IFMT: u32 = 0o170000;
        // Regular, directory, symlink, FIFO, character and block device, socket.
        const TYPES: [u32; 7] = [
            0o100000, 0o040000, 0o120000, 0o010000, 0o020000, 0o060000, 0o140000,
        ];
        if !TYPES.contains(&(item.mode & S_IFMT)) {
            return Err(format!("unknown file type in mode {:o}", item.mode));
        }
        if item.size > MAX_FILE_BYTES || item.blocks > MAX_FILE_BYTES / 4096 {
            return Err(format!(
                "size {} or blocks {} past the largest file",
                item.size, item.blocks
            ));
        }
        if item.next_index > MAX_INDEX {
            return Err(format!("directory index counter {}", item.next_index));
        }
        Ok(item)
    }
}

/// One name in a directory item or inode back-reference list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameEntry {
    /// Directory items: the child inode. Back-references: the directory-index sequence.
    pub target: u64,
    /// Directory items: the child's file type (S_IFMT >> 12). Back-references: unused (0).
    pub kind: u8,
    pub name: Vec<u8>,
}

/// Encodes a list of names (a hash bucket of a directory, or an inode's names in one parent).
pub fn encode_names(entries: &[NameEntry]) -> Vec<u8> {
    let mut b = Vec::new();
    for e in entries {
        b.extend_from_slice(&e.target.to_le_bytes());
        b.push(e.kind);
        b.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        b.extend_from_slice(&e.name);
    }
    b
}

/// Appends one name entry to an encoded list (no intermediate allocation).
pub fn push_name(out: &mut Vec<u8>, target: u64, kind: u8, name: &[u8]) {
    out.extend_from_slice(&target.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
}

/// The name of the entry at `at` in an encoded list, checked: inside the list, 1..=255 bytes,
/// and a name the engine would accept (no "/" or NUL, not "." or "..").
fn entry_name(b: &[u8], at: usize) -> Result<&[u8], String> {
    if at + 11 > b.len() {
        return Err("truncated name entry".into());
    }
    let len = le_u16(b, at + 9) as usize;
    if len == 0 || len > 255 || at + 11 + len > b.len() {
        return Err(format!("name entry of length {len} overruns its item"));
    }
    let name = &b[at + 11..at + 11 + len];
    if name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(format!(
            "impossible name {:?}",
            String::from_utf8_lossy(name)
        ));
    }
    Ok(name)
}

/// Finds `name` in an encoded list without decoding it: (target, kind).
pub fn find_name(b: &[u8], name: &[u8]) -> Result<Option<(u64, u8)>, String> {
    let mut at = 0;
    while at < b.len() {
        let found = entry_name(b, at)?;
        if found == name {
            return Ok(Some((le_u64(b, at), b[at + 8])));
        }
        at += 11 + found.len();
    }
    Ok(None)
}

pub fn decode_names(b: &[u8]) -> Result<Vec<NameEntry>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let name = entry_name(b, at)?;
        out.push(NameEntry {
            target: le_u64(b, at),
            kind: b[at + 8],
            name: name.to_vec(),
        });
        at += 11 + name.len();
    }
    Ok(out)
}

/// One name of an inode in an extended back-reference item
/// (`(ino, InodeExtRef, chain_offset(hash(dir ‖ name), link))`, a chain as directory items
/// are, [`crate::bucket`]): the names of an inode in one directory that no longer fit its
/// [`ItemKind::InodeRef`](super::ItemKind::InodeRef) item. Encoded as index u64 · dir u64 ·
/// name length u16 · name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtRef {
    /// The name's directory-index sequence in its directory.
    pub index: u64,
    /// The directory (8 bytes, little-endian) then the name: what the chain hashes, and what
    /// tells two entries apart.
    id: Vec<u8>,
}

/// Bytes an extended back-reference entry takes besides its name.
pub const EXT_REF_HEADER_BYTES: usize = 18;

impl ExtRef {
    pub fn new(dir: u64, index: u64, name: &[u8]) -> ExtRef {
        ExtRef {
            index,
            id: ExtRef::id_of(dir, name),
        }
    }

    /// What the chain hashes and compares for (`dir`, `name`).
    pub fn id_of(dir: u64, name: &[u8]) -> Vec<u8> {
        let mut id = Vec::with_capacity(8 + name.len());
        id.extend_from_slice(&dir.to_le_bytes());
        id.extend_from_slice(name);
        id
    }

    pub fn dir(&self) -> u64 {
        le_u64(&self.id, 0)
    }

    pub fn name(&self) -> &[u8] {
        &self.id[8..]
    }

    pub fn id(&self) -> &[u8] {
        &self.id
    }
}

pub fn encode_ext_refs(entries: &[ExtRef]) -> Vec<u8> {
    let mut b = Vec::new();
    for e in entries {
        b.extend_from_slice(&e.index.to_le_bytes());
        b.extend_from_slice(&e.dir().to_le_bytes());
        b.extend_from_slice(&(e.name().len() as u16).to_le_bytes());
        b.extend_from_slice(e.name());
    }
    b
}

/// Decodes an extended back-reference item, checking each entry: inside the item, a name the
/// engine would accept, a directory that is an inode number and an index in range.
pub fn decode_ext_refs(b: &[u8]) -> Result<Vec<ExtRef>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        if at + EXT_REF_HEADER_BYTES > b.len() {
            return Err("truncated extended back-reference".into());
        }
        let (index, dir) = (le_u64(b, at), le_u64(b, at + 8));
        let len = le_u16(b, at + 16) as usize;
        let start = at + EXT_REF_HEADER_BYTES;
        if len == 0 || len > 255 || start + len > b.len() {
            return Err(format!(
                "extended back-reference name of length {len} overruns its item"
            ));
        }
        let name = &b[start..start + len];
        if name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
            return Err(format!(
                "impossible name {:?}",
                String::from_utf8_lossy(name)
            ));
        }
        if !(FIRST_INODE..=MAX_INO).contains(&dir) || index > MAX_INDEX {
            return Err(format!(
                "extended back-reference to directory {dir} index {index}"
            ));
        }
        out.push(ExtRef::new(dir, index, name));
        at = start + len;
    }
    Ok(out)
}

/// A file extent item: (ino, ExtentData, file offset in bytes, block aligned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentItem {
    /// First disk block.
    pub disk_block: u64,
    pub blocks: u32,
    /// Preallocated (fallocate): allocated, reads as zeroes, no checksums yet.
    pub prealloc: bool,
    /// crc32c of each 4 KiB block (empty when `prealloc`).
    pub crcs: Vec<u32>,
}

/// Longest extent in one item: its checksums must fit the item.
pub const MAX_EXTENT_BLOCKS: u32 = 256;

impl ExtentItem {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(13 + 4 * self.crcs.len());
        b.push(self.prealloc as u8);
        b.extend_from_slice(&self.disk_block.to_le_bytes());
        b.extend_from_slice(&self.blocks.to_le_bytes());
        for crc in &self.crcs {
            b.extend_from_slice(&crc.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<ExtentItem, String> {
        Self::decode_window(b, 0, u32::MAX)
    }

    /// The block count an encoded item states (unchecked; None when it is too short to
    /// hold one): what a lookup needs to know of an item before decoding any of it.
    pub fn stated_blocks(b: &[u8]) -> Option<u32> {
        (b.len() >= 13).then(|| le_u32(b, 9))
    }

    /// The part of the extent from its block `skip` on, at most `take` blocks, checked as
    /// [`ExtentItem::decode`] checks the whole item: a sub-extent reads as the same blocks
    /// do, and decoding only it spares a reader the checksums of the rest (up to 256).
    pub fn decode_window(b: &[u8], skip: u32, take: u32) -> Result<ExtentItem, String> {
        if b.len() < 13 {
            return Err("extent item shorter than its header".into());
        }
        let prealloc = match b[0] {
            0 => false,
            1 => true,
            f => return Err(format!("unknown extent flags {f}")),
        };
        let blocks = le_u32(b, 9);
        if blocks == 0 || blocks > MAX_EXTENT_BLOCKS {
            return Err(format!("extent of {blocks} blocks"));
        }
        let disk_block = le_u64(b, 1);
        if disk_block < FIRST_REGION_BLOCK || disk_block.checked_add(blocks as u64).is_none() {
            return Err(format!("extent at impossible block {disk_block}"));
        }
        let want = if prealloc { 0 } else { blocks as usize };
        if b.len() != 13 + 4 * want {
            return Err(format!(
                "extent of {blocks} blocks carries {} checksum bytes",
                b.len() - 13
            ));
        }
        if skip >= blocks {
            return Err(format!("block {skip} of an extent of {blocks} blocks"));
        }
        let taken = take.min(blocks - skip);
        let crcs = if prealloc {
            Vec::new()
        } else {
            (skip..skip + taken)
                .map(|i| le_u32(b, 13 + 4 * i as usize))
                .collect()
        };
        Ok(ExtentItem {
            prealloc,
            disk_block: disk_block + skip as u64,
            blocks: taken,
            crcs,
        })
    }
}

/// One extended attribute in an xattr item's chain link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xattr {
    pub name: Vec<u8>,
    pub value: XattrValue,
}

/// Where an xattr's value is: in its chain link, or, when larger than
/// [`XATTR_INLINE_MAX_BYTES`], in pieces of its own (`(ino, XattrValue, xattr_piece_offset(
/// hash, slot, piece))`), `slot` telling apart the large values of names sharing the hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XattrValue {
    Inline(Vec<u8>),
    Pieces { slot: u16, len: u32 },
}

/// Largest value kept in its chain link; larger ones go out in pieces.
pub const XATTR_INLINE_MAX_BYTES: usize = 1024;
/// Bytes per out-of-line piece (one item each).
pub const XATTR_PIECE_BYTES: usize = 1536;

/// The key offset of piece `piece` of the out-of-line value in slot `slot` of hash `hash`.
pub fn xattr_piece_offset(hash: u32, slot: u16, piece: u16) -> u64 {
    (u64::from(hash) << 32) | (u64::from(slot) << 16) | u64::from(piece)
}

const XATTR_PIECES: u8 = 1;

impl Xattr {
    /// Bytes the entry takes in its link.
    pub fn encoded_len(&self) -> usize {
        7 + self.name.len()
            + match &self.value {
                XattrValue::Inline(v) => v.len(),
                XattrValue::Pieces { .. } => 2,
            }
    }
}

/// name length u16 | flags u8 (1: value in pieces) | value length u32 | slot u16 (pieces
/// only) | name | value (inline only), for each entry.
pub fn encode_xattrs(entries: &[Xattr]) -> Vec<u8> {
    let mut b = Vec::new();
    for x in entries {
        b.extend_from_slice(&(x.name.len() as u16).to_le_bytes());
        match &x.value {
            XattrValue::Inline(value) => {
                b.push(0);
                b.extend_from_slice(&(value.len() as u32).to_le_bytes());
                b.extend_from_slice(&x.name);
                b.extend_from_slice(value);
            }
            XattrValue::Pieces { slot, len } => {
                b.push(XATTR_PIECES);
                b.extend_from_slice(&len.to_le_bytes());
                b.extend_from_slice(&slot.to_le_bytes());
                b.extend_from_slice(&x.name);
            }
        }
    }
    b
}

pub fn decode_xattrs(b: &[u8]) -> Result<Vec<Xattr>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        if at + 7 > b.len() {
            return Err("truncated xattr".into());
        }
        let name_len = le_u16(b, at) as usize;
        let flags = b[at + 2];
        let value_len = le_u32(b, at + 3) as usize;
        let (slot, inline_len) = match flags {
            0 => (None, value_len),
            XATTR_PIECES => {
                if at + 9 > b.len() {
                    return Err("truncated xattr".into());
                }
                (Some(le_u16(b, at + 7)), 0)
            }
            f => return Err(format!("unknown xattr flags {f}")),
        };
        let header = if slot.is_some() { 9 } else { 7 };
        if value_len > MAX_XATTR_VALUE_BYTES || (slot.is_some() && value_len == 0) {
            return Err(format!("xattr value of {value_len} bytes"));
        }
        if name_len == 0 || name_len > 255 || at + header + name_len + inline_len > b.len() {
            return Err("xattr overruns its item".into());
        }
        let name = b[at + header..at + header + name_len].to_vec();
        if name.contains(&0) {
            return Err("xattr name holds a NUL".into());
        }
        let value = match slot {
            Some(slot) => XattrValue::Pieces {
                slot,
                len: value_len as u32,
            },
            None => XattrValue::Inline(
                b[at + header + name_len..at + header + name_len + inline_len].to_vec(),
            ),
        };
        out.push(Xattr { name, value });
        at += header + name_len + inline_len;
    }
    Ok(out)
}

/// Largest xattr value (XATTR_SIZE_MAX, what Linux lets any filesystem store).
pub const MAX_XATTR_VALUE_BYTES: usize = 65536;

/// The keyed hash that places a name in its directory item or xattr item: SipHash-1-3 of
/// the name under the filesystem's random key ([`super::Superblock::hash_key`]), 32 bits
/// (fewer when formatted so for tests). Without the key nobody can compute names that
/// collide; names that do collide still all fit, because a hash has a chain of items
/// ([`chain_offset`]), not one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameHasher {
    key: [u8; 16],
    mask: u32,
}

impl NameHasher {
    pub fn new(key: [u8; 16], bits: u8) -> NameHasher {
        assert!((1..=32).contains(&bits), "a name hash has 1 to 32 bits");
        NameHasher {
            key,
            mask: (u64::from(u32::MAX) >> (32 - bits)) as u32,
        }
    }

    pub fn hash(&self, name: &[u8]) -> u32 {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher13::new_with_key(&self.key);
        h.write(name);
        h.finish() as u32 & self.mask
    }
}

/// The key offset of item `link` in the chain of hash `hash`: the hash in the high half,
/// so one hash's items are neighbours in the tree and one range read finds them all.
pub fn chain_offset(hash: u32, link: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(link)
}

/// The hash a chain item's key offset belongs to.
pub fn chain_hash(offset: u64) -> u32 {
    (offset >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_extent_window_is_the_sub_extent_of_those_blocks() {
        let whole = ExtentItem {
            disk_block: FIRST_REGION_BLOCK + 100,
            blocks: 10,
            prealloc: false,
            crcs: (0..10).map(|i| 0xc0de_0000 + i).collect(),
        };
        let bytes = whole.encode();
        assert_eq!(
            ExtentItem::decode_window(&bytes, 0, u32::MAX).unwrap(),
            whole
        );
        let window = ExtentItem::decode_window(&bytes, 3, 4).unwrap();
        assert_eq!(window.disk_block, whole.disk_block + 3);
        assert_eq!(window.blocks, 4);
        assert_eq!(window.crcs, whole.crcs[3..7]);
        let tail = ExtentItem::decode_window(&bytes, 8, 100).unwrap();
        assert_eq!(
            (tail.blocks, tail.crcs.len()),
            (2, 2),
            "cut at the extent's end"
        );
        assert!(
            ExtentItem::decode_window(&bytes, 10, 1).is_err(),
            "past the extent"
        );
        // A window is checked as the whole item is.
        let mut bad = bytes.clone();
        bad.pop();
        assert!(ExtentItem::decode_window(&bad, 3, 4).is_err());
        let prealloc = ExtentItem {
            prealloc: true,
            crcs: Vec::new(),
            ..whole
        };
        let window = ExtentItem::decode_window(&prealloc.encode(), 5, 2).unwrap();
        assert!(window.prealloc && window.crcs.is_empty() && window.blocks == 2);
    }

    #[test]
    fn items_round_trip_and_reject_garbage() {
        let inode = InodeItem {
            mode: 0o100644,
            nlink: 1,
            size: 12345,
            mtime: Timespec { sec: -5, nsec: 7 },
            next_index: 9,
            ..Default::default()
        };
        assert_eq!(InodeItem::decode(&inode.encode()).unwrap(), inode);
        assert!(InodeItem::decode(&[0; 10]).is_err());
        let names = vec![
            NameEntry {
                target: 300,
                kind: 8,
                name: b"a".to_vec(),
            },
            NameEntry {
                target: 301,
                kind: 4,
                name: vec![b'x'; 255],
            },
        ];
        assert_eq!(decode_names(&encode_names(&names)).unwrap(), names);
        let mut bad = encode_names(&names);
        bad.truncate(bad.len() - 1);
        assert!(decode_names(&bad).is_err());
        let extent = ExtentItem {
            disk_block: 77,
            blocks: 2,
            prealloc: false,
            crcs: vec![1, 2],
        };
        assert_eq!(ExtentItem::decode(&extent.encode()).unwrap(), extent);
        let prealloc = ExtentItem {
            disk_block: 7,
            blocks: 9,
            prealloc: true,
            crcs: vec![],
        };
        assert_eq!(ExtentItem::decode(&prealloc.encode()).unwrap(), prealloc);
        assert!(ExtentItem::decode(&extent.encode()[..15]).is_err());
        let xattrs = vec![
            Xattr {
                name: b"user.a".to_vec(),
                value: XattrValue::Inline(vec![]),
            },
            Xattr {
                name: b"user.b".to_vec(),
                value: XattrValue::Inline(vec![1; 100]),
            },
            Xattr {
                name: b"user.c".to_vec(),
                value: XattrValue::Pieces {
                    slot: 3,
                    len: 60_000,
                },
            },
        ];
        let bytes = encode_xattrs(&xattrs);
        assert_eq!(
            bytes.len(),
            xattrs.iter().map(Xattr::encoded_len).sum::<usize>()
        );
        assert_eq!(decode_xattrs(&encode_xattrs(&xattrs)).unwrap(), xattrs);
    }

    /// Well-formed bytes holding values the engine never writes and would later do arithmetic
    /// with or trust: each is refused where it is decoded.
    #[test]
    fn impossible_values_are_refused_by_name() {
        let good = InodeItem {
            mode: 0o100644,
            nlink: 1,
            ..Default::default()
        };
        let refused = |f: &dyn Fn(&mut InodeItem)| {
            let mut item = good;
            f(&mut item);
            InodeItem::decode(&item.encode()).unwrap_err()
        };
        assert!(refused(&|i| i.mode = 0o030644).contains("file type"));
        assert!(refused(&|i| i.mode = 0o644).contains("file type"));
        assert!(refused(&|i| i.blocks = u64::MAX).contains("largest file"));
        assert!(refused(&|i| i.size = MAX_FILE_BYTES + 1).contains("largest file"));
        assert!(refused(&|i| i.next_index = u64::MAX).contains("index counter"));
        for name in [&b"a/b"[..], b".", b"..", b"nul\0"] {
            let entry = NameEntry {
                target: 300,
                kind: 8,
                name: name.to_vec(),
            };
            let bytes = encode_names(&[entry]);
            assert!(decode_names(&bytes)
                .unwrap_err()
                .contains("impossible name"));
            assert!(find_name(&bytes, b"x").is_err());
        }
        let xattr = Xattr {
            name: b"user.\0".to_vec(),
            value: XattrValue::Inline(vec![]),
        };
        assert!(decode_xattrs(&encode_xattrs(&[xattr]))
            .unwrap_err()
            .contains("NUL"));
        for disk_block in [0, u64::MAX - 1] {
            let extent = ExtentItem {
                disk_block,
                blocks: 2,
                prealloc: true,
                crcs: vec![],
            };
            assert!(ExtentItem::decode(&extent.encode())
                .unwrap_err()
                .contains("impossible block"));
        }
    }
}
