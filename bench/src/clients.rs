//! Concurrent fsync clients through the reactor (issue 5's figures): C client threads each
//! append 4 KiB to its own file and fsync it, for C = 1, 4, 16 by default, on a file-backed
//! image. Reports fsyncs/s, latency percentiles, how many fsyncs each log record carried, the
//! share that fell back to a commit, the reactor's CPU time per operation, and the CPU an idle
//! reactor uses with spin-then-park.

use crate::stats::{fmt_ns, latency_histogram, LatencySummary};
use engine::MkfsOptions;
use reactor::{Config, IdlePolicy, Op, Reply, Runtime};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct ClientsBenchConfig {
    pub dir: PathBuf,
    pub image_bytes: u64,
    pub clients: Vec<usize>,
    pub seconds: f64,
    pub idle_seconds: f64,
    pub busy_poll: bool,
}

impl Default for ClientsBenchConfig {
    fn default() -> Self {
        ClientsBenchConfig {
            dir: PathBuf::from("/var/tmp"),
            image_bytes: 1 << 30,
            clients: vec![1, 4, 16],
            seconds: 3.0,
            idle_seconds: 2.0,
            busy_poll: false,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ClientsResult {
    pub clients: usize,
    pub latency: LatencySummary,
    pub fsyncs: u64,
    pub log_writes: u64,
    pub fsyncs_per_record: f64,
    pub fallback_share: f64,
    pub commits: u64,
    pub reactor_cpu_ns_per_op: f64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct ClientsReport {
    pub results: Vec<ClientsResult>,
    /// Share of one core an idle reactor used (spin-then-park), over `idle_seconds`.
    pub idle_core_share: f64,
}

fn stats(client: &mut reactor::Client) -> Result<reactor::ReactorStats, String> {
    match client.call(Op::Stats).map_err(|e| e.to_string())? {
        Reply::Stats(s) => Ok(*s),
        other => Err(format!("unexpected reply {other:?}")),
    }
}

fn one_run(config: &ClientsBenchConfig, clients: usize) -> Result<ClientsResult, String> {
    let image = tempfile::Builder::new()
        .prefix("corefs-clientsbench-")
        .suffix(".img")
        .tempfile_in(&config.dir)
        .map_err(|e| format!("creating an image in {}: {e}", config.dir.display()))?;
    crate::fsync::prefill(image.as_file(), config.image_bytes)?;
    let runtime = Runtime::start(Config {
        device: format!(
            "file:{},size={}",
            image.path().display(),
            config.image_bytes
        ),
        mkfs: Some(MkfsOptions {
            shards: 16,
            label: "clients".into(),
        }),
        idle: if config.busy_poll {
            IdlePolicy::BusyPoll
        } else {
            IdlePolicy::default()
        },
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut setup = runtime.client(4);
    let mut inos = Vec::new();
    for i in 0..clients {
        let reply = setup
            .call(Op::Create {
                dir: 256,
                name: format!("client-{i}").into_bytes(),
                mode: 0o644,
            })
            .map_err(|e| e.to_string())?;
        match reply {
            Reply::Stat(s) => inos.push(s.ino),
            other => return Err(format!("unexpected reply {other:?}")),
        }
    }
    setup.call(Op::Sync).map_err(|e| e.to_string())?;
    let before = stats(&mut setup)?;
    let begin = Instant::now();
    let end = begin + Duration::from_secs_f64(config.seconds);
    let histograms: Vec<Result<hdrhistogram::Histogram<u64>, String>> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = inos
                .iter()
                .map(|&ino| {
                    let mut client = runtime.client(2);
                    scope.spawn(move || {
                        let mut h = latency_histogram();
                        let mut offset = 0u64;
                        while Instant::now() < end {
                            let start = Instant::now();
                            // The write and its fsync go in together (they run in order), as
                            // an embedder using the asynchronous API does; then both complete.
                            let write = Op::Write {
                                ino,
                                offset,
                                data: vec![(offset >> 12) as u8; 4096],
                            };
                            client.submit(write, 1).map_err(|e| format!("{e:?}"))?;
                            client
                                .submit(Op::Fsync { ino }, 2)
                                .map_err(|e| format!("{e:?}"))?;
                            let mut done = Vec::with_capacity(2);
                            while client.in_flight() > 0 {
                                client.wait(&mut done, Duration::from_secs(10));
                            }
                            for c in done {
                                c.result.map_err(|e| e.to_string())?;
                            }
                            h.record(start.elapsed().as_nanos().max(1) as u64)
                                .expect("within bounds");
                            offset += 4096;
                            if offset == crate::fsync::WRAP_BYTES / 4 {
                                client
                                    .call(Op::Truncate { ino, size: 0 })
                                    .map_err(|e| e.to_string())?;
                                offset = 0;
                            }
                        }
                        Ok(h)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("client"))
                .collect()
        });
    let elapsed = begin.elapsed().as_secs_f64();
    let mut all = latency_histogram();
    for h in histograms {
        all.add(h?).expect("same bounds");
    }
    let after = stats(&mut setup)?;
    drop(setup);
    runtime.shutdown().map_err(|e| e.to_string())?;
    let fsyncs = after.log.fsyncs - before.log.fsyncs;
    let log_writes = after.log.log_writes - before.log.log_writes;
    let fallbacks = after.log.fallback_commits() - before.log.fallback_commits();
    let ops = after.ops - before.ops;
    Ok(ClientsResult {
        clients,
        latency: LatencySummary::from_histogram(&all, elapsed),
        fsyncs,
        log_writes,
        fsyncs_per_record: fsyncs as f64 / log_writes.max(1) as f64,
        fallback_share: fallbacks as f64 / fsyncs.max(1) as f64,
        commits: after.commit.commits - before.commit.commits,
        reactor_cpu_ns_per_op: (after.cpu_ns - before.cpu_ns) as f64 / ops.max(1) as f64,
    })
}

fn idle_share(seconds: f64) -> Result<f64, String> {
    let runtime = Runtime::start(Config {
        device: "mem:256MiB".into(),
        mkfs: Some(MkfsOptions::default()),
        idle: IdlePolicy::default(),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut client = runtime.client(2);
    std::thread::sleep(Duration::from_millis(200));
    let before = stats(&mut client)?;
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let after = stats(&mut client)?;
    let wall = start.elapsed().as_nanos() as f64;
    drop(client);
    runtime.shutdown().map_err(|e| e.to_string())?;
    Ok((after.cpu_ns - before.cpu_ns) as f64 / wall)
}

pub fn run(config: &ClientsBenchConfig) -> Result<ClientsReport, String> {
    let mut report = ClientsReport::default();
    for &clients in &config.clients {
        eprintln!(
            "clients bench: {clients} client(s), {} s...",
            config.seconds
        );
        report.results.push(one_run(config, clients)?);
    }
    eprintln!("clients bench: idle reactor, {} s...", config.idle_seconds);
    report.idle_core_share = idle_share(config.idle_seconds)?;
    Ok(report)
}

impl std::fmt::Display for ClientsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "4 KiB append + fsync per client, each on its own file, through one reactor (file backend)"
        )?;
        writeln!(
            f,
            "{:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>13}",
            "clients",
            "fsyncs/s",
            "p50",
            "p99",
            "max",
            "x 1 client",
            "fsyncs/rec",
            "fallback",
            "reactor CPU/op"
        )?;
        let base = self
            .results
            .first()
            .map(|r| r.latency.ops_per_sec)
            .unwrap_or(1.0);
        for r in &self.results {
            writeln!(
                f,
                "{:>7} {:>10.0} {:>9} {:>9} {:>9} {:>9.2} {:>12.2} {:>8.2}% {:>13}",
                r.clients,
                r.latency.ops_per_sec,
                fmt_ns(r.latency.p50_ns as f64),
                fmt_ns(r.latency.p99_ns as f64),
                fmt_ns(r.latency.max_ns as f64),
                r.latency.ops_per_sec / base,
                r.fsyncs_per_record,
                r.fallback_share * 100.0,
                fmt_ns(r.reactor_cpu_ns_per_op)
            )?;
        }
        writeln!(
            f,
            "idle reactor (spin-then-park): {:.3}% of one core",
            self.idle_core_share * 100.0
        )
    }
}
