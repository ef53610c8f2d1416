//! What mkfs and mount take: [`MkfsOptions`] (the geometry written once) and
//! [`MountOptions`] (caches, commit pacing, write-back, access times: a mount's choices,
//! none of them on disk), with the defaults a fresh filesystem and a mount get.

use crate::format::DEFAULT_SHARDS;

#[derive(Debug, Clone)]
pub struct MkfsOptions {
    pub shards: u32,
    pub label: String,
    /// Blocks per block group (a power of two from 8 to 4096); None picks by size
    /// ([`crate::space::Geometry::auto_group_blocks`]: 1 MiB on a 1 GiB device, 16 MiB from 8 GiB with 64
    /// shards). Small groups make tests move groups between shards all the time.
    pub group_blocks: Option<u64>,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        MkfsOptions {
            shards: DEFAULT_SHARDS,
            label: String::new(),
            group_blocks: None,
        }
    }
}

/// The largest fsync log area mkfs gives a shard (blocks: 32 MiB), both halves.
pub const LOG_BLOCKS_MAX: u64 = 8192;

#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Tree nodes kept in memory over all the shards this mount (or partition) holds: the
    /// metadata cache bound, about 4.5 KiB of memory per node. Past it, clean nodes are
    /// evicted from the shard holding the most, down to 7/8 of the bound (dirty nodes stay
    /// until their commit, bounded by `dirty_limit_nodes`). A partition holding k of n
    /// shards gets k/n of it. A bound per shard would leave most of the budget to idle
    /// shards while the busy ones re-read their nodes: creates from 4 clients into 4
    /// directories ran at 82k/s with 4096 nodes per shard (the bound before) and 146k/s
    /// with this default.
    pub cache_nodes: usize,
    /// [`crate::Filesystem::tick`] commits once the running transaction is this old...
    pub commit_interval: std::time::Duration,
    /// ...or holds this many dirty tree nodes, so recovery work and memory stay bounded,
    /// and so does the commit's pause: a commit runs on the reactor between batches, at about
    /// 14 µs per dirty node here (4096 nodes: ~60 ms; 16384 made 20 s of creates pause for
    /// up to 240 ms and run at 60% of the rate).
    pub dirty_limit_nodes: usize,
    /// Staged (written, not yet on the device) file data past which the oldest inodes' data
    /// goes to the device in the background ([`crate::writeback`]). Data that dies young
    /// (a temporary file) is never written when it stays under this; 8 MiB leaves 4 MiB
    /// below [`MountOptions::staged_park_bytes`], where writers start to park (the threshold
    /// is kept below that bound whatever is asked here).
    pub writeback_start_bytes: usize,
    /// Staged data bytes from which a reactor parks the writes that would stage more until
    /// write-back makes room ([`crate::writeback::STAGED_PARK_BYTES`] by default); the hard
    /// bound, where a write writes everything staged back before it returns, lies
    /// [`crate::writeback::STAGED_HEADROOM_BYTES`] above. The simulation sets it to a few
    /// blocks, so writes park all the time.
    pub staged_park_bytes: usize,
    /// Data blocks kept in memory after a read or write ([`crate::writeback`]'s block cache);
    /// 0 turns the cache off, so reads measure the device path (a kernel filesystem read
    /// with O_DIRECT keeps no data either).
    pub data_cache_blocks: usize,
    /// Tree nodes a commit serializes per slice after its pause
    /// ([`crate::commit::COMMIT_SLICE_NODES`] by default). The crash tester and the
    /// simulation use 1, so the running transaction changes the tree between every two
    /// nodes of the commit being written.
    pub commit_slice_nodes: usize,
    /// When reads move access times ([`crate::inode::Atime`]; relatime by default).
    pub atime: crate::inode::Atime,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            cache_nodes: 1 << 16,
            commit_interval: std::time::Duration::from_secs(5),
            dirty_limit_nodes: 4096,
            writeback_start_bytes: 8 << 20,
            staged_park_bytes: crate::writeback::STAGED_PARK_BYTES,
            data_cache_blocks: crate::writeback::CACHE_BLOCKS,
            commit_slice_nodes: crate::commit::COMMIT_SLICE_NODES,
            atime: crate::inode::Atime::Relative,
        }
    }
}
