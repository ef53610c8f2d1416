//! corefs reactors: the thread that owns the engine and its device queue, the client API, and
//! grouped fsyncs.
//!
//! ```text
//! client threads ── Client::submit ──► bounded request queue (lock-free) ──► reactor thread
//!      ▲                                                                     │ pinned, polls
//!      └──── Client::poll / wait ◄── per-client bounded completion queue ◄────┘ engine + device
//! ```
//!
//! A reactor is pinned to a chosen core and owns its shards and its device queue. Bounded
//! lock-free queues run both ways with backpressure at submit. Fsyncs that arrive while the
//! reactor is busy are made durable by one log record and one flush, with several groups'
//! records in flight at once and their waiters released in order as each becomes durable;
//! consecutive reads are served with their device reads in flight together; commits run when
//! the engine says one is due (timer, dirty limit, half-full log), between batches. There is
//! an idle policy (busy-poll, or spin then park), statistics with the fsync latency split by
//! phase, a shutdown that drains, commits and unmounts, and `sim` (with the `sim` feature),
//! the same batch code driven in one thread by a seeded scheduler for deterministic simulation.
//!
//! A reactor with nothing to do lends its engine (`caller`): a client that finds it lent
//! runs a lookup or a read itself when memory answers it, with no hop between threads.
//!
//! By default one reactor owns every shard. Several (`Config::reactors`, `multi`) each own
//! every N-th shard as a partition of the engine on a device queue of their own, with a
//! coordinator thread that runs the coordinated commits (each reactor serving generation N+1
//! while its half of N is written) and the operations that span reactors, on shards lent to
//! it. See docs/reactors.md.

pub mod affinity;
mod caller;
pub mod client;
pub mod contention;
mod delivery;
mod doorbell;
mod execute;
mod meta_wait;
mod multi;
pub mod op;
mod owed;
mod queue;
mod reply;
mod runtime;
#[cfg(feature = "sim")]
pub mod sim;
pub mod source;
pub mod stats;

/// A panic's message (its `&str` or `String` payload), for logs and error messages.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

pub use client::{Client, SubmitError};
pub use doorbell::ring_eventfd;
pub use op::{Completion, Op, OpenHow, Opened, Owner, Reply, SAME_DIR};
pub use reply::{wait_awake, wait_policy, Wait, DEEP_QUEUE_REQUESTS};
pub use runtime::{durable_spin_budget, Config, IdlePolicy, Runtime, DURABLE_SPIN_MAX};
pub use stats::{Latency, ReactorStats};
