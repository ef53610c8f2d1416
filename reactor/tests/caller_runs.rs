//! Clients run lookups, reads and changes of names themselves while the reactor sleeps
//! (`reactor/src/caller.rs`), and what they get and leave is what the reactor would have
//! answered and left.
//!
//! A file image with a node cache far smaller than its trees, so that runs from memory miss
//! often and must hand the request to the reactor untouched (a run that reached the device
//! would trip the engine's assertion and poison the runtime). Writer threads change their
//! own files and directories and check, after each change, that a path lookup, a stat, a
//! readdir and an xattr read made by themselves see it (read-your-writes through whichever
//! side answers); reader threads check files nobody changes. Seeds print; `COREFS_SEED=N`
//! replays. After the run the image is mounted again and every writer's files are checked:
//! the changes clients ran reached the device with the reactor's commits.

use engine::{EngineError, MkfsOptions, MountOptions, XattrFlags};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reactor::{Client, Config, Op, Owner, Reply, Runtime};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const ROOT: u64 = 256;

fn config(dir: &tempfile::TempDir) -> Config {
    Config {
        device: format!("file:{}/fs.img,size=128MiB", dir.path().display()),
        mkfs: Some(MkfsOptions {
            shards: 4,
            label: "callers".into(),
            ..Default::default()
        }),
        mount: MountOptions {
            // Far fewer nodes than the trees hold: lookups miss all the time.
            cache_nodes: 48,
            // Commits all the time: lookups and changes run between the slices of a commit
            // and beside its writes in flight, with nodes evicted and read back meanwhile.
            commit_interval: Duration::from_millis(20),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn stat_of(reply: Result<Reply, EngineError>, what: &str) -> engine::Stat {
    match reply {
        Ok(Reply::Stat(s)) => s,
        other => panic!("{what}: expected a stat, got {other:?}"),
    }
}

fn walk_stat(client: &mut Client, path: &[&str]) -> Result<Reply, EngineError> {
    client.call(Op::Walk {
        from: ROOT,
        path: path.iter().map(|p| p.as_bytes().to_vec()).collect(),
        then: Box::new(Op::Stat { ino: 0 }),
    })
}

fn mkdir(client: &mut Client, dir: u64, name: &str) -> u64 {
    make(client, dir, name, 0o755, true)
}

fn create(client: &mut Client, dir: u64, name: &str) -> u64 {
    make(client, dir, name, 0o644, false)
}

/// A new directory or file `name` in `dir`; its inode.
fn make(client: &mut Client, dir: u64, name: &str, mode: u32, is_dir: bool) -> u64 {
    let name_bytes = name.as_bytes().to_vec();
    let op = if is_dir {
        Op::Mkdir {
            dir,
            name: name_bytes,
            mode,
            owner: Owner::ROOT,
        }
    } else {
        Op::Create {
            dir,
            name: name_bytes,
            mode,
            owner: Owner::ROOT,
        }
    };
    stat_of(client.call(op), name).ino
}

/// Every name in directory `dir`, by readdir.
fn names_in(client: &mut Client, dir: u64) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut cookie = 0;
    loop {
        let entries = match client.call(Op::Readdir {
            dir,
            cookie,
            max: 64,
        }) {
            Ok(Reply::Entries(e)) => e,
            other => panic!("readdir: {other:?}"),
        };
        let Some(last) = entries.last() else {
            return out;
        };
        cookie = last.cookie;
        for e in entries {
            let name = String::from_utf8(e.name).expect("test names are UTF-8");
            if name != "." && name != ".." {
                out.insert(name, e.ino);
            }
        }
    }
}

/// One writer: its own directory, files it creates, grows, tags and removes, each change
/// checked at once through lookups that may run in this thread.
/// What a writer leaves: its files' names, sizes and tags.
type Left = BTreeMap<String, (u64, u8)>;

/// Returns its steps, the reads it ran itself and what it leaves.
fn writer(client: &mut Client, seed: u64, index: usize, deadline: Instant) -> (u64, u64, Left) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ ((index as u64 + 1) * 0x9e37));
    let dir_name = format!("w{index}");
    let dir = mkdir(client, ROOT, &dir_name);
    // name -> (ino, size, tag)
    let mut files: BTreeMap<String, (u64, u64, u8)> = BTreeMap::new();
    // What each file holds: every write lays its tag's byte.
    let mut contents: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut next = 0u64;
    let mut steps = 0u64;
    let mut reads_here = 0;
    while Instant::now() < deadline {
        steps += 1;
        let what = format!("seed {seed} writer {index} step {steps}");
        match rng.random_range(0..10) {
            0..=3 => {
                let name = format!("f{next:05}");
                next += 1;
                let ino = create(client, dir, &name);
                files.insert(name, (ino, 0, 0));
                contents.insert(ino, Vec::new());
            }
            4..=6 if !files.is_empty() => {
                let at = rng.random_range(0..files.len());
                let (name, entry) = files.iter_mut().nth(at).expect("in range");
                let grow = rng.random_range(1..9000u64);
                entry.2 = entry.2.wrapping_add(1);
                client
                    .call(Op::Write {
                        ino: entry.0,
                        offset: entry.1,
                        data: vec![entry.2; grow as usize].into(),
                    })
                    .unwrap_or_else(|e| panic!("{what}: write {name}: {e}"));
                entry.1 += grow;
                let content = contents.get_mut(&entry.0).expect("every file has contents");
                content.resize(entry.1 as usize, entry.2);
                let tag = [entry.2];
                client
                    .call(Op::SetXattr {
                        ino: entry.0,
                        name: b"user.tag".to_vec(),
                        value: tag.to_vec(),
                        flags: XattrFlags::default(),
                    })
                    .unwrap_or_else(|e| panic!("{what}: setxattr {name}: {e}"));
                let got = client.call(Op::Walk {
                    from: ROOT,
                    path: vec![dir_name.clone().into_bytes(), name.clone().into_bytes()],
                    then: Box::new(Op::GetXattr {
                        ino: 0,
                        name: b"user.tag".to_vec(),
                    }),
                });
                match got {
                    Ok(Reply::Data(d)) => assert_eq!(d, tag, "{what}: xattr of {name}"),
                    other => panic!("{what}: getxattr {name}: {other:?}"),
                }
            }
            7 if !files.is_empty() => {
                // Two reads of a random range: the first after a write moves the access
                // time (the reactor's), the second may run here.
                let at = rng.random_range(0..files.len());
                let (name, &(ino, size, _)) = files.iter().nth(at).expect("in range");
                let offset = rng.random_range(0..=size);
                let len = rng.random_range(0..20_000usize);
                let content = &contents[&ino];
                let want = &content[offset as usize..(offset as usize + len).min(content.len())];
                for _ in 0..2 {
                    let before = client.requests_ran_here();
                    let read = client.call(Op::Read { ino, offset, len });
                    reads_here += client.requests_ran_here() - before;
                    match read {
                        Ok(Reply::Data(d)) => {
                            assert!(d == want, "{what}: read {len} at {offset} of {name}")
                        }
                        other => panic!("{what}: read of {name}: {other:?}"),
                    }
                }
            }
            8 if !files.is_empty() => {
                let at = rng.random_range(0..files.len());
                let name = files.keys().nth(at).expect("in range").clone();
                client
                    .call(Op::Unlink {
                        dir,
                        name: name.clone().into_bytes(),
                    })
                    .unwrap_or_else(|e| panic!("{what}: unlink {name}: {e}"));
                let (ino, ..) = files.remove(&name).expect("present");
                contents.remove(&ino);
                match walk_stat(client, &[&dir_name, &name]) {
                    Err(EngineError::NotFound) => {}
                    other => panic!("{what}: {name} after its unlink: {other:?}"),
                }
            }
            _ => {
                let listed = names_in(client, dir);
                let want: BTreeMap<String, u64> =
                    files.iter().map(|(n, e)| (n.clone(), e.0)).collect();
                assert_eq!(listed, want, "{what}: readdir of {dir_name}");
            }
        }
        // Every file this writer has, as it left it.
        if let Some((name, &(ino, size, _))) = files.iter().nth(steps as usize % files.len().max(1))
        {
            let s = stat_of(walk_stat(client, &[&dir_name, name]), &what);
            assert_eq!((s.ino, s.size), (ino, size), "{what}: stat of {name}");
            let s = stat_of(client.call(Op::Stat { ino }), &what);
            assert_eq!(s.size, size, "{what}: fstat of {name}");
        }
    }
    let left = files
        .into_iter()
        .map(|(name, (_, size, tag))| (name, (size, tag)))
        .collect();
    (steps, reads_here, left)
}

/// One reader: files nobody changes, looked up over and over.
fn reader(client: &mut Client, seed: u64, fixed: &[(String, u64, u64)], deadline: Instant) -> u64 {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5eed);
    let mut steps = 0;
    while Instant::now() < deadline {
        steps += 1;
        let (name, ino, size) = &fixed[rng.random_range(0..fixed.len())];
        let s = stat_of(
            walk_stat(client, &["fixed", name]),
            &format!("seed {seed} reader step {steps}"),
        );
        assert_eq!((s.ino, s.size), (*ino, *size), "seed {seed}: {name}");
        match walk_stat(client, &["fixed", "no-such-name"]) {
            Err(EngineError::NotFound) => {}
            other => panic!("seed {seed}: a missing name: {other:?}"),
        }
        if steps % 64 == 0 {
            // Let the reactor fall asleep now and then: that is when callers run.
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    steps
}

#[test]
fn lookups_run_by_callers_see_every_answered_change() {
    let seed = nvme::wrap::seed_from_env();
    let dir = tempfile::tempdir().unwrap();
    let runtime = Runtime::start(config(&dir)).expect("start");
    let mut setup = runtime.client(64);
    let fixed_dir = mkdir(&mut setup, ROOT, "fixed");
    let fixed: Vec<(String, u64, u64)> = (0..600)
        .map(|i| {
            let name = format!("file-with-a-long-name-{i:04}");
            let ino = create(&mut setup, fixed_dir, &name);
            let size = (i % 7) as u64 * 100;
            if size > 0 {
                setup
                    .call(Op::Write {
                        ino,
                        offset: 0,
                        data: vec![1; size as usize].into(),
                    })
                    .unwrap();
            }
            (name, ino, size)
        })
        .collect();
    // A commit first, so the trees are on the device and the small cache must re-read them.
    setup.call(Op::Sync).expect("sync");
    let deadline = Instant::now() + Duration::from_secs(3);
    let ((writes, reads_here, left), reads) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..2)
            .map(|i| {
                let mut c = runtime.client(64);
                s.spawn(move || writer(&mut c, seed, i, deadline))
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let mut c = runtime.client(64);
                let fixed = &fixed;
                s.spawn(move || reader(&mut c, seed, fixed, deadline))
            })
            .collect();
        let mut w = (0, 0, Vec::new());
        for t in writers {
            let (steps, here, left) = t.join().unwrap();
            w.0 += steps;
            w.1 += here;
            w.2.push(left);
        }
        let r: u64 = readers.into_iter().map(|t| t.join().unwrap()).sum();
        (w, r)
    });
    let stats = match setup.call(Op::Stats) {
        Ok(Reply::Stats(s)) => s,
        other => panic!("stats: {other:?}"),
    };
    println!(
        "writer steps {writes} ({reads_here} reads ran in the writer), reader steps {reads}; \
         clients ran {} requests themselves ({} changes; {} nodes read beside the queue, {} \
         of them from writes in flight), {} missed memory and went to the reactor; reactor \
         ops {}",
        stats.caller_ran,
        stats.fetch.lent_changes,
        stats.device_waits.lent_reads,
        stats.device_waits.lent_reads_from_writes,
        stats.caller_missed,
        stats.ops
    );
    assert!(
        stats.fetch.lent_changes > 0,
        "no change ever ran in a client"
    );
    assert!(stats.caller_ran > 0, "no client ever ran a request itself");
    assert!(reads_here > 0, "no read ever ran in its caller");
    assert!(
        stats.caller_missed > 0,
        "a cache of 48 nodes never missed: the test does not reach the hand-over"
    );
    runtime.shutdown().expect("clean shutdown");

    // Mounted again: every change a client ran is on the device, as its writer left it.
    let runtime = Runtime::start(Config {
        mkfs: None,
        ..config(&dir)
    })
    .expect("remount");
    let mut client = runtime.client(64);
    for (index, left) in left.iter().enumerate() {
        let dir_name = format!("w{index}");
        let dir = stat_of(walk_stat(&mut client, &[&dir_name]), &dir_name).ino;
        let listed: Vec<String> = names_in(&mut client, dir).into_keys().collect();
        let want: Vec<String> = left.keys().cloned().collect();
        assert_eq!(listed, want, "seed {seed}: {dir_name} after the remount");
        for (name, &(size, tag)) in left {
            let s = stat_of(walk_stat(&mut client, &[&dir_name, name]), name);
            assert_eq!(s.size, size, "seed {seed}: size of {dir_name}/{name}");
            if tag > 0 {
                match client.call(Op::GetXattr {
                    ino: s.ino,
                    name: b"user.tag".to_vec(),
                }) {
                    Ok(Reply::Data(d)) => assert_eq!(d, [tag], "seed {seed}: {name}'s tag"),
                    other => panic!("seed {seed}: {name}'s tag: {other:?}"),
                }
            }
        }
    }
    runtime.shutdown().expect("clean shutdown");
}

#[test]
fn a_runtime_that_does_not_lend_runs_every_request_itself() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = Runtime::start(Config {
        callers_run: false,
        ..config(&dir)
    })
    .expect("start");
    let mut client = runtime.client(64);
    create(&mut client, ROOT, "a");
    for _ in 0..200 {
        stat_of(walk_stat(&mut client, &["a"]), "stat");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(client.requests_ran_here(), 0);
    let sent = client.requests_sent();
    assert_eq!(sent, 201, "every call is one request");
    runtime.shutdown().expect("clean shutdown");
}

/// Data reads a client runs itself: with the data cache off, a read whose nodes are in
/// memory reads its blocks beside the queue in the client's thread. One thread rewrites its
/// own file (random blocks, an fdatasync now and then: write-backs and commits in flight
/// under the reads) and checks each range it reads against its model; readers check a file
/// nobody changes. After a remount the rewritten file holds the model's bytes.
#[test]
fn data_reads_run_by_callers_return_the_bytes_the_reactor_would() {
    const FILE_BYTES: usize = 1 << 20;
    let seed = nvme::wrap::seed_from_env();
    let dir = tempfile::tempdir().unwrap();
    let data_config = || {
        let mut c = config(&dir);
        // Beside the queue even on a quiet machine (by default only while the cores are
        // shared with other work).
        c.callers_device_always = true;
        c.mount.data_cache_blocks = 0;
        // Nodes for the file's extents stay in memory; the data never does.
        c.mount.cache_nodes = 4096;
        c
    };
    let runtime = Runtime::start(data_config()).expect("start");
    let mut setup = runtime.client(64);
    let pattern = |salt: u64| -> Vec<u8> {
        let mut r = Xoshiro256PlusPlus::seed_from_u64(seed ^ salt);
        (0..FILE_BYTES).map(|_| r.random()).collect()
    };
    let fixed_bytes = pattern(1);
    let mut model = pattern(2);
    let fixed = create(&mut setup, ROOT, "fixed");
    let rewritten = create(&mut setup, ROOT, "rewritten");
    for (ino, bytes) in [(fixed, &fixed_bytes), (rewritten, &model)] {
        for (i, chunk) in bytes.chunks(128 << 10).enumerate() {
            setup
                .call(Op::Write {
                    ino,
                    offset: (i * (128 << 10)) as u64,
                    data: chunk.to_vec().into(),
                })
                .unwrap();
        }
    }
    setup.call(Op::Sync).expect("sync");
    let deadline = Instant::now() + Duration::from_secs(3);
    let random_range = |rng: &mut Xoshiro256PlusPlus| {
        let offset = rng.random_range(0..FILE_BYTES as u64);
        let len = rng.random_range(1..20_000usize);
        (offset, len)
    };
    // A read as a call, or into a buffer of the caller's holding anything (`read_into`: a
    // read run here copies straight into it), answered alike.
    let read = |c: &mut Client, rng: &mut Xoshiro256PlusPlus, ino, offset, len| {
        if rng.random() {
            return c.call(Op::Read { ino, offset, len });
        }
        let mut buf = vec![rng.random::<u8>() | 1; len];
        c.read_into(ino, offset, &mut buf)
            .map(|n| Reply::Data(buf[..n].to_vec()))
    };
    let check =
        |got: Result<Reply, EngineError>, want: &[u8], offset: u64, len: usize, who: &str| {
            let end = (offset as usize + len).min(want.len());
            match got {
                Ok(Reply::Data(d)) => assert!(
                    d == want[offset as usize..end],
                    "seed {seed}: {who} read {len} at {offset}: wrong bytes"
                ),
                other => panic!("seed {seed}: {who} read {len} at {offset}: {other:?}"),
            }
        };
    let (writer_reads_here, reader_steps) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2u64)
            .map(|index| {
                let mut c = runtime.client(64);
                let want = &fixed_bytes;
                s.spawn(move || {
                    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ (index + 10));
                    let mut steps = 0u64;
                    while Instant::now() < deadline {
                        steps += 1;
                        let (offset, len) = random_range(&mut rng);
                        let got = read(&mut c, &mut rng, fixed, offset, len);
                        check(got, want, offset, len, "a reader");
                        if steps % 32 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                    steps
                })
            })
            .collect();
        let mut c = runtime.client(64);
        let model = &mut model;
        let writer = s.spawn(move || {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 3);
            let mut steps = 0u64;
            while Instant::now() < deadline {
                steps += 1;
                if rng.random_ratio(1, 3) {
                    let (offset, len) = random_range(&mut rng);
                    let len = len.min(FILE_BYTES - offset as usize);
                    let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                    model[offset as usize..offset as usize + len].copy_from_slice(&data);
                    c.call(Op::Write {
                        ino: rewritten,
                        offset,
                        data: data.into(),
                    })
                    .unwrap();
                    if rng.random_ratio(1, 4) {
                        c.call(Op::Fdatasync { ino: rewritten }).unwrap();
                    }
                }
                let (offset, len) = random_range(&mut rng);
                let got = read(&mut c, &mut rng, rewritten, offset, len);
                check(got, model, offset, len, "the writer");
                if steps % 32 == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            c.requests_ran_here()
        });
        let steps: u64 = readers.into_iter().map(|t| t.join().unwrap()).sum();
        (writer.join().unwrap(), steps)
    });
    let stats = match setup.call(Op::Stats) {
        Ok(Reply::Stats(s)) => s,
        other => panic!("stats: {other:?}"),
    };
    println!(
        "reader steps {reader_steps}, writer ran {writer_reads_here} requests itself ({} \
         writes, {} fsyncs); reads beside the queue {} ({} blocks; {} device reads of them, \
         {} blocks from writes in flight); reactor device reads {}",
        stats.fetch.lent_writes,
        stats.fetch.lent_fsyncs,
        stats.reads.lent_reads,
        stats.reads.lent_read_blocks,
        stats.device_waits.lent_reads,
        stats.device_waits.lent_reads_from_writes,
        stats.reads.device_reads_done,
    );
    assert!(
        stats.reads.lent_reads > 0 && stats.reads.lent_read_blocks > 0,
        "no data read ran beside the queue"
    );
    assert!(stats.fetch.lent_writes > 0, "no write ran in its caller");
    assert!(stats.fetch.lent_fsyncs > 0, "no fsync ran in its caller");
    runtime.shutdown().expect("clean shutdown");

    let runtime = Runtime::start(Config {
        mkfs: None,
        ..data_config()
    })
    .expect("remount");
    let mut client = runtime.client(64);
    for offset in (0..FILE_BYTES).step_by(128 << 10) {
        let got = client.call(Op::Read {
            ino: rewritten,
            offset: offset as u64,
            len: 128 << 10,
        });
        check(got, &model, offset as u64, 128 << 10, "after the remount");
    }
    runtime.shutdown().expect("clean shutdown");
}

/// A submit made with nothing else of the client's in flight may run in the client while the
/// reactor sleeps: its completion comes at the next poll with its token, calls and submits
/// mixed keep their answers apart, and the submits that went to the reactor still come back.
#[test]
fn submits_run_by_their_caller_complete_at_the_next_poll() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = Runtime::start(config(&dir)).expect("start");
    let mut client = runtime.client(64);
    let ino = create(&mut client, ROOT, "f");
    let bytes: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
    client
        .call(Op::Write {
            ino,
            offset: 0,
            data: bytes.clone().into(),
        })
        .unwrap();
    client.call(Op::Sync).expect("sync");
    let mut out = Vec::new();
    for round in 0..400u64 {
        let offset = (round * 1000) % 12000;
        // One alone (may run here), then four at once (the rest go to the reactor).
        let depth = if round % 2 == 0 { 1 } else { 4 };
        for k in 0..depth {
            client
                .submit(
                    Op::Read {
                        ino,
                        offset: offset + k,
                        len: 3000,
                    },
                    round * 10 + k,
                )
                .expect("room");
        }
        let mut seen = Vec::new();
        while seen.len() < depth as usize {
            out.clear();
            client.wait(&mut out, Duration::from_secs(5));
            assert!(!out.is_empty(), "round {round}: a completion went missing");
            for c in out.drain(..) {
                let k = c.token - round * 10;
                assert!(k < depth, "round {round}: a stranger's token {}", c.token);
                let at = (offset + k) as usize;
                match c.result {
                    Ok(Reply::Data(d)) => assert_eq!(d, bytes[at..at + 3000], "round {round}"),
                    other => panic!("round {round}: {other:?}"),
                }
                seen.push(k);
            }
        }
        assert_eq!(client.in_flight(), 0);
        // A call between submits gets its own answer.
        let s = stat_of(client.call(Op::Stat { ino }), "stat");
        assert_eq!(s.size, bytes.len() as u64);
        if round % 8 == 0 {
            std::thread::sleep(Duration::from_micros(300));
        }
    }
    assert!(
        client.requests_ran_here() > 0,
        "no submit or call ever ran in its caller"
    );
    runtime.shutdown().expect("clean shutdown");
}
