//! The atomic batches open on file handles (`corefs_atomic_begin` ... `corefs_atomic_commit`
//! or `corefs_atomic_abort`; engine `atomic` says what a batch guarantees).
//!
//! # Invariants
//! - At most one batch per (filesystem, file handle); it goes with its commit, its abort, the
//!   handle's release or the filesystem's close, whichever comes first.
//! - The table's mutex is held only to look up, stage into or take out a batch, never across a
//!   reactor call; [`OPEN`] counts the batches, so handles without one (every handle of a
//!   program that never opens a batch) pay one atomic load per read or write, not the lock.

use engine::AtomicBatch;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// (filesystem id, file handle) → its open batch.
static BATCHES: Mutex<Option<HashMap<(i64, i64), AtomicBatch>>> = Mutex::new(None);
/// Batches in [`BATCHES`].
static OPEN: AtomicUsize = AtomicUsize::new(0);

fn table<T>(f: impl FnOnce(&mut HashMap<(i64, i64), AtomicBatch>) -> T) -> T {
    // A panic while the lock was held left the map consistent (every change is one insert or
    // remove): the poison is ignored rather than turning every later call into a panic.
    let mut guard = BATCHES.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let result = f(map);
    OPEN.store(map.len(), Ordering::Release);
    result
}

/// Opens a batch on `(fs, fd)`; false when one is open already.
pub(crate) fn begin(fs: i64, fd: i64) -> bool {
    table(|m| match m.entry((fs, fd)) {
        std::collections::hash_map::Entry::Occupied(_) => false,
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(AtomicBatch::new());
            true
        }
    })
}

/// The batch of `(fs, fd)`, taken out (closed), if one is open.
pub(crate) fn take(fs: i64, fd: i64) -> Option<AtomicBatch> {
    if OPEN.load(Ordering::Acquire) == 0 {
        return None;
    }
    table(|m| m.remove(&(fs, fd)))
}

/// True when `(fs, fd)` has a batch open.
pub(crate) fn is_open(fs: i64, fd: i64) -> bool {
    OPEN.load(Ordering::Acquire) != 0 && table(|m| m.contains_key(&(fs, fd)))
}

/// Runs `f` on the batch of `(fs, fd)` when one is open (None otherwise).
pub(crate) fn with<T>(fs: i64, fd: i64, f: impl FnOnce(&mut AtomicBatch) -> T) -> Option<T> {
    if OPEN.load(Ordering::Acquire) == 0 {
        return None;
    }
    table(|m| m.get_mut(&(fs, fd)).map(f))
}

/// Drops every batch of filesystem `fs` (it is closing).
pub(crate) fn forget_fs(fs: i64) {
    if OPEN.load(Ordering::Acquire) != 0 {
        table(|m| m.retain(|&(id, _), _| id != fs));
    }
}
