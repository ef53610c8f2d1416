//! A simulated volatile write cache in front of any device: writes stay in memory until a
//! flush (or a FUA write) sends them to the inner device. Killing the process is then a power
//! cut: whatever was not flushed is gone, exactly what a drive's cache loses. Selected with the
//! `cache=volatile` device-string option, so crash tests can run unmodified programs (SQLite on
//! the VFS, say) against a file image and `kill -9` them.
//!
//! # Invariants
//! - A read returns the newest data: the inner device's, overlaid with cached LBAs (a FUA
//!   write not yet completed included).
//! - A flush, and a FUA write, make anything durable only when their *completion* is
//!   delivered by `poll`/`wait` — never at submit — and not before `flush_delay` has passed
//!   since they were submitted (`cache=volatile,flushdelay=MICROSECONDS`; 0 by default). So a
//!   process killed between issuing a flush and seeing it complete loses what the flush was
//!   for, as on a real drive: a caller that acknowledges an fsync before its flush completes
//!   is caught by a kill -9 landing in that window (the wider the delay, the likelier).
//! - Completions of flushes and FUA writes are delivered in submission order; a flush writes
//!   every cached LBA to the inner device, then flushes it; a FUA write goes through to the
//!   inner device at its completion (and drops a cached copy holding the same bytes).
//!   Write-zeroes and deallocate drop the cached LBAs they cover and go through at once.
//! - The cache is bounded ([`CACHE_LIMIT_BYTES`]): past it, cached writes are written back
//!   without a flush, as a drive evicts (unflushed data may reach media early; never late).
//!
//! Plain writes, reads, write-zeroes and deallocates complete inside `submit` (synchronously
//! against the inner device); their completion is returned by the next poll.

use crate::{
    flush_sync, read_sync, validate, write_sync, BlockDevice, DevError, DeviceInfo, DmaPool,
    IoCompletion, IoOp, OpKind, Rejected, Request,
};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Cached bytes past which writes are written back early.
pub const CACHE_LIMIT_BYTES: usize = 256 << 20;

/// A flush or FUA write waiting for its completion (when it takes effect).
struct Deferred {
    due: Instant,
    token: u64,
    kind: OpKind,
    /// For a FUA write: where, and what (the caller's buffer goes back with the completion).
    fua: Option<(u64, Vec<u8>)>,
    buf: Option<crate::DmaBuf>,
}

pub struct VolatileCacheDevice {
    inner: Box<dyn BlockDevice>,
    info: DeviceInfo,
    cache: BTreeMap<u64, Box<[u8]>>,
    done: VecDeque<IoCompletion>,
    deferred: VecDeque<Deferred>,
    flush_delay: Duration,
}

impl VolatileCacheDevice {
    pub fn new(inner: Box<dyn BlockDevice>) -> VolatileCacheDevice {
        VolatileCacheDevice::with_flush_delay(inner, Duration::ZERO)
    }

    /// A cache whose flushes and FUA writes take effect (and complete) no earlier than
    /// `flush_delay` after they were submitted.
    pub fn with_flush_delay(
        inner: Box<dyn BlockDevice>,
        flush_delay: Duration,
    ) -> VolatileCacheDevice {
        let mut info = inner.info().clone();
        info.name = format!("{} (volatile cache)", info.name);
        info.completion_mode = crate::CompletionMode::Immediate;
        VolatileCacheDevice {
            inner,
            info,
            cache: BTreeMap::new(),
            done: VecDeque::new(),
            deferred: VecDeque::new(),
            flush_delay,
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

    fn cache_write(&mut self, lba: u64, data: &[u8]) -> Result<(), DevError> {
        let lba_bytes = self.lba_bytes();
        for (i, chunk) in data.chunks(lba_bytes).enumerate() {
            self.cache.insert(lba + i as u64, chunk.into());
        }
        if self.cache.len() * lba_bytes > CACHE_LIMIT_BYTES {
            self.write_back()?;
        }
        Ok(())
    }

    /// Runs an op that completes at once (everything but flushes and FUA writes).
    fn run(&mut self, op: &mut IoOp) -> Result<(), DevError> {
        let lba_bytes = self.lba_bytes();
        match op {
            IoOp::Write { .. } | IoOp::WriteShared { .. } => {
                let (lba, data, _) = op.as_write().expect("a write");
                self.cache_write(lba, &data)
            }
            IoOp::Read { lba, buf } => {
                let out = buf.as_mut_slice();
                read_sync(&mut *self.inner, *lba, out)?;
                let lbas = (out.len() / lba_bytes) as u64;
                for (k, data) in self.cache.range(*lba..*lba + lbas) {
                    let at = (*k - *lba) as usize * lba_bytes;
                    out[at..at + lba_bytes].copy_from_slice(data);
                }
                Ok(())
            }
            IoOp::Flush => unreachable!("flushes are deferred"),
            IoOp::WriteZeroes { lba, lbas } | IoOp::Deallocate { lba, lbas } => {
                let (lba, lbas) = (*lba, *lbas as u64);
                self.drop_cached(lba, lbas);
                let forwarded = match op {
                    IoOp::WriteZeroes { .. } => IoOp::WriteZeroes {
                        lba,
                        lbas: lbas as u32,
                    },
                    _ => IoOp::Deallocate {
                        lba,
                        lbas: lbas as u32,
                    },
                };
                let mut others = Vec::new();
                crate::run_sync(&mut *self.inner, forwarded, &mut others)?.result
            }
        }
    }

    /// Gives effect to the flushes and FUA writes that are due, in submission order, and
    /// queues their completions.
    fn complete_due(&mut self, now: Instant) {
        while self.deferred.front().is_some_and(|d| d.due <= now) {
            let d = self.deferred.pop_front().expect("front");
            let result = match &d.fua {
                None => self
                    .write_back()
                    .and_then(|()| flush_sync(&mut *self.inner)),
                Some((lba, data)) => {
                    let lba_bytes = self.lba_bytes();
                    // A cached copy with these bytes is now on the media; a newer one stays.
                    for (i, chunk) in data.chunks(lba_bytes).enumerate() {
                        let key = lba + i as u64;
                        if self.cache.get(&key).is_some_and(|c| **c == *chunk) {
                            self.cache.remove(&key);
                        }
                    }
                    write_sync(&mut *self.inner, *lba, data, true)
                }
            };
            self.done.push_back(IoCompletion {
                token: d.token,
                kind: d.kind,
                result,
                buf: d.buf,
            });
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
        let due = Instant::now() + self.flush_delay;
        match &op {
            IoOp::Flush => {
                self.deferred.push_back(Deferred {
                    due,
                    token,
                    kind,
                    fua: None,
                    buf: op.into_buf(),
                });
                return Ok(());
            }
            IoOp::Write { fua: true, .. } | IoOp::WriteShared { fua: true, .. } => {
                // Readable at once (from the cache), durable only at its completion.
                let (lba, data, _) = op.as_write().expect("a write");
                let data = data.into_owned();
                let cached = self.cache_write(lba, &data);
                if cached.is_ok() {
                    self.deferred.push_back(Deferred {
                        due,
                        token,
                        kind,
                        fua: Some((lba, data)),
                        buf: op.into_buf(),
                    });
                    return Ok(());
                }
                self.done.push_back(IoCompletion {
                    token,
                    kind,
                    result: cached,
                    buf: op.into_buf(),
                });
                return Ok(());
            }
            _ => {}
        }
        let result = self.run(&mut op);
        self.done.push_back(IoCompletion {
            token,
            kind,
            result,
            buf: op.into_buf(),
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        self.complete_due(Instant::now());
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        if self.done.is_empty() {
            if let Some(first) = self.deferred.front() {
                // Sleep until the first deferred op is due (or the timeout).
                let now = Instant::now();
                let until = first.due.min(now + timeout);
                std::thread::sleep(until.saturating_duration_since(now));
            }
        }
        self.poll(out)
    }

    fn in_flight(&self) -> u32 {
        (self.done.len() + self.deferred.len()) as u32
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

    /// A flush or FUA write takes effect only when its completion is delivered, never at
    /// submit: a process killed in between loses the data (what lets a kill -9 test see an
    /// acknowledgement given before the flush completed).
    #[test]
    fn flushes_and_fua_writes_take_effect_only_when_their_completion_is_delivered() {
        let mut dev = VolatileCacheDevice::new(Box::new(MemDevice::new(config()).unwrap()));
        write_sync(&mut dev, 8, &[7u8; 512], false).unwrap();
        let mut buf = dev.pool().alloc(512).unwrap();
        buf.as_mut_slice().fill(9);
        let submitted = std::time::Instant::now();
        dev.submit(Request {
            token: 1,
            op: IoOp::Flush,
        })
        .unwrap();
        dev.submit(Request {
            token: 2,
            op: IoOp::Write {
                lba: 100,
                buf,
                fua: true,
            },
        })
        .unwrap();
        let on_media = |dev: &mut VolatileCacheDevice, lba: u64| {
            let mut b = vec![0u8; 512];
            dev.inner.sim_access().unwrap().sim_read(lba, &mut b);
            b[0]
        };
        // Submitted, not completed: nothing on the media (a kill now loses both).
        assert_eq!((on_media(&mut dev, 8), on_media(&mut dev, 100)), (0, 0));
        assert_eq!(dev.in_flight(), 2);
        let mut out = Vec::new();
        while out.len() < 2 {
            dev.wait(&mut out, Duration::from_secs(1)).unwrap();
        }
        assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!((on_media(&mut dev, 8), on_media(&mut dev, 100)), (7, 9));
        assert_eq!(dev.in_flight(), 0);
        let _ = submitted;

        // With a delay, a flush completes (and takes effect) no earlier than that after its
        // submission; a FUA write in flight is readable meanwhile.
        let delay = Duration::from_millis(20);
        let mut dev = VolatileCacheDevice::with_flush_delay(
            Box::new(MemDevice::new(config()).unwrap()),
            delay,
        );
        let mut buf = dev.pool().alloc(512).unwrap();
        buf.as_mut_slice().fill(5);
        let submitted = std::time::Instant::now();
        dev.submit(Request {
            token: 3,
            op: IoOp::Write {
                lba: 50,
                buf,
                fua: true,
            },
        })
        .unwrap();
        let mut back = vec![0u8; 512];
        read_sync(&mut dev, 50, &mut back).unwrap();
        assert_eq!(back, vec![5u8; 512], "a FUA write in flight is readable");
        let mut out = Vec::new();
        while out.is_empty() {
            dev.wait(&mut out, Duration::from_secs(1)).unwrap();
        }
        assert!(submitted.elapsed() >= delay, "completed before its delay");
        assert_eq!(on_media(&mut dev, 50), 5);
    }
}
