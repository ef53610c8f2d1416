//! `corefs top`: a live view of a corefs server (`corefs serve`), in the spirit of spdk_top.
//! A polling reactor shows as 100% busy in top(1) whether it works or waits; this view says
//! how much of its time went to requests. Every figure is a difference of two samples of the
//! server's counters divided by the time between them (latency percentiles, which the
//! reactor keeps since its start, excepted: they say so).

use corefs::service::stats::{ClientStats, ServerStats};
use corefs::service::Observer;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Watch a corefs server: its reactors' busy share, operations by kind, fsync groups,
/// commits, latencies, and per client (process) its requests and bytes. Refreshes in place
/// every --interval seconds until interrupted.
#[derive(clap::Args)]
pub struct Args {
    /// The server's socket (`corefs serve --socket`).
    #[arg(long)]
    socket: PathBuf,
    /// Seconds between refreshes (and between the two samples of --once).
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// One view (two samples --interval apart) and exit.
    #[arg(long)]
    once: bool,
    /// With --once: the view as JSON (both samples' totals and the rates), for scripts.
    #[arg(long, requires = "once")]
    json: bool,
}

pub fn run(args: Args) -> Result<(), String> {
    if !(args.interval > 0.0 && args.interval <= 3600.0) {
        return Err(format!(
            "--interval {}: between 0 and 3600 seconds",
            args.interval
        ));
    }
    let interval = Duration::from_secs_f64(args.interval);
    let mut observer =
        Observer::connect(&args.socket).map_err(|e| format!("{}: {e}", args.socket.display()))?;
    let mut before = observer.sample()?;
    let mut taken = Instant::now();
    loop {
        std::thread::sleep(interval);
        let after = observer.sample()?;
        let seconds = taken.elapsed().as_secs_f64();
        taken = Instant::now();
        let view = View::of(&before, &after, seconds);
        if args.json {
            let out = serde_json::json!({
                "socket": args.socket,
                "seconds": seconds,
                "rates": view.json(),
                "sample": after,
            });
            let text = serde_json::to_string_pretty(&out).expect("serializable") + "\n";
            return show(&text);
        }
        let mut text = view.text(&args.socket, &after);
        if !args.once {
            // Home and clear: the view refreshes in place.
            text.insert_str(0, "\x1b[H\x1b[2J");
        }
        show(&text)?;
        if args.once {
            return Ok(());
        }
        before = after;
    }
}

/// Writes `text` to standard output; a reader that went (`| head`) ends the view quietly.
fn show(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(format!("writing the view: {e}")),
    }
}

/// Per second, between two samples.
struct View {
    seconds: f64,
    ops: f64,
    busy_share: f64,
    cpu_share: f64,
    parks: f64,
    fsyncs: f64,
    fsync_groups: f64,
    log_writes: f64,
    commits: f64,
    clients: Vec<ClientRates>,
}

struct ClientRates {
    now: ClientStats,
    requests: f64,
    reads: f64,
    writes: f64,
    fsyncs: f64,
    metadata: f64,
    locks: f64,
    read_mib: f64,
    written_mib: f64,
    /// Of those, moved in place in the client's buffer arena (no copy on its side).
    shared_mib: f64,
    /// Mean time the server took per request over the interval.
    mean_us: f64,
}

fn rate(after: u64, before: u64, seconds: f64) -> f64 {
    after.saturating_sub(before) as f64 / seconds
}

impl View {
    fn of(before: &ServerStats, after: &ServerStats, seconds: f64) -> View {
        let (a, b) = (&after.reactors, &before.reactors);
        let interval_ns = seconds * 1e9;
        let clients = after
            .clients
            .iter()
            .map(|now| {
                let was = before
                    .clients
                    .iter()
                    .find(|c| c.connection == now.connection)
                    .cloned()
                    .unwrap_or_default();
                let requests = now.requests.saturating_sub(was.requests);
                let service = now.service_ns_total.saturating_sub(was.service_ns_total);
                ClientRates {
                    requests: requests as f64 / seconds,
                    reads: rate(now.reads, was.reads, seconds),
                    writes: rate(now.writes, was.writes, seconds),
                    fsyncs: rate(now.fsyncs, was.fsyncs, seconds),
                    metadata: rate(now.metadata, was.metadata, seconds),
                    locks: rate(now.locks, was.locks, seconds),
                    read_mib: rate(now.bytes_read, was.bytes_read, seconds) / (1 << 20) as f64,
                    written_mib: rate(now.bytes_written, was.bytes_written, seconds)
                        / (1 << 20) as f64,
                    shared_mib: rate(now.bytes_shared, was.bytes_shared, seconds)
                        / (1 << 20) as f64,
                    mean_us: if requests > 0 {
                        service as f64 / requests as f64 / 1e3
                    } else {
                        0.0
                    },
                    now: now.clone(),
                }
            })
            .collect();
        View {
            seconds,
            ops: rate(a.ops, b.ops, seconds),
            busy_share: a.batch_ns.saturating_sub(b.batch_ns) as f64 / interval_ns,
            cpu_share: a.cpu_ns.saturating_sub(b.cpu_ns) as f64 / interval_ns,
            parks: rate(a.parks, b.parks, seconds),
            fsyncs: rate(a.log.fsyncs, b.log.fsyncs, seconds),
            fsync_groups: rate(a.fsync_groups, b.fsync_groups, seconds),
            log_writes: rate(a.log.log_writes, b.log.log_writes, seconds),
            commits: rate(a.commit.commits, b.commit.commits, seconds),
            clients,
        }
    }

    fn text(&self, socket: &std::path::Path, now: &ServerStats) -> String {
        let r = &now.reactors;
        let mut out = format!(
            "corefs top  {}  up {:.1} s  {} clients ({} since start)  every {:.1} s\n\n",
            socket.display(),
            now.uptime_ns as f64 / 1e9,
            now.clients.len(),
            now.connections_total,
            self.seconds
        );
        out += &format!(
            "reactors  {:>9.0} ops/s   busy {:>5.1}% (running requests)   on CPU {:>5.1}%   parks {:.0}/s\n",
            self.ops,
            self.busy_share * 100.0,
            self.cpu_share * 100.0,
            self.parks
        );
        let group = if self.fsync_groups > 0.0 {
            self.fsyncs / self.fsync_groups
        } else {
            0.0
        };
        out += &format!(
            "fsyncs   {:>9.0} /s      in {:.0} groups/s (mean {:.1}, largest {} since start)   log writes {:.0}/s   commits {:.1}/s (last max {:.1} ms)\n",
            self.fsyncs,
            self.fsync_groups,
            group,
            r.fsync_group_max,
            self.log_writes,
            self.commits,
            r.commit.commit_ns_max as f64 / 1e6
        );
        out += &format!(
            "latency  fsync p50 {:.0} us  p99 {:.0} us   request p99 {:.0} us   (since start)   data cache {:.1}% hits\n\n",
            r.fsync_total.p50_ns as f64 / 1e3,
            r.fsync_total.p99_ns as f64 / 1e3,
            r.reply.p99_ns as f64 / 1e3,
            if r.data_cache_hits + r.data_blocks_read > 0 {
                r.data_cache_hits as f64 * 100.0 / (r.data_cache_hits + r.data_blocks_read) as f64
            } else {
                0.0
            }
        );
        out += &format!(
            "{:>5} {:>8} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9} {:>8} {:>6}\n",
            "conn",
            "pid",
            "uid",
            "req/s",
            "read/s",
            "write/s",
            "fsync/s",
            "meta/s",
            "lock/s",
            "MiB/s in",
            "MiB/s out",
            "in place",
            "mean us",
            "open"
        );
        let mut clients: Vec<&ClientRates> = self.clients.iter().collect();
        clients.sort_by(|x, y| y.requests.total_cmp(&x.requests));
        for c in clients {
            out += &format!(
                "{:>5} {:>8} {:>6} {:>9.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7.0} {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>6}\n",
                c.now.connection,
                c.now.pid,
                c.now.uid,
                c.requests,
                c.reads,
                c.writes,
                c.fsyncs,
                c.metadata,
                c.locks,
                c.written_mib,
                c.read_mib,
                c.shared_mib,
                c.mean_us,
                c.now.holds
            );
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "reactor_ops_per_s": self.ops,
            "reactor_busy_share": self.busy_share,
            "reactor_cpu_share": self.cpu_share,
            "parks_per_s": self.parks,
            "fsyncs_per_s": self.fsyncs,
            "fsync_groups_per_s": self.fsync_groups,
            "log_writes_per_s": self.log_writes,
            "commits_per_s": self.commits,
            "clients": self.clients.iter().map(|c| serde_json::json!({
                "connection": c.now.connection,
                "pid": c.now.pid,
                "uid": c.now.uid,
                "requests_per_s": c.requests,
                "reads_per_s": c.reads,
                "writes_per_s": c.writes,
                "fsyncs_per_s": c.fsyncs,
                "metadata_per_s": c.metadata,
                "locks_per_s": c.locks,
                "written_mib_per_s": c.written_mib,
                "read_mib_per_s": c.read_mib,
                "in_place_mib_per_s": c.shared_mib,
                "mean_service_us": c.mean_us,
                "open": c.now.holds,
            })).collect::<Vec<_>>(),
        })
    }
}
