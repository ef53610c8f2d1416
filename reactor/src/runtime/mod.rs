//! The reactor: one pinned thread that owns the engine (every shard) and its device queue,
//! drains client requests from a bounded lock-free queue in batches, runs them, groups the
//! batch's fsyncs into one log record and one flush, commits when the engine says a commit is
//! due, and idles by busy-polling or by spinning then parking.
//!
//! This module starts and stops reactors ([`Runtime`]: its configuration, the threads it
//! spawns, shutdown) and holds a reactor's state ([`Reactor`]). The rest is by concern:
//! - [`serve`]: a reactor thread's life once its engine is mounted, and the failed reactor
//!   a panic leaves;
//! - [`run_loop`]: the loop, its idle policy and its sleeps;
//! - [`batch`]: running a batch, its fsync group and its reads, and collecting what the
//!   device finished for them;
//! - [`commit`]: starting and driving commits, and (several reactors) the coordinator's
//!   control messages.
//!
//! Requests arrive through [`crate::queue`], run through [`crate::execute`], and their
//! completions leave through [`crate::delivery`].
//!
//! # Invariants
//! - Only the reactor thread touches the engine and the device queue (the io_uring rings are
//!   single-issuer: the reactor opens and mounts the device itself).
//! - Requests, completions and batches are bounded ([`crate::queue`]); operations run in
//!   queue order and an fsync completes only once its group is durable ([`batch`]).
//!
//! Fault model: an engine error fails the operations it hits and, for device errors and
//! failed commits, makes the filesystem fail-stop (every later change returns ReadOnly); the
//! reactor keeps serving reads and stats. Shutdown commits and unmounts. A panic fails the
//! whole runtime: every reactor then answers every request with the failure ([`serve`]).

mod batch;
mod commit;
mod run_loop;
mod serve;

use crate::client::Client;
use crate::delivery::deliver;
use crate::meta_wait::MetaWaits;
use crate::multi::{Control, Coordinator, Member, Router};
use crate::op::Completion;
use crate::owed::Owed;
use crate::queue::{Request, Shared};
use crate::reply::ReplyQueue;
use crate::stats::{thread_cpu_ns, Histograms, ReactorStats};
use batch::PendingGroup;
use engine::partition::{Lent, PartitionTemplate};
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::BlockDevice;
use serve::serve;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the reactor does when it has nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Poll without pause: lowest latency, one core at 100% (dedicated storage cores). An
    /// fsync's record that outlasts twice the usual ([`durable_spin_budget`] with
    /// [`DURABLE_SPIN_MAX`]) is waited for asleep on the doorbell, where the device rings it.
    BusyPoll,
    /// Poll for `spin`, then park until a client submits or a commit is due (shared cores:
    /// an idle reactor uses about no CPU). With an fsync waiting for its record, poll the
    /// device (yielding the core between polls) for up to twice the time records have been
    /// taking to become durable, when that is at most `durable_spin_max`, before sleeping on
    /// the doorbell ([`durable_spin_budget`]).
    SpinThenPark {
        spin: Duration,
        durable_spin_max: Duration,
    },
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy::SpinThenPark {
            spin: Duration::from_micros(50),
            durable_spin_max: DURABLE_SPIN_MAX,
        }
    }
}

/// The default longest spin for an fsync's record ([`IdlePolicy::SpinThenPark`]). Waking a
/// sleeping thread costs tens of microseconds on a VM, as long as a third of a file image's
/// FUA write here (85–100 µs): RocksDB's synchronous puts on a file image ran at 8.3–8.8k/s
/// with the reactor sleeping through every record and 9.6–9.9k/s spinning through it. 300 µs
/// is the client's own spin (`client::SPIN_TIME`): past it the client sleeps too, and a
/// wake-up is small beside the wait.
pub const DURABLE_SPIN_MAX: Duration = Duration::from_micros(300);

/// The most one record's time counts for in the running mean ([`durable_ns_ewma_next`]).
pub const DURABLE_SAMPLE_NS_MAX: u64 = 1_000_000;

/// How long a spin-then-park reactor with fsyncs waiting polls the device before it sleeps,
/// given the recent time records took to become durable (`durable_ns_ewma`, 0 before the
/// first): twice that, so the usual record completes within the spin and only a slow one
/// costs a sleep; nothing before the first record is timed, and nothing on a device slower
/// than `max`, where the spin would burn a core for a wake-up that costs little beside the
/// wait.
pub fn durable_spin_budget(durable_ns_ewma: u64, max: Duration) -> Duration {
    let expected = Duration::from_nanos(durable_ns_ewma);
    if expected > max {
        return Duration::ZERO;
    }
    (expected * 2).min(max)
}

/// Folds one record's time to durable into the running mean (weight 1/8). One sample counts
/// for at most [`DURABLE_SAMPLE_NS_MAX`]: a record held behind a commit's tens of
/// milliseconds would otherwise stop the spinning for dozens of records after it.
pub fn durable_ns_ewma_next(ewma_ns: u64, sample_ns: u64) -> u64 {
    let sample_ns = sample_ns.min(DURABLE_SAMPLE_NS_MAX);
    if ewma_ns == 0 {
        return sample_ns.max(1);
    }
    (ewma_ns - ewma_ns / 8 + sample_ns / 8).max(1)
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
    /// While the reactor sleeps, waits for its device or polls an empty queue, a client
    /// runs a lookup or a read itself when memory answers it, instead of waking the reactor
    /// ([`crate::caller`]; one reactor only). On by default; `COREFS_CALLERS_RUN=0` in the
    /// environment turns it off, to compare.
    pub callers_run: bool,
    /// With `callers_run`: changes of names, links, attributes and holds too, not only
    /// lookups and reads. On by default; `COREFS_CALLERS_RUN=lookups` turns it off.
    pub callers_change: bool,
    /// With `callers_change`: fsyncs too, their records written beside the queue while the
    /// cores are shared ([`engine::Filesystem::fsync_beside`]). On by default;
    /// `COREFS_CALLERS_RUN=changes` turns it off (and `lookups` or `0`), to compare.
    pub callers_fsync: bool,
    /// With `callers_change`: a client reads data blocks memory misses, and writes an
    /// fsync's record, beside the queue whenever it runs a read or an fsync, not only while
    /// the cores are shared with other work (where it saves two wake-ups or more; on a quiet
    /// machine the polling reactor's ring is as fast or faster). Off by default; tests turn
    /// it on to reach those paths on a quiet machine.
    pub callers_device_always: bool,
}

/// `COREFS_CALLERS_RUN`, read once: `0` turns lending off, `lookups` keeps changes on the
/// reactor, `changes` keeps fsyncs there (to compare; [`crate::caller`]).
fn callers_env() -> Option<&'static str> {
    static ENV: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ENV.get_or_init(|| std::env::var("COREFS_CALLERS_RUN").ok())
        .as_deref()
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
            callers_run: callers_env() != Some("0"),
            callers_change: !matches!(callers_env(), Some("0" | "lookups")),
            callers_fsync: !matches!(callers_env(), Some("0" | "lookups" | "changes")),
            callers_device_always: false,
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

/// A reactor pinned to a core of its own, and the cores it may spread to while that core is
/// shared with other work ([`crate::contention`]): there a pinned thread waits out whole time
/// slices, while the scheduler moves an unpinned one to a free core, or beside its client.
pub(crate) struct Pinned {
    core: usize,
    wide: Vec<usize>,
    widened: bool,
    /// Where the kernel's workers for this reactor's queue run while the process is not
    /// contended: its cores but the reactors' ([`place_blocking_work`]); empty when that
    /// leaves none (they then stay where they are born). While contended they may run on
    /// every core (`wide`); `workers_wide` says which holds now.
    quiet_workers: Vec<usize>,
    workers_wide: bool,
}

fn pin(core: Option<usize>, config: &Config) -> Option<Pinned> {
    raise_priority();
    let core = core?;
    // Before pinning: the cores the process may use.
    let wide = crate::affinity::allowed_cores().unwrap_or_default();
    // Checked when the runtime started: this fails only if the allowed set changed.
    if let Err(e) = crate::affinity::pin_current_thread(core) {
        tracing::warn!(core, "{e}; the reactor runs unpinned");
        return None;
    }
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !crate::affinity::isolated_cores().contains(&core) && !SAID.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "reactor core {core} is not isolated (no isolcpus= or nohz_full= for it): other \
             work may run there. The reactor polls while it has its core to itself; while it \
             does not, it sleeps in the kernel between requests and may run on cores {}",
            crate::affinity::cpu_list(&wide)
        );
    }
    let mut reactor_cores = config.cores.clone();
    reactor_cores.extend(config.core);
    let quiet_workers = wide
        .iter()
        .copied()
        .filter(|c| !reactor_cores.contains(c))
        .collect();
    Some(Pinned {
        core,
        wide,
        widened: false,
        quiet_workers,
        workers_wide: false,
    })
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
        let shared = Arc::new(Shared::with_reactors(
            config.queue_capacity,
            1,
            crate::caller::CallerPolicy {
                run: config.callers_run,
                changes: config.callers_change,
                fsyncs: config.callers_change && config.callers_fsync,
                device_always: config.callers_device_always,
            },
        ));
        let router = Arc::new(Router::new(vec![shared.clone()], 0, None));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let reactor_router = router.clone();
        let thread = std::thread::Builder::new()
            .name("corefs-reactor".into())
            .spawn(move || {
                let shared = reactor_router.reactors[0].clone();
                shared.doorbell.bind_thread();
                let _stopped = MarkStopped(reactor_router.clone());
                let mut pinned = pin(config.cores.first().copied().or(config.core), &config);
                let fs = match open(&config, dev, pinned.as_mut()) {
                    Ok(fs) => fs,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let mut reactor = Reactor::new(fs, config.mount.commit_interval);
                reactor.pinned = pinned;
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
                    let mut fs = open(&config, dev, None)?;
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
            .map(|_| {
                Arc::new(Shared::with_reactors(
                    config.queue_capacity,
                    n,
                    crate::caller::CallerPolicy::OFF,
                ))
            })
            .collect();
        let pool = parts.first().map(|(_, template, _)| template.pool.clone());
        let router = Arc::new(Router::new(reactors, shard_count, pool));
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
                    let mut pinned = pin(core, &config);
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
                    let dev = dev.and_then(|mut dev| {
                        place_blocking_work(&mut *dev, pinned.as_mut(), &config)?;
                        Ok(dev)
                    });
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
                    reactor.pinned = pinned;
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

    /// Adds a source of requests that the reactor polls itself ([`crate::source`]), each
    /// completing through `sink`; `id` names it for [`Runtime::remove_source`]. A runtime of
    /// one reactor whose doorbell can be rung from another process (an eventfd) only: an
    /// error otherwise, and the caller serves the source's requests through clients.
    pub fn add_source(
        &self,
        id: u64,
        source: Arc<dyn crate::source::Source>,
        sink: Arc<dyn crate::source::CompletionSink>,
    ) -> Result<(), EngineError> {
        if self.router.reactors.len() != 1 {
            return Err(EngineError::NotSupported(
                "sources on a runtime of several reactors".into(),
            ));
        }
        let shared = &self.router.reactors[0];
        if shared.doorbell.raw_fd().is_none() {
            return Err(EngineError::NotSupported(
                "a source needs the reactor's eventfd doorbell".into(),
            ));
        }
        shared.sources.add(crate::source::Entry {
            id,
            source,
            reply: Arc::new(ReplyQueue::with_sink(sink)),
        });
        shared.doorbell.ring();
        Ok(())
    }

    /// Stops polling source `id` (requests taken from it still complete).
    pub fn remove_source(&self, id: u64) -> bool {
        self.router.reactors[0].sources.remove(id)
    }

    /// The descriptor a source's clients write 1 (8 bytes) to, to wake the reactor when it
    /// sleeps ([`crate::source::Source::parked`]): its doorbell's eventfd, when it has one.
    pub fn doorbell_fd(&self) -> Option<std::os::fd::RawFd> {
        self.router.reactors[0].doorbell.raw_fd()
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

/// Keeps the kernel's blocking work for a pinned reactor's queue (io_uring's workers: a file
/// image's flushes) off the reactors' cores while the process is not contended
/// ([`BlockDevice::run_blocking_work_on`]; [`Reactor::adapt_affinity`] lets them onto every
/// core while it is). Born on the reactor's core, a woken worker waited for the busy-polling
/// reactor's time slice: 4 writers' 64 KiB write+fsync had a p99 of 5.5–8.3 ms in the
/// record's write and flush in some quiet runs, where the device took 0.4–0.6 ms. Held to
/// the other cores beside a CPU-bound neighbour, it waited behind the neighbour while the
/// reactor, sleeping between requests, left its own core idle (3–4 ms against 0.5–1.7 ms).
/// An unpinned reactor's workers go where the scheduler puts them.
fn place_blocking_work(
    dev: &mut dyn BlockDevice,
    pinned: Option<&mut Pinned>,
    config: &Config,
) -> Result<(), EngineError> {
    let Some(pinned) = pinned else {
        return Ok(());
    };
    if pinned.quiet_workers.is_empty() {
        return Ok(());
    }
    let placed = dev
        .run_blocking_work_on(&pinned.quiet_workers)
        .map_err(|e| open_failed(&config.device, e))?;
    if placed {
        tracing::debug!(
            reactor_core = pinned.core,
            "the kernel's blocking work for this reactor's queue runs on cores {} while the \
             process is not contended",
            crate::affinity::cpu_list(&pinned.quiet_workers)
        );
    } else {
        pinned.quiet_workers.clear();
    }
    Ok(())
}

fn open(
    config: &Config,
    dev: Option<Box<dyn BlockDevice>>,
    pinned: Option<&mut Pinned>,
) -> Result<Filesystem, EngineError> {
    let mut dev = match dev {
        Some(dev) => dev,
        None => nvme::open_device(&config.device, &nvme::OpenOptions::default())
            .map_err(|e| open_failed(&config.device, e))?,
    };
    place_blocking_work(&mut *dev, pinned, config)?;
    if let Some(mkfs) = &config.mkfs {
        dev = Filesystem::mkfs(dev, mkfs)?;
    }
    Filesystem::mount(dev, config.mount.clone())
}

pub(crate) struct Reactor {
    fs: Filesystem,
    commit_interval: Duration,
    /// The reactor thread's waits for a core ([`crate::contention`]), looked at as it turns.
    run_delay: crate::contention::Meter,
    /// The core the reactor is pinned to (None: not pinned).
    pinned: Option<Pinned>,
    hist: Histograms,
    stats: ReactorStats,
    cpu_start_ns: u64,
    /// fsync groups whose records are in flight, oldest first (tickets ascend).
    pending: VecDeque<PendingGroup>,
    /// Since when a due commit waits for the records in flight (`COMMIT_DEFER_MAX`, [`commit`]).
    commit_deferred_since: Option<Instant>,
    /// A due commit waited `COMMIT_DEFER_MAX` for the device pipeline to empty: until it
    /// does, the requests that would add to it (fsyncs, writes) park, and the commit starts
    /// once it is empty ([`commit`]).
    commit_barrier: bool,
    /// Preparation steps the due commit has taken (`PREPARE_STEPS_MAX`, [`commit`]).
    prepare_steps: u32,
    /// Loop turns so far ([`Reactor::looked`]), and the turn in which the commit last took a
    /// step of CPU work (a preparation step, its start, or a serialization slice): one per
    /// turn, so that no turn holds the clients for more than one step ([`commit`]).
    turn: u64,
    commit_step_turn: u64,
    /// With several reactors: this one's side of the coordination ([`crate::multi`]).
    multi: Option<Member>,
    /// Replies held until a generation is durable (syncs, fsyncs that fell back, directory
    /// renames with several reactors).
    commit_waiters: Vec<crate::multi::CommitWaiter>,
    /// Every request taken into a batch and not yet answered or handed on: what a failed
    /// reactor answers ([`crate::owed`]).
    owed: Owed,
    /// Reads whose device I/O is in flight, by the engine's read set (one each): answered
    /// from [`Filesystem::read_progress`] while the reactor serves other requests. Bounded
    /// by the requests owed.
    parked_reads: std::collections::HashMap<u64, Request>,
    /// Requests parked while the tree nodes their lookups need are read, and the requests
    /// of their clients behind them ([`crate::meta_wait`]).
    pub(crate) meta: MetaWaits,
    /// When the loop last looked at its queues, the longest it went without looking, and
    /// how much of that it can have spent running.
    gaps: crate::stats::GapMeter,
    /// The running mean of the time fsync records took to become durable, in ns (0 before
    /// the first): how long a spin-then-park reactor spins for the next ([`durable_spin_budget`]).
    durable_ns_ewma: u64,
    /// Test hook: panic when the next request runs ([`Runtime::panic_on_next_request`]).
    #[cfg(any(test, feature = "test-hooks"))]
    panic_next: Arc<std::sync::atomic::AtomicBool>,
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

impl Reactor {
    pub(crate) fn new(mut fs: Filesystem, commit_interval: Duration) -> Reactor {
        // Commits run in the background here; an fsync that needs one waits for it.
        fs.defer_commits(true);
        Reactor {
            // Opened on the reactor's own thread (it measures the thread that opens it).
            run_delay: crate::contention::Meter::new("a reactor"),
            pinned: None,
            fs,
            commit_interval,
            hist: Histograms::new(),
            stats: ReactorStats::default(),
            cpu_start_ns: thread_cpu_ns(),
            pending: VecDeque::new(),
            commit_deferred_since: None,
            commit_barrier: false,
            prepare_steps: 0,
            turn: 0,
            commit_step_turn: u64::MAX,
            multi: None,
            commit_waiters: Vec::new(),
            owed: Owed::default(),
            parked_reads: Default::default(),
            meta: MetaWaits::default(),
            gaps: Default::default(),
            durable_ns_ewma: 0,
            #[cfg(any(test, feature = "test-hooks"))]
            panic_next: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// Pushes completions to their clients ([`deliver`]); they are no longer owed.
    fn deliver(&mut self, done: Vec<(Arc<ReplyQueue>, Completion)>) {
        let now = Instant::now();
        for (reply, completion) in &done {
            if let Some(submitted) = self.owed.settle(reply, completion.token) {
                let ns = now.saturating_duration_since(submitted).as_nanos() as u64;
                let _ = self.hist.reply.record(ns.max(1));
            }
        }
        deliver(done);
    }

    fn snapshot(&mut self) -> ReactorStats {
        let mut s = self.stats.clone();
        s.cpu_ns = thread_cpu_ns().saturating_sub(self.cpu_start_ns);
        self.hist.fill(&mut s);
        s.commit = self.fs.commit_stats();
        s.log = self.fs.log_stats();
        s.unpinned_blocks_last = s.commit.last_unpinned_blocks;
        s.reads = self.fs.read_stats();
        s.device_waits = self.fs.device_wait_stats();
        s.meta_parks = self.meta.parks;
        s.room_parks = self.meta.room_parks;
        s.barrier_parks = self.meta.barrier_parks;
        s.fetch = self.fs.fetch_stats();
        (s.data_cache_hits, s.data_blocks_read) = self.fs.data_cache_hits();
        let decoded = self.fs.decoded_stats();
        s.decoded_hits = decoded.inode_hits + decoded.chain_hits;
        s.decoded_misses = decoded.inode_misses + decoded.chain_misses;
        s.space = self.fs.space_pool().stats();
        s
    }

    /// The engine's deferred-lookup counters (the simulation reports read-ahead from them).
    #[cfg(feature = "sim")]
    pub(crate) fn fetch_stats(&self) -> engine::FetchStats {
        self.fs.fetch_stats()
    }

    /// The filesystem's pool of block groups (the simulation reports hand-overs from it).
    #[cfg(feature = "sim")]
    pub(crate) fn space_pool(&self) -> std::sync::Arc<engine::space::Pool> {
        self.fs.space_pool()
    }

    /// Unmounts (commits unless the filesystem failed) and gives the device back.
    #[cfg(feature = "sim")]
    pub(crate) fn unmount(self) -> Result<Box<dyn BlockDevice>, EngineError> {
        self.fs.unmount()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spin for an fsync's record: none before a record was timed, twice the running
    /// mean, never past the maximum, none on a device slower than it.
    #[test]
    fn a_durable_spin_covers_twice_the_usual_record_within_its_maximum() {
        let max = DURABLE_SPIN_MAX;
        assert_eq!(durable_spin_budget(0, max), Duration::ZERO);
        assert_eq!(durable_spin_budget(90_000, max), Duration::from_micros(180));
        assert_eq!(durable_spin_budget(200_000, max), max);
        assert_eq!(durable_spin_budget(max.as_nanos() as u64, max), max);
        assert_eq!(
            durable_spin_budget(max.as_nanos() as u64 + 1, max),
            Duration::ZERO
        );
        assert_eq!(durable_spin_budget(90_000, Duration::ZERO), Duration::ZERO);
    }

    /// The running mean starts at the first record, moves an eighth of the way per record,
    /// and one record held behind a commit moves it by at most an eighth of the cap.
    #[test]
    fn the_running_mean_of_records_follows_them_and_caps_an_outlier() {
        let first = durable_ns_ewma_next(0, 80_000);
        assert_eq!(first, 80_000);
        assert_eq!(durable_ns_ewma_next(first, 160_000), 90_000);
        let held = durable_ns_ewma_next(first, 40_000_000);
        assert_eq!(held, 80_000 - 10_000 + DURABLE_SAMPLE_NS_MAX / 8);
        // Still under the spin's maximum: the next records are spun for, not slept through.
        assert!(
            durable_spin_budget(held, DURABLE_SPIN_MAX) > Duration::ZERO,
            "{held}"
        );
        // A sample of 0 ns never makes the mean read "no record timed yet".
        assert_eq!(durable_ns_ewma_next(0, 0), 1);
        assert!(durable_ns_ewma_next(1, 0) >= 1);
    }
}
