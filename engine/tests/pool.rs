//! One pool of space: a file or a directory may use all the free space there is, whatever
//! shard it lives in, and everything deleted comes back.
//!
//! Shaped as users hit the old limit (each shard confined to 1/64 of the device: a 100 MB
//! file on a fresh 1 GiB image stopped at 14 MiB): one large file, one large directory, a
//! mix of both and of small files filled to ENOSPC and deleted, on default filesystems.
//! The million-name directory takes minutes and runs from `scripts/big-tests.sh` (it is
//! listed as ignored here, never skipped silently). `COREFS_SEED` replays the name layout.

use engine::fs::StatFs;
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};

fn mkfs(bytes: u64, shards: u32) -> Filesystem {
    let dev = MemDevice::new(MemConfig {
        capacity_bytes: bytes,
        queue_depth: 64,
        buf_bytes: 1 << 20,
        buf_count: 32,
        ..Default::default()
    })
    .unwrap();
    let options = MkfsOptions {
        shards,
        ..Default::default()
    };
    let dev =
        Filesystem::mkfs_seeded(Box::new(dev), &options, nvme::wrap::seed_from_env()).unwrap();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

fn remount(fs: Filesystem) -> Filesystem {
    Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap()
}

/// A MiB of data that differs from MiB to MiB.
fn mib(i: u64) -> Vec<u8> {
    let mut out = vec![0u8; 1 << 20];
    for (b, chunk) in out.chunks_mut(4096).enumerate() {
        chunk[..8].copy_from_slice(&i.to_le_bytes());
        chunk[8..16].copy_from_slice(&(b as u64).to_le_bytes());
    }
    out
}

/// Writes MiBs into `ino` from `from` until ENOSPC; returns how many went in. Every
/// refusal is ENOSPC with the filesystem still writable.
fn fill_file(fs: &mut Filesystem, ino: u64, from: u64) -> u64 {
    let mut i = from;
    loop {
        match fs.write(ino, i << 20, &mib(i)) {
            Ok(_) => i += 1,
            Err(EngineError::NoSpace) => return i - from,
            Err(e) => panic!("MiB {i}: {e}"),
        }
        assert_eq!(fs.failure(), None);
    }
}

/// Creates empty files `prefix0`, `prefix1`... in `dir` until ENOSPC; returns how many.
fn fill_dir(fs: &mut Filesystem, dir: u64, prefix: &str) -> u64 {
    let mut n = 0u64;
    loop {
        match fs.create(dir, format!("{prefix}{n}").as_bytes(), 0o644, 0, 0) {
            Ok(_) => n += 1,
            Err(EngineError::NoSpace) => return n,
            Err(e) => panic!("{prefix}{n}: {e}"),
        }
        assert_eq!(fs.failure(), None);
    }
}

fn names(fs: &mut Filesystem, dir: u64) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut cookie = 0;
    loop {
        let batch = fs.readdir(dir, cookie, 1024).unwrap();
        let Some(last) = batch.last() else { break };
        cookie = last.cookie;
        out.extend(batch.into_iter().map(|e| e.name));
    }
    out
}

/// What statfs says is free has come back to `start`'s within 1% of the device.
fn assert_back(fs: &Filesystem, start: &StatFs) {
    let now = fs.statfs();
    let slack = start.total_blocks / 100;
    assert!(
        now.free_blocks + slack >= start.free_blocks,
        "free {} blocks after deleting everything, {} at the start (of {})\n{:?}",
        now.free_blocks,
        start.free_blocks,
        start.total_blocks,
        fs.space_pool().stats()
    );
}

/// A fresh default 1 GiB filesystem (64 shards): one file takes ≥ 95% of the space statfs
/// showed, in a region that held 1/64 of it before. ENOSPC comes exactly when the pool has
/// no group left that data may take and the file's shard has no room of its own, and
/// statfs then says (nearly) nothing is free. After a remount the file reads back; deleted,
/// every block comes back.
#[test]
fn one_file_fills_a_fresh_default_image() {
    let mut fs = mkfs(1 << 30, 64);
    let start = fs.statfs();
    let root = fs.root();
    let ino = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    let mut written = 0;
    // MiB writes, an fsync now and then as a database does.
    loop {
        let got = fill_file(&mut fs, ino, written);
        written += got;
        if got == 0 {
            break;
        }
        fs.fsync(ino).unwrap();
    }
    let pool = fs.space_pool().stats();
    assert!(
        written * 256 * 100 >= start.free_blocks * 95,
        "{written} MiB of {} MiB free",
        start.free_blocks / 256
    );
    // Exactly when the pool is empty: no group data may take is left...
    assert!(
        pool.free_blocks < pool.reserve_blocks + pool.group_blocks,
        "ENOSPC with groups left: {pool:?}"
    );
    // ...and statfs no longer promises what a file cannot get.
    let end = fs.statfs();
    assert!(
        end.free_blocks * 100 <= end.total_blocks,
        "ENOSPC while statfs says {} of {} blocks are free",
        end.free_blocks,
        end.total_blocks
    );
    eprintln!(
        "one file: {written} MiB of {} MiB free at the start; {} groups taken",
        start.free_blocks / 256,
        pool.taken
    );
    let mut fs = remount(fs);
    fs.check().unwrap();
    for i in [0, written / 2, written - 1] {
        assert_eq!(fs.read(ino, i << 20, 1 << 20).unwrap(), mib(i), "MiB {i}");
    }
    let root = fs.root();
    fs.unlink(root, b"big").unwrap();
    fs.sync().unwrap();
    assert_back(&fs, &start);
    let mut fs = remount(fs);
    fs.check().unwrap();
    assert_back(&fs, &start);
}

/// One directory takes all the tree space there is: on a 64 MiB image of 4 shards (a region
/// of 16 MiB each before, where the directory's names had to fit), empty files in one
/// directory until ENOSPC use ≥ 95% of the blocks statfs showed free, and deleting them
/// gives every block back.
#[test]
fn one_directory_fills_the_image_with_names() {
    let mut fs = mkfs(64 << 20, 4);
    let start = fs.statfs();
    let root = fs.root();
    let dir = fs.mkdir(root, b"many", 0o755, 0, 0).unwrap().ino;
    let count = fill_dir(&mut fs, dir, "name-with-a-few-more-bytes-");
    let end = fs.statfs();
    let used = start.free_blocks - end.free_blocks;
    eprintln!(
        "one directory: {count} names, {used} of {} free blocks used",
        start.free_blocks
    );
    assert!(
        used * 100 >= start.free_blocks * 95,
        "{count} names used {used} of {} free blocks",
        start.free_blocks
    );
    let mut fs = remount(fs);
    fs.check().unwrap();
    let listed = names(&mut fs, dir);
    assert_eq!(listed.len() as u64, count);
    for name in listed {
        fs.unlink(dir, &name).unwrap();
    }
    let root = fs.root();
    fs.rmdir(root, b"many").unwrap();
    fs.sync().unwrap();
    assert_back(&fs, &start);
    let mut fs = remount(fs);
    fs.check().unwrap();
}

/// The users' mix on a fresh default 1 GiB filesystem: a large file, small files spread
/// over directories and a large directory, each filled until ENOSPC, then a second round of
/// the large file (space the others left). Everything deleted (with a full filesystem's
/// removals) gives every block back: statfs within 1% of the start, the checker clean.
#[test]
fn a_mixed_fill_to_enospc_gives_every_block_back() {
    let mut fs = mkfs(1 << 30, 64);
    let start = fs.statfs();
    let root = fs.root();
    let big = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    // The large file takes half the device.
    let half = start.free_blocks / 256 / 2;
    for i in 0..half {
        fs.write(big, i << 20, &mib(i)).unwrap();
    }
    fs.sync().unwrap();
    // Small files of 1 to 16 blocks, in 8 directories, until ENOSPC.
    let dirs: Vec<u64> = (0..8)
        .map(|d| {
            fs.mkdir(root, format!("d{d}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    let mut small = 0u64;
    'small: loop {
        let dir = dirs[small as usize % dirs.len()];
        let st = match fs.create(dir, format!("s{small}").as_bytes(), 0o644, 0, 0) {
            Ok(st) => st,
            Err(EngineError::NoSpace) => break 'small,
            Err(e) => panic!("{e}"),
        };
        let len = 4096 * (1 + small % 16) as usize;
        match fs.write(st.ino, 0, &mib(small)[..len]) {
            Ok(_) => {}
            Err(EngineError::NoSpace) => break 'small,
            Err(e) => panic!("{e}"),
        }
        small += 1;
        if small % 500 == 0 {
            fs.sync().unwrap();
        }
    }
    // A large directory, and whatever the large file can still get.
    let many = fs.mkdir(root, b"many", 0o755, 0, 0).unwrap().ino;
    let names_made = fill_dir(&mut fs, many, "n");
    let more = fill_file(&mut fs, big, half);
    let full = fs.statfs();
    eprintln!(
        "mix: {half} + {more} MiB file, {small} small files, {names_made} names; free {} of {} \
         blocks at the start, {} at the end",
        start.free_blocks, start.total_blocks, full.free_blocks
    );
    // The names the large directory still gets depend on where its shard's space stands
    // when the small files hit ENOSPC (seeded): 871 to 4,192 over a dozen seeds, so a floor
    // of 1,000 failed one seed in ten (1796504314958776498: 871) before and after the
    // session that found it. What matters is that a full filesystem still takes hundreds.
    assert!(
        small > 1000 && names_made > 500,
        "{small} small files, {names_made} names"
    );
    // What the other shards' partly used groups hold is all statfs still counts.
    assert!(
        full.free_blocks * 100 <= full.total_blocks * 2,
        "full, yet statfs says {} blocks free",
        full.free_blocks
    );
    let mut fs = remount(fs);
    fs.check().unwrap();
    let root = fs.root();
    for dir in ["d0", "d1", "d2", "d3", "d4", "d5", "d6", "d7", "many"] {
        let ino = fs.lookup(root, dir.as_bytes()).unwrap().ino;
        for name in names(&mut fs, ino) {
            fs.unlink(ino, &name)
                .unwrap_or_else(|e| panic!("unlink in {dir} of a full filesystem: {e}"));
        }
        fs.rmdir(root, dir.as_bytes()).unwrap();
    }
    fs.unlink(root, b"big").unwrap();
    fs.sync().unwrap();
    assert_back(&fs, &start);
    let mut fs = remount(fs);
    fs.check().unwrap();
    assert_back(&fs, &start);
    assert_eq!(fs.statfs().inodes, 1, "the root alone");
}

/// A million empty files in one directory (1 GiB image, default shards). Minutes in a
/// debug build: `scripts/big-tests.sh` runs it in release.
#[test]
#[ignore = "a million files: scripts/big-tests.sh runs it"]
fn a_million_names_in_one_directory() {
    let mut fs = mkfs(1 << 30, 64);
    let root = fs.root();
    let dir = fs.mkdir(root, b"million", 0o755, 0, 0).unwrap().ino;
    let started = std::time::Instant::now();
    for i in 0..1_000_000u32 {
        fs.create(dir, format!("file-{i:07}").as_bytes(), 0o644, 0, 0)
            .unwrap_or_else(|e| panic!("file {i}: {e}"));
        if i % 100_000 == 99_999 {
            fs.sync().unwrap();
        }
    }
    fs.sync().unwrap();
    eprintln!(
        "a million names in {:.1} s; statfs {:?}",
        started.elapsed().as_secs_f64(),
        fs.statfs()
    );
    let mut fs = remount(fs);
    fs.check().unwrap();
    assert_eq!(names(&mut fs, dir).len(), 1_000_000);
    assert!(fs.lookup(dir, b"file-0999999").is_ok());
}
