//! Hard links in users' numbers: thousands of names of one file in one directory (past what
//! its back-reference item holds, into extended back-references), renamed, moved between
//! directories and removed, across commits, remounts and crashes with the names fsynced; the
//! checker runs after each step. With a 2-bit name hash the extended back-references share
//! hash chains, which must still hold every name. ext4's limit of 65,000 names holds.

use engine::{EngineError, Filesystem, MkfsOptions, MountOptions, RenameFlags};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;
use std::collections::BTreeSet;

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: 256 << 20,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 16,
    }
}

fn fresh(hash_bits: u8) -> Filesystem {
    let dev = Box::new(MemDevice::new(config()).unwrap());
    let dev = Filesystem::mkfs_with_name_hash_bits(
        dev,
        &MkfsOptions {
            shards: 4,
            ..Default::default()
        },
        hash_bits,
    )
    .unwrap();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

fn remount(fs: Filesystem) -> Filesystem {
    Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap()
}

/// What a crash leaves: the device as it is, without the unmount's commit.
fn crash(fs: Filesystem) -> Filesystem {
    let dev: Box<dyn BlockDevice> = fs.into_device();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

/// A 40-byte name: 51 fit one back-reference item.
fn name(i: usize) -> Vec<u8> {
    format!("link-{i:05}-{}", "n".repeat(29)).into_bytes()
}

/// The names in `dir`, all naming `ino`.
fn names_in(fs: &mut Filesystem, dir: u64, ino: u64) -> BTreeSet<Vec<u8>> {
    let mut names = BTreeSet::new();
    let mut cookie = 0;
    loop {
        let entries = fs.readdir(dir, cookie, 500).unwrap();
        let Some(last) = entries.last() else { break };
        cookie = last.cookie;
        for e in entries {
            assert_eq!(e.ino, ino, "{:?}", String::from_utf8_lossy(&e.name));
            names.insert(e.name);
        }
    }
    names
}

fn check_names(fs: &mut Filesystem, dir: u64, ino: u64, want: &BTreeSet<Vec<u8>>, ctx: &str) {
    assert_eq!(&names_in(fs, dir, ino), want, "{ctx}: names");
    for n in want.iter().step_by(97) {
        assert_eq!(fs.lookup(dir, n).unwrap().ino, ino, "{ctx}: lookup");
    }
    fs.check().unwrap_or_else(|e| panic!("{ctx}: checker: {e}"));
}

#[test]
fn thousands_of_names_of_one_file_in_one_directory() {
    for hash_bits in [32, 2] {
        let ctx = |step: &str| format!("{hash_bits}-bit hash: {step}");
        let mut fs = fresh(hash_bits);
        let root = fs.root();
        let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
        let other = fs.mkdir(root, b"e", 0o755, 0, 0).unwrap().ino;
        let file = fs.create(dir, &name(0), 0o644, 0, 0).unwrap().ino;
        let mut want: BTreeSet<Vec<u8>> = [name(0)].into();
        for i in 1..2000 {
            fs.link(file, dir, &name(i))
                .unwrap_or_else(|e| panic!("{}: link {i}: {e}", ctx("links")));
            want.insert(name(i));
        }
        assert_eq!(fs.stat(file).unwrap().nlink, 2000);
        check_names(&mut fs, dir, file, &want, &ctx("2,000 names"));

        // Renames within the directory (names in the back-reference item and past it), one
        // over another name of the same file (nothing happens), moves to another directory,
        // and removals of every third.
        for i in (0..2000).step_by(7) {
            let to = format!("renamed-{i}").into_bytes();
            fs.rename(dir, &name(i), dir, &to, RenameFlags::default())
                .unwrap();
            want.remove(&name(i));
            want.insert(to);
        }
        fs.rename(dir, &name(1), dir, &name(2), RenameFlags::default())
            .unwrap();
        let mut moved = BTreeSet::new();
        for i in (3..2000).step_by(11).filter(|i| i % 7 != 0) {
            fs.rename(dir, &name(i), other, &name(i), RenameFlags::default())
                .unwrap();
            want.remove(&name(i));
            moved.insert(name(i));
        }
        let removed: Vec<Vec<u8>> = want.iter().step_by(3).cloned().collect();
        for n in &removed {
            fs.unlink(dir, n).unwrap();
            want.remove(n);
        }
        let nlink = (want.len() + moved.len()) as u32;
        assert_eq!(fs.stat(file).unwrap().nlink, nlink);
        check_names(&mut fs, dir, file, &want, &ctx("renamed, moved, removed"));
        check_names(&mut fs, other, file, &moved, &ctx("moved"));

        // Durable by commit.
        let mut fs = remount(fs);
        assert_eq!(fs.stat(file).unwrap().nlink, nlink);
        check_names(&mut fs, dir, file, &want, &ctx("after a remount"));

        // Durable by fsync: 300 more names logged, then a crash.
        for i in 2000..2300 {
            fs.link(file, dir, &name(i)).unwrap();
            want.insert(name(i));
        }
        fs.fsync(file).unwrap();
        let mut fs = crash(fs);
        assert_eq!(fs.stat(file).unwrap().nlink, nlink + 300);
        check_names(&mut fs, dir, file, &want, &ctx("300 names fsynced, crash"));

        // Removals logged by a directory fsync, then a crash.
        let gone: Vec<Vec<u8>> = want.iter().skip(1).step_by(2).cloned().collect();
        for n in &gone {
            fs.unlink(dir, n).unwrap();
            want.remove(n);
        }
        fs.fsync(dir).unwrap();
        let mut fs = crash(fs);
        let nlink = (want.len() + moved.len()) as u32;
        assert_eq!(fs.stat(file).unwrap().nlink, nlink);
        check_names(&mut fs, dir, file, &want, &ctx("removals fsynced, crash"));

        // Every name gone: the file goes, and nothing of it is left for the checker.
        for n in want.clone() {
            fs.unlink(dir, &n).unwrap();
        }
        for n in moved {
            fs.unlink(other, &n).unwrap();
        }
        assert_eq!(fs.stat(file), Err(EngineError::NotFound));
        fs.check().unwrap();
        remount(fs).unmount().unwrap();
    }
}

/// ext4's limit: the 65,001st name is EMLINK, with nothing changed.
#[test]
fn the_sixty_five_thousandth_name_is_the_last() {
    let mut fs = fresh(32);
    let root = fs.root();
    let file = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    for i in 1..65_000u32 {
        fs.link(file, root, format!("{i}").as_bytes())
            .unwrap_or_else(|e| panic!("link {i}: {e}"));
    }
    assert_eq!(fs.stat(file).unwrap().nlink, 65_000);
    assert_eq!(
        fs.link(file, root, b"one-too-many").map(drop),
        Err(EngineError::TooManyLinks)
    );
    assert_eq!(
        fs.lookup(root, b"one-too-many").map(drop),
        Err(EngineError::NotFound)
    );
    fs.check().unwrap();
}
