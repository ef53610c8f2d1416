//! Tree node blocks.
//!
//! Header (64 bytes): crc32c u32 (of bytes 4..4096) | magic u32 | address u64 | generation u64 |
//! owner shard u32 | level u8 | 3 reserved | item count u16 | 30 reserved (zero).
//!
//! A leaf (level 0) has item headers after the header — key (17) | data offset u16 | data
//! length u16 — and item data packed from the end of the block backwards. An internal node
//! has entries — key (17) | child pointer (address u64, generation u64, crc32c u32) — whose key
//! is the smallest key in the child's subtree.
//!
//! Decoding checks everything a corrupt or misplaced block could get wrong and names it: the
//! checksum, the magic, the address (misdirected writes), the generation the parent expects
//! (lost writes), the owner, the level, item bounds and key order.

use super::{block_crc, le_u16, le_u32, le_u64, BlockPtr, Key, BLOCK_BYTES};

pub const NODE_MAGIC: u32 = u32::from_le_bytes(*b"CFSN");
pub const HEADER_BYTES: usize = 64;
pub const LEAF_ITEM_HEADER_BYTES: usize = Key::ENCODED_BYTES + 4;
pub const INTERNAL_ENTRY_BYTES: usize = Key::ENCODED_BYTES + BlockPtr::ENCODED_BYTES;
/// Bytes available for items in a leaf.
pub const LEAF_SPACE_BYTES: usize = BLOCK_BYTES - HEADER_BYTES;
/// Children per internal node.
pub const INTERNAL_FANOUT: usize = (BLOCK_BYTES - HEADER_BYTES) / INTERNAL_ENTRY_BYTES;
/// Largest item value: any two items must fit one leaf, so a split always succeeds.
pub const MAX_ITEM_BYTES: usize = LEAF_SPACE_BYTES / 2 - LEAF_ITEM_HEADER_BYTES;
/// Deepest tree a reader accepts (a cycle or garbage level is rejected, never followed).
pub const MAX_LEVEL: u8 = 8;

const _: () = assert!(INTERNAL_FANOUT == 108);
const _: () = assert!(
    MAX_ITEM_BYTES >= 1024,
    "directory items and inline data need 1 KiB"
);
const _: () = assert!(BLOCK_BYTES <= u16::MAX as usize + 1, "leaf offsets are u16");

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHeader {
    pub addr: u64,
    pub generation: u64,
    pub owner: u32,
    pub level: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeBody {
    Leaf(Vec<(Key, Vec<u8>)>),
    Internal(Vec<(Key, BlockPtr)>),
}

impl NodeBody {
    pub fn len(&self) -> usize {
        match self {
            NodeBody::Leaf(items) => items.len(),
            NodeBody::Internal(entries) => entries.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes a leaf's items take, headers included.
pub fn leaf_used_bytes(items: &[(Key, Vec<u8>)]) -> usize {
    items
        .iter()
        .map(|(_, v)| LEAF_ITEM_HEADER_BYTES + v.len())
        .sum()
}

/// Encodes a node into `out` (one block) and returns its crc32c.
pub fn encode_node(header: &NodeHeader, body: &NodeBody, out: &mut [u8]) -> u32 {
    match body {
        NodeBody::Leaf(items) => encode_leaf(header, items, out),
        NodeBody::Internal(entries) => encode_internal(header, entries, out),
    }
}

fn encode_header(header: &NodeHeader, count: usize, out: &mut [u8]) {
    assert_eq!(out.len(), BLOCK_BYTES);
    out.fill(0);
    out[4..8].copy_from_slice(&NODE_MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&header.addr.to_le_bytes());
    out[16..24].copy_from_slice(&header.generation.to_le_bytes());
    out[24..28].copy_from_slice(&header.owner.to_le_bytes());
    out[28] = header.level;
    out[32..34].copy_from_slice(&(count as u16).to_le_bytes());
}

fn seal(out: &mut [u8]) -> u32 {
    let crc = block_crc(out);
    out[0..4].copy_from_slice(&crc.to_le_bytes());
    crc
}

/// Encodes a leaf from borrowed items (the commit serializes without copying them).
pub fn encode_leaf(header: &NodeHeader, items: &[(Key, Vec<u8>)], out: &mut [u8]) -> u32 {
    assert_eq!(header.level, 0, "a leaf is level 0");
    assert!(
        leaf_used_bytes(items) <= LEAF_SPACE_BYTES,
        "leaf overfull at encode"
    );
    encode_header(header, items.len(), out);
    let mut data_end = BLOCK_BYTES;
    for (i, (key, value)) in items.iter().enumerate() {
        let at = HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES;
        data_end -= value.len();
        key.encode(&mut out[at..]);
        out[at + 17..at + 19].copy_from_slice(&(data_end as u16).to_le_bytes());
        out[at + 19..at + 21].copy_from_slice(&(value.len() as u16).to_le_bytes());
        out[data_end..data_end + value.len()].copy_from_slice(value);
    }
    seal(out)
}

/// Encodes an internal node.
pub fn encode_internal(header: &NodeHeader, entries: &[(Key, BlockPtr)], out: &mut [u8]) -> u32 {
    assert!(header.level > 0, "an internal node is above level 0");
    assert!(
        entries.len() <= INTERNAL_FANOUT,
        "internal node overfull at encode"
    );
    encode_header(header, entries.len(), out);
    for (i, (key, ptr)) in entries.iter().enumerate() {
        let at = HEADER_BYTES + i * INTERNAL_ENTRY_BYTES;
        key.encode(&mut out[at..]);
        ptr.encode(&mut out[at + 17..]);
    }
    seal(out)
}

/// Decodes the block `expected` points at, checking it is exactly that block. `owner` is the
/// shard whose tree is being read; `level`, when known, the level the parent implies.
pub fn decode_node(
    block: &[u8],
    expected: &BlockPtr,
    owner: u32,
    level: Option<u8>,
) -> Result<(NodeHeader, NodeBody), String> {
    if block.len() != BLOCK_BYTES {
        return Err(format!("node is {} bytes, not {BLOCK_BYTES}", block.len()));
    }
    let stored_crc = le_u32(block, 0);
    let crc = block_crc(block);
    if crc != stored_crc {
        return Err(format!(
            "checksum mismatch (stored {stored_crc:#010x}, computed {crc:#010x})"
        ));
    }
    if crc != expected.crc {
        return Err(format!(
            "block is intact but not the one the parent wrote (crc {crc:#010x}, parent expects {:#010x}): a lost or misdirected write",
            expected.crc
        ));
    }
    if le_u32(block, 4) != NODE_MAGIC {
        return Err("bad node magic".into());
    }
    let header = NodeHeader {
        addr: le_u64(block, 8),
        generation: le_u64(block, 16),
        owner: le_u32(block, 24),
        level: block[28],
    };
    if header.addr != expected.addr {
        return Err(format!(
            "node claims address {} (misdirected write)",
            header.addr
        ));
    }
    if header.generation != expected.generation {
        return Err(format!(
            "node generation {} but parent expects {}",
            header.generation, expected.generation
        ));
    }
    if header.owner != owner {
        return Err(format!(
            "node belongs to shard {}, not {owner}",
            header.owner
        ));
    }
    if header.level > MAX_LEVEL || level.is_some_and(|l| l != header.level) {
        return Err(format!(
            "node level {} where {:?} is expected",
            header.level, level
        ));
    }
    let count = le_u16(block, 32) as usize;
    let mut previous: Option<Key> = None;
    let mut check_order = |key: Key| -> Result<(), String> {
        if previous.is_some_and(|p| p >= key) {
            return Err(format!("keys out of order at {key:?}"));
        }
        previous = Some(key);
        Ok(())
    };
    let body = if header.level == 0 {
        if HEADER_BYTES + count * LEAF_ITEM_HEADER_BYTES > BLOCK_BYTES {
            return Err(format!("{count} items cannot fit a leaf"));
        }
        let data_start = HEADER_BYTES + count * LEAF_ITEM_HEADER_BYTES;
        let mut items = Vec::with_capacity(count);
        for i in 0..count {
            let at = HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES;
            let key = Key::decode(&block[at..])
                .ok_or_else(|| format!("item {i} has an unknown kind {}", block[at + 8]))?;
            check_order(key)?;
            let offset = le_u16(block, at + 17) as usize;
            let len = le_u16(block, at + 19) as usize;
            if offset < data_start || offset + len > BLOCK_BYTES {
                return Err(format!("item {i} data {offset}+{len} outside the leaf"));
            }
            items.push((key, block[offset..offset + len].to_vec()));
        }
        NodeBody::Leaf(items)
    } else {
        if count == 0 || count > INTERNAL_FANOUT {
            return Err(format!("internal node with {count} children"));
        }
        let mut entries = Vec::with_capacity(count);
        for i in 0..count {
            let at = HEADER_BYTES + i * INTERNAL_ENTRY_BYTES;
            let key = Key::decode(&block[at..])
                .ok_or_else(|| format!("entry {i} has an unknown kind {}", block[at + 8]))?;
            check_order(key)?;
            let ptr = BlockPtr::decode(&block[at + 17..]);
            if ptr.generation > header.generation {
                return Err(format!(
                    "child {i} is newer (generation {}) than its parent",
                    ptr.generation
                ));
            }
            entries.push((key, ptr));
        }
        NodeBody::Internal(entries)
    };
    Ok((header, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::ItemKind;

    fn leaf() -> (NodeHeader, NodeBody) {
        let items = (0..20)
            .map(|i| {
                (
                    Key::new(i, ItemKind::Test, i * 3),
                    vec![i as u8; 50 + i as usize],
                )
            })
            .collect();
        (
            NodeHeader {
                addr: 77,
                generation: 5,
                owner: 3,
                level: 0,
            },
            NodeBody::Leaf(items),
        )
    }

    #[test]
    fn nodes_round_trip_and_every_corruption_is_named() {
        let (header, body) = leaf();
        let mut block = vec![0u8; BLOCK_BYTES];
        let crc = encode_node(&header, &body, &mut block);
        let ptr = BlockPtr {
            addr: 77,
            generation: 5,
            crc,
        };
        assert_eq!(
            decode_node(&block, &ptr, 3, Some(0)).unwrap(),
            (header.clone(), body.clone())
        );

        let mut flipped = block.clone();
        flipped[BLOCK_BYTES - 1] ^= 1;
        assert!(decode_node(&flipped, &ptr, 3, None)
            .unwrap_err()
            .contains("checksum"));
        let wrong_place = BlockPtr { addr: 78, ..ptr };
        assert!(decode_node(&block, &wrong_place, 3, None)
            .unwrap_err()
            .contains("misdirected"));
        assert!(decode_node(&block, &ptr, 4, None)
            .unwrap_err()
            .contains("shard"));
        assert!(decode_node(&block, &ptr, 3, Some(1))
            .unwrap_err()
            .contains("level"));

        // An intact node at the wrong address (misdirected write) with the parent's crc.
        let mut elsewhere = vec![0u8; BLOCK_BYTES];
        let crc2 = encode_node(
            &NodeHeader {
                addr: 99,
                ..header.clone()
            },
            &body,
            &mut elsewhere,
        );
        let err = decode_node(
            &elsewhere,
            &BlockPtr {
                addr: 77,
                generation: 5,
                crc: crc2,
            },
            3,
            None,
        )
        .unwrap_err();
        assert!(err.contains("misdirected"), "{err}");
        // A stale node (lost write): right place, older generation, different crc.
        let mut stale = vec![0u8; BLOCK_BYTES];
        let crc3 = encode_node(
            &NodeHeader {
                generation: 4,
                ..header
            },
            &body,
            &mut stale,
        );
        let err = decode_node(
            &stale,
            &BlockPtr {
                addr: 77,
                generation: 5,
                crc: crc3,
            },
            3,
            None,
        )
        .unwrap_err();
        assert!(err.contains("generation"), "{err}");
    }

    #[test]
    fn internal_nodes_round_trip() {
        let entries: Vec<(Key, BlockPtr)> = (0..INTERNAL_FANOUT as u64)
            .map(|i| {
                (
                    Key::new(i, ItemKind::InodeItem, 0),
                    BlockPtr {
                        addr: 100 + i,
                        generation: 2,
                        crc: i as u32,
                    },
                )
            })
            .collect();
        let header = NodeHeader {
            addr: 9,
            generation: 3,
            owner: 0,
            level: 2,
        };
        let body = NodeBody::Internal(entries);
        let mut block = vec![0u8; BLOCK_BYTES];
        let crc = encode_node(&header, &body, &mut block);
        let decoded = decode_node(
            &block,
            &BlockPtr {
                addr: 9,
                generation: 3,
                crc,
            },
            0,
            Some(2),
        )
        .unwrap();
        assert_eq!(decoded, (header, body));
    }
}
