//! The reactor's loop ([`run`]): take the coordinator's control messages (several
//! reactors), take a batch from the queue and run it, take a commit step; with nothing
//! queued, wait for the device, or idle by the policy ([`IdlePolicy`]).
//!
//! # Invariants
//! - The loop looks at its queue between any two pieces of work (`looked`;
//!   `ReactorStats::loop_gap_ns_max` is the longest it went without looking, and
//!   `loop_gap_on_cpu_ns_max` how much of such a gap the reactor can have spent running).
//! - A reactor sleeps on its doorbell only after publishing `parked` and checking its queue
//!   and its control count again ([`crate::queue`]), so a submit or a control message ends
//!   the sleep. A sleep inside the device wait lasts one slice at most (`LOG_WAIT_SLICE`,
//!   `READ_WAIT_SLICE`). Every sleep is bounded, the idle park by the commit timer.
//! - Busy-poll sleeps on the doorbell only while an fsync waits for a record that outlasted
//!   the durable-spin budget ([`super::durable_spin_budget`] with [`DURABLE_SPIN_MAX`]);
//!   otherwise it yields its core between polls.
//! - A spin-then-park reactor waiting on its device polls (yielding) for a bounded time
//!   before it sleeps: its idle spin, or with an fsync waiting the durable-spin budget
//!   ([`super::durable_spin_budget`], at most `durable_spin_max`).
//! - A reactor does not idle while the commit it is due or waited for has a step to take
//!   ([`Reactor::commit_step_ready`]): the steps are CPU work, one per turn, and a parked
//!   reactor's turns are its timer apart.
//! - The loop ends only once every fsync waiter, parked read and parked request is answered,
//!   or when the runtime fails ([`Ran`]).

use super::{durable_spin_budget, Config, IdlePolicy, Reactor, DURABLE_SPIN_MAX};
use crate::delivery::deliver_failed;
use crate::multi::{Router, ToCoordinator};
use crate::queue::{Request, Shared};
use crate::stats::{Histograms, ReactorStats};
use engine::EngineError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long an idle reactor with I/O in flight sleeps before it looks around again
/// (spin-then-park only; busy-poll never sleeps). On the doorbell ([`crate::doorbell`]) a
/// completion or a request ends the sleep, and this only bounds a missed one. Where the device
/// cannot ring the doorbell the reactor sleeps on its device queue instead: the sleep ends at
/// the first completion, and this bounds how late a new request is noticed while a flush
/// runs. Much shorter slices woke the reactor several times per flush, competing for the
/// cores with the kernel's fsync worker that flush needs (docs/reactors.md has the figures).
const LOG_WAIT_SLICE: Duration = Duration::from_millis(1);

/// How long a busy-polling reactor whose only work in flight is data reads polls for them
/// (yielding between polls) before it blocks on its device queue, and for how long it
/// blocks. Polling is what keeps a read's reply prompt: a request arriving during a blocked
/// wait waits for the next completion or the slice's end, and at queue depth 32 on a file
/// image blocking after 20 µs cost 10–15% of the reads per second (docs/reactors.md). The
/// wait is still there for reads that complete through kernel work on the reactor's own
/// core (an io-wq worker inherits its affinity), which a reactor that only spins and yields
/// once left to the scheduler's tick, a jiffy per read: after 500 µs without a new request
/// the reactor blocks and lets that work run. Reads on a device that answers sooner than
/// that never wait here.
const READ_SPIN: Duration = Duration::from_micros(500);
const READ_WAIT_SLICE: Duration = Duration::from_micros(50);

/// How a reactor idles this turn: its policy, or, while the cores are shared with other work
/// ([`crate::contention`]), parking at once (no spin, no yield: a spinner sharing its core is
/// preempted for whole slices, a sleeper is woken ahead of a CPU hog).
fn idle_now(config: &Config) -> IdlePolicy {
    if crate::contention::contended() {
        IdlePolicy::SpinThenPark {
            spin: Duration::ZERO,
            durable_spin_max: Duration::ZERO,
        }
    } else {
        config.idle
    }
}

/// A busy-polling reactor gives its core away for a moment whenever it has nothing to do.
/// Its core is not its alone: kernel work its own I/O depends on runs there too (a file
/// image's FUA write completes through a kworker on the core that took the interrupt), and
/// the scheduler lets a woken task preempt a running one only when that one's slice is used
/// up — a jiffy later. Spinning without yielding made every append + fdatasync on a file
/// image take a whole jiffy (docs/reactors.md); yielding costs one system call when nothing
/// else wants the core.
fn yield_to_kernel_work() {
    std::thread::yield_now();
}

/// Sleeps on the doorbell for one device-wait slice, the engine lent meanwhile, counting the
/// sleep and whether it ran out (a completion or a request rings it sooner). False when the
/// runtime failed.
fn sleep_for_device(reactor: &mut Reactor, shared: &Shared, router: &Router) -> bool {
    reactor.stats.device_sleeps += 1;
    match lent(reactor, shared, router, || {
        park_for_control(shared, LOG_WAIT_SLICE)
    }) {
        None => false,
        Some(rang) => {
            reactor.stats.device_sleep_timeouts += u64::from(!rang);
            true
        }
    }
}

/// How a reactor's loop ended.
pub(super) enum Ran {
    /// Shut down: every request answered; the final statistics.
    Stopped(Box<(ReactorStats, Histograms)>),
    /// The runtime failed (another thread panicked): serve as a failed reactor.
    Failed,
}

/// The reactor's loop, until shutdown or until the runtime fails; then the fsync groups in
/// flight are waited for.
pub(super) fn run(reactor: &mut Reactor, shared: &Shared, router: &Router, config: &Config) -> Ran {
    let mut batch: Vec<Request> = Vec::with_capacity(config.batch_max);
    // The sources this reactor polls besides its queue ([`crate::source`]).
    let mut polled = crate::source::Polled::default();
    let mut idle_since: Option<Instant> = None;
    // Lookups and changes clients had run on the lent engine when the loop last looked: a
    // change means the filesystem is busy though the reactor ran nothing
    // ([`crate::caller::keeps_reactor_polling`]).
    let mut callers_ran_seen = shared.caller.names_ran.load(Ordering::Relaxed);
    // Since when the loop has been polling a device that had nothing for it.
    let mut device_idle_since: Option<Instant> = None;
    // The last turn spun for an fsync's record ([`durable_spin_budget`]).
    let mut durable_spinning = false;
    // Completions ring the doorbell too: waiting for the device, the reactor sleeps on it and
    // still hears its clients. (A busy-polling reactor sleeps too while its cores are shared
    // with other work: it needs the signal as well.)
    let device_rings = shared
        .doorbell
        .raw_fd()
        .is_some_and(|fd| reactor.fs.signal_completions_to(fd));
    tracing::debug!(device_rings, "reactor doorbell");
    reactor.stats.device_ring_reactors = device_rings as u64;
    loop {
        reactor.looked();
        if router.failure().is_some() {
            return Ran::Failed;
        }
        if reactor.multi.is_some() {
            if reactor.take_control(shared) {
                break;
            }
            if reactor.multi.as_ref().is_some_and(|m| m.away) {
                // Every shard is lent: requests wait until they come back.
                let m = reactor.multi.as_mut().expect("multi");
                while let Some(r) = shared.requests.pop() {
                    m.deferred.push_back(r);
                }
                let _ = park_for_control(shared, Duration::from_millis(1));
                continue;
            }
            let m = reactor.multi.as_mut().expect("multi");
            while batch.len() < config.batch_max {
                match m.deferred.pop_front() {
                    Some(r) => batch.push(r),
                    None => break,
                }
            }
        }
        while batch.len() < config.batch_max {
            match shared.requests.pop() {
                Some(r) => batch.push(r),
                None => break,
            }
        }
        for e in polled.refresh(&shared.sources) {
            let room = config.batch_max.saturating_sub(batch.len());
            if room == 0 {
                break;
            }
            let now = Instant::now();
            e.source.take(room, &mut |op, token| {
                batch.push(Request {
                    op,
                    token,
                    reply: e.reply.clone(),
                    submitted: now,
                })
            });
        }
        if !batch.is_empty() || reactor.meta.has_resumed() {
            if router.failure().is_some() {
                // Checked after taking the requests: a request sent after its client saw the
                // failure (answered by another reactor) is answered with it too, never run.
                for r in batch.drain(..) {
                    reactor.owed.take(&r.reply, r.token, r.submitted);
                }
                return Ran::Failed;
            }
            idle_since = None;
            let batch_started = Instant::now();
            reactor.run_batch(&mut batch);
            reactor.tick();
            reactor.stats.batch_ns += batch_started.elapsed().as_nanos() as u64;
            device_idle_since = None;
            durable_spinning = false;
            continue;
        }
        if reactor.waiting_on_device() {
            // Records or a commit in flight and nothing queued: poll the device (busy-poll),
            // or sleep on it briefly (shared cores) and look at the queue again.
            let spun = device_idle_since.get_or_insert_with(Instant::now).elapsed();
            match idle_now(config) {
                IdlePolicy::BusyPoll => {
                    reactor.poll_durable(None);
                    // An fsync whose record outlasts the durable-spin budget is waited for
                    // asleep on the doorbell, as a spin-then-park reactor waits for it: a
                    // polling core then is a core the device's flush cannot have. On this VM
                    // the host runs the emulated disk on the physical CPUs the virtual ones
                    // use, and a reactor that yielded through every flush had its virtual CPU
                    // taken for whole host slices (fsync-writers-64k p99 8-12 ms, 1.5-1.8 ms
                    // parking; docs/reactors.md). On an isolated core a record seldom runs
                    // past twice its usual time, and then a wake-up is small beside it.
                    let fsync_overdue = device_rings
                        && !reactor.pending.is_empty()
                        && reactor.waiting_on_device()
                        && !reactor.fs.commit_slicing()
                        && spun >= durable_spin_budget(reactor.durable_ns_ewma, DURABLE_SPIN_MAX);
                    if reactor.only_reads_in_flight() && spun >= READ_SPIN {
                        reactor.collect_reads(Some(READ_WAIT_SLICE));
                    } else if fsync_overdue {
                        if !sleep_for_device(reactor, shared, router) {
                            return Ran::Failed;
                        }
                    } else if lent(reactor, shared, router, yield_to_kernel_work).is_none() {
                        // Lent while it yields: an fsync's record takes hundreds of
                        // microseconds on a file image, and eight dbench clients found the
                        // engine held in 92% of their tries, all spent waiting for records.
                        return Ran::Failed;
                    }
                }
                // Take what is done; spin a while (a device read usually completes within
                // it, and a sleep costs a wake-up as long as the read), then sleep until a
                // completion or a request rings.
                IdlePolicy::SpinThenPark {
                    spin,
                    durable_spin_max,
                } if device_rings => {
                    let groups_before = reactor.pending.len();
                    reactor.poll_durable(None);
                    if durable_spinning && reactor.pending.len() < groups_before {
                        reactor.stats.durable_spin_releases += 1;
                    }
                    durable_spinning = false;
                    // A commit with trees left to serialize has CPU work: no sleep.
                    if reactor.waiting_on_device() && !reactor.fs.commit_slicing() {
                        if reactor.only_reads_in_flight() && spun < spin {
                            std::hint::spin_loop();
                            continue;
                        }
                        // Poll, yielding the core (the device's work may complete through
                        // kernel work that needs this one), for as long as an idle reactor
                        // spins (its client's next request usually comes sooner than a
                        // sleeping reactor wakes), and while an fsync waits for a record the
                        // device usually answers sooner than that too.
                        let fsync_waits = !reactor.pending.is_empty();
                        let budget = if fsync_waits {
                            spin.max(durable_spin_budget(
                                reactor.durable_ns_ewma,
                                durable_spin_max,
                            ))
                        } else {
                            spin
                        };
                        if spun < budget {
                            durable_spinning = fsync_waits;
                            if lent(reactor, shared, router, yield_to_kernel_work).is_none() {
                                return Ran::Failed;
                            }
                            continue;
                        }
                        if !sleep_for_device(reactor, shared, router) {
                            return Ran::Failed;
                        }
                    }
                }
                IdlePolicy::SpinThenPark { .. } => reactor.poll_durable(Some(LOG_WAIT_SLICE)),
            }
            continue;
        }
        if !reactor.pending.is_empty() || reactor.fs.commit_in_flight().is_some() {
            // Nothing on the device: take the next step (submit the superblock, release what
            // a finished commit unblocked), or, with several reactors, wait for the
            // coordinator's superblock.
            let before = reactor.pending_groups();
            reactor.poll_durable(None);
            if reactor.pending_groups() == before
                && !reactor.fs.device_busy()
                && !reactor.fs.commit_slicing()
                && idle_now(config) != IdlePolicy::BusyPoll
                && lent(reactor, shared, router, || {
                    park_for_control(shared, LOG_WAIT_SLICE)
                })
                .is_none()
            {
                return Ran::Failed;
            }
            continue;
        }
        if shared.stopping.load(Ordering::Acquire) && shared.requests.is_empty() {
            match reactor.multi.as_mut() {
                None if reactor.commit_waiters.is_empty() && reactor.meta.is_empty() => break,
                None => {
                    reactor.tick();
                    continue;
                }
                Some(m) => {
                    // Drained: the coordinator makes the last commit once every reactor is,
                    // then says Exit.
                    if reactor.commit_waiters.is_empty()
                        && reactor.meta.is_empty()
                        && reactor.fs.commit_in_flight().is_none()
                        && !m.drained_sent
                    {
                        m.drained_sent = true;
                        m.tell(ToCoordinator::Drained(m.index));
                    }
                    let _ = park_for_control(shared, Duration::from_millis(10));
                    continue;
                }
            }
        }
        reactor.tick();
        if reactor.commit_step_ready() {
            // The due commit's next step is CPU work for the next turn: no idling before it.
            idle_since = None;
            continue;
        }
        match idle_now(config) {
            IdlePolicy::BusyPoll => {
                let wait = || idle_wait(shared, IDLE_LEND_MAX, yield_to_kernel_work);
                if lent(reactor, shared, router, wait).is_none() {
                    return Ran::Failed;
                }
            }
            IdlePolicy::SpinThenPark { spin, .. } => {
                // Lookups and changes clients ran themselves count as work: the reactor polls
                // through a burst of them as through a burst of its own, so the burst's next
                // request finds a core awake. A halted core is woken by the next request at a
                // cost on a VM, whichever thread it wakes there: a FUSE session thread woken
                // for each of `cp -a`'s requests on a halted core cost cp a third of its time
                // (docs/reactors.md).
                let callers_ran = shared.caller.names_ran.load(Ordering::Relaxed);
                if callers_ran != callers_ran_seen {
                    callers_ran_seen = callers_ran;
                    idle_since = None;
                }
                let since = *idle_since.get_or_insert_with(Instant::now);
                let spun = since.elapsed();
                if spun < spin && !spin.is_zero() {
                    // Yield, not spin: a client the scheduler put on this core (2 loaded
                    // cores) runs, where a spin at this thread's weight would hold it off.
                    let left = (spin - spun).min(IDLE_LEND_MAX);
                    let wait = || idle_wait(shared, left, std::thread::yield_now);
                    if lent(reactor, shared, router, wait).is_none() {
                        return Ran::Failed;
                    }
                    continue;
                }
                shared.set_parked(true);
                std::sync::atomic::fence(Ordering::SeqCst);
                if shared.no_requests()
                    && shared.control_pending.load(Ordering::SeqCst) == 0
                    && !shared.stopping.load(Ordering::Acquire)
                {
                    reactor.stats.parks += 1;
                    // Wake for the commit timer even when no client comes.
                    let timer = reactor.commit_interval / 4;
                    let sleep = || {
                        shared.doorbell.sleep(
                            timer.clamp(Duration::from_millis(1), Duration::from_millis(500)),
                        )
                    };
                    if lent(reactor, shared, router, sleep).is_none() {
                        shared.set_parked(false);
                        return Ran::Failed;
                    }
                }
                shared.set_parked(false);
            }
        }
    }
    // Every fsync waiter and every read goes before the reactor does.
    while !reactor.pending.is_empty()
        || !reactor.parked_reads.is_empty()
        || !reactor.meta.is_empty()
    {
        // A turn for the commit's steps ([`Reactor::take_commit_step`]); not a look at the
        // queue, which takes no more requests now (the waits below are not gaps).
        reactor.turn += 1;
        if router.failure().is_some() {
            return Ran::Failed;
        }
        reactor.poll_durable(Some(Duration::from_millis(100)));
        if reactor.meta.has_resumed() {
            reactor.run_batch(&mut Vec::new());
        }
    }
    if !reactor.owed.is_empty() {
        // A reply the loop lost track of: answered rather than left to hang its client.
        tracing::error!("reactor stopping with requests unanswered");
        let owed = reactor.owed.take_all();
        deliver_failed(
            owed,
            &EngineError::Internal("the reactor stopped without answering".into()),
        );
    }
    let stats = reactor.snapshot();
    tracing::info!(
        ops = stats.ops,
        cpu_ns_per_op = stats.cpu_ns_per_op() as u64,
        commits = stats.commit.commits,
        log_writes = stats.log.log_writes,
        fallbacks = stats.log.fallback_commits(),
        fsync_p50_us = stats.fsync_total.p50_ns / 1000,
        fsync_p99_us = stats.fsync_total.p99_ns / 1000,
        fsync_queue_wait_p50_us = stats.fsync_queue_wait.p50_ns / 1000,
        fsync_log_write_p50_us = stats.fsync_log_write.p50_ns / 1000,
        fsync_log_write_p99_us = stats.fsync_log_write.p99_ns / 1000,
        // Where the slowest fsync's time went: queued, its record's write and flush, or a
        // fallback commit.
        fsync_max_us = stats.fsync_total.max_ns / 1000,
        fsync_queue_wait_max_us = stats.fsync_queue_wait.max_ns / 1000,
        fsync_log_write_max_us = stats.fsync_log_write.max_ns / 1000,
        fsync_commit_wait_max_us = stats.fsync_commit_wait.max_ns / 1000,
        reply_max_us = stats.reply.max_ns / 1000,
        fsync_groups = stats.fsync_groups,
        fua_records = stats.log.fua_records,
        device_sleeps = stats.device_sleeps,
        durable_spin_releases = stats.durable_spin_releases,
        loop_gap_us_max = stats.loop_gap_ns_max / 1000,
        loop_gap_on_cpu_us_max = stats.loop_gap_on_cpu_ns_max / 1000,
        device_reads = stats.reads.device_reads_done,
        device_read_us_mean =
            stats.reads.device_read_ns_sum / stats.reads.device_reads_done.max(1) / 1000,
        caller_ran = stats.caller_ran,
        caller_missed = stats.caller_missed,
        caller_writes = stats.fetch.lent_writes,
        caller_fsyncs = stats.fetch.lent_fsyncs,
        caller_fsyncs_declined = stats.fetch.lent_fsyncs_declined,
        decoded_hits = stats.decoded_hits,
        decoded_misses = stats.decoded_misses,
        "reactor stopping"
    );
    Ran::Stopped(Box::new((stats, reactor.hist.clone())))
}

/// The longest an idle reactor polls its queue with its engine lent before it takes the
/// engine back for a turn (the commit timer, the device pipeline, its statistics). While lent,
/// a client runs a request itself ([`crate::caller`]); a reactor that went round its loop
/// between polls held the engine most of the time and clients found it taken. Longer lends
/// delay the reactor's own timed work: at 100 µs the kill test's due commits started late
/// enough that its mutation (an fsync acknowledged at its flush's submission) escaped 2 runs
/// in 5 of its 10 kills, none at 10 µs; clients' rates were the same at both (abi-stat 1.26×
/// and 1.27× ext4, abi-open-close 2.45× and 2.32×, within their spread).
const IDLE_LEND_MAX: Duration = Duration::from_micros(10);

/// Polls the queue (pausing between looks with `pause`) until a request, a control message
/// or the stop arrives, or `max` passes. Touches nothing but the queue: the engine may be
/// lent meanwhile.
fn idle_wait(shared: &Shared, max: Duration, pause: impl Fn()) {
    let started = Instant::now();
    loop {
        if !shared.no_requests()
            || shared.control_pending.load(Ordering::Acquire) > 0
            || shared.stopping.load(Ordering::Acquire)
        {
            return;
        }
        pause();
        if started.elapsed() >= max {
            return;
        }
    }
}

/// Runs `wait` (a sleep or a yield) with the reactor's engine lent to its clients
/// ([`crate::caller`]): a client that finds it asleep runs a lookup itself. `None` if a
/// client panicked while it held the engine: the runtime has failed.
fn lent<T>(
    reactor: &mut Reactor,
    shared: &Shared,
    router: &Router,
    wait: impl FnOnce() -> T,
) -> Option<T> {
    let writes_held = reactor.commit_barrier;
    let (out, whole) = shared
        .caller
        .lend_during(&mut reactor.fs, writes_held, wait);
    reactor.stats.caller_ran = shared.caller.ran.load(Ordering::Relaxed);
    reactor.stats.caller_missed = shared.caller.missed.load(Ordering::Relaxed);
    if whole {
        return Some(out);
    }
    router.fail(EngineError::Internal(
        "a client panicked while it ran a request on the reactor's engine".into(),
    ));
    None
}

/// Parks up to `timeout` unless a control message or a request is waiting. True when the
/// doorbell rang.
pub(super) fn park_for_control(shared: &Shared, timeout: Duration) -> bool {
    shared.set_parked(true);
    std::sync::atomic::fence(Ordering::SeqCst);
    let mut rung = true;
    if shared.control_pending.load(Ordering::SeqCst) == 0 && shared.no_requests() {
        rung = shared.doorbell.sleep(timeout);
    }
    shared.set_parked(false);
    rung
}

impl Reactor {
    /// A pinned reactor spreads over the process's cores while its own core is shared with
    /// other work (it waited for it itself: where only its clients wait, its core is still
    /// its own and moving to theirs would crowd them), and goes back when that ends
    /// ([`super::Pinned`]). The kernel's workers for its queue, kept off the reactors' cores,
    /// may use every core while the process is contended ([`super::place_blocking_work`]).
    fn adapt_affinity(&mut self, now: Instant) {
        let Some(p) = self.pinned.as_mut() else {
            return;
        };
        let workers_wide = crate::contention::contended();
        if !p.quiet_workers.is_empty() && workers_wide != p.workers_wide {
            let cores = if workers_wide {
                &p.wide
            } else {
                &p.quiet_workers
            };
            match self.fs.run_blocking_work_on(cores) {
                Ok(true) => p.workers_wide = workers_wide,
                Ok(false) => p.quiet_workers.clear(),
                Err(e) => {
                    // The queue failed: its next I/O reports it.
                    tracing::warn!("placing the kernel's workers: {e}");
                    p.quiet_workers.clear();
                }
            }
        }
        let contended = self.run_delay.own_contended(now);
        if contended == p.widened {
            return;
        }
        let set = if contended {
            crate::affinity::set_current_thread_cores(&p.wide)
        } else {
            crate::affinity::pin_current_thread(p.core)
        };
        match set {
            Ok(()) => {
                p.widened = contended;
                tracing::debug!(core = p.core, widened = contended, "reactor affinity");
            }
            Err(e) => {
                tracing::warn!("{e}; the reactor stays where it is");
                self.pinned = None;
            }
        }
    }

    /// Work waiting on the device or on a commit: fsync groups whose records are not
    /// durable, a commit in flight, replies waiting for one.
    pub(crate) fn pending_groups(&self) -> usize {
        self.pending.len()
            + self.fs.commit_in_flight().is_some() as usize
            + self.commit_waiters.len()
    }

    /// Something waits for the device: background writes or flushes in flight (records,
    /// this reactor's commit).
    fn waiting_on_device(&self) -> bool {
        self.fs.device_busy() || self.reads_outstanding()
    }

    /// Notes that the loop looks at its queues now: the longest gap between two looks is the
    /// longest any request waited for the reactor's attention.
    pub(crate) fn looked(&mut self) {
        self.turn += 1;
        let now = Instant::now();
        self.run_delay.check(now);
        self.adapt_affinity(now);
        self.gaps.look(now, crate::stats::thread_cpu_ns);
        self.stats.loop_gap_ns_max = self.gaps.gap_ns_max;
        self.stats.loop_gap_on_cpu_ns_max = self.gaps.on_cpu_ns_max;
    }
}
