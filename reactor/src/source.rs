//! Requests that reach a reactor from outside its client queue, polled by the reactor itself:
//! a storage service's shared-memory rings (`corefs serve`), so no thread stands between a
//! client process and the reactor (a thread in between is a third party to schedule, and on
//! two cores it shares one with the client or the reactor: tens of microseconds a request).
//!
//! # Invariants
//! - A source is polled only by the reactor it was added to (the first; a runtime of one
//!   reactor: [`crate::Runtime::add_source`] refuses more), at every turn of its loop, and is
//!   counted as work by every check that decides whether the reactor may sleep.
//! - No lost wake-up, as for the client queue: the reactor tells each source it is about to
//!   sleep ([`Source::parked`]), then looks at them again, then sleeps on its doorbell; a
//!   source's client publishes its request, then reads the parked flag and rings the
//!   doorbell if set.
//! - A request taken from a source completes through its [`CompletionSink`], after the batch
//!   (never inline while the engine is mid-operation), exactly once, as a client's does.

use crate::op::Op;
use crate::reply::ReplyQueue;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where a reactor finds requests besides its client queue.
pub trait Source: Send + Sync {
    /// Whether a request is waiting (cheap: asked before every sleep and while idle).
    fn ready(&self) -> bool;
    /// Hands up to `max` waiting requests to `take`, each with the token its completion will
    /// carry; returns how many.
    fn take(&self, max: usize, take: &mut dyn FnMut(Op, u64)) -> usize;
    /// The reactor is about to sleep on its doorbell (true), or is awake again (false).
    fn parked(&self, parked: bool);
}

/// Where the completions of a source's requests go ([`crate::reply`] delivers to it).
pub use crate::reply::CompletionSink;

pub(crate) struct Entry {
    pub id: u64,
    pub source: Arc<dyn Source>,
    pub reply: Arc<ReplyQueue>,
}

/// The sources of one reactor: a list the runtime changes and the reactor copies when its
/// version moved (one atomic load per turn otherwise).
#[derive(Default)]
pub(crate) struct Sources {
    list: Mutex<Vec<Arc<Entry>>>,
    version: AtomicU64,
}

impl Sources {
    pub fn add(&self, entry: Entry) {
        self.list
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::new(entry));
        self.version.fetch_add(1, Ordering::Release);
    }

    pub fn remove(&self, id: u64) -> bool {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        let before = list.len();
        list.retain(|e| e.id != id);
        let removed = list.len() < before;
        if removed {
            self.version.fetch_add(1, Ordering::Release);
        }
        removed
    }
}

/// A reactor's copy of its sources.
#[derive(Default)]
pub(crate) struct Polled {
    version: u64,
    entries: Vec<Arc<Entry>>,
}

impl Polled {
    /// The current sources (refreshed when the list changed).
    pub fn refresh(&mut self, sources: &Sources) -> &[Arc<Entry>] {
        let version = sources.version.load(Ordering::Acquire);
        if version != self.version {
            self.entries = sources
                .list
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            self.version = version;
        }
        &self.entries
    }
}

/// Whether any of `sources` has a request waiting.
pub(crate) fn any_ready(sources: &Sources) -> bool {
    if sources.version.load(Ordering::Acquire) == 0 {
        return false;
    }
    sources
        .list
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|e| e.source.ready())
}

/// Tells every source the reactor sleeps (or woke).
pub(crate) fn set_parked(sources: &Sources, parked: bool) {
    if sources.version.load(Ordering::Acquire) == 0 {
        return;
    }
    for e in sources
        .list
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        e.source.parked(parked);
    }
}
