//! `corefs soak`: `corefs_bench::soak` with a table of samples as it runs; by default on a
//! temporary image that is removed afterwards.

/// Many clients run a verified mixed workload (create, write, fsync, read back, unlink)
/// for a long time; prints RSS, open descriptors and operations every interval.
#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        device,
        clients,
        seconds,
        interval,
        files,
    } = args;
    // The image lives until the run ends (dropping it removes the file).
    let image = match &device {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("corefs-soak-")
                .suffix(".img")
                .tempfile_in("/var/tmp")
                .map_err(|e| format!("creating an image in /var/tmp: {e}"))?,
        ),
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
    let report = corefs_bench::soak::run(
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
    )?;
    let first = report.samples.first().copied();
    let end = report.samples.last().copied();
    if let (Some(a), Some(b)) = (first, end) {
        println!(
            "soak: {} operations, {} reads verified; RSS {} -> {} KiB, open fds {} -> {}",
            report.ops, report.verified_reads, a.rss_kib, b.rss_kib, a.open_fds, b.open_fds
        );
    }
    Ok(())
}
