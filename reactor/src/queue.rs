//! The queue between clients and one reactor: the requests it holds ([`Request`]) and what
//! clients and reactor share besides ([`Shared`]: flags, the doorbell, the waiter count, the
//! published statfs share).
//!
//! # Invariants
//! - Requests are bounded (the request queue's capacity), completions are bounded (each
//!   client's capacity), a batch is bounded (`batch_max`): memory never grows with load.
//! - A submit pushes its request, then fences, then reads `parked`; a parking reactor
//!   stores `parked`, fences, then checks the queue: one of the two sees the other, so no
//!   request waits for a reactor that sleeps through it.

use crate::doorbell::Doorbell;
use crate::op::Op;
use crate::reply::ReplyQueue;
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// One client request: the operation, the client's token for it and where its completion goes.
pub(crate) struct Request {
    pub op: Op,
    pub token: u64,
    pub reply: Arc<ReplyQueue>,
    pub submitted: Instant,
}

pub(crate) struct Shared {
    pub requests: ArrayQueue<Request>,
    pub stopping: AtomicBool,
    pub stopped: AtomicBool,
    /// The reactor is parked (or about to): a submit rings the doorbell only then.
    pub(crate) parked: AtomicBool,
    /// What the reactor sleeps on and wakers ring ([`crate::doorbell`]).
    pub(crate) doorbell: Doorbell,
    /// Clients waiting for a reply right now (spinning or asleep), and how many may wait
    /// spinning: the cores besides the reactor's. A client spins only while the waiters fit
    /// those cores — a lone client spins (a SQLite connection's calls answered in
    /// microseconds); more spinners than spare cores take the CPU the reactor and the other
    /// clients need (docs/reactors.md has the figures).
    pub waiters: std::sync::atomic::AtomicUsize,
    pub spinners_max: usize,
    /// Control messages sent by the coordinator and not yet taken (a parking reactor checks).
    pub control_pending: std::sync::atomic::AtomicUsize,
    /// This reactor's shards' size, free space and inodes, published when it starts, before
    /// each batch's replies and at each tick (statfs with several reactors sums them).
    pub total_blocks: std::sync::atomic::AtomicU64,
    pub free_blocks: std::sync::atomic::AtomicU64,
    pub inodes: std::sync::atomic::AtomicU64,
    /// Where the reactor lends its engine to clients while it sleeps ([`crate::caller`]).
    pub(crate) caller: crate::caller::CallerRuns,
    /// Requests polled from outside the client queue ([`crate::source`]).
    pub(crate) sources: crate::source::Sources,
    /// Test hook ([`Runtime::panic_on_next_request`]): the reactor panics when it next
    /// runs a request.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(crate) panic_next: Arc<AtomicBool>,
}

impl Shared {
    #[cfg(feature = "sim")]
    pub(crate) fn new(queue_capacity: usize) -> Shared {
        Shared::with_reactors(queue_capacity, 1, crate::caller::CallerPolicy::OFF)
    }

    /// The queue of one of `reactors` reactors (clients spin only on the cores they leave);
    /// `callers`: what clients may run themselves while the reactor sleeps
    /// ([`crate::caller`]; one reactor only).
    pub(crate) fn with_reactors(
        queue_capacity: usize,
        reactors: usize,
        callers: crate::caller::CallerPolicy,
    ) -> Shared {
        Shared {
            requests: ArrayQueue::new(queue_capacity.max(1)),
            stopping: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            doorbell: Doorbell::new(),
            waiters: std::sync::atomic::AtomicUsize::new(0),
            spinners_max: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .saturating_sub(reactors),
            control_pending: std::sync::atomic::AtomicUsize::new(0),
            total_blocks: std::sync::atomic::AtomicU64::new(0),
            free_blocks: std::sync::atomic::AtomicU64::new(0),
            inodes: std::sync::atomic::AtomicU64::new(0),
            sources: crate::source::Sources::default(),
            caller: crate::caller::CallerRuns::new(crate::caller::CallerPolicy {
                run: callers.run && reactors == 1,
                ..callers
            }),
            #[cfg(any(test, feature = "test-hooks"))]
            panic_next: Arc::new(AtomicBool::new(false)),
        }
    }

    /// No request waiting: neither in the client queue nor in a source.
    pub(crate) fn no_requests(&self) -> bool {
        self.requests.is_empty() && !crate::source::any_ready(&self.sources)
    }

    /// Publishes that the reactor is about to sleep (or woke): to its clients (`parked`) and
    /// to its sources' clients. The caller fences, then checks [`Shared::no_requests`].
    pub(crate) fn set_parked(&self, parked: bool) {
        self.parked.store(parked, Ordering::SeqCst);
        crate::source::set_parked(&self.sources, parked);
    }

    /// After a client ran `op` on the lent engine: a lookup or change of names
    /// ([`crate::caller::keeps_reactor_polling`]) is counted, so the reactor polls through
    /// the burst it may begin, and wakes the reactor if it is parked, unless the cores are
    /// shared with other work, where a polling reactor takes a core the work needs and each
    /// wake-up would cost a scheduler decision per request.
    pub(crate) fn caller_ran(&self, op: &crate::Op) {
        if !crate::caller::keeps_reactor_polling(op) {
            return;
        }
        self.caller.names_ran.fetch_add(1, Ordering::Relaxed);
        if self.parked.load(Ordering::Relaxed) && !crate::contention::contended() {
            self.doorbell.ring();
        }
    }

    /// Wakes the reactor if it is parked (a submit calls this).
    pub fn wake_reactor(&self) {
        // The request was pushed before this load: fence so the push is visible before
        // `parked` is read (see `ReplyQueue::wake`), or a parking reactor could miss it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.doorbell.ring();
        }
    }
}
