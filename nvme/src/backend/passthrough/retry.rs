//! Commands the host cancelled, sent again: what a controller reset does to a passthrough
//! queue, and how the queue lives through it.
//!
//! When a command times out (30 s by default) or the controller fails, the kernel's NVMe driver
//! resets the controller. The block layer requeues its own requests across a reset, but
//! passthrough commands are fail-fast: every command in flight completes with `-EINTR` (the
//! driver cancelled it), and commands submitted while the controller is not live complete with
//! NVMe status Host Pathing Error (0x370) or Command Aborted By Host (0x371) without reaching
//! it. None of them is a media error, and the controller is usable again once the reset ends.
//!
//! Invariants:
//! - Only those three outcomes are sent again ([`cancelled_by_host`]); every other error
//!   completes the command as before (and fails the shard above us).
//! - A command is sent again as it was first built (same LBAs, same buffer, same FUA bit), so a
//!   second run of it is idempotent: the engine never has two commands in flight on one LBA,
//!   and issues what depends on a command only after it completes, so a write the controller
//!   may or may not have done before the reset ends up done exactly as asked.
//! - Bounded: the waits between sends grow from 1 ms by 4x up to 1 s, and a command is given
//!   up, with its last error, once [`RETRY_BUDGET`] has passed since its first cancellation.
//!   The table holds at most one entry per slot of the queue (fixed at open).
//! - Not silent: the first cancellation in any second is logged as a warning, and
//!   [`Resubmits::sent_again_total`] counts every resend.

use std::time::{Duration, Instant};

/// How long after its first cancellation a command is still sent again: longer than a
/// controller reset takes (seconds on real hardware, about 0.3 s in the test guest), shorter
/// than the driver's default command timeout, so that a command that itself hangs the
/// controller is given up after the second reset rather than looping.
pub const RETRY_BUDGET: Duration = Duration::from_secs(30);

const BACKOFF_FIRST: Duration = Duration::from_millis(1);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// NVMe status (Status Code Type 3, path related): the host had no live path to the
/// controller, so the command never reached it.
const SC_HOST_PATH_ERROR: u16 = 0x370;
/// NVMe status: the host aborted the command (the driver's cancellation, as a status).
const SC_HOST_ABORTED: u16 = 0x371;

/// True when a completion's `res` says the host cancelled the command or never sent it (see
/// the module docs), not that the controller failed it.
pub fn cancelled_by_host(res: i32) -> bool {
    match res {
        r if r == -libc::EINTR => true,
        // The status field without its Do Not Retry and More bits (bits 14, 13) and the
        // Command Retry Delay (bits 12:11): Status Code Type and Status Code.
        r if r > 0 => matches!((r as u16) & 0x7ff, SC_HOST_PATH_ERROR | SC_HOST_ABORTED),
        _ => false,
    }
}

/// The wait before send number `attempt` (1 = the first resend).
pub fn backoff(attempt: u32) -> Duration {
    let factor = 4u32.saturating_pow(attempt.saturating_sub(1));
    BACKOFF_FIRST.saturating_mul(factor).min(BACKOFF_MAX)
}

/// One command's cancellations so far: the policy of the module docs, for the queue's
/// commands ([`Resubmits`]) and for those beside it alike.
#[derive(Debug, Default)]
pub struct Attempts {
    first_cancelled: Option<Instant>,
    count: u32,
}

impl Attempts {
    /// The wait before sending the command again, after a completion that said `res` at
    /// `now`; None when it completes with `res` (not a host cancellation, or the budget is
    /// spent).
    pub fn again_after(&mut self, res: i32, now: Instant) -> Option<Duration> {
        if !cancelled_by_host(res) {
            return None;
        }
        let first = *self.first_cancelled.get_or_insert(now);
        if now.duration_since(first) > RETRY_BUDGET {
            return None;
        }
        self.count += 1;
        Some(backoff(self.count))
    }

    /// Sends again so far.
    pub fn count(&self) -> u32 {
        self.count
    }
}

struct Pending<E> {
    /// The submission entry as first built.
    sqe: E,
    /// Goes on the data-less ring (see the backend's module docs).
    dataless: bool,
    attempts: Attempts,
    due: Instant,
}

/// What each slot of a queue was sent as, and which slots wait to be sent again. `E` is the
/// ring's submission entry (generic so the policy is tested without a ring).
pub struct Resubmits<E> {
    entries: Vec<Option<Pending<E>>>,
    /// Slots parked until their `due` time, at most one per slot.
    parked: Vec<u64>,
    sent_again_total: u64,
    warned_at: Option<Instant>,
}

impl<E: Clone> Resubmits<E> {
    pub fn new(depth: u32) -> Self {
        Resubmits {
            entries: (0..depth).map(|_| None).collect(),
            parked: Vec::with_capacity(depth as usize),
            sent_again_total: 0,
            warned_at: None,
        }
    }

    /// Remembers what slot `slot` was submitted as.
    pub fn remember(&mut self, slot: u64, sqe: E, dataless: bool) {
        self.entries[slot as usize] = Some(Pending {
            sqe,
            dataless,
            attempts: Attempts::default(),
            due: Instant::now(),
        });
    }

    /// The slot completed for good.
    pub fn forget(&mut self, slot: u64) {
        self.entries[slot as usize] = None;
    }

    /// Parks `slot`, whose completion said `res`, to be sent again; false when `res` is not a
    /// host cancellation or the command's budget is spent (the caller completes it).
    pub fn park(&mut self, slot: u64, res: i32, now: Instant, what: &str) -> bool {
        if !cancelled_by_host(res) {
            return false;
        }
        let Some(pending) = self.entries[slot as usize].as_mut() else {
            return false;
        };
        let Some(wait) = pending.attempts.again_after(res, now) else {
            tracing::error!(
                "{what}: a command the host cancelled for longer than {RETRY_BUDGET:?} \
                 (controller resets) is given up"
            );
            return false;
        };
        pending.due = now + wait;
        assert!(
            !self.parked.contains(&slot),
            "slot {slot} parked twice: it completed while parked"
        );
        self.parked.push(slot);
        if self
            .warned_at
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1))
        {
            self.warned_at = Some(now);
            tracing::warn!(
                "{what}: the host cancelled a command (status {res}: a controller reset, or the \
                 path not ready); sending it again (attempt {})",
                pending.attempts.count()
            );
        }
        true
    }

    /// Takes the parked slots due by `now`, each with its entry and ring.
    pub fn take_due(&mut self, now: Instant, out: &mut Vec<(u64, E, bool)>) {
        let entries = &self.entries;
        let mut sent = 0;
        self.parked.retain(|&slot| {
            let pending = entries[slot as usize]
                .as_ref()
                .expect("a parked slot has its entry");
            if pending.due <= now {
                out.push((slot, pending.sqe.clone(), pending.dataless));
                sent += 1;
                false
            } else {
                true
            }
        });
        self.sent_again_total += sent;
    }

    /// When the next parked slot is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.parked
            .iter()
            .filter_map(|&slot| self.entries[slot as usize].as_ref().map(|p| p.due))
            .min()
    }

    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Commands sent again since the queue opened.
    pub fn sent_again_total(&self) -> u64 {
        self.sent_again_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_host_cancellations_are_sent_again() {
        assert!(cancelled_by_host(-libc::EINTR));
        assert!(cancelled_by_host(0x370));
        assert!(cancelled_by_host(0x371));
        // With Do Not Retry or More set, still the host's own doing.
        assert!(cancelled_by_host(0x4370));
        for res in [0, -libc::EIO, -libc::ENOSPC, 0x281, 0x2, 0x180, 0x372] {
            assert!(!cancelled_by_host(res), "{res:#x}");
        }
    }

    #[test]
    fn backoff_grows_to_a_second() {
        let waits: Vec<_> = (1..=7).map(backoff).collect();
        assert_eq!(waits[0], Duration::from_millis(1));
        assert_eq!(waits[1], Duration::from_millis(4));
        assert_eq!(waits[4], Duration::from_millis(256));
        assert_eq!(waits[5], Duration::from_secs(1));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(1));
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_cancelled_command_waits_then_goes_again_as_it_was() {
        let mut r = Resubmits::new(4);
        let t0 = Instant::now();
        r.remember(2, 22u32, false);
        r.remember(3, 33u32, true);
        assert!(!r.park(2, -libc::EIO, t0, "t"), "a media error completes");
        assert!(r.park(2, -libc::EINTR, t0, "t"));
        assert!(r.park(3, 0x370, t0, "t"));
        assert_eq!(r.parked(), 2);
        let mut out = Vec::new();
        r.take_due(t0, &mut out);
        assert!(out.is_empty(), "nothing is due before its backoff");
        assert_eq!(r.next_due(), Some(t0 + Duration::from_millis(1)));
        r.take_due(t0 + Duration::from_millis(1), &mut out);
        out.sort();
        assert_eq!(out, vec![(2, 22, false), (3, 33, true)]);
        assert_eq!(r.sent_again_total(), 2);
        assert_eq!(r.parked(), 0);
        // Cancelled again: the second wait is longer.
        assert!(r.park(2, -libc::EINTR, t0 + Duration::from_millis(2), "t"));
        assert_eq!(r.next_due(), Some(t0 + Duration::from_millis(6)));
    }

    #[test]
    fn a_command_cancelled_past_the_budget_is_given_up() {
        let mut r = Resubmits::new(1);
        let t0 = Instant::now();
        r.remember(0, 7u32, false);
        assert!(r.park(0, -libc::EINTR, t0, "t"));
        let mut out = Vec::new();
        r.take_due(t0 + RETRY_BUDGET, &mut out);
        assert_eq!(out.len(), 1);
        assert!(
            r.park(0, -libc::EINTR, t0 + RETRY_BUDGET, "t"),
            "at the budget"
        );
        r.take_due(t0 + RETRY_BUDGET * 2, &mut out);
        assert!(!r.park(
            0,
            -libc::EINTR,
            t0 + RETRY_BUDGET + Duration::from_millis(1),
            "t"
        ));
        // Remembered afresh (a new command in the slot), the budget starts again.
        r.forget(0);
        r.remember(0, 8u32, false);
        assert!(r.park(0, -libc::EINTR, t0 + RETRY_BUDGET * 3, "t"));
    }
}
