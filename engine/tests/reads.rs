//! Asynchronous data reads ([`engine::reads`]) against a device that holds reads back until
//! told: a read's device I/O outlives the requests served meanwhile, its blocks stay pinned
//! until it finishes, and its results are the bytes the file had when it was planned.
//! Nothing here depends on timing.

use engine::{Filesystem, MkfsOptions, MountOptions, ReadStart};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::{BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, Rejected, Request};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Passes everything to a memory device but reads, which it keeps unsubmitted (so they see
/// the device as it is when released) while `hold` is set. A wait releases them: whoever
/// waits blocks on the device, and a device makes progress.
struct HoldReads {
    inner: MemDevice,
    held: Vec<Request>,
    hold: Arc<AtomicBool>,
    /// While set, a release keeps the newest held read back (one read outlives another).
    keep_newest: Arc<AtomicBool>,
    /// Reads held so far.
    held_total: Arc<AtomicU64>,
}

impl HoldReads {
    fn release(&mut self) {
        let keep = match self.keep_newest.load(Ordering::SeqCst) {
            true => self.held.pop(),
            false => None,
        };
        for request in self.held.drain(..) {
            self.inner
                .submit(request)
                .expect("room for a released read");
        }
        self.held.extend(keep);
    }
}

impl BlockDevice for HoldReads {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }
    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        if matches!(request.op, IoOp::Read { .. }) && self.hold.load(Ordering::SeqCst) {
            self.held_total.fetch_add(1, Ordering::SeqCst);
            self.held.push(request);
            return Ok(());
        }
        self.inner.submit(request)
    }
    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        if !self.hold.load(Ordering::SeqCst) {
            self.release();
        }
        self.inner.poll(out)
    }
    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        self.release();
        self.inner.wait(out, timeout)
    }
    fn in_flight(&self) -> u32 {
        self.inner.in_flight() + self.held.len() as u32
    }
}

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: 64 << 20,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 64,
    }
}

struct Held {
    fs: Filesystem,
    hold: Arc<AtomicBool>,
    keep_newest: Arc<AtomicBool>,
    held_total: Arc<AtomicU64>,
}

/// A filesystem with file `a` (64 KiB of 0x11) committed, remounted so nothing is cached.
fn with_file_a() -> (Held, u64) {
    let hold = Arc::new(AtomicBool::new(false));
    let keep_newest = Arc::new(AtomicBool::new(false));
    let held_total = Arc::new(AtomicU64::new(0));
    let dev = HoldReads {
        inner: MemDevice::new(config()).unwrap(),
        held: Vec::new(),
        hold: hold.clone(),
        keep_newest: keep_newest.clone(),
        held_total: held_total.clone(),
    };
    let options = MkfsOptions {
        shards: 2,
        label: "reads".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &[0x11; 65536]).unwrap();
    let dev = fs.unmount().unwrap();
    let fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    (
        Held {
            fs,
            hold,
            keep_newest,
            held_total,
        },
        a,
    )
}

/// A fresh filesystem of `shards` shards on a memory device, mounted.
fn fresh_mem(shards: u32) -> Filesystem {
    let options = MkfsOptions {
        shards,
        label: "reads".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(MemDevice::new(config()).unwrap()), &options).unwrap();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

/// Runs a commit to SuperCommitted without unpinning (what a reactor does before it
/// releases the commit's waiters).
fn commit_to_super(fs: &mut Filesystem) {
    assert!(fs.commit_start().unwrap(), "something to commit");
    loop {
        match fs
            .commit_progress(Some(Duration::from_millis(100)))
            .unwrap()
        {
            engine::commit::CommitProgress::SuperCommitted(_) => return,
            engine::commit::CommitProgress::Idle => panic!("the commit vanished"),
            _ => {}
        }
    }
}

#[test]
fn a_read_in_flight_keeps_its_blocks_pinned_and_returns_the_bytes_it_was_planned_on() {
    let (mut h, a) = with_file_a();
    let fs = &mut h.fs;
    // Metadata first, so the read below plans from the node cache.
    assert_eq!(fs.stat(a).unwrap().size, 65536);
    h.hold.store(true, Ordering::SeqCst);
    let set = match fs.read_start(&[(a, 0, 65536)]) {
        ReadStart::Pending(set) => set,
        ReadStart::Done(_) => panic!("a cold read needs the device"),
    };
    assert!(
        h.held_total.load(Ordering::SeqCst) > 0,
        "the read reached the device"
    );
    assert_eq!(fs.reads_in_flight(), 1);
    assert!(fs.read_progress(None).is_empty(), "held: nothing finished");

    // Meanwhile the file is overwritten (copy-on-write: the read's blocks are freed,
    // pinned) and the change commits.
    fs.write(a, 0, &[0x22; 65536]).unwrap();
    assert_eq!(
        fs.read(a, 0, 4).unwrap(),
        vec![0x22; 4],
        "served from memory"
    );
    commit_to_super(fs);
    assert!(
        fs.unpin_waits_for_reads(),
        "the commit freed blocks a read in flight was planned on"
    );
    // The forced unpin finishes the read first (the wait releases it).
    fs.complete_commit();
    assert!(!fs.unpin_waits_for_reads());
    let done = fs.read_progress(None);
    assert_eq!(
        done.len(),
        1,
        "the unpin finished the read before it returned"
    );
    assert_eq!(done[0].0, set);
    assert_eq!(done[0].1.len(), 1);
    let bytes = done[0].1[0].as_ref().expect("the read succeeded");
    assert_eq!(
        bytes,
        &vec![0x11; 65536],
        "the bytes the file had when planned"
    );
    assert_eq!(fs.reads_in_flight(), 0);
    assert!(fs.read_stats().sets_async >= 1);
    h.hold.store(false, Ordering::SeqCst);
    fs.check().unwrap();
}

#[test]
fn many_sets_in_flight_finish_in_any_order_each_with_its_own_results() {
    let (mut h, a) = with_file_a();
    let fs = &mut h.fs;
    assert_eq!(fs.stat(a).unwrap().size, 65536);
    let root = fs.root();
    let b = fs.create(root, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, b"in memory").unwrap();
    h.hold.store(true, Ordering::SeqCst);
    // 16 one-block sets, each pending on the device, and one served from memory at once.
    let mut sets = Vec::new();
    for i in 0..16u64 {
        match fs.read_start(&[(a, i * 4096, 4096), (b, 0, 9)]) {
            ReadStart::Pending(set) => sets.push(set),
            ReadStart::Done(_) => panic!("block {i} is not cached"),
        }
    }
    match fs.read_start(&[(b, 3, 6)]) {
        ReadStart::Done(r) => assert_eq!(r[0].as_ref().unwrap(), b"memory"),
        ReadStart::Pending(_) => panic!("staged data needs no device"),
    }
    // A synchronous read meanwhile waits for its own set only; the others stay pending
    // for their owner.
    h.hold.store(false, Ordering::SeqCst);
    assert_eq!(fs.read(a, 4096 * 20, 3).unwrap().len(), 0, "past the end");
    let mut seen = std::collections::HashSet::new();
    while seen.len() < sets.len() {
        for (set, results) in fs.read_progress(Some(Duration::from_millis(100))) {
            assert!(sets.contains(&set) && seen.insert(set), "set {set} once");
            assert_eq!(results.len(), 2);
            assert_eq!(results[0].as_ref().unwrap(), &vec![0x11; 4096]);
            assert_eq!(results[1].as_ref().unwrap(), b"in memory");
        }
    }
    assert_eq!(fs.reads_in_flight(), 0);
}

#[test]
fn a_device_error_fails_the_sets_waiting_for_it_and_stops_the_filesystem() {
    use nvme::wrap::{FaultConfig, FaultDevice};
    let mut fs = fresh_mem(2);
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &[0x33; 8192]).unwrap();
    let dev = fs.unmount().unwrap();
    let mut image = vec![0u8; 64 << 20];
    let mut dev = dev;
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    let faulty = FaultDevice::new(
        MemDevice::from_image(&image, config()).unwrap(),
        FaultConfig::default(),
    );
    let faults = faulty.handle();
    let mut fs = Filesystem::mount(Box::new(faulty), MountOptions::default()).unwrap();
    assert_eq!(fs.stat(a).unwrap().size, 8192);
    faults.fail_next(nvme::OpKind::Read, 1);
    let set = match fs.read_start(&[(a, 0, 8192)]) {
        ReadStart::Pending(set) => set,
        ReadStart::Done(_) => panic!("a cold read needs the device"),
    };
    let mut done = Vec::new();
    while done.is_empty() {
        done = fs.read_progress(Some(Duration::from_millis(100)));
    }
    assert_eq!(done[0].0, set);
    assert!(
        matches!(done[0].1[0], Err(engine::EngineError::Device(_))),
        "{:?}",
        done[0].1[0]
    );
    assert!(
        fs.failure().is_some(),
        "a device error makes the filesystem fail-stop"
    );
    assert!(fs.write(a, 0, b"x").is_err(), "no change after the failure");
}

/// A file read sequentially has what follows its reads fetched into the block cache in the
/// background: most of its reads then need no device read of their own, every byte is the
/// file's, and a block rewritten after it was read ahead is read as rewritten.
#[test]
fn sequential_reads_are_read_ahead_into_the_block_cache() {
    let mut fs = fresh_mem(2);
    let root = fs.root();
    let f = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    let blocks = 256u64; // 1 MiB
    let block_of = |i: u64| vec![(i % 251) as u8 ^ 0x5A; 4096];
    for i in 0..blocks {
        fs.write(f, i * 4096, &block_of(i)).unwrap();
    }
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let before = fs.read_stats();
    for i in 0..blocks {
        let out = fs.read_many(&[(f, i * 4096, 4096)]);
        let want = if i == 120 {
            vec![0xEE; 4096]
        } else {
            block_of(i)
        };
        assert!(out[0].as_ref().unwrap() == &want, "block {i} read wrong");
        if i == 100 {
            // Rewritten after the read-ahead fetched it (copy-on-write: a new block).
            fs.write(f, 120 * 4096, &[0xEE; 4096]).unwrap();
        }
    }
    let stats = fs.read_stats();
    assert!(stats.ahead_sets > 0, "no read-ahead: {stats:?}");
    let own_sets = stats.sets_async - before.sets_async;
    assert!(
        own_sets < blocks / 4,
        "{own_sets} of {blocks} sequential reads went to the device themselves: {stats:?}"
    );
    assert!(
        fs.read_many(&[(f, 120 * 4096, 4096)])[0].as_ref().unwrap() == &vec![0xEE; 4096],
        "a block read ahead, then rewritten, read stale"
    );
    // Random reads start no read-ahead.
    let ahead = fs.read_stats().ahead_sets;
    for i in [7u64, 201, 33, 150, 90] {
        let out = fs.read_many(&[(f, i * 4096, 4096)]);
        assert!(out[0].is_ok());
    }
    assert_eq!(fs.read_stats().ahead_sets, ahead, "random reads read ahead");
    fs.unmount().unwrap();
}

/// A read planned while a read-ahead is fetching its blocks takes them from that device
/// read when it completes, never reads them again: a file streamed through reads every block
/// from the device once (read ahead or read on demand), every byte is the file's, the
/// window grows past its first 256 KiB, and a rotten block that a joining read takes from
/// the read-ahead fails that read with a checksum error, not rotten bytes.
#[test]
fn a_streaming_read_joins_read_ahead_in_flight_and_reads_each_block_once() {
    const BLOCKS: u64 = 1024; // 4 MiB
    const READ: u64 = 16; // 64 KiB reads
                          // Unique bytes per block, so the image shows where each landed.
    let block_of = |i: u64| -> Vec<u8> {
        (0..4096u64)
            .map(|k| (i.wrapping_mul(31) ^ k.wrapping_mul(7) ^ (i >> 3)) as u8)
            .collect()
    };
    let mut fs = fresh_mem(2);
    let root = fs.root();
    let f = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    for chunk in 0..BLOCKS / 64 {
        let bytes: Vec<u8> = (chunk * 64..(chunk + 1) * 64).flat_map(block_of).collect();
        fs.write(f, chunk * 64 * 4096, &bytes).unwrap();
    }
    fs.commit().unwrap();
    let mut dev = fs.unmount().unwrap();
    let mut image = vec![0u8; config().capacity_bytes as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    // File block 40 rots. Read 1 (blocks 16..32) starts the first read-ahead, of blocks
    // 32..96; read 2 (blocks 32..48) is planned while that read is held, and joins it.
    const ROTTEN: u64 = 40;
    let at = image
        .chunks(4096)
        .position(|b| b == block_of(ROTTEN).as_slice())
        .expect("the block is in the image");
    image[at * 4096 + 100] ^= 0x10;
    let hold = Arc::new(AtomicBool::new(false));
    let dev = HoldReads {
        inner: MemDevice::from_image(&image, config()).unwrap(),
        held: Vec::new(),
        hold: hold.clone(),
        keep_newest: Arc::new(AtomicBool::new(false)),
        held_total: Arc::new(AtomicU64::new(0)),
    };
    let mut fs = Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap();
    assert_eq!(
        fs.stat(f).unwrap().size,
        BLOCKS * 4096,
        "metadata in memory"
    );

    // Two reads at a time (the first read alone) are planned while the device holds every
    // read, then both are waited for: the second of each pair finds the first's read-ahead
    // on its way.
    let mut results: Vec<(u64, Result<Vec<u8>, engine::EngineError>)> = Vec::new();
    let mut next = 0;
    while next < BLOCKS {
        hold.store(true, Ordering::SeqCst);
        let mut pending = Vec::new();
        for _ in 0..if next == 0 { 1 } else { 2 } {
            if next >= BLOCKS {
                break;
            }
            match fs.read_start(&[(f, next * 4096, (READ * 4096) as usize)]) {
                ReadStart::Done(mut out) => results.push((next, out.pop().unwrap())),
                ReadStart::Pending(set) => pending.push((set, next)),
            }
            next += READ;
        }
        hold.store(false, Ordering::SeqCst);
        while !pending.is_empty() {
            for (set, mut out) in fs.read_progress(Some(Duration::from_millis(100))) {
                // Node sets (a read-ahead's extents fetched) come back with no results.
                if let Some(at) = pending.iter().position(|&(s, _)| s == set) {
                    results.push((pending.remove(at).1, out.pop().unwrap()));
                }
            }
        }
    }
    results.sort_by_key(|&(first, _)| first);
    assert_eq!(results.len() as u64, BLOCKS / READ);
    for (first, result) in &results {
        let range = *first..first + READ;
        match result {
            Err(engine::EngineError::Corrupt { what, .. }) if range.contains(&ROTTEN) => {
                assert_eq!(*what, "data block");
            }
            Ok(_) if range.contains(&ROTTEN) => panic!("blocks {range:?}: rotten bytes read"),
            Ok(bytes) => {
                let want: Vec<u8> = range.clone().flat_map(block_of).collect();
                assert!(bytes == &want, "blocks {range:?} read wrong");
            }
            Err(e) => panic!("blocks {range:?}: {e}"),
        }
    }
    let stats = fs.read_stats();
    let (hits, device_blocks) = fs.data_cache_hits();
    // Blocks read from the device: by read-ahead, and by reads themselves (those taken
    // from a read-ahead in flight are counted with the read-ahead's).
    let read_from_device = stats.ahead_blocks + device_blocks - stats.ahead_joined_blocks;
    println!("{stats:?}; {hits} cache hits, {device_blocks} device blocks taken by reads");
    assert!(
        stats.ahead_joined_blocks >= 2 * READ,
        "reads joined read-ahead on its way for {} blocks: {stats:?}",
        stats.ahead_joined_blocks
    );
    assert!(
        hits > BLOCKS / 2,
        "{hits} blocks came from the cache: {stats:?}"
    );
    assert!(
        read_from_device <= BLOCKS,
        "{read_from_device} blocks read from the device for a {BLOCKS}-block file: {stats:?}"
    );
    assert!(
        stats.ahead_sets < BLOCKS / READ / 2,
        "the window did not grow: {} read-ahead sets for {} reads",
        stats.ahead_sets,
        BLOCKS / READ
    );
    fs.unmount().unwrap();
}

/// A reactor's batch: requests served from memory are answered at once, never held in the
/// set of a request that waits for the device; errors are answered at once too; each
/// device-bound request is a set of its own, answered as soon as its own device read is
/// back, never held for a slower read of the same batch.
#[test]
fn a_batch_answers_each_request_as_soon_as_its_own_reads_are_back() {
    let (mut h, a) = with_file_a();
    let fs = &mut h.fs;
    let root = fs.root();
    let b = fs.create(root, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, b"in memory").unwrap();
    h.hold.store(true, Ordering::SeqCst);
    let batch = [
        (b, 0, 9),
        (a, 0, 4096),
        (u64::MAX / 2, 0, 1),
        (b, 3, 6),
        (a, 8192, 4096),
    ];
    let started = fs.read_start_deferred(&batch, &[false; 5]);
    assert!(
        started.parked.is_empty(),
        "nothing deferred, nothing parked"
    );
    let done: Vec<usize> = started.done.iter().map(|&(index, _)| index).collect();
    assert_eq!(
        done,
        [0, 2, 3],
        "memory reads and the failed one, in batch order"
    );
    assert_eq!(started.done[0].1.as_ref().unwrap(), b"in memory");
    assert!(started.done[1].1.is_err(), "no such inode");
    assert_eq!(started.done[2].1.as_ref().unwrap(), b"memory");
    let waiting: Vec<usize> = started.pending.iter().map(|&(_, index)| index).collect();
    assert_eq!(waiting, [1, 4], "only the device reads wait, one set each");
    let (first, last) = (started.pending[0].0, started.pending[1].0);
    assert_ne!(first, last, "a set per request");
    // The last request's device read stays on the device; the first request's comes back.
    h.keep_newest.store(true, Ordering::SeqCst);
    h.hold.store(false, Ordering::SeqCst);
    let finished = loop {
        let sets = fs.read_progress(Some(Duration::from_millis(100)));
        if !sets.is_empty() {
            break sets;
        }
    };
    assert_eq!(finished.len(), 1, "only the first request's read is back");
    let (set, results) = &finished[0];
    assert_eq!(
        *set, first,
        "the first request is answered without the last"
    );
    assert_eq!(results.len(), 1, "a set answers its one request");
    assert_eq!(results[0].as_ref().unwrap(), &vec![0x11; 4096]);
    assert!(
        fs.read_progress(None).is_empty(),
        "the last request's read is still held"
    );
    h.keep_newest.store(false, Ordering::SeqCst);
    let finished = loop {
        let sets = fs.read_progress(Some(Duration::from_millis(100)));
        if !sets.is_empty() {
            break sets;
        }
    };
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].0, last);
    assert_eq!(finished[0].1[0].as_ref().unwrap(), &vec![0x11; 4096]);
    assert_eq!(fs.reads_in_flight(), 0);
    fs.check().unwrap();
}

/// Runs `readdir(dir)` deferred, as a reactor does, until it is answered: each miss parks
/// it until its node set is read. Returns the entries and how many times it parked.
fn readdir_deferred(fs: &mut Filesystem, dir: u64, max: usize) -> (usize, u32) {
    let mut parks = 0;
    loop {
        match fs.without_waiting(|fs| fs.readdir(dir, 0, max)) {
            engine::Deferred::Ready(entries) => return (entries.unwrap().len(), parks),
            engine::Deferred::Fetching(set) => {
                parks += 1;
                assert!(parks < 10_000, "the readdir never completes");
                while !fs
                    .read_progress(Some(Duration::from_millis(100)))
                    .iter()
                    .any(|(done, _)| *done == set)
                {}
            }
        }
    }
}

/// A directory walk over a cold tree reads the walk's next leaves ahead: a readdir spanning
/// dozens of leaves parks a few times, not once per leaf (a reactor runs a request that
/// parked `ROUNDS_MAX` times waiting on the device, holding every client). Read-ahead never
/// changes what is read.
#[test]
fn a_directory_walk_over_a_cold_tree_reads_its_next_leaves_ahead() {
    let mut fs = fresh_mem(1);
    let root = fs.root();
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    let names = 4000;
    for i in 0..names {
        let name = format!("a-file-name-long-enough-to-fill-leaves-{i:06}");
        fs.create(dir, name.as_bytes(), 0o644, 0, 0).unwrap();
    }
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let before = fs.fetch_stats();
    let (entries, parks) = readdir_deferred(&mut fs, dir, names);
    assert_eq!(entries, names, "every name, read ahead or not");
    let fetched = fs.fetch_stats();
    let read_ahead = fetched.blocks_ahead - before.blocks_ahead;
    let node_reads = fetched.blocks_fetched - before.blocks_fetched;
    // The leaves holding the directory's names: far more than the parks.
    assert!(
        node_reads >= 40,
        "{node_reads} nodes read: the walk spans many leaves"
    );
    assert!(read_ahead > 0, "nothing was read ahead");
    assert!(
        parks * 4 <= node_reads as u32,
        "{parks} parks for {node_reads} nodes read ({read_ahead} ahead)"
    );
    println!("{parks} parks, {node_reads} nodes read, {read_ahead} of them ahead");
    // Again, cached: no park at all, the same names.
    let (again, parks) = readdir_deferred(&mut fs, dir, names);
    assert_eq!((again, parks), (names, 0));
}

/// The class the asynchronous read path must get right, generated: random files (holes,
/// unaligned tails, several extents), random batches of random ranges, pieces cut into
/// several device reads (a 2-block DMA buffer), rotten blocks, the data-block cache on and
/// off, batches split per request (as a reactor reads), unsplit (`read_many`), and each
/// request read in its caller's thread beside the queue (`read_lent`, as a client whose
/// reactor sleeps reads; blocks cut at the device's largest transfer there too). Each
/// request must return exactly the model's bytes, or fail as corrupt exactly when its
/// range touches a rotten block of its file. Seeded (`COREFS_SEED`); the seed is printed.
#[test]
fn random_reads_match_the_model_across_split_device_reads_and_rotten_blocks() {
    use rand::{Rng, SeedableRng};
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    const IMAGE: u64 = 32 << 20;
    let config = MemConfig {
        capacity_bytes: IMAGE,
        lba_size_bytes: 4096,
        queue_depth: 32,
        // Two blocks per device read: a piece of more is cut into several.
        buf_bytes: 8192,
        buf_count: 64,
    };
    let dev = Filesystem::mkfs(
        Box::new(MemDevice::new(config).unwrap()),
        &MkfsOptions {
            shards: 2,
            label: "model".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    // Every written block's bytes are unique to (file, block), so the image shows where
    // each landed.
    let block_bytes = |file: usize, block: u64| -> Vec<u8> {
        let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(
            seed ^ ((file as u64) << 40) ^ block.wrapping_mul(0x9e37_79b9),
        );
        (0..4096).map(|_| r.random()).collect()
    };
    let mut files: Vec<(u64, Vec<u8>)> = Vec::new();
    for file in 0..8usize {
        let ino = fs
            .create(root, format!("f{file}").as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        let blocks = rng.random_range(1..40u64);
        let mut model = vec![0u8; (blocks * 4096) as usize];
        for block in 0..blocks {
            // About one block in five stays a hole.
            if rng.random_ratio(1, 5) {
                continue;
            }
            let bytes = block_bytes(file, block);
            fs.write(ino, block * 4096, &bytes).unwrap();
            model[(block * 4096) as usize..][..4096].copy_from_slice(&bytes);
        }
        // An unaligned size: the tail past it reads as nothing.
        let size = (blocks * 4096 - rng.random_range(0..4096)) as usize;
        fs.truncate(ino, size as u64).unwrap();
        model.truncate(size);
        files.push((ino, model));
    }
    fs.commit().unwrap();
    let mut dev = fs.unmount().unwrap();
    let mut image = vec![0u8; IMAGE as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    // Rot a few data blocks, found by content. Only whole blocks: the truncation rewrote a
    // file's partial last block elsewhere, and its old copy still lies in the image.
    let mut rotten: Vec<(usize, u64)> = Vec::new();
    for _ in 0..200 {
        if rotten.len() == 4 {
            break;
        }
        let file = rng.random_range(0..files.len());
        let whole = (files[file].1.len() / 4096) as u64;
        if whole == 0 {
            continue;
        }
        let block = rng.random_range(0..whole);
        let want = block_bytes(file, block);
        let mut found = image
            .chunks(4096)
            .enumerate()
            .filter(|(_, b)| *b == want.as_slice());
        let (Some((at, _)), None) = (found.next(), found.next()) else {
            continue; // a hole
        };
        image[at * 4096 + rng.random_range(0..4096)] ^= 1 << rng.random_range(0..8);
        rotten.push((file, block));
    }
    let expect = |file: usize, offset: u64, len: usize| -> Result<Vec<u8>, ()> {
        let model = &files[file].1;
        let from = (offset as usize).min(model.len());
        let to = (offset as usize).saturating_add(len).min(model.len());
        let touched = |b: u64| (b as usize) * 4096 < to && (b as usize + 1) * 4096 > from;
        if from < to && rotten.iter().any(|&(f, b)| f == file && touched(b)) {
            return Err(());
        }
        Ok(model[from..to].to_vec())
    };
    assert!(!rotten.is_empty(), "seed {seed}: no block to rot");
    let (mut corrupt_seen, mut bytes_seen) = (0, 0);
    for cache in [0, engine::writeback::CACHE_BLOCKS] {
        let options = MountOptions {
            data_cache_blocks: cache,
            ..MountOptions::default()
        };
        let mut fs = Filesystem::mount(
            Box::new(MemDevice::from_image(&image, config).unwrap()),
            options,
        )
        .unwrap();
        let mut lent_answered = 0;
        for round in 0..90 {
            let batch: Vec<(usize, u64, usize)> = (0..rng.random_range(1..9))
                .map(|_| {
                    let file = rng.random_range(0..files.len());
                    let size = files[file].1.len() as u64;
                    let offset = rng.random_range(0..size + 5000);
                    (file, offset, rng.random_range(0..70_000))
                })
                .collect();
            let requests: Vec<(u64, u64, usize)> = batch
                .iter()
                .map(|&(file, offset, len)| (files[file].0, offset, len))
                .collect();
            let results: Vec<Result<Vec<u8>, engine::EngineError>> = if round % 3 == 0 {
                fs.read_many(&requests)
            } else if round % 3 == 2 {
                // As a client whose reactor sleeps reads: in its own thread, data blocks
                // beside the queue; what it declines goes the owner's way.
                requests
                    .iter()
                    .map(|&(ino, offset, len)| match fs.read_lent(ino, offset, len) {
                        Some(result) => {
                            lent_answered += 1;
                            result
                        }
                        None => fs.read(ino, offset, len),
                    })
                    .collect()
            } else {
                // As a reactor reads: split, each request answered as its own reads return.
                let started = fs.read_start_deferred(&requests, &vec![false; requests.len()]);
                let mut results: Vec<Option<_>> = requests.iter().map(|_| None).collect();
                for (index, result) in started.done {
                    results[index] = Some(result);
                }
                let mut pending = started.pending;
                while !pending.is_empty() {
                    for (set, mut out) in fs.read_progress(Some(Duration::from_millis(100))) {
                        let at = pending.iter().position(|&(s, _)| s == set).unwrap();
                        let (_, index) = pending.remove(at);
                        results[index] = Some(out.pop().expect("one result per set"));
                    }
                }
                results.into_iter().map(|r| r.expect("answered")).collect()
            };
            for ((&(file, offset, len), got), request) in batch.iter().zip(&results).zip(&requests)
            {
                let ctx = format!("seed {seed}, cache {cache}, round {round}, {request:?}");
                match (got, expect(file, offset, len)) {
                    (Ok(got), Ok(want)) => {
                        assert!(got == &want, "{ctx}: wrong bytes");
                        bytes_seen += got.len();
                    }
                    (Err(e), Err(())) => {
                        let corrupt = matches!(
                            e,
                            engine::EngineError::Corrupt {
                                what: "data block",
                                ..
                            }
                        );
                        assert!(corrupt, "{ctx}: {e}");
                        corrupt_seen += 1;
                    }
                    (got, want) => panic!(
                        "{ctx}: got {:?}, want {:?}",
                        got.as_ref().map(Vec::len),
                        want.map(|w| w.len())
                    ),
                }
            }
        }
        let stats = fs.read_stats();
        assert!(
            stats.device_reads > stats.sets_async,
            "seed {seed}: pieces were cut into several device reads ({stats:?})"
        );
        assert!(
            lent_answered > 0 && stats.lent_reads > 0 && stats.lent_read_blocks > 0,
            "seed {seed}, cache {cache}: no read was answered beside the queue \
             ({lent_answered} answered lent; {stats:?})"
        );
    }
    assert!(
        corrupt_seen > 0 && bytes_seen > 0,
        "seed {seed}: {corrupt_seen} corrupt requests, {bytes_seen} bytes read"
    );
}

/// Passes everything to a memory device but writes, which it keeps unsubmitted while `hold`
/// is set (the device does not have their bytes: writes in flight). Its any-thread reader
/// reads the memory device itself, so a read beside the queue sees what the device holds.
struct HoldWrites {
    inner: MemDevice,
    held: Vec<Request>,
    hold: Arc<AtomicBool>,
}

impl HoldWrites {
    fn release(&mut self) {
        for request in self.held.drain(..) {
            self.inner
                .submit(request)
                .expect("room for a released write");
        }
    }
}

impl BlockDevice for HoldWrites {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }
    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        if request.op.kind() == nvme::OpKind::Write && self.hold.load(Ordering::SeqCst) {
            self.held.push(request);
            return Ok(());
        }
        self.inner.submit(request)
    }
    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        if !self.hold.load(Ordering::SeqCst) {
            self.release();
        }
        self.inner.poll(out)
    }
    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        self.release();
        self.inner.wait(out, timeout)
    }
    fn in_flight(&self) -> u32 {
        self.inner.in_flight() + self.held.len() as u32
    }
    fn any_thread_io(&self) -> Option<Box<dyn nvme::AnyThreadIo>> {
        self.inner.any_thread_io()
    }
}

/// A read in the caller's thread beside the queue (`read_lent`, what a client runs while
/// its reactor sleeps) of blocks whose write-back is still in flight takes them from the
/// write, not from the device, which has the blocks' older bytes (a fresh allocation: a
/// crc mismatch). A file with data still staged is declined, untouched: the owner writes it
/// back first (an fsync's record carries staged data without writing it back).
#[test]
fn a_read_beside_the_queue_takes_blocks_a_write_in_flight_holds_from_that_write() {
    let hold = Arc::new(AtomicBool::new(false));
    let dev = HoldWrites {
        inner: MemDevice::new(config()).unwrap(),
        held: Vec::new(),
        hold: hold.clone(),
    };
    let options = MkfsOptions {
        shards: 2,
        label: "reads".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
    // No data cache: every block not staged comes from the device or a write in flight.
    let mut fs = Filesystem::mount(
        dev,
        MountOptions {
            data_cache_blocks: 0,
            ..MountOptions::default()
        },
    )
    .unwrap();
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &[0x11; 65536]).unwrap();
    fs.commit().unwrap();
    // Read once by the owner: the access time moves now, not in the lent reads below.
    assert_eq!(fs.read(a, 0, 4096).unwrap(), [0x11; 4096]);

    let before = fs.device_wait_stats();
    let got = fs
        .read_lent(a, 8192, 8192)
        .expect("answered beside the queue");
    assert_eq!(got.unwrap(), [0x11; 8192]);
    let after = fs.device_wait_stats();
    assert_eq!(
        after.lent_reads,
        before.lent_reads + 1,
        "one read of the device"
    );

    hold.store(true, Ordering::SeqCst);
    // Copy-on-write: new blocks for 4096..12288, staged.
    fs.write(a, 4096, &[0x22; 8192]).unwrap();
    assert!(
        fs.read_lent(a, 0, 16384).is_none(),
        "a file with staged data is the owner's to read"
    );
    // The owner's read hands the staged blocks to the device (held in flight) and is
    // answered from them.
    assert_eq!(fs.read(a, 4096, 4096).unwrap(), [0x22; 4096]);
    let before = fs.device_wait_stats();
    let got = fs
        .read_lent(a, 0, 16384)
        .expect("answered beside the queue")
        .expect("the bytes of the write in flight");
    assert_eq!(got[..4096], [0x11; 4096]);
    assert_eq!(got[4096..12288], [0x22; 8192]);
    assert_eq!(got[12288..], [0x11; 4096]);
    let after = fs.device_wait_stats();
    assert_eq!(
        after.lent_reads_from_writes,
        before.lent_reads_from_writes + 2,
        "the two rewritten blocks came from the write in flight"
    );
    assert_eq!(
        after.lent_reads,
        before.lent_reads + 2,
        "the blocks on either side came from the device"
    );

    // Released and completed, the same read comes from the device alone.
    hold.store(false, Ordering::SeqCst);
    fs.commit().unwrap();
    let before = fs.device_wait_stats();
    let got = fs.read_lent(a, 0, 16384).unwrap().unwrap();
    assert_eq!(got[4096..12288], [0x22; 8192]);
    assert_eq!(
        fs.device_wait_stats().lent_reads_from_writes,
        before.lent_reads_from_writes
    );
}
