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
//!   clears it, and [`Filesystem::commit_due`] commits when it grows past
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

use crate::error::{EngineError, Result};
use crate::format::items::{encode_names, InodeItem};
use crate::format::{ItemKind, Key, BLOCK_BYTES};
use crate::fs::{Filesystem, FIRST_INODE};
use record::{encode_record, record_blocks, LogOp, RecordHeader};
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// A record's blocks at `at` and the data blocks written in place beside it: one batch, all
/// in flight at once, made durable by one flush.
fn record_and_data(at: u64, record: Vec<u8>, mut data: Vec<(u64, Vec<u8>)>) -> Vec<(u64, Vec<u8>)> {
    data.extend(
        record
            .chunks(BLOCK_BYTES)
            .enumerate()
            .map(|(i, b)| (at + i as u64, b.to_vec())),
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    /// fsync and fdatasync calls (a group counts each member).
    pub fsyncs: u64,
    /// Records written, and their blocks; records written FUA (no flush after them).
    pub log_writes: u64,
    pub log_blocks: u64,
    pub fua_records: u64,
    /// Inodes written into records.
    pub inodes_logged: u64,
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
    /// ([`Filesystem::fsync_beside`]), taken into its [`SideRecord`].
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

impl Filesystem {
    /// fsync: makes the inode's data and metadata durable, and its names and the path to it.
    /// Writes one log record and flushes, or nothing when nothing changed since the inode was
    /// last logged; commits instead only when the record does not fit the log.
    pub fn fsync(&mut self, ino: u64) -> Result<()> {
        self.check_exists(ino)?;
        self.fsync_group(&[(ino, false)])
    }

    /// fdatasync: as [`Filesystem::fsync`], except that an inode whose only change since it was
    /// last logged is its timestamps is not logged at all.
    pub fn fdatasync(&mut self, ino: u64) -> Result<()> {
        self.check_exists(ino)?;
        self.fsync_group(&[(ino, true)])
    }

    /// An fsync of an inode that does not exist is an error (a stale handle), not a no-op,
    /// unless its last name went in this transaction: then logging it persists the removal.
    pub fn check_exists(&mut self, ino: u64) -> Result<()> {
        match self.load_inode(ino) {
            Err(EngineError::NotFound) if self.log.inodes.contains_key(&ino) => Ok(()),
            other => other.map(drop),
        }
    }

    /// Several fsyncs (`(ino, datasync)`) made durable by one record and one flush: what a
    /// reactor does with the fsyncs that arrive while it is busy. Callers check each inode
    /// when its fsync arrives ([`Filesystem::check_exists`]); a member removed since, whose
    /// removal is already durable or logged, has nothing left to persist and is skipped.
    pub fn fsync_group(&mut self, group: &[(u64, bool)]) -> Result<()> {
        match self.fsync_group_start(group)? {
            FsyncStart::Durable => Ok(()),
            FsyncStart::Pending(ticket) => self.wait_durable(ticket),
            FsyncStart::NeedsCommit => self.commit_to_super().map(drop),
            // The commit first: the record counts only after it.
            FsyncStart::AfterCommit { ticket, .. } => {
                self.finish_commit_in_flight()?;
                match ticket {
                    Some(ticket) => self.wait_durable(ticket),
                    None => Ok(()),
                }
            }
        }
    }

    /// The fallback: a commit here, or, in a partition, the owner's coordinated commit. A
    /// lent engine ([`Filesystem::fsync_beside`]) commits nothing: the owner runs the fsync.
    fn fsync_fallback(&mut self) -> Result<FsyncStart> {
        if self.mode.is_partitioned() || self.commit.deferred || self.dev.lent_for_writes() {
            Ok(FsyncStart::NeedsCommit)
        } else {
            self.commit_to_super().map(|_| FsyncStart::Durable)
        }
    }

    /// [`Filesystem::fsync_group`] without waiting: the record's writes and flush are started
    /// in the background ([`inflight`]) and the group is durable once
    /// [`Filesystem::log_progress`] passes the returned ticket. The engine serves other
    /// operations meanwhile; a reactor releases the group's waiters then. A group with
    /// nothing new to log still waits for the newest record in flight, which may hold its
    /// changes.
    pub fn fsync_group_start(&mut self, group: &[(u64, bool)]) -> Result<FsyncStart> {
        self.check_writable()?;
        // While a commit (N) is in flight this logs for N+1 into the other half of the log
        // area; such a record counts only once N is durable too, which the caller waits for
        // (`FsyncStart::Pending` names the generation).
        self.log.stats.fsyncs += group.len() as u64;
        let mut wanted = Vec::with_capacity(group.len());
        for &(ino, datasync) in group {
            let pending = self
                .log
                .inodes
                .get(&ino)
                .is_some_and(|t| !datasync || t.data || !t.links.is_empty());
            if self.log.relog_suppressed(ino) {
                self.log.stats.already_logged += 1;
            } else if pending || self.ancestor_pending(ino)? {
                wanted.push(ino);
            } else {
                self.log.stats.already_logged += 1;
            }
        }
        if wanted.is_empty() {
            // What it changed may be in the commit in flight: durable with it.
            if let Some(generation) = self.commit_in_flight() {
                return Ok(FsyncStart::AfterCommit {
                    ticket: self.newest_in_flight(),
                    generation,
                });
            }
            return Ok(match self.newest_in_flight() {
                Some(ticket) => FsyncStart::Pending(ticket),
                None => FsyncStart::Durable,
            });
        }
        let Some(members) = self.log_closure(&wanted)? else {
            self.log.stats.fallback_cross += 1;
            tracing::debug!("fsync reaches a change spanning partitions: committing");
            return self.fsync_fallback();
        };
        let mut ops = self.collect_ops(&members)?;
        // A small fsync carries the staged data its extents reference inside the record, so
        // the record is its only write; a large one writes the members' data in place, in the
        // same batch as the record.
        let embedded = self.staged_data_ops(&ops)?;
        let embedding = embedded.is_some();
        if !embedding
            && self.dev.lent_for_writes()
            && members
                .iter()
                .map(|&ino| self.staged_bytes_of(ino))
                .sum::<usize>()
                > LENT_FSYNC_BYTES_MAX
        {
            // Too much to write in a caller's thread while the reactor waits for its engine.
            return Ok(FsyncStart::NeedsCommit);
        }
        let (data_ops, carried_runs) = embedded.unwrap_or_default();
        ops.extend(data_ops);
        // Any log held here will do (a record's ops name their own shards, and replay reads
        // every log in sequence order): the emptiest one, so one busy file spreads its records
        // over every shard's log instead of filling its own and forcing a commit (SQLite's WAL
        // on 64 shards committed every 28 transactions).
        let shard = self.emptiest_log();
        let blocks = record_blocks(ops.iter());
        let log_blocks = self.sb.log_half_blocks();
        if blocks > log_blocks {
            self.log.stats.fallback_too_big += 1;
            tracing::debug!(
                blocks,
                log_blocks,
                "fsync record larger than the log: committing"
            );
            return self.fsync_fallback();
        }
        if self.log.heads[shard as usize] + blocks > log_blocks {
            self.log.stats.fallback_log_full += 1;
            tracing::debug!(shard, "fsync log full: committing");
            return self.fsync_fallback();
        }
        let header = RecordHeader {
            blocks: 0,
            generation: self.commit.generation,
            global_seq: self.log.next_seq,
            shard_seq: self.log.shard_seqs[shard as usize],
            shard,
            stream: self.log.stream,
            op_count: 0,
            payload_bytes: 0,
            uuid: self.sb.uuid,
        };
        let bytes = encode_record(header, &ops);
        assert_eq!(bytes.len() as u64, blocks * BLOCK_BYTES as u64);
        let at = self.sb.log_start(shard, self.commit.generation) + self.log.heads[shard as usize];
        // Otherwise the members' staged data goes in place, in flight together with the
        // record. Embedded blocks stay staged for the commit.
        let data = if embedding {
            Vec::new()
        } else {
            self.take_staged(members.iter())
        };
        // How the writes become durable. A record that carries all its data is its only
        // write: written FUA it is durable when it completes — one device write per fsync, no
        // flush. A record with in-place data goes the same way on a device with native FUA:
        // every write FUA, the ticket durable when all complete (a crash before that leaves a
        // record whose data crcs fail: replay stops there, and its fsync had not returned).
        // Where FUA is emulated (a file: each FUA write is a write and a flush) those writes
        // go plain and one flush follows; so does any record when a data block was written in
        // place since the last flush was submitted (only a flush makes that block durable).
        // Records before it are durable first either way (tickets are released in order).
        let all_fua = data.is_empty() || nvme::BlockDevice::info(&*self.dev).fua_native;
        let ticket = if all_fua && !self.log.unflushed_writes {
            self.log.stats.fua_records += 1;
            self.submit_fua(record_and_data(at, bytes, data))?
        } else {
            self.submit_record(record_and_data(at, bytes, data))?
        };
        // The runs this record carries whole need not be carried again in this generation.
        self.mark_logged(&carried_runs);
        // Logged (durable once the ticket is): the coupled set's tracking starts over. Until
        // then an fsync finding nothing new waits for the newest ticket, so it cannot return
        // before the record holding its changes is durable.
        for ino in &members {
            if let Some(t) = self.log.inodes.remove(ino) {
                self.log.tracked_keys -= t.keys.len();
            }
            #[cfg(feature = "mutations")]
            self.log.logged_this_generation.insert(*ino);
        }
        self.log.heads[shard as usize] += blocks;
        self.log.shard_seqs[shard as usize] += 1;
        self.log.next_seq += 1;
        self.log.stats.log_writes += 1;
        self.log.stats.log_blocks += blocks;
        self.log.stats.inodes_logged += members.len() as u64;
        Ok(match self.commit_in_flight() {
            Some(generation) => FsyncStart::AfterCommit {
                ticket: Some(ticket),
                generation,
            },
            None => FsyncStart::Pending(ticket),
        })
    }

    pub fn log_stats(&self) -> LogStats {
        self.log.stats
    }

    /// Blocks left in the emptiest log half this mount holds: a record larger than this falls
    /// back to a commit (`fallback_log_full`).
    pub fn log_room_blocks(&self) -> u64 {
        let head = self.log.heads[self.emptiest_log() as usize];
        self.sb.log_half_blocks().saturating_sub(head)
    }

    /// The held shard whose log half has the most room.
    fn emptiest_log(&self) -> u32 {
        (0..self.shard_count())
            .filter(|&s| self.holds(s))
            .min_by_key(|&s| self.log.heads[s as usize])
            .expect("a partition that logs holds a shard")
    }

    /// Data ops for every staged block the record's extents reference that no earlier
    /// record of this generation carries, and the staged runs they cover whole (to mark
    /// once the record is on its way); None when there are more than [`EMBED_MAX_BLOCKS`]
    /// (then the data is written in place instead). An extent grown by an append references
    /// its earlier blocks again: those an earlier record carried replay from that record,
    /// which comes first in the stream.
    fn staged_data_ops(&self, ops: &[LogOp]) -> Result<Option<CarriedData>> {
        let mut data = Vec::new();
        let mut whole = Vec::new();
        let mut staged = Vec::new();
        for op in ops {
            let LogOp::Put(key, value) = op else { continue };
            if key.kind != ItemKind::ExtentData {
                continue;
            }
            let item = crate::format::items::ExtentItem::decode(value)
                .map_err(|why| EngineError::corrupt("extent item", key.objectid, why))?;
            if item.prealloc {
                continue;
            }
            staged.clear();
            self.unlogged_staged(
                key.objectid,
                item.disk_block,
                item.blocks as u64,
                &mut staged,
                &mut whole,
            );
            for &(block, bytes) in &staged {
                if data.len() == EMBED_MAX_BLOCKS {
                    return Ok(None);
                }
                data.push(LogOp::Data(block, bytes.to_vec()));
            }
        }
        Ok(Some((data, whole)))
    }

    /// The parents of `ino` (the directories holding its names). In a partition, an inode
    /// held elsewhere ends the walk up: its name and every name above it are durable or were
    /// changed by an operation that marked an inode here ([`crate::partition`]).
    fn parents_of(&mut self, ino: u64) -> Result<Vec<u64>> {
        let shard = self.shard_of(ino);
        if !self.holds(shard) {
            return Ok(Vec::new());
        }
        let refs = self.with_tree(shard, false, |tree, io| {
            tree.range(
                io,
                Key::new(ino, ItemKind::InodeRef, 0),
                Key::new(ino, ItemKind::XattrItem, 0),
            )
        })?;
        let mut parents = Vec::new();
        for (key, value) in refs {
            match key.kind {
                ItemKind::InodeRef => parents.push(key.offset),
                // Names past a full InodeRef item; their directory may have no InodeRef item
                // left once the names there are removed.
                ItemKind::InodeExtRef => parents.extend(
                    crate::format::items::decode_ext_refs(&value)
                        .map_err(|why| {
                            EngineError::corrupt_inode("extended back-reference", ino, why)
                        })?
                        .iter()
                        .map(|e| e.dir()),
                ),
                _ => {}
            }
        }
        parents.sort_unstable();
        parents.dedup();
        Ok(parents)
    }

    /// True when some ancestor of `ino` has an unlogged change of its own name.
    fn ancestor_pending(&mut self, ino: u64) -> Result<bool> {
        let mut seen = HashSet::new();
        let mut stack = self.parents_of(ino)?;
        while let Some(dir) = stack.pop() {
            if !seen.insert(dir) {
                continue;
            }
            if self.log.own_name_changed(dir) {
                return Ok(true);
            }
            if mutated!(AncestorWalkStopsEarly) {
                // Mutation check: stop at the first directory whose own name is durable.
                continue;
            }
            stack.extend(self.parents_of(dir)?);
        }
        Ok(false)
    }

    /// The inodes a record for `inos` must hold: closed under name coupling and reachability
    /// (see the module comment). Only inodes with tracked changes are members. None when the
    /// set reaches an inode changed across partitions (or coupled to one held elsewhere):
    /// only a commit makes that durable atomically.
    fn log_closure(&mut self, inos: &[u64]) -> Result<Option<BTreeSet<u64>>> {
        let mut members = BTreeSet::new();
        let mut walked = HashSet::new();
        let mut stack: Vec<u64> = inos.to_vec();
        while let Some(ino) = stack.pop() {
            if !members.insert(ino) {
                continue;
            }
            if self.log.cross.contains(&ino) || !self.holds(self.shard_of(ino)) {
                return Ok(None);
            }
            if let Some(t) = self.log.inodes.get(&ino) {
                stack.extend(t.links.iter().copied());
            }
            // Walk up from each name's directory; an ancestor whose own name changed joins
            // (with everything coupled to it), and the walk goes on above it either way.
            let mut up = self.parents_of(ino)?;
            while let Some(dir) = up.pop() {
                if !walked.insert(dir) {
                    continue;
                }
                if self.log.own_name_changed(dir) {
                    stack.push(dir);
                } else if mutated!(AncestorWalkStopsEarly) {
                    // Mutation check: stop at the first directory whose own name is durable.
                    continue;
                }
                up.extend(self.parents_of(dir)?);
            }
        }
        members.retain(|ino| self.log.inodes.contains_key(ino) && !self.log.relog_suppressed(*ino));
        Ok(Some(members))
    }

    /// The record's ops: each tracked key of each member with its current value (a pending
    /// directory index item counts as present) or its deletion.
    fn collect_ops(&mut self, members: &BTreeSet<u64>) -> Result<Vec<LogOp>> {
        let mut ops = Vec::new();
        for &ino in members {
            let keys: Vec<Key> = self.log.inodes[&ino]
                .keys
                .sorted()
                .into_iter()
                .map(|(kind, offset)| Key::new(ino, kind, offset))
                .collect();
            let shard = self.shard_of(ino);
            for key in keys {
                if key.kind == ItemKind::DirIndex {
                    if let Some((_, entry)) = self
                        .namespace
                        .delayed
                        .range(ino, key.offset)
                        .next()
                        .filter(|(s, _)| *s == key.offset)
                    {
                        ops.push(LogOp::Put(key, encode_names(std::slice::from_ref(entry))));
                        continue;
                    }
                }
                let value = self.with_tree(shard, false, |tree, io| tree.get(io, &key))?;
                ops.push(match value {
                    Some(value) => LogOp::Put(key, value),
                    None => LogOp::Delete(key),
                });
            }
        }
        Ok(ops)
    }
}

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
