//! `corefs sim`: `reactor::sim` over a range of seeds, stopping at the first violation with
//! the command that replays it.

use super::clock_seed;

/// Deterministic simulation: the reactor and clients in one thread under a seeded
/// scheduler on a simulated device with seeded device errors, then crash states cut at
/// random points, each mounted, checked and compared with what clients were acknowledged.
#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        seeds,
        seed,
        steps,
        clients,
        eio,
    } = args;
    let first = seed.unwrap_or_else(clock_seed);
    eprintln!(
        "sim: seeds {first}..{} ({} steps, {clients} clients)",
        first + seeds,
        steps
    );
    let started = std::time::Instant::now();
    let mut total = reactor::sim::SimOutcome::default();
    for s in first..first + seeds {
        let config = reactor::sim::SimConfig {
            seed: s,
            clients,
            steps,
            eio_rate: if s % 2 == 1 { eio } else { 0.0 },
            ..Default::default()
        };
        let outcome = reactor::sim::run(&config)
            .map_err(|e| format!("{e} (replay: corefs sim --seeds 1 --seed {s})"))?;
        total.add(&outcome);
    }
    println!(
        "sim: {seeds} seeds, 0 violations: {} batches, {} fsyncs acknowledged, {} failed under \
         {} injected device errors ({} runs failed stop), {} reads verified, {} reads \
         failed (detected), {} rewrites acknowledged, {} listings verified, {} requests parked for \
         metadata, {} tree nodes read ahead, {} writes parked for staging room, {} block groups \
         taken and {} given back, {} crash states checked, {:.1} s",
        total.batches,
        total.fsyncs_acknowledged,
        total.fsyncs_failed,
        total.faults_armed,
        total.runs_failed_stop,
        total.reads_verified,
        total.reads_failed,
        total.rewrites_acknowledged,
        total.readdirs_verified,
        total.meta_parks,
        total.nodes_read_ahead,
        total.room_parks,
        total.groups_taken,
        total.groups_returned,
        total.crash_states,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
