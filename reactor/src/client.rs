//! The client side: a handle any thread uses to submit operations to the reactor and collect
//! their completions.
//!
//! # Invariants
//! - A client never has more than its capacity in flight, so the reactor's push of a
//!   completion into the client's queue (of that capacity) never fails: backpressure is applied
//!   at submit, where the caller can act on it, never at completion.
//! - Submitting and completing take no lock. A client about to sleep publishes its thread and a
//!   waiting flag; the reactor wakes it only then (the slow path takes a mutex).

use crate::multi::Router;
use crate::op::{Completion, Op, Reply};
use crate::runtime::{Request, Shared};
use crossbeam_queue::ArrayQueue;
use engine::EngineError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a waiting client spins on its completion queue when it has a core of its own:
/// longer than a file-backed fsync takes, since waking a sleeping thread costs tens of
/// microseconds on a virtual machine (one client's creates: 90k/s spinning 20 us, 106k/s
/// spinning 300 us; the spin only runs on a core no other waiting client needs).
const SPIN_TIME: Duration = Duration::from_micros(300);
/// How long a client waiting for a quick operation yields its core before it sleeps: longer
/// than a batch of quick operations takes, short against a commit's pause.
const YIELD_TIME: Duration = Duration::from_micros(200);

/// How a client waits for a reply before it sleeps.
#[derive(Clone, Copy)]
enum Wait {
    Spin,
    Yield,
    Sleep,
}

/// A client's completion queue, shared with the reactor.
pub(crate) struct ReplyQueue {
    pub done: ArrayQueue<Completion>,
    waiting: AtomicBool,
    waiter: Mutex<Option<Thread>>,
}

impl ReplyQueue {
    /// Called by the reactor after pushing completions: wakes the client if it sleeps.
    pub fn wake(&self) {
        // The completion was pushed before this load; the client stores `waiting` before it
        // checks the queue. Without a full fence here the push could still sit in this core's
        // store buffer when `waiting` is read as false (x86 reorders a store with a later
        // load), the client would see an empty queue, and sleep out its whole timeout.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) {
            if let Some(thread) = self.waiter.lock().expect("waiter lock").as_ref() {
                thread.unpark();
            }
        }
    }
}

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
}

impl Client {
    pub(crate) fn new(router: Arc<Router>, capacity: usize) -> Client {
        let capacity = capacity.max(1);
        Client {
            shared: router.reactors[0].clone(),
            router,
            replies: Arc::new(ReplyQueue {
                done: ArrayQueue::new(capacity),
                waiting: AtomicBool::new(false),
                waiter: Mutex::new(None),
            }),
            capacity,
            in_flight: 0,
            next_token: 1 << 63,
            stash: VecDeque::new(),
        }
    }

    /// Operations submitted and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Submits `op` with the caller's `token`; its completion carries the token back.
    pub fn submit(&mut self, op: Op, token: u64) -> Result<(), SubmitError> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped(op));
        }
        if self.in_flight >= self.capacity {
            return Err(SubmitError::Full(op));
        }
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
        while let Some(c) = self.replies.done.pop() {
            out.push(c);
        }
        let n = out.len() - before;
        self.in_flight -= n;
        n
    }

    /// As [`Client::poll`], sleeping up to `timeout` until at least one completion arrives.
    pub fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out);
            if n > 0 || self.in_flight == 0 || !self.sleep_until_reply(deadline, false) {
                return n;
            }
        }
    }

    /// Sleeps until the completion queue is not empty (true) or `deadline` passes (false).
    /// `quick`: the awaited operation normally completes without device I/O
    /// ([`Op::is_quick`]).
    fn sleep_until_reply(&self, deadline: Instant, quick: bool) -> bool {
        // A short spin first (replies often come within microseconds), but only while every
        // waiting client can have a core besides the reactor's (see `Shared::waiters`).
        // Otherwise a client waiting for a quick operation yields its core for a while before
        // it sleeps: the clients then take turns on the cores the reactor leaves, and the
        // reactor finds them awake instead of paying a futex wake (an inter-processor
        // interrupt, several microseconds on a virtual machine) for each reply. Creates from
        // four clients on two cores: 67k/s sleeping, 87k/s yielding. A slow operation
        // (fsync, read) sleeps at once: yielding through its device wait only takes the
        // cores from clients with work to do.
        let shared = &self.shared;
        let waiting = shared.waiters.fetch_add(1, Ordering::AcqRel) + 1;
        let wait = if waiting <= shared.spinners_max {
            Wait::Spin
        } else if quick {
            Wait::Yield
        } else {
            Wait::Sleep
        };
        let replied = self.wait_for_reply(deadline, wait);
        shared.waiters.fetch_sub(1, Ordering::AcqRel);
        replied
    }

    fn wait_for_reply(&self, deadline: Instant, wait: Wait) -> bool {
        let until = match wait {
            Wait::Spin => Some(Instant::now() + SPIN_TIME),
            Wait::Yield => Some(Instant::now() + YIELD_TIME),
            Wait::Sleep => None,
        };
        if let Some(until) = until {
            while Instant::now() < until.min(deadline) {
                if !self.replies.done.is_empty() {
                    return true;
                }
                match wait {
                    Wait::Yield => std::thread::yield_now(),
                    _ => std::hint::spin_loop(),
                }
            }
        }
        loop {
            if !self.replies.done.is_empty() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || self.shared.stopped.load(Ordering::Acquire) {
                return !self.replies.done.is_empty();
            }
            *self.replies.waiter.lock().expect("waiter lock") = Some(std::thread::current());
            self.replies.waiting.store(true, Ordering::SeqCst);
            // Pairs with the fence in `ReplyQueue::wake` (store `waiting`, then load the queue).
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.replies.done.is_empty() {
                std::thread::park_timeout((deadline - now).min(Duration::from_millis(100)));
            }
            self.replies.waiting.store(false, Ordering::SeqCst);
        }
    }

    /// Runs one operation and waits for its result (the synchronous API). Completions of
    /// earlier asynchronous submissions that arrive meanwhile are kept for the next poll.
    pub fn call(&mut self, op: Op) -> Result<Reply, EngineError> {
        if self.in_flight >= self.capacity {
            return Err(EngineError::Invalid(format!(
                "client has {} operations in flight (its capacity): poll them first",
                self.in_flight
            )));
        }
        let token = self.next_token;
        self.next_token += 1;
        let quick = op.is_quick();
        let mut op = op;
        loop {
            match self.submit(op, token) {
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
            while let Some(c) = self.replies.done.pop() {
                if c.token == token {
                    self.in_flight -= 1;
                    return c.result;
                }
                // Another submission's completion: still the caller's to collect.
                self.stash.push_back(c);
            }
            if !self.sleep_until_reply(Instant::now() + Duration::from_secs(1), quick)
                && self.shared.stopped.load(Ordering::Acquire)
            {
                return Err(EngineError::ReadOnly("the reactor has stopped".into()));
            }
        }
    }
}
