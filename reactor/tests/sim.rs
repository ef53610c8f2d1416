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
    // Seeds 2 and 3 mod 4 stage one block at most: their writes park for room and resume
    // in whatever order the scheduler reaches them.
    assert!(room_parks > 0, "no write parked for staging room");
    // Odd seeds list a root of 1,500 fillers through a cache of a few nodes: the walk parks
    // and reads ahead.
    assert!(listings > 0, "no listing verified");
    assert!(read_ahead > 0, "no tree node was read ahead");
    assert!(acknowledged > 100, "the runs did little: {acknowledged}");
    eprintln!("{acknowledged} fsyncs acknowledged, {failed_stop} runs failed stop");
}

#[test]
fn a_seed_replays_exactly() {
    let config = SimConfig {
        seed: 4242,
        eio_rate: 0.004,
        ..SimConfig::default()
    };
    assert_eq!(run(&config).unwrap(), run(&config).unwrap());
}
