//! Access and birth times. A read moves a file's access time as the mount's option says
//! (relatime by default, noatime, strictatime); the move is an ordinary inode change: the next
//! commit writes it, an fsync logs it, an fdatasync does not, and reads never commit. Birth
//! time is set when the inode is made and never moves.

use engine::{Atime, Filesystem, MkfsOptions, MountOptions, SetAttr};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: 64 << 20,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 16,
    }
}

fn mount(dev: Box<dyn BlockDevice>, atime: Atime) -> Filesystem {
    Filesystem::mount(
        dev,
        MountOptions {
            atime,
            ..Default::default()
        },
    )
    .unwrap()
}

fn fresh(atime: Atime) -> Filesystem {
    let dev = Box::new(MemDevice::new(config()).unwrap());
    let dev = Filesystem::mkfs(
        dev,
        &MkfsOptions {
            shards: 4,
            ..Default::default()
        },
    )
    .unwrap();
    mount(dev, atime)
}

/// A file of 8 KiB, written after it was created.
fn written(fs: &mut Filesystem, name: &str) -> u64 {
    let root = fs.root();
    let ino = fs.create(root, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
    fs.write(ino, 0, &[7u8; 8192]).unwrap();
    ino
}

#[test]
fn relatime_moves_atime_on_the_first_read_after_a_write_only() {
    let mut fs = fresh(Atime::Relative);
    let ino = written(&mut fs, "f");
    let before = fs.stat(ino).unwrap();
    assert!(before.atime <= before.mtime, "{before:?}");
    assert_eq!(fs.read(ino, 0, 4096).unwrap().len(), 4096);
    let first = fs.stat(ino).unwrap();
    assert!(
        first.atime > before.atime && first.atime >= first.mtime,
        "the first read after a write moves atime past mtime: {before:?} -> {first:?}"
    );
    assert_eq!(first.mtime, before.mtime, "a read changes no other time");
    assert_eq!(first.ctime, before.ctime, "a read changes no other time");
    fs.read(ino, 4096, 4096).unwrap();
    assert_eq!(
        fs.stat(ino).unwrap().atime,
        first.atime,
        "a second read before any change leaves it"
    );
    // A change makes the next read move it again.
    fs.write(ino, 0, b"x").unwrap();
    fs.read(ino, 0, 1).unwrap();
    let again = fs.stat(ino).unwrap();
    assert!(again.atime > first.atime && again.atime >= again.mtime);
    // Durable with the next commit, like any inode change.
    let dev = fs.unmount().unwrap();
    let mut fs = mount(dev, Atime::Relative);
    assert_eq!(fs.stat(ino).unwrap().atime, again.atime);
    fs.unmount().unwrap();
}

#[test]
fn noatime_never_moves_it_and_strictatime_moves_it_on_every_read() {
    let mut fs = fresh(Atime::Never);
    let ino = written(&mut fs, "f");
    let before = fs.stat(ino).unwrap().atime;
    for _ in 0..3 {
        fs.read(ino, 0, 100).unwrap();
    }
    assert_eq!(fs.stat(ino).unwrap().atime, before, "noatime");
    let dev = fs.unmount().unwrap();

    let mut fs = mount(dev, Atime::Strict);
    let mut last = fs.stat(ino).unwrap().atime;
    for _ in 0..3 {
        fs.read(ino, 0, 100).unwrap();
        let now = fs.stat(ino).unwrap().atime;
        assert!(
            now > last,
            "strictatime: every read moves it ({last:?} -> {now:?})"
        );
        last = now;
    }
    // An empty read is no access (as on Linux).
    fs.read(ino, 0, 0).unwrap();
    assert_eq!(fs.stat(ino).unwrap().atime, last);
    fs.unmount().unwrap();
}

#[test]
fn an_atime_move_is_logged_by_fsync_not_by_fdatasync_and_reads_never_commit() {
    let mut fs = fresh(Atime::Strict);
    let ino = written(&mut fs, "f");
    fs.fsync(ino).unwrap();
    let generation = fs.durable_generation();
    for _ in 0..1000 {
        fs.read(ino, 0, 512).unwrap();
    }
    assert_eq!(
        fs.durable_generation(),
        generation,
        "a thousand reads committed: an atime move must ride the running transaction"
    );
    let logged = fs.log_stats().log_writes;
    fs.fdatasync(ino).unwrap();
    assert_eq!(
        fs.log_stats().log_writes,
        logged,
        "fdatasync logged an access time"
    );
    fs.fsync(ino).unwrap();
    assert_eq!(
        fs.log_stats().log_writes,
        logged + 1,
        "fsync did not log the access time"
    );
    let atime = fs.stat(ino).unwrap().atime;
    // The logged access time survives a crash: the device as it is, without the unmount's
    // commit.
    let dev = fs.into_device();
    let mut fs = mount(dev, Atime::Never);
    assert_eq!(fs.stat(ino).unwrap().atime, atime, "replayed access time");
    fs.unmount().unwrap();
}

#[test]
fn birth_time_is_set_at_creation_and_never_moves() {
    let mut fs = fresh(Atime::Relative);
    let root = fs.root();
    let made = fs.create(root, b"f", 0o644, 0, 0).unwrap();
    assert_eq!(made.crtime, made.ctime, "born when first changed");
    let ino = made.ino;
    fs.write(ino, 0, b"data").unwrap();
    fs.read(ino, 0, 4).unwrap();
    fs.setattr(
        ino,
        SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    let later = fs.stat(ino).unwrap();
    assert!(later.ctime > made.ctime);
    assert_eq!(later.crtime, made.crtime, "birth time moved");
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap();
    assert_eq!(dir.crtime, dir.ctime);
    let dev = fs.unmount().unwrap();
    let mut fs = mount(dev, Atime::Relative);
    assert_eq!(fs.stat(ino).unwrap().crtime, made.crtime);
    fs.unmount().unwrap();
}
