//! Delivering completions to clients: push each onto its client's bounded completion queue,
//! then wake each client once.
//!
//! # Invariants
//! - Completions are pushed after the batch has run and clients are woken after that: nothing
//!   runs inline while the engine is mid-operation.
//! - A completion queue never overflows on the normal path: a client never has more in
//!   flight than its queue holds ([`deliver`] asserts it). A failed runtime's answers
//!   ([`deliver_failed`]) never panic: one that finds no room is logged and lost.

use crate::client::ReplyQueue;
use crate::op::Completion;
use engine::EngineError;
use std::sync::Arc;

/// Answers requests with `failure` (a failed runtime). Never panics: a completion queue
/// with no room (which the clients' capacities rule out) loses that completion, logged.
pub(crate) fn deliver_failed(requests: Vec<(Arc<ReplyQueue>, u64)>, failure: &EngineError) {
    let mut to_wake: Vec<Arc<ReplyQueue>> = Vec::new();
    for (reply, token) in requests {
        let completion = Completion {
            token,
            result: Err(failure.clone()),
        };
        if reply.done.push(completion).is_err() {
            tracing::error!(
                token,
                "a failed reactor's answer found its client's queue full"
            );
        }
        if !to_wake.iter().any(|r| Arc::ptr_eq(r, &reply)) {
            to_wake.push(reply);
        }
    }
    for reply in to_wake {
        reply.wake();
    }
}

/// Pushes completions to their clients, then wakes each client once (never inline while the
/// engine is mid-operation).
pub(crate) fn deliver(done: Vec<(Arc<ReplyQueue>, Completion)>) {
    let mut to_wake: Vec<Arc<ReplyQueue>> = Vec::new();
    for (reply, completion) in done {
        // Cannot fail: a client never has more in flight than its queue holds.
        assert!(
            reply.done.push(completion).is_ok(),
            "completion queue overflow"
        );
        if !to_wake.iter().any(|r| Arc::ptr_eq(r, &reply)) {
            to_wake.push(reply);
        }
    }
    for reply in to_wake {
        reply.wake();
    }
}
