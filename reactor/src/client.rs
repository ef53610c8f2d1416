//! The client side: a handle any thread uses to submit operations to the reactor and collect
//! their completions, from its completion queue ([`crate::reply`], which says how a client
//! waits), or by running the request itself while the reactor sleeps ([`crate::caller`]).
//!
//! # Invariants
//! - A client never has more than its capacity in flight (backpressure at submit, where the
//!   caller can act on it): its completion queue, of that capacity, never overflows.
//! - A client with requests of its own in flight runs none itself (it would overtake them).

use crate::multi::Router;
use crate::op::{Completion, Op, Reply};
use crate::queue::{Request, Shared};
use crate::reply::{wait_policy, ReplyQueue, Wait, DEEP_QUEUE_REQUESTS};
use engine::EngineError;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a submit was refused; the operation comes back.
#[derive(Debug)]
pub enum SubmitError {
    /// The client has its capacity in flight, or the reactor's request queue is full: poll
    /// completions (or wait) and submit again.
    Full(Op),
    /// The runtime is shutting down.
    Stopped(Op),
}

/// A submission handle. Cheap to create ([`crate::Runtime::client`]); use one per thread.
pub struct Client {
    /// Every reactor's queue and which owns what: an operation goes to the reactor owning
    /// its inode (or directory).
    router: Arc<Router>,
    /// The first reactor's shared state: its stopping/stopped flags and waiter count stand
    /// for the whole runtime.
    shared: Arc<Shared>,
    replies: Arc<ReplyQueue>,
    capacity: usize,
    in_flight: usize,
    next_token: u64,
    /// Completions taken from the queue while waiting for a specific token.
    stash: VecDeque<Completion>,
    /// Requests this client has submitted: a call's round trips to the reactors.
    sent: u64,
    /// Requests this client ran itself while the reactor slept ([`crate::caller`]).
    ran_here: u64,
    /// Operations in flight when the last [`Client::submit`] came: 0 for a program that
    /// submits one at a time.
    submitted_behind: usize,
    /// This client's handle for fsync records it writes beside the device's queue
    /// ([`crate::caller`]), made at its first such fsync.
    side_io: Option<Box<dyn nvme::AnyThreadIo>>,
    /// The tokens of submitted large transfers ([`Op::is_large_transfer`]) not collected
    /// yet: at most `capacity`.
    large: Vec<u64>,
}

impl Client {
    pub(crate) fn new(router: Arc<Router>, capacity: usize) -> Client {
        let capacity = capacity.max(1);
        Client {
            shared: router.reactors[0].clone(),
            router,
            replies: Arc::new(ReplyQueue::new(capacity)),
            capacity,
            in_flight: 0,
            next_token: 1 << 63,
            stash: VecDeque::new(),
            sent: 0,
            ran_here: 0,
            submitted_behind: 0,
            side_io: None,
            large: Vec::new(),
        }
    }

    /// Requests submitted through this client so far (each a round trip to a reactor;
    /// what a reactor hands on to another is not counted again).
    pub fn requests_sent(&self) -> u64 {
        self.sent
    }

    /// Requests this client ran itself on the reactor's engine while the reactor slept
    /// (no round trip: [`crate::caller`]).
    pub fn requests_ran_here(&self) -> u64 {
        self.ran_here
    }

    /// Operations submitted and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Large transfers ([`Op::is_large_transfer`]) submitted and not yet collected.
    pub fn large_in_flight(&self) -> usize {
        self.large.len()
    }

    /// Whether this client streams: two or more requests in flight, every one a large
    /// transfer. A [`Client::wait`] then sleeps for the next reply instead of spinning:
    /// replies come hundreds of microseconds apart, the device stays busy with the others
    /// while the reactor wakes the client, and the spin was a quarter of the CPU of fio's
    /// 1 MiB writes at queue depth 8 (0.82-0.86 CPU seconds per GiB, 0.59-0.68 sleeping, at
    /// the same MiB/s). One large transfer alone is waited for as before: nothing else
    /// keeps the device busy during the wake-up.
    pub fn streaming(&self) -> bool {
        self.in_flight >= 2 && self.large.len() == self.in_flight
    }

    /// Whether a [`Client::wait`] sleeps at once for the next reply instead of spinning:
    /// while this client streams ([`Client::streaming`]) or keeps a deep queue
    /// ([`DEEP_QUEUE_REQUESTS`] or more requests in flight, whatever their size).
    pub fn waits_asleep(&self) -> bool {
        self.streaming() || self.in_flight >= DEEP_QUEUE_REQUESTS
    }

    /// Submits `op` with the caller's `token`; its completion carries the token back.
    ///
    /// With nothing of this client's in flight (nor at its last submit) and the reactor
    /// asleep, the operation may run here and now ([`crate::caller`]: a lookup, a change of
    /// names, a staging write, a short read whose blocks this thread reads beside the
    /// queue); its completion is then ready at the next poll. A program that submits one
    /// read at a time pays no wake-up on either side, as with [`Client::call`].
    pub fn submit(&mut self, op: Op, token: u64) -> Result<(), SubmitError> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped(op));
        }
        if self.in_flight >= self.capacity {
            return Err(SubmitError::Full(op));
        }
        // Only for a program that submits one at a time: one that keeps a queue deep and
        // just drained it would hold the rest of its batch behind a read run here (at
        // queue depth 32, 0.84x the reads per second of sending every one).
        let alone = self.in_flight == 0 && self.submitted_behind == 0;
        self.submitted_behind = self.in_flight;
        if op.is_large_transfer() {
            self.large.push(token);
        }
        if alone {
            let shared = &self.shared;
            if let Some(result) =
                shared
                    .caller
                    .try_run(&op, &mut self.side_io, || shared.doorbell.ring(), None)
            {
                self.ran_here += 1;
                shared.caller_ran(&op);
                self.in_flight += 1;
                self.stash.push_back(Completion { token, result });
                return Ok(());
            }
        }
        let sent = self.send(op, token);
        if sent.is_err() && self.large.last() == Some(&token) {
            self.large.pop();
        }
        sent
    }

    /// Sends `op` to the reactor that owns it (never runs it here), once the caller checked
    /// the client's capacity and the runtime's state.
    fn send(&mut self, op: Op, token: u64) -> Result<(), SubmitError> {
        let request = Request {
            op,
            token,
            reply: self.replies.clone(),
            submitted: Instant::now(),
        };
        let target = &self.router.reactors[self.router.route(&request.op)];
        match target.requests.push(request) {
            Ok(()) => {
                self.in_flight += 1;
                self.sent += 1;
                target.wake_reactor();
                Ok(())
            }
            Err(request) => Err(SubmitError::Full(request.op)),
        }
    }

    /// Moves every available completion into `out`; returns how many.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let before = out.len();
        out.extend(self.stash.drain(..));
        while let Some(c) = self.replies.pop() {
            out.push(c);
        }
        let n = out.len() - before;
        self.in_flight -= n;
        if !self.large.is_empty() {
            for c in &out[before..] {
                if let Some(at) = self.large.iter().position(|&t| t == c.token) {
                    self.large.swap_remove(at);
                }
            }
        }
        n
    }

    /// As [`Client::poll`], sleeping up to `timeout` until at least one completion arrives.
    pub fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        let started = Instant::now();
        let deadline = started + timeout;
        loop {
            let n = self.poll(out);
            let asleep = self.waits_asleep();
            if n > 0 || self.in_flight == 0 || !self.sleep_until_reply(deadline, false, asleep) {
                // A slow wait looks at whether this thread waited for a core, as a slow
                // call does: a program driving the queue itself must not spin beside a
                // neighbour unnoticed.
                if n > 0 {
                    crate::contention::after_call(started.elapsed());
                }
                return n;
            }
        }
    }

    /// Sleeps until the completion queue is not empty (true) or `deadline` passes (false).
    /// `quick`: the awaited operation normally completes without device I/O
    /// ([`Op::is_quick`], or a read the reactor has not sent to the device).
    fn sleep_until_reply(&self, deadline: Instant, quick: bool, asleep: bool) -> bool {
        // A short spin first (replies often come within microseconds), but only while every
        // waiting client can have a core besides the reactor's (see `Shared::waiters`).
        // Otherwise a client waiting for a quick operation yields its core for a while before
        // it sleeps: the clients then take turns on the cores the reactor leaves, and the
        // reactor finds them awake instead of paying a futex wake (an inter-processor
        // interrupt, dear on a virtual machine) for each reply; more clients than spare cores
        // create faster yielding than sleeping (docs/reactors.md). A slow operation
        // (fsync, a read from the device) sleeps at once: yielding through its device wait
        // only takes the cores from clients with work to do.
        let shared = &self.shared;
        let waiting = shared.waiters.fetch_add(1, Ordering::AcqRel) + 1;
        let wait = if asleep {
            Wait::Sleep
        } else {
            wait_policy(
                waiting,
                shared.spinners_max,
                quick,
                crate::contention::contended(),
            )
        };
        let replied = self.replies.wait_for_reply(deadline, wait, &shared.stopped);
        shared.waiters.fetch_sub(1, Ordering::AcqRel);
        replied
    }

    /// Runs one operation and waits for its result (the synchronous API). Completions of
    /// earlier asynchronous submissions that arrive meanwhile are kept for the next poll.
    pub fn call(&mut self, op: Op) -> Result<Reply, EngineError> {
        self.call_into(op, None)
    }

    /// Reads up to `out.len()` bytes of `ino` at `offset` into `out`; returns how many. A
    /// read memory answers in this thread is copied once, from the cache straight into
    /// `out`; one the reactor runs comes back as its bytes, copied here.
    pub fn read_into(
        &mut self,
        ino: u64,
        offset: u64,
        out: &mut [u8],
    ) -> Result<usize, EngineError> {
        let len = out.len();
        match self.call_into(Op::Read { ino, offset, len }, Some(&mut *out))? {
            Reply::Placed(n) if n <= len => Ok(n),
            Reply::Data(d) if d.len() <= len => {
                out[..d.len()].copy_from_slice(&d);
                Ok(d.len())
            }
            other => Err(EngineError::Refused {
                errno: libc::EIO,
                message: format!("unexpected reply to a read {other:?}"),
            }),
        }
    }

    /// [`Client::call`]; a read run in this thread puts its bytes in `into` (see
    /// [`crate::caller::CallerRuns::try_run`]).
    fn call_into(&mut self, op: Op, into: Option<&mut [u8]>) -> Result<Reply, EngineError> {
        if self.in_flight >= self.capacity {
            return Err(EngineError::Invalid(format!(
                "client has {} operations in flight (its capacity): poll them first",
                self.in_flight
            )));
        }
        // With nothing of its own in flight, a lookup memory answers runs here while the
        // reactor sleeps: no wake-up on either side ([`crate::caller`]).
        if self.in_flight == 0 {
            let shared = &self.shared;
            if let Some(result) =
                shared
                    .caller
                    .try_run(&op, &mut self.side_io, || shared.doorbell.ring(), into)
            {
                self.ran_here += 1;
                shared.caller_ran(&op);
                return result;
            }
        }
        let token = self.next_token;
        self.next_token += 1;
        let started = Instant::now();
        let quick = op.waits_awake();
        self.replies.device_wait.store(false, Ordering::Relaxed);
        let mut op = op;
        loop {
            // Sent, not submitted: the run here was tried above, and a completion must come
            // back through the queue this call waits on.
            if self.shared.stopping.load(Ordering::Acquire) {
                return Err(EngineError::ReadOnly("the reactor has stopped".into()));
            }
            match self.send(op, token) {
                Ok(()) => break,
                // The reactor's queue is full: it drains it continuously.
                Err(SubmitError::Full(back)) => {
                    op = back;
                    std::thread::yield_now();
                }
                Err(SubmitError::Stopped(_)) => {
                    return Err(EngineError::ReadOnly("the reactor has stopped".into()))
                }
            }
        }
        loop {
            while let Some(c) = self.replies.pop() {
                if c.token == token {
                    self.in_flight -= 1;
                    // A slow call looks at whether this thread waited for a core.
                    crate::contention::after_call(started.elapsed());
                    return c.result;
                }
                // Another submission's completion: still the caller's to collect.
                self.stash.push_back(c);
            }
            if !self.sleep_until_reply(Instant::now() + Duration::from_secs(1), quick, false)
                && self.shared.stopped.load(Ordering::Acquire)
            {
                return Err(EngineError::ReadOnly("the reactor has stopped".into()));
            }
        }
    }
}
