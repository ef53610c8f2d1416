//! The mux's ordering by block, against a device that holds background writes back until
//! released: nothing here depends on timing.
use super::*;
use crate::blocks::block_lba;
use crate::format::BLOCK_BYTES;
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::OpKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Passes everything to a memory device except writes, which it keeps (unsubmitted, so
/// the device still holds the old bytes) until `released` is set.
struct HoldWrites {
    inner: MemDevice,
    held: Vec<Request>,
    released: Arc<AtomicBool>,
    waits: u32,
}

impl HoldWrites {
    fn release_if_told(&mut self) {
        if self.released.load(Ordering::Relaxed) {
            for request in self.held.drain(..) {
                self.inner
                    .submit(request)
                    .expect("room for a released write");
            }
        }
    }
}

impl BlockDevice for HoldWrites {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }
    fn submit(&mut self, request: Request) -> std::result::Result<(), Rejected> {
        if request.op.kind() == nvme::OpKind::Write {
            self.held.push(request);
            return Ok(());
        }
        self.inner.submit(request)
    }
    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> std::result::Result<usize, DevError> {
        self.release_if_told();
        self.inner.poll(out)
    }
    fn wait(
        &mut self,
        out: &mut Vec<IoCompletion>,
        _timeout: Duration,
    ) -> std::result::Result<usize, DevError> {
        // A wait is what a drain does: held writes stay held (the wait returns what the
        // device has), and a mux that keeps waiting for them is the failure under test.
        self.waits += 1;
        assert!(
            self.waits < 100 || self.released.load(Ordering::Relaxed),
            "the mux waits for a held background write"
        );
        self.poll(out)
    }
    fn in_flight(&self) -> u32 {
        self.inner.in_flight() + self.held.len() as u32
    }
}

fn mux() -> (DeviceMux, Arc<AtomicBool>) {
    let inner = MemDevice::new(MemConfig {
        capacity_bytes: 16 << 20,
        ..MemConfig::default()
    })
    .expect("memory device");
    let released = Arc::new(AtomicBool::new(false));
    let dev = HoldWrites {
        inner,
        held: Vec::new(),
        released: released.clone(),
        waits: 0,
    };
    (DeviceMux::new(Box::new(dev)), released)
}

fn read(mux: &mut DeviceMux, token: u64, block: u64) -> Vec<u8> {
    let buf = mux.pool().alloc(BLOCK_BYTES).expect("a buffer");
    let lba = block_lba(mux, block);
    mux.submit(Request {
        token,
        op: IoOp::Read { lba, buf },
    })
    .expect("read submitted");
    let mut out = Vec::new();
    mux.poll(&mut out).expect("poll");
    assert_eq!(out.len(), 1, "the read completed without the held write");
    let c = out.pop().expect("one");
    assert_eq!((c.token, c.kind), (token, OpKind::Read));
    c.result.expect("read ok");
    c.buf.expect("read buffer").as_slice().to_vec()
}

#[test]
fn reads_beside_a_background_write_never_wait_for_it_and_see_its_bytes() {
    let (mut mux, released) = mux();
    let token = BACKGROUND | 7 << 1;
    let blocks = vec![
        (10, vec![0xAB; BLOCK_BYTES].into()),
        (11, vec![0xCD; BLOCK_BYTES].into()),
    ];
    let mut runs = crate::blocks::coalesce(&mux, blocks, false);
    assert_eq!(runs.len(), 1, "neighbours make one run");
    let run = runs.pop().expect("one run");
    let lba = block_lba(&mux, 10);
    mux.queue_background_write(token, lba, run, false)
        .expect("queued");
    assert!(mux.writes_outstanding.contains_key(&token));

    // Another block: the device answers while the write is held.
    assert_eq!(read(&mut mux, 1, 20), vec![0; BLOCK_BYTES]);
    assert!(
        mux.writes_outstanding.contains_key(&token),
        "a read of another block drained the background write"
    );
    // The blocks being written: their new bytes, not the device's old ones.
    assert_eq!(read(&mut mux, 2, 10), vec![0xAB; BLOCK_BYTES]);
    assert_eq!(read(&mut mux, 3, 11), vec![0xCD; BLOCK_BYTES]);
    assert!(mux.writes_outstanding.contains_key(&token));

    // Once the device completes the write, its bytes leave memory and reads go to the
    // device, which now has them.
    released.store(true, Ordering::Relaxed);
    let done = mux.poll_background(None).expect("background poll");
    assert!(done.iter().any(|c| c.token == token && c.result.is_ok()));
    assert!(mux.writing.is_empty() && mux.writes_outstanding.is_empty());
    assert_eq!(read(&mut mux, 4, 11), vec![0xCD; BLOCK_BYTES]);
}

/// A large background write (a commit's chunk, a write-back) reaches the device a
/// bounded amount per pump: the copies into DMA buffers spread over the loop's turns,
/// and every write still goes, in order.
#[test]
fn a_pump_hands_the_device_a_bounded_amount_and_the_backlog_drains_over_calls() {
    let (mut mux, released) = mux();
    released.store(true, Ordering::Relaxed);
    let token = BACKGROUND | 9 << 1;
    // 64 separate 32 KiB runs (2 MiB), every other 8 blocks, so none coalesce.
    for i in 0..64u64 {
        let first = 100 + i * 16;
        let blocks: Vec<(u64, bytes::Bytes)> = (0..8)
            .map(|b| (first + b, vec![i as u8; BLOCK_BYTES].into()))
            .collect();
        let mut runs = crate::blocks::coalesce(&mux, blocks, false);
        let run = runs.pop().expect("one run");
        let lba = block_lba(&mux, first);
        mux.queue_background_write(token, lba, run, false)
            .expect("queued");
    }
    assert_eq!(mux.backlog.len(), 64, "queueing submits nothing");
    mux.pump().expect("pump");
    let first_pump = 64 - mux.backlog.len();
    assert_eq!(
        first_pump * (32 << 10),
        PUMP_BYTES_MAX,
        "one pump submits PUMP_BYTES_MAX and no more"
    );
    let mut calls = 1;
    while !mux.backlog.is_empty() {
        let _ = mux.poll_background(None).expect("poll");
        calls += 1;
        assert!(calls < 100, "the backlog drains");
    }
    // A poll pumps before and after it takes completions: at most twice.
    assert!(
        calls * 2 >= (2 << 20) / PUMP_BYTES_MAX,
        "spread over several calls"
    );
    while mux.writes_outstanding.contains_key(&token) {
        let _ = mux.poll_background(None).expect("poll");
    }
    for i in 0..64u64 {
        assert_eq!(
            read(&mut mux, 1000 + i, 100 + i * 16),
            vec![i as u8; BLOCK_BYTES]
        );
    }
}

/// An asynchronous read over blocks only part of which a background write holds can be
/// answered neither from the write's bytes nor from the device yet: it waits for that
/// write without a synchronous wait (the held device asserts none comes), and once the
/// write completes it reads the new bytes and the old ones beside them.
#[test]
fn an_async_read_partly_over_a_background_write_waits_for_it_without_holding_anyone() {
    let (mut mux, released) = mux();
    // Block 12's old bytes, written before the background write.
    let mut old = mux.pool().alloc(BLOCK_BYTES).expect("a buffer");
    old.as_mut_slice().fill(0x11);
    let lba = block_lba(&mux, 12);
    released.store(true, Ordering::Relaxed);
    mux.submit(Request {
        token: 1,
        op: IoOp::Write {
            lba,
            buf: old,
            fua: false,
        },
    })
    .expect("write submitted");
    let mut out = Vec::new();
    while out.is_empty() {
        mux.poll(&mut out).expect("poll");
    }
    released.store(false, Ordering::Relaxed);

    let token = BACKGROUND | 5 << 1;
    let blocks = vec![
        (10, vec![0xAB; BLOCK_BYTES].into()),
        (11, vec![0xCD; BLOCK_BYTES].into()),
    ];
    let run = crate::blocks::coalesce(&mux, blocks, false)
        .pop()
        .expect("one run");
    mux.queue_background_write(token, block_lba(&mux, 10), run, false)
        .expect("queued");
    mux.pump().expect("pump");

    // Blocks 10..13: two being written, one on the device.
    let buf = mux.pool().alloc(3 * BLOCK_BYTES).expect("a buffer");
    let read_token = READ | 1;
    mux.submit_read(Request {
        token: read_token,
        op: IoOp::Read {
            lba: block_lba(&mux, 10),
            buf,
        },
    })
    .expect("accepted without waiting");
    assert_eq!(mux.reads_in_flight(), 1);
    assert!(
        mux.poll_reads(None).expect("poll").is_empty(),
        "waits for the write"
    );
    assert_eq!(mux.reads_after_writes.len(), 1);

    released.store(true, Ordering::Relaxed);
    let mut done = Vec::new();
    for _ in 0..100 {
        let _ = mux.poll_background(None).expect("background poll");
        done.extend(mux.poll_reads(None).expect("poll"));
        if !done.is_empty() {
            break;
        }
    }
    assert_eq!(done.len(), 1, "the read started once the write completed");
    let c = done.pop().expect("one");
    assert_eq!(c.token, read_token);
    c.result.expect("read ok");
    let data = c.buf.expect("buffer").as_slice().to_vec();
    assert_eq!(&data[..BLOCK_BYTES], &[0xAB; BLOCK_BYTES][..]);
    assert_eq!(
        &data[BLOCK_BYTES..2 * BLOCK_BYTES],
        &[0xCD; BLOCK_BYTES][..]
    );
    assert_eq!(&data[2 * BLOCK_BYTES..], &[0x11; BLOCK_BYTES][..]);
    assert_eq!(mux.reads_in_flight(), 0);
}
