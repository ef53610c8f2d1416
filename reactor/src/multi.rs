//! Several reactors on one filesystem: the shards spread over the reactors (shard `s` to
//! reactor `s % N`), each reactor a partition of the engine on its own device queue
//! ([`engine::partition`]), and a commit coordinator thread.
//!
//! ```text
//!            route by inode / directory               forward (read-only) / span
//! clients ──────────────────────────► reactor 0 ◄──────────────────────────► reactor 1
//!                                         │  commit requests, spans, stats       │
//!                                         └────────────► coordinator ◄───────────┘
//!                                     prepare / done / lend / return (control channels)
//! ```
//!
//! # Invariants
//! - A client sends an operation to the reactor owning its inode (a directory operation: the
//!   directory's). The reactor runs it when every shard it touches is its own; a read that
//!   needs another reactor's inode (a lookup's child, the rest of a path) is forwarded there;
//!   a change touching another reactor's shards is a *span*: the coordinator borrows the
//!   shards of every reactor, runs it on its own engine, marks what it changed and gives the
//!   shards back. The reactors hold the requests for lent shards until then, so no operation
//!   observes half of a span, and a span lands in one generation.
//! - Commits are coordinated: on request (a reactor's fsync fallback, sync, directory rename,
//!   commit timer or dirty limit) the coordinator asks every reactor for its half, writes the
//!   superblock, and tells every reactor SuperCommitted; each releases its waiters then and
//!   unpins on its own afterwards. A reactor does nothing else between its half and the
//!   superblock (commits stop the world here; see docs/reactors.md).
//! - In partitioned mode a directory rename commits before it returns (the fsync log stops
//!   its walk up at partition boundaries, which is sound only if no directory's name above a
//!   boundary changes unlogged: [`engine::partition`]).
//! - Channels: a reactor → coordinator message is either a client request (bounded by the
//!   clients' capacities) or one step of a protocol the coordinator runs one at a time (one
//!   message per reactor); the coordinator → reactor control messages likewise. Nothing grows
//!   without bound.
//!
//! Fault model: a failed commit or span makes every partition fail-stop with the error
//! (sticky, read-only); waiters of that commit get the error.

use crate::delivery::{deliver, deliver_failed};
use crate::execute::execute_on;
use crate::op::{Completion, Op, Reply};
use crate::queue::{Request, Shared};
use crate::reply::ReplyQueue;
use crate::stats::{Histograms, ReactorStats};
use engine::format::{ShardRoot, Superblock};
use engine::partition::Lent;
use engine::{EngineError, Filesystem};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which reactor owns which shard, and every reactor's queue.
pub(crate) struct Router {
    pub reactors: Vec<Arc<Shared>>,
    pub shard_count: u32,
    /// The filesystem's pool of block groups (several reactors: statfs adds its free groups
    /// once to what the reactors publish of their shards).
    pub pool: Option<Arc<engine::space::Pool>>,
    /// Set once, when a reactor or the coordinator panics: the whole runtime has failed
    /// ([`crate::runtime`]'s `serve` module says why and what each thread then does).
    failure: std::sync::OnceLock<EngineError>,
}

impl Router {
    pub fn new(
        reactors: Vec<Arc<Shared>>,
        shard_count: u32,
        pool: Option<Arc<engine::space::Pool>>,
    ) -> Router {
        Router {
            reactors,
            shard_count,
            pool,
            failure: std::sync::OnceLock::new(),
        }
    }

    /// The runtime has failed with `e` (the first failure wins and is returned); every
    /// reactor is woken to notice.
    pub fn fail(&self, e: EngineError) -> EngineError {
        let _ = self.failure.set(e);
        for r in &self.reactors {
            r.doorbell.ring();
        }
        self.failure.get().cloned().expect("set above")
    }

    /// The runtime's failure, once a reactor or the coordinator panicked.
    pub fn failure(&self) -> Option<&EngineError> {
        self.failure.get()
    }

    pub fn owner_of_shard(&self, shard: u32) -> usize {
        shard as usize % self.reactors.len()
    }

    pub fn owner_of(&self, ino: u64) -> usize {
        self.owner_of_shard((ino % self.shard_count as u64) as u32)
    }

    /// The reactor an operation goes to first.
    pub fn route(&self, op: &Op) -> usize {
        if self.reactors.len() == 1 {
            return 0;
        }
        match op {
            Op::Walk { from: ino, .. }
            | Op::Open { dir: ino, .. }
            | Op::Lookup { dir: ino, .. }
            | Op::Create { dir: ino, .. }
            | Op::Mkdir { dir: ino, .. }
            | Op::Symlink { dir: ino, .. }
            | Op::Mknod { dir: ino, .. }
            | Op::Link { dir: ino, .. }
            | Op::Unlink { dir: ino, .. }
            | Op::Rmdir { dir: ino, .. }
            | Op::Readdir { dir: ino, .. }
            | Op::Rename { from_dir: ino, .. }
            | Op::Readlink { ino }
            | Op::Stat { ino }
            | Op::SetAttr { ino, .. }
            | Op::Read { ino, .. }
            | Op::Write { ino, .. }
            | Op::Append { ino, .. }
            | Op::Hold { ino }
            | Op::Release { ino }
            | Op::Truncate { ino, .. }
            | Op::Fallocate { ino, .. }
            | Op::SetXattr { ino, .. }
            | Op::GetXattr { ino, .. }
            | Op::ListXattr { ino }
            | Op::RemoveXattr { ino, .. }
            | Op::Fsync { ino }
            | Op::Fdatasync { ino }
            | Op::WriteAtomic { ino, .. } => self.owner_of(*ino),
            Op::Sync | Op::Statfs | Op::Stats => 0,
        }
    }
}

/// Reactor → coordinator.
pub(crate) enum ToCoordinator {
    /// A reactor has waiters for a commit (or one is due).
    CommitRequest,
    /// A client request that touches shards of several reactors; `place`: the shard a new
    /// directory goes to.
    Span(Box<Request>, Option<u32>),
    Stats(Box<Request>),
    Lent(usize, Box<Result<Lent, EngineError>>),
    Half(usize, Box<Half>),
    Snapshot(Box<(ReactorStats, Histograms)>),
    /// The reactor is stopping and has nothing queued or waiting.
    Drained(usize),
}

/// A reactor's half of a commit: its shards' new roots (None: nothing changed), or the
/// error that failed it.
pub(crate) type Half = Result<Option<Vec<(u32, ShardRoot)>>, EngineError>;

/// Coordinator → reactor.
pub(crate) enum Control {
    Lend,
    Return(Lent),
    CommitPrepare,
    CommitDone(Box<Superblock>),
    CommitFailed(EngineError),
    Snapshot,
    Exit,
}

/// A reply held until generation `generation` is durable (SuperCommitted).
pub(crate) struct CommitWaiter {
    pub request: Request,
    pub reply: Reply,
    /// For an fsync that fell back: when it was checked and when its group started.
    pub fsync: Option<(Instant, Instant)>,
    /// The running generation when it was queued: its changes are in that one.
    pub generation: u64,
}

/// A reactor's side of the protocol.
pub(crate) struct Member {
    pub index: usize,
    pub router: Arc<Router>,
    pub to_coordinator: Sender<ToCoordinator>,
    pub coordinator: std::thread::Thread,
    pub control: Receiver<Control>,
    /// A commit was asked for and its done (or failure) has not come yet.
    pub commit_asked: bool,
    /// This reactor's half of the coordinated commit in flight was sent.
    pub half_sent: bool,
    /// Every shard is lent to the coordinator: requests wait in `deferred`.
    pub away: bool,
    pub deferred: VecDeque<Request>,
    /// Round-robin over every shard for new directories.
    pub next_dir_shard: u64,
    pub drained_sent: bool,
}

impl Member {
    pub fn tell(&self, message: ToCoordinator) {
        // The coordinator outlives every reactor: a send cannot fail while it runs.
        let _ = self.to_coordinator.send(message);
        self.coordinator.unpark();
    }

    /// Sends a client request on to the coordinator; gives it back if the coordinator has
    /// gone (it only goes before the reactors when its thread died).
    pub fn hand_on(&self, message: ToCoordinator) -> Result<(), Box<Request>> {
        let sent = self.to_coordinator.send(message);
        self.coordinator.unpark();
        match sent {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::SendError(
                ToCoordinator::Span(request, _) | ToCoordinator::Stats(request),
            )) => Err(request),
            Err(_) => Ok(()),
        }
    }

    pub fn ask_commit(&mut self) {
        if !self.commit_asked {
            self.commit_asked = true;
            self.tell(ToCoordinator::CommitRequest);
        }
    }
}

/// Where a request runs.
pub(crate) enum Plan {
    /// Here: every shard it touches is held here.
    Local,
    /// On another reactor, as this (read-only) operation.
    Forward(usize, Op),
    /// On the coordinator with every shard (a change spanning reactors); the new directory's
    /// shard for a mkdir.
    Span(Option<u32>),
    /// Answered without the engine.
    Answer(Result<Reply, EngineError>),
}

fn held_or_absent(fs: &Filesystem, ino: Option<u64>) -> bool {
    ino.is_none_or(|i| fs.holds(fs.shard_of(i)))
}

/// Decides where `op` runs, reading only shards held here. Errors found here (a missing
/// directory) are the operation's result.
pub(crate) fn plan(fs: &mut Filesystem, member: &mut Member, op: &Op) -> Plan {
    match plan_inner(fs, member, op) {
        Ok(plan) => plan,
        Err(e) => Plan::Answer(Err(e)),
    }
}

fn plan_inner(fs: &mut Filesystem, member: &mut Member, op: &Op) -> Result<Plan, EngineError> {
    let holds = |fs: &Filesystem, ino: u64| fs.holds(fs.shard_of(ino));
    Ok(match op {
        // An open of a name whose inode another reactor holds is held there (by number: the
        // name may go meanwhile, and then the client starts over).
        Op::Open { dir, name, how } if !name.is_empty() => match fs.lookup_ino(*dir, name)? {
            Some(_) if how.create.is_some() && how.exclusive => {
                Plan::Answer(Err(EngineError::Exists))
            }
            Some(child) if !holds(fs, child) => Plan::Forward(
                member.router.owner_of(child),
                Op::Open {
                    dir: child,
                    name: Vec::new(),
                    how: *how,
                },
            ),
            _ => Plan::Local,
        },
        Op::Lookup { dir, name } => match fs.lookup_ino(*dir, name)? {
            Some(child) if !holds(fs, child) => {
                Plan::Forward(member.router.owner_of(child), Op::Stat { ino: child })
            }
            _ => Plan::Local,
        },
        Op::Mkdir { .. } => {
            let count = fs.shard_count() as u64;
            let shard = (member.next_dir_shard % count) as u32;
            member.next_dir_shard += 1;
            if fs.holds(shard) {
                fs.place_next(shard);
                Plan::Local
            } else {
                Plan::Span(Some(shard))
            }
        }
        Op::Unlink { dir, name } | Op::Rmdir { dir, name } => {
            let child = fs.lookup_ino(*dir, name)?;
            if held_or_absent(fs, child) {
                Plan::Local
            } else {
                Plan::Span(None)
            }
        }
        Op::Link { ino, dir, .. } => {
            if holds(fs, *ino) && holds(fs, *dir) {
                Plan::Local
            } else {
                Plan::Span(None)
            }
        }
        Op::Rename {
            from_dir,
            from,
            to_dir,
            to,
            ..
        } => {
            if !holds(fs, *to_dir) {
                Plan::Span(None)
            } else {
                let child = fs.lookup_ino(*from_dir, from)?;
                let target = fs.lookup_ino(*to_dir, to)?;
                if held_or_absent(fs, child)
                    && held_or_absent(fs, target)
                    && loop_check_local(fs, *from_dir, from, *to_dir, to)?
                {
                    Plan::Local
                } else {
                    Plan::Span(None)
                }
            }
        }
        Op::Statfs => Plan::Answer(Ok(Reply::Statfs(statfs(&member.router)))),
        _ => Plan::Local,
    })
}

/// True when what a rename walks to refuse a loop is held here: moving a directory walks up
/// from its new parent (is it moving into its own subtree?), and a target directory is
/// looked for above the old parent (an exchange would move it into its own subtree; a
/// rename over it finds it not empty). A walk that would leave the
/// partition makes the rename a span (read there, it failed: EINVAL for renames of
/// directories whose new parent had an ancestor on another reactor).
fn loop_check_local(
    fs: &mut Filesystem,
    from_dir: u64,
    from: &[u8],
    to_dir: u64,
    to: &[u8],
) -> Result<bool, EngineError> {
    let is_dir = |fs: &mut Filesystem, dir: u64, name: &[u8]| match fs.lookup(dir, name) {
        Ok(stat) => Ok(stat.is_dir()),
        Err(EngineError::NotFound) => Ok(false),
        Err(e) => Err(e),
    };
    if is_dir(fs, from_dir, from)? && !fs.ancestry_held(to_dir)? {
        return Ok(false);
    }
    if is_dir(fs, to_dir, to)? && !fs.ancestry_held(from_dir)? {
        return Ok(false);
    }
    Ok(true)
}

/// statfs over every reactor's published figures (the free blocks in the groups their
/// shards own) and the pool's free groups.
fn statfs(router: &Router) -> engine::fs::StatFs {
    let mut total = 0;
    let mut free = 0;
    let mut inodes = 0;
    for r in &router.reactors {
        total += r.total_blocks.load(Ordering::Relaxed);
        free += r.free_blocks.load(Ordering::Relaxed);
        inodes += r.inodes.load(Ordering::Relaxed);
    }
    if let Some(pool) = &router.pool {
        total += pool.geometry().data_blocks();
        free += pool.available_blocks();
    }
    engine::fs::StatFs {
        block_bytes: engine::format::BLOCK_BYTES as u32,
        total_blocks: total,
        free_blocks: free,
        inodes,
        free_inodes: free.saturating_mul(engine::fs::INODES_PER_FREE_BLOCK),
        name_max: 255,
    }
}

/// True when a rename just made moved a directory (it must commit before it returns).
pub(crate) fn renamed_a_directory(fs: &mut Filesystem, op: &Op) -> bool {
    match op {
        Op::Rename { to_dir, to, .. } => fs.lookup(*to_dir, to).is_ok_and(|s| s.is_dir()),
        _ => false,
    }
}

/// The coordinator: the whole mount (holding no shard between spans), its device queue, and
/// a channel from and to every reactor.
pub(crate) struct Coordinator {
    pub fs: Filesystem,
    pub from_reactors: Receiver<ToCoordinator>,
    pub to_reactors: Vec<Sender<Control>>,
    pub router: Arc<Router>,
    /// Messages that arrived during a protocol step, handled after it.
    backlog: VecDeque<ToCoordinator>,
    drained: Vec<bool>,
    /// Coordinated commits timed here, from CommitPrepare to the superblock durable (what
    /// fsync waiters wait): this coordinator's own filesystem writes only the superblock.
    commit_ns_total: u64,
    commit_ns_max: u64,
    commit_ns_last: u64,
    /// The client request a span or a statistics step is serving: answered with the
    /// failure if the coordinator panics while it holds it.
    serving: Option<(Arc<ReplyQueue>, u64)>,
}

impl Coordinator {
    pub fn new(
        fs: Filesystem,
        from_reactors: Receiver<ToCoordinator>,
        to_reactors: Vec<Sender<Control>>,
        router: Arc<Router>,
    ) -> Coordinator {
        let n = to_reactors.len();
        Coordinator {
            fs,
            from_reactors,
            to_reactors,
            router,
            backlog: VecDeque::new(),
            drained: vec![false; n],
            commit_ns_total: 0,
            commit_ns_max: 0,
            commit_ns_last: 0,
            serving: None,
        }
    }

    fn send(&self, reactor: usize, control: Control) {
        let _ = self.to_reactors[reactor].send(control);
        let shared = &self.router.reactors[reactor];
        shared.control_pending.fetch_add(1, Ordering::SeqCst);
        shared.wake_reactor();
    }

    fn broadcast(&self, make: impl Fn() -> Control) {
        for r in 0..self.to_reactors.len() {
            self.send(r, make());
        }
    }

    /// The next message, waiting for it; None once the reactors are gone or the runtime
    /// failed.
    fn next(&mut self) -> Option<ToCoordinator> {
        if let Some(m) = self.backlog.pop_front() {
            return Some(m);
        }
        loop {
            if self.router.failure().is_some() {
                return None;
            }
            match self.from_reactors.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => return Some(m),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Waits for the message `pick` accepts, keeping the others for later. Fails when the
    /// runtime does (a failed reactor answers no protocol step: waiting for it would hang).
    fn wait_for<T>(
        &mut self,
        mut pick: impl FnMut(ToCoordinator) -> Result<T, ToCoordinator>,
    ) -> Result<T, EngineError> {
        loop {
            if let Some(e) = self.router.failure() {
                return Err(e.clone());
            }
            let m = match self.from_reactors.recv_timeout(Duration::from_millis(10)) {
                Ok(m) => m,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(EngineError::Internal(
                        "the reactors left during a coordinated step".into(),
                    ))
                }
            };
            match pick(m) {
                Ok(t) => return Ok(t),
                Err(other) => self.backlog.push_back(other),
            }
        }
    }

    /// Serves until every reactor has drained after a stop; then the final commit. Returns
    /// the whole mount (for the device).
    ///
    /// A panic here fails the whole runtime ([`Router::fail`]): the request being served is
    /// answered with the failure, and the coordinator then answers every request the
    /// reactors hand it with it until they are gone, so no client and no reactor waits for
    /// it forever.
    pub fn run(mut self) -> Result<Filesystem, EngineError> {
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve()));
        let failure = match served {
            Ok(result) => match self.router.failure() {
                None => return result.map(|()| self.fs),
                Some(e) => e.clone(),
            },
            Err(panic) => {
                let why = crate::panic_message(&*panic);
                tracing::error!("the commit coordinator panicked: {why}");
                self.router.fail(EngineError::Internal(format!(
                    "the commit coordinator panicked: {why}"
                )))
            }
        };
        if let Some((reply, token)) = self.serving.take() {
            deliver_failed(vec![(reply, token)], &failure);
        }
        self.serve_failed(&failure);
        Err(failure)
    }

    /// After a failure: answers every request handed here with `failure` until every
    /// reactor has gone (their ends of the channel closed).
    fn serve_failed(&mut self, failure: &EngineError) {
        let backlog: Vec<ToCoordinator> = self.backlog.drain(..).collect();
        for message in backlog.into_iter().chain(self.from_reactors.iter()) {
            if let ToCoordinator::Span(request, _) | ToCoordinator::Stats(request) = message {
                deliver_failed(vec![(request.reply, request.token)], failure);
            }
        }
    }

    fn serve(&mut self) -> Result<(), EngineError> {
        while let Some(message) = self.next() {
            match message {
                ToCoordinator::CommitRequest => {
                    let _ = self.commit_all();
                }
                ToCoordinator::Span(request, place) => self.span(*request, place, false),
                ToCoordinator::Stats(request) => self.stats(*request),
                ToCoordinator::Drained(r) => {
                    self.drained[r] = true;
                    if self.drained.iter().all(|&d| d) {
                        break;
                    }
                }
                ToCoordinator::Lent(..) | ToCoordinator::Half(..) | ToCoordinator::Snapshot(..) => {
                    unreachable!("protocol replies arrive only during their step")
                }
            }
        }
        if self.router.failure().is_some() {
            return Ok(());
        }
        // Shutdown: every reactor is idle; the last commit, then they unmount their queues.
        let result = if self.fs.failure().is_none() {
            self.commit_all().map(drop)
        } else {
            Ok(())
        };
        self.broadcast(|| Control::Exit);
        result
    }

    /// The coordinated commit. Releases every reactor's commit waiters (with the error, if
    /// it fails).
    pub fn commit_all(&mut self) -> Result<(), EngineError> {
        let generation = self.fs.generation();
        let started = std::time::Instant::now();
        self.broadcast(|| Control::CommitPrepare);
        let n = self.to_reactors.len();
        let mut halves: Vec<Option<Half>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let (r, half) = self.wait_for(|m| match m {
                ToCoordinator::Half(r, half) => Ok((r, half)),
                other => Err(other),
            })?;
            halves[r] = Some(*half);
        }
        let mut roots = Vec::new();
        let mut failure = self.fs.failure().cloned();
        let mut dirty = false;
        for half in halves.into_iter().flatten() {
            match half {
                Ok(Some(r)) => {
                    dirty = true;
                    roots.extend(r);
                }
                Ok(None) => {}
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        let result = match failure {
            Some(e) => Err(e),
            None => self.fs.write_super(&roots),
        };
        match result {
            Ok(sb) => {
                self.fs.commit_finish(&sb);
                let ns = started.elapsed().as_nanos() as u64;
                self.commit_ns_total += ns;
                self.commit_ns_max = self.commit_ns_max.max(ns);
                self.commit_ns_last = ns;
                self.fs.complete_commit();
                tracing::debug!(generation, dirty, "coordinated commit");
                self.broadcast(|| Control::CommitDone(Box::new(sb.clone())));
                Ok(())
            }
            Err(e) => {
                tracing::error!(generation, "coordinated commit failed: {e}");
                self.fs.fail_stop(e.clone());
                self.broadcast(|| Control::CommitFailed(e.clone()));
                Err(e)
            }
        }
    }

    /// Runs a request spanning reactors with every shard lent here.
    fn span(&mut self, request: Request, place: Option<u32>, retried: bool) {
        self.serving = Some((request.reply.clone(), request.token));
        self.broadcast(|| Control::Lend);
        let n = self.to_reactors.len();
        let mut lent: Vec<(usize, Vec<u32>)> = Vec::with_capacity(n);
        let mut failure = None;
        for _ in 0..n {
            let waited = self.wait_for(|m| match m {
                ToCoordinator::Lent(r, l) => Ok((r, l)),
                other => Err(other),
            });
            let (r, result) = match waited {
                Ok(lent) => lent,
                // The runtime failed: the shards lent so far stay here, unused.
                Err(e) => return self.answer(request, Err(e)),
            };
            match *result {
                Ok(l) => {
                    lent.push((r, l.ids()));
                    self.fs.put_shards(l);
                }
                Err(e) => {
                    // That reactor keeps its shards (it failed stop); the others get theirs
                    // back below.
                    failure.get_or_insert(e);
                }
            }
        }
        let op = request.op.clone();
        let mut result = match failure {
            Some(e) => Err(e),
            None => {
                if let Some(shard) = place {
                    self.fs.place_next(shard);
                }
                execute_on(&mut self.fs, &op)
            }
        };
        let needs_commit = result.is_ok() && renamed_a_directory(&mut self.fs, &op);
        // Refused for space a commit gives back (frees pinned in the shards it held, groups
        // emptied anywhere): once more after a coordinated commit, whose unpinning every
        // partition finishes before it lends its shards again.
        let retry_for_space =
            !retried && matches!(result, Err(EngineError::NoSpace)) && self.fs.space_reclaimable();
        self.fs.mark_cross();
        for (r, ids) in lent {
            match self.fs.take_shards(&ids) {
                Ok(back) => self.send(r, Control::Return(back)),
                Err(e) => {
                    // Only a failed log drain refuses, and this engine writes no log.
                    unreachable!("the coordinator has no log in flight: {e}")
                }
            }
        }
        if needs_commit || retry_for_space {
            if let Err(e) = self.commit_all() {
                result = Err(e);
            } else if retry_for_space {
                return self.span(request, place, true);
            }
        }
        self.answer(request, result);
    }

    /// Completes the request being served.
    fn answer(&mut self, request: Request, result: Result<Reply, EngineError>) {
        self.serving = None;
        deliver(vec![(
            request.reply,
            Completion {
                token: request.token,
                result,
            },
        )]);
    }

    /// Every reactor's statistics, merged; the commit figures are this coordinator's.
    fn stats(&mut self, request: Request) {
        self.serving = Some((request.reply.clone(), request.token));
        self.broadcast(|| Control::Snapshot);
        let n = self.to_reactors.len();
        let mut total = ReactorStats::default();
        let mut hist: Option<Histograms> = None;
        let mut reactor_blocks = 0u64;
        for _ in 0..n {
            let waited = self.wait_for(|m| match m {
                ToCoordinator::Snapshot(s) => Ok(s),
                other => Err(other),
            });
            let snapshot = match waited {
                Ok(snapshot) => snapshot,
                Err(e) => return self.answer(request, Err(e)),
            };
            let (stats, h) = *snapshot;
            total.absorb(&stats);
            // Each reactor wrote its half's blocks (its count includes the superblock,
            // which the coordinator wrote once: taken off here).
            reactor_blocks += stats
                .commit
                .blocks_written
                .saturating_sub(stats.commit.commits);
            match &mut hist {
                Some(all) => all.add(&h),
                None => hist = Some(h),
            }
        }
        if let Some(h) = hist {
            h.fill(&mut total);
        }
        let pause_ns_max = total.commit.pause_ns_max;
        total.commit = self.fs.commit_stats();
        total.commit.pause_ns_max = pause_ns_max;
        total.commit.commit_ns_total = self.commit_ns_total;
        total.commit.commit_ns_max = self.commit_ns_max;
        total.commit.last_commit_ns = self.commit_ns_last;
        total.commit.last_super_commit_ns = self.commit_ns_last;
        total.commit.blocks_written += reactor_blocks;
        total.unpinned_blocks_last = total.commit.last_unpinned_blocks;
        self.answer(request, Ok(Reply::Stats(Box::new(total))));
    }
}

/// A reply for `request` (helper for the reactor side).
pub(crate) fn completion(
    request: Request,
    result: Result<Reply, EngineError>,
) -> (Arc<ReplyQueue>, Completion) {
    (
        request.reply,
        Completion {
            token: request.token,
            result,
        },
    )
}
