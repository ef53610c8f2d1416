//! The reactor under load from many client threads: seeded random workloads checked against
//! per-client models and after a remount, rename storms across directories, grouped fsyncs,
//! shutdown under load, power cuts during multi-client fsync workloads, and idle behaviour.
//! Seeds print; `COREFS_SEED=N` replays.

use engine::{EngineError, Filesystem, MkfsOptions, MountOptions, RenameFlags};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image, CrashMode, RecordingDevice};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reactor::{Client, Config, IdlePolicy, Op, Reply, Runtime};
use std::collections::BTreeMap;
use std::time::Duration;

const ROOT: u64 = 256;

fn file_config(dir: &tempfile::TempDir, idle: IdlePolicy) -> Config {
    file_config_n(dir, idle, 1)
}

/// The file-backed config with `reactors` reactors (each holds every `reactors`-th shard).
fn file_config_n(dir: &tempfile::TempDir, idle: IdlePolicy, reactors: usize) -> Config {
    Config {
        reactors,
        device: format!("file:{}/fs.img,size=128MiB", dir.path().display()),
        mkfs: Some(MkfsOptions {
            shards: 8,
            label: "reactor".into(),
            ..Default::default()
        }),
        idle,
        ..Default::default()
    }
}

fn ino_of(reply: Reply) -> u64 {
    match reply {
        Reply::Stat(s) => s.ino,
        other => panic!("expected a stat, got {other:?}"),
    }
}

fn data_of(reply: Reply) -> Vec<u8> {
    match reply {
        Reply::Data(d) => d,
        other => panic!("expected data, got {other:?}"),
    }
}

/// Creates `count` files `<prefix>0`, `<prefix>1`, ... in the root; returns their inodes.
fn create_files(client: &mut Client, prefix: &str, count: usize) -> Vec<u64> {
    (0..count)
        .map(|i| {
            ino_of(
                client
                    .call(Op::Create {
                        dir: ROOT,
                        name: format!("{prefix}{i}").into_bytes(),
                        mode: 0o644,
                        owner: reactor::Owner::ROOT,
                    })
                    .unwrap(),
            )
        })
        .collect()
}

/// A formatted memory device (4 KiB LBAs) of `capacity` bytes and its config.
fn formatted_mem(
    capacity: u64,
    buf_bytes: usize,
    shards: u32,
) -> (MemConfig, Box<dyn nvme::BlockDevice>) {
    let mem = MemConfig {
        capacity_bytes: capacity,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes,
        buf_count: 64,
    };
    let dev = Filesystem::mkfs(
        Box::new(MemDevice::new(mem).unwrap()),
        &MkfsOptions {
            shards,
            label: "reactor".into(),
            ..Default::default()
        },
    )
    .unwrap();
    (mem, dev)
}

/// Mounts what the runtime left on `device` and runs the checker.
fn remount_checked(device: &str) -> Filesystem {
    let dev = nvme::open_device(device, &nvme::OpenOptions::default()).unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    fs.check().unwrap();
    fs
}

fn mkdir(client: &mut Client, dir: u64, name: &str) -> u64 {
    ino_of(
        client
            .call(Op::Mkdir {
                dir,
                name: name.into(),
                mode: 0o755,
                owner: reactor::Owner::ROOT,
            })
            .unwrap(),
    )
}

/// One client's random workload in its own directory, checked against its model as it goes.
/// Returns the model (file name → content) as last fsynced... and as last written.
fn client_workload(
    client: &mut Client,
    dir: u64,
    seed: u64,
    ops: usize,
) -> BTreeMap<String, Vec<u8>> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut model: BTreeMap<String, (u64, Vec<u8>)> = BTreeMap::new();
    for step in 0..ops {
        let name = format!("f{}", rng.random_range(0..6));
        match rng.random_range(0..10) {
            0..=1 if !model.contains_key(&name) => {
                let ino = ino_of(
                    client
                        .call(Op::Create {
                            dir,
                            name: name.clone().into_bytes(),
                            mode: 0o644,
                            owner: reactor::Owner::ROOT,
                        })
                        .unwrap(),
                );
                model.insert(name, (ino, Vec::new()));
            }
            2..=5 if model.contains_key(&name) => {
                let (ino, content) = model.get_mut(&name).unwrap();
                let offset = rng.random_range(0..=content.len() as u64 + 100);
                let len = rng.random_range(1..9000);
                let byte = rng.random::<u8>();
                let data = vec![byte; len];
                client
                    .call(Op::Write {
                        ino: *ino,
                        offset,
                        data: data.clone().into(),
                    })
                    .unwrap();
                let end = offset as usize + len;
                if content.len() < end {
                    content.resize(end, 0);
                }
                content[offset as usize..end].copy_from_slice(&data);
            }
            6 if model.contains_key(&name) => {
                let (ino, content) = &model[&name];
                let got = data_of(
                    client
                        .call(Op::Read {
                            ino: *ino,
                            offset: 0,
                            len: content.len() + 10,
                        })
                        .unwrap(),
                );
                assert_eq!(&got, content, "seed {seed} step {step}: read of {name}");
            }
            7 if model.contains_key(&name) => {
                let (ino, _) = model[&name];
                client.call(Op::Fsync { ino }).unwrap();
            }
            8 if model.contains_key(&name) => {
                let to = format!("g{}", rng.random_range(0..3));
                if model.contains_key(&to) {
                    continue;
                }
                client
                    .call(Op::Rename {
                        from_dir: dir,
                        from: name.clone().into_bytes(),
                        to_dir: dir,
                        to: to.clone().into_bytes(),
                        flags: RenameFlags::default(),
                    })
                    .unwrap();
                let entry = model.remove(&name).unwrap();
                model.insert(to, entry);
            }
            9 if model.contains_key(&name) => {
                client
                    .call(Op::Unlink {
                        dir,
                        name: name.clone().into_bytes(),
                    })
                    .unwrap();
                model.remove(&name);
            }
            _ => {}
        }
    }
    model.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

fn read_dir_model(fs: &mut Filesystem, dir: u64) -> BTreeMap<String, Vec<u8>> {
    fs.readdir(dir, 0, 1000)
        .unwrap()
        .into_iter()
        .map(|e| {
            let size = fs.stat(e.ino).unwrap().size as usize;
            (
                String::from_utf8(e.name).unwrap(),
                fs.read(e.ino, 0, size).unwrap(),
            )
        })
        .collect()
}

fn stress(idle: IdlePolicy, clients: usize, reactors: usize) {
    let seed = nvme::wrap::seed_from_env();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = file_config_n(&dir, idle, reactors);
    let device = config.device.clone();
    let runtime = Runtime::start(config).unwrap();
    let mut setup = runtime.client(4);
    let dirs: Vec<u64> = (0..clients)
        .map(|i| mkdir(&mut setup, ROOT, &format!("c{i}")))
        .collect();
    let models: Vec<BTreeMap<String, Vec<u8>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = dirs
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let mut client = runtime.client(8);
                scope.spawn(move || client_workload(&mut client, d, seed ^ i as u64, 400))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stats = runtime.shutdown().unwrap();
    assert!(stats.ops > 0);
    // A file image's completions ring each reactor's doorbell: a sleeping one wakes for them,
    // and a busy-polling one sleeps too while its cores are shared (reactor::contention).
    assert_eq!(stats.device_ring_reactors, reactors as u64, "seed {seed}");
    // Remount what shutdown committed: every client's directory is exactly its model.
    let mut fs = remount_checked(&device);
    for (i, (&d, model)) in dirs.iter().zip(&models).enumerate() {
        assert_eq!(
            &read_dir_model(&mut fs, d),
            model,
            "client {i}, seed {seed}"
        );
    }
}

#[test]
fn many_clients_against_their_models_spin_then_park() {
    stress(IdlePolicy::default(), 8, 1);
}

#[test]
fn many_clients_against_their_models_two_reactors() {
    stress(IdlePolicy::default(), 8, 2);
}

#[test]
fn many_clients_against_their_models_busy_poll() {
    stress(IdlePolicy::BusyPoll, 4, 1);
}

#[test]
fn rename_storm_across_directories_keeps_every_name_in_one_place() {
    rename_storm(1);
}

/// With two reactors the directories are spread over both: most renames span reactors.
#[test]
fn rename_storm_across_reactors_keeps_every_name_in_one_place() {
    rename_storm(2);
}

fn rename_storm(reactors: usize) {
    let seed = nvme::wrap::seed_from_env();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = file_config_n(&dir, IdlePolicy::default(), reactors);
    let device = config.device.clone();
    let runtime = Runtime::start(config).unwrap();
    let mut setup = runtime.client(4);
    let dirs: Vec<u64> = (0..4)
        .map(|i| mkdir(&mut setup, ROOT, &format!("d{i}")))
        .collect();
    let files = 40;
    for f in 0..files {
        setup
            .call(Op::Create {
                dir: dirs[0],
                name: format!("n{f}").into_bytes(),
                mode: 0o644,
                owner: reactor::Owner::ROOT,
            })
            .unwrap();
    }
    std::thread::scope(|scope| {
        for t in 0..6u64 {
            let mut client = runtime.client(4);
            let dirs = dirs.clone();
            scope.spawn(move || {
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ t);
                for _ in 0..300 {
                    let name = format!("n{}", rng.random_range(0..files)).into_bytes();
                    let from = dirs[rng.random_range(0..dirs.len())];
                    let to = dirs[rng.random_range(0..dirs.len())];
                    // Racing renames: the name may have moved; only NotFound is expected.
                    match client.call(Op::Rename {
                        from_dir: from,
                        from: name.clone(),
                        to_dir: to,
                        to: name,
                        flags: RenameFlags::default(),
                    }) {
                        Ok(_) | Err(EngineError::NotFound) => {}
                        Err(e) => panic!("seed {seed}: rename failed: {e}"),
                    }
                    if rng.random_bool(0.1) {
                        client.call(Op::Fsync { ino: to }).unwrap();
                    }
                }
            });
        }
    });
    runtime.shutdown().unwrap();
    let mut fs = remount_checked(&device);
    let mut names: Vec<Vec<u8>> = dirs
        .iter()
        .flat_map(|&d| fs.readdir(d, 0, 1000).unwrap().into_iter().map(|e| e.name))
        .collect();
    names.sort();
    let mut expected: Vec<Vec<u8>> = (0..files).map(|f| format!("n{f}").into_bytes()).collect();
    expected.sort();
    assert_eq!(names, expected, "seed {seed}: every name exactly once");
}

#[test]
fn fsyncs_queued_together_share_one_log_record() {
    fsyncs_grouped(1);
}

#[test]
fn fsyncs_queued_together_share_one_log_record_per_reactor() {
    fsyncs_grouped(2);
}

fn fsyncs_grouped(reactors: usize) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::start(file_config_n(&dir, IdlePolicy::default(), reactors)).unwrap();
    assert_eq!(runtime.reactors(), reactors);
    let mut client = runtime.client(64);
    let inos = create_files(&mut client, "f", 16);
    client.call(Op::Sync).unwrap();
    for round in 0..20u8 {
        // A write of each file, then every fsync, submitted without waiting: the fsyncs that
        // reach the reactor in one batch become one record.
        for (i, &ino) in inos.iter().enumerate() {
            let data = vec![round ^ i as u8; 4096];
            client
                .submit(
                    Op::Write {
                        ino,
                        offset: round as u64 * 4096,
                        data: data.into(),
                    },
                    i as u64,
                )
                .unwrap();
        }
        for &ino in &inos {
            client.submit(Op::Fsync { ino }, 1000 + ino).unwrap();
        }
        let mut done = Vec::new();
        while client.in_flight() > 0 {
            client.wait(&mut done, Duration::from_secs(5));
        }
        assert_eq!(done.len(), 32);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    }
    let stats = stats_of(&mut client);
    assert_eq!(stats.log.fsyncs, 320);
    assert!(
        stats.fsync_groups < 320 && stats.fsync_group_max >= 2,
        "no fsyncs were grouped: {stats:?}"
    );
    assert!(stats.log.log_writes <= stats.fsync_groups);
    assert_eq!(stats.fsync_total.count, 320);
    assert_eq!(stats.log.fallback_commits(), 0, "{stats:?}");
    runtime.shutdown().unwrap();
}

#[test]
fn reads_queued_together_are_served_together_and_in_order_with_writes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::start(file_config(&dir, IdlePolicy::default())).unwrap();
    let mut client = runtime.client(64);
    let inos = create_files(&mut client, "r", 4);
    let busy = create_files(&mut client, "busy", 1)[0];
    let block = |ino: u64, b: u64, version: u8| -> Vec<u8> {
        (0..4096u64)
            .map(|i| (i ^ ino ^ (b * 7)) as u8 ^ version)
            .collect()
    };
    for &ino in &inos {
        for b in 0..64 {
            client
                .call(Op::Write {
                    ino,
                    offset: b * 4096,
                    data: block(ino, b, 0).into(),
                })
                .unwrap();
        }
    }
    client.call(Op::Sync).unwrap();
    // A large write into another file keeps the reactor busy for milliseconds (copying and
    // staging 8 MiB) while the reads below queue up behind it, so they reach it together.
    // (A commit's I/O no longer does: the reactor hears requests while it waits for the
    // device, and these reads come from its cache in microseconds.)
    client
        .submit(
            Op::Write {
                ino: busy,
                offset: 0,
                data: vec![7; 8 << 20].into(),
            },
            7_777,
        )
        .unwrap();
    // 16 reads, an overwrite of a block they read, 16 more reads: the second run must see the
    // new data, the first the old, whatever the grouping.
    let mut expected = BTreeMap::new();
    let mut token = 0u64;
    for version in [0u8, 1] {
        if version == 1 {
            client
                .submit(
                    Op::Write {
                        ino: inos[0],
                        offset: 0,
                        data: block(inos[0], 0, 1).into(),
                    },
                    9_999,
                )
                .unwrap();
        }
        for i in 0..16u64 {
            let ino = inos[(i % 4) as usize];
            let b = if i % 5 == 0 { 0 } else { (i * 13) % 64 };
            let v = if ino == inos[0] && b == 0 { version } else { 0 };
            client
                .submit(
                    Op::Read {
                        ino,
                        offset: b * 4096,
                        len: 4096,
                    },
                    token,
                )
                .unwrap();
            expected.insert(token, block(ino, b, v));
            token += 1;
        }
    }
    let mut done = Vec::new();
    while client.in_flight() > 0 {
        client.wait(&mut done, Duration::from_secs(5));
    }
    assert_eq!(done.len(), 34);
    for c in done {
        if c.token == 9_999 || c.token == 7_777 {
            c.result.unwrap();
            continue;
        }
        assert_eq!(
            data_of(c.result.unwrap()),
            expected[&c.token],
            "read {}",
            c.token
        );
    }
    let stats = stats_of(&mut client);
    assert!(
        stats.read_groups >= 1,
        "no reads were served together: {stats:?}"
    );
    runtime.shutdown().unwrap();
}

#[test]
fn shutdown_under_load_keeps_every_acknowledged_fsync() {
    shutdown_under_load(1);
}

#[test]
fn shutdown_of_two_reactors_under_load_keeps_every_acknowledged_fsync() {
    shutdown_under_load(2);
}

fn shutdown_under_load(reactors: usize) {
    let seed = nvme::wrap::seed_from_env();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = file_config_n(&dir, IdlePolicy::default(), reactors);
    let device = config.device.clone();
    let runtime = Runtime::start(config).unwrap();
    let mut setup = runtime.client(4);
    let inos = create_files(&mut setup, "w", 4);
    let acknowledged: Vec<u64> = std::thread::scope(|scope| {
        let handles: Vec<_> = inos
            .iter()
            .map(|&ino| {
                let mut client = runtime.client(4);
                scope.spawn(move || {
                    // Append + fsync until the reactor stops; count the acknowledged blocks.
                    let mut acked = 0u64;
                    loop {
                        let data = vec![(acked % 251) as u8; 4096];
                        let write = client.call(Op::Write {
                            ino,
                            offset: acked * 4096,
                            data: data.into(),
                        });
                        if write.is_err() || client.call(Op::Fsync { ino }).is_err() {
                            return acked;
                        }
                        acked += 1;
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let stats = runtime.shutdown().unwrap();
        assert!(stats.log.fsyncs > 0);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut fs = remount_checked(&device);
    for (&ino, &acked) in inos.iter().zip(&acknowledged) {
        assert!(acked > 0, "seed {seed}: a writer made no progress");
        let data = fs.read(ino, 0, acked as usize * 4096).unwrap();
        assert_eq!(data.len() as u64, acked * 4096);
        for b in 0..acked {
            assert_eq!(data[b as usize * 4096], (b % 251) as u8);
        }
    }
}

#[test]
fn a_power_cut_during_multi_client_fsyncs_loses_no_acknowledged_fsync() {
    power_cut_during_fsyncs(1, false);
}

/// Clients write their fsyncs' records beside the queue whenever the reactor lends its
/// engine (by default only while the cores are shared): the cuts fall between those
/// synchronous writes and flushes and the reactor's own.
#[test]
fn a_power_cut_during_fsyncs_run_by_callers_loses_no_acknowledged_fsync() {
    power_cut_during_fsyncs(1, true);
}

/// Two reactors: their queues record into one write log (a flush covers every queue's
/// completed writes, as an NVMe flush covers the namespace), so the cuts see both streams.
#[test]
fn a_power_cut_under_two_reactors_loses_no_acknowledged_fsync() {
    power_cut_during_fsyncs(2, false);
}

/// `callers_device_always`: clients run fsyncs beside the queue even on a quiet machine.
fn power_cut_during_fsyncs(reactors: usize, callers_device_always: bool) {
    let seed = nvme::wrap::seed_from_env();
    let (mem, image, log, runtime) = recorded_runtime_with(reactors, "cut", |c| {
        c.callers_device_always = callers_device_always;
    });
    let mut setup = runtime.client(4);
    // A directory per client: with two reactors the directories spread over both, and each
    // file lives with its directory, so both reactors' log streams are written.
    let inos: Vec<u64> = (0..4)
        .map(|i| {
            let dir = mkdir(&mut setup, ROOT, &format!("d{i}"));
            ino_of(
                setup
                    .call(Op::Create {
                        dir,
                        name: b"c".to_vec(),
                        mode: 0o644,
                        owner: reactor::Owner::ROOT,
                    })
                    .unwrap(),
            )
        })
        .collect();
    if reactors == 2 {
        let on: std::collections::BTreeSet<u64> = inos.iter().map(|i| (i % 4) % 2).collect();
        assert_eq!(on.len(), 2, "the files are spread over both reactors");
    }
    // (write-log length when the fsync returned, inode, blocks acknowledged)
    let acks: Vec<(usize, u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = inos
            .iter()
            .map(|&ino| {
                let mut client = runtime.client(4);
                let log = log.clone();
                scope.spawn(move || {
                    let mut acks = Vec::new();
                    for b in 0..25u64 {
                        client
                            .call(Op::Write {
                                ino,
                                offset: b * 4096,
                                data: vec![(b + 1) as u8; 4096].into(),
                            })
                            .unwrap();
                        client.call(Op::Fsync { ino }).unwrap();
                        acks.push((log.len(), ino, b + 1));
                    }
                    acks
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let stats = stats_of(&mut setup);
    if callers_device_always {
        println!(
            "{} of 100 fsyncs ran in their caller, beside the queue ({} declined)",
            stats.fetch.lent_fsyncs, stats.fetch.lent_fsyncs_declined
        );
        assert!(stats.fetch.lent_fsyncs > 0, "no fsync ran in its caller");
    }
    drop(runtime);
    let records = log.snapshot();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut cuts: Vec<usize> = acks.iter().map(|a| a.0).collect();
    cuts.extend((0..40).map(|_| rng.random_range(0..=records.len())));
    for cut in cuts {
        for mode in [
            CrashMode::DurableOnly,
            CrashMode::Torn {
                seed: seed ^ cut as u64,
            },
        ] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let dev = MemDevice::from_image(&crashed, mem).unwrap();
            let mut fs = Filesystem::mount(Box::new(dev), MountOptions::default())
                .unwrap_or_else(|e| panic!("seed {seed} cut {cut} {mode:?}: mount: {e}"));
            fs.check()
                .unwrap_or_else(|e| panic!("seed {seed} cut {cut} {mode:?}: {e}"));
            for &ino in &inos {
                let promised = acks
                    .iter()
                    .filter(|a| a.1 == ino && a.0 <= cut)
                    .map(|a| a.2)
                    .max()
                    .unwrap_or(0);
                if promised == 0 {
                    continue;
                }
                let data = fs
                    .read(ino, 0, promised as usize * 4096)
                    .unwrap_or_else(|e| {
                        // The recorded run cannot be replayed (it depends on timing): the
                        // failure describes what it saw.
                        let mut by_log: Vec<_> = acks.clone();
                        by_log.sort();
                        panic!(
                            "seed {seed} cut {cut} of {} {mode:?}: inode {ino} with {promised} \
                             acknowledged blocks: {e}\ninodes {inos:?}\nacks (log length, \
                             inode, blocks): {:?}\nrecords: {}\nreactor stats: commits {} \
                             log {:?}",
                            records.len(),
                            &by_log[..by_log.len().min(16)],
                            describe_records(&records[..records.len().min(cut + 8)]),
                            stats.commit.commits,
                            stats.log,
                        )
                    });
                assert_eq!(
                    data.len() as u64,
                    promised * 4096,
                    "seed {seed} cut {cut} {mode:?}: inode {ino} lost acknowledged data"
                );
                for b in 0..promised {
                    assert_eq!(
                        data[b as usize * 4096],
                        (b + 1) as u8,
                        "seed {seed} cut {cut}"
                    );
                }
            }
        }
    }
}

#[test]
fn an_idle_reactor_parks_and_a_bad_device_is_an_error() {
    let runtime = Runtime::start(Config {
        device: "mem:64MiB".into(),
        mkfs: Some(MkfsOptions::default()),
        ..Default::default()
    })
    .unwrap();
    let mut client = runtime.client(2);
    let before = stats_of(&mut client);
    std::thread::sleep(Duration::from_millis(500));
    let after = stats_of(&mut client);
    assert!(after.parks > before.parks, "an idle reactor parks");
    runtime.shutdown().unwrap();

    let err = Runtime::start(Config {
        device: "nosuch:/dev/x".into(),
        ..Default::default()
    })
    .err()
    .expect("a bad device string fails the start");
    assert!(err.to_string().contains("nosuch"), "{err}");
}

/// A commit waited for (a sync, an fsync that falls back) does not wait for the idle park's
/// timer between its preparation steps: it once took a step per 500 ms park, so a sync (or
/// an fsync falling back) after creates in many directories waited seconds while the reactor
/// slept (10-15 s for a `dd conv=fsync` after `cp -a /usr/include` through the FUSE mount).
/// 40 directories of 100 new files each leave ~14 preparation steps; the reactor may park
/// at most on either side of the sync (the client's own pauses), not between its steps.
#[test]
fn a_waited_commit_takes_its_preparation_steps_without_parking() {
    let runtime = Runtime::start(Config {
        device: "mem:256MiB".into(),
        mkfs: Some(MkfsOptions::default()),
        ..Default::default()
    })
    .unwrap();
    let mut client = runtime.client(2);
    for d in 0..40 {
        let dir = mkdir(&mut client, ROOT, &format!("d{d}"));
        for f in 0..100 {
            client
                .call(Op::Create {
                    dir,
                    name: format!("f{f}").into_bytes(),
                    mode: 0o644,
                    owner: reactor::Owner::ROOT,
                })
                .unwrap();
        }
    }
    let before = stats_of(&mut client);
    client.call(Op::Sync).unwrap();
    let after = stats_of(&mut client);
    assert!(
        after.commit.commits > before.commit.commits,
        "the sync committed"
    );
    assert!(
        after.parks - before.parks <= 2,
        "the reactor parked {} times while the sync's commit prepared",
        after.parks - before.parks
    );
    runtime.shutdown().unwrap();
}

/// A device error under several clients' fsyncs (the records in flight): no fsync after the
/// failure is acknowledged, every later change fails read-only, shutdown still returns, and
/// a remount keeps every fsync that was acknowledged.
#[test]
fn a_device_error_under_concurrent_fsyncs_fails_stop_and_loses_nothing_acknowledged() {
    use nvme::wrap::{FaultConfig, FaultDevice};
    let seed = nvme::wrap::seed_from_env();
    let (mem, dev) = formatted_mem(64 << 20, 64 << 10, 4);
    let faulty = FaultDevice::new(
        dev,
        FaultConfig {
            seed,
            ..Default::default()
        },
    );
    let faults = faulty.handle();
    let runtime = Runtime::start_with_device(
        Config {
            device: "faulty mem".into(),
            ..Default::default()
        },
        Box::new(faulty),
    )
    .unwrap();
    let mut setup = runtime.client(4);
    let inos = create_files(&mut setup, "e", 4);
    setup.call(Op::Sync).unwrap();
    let failed = std::sync::atomic::AtomicBool::new(false);
    // Per client: the blocks whose fsync was acknowledged.
    let acked: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = inos
            .iter()
            .enumerate()
            .map(|(c, &ino)| {
                let mut client = runtime.client(4);
                let failed = &failed;
                let faults = &faults;
                scope.spawn(move || {
                    let mut acked = 0u64;
                    for i in 0..200u64 {
                        if c == 0 && i == 40 {
                            // One record write fails while the others run.
                            faults.fail_next(nvme::OpKind::Write, 1);
                        }
                        // Seen before this write was submitted: the filesystem had failed
                        // (the engine fails stop before it reports the error), so this write
                        // and fsync must fail. (An Ok that merely arrives after another
                        // client saw the error may have been durable before it: the remount
                        // below checks those.)
                        let failed_before = failed.load(std::sync::atomic::Ordering::SeqCst);
                        let w = client.call(Op::Write {
                            ino,
                            offset: i * 4096,
                            data: vec![(i as u8) ^ (c as u8); 4096].into(),
                        });
                        let f = w.and_then(|_| client.call(Op::Fsync { ino }));
                        match f {
                            Ok(_) => {
                                assert!(
                                    !failed_before,
                                    "seed {seed}: an fsync submitted after the failure was acknowledged"
                                );
                                acked = i + 1;
                            }
                            Err(_) => {
                                failed.store(true, std::sync::atomic::Ordering::SeqCst);
                                break;
                            }
                        }
                    }
                    (ino, acked)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        failed.load(std::sync::atomic::Ordering::SeqCst),
        "the fault never fired"
    );
    let mut client = runtime.client(4);
    assert!(
        matches!(
            client.call(Op::Write {
                ino: inos[0],
                offset: 0,
                data: vec![1; 10].into(),
            }),
            Err(EngineError::ReadOnly(_))
        ),
        "seed {seed}: not fail-stop"
    );
    drop(client);
    drop(setup);
    // The failed filesystem does not commit, but it stops and gives the device back.
    let (_, mut dev) = runtime.shutdown_into_device().unwrap();
    let mut image = vec![0u8; 64 << 20];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    let mut fs = Filesystem::mount(
        Box::new(MemDevice::from_image(&image, mem).unwrap()),
        MountOptions::default(),
    )
    .unwrap();
    fs.check().unwrap();
    eprintln!("seed {seed}: acknowledged per client {acked:?}");
    assert!(acked.iter().any(|&(_, n)| n > 0));
    for (c, &(ino, n)) in acked.iter().enumerate() {
        for i in 0..n {
            assert_eq!(
                fs.read(ino, i * 4096, 4096).unwrap(),
                vec![(i as u8) ^ (c as u8); 4096],
                "seed {seed}: client {c} block {i} was acknowledged"
            );
        }
    }
}

/// Many clients fill the device: every failing call fails with ENOSPC (nothing else), what
/// was fsynced survives a remount intact, deleting frees space and writes resume.
#[test]
fn clients_filling_the_device_get_enospc_and_lose_nothing_durable() {
    let seed = nvme::wrap::seed_from_env();
    let (mem, dev) = formatted_mem(24 << 20, 128 << 10, 2);
    let runtime = Runtime::start_with_device(
        Config {
            device: "small mem".into(),
            ..Default::default()
        },
        dev,
    )
    .unwrap();
    // Per client: (inode, bytes fsynced).
    let durable: Vec<Vec<(u64, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u8)
            .map(|c| {
                let mut client = runtime.client(4);
                scope.spawn(move || {
                    let mut files = Vec::new();
                    'outer: for f in 0..1000u32 {
                        let ino = match client.call(Op::Create {
                            dir: ROOT,
                            name: format!("c{c}-{f}").into_bytes(),
                            mode: 0o644,
                            owner: reactor::Owner::ROOT,
                        }) {
                            Ok(r) => ino_of(r),
                            Err(e) => {
                                assert_eq!(e.errno(), 28, "seed {seed}: create: {e}");
                                break;
                            }
                        };
                        let mut synced = 0u64;
                        for i in 0..8u64 {
                            let data = vec![c ^ i as u8; 64 << 10];
                            let r = client
                                .call(Op::Write {
                                    ino,
                                    offset: i * (64 << 10),
                                    data: data.into(),
                                })
                                .and_then(|_| client.call(Op::Fsync { ino }));
                            match r {
                                Ok(_) => synced = (i + 1) * (64 << 10),
                                Err(e) => {
                                    assert_eq!(e.errno(), 28, "seed {seed}: write/fsync: {e}");
                                    files.push((ino, synced));
                                    break 'outer;
                                }
                            }
                        }
                        files.push((ino, synced));
                    }
                    files
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut client = runtime.client(4);
    // Full: still a clean ENOSPC, and the filesystem is not failed.
    let err = client
        .call(Op::Write {
            ino: durable[0][0].0,
            offset: 1 << 30,
            data: vec![1; 1 << 20].into(),
        })
        .unwrap_err();
    assert_eq!(err.errno(), 28, "{err}");
    // Deleting frees space; after a commit a write goes through again.
    for c in 0..4u8 {
        for (f, _) in durable[c as usize].iter().enumerate().step_by(2) {
            client
                .call(Op::Unlink {
                    dir: ROOT,
                    name: format!("c{c}-{f}").into_bytes(),
                })
                .unwrap();
        }
    }
    client.call(Op::Sync).unwrap();
    let ino = ino_of(
        client
            .call(Op::Create {
                dir: ROOT,
                name: b"after".to_vec(),
                mode: 0o644,
                owner: reactor::Owner::ROOT,
            })
            .unwrap(),
    );
    client
        .call(Op::Write {
            ino,
            offset: 0,
            data: vec![7; 256 << 10].into(),
        })
        .unwrap();
    client.call(Op::Fsync { ino }).unwrap();
    drop(client);
    let (_, mut dev) = runtime.shutdown_into_device().unwrap();
    let mut image = vec![0u8; 24 << 20];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    let mut fs = Filesystem::mount(
        Box::new(MemDevice::from_image(&image, mem).unwrap()),
        MountOptions::default(),
    )
    .unwrap();
    fs.check().unwrap();
    let files: usize = durable.iter().map(Vec::len).sum();
    assert!(files > 4, "seed {seed}: the device filled too early");
    for (c, list) in durable.iter().enumerate() {
        for (f, &(ino, bytes)) in list.iter().enumerate() {
            if f % 2 == 0 {
                continue; // deleted
            }
            for i in 0..bytes / (64 << 10) {
                assert_eq!(
                    fs.read(ino, i * (64 << 10), 64 << 10).unwrap(),
                    vec![c as u8 ^ i as u8; 64 << 10],
                    "seed {seed}: client {c} file {f} chunk {i}"
                );
            }
        }
    }
    assert_eq!(fs.read(ino, 0, 256 << 10).unwrap(), vec![7; 256 << 10]);
}

/// The fsync log stops walking up at a partition boundary; that is sound only because a
/// directory rename commits before it returns. Here a file lives (by a rename spanning
/// reactors) in a directory held by the other reactor; that directory is then renamed locally
/// over there, and the file is fsynced: after a power cut right then, the file is at its new
/// path.
#[test]
fn a_directory_renamed_on_another_reactor_is_durable_before_an_fsync_below_it() {
    let (mem, image, log, runtime) = recorded_runtime(2, "boundary");
    let mut c = runtime.client(4);
    // Shard s is served by reactor s % 2 and inode i lives in shard i % 4: find a directory
    // G on reactor 1 holding a directory D on reactor 1, and a directory E on reactor 0.
    let reactor_of = |ino: u64| (ino % 4) % 2;
    let mut made = Vec::new();
    let mut find = |c: &mut Client, parent: u64, want: u64, tag: &str| -> u64 {
        for i in 0.. {
            let ino = mkdir(c, parent, &format!("{tag}{i}"));
            made.push(ino);
            if reactor_of(ino) == want {
                return ino;
            }
        }
        unreachable!()
    };
    let g = find(&mut c, ROOT, 1, "g");
    let d = find(&mut c, g, 1, "d");
    let e = find(&mut c, ROOT, 0, "e");
    let d_name = String::from_utf8(runtime_name(&mut c, g, d).expect("D is named in G")).unwrap();
    let f = ino_of(
        c.call(Op::Create {
            dir: e,
            name: b"f".to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })
        .unwrap(),
    );
    assert_eq!(reactor_of(f), 0, "a file goes to its directory's reactor");
    c.call(Op::Write {
        ino: f,
        offset: 0,
        data: vec![7; 4096].into(),
    })
    .unwrap();
    c.call(Op::Rename {
        from_dir: e,
        from: b"f".to_vec(),
        to_dir: d,
        to: b"f".to_vec(),
        flags: RenameFlags::default(),
    })
    .unwrap();
    c.call(Op::Sync).unwrap();
    // Rename D within G: both on reactor 1, a local operation there.
    c.call(Op::Rename {
        from_dir: g,
        from: d_name.clone().into_bytes(),
        to_dir: g,
        to: b"renamed".to_vec(),
        flags: RenameFlags::default(),
    })
    .unwrap();
    c.call(Op::Write {
        ino: f,
        offset: 4096,
        data: vec![8; 4096].into(),
    })
    .unwrap();
    c.call(Op::Fsync { ino: f }).unwrap();
    let cut = log.len();
    drop(c);
    drop(runtime);
    let records = log.snapshot();
    let crashed = crash_image(&image, 512, &records, cut, CrashMode::DurableOnly);
    let dev = MemDevice::from_image(&crashed, mem).unwrap();
    let mut fs = Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap();
    fs.check().unwrap();
    let g_name = format!("g{}", made.iter().position(|&i| i == g).unwrap());
    let path = format!("{g_name}/renamed/f");
    let ino = fs
        .resolve(&path)
        .unwrap_or_else(|e| panic!("{path} after the power cut: {e}"));
    assert_eq!(ino, f);
    assert_eq!(
        fs.stat(f).unwrap().size,
        8192,
        "the fsynced append is there"
    );
}

/// The name `child` has in `dir`.
fn runtime_name(c: &mut Client, dir: u64, child: u64) -> Option<Vec<u8>> {
    match c
        .call(Op::Readdir {
            dir,
            cookie: 0,
            max: 1000,
        })
        .unwrap()
    {
        Reply::Entries(entries) => entries.into_iter().find(|e| e.ino == child).map(|e| e.name),
        other => panic!("{other:?}"),
    }
}

/// A fresh 64 MiB image of 4 shards (512-byte LBAs) and `reactors` reactors on a recording
/// device over it: (its geometry, the image before, the write log, the runtime).
fn recorded_runtime(
    reactors: usize,
    label: &str,
) -> (
    MemConfig,
    Vec<u8>,
    std::sync::Arc<nvme::wrap::WriteLog>,
    Runtime,
) {
    recorded_runtime_with(reactors, label, |_| {})
}

/// [`recorded_runtime`] with `tune` applied to the runtime's configuration.
fn recorded_runtime_with(
    reactors: usize,
    label: &str,
    tune: impl FnOnce(&mut Config),
) -> (
    MemConfig,
    Vec<u8>,
    std::sync::Arc<nvme::wrap::WriteLog>,
    Runtime,
) {
    let mem = MemConfig {
        capacity_bytes: 64 << 20,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    };
    let mut dev = Filesystem::mkfs(
        Box::new(MemDevice::new(mem).unwrap()),
        &MkfsOptions {
            shards: 4,
            label: label.into(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut image = vec![0u8; 64 << 20];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    let recording = RecordingDevice::new(MemDevice::from_image(&image, mem).unwrap());
    let log = recording.log();
    let mut config = Config {
        device: "recorded mem".into(),
        reactors,
        ..Default::default()
    };
    tune(&mut config);
    let runtime = Runtime::start_with_device(config, Box::new(recording)).unwrap();
    (mem, image, log, runtime)
}

/// One line per record: index, kind, first LBA, length, FUA, what a flush covers.
fn describe_records(records: &[nvme::wrap::Record]) -> String {
    use nvme::wrap::Record;
    records
        .iter()
        .enumerate()
        .map(|(i, r)| match r {
            Record::Write { lba, data, fua } => {
                format!("\n  {i}: write lba {lba} bytes {} fua {fua}", data.len())
            }
            Record::WriteZeroes { lba, lbas } => format!("\n  {i}: zeroes lba {lba} lbas {lbas}"),
            Record::Deallocate { lba, lbas } => format!("\n  {i}: trim lba {lba} lbas {lbas}"),
            Record::Flush { covers } => format!("\n  {i}: flush covers {covers}"),
        })
        .collect()
}

/// Writes block `b` of `ino`, every byte `b + 1`.
fn write_filled_block(client: &mut Client, ino: u64, b: u64) {
    client
        .call(Op::Write {
            ino,
            offset: b * 4096,
            data: vec![b as u8 + 1; 4096].into(),
        })
        .unwrap();
}

/// On a file image a spin-then-park reactor with an fsync waiting polls the device through
/// a record that takes no longer than usual instead of sleeping (a wake-up costs a third of a
/// record's time on a VM), and the data is there after a remount. A maximum of 1 s makes the
/// spin twice the running mean whatever the machine's load: records cannot all take more
/// than twice the mean of the ones before them.
#[test]
fn a_reactor_spins_through_a_usual_record_instead_of_sleeping() {
    let idle = IdlePolicy::SpinThenPark {
        spin: Duration::from_micros(50),
        durable_spin_max: Duration::from_secs(1),
    };
    let fsyncs = 100u64;
    let (stats, _dir) = fsynced_blocks_on_a_file_image(idle, fsyncs);
    // Most records take less than twice the mean (a long tail raises the mean above the
    // median); a tenth leaves room for a loaded machine's disk.
    assert!(
        stats.durable_spin_releases >= fsyncs / 10,
        "{} of {fsyncs} records became durable while the reactor spun for them ({} device \
         sleeps)",
        stats.durable_spin_releases,
        stats.device_sleeps
    );
}

/// Writes and fsyncs `fsyncs` blocks of one file through a runtime on a file image with
/// `idle`, one at a time, checks a remount holds every block, and returns the runtime's
/// final statistics (and the directory holding the image).
fn fsynced_blocks_on_a_file_image(
    idle: IdlePolicy,
    fsyncs: u64,
) -> (reactor::ReactorStats, tempfile::TempDir) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = file_config(&dir, idle);
    let device = config.device.clone();
    let runtime = Runtime::start(config).unwrap();
    let mut client = runtime.client(4);
    let ino = create_files(&mut client, "f", 1)[0];
    for i in 0..fsyncs {
        write_filled_block(&mut client, ino, i);
        client.call(Op::Fsync { ino }).unwrap();
    }
    drop(client);
    let stats = runtime.shutdown().unwrap();
    assert!(stats.log.fsyncs >= fsyncs, "{}", stats.log.fsyncs);
    let mut fs = remount_checked(&device);
    for i in 0..fsyncs {
        assert_eq!(
            fs.read(ino, i * 4096, 4096).unwrap(),
            vec![i as u8 + 1; 4096]
        );
    }
    (stats, dir)
}

/// On a file image a spin-then-park reactor waiting for an fsync record sleeps on its
/// doorbell, which the kernel rings when the write completes: every fsync returns (none waits
/// for a timeout slice to notice), and the data is there after a remount.
#[test]
fn a_reactor_waiting_for_its_device_sleeps_on_the_doorbell_and_completions_wake_it() {
    // No spin at all: every wait for the device sleeps (a record on a fast disk could
    // otherwise complete within the spin, and nothing would be shown).
    let idle = IdlePolicy::SpinThenPark {
        spin: Duration::ZERO,
        durable_spin_max: Duration::ZERO,
    };
    let (stats, _dir) = fsynced_blocks_on_a_file_image(idle, 20);
    assert_eq!(stats.device_ring_reactors, 1);
    // Each fsync's record is a device write of tens of microseconds at least, with nothing
    // else to do meanwhile.
    assert!(
        stats.device_sleeps > 0,
        "the reactor never slept on its doorbell for the device"
    );
    // Nothing but a completion can ring it here (the one client waits for its fsync): had
    // the kernel not signalled completions, every sleep would have run to its timeout.
    assert!(
        stats.device_sleep_timeouts < stats.device_sleeps,
        "{} of {} device sleeps timed out: completions do not ring the doorbell",
        stats.device_sleep_timeouts,
        stats.device_sleeps
    );
}

/// A busy-polling reactor waits for an fsync's record asleep on its doorbell once the record
/// outlasts the durable-spin budget, which is nothing before the first record is timed: it
/// sleeps at least for that one, completions wake it (not its 1 ms slice), and every fsync
/// returns with its data there after a remount.
#[test]
fn a_busy_polling_reactor_sleeps_through_an_overdue_record_and_completions_wake_it() {
    let (stats, _dir) = fsynced_blocks_on_a_file_image(IdlePolicy::BusyPoll, 20);
    assert_eq!(stats.device_ring_reactors, 1);
    assert!(
        stats.device_sleeps > 0,
        "the busy-polling reactor never slept for a record, not even the first"
    );
    assert!(
        stats.device_sleep_timeouts < stats.device_sleeps,
        "{} of {} device sleeps timed out: completions do not ring the doorbell",
        stats.device_sleep_timeouts,
        stats.device_sleeps
    );
}

/// With two reactors a commit is coordinated: its figures in the statistics are the whole
/// commit's (prepare to superblock, every reactor's half of the blocks), not the
/// coordinator's own superblock write alone.
#[test]
fn two_reactors_report_the_coordinated_commits_time_and_blocks() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::start(file_config_n(&dir, IdlePolicy::default(), 2)).unwrap();
    let mut client = runtime.client(4);
    let inos = create_files(&mut client, "c", 4);
    let blocks_per_file = 8u64;
    for &ino in &inos {
        for b in 0..blocks_per_file {
            write_filled_block(&mut client, ino, b);
        }
    }
    client.call(Op::Sync).unwrap();
    let stats = stats_of(&mut client);
    let c = &stats.commit;
    assert!(c.commits >= 1, "{c:?}");
    assert!(
        c.commit_ns_max > 0 && c.commit_ns_total >= c.commit_ns_max,
        "{c:?}"
    );
    // The files' data went to the device with the commit, on both reactors' shards.
    let data_blocks = blocks_per_file * inos.len() as u64;
    assert!(c.blocks_written >= data_blocks, "{c:?}");
    drop(client);
    runtime.shutdown().unwrap();
}

/// What programs need of a filesystem beyond plain files, through the reactor, with one and
/// with two reactors: creates carry their owner; special files; an inode held open outlives
/// its last name and goes at its release; appends from several clients at once never land
/// on each other (O_APPEND).
#[test]
fn owners_special_files_held_inodes_and_concurrent_appends() {
    for reactors in [1, 2] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let runtime = Runtime::start(file_config_n(&dir, IdlePolicy::default(), reactors)).unwrap();
        let mut c = runtime.client(8);
        let owner = reactor::Owner { uid: 1000, gid: 50 };
        let file = match c
            .call(Op::Create {
                dir: ROOT,
                name: b"owned".to_vec(),
                mode: 0o640,
                owner,
            })
            .unwrap()
        {
            Reply::Stat(s) => s,
            other => panic!("{other:?}"),
        };
        assert_eq!((file.uid, file.gid), (1000, 50), "{reactors} reactors");
        let fifo = match c
            .call(Op::Mknod {
                dir: ROOT,
                name: b"fifo".to_vec(),
                mode: 0o010600,
                rdev: 0,
                owner,
            })
            .unwrap()
        {
            Reply::Stat(s) => s,
            other => panic!("{other:?}"),
        };
        assert_eq!(fifo.mode & 0o170000, 0o010000);
        // Held, unlinked, still readable; gone at its release.
        c.call(Op::Write {
            ino: file.ino,
            offset: 0,
            data: b"kept while open".to_vec().into(),
        })
        .unwrap();
        c.call(Op::Hold { ino: file.ino }).unwrap();
        c.call(Op::Unlink {
            dir: ROOT,
            name: b"owned".to_vec(),
        })
        .unwrap();
        assert_eq!(
            data_of(
                c.call(Op::Read {
                    ino: file.ino,
                    offset: 0,
                    len: 100
                })
                .unwrap()
            ),
            b"kept while open"
        );
        c.call(Op::Release { ino: file.ino }).unwrap();
        assert_eq!(
            c.call(Op::Stat { ino: file.ino }).unwrap_err(),
            EngineError::NotFound
        );
        // Created held (open with O_CREAT): an unlink right after leaves it, with nlink 0,
        // until the release; in directories on each reactor.
        for d in 0..4 {
            let parent = mkdir(&mut c, ROOT, &format!("held-{d}"));
            let held = match c
                .call(Op::Open {
                    dir: parent,
                    name: b"f".to_vec(),
                    how: reactor::OpenHow {
                        create: Some((0o600, owner)),
                        exclusive: true,
                        writable: true,
                        ..Default::default()
                    },
                })
                .unwrap()
            {
                Reply::Opened(reactor::Opened::Created(s)) => s,
                other => panic!("{other:?}"),
            };
            assert_eq!((held.uid, held.gid, held.nlink), (1000, 50, 1));
            c.call(Op::Unlink {
                dir: parent,
                name: b"f".to_vec(),
            })
            .unwrap();
            match c.call(Op::Stat { ino: held.ino }).unwrap() {
                Reply::Stat(s) => assert_eq!(s.nlink, 0, "held after the unlink"),
                other => panic!("{other:?}"),
            }
            c.call(Op::Release { ino: held.ino }).unwrap();
            assert_eq!(
                c.call(Op::Stat { ino: held.ino }).unwrap_err(),
                EngineError::NotFound
            );
        }
        // Four clients append 200 records each to one file.
        let log = create_files(&mut c, "log", 1)[0];
        let offsets: Vec<Vec<u64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4u8)
                .map(|w| {
                    let mut client = runtime.client(8);
                    scope.spawn(move || {
                        (0..200)
                            .map(|i| {
                                let record = vec![w; 100 + (i % 7)];
                                match client
                                    .call(Op::Append {
                                        ino: log,
                                        data: record.clone().into(),
                                    })
                                    .unwrap()
                                {
                                    Reply::Appended { offset, written } => {
                                        assert_eq!(written, record.len());
                                        offset
                                    }
                                    other => panic!("{other:?}"),
                                }
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<u64> = offsets.into_iter().flatten().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 800, "two appends landed at one offset");
        let total: u64 = (0..200u64).map(|i| 100 + i % 7).sum::<u64>() * 4;
        match c.call(Op::Stat { ino: log }).unwrap() {
            Reply::Stat(s) => assert_eq!(s.size, total),
            other => panic!("{other:?}"),
        }
        drop(c);
        runtime.shutdown().unwrap();
        remount_checked(&format!("file:{}/fs.img", dir.path().display()));
    }
}

/// A filesystem (mounted, not yet committed) with 3,000 files in its root, enough inodes for
/// many leaves, none of them cached once it is remounted; file `i` holds `data(i)`. Returns
/// it with the files' inodes in order.
fn filesystem_with_cold_files(data: impl Fn(u32) -> Vec<u8>) -> (Filesystem, Vec<u64>) {
    let (_, dev) = formatted_mem(64 << 20, 64 << 10, 2);
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let mut cold = Vec::new();
    for i in 0..3000u32 {
        let ino = fs
            .create(root, format!("f{i:05}").as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        let bytes = data(i);
        if !bytes.is_empty() {
            fs.write(ino, 0, &bytes).unwrap();
        }
        cold.push(ino);
    }
    (fs, cold)
}

/// While a latency spike holds the metadata `slow`'s first request parked on, `fast` sends
/// `op` 20 times: each must be answered within 30 s (from the cache) with a reply `ok`
/// accepts, while nothing of `slow`'s is answered (its later requests wait behind the parked
/// one). The spike ends before any panic, and at the end, so the runtime can shut down.
fn cached_requests_pass_a_parked_one(
    fast: &mut Client,
    slow: &mut Client,
    faults: &nvme::wrap::FaultHandle,
    slow_done: &mut Vec<reactor::Completion>,
    op: impl Fn() -> Op,
    ok: impl Fn(&Reply) -> bool,
) {
    for _ in 0..20 {
        let sent = op();
        fast.submit(sent.clone(), 1).unwrap();
        let mut done = Vec::new();
        fast.wait(&mut done, Duration::from_secs(30));
        let Some(completion) = done.pop() else {
            faults.end_delays();
            panic!("a cached {sent:?} waited for the parked request's slow metadata");
        };
        let reply = completion.result.unwrap();
        assert!(ok(&reply), "{sent:?} answered {reply:?}");
        slow.poll(slow_done);
        if !slow_done.is_empty() {
            faults.end_delays();
            panic!("the parked request, or one behind it, completed early: {slow_done:?}");
        }
    }
    faults.end_delays();
}

/// The runtime's statistics, asked through `client`.
fn stats_of(client: &mut Client) -> Box<reactor::ReactorStats> {
    match client.call(Op::Stats).unwrap() {
        Reply::Stats(s) => s,
        other => panic!("stats: {other:?}"),
    }
}

/// What the hot file of [`spiky_runtime_with_a_hot_file`] holds, in memory.
const HOT_BYTES: &[u8] = b"cached bytes";

/// `fs` unmounted and started on a runtime over a fault device (whose latency spikes the
/// caller arms), with a file "hot" created and written ([`HOT_BYTES`], cached) through a
/// first client: the runtime, the fault handle, that client and the file's inode.
fn spiky_runtime_with_a_hot_file(
    fs: Filesystem,
) -> (Runtime, nvme::wrap::FaultHandle, reactor::Client, u64) {
    use nvme::wrap::{FaultConfig, FaultDevice};
    let dev = fs.unmount().unwrap();
    let faulty = FaultDevice::new(dev, FaultConfig::default());
    let faults = faulty.handle();
    let runtime = Runtime::start_with_device(
        Config {
            device: "spiky mem".into(),
            ..Default::default()
        },
        Box::new(faulty),
    )
    .unwrap();
    let mut fast = runtime.client(4);
    let hot = ino_of(
        fast.call(Op::Create {
            dir: ROOT,
            name: b"hot".to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })
        .unwrap(),
    );
    fast.call(Op::Write {
        ino: hot,
        offset: 0,
        data: HOT_BYTES.to_vec().into(),
    })
    .unwrap();
    (runtime, faults, fast, hot)
}

/// Creates `name` in the root directory through `client`; its inode.
fn create_in_root(client: &mut reactor::Client, name: &[u8]) -> u64 {
    ino_of(
        client
            .call(Op::Create {
                dir: ROOT,
                name: name.to_vec(),
                mode: 0o644,
                owner: reactor::Owner::ROOT,
            })
            .unwrap(),
    )
}

/// While a latency spike holds some device request, a cached read of the hot file of
/// [`spiky_runtime_with_a_hot_file`] and a stat of it, each of which must be answered: one
/// that waits for the held request would wait for the spike, so 30 s without an answer is
/// that failure (`waited_for` names the held work). The spike is ended first, so a failing
/// test does not wait it out at shutdown.
fn serve_hot_during_spike(
    client: &mut reactor::Client,
    hot: u64,
    faults: &nvme::wrap::FaultHandle,
    waited_for: &str,
) {
    let mut answer = |op: Op| -> Reply {
        client.submit(op, 1).unwrap();
        let mut done = Vec::new();
        client.wait(&mut done, Duration::from_secs(30));
        let Some(completion) = done.pop() else {
            faults.end_delays();
            panic!("a cached operation waited for {waited_for}");
        };
        completion.result.unwrap()
    };
    let read = Op::Read {
        ino: hot,
        offset: 0,
        len: HOT_BYTES.len(),
    };
    match answer(read) {
        Reply::Data(d) => assert_eq!(d, HOT_BYTES),
        other => panic!("read: {other:?}"),
    }
    assert!(matches!(answer(Op::Stat { ino: hot }), Reply::Stat(_)));
}

/// A client keeping a deep queue of small reads waits for them asleep: from
/// `DEEP_QUEUE_REQUESTS` in flight on, not one fewer, and not once they are collected; and
/// every read still comes back with its own bytes (a sleeping wait loses no completion).
#[test]
fn a_client_waits_asleep_with_a_deep_queue_of_small_reads() {
    let (_, dev) = formatted_mem(64 << 20, 128 << 10, 2);
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let ino = fs.create(root, b"deep", 0o644, 0, 0).unwrap().ino;
    let runtime = Runtime::start_with_device(
        Config {
            device: "mem".into(),
            ..Default::default()
        },
        fs.unmount().unwrap(),
    )
    .unwrap();
    let deep = reactor::DEEP_QUEUE_REQUESTS;
    let mut client = runtime.client(2 * deep);
    let block = |i: usize| vec![(i as u8).wrapping_mul(37) ^ 0xA5; 4096];
    for i in 0..deep {
        let op = Op::Write {
            ino,
            offset: (i * 4096) as u64,
            data: block(i).into(),
        };
        assert!(matches!(client.call(op), Ok(Reply::Written(4096))));
    }
    for i in 0..deep {
        assert!(
            !client.waits_asleep(),
            "{i} small reads in flight: below the depth"
        );
        let op = Op::Read {
            ino,
            offset: (i * 4096) as u64,
            len: 4096,
        };
        client.submit(op, i as u64).unwrap();
    }
    assert!(client.waits_asleep(), "{deep} small reads in flight");
    assert!(!client.streaming(), "small reads are no stream");
    let mut done = Vec::new();
    while client.in_flight() > 0 {
        client.wait(&mut done, Duration::from_secs(10));
    }
    assert!(!client.waits_asleep(), "nothing in flight");
    assert_eq!(done.len(), deep);
    done.sort_by_key(|c| c.token);
    for (i, c) in done.into_iter().enumerate() {
        assert_eq!(c.token, i as u64);
        match c.result {
            Ok(Reply::Data(d)) => assert!(d == block(i), "block {i} read back wrong"),
            other => panic!("read {i}: {other:?}"),
        }
    }
    drop(client);
    runtime.shutdown().unwrap();
}

/// A client counts the large transfers it has in flight and forgets each when it is
/// collected: with two or more in flight and nothing else it streams (its waits sleep
/// instead of spinning), with a small request among them it does not, and every byte the
/// streamed writes wrote reads back through streamed reads.
#[test]
fn a_client_streams_while_only_large_transfers_are_in_flight() {
    let (_, dev) = formatted_mem(64 << 20, 128 << 10, 2);
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let ino = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    let runtime = Runtime::start_with_device(
        Config {
            device: "mem".into(),
            ..Default::default()
        },
        fs.unmount().unwrap(),
    )
    .unwrap();
    let mut client = runtime.client(16);
    const MIB: usize = 1 << 20;
    let chunk = |i: usize| vec![i as u8 ^ 0x5A; MIB];
    let collect = |client: &mut reactor::Client| -> Vec<reactor::Completion> {
        let mut done = Vec::new();
        while client.in_flight() > 0 {
            client.wait(&mut done, Duration::from_secs(10));
        }
        done
    };
    for i in 0..3 {
        let data = chunk(i);
        let op = Op::Write {
            ino,
            offset: (i * MIB) as u64,
            data: data.into(),
        };
        client.submit(op, i as u64).unwrap();
    }
    assert_eq!(client.large_in_flight(), 3);
    assert!(client.streaming(), "three 1 MiB writes in flight");
    client.submit(Op::Stat { ino }, 99).unwrap();
    assert!(!client.streaming(), "a stat among them");
    let done = collect(&mut client);
    assert_eq!(done.len(), 4);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(
        client.large_in_flight(),
        0,
        "every large transfer forgotten"
    );
    assert!(!client.streaming());
    for i in 0..3 {
        let op = Op::Read {
            ino,
            offset: (i * MIB) as u64,
            len: MIB,
        };
        client.submit(op, 10 + i as u64).unwrap();
    }
    assert!(client.streaming(), "three 1 MiB reads in flight");
    let mut done = collect(&mut client);
    done.sort_by_key(|c| c.token);
    for (i, c) in done.into_iter().enumerate() {
        match c.result {
            Ok(Reply::Data(d)) => assert!(d == chunk(i), "MiB {i} read back wrong"),
            other => panic!("read {i}: {other:?}"),
        }
    }
    assert_eq!(client.large_in_flight(), 0);
    drop(client);
    runtime.shutdown().unwrap();
}

/// With several reactors, the routing lookups (which reactor owns what a request names) run
/// deferred as well: under a node cache far too small for the tree, unlinks and lookups sent
/// by several clients at once park on their misses and are all answered, each rightly.
#[test]
fn several_reactors_park_routing_lookups_and_answer_every_request_rightly() {
    let (_, dev) = formatted_mem(64 << 20, 64 << 10, 4);
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let names: Vec<Vec<u8>> = (0..2000).map(|i| format!("n{i:05}").into_bytes()).collect();
    for name in &names {
        fs.create(root, name, 0o644, 0, 0).unwrap();
    }
    let runtime = Runtime::start_with_device(
        Config {
            device: "mem, cold cache".into(),
            reactors: 2,
            mount: MountOptions {
                cache_nodes: 16,
                ..Default::default()
            },
            ..Default::default()
        },
        fs.unmount().unwrap(),
    )
    .unwrap();
    let mut clients: Vec<_> = (0..3).map(|_| runtime.client(8)).collect();
    // Client c unlinks every third of the even names and looks up the odd ones, 8 at a time.
    for (c, client) in clients.iter_mut().enumerate() {
        let mine: Vec<usize> = (0..names.len()).filter(|i| i % 3 == c).collect();
        for chunk in mine.chunks(8) {
            for &i in chunk {
                let name = names[i].clone();
                let op = if i % 2 == 0 {
                    Op::Unlink { dir: ROOT, name }
                } else {
                    Op::Lookup { dir: ROOT, name }
                };
                client.submit(op, i as u64).unwrap();
            }
            let mut done = Vec::new();
            while done.len() < chunk.len() {
                assert!(
                    client.wait(&mut done, Duration::from_secs(30)) > 0,
                    "a parked request was never answered"
                );
            }
            for completion in done {
                let i = completion.token as usize;
                match completion.result {
                    Ok(Reply::Done) if i % 2 == 0 => {}
                    Ok(Reply::Stat(_)) if i % 2 == 1 => {}
                    other => panic!("{}: {other:?}", String::from_utf8_lossy(&names[i])),
                }
            }
        }
    }
    // What the unlinks removed is gone, and nothing else.
    for (i, name) in names.iter().enumerate().step_by(97) {
        let found = clients[0].call(Op::Lookup {
            dir: ROOT,
            name: name.clone(),
        });
        match (i % 2, found) {
            (0, Err(EngineError::NotFound)) | (1, Ok(Reply::Stat(_))) => {}
            (_, other) => panic!("{}: {other:?}", String::from_utf8_lossy(name)),
        }
    }
    let stats = stats_of(&mut clients[0]);
    assert!(
        stats.meta_parks >= 1,
        "no request parked: {:?}",
        stats.fetch
    );
    drop(clients);
    runtime.shutdown().unwrap();
}

/// A data read whose extents are not in memory parks, mapped once and deferred: while the
/// tree node its mapping needs is held by a latency spike, another client's cached reads
/// are answered, and the parked client's write and read behind it wait. The parked read
/// then returns the bytes from before that write, and the read after it the new bytes.
#[test]
fn a_read_whose_extents_are_cold_parks_and_keeps_its_clients_order() {
    // Files with data: their extents fill many leaves too.
    let (fs, cold) = filesystem_with_cold_files(|i| i.to_le_bytes().repeat(1024));
    let (runtime, faults, mut fast, hot) = spiky_runtime_with_a_hot_file(fs);
    let target = cold[1500];
    // The next device read (a node the read's mapping needs) is held until released below.
    faults.delay_next(nvme::OpKind::Read, 1, Duration::from_secs(600));
    let mut slow = runtime.client(4);
    let read = |token| {
        (
            Op::Read {
                ino: target,
                offset: 0,
                len: 4096,
            },
            token,
        )
    };
    for (op, token) in [
        read(7),
        (
            Op::Write {
                ino: target,
                offset: 0,
                data: b"rewritten".to_vec().into(),
            },
            8,
        ),
        read(9),
    ] {
        slow.submit(op, token).unwrap();
    }
    let mut slow_done = Vec::new();
    cached_requests_pass_a_parked_one(
        &mut fast,
        &mut slow,
        &faults,
        &mut slow_done,
        || Op::Read {
            ino: hot,
            offset: 0,
            len: HOT_BYTES.len(),
        },
        |reply| matches!(reply, Reply::Data(d) if d == HOT_BYTES),
    );
    while slow_done.len() < 3 {
        slow.wait(&mut slow_done, Duration::from_secs(5));
    }
    // Answers may arrive in any order (a read's device I/O completes after the write that
    // followed it is applied); what each saw must follow the order they were sent in.
    slow_done.sort_by_key(|c| c.token);
    let mut results = slow_done.into_iter().map(|c| c.result.unwrap());
    let before = 1500u32.to_le_bytes().repeat(1024);
    assert!(
        matches!(results.next(), Some(Reply::Data(d)) if d == before),
        "the parked read saw the write queued behind it"
    );
    results.next();
    let mut after = before.clone();
    after[..9].copy_from_slice(b"rewritten");
    assert!(matches!(results.next(), Some(Reply::Data(d)) if d == after));
    let stats = stats_of(&mut fast);
    assert!(stats.meta_parks >= 1, "no read parked: {:?}", stats.fetch);
    drop((fast, slow));
    runtime.shutdown().unwrap();
}

/// A slow device read (a latency spike on the fault wrapper) does not hold the reactor:
/// while one client's cold read waits for the device, another client's reads and stats that
/// hit the cache complete, and the slow read then returns its bytes. The reactor's
/// statistics show the read ran asynchronously and the loop kept looking at its queue.
#[test]
fn a_slow_device_read_does_not_hold_clients_whose_operations_hit_the_cache() {
    let (_, dev) = formatted_mem(64 << 20, 64 << 10, 2);
    // File "cold" on the device, nothing of it cached: written, then remounted.
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let cold = fs.create(root, b"cold", 0o644, 0, 0).unwrap().ino;
    fs.write(cold, 0, &[0x5A; 65536]).unwrap();
    let (runtime, faults, mut fast, hot) = spiky_runtime_with_a_hot_file(fs);
    // The cold file's metadata is read now (the stat parks for it and runs again); its
    // data is not.
    assert!(matches!(
        fast.call(Op::Stat { ino: cold }).unwrap(),
        Reply::Stat(s) if s.size == 65536
    ));

    // The next device read is held back by a spike that outlasts the test (ended below by
    // hand), so however slowly a loaded machine runs the fast client, the slow read is
    // still outstanding while it is served.
    faults.delay_next(nvme::OpKind::Read, 1, Duration::from_secs(600));
    let mut slow = runtime.client(4);
    let slow_submitted = std::time::Instant::now();
    slow.submit(
        Op::Read {
            ino: cold,
            offset: 0,
            len: 65536,
        },
        7,
    )
    .unwrap();
    let mut slow_done = Vec::new();
    for _ in 0..20 {
        serve_hot_during_spike(&mut fast, hot, &faults, "the slow read outstanding");
        slow.poll(&mut slow_done);
        assert!(slow_done.is_empty(), "the held read completed early");
    }
    let held = slow_submitted.elapsed();
    faults.end_delays();
    while slow_done.is_empty() {
        slow.wait(&mut slow_done, Duration::from_secs(5));
    }
    match slow_done.pop().unwrap().result.unwrap() {
        Reply::Data(d) => assert_eq!(d, vec![0x5A; 65536]),
        other => panic!("slow read: {other:?}"),
    }
    let stats = stats_of(&mut fast);
    assert!(stats.reads.sets_async >= 1, "{:?}", stats.reads);
    // The reactor's reply latency saw the slow read whole, and the cached requests served
    // around it as the quick ones they were.
    assert!(
        stats.reply.max_ns >= held.as_nanos() as u64,
        "reply max {} ns, the read was held {held:?}",
        stats.reply.max_ns
    );
    assert!(stats.reply.count >= 40, "{:?}", stats.reply);
    // Nothing waited for the device inside an operation: the cold read, the metadata it
    // needed and the cached reads around it all went without a synchronous wait.
    assert_eq!(stats.device_waits.waits, 0, "{:?}", stats.device_waits);
    assert!(
        stats.reply.p50_ns * 10 < held.as_nanos() as u64,
        "{:?}",
        stats.reply
    );
    // The loop kept looking at its queue: its longest gap was far shorter than the spike.
    assert!(
        stats.loop_gap_ns_max < 60_000_000_000,
        "the loop stopped looking at its queue for the whole spike: {} ns",
        stats.loop_gap_ns_max
    );
    drop((fast, slow));
    runtime.shutdown().unwrap();
}

/// A writer that outpaces the device is held back at the staging bound without holding the
/// reactor: while every device write is held by a latency spike, the writer's staged data
/// reaches the engine's park bound and its next write parks (it is neither answered nor run
/// into a synchronous write-back, which would wait for the spike with every client behind
/// it); another client's cached reads and stats are answered meanwhile. Once the spike ends
/// the parked write completes, and the file reads back whole.
#[test]
fn a_writer_outpacing_the_device_parks_at_the_staging_bound_and_others_are_served() {
    let (_, dev) = formatted_mem(64 << 20, 64 << 10, 2);
    let fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let (runtime, faults, mut fast, hot) = spiky_runtime_with_a_hot_file(fs);
    let mut writer = runtime.client(4);
    let big = create_in_root(&mut writer, b"big");
    // Every device write from here completes only when the spike ends (below).
    faults.delay_next(nvme::OpKind::Write, u32::MAX, Duration::from_secs(600));
    const CHUNK: usize = 1 << 20;
    let chunk = |i: usize| vec![(i % 251) as u8 + 1; CHUNK];
    // 1 MiB writes until one is not answered within 2 s: it parked. Staging holds at most
    // MAX_STAGED_BYTES, so that happens within 16 writes.
    let mut parked_at = None;
    for i in 0..24 {
        writer
            .submit(
                Op::Write {
                    ino: big,
                    offset: (i * CHUNK) as u64,
                    data: chunk(i).into(),
                },
                i as u64,
            )
            .unwrap();
        let mut done = Vec::new();
        writer.wait(&mut done, Duration::from_secs(2));
        match done.pop() {
            Some(c) => {
                c.result.unwrap();
            }
            None => {
                parked_at = Some(i);
                break;
            }
        }
    }
    let Some(parked_at) = parked_at else {
        faults.end_delays();
        panic!("24 MiB were staged with no device write completing: nothing held the writer");
    };
    assert!(
        parked_at * CHUNK >= engine::writeback::STAGED_PARK_BYTES - CHUNK,
        "the writer parked after {parked_at} MiB, before the bound"
    );
    let mut writer_done = Vec::new();
    for _ in 0..20 {
        serve_hot_during_spike(&mut fast, hot, &faults, "the parked writer");
        writer.poll(&mut writer_done);
        assert!(writer_done.is_empty(), "the parked write completed early");
    }
    let stats = stats_of(&mut fast);
    assert!(stats.room_parks >= 1, "no write parked for room");
    faults.end_delays();
    while writer_done.is_empty() {
        writer.wait(&mut writer_done, Duration::from_secs(5));
    }
    writer_done.pop().unwrap().result.unwrap();
    for i in 0..=parked_at {
        let data = data_of(
            writer
                .call(Op::Read {
                    ino: big,
                    offset: (i * CHUNK) as u64,
                    len: CHUNK,
                })
                .unwrap(),
        );
        assert!(data == chunk(i), "MiB {i} reads back wrong");
    }
    drop((fast, writer));
    runtime.shutdown().unwrap();
}

/// A due commit never waits for the device pipeline on the reactor: while an fsync's record
/// is held by a latency spike and a commit is due, the commit waits (without holding the
/// reactor) for the pipeline to empty, and once it has waited `COMMIT_DEFER_MAX` the
/// fsyncs that would add to the pipeline park until it starts. Another client's cached reads
/// and stats are answered all along; before, the commit drained the pipeline synchronously
/// and every client waited for the spike. Once the spike ends everything completes and the
/// commit is made.
#[test]
fn a_due_commit_waits_for_records_in_flight_without_holding_the_reactor() {
    use nvme::wrap::{FaultConfig, FaultDevice};
    let (_, dev) = formatted_mem(64 << 20, 64 << 10, 2);
    let faulty = FaultDevice::new(dev, FaultConfig::default());
    let faults = faulty.handle();
    let runtime = Runtime::start_with_device(
        Config {
            device: "spiky mem".into(),
            mount: MountOptions {
                commit_interval: Duration::from_millis(200),
                ..MountOptions::default()
            },
            ..Default::default()
        },
        Box::new(faulty),
    )
    .unwrap();
    let mut fast = runtime.client(4);
    let mut writer = runtime.client(4);
    let mut later = runtime.client(4);
    let hot = create_in_root(&mut fast, b"hot");
    fast.call(Op::Write {
        ino: hot,
        offset: 0,
        data: HOT_BYTES.to_vec().into(),
    })
    .unwrap();
    let logged = create_in_root(&mut writer, b"logged");
    writer
        .call(Op::Write {
            ino: logged,
            offset: 0,
            data: vec![7; 4096].into(),
        })
        .unwrap();
    // Every device write from here completes only when the spike ends (below): the fsync's
    // record stays in flight, with the commit due behind it.
    faults.delay_next(nvme::OpKind::Write, u32::MAX, Duration::from_secs(600));
    writer.submit(Op::Fsync { ino: logged }, 1).unwrap();
    // Past the commit interval and COMMIT_DEFER_MAX: the commit is due and the barrier up.
    let until = std::time::Instant::now() + Duration::from_millis(600);
    while std::time::Instant::now() < until {
        serve_hot_during_spike(&mut fast, hot, &faults, "the due commit");
        std::thread::sleep(Duration::from_millis(20));
    }
    // An fsync now would add a record: it parks until the commit starts.
    later.submit(Op::Fsync { ino: hot }, 3).unwrap();
    let mut parked = Vec::new();
    for _ in 0..20 {
        serve_hot_during_spike(&mut fast, hot, &faults, "the due commit");
        later.poll(&mut parked);
    }
    let mut logged_done = Vec::new();
    writer.poll(&mut logged_done);
    assert!(
        logged_done.is_empty() && parked.is_empty(),
        "an fsync completed while its record or the commit's start was held"
    );
    let stats = stats_of(&mut fast);
    assert!(
        stats.barrier_parks >= 1,
        "the later fsync did not park for the commit"
    );
    let commits_before = stats.commit.commits;
    faults.end_delays();
    while logged_done.is_empty() {
        writer.wait(&mut logged_done, Duration::from_secs(5));
    }
    logged_done.pop().unwrap().result.unwrap();
    while parked.is_empty() {
        later.wait(&mut parked, Duration::from_secs(5));
    }
    parked.pop().unwrap().result.unwrap();
    // The due commit was made once the pipeline emptied.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while stats_of(&mut fast).commit.commits == commits_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the due commit never ran"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop((fast, writer, later));
    runtime.shutdown().unwrap();
}

/// A metadata miss parks its request, not the reactor: while a tree node one client's stat
/// needs is held by a latency spike, clients whose operations hit the cache are answered,
/// and the parked client's later request waits behind its parked one (its order is kept).
#[test]
fn a_slow_metadata_read_parks_its_request_not_the_reactor() {
    let (fs, cold) = filesystem_with_cold_files(|_| Vec::new());
    let (runtime, faults, mut fast, hot) = spiky_runtime_with_a_hot_file(fs);
    let target = cold[1500];
    // The next device read (the stat's leaf) is held until released below.
    faults.delay_next(nvme::OpKind::Read, 1, Duration::from_secs(600));
    let mut slow = runtime.client(4);
    slow.submit(Op::Stat { ino: target }, 7).unwrap();
    slow.submit(Op::Stat { ino: hot }, 8).unwrap();
    let mut slow_done = Vec::new();
    cached_requests_pass_a_parked_one(
        &mut fast,
        &mut slow,
        &faults,
        &mut slow_done,
        || Op::Stat { ino: hot },
        |reply| matches!(reply, Reply::Stat(s) if s.ino == hot),
    );
    while slow_done.len() < 2 {
        slow.wait(&mut slow_done, Duration::from_secs(5));
    }
    let tokens: Vec<u64> = slow_done.iter().map(|c| c.token).collect();
    assert_eq!(
        tokens,
        [7, 8],
        "one client's requests answered out of order"
    );
    match slow_done.remove(0).result.unwrap() {
        Reply::Stat(s) => assert_eq!(s.ino, target),
        other => panic!("slow stat: {other:?}"),
    }
    let stats = stats_of(&mut fast);
    assert!(
        stats.meta_parks >= 1,
        "no request parked: {:?}",
        stats.fetch
    );
    assert!(stats.fetch.blocks_used >= 1, "{:?}", stats.fetch);
    drop((fast, slow));
    runtime.shutdown().unwrap();
}

/// A write inside a block whose data is not in memory parks until the block is read into the
/// block cache, instead of reading it while the reactor waits: while a latency spike holds
/// that read, another client's cached reads are answered and nothing of the writer's is.
/// The write then lays its bytes over the block's old content.
#[test]
fn a_write_inside_an_uncached_block_parks_until_the_block_is_in() {
    let (fs, cold) = filesystem_with_cold_files(|i| i.to_le_bytes().repeat(2048));
    let (runtime, faults, mut fast, hot) = spiky_runtime_with_a_hot_file(fs);
    let target = cold[2500];
    let mut slow = runtime.client(4);
    // The file's inode and extents in memory (a read of its second block), its first block
    // not.
    let second = slow
        .call(Op::Read {
            ino: target,
            offset: 4096,
            len: 4096,
        })
        .unwrap();
    let old = 2500u32.to_le_bytes().repeat(2048);
    assert!(matches!(&second, Reply::Data(d) if d[..] == old[4096..]));
    let waits_before = stats_of(&mut fast).device_waits;
    // The next device read (the write's edge block) is held until released below.
    faults.delay_next(nvme::OpKind::Read, 1, Duration::from_secs(600));
    slow.submit(
        Op::Write {
            ino: target,
            offset: 100,
            data: b"in the middle".to_vec().into(),
        },
        8,
    )
    .unwrap();
    let mut slow_done = Vec::new();
    cached_requests_pass_a_parked_one(
        &mut fast,
        &mut slow,
        &faults,
        &mut slow_done,
        || Op::Read {
            ino: hot,
            offset: 0,
            len: HOT_BYTES.len(),
        },
        |reply| matches!(reply, Reply::Data(d) if d == HOT_BYTES),
    );
    while slow_done.is_empty() {
        slow.wait(&mut slow_done, Duration::from_secs(5));
    }
    assert!(
        matches!(slow_done[0].result, Ok(Reply::Written(13))),
        "{slow_done:?}"
    );
    let mut want = old.clone();
    want[100..113].copy_from_slice(b"in the middle");
    let got = slow
        .call(Op::Read {
            ino: target,
            offset: 0,
            len: want.len(),
        })
        .unwrap();
    assert!(matches!(&got, Reply::Data(d) if *d == want), "{got:?}");
    let stats = stats_of(&mut fast);
    assert_eq!(
        stats.device_waits.waits, waits_before.waits,
        "the write waited for the device on the reactor"
    );
    assert!(stats.fetch.edge_deferred >= 1, "{:?}", stats.fetch);
    drop((fast, slow));
    runtime.shutdown().unwrap();
}
