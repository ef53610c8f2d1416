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
        fs.write_lent(a, 0, &first).expect("runs lent").unwrap(),
        10_000
    );
    // Appending from the unaligned end reads the block under it, which the write above
    // left in the block cache (a WAL's or a log's appends): it runs lent too.
    let reads_before = fs.read_stats().device_reads;
    assert_eq!(
        fs.write_lent(a, 10_000, b"more")
            .expect("the edge block is cached")
            .unwrap(),
        4
    );
    // So does a write inside the file over a cached block in part.
    assert_eq!(
        fs.write_lent(a, 100, b"x").expect("cached edge").unwrap(),
        1
    );
    assert_eq!(fs.read_stats().device_reads, reads_before, "no device read");
    // Whole blocks inside the file, and a write past the end with a gap, run.
    assert!(fs.write_lent(a, 4096, &[7u8; 4096]).unwrap().is_ok());
    assert!(fs.write_lent(a, 20_000, b"far").unwrap().is_ok());
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
        match fs.write_lent(a, at, &big) {
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
    assert!(fs.write_lent(a, 200, b"y").is_none());
    assert!(fs.write_lent(a, 10_002, b"yy").is_none());
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
    fs.write_lent(a, 0, &bytes).expect("runs lent").unwrap();
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
        match fs.write_lent(a, offset, &data) {
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
                    let written = match fs.write_lent(ino, offset, &data) {
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
                    let got = match fs.read_lent(ino, offset, len) {
                        Some(result) => {
                            lent_reads += 1;
                            result
                        }
                        None => fs.read(ino, offset, len),
                    }
                    .unwrap_or_else(|e| panic!("{ctx}: read: {e}"));
                    let model = &models[f];
                    let from = (offset as usize).min(model.len());
                    let to = (offset as usize).saturating_add(len).min(model.len());
                    assert!(got == model[from..to], "{ctx}: read {len} at {offset}");
                }
                85..=94 => {
                    fs.fsync(ino).unwrap();
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
    fs.write_lent(a, 0, &[1u8; 7 * 4096])
        .expect("runs lent")
        .unwrap();
    assert_eq!(fs.staged_bytes(), 7 * 4096);
    // From inside block 7 (at the end of the file: nothing to read) into block 8.
    assert!(fs.write_lent(a, 8 * 4096 - 50, &[2u8; 100]).is_none());
    // The owner runs it (and starts the write-back).
    fs.write(a, 8 * 4096 - 50, &[2u8; 100]).unwrap();
    let mut model = vec![1u8; 7 * 4096];
    model.resize(8 * 4096 - 50, 0);
    model.extend_from_slice(&[2u8; 100]);
    assert_eq!(fs.read(a, 0, 10 * 4096).unwrap(), model);
}
