//! One pool of space shared by shards on different reactors: two clients fill the device
//! concurrently from opposite ends (a file in the first shard, whose groups start at the
//! front of the device, and one in the last, whose groups start at the back) until ENOSPC,
//! through two reactors. Between them they get what statfs promised; each file reads back
//! after a remount; deleted, every block comes back. `COREFS_SEED` replays the layout.

use engine::fs::StatFs;
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
use reactor::{Client, Config, Op, Reply, Runtime};

const SHARDS: u32 = 8;

fn mib(file: u8, i: u64) -> Vec<u8> {
    let mut out = vec![file; 1 << 20];
    for (b, chunk) in out.chunks_mut(4096).enumerate() {
        chunk[..8].copy_from_slice(&i.to_le_bytes());
        chunk[8..16].copy_from_slice(&(b as u64).to_le_bytes());
    }
    out
}

fn statfs(client: &mut Client) -> StatFs {
    match client.call(Op::Statfs).unwrap() {
        Reply::Statfs(s) => s,
        other => panic!("statfs: {other:?}"),
    }
}

/// Writes MiBs to `ino` until ENOSPC (an fsync every 16); returns how many went in.
fn fill(mut client: Client, ino: u64, file: u8) -> u64 {
    let mut i = 0;
    loop {
        match client.call(Op::Write {
            ino,
            offset: i << 20,
            data: mib(file, i).into(),
        }) {
            Ok(_) => i += 1,
            Err(EngineError::NoSpace) => break,
            Err(e) => panic!("file {file} MiB {i}: {e}"),
        }
        if i % 16 == 0 {
            match client.call(Op::Fsync { ino }) {
                Ok(_) | Err(EngineError::NoSpace) => {}
                Err(e) => panic!("file {file} fsync: {e}"),
            }
        }
    }
    client.call(Op::Fsync { ino }).unwrap();
    i
}

#[test]
fn two_reactors_fill_the_device_from_opposite_ends() {
    let dev = MemDevice::new(MemConfig {
        capacity_bytes: 256 << 20,
        ..Default::default()
    })
    .unwrap();
    let dev = Filesystem::mkfs_seeded(
        Box::new(dev),
        &MkfsOptions {
            shards: SHARDS,
            label: "ends".into(),
            ..Default::default()
        },
        nvme::wrap::seed_from_env(),
    )
    .unwrap();
    // Files in shard 0 (reactor 0; its groups start the device) and shard 7 (reactor 1; the
    // last region): a whole mount places new inodes round-robin.
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let (mut front, mut back) = (None, None);
    for i in 0.. {
        let ino = fs
            .create(root, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        match ino % SHARDS as u64 {
            0 => front = front.or(Some((ino, format!("f{i}")))),
            7 => back = back.or(Some((ino, format!("f{i}")))),
            _ => {}
        }
        if front.is_some() && back.is_some() {
            break;
        }
    }
    let ((front, front_name), (back, back_name)) = (front.unwrap(), back.unwrap());
    let runtime = Runtime::start_with_device(
        Config {
            device: "mem, two reactors".into(),
            reactors: 2,
            ..Default::default()
        },
        fs.unmount().unwrap(),
    )
    .unwrap();
    let mut client = runtime.client(8);
    let start = statfs(&mut client);
    let writers: Vec<_> = [(front, 1u8), (back, 2u8)]
        .into_iter()
        .map(|(ino, file)| {
            let c = runtime.client(8);
            std::thread::spawn(move || fill(c, ino, file))
        })
        .collect();
    let written: Vec<u64> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let total = written.iter().sum::<u64>();
    let full = statfs(&mut client);
    eprintln!(
        "two reactors: {written:?} MiB of {} MiB free; statfs then {} MiB free",
        start.free_blocks / 256,
        full.free_blocks / 256
    );
    assert!(
        total * 256 * 100 >= start.free_blocks * 95,
        "{written:?} MiB of {} MiB free",
        start.free_blocks / 256
    );
    assert!(
        written.iter().all(|&w| w > 8),
        "{written:?}: one writer starved"
    );
    drop(client);
    let mut fs = Filesystem::mount(
        runtime.shutdown_into_device().unwrap().1,
        MountOptions::default(),
    )
    .unwrap();
    fs.check().unwrap();
    // They met: each took groups of the other's half of the device.
    let space = fs.space_report();
    let per_region = fs.space_pool().geometry().groups_per_region;
    let half = SHARDS as u64 * per_region / 2;
    assert!(
        space[0].groups.iter().any(|&g| g >= half) || space[7].groups.iter().any(|&g| g < half),
        "neither crossed the middle: {space:?}"
    );
    for (ino, file, count) in [(front, 1u8, written[0]), (back, 2, written[1])] {
        for i in [0, count / 2, count - 1] {
            assert_eq!(fs.read(ino, i << 20, 1 << 20).unwrap(), mib(file, i));
        }
    }
    // Deleted through two reactors again, every block comes back.
    let runtime = Runtime::start_with_device(
        Config {
            device: "mem, two reactors".into(),
            reactors: 2,
            ..Default::default()
        },
        fs.unmount().unwrap(),
    )
    .unwrap();
    let mut client = runtime.client(8);
    for name in [front_name, back_name] {
        client
            .call(Op::Unlink {
                dir: 256,
                name: name.into_bytes(),
            })
            .unwrap();
    }
    client.call(Op::Sync).unwrap();
    // The groups reach the pool once each reactor unpins the commit: a second commit
    // makes sure both have.
    client.call(Op::Sync).unwrap();
    let end = statfs(&mut client);
    assert!(
        end.free_blocks + end.total_blocks / 100 >= start.free_blocks,
        "free {} after deleting, {} at the start",
        end.free_blocks,
        start.free_blocks
    );
    drop(client);
    let mut fs = Filesystem::mount(
        runtime.shutdown_into_device().unwrap().1,
        MountOptions::default(),
    )
    .unwrap();
    fs.check().unwrap();
}
