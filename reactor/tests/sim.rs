//! The deterministic simulation (`reactor::sim`) on a sample of seeds, with and without
//! injected device errors: every crash cut of every run mounts, checks clean and holds every
//! fsync its client saw acknowledged. The same seed gives the same run. `COREFS_SEED=N`
//! replays one seed; `corefs sim --seeds N` runs many.

use reactor::sim::{run, SimConfig};

#[test]
fn seeded_runs_keep_every_acknowledged_fsync() {
    let first = nvme::wrap::seed_from_env();
    eprintln!("seeds {first}..{}", first + 12);
    let mut acknowledged = 0;
    let mut failed_stop = 0;
    let mut room_parks = 0;
    let (mut listings, mut read_ahead) = (0, 0);
    for seed in first..first + 12 {
        let eio_rate = if seed % 2 == 0 { 0.0 } else { 0.004 };
        let outcome = run(&SimConfig {
            seed,
            eio_rate,
            ..SimConfig::default()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(outcome.crash_states >= 2, "{outcome:?}");
        acknowledged += outcome.fsyncs_acknowledged;
        failed_stop += outcome.failed_stop as u32;
        room_parks += outcome.room_parks;
        listings += outcome.readdirs_verified;
        read_ahead += outcome.nodes_read_ahead;
    }
    // Fixed seeds pin what a random range may miss (a seed whose clients never list the
    // root before a device error stops them reads nothing ahead). These two read ahead
    // (checked: a seed replays the same run in any process, `a_seed_replays_exactly`).
    for seed in [77_777, 987_654_321] {
        let outcome = run(&SimConfig {
            seed,
            ..SimConfig::default()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            outcome.nodes_read_ahead > 0,
            "seed {seed}: no tree node was read ahead ({outcome:?})"
        );
        read_ahead += outcome.nodes_read_ahead;
        listings += outcome.readdirs_verified;
    }
    // Seeds 2 and 3 mod 4 stage one block at most: their writes park for room and resume
    // in whatever order the scheduler reaches them.
    assert!(room_parks > 0, "no write parked for staging room");
    // Odd seeds list a root of 1,500 fillers through a cache of 24 nodes: the walk parks
    // and reads ahead.
    assert!(listings > 0, "no listing verified");
    assert!(read_ahead > 0, "no tree node was read ahead");
    assert!(acknowledged > 100, "the runs did little: {acknowledged}");
    eprintln!("{acknowledged} fsyncs acknowledged, {failed_stop} runs failed stop");
}

/// The same seed gives the same run, with device errors and with a tree of many leaves
/// behind a small cache (odd seeds: the misses and what is read ahead depend on where the
/// names land, which mkfs's name-hash key decides).
#[test]
fn a_seed_replays_exactly() {
    for seed in [4242, 4243, 4245] {
        let config = SimConfig {
            seed,
            eio_rate: 0.004,
            ..SimConfig::default()
        };
        assert_eq!(run(&config).unwrap(), run(&config).unwrap(), "seed {seed}");
    }
}
