//! Workloads over the ACE operation set (Mohan et al., "Finding Crash-Consistency Bugs with
//! Bounded Black-Box Crash Testing", OSDI 2018), on ACE's file set: `foo`, `bar`, `A/`, `B/`,
//! `A/C/`, `A/foo`, `A/bar`, `B/foo`, `B/bar`, `A/C/foo`, `A/C/bar` (plus `B/D/` for mkdir).
//!
//! Every workload starts from the same setup (directories `A`, `B`, `A/C`; files `foo` and
//! `A/foo` with 16 KiB of data; synced), then runs core operations, each followed by a
//! persistence operation (fsync or fdatasync of a file or directory, or sync). Sequences of one
//! and of two core operations are enumerated exhaustively; [`sample`] draws from the same space.
//!
//! Beyond ACE, the setup holds files two and three levels below `A` (`A/C/baz`, `A/C/E/baz`,
//! [`DEEP_FILES`]), the core operations change them wherever a directory rename above them
//! moved them, and a directory rename is followed by an fsync of each file it moved: the
//! shapes in which an fsync's walk up its ancestors must pass directories whose own names
//! are durable to reach one renamed in this generation (`rename A B/D; fsync B/D/C/baz`).

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

pub const FILES: [&str; 8] = [
    "foo", "bar", "A/foo", "A/bar", "B/foo", "B/bar", "A/C/foo", "A/C/bar",
];
pub const DIRS: [&str; 5] = ["", "A", "B", "A/C", "B/D"];

/// The deep files of the setup, at every place the core directory renames (`A/C -> B/C`,
/// `A -> B/D`) can move them; the new name created beside the three-level one.
pub const DEEP_FILES: [&str; 6] = [
    "A/C/baz",
    "A/C/E/baz",
    "B/C/baz",
    "B/C/E/baz",
    "B/D/C/baz",
    "B/D/C/E/baz",
];
pub const DEEP_NEW: [&str; 3] = ["A/C/E/qux", "B/C/E/qux", "B/D/C/E/qux"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Falloc {
    KeepSize,
    PunchHole,
    ZeroRange,
}

/// One step of a workload: a core operation on ACE's file set, or a persistence operation.
/// A step names paths, not inodes; the crash tester turns it into engine calls or reactor
/// requests ([`reactor::Op`]), which is why it is not called an op itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Creat(&'static str),
    Mkdir(&'static str),
    Falloc {
        path: &'static str,
        mode: Falloc,
        offset: u64,
        len: u64,
    },
    /// `append`: at the end of the file; otherwise at `offset`.
    Write {
        path: &'static str,
        offset: u64,
        len: u64,
        append: bool,
    },
    Link(&'static str, &'static str),
    Unlink(&'static str),
    /// rmdir for directories, unlink otherwise.
    Remove(&'static str),
    Rename(&'static str, &'static str),
    SetXattr(&'static str, u8),
    RemoveXattr(&'static str),
    Truncate(&'static str, u64),
    Symlink(&'static str),
    // Persistence operations.
    Fsync(&'static str),
    Fdatasync(&'static str),
    Sync,
}

impl Step {
    pub fn is_persistence(&self) -> bool {
        matches!(self, Step::Fsync(_) | Step::Fdatasync(_) | Step::Sync)
    }

    /// The paths a core operation touches (for choosing its persistence operations).
    fn touched(&self) -> Vec<&'static str> {
        match self {
            Step::Creat(p)
            | Step::Mkdir(p)
            | Step::Unlink(p)
            | Step::Remove(p)
            | Step::SetXattr(p, _)
            | Step::RemoveXattr(p)
            | Step::Truncate(p, _)
            | Step::Symlink(p) => vec![p],
            Step::Falloc { path, .. } | Step::Write { path, .. } => vec![path],
            Step::Link(a, b) | Step::Rename(a, b) => vec![a, b],
            _ => vec![],
        }
    }
}

fn parent(path: &'static str) -> &'static str {
    path.rfind('/').map(|i| &path[..i]).unwrap_or("")
}

/// Every core operation with its arguments.
pub fn core_ops() -> Vec<Step> {
    let mut ops = Vec::new();
    for f in FILES {
        ops.push(Step::Creat(f));
        ops.push(Step::Write {
            path: f,
            offset: 0,
            len: 4096,
            append: true,
        });
        ops.push(Step::Write {
            path: f,
            offset: 0,
            len: 8192,
            append: false,
        });
        ops.push(Step::Write {
            path: f,
            offset: 1000,
            len: 3000,
            append: false,
        });
        // More than an fsync record carries (engine::log::EMBED_MAX_BLOCKS): its fsync writes
        // the data in place beside the record.
        ops.push(Step::Write {
            path: f,
            offset: 0,
            len: 12 * 4096,
            append: true,
        });
        // Into the range the KEEP_SIZE fallocate below preallocates: after it, the write
        // fills the preallocated blocks in place instead of allocating.
        ops.push(Step::Write {
            path: f,
            offset: 16384,
            len: 8192,
            append: false,
        });
        for (mode, offset, len) in [
            (Falloc::KeepSize, 16384, 8192),
            (Falloc::PunchHole, 2048, 6000),
            (Falloc::ZeroRange, 4096, 4096),
        ] {
            ops.push(Step::Falloc {
                path: f,
                mode,
                offset,
                len,
            });
        }
        ops.push(Step::Unlink(f));
        ops.push(Step::SetXattr(f, 1));
        ops.push(Step::RemoveXattr(f));
        ops.push(Step::Truncate(f, 2500));
        ops.push(Step::Truncate(f, 0));
        ops.push(Step::Symlink(f));
    }
    // Changes to files below a directory a rename may have moved, named at each place.
    for f in DEEP_FILES {
        ops.push(Step::Write {
            path: f,
            offset: 0,
            len: 4096,
            append: true,
        });
        ops.push(Step::SetXattr(f, 2));
    }
    for f in DEEP_NEW {
        ops.push(Step::Creat(f));
    }
    for d in ["A", "B", "A/C", "B/D"] {
        ops.push(Step::Mkdir(d));
        ops.push(Step::Remove(d));
    }
    for (a, b) in [
        ("foo", "bar"),
        ("foo", "A/bar"),
        ("A/foo", "B/foo"),
        ("A/foo", "A/bar"),
        ("A/foo", "A/C/foo"),
        ("bar", "foo"),
    ] {
        ops.push(Step::Link(a, b));
        ops.push(Step::Rename(a, b));
    }
    ops.push(Step::Rename("A/C", "B/C"));
    ops.push(Step::Rename("A", "B/D"));
    ops
}

/// Persistence choices after `op`: fsync and fdatasync of what it touched, fsync of their
/// parents, and sync; after a directory rename, also fsync and fdatasync of each file it moved
/// two or more levels down. Each names a path that exists after `op` ([`Namespace::existing`]).
fn persistence_after(op: &Step, names: &Namespace) -> Vec<Step> {
    let mut out = vec![Step::Sync];
    for p in op.touched() {
        out.push(Step::Fsync(p));
        out.push(Step::Fdatasync(p));
        out.push(Step::Fsync(parent(p)));
    }
    out.dedup();
    if let Step::Rename(_, to) = *op {
        for moved in names.files_below(to).filter(|p| parent(p) != to) {
            out.push(Step::Fsync(moved));
            out.push(Step::Fdatasync(moved));
        }
    }
    // Retargeted after the dedup, so every operation has as many choices whatever it did
    // (578 workloads of length one, 578² of length two).
    for persist in &mut out {
        *persist = match *persist {
            Step::Fsync(p) => Step::Fsync(names.existing(p)),
            Step::Fdatasync(p) => Step::Fdatasync(names.existing(p)),
            Step::Sync => Step::Sync,
            _ => unreachable!("a persistence op"),
        };
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
}

/// Which of the workload paths exist, and as what, after some core operations from the setup:
/// a model of the operations' effect on names, so that every fsync a workload holds names a
/// path that exists when it runs (one that does not would check nothing: it fails with
/// NotFound). Inode identities are kept so a rename between two names of one file is the
/// no-op POSIX says it is.
#[derive(Debug, Clone)]
pub struct Namespace {
    paths: std::collections::BTreeMap<&'static str, (Kind, u32)>,
    next_ino: u32,
}

impl Default for Namespace {
    fn default() -> Self {
        Namespace::setup()
    }
}

/// Every path a workload can name (the files, the directories, their renamed places).
fn all_paths() -> impl Iterator<Item = &'static str> {
    FILES
        .into_iter()
        .chain(DIRS)
        .chain([
            "B/C",
            "B/D/foo",
            "B/D/bar",
            "B/D/C",
            "B/D/C/foo",
            "B/D/C/bar",
            "B/C/foo",
            "B/C/bar",
            "A/C/E",
            "B/C/E",
            "B/D/C/E",
        ])
        .chain(DEEP_FILES)
        .chain(DEEP_NEW)
}

/// The `&'static str` for a path that is one of [`all_paths`].
fn interned(path: &str) -> Option<&'static str> {
    all_paths().find(|p| *p == path)
}

impl Namespace {
    /// The setup every workload starts from: `A`, `B`, `A/C`, `A/C/E`, `foo`, `A/foo`,
    /// `A/C/baz`, `A/C/E/baz`.
    pub fn setup() -> Namespace {
        let mut names = Namespace {
            paths: Default::default(),
            next_ino: 0,
        };
        for (path, kind) in [
            ("", Kind::Dir),
            ("A", Kind::Dir),
            ("B", Kind::Dir),
            ("A/C", Kind::Dir),
            ("A/C/E", Kind::Dir),
            ("foo", Kind::File),
            ("A/foo", Kind::File),
            ("A/C/baz", Kind::File),
            ("A/C/E/baz", Kind::File),
        ] {
            names.add(path, kind);
        }
        names
    }

    /// The namespace after `ops` (persistence operations change nothing).
    pub fn after(ops: &[Step]) -> Namespace {
        let mut names = Namespace::setup();
        for op in ops {
            names.apply(op);
        }
        names
    }

    fn add(&mut self, path: &'static str, kind: Kind) {
        self.next_ino += 1;
        self.paths.insert(path, (kind, self.next_ino));
    }

    fn kind(&self, path: &str) -> Option<Kind> {
        self.paths.get(path).map(|(k, _)| *k)
    }

    pub fn exists(&self, path: &str) -> bool {
        self.paths.contains_key(path)
    }

    /// `path` if it exists, else its nearest existing ancestor (the root always does).
    pub fn existing(&self, path: &'static str) -> &'static str {
        let mut p = path;
        while !self.exists(p) {
            p = parent(p);
        }
        p
    }

    /// The regular files below directory `dir` (its descendants at any depth).
    fn files_below<'a>(&'a self, dir: &'a str) -> impl Iterator<Item = &'static str> + 'a {
        self.paths
            .iter()
            .filter(move |(p, (kind, _))| {
                *kind == Kind::File && p.len() > dir.len() + 1 && p.starts_with(dir) && {
                    p.as_bytes()[dir.len()] == b'/'
                }
            })
            .map(|(p, _)| *p)
    }

    fn is_empty_dir(&self, path: &str) -> bool {
        self.kind(path) == Some(Kind::Dir)
            && !self
                .paths
                .keys()
                .any(|p| !p.is_empty() && parent(p) == path)
    }

    /// A new name can go at `path`: its parent is a directory and the name is free.
    fn can_create(&self, path: &str) -> bool {
        !self.exists(path) && self.kind(parent_str(path)) == Some(Kind::Dir)
    }

    /// Every existing path, sorted.
    pub fn paths(&self) -> Vec<String> {
        self.paths.keys().map(|p| p.to_string()).collect()
    }

    /// Applies a core operation's effect on names (persistence operations have none).
    pub fn apply(&mut self, op: &Step) {
        match *op {
            Step::Creat(p) if self.can_create(p) => self.add(p, Kind::File),
            Step::Mkdir(p) if self.can_create(p) => self.add(p, Kind::Dir),
            Step::Symlink(p) if self.can_create(p) => self.add(p, Kind::Symlink),
            Step::Link(a, b) => {
                if let Some(&(kind, ino)) = self.paths.get(a) {
                    if kind != Kind::Dir && self.can_create(b) {
                        self.paths.insert(b, (kind, ino));
                    }
                }
            }
            Step::Unlink(p) if matches!(self.kind(p), Some(Kind::File | Kind::Symlink)) => {
                self.paths.remove(p);
            }
            Step::Remove(p)
                if matches!(self.kind(p), Some(Kind::File | Kind::Symlink))
                    || (!p.is_empty() && self.is_empty_dir(p)) =>
            {
                self.paths.remove(p);
            }
            Step::Rename(a, b) => self.rename(a, b),
            _ => {}
        }
    }

    fn rename(&mut self, a: &'static str, b: &'static str) {
        let Some(&(kind, ino)) = self.paths.get(a) else {
            return;
        };
        if a == b || self.kind(parent_str(b)) != Some(Kind::Dir) {
            return;
        }
        // Into its own subtree: EINVAL.
        if b.starts_with(&format!("{a}/")) {
            return;
        }
        match self.paths.get(b) {
            // Two names of one file: nothing happens.
            Some(&(_, other)) if other == ino => return,
            // Onto a directory: only a directory, and only onto an empty one (EISDIR,
            // ENOTEMPTY); a directory onto anything else is ENOTDIR. A directory onto an
            // empty one replaces it (a sampled workload found the model calling that a
            // failure, so it fsynced a path the rename had moved).
            Some(&(Kind::Dir, _)) if kind != Kind::Dir || !self.is_empty_dir(b) => return,
            Some(&(other, _)) if kind == Kind::Dir && other != Kind::Dir => return,
            _ => {}
        }
        self.paths.remove(b);
        let moved: Vec<(&'static str, (Kind, u32))> = self
            .paths
            .iter()
            .filter(|(p, _)| **p == a || p.starts_with(&format!("{a}/")))
            .map(|(p, v)| (*p, *v))
            .collect();
        for (p, _) in &moved {
            self.paths.remove(p);
        }
        for (p, v) in moved {
            let to = format!("{b}{}", &p[a.len()..]);
            let to = interned(&to)
                .unwrap_or_else(|| panic!("rename {a} -> {b}: {to} is not a workload path"));
            self.paths.insert(to, v);
        }
    }
}

fn parent_str(path: &str) -> &str {
    path.rfind('/').map(|i| &path[..i]).unwrap_or("")
}

/// Every workload of `length` core operations (1 or 2), each followed by a persistence op.
pub fn exhaustive(length: usize) -> Vec<Vec<Step>> {
    let core = core_ops();
    let mut out: Vec<Vec<Step>> = vec![vec![]];
    for _ in 0..length {
        let mut next = Vec::new();
        for prefix in &out {
            let before = Namespace::after(prefix);
            for op in &core {
                let mut names = before.clone();
                names.apply(op);
                for persist in persistence_after(op, &names) {
                    let mut w = prefix.clone();
                    w.push(op.clone());
                    w.push(persist);
                    next.push(w);
                }
            }
        }
        out = next;
    }
    out
}

/// `count` workloads of length 1 or 2 drawn with `seed` from the exhaustive space.
pub fn sample(count: usize, seed: u64) -> Vec<Vec<Step>> {
    let core = core_ops();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let length = rng.random_range(1..=2);
            let mut w = Vec::new();
            let mut names = Namespace::setup();
            for _ in 0..length {
                let op = core[rng.random_range(0..core.len())].clone();
                names.apply(&op);
                let persist = persistence_after(&op, &names);
                let p = persist[rng.random_range(0..persist.len())].clone();
                w.push(op);
                w.push(p);
            }
            w
        })
        .collect()
}
