//! Whole filesystem blocks to and from the device, synchronously: the block to LBA
//! mapping, single-block and run reads, and writes of many blocks coalesced into runs no
//! longer than the device's largest I/O (what one request carries). The lowest layer above
//! the device: tools, mount, replay, the checker and the background pipeline
//! ([`crate::log::inflight`]) use it, and it uses nothing of the engine but its format and
//! errors.
//!
//! # Invariants
//! - Only whole blocks: every piece written is a non-empty multiple of
//!   [`crate::format::BLOCK_BYTES`] (asserted), and a run never exceeds the device's largest
//!   transfer.
//! - Bounded: at most the queue's depth in flight, and the DMA pool's buffers; a pool with
//!   nothing free and nothing in flight is `PoolExhausted`, never a wait forever.
//!
//! Fault model: every completion is checked; the first device error is returned after every
//! request in flight has finished (their buffers go back to the pool), so a caller that
//! fails stop on it leaves nothing in flight behind. Nothing is retried.

use crate::error::{EngineError, Result};
use crate::format::BLOCK_BYTES;
use nvme::{BlockDevice, DevError, DmaBuf, IoOp, Request};
use std::time::Duration;

/// The device LBAs of filesystem block `block`.
pub(crate) fn block_lba(dev: &dyn BlockDevice, block: u64) -> u64 {
    block * (BLOCK_BYTES as u64 / dev.info().lba_size_bytes as u64)
}

/// Reads one filesystem block.
pub(crate) fn read_block(dev: &mut dyn BlockDevice, block: u64) -> Result<Vec<u8>> {
    let mut out = vec![0u8; BLOCK_BYTES];
    let lba = block_lba(dev, block);
    nvme::read_sync(dev, lba, &mut out)?;
    Ok(out)
}

/// Bytes of whole-block pieces (what a write-back or a commit chunk hands the device).
pub(crate) fn pieces_bytes(pieces: &[(u64, bytes::Bytes)]) -> usize {
    pieces.iter().map(|(_, d)| d.len()).sum()
}

/// Reads runs of whole blocks (`(first block, count)`), with as many device reads in flight
/// as the queue and the DMA pool allow; a run longer than the largest I/O is split. Returns
/// each run's bytes, in order. Every completion is checked; the first failure is returned
/// after all in-flight reads finish (their buffers go back to the pool).
pub(crate) fn read_runs(dev: &mut dyn BlockDevice, runs: &[(u64, u64)]) -> Result<Vec<Vec<u8>>> {
    let max_blocks = (dev.info().max_io_bytes as usize / BLOCK_BYTES).max(1) as u64;
    // (run index, byte offset in the run, first block, blocks) per device read.
    let mut ios: Vec<(usize, usize, u64, u64)> = Vec::new();
    for (run, &(start, count)) in runs.iter().enumerate() {
        let mut at = 0;
        while at < count {
            let n = (count - at).min(max_blocks);
            ios.push((run, at as usize * BLOCK_BYTES, start + at, n));
            at += n;
        }
    }
    let mut out: Vec<Vec<u8>> = runs
        .iter()
        .map(|&(_, count)| vec![0u8; count as usize * BLOCK_BYTES])
        .collect();
    let lbas: Vec<u64> = ios
        .iter()
        .map(|&(_, _, block, _)| block_lba(dev, block))
        .collect();
    pump(
        dev,
        ios.len(),
        |i| ios[i].3 as usize * BLOCK_BYTES,
        |i, buf| IoOp::Read { lba: lbas[i], buf },
        |i, buf| {
            let (run, offset, _, blocks) = ios[i];
            let buf = buf.expect("a read completion returns its buffer");
            let len = blocks as usize * BLOCK_BYTES;
            assert_eq!(buf.as_slice().len(), len, "device read length");
            out[run][offset..offset + len].copy_from_slice(buf.as_slice());
        },
    )?;
    Ok(out)
}

/// Runs `count` device I/Os with as many in flight as the queue and the DMA pool allow: I/O
/// `i` gets a buffer of `bytes(i)`, `op(i, buf)` fills it and says what to do with it, and
/// `done(i, buf)` takes each successful completion's buffer back. After the first failure
/// (at submit or completion) nothing more is submitted, and it is returned once every I/O in
/// flight has finished; a pool with nothing free and nothing in flight is `PoolExhausted`.
fn pump(
    dev: &mut dyn BlockDevice,
    count: usize,
    bytes: impl Fn(usize) -> usize,
    mut op: impl FnMut(usize, DmaBuf) -> IoOp,
    mut done: impl FnMut(usize, Option<DmaBuf>),
) -> Result<()> {
    let depth = dev.info().queue_depth as usize;
    let mut completions = Vec::new();
    let mut first_error: Option<DevError> = None;
    let mut next = 0usize;
    let mut in_flight = 0usize;
    loop {
        while in_flight < depth && next < count && first_error.is_none() {
            let Some(buf) = dev.pool().alloc(bytes(next)) else {
                if in_flight == 0 {
                    first_error = Some(DevError::PoolExhausted);
                }
                break; // buffers come back with completions
            };
            if let Err(rejected) = dev.submit(Request {
                token: next as u64,
                op: op(next, buf),
            }) {
                first_error.get_or_insert(rejected.reason);
                break;
            }
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        dev.wait(&mut completions, Duration::from_secs(1))?;
        for completion in completions.drain(..) {
            in_flight -= 1;
            match completion.result {
                Err(e) => {
                    first_error.get_or_insert(e);
                }
                Ok(()) => done(completion.token as usize, completion.buf),
            }
        }
    }
    match first_error {
        Some(e) => Err(EngineError::Device(e)),
        None => Ok(()),
    }
}

/// Neighbouring blocks that go to the device as one write: the pieces stay as they were
/// built and are copied once, into the DMA buffer, at submit. Joining them on the heap first
/// cost a commit a third of its pause (4,100 nodes: a growing buffer's reallocations and
/// the page faults of fresh memory).
pub(crate) struct Run {
    pub addr: u64,
    pieces: Vec<bytes::Bytes>,
    bytes: usize,
}

impl Run {
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// The pieces, for reuse once copied.
    pub fn into_pieces(self) -> Vec<bytes::Bytes> {
        self.pieces
    }

    /// Copies the pieces into `dst`, which is exactly the run's length.
    pub fn copy_to(&self, dst: &mut [u8]) {
        assert_eq!(
            dst.len(),
            self.bytes,
            "a run is copied into a buffer of its size"
        );
        let mut at = 0;
        for piece in &self.pieces {
            dst[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
    }
}

/// Sorts pieces of whole blocks by address and merges neighbours into runs no longer than
/// the device's largest I/O: what one write request carries. With `shared`, for a queue
/// that writes the runs from their pieces (the mux's pump), a run whose pieces the device
/// can take as one shared write ([`nvme::SharedFit`], kept as it grows) grows on to the device's
/// largest shared write: such a run longer than the largest I/O always fits.
pub(crate) fn coalesce(
    dev: &dyn BlockDevice,
    mut blocks: Vec<(u64, bytes::Bytes)>,
    shared: bool,
) -> Vec<Run> {
    blocks.sort_unstable_by_key(|(addr, _)| *addr);
    let info = dev.info();
    let max_bytes = (info.max_io_bytes as usize).max(BLOCK_BYTES);
    let shared_max_bytes = if shared && info.shared_write_ranges_max > 0 {
        (info.shared_write_bytes_max as usize).max(max_bytes)
    } else {
        max_bytes
    };
    // The last run's shared-write account, kept as it grows: `None` once the run no longer
    // makes one shared write (or the queue takes none).
    let mut last_fit: Option<nvme::SharedFit> = None;
    let grow = |fit: Option<nvme::SharedFit>, block: &bytes::Bytes| {
        fit.and_then(|mut fit| fit.push(block).ok().map(|()| fit))
    };
    let mut runs: Vec<Run> = Vec::new();
    // A piece larger than the largest I/O (staged data on a device with small buffers) is
    // cut into single blocks first.
    if blocks.iter().any(|(_, b)| b.len() > max_bytes) {
        let pieces = std::mem::take(&mut blocks);
        for (addr, piece) in pieces {
            if piece.len() <= max_bytes {
                blocks.push((addr, piece));
                continue;
            }
            // Slices of the piece: no copy.
            blocks.extend((0..piece.len() / BLOCK_BYTES).map(|i| {
                (
                    addr + i as u64,
                    piece.slice(i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES),
                )
            }));
        }
    }
    for (addr, block) in blocks {
        assert!(
            !block.is_empty() && block.len() % BLOCK_BYTES == 0,
            "whole blocks only"
        );
        let grown = grow(last_fit, &block);
        match runs.last_mut() {
            Some(run)
                if run.addr + (run.bytes / BLOCK_BYTES) as u64 == addr
                    && (run.bytes + block.len() <= max_bytes
                        || (grown.is_some() && run.bytes + block.len() <= shared_max_bytes)) =>
            {
                last_fit = grown;
                run.bytes += block.len();
                run.pieces.push(block);
            }
            _ => {
                last_fit = grow(nvme::SharedFit::new(info).ok(), &block);
                runs.push(Run {
                    addr,
                    bytes: block.len(),
                    pieces: vec![block],
                });
            }
        }
    }
    runs
}

/// Writes whole blocks, coalescing neighbours into larger I/Os, with as many in flight as the
/// queue allows. Every completion is checked; the first failure is returned after all finish.
pub(crate) fn write_blocks(
    dev: &mut dyn BlockDevice,
    blocks: Vec<(u64, bytes::Bytes)>,
) -> Result<()> {
    let runs = coalesce(dev, blocks, false);
    let lbas: Vec<u64> = runs.iter().map(|run| block_lba(dev, run.addr)).collect();
    pump(
        dev,
        runs.len(),
        |i| runs[i].len_bytes(),
        |i, mut buf| {
            runs[i].copy_to(buf.as_mut_slice());
            IoOp::Write {
                lba: lbas[i],
                buf,
                fua: false,
            }
        },
        |_, _| {},
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme::backend::mem::{MemConfig, MemDevice};

    const KIB: usize = 1024;

    /// Run lengths in KiB.
    fn run_kib(dev: &MemDevice, blocks: &[(u64, bytes::Bytes)], shared: bool) -> Vec<usize> {
        coalesce(dev, blocks.to_vec(), shared)
            .iter()
            .map(|run| run.len_bytes() / KIB)
            .collect()
    }

    #[test]
    fn a_run_grows_past_the_largest_io_only_while_it_makes_one_shared_write() {
        let dev = MemDevice::new(MemConfig {
            buf_bytes: 128 * KIB,
            ..MemConfig::default()
        })
        .expect("memory device");
        assert_eq!(dev.info().max_io_bytes as usize, 128 * KIB);
        let blocks_of = |data: &bytes::Bytes, at: usize, first: u64, count: usize| {
            (0..count)
                .map(|i| {
                    let start = at + i * BLOCK_BYTES;
                    (first + i as u64, data.slice(start..start + BLOCK_BYTES))
                })
                .collect::<Vec<_>>()
        };
        let staged = nvme::aligned_copy(&vec![7u8; 512 * KIB + 1]);
        let aligned = blocks_of(&staged, 0, 100, 128);
        let misaligned = blocks_of(&staged, 1, 100, 128);
        // Slices of one aligned copy: one shared write; copied, in runs of the largest I/O.
        assert_eq!(run_kib(&dev, &aligned, true), [512]);
        assert_eq!(run_kib(&dev, &aligned, false), [128; 4]);
        // Misaligned in memory: no shared write, whatever was asked.
        assert_eq!(run_kib(&dev, &misaligned, true), [128; 4]);
        // Aligned then not: the run stops growing where its pieces stop fitting.
        let mut mixed = aligned[..64].to_vec();
        mixed.extend(blocks_of(&staged, 1, 164, 64));
        assert_eq!(run_kib(&dev, &mixed, true), [256, 128, 128]);
        // Unsorted pieces come out sorted, and a gap in the addresses ends a run.
        let mut gapped = aligned[..4].to_vec();
        gapped.reverse();
        gapped.push((200, staged.slice(0..BLOCK_BYTES)));
        assert_eq!(run_kib(&dev, &gapped, true), [16, 4]);
    }
}
