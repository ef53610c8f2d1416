//! `corefs`: the command-line tool for operators and benchmarkers. Subcommands grow with the
//! project (mkfs, fsck, dump, mount); today: `probe` (kernel features) and `bench device`
//! (the device-layer micro-benchmark).

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
    /// Report the kernel features corefs uses and what to do about missing ones.
    Probe,
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Subcommand)]
enum Bench {
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

fn parse_size(text: &str) -> Result<u64, String> {
    nvme::spec::parse_size(text)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COREFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Probe => {
            print!("{}", nvme::probe::probe());
            Ok(())
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
