//! What a thread the engine is lent to may run (`Filesystem::read_lent`,
//! `Filesystem::write_lent`: a client while its reactor sleeps), and what it must leave to the
//! owner untouched. The device asserts on any use of its queue while lent, so a path that
//! reached it would panic here.

use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};

fn fresh(options: MountOptions) -> Filesystem {
    fresh_sized(64 << 20, 2, options)
}

/// A fresh filesystem of `shards` shards on a memory device of `capacity_bytes`, mounted.
fn fresh_sized(capacity_bytes: u64, shards: u32, options: MountOptions) -> Filesystem {
    let config = MemConfig {
        capacity_bytes,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 64,
    };
    let mkfs = MkfsOptions {
        shards,
        label: "lent".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(MemDevice::new(config).unwrap()), &mkfs).unwrap();
    Filesystem::mount(dev, options).unwrap()
}

/// Writes that only stage run lent and read back as written, through a commit and a
/// remount; writes that would read an edge block from the device, or start write-back, are
/// left to the owner with nothing changed.
#[test]
fn a_lent_write_stages_its_bytes_or_leaves_the_write_untouched() {
    let mut fs = fresh(MountOptions::default());
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    // A new file, from 0 to an unaligned end: its tail block lies past the end.
    let first: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(
        fs.write_lent(a, 0, engine::Staged::copy_of(&first))
            .expect("runs lent")
            .unwrap(),
        10_000
    );
    // Appending from the unaligned end reads the block under it, which the write above
    // left in the block cache (a WAL's or a log's appends): it runs lent too.
    let reads_before = fs.read_stats().device_reads;
    assert_eq!(
        fs.write_lent(a, 10_000, engine::Staged::copy_of(b"more"))
            .expect("the edge block is cached")
            .unwrap(),
        4
    );
    // So does a write inside the file over a cached block in part.
    assert_eq!(
        fs.write_lent(a, 100, engine::Staged::copy_of(b"x"))
            .expect("cached edge")
            .unwrap(),
        1
    );
    assert_eq!(fs.read_stats().device_reads, reads_before, "no device read");
    // Whole blocks inside the file, and a write past the end with a gap, run.
    assert!(fs
        .write_lent(a, 4096, engine::Staged::copy_of(&[7u8; 4096]))
        .unwrap()
        .is_ok());
    assert!(fs
        .write_lent(a, 20_000, engine::Staged::copy_of(b"far"))
        .unwrap()
        .is_ok());
    let mut model = first.clone();
    model.extend_from_slice(b"more");
    model[100] = b'x';
    model[4096..8192].fill(7);
    model.resize(20_000, 0);
    model.extend_from_slice(b"far");
    assert_eq!(fs.read(a, 0, 30_000).unwrap(), model);
    assert_eq!(fs.fetch_stats().lent_writes, 5);

    // Write-back would start: a lent write does not start it.
    let big = vec![9u8; 1 << 20];
    let mut at = 1 << 20;
    let mut declined = false;
    for _ in 0..64 {
        match fs.write_lent(a, at, engine::Staged::copy_of(&big)) {
            Some(result) => {
                result.unwrap();
                model.resize(at as usize, 0);
                model.extend_from_slice(&big);
                at += 1 << 20;
            }
            None => {
                declined = true;
                break;
            }
        }
    }
    assert!(
        declined,
        "staging never filled up to the write-back threshold"
    );
    assert!(fs.staged_bytes() > 0);

    fs.commit().unwrap();
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    // After the remount the cache is empty: a write over part of a block inside the file
    // would read it from the device, the owner's queue. Declined, nothing changed.
    let stat = fs.stat(a).unwrap();
    assert!(fs
        .write_lent(a, 200, engine::Staged::copy_of(b"y"))
        .is_none());
    assert!(fs
        .write_lent(a, 10_002, engine::Staged::copy_of(b"yy"))
        .is_none());
    assert_eq!(
        fs.stat(a).unwrap(),
        stat,
        "a declined write changed nothing"
    );
    assert_eq!(fs.read(a, 0, model.len() + 10).unwrap(), model);
    fs.check().expect("a consistent filesystem");
}

/// A write the owner's log makes durable after it ran lent: an fsync record covers it, and
/// replay after a crash (no commit) brings it back.
#[test]
fn an_fsync_after_a_lent_write_makes_it_durable() {
    let mut fs = fresh(MountOptions::default());
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.commit().unwrap();
    let bytes: Vec<u8> = (0..12_345u32).map(|i| (i * 7 % 251) as u8).collect();
    fs.write_lent(a, 0, engine::Staged::copy_of(&bytes))
        .expect("runs lent")
        .unwrap();
    fs.fsync(a).unwrap();
    // A crash: the device as it is, nothing more written.
    let dev = fs.into_device();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    assert_eq!(fs.read(a, 0, 20_000).unwrap(), bytes);
}

/// A write refused for space runs nowhere lent: it goes to the owner untouched (the owner
/// commits, which unpins what earlier writes freed, and tries again), and the filesystem
/// stays writable. A small device filled by overwrites whose old blocks stay pinned until a
/// commit.
#[test]
fn a_lent_write_refused_for_space_is_left_to_the_owner_untouched() {
    let mut fs = fresh_sized(16 << 20, 4, MountOptions::default());
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    let (mut lent, mut declined) = (0, 0);
    for i in 0..20_000u64 {
        let offset = (i % 64) * 65536;
        let data = vec![i as u8; 65536];
        match fs.write_lent(a, offset, engine::Staged::copy_of(&data)) {
            Some(result) => {
                result.unwrap_or_else(|e| panic!("write {i} ran lent and failed: {e}"));
                lent += 1;
            }
            None => {
                declined += 1;
                fs.write(a, offset, &data)
                    .unwrap_or_else(|e| panic!("write {i} by the owner: {e}"));
            }
        }
        if i % 16 == 15 {
            fs.fsync(a).unwrap();
        }
    }
    let no_space = fs.fetch_stats().lent_no_space;
    assert!(
        lent > 0 && no_space > 0,
        "{lent} ran lent, {declined} declined, {no_space} of them for space"
    );
    assert_eq!(
        fs.read(a, 0, 4096).unwrap(),
        vec![(19_968u64 % 256) as u8; 4096]
    );
}

/// The class, generated: lent writes and reads of random ranges (unaligned, across block
/// boundaries, past the end, over holes) mixed with the owner's writes, fsyncs and commits,
/// with the data cache on and off. A lent run that reached the device's queue would panic
/// (the device asserts); every read must return the model's bytes, lent or not, and so must
/// the file after a remount. Seeded (`COREFS_SEED`); the seed is printed.
#[test]
fn random_lent_writes_and_reads_match_the_model() {
    use rand::{Rng, SeedableRng};
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    // Tight staging bounds too: write-back would start after a few writes, so a lent write
    // that misjudged what it stages (an unaligned write across a block boundary stages one
    // block more than its length rounded up) reaches the queue.
    let configs = [
        (0, 8 << 20, engine::writeback::STAGED_PARK_BYTES),
        (
            engine::writeback::CACHE_BLOCKS,
            8 << 20,
            engine::writeback::STAGED_PARK_BYTES,
        ),
        (0, 32 << 10, 256 << 10),
        (engine::writeback::CACHE_BLOCKS, 32 << 10, 256 << 10),
    ];
    for (cache, writeback_start_bytes, staged_park_bytes) in configs {
        let mut fs = fresh(MountOptions {
            data_cache_blocks: cache,
            writeback_start_bytes,
            staged_park_bytes,
            ..MountOptions::default()
        });
        let root = fs.root();
        let files: Vec<u64> = (0..3)
            .map(|i| {
                fs.create(root, format!("f{i}").as_bytes(), 0o644, 0, 0)
                    .unwrap()
                    .ino
            })
            .collect();
        let mut models: Vec<Vec<u8>> = vec![Vec::new(); files.len()];
        let (mut lent_writes, mut lent_reads) = (0u64, 0u64);
        for step in 0..8000u32 {
            let f = rng.random_range(0..files.len());
            let ino = files[f];
            let ctx = format!(
                "seed {seed}, cache {cache}, write-back from {writeback_start_bytes}, step {step}, \
                 file {f}"
            );
            match rng.random_range(0..100) {
                0..=44 => {
                    let size = models[f].len() as u64;
                    let offset = match rng.random_range(0..3) {
                        0 => size,
                        1 => rng.random_range(0..size + 1),
                        _ => rng.random_range(0..size + 20_000),
                    };
                    let len = match rng.random_range(0..4) {
                        0 => 4096,
                        1 => rng.random_range(1..200),
                        2 => rng.random_range(1..20_000),
                        _ => rng.random_range(1..200_000),
                    };
                    let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                    let written = match fs.write_lent(ino, offset, engine::Staged::copy_of(&data)) {
                        Some(result) => {
                            lent_writes += 1;
                            result
                        }
                        None => fs.write(ino, offset, &data),
                    };
                    assert_eq!(written.unwrap_or_else(|e| panic!("{ctx}: {e}")), len);
                    let model = &mut models[f];
                    let end = offset as usize + len;
                    if model.len() < end {
                        model.resize(end, 0);
                    }
                    model[offset as usize..end].copy_from_slice(&data);
                }
                45..=84 => {
                    let size = models[f].len() as u64;
                    let offset = rng.random_range(0..size + 5000);
                    let len = rng.random_range(0..70_000);
                    // Into a buffer of the caller's (holding anything: holes and
                    // preallocated ranges must come back as zeroes), or a new one.
                    let into = rng.random_range(0..3);
                    let mut buf = vec![rng.random::<u8>() | 1; len];
                    let lent = match into {
                        0 => fs.read_lent(ino, offset, len),
                        1 => fs
                            .read_memory_into(ino, offset, &mut buf, true)
                            .map(|r| r.map(|n| buf[..n].to_vec())),
                        _ => fs
                            .read_memory_into(ino, offset, &mut buf, false)
                            .map(|r| r.map(|n| buf[..n].to_vec())),
                    };
                    let got = match lent {
                        Some(result) => {
                            lent_reads += 1;
                            result
                        }
                        None => fs.read(ino, offset, len),
                    }
                    .unwrap_or_else(|e| panic!("{ctx}: read ({into}): {e}"));
                    let model = &models[f];
                    let from = (offset as usize).min(model.len());
                    let to = (offset as usize).saturating_add(len).min(model.len());
                    assert!(got == model[from..to], "{ctx}: read {len} at {offset}");
                }
                85..=89 => {
                    fs.fsync(ino).unwrap();
                }
                90..=94 => {
                    // Preallocated space, inside the file or past its end (kept size):
                    // reads of it are zeroes until written.
                    let size = models[f].len() as u64;
                    let offset = rng.random_range(0..size + 20_000);
                    let len = rng.random_range(1..100_000);
                    let keep_size = rng.random();
                    let mode = engine::FallocateMode {
                        keep_size,
                        ..Default::default()
                    };
                    fs.fallocate(ino, mode, offset, len)
                        .unwrap_or_else(|e| panic!("{ctx}: fallocate: {e}"));
                    let end = (offset + len) as usize;
                    if !keep_size && models[f].len() < end {
                        models[f].resize(end, 0);
                    }
                }
                _ => {
                    fs.commit().unwrap();
                }
            }
        }
        assert!(
            lent_writes > 0 && lent_reads > 0,
            "seed {seed}, cache {cache}: {lent_writes} lent writes, {lent_reads} lent reads"
        );
        let dev = fs.unmount().unwrap();
        let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
        for (f, &ino) in files.iter().enumerate() {
            let model = &models[f];
            assert!(
                fs.read(ino, 0, model.len() + 1).unwrap() == *model,
                "seed {seed}, cache {cache}: file {f} after the remount"
            );
        }
        fs.check().expect("a consistent filesystem");
    }
}

/// What a lent write stages is every block it covers: 100 bytes across a block boundary
/// stage two blocks. With staging one block under the write-back threshold such a write is
/// the owner's (run lent, it would start the write-back and reach the device's queue).
#[test]
fn a_lent_write_counts_every_block_it_covers_against_the_write_back_threshold() {
    let mut fs = fresh(MountOptions {
        writeback_start_bytes: 32 << 10,
        staged_park_bytes: 256 << 10,
        ..MountOptions::default()
    });
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write_lent(a, 0, engine::Staged::copy_of(&[1u8; 7 * 4096]))
        .expect("runs lent")
        .unwrap();
    assert_eq!(fs.staged_bytes(), 7 * 4096);
    // From inside block 7 (at the end of the file: nothing to read) into block 8.
    assert!(fs
        .write_lent(a, 8 * 4096 - 50, engine::Staged::copy_of(&[2u8; 100]))
        .is_none());
    // The owner runs it (and starts the write-back).
    fs.write(a, 8 * 4096 - 50, &[2u8; 100]).unwrap();
    let mut model = vec![1u8; 7 * 4096];
    model.resize(8 * 4096 - 50, 0);
    model.extend_from_slice(&[2u8; 100]);
    assert_eq!(fs.read(a, 0, 10 * 4096).unwrap(), model);
}

/// A filesystem with one file `a` (committed) on a recording memory device, and the image
/// the recording starts from: crash states are that image with a prefix of the log applied.
fn recorded(
    options: MountOptions,
) -> (
    Filesystem,
    u64,
    Vec<u8>,
    std::sync::Arc<nvme::wrap::WriteLog>,
) {
    const CAPACITY: usize = 64 << 20;
    let mut fs = fresh(MountOptions::default());
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.commit().unwrap();
    let mut dev = fs.into_device();
    let mut base = vec![0u8; CAPACITY];
    dev.sim_access()
        .expect("a memory device")
        .sim_read(0, &mut base);
    let recording = nvme::wrap::RecordingDevice::new(dev);
    let log = recording.log();
    let fs = Filesystem::mount(Box::new(recording), options).unwrap();
    (fs, a, base, log)
}

/// The filesystem a power cut leaves after every record logged so far, keeping only what
/// flushes and FUA writes made durable.
fn crashed(base: &[u8], log: &nvme::wrap::WriteLog) -> Filesystem {
    use nvme::wrap::crash::{crash_image, CrashMode};
    let records = log.snapshot();
    let image = crash_image(base, 4096, &records, records.len(), CrashMode::DurableOnly);
    let config = MemConfig {
        capacity_bytes: image.len() as u64,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 64,
    };
    let dev = MemDevice::from_image(&image, config).unwrap();
    Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap()
}

/// An fsync as a client runs it: the record built on the lent engine, then written beside
/// the queue through the caller's own handle. `None`: declined, the owner's.
fn fsync_as_caller(fs: &mut Filesystem, ino: u64, datasync: bool) -> Option<engine::Result<()>> {
    let mut io = fs
        .side_io()
        .expect("a memory device writes beside its queue");
    Some(match fs.fsync_beside(&[(ino, datasync)])? {
        Ok(Some(record)) => record.run(io.as_mut()).0,
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    })
}

/// An fsync run by a caller writes its record beside the device's queue and is durable
/// when it returns: a power cut right then keeps the data it covered (a small record
/// carrying its data, then a large one writing 64 KiB in place), with no queue use (the
/// device asserts on any).
#[test]
fn an_fsync_run_by_a_caller_is_durable_when_it_returns() {
    let (mut fs, a, base, log) = recorded(MountOptions::default());
    let small: Vec<u8> = (0..12_345u32).map(|i| (i * 7 % 251) as u8).collect();
    fs.write(a, 0, &small).unwrap();
    fsync_as_caller(&mut fs, a, true)
        .expect("runs in the caller")
        .unwrap();
    assert_eq!(fs.fetch_stats().lent_fsyncs, 1);
    assert_eq!(crashed(&base, &log).read(a, 0, 1 << 20).unwrap(), small);

    // Past EMBED_MAX_BLOCKS: the data goes in place beside the record.
    let large: Vec<u8> = (0..65_536u32).map(|i| (i * 13 % 253) as u8).collect();
    fs.write(a, 4096, &large).unwrap();
    let writes = |log: &nvme::wrap::WriteLog| {
        log.snapshot()
            .iter()
            .filter(|r| matches!(r, nvme::wrap::Record::Write { .. }))
            .count()
    };
    let writes_before = writes(&log);
    fsync_as_caller(&mut fs, a, false)
        .expect("runs in the caller")
        .unwrap();
    // The memory device has native FUA: every write FUA, no flush (a file image flushes).
    assert!(
        writes(&log) >= writes_before + 2,
        "the data in place and the record"
    );
    let mut want = small.clone();
    want.resize(4096, 0);
    want.extend_from_slice(&large);
    assert_eq!(crashed(&base, &log).read(a, 0, 1 << 20).unwrap(), want);
    assert!(fs.device_wait_stats().lent_writes >= 2);
    fs.check().expect("a consistent filesystem");
}

/// An fsync a lent engine cannot finish alone is left to the owner with nothing written
/// and nothing counted: one with a record still in flight on the queue (a write beside the
/// queue would not be ordered against it), and one with more data to write in place than a
/// caller may while its reactor waits.
#[test]
fn an_fsync_that_needs_the_queue_or_much_writing_is_left_to_the_owner() {
    let options = MountOptions {
        // Staged data stays staged until its fsync.
        writeback_start_bytes: usize::MAX,
        ..MountOptions::default()
    };
    let (mut fs, a, _base, log) = recorded(options);
    fs.write(a, 0, &[1u8; 5000]).unwrap();
    let started = fs.fsync_group_start(&[(a, false)]).unwrap();
    assert!(matches!(started, engine::log::FsyncStart::Pending(_)));
    fs.write(a, 0, &[2u8; 5000]).unwrap();
    let logged = log.len();
    assert!(
        fsync_as_caller(&mut fs, a, false).is_none(),
        "a record in flight: the owner's"
    );
    assert_eq!(log.len(), logged, "nothing written");
    fs.drain_log().unwrap();

    let big = vec![3u8; engine::log::LENT_FSYNC_BYTES_MAX * 2];
    fs.write(a, 0, &big).unwrap();
    assert!(!fs.device_busy());
    let (fsyncs, logged) = (fs.log_stats().fsyncs, log.len());
    assert!(
        fsync_as_caller(&mut fs, a, false).is_none(),
        "more than LENT_FSYNC_BYTES_MAX in place: the owner's"
    );
    assert_eq!(log.len(), logged, "nothing written");
    assert_eq!(fs.log_stats().fsyncs, fsyncs, "nothing counted");
    assert_eq!(fs.fetch_stats().lent_fsyncs_declined, 1);
    assert_eq!(fs.fetch_stats().lent_fsyncs, 0);
    fs.fsync(a).unwrap();
    assert_eq!(fs.read(a, 0, 1 << 20).unwrap(), big);
}

/// While a caller's record is being written beside the queue (built, the engine given
/// back, not yet written): the owner reads the file's new bytes from memory, another
/// caller's fsync goes to the owner (the queue is not idle), the owner's own fsync waits
/// for it in order, and the next caller's fsync counts its completions and runs. A record
/// dropped unwritten (a caller that panicked) fails the filesystem instead of hanging it.
#[test]
fn a_record_written_beside_the_queue_is_counted_by_whoever_holds_the_engine_next() {
    let (mut fs, a, base, log) = recorded(MountOptions::default());
    let root = fs.root();
    let b = fs.create(root, b"b", 0o644, 0, 0).unwrap().ino;
    let mut io = fs.side_io().unwrap();
    fs.write(a, 0, &[7u8; 6000]).unwrap();
    let record = fs
        .fsync_beside(&[(a, false)])
        .expect("runs in the caller")
        .unwrap()
        .expect("something to log");
    assert_eq!(fs.log_in_flight(), 1, "the record is in flight");
    assert!(
        !fs.device_busy(),
        "not on the queue: nothing for its owner to poll"
    );
    assert_eq!(fs.read(a, 0, 6000).unwrap(), vec![7u8; 6000]);
    fs.write(b, 0, &[8u8; 100]).unwrap();
    assert!(fsync_as_caller(&mut fs, b, false).is_none(), "not idle");
    let started = fs.fsync_group_start(&[(b, false)]).unwrap();
    let engine::log::FsyncStart::Pending(ticket) = started else {
        panic!("{started:?}")
    };
    assert_eq!(
        fs.log_progress(None).unwrap(),
        ticket - 1,
        "behind the caller's"
    );
    let (written, _) = record.run(io.as_mut());
    written.unwrap();
    fs.wait_durable(ticket).unwrap();
    let crashed_fs = &mut crashed(&base, &log);
    assert_eq!(crashed_fs.read(a, 0, 6000).unwrap(), vec![7u8; 6000]);
    assert_eq!(crashed_fs.read(b, 0, 100).unwrap(), vec![8u8; 100]);

    fs.write(a, 0, &[9u8; 10]).unwrap();
    let record = fs
        .fsync_beside(&[(a, true)])
        .expect("idle again")
        .unwrap()
        .expect("something to log");
    record.run(io.as_mut()).0.unwrap();
    fs.write(a, 0, &[10u8; 10]).unwrap();
    fsync_as_caller(&mut fs, a, true)
        .expect("the last record's completions counted first")
        .unwrap();
    assert_eq!(fs.fetch_stats().lent_fsyncs, 3);

    fs.write(a, 0, &[11u8; 10]).unwrap();
    let record = fs.fsync_beside(&[(a, true)]).unwrap().unwrap().unwrap();
    drop(record);
    assert!(fs.log_progress(None).is_err(), "fail-stop");
    assert!(
        fs.write(a, 0, &[12u8; 10]).is_err(),
        "read-only after the failure"
    );
}
