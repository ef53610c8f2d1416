//! Metadata the device must supply, fetched without waiting: how an operation that misses
//! the node cache is suspended instead of holding its caller while the device answers.
//!
//! A caller that must not wait (a reactor) runs an operation's *lookups* first through
//! [`Filesystem::without_waiting`](crate::Filesystem::without_waiting). While it runs, a tree node that is not in memory is not
//! read: its block address is noted and the lookup fails with [`crate::EngineError::WouldBlock`],
//! which `without_waiting` turns into a device read in the background
//! ([`crate::reads`]'s node sets) and returns as [`Deferred::Fetching`] with the set's
//! number. The caller parks the operation and runs it again once the set is answered: the
//! block is then waiting in [`NodeFetch`]'s `fetched` map and the tree takes it from there
//! (checked against its parent's crc32c like any node read) instead of the device.
//!
//! # Invariants
//! - Nothing changes while deferring: a suspended operation is run again from its start, so
//!   only lookups may run deferred. [`Filesystem::with_tree`](crate::Filesystem::with_tree) asserts that no tree is
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

use std::collections::{HashMap, VecDeque};

mod ops;

/// Fetched blocks kept for the operations that asked for them (4 MiB of 4 KiB blocks).
pub const FETCHED_MAX: usize = 1024;

/// What [`Filesystem::without_waiting`](crate::Filesystem::without_waiting) made of a run.
#[derive(Debug)]
pub enum Deferred<T> {
    /// Everything was in memory: the run's result.
    Ready(T),
    /// A node had to come from the device: its read is in flight in the read set with this
    /// number ([`Filesystem::read_progress`](crate::Filesystem::read_progress) hands it back, with no results). Run the
    /// operation again once it is answered.
    Fetching(u64),
}

/// Counters of deferred lookups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// ([`Filesystem::probe_write_edges`](crate::Filesystem::probe_write_edges)), and those blocks.
    pub edge_deferred: u64,
    pub edge_blocks: u64,
    /// Runs from memory alone ([`Filesystem::from_memory`](crate::Filesystem::from_memory)) that missed and were left to
    /// the device's owner.
    pub from_memory_misses: u64,
    /// Changes run by a thread the engine was lent to ([`Filesystem::change_lent`](crate::Filesystem::change_lent)), and
    /// those refused for space and left to the owner.
    pub lent_changes: u64,
    pub lent_no_space: u64,
    /// Of the lent changes, writes ([`Filesystem::write_lent`](crate::Filesystem::write_lent)), and the edge blocks they
    /// read beside the queue ([`Filesystem::write_lent_reading_edges`](crate::Filesystem::write_lent_reading_edges)).
    pub lent_writes: u64,
    pub lent_write_edge_reads: u64,
    /// fsyncs run by a thread the engine was lent to, their records written beside the
    /// queue ([`Filesystem::fsync_beside`](crate::Filesystem::fsync_beside)), and those it gave back to the owner (a fallback
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
    /// The current run from memory alone ([`Filesystem::from_memory`](crate::Filesystem::from_memory)) met something only
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
