//! The recording and fault wrappers: crash states rebuilt from the write log honour flushes and
//! FUA exactly, and every injected fault behaves as the fault model says — deterministically for
//! a seed.

use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image, CrashMode, FaultConfig, FaultDevice, Record, RecordingDevice};
use nvme::{BlockDevice, DevError, IoOp, OpKind};
use std::time::{Duration, Instant};

const LBA: usize = 4096;

fn mem() -> MemDevice {
    MemDevice::new(MemConfig {
        capacity_bytes: 1 << 20,
        lba_size_bytes: 4096,
        queue_depth: 16,
        buf_bytes: 16 << 10,
        buf_count: 32,
    })
    .unwrap()
}

fn block(fill: u8) -> Vec<u8> {
    vec![fill; LBA]
}

fn read_block(dev: &mut dyn BlockDevice, lba: u64) -> Vec<u8> {
    let mut out = vec![0u8; LBA];
    nvme::read_sync(dev, lba, &mut out).unwrap();
    out
}

#[test]
fn recording_logs_completed_writes_and_flush_coverage() {
    let mut dev = RecordingDevice::new(mem());
    let log = dev.log();
    nvme::write_sync(&mut dev, 1, &block(1), false).unwrap();
    nvme::write_sync(&mut dev, 2, &block(2), false).unwrap();
    nvme::flush_sync(&mut dev).unwrap();
    nvme::write_sync(&mut dev, 1, &block(3), false).unwrap();
    nvme::write_sync(&mut dev, 4, &block(4), true).unwrap();
    let mut done = Vec::new();
    nvme::run_sync(&mut dev, IoOp::WriteZeroes { lba: 2, lbas: 1 }, &mut done)
        .unwrap()
        .result
        .unwrap();
    let _ = read_block(&mut dev, 1); // reads are not logged
    let records = log.snapshot();
    assert_eq!(records.len(), 6, "{records:?}");
    assert_eq!(records[2], Record::Flush { covers: 2 });
    assert!(matches!(
        &records[4],
        Record::Write {
            lba: 4,
            fua: true,
            ..
        }
    ));

    let base = vec![0u8; 1 << 20];
    let at = |image: &[u8], lba: usize| image[lba * LBA];
    // Cut after everything: only the flush-covered writes and the FUA write are certain.
    let durable = crash_image(&base, 4096, &records, records.len(), CrashMode::DurableOnly);
    assert_eq!(
        (at(&durable, 1), at(&durable, 2), at(&durable, 4)),
        (1, 2, 4)
    );
    let landed = crash_image(&base, 4096, &records, records.len(), CrashMode::AllLanded);
    assert_eq!((at(&landed, 1), at(&landed, 2), at(&landed, 4)), (3, 0, 4));
    assert_eq!(landed, dev.inner().image(), "all landed equals the device");
    // Cut before the flush completed: nothing is durable.
    let early = crash_image(&base, 4096, &records, 2, CrashMode::DurableOnly);
    assert!(early.iter().all(|&b| b == 0));
    // Random subsets only ever show, per LBA, the durable value or a later completed write.
    for seed in 0..200 {
        let img = crash_image(
            &base,
            4096,
            &records,
            records.len(),
            CrashMode::Torn { seed },
        );
        assert!([1, 3].contains(&at(&img, 1)), "seed {seed}");
        assert!([0, 2].contains(&at(&img, 2)), "seed {seed}");
        assert_eq!(at(&img, 4), 4, "seed {seed}: FUA write lost");
    }
    // A flush covers only records completed before it was submitted.
    assert_eq!(
        nvme::wrap::crash::durable_prefix(&records, records.len()),
        2
    );
}

#[test]
fn torn_crash_states_mix_lbas_of_one_write() {
    let records = vec![Record::Write {
        lba: 0,
        data: vec![9u8; 4 * LBA].into(),
        fua: false,
    }];
    let base = vec![0u8; 8 * LBA];
    let mut saw_mixed = false;
    for seed in 0..64 {
        let img = crash_image(&base, 4096, &records, 1, CrashMode::Torn { seed });
        let landed: Vec<bool> = (0..4).map(|b| img[b * LBA] == 9).collect();
        for b in 0..4 {
            assert!(
                img[b * LBA..(b + 1) * LBA]
                    .iter()
                    .all(|&x| x == img[b * LBA]),
                "seed {seed}: an LBA torn inside itself"
            );
        }
        saw_mixed |= landed.iter().any(|&l| l) && landed.iter().any(|&l| !l);
    }
    assert!(saw_mixed, "64 seeds never tore a 4-LBA write");
    let corrupt = crash_image(
        &base,
        4096,
        &records,
        1,
        CrashMode::CorruptSector { seed: 5 },
    );
    assert!(
        corrupt
            .chunks(LBA)
            .any(|b| b.iter().any(|&x| x != 0 && x != 9)),
        "no garbage sector"
    );
}

#[test]
fn one_shot_and_random_eio() {
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 11,
            ..Default::default()
        },
    );
    dev.fail_next(OpKind::Flush, 1);
    dev.fail_next(OpKind::Write, 1);
    let err = nvme::write_sync(&mut dev, 3, &block(7), false).unwrap_err();
    assert_eq!(
        err,
        DevError::Io {
            op: OpKind::Write,
            errno: libc::EIO
        }
    );
    assert_eq!(
        read_block(&mut dev, 3),
        block(0),
        "a failed write did not reach the device"
    );
    assert!(matches!(
        nvme::flush_sync(&mut dev),
        Err(DevError::Io {
            op: OpKind::Flush,
            ..
        })
    ));
    nvme::flush_sync(&mut dev).unwrap();
    dev.set_config(FaultConfig {
        read_eio: 1.0,
        ..Default::default()
    });
    let mut out = vec![0u8; LBA];
    assert!(nvme::read_sync(&mut dev, 0, &mut out).is_err());
    assert_eq!(dev.stats().eio, 3);
    assert_eq!(
        dev.pool().free_count(),
        32,
        "buffers of failed ops come back"
    );
}

#[test]
fn bitrot_is_persistent_until_rewritten() {
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 3,
            ..Default::default()
        },
    );
    nvme::write_sync(&mut dev, 5, &block(0x55), false).unwrap();
    dev.rot(5, 8 * 100 + 3);
    let first = read_block(&mut dev, 5);
    assert_eq!(first[100], 0x55 ^ 0x08);
    assert_eq!(
        read_block(&mut dev, 5),
        first,
        "a retry returns the same rotten data"
    );
    nvme::write_sync(&mut dev, 5, &block(0x66), false).unwrap();
    assert_eq!(
        read_block(&mut dev, 5),
        block(0x66),
        "a rewrite heals the block"
    );
    // Random rot: some reads of many come back wrong, deterministically for the seed.
    let rotten_reads = |seed: u64| {
        let mut dev = FaultDevice::new(
            mem(),
            FaultConfig {
                seed,
                read_bitrot: 0.1,
                ..Default::default()
            },
        );
        (0..100)
            .filter(|&i| read_block(&mut dev, i % 16) != block(0))
            .count()
    };
    let a = rotten_reads(42);
    assert!(a > 0, "10% rot over 100 reads found nothing");
    assert_eq!(
        a,
        rotten_reads(42),
        "the same seed must give the same faults"
    );
}

#[test]
fn misdirected_and_lost_writes_report_success_and_miss_the_target() {
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 9,
            misdirected_write: 1.0,
            ..Default::default()
        },
    );
    nvme::write_sync(&mut dev, 10, &block(0xaa), false).unwrap();
    assert_eq!(dev.stats().misdirected, 1);
    let image = dev.inner().image();
    let landed: Vec<usize> = image
        .chunks(LBA)
        .enumerate()
        .filter(|(_, b)| b[0] == 0xaa)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(landed.len(), 1, "the data landed exactly once");
    if landed[0] != 10 {
        assert_eq!(image[10 * LBA], 0, "the target kept its old data");
    }
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 9,
            lost_write: 1.0,
            ..Default::default()
        },
    );
    nvme::write_sync(&mut dev, 10, &block(0xbb), true).unwrap();
    assert_eq!(dev.stats().lost, 1);
    assert!(dev.inner().image().iter().all(|&b| b == 0));
}

#[test]
fn latency_spikes_delay_without_error() {
    let spike = Duration::from_millis(30);
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 1,
            latency_spike: 1.0,
            latency_spike_duration: spike,
            ..Default::default()
        },
    );
    let start = Instant::now();
    nvme::write_sync(&mut dev, 0, &block(1), false).unwrap();
    assert!(
        start.elapsed() >= spike,
        "completion came back before the spike ended"
    );
    let mut out = Vec::new();
    dev.submit(nvme::Request {
        token: 5,
        op: IoOp::Flush,
    })
    .unwrap();
    assert_eq!(
        dev.poll(&mut out).unwrap(),
        0,
        "a held completion is not visible early"
    );
    assert_eq!(dev.in_flight(), 1);
    while out.is_empty() {
        dev.wait(&mut out, Duration::from_secs(1)).unwrap();
    }
    assert_eq!(out[0].token, 5);
}

#[test]
fn ignored_flush_and_crash_lose_unflushed_writes() {
    let mut dev = FaultDevice::new(
        mem(),
        FaultConfig {
            seed: 77,
            crash_model: true,
            ..Default::default()
        },
    );
    nvme::write_sync(&mut dev, 0, &block(1), false).unwrap();
    nvme::flush_sync(&mut dev).unwrap();
    nvme::write_sync(&mut dev, 1, &block(2), true).unwrap(); // FUA: durable
                                                             // Many unflushed writes: after the crash each LBA holds its durable value or a write to it.
    for round in 0..20u8 {
        nvme::write_sync(&mut dev, 2 + (round % 4) as u64, &block(10 + round), false).unwrap();
    }
    nvme::write_sync(&mut dev, 0, &block(99), false).unwrap();
    let unflushed = dev.crash();
    assert_eq!(unflushed, 21);
    assert_eq!(
        read_block(&mut dev, 1),
        block(2),
        "a FUA write survives a crash"
    );
    let lba0 = read_block(&mut dev, 0)[0];
    assert!([1, 99].contains(&lba0), "flushed block holds {lba0}");
    let stats = dev.stats().clone();
    assert!(
        stats.dropped_at_crash + stats.torn_at_crash > 0,
        "{stats:?}"
    );
    // An ignored flush protects nothing.
    dev.set_config(FaultConfig {
        ignored_flush: 1.0,
        ..Default::default()
    });
    for _ in 0..8 {
        nvme::write_sync(&mut dev, 8, &block(5), false).unwrap();
        nvme::flush_sync(&mut dev).unwrap();
    }
    assert_eq!(dev.stats().ignored_flushes, 8);
    assert_eq!(
        dev.crash(),
        8,
        "writes behind ignored flushes are still unflushed"
    );
}
