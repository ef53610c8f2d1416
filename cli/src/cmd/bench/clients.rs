//! `corefs bench clients`: `corefs_bench::clients`, concurrent fsync clients through the
//! reactors.

use crate::cmd::{parse_size, write_json};
use std::path::PathBuf;

/// Concurrent clients appending 4 KiB + fsync through the reactor (1, 4, 16 clients), and
/// the CPU an idle reactor uses.
#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(args: Args) -> Result<(), String> {
    let config = corefs_bench::clients::ClientsBenchConfig {
        dir: args.dir,
        image_bytes: args.image_size,
        clients: args.clients,
        seconds: args.seconds,
        shared_cores: args.shared_cores,
        busy_poll: args.busy_poll,
        reactors: args.reactors,
        ..Default::default()
    };
    let report = corefs_bench::clients::run(&config)?;
    print!("{report}");
    write_json(args.json, &report)
}
