//! The images runs start from ([`Base`]): an aged filesystem (stale records of earlier
//! generations in both halves of every log area), clean or recovering (its first mount
//! replays records and so is a crash and a recovery), with the tree its first mount must
//! show; and how the tester's devices and mounts are made.

use super::{apply, pattern, snapshot, split, Tree};
use crate::workload::Step;
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions, RenameFlags, XattrFlags};
use nvme::backend::mem::{MemConfig, MemDevice};

const CAPACITY: u64 = 4 << 20;

/// How every mount of the tester is made: noatime. The oracle reads every file at every
/// persistence point; with access times moving, those reads would change the inodes between
/// the workload's operations and so what its fsyncs log, and the workload run would no
/// longer be the one named. (An access time is an inode change like a chmod, which the
/// workloads' xattr changes stand for; atimes are not compared.)
pub(crate) fn mount_options() -> MountOptions {
    MountOptions {
        atime: engine::Atime::Never,
        ..MountOptions::default()
    }
}

/// Block groups of the base image: 32 KiB, the smallest mkfs makes, so that the workloads'
/// writes take groups from the pool and their truncates, unlinks and overwrites give groups
/// back at the commits the workloads make (a sync, a fallback, the full log): every crash
/// point of a hand-over is among the states checked.
pub const GROUP_BLOCKS: u64 = engine::space::GROUP_BLOCKS_MIN;

pub(crate) fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: CAPACITY,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 16,
    }
}

fn mem_image(dev: Box<dyn nvme::BlockDevice>) -> Vec<u8> {
    let mut dev = dev;
    let mut image = vec![0u8; CAPACITY as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).expect("reading back a memory device");
    image
}

/// An image runs start from, with the tree its first mount must show.
#[derive(Debug, Clone)]
pub struct Base {
    pub kind: BaseKind,
    pub image: Vec<u8>,
    /// What the filesystem that wrote the image held when it was unmounted or crashed: the
    /// oracle's starting state, computed from the operations that built the image rather than
    /// read from the image's own mount, which the first check of every run compares with it.
    pub tree: Tree,
}

/// Which starting image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseKind {
    /// The setup, synced and unmounted.
    Clean,
    /// The clean image mounted, changed with every change fsynced, and crashed with the
    /// records written and no commit: its first mount replays them. A run from it is a second
    /// crash after a recovery: crash, recovery mount, more operations and fsyncs, crash again.
    Recovering,
}

impl BaseKind {
    pub const ALL: [BaseKind; 2] = [BaseKind::Clean, BaseKind::Recovering];

    pub fn name(self) -> &'static str {
        match self {
            BaseKind::Clean => "clean",
            BaseKind::Recovering => "recovering",
        }
    }

    pub fn from_name(name: &str) -> Option<BaseKind> {
        BaseKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl Base {
    /// The base image of `kind`, built once per process.
    pub fn get(kind: BaseKind) -> &'static Base {
        static CLEAN: std::sync::OnceLock<Base> = std::sync::OnceLock::new();
        static RECOVERING: std::sync::OnceLock<Base> = std::sync::OnceLock::new();
        match kind {
            BaseKind::Clean => CLEAN.get_or_init(|| build_base(BaseKind::Clean)),
            BaseKind::Recovering => RECOVERING.get_or_init(|| build_base(BaseKind::Recovering)),
        }
    }
}

/// The clean image ([`Base::get`]).
pub fn base_image() -> &'static Base {
    Base::get(BaseKind::Clean)
}

/// Builds a base: ACE's setup (directories `A`, `B`, `A/C`; files `foo` and `A/foo` with 16
/// KiB each) and the deep files (`A/C/E/`, `A/C/baz`, `A/C/E/baz` with 8 KiB each), on an
/// *aged* filesystem: before the setup's last commit, three generations logged fsync records —
/// creates, appends, xattrs, renames and unlinks much like the workloads' — so both halves of
/// every shard's log area hold stale records, and a record torn by a crash lies over old
/// record bytes, not zeroes. The recovering kind then logs [`RECOVERY_CHANGES`] and crashes.
fn build_base(kind: BaseKind) -> Base {
    let dev = MemDevice::new(config()).expect("memory device");
    // Fixed keys: the same directories in every process, so a seed replays the same trees.
    let dev = Filesystem::mkfs_seeded(
        Box::new(dev),
        &MkfsOptions {
            shards: 4,
            label: "ace".into(),
            group_blocks: Some(GROUP_BLOCKS),
        },
        0xace,
    )
    .expect("mkfs");
    let mut fs = Filesystem::mount(dev, mount_options()).expect("mount");
    for d in ["A", "B", "A/C", "A/C/E"] {
        let (parent, name) = split(d);
        let p = fs.resolve(parent).expect("parent");
        fs.mkdir(p, name.as_bytes(), 0o755, 0, 0).expect("mkdir");
    }
    for (f, len) in [
        ("foo", 16384),
        ("A/foo", 16384),
        ("A/C/baz", 8192),
        ("A/C/E/baz", 8192),
    ] {
        let (parent, name) = split(f);
        let p = fs.resolve(parent).expect("parent");
        let ino = fs
            .create(p, name.as_bytes(), 0o644, 0, 0)
            .expect("create")
            .ino;
        fs.write(ino, 0, &pattern(f, len)).expect("write");
    }
    fs.sync().expect("sync");
    age(&mut fs).expect("aging the image");
    // Every aging file's first fsync logs it (whatever else the log skips): at least 12
    // records over three generations.
    assert!(
        fs.log_stats().log_writes >= 12,
        "aging wrote too few records"
    );
    if kind == BaseKind::Clean {
        let tree = snapshot(&mut fs).expect("snapshot of the clean base");
        let image = mem_image(fs.unmount().expect("unmount"));
        return Base { kind, image, tree };
    }
    // A fresh mount, so the records below are the first of their generation.
    let mut fs = Filesystem::mount(fs.unmount().expect("unmount"), mount_options()).expect("mount");
    let logged = fs.log_stats().log_writes;
    for op in RECOVERY_CHANGES {
        apply(&mut fs, &op).unwrap_or_else(|e| panic!("recovering base: {op:?}: {e}"));
    }
    let records = fs.log_stats().log_writes - logged;
    assert!(
        records >= 6 && fs.log_stats().fallback_commits() == 0,
        "recovering base: {records} records, {} commits: every change must be logged",
        fs.log_stats().fallback_commits()
    );
    // Every change was fsynced, so the tree after replay is this one.
    let tree = snapshot(&mut fs).expect("snapshot of the recovering base");
    fs.drain_log().expect("records durable");
    let image = mem_image(fs.into_device());
    Base { kind, image, tree }
}

/// What the recovering base logs after the clean one and then loses to a crash: each change
/// fsynced (so its mount has one right answer), in records of several kinds — data carried in
/// the record and written in place, an xattr of a directory, a file created, moved between
/// directories and removed, a truncate — that leave the names as the setup made them (the
/// workloads' model of names starts from those).
pub const RECOVERY_CHANGES: [Step; 16] = [
    Step::Write {
        path: "foo",
        offset: 0,
        len: 4096,
        append: true,
    },
    Step::Fsync("foo"),
    Step::Write {
        path: "A/C/baz",
        offset: 8192,
        len: 16 * 4096,
        append: false,
    },
    Step::Fsync("A/C/baz"),
    Step::SetXattr("A/C/E", 3),
    Step::Fsync("A/C/E"),
    Step::Creat("B/bar"),
    Step::Write {
        path: "B/bar",
        offset: 0,
        len: 4096,
        append: true,
    },
    Step::Fsync("B/bar"),
    Step::Rename("B/bar", "A/bar"),
    Step::Fsync("A/bar"),
    Step::Fsync("B"),
    Step::Unlink("A/bar"),
    Step::Fsync("A"),
    Step::Truncate("A/foo", 10_000),
    Step::Fsync("A/foo"),
];

/// Fills both halves of the log areas with records of earlier generations, leaving the tree
/// as the setup made it.
fn age(fs: &mut Filesystem) -> Result<(), EngineError> {
    let root = fs.root();
    for generation in 0..3u8 {
        for (i, dir) in ["", "A", "B", "A/C"].into_iter().enumerate() {
            let d = fs.resolve(dir)?;
            let name = format!("aging{i}");
            let ino = fs.create(d, name.as_bytes(), 0o644, 0, 0)?.ino;
            fs.fsync(ino)?;
            fs.write(ino, 0, &pattern(&name, 4096 * (1 + i % 2)))?;
            fs.fsync(ino)?;
            fs.setxattr(ino, b"user.ace", &[generation; 40], XattrFlags::Any)?;
            fs.fdatasync(ino)?;
            fs.fsync(ino)?;
            fs.rename(d, name.as_bytes(), root, b"aged", RenameFlags::default())?;
            fs.fsync(root)?;
            fs.unlink(root, b"aged")?;
            fs.fsync(root)?;
        }
        fs.sync()?;
    }
    Ok(())
}
