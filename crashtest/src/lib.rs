//! Crash-consistency testing in the style of CrashMonkey/ACE and xfstests' dm-log-writes.
//!
//! A workload ([`workload`]) runs on a recording device. At every persistence point (each
//! fsync, fdatasync or sync returning) and at every flush, the crash state is rebuilt from the
//! write log — what the flushes made durable, and, in a reordering mode, random subsets of the
//! last epoch's writes with torn sectors — mounted (which replays whatever mount replays), and
//! checked against an oracle:
//! - every path persisted before the crash, and not changed since, has exactly its persisted
//!   state: data, size, mode, link count, names, symlink target, xattrs (fdatasync: data and
//!   size); a directory fsynced has its entries; after a sync the whole tree is identical;
//! - the tree checker passes;
//! - the filesystem is usable: a file can be created in every directory, then everything
//!   deleted, directories included, and the checker passes again.
//!
//! The oracle's expected states are snapshots of the live filesystem taken when each
//! persistence operation returned, so the crash test checks durability; the POSIX model tests
//! check semantics.

pub mod reactors;
pub mod workload;

use engine::{
    EngineError, FallocateMode, Filesystem, MkfsOptions, MountOptions, RenameFlags, XattrFlags,
};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image_into, CrashMode, Record, RecordingDevice};
use std::cell::RefCell;
use std::collections::BTreeMap;
use workload::{Falloc, Op};

thread_local! {
    static DEVICE: RefCell<Option<Box<dyn nvme::BlockDevice>>> = const { RefCell::new(None) };
    static IMAGE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// What a workload runs on and the oracle reads: the engine itself, or clients of running
/// reactors ([`reactors`]). The methods are the engine's.
pub trait Live {
    fn resolve(&mut self, path: &str) -> Result<u64, EngineError>;
    fn root(&self) -> u64;
    fn stat(&mut self, ino: u64) -> Result<engine::Stat, EngineError>;
    fn create(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn mkdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn symlink(&mut self, dir: u64, name: &[u8], target: &[u8]) -> Result<(), EngineError>;
    fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError>;
    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), EngineError>;
    fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn rename(&mut self, src: u64, from: &[u8], dst: u64, to: &[u8]) -> Result<(), EngineError>;
    fn setxattr(&mut self, ino: u64, name: &[u8], value: &[u8]) -> Result<(), EngineError>;
    fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<(), EngineError>;
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), EngineError>;
    fn fsync(&mut self, ino: u64) -> Result<(), EngineError>;
    fn fdatasync(&mut self, ino: u64) -> Result<(), EngineError>;
    fn sync(&mut self) -> Result<(), EngineError>;
    fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>, EngineError>;
    fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>, EngineError>;
    fn readdir(&mut self, ino: u64) -> Result<Vec<engine::DirEntry>, EngineError>;
    fn readlink(&mut self, ino: u64) -> Result<Vec<u8>, EngineError>;
    fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>, EngineError>;
}

impl Live for Filesystem {
    fn resolve(&mut self, path: &str) -> Result<u64, EngineError> {
        Filesystem::resolve(self, path)
    }
    fn root(&self) -> u64 {
        Filesystem::root(self)
    }
    fn stat(&mut self, ino: u64) -> Result<engine::Stat, EngineError> {
        Filesystem::stat(self, ino)
    }
    fn create(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::create(self, dir, name, 0o644, 0, 0).map(drop)
    }
    fn mkdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::mkdir(self, dir, name, 0o755, 0, 0).map(drop)
    }
    fn symlink(&mut self, dir: u64, name: &[u8], target: &[u8]) -> Result<(), EngineError> {
        Filesystem::symlink(self, dir, name, target, 0, 0).map(drop)
    }
    fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        Filesystem::fallocate(self, ino, mode, offset, len)
    }
    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), EngineError> {
        Filesystem::write(self, ino, offset, data).map(drop)
    }
    fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::link(self, ino, dir, name).map(drop)
    }
    fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::unlink(self, dir, name)
    }
    fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::rmdir(self, dir, name)
    }
    fn rename(&mut self, src: u64, from: &[u8], dst: u64, to: &[u8]) -> Result<(), EngineError> {
        Filesystem::rename(self, src, from, dst, to, RenameFlags::default())
    }
    fn setxattr(&mut self, ino: u64, name: &[u8], value: &[u8]) -> Result<(), EngineError> {
        Filesystem::setxattr(self, ino, name, value, XattrFlags::Any)
    }
    fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::removexattr(self, ino, name)
    }
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), EngineError> {
        Filesystem::truncate(self, ino, size)
    }
    fn fsync(&mut self, ino: u64) -> Result<(), EngineError> {
        Filesystem::fsync(self, ino)
    }
    fn fdatasync(&mut self, ino: u64) -> Result<(), EngineError> {
        Filesystem::fdatasync(self, ino)
    }
    fn sync(&mut self) -> Result<(), EngineError> {
        Filesystem::sync(self)
    }
    fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>, EngineError> {
        Filesystem::listxattr(self, ino)
    }
    fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>, EngineError> {
        Filesystem::getxattr(self, ino, name)
    }
    fn readdir(&mut self, ino: u64) -> Result<Vec<engine::DirEntry>, EngineError> {
        Filesystem::readdir(self, ino, 0, usize::MAX)
    }
    fn readlink(&mut self, ino: u64) -> Result<Vec<u8>, EngineError> {
        Filesystem::readlink(self, ino)
    }
    fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>, EngineError> {
        Filesystem::read(self, ino, offset, len)
    }
}

/// What a path held when it was persisted (or when the crash state is inspected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File {
        /// Inode numbers survive a crash, so they identify a file's names across it.
        ino: u64,
        data: Vec<u8>,
        mode: u32,
        nlink: u32,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Dir {
        names: Vec<Vec<u8>>,
        mode: u32,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Symlink {
        target: Vec<u8>,
    },
}

pub type Tree = BTreeMap<String, Entry>;

impl Entry {
    /// A one-line description for failure messages (content as length and crc32c).
    pub fn summary(&self) -> String {
        let xattr_names = |x: &[(Vec<u8>, Vec<u8>)]| -> Vec<String> {
            x.iter()
                .map(|(n, v)| format!("{}={}B", String::from_utf8_lossy(n), v.len()))
                .collect()
        };
        match self {
            Entry::File {
                data,
                mode,
                nlink,
                xattrs,
                ..
            } => format!(
                "file {} bytes crc {:#010x} mode {mode:o} nlink {nlink} xattrs {:?}",
                data.len(),
                crc32c::crc32c(data),
                xattr_names(xattrs)
            ),
            Entry::Dir {
                names,
                mode,
                xattrs,
            } => format!(
                "dir {:?} mode {mode:o} xattrs {:?}",
                names
                    .iter()
                    .map(|n| String::from_utf8_lossy(n).into_owned())
                    .collect::<Vec<_>>(),
                xattr_names(xattrs)
            ),
            Entry::Symlink { target } => format!("symlink -> {}", String::from_utf8_lossy(target)),
        }
    }
}

fn summarize(entry: Option<&Entry>) -> String {
    entry.map_or("absent".to_string(), Entry::summary)
}

/// What one persistence point promises.
#[derive(Debug, Clone)]
pub(crate) enum Promise {
    /// fsync of a file or symlink: the whole entry; of a directory: its names.
    Whole(String, Option<Entry>),
    /// fdatasync: data and size only.
    Data(String, Option<Vec<u8>>),
    /// sync: the whole tree.
    All(Tree),
}

/// The outcome of one workload.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    pub crash_states: u64,
    pub persistence_points: u64,
    /// How the workload's persistence points were served: log records written, fsyncs that
    /// found nothing new, fsyncs that fell back to a commit.
    pub log_writes: u64,
    pub already_logged: u64,
    pub fallback_commits: u64,
}

impl Outcome {
    pub fn add(&mut self, other: &Outcome) {
        self.crash_states += other.crash_states;
        self.persistence_points += other.persistence_points;
        self.log_writes += other.log_writes;
        self.already_logged += other.already_logged;
        self.fallback_commits += other.fallback_commits;
    }
}

const CAPACITY: u64 = 4 << 20;

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

/// The image every workload starts from (built once).
pub fn base_image() -> Vec<u8> {
    let dev = MemDevice::new(config()).expect("memory device");
    let dev = Filesystem::mkfs(
        Box::new(dev),
        &MkfsOptions {
            shards: 4,
            label: "ace".into(),
        },
    )
    .expect("mkfs");
    let mut fs = Filesystem::mount(dev, MountOptions::default()).expect("mount");
    for d in ["A", "B", "A/C"] {
        let (parent, name) = split(d);
        let p = fs.resolve(parent).expect("parent");
        fs.mkdir(p, name.as_bytes(), 0o755, 0, 0).expect("mkdir");
    }
    for f in ["foo", "A/foo"] {
        let (parent, name) = split(f);
        let p = fs.resolve(parent).expect("parent");
        let ino = fs
            .create(p, name.as_bytes(), 0o644, 0, 0)
            .expect("create")
            .ino;
        fs.write(ino, 0, &pattern(f, 16384)).expect("write");
    }
    mem_image(fs.unmount().expect("unmount"))
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

fn pattern(seed: &str, len: usize) -> Vec<u8> {
    let salt = seed
        .bytes()
        .fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ salt ^ (i >> 9) as u8)
        .collect()
}

/// Applies one operation; errors (a name that does not exist, a non-empty directory...) are
/// part of the workload's meaning and are ignored, as a real program's would be.
pub(crate) fn apply<F: Live>(fs: &mut F, op: &Op) -> Result<(), EngineError> {
    fn lookup<F: Live>(fs: &mut F, path: &str) -> Result<u64, EngineError> {
        fs.resolve(path)
    }
    fn parent_of<F: Live>(
        fs: &mut F,
        path: &'static str,
    ) -> Result<(u64, &'static str), EngineError> {
        let (parent, name) = split(path);
        Ok((fs.resolve(parent)?, name))
    }
    match *op {
        Op::Creat(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.create(dir, name.as_bytes())
        }
        Op::Mkdir(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.mkdir(dir, name.as_bytes())
        }
        Op::Falloc {
            path,
            mode,
            offset,
            len,
        } => {
            let ino = lookup(fs, path)?;
            let mode = match mode {
                Falloc::KeepSize => FallocateMode {
                    keep_size: true,
                    ..Default::default()
                },
                Falloc::PunchHole => FallocateMode {
                    keep_size: true,
                    punch_hole: true,
                    ..Default::default()
                },
                Falloc::ZeroRange => FallocateMode {
                    zero_range: true,
                    ..Default::default()
                },
            };
            fs.fallocate(ino, mode, offset, len)
        }
        Op::Write {
            path,
            offset,
            len,
            append,
        } => {
            let ino = lookup(fs, path)?;
            let at = if append { fs.stat(ino)?.size } else { offset };
            fs.write(ino, at, &pattern(&format!("{path}{at}"), len as usize))
        }
        Op::Link(a, b) => {
            let ino = lookup(fs, a)?;
            let (dir, name) = parent_of(fs, b)?;
            fs.link(ino, dir, name.as_bytes())
        }
        Op::Unlink(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.unlink(dir, name.as_bytes())
        }
        Op::Remove(p) => {
            let (dir, name) = parent_of(fs, p)?;
            match fs.rmdir(dir, name.as_bytes()) {
                Err(EngineError::NotDir) => fs.unlink(dir, name.as_bytes()),
                other => other,
            }
        }
        Op::Rename(a, b) => {
            let (src, sname) = parent_of(fs, a)?;
            let (dst, dname) = parent_of(fs, b)?;
            fs.rename(src, sname.as_bytes(), dst, dname.as_bytes())
        }
        Op::SetXattr(p, v) => {
            let ino = lookup(fs, p)?;
            fs.setxattr(ino, b"user.ace", &[v; 40])
        }
        Op::RemoveXattr(p) => {
            let ino = lookup(fs, p)?;
            fs.removexattr(ino, b"user.ace")
        }
        Op::Truncate(p, size) => {
            let ino = lookup(fs, p)?;
            fs.truncate(ino, size)
        }
        Op::Symlink(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.symlink(dir, name.as_bytes(), b"foo")
        }
        Op::Fsync(p) => {
            let ino = lookup(fs, p)?;
            fs.fsync(ino)
        }
        Op::Fdatasync(p) => {
            let ino = lookup(fs, p)?;
            fs.fdatasync(ino)
        }
        Op::Sync => fs.sync(),
    }
}

fn entry_of<F: Live>(fs: &mut F, ino: u64) -> Result<Entry, EngineError> {
    let st = fs.stat(ino)?;
    let mut xattrs = Vec::new();
    if !st.is_symlink() {
        let mut names = fs.listxattr(ino)?;
        names.sort();
        for name in names {
            let value = fs.getxattr(ino, &name)?;
            xattrs.push((name, value));
        }
    }
    Ok(if st.is_dir() {
        let mut names: Vec<Vec<u8>> = fs.readdir(ino)?.into_iter().map(|e| e.name).collect();
        names.sort();
        Entry::Dir {
            names,
            mode: st.mode,
            xattrs,
        }
    } else if st.is_symlink() {
        Entry::Symlink {
            target: fs.readlink(ino)?,
        }
    } else {
        Entry::File {
            ino,
            data: fs.read(ino, 0, st.size as usize)?,
            mode: st.mode,
            nlink: st.nlink,
            xattrs,
        }
    })
}

/// Every path of the filesystem with its entry.
pub fn snapshot<F: Live>(fs: &mut F) -> Result<Tree, EngineError> {
    let mut tree = Tree::new();
    let mut stack = vec![(String::new(), fs.root())];
    while let Some((path, ino)) = stack.pop() {
        let entry = entry_of(fs, ino)?;
        if matches!(entry, Entry::Dir { .. }) {
            for child in fs.readdir(ino)? {
                let name = String::from_utf8_lossy(&child.name).into_owned();
                let child_path = if path.is_empty() {
                    name
                } else {
                    format!("{path}/{name}")
                };
                stack.push((child_path, child.ino));
            }
        }
        tree.insert(path, entry);
    }
    Ok(tree)
}

/// Every path naming file `ino`.
fn names_of(tree: &Tree, ino: u64) -> Vec<&String> {
    tree.iter()
        .filter(|(_, e)| matches!(e, Entry::File { ino: i, .. } if *i == ino))
        .map(|(p, _)| p)
        .collect()
}

fn data_of(entry: Option<&Entry>) -> Option<Vec<u8>> {
    match entry {
        Some(Entry::File { data, .. }) => Some(data.clone()),
        _ => None,
    }
}

/// Runs one workload and checks every crash state. `Err` describes the first violation.
pub fn run(base: &[u8], ops: &[Op], seed: u64) -> Result<Outcome, String> {
    let dev = MemDevice::from_image(base, config()).map_err(|e| e.to_string())?;
    let recording = RecordingDevice::new(dev);
    let log = recording.log();
    let mut fs = Filesystem::mount(Box::new(recording), MountOptions::default())
        .map_err(|e| e.to_string())?;
    let points = run_ops(&mut fs, ops, &log)?;
    let stats = fs.log_stats();
    drop(fs);
    let records = log.snapshot();
    let outcome = Outcome {
        persistence_points: points.len() as u64,
        log_writes: stats.log_writes,
        already_logged: stats.already_logged,
        fallback_commits: stats.fallback_commits(),
        ..Default::default()
    };
    check_points(base, &records, &points, seed, outcome)
}

/// Applies `ops`, recording a persistence point (write-log length, promise, live tree) as
/// each persistence operation returns.
pub(crate) fn run_ops<F: Live>(
    fs: &mut F,
    ops: &[Op],
    log: &nvme::wrap::WriteLog,
) -> Result<Vec<Point>, String> {
    run_ops_committing(fs, ops, log, |_, _| false)
}

/// As [`run_ops`], where `commits(fs, op)` says that `op`, which just succeeded, committed the
/// whole filesystem before returning (a directory rename with several reactors): a point
/// promising the whole tree, like a sync.
pub(crate) fn run_ops_committing<F: Live>(
    fs: &mut F,
    ops: &[Op],
    log: &nvme::wrap::WriteLog,
    commits: impl Fn(&mut F, &Op) -> bool,
) -> Result<Vec<Point>, String> {
    let mut points: Vec<Point> = Vec::new();
    for op in ops {
        let result = apply(fs, op);
        if result.is_ok() && commits(fs, op) {
            points.push(persistence_point(fs, &Op::Sync, log.len())?);
            continue;
        }
        if let Err(
            e @ (EngineError::Device(_)
            | EngineError::Corrupt { .. }
            | EngineError::ReadOnly(_)
            | EngineError::NoSpace),
        ) = &result
        {
            return Err(format!("{op:?} failed: {e}"));
        }
        if op.is_persistence() {
            if let Err(e) = &result {
                if !matches!(e, EngineError::NotFound) {
                    return Err(format!("{op:?} failed: {e}"));
                }
                continue;
            }
            points.push(persistence_point(fs, op, log.len())?);
        }
    }
    Ok(points)
}

/// One persistence point: the write-log length when it returned, what it promised, and the
/// live tree at that moment.
pub(crate) type Point = (usize, Promise, Tree);

/// The live state and promise of persistence operation `op`, which just returned.
pub(crate) fn persistence_point<F: Live>(fs: &mut F, op: &Op, at: usize) -> Result<Point, String> {
    let live = snapshot(fs).map_err(|e| format!("snapshot after {op:?}: {e}"))?;
    let promise = match op {
        Op::Sync => Promise::All(live.clone()),
        Op::Fsync(p) => Promise::Whole(p.to_string(), live.get(*p).cloned()),
        Op::Fdatasync(p) => Promise::Data(p.to_string(), data_of(live.get(*p))),
        _ => unreachable!("persistence op"),
    };
    Ok((at, promise, live))
}

/// Checks every crash state the write log allows against the persistence points.
pub(crate) fn check_points(
    base: &[u8],
    records: &[Record],
    points: &[Point],
    seed: u64,
    mut outcome: Outcome,
) -> Result<Outcome, String> {
    // Crash points: every persistence point, and every flush both before it completes (the
    // epoch's writes in flight: in the torn mode a random subset lands, sectors torn) and after.
    let mut cuts: Vec<usize> = points.iter().map(|(cut, _, _)| *cut).collect();
    for (i, record) in records.iter().enumerate() {
        if matches!(record, Record::Flush { .. }) {
            cuts.push(i);
            cuts.push(i + 1);
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    for cut in cuts {
        let promised: Vec<&(usize, Promise, Tree)> =
            points.iter().filter(|(at, _, _)| *at <= cut).collect();
        // A cut before a flush completes falls inside the persistence operation that returns
        // next: what it was writing may have landed, so each path may also show the state that
        // operation persisted.
        let in_flight = points
            .iter()
            .find(|(at, _, _)| *at > cut)
            .map(|(_, _, tree)| tree);
        for mode in [
            CrashMode::DurableOnly,
            CrashMode::Torn {
                seed: seed ^ cut as u64,
            },
        ] {
            IMAGE.with_borrow_mut(|image| crash_image_into(base, 512, records, cut, mode, image));
            let context = format!("crash after record {cut} of {} ({mode:?})", records.len());
            IMAGE.with_borrow(|image| check_state(image, &promised, in_flight, &context))?;
            outcome.crash_states += 1;
        }
    }
    Ok(outcome)
}

fn check_state(
    image: &[u8],
    promised: &[&(usize, Promise, Tree)],
    in_flight: Option<&Tree>,
    context: &str,
) -> Result<(), String> {
    // One memory device per thread, refilled for each crash state: mapping a fresh device for
    // each of millions of states would spend most of the time in the kernel.
    let mut dev = match DEVICE.take() {
        Some(dev) => dev,
        None => Box::new(MemDevice::new(config()).map_err(|e| e.to_string())?)
            as Box<dyn nvme::BlockDevice>,
    };
    dev.sim_access()
        .expect("a memory device")
        .sim_write(0, image);
    let mut fs = Filesystem::mount(dev, MountOptions::default())
        .map_err(|e| format!("{context}: mount failed: {e}"))?;
    let result = check_mounted(&mut fs, promised, in_flight, context);
    DEVICE.set(Some(fs.into_device()));
    result
}

fn check_mounted(
    fs: &mut Filesystem,
    promised: &[&(usize, Promise, Tree)],
    in_flight: Option<&Tree>,
    context: &str,
) -> Result<(), String> {
    let now = snapshot(fs).map_err(|e| format!("{context}: walking the tree: {e}"))?;
    let latest = promised.last().map(|(_, _, tree)| tree);
    // The path shows what the in-flight persistence operation was making durable.
    let as_in_flight = |path: &str| in_flight.is_some_and(|t| t.get(path) == now.get(path));
    for (_, promise, at_point) in promised.iter() {
        // A promise binds while what it promised is still what the live filesystem held at
        // the latest persistence point before the crash (later changes may supersede it).
        let unchanged = |path: &str| latest.is_some_and(|l| l.get(path) == at_point.get(path));
        match promise {
            // After a sync every path is promised: each one that has not changed since must be
            // exactly as synced (present or absent).
            Promise::All(tree) => {
                for path in tree.keys().chain(now.keys()) {
                    if unchanged(path) && tree.get(path) != now.get(path) && !as_in_flight(path) {
                        return Err(format!(
                            "{context}: after sync /{path} should be {}, found {}",
                            summarize(tree.get(path)),
                            summarize(now.get(path))
                        ));
                    }
                }
            }
            Promise::Whole(path, entry) if unchanged(path) => {
                let found = now.get(path);
                let ok = match (entry, found) {
                    (Some(Entry::Dir { names, .. }), Some(Entry::Dir { names: got, .. })) => {
                        names == got
                    }
                    (expected, found) => expected.as_ref() == found,
                };
                if !ok && !as_in_flight(path) {
                    return Err(format!(
                        "{context}: fsync({path}) promised {}, found {}",
                        summarize(entry.as_ref()),
                        summarize(found)
                    ));
                }
                // An fsynced file's names are all persisted, and only those: a name is in
                // exactly one place after a rename, and every hard link is there.
                if let Some(Entry::File { ino, .. }) = entry {
                    let promised_names = names_of(at_point, *ino);
                    if latest.is_some_and(|l| names_of(l, *ino) == promised_names)
                        && names_of(&now, *ino) != promised_names
                        && in_flight.is_none_or(|t| names_of(t, *ino) != names_of(&now, *ino))
                    {
                        return Err(format!(
                            "{context}: fsync({path}) promised the names {promised_names:?}, found {:?}",
                            names_of(&now, *ino)
                        ));
                    }
                }
            }
            Promise::Data(path, data) if unchanged(path) => {
                let found = data_of(now.get(path));
                if data.is_some() && &found != data && !as_in_flight(path) {
                    return Err(format!(
                        "{context}: fdatasync({path}) promised {} bytes, found {:?}",
                        data.as_ref().map_or(0, |d| d.len()),
                        found.map(|d| d.len())
                    ));
                }
            }
            _ => {}
        }
    }
    fs.check().map_err(|e| format!("{context}: checker: {e}"))?;
    usable(fs, &now).map_err(|e| format!("{context}: not usable: {e}"))?;
    fs.check()
        .map(drop)
        .map_err(|e| format!("{context}: checker after use: {e}"))
}

/// Creates a file in every directory, then deletes everything, deepest first.
fn usable(fs: &mut Filesystem, tree: &Tree) -> Result<(), EngineError> {
    let dirs: Vec<&String> = tree
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Dir { .. }))
        .map(|(p, _)| p)
        .collect();
    for dir in &dirs {
        let ino = fs.resolve(dir)?;
        fs.create(ino, b"usable-probe", 0o644, 0, 0)?;
    }
    let mut paths: Vec<String> = tree.keys().filter(|p| !p.is_empty()).cloned().collect();
    paths.extend(dirs.iter().map(|d| {
        if d.is_empty() {
            "usable-probe".to_string()
        } else {
            format!("{d}/usable-probe")
        }
    }));
    paths.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    for path in paths {
        let (parent, name) = split(&path);
        let dir = fs.resolve(parent)?;
        match fs.rmdir(dir, name.as_bytes()) {
            Err(EngineError::NotDir) => fs.unlink(dir, name.as_bytes())?,
            other => other?,
        }
    }
    fs.commit()?;
    Ok(())
}
