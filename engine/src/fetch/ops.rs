//! Running an operation without waiting for the device: [`Filesystem::without_waiting`]
//! turns a node-cache miss into a background fetch, and the probes a reactor runs before an
//! operation that changes the filesystem (so it runs only once its nodes are in memory).
//!
//! Layering: what is fetched and in flight lives in [`super::NodeFetch`], which never names
//! [`Filesystem`]; this file runs lookups over it. [`super`] states the invariants (nothing
//! changes while deferring, `WouldBlock` never reaches a caller).

use super::{Deferred, FetchStats};
use crate::fs::Filesystem;

impl Filesystem {
    /// Runs `f` — lookups only, never a change — without waiting for the device: if a tree
    /// node it needs is not in memory, its read is started in the background and
    /// [`Deferred::Fetching`] says which read set to wait for; `f`'s result is then dropped
    /// (it saw a miss). A failed filesystem reads nothing in the background: `f` then runs
    /// as usual.
    ///
    /// # Panics
    /// If `f` changes a tree (a contract violation: a deferred run must be repeatable).
    pub fn without_waiting<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> Deferred<T> {
        if self.failed.is_some() {
            return Deferred::Ready(f(self));
        }
        assert!(!self.fetch.deferring, "deferred runs do not nest");
        self.fetch.deferring = true;
        let out = f(self);
        self.fetch.deferring = false;
        let ahead = std::mem::take(&mut self.fetch.ahead);
        let data = std::mem::take(&mut self.fetch.missing_data);
        if self.fetch.missing.is_empty() {
            if data.is_empty() {
                return Deferred::Ready(out);
            }
            // Only data blocks: read into the block cache, where the run finds them next time.
            drop(out);
            self.fetch.stats.edge_deferred += 1;
            self.fetch.stats.edge_blocks += data.len() as u64;
            return Deferred::Fetching(self.start_fill(data));
        }
        drop(out);
        self.fetch.stats.deferred += 1;
        let mut missing = std::mem::take(&mut self.fetch.missing);
        missing.sort_unstable();
        missing.dedup();
        let mut wait_for = None;
        let mut new = Vec::new();
        for addr in missing {
            match self.fetch.in_flight.get(&addr) {
                Some(&set) => {
                    wait_for.get_or_insert(set);
                }
                None => new.push(addr),
            }
        }
        if !new.is_empty() {
            let set = self.start_node_reads(&new);
            for addr in new {
                self.fetch.in_flight.insert(addr, set);
            }
            wait_for = Some(set);
        }
        // The walk's next nodes, in a set of their own: the run waits only for what it
        // missed. A later miss of one of them waits for this set instead of reading again.
        let mut ahead: Vec<u64> = ahead
            .into_iter()
            .filter(|a| !self.fetch.in_flight.contains_key(a) && !self.fetch.holds(*a))
            .collect();
        ahead.sort_unstable();
        ahead.dedup();
        if !ahead.is_empty() {
            self.fetch.stats.blocks_ahead += ahead.len() as u64;
            let set = self.start_node_reads(&ahead);
            for addr in ahead {
                self.fetch.in_flight.insert(addr, set);
            }
        }
        Deferred::Fetching(wait_for.expect("a miss was noted"))
    }

    /// Runs `f` — lookups only, never a change — from memory alone, for a thread that is
    /// not the device's owner (a client running a request while its reactor sleeps): if
    /// anything `f` needs is not in memory, nothing is read (the device stays untouched:
    /// [`crate::mux::DeviceMux`] asserts so) and the result is `None`; the caller
    /// then sends the request to the owner. A failed filesystem gives `None` too (its
    /// operations may read synchronously).
    ///
    /// # Panics
    /// If `f` changes a tree or reaches the device (contract violations).
    pub fn from_memory<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> Option<T> {
        let (out, data) = self.run_from_memory(f, false)?;
        debug_assert!(data.is_empty(), "a miss of data is a miss");
        Some(out)
    }

    /// [`Filesystem::from_memory`]; with `data_allowed`, data blocks the run missed (its
    /// tree nodes all found) are not a miss but handed back, for the caller to read beside
    /// the queue ([`Filesystem::read_lent`]).
    pub(crate) fn run_from_memory<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> T,
        data_allowed: bool,
    ) -> Option<(T, Vec<crate::file::ReadPiece>)> {
        if self.failed.is_some() || self.fetch.deferring {
            return None;
        }
        self.fetch.deferring = true;
        self.fetch.declined = false;
        self.dev.lend(crate::mux::Lent::Nothing);
        let out = f(self);
        self.dev.lend(crate::mux::Lent::No);
        self.fetch.deferring = false;
        // Read-ahead hints are the owner's to act on when it misses itself.
        self.fetch.ahead.clear();
        let data = std::mem::take(&mut self.fetch.missing_data);
        let missed = !self.fetch.missing.is_empty()
            || (!data.is_empty() && !data_allowed)
            || std::mem::take(&mut self.fetch.declined);
        self.fetch.missing.clear();
        if missed {
            self.fetch.stats.from_memory_misses += 1;
            return None;
        }
        Some((out, data))
    }

    /// True when a thread that does not own the device may run changes on this engine
    /// ([`Filesystem::change_lent`]): the device can read beside its queue.
    pub fn changes_lendable(&self) -> bool {
        self.dev.reads_beside_queue()
    }

    /// Runs the change `f` for a thread that does not own the device's queue (a client
    /// running a request while its reactor sleeps), after the caller checked from memory
    /// that what the change looks up is there. A tree node it still misses is read
    /// synchronously beside the queue ([`nvme::AnyThreadIo`]); the queue itself is never
    /// touched (the device asserts so). `None`: not run, nothing changed, the owner must run
    /// it — the engine has failed, cannot read beside its queue, or the change was refused
    /// for space before it changed anything (the owner commits and tries again).
    ///
    /// # Panics
    /// If `f` reaches the device's queue: only changes that write nothing to the device
    /// themselves may run here (names, links, attributes, holds; not data).
    pub fn change_lent<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> crate::Result<T>,
    ) -> Option<crate::Result<T>> {
        if self.failed.is_some() || self.fetch.deferring || !self.dev.reads_beside_queue() {
            return None;
        }
        let changes = self.op.changes;
        self.dev.lend(crate::mux::Lent::Reads);
        self.op.lent = true;
        let out = f(self);
        self.op.lent = false;
        self.dev.lend(crate::mux::Lent::No);
        if matches!(out, Err(crate::EngineError::NoSpace)) && self.op.changes == changes {
            self.fetch.stats.lent_no_space += 1;
            return None;
        }
        self.fetch.stats.lent_changes += 1;
        Some(out)
    }

    /// Counters of deferred lookups.
    pub fn fetch_stats(&self) -> FetchStats {
        self.fetch.stats
    }

    /// Looks up what a read or write of `len` bytes at `offset` of file `ino` maps (its
    /// inode and extent items), changing nothing: the probe a caller runs deferred before
    /// the operation itself.
    pub fn probe_range(&mut self, ino: u64, offset: u64, len: usize) -> crate::Result<()> {
        let len = crate::file::rw_len(offset, len)?;
        self.probe_extents(ino, offset, len as u64)
    }

    /// Deferred, as [`Filesystem::probe_range`], for a write of `len` bytes at `offset` of
    /// file `ino` (`None`: an append, at the end of the file): also notes the edge blocks the
    /// write reads (the blocks it covers only in part) that memory does not hold, so the run
    /// defers until they are in the block cache instead of the write reading them while the
    /// reactor waits. With the block cache off there is nowhere to keep them: the write
    /// reads them itself.
    pub fn probe_write_edges(
        &mut self,
        ino: u64,
        offset: Option<u64>,
        len: usize,
    ) -> crate::Result<()> {
        let offset = match offset {
            Some(offset) => offset,
            None => self.stat(ino)?.size,
        };
        let len = crate::file::rw_len(offset, len)?;
        self.probe_extents(ino, offset, len as u64)?;
        if !self.fetch.deferring || self.block_cache.capacity_blocks() == 0 {
            return Ok(());
        }
        let pieces = self.edge_reads(ino, offset, offset + len as u64)?;
        self.fetch.missing_data.extend(pieces);
        Ok(())
    }
}
