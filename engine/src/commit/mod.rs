//! The commit state machine: how the running transaction (generation N) becomes durable.
//!
//! ```text
//! Running ──► CommitStart ──► CommitDoing ──► Unblocked ──► SuperCommitted ──► Completed ──► Running (N+1)
//! ```
//!
//! - **Running**: changes join generation N.
//! - **CommitStart**: N stops taking new joiners; changes from now on belong to N+1.
//! - **CommitDoing**: each shard persists its space bitmap into its tree (a fixpoint: writing a
//!   bitmap item can copy a leaf, which allocates, which changes the bitmap), serializes its
//!   dirty nodes bottom-up, and the blocks are written and flushed.
//! - **Unblocked**: N's metadata is on stable media but not yet referenced; N+1 may run.
//! - **SuperCommitted**: the superblock naming N's roots is durable (one FUA write of copy
//!   N % 2). Waiters for N (fsync fallbacks, sync) are released here — not later.
//! - **Completed**: blocks freed in N are unpinned and may be reused by N+1 onwards.
//!   [`Filesystem::commit_to_super`](crate::Filesystem::commit_to_super) returns at SuperCommitted, so a caller with waiters (an
//!   fsync that fell back to a commit, a reactor's syncs) releases them first; the unpinning
//!   runs in [`Filesystem::complete_commit`](crate::Filesystem::complete_commit), which the reactor calls after completing the batch
//!   (via `tick`) and which every later commit calls first. [`Filesystem::commit`](crate::Filesystem::commit) does both.
//!
//! A power cut anywhere leaves generation N−1 (superblock not yet durable) or N (durable):
//! nothing in between, because no block N−1 references is overwritten before N's superblock is
//! durable (pinned frees, [`crate::space`]), and the superblock copy N writes is not the copy
//! holding N−1.
//!
//! Fault model: a device error during a commit makes the filesystem fail-stop (sticky error,
//! read-only); the durable state is the previous generation and a remount recovers it.

use crate::format::{ShardRoot, Superblock};
use std::time::Instant;

mod ops;

/// Inodes of retired change tracking dropped per commit step ([`LogState::drop_retired`]).
/// The frees are of cold memory: 4,096 took 0.6–1.2 ms on this VM (the largest piece of
/// work a create run's loop did between two looks at its queue), so a step takes a quarter
/// of that; a commit has thousands of steps to spread it over.
///
/// [`LogState::drop_retired`]: crate::log::LogState::drop_retired
const RETIRED_DROP_STEP: usize = 1024;

/// What the commit owns of a filesystem: the running transaction, the state machine, the
/// commit in flight and its statistics.
#[derive(Debug)]
pub(crate) struct Committer {
    /// The running transaction's generation.
    pub generation: u64,
    pub state: CommitState,
    pub stats: CommitStats,
    /// True while a commit runs: its allocations may use the whole metadata reserve.
    pub in_commit: bool,
    /// When the running transaction started (for the commit timer).
    pub transaction_started: Instant,
    /// A generation super-committed whose frees are not unpinned yet
    /// ([`Filesystem::complete_commit`](crate::Filesystem::complete_commit)).
    pub unpin_pending: Option<u64>,
    /// The commit whose writes are in flight while the next generation runs
    /// ([`Filesystem::commit_start`](crate::Filesystem::commit_start)).
    pub in_flight: Option<CommitInFlight>,
    /// An fsync that must commit says so ([`crate::log::FsyncStart::NeedsCommit`]) instead of
    /// committing inline: a reactor runs the commit in the background and releases it then.
    pub deferred: bool,
}

impl Committer {
    /// Running transaction `generation`, no commit in flight.
    pub fn new(generation: u64, deferred: bool) -> Committer {
        Committer {
            generation,
            state: CommitState::Running,
            stats: CommitStats::default(),
            in_commit: false,
            transaction_started: Instant::now(),
            unpin_pending: None,
            in_flight: None,
            deferred,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitState {
    Running,
    CommitStart,
    CommitDoing,
    Unblocked,
    SuperCommitted,
    Completed,
}

/// Where the commit in flight stands ([`Filesystem::commit_progress`](crate::Filesystem::commit_progress)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitProgress {
    /// No commit in flight.
    Idle,
    /// Its blocks (or its superblock) are being written.
    Writing,
    /// A partition's half is durable: its coordinator may write the superblock.
    Written,
    /// The superblock of this generation is durable.
    SuperCommitted(u64),
}

/// A commit whose writes are in flight.
#[derive(Debug)]
pub(crate) struct CommitInFlight {
    pub generation: u64,
    pub roots: Vec<(u32, ShardRoot)>,
    pub blocks: u64,
    pub started: Instant,
    /// The pipeline ticket of the trees' last writes and their flush, submitted with the last
    /// slice (None: slices remain, or nothing to write).
    pub writes: Option<u64>,
    /// The superblock and the ticket of its write and flush, once submitted.
    pub superblock: Option<(Superblock, u64)>,
    /// Shards whose frozen trees are still being serialized, a slice per
    /// [`Filesystem::commit_progress`](crate::Filesystem::commit_progress) (their `roots` entries are filled when done).
    pub slicing: Vec<u32>,
    /// Blocks serialized and not yet handed to the device (submitted in chunks of
    /// [`COMMIT_CHUNK_BLOCKS`], the last with the flush).
    pub chunk: Vec<(u64, bytes::Bytes)>,
}

/// Tree nodes one commit slice serializes by default
/// ([`crate::MountOptions::commit_slice_nodes`]): what bounds how long a commit's CPU work
/// holds its caller between two looks at its queues (a few µs a node; docs/commit.md).
pub const COMMIT_SLICE_NODES: usize = 32;

/// Serialized blocks handed to the device together (each chunk is one pipeline entry, of
/// which [`crate::log::inflight::MAX_IN_FLIGHT`] may be outstanding).
pub const COMMIT_CHUNK_BLOCKS: usize = 512;

/// A partition's half of a commit ([`Filesystem::commit_write`](crate::Filesystem::commit_write)): what it wrote, for the
/// coordinator's superblock and for [`Filesystem::commit_finish`](crate::Filesystem::commit_finish).
#[derive(Debug, Clone)]
pub struct CommitWritten {
    pub generation: u64,
    /// The new roots of the shards this partition holds.
    pub roots: Vec<(u32, ShardRoot)>,
    pub blocks: u64,
    pub started: Instant,
}

/// Commit statistics, in the style of btrfs's commit_stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CommitStats {
    pub commits: u64,
    pub commit_ns_total: u64,
    pub commit_ns_max: u64,
    pub last_commit_ns: u64,
    pub blocks_written: u64,
    /// Time from commit start to SuperCommitted (what waiters wait), last commit.
    pub last_super_commit_ns: u64,
    /// Blocks unpinned after SuperCommitted, last commit, and how long that took.
    pub last_unpinned_blocks: u64,
    pub last_unpin_ns: u64,
    pub bitmap_fixpoint_rounds_max: u32,
    /// The longest time a caller was held by [`Filesystem::commit_start`](crate::Filesystem::commit_start) (delayed items,
    /// counters, the space bitmap, freezing the trees): the commit's pause; the trees are
    /// serialized in slices after it and written in the background.
    pub pause_ns_max: u64,
    /// Serialization slices run (each at most [`crate::MountOptions::commit_slice_nodes`]
    /// nodes), and the longest.
    pub slices: u64,
    pub slice_ns_max: u64,
}
