//! The superblock: one 4 KiB block, two copies (blocks 0 and 1) written alternately.
//!
//! Layout: crc32c u32 (of bytes 4..4096) | magic u64 `CoreFSsb` | format version u32 |
//! generation u64 | total blocks u64 | device LBA size u32 | shard count u32 | blocks per shard
//! region u64 | uuid [16] | label [32] | log blocks per shard u64 | name hash key [16] | name
//! hash bits u8 | 3 reserved | blocks per group u32 (version 5) | shard roots from byte 128,
//! 48 bytes each: tree pointer (address u64, generation u64, crc32c u32) | tree level u8 |
//! 3 reserved | used blocks u64 | inodes u64 | groups owned u32 (version 5) | 4 reserved.
//!
//! Decoding validates every field against the others (sizes, region bounds, levels) so that a
//! corrupt superblock is reported by name and never trusted.

use super::node::MAX_LEVEL;
use super::{
    block_crc, le_u32, le_u64, BlockPtr, BLOCK_BYTES, FIRST_REGION_BLOCK, FORMAT_VERSION,
    FORMAT_VERSION_OLDEST, MAX_SHARDS,
};

pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"CoreFSsb");
/// The largest generation a superblock may carry (see [`Superblock::decode`]).
pub const MAX_GENERATION: u64 = u64::MAX / 2;
const SHARD_ROOTS_AT: usize = 128;
const SHARD_ROOT_BYTES: usize = 48;
const _: () = assert!(SHARD_ROOTS_AT + MAX_SHARDS as usize * SHARD_ROOT_BYTES <= BLOCK_BYTES);

/// One shard's entry in the superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardRoot {
    /// Root of the shard's tree; address 0 means an empty tree (block 0 is never a node).
    pub tree: BlockPtr,
    pub level: u8,
    /// Blocks the shard uses (tree nodes and data), in the groups it owns.
    pub used_blocks: u64,
    /// Inodes living in the shard (statfs's inode figures).
    pub inodes: u64,
    /// Block groups the shard owns ([`crate::space`]): the bitmap items in its tree. Format
    /// version 5; mount does not check it for older ones (0).
    pub groups: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub generation: u64,
    pub total_blocks: u64,
    pub lba_size_bytes: u32,
    pub region_blocks: u64,
    pub uuid: [u8; 16],
    pub label: String,
    /// The first blocks of every shard region are the shard's fsync log ([`crate::log`]); the
    /// rest is cut into block groups that any shard may own ([`crate::space`]).
    pub log_blocks: u64,
    /// Blocks per block group: a power of two from 8 to 4096 (4096 for filesystems made
    /// before version 5, whose bitmap chunks are exactly these groups).
    pub group_blocks: u64,
    /// The key of the hash that places names in directory and xattr items (random per
    /// filesystem, [`super::items::NameHasher`]), and how many bits of it are used: 32, or
    /// fewer when a test formats a filesystem whose names collide often.
    pub hash_key: [u8; 16],
    pub name_hash_bits: u8,
    pub shards: Vec<ShardRoot>,
}

impl Superblock {
    /// The first block of shard `shard`'s region.
    pub fn region_start(&self, shard: u32) -> u64 {
        FIRST_REGION_BLOCK + shard as u64 * self.region_blocks
    }

    /// Blocks of one half of a shard's log area. The records of generation G go to half
    /// G % 2, so the next generation can log while G is being committed without touching the
    /// records a crash before G's superblock would still need.
    pub fn log_half_blocks(&self) -> u64 {
        self.log_blocks / 2
    }

    /// The first block of the log half holding shard `shard`'s records of `generation`.
    pub fn log_start(&self, shard: u32, generation: u64) -> u64 {
        self.region_start(shard) + (generation % 2) * self.log_half_blocks()
    }

    /// Blocks of each shard region after its log area: the region's block groups.
    pub fn data_blocks(&self) -> u64 {
        self.region_blocks - self.log_blocks
    }

    /// Blocks in every block group together: what files and trees may use.
    pub fn data_area_blocks(&self) -> u64 {
        self.shards.len() as u64 * self.data_blocks()
    }

    /// The hash placing names in this filesystem's directory and xattr items.
    pub fn name_hasher(&self) -> super::items::NameHasher {
        super::items::NameHasher::new(self.hash_key, self.name_hash_bits)
    }

    pub fn encode(&self) -> Vec<u8> {
        assert!(!self.shards.is_empty() && self.shards.len() <= MAX_SHARDS as usize);
        assert!(self.label.len() <= 32, "label longer than 32 bytes");
        let mut b = vec![0u8; BLOCK_BYTES];
        b[4..12].copy_from_slice(&SUPERBLOCK_MAGIC.to_le_bytes());
        b[12..16].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.total_blocks.to_le_bytes());
        b[32..36].copy_from_slice(&self.lba_size_bytes.to_le_bytes());
        b[36..40].copy_from_slice(&(self.shards.len() as u32).to_le_bytes());
        b[40..48].copy_from_slice(&self.region_blocks.to_le_bytes());
        b[48..64].copy_from_slice(&self.uuid);
        b[64..64 + self.label.len()].copy_from_slice(self.label.as_bytes());
        b[96..104].copy_from_slice(&self.log_blocks.to_le_bytes());
        b[104..120].copy_from_slice(&self.hash_key);
        b[120] = self.name_hash_bits;
        b[124..128].copy_from_slice(&(self.group_blocks as u32).to_le_bytes());
        for (i, shard) in self.shards.iter().enumerate() {
            let at = SHARD_ROOTS_AT + i * SHARD_ROOT_BYTES;
            shard.tree.encode(&mut b[at..]);
            b[at + 20] = shard.level;
            b[at + 24..at + 32].copy_from_slice(&shard.used_blocks.to_le_bytes());
            b[at + 32..at + 40].copy_from_slice(&shard.inodes.to_le_bytes());
            b[at + 40..at + 44].copy_from_slice(&(shard.groups as u32).to_le_bytes());
        }
        let crc = block_crc(&b);
        b[0..4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The format version a superblock block says it is written in (unchecked: [`Self::decode`]
    /// checks it). Every superblock this corefs writes is [`FORMAT_VERSION`].
    pub fn version_of(b: &[u8]) -> u32 {
        if b.len() < 16 {
            return 0;
        }
        le_u32(b, 12)
    }

    /// Decodes and validates a superblock read from a device of `device_blocks` blocks.
    pub fn decode(b: &[u8], device_blocks: u64) -> Result<Superblock, String> {
        if b.len() != BLOCK_BYTES {
            return Err(format!("superblock is {} bytes", b.len()));
        }
        if le_u64(b, 4) != SUPERBLOCK_MAGIC {
            return Err("bad magic: not a corefs filesystem".into());
        }
        let (stored, computed) = (le_u32(b, 0), block_crc(b));
        if stored != computed {
            return Err(format!(
                "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            ));
        }
        let version = Self::version_of(b);
        if !(FORMAT_VERSION_OLDEST..=FORMAT_VERSION).contains(&version) {
            return Err(format!(
                "format version {version}; this corefs reads versions \
                 {FORMAT_VERSION_OLDEST} to {FORMAT_VERSION}"
            ));
        }
        let generation = le_u64(b, 16);
        // Generations count commits from 1; one past u64::MAX / 2 would take longer than the
        // device lives, and the engine adds to it without checking.
        if generation == 0 || generation > MAX_GENERATION {
            return Err(format!("impossible generation {generation}"));
        }
        let total_blocks = le_u64(b, 24);
        let lba_size_bytes = le_u32(b, 32);
        let shard_count = le_u32(b, 36);
        let region_blocks = le_u64(b, 40);
        if total_blocks > device_blocks {
            return Err(format!(
                "filesystem of {total_blocks} blocks on a device of {device_blocks}"
            ));
        }
        if !lba_size_bytes.is_power_of_two() || !(512..=4096).contains(&lba_size_bytes) {
            return Err(format!("impossible LBA size {lba_size_bytes}"));
        }
        if shard_count == 0 || shard_count > MAX_SHARDS {
            return Err(format!("impossible shard count {shard_count}"));
        }
        let regions_end = (shard_count as u64)
            .checked_mul(region_blocks)
            .and_then(|r| r.checked_add(FIRST_REGION_BLOCK))
            .ok_or("shard regions overflow")?;
        if region_blocks == 0 || regions_end > total_blocks {
            return Err(format!(
                "{shard_count} regions of {region_blocks} blocks exceed {total_blocks} blocks"
            ));
        }
        let log_blocks = le_u64(b, 96);
        // Two halves of at least a block each, and at least one block left for the allocator.
        if log_blocks < 2 || log_blocks >= region_blocks {
            return Err(format!(
                "log area of {log_blocks} blocks in regions of {region_blocks}"
            ));
        }
        let name_hash_bits = b[120];
        if !(1..=32).contains(&name_hash_bits) {
            return Err(format!("name hash of {name_hash_bits} bits"));
        }
        // Version 5 cuts the data area into groups of a size mkfs chose; older versions
        // are read as groups of their bitmap chunks' size.
        let group_blocks = if version >= 5 {
            le_u32(b, 124) as u64
        } else {
            crate::space::GROUP_BLOCKS_MAX
        };
        if !group_blocks.is_power_of_two()
            || !(crate::space::GROUP_BLOCKS_MIN..=crate::space::GROUP_BLOCKS_MAX)
                .contains(&group_blocks)
        {
            return Err(format!("block groups of {group_blocks} blocks"));
        }
        let label_bytes = &b[64..96];
        let label_len = label_bytes.iter().position(|&c| c == 0).unwrap_or(32);
        let label = String::from_utf8(label_bytes[..label_len].to_vec())
            .map_err(|_| "label is not UTF-8")?;
        let mut sb = Superblock {
            generation,
            total_blocks,
            lba_size_bytes,
            region_blocks,
            uuid: b[48..64].try_into().expect("16 bytes"),
            label,
            log_blocks,
            group_blocks,
            hash_key: b[104..120].try_into().expect("16 bytes"),
            name_hash_bits,
            shards: Vec::with_capacity(shard_count as usize),
        };
        let data_blocks = shard_count as u64 * sb.data_blocks();
        let geo = crate::space::Geometry {
            shards: shard_count,
            region_blocks,
            log_blocks,
            group_blocks,
            groups_per_region: sb.data_blocks().div_ceil(group_blocks),
        };
        for i in 0..shard_count {
            let at = SHARD_ROOTS_AT + i as usize * SHARD_ROOT_BYTES;
            let root = ShardRoot {
                tree: BlockPtr::decode(&b[at..]),
                level: b[at + 20],
                used_blocks: le_u64(b, at + 24),
                inodes: le_u64(b, at + 32),
                groups: if version >= 5 {
                    le_u32(b, at + 40) as u64
                } else {
                    0
                },
            };
            if root.tree.addr != 0 && geo.group_of(root.tree.addr).is_none() {
                return Err(format!(
                    "shard {i} root at block {} is outside the block groups",
                    root.tree.addr
                ));
            }
            if root.tree.generation > generation
                || root.level > MAX_LEVEL
                || root.used_blocks > data_blocks
                || root.groups > geo.group_count()
            {
                return Err(format!("shard {i} root is impossible: {root:?}"));
            }
            sb.shards.push(root);
        }
        Ok(sb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            generation: 9,
            total_blocks: 10_000,
            lba_size_bytes: 512,
            region_blocks: 1000,
            uuid: [7; 16],
            label: "data".into(),
            log_blocks: 16,
            group_blocks: 64,
            hash_key: [3; 16],
            name_hash_bits: 32,
            shards: (0..4)
                .map(|i| ShardRoot {
                    tree: BlockPtr {
                        addr: 2 + i * 1000 + 20,
                        generation: 8,
                        crc: 1,
                    },
                    level: 1,
                    used_blocks: 10,
                    inodes: 3,
                    groups: 2,
                })
                .collect(),
        }
    }

    #[test]
    fn round_trips_and_rejects_corruption_by_name() {
        let sb = sample();
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes, 10_000).unwrap(), sb);
        let mut flipped = bytes.clone();
        flipped[100] ^= 4;
        assert!(Superblock::decode(&flipped, 10_000)
            .unwrap_err()
            .contains("checksum"));
        assert!(Superblock::decode(&vec![0u8; 4096], 10_000)
            .unwrap_err()
            .contains("magic"));
        assert!(Superblock::decode(&bytes, 5_000)
            .unwrap_err()
            .contains("device"));
        let mut bad = sample();
        bad.shards[2].tree.addr = 1;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("outside the block groups"));
        let mut bad = sample();
        bad.shards[2].tree.addr = 2 + 1000 * 2 + 3;
        assert!(
            Superblock::decode(&bad.encode(), 10_000)
                .unwrap_err()
                .contains("outside the block groups"),
            "a log block"
        );
        let mut bad = sample();
        bad.group_blocks = 48;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("block groups of 48"));
        let mut bad = sample();
        bad.region_blocks = 5000;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("exceed"));
        // Checksum-valid but impossible: each is named, none is trusted.
        let mut bad = sample();
        bad.generation = u64::MAX;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("generation"));
        let mut bad = sample();
        bad.log_blocks = 1;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("log area"));
        let mut bad = sample();
        bad.shards[1].level = MAX_LEVEL + 1;
        assert!(Superblock::decode(&bad.encode(), 10_000)
            .unwrap_err()
            .contains("impossible"));
    }
}
