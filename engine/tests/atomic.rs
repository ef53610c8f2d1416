//! Atomic batches (engine `atomic`, docs/fsync-log.md "Atomic batches") across power cuts:
//! a power cut at every write and flush of a run of batches — only what was durable, and
//! torn writes — mounts clean with the file holding the state after some number of whole
//! batches, never part of one, and at least every batch whose commit had returned. Run with
//! the log's usual path (one record per batch, small and large), and with the record not
//! fitting the log (the batch commits the transaction instead).

use engine::atomic::AtomicBatch;
use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::MemDevice;
use nvme::wrap::{crash_image, CrashMode, Record, RecordingDevice, WriteLog};
use std::sync::Arc;

#[path = "support/mem_image.rs"]
mod mem_image;
use mem_image::{config, image_of};

fn mount(image: &[u8]) -> Filesystem {
    let dev = MemDevice::from_image(image, config()).unwrap();
    Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap()
}

/// Deterministic bytes for (batch, write).
fn bytes(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) as u8 | 1)
        .collect()
}

/// Files `db` (8 blocks of old content) and `other`, committed on a fresh image, mounted
/// again on a recording device: (image, write log, filesystem, db, other, db's content).
fn recorded() -> (Vec<u8>, Arc<WriteLog>, Filesystem, u64, u64, Vec<u8>) {
    let dev = MemDevice::new(config()).unwrap();
    let options = MkfsOptions {
        shards: 2,
        label: "atomic".into(),
        ..Default::default()
    };
    let image = image_of(Filesystem::mkfs(Box::new(dev), &options).unwrap());
    let mut fs = mount(&image);
    let root = fs.root();
    let db = fs.create(root, b"db", 0o644, 0, 0).unwrap().ino;
    let other = fs.create(root, b"other", 0o644, 0, 0).unwrap().ino;
    let old = bytes(8 * 4096, 999);
    fs.write(db, 0, &old).unwrap();
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let recording = RecordingDevice::new(MemDevice::from_image(&image, config()).unwrap());
    let log = recording.log();
    let fs = Filesystem::mount(Box::new(recording), MountOptions::default()).unwrap();
    (image, log, fs, db, other, old)
}

/// Batch `n`'s writes: page overwrites, a partial write inside a block, one growing the file,
/// and (in batch 1) a large write whose data goes in place beside the record.
fn batch_writes(n: u32) -> Vec<(u64, Vec<u8>)> {
    let seed = n * 100;
    let mut writes = vec![
        (4096 * (n as u64 % 3), bytes(4096, seed + 1)),
        (4096 * 5 + 100, bytes(300, seed + 2)),
        (4096 * (8 + 2 * n as u64), bytes(4096, seed + 3)),
        (4096 * 6, bytes(4096, seed + 4)),
        // Overlaps the first: the later write wins.
        (4096 * (n as u64 % 3) + 1000, bytes(50, seed + 5)),
    ];
    if n == 1 {
        writes.push((4096 * 20, bytes(12 * 4096, seed + 6)));
    }
    writes
}

fn apply(content: &mut Vec<u8>, writes: &[(u64, Vec<u8>)]) {
    for (offset, data) in writes {
        let end = *offset as usize + data.len();
        if content.len() < end {
            content.resize(end, 0);
        }
        content[*offset as usize..end].copy_from_slice(data);
    }
}

/// Runs `batches` batches through an [`AtomicBatch`] each, and checks every cut of the
/// device's write log: the file is always one of the states between whole batches, at
/// least the last one acknowledged. Returns the filesystem for more checks.
fn assert_batches_all_or_nothing(
    image: &[u8],
    log: &WriteLog,
    mut fs: Filesystem,
    db: u64,
    old: Vec<u8>,
    batches: u32,
) -> Filesystem {
    let from = log.len();
    let mut states = vec![old];
    // Log length when batch k's commit returned (it was acknowledged from there on).
    let mut acked_at = Vec::new();
    for n in 0..batches {
        let mut batch = AtomicBatch::new();
        for (offset, data) in batch_writes(n) {
            batch.stage(offset, &data).unwrap();
        }
        let writes = batch.take_writes();
        fs.write_atomic(db, &writes).unwrap();
        acked_at.push(log.len());
        let mut next = states.last().unwrap().clone();
        apply(&mut next, &batch_writes(n));
        assert_eq!(fs.read(db, 0, next.len() + 10).unwrap(), next);
        states.push(next);
    }
    let records: Vec<Record> = log.snapshot();
    let mut cuts = 0;
    for cut in from..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(image, 512, &records, cut, mode);
            let mut after = mount(&crashed);
            after
                .check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            let size = after.stat(db).unwrap().size;
            let content = after.read(db, 0, size as usize).unwrap();
            let Some(state) = states.iter().position(|s| *s == content) else {
                panic!("cut {cut} {mode:?}: size {size}, part of a batch")
            };
            let acked = acked_at.iter().filter(|&&at| at <= cut).count();
            if mode == CrashMode::DurableOnly {
                assert!(
                    state >= acked,
                    "cut {cut}: state after {state} batches, {acked} were acknowledged"
                );
            }
            cuts += 1;
        }
    }
    assert!(cuts > 2 * batches as usize, "{cuts} cuts checked");
    assert_eq!(
        fs.reservation_overrun_blocks(),
        0,
        "a batch reserves its worst case"
    );
    fs
}

#[test]
fn a_batch_is_one_record_and_all_or_nothing_at_every_cut() {
    let (image, log, mut fs, db, other, old) = recorded();
    // Something else logged first, so the batches' records are not the first after mount.
    fs.write(other, 0, &bytes(4096, 7)).unwrap();
    fs.fsync(other).unwrap();
    let before = fs.log_stats();
    let fs = assert_batches_all_or_nothing(&image, &log, fs, db, old, 3);
    let after = fs.log_stats();
    assert_eq!(
        after.log_writes - before.log_writes,
        3,
        "one record per batch"
    );
    assert_eq!(after.fallback_commits(), 0);
}

#[test]
fn a_batch_whose_record_does_not_fit_the_log_commits_and_is_all_or_nothing() {
    let (image, log, mut fs, db, other, old) = recorded();
    // Fill every log until a batch's record no longer fits (no tick here commits early).
    let mut i = 0u64;
    while fs.log_room_blocks() > 3 {
        fs.write(other, i * 4096, &bytes(4096, i as u32)).unwrap();
        fs.fsync(other).unwrap();
        i += 1;
        assert!(i < 100_000, "the log never filled");
    }
    let before = fs.log_stats();
    let fs = assert_batches_all_or_nothing(&image, &log, fs, db, old, 1);
    assert!(
        fs.log_stats().fallback_log_full > before.fallback_log_full,
        "the batch committed instead of logging"
    );
}

#[test]
fn staging_and_an_empty_commit_change_nothing() {
    let (_image, _log, mut fs, db, _other, old) = recorded();
    let mut batch = AtomicBatch::new();
    batch.stage(0, &bytes(4096, 1)).unwrap();
    // Staged only: the file is unchanged until the commit.
    assert_eq!(fs.read(db, 0, old.len()).unwrap(), old);
    drop(batch);
    fs.write_atomic(db, &[]).unwrap();
    assert_eq!(fs.read(db, 0, old.len() + 1).unwrap(), old);
    // A batch on a directory is refused before anything is applied.
    let root = fs.root();
    assert!(fs.write_atomic(root, &[(0, vec![1])]).is_err());
    fs.check().unwrap();
}

/// Each batch overwrites pages, freeing their old copies pinned until a commit; fsync records
/// never commit. A batch that finds the shard full of such frees commits first (nothing of it
/// applied yet) and goes on: never ENOSPC, never a half-applied batch failing the filesystem.
#[test]
fn batches_overwriting_pages_commit_when_frees_wait_and_never_fail() {
    let (_image, _log, mut fs, db, _other, _old) = recorded();
    let free = fs.statfs().free_blocks;
    let rounds = free; // each batch pins 3 blocks: the shard fills several times over
    for n in 0..rounds as u32 {
        let writes = vec![
            (0, bytes(4096, n)),
            (4096 * 3, bytes(4096, n + 1)),
            (4096 * 5 + 24, bytes(100, n + 2)),
        ];
        fs.write_atomic(db, &writes)
            .unwrap_or_else(|e| panic!("batch {n} of {rounds}: {e}"));
    }
    assert!(fs.commit_stats().commits >= 1);
    assert_eq!(fs.reservation_overrun_blocks(), 0);
    fs.check().unwrap();
}
