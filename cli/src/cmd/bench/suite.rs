//! `corefs bench suite`: the suite's flags turned into `corefs_bench::suite::SuiteConfig`,
//! its run, and its outputs written to a directory of their own.

use crate::cmd::parse_size;
use corefs_bench::suite::{self, Placement, SuiteConfig, TargetSpec};
use std::path::PathBuf;

/// The suite (the README's main job): append + fdatasync, random overwrites with fsync,
/// file creates, a dbench-like mix and random reads at QD1/QD32, on corefs and on kernel
/// filesystems on the same disk; prints the side-by-side table, writes results.json,
/// table.txt and SVG plots.
#[derive(clap::Args)]
pub struct Args {
    /// Directory for the image, loop files and kernel runs (must support O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Targets, comma-separated: corefs-file, corefs-mem, corefs-serve (`corefs serve` on its own image, the clients in another process), corefs-fuse (`corefs mount` on its own image, the clients' system calls on it), corefs:DEVICE (e.g.
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
    /// corefs shards (units of parallelism; they share the device's space).
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
    /// The sequential workloads' file (seq-read-1m reads it once; seq-write-1m starts a new
    /// file every half of it).
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    seq_file_size: u64,
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
    /// CPU-bound neighbour processes (`sh -c 'while :; do :; done'`) spinning beside every
    /// run of every target: a user's machine is never empty.
    #[arg(long, default_value_t = 0)]
    neighbours: usize,
    /// Pin the neighbours one per core (default: unpinned, placed by the scheduler).
    #[arg(long)]
    neighbours_pinned: bool,
    /// Where results.json, table.txt and the plots go (default: bench-results/<time>).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    let mut config = SuiteConfig {
        dir: args.dir.clone(),
        image_bytes: args.image_size,
        shards: args.shards,
        seconds: args.seconds,
        repeats: args.repeat.max(1),
        targets: Vec::new(),
        only: args.only,
        sizes: suite::workloads::Sizes {
            writers: args.writers,
            write_file_bytes: args.write_file_size,
            fsync_every: args.fsync_every.max(1),
            create_clients: args.create_clients,
            create_dirs: args.create_dirs.max(1),
            dbench_clients: args.dbench_clients,
            read_file_bytes: args.read_file_size,
            seq_file_bytes: args.seq_file_size,
        },
        placement: Placement::choose(args.reactors, args.shared_cores),
        reactors: args.reactors,
        seed: args.seed,
        neighbours: args.neighbours,
        neighbours_pinned: args.neighbours_pinned,
    };
    for t in &args.targets {
        config.targets.push(TargetSpec::parse(t)?);
    }
    if args.loops {
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
    let out = args.out.unwrap_or_else(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from("bench-results").join(format!("suite-{now}"))
    });
    let results = suite::run(&config, &|line| eprintln!("{line}"))?;
    println!("\n{}", suite::side_by_side(&results));
    print!("{}", suite::fio_raw::comparison(&results));
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
