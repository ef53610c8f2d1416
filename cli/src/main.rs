//! `corefs`: the command-line tool for operators and benchmarkers: `mkfs`, `fsck`, `mount`
//! (FUSE), `probe` (kernel features), `crashtest`, and `bench` (the suite, compare, and the
//! narrower device, engine, fsync and clients benchmarks).

mod fuse;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "corefs",
    version,
    about = "corefs: a polled-mode userspace filesystem"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a filesystem (destroys what the device holds). Refused while another mount,
    /// mkfs or fsck holds the device.
    Mkfs {
        /// Device string: file:PATH, nvme:/dev/ngXnY, mem:SIZE.
        device: String,
        /// Create or grow a file image to this size (file: devices).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Shards (1..=64): units of parallelism, each with its own tree and space.
        #[arg(long, default_value_t = engine::format::DEFAULT_SHARDS)]
        shards: u32,
        #[arg(long, default_value = "")]
        label: String,
    },
    /// Check a filesystem: both superblocks, the fsync logs, every tree node (checksum,
    /// address, generation), every name, back-reference, link count, extent and block of the
    /// space bitmap, and every data block's checksum. Exit codes as e2fsck: 0 clean, 1 errors
    /// corrected, 4 errors left uncorrected, 8 operational error.
    ///
    /// By default fsck writes, as a mount does: it replays the fsync log records the device
    /// holds and commits them (it says how many before it writes), and it holds the device
    /// exclusively. With -n it writes nothing: the records are replayed in memory only, and
    /// the device is opened read-only, so it also works (with a warning) while mounted.
    Fsck {
        device: String,
        /// Repair what is safe to repair: a damaged superblock copy is rewritten from the
        /// current one. (Log records are replayed by every mount, as a journal is.)
        #[arg(long, conflicts_with = "no_write")]
        repair: bool,
        /// Check only, change nothing (e2fsck's -n): open the device read-only and replay the
        /// fsync logs in memory; the report is the one a plain fsck would give.
        #[arg(short = 'n', long = "no-write")]
        no_write: bool,
        /// Skip reading and verifying every data block.
        #[arg(long)]
        no_data: bool,
    },
    /// Print what an image holds without mounting it (nothing is written; the device is
    /// opened read-only, so this works on a mounted image too, with a warning).
    Dump {
        device: String,
        #[command(subcommand)]
        what: DumpWhat,
    },
    /// Report the kernel features corefs uses and what to do about missing ones.
    Probe,
    /// Crash-consistency test: ACE workloads of one or two operations, every crash state at
    /// every persistence point and flush mounted and checked against an oracle.
    Crashtest {
        /// Run every workload of this length (1 or 2).
        #[arg(long, conflicts_with = "sample")]
        length: Option<usize>,
        /// Run this many workloads drawn at random (lengths 1 and 2).
        #[arg(long)]
        sample: Option<usize>,
        #[arg(long)]
        seed: Option<u64>,
        /// Worker threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        /// Run the workloads through this many reactors (client API, coordinated commits)
        /// only, instead of under every schedule.
        #[arg(long)]
        reactors: Option<usize>,
        /// The schedules to run each workload under (default: all of them): plain,
        /// pipelined, commit-in-flight, fallback, writeback, reactors (two reactors).
        #[arg(long, value_delimiter = ',')]
        schedules: Option<Vec<String>>,
        /// Run only part K of N (`K/N`, 1-based): the workloads split into N contiguous
        /// parts, each keeping its index in the whole list (and so its per-workload seed), so
        /// a long run can be done in pieces whose counts and times add up.
        #[arg(long, value_parser = parse_part)]
        part: Option<(usize, usize)>,
    },
    /// Serve a filesystem at a mountpoint through FUSE until it is unmounted (umount or
    /// fusermount3 -u); the unmount commits. The device is held exclusively meanwhile: a
    /// second mount, mkfs or fsck of it fails (dump and fsck -n still read it).
    Mount {
        /// Device string: file:PATH, nvme:/dev/ngXnY.
        device: String,
        mountpoint: PathBuf,
        /// Pin the reactor to this core (with several reactors: this core and the next ones).
        #[arg(long, value_parser = parse_core)]
        core: Option<usize>,
        /// Reactors, each serving every N-th shard on its own device queue (0: one per core).
        #[arg(long, default_value_t = 1)]
        reactors: usize,
        /// Busy-poll (a dedicated core) instead of spin-then-park.
        #[arg(long)]
        busy_poll: bool,
        /// Let every user use the mount, not only the mounter (FUSE's allow_other), as a
        /// storage service run by root serves others: the kernel checks each caller's
        /// permissions against modes and owners (default_permissions), as on a kernel
        /// filesystem. A mounter other than root needs `user_allow_other` in /etc/fuse.conf
        /// (fusermount3 refuses the option otherwise).
        #[arg(long)]
        allow_other: bool,
    },
    /// Many clients run a verified mixed workload (create, write, fsync, read back, unlink)
    /// for a long time; prints RSS, open descriptors and operations every interval.
    Soak {
        /// Device string (formatted): file:PATH,size=.., nvme:.., mem:SIZE (a memory device's
        /// pages count in RSS as they are written). Default: a 1 GiB temporary image in
        /// /var/tmp, removed afterwards.
        #[arg(long)]
        device: Option<String>,
        #[arg(long, default_value_t = 8)]
        clients: usize,
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Seconds between samples.
        #[arg(long, default_value_t = 5.0)]
        interval: f64,
        /// Files each client keeps at most (so the filesystem's size stays flat).
        #[arg(long, default_value_t = 200)]
        files: usize,
    },
    /// Deterministic simulation: the reactor and clients in one thread under a seeded
    /// scheduler on a simulated device with seeded device errors, then crash states cut at
    /// random points, each mounted, checked and compared with what clients were acknowledged.
    Sim {
        /// Seeds to run, starting at --seed.
        #[arg(long, default_value_t = 100)]
        seeds: u64,
        /// First seed (default: from the clock; printed).
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, default_value_t = 600)]
        steps: usize,
        #[arg(long, default_value_t = 4)]
        clients: usize,
        /// Probability per step of arming a one-shot EIO (read, write or flush), on every
        /// other seed.
        #[arg(long, default_value_t = 0.004)]
        eio: f64,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Subcommand)]
enum DumpWhat {
    /// Both superblock copies.
    Super,
    /// Every tree node with its items decoded (all shards, or --shard).
    Trees {
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Every item of one inode.
    Inode { ino: u64 },
    /// The fsync log records the next mount would replay, per shard.
    Logs,
    /// Nodes, items, inodes, extents and blocks per shard.
    Stats,
}

#[derive(Subcommand)]
enum Bench {
    /// The suite (the README's main job): append + fdatasync, random overwrites with fsync,
    /// file creates, a dbench-like mix and random reads at QD1/QD32, on corefs and on kernel
    /// filesystems on the same disk; prints the side-by-side table, writes results.json,
    /// table.txt and SVG plots.
    Suite {
        /// Directory for the image, loop files and kernel runs (must support O_DIRECT).
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Targets, comma-separated: corefs-file, corefs-mem, corefs:DEVICE (e.g.
        /// corefs:nvme:/dev/ng0n1; destroyed), dir:PATH (a kernel filesystem directory), ext4,
        /// xfs, btrfs (made on loop devices in --dir; root). Default: corefs-file and
        /// dir:<--dir>.
        #[arg(long, value_delimiter = ',')]
        targets: Vec<String>,
        /// Shortcut: add ext4, xfs and btrfs on loop devices to the targets.
        #[arg(long)]
        loops: bool,
        /// Run only workloads whose names contain one of these (comma-separated). Entries
        /// starting with "rocksdb" run RocksDB on corefs and on the kernel directory
        /// (corefs_db_bench, built by scripts/rocksdb-build.sh; needs librocksdb-dev).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Seconds per workload and target.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Repeats per workload and target (compare needs 2+ to judge significance).
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// corefs image and loop file size.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        image_size: u64,
        /// corefs shards (a file's data lives in its inode's shard: fewer, larger shards).
        #[arg(long, default_value_t = 2)]
        shards: u32,
        /// randwrite clients (fio numjobs).
        #[arg(long, default_value_t = 4)]
        writers: usize,
        /// fsync every N 4 KiB random overwrites.
        #[arg(long, default_value_t = 8)]
        fsync_every: u32,
        /// Each randwrite client's file.
        #[arg(long, default_value = "16MiB", value_parser = parse_size)]
        write_file_size: u64,
        /// Clients and directories of the create workload.
        #[arg(long, default_value_t = 4)]
        create_clients: usize,
        #[arg(long, default_value_t = 4)]
        create_dirs: usize,
        /// dbench-like clients.
        #[arg(long, default_value_t = 8)]
        dbench_clients: usize,
        /// The random-read file.
        #[arg(long, default_value = "192MiB", value_parser = parse_size)]
        read_file_size: u64,
        /// corefs reactors share the cores with the clients (unpinned; reactors spin, then
        /// park). The default, when there are more cores than reactors: each reactor pinned to
        /// a core of its own (the last ones), busy-polling, and corefs's clients on the
        /// others — dedicated storage cores, as corefs is meant to run.
        #[arg(long)]
        shared_cores: bool,
        /// corefs reactors (each serving every N-th shard; at most --shards).
        #[arg(long, default_value_t = 1)]
        reactors: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Where results.json, table.txt and the plots go (default: bench-results/<time>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Lines up two suite results (baseline, current): mean and stdev over repeats, percent
    /// difference, `*` where it exceeds two baseline stdevs.
    Compare { baseline: PathBuf, current: PathBuf },
    /// Prints the tables and redraws the plots of a results.json.
    Show {
        results: PathBuf,
        /// Where to write the plots (default: beside the file).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Engine figures on the memory backend: create rate, 4 KiB overwrite cost, commit latency
    /// of 10,000 dirty inodes, directory-index batching.
    Engine {
        /// Empty-file creates to time.
        #[arg(long, default_value_t = 300_000)]
        creates: u64,
        /// Files to create, remount and list with a bounded metadata cache.
        #[arg(long, default_value_t = 1_000_000)]
        files: u64,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Concurrent clients appending 4 KiB + fsync through the reactor (1, 4, 16 clients), and
    /// the CPU an idle reactor uses.
    Clients {
        /// Directory for the file image (not tmpfs).
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        image_size: u64,
        /// Client counts to run, comma-separated.
        #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
        clients: Vec<usize>,
        /// Seconds per client count.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Reactors share every core with the clients (spin, then park). The default, when
        /// there are more cores than reactors: each reactor busy-polls on a core of its own
        /// (the last ones) and the clients are pinned to the others, as the suite runs.
        #[arg(long)]
        shared_cores: bool,
        /// With --shared-cores: busy-poll instead of spin-then-park.
        #[arg(long)]
        busy_poll: bool,
        /// Reactor counts to run each client count with, comma-separated.
        #[arg(long, default_value = "1,2", value_delimiter = ',')]
        reactors: Vec<usize>,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// 4 KiB append + fdatasync at queue depth 1: corefs on a file image (or --device), the raw
    /// device's write + flush, and the kernel filesystem holding the image, in alternating
    /// rounds; corefs's commits count inside the operations, as ext4's journal commits do.
    Fsync {
        /// Directory for the image and the raw file (not tmpfs).
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Run corefs on this device instead of an image in --dir, e.g. nvme:/dev/ng0n1. Its
        /// content is destroyed.
        #[arg(long)]
        device: Option<String>,
        /// Directory on the kernel filesystem to compare with (default: --dir), e.g. an ext4
        /// mounted on a loop device.
        #[arg(long)]
        kernel_dir: Option<PathBuf>,
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        image_size: u64,
        /// Seconds per target and round.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Device-layer micro-benchmark: CPU cost per op (memory), latency at QD1/QD32 (file image,
    /// and any --device given), side by side with fio on the same file.
    Device {
        /// Extra device to measure, e.g. nvme:/dev/ng0n1 (repeatable). Its content is destroyed.
        #[arg(long = "device")]
        devices: Vec<String>,
        /// Directory for the temporary file image (must support O_DIRECT: not tmpfs).
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Size of the file image.
        #[arg(long, default_value = "256MiB", value_parser = parse_size)]
        image_size: u64,
        /// Seconds per latency test and round.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Rounds per workload, alternating corefs and fio; medians are compared.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Operations per CPU-cost test on the memory backend.
        #[arg(long, default_value_t = 2_000_000)]
        mem_ops: u64,
        /// Skip the fio comparison.
        #[arg(long)]
        no_fio: bool,
        /// Also write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn bench_suite(
    mut config: corefs_bench::suite::SuiteConfig,
    targets: Vec<String>,
    loops: bool,
    out: Option<PathBuf>,
) -> Result<(), String> {
    use corefs_bench::suite::{self, TargetSpec};
    for t in &targets {
        config.targets.push(TargetSpec::parse(t)?);
    }
    if loops {
        if config.targets.is_empty() {
            config.targets = vec![
                TargetSpec::CorefsFile,
                TargetSpec::KernelDir(config.dir.clone()),
            ];
        }
        for fs in ["ext4", "xfs", "btrfs"] {
            config.targets.push(TargetSpec::KernelLoop(fs.into()));
        }
    }
    let out = out.unwrap_or_else(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from("bench-results").join(format!("suite-{now}"))
    });
    let results = suite::run(&config, &|line| eprintln!("{line}"))?;
    println!("\n{}", suite::side_by_side(&results));
    print!("{}", suite::details(&results));
    let files = suite::write_outputs(&results, &out)?;
    println!(
        "\nwrote {} files to {} (results.json, table.txt, cdf-*.svg, hist-*.svg); \
         compare two runs with `corefs bench compare OLD/results.json NEW/results.json`",
        files.len(),
        out.display()
    );
    Ok(())
}

/// A seed from the clock, for runs not given one (printed, so they replay).
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

fn parse_size(text: &str) -> Result<u64, String> {
    nvme::spec::parse_size(text)
}

/// A core id the process may run on (`reactor::affinity`): an error naming the allowed set
/// otherwise, while the arguments are parsed.
fn parse_core(text: &str) -> Result<usize, String> {
    let core: usize = text
        .parse()
        .map_err(|e| format!("{text:?} is not a core id: {e}"))?;
    reactor::affinity::check_cores(&[core]).map_err(|e| e.to_string())?;
    Ok(core)
}

/// The tool's allocator. The reactor frees what client threads allocated (an operation's
/// names and data) and the clients free its replies; glibc's malloc took a lock per such free
/// and consolidated arenas on the reactor's time (a quarter of it in a create run). An
/// application embedding corefs chooses its own allocator; this one is for the tool's runs
/// (creates 152k -> 172k/s, mean of three paired runs). Transparent huge pages are turned off
/// for the process in `main` (see there).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// No transparent huge pages for this process. mimalloc advises its heap segments for them,
/// so the first touch of a segment faulted in and zeroed 2 MiB on whichever thread touched
/// it, the reactor included: on this VM (memory backed lazily by the host) such a fault held
/// a dbench write for 5-11 ms, 20 times in 3 s; with THP off, none (`thp_fault_alloc` 111 -> 0
/// per run). Latency-bound servers commonly run without THP for the same reason. The DMA pool
/// uses hugetlb pages when reserved, which this does not affect.
fn disable_transparent_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if rc != 0 {
        tracing::debug!(
            "prctl(PR_SET_THP_DISABLE) failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let cli = Cli::parse();
    // The crash tester mounts millions of crash states, most of which replay or drop a log
    // record: only errors are worth a line there.
    let default_level = match cli.command {
        Command::Crashtest { .. } | Command::Sim { .. } => "error",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COREFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Mkfs {
            device,
            size,
            shards,
            label,
        } => mkfs(&device, size, shards, label),
        Command::Fsck {
            device,
            repair,
            no_write,
            no_data,
        } => return fsck(&device, repair, no_write, !no_data),
        Command::Dump { device, what } => open_read_only(&device, "dump").and_then(|mut dev| {
            let dev = &mut *dev;
            use engine::inspect;
            let text = match what {
                DumpWhat::Super => Ok(inspect::format_superblocks(dev)),
                DumpWhat::Trees { shard } => inspect::format_trees(dev, shard),
                DumpWhat::Inode { ino } => inspect::format_inode(dev, ino),
                DumpWhat::Logs => inspect::format_logs(dev),
                DumpWhat::Stats => inspect::format_stats(dev),
            }?;
            print!("{text}");
            Ok(())
        }),
        Command::Crashtest {
            length,
            sample,
            seed,
            threads,
            reactors,
            schedules,
            part,
        } => {
            let seed = seed.unwrap_or_else(clock_seed);
            let schedules: Vec<crashtest::Schedule> = match schedules {
                None => crashtest::Schedule::ALL.to_vec(),
                Some(names) => match names
                    .iter()
                    .map(|n| crashtest::Schedule::from_name(n).ok_or(n))
                    .collect()
                {
                    Ok(s) => s,
                    Err(n) => return fail(format!("--schedules: no schedule {n}")),
                },
            };
            if let Err(why) = announce_mutation() {
                return fail(why);
            }
            let workloads = match (length, sample) {
                (Some(length), _) if (1..=2).contains(&length) => {
                    crashtest::workload::exhaustive(length)
                }
                (Some(length), _) => return fail(format!("--length {length}: use 1 or 2")),
                (None, count) => crashtest::workload::sample(count.unwrap_or(1000), seed),
            };
            let all = workloads.len();
            let (first, workloads) = match part {
                None => (0, workloads),
                Some((k, n)) => {
                    let range = part_range(all, k, n);
                    (range.start, workloads[range].to_vec())
                }
            };
            let threads = threads.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            });
            eprintln!(
                "crashtest: {} workloads (from index {first} of {all}) on {threads} threads, seed {seed}, schedules {}",
                workloads.len(),
                match reactors {
                    Some(n) => format!("{n} reactors"),
                    None => schedules
                        .iter()
                        .map(|s| s.name())
                        .collect::<Vec<_>>()
                        .join(","),
                }
            );
            let start = std::time::Instant::now();
            crashtest(workloads, first, seed, threads, reactors, &schedules).map(|(count, outcome)| {
                let states = outcome.crash_states;
                println!(
                    "crashtest: {count} workloads, {} runs, {states} crash states checked ({} with writes in flight), 0 violations, {:.1} s (seed {seed})",
                    outcome.runs,
                    outcome.in_flight_states,
                    start.elapsed().as_secs_f64()
                );
                println!(
                    "crashtest: {} persistence points: {} fsync log records ({} pipelined behind another, {} during a commit), {} fsyncs with nothing new to log, {} fell back to a commit, {} KiB written back in the background",
                    outcome.persistence_points,
                    outcome.log_writes,
                    outcome.pipelined_records,
                    outcome.records_during_commit,
                    outcome.already_logged,
                    outcome.fallback_commits,
                    outcome.writeback_bytes >> 10
                );
            })
        }
        Command::Mount {
            device,
            mountpoint,
            core,
            reactors,
            busy_poll,
            allow_other,
        } => match core {
            // One core per reactor from `core` on, each one the process may run on (with
            // reactors 0, the number is not known yet: `core` alone).
            Some(c) if reactors > 0 => reactor::affinity::consecutive_cores(c, reactors),
            _ => Ok(Vec::new()),
        }
        .map_err(|e| format!("--core: {e}"))
        .and_then(|cores| {
            reactor::Runtime::start(reactor::Config {
                device: device.clone(),
                core,
                reactors,
                cores,
                idle: if busy_poll {
                    reactor::IdlePolicy::BusyPoll
                } else {
                    reactor::IdlePolicy::default()
                },
                ..reactor::Config::default()
            })
            .map_err(|e| format!("{device}: {e}"))
        })
        .and_then(|runtime| {
            eprintln!(
                "corefs: serving {device} at {} (unmount with: umount {})",
                mountpoint.display(),
                mountpoint.display()
            );
            let access = if allow_other {
                fuse::Access::Everyone
            } else {
                fuse::Access::Mounter
            };
            fuse::serve(runtime, &mountpoint, access).map_err(|e| {
                format!(
                    "mounting at {}: {e}{}",
                    mountpoint.display(),
                    fuse::mount_hint(&e)
                )
            })
        }),
        Command::Soak {
            device,
            clients,
            seconds,
            interval,
            files,
        } => {
            let image = match &device {
                Some(_) => None,
                None => match tempfile::Builder::new()
                    .prefix("corefs-soak-")
                    .suffix(".img")
                    .tempfile_in("/var/tmp")
                {
                    Ok(f) => Some(f),
                    Err(e) => return fail(format!("creating an image in /var/tmp: {e}")),
                },
            };
            let device = device.unwrap_or_else(|| {
                format!(
                    "file:{},size=1GiB",
                    image.as_ref().expect("made above").path().display()
                )
            });
            println!(
                "{:>8} {:>10} {:>6} {:>12} {:>10}",
                "seconds", "RSS KiB", "fds", "ops", "ops/s"
            );
            let last = std::cell::Cell::new((0.0f64, 0u64));
            corefs_bench::soak::run(
                &corefs_bench::soak::SoakConfig {
                    device,
                    clients,
                    seconds,
                    interval_seconds: interval,
                    files_per_client: files,
                },
                &|s| {
                    let (t0, ops0) = last.get();
                    let rate = if s.at_seconds > t0 {
                        (s.ops - ops0) as f64 / (s.at_seconds - t0)
                    } else {
                        0.0
                    };
                    println!(
                        "{:>8.1} {:>10} {:>6} {:>12} {:>10.0}",
                        s.at_seconds, s.rss_kib, s.open_fds, s.ops, rate
                    );
                    last.set((s.at_seconds, s.ops));
                },
            )
            .map(|report| {
                let first = report.samples.first().copied();
                let end = report.samples.last().copied();
                if let (Some(a), Some(b)) = (first, end) {
                    println!(
                        "soak: {} operations, {} reads verified; RSS {} -> {} KiB, open fds {} -> {}",
                        report.ops, report.verified_reads, a.rss_kib, b.rss_kib, a.open_fds, b.open_fds
                    );
                }
            })
        }
        Command::Sim {
            seeds,
            seed,
            steps,
            clients,
            eio,
        } => {
            let first = seed.unwrap_or_else(clock_seed);
            eprintln!(
                "sim: seeds {first}..{} ({} steps, {clients} clients)",
                first + seeds,
                steps
            );
            let started = std::time::Instant::now();
            let mut total = reactor::sim::SimOutcome::default();
            let mut result = Ok(());
            for s in first..first + seeds {
                let config = reactor::sim::SimConfig {
                    seed: s,
                    clients,
                    steps,
                    eio_rate: if s % 2 == 1 { eio } else { 0.0 },
                    ..Default::default()
                };
                match reactor::sim::run(&config) {
                    Ok(o) => total.add(&o),
                    Err(e) => {
                        result = Err(format!("{e} (replay: corefs sim --seeds 1 --seed {s})"));
                        break;
                    }
                }
            }
            result.map(|()| {
                println!(
                    "sim: {seeds} seeds, 0 violations: {} batches, {} fsyncs acknowledged, {} failed under \
                     {} injected device errors ({} runs failed stop), {} reads verified, {} reads \
                     failed (detected), {} rewrites acknowledged, {} requests parked for metadata, {} crash \
                     states checked, {:.1} s",
                    total.batches,
                    total.fsyncs_acknowledged,
                    total.fsyncs_failed,
                    total.faults_armed,
                    total.runs_failed_stop,
                    total.reads_verified,
                    total.reads_failed,
                    total.rewrites_acknowledged,
                    total.meta_parks,
                    total.crash_states,
                    started.elapsed().as_secs_f64()
                );
            })
        }
        Command::Probe => {
            print!("{}", nvme::probe::probe());
            Ok(())
        }
        Command::Bench(Bench::Suite {
            dir,
            targets,
            loops,
            only,
            seconds,
            repeat,
            image_size,
            shards,
            writers,
            fsync_every,
            write_file_size,
            create_clients,
            create_dirs,
            dbench_clients,
            read_file_size,
            shared_cores,
            reactors,
            seed,
            out,
        }) => bench_suite(
            corefs_bench::suite::SuiteConfig {
                dir: dir.clone(),
                image_bytes: image_size,
                shards,
                seconds,
                repeats: repeat.max(1),
                targets: Vec::new(),
                only,
                sizes: corefs_bench::suite::workloads::Sizes {
                    writers,
                    write_file_bytes: write_file_size,
                    fsync_every: fsync_every.max(1),
                    create_clients,
                    create_dirs: create_dirs.max(1),
                    dbench_clients,
                    read_file_bytes: read_file_size,
                },
                placement: corefs_bench::suite::Placement::choose(reactors, shared_cores),
                reactors,
                seed,
            },
            targets,
            loops,
            out,
        ),
        Command::Bench(Bench::Compare { baseline, current }) => {
            use corefs_bench::suite::results::SuiteResults;
            SuiteResults::load(&baseline).and_then(|base| {
                let current = SuiteResults::load(&current)?;
                print!("{}", corefs_bench::suite::compare::report(&base, &current));
                Ok(())
            })
        }
        Command::Bench(Bench::Show { results, out }) => {
            corefs_bench::suite::results::SuiteResults::load(&results).and_then(|r| {
                print!(
                    "{}{}",
                    corefs_bench::suite::side_by_side(&r),
                    corefs_bench::suite::details(&r)
                );
                let dir = out.unwrap_or_else(|| {
                    results
                        .parent()
                        .map(PathBuf::from)
                        .unwrap_or_else(|| PathBuf::from("."))
                });
                std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                let files = corefs_bench::suite::plot::write_plots(&r, &dir)?;
                println!("{} plots in {}", files.len(), dir.display());
                Ok(())
            })
        }
        Command::Bench(Bench::Engine {
            creates,
            files,
            json,
        }) => corefs_bench::engine::run(creates, files).and_then(|report| {
            print!("{report}");
            write_json(json, &report)
        }),
        Command::Bench(Bench::Clients {
            dir,
            image_size,
            clients,
            seconds,
            shared_cores,
            busy_poll,
            reactors,
            json,
        }) => {
            let config = corefs_bench::clients::ClientsBenchConfig {
                dir,
                image_bytes: image_size,
                clients,
                seconds,
                shared_cores,
                busy_poll,
                reactors,
                ..Default::default()
            };
            corefs_bench::clients::run(&config).and_then(|report| {
                print!("{report}");
                write_json(json, &report)
            })
        }
        Command::Bench(Bench::Fsync {
            dir,
            device,
            kernel_dir,
            image_size,
            seconds,
            rounds,
            json,
        }) => {
            let config = corefs_bench::fsync::FsyncBenchConfig {
                dir,
                kernel_dir,
                image_bytes: image_size,
                seconds_per_round: seconds,
                rounds,
                device,
            };
            corefs_bench::fsync::run(&config).and_then(|report| {
                print!("{report}");
                write_json(json, &report)
            })
        }
        Command::Bench(Bench::Device {
            devices,
            dir,
            image_size,
            seconds,
            rounds,
            mem_ops,
            no_fio,
            json,
        }) => {
            let config = corefs_bench::device::DeviceBenchConfig {
                devices,
                image_dir: dir,
                image_bytes: image_size,
                seconds_per_test: seconds,
                mem_ops,
                run_fio: !no_fio,
                rounds,
            };
            corefs_bench::device::run(&config).and_then(|report| {
                print!("{report}");
                match json {
                    Some(path) => std::fs::write(
                        &path,
                        serde_json::to_string_pretty(&report).expect("serializable"),
                    )
                    .map_err(|e| format!("writing {}: {e}", path.display())),
                    None => Ok(()),
                }
            })
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("corefs: {why}");
            ExitCode::FAILURE
        }
    }
}

fn open(device: &str, size: Option<u64>) -> Result<Box<dyn nvme::BlockDevice>, String> {
    let defaults = nvme::OpenOptions {
        size_bytes: size,
        ..Default::default()
    };
    nvme::open_device(device, &defaults).map_err(|e| e.to_string())
}

/// Opens a device read-only and without its exclusive lock, for tools that write nothing;
/// says so when a writer holds it, since what they read may then be stale or change under
/// them.
fn open_read_only(device: &str, tool: &str) -> Result<Box<dyn nvme::BlockDevice>, String> {
    let defaults = nvme::OpenOptions {
        access: nvme::Access::ReadShared,
        ..Default::default()
    };
    let dev = nvme::open_device(device, &defaults).map_err(|e| e.to_string())?;
    match nvme::lock::in_use(device) {
        Ok(Some(holder)) => eprintln!(
            "corefs {tool}: warning: {device} is in use ({holder}): it is read as it is now, \
             while it may be changing, so what this shows may be stale or inconsistent"
        ),
        Ok(None) => {}
        Err(e) => eprintln!("corefs {tool}: warning: cannot tell whether {device} is in use: {e}"),
    }
    Ok(dev)
}

fn mkfs(device: &str, size: Option<u64>, shards: u32, label: String) -> Result<(), String> {
    let dev = open(device, size)?;
    let bytes = dev.info().capacity_bytes();
    let options = engine::MkfsOptions { shards, label };
    let dev = engine::Filesystem::mkfs(dev, &options).map_err(|e| e.to_string())?;
    let mut fs = engine::Filesystem::mount(dev, Default::default()).map_err(|e| e.to_string())?;
    // The root directory belongs to whoever makes the filesystem, as mke2fs does: a user who
    // formats an image and mounts it (through fusermount3) can then write to it.
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if (uid, gid) != (0, 0) {
        let owner = engine::SetAttr {
            uid: Some(uid),
            gid: Some(gid),
            ..Default::default()
        };
        fs.setattr(fs.root(), owner).map_err(|e| e.to_string())?;
        fs.sync().map_err(|e| e.to_string())?;
    }
    let sb = fs.superblock();
    println!(
        "corefs: {} MiB on {device}: {} shards of {} MiB, generation {}, label {:?}",
        bytes >> 20,
        sb.shards.len(),
        (sb.region_blocks * 4096) >> 20,
        sb.generation,
        sb.label
    );
    Ok(())
}

fn fsck(device: &str, repair: bool, no_write: bool, check_data: bool) -> ExitCode {
    use engine::inspect;
    use std::io::IsTerminal;
    let opened = if no_write {
        open_read_only(device, "fsck")
    } else {
        open(device, None)
    };
    let mut dev = match opened {
        Ok(dev) => dev,
        Err(why) => {
            eprintln!("corefs fsck: {why}");
            return ExitCode::from(8);
        }
    };
    let mut corrected = 0u32;
    // Superblocks: mount would quietly use the good copy; fsck names a damaged one.
    let copies = inspect::superblocks(&mut *dev);
    let current = match inspect::current_superblock(&mut *dev) {
        Ok(sb) => sb,
        Err(why) => {
            println!("corefs fsck: {device}: CORRUPT: superblock: {why}");
            return ExitCode::from(4);
        }
    };
    for (addr, copy) in &copies {
        if let Err(why) = copy {
            if repair {
                if let Err(e) = inspect::rewrite_superblock(&mut *dev, &current, *addr) {
                    eprintln!("corefs fsck: {device}: rewriting superblock copy {addr}: {e}");
                    return ExitCode::from(8);
                }
                println!(
                    "corefs fsck: {device}: superblock copy at block {addr} was damaged ({why}): \
                     rewritten from generation {}",
                    current.generation
                );
                corrected += 1;
            } else {
                println!(
                    "corefs fsck: {device}: CORRUPT: superblock copy at block {addr}: {why} \
                     (the other copy is good: --repair rewrites this one)"
                );
                return ExitCode::from(4);
            }
        }
    }
    let records = match inspect::pending_log_records(&mut *dev) {
        Ok(records) => records,
        Err(why) => {
            eprintln!("corefs fsck: {device}: reading the logs: {why}");
            return ExitCode::from(8);
        }
    };
    // Mounting replays the records and commits them, as every mount does: said before it
    // happens, with how to check without it.
    match (records, no_write) {
        (0, _) => eprintln!("corefs fsck: fsync logs: no records to replay"),
        (n, false) => eprintln!(
            "corefs fsck: fsync logs: {n} records: replaying them and writing them to \
             {device}, as a mount would (fsck -n checks without writing)"
        ),
        (n, true) => eprintln!(
            "corefs fsck: fsync logs: {n} records: replaying them in memory only (-n: nothing \
             is written to {device})"
        ),
    }
    // -n: every write of the mount (replay, commit) stays in an in-memory overlay over the
    // read-only device, so the engine runs exactly as it would and the device is not touched.
    let dev: Box<dyn nvme::BlockDevice> = if no_write {
        Box::new(nvme::wrap::OverlayDevice::new(dev))
    } else {
        dev
    };
    let mut fs = match engine::Filesystem::mount(dev, Default::default()) {
        Ok(fs) => fs,
        Err(e) => return fsck_failed(device, "", &e),
    };
    let generation = fs.durable_generation();
    eprintln!("corefs fsck: checking the trees (names, links, extents, space)...");
    let at = format!(" at generation {generation}");
    let report = match fs.check() {
        Ok(report) => report,
        Err(e) => return fsck_failed(device, &at, &e),
    };
    let mut data_blocks = None;
    if check_data {
        let tty = std::io::stderr().is_terminal();
        let mut progress = |done: u32, total: u32| {
            if tty {
                let width = 40;
                let filled = (done as usize * width) / total.max(1) as usize;
                eprint!(
                    "\rcorefs fsck: data checksums [{}{}] {done}/{total} shards",
                    "#".repeat(filled),
                    " ".repeat(width - filled)
                );
                if done == total {
                    eprintln!();
                }
            } else if done == total {
                eprintln!("corefs fsck: data checksums: {total} shards read");
            }
        };
        match fs.check_data(&mut progress) {
            Ok(blocks) => data_blocks = Some(blocks),
            Err(e) => return fsck_failed(device, &at, &e),
        }
    }
    println!(
        "corefs fsck: {device}: clean at generation {generation}: {} inodes ({} directories), {} names, \
         {} items, {} tree blocks, {} data blocks{}{}",
        report.inodes,
        report.directories,
        report.names,
        report.items,
        report.tree_blocks,
        report.data_blocks,
        match data_blocks {
            Some(n) => format!(" ({n} verified against their checksums)"),
            None => " (data not read: --no-data)".into(),
        },
        if corrected > 0 {
            format!("; {corrected} error(s) corrected")
        } else {
            String::new()
        }
    );
    if corrected > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// fsck's verdict on an engine error: corruption is reported (exit 4), anything else is an
/// operational error (exit 8), as e2fsck's codes go.
fn fsck_failed(device: &str, at: &str, e: &engine::EngineError) -> ExitCode {
    if matches!(e, engine::EngineError::Corrupt { .. }) {
        println!("corefs fsck: {device}: CORRUPT{at}: {e}");
        ExitCode::from(4)
    } else {
        eprintln!("corefs fsck: {device}: {e}");
        ExitCode::from(8)
    }
}

fn write_json(path: Option<PathBuf>, report: &impl serde::Serialize) -> Result<(), String> {
    match path {
        Some(path) => std::fs::write(
            &path,
            serde_json::to_string_pretty(report).expect("serializable"),
        )
        .map_err(|e| format!("writing {}: {e}", path.display())),
        None => Ok(()),
    }
}

/// Says which deliberate breakage `COREFS_MUTATION` turned on (a mutation check: the run must
/// then fail), or why it cannot: a normal build carries none of them.
fn announce_mutation() -> Result<(), String> {
    let Ok(name) = std::env::var("COREFS_MUTATION") else {
        return Ok(());
    };
    #[cfg(feature = "mutations")]
    {
        match engine::mutation::from_env() {
            Some(m) => eprintln!(
                "crashtest: mutation {} is on: this run must report a violation",
                m.name()
            ),
            None => eprintln!("crashtest: COREFS_MUTATION={name}: no mutation"),
        }
        Ok(())
    }
    #[cfg(not(feature = "mutations"))]
    Err(format!(
        "COREFS_MUTATION={name}: this corefs was built without the mutation checks \
         (cargo build --release -p corefs-cli --features mutations)"
    ))
}

/// Runs crash-consistency workloads on `threads` threads; returns the workload count and the
/// summed outcome.
fn crashtest(
    workloads: Vec<Vec<crashtest::workload::Op>>,
    first: usize,
    seed: u64,
    threads: usize,
    reactors: Option<usize>,
    schedules: &[crashtest::Schedule],
) -> Result<(u64, crashtest::Outcome), String> {
    let base = crashtest::base_image();
    let total = workloads.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let sum = std::sync::Mutex::new(crashtest::Outcome::default());
    let failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total || failure.lock().expect("lock").is_some() {
                    return;
                }
                // The seed follows the index in the whole list, so a part replays as the
                // whole run would.
                let index = first + i;
                let outcome = match reactors {
                    None => crashtest::run_schedules(
                        &base,
                        &workloads[i],
                        seed ^ index as u64,
                        schedules,
                    ),
                    Some(n) => crashtest::reactors::run_on_reactors(
                        &base,
                        &workloads[i],
                        seed ^ index as u64,
                        n,
                    ),
                };
                match outcome {
                    Ok(outcome) => {
                        sum.lock().expect("lock").add(&outcome);
                    }
                    Err(why) => {
                        *failure.lock().expect("lock") =
                            Some(format!("workload {index} {:?}: {why}", workloads[i]));
                        return;
                    }
                }
                if i % 10_000 == 0 && i > 0 {
                    eprintln!("crashtest: {i}/{total} workloads");
                }
            });
        }
    });
    match failure.into_inner().expect("lock") {
        Some(why) => Err(why),
        None => Ok((total as u64, sum.into_inner().expect("lock"))),
    }
}

/// Parses `K/N` (1 <= K <= N).
fn parse_part(text: &str) -> Result<(usize, usize), String> {
    let (k, n) = text
        .split_once('/')
        .ok_or_else(|| format!("{text}: expected K/N, such as 1/4"))?;
    let k: usize = k.parse().map_err(|e| format!("{text}: part {k}: {e}"))?;
    let n: usize = n.parse().map_err(|e| format!("{text}: parts {n}: {e}"))?;
    if n == 0 || k == 0 || k > n {
        return Err(format!("{text}: need 1 <= K <= N"));
    }
    Ok((k, n))
}

/// The indices of part `k` of `n` (1-based) of `total` workloads: contiguous, covering every
/// index exactly once over k = 1..=n.
fn part_range(total: usize, k: usize, n: usize) -> std::ops::Range<usize> {
    assert!(1 <= k && k <= n, "part {k}/{n}");
    (total * (k - 1) / n)..(total * k / n)
}

fn fail(why: String) -> ExitCode {
    eprintln!("corefs: {why}");
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::{parse_part, part_range};

    #[test]
    fn parts_cover_every_workload_once() {
        for total in [0, 1, 7, 578, 334_084] {
            for n in 1..=9 {
                let mut next = 0;
                for k in 1..=n {
                    let r = part_range(total, k, n);
                    assert_eq!(r.start, next, "total {total} part {k}/{n}");
                    next = r.end;
                }
                assert_eq!(next, total, "total {total} in {n} parts");
            }
        }
    }

    #[test]
    fn part_syntax() {
        assert_eq!(parse_part("2/5"), Ok((2, 5)));
        for bad in ["0/3", "4/3", "1/0", "3", "a/2", "1/"] {
            assert!(parse_part(bad).is_err(), "{bad} accepted");
        }
    }
}
