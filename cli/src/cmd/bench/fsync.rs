//! `corefs bench fsync`: `corefs_bench::fsync`, queue-depth-1 append + fdatasync against the
//! raw device and the kernel filesystem under the image.

use crate::cmd::{parse_size, write_json};
use std::path::PathBuf;

/// 4 KiB append + fdatasync at queue depth 1: corefs on a file image (or --device), the raw
/// device's write + flush, and the kernel filesystem holding the image, in alternating
/// rounds; corefs's commits count inside the operations, as ext4's journal commits do.
#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(args: Args) -> Result<(), String> {
    let config = corefs_bench::fsync::FsyncBenchConfig {
        dir: args.dir,
        kernel_dir: args.kernel_dir,
        image_bytes: args.image_size,
        seconds_per_round: args.seconds,
        rounds: args.rounds,
        device: args.device,
    };
    let report = corefs_bench::fsync::run(&config)?;
    print!("{report}");
    write_json(args.json, &report)
}
