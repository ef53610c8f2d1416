//! The engine's device, multiplexed: one queue split into *background* requests (a record's
//! or a commit's writes and flushes, staged data written back, tagged in the token) whose
//! completions are kept for the log's pipeline ([`crate::log::inflight`]), asynchronous data
//! reads ([`crate::reads`]), and the engine's ordinary synchronous I/O, which never sees a
//! background completion. It also lends the engine to a thread that does not own the queue
//! ([`Lent`]): such a thread reads beside the queue or not at all.
//!
//! # Invariants
//! - Ordering is by block, not by a global drain: a background write's bytes stay in memory
//!   ([`DeviceMux::writing`]) from when it is queued until the device completes it, and a
//!   foreground read of those blocks is answered from them, never from the device; a
//!   foreground read or write of other blocks goes to the device at once, beside the
//!   background I/O. A foreground write never overlaps a background write in flight (the
//!   allocator never reuses a block a pending write targets: data frees are pinned until a
//!   commit, and a commit drains), checked; a foreground flush still waits for every
//!   background write (it must cover them).
//! - Bounded: background writes not yet submitted wait in a backlog, pumped at most
//!   [`PUMP_BYTES_MAX`] per call and never past a quarter of the queue or the DMA pool kept
//!   for synchronous I/O.
//! - The queue is its owner's: while the engine is lent ([`Lent`]), every submission, poll
//!   and wait asserts, except reads beside the queue through the device's any-thread handle.
//! - Writes beside the queue (an fsync's record run by a client, [`SideIo`]) are queued only
//!   while nothing is in flight ([`DeviceMux::idle`]) and made by the client after it gave
//!   the engine back; their bytes stay in `writing`, as a background write's, until the
//!   client posts their completions ([`SideDone`]) and the next holder of the engine takes
//!   them ([`DeviceMux::take_side_done`]) as a device's.
//!
//! Fault model: a device error is handed to whoever waits for the request (the pipeline makes
//! the filesystem fail-stop on a background one); nothing is retried here.

use crate::blocks::Run;
use nvme::{BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, Rejected, Request};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The top 16 bits of a background request's token; the rest is `ticket << 1 | is_flush`.
/// Foreground tokens (block addresses, indices, `run_sync`'s `u64::MAX`) never have them.
pub(crate) const BACKGROUND: u64 = 0xB10C << 48;
pub(crate) const TAG_MASK: u64 = 0xFFFF << 48;

fn is_background(token: u64) -> bool {
    token & TAG_MASK == BACKGROUND
}

/// The top 16 bits of an asynchronous data read's token ([`crate::reads`]); the rest is the
/// read's own number. Their completions go to [`DeviceMux::poll_reads`] only, so no
/// synchronous path ever meets one.
pub(crate) const READ: u64 = 0xAEAD << 48;

pub(crate) fn is_read(token: u64) -> bool {
    token & TAG_MASK == READ
}

/// Time spent waiting for the device inside an operation: every synchronous wait of the
/// engine's after mount (a metadata read that missed the cache, a drain before a flush, room
/// in a full queue; mount's own reads, before anyone is served, are not counted). An
/// asynchronous engine keeps these at zero on its hot paths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceWaitStats {
    pub waits: u64,
    pub wait_ns_total: u64,
    pub wait_ns_max: u64,
    /// Device reads a lent engine made beside the queue ([`Lent::Reads`]), and the blocks
    /// it took from the background writes in flight instead.
    pub lent_reads: u64,
    pub lent_reads_from_writes: u64,
    /// Background write runs a lent engine made beside the queue ([`Lent::Writes`]).
    pub lent_writes: u64,
    /// Background writes the device made from the staged bytes themselves
    /// ([`nvme::IoOp::WriteShared`]), and those copied into a DMA buffer first (the device
    /// takes no shared writes, or a piece is not aligned: a tree node, an edge block, a
    /// write at an offset that is not a multiple of the LBA size).
    pub shared_writes: u64,
    pub copied_writes: u64,
    pub shared_write_bytes: u64,
    pub copied_write_bytes: u64,
}

/// The engine's device with background requests kept apart (see the module comment).
pub struct DeviceMux {
    inner: Box<dyn BlockDevice>,
    background: Vec<IoCompletion>,
    background_in_flight: u32,
    /// The bytes of every background write queued or in flight, by first block: (blocks,
    /// ticket token, the run's pieces). A foreground read of them is answered from here;
    /// the backlog copies from here into DMA buffers as room frees.
    writing: std::collections::BTreeMap<u64, (u64, u64, Vec<bytes::Bytes>)>,
    /// Background writes not yet completed, per ticket token (its blocks leave `writing`
    /// when the count reaches 0).
    writes_outstanding: std::collections::HashMap<u64, (u32, Vec<u64>)>,
    /// Foreground reads answered from `writing`, handed out by the next poll or wait.
    answered: Vec<IoCompletion>,
    /// Asynchronous data reads ([`READ`] tokens) submitted and not completed, and the
    /// completed ones (from the device or answered from `writing`) not handed out yet.
    reads_in_flight: u32,
    reads_done: Vec<IoCompletion>,
    /// Asynchronous reads that overlap background writes they cannot be answered from
    /// (part of their blocks only): the tickets they wait for, and the read, started once
    /// those writes complete. Counted in `reads_in_flight`. Bounded by the reads in flight.
    reads_after_writes: VecDeque<(Vec<u64>, Request)>,
    /// Synchronous waits for the device.
    pub(crate) waits: DeviceWaitStats,
    /// Background writes not submitted yet (the queue or the DMA pool was full): (token,
    /// lba, first block, fua), their bytes in `writing`; submitted in order as room frees.
    /// Bounded by what the engine hands over at once (a record, or one commit's blocks).
    backlog: VecDeque<(u64, u64, u64, bool)>,
    scratch: Vec<IoCompletion>,
    /// Block buffers whose contents went to the device, for the next commit's nodes (at most
    /// [`SPARE_BLOCKS_MAX`]). Allocating them afresh each commit cost its pause a page fault
    /// per node: the allocator gives the freed megabytes back to the kernel between commits.
    pub(crate) spare_blocks: Vec<Vec<u8>>,
    /// Lent to a thread that is not the queue's owner ([`Lent`]).
    lent: Lent,
    /// Synchronous I/O beside the queue, from any thread ([`BlockDevice::any_thread_io`]):
    /// what a lent engine that runs a change reads its missed nodes through, and what one
    /// that runs an fsync writes its record through ([`Lent::Writes`]).
    reader: Option<Box<dyn nvme::AnyThreadIo>>,
    /// Callers' writes and flushes beside the queue not yet taken back as completions
    /// ([`DeviceMux::queue_side_write`], [`DeviceMux::take_side_done`]), and where callers
    /// post them.
    side_in_flight: u32,
    side: Arc<SideDone>,
}

/// Whether the engine is lent to a thread that does not own the device's queue, and what that
/// thread may do with the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lent {
    /// The owner runs: anything.
    No,
    /// Nothing at all ([`crate::Filesystem::from_memory`]): every submission, poll and wait
    /// asserts.
    Nothing,
    /// Synchronous reads only, through the any-thread reader, answered from the background
    /// writes in flight where they cover the blocks ([`crate::Filesystem::change_lent`]).
    /// Anything else asserts.
    Reads,
    /// As [`Lent::Reads`], and background writes and flushes queued for the caller to make
    /// beside the queue once it gave the engine back ([`crate::Filesystem::fsync_beside`]).
    /// Lent so only while nothing is in flight: a write there is not ordered against one on
    /// the queue.
    Writes,
}

impl Lent {
    /// Reads go beside the queue.
    fn reads_beside(self) -> bool {
        matches!(self, Lent::Reads | Lent::Writes)
    }
}

/// Background write bytes one [`DeviceMux::pump`] hands to the device. Every copy into a DMA
/// buffer (and, on the memory backend, the write itself) runs on the reactor: a commit
/// chunk or a staged-data write-back of several MiB submitted in one call held the loop for
/// about 1 ms per 2 MiB on the memory backend. The backlog is pumped at least once per
/// loop turn (every poll of the device), so this bounds the work per turn, not throughput.
pub const PUMP_BYTES_MAX: usize = 512 << 10;

/// Spare block buffers kept (16 MiB): a commit's worth at the default dirty limit.
pub const SPARE_BLOCKS_MAX: usize = 4096;

impl DeviceMux {
    pub fn new(inner: Box<dyn BlockDevice>) -> DeviceMux {
        let reader = inner.any_thread_io();
        DeviceMux {
            inner,
            background: Vec::new(),
            background_in_flight: 0,
            writing: Default::default(),
            writes_outstanding: Default::default(),
            answered: Vec::new(),
            reads_in_flight: 0,
            reads_done: Vec::new(),
            reads_after_writes: VecDeque::new(),
            waits: DeviceWaitStats::default(),
            backlog: VecDeque::new(),
            scratch: Vec::new(),
            spare_blocks: Vec::new(),
            lent: Lent::No,
            reader,
            side_in_flight: 0,
            side: Arc::default(),
        }
    }

    /// Lends the engine to (or takes it back from, with [`Lent::No`]) a thread that does
    /// not own the device's queue.
    pub(crate) fn lend(&mut self, lent: Lent) {
        assert!(
            !lent.reads_beside() || self.reader.is_some(),
            "reads while lent need an any-thread handle"
        );
        assert!(
            lent != Lent::Writes || (self.writes_beside_queue() && self.idle()),
            "writes while lent need an any-thread handle that writes, and an idle queue"
        );
        self.lent = lent;
    }

    /// True when a lent engine can read beside the queue ([`Lent::Reads`]).
    pub(crate) fn reads_beside_queue(&self) -> bool {
        self.reader.is_some()
    }

    /// True when a lent engine can write and flush beside the queue ([`Lent::Writes`]).
    pub(crate) fn writes_beside_queue(&self) -> bool {
        self.reader.as_ref().is_some_and(|r| r.writes())
    }

    /// True when lent for writes beside the queue ([`Lent::Writes`]).
    pub(crate) fn lent_for_writes(&self) -> bool {
        self.lent == Lent::Writes
    }

    /// Nothing is in flight, queued or waiting to be handed out: no background write or
    /// flush, no asynchronous read, no synchronous request. What [`Lent::Writes`] needs.
    pub(crate) fn idle(&self) -> bool {
        self.queue_idle() && self.side_in_flight == 0
    }

    /// Nothing of the queue's own is outstanding: no background request in flight, queued or
    /// completed and not yet counted, no read, no synchronous request (callers' writes beside
    /// the queue may be).
    pub(crate) fn queue_idle(&self) -> bool {
        self.background_in_flight == 0
            && self.backlog.is_empty()
            && self.background.is_empty()
            && self.reads_in_flight == 0
            && self.reads_done.is_empty()
            && self.answered.is_empty()
            && self.inner.in_flight() == 0
    }

    /// The contract of [`DeviceMux::lend`]: a device request made by a thread that does not
    /// own the device's queue would fail (an io_uring ring admits one submitter) or race.
    fn assert_owner(&self) {
        assert!(
            self.lent == Lent::No,
            "the device's queue was reached by a thread the engine was lent to ({:?})",
            self.lent
        );
    }

    /// A synchronous read made by a lent engine ([`Lent::Reads`]): answered from the
    /// background writes in flight when they hold its blocks (the device may not have them
    /// yet), else read beside the queue; its completion waits in `answered` for the next poll.
    fn submit_lent(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        assert!(
            self.lent.reads_beside(),
            "the device's queue was reached by a thread running from memory alone"
        );
        let Request { token, op } = request;
        let IoOp::Read { lba, mut buf } = op else {
            panic!("a lent engine may only read: {:?}", op.kind());
        };
        // A lent engine's synchronous reads are tree nodes: whole blocks, read as the data
        // reads beside the queue are (blocks a background write holds come from it).
        let byte = lba * self.inner.info().lba_size_bytes as u64;
        let block_bytes = crate::format::BLOCK_BYTES as u64;
        assert!(
            byte % block_bytes == 0 && buf.as_slice().len() as u64 % block_bytes == 0,
            "a lent engine reads whole blocks"
        );
        let result = self.read_blocks_beside(byte / block_bytes, buf.as_mut_slice());
        self.answered.push(IoCompletion {
            token,
            kind: nvme::OpKind::Read,
            result,
            buf: Some(buf),
        });
        Ok(())
    }

    /// Reads data blocks `first..first + dst.len() / BLOCK_BYTES` synchronously beside the
    /// queue, for a lent engine ([`Lent::Reads`]) reading file data in its caller's thread
    /// ([`crate::Filesystem::read_lent`]): each block a background write in flight holds is
    /// copied from it (the device may not have it yet); the runs between are read through
    /// the any-thread reader, at most the device's largest transfer at a time.
    pub(crate) fn read_blocks_beside(
        &mut self,
        first: u64,
        dst: &mut [u8],
    ) -> std::result::Result<(), DevError> {
        const BLOCK: usize = crate::format::BLOCK_BYTES;
        assert!(
            self.lent.reads_beside(),
            "only a lent engine reads beside the queue"
        );
        assert!(
            !dst.is_empty() && dst.len() % BLOCK == 0,
            "whole blocks beside the queue"
        );
        let count = dst.len() / BLOCK;
        let max_blocks = (self.inner.info().max_io_bytes as usize / BLOCK).max(1);
        let mut at = 0;
        while at < count {
            let block = first + at as u64;
            if let Some(bytes) = self.writing_block(block) {
                dst[at * BLOCK..(at + 1) * BLOCK].copy_from_slice(bytes);
                self.waits.lent_reads_from_writes += 1;
                at += 1;
                continue;
            }
            // A run of blocks no background write holds.
            let mut end = at + 1;
            while end < count
                && end - at < max_blocks
                && self.writing_block(first + end as u64).is_none()
            {
                end += 1;
            }
            let lba = block * (BLOCK as u64 / self.inner.info().lba_size_bytes as u64);
            let reader = self.reader.as_mut().expect("checked when lent");
            reader.read_at(lba, &mut dst[at * BLOCK..end * BLOCK])?;
            self.waits.lent_reads += 1;
            at = end;
        }
        Ok(())
    }

    /// True while background writes or flushes are in flight on the queue or queued for it,
    /// or completed and not yet handed to the pipeline ([`DeviceMux::poll_background`]).
    /// Callers' writes beside the queue do not count: they are not the queue owner's to wait
    /// on (they post their completions, and ring it if it asked).
    pub(crate) fn queue_busy(&self) -> bool {
        self.background_in_flight > 0 || !self.backlog.is_empty() || !self.background.is_empty()
    }

    /// Drops the background writes not yet submitted: the filesystem failed stop, and nothing
    /// more goes to the device (what is in flight still completes).
    pub(crate) fn drop_backlog(&mut self) {
        self.backlog.clear();
    }

    /// The device itself. Requests still in flight stay in flight (what a crash leaves).
    pub fn into_inner(self) -> Box<dyn BlockDevice> {
        self.inner
    }

    /// Moves completions from the device, keeping background ones aside.
    fn route(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        let mut foreground = 0;
        let mut scratch = std::mem::take(&mut self.scratch);
        for mut c in scratch.drain(..) {
            if is_background(c.token) {
                self.background_in_flight -= 1;
                if c.token & 1 == 0 {
                    self.write_done(c.token);
                }
                // Only the token and result matter from here: the buffer goes back to the
                // pool now, for the backlog. Kept until the pipeline looked at the completion,
                // a commit larger than the pool left a synchronous read draining the backlog
                // with every buffer held by finished writes: PoolExhausted, fail-stop.
                c.buf = None;
                self.background.push(c);
            } else if is_read(c.token) {
                self.reads_in_flight -= 1;
                self.reads_done.push(c);
            } else {
                out.push(c);
                foreground += 1;
            }
        }
        self.scratch = scratch;
        self.start_reads_after_writes();
        foreground
    }

    /// Starts the reads that waited for background writes now completed; a full queue keeps
    /// them for the next completion. A read the device refuses otherwise completes with the
    /// error.
    fn start_reads_after_writes(&mut self) {
        let mut left = self.reads_after_writes.len();
        while left > 0 {
            left -= 1;
            let (tokens, request) = self.reads_after_writes.pop_front().expect("counted above");
            if tokens
                .iter()
                .any(|t| self.writes_outstanding.contains_key(t))
            {
                self.reads_after_writes.push_back((tokens, request));
                continue;
            }
            self.assert_owner();
            match self.inner.submit(request) {
                Ok(()) => {}
                Err(Rejected {
                    request,
                    reason: DevError::QueueFull,
                }) => {
                    self.reads_after_writes.push_front((Vec::new(), request));
                    return;
                }
                Err(Rejected { request, reason }) => {
                    self.reads_in_flight -= 1;
                    let buf = match request.op {
                        IoOp::Read { buf, .. } => Some(buf),
                        _ => None,
                    };
                    self.reads_done.push(IoCompletion {
                        token: request.token,
                        kind: nvme::OpKind::Read,
                        result: Err(reason),
                        buf,
                    });
                }
            }
        }
    }

    /// One write of `token`'s ticket completed: when it was the last, its bytes leave
    /// [`DeviceMux::writing`] (their block buffers go to the spares).
    fn write_done(&mut self, token: u64) {
        let Some((left, _)) = self.writes_outstanding.get_mut(&token) else {
            return;
        };
        *left -= 1;
        if *left > 0 {
            return;
        }
        let (_, blocks) = self
            .writes_outstanding
            .remove(&token)
            .expect("looked up above");
        for first in blocks {
            if let Some((_, _, pieces)) = self.writing.remove(&first) {
                for piece in pieces {
                    if piece.len() != crate::format::BLOCK_BYTES
                        || self.spare_blocks.len() >= SPARE_BLOCKS_MAX
                    {
                        continue;
                    }
                    // A block nobody else holds and whose allocation is that block alone (a
                    // tree node's) is reused. The last slice of a staged write may be the
                    // only holder of the write's whole allocation: kept, it would pin
                    // that much memory as a 4 KiB spare.
                    if let Ok(block) = piece.try_into_mut() {
                        let block: Vec<u8> = block.into();
                        if block.capacity() == crate::format::BLOCK_BYTES {
                            self.spare_blocks.push(block);
                        }
                    }
                }
            }
        }
    }

    /// The bytes of filesystem block `block` if a background write of it is queued or in
    /// flight.
    pub(crate) fn writing_block(&self, block: u64) -> Option<&[u8]> {
        let (&first, (count, _, pieces)) = self.writing.range(..=block).next_back()?;
        if block >= first + count {
            return None;
        }
        let mut at = ((block - first) as usize) * crate::format::BLOCK_BYTES;
        for piece in pieces {
            if at < piece.len() {
                return Some(&piece[at..at + crate::format::BLOCK_BYTES]);
            }
            at -= piece.len();
        }
        unreachable!("a run's pieces hold its blocks")
    }

    /// Tickets of the background writes (queued or in flight) overlapping blocks
    /// `first..first + count`. Runs never overlap each other, and none is longer than the
    /// largest I/O or shared write, so the runs starting within that much before `first`
    /// are all there is to look at.
    fn overlapping_writes(&self, first: u64, count: u64) -> Vec<u64> {
        let end = first + count;
        let info = self.inner.info();
        let reach = (info.max_io_bytes.max(info.shared_write_bytes_max) as u64
            / crate::format::BLOCK_BYTES as u64)
            .max(1);
        let mut tokens: Vec<u64> = self
            .writing
            .range(first.saturating_sub(reach)..end)
            .filter(|(&start, (n, _, _))| start + n > first)
            .map(|(_, (_, token, _))| *token)
            .collect();
        tokens.sort_unstable();
        tokens.dedup();
        tokens
    }

    /// A synchronous wait for the device, counted in [`DeviceMux::waits`].
    fn wait_inner(&mut self, timeout: Duration) -> std::result::Result<usize, DevError> {
        let started = Instant::now();
        self.assert_owner();
        let result = self.inner.wait(&mut self.scratch, timeout);
        let ns = started.elapsed().as_nanos() as u64;
        self.waits.waits += 1;
        self.waits.wait_ns_total += ns;
        self.waits.wait_ns_max = self.waits.wait_ns_max.max(ns);
        result
    }

    /// Waits until every background write is submitted and no background request is in
    /// flight (their completions are kept).
    fn drain_background(&mut self) -> std::result::Result<(), DevError> {
        let mut foreground = Vec::new();
        let result = loop {
            if let Err(e) = self.pump() {
                break Err(e);
            }
            self.take_side_done();
            if self.background_in_flight == 0 {
                if self.side_in_flight > 0 {
                    // A foreground flush covers callers' writes beside the queue too.
                    self.wait_side(Duration::from_millis(100));
                    continue;
                }
                if self.backlog.is_empty() {
                    break Ok(());
                }
                // Nothing in flight to free a buffer or a slot, and still not submitted.
                break Err(DevError::PoolExhausted);
            }
            if let Err(e) = self.wait_inner(Duration::from_millis(100)) {
                break Err(e);
            }
            self.route(&mut foreground);
        };
        self.answered.append(&mut foreground);
        result
    }

    /// Submits a foreground request; when background I/O fills the queue, waits for some of
    /// it to complete first (its completions are kept for the pipeline).
    fn submit_foreground(&mut self, mut request: Request) -> std::result::Result<(), Rejected> {
        loop {
            self.assert_owner();
            match self.inner.submit(request) {
                Err(Rejected {
                    request: back,
                    reason: DevError::QueueFull,
                }) if self.background_in_flight + self.reads_in_flight > 0 => {
                    request = back;
                    let mut foreground = Vec::new();
                    let waited = self.wait_inner(Duration::from_millis(100));
                    self.route(&mut foreground);
                    self.answered.append(&mut foreground);
                    if let Err(reason) = waited {
                        return Err(Rejected { request, reason });
                    }
                }
                other => return other,
            }
        }
    }

    /// Waits until the background writes of tickets `tokens` have all completed (their
    /// completions are kept for the pipeline).
    fn wait_for_writes(&mut self, tokens: &[u64]) -> std::result::Result<(), DevError> {
        // Foreground requests submitted before this one may complete meanwhile: their
        // completions wait in `answered` for their caller's next poll.
        let mut foreground = Vec::new();
        while tokens
            .iter()
            .any(|t| self.writes_outstanding.contains_key(t))
        {
            self.pump()?;
            if self.background_in_flight == 0 {
                return Err(DevError::PoolExhausted);
            }
            self.wait_inner(Duration::from_millis(100))?;
            self.route(&mut foreground);
        }
        self.answered.append(&mut foreground);
        Ok(())
    }

    /// Submits a foreground or asynchronous-read request in block order with the background
    /// writes: a read of blocks being written is answered with their bytes, a request
    /// overlapping one waits for it, anything else goes to the device at once.
    fn submit_ordered(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        let lba_bytes = self.inner.info().lba_size_bytes as u64;
        let block_bytes = crate::format::BLOCK_BYTES as u64;
        let range = request
            .op
            .lba_range(lba_bytes as u32)
            .map(|(lba, lbas)| (lba * lba_bytes, lbas * lba_bytes));
        let Some((byte, bytes)) = range else {
            // A flush covers every write completed before it: the background ones too.
            if let Err(reason) = self.drain_background() {
                return Err(Rejected { request, reason });
            }
            self.assert_owner();
            return self.inner.submit(request);
        };
        let (first, end) = (byte / block_bytes, (byte + bytes).div_ceil(block_bytes));
        let overlapping = self.overlapping_writes(first, end - first);
        if overlapping.is_empty() {
            return self.submit_to_device(request);
        }
        let Request { token, op } = request;
        match op {
            // A read of blocks being written is answered with their bytes.
            IoOp::Read { lba, mut buf }
                if byte % block_bytes == 0
                    && bytes % block_bytes == 0
                    && (first..end).all(|b| self.writing_block(b).is_some()) =>
            {
                let dst = buf.as_mut_slice();
                for (i, b) in (first..end).enumerate() {
                    let at = i * crate::format::BLOCK_BYTES;
                    dst[at..at + crate::format::BLOCK_BYTES]
                        .copy_from_slice(self.writing_block(b).expect("checked"));
                }
                let _ = lba;
                let completion = IoCompletion {
                    token,
                    kind: nvme::OpKind::Read,
                    result: Ok(()),
                    buf: Some(buf),
                };
                if is_read(token) {
                    self.reads_done.push(completion);
                } else {
                    self.answered.push(completion);
                }
                Ok(())
            }
            // An asynchronous read of blocks some of which a background write holds waits
            // for that write without holding anyone: it starts once the write completes.
            IoOp::Read { lba, buf } if is_read(token) => {
                self.reads_in_flight += 1;
                self.reads_after_writes.push_back((
                    overlapping,
                    Request {
                        token,
                        op: IoOp::Read { lba, buf },
                    },
                ));
                Ok(())
            }
            op => {
                // Part of a synchronous read, or a write, over blocks a background write
                // still holds: that write goes first (never expected for writes: the
                // allocator does not reuse a block with a write pending).
                debug_assert!(
                    matches!(op, IoOp::Read { .. }),
                    "a foreground write overlaps a background write in flight"
                );
                let request = Request { token, op };
                if let Err(reason) = self.wait_for_writes(&overlapping) {
                    return Err(Rejected { request, reason });
                }
                self.submit_to_device(request)
            }
        }
    }

    /// Hands a request to the device: a synchronous one waits for room when background I/O
    /// fills the queue; an asynchronous read is handed back instead (its owner retries once
    /// completions free room).
    fn submit_to_device(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        if !is_read(request.token) {
            return self.submit_foreground(request);
        }
        self.assert_owner();
        self.inner.submit(request)?;
        self.reads_in_flight += 1;
        Ok(())
    }

    /// Submits an asynchronous data read ([`READ`] token); its completion comes from
    /// [`DeviceMux::poll_reads`].
    pub(crate) fn submit_read(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        assert!(
            is_read(request.token),
            "an asynchronous read carries the read tag"
        );
        self.submit_ordered(request)
    }

    /// Hands what is queued for the device to it now, without waiting (and takes what has
    /// completed meanwhile, routed as [`DeviceMux::poll_reads`] routes it). A queue's
    /// submissions otherwise go at its next poll or wait.
    pub(crate) fn submit_now(&mut self) -> std::result::Result<(), DevError> {
        let mut foreground = Vec::new();
        self.assert_owner();
        self.inner.poll(&mut self.scratch)?;
        self.route(&mut foreground);
        self.answered.append(&mut foreground);
        Ok(())
    }

    /// Asynchronous reads submitted and not completed.
    pub(crate) fn reads_in_flight(&self) -> u32 {
        self.reads_in_flight
    }

    /// Completed asynchronous reads; with `wait`, sleeps up to that long for one when none
    /// is ready. Background completions met are kept for the pipeline, synchronous ones for
    /// their caller.
    pub(crate) fn poll_reads(
        &mut self,
        wait: Option<Duration>,
    ) -> std::result::Result<Vec<IoCompletion>, DevError> {
        let mut foreground = Vec::new();
        self.pump()?;
        if self.reads_done.is_empty() && (self.reads_in_flight > 0 || self.background_in_flight > 0)
        {
            self.assert_owner();
            self.inner.poll(&mut self.scratch)?;
            self.route(&mut foreground);
            if let (Some(timeout), true) = (wait, self.reads_done.is_empty()) {
                if self.reads_in_flight > 0 {
                    self.assert_owner();
                    self.inner.wait(&mut self.scratch, timeout)?;
                    self.route(&mut foreground);
                }
            }
        }
        self.answered.append(&mut foreground);
        Ok(std::mem::take(&mut self.reads_done))
    }

    /// Queues a background write of `data` at `lba`; [`DeviceMux::pump`] submits it.
    pub(crate) fn queue_background_write(
        &mut self,
        token: u64,
        lba: u64,
        run: Run,
        fua: bool,
    ) -> std::result::Result<(), DevError> {
        assert!(is_background(token));
        let entry = self.writes_outstanding.entry(token).or_default();
        entry.0 += 1;
        entry.1.push(run.addr);
        let (addr, blocks) = (
            run.addr,
            (run.len_bytes() / crate::format::BLOCK_BYTES) as u64,
        );
        let overlap = self.overlapping_writes(addr, blocks);
        assert!(
            overlap.is_empty(),
            "a background write of blocks {addr}+{blocks} overlaps writes in flight \
             {overlap:?}: the allocator reused a block with a write pending"
        );
        let previous = self
            .writing
            .insert(addr, (blocks, token, run.into_pieces()));
        assert!(
            previous.is_none(),
            "two background writes of block {addr} at once"
        );
        self.backlog.push_back((token, lba, addr, fua));
        Ok(())
    }

    /// Submits queued background writes while the queue and the DMA pool have room, leaving
    /// a quarter of each to foreground I/O: a read that runs beside a commit's writes finds a
    /// buffer and a slot instead of waiting for them. A write whose pieces the device can
    /// write from where they are (aligned staged data, [`nvme::shared`]) goes as a shared
    /// write, without a buffer or a copy; the rest is copied into a DMA buffer. At most
    /// [`PUMP_BYTES_MAX`] per call (and at least one write when there is room), so the copies
    /// of a commit's megabytes spread over the reactor's loop turns instead of filling one.
    pub(crate) fn pump(&mut self) -> std::result::Result<(), DevError> {
        let pool_keep = self.inner.pool().buf_count() as usize / 4;
        let slots = self.inner.info().queue_depth;
        let slots_keep = slots / 4;
        let mut pumped_bytes = 0usize;
        while let Some((token, lba, addr, fua)) = self.backlog.pop_front() {
            let (blocks, _, pieces) = &self.writing[&addr];
            let shared = nvme::SharedWrite::fits(pieces, self.inner.info());
            if (!shared && self.inner.pool().free_count() <= pool_keep)
                || self.background_in_flight >= slots - slots_keep
                || pumped_bytes >= PUMP_BYTES_MAX
            {
                self.backlog.push_front((token, lba, addr, fua));
                return Ok(());
            }
            let len = *blocks as usize * crate::format::BLOCK_BYTES;
            let op = if shared {
                let data = nvme::SharedWrite::new(pieces.clone());
                assert_eq!(data.len(), len, "a run's pieces are its blocks");
                self.waits.shared_writes += 1;
                self.waits.shared_write_bytes += len as u64;
                IoOp::WriteShared { lba, data, fua }
            } else {
                assert!(
                    len <= self.inner.info().max_io_bytes as usize,
                    "a run longer than the largest I/O is made a shared write only"
                );
                let Some(mut buf) = self.inner.pool().alloc(len) else {
                    self.backlog.push_front((token, lba, addr, fua));
                    return Ok(());
                };
                let dst = buf.as_mut_slice();
                let mut at = 0;
                for piece in pieces {
                    dst[at..at + piece.len()].copy_from_slice(piece);
                    at += piece.len();
                }
                assert_eq!(at, len, "a run's pieces fill its buffer");
                self.waits.copied_writes += 1;
                self.waits.copied_write_bytes += len as u64;
                IoOp::Write { lba, buf, fua }
            };
            let request = Request { token, op };
            self.assert_owner();
            match self.inner.submit(request) {
                Ok(()) => {
                    self.background_in_flight += 1;
                    pumped_bytes += len;
                }
                Err(Rejected {
                    reason: DevError::QueueFull,
                    ..
                }) => {
                    self.backlog.push_front((token, lba, addr, fua));
                    return Ok(());
                }
                Err(rejected) => return Err(rejected.reason),
            }
        }
        Ok(())
    }

    /// Submits a background request; a full queue hands it back.
    pub(crate) fn submit_background(
        &mut self,
        request: Request,
    ) -> std::result::Result<(), Rejected> {
        assert!(is_background(request.token));
        self.assert_owner();
        self.inner.submit(request)?;
        self.background_in_flight += 1;
        Ok(())
    }

    /// Collects background completions; with `wait`, sleeps up to `timeout` for one when some
    /// are in flight and none is ready.
    pub(crate) fn poll_background(
        &mut self,
        wait: Option<Duration>,
    ) -> std::result::Result<Vec<IoCompletion>, DevError> {
        // Foreground completions met here wait in `answered` for their caller's next poll.
        let mut foreground = Vec::new();
        self.take_side_done();
        self.pump()?;
        if self.background_in_flight == 0 && self.side_in_flight > 0 {
            if let Some(timeout) = wait {
                self.wait_side(timeout);
            }
        } else if self.background_in_flight > 0 {
            self.assert_owner();
            self.inner.poll(&mut self.scratch)?;
            self.route(&mut foreground);
            if let Some(timeout) = wait {
                if self.background.is_empty() {
                    self.assert_owner();
                    self.inner.wait(&mut self.scratch, timeout)?;
                    self.route(&mut foreground);
                }
            }
            self.pump()?;
        } else if !self.backlog.is_empty() {
            return Err(DevError::PoolExhausted);
        }
        self.take_side_done();
        self.answered.append(&mut foreground);
        Ok(std::mem::take(&mut self.background))
    }
}

impl BlockDevice for DeviceMux {
    fn new_queue(&self) -> Option<std::result::Result<Box<dyn BlockDevice>, DevError>> {
        self.inner.new_queue()
    }
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }

    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        assert!(
            !is_background(request.token) && !is_read(request.token),
            "foreground tokens must not carry the background or read tag"
        );
        if self.lent != Lent::No {
            return self.submit_lent(request);
        }
        self.submit_ordered(request)
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> std::result::Result<usize, DevError> {
        let answered = self.answered.len();
        out.append(&mut self.answered);
        if self.lent.reads_beside() {
            // A lent engine's reads are answered at submit; the queue is not its to poll.
            return Ok(answered);
        }
        self.assert_owner();
        self.inner.poll(&mut self.scratch)?;
        Ok(answered + self.route(out))
    }

    fn wait(
        &mut self,
        out: &mut Vec<IoCompletion>,
        timeout: Duration,
    ) -> std::result::Result<usize, DevError> {
        if !self.answered.is_empty() || self.lent.reads_beside() {
            return self.poll(out);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            self.wait_inner(deadline.saturating_duration_since(now))?;
            let found = self.route(out);
            if found > 0 || Instant::now() >= deadline || self.in_flight() == 0 {
                return Ok(found);
            }
        }
    }

    fn in_flight(&self) -> u32 {
        if self.lent.reads_beside() {
            return self.answered.len() as u32;
        }
        self.inner.in_flight() - self.background_in_flight - self.reads_in_flight
            + self.answered.len() as u32
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        self.inner.signal_completions_to(eventfd)
    }

    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, nvme::DevError> {
        self.inner.run_blocking_work_on(cores)
    }

    #[cfg(feature = "sim")]
    fn sim_access(&mut self) -> Option<&mut dyn nvme::SimAccess> {
        self.inner.sim_access()
    }
}

mod side;
#[cfg(test)]
mod tests;

pub use side::SideDone;
pub(crate) use side::SideIo;
