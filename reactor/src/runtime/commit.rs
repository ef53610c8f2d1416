//! Commits as a reactor drives them. Between batches ([`Reactor::tick`]) it unpins the last
//! commit's frees, prepares the next (delayed index items, a bounded step per loop turn) and
//! starts it (one reactor) or asks the coordinator for one (several); it advances the commit
//! in flight while it serves the next generation, and releases the replies waiting for a
//! durable generation. With several reactors it also takes the coordinator's control
//! messages ([`Control`]): lending shards and taking them back, starting its half of a
//! coordinated commit, and that commit's end.
//!
//! # Invariants
//! - One commit in flight at a time. A due commit starts only once the device pipeline is
//!   empty (its start never waits for the device); after `COMMIT_DEFER_MAX` of waiting,
//!   fsyncs and writes park until it starts, so the pipeline empties. It does not start
//!   while the last commit's unpin waits for reads in flight.
//! - A commit waiter is released only once its generation is durable, or with the error
//!   (every waiter) once the filesystem failed.
//! - With several reactors a reactor sends its half of a coordinated commit once
//!   (`half_sent`), and applies the coordinator's superblock before it releases waiters.
//! - A loop turn takes at most one commit step of CPU work: a preparation step, the start
//!   (freezing the trees), or a serialization slice ([`Reactor::take_commit_step`]). Each is
//!   bounded (0.1–0.5 ms on the memory backend); run back to back in one turn (two
//!   preparation steps, the start and the first slice, as the batch's and the tick's calls
//!   used to) they held every client 1.0–1.25 ms, the longest turns of a create run left
//!   once the memory device no longer faulted.

use super::{publish_statfs, Reactor};
use crate::multi::{Control, ToCoordinator};
use crate::queue::Shared;
use engine::EngineError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Loop turns a due commit spends inserting delayed index items before it starts anyway
/// ([`engine::Filesystem::commit_prepare`]).
const PREPARE_STEPS_MAX: u32 = 64;

/// How long a due commit waits for the records in flight to become durable before it starts
/// anyway (and waits for them itself, holding the reactor).
const COMMIT_DEFER_MAX: Duration = Duration::from_millis(50);

impl Reactor {
    pub(crate) fn tick(&mut self) {
        // Unpin the last commit's frees (after its waiters went), then start or ask for the
        // next commit when one is due or waited for.
        // A read in flight may still need blocks the commit freed: the unpin waits for it
        // rather than the reactor.
        if self.fs.commit_in_flight().is_none() && !self.fs.unpin_waits_for_reads() {
            self.fs.complete_commit();
        }
        // Requests refused for space a commit gives back run again once it is complete.
        self.meta.space_made(self.fs.completed_generation());
        self.drive_commits();
        if let Some(m) = self.multi.as_ref() {
            publish_statfs(&self.fs, &m.router.reactors[m.index]);
        }
        self.poll_durable(None);
    }

    /// True when [`Reactor::drive_commits`] would take a step on the next loop turn (one
    /// reactor): a commit is due or waited for and nothing it waits for is in flight. The
    /// loop then turns again at once rather than idle. A due commit takes a preparation step
    /// per turn (up to `PREPARE_STEPS_MAX`), and an idle reactor's turns are its park's timer
    /// apart (500 ms): through the FUSE mount, a 1 GiB `dd conv=fsync` right after
    /// `cp -a /usr/include` waited 10-15 s in its fsync (a fallback waiting for the commit)
    /// in about half the runs, 0.8 s in the others.
    pub(super) fn commit_step_ready(&self) -> bool {
        self.multi.is_none()
            && self.fs.failure().is_none()
            && self.fs.log_in_flight() == 0
            && self.commit_may_step()
    }

    /// A commit is wanted and nothing in the engine stops its next step: none is in flight,
    /// and the last one's unpin does not wait for reads in flight (the next commit first
    /// unpins the last, which must wait for the reads planned before it: starting now would
    /// hold the reactor until they complete, and a slow device read would stop every client;
    /// it starts once they land). Wanted: due (the engine says so) or waited for (a waiter,
    /// or a request parked for space, needs a generation not yet durable).
    fn commit_may_step(&self) -> bool {
        if self.fs.commit_in_flight().is_some() || self.fs.unpin_waits_for_reads() {
            return false;
        }
        let durable = self.fs.durable_generation();
        self.commit_waiters.iter().any(|w| w.generation > durable)
            || self.meta.space_wanted().is_some_and(|g| g > durable)
            || self.fs.commit_due()
    }

    /// Starts a commit (one reactor) or asks the coordinator for one (several) when the
    /// engine says one is due or a waiter needs a generation not yet durable.
    pub(super) fn drive_commits(&mut self) {
        if self.fs.failure().is_some() {
            // No commit will start: what waited for one runs now, and fails.
            if std::mem::take(&mut self.commit_barrier) {
                self.meta.commit_started();
            }
            if !self.commit_waiters.is_empty() {
                let e = self.fs.failure().cloned().expect("failed");
                self.release_commit_waiters(u64::MAX, Err(e));
            }
            return;
        }
        if !self.commit_may_step() {
            return;
        }
        // The delayed index items go into the trees a step per loop turn first, so the
        // commit's pause has few left; a stream of creates that outpaces the steps gets its
        // commit after PREPARE_STEPS_MAX of them all the same.
        if self.prepare_steps < PREPARE_STEPS_MAX {
            if !self.take_commit_step() {
                return;
            }
            match self.fs.commit_prepare() {
                // Prepared: the start is the next turn's step.
                Ok(true) => {
                    self.prepare_steps = PREPARE_STEPS_MAX;
                    return;
                }
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
        if !self.take_commit_step() {
            return;
        }
        self.prepare_steps = 0;
        if let Some(m) = self.multi.as_mut() {
            m.ask_commit();
            return;
        }
        // A commit first waits for the records in flight to become durable, holding the
        // reactor: behind a slow device flush every client stalled with it (docs/reactors.md).
        // So it starts once they are durable, polled for in the meantime. If fsyncs and
        // write-backs keep the pipeline busy for COMMIT_DEFER_MAX, the barrier goes up:
        // fsyncs and writes park until the commit has started, so the pipeline empties
        // without the reactor waiting for it (starting at once and draining held every
        // client 15–36 ms in dbench on a file image). Everything else goes on.
        if self.fs.log_in_flight() > 0 {
            let since = *self.commit_deferred_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= COMMIT_DEFER_MAX {
                self.commit_barrier = true;
            }
            return;
        }
        self.commit_deferred_since = None;
        if std::mem::take(&mut self.commit_barrier) {
            // Runs after the commit has started, below: the parked requests run in the next
            // batch, in the next generation.
            self.meta.commit_started();
        }
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
    pub(super) fn progress_commit(&mut self, wait: Option<Duration>) {
        if self.fs.commit_in_flight().is_none() {
            return;
        }
        if self.multi.as_ref().is_some_and(|m| m.half_sent) {
            return;
        }
        // Serializing is CPU work: a step of its own. Past it, progress is polling.
        if self.fs.commit_slicing() && !self.take_commit_step() {
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

    /// Takes the coordinator's control messages; true on Exit.
    pub(super) fn take_control(&mut self, shared: &Shared) -> bool {
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
        // The start is this turn's commit step, whatever came before it (the coordinator
        // asked: it is not deferred); the first slice waits for the next turn.
        self.commit_step_turn = self.turn;
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

    /// Takes this loop turn's commit step: false when the turn took one already (the caller
    /// comes back next turn, after the queue has been looked at).
    fn take_commit_step(&mut self) -> bool {
        if self.commit_step_turn == self.turn {
            return false;
        }
        self.commit_step_turn = self.turn;
        true
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
}
