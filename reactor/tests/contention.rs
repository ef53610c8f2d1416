//! A reactor beside CPU-bound neighbours (one spinning process per core): the process
//! finds out that its cores are shared and switches to sleeping in the kernel between
//! requests (`reactor::contention`), every call still completes and its result is right, and
//! on a quiet machine it is not contended. No timing is asserted (the suite measures speed:
//! `corefs bench suite --neighbours N`). Its own test binary: the contention state is the
//! process's.

mod support;

use reactor::{Config, IdlePolicy, Op, Reply, Runtime};
use std::time::{Duration, Instant};
use support::hogs;

fn ino(reply: Reply) -> u64 {
    match reply {
        Reply::Stat(s) => s.ino,
        other => panic!("{other:?}"),
    }
}

#[test]
fn neighbours_make_the_process_contended_and_calls_go_on() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = Runtime::start(Config {
        device: "mem:64MiB".into(),
        mkfs: Some(engine::MkfsOptions {
            shards: 4,
            ..Default::default()
        }),
        // The dedicated placement's idle policy: it must stop polling too.
        idle: IdlePolicy::BusyPoll,
        core: Some(cores - 1),
        ..Default::default()
    })
    .unwrap();
    let mut client = runtime.client(4);
    let file = ino(client
        .call(Op::Create {
            dir: 256,
            name: b"f".to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })
        .unwrap());
    // Quiet first: a second of calls, and nobody else on the CPUs.
    let quiet_until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < quiet_until {
        client.call(Op::Stat { ino: file }).unwrap();
    }
    assert!(
        !reactor::contention::contended(),
        "contended with nothing else running (others used {:.2} cores)",
        reactor::contention::others_cores()
    );
    let neighbours = hogs(cores);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0u64;
    while !reactor::contention::contended() {
        assert!(
            Instant::now() < deadline,
            "never contended beside {cores} spinning processes (others used {:.2} cores)",
            reactor::contention::others_cores()
        );
        // Over the first 4 MiB again and again: a fast machine makes many writes before it
        // notices the neighbours, and appending would fill the device (it did, at 64 MiB,
        // once writes ran in the client: ENOSPC).
        client
            .call(Op::Write {
                ino: file,
                offset: (i % 1024) * 4096,
                data: vec![i as u8; 4096].into(),
            })
            .unwrap();
        client.call(Op::Fsync { ino: file }).unwrap();
        i += 1;
    }
    // Contended: writes, fsyncs and reads go on and read back what was written.
    for j in i..i + 200 {
        client
            .call(Op::Write {
                ino: file,
                offset: (j % 1024) * 4096,
                data: vec![j as u8; 4096].into(),
            })
            .unwrap();
        client.call(Op::Fsync { ino: file }).unwrap();
        let back = client
            .call(Op::Read {
                ino: file,
                offset: (j % 1024) * 4096,
                len: 4096,
            })
            .unwrap();
        assert!(matches!(back, Reply::Data(d) if d == vec![j as u8; 4096]));
    }
    assert!(reactor::contention::episodes() >= 1);
    drop(neighbours);
    drop(client);
    runtime.shutdown().unwrap();
}
