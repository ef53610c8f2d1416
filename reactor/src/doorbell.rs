//! A reactor's doorbell: the one thing a reactor with nothing to do sleeps on. Everything that
//! can give it work rings it — a client that queued a request, the coordinator that sent a
//! control message, shutdown — and, where the device queue can
//! ([`nvme::BlockDevice::signal_completions_to`]), the kernel on every I/O completion.
//!
//! Why one descriptor for both: a reactor waiting for an fsync record's flush used to sleep
//! inside the device wait, deaf to its request queue until the next completion or the end of
//! a slice: an fsync arriving meanwhile waited in the queue for a whole slice before the
//! reactor even looked at it (docs/reactors.md has the figures). Sleeping on the doorbell,
//! the reactor wakes for whichever comes first.
//!
//! # Invariants
//! - No lost wake-up. The sleeper stores `parked` (SeqCst), then checks its queues, then
//!   sleeps; a waker pushes its work, then loads `parked` and rings (see
//!   [`crate::queue::Shared::wake_reactor`]). A ring, or a completion, that comes before the
//!   sleep stays in the eventfd's counter, so the sleep returns at once; the counter is
//!   drained after each sleep, and the caller looks at its queues again before the next one.
//! - Both sides use the same mechanism, fixed at creation: the eventfd, or (if the kernel gave
//!   none) thread park/unpark, which cannot hear the device — the reactor then keeps sleeping
//!   in the device wait in slices.
//!
//! Fault model: writing +1 to an eventfd fails only when its counter would overflow (never
//! here: the sleeper drains it) or it is not a valid descriptor (a bug); reading and polling
//! fail only with EINTR or EAGAIN, both harmless: the caller's loop looks again.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::Duration;

pub(crate) struct Doorbell {
    /// The eventfd (non-blocking), or None when the kernel refused one.
    eventfd: Option<OwnedFd>,
    /// The reactor's thread, for the park/unpark fallback.
    thread: OnceLock<Thread>,
}

impl Doorbell {
    pub fn new() -> Doorbell {
        // SAFETY: eventfd takes no pointers; a non-negative result is a descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        let eventfd = if fd >= 0 {
            // SAFETY: just created, owned by nobody else.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        } else {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "no eventfd for the reactor's doorbell: it parks its thread instead, and waits for its device in 1 ms slices"
            );
            None
        };
        Doorbell {
            eventfd,
            thread: OnceLock::new(),
        }
    }

    /// Called once by the reactor thread before it first sleeps.
    pub fn bind_thread(&self) {
        let _ = self.thread.set(std::thread::current());
    }

    /// The eventfd a device queue may signal (None: there is none).
    pub fn raw_fd(&self) -> Option<RawFd> {
        self.eventfd.as_ref().map(|fd| fd.as_raw_fd())
    }

    /// Wakes the reactor from its current or next sleep.
    pub fn ring(&self) {
        match &self.eventfd {
            Some(fd) => ring_eventfd(fd.as_raw_fd()),
            None => {
                if let Some(thread) = self.thread.get() {
                    thread.unpark();
                }
            }
        }
    }

    /// Sleeps until rung (or a completion signalled, or `timeout`), then drains the counter.
    /// The caller has published `parked` and found nothing to do. True when rung (as far as
    /// it can tell: the park fallback cannot).
    pub fn sleep(&self, timeout: Duration) -> bool {
        let Some(fd) = &self.eventfd else {
            std::thread::park_timeout(timeout);
            return false;
        };
        let mut pollfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one pollfd and one timespec, both live for the call; no signal mask.
        let ready = unsafe { libc::ppoll(&mut pollfd, 1, &ts, std::ptr::null()) };
        self.drain();
        ready > 0
    }

    /// Resets the counter (non-blocking: nothing to read is EAGAIN).
    fn drain(&self) {
        if let Some(fd) = &self.eventfd {
            let mut count: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from a descriptor we own.
            let _ = unsafe {
                libc::read(
                    fd.as_raw_fd(),
                    (&mut count as *mut u64).cast::<libc::c_void>(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }
}

/// Adds 1 to eventfd `fd` (8 bytes), as a reactor's waker does; a storage service's client
/// rings its server's reactor with it. The only failure, EAGAIN on a counter at its maximum,
/// still leaves it readable.
pub fn ring_eventfd(fd: std::os::fd::RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to a descriptor the caller holds.
    let _ = unsafe {
        libc::write(
            fd,
            (&one as *const u64).cast::<libc::c_void>(),
            std::mem::size_of::<u64>(),
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_ring_before_the_sleep_is_kept_and_a_sleep_without_one_times_out() {
        let bell = Doorbell::new();
        assert!(bell.raw_fd().is_some(), "eventfd available on this kernel");
        bell.bind_thread();
        bell.ring();
        let start = Instant::now();
        assert!(bell.sleep(Duration::from_secs(5)), "rung");
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "a ring before the sleep ends it at once"
        );
        // Drained: the next sleep waits out its timeout.
        let start = Instant::now();
        assert!(!bell.sleep(Duration::from_millis(20)), "timed out");
        assert!(start.elapsed() >= Duration::from_millis(15));
    }

    #[test]
    fn a_ring_from_another_thread_wakes_the_sleeper() {
        let bell = std::sync::Arc::new(Doorbell::new());
        bell.bind_thread();
        let ringer = {
            let bell = bell.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                bell.ring();
            })
        };
        let start = Instant::now();
        bell.sleep(Duration::from_secs(10));
        assert!(
            start.elapsed() < Duration::from_secs(9),
            "woken by the ring"
        );
        ringer.join().unwrap();
    }
}
