//! kill -9 during fsync-heavy work behind the simulated volatile cache (`cache=volatile`,
//! whose flushes and FUA writes take effect only when their completion is delivered, here
//! 2 ms after submission): a child process runs a reactor on a file image, committing every
//! millisecond, and appends 48 KiB and fsyncs it over and over, printing each fsync it was
//! told succeeded; the parent kills it with SIGKILL right after a random acknowledgement,
//! mounts the image, and checks every acknowledged chunk is there. With the guard that holds a
//! record until its flush *completes* removed (`ack-at-flush-submit`), a kill finds an
//! acknowledged chunk missing. `COREFS_SEED` replays the kill points.

use engine::{Filesystem, MkfsOptions, MountOptions};
use rand::{Rng, SeedableRng};
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Set in the child: the image it runs on.
const CHILD_IMAGE: &str = "COREFS_KILL_CHILD_IMAGE";

/// Bytes appended per fsync: more than a record carries (8 blocks), so each fsync writes its
/// data in place and, on a file (no native FUA), flushes: a record durable only at its flush.
const CHUNK: u64 = 12 * 4096;

fn block(index: u64) -> Vec<u8> {
    (0..CHUNK)
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
            // A commit (two 2 ms device round trips) every 5 ms: many fsyncs arrive while one
            // is in flight, with a write made after it started, and log for the next
            // generation. (Every millisecond, each write was swept into a commit before its
            // fsync came, which then had nothing to log.)
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
        owner: reactor::Owner::ROOT,
    }) {
        Ok(reactor::Reply::Stat(s)) => s.ino,
        other => panic!("create: {other:?}"),
    };
    client.call(reactor::Op::Sync).expect("sync");
    println!("ready");
    let mut done = Vec::new();
    for index in 0..100_000u64 {
        // The write and its fsync in one batch: the fsync logs the write (a commit starting
        // between the two would sweep the write in and leave the fsync nothing to log).
        client
            .submit(
                reactor::Op::Write {
                    ino,
                    offset: index * CHUNK,
                    data: block(index).into(),
                },
                1,
            )
            .and_then(|()| client.submit(reactor::Op::Fsync { ino }, 2))
            .expect("submit");
        done.clear();
        while done.len() < 2 {
            client.wait(&mut done, Duration::from_secs(10));
        }
        for c in &done {
            c.result.as_ref().expect("write and fsync");
        }
        println!("ack {index}");
        // A pause with nothing in flight lets the due commit start (under a steady stream of
        // records it waits up to 50 ms); shorter than a flush, so the next fsync logs while
        // the commit's flush is still under way.
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// One run: formats an image, starts the child (with `mutation`), kills it with SIGKILL as
/// soon as it reads the child's `ack {kill_at}` (so the kill lands right after an
/// acknowledgement, where an early one is exposed), and checks the image. Returns the
/// acknowledged blocks, or what was lost.
fn run_once(mutation: Option<&str>, kill_at: u64) -> Result<u64, String> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let image = dir.path().join("kill.img");
    let dev = nvme::open_device(
        &format!("file:{},size=64MiB", image.display()),
        &nvme::OpenOptions::default(),
    )
    .expect("image");
    // Four shards: the file's data all goes to one, which must hold every chunk.
    let options = MkfsOptions {
        shards: 4,
        label: "kill".into(),
        ..Default::default()
    };
    drop(Filesystem::mkfs(dev, &options).expect("mkfs"));
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
    let (acks_tx, acks_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut acked = None;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(n) = line.strip_prefix("ack ") {
                acked = n.parse::<u64>().ok().or(acked);
                let _ = acks_tx.send(acked);
            }
        }
        acked
    });
    loop {
        match acks_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(n)) if n >= kill_at => break,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the child stopped before ack {kill_at}"));
            }
        }
    }
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    // Every line the child wrote before it died: each was an fsync it was told had returned.
    let last = reader.join().expect("reader").expect("acknowledged");
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
        let found = if index * CHUNK < size {
            fs.read(ino, index * CHUNK, CHUNK as usize)
                .map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        if found != block(index) {
            return Err(format!(
                "block {index} of {} acknowledged is lost ({size} bytes on the image)",
                last + 1
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
    let runs = 6;
    for run in 0..runs {
        let kill_at = rng.random_range(2..40);
        acked += run_once(None, kill_at)
            .unwrap_or_else(|why| panic!("seed {seed} run {run} (killed at ack {kill_at}): {why}"));
    }
    eprintln!("{runs} kills: {acked} acknowledged fsyncs, all on the image");
}

#[test]
fn a_kill_catches_an_fsync_acknowledged_when_its_flush_was_submitted() {
    let seed = nvme::wrap::seed_from_env();
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let runs = 10;
    for run in 0..runs {
        let kill_at = rng.random_range(2..40);
        if let Err(why) = run_once(Some("ack-at-flush-submit"), kill_at) {
            eprintln!("seed {seed} run {run} (killed at ack {kill_at}): {why}");
            return;
        }
    }
    panic!("seed {seed}: {runs} kills with ack-at-flush-submit lost no acknowledged fsync");
}
