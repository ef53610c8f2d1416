//! DMA buffer pools: one slab per queue, allocated once at start-up, carved into equal buffers.
//!
//! The slab comes from 2 MiB hugepages (`MAP_HUGETLB`) so the IOMMU and the kernel's pinning see
//! few, large pages. When none are reserved it falls back to ordinary anonymous memory advised
//! with `MADV_HUGEPAGE` and says so once, with the command that reserves them.
//!
//! # Invariants
//! - The slab is never resized or unmapped while a buffer of it lives: every [`DmaBuf`] holds
//!   the pool alive through an `Arc`.
//! - A buffer index is owned by at most one [`DmaBuf`] at a time; dropping the buffer returns
//!   the index to a bounded lock-free free list. This single ownership is what makes handing the
//!   buffer's memory to the device (and to another thread) sound.
//! - The free list hands out the buffer freed last ([`FreeStack`]): I/O cycles through as few
//!   buffers as it keeps in flight, whose memory the caches still hold, and an ordinary-memory
//!   slab (mapped, not faulted in) becomes resident only as far as buffers are ever in use at
//!   once (a ring registers it a 2 MiB chunk at a time, [`DmaPool::bufs_per_chunk`]).
//! - Every buffer starts at a multiple of its size within a 2 MiB-aligned slab, and sizes are
//!   multiples of 4 KiB, so buffers are aligned for every LBA size up to 4 KiB.
//! - An exhausted pool returns `None` from [`DmaPool::alloc`]: backpressure, never growth.

use memmap2::{MmapMut, MmapOptions};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

const HUGEPAGE_BYTES: usize = 2 << 20;
/// Smallest buffer size and alignment: the largest LBA size corefs supports.
pub const BUF_ALIGN_BYTES: usize = 4096;

/// Where a pool's slab came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolBacking {
    /// Reserved 2 MiB hugepages (`MAP_HUGETLB`).
    Hugepages,
    /// Ordinary anonymous memory with a transparent-hugepage hint.
    Anonymous,
}

/// Whether a pool may use hugepages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugepagePolicy {
    /// Use hugepages when reserved, fall back otherwise (and say so once).
    #[default]
    Prefer,
    /// Never try hugepages (tests, tools).
    Never,
}

/// io_uring registers at most 16384 buffers per ring (IORING_MAX_REG_BUFFERS), and buffer
/// indexes travel in 16-bit SQE fields.
pub const MAX_BUFFERS: u32 = 1 << 14;

/// Largest DMA buffer, so the largest single I/O. NVMe controllers cap a transfer far lower
/// (MDTS, typically 128 KiB to 2 MiB) and so does the block layer; past this a buffer only
/// wastes pinned memory. It also keeps every transfer length within the u32 fields it travels in.
pub const BUF_BYTES_MAX: usize = 16 << 20;

/// Largest DMA pool (buffer size x buffers) of one queue. The pool is one slab, pinned when
/// registered, and every reactor has one: 1 GiB is 32 times the default and still leaves a
/// machine room for several queues.
pub const POOL_BYTES_MAX: usize = 1 << 30;

/// Checks a pool's geometry and returns its slab size (whole 2 MiB pages). The messages name
/// the device-string option that sets each value (`buf=`, `bufs=`).
pub fn check_geometry(buf_bytes: usize, buf_count: u32) -> Result<usize, String> {
    if buf_bytes == 0 || buf_bytes % BUF_ALIGN_BYTES != 0 || buf_bytes > BUF_BYTES_MAX {
        return Err(format!(
            "buf={buf_bytes} must be a multiple of 4KiB from 4KiB to {}",
            crate::limits::format_size(BUF_BYTES_MAX as u64)
        ));
    }
    if buf_count == 0 || buf_count > MAX_BUFFERS {
        return Err(format!("bufs={buf_count} must be 1..{MAX_BUFFERS}"));
    }
    let pool_bytes = buf_bytes
        .checked_mul(buf_count as usize)
        .filter(|&bytes| bytes <= POOL_BYTES_MAX)
        .ok_or_else(|| {
            format!(
                "buf={buf_bytes} x bufs={buf_count} is more than the {} a queue's DMA pool may \
                 take: use fewer or smaller buffers",
                crate::limits::format_size(POOL_BYTES_MAX as u64)
            )
        })?;
    // Cannot overflow: pool_bytes is at most 1 GiB.
    Ok(pool_bytes.next_multiple_of(HUGEPAGE_BYTES))
}

/// The free buffer indexes of a pool, the last freed on top: a bounded lock-free stack
/// (Treiber's, its head tagged against ABA), so that allocation reuses the buffer freed
/// last. With a first-in, first-out list every transfer went through the whole slab in
/// turn, 32 MiB by default, a working set no cache holds: fio's 1 MiB QD8 reads through
/// libcorefs ran at 1,238-1,318 MiB/s with 256 buffers and 1,517-1,636 with 64 (3 runs
/// each, 2026-12-07), writes 1,120-1,246 against 1,229-1,358.
struct FreeStack {
    /// `tag << 32 | top + 1`, where `top` is the index on top and 0 means empty; the tag
    /// changes with every push and pop, so a pop that read the head before another thread
    /// popped and pushed again fails its exchange instead of linking a stale `next`.
    head: AtomicU64,
    /// Per index: the index below it on the stack, plus one (0: the bottom).
    next: Box<[AtomicU32]>,
    /// Per index: on the stack now (a buffer returned twice is caught here).
    free: Box<[AtomicBool]>,
    len: AtomicUsize,
}

impl FreeStack {
    /// A stack of every index of `count`, index 0 on top.
    fn new(count: u32) -> FreeStack {
        let stack = FreeStack {
            head: AtomicU64::new(0),
            next: (0..count).map(|_| AtomicU32::new(0)).collect(),
            free: (0..count).map(|_| AtomicBool::new(false)).collect(),
            len: AtomicUsize::new(0),
        };
        for index in (0..count).rev() {
            stack.push(index);
        }
        stack
    }

    fn push(&self, index: u32) {
        let was_free = self.free[index as usize].swap(true, Ordering::AcqRel);
        assert!(!was_free, "DMA buffer {index} returned twice");
        // Counted before it can be popped, so the count never goes below zero.
        self.len.fetch_add(1, Ordering::Relaxed);
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            self.next[index as usize].store(head as u32, Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | (index as u64 + 1);
            // Release: a pop that sees this head sees `next` above.
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    fn pop(&self) -> Option<u32> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = head as u32;
            if top == 0 {
                return None;
            }
            let index = top - 1;
            // Stale if another thread took `index` meanwhile: then the head's tag moved and
            // the exchange below fails.
            let below = self.next[index as usize].load(Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | below as u64;
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.free[index as usize].store(false, Ordering::Release);
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    return Some(index);
                }
                Err(now) => head = now,
            }
        }
    }

    /// Free buffers (exact when no other thread pushes or pops meanwhile; never fewer).
    fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);
static WARNED_NO_HUGEPAGES: AtomicBool = AtomicBool::new(false);

struct PoolInner {
    id: u64,
    base: *mut u8,
    buf_bytes: usize,
    buf_count: u32,
    backing: PoolBacking,
    free: FreeStack,
    /// Keeps the mapping alive; `base` points into it.
    _map: MmapMut,
}

// SAFETY: the raw `base` pointer refers to the mapping owned by `_map`, which lives as long as
// the `PoolInner`. Distinct buffers address disjoint ranges and each range is reachable only
// through the single `DmaBuf` owning its index, so sharing the pool between threads cannot
// create aliasing mutable access.
unsafe impl Send for PoolInner {}
// SAFETY: see `Send`; the only shared mutable state is the lock-free `free` queue.
unsafe impl Sync for PoolInner {}

/// A bounded pool of equal DMA buffers; cheap to clone (shared handle).
#[derive(Clone)]
pub struct DmaPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for DmaPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaPool")
            .field("id", &self.inner.id)
            .field("buf_bytes", &self.inner.buf_bytes)
            .field("buf_count", &self.inner.buf_count)
            .field("backing", &self.inner.backing)
            .field("free", &self.inner.free.len())
            .finish()
    }
}

impl DmaPool {
    /// Maps `buf_count` buffers of `buf_bytes` each; the slab is rounded up to whole 2 MiB
    /// pages. The geometry is checked first ([`check_geometry`]): it comes from device strings
    /// and C callers, so a bad one is an error, never a panic or a wrapped multiplication.
    pub fn new(
        buf_bytes: usize,
        buf_count: u32,
        policy: HugepagePolicy,
    ) -> Result<DmaPool, crate::DevError> {
        let slab_bytes =
            check_geometry(buf_bytes, buf_count).map_err(|why| crate::DevError::BadSpec {
                spec: format!("buf={buf_bytes},bufs={buf_count}"),
                why,
            })?;

        let (map, backing) = match policy {
            HugepagePolicy::Prefer => match MmapOptions::new()
                .len(slab_bytes)
                .huge(Some(21))
                .populate()
                .map_anon()
            {
                Ok(map) => (map, PoolBacking::Hugepages),
                Err(_) => {
                    if !WARNED_NO_HUGEPAGES.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "no 2 MiB hugepages reserved for a {} MiB DMA pool; using ordinary \
                             memory (slower DMA mapping). Reserve them as root with: \
                             echo {} > /proc/sys/vm/nr_hugepages",
                            slab_bytes >> 20,
                            slab_bytes / HUGEPAGE_BYTES
                        );
                    }
                    (Self::map_anonymous(slab_bytes)?, PoolBacking::Anonymous)
                }
            },
            HugepagePolicy::Never => (Self::map_anonymous(slab_bytes)?, PoolBacking::Anonymous),
        };

        let free = FreeStack::new(buf_count);
        let mut map = map;
        let base = map.as_mut_ptr();
        assert_eq!(
            base as usize % BUF_ALIGN_BYTES,
            0,
            "mmap returns page-aligned memory"
        );
        Ok(DmaPool {
            inner: Arc::new(PoolInner {
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                base,
                buf_bytes,
                buf_count,
                backing,
                free,
                _map: map,
            }),
        })
    }

    fn map_anonymous(slab_bytes: usize) -> Result<MmapMut, crate::DevError> {
        let map = MmapOptions::new()
            .len(slab_bytes)
            .map_anon()
            .map_err(|e| crate::DevError::setup("mapping the DMA buffer pool", &e, ""))?;
        // A failed hint costs speed only, so it is not an error.
        let _ = map.advise(memmap2::Advice::HugePage);
        // Not faulted in here: a ring registers (and so pins, and the kernel zeroes) its pool
        // a chunk at a time as buffers are first used ([`crate::backend`]'s rings), so a queue
        // that never has more than a few buffers in use never pays for the rest. Faulting in
        // all 32 MiB at open was a tenth of a second of CPU per queue on this VM (fresh guest
        // memory), three times for a fio run (its layout mounts and its job's), and as much
        // resident memory whether used or not. Where nothing registers the pool, a buffer's
        // first use takes the page fault instead.
        Ok(map)
    }

    /// Takes a buffer of `len_bytes` (at most the buffer size), or `None` when every buffer is
    /// in use. The content is whatever the previous user left.
    pub fn alloc(&self, len_bytes: usize) -> Option<DmaBuf> {
        assert!(
            len_bytes <= self.inner.buf_bytes,
            "asked for {len_bytes} bytes from a pool of {}-byte buffers",
            self.inner.buf_bytes
        );
        let index = self.inner.free.pop()?;
        Some(DmaBuf {
            pool: Arc::clone(&self.inner),
            index,
            len_bytes,
        })
    }

    pub fn buf_bytes(&self) -> usize {
        self.inner.buf_bytes
    }
    pub fn buf_count(&self) -> u32 {
        self.inner.buf_count
    }

    /// Buffers in one 2 MiB stretch of the slab (at least one): what a ring registers at
    /// once when a buffer past those registered is first used.
    pub fn bufs_per_chunk(&self) -> u32 {
        (HUGEPAGE_BYTES / self.inner.buf_bytes).max(1) as u32
    }
    pub fn free_count(&self) -> usize {
        self.inner.free.len()
    }
    pub fn backing(&self) -> PoolBacking {
        self.inner.backing
    }

    /// One iovec per buffer, in index order, for `io_uring_register_buffers`: buffer `i` of
    /// the pool is registered buffer `i` of the ring ([`DmaBuf::index`]).
    ///
    /// Why not the whole slab as one registered buffer: Linux 6.1 builds the bvec iterator of a
    /// fixed NVMe passthrough command over every page left in the registered buffer, and
    /// `blk_rq_map_user_bvec` rejects it (EINVAL) once that exceeds the queue's segment limit.
    /// Per-buffer registration keeps each iterator to one buffer's pages.
    pub fn iovecs(&self) -> Vec<libc::iovec> {
        self.iovecs_of(0..self.inner.buf_count)
    }

    /// The buffers of `indexes` as iovecs (for a ring's registration of them).
    pub fn iovecs_of(&self, indexes: std::ops::Range<u32>) -> Vec<libc::iovec> {
        assert!(indexes.end <= self.inner.buf_count, "buffers past the pool");
        (indexes.start as usize..indexes.end as usize)
            .map(|index| libc::iovec {
                // SAFETY: index < buf_count, so the offset stays inside the slab.
                iov_base: unsafe { self.inner.base.add(index * self.inner.buf_bytes) }.cast(),
                iov_len: self.inner.buf_bytes,
            })
            .collect()
    }
}

/// One buffer of a [`DmaPool`]; returns itself to the pool on drop.
pub struct DmaBuf {
    pool: Arc<PoolInner>,
    index: u32,
    len_bytes: usize,
}

impl DmaBuf {
    pub fn len(&self) -> usize {
        self.len_bytes
    }
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }
    pub fn capacity(&self) -> usize {
        self.pool.buf_bytes
    }

    /// Changes the transfer length; at most the buffer's capacity.
    pub fn set_len(&mut self, len_bytes: usize) {
        assert!(
            len_bytes <= self.pool.buf_bytes,
            "DmaBuf::set_len past capacity"
        );
        self.len_bytes = len_bytes;
    }

    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: index < buf_count, so the offset stays inside the slab.
        unsafe {
            self.pool
                .base
                .add(self.index as usize * self.pool.buf_bytes)
        }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_ptr().cast_mut()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range is inside the slab, owned by this buffer alone (module invariant).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len_bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len_bytes) }
    }

    /// The buffer's index in its pool, which is also its registered-buffer index.
    pub fn index(&self) -> u16 {
        self.index as u16
    }

    /// True when this buffer was carved from `pool`'s slab.
    pub fn belongs_to(&self, pool: &DmaPool) -> bool {
        self.pool.id == pool.inner.id
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // The stack asserts that the index was not free already (single ownership).
        self.pool.free.push(self.index);
    }
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DmaBuf(pool {} #{} {}B)",
            self.pool.id, self.index, self.len_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhausted_pool_gives_backpressure_and_recovers() {
        let pool = DmaPool::new(8192, 3, HugepagePolicy::Never).unwrap();
        let a = pool.alloc(4096).unwrap();
        let b = pool.alloc(8192).unwrap();
        let c = pool.alloc(512).unwrap();
        assert!(
            pool.alloc(4096).is_none(),
            "a fourth buffer from a pool of three"
        );
        assert_eq!(pool.free_count(), 0);
        drop(b);
        let d = pool.alloc(4096).expect("a dropped buffer is reusable");
        assert!(a.belongs_to(&pool) && c.belongs_to(&pool) && d.belongs_to(&pool));
        let other = DmaPool::new(4096, 1, HugepagePolicy::Never).unwrap();
        assert!(!a.belongs_to(&other));
    }

    /// The buffer freed last is the next one handed out, and threads taking and returning
    /// buffers at once never get one that is taken (each writes its mark and finds it
    /// unchanged) nor lose one (the pool is whole again at the end).
    #[test]
    fn the_last_buffer_freed_is_reused_first_and_none_is_shared() {
        let pool = DmaPool::new(4096, 64, HugepagePolicy::Never).unwrap();
        let a = pool.alloc(4096).unwrap();
        let b = pool.alloc(4096).unwrap();
        let (a_index, b_index) = (a.index(), b.index());
        drop(a);
        drop(b);
        assert_eq!(pool.alloc(4096).unwrap().index(), b_index);
        let again = pool.alloc(4096).unwrap();
        assert_eq!(again.index(), b_index, "the one dropped just before");
        drop(again);
        assert_ne!(a_index, b_index);

        std::thread::scope(|s| {
            for t in 0..4u8 {
                let pool = pool.clone();
                s.spawn(move || {
                    let mut held: Vec<DmaBuf> = Vec::new();
                    for round in 0..20_000u32 {
                        if held.len() < 8 && round % 3 != 2 {
                            if let Some(mut buf) = pool.alloc(4096) {
                                buf.as_mut_slice()[..4].copy_from_slice(&round.to_le_bytes());
                                buf.as_mut_slice()[4] = t;
                                held.push(buf);
                            }
                        } else if let Some(buf) = held.pop() {
                            assert_eq!(buf.as_slice()[4], t, "a buffer two threads held");
                        }
                    }
                });
            }
        });
        assert_eq!(pool.free_count(), 64, "every buffer came back");
        let all: Vec<DmaBuf> = (0..64).map(|_| pool.alloc(4096).unwrap()).collect();
        let mut indexes: Vec<u16> = all.iter().map(|b| b.index()).collect();
        indexes.sort_unstable();
        indexes.dedup();
        assert_eq!(indexes.len(), 64, "no index handed out twice");
        assert!(pool.alloc(4096).is_none());
    }

    #[test]
    fn buffers_are_aligned_and_disjoint() {
        let pool = DmaPool::new(4096, 16, HugepagePolicy::Prefer).unwrap();
        let mut bufs: Vec<DmaBuf> = (0..16).map(|_| pool.alloc(4096).unwrap()).collect();
        for (i, buf) in bufs.iter_mut().enumerate() {
            assert_eq!(buf.as_ptr() as usize % BUF_ALIGN_BYTES, 0);
            buf.as_mut_slice().fill(i as u8);
        }
        for (i, buf) in bufs.iter().enumerate() {
            assert!(buf.as_slice().iter().all(|&b| b == i as u8));
        }
    }
}
