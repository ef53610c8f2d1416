//! Where the kernel runs a pinned reactor's blocking device work: io_uring's workers (a file
//! image's flush is an `fdatasync` one of them makes) run off the reactor's core while the
//! process is not contended (held to it, they waited for the busy-polling reactor's time
//! slice: 4 writers' fsync p99 5.5 ms in the record's flush, in some runs, against 0.5 ms),
//! and on every core while CPU-bound neighbours make it contended (held to the other cores,
//! they waited behind a neighbour while the reactor's core sat idle). No timing is asserted.
//! Its own test binary: the workers and the contention state are the process's.

mod support;

use reactor::{Client, Config, IdlePolicy, Op, Owner, Reply, Runtime};
use std::time::{Duration, Instant};
use support::hogs;

/// Every io_uring worker thread of this process and the cores it may run on.
fn io_workers() -> Vec<(String, Vec<usize>)> {
    threads(|comm| comm.starts_with("iou-wrk"))
}

/// This process's threads whose names `want` picks, and the cores each may run on.
fn threads(want: impl Fn(&str) -> bool) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
            continue; // the thread ended meanwhile
        };
        if !want(comm.trim()) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue;
        };
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .expect("status names the allowed cores")
            .trim()
            .to_string();
        out.push((comm.trim().to_string(), parse_cpu_list(&list)));
    }
    out
}

fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut cores = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cores.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => cores.push(part.parse().unwrap()),
        }
    }
    cores
}

/// 64 KiB fsyncs: the data goes in place and the record needs a flush, which on a file
/// image is an fsync the kernel hands to a worker.
fn fsyncs(client: &mut Client, ino: u64, rounds: u64) {
    for round in 0..rounds {
        client
            .call(Op::Write {
                ino,
                offset: (round % 64) * (64 << 10),
                data: vec![round as u8; 64 << 10].into(),
            })
            .unwrap();
        client.call(Op::Fsync { ino }).unwrap();
    }
}

#[test]
fn a_pinned_reactors_flushes_run_off_its_core_unless_contended() {
    let allowed = reactor::affinity::allowed_cores().unwrap();
    let reactor_core = *allowed.last().unwrap();
    let others: Vec<usize> = allowed
        .iter()
        .copied()
        .filter(|&c| c != reactor_core)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let runtime = Runtime::start(Config {
        device: format!("file:{}/fs.img,size=64MiB", dir.path().display()),
        mkfs: Some(engine::MkfsOptions::default()),
        idle: IdlePolicy::BusyPoll,
        core: Some(reactor_core),
        // The flushes watched here are the reactor's: beside neighbours a client would write
        // its fsync's record itself (docs/reactors.md), and the reactor, never handed one,
        // need not take the turn that re-places its workers.
        callers_fsync: false,
        ..Default::default()
    })
    .unwrap();
    let mut client = runtime.client(4);
    let ino = match client
        .call(Op::Create {
            dir: 256,
            name: b"f".to_vec(),
            mode: 0o644,
            owner: Owner::ROOT,
        })
        .unwrap()
    {
        Reply::Stat(s) => s.ino,
        other => panic!("{other:?}"),
    };
    fsyncs(&mut client, ino, 32);
    assert!(
        !reactor::contention::contended(),
        "contended with nothing else running (others used {:.2} cores)",
        reactor::contention::others_cores()
    );
    let workers = io_workers();
    assert!(
        !workers.is_empty(),
        "no io_uring worker ran the file image's flushes"
    );
    // One core: it is the reactor's and every core; the workers can only share it.
    let quiet = if others.is_empty() { &allowed } else { &others };
    for (name, cores) in &workers {
        assert_eq!(
            cores, quiet,
            "{name} may run on {cores:?}; the reactor is pinned to {reactor_core}"
        );
    }

    // CPU-bound neighbours on every core: once the process is contended, the workers may
    // run anywhere, those running already included.
    let _hogs = hogs(allowed.len());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !reactor::contention::contended() {
        assert!(
            Instant::now() < deadline,
            "20 s beside {} spinning processes and never contended",
            allowed.len()
        );
        fsyncs(&mut client, ino, 4);
    }
    // The reactor re-places them at its next turn while the process is contended. The
    // contention can lapse again (its hold ends once no thread of ours waits for a core, as
    // when the reactor spread out below), and the workers then go back: so what is checked is
    // that, seen while contended, they may run on every core.
    loop {
        fsyncs(&mut client, ino, 4);
        let workers = io_workers();
        assert!(!workers.is_empty(), "no io_uring worker left");
        let wide = workers.iter().all(|(_, cores)| cores == &allowed);
        if wide && reactor::contention::contended() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the workers never ran on every core while contended: {workers:?}"
        );
    }
    // The reactor itself, kept off its core by a neighbour, spreads over every core (and
    // goes back once it has its core again: seen at least once, then).
    if allowed.len() > 1 {
        let reactor = || threads(|comm| comm == "corefs-reactor");
        assert_eq!(reactor().len(), 1, "one reactor thread");
        while reactor()[0].1 != allowed {
            assert!(
                Instant::now() < deadline,
                "the pinned reactor never spread over {allowed:?} beside the neighbours: {:?}",
                reactor()
            );
            fsyncs(&mut client, ino, 4);
        }
    }
    runtime.shutdown().unwrap();
}
