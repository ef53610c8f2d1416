//! Item keys, btrfs-style: (object id, item kind, offset), ordered in that order. An inode's
//! items sort together; within an inode, by kind; within a kind, by offset (file offset for
//! extents, name hash for directory items, sequence for directory index items).

/// What an item holds. The numeric values are on disk: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum ItemKind {
    InodeItem = 1,
    /// (ino, OrphanMark, 0): the inode has no name left but is still open; it goes when the
    /// last holder lets go, or at the next mount. Logged with the inode.
    OrphanMark = 2,
    InodeRef = 12,
    /// (ino, InodeExtRef, chain_offset(hash(dir ‖ name), link)): names of the inode that did
    /// not fit its InodeRef item in their directory ([`crate::format::items::ExtRef`]).
    /// Version 6 on.
    InodeExtRef = 13,
    XattrItem = 24,
    /// (ino, XattrValue, hash << 32 | slot << 16 | piece): a piece of an xattr value too large
    /// to sit in its chain link.
    XattrValue = 25,
    DirItem = 84,
    DirIndex = 96,
    ExtentData = 108,
    SymlinkTarget = 110,
    ExtentCsum = 128,
    /// (1, SpaceBitmap, chunk): versions 3 and 4 only, one per 4096-block chunk of the
    /// shard's own region. Read (and replaced by group bitmaps) when mount upgrades them.
    SpaceBitmap = 200,
    /// (ORPHAN_OBJECTID, OrphanIndex, ino), in the inode's shard: where mount finds the
    /// orphans to delete. Persisted by commits; replay rebuilds it from the marks it applies.
    OrphanIndex = 201,
    /// (1, GroupBitmap, group): the shard owns block group `group`; one bit per block of it,
    /// 1 = allocated ([`crate::space`]).
    GroupBitmap = 202,
    /// Keys used by tests of the tree alone.
    Test = 255,
}

impl ItemKind {
    pub fn from_u8(value: u8) -> Option<ItemKind> {
        Some(match value {
            1 => ItemKind::InodeItem,
            2 => ItemKind::OrphanMark,
            12 => ItemKind::InodeRef,
            13 => ItemKind::InodeExtRef,
            24 => ItemKind::XattrItem,
            25 => ItemKind::XattrValue,
            84 => ItemKind::DirItem,
            96 => ItemKind::DirIndex,
            108 => ItemKind::ExtentData,
            110 => ItemKind::SymlinkTarget,
            128 => ItemKind::ExtentCsum,
            200 => ItemKind::SpaceBitmap,
            201 => ItemKind::OrphanIndex,
            202 => ItemKind::GroupBitmap,
            255 => ItemKind::Test,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub objectid: u64,
    pub kind: ItemKind,
    pub offset: u64,
}

impl Key {
    /// objectid u64, kind u8, offset u64.
    pub const ENCODED_BYTES: usize = 17;
    pub const MIN: Key = Key {
        objectid: 0,
        kind: ItemKind::InodeItem,
        offset: 0,
    };
    pub const MAX: Key = Key {
        objectid: u64::MAX,
        kind: ItemKind::Test,
        offset: u64::MAX,
    };

    pub fn new(objectid: u64, kind: ItemKind, offset: u64) -> Key {
        Key {
            objectid,
            kind,
            offset,
        }
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.objectid.to_le_bytes());
        out[8] = self.kind as u8;
        out[9..17].copy_from_slice(&self.offset.to_le_bytes());
    }

    /// Decodes a key; `None` for an unknown kind (a corrupt or newer-format block) or fewer
    /// than [`Key::ENCODED_BYTES`] bytes.
    pub fn decode(bytes: &[u8]) -> Option<Key> {
        let bytes = bytes.get(..Key::ENCODED_BYTES)?;
        Some(Key {
            objectid: super::le_u64(bytes, 0),
            kind: ItemKind::from_u8(bytes[8])?,
            offset: super::le_u64(bytes, 9),
        })
    }
}
