//! corefs reactors: the thread that owns the engine and its device queue, the client API, and
//! grouped fsyncs.
//!
//! ```text
//! client threads ── Client::submit ──► bounded request queue (lock-free) ──► reactor thread
//!      ▲                                                                     │ pinned, polls
//!      └──── Client::poll / wait ◄── per-client bounded completion queue ◄────┘ engine + device
//! ```
//!
//! What is built: one reactor per filesystem, pinned to a chosen core, owning every shard and
//! the device's queue; bounded lock-free queues both ways with backpressure at submit; fsyncs
//! that arrive while the reactor is busy made durable by one log record and one flush, with
//! several groups' records in flight at once and their waiters released in order as each
//! becomes durable; consecutive reads served with their device reads in flight together;
//! commits when the engine says one is due (timer, dirty limit, half-full log), between
//! batches; an idle policy (busy-poll, or spin then park); statistics with the fsync latency
//! split by phase; shutdown that drains, commits and unmounts; and [`sim`], the same batch code
//! driven in one thread by a seeded scheduler for deterministic simulation.
//!
//! Not built yet: several reactors each owning a subset of the shards with their own device
//! queues and a cross-core commit coordinator. The engine is one state machine over all shards
//! today; splitting it per shard (and running generation N+1 while N commits) is the next step.
//! See docs/reactors.md.

pub mod affinity;
pub mod client;
mod doorbell;
mod meta_wait;
mod multi;
pub mod op;
mod owed;
mod runtime;
pub mod sim;
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
pub use op::{Completion, Op, Owner, Reply};
pub use runtime::{Config, IdlePolicy, Runtime};
pub use stats::{Latency, ReactorStats};
