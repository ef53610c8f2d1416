//! The POSIX objects and rules programs meet beyond plain files and directories: special
//! files, set-group-ID directories, files kept open after their last name goes (orphans,
//! including across power cuts), long symlink targets, large xattrs, inode counts, atomic
//! appends. Each is checked through a remount and the checker.

use engine::{
    EngineError, Filesystem, MkfsOptions, MountOptions, RenameFlags, SetAttr, XattrFlags,
};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image, CrashMode, RecordingDevice};
use nvme::BlockDevice;

const S_IFMT: u32 = 0o170000;
const S_IFIFO: u32 = 0o010000;
const S_IFCHR: u32 = 0o020000;
const S_IFBLK: u32 = 0o060000;
const S_IFSOCK: u32 = 0o140000;
const S_IFDIR: u32 = 0o040000;
const S_ISGID: u32 = 0o2000;

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: 32 << 20,
        lba_size_bytes: 512,
        queue_depth: 64,
        buf_bytes: 1 << 20,
        buf_count: 32,
    }
}

fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut out = vec![0u8; dev.info().capacity_bytes() as usize];
    nvme::read_sync(&mut *dev, 0, &mut out).unwrap();
    out
}

fn fresh_with_bits(bits: u8) -> Filesystem {
    let dev = Box::new(MemDevice::new(config()).unwrap());
    let dev = Filesystem::mkfs_with_name_hash_bits(
        dev,
        &MkfsOptions {
            shards: 4,
            label: String::new(),
            ..Default::default()
        },
        bits,
    )
    .unwrap();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

fn fresh() -> Filesystem {
    fresh_with_bits(32)
}

fn remount(fs: Filesystem) -> Filesystem {
    let mut fs = Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap();
    fs.check().unwrap();
    fs
}

/// A mount of what a power cut leaves right now (nothing more is committed).
fn crash(fs: Filesystem) -> Filesystem {
    let image = image_of(fs.into_device());
    let mut fs = Filesystem::mount(
        Box::new(MemDevice::from_image(&image, config()).unwrap()),
        MountOptions::default(),
    )
    .unwrap();
    fs.check().unwrap();
    fs
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

#[test]
fn special_files_keep_their_type_and_device_number() {
    let mut fs = fresh();
    let root = fs.root();
    let fifo = fs.mknod(root, b"fifo", S_IFIFO | 0o600, 0, 7, 8).unwrap();
    let sock = fs.mknod(root, b"sock", S_IFSOCK | 0o644, 0, 0, 0).unwrap();
    let chr = fs
        .mknod(root, b"null", S_IFCHR | 0o666, 0x0103, 0, 0)
        .unwrap();
    let blk = fs
        .mknod(root, b"loop0", S_IFBLK | 0o660, 0x0700, 0, 6)
        .unwrap();
    let reg = fs.mknod(root, b"plain", 0o100644, 99, 0, 0).unwrap();
    assert_eq!(
        fs.mknod(root, b"dir", S_IFDIR | 0o755, 0, 0, 0),
        Err(EngineError::Invalid("mknod of file type 4".into()))
    );
    assert_eq!(fs.read(fifo.ino, 0, 10).unwrap_err().errno(), 22);
    assert_eq!(fs.write(chr.ino, 0, b"x").unwrap_err().errno(), 22);
    let mut fs = remount(fs);
    for (name, st, kind, rdev) in [
        ("fifo", fifo, S_IFIFO, 0),
        ("sock", sock, S_IFSOCK, 0),
        ("null", chr, S_IFCHR, 0x0103),
        ("loop0", blk, S_IFBLK, 0x0700),
        ("plain", reg, 0o100000, 0),
    ] {
        let now = fs.lookup(root, name.as_bytes()).unwrap();
        assert_eq!(now.ino, st.ino);
        assert_eq!(now.mode & S_IFMT, kind, "{name}");
        assert_eq!(now.rdev, rdev, "{name}");
    }
    assert_eq!(fs.stat(fifo.ino).unwrap().uid, 7);
    let kinds: Vec<u8> = fs
        .readdir(root, 0, 10)
        .unwrap()
        .iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![1, 12, 2, 6, 8],
        "DT_FIFO, DT_SOCK, DT_CHR, DT_BLK, DT_REG"
    );
    fs.unlink(root, b"null").unwrap();
    fs.rename(root, b"fifo", root, b"fifo2", RenameFlags::default())
        .unwrap();
    remount(fs);
}

#[test]
fn a_set_group_id_directory_gives_its_group_and_passes_its_bit_to_subdirectories() {
    let mut fs = fresh();
    let root = fs.root();
    let shared = fs.mkdir(root, b"shared", 0o2775, 0, 100).unwrap();
    assert_eq!(shared.mode & S_ISGID, S_ISGID);
    let file = fs.create(shared.ino, b"f", 0o644, 1000, 5).unwrap();
    assert_eq!((file.uid, file.gid), (1000, 100));
    assert_eq!(file.mode & S_ISGID, 0, "a file does not take the bit");
    let sub = fs.mkdir(shared.ino, b"sub", 0o755, 1000, 5).unwrap();
    assert_eq!(sub.gid, 100);
    assert_eq!(sub.mode & S_ISGID, S_ISGID, "a directory takes the bit");
    let deeper = fs.symlink(sub.ino, b"link", b"../f", 1000, 5).unwrap();
    assert_eq!(deeper.gid, 100);
    let plain = fs.mkdir(root, b"plain", 0o755, 0, 0).unwrap();
    assert_eq!(fs.create(plain.ino, b"g", 0o644, 1000, 5).unwrap().gid, 5);
    let mut fs = remount(fs);
    assert_eq!(fs.stat(sub.ino).unwrap().mode & S_ISGID, S_ISGID);
}

#[test]
fn an_open_file_outlives_its_last_name_and_goes_with_its_last_holder() {
    let mut fs = fresh();
    let root = fs.root();
    let before = fs.statfs();
    let ino = fs.create(root, b"tmp", 0o600, 0, 0).unwrap().ino;
    fs.write(ino, 0, &bytes(1, 50_000)).unwrap();
    fs.hold(ino).unwrap();
    fs.hold(ino).unwrap();
    fs.unlink(root, b"tmp").unwrap();
    assert_eq!(fs.lookup(root, b"tmp"), Err(EngineError::NotFound));
    let st = fs.stat(ino).unwrap();
    assert_eq!((st.nlink, st.size), (0, 50_000));
    assert_eq!(fs.read(ino, 0, 50_000).unwrap(), bytes(1, 50_000));
    fs.write(ino, 50_000, &bytes(2, 10_000)).unwrap();
    fs.fsync(ino).unwrap();
    fs.check().unwrap();
    fs.commit().unwrap();
    fs.check().unwrap();
    fs.release(ino).unwrap();
    assert_eq!(fs.stat(ino).unwrap().nlink, 0, "one holder is left");
    fs.release(ino).unwrap();
    assert_eq!(fs.stat(ino), Err(EngineError::NotFound));
    assert!(fs.release(ino).is_err(), "a release without a hold");
    fs.commit().unwrap();
    fs.check().unwrap();
    assert_eq!(fs.statfs().inodes, before.inodes);
    // Renamed over and removed directories behave the same.
    let victim = fs.create(root, b"victim", 0o600, 0, 0).unwrap().ino;
    let other = fs.create(root, b"other", 0o600, 0, 0).unwrap().ino;
    fs.write(victim, 0, b"still here").unwrap();
    fs.hold(victim).unwrap();
    fs.rename(root, b"other", root, b"victim", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.lookup(root, b"victim").unwrap().ino, other);
    assert_eq!(fs.read(victim, 0, 100).unwrap(), b"still here");
    let dir = fs.mkdir(root, b"cwd", 0o755, 0, 0).unwrap().ino;
    fs.hold(dir).unwrap();
    fs.rmdir(root, b"cwd").unwrap();
    assert_eq!(fs.stat(dir).unwrap().nlink, 0);
    assert_eq!(
        fs.create(dir, b"inside", 0o644, 0, 0),
        Err(EngineError::NotFound),
        "nothing is created in a removed directory"
    );
    fs.check().unwrap();
    fs.release(victim).unwrap();
    fs.release(dir).unwrap();
    let mut fs = remount(fs);
    assert_eq!(fs.stat(victim), Err(EngineError::NotFound));
    assert_eq!(fs.stat(dir), Err(EngineError::NotFound));
}

/// A crash while an unlinked file is still open leaves an orphan: the next mount deletes it
/// and frees its blocks, whether the unlink reached the disk by a commit or by an fsync's
/// record; and an unlink that never reached the disk leaves the file with its name.
#[test]
fn orphans_left_by_a_crash_are_deleted_at_the_next_mount() {
    for how in ["commit", "fsync", "neither"] {
        let mut fs = fresh();
        let root = fs.root();
        let keep = fs.create(root, b"keep", 0o644, 0, 0).unwrap().ino;
        let ino = fs.create(root, b"tmp", 0o600, 0, 0).unwrap().ino;
        fs.write(ino, 0, &bytes(3, 200_000)).unwrap();
        fs.sync().unwrap();
        let used_before = fs.statfs().free_blocks;
        fs.hold(ino).unwrap();
        fs.unlink(root, b"tmp").unwrap();
        match how {
            "commit" => fs.sync().unwrap(),
            "fsync" => fs.fsync(ino).unwrap(),
            _ => {}
        }
        let mut fs = crash(fs);
        assert_eq!(fs.stat(keep).unwrap().nlink, 1, "{how}");
        if how == "neither" {
            assert_eq!(fs.lookup(root, b"tmp").unwrap().ino, ino, "{how}");
        } else {
            assert_eq!(fs.stat(ino), Err(EngineError::NotFound), "{how}");
            assert!(fs.lookup(root, b"tmp").is_err(), "{how}");
            assert!(
                fs.statfs().free_blocks >= used_before + 40,
                "{how}: the orphan's blocks came back"
            );
        }
        remount(fs);
    }
}

/// A power cut at every write of holding, unlinking, fsyncing and releasing an open file
/// mounts clean: the file is there under its name, or gone, never leaked.
#[test]
fn a_power_cut_at_every_write_of_an_orphan_s_life_mounts_clean() {
    let mut fs = fresh();
    let root = fs.root();
    let ino = fs.create(root, b"tmp", 0o600, 0, 0).unwrap().ino;
    fs.write(ino, 0, &bytes(4, 30_000)).unwrap();
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let recording = RecordingDevice::new(MemDevice::from_image(&image, config()).unwrap());
    let log = recording.log();
    let mut fs = Filesystem::mount(Box::new(recording), MountOptions::default()).unwrap();
    fs.hold(ino).unwrap();
    fs.unlink(root, b"tmp").unwrap();
    fs.write(ino, 30_000, &bytes(5, 4096)).unwrap();
    fs.fsync(ino).unwrap();
    fs.commit().unwrap();
    fs.release(ino).unwrap();
    fs.commit().unwrap();
    let records = log.snapshot();
    assert!(records.len() > 4, "{} writes", records.len());
    for cut in 0..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let mut fs = Filesystem::mount(
                Box::new(MemDevice::from_image(&crashed, config()).unwrap()),
                MountOptions::default(),
            )
            .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: mount: {e}"));
            fs.check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            match fs.lookup(root, b"tmp") {
                Ok(st) => assert_eq!(st.ino, ino),
                Err(_) => assert_eq!(fs.stat(ino), Err(EngineError::NotFound), "cut {cut}"),
            }
        }
    }
}

#[test]
fn symlink_targets_up_to_4095_bytes() {
    let mut fs = fresh();
    let root = fs.root();
    let long: Vec<u8> = (0..4095).map(|i| b'a' + (i % 26) as u8).collect();
    let st = fs.symlink(root, b"long", &long, 0, 0).unwrap();
    assert_eq!(st.size, 4095);
    assert_eq!(fs.readlink(st.ino).unwrap(), long);
    let mut too_long = long.clone();
    too_long.push(b'z');
    assert_eq!(
        fs.symlink(root, b"too-long", &too_long, 0, 0),
        Err(EngineError::NameTooLong)
    );
    fs.fsync(st.ino).unwrap();
    let mut fs = crash(fs);
    assert_eq!(fs.readlink(st.ino).unwrap(), long, "replayed from the log");
    let mut fs = remount({
        fs.unlink(root, b"long").unwrap();
        fs
    });
    assert!(fs.lookup(root, b"long").is_err());
}

#[test]
fn xattr_values_up_to_64_kib_and_e2big_beyond() {
    // A 2-bit name hash: the attributes share chains, so their large values need slots.
    let mut fs = fresh_with_bits(2);
    let root = fs.root();
    let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    let sizes = [0usize, 1024, 1025, 4096, 20_000, 65_536];
    for (i, &size) in sizes.iter().enumerate() {
        fs.setxattr(
            ino,
            format!("user.v{i}").as_bytes(),
            &bytes(i as u8, size),
            XattrFlags::Create,
        )
        .unwrap_or_else(|e| panic!("{size} bytes: {e}"));
    }
    let err = fs
        .setxattr(ino, b"user.big", &vec![0; 65_537], XattrFlags::Any)
        .unwrap_err();
    assert_eq!(err.errno(), 7, "E2BIG: {err}");
    fs.check().unwrap();
    // Large to small, small to large, large to large.
    fs.setxattr(ino, b"user.v5", b"small now", XattrFlags::Replace)
        .unwrap();
    fs.setxattr(ino, b"user.v0", &bytes(9, 30_000), XattrFlags::Replace)
        .unwrap();
    fs.setxattr(ino, b"user.v4", &bytes(8, 3_000), XattrFlags::Replace)
        .unwrap();
    fs.removexattr(ino, b"user.v3").unwrap();
    fs.fsync(ino).unwrap();
    let mut fs = crash(fs);
    let expect = [
        ("user.v0", Some(bytes(9, 30_000))),
        ("user.v1", Some(bytes(1, 1024))),
        ("user.v2", Some(bytes(2, 1025))),
        ("user.v3", None),
        ("user.v4", Some(bytes(8, 3_000))),
        ("user.v5", Some(b"small now".to_vec())),
    ];
    for (name, value) in &expect {
        match value {
            Some(v) => assert_eq!(&fs.getxattr(ino, name.as_bytes()).unwrap(), v, "{name}"),
            None => assert_eq!(fs.getxattr(ino, name.as_bytes()), Err(EngineError::NoData)),
        }
    }
    assert_eq!(fs.listxattr(ino).unwrap().len(), 5);
    fs.unlink(root, b"f").unwrap();
    remount(fs);
}

#[test]
fn statfs_counts_inodes_through_creates_deletes_replay_and_remount() {
    let mut fs = fresh();
    let root = fs.root();
    assert_eq!(fs.statfs().inodes, 1, "the root");
    assert!(fs.statfs().free_inodes > 1000);
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    for i in 0..50 {
        fs.create(dir, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    assert_eq!(fs.statfs().inodes, 52);
    for i in 0..20 {
        fs.unlink(dir, format!("f{i}").as_bytes()).unwrap();
    }
    assert_eq!(fs.statfs().inodes, 32);
    fs.sync().unwrap();
    let f = fs.create(dir, b"logged", 0o644, 0, 0).unwrap().ino;
    fs.fsync(f).unwrap();
    let fs = crash(fs);
    assert_eq!(
        fs.statfs().inodes,
        33,
        "replay counts the inode it recreates"
    );
    let fs = remount(fs);
    assert_eq!(fs.statfs().inodes, 33);
}

#[test]
fn appends_land_at_the_end_one_after_another() {
    let mut fs = fresh();
    let root = fs.root();
    let ino = fs.create(root, b"log", 0o644, 0, 0).unwrap().ino;
    let mut expect = Vec::new();
    for i in 0..20u8 {
        let piece = bytes(i, 100 + i as usize * 37);
        let (at, n) = fs.append(ino, &piece).unwrap();
        assert_eq!((at, n), (expect.len() as u64, piece.len()));
        expect.extend_from_slice(&piece);
    }
    assert_eq!(fs.read(ino, 0, expect.len()).unwrap(), expect);
    fs.setattr(
        ino,
        SetAttr {
            size: Some(10),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(fs.append(ino, b"x").unwrap(), (10, 1));
}

/// Random lives of open files: creates, links, unlinks, renames over, holds and releases,
/// writes, fsyncs and commits, checked against a model after every step (link counts,
/// orphans alive while held and gone at their last release, data), then a power cut: the
/// mount deletes every orphan and keeps every name a sync made durable. Seeds print;
/// `COREFS_SEED=N` replays.
#[test]
fn random_holds_unlinks_and_releases_match_the_model() {
    use std::collections::BTreeMap;
    let seed = nvme::wrap::seed_from_env();
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    #[derive(Debug, Default, Clone)]
    struct File {
        holds: u32,
        names: u32,
        len: u64,
    }
    let mut fs = fresh();
    let root = fs.root();
    let mut files: BTreeMap<u64, File> = BTreeMap::new();
    let mut names: BTreeMap<String, u64> = BTreeMap::new();
    let name_of = |i: u64| format!("n{i}");
    for step in 0..2000 {
        let ctx = format!("seed {seed} step {step}");
        match next(9) {
            0 => {
                let name = name_of(next(10));
                if let std::collections::btree_map::Entry::Vacant(slot) = names.entry(name) {
                    let ino = fs
                        .create(root, slot.key().as_bytes(), 0o644, 0, 0)
                        .unwrap()
                        .ino;
                    files.insert(
                        ino,
                        File {
                            names: 1,
                            ..Default::default()
                        },
                    );
                    slot.insert(ino);
                }
            }
            1 | 2 => {
                let name = name_of(next(10));
                if let Some(ino) = names.remove(&name) {
                    fs.unlink(root, name.as_bytes()).unwrap();
                    files.get_mut(&ino).unwrap().names -= 1;
                }
            }
            3 => {
                let (from, to) = (name_of(next(10)), name_of(next(10)));
                if let Some(&ino) = names.get(&from) {
                    fs.rename(
                        root,
                        from.as_bytes(),
                        root,
                        to.as_bytes(),
                        RenameFlags::default(),
                    )
                    .unwrap();
                    // Two names of one file: rename does nothing (POSIX).
                    if names.get(&to) != Some(&ino) {
                        if let Some(gone) = names.insert(to.clone(), ino) {
                            files.get_mut(&gone).unwrap().names -= 1;
                        }
                        names.remove(&from);
                    }
                }
            }
            4 => {
                let name = name_of(next(10));
                let live: Vec<u64> = files.keys().copied().collect();
                if !names.contains_key(&name) && !live.is_empty() {
                    let ino = live[next(live.len() as u64) as usize];
                    if files[&ino].names > 0 {
                        fs.link(ino, root, name.as_bytes()).unwrap();
                        files.get_mut(&ino).unwrap().names += 1;
                        names.insert(name, ino);
                    }
                }
            }
            5 => {
                let live: Vec<u64> = files.keys().copied().collect();
                if !live.is_empty() {
                    let ino = live[next(live.len() as u64) as usize];
                    fs.hold(ino).unwrap();
                    files.get_mut(&ino).unwrap().holds += 1;
                }
            }
            6 => {
                let held: Vec<u64> = files
                    .iter()
                    .filter(|(_, f)| f.holds > 0)
                    .map(|(i, _)| *i)
                    .collect();
                if !held.is_empty() {
                    let ino = held[next(held.len() as u64) as usize];
                    fs.release(ino).unwrap();
                    files.get_mut(&ino).unwrap().holds -= 1;
                }
            }
            7 => {
                let live: Vec<u64> = files.keys().copied().collect();
                if !live.is_empty() {
                    let ino = live[next(live.len() as u64) as usize];
                    let n = 1 + next(9000) as usize;
                    fs.append(ino, &bytes(step as u8, n)).unwrap();
                    files.get_mut(&ino).unwrap().len += n as u64;
                    if next(2) == 0 {
                        fs.fsync(ino).unwrap();
                    }
                }
            }
            _ => fs.commit().map(drop).unwrap(),
        }
        files.retain(|ino, f| {
            let alive = f.names > 0 || f.holds > 0;
            if !alive {
                assert_eq!(
                    fs.stat(*ino),
                    Err(EngineError::NotFound),
                    "{ctx}: {ino} leaked"
                );
            }
            alive
        });
        for (ino, f) in &files {
            let st = fs
                .stat(*ino)
                .unwrap_or_else(|e| panic!("{ctx}: {ino}: {e}"));
            assert_eq!((st.nlink, st.size), (f.names, f.len), "{ctx}: inode {ino}");
        }
        for (name, ino) in &names {
            assert_eq!(
                fs.lookup(root, name.as_bytes()).unwrap().ino,
                *ino,
                "{ctx}: {name}"
            );
        }
        if step % 250 == 249 {
            fs.check().unwrap_or_else(|e| panic!("{ctx}: {e}"));
        }
    }
    fs.sync().unwrap();
    let orphans: Vec<u64> = files
        .iter()
        .filter(|(_, f)| f.names == 0)
        .map(|(i, _)| *i)
        .collect();
    let mut fs = crash(fs);
    for ino in orphans {
        assert_eq!(
            fs.stat(ino),
            Err(EngineError::NotFound),
            "seed {seed}: orphan {ino} survived"
        );
    }
    for (name, ino) in &names {
        let st = fs.lookup(root, name.as_bytes()).unwrap();
        assert_eq!(
            (st.ino, st.size),
            (*ino, files[ino].len),
            "seed {seed}: {name}"
        );
    }
    assert_eq!(
        fs.statfs().inodes,
        1 + names
            .values()
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64
    );
}
