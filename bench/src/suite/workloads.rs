//! The suite's workloads, each written once against [`Session`] so every target runs the same
//! operations:
//!
//! - `append-fdatasync`: 4 KiB appends, each followed by fdatasync, queue depth 1 (fsperf's
//!   bufferedappenddatasync);
//! - `randwrite`: C clients overwrite random blocks of their own preallocated file and fsync
//!   every N writes (fio `rw=randwrite fsync=N numjobs=C`);
//! - `creates`: T clients create empty files spread over K directories (fs_mark -S 0 -s 0);
//! - `dbench`: C clients each loop over a dbench-like mix in their own tree — mkdir, create,
//!   write, close, stat, find, read, rename, flush (fsync), unlink, deltree — with dbench's
//!   per-operation table;
//! - `abi-open-close` and `abi-stat`: one client calling open(O_CREAT|O_EXCL)+close of new
//!   files, and stat of existing ones, by path, through the C ABI on corefs (libcorefs's
//!   `corefs_open`, `corefs_release`, `corefs_stat`: what an embedding database pays per
//!   call) and through the system calls on the kernel targets;
//! - `randread`: random 4 KiB reads of a file written and made durable beforehand, read after
//!   a remount (cold), at queue depth 1 or 32, from the device on every target (kernel targets
//!   read with O_DIRECT, corefs with its data-block cache off);
//! - `seq-write-1m`: one client writes 1 MiB blocks sequentially (`dd bs=1M`), fsyncing every
//!   64 MiB, and starts a new file (the old one unlinked) every 256 MiB;
//! - `seq-read-1m`: one client reads a 512 MiB file written beforehand in 1 MiB blocks from
//!   start to end once, after a remount (cold), buffered as `dd` and `cp` read: kernel targets
//!   through their page cache and read-ahead, corefs through its block cache and read-ahead;
//! - `copy-tree`: one client copies a tree in and back out, over and over: a directory of 64
//!   files of mixed sizes (1 KiB to 1 MiB, log-uniform) in 4 subdirectories is written, each
//!   file fsynced (what `cp -a` and a `sync` make durable), read back whole, and deleted.
//!
//! Invariants: setup is not timed; each client touches only its own files and directories, so
//! no two clients contend on a name; every operation's result is checked (a short read or a
//! failed call ends the run with an error, never a sample).

use super::results::new_histogram;
use super::session::{Session, R};
use hdrhistogram::Histogram;
use rand::{Rng, RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::time::Instant;

/// An appending client moves on to a new file when its file reaches this size.
pub const APPEND_WRAP_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Append {
        block_bytes: usize,
    },
    RandWrite {
        block_bytes: usize,
        fsync_every: u32,
        file_bytes: u64,
    },
    Creates {
        dirs: usize,
    },
    Dbench,
    RandRead {
        qd: usize,
        file_bytes: u64,
    },
    /// open(O_CREAT|O_EXCL)+close of new files in a directory of the client's own, through
    /// the C ABI.
    AbiOpenClose,
    /// stat of `files` existing files by path, in random order, through the C ABI.
    AbiStat {
        files: usize,
    },
    /// Sequential writes of `block_bytes`, fsync every `fsync_bytes`, a new file every
    /// `file_bytes`.
    SeqWrite {
        block_bytes: usize,
        fsync_bytes: u64,
        file_bytes: u64,
    },
    /// One sequential pass over a cold file of `file_bytes` in `block_bytes` reads.
    SeqRead {
        block_bytes: usize,
        file_bytes: u64,
    },
    /// A tree of `files` files of mixed sizes in `dirs` directories written, fsynced, read
    /// back and deleted, over and over.
    CopyTree {
        files: usize,
        dirs: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub name: String,
    pub clients: usize,
    pub kind: Kind,
}

/// Sizes the suite is built from (the command line's options).
#[derive(Debug, Clone)]
pub struct Sizes {
    /// Clients of the randwrite workloads (fio numjobs).
    pub writers: usize,
    /// Each randwrite client's file.
    pub write_file_bytes: u64,
    /// fsync every N 4 KiB overwrites.
    pub fsync_every: u32,
    pub create_clients: usize,
    pub create_dirs: usize,
    pub dbench_clients: usize,
    pub read_file_bytes: u64,
    /// The sequential workloads' file.
    pub seq_file_bytes: u64,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes {
            writers: 4,
            write_file_bytes: 16 << 20,
            fsync_every: 8,
            create_clients: 4,
            create_dirs: 4,
            dbench_clients: 8,
            read_file_bytes: 192 << 20,
            seq_file_bytes: 512 << 20,
        }
    }
}

/// The short suite, in the order it runs.
pub fn suite(sizes: &Sizes) -> Vec<Workload> {
    vec![
        Workload {
            name: "append-fdatasync".into(),
            clients: 1,
            kind: Kind::Append { block_bytes: 4096 },
        },
        Workload {
            name: format!("randwrite-4k-fsync{}", sizes.fsync_every),
            clients: sizes.writers,
            kind: Kind::RandWrite {
                block_bytes: 4096,
                fsync_every: sizes.fsync_every,
                file_bytes: sizes.write_file_bytes,
            },
        },
        Workload {
            name: "fsync-writers-64k".into(),
            clients: sizes.writers,
            kind: Kind::RandWrite {
                block_bytes: 64 << 10,
                fsync_every: 1,
                file_bytes: sizes.write_file_bytes,
            },
        },
        Workload {
            name: "creates".into(),
            clients: sizes.create_clients,
            kind: Kind::Creates {
                dirs: sizes.create_dirs,
            },
        },
        Workload {
            name: "dbench".into(),
            clients: sizes.dbench_clients,
            kind: Kind::Dbench,
        },
        Workload {
            name: "abi-open-close".into(),
            clients: 1,
            kind: Kind::AbiOpenClose,
        },
        Workload {
            name: "abi-stat".into(),
            clients: 1,
            kind: Kind::AbiStat { files: 1000 },
        },
        Workload {
            name: "randread-qd1".into(),
            clients: 1,
            kind: Kind::RandRead {
                qd: 1,
                file_bytes: sizes.read_file_bytes,
            },
        },
        Workload {
            name: "randread-qd32".into(),
            clients: 1,
            kind: Kind::RandRead {
                qd: 32,
                file_bytes: sizes.read_file_bytes,
            },
        },
        Workload {
            name: "seq-write-1m".into(),
            clients: 1,
            kind: Kind::SeqWrite {
                block_bytes: 1 << 20,
                fsync_bytes: 64 << 20,
                file_bytes: (sizes.seq_file_bytes / 2).max(64 << 20),
            },
        },
        Workload {
            name: "seq-read-1m".into(),
            clients: 1,
            kind: Kind::SeqRead {
                block_bytes: 1 << 20,
                file_bytes: sizes.seq_file_bytes,
            },
        },
        Workload {
            name: "copy-tree".into(),
            clients: 1,
            kind: Kind::CopyTree { files: 64, dirs: 4 },
        },
    ]
}

/// One client's measurements.
pub struct Recorder {
    /// Operation kind → latencies; the first is the main kind unless `aggregate`.
    pub ops: Vec<(&'static str, Histogram<u64>)>,
    /// When set, every operation is also recorded under this name, the main kind.
    pub aggregate: Option<&'static str>,
    pub bytes: u64,
}

impl Recorder {
    pub fn new(main: &'static str, aggregate: bool) -> Recorder {
        Recorder {
            ops: vec![(main, new_histogram())],
            aggregate: aggregate.then_some(main),
            bytes: 0,
        }
    }

    pub fn record(&mut self, op: &'static str, ns: u64) {
        let ns = ns.max(1);
        let i = match self.ops.iter().position(|(name, _)| *name == op) {
            Some(i) => i,
            None => {
                self.ops.push((op, new_histogram()));
                self.ops.len() - 1
            }
        };
        let _ = self.ops[i].1.record(ns);
        if let Some(main) = self.aggregate {
            if main != op {
                let _ = self.ops[0].1.record(ns);
            }
        }
    }

    /// Runs `f`, recording its latency under `op`.
    pub fn time<T>(&mut self, op: &'static str, f: impl FnOnce() -> R<T>) -> R<T> {
        let started = Instant::now();
        let out = f()?;
        self.record(op, started.elapsed().as_nanos() as u64);
        Ok(out)
    }

    pub fn merge(&mut self, other: Recorder) {
        for (op, h) in other.ops {
            match self.ops.iter_mut().find(|(name, _)| *name == op) {
                Some((_, mine)) => mine.add(&h).expect("same histogram bounds"),
                None => self.ops.push((op, h)),
            }
        }
        self.bytes += other.bytes;
    }
}

/// Deterministic, recognisable file contents.
/// Eight bytes per generator step: a byte per step cost dbench's clients 100 µs of CPU per
/// iteration (2 µs per operation, an eighth of the client core where corefs's clients
/// share one), none of it the filesystem's.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut bytes = vec![0u8; len];
    rng.fill_bytes(&mut bytes);
    bytes
}

/// Writes `bytes` of `path` in 1 MiB pieces and makes it durable.
fn write_file(s: &mut dyn Session, path: &str, bytes: u64) -> R<()> {
    let fh = s.create(path)?;
    let chunk = pattern(1 << 20, bytes);
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(chunk.len() as u64) as usize;
        s.pwrite(fh, at, &chunk[..n])?;
        at += n as u64;
    }
    s.fsync(fh)?;
    s.close(fh)
}

impl Workload {
    /// The main operation kind's name (the one the headline latency describes).
    pub fn main_op(&self) -> &'static str {
        match &self.kind {
            Kind::Append { .. } => "append+fdatasync",
            Kind::RandWrite { fsync_every: 1, .. } => "write+fsync",
            Kind::RandWrite { .. } => "write",
            Kind::Creates { .. } => "create",
            Kind::Dbench => "all",
            Kind::RandRead { .. } => "read",
            Kind::AbiOpenClose => "open+close",
            Kind::AbiStat { .. } => "stat",
            Kind::SeqWrite { .. } => "write",
            Kind::SeqRead { .. } => "read",
            Kind::CopyTree { .. } => "tree",
        }
    }

    /// Whether a corefs target serves the workload through its C ABI (libcorefs), as a
    /// program embedding it calls it.
    pub fn through_c_abi(&self) -> bool {
        matches!(self.kind, Kind::AbiOpenClose | Kind::AbiStat { .. })
    }

    /// Whether the workload reads what setup wrote after a remount.
    pub fn reads_cold(&self) -> bool {
        matches!(self.kind, Kind::RandRead { .. } | Kind::SeqRead { .. })
    }

    /// Whether the workload measures the device path: then no target may serve its reads
    /// from memory. Kernel targets read with O_DIRECT; corefs runs with its data-block cache
    /// off (with it, a 16 MiB cache over a 192 MiB file served about 8% of the reads).
    pub fn measures_device_path(&self) -> bool {
        matches!(self.kind, Kind::RandRead { .. })
    }

    /// Untimed preparation on a fresh filesystem.
    pub fn setup(&self, s: &mut dyn Session) -> R<()> {
        match &self.kind {
            Kind::Append { .. } => {
                for c in 0..self.clients {
                    let fh = s.create(&format!("append-{c}"))?;
                    s.fsync(fh)?;
                    s.close(fh)?;
                }
            }
            Kind::RandWrite { file_bytes, .. } => {
                for c in 0..self.clients {
                    write_file(s, &format!("rw-{c}"), *file_bytes)?;
                }
            }
            Kind::Creates { dirs } => {
                for d in 0..*dirs {
                    s.mkdir(&format!("d{d}"))?;
                }
            }
            Kind::Dbench => {
                s.mkdir("clients")?;
                for c in 0..self.clients {
                    s.mkdir(&format!("clients/client{c}"))?;
                }
            }
            Kind::RandRead { file_bytes, .. } => write_file(s, "rr", *file_bytes)?,
            Kind::AbiOpenClose => {
                for c in 0..self.clients {
                    s.mkdir(&format!("abi{c}"))?;
                }
            }
            Kind::AbiStat { files } => {
                for c in 0..self.clients {
                    s.mkdir(&format!("abi{c}"))?;
                    for f in 0..*files {
                        let fh = s.create(&format!("abi{c}/f{f}"))?;
                        s.close(fh)?;
                    }
                }
            }
            Kind::SeqWrite { .. } => {}
            Kind::SeqRead { file_bytes, .. } => write_file(s, "seq", *file_bytes)?,
            Kind::CopyTree { .. } => {}
        }
        Ok(())
    }

    /// One client's timed loop, until `until`.
    pub fn client(&self, c: usize, s: &mut dyn Session, until: Instant, seed: u64) -> R<Recorder> {
        let main = self.main_op();
        let mut rec = Recorder::new(main, matches!(self.kind, Kind::Dbench));
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ (c as u64) << 32);
        match &self.kind {
            Kind::Append { block_bytes } => {
                let mut path = format!("append-{c}");
                let mut fh = s.open(&path)?;
                let block = pattern(*block_bytes, seed);
                let mut offset = 0u64;
                let mut generation = 0u32;
                let mut first = true;
                while keep_going(&mut first, until) {
                    let started = Instant::now();
                    rec.time("write", || s.pwrite(fh, offset, &block))?;
                    rec.time("fdatasync", || s.fdatasync(fh))?;
                    rec.record(main, started.elapsed().as_nanos() as u64);
                    offset += *block_bytes as u64;
                    rec.bytes += *block_bytes as u64;
                    if offset >= APPEND_WRAP_BYTES {
                        // A fast target would otherwise fill the filesystem: go on in a new
                        // file (untimed), as a log rotates.
                        s.close(fh)?;
                        s.unlink(&path)?;
                        generation += 1;
                        path = format!("append-{c}-{generation}");
                        fh = s.create(&path)?;
                        offset = 0;
                    }
                }
                s.close(fh)?;
            }
            Kind::RandWrite {
                block_bytes,
                fsync_every,
                file_bytes,
            } => {
                let fh = s.open(&format!("rw-{c}"))?;
                let block = pattern(*block_bytes, seed);
                let slots = file_bytes / *block_bytes as u64;
                let mut n = 0u32;
                let mut first = true;
                while keep_going(&mut first, until) {
                    let offset = rng.random_range(0..slots) * *block_bytes as u64;
                    let started = Instant::now();
                    if *fsync_every == 1 {
                        rec.time("write", || s.pwrite(fh, offset, &block))?;
                        rec.time("fsync", || s.fsync(fh))?;
                        rec.record(main, started.elapsed().as_nanos() as u64);
                    } else {
                        rec.time("write", || s.pwrite(fh, offset, &block))?;
                        n += 1;
                        if n % fsync_every == 0 {
                            rec.time("fsync", || s.fsync(fh))?;
                        }
                    }
                    rec.bytes += *block_bytes as u64;
                }
                s.close(fh)?;
            }
            Kind::Creates { dirs } => {
                let dir = c % dirs;
                let mut i = 0u64;
                let mut first = true;
                while keep_going(&mut first, until) {
                    let path = format!("d{dir}/c{c}-{i}");
                    let started = Instant::now();
                    let fh = s.create(&path)?;
                    s.close(fh)?;
                    rec.record(main, started.elapsed().as_nanos() as u64);
                    i += 1;
                }
            }
            Kind::Dbench => {
                let mut iteration = 0u64;
                let mut first = true;
                while keep_going(&mut first, until) {
                    dbench_iteration(s, &mut rec, &mut rng, c, iteration)?;
                    iteration += 1;
                }
            }
            Kind::AbiOpenClose => {
                let mut i = 0u64;
                let mut first = true;
                while keep_going(&mut first, until) {
                    let path = format!("abi{c}/f{i}");
                    let started = Instant::now();
                    let fh = s.create(&path)?;
                    s.close(fh)?;
                    rec.record(main, started.elapsed().as_nanos() as u64);
                    i += 1;
                }
            }
            Kind::AbiStat { files } => {
                let mut first = true;
                while keep_going(&mut first, until) {
                    let path = format!("abi{c}/f{}", rng.random_range(0..*files));
                    let size = rec.time(main, || s.stat(&path))?;
                    if size != 0 {
                        return Err(format!("{path}: size {size}, made empty"));
                    }
                }
            }
            Kind::SeqWrite {
                block_bytes,
                fsync_bytes,
                file_bytes,
            } => {
                let block = pattern(*block_bytes, seed);
                let mut generation = 0u32;
                let mut path = format!("seq-{c}");
                let mut fh = s.create(&path)?;
                let mut offset = 0u64;
                let mut first = true;
                while keep_going(&mut first, until) {
                    rec.time(main, || s.pwrite(fh, offset, &block))?;
                    offset += *block_bytes as u64;
                    rec.bytes += *block_bytes as u64;
                    if offset % fsync_bytes == 0 {
                        rec.time("fsync", || s.fsync(fh))?;
                    }
                    if offset >= *file_bytes {
                        // A new file, as a log or an export rotates; the old one goes.
                        s.close(fh)?;
                        s.unlink(&path)?;
                        generation += 1;
                        path = format!("seq-{c}-{generation}");
                        fh = s.create(&path)?;
                        offset = 0;
                    }
                }
                // What was written is durable before the run ends, as `dd conv=fsync`.
                rec.time("fsync", || s.fsync(fh))?;
                s.close(fh)?;
            }
            Kind::SeqRead {
                block_bytes,
                file_bytes,
            } => {
                let fh = s.open("seq")?;
                let mut offset = 0u64;
                let mut first = true;
                // One pass: what a second one read would come from memory on some targets.
                while offset < *file_bytes && keep_going(&mut first, until) {
                    let got = rec.time(main, || s.pread(fh, offset, *block_bytes))?;
                    if got != *block_bytes {
                        return Err(format!("seq: read {got} of {block_bytes} at {offset}"));
                    }
                    offset += got as u64;
                    rec.bytes += got as u64;
                }
                s.close(fh)?;
            }
            Kind::CopyTree { files, dirs } => {
                let data = pattern(1 << 20, seed);
                let mut iteration = 0u64;
                let mut first = true;
                while keep_going(&mut first, until) {
                    let started = Instant::now();
                    let base = format!("tree-{c}-{iteration}");
                    s.mkdir(&base)?;
                    for d in 0..*dirs {
                        s.mkdir(&format!("{base}/d{d}"))?;
                    }
                    // Log-uniform sizes from 1 KiB to 1 MiB: many small files, a few large.
                    let sizes: Vec<usize> = (0..*files)
                        .map(|_| {
                            let top = 1usize << rng.random_range(10..=20u32);
                            rng.random_range(top / 2..=top)
                        })
                        .collect();
                    let path = |f: usize| format!("{base}/d{}/f{f}", f % dirs);
                    for (f, &size) in sizes.iter().enumerate() {
                        let fh = rec.time("create", || s.create(&path(f)))?;
                        rec.time("write", || s.pwrite(fh, 0, &data[..size]))?;
                        rec.time("fsync", || s.fsync(fh))?;
                        s.close(fh)?;
                        rec.bytes += size as u64;
                    }
                    for (f, &size) in sizes.iter().enumerate() {
                        let fh = s.open(&path(f))?;
                        let got = rec.time("read", || s.pread(fh, 0, size))?;
                        if got != size {
                            return Err(format!("{}: read {got} of {size} bytes", path(f)));
                        }
                        s.close(fh)?;
                        rec.bytes += size as u64;
                    }
                    rec.time("deltree", || deltree(s, &base))?;
                    rec.record(main, started.elapsed().as_nanos() as u64);
                    iteration += 1;
                }
            }
            Kind::RandRead { qd, file_bytes } => {
                let fh = s.open("rr")?;
                let mut latencies = new_histogram();
                let reads = s.random_reads(fh, *file_bytes, *qd, until, seed, &mut |ns| {
                    let _ = latencies.record(ns.max(1));
                })?;
                assert_eq!(reads, latencies.len(), "one latency sample per read");
                rec.ops[0].1.add(&latencies).expect("same histogram bounds");
                rec.bytes += reads * 4096;
                s.close(fh)?;
            }
        }
        Ok(rec)
    }
}

/// True while a client's timed loop goes on: until `until`, and at least once whatever the
/// clock says, so that every client measures an operation even when its setup (opening
/// its file on a stalled disk) outlasts a short run. A run of 0.25 s on a loaded machine
/// once measured nothing for ext4's append-fdatasync.
fn keep_going(first: &mut bool, until: Instant) -> bool {
    std::mem::take(first) || Instant::now() < until
}

/// One pass of the dbench-like mix in the client's own directory.
fn dbench_iteration(
    s: &mut dyn Session,
    rec: &mut Recorder,
    rng: &mut Xoshiro256PlusPlus,
    c: usize,
    iteration: u64,
) -> R<()> {
    const FILES: usize = 8;
    let base = format!("clients/client{c}/it{iteration}");
    rec.time("Mkdir", || s.mkdir(&base))?;
    let mut sizes = [0usize; FILES];
    let data = pattern(64 << 10, iteration);
    for (f, size) in sizes.iter_mut().enumerate() {
        *size = rng.random_range(1..=16usize) * 4096;
        let path = format!("{base}/f{f}");
        let fh = rec.time("Create", || s.create(&path))?;
        rec.time("WriteX", || s.pwrite(fh, 0, &data[..*size]))?;
        rec.time("Close", || s.close(fh))?;
        rec.bytes += *size as u64;
    }
    for (f, size) in sizes.iter().enumerate() {
        let got = rec.time("Qpathinfo", || s.stat(&format!("{base}/f{f}")))?;
        if got != *size as u64 {
            return Err(format!("{base}/f{f}: size {got}, wrote {size}"));
        }
    }
    let names = rec.time("Find", || s.readdir(&base))?;
    if names.len() != FILES {
        return Err(format!("{base}: {} entries, made {FILES}", names.len()));
    }
    for (f, size) in sizes.iter().enumerate().take(4) {
        let path = format!("{base}/f{f}");
        let fh = rec.time("Open", || s.open(&path))?;
        let got = rec.time("ReadX", || s.pread(fh, 0, *size))?;
        if got != *size {
            return Err(format!("{path}: read {got} of {size} bytes"));
        }
        rec.time("Close", || s.close(fh))?;
        rec.bytes += *size as u64;
    }
    for f in 0..2 {
        rec.time("Rename", || {
            s.rename(&format!("{base}/f{f}"), &format!("{base}/g{f}"))
        })?;
    }
    let path = format!("{base}/f{}", FILES - 1);
    let fh = rec.time("Open", || s.open(&path))?;
    rec.time("Flush", || s.fsync(fh))?;
    rec.time("Close", || s.close(fh))?;
    for f in 2..4 {
        rec.time("Unlink", || s.unlink(&format!("{base}/f{f}")))?;
    }
    rec.time("Deltree", || deltree(s, &base))
}

/// Removes a tree through readdir, unlink and rmdir (as dbench's Deltree does).
pub fn deltree(s: &mut dyn Session, path: &str) -> R<()> {
    for (name, is_dir) in s.readdir(path)? {
        let child = format!("{path}/{name}");
        if is_dir {
            deltree(s, &child)?;
        } else {
            s.unlink(&child)?;
        }
    }
    s.rmdir(path)
}
