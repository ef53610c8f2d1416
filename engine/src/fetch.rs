//! Metadata the device must supply, fetched without waiting: how an operation that misses
//! the node cache is suspended instead of holding its caller while the device answers.
//!
//! A caller that must not wait (a reactor) runs an operation's *lookups* first through
//! [`Filesystem::without_waiting`]. While it runs, a tree node that is not in memory is not
//! read: its block address is noted and the lookup fails with [`crate::EngineError::WouldBlock`],
//! which `without_waiting` turns into a device read in the background
//! ([`crate::reads`]'s node sets) and returns as [`Deferred::Fetching`] with the set's
//! number. The caller parks the operation and runs it again once the set is answered: the
//! block is then waiting in [`NodeFetch`]'s `fetched` map and the tree takes it from there
//! (checked against its parent's crc32c like any node read) instead of the device.
//!
//! # Invariants
//! - Nothing changes while deferring: a suspended operation is run again from its start, so
//!   only lookups may run deferred. [`Filesystem::with_tree`] asserts that no tree is
//!   changed while deferring; the reactor runs an operation that changes the filesystem only
//!   after a deferred probe of what it will look up found everything in memory.
//! - `WouldBlock` never reaches a caller: it exists only while deferring, and
//!   `without_waiting` replaces the result of any run that noted a miss.
//! - Bounded: at most [`FETCHED_MAX`] fetched blocks wait to be taken (the oldest go
//!   first); a block in flight is fetched once however many operations wait for it.
//! - A fetched block is only a hint: it is used when it decodes under the pointer the tree
//!   holds at the time (crc32c, owner, level), and otherwise dropped and read again. So a
//!   block freed and reused after it was fetched can never be mistaken for its new contents.
//!
//! Fault model: as for data reads — a device error fails the filesystem (fail-stop) and the
//! operations run again meet the sticky error; a block that fails its check is read again
//! synchronously, where corruption is reported as it always is.

use crate::fs::Filesystem;
use std::collections::{HashMap, VecDeque};

/// Fetched blocks kept for the operations that asked for them (4 MiB of 4 KiB blocks).
pub const FETCHED_MAX: usize = 1024;

/// What [`Filesystem::without_waiting`] made of a run.
#[derive(Debug)]
pub enum Deferred<T> {
    /// Everything was in memory: the run's result.
    Ready(T),
    /// A node had to come from the device: its read is in flight in the read set with this
    /// number ([`Filesystem::read_progress`] hands it back, with no results). Run the
    /// operation again once it is answered.
    Fetching(u64),
}

/// Counters of deferred lookups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Runs that noted a miss and were deferred.
    pub deferred: u64,
    /// Node blocks read in the background.
    pub blocks_fetched: u64,
    /// Fetched blocks the tree took instead of reading the device.
    pub blocks_used: u64,
    /// Fetched blocks that no longer matched their pointer (read again), or were dropped
    /// unused to keep the bound.
    pub blocks_stale: u64,
    pub blocks_dropped: u64,
    /// Node blocks read ahead of a walk ([`crate::tree::READ_AHEAD_NODES`] at a time).
    pub blocks_ahead: u64,
    /// Runs deferred for the data blocks a partial write lays its bytes over
    /// ([`Filesystem::probe_write_edges`]), and those blocks.
    pub edge_deferred: u64,
    pub edge_blocks: u64,
    /// Runs from memory alone ([`Filesystem::from_memory`]) that missed and were left to
    /// the device's owner.
    pub from_memory_misses: u64,
    /// Changes run by a thread the engine was lent to ([`Filesystem::change_lent`]), and
    /// those refused for space and left to the owner.
    pub lent_changes: u64,
    pub lent_no_space: u64,
    /// Of the lent changes, writes ([`Filesystem::write_lent`]), and the edge blocks they
    /// read beside the queue ([`Filesystem::write_lent_reading_edges`]).
    pub lent_writes: u64,
    pub lent_write_edge_reads: u64,
    /// fsyncs run by a thread the engine was lent to, their records written beside the
    /// queue ([`Filesystem::fsync_beside`]), and those it gave back to the owner (a fallback
    /// to a commit, or too much data to write in place).
    pub lent_fsyncs: u64,
    pub lent_fsyncs_declined: u64,
}

/// The engine's state for deferred lookups.
#[derive(Default)]
pub(crate) struct NodeFetch {
    /// Set while a deferred run is in progress.
    pub deferring: bool,
    /// Node blocks the current deferred run missed.
    pub missing: Vec<u64>,
    /// Data blocks the current deferred run needs in the block cache (a partial write's
    /// edges), once its nodes are all in memory.
    pub missing_data: Vec<crate::file::ReadPiece>,
    /// The current run from memory alone ([`Filesystem::from_memory`]) met something only
    /// the device's owner may do (a read that moves the access time): it is left to it.
    pub declined: bool,
    /// Node blocks a tree walk in the current deferred run will likely want next
    /// ([`crate::tree::NodeIo::read_ahead`]): read in the background, waited for by nobody.
    pub ahead: Vec<u64>,
    /// Blocks read in the background, waiting for the tree to take them, each with the
    /// number of its arrival.
    fetched: HashMap<u64, (u64, Vec<u8>)>,
    /// Arrivals, oldest first, as `(address, arrival number)`. An entry whose number is not
    /// its block's in `fetched` is stale (taken, or arrived again later): without the
    /// number, a block fetched over and over would leave one entry per fetch that no
    /// clean-up could tell from the live one, and the queue would grow without bound.
    order: VecDeque<(u64, u64)>,
    arrivals: u64,
    /// Blocks in flight, and the read set each is in.
    pub in_flight: HashMap<u64, u64>,
    pub stats: FetchStats,
}

impl NodeFetch {
    /// True when a fetched block waits at `addr`.
    pub fn holds(&self, addr: u64) -> bool {
        self.fetched.contains_key(&addr)
    }

    /// The fetched block at `addr`, if one waits (taken: the tree holds it from now on).
    pub fn take(&mut self, addr: u64) -> Option<Vec<u8>> {
        self.fetched.remove(&addr).map(|(_, block)| block)
    }

    /// A block arrived from the device.
    pub fn arrived(&mut self, addr: u64, block: Vec<u8>) {
        self.in_flight.remove(&addr);
        self.stats.blocks_fetched += 1;
        self.arrivals += 1;
        self.fetched.insert(addr, (self.arrivals, block));
        self.order.push_back((addr, self.arrivals));
        while self.fetched.len() > FETCHED_MAX {
            let (oldest, number) = self.order.pop_front().expect("every block has an entry");
            if self.fetched.get(&oldest).is_some_and(|&(n, _)| n == number) {
                self.fetched.remove(&oldest);
                self.stats.blocks_dropped += 1;
            }
        }
        // Stale entries are dropped once they are as many as the live ones: the clean-up
        // costs O(1) amortized per arrival, and `order` stays within twice the bound.
        if self.order.len() > 2 * FETCHED_MAX {
            let fetched = &self.fetched;
            self.order
                .retain(|(a, number)| fetched.get(a).is_some_and(|&(n, _)| n == *number));
        }
        assert!(
            self.order.len() <= 2 * FETCHED_MAX && self.fetched.len() <= FETCHED_MAX,
            "fetched blocks stay bounded"
        );
    }

    /// A block's read failed: nobody waits for it any more (the filesystem has failed).
    pub fn lost(&mut self, addr: u64) {
        self.in_flight.remove(&addr);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// A hot node fetched and taken over and over (a node cache far smaller than the tree)
    /// leaves no trail: the queue of arrivals stays within its bound, and eviction still
    /// drops the oldest live block first.
    #[test]
    fn a_block_fetched_and_taken_over_and_over_keeps_the_arrivals_bounded() {
        let mut fetch = NodeFetch::default();
        // A few blocks that wait untaken, then one hot block fetched again and again while
        // one of them stays waiting.
        for addr in 0..8 {
            fetch.arrived(1000 + addr, vec![addr as u8]);
        }
        for round in 0..50_000u64 {
            fetch.arrived(7, vec![1]);
            if round % 2 == 0 {
                assert_eq!(fetch.take(7), Some(vec![1]));
            }
            assert!(
                fetch.order.len() <= 2 * FETCHED_MAX,
                "round {round}: {} arrivals kept",
                fetch.order.len()
            );
        }
        assert_eq!(fetch.take(1003), Some(vec![3]), "untaken blocks stay");
        // Filling past the bound drops the oldest waiting blocks, not the newest.
        for addr in 0..FETCHED_MAX as u64 {
            fetch.arrived(5000 + addr, vec![0]);
        }
        assert!(fetch.take(1000).is_none(), "the oldest went first");
        assert!(fetch.take(5000 + FETCHED_MAX as u64 - 1).is_some());
        assert!(fetch.fetched.len() <= FETCHED_MAX);
    }
}
