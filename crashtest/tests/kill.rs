//! kill -9 during fsync-heavy work behind the simulated volatile cache (`cache=volatile`,
//! whose flushes and FUA writes take effect only when their completion is delivered, here
//! 2 ms after submission): a child process runs a reactor on a file image, committing every
//! millisecond, and appends a block and fsyncs it over and over, printing each fsync it was
//! told succeeded; the parent kills it with SIGKILL at a random moment, mounts the image, and
//! checks every acknowledged block is there. With the guard that holds a record logged during
//! a commit until the commit's superblock is durable removed (`ack-before-commit`), some kill
//! finds an acknowledged block missing. `COREFS_SEED` replays the kill times.

use engine::{Filesystem, MkfsOptions, MountOptions};
use rand::{Rng, SeedableRng};
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Set in the child: the image it runs on.
const CHILD_IMAGE: &str = "COREFS_KILL_CHILD_IMAGE";

fn block(index: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|i| (index.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (i % 57)) as u8 ^ i as u8)
        .collect()
}

/// The child: appends and fsyncs until killed, printing `ack N` once block N's fsync returned.
#[test]
#[ignore = "the child process of the kill tests, which run it"]
fn kill_child() {
    let Some(image) = std::env::var_os(CHILD_IMAGE) else {
        return;
    };
    let runtime = reactor::Runtime::start(reactor::Config {
        device: format!(
            "file:{},cache=volatile,flushdelay=2000",
            image.to_string_lossy()
        ),
        mount: MountOptions {
            // Commits back to back: a commit is in flight at almost every fsync.
            commit_interval: Duration::from_millis(1),
            ..MountOptions::default()
        },
        ..Default::default()
    })
    .expect("starting the reactor");
    let mut client = runtime.client(4);
    let ino = match client.call(reactor::Op::Create {
        dir: engine::inode::ROOT_INO,
        name: b"f".to_vec(),
        mode: 0o644,
    }) {
        Ok(reactor::Reply::Stat(s)) => s.ino,
        other => panic!("create: {other:?}"),
    };
    client.call(reactor::Op::Sync).expect("sync");
    println!("ready");
    for index in 0..100_000u64 {
        client
            .call(reactor::Op::Write {
                ino,
                offset: index * 4096,
                data: block(index),
            })
            .expect("write");
        client.call(reactor::Op::Fsync { ino }).expect("fsync");
        println!("ack {index}");
    }
}

/// One run: formats an image, starts the child (with `mutation`), kills it `after` its first
/// fsyncs, and checks the image. Returns the acknowledged blocks, or what was lost.
fn run_once(mutation: Option<&str>, after: Duration) -> Result<u64, String> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let image = dir.path().join("kill.img");
    let dev = nvme::open_device(
        &format!("file:{},size=64MiB", image.display()),
        &nvme::OpenOptions::default(),
    )
    .expect("image");
    drop(Filesystem::mkfs(dev, &MkfsOptions::default()).expect("mkfs"));
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args(["kill_child", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_IMAGE, &image)
        .env_remove("COREFS_MUTATION")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(m) = mutation {
        command.env("COREFS_MUTATION", m);
    }
    let mut child = command.spawn().expect("spawning the child");
    let stdout = child.stdout.take().expect("piped");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut acked = None;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line == "ready" {
                let _ = ready_tx.send(());
            } else if let Some(n) = line.strip_prefix("ack ") {
                acked = n.parse::<u64>().ok().or(acked);
            }
        }
        acked
    });
    if ready_rx.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the child never became ready".into());
    }
    std::thread::sleep(after);
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    // Every line the child wrote before it died: each was an fsync it was told had returned.
    let Some(last) = reader.join().expect("reader") else {
        return Ok(0);
    };
    let dev = nvme::open_device(
        &format!("file:{}", image.display()),
        &nvme::OpenOptions::default(),
    )
    .expect("image");
    let mut fs = Filesystem::mount(dev, MountOptions::default())
        .map_err(|e| format!("mount after the kill: {e}"))?;
    fs.check().map_err(|e| format!("checker: {e}"))?;
    let ino = fs
        .lookup(fs.root(), b"f")
        .map_err(|e| format!("f: {e}"))?
        .ino;
    let size = fs.stat(ino).map_err(|e| e.to_string())?.size;
    for index in 0..=last {
        let found = if index * 4096 < size {
            fs.read(ino, index * 4096, 4096).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        if found != block(index) {
            return Err(format!(
                "block {index} of {} acknowledged is lost ({} bytes on the image)",
                last + 1,
                size
            ));
        }
    }
    Ok(last + 1)
}

#[test]
fn a_kill_during_fsyncs_behind_a_volatile_cache_loses_no_acknowledged_fsync() {
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut acked = 0;
    for run in 0..5 {
        let after = Duration::from_millis(rng.random_range(20..200));
        acked += run_once(None, after)
            .unwrap_or_else(|why| panic!("seed {seed} run {run} (killed after {after:?}): {why}"));
    }
    eprintln!("5 kills: {acked} acknowledged fsyncs, all on the image");
    assert!(acked > 5, "too few fsyncs were acknowledged to check");
}

#[test]
fn a_kill_catches_a_record_acknowledged_before_the_commit_in_flight_is_durable() {
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let runs = 20;
    for run in 0..runs {
        let after = Duration::from_millis(rng.random_range(20..200));
        if let Err(why) = run_once(Some("ack-before-commit"), after) {
            eprintln!("seed {seed} run {run} (killed after {after:?}): {why}");
            return;
        }
    }
    panic!("seed {seed}: {runs} kills with ack-before-commit lost no acknowledged fsync");
}
