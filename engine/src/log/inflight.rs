//! fsync records in flight: the log's writes and flushes run in the background while the
//! engine goes on serving other operations, and fsync waiters are released in record order as
//! each record becomes durable.
//!
//! The engine has one device queue. [`DeviceMux`] sits in front of it and splits it in two:
//! *background* requests (a record's writes and its flush, tagged in the token) whose
//! completions are kept for [`Filesystem::log_progress`], and the engine's ordinary
//! synchronous I/O, which never sees a background completion.
//!
//! # Invariants
//! - Ordering is by block, not by a global drain: a background write's bytes stay in memory
//!   ([`DeviceMux::writing`]) from when it is queued until the device completes it, and a
//!   foreground read of those blocks is answered from them, never from the device; a
//!   foreground read or write of other blocks goes to the device at once, beside the
//!   background I/O. A foreground write never overlaps a background write in flight (the
//!   allocator never reuses a block a pending write targets: data frees are pinned until a
//!   commit, and a commit drains), checked; a foreground flush still waits for every
//!   background write (it must cover them). A commit drains the records explicitly.
//! - A record's flush is submitted only after all of its writes completed, and those of every
//!   write-back started before it, so the flush covers them (a write-back has no flush of its
//!   own: its data is durable at the next one, which a record or commit referencing it waits
//!   for). Records become durable in the order they were started: ticket N is reported durable
//!   only once every ticket before it is, because a later record's flush may finish first and
//!   replay stops at the first missing record anyway.
//! - Bounded: at most [`MAX_IN_FLIGHT`] records have device work outstanding (writes or
//!   flush); starting another first waits for the device. A record written while a commit is
//!   in flight then waits for that commit's superblock without holding anything of the device:
//!   those are bounded by the log area (each takes at least one of its blocks), and waiting
//!   for one here would wait for a commit only the caller can carry on — a hang.
//!
//! Fault model: a failed background write or flush makes the filesystem fail-stop (sticky
//! error); every ticket not yet durable then fails with it. Nothing is retried.

use crate::commit::Run;
use crate::error::{EngineError, Result};
use crate::fs::{block_lba, Filesystem};
use nvme::{BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, Rejected, Request};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The top 16 bits of a background request's token; the rest is `ticket << 1 | is_flush`.
/// Foreground tokens (block addresses, indices, `run_sync`'s `u64::MAX`) never have them.
const BACKGROUND: u64 = 0xB10C << 48;
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceWaitStats {
    pub waits: u64,
    pub wait_ns_total: u64,
    pub wait_ns_max: u64,
    /// Reads a lent engine made beside the queue ([`Lent::Reads`]), and those answered from
    /// the background writes in flight.
    pub lent_reads: u64,
    pub lent_reads_from_writes: u64,
}

/// Records in flight at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// The engine's device with background requests kept apart (see the module comment).
pub struct DeviceMux {
    inner: Box<dyn BlockDevice>,
    background: Vec<IoCompletion>,
    background_in_flight: u32,
    /// The bytes of every background write queued or in flight, by first block: (blocks,
    /// ticket token, the run's pieces). A foreground read of them is answered from here;
    /// the backlog copies from here into DMA buffers as room frees.
    writing: std::collections::BTreeMap<u64, (u64, u64, Vec<Vec<u8>>)>,
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
    /// Synchronous reads beside the queue, from any thread ([`BlockDevice::any_thread_reader`]):
    /// what a lent engine that runs a change reads its missed nodes through.
    reader: Option<Box<dyn nvme::AnyThreadReader>>,
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
        let reader = inner.any_thread_reader();
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
        }
    }

    /// Lends the engine to (or takes it back from, with [`Lent::No`]) a thread that does
    /// not own the device's queue.
    pub(crate) fn lend(&mut self, lent: Lent) {
        assert!(
            lent != Lent::Reads || self.reader.is_some(),
            "reads while lent need an any-thread reader"
        );
        self.lent = lent;
    }

    /// True when a lent engine can read beside the queue ([`Lent::Reads`]).
    pub(crate) fn reads_beside_queue(&self) -> bool {
        self.reader.is_some()
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
        assert_eq!(
            self.lent,
            Lent::Reads,
            "the device's queue was reached by a thread running from memory alone"
        );
        let Request { token, op } = request;
        let IoOp::Read { lba, mut buf } = op else {
            panic!("a lent engine may only read: {:?}", op.kind());
        };
        let lba_bytes = self.inner.info().lba_size_bytes as u64;
        let block_bytes = crate::format::BLOCK_BYTES as u64;
        let (byte, bytes) = (lba * lba_bytes, buf.as_slice().len() as u64);
        let (first, end) = (byte / block_bytes, (byte + bytes).div_ceil(block_bytes));
        self.waits.lent_reads += 1;
        let result = if self.overlapping_writes(first, end - first).is_empty() {
            let reader = self.reader.as_mut().expect("checked when lent");
            reader.read_at(lba, buf.as_mut_slice())
        } else {
            self.waits.lent_reads_from_writes += 1;
            // A node is one block: written in the background whole, or not at all.
            assert!(
                byte % block_bytes == 0
                    && bytes % block_bytes == 0
                    && (first..end).all(|b| self.writing_block(b).is_some()),
                "a lent engine read blocks a background write holds only in part"
            );
            let dst = buf.as_mut_slice();
            for (i, b) in (first..end).enumerate() {
                let at = i * crate::format::BLOCK_BYTES;
                dst[at..at + crate::format::BLOCK_BYTES]
                    .copy_from_slice(self.writing_block(b).expect("checked"));
            }
            Ok(())
        };
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
        assert_eq!(
            self.lent,
            Lent::Reads,
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
                    if piece.len() == crate::format::BLOCK_BYTES
                        && self.spare_blocks.len() < SPARE_BLOCKS_MAX
                    {
                        self.spare_blocks.push(piece);
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
    /// largest I/O, so the runs starting within that much before `first` are all there is
    /// to look at.
    fn overlapping_writes(&self, first: u64, count: u64) -> Vec<u64> {
        let end = first + count;
        let reach =
            (self.inner.info().max_io_bytes as u64 / crate::format::BLOCK_BYTES as u64).max(1);
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
            if self.background_in_flight == 0 {
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
        let range = match &request.op {
            IoOp::Read { lba, buf } | IoOp::Write { lba, buf, .. } => {
                Some((lba * lba_bytes, buf.as_slice().len() as u64))
            }
            IoOp::WriteZeroes { lba, lbas } | IoOp::Deallocate { lba, lbas } => {
                Some((lba * lba_bytes, *lbas as u64 * lba_bytes))
            }
            IoOp::Flush => None,
        };
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
    fn queue_background_write(
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
    /// buffer and a slot instead of waiting for them. At most [`PUMP_BYTES_MAX`] per call
    /// (and at least one write when there is room), so the copies into DMA buffers of a
    /// commit's megabytes spread over the reactor's loop turns instead of filling one.
    fn pump(&mut self) -> std::result::Result<(), DevError> {
        let pool_keep = self.inner.pool().buf_count() as usize / 4;
        let slots = self.inner.info().queue_depth;
        let slots_keep = slots / 4;
        let mut pumped_bytes = 0usize;
        while let Some((token, lba, addr, fua)) = self.backlog.pop_front() {
            if self.inner.pool().free_count() <= pool_keep
                || self.background_in_flight >= slots - slots_keep
                || pumped_bytes >= PUMP_BYTES_MAX
            {
                self.backlog.push_front((token, lba, addr, fua));
                return Ok(());
            }
            let (blocks, _, pieces) = &self.writing[&addr];
            let len = *blocks as usize * crate::format::BLOCK_BYTES;
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
            let request = Request {
                token,
                op: IoOp::Write { lba, buf, fua },
            };
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
    fn submit_background(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        assert!(is_background(request.token));
        self.assert_owner();
        self.inner.submit(request)?;
        self.background_in_flight += 1;
        Ok(())
    }

    /// Collects background completions; with `wait`, sleeps up to `timeout` for one when some
    /// are in flight and none is ready.
    fn poll_background(
        &mut self,
        wait: Option<Duration>,
    ) -> std::result::Result<Vec<IoCompletion>, DevError> {
        // Foreground completions met here wait in `answered` for their caller's next poll.
        let mut foreground = Vec::new();
        self.pump()?;
        if self.background_in_flight > 0 {
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
        if self.lent == Lent::Reads {
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
        if !self.answered.is_empty() || self.lent == Lent::Reads {
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
        if self.lent == Lent::Reads {
            return self.answered.len() as u32;
        }
        self.inner.in_flight() - self.background_in_flight - self.reads_in_flight
            + self.answered.len() as u32
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        self.inner.signal_completions_to(eventfd)
    }

    #[cfg(feature = "sim")]
    fn sim_access(&mut self) -> Option<&mut dyn nvme::SimAccess> {
        self.inner.sim_access()
    }
}

/// One record on its way to the device.
#[derive(Debug)]
struct InFlight {
    ticket: u64,
    /// Write runs not yet completed (the record is being submitted while this is counted up
    /// front, so its flush cannot go early).
    writes_left: u32,
    flush_submitted: bool,
    flushed: bool,
    /// Written with FUA: durable when the writes complete, no flush.
    fua: bool,
    /// Staged file data written back early ([`Filesystem::submit_writeback`]): done when the
    /// writes complete, no flush; these bytes (0 for a record).
    writeback_bytes: usize,
    /// Counts as durable only once this generation is SuperCommitted too.
    after: Option<u64>,
}

/// The log's background I/O state.
#[derive(Debug, Default)]
pub(crate) struct Pipeline {
    in_flight: VecDeque<InFlight>,
    next_ticket: u64,
    /// Every ticket up to this one (exclusive) is durable.
    durable_below: u64,
}

/// What starting an fsync group gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncStart {
    /// Durable already: nothing new to log and nothing in flight, or a commit was made.
    Durable,
    /// Durable once [`Filesystem::log_progress`] reports this ticket.
    Pending(u64),
    /// Durable only after a commit of the whole filesystem, which a partition cannot make on
    /// its own: its owner asks the coordinator ([`crate::partition`]). Nothing was written.
    NeedsCommit,
    /// A commit was in flight: durable once `ticket` (if any: this group's record, or the
    /// newest in flight) is durable *and* generation `generation` is SuperCommitted (the
    /// record belongs to the next generation, which replay takes only after it).
    AfterCommit {
        ticket: Option<u64>,
        generation: u64,
    },
}

impl Filesystem {
    /// Submits `blocks` (a record and, for a large fsync, its data) as background writes
    /// under a new ticket; the flush follows when they complete.
    pub(crate) fn submit_record(&mut self, blocks: Vec<(u64, Vec<u8>)>) -> Result<u64> {
        let after = self.commit_in_flight();
        self.submit_background(blocks, false, after, 0)
    }

    /// Writes staged file data back in the background under a new ticket, done when the
    /// writes complete: no flush of its own, so the data is durable only at the next flush
    /// (`unflushed_writes`), and the next record's flush waits for these writes.
    pub(crate) fn submit_writeback(&mut self, blocks: Vec<(u64, Vec<u8>)>) -> Result<u64> {
        let bytes = crate::writeback::pieces_bytes(&blocks);
        let ticket = self.submit_background(blocks, false, None, bytes)?;
        self.log.unflushed_writes = true;
        Ok(ticket)
    }

    /// Bytes of write-backs whose writes the device has not completed.
    pub(crate) fn writeback_bytes_in_flight(&self) -> usize {
        self.log
            .pipeline
            .in_flight
            .iter()
            .filter(|f| !f.flushed)
            .map(|f| f.writeback_bytes)
            .sum()
    }

    /// A chunk of a commit's serialized blocks: written in the background with no flush of
    /// its own, done when its writes complete; the commit's last chunk is a record whose
    /// flush waits for these writes (as for a write-back) and so covers them.
    pub(crate) fn submit_commit_chunk(&mut self, blocks: Vec<(u64, Vec<u8>)>) -> Result<u64> {
        assert!(!blocks.is_empty(), "a commit chunk has blocks");
        let bytes = crate::writeback::pieces_bytes(&blocks);
        self.submit_background(blocks, false, None, bytes)
    }

    /// As [`Filesystem::submit_record`] with every write FUA and no flush after: durable when
    /// the writes complete (a small record that carries its data).
    pub(crate) fn submit_fua(&mut self, blocks: Vec<(u64, Vec<u8>)>) -> Result<u64> {
        let after = self.commit_in_flight();
        self.submit_background(blocks, true, after, 0)
    }

    /// A commit's own writes (its blocks, then its superblock with FUA): never held back by
    /// the commit in flight, which they are.
    pub(crate) fn submit_commit_io(
        &mut self,
        blocks: Vec<(u64, Vec<u8>)>,
        fua: bool,
    ) -> Result<u64> {
        self.submit_background(blocks, fua, None, 0)
    }

    /// `after`: a record written while the commit of that generation is in flight belongs to
    /// the next one, which replay takes only once that commit is durable — it is reported
    /// durable only then (even when its own writes finished first).
    fn submit_background(
        &mut self,
        blocks: Vec<(u64, Vec<u8>)>,
        fua: bool,
        after: Option<u64>,
        writeback_bytes: usize,
    ) -> Result<u64> {
        if !fua && writeback_bytes == 0 {
            // This batch's flush will cover every write completed before it, in-place data
            // written back in the foreground included; anything released after it is too.
            self.log.unflushed_writes = false;
        }
        while self.records_on_device() >= MAX_IN_FLIGHT {
            self.log_progress(Some(Duration::from_millis(100)))?;
        }
        let runs = crate::commit::coalesce(&*self.dev, blocks);
        let ticket = self.log.pipeline.next_ticket;
        self.log.pipeline.next_ticket += 1;
        self.log.pipeline.in_flight.push_back(InFlight {
            ticket,
            writes_left: runs.len() as u32,
            // FUA writes are durable when they complete, a write-back is done then: no flush.
            flush_submitted: fua || writeback_bytes > 0,
            flushed: false,
            fua,
            writeback_bytes,
            after,
        });
        let token = BACKGROUND | ticket << 1;
        for run in runs {
            let lba = block_lba(&*self.dev, run.addr);
            // What does not fit the queue or the pool now goes as earlier requests complete
            // (log_progress pumps the backlog).
            if let Err(e) = self.dev.queue_background_write(token, lba, run, fua) {
                return self.fail_background(e);
            }
        }
        if let Err(e) = self.dev.pump() {
            return self.fail_background(e);
        }
        Ok(ticket)
    }

    /// A background failure: the filesystem fails stop and every pending ticket fails.
    fn fail_background<T>(&mut self, e: DevError) -> Result<T> {
        self.failed.get_or_insert(EngineError::Device(e.clone()));
        Err(EngineError::Device(e))
    }

    /// Advances the records in flight: counts finished writes, submits each record's flush
    /// once its writes are done, and returns the ticket below which every record is durable.
    /// `wait` sleeps up to that long for a completion when nothing is ready. Fails with the
    /// filesystem's sticky error once a background request failed.
    pub fn log_progress(&mut self, wait: Option<Duration>) -> Result<u64> {
        if let Some(e) = self.failed.clone() {
            if !self.log.pipeline.in_flight.is_empty() {
                // Fail-stopped: nothing more goes to the device, and what is in flight still
                // completes (its completions dropped here), so the device drains and a reactor
                // waiting for it to go idle can stop.
                self.dev.backlog.clear();
                let _ = self.dev.poll_background(wait);
                return Err(e);
            }
        }
        let completions = match self.dev.poll_background(wait) {
            Ok(c) => c,
            Err(e) => return self.fail_background(e),
        };
        for c in completions {
            let ticket = (c.token & !TAG_MASK) >> 1;
            let is_flush = c.token & 1 != 0;
            if let Err(e) = c.result {
                return self.fail_background(e);
            }
            let Some(entry) = self
                .log
                .pipeline
                .in_flight
                .iter_mut()
                .find(|f| f.ticket == ticket)
            else {
                // Mutation check: the record went at its flush's submission.
                assert!(
                    mutated!(AckAtFlushSubmit) && is_flush,
                    "a completion belongs to a record in flight"
                );
                continue;
            };
            if is_flush {
                entry.flushed = true;
            } else {
                entry.writes_left -= 1;
            }
        }
        // FUA-only entries are durable once their writes are; a write-back is done then.
        for entry in self.log.pipeline.in_flight.iter_mut() {
            if entry.flush_submitted
                && !entry.flushed
                && entry.writes_left == 0
                && (entry.fua || entry.writeback_bytes > 0)
            {
                entry.flushed = true;
            }
        }
        // Each record whose writes are all done gets its flush (a full queue: next time), once
        // no write-back started before it has writes outstanding: the flush must cover the
        // data the record may reference.
        let mut writeback_ahead = false;
        for i in 0..self.log.pipeline.in_flight.len() {
            let entry = &self.log.pipeline.in_flight[i];
            let held = writeback_ahead;
            writeback_ahead |= entry.writeback_bytes > 0 && entry.writes_left > 0;
            if entry.writes_left > 0 || entry.flush_submitted || held {
                continue;
            }
            let request = Request {
                token: BACKGROUND | entry.ticket << 1 | 1,
                op: IoOp::Flush,
            };
            match self.dev.submit_background(request) {
                Ok(()) => {
                    let entry = &mut self.log.pipeline.in_flight[i];
                    entry.flush_submitted = true;
                    // Mutation check: durable before the flush completed.
                    entry.flushed |= mutated!(AckAtFlushSubmit);
                }
                Err(Rejected {
                    reason: DevError::QueueFull,
                    ..
                }) => break,
                Err(rejected) => return self.fail_background(rejected.reason),
            }
        }
        let durable_generation = self.sb.generation;
        let pipeline = &mut self.log.pipeline;
        // Mutation check: release a record logged during commit N before N is durable.
        let early = mutated!(AckBeforeCommit);
        while pipeline.in_flight.front().is_some_and(|f| {
            f.flushed && (early || f.after.is_none_or(|g| durable_generation >= g))
        }) {
            let done = pipeline.in_flight.pop_front().expect("front");
            pipeline.durable_below = done.ticket + 1;
        }
        if pipeline.in_flight.is_empty() {
            pipeline.durable_below = pipeline.next_ticket;
        }
        Ok(pipeline.durable_below)
    }

    /// The ticket below which every record is durable, as the last
    /// [`Filesystem::log_progress`] found it (nothing is polled).
    pub fn log_durable_below(&self) -> u64 {
        self.log.pipeline.durable_below
    }

    /// True when `ticket`'s own writes (and flush) are done, whatever is ahead of it.
    pub(crate) fn ticket_done(&self, ticket: u64) -> bool {
        ticket < self.log.pipeline.durable_below
            || self
                .log
                .pipeline
                .in_flight
                .iter()
                .any(|f| f.ticket == ticket && f.flushed)
    }

    /// True while background writes or flushes are in flight or queued, or completed with
    /// their completions not yet counted by the pipeline ([`Filesystem::log_progress`]): a
    /// synchronous read or a data-read poll routes every completion it meets, so a
    /// write-back may be done on the device and still hold its pipeline entry (and a due
    /// commit behind it) until the pipeline is advanced once more.
    pub fn device_busy(&self) -> bool {
        self.dev.background_in_flight > 0
            || !self.dev.backlog.is_empty()
            || !self.dev.background.is_empty()
    }

    /// Waits until `ticket` is durable.
    pub fn wait_durable(&mut self, ticket: u64) -> Result<()> {
        while self.log_progress(Some(Duration::from_millis(100)))? <= ticket {}
        Ok(())
    }

    /// Waits until no record is in flight (before a commit, and before giving the device
    /// back).
    pub fn drain_log(&mut self) -> Result<()> {
        match self.log.pipeline.in_flight.back() {
            Some(last) => {
                let last = last.ticket;
                self.wait_durable(last)
            }
            None => Ok(()),
        }
    }

    /// The newest ticket started, if any is still in flight.
    pub(crate) fn newest_in_flight(&self) -> Option<u64> {
        self.log.pipeline.in_flight.back().map(|f| f.ticket)
    }

    /// Records whose writes or flush the device has not completed yet.
    fn records_on_device(&self) -> usize {
        self.log
            .pipeline
            .in_flight
            .iter()
            .filter(|f| !f.flushed)
            .count()
    }

    /// Records in flight.
    pub fn log_in_flight(&self) -> usize {
        self.log.pipeline.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    //! The mux's ordering by block, against a device that holds background writes back until
    //! released: nothing here depends on timing.
    use super::*;
    use crate::format::BLOCK_BYTES;
    use nvme::backend::mem::{MemConfig, MemDevice};
    use nvme::OpKind;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Passes everything to a memory device except writes, which it keeps (unsubmitted, so
    /// the device still holds the old bytes) until `released` is set.
    struct HoldWrites {
        inner: MemDevice,
        held: Vec<Request>,
        released: Arc<AtomicBool>,
        waits: u32,
    }

    impl HoldWrites {
        fn release_if_told(&mut self) {
            if self.released.load(Ordering::Relaxed) {
                for request in self.held.drain(..) {
                    self.inner
                        .submit(request)
                        .expect("room for a released write");
                }
            }
        }
    }

    impl BlockDevice for HoldWrites {
        fn info(&self) -> &DeviceInfo {
            self.inner.info()
        }
        fn pool(&self) -> &DmaPool {
            self.inner.pool()
        }
        fn submit(&mut self, request: Request) -> std::result::Result<(), Rejected> {
            if matches!(request.op, IoOp::Write { .. }) {
                self.held.push(request);
                return Ok(());
            }
            self.inner.submit(request)
        }
        fn poll(&mut self, out: &mut Vec<IoCompletion>) -> std::result::Result<usize, DevError> {
            self.release_if_told();
            self.inner.poll(out)
        }
        fn wait(
            &mut self,
            out: &mut Vec<IoCompletion>,
            _timeout: Duration,
        ) -> std::result::Result<usize, DevError> {
            // A wait is what a drain does: held writes stay held (the wait returns what the
            // device has), and a mux that keeps waiting for them is the failure under test.
            self.waits += 1;
            assert!(
                self.waits < 100 || self.released.load(Ordering::Relaxed),
                "the mux waits for a held background write"
            );
            self.poll(out)
        }
        fn in_flight(&self) -> u32 {
            self.inner.in_flight() + self.held.len() as u32
        }
    }

    fn mux() -> (DeviceMux, Arc<AtomicBool>) {
        let inner = MemDevice::new(MemConfig {
            capacity_bytes: 16 << 20,
            ..MemConfig::default()
        })
        .expect("memory device");
        let released = Arc::new(AtomicBool::new(false));
        let dev = HoldWrites {
            inner,
            held: Vec::new(),
            released: released.clone(),
            waits: 0,
        };
        (DeviceMux::new(Box::new(dev)), released)
    }

    fn read(mux: &mut DeviceMux, token: u64, block: u64) -> Vec<u8> {
        let buf = mux.pool().alloc(BLOCK_BYTES).expect("a buffer");
        let lba = block_lba(mux, block);
        mux.submit(Request {
            token,
            op: IoOp::Read { lba, buf },
        })
        .expect("read submitted");
        let mut out = Vec::new();
        mux.poll(&mut out).expect("poll");
        assert_eq!(out.len(), 1, "the read completed without the held write");
        let c = out.pop().expect("one");
        assert_eq!((c.token, c.kind), (token, OpKind::Read));
        c.result.expect("read ok");
        c.buf.expect("read buffer").as_slice().to_vec()
    }

    #[test]
    fn reads_beside_a_background_write_never_wait_for_it_and_see_its_bytes() {
        let (mut mux, released) = mux();
        let token = BACKGROUND | 7 << 1;
        let blocks = vec![(10, vec![0xAB; BLOCK_BYTES]), (11, vec![0xCD; BLOCK_BYTES])];
        let mut runs = crate::commit::coalesce(&mux, blocks);
        assert_eq!(runs.len(), 1, "neighbours make one run");
        let run = runs.pop().expect("one run");
        let lba = block_lba(&mux, 10);
        mux.queue_background_write(token, lba, run, false)
            .expect("queued");
        assert!(mux.writes_outstanding.contains_key(&token));

        // Another block: the device answers while the write is held.
        assert_eq!(read(&mut mux, 1, 20), vec![0; BLOCK_BYTES]);
        assert!(
            mux.writes_outstanding.contains_key(&token),
            "a read of another block drained the background write"
        );
        // The blocks being written: their new bytes, not the device's old ones.
        assert_eq!(read(&mut mux, 2, 10), vec![0xAB; BLOCK_BYTES]);
        assert_eq!(read(&mut mux, 3, 11), vec![0xCD; BLOCK_BYTES]);
        assert!(mux.writes_outstanding.contains_key(&token));

        // Once the device completes the write, its bytes leave memory and reads go to the
        // device, which now has them.
        released.store(true, Ordering::Relaxed);
        let done = mux.poll_background(None).expect("background poll");
        assert!(done.iter().any(|c| c.token == token && c.result.is_ok()));
        assert!(mux.writing.is_empty() && mux.writes_outstanding.is_empty());
        assert_eq!(read(&mut mux, 4, 11), vec![0xCD; BLOCK_BYTES]);
    }

    /// A large background write (a commit's chunk, a write-back) reaches the device a
    /// bounded amount per pump: the copies into DMA buffers spread over the loop's turns,
    /// and every write still goes, in order.
    #[test]
    fn a_pump_hands_the_device_a_bounded_amount_and_the_backlog_drains_over_calls() {
        let (mut mux, released) = mux();
        released.store(true, Ordering::Relaxed);
        let token = BACKGROUND | 9 << 1;
        // 64 separate 32 KiB runs (2 MiB), every other 8 blocks, so none coalesce.
        for i in 0..64u64 {
            let first = 100 + i * 16;
            let blocks: Vec<(u64, Vec<u8>)> = (0..8)
                .map(|b| (first + b, vec![i as u8; BLOCK_BYTES]))
                .collect();
            let mut runs = crate::commit::coalesce(&mux, blocks);
            let run = runs.pop().expect("one run");
            let lba = block_lba(&mux, first);
            mux.queue_background_write(token, lba, run, false)
                .expect("queued");
        }
        assert_eq!(mux.backlog.len(), 64, "queueing submits nothing");
        mux.pump().expect("pump");
        let first_pump = 64 - mux.backlog.len();
        assert_eq!(
            first_pump * (32 << 10),
            PUMP_BYTES_MAX,
            "one pump submits PUMP_BYTES_MAX and no more"
        );
        let mut calls = 1;
        while !mux.backlog.is_empty() {
            let _ = mux.poll_background(None).expect("poll");
            calls += 1;
            assert!(calls < 100, "the backlog drains");
        }
        // A poll pumps before and after it takes completions: at most twice.
        assert!(
            calls * 2 >= (2 << 20) / PUMP_BYTES_MAX,
            "spread over several calls"
        );
        while mux.writes_outstanding.contains_key(&token) {
            let _ = mux.poll_background(None).expect("poll");
        }
        for i in 0..64u64 {
            assert_eq!(
                read(&mut mux, 1000 + i, 100 + i * 16),
                vec![i as u8; BLOCK_BYTES]
            );
        }
    }

    /// An asynchronous read over blocks only part of which a background write holds can be
    /// answered neither from the write's bytes nor from the device yet: it waits for that
    /// write without a synchronous wait (the held device asserts none comes), and once the
    /// write completes it reads the new bytes and the old ones beside them.
    #[test]
    fn an_async_read_partly_over_a_background_write_waits_for_it_without_holding_anyone() {
        let (mut mux, released) = mux();
        // Block 12's old bytes, written before the background write.
        let mut old = mux.pool().alloc(BLOCK_BYTES).expect("a buffer");
        old.as_mut_slice().fill(0x11);
        let lba = block_lba(&mux, 12);
        released.store(true, Ordering::Relaxed);
        mux.submit(Request {
            token: 1,
            op: IoOp::Write {
                lba,
                buf: old,
                fua: false,
            },
        })
        .expect("write submitted");
        let mut out = Vec::new();
        while out.is_empty() {
            mux.poll(&mut out).expect("poll");
        }
        released.store(false, Ordering::Relaxed);

        let token = BACKGROUND | 5 << 1;
        let blocks = vec![(10, vec![0xAB; BLOCK_BYTES]), (11, vec![0xCD; BLOCK_BYTES])];
        let run = crate::commit::coalesce(&mux, blocks)
            .pop()
            .expect("one run");
        mux.queue_background_write(token, block_lba(&mux, 10), run, false)
            .expect("queued");
        mux.pump().expect("pump");

        // Blocks 10..13: two being written, one on the device.
        let buf = mux.pool().alloc(3 * BLOCK_BYTES).expect("a buffer");
        let read_token = READ | 1;
        mux.submit_read(Request {
            token: read_token,
            op: IoOp::Read {
                lba: block_lba(&mux, 10),
                buf,
            },
        })
        .expect("accepted without waiting");
        assert_eq!(mux.reads_in_flight(), 1);
        assert!(
            mux.poll_reads(None).expect("poll").is_empty(),
            "waits for the write"
        );
        assert_eq!(mux.reads_after_writes.len(), 1);

        released.store(true, Ordering::Relaxed);
        let mut done = Vec::new();
        for _ in 0..100 {
            let _ = mux.poll_background(None).expect("background poll");
            done.extend(mux.poll_reads(None).expect("poll"));
            if !done.is_empty() {
                break;
            }
        }
        assert_eq!(done.len(), 1, "the read started once the write completed");
        let c = done.pop().expect("one");
        assert_eq!(c.token, read_token);
        c.result.expect("read ok");
        let data = c.buf.expect("buffer").as_slice().to_vec();
        assert_eq!(&data[..BLOCK_BYTES], &[0xAB; BLOCK_BYTES][..]);
        assert_eq!(
            &data[BLOCK_BYTES..2 * BLOCK_BYTES],
            &[0xCD; BLOCK_BYTES][..]
        );
        assert_eq!(&data[2 * BLOCK_BYTES..], &[0x11; BLOCK_BYTES][..]);
        assert_eq!(mux.reads_in_flight(), 0);
    }
}
