//! What a thread the engine is lent to may run (`Filesystem::read_lent`,
//! `Filesystem::write_lent`: a client while its reactor sleeps), and what it must leave to the
//! owner untouched. The device asserts on any use of its queue while lent, so a path that
//! reached it would panic here.

use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};

fn fresh(options: MountOptions) -> Filesystem {
    let config = MemConfig {
        capacity_bytes: 64 << 20,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 64,
    };
    let mkfs = MkfsOptions {
        shards: 2,
        label: "lent".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(MemDevice::new(config).unwrap()), &mkfs).unwrap();
    Filesystem::mount(dev, options).unwrap()
}

/// Writes that only stage run lent and read back as written, through a commit and a
/// remount; writes that would read an edge block inside the file, or start write-back, are
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
    // Appending from the unaligned end would read the block under it: the owner's.
    let stat = fs.stat(a).unwrap();
    assert!(fs.write_lent(a, 10_000, b"more").is_none());
    assert_eq!(
        fs.stat(a).unwrap(),
        stat,
        "a declined write changed nothing"
    );
    // So is a write inside the file that covers a block in part.
    assert!(fs.write_lent(a, 100, b"x").is_none());
    // Whole blocks inside the file, and a write past the end with a gap, run.
    assert!(fs.write_lent(a, 4096, &[7u8; 4096]).unwrap().is_ok());
    assert!(fs.write_lent(a, 20_000, b"far").unwrap().is_ok());
    let mut model = first.clone();
    model[4096..8192].fill(7);
    model.resize(20_000, 0);
    model.extend_from_slice(b"far");
    assert_eq!(fs.read(a, 0, 30_000).unwrap(), model);
    assert_eq!(fs.fetch_stats().lent_writes, 3);

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
    let config = MemConfig {
        capacity_bytes: 16 << 20,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 64,
    };
    let mkfs = MkfsOptions {
        shards: 4,
        label: "lent".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(MemDevice::new(config).unwrap()), &mkfs).unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
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
