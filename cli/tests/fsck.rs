//! `corefs fsck` and `corefs dump` on healthy and corrupted images: every injected corruption
//! class is found and named, with e2fsck's exit codes (0 clean, 1 corrected, 4 errors left,
//! 8 operational error), and `--repair` fixes only what is safe (a damaged superblock copy).
//! Block-level damage is done to the image file; item-level damage (wrong link count, missing
//! back-reference, dangling name, overlapping extents, unaccounted space) through the engine's
//! raw item calls, which bypass the invariants the checker verifies; malformed leaves (items
//! sharing data, keys out of order) by editing a leaf and re-sealing its crc and pointer.

use engine::format::items::{ExtentItem, InodeItem};
use engine::format::{ItemKind, Key, NodeBody};
use engine::{Filesystem, MkfsOptions, MountOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

const IMAGE_BYTES: u64 = 64 << 20;
const SHARDS: u32 = 2;

fn device(path: &Path) -> String {
    format!("file:{}", path.display())
}

fn open(path: &Path) -> Box<dyn nvme::BlockDevice> {
    nvme::open_device(
        &format!("file:{},size={IMAGE_BYTES}", path.display()),
        &nvme::OpenOptions::default(),
    )
    .unwrap()
}

/// Files a..d with data, a directory with a file, a symlink; returns the image path and the
/// inode numbers by name.
fn healthy(dir: &Path) -> (PathBuf, Vec<(String, u64)>) {
    let path = dir.join("healthy.img");
    let dev = Filesystem::mkfs(
        open(&path),
        &MkfsOptions {
            shards: SHARDS,
            label: "fsck".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let mut names = Vec::new();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let ino = fs.create(root, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
        fs.write(ino, 0, &vec![0x40 + i as u8; 16384]).unwrap();
        names.push((name.to_string(), ino));
    }
    let sub = fs.mkdir(root, b"sub", 0o755, 0, 0).unwrap().ino;
    let inner = fs.create(sub, b"inner", 0o644, 0, 0).unwrap().ino;
    fs.write(inner, 0, b"inner data").unwrap();
    fs.symlink(root, b"link", b"sub/inner", 0, 0).unwrap();
    names.push(("sub".into(), sub));
    fs.unmount().unwrap();
    (path, names)
}

fn copy(from: &Path, dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(format!("{name}.img"));
    std::fs::copy(from, &to).unwrap();
    to
}

/// Runs fsck; returns (exit code, stdout + stderr).
fn fsck(image: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .arg("fsck")
        .arg(device(image))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn dump(image: &Path, what: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .arg("dump")
        .arg(device(image))
        .args(what)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn expect_corrupt(image: &Path, class: &str, words: &[&str]) {
    let (code, text) = fsck(image, &[]);
    assert_eq!(code, 4, "{class}: exit code; fsck said:\n{text}");
    for w in words {
        assert!(
            text.contains(w),
            "{class}: fsck does not say {w:?}:\n{text}"
        );
    }
    eprintln!(
        "{class}: {}",
        text.lines().find(|l| l.contains("CORRUPT")).unwrap_or("")
    );
}

fn flip(image: &Path, block: u64, byte: usize) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .unwrap();
    let mut b = [0u8; 1];
    let at = block * 4096 + byte as u64;
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x20;
    f.write_all_at(&b, at).unwrap();
}

fn read_block(image: &Path, block: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(image).unwrap();
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, block * 4096).unwrap();
    b
}

fn write_block(image: &Path, block: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    f.write_all_at(bytes, block * 4096).unwrap();
}

/// Leaf addresses of `shard` with whether each holds an item of `ino`.
fn leaves(image: &Path, shard: u32, ino: u64) -> Vec<(u64, bool)> {
    let mut dev = open(image);
    let sb = engine::inspect::current_superblock(&mut *dev).unwrap();
    let mut out = Vec::new();
    engine::inspect::walk_tree(&mut *dev, &sb, shard, &mut |_, ptr, node| {
        if let Ok(NodeBody::Leaf(items)) = node {
            out.push((ptr.addr, items.iter().any(|(k, _)| k.objectid == ino)));
        }
    });
    out
}

/// Lets `f` change shard `shard`'s tree, a single leaf, then re-seals the leaf's crc and the
/// superblock's pointer to it (both copies), so only the structure checks can tell.
fn reseal_root_leaf(image: &Path, shard: u32, f: impl FnOnce(&mut [u8])) {
    let mut dev = open(image);
    let mut sb = engine::inspect::current_superblock(&mut *dev).unwrap();
    let root = sb.shards[shard as usize];
    assert_eq!(root.level, 0, "shard {shard}'s tree is one leaf");
    drop(dev);
    let mut leaf = read_block(image, root.tree.addr);
    f(&mut leaf);
    let crc = engine::format::block_crc(&leaf);
    leaf[0..4].copy_from_slice(&crc.to_le_bytes());
    write_block(image, root.tree.addr, &leaf);
    sb.shards[shard as usize].tree.crc = crc;
    let mut dev = open(image);
    for addr in engine::format::SUPERBLOCK_ADDRS {
        engine::inspect::rewrite_superblock(&mut *dev, &sb, addr).unwrap();
    }
}

/// Mounts `image`, lets `f` change raw items, commits.
fn edit(image: &Path, f: impl FnOnce(&mut Filesystem)) {
    let mut fs = Filesystem::mount(open(image), MountOptions::default()).unwrap();
    f(&mut fs);
    fs.unmount().unwrap();
}

fn inode_of(fs: &mut Filesystem, ino: u64) -> InodeItem {
    let shard = fs.shard_of(ino);
    let bytes = fs
        .get_item(shard, &Key::new(ino, ItemKind::InodeItem, 0))
        .unwrap()
        .unwrap();
    InodeItem::decode(&bytes).unwrap()
}

#[test]
fn every_corruption_class_is_found_and_named() {
    let dir = tempfile::Builder::new()
        .prefix("corefs-fsck-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (image, names) = healthy(dir.path());
    let ino = |n: &str| names.iter().find(|(name, _)| name == n).unwrap().1;

    // Healthy: clean, exit 0, every data block verified.
    let (code, text) = fsck(&image, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("clean") && text.contains("verified against their checksums"),
        "{text}"
    );

    // One damaged superblock copy: named; --repair rewrites it (exit 1), then clean.
    let img = copy(&image, dir.path(), "super1");
    flip(&img, 0, 40);
    expect_corrupt(
        &img,
        "superblock copy",
        &["superblock copy at block 0", "--repair"],
    );
    let (code, text) = fsck(&img, &["--repair"]);
    assert_eq!(code, 1, "repair: {text}");
    assert!(text.contains("rewritten"), "{text}");
    assert_eq!(fsck(&img, &[]).0, 0, "clean after the repair");

    // Both copies damaged: nothing to mount from.
    let img = copy(&image, dir.path(), "super2");
    flip(&img, 0, 40);
    flip(&img, 1, 40);
    expect_corrupt(&img, "both superblocks", &["no valid superblock"]);

    // A flipped bit in a tree leaf: its checksum.
    let a = ino("a");
    let shard_a = (a % SHARDS as u64) as u32;
    let leaf_a = leaves(&image, shard_a, a)
        .into_iter()
        .find(|l| l.1)
        .unwrap()
        .0;
    let img = copy(&image, dir.path(), "node-crc");
    flip(&img, leaf_a, 2000);
    expect_corrupt(
        &img,
        "tree node checksum",
        &["tree node", "checksum mismatch"],
    );

    // An intact node where another belongs (a misdirected or lost write): the parent's
    // pointer does not match it.
    let all: Vec<u64> = (0..SHARDS)
        .flat_map(|s| leaves(&image, s, 0))
        .map(|l| l.0)
        .collect();
    let other = *all.iter().find(|&&l| l != leaf_a).expect("two leaves");
    let img = copy(&image, dir.path(), "misdirected");
    write_block(&img, leaf_a, &read_block(&image, other));
    expect_corrupt(&img, "misdirected write", &["lost or misdirected write"]);

    // Checksum-valid but malformed leaves (the crc and the superblock's pointer re-sealed):
    // the structure checks name them.
    let item = |i: usize| 64 + i * 21;
    let img = copy(&image, dir.path(), "shared-data");
    reseal_root_leaf(&img, shard_a, |leaf| {
        leaf.copy_within(item(1) + 17..item(1) + 21, item(0) + 17);
    });
    expect_corrupt(
        &img,
        "items sharing data",
        &["tree node", "share data bytes"],
    );
    let img = copy(&image, dir.path(), "key-order");
    reseal_root_leaf(&img, shard_a, |leaf| {
        let first = leaf[item(0)..item(1)].to_vec();
        leaf.copy_within(item(1)..item(2), item(0));
        leaf[item(1)..item(2)].copy_from_slice(&first);
    });
    expect_corrupt(&img, "keys out of order", &["tree node", "out of order"]);

    // A data block with a flipped bit: read and verified by fsck.
    let mut fs = Filesystem::mount(open(&image), MountOptions::default()).unwrap();
    let extent_key = Key::new(a, ItemKind::ExtentData, 0);
    let extent = ExtentItem::decode(&fs.get_item(shard_a, &extent_key).unwrap().unwrap()).unwrap();
    drop(fs);
    let img = copy(&image, dir.path(), "data");
    flip(&img, extent.disk_block + 1, 99);
    expect_corrupt(
        &img,
        "data checksum",
        &["data block", "checksum mismatch", &format!("inode {a}")],
    );
    // ...which --no-data does not read.
    assert_eq!(fsck(&img, &["--no-data"]).0, 0);

    // Item-level damage through raw item edits.
    let img = copy(&image, dir.path(), "nlink");
    edit(&img, |fs| {
        let mut item = inode_of(fs, a);
        item.nlink = 3;
        fs.insert_item(shard_a, Key::new(a, ItemKind::InodeItem, 0), item.encode())
            .unwrap();
    });
    expect_corrupt(&img, "link count", &["nlink 3 but 1 names"]);

    let img = copy(&image, dir.path(), "backref");
    let root = engine::inode::ROOT_INO;
    edit(&img, |fs| {
        fs.remove_item(shard_a, &Key::new(a, ItemKind::InodeRef, root))
            .unwrap()
            .expect("a's back-reference");
    });
    expect_corrupt(&img, "missing back-reference", &["inode back-reference"]);

    let b = ino("b");
    let shard_b = (b % SHARDS as u64) as u32;
    let img = copy(&image, dir.path(), "dangling");
    edit(&img, |fs| {
        fs.remove_item(shard_b, &Key::new(b, ItemKind::InodeItem, 0))
            .unwrap();
    });
    expect_corrupt(&img, "dangling name", &[&format!("missing inode {b}")]);

    let img = copy(&image, dir.path(), "overlap");
    edit(&img, |fs| {
        // A second extent over file blocks 2..4 of `a`, whose extent covers 0..4; its blocks
        // are `a`'s own, so only the overlap is wrong... and the blocks' double use.
        let mut second = extent.clone();
        second.disk_block = extent.disk_block + 2;
        second.blocks = 2;
        second.crcs = extent.crcs[2..4].to_vec();
        fs.insert_item(
            shard_a,
            Key::new(a, ItemKind::ExtentData, 2 * 4096),
            second.encode(),
        )
        .unwrap();
    });
    expect_corrupt(&img, "overlapping extents", &["block used twice"]);

    let c = ino("c");
    let shard_c = (c % SHARDS as u64) as u32;
    let img = copy(&image, dir.path(), "space");
    edit(&img, |fs| {
        // An extent on a block the space bitmap says is free: the last of the last group
        // shard c owns (its few small files leave the end of it free).
        let space = fs.space_report();
        let last = *space[shard_c as usize]
            .groups
            .last()
            .expect("shard c owns a group");
        let pool = fs.space_pool();
        let geo = pool.geometry();
        let free_block = geo.group_start(last) + geo.group_len(last) - 1;
        let item = ExtentItem {
            disk_block: free_block,
            blocks: 1,
            prealloc: true,
            crcs: Vec::new(),
        };
        fs.insert_item(
            shard_c,
            Key::new(c, ItemKind::ExtentData, 1 << 20),
            item.encode(),
        )
        .unwrap();
    });
    expect_corrupt(&img, "space accounting", &["space bitmap", "marked free"]);
}

#[test]
fn dump_shows_superblocks_trees_an_inode_logs_and_stats() {
    let dir = tempfile::Builder::new()
        .prefix("corefs-dump-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (image, names) = healthy(dir.path());
    let a = names[0].1;
    let text = dump(&image, &["super"]);
    assert!(
        text.contains("superblock copy at block 0") && text.contains("label \"fsck\""),
        "{text}"
    );
    let text = dump(&image, &["trees"]);
    assert!(text.contains("shard 0:") && text.contains("leaf"), "{text}");
    assert!(text.contains("\"inner\""), "names decoded: {text}");
    let text = dump(&image, &["inode", &a.to_string()]);
    assert!(
        text.contains("InodeItem") && text.contains("nlink 1 size 16384"),
        "{text}"
    );
    assert!(
        text.contains("ExtentData") && text.contains("\"a\""),
        "{text}"
    );
    let text = dump(&image, &["stats"]);
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("all")),
        "{text}"
    );
    assert!(
        text.contains("block groups of") && text.contains("owned"),
        "{text}"
    );
    let text = dump(&image, &["trees", "--shard", "0"]);
    assert!(
        text.contains("block group"),
        "group bitmaps decoded: {text}"
    );

    // An fsync after the last commit leaves a record: dump shows it without replaying it,
    // fsck replays it (as mount does) and finds the filesystem clean with the data.
    let mut fs = Filesystem::mount(open(&image), MountOptions::default()).unwrap();
    fs.write(a, 16384, b"logged").unwrap();
    fs.fsync(a).unwrap();
    drop(fs.into_device()); // a crash: no commit
    let text = dump(&image, &["logs"]);
    assert!(text.contains("1 records of generation"), "{text}");
    assert_eq!(dump(&image, &["logs"]), text, "dump does not replay");
    let (code, out) = fsck(&image, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 records"), "{out}");
    let mut fs = Filesystem::mount(open(&image), MountOptions::default()).unwrap();
    assert_eq!(fs.read(a, 16384, 6).unwrap(), b"logged");
}

/// `fsck -n` changes nothing: on an image with pending fsync log records it replays them in
/// memory only (the image's bytes are identical afterwards) and reports what a plain fsck
/// reports; the plain fsck says it will write them, then does (the bytes change), and a second
/// `-n` finds nothing left to replay.
#[test]
fn fsck_n_replays_in_memory_and_writes_nothing() {
    let dir = tempfile::Builder::new()
        .prefix("corefs-fsck-n-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (image, names) = healthy(dir.path());
    let a = names[0].1;
    let mut fs = Filesystem::mount(open(&image), MountOptions::default()).unwrap();
    fs.write(a, 16384, b"only in the log").unwrap();
    fs.fsync(a).unwrap();
    let b = fs.create(fs.root(), b"new", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &[7u8; 9000]).unwrap();
    fs.fsync(b).unwrap();
    drop(fs.into_device()); // a crash: the records are not committed
    let records = dump(&image, &["logs"]);
    assert!(!records.contains("\n0 records"), "{records}");

    let hash = |path: &Path| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::fs::read(path).unwrap().hash(&mut h);
        h.finish()
    };
    let before = hash(&image);
    let out = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_corefs"))
            .arg("fsck")
            .args(args)
            .arg(device(&image))
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, report_n, err_n) = out(&["-n"]);
    assert_eq!(code, 0, "{report_n}{err_n}");
    assert!(
        err_n.contains("replaying them in memory only") && err_n.contains("nothing is written"),
        "{err_n}"
    );
    assert_eq!(hash(&image), before, "fsck -n changed the image");
    assert_eq!(
        dump(&image, &["logs"]),
        records,
        "the records are still pending"
    );

    let (code, report, err) = out(&[]);
    assert_eq!(code, 0, "{report}{err}");
    assert!(
        err.contains("replaying them and writing them") && err.contains("fsck -n"),
        "the plain fsck does not say it writes: {err}"
    );
    assert_eq!(report, report_n, "fsck -n reports what fsck reports");
    assert!(report.contains("clean at generation"), "{report}");
    assert_ne!(hash(&image), before, "the plain fsck did not replay");
    let (code, again, err) = out(&["-n"]);
    assert_eq!(code, 0, "{again}{err}");
    assert!(err.contains("no records to replay"), "{err}");
    let mut fs = Filesystem::mount(open(&image), MountOptions::default()).unwrap();
    assert_eq!(fs.read(a, 16384, 15).unwrap(), b"only in the log");
    assert_eq!(fs.read(b, 0, 9000).unwrap(), vec![7u8; 9000]);
}
