//! Workloads over the ACE operation set (Mohan et al., "Finding Crash-Consistency Bugs with
//! Bounded Black-Box Crash Testing", OSDI 2018), on ACE's file set: `foo`, `bar`, `A/`, `B/`,
//! `A/C/`, `A/foo`, `A/bar`, `B/foo`, `B/bar`, `A/C/foo`, `A/C/bar` (plus `B/D/` for mkdir).
//!
//! Every workload starts from the same setup (directories `A`, `B`, `A/C`; files `foo` and
//! `A/foo` with 16 KiB of data; synced), then runs core operations, each followed by a
//! persistence operation (fsync or fdatasync of a file or directory, or sync). Sequences of one
//! and of two core operations are enumerated exhaustively; [`sample`] draws from the same space.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

pub const FILES: [&str; 8] = [
    "foo", "bar", "A/foo", "A/bar", "B/foo", "B/bar", "A/C/foo", "A/C/bar",
];
pub const DIRS: [&str; 5] = ["", "A", "B", "A/C", "B/D"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Falloc {
    KeepSize,
    PunchHole,
    ZeroRange,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
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

impl Op {
    pub fn is_persistence(&self) -> bool {
        matches!(self, Op::Fsync(_) | Op::Fdatasync(_) | Op::Sync)
    }

    /// The paths a core operation touches (for choosing its persistence operations).
    fn touched(&self) -> Vec<&'static str> {
        match self {
            Op::Creat(p)
            | Op::Mkdir(p)
            | Op::Unlink(p)
            | Op::Remove(p)
            | Op::SetXattr(p, _)
            | Op::RemoveXattr(p)
            | Op::Truncate(p, _)
            | Op::Symlink(p) => vec![p],
            Op::Falloc { path, .. } | Op::Write { path, .. } => vec![path],
            Op::Link(a, b) | Op::Rename(a, b) => vec![a, b],
            _ => vec![],
        }
    }
}

fn parent(path: &'static str) -> &'static str {
    path.rfind('/').map(|i| &path[..i]).unwrap_or("")
}

/// Every core operation with its arguments.
pub fn core_ops() -> Vec<Op> {
    let mut ops = Vec::new();
    for f in FILES {
        ops.push(Op::Creat(f));
        ops.push(Op::Write {
            path: f,
            offset: 0,
            len: 4096,
            append: true,
        });
        ops.push(Op::Write {
            path: f,
            offset: 0,
            len: 8192,
            append: false,
        });
        ops.push(Op::Write {
            path: f,
            offset: 1000,
            len: 3000,
            append: false,
        });
        // More than an fsync record carries (engine::log::EMBED_MAX_BLOCKS): its fsync writes
        // the data in place beside the record.
        ops.push(Op::Write {
            path: f,
            offset: 0,
            len: 12 * 4096,
            append: true,
        });
        for (mode, offset, len) in [
            (Falloc::KeepSize, 16384, 8192),
            (Falloc::PunchHole, 2048, 6000),
            (Falloc::ZeroRange, 4096, 4096),
        ] {
            ops.push(Op::Falloc {
                path: f,
                mode,
                offset,
                len,
            });
        }
        ops.push(Op::Unlink(f));
        ops.push(Op::SetXattr(f, 1));
        ops.push(Op::RemoveXattr(f));
        ops.push(Op::Truncate(f, 2500));
        ops.push(Op::Truncate(f, 0));
        ops.push(Op::Symlink(f));
    }
    for d in ["A", "B", "A/C", "B/D"] {
        ops.push(Op::Mkdir(d));
        ops.push(Op::Remove(d));
    }
    for (a, b) in [
        ("foo", "bar"),
        ("foo", "A/bar"),
        ("A/foo", "B/foo"),
        ("A/foo", "A/bar"),
        ("A/foo", "A/C/foo"),
        ("bar", "foo"),
    ] {
        ops.push(Op::Link(a, b));
        ops.push(Op::Rename(a, b));
    }
    ops.push(Op::Rename("A/C", "B/C"));
    ops.push(Op::Rename("A", "B/D"));
    ops
}

/// Persistence choices after `op`: fsync and fdatasync of what it touched, fsync of their
/// parents, and sync.
fn persistence_after(op: &Op) -> Vec<Op> {
    let mut out = vec![Op::Sync];
    for p in op.touched() {
        out.push(Op::Fsync(p));
        out.push(Op::Fdatasync(p));
        out.push(Op::Fsync(parent(p)));
    }
    out.dedup();
    out
}

/// Every workload of `length` core operations (1 or 2), each followed by a persistence op.
pub fn exhaustive(length: usize) -> Vec<Vec<Op>> {
    let core = core_ops();
    let mut out: Vec<Vec<Op>> = vec![vec![]];
    for _ in 0..length {
        let mut next = Vec::new();
        for prefix in &out {
            for op in &core {
                for persist in persistence_after(op) {
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
pub fn sample(count: usize, seed: u64) -> Vec<Vec<Op>> {
    let core = core_ops();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let length = rng.random_range(1..=2);
            let mut w = Vec::new();
            for _ in 0..length {
                let op = core[rng.random_range(0..core.len())].clone();
                let persist = persistence_after(&op);
                let p = persist[rng.random_range(0..persist.len())].clone();
                w.push(op);
                w.push(p);
            }
            w
        })
        .collect()
}
