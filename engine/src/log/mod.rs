//! The fast fsync log (docs/fsync-log.md): fsync and fdatasync write what changed since the
//! inode was last logged into a record at the head of one shard's log area and flush once,
//! instead of committing the transaction. Mount replays the records written after the last
//! super-commit ([`replay`]); every super-commit truncates the logs (records carry the
//! generation they belong to, and the next one starts at the head of the area again).
//!
//! What a record holds: the current value (or the deletion) of every tree key that changed
//! since it was last logged, for a set of inodes closed under two rules:
//! - **name coupling**: a name added or removed couples the directory and the child (the
//!   child's back-reference key names both), so the directory's items, its size, link count and
//!   index counter, and the child's back-references and link count are always logged together;
//! - **reachability**: every ancestor of a logged inode whose own name changed since it was
//!   last logged is logged too (a new directory, a renamed one), so an fsynced path exists
//!   after replay. The walk goes up to the root: a directory whose own name is durable may
//!   sit below one renamed in this generation (`rename A B/D; fsync B/D/C/foo` must log `A`'s
//!   move though `C` and `foo` are unchanged).
//!
//! # Invariants
//! - Replaying the durable tree plus the accepted records gives a state in which every
//!   cross-inode invariant holds (names, link counts, directory sizes): such invariants only
//!   span name-coupled inodes, which are logged together. Space and inode counters, the two
//!   per-shard invariants, are rebuilt by replay from the extents and inodes it applied.
//! - An inode with nothing new since it was last logged in this transaction is not logged
//!   again, whether it is the inode fsynced, a coupled one or an ancestor.
//! - Change tracking is per key, so it never loses an extent and never depends on the tree
//!   cache: clean nodes may be evicted at will. It is bounded by the transaction (a commit
//!   clears it, and [`Filesystem::commit_due`](crate::Filesystem::commit_due) commits when it grows past
//!   [`MAX_TRACKED_KEYS`]).
//! - Data blocks a record references are never reused before the next super-commit (data
//!   frees are pinned), so replay finds them as written.
//!
//! Fault model: a record is written without FUA and made durable by one flush. A small fsync's
//! data rides inside the record (covered by its crc); a large one's data blocks are written in
//! place beside it, and the same flush makes them durable. A crash before the flush completes may leave
//! the record without its data, or torn: replay checks the record's crc and the crc32c of every
//! data block it references, and stops at the first record that fails (its fsync had not
//! returned). A device error while logging makes the filesystem fail-stop like any other.

pub mod inflight;
pub mod record;
mod replay;
mod side;

pub use inflight::FsyncStart;
pub use side::{SideRecord, LENT_FSYNC_BYTES_MAX};

use crate::format::items::InodeItem;
use crate::format::items::FIRST_INODE;
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use record::LogOp;
use std::collections::{BTreeMap, HashSet};

mod ops;

/// A record's blocks at `at` and the data blocks written in place beside it: one batch, all
/// in flight at once, made durable by one flush.
fn record_and_data(
    at: u64,
    record: Vec<u8>,
    mut data: Vec<(u64, bytes::Bytes)>,
) -> Vec<(u64, bytes::Bytes)> {
    data.extend(
        record
            .chunks(BLOCK_BYTES)
            .enumerate()
            .map(|(i, b)| (at + i as u64, bytes::Bytes::copy_from_slice(b))),
    );
    data
}

/// Tracked changed keys past which the running transaction is due to commit.
pub const MAX_TRACKED_KEYS: usize = 1 << 20;
/// Staged data blocks an fsync record carries itself; past this the data is written in place.
/// Larger ones go in place: embedded blocks are written twice (in the record, then by the
/// commit), which for 64 KiB fsyncs doubled the device traffic and filled the log (and forced
/// a commit) every 15 ms.
pub const EMBED_MAX_BLOCKS: usize = 8;

/// Fsync log figures, since mount.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LogStats {
    /// fsync and fdatasync calls (a group counts each member).
    pub fsyncs: u64,
    /// Records written, and their blocks; records written FUA (no flush after them).
    pub log_writes: u64,
    pub log_blocks: u64,
    pub fua_records: u64,
    /// Inodes written into records.
    pub inodes_logged: u64,
    /// Of those, files carried for their names alone, their content left for later
    /// (see "What a record holds" in docs/fsync-log.md).
    pub inodes_named_only: u64,
    /// fsyncs that found nothing new to log (no I/O at all).
    pub already_logged: u64,
    /// fsyncs that committed the transaction instead, by reason.
    pub fallback_log_full: u64,
    pub fallback_too_big: u64,
    /// ...because a member was changed by an operation spanning partitions, which only a
    /// commit makes durable atomically ([`crate::partition`]).
    pub fallback_cross: u64,
    /// Records and ops replayed by mount.
    pub replayed_records: u64,
    pub replayed_ops: u64,
    /// Staged file data written back in the background before an fsync or a commit needed
    /// it ([`crate::writeback`]).
    pub writeback_bytes: u64,
}

impl LogStats {
    pub fn fallback_commits(&self) -> u64 {
        self.fallback_log_full + self.fallback_too_big + self.fallback_cross
    }
}

/// What changed in one inode since it was last logged (or since the last commit).
#[derive(Default)]
pub(crate) struct Tracked {
    pub(crate) keys: LazySet<(ItemKind, u64)>,
    /// Something other than timestamps changed (what fdatasync must log).
    data: bool,
    /// One of its names (an `InodeRef` key) changed: an ancestor walk must log it.
    name_changed: bool,
    /// Inodes a name change couples this one to.
    links: LazySet<u64>,
    /// A regular file created in this transaction, never logged whole since and never
    /// renamed over another ([`LogState::note_replacing`]): nothing of its content is durable
    /// yet, so a record that carries it only for its names may give it the content it was
    /// born with (empty) and leave the rest tracked
    /// ([`Filesystem::fsync_group_start`](crate::Filesystem::fsync_group_start)).
    born: bool,
}

/// A set kept as a list that is appended to and deduplicated lazily. Noting a change is on
/// every mutation's path, and a directory taking thousands of creates notes three keys per
/// create: a `BTreeSet` insert there cost more than the rest of the create. A push is O(1); a
/// note of the key just noted (an inode item touched by every write) is dropped at once.
///
/// Inserts gather unsorted in `recent`; a full `recent` is sorted into a run, and runs merge
/// like a binary counter (the newest into the one before while that one is at most twice its
/// size), dropping duplicates as they merge, up to [`LazySet::RUN_LEN_MAX`]. So no insert
/// sorts or merges the whole set: the set used to be sorted whole each time it doubled, and
/// under a create run a directory's list reached 34,000 keys, a sort of 0.9–1.0 ms inside
/// one create (the longest requests of a create run on the memory backend); merging runs
/// that large still cost 0.2–1.7 ms. A merge is linear and bounded by the cap.
///
/// Memory stays bounded without merging everything: the tracked keys of a transaction,
/// duplicates included, make its commit due at [`MAX_TRACKED_KEYS`]. Duplicates across
/// capped runs are keys changed again after thousands of other changes to the same inode.
///
/// # Invariants
/// - Each run is sorted and distinct. Below the cap, each run is more than twice as long as
///   the next (newer) one, so a set of fewer distinct members than the cap holds fewer than
///   twice them plus [`LazySet::RECENT_MAX`].
#[derive(Debug)]
pub(crate) struct LazySet<T> {
    /// Sorted, distinct runs, oldest (longest) first.
    runs: Vec<Vec<T>>,
    /// Inserts since the last run was made, unsorted.
    recent: Vec<T>,
    /// Entries in `runs`, kept current: [`LazySet::len`] is asked twice per change noted,
    /// and a directory under a create run holds dozens of capped runs.
    runs_len: usize,
}

impl<T> Default for LazySet<T> {
    fn default() -> Self {
        LazySet {
            runs: Vec::new(),
            recent: Vec::new(),
            runs_len: 0,
        }
    }
}

impl<T: Ord + Copy> LazySet<T> {
    /// Inserts gathered before they are sorted into a run (small sets, most inodes' one to
    /// three keys, are never sorted). A sort of this many costs a few microseconds.
    const RECENT_MAX: usize = 128;
    /// Longest run a merge makes: merging 8,192 keys costs tens of microseconds.
    const RUN_LEN_MAX: usize = 8192;

    pub(crate) fn insert(&mut self, item: T) {
        if self.recent.last() == Some(&item) {
            return;
        }
        self.recent.push(item);
        if self.recent.len() < Self::RECENT_MAX {
            return;
        }
        let mut run = std::mem::take(&mut self.recent);
        run.sort_unstable();
        run.dedup();
        self.runs_len += run.len();
        while self.runs.last().is_some_and(|last| {
            last.len() <= 2 * run.len() && last.len() + run.len() <= Self::RUN_LEN_MAX
        }) {
            let last = self.runs.pop().expect("checked");
            let before = last.len() + run.len();
            run = merge_distinct(&last, &run);
            self.runs_len -= before - run.len();
        }
        self.runs.push(run);
    }

    /// Entries held, duplicates included (what the memory bound counts).
    pub(crate) fn len(&self) -> usize {
        self.runs_len + self.recent.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.recent.is_empty() && self.runs.is_empty()
    }

    /// The members, unordered, possibly repeated.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.runs.iter().flatten().chain(self.recent.iter())
    }

    /// The members, sorted and distinct.
    pub(crate) fn sorted(&self) -> Vec<T> {
        let mut items: Vec<T> = self.iter().copied().collect();
        // The stable sort finds the sorted runs and merges them.
        items.sort();
        items.dedup();
        items
    }
}

/// Two sorted, distinct runs merged into one, sorted and distinct.
fn merge_distinct<T: Ord + Copy>(a: &[T], b: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

#[derive(Default)]
pub(crate) struct LogState {
    /// Changes tracked per inode since the last commit. A B-tree, not a hash map: a create
    /// run tracks tens of thousands of inodes per generation, and a hash map's resize moved
    /// them all at once inside one operation (1.1, 1.7, 3.0 and 6.0 ms at 7, 14, 28 and 57
    /// thousand inodes: the creates' worst latency). A B-tree grows a node at a time.
    pub(crate) inodes: BTreeMap<u64, Tracked>,
    /// The last generation's tracking, dropped a bounded number of inodes at a time
    /// ([`LogState::drop_retired`]): dropping tens of thousands at the commit's start held
    /// the reactor 1 to 3 ms in a create run.
    retired: BTreeMap<u64, Tracked>,
    pub(crate) tracked_keys: usize,
    /// Inodes changed this transaction by an operation that spanned partitions: an fsync
    /// reaching one commits instead of logging ([`crate::partition`]).
    pub(crate) cross: HashSet<u64>,
    /// Per directory, the new files a record carried by name alone since the last commit
    /// (their content still unlogged): an fsync of the directory logs them whole, since it
    /// persists its new files' content (docs/durability.md), and by then the directory may
    /// have nothing of its own left to log.
    pub(crate) named_only_in: BTreeMap<u64, Vec<u64>>,
    /// Per shard: the next block of its log area, and the next record's shard sequence.
    pub(crate) heads: Vec<u64>,
    pub(crate) shard_seqs: Vec<u64>,
    /// This log stream (a partition's; 0 when whole) and its next record's sequence, over
    /// the stream's shards (replay order).
    pub(crate) stream: u32,
    next_seq: u64,
    /// Reused buffer for keys taken from the trees.
    pub scratch: Vec<Key>,
    pub stats: LogStats,
    /// Records whose writes or flush are still in flight.
    pub pipeline: inflight::Pipeline,
    /// Writes and flushes queued for a caller to make beside the queue
    /// ([`Filesystem::fsync_beside`](crate::Filesystem::fsync_beside)), taken into its [`SideRecord`].
    pub(crate) side_out: Vec<crate::mux::SideIo>,
    /// Data was written in place in the foreground since the last flush was submitted: a
    /// record referencing it needs a flush, not only a FUA write.
    pub unflushed_writes: bool,
    /// Inodes logged in this generation (what the `NoRelog` mutation check skips).
    #[cfg(feature = "mutations")]
    logged_this_generation: HashSet<u64>,
}

impl LogState {
    pub fn new(shards: usize) -> LogState {
        LogState {
            heads: vec![0; shards],
            shard_seqs: vec![0; shards],
            // Nothing says the device's cache holds none of our writes: the first record
            // flushes.
            unflushed_writes: true,
            ..Default::default()
        }
    }

    /// Records that `key` changed (inserted, replaced or removed).
    pub fn note(&mut self, key: Key) {
        if key.objectid < FIRST_INODE {
            return; // the engine's own items: persisted by commits only
        }
        let tracked = self.inodes.entry(key.objectid).or_default();
        let held = tracked.keys.len();
        tracked.keys.insert((key.kind, key.offset));
        // Compaction may shrink the list: the total follows what the lists hold.
        self.tracked_keys = self.tracked_keys - held + tracked.keys.len();
        if key.kind != ItemKind::InodeItem {
            tracked.data = true;
        }
        if key.kind == ItemKind::InodeRef {
            tracked.name_changed = true;
            if key.offset != key.objectid {
                self.couple(key.objectid, key.offset);
            }
        }
    }

    /// A name of `child` in `dir` changed: the two are logged together from now on (name
    /// coupling). An InodeRef key names both ([`LogState::note`]); an extended
    /// back-reference's key does not, so its writer calls this itself.
    pub fn couple(&mut self, child: u64, dir: u64) {
        let tracked = self.inodes.entry(child).or_default();
        tracked.name_changed = true;
        tracked.links.insert(dir);
        self.inodes.entry(dir).or_default().links.insert(child);
    }

    /// `ino` is a regular file this transaction created (see [`Tracked::born`]).
    pub fn note_born(&mut self, ino: u64) {
        self.inodes.entry(ino).or_default().born = true;
    }

    /// `ino` took the name of another file (a rename over it, or an exchange): it is logged
    /// whole from now on, never by name alone. The pattern is "write a new file, rename it
    /// over the old one" without an fsync of the new one; by name alone a sibling's fsync
    /// would persist the name with an empty file and the old file gone (ext4's
    /// `auto_da_alloc` and btrfs's flush on a replacing rename exist for the same reason).
    pub fn note_replacing(&mut self, ino: u64) {
        if let Some(t) = self.inodes.get_mut(&ino) {
            t.born = false;
        }
    }

    /// An inode item changed in more than its timestamps.
    pub fn note_data(&mut self, ino: u64) {
        self.inodes.entry(ino).or_default().data = true;
    }

    /// Blocks used in the fullest log half (one 7/8 full makes a commit due, so fsyncs rarely
    /// find it full: the next generation logs into the other half while the commit runs).
    pub fn fullest_head(&self) -> u64 {
        self.heads.iter().copied().max().unwrap_or(0)
    }

    pub fn tracked_keys(&self) -> usize {
        self.tracked_keys
    }

    /// A commit started: every change tracked so far is in it, the next generation's
    /// changes are tracked from here.
    pub fn reset_tracking(&mut self) {
        let mut old = std::mem::take(&mut self.inodes);
        if self.retired.is_empty() {
            self.retired = old;
        } else {
            // Not dropped yet (commits in quick succession): kept with the older ones.
            self.retired.append(&mut old);
        }
        self.cross.clear();
        self.named_only_in.clear();
        self.tracked_keys = 0;
        #[cfg(feature = "mutations")]
        self.logged_this_generation.clear();
    }

    /// Drops up to `max` inodes' retired tracking; true while some is left. Called as the
    /// commit progresses, so the drop is spread over its slices.
    pub fn drop_retired(&mut self, max: usize) -> bool {
        for _ in 0..max {
            if self.retired.pop_first().is_none() {
                return false;
            }
        }
        !self.retired.is_empty()
    }

    /// A super-commit made everything logged durable: the logs start over at their heads.
    pub fn reset_heads(&mut self) {
        self.heads.iter_mut().for_each(|h| *h = 0);
        self.shard_seqs.iter_mut().for_each(|s| *s = 0);
        self.next_seq = 0;
    }

    /// Mutation check `NoRelog`: an inode logged once this generation counts as having
    /// nothing new.
    fn relog_suppressed(&self, _ino: u64) -> bool {
        #[cfg(feature = "mutations")]
        let suppressed = mutated!(NoRelog) && self.logged_this_generation.contains(&_ino);
        #[cfg(not(feature = "mutations"))]
        let suppressed = false;
        suppressed
    }

    fn own_name_changed(&self, ino: u64) -> bool {
        self.inodes.get(&ino).is_some_and(|t| t.name_changed)
    }
}

/// True when two inode items differ only in their timestamps.
pub(crate) fn only_times_differ(old: &InodeItem, new: &InodeItem) -> bool {
    let mut old = *old;
    old.atime = new.atime;
    old.mtime = new.mtime;
    old.ctime = new.ctime;
    old == *new
}

/// What a record carries of the staged data: its data ops, and the staged runs (inode, index)
/// they cover whole.
type CarriedData = (Vec<LogOp>, Vec<(u64, usize)>);

#[cfg(test)]
mod tests {
    use super::{LazySet, LogState};
    use crate::format::{ItemKind, Key};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// A commit's start hands the generation's tracking over whole and new changes start
    /// from nothing; the old tracking is dropped a bounded step at a time, and a second
    /// hand-over before the first is dropped keeps both for dropping.
    #[test]
    fn retired_tracking_is_dropped_in_bounded_steps() {
        let mut log = LogState::default();
        let note = |log: &mut LogState, ino: u64| {
            log.note(Key::new(ino, ItemKind::InodeItem, 0));
        };
        (1000..11_000).for_each(|ino| note(&mut log, ino));
        log.reset_tracking();
        assert!(log.inodes.is_empty() && log.tracked_keys() == 0);
        note(&mut log, 50_000);
        assert!(log.drop_retired(4096), "6,000 left after one step");
        assert_eq!(log.retired.len(), 10_000 - 4096);
        log.reset_tracking();
        assert_eq!(
            log.retired.len(),
            10_000 - 4096 + 1,
            "both generations kept"
        );
        assert!(log.drop_retired(4096));
        assert!(!log.drop_retired(4096), "all dropped");
        assert!(log.retired.is_empty() && log.inodes.is_empty());
    }

    /// A directory under a create run: an index, a hashed name and the directory's own inode
    /// item per create. The repeats are dropped as runs merge, and no run (no merge) passes
    /// the cap, so no insert ever sorts or merges the whole set.
    #[test]
    fn a_directory_under_creates_stays_within_bounds() {
        let mut lazy: LazySet<(u8, u64)> = LazySet::default();
        let creates = 100_000u64;
        for i in 0..creates {
            lazy.insert((1, i));
            lazy.insert((2, i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            lazy.insert((0, 0));
        }
        let distinct = 2 * creates as usize + 1;
        // One repeat (the inode item) per run at most.
        assert!(lazy.len() <= distinct + lazy.runs.len() + LazySet::<(u8, u64)>::RECENT_MAX);
        for run in &lazy.runs {
            assert!(run.len() <= LazySet::<(u8, u64)>::RUN_LEN_MAX);
            assert!(
                run.windows(2).all(|w| w[0] < w[1]),
                "a run is sorted and distinct"
            );
        }
        assert_eq!(lazy.sorted().len(), distinct);
    }

    proptest! {
        /// A lazy set holds what a `BTreeSet` would, and never more than twice its distinct
        /// members plus the unsorted inserts; its runs keep their invariants.
        #[test]
        fn a_lazy_set_is_a_set_with_bounded_slack(items in proptest::collection::vec(0u64..200, 0..2000)) {
            let mut lazy = LazySet::default();
            let mut model = BTreeSet::new();
            for &item in &items {
                lazy.insert(item);
                model.insert(item);
                prop_assert!(lazy.len() <= 2 * model.len() + LazySet::<u64>::RECENT_MAX);
                prop_assert_eq!(lazy.len(), lazy.iter().count(), "the kept length is the held entries");
                for run in &lazy.runs {
                    prop_assert!(run.windows(2).all(|w| w[0] < w[1]), "a run is sorted and distinct");
                }
                for pair in lazy.runs.windows(2) {
                    prop_assert!(pair[0].len() > 2 * pair[1].len(), "runs shrink geometrically");
                }
            }
            prop_assert_eq!(lazy.sorted(), model.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(lazy.is_empty(), model.is_empty());
            let mut seen: Vec<u64> = lazy.iter().copied().collect();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen, model.into_iter().collect::<Vec<_>>());
        }
    }
}
