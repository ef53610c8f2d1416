//! Write-back of file data. `write` allocates new blocks (copy-on-write), records the extent,
//! and stages the bytes here instead of writing them at once; they go to the device together
//! with whatever first needs them durable or readable:
//! - an fsync writes the staged data of the inodes its record covers in the same batch as the
//!   record, so the device works on both at once, and one flush makes both durable;
//! - a commit writes all staged data with its tree nodes, before its flush;
//! - a read of an inode with staged data hands that inode's data to the device first (in the
//!   background: see below);
//! - past [`MountOptions::writeback_start_bytes`] the data of the lowest-numbered (roughly the
//!   oldest) inodes goes to the device in the background, [`WRITEBACK_CHUNK_BYTES`] at a time
//!   with at most [`WRITEBACK_IN_FLIGHT_MAX_BYTES`] (and half the park bound below) on the
//!   device, while the reactor serves on;
//! - once a commit is near ([`Filesystem::commit_near`](crate::Filesystem::commit_near)), the threshold drops to
//!   [`PRECOMMIT_STAGED_BYTES`]: the commit then finds little data left to write, and every
//!   fsync that arrives while it is in flight waits for it (its record belongs to the next
//!   generation), so its length is fsync tail latency. 16 clients appending 4 KiB + fsync
//!   on a file image made commits of ~1,800 blocks (8 ms), nearly all staged data;
//! - past [`MountOptions::staged_park_bytes`] ([`STAGED_PARK_BYTES`] by default: writers
//!   outpace the device) a reactor holds back the
//!   operations that would stage more ([`Filesystem::staging_has_room`](crate::Filesystem::staging_has_room)): they park, without
//!   holding the reactor, until write-back has made room, while reads and every other
//!   operation go on. Writers are throttled to the device's write speed;
//! - past [`STAGED_HEADROOM_BYTES`] more ([`MAX_STAGED_BYTES`] by default), reached only by
//!   an engine driven without a reactor or by a
//!   single write larger than the headroom between the two bounds, everything staged is
//!   written back before the write returns, so memory stays bounded whoever drives it.
//!
//! Writing back in the background matters for latency: a synchronous write-back of 16 MiB held
//! the reactor, and every client's operation, for 30 ms on a file image. For the same reason a
//! read of blocks still staged does not write them back and wait: it hands them to the device
//! in the background, and the device pipeline answers the read from their bytes
//! ([`crate::log::inflight`]) or starts it once their write completes.
//!
//! Recently written and read data blocks are also kept, by disk block, in a bounded cache
//! ([`crate::MountOptions::data_cache_blocks`], [`CACHE_BLOCKS`] by default; 0 turns it off,
//! so every read of data not staged goes to the device, as a benchmark of the device path
//! needs): a read, or the read-modify-write of a write that covers part of a block (SQLite's
//! 4120-byte WAL frames), is served from memory instead of the device. Blocks are
//! copy-on-write, so a disk block's content only changes when it is freed and written anew,
//! which replaces the cached copy; and a cached block is used only if it matches the crc32c of
//! the extent that references it. A block's crc is computed at its first use and kept with it
//! (a block does not change in the cache; an insert replaces it with its own, unknown crc):
//! hashing 4 KiB at every hit was a tenth of a reactor's time serving cached reads.
//!
//! # Invariants
//! - A block referenced by a log record or a committed tree was written before the flush that
//!   made the record or the superblock durable (callers take the staged blocks of exactly the
//!   inodes they persist, or all of them).
//! - Staged blocks were freshly allocated by the running transaction and are never reused
//!   before its commit (data frees are pinned), so writing one late never overwrites live data.
//!
//! Fault model: a failed write-back makes the filesystem fail-stop; the fsync or commit that
//! needed it returns the error, so nothing is acknowledged that is not durable.

use crate::format::BLOCK_BYTES;
use std::collections::{BTreeMap, HashMap, VecDeque};

mod ops;

/// Staged data bytes past which everything staged is written back before a write returns,
/// at the default park bound (in general the park bound plus [`STAGED_HEADROOM_BYTES`]).
pub const MAX_STAGED_BYTES: usize = STAGED_PARK_BYTES + STAGED_HEADROOM_BYTES;
/// Staged data bytes from which a reactor parks the operations that stage more until
/// write-back makes room ([`Filesystem::staging_has_room`](crate::Filesystem::staging_has_room);
/// [`crate::MountOptions::staged_park_bytes`] by default).
pub const STAGED_PARK_BYTES: usize = 12 << 20;
/// Room above the park bound for the writes admitted just under it, before the hard bound.
pub const STAGED_HEADROOM_BYTES: usize = 4 << 20;
/// Bytes one background write-back takes (whole staged pieces, so it may take a little more).
pub const WRITEBACK_CHUNK_BYTES: usize = 1 << 20;
/// Background write-back bytes on the device at once. Small, because any synchronous I/O
/// (a cold read) first waits for the background I/O in flight: about 4 ms for 2 MiB on a
/// file image.
pub const WRITEBACK_IN_FLIGHT_MAX_BYTES: usize = 2 << 20;
/// Staged data bytes past which write-back starts while a commit is near.
pub const PRECOMMIT_STAGED_BYTES: usize = 256 << 10;
/// Data blocks the cache keeps by default (16 MiB).
pub const CACHE_BLOCKS: usize = 4096;

/// Recently written or read data blocks by disk block, in two segments so that streaming
/// I/O does not flush what is read again (scan resistance, as 2Q and Linux's inactive and
/// active lists):
/// - **probation**: every block enters here, first in, first out. A block read from here
///   is promoted; a block read ahead ([`BlockCache::insert_read`]) is promoted only at its
///   second read, since the streaming reader it was fetched for reads it once.
/// - **protected**: blocks read again, least recently read out first, at most three
///   quarters of the capacity (the oldest go back to probation past that).
///
/// Eviction takes probation's oldest first, so a file streamed through the cache (read
/// ahead, read once; or written once) only ever displaces other probation blocks: a 64 MiB
/// stream through a 16 MiB cache left none of a small hot set in memory before.
///
/// The bytes live in slots of a slab allocated a chunk at a time as the cache first fills and
/// reused after, never per block: a 4 KiB allocation and free per cached block (an insert
/// evicting the oldest) cost the allocator's page searches, 0.5 ms for the 16 blocks of one
/// 64 KiB dbench write at worst, and the map grew by rehashing every entry at once. The map
/// is sized for the capacity up front.
///
/// # Invariants
/// - At most `capacity_blocks` blocks are held, each in a slot of its own; a slot is in the
///   map or on the free list, never both.
/// - Every held block has one current entry, `(disk, its stamp)`, in the queue of its
///   segment (older entries for it are stale and skipped), so eviction always finds a block
///   to evict; `protected_blocks` counts the protected ones, at most `protected_max()`.
/// - The queues hold at most four entries per block of capacity (stale ones are dropped
///   past that, never blocks).
pub(crate) struct BlockCache {
    blocks: HashMap<u64, Cached>,
    /// Probation's entries, oldest first: (disk block, stamp).
    order: VecDeque<(u64, u64)>,
    /// Protected entries, least recently read first.
    protected: VecDeque<(u64, u64)>,
    protected_blocks: usize,
    stamp: u64,
    /// Most blocks kept; 0: none (the cache is off).
    capacity_blocks: usize,
    /// The slots' bytes, [`SLAB_CHUNK_BLOCKS`] slots a chunk.
    chunks: Vec<Box<[u8]>>,
    /// Slots made and not in use.
    free_slots: Vec<u32>,
    /// Data blocks reads took from the cache, and from the device.
    pub hits: u64,
    pub device_blocks: u64,
}

/// Slots per slab chunk (256 KiB).
const SLAB_CHUNK_BLOCKS: usize = 64;
/// Map entries reserved at start at most: a cache configured far larger grows its map past
/// this as it fills, rather than allocating it all at mount.
const RESERVE_BLOCKS_MAX: usize = 1 << 16;

/// Which segment a cached block is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    /// `ahead`: read ahead and not read yet (its first read does not promote it).
    Probation {
        ahead: bool,
    },
    Protected,
}

/// A cached block: its slot, the stamp of its current queue entry, its segment, and its
/// crc32c once computed.
struct Cached {
    slot: u32,
    stamp: u64,
    segment: Segment,
    crc: Option<u32>,
}

impl BlockCache {
    pub fn new(capacity_blocks: usize) -> BlockCache {
        BlockCache {
            blocks: HashMap::with_capacity(capacity_blocks.min(RESERVE_BLOCKS_MAX)),
            order: VecDeque::new(),
            protected: VecDeque::new(),
            protected_blocks: 0,
            stamp: 0,
            capacity_blocks,
            chunks: Vec::new(),
            free_slots: Vec::new(),
            hits: 0,
            device_blocks: 0,
        }
    }

    /// Caches a block written or read on demand.
    pub fn insert(&mut self, disk: u64, data: &[u8]) {
        self.insert_as(disk, data, false, None);
    }

    /// Caches a block read from the device whose crc32c the reader just computed
    /// (`ahead`: for a streaming reader, [`crate::reads`]), so its first hit does not
    /// hash it again.
    pub fn insert_read(&mut self, disk: u64, data: &[u8], crc: u32, ahead: bool) {
        self.insert_as(disk, data, ahead, Some(crc));
    }

    fn insert_as(&mut self, disk: u64, data: &[u8], ahead: bool, crc: Option<u32>) {
        assert_eq!(data.len(), BLOCK_BYTES);
        if self.capacity_blocks == 0 {
            return;
        }
        self.stamp += 1;
        let stamp = self.stamp;
        let (slot, segment) = match self.blocks.get_mut(&disk) {
            Some(cached) => {
                cached.stamp = stamp;
                cached.crc = crc;
                // New bytes for a block read ahead are no longer the read-ahead's.
                if let Segment::Probation { ahead: was } = cached.segment {
                    cached.segment = Segment::Probation {
                        ahead: was && ahead,
                    };
                }
                (cached.slot, cached.segment)
            }
            None => {
                while self.blocks.len() >= self.capacity_blocks && self.evict_oldest() {}
                let slot = self.take_slot();
                let segment = Segment::Probation { ahead };
                self.blocks.insert(
                    disk,
                    Cached {
                        slot,
                        stamp,
                        segment,
                        crc,
                    },
                );
                (slot, segment)
            }
        };
        self.slot_mut(slot).copy_from_slice(data);
        match segment {
            Segment::Protected => self.protected.push_back((disk, stamp)),
            Segment::Probation { .. } => self.order.push_back((disk, stamp)),
        }
        self.bound_stale_entries();
    }

    /// Re-stamped blocks (rewritten, read again, moved between segments) leave stale entries
    /// behind: past four entries per block of capacity the queues drop them, keeping every
    /// block (evicting blocks to shorten the queues made a hot set read over and over push
    /// out the rest of the cache). A compaction leaves at most one entry per block, so the
    /// next is a capacity's worth of entries away: O(1) per entry, amortized.
    fn bound_stale_entries(&mut self) {
        if self.order.len() + self.protected.len() <= self.capacity_blocks.saturating_mul(4) {
            return;
        }
        let blocks = &self.blocks;
        let current = |disk: &u64, stamp: &u64, protected: bool| {
            blocks.get(disk).is_some_and(|c| {
                c.stamp == *stamp && (c.segment == Segment::Protected) == protected
            })
        };
        self.order.retain(|(d, s)| current(d, s, false));
        self.protected.retain(|(d, s)| current(d, s, true));
    }

    /// The most blocks the protected segment holds.
    fn protected_max(&self) -> usize {
        self.capacity_blocks * 3 / 4
    }

    /// Drops the oldest entry of probation (of the protected queue when probation has
    /// none), and its block when the entry is current. False when both queues are empty.
    fn evict_oldest(&mut self) -> bool {
        let (queue_protected, (old, stamp)) = match self.order.pop_front() {
            Some(entry) => (false, entry),
            None => match self.protected.pop_front() {
                Some(entry) => (true, entry),
                None => return false,
            },
        };
        let current = self.blocks.get(&old).is_some_and(|c| {
            c.stamp == stamp && (c.segment == Segment::Protected) == queue_protected
        });
        if current {
            let cached = self.blocks.remove(&old).expect("checked");
            if cached.segment == Segment::Protected {
                self.protected_blocks -= 1;
            }
            self.free_slots.push(cached.slot);
        }
        true
    }

    /// Block `disk` was read from the cache: promoted out of probation (a block read ahead
    /// at its second read), or made the most recently read of the protected segment.
    fn touch(&mut self, disk: u64) {
        self.stamp += 1;
        let stamp = self.stamp;
        let Some(cached) = self.blocks.get_mut(&disk) else {
            return;
        };
        match cached.segment {
            Segment::Probation { ahead: true } => {
                cached.segment = Segment::Probation { ahead: false };
                return;
            }
            Segment::Probation { ahead: false } => {
                cached.segment = Segment::Protected;
                self.protected_blocks += 1;
            }
            Segment::Protected => {}
        }
        cached.stamp = stamp;
        self.protected.push_back((disk, stamp));
        // Past its share, the protected segment's least recently read go back to probation.
        while self.protected_blocks > self.protected_max() {
            let Some((old, old_stamp)) = self.protected.pop_front() else {
                break;
            };
            self.stamp += 1;
            let demoted = self.stamp;
            if let Some(c) = self
                .blocks
                .get_mut(&old)
                .filter(|c| c.stamp == old_stamp && c.segment == Segment::Protected)
            {
                c.segment = Segment::Probation { ahead: false };
                c.stamp = demoted;
                self.protected_blocks -= 1;
                self.order.push_back((old, demoted));
            }
        }
        self.bound_stale_entries();
    }

    /// A free slot, making a chunk of them when none is left (only while the cache first
    /// fills: the capacity bounds the slots made).
    fn take_slot(&mut self) -> u32 {
        if let Some(slot) = self.free_slots.pop() {
            return slot;
        }
        let first = (self.chunks.len() * SLAB_CHUNK_BLOCKS) as u32;
        self.chunks
            .push(vec![0u8; SLAB_CHUNK_BLOCKS * BLOCK_BYTES].into_boxed_slice());
        self.free_slots
            .extend((first + 1..first + SLAB_CHUNK_BLOCKS as u32).rev());
        first
    }

    fn slot(&self, slot: u32) -> &[u8] {
        let (chunk, at) = (
            slot as usize / SLAB_CHUNK_BLOCKS,
            slot as usize % SLAB_CHUNK_BLOCKS,
        );
        &self.chunks[chunk][at * BLOCK_BYTES..(at + 1) * BLOCK_BYTES]
    }

    fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let (chunk, at) = (
            slot as usize / SLAB_CHUNK_BLOCKS,
            slot as usize % SLAB_CHUNK_BLOCKS,
        );
        &mut self.chunks[chunk][at * BLOCK_BYTES..(at + 1) * BLOCK_BYTES]
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Drops the cached blocks in `range` (their queue entries go stale).
    pub fn forget(&mut self, range: std::ops::Range<u64>) {
        if self.blocks.is_empty() {
            return;
        }
        for disk in range {
            if let Some(cached) = self.blocks.remove(&disk) {
                if cached.segment == Segment::Protected {
                    self.protected_blocks -= 1;
                }
                self.free_slots.push(cached.slot);
            }
        }
    }

    pub fn get(&self, disk: u64) -> Option<&[u8]> {
        self.blocks.get(&disk).map(|c| self.slot(c.slot))
    }

    /// Whether block `disk` is cached with crc32c `crc`, without reading it (no promotion).
    pub(crate) fn holds(&mut self, disk: u64, crc: u32) -> bool {
        let Some(cached) = self.blocks.get(&disk) else {
            return false;
        };
        let have = match cached.crc {
            Some(have) => have,
            None => {
                let have = crc32c::crc32c(self.slot(cached.slot));
                self.blocks.get_mut(&disk).expect("found above").crc = Some(have);
                have
            }
        };
        have == crc
    }

    /// Block `disk` if it is cached and its crc32c is `crc`: a read of it, which promotes it
    /// (see the type's doc).
    pub(crate) fn get_checked(&mut self, disk: u64, crc: u32) -> Option<&[u8]> {
        let (slot, known) = {
            let cached = self.blocks.get(&disk)?;
            (cached.slot, cached.crc)
        };
        let have = match known {
            Some(have) => have,
            None => {
                let have = crc32c::crc32c(self.slot(slot));
                self.blocks.get_mut(&disk).expect("found above").crc = Some(have);
                have
            }
        };
        if have != crc {
            return None;
        }
        self.touch(disk);
        Some(self.slot(slot))
    }
}

#[derive(Default)]
pub(crate) struct Staged {
    /// Per inode: its staged pieces, oldest first.
    by_ino: BTreeMap<u64, Vec<Run>>,
    bytes: usize,
}

/// A staged piece of an inode's data.
pub(crate) struct Run {
    /// Its first disk block.
    disk: u64,
    /// Whole blocks of data: a slice of the write's bytes, shared with the other runs the
    /// write was staged in (none of them copies).
    data: bytes::Bytes,
    /// Every block of it is carried by an fsync record of this generation (a record that
    /// references one of them later needs not carry it again: replay writes it from the
    /// earlier record, which replays first). Commits take every run, so a mark never
    /// outlives its generation.
    logged: bool,
}

impl Run {
    fn blocks(&self) -> u64 {
        (self.data.len() / BLOCK_BYTES) as u64
    }
}

impl Staged {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Largest piece staged data is kept in: a write's data is staged in pieces this size, which
/// go to the device as they are ([`crate::blocks::coalesce`] joins neighbours up to the
/// largest I/O). Splitting staged runs into single blocks when they were taken copied every
/// byte once more: 8 MiB of a large file's fsync cost about 2 ms of the reactor for it.
pub(crate) const STAGE_PIECE_BYTES: usize = 64 << 10;

/// Writes of at least this many bytes stream: their blocks are staged but not cached
/// ([`Filesystem::stage_data`](crate::Filesystem::stage_data)), whatever allocation runs they land in.
pub const STREAM_WRITE_BYTES: usize = 256 << 10;

/// Moves staged runs into `out`, each a piece of whole blocks (at most
/// [`STAGE_PIECE_BYTES`]), without copying them.
fn move_pieces(runs: Vec<Run>, out: &mut Vec<(u64, bytes::Bytes)>) {
    for Run { disk, data, .. } in runs {
        assert!(
            data.len() % BLOCK_BYTES == 0 && data.len() <= STAGE_PIECE_BYTES,
            "staged data is kept in pieces of whole blocks"
        );
        out.push((disk, data));
    }
}

/// Staged runs of some inodes, moved between partitions ([`crate::partition`]).
pub(crate) type StagedRuns = Vec<(u64, Vec<Run>)>;

impl Staged {
    /// Takes the staged data of every inode `pick` selects.
    pub(crate) fn take_inodes(&mut self, pick: impl Fn(u64) -> bool) -> StagedRuns {
        let inos: Vec<u64> = self.by_ino.keys().copied().filter(|i| pick(*i)).collect();
        let mut out = Vec::with_capacity(inos.len());
        for ino in inos {
            let runs = self.by_ino.remove(&ino).expect("listed");
            self.bytes -= runs.iter().map(|r| r.data.len()).sum::<usize>();
            out.push((ino, runs));
        }
        out
    }

    /// Adds staged data taken by [`Staged::take_inodes`].
    pub(crate) fn put_inodes(&mut self, inodes: StagedRuns) {
        for (ino, mut runs) in inodes {
            self.bytes += runs.iter().map(|r| r.data.len()).sum::<usize>();
            // A mark speaks for this partition's stream of records: replay orders a stream's
            // records but not one stream's against another's, so here the data is carried
            // again by the next record that references it.
            for run in &mut runs {
                run.logged = false;
            }
            self.by_ino.entry(ino).or_default().extend(runs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BlockCache, Segment};
    use crate::format::BLOCK_BYTES;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn block(disk: u64, version: u32) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_BYTES];
        b[..8].copy_from_slice(&disk.to_le_bytes());
        b[8..12].copy_from_slice(&version.to_le_bytes());
        b[BLOCK_BYTES - 4..].copy_from_slice(&version.to_le_bytes());
        b
    }

    proptest! {
        /// The slab cache returns a block's latest bytes or nothing (no two blocks ever share
        /// a slot), holds at most its capacity, keeps the block inserted last, and checks
        /// crcs against the bytes it holds.
        #[test]
        fn the_block_cache_keeps_latest_bytes_within_its_capacity(
            capacity in 1usize..200,
            inserts in proptest::collection::vec(0u64..400, 1..3000),
        ) {
            let mut cache = BlockCache::new(capacity);
            let mut latest: HashMap<u64, u32> = HashMap::new();
            for (version, &disk) in inserts.iter().enumerate() {
                let version = version as u32;
                cache.insert(disk, &block(disk, version));
                latest.insert(disk, version);
                prop_assert!(cache.blocks.len() <= capacity);
                prop_assert!(cache.protected_blocks <= cache.protected_max());
                prop_assert!(cache.get(disk).is_some(), "the block just inserted is held");
                let want = block(disk, version);
                let crc = crc32c::crc32c(&want);
                prop_assert_eq!(cache.get_checked(disk, crc), Some(&want[..]));
                prop_assert_eq!(cache.get_checked(disk, crc ^ 1), None);
            }
            for (&disk, &version) in &latest {
                if let Some(got) = cache.get(disk) {
                    prop_assert_eq!(got, &block(disk, version)[..]);
                }
            }
            prop_assert!(cache.chunks.len() * super::SLAB_CHUNK_BLOCKS < capacity + super::SLAB_CHUNK_BLOCKS);
        }
    }

    /// Scan resistance: a small set read twice survives any amount of data streamed through
    /// the cache once, whether read ahead and read, or written; the protected segment stays
    /// within its share; blocks nobody reads again still go first in, first out.
    #[test]
    fn a_stream_through_the_cache_leaves_blocks_read_again_in_it() {
        let mut cache = BlockCache::new(64);
        let crc = |disk: u64| crc32c::crc32c(&block(disk, 0));
        for hot in 0..16 {
            cache.insert(hot, &block(hot, 0));
            assert!(cache.get_checked(hot, crc(hot)).is_some());
        }
        for disk in 1000..3000u64 {
            if disk % 2 == 0 {
                // Read ahead, then read once by the streaming reader.
                let data = block(disk, 0);
                cache.insert_read(disk, &data, crc32c::crc32c(&data), true);
                assert!(cache.get_checked(disk, crc(disk)).is_some());
            } else {
                // Written once (a streaming writer).
                cache.insert(disk, &block(disk, 0));
            }
            assert!(cache.blocks.len() <= 64);
        }
        for hot in 0..16 {
            assert!(cache.get(hot).is_some(), "hot block {hot} was streamed out");
        }
        // Everything read twice: protected holds at most three quarters, the rest stays on
        // probation, and the count agrees with the segments.
        for disk in 5000..5064u64 {
            cache.insert(disk, &block(disk, 0));
            cache.get_checked(disk, crc(disk));
        }
        let protected = cache
            .blocks
            .values()
            .filter(|c| c.segment == Segment::Protected)
            .count();
        assert_eq!(protected, cache.protected_blocks);
        assert!(protected <= 48, "{protected} protected of 64");
        // A hot block read over and over leaves stale queue entries, never evictions.
        let mut steady = BlockCache::new(16);
        for disk in 0..16u64 {
            steady.insert(disk, &block(disk, 0));
        }
        for _ in 0..1000 {
            assert!(steady.get_checked(3, crc(3)).is_some());
        }
        assert!(
            (0..16).all(|d| steady.get(d).is_some()),
            "a hot block evicted others"
        );
        assert!(steady.order.len() + steady.protected.len() <= 64);
        // Blocks never read again leave in the order they came.
        let mut fifo = BlockCache::new(8);
        for disk in 0..12u64 {
            fifo.insert(disk, &block(disk, 0));
        }
        assert!((0..4).all(|d| fifo.get(d).is_none()));
        assert!((4..12).all(|d| fifo.get(d).is_some()));
    }

    /// Off means off: nothing is held and no slab is made.
    #[test]
    fn a_cache_of_no_blocks_holds_nothing() {
        let mut cache = BlockCache::new(0);
        cache.insert(7, &block(7, 1));
        assert!(cache.get(7).is_none());
        assert!(cache.chunks.is_empty());
    }
}
