//! A simulated volatile write cache in front of any device: writes stay in memory until a
//! flush (or a FUA write) sends them to the inner device. Killing the process is then a power
//! cut: whatever was not flushed is gone, exactly what a drive's cache loses. Selected with the
//! `cache=volatile` device-string option, so crash tests can run unmodified programs (SQLite on
//! the VFS, say) against a file image and `kill -9` them.
//!
//! # Invariants
//! - A read returns the newest data: the inner device's, overlaid with cached LBAs.
//! - A flush writes every cached LBA to the inner device, then flushes it; a FUA write goes
//!   through at once (and drops any cached copy of its LBAs). Write-zeroes and deallocate drop
//!   the cached LBAs they cover and go through.
//! - The cache is bounded ([`CACHE_LIMIT_BYTES`]): past it, cached writes are written back
//!   without a flush, as a drive evicts (unflushed data may reach media early; never late).
//!
//! Every operation completes inside `submit` (synchronously against the inner device); the
//! completion is returned by the next poll.

use crate::{
    flush_sync, read_sync, validate, write_sync, BlockDevice, Completion, DevError, DeviceInfo,
    DmaPool, Op, OpKind, Rejected, Request,
};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// Cached bytes past which writes are written back early.
pub const CACHE_LIMIT_BYTES: usize = 256 << 20;

pub struct VolatileCacheDevice {
    inner: Box<dyn BlockDevice>,
    info: DeviceInfo,
    cache: BTreeMap<u64, Box<[u8]>>,
    done: VecDeque<Completion>,
}

impl VolatileCacheDevice {
    pub fn new(inner: Box<dyn BlockDevice>) -> VolatileCacheDevice {
        let mut info = inner.info().clone();
        info.name = format!("{} (volatile cache)", info.name);
        info.completion_mode = crate::CompletionMode::Immediate;
        VolatileCacheDevice {
            inner,
            info,
            cache: BTreeMap::new(),
            done: VecDeque::new(),
        }
    }

    fn lba_bytes(&self) -> usize {
        self.info.lba_size_bytes as usize
    }

    /// Writes every cached LBA to the inner device, in runs of consecutive LBAs.
    fn write_back(&mut self) -> Result<(), DevError> {
        let max = self.info.max_io_bytes as usize;
        let cache = std::mem::take(&mut self.cache);
        let mut run: Option<(u64, Vec<u8>)> = None;
        for (lba, data) in cache {
            match &mut run {
                Some((start, bytes))
                    if *start + (bytes.len() / self.lba_bytes()) as u64 == lba
                        && bytes.len() + data.len() <= max =>
                {
                    bytes.extend_from_slice(&data)
                }
                _ => {
                    if let Some((start, bytes)) = run.take() {
                        write_sync(&mut *self.inner, start, &bytes, false)?;
                    }
                    run = Some((lba, data.to_vec()));
                }
            }
        }
        if let Some((start, bytes)) = run {
            write_sync(&mut *self.inner, start, &bytes, false)?;
        }
        Ok(())
    }

    fn drop_cached(&mut self, lba: u64, lbas: u64) {
        let keys: Vec<u64> = self.cache.range(lba..lba + lbas).map(|(k, _)| *k).collect();
        for k in keys {
            self.cache.remove(&k);
        }
    }

    fn run(&mut self, op: &mut Op) -> Result<(), DevError> {
        let lba_bytes = self.lba_bytes();
        match op {
            Op::Write {
                lba,
                buf,
                fua: false,
            } => {
                for (i, chunk) in buf.as_slice().chunks(lba_bytes).enumerate() {
                    self.cache.insert(*lba + i as u64, chunk.into());
                }
                if self.cache.len() * lba_bytes > CACHE_LIMIT_BYTES {
                    self.write_back()?;
                }
                Ok(())
            }
            Op::Write {
                lba,
                buf,
                fua: true,
            } => {
                self.drop_cached(*lba, (buf.len() / lba_bytes) as u64);
                write_sync(&mut *self.inner, *lba, buf.as_slice(), true)
            }
            Op::Read { lba, buf } => {
                let out = buf.as_mut_slice();
                read_sync(&mut *self.inner, *lba, out)?;
                let lbas = (out.len() / lba_bytes) as u64;
                for (k, data) in self.cache.range(*lba..*lba + lbas) {
                    let at = (*k - *lba) as usize * lba_bytes;
                    out[at..at + lba_bytes].copy_from_slice(data);
                }
                Ok(())
            }
            Op::Flush => {
                self.write_back()?;
                flush_sync(&mut *self.inner)
            }
            Op::WriteZeroes { lba, lbas } | Op::Deallocate { lba, lbas } => {
                let (lba, lbas) = (*lba, *lbas as u64);
                self.drop_cached(lba, lbas);
                let forwarded = match op {
                    Op::WriteZeroes { .. } => Op::WriteZeroes {
                        lba,
                        lbas: lbas as u32,
                    },
                    _ => Op::Deallocate {
                        lba,
                        lbas: lbas as u32,
                    },
                };
                let mut others = Vec::new();
                crate::run_sync(&mut *self.inner, forwarded, &mut others)?.result
            }
        }
    }
}

impl BlockDevice for VolatileCacheDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        if let Err(reason) = validate(&self.info, self.inner.pool(), &request.op) {
            return Err(Rejected { request, reason });
        }
        let Request { token, mut op } = request;
        let kind: OpKind = op.kind();
        let result = self.run(&mut op);
        self.done.push_back(Completion {
            token,
            kind,
            result,
            buf: op.into_buf(),
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, DevError> {
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }

    fn wait(&mut self, out: &mut Vec<Completion>, _timeout: Duration) -> Result<usize, DevError> {
        self.poll(out)
    }

    fn in_flight(&self) -> u32 {
        self.done.len() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mem::{MemConfig, MemDevice};

    fn config() -> MemConfig {
        MemConfig {
            capacity_bytes: 1 << 20,
            lba_size_bytes: 512,
            queue_depth: 8,
            buf_bytes: 64 << 10,
            buf_count: 8,
        }
    }

    #[test]
    fn unflushed_writes_are_readable_but_reach_the_inner_device_only_when_flushed() {
        let mut dev = VolatileCacheDevice::new(Box::new(MemDevice::new(config()).unwrap()));
        write_sync(&mut dev, 8, &[7u8; 1024], false).unwrap();
        write_sync(&mut dev, 100, &[9u8; 512], true).unwrap();
        let mut back = vec![0u8; 2048];
        read_sync(&mut dev, 7, &mut back).unwrap();
        assert_eq!(&back[..512], &[0u8; 512][..]);
        assert_eq!(&back[512..1536], &[7u8; 1024][..]);
        let mut inner = vec![0u8; 1024];
        let sim = dev.inner.sim_access().unwrap();
        sim.sim_read(8, &mut inner);
        assert_eq!(
            inner,
            vec![0u8; 1024],
            "not flushed: not on the inner device"
        );
        let mut fua = vec![0u8; 512];
        sim.sim_read(100, &mut fua);
        assert_eq!(fua, vec![9u8; 512], "FUA goes through");
        flush_sync(&mut dev).unwrap();
        let sim = dev.inner.sim_access().unwrap();
        sim.sim_read(8, &mut inner);
        assert_eq!(inner, vec![7u8; 1024], "flushed");
    }
}
