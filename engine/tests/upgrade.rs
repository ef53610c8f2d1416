//! Format upgrades: a filesystem written by an older corefs mounts, replays what its crash
//! left in the logs, and is rewritten in this format before anything new is logged.
//!
//! The image is a real one: `fixtures/v4-crashed.cfsimg` was written by corefs 8ee9508
//! (format version 4: fixed shard regions, one space bitmap item per 4096-block chunk of a
//! region) with the program in `fixtures/README.md`, and left as a power cut leaves it: three
//! fsyncs logged after the last commit, one of them with its data in place beside the
//! record. Version 3 differs from 4 only in log records this image does not use, so the same
//! image stamped version 3 stands for one.

use engine::format::{Superblock, SUPERBLOCK_ADDRS};
use engine::{EngineError, Filesystem, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;

/// Inodes of the fixture (the generator printed them).
const SMALL: u64 = 257;
const D: u64 = 258;
const BIG: u64 = 259;
const LOGGED: u64 = 261;

/// The generator's data pattern: zeros but for the first 16 bytes and the last of every
/// block.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| match i % 4096 {
            o @ 0..16 => (o as u8).wrapping_mul(31).wrapping_add(seed) ^ (i / 4096) as u8 | 1,
            4095 => seed | 1,
            _ => 0,
        })
        .collect()
}

/// The fixture, unpacked: "CFSIMG1\0", capacity u64; per non-zero block its index u64 and
/// runs (zeros u16, literal length u16, literal bytes) covering its 4096 bytes; index
/// u64::MAX ends it.
fn fixture() -> Vec<u8> {
    let packed = include_bytes!("fixtures/v4-crashed.cfsimg");
    assert_eq!(&packed[..8], b"CFSIMG1\0");
    let u64_at = |at: usize| u64::from_le_bytes(packed[at..at + 8].try_into().unwrap());
    let u16_at = |at: usize| u16::from_le_bytes(packed[at..at + 2].try_into().unwrap()) as usize;
    let mut image = vec![0u8; u64_at(8) as usize];
    let mut at = 16;
    loop {
        let block = u64_at(at);
        at += 8;
        if block == u64::MAX {
            break;
        }
        let mut off = block as usize * 4096;
        let end = off + 4096;
        while off < end {
            let (zeros, lits) = (u16_at(at), u16_at(at + 2));
            at += 4;
            off += zeros;
            image[off..off + lits].copy_from_slice(&packed[at..at + lits]);
            at += lits;
            off += lits;
        }
    }
    image
}

fn config(bytes: usize) -> MemConfig {
    MemConfig {
        capacity_bytes: bytes as u64,
        ..Default::default()
    }
}

fn device(image: &[u8]) -> Box<dyn BlockDevice> {
    Box::new(MemDevice::from_image(image, config(image.len())).unwrap())
}

fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut out = vec![0u8; dev.info().capacity_bytes() as usize];
    nvme::read_sync(&mut *dev, 0, &mut out).unwrap();
    out
}

/// The newest valid superblock copy of `image` and its format version.
fn superblock(image: &[u8]) -> (Superblock, u32) {
    SUPERBLOCK_ADDRS
        .iter()
        .map(|&a| &image[a as usize * 4096..a as usize * 4096 + 4096])
        .filter_map(|b| {
            Superblock::decode(b, (image.len() / 4096) as u64)
                .ok()
                .map(|sb| (sb, Superblock::version_of(b)))
        })
        .max_by_key(|(sb, _)| sb.generation)
        .expect("a valid superblock")
}

/// `image` with both superblock copies stamped format version `version`.
fn with_format_version(image: &[u8], version: u32) -> Vec<u8> {
    let mut image = image.to_vec();
    for addr in SUPERBLOCK_ADDRS {
        let at = addr as usize * 4096;
        let block = &mut image[at..at + 4096];
        block[12..16].copy_from_slice(&version.to_le_bytes());
        let crc = engine::format::block_crc(block);
        block[0..4].copy_from_slice(&crc.to_le_bytes());
    }
    image
}

/// Everything the generator left, as the generator wrote it.
fn assert_contents(fs: &mut Filesystem) {
    let root = fs.root();
    assert_eq!(fs.lookup(root, b"d").unwrap().ino, D);
    assert_eq!(fs.lookup(D, b"small").unwrap().ino, SMALL);
    let mut small = b"hello from version 4\n".to_vec();
    small.resize(4096, 0);
    small.extend(pattern(3, 4096));
    assert_eq!(
        fs.read(SMALL, 0, 1 << 20).unwrap(),
        small,
        "the replayed block"
    );
    assert_eq!(fs.getxattr(SMALL, b"user.v").unwrap(), b"four");
    let link = fs.lookup(D, b"link").unwrap().ino;
    assert_eq!(fs.readlink(link).unwrap(), b"small");
    assert!(matches!(
        fs.lookup(root, b"gone"),
        Err(EngineError::NotFound)
    ));
    // 5000 blocks across two of the old bitmap chunks; four marked, the rest zeros.
    assert_eq!(fs.stat(BIG).unwrap().size, 5000 * 4096);
    for b in 0..5000u64 {
        let got = fs.read(BIG, b * 4096, 4096).unwrap();
        if [0, 4095, 4096, 4999].contains(&b) {
            assert_eq!(got, pattern(b as u8, 4096), "big block {b}");
        } else {
            assert!(got.iter().all(|&x| x == 0), "big block {b}");
        }
    }
    let mut logged = pattern(7, 20 * 4096);
    logged.extend_from_slice(b"tail");
    assert_eq!(fs.lookup(root, b"logged").unwrap().ino, LOGGED);
    assert_eq!(
        fs.read(LOGGED, 0, 1 << 20).unwrap(),
        logged,
        "the replayed file"
    );
}

/// A version 3 or 4 filesystem left by a crash mounts: its logged fsyncs replay, its space
/// bitmap chunks become block groups of the shards that held them (the chunks no item
/// named are free for any shard), and mount commits the result in this version at once. The
/// upgraded filesystem checks clean, remounts, and its groups move: the big file's go back
/// to the pool when it is deleted, and another shard can take them.
#[test]
fn a_version_4_or_3_filesystem_left_by_a_crash_is_upgraded_at_mount() {
    let original = fixture();
    assert_eq!(superblock(&original).1, 4);
    for version in [4, 3] {
        let image = with_format_version(&original, version);
        let mut fs = Filesystem::mount(device(&image), MountOptions::default())
            .unwrap_or_else(|e| panic!("version {version}: {e}"));
        assert!(
            fs.log_stats().replayed_records >= 2,
            "version {version}: {:?}",
            fs.log_stats()
        );
        assert_contents(&mut fs);
        fs.check().unwrap();
        // Rewritten in this version by mount's commit, before anything was logged.
        let upgraded = image_of(fs.into_device());
        let (sb, v) = superblock(&upgraded);
        assert_eq!(v, engine::format::FORMAT_VERSION);
        assert_eq!(
            sb.group_blocks,
            engine::space::Geometry::auto_group_blocks(sb.data_area_blocks(), 2),
            "the groups mkfs gives a device of this size now"
        );
        let mut fs = Filesystem::mount(device(&upgraded), MountOptions::default()).unwrap();
        assert_eq!(fs.log_stats().replayed_records, 0);
        assert_contents(&mut fs);
        fs.check().unwrap();
        let big_shard = (BIG % 2) as usize;
        let space = fs.space_report();
        assert!(
            space[big_shard].groups.len() >= 2,
            "the big file's shard holds both chunks of its region: {space:?}"
        );
        let root = fs.root();
        fs.unlink(root, b"big").unwrap();
        fs.sync().unwrap();
        // The other shard now fills past its old region, into groups the big file emptied:
        // 10,000 blocks where a region holds 7,680.
        let other = fs.create(root, b"other", 0o644, 0, 0).unwrap().ino;
        let other_shard = (other % 2) as usize;
        assert_ne!(other_shard, big_shard);
        let data = pattern(5, 10_000 * 4096);
        for (i, piece) in data.chunks(1 << 20).enumerate() {
            fs.write(other, (i << 20) as u64, piece)
                .unwrap_or_else(|e| {
                    panic!(
                        "version {version}: MiB {i}: {e}: {:?} {:?} {:?}",
                        fs.space_report(),
                        fs.space_pool().stats(),
                        fs.statfs()
                    )
                });
        }
        fs.sync().unwrap();
        let per_region = fs.space_pool().geometry().groups_per_region;
        let space = fs.space_report();
        assert!(
            space[other_shard]
                .groups
                .iter()
                .any(|g| g / per_region == big_shard as u64),
            "shard {other_shard} took no group of the other region: {space:?}"
        );
        let mut fs = Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap();
        fs.check().unwrap();
        assert_eq!(fs.read(other, 0, data.len()).unwrap(), data);
    }
}

/// Versions this corefs does not read are refused by name, and the image is left alone.
#[test]
fn versions_this_corefs_does_not_read_are_refused_by_name() {
    let original = fixture();
    for version in [2, engine::format::FORMAT_VERSION + 1] {
        let image = with_format_version(&original, version);
        let err = Filesystem::mount(device(&image), MountOptions::default())
            .err()
            .expect("an unreadable version mounts");
        assert!(
            err.to_string()
                .contains(&format!("format version {version}")),
            "{err}"
        );
    }
}

/// A version 5 filesystem (block groups, no extended back-references) left by a crash
/// mounts, replays its records (their format did not change) and is marked version 6 by
/// mount's commit; a file then takes more names in one directory than version 5 could hold.
#[test]
fn a_version_5_filesystem_left_by_a_crash_is_upgraded_at_mount() {
    let mut fs = Filesystem::mount(device(&fixture()), MountOptions::default()).unwrap();
    let root = fs.root();
    let file = fs.create(root, b"v5", 0o644, 0, 0).unwrap().ino;
    fs.write(file, 0, b"five").unwrap();
    fs.fsync(file).unwrap();
    // What a crashed version 5 corefs leaves: this image has nothing version 6 added.
    let image = with_format_version(&image_of(fs.into_device()), 5);
    let mut fs = Filesystem::mount(device(&image), MountOptions::default()).unwrap();
    assert!(fs.log_stats().replayed_records >= 1, "{:?}", fs.log_stats());
    assert_contents(&mut fs);
    assert_eq!(fs.read(file, 0, 10).unwrap(), b"five");
    fs.check().unwrap();
    let upgraded = image_of(fs.into_device());
    assert_eq!(superblock(&upgraded).1, engine::format::FORMAT_VERSION);
    let mut fs = Filesystem::mount(device(&upgraded), MountOptions::default()).unwrap();
    for i in 0..200 {
        fs.link(
            file,
            root,
            format!("name-{i:03}-{}", "x".repeat(24)).as_bytes(),
        )
        .unwrap_or_else(|e| panic!("link {i}: {e}"));
    }
    let mut fs = Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap();
    assert_eq!(fs.stat(file).unwrap().nlink, 201);
    fs.check().unwrap();
}
