//! `corefs crashtest`: ACE workloads run by `corefs-crashtest`, on as many threads as asked,
//! whole or in parts whose counts add up. Each workload's seed follows its index in the whole
//! list, so a part, or a failure, replays as the whole run would.

use super::clock_seed;
use crashtest::workload::Step;
use crashtest::{Base, BaseKind, Outcome, Schedule};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Crash-consistency test: ACE workloads of one or two operations, every crash state at
/// every persistence point and flush mounted and checked against an oracle.
#[derive(clap::Args)]
pub struct Args {
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
    /// pipelined, commit-in-flight, commit-catches, fallback, writeback, reactors (two
    /// reactors), callers
    /// (writes and fsyncs run as a client runs them, records written beside the queue).
    #[arg(long, value_delimiter = ',')]
    schedules: Option<Vec<String>>,
    /// Run only part K of N (`K/N`, 1-based): the workloads split into N contiguous
    /// parts, each keeping its index in the whole list (and so its per-workload seed), so
    /// a long run can be done in pieces whose counts and times add up.
    #[arg(long, value_parser = parse_part)]
    part: Option<(usize, usize)>,
    /// The images each workload starts from (default: both): clean (the setup, synced), and
    /// recovering (the setup with fsync records its first mount replays: every run is a
    /// crash, a recovery, more operations and a second crash).
    #[arg(long, value_delimiter = ',')]
    bases: Option<Vec<String>>,
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        length,
        sample,
        seed,
        threads,
        reactors,
        schedules,
        part,
        bases,
    } = args;
    let bases: Vec<BaseKind> = match bases {
        None => BaseKind::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| BaseKind::from_name(n).ok_or(n))
            .collect::<Result<_, _>>()
            .map_err(|n| format!("--bases: no base {n} (clean, recovering)"))?,
    };
    let seed = seed.unwrap_or_else(clock_seed);
    let schedules: Vec<Schedule> = match schedules {
        None => Schedule::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| Schedule::from_name(n).ok_or(n))
            .collect::<Result<_, _>>()
            .map_err(|n| format!("--schedules: no schedule {n}"))?,
    };
    announce_mutation()?;
    let workloads = match (length, sample) {
        (Some(length), _) if (1..=2).contains(&length) => crashtest::workload::exhaustive(length),
        (Some(length), _) => return Err(format!("--length {length}: use 1 or 2")),
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
        "crashtest: {} workloads (from index {first} of {all}) from the {} base(s) on {threads} threads, seed {seed}, schedules {}",
        workloads.len(),
        bases.iter().map(|b| b.name()).collect::<Vec<_>>().join(" and "),
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
    let mut count = 0;
    let mut outcome = Outcome::default();
    for &base in &bases {
        let (n, o) = run_workloads(&workloads, first, seed, threads, reactors, &schedules, base)?;
        count += n;
        outcome.add(&o);
    }
    let states = outcome.crash_states;
    println!(
        "crashtest: {count} workload runs, {} runs, {states} crash states checked ({} with writes in flight), 0 violations, {:.1} s (seed {seed})",
        outcome.runs,
        outcome.in_flight_states,
        start.elapsed().as_secs_f64()
    );
    println!(
        "crashtest: {} persistence points: {} fsync log records ({} pipelined behind another, {} during a commit), {} fsyncs run by a caller beside the queue, {} fsyncs with nothing new to log, {} fell back to a commit, {} KiB written back in the background",
        outcome.persistence_points,
        outcome.log_writes,
        outcome.pipelined_records,
        outcome.records_during_commit,
        outcome.lent_fsyncs,
        outcome.already_logged,
        outcome.fallback_commits,
        outcome.writeback_bytes >> 10
    );
    println!(
        "crashtest: block groups of {} blocks: {} taken from the pool, {} given back (engine schedules)",
        crashtest::GROUP_BLOCKS,
        outcome.groups_taken,
        outcome.groups_returned
    );
    Ok(())
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

/// Runs crash-consistency workloads from the `kind` image on `threads` threads, stopping at
/// the first failure; returns the workload count and the summed outcome.
fn run_workloads(
    workloads: &[Vec<Step>],
    first: usize,
    seed: u64,
    threads: usize,
    reactors: Option<usize>,
    schedules: &[Schedule],
    kind: BaseKind,
) -> Result<(u64, Outcome), String> {
    let base = Base::get(kind);
    let total = workloads.len();
    let next = AtomicUsize::new(0);
    let sum = Mutex::new(Outcome::default());
    let failure: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || failure.lock().expect("lock").is_some() {
                    return;
                }
                // The seed follows the index in the whole list, so a part replays as the
                // whole run would.
                let index = first + i;
                let outcome = match reactors {
                    None => crashtest::run_schedules(
                        base,
                        &workloads[i],
                        seed ^ index as u64,
                        schedules,
                    ),
                    Some(n) => crashtest::reactors::run_on_reactors(
                        base,
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
                        *failure.lock().expect("lock") = Some(format!(
                            "workload {index} {:?} from the {} base: {why}",
                            workloads[i],
                            kind.name()
                        ));
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
