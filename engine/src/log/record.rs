//! The fsync log's record format.
//!
//! A record is a whole number of 4 KiB blocks written at the head of one shard's log area:
//!
//! ```text
//! 0  crc32c u32 of bytes 4..(blocks × 4096)   4  blocks u32
//! 8  magic u64 "CoreFSlg"                      16 generation u64 (durable generation + 1)
//! 24 global sequence u64 (per generation)      32 shard sequence u64 (per log, per generation)
//! 40 shard u32 (whose log holds it)            44 op count u32
//! 48 payload bytes u32                         52 stream u32 (whose sequence: a partition's)
//! 56 filesystem uuid [16]                      72 reserved [8]
//! 80 ops: tag u8 (1 put, 2 delete) | key (17 bytes) | put: value length u16 | value
//!    or: tag 3 (data) | disk block u64 | the block's 4096 bytes
//!    or: tag 4 (data, zero tail) | disk block u64 | length n u16 | the block's first n
//!        bytes (the other 4096 − n are zero)
//! ```
//!
//! A data op carries a data block the record's extents reference whose bytes were not on the
//! device yet: small fsyncs put their data in the record, so the record is the only write. A
//! block whose last bytes are zero (the end of a file being appended to: a database's WAL,
//! a log) is carried without them (tag 4, format version 4), so a small append's record
//! fits one block with its metadata instead of two.
//!
//! # Invariants
//! - The crc covers every byte of the record after itself, padding included, so a torn or
//!   partly written record never decodes.
//! - A record names its filesystem (uuid), its generation and both sequence numbers, so replay
//!   tells a stale record (an older generation, another filesystem, an earlier lap of the log
//!   area) from a current one without the log area ever being erased.
//! - Decoding checks every length against the record's size before reading, and every value
//!   against the largest item a tree holds; what the ops mean (which inodes, which blocks) is
//!   checked by replay ([`super::replay`]).

use crate::format::node::MAX_ITEM_BYTES;
use crate::format::{le_u16, le_u32, le_u64, Key, BLOCK_BYTES};

pub const LOG_MAGIC: u64 = u64::from_le_bytes(*b"CoreFSlg");
pub const HEADER_BYTES: usize = 80;
const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;
const TAG_DATA: u8 = 3;
const TAG_DATA_ZERO_TAIL: u8 = 4;

/// The bytes of a data block a record carries: up to its last non-zero byte, when leaving
/// out the zeros after it (and adding a length) makes the op shorter; else all of them.
fn data_bytes_carried(bytes: &[u8]) -> Option<usize> {
    // Eight bytes at a time from the end (an appended file's last block is mostly zeros, and
    // each fsync's record scans it three times: to size the record, then to encode it).
    let mut len = bytes.len();
    while len >= 8 && bytes[len - 8..len] == [0u8; 8] {
        len -= 8;
    }
    while len > 0 && bytes[len - 1] == 0 {
        len -= 1;
    }
    (len + 2 < BLOCK_BYTES).then_some(len)
}

/// One change to a shard tree (the shard is the key's object id modulo the shard count), or
/// the content of a data block the record's extents reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOp {
    Put(Key, Vec<u8>),
    Delete(Key),
    /// A whole data block (4096 bytes) for disk block `block`.
    Data(u64, Vec<u8>),
}

impl LogOp {
    /// The tree key a put or delete changes (None for data).
    pub fn key(&self) -> Option<&Key> {
        match self {
            LogOp::Put(key, _) | LogOp::Delete(key) => Some(key),
            LogOp::Data(..) => None,
        }
    }

    pub fn encoded_bytes(&self) -> usize {
        match self {
            LogOp::Put(_, value) => 1 + Key::ENCODED_BYTES + 2 + value.len(),
            LogOp::Delete(_) => 1 + Key::ENCODED_BYTES,
            LogOp::Data(_, bytes) => match data_bytes_carried(bytes) {
                Some(len) => 1 + 8 + 2 + len,
                None => 1 + 8 + BLOCK_BYTES,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub blocks: u32,
    pub generation: u64,
    pub global_seq: u64,
    pub shard_seq: u64,
    pub shard: u32,
    /// The log stream: records of one stream replay in sequence order, streams
    /// independently (a partition writes its own; 0 when one engine holds every shard).
    pub stream: u32,
    pub op_count: u32,
    pub payload_bytes: u32,
    pub uuid: [u8; 16],
}

/// Blocks a record of `ops` occupies.
pub fn record_blocks<'a>(ops: impl Iterator<Item = &'a LogOp>) -> u64 {
    let bytes = HEADER_BYTES + ops.map(LogOp::encoded_bytes).sum::<usize>();
    bytes.div_ceil(BLOCK_BYTES) as u64
}

/// Encodes a record; `header.blocks`, `op_count` and `payload_bytes` are filled in here.
pub fn encode_record(mut header: RecordHeader, ops: &[LogOp]) -> Vec<u8> {
    let payload: usize = ops.iter().map(LogOp::encoded_bytes).sum();
    let blocks = (HEADER_BYTES + payload).div_ceil(BLOCK_BYTES);
    header.blocks = u32::try_from(blocks).expect("record blocks fit u32");
    header.op_count = u32::try_from(ops.len()).expect("op count fits u32");
    header.payload_bytes = u32::try_from(payload).expect("payload fits u32");
    let mut b = vec![0u8; blocks * BLOCK_BYTES];
    b[4..8].copy_from_slice(&header.blocks.to_le_bytes());
    b[8..16].copy_from_slice(&LOG_MAGIC.to_le_bytes());
    b[16..24].copy_from_slice(&header.generation.to_le_bytes());
    b[24..32].copy_from_slice(&header.global_seq.to_le_bytes());
    b[32..40].copy_from_slice(&header.shard_seq.to_le_bytes());
    b[40..44].copy_from_slice(&header.shard.to_le_bytes());
    b[44..48].copy_from_slice(&header.op_count.to_le_bytes());
    b[48..52].copy_from_slice(&header.payload_bytes.to_le_bytes());
    b[52..56].copy_from_slice(&header.stream.to_le_bytes());
    b[56..72].copy_from_slice(&header.uuid);
    let mut at = HEADER_BYTES;
    for op in ops {
        match op {
            LogOp::Put(key, value) => {
                b[at] = TAG_PUT;
                key.encode(&mut b[at + 1..]);
                at += 1 + Key::ENCODED_BYTES;
                let len = u16::try_from(value.len()).expect("an item value fits u16");
                b[at..at + 2].copy_from_slice(&len.to_le_bytes());
                b[at + 2..at + 2 + value.len()].copy_from_slice(value);
                at += 2 + value.len();
            }
            LogOp::Delete(key) => {
                b[at] = TAG_DELETE;
                key.encode(&mut b[at + 1..]);
                at += 1 + Key::ENCODED_BYTES;
            }
            LogOp::Data(block, bytes) => {
                assert_eq!(bytes.len(), BLOCK_BYTES, "a data op holds one block");
                b[at + 1..at + 9].copy_from_slice(&block.to_le_bytes());
                match data_bytes_carried(bytes) {
                    Some(len) => {
                        b[at] = TAG_DATA_ZERO_TAIL;
                        let len16 = u16::try_from(len).expect("less than a block");
                        b[at + 9..at + 11].copy_from_slice(&len16.to_le_bytes());
                        b[at + 11..at + 11 + len].copy_from_slice(&bytes[..len]);
                        at += 11 + len;
                    }
                    None => {
                        b[at] = TAG_DATA;
                        b[at + 9..at + 9 + BLOCK_BYTES].copy_from_slice(bytes);
                        at += 9 + BLOCK_BYTES;
                    }
                }
            }
        }
    }
    assert_eq!(at, HEADER_BYTES + payload);
    let crc = crc32c::crc32c(&b[4..]);
    b[0..4].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes the header from a record's first block (its crc is checked by [`decode_record`]
/// once all its blocks are read).
pub fn decode_header(block: &[u8]) -> Result<RecordHeader, String> {
    if block.len() < HEADER_BYTES {
        return Err("short header".into());
    }
    if le_u64(block, 8) != LOG_MAGIC {
        return Err("no record magic".into());
    }
    let header = RecordHeader {
        blocks: le_u32(block, 4),
        generation: le_u64(block, 16),
        global_seq: le_u64(block, 24),
        shard_seq: le_u64(block, 32),
        shard: le_u32(block, 40),
        stream: le_u32(block, 52),
        op_count: le_u32(block, 44),
        payload_bytes: le_u32(block, 48),
        uuid: block[56..72].try_into().expect("16 bytes"),
    };
    if header.blocks == 0
        || HEADER_BYTES + header.payload_bytes as usize > header.blocks as usize * BLOCK_BYTES
    {
        return Err(format!(
            "impossible size: {} blocks, {} payload bytes",
            header.blocks, header.payload_bytes
        ));
    }
    Ok(header)
}

/// Decodes a whole record (`bytes` is exactly its blocks): checks the crc, then every op.
pub fn decode_record(bytes: &[u8]) -> Result<(RecordHeader, Vec<LogOp>), String> {
    let header = decode_header(bytes)?;
    if bytes.len() != header.blocks as usize * BLOCK_BYTES {
        return Err(format!(
            "record of {} blocks given {} bytes",
            header.blocks,
            bytes.len()
        ));
    }
    let (stored, computed) = (le_u32(bytes, 0), crc32c::crc32c(&bytes[4..]));
    // A torn record never decodes: the crc is what tells it from whole (unless the mutation
    // check removes this guard on purpose).
    if stored != computed && !mutated!(SkipRecordCrc) {
        return Err(format!(
            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let end = HEADER_BYTES + header.payload_bytes as usize;
    let mut at = HEADER_BYTES;
    let mut ops = Vec::with_capacity(header.op_count.min(4096) as usize);
    while at < end {
        if bytes[at] == TAG_DATA {
            if at + 9 + BLOCK_BYTES > end {
                return Err(format!("data op at byte {at} runs past the payload"));
            }
            ops.push(LogOp::Data(
                le_u64(bytes, at + 1),
                bytes[at + 9..at + 9 + BLOCK_BYTES].to_vec(),
            ));
            at += 9 + BLOCK_BYTES;
            continue;
        }
        if bytes[at] == TAG_DATA_ZERO_TAIL {
            if at + 11 > end {
                return Err(format!("data op at byte {at} runs past the payload"));
            }
            let len = le_u16(bytes, at + 9) as usize;
            if len > BLOCK_BYTES || at + 11 + len > end {
                return Err(format!(
                    "data op at byte {at} carries {len} bytes past the payload or its block"
                ));
            }
            let mut block = vec![0u8; BLOCK_BYTES];
            block[..len].copy_from_slice(&bytes[at + 11..at + 11 + len]);
            ops.push(LogOp::Data(le_u64(bytes, at + 1), block));
            at += 11 + len;
            continue;
        }
        if at + 1 + Key::ENCODED_BYTES > end {
            return Err(format!("op at byte {at} runs past the payload"));
        }
        let tag = bytes[at];
        let key = Key::decode(&bytes[at + 1..])
            .ok_or_else(|| format!("op at byte {at} has an unknown key kind"))?;
        at += 1 + Key::ENCODED_BYTES;
        match tag {
            TAG_PUT => {
                if at + 2 > end {
                    return Err(format!("put at byte {at} runs past the payload"));
                }
                let len = le_u16(bytes, at) as usize;
                if at + 2 + len > end {
                    return Err(format!("value at byte {at} runs past the payload"));
                }
                if len > MAX_ITEM_BYTES {
                    return Err(format!(
                        "value at byte {at} is {len} bytes, more than an item holds"
                    ));
                }
                ops.push(LogOp::Put(key, bytes[at + 2..at + 2 + len].to_vec()));
                at += 2 + len;
            }
            TAG_DELETE => ops.push(LogOp::Delete(key)),
            other => return Err(format!("unknown op tag {other} at byte {at}")),
        }
    }
    if ops.len() != header.op_count as usize {
        return Err(format!(
            "{} ops decoded, header says {}",
            ops.len(),
            header.op_count
        ));
    }
    Ok((header, ops))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::ItemKind;
    use proptest::prelude::*;

    fn header() -> RecordHeader {
        RecordHeader {
            blocks: 0,
            generation: 7,
            global_seq: 3,
            shard_seq: 1,
            shard: 5,
            stream: 2,
            op_count: 0,
            payload_bytes: 0,
            uuid: [9; 16],
        }
    }

    fn op() -> impl Strategy<Value = LogOp> {
        let key = (256u64..10_000, 0u64..1 << 40)
            .prop_map(|(o, off)| Key::new(o, ItemKind::ExtentData, off));
        prop_oneof![
            (key.clone(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(k, v)| LogOp::Put(k, v)),
            key.prop_map(LogOp::Delete),
            (any::<u64>(), any::<u8>())
                .prop_map(|(b, fill)| LogOp::Data(b, vec![fill; BLOCK_BYTES])),
            // A block written up to some byte, zeros after (an appended file's last block),
            // with a non-zero byte anywhere, or none at all.
            (
                any::<u64>(),
                0..=BLOCK_BYTES,
                any::<u8>(),
                any::<prop::sample::Index>()
            )
                .prop_map(|(b, len, fill, hole)| {
                    let mut block = vec![0u8; BLOCK_BYTES];
                    block[..len].fill(fill | 1);
                    if len > 0 {
                        block[hole.index(len)] = 0;
                    }
                    LogOp::Data(b, block)
                }),
        ]
    }

    proptest! {
        #[test]
        fn records_round_trip_and_any_flipped_bit_is_caught(
            ops in proptest::collection::vec(op(), 0..60),
            flip in any::<prop::sample::Index>(),
        ) {
            let bytes = encode_record(header(), &ops);
            prop_assert_eq!(bytes.len() as u64, record_blocks(ops.iter()) * BLOCK_BYTES as u64);
            let (h, decoded) = decode_record(&bytes).unwrap();
            prop_assert_eq!(&decoded, &ops);
            prop_assert_eq!(h.generation, 7);
            prop_assert_eq!(h.global_seq, 3);
            let mut bad = bytes.clone();
            let bit = flip.index(bad.len() * 8);
            bad[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_record(&bad).is_err());
        }
    }

    /// A small append's record is one block: the data block's zero tail is left out, and
    /// comes back as zeros; a block with its last byte written is carried whole.
    #[test]
    fn a_data_block_with_a_zero_tail_is_carried_without_it() {
        let meta = LogOp::Put(Key::new(300, ItemKind::InodeItem, 0), vec![7; 200]);
        let mut appended = vec![0u8; BLOCK_BYTES];
        appended[..2000].fill(0x5a);
        let ops = vec![meta.clone(), LogOp::Data(9, appended.clone())];
        assert_eq!(record_blocks(ops.iter()), 1);
        let (_, decoded) = decode_record(&encode_record(header(), &ops)).unwrap();
        assert_eq!(decoded, ops);
        let full = vec![0x5a; BLOCK_BYTES];
        let ops = vec![meta, LogOp::Data(9, full)];
        assert_eq!(record_blocks(ops.iter()), 2);
        let (_, decoded) = decode_record(&encode_record(header(), &ops)).unwrap();
        assert_eq!(decoded, ops);
        // A zero-tail op claiming more than a block is refused, crc or not.
        let mut ops_bytes = encode_record(header(), &[LogOp::Data(9, appended)]);
        ops_bytes[HEADER_BYTES + 9..HEADER_BYTES + 11].copy_from_slice(&4097u16.to_le_bytes());
        let crc = crc32c::crc32c(&ops_bytes[4..]);
        ops_bytes[0..4].copy_from_slice(&crc.to_le_bytes());
        assert!(decode_record(&ops_bytes)
            .unwrap_err()
            .contains("past the payload or its block"));
    }

    #[test]
    fn garbage_and_short_records_are_rejected_by_name() {
        assert!(decode_header(&[0u8; 4096]).unwrap_err().contains("magic"));
        let ops = vec![LogOp::Put(
            Key::new(300, ItemKind::InodeItem, 0),
            vec![1; 5000],
        )];
        let bytes = encode_record(header(), &ops);
        assert_eq!(bytes.len(), 2 * BLOCK_BYTES);
        assert!(decode_record(&bytes[..BLOCK_BYTES])
            .unwrap_err()
            .contains("given"));
        // Intact, but the value could never be a tree item.
        assert!(decode_record(&bytes)
            .unwrap_err()
            .contains("more than an item holds"));
    }
}
