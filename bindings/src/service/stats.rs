//! What a server reports about itself (`corefs top`): its reactors' statistics and, per
//! connection, who it is and what it asked for. Counters only ever grow; a viewer takes two
//! samples and divides their difference by the time between them.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// One sample of a server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerStats {
    /// Since the server started serving.
    pub uptime_ns: u64,
    /// Connections accepted since the start.
    pub connections_total: u64,
    /// The reactors' statistics, summed over reactors (`reactor::Op::Stats`).
    pub reactors: reactor::ReactorStats,
    /// The connections open now (a non-root asker sees only its own user's).
    pub clients: Vec<ClientStats>,
}

/// One connection's figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientStats {
    pub connection: u64,
    pub pid: i32,
    pub uid: u32,
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub fsyncs: u64,
    /// Lookups, opens, creates, renames, attributes: everything else.
    pub metadata: u64,
    pub locks: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Of those, bytes the server read or wrote in place in the client's buffer arena (from
    /// and into buffers of `corefs_buf_alloc`: no copy on the client's side).
    pub bytes_shared: u64,
    /// Time the server spent on this connection's requests, from taking one to answering it.
    pub service_ns_total: u64,
    /// Inodes it holds open (each open counted).
    pub holds: u32,
}

/// A connection's counters, kept by its workers.
#[derive(Default)]
pub(crate) struct Counters {
    pub requests: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub fsyncs: AtomicU64,
    pub metadata: AtomicU64,
    pub locks: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_shared: AtomicU64,
    pub service_ns_total: AtomicU64,
}

/// What kind of request a worker served, for [`Counters::count`].
pub(crate) enum Work {
    Read(u64),
    Write(u64),
    Fsync,
    Metadata,
    Lock,
}

impl Counters {
    pub fn count(&self, work: Work, service_ns: u64) {
        let add = |c: &AtomicU64, n: u64| {
            c.fetch_add(n, Ordering::Relaxed);
        };
        add(&self.requests, 1);
        add(&self.service_ns_total, service_ns);
        match work {
            Work::Read(bytes) => {
                add(&self.reads, 1);
                add(&self.bytes_read, bytes);
            }
            Work::Write(bytes) => {
                add(&self.writes, 1);
                add(&self.bytes_written, bytes);
            }
            Work::Fsync => add(&self.fsyncs, 1),
            Work::Metadata => add(&self.metadata, 1),
            Work::Lock => add(&self.locks, 1),
        }
    }

    pub fn sample(&self, stats: &mut ClientStats) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        stats.requests = get(&self.requests);
        stats.reads = get(&self.reads);
        stats.writes = get(&self.writes);
        stats.fsyncs = get(&self.fsyncs);
        stats.metadata = get(&self.metadata);
        stats.locks = get(&self.locks);
        stats.bytes_read = get(&self.bytes_read);
        stats.bytes_written = get(&self.bytes_written);
        stats.bytes_shared = get(&self.bytes_shared);
        stats.service_ns_total = get(&self.service_ns_total);
    }
}
