//! A write's bytes as staged by whoever copied them in, with the crc32c of each of their
//! blocks when that copy computed it ([`Staged::copy_of`]).
//!
//! Every block an extent holds carries its crc32c. Computed by the engine at staging, it is
//! read from memory another core wrote: in fio's 1 MiB sequential writes through the C ABI
//! the caller's thread copied the bytes and the reactor then spent a third of its time
//! checksumming that copy, cold. The thread that copies computes each block's sum right after
//! copying it, while it is in the cache, and the sums travel with the bytes.
//!
//! # Invariants
//! - `block_crcs[i]` is the crc32c of bytes `i * BLOCK_BYTES ..` of `bytes`, for every whole
//!   block of them (a shorter tail has none). They are used only where the bytes land
//!   block-aligned in the file, as they are cut there ([`Staged::slice`] keeps them only for
//!   a cut at a block boundary).
//! - Debug builds check every sum they use against the bytes ([`Staged::block_crcs`]).

use crate::format::BLOCK_BYTES;
use bytes::Bytes;
use std::sync::Arc;

/// Bytes nobody may change, and their blocks' crc32c when known.
#[derive(Clone, Default)]
pub struct Staged {
    bytes: Bytes,
    /// The crcs and the index of this value's first block among them (a slice shares them).
    block_crcs: Option<(Arc<[u32]>, usize)>,
}

impl Staged {
    /// The staging copy of `data` ([`nvme::staging_copy`]), each whole block's crc32c taken
    /// as it is copied.
    pub fn copy_of(data: &[u8]) -> Staged {
        let mut crcs = Vec::with_capacity(data.len() / BLOCK_BYTES);
        let bytes = nvme::staging_copy_visiting(data, BLOCK_BYTES, |block| {
            if block.len() == BLOCK_BYTES {
                crcs.push(crc32c::crc32c(block));
            }
        });
        Staged {
            bytes,
            block_crcs: (!crcs.is_empty()).then(|| (crcs.into(), 0)),
        }
    }

    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    pub fn into_bytes(self) -> Bytes {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes `range`, with their crcs when the cut is at a block boundary.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Staged {
        let block_crcs = match &self.block_crcs {
            Some((crcs, first)) if range.start % BLOCK_BYTES == 0 => {
                Some((crcs.clone(), first + range.start / BLOCK_BYTES))
            }
            _ => None,
        };
        Staged {
            bytes: self.bytes.slice(range),
            block_crcs,
        }
    }

    /// The crc32c of each block of these bytes, which must be whole blocks: the ones
    /// computed at the copy, or computed now.
    pub fn block_crcs(&self) -> Vec<u32> {
        assert_eq!(self.bytes.len() % BLOCK_BYTES, 0, "whole blocks only");
        let blocks = self.bytes.len() / BLOCK_BYTES;
        match &self.block_crcs {
            Some((crcs, first)) if first + blocks <= crcs.len() => {
                let known = crcs[*first..first + blocks].to_vec();
                debug_assert!(
                    known
                        .iter()
                        .zip(self.bytes.chunks(BLOCK_BYTES))
                        .all(|(crc, block)| *crc == crc32c::crc32c(block)),
                    "a staged write's crcs are its blocks'"
                );
                known
            }
            _ => self.bytes.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect(),
        }
    }

    /// Whether the crcs come with the bytes (for tests and statistics).
    pub fn has_block_crcs(&self) -> bool {
        matches!(&self.block_crcs, Some((crcs, first)) if first + self.bytes.len() / BLOCK_BYTES <= crcs.len())
    }
}

impl From<Bytes> for Staged {
    /// Bytes without their crcs: the engine computes them at staging.
    fn from(bytes: Bytes) -> Staged {
        Staged {
            bytes,
            block_crcs: None,
        }
    }
}

impl From<Vec<u8>> for Staged {
    fn from(bytes: Vec<u8>) -> Staged {
        Bytes::from(bytes).into()
    }
}

impl std::ops::Deref for Staged {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for Staged {
    /// The bytes: the sums are a cache of them, not part of the write.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.bytes.fmt(f)
    }
}

impl PartialEq for Staged {
    /// Equal bytes are equal writes, whoever computed the crcs.
    fn eq(&self, other: &Staged) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Staged {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_carries_its_blocks_crcs_and_so_do_its_slices_at_block_boundaries() {
        let data: Vec<u8> = (0..5 * BLOCK_BYTES + 100)
            .map(|i| (i * 31 + 7) as u8)
            .collect();
        let staged = Staged::copy_of(&data);
        assert_eq!(&staged[..], &data[..]);
        let want =
            |bytes: &[u8]| -> Vec<u32> { bytes.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect() };
        let whole = staged.slice(0..5 * BLOCK_BYTES);
        assert!(whole.has_block_crcs());
        assert_eq!(whole.block_crcs(), want(&data[..5 * BLOCK_BYTES]));
        let middle = staged.slice(BLOCK_BYTES..4 * BLOCK_BYTES);
        assert!(middle.has_block_crcs());
        assert_eq!(
            middle.block_crcs(),
            want(&data[BLOCK_BYTES..4 * BLOCK_BYTES])
        );
        // Sliced again: the first block's index adds up.
        let inner = middle.slice(2 * BLOCK_BYTES..3 * BLOCK_BYTES);
        assert!(inner.has_block_crcs());
        assert_eq!(
            inner.block_crcs(),
            want(&data[3 * BLOCK_BYTES..4 * BLOCK_BYTES])
        );
        // Cut inside a block: the sums are of other bytes, so they go, and are computed.
        let shifted = staged.slice(100..100 + 4 * BLOCK_BYTES);
        assert!(!shifted.has_block_crcs());
        assert_eq!(
            shifted.block_crcs(),
            want(&data[100..100 + 4 * BLOCK_BYTES])
        );
        // Bytes handed over without sums get theirs computed.
        let plain = Staged::from(data[..2 * BLOCK_BYTES].to_vec());
        assert!(!plain.has_block_crcs());
        assert_eq!(plain.block_crcs(), want(&data[..2 * BLOCK_BYTES]));
        assert_eq!(plain, Staged::copy_of(&data[..2 * BLOCK_BYTES]));
    }
}
