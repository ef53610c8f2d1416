//! corefs engine: the on-disk format, copy-on-write metadata trees, space allocation,
//! transactions and the commit state machine. It runs on any [`nvme::BlockDevice`]; one thread
//! may drive every shard (tests, tools), or reactors spread shards over cores.
//!
//! Where things are:
//! - [`format`]: every on-disk structure and its codec (superblock, nodes, keys);
//! - [`tree`]: the copy-on-write B+tree of one shard;
//! - [`space`]: the per-shard block allocator with generation-pinned frees;
//! - [`fs`]: mkfs, mount, the shards; [`commit`]: the commit state machine
//!   (Running → CommitStart → CommitDoing → Unblocked → SuperCommitted → Completed);
//! - [`inode`], [`dir`], [`file`], [`xattr`]: the POSIX operations;
//! - [`check`]: the checker behind `corefs fsck` and every test.

pub mod atomic;
mod blocks;
mod bucket;

/// True when the named [`mutation::Mutation`] is in force; always false (and nothing of the
/// mutations compiled) without the `mutations` feature.
macro_rules! mutated {
    ($name:ident) => {{
        #[cfg(feature = "mutations")]
        let on = $crate::mutation::active($crate::mutation::Mutation::$name);
        #[cfg(not(feature = "mutations"))]
        let on = false;
        on
    }};
}

pub mod check;
pub mod commit;
pub mod decoded;
pub mod delayed;
pub mod dir;
pub mod error;
pub mod fetch;
pub mod file;
pub mod format;
pub mod fs;
#[cfg(feature = "sim")]
#[doc(hidden)]
pub mod fuzz_harness;
pub mod inode;
pub mod inspect;
pub mod log;
/// Deliberate breakages for the crash tests' mutation checks (feature `mutations` only).
#[cfg(feature = "mutations")]
#[doc(hidden)]
pub mod mutation;
mod mux;
pub mod partition;
pub mod reads;
pub mod refs;
pub mod space;
pub mod tree;
pub mod writeback;
pub mod xattr;

pub use atomic::AtomicBatch;
/// Shared bytes: what a write hands the engine to stage without a copy
/// ([`Filesystem::write_shared`]).
pub use bytes::Bytes;
pub use check::CheckReport;
pub use commit::{CommitState, CommitStats};
pub use delayed::DelayedStats;
pub use dir::{DirEntry, RenameFlags};
pub use error::{EngineError, Result};
pub use fetch::{Deferred, FetchStats};
pub use file::{FallocateMode, Staged};
pub use fs::{Filesystem, MkfsOptions, MountOptions};
pub use inode::{Atime, SetAttr, Stat};
pub use log::LogStats;
pub use mux::DeviceWaitStats;
pub use reads::{ReadResult, ReadStart, ReadStats, ReadsStarted};
pub use xattr::XattrFlags;
