//! One conformance suite for every backend that runs on this machine (memory, io_uring file at
//! 512 B and 4 KiB LBAs, SQPOLL, and both wrappers): random operation sequences at queue depth up
//! to 64 checked against an in-memory model (writes from DMA buffers and, where the queue
//! takes them, from shared memory in pieces), plus the rejection contract (queue full, range,
//! alignment, foreign buffers, misaligned shared memory). Seeds are printed so a failure
//! replays.

use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::backend::uring_file::{FileConfig, FileDevice};
use nvme::dma::HugepagePolicy;
use nvme::wrap::{FaultConfig, FaultDevice, OverlayDevice, RecordingDevice};
use nvme::{BlockDevice, DevError, IoCompletion, IoOp, Request, SharedWrite};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::time::Duration;

const CAPACITY_BYTES: u64 = 8 << 20;

fn mem(lba: u32) -> MemDevice {
    MemDevice::new(MemConfig {
        capacity_bytes: CAPACITY_BYTES,
        lba_size_bytes: lba,
        queue_depth: 64,
        buf_bytes: 64 << 10,
        buf_count: 96,
    })
    .unwrap()
}

fn file(dir: &tempfile::TempDir, lba: u32, sqpoll: bool) -> FileDevice {
    FileDevice::open(
        &dir.path().join("image"),
        &FileConfig {
            create_bytes: Some(CAPACITY_BYTES),
            lba_size_bytes: lba,
            queue_depth: 64,
            buf_bytes: 64 << 10,
            buf_count: 96,
            sqpoll_idle_ms: sqpoll.then_some(100),
            hugepages: HugepagePolicy::Never,
            access: nvme::Access::Exclusive,
        },
    )
    .unwrap()
}

/// What each in-flight token expects when it completes.
enum Expect {
    Read { lba: u64, model_snapshot: Vec<u8> },
    Other,
}

/// `data` as a shared write of 1-4 pieces cut at random LBA boundaries, each piece a slice of
/// one aligned copy of the whole (pieces that follow each other in memory, as a staged
/// write's do) or, where the queue takes more than one range, an aligned copy of its own (as
/// pieces of different writes are).
fn shared_pieces(
    data: &[u8],
    info: &nvme::DeviceInfo,
    rng: &mut Xoshiro256PlusPlus,
) -> SharedWrite {
    let lba = info.lba_size_bytes as usize;
    let aligned = nvme::aligned_copy;
    let whole = aligned(data);
    let lbas = data.len() / lba;
    let mut cuts = vec![0, lbas];
    for _ in 0..rng.random_range(0..4) {
        cuts.push(rng.random_range(0..=lbas));
    }
    cuts.sort_unstable();
    cuts.dedup();
    let pieces = cuts
        .windows(2)
        .map(|w| {
            let range = w[0] * lba..w[1] * lba;
            if info.shared_write_ranges_max == 1 || rng.random_bool(0.5) {
                whole.slice(range)
            } else {
                aligned(&data[range])
            }
        })
        .collect();
    SharedWrite::new(pieces)
}

/// Runs `ops` random operations with up to `depth` in flight and checks every read against the
/// model. Overlapping in-flight operations are avoided, because their order is undefined.
fn run_model(dev: &mut dyn BlockDevice, seed: u64, ops: usize, depth: usize) {
    let info = dev.info().clone();
    let lba_size = info.lba_size_bytes as usize;
    let max_lbas = (info.max_io_bytes as usize / lba_size).min(32);
    let mut model = vec![0u8; info.capacity_bytes() as usize];
    // Start from a known state: zero the whole device.
    let mut done = Vec::new();
    let zero_lbas = info.capacity_lbas.min(8192) as u32;
    let mut lba = 0;
    while lba < info.capacity_lbas {
        let n = zero_lbas.min((info.capacity_lbas - lba) as u32);
        let c = nvme::run_sync(dev, IoOp::WriteZeroes { lba, lbas: n }, &mut done).unwrap();
        c.result.unwrap();
        lba += n as u64;
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut in_flight: Vec<(u64, u64, u64, Expect)> = Vec::new(); // token, lba, lbas, expect
    let mut next_token = 1u64;
    let mut completions: Vec<IoCompletion> = Vec::new();
    let mut issued = 0;
    while issued < ops || !in_flight.is_empty() {
        if issued < ops && in_flight.len() < depth {
            let lbas = rng.random_range(1..=max_lbas) as u64;
            let lba = rng.random_range(0..info.capacity_lbas - lbas + 1);
            let overlaps = in_flight
                .iter()
                .any(|(_, l, n, _)| lba < l + n && *l < lba + lbas);
            let kind = rng.random_range(0..100);
            if !overlaps {
                let range = lba as usize * lba_size..(lba + lbas) as usize * lba_size;
                let (op, expect) = if kind < 45 && info.shared_write_ranges_max > 0 && kind % 2 == 0
                {
                    let mut data = vec![0u8; range.len()];
                    rng.fill(&mut data[..]);
                    model[range].copy_from_slice(&data);
                    (
                        IoOp::WriteShared {
                            lba,
                            data: shared_pieces(&data, &info, &mut rng),
                            fua: kind < 5,
                        },
                        Expect::Other,
                    )
                } else if kind < 45 {
                    let mut buf = dev.pool().alloc(range.len()).expect("pool sized for depth");
                    rng.fill(buf.as_mut_slice());
                    model[range].copy_from_slice(buf.as_slice());
                    (
                        IoOp::Write {
                            lba,
                            buf,
                            fua: kind < 5,
                        },
                        Expect::Other,
                    )
                } else if kind < 85 {
                    let buf = dev.pool().alloc(range.len()).expect("pool sized for depth");
                    (
                        IoOp::Read { lba, buf },
                        Expect::Read {
                            lba,
                            model_snapshot: model[range].to_vec(),
                        },
                    )
                } else if kind < 92 {
                    model[range].fill(0);
                    (
                        IoOp::WriteZeroes {
                            lba,
                            lbas: lbas as u32,
                        },
                        Expect::Other,
                    )
                } else if kind < 96 {
                    model[range].fill(0);
                    (
                        IoOp::Deallocate {
                            lba,
                            lbas: lbas as u32,
                        },
                        Expect::Other,
                    )
                } else {
                    (IoOp::Flush, Expect::Other)
                };
                let (lba, lbas) = if matches!(op, IoOp::Flush) {
                    (0, 0)
                } else {
                    (lba, lbas)
                };
                dev.submit(Request {
                    token: next_token,
                    op,
                })
                .unwrap_or_else(|r| panic!("seed {seed}: submit rejected: {}", r.reason));
                in_flight.push((next_token, lba, lbas, expect));
                next_token += 1;
                issued += 1;
                continue;
            }
        }
        completions.clear();
        dev.wait(&mut completions, Duration::from_secs(5)).unwrap();
        for c in completions.drain(..) {
            let at = in_flight
                .iter()
                .position(|(t, ..)| *t == c.token)
                .unwrap_or_else(|| panic!("seed {seed}: unknown token {}", c.token));
            let (_, _, _, expect) = in_flight.swap_remove(at);
            c.result
                .as_ref()
                .unwrap_or_else(|e| panic!("seed {seed}: {:?} failed: {e}", c.kind));
            if let Expect::Read {
                lba,
                model_snapshot,
            } = expect
            {
                let buf = c.buf.expect("read returns its buffer");
                assert!(
                    buf.as_slice() == &model_snapshot[..],
                    "seed {seed}: read at lba {lba} differs from the model"
                );
            }
        }
    }
    nvme::flush_sync(dev).unwrap();
    // Whole-device check at the end.
    let mut image = vec![0u8; model.len()];
    nvme::read_sync(dev, 0, &mut image).unwrap();
    assert!(
        image == model,
        "seed {seed}: final image differs from the model"
    );
    assert_eq!(dev.in_flight(), 0);
    assert_eq!(
        dev.pool().free_count(),
        dev.pool().buf_count() as usize,
        "seed {seed}: buffers leaked"
    );
}

fn seed() -> u64 {
    nvme::wrap::seed_from_env()
}

#[test]
fn mem_backend_matches_model() {
    for lba in [512, 4096] {
        run_model(&mut mem(lba), seed(), 3000, 32);
    }
}

#[test]
fn file_backend_matches_model_at_512_and_4096() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut dev = file(&dir, 4096, false);
    // Every kernel corefs runs on (5.19+) registers files: the model runs through the
    // registered index, the path every request takes.
    assert!(
        dev.fixed_file(),
        "the image was not registered with the ring"
    );
    run_model(&mut dev, seed(), 3000, 64);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    run_model(&mut file(&dir, 512, false), seed(), 2000, 33);
}

#[test]
fn file_backend_with_sqpoll_matches_model() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    run_model(&mut file(&dir, 4096, true), seed(), 1000, 16);
}

#[test]
fn wrappers_without_faults_are_transparent() {
    run_model(&mut RecordingDevice::new(mem(4096)), seed(), 1500, 16);
    run_model(
        &mut FaultDevice::new(
            mem(4096),
            FaultConfig {
                seed: seed(),
                ..Default::default()
            },
        ),
        seed(),
        1500,
        16,
    );
    run_model(
        &mut OverlayDevice::new(Box::new(mem(4096))),
        seed(),
        1500,
        16,
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn prop_file_and_mem_agree(seed in any::<u64>(), depth in 1usize..48) {
        run_model(&mut mem(4096), seed, 300, depth);
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        run_model(&mut file(&dir, 4096, false), seed, 300, depth);
    }
}

fn check_rejections(dev: &mut dyn BlockDevice) {
    let info = dev.info().clone();
    let lba = info.lba_size_bytes as usize;
    // Out of range.
    let buf = dev.pool().alloc(lba).unwrap();
    let r = dev
        .submit(Request {
            token: 1,
            op: IoOp::Read {
                lba: info.capacity_lbas,
                buf,
            },
        })
        .unwrap_err();
    assert!(
        matches!(r.reason, DevError::OutOfRange { .. }),
        "{}",
        r.reason
    );
    assert!(
        matches!(r.request.op, IoOp::Read { .. }),
        "the request comes back"
    );
    let r = dev
        .submit(Request {
            token: 1,
            op: IoOp::WriteZeroes {
                lba: u64::MAX,
                lbas: 2,
            },
        })
        .unwrap_err();
    assert!(
        matches!(r.reason, DevError::OutOfRange { .. }),
        "overflowing range: {}",
        r.reason
    );
    // Not a whole LBA.
    let buf = dev.pool().alloc(lba + 1).unwrap();
    let r = dev
        .submit(Request {
            token: 1,
            op: IoOp::Write {
                lba: 0,
                buf,
                fua: false,
            },
        })
        .unwrap_err();
    assert!(
        matches!(r.reason, DevError::BadLength { .. }),
        "{}",
        r.reason
    );
    // A buffer from another pool.
    let other = nvme::DmaPool::new(4096, 1, HugepagePolicy::Never).unwrap();
    let foreign = other.alloc(lba).unwrap();
    let r = dev
        .submit(Request {
            token: 1,
            op: IoOp::Write {
                lba: 0,
                buf: foreign,
                fua: false,
            },
        })
        .unwrap_err();
    assert_eq!(r.reason, DevError::ForeignBuffer);
    // Shared memory: refused where the queue takes none, and misaligned where it does.
    let page = nvme::aligned_copy(&[7u8; 2 * nvme::shared::ALIGN_BYTES]);
    let r = dev
        .submit(Request {
            token: 1,
            op: IoOp::WriteShared {
                lba: 0,
                data: SharedWrite::new(vec![page.slice(1..1 + lba)]),
                fua: false,
            },
        })
        .unwrap_err();
    if info.shared_write_ranges_max > 0 {
        assert!(
            matches!(r.reason, DevError::Misaligned { .. }),
            "{}",
            r.reason
        );
    } else {
        assert!(
            matches!(r.reason, DevError::Unsupported { .. }),
            "{}",
            r.reason
        );
    }
    // Queue full: fill the queue without polling, the next one bounces and comes back whole.
    for token in 0..info.queue_depth as u64 {
        dev.submit(Request {
            token,
            op: IoOp::Flush,
        })
        .unwrap();
    }
    let buf = dev.pool().alloc(lba).unwrap();
    let r = dev
        .submit(Request {
            token: 999,
            op: IoOp::Write {
                lba: 0,
                buf,
                fua: false,
            },
        })
        .unwrap_err();
    assert_eq!(r.reason, DevError::QueueFull);
    assert_eq!(r.request.token, 999);
    let mut done = Vec::new();
    while done.len() < info.queue_depth as usize {
        dev.wait(&mut done, Duration::from_secs(5)).unwrap();
    }
    assert!(done.iter().all(|c| c.result.is_ok()));
    let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
    tokens.sort();
    assert_eq!(
        tokens,
        (0..info.queue_depth as u64).collect::<Vec<_>>(),
        "every request completes exactly once"
    );
    assert_eq!(dev.in_flight(), 0);
}

#[test]
fn backends_reject_bad_requests_and_give_backpressure() {
    check_rejections(&mut mem(4096));
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    check_rejections(&mut file(&dir, 4096, false));
    check_rejections(&mut RecordingDevice::new(mem(512)));
    check_rejections(&mut OverlayDevice::new(Box::new(mem(512))));
    check_rejections(&mut FaultDevice::new(mem(512), FaultConfig::default()));
}

/// A file queue registers its DMA pool a 2 MiB chunk at a time as buffers are first used,
/// not all at open (registering pins, and so faults in, every page it names), and I/O from
/// buffers registered late round-trips like any other.
#[test]
fn a_file_queue_registers_its_buffers_as_they_are_first_used() {
    let dir = tempfile::tempdir().unwrap();
    let mut dev = file(&dir, 4096, false);
    let pool = dev.pool().clone();
    let chunk = pool.bufs_per_chunk();
    assert_eq!(chunk, 32, "64 KiB buffers, 32 to a 2 MiB chunk");
    assert_eq!(
        dev.registered_bufs(),
        Some(0),
        "the pool is registered sparse and empty at open (a kernel without sparse buffer \
         tables, before 5.19, registers it whole: this test then fails by design)"
    );
    let mut done = Vec::new();
    let block = |i: usize| vec![(i % 251) as u8 + 1; 4096];
    let write = |dev: &mut FileDevice, lba: u64, bytes: &[u8], done: &mut Vec<IoCompletion>| {
        let mut buf = dev.pool().alloc(4096).unwrap();
        buf.as_mut_slice().copy_from_slice(bytes);
        let op = IoOp::Write {
            lba,
            buf,
            fua: false,
        };
        nvme::run_sync(dev, op, done).unwrap().result.unwrap();
    };
    write(&mut dev, 0, &block(0), &mut done);
    assert_eq!(
        dev.registered_bufs(),
        Some(chunk),
        "one buffer used: its chunk only"
    );

    // More buffers at once than a chunk holds: the next chunk is registered, no more.
    let held: Vec<_> = (0..=chunk as usize)
        .map(|i| {
            let mut buf = pool.alloc(4096).unwrap();
            buf.as_mut_slice().copy_from_slice(&block(i));
            buf
        })
        .collect();
    for (i, buf) in held.into_iter().enumerate() {
        let op = IoOp::Write {
            lba: i as u64,
            buf,
            fua: false,
        };
        dev.submit(Request {
            token: i as u64,
            op,
        })
        .unwrap();
    }
    let mut completed = Vec::new();
    while completed.len() <= chunk as usize {
        dev.wait(&mut completed, Duration::from_secs(5)).unwrap();
    }
    for c in &completed {
        c.result.as_ref().unwrap();
    }
    assert_eq!(dev.registered_bufs(), Some(2 * chunk));
    for i in 0..=chunk as u64 {
        let buf = pool.alloc(4096).unwrap();
        let c = nvme::run_sync(&mut dev, IoOp::Read { lba: i, buf }, &mut done).unwrap();
        c.result.unwrap();
        let buf = c.buf.expect("a read hands its buffer back");
        assert_eq!(buf.as_slice(), &block(i as usize)[..], "block {i}");
    }
    assert!(dev.fixed_buffers());
    assert!(dev.registered_bufs().unwrap() < pool.buf_count());
}

#[test]
fn file_device_strings_create_size_and_reopen() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("img");
    let spec = format!("file:{},size=4MiB,qd=8,hugepages=off", path.display());
    let mut dev = nvme::open_device(&spec, &Default::default()).unwrap();
    assert_eq!(dev.info().capacity_bytes(), 4 << 20);
    assert_eq!(dev.info().queue_depth, 8);
    nvme::write_sync(&mut *dev, 7, &[0xab; 4096], true).unwrap();
    drop(dev);
    // Reopen without a size: the existing file's size and content are kept.
    let mut dev =
        nvme::open_device(&format!("file:{}", path.display()), &Default::default()).unwrap();
    assert_eq!(dev.info().capacity_bytes(), 4 << 20);
    let mut back = [0u8; 4096];
    nvme::read_sync(&mut *dev, 7, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xab));
    // Missing file without a size: a clear error that says how to create it.
    let err = nvme::open_device(
        &format!("file:{}/missing", dir.path().display()),
        &Default::default(),
    )
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("ENOENT") && err.to_string().contains("size="),
        "{err}"
    );
    let mem = nvme::open_device("mem:1MiB,lba=512", &Default::default()).unwrap();
    assert_eq!(
        (mem.info().capacity_lbas, mem.info().lba_size_bytes),
        (2048, 512)
    );
}

#[test]
fn file_backend_reports_io_errors_by_name() {
    // A read past the end of a file that shrank under us is a short transfer, never silent.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut dev = file(&dir, 4096, false);
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("image"))
        .unwrap()
        .set_len(4096)
        .unwrap();
    let mut out = [0u8; 8192];
    let err = nvme::read_sync(&mut dev, 0, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            DevError::ShortTransfer {
                expected_bytes: 8192,
                got_bytes: 4096,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn kernel_probe_finds_io_uring() {
    let report = nvme::probe::probe();
    eprintln!("{report}");
    assert!(
        report.feature("io_uring").unwrap().available,
        "io_uring is needed for the file backend:\n{report}"
    );
    assert!(
        report
            .feature("io_uring READ_FIXED/WRITE_FIXED")
            .unwrap()
            .available
    );
}

#[test]
fn a_queue_belongs_to_the_thread_that_first_submits() {
    // Opened here, used on another thread: the first submitter becomes the owner.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut dev = file(&dir, 4096, false);
    let mut dev = std::thread::spawn(move || {
        nvme::write_sync(&mut dev, 3, &[7u8; 4096], false).unwrap();
        dev
    })
    .join()
    .unwrap();
    // Back on this thread, a ring with deferred task run refuses us with a clear, sticky error
    // instead of corrupting anything; a kernel without deferred task run simply works.
    let mut out = [0u8; 4096];
    match nvme::read_sync(&mut dev, 3, &mut out) {
        Ok(()) => assert_eq!(out, [7u8; 4096]),
        Err(e) => {
            assert_eq!(
                e,
                DevError::QueueFailed {
                    errno: libc::EEXIST
                },
                "{e}"
            );
            assert!(nvme::flush_sync(&mut dev).is_err(), "the failure is sticky");
        }
    }
}

/// A file device that did I/O releases the image's lock the moment it is dropped: the
/// ring's registered file is a description of its own, so the kernel's asynchronous ring
/// teardown holds no reference to the locked one (a tool run just after a close once found
/// the image still "in use").
#[test]
fn a_dropped_file_device_releases_its_lock_at_once() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = format!("file:{}", dir.path().join("image").display());
    for round in 0..20 {
        let mut dev = file(&dir, 4096, false);
        assert!(dev.fixed_file(), "the image is registered with the ring");
        let block = vec![round as u8; 4096];
        nvme::write_sync(&mut dev, round, &block, false).unwrap();
        let mut back = vec![0u8; 4096];
        nvme::read_sync(&mut dev, round, &mut back).unwrap();
        assert_eq!(back, block);
        assert!(
            nvme::lock::in_use(&spec).unwrap().is_some(),
            "held while open"
        );
        drop(dev);
        assert!(
            nvme::lock::in_use(&spec).unwrap().is_none(),
            "round {round}: the image is still locked after its device was dropped"
        );
    }
}

/// A reader beside the queue ([`BlockDevice::any_thread_io`]), used from another thread,
/// sees what the queue's completed writes left, and refuses what the queue refuses (bad
/// lengths, ranges outside the device) by name.
fn any_thread_io_sees_completed_writes(dev: &mut dyn BlockDevice) {
    let lba_size = dev.info().lba_size_bytes as usize;
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let lba = 3 * 4096 / lba_size as u64;
    nvme::write_sync(dev, lba, &data, false).unwrap();
    let mut reader = dev.any_thread_io().expect("the backend has a reader");
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            let mut out = vec![0u8; data.len()];
            reader.read_at(lba, &mut out).unwrap();
            let capacity_lbas = CAPACITY_BYTES / lba_size as u64;
            let mut one = vec![0u8; lba_size];
            assert!(matches!(
                reader.read_at(capacity_lbas, &mut one),
                Err(DevError::OutOfRange { .. })
            ));
            let mut odd = vec![0u8; lba_size + 1];
            assert!(matches!(
                reader.read_at(0, &mut odd),
                Err(DevError::BadLength { .. })
            ));
            out
        })
        .join()
        .unwrap()
    });
    assert!(got == data, "the reader returns the written bytes");

    // Writes beside the queue, from another thread: the queue reads them back, FUA or
    // followed by a flush; bad ranges are refused as the queue refuses them.
    assert!(reader.writes(), "the backend writes beside its queue");
    let other: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            reader.write_at(lba, &other[..4096], true).unwrap();
            reader
                .write_at(lba + (4096 / lba_size) as u64, &other[4096..], false)
                .unwrap();
            reader.flush().unwrap();
            let capacity_lbas = CAPACITY_BYTES / lba_size as u64;
            assert!(matches!(
                reader.write_at(capacity_lbas, &other[..lba_size], false),
                Err(DevError::OutOfRange { .. })
            ));
        })
        .join()
        .unwrap()
    });
    let mut back = vec![0u8; other.len()];
    nvme::read_sync(dev, lba, &mut back).unwrap();
    assert!(back == other, "the queue reads what was written beside it");
}

#[test]
fn mem_and_file_readers_beside_the_queue_see_completed_writes() {
    any_thread_io_sees_completed_writes(&mut mem(4096));
    let dir = tempfile::tempdir().unwrap();
    any_thread_io_sees_completed_writes(&mut file(&dir, 512, false));
    let dir = tempfile::tempdir().unwrap();
    any_thread_io_sees_completed_writes(&mut file(&dir, 4096, false));
}
