//! Deliberate breakages of the fsync log and the space hand-over, for checking that the crash tests catch them
//! (mutation testing). Compiled only with the `mutations` cargo feature, which the crash
//! tester's tests turn on and nothing shipped does (`libcorefs` and the `corefs` tool's
//! normal build carry none of this: `cargo tree -e features -i corefs-engine` shows the
//! feature only under the crash tester's dev-dependencies and `corefs-cli/mutations`).
//!
//! Each [`Mutation`] removes one guard of the log (docs/fsync-log.md). One is active at a
//! time: the one set for the current thread ([`set_for_thread`], what tests use, so tests
//! running side by side in one binary do not see each other's), else the one named by the
//! environment variable `COREFS_MUTATION` (read once per process: what `corefs crashtest`
//! uses), else none.
//!
//! # Invariants
//! - With no mutation set, every guard behaves exactly as in a build without the feature:
//!   the call sites test [`active`] and nothing else changes.
//! - An unknown `COREFS_MUTATION` name panics at the first check, so a typo never passes for
//!   a mutation the tests failed to catch.

use std::cell::Cell;
use std::sync::OnceLock;

/// One deliberate breakage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Replay accepts a record whose crc32c does not match (`decode_record` skips the check).
    SkipRecordCrc,
    /// Replay goes on past a missing record, or one whose data is not on the device, applying
    /// the stream's later records without it.
    ReplayPastGap,
    /// A record written while commit N is in flight is reported durable when its own writes
    /// are, before N's superblock is (replay ignores it until then).
    AckBeforeCommit,
    /// An inode logged once in a generation is never logged again in it: a later fsync of it
    /// finds "nothing new" whatever changed.
    NoRelog,
    /// A record is reported durable when its flush is submitted, not when it completes (the
    /// waiter-release guard of the pipeline).
    AckAtFlushSubmit,
    /// A commit does not record a block group its shard took in the generation (the
    /// group's bitmap item is never written): the ownership record of a hand-over is lost.
    DropGroupOwnership,
    /// An fsync's walk up the ancestors of what it logs stops at the first directory whose
    /// own name did not change, so a directory renamed above that one is never logged.
    AncestorWalkStopsEarly,
    /// Mount replays the records into the trees but does not commit them: the replayed state
    /// lives in memory only, and the next records overwrite the ones it came from.
    ReplayNotCommitted,
    /// An fsync with nothing new to log while commit N is in flight is released at the newest
    /// ticket of any kind (one of the commit's own chunks), before N's superblock is durable.
    AnyTicketDuringCommit,
}

impl Mutation {
    pub const ALL: [Mutation; 9] = [
        Mutation::SkipRecordCrc,
        Mutation::ReplayPastGap,
        Mutation::AckBeforeCommit,
        Mutation::NoRelog,
        Mutation::AckAtFlushSubmit,
        Mutation::DropGroupOwnership,
        Mutation::AncestorWalkStopsEarly,
        Mutation::ReplayNotCommitted,
        Mutation::AnyTicketDuringCommit,
    ];

    /// The name `COREFS_MUTATION` takes.
    pub fn name(self) -> &'static str {
        match self {
            Mutation::SkipRecordCrc => "skip-record-crc",
            Mutation::ReplayPastGap => "replay-past-gap",
            Mutation::AckBeforeCommit => "ack-before-commit",
            Mutation::NoRelog => "no-relog",
            Mutation::AckAtFlushSubmit => "ack-at-flush-submit",
            Mutation::DropGroupOwnership => "drop-group-ownership",
            Mutation::AncestorWalkStopsEarly => "ancestor-walk-stops-early",
            Mutation::ReplayNotCommitted => "replay-not-committed",
            Mutation::AnyTicketDuringCommit => "any-ticket-during-commit",
        }
    }

    pub fn from_name(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }
}

thread_local! {
    /// Some(choice) once this thread chose (None in it: no mutation, whatever the environment).
    static THREAD: Cell<Option<Option<Mutation>>> = const { Cell::new(None) };
}

/// The mutation named by `COREFS_MUTATION`, read once.
pub fn from_env() -> Option<Mutation> {
    static ENV: OnceLock<Option<Mutation>> = OnceLock::new();
    *ENV.get_or_init(|| {
        let name = std::env::var("COREFS_MUTATION").ok()?;
        let name = name.trim();
        if name.is_empty() || name == "none" {
            return None;
        }
        Some(Mutation::from_name(name).unwrap_or_else(|| {
            panic!(
                "COREFS_MUTATION={name}: not one of {:?}",
                Mutation::ALL.map(Mutation::name)
            )
        }))
    })
}

/// Sets the mutation for the calling thread (None: none, whatever `COREFS_MUTATION` says).
pub fn set_for_thread(mutation: Option<Mutation>) {
    THREAD.set(Some(mutation));
}

/// The mutation in force on this thread.
pub fn current() -> Option<Mutation> {
    THREAD.get().unwrap_or_else(from_env)
}

/// True when `mutation` is in force on this thread.
pub fn active(mutation: Mutation) -> bool {
    current() == Some(mutation)
}
