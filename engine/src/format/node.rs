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
//! (lost writes), the owner, the level; and the structure, since a checksum-valid block can
//! still be malformed: item count, each item's data inside the data area, no longer than
//! [`MAX_ITEM_BYTES`] and sharing no byte with another's, keys known and strictly increasing,
//! child pointers non-zero, not newer than the node and distinct. A decoded node therefore
//! always fits a block and obeys the split contract (any two items fit one leaf).

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
        NodeBody::Leaf(decode_leaf_items(block, count, &mut check_order)?)
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
            if ptr.addr == 0 || ptr.addr == header.addr || ptr.generation == 0 {
                return Err(format!(
                    "child {i} pointer is impossible (block {}, generation {})",
                    ptr.addr, ptr.generation
                ));
            }
            if ptr.generation > header.generation {
                return Err(format!(
                    "child {i} is newer (generation {}) than its parent",
                    ptr.generation
                ));
            }
            entries.push((key, ptr));
        }
        // The same child twice would be copied on write twice and freed twice: a node is
        // reachable by one path only.
        let mut addrs: Vec<u64> = entries.iter().map(|(_, p)| p.addr).collect();
        addrs.sort_unstable();
        if let Some(w) = addrs.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("child block {} is referenced twice", w[0]));
        }
        NodeBody::Internal(entries)
    };
    Ok((header, body))
}

/// The items of a leaf holding `count` of them: every item header inside the block, every
/// item's data inside the data area (after the headers), no longer than [`MAX_ITEM_BYTES`]
/// and not sharing a byte with another item's, keys known and strictly increasing. So a
/// decoded leaf always fits a block and any two of its items fit one (the split contract).
fn decode_leaf_items(
    block: &[u8],
    count: usize,
    check_order: &mut impl FnMut(Key) -> Result<(), String>,
) -> Result<Vec<(Key, Vec<u8>)>, String> {
    let data_start = HEADER_BYTES + count * LEAF_ITEM_HEADER_BYTES;
    if data_start > BLOCK_BYTES {
        return Err(format!("{count} items cannot fit a leaf"));
    }
    let mut items = Vec::with_capacity(count);
    // (offset, length, item) of every item with data, to find overlaps.
    let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(count);
    for i in 0..count {
        let at = HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES;
        let key = Key::decode(&block[at..])
            .ok_or_else(|| format!("item {i} has an unknown kind {}", block[at + 8]))?;
        check_order(key)?;
        let offset = le_u16(block, at + 17) as usize;
        let len = le_u16(block, at + 19) as usize;
        if len > MAX_ITEM_BYTES {
            return Err(format!(
                "item {i} is {len} bytes, more than the largest item ({MAX_ITEM_BYTES})"
            ));
        }
        if offset < data_start || offset + len > BLOCK_BYTES {
            return Err(format!("item {i} data {offset}+{len} outside the leaf"));
        }
        if len > 0 {
            spans.push((offset, len, i));
        }
        items.push((key, block[offset..offset + len].to_vec()));
    }
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(format!(
            "items {} and {} share data bytes ({}+{} and {}+{})",
            w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1
        ));
    }
    Ok(items)
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

    /// Re-seals `block` after a change and decodes it with a pointer that matches, so only
    /// the structure checks can refuse it.
    fn decode_resealed(block: &mut [u8], level: u8) -> Result<(NodeHeader, NodeBody), String> {
        let crc = seal(block);
        let ptr = BlockPtr {
            addr: le_u64(block, 8),
            generation: le_u64(block, 16),
            crc,
        };
        decode_node(block, &ptr, le_u32(block, 24), Some(level))
    }

    #[test]
    fn checksum_valid_but_malformed_leaves_are_named() {
        let (header, body) = leaf();
        let mut block = vec![0u8; BLOCK_BYTES];
        encode_node(&header, &body, &mut block);
        let item = |i: usize| HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES;

        // Item 3 longer than any item may be (its data stays inside the block).
        let mut bad = block.clone();
        let offset = le_u16(&bad, item(19) + 17);
        bad[item(19) + 17..item(19) + 19].copy_from_slice(&(offset - 2000).to_le_bytes());
        bad[item(19) + 19..item(19) + 21]
            .copy_from_slice(&(MAX_ITEM_BYTES as u16 + 1).to_le_bytes());
        let err = decode_resealed(&mut bad, 0).unwrap_err();
        assert!(err.contains("largest item"), "{err}");

        // Item 5 one byte longer: it runs into item 4's data.
        let mut bad = block.clone();
        let len = le_u16(&bad, item(5) + 19);
        bad[item(5) + 19..item(5) + 21].copy_from_slice(&(len + 1).to_le_bytes());
        let err = decode_resealed(&mut bad, 0).unwrap_err();
        assert!(err.contains("share data"), "{err}");

        // Item 7 points at item 2's bytes.
        let mut bad = block.clone();
        bad.copy_within(item(2) + 17..item(2) + 21, item(7) + 17);
        let err = decode_resealed(&mut bad, 0).unwrap_err();
        assert!(err.contains("share data"), "{err}");

        // Data inside the item headers.
        let mut bad = block.clone();
        bad[item(0) + 17..item(0) + 19].copy_from_slice(&(item(19) as u16).to_le_bytes());
        let err = decode_resealed(&mut bad, 0).unwrap_err();
        assert!(err.contains("outside the leaf"), "{err}");

        // Keys out of order, an unknown kind, more items than a leaf holds.
        let mut bad = block.clone();
        bad.copy_within(item(3)..item(3) + 17, item(4));
        assert!(decode_resealed(&mut bad, 0)
            .unwrap_err()
            .contains("out of order"));
        let mut bad = block.clone();
        bad[item(6) + 8] = 77;
        assert!(decode_resealed(&mut bad, 0)
            .unwrap_err()
            .contains("unknown kind"));
        let mut bad = block.clone();
        bad[32..34].copy_from_slice(&200u16.to_le_bytes());
        assert!(decode_resealed(&mut bad, 0)
            .unwrap_err()
            .contains("cannot fit"));
    }

    #[test]
    fn checksum_valid_but_malformed_internal_nodes_are_named() {
        let entries: Vec<(Key, BlockPtr)> = (0..10u64)
            .map(|i| {
                let ptr = BlockPtr {
                    addr: 100 + i,
                    generation: 2,
                    crc: i as u32,
                };
                (Key::new(i, ItemKind::InodeItem, 0), ptr)
            })
            .collect();
        let header = NodeHeader {
            addr: 9,
            generation: 3,
            owner: 0,
            level: 1,
        };
        let mut block = vec![0u8; BLOCK_BYTES];
        encode_node(&header, &NodeBody::Internal(entries), &mut block);
        let entry = |i: usize| HEADER_BYTES + i * INTERNAL_ENTRY_BYTES;

        // The same child under two keys: it would be copied on write and freed twice.
        let mut bad = block.clone();
        bad.copy_within(entry(2) + 17..entry(2) + 37, entry(6) + 17);
        let err = decode_resealed(&mut bad, 1).unwrap_err();
        assert!(err.contains("referenced twice"), "{err}");

        // A child at block 0, or at generation 0.
        let mut bad = block.clone();
        bad[entry(4) + 17..entry(4) + 25].fill(0);
        assert!(decode_resealed(&mut bad, 1)
            .unwrap_err()
            .contains("impossible"));
        let mut bad = block.clone();
        bad[entry(4) + 25..entry(4) + 33].fill(0);
        assert!(decode_resealed(&mut bad, 1)
            .unwrap_err()
            .contains("impossible"));

        // No children, too many, keys out of order.
        for count in [0u16, INTERNAL_FANOUT as u16 + 1] {
            let mut bad = block.clone();
            bad[32..34].copy_from_slice(&count.to_le_bytes());
            assert!(decode_resealed(&mut bad, 1)
                .unwrap_err()
                .contains("children"));
        }
        let mut bad = block.clone();
        bad.copy_within(entry(8)..entry(8) + 17, entry(1));
        assert!(decode_resealed(&mut bad, 1)
            .unwrap_err()
            .contains("out of order"));
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
