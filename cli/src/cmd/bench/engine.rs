//! `corefs bench engine`: `corefs_bench::engine`, the engine alone on the memory backend.

use crate::cmd::write_json;
use std::path::PathBuf;

/// Engine figures on the memory backend: create rate, 4 KiB overwrite cost, commit latency
/// of 10,000 dirty inodes, directory-index batching.
#[derive(clap::Args)]
pub struct Args {
    /// Empty-file creates to time.
    #[arg(long, default_value_t = 300_000)]
    creates: u64,
    /// Files to create, remount and list with a bounded metadata cache.
    #[arg(long, default_value_t = 1_000_000)]
    files: u64,
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    let report = corefs_bench::engine::run(args.creates, args.files)?;
    print!("{report}");
    write_json(args.json, &report)
}
