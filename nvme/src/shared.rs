//! Writes from memory the caller shares with the device instead of copying it into a DMA
//! buffer first ([`crate::IoOp::WriteShared`]), and the copies such memory comes from
//! ([`aligned_copy`], and [`staging_copy`] for a write the engine stages).
//!
//! A write staged in the engine is already a [`Bytes`] that nobody may change: handing those
//! bytes to the device saves a copy of every byte written (on the file backend, 1 MiB
//! sequential writes went 12-20% faster when the copy was skipped, measured before this
//! was built). A queue says how many memory ranges one such write may span
//! ([`crate::DeviceInfo::shared_write_ranges_max`]: the file backend's `WRITEV` many, an NVMe
//! command one, 0 for none); a write it cannot take is handed over in a DMA buffer as before.
//!
//! # Invariants
//! - The bytes of a shared write are immutable ([`Bytes`] has no way to change them) and the
//!   queue holds a reference to every piece until the write completes, so the device never
//!   reads memory that was freed or changed under it.
//! - Every piece starts at an address aligned to the device's LBA size and is a whole
//!   number of LBAs long (what `O_DIRECT` asks of memory), checked at submit
//!   ([`SharedWrite::check`]); the pieces together are at most the device's largest transfer.

use crate::{DevError, DeviceInfo};
use bytes::Bytes;

/// The alignment of [`aligned_copy`]'s memory: a page, which is at least the LBA size of
/// every device corefs runs on and what `O_DIRECT` asks of memory.
pub const ALIGN_BYTES: usize = 4096;

/// The pieces of one write, in device order: piece `i + 1`'s bytes follow piece `i`'s on
/// the device, wherever they sit in memory.
#[derive(Debug, Clone, Default)]
pub struct SharedWrite {
    pieces: Vec<Bytes>,
}

impl SharedWrite {
    pub fn new(pieces: Vec<Bytes>) -> SharedWrite {
        SharedWrite { pieces }
    }

    pub fn pieces(&self) -> &[Bytes] {
        &self.pieces
    }

    /// Bytes written, all pieces together.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory ranges to hand the device: the pieces, with those that follow each other in
    /// memory (slices of one staged write) joined, so a write staged as one allocation goes
    /// as one range. The ranges point into `self`, which must outlive their use.
    pub fn ranges(&self) -> Vec<(*const u8, usize)> {
        ranges_of(&self.pieces).collect()
    }

    /// Copies the pieces, in order, into `out` (exactly as long as the write): for queues
    /// that model a device in memory.
    pub fn copy_to(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.len(), "a shared write copied whole");
        let mut at = 0;
        for piece in &self.pieces {
            out[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
    }

    /// The write's bytes in one vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        self.copy_to(&mut out);
        out
    }

    /// Whether a queue described by `info` may take this write ([`check_pieces`]).
    pub fn check(&self, info: &DeviceInfo) -> Result<(), DevError> {
        check_pieces(&self.pieces, info)
    }

    /// True when a queue described by `info` takes `pieces` as one shared write
    /// ([`check_pieces`], for a caller choosing between that and a copy).
    pub fn fits(pieces: &[Bytes], info: &DeviceInfo) -> bool {
        check_pieces(pieces, info).is_ok()
    }
}

/// Whether a queue described by `info` may take `pieces` as one shared write: it writes from
/// shared memory at all ([`SharedFit::new`]), every piece is aligned and sized as the module's
/// invariants say and they span few enough memory ranges ([`SharedFit::push`]), and together
/// they are a transfer the queue takes.
fn check_pieces(pieces: &[Bytes], info: &DeviceInfo) -> Result<(), DevError> {
    let mut fit = SharedFit::new(info)?;
    for piece in pieces {
        fit.push(piece)?;
    }
    crate::check_len(info, fit.len_bytes, info.shared_write_bytes_max)
}

/// Whether pieces added one at a time still make one shared write a queue takes, kept as
/// they come: the one definition of alignment and of memory ranges, for a whole write
/// ([`SharedWrite::check`]) and for a caller growing a write piece by piece, which would
/// otherwise walk its pieces again for every piece added. The length against the queue's
/// largest transfer is the caller's to check ([`SharedFit::len_bytes`]).
#[derive(Debug, Clone, Copy)]
pub struct SharedFit {
    lba_size_bytes: usize,
    ranges_max: usize,
    ranges: usize,
    /// The address just past the last piece: a piece starting there joins its range.
    end_addr: usize,
    len_bytes: u64,
}

impl SharedFit {
    /// An empty write for a queue described by `info`; an error when the queue takes no
    /// writes from shared memory.
    pub fn new(info: &DeviceInfo) -> Result<SharedFit, DevError> {
        if info.shared_write_ranges_max == 0 {
            return Err(DevError::Unsupported {
                what: "writes from shared memory",
            });
        }
        Ok(SharedFit {
            lba_size_bytes: info.lba_size_bytes as usize,
            ranges_max: info.shared_write_ranges_max as usize,
            ranges: 0,
            end_addr: 0,
            len_bytes: 0,
        })
    }

    /// Adds `piece` at the end; an error (and `self` unchanged) when it is misaligned or
    /// would open one memory range more than the queue takes.
    pub fn push(&mut self, piece: &Bytes) -> Result<(), DevError> {
        let addr = piece.as_ptr() as usize;
        if addr % self.lba_size_bytes != 0 || piece.len() % self.lba_size_bytes != 0 {
            return Err(DevError::Misaligned {
                addr,
                len_bytes: piece.len(),
                lba_size_bytes: self.lba_size_bytes as u32,
            });
        }
        let ranges = self.ranges + usize::from(self.ranges == 0 || addr != self.end_addr);
        if ranges > self.ranges_max {
            return Err(DevError::Unsupported {
                what: "a shared write in more memory ranges than the queue takes",
            });
        }
        self.ranges = ranges;
        self.end_addr = addr + piece.len();
        self.len_bytes += piece.len() as u64;
        Ok(())
    }

    /// The memory ranges the pieces so far make ([`SharedWrite::ranges`] counted).
    pub fn ranges(&self) -> usize {
        self.ranges
    }

    /// Bytes of the pieces so far.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

/// The memory ranges `pieces` make, in order: runs of pieces that follow each other in
/// memory joined into one.
fn ranges_of(pieces: &[Bytes]) -> impl Iterator<Item = (*const u8, usize)> + '_ {
    let mut rest = pieces.iter().peekable();
    std::iter::from_fn(move || {
        let first = rest.next()?;
        let (at, mut len) = (first.as_ptr(), first.len());
        while let Some(next) = rest.next_if(|p| at.wrapping_add(len) == p.as_ptr()) {
            len += next.len();
        }
        Some((at, len))
    })
}

/// A copy of `data` at an [`ALIGN_BYTES`]-aligned address, so that its slices at block
/// offsets are aligned too and a device can write from them: an ordinary allocation up to a
/// page longer, the bytes placed at its first aligned address. Not an allocation asked
/// aligned: glibc's `memalign` of a megabyte mapped fresh pages every time (its request
/// exceeds the mmap threshold glibc had raised to the size of the writes freed before), a
/// page fault per 4 KiB copied, 272k per GiB written and 60% more CPU than the copy it saves.
pub fn aligned_copy(data: &[u8]) -> Bytes {
    aligned_copy_visiting(data, data.len().max(1), |_| {})
}

/// [`aligned_copy`], handing `visit` each `chunk_bytes` of the copy (the last may be
/// shorter) just after it is copied, while it is in the cache: a checksum of the copy costs
/// a fraction of what it costs later on another core (a 1 MiB write's crc32c, taken by the
/// reactor from the caller's copy, was a third of the reactor's time in fio's sequential
/// writes).
pub fn aligned_copy_visiting(data: &[u8], chunk_bytes: usize, visit: impl FnMut(&[u8])) -> Bytes {
    let mut padded: Vec<u8> = Vec::with_capacity(data.len() + ALIGN_BYTES - 1);
    let pad = padded.as_ptr().align_offset(ALIGN_BYTES);
    padded.resize(pad, 0);
    extend_visiting(&mut padded, data, chunk_bytes, visit);
    Bytes::from(padded).slice(pad..)
}

/// Appends `data` to `out` a chunk at a time, handing `visit` each copied chunk.
fn extend_visiting(
    out: &mut Vec<u8>,
    data: &[u8],
    chunk_bytes: usize,
    mut visit: impl FnMut(&[u8]),
) {
    assert!(chunk_bytes > 0, "chunks of at least a byte");
    assert!(
        out.capacity() - out.len() >= data.len(),
        "room for the copy"
    );
    for chunk in data.chunks(chunk_bytes) {
        let at = out.len();
        // Within capacity (asserted above): no reallocation moves what was visited.
        out.extend_from_slice(chunk);
        visit(&out[at..]);
    }
}

/// The copy of a write's bytes that the engine stages: aligned ([`aligned_copy`]) from
/// [`STAGING_ALIGNED_FROM_BYTES`] on, so the device writes them back from that copy; an
/// ordinary one below, copied again into a DMA buffer at write back, which for a small write
/// costs less than the padding (a 4 KiB append's copy would take two pages) and the pinning
/// of its page for a write from user memory (append+fdatasync did 3-24% fewer ops with every
/// write aligned, 3 pairs of runs).
pub fn staging_copy(data: &[u8]) -> Bytes {
    staging_copy_visiting(data, data.len().max(1), |_| {})
}

/// [`staging_copy`], handing `visit` each `chunk_bytes` of the copy as it is made
/// ([`aligned_copy_visiting`]).
pub fn staging_copy_visiting(data: &[u8], chunk_bytes: usize, visit: impl FnMut(&[u8])) -> Bytes {
    if data.len() >= STAGING_ALIGNED_FROM_BYTES {
        aligned_copy_visiting(data, chunk_bytes, visit)
    } else {
        let mut copy = Vec::with_capacity(data.len());
        extend_visiting(&mut copy, data, chunk_bytes, visit);
        Bytes::from(copy)
    }
}

/// See [`staging_copy`]: a write from this size on is staged aligned.
pub const STAGING_ALIGNED_FROM_BYTES: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aligned_copy_is_aligned_equal_and_its_block_slices_too() {
        for len in [1, 4096, 4096 * 3 + 100, STAGING_ALIGNED_FROM_BYTES, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            for copy in [aligned_copy(&data), staging_copy(&data)] {
                assert_eq!(&copy[..], &data[..]);
            }
            let copy = aligned_copy(&data);
            assert_eq!(copy.as_ptr() as usize % ALIGN_BYTES, 0, "len {len}");
            if len > 8192 {
                let block = copy.slice(4096..8192);
                assert_eq!(block.as_ptr() as usize % ALIGN_BYTES, 0);
            }
            if len >= STAGING_ALIGNED_FROM_BYTES {
                let staged = staging_copy(&data);
                assert_eq!(staged.as_ptr() as usize % ALIGN_BYTES, 0, "len {len}");
            }
        }
    }

    #[test]
    fn a_visited_copy_hands_over_each_chunk_of_the_copy_in_order() {
        for len in [
            1,
            4095,
            4096,
            3 * 4096 + 7,
            STAGING_ALIGNED_FROM_BYTES + 4096,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13 + 1) as u8).collect();
            let mut seen: Vec<(usize, Vec<u8>)> = Vec::new();
            let copy = staging_copy_visiting(&data, 4096, |chunk| {
                seen.push((chunk.as_ptr() as usize, chunk.to_vec()));
            });
            assert_eq!(&copy[..], &data[..], "len {len}");
            assert_eq!(seen.len(), len.div_ceil(4096), "len {len}");
            for (i, (addr, bytes)) in seen.iter().enumerate() {
                // The chunk handed over is the copy's own memory, not the source's.
                assert_eq!(
                    *addr,
                    copy.as_ptr() as usize + i * 4096,
                    "len {len} chunk {i}"
                );
                assert_eq!(bytes[..], data[i * 4096..(i * 4096 + 4096).min(len)]);
            }
        }
    }

    #[test]
    fn ranges_join_pieces_that_follow_each_other_in_memory_only() {
        let a = aligned_copy(&[1u8; 3 * 4096]);
        let b = aligned_copy(&[2u8; 4096]);
        let write = SharedWrite::new(vec![a.slice(0..4096), a.slice(4096..8192), b.clone()]);
        let ranges = write.ranges();
        assert_eq!(ranges.len(), 2, "{ranges:?}");
        assert_eq!(ranges[0], (a.as_ptr(), 8192));
        assert_eq!(ranges[1], (b.as_ptr(), 4096));
        // Counted as they come, the same ranges.
        let info = DeviceInfo {
            shared_write_ranges_max: 8,
            ..test_info()
        };
        let mut fit = SharedFit::new(&info).unwrap();
        for (i, piece) in write.pieces().iter().enumerate() {
            fit.push(piece).unwrap();
            assert_eq!(fit.ranges(), [1, 1, 2][i], "after piece {i}");
        }
        assert_eq!(fit.len_bytes(), write.len() as u64);
        // Out of order in memory: not joined, whatever their addresses.
        let swapped = SharedWrite::new(vec![a.slice(4096..8192), a.slice(0..4096)]);
        assert_eq!(swapped.ranges().len(), 2);
        let mut out = vec![0; write.len()];
        write.copy_to(&mut out);
        assert_eq!(&out[..8192], &[1u8; 8192][..]);
        assert_eq!(&out[8192..], &[2u8; 4096][..]);
    }

    fn test_info() -> DeviceInfo {
        DeviceInfo {
            name: "test".into(),
            lba_size_bytes: 512,
            capacity_lbas: 1 << 20,
            queue_depth: 8,
            max_io_bytes: 128 << 10,
            fua_native: false,
            completion_mode: crate::CompletionMode::Immediate,
            shared_write_ranges_max: 1,
            shared_write_bytes_max: 128 << 10,
        }
    }

    #[test]
    fn misaligned_pieces_are_refused_with_their_address() {
        let info = test_info();
        let a = aligned_copy(&[1u8; 8192]);
        assert!(SharedWrite::new(vec![a.slice(512..1024)])
            .check(&info)
            .is_ok());
        let err = SharedWrite::new(vec![a.slice(100..612)])
            .check(&info)
            .unwrap_err();
        assert!(matches!(err, DevError::Misaligned { .. }), "{err}");
        let err = SharedWrite::new(vec![a.slice(0..100)])
            .check(&info)
            .unwrap_err();
        assert!(matches!(err, DevError::Misaligned { .. }), "{err}");
        // One range at most: joined slices pass, pieces apart do not.
        let joined = [a.slice(0..4096), a.slice(4096..8192)];
        assert!(SharedWrite::fits(&joined, &info));
        assert!(SharedWrite::new(joined.to_vec()).check(&info).is_ok());
        let apart = [a.slice(4096..8192), a.slice(0..4096)];
        assert!(!SharedWrite::fits(&apart, &info));
        let err = SharedWrite::new(apart.to_vec()).check(&info).unwrap_err();
        assert!(matches!(err, DevError::Unsupported { .. }), "{err}");
        // A refused piece leaves the running account as it was.
        let mut fit = SharedFit::new(&info).unwrap();
        fit.push(&apart[0]).unwrap();
        assert!(fit.push(&apart[1]).is_err());
        assert!(fit.push(&a.slice(100..612)).is_err());
        assert_eq!((fit.ranges(), fit.len_bytes()), (1, 4096));
        // Too long for the queue: the length is the whole write's check.
        let long = aligned_copy(&vec![3u8; 256 << 10]);
        assert!(!SharedWrite::fits(&[long], &info));
        let unsupported = DeviceInfo {
            shared_write_ranges_max: 0,
            ..info
        };
        assert!(!SharedWrite::fits(&joined, &unsupported));
        let err = SharedWrite::new(vec![a]).check(&unsupported).unwrap_err();
        assert!(matches!(err, DevError::Unsupported { .. }), "{err}");
    }
}
