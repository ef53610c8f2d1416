//! File data: extents, read, write, truncate, fallocate, punch hole, zero range. Here the
//! extent and read-plan types; in [`ops`] mapping, planning, read-ahead and what punches and
//! frees blocks; writes in [`write`], truncate and fallocate in [`resize`].
//!
//! Data is copy-on-write at 4 KiB block granularity: a write allocates new blocks in the
//! inode's shard region, writes them, then replaces the extent items covering that range; the
//! blocks it replaced are freed pinned (reusable after the next super-commit). So a crash never
//! shows a half-overwritten block of a committed file, and data reaches the device before the
//! metadata that points at it (the commit flushes before its superblock).
//!
//! An extent item `(ino, ExtentData, file offset)` covers at most [`MAX_EXTENT_BLOCKS`](crate::format::items::MAX_EXTENT_BLOCKS) blocks
//! and carries the crc32c of each block; a read verifies every block it returns. Holes have no
//! item and read as zeroes; preallocated extents read as zeroes until written.
//!
//! # Invariants
//! - Extents of one inode never overlap; each disk block belongs to at most one extent.
//! - `inode.blocks` counts the data blocks the inode's extents hold.

use crate::error::{EngineError, Result};
use crate::format::items::ExtentItem;
use crate::format::{ItemKind, Key, BLOCK_BYTES};

mod resize;
mod staged;
mod write;

pub use staged::Staged;

const BLOCK: u64 = BLOCK_BYTES as u64;
/// Largest file offset (keeps every byte offset and block count in range): the format's.
pub use crate::format::items::MAX_FILE_BYTES;

mod ops;

/// The most bytes one read or write moves: Linux's `MAX_RW_COUNT` (`INT_MAX & PAGE_MASK`).
/// A longer request is shortened to it, as read(2) and write(2) shorten theirs, so no
/// caller's length makes the engine allocate more than this for one request.
pub const MAX_RW_BYTES: usize = 0x7fff_f000;

/// Bounds the position and length of one read or write from outside (an ABI call, a FUSE
/// request, a client's operation) the way Linux's `rw_verify_area` does before a read or
/// write runs: file positions are signed 64-bit (`loff_t`), so an offset past `i64::MAX`
/// (a negative position) or an `offset + len` past it is EINVAL; a length over
/// [`MAX_RW_BYTES`] is then shortened, not refused. Returns the length to use. Every
/// read and write entry point of the engine calls this before it sizes any buffer.
pub fn rw_len(offset: u64, len: usize) -> Result<usize> {
    let end = u64::try_from(len)
        .ok()
        .and_then(|len| offset.checked_add(len))
        .filter(|&end| end <= i64::MAX as u64);
    if end.is_none() {
        return Err(EngineError::Invalid(format!(
            "offset {offset} + length {len} is past the largest file position (2^63 - 1)"
        )));
    }
    Ok(len.min(MAX_RW_BYTES))
}

/// What one read maps to ([`Filesystem::map_read`](crate::Filesystem::map_read)): bytes `offset..end` of file `ino` (the
/// request clipped to the file's size; empty when `end == offset`) and the extents over them.
pub(crate) struct ReadMap {
    ino: u64,
    offset: u64,
    end: u64,
    extents: Vec<Extent>,
    /// The read moves the file's access time ([`crate::inode::Atime`]), decided from the
    /// inode item the mapping read anyway, so a read that moves nothing looks nothing up
    /// again.
    pub moves_atime: bool,
}

impl ReadMap {
    /// Bytes the read returns (it stops at the end of the file).
    pub(crate) fn len(&self) -> usize {
        (self.end - self.offset) as usize
    }
}

/// A device read one request of a read set ([`crate::reads`]) waits for: `count` blocks at
/// `disk` (verified against `crcs`), whose bytes `src` go to the request's output bytes
/// `dst`. `joins`: the blocks come from a read-ahead's device read already on its way
/// (keyed by its first block) rather than a read of their own.
pub(crate) struct ReadPiece {
    pub request: usize,
    pub ino: u64,
    pub disk: u64,
    pub count: u64,
    pub crcs: Vec<u32>,
    pub src: std::ops::Range<usize>,
    pub dst: std::ops::Range<usize>,
    pub joins: Option<u64>,
}

impl ReadPiece {
    /// One block of file `ino` at `disk`, read for itself (an edge block a write covers in
    /// part), copied nowhere.
    fn edge_block(ino: u64, disk: u64, crc: u32) -> ReadPiece {
        ReadPiece {
            request: usize::MAX,
            ino,
            disk,
            count: 1,
            crcs: vec![crc],
            src: 0..0,
            dst: 0..0,
            joins: None,
        }
    }
}

/// fallocate(2) modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FallocateMode {
    pub keep_size: bool,
    pub punch_hole: bool,
    pub zero_range: bool,
}

/// One extent as found in the tree: its first file block and its item.
#[derive(Debug, Clone)]
struct Extent {
    file_block: u64,
    item: ExtentItem,
}

impl Extent {
    fn end(&self) -> u64 {
        self.file_block + self.item.blocks as u64
    }
}

fn extent_key(ino: u64, file_block: u64) -> Key {
    Key::new(ino, ItemKind::ExtentData, file_block * BLOCK)
}
