//! Mutation checks: each guard of the fsync log (and the space hand-over) removed on purpose (`engine::mutation`, the
//! `mutations` feature, which the dev-dependency turns on for these tests only) makes the crash
//! tester report a violation within a bounded run — the length-one exhaustive run for the
//! record crc, the gap, the commit in flight, the flush's completion, the group hand-over and
//! the ancestor walk; the same from the recovering image (a second crash after a recovery)
//! for the replay's commit; a length-two subset of fsync, change, fsync of one file for the
//! inode logged once — and
//! the workload that exposed it passes with the guard in place. A guard whose removal no test
//! notices is a guard nothing checks. `COREFS_SEED` replays (the seed picks the torn and
//! damaged sectors).

use crashtest::workload::{self, Step};
use crashtest::{Base, BaseKind, Schedule};
use engine::mutation::{self, Mutation};

/// Runs `workloads` from the clean base under `schedules` with `mutation` on (this thread
/// only) until the first violation; asserts there is one, and that the same workload and seed
/// pass with the guard in place. Returns the violation.
fn assert_caught(mutation: Mutation, workloads: &[Vec<Step>], schedules: &[Schedule]) -> String {
    assert_caught_from(BaseKind::Clean, mutation, workloads, schedules)
}

/// [`assert_caught`] from the base of `kind`.
fn assert_caught_from(
    kind: BaseKind,
    mutation: Mutation,
    workloads: &[Vec<Step>],
    schedules: &[Schedule],
) -> String {
    let seed = nvme::wrap::seed_from_env();
    // The base image is built with every guard in place (its aging logs and commits).
    mutation::set_for_thread(None);
    let base = Base::get(kind);
    mutation::set_for_thread(Some(mutation));
    let found = workloads.iter().enumerate().find_map(|(i, w)| {
        crashtest::run_schedules(base, w, seed ^ i as u64, schedules)
            .err()
            .map(|why| (i, why))
    });
    mutation::set_for_thread(None);
    let Some((i, why)) = found else {
        panic!(
            "seed {seed}: with {} on, {} workloads reported no violation",
            mutation.name(),
            workloads.len()
        );
    };
    eprintln!(
        "{}: workload {i} {:?}: {why}",
        mutation.name(),
        workloads[i]
    );
    if let Err(other) = crashtest::run_schedules(base, &workloads[i], seed ^ i as u64, schedules) {
        panic!(
            "seed {seed}: workload {i} {:?} fails with every guard in place too: {other}",
            workloads[i]
        );
    }
    why
}

#[test]
fn replay_accepting_a_record_whose_crc_fails_is_caught() {
    assert_caught(
        Mutation::SkipRecordCrc,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
}

#[test]
fn replay_going_on_past_a_missing_record_is_caught() {
    assert_caught(
        Mutation::ReplayPastGap,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
}

#[test]
fn acknowledging_a_record_before_the_commit_in_flight_is_durable_is_caught() {
    let why = assert_caught(
        Mutation::AckBeforeCommit,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
    assert!(why.contains(Schedule::CommitInFlight.name()), "{why}");
}

#[test]
fn releasing_an_fsync_at_a_commit_chunk_before_its_superblock_is_caught() {
    let why = assert_caught(
        Mutation::AnyTicketDuringCommit,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
    assert!(why.contains(Schedule::CommitCatches.name()), "{why}");
}

#[test]
fn never_logging_an_inode_again_in_its_generation_is_caught() {
    // Length two: a file changed and fsynced, then changed again and fsynced (the second
    // fsync must log it again). (The prelude's fsync of foo makes length one catch it too.)
    let again: Vec<Vec<Step>> = workload::exhaustive(2)
        .into_iter()
        .filter(|w| {
            let path = |op: &Step| match op {
                Step::Fsync(p) | Step::Fdatasync(p) => Some(*p),
                _ => None,
            };
            path(&w[1]).is_some() && path(&w[1]) == path(&w[3]) && path(&w[1]) != Some("")
        })
        .step_by(7)
        .take(300)
        .collect();
    assert!(again.len() >= 100, "{} workloads", again.len());
    // Not the fallback schedule: filling its logs fsyncs one file over and over, which this
    // mutation breaks before the workload runs; the oracle is what must catch it.
    let schedules: Vec<Schedule> = Schedule::ALL
        .into_iter()
        .filter(|s| *s != Schedule::Fallback)
        .collect();
    let why = assert_caught(Mutation::NoRelog, &again, &schedules);
    assert!(!why.contains("filling"), "{why}");
}

#[test]
fn acknowledging_a_record_when_its_flush_is_submitted_is_caught() {
    assert_caught(
        Mutation::AckAtFlushSubmit,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
}

/// A group a shard took in the running transaction must be recorded by the commit: with the
/// record dropped, a crash state after that commit has blocks in use in a group nobody owns,
/// and its mount (or the checker) says so.
#[test]
fn dropping_the_ownership_record_of_a_group_hand_over_is_caught() {
    let why = assert_caught(
        Mutation::DropGroupOwnership,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
    assert!(
        why.contains("group") || why.contains("bitmap") || why.contains("space"),
        "{why}"
    );
}

/// An fsync must log a directory renamed in this generation however far above the fsynced
/// file it is, past directories whose own names are durable: `rename A B/D; fsync
/// B/D/C/baz` with the walk stopped at `C` leaves `B/D/C/baz` missing after a crash.
#[test]
fn an_ancestor_walk_stopping_below_a_renamed_directory_is_caught() {
    let why = assert_caught(
        Mutation::AncestorWalkStopsEarly,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
    assert!(why.contains("B/D/C") || why.contains("B/C/"), "{why}");
}

/// A recovery mount must make the replayed state durable before new records overwrite the
/// ones it came from: from the recovering base (whose first mount replays), the second
/// crash loses what the first mount recovered.
#[test]
fn a_replay_left_uncommitted_is_caught_at_the_second_crash() {
    assert_caught_from(
        BaseKind::Recovering,
        Mutation::ReplayNotCommitted,
        &workload::exhaustive(1),
        &Schedule::ALL,
    );
}

#[test]
fn mutation_names_round_trip() {
    for m in Mutation::ALL {
        assert_eq!(Mutation::from_name(m.name()), Some(m));
    }
    assert_eq!(Mutation::from_name("none"), None);
}
