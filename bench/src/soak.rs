//! `corefs soak`: many clients doing a verified mixed workload (create, write, fsync, read
//! back and compare, rename, unlink) through one reactor for a long time, reporting resident
//! memory (RSS), open file descriptors and throughput every interval, so growth shows. A
//! short run is in the test command; long runs are for people.
//!
//! Invariants: each client works in its own directory and keeps a model of its files; every
//! read is compared with the model (a mismatch ends the run with an error naming the file);
//! the number of files per client is bounded, so the filesystem's size stays flat.

use engine::MkfsOptions;
use reactor::{Client, Config, Op, Reply, Runtime};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub device: String,
    pub clients: usize,
    pub seconds: f64,
    pub interval_seconds: f64,
    pub files_per_client: usize,
}

/// One sample.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Sample {
    pub at_seconds: f64,
    pub rss_kib: u64,
    pub open_fds: u64,
    pub ops: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SoakReport {
    pub samples: Vec<Sample>,
    pub ops: u64,
    pub verified_reads: u64,
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

fn ino_of(r: Reply) -> Result<u64, String> {
    match r {
        Reply::Stat(s) => Ok(s.ino),
        other => Err(format!("unexpected reply {other:?}")),
    }
}

/// One client's loop until `stop`.
fn client_loop(
    mut client: Client,
    c: usize,
    files_max: usize,
    stop: &AtomicBool,
    ops: &AtomicU64,
    verified: &AtomicU64,
) -> Result<(), String> {
    let call = |client: &mut Client, op: Op| client.call(op).map_err(|e| e.to_string());
    let dir = ino_of(call(
        &mut client,
        Op::Mkdir {
            dir: engine::inode::ROOT_INO,
            name: format!("soak{c}").into_bytes(),
            mode: 0o755,
            owner: reactor::Owner::ROOT,
        },
    )?)?;
    // name → (inode, contents)
    let mut model: BTreeMap<u64, (u64, Vec<u8>)> = BTreeMap::new();
    let mut next = 0u64;
    let mut step = 0u64;
    while !stop.load(Ordering::Relaxed) {
        step += 1;
        let pick = (step.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize;
        if model.len() < files_max && pick % 4 != 0 {
            let name = next;
            next += 1;
            let ino = ino_of(call(
                &mut client,
                Op::Create {
                    dir,
                    name: format!("f{name}").into_bytes(),
                    mode: 0o644,
                    owner: reactor::Owner::ROOT,
                },
            )?)?;
            let len = 1 + pick % 20_000;
            let data: Vec<u8> = (0..len)
                .map(|i| (i as u64 ^ name ^ c as u64) as u8)
                .collect();
            call(
                &mut client,
                Op::Write {
                    ino,
                    offset: 0,
                    data: data.clone().into(),
                },
            )?;
            if pick % 3 == 0 {
                call(&mut client, Op::Fsync { ino })?;
            }
            model.insert(name, (ino, data));
        } else if let Some((&name, (ino, data))) = model.iter().nth(pick % model.len().max(1)) {
            let got = match call(
                &mut client,
                Op::Read {
                    ino: *ino,
                    offset: 0,
                    len: data.len() + 10,
                },
            )? {
                Reply::Data(d) => d,
                other => return Err(format!("unexpected reply {other:?}")),
            };
            if got != *data {
                return Err(format!(
                    "client {c}: file f{name} read back {} bytes differing from the {} written",
                    got.len(),
                    data.len()
                ));
            }
            verified.fetch_add(1, Ordering::Relaxed);
            call(
                &mut client,
                Op::Unlink {
                    dir,
                    name: format!("f{name}").into_bytes(),
                },
            )?;
            model.remove(&name);
        }
        ops.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

pub fn run(config: &SoakConfig, progress: &dyn Fn(&Sample)) -> Result<SoakReport, String> {
    let runtime = Runtime::start(Config {
        device: config.device.clone(),
        mkfs: Some(MkfsOptions {
            shards: 4,
            label: "soak".into(),
            ..Default::default()
        }),
        ..Config::default()
    })
    .map_err(|e| format!("{}: {e}", config.device))?;
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let verified = AtomicU64::new(0);
    let started = Instant::now();
    let mut samples = Vec::new();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.clients)
            .map(|c| {
                let client = runtime.client(4);
                let (stop, ops, verified) = (&stop, &ops, &verified);
                let files = config.files_per_client;
                scope.spawn(move || client_loop(client, c, files, stop, ops, verified))
            })
            .collect();
        let end = started + Duration::from_secs_f64(config.seconds);
        let mut next = started;
        while Instant::now() < end && !handles.iter().any(|h| h.is_finished()) {
            if Instant::now() >= next {
                let s = Sample {
                    at_seconds: started.elapsed().as_secs_f64(),
                    rss_kib: rss_kib(),
                    open_fds: open_fds(),
                    ops: ops.load(Ordering::Relaxed),
                };
                progress(&s);
                samples.push(s);
                next += Duration::from_secs_f64(config.interval_seconds);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a client panicked".into())))
            .collect()
    });
    for r in results {
        r?;
    }
    let last = Sample {
        at_seconds: started.elapsed().as_secs_f64(),
        rss_kib: rss_kib(),
        open_fds: open_fds(),
        ops: ops.load(Ordering::Relaxed),
    };
    progress(&last);
    samples.push(last);
    runtime.shutdown().map_err(|e| e.to_string())?;
    Ok(SoakReport {
        samples,
        ops: ops.load(Ordering::Relaxed),
        verified_reads: verified.load(Ordering::Relaxed),
    })
}
