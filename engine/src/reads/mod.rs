//! Asynchronous data reads: the device half of a read runs while its caller (a reactor)
//! serves other requests.
//!
//! [`Filesystem::read_start`](crate::Filesystem::read_start) plans a set of reads — maps their extents, copies what memory
//! holds (staged data, the block cache, blocks being written back) — and submits the data
//! blocks left to fetch as device reads of the mux's read class
//! ([`crate::mux::READ`]), whose completions no synchronous path ever sees.
//! [`Filesystem::read_progress`](crate::Filesystem::read_progress) reaps completions, verifies every block against its
//! extent's crc, and hands back each set that finished. A data block goes from its DMA
//! buffer to the request's output (and the block cache) in one copy, as its device read
//! completes; no staging buffer is allocated or zeroed per read. [`Filesystem::read_many`](crate::Filesystem::read_many) is the
//! synchronous form (tools, tests, the commit coordinator): start, then wait for that set.
//!
//! # Invariants
//! - A block a read in flight was planned against is never reused under it. Reads copy
//!   nothing from the device that the plan did not name, and the blocks named are live at
//!   plan time; a later overwrite, punch or unlink frees them pinned. Blocks freed in
//!   generation G are unpinned only when no read planned in G or before is in flight:
//!   [`Filesystem::unpin_waits_for_reads`](crate::Filesystem::unpin_waits_for_reads) lets a reactor defer its unpin, and every forced
//!   unpin (the next commit's start, lending shards, unmount) first finishes those reads.
//! - Ordering with writes is by block, in the mux: a read of a block being written back is
//!   answered with the bytes being written, never with the device's older ones.
//! - Bounded: asynchronous reads use at most half of the queue and at most half of the DMA
//!   buffers, so the other half is always there for synchronous I/O and background writes.
//!   (With an eighth left, read-ahead that nobody reaped yet held 28 of 32 buffers, and a
//!   write-back with nothing of its own in flight to free one failed the write with
//!   `PoolExhausted`.) The device reads beyond that wait in `queued`, and are
//!   submitted in order as completions free room. The sets in flight are bounded by the
//!   caller (a reactor's requests owed).
//! - Results leave in completion order, each set once, with one result per request in the
//!   order asked.
//!
//! Fault model: a device error (at submit or completion) fails every request of the set
//! that waited for it and makes the filesystem fail-stop; a block whose crc mismatches
//! fails its own request alone. Nothing is retried.

use crate::error::{EngineError, Result};
use crate::file::ReadPiece;
use crate::format::BLOCK_BYTES;
use std::collections::{HashMap, VecDeque};

mod ops;

/// One request's result: its bytes, or why it failed.
pub type ReadResult = Result<Vec<u8>>;

/// What [`Filesystem::read_start`](crate::Filesystem::read_start) did with a set of reads.
#[derive(Debug)]
pub enum ReadStart {
    /// Everything came from memory (or failed before the device): the results, in order.
    Done(Vec<ReadResult>),
    /// Device reads are in flight: the set's number, which [`Filesystem::read_progress`](crate::Filesystem::read_progress)
    /// hands back with the results.
    Pending(u64),
}

/// What [`Filesystem::read_start_deferred`](crate::Filesystem::read_start_deferred) did with each request of a batch.
#[derive(Debug, Default)]
pub struct ReadsStarted {
    /// Requests answered now (from memory, or failed before the device): `(index in the
    /// batch, result)`, in batch order.
    pub done: Vec<(usize, ReadResult)>,
    /// The requests that wait for the device, one set each: `(set number, index in the
    /// batch)`. [`Filesystem::read_progress`](crate::Filesystem::read_progress) hands each set back with its one result as
    /// soon as that request's own device reads are done, so a read never waits for
    /// another's (a set of the whole batch held every reply for the slowest read in it:
    /// about 100 µs per read at queue depth 32 on a file image).
    pub pending: Vec<(u64, usize)>,
    /// Requests whose lookups missed the node cache: `(index in the batch, node set)`.
    pub parked: Vec<(usize, u64)>,
}

/// Asynchronous read counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadStats {
    /// Sets that needed the device, and the device reads they made.
    pub sets_async: u64,
    pub device_reads: u64,
    /// Device reads that waited in the queue for room before their submit.
    pub device_reads_queued: u64,
    /// Device reads completed, and their time from submit to reap summed: the mean device
    /// read time, and (over a run's length, by Little's law) the mean reads in flight.
    pub device_reads_done: u64,
    pub device_read_ns_sum: u64,
    /// Most sets in flight at once.
    pub sets_in_flight_max: u64,
    /// Sets of tree-node blocks for deferred lookups ([`crate::fetch`]).
    pub node_sets: u64,
    /// Read-ahead sets started, and the blocks they fetched.
    pub ahead_sets: u64,
    pub ahead_blocks: u64,
    /// Blocks reads took from a read-ahead's device read still in flight when they were
    /// planned (waiting for it rather than reading them again).
    pub ahead_joined_blocks: u64,
    /// Reads a lent engine made in its caller's thread beside the queue
    /// ([`Filesystem::read_lent`](crate::Filesystem::read_lent)), and the data blocks they read.
    pub lent_reads: u64,
    pub lent_read_blocks: u64,
}

/// The longest read a lent engine makes beside the queue in its caller's thread
/// ([`Filesystem::read_lent`](crate::Filesystem::read_lent)): its reactor waits for the engine meanwhile, so a long read
/// goes to the reactor, which overlaps it with other work.
pub const LENT_READ_BYTES_MAX: usize = 128 << 10;

/// A set of reads waiting for the device.
struct ReadSet {
    outs: Vec<ReadResult>,
    pieces: Vec<ReadPiece>,
    /// A node set's blocks as they arrive, one buffer per piece (they go to the fetched map
    /// whole). Data and read-ahead sets keep none: each device read is verified, cached and
    /// copied to its request's output straight from its DMA buffer ([`take_blocks`]).
    data: Vec<Vec<u8>>,
    /// Device reads of the set not completed yet.
    ios_left: usize,
    /// The generation running when the set was planned: its blocks stay pinned while it is
    /// in flight.
    generation: u64,
    /// The first device error met.
    failed: Option<EngineError>,
    /// Data sets are handed back with their results; a node set's blocks go to the
    /// fetched map ([`crate::fetch`]) and it is handed back with none; a read-ahead's blocks
    /// go to the block cache (those whose crc matches) and it is handed back to no one.
    kind: SetKind,
}

/// Read-ahead: a file read sequentially (each read starting where the one before ended)
/// has a window past its read fetched into the block cache in the
/// background, and the next window fetched once the reader is half way through the one
/// before, so the device works while the reader copies. The window starts at twice the read
/// (at least [`READAHEAD_BYTES`]) and doubles with each window fetched, up to four reads'
/// worth (at least 1 MiB), at most [`READAHEAD_BYTES_MAX`] and a quarter of the block cache:
/// a 1 MiB reader keeps about 4 MiB coming, as the kernel's read-ahead grows for `dd bs=1M`;
/// a 4 KiB reader 256 KiB. A fixed 256 KiB behind 1 MiB reads served 0.4% of their blocks
/// (each read found most of its blocks neither cached nor asked for, and read them itself).
/// A read whose blocks a read-ahead is still fetching waits for that device read instead of
/// asking again ([`AheadIo`]). [`STREAMS`] files are followed at once (the least recently
/// read is forgotten).
pub const READAHEAD_BYTES: u64 = 256 << 10;
pub const READAHEAD_BYTES_MAX: u64 = 8 << 20;
pub const STREAMS: usize = 16;

/// The largest read-ahead window for reads of `len` bytes, with a block cache of
/// `cache_bytes`: read-ahead arrives in the cache's probation segment, and a window larger
/// than a quarter of the cache (two in flight beside other readers' blocks) would push its
/// own blocks out before its reader gets to them.
pub(super) fn window_max(len: u64, cache_bytes: u64) -> u64 {
    len.saturating_mul(4)
        .clamp(1 << 20, READAHEAD_BYTES_MAX)
        .min(cache_bytes / 4)
        .max(READAHEAD_BYTES.min(cache_bytes / 4))
}

/// Where a run of a read's blocks comes from ([`Filesystem::read_run`](crate::Filesystem::read_run)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunSource {
    /// The block cache holds every block, each matching its crc.
    Cache,
    /// A read-ahead's device read on its way (by its first block) fetches them.
    Ahead(u64),
    /// A device read of their own.
    Device,
}

/// A read-ahead's device read in flight (or queued), by its first block: the sets of reads
/// planned while it was on its way that take some of its blocks from it when it completes
/// (each `(set, piece)`, the piece inside its range), instead of reading them again.
#[derive(Debug, Default)]
struct AheadIo {
    blocks: u64,
    joiners: Vec<(u64, usize)>,
}

/// What a set of device reads is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetKind {
    /// Requests' data (handed back with their results).
    Data,
    /// Tree nodes for deferred lookups ([`crate::fetch`]).
    Nodes,
    /// Read-ahead into the block cache.
    Ahead,
    /// Blocks a deferred write waits for, into the block cache ([`crate::fetch`]): answered
    /// with no results, so the write runs again.
    Fill,
}

/// One followed file: where its next sequential read starts, how far read-ahead went, and
/// its window.
#[derive(Debug, Clone, Copy, Default)]
struct Stream {
    ino: u64,
    next: u64,
    ahead_to: u64,
    window: u64,
    last_used: u64,
}

impl Stream {
    /// The window a fetch for a read of `len` bytes uses: the stream's, or for a stream
    /// (re)started, twice the read (at least [`READAHEAD_BYTES`]).
    fn window_for(&self, len: u64, cache_bytes: u64) -> u64 {
        match self.window {
            0 => len
                .saturating_mul(2)
                .max(READAHEAD_BYTES)
                .min(window_max(len, cache_bytes)),
            window => window,
        }
    }

    /// Whether a read of `offset..end` continues this stream and leaves less than half a
    /// window read ahead of it: read-ahead then fetches the next window.
    fn fetch_due(&self, offset: u64, end: u64, cache_bytes: u64) -> bool {
        let window = self.window_for(end - offset, cache_bytes);
        self.next == offset && self.ahead_to < end + window / 2
    }
}

/// One device read of a set: `blocks` blocks at `block` into piece `piece` at byte `at`.
#[derive(Debug, Clone, Copy)]
struct ReadIo {
    set: u64,
    piece: usize,
    at: usize,
    block: u64,
    blocks: u64,
}

/// The engine's asynchronous reads.
#[derive(Default)]
pub(crate) struct Reads {
    next_set: u64,
    next_io: u64,
    sets: HashMap<u64, ReadSet>,
    /// Device reads not submitted yet (no room), in order.
    queued: VecDeque<ReadIo>,
    /// Device reads submitted, by token (without the tag), with when.
    in_flight: HashMap<u64, (ReadIo, std::time::Instant)>,
    /// Sets finished and not handed out yet.
    ready: VecDeque<(u64, Vec<ReadResult>)>,
    /// Read-ahead's device reads not completed, by first block; their ranges never overlap
    /// (read-ahead plans no block already on its way).
    ahead: std::collections::BTreeMap<u64, AheadIo>,
    /// Files read sequentially ([`READAHEAD_BYTES`]), and a clock for forgetting them.
    streams: [Stream; STREAMS],
    stream_clock: u64,
    pub(crate) stats: ReadStats,
}

impl Reads {
    /// The read-ahead device read (first block, blocks) that is fetching disk block `disk`,
    /// if one is on its way.
    pub(crate) fn ahead_covering(&self, disk: u64) -> Option<(u64, u64)> {
        let (&first, io) = self.ahead.range(..=disk).next_back()?;
        (disk < first + io.blocks).then_some((first, io.blocks))
    }

    /// Whether no read-ahead on its way fetches any of blocks `first..first + blocks`:
    /// the ranges never overlap, so the one starting before and the one starting inside
    /// decide it.
    fn ahead_free(&self, first: u64, blocks: u64) -> bool {
        self.ahead_covering(first).is_none()
            && self.ahead.range(first..first + blocks).next().is_none()
    }
}

/// The blocks one device read `io` brought (`bytes`) for a data or read-ahead set, straight
/// from its DMA buffer: each block is checked against its extent's crc and cached when it
/// matches (a read-ahead's mismatching block is left out: the read that wants it reads the
/// device and reports what it finds); for a data set, a mismatch fails the block's request
/// and the bytes of the request's range this read covers are copied to its output. The
/// crc32c of each block is left in `computed`, for the reads that joined a read-ahead's
/// device read ([`give_joined`]) to check their blocks without hashing them again.
fn take_blocks(
    set: &mut ReadSet,
    io: &ReadIo,
    bytes: &[u8],
    cache: &mut crate::writeback::BlockCache,
    computed: &mut Vec<u32>,
) {
    let piece = &set.pieces[io.piece];
    let first = io.at / BLOCK_BYTES;
    assert!(
        first + io.blocks as usize <= piece.count as usize,
        "a device read stays inside its piece"
    );
    let ahead = set.kind == SetKind::Ahead;
    let bad = check_blocks(piece, first, bytes, cache, ahead, computed);
    if set.kind != SetKind::Data {
        return;
    }
    cache.device_blocks += io.blocks;
    match (bad, &mut set.outs[piece.request]) {
        (Some(e), out @ Ok(_)) => *out = Err(e),
        (None, Ok(out)) => copy_piece(piece, io.at, bytes, out),
        // The request failed already (another piece's block): nothing to copy.
        (_, Err(_)) => {}
    }
}

/// Gives a read that joined a read-ahead's device read (`piece` of `set`, inside the
/// read-ahead's blocks from `first_block`) its blocks from that read's bytes: each checked
/// against the crc the joining read expects, using the crcs the read-ahead computed.
fn give_joined(
    set: &mut ReadSet,
    piece: usize,
    first_block: u64,
    bytes: &[u8],
    computed: &[u32],
    cache: &mut crate::writeback::BlockCache,
) {
    let piece = &set.pieces[piece];
    assert!(
        piece.disk >= first_block
            && (piece.disk - first_block + piece.count) as usize * BLOCK_BYTES <= bytes.len(),
        "a joined piece lies inside the read-ahead's device read"
    );
    let skip = (piece.disk - first_block) as usize;
    cache.device_blocks += piece.count;
    let bad = (0..piece.count as usize).find(|&i| computed[skip + i] != piece.crcs[i]);
    match (bad, &mut set.outs[piece.request]) {
        (Some(i), out @ Ok(_)) => *out = Err(crc_mismatch(piece, i, computed[skip + i])),
        (None, Ok(out)) => copy_piece(
            piece,
            0,
            &bytes[skip * BLOCK_BYTES..(skip + piece.count as usize) * BLOCK_BYTES],
            out,
        ),
        (_, Err(_)) => {}
    }
}

/// Checks the blocks `bytes` brought (blocks `first..` of `piece`) against their extent's
/// crcs and caches each that matches (`ahead`: as read-ahead); returns the first mismatch
/// as the error a read of them reports, and leaves each block's crc32c in `computed`.
fn check_blocks(
    piece: &ReadPiece,
    first: usize,
    bytes: &[u8],
    cache: &mut crate::writeback::BlockCache,
    ahead: bool,
    computed: &mut Vec<u32>,
) -> Option<EngineError> {
    let mut bad = None;
    computed.clear();
    for (k, block) in bytes.chunks(BLOCK_BYTES).enumerate() {
        let i = first + k;
        let crc = crc32c::crc32c(block);
        computed.push(crc);
        if crc == piece.crcs[i] {
            cache.insert_read(piece.disk + i as u64, block, crc, ahead);
        } else if bad.is_none() {
            bad = Some(crc_mismatch(piece, i, crc));
        }
    }
    bad
}

/// The error a read reports for block `i` of `piece`, whose bytes hash to `computed`.
fn crc_mismatch(piece: &ReadPiece, i: usize, computed: u32) -> EngineError {
    EngineError::corrupt(
        "data block",
        piece.disk + i as u64,
        format!(
            "checksum mismatch in inode {} (stored {:#010x}, computed {computed:#010x})",
            piece.ino, piece.crcs[i]
        ),
    )
}

/// Copies what `bytes` (the piece's bytes from `at` on) hold of the range of the piece a
/// request wants (`src`, landing at `dst` in its output `out`).
fn copy_piece(piece: &ReadPiece, at: usize, bytes: &[u8], out: &mut [u8]) {
    let lo = piece.src.start.max(at);
    let hi = piece.src.end.min(at + bytes.len());
    if lo < hi {
        let to = piece.dst.start + (lo - piece.src.start);
        out[to..to + (hi - lo)].copy_from_slice(&bytes[lo - at..hi - at]);
    }
}

/// Where a read from memory puts its bytes: a new buffer (asked as a length) or the
/// caller's. A length is answered as [`ReadOut::Vec`], a buffer as itself cut to the bytes
/// read.
pub(crate) enum ReadOut<'a> {
    Alloc(usize),
    Vec(Vec<u8>),
    Into(&'a mut [u8]),
}

impl ReadOut<'_> {
    /// How many bytes the read asks for; once answered, how many it read.
    pub(crate) fn len(&self) -> usize {
        match self {
            ReadOut::Alloc(len) => *len,
            ReadOut::Vec(v) => v.len(),
            ReadOut::Into(out) => out.len(),
        }
    }

    /// The bytes read so far (a planned read's, or its device pieces' to fill).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            ReadOut::Alloc(_) => &mut [],
            ReadOut::Vec(v) => v,
            ReadOut::Into(out) => out,
        }
    }

    /// The bytes of a read asked as a length.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            ReadOut::Vec(v) => v,
            _ => unreachable!("a read asked as a length is answered in a Vec"),
        }
    }
}
