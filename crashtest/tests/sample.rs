//! A seeded sample of the ACE length-one and length-two workload space (the whole space runs
//! with `corefs crashtest`), each workload under one schedule in turn (plain, pipelined, a
//! commit in flight, full logs, write-back, two reactors), from each base in turn (clean;
//! recovering: a crash, a recovery mount, the workload, a second crash). Every crash state
//! at every persistence point, flush and FUA write is mounted and checked. `COREFS_SEED`
//! replays a sample; `COREFS_CRASH_SAMPLE` sets its size.

use crashtest::{Base, BaseKind, Schedule};

#[test]
fn ace_sample_every_crash_state_passes() {
    let seed = nvme::wrap::seed_from_env();
    let count: usize = std::env::var("COREFS_CRASH_SAMPLE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    eprintln!("{count} workloads");
    let mut total = crashtest::Outcome::default();
    for (i, workload) in crashtest::workload::sample(count, seed).iter().enumerate() {
        let schedule = Schedule::ALL[i % Schedule::ALL.len()];
        let kind = BaseKind::ALL[(i / Schedule::ALL.len()) % BaseKind::ALL.len()];
        let outcome = crashtest::run_schedule(Base::get(kind), workload, seed ^ i as u64, schedule)
            .unwrap_or_else(|why| {
                panic!(
                    "seed {seed} workload {i} {workload:?} [{}, {} base]: {why}",
                    schedule.name(),
                    kind.name()
                )
            });
        total.add(&outcome);
    }
    eprintln!(
        "{count} workloads: {} persistence points, {} crash states checked ({} with writes in \
         flight), {} records pipelined, {} during a commit, {} fallback commits",
        total.persistence_points,
        total.crash_states,
        total.in_flight_states,
        total.pipelined_records,
        total.records_during_commit,
        total.fallback_commits
    );
    assert!(
        total.crash_states > count as u64,
        "too few crash states were checked"
    );
    assert!(
        total.in_flight_states > 0
            && total.pipelined_records > 0
            && total.records_during_commit > 0
            && total.fallback_commits > 0,
        "a schedule never did what it is for"
    );
}

#[test]
fn the_exhaustive_spaces_have_the_expected_size() {
    let one = crashtest::workload::exhaustive(1);
    assert_eq!(one.len(), 676, "length-one workloads");
    assert!(one.iter().all(|w| w.len() == 2 && w[1].is_persistence()));
    let core = crashtest::workload::core_ops().len();
    assert_eq!(core, 157, "core operations");
    let two = crashtest::workload::exhaustive(2);
    assert_eq!(two.len(), 456_954, "length-two workloads");
    assert!(two.iter().all(|w| w.len() == 4 && w[3].is_persistence()));
}

/// The workload generator's model of names agrees with the engine: after every core operation
/// and every pair of them, exactly the paths it says exist do; so every fsync a workload
/// holds names an existing path (one that did not would check nothing). Every pair of
/// operations that change names, not a sample of them: a 600-pair sample of all pairs missed
/// the one (mkdir B/D, rename A -> B/D) the model got wrong. Pairs with a data operation
/// (which changes no name) are sampled.
#[test]
fn every_fsync_of_a_workload_names_an_existing_path() {
    use crashtest::workload::{core_ops, Namespace, Step};
    use rand::{Rng, SeedableRng};
    let seed = nvme::wrap::seed_from_env();
    let base = crashtest::base_image();
    let core = core_ops();
    let names_op = |op: &Step| {
        matches!(
            op,
            Step::Creat(_)
                | Step::Mkdir(_)
                | Step::Link(..)
                | Step::Unlink(_)
                | Step::Remove(_)
                | Step::Rename(..)
                | Step::Symlink(_)
        )
    };
    let mut sequences: Vec<Vec<Step>> = core.iter().map(|op| vec![op.clone()]).collect();
    for a in core.iter().filter(|op| names_op(op)) {
        for b in core.iter().filter(|op| names_op(op)) {
            sequences.push(vec![a.clone(), b.clone()]);
        }
    }
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    for _ in 0..300 {
        let a = core[rng.random_range(0..core.len())].clone();
        let b = core[rng.random_range(0..core.len())].clone();
        sequences.push(vec![a, b]);
    }
    for ops in sequences {
        let names = Namespace::after(&ops);
        let live = crashtest::live_paths_after(base, &ops)
            .unwrap_or_else(|e| panic!("seed {seed}: {ops:?}: {e}"));
        assert_eq!(
            names.paths(),
            live,
            "seed {seed}: after {ops:?} the model's paths (left) are not the engine's"
        );
    }
    // The recovering base's changes leave the setup's names (the model starts from them).
    assert_eq!(
        Namespace::setup().paths(),
        crashtest::live_paths_after(Base::get(BaseKind::Recovering), &[]).unwrap(),
        "the recovering base's names"
    );
    for w in crashtest::workload::exhaustive(1)
        .iter()
        .chain(&crashtest::workload::sample(2000, seed))
    {
        let mut names = Namespace::setup();
        for op in w {
            match op {
                Step::Fsync(p) | Step::Fdatasync(p) => {
                    assert!(names.exists(p), "seed {seed}: {w:?}: {p} does not exist")
                }
                op => names.apply(op),
            }
        }
    }
}
