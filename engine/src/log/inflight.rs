//! fsync records in flight: the log's writes and flushes run in the background while the
//! engine goes on serving other operations, and fsync waiters are released in record order as
//! each record becomes durable.
//!
//! The engine has one device queue. [`crate::mux::DeviceMux`] sits in front of it and keeps
//! *background* requests (a record's writes and its flush, tagged in the token) apart: their
//! completions come here, to [`Filesystem::log_progress`], and ordering against the engine's
//! other I/O is by block, in the mux.
//!
//! # Invariants
//! - A commit drains the records explicitly.
//! - A record's flush is submitted only after all of its writes completed, and those of every
//!   write-back started before it, so the flush covers them (a write-back has no flush of its
//!   own: its data is durable at the next one, which a record or commit referencing it waits
//!   for). At most one flush of the pipeline's own is in flight; it covers every record
//!   whose writes had completed when it was submitted, and the records ready after that share
//!   the next. Records become durable in the order they were started: ticket N is reported durable
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

use crate::blocks::block_lba;
use crate::error::{EngineError, Result};
use crate::fs::Filesystem;
use crate::mux::{BACKGROUND, TAG_MASK};
use nvme::{DevError, IoOp, Rejected, Request};
use std::collections::VecDeque;
use std::time::Duration;
/// Records in flight at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// One record on its way to the device.
#[derive(Debug)]
struct InFlight {
    ticket: u64,
    /// Write runs not yet completed (the record is being submitted while this is counted up
    /// front, so its flush cannot go early).
    writes_left: u32,
    flush_submitted: bool,
    flushed: bool,
    /// The ticket whose flush request covers this record, when the pipeline submitted one
    /// ([`Filesystem::log_progress`]): one flush covers every record whose writes were done
    /// when it went.
    flush_cover: Option<u64>,
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
    /// A commit was in flight: durable once generation `generation` is SuperCommitted and
    /// `ticket`, if any, is durable: this group's record, or the newest record logged since
    /// the commit started (records of the next generation, which replay takes only after
    /// it). Such a ticket is reported durable only once the commit is, so releasing the
    /// group at the ticket is enough; with none, the group waits for the commit.
    AfterCommit {
        ticket: Option<u64>,
        generation: u64,
    },
}

impl Pipeline {
    /// No record, write-back or commit chunk is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }
}

impl Filesystem {
    /// Submits `blocks` (a record and, for a large fsync, its data) as background writes
    /// under a new ticket; the flush follows when they complete.
    pub(crate) fn submit_record(&mut self, blocks: Vec<(u64, bytes::Bytes)>) -> Result<u64> {
        let after = self.commit_in_flight();
        self.submit_background(blocks, false, after, 0)
    }

    /// Writes staged file data back in the background under a new ticket, done when the
    /// writes complete: no flush of its own, so the data is durable only at the next flush
    /// (`unflushed_writes`), and the next record's flush waits for these writes.
    pub(crate) fn submit_writeback(&mut self, blocks: Vec<(u64, bytes::Bytes)>) -> Result<u64> {
        let bytes = crate::blocks::pieces_bytes(&blocks);
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
    pub(crate) fn submit_commit_chunk(&mut self, blocks: Vec<(u64, bytes::Bytes)>) -> Result<u64> {
        assert!(!blocks.is_empty(), "a commit chunk has blocks");
        let bytes = crate::blocks::pieces_bytes(&blocks);
        self.submit_background(blocks, false, None, bytes)
    }

    /// As [`Filesystem::submit_record`] with every write FUA and no flush after: durable when
    /// the writes complete (a small record that carries its data).
    pub(crate) fn submit_fua(&mut self, blocks: Vec<(u64, bytes::Bytes)>) -> Result<u64> {
        let after = self.commit_in_flight();
        self.submit_background(blocks, true, after, 0)
    }

    /// A commit's own writes (its blocks, then its superblock with FUA): never held back by
    /// the commit in flight, which they are.
    pub(crate) fn submit_commit_io(
        &mut self,
        blocks: Vec<(u64, bytes::Bytes)>,
        fua: bool,
    ) -> Result<u64> {
        self.submit_background(blocks, fua, None, 0)
    }

    /// `after`: a record written while the commit of that generation is in flight belongs to
    /// the next one, which replay takes only once that commit is durable — it is reported
    /// durable only then (even when its own writes finished first).
    fn submit_background(
        &mut self,
        blocks: Vec<(u64, bytes::Bytes)>,
        fua: bool,
        after: Option<u64>,
        writeback_bytes: usize,
    ) -> Result<u64> {
        if !fua && writeback_bytes == 0 {
            // This batch's flush will cover every write completed before it, in-place data
            // written back in the foreground included; anything released after it is too.
            self.log.unflushed_writes = false;
        }
        if self.dev.lent_for_writes() {
            return self.submit_side(blocks, fua, after, writeback_bytes);
        }
        while self.records_on_device() >= MAX_IN_FLIGHT {
            self.log_progress(Some(Duration::from_millis(100)))?;
        }
        // Runs the device takes as shared writes may be longer than its largest I/O (the
        // mux's pump sends them from their pieces).
        let runs = crate::blocks::coalesce(&*self.dev, blocks, true);
        // FUA writes are durable when they complete, a write-back is done then: no flush.
        let no_flush = fua || writeback_bytes > 0;
        let ticket = self.start_ticket(runs.len(), no_flush, fua, after, writeback_bytes);
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

    /// [`Filesystem::submit_background`] for an engine lent to a caller's thread
    /// ([`crate::mux::Lent::Writes`], [`Filesystem::fsync_beside`]): the writes, then the
    /// flush unless they are FUA or a write-back, are queued for the caller to make beside
    /// the queue once it has given the engine back ([`crate::log::SideRecord`]); their
    /// completions come back through the device multiplexer as a device's do. Lent so only
    /// with nothing in flight, so the flush covers every write the ticket may reference.
    fn submit_side(
        &mut self,
        blocks: Vec<(u64, bytes::Bytes)>,
        fua: bool,
        after: Option<u64>,
        writeback_bytes: usize,
    ) -> Result<u64> {
        assert!(
            after.is_none() && self.log.pipeline.in_flight.is_empty(),
            "writes beside the queue only with nothing in flight"
        );
        // Written beside the queue through a bounce buffer: no longer than the largest I/O.
        let runs = crate::blocks::coalesce(&*self.dev, blocks, false);
        let flush = !fua && writeback_bytes == 0;
        // The caller flushes (or the writes are FUA, or a write-back needs none): the
        // pipeline submits no flush of its own.
        let ticket = self.start_ticket(runs.len(), true, fua, after, writeback_bytes);
        let token = BACKGROUND | ticket << 1;
        for run in runs {
            let lba = block_lba(&*self.dev, run.addr);
            let io = self.dev.queue_side_write(token, lba, run, fua);
            self.log.side_out.push(io);
        }
        if flush {
            let io = self.dev.queue_side_flush(token | 1);
            self.log.side_out.push(io);
        }
        Ok(ticket)
    }

    /// A new ticket in the pipeline for `writes` write runs; `flush_submitted`: the pipeline
    /// submits no flush for it.
    fn start_ticket(
        &mut self,
        writes: usize,
        flush_submitted: bool,
        fua: bool,
        after: Option<u64>,
        writeback_bytes: usize,
    ) -> u64 {
        let pipeline = &mut self.log.pipeline;
        let ticket = pipeline.next_ticket;
        pipeline.next_ticket += 1;
        pipeline.in_flight.push_back(InFlight {
            ticket,
            writes_left: writes as u32,
            flush_submitted,
            flushed: false,
            flush_cover: None,
            fua,
            writeback_bytes,
            after,
        });
        ticket
    }

    /// A background failure: the filesystem fails stop and every pending ticket fails.
    fn fail_background<T>(&mut self, e: DevError) -> Result<T> {
        self.failed.get_or_insert(EngineError::Device(e.clone()));
        Err(EngineError::Device(e))
    }

    /// Counts background completions against the records in flight: finished writes, done
    /// flushes; a FUA record (or a write-back) whose writes are all done is durable (done).
    fn count_background(&mut self, completions: Vec<nvme::IoCompletion>) -> Result<()> {
        for c in completions {
            let ticket = (c.token & !TAG_MASK) >> 1;
            let is_flush = c.token & 1 != 0;
            if let Err(e) = c.result {
                return self.fail_background(e);
            }
            if is_flush {
                // One flush covers every record it was submitted for (a caller's flush beside
                // the queue, its own record alone).
                let mut covered = 0;
                for entry in self.log.pipeline.in_flight.iter_mut() {
                    if entry.flush_cover == Some(ticket)
                        || (entry.flush_cover.is_none() && entry.ticket == ticket)
                    {
                        entry.flushed = true;
                        covered += 1;
                    }
                }
                // Mutation check: the records went at their flush's submission.
                assert!(
                    covered > 0 || mutated!(AckAtFlushSubmit),
                    "a flush completion belongs to a record in flight"
                );
                continue;
            }
            let Some(entry) = self
                .log
                .pipeline
                .in_flight
                .iter_mut()
                .find(|f| f.ticket == ticket)
            else {
                panic!("a write completion belongs to a record in flight");
            };
            entry.writes_left -= 1;
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
        Ok(())
    }

    /// Takes the completions callers posted for their writes beside the queue, for a
    /// thread the engine is lent to (which may not poll the queue), and releases the
    /// records they made durable. What the owner's next [`Filesystem::log_progress`] would
    /// do with them, less submitting flushes (the queue is the owner's).
    pub(crate) fn take_side_done_lent(&mut self) -> Result<()> {
        let completions = self.dev.take_side_completions();
        self.count_background(completions)?;
        self.release_durable();
        Ok(())
    }

    /// Pops the records that are durable, in order; the ticket below which all are.
    fn release_durable(&mut self) -> u64 {
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
        pipeline.durable_below
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
                self.dev.drop_backlog();
                let _ = self.dev.poll_background(wait);
                return Err(e);
            }
        }
        let completions = match self.dev.poll_background(wait) {
            Ok(c) => c,
            Err(e) => return self.fail_background(e),
        };
        self.count_background(completions)?;
        self.submit_group_flush()?;
        Ok(self.release_durable())
    }

    /// Submits one flush for every record whose writes are all done and that has none yet,
    /// once no write-back started before it has writes outstanding (the flush must cover the
    /// data the record may reference), while no flush of the pipeline's is in flight. The
    /// records that become ready meanwhile wait for that one to complete and then share the
    /// next: a flush covers every write completed before it is submitted, so one per group
    /// of records is enough, and a device flushes once where it was asked once per record.
    /// Four writers fsyncing 64 KiB each on a file image made a record and a flush each, up
    /// to four flushes at once on one image file (docs/fsync-log.md has the figures).
    fn submit_group_flush(&mut self) -> Result<()> {
        let pipeline = &self.log.pipeline;
        if pipeline
            .in_flight
            .iter()
            .any(|f| f.flush_cover.is_some() && !f.flushed)
        {
            return Ok(());
        }
        let mut writeback_ahead = false;
        let mut group = Vec::new();
        for (i, entry) in pipeline.in_flight.iter().enumerate() {
            let held = writeback_ahead;
            writeback_ahead |= entry.writeback_bytes > 0 && entry.writes_left > 0;
            if entry.writes_left > 0 || entry.flush_submitted || held {
                continue;
            }
            group.push(i);
        }
        let Some(&newest) = group.last() else {
            return Ok(());
        };
        let cover = pipeline.in_flight[newest].ticket;
        let request = Request {
            token: BACKGROUND | cover << 1 | 1,
            op: IoOp::Flush,
        };
        match self.dev.submit_background(request) {
            Ok(()) => {
                for i in group {
                    let entry = &mut self.log.pipeline.in_flight[i];
                    assert!(
                        entry.writes_left == 0,
                        "a flush covers completed writes only"
                    );
                    entry.flush_submitted = true;
                    entry.flush_cover = Some(cover);
                    // Mutation check: durable before the flush completed.
                    entry.flushed |= mutated!(AckAtFlushSubmit);
                }
                Ok(())
            }
            Err(Rejected {
                reason: DevError::QueueFull,
                ..
            }) => Ok(()),
            Err(rejected) => self.fail_background(rejected.reason),
        }
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
    /// commit behind it) until the pipeline is advanced once more. Writes a caller makes
    /// beside the queue ([`Filesystem::fsync_beside`]) do not count: the owner has nothing
    /// to poll for them (their records count in [`Filesystem::log_in_flight`], and their
    /// caller rings the owner when it posts completions the owner looked for).
    pub fn device_busy(&self) -> bool {
        self.dev.queue_busy()
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

    /// The newest record in flight that counts only once commit `generation` is durable
    /// (logged while it was in flight). Releasing it implies the commit: what
    /// [`FsyncStart::AfterCommit`] names.
    pub(crate) fn newest_in_flight_after(&self, generation: u64) -> Option<u64> {
        if mutated!(AnyTicketDuringCommit) {
            // Mutation check: the newest ticket of any kind, a commit chunk included.
            return self.newest_in_flight();
        }
        self.log
            .pipeline
            .in_flight
            .iter()
            .rev()
            .find(|f| f.after == Some(generation))
            .map(|f| f.ticket)
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
