//! Concurrent fsync clients through the reactor (docs/reactors.md's figures): C client
//! threads, each appending 4 KiB to its own file and fsyncing it, for C = 1, 4, 16 by default,
//! on a file-backed image. Placed as the suite places corefs ([`Placement`]): with more cores
//! than reactors, each reactor busy-polls on a core of its own and the clients are pinned to
//! the others; otherwise (or with `shared_cores`) everything shares every core and reactors
//! spin, then park. Reports fsyncs/s, latency percentiles, how many fsyncs each log record
//! carried, the share that fell back to a commit, the reactor's CPU time per operation, and
//! the CPU an idle reactor uses with spin-then-park.

use crate::stats::{fmt_ns, latency_histogram, LatencySummary};
use crate::suite::Placement;
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
    /// Reactors share the cores with the clients even when there are cores to spare.
    pub shared_cores: bool,
    /// With shared cores: busy-poll instead of spin-then-park.
    pub busy_poll: bool,
    /// Reactor counts to run each client count with.
    pub reactors: Vec<usize>,
}

impl Default for ClientsBenchConfig {
    fn default() -> Self {
        ClientsBenchConfig {
            dir: PathBuf::from("/var/tmp"),
            image_bytes: 1 << 30,
            clients: vec![1, 4, 16],
            seconds: 3.0,
            idle_seconds: 2.0,
            shared_cores: false,
            busy_poll: false,
            reactors: vec![1, 2],
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ClientsResult {
    pub reactors: usize,
    pub clients: usize,
    /// Where the reactors and clients ran ([`Placement::describe`]).
    pub placement: String,
    pub latency: LatencySummary,
    pub fsyncs: u64,
    pub log_writes: u64,
    pub fsyncs_per_record: f64,
    pub fallback_share: f64,
    pub commits: u64,
    /// Commits in the run: mean and longest, start to SuperCommitted. An fsync logged while
    /// one is in flight waits for it (its record belongs to the next generation).
    pub commit_ns_mean: f64,
    pub commit_ns_max: u64,
    /// Blocks a commit wrote, mean (tree nodes and staged data not yet written back).
    pub commit_blocks_mean: f64,
    pub reactor_cpu_ns_per_op: f64,
    /// The reactors' view of the fsync latency, p99 by phase: waiting in the queue, the
    /// group's log write + flush, and submit to completion pushed (the rest of what a client
    /// sees is its wake-up).
    pub queue_wait_p99_ns: u64,
    pub log_write_p99_ns: u64,
    pub reactor_total_p99_ns: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct ClientsReport {
    pub results: Vec<ClientsResult>,
    /// Share of one core an idle instance used (spin-then-park; the whole process: reactors
    /// and coordinator), over `idle_seconds`, per reactor count.
    pub idle_core_share: Vec<(usize, f64)>,
}

fn stats(client: &mut reactor::Client) -> Result<reactor::ReactorStats, String> {
    match client.call(Op::Stats).map_err(|e| e.to_string())? {
        Reply::Stats(s) => Ok(*s),
        other => Err(format!("unexpected reply {other:?}")),
    }
}

fn one_run(
    config: &ClientsBenchConfig,
    reactors: usize,
    clients: usize,
) -> Result<ClientsResult, String> {
    let image = tempfile::Builder::new()
        .prefix("corefs-clientsbench-")
        .suffix(".img")
        .tempfile_in(&config.dir)
        .map_err(|e| format!("creating an image in {}: {e}", config.dir.display()))?;
    crate::fsync::prefill(image.as_file(), config.image_bytes)?;
    let placement = Placement::choose(reactors, config.shared_cores);
    let (reactor_cores, client_cores) = match &placement {
        Placement::Dedicated {
            reactor_cores,
            client_cores,
        } => (reactor_cores.clone(), client_cores.clone()),
        Placement::Shared => (Vec::new(), Vec::new()),
    };
    let runtime = Runtime::start(Config {
        device: format!(
            "file:{},size={}",
            image.path().display(),
            config.image_bytes
        ),
        mkfs: Some(MkfsOptions {
            shards: 16,
            label: "clients".into(),
            ..Default::default()
        }),
        idle: if config.busy_poll || !reactor_cores.is_empty() {
            IdlePolicy::BusyPoll
        } else {
            IdlePolicy::default()
        },
        reactors,
        cores: reactor_cores,
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
                owner: reactor::Owner::ROOT,
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
                .enumerate()
                .map(|(c, &ino)| {
                    let mut client = runtime.client(2);
                    let core =
                        (!client_cores.is_empty()).then(|| client_cores[c % client_cores.len()]);
                    scope.spawn(move || {
                        if let Some(id) = core {
                            // Best effort: an unpinned client only shares the reactor's core.
                            let _ = reactor::affinity::pin_current_thread(id);
                        }
                        let mut h = latency_histogram();
                        let mut offset = 0u64;
                        // At least one operation per client whatever the clock says: on a
                        // loaded machine (CI, beside the suite's CPU-bound neighbours) a
                        // client started after a 0.3 s run's end once measured nothing.
                        let mut first = true;
                        while std::mem::take(&mut first) || Instant::now() < end {
                            let start = Instant::now();
                            // The write and its fsync go in together (they run in order), as
                            // an embedder using the asynchronous API does; then both complete.
                            let write = Op::Write {
                                ino,
                                offset,
                                data: vec![(offset >> 12) as u8; 4096].into(),
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
        reactors,
        clients,
        placement: placement.describe(),
        latency: LatencySummary::from_histogram(&all, elapsed),
        fsyncs,
        log_writes,
        fsyncs_per_record: fsyncs as f64 / log_writes.max(1) as f64,
        fallback_share: fallbacks as f64 / fsyncs.max(1) as f64,
        commits: after.commit.commits - before.commit.commits,
        commit_ns_mean: (after.commit.commit_ns_total - before.commit.commit_ns_total) as f64
            / (after.commit.commits - before.commit.commits).max(1) as f64,
        // The stats keep the longest commit since mount: the setup's tiny ones do not reach it.
        commit_ns_max: after.commit.commit_ns_max,
        commit_blocks_mean: (after.commit.blocks_written - before.commit.blocks_written) as f64
            / (after.commit.commits - before.commit.commits).max(1) as f64,
        reactor_cpu_ns_per_op: (after.cpu_ns - before.cpu_ns) as f64 / ops.max(1) as f64,
        queue_wait_p99_ns: after.fsync_queue_wait.p99_ns,
        log_write_p99_ns: after.fsync_log_write.p99_ns,
        reactor_total_p99_ns: after.fsync_total.p99_ns,
    })
}

fn idle_share(seconds: f64, reactors: usize) -> Result<f64, String> {
    let runtime = Runtime::start(Config {
        device: "mem:256MiB".into(),
        mkfs: Some(MkfsOptions::default()),
        idle: IdlePolicy::default(),
        reactors,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(200));
    // The process's CPU: the reactors, the coordinator and this (sleeping) thread.
    let before = crate::suite::process_cpu_ns();
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let after = crate::suite::process_cpu_ns();
    let wall = start.elapsed().as_nanos() as f64;
    runtime.shutdown().map_err(|e| e.to_string())?;
    Ok(after.saturating_sub(before) as f64 / wall)
}

pub fn run(config: &ClientsBenchConfig) -> Result<ClientsReport, String> {
    let mut report = ClientsReport::default();
    for &reactors in &config.reactors {
        for &clients in &config.clients {
            eprintln!(
                "clients bench: {reactors} reactor(s), {clients} client(s), {} s...",
                config.seconds
            );
            report.results.push(one_run(config, reactors, clients)?);
        }
        eprintln!(
            "clients bench: idle, {reactors} reactor(s), {} s...",
            config.idle_seconds
        );
        report
            .idle_core_share
            .push((reactors, idle_share(config.idle_seconds, reactors)?));
    }
    Ok(report)
}

impl std::fmt::Display for ClientsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "4 KiB append + fsync per client, each on its own file (file backend); x1: against one client with as many reactors"
        )?;
        let mut placements: Vec<(usize, &str)> = Vec::new();
        for r in &self.results {
            if !placements.contains(&(r.reactors, r.placement.as_str())) {
                placements.push((r.reactors, &r.placement));
            }
        }
        for (reactors, placement) in placements {
            writeln!(f, "{reactors} reactor(s): {placement}")?;
        }
        writeln!(
            f,
            "{:>8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7} {:>10} {:>9} {:>13}",
            "reactors",
            "clients",
            "fsyncs/s",
            "p50",
            "p99",
            "max",
            "rate x1",
            "p99 x1",
            "fsyncs/rec",
            "fallback",
            "reactor CPU/op"
        )?;
        for r in &self.results {
            let base = self
                .results
                .iter()
                .find(|b| b.reactors == r.reactors && b.clients == 1)
                .unwrap_or(r);
            writeln!(
                f,
                "{:>8} {:>7} {:>10.0} {:>9} {:>9} {:>9} {:>8.2} {:>7.2} {:>10.2} {:>8.2}% {:>13}",
                r.reactors,
                r.clients,
                r.latency.ops_per_sec,
                fmt_ns(r.latency.p50_ns as f64),
                fmt_ns(r.latency.p99_ns as f64),
                fmt_ns(r.latency.max_ns as f64),
                r.latency.ops_per_sec / base.latency.ops_per_sec,
                r.latency.p99_ns as f64 / base.latency.p99_ns.max(1) as f64,
                r.fsyncs_per_record,
                r.fallback_share * 100.0,
                fmt_ns(r.reactor_cpu_ns_per_op)
            )?;
        }
        writeln!(
            f,
            "fsync p99 by phase, as the reactors saw it (queue wait / log write + flush / submit to completion); commits (mean, max)"
        )?;
        for r in &self.results {
            writeln!(
                f,
                "{:>8} {:>7}   {:>9} / {:>9} / {:>9}   {} commits ({}, {}; {:.0} blocks)",
                r.reactors,
                r.clients,
                fmt_ns(r.queue_wait_p99_ns as f64),
                fmt_ns(r.log_write_p99_ns as f64),
                fmt_ns(r.reactor_total_p99_ns as f64),
                r.commits,
                fmt_ns(r.commit_ns_mean),
                fmt_ns(r.commit_ns_max as f64),
                r.commit_blocks_mean
            )?;
        }
        for (reactors, share) in &self.idle_core_share {
            writeln!(
                f,
                "idle instance, {reactors} reactor(s) (spin-then-park): {:.3}% of one core (whole process)",
                share * 100.0
            )?;
        }
        Ok(())
    }
}
