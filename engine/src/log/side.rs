//! fsyncs run by a client on an engine its reactor lent it: the record is built here, with
//! the engine held, and written by the client beside the device's queue after it gave the
//! engine back ([`SideRecord`]), so the fsync costs no wake-up and nobody waits for the
//! client while the device works (docs/reactors.md, "fsyncs run in the client").
//!
//! # Invariants
//! - Runs only with nothing in flight on the queue, no record in the pipeline and no commit
//!   in flight: the record's writes are not ordered against the queue's, and its flush must
//!   cover every write the record references.
//! - Declining changes nothing but caches, and counts nothing: a fallback to a commit, or
//!   more than [`LENT_FSYNC_BYTES_MAX`] of data in place, goes to the owner untouched.
//! - The record takes a ticket in the pipeline like any other; it is durable once its
//!   completions, posted by the client, are counted, and later records wait for it.
//!
//! Fault model: a failed write or flush fails the fsync and, once counted, the filesystem
//! (fail-stop); a record dropped unwritten fails its writes the same way.

use super::FsyncStart;
use crate::error::{EngineError, Result};
use crate::fs::Filesystem;

/// In-place data an fsync run in a caller's thread may write ([`Filesystem::fsync_beside`]):
/// its reactor waits for its engine while the record is built, and the caller makes the
/// writes one at a time with no queue depth, where the reactor overlaps a large fsync's
/// writes with other work. A record that carries its data is small
/// ([`super::EMBED_MAX_BLOCKS`]) and always may.
pub const LENT_FSYNC_BYTES_MAX: usize = 256 << 10;

/// An fsync's writes (its record, and data in place) and flush, for the caller to make
/// beside the device's queue once it has given the engine back
/// ([`Filesystem::fsync_beside`]). Their completions go back to the engine through the
/// device multiplexer, which counts them as a device's: until then a read of the blocks is
/// answered from memory and later records wait for this one. Dropped without
/// [`SideRecord::run`] (a caller that panicked), its writes fail and the filesystem
/// fail-stops: the engine would otherwise wait for them forever.
#[must_use = "an fsync beside the queue is durable only once run"]
pub struct SideRecord {
    ios: Vec<crate::mux::SideIo>,
    done: std::sync::Arc<crate::mux::SideDone>,
}

impl std::fmt::Debug for SideRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideRecord")
            .field("ios", &self.ios.len())
            .finish()
    }
}

impl SideRecord {
    /// Makes the writes, in order, then the flush, through `io`; durable when this returns
    /// `Ok`. The first failure fails the rest unmade and the filesystem fail-stops (as on
    /// a background failure). Also returns whether the engine's owner asked to be woken
    /// (it waits for these completions: ring it).
    pub fn run(mut self, io: &mut dyn nvme::AnyThreadIo) -> (Result<()>, bool) {
        let ios = std::mem::take(&mut self.ios);
        let mut done = Vec::with_capacity(ios.len());
        let mut failed: Option<nvme::DevError> = None;
        for side in ios {
            let token = side.token();
            let result = match (&failed, side) {
                (Some(e), _) => Err(e.clone()),
                (
                    None,
                    crate::mux::SideIo::Write {
                        lba, bytes, fua, ..
                    },
                ) => io.write_at(lba, &bytes, fua),
                (None, crate::mux::SideIo::Flush { .. }) => io.flush(),
            };
            if let Err(e) = &result {
                failed.get_or_insert(e.clone());
            }
            done.push((token, result));
        }
        let wake = self.done.post(done);
        (failed.map_or(Ok(()), |e| Err(EngineError::Device(e))), wake)
    }
}

impl Drop for SideRecord {
    fn drop(&mut self) {
        if self.ios.is_empty() {
            return;
        }
        // ECANCELED: never made.
        const ECANCELED: i32 = 125;
        let error = nvme::DevError::Io {
            op: nvme::OpKind::Write,
            errno: ECANCELED,
        };
        self.done.post(
            self.ios
                .drain(..)
                .map(|io| (io.token(), Err(error.clone()))),
        );
    }
}

impl Filesystem {
    /// [`Filesystem::fsync_group`] for a thread that does not own the device's queue (a
    /// client whose reactor lent it the engine): the record is built here and its writes
    /// (and flush) are handed back as a [`SideRecord`], which the caller makes beside the
    /// queue through its own any-thread handle ([`nvme::AnyThreadIo`]) *after* giving the
    /// engine back: the fsync is durable when [`SideRecord::run`] returns, with no wake-up
    /// of the queue's owner nor of the caller, and nobody waits for the engine meanwhile.
    /// What a kernel filesystem's fsync does in its caller's thread. `Ok(None)`: durable
    /// already (nothing new to log).
    ///
    /// `None`: not run, nothing changed but caches, the owner must run it. So when the
    /// device cannot write beside its queue, when anything is in flight (a write beside the
    /// queue would not be ordered against one on it, and the pipeline releases records in
    /// order) or a commit is, when the filesystem has failed, and when the fsync would fall
    /// back to a commit or write more than [`LENT_FSYNC_BYTES_MAX`] of data in place.
    pub fn fsync_beside(&mut self, group: &[(u64, bool)]) -> Option<Result<Option<SideRecord>>> {
        if self.failed.is_some()
            || self.fetch.deferring
            || !self.dev.writes_beside_queue()
            || !self.dev.queue_idle()
        {
            return None;
        }
        // What callers made beside the queue and posted since: counted, their records
        // released (a caller's previous fsync, usually).
        if let Err(e) = self.take_side_done_lent() {
            return Some(Err(e));
        }
        if !self.dev.idle() || !self.log.pipeline.is_empty() || self.commit_in_flight().is_some() {
            return None;
        }
        let stats = self.log.stats;
        self.dev.lend(crate::mux::Lent::Writes);
        self.op.lent = true;
        let started = (|| {
            for &(ino, _) in group {
                self.check_exists(ino)?;
            }
            self.fsync_group_start(group)
        })();
        self.op.lent = false;
        self.dev.lend(crate::mux::Lent::No);
        let ios = std::mem::take(&mut self.log.side_out);
        match started {
            Ok(FsyncStart::Durable) => {
                assert!(ios.is_empty(), "nothing written for a durable fsync");
                self.fetch.stats.lent_fsyncs += 1;
                Some(Ok(None))
            }
            Ok(FsyncStart::Pending(ticket)) => {
                assert!(
                    !ios.is_empty()
                        && ios
                            .iter()
                            .all(|io| (io.token() & !crate::mux::TAG_MASK) >> 1 == ticket),
                    "a record beside the queue is its ticket's writes"
                );
                self.fetch.stats.lent_fsyncs += 1;
                Some(Ok(Some(SideRecord {
                    ios,
                    done: self.dev.side_done(),
                })))
            }
            Ok(FsyncStart::NeedsCommit) => {
                // Declined before anything was queued: counted when the owner runs it.
                assert!(ios.is_empty(), "a declined fsync queued nothing");
                self.log.stats = stats;
                self.fetch.stats.lent_fsyncs_declined += 1;
                None
            }
            Ok(start @ FsyncStart::AfterCommit { .. }) => {
                unreachable!("no commit is in flight while lent for writes: {start:?}")
            }
            Err(e) => {
                // Failed before its record was queued (a record queued is always returned).
                assert!(ios.is_empty(), "a failed fsync queued nothing");
                Some(Err(e))
            }
        }
    }

    /// A handle through which a caller makes [`SideRecord`]s' writes beside the queue, where
    /// the device has one that writes (a file image's own `O_DIRECT` descriptor, a
    /// passthrough namespace's own descriptor for synchronous I/O commands).
    pub fn side_io(&self) -> Option<Box<dyn nvme::AnyThreadIo>> {
        self.dev.new_side_io()
    }
}
