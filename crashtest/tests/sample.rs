//! A seeded sample of the ACE length-one and length-two workload space (the whole space runs
//! with `corefs crashtest`). Every crash state at every persistence point and flush is mounted
//! and checked. `COREFS_SEED` replays a sample; `COREFS_CRASH_SAMPLE` sets its size.

#[test]
fn ace_sample_every_crash_state_passes() {
    let seed = nvme::wrap::seed_from_env();
    let count: usize = std::env::var("COREFS_CRASH_SAMPLE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    eprintln!("{count} workloads");
    let base = crashtest::base_image();
    let mut states = 0;
    let mut points = 0;
    for (i, workload) in crashtest::workload::sample(count, seed).iter().enumerate() {
        let outcome = crashtest::run(&base, workload, seed ^ i as u64)
            .unwrap_or_else(|why| panic!("seed {seed} workload {i} {workload:?}: {why}"));
        states += outcome.crash_states;
        points += outcome.persistence_points;
    }
    eprintln!("{count} workloads, {points} persistence points, {states} crash states checked");
    assert!(states > count as u64, "too few crash states were checked");
}

#[test]
fn the_exhaustive_spaces_have_the_expected_size() {
    let one = crashtest::workload::exhaustive(1);
    assert!(one.len() > 400, "{} length-one workloads", one.len());
    assert!(one.iter().all(|w| w.len() == 2 && w[1].is_persistence()));
    let core = crashtest::workload::core_ops().len();
    assert!(core > 100, "{core} core operations");
}
