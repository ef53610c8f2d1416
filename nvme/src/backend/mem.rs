//! The memory backend: a RAM device for tests, simulation and measuring pure software cost.
//!
//! Operations complete at submission (the copy happens in `submit`); completions wait in a
//! bounded queue for `poll`, so callers see the same submit/poll protocol as on real hardware.
//! Storage is an anonymous mapping, so `mem:64GiB` costs nothing until blocks are written;
//! [`MemDevice::prefault`] (device-string option `prefault`) backs it all at open instead, so
//! that a benchmark's writes pay for copies and not for the kernel's first-touch page faults
//! (which a real device never causes: measured at over half of the reactor's longest loop
//! turns in a create run on an unfaulted device).
//!
//! Fault model: none of its own; wrap it in `wrap::FaultDevice` for faults and
//! `wrap::RecordingDevice` for crash states (both with the `sim` feature). Every write is durable at completion
//! (there is no volatile cache to lose), which is why crash testing uses the recorded write log.

use super::{admit, Gate};
use crate::dma::HugepagePolicy;
#[cfg(feature = "sim")]
use crate::SimAccess;
use crate::{
    BlockDevice, CompletionMode, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, Rejected,
    Request,
};
use memmap2::MmapMut;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct MemDevice {
    info: DeviceInfo,
    pool: DmaPool,
    /// Shared by every queue of the device ([`MemDevice::new_queue`]); the lock is held for
    /// one copy, never across calls.
    store: Arc<Mutex<MmapMut>>,
    done: VecDeque<IoCompletion>,
}

/// Geometry and queue settings of a memory device.
#[derive(Debug, Clone, Copy)]
pub struct MemConfig {
    pub capacity_bytes: u64,
    pub lba_size_bytes: u32,
    pub queue_depth: u32,
    pub buf_bytes: usize,
    pub buf_count: u32,
}

impl Default for MemConfig {
    fn default() -> Self {
        MemConfig {
            capacity_bytes: 64 << 20,
            lba_size_bytes: 4096,
            queue_depth: 256,
            buf_bytes: 128 << 10,
            buf_count: 512,
        }
    }
}

impl MemDevice {
    pub fn new(config: MemConfig) -> Result<MemDevice, DevError> {
        // The config may come from a device string or a C caller: every size is checked, and
        // a bad one is an error, never a panic.
        let spec = format!("mem:{}", config.capacity_bytes);
        let bad = |why: String| DevError::BadSpec {
            spec: spec.clone(),
            why,
        };
        let lba = crate::limits::check_lba_size(config.lba_size_bytes as u64).map_err(bad)?;
        crate::limits::check_queue_depth(config.queue_depth as u64).map_err(bad)?;
        crate::dma::check_geometry(config.buf_bytes, config.buf_count).map_err(bad)?;
        if config.capacity_bytes > crate::limits::SIZE_BYTES_MAX {
            return Err(bad(format!(
                "size={} is more than {}",
                config.capacity_bytes,
                crate::limits::format_size(crate::limits::SIZE_BYTES_MAX)
            )));
        }
        let capacity_lbas = config.capacity_bytes / lba as u64;
        if capacity_lbas == 0 {
            return Err(bad(format!("smaller than one {lba}-byte LBA")));
        }
        let store_bytes = usize::try_from(capacity_lbas * lba as u64)
            .map_err(|_| bad("larger than this machine's address space".into()))?;
        let store = MmapMut::map_anon(store_bytes)
            .map_err(|e| DevError::setup("mapping the memory device", &e, "use a smaller size"))?;
        let pool = DmaPool::new(config.buf_bytes, config.buf_count, HugepagePolicy::Prefer)?;
        Ok(MemDevice {
            info: DeviceInfo {
                name: format!(
                    "mem:{}",
                    crate::limits::format_size(capacity_lbas * lba as u64)
                ),
                lba_size_bytes: lba,
                capacity_lbas,
                queue_depth: config.queue_depth,
                max_io_bytes: u32::try_from(config.buf_bytes)
                    .expect("buf_bytes is at most BUF_BYTES_MAX, checked above"),
                fua_native: true,
                completion_mode: CompletionMode::Immediate,
                shared_write_ranges_max: u32::MAX,
                // As a file's (so the engine's long runs are tested on memory too).
                shared_write_bytes_max: crate::backend::uring_file::SHARED_WRITE_BYTES_MAX
                    .max(config.buf_bytes as u32),
            },
            pool,
            store: Arc::new(Mutex::new(store)),
            done: VecDeque::with_capacity(config.queue_depth as usize),
        })
    }

    /// A device holding a copy of `image` (a crash state, a saved test image).
    /// This device, reporting its FUA as emulated (as a file image's is: a write and a
    /// flush), so the engine sends records with in-place data plain and flushes after them.
    pub fn emulating_fua(mut self) -> MemDevice {
        self.info.fua_native = false;
        self
    }

    pub fn from_image(image: &[u8], mut config: MemConfig) -> Result<MemDevice, DevError> {
        config.capacity_bytes = image.len() as u64;
        let dev = MemDevice::new(config)?;
        dev.store
            .lock()
            .expect("memory device lock")
            .copy_from_slice(image);
        Ok(dev)
    }

    /// The whole device content, as of the last completed write (a copy).
    pub fn image(&self) -> Vec<u8> {
        self.store.lock().expect("memory device lock").to_vec()
    }

    /// Another queue on the same storage, with its own completions and DMA pool: what each
    /// reactor of a partitioned filesystem opens (as it opens its own ring on a real device).
    pub fn new_queue(&self) -> Result<MemDevice, DevError> {
        let pool = DmaPool::new(
            self.pool.buf_bytes(),
            self.pool.buf_count(),
            HugepagePolicy::Prefer,
        )?;
        Ok(MemDevice {
            info: self.info.clone(),
            pool,
            store: self.store.clone(),
            done: VecDeque::with_capacity(self.info.queue_depth as usize),
        })
    }

    /// Backs the whole device with memory now, in transparent hugepages where the kernel gives
    /// them. Fails (and changes nothing a caller can see) when the machine has not the memory:
    /// a device string asking for more than that is the caller's mistake, told at open rather
    /// than by the kernel's out-of-memory killer in the middle of a run.
    pub fn prefault(&self) -> Result<(), DevError> {
        let mut store = self.store();
        // A hint: 2 MiB pages mean 512 times fewer faults to take now and fewer TLB misses
        // later; without them the populate below still faults every 4 KiB page in.
        let _ = store.advise(memmap2::Advice::HugePage);
        match store.advise(memmap2::Advice::PopulateWrite) {
            Ok(()) => Ok(()),
            // Kernels before 5.14 have no MADV_POPULATE_WRITE: touch every page instead.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                for page in store.chunks_mut(4096) {
                    // SAFETY: `page` is a live, writable byte of the mapping; the store of
                    // the zero it already holds (fresh anonymous memory) changes nothing but
                    // makes the kernel back the page. Volatile, so it is not optimized away.
                    unsafe { std::ptr::write_volatile(page.as_mut_ptr(), page[0]) };
                }
                Ok(())
            }
            Err(e) => Err(DevError::setup(
                format!("faulting in the memory of {}", self.info.name),
                &e,
                "use a smaller size or drop `prefault`",
            )),
        }
    }

    /// How many of the device's 4 KiB pages the kernel holds in memory (tests of
    /// [`MemDevice::prefault`]).
    pub fn resident_pages(&self) -> Result<u64, DevError> {
        let store = self.store();
        let pages = store.len().div_ceil(4096);
        let mut present = vec![0u8; pages];
        // SAFETY: the range is the live mapping (page-aligned start, as mmap returns it), and
        // `present` has one byte per page of it, as mincore(2) writes.
        let rc = unsafe {
            libc::mincore(
                store.as_ptr() as *mut libc::c_void,
                store.len(),
                present.as_mut_ptr(),
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(DevError::setup("mincore on the memory device", &e, ""));
        }
        Ok(present.iter().filter(|&&b| b & 1 != 0).count() as u64)
    }

    fn store(&self) -> std::sync::MutexGuard<'_, MmapMut> {
        self.store.lock().expect("memory device lock")
    }

    fn byte_range(&self, lba: u64, len_bytes: usize) -> std::ops::Range<usize> {
        let start = (lba * self.info.lba_size_bytes as u64) as usize;
        start..start + len_bytes
    }
}

impl BlockDevice for MemDevice {
    fn new_queue(&self) -> Option<Result<Box<dyn BlockDevice>, DevError>> {
        Some(MemDevice::new_queue(self).map(|q| Box::new(q) as Box<dyn BlockDevice>))
    }

    fn any_thread_io(&self) -> Option<Box<dyn crate::AnyThreadIo>> {
        Some(Box::new(MemSideIo {
            store: self.store.clone(),
            info: self.info.clone(),
        }))
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn pool(&self) -> &DmaPool {
        &self.pool
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        let gate = Gate {
            full: self.done.len() >= self.info.queue_depth as usize,
            ..Gate::default()
        };
        if let Err(reason) = admit(&gate, &self.info, &self.pool, &request.op) {
            return Err(Rejected { request, reason });
        }
        let kind = request.op.kind();
        let lba_size = self.info.lba_size_bytes as usize;
        let buf = match request.op {
            IoOp::Read { lba, mut buf } => {
                let range = self.byte_range(lba, buf.len());
                buf.as_mut_slice().copy_from_slice(&self.store()[range]);
                Some(buf)
            }
            IoOp::Write { lba, buf, .. } => {
                let range = self.byte_range(lba, buf.len());
                self.store()[range].copy_from_slice(buf.as_slice());
                Some(buf)
            }
            IoOp::WriteShared { lba, data, .. } => {
                let range = self.byte_range(lba, data.len());
                data.copy_to(&mut self.store()[range]);
                None
            }
            IoOp::WriteZeroes { lba, lbas } | IoOp::Deallocate { lba, lbas } => {
                let range = self.byte_range(lba, lbas as usize * lba_size);
                self.store()[range].fill(0);
                None
            }
            IoOp::Flush => None,
        };
        self.done.push_back(IoCompletion {
            token: request.token,
            kind,
            result: Ok(()),
            buf,
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        let count = self.done.len();
        out.extend(self.done.drain(..));
        Ok(count)
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, _timeout: Duration) -> Result<usize, DevError> {
        // Everything submitted is already complete, so there is never anything to wait for.
        self.poll(out)
    }

    fn in_flight(&self) -> u32 {
        self.done.len() as u32
    }

    #[cfg(feature = "sim")]
    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        Some(self)
    }
}

#[cfg(feature = "sim")]
impl SimAccess for MemDevice {
    fn sim_read(&self, lba: u64, out: &mut [u8]) {
        let range = self.byte_range(lba, out.len());
        out.copy_from_slice(&self.store()[range]);
    }

    fn sim_write(&mut self, lba: u64, data: &[u8]) {
        let range = self.byte_range(lba, data.len());
        self.store()[range].copy_from_slice(data);
    }
}

/// [`BlockDevice::any_thread_io`] of a memory device: a copy under the store's lock. Every
/// write is durable when it completes (the memory device has no cache to flush; the
/// volatile-cache wrapper, which models one, has no handle beside its queue).
struct MemSideIo {
    store: Arc<Mutex<MmapMut>>,
    info: DeviceInfo,
}

impl crate::AnyThreadIo for MemSideIo {
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<(), DevError> {
        crate::check_any_thread_io(&self.info, lba, out.len())?;
        let start = (lba * self.info.lba_size_bytes as u64) as usize;
        let store = self.store.lock().expect("memory device lock");
        out.copy_from_slice(&store[start..start + out.len()]);
        Ok(())
    }

    fn writes(&self) -> bool {
        true
    }

    fn write_at(&mut self, lba: u64, data: &[u8], _fua: bool) -> Result<(), DevError> {
        crate::check_any_thread_io(&self.info, lba, data.len())?;
        let start = (lba * self.info.lba_size_bytes as u64) as usize;
        let mut store = self.store.lock().expect("memory device lock");
        store[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), DevError> {
        Ok(())
    }
}
