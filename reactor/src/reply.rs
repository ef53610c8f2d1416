//! A client's completion queue ([`ReplyQueue`]) and how a client waits on it.
//!
//! # Invariants
//! - A client never has more than its capacity in flight, so the reactor's push of a
//!   completion into the client's queue (of that capacity) never fails: backpressure is applied
//!   at submit, where the caller can act on it, never at completion.
//! - Submitting, completing and waking take no lock. A client about to sleep stores 1 in its
//!   futex word ([`ReplyQueue::sleeping`]), then checks its queue, then sleeps on the word;
//!   the reactor pushes, then swaps the word to 0 and wakes only if it was 1 (see
//!   [`ReplyQueue::wake`]): no lost wake-up, and at most one wake system call per sleep
//!   however many completions (or reactors) come.
//! - A waiting client never spins on a core without handing it on now and then: with more
//!   threads than cores (clients and the reactor on 2 cores) a spinner may share its core
//!   with the reactor it waits for, and a pure spin would hold that core for a time slice.
//!
//! # How a client waits (see `Client::sleep_until_reply`)
//! - While every waiting client can have a core besides the reactors' it spins, yielding every
//!   [`SPIN_PASSES_PER_YIELD`] passes.
//! - Otherwise, for an operation that normally needs no device I/O, it yields its core (the
//!   clients take turns on the cores the reactor leaves, and the reactor, finding them awake,
//!   pays no wake-up per reply); a read counts as one until the reactor says it went to the
//!   device ([`ReplyQueue::device_wait`]): a cached read is answered within the batch.
//! - Otherwise, or after the yield time, it sleeps on its futex word.
//! - A client waiting with a deep queue ([`DEEP_QUEUE_REQUESTS`] in flight) or a stream of
//!   large transfers sleeps at once, whatever the cores: the device stays busy with its other
//!   requests while the reactor wakes it.

use crate::op::Completion;
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiting client spins on its completion queue when it has a core of its own:
/// longer than a file-backed fsync takes, since waking a sleeping thread is dear on a virtual
/// machine (docs/reactors.md has the figures). The spin only runs on a core no other waiting
/// client needs.
const SPIN_TIME: Duration = Duration::from_micros(300);
/// How many requests a client has in flight before its waits sleep at once instead of
/// spinning ([`crate::Client::waits_asleep`]). With that many on their way, replies come
/// microseconds apart and the device has the rest to work on while the reactor wakes the
/// client, so a spin saves nothing; and it costs the device: on a virtual machine the host
/// runs the emulated disk on the physical CPUs the virtual ones use, and a spinning vCPU
/// keeps it from there (fio's random reads at queue depth 32 on core 1 did 138-155k/s
/// alone and 100-105k/s beside a CPU-bound loop on core 0). Random 4 KiB reads of a file
/// image at queue depth 32 (this 2-core VM, 3 pairs): 78-84k/s spinning, 92-105k/s
/// sleeping; the engine's device read 209-231 µs → 147-167 µs, and the p99.9 of 26-27 ms
/// (both vCPUs busy, the host took one for whole slices) 3-10 ms. At queue depth 16 and 8
/// sleeping changed nothing beyond the noise; from 2 requests on it cost a fifth of the reads
/// at queue depth 2 (the wake-up is then on the path of half the device's work).
pub const DEEP_QUEUE_REQUESTS: usize = 16;

/// How long a client waiting for a quick operation yields its core before it sleeps: longer
/// than a batch of quick operations takes, short against a commit's pause.
const YIELD_TIME: Duration = Duration::from_micros(200);
/// Spin passes (a queue check and a pause each) between two yields of a spinning client. The
/// scheduler does not know the client waits for the reactor: on loaded cores it may put both
/// on one for long stretches, where a pure spin holds the reactor off until the spinner's
/// slice ends. A yield every few microseconds hands it the core, and costs one system call
/// that returns at once when nothing else is runnable (docs/reactors.md has the figures).
const SPIN_PASSES_PER_YIELD: u32 = 32;
/// Passes of a waiting loop between two reads of the clock: a clock read costs as much as a
/// dozen spin passes, and a deadline late by a few passes does not matter.
const SPIN_PASSES_PER_CLOCK: u32 = 64;
const YIELD_PASSES_PER_CLOCK: u32 = 4;

/// How a client waits: while the cores are shared with other work (`contended`,
/// [`crate::contention`]) it sleeps at once; otherwise it spins while the waiting clients
/// (`waiting`, this one included) fit the cores the reactors leave (`spinners_max`), else
/// yields for a quick operation, else sleeps.
pub fn wait_policy(waiting: usize, spinners_max: usize, quick: bool, contended: bool) -> Wait {
    if contended {
        Wait::Sleep
    } else if waiting <= spinners_max {
        Wait::Spin
    } else if quick {
        Wait::Yield
    } else {
        Wait::Sleep
    }
}

/// How a client waits for a reply before it sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Spin,
    Yield,
    Sleep,
}

/// Where the completions of requests from a source ([`crate::source`]) go, instead of a
/// client's queue.
pub trait CompletionSink: Send + Sync {
    /// One request's outcome, from the reactor thread after its batch.
    fn complete(&self, completion: Completion);
}

/// A client's completion queue, shared with the reactor.
pub(crate) struct ReplyQueue {
    /// Bounded by the client's capacity: a client never has more in flight.
    done: ArrayQueue<Completion>,
    /// Completions that found `done` full. Empty unless an accounting slip let a client
    /// have more in flight than its capacity: they wait here (the reactor never blocks and
    /// never panics for it) and the client takes them after `done`'s, in order.
    overflow: std::sync::Mutex<std::collections::VecDeque<Completion>>,
    /// `overflow` holds completions (set under its lock): only then is it locked.
    overflowed: AtomicBool,
    /// The futex word: 1 while the client sleeps (or is about to) on it, else 0.
    sleeping: AtomicU32,
    /// Set by the reactor when a read of this client's went to the device (its reply is a
    /// device round trip away): a client yielding for it sleeps instead. A hint, cleared by
    /// the client when it next submits; it never delays a reply.
    pub(crate) device_wait: AtomicBool,
    /// Where completions go instead of `done` ([`crate::source`]): a sink that answers them
    /// itself (a storage service's ring), waking its own waiters.
    sink: Option<std::sync::Arc<dyn CompletionSink>>,
}

impl ReplyQueue {
    /// A queue whose completions go to `sink` as they come.
    pub(crate) fn with_sink(sink: std::sync::Arc<dyn CompletionSink>) -> ReplyQueue {
        let mut queue = ReplyQueue::new(1);
        queue.sink = Some(sink);
        queue
    }

    pub fn new(capacity: usize) -> ReplyQueue {
        ReplyQueue {
            done: ArrayQueue::new(capacity.max(1)),
            overflow: std::sync::Mutex::new(std::collections::VecDeque::new()),
            overflowed: AtomicBool::new(false),
            sleeping: AtomicU32::new(0),
            device_wait: AtomicBool::new(false),
            sink: None,
        }
    }

    fn overflow(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<Completion>> {
        self.overflow.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a completion (the reactor, before [`ReplyQueue::wake`]). Never fails: past the
    /// capacity it waits in the overflow, logged, since only a bug gets there.
    pub fn push(&self, completion: Completion) {
        if let Some(sink) = &self.sink {
            sink.complete(completion);
            return;
        }
        if !self.overflowed.load(Ordering::Acquire) {
            match self.done.push(completion) {
                Ok(()) => return,
                Err(back) => {
                    tracing::error!(
                        token = back.token,
                        "a client's completion queue is full: it has more in flight than its \
                         capacity (a bug); the completion waits in its overflow"
                    );
                    let mut overflow = self.overflow();
                    overflow.push_back(back);
                    self.overflowed.store(true, Ordering::Release);
                    return;
                }
            }
        }
        // Behind what overflowed already, in order.
        let mut overflow = self.overflow();
        overflow.push_back(completion);
        self.overflowed.store(true, Ordering::Release);
    }

    /// The oldest completion, if any.
    pub fn pop(&self) -> Option<Completion> {
        if let Some(c) = self.done.pop() {
            return Some(c);
        }
        if !self.overflowed.load(Ordering::Acquire) {
            return None;
        }
        let mut overflow = self.overflow();
        let c = overflow.pop_front();
        if overflow.is_empty() {
            self.overflowed.store(false, Ordering::Release);
        }
        c
    }

    /// True when no completion is queued.
    pub fn is_empty(&self) -> bool {
        self.done.is_empty() && !self.overflowed.load(Ordering::Acquire)
    }

    /// Called by the reactor after pushing completions: wakes the client if it sleeps.
    pub fn wake(&self) {
        if self.sink.is_some() {
            return; // the sink woke its waiter with each completion
        }
        // The completion was pushed before this load; the client stores `sleeping` before it
        // checks the queue. Without a full fence here the push could still sit in this core's
        // store buffer when `sleeping` is read as 0 (x86 reorders a store with a later load),
        // the client would see an empty queue, and sleep out its whole timeout.
        std::sync::atomic::fence(Ordering::SeqCst);
        // The load first: a client that is not asleep (spinning, yielding, running) costs
        // one shared read, no write to its line. The swap makes one waker of many call wake.
        if self.sleeping.load(Ordering::SeqCst) == 1 && self.sleeping.swap(0, Ordering::SeqCst) == 1
        {
            futex_wake(&self.sleeping);
        }
    }

    /// Marks this client's pending read as gone to the device (see [`ReplyQueue::device_wait`]).
    pub fn note_device_wait(&self) {
        self.device_wait.store(true, Ordering::Relaxed);
    }

    /// Sleeps until woken or `timeout`, unless a completion is already queued. The caller
    /// loops: a return says nothing about the queue.
    fn sleep(&self, timeout: Duration) {
        self.sleeping.store(1, Ordering::SeqCst);
        // Pairs with the fence in `wake` (store `sleeping`, then load the queue).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.is_empty() {
            futex_wait(&self.sleeping, 1, timeout);
        }
        self.sleeping.store(0, Ordering::SeqCst);
    }

    /// Waits as `wait` says, then sleeps, until the queue is not empty (true), `deadline`
    /// passes or `stopped` is set (false, unless a completion came meanwhile).
    pub(crate) fn wait_for_reply(
        &self,
        deadline: Instant,
        wait: Wait,
        stopped: &AtomicBool,
    ) -> bool {
        let replies = self;
        if wait_awake(
            wait,
            deadline,
            || !replies.is_empty(),
            // The reactor sent the read to the device: a round trip to sleep through, not
            // to yield through.
            || replies.device_wait.load(Ordering::Relaxed),
            // A slow yield changes nothing here (in process, contention is the reactor's
            // and the clients' shared state: `crate::contention`).
            || false,
        ) {
            return true;
        }
        loop {
            if !replies.is_empty() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || stopped.load(Ordering::Acquire) {
                return !replies.is_empty();
            }
            replies.sleep((deadline - now).min(Duration::from_millis(100)));
        }
    }
}

/// A yield that kept the waiter off its core longer than this may have handed it to another
/// process's thread for a slice (0.75-4 ms here); a sibling waiter taking its turn runs for
/// microseconds (though a sibling with work may run longer).
pub const YIELD_SLOW: Duration = Duration::from_micros(250);

/// The part of a wait before the waiter sleeps, as `wait` says: spin (handing the core on
/// every [`SPIN_PASSES_PER_YIELD`] passes) for [`SPIN_TIME`], or yield for [`YIELD_TIME`]
/// until `gone_to_device` says the answer is a device round trip away, or nothing. True once
/// `ready`; false when the caller should sleep. After a yield slower than [`YIELD_SLOW`]
/// (another process may have had the core) `slow_yield` says whether to stop waiting awake.
/// In-process clients and a storage service's clients wait through this one loop while no
/// neighbour is about (they diverged once: a service client that spun without yielding,
/// reading the clock at every pass, kept the sibling threads it shared a core with from
/// submitting, and slept where an in-process one would yield: dbench through the service
/// did 73-87k ops/s, with this loop 92-107k).
pub fn wait_awake(
    wait: Wait,
    deadline: Instant,
    ready: impl Fn() -> bool,
    gone_to_device: impl Fn() -> bool,
    slow_yield: impl Fn() -> bool,
) -> bool {
    let (until, passes_per_clock) = match wait {
        Wait::Spin => (Instant::now() + SPIN_TIME, SPIN_PASSES_PER_CLOCK),
        Wait::Yield => (Instant::now() + YIELD_TIME, YIELD_PASSES_PER_CLOCK),
        Wait::Sleep => return ready(),
    };
    let until = until.min(deadline);
    let mut pass = 0u32;
    // Yields the core; false when waiting awake should stop.
    let yield_quickly = || {
        let before = Instant::now();
        std::thread::yield_now();
        !(before.elapsed() > YIELD_SLOW && slow_yield())
    };
    loop {
        if ready() {
            return true;
        }
        pass = pass.wrapping_add(1);
        if pass % passes_per_clock == 0 && Instant::now() >= until {
            return false;
        }
        match wait {
            Wait::Yield => {
                if gone_to_device() || !yield_quickly() {
                    return ready();
                }
            }
            _ if pass % SPIN_PASSES_PER_YIELD == 0 => {
                if !yield_quickly() {
                    return ready();
                }
            }
            _ => std::hint::spin_loop(),
        }
    }
}

/// Sleeps while `word` holds `expected`, up to `timeout` (or until a wake, or a signal).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the futex word is a live, aligned u32 for the call; the timespec too. A private
    // futex: only this process's threads use the word. Errors (EAGAIN: the word changed,
    // EINTR, ETIMEDOUT) all mean "look again", which the caller does.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes one thread sleeping on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: the futex word is a live, aligned u32; FUTEX_WAKE reads nothing else.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Reply;
    use std::sync::Arc;

    /// A waiter yielding on a core where another thread spins hands it slices: `wait_awake`
    /// sees the slow yield and asks whether to stop; told to, it returns (not ready).
    #[test]
    fn a_slow_yield_is_reported() {
        let hog = crate::affinity::CoreHog::beside_me();
        let asked = AtomicU32::new(0);
        for _ in 0..200 {
            let ready = wait_awake(
                Wait::Yield,
                Instant::now() + Duration::from_millis(50),
                || false,
                || false,
                || {
                    asked.fetch_add(1, Ordering::Relaxed);
                    true
                },
            );
            assert!(!ready, "nothing was ever ready");
            if asked.load(Ordering::Relaxed) > 0 {
                break;
            }
        }
        drop(hog);
        assert!(
            asked.load(Ordering::Relaxed) > 0,
            "200 waits yielding beside a spinner on one core never saw a slow yield"
        );
    }

    fn completion(token: u64) -> Completion {
        Completion {
            token,
            result: Ok(Reply::Done),
        }
    }

    #[test]
    fn the_policy_spins_only_while_the_waiters_fit_the_cores_left() {
        assert_eq!(wait_policy(1, 1, false, false), Wait::Spin);
        assert_eq!(wait_policy(2, 1, true, false), Wait::Yield);
        assert_eq!(wait_policy(2, 1, false, false), Wait::Sleep);
        assert_eq!(wait_policy(1, 0, true, false), Wait::Yield);
        assert_eq!(wait_policy(3, 3, false, false), Wait::Spin);
        // Cores shared with other work: sleep at once, whatever else holds.
        assert_eq!(wait_policy(1, 1, false, true), Wait::Sleep);
        assert_eq!(wait_policy(2, 1, true, true), Wait::Sleep);
    }

    /// A sleeper and a waker race many times, each round's push landing anywhere in the
    /// sleeper's check/publish/check/sleep sequence. A lost wake-up leaves the sleeper in the
    /// futex until its slice ends (100 ms, `wait_for_reply`): a round that took that long is
    /// counted as lost. (Removing the queue check before the futex wait lost 3 rounds in a run.)
    #[test]
    fn no_wake_up_is_lost_when_the_push_races_the_sleep() {
        const ROUNDS: u64 = 20_000;
        let timeout = Duration::from_secs(10);
        let slice = Duration::from_millis(100);
        let queue = Arc::new(ReplyQueue::new(1));
        let stopped = Arc::new(AtomicBool::new(false));
        let sleeper = {
            let (queue, stopped) = (queue.clone(), stopped.clone());
            std::thread::spawn(move || {
                let mut lost = 0u64;
                for round in 0..ROUNDS {
                    let started = Instant::now();
                    // Sleep at once (no spin): the race is with the futex itself.
                    assert!(queue.wait_for_reply(started + timeout, Wait::Sleep, &stopped));
                    if started.elapsed() >= slice {
                        lost += 1;
                    }
                    let c = queue.pop().expect("a completion after a true wait");
                    assert_eq!(c.token, round);
                }
                lost
            })
        };
        for round in 0..ROUNDS {
            // Wait until the sleeper took the last one (queue of one), then vary the moment
            // of the push against its publish and check.
            while !queue.is_empty() {
                std::hint::spin_loop();
            }
            for _ in 0..(round % 64) {
                std::hint::spin_loop();
            }
            queue.push(completion(round));
            queue.wake();
        }
        let lost = sleeper.join().expect("sleeper");
        assert_eq!(
            lost, 0,
            "rounds that waited out the timeout (lost wake-ups)"
        );
    }

    /// One waker's swap clears the word, so two reactors answering the same sleeping client
    /// make one wake call between them, and the word is 0 after either.
    #[test]
    fn a_wake_clears_the_sleeping_word_once() {
        let queue = ReplyQueue::new(2);
        queue.sleeping.store(1, Ordering::SeqCst);
        queue.push(completion(1));
        queue.wake();
        assert_eq!(queue.sleeping.load(Ordering::SeqCst), 0);
        // A second wake finds no sleeper and changes nothing.
        queue.wake();
        assert_eq!(queue.sleeping.load(Ordering::SeqCst), 0);
    }

    /// More completions than the queue's capacity (an accounting slip) neither panic nor
    /// get lost: they wait in the overflow and come out after the others, in order, and
    /// the queue reads empty only once all are taken.
    #[test]
    fn completions_past_the_capacity_wait_in_order_and_nothing_panics() {
        let queue = ReplyQueue::new(2);
        for token in 0..5 {
            queue.push(completion(token));
        }
        assert!(!queue.is_empty());
        assert_eq!(queue.pop().map(|c| c.token), Some(0));
        // Room again in the bounded part, but what overflowed stays ahead of a new one.
        queue.push(completion(5));
        let tokens: Vec<u64> = std::iter::from_fn(|| queue.pop().map(|c| c.token)).collect();
        assert_eq!(tokens, vec![1, 2, 3, 4, 5]);
        assert!(queue.is_empty());
        queue.push(completion(6));
        assert_eq!(queue.pop().map(|c| c.token), Some(6));
        assert!(queue.is_empty());
    }

    /// A reply already queued ends a sleep at once, whatever the wait.
    #[test]
    fn a_queued_reply_ends_every_wait_at_once() {
        let stopped = AtomicBool::new(false);
        for wait in [Wait::Spin, Wait::Yield, Wait::Sleep] {
            let queue = ReplyQueue::new(1);
            queue.push(completion(7));
            let deadline = Instant::now() + Duration::from_secs(30);
            assert!(queue.wait_for_reply(deadline, wait, &stopped), "{wait:?}");
            assert_eq!(queue.sleeping.load(Ordering::SeqCst), 0);
        }
    }
}
