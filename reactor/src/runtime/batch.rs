//! A batch of requests ([`Reactor::run_batch`]) and what it leaves in flight: its fsync
//! group's record and its reads' device I/O, collected as the device completes them
//! ([`Reactor::poll_durable`]).
//!
//! # Invariants
//! - Operations run in queue order. An fsync completes only after the group holding it is
//!   durable (its record and data flushed, or its fallback commit at SuperCommitted); every
//!   operation queued before it is covered. A group's record is written in the background
//!   while later batches run; groups complete in the order they started (a later record's
//!   flush finishing first releases nobody early), so at most 64 records are in flight.
//! - Consecutive reads start together; any other operation first lets the reads before it
//!   start, so order is kept. Each read is answered at once, parked, or waiting in one
//!   device set, exactly one of these (asserted).
//! - Every request taken into a batch is owed ([`crate::owed`]) until it is answered or
//!   handed on; completions go out after the batch has run ([`crate::delivery`]).

use super::{publish_statfs, Reactor};
use crate::delivery::deliver_failed;
use crate::execute::execute_on;
use crate::meta_wait::Probed;
use crate::multi::{Plan, ToCoordinator};
use crate::op::{Completion, Op, Reply};
use crate::queue::Request;
use crate::reply::ReplyQueue;
use engine::log::FsyncStart;
use engine::{Deferred, EngineError, ReadResult};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An fsync group waiting for its record to become durable.
pub(super) struct PendingGroup {
    ticket: u64,
    waiters: Vec<(Request, Instant)>,
    group_start: Instant,
}

impl Reactor {
    /// Walks [`Op::Walk`] `request` over the directories this reactor holds, deferred (a
    /// node not in memory parks it). Returns the operation it carries, its target the
    /// inode reached, when that runs here; None when it was answered (an error on the way),
    /// parked, or handed on to the reactor holding the rest of the path or its target.
    fn walk(
        &mut self,
        request: Request,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
        forwards: &mut Vec<(usize, Request)>,
    ) -> Option<Request> {
        let Op::Walk { from, path, then } = &request.op else {
            return Some(request);
        };
        // How far the walk gets here: the inode reached and the names taken.
        let step = |fs: &mut engine::Filesystem| crate::execute::walk(fs, *from, path);
        let stepped = if self.meta.may_defer(&request) {
            match self.fs.without_waiting(step) {
                Deferred::Ready(stepped) => stepped,
                Deferred::Fetching(set) => {
                    self.meta.park(request, set);
                    return None;
                }
            }
        } else {
            step(&mut self.fs)
        };
        let here = self.multi.as_ref().map(|m| (m.index, m.router.clone()));
        let next = match stepped {
            Ok((ino, taken)) if taken < path.len() => {
                // A directory on the way is another reactor's: the rest of the walk is.
                let (_, router) = here.as_ref().expect("one reactor holds every shard");
                let rest = Op::Walk {
                    from: ino,
                    path: path[taken..].to_vec(),
                    then: then.clone(),
                };
                Ok((router.owner_of(ino), rest))
            }
            Ok((ino, _)) => crate::execute::walked(then, ino).map(|op| {
                let to = here.as_ref().map_or(0, |(_, router)| router.route(&op));
                (to, op)
            }),
            Err(e) => Err(e),
        };
        self.meta.ran(&request);
        match next {
            Ok((to, op)) if here.as_ref().is_none_or(|(index, _)| *index == to) => {
                Some(Request { op, ..request })
            }
            Ok((to, op)) => {
                forwards.push((to, Request { op, ..request }));
                None
            }
            Err(e) => {
                done.push(crate::multi::completion(request, Err(e)));
                None
            }
        }
    }

    /// Runs a batch: every operation in order; the fsyncs are checked when reached and made
    /// durable together at the end; then completions go out and clients wake.
    pub(crate) fn run_batch(&mut self, batch: &mut Vec<Request>) {
        self.stats.batches += 1;
        let mut done: Vec<(Arc<ReplyQueue>, Completion)> = Vec::with_capacity(batch.len());
        let mut fsyncs: Vec<(Request, (u64, bool), Instant)> = Vec::new();
        let mut syncs: Vec<Request> = Vec::new();
        let mut reads: Vec<Request> = Vec::new();
        // With several reactors: requests for another reactor, and spans for the coordinator.
        let mut forwards: Vec<(usize, Request)> = Vec::new();
        let mut spans: Vec<(Request, Option<u32>)> = Vec::new();
        // Requests whose nodes arrived run first (they came before their clients' others);
        // they are owed already.
        let resumed = self.meta.take_resumed();
        let owed_already = resumed.len();
        if owed_already > 0 {
            let fresh = std::mem::take(batch);
            batch.extend(resumed);
            batch.extend(fresh);
        }
        // Owed from here until answered or handed on, whatever happens in between.
        for request in batch.iter().skip(owed_already) {
            self.owed
                .take(&request.reply, request.token, request.submitted);
        }
        for request in batch.drain(..) {
            self.stats.ops += 1;
            // Consecutive reads run together, their device reads all in flight at once; any
            // other operation first lets the reads before it start (and park those whose
            // nodes are not in memory), so order is kept.
            let is_read = matches!(request.op, Op::Read { .. });
            if !is_read {
                self.run_reads(&mut reads, &mut done);
            }
            // A client with a parked request: this one waits behind it, in order.
            let Some(request) = self.meta.holds_back(request) else {
                continue;
            };
            #[cfg(any(test, feature = "test-hooks"))]
            if self
                .panic_next
                .swap(false, std::sync::atomic::Ordering::SeqCst)
            {
                panic!(
                    "test hook: this reactor panics on its next request ({request_op:?})",
                    request_op = request.op
                );
            }
            if is_read {
                reads.push(request);
                continue;
            }
            // A path's walk runs here as far as this reactor holds its directories; what
            // it carries then goes on as if sent where the walk ended.
            let request = if matches!(request.op, Op::Walk { .. }) {
                match self.walk(request, &mut done, &mut forwards) {
                    Some(request) => request,
                    None => continue,
                }
            } else {
                request
            };
            if self.multi.is_some() && matches!(request.op, Op::Stats) {
                self.hand_on(request, ToCoordinator::Stats);
                continue;
            }
            if let Some(m) = self.multi.as_mut() {
                // The routing lookups run deferred too: a miss parks the request, not the
                // reactor (routing only looks up and places; nothing it changes is undone).
                let planned = if self.meta.may_defer(&request) {
                    match self
                        .fs
                        .without_waiting(|fs| crate::multi::plan(fs, m, &request.op))
                    {
                        Deferred::Ready(plan) => plan,
                        Deferred::Fetching(set) => {
                            self.meta.park(request, set);
                            continue;
                        }
                    }
                } else {
                    crate::multi::plan(&mut self.fs, m, &request.op)
                };
                if !matches!(planned, Plan::Local) {
                    self.meta.ran(&request);
                }
                match planned {
                    Plan::Local => {}
                    Plan::Forward(to, op) => {
                        forwards.push((to, Request { op, ..request }));
                        continue;
                    }
                    Plan::Span(place) => {
                        spans.push((request, place));
                        continue;
                    }
                    Plan::Answer(result) => {
                        done.push(crate::multi::completion(request, result));
                        continue;
                    }
                }
            }
            // A due commit waits for the device pipeline to empty: what would add to it
            // waits for the commit's start instead (then it logs into the next generation).
            // Checked first: the room check below may start write-backs, which would add to
            // the pipeline the commit waits to see empty.
            if self.commit_barrier && (stages_data(&request.op) || request.op.is_fsync().is_some())
            {
                self.meta.park_for_commit(request);
                continue;
            }
            // A write that would stage data past the engine's bound waits, parked, until
            // write-back has made room: writers go at the device's pace, and nobody else
            // waits for them.
            if stages_data(&request.op) && !self.fs.staging_has_room() {
                self.meta.park_for_room(request);
                continue;
            }
            // What the request looks up is in memory, or it parks until it is.
            let request = match self.meta.probe(&mut self.fs, request) {
                Probed::Run(request) => request,
                Probed::Answered(request, result) => {
                    done.push((
                        request.reply,
                        Completion {
                            token: request.token,
                            result,
                        },
                    ));
                    continue;
                }
                Probed::Parked => continue,
            };
            // An atomic batch is applied here, whole (no commit starts inside it), and joins
            // the fsync group as an fsync of its file: the group's one record (or commit)
            // makes all of it durable together. Its bytes are dropped once applied.
            if let Op::WriteAtomic { ino, writes } = &request.op {
                let ino = *ino;
                let started = Instant::now();
                match self.fs.write_batch(ino, writes) {
                    Ok(()) => {
                        let request = Request {
                            op: Op::Fsync { ino },
                            ..request
                        };
                        fsyncs.push((request, (ino, false), started));
                    }
                    Err(e) => done.push(crate::multi::completion(request, Err(e))),
                }
                continue;
            }
            if let Some(member) = request.op.is_fsync() {
                let started = Instant::now();
                match self.fs.check_exists(member.0) {
                    Ok(()) => fsyncs.push((request, member, started)),
                    Err(e) => done.push(crate::multi::completion(request, Err(e))),
                }
                continue;
            }
            if matches!(request.op, Op::Sync) {
                syncs.push(request);
                continue;
            }
            let result = self.execute(&request.op);
            // A partition's change refused for want of space that a commit would give back
            // (blocks freed in the running transaction, groups emptied by any shard) waits,
            // parked, for the next commit to complete and runs again; a few rounds at most.
            // (A whole mount commits inline, in the engine.)
            if matches!(result, Err(EngineError::NoSpace))
                && self.multi.is_some()
                && self.fs.space_reclaimable()
                && self.meta.may_wait_for_space(&request)
            {
                let generation = self.fs.generation();
                self.meta.park_for_space(request, generation);
                continue;
            }
            self.meta.done_with_space(&request);
            let Request {
                op,
                token,
                reply,
                submitted,
            } = request;
            // With several reactors a directory rename commits before it returns.
            match result {
                Ok(renamed)
                    if self.multi.is_some()
                        && matches!(op, Op::Rename { .. })
                        && crate::multi::renamed_a_directory(&mut self.fs, &op) =>
                {
                    let generation = self.fs.generation();
                    self.commit_waiters.push(crate::multi::CommitWaiter {
                        request: Request {
                            op,
                            token,
                            reply,
                            submitted,
                        },
                        reply: renamed,
                        fsync: None,
                        generation,
                    });
                }
                result => done.push((reply, Completion { token, result })),
            }
        }
        self.run_reads(&mut reads, &mut done);
        if !fsyncs.is_empty() {
            let members: Vec<(u64, bool)> = fsyncs.iter().map(|(_, m, _)| *m).collect();
            let fallbacks = self.fs.log_stats().fallback_commits();
            let group_start = Instant::now();
            let result = tracing::debug_span!("fsync_group_start", members = members.len())
                .in_scope(|| self.fs.fsync_group_start(&members));
            let fell_back = self.fs.log_stats().fallback_commits() > fallbacks;
            self.stats.fsync_groups += 1;
            self.stats.fsync_group_max = self.stats.fsync_group_max.max(members.len() as u64);
            let waiters: Vec<(Request, Instant)> = fsyncs
                .into_iter()
                .map(|(r, _, started)| (r, started))
                .collect();
            match result {
                // The record is in flight: the waiters go when it is durable, and the reactor
                // serves the next batch meanwhile.
                // Logged while a commit is in flight too: the engine reports such a record
                // durable only once the commit is.
                Ok(
                    FsyncStart::Pending(ticket)
                    | FsyncStart::AfterCommit {
                        ticket: Some(ticket),
                        ..
                    },
                ) => self.pending.push_back(PendingGroup {
                    ticket,
                    waiters,
                    group_start,
                }),
                Ok(FsyncStart::Durable) => {
                    self.finish_group(waiters, group_start, fell_back, Ok(()), &mut done);
                }
                // Released by a commit: the one in flight, when there was nothing new to log
                // (what it changed is in it), or, for a fallback, the next one (started or
                // asked for after the batch).
                Ok(
                    start
                    @ (FsyncStart::AfterCommit { ticket: None, .. } | FsyncStart::NeedsCommit),
                ) => {
                    let generation = match start {
                        FsyncStart::AfterCommit { generation, .. } => generation,
                        _ => self.fs.generation(),
                    };
                    for (request, started) in waiters {
                        self.commit_waiters.push(crate::multi::CommitWaiter {
                            request,
                            reply: Reply::Done,
                            fsync: Some((started, group_start)),
                            generation,
                        });
                    }
                }
                Err(e) => {
                    self.finish_group(waiters, group_start, false, Err(e), &mut done);
                }
            }
        }
        // A sync waits for the running generation (a commit in flight holds an older one):
        // released at its SuperCommitted; tick() unpins after.
        let generation = self.fs.generation();
        for request in syncs {
            self.commit_waiters.push(crate::multi::CommitWaiter {
                request,
                reply: Reply::Done,
                fsync: None,
                generation,
            });
        }
        self.collect_durable(None, &mut done);
        // Before the replies: a client that saw its change done sees it in statfs too.
        if let Some(m) = self.multi.as_ref() {
            publish_statfs(&self.fs, &m.router.reactors[m.index]);
        }
        self.deliver(done);
        self.drive_commits();
        if let Some(router) = self.multi.as_ref().map(|m| m.router.clone()) {
            for (to, request) in forwards {
                let (reply, token) = (request.reply.clone(), request.token);
                let target = &router.reactors[to];
                match target.requests.push(request) {
                    Ok(()) => {
                        target.wake_reactor();
                        self.owed.settle(&reply, token);
                    }
                    // Its queue is full: the coordinator runs it instead (it can run anything).
                    Err(request) => spans.push((request, None)),
                }
            }
            for (request, place) in spans {
                self.hand_on(request, |r| ToCoordinator::Span(r, place));
            }
        }
    }

    /// Completes an fsync group's waiters with `result`, recording their phases; returns the
    /// group's time from its start, in ns.
    fn finish_group(
        &mut self,
        waiters: Vec<(Request, Instant)>,
        group_start: Instant,
        fell_back: bool,
        result: Result<(), EngineError>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) -> u64 {
        let now = Instant::now();
        let group_ns = now.duration_since(group_start).as_nanos().max(1) as u64;
        for (request, started) in waiters {
            let wait = started.duration_since(request.submitted).as_nanos().max(1) as u64;
            let total = now.duration_since(request.submitted).as_nanos().max(1) as u64;
            let _ = self.hist.queue_wait.record(wait);
            let phase = if fell_back {
                &mut self.hist.commit_wait
            } else {
                &mut self.hist.log_write
            };
            let _ = phase.record(group_ns);
            let _ = self.hist.total.record(total);
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result: result.clone().map(|()| Reply::Done),
                },
            ));
        }
        group_ns
    }

    /// Releases the waiters of every fsync group whose record is durable now (all of them,
    /// with the error, once the filesystem failed). `wait`: sleep on the device up to that
    /// long for progress.
    fn collect_durable(
        &mut self,
        wait: Option<Duration>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) {
        // With no fsync waiting, the pipeline still advances for background write-backs (their
        // completions free the room the next ones need) and for records callers wrote beside
        // the queue (a due commit waits for them).
        if self.pending.is_empty() && !self.fs.device_busy() && self.fs.log_in_flight() == 0 {
            return;
        }
        match self.fs.log_progress(wait) {
            Ok(durable_below) => {
                while self
                    .pending
                    .front()
                    .is_some_and(|g| g.ticket < durable_below)
                {
                    let group = self.pending.pop_front().expect("front");
                    let durable_ns =
                        self.finish_group(group.waiters, group.group_start, false, Ok(()), done);
                    self.durable_ns_ewma =
                        super::durable_ns_ewma_next(self.durable_ns_ewma, durable_ns);
                }
            }
            Err(e) => {
                while let Some(group) = self.pending.pop_front() {
                    self.finish_group(
                        group.waiters,
                        group.group_start,
                        false,
                        Err(e.clone()),
                        done,
                    );
                }
            }
        }
    }

    /// Waits for records in flight (up to `wait`) and delivers the waiters they release;
    /// resumes the writes that waited for staging room once there is some.
    pub(crate) fn poll_durable(&mut self, wait: Option<Duration>) {
        // Reads are what the reactor sleeps on when nothing else is on the device.
        let read_wait = if self.pending.is_empty() && !self.fs.device_busy() {
            wait
        } else {
            None
        };
        self.collect_reads(read_wait);
        let mut done = Vec::new();
        // The commit's I/O shares the device pipeline with the records: one wait serves both.
        let commit_wait = if self.pending.is_empty() { wait } else { None };
        self.collect_durable(wait, &mut done);
        self.deliver(done);
        let before = self.fs.durable_generation();
        self.progress_commit(commit_wait);
        if self.fs.durable_generation() != before {
            // Groups logged during the commit may go now.
            let mut done = Vec::new();
            self.collect_durable(None, &mut done);
            self.deliver(done);
        }
        // After the polls above took the write-backs' completions.
        if self.meta.waits_for_room() && self.fs.staging_has_room() {
            self.meta.room_made();
        }
    }

    /// Hands a client request to the coordinator (a span, or statistics); answers it here
    /// if the coordinator has gone.
    fn hand_on(&mut self, request: Request, make: impl FnOnce(Box<Request>) -> ToCoordinator) {
        self.owed.settle(&request.reply, request.token);
        let m = self.multi.as_ref().expect("several reactors");
        if let Err(request) = m.hand_on(make(Box::new(request))) {
            deliver_failed(
                vec![(request.reply, request.token)],
                &EngineError::Internal("the commit coordinator has stopped".into()),
            );
        }
    }

    /// Starts the queued reads together ([`Filesystem::read_start_deferred`]): each read
    /// memory serves is answered now; the rest park until their device reads complete.
    fn run_reads(
        &mut self,
        reads: &mut Vec<Request>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) {
        if reads.is_empty() {
            return;
        }
        let wanted: Vec<(u64, u64, usize)> = reads
            .iter()
            .map(|r| match r.op {
                Op::Read { ino, offset, len } => (ino, offset, len),
                _ => unreachable!("only reads are queued here"),
            })
            .collect();
        self.stats.read_groups += 1;
        // Each read's extents are mapped once, deferred: one whose tree nodes are not in
        // memory parks until they are read, and its client's later requests wait behind it.
        let may_defer: Vec<bool> = reads.iter().map(|r| self.meta.may_defer(r)).collect();
        let started = self.fs.read_start_deferred(&wanted, &may_defer);
        // Each request goes one way: answered now (served from memory: it never waits for
        // another request's device read), parked (its nodes are being read), or into the
        // device set.
        let mut slots: Vec<Option<Request>> = reads.drain(..).map(Some).collect();
        for (index, set) in started.parked {
            let request = slots[index].take().expect("a request parks once");
            self.meta.park(request, set);
        }
        for request in slots.iter().flatten() {
            self.meta.ran(request);
        }
        for (index, result) in started.done {
            let request = slots[index].take().expect("a request is answered once");
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result: result.map(Reply::Data),
                },
            ));
        }
        for (set, index) in started.pending {
            let request = slots[index].take().expect("a request waits in one set");
            // Its client stops yielding for this reply and sleeps (client.rs).
            request.reply.note_device_wait();
            self.parked_reads.insert(set, request);
        }
        assert!(
            slots.iter().all(Option::is_none),
            "every read is answered, parked or waiting"
        );
    }

    /// Device reads in flight: parked reads, tree nodes parked requests wait for, and
    /// read-ahead (which nobody waits for, but whose blocks a later unpin must wait for:
    /// it is reaped as promptly as the others).
    pub(super) fn reads_outstanding(&self) -> bool {
        !self.parked_reads.is_empty() || self.fs.reads_in_flight() > 0
    }

    /// True when the only work on the device is parked reads.
    pub(super) fn only_reads_in_flight(&self) -> bool {
        self.reads_outstanding() && self.pending.is_empty() && !self.fs.device_busy()
    }

    /// Answers the parked reads whose device I/O finished; with `wait`, sleeps up to that
    /// long for the device when none has.
    pub(super) fn collect_reads(&mut self, wait: Option<Duration>) {
        if !self.reads_outstanding() {
            return;
        }
        let mut done = Vec::new();
        for (set, results) in self.fs.read_progress(wait) {
            // Tree nodes for parked requests: they run again in the next batch.
            if self.meta.answered(set) {
                continue;
            }
            let Some(request) = self.parked_reads.remove(&set) else {
                // A set the engine finished for someone else (a synchronous read).
                continue;
            };
            let [result] =
                <[ReadResult; 1]>::try_from(results).expect("a read's set answers it alone");
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result: result.map(Reply::Data),
                },
            ));
        }
        self.deliver(done);
    }

    fn execute(&mut self, op: &Op) -> Result<Reply, EngineError> {
        match op {
            Op::Stats => Ok(Reply::Stats(Box::new(self.snapshot()))),
            op => execute_on(&mut self.fs, op),
        }
    }
}

/// True for the operations that stage file data in the engine (writes, appends, atomic
/// batches): those a reactor holds back while staging is full.
fn stages_data(op: &Op) -> bool {
    matches!(
        op,
        Op::Write { .. } | Op::Append { .. } | Op::WriteAtomic { .. }
    )
}
