//! The replies a reactor owes: every request it has taken into a batch and not yet answered
//! or handed on (to another reactor or the coordinator). A reactor that panics loses the
//! requests its stack held (a batch half run, completions not yet pushed); this ledger, kept
//! outside the code that panics, is how it still answers each of them (with EIO), so no
//! client waits forever for a reply that will never come.
//!
//! # Invariants
//! - An entry is added when a request enters a batch and removed exactly once: when its
//!   completion is pushed ([`crate::runtime::Reactor`]'s deliver) or it leaves the reactor.
//!   Two requests of one client with the same token are two counts of one entry: they are
//!   answered alike, so the count is all that matters.
//! - Bounded by what clients may have in flight (each client's capacity).
//! - An entry keeps the earliest submit time of its requests: the reply latency the reactor
//!   reports ([`crate::ReactorStats::reply`]) is measured from it when the entry settles.

use crate::reply::ReplyQueue;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Instant;

/// A client's reply queue (by address) and the token of one of its requests.
type Key = (usize, u64);

/// The keys are a pointer and a token: a multiply-rotate hash is enough, and SipHash would
/// cost more than the rest of the bookkeeping on the reactor's per-request path.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[derive(Default)]
pub(crate) struct Owed {
    entries: HashMap<Key, (Arc<ReplyQueue>, u32, Instant), BuildHasherDefault<KeyHasher>>,
}

fn key(reply: &Arc<ReplyQueue>, token: u64) -> Key {
    (Arc::as_ptr(reply) as usize, token)
}

impl Owed {
    /// A request of `reply`'s client with `token`, submitted at `submitted`, is now this
    /// reactor's to answer.
    pub fn take(&mut self, reply: &Arc<ReplyQueue>, token: u64, submitted: Instant) {
        self.entries
            .entry(key(reply, token))
            .or_insert_with(|| (reply.clone(), 0, submitted))
            .1 += 1;
    }

    /// That request was answered or handed on: when it was submitted, if it was owed.
    pub fn settle(&mut self, reply: &Arc<ReplyQueue>, token: u64) -> Option<Instant> {
        let k = key(reply, token);
        let entry = self.entries.get_mut(&k)?;
        let submitted = entry.2;
        entry.1 -= 1;
        if entry.1 == 0 {
            self.entries.remove(&k);
        }
        Some(submitted)
    }

    /// Every reply still owed (a token once per count), emptying the ledger.
    pub fn take_all(&mut self) -> Vec<(Arc<ReplyQueue>, u64)> {
        let mut all = Vec::new();
        for ((_, token), (reply, count, _)) in self.entries.drain() {
            for _ in 0..count {
                all.push((reply.clone(), token));
            }
        }
        all
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
