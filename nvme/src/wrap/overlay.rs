//! A copy-on-write overlay over any device: writes land in memory, reads see them first, and
//! the device underneath is never written. `corefs fsck -n` mounts the engine on one over a
//! device opened read-only, so the mount replays the fsync logs and commits exactly as it
//! would (the engine does not know), the checker reads the result, and the image stays byte
//! for byte what it was.
//!
//! # Invariants
//! - Only reads reach the inner device. Writes, write-zeroes and deallocates change the
//!   overlay; a flush completes at once (nothing underneath to make durable).
//! - A read returns the inner device's blocks, overlaid first with the zeroed ranges and then
//!   with the written blocks. Zeroing a range drops the written blocks it covers, so a written
//!   block inside a zeroed range was written after the zeroing, and wins.
//! - Memory is not bounded: every block written stays in memory until the overlay is dropped.
//!   A check writes what replaying the logs and one commit write, small next to the image; a
//!   long-running program writing through an overlay would grow without limit.
//!
//! Every operation completes inside `submit` (synchronously against the inner device); the
//! completion is returned by the next poll.

use crate::{
    validate, BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, OpKind, Rejected,
    Request,
};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

pub struct OverlayDevice {
    inner: Box<dyn BlockDevice>,
    info: DeviceInfo,
    /// Written blocks by LBA, one LBA each.
    written: BTreeMap<u64, Box<[u8]>>,
    /// Zeroed ranges (write-zeroes, deallocate): start LBA → end LBA (exclusive); disjoint
    /// and not adjacent (merged on insert).
    zeroed: BTreeMap<u64, u64>,
    done: VecDeque<IoCompletion>,
}

impl OverlayDevice {
    pub fn new(inner: Box<dyn BlockDevice>) -> OverlayDevice {
        let mut info = inner.info().clone();
        info.name = format!("{} (overlay: writes kept in memory)", info.name);
        info.completion_mode = crate::CompletionMode::Immediate;
        OverlayDevice {
            inner,
            info,
            written: BTreeMap::new(),
            zeroed: BTreeMap::new(),
            done: VecDeque::new(),
        }
    }

    /// Bytes of written blocks held in memory.
    pub fn overlay_bytes(&self) -> usize {
        self.written.len() * self.info.lba_size_bytes as usize
    }

    /// The device underneath, unchanged by anything written through the overlay.
    pub fn into_inner(self) -> Box<dyn BlockDevice> {
        self.inner
    }

    fn lba_bytes(&self) -> usize {
        self.info.lba_size_bytes as usize
    }

    /// Records `lba..end` as zeroed: drops the written blocks there and merges the range with
    /// any zeroed range it overlaps or touches.
    fn zero(&mut self, lba: u64, end: u64) {
        let covered: Vec<u64> = self.written.range(lba..end).map(|(k, _)| *k).collect();
        for k in covered {
            self.written.remove(&k);
        }
        let (mut start, mut stop) = (lba, end);
        // Ranges are disjoint and sorted, so their ends ascend too: walking back from the last
        // range starting at or before `end`, stop at the first that ends before `lba`.
        let touching: Vec<(u64, u64)> = self
            .zeroed
            .range(..=end)
            .rev()
            .take_while(|(_, e)| **e >= lba)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in touching {
            self.zeroed.remove(&s);
            start = start.min(s);
            stop = stop.max(e);
        }
        self.zeroed.insert(start, stop);
    }

    /// Reads through to the inner device into the caller's buffer (it comes from the inner
    /// device's pool, which is this device's pool), then lays the overlay over it. The buffer
    /// comes back in every case but one: the inner queue failing while it holds it, after
    /// which that queue (and so this device) takes nothing more.
    fn read(
        &mut self,
        lba: u64,
        buf: crate::DmaBuf,
    ) -> (Result<(), DevError>, Option<crate::DmaBuf>) {
        const TOKEN: u64 = 0;
        if let Err(rejected) = self.inner.submit(Request {
            token: TOKEN,
            op: IoOp::Read { lba, buf },
        }) {
            // The inner queue is idle (every overlay operation completes in submit), so this is
            // its verdict on the request, not backpressure.
            return (Err(rejected.reason), rejected.request.op.into_buf());
        }
        let mut done = Vec::with_capacity(1);
        while done.is_empty() {
            if let Err(e) = self.inner.wait(&mut done, Duration::from_millis(100)) {
                return (Err(e), None);
            }
        }
        assert!(
            done.len() == 1 && done[0].token == TOKEN,
            "the overlay's inner queue had one request in flight"
        );
        let completion = done.pop().expect("one completion");
        let Some(mut buf) = completion.buf else {
            return (completion.result, None);
        };
        if let Err(e) = completion.result {
            return (Err(e), Some(buf));
        }
        let lba_bytes = self.lba_bytes();
        let end = lba + (buf.len() / lba_bytes) as u64;
        let out = buf.as_mut_slice();
        for (s, e) in self
            .zeroed
            .range(..end)
            .rev()
            .take_while(|(_, e)| **e > lba)
        {
            let from = (s.max(&lba) - lba) as usize * lba_bytes;
            let to = (e.min(&end) - lba) as usize * lba_bytes;
            out[from..to].fill(0);
        }
        for (k, data) in self.written.range(lba..end) {
            let at = (k - lba) as usize * lba_bytes;
            out[at..at + lba_bytes].copy_from_slice(data);
        }
        (Ok(()), Some(buf))
    }
}

impl BlockDevice for OverlayDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        // Completions wait for poll: at most a queue depth of them, as on the device.
        if self.done.len() >= self.info.queue_depth as usize {
            return Err(Rejected {
                request,
                reason: DevError::QueueFull,
            });
        }
        if let Err(reason) = validate(&self.info, self.inner.pool(), &request.op) {
            return Err(Rejected { request, reason });
        }
        let Request { token, op } = request;
        let kind: OpKind = op.kind();
        let lba_bytes = self.lba_bytes();
        let (result, buf) = match op {
            IoOp::Read { lba, buf } => self.read(lba, buf),
            op @ (IoOp::Write { .. } | IoOp::WriteShared { .. }) => {
                let (lba, data, _) = op.as_write().expect("a write");
                for (i, block) in data.chunks(lba_bytes).enumerate() {
                    self.written.insert(lba + i as u64, block.into());
                }
                drop(data);
                (Ok(()), op.into_buf())
            }
            IoOp::WriteZeroes { lba, lbas } | IoOp::Deallocate { lba, lbas } => {
                // validate checked lba + lbas against the capacity, so the sum cannot wrap.
                self.zero(lba, lba + lbas as u64);
                (Ok(()), None)
            }
            IoOp::Flush => (Ok(()), None),
        };
        self.done.push_back(IoCompletion {
            token,
            kind,
            result,
            buf,
        });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, _timeout: Duration) -> Result<usize, DevError> {
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
    use crate::{flush_sync, read_sync, run_sync, write_sync};

    fn config() -> MemConfig {
        MemConfig {
            capacity_bytes: 1 << 20,
            lba_size_bytes: 512,
            queue_depth: 8,
            buf_bytes: 64 << 10,
            buf_count: 8,
        }
    }

    fn read(dev: &mut dyn BlockDevice, lba: u64, lbas: usize) -> Vec<u8> {
        let mut out = vec![0u8; lbas * 512];
        read_sync(dev, lba, &mut out).unwrap();
        out
    }

    #[test]
    fn writes_zeroes_and_flushes_stay_in_the_overlay() {
        let mut inner = MemDevice::new(config()).unwrap();
        write_sync(&mut inner, 0, &[1u8; 512 * 16], true).unwrap();
        let before = inner.image();
        let mut dev = OverlayDevice::new(Box::new(inner));

        write_sync(&mut dev, 2, &[7u8; 1024], false).unwrap();
        write_sync(&mut dev, 20, &[9u8; 512], true).unwrap();
        flush_sync(&mut dev).unwrap();
        let back = read(&mut dev, 1, 4);
        assert_eq!(&back[..512], &[1u8; 512][..], "inner block shows through");
        assert_eq!(&back[512..1536], &[7u8; 1024][..], "written blocks win");
        assert_eq!(&back[1536..], &[1u8; 512][..]);

        // Zero 3..10: drops the written block 3, keeps 2; then write 5 inside the range.
        let mut others = Vec::new();
        run_sync(&mut dev, IoOp::WriteZeroes { lba: 3, lbas: 7 }, &mut others)
            .unwrap()
            .result
            .unwrap();
        run_sync(&mut dev, IoOp::Deallocate { lba: 10, lbas: 2 }, &mut others)
            .unwrap()
            .result
            .unwrap();
        assert_eq!(
            dev.zeroed.len(),
            1,
            "touching ranges merge: {:?}",
            dev.zeroed
        );
        write_sync(&mut dev, 5, &[4u8; 512], false).unwrap();
        let back = read(&mut dev, 2, 12);
        let block = |i: usize| &back[i * 512..(i + 1) * 512];
        assert_eq!(
            block(0),
            &[7u8; 512][..],
            "LBA 2 written before, outside the range"
        );
        assert_eq!(block(1), &[0u8; 512][..], "LBA 3 zeroed after its write");
        assert_eq!(block(3), &[4u8; 512][..], "LBA 5 written after the zeroing");
        assert_eq!(block(9), &[0u8; 512][..], "LBA 11 deallocated");
        assert_eq!(block(10), &[1u8; 512][..], "LBA 12 untouched");
        run_sync(&mut dev, IoOp::WriteZeroes { lba: 0, lbas: 2 }, &mut others)
            .unwrap()
            .result
            .unwrap();
        assert_eq!(dev.zeroed.len(), 2, "{:?}", dev.zeroed);
        assert_eq!(read(&mut dev, 0, 1), vec![0u8; 512]);

        let mut inner = dev.into_inner();
        let mem = inner.sim_access().unwrap();
        let mut after = vec![0u8; before.len()];
        mem.sim_read(0, &mut after);
        assert!(after == before, "the inner device was written");
    }
}
