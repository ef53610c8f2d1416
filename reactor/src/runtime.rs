//! The reactor: one pinned thread that owns the engine (every shard) and its device queue,
//! drains client requests from a bounded lock-free queue in batches, runs them, groups the
//! batch's fsyncs into one log record and one flush, commits when the engine says a commit is
//! due, and idles by busy-polling or by spinning then parking.
//!
//! # Invariants
//! - Only the reactor thread touches the engine and the device queue (the io_uring rings are
//!   single-issuer: the reactor opens and mounts the device itself).
//! - Requests are bounded (the request queue's capacity), completions are bounded (each
//!   client's capacity), a batch is bounded (`batch_max`): memory never grows with load.
//! - Operations run in queue order. An fsync completes only after the group holding it is
//!   durable (its record and data flushed, or its fallback commit at SuperCommitted); every
//!   operation queued before it is covered. A group's record is written in the background
//!   while later batches run; groups complete in the order they started (a later record's
//!   flush finishing first releases nobody early), so at most 64 records are in flight.
//! - Completions are pushed after the batch has run and clients are woken after that: nothing
//!   runs inline while the engine is mid-operation.
//!
//! Fault model: an engine error fails the operations it hits and, for device errors and
//! failed commits, makes the filesystem fail-stop (every later change returns ReadOnly); the
//! reactor keeps serving reads and stats. Shutdown commits and unmounts.
//!
//! A panic (a bug: a broken invariant in memory) never leaves a reactor thread. Each runs
//! its loop under `catch_unwind`; one that panics logs the message (`tracing::error!`) and
//! fails the whole runtime ([`Router::fail`]) with [`EngineError::Internal`] (EIO). Every
//! reactor then becomes a *failed reactor*: it answers every request it owes (the batch it
//! was running, fsync and commit waiters: [`crate::owed`]), every request queued and every
//! later one with that error, commits nothing more, and exits when shut down; shutdown
//! returns the error. The whole runtime fails, not only the reactor that panicked, because
//! no later change could become durable (a commit needs every reactor's half, and a span
//! every reactor's shards) and the panic may have left shards lent or half changed; the
//! filesystem is fail-stop: its durable generation and acknowledged fsyncs (in the logs)
//! are intact for the next mount, as after a device error.

use crate::client::{Client, ReplyQueue};
use crate::delivery::{deliver, deliver_failed};
use crate::execute::execute_on;
use crate::meta_wait::{MetaWaits, Probed};
use crate::multi::{Control, Coordinator, Member, Plan, Router, ToCoordinator};
use crate::op::{Completion, Op, Reply};
use crate::owed::Owed;
use crate::queue::{Request, Shared};
use crate::stats::{thread_cpu_ns, Histograms, ReactorStats};
use engine::log::FsyncStart;
use engine::partition::{Lent, PartitionTemplate};
use engine::{Deferred, EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::BlockDevice;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle reactor with I/O in flight sleeps before it looks around again
/// (spin-then-park only; busy-poll never sleeps). On the doorbell ([`crate::doorbell`]) a
/// completion or a request ends the sleep, and this only bounds a missed one. Where the device
/// cannot ring the doorbell the reactor sleeps on its device queue instead: the sleep ends at
/// the first completion, and this bounds how late a new request is noticed while a flush
/// runs. 50 µs slices made the reactor wake ~4 times per flush and compete with the
/// kernel's fsync worker on 2 cores: SQLite WAL fell from 2,680 to 900–1,450 tx/s; with 1 ms
/// it is 2,930 and 16 fsync clients did not lose (30k fsyncs/s).
const LOG_WAIT_SLICE: Duration = Duration::from_millis(1);

/// Loop turns a due commit spends inserting delayed index items before it starts anyway
/// ([`engine::Filesystem::commit_prepare`]).
const PREPARE_STEPS_MAX: u32 = 64;

/// How long a busy-polling reactor whose only work in flight is data reads polls for them
/// before it blocks on its device queue, and for how long it blocks. A file image's reads
/// complete through kernel work on the reactor's own core (an io-wq worker inherits its
/// affinity): a reactor that only spins and yields left them waiting for the scheduler's
/// tick (4 ms per read at QD32). Blocking in the device wait lets that work run at once;
/// 50 µs bounds how late a request arriving meanwhile is seen.
const READ_SPIN: Duration = Duration::from_micros(20);
const READ_WAIT_SLICE: Duration = Duration::from_micros(50);

/// What the reactor does when it has nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Poll without pause: lowest latency, one core at 100% (dedicated storage cores).
    BusyPoll,
    /// Poll for `spin`, then park until a client submits or a commit is due (shared cores:
    /// an idle reactor uses about no CPU).
    SpinThenPark { spin: Duration },
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy::SpinThenPark {
            spin: Duration::from_micros(50),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Device string (`nvme:/dev/ng0n1`, `file:/srv/fs.img,size=1GiB`, `mem:256MiB`).
    pub device: String,
    /// Format the device first.
    pub mkfs: Option<MkfsOptions>,
    pub mount: MountOptions,
    /// Pin the reactor to this core (None: not pinned). With several reactors, `cores` wins.
    pub core: Option<usize>,
    /// Reactors: each holds the shards `s` with `s % reactors == its index`, on a device
    /// queue of its own, and a coordinator thread runs the commits (1, the default: one
    /// reactor holds every shard and commits itself). At most the shard count. 0: one per core
    /// the process may use (capped at the shard count) — for dedicated storage cores; on
    /// cores shared with the clients, one reactor serves better (docs/reactors.md).
    pub reactors: usize,
    /// Pin reactor `i` to `cores[i % cores.len()]` (empty: `core`, or not pinned).
    pub cores: Vec<usize>,
    pub idle: IdlePolicy,
    /// Requests the queue holds before submit reports Full.
    pub queue_capacity: usize,
    /// Requests run per batch (and so the most fsyncs one record groups).
    pub batch_max: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: "mem:256MiB".into(),
            mkfs: None,
            mount: MountOptions::default(),
            core: None,
            reactors: 1,
            cores: Vec::new(),
            idle: IdlePolicy::default(),
            queue_capacity: 4096,
            batch_max: 256,
        }
    }
}

/// What a stopped runtime hands back: its final statistics and the unmounted device.
type Stopped = (ReactorStats, Box<dyn BlockDevice>);

/// What a reactor thread ends with.
struct ReactorExit {
    stats: ReactorStats,
    hist: Histograms,
    dev: Box<dyn BlockDevice>,
}

type CoordinatorExit = (engine::CommitStats, Box<dyn BlockDevice>);

/// Running reactors (and their coordinator, with several). Dropping it without
/// [`Runtime::shutdown`] also shuts down.
pub struct Runtime {
    router: Arc<Router>,
    threads: Vec<JoinHandle<Result<ReactorExit, EngineError>>>,
    coordinator: Option<JoinHandle<Result<CoordinatorExit, EngineError>>>,
}

/// Sets every reactor's `stopped` flag when a reactor thread ends (even by panicking), so
/// waiting clients return instead of hanging.
struct MarkStopped(Arc<Router>);
impl Drop for MarkStopped {
    fn drop(&mut self) {
        for r in &self.0.reactors {
            r.stopped.store(true, Ordering::Release);
        }
    }
}

/// Raises the calling reactor thread's scheduling weight (nice -10) when allowed. On cores
/// shared with many client threads, a woken reactor otherwise waits behind them for a time
/// slice while every client waits for it.
fn raise_priority() {
    // SAFETY: gettid and setpriority take no pointers.
    let rc = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, -10)
    };
    if rc != 0 {
        tracing::debug!(
            "reactor priority not raised ({}): needs CAP_SYS_NICE or RLIMIT_NICE",
            std::io::Error::last_os_error()
        );
    }
}

fn pin(core: Option<usize>) {
    raise_priority();
    if let Some(core) = core {
        // Checked when the runtime started: this fails only if the allowed set changed.
        if let Err(e) = crate::affinity::pin_current_thread(core) {
            tracing::warn!(core, "{e}; the reactor runs unpinned");
        }
    }
}

/// What a reactor thread does once its engine is mounted: the loop, under `catch_unwind`;
/// after a panic (its own, or another thread's that failed the runtime), the failed
/// reactor's service ([`serve_failed`]). Never unwinds.
fn serve(
    mut reactor: Reactor,
    shared: &Shared,
    router: &Router,
    config: &Config,
    index: usize,
) -> Result<ReactorExit, EngineError> {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        reactor.panic_next = shared.panic_next.clone();
    }
    let ran = catch_unwind(AssertUnwindSafe(|| {
        run(&mut reactor, shared, router, config)
    }));
    match ran {
        Ok(Ran::Stopped(exit)) => {
            let (stats, hist) = *exit;
            let multi = reactor.multi.is_some();
            let unmounted = catch_unwind(AssertUnwindSafe(move || {
                if multi {
                    // The coordinator made the last commit; this queue only goes away.
                    Ok(reactor.fs.into_device())
                } else {
                    reactor.fs.unmount()
                }
            }));
            match unmounted {
                Ok(Ok(dev)) => Ok(ReactorExit { stats, hist, dev }),
                Ok(Err(e)) => Err(e),
                Err(panic) => Err(panicked(router, index, &*panic)),
            }
        }
        Ok(Ran::Failed) => serve_failed(reactor, shared, router),
        Err(panic) => {
            panicked(router, index, &*panic);
            serve_failed(reactor, shared, router)
        }
    }
}

/// Logs reactor `index`'s panic and fails the runtime with it; returns the runtime's
/// failure (the first one, if another thread failed it first).
fn panicked(router: &Router, index: usize, panic: &(dyn std::any::Any + Send)) -> EngineError {
    let why = crate::panic_message(panic);
    tracing::error!(reactor = index, "reactor {index} panicked: {why}");
    router.fail(EngineError::Internal(format!(
        "reactor {index} panicked: {why}"
    )))
}

/// The failed reactor: answers what it owes, what is queued and what comes later with the
/// runtime's failure until it is shut down; then drops its engine (committing nothing) and
/// returns the failure. The engine may be half-changed, so none of its code runs again: the
/// device's own drop lets the I/O in flight finish (bounded) before its buffers go.
fn serve_failed(
    mut reactor: Reactor,
    shared: &Shared,
    router: &Router,
) -> Result<ReactorExit, EngineError> {
    let failure = router
        .failure()
        .cloned()
        .expect("a failed reactor's runtime has failed");
    // The ledger holds the requests of the batch that was running and of the fsync groups
    // and commit waiters; the deferred ones (shards lent) never reached a batch.
    let mut owed = reactor.owed.take_all();
    reactor.pending.clear();
    reactor.commit_waiters.clear();
    if let Some(m) = reactor.multi.as_mut() {
        owed.extend(m.deferred.drain(..).map(|r| (r.reply, r.token)));
    }
    deliver_failed(owed, &failure);
    loop {
        let mut queued = Vec::new();
        while let Some(r) = shared.requests.pop() {
            queued.push((r.reply, r.token));
        }
        deliver_failed(queued, &failure);
        if let Some(m) = reactor.multi.as_ref() {
            // Control messages are moot now (lent shards coming back are dropped); taking
            // them keeps the count a parked reactor checks true.
            while m.control.try_recv().is_ok() {
                shared.control_pending.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if shared.stopping.load(Ordering::Acquire) && shared.requests.is_empty() {
            break;
        }
        let _ = park_for_control(shared, Duration::from_millis(100));
    }
    let _ = catch_unwind(AssertUnwindSafe(move || drop(reactor)));
    Err(failure)
}

impl Runtime {
    /// Starts the reactor threads (and, with several, the coordinator), which open (and
    /// format, if asked) the device and mount it; returns once they serve requests, or with
    /// the error that stopped them.
    pub fn start(config: Config) -> Result<Runtime, EngineError> {
        Self::spawn(config, None)
    }

    /// As [`Runtime::start`] on a device the caller opened (a wrapped or simulated one;
    /// `config.device` is then only its name). The device must not have done I/O yet if its
    /// queue is single-issuer (the io_uring backends). Several reactors need a device that
    /// makes more queues itself (the memory device).
    pub fn start_with_device(
        config: Config,
        dev: Box<dyn BlockDevice>,
    ) -> Result<Runtime, EngineError> {
        Self::spawn(config, Some(dev))
    }

    fn spawn(
        mut config: Config,
        dev: Option<Box<dyn BlockDevice>>,
    ) -> Result<Runtime, EngineError> {
        // Every core a reactor may be pinned to is one this process may run on: an error
        // naming it here, before any thread starts, rather than a failed pin later.
        let mut cores = config.cores.clone();
        cores.extend(config.core);
        crate::affinity::check_cores(&cores)?;
        let mut auto = false;
        if config.reactors == 0 {
            // One per core the process may use, capped at the shard count once mounted.
            auto = true;
            config.reactors =
                crate::affinity::allowed_cores().map_or(1, |cores| cores.len().max(1));
        }
        if config.reactors > 1 {
            return Self::spawn_several(config, dev, auto);
        }
        let shared = Arc::new(Shared::with_reactors(config.queue_capacity, 1));
        let router = Arc::new(Router::new(vec![shared.clone()], 0));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let reactor_router = router.clone();
        let thread = std::thread::Builder::new()
            .name("corefs-reactor".into())
            .spawn(move || {
                let shared = reactor_router.reactors[0].clone();
                shared.doorbell.bind_thread();
                let _stopped = MarkStopped(reactor_router.clone());
                pin(config.cores.first().copied().or(config.core));
                let fs = match open(&config, dev) {
                    Ok(fs) => fs,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let reactor = Reactor::new(fs, config.mount.commit_interval);
                serve(reactor, &shared, &reactor_router, &config, 0)
            })
            .map_err(|e| EngineError::Invalid(format!("starting the reactor thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Runtime {
                router,
                threads: vec![thread],
                coordinator: None,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(died_starting("the reactor thread", thread.join())),
        }
    }

    /// Several reactors: the coordinator mounts the whole filesystem (replaying the logs),
    /// splits it, and each reactor builds its partition on a queue of its own.
    fn spawn_several(
        config: Config,
        dev: Option<Box<dyn BlockDevice>>,
        auto: bool,
    ) -> Result<Runtime, EngineError> {
        let mut n = config.reactors;
        type Part = (Lent, PartitionTemplate, Option<Box<dyn BlockDevice>>);
        let (setup_tx, setup_rx) =
            std::sync::mpsc::sync_channel::<Result<(Vec<Part>, u32), EngineError>>(1);
        let (router_tx, router_rx) = std::sync::mpsc::sync_channel::<Option<Arc<Router>>>(1);
        let (to_coordinator, from_reactors) = std::sync::mpsc::channel();
        let mut control_tx = Vec::with_capacity(n);
        let mut control_rx = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = std::sync::mpsc::channel();
            control_tx.push(tx);
            control_rx.push(rx);
        }
        let coordinator_config = config.clone();
        let coordinator = std::thread::Builder::new()
            .name("corefs-coordinator".into())
            .spawn(move || -> Result<CoordinatorExit, EngineError> {
                let config = coordinator_config;
                let setup = (|| {
                    let mut fs = open(&config, dev)?;
                    let shards = fs.shard_count();
                    let n = if auto { n.min(shards as usize) } else { n };
                    if n > shards as usize {
                        return Err(EngineError::Invalid(format!(
                            "{n} reactors for {shards} shards: at most one reactor per shard \
                             (format with more shards, or start fewer reactors)"
                        )));
                    }
                    let mut parts = Vec::with_capacity(n);
                    for r in 0..n {
                        let ids: Vec<u32> = (0..shards).filter(|s| *s as usize % n == r).collect();
                        let lent = fs.take_shards(&ids)?;
                        let queue = match fs.device().new_queue() {
                            Some(q) => Some(q.map_err(|e| {
                                EngineError::Invalid(format!("a queue for reactor {r}: {e}"))
                            })?),
                            None => None,
                        };
                        parts.push((lent, fs.partition_template(r as u32), queue));
                    }
                    fs.set_partitioned();
                    Ok((fs, parts, shards))
                })();
                let fs = match setup {
                    Ok((fs, parts, shards)) => {
                        let _ = setup_tx.send(Ok((parts, shards)));
                        fs
                    }
                    Err(e) => {
                        let _ = setup_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let Ok(Some(router)) = router_rx.recv() else {
                    // A reactor failed to start: the ones that did are told to exit.
                    for tx in &control_tx {
                        let _ = tx.send(Control::Exit);
                    }
                    return Err(EngineError::Invalid("a reactor failed to start".into()));
                };
                let coordinator = Coordinator::new(fs, from_reactors, control_tx, router);
                let fs = coordinator.run()?;
                let stats = fs.commit_stats();
                Ok((stats, fs.into_device()))
            })
            .map_err(|e| EngineError::Invalid(format!("starting the coordinator thread: {e}")))?;
        let join_coordinator_error =
            |coordinator: JoinHandle<Result<CoordinatorExit, EngineError>>| {
                died_starting("the coordinator", coordinator.join())
            };
        let (parts, shard_count) = match setup_rx.recv() {
            Ok(Ok(setup)) => setup,
            Ok(Err(e)) => {
                let _ = coordinator.join();
                return Err(e);
            }
            Err(_) => return Err(join_coordinator_error(coordinator)),
        };
        n = parts.len();
        let reactors: Vec<Arc<Shared>> = (0..n)
            .map(|_| Arc::new(Shared::with_reactors(config.queue_capacity, n)))
            .collect();
        let router = Arc::new(Router::new(reactors, shard_count));
        let coordinator_thread = coordinator.thread().clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, Result<(), EngineError>)>();
        let mut threads = Vec::with_capacity(n);
        for (index, ((lent, template, queue), control)) in
            parts.into_iter().zip(control_rx).enumerate()
        {
            let router = router.clone();
            let config = config.clone();
            let ready_tx = ready_tx.clone();
            let to_coordinator = to_coordinator.clone();
            let coordinator_thread = coordinator_thread.clone();
            let thread = std::thread::Builder::new()
                .name(format!("corefs-reactor-{index}"))
                .spawn(move || -> Result<ReactorExit, EngineError> {
                    let shared = router.reactors[index].clone();
                    shared.doorbell.bind_thread();
                    let _stopped = MarkStopped(router.clone());
                    let core = if config.cores.is_empty() {
                        None
                    } else {
                        Some(config.cores[index % config.cores.len()])
                    };
                    pin(core);
                    // The coordinator's queue holds the device's exclusive lock (it opened
                    // the device to mount it); each reactor's own queue shares that lock.
                    let dev = match queue {
                        Some(q) => Ok(q),
                        None => nvme::open_device(
                            &config.device,
                            &nvme::OpenOptions {
                                access: nvme::Access::AnotherQueue,
                                ..Default::default()
                            },
                        )
                        .map_err(|e| open_failed(&config.device, e)),
                    };
                    let dev = match dev {
                        Ok(dev) => dev,
                        Err(e) => {
                            let _ = ready_tx.send((index, Err(e.clone())));
                            return Err(e);
                        }
                    };
                    let fs = Filesystem::from_shards(dev, &template, lent);
                    // Before the runtime is up: statfs never sums a reactor not yet counted.
                    publish_statfs(&fs, &shared);
                    let _ = ready_tx.send((index, Ok(())));
                    let mut reactor = Reactor::new(fs, config.mount.commit_interval);
                    let member_router = router.clone();
                    reactor.multi = Some(Member {
                        index,
                        router: router.clone(),
                        to_coordinator,
                        coordinator: coordinator_thread,
                        control,
                        commit_asked: false,
                        half_sent: true,
                        away: false,
                        deferred: VecDeque::new(),
                        next_dir_shard: index as u64,
                        drained_sent: false,
                    });
                    serve(reactor, &shared, &member_router, &config, index)
                })
                .map_err(|e| EngineError::Invalid(format!("starting reactor {index}: {e}")))?;
            threads.push(thread);
        }
        drop(ready_tx);
        let mut failure = None;
        for _ in 0..n {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((index, Err(e))) => {
                    failure.get_or_insert(EngineError::Invalid(format!("reactor {index}: {e}")));
                }
                Err(_) => {
                    failure.get_or_insert(EngineError::Invalid(
                        "a reactor died while starting".into(),
                    ));
                    break;
                }
            }
        }
        if let Some(e) = failure {
            let _ = router_tx.send(None);
            for t in threads {
                let _ = t.join();
            }
            let _ = coordinator.join();
            return Err(e);
        }
        let _ = router_tx.send(Some(router.clone()));
        Ok(Runtime {
            router,
            threads,
            coordinator: Some(coordinator),
        })
    }

    /// A client handle with room for `capacity` operations in flight.
    pub fn client(&self, capacity: usize) -> Client {
        Client::new(self.router.clone(), capacity)
    }

    /// Reactors running.
    pub fn reactors(&self) -> usize {
        self.router.reactors.len()
    }

    /// The runtime's failure, once a reactor or the coordinator panicked: every request is
    /// then answered with it (see the module's fault model).
    pub fn failure(&self) -> Option<EngineError> {
        self.router.failure().cloned()
    }

    /// Test hook: reactor `reactor` panics when it next runs a request, so tests can check
    /// what a panic does. Armed only in builds with the `test-hooks` feature (tests turn it
    /// on): elsewhere this does nothing and returns false, and no panic is compiled in.
    #[doc(hidden)]
    pub fn panic_on_next_request(&self, reactor: usize) -> bool {
        #[cfg(any(test, feature = "test-hooks"))]
        {
            let shared = &self.router.reactors[reactor];
            shared.panic_next.store(true, Ordering::SeqCst);
            shared.doorbell.ring();
            true
        }
        #[cfg(not(any(test, feature = "test-hooks")))]
        {
            let _ = reactor;
            false
        }
    }

    /// Stops taking requests, runs those queued, commits, unmounts; returns the final
    /// statistics (with several reactors, merged; the commit figures are the coordinator's).
    pub fn shutdown(mut self) -> Result<ReactorStats, EngineError> {
        self.stop().map(|(stats, _)| stats)
    }

    /// As [`Runtime::shutdown`], handing back the unmounted device, so a memory device (or
    /// a simulated one) can be mounted again by [`Runtime::start_with_device`]. An io_uring
    /// device must not be moved to another thread: reopen it from its device string instead.
    pub fn shutdown_into_device(mut self) -> Result<Stopped, EngineError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Stopped, EngineError> {
        if self.threads.is_empty() {
            return Err(EngineError::Invalid("already shut down".into()));
        }
        for shared in &self.router.reactors {
            shared.stopping.store(true, Ordering::Release);
            shared.doorbell.ring();
        }
        let mut exits = Vec::new();
        let mut failure = None;
        for handle in self.threads.drain(..) {
            match handle.join() {
                Ok(Ok(exit)) => exits.push(exit),
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                }
                Err(_) => {
                    failure.get_or_insert(EngineError::Invalid("a reactor panicked".into()));
                }
            }
        }
        let coordinator = match self.coordinator.take().map(|h| h.join()) {
            None => None,
            Some(Ok(Ok(exit))) => Some(exit),
            Some(Ok(Err(e))) => {
                failure.get_or_insert(e);
                None
            }
            Some(Err(_)) => {
                failure.get_or_insert(EngineError::Invalid("the coordinator panicked".into()));
                None
            }
        };
        // After a panic every thread ends with the runtime's failure (or a consequence of
        // it): report the cause.
        if let Some(e) = self.router.failure() {
            return Err(e.clone());
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let mut exits = exits.into_iter();
        let first = exits.next().expect("at least one reactor");
        let (mut stats, mut hist, dev) = (first.stats, first.hist, first.dev);
        for exit in exits {
            stats.absorb(&exit.stats);
            hist.add(&exit.hist);
        }
        match coordinator {
            Some((commit, dev)) => {
                hist.fill(&mut stats);
                let pause_ns_max = stats.commit.pause_ns_max;
                stats.commit = commit;
                stats.commit.pause_ns_max = pause_ns_max;
                stats.unpinned_blocks_last = commit.last_unpinned_blocks;
                Ok((stats, dev))
            }
            None => Ok((stats, dev)),
        }
    }
}

/// The error of a thread that ended while starting (an error it returned, or its panic).
fn died_starting(
    what: &str,
    joined: std::thread::Result<Result<impl Sized, EngineError>>,
) -> EngineError {
    match joined {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => EngineError::Invalid(format!("{what} ended while starting")),
        Err(panic) => EngineError::Internal(format!(
            "{what} panicked while starting: {}",
            crate::panic_message(&*panic)
        )),
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            if let Err(e) = self.stop() {
                tracing::error!("reactor shutdown: {e}");
            }
        }
    }
}

/// An open that failed: a device held by another writer keeps its own error (its errno is
/// EBUSY, and the message names the holder); anything else is the caller's device string.
fn open_failed(device: &str, e: nvme::DevError) -> EngineError {
    match e {
        nvme::DevError::Busy { .. } => EngineError::Device(e),
        e => EngineError::Invalid(format!("{device}: {e}")),
    }
}

fn open(config: &Config, dev: Option<Box<dyn BlockDevice>>) -> Result<Filesystem, EngineError> {
    let mut dev = match dev {
        Some(dev) => dev,
        None => nvme::open_device(&config.device, &nvme::OpenOptions::default())
            .map_err(|e| open_failed(&config.device, e))?,
    };
    if let Some(mkfs) = &config.mkfs {
        dev = Filesystem::mkfs(dev, mkfs)?;
    }
    Filesystem::mount(dev, config.mount.clone())
}

pub(crate) struct Reactor {
    fs: Filesystem,
    commit_interval: Duration,
    hist: Histograms,
    stats: ReactorStats,
    cpu_start_ns: u64,
    /// fsync groups whose records are in flight, oldest first (tickets ascend).
    pending: VecDeque<PendingGroup>,
    /// Since when a due commit waits for the records in flight ([`COMMIT_DEFER_MAX`]).
    commit_deferred_since: Option<Instant>,
    /// Preparation steps the due commit has taken ([`PREPARE_STEPS_MAX`]).
    prepare_steps: u32,
    /// With several reactors: this one's side of the coordination ([`crate::multi`]).
    pub(crate) multi: Option<Member>,
    /// Replies held until a generation is durable (syncs, fsyncs that fell back, directory
    /// renames with several reactors).
    commit_waiters: Vec<crate::multi::CommitWaiter>,
    /// Every request taken into a batch and not yet answered or handed on: what a failed
    /// reactor answers ([`crate::owed`]).
    owed: Owed,
    /// Reads whose device I/O is in flight, by the engine's read set: answered from
    /// [`Filesystem::read_progress`] while the reactor serves other requests. Bounded by the
    /// requests owed.
    parked_reads: std::collections::HashMap<u64, Vec<Request>>,
    /// Requests parked while the tree nodes their lookups need are read, and the requests
    /// of their clients behind them ([`crate::meta_wait`]).
    pub(crate) meta: MetaWaits,
    /// When the loop last looked at its queues, and the longest it went without looking.
    last_look: Option<Instant>,
    /// Test hook: panic when the next request runs ([`Runtime::panic_on_next_request`]).
    #[cfg(any(test, feature = "test-hooks"))]
    panic_next: Arc<std::sync::atomic::AtomicBool>,
}

/// How long a due commit waits for the records in flight to become durable before it starts
/// anyway (and waits for them itself, holding the reactor).
const COMMIT_DEFER_MAX: Duration = Duration::from_millis(50);

/// An fsync group waiting for its record to become durable.
struct PendingGroup {
    ticket: u64,
    waiters: Vec<(Request, Instant)>,
    group_start: Instant,
}

/// A busy-polling reactor gives its core away for a moment whenever it has nothing to do.
/// Its core is not its alone: kernel work its own I/O depends on runs there too (a file
/// image's FUA write completes through a kworker on the core that took the interrupt), and
/// the scheduler lets a woken task preempt a running one only when that one's slice is used
/// up — a jiffy later. Spinning without yielding made every 4 KiB append + fdatasync on a
/// file image take exactly 4 ms (HZ=250); yielding costs one system call when nothing else
/// wants the core.
fn yield_to_kernel_work() {
    std::thread::yield_now();
}

/// How a reactor's loop ended.
enum Ran {
    /// Shut down: every request answered; the final statistics.
    Stopped(Box<(ReactorStats, Histograms)>),
    /// The runtime failed (another thread panicked): serve as a failed reactor.
    Failed,
}

/// The reactor's loop, until shutdown or until the runtime fails; then the fsync groups in
/// flight are waited for.
fn run(reactor: &mut Reactor, shared: &Shared, router: &Router, config: &Config) -> Ran {
    let mut batch: Vec<Request> = Vec::with_capacity(config.batch_max);
    let mut idle_since: Option<Instant> = None;
    // Since when the loop has been polling a device that had nothing for it.
    let mut device_idle_since: Option<Instant> = None;
    // Completions ring the doorbell too: waiting for the device, the reactor sleeps on it and
    // still hears its clients. (Busy-poll never sleeps and needs no signal.)
    let device_rings = config.idle != IdlePolicy::BusyPoll
        && shared
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
        if !batch.is_empty() || reactor.meta.has_resumed() {
            if router.failure().is_some() {
                // Checked after taking the requests: a request sent after its client saw the
                // failure (answered by another reactor) is answered with it too, never run.
                for r in batch.drain(..) {
                    reactor.owed.take(&r.reply, r.token);
                }
                return Ran::Failed;
            }
            idle_since = None;
            reactor.run_batch(&mut batch);
            reactor.tick();
            device_idle_since = None;
            continue;
        }
        if reactor.waiting_on_device() {
            // Records or a commit in flight and nothing queued: poll the device (busy-poll),
            // or sleep on it briefly (shared cores) and look at the queue again.
            let spun = device_idle_since.get_or_insert_with(Instant::now).elapsed();
            match config.idle {
                IdlePolicy::BusyPoll => {
                    reactor.poll_durable(None);
                    if reactor.only_reads_in_flight() && spun >= READ_SPIN {
                        reactor.collect_reads(Some(READ_WAIT_SLICE));
                    } else {
                        yield_to_kernel_work();
                    }
                }
                // Take what is done; spin a while (a device read usually completes within
                // it, and a sleep costs a wake-up as long as the read), then sleep until a
                // completion or a request rings.
                IdlePolicy::SpinThenPark { spin } if device_rings => {
                    reactor.poll_durable(None);
                    // A commit with trees left to serialize has CPU work: no sleep.
                    if reactor.waiting_on_device() && !reactor.fs.commit_slicing() {
                        if reactor.only_reads_in_flight() && spun < spin {
                            std::hint::spin_loop();
                            continue;
                        }
                        reactor.stats.device_sleeps += 1;
                        if !park_for_control(shared, LOG_WAIT_SLICE) {
                            reactor.stats.device_sleep_timeouts += 1;
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
                && config.idle != IdlePolicy::BusyPoll
            {
                let _ = park_for_control(shared, LOG_WAIT_SLICE);
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
        match config.idle {
            IdlePolicy::BusyPoll => yield_to_kernel_work(),
            IdlePolicy::SpinThenPark { spin } => {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() < spin {
                    // Yield, not spin: a client the scheduler put on this core (2 loaded
                    // cores) runs, where a spin at this thread's weight would hold it off.
                    std::thread::yield_now();
                    continue;
                }
                shared.parked.store(true, Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                if shared.requests.is_empty()
                    && shared.control_pending.load(Ordering::SeqCst) == 0
                    && !shared.stopping.load(Ordering::Acquire)
                {
                    reactor.stats.parks += 1;
                    // Wake for the commit timer even when no client comes.
                    let timer = reactor.commit_interval / 4;
                    shared
                        .doorbell
                        .sleep(timer.clamp(Duration::from_millis(1), Duration::from_millis(500)));
                }
                shared.parked.store(false, Ordering::SeqCst);
            }
        }
    }
    // Every fsync waiter and every read goes before the reactor does.
    while !reactor.pending.is_empty()
        || !reactor.parked_reads.is_empty()
        || !reactor.meta.is_empty()
    {
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
        fsync_groups = stats.fsync_groups,
        fua_records = stats.log.fua_records,
        "reactor stopping"
    );
    Ran::Stopped(Box::new((stats, reactor.hist.clone())))
}

/// Publishes this reactor's share of statfs (its shards' size, free space and inodes) for
/// the statfs that sums them with several reactors.
fn publish_statfs(fs: &Filesystem, shared: &Shared) {
    let statfs = fs.statfs();
    shared
        .total_blocks
        .store(statfs.total_blocks, Ordering::Relaxed);
    shared
        .free_blocks
        .store(statfs.free_blocks, Ordering::Relaxed);
    shared.inodes.store(statfs.inodes, Ordering::Relaxed);
}

/// Parks up to `timeout` unless a control message or a request is waiting. True when the
/// doorbell rang.
fn park_for_control(shared: &Shared, timeout: Duration) -> bool {
    shared.parked.store(true, Ordering::SeqCst);
    std::sync::atomic::fence(Ordering::SeqCst);
    let mut rung = true;
    if shared.control_pending.load(Ordering::SeqCst) == 0 && shared.requests.is_empty() {
        rung = shared.doorbell.sleep(timeout);
    }
    shared.parked.store(false, Ordering::SeqCst);
    rung
}

impl Reactor {
    pub(crate) fn new(mut fs: Filesystem, commit_interval: Duration) -> Reactor {
        // Commits run in the background here; an fsync that needs one waits for it.
        fs.defer_commits(true);
        Reactor {
            fs,
            commit_interval,
            hist: Histograms::new(),
            stats: ReactorStats::default(),
            cpu_start_ns: thread_cpu_ns(),
            pending: VecDeque::new(),
            commit_deferred_since: None,
            prepare_steps: 0,
            multi: None,
            commit_waiters: Vec::new(),
            owed: Owed::default(),
            parked_reads: Default::default(),
            meta: MetaWaits::default(),
            last_look: None,
            #[cfg(any(test, feature = "test-hooks"))]
            panic_next: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// Pushes completions to their clients ([`deliver`]); they are no longer owed.
    fn deliver(&mut self, done: Vec<(Arc<ReplyQueue>, Completion)>) {
        for (reply, completion) in &done {
            self.owed.settle(reply, completion.token);
        }
        deliver(done);
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
    fn looked(&mut self) {
        let now = Instant::now();
        if let Some(last) = self.last_look {
            let gap = now.duration_since(last).as_nanos() as u64;
            self.stats.loop_gap_ns_max = self.stats.loop_gap_ns_max.max(gap);
        }
        self.last_look = Some(now);
    }

    /// Device reads in flight: parked reads, tree nodes parked requests wait for, and
    /// read-ahead (which nobody waits for, but whose blocks a later unpin must wait for:
    /// it is reaped as promptly as the others).
    fn reads_outstanding(&self) -> bool {
        !self.parked_reads.is_empty() || self.fs.reads_in_flight() > 0
    }

    /// True when the only work on the device is parked reads.
    fn only_reads_in_flight(&self) -> bool {
        self.reads_outstanding() && self.pending.is_empty() && !self.fs.device_busy()
    }

    /// Answers the parked reads whose device I/O finished; with `wait`, sleeps up to that
    /// long for the device when none has.
    fn collect_reads(&mut self, wait: Option<Duration>) {
        if !self.reads_outstanding() {
            return;
        }
        let mut done = Vec::new();
        for (set, results) in self.fs.read_progress(wait) {
            // Tree nodes for parked requests: they run again in the next batch.
            if self.meta.answered(set) {
                continue;
            }
            let Some(requests) = self.parked_reads.remove(&set) else {
                // A set the engine finished for someone else (a synchronous read).
                continue;
            };
            for (request, result) in requests.into_iter().zip(results) {
                done.push((
                    request.reply,
                    Completion {
                        token: request.token,
                        result: result.map(Reply::Data),
                    },
                ));
            }
        }
        self.deliver(done);
    }

    /// Unmounts (commits unless the filesystem failed) and gives the device back.
    #[cfg(feature = "sim")]
    pub(crate) fn unmount(self) -> Result<Box<dyn BlockDevice>, EngineError> {
        self.fs.unmount()
    }

    pub(crate) fn tick(&mut self) {
        // Unpin the last commit's frees (after its waiters went), then start or ask for the
        // next commit when one is due or waited for.
        // A read in flight may still need blocks the commit freed: the unpin waits for it
        // rather than the reactor.
        if self.fs.commit_in_flight().is_none() && !self.fs.unpin_waits_for_reads() {
            self.fs.complete_commit();
        }
        self.drive_commits();
        if let Some(m) = self.multi.as_ref() {
            publish_statfs(&self.fs, &m.router.reactors[m.index]);
        }
        self.poll_durable(None);
    }

    /// Starts a commit (one reactor) or asks the coordinator for one (several) when the
    /// engine says one is due or a waiter needs a generation not yet durable.
    fn drive_commits(&mut self) {
        if self.fs.failure().is_some() {
            if !self.commit_waiters.is_empty() {
                let e = self.fs.failure().cloned().expect("failed");
                self.release_commit_waiters(u64::MAX, Err(e));
            }
            return;
        }
        if self.fs.commit_in_flight().is_some() {
            return;
        }
        // The next commit first unpins the last one, which must wait for the reads in flight
        // planned before it: starting it now would hold the reactor until they complete (a
        // 50 ms device read would stop every client). It starts once they land.
        if self.fs.unpin_waits_for_reads() {
            return;
        }
        let durable = self.fs.durable_generation();
        let waited = self.commit_waiters.iter().any(|w| w.generation > durable);
        if !waited && !self.fs.commit_due() {
            return;
        }
        // The delayed index items go into the trees a step per loop turn first, so the
        // commit's pause has few left; a stream of creates that outpaces the steps gets its
        // commit after PREPARE_STEPS_MAX of them all the same.
        if self.prepare_steps < PREPARE_STEPS_MAX {
            match self.fs.commit_prepare() {
                Ok(true) => {}
                Ok(false) => {
                    self.prepare_steps += 1;
                    return;
                }
                Err(e) => {
                    self.release_commit_waiters(u64::MAX, Err(e));
                    return;
                }
            }
        }
        self.prepare_steps = 0;
        if let Some(m) = self.multi.as_mut() {
            m.ask_commit();
            return;
        }
        // A commit first waits for the records in flight to become durable, holding the
        // reactor: behind a slow device flush (tens of ms on a shared disk) every client
        // stalled with it. So it starts once they are durable, polled for in the meantime, or
        // after COMMIT_DEFER_MAX if fsyncs keep the pipeline busy.
        if self.fs.log_in_flight() > 0 {
            let since = *self.commit_deferred_since.get_or_insert_with(Instant::now);
            if since.elapsed() < COMMIT_DEFER_MAX {
                return;
            }
        }
        self.commit_deferred_since = None;
        match self.fs.commit_start() {
            Ok(true) => {}
            // Nothing to write: every change is durable already.
            Ok(false) => {
                let running = self.fs.generation();
                self.release_commit_waiters(running, Ok(()));
            }
            Err(e) => self.release_commit_waiters(u64::MAX, Err(e)),
        }
    }

    /// Advances the commit in flight: its half to the coordinator once written (several
    /// reactors), its waiters released at SuperCommitted (one reactor).
    fn progress_commit(&mut self, wait: Option<Duration>) {
        if self.fs.commit_in_flight().is_none() {
            return;
        }
        if self.multi.as_ref().is_some_and(|m| m.half_sent) {
            return;
        }
        match self.fs.commit_progress(wait) {
            Ok(engine::commit::CommitProgress::SuperCommitted(generation)) => {
                let after = self.fs.commit_stats();
                tracing::debug!(
                    commits = after.commits,
                    commit_us = after.last_commit_ns / 1000,
                    generation,
                    "commit"
                );
                self.release_commit_waiters(generation, Ok(()));
            }
            Ok(engine::commit::CommitProgress::Written) => {
                let roots = self
                    .fs
                    .commit_written()
                    .map(|w| w.roots)
                    .unwrap_or_default();
                let m = self
                    .multi
                    .as_mut()
                    .expect("only a partition stops at Written");
                m.half_sent = true;
                m.tell(ToCoordinator::Half(m.index, Box::new(Ok(Some(roots)))));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!("commit failed: {e}");
                if let Some(m) = self.multi.as_mut() {
                    m.half_sent = true;
                    m.tell(ToCoordinator::Half(m.index, Box::new(Err(e.clone()))));
                }
                self.release_commit_waiters(u64::MAX, Err(e));
            }
        }
    }

    pub(crate) fn snapshot(&mut self) -> ReactorStats {
        let mut s = self.stats.clone();
        s.cpu_ns = thread_cpu_ns().saturating_sub(self.cpu_start_ns);
        self.hist.fill(&mut s);
        s.commit = self.fs.commit_stats();
        s.log = self.fs.log_stats();
        s.unpinned_blocks_last = s.commit.last_unpinned_blocks;
        s.reads = self.fs.read_stats();
        s.device_waits = self.fs.device_wait_stats();
        s.meta_parks = self.meta.parks;
        s.fetch = self.fs.fetch_stats();
        (s.data_cache_hits, s.data_blocks_read) = self.fs.data_cache_hits();
        s
    }

    /// Takes the coordinator's control messages; true on Exit.
    fn take_control(&mut self, shared: &Shared) -> bool {
        loop {
            let Some(m) = self.multi.as_mut() else {
                return false;
            };
            let Ok(control) = m.control.try_recv() else {
                return false;
            };
            shared.control_pending.fetch_sub(1, Ordering::SeqCst);
            match control {
                Control::Lend => {
                    let held = self.fs.held_ids();
                    let lent = self.fs.take_shards(&held);
                    // The drain may have made records durable: their waiters go.
                    self.poll_durable(None);
                    let m = self.multi.as_mut().expect("multi");
                    m.away = lent.is_ok();
                    m.tell(ToCoordinator::Lent(m.index, Box::new(lent)));
                }
                Control::Return(lent) => {
                    self.fs.put_shards(lent);
                    self.multi.as_mut().expect("multi").away = false;
                }
                Control::CommitPrepare => self.begin_half(),
                Control::CommitDone(sb) => {
                    self.fs.commit_finish(&sb);
                    let m = self.multi.as_mut().expect("multi");
                    m.commit_asked = false;
                    self.release_commit_waiters(sb.generation, Ok(()));
                    // Groups logged during the commit may go now.
                    self.poll_durable(None);
                }
                Control::CommitFailed(e) => {
                    self.fs.fail_stop(e.clone());
                    let m = self.multi.as_mut().expect("multi");
                    m.commit_asked = false;
                    self.release_commit_waiters(u64::MAX, Err(e));
                    self.poll_durable(None);
                }
                Control::Snapshot => {
                    let snapshot = self.snapshot();
                    let m = self.multi.as_ref().expect("multi");
                    m.tell(ToCoordinator::Snapshot(Box::new((
                        snapshot,
                        self.hist.clone(),
                    ))));
                }
                Control::Exit => return true,
            }
        }
    }

    /// Starts this reactor's half of a coordinated commit: its blocks go to the device in
    /// the background while it serves the next generation; the half goes to the coordinator
    /// once written ([`Reactor::progress_commit`]), and its done arrives as a control message.
    fn begin_half(&mut self) {
        let started = self.fs.commit_start();
        // A partition always starts (its generation moves even with nothing to write).
        let m = self.multi.as_mut().expect("multi");
        match started {
            Ok(true) => {
                m.half_sent = false;
                self.poll_durable(None);
            }
            Ok(false) => {
                m.half_sent = true;
                m.tell(ToCoordinator::Half(m.index, Box::new(Ok(None))));
            }
            Err(e) => {
                m.half_sent = true;
                m.tell(ToCoordinator::Half(m.index, Box::new(Err(e))));
            }
        }
    }

    /// Completes the replies waiting for a generation up to `generation` (all of them, with
    /// the error, on failure).
    fn release_commit_waiters(&mut self, generation: u64, result: Result<(), EngineError>) {
        if self.commit_waiters.is_empty() {
            return;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.commit_waiters)
            .into_iter()
            .partition(|w| result.is_err() || w.generation <= generation);
        self.commit_waiters = waiting;
        let now = Instant::now();
        let mut done = Vec::with_capacity(ready.len());
        for w in ready {
            if let Some((started, group_start)) = w.fsync {
                let submitted = w.request.submitted;
                let _ = self
                    .hist
                    .queue_wait
                    .record(started.duration_since(submitted).as_nanos().max(1) as u64);
                let _ = self
                    .hist
                    .commit_wait
                    .record(now.duration_since(group_start).as_nanos().max(1) as u64);
                let _ = self
                    .hist
                    .total
                    .record(now.duration_since(submitted).as_nanos().max(1) as u64);
            }
            done.push(crate::multi::completion(
                w.request,
                result.clone().map(|()| w.reply),
            ));
        }
        self.deliver(done);
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
            self.owed.take(&request.reply, request.token);
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
            if self.panic_next.swap(false, Ordering::SeqCst) {
                panic!(
                    "test hook: this reactor panics on its next request ({request_op:?})",
                    request_op = request.op
                );
            }
            if is_read {
                reads.push(request);
                continue;
            }
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
            let Request {
                op,
                token,
                reply,
                submitted,
            } = request;
            // With several reactors a directory rename commits before it returns.
            let rename = match (&self.multi, &op) {
                (Some(_), Op::Rename { .. }) => Some(op.clone()),
                _ => None,
            };
            let result = self.execute(op);
            if let (Some(rename), Ok(_)) = (&rename, &result) {
                if crate::multi::renamed_a_directory(&mut self.fs, rename) {
                    let generation = self.fs.generation();
                    self.commit_waiters.push(crate::multi::CommitWaiter {
                        request: Request {
                            op: rename.clone(),
                            token,
                            reply,
                            submitted,
                        },
                        reply: result.expect("checked"),
                        fsync: None,
                        generation,
                    });
                    continue;
                }
            }
            done.push((reply, Completion { token, result }));
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
                    self.finish_group(waiters, group_start, fell_back, Ok(()), &mut done)
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
                Err(e) => self.finish_group(waiters, group_start, false, Err(e), &mut done),
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

    /// Completes an fsync group's waiters with `result`, recording their phases.
    fn finish_group(
        &mut self,
        waiters: Vec<(Request, Instant)>,
        group_start: Instant,
        fell_back: bool,
        result: Result<(), EngineError>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) {
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
    }

    /// Releases the waiters of every fsync group whose record is durable now (all of them,
    /// with the error, once the filesystem failed). `wait`: sleep on the device up to that
    /// long for progress.
    fn collect_durable(
        &mut self,
        wait: Option<Duration>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) {
        // With no fsync waiting, the pipeline still advances for background write-backs: their
        // completions free the room the next ones need.
        if self.pending.is_empty() && !self.fs.device_busy() {
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
                    self.finish_group(group.waiters, group.group_start, false, Ok(()), done);
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

    /// Waits for records in flight (up to `wait`) and delivers the waiters they release.
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
        if let Some((set, answers)) = started.pending {
            let waiting: Vec<Request> = answers
                .into_iter()
                .map(|index| slots[index].take().expect("a request waits in one set"))
                .collect();
            // Their clients stop yielding for these replies and sleep (client.rs).
            waiting.iter().for_each(|r| r.reply.note_device_wait());
            self.parked_reads.insert(set, waiting);
        }
        assert!(
            slots.iter().all(Option::is_none),
            "every read is answered, parked or waiting"
        );
    }

    fn execute(&mut self, op: Op) -> Result<Reply, EngineError> {
        match op {
            Op::Stats => Ok(Reply::Stats(Box::new(self.snapshot()))),
            op => execute_on(&mut self.fs, op),
        }
    }
}
