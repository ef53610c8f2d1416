//! `corefs bench` — the benchmark suite a storage engineer runs to compare corefs with kernel
//! filesystems on the same disk, fsperf-style: the same workloads ([`workloads`]) on every
//! target ([`target`]: corefs on any backend through its client API; a kernel directory through
//! POSIX; ext4, xfs and btrfs made on loop devices by [`loopdev`]), HDR latency percentiles, CPU
//! per operation, engine statistics and mount time per run, JSON results ([`results`]) that
//! [`compare`] lines up against a baseline, and SVG plots ([`plot`]).
//!
//! Invariants: each workload starts on a fresh filesystem; targets run interleaved per workload
//! and repeat (workload 1 on every target, then workload 2, ...) so slow drift of the disk
//! spreads over all of them instead of favouring one; a failed run is an error naming the
//! workload and target, never a silent gap in the table. The random-read workloads on
//! corefs-file also run the real fio on corefs-file's image ([`fio_raw`], target
//! `fio-raw-image`) right after corefs's run, while the image still exists and corefs has
//! unmounted it; when fio is missing the suite says so, at the start and in the comparison.

pub mod abi;
pub mod compare;
pub mod direct;
pub mod fio_raw;
pub mod fuse;
pub mod loopdev;
pub mod machine;
pub mod neighbours;
pub mod plot;
pub mod results;
pub mod rocksdb;
pub mod serve;
pub mod server;
pub mod session;
pub mod target;
pub mod workloads;

use crate::stats::fmt_ns;
use results::{Meta, OpRow, Percentiles, RunResult, SuiteResults};
use session::{Target, R};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use target::{CorefsTarget, KernelTarget};
use workloads::{Recorder, Sizes, Workload};

/// A target named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    /// corefs on a file-backed image this run makes (and prefills) in the suite directory.
    CorefsFile,
    /// corefs in memory.
    CorefsMem,
    /// corefs as a storage service: `corefs serve` on an image of its own, the clients in
    /// the bench process through `corefs_connect`.
    CorefsServe,
    /// corefs through its FUSE mount: `corefs mount` on an image of its own, the clients in
    /// the bench process making system calls on the mountpoint.
    CorefsFuse,
    /// corefs on a device string (`nvme:/dev/ng0n1`, `file:/dev/sdb`).
    CorefsDevice(String),
    /// The kernel filesystem holding this directory.
    KernelDir(PathBuf),
    /// ext4, xfs or btrfs made on a loop device over a file in the suite directory (root).
    KernelLoop(String),
}

impl TargetSpec {
    /// `corefs-file`, `corefs-mem`, `corefs:DEVICE`, `dir:PATH`, `ext4`, `xfs`, `btrfs`.
    pub fn parse(text: &str) -> R<TargetSpec> {
        Ok(match text {
            "corefs" | "corefs-file" => TargetSpec::CorefsFile,
            "corefs-mem" => TargetSpec::CorefsMem,
            "corefs-serve" => TargetSpec::CorefsServe,
            "corefs-fuse" => TargetSpec::CorefsFuse,
            "ext4" | "xfs" | "btrfs" => TargetSpec::KernelLoop(text.to_string()),
            _ => {
                if let Some(device) = text.strip_prefix("corefs:") {
                    TargetSpec::CorefsDevice(device.to_string())
                } else if let Some(dir) = text.strip_prefix("dir:") {
                    TargetSpec::KernelDir(PathBuf::from(dir))
                } else {
                    return Err(format!(
                        "unknown target {text:?}: corefs-file, corefs-mem, corefs-serve, corefs-fuse, corefs:DEVICE, \
                         dir:PATH, ext4, xfs or btrfs"
                    ));
                }
            }
        })
    }
}

/// Where corefs's reactors and the workload's clients run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// How corefs is meant to run (dedicated storage cores): each reactor pinned to a core
    /// of its own, busy-polling, and the clients pinned to the other cores. A kernel
    /// filesystem's clients use every core (its work runs in them).
    Dedicated {
        reactor_cores: Vec<usize>,
        client_cores: Vec<usize>,
    },
    /// Reactors and clients share every core, unpinned; reactors spin, then park.
    Shared,
}

impl Placement {
    /// Dedicated cores when the process may use more cores than there are reactors (the
    /// last ones go to the reactors), unless `shared` is asked for.
    pub fn choose(reactors: usize, shared: bool) -> Placement {
        let cores = reactor::affinity::allowed_cores().unwrap_or_default();
        let reactors = reactors.max(1);
        if shared || cores.len() <= reactors {
            return Placement::Shared;
        }
        let (client_cores, reactor_cores) = cores.split_at(cores.len() - reactors);
        Placement::Dedicated {
            reactor_cores: reactor_cores.to_vec(),
            client_cores: client_cores.to_vec(),
        }
    }

    /// One line for the run's header.
    pub fn describe(&self) -> String {
        match self {
            Placement::Dedicated {
                reactor_cores,
                client_cores,
            } => format!(
                "corefs reactors busy-poll on dedicated cores {reactor_cores:?}, their clients run on cores {client_cores:?} (kernel filesystems' clients on every core)"
            ),
            Placement::Shared => {
                "corefs reactors and clients share every core (reactors spin, then park)".into()
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct SuiteConfig {
    /// Where images, loop files and kernel-directory runs go (must support O_DIRECT).
    pub dir: PathBuf,
    /// Size of corefs's image and of each loop device's file.
    pub image_bytes: u64,
    pub shards: u32,
    pub seconds: f64,
    pub repeats: u32,
    /// Empty: corefs-file and the kernel filesystem holding `dir`.
    pub targets: Vec<TargetSpec>,
    /// Run only workloads whose name contains one of these (empty: all).
    pub only: Vec<String>,
    pub sizes: Sizes,
    /// Where corefs's reactors and its clients run.
    pub placement: Placement,
    /// Reactors serving corefs (at most `shards`).
    pub reactors: usize,
    pub seed: u64,
    /// CPU-bound processes spinning beside every run ([`neighbours`]), and whether each is
    /// pinned to a core of its own.
    pub neighbours: usize,
    pub neighbours_pinned: bool,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        SuiteConfig {
            dir: PathBuf::from("/var/tmp"),
            image_bytes: 1 << 30,
            shards: 2,
            seconds: 3.0,
            repeats: 1,
            targets: Vec::new(),
            only: Vec::new(),
            sizes: Sizes::default(),
            placement: Placement::Shared,
            reactors: 1,
            seed: 1,
            neighbours: 0,
            neighbours_pinned: false,
        }
    }
}

/// CPU time of the whole process (user + system), in nanoseconds.
/// The steal time /proc/stat reports for all cores together, in ms (None when unreadable:
/// not Linux, or no steal column).
pub(crate) fn host_steal_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    steal_ms_of(&stat, clock_ticks_per_sec())
}

/// The steal column (the eighth number) of /proc/stat's `cpu` line, in ms.
fn steal_ms_of(stat: &str, ticks_per_sec: f64) -> Option<f64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let steal: u64 = line.split_whitespace().nth(8)?.parse().ok()?;
    Some(steal as f64 * 1000.0 / ticks_per_sec)
}

fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

pub(crate) fn process_cpu_ns() -> u64 {
    // SAFETY: getrusage writes one rusage through the pointer.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    assert_eq!(rc, 0, "getrusage(RUSAGE_SELF) cannot fail");
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Builds the targets; the images they need live in `images` until the suite ends.
fn build_targets(
    config: &SuiteConfig,
    images: &mut Vec<tempfile::NamedTempFile>,
    say: &dyn Fn(&str),
) -> R<Vec<Box<dyn Target>>> {
    let specs = if config.targets.is_empty() {
        vec![
            TargetSpec::CorefsFile,
            TargetSpec::KernelDir(config.dir.clone()),
        ]
    } else {
        config.targets.clone()
    };
    let mut out: Vec<Box<dyn Target>> = Vec::new();
    for spec in specs {
        match spec {
            TargetSpec::CorefsFile => {
                let image = prefilled_image(config, "corefs-suite-", say)?;
                let device = format!(
                    "file:{},size={}",
                    image.path().display(),
                    config.image_bytes
                );
                // The image stays in `images` (deleted on drop) until the suite ends, so fio can
                // read it after any workload.
                let target = CorefsTarget::new(
                    fio_raw::COREFS_TARGET,
                    &device,
                    config.shards,
                    config.placement.clone(),
                    config.reactors,
                )
                .with_image(image.path());
                images.push(image);
                out.push(Box::new(target));
            }
            TargetSpec::CorefsServe => {
                let image = prefilled_image(config, "corefs-serve-", say)?;
                out.push(Box::new(serve::ServeTarget::new(
                    image.path(),
                    config.shards,
                    config.placement.clone(),
                    config.reactors,
                    serve::Serve::new(&config.dir),
                )));
                images.push(image);
            }
            TargetSpec::CorefsFuse => {
                let image = prefilled_image(config, "corefs-fuse-", say)?;
                out.push(Box::new(fuse::FuseTarget::new(
                    image.path(),
                    config.shards,
                    config.placement.clone(),
                    config.reactors,
                    fuse::Fuse::new(&config.dir)?,
                )));
                images.push(image);
            }
            TargetSpec::CorefsMem => out.push(Box::new(CorefsTarget::new(
                "corefs-mem",
                &format!("mem:{},prefault", config.image_bytes),
                config.shards,
                config.placement.clone(),
                config.reactors,
            ))),
            TargetSpec::CorefsDevice(device) => out.push(Box::new(CorefsTarget::new(
                &format!("corefs-{}", device.split(':').next().unwrap_or("dev")),
                &device,
                config.shards,
                config.placement.clone(),
                config.reactors,
            ))),
            TargetSpec::KernelDir(dir) => {
                let fs = crate::fsync::fs_type_of(&dir);
                out.push(Box::new(KernelTarget::dir(&fs, &dir)));
            }
            TargetSpec::KernelLoop(fs_type) => {
                say(&format!(
                    "making {fs_type} on a loop device in {}",
                    config.dir.display()
                ));
                // Sparse, and large enough that ext4's inode table does not run out in the
                // create workload (1 GiB of ext4 has 65,536 inodes).
                let bytes = config.image_bytes.max(8 << 30);
                let fs = loopdev::LoopFs::make(&fs_type, &config.dir, bytes)?;
                out.push(Box::new(KernelTarget::on_loop(fs)));
            }
        }
    }
    Ok(out)
}

/// A new image file in the suite's directory, written whole first (so corefs's writes land
/// on allocated blocks, as a kernel filesystem's overwrites do); deleted when dropped.
fn prefilled_image(
    config: &SuiteConfig,
    prefix: &str,
    say: &dyn Fn(&str),
) -> R<tempfile::NamedTempFile> {
    let image = tempfile::Builder::new()
        .prefix(prefix)
        .suffix(".img")
        .tempfile_in(&config.dir)
        .map_err(|e| format!("creating an image in {}: {e}", config.dir.display()))?;
    say(&format!(
        "writing a {} MiB image at {} (so corefs's writes land on allocated blocks, as a \
         kernel filesystem's overwrites do)",
        config.image_bytes >> 20,
        image.path().display()
    ));
    crate::fsync::prefill(image.as_file(), config.image_bytes)?;
    Ok(image)
}

/// Runs one workload on one target.
fn run_one(
    target: &mut dyn Target,
    workload: &Workload,
    seconds: f64,
    repeat: u32,
    seed: u64,
    progress: &(dyn Fn(&str) + Sync),
) -> R<RunResult> {
    target.set_data_cache(!workload.measures_device_path());
    target.prepare()?;
    if workload.through_c_abi() {
        target.through_c_abi()?;
    }
    {
        let mut session = target.session()?;
        workload.setup(&mut *session)?;
    }
    if workload.reads_cold() {
        target.remount()?;
    }
    let mut sessions = Vec::with_capacity(workload.clients);
    for _ in 0..workload.clients {
        sessions.push(target.session()?);
    }
    let cpu_before = process_cpu_ns() + target.server_cpu_ns().unwrap_or(0);
    let steal_before = host_steal_ms();
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let client_cores = target.client_cores();
    let recorders: Vec<R<Recorder>> = std::thread::scope(|scope| {
        let handles: Vec<_> = sessions
            .into_iter()
            .enumerate()
            .map(|(c, mut session)| {
                let core = (!client_cores.is_empty()).then(|| client_cores[c % client_cores.len()]);
                scope.spawn(move || {
                    if let Some(id) = core {
                        // Best effort: an unpinned client only shares the reactor's core.
                        let _ = reactor::affinity::pin_current_thread(id);
                    }
                    workload.client(c, &mut *session, until, seed)
                })
            })
            .collect();
        // Long runs show they are alive: a line every 10 s.
        if seconds >= 20.0 {
            scope.spawn(move || {
                let mut next = 10.0;
                while Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(200));
                    let at = started.elapsed().as_secs_f64();
                    if at >= next && at < seconds {
                        progress(&format!("        ... {at:.0} of {seconds:.0} s"));
                        next += 10.0;
                    }
                }
            });
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_ns =
        (process_cpu_ns() + target.server_cpu_ns().unwrap_or(0)).saturating_sub(cpu_before);
    let host_steal_ms = steal_before
        .zip(host_steal_ms())
        .map(|(before, after)| (after - before).max(0.0));
    let mut total = Recorder::new(workload.main_op(), false);
    for r in recorders {
        total.merge(r?);
    }
    let engine = target.engine_figures()?;
    let mount_ms = target.remount()?;
    target.finish()?;
    let main = &total.ops[0].1;
    let (cdf, buckets) = RunResult::distribution(main);
    let ops = main.len();
    Ok(RunResult {
        workload: workload.name.clone(),
        target: target.name(),
        repeat,
        seconds: elapsed,
        ops,
        ops_per_sec: ops as f64 / elapsed,
        bytes: total.bytes,
        mib_per_sec: total.bytes as f64 / elapsed / (1 << 20) as f64,
        latency: Percentiles::of(main),
        op_table: total
            .ops
            .iter()
            .filter(|(name, _)| *name != workload.main_op() || workload.main_op() == "all")
            .map(|(name, h)| OpRow {
                op: name.to_string(),
                latency: Percentiles::of(h),
            })
            .collect(),
        cpu_ns_per_op: if ops > 0 {
            cpu_ns as f64 / ops as f64
        } else {
            0.0
        },
        engine,
        mount_ms,
        host_steal_ms,
        cdf,
        buckets,
    })
}

/// The disk under the suite directory, and each corefs device target's.
fn devices_described(config: &SuiteConfig) -> String {
    let mut out = vec![machine::device_model(&config.dir)];
    for spec in &config.targets {
        if let TargetSpec::CorefsDevice(device) = spec {
            if let Some(path) = machine::device_path(device) {
                out.push(machine::device_model(&path));
            }
        }
    }
    out.dedup();
    out.join("; ")
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Runs the suite. `progress` gets a line per step (the command prints them to stderr).
pub fn run(config: &SuiteConfig, progress: &(dyn Fn(&str) + Sync)) -> R<SuiteResults> {
    // RocksDB's workloads run in their own program (rocksdb.rs), only when asked for by name.
    let rocksdb_only = rocksdb::entries(&config.only);
    let native_only: Vec<&String> = config
        .only
        .iter()
        .filter(|o| !o.starts_with("rocksdb"))
        .collect();
    let workloads: Vec<Workload> = workloads::suite(&config.sizes)
        .into_iter()
        .filter(|w| config.only.is_empty() || native_only.iter().any(|o| w.name.contains(*o)))
        .collect();
    let rocksdb_program = if rocksdb_only.is_empty() {
        None
    } else {
        match rocksdb::program() {
            Ok(path) => Some(path),
            // Said, not silent; and an error when it was all that was asked for.
            Err(why) if workloads.is_empty() => return Err(why),
            Err(why) => {
                progress(&why);
                None
            }
        }
    };
    if workloads.is_empty() && rocksdb_program.is_none() {
        return Err(format!("no workload matches {:?}", config.only));
    }
    let mut images = Vec::new();
    let mut targets = if workloads.is_empty() {
        Vec::new()
    } else {
        build_targets(config, &mut images, progress)?
    };
    let mut results = SuiteResults {
        meta: Meta {
            corefs_version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            kernel: kernel_release(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            seconds_per_run: config.seconds,
            image_bytes: config.image_bytes,
            repeats: config.repeats,
            dir: config.dir.display().to_string(),
            dir_fs: crate::fsync::fs_type_of(&config.dir),
            placement: config.placement.describe(),
            cpu_model: machine::cpu_model(),
            device_model: devices_described(config),
            corefs_commit: machine::corefs_commit(),
            load_avg_start: machine::load_avg_1min(),
            fio: String::new(),
            neighbours: config.neighbours as u32,
            neighbours_pinned: config.neighbours_pinned,
        },
        runs: Vec::new(),
    };
    if rocksdb_program.is_some() {
        // corefs_db_bench mounts through the C ABI with its defaults, not this placement.
        results.meta.placement = if workloads.is_empty() {
            rocksdb::PLACEMENT.to_string()
        } else {
            format!("{}; {}", results.meta.placement, rocksdb::PLACEMENT)
        };
    }
    progress(&results.meta.placement);
    // Started after the load average was read (they are the load this run asked for); they
    // spin until `_neighbours` goes at the end of the run.
    let _neighbours = neighbours::Neighbours::start(config.neighbours, config.neighbours_pinned)?;
    if config.neighbours > 0 {
        progress(&format!(
            "{} CPU-bound neighbour process(es) spinning beside every run ({})",
            config.neighbours,
            if config.neighbours_pinned {
                "pinned one per core"
            } else {
                "unpinned"
            }
        ));
    }
    if let Some(load) = results.meta.load_avg_start {
        if load >= machine::BUSY_LOAD_AVG {
            progress(&format!(
                "warning: load average {load:.2} on {} CPUs before the run: other work competes with the benchmark",
                results.meta.cpus
            ));
        }
    }
    // fio's yardstick: for random-read workloads, on corefs-file's image.
    let fio_workloads = workloads
        .iter()
        .filter(|w| matches!(w.kind, workloads::Kind::RandRead { .. }))
        .count();
    let fio_images = targets.iter().filter(|t| t.image().is_some()).count();
    let mut fio_ok = false;
    if fio_workloads > 0 && fio_images > 0 {
        results.meta.fio = match fio_raw::version() {
            Ok(version) => {
                fio_ok = true;
                format!(
                    "{version}: random 4 KiB O_DIRECT reads over the whole {} MiB corefs-file \
                     image, read-only, psync at QD1 and io_uring above",
                    config.image_bytes >> 20
                )
            }
            Err(why) => format!("{why}: no {} rows", fio_raw::TARGET),
        };
        progress(&format!("fio yardstick: {}", results.meta.fio));
    }
    let fio_runs = if fio_ok {
        fio_workloads * fio_images * config.repeats as usize
    } else {
        0
    };
    let total = workloads.len() * targets.len() * config.repeats as usize + fio_runs;
    let suite_started = Instant::now();
    let mut step = 0;
    for workload in &workloads {
        for repeat in 0..config.repeats {
            for target in targets.iter_mut() {
                step += 1;
                let left = (total - step + 1) as f64 * config.seconds;
                progress(&format!(
                    "[{step:>2}/{total}] {} on {}{} ... (about {:.0} s of runs left)",
                    workload.name,
                    target.name(),
                    if config.repeats > 1 {
                        format!(" (repeat {})", repeat + 1)
                    } else {
                        String::new()
                    },
                    left
                ));
                let seed = config.seed.wrapping_add(repeat as u64);
                let run = run_one(
                    &mut **target,
                    workload,
                    config.seconds,
                    repeat,
                    seed,
                    progress,
                )
                .map_err(|e| format!("{} on {}: {e}", workload.name, target.name()))?;
                progress(&format!(
                    "{}{}{}",
                    run_line(&run),
                    run.engine
                        .as_ref()
                        .map(|e| format!(", data cache {}", data_cache_summary(e)))
                        .unwrap_or_default(),
                    run.host_steal_ms
                        .map(|ms| format!(", host steal {ms:.0} ms"))
                        .unwrap_or_default()
                ));
                results.runs.push(run);
                if let (true, workloads::Kind::RandRead { qd, .. }, Some(image)) =
                    (fio_ok, &workload.kind, target.image())
                {
                    // corefs has unmounted (run_one's finish), so fio reads a quiet image.
                    step += 1;
                    progress(&format!(
                        "[{step:>2}/{total}] {} on {} (fio {} QD{qd} on {}) ...",
                        workload.name,
                        fio_raw::TARGET,
                        fio_raw::engine_for(*qd),
                        image.display()
                    ));
                    let run =
                        fio_raw::run(image, &workload.name, *qd, config.seconds, repeat, seed)
                            .map_err(|e| {
                                format!("{} on {}: {e}", workload.name, fio_raw::TARGET)
                            })?;
                    progress(&run_line(&run));
                    results.runs.push(run);
                }
            }
        }
    }
    if let Some(program) = rocksdb_program {
        progress(&format!(
            "rocksdb: {} on corefs-file and the kernel directory (about {:.0} s of runs)",
            program.display(),
            16.0 * config.seconds * config.repeats as f64
        ));
        results
            .runs
            .extend(rocksdb::run(&program, config, &rocksdb_only, progress)?);
    }
    progress(&format!(
        "suite done in {:.0} s",
        suite_started.elapsed().as_secs_f64()
    ));
    drop(targets);
    drop(images);
    Ok(results)
}

/// One run's figures as the progress lines show them.
fn run_line(run: &results::RunResult) -> String {
    format!(
        "        {:.0} ops/s, {:.1} MiB/s, p50 {}, p99 {}, max {}",
        run.ops_per_sec,
        run.mib_per_sec,
        fmt_ns(run.latency.p50_ns as f64),
        fmt_ns(run.latency.p99_ns as f64),
        fmt_ns(run.latency.max_ns as f64),
    )
}

/// The data-block cache over a run: "off", or its hits and their share of the data blocks
/// read ("1234 hits (8.1%)").
pub fn data_cache_summary(e: &results::EngineFigures) -> String {
    match e.data_cache_blocks {
        None => return "-".into(),
        Some(0) => return "off".into(),
        Some(_) => {}
    }
    let total = e.data_cache_hits + e.data_blocks_read;
    let share = if total > 0 {
        e.data_cache_hits as f64 * 100.0 / total as f64
    } else {
        0.0
    };
    format!("{} hits ({share:.1}%)", e.data_cache_hits)
}

/// Largest of a metric over a workload/target's repeats (the "max" column: the worst
/// operation of any repeat, not a mean of each repeat's worst).
fn max_of(
    results: &SuiteResults,
    workload: &str,
    target: &str,
    f: impl Fn(&RunResult) -> f64,
) -> Option<f64> {
    results.runs_of(workload, target).map(f).reduce(f64::max)
}

/// Mean of a metric over a workload/target's repeats.
fn mean_of(
    results: &SuiteResults,
    workload: &str,
    target: &str,
    f: impl Fn(&RunResult) -> f64,
) -> Option<f64> {
    let values: Vec<f64> = results.runs_of(workload, target).map(f).collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// The side-by-side table: every target per workload, then each other target's ratio to the
/// first corefs target (throughput: higher is better for corefs; p99 and max: lower is).
/// Every column is the mean over repeats except "max", the largest latency of any repeat.
pub fn side_by_side(results: &SuiteResults) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let targets = results.targets();
    let reference = targets
        .iter()
        .find(|t| t.starts_with("corefs"))
        .cloned()
        .unwrap_or_else(|| targets[0].clone());
    if !results.meta.placement.is_empty() {
        let _ = writeln!(out, "{}", results.meta.placement);
    }
    if results.meta.neighbours > 0 {
        let _ = writeln!(
            out,
            "with {} CPU-bound neighbour process(es) spinning beside every run ({})",
            results.meta.neighbours,
            if results.meta.neighbours_pinned {
                "pinned one per core"
            } else {
                "unpinned"
            }
        );
    }
    let _ = writeln!(
        out,
        "{:<22} {:<14} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "workload",
        "target",
        "ops/s",
        "MiB/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "max",
        "cpu/op",
        "mount"
    );
    for workload in results.workloads() {
        for target in &targets {
            let runs: Vec<&RunResult> = results.runs_of(&workload, target).collect();
            let Some(first) = runs.first() else { continue };
            let n = runs.len() as f64;
            let avg = |f: &dyn Fn(&RunResult) -> f64| runs.iter().map(|r| f(r)).sum::<f64>() / n;
            let _ = writeln!(
                out,
                "{:<22} {:<14} {:>10.0} {:>9.1} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
                workload,
                target,
                avg(&|r| r.ops_per_sec),
                avg(&|r| r.mib_per_sec),
                fmt_ns(avg(&|r| r.latency.p50_ns as f64)),
                fmt_ns(avg(&|r| r.latency.p90_ns as f64)),
                fmt_ns(avg(&|r| r.latency.p99_ns as f64)),
                fmt_ns(avg(&|r| r.latency.p999_ns as f64)),
                fmt_ns(
                    max_of(results, &workload, target, |r| r.latency.max_ns as f64).unwrap_or(0.0)
                ),
                fmt_ns(avg(&|r| r.cpu_ns_per_op)),
                first
                    .mount_ms
                    .map(|_| format!("{:.1}ms", avg(&|r| r.mount_ms.unwrap_or(0.0))))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        for target in targets.iter().filter(|t| **t != reference) {
            let show = |a: Option<f64>, b: Option<f64>| -> String {
                match (a, b) {
                    (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                    _ => "-".into(),
                }
            };
            let ratio = |f: &dyn Fn(&RunResult) -> f64| -> String {
                show(
                    mean_of(results, &workload, &reference, f),
                    mean_of(results, &workload, target, f),
                )
            };
            let max = |f: fn(&RunResult) -> f64| -> String {
                show(
                    max_of(results, &workload, &reference, f),
                    max_of(results, &workload, target, f),
                )
            };
            let _ = writeln!(
                out,
                "{:<22} {:<14} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "",
                format!("{reference}/{target}")
                    .chars()
                    .take(14)
                    .collect::<String>(),
                ratio(&|r| r.ops_per_sec),
                ratio(&|r| r.mib_per_sec),
                ratio(&|r| r.latency.p50_ns as f64),
                ratio(&|r| r.latency.p90_ns as f64),
                ratio(&|r| r.latency.p99_ns as f64),
                ratio(&|r| r.latency.p999_ns as f64),
                max(|r| r.latency.max_ns as f64),
                ratio(&|r| r.cpu_ns_per_op),
            );
        }
    }
    out.push_str(&paired_ratios(results, &reference));
    out
}

/// The median and the spread of a ratio over paired repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairedRatio {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub pairs: usize,
}

/// `f(reference) / f(target)` for each repeat both ran (the repeats interleave the targets,
/// so a pair saw the same state of the disk and the machine): median, least and most.
pub fn paired_ratio(
    results: &SuiteResults,
    workload: &str,
    reference: &str,
    target: &str,
    f: impl Fn(&RunResult) -> f64,
) -> Option<PairedRatio> {
    let mut ratios: Vec<f64> = results
        .runs_of(workload, reference)
        .filter_map(|a| {
            let b = results
                .runs_of(workload, target)
                .find(|b| b.repeat == a.repeat)?;
            let (fa, fb) = (f(a), f(b));
            (fb > 0.0).then_some(fa / fb)
        })
        .collect();
    if ratios.is_empty() {
        return None;
    }
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let median = if n % 2 == 1 {
        ratios[n / 2]
    } else {
        (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
    };
    Some(PairedRatio {
        median,
        min: ratios[0],
        max: ratios[n - 1],
        pairs: n,
    })
}

/// With repeats, each ratio to the reference as the median of the paired repeats with its
/// spread: what decides which side wins on a noisy disk (a mean of a few 5-second samples
/// does not).
fn paired_ratios(results: &SuiteResults, reference: &str) -> String {
    use std::fmt::Write;
    if results.meta.repeats < 2 {
        return String::new();
    }
    let mut out = format!(
        "\nratios over paired repeats ({reference} / target; median, least–most): throughput \
         above 1 and p99 below 1 favour {reference}\n"
    );
    for workload in results.workloads() {
        for target in results.targets().iter().filter(|t| *t != reference) {
            let ops = paired_ratio(results, &workload, reference, target, |r| r.ops_per_sec);
            let p99 = paired_ratio(results, &workload, reference, target, |r| {
                r.latency.p99_ns as f64
            });
            if let (Some(ops), Some(p99)) = (ops, p99) {
                let _ = writeln!(
                    out,
                    " {workload:<22} {target:<14} ops/s {:.2}x ({:.2}–{:.2})  p99 {:.2}x ({:.2}–{:.2})  {} pairs",
                    ops.median, ops.min, ops.max, p99.median, p99.min, p99.max, ops.pairs
                );
            }
        }
    }
    out
}

/// dbench's per-operation table (Operation, Count, AvgLat, MaxLat) for each run that has
/// more than one operation kind, and the engine's figures for corefs runs.
pub fn details(results: &SuiteResults) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for run in &results.runs {
        if run.op_table.len() > 1 || run.workload.contains("dbench") {
            let _ = writeln!(
                out,
                "\n{} on {} (repeat {}): {:.1} MiB/s, {:.0} ops/s",
                run.workload,
                run.target,
                run.repeat + 1,
                run.mib_per_sec,
                run.ops_per_sec
            );
            let _ = writeln!(
                out,
                " {:<18} {:>9} {:>11} {:>11} {:>11}",
                "Operation", "Count", "AvgLat", "P99Lat", "MaxLat"
            );
            let _ = writeln!(out, " {}", "-".repeat(64));
            for row in &run.op_table {
                let _ = writeln!(
                    out,
                    " {:<18} {:>9} {:>11.3} {:>11.3} {:>11.3}",
                    row.op,
                    row.latency.count,
                    row.latency.mean_ns / 1e6,
                    row.latency.p99_ns as f64 / 1e6,
                    row.latency.max_ns as f64 / 1e6
                );
            }
            let _ = writeln!(out, " (latencies in ms)");
        }
    }
    let engine_runs: Vec<&RunResult> = results.runs.iter().filter(|r| r.engine.is_some()).collect();
    if !engine_runs.is_empty() {
        let _ = writeln!(
            out,
            "\nengine figures (corefs runs; a commit's pause is the part that holds the reactor, a slice one serialization step after it; gap: the longest the reactor's loop did not look at its queue, host steal included; on cpu: of such a gap, the most the reactor can have spent running (its thread's CPU time; the rest it or its virtual CPU was descheduled; a host pause not reported as steal counts as running); steal: CPU time the hypervisor took from the machine's cores during the run; reply: the longest a request took inside corefs, submit to reply pushed (a client's max above it is its own wake-up); dev wait: the longest synchronous device wait inside an operation; fsq99/fsl99: fsync's p99 waiting in the reactor's queue and in its record's write and flush; groups: block groups shards took from the pool and gave back since the mount; data cache: the engine's data-block cache, off where a workload measures the device path)\n {:<22} {:<12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>11}  data cache",
            "workload", "target", "commits", "avg ms", "max ms", "pause ms", "slice ms", "gap ms", "oncpu ms", "steal ms", "reply ms", "devwt ms", "fsq99 ms", "fsl99 ms", "log wr", "fallback", "groupmax", "unpin ms", "mount ms", "groups"
        );
        for run in engine_runs {
            let e = run.engine.as_ref().expect("filtered");
            let _ = writeln!(
                out,
                " {:<22} {:<12} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>9} {:>9} {:>10.3} {:>9} {:>11}  {}",
                run.workload,
                run.target,
                e.commits,
                e.commit_ms_avg,
                e.commit_ms_max,
                e.commit_pause_ms_max,
                e.commit_slice_ms_max,
                e.loop_gap_ms_max,
                e.loop_gap_on_cpu_ms_max,
                run.host_steal_ms
                    .map(|ms| format!("{ms:.0}"))
                    .unwrap_or_else(|| "-".into()),
                e.reply_ms_max,
                e.device_wait_ms_max,
                e.fsync_queue_p99_ms,
                e.fsync_log_p99_ms,
                e.log_writes,
                e.fallback_commits,
                e.fsync_group_max,
                e.unpin_ms_last,
                run.mount_ms
                    .map(|m| format!("{m:.1}"))
                    .unwrap_or_else(|| "-".into()),
                format!("{}/{}", e.groups_taken, e.groups_returned),
                data_cache_summary(e)
            );
        }
    }
    out
}

/// Writes results.json, table.txt and the plots into `out_dir`; returns the files written.
pub fn write_outputs(results: &SuiteResults, out_dir: &Path) -> R<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut files = Vec::new();
    let json = out_dir.join("results.json");
    results.save(&json)?;
    files.push(json);
    let table = out_dir.join("table.txt");
    std::fs::write(
        &table,
        format!(
            "{}\n{}{}",
            side_by_side(results),
            fio_raw::comparison(results),
            details(results)
        ),
    )
    .map_err(|e| format!("{}: {e}", table.display()))?;
    files.push(table);
    files.extend(plot::write_plots(results, out_dir)?);
    Ok(files)
}

#[cfg(test)]
mod tests {
    /// The steal column is the eighth number of the `cpu` line, in clock ticks.
    #[test]
    fn steal_is_read_from_the_cpu_line() {
        let stat = "cpu  100 2 30 4000 5 0 6 250 0 0\ncpu0 50 1 15 2000 2 0 3 125 0 0\n";
        assert_eq!(super::steal_ms_of(stat, 100.0), Some(2500.0));
        assert_eq!(
            super::steal_ms_of("cpu  1 2 3 4\n", 100.0),
            None,
            "no steal column"
        );
        assert_eq!(super::steal_ms_of("intr 5\n", 100.0), None);
    }
}
