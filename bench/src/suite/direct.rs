//! Random 4 KiB O_DIRECT reads of a kernel-filesystem file through io_uring at a fixed queue
//! depth (what `fio --ioengine=io_uring --direct=1 --rw=randread --iodepth=QD` does), so kernel
//! targets are read without their page cache, as corefs (which has none) is.
//!
//! Invariants: at most `qd` reads in flight; each buffer belongs to one read from submission
//! to completion (the slot index is the user data); a short or failed read ends the run with
//! an error naming the file, never a latency sample.

use io_uring::{opcode, types, IoUring};
use rand::{Rng, SeedableRng};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

const BLOCK_BYTES: usize = 4096;

/// `qd` 4 KiB-aligned buffers in one allocation.
struct AlignedBufs {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBufs {
    fn new(count: usize) -> AlignedBufs {
        let layout = std::alloc::Layout::from_size_align(count * BLOCK_BYTES, BLOCK_BYTES)
            .expect("valid buffer layout");
        // SAFETY: the layout has a non-zero size (count >= 1).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory for read buffers");
        AlignedBufs { ptr, layout }
    }

    fn slot(&self, i: usize) -> *mut u8 {
        assert!((i + 1) * BLOCK_BYTES <= self.layout.size());
        // SAFETY: in bounds, checked above.
        unsafe { self.ptr.add(i * BLOCK_BYTES) }
    }
}

impl Drop for AlignedBufs {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

pub fn random_reads(
    path: &Path,
    file_bytes: u64,
    qd: usize,
    until: Instant,
    seed: u64,
    record: &mut dyn FnMut(u64),
) -> Result<u64, String> {
    let qd = qd.max(1);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("{} (O_DIRECT): {e}", path.display()))?;
    let mut ring =
        IoUring::new(qd.next_power_of_two() as u32).map_err(|e| format!("io_uring setup: {e}"))?;
    let bufs = AlignedBufs::new(qd);
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let blocks = file_bytes / BLOCK_BYTES as u64;
    let mut submitted = vec![Instant::now(); qd];
    let mut free: Vec<usize> = (0..qd).collect();
    let mut in_flight = 0usize;
    let mut done = 0u64;
    loop {
        // At least one read, however late the start (see workloads::keep_going).
        while Instant::now() < until || (done == 0 && in_flight == 0) {
            let Some(slot) = free.pop() else { break };
            let offset = rng.random_range(0..blocks) * BLOCK_BYTES as u64;
            let entry = opcode::Read::new(
                types::Fd(file.as_raw_fd()),
                bufs.slot(slot),
                BLOCK_BYTES as u32,
            )
            .offset(offset)
            .build()
            .user_data(slot as u64);
            submitted[slot] = Instant::now();
            // SAFETY: the buffer slot stays allocated and untouched until this read completes
            // (the slot returns to `free` only at its completion; `bufs` outlives the ring's
            // use, as every in-flight read is reaped before returning).
            unsafe { ring.submission().push(&entry) }
                .map_err(|_| "submission queue full".to_string())?;
            in_flight += 1;
        }
        if in_flight == 0 {
            return Ok(done);
        }
        ring.submit_and_wait(1)
            .map_err(|e| format!("io_uring submit: {e}"))?;
        let now = Instant::now();
        let reaped: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, result) in reaped {
            in_flight -= 1;
            if result != BLOCK_BYTES as i32 {
                // Reap the rest before the buffers go away.
                while in_flight > 0 {
                    let _ = ring.submit_and_wait(1);
                    in_flight -= ring.completion().count();
                }
                return Err(format!(
                    "{}: read returned {result} ({})",
                    path.display(),
                    std::io::Error::from_raw_os_error(-result.min(0))
                ));
            }
            record(now.duration_since(submitted[slot]).as_nanos() as u64);
            free.push(slot);
            done += 1;
        }
    }
}
