//! The memory backend: a RAM device for tests, simulation and measuring pure software cost.
//!
//! Operations complete at submission (the copy happens in `submit`); completions wait in a
//! bounded queue for `poll`, so callers see the same submit/poll protocol as on real hardware.
//! Storage is an anonymous mapping, so `mem:64GiB` costs nothing until blocks are written.
//!
//! Fault model: none of its own; wrap it in [`crate::wrap::FaultDevice`] for faults and
//! [`crate::wrap::RecordingDevice`] for crash states. Every write is durable at completion
//! (there is no volatile cache to lose), which is why crash testing uses the recorded write log.

use crate::dma::HugepagePolicy;
use crate::{
    validate, BlockDevice, Completion, CompletionMode, DevError, DeviceInfo, DmaPool, Op, Rejected,
    Request, SimAccess,
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
    done: VecDeque<Completion>,
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
        let lba = config.lba_size_bytes;
        assert!(
            lba.is_power_of_two() && (512..=4096).contains(&lba),
            "LBA size {lba} must be a power of two from 512 to 4096"
        );
        assert!(config.queue_depth > 0, "queue depth must be at least 1");
        let capacity_lbas = config.capacity_bytes / lba as u64;
        if capacity_lbas == 0 {
            return Err(DevError::BadSpec {
                spec: format!("mem:{}", config.capacity_bytes),
                why: format!("smaller than one {lba}-byte LBA"),
            });
        }
        let store = MmapMut::map_anon((capacity_lbas * lba as u64) as usize)
            .map_err(|e| DevError::setup("mapping the memory device", &e, "use a smaller size"))?;
        let pool = DmaPool::new(config.buf_bytes, config.buf_count, HugepagePolicy::Prefer)?;
        Ok(MemDevice {
            info: DeviceInfo {
                name: format!(
                    "mem:{}",
                    crate::spec::format_size(capacity_lbas * lba as u64)
                ),
                lba_size_bytes: lba,
                capacity_lbas,
                queue_depth: config.queue_depth,
                max_io_bytes: config.buf_bytes as u32,
                fua_native: true,
                completion_mode: CompletionMode::Immediate,
            },
            pool,
            store: Arc::new(Mutex::new(store)),
            done: VecDeque::with_capacity(config.queue_depth as usize),
        })
    }

    /// A device holding a copy of `image` (a crash state, a saved test image).
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

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn pool(&self) -> &DmaPool {
        &self.pool
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        if self.done.len() >= self.info.queue_depth as usize {
            return Err(Rejected {
                request,
                reason: DevError::QueueFull,
            });
        }
        if let Err(reason) = validate(&self.info, &self.pool, &request.op) {
            return Err(Rejected { request, reason });
        }
        let kind = request.op.kind();
        let lba_size = self.info.lba_size_bytes as usize;
        let buf = match request.op {
            Op::Read { lba, mut buf } => {
                let range = self.byte_range(lba, buf.len());
                buf.as_mut_slice().copy_from_slice(&self.store()[range]);
                Some(buf)
            }
            Op::Write { lba, buf, .. } => {
                let range = self.byte_range(lba, buf.len());
                self.store()[range].copy_from_slice(buf.as_slice());
                Some(buf)
            }
            Op::WriteZeroes { lba, lbas } | Op::Deallocate { lba, lbas } => {
                let range = self.byte_range(lba, lbas as usize * lba_size);
                self.store()[range].fill(0);
                None
            }
            Op::Flush => None,
        };
        self.done.push_back(Completion {
            token: request.token,
            kind,
            result: Ok(()),
            buf,
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, DevError> {
        let count = self.done.len();
        out.extend(self.done.drain(..));
        Ok(count)
    }

    fn wait(&mut self, out: &mut Vec<Completion>, _timeout: Duration) -> Result<usize, DevError> {
        // Everything submitted is already complete, so there is never anything to wait for.
        self.poll(out)
    }

    fn in_flight(&self) -> u32 {
        self.done.len() as u32
    }

    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        Some(self)
    }
}

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
