//! A seeded sample of the ACE workloads run through two reactors (partitions, their own log
//! streams, spans, coordinated commits): every crash state at every persistence point and
//! flush is mounted and checked, from each base in turn (clean; recovering, whose first
//! mount replays records before the workload runs). `COREFS_SEED` replays; `COREFS_CRASH_SAMPLE_REACTORS` sets the
//! sample's size (the whole space runs with `corefs crashtest --reactors 2`).

#[test]
fn ace_sample_on_two_reactors_every_crash_state_passes() {
    let seed = nvme::wrap::seed_from_env();
    let count: usize = std::env::var("COREFS_CRASH_SAMPLE_REACTORS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut total = crashtest::Outcome::default();
    for (i, workload) in crashtest::workload::sample(count, seed).iter().enumerate() {
        let kind = crashtest::BaseKind::ALL[i % crashtest::BaseKind::ALL.len()];
        let base = crashtest::Base::get(kind);
        let outcome = crashtest::reactors::run_on_reactors(base, workload, seed ^ i as u64, 2)
            .unwrap_or_else(|why| {
                panic!(
                    "seed {seed} workload {i} {workload:?} ({} base): {why}",
                    kind.name()
                )
            });
        total.add(&outcome);
    }
    eprintln!(
        "{count} workloads on 2 reactors: {} persistence points, {} crash states, {} log \
         writes, {} fallback commits",
        total.persistence_points, total.crash_states, total.log_writes, total.fallback_commits
    );
    assert!(
        total.crash_states > count as u64,
        "too few crash states were checked"
    );
    assert!(
        total.log_writes > 0,
        "no fsync was logged: the reactors never logged"
    );
}
