//! A client runs a request itself while its reactor sleeps ([`CallerRuns`]): the engine is
//! lent to whichever thread takes it, so a lookup, a read or a change of names answered
//! from memory costs no wake-up on either side.
//!
//! Why: every request crosses threads twice (the reactor's wake-up, then the client's). On
//! a quiet machine a hop is a few microseconds; beside a CPU-bound neighbour both sides
//! sleep in the kernel (`crate::contention`) and each hop is a wake-up that the scheduler
//! may serve late. A `stat` that the kernel answers from its caches in 1.5 µs took 27 µs.
//! A caller that finds the reactor asleep runs the request on its own core instead.
//!
//! # Invariants
//! - One thread at a time uses the engine. The slot's state is `REACTOR` (the reactor
//!   runs), `LENT` (the reactor waits for work or for its device and lends the engine) or
//!   `CALLER` (a client took it). Only the reactor turns `REACTOR` into `LENT` and back;
//!   a client turns `LENT` into `CALLER` and back. Taking and giving back pair an Acquire
//!   with a Release, so each holder sees everything the one before it did.
//! - The engine pointer is published by the reactor before it lends and is valid until it
//!   takes the engine back: the reactor does not touch its engine while it is lent.
//! - The device's queue is the reactor's alone (an io_uring ring admits one submitter):
//!   while the engine is lent, the device multiplexer asserts on any use of it.
//! - Lookups run from memory alone ([`engine::Filesystem::from_memory`]): nothing changes,
//!   nothing is read, and a miss gives the request back, untouched, to be sent to the
//!   reactor. A read that would move an access time or start a read-ahead, or whose tree
//!   nodes are not in memory, is the reactor's.
//! - A read whose inode and extents are in memory but whose data blocks are not reads them
//!   synchronously beside the queue ([`engine::Filesystem::read_lent`]): one system call
//!   on the client's core, as a kernel filesystem's read would be, instead of a wake-up of
//!   the reactor and one of the client. Not for reads longer than
//!   [`engine::reads::LENT_READ_BYTES_MAX`] (the reactor waits for its engine meanwhile).
//! - Changes of names, links, attributes and holds ([`Op::caller_run`]) run once their
//!   walk and lookups were found in memory, with the engine lent for reads
//!   ([`engine::Filesystem::change_lent`]): a change cannot be declined halfway, so a tree
//!   node it still misses (a split's sibling, the leaf a new inode lands in) is read
//!   synchronously beside the queue, answered from the background writes in flight where
//!   they hold it. Changes that write to the device themselves (truncation, a write that
//!   would start write-back) are never run here. A change refused for space before it
//!   changed anything goes to the reactor, which commits and tries again. A change that
//!   makes a commit due rings the reactor.
//! - An fsync runs here only while the cores are shared, and only with nothing in flight
//!   ([`engine::Filesystem::fsync_beside`]): its record is built with the engine held, and
//!   written, and flushed, through the client's own handle beside the queue *after* the
//!   engine is given back, so nobody waits for this thread while the device works. Durable
//!   when the call returns, as a kernel filesystem's fsync is in its caller's thread: no
//!   wake-up of the reactor for the request, none for the device's completion, none of the
//!   client for the reply. The completions go back to the engine through the device
//!   multiplexer (whoever holds the engine next counts them); a reactor that waits for
//!   them asked to be rung. One that would fall back to a commit, or write much data in
//!   place, goes to the reactor.
//! - Only with one reactor: with several, a walk may need another reactor's directories.
//! - The reactor waiting to take its engine back (`reclaiming`) stops new callers from
//!   taking it, so callers cannot starve the reactor.
//! - A caller that panics while it holds the engine poisons the slot: the reactor fails the
//!   runtime instead of using an engine left in an unknown state.
//!
//! Ordering: a request a caller runs sees every request answered before it was made (the
//! reactor ran them before it lent the engine). Requests still queued were not answered,
//! so running ahead of them is what any concurrent caller may see. A client with requests
//! of its own in flight does not run one itself (it would overtake them).

use crate::execute::{execute_on, lookups, walk};
use crate::op::{CallerRun, Op, Reply};
use engine::{EngineError, Filesystem};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, Ordering};

const REACTOR: u8 = 0;
const LENT: u8 = 1;
const CALLER: u8 = 2;
const POISONED: u8 = 3;

// A client uses the engine on its own thread.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Filesystem>();
};

/// Spins a reactor makes for a client to give the engine back before it yields its core
/// (a client holds it for microseconds; only a client preempted while holding it takes
/// longer).
const RECLAIM_SPINS: u32 = 256;

/// What clients may run themselves ([`crate::Config::callers_run`] and the fields after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallerPolicy {
    /// The reactor lends its engine at all (one reactor only).
    pub run: bool,
    /// Changes of names, links, attributes, holds and staging writes too.
    pub changes: bool,
    /// fsyncs too ([`engine::Filesystem::fsync_beside`]).
    pub fsyncs: bool,
    /// Data reads and fsyncs beside the queue always, not only while the cores are shared.
    pub device_always: bool,
}

impl CallerPolicy {
    /// Nothing runs in a client.
    pub(crate) const OFF: CallerPolicy = CallerPolicy {
        run: false,
        changes: false,
        fsyncs: false,
        device_always: false,
    };
}

/// How long a client waits for a reactor that holds its engine to lend it again before it
/// sends its request instead ([`CallerRuns::take`]), while the cores are shared with other
/// work (a request sent then costs two wake-ups).
const TAKE_WAIT: std::time::Duration = std::time::Duration::from_micros(20);
/// The same on a quiet machine, where a request sent to the polling reactor costs about
/// 2.5 µs there and back: about the length of an idle reactor's turn between two lends
/// (IDLE_LEND_MAX apart), so a call that comes during one waits for its end instead of
/// paying the round trip. With it abi-stat's p99 went from 2.6 µs to 0.9 µs and its rate
/// up 15%, abi-open-close's up 12% (3 alternating pairs). 20 µs here, before the slot had
/// cache lines of its own, cost quiet abi-stat a sixth of its rate (docs/reactors.md).
const TAKE_WAIT_QUIET: std::time::Duration = std::time::Duration::from_micros(2);

/// The slot through which a reactor lends its engine (one per reactor, in
/// [`crate::queue::Shared`]). Aligned to a pair of cache lines of its own: a client takes
/// and gives back the slot on every call it runs, and the fields beside it in `Shared` are
/// what the reactor reads in every pass of its idle loop (its queue's state, `stopping`,
/// `control_pending`): sharing their line, each take and each give-back had to pull the line
/// back from the reactor's core (a stat run here spent a fifth of its time on those two
/// accesses, perf on abi-stat).
#[repr(align(128))]
pub(crate) struct CallerRuns {
    state: AtomicU8,
    /// The reactor waits to take its engine back: clients stop taking it, so a stream of
    /// callers cannot keep the reactor from its queue.
    reclaiming: AtomicBool,
    fs: AtomicPtr<Filesystem>,
    /// Whether the reactor lends at all (`Config::callers_run`, one reactor), and whether
    /// clients may run changes (`Config::callers_change`).
    enabled: bool,
    changes: bool,
    fsyncs: bool,
    device_always: bool,
    /// The reactor holds writes back (a due commit waits for its device pipeline to
    /// empty): clients send theirs to it. Set before the engine is lent.
    writes_held: AtomicBool,
    /// Requests clients ran themselves, and those they tried and gave to the reactor (a
    /// miss in memory).
    pub ran: AtomicU64,
    pub missed: AtomicU64,
    /// Of `ran`, the lookups and changes of names and attributes ([`keeps_reactor_polling`]):
    /// a burst of them keeps a spin-then-park reactor polling. Counted by
    /// [`crate::queue::Shared::caller_ran`], which also rings a parked reactor for them.
    pub names_ran: AtomicU64,
}

/// True for a request run by a client that counts as the filesystem being busy for its
/// reactor's idle spin: a lookup or a change of names, links or attributes, what a program
/// walking or copying a tree makes one after another. Not data reads, writes or fsyncs: a
/// polling reactor beside those takes a core the kernel's I/O work needs (a 1 MiB sequential
/// read went 0.87x, append + fdatasync beside a CPU-bound neighbour 0.80x, when every run
/// counted).
pub(crate) fn keeps_reactor_polling(op: &Op) -> bool {
    matches!(op.caller_run(), CallerRun::FromMemory | CallerRun::Change)
        && !matches!(op, Op::Read { .. })
}

impl CallerRuns {
    pub(crate) fn new(policy: CallerPolicy) -> CallerRuns {
        CallerRuns {
            state: AtomicU8::new(REACTOR),
            reclaiming: AtomicBool::new(false),
            fs: AtomicPtr::new(std::ptr::null_mut()),
            enabled: policy.run,
            changes: policy.changes,
            fsyncs: policy.fsyncs,
            device_always: policy.device_always,
            writes_held: AtomicBool::new(false),
            ran: AtomicU64::new(0),
            missed: AtomicU64::new(0),
            names_ran: AtomicU64::new(0),
        }
    }

    /// The reactor lends its engine while it runs `wait` (a sleep or a yield that does not
    /// touch the engine), then takes it back. False if a caller poisoned the slot.
    /// `writes_held`: the reactor holds writes back now (its commit barrier); clients then
    /// run none.
    pub(crate) fn lend_during<T>(
        &self,
        fs: &mut Filesystem,
        writes_held: bool,
        wait: impl FnOnce() -> T,
    ) -> (T, bool) {
        if !self.enabled {
            return (wait(), true);
        }
        debug_assert_eq!(self.state.load(Ordering::Relaxed), REACTOR);
        self.writes_held.store(writes_held, Ordering::Relaxed);
        self.fs.store(fs as *mut Filesystem, Ordering::Relaxed);
        self.state.store(LENT, Ordering::Release);
        let out = wait();
        (out, self.reclaim())
    }

    /// Takes the engine back, waiting for a caller that holds it.
    fn reclaim(&self) -> bool {
        let mut spins = 0u32;
        loop {
            match self.state.compare_exchange_weak(
                LENT,
                REACTOR,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(POISONED) => return false,
                Err(_) => {
                    self.reclaiming.store(true, Ordering::Relaxed);
                    spins += 1;
                    if spins < RECLAIM_SPINS {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        self.reclaiming.store(false, Ordering::Relaxed);
        self.fs.store(std::ptr::null_mut(), Ordering::Relaxed);
        true
    }

    /// Takes the lent engine (`LENT` to `CALLER`). A reactor that holds it is usually
    /// finishing a turn (it delivered a reply and goes back to its queue) and lends it again
    /// within microseconds: the caller waits up to [`TAKE_WAIT`] for that while the cores
    /// are shared, [`TAKE_WAIT_QUIET`] on a quiet machine, rather than send its request to a
    /// reactor that would then serve it, and the next, and the next (a client's request sent
    /// while the reactor finishes a turn keeps the reactor awake for the client's next one:
    /// eight dbench clients found the engine held in half of their tries, and every unlink
    /// after an fsync went to the reactor).
    fn take(&self) -> bool {
        let mut waited_since = None;
        loop {
            match self
                .state
                .compare_exchange(LENT, CALLER, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(REACTOR) if !self.reclaiming.load(Ordering::Relaxed) => {
                    let wait = if crate::contention::contended() {
                        TAKE_WAIT
                    } else {
                        TAKE_WAIT_QUIET
                    };
                    let since = *waited_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= wait {
                        return false;
                    }
                    std::hint::spin_loop();
                }
                // Another client has it, or the slot is poisoned or reclaimed.
                Err(_) => return false,
            }
        }
    }

    /// Runs `op` in the calling thread if the reactor lends its engine now and `op` may run
    /// here ([`Op::caller_run`]): `None` otherwise (send it to the reactor). An fsync's
    /// record is written through `side_io` (the client's own handle beside the queue, made
    /// at its first fsync) after the engine is given back.
    /// `wake` rings the reactor: called when a change made a commit due, so the reactor
    /// commits soon, and when the reactor waits for a record written here. `into`: a read's
    /// bytes go there (the caller's buffer, at least as long as the read) and it answers
    /// [`Reply::Placed`], so they are copied once.
    pub(crate) fn try_run(
        &self,
        op: &Op,
        side_io: &mut Option<Box<dyn nvme::AnyThreadIo>>,
        wake: impl FnOnce(),
        into: Option<&mut [u8]>,
    ) -> Option<Result<Reply, EngineError>> {
        let kind = op.caller_run();
        if !self.enabled
            || kind == CallerRun::No
            || (matches!(kind, CallerRun::Change | CallerRun::Write) && !self.changes)
            || (kind == CallerRun::Fsync && !self.fsyncs)
            // An fsync beside the queue saves wake-ups only while the cores are shared (on a
            // quiet machine both sides poll and the reactor's ring is as fast).
            || (kind == CallerRun::Fsync
                && !self.device_always
                && !crate::contention::contended())
            || self.reclaiming.load(Ordering::Relaxed)
        {
            return None;
        }
        if !self.take() {
            return None;
        }
        let held = Held { slot: self };
        let fs = self.fs.load(Ordering::Relaxed);
        assert!(!fs.is_null(), "a lent engine is published");
        // SAFETY: the state is CALLER, which only this thread can leave; the reactor
        // published the pointer before it lent the engine and uses the engine only after it
        // takes it back (module invariants), so this is the only reference to it now.
        let fs = unsafe { &mut *fs };
        // Read after taking the engine: the reactor set it before it lent (Release), and
        // does not change it while lent.
        if matches!(kind, CallerRun::Write | CallerRun::Fsync)
            && self.writes_held.load(Ordering::Relaxed)
        {
            drop(held);
            self.missed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // A record to write beside the queue once the engine is given back.
        let mut side = None;
        let mut out = match (kind, op) {
            // Data blocks memory misses are read beside the queue only while the cores are
            // shared: a polling reactor's ring read beats a pread on a quiet machine (QD1 on
            // a file image: 21k reads/s through the reactor, 18k beside the queue; with one
            // neighbour 10k and 16k). And only where changes may run too
            // (`COREFS_CALLERS_RUN=lookups` keeps a caller to memory).
            (_, &Op::Read { ino, offset, len }) => {
                let beside = self.changes && (self.device_always || crate::contention::contended());
                match into {
                    Some(into) => {
                        let into = &mut into[..len];
                        fs.read_memory_into(ino, offset, into, beside)
                            .map(|r| r.map(Reply::Placed))
                    }
                    None if beside => fs.read_lent(ino, offset, len).map(|r| r.map(Reply::Data)),
                    None => fs
                        .read_from_memory(ino, offset, len)
                        .map(|r| r.map(Reply::Data)),
                }
            }
            (
                CallerRun::Write,
                &Op::Write {
                    ino,
                    offset,
                    ref data,
                },
            ) => {
                // An edge block memory misses is read beside the queue while the cores are
                // shared (as a data read is), instead of sending the write to the reactor.
                let out = if self.device_always || crate::contention::contended() {
                    fs.write_lent_reading_edges(ino, offset, data.clone())
                } else {
                    fs.write_lent(ino, offset, data.clone())
                };
                out.map(|r| r.map(Reply::Written))
            }
            (CallerRun::Fsync, op) => {
                let member = op.is_fsync().expect("an fsync");
                if side_io.is_none() {
                    *side_io = fs.side_io();
                }
                match side_io {
                    None => None,
                    Some(_) => fs.fsync_beside(&[member]).map(|r| {
                        r.map(|record| {
                            side = record;
                            Reply::Done
                        })
                    }),
                }
            }
            (CallerRun::Change, op) => change(fs, op),
            _ => fs.from_memory(|fs| execute_on(fs, op)),
        };
        let mut ring = out.is_some() && kind != CallerRun::FromMemory && fs.commit_due();
        drop(held);
        if let Some(record) = side {
            // The engine is the reactor's (or another client's) again while the device
            // works: nobody waits for this thread to be scheduled back.
            let io = side_io.as_mut().expect("made above");
            let (written, wanted) = record.run(io.as_mut());
            ring |= wanted;
            out = Some(written.map(|()| Reply::Done));
        }
        if ring {
            wake();
        }
        match out {
            Some(result) => {
                self.ran.fetch_add(1, Ordering::Relaxed);
                Some(result)
            }
            None => {
                self.missed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

/// A change run by a client: its walk and its lookups from memory (a miss hands it to the
/// reactor, which parks it while the nodes are read), then the change itself
/// ([`Filesystem::change_lent`]).
fn change(fs: &mut Filesystem, op: &Op) -> Option<Result<Reply, EngineError>> {
    let walked;
    let op = match op {
        Op::Walk { from, path, then } => match fs.from_memory(|fs| walk(fs, *from, path))? {
            Ok((ino, taken)) => {
                assert_eq!(taken, path.len(), "one reactor holds every directory");
                walked = match crate::execute::walked(then, ino) {
                    Ok(op) => op,
                    Err(e) => return Some(Err(e)),
                };
                &walked
            }
            Err(e) => return Some(Err(e)),
        },
        op => op,
    };
    fs.from_memory(|fs| lookups(fs, op))?;
    fs.change_lent(|fs| execute_on(fs, op))
}

/// The engine held by a caller: given back on drop, poisoned if the caller panicked.
struct Held<'a> {
    slot: &'a CallerRuns,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let state = if std::thread::panicking() {
            POISONED
        } else {
            LENT
        };
        self.slot.state.store(state, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_takes_only_a_lent_engine_and_the_reactor_waits_for_it() {
        let slot = CallerRuns::new(CallerPolicy {
            run: true,
            changes: true,
            fsyncs: true,
            device_always: false,
        });
        // Not lent: the caller must not take it.
        assert!(slot
            .state
            .compare_exchange(LENT, CALLER, Ordering::Acquire, Ordering::Relaxed)
            .is_err());
        slot.state.store(LENT, Ordering::Release);
        slot.state.store(CALLER, Ordering::Release);
        let reclaimed = std::thread::scope(|s| {
            let reactor = s.spawn(|| slot.reclaim());
            std::thread::sleep(std::time::Duration::from_millis(20));
            // The reactor still waits for the caller.
            assert!(!reactor.is_finished());
            slot.state.store(LENT, Ordering::Release);
            reactor.join().unwrap()
        });
        assert!(reclaimed);
        assert_eq!(slot.state.load(Ordering::Relaxed), REACTOR);
        slot.state.store(POISONED, Ordering::Release);
        assert!(!slot.reclaim(), "a poisoned slot fails the reactor");
    }
}
