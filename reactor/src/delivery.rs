//! Delivering completions to clients: push each onto its client's bounded completion queue,
//! then wake each client once.
//!
//! # Invariants
//! - Completions are pushed after the batch has run and clients are woken after that: nothing
//!   runs inline while the engine is mid-operation.
//! - A completion queue never overflows on the normal path: a client never has more in
//!   flight than its queue holds. Should an accounting slip get past that, the completion
//!   waits in the queue's overflow, logged ([`ReplyQueue::push`]): delivery never panics,
//!   never blocks and never loses a completion.

use crate::op::Completion;
use crate::reply::ReplyQueue;
use engine::EngineError;
use std::sync::Arc;

/// Answers requests with `failure` (a failed runtime). Never panics.
pub(crate) fn deliver_failed(requests: Vec<(Arc<ReplyQueue>, u64)>, failure: &EngineError) {
    let mut to_wake: Vec<Arc<ReplyQueue>> = Vec::new();
    for (reply, token) in requests {
        let completion = Completion {
            token,
            result: Err(failure.clone()),
        };
        reply.push(completion);
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
        reply.push(completion);
        if !to_wake.iter().any(|r| Arc::ptr_eq(r, &reply)) {
            to_wake.push(reply);
        }
    }
    for reply in to_wake {
        reply.wake();
    }
}
