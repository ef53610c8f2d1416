//! The fsync latency benchmark (docs/fsync-log.md's figures): 4 KiB append + fdatasync at
//! queue depth 1.
//!
//! Three targets take turns, `rounds` times, on the same disk, and medians are compared (a
//! virtual disk's speed drifts within a minute; running one target entirely before the other
//! would measure the drift):
//! - **corefs**: a file-backed image (`file:` backend, O_DIRECT) in `dir`, or the device
//!   `--device` names (`nvme:/dev/ng0n1`), one file; each operation is `write` of 4 KiB at the
//!   end of the file then `fdatasync` — what a database's log append does;
//! - **raw**: the floor — an O_DIRECT `pwrite` of 4 KiB into a preallocated, pre-written file
//!   in `dir`, then `fdatasync` (one device write and one cache flush);
//! - **kernel**: the filesystem holding `dir` (ext4 here), a buffered 4 KiB append then
//!   `fdatasync`, as fsperf's bufferedappenddatasync.
//!
//! Both filesystems do the same work inside the timer: the same call (fdatasync), and their
//! commits. ext4's journal commit lands inside its fdatasync; corefs's `tick()`, which commits
//! when the transaction is old, large or its fsync log is filling (as a reactor's loop does
//! between operations), runs after each fdatasync inside the operation's time, so a commit
//! shows in the latency of the operation that paid for it. The commits are also counted
//! (count, mean, max).

use crate::stats::{fmt_ns, latency_histogram, LatencySummary};
use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::OpenOptions;
use serde::Serialize;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct FsyncBenchConfig {
    /// Where the image and the raw file go (must support O_DIRECT).
    pub dir: PathBuf,
    /// Where the kernel filesystem's appends go (default: `dir`), e.g. an ext4, xfs or btrfs
    /// mounted on a loop device over a file on the same disk.
    pub kernel_dir: Option<PathBuf>,
    pub image_bytes: u64,
    pub seconds_per_round: f64,
    pub rounds: u32,
    /// corefs's device (formatted; its content is destroyed) instead of an image in `dir`.
    pub device: Option<String>,
}

impl Default for FsyncBenchConfig {
    fn default() -> Self {
        FsyncBenchConfig {
            dir: PathBuf::from("/var/tmp"),
            kernel_dir: None,
            device: None,
            image_bytes: 1 << 30,
            seconds_per_round: 2.0,
            rounds: 3,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TargetResult {
    pub target: String,
    /// The round with the median p50.
    pub latency: LatencySummary,
    pub p50_ns_per_round: Vec<u64>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct CorefsFigures {
    pub fsyncs: u64,
    pub log_writes: u64,
    pub log_blocks: u64,
    pub already_logged: u64,
    pub fallback_commits: u64,
    /// Commits `tick()` made after an operation's fdatasync (inside its time).
    pub tick_commits: u64,
    pub tick_commit_ns_mean: f64,
    pub tick_commit_ns_max: u64,
    /// Mean latency of the operations that ran a commit (at least the commit's, as it is
    /// inside their time).
    pub commit_op_ns_mean: f64,
    /// Times the file reached [`WRAP_BYTES`] and was truncated to zero.
    pub wraps: u64,
}

/// The appended file is truncated to zero when it reaches this size.
pub const WRAP_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Serialize, Default)]
pub struct FsyncBenchReport {
    pub kernel_fs: String,
    pub targets: Vec<TargetResult>,
    pub corefs: CorefsFigures,
    /// corefs p50 / raw p50, and kernel p50 / corefs p50 (medians over rounds).
    pub corefs_over_raw_p50: f64,
    pub kernel_over_corefs_p50: f64,
}

/// The filesystem type holding `dir`, from /proc/self/mounts (longest matching mount point).
pub fn fs_type_of(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, point, kind) = (f.next()?, f.next()?, f.next()?);
            dir.starts_with(point)
                .then(|| (point.len(), kind.to_string()))
        })
        .max()
        .map(|(_, kind)| kind)
        .unwrap_or_else(|| "unknown".into())
}

fn block(i: u64) -> Vec<u8> {
    let mut b = vec![(i % 251) as u8; 4096];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

struct CorefsTarget {
    fs: Filesystem,
    ino: u64,
    offset: u64,
    figures: CorefsFigures,
    tick_ns_total: u64,
    commit_op_ns_total: u64,
}

impl CorefsTarget {
    fn new(spec: &str) -> Result<CorefsTarget, String> {
        let dev = nvme::open_device(spec, &OpenOptions::default()).map_err(|e| e.to_string())?;
        // A file's data lives in its shard's region: few shards leave one file room to grow.
        let options = MkfsOptions {
            shards: 4,
            label: "fsyncbench".into(),
            ..Default::default()
        };
        let dev = Filesystem::mkfs(dev, &options).map_err(|e| e.to_string())?;
        let mut fs = Filesystem::mount(dev, MountOptions::default()).map_err(|e| e.to_string())?;
        let root = fs.root();
        let ino = fs
            .create(root, b"log", 0o644, 0, 0)
            .map_err(|e| e.to_string())?
            .ino;
        fs.sync().map_err(|e| e.to_string())?;
        Ok(CorefsTarget {
            fs,
            ino,
            offset: 0,
            figures: CorefsFigures::default(),
            tick_ns_total: 0,
            commit_op_ns_total: 0,
        })
    }

    fn round(&mut self, seconds: f64) -> Result<LatencySummary, String> {
        let mut histogram = latency_histogram();
        let begin = Instant::now();
        let end = begin + Duration::from_secs_f64(seconds);
        while Instant::now() < end {
            let data = block(self.offset / 4096);
            let start = Instant::now();
            self.fs
                .write(self.ino, self.offset, &data)
                .map_err(|e| e.to_string())?;
            self.fs.fdatasync(self.ino).map_err(|e| e.to_string())?;
            // The commit a reactor would run now belongs to this operation, as ext4's journal
            // commit belongs to the fdatasync that forced it.
            let tick = Instant::now();
            let committed = self.fs.tick().map_err(|e| e.to_string())?;
            if committed {
                let ns = tick.elapsed().as_nanos() as u64;
                self.figures.tick_commits += 1;
                self.tick_ns_total += ns;
                self.figures.tick_commit_ns_max = self.figures.tick_commit_ns_max.max(ns);
            }
            let ns = start.elapsed().as_nanos().max(1) as u64;
            histogram.record(ns).expect("latency within bounds");
            if committed {
                self.commit_op_ns_total += ns;
            }
            self.offset += 4096;
            if self.offset == WRAP_BYTES {
                // Recycle the file, as a database recycles its log (outside the clock; the
                // kernel side starts a new file each round instead).
                self.fs.truncate(self.ino, 0).map_err(|e| e.to_string())?;
                self.offset = 0;
                self.figures.wraps += 1;
            }
        }
        Ok(LatencySummary::from_histogram(
            &histogram,
            begin.elapsed().as_secs_f64(),
        ))
    }

    fn finish(mut self) -> Result<CorefsFigures, String> {
        let stats = self.fs.log_stats();
        self.figures.fsyncs = stats.fsyncs;
        self.figures.log_writes = stats.log_writes;
        self.figures.log_blocks = stats.log_blocks;
        self.figures.already_logged = stats.already_logged;
        self.figures.fallback_commits = stats.fallback_commits();
        if self.figures.tick_commits > 0 {
            self.figures.tick_commit_ns_mean =
                self.tick_ns_total as f64 / self.figures.tick_commits as f64;
            self.figures.commit_op_ns_mean =
                self.commit_op_ns_total as f64 / self.figures.tick_commits as f64;
        }
        // Everything appended must read back after a remount.
        let (ino, size) = (self.ino, self.offset);
        if size == 0 {
            return Ok(self.figures);
        }
        let dev = self.fs.unmount().map_err(|e| e.to_string())?;
        let mut fs = Filesystem::mount(dev, MountOptions::default()).map_err(|e| e.to_string())?;
        let got = fs.stat(ino).map_err(|e| e.to_string())?.size;
        if got != size {
            return Err(format!(
                "corefs file is {got} bytes after remount, expected {size}"
            ));
        }
        let last = fs.read(ino, size - 4096, 4096).map_err(|e| e.to_string())?;
        if last != block(size / 4096 - 1) {
            return Err("corefs file's last block differs after remount".into());
        }
        Ok(self.figures)
    }
}

/// O_DIRECT pwrite + fdatasync into a preallocated, pre-written file: the device's floor.
fn raw_round(path: &Path, bytes: u64, seconds: f64) -> Result<LatencySummary, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // O_DIRECT wants an aligned buffer: a 4 KiB window of an 8 KiB allocation.
    let mut backing = vec![0u8; 8192];
    let skew = backing.as_ptr().align_offset(4096);
    let buf = &mut backing[skew..skew + 4096];
    let mut histogram = latency_histogram();
    let begin = Instant::now();
    let end = begin + Duration::from_secs_f64(seconds);
    let mut offset = 0u64;
    while Instant::now() < end {
        buf.copy_from_slice(&block(offset / 4096));
        let start = Instant::now();
        // SAFETY: the buffer is 4096 bytes, aligned for O_DIRECT, and outlives the call.
        let n = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                buf.as_ptr().cast(),
                4096,
                offset as libc::off_t,
            )
        };
        if n != 4096 {
            return Err(format!("raw pwrite: {}", std::io::Error::last_os_error()));
        }
        file.sync_data()
            .map_err(|e| format!("raw fdatasync: {e}"))?;
        histogram
            .record(start.elapsed().as_nanos().max(1) as u64)
            .expect("latency within bounds");
        offset = (offset + 4096) % bytes;
    }
    Ok(LatencySummary::from_histogram(
        &histogram,
        begin.elapsed().as_secs_f64(),
    ))
}

/// Buffered append + fdatasync on the kernel filesystem, a new file per round.
fn kernel_round(dir: &Path, round: u32, seconds: f64) -> Result<LatencySummary, String> {
    use std::io::Write;
    let path = dir.join(format!(
        "corefs-fsyncbench-kernel-{}-{round}",
        std::process::id()
    ));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut histogram = latency_histogram();
    let begin = Instant::now();
    let end = begin + Duration::from_secs_f64(seconds);
    let mut i = 0u64;
    let result = (|| {
        while Instant::now() < end {
            let data = block(i);
            let start = Instant::now();
            file.write_all(&data)
                .map_err(|e| format!("kernel append: {e}"))?;
            file.sync_data()
                .map_err(|e| format!("kernel fdatasync: {e}"))?;
            histogram
                .record(start.elapsed().as_nanos().max(1) as u64)
                .expect("latency within bounds");
            i += 1;
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    result.map(|()| LatencySummary::from_histogram(&histogram, begin.elapsed().as_secs_f64()))
}

/// Writes `bytes` into `file` once, so later writes allocate nothing in the kernel fs.
pub fn prefill(mut file: &std::fs::File, bytes: u64) -> Result<(), String> {
    use std::io::Write;
    let chunk = vec![0x5cu8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])
            .map_err(|e| format!("prefilling: {e}"))?;
        left -= n as u64;
    }
    file.sync_all().map_err(|e| format!("prefilling: {e}"))
}

fn median_result(target: &str, rounds: Vec<LatencySummary>) -> TargetResult {
    let p50_ns_per_round = rounds.iter().map(|l| l.p50_ns).collect();
    let mut sorted = rounds;
    sorted.sort_by_key(|l| l.p50_ns);
    TargetResult {
        target: target.to_string(),
        latency: sorted[sorted.len() / 2].clone(),
        p50_ns_per_round,
    }
}

/// Runs the benchmark, printing progress to stderr.
pub fn run(config: &FsyncBenchConfig) -> Result<FsyncBenchReport, String> {
    let kernel_dir = config
        .kernel_dir
        .clone()
        .unwrap_or_else(|| config.dir.clone());
    let kernel_fs = fs_type_of(&kernel_dir);
    let raw = tempfile::Builder::new()
        .prefix("corefs-fsyncbench-raw-")
        .tempfile_in(&config.dir)
        .map_err(|e| format!("creating a file in {}: {e}", config.dir.display()))?;
    // The image and the raw file are written once whole first (as fio lays out its file), so
    // neither pays for the kernel filesystem allocating blocks under it: the image stands for
    // a device, the raw file for the same device without corefs.
    let raw_bytes = 64u64 << 20;
    let mut image = None;
    let spec = match &config.device {
        Some(device) => device.clone(),
        None => {
            let file = tempfile::Builder::new()
                .prefix("corefs-fsyncbench-")
                .suffix(".img")
                .tempfile_in(&config.dir)
                .map_err(|e| format!("creating an image in {}: {e}", config.dir.display()))?;
            eprintln!("fsync bench: writing the image once...");
            prefill(file.as_file(), config.image_bytes)?;
            let spec = format!("file:{},size={}", file.path().display(), config.image_bytes);
            image = Some(file);
            spec
        }
    };
    eprintln!("fsync bench: writing the raw file once...");
    prefill(raw.as_file(), raw_bytes)?;
    eprintln!(
        "fsync bench: corefs on {spec}; raw in {}; {kernel_fs} in {}",
        config.dir.display(),
        kernel_dir.display()
    );
    let mut corefs = CorefsTarget::new(&spec)?;
    let (mut ours, mut floor, mut kernel) = (Vec::new(), Vec::new(), Vec::new());
    let rounds = config.rounds.max(1);
    for round in 1..=rounds {
        eprintln!("round {round}/{rounds}: corefs, raw, {kernel_fs}...");
        ours.push(corefs.round(config.seconds_per_round)?);
        floor.push(raw_round(raw.path(), raw_bytes, config.seconds_per_round)?);
        kernel.push(kernel_round(&kernel_dir, round, config.seconds_per_round)?);
    }
    let figures = corefs.finish()?;
    drop(image);
    let median_p50 = |v: &[LatencySummary]| {
        let mut p: Vec<u64> = v.iter().map(|l| l.p50_ns).collect();
        p.sort_unstable();
        p[p.len() / 2] as f64
    };
    let (c, r, k) = (median_p50(&ours), median_p50(&floor), median_p50(&kernel));
    Ok(FsyncBenchReport {
        targets: vec![
            median_result(
                &format!(
                    "corefs ({} backend)",
                    spec.split(':').next().unwrap_or("file")
                ),
                ours,
            ),
            median_result("raw O_DIRECT write + fdatasync", floor),
            median_result(&format!("{kernel_fs} append + fdatasync"), kernel),
        ],
        kernel_fs,
        corefs: figures,
        corefs_over_raw_p50: c / r,
        kernel_over_corefs_p50: k / c,
    })
}

impl std::fmt::Display for FsyncBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "4 KiB append + fdatasync, queue depth 1 (median round of p50; corefs's commits inside the time)"
        )?;
        writeln!(
            f,
            "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  p50 per round",
            "target", "ops/s", "p50", "p90", "p99", "p99.9", "max"
        )?;
        for t in &self.targets {
            let l = &t.latency;
            writeln!(
                f,
                "{:<34} {:>9.0} {:>9} {:>9} {:>9} {:>9} {:>9}  {}",
                t.target,
                l.ops_per_sec,
                fmt_ns(l.p50_ns as f64),
                fmt_ns(l.p90_ns as f64),
                fmt_ns(l.p99_ns as f64),
                fmt_ns(l.p999_ns as f64),
                fmt_ns(l.max_ns as f64),
                t.p50_ns_per_round
                    .iter()
                    .map(|&n| fmt_ns(n as f64))
                    .collect::<Vec<_>>()
                    .join(" ")
            )?;
        }
        let c = &self.corefs;
        writeln!(
            f,
            "corefs p50 / raw p50: {:.2} (target <= 1.3); {} p50 / corefs p50: {:.2} (target >= 3)",
            self.corefs_over_raw_p50, self.kernel_fs, self.kernel_over_corefs_p50
        )?;
        writeln!(
            f,
            "corefs: {} fsyncs, {} log records ({} blocks), {} with nothing new, {} fell back to a commit; \
             tick() committed {} times after an fdatasync, inside its operation (mean {}, max {}; \
             those operations took {} on average)",
            c.fsyncs,
            c.log_writes,
            c.log_blocks,
            c.already_logged,
            c.fallback_commits,
            c.tick_commits,
            fmt_ns(c.tick_commit_ns_mean),
            fmt_ns(c.tick_commit_ns_max as f64),
            fmt_ns(c.commit_op_ns_mean)
        )
    }
}
