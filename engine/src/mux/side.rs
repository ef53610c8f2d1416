//! Writes beside the queue: an fsync's record that a client runs on a lent engine
//! ([`crate::Filesystem::fsync_beside`]) is written by the client itself, through its own
//! handle beside the device's queue ([`nvme::AnyThreadIo`]), after it gave the engine back.
//! Here the multiplexer queues those writes for it ([`SideIo`]) and takes their completions
//! back ([`SideDone`]) as a device's.
//!
//! # Invariants
//! - Queued only while the engine is lent for writes ([`Lent::Writes`]), which needs nothing
//!   in flight ([`DeviceMux::idle`]): a write beside the queue is not ordered against one
//!   on it.
//! - A queued write's bytes stay in [`DeviceMux::writing`], as a background write's, until
//!   its completion is taken: a read of its blocks is answered from them, and no background
//!   write may overlap them (checked).
//! - Every queued request is posted exactly once, by [`crate::log::SideRecord`] (made, or
//!   failed unmade when the record is dropped), and counted in `side_in_flight` until taken.
//!
//! Fault model: a failed write or flush is posted as failed; the pipeline that counts it
//! makes the filesystem fail-stop, as for a background failure. Nothing is retried.

use super::{is_background, DeviceMux, Lent};
use crate::blocks::Run;
use nvme::{DevError, IoCompletion};
use std::sync::Arc;
use std::time::Duration;

/// How long a synchronous wait sleeps at a time when only callers' writes beside the queue
/// are outstanding ([`DeviceMux::wait_side`]).
const SIDE_WAIT_SLICE: Duration = Duration::from_micros(20);

/// A write or flush a caller makes beside the queue for a lent engine
/// ([`crate::log::SideRecord`]), tagged as the background request it stands for.
#[derive(Debug)]
pub(crate) enum SideIo {
    Write {
        token: u64,
        lba: u64,
        bytes: Vec<u8>,
        fua: bool,
    },
    Flush {
        token: u64,
    },
}

impl SideIo {
    pub(crate) fn token(&self) -> u64 {
        match self {
            SideIo::Write { token, .. } | SideIo::Flush { token } => *token,
        }
    }
}

/// Completions of writes and flushes callers made beside the queue, posted without the
/// engine (the caller gave it back before its I/O) and taken by whoever holds it next
/// ([`DeviceMux::take_side_done`]). `wanted`: the engine looked while some were still
/// outstanding, so the caller that posts wakes its owner.
#[derive(Debug, Default)]
pub struct SideDone {
    posted: std::sync::Mutex<SidePosted>,
}

#[derive(Debug, Default)]
struct SidePosted {
    done: Vec<(u64, std::result::Result<(), DevError>)>,
    wanted: bool,
}

impl SideDone {
    /// Posts completions (token, result); true when the engine's owner asked to be woken.
    pub(crate) fn post(
        &self,
        done: impl IntoIterator<Item = (u64, std::result::Result<(), DevError>)>,
    ) -> bool {
        let mut posted = self.posted.lock().expect("side completions lock");
        posted.done.extend(done);
        std::mem::take(&mut posted.wanted)
    }
}

impl DeviceMux {
    /// Queues a background write of `run` at `lba` for a caller to make beside the queue
    /// ([`Lent::Writes`], [`crate::log::SideRecord`]): its bytes stay in
    /// [`DeviceMux::writing`] (a read of its blocks is answered from them) until the caller
    /// posts its completion ([`SideDone`]), which the pipeline then takes as a device's.
    pub(crate) fn queue_side_write(&mut self, token: u64, lba: u64, run: Run, fua: bool) -> SideIo {
        assert_eq!(self.lent, Lent::Writes, "only a lent engine writes beside");
        assert!(is_background(token) && token & 1 == 0);
        let blocks = (run.len_bytes() / crate::format::BLOCK_BYTES) as u64;
        assert!(
            self.overlapping_writes(run.addr, blocks).is_empty(),
            "a write beside the queue overlaps a background write"
        );
        let mut bytes = vec![0u8; run.len_bytes()];
        run.copy_to(&mut bytes);
        let entry = self.writes_outstanding.entry(token).or_default();
        entry.0 += 1;
        entry.1.push(run.addr);
        self.writing
            .insert(run.addr, (blocks, token, run.into_pieces()));
        self.side_in_flight += 1;
        self.waits.lent_writes += 1;
        SideIo::Write {
            token,
            lba,
            bytes,
            fua,
        }
    }

    /// Queues a flush for a caller to make beside the queue after the writes queued before
    /// it ([`DeviceMux::queue_side_write`]).
    pub(crate) fn queue_side_flush(&mut self, token: u64) -> SideIo {
        assert_eq!(self.lent, Lent::Writes, "only a lent engine flushes beside");
        assert!(is_background(token) && token & 1 == 1);
        self.side_in_flight += 1;
        SideIo::Flush { token }
    }

    /// Where callers post the completions of what they wrote beside the queue.
    pub(crate) fn side_done(&self) -> Arc<SideDone> {
        Arc::clone(&self.side)
    }

    /// A new handle for a caller's writes beside the queue, where the device has one that
    /// writes.
    pub(crate) fn new_side_io(&self) -> Option<Box<dyn nvme::AnyThreadIo>> {
        self.inner.any_thread_io().filter(|io| io.writes())
    }

    /// Moves the completions callers posted into the background completions, for the
    /// pipeline. Asks to be woken ([`SideDone`]) while some are still outstanding.
    pub(crate) fn take_side_done(&mut self) {
        if self.side_in_flight == 0 {
            return;
        }
        let side = Arc::clone(&self.side);
        let mut posted = side.posted.lock().expect("side completions lock");
        for (token, result) in posted.done.drain(..) {
            self.side_in_flight -= 1;
            let is_flush = token & 1 != 0;
            if !is_flush {
                self.write_done(token);
            }
            self.background.push(IoCompletion {
                token,
                kind: if is_flush {
                    nvme::OpKind::Flush
                } else {
                    nvme::OpKind::Write
                },
                result,
                buf: None,
            });
        }
        posted.wanted = self.side_in_flight > 0;
    }

    /// The completions callers posted for their writes beside the queue, for the pipeline
    /// ([`DeviceMux::take_side_done`]), with those the queue left uncounted.
    pub(crate) fn take_side_completions(&mut self) -> Vec<IoCompletion> {
        self.take_side_done();
        std::mem::take(&mut self.background)
    }

    /// Waits a moment for callers' writes beside the queue (nothing of the queue's own is in
    /// flight to wait on): they take a device write's time.
    pub(super) fn wait_side(&mut self, timeout: Duration) {
        if self.side_in_flight > 0 && self.background.is_empty() {
            std::thread::sleep(timeout.min(SIDE_WAIT_SLICE));
            self.take_side_done();
        }
    }
}
