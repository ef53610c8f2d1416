//! Making a filesystem and mounting one: mkfs writes the superblocks, then the root
//! directory in a first commit; mount reads and checks the newest valid superblock, the
//! shards' roots and the space, replays the fsync log, and never writes.
//!
//! Fault model: every block mount reads is verified before it is used; a corrupt or
//! foreign image is an error naming what failed, never a panic, and nothing is written.

use crate::blocks::{block_lba, read_block};
use crate::commit::Committer;
use crate::error::{EngineError, Result};
use crate::format::items::{InodeItem, Timespec};
use crate::format::{
    ItemKind, Key, ShardRoot, Superblock, BLOCK_BYTES, FIRST_REGION_BLOCK, FORMAT_VERSION,
    MAX_SHARDS, SUPERBLOCK_ADDRS,
};
use crate::inode::{ROOT_INO, S_IFDIR};
use crate::space::{Geometry, Pool, Space};
use crate::tree::Tree;
use nvme::BlockDevice;

use super::{
    Filesystem, MkfsOptions, Mode, MountOptions, OpState, Shard, ShardIo, LOG_BLOCKS_MAX,
    SPACE_OBJECTID,
};

/// 16 bytes from the operating system's random source, without a dependency: each
/// `RandomState` is keyed from it (std's own defence against hash flooding), and a SipHash
/// output under an unknown key is unpredictable. Used for the uuid and the name hash key.
fn random_bytes() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, half) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

impl Filesystem {
    /// Creates an empty filesystem on `dev`, destroying what was there: superblocks, then the
    /// root directory in a first commit. Returns the device.
    pub fn mkfs(dev: Box<dyn BlockDevice>, options: &MkfsOptions) -> Result<Box<dyn BlockDevice>> {
        Self::mkfs_keyed(dev, options, 32, random_bytes(), random_bytes())
    }

    /// [`Filesystem::mkfs`] with a name hash of `bits` bits (1..=32): with few bits, names
    /// share hashes all the time, so tests reach the chains of directory and xattr items
    /// that otherwise only names colliding by chance (or by attack) need.
    #[doc(hidden)]
    #[cfg(feature = "sim")]
    pub fn mkfs_with_name_hash_bits(
        dev: Box<dyn BlockDevice>,
        options: &MkfsOptions,
        bits: u8,
    ) -> Result<Box<dyn BlockDevice>> {
        Self::mkfs_keyed(dev, options, bits, random_bytes(), random_bytes())
    }

    /// [`Filesystem::mkfs`] with the uuid and the name-hash key derived from `seed` instead
    /// of drawn at random, for simulations and seeded tests: the name-hash key orders every
    /// directory's items, so with a random one the same seed lays out different trees in
    /// every process (a simulation's cache misses, and what it reads ahead, then differ), and
    /// a failure printed with its seed would not replay. Not for a filesystem that keeps
    /// data: a key anyone can derive lets names be chosen to collide.
    #[doc(hidden)]
    #[cfg(feature = "sim")]
    pub fn mkfs_seeded(
        dev: Box<dyn BlockDevice>,
        options: &MkfsOptions,
        seed: u64,
    ) -> Result<Box<dyn BlockDevice>> {
        // splitmix64: four well-mixed words from one seed.
        let mut state = seed;
        let mut word = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)).to_le_bytes()
        };
        let mut uuid = [0u8; 16];
        let mut hash_key = [0u8; 16];
        for half in uuid.chunks_mut(8).chain(hash_key.chunks_mut(8)) {
            half.copy_from_slice(&word());
        }
        Self::mkfs_keyed(dev, options, 32, uuid, hash_key)
    }

    /// [`Filesystem::mkfs_with_name_hash_bits`] with a given uuid and name-hash key instead
    /// of random ones: the same operations then lay out the same image byte for byte (up to
    /// timestamps), which is what lets a fuzz harness replay a failure from its seed.
    pub(crate) fn mkfs_keyed(
        mut dev: Box<dyn BlockDevice>,
        options: &MkfsOptions,
        bits: u8,
        uuid: [u8; 16],
        hash_key: [u8; 16],
    ) -> Result<Box<dyn BlockDevice>> {
        if !(1..=32).contains(&bits) {
            return Err(EngineError::Invalid(format!(
                "a name hash of {bits} bits (1..=32)"
            )));
        }
        let info = dev.info().clone();
        if BLOCK_BYTES as u32 % info.lba_size_bytes != 0 {
            return Err(EngineError::Invalid(format!(
                "LBA size {} does not divide the 4 KiB block",
                info.lba_size_bytes
            )));
        }
        if options.shards == 0 || options.shards > MAX_SHARDS {
            return Err(EngineError::Invalid(format!(
                "shard count {} is not 1..={MAX_SHARDS}",
                options.shards
            )));
        }
        if options.label.len() > 32 {
            return Err(EngineError::Invalid("label longer than 32 bytes".into()));
        }
        let total_blocks = info.capacity_bytes() / BLOCK_BYTES as u64;
        let region_blocks = total_blocks.saturating_sub(FIRST_REGION_BLOCK) / options.shards as u64;
        if region_blocks < 64 {
            return Err(EngineError::Invalid(format!(
                "{} MiB is too small for {} shards (each needs 64 blocks)",
                info.capacity_bytes() >> 20,
                options.shards
            )));
        }
        // 1/16 of the region, 8 blocks to 32 MiB; a log 7/8 full makes a commit due, and
        // the fsync that arrives during a commit waits for it. A cap of 4 MiB committed
        // every ~800 of RocksDB's synchronous puts on a 1 GiB image (55 commits in 5 s,
        // each holding one put ~1 ms: p99.9 1.3–1.5 ms); 32 MiB, 7 commits (p99.9 1.0 ms).
        let log_blocks = (region_blocks / 16).clamp(8, LOG_BLOCKS_MAX);
        let data_blocks = (region_blocks - log_blocks) * options.shards as u64;
        let group_blocks = match options.group_blocks {
            None => Geometry::auto_group_blocks(data_blocks, options.shards),
            Some(g)
                if g.is_power_of_two()
                    && (crate::space::GROUP_BLOCKS_MIN..=crate::space::GROUP_BLOCKS_MAX)
                        .contains(&g) =>
            {
                g
            }
            Some(g) => {
                return Err(EngineError::Invalid(format!(
                    "block groups of {g} blocks (a power of two from {} to {})",
                    crate::space::GROUP_BLOCKS_MIN,
                    crate::space::GROUP_BLOCKS_MAX
                )))
            }
        };
        let sb = Superblock {
            generation: 1,
            total_blocks,
            lba_size_bytes: info.lba_size_bytes,
            region_blocks,
            uuid,
            label: options.label.clone(),
            log_blocks,
            group_blocks,
            hash_key,
            name_hash_bits: bits,
            shards: vec![ShardRoot::default(); options.shards as usize],
        };
        let bytes = sb.encode();
        for addr in SUPERBLOCK_ADDRS {
            let lba = block_lba(&*dev, addr);
            nvme::write_sync(&mut *dev, lba, &bytes, false)?;
        }
        nvme::flush_sync(&mut *dev)?;
        let mut fs = Filesystem::mount(dev, MountOptions::default())?;
        let now = Timespec::now();
        let root = InodeItem {
            mode: S_IFDIR | 0o755,
            nlink: 2,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            generation: fs.commit.generation,
            next_index: crate::dir::FIRST_INDEX,
            ..Default::default()
        };
        fs.store_inode(ROOT_INO, &root)?;
        fs.count_inodes(fs.shard_of(ROOT_INO), 1);
        fs.unmount()
    }

    /// Mounts the newest valid superblock's generation and replays the fsync logs written
    /// after it (committing the result; mount writes nothing when the logs hold no record).
    pub fn mount(mut dev: Box<dyn BlockDevice>, options: MountOptions) -> Result<Filesystem> {
        let device_blocks = dev.info().capacity_bytes() / BLOCK_BYTES as u64;
        let _span = tracing::debug_span!("mount", device_blocks).entered();
        if device_blocks < FIRST_REGION_BLOCK || BLOCK_BYTES as u32 % dev.info().lba_size_bytes != 0
        {
            return Err(EngineError::Invalid(
                "device too small or LBA size larger than 4 KiB".into(),
            ));
        }
        let mut best: Option<Superblock> = None;
        // The format version of the superblock taken.
        let mut best_version = 0;
        let mut problems = Vec::new();
        for addr in SUPERBLOCK_ADDRS {
            match read_block(&mut *dev, addr).map(|b| {
                (
                    Superblock::decode(&b, device_blocks),
                    Superblock::version_of(&b),
                )
            }) {
                Ok((Ok(sb), version)) => {
                    if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                        best = Some(sb);
                        best_version = version;
                    }
                }
                Ok((Err(why), _)) => problems.push(format!("copy {addr}: {why}")),
                Err(e) => problems.push(format!("copy {addr}: {e}")),
            }
        }
        let sb = best.ok_or_else(|| EngineError::corrupt("superblock", 0, problems.join("; ")))?;
        let shard_count = sb.shards.len();
        if !problems.is_empty() {
            tracing::warn!(
                "mounting generation {} from the intact superblock copy; {}",
                sb.generation,
                problems.join("; ")
            );
        }
        // Versions before 5 keep one bitmap item per 4096-block chunk of the shard's own
        // region: they get the block groups mkfs would give them now (a size that divides
        // the chunks), each owned by the shard whose chunk marks a block of it, and the
        // upgrade below rewrites the items.
        let legacy = best_version < 5;
        let mut sb = sb;
        if legacy {
            sb.group_blocks =
                Geometry::auto_group_blocks(sb.data_area_blocks(), sb.shards.len() as u32);
        }
        let pool = std::sync::Arc::new(Pool::new(Geometry::of(&sb)));
        let mut shards = Vec::with_capacity(sb.shards.len());
        for (id, root) in sb.shards.iter().enumerate() {
            let mut tree = Tree::open(id as u32, root.tree, root.level);
            let mut space = Space::new(id as u32, pool.clone());
            let kind = if legacy {
                ItemKind::SpaceBitmap
            } else {
                ItemKind::GroupBitmap
            };
            // The bitmap items are read before the space knows its groups: the root and the
            // nodes above them are checked against the superblock's pointers (address,
            // generation, crc), and the groups against each other once all are read.
            // The bitmap items say which groups the shard owns, so the nodes on the way to them
            // are checked against the data area only (and against the superblock's pointers:
            // address, generation, crc); the tree is opened again afterwards, so every node read
            // later is checked against the groups.
            space.set_loading(true);
            let items = {
                let mut io = ShardIo {
                    dev: &mut *dev,
                    space: &mut space,
                    generation: sb.generation + 1,
                    for_commit: false,
                    commit_floor: 0,
                    fetch: None,
                    unsubmitted: &[],
                };
                tree.range(
                    &mut io,
                    Key::new(SPACE_OBJECTID, kind, 0),
                    Key::new(SPACE_OBJECTID, kind, u64::MAX),
                )?
            };
            space.set_loading(false);
            let loaded_items = items.len() as u64;
            for (key, bytes) in items {
                let loaded = if legacy {
                    space.load_legacy_chunk(key.offset, &bytes)
                } else {
                    space.load_group(key.offset, &bytes)
                };
                loaded.map_err(|why| {
                    EngineError::corrupt(
                        "space bitmap",
                        root.tree.addr,
                        format!("shard {id}: {why}"),
                    )
                })?;
            }
            if space.allocated_blocks() != root.used_blocks
                || (!legacy && loaded_items != root.groups)
            {
                return Err(EngineError::corrupt(
                    "space bitmap",
                    root.tree.addr,
                    format!(
                        "shard {id} bitmap counts {} blocks in {loaded_items} groups, \
                         superblock says {} in {}",
                        space.allocated_blocks(),
                        root.used_blocks,
                        root.groups
                    ),
                ));
            }
            let mut tree = Tree::open(id as u32, root.tree, root.level);
            tree.record_changes();
            shards.push(Some(Shard {
                tree,
                space,
                inodes: root.inodes,
            }));
        }
        let data_cache_blocks = options.data_cache_blocks;
        let mut fs = Filesystem {
            commit: Committer::new(sb.generation + 1, false),
            dev: Box::new(crate::mux::DeviceMux::new(dev)),
            sb,
            pool,
            shards,
            mode: Mode::Whole,
            failed: None,
            options,
            namespace: crate::inode::Namespace::new(shard_count, 0),
            log: crate::log::LogState::new(shard_count),
            staged: Default::default(),
            block_cache: crate::writeback::BlockCache::new(data_cache_blocks),
            op: OpState::default(),
            reads: Default::default(),
            fetch: Default::default(),
            decoded: Default::default(),
        };
        // Records written after the last super-commit are applied and committed here: the only
        // time mount writes. Replay may use every free block, as a commit does: it redoes
        // changes whose room was reserved when they were made, and a mount must not fail for
        // space.
        fs.commit.in_commit = true;
        let replayed = fs.replay_logs();
        fs.commit.in_commit = false;
        replayed?;
        // Inodes left open and nameless when the last session ended (a crash, or a process
        // that died holding them) have no holder now.
        if fs.delete_orphans()? > 0 {
            fs.commit()?;
        }
        // An older format's filesystem is marked with this one's version by a commit before
        // anything else is written (shard 0's inode counter is always there to rewrite), so that
        // no record of the new kinds ever sits under an old superblock, where an older corefs
        // would take it for the log's torn end.
        if best_version < FORMAT_VERSION {
            tracing::info!(
                from = best_version,
                to = FORMAT_VERSION,
                "upgrading the filesystem's format version{}",
                if best_version < 5 {
                    " (space bitmaps become block groups)"
                } else {
                    ""
                }
            );
            fs.rewrite_ino_counter(0)?;
            fs.commit()?;
        }
        // Mount reads the superblock, the roots and the logs synchronously, before anyone is
        // served: the device-wait statistics count waits inside operations from here on.
        fs.dev.waits = Default::default();
        Ok(fs)
    }
}
