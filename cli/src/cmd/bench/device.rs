//! `corefs bench device`: `corefs_bench::device`, the device layer alone, beside fio.

use crate::cmd::{parse_size, write_json};
use std::path::PathBuf;

/// Device-layer micro-benchmark: CPU cost per op (memory), latency at QD1/QD32 (file image,
/// and any --device given), side by side with fio on the same file.
#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(args: Args) -> Result<(), String> {
    let config = corefs_bench::device::DeviceBenchConfig {
        devices: args.devices,
        image_dir: args.dir,
        image_bytes: args.image_size,
        seconds_per_test: args.seconds,
        mem_ops: args.mem_ops,
        run_fio: !args.no_fio,
        rounds: args.rounds,
    };
    let report = corefs_bench::device::run(&config)?;
    print!("{report}");
    write_json(args.json, &report)
}
