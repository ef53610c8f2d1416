//! Deterministic simulation: the reactor's own batch, fsync-group, commit and completion code
//! driven in one thread by a seeded scheduler, with clients as state machines, on a simulated
//! device with seeded faults (EIO on reads, writes and flushes, armed by the scheduler) and
//! recorded I/O; after the run,
//! crash images are cut at random points of the I/O and at the end, in both crash modes, and
//! each is mounted, checked, and compared with what clients were told was durable. Any run
//! replays from its seed (`corefs sim --seed N`).
//!
//! Determinism: no threads, the memory device completes synchronously, the fault wrapper
//! draws from the seed, mkfs takes its uuid and name-hash key from the seed (a random key
//! lays directories out differently in every process), and the commit timer is set beyond the run so commits come only from
//! the dirty limit and the log's fill, which depend on the operations alone.
//!
//! The oracle: each client appends blocks whose bytes are a function of (client, file, block)
//! and fsyncs (or fdatasyncs) after each; when it *observes* an fsync's success it notes the
//! recorded I/O's length then. A crash cut at or after that length must show the file with at
//! least that many blocks, each with its expected bytes. After a device error the filesystem
//! must refuse further changes, and the oracle still holds for what was acknowledged.

use crate::client::Client;
use crate::op::{Op, Reply};
use crate::queue::{Request, Shared};
use crate::runtime::Reactor;
use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image, CrashMode, FaultConfig, FaultDevice, RecordingDevice};
use nvme::BlockDevice;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    pub clients: usize,
    pub steps: usize,
    /// Probability per scheduler step of arming a one-shot EIO on the next read, write or
    /// flush (0: none).
    pub eio_rate: f64,
    /// Crash cuts checked besides the final state.
    pub crash_cuts: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 1,
            clients: 4,
            steps: 600,
            eio_rate: 0.0,
            crash_cuts: 6,
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimOutcome {
    pub batches: u64,
    pub fsyncs_acknowledged: u64,
    /// fsyncs that failed (a device error was injected under them or before them).
    pub fsyncs_failed: u64,
    /// Reads of acknowledged blocks that returned exactly the bytes written, and reads that
    /// failed with an error (a detected fault); a read returning other bytes is a violation.
    pub reads_verified: u64,
    pub reads_failed: u64,
    /// Rewrites of acknowledged blocks (same bytes, new blocks) whose fsync was acknowledged.
    pub rewrites_acknowledged: u64,
    /// One-shot device errors armed (each fails the next read, write or flush).
    pub faults_armed: u64,
    pub failed_stop: bool,
    pub crash_states: u64,
    /// Runs that failed stop (when outcomes are summed over seeds).
    pub runs_failed_stop: u64,
    /// Requests parked for tree nodes (odd seeds run with a metadata cache of 24 nodes,
    /// so lookups miss and requests resume in whatever order the scheduler reaches them).
    pub meta_parks: u64,
    /// Writes parked for staging room (seeds 2 and 3 mod 4 stage one block at most before
    /// writes park, and resume as write-backs complete).
    pub room_parks: u64,
    /// Listings of the root directory that held every client's files and all the filler
    /// files or none (odd seeds: 1,500 fillers over leaves the small cache misses, so the walk
    /// parks and reads ahead, resumed in whatever order the scheduler picks).
    pub readdirs_verified: u64,
    /// Tree nodes read ahead of a walk ([`engine::FetchStats::blocks_ahead`]).
    pub nodes_read_ahead: u64,
    /// Block groups shards took from the pool and gave back to it (the image has small
    /// groups, [`GROUP_BLOCKS`], so the seeded faults land around hand-overs too).
    pub groups_taken: u64,
    pub groups_returned: u64,
}

impl SimOutcome {
    /// Adds one run's outcome to a sum over seeds.
    pub fn add(&mut self, run: &SimOutcome) {
        self.batches += run.batches;
        self.fsyncs_acknowledged += run.fsyncs_acknowledged;
        self.fsyncs_failed += run.fsyncs_failed;
        self.reads_verified += run.reads_verified;
        self.reads_failed += run.reads_failed;
        self.rewrites_acknowledged += run.rewrites_acknowledged;
        self.faults_armed += run.faults_armed;
        self.failed_stop |= run.failed_stop;
        self.crash_states += run.crash_states;
        self.runs_failed_stop += run.failed_stop as u64;
        self.meta_parks += run.meta_parks;
        self.room_parks += run.room_parks;
        self.readdirs_verified += run.readdirs_verified;
        self.nodes_read_ahead += run.nodes_read_ahead;
        self.groups_taken += run.groups_taken;
        self.groups_returned += run.groups_returned;
    }
}

const CAPACITY: u64 = 32 << 20;

/// Block groups of the simulated image: 64 KiB, so clients' writes take groups from the pool
/// and deletes give them back all through a run.
pub const GROUP_BLOCKS: u64 = 16;
const FILES: usize = 2;
/// Files made before the run on odd seeds, so that the trees outgrow the small cache.
const FILLER_FILES: usize = 1500;
const BLOCK: usize = 4096;

fn mem_config() -> MemConfig {
    MemConfig {
        capacity_bytes: CAPACITY,
        lba_size_bytes: 4096,
        queue_depth: 64,
        buf_bytes: 128 << 10,
        buf_count: 128,
    }
}

fn block(client: usize, file: usize, index: u64) -> Vec<u8> {
    let tag = (client as u64) << 40 | (file as u64) << 32 | index;
    (0..BLOCK as u64)
        .map(|i| {
            (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left((i % 61) as u32)
                ^ i) as u8
        })
        .collect()
}

/// A simulated client: its files and where it is.
struct SimClient {
    client: Client,
    inos: Vec<u64>,
    /// A scratch file of 64 KiB appends, truncated to nothing and synced now and then: its
    /// blocks come and go in whole groups, so shards take groups and give them back under the
    /// faults. The oracle does not check its bytes (the checker checks its space).
    scratch: u64,
    scratch_blocks: u64,
    /// Blocks appended per file (the next index).
    written: Vec<u64>,
    /// (file, block index) of the write + fsync, or of the read, in flight.
    in_flight: Option<(usize, u64)>,
    write_ok: bool,
    stopped: bool,
}

/// (recorded I/O length when observed, client, file, blocks durable)
type Ack = (usize, usize, usize, u64);

/// One scheduler step of the reactor: a batch, then (with `tick`) its timers and the device
/// (reads parked on it are answered there); without, parked reads stay parked across steps
/// and resume at a later one, in whatever order the scheduler reaches them.
fn step_reactor(reactor: &mut Reactor, shared: &Shared, batch_max: usize, tick: bool) -> bool {
    reactor.looked();
    let mut batch: Vec<Request> = Vec::new();
    while batch.len() < batch_max {
        match shared.requests.pop() {
            Some(r) => batch.push(r),
            None => break,
        }
    }
    if batch.is_empty() && !reactor.meta.has_resumed() {
        let had = reactor.pending_groups() > 0;
        reactor.poll_durable(None);
        // An idle turn takes a commit step too, as the reactor's loop does: a sync that
        // came in the last batch waits for the commit's next steps.
        if tick {
            reactor.tick();
        }
        return had;
    }
    reactor.run_batch(&mut batch);
    if tick {
        reactor.tick();
    }
    true
}

/// Runs one seed. An error describes the violation, with the seed.
pub fn run(config: &SimConfig) -> Result<SimOutcome, String> {
    let seed = config.seed;
    let fail = |why: String| format!("seed {seed}: {why}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Keys from the seed: a random name-hash key lays the fillers out differently in every
    // process, and the run (its misses, what it reads ahead) with them.
    let dev = Filesystem::mkfs_seeded(
        Box::new(MemDevice::new(mem_config()).map_err(|e| e.to_string())?),
        &MkfsOptions {
            shards: 4,
            label: "sim".into(),
            group_blocks: Some(GROUP_BLOCKS),
        },
        seed,
    )
    .map_err(|e| e.to_string())?;
    let dev = if seed % 2 == 1 {
        // Trees of several levels and many leaves, so the small cache below misses.
        let mut fs = Filesystem::mount(dev, MountOptions::default()).map_err(|e| e.to_string())?;
        let root = fs.root();
        for i in 0..FILLER_FILES {
            fs.create(root, format!("filler{i}").as_bytes(), 0o644, 0, 0)
                .map_err(|e| e.to_string())?;
        }
        fs.unmount().map_err(|e| e.to_string())?
    } else {
        dev
    };
    let base = image_of(dev);
    let faulty = FaultDevice::new(
        MemDevice::from_image(&base, mem_config()).map_err(|e| e.to_string())?,
        FaultConfig {
            seed,
            ..Default::default()
        },
    );
    // Faults are armed by the scheduler once the clients run (setup and mount go clean).
    let faults = faulty.handle();
    let recording = RecordingDevice::new(faulty);
    let log = recording.log();
    let fs = Filesystem::mount(
        Box::new(recording),
        MountOptions {
            // Beyond the run: commits come from the dirty limit and the log's fill only.
            commit_interval: Duration::from_secs(3600),
            // A commit's trees are written a node per slice: client operations the
            // scheduler runs land between any two of its nodes.
            commit_slice_nodes: 1,
            // Odd seeds: a metadata cache of 24 nodes, so that lookups miss and requests park
            // for their nodes (reactor/src/meta_wait.rs). It holds the upper levels a walk
            // goes through, so a listing misses leaf after leaf under one parent and reads
            // ahead: with 4 (or 12) nodes the parent was evicted between two leaves, and 2 of
            // 12 seeds read ahead; with 24, 10 of 12, and as many requests park.
            cache_nodes: if seed % 2 == 1 { 24 } else { 1 << 16 },
            // Seeds 2 and 3 mod 4: staging parks writes from one block on, so writes park
            // for room (reactor/src/meta_wait.rs) and resume as write-backs complete, in
            // whatever order the scheduler runs them.
            staged_park_bytes: if seed % 4 >= 2 {
                engine::format::BLOCK_BYTES
            } else {
                MountOptions::default().staged_park_bytes
            },
            ..MountOptions::default()
        },
    )
    .map_err(|e| fail(e.to_string()))?;
    let mut reactor = Reactor::new(fs, Duration::from_secs(3600));
    let shared = Arc::new(Shared::new(256));
    let mut clients: Vec<SimClient> = (0..config.clients)
        .map(|_| SimClient {
            client: Client::new(
                Arc::new(crate::multi::Router::new(vec![shared.clone()], 0, None)),
                4,
            ),
            inos: Vec::new(),
            scratch: 0,
            scratch_blocks: 0,
            written: vec![0; FILES],
            in_flight: None,
            write_ok: false,
            stopped: false,
        })
        .collect();
    // Setup: every client's files, created and committed (before faults matter).
    for (c, sc) in clients.iter_mut().enumerate() {
        for f in 0..=FILES {
            let name = if f == FILES {
                format!("c{c}scratch")
            } else {
                format!("c{c}f{f}")
            };
            sc.client
                .submit(
                    Op::Create {
                        dir: engine::inode::ROOT_INO,
                        name: name.into_bytes(),
                        mode: 0o644,
                        owner: crate::op::Owner::ROOT,
                    },
                    f as u64,
                )
                .map_err(|e| fail(format!("setup submit: {e:?}")))?;
        }
    }
    for sc in clients.iter_mut() {
        let mut done = Vec::new();
        while done.len() <= FILES {
            step_reactor(&mut reactor, &shared, 64, true);
            sc.client.poll(&mut done);
        }
        done.sort_by_key(|c| c.token);
        for c in done {
            match c.result {
                Ok(Reply::Stat(s)) if c.token == FILES as u64 => sc.scratch = s.ino,
                Ok(Reply::Stat(s)) => sc.inos.push(s.ino),
                other => return Err(fail(format!("setup create: {other:?}"))),
            }
        }
    }
    let mut outcome = SimOutcome::default();
    let mut acks: Vec<Ack> = Vec::new();
    let mut completions = Vec::new();
    for _ in 0..config.steps {
        if config.eio_rate > 0.0 && rng.random_bool(config.eio_rate) {
            let kind = [nvme::OpKind::Read, nvme::OpKind::Write, nvme::OpKind::Flush]
                [rng.random_range(0..3)];
            faults.fail_next(kind, 1);
            outcome.faults_armed += 1;
        }
        match rng.random_range(0..100) {
            // A client starts an append + fsync.
            0..=44 => {
                let c = rng.random_range(0..clients.len());
                let sc = &mut clients[c];
                if sc.in_flight.is_some() || sc.stopped {
                    continue;
                }
                if rng.random_range(0..16) == 0 {
                    // List the root: a walk over leaves the small cache misses on odd seeds.
                    let list = Op::Readdir {
                        dir: engine::inode::ROOT_INO,
                        cookie: 0,
                        max: 4096,
                    };
                    sc.client
                        .submit(list, 6)
                        .map_err(|e| fail(format!("submit: {e:?}")))?;
                    sc.in_flight = Some((FILES, 0));
                    continue;
                }
                if rng.random_range(0..8) == 0 {
                    // The scratch file: 64 KiB more and fsynced, or (past 256 KiB) truncated to
                    // nothing and synced (the commit gives back the groups it emptied).
                    let ino = sc.scratch;
                    let (change, persist) = if sc.scratch_blocks >= 64 {
                        sc.scratch_blocks = 0;
                        (Op::Truncate { ino, size: 0 }, Op::Sync)
                    } else {
                        let at = sc.scratch_blocks * BLOCK as u64;
                        sc.scratch_blocks += 16;
                        let data = vec![c as u8 + 1; 16 * BLOCK];
                        (
                            Op::Write {
                                ino,
                                offset: at,
                                data: data.into(),
                            },
                            Op::Fsync { ino },
                        )
                    };
                    sc.client
                        .submit(change, 7)
                        .and_then(|()| sc.client.submit(persist, 8))
                        .map_err(|e| fail(format!("submit: {e:?}")))?;
                    sc.in_flight = Some((FILES, 0));
                    sc.write_ok = false;
                    continue;
                }
                let f = rng.random_range(0..FILES);
                if sc.written[f] > 0 && rng.random_range(0..4) == 0 {
                    // Read back an acknowledged block: its bytes, or an error; never others.
                    let index = rng.random_range(0..sc.written[f]);
                    let read = Op::Read {
                        ino: sc.inos[f],
                        offset: index * BLOCK as u64,
                        len: BLOCK,
                    };
                    sc.client
                        .submit(read, 3)
                        .map_err(|e| fail(format!("submit: {e:?}")))?;
                    sc.in_flight = Some((f, index));
                    continue;
                }
                if sc.written[f] > 0 && rng.random_range(0..4) == 0 {
                    // Rewrite an acknowledged block with its own bytes and fsync: the copy
                    // frees its old block (pinned) while other clients' reads may be in
                    // flight on theirs; the commit that follows unpins.
                    let index = rng.random_range(0..sc.written[f]);
                    let ino = sc.inos[f];
                    let write = Op::Write {
                        ino,
                        offset: index * BLOCK as u64,
                        data: block(c, f, index).into(),
                    };
                    sc.client
                        .submit(write, 4)
                        .and_then(|()| sc.client.submit(Op::Fsync { ino }, 5))
                        .map_err(|e| fail(format!("submit: {e:?}")))?;
                    sc.in_flight = Some((f, index));
                    sc.write_ok = false;
                    continue;
                }
                let index = sc.written[f];
                let ino = sc.inos[f];
                let write = Op::Write {
                    ino,
                    offset: index * BLOCK as u64,
                    data: block(c, f, index).into(),
                };
                let sync = if rng.random_bool(0.5) {
                    Op::Fsync { ino }
                } else {
                    Op::Fdatasync { ino }
                };
                sc.client
                    .submit(write, 1)
                    .and_then(|()| sc.client.submit(sync, 2))
                    .map_err(|e| fail(format!("submit: {e:?}")))?;
                sc.in_flight = Some((f, index));
                sc.write_ok = false;
            }
            // The reactor runs a batch (or polls its records in flight).
            45..=84 => {
                let batch_max = rng.random_range(1..=16);
                let tick = rng.random_bool(0.7);
                if step_reactor(&mut reactor, &shared, batch_max, tick) {
                    outcome.batches += 1;
                }
            }
            // A client looks at its completions.
            _ => {
                let c = rng.random_range(0..clients.len());
                collect(
                    c,
                    &mut clients[c],
                    &mut completions,
                    &log,
                    &mut acks,
                    &mut outcome,
                )?;
            }
        }
    }
    // Drain: everything submitted completes.
    for _ in 0..10_000 {
        if clients.iter().all(|sc| sc.in_flight.is_none()) {
            break;
        }
        step_reactor(&mut reactor, &shared, 64, true);
        for (c, sc) in clients.iter_mut().enumerate() {
            collect(c, sc, &mut completions, &log, &mut acks, &mut outcome)?;
        }
    }
    if clients.iter().any(|sc| sc.in_flight.is_some()) {
        let stuck: Vec<_> = clients.iter().map(|sc| sc.in_flight).collect();
        return Err(fail(format!(
            "requests never completed (each client's: {stuck:?})"
        )));
    }
    outcome.failed_stop = clients.iter().any(|sc| sc.stopped);
    if outcome.failed_stop {
        // Fail-stop: a change after the failure is refused.
        let sc = &mut clients[0];
        let r = sc.client.submit(
            Op::Write {
                ino: sc.inos[0],
                offset: 0,
                data: vec![0; 1].into(),
            },
            9,
        );
        r.map_err(|e| fail(format!("submit: {e:?}")))?;
        let mut done = Vec::new();
        while done.is_empty() {
            step_reactor(&mut reactor, &shared, 64, true);
            sc.client.poll(&mut done);
        }
        if done[0].result.is_ok() {
            return Err(fail("a write succeeded after the filesystem failed".into()));
        }
    }
    drop(clients);
    outcome.meta_parks = reactor.meta.parks;
    outcome.room_parks = reactor.meta.room_parks;
    outcome.nodes_read_ahead = reactor.fetch_stats().blocks_ahead;
    let pool = reactor.space_pool().stats();
    outcome.groups_taken = pool.taken;
    outcome.groups_returned = pool.returned;
    // A healthy filesystem commits at unmount; on a faulty device that commit may itself
    // meet an injected error, which must then be reported, as it is here.
    match reactor.unmount() {
        Ok(_) => {}
        Err(e) if config.eio_rate > 0.0 => {
            outcome.failed_stop = true;
            tracing::debug!("seed {seed}: unmount on a faulty device: {e}");
        }
        Err(e) => return Err(fail(format!("unmount: {e}"))),
    }
    // Crash states: random cuts and the end, both modes.
    let records = log.snapshot();
    let mut cuts: Vec<usize> = (0..config.crash_cuts)
        .map(|_| rng.random_range(0..=records.len()))
        .collect();
    cuts.push(records.len());
    for cut in cuts {
        for mode in [
            CrashMode::DurableOnly,
            CrashMode::Torn {
                seed: seed ^ cut as u64,
            },
        ] {
            let image = crash_image(&base, 4096, &records, cut, mode);
            check_state(&image, cut, &acks)
                .map_err(|why| fail(format!("cut {cut} {mode:?}: {why}")))?;
            outcome.crash_states += 1;
        }
    }
    Ok(outcome)
}

fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut image = vec![0u8; CAPACITY as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).expect("reading a memory device");
    image
}

/// Takes a client's completions and advances it; notes acknowledged fsyncs.
fn collect(
    c: usize,
    sc: &mut SimClient,
    completions: &mut Vec<crate::op::Completion>,
    log: &nvme::wrap::WriteLog,
    acks: &mut Vec<Ack>,
    outcome: &mut SimOutcome,
) -> Result<(), String> {
    completions.clear();
    sc.client.poll(completions);
    for done in completions.drain(..) {
        let Some((f, index)) = sc.in_flight else {
            continue;
        };
        match (done.token, done.result) {
            (1, Ok(_)) => sc.write_ok = true,
            (1, Err(_)) => sc.write_ok = false,
            (2, Ok(_)) if sc.write_ok => {
                sc.written[f] = index + 1;
                acks.push((log.len(), c, f, index + 1));
                outcome.fsyncs_acknowledged += 1;
                sc.in_flight = None;
            }
            (2, Ok(_)) => {
                return Err(format!(
                    "client {c}: an fsync succeeded after its write failed"
                ))
            }
            (2, Err(_)) => {
                outcome.fsyncs_failed += 1;
                sc.stopped = true;
                sc.in_flight = None;
            }
            (3, Ok(Reply::Data(d))) => {
                if d != block(c, f, index) {
                    return Err(format!(
                        "client {c}: read of file {f} block {index} returned wrong data"
                    ));
                }
                outcome.reads_verified += 1;
                sc.in_flight = None;
            }
            (3, Err(_)) => {
                outcome.reads_failed += 1;
                sc.in_flight = None;
            }
            (4, result) => sc.write_ok = result.is_ok(),
            (5, Ok(_)) if sc.write_ok => {
                outcome.rewrites_acknowledged += 1;
                sc.in_flight = None;
            }
            (5, Ok(_)) => {
                return Err(format!(
                    "client {c}: an fsync succeeded after its rewrite failed"
                ))
            }
            (5, Err(_)) => {
                outcome.fsyncs_failed += 1;
                sc.stopped = true;
                sc.in_flight = None;
            }
            (6, Ok(Reply::Entries(entries))) => {
                let names: std::collections::HashSet<&[u8]> =
                    entries.iter().map(|e| &e.name[..]).collect();
                if names.len() != entries.len() {
                    return Err(format!("client {c}: a listing repeated a name"));
                }
                let fillers = names.iter().filter(|n| n.starts_with(b"filler")).count();
                if fillers != 0 && fillers != FILLER_FILES {
                    return Err(format!(
                        "client {c}: a listing held {fillers} of the {FILLER_FILES} filler files"
                    ));
                }
                for own in 0..FILES {
                    if !names.contains(format!("c{c}f{own}").as_bytes()) {
                        return Err(format!("client {c}: a listing missed its file {own}"));
                    }
                }
                outcome.readdirs_verified += 1;
                sc.in_flight = None;
            }
            // A detected fault (a node read failed): the listing reports it, never less.
            (6, Err(_)) => {
                outcome.reads_failed += 1;
                sc.in_flight = None;
            }
            // The scratch file's change and its fsync.
            (7, result) => sc.write_ok = result.is_ok(),
            (8, Ok(_)) if sc.write_ok => sc.in_flight = None,
            (8, Ok(_)) => {
                return Err(format!(
                    "client {c}: an fsync succeeded after its scratch change failed"
                ))
            }
            (8, Err(_)) => {
                outcome.fsyncs_failed += 1;
                sc.stopped = true;
                sc.in_flight = None;
            }
            (token, result) => {
                return Err(format!("client {c}: stray completion {token}: {result:?}"))
            }
        }
    }
    Ok(())
}

/// Mounts a crash image, checks it, and verifies every fsync acknowledged before `cut`.
fn check_state(image: &[u8], cut: usize, acks: &[Ack]) -> Result<(), String> {
    let dev = MemDevice::from_image(image, mem_config()).map_err(|e| e.to_string())?;
    let mut fs = Filesystem::mount(Box::new(dev), MountOptions::default())
        .map_err(|e| format!("mount: {e}"))?;
    fs.check().map_err(|e| format!("check: {e}"))?;
    // The most blocks acknowledged per (client, file) by the cut.
    let mut want: std::collections::BTreeMap<(usize, usize), u64> = Default::default();
    for &(at, c, f, blocks) in acks {
        if at <= cut {
            let e = want.entry((c, f)).or_default();
            *e = (*e).max(blocks);
        }
    }
    for ((c, f), blocks) in want {
        let ino = fs
            .lookup(fs.root(), format!("c{c}f{f}").as_bytes())
            .map_err(|e| format!("client {c} file {f}: {e}"))?
            .ino;
        let size = fs.stat(ino).map_err(|e| e.to_string())?.size;
        if size < blocks * BLOCK as u64 {
            return Err(format!(
                "client {c} file {f}: {size} bytes, {blocks} blocks acknowledged"
            ));
        }
        for i in 0..blocks {
            let got = fs
                .read(ino, i * BLOCK as u64, BLOCK)
                .map_err(|e| format!("client {c} file {f} block {i}: {e}"))?;
            if got != block(c, f, i) {
                return Err(format!("client {c} file {f} block {i}: wrong bytes"));
            }
        }
    }
    Ok(())
}
