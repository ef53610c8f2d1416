//! The in-flight table of an io_uring queue: a fixed array of slots indexed by the SQE's
//! `user_data`.
//!
//! Invariants: the table never grows past the queue depth it was made with; a slot is taken at
//! submit and released exactly once, when its CQE is reaped; `user_data` is the slot index, so a
//! CQE naming a free or out-of-range slot is a kernel or memory-safety bug and panics.

use crate::{DmaBuf, OpKind, SharedWrite};

pub(crate) struct InFlight {
    pub token: u64,
    pub kind: OpKind,
    /// The data buffer, owned by the queue while the device may touch it.
    pub buf: Option<DmaBuf>,
    /// Bytes a read or write must transfer; 0 for data-less ops.
    pub expect_bytes: u32,
    /// True when the op's buffer is internal (a DSM range list) and is not handed back.
    pub internal_buf: bool,
    /// A shared write's memory, held until the device is done reading it (never read here:
    /// the device reads what it points to).
    #[allow(dead_code)]
    pub held: Option<Held>,
}

/// What a shared write ([`crate::IoOp::WriteShared`]) keeps alive while in flight: its
/// pieces, and the `iovec` list naming them that a vectored write's SQE points to.
pub(crate) struct Held {
    #[allow(dead_code)]
    pub data: SharedWrite,
    pub iovecs: Box<[libc::iovec]>,
}

// SAFETY: the iovecs point into `data`'s pieces, which are immutable shared bytes (`Bytes`
// is Send and Sync) kept alive by `data` beside them; the raw pointers are only what makes
// `iovec` not Send.
unsafe impl Send for Held {}

impl Held {
    /// Holds `data` with its memory ranges as iovecs ([`SharedWrite::ranges`]).
    pub fn new(data: SharedWrite) -> Held {
        let iovecs = data
            .ranges()
            .into_iter()
            .map(|(at, len)| libc::iovec {
                iov_base: at.cast_mut().cast(),
                iov_len: len,
            })
            .collect();
        Held { data, iovecs }
    }
}

pub(crate) struct Slots {
    entries: Vec<Option<InFlight>>,
    free: Vec<u32>,
}

impl Slots {
    pub fn new(depth: u32) -> Slots {
        Slots {
            entries: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
        }
    }

    pub fn in_flight(&self) -> u32 {
        (self.entries.len() - self.free.len()) as u32
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    /// Takes the slot `user_data` names: the one [`Slots::next_index`] gave the SQE, pushed
    /// since. The caller has checked `is_full` first.
    pub fn take(&mut self, user_data: u64, entry: InFlight) {
        let index = self.free.pop().expect("Slots::take on a full table");
        assert_eq!(
            index as u64, user_data,
            "slot table handed out a different slot"
        );
        let slot = &mut self.entries[index as usize];
        assert!(slot.is_none(), "free list named a busy slot {index}");
        *slot = Some(entry);
    }

    /// The slot the next `take` will take, so an SQE can carry it before the slot is taken
    /// (a push that fails then leaves the table as it was).
    pub fn next_index(&self) -> u64 {
        *self.free.last().expect("Slots::next_index on a full table") as u64
    }

    /// Forgets every slot still in flight, buffers included, so that none goes back to the
    /// pool while the device may still DMA into it (at drop, after a drain that did not end):
    /// a leak is safe, a use-after-DMA is corruption.
    pub fn leak_in_flight(&mut self) {
        if self.in_flight() > 0 {
            std::mem::forget(std::mem::replace(self, Slots::new(1)));
        }
    }

    pub fn release(&mut self, user_data: u64) -> InFlight {
        let entry = self
            .entries
            .get_mut(user_data as usize)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("completion for slot {user_data}, which is not in flight"));
        self.free.push(user_data as u32);
        entry
    }
}
