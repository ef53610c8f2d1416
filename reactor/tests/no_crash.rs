//! Nothing a caller passes and no bug in a reactor takes the host process down: a core the
//! process may not run on is an error at start, and a reactor that panics (the test hook
//! `Runtime::panic_on_next_request`, compiled in through the `test-hooks` feature these tests
//! turn on) fails the runtime: every request, queued before or sent after, gets EIO from every
//! reactor, shutdown returns the panic, and what was fsynced before it is on the device.

use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use reactor::{Client, Config, IdlePolicy, Op, Reply, Runtime};
use std::time::{Duration, Instant};

const ROOT: u64 = 256;
const SHARDS: u32 = 8;
const EIO: i32 = 5;

fn config(dir: &tempfile::TempDir, reactors: usize) -> Config {
    Config {
        reactors,
        device: format!("file:{}/fs.img,size=64MiB", dir.path().display()),
        mkfs: Some(MkfsOptions {
            shards: SHARDS,
            label: "no-crash".into(),
            ..Default::default()
        }),
        idle: IdlePolicy::default(),
        ..Default::default()
    }
}

#[test]
fn a_core_the_process_may_not_run_on_is_an_error_naming_it_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let allowed = reactor::affinity::allowed_cores().unwrap();
    // 5000 made libc's CPU_SET (an extern "C" function) panic in the reactor thread, which
    // aborted the process.
    for (core, cores) in [
        (Some(5000), vec![]),
        (None, vec![allowed[0], 5000]),
        (None, vec![usize::MAX]),
        (Some(allowed[allowed.len() - 1] + 1), vec![]),
    ] {
        let bad = cores
            .iter()
            .chain(&core)
            .find(|c| !allowed.contains(*c))
            .copied()
            .unwrap();
        let e = Runtime::start(Config {
            core,
            cores: cores.clone(),
            reactors: cores.len().max(1),
            ..config(&dir, 1)
        })
        .err()
        .unwrap_or_else(|| panic!("core {core:?} cores {cores:?} started"));
        let text = e.to_string();
        assert_eq!(e.errno(), 22, "{text}");
        assert!(
            text.contains(&format!("core {bad} ")) && text.contains("allowed: "),
            "{text}"
        );
    }
    // An allowed core still pins.
    let rt = Runtime::start(Config {
        core: Some(allowed[0]),
        ..config(&dir, 1)
    })
    .unwrap();
    rt.shutdown().unwrap();
}

fn ino_of(reply: Reply) -> u64 {
    match reply {
        Reply::Stat(s) => s.ino,
        other => panic!("expected a stat, got {other:?}"),
    }
}

fn assert_eio(result: Result<Reply, EngineError>, what: &str) {
    match result {
        Err(e) => assert_eq!(e.errno(), EIO, "{what}: {e}"),
        Ok(reply) => panic!("{what}: {reply:?} after the panic"),
    }
}

/// Collects `count` completions, failing rather than hanging if any never comes.
fn completions(client: &mut Client, count: usize) -> Vec<reactor::Completion> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    while done.len() < count {
        assert!(
            Instant::now() < deadline,
            "{} of {count} requests were never answered",
            count - done.len()
        );
        client.wait(&mut done, Duration::from_millis(100));
    }
    done
}

fn a_panicking_reactor_fails_the_runtime(reactors: usize) {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::start(config(&dir, reactors)).unwrap();
    let mut c = rt.client(64);
    // A file in each of several directories: directories spread over the shards (and so
    // the reactors), and a file lives in its directory's shard.
    let files: Vec<u64> = (0..SHARDS)
        .map(|i| {
            let dir = ino_of(
                c.call(Op::Mkdir {
                    dir: ROOT,
                    name: format!("d{i}").into_bytes(),
                    mode: 0o755,
                    owner: reactor::Owner::ROOT,
                })
                .unwrap(),
            );
            ino_of(
                c.call(Op::Create {
                    dir,
                    name: b"f".to_vec(),
                    mode: 0o644,
                    owner: reactor::Owner::ROOT,
                })
                .unwrap(),
            )
        })
        .collect();
    for (i, &ino) in files.iter().enumerate() {
        c.call(Op::Write {
            ino,
            offset: 0,
            data: vec![i as u8; 6000].into(),
        })
        .unwrap();
        c.call(Op::Fsync { ino }).unwrap();
    }
    // Shard s is served by reactor s % reactors: the victim is the last reactor, and with
    // two, reactor 0 serves the bystander.
    let owner = |ino: u64| (ino % SHARDS as u64) as usize % reactors;
    let victim = reactors - 1;
    let victim_file = *files.iter().find(|&&i| owner(i) == victim).unwrap();
    let bystander_file = *files.iter().find(|&&i| owner(i) == 0).unwrap();
    assert!(
        rt.panic_on_next_request(victim),
        "the test-hooks feature is on"
    );
    // Requests queued together: the first panics the reactor; the batch it was in and
    // whatever queued behind it are answered all the same. The first is an fsync, which
    // only a reactor runs: a client with nothing in flight runs a write over cached blocks
    // itself, and it would never reach the reactor's hook.
    let queued = [
        Op::Fsync { ino: victim_file },
        Op::Write {
            ino: victim_file,
            offset: 100,
            data: vec![0xee; 100].into(),
        },
        Op::Read {
            ino: victim_file,
            offset: 0,
            len: 6000,
        },
        Op::Stat { ino: victim_file },
        Op::Write {
            ino: victim_file,
            offset: 8192,
            data: vec![0xee; 100].into(),
        },
    ];
    for (token, op) in queued.iter().enumerate() {
        c.submit(op.clone(), token as u64).unwrap();
    }
    let mut done = completions(&mut c, queued.len());
    done.sort_by_key(|d| d.token);
    for (d, op) in done.into_iter().zip(&queued) {
        assert_eio(d.result, &format!("queued {op:?}"));
    }
    let failure = rt.failure().expect("the runtime failed");
    assert!(
        failure
            .to_string()
            .contains(&format!("reactor {victim} panicked: test hook")),
        "{failure}"
    );
    // Every later request, from any client and to any reactor, gets EIO too.
    let mut other = rt.client(4);
    for op in [
        Op::Stat { ino: victim_file },
        Op::Stat {
            ino: bystander_file,
        },
        Op::Write {
            ino: bystander_file,
            offset: 0,
            data: vec![1; 10].into(),
        },
        Op::Fsync {
            ino: bystander_file,
        },
        Op::resolve("d1/f"),
        Op::Sync,
        Op::Stats,
    ] {
        assert_eio(other.call(op.clone()), &format!("later {op:?}"));
    }
    let e = rt.shutdown().expect_err("shutdown reports the panic");
    assert_eq!(e.errno(), EIO, "{e}");
    assert!(e.to_string().contains("panicked"), "{e}");
    // Fail-stop: what was fsynced before the panic is on the device, consistent.
    let dev = nvme::open_device(
        &format!("file:{}/fs.img", dir.path().display()),
        &nvme::OpenOptions::default(),
    )
    .unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    fs.check().unwrap();
    for (i, &ino) in files.iter().enumerate() {
        assert_eq!(fs.read(ino, 0, 6000).unwrap(), vec![i as u8; 6000], "f{i}");
    }
}

#[test]
fn a_reactor_that_panics_answers_every_request_with_eio_and_shutdown_reports_it() {
    a_panicking_reactor_fails_the_runtime(1);
}

#[test]
fn a_panic_in_one_of_two_reactors_fails_both_without_a_hang() {
    a_panicking_reactor_fails_the_runtime(2);
}
