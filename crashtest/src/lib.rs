//! Crash-consistency testing in the style of CrashMonkey/ACE and xfstests' dm-log-writes.
//!
//! A workload ([`workload`]) runs on a recording device, from an aged image (stale records of
//! earlier generations in both halves of every log area; [`Base`]: clean, or recovering —
//! records its first mount replays, so the run is a crash, a recovery, the workload and a
//! second crash) after a prelude that logs `foo` in the running generation, under each
//! [`Schedule`]: the engine's synchronous calls; fsyncs
//! pipelined as a reactor runs them (several records in flight); a commit in flight while
//! the workload's fsyncs log; full logs (every fsync falls back to a commit); background
//! write-back; two reactors. The crash state is rebuilt from the write log at every
//! persistence point, at every flush and every FUA write both before it completes and after,
//! and at the end, in every crash mode of [`nvme::wrap::crash`] (only durable writes; all
//! landed; a random subset; torn at sector granularity, FUA writes in flight included; one
//! sector damaged), mounted (which replays the logs), and checked against an oracle:
//! - every path persisted before the crash, and not changed since, has exactly its persisted
//!   state: data, size, mode, link count, names, symlink target, xattrs (fdatasync: data and
//!   size); a directory fsynced has its entries; after a sync (and from the synced image the
//!   run starts from) the whole tree is identical — or, for a crash inside persistence
//!   operations under way, what one of them was persisting;
//! - the tree checker passes;
//! - the filesystem is usable: a file can be created in every directory, then everything
//!   deleted, directories included, and the checker passes again.
//!
//! The oracle's expected states are snapshots of the live filesystem taken when each
//! persistence operation started (what it persists) and acknowledged, so the crash test
//! checks durability; the POSIX model tests check semantics. The starting state is the tree
//! the base's builder held, not what the base's mount shows (the first check compares them).
//!
//! Mutation checks (`tests/mutations.rs`, and `corefs crashtest` built with
//! `--features mutations` and run with `COREFS_MUTATION=NAME`): each guard of the fsync log
//! removed in [`engine::mutation`] fails a run.

mod check;
mod live;
pub mod reactors;
mod snapshot;
pub mod workload;

mod base;
pub use base::{base_image, Base, BaseKind, GROUP_BLOCKS, RECOVERY_CHANGES};
pub(crate) use base::{config, mount_options};
pub(crate) use check::check_points;
use live::callers;
pub use live::Live;
pub(crate) use snapshot::{data_of, names_of, summarize};
pub use snapshot::{snapshot, Entry, Tree};

use engine::log::FsyncStart;
use engine::{EngineError, FallocateMode, Filesystem, MountOptions, XattrFlags};
use nvme::backend::mem::MemDevice;
use nvme::wrap::{Record, RecordingDevice};
use std::cell::RefCell;
use workload::{Falloc, Step};

/// What one persistence point promises.
#[derive(Debug, Clone)]
pub(crate) enum Promise {
    /// fsync of a file or symlink: the whole entry; of a directory: its names.
    Whole(String, Option<Entry>),
    /// fdatasync: data and size only.
    Data(String, Option<Vec<u8>>),
    /// sync (and the synced image every run starts from): the whole tree.
    All(Tree),
}

/// One persistence point: when it was acknowledged (the write-log length then), when its
/// operation started (from there on what it persists may be on the way), what it promised, and
/// the live tree it persists.
#[derive(Debug, Clone)]
pub(crate) struct Point {
    pub at: usize,
    pub started_at: usize,
    pub promise: Promise,
    pub tree: Tree,
}

/// How a workload is driven. Each exposes crash states the others cannot: together they put
/// records in flight at every cut, several at once, during a commit and beside background
/// write-back, and they run the commit fallback and the reactors' code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// The engine's synchronous calls: each fsync returns once its record is durable.
    Plain,
    /// Every fsync is started and not waited for ([`Filesystem::fsync_group_start`], as a
    /// reactor does): the prelude's second record is still in flight when the workload
    /// starts, so several records are in flight at once and acknowledged in order as the
    /// engine reports them durable.
    Pipelined,
    /// A commit of the prelude is in flight (started, not finished) while the workload runs:
    /// its fsyncs log for the next generation and are acknowledged when the engine says so.
    CommitInFlight,
    /// The workload's changes before its first persistence operation are caught by a commit
    /// started just before it, which stays in flight while the rest runs: that fsync finds
    /// its changes in the commit (nothing new to log) and must wait for its superblock.
    CommitCatches,
    /// Every log half is full before the workload: each fsync that has something to log falls
    /// back to a commit.
    Fallback,
    /// Background write-back from the first staged byte: a write's data goes to its place in
    /// the background, and records wait for it.
    Writeback,
    /// Two reactors, through the client API ([`reactors`]).
    Reactors,
    /// As `Plain`, with every write and fsync run as a client runs them on a lent engine:
    /// staged by the caller, records written and flushed synchronously beside the device's
    /// queue ([`Filesystem::fsync_beside`]), the owner's path where those decline.
    Callers,
}

impl Schedule {
    pub const ALL: [Schedule; 8] = [
        Schedule::Plain,
        Schedule::Pipelined,
        Schedule::CommitInFlight,
        Schedule::CommitCatches,
        Schedule::Fallback,
        Schedule::Writeback,
        Schedule::Reactors,
        Schedule::Callers,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Schedule::Plain => "plain",
            Schedule::Pipelined => "pipelined",
            Schedule::CommitInFlight => "commit-in-flight",
            Schedule::CommitCatches => "commit-catches",
            Schedule::Fallback => "fallback",
            Schedule::Writeback => "writeback",
            Schedule::Reactors => "reactors",
            Schedule::Callers => "callers",
        }
    }

    pub fn from_name(name: &str) -> Option<Schedule> {
        Schedule::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What every run does after mounting, before the workload, in the same generation: a 4 KiB
/// append to `foo`, fsynced. So `foo` is already logged in this generation (a later change
/// to it must be logged again), and the workload's records follow one in the log.
pub const PRELUDE: [Step; 2] = [
    Step::Write {
        path: "foo",
        offset: 0,
        len: 4096,
        append: true,
    },
    Step::Fsync("foo"),
];

/// The outcome of one workload.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    /// Runs (one per schedule).
    pub runs: u64,
    pub crash_states: u64,
    /// Crash states with a write in flight (submitted, not completed) at the cut.
    pub in_flight_states: u64,
    pub persistence_points: u64,
    /// How the workload's persistence points were served: log records written, fsyncs that
    /// found nothing new, fsyncs that fell back to a commit.
    pub log_writes: u64,
    pub already_logged: u64,
    pub fallback_commits: u64,
    /// Records acknowledged with another record in flight, and records logged while a commit
    /// was in flight.
    pub pipelined_records: u64,
    pub records_during_commit: u64,
    /// fsyncs run by a caller, their records written beside the queue (callers schedule).
    pub lent_fsyncs: u64,
    /// Staged data written back in the background.
    pub writeback_bytes: u64,
    /// Block groups shards took from the pool and gave back to it (engine schedules).
    pub groups_taken: u64,
    pub groups_returned: u64,
}

impl Outcome {
    pub fn add(&mut self, other: &Outcome) {
        self.runs += other.runs;
        self.crash_states += other.crash_states;
        self.in_flight_states += other.in_flight_states;
        self.persistence_points += other.persistence_points;
        self.log_writes += other.log_writes;
        self.already_logged += other.already_logged;
        self.fallback_commits += other.fallback_commits;
        self.pipelined_records += other.pipelined_records;
        self.records_during_commit += other.records_during_commit;
        self.lent_fsyncs += other.lent_fsyncs;
        self.writeback_bytes += other.writeback_bytes;
        self.groups_taken += other.groups_taken;
        self.groups_returned += other.groups_returned;
    }

    pub(crate) fn with_log(mut self, stats: &engine::log::LogStats) -> Outcome {
        self.log_writes += stats.log_writes;
        self.already_logged += stats.already_logged;
        self.fallback_commits += stats.fallback_commits();
        self.writeback_bytes += stats.writeback_bytes;
        self
    }
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

fn pattern(seed: &str, len: usize) -> Vec<u8> {
    let salt = seed
        .bytes()
        .fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ salt ^ (i >> 9) as u8)
        .collect()
}

/// Applies one operation; errors (a name that does not exist, a non-empty directory...) are
/// part of the workload's meaning and are ignored, as a real program's would be.
pub(crate) fn apply<F: Live>(fs: &mut F, op: &Step) -> Result<(), EngineError> {
    fn lookup<F: Live>(fs: &mut F, path: &str) -> Result<u64, EngineError> {
        fs.resolve(path)
    }
    fn parent_of<F: Live>(
        fs: &mut F,
        path: &'static str,
    ) -> Result<(u64, &'static str), EngineError> {
        let (parent, name) = split(path);
        Ok((fs.resolve(parent)?, name))
    }
    match *op {
        Step::Creat(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.create(dir, name.as_bytes())
        }
        Step::Mkdir(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.mkdir(dir, name.as_bytes())
        }
        Step::Falloc {
            path,
            mode,
            offset,
            len,
        } => {
            let ino = lookup(fs, path)?;
            let mode = match mode {
                Falloc::KeepSize => FallocateMode {
                    keep_size: true,
                    ..Default::default()
                },
                Falloc::PunchHole => FallocateMode {
                    keep_size: true,
                    punch_hole: true,
                    ..Default::default()
                },
                Falloc::ZeroRange => FallocateMode {
                    zero_range: true,
                    ..Default::default()
                },
            };
            fs.fallocate(ino, mode, offset, len)
        }
        Step::Write {
            path,
            offset,
            len,
            append,
        } => {
            let ino = lookup(fs, path)?;
            let at = if append { fs.stat(ino)?.size } else { offset };
            fs.write(ino, at, &pattern(&format!("{path}{at}"), len as usize))
        }
        Step::Link(a, b) => {
            let ino = lookup(fs, a)?;
            let (dir, name) = parent_of(fs, b)?;
            fs.link(ino, dir, name.as_bytes())
        }
        Step::Unlink(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.unlink(dir, name.as_bytes())
        }
        Step::Remove(p) => {
            let (dir, name) = parent_of(fs, p)?;
            match fs.rmdir(dir, name.as_bytes()) {
                Err(EngineError::NotDir) => fs.unlink(dir, name.as_bytes()),
                other => other,
            }
        }
        Step::Rename(a, b) => {
            let (src, sname) = parent_of(fs, a)?;
            let (dst, dname) = parent_of(fs, b)?;
            fs.rename(src, sname.as_bytes(), dst, dname.as_bytes())
        }
        Step::SetXattr(p, v) => {
            let ino = lookup(fs, p)?;
            fs.setxattr(ino, b"user.ace", &[v; 40])
        }
        Step::RemoveXattr(p) => {
            let ino = lookup(fs, p)?;
            fs.removexattr(ino, b"user.ace")
        }
        Step::Truncate(p, size) => {
            let ino = lookup(fs, p)?;
            fs.truncate(ino, size)
        }
        Step::Symlink(p) => {
            let (dir, name) = parent_of(fs, p)?;
            fs.symlink(dir, name.as_bytes(), b"foo")
        }
        Step::Fsync(p) => {
            let ino = lookup(fs, p)?;
            fs.fsync(ino)
        }
        Step::Fdatasync(p) => {
            let ino = lookup(fs, p)?;
            fs.fdatasync(ino)
        }
        Step::Sync => fs.sync(),
    }
}

/// Runs one workload under every [`Schedule`] and checks every crash state. `Err` describes
/// the first violation, with the schedule.
pub fn run(base: &Base, ops: &[Step], seed: u64) -> Result<Outcome, String> {
    run_schedules(base, ops, seed, &Schedule::ALL)
}

/// [`run`] under the given schedules.
pub fn run_schedules(
    base: &Base,
    ops: &[Step],
    seed: u64,
    schedules: &[Schedule],
) -> Result<Outcome, String> {
    let mut total = Outcome::default();
    for &schedule in schedules {
        let outcome = run_schedule(base, ops, seed, schedule)
            .map_err(|why| format!("[{}] {why}", schedule.name()))?;
        total.add(&outcome);
    }
    Ok(total)
}

/// Runs one workload under one schedule and checks every crash state.
pub fn run_schedule(
    base: &Base,
    ops: &[Step],
    seed: u64,
    schedule: Schedule,
) -> Result<Outcome, String> {
    if schedule == Schedule::Reactors {
        return reactors::run_on_reactors(base, ops, seed, 2);
    }
    let (dev, log) = RunDevice::take(&base.image)?;
    let options = MountOptions {
        writeback_start_bytes: if schedule == Schedule::Writeback {
            0
        } else {
            mount_options().writeback_start_bytes
        },
        // A commit's trees are written a node per slice, so the workload's changes land
        // between any two of its nodes.
        commit_slice_nodes: 1,
        ..mount_options()
    };
    let mut fs = Filesystem::mount(dev, options).map_err(|e| e.to_string())?;
    let _callers = callers::Guard::set(schedule == Schedule::Callers);
    let mounted = log.len();
    let mut points = vec![base_point(&mut fs, base)?];
    let mut outcome = Outcome {
        runs: 1,
        ..Default::default()
    };
    let mut skip: Vec<std::ops::Range<usize>> = Vec::new();
    let from = match schedule {
        Schedule::Pipelined | Schedule::CommitInFlight | Schedule::CommitCatches => {
            let mut driver = Pipeline::default();
            driver.run(&mut fs, &PRELUDE, &log, &mut points)?;
            if schedule == Schedule::CommitInFlight {
                // The prelude's record durable, its change (logged, not committed) is committed
                // in the background while the workload runs.
                driver.finish(&mut fs, &log, &mut points)?;
                fs.commit_start()
                    .map_err(|e| format!("commit start: {e}"))?;
            }
            // Pipelined: the prelude's record (the first after mount: written, then flushed)
            // is still in flight as the workload's records follow it.
            let from = log.len();
            let caught = if schedule == Schedule::CommitCatches {
                driver.finish(&mut fs, &log, &mut points)?;
                let first = ops
                    .iter()
                    .position(|op| matches!(op, Step::Fsync(_) | Step::Fdatasync(_) | Step::Sync))
                    .unwrap_or(ops.len());
                driver.run(&mut fs, &ops[..first], &log, &mut points)?;
                fs.commit_start()
                    .map_err(|e| format!("commit start: {e}"))?;
                first
            } else {
                0
            };
            driver.run(&mut fs, &ops[caught..], &log, &mut points)?;
            driver.finish(&mut fs, &log, &mut points)?;
            outcome.pipelined_records = driver.pipelined;
            outcome.records_during_commit = driver.during_commit;
            from
        }
        _ => {
            points.extend(run_ops(&mut fs, &PRELUDE, &log)?);
            let fallback = schedule == Schedule::Fallback;
            // Cuts inside a filling are not checked (its fsyncs are not points; the last one's
            // state is promised at its end).
            let mut fillings: Vec<std::ops::Range<usize>> = Vec::new();
            let mut fill = |fs: &mut Filesystem, points: &mut Vec<Point>| -> Result<(), String> {
                let start = log.len();
                // Each filling fsync is a point (a cut just before the filling may show its
                // first record landed).
                fill_logs(
                    fs,
                    &mut |fs, started_at| {
                        let at = log.len();
                        points.push(persistence_point(fs, &Step::Fsync(""), started_at, at)?);
                        Ok(())
                    },
                    &log,
                )?;
                fillings.push(start + 1..log.len());
                Ok(())
            };
            if fallback {
                fill(&mut fs, &mut points)?;
            }
            let from = log.len();
            for op in ops {
                let logged = fs.log_stats().log_writes;
                points.extend(run_ops(&mut fs, std::slice::from_ref(op), &log)?);
                if fallback && fs.log_stats().log_writes != logged {
                    return Err(format!("{op:?} logged into a full log"));
                }
                // A commit (a sync, a fallback) empties the logs: full again for what follows.
                if fallback && fs.log_room_blocks() > 0 {
                    fill(&mut fs, &mut points)?;
                }
            }
            skip.extend(fillings);
            from
        }
    };
    let stats = fs.log_stats();
    let pool = fs.space_pool().stats();
    outcome.lent_fsyncs = fs.fetch_stats().lent_fsyncs;
    if schedule == Schedule::Callers
        && outcome.lent_fsyncs == 0
        && ops
            .iter()
            .any(|op| matches!(op, Step::Fsync(_) | Step::Fdatasync(_)))
    {
        return Err("no fsync ran beside the queue".into());
    }
    let (records, submissions) = log.take();
    RunDevice::give_back(&base.image, fs.into_device(), log, &submissions);
    let mut outcome = outcome.with_log(&stats);
    outcome.groups_taken += pool.taken;
    outcome.groups_returned += pool.returned;
    skip.push(unchecked_prelude(base, mounted, from));
    check_points(
        &base.image,
        &records,
        &submissions,
        &points,
        &skip,
        seed,
        outcome,
    )
}

/// The recording memory device runs use, kept per thread between runs and put back to the
/// base image by undoing what each run wrote: a fresh 4 MiB mapping per run spent more time in
/// page faults than the run itself.
struct RunDevice {
    base_crc: u32,
    device: Box<dyn nvme::BlockDevice>,
    log: std::sync::Arc<nvme::wrap::WriteLog>,
}

thread_local! {
    static RUN_DEVICE: RefCell<Option<RunDevice>> = const { RefCell::new(None) };
}

impl RunDevice {
    /// A recording device holding `base`, with an empty write log.
    fn take(
        base: &[u8],
    ) -> Result<
        (
            Box<dyn nvme::BlockDevice>,
            std::sync::Arc<nvme::wrap::WriteLog>,
        ),
        String,
    > {
        let base_crc = crc32c::crc32c(base);
        if let Some(kept) = RUN_DEVICE.take() {
            if kept.base_crc == base_crc && kept.log.is_empty() {
                return Ok((kept.device, kept.log));
            }
        }
        let recording =
            RecordingDevice::new(MemDevice::from_image(base, config()).map_err(|e| e.to_string())?);
        let log = recording.log();
        Ok((Box::new(recording), log))
    }

    /// Keeps `device` for the next run, with every LBA `written` put back as in `base`.
    fn give_back(
        base: &[u8],
        mut device: Box<dyn nvme::BlockDevice>,
        log: std::sync::Arc<nvme::wrap::WriteLog>,
        written: &[nvme::wrap::Submission],
    ) {
        if device.in_flight() > 0 {
            return;
        }
        let sim = device.sim_access().expect("a memory device");
        for r in written.iter().filter_map(|s| lbas_of(&s.record)) {
            let (from, to) = (r.start as usize * 512, r.end as usize * 512);
            sim.sim_write(r.start, &base[from..to]);
        }
        let (records, submissions) = log.take();
        if records.is_empty() && submissions.is_empty() {
            RUN_DEVICE.set(Some(RunDevice {
                base_crc: crc32c::crc32c(base),
                device,
                log,
            }));
        }
    }
}

/// The 512-byte LBAs a write covers.
fn lbas_of(record: &Record) -> Option<std::ops::Range<u64>> {
    match record {
        Record::Write { lba, data, .. } => Some(*lba..*lba + (data.len() / 512) as u64),
        Record::WriteZeroes { lba, lbas } | Record::Deallocate { lba, lbas } => {
            Some(*lba..*lba + *lbas as u64)
        }
        Record::Flush { .. } => None,
    }
}

/// The paths that exist after `ops` run on `base` (errors ignored, as in a workload): what
/// the workload generator's model of names is checked against.
pub fn live_paths_after(base: &Base, ops: &[Step]) -> Result<Vec<String>, String> {
    let dev = MemDevice::from_image(&base.image, config()).map_err(|e| e.to_string())?;
    let mut fs = Filesystem::mount(Box::new(dev), mount_options()).map_err(|e| e.to_string())?;
    for op in ops {
        let _ = apply(&mut fs, op);
    }
    let tree = snapshot(&mut fs).map_err(|e| e.to_string())?;
    Ok(tree.into_keys().collect())
}

/// The image a run starts from: a promise of the whole tree at cut 0, the tree the base was
/// built with; the first mount must show exactly that (a recovering base's first mount
/// replays every record of it).
pub(crate) fn base_point<F: Live>(fs: &mut F, base: &Base) -> Result<Point, String> {
    let tree = snapshot(fs).map_err(|e| format!("snapshot of the base: {e}"))?;
    if tree != base.tree {
        let differs: Vec<String> = base
            .tree
            .keys()
            .chain(tree.keys())
            .filter(|p| base.tree.get(*p) != tree.get(*p))
            .map(|p| {
                format!(
                    "{p}: {} (built) vs {} (mounted)",
                    summarize(base.tree.get(p)),
                    summarize(tree.get(p))
                )
            })
            .collect();
        return Err(format!(
            "the {} base's first mount is not the tree that wrote it: {}",
            base.kind.name(),
            differs.join("; ")
        ));
    }
    Ok(Point {
        at: 0,
        started_at: 0,
        promise: Promise::All(base.tree.clone()),
        tree,
    })
}

/// The cuts a run does not check: the prelude's (the same for every workload). A recovering
/// base's first mount (its replay and the replay's commit, from cut 0 to `mounted`) is
/// checked: a crash there must replay to the same tree.
pub(crate) fn unchecked_prelude(
    base: &Base,
    mounted: usize,
    from: usize,
) -> std::ops::Range<usize> {
    match base.kind {
        BaseKind::Clean => 0..from,
        BaseKind::Recovering => mounted..from,
    }
}

/// Logs one-block records (an xattr of the root changed, fsynced: the root is never renamed,
/// and after a commit nothing is coupled to it) until every log half is full, so the
/// workload's fsyncs fall back to commits. `fsynced(fs, started_at)` is called after each
/// fsync, with the write-log length before it.
fn fill_logs(
    fs: &mut Filesystem,
    fsynced: &mut dyn FnMut(&mut Filesystem, usize) -> Result<(), String>,
    log: &nvme::wrap::WriteLog,
) -> Result<(), String> {
    let ino = fs.root();
    // Each record takes one block of the emptiest log; a bound well past every log's size.
    for value in 0..4096u32 {
        if fs.log_room_blocks() == 0 {
            return Ok(());
        }
        let before = fs.log_stats();
        let started_at = log.len();
        fs.setxattr(ino, b"user.fill", &value.to_le_bytes(), XattrFlags::Any)
            .and_then(|()| fs.fsync(ino))
            .map_err(|e| format!("filling the logs: {e}"))?;
        let after = fs.log_stats();
        if after.fallback_commits() != before.fallback_commits()
            || after.log_blocks != before.log_blocks + 1
        {
            // The change must be logged, in one block of a log with room for it.
            return Err(format!(
                "filling the logs: fsync(/) after changing its xattr wrote {} log blocks and {} \
                 fallback commits, not one block (zero: it returned with nothing durable)",
                after.log_blocks - before.log_blocks,
                after.fallback_commits() - before.fallback_commits()
            ));
        }
        fsynced(fs, started_at)?;
    }
    Err("filling the logs: they never filled".into())
}

/// Applies `ops` through the engine's synchronous calls (or a reactor client), recording a
/// persistence point as each persistence operation returns.
pub(crate) fn run_ops<F: Live>(
    fs: &mut F,
    ops: &[Step],
    log: &nvme::wrap::WriteLog,
) -> Result<Vec<Point>, String> {
    run_ops_committing(fs, ops, log, |_, _| false)
}

/// Fails on an error no workload may meet; persistence operations must succeed (every one
/// names an existing path: [`workload`] makes sure of it).
fn check_result(op: &Step, result: &Result<(), EngineError>) -> Result<(), String> {
    match result {
        Err(
            e @ (EngineError::Device(_)
            | EngineError::Corrupt { .. }
            | EngineError::ReadOnly(_)
            | EngineError::NoSpace),
        ) => Err(format!("{op:?} failed: {e}")),
        Err(e) if op.is_persistence() => Err(format!("{op:?} failed: {e}")),
        _ => Ok(()),
    }
}

/// As [`run_ops`], where `commits(fs, op)` says that `op`, which just succeeded, committed the
/// whole filesystem before returning (a directory rename with several reactors): a point
/// promising the whole tree, like a sync.
pub(crate) fn run_ops_committing<F: Live>(
    fs: &mut F,
    ops: &[Step],
    log: &nvme::wrap::WriteLog,
    commits: impl Fn(&mut F, &Step) -> bool,
) -> Result<Vec<Point>, String> {
    let mut points: Vec<Point> = Vec::new();
    for op in ops {
        let started_at = log.len();
        let result = apply(fs, op);
        if result.is_ok() && commits(fs, op) {
            points.push(persistence_point(fs, &Step::Sync, started_at, log.len())?);
            continue;
        }
        check_result(op, &result)?;
        if op.is_persistence() {
            points.push(persistence_point(fs, op, started_at, log.len())?);
        }
    }
    Ok(points)
}

/// The live state and promise of persistence operation `op`, which started at `started_at`
/// and is acknowledged at `at`; the live tree is what it persists.
pub(crate) fn persistence_point<F: Live>(
    fs: &mut F,
    op: &Step,
    started_at: usize,
    at: usize,
) -> Result<Point, String> {
    let tree = snapshot(fs).map_err(|e| format!("snapshot after {op:?}: {e}"))?;
    let promise = match op {
        Step::Sync => Promise::All(tree.clone()),
        Step::Fsync(p) => Promise::Whole(p.to_string(), tree.get(*p).cloned()),
        Step::Fdatasync(p) => Promise::Data(p.to_string(), data_of(tree.get(*p))),
        _ => unreachable!("persistence op"),
    };
    Ok(Point {
        at,
        started_at,
        promise,
        tree,
    })
}

/// When a started fsync counts as durable.
enum Ack {
    /// At once (nothing new, nothing in flight).
    Now,
    /// When the engine reports this ticket durable.
    Ticket(u64),
    /// When this generation is SuperCommitted.
    Generation(u64),
}

/// Drives the engine as a reactor does: fsyncs started without waiting
/// ([`Filesystem::fsync_group_start`]), acknowledged in start order as
/// [`Filesystem::log_progress`] reports them durable. Nothing is polled until
/// [`Pipeline::finish`] (or a sync), so every record started stays in flight until then: a
/// record written and not yet flushed beside a later FUA one, a commit's blocks and
/// superblock beside a record logged for the next generation.
#[derive(Default)]
struct Pipeline {
    waiting: std::collections::VecDeque<(Ack, Point)>,
    /// Records started while an earlier one was waiting, and records started while a commit
    /// was in flight.
    pipelined: u64,
    during_commit: u64,
}

impl Pipeline {
    fn run(
        &mut self,
        fs: &mut Filesystem,
        ops: &[Step],
        log: &nvme::wrap::WriteLog,
        points: &mut Vec<Point>,
    ) -> Result<(), String> {
        for op in ops {
            match op {
                Step::Fsync(_) | Step::Fdatasync(_) => self.start(fs, op, log)?,
                _ => self.apply(fs, op, log, points)?,
            }
        }
        Ok(())
    }

    /// A core operation or a sync (which commits: everything started before it is durable
    /// when it returns).
    fn apply(
        &mut self,
        fs: &mut Filesystem,
        op: &Step,
        log: &nvme::wrap::WriteLog,
        points: &mut Vec<Point>,
    ) -> Result<(), String> {
        let started_at = log.len();
        let result = apply(fs, op);
        check_result(op, &result)?;
        if *op == Step::Sync {
            self.progress(fs, false, log, points)?;
            if !self.waiting.is_empty() {
                return Err("a sync returned before the fsyncs started ahead of it".into());
            }
            points.push(persistence_point(fs, op, started_at, log.len())?);
        }
        Ok(())
    }

    /// Starts an fsync or fdatasync; its point is taken now (what it persists) and
    /// acknowledged later.
    fn start(
        &mut self,
        fs: &mut Filesystem,
        op: &Step,
        log: &nvme::wrap::WriteLog,
    ) -> Result<(), String> {
        let (path, datasync) = match op {
            Step::Fsync(p) => (*p, false),
            Step::Fdatasync(p) => (*p, true),
            _ => unreachable!("an fsync"),
        };
        let started_at = log.len();
        let ino = fs
            .resolve(path)
            .map_err(|e| format!("{op:?} failed: {e}"))?;
        let point = persistence_point(fs, op, started_at, 0)?;
        fs.check_exists(ino)
            .map_err(|e| format!("{op:?} failed: {e}"))?;
        let writes = fs.log_stats().log_writes;
        let start = fs
            .fsync_group_start(&[(ino, datasync)])
            .map_err(|e| format!("{op:?} failed: {e}"))?;
        let logged = fs.log_stats().log_writes > writes;
        if logged && !self.waiting.is_empty() {
            self.pipelined += 1;
        }
        let ack = match start {
            FsyncStart::Durable => Ack::Now,
            FsyncStart::Pending(ticket) => Ack::Ticket(ticket),
            FsyncStart::AfterCommit { ticket, generation } => {
                self.during_commit += logged as u64;
                match ticket {
                    Some(ticket) => Ack::Ticket(ticket),
                    None => Ack::Generation(generation),
                }
            }
            FsyncStart::NeedsCommit => return Err("a whole mount was asked for a commit".into()),
        };
        self.waiting.push_back((ack, point));
        Ok(())
    }

    /// Polls the engine and acknowledges what it reports durable, in start order: after the
    /// log's progress, and again after the commit's (which polls the log too), before
    /// anything else is polled, so an acknowledgement is noted as early as a reactor would
    /// release its waiter.
    fn progress(
        &mut self,
        fs: &mut Filesystem,
        wait: bool,
        log: &nvme::wrap::WriteLog,
        points: &mut Vec<Point>,
    ) -> Result<(), String> {
        let wait = wait.then_some(std::time::Duration::from_millis(1));
        let durable_below = fs
            .log_progress(wait)
            .map_err(|e| format!("log progress: {e}"))?;
        self.release(fs, durable_below, log, points);
        fs.commit_progress(None)
            .map_err(|e| format!("commit progress: {e}"))?;
        self.release(fs, fs.log_durable_below(), log, points);
        Ok(())
    }

    fn release(
        &mut self,
        fs: &Filesystem,
        durable_below: u64,
        log: &nvme::wrap::WriteLog,
        points: &mut Vec<Point>,
    ) {
        while let Some((ack, _)) = self.waiting.front() {
            let done = match *ack {
                Ack::Now => true,
                Ack::Ticket(ticket) => ticket < durable_below,
                Ack::Generation(generation) => fs.durable_generation() >= generation,
            };
            if !done {
                break;
            }
            let (_, mut point) = self.waiting.pop_front().expect("front");
            point.at = log.len();
            points.push(point);
        }
    }

    /// Carries everything started to durable.
    fn finish(
        &mut self,
        fs: &mut Filesystem,
        log: &nvme::wrap::WriteLog,
        points: &mut Vec<Point>,
    ) -> Result<(), String> {
        for _ in 0..100_000 {
            if self.waiting.is_empty() && fs.commit_in_flight().is_none() {
                return Ok(());
            }
            self.progress(fs, true, log, points)?;
        }
        Err("records in flight never became durable".into())
    }
}
