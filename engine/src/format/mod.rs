//! The on-disk format, version 5. Every integer on disk is fixed-width little-endian; every
//! block carries a crc32c; every pointer to a block carries the block's address, generation and
//! crc32c, so a reader detects bit rot, torn writes, lost writes and misdirected writes before
//! it uses a byte (see docs/on-disk-format.md).
//!
//! Layout of a device, in 4 KiB blocks:
//! - blocks 0 and 1: superblock copies, written alternately (commit N writes copy N % 2), so a
//!   torn superblock write always leaves the previous generation intact;
//! - blocks 2..: one equal region per shard: first the shard's fsync log area
//!   ([`crate::log`]), then block groups, each owned by one shard at a time or free
//!   ([`crate::space`]): any shard's tree nodes and data extents may live in any region.

pub mod items;
pub mod key;
pub mod node;
pub mod superblock;

pub use key::{ItemKind, Key};
pub use node::{decode_node, encode_node, NodeBody, NodeHeader};
pub use superblock::{ShardRoot, Superblock};

/// The filesystem block size: tree nodes, superblocks and data extents are whole blocks.
pub const BLOCK_BYTES: usize = 4096;
/// Version 2 added the per-shard fsync log area; version 3 places names with a keyed hash
/// and chains the items of names sharing a hash; version 4 lets a log record carry a data
/// block without its zero tail (`crate::log::record`); version 5 turns the fixed shard
/// regions into block groups that move between shards (`crate::space`); version 6 adds
/// extended back-references (`ItemKind::InodeExtRef`), so one file may have thousands of
/// names in one directory.
pub const FORMAT_VERSION: u32 = 6;
/// The oldest version mount reads. Versions 3 and 4 differ in their log records and their
/// space bitmap (one item per 4096-block chunk of a shard's own region); mount reads their
/// chunks as groups of 4096 blocks and commits at once, rewriting them as group items and
/// marking the filesystem with this version, before anything is logged (an older corefs
/// then refuses it, instead of taking a record of a newer kind for the log's torn end).
/// Version 5 differs only in having no extended back-references: its first mount marks it
/// version 6 the same way.
pub const FORMAT_VERSION_OLDEST: u32 = 3;
/// Superblock copies live in these blocks.
pub const SUPERBLOCK_ADDRS: [u64; 2] = [0, 1];
/// First block of the shard regions.
pub const FIRST_REGION_BLOCK: u64 = 2;
/// Shards per filesystem: chosen at mkfs, at most this many (they share one superblock block).
pub const MAX_SHARDS: u32 = 64;
pub const DEFAULT_SHARDS: u32 = 64;

/// A pointer to a block: where it is, which generation wrote it, and its crc32c. A read checks
/// all three against the block's own header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct BlockPtr {
    pub addr: u64,
    pub generation: u64,
    pub crc: u32,
}

impl BlockPtr {
    pub const ENCODED_BYTES: usize = 20;

    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.generation.to_le_bytes());
        out[16..20].copy_from_slice(&self.crc.to_le_bytes());
    }

    pub fn decode(bytes: &[u8]) -> BlockPtr {
        BlockPtr {
            addr: le_u64(bytes, 0),
            generation: le_u64(bytes, 8),
            crc: le_u32(bytes, 16),
        }
    }
}

pub(crate) fn le_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}
pub(crate) fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn le_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2 bytes"))
}

/// crc32c of a block, skipping its first four bytes (where the crc itself is stored).
pub fn block_crc(block: &[u8]) -> u32 {
    crc32c::crc32c(&block[4..])
}
