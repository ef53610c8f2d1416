//! The atomic batch a file handle may have open (`corefs_atomic_begin` ... `corefs_atomic_commit`
//! or `corefs_atomic_abort`; engine `atomic` says what a batch guarantees).
//!
//! # Invariants
//! - At most one batch per file handle. It lives in the handle's own [`BatchSlot`] (owned by
//!   the handle's entry in its filesystem's table) and goes with its commit, its abort, or
//!   the handle itself (its release, or the filesystem's close), whichever comes first.
//! - Nothing is shared between handles: a read, write or fstat through a handle without an
//!   open batch reads one flag of that handle ([`BatchSlot::open`], written only by begin,
//!   commit and abort); the slot's mutex is taken only while that handle has a batch open,
//!   by the calls through that handle (which must see the batch anyway), and never across a
//!   reactor call.

use engine::AtomicBatch;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A file handle's atomic batch, if one is open.
#[derive(Default)]
pub(crate) struct BatchSlot {
    /// Set while `batch` holds a batch (set after it is put in, cleared before it is taken
    /// out, both under the lock): a call that reads it clear skips the lock.
    open: AtomicBool,
    batch: Mutex<Option<AtomicBatch>>,
}

impl BatchSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AtomicBatch>> {
        // A panic while the lock was held left the slot consistent (every change is one
        // assignment): the poison is ignored rather than turning later calls into panics.
        self.batch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a batch; false when one is open already.
    pub fn begin(&self) -> bool {
        let mut slot = self.lock();
        if slot.is_some() {
            return false;
        }
        *slot = Some(AtomicBatch::new());
        self.open.store(true, Ordering::Release);
        true
    }

    /// The batch, taken out (closed), if one is open.
    pub fn take(&self) -> Option<AtomicBatch> {
        if !self.open.load(Ordering::Acquire) {
            return None;
        }
        let mut slot = self.lock();
        self.open.store(false, Ordering::Release);
        slot.take()
    }

    /// True when a batch is open.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Runs `f` on the batch when one is open (None otherwise).
    pub fn with<T>(&self, f: impl FnOnce(&mut AtomicBatch) -> T) -> Option<T> {
        if !self.open.load(Ordering::Acquire) {
            return None;
        }
        self.lock().as_mut().map(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_holds_one_batch_from_begin_to_take() {
        let slot = BatchSlot::default();
        assert!(!slot.is_open());
        assert!(slot.with(|_| ()).is_none(), "no batch: nothing to run on");
        assert!(slot.take().is_none());
        assert!(slot.begin());
        assert!(!slot.begin(), "one batch at a time");
        assert!(slot.is_open());
        assert_eq!(slot.with(|b| b.stage(0, b"abc").is_ok()), Some(true));
        let mut batch = slot.take().expect("the open batch");
        assert!(!slot.is_open());
        assert_eq!(batch.take_writes(), vec![(0, b"abc".to_vec())]);
        assert!(slot.take().is_none(), "taken once");
        assert!(slot.begin(), "a new batch after the last one closed");
    }
}
