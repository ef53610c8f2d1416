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

use crate::client::{Client, ReplyQueue};
use crate::op::{Completion, Op, Reply};
use crate::stats::{thread_cpu_ns, Histograms, Latency, ReactorStats};
use crossbeam_queue::ArrayQueue;
use engine::log::FsyncStart;
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::BlockDevice;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle reactor with fsync records in flight sleeps on its device queue before it
/// looks at the request queue again (spin-then-park only; busy-poll never sleeps). The sleep
/// ends at the first completion, so this bounds only how late a new request is noticed while
/// a flush runs. 50 µs slices made the reactor wake ~4 times per flush and compete with the
/// kernel's fsync worker on 2 cores: SQLite WAL fell from 2,680 to 900–1,450 tx/s; with 1 ms
/// it is 2,930 and 16 fsync clients did not lose (30k fsyncs/s).
const LOG_WAIT_SLICE: Duration = Duration::from_millis(1);

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
    /// Pin the reactor to this core (None: not pinned).
    pub core: Option<usize>,
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
            idle: IdlePolicy::default(),
            queue_capacity: 4096,
            batch_max: 256,
        }
    }
}

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
    parked: AtomicBool,
    reactor: OnceLock<Thread>,
    /// Clients waiting for a reply right now (spinning or asleep), and how many may wait
    /// spinning: the cores besides the reactor's. A client spins only while the waiters fit
    /// those cores — one client on 2 cores spins (a SQLite connection's calls answered in
    /// microseconds), four do not: on 2 cores, 4 spinning clients spent a quarter of all CPU
    /// time spinning, and without spinning the dbench-like mix ran 30% faster.
    pub waiters: std::sync::atomic::AtomicUsize,
    pub spinners_max: usize,
}

impl Shared {
    pub(crate) fn new(queue_capacity: usize) -> Shared {
        Shared {
            requests: ArrayQueue::new(queue_capacity.max(1)),
            stopping: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            reactor: OnceLock::new(),
            waiters: std::sync::atomic::AtomicUsize::new(0),
            spinners_max: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .saturating_sub(1),
        }
    }

    /// Wakes the reactor if it is parked (a submit calls this).
    pub fn wake_reactor(&self) {
        // The request was pushed before this load: fence so the push is visible before
        // `parked` is read (see `ReplyQueue::wake`), or a parking reactor could miss it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            if let Some(thread) = self.reactor.get() {
                thread.unpark();
            }
        }
    }
}

/// What a stopped reactor hands back: its final statistics and the unmounted device.
type Stopped = (ReactorStats, Box<dyn BlockDevice>);

/// A running reactor. Dropping it without [`Runtime::shutdown`] also shuts down.
pub struct Runtime {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Result<Stopped, EngineError>>>,
}

impl Runtime {
    /// Starts the reactor thread, which opens (and formats, if asked) the device and mounts it;
    /// returns once it serves requests, or with the error that stopped it.
    pub fn start(config: Config) -> Result<Runtime, EngineError> {
        Self::spawn(config, None)
    }

    /// As [`Runtime::start`] on a device the caller opened (a wrapped or simulated one;
    /// `config.device` is then only its name). The device must not have done I/O yet if its
    /// queue is single-issuer (the io_uring backends).
    pub fn start_with_device(
        config: Config,
        dev: Box<dyn BlockDevice>,
    ) -> Result<Runtime, EngineError> {
        Self::spawn(config, Some(dev))
    }

    fn spawn(config: Config, dev: Option<Box<dyn BlockDevice>>) -> Result<Runtime, EngineError> {
        let shared = Arc::new(Shared::new(config.queue_capacity));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let reactor_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("corefs-reactor".into())
            .spawn(move || {
                let _ = reactor_shared.reactor.set(std::thread::current());
                // Set even if the reactor panics, so waiting clients return instead of hanging.
                struct MarkStopped<'a>(&'a AtomicBool);
                impl Drop for MarkStopped<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::Release);
                    }
                }
                let _stopped = MarkStopped(&reactor_shared.stopped);
                run(&reactor_shared, &config, dev, &ready_tx)
            })
            .map_err(|e| EngineError::Invalid(format!("starting the reactor thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Runtime {
                shared,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(match thread.join() {
                Ok(Err(e)) => e,
                _ => EngineError::Invalid("the reactor thread died while starting".into()),
            }),
        }
    }

    /// A client handle with room for `capacity` operations in flight.
    pub fn client(&self, capacity: usize) -> Client {
        Client::new(self.shared.clone(), capacity)
    }

    /// Stops taking requests, runs those queued, commits, unmounts; returns the final
    /// statistics.
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
        self.shared.stopping.store(true, Ordering::Release);
        if let Some(thread) = self.shared.reactor.get() {
            thread.unpark();
        }
        match self.thread.take() {
            Some(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(EngineError::Invalid("the reactor panicked".into()))),
            None => Err(EngineError::Invalid("already shut down".into())),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if self.thread.is_some() {
            if let Err(e) = self.stop() {
                tracing::error!("reactor shutdown: {e}");
            }
        }
    }
}

fn open(config: &Config, dev: Option<Box<dyn BlockDevice>>) -> Result<Filesystem, EngineError> {
    let mut dev = match dev {
        Some(dev) => dev,
        None => nvme::open_device(&config.device, &nvme::OpenOptions::default())
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", config.device)))?,
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
}

/// An fsync group waiting for its record to become durable.
struct PendingGroup {
    ticket: u64,
    waiters: Vec<(Request, Instant)>,
    group_start: Instant,
}

fn run(
    shared: &Shared,
    config: &Config,
    dev: Option<Box<dyn BlockDevice>>,
    ready: &std::sync::mpsc::SyncSender<Result<(), EngineError>>,
) -> Result<Stopped, EngineError> {
    if let Some(core) = config.core {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
            tracing::warn!(
                core,
                "could not pin the reactor to core {core}; running unpinned"
            );
        }
    }
    let fs = match open(config, dev) {
        Ok(fs) => fs,
        Err(e) => {
            let _ = ready.send(Err(e.clone()));
            return Err(e);
        }
    };
    let _ = ready.send(Ok(()));
    let mut reactor = Reactor::new(fs, config.mount.commit_interval);
    let mut batch: Vec<Request> = Vec::with_capacity(config.batch_max);
    let mut idle_since: Option<Instant> = None;
    loop {
        while batch.len() < config.batch_max {
            match shared.requests.pop() {
                Some(r) => batch.push(r),
                None => break,
            }
        }
        if !batch.is_empty() {
            idle_since = None;
            reactor.run_batch(&mut batch);
            reactor.tick();
            continue;
        }
        if !reactor.pending.is_empty() {
            // Records in flight and nothing queued: poll the device (busy-poll), or sleep on
            // it briefly (shared cores) and look at the queue again.
            let wait = match config.idle {
                IdlePolicy::BusyPoll => None,
                IdlePolicy::SpinThenPark { .. } => Some(LOG_WAIT_SLICE),
            };
            reactor.poll_durable(wait);
            continue;
        }
        if shared.stopping.load(Ordering::Acquire) && shared.requests.is_empty() {
            break;
        }
        reactor.tick();
        match config.idle {
            IdlePolicy::BusyPoll => std::hint::spin_loop(),
            IdlePolicy::SpinThenPark { spin } => {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() < spin {
                    std::hint::spin_loop();
                    continue;
                }
                shared.parked.store(true, Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                if shared.requests.is_empty() && !shared.stopping.load(Ordering::Acquire) {
                    reactor.stats.parks += 1;
                    // Wake for the commit timer even when no client comes.
                    let timer = reactor.commit_interval / 4;
                    std::thread::park_timeout(
                        timer.clamp(Duration::from_millis(1), Duration::from_millis(500)),
                    );
                }
                shared.parked.store(false, Ordering::SeqCst);
            }
        }
    }
    // Every fsync waiter goes before the reactor does.
    while !reactor.pending.is_empty() {
        reactor.poll_durable(Some(Duration::from_millis(100)));
    }
    let stats = reactor.snapshot();
    tracing::info!(
        ops = stats.ops,
        cpu_ns_per_op = stats.cpu_ns_per_op() as u64,
        commits = stats.commit.commits,
        log_writes = stats.log.log_writes,
        fallbacks = stats.log.fallback_commits(),
        fsync_p99_us = stats.fsync_total.p99_ns / 1000,
        "reactor stopping"
    );
    let dev = reactor.fs.unmount()?;
    Ok((stats, dev))
}

impl Reactor {
    pub(crate) fn new(fs: Filesystem, commit_interval: Duration) -> Reactor {
        Reactor {
            fs,
            commit_interval,
            hist: Histograms::new(),
            stats: ReactorStats::default(),
            cpu_start_ns: thread_cpu_ns(),
            pending: VecDeque::new(),
        }
    }

    /// fsync groups whose records are not durable yet.
    pub(crate) fn pending_groups(&self) -> usize {
        self.pending.len()
    }

    /// Unmounts (commits unless the filesystem failed) and gives the device back.
    pub(crate) fn unmount(self) -> Result<Box<dyn BlockDevice>, EngineError> {
        self.fs.unmount()
    }

    pub(crate) fn tick(&mut self) {
        let before = self.fs.commit_stats().commits;
        if let Err(e) = self.fs.tick() {
            tracing::error!("background commit failed: {e}");
        }
        // A commit drains the records in flight: release their waiters.
        self.poll_durable(None);
        let after = self.fs.commit_stats();
        if after.commits > before {
            tracing::debug!(
                commits = after.commits,
                commit_us = after.last_commit_ns / 1000,
                super_commit_us = after.last_super_commit_ns / 1000,
                unpinned = after.last_unpinned_blocks,
                "commit"
            );
        }
    }

    pub(crate) fn snapshot(&mut self) -> ReactorStats {
        let mut s = self.stats.clone();
        s.cpu_ns = thread_cpu_ns().saturating_sub(self.cpu_start_ns);
        s.fsync_queue_wait = Latency::of(&self.hist.queue_wait);
        s.fsync_log_write = Latency::of(&self.hist.log_write);
        s.fsync_commit_wait = Latency::of(&self.hist.commit_wait);
        s.fsync_total = Latency::of(&self.hist.total);
        s.commit = self.fs.commit_stats();
        s.log = self.fs.log_stats();
        s.unpinned_blocks_last = s.commit.last_unpinned_blocks;
        s
    }

    /// Runs a batch: every operation in order; the fsyncs are checked when reached and made
    /// durable together at the end; then completions go out and clients wake.
    pub(crate) fn run_batch(&mut self, batch: &mut Vec<Request>) {
        self.stats.batches += 1;
        let mut done: Vec<(Arc<ReplyQueue>, Completion)> = Vec::with_capacity(batch.len());
        let mut fsyncs: Vec<(Request, (u64, bool), Instant)> = Vec::new();
        let mut syncs: Vec<Request> = Vec::new();
        let mut reads: Vec<Request> = Vec::new();
        for request in batch.drain(..) {
            self.stats.ops += 1;
            // Consecutive reads run together, their device reads all in flight at once; any
            // other operation first lets the reads before it finish, so order is kept.
            if matches!(request.op, Op::Read { .. }) {
                reads.push(request);
                continue;
            }
            self.run_reads(&mut reads, &mut done);
            if let Some(member) = request.op.is_fsync() {
                let started = Instant::now();
                match self.fs.check_exists(member.0) {
                    Ok(()) => fsyncs.push((request, member, started)),
                    Err(e) => done.push((
                        request.reply.clone(),
                        Completion {
                            token: request.token,
                            result: Err(e),
                        },
                    )),
                }
                continue;
            }
            if matches!(request.op, Op::Sync) {
                syncs.push(request);
                continue;
            }
            let result = self.execute(request.op);
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result,
                },
            ));
        }
        self.run_reads(&mut reads, &mut done);
        if !fsyncs.is_empty() {
            let members: Vec<(u64, bool)> = fsyncs.iter().map(|(_, m, _)| *m).collect();
            let fallbacks = self.fs.log_stats().fallback_commits();
            let group_start = Instant::now();
            let result = self.fs.fsync_group_start(&members);
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
                Ok(FsyncStart::Pending(ticket)) => self.pending.push_back(PendingGroup {
                    ticket,
                    waiters,
                    group_start,
                }),
                Ok(FsyncStart::Durable) => {
                    self.finish_group(waiters, group_start, fell_back, Ok(()), &mut done)
                }
                Err(e) => self.finish_group(waiters, group_start, false, Err(e), &mut done),
            }
        }
        if !syncs.is_empty() {
            // Returns at SuperCommitted; tick() unpins after the waiters are released.
            let result = self.fs.commit_to_super().map(drop);
            for request in syncs {
                done.push((
                    request.reply,
                    Completion {
                        token: request.token,
                        result: result.clone().map(|()| Reply::Done),
                    },
                ));
            }
        }
        self.collect_durable(None, &mut done);
        deliver(done);
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
        if self.pending.is_empty() {
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
        let mut done = Vec::new();
        self.collect_durable(wait, &mut done);
        deliver(done);
    }

    /// Runs the queued reads: one alone as any operation, several through
    /// [`Filesystem::read_many`].
    fn run_reads(
        &mut self,
        reads: &mut Vec<Request>,
        done: &mut Vec<(Arc<ReplyQueue>, Completion)>,
    ) {
        if reads.len() == 1 {
            let request = reads.pop().expect("one read");
            let result = self.execute(request.op);
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result,
                },
            ));
            return;
        }
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
        let results = self.fs.read_many(&wanted);
        for (request, result) in reads.drain(..).zip(results) {
            done.push((
                request.reply,
                Completion {
                    token: request.token,
                    result: result.map(Reply::Data),
                },
            ));
        }
    }

    fn execute(&mut self, op: Op) -> Result<Reply, EngineError> {
        let fs = &mut self.fs;
        Ok(match op {
            Op::Resolve { path } => {
                let ino = fs.resolve(&path)?;
                Reply::Stat(fs.stat(ino)?)
            }
            Op::Lookup { dir, name } => Reply::Stat(fs.lookup(dir, &name)?),
            Op::Create { dir, name, mode } => Reply::Stat(fs.create(dir, &name, mode, 0, 0)?),
            Op::Mkdir { dir, name, mode } => Reply::Stat(fs.mkdir(dir, &name, mode, 0, 0)?),
            Op::Symlink { dir, name, target } => {
                Reply::Stat(fs.symlink(dir, &name, &target, 0, 0)?)
            }
            Op::Readlink { ino } => Reply::Data(fs.readlink(ino)?),
            Op::Link { ino, dir, name } => Reply::Stat(fs.link(ino, dir, &name)?),
            Op::Unlink { dir, name } => fs.unlink(dir, &name).map(|()| Reply::Done)?,
            Op::Rmdir { dir, name } => fs.rmdir(dir, &name).map(|()| Reply::Done)?,
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
                flags,
            } => fs
                .rename(from_dir, &from, to_dir, &to, flags)
                .map(|()| Reply::Done)?,
            Op::Readdir { dir, cookie, max } => Reply::Entries(fs.readdir(dir, cookie, max)?),
            Op::Stat { ino } => Reply::Stat(fs.stat(ino)?),
            Op::SetAttr { ino, change } => Reply::Stat(fs.setattr(ino, change)?),
            Op::Read { ino, offset, len } => Reply::Data(fs.read(ino, offset, len)?),
            Op::Write { ino, offset, data } => Reply::Written(fs.write(ino, offset, &data)?),
            Op::Truncate { ino, size } => fs.truncate(ino, size).map(|()| Reply::Done)?,
            Op::Fallocate {
                ino,
                mode,
                offset,
                len,
            } => fs.fallocate(ino, mode, offset, len).map(|()| Reply::Done)?,
            Op::SetXattr {
                ino,
                name,
                value,
                flags,
            } => fs
                .setxattr(ino, &name, &value, flags)
                .map(|()| Reply::Done)?,
            Op::GetXattr { ino, name } => Reply::Data(fs.getxattr(ino, &name)?),
            Op::ListXattr { ino } => Reply::Names(fs.listxattr(ino)?),
            Op::RemoveXattr { ino, name } => fs.removexattr(ino, &name).map(|()| Reply::Done)?,
            Op::Statfs => Reply::Statfs(fs.statfs()),
            Op::Stats => Reply::Stats(Box::new(self.snapshot())),
            Op::Fsync { .. } | Op::Fdatasync { .. } | Op::Sync => {
                unreachable!("handled by the batch")
            }
        })
    }
}

/// Pushes completions to their clients, then wakes each client once (never inline while the
/// engine is mid-operation).
fn deliver(done: Vec<(Arc<ReplyQueue>, Completion)>) {
    let mut to_wake: Vec<Arc<ReplyQueue>> = Vec::new();
    for (reply, completion) in done {
        // Cannot fail: a client never has more in flight than its queue holds.
        assert!(
            reply.done.push(completion).is_ok(),
            "completion queue overflow"
        );
        if !to_wake.iter().any(|r| Arc::ptr_eq(r, &reply)) {
            to_wake.push(reply);
        }
    }
    for reply in to_wake {
        reply.wake();
    }
}
