//! The device-layer micro-benchmark.
//!
//! 1. CPU cost per operation on the memory backend: submit + poll of a 4 KiB write (and read,
//!    and flush), one at a time and in batches of 32, measured in thread CPU time. This is the
//!    software cost corefs adds on top of any device.
//! 2. Latency on real backends (the file image, and NVMe when given): 4 KiB random writes and
//!    reads at queue depth 1, random reads at queue depth 32, with HDR percentiles.
//! 3. The same workloads through `fio` on the same file in the same run (io_uring with fixed
//!    buffers and no ramp at every depth, as corefs's side runs: see [`crate::fio`]), and on a
//!    device given with `--device` (`nvme:/dev/ngXnY` through fio's `io_uring_cmd` passthrough,
//!    `file:/dev/sdX` through io_uring), so the ratio is meaningful on whatever disk this runs
//!    on.

use crate::fio::{self, FioJob, FioResult};
use crate::stats::{fmt_ns, latency_histogram, thread_cpu_ns, LatencySummary};
use nvme::{BlockDevice, DevError, IoCompletion, IoOp, OpenOptions, Request};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct DeviceBenchConfig {
    /// Extra devices to measure (`nvme:/dev/ng0n1`, `file:/dev/sdb`, ...).
    pub devices: Vec<String>,
    /// Where the default file image goes (must support O_DIRECT: not tmpfs).
    pub image_dir: PathBuf,
    pub image_bytes: u64,
    pub seconds_per_test: f64,
    pub mem_ops: u64,
    pub run_fio: bool,
    /// Alternating corefs/fio rounds per workload; medians are compared.
    pub rounds: u32,
}

impl Default for DeviceBenchConfig {
    fn default() -> Self {
        DeviceBenchConfig {
            devices: Vec::new(),
            image_dir: PathBuf::from("/var/tmp"),
            image_bytes: 256 << 20,
            seconds_per_test: 2.0,
            mem_ops: 2_000_000,
            run_fio: true,
            rounds: 3,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CpuCost {
    pub op: String,
    pub batch: u32,
    pub ops: u64,
    pub cpu_ns_per_op: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyResult {
    pub device: String,
    pub workload: String,
    pub queue_depth: u32,
    pub latency: LatencySummary,
}

#[derive(Debug, Clone, Serialize)]
pub struct FioComparison {
    pub workload: String,
    /// The device both sides ran on (corefs's name for it).
    pub device: String,
    pub fio_command: String,
    pub fio: FioResult,
    pub corefs: LatencySummary,
    /// corefs / fio for the figure the target names (p50 latency at depth 1, IOPS at depth 32).
    pub ratio: f64,
    pub figure: String,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct DeviceBenchReport {
    pub cpu: Vec<CpuCost>,
    pub latency: Vec<LatencyResult>,
    pub fio: Vec<FioComparison>,
    pub notes: Vec<String>,
}

/// Measures the memory backend's CPU cost per operation. The device is 2 MiB so its blocks
/// stay in cache: the figure is corefs's software cost, not the machine's DRAM bandwidth
/// (a 4 KiB copy from DRAM alone costs a few hundred ns).
pub fn mem_cpu_cost(ops: u64) -> Result<Vec<CpuCost>, DevError> {
    let mut dev = nvme::open_device("mem:2MiB,qd=64,bufs=64,buf=4KiB", &OpenOptions::default())?;
    let lbas = dev.info().capacity_lbas;
    let mut results = Vec::new();
    for (name, batch) in [
        ("write 4KiB", 1u32),
        ("write 4KiB", 32),
        ("read 4KiB", 1),
        ("flush", 1),
    ] {
        let mut bufs: Vec<nvme::DmaBuf> = (0..batch)
            .map(|_| dev.pool().alloc(4096).expect("pool"))
            .collect();
        let mut done: Vec<IoCompletion> = Vec::with_capacity(64);
        // Warm up, then measure.
        for measured in [false, true] {
            let rounds = if measured { ops / batch as u64 } else { 10_000 };
            let start = thread_cpu_ns();
            let mut lba = 0u64;
            for _ in 0..rounds {
                for _ in 0..batch {
                    lba = (lba + 7) % lbas;
                    let op = match name {
                        "flush" => IoOp::Flush,
                        _ => {
                            let buf = bufs.pop().expect("buffer returned by the last round");
                            IoOp::transfer(name.starts_with("write"), lba, buf)
                        }
                    };
                    dev.submit(Request { token: lba, op })
                        .map_err(|r| r.reason)?;
                }
                dev.poll(&mut done)?;
                for c in done.drain(..) {
                    c.result?;
                    if let Some(buf) = c.buf {
                        bufs.push(buf);
                    }
                }
            }
            let cpu_ns = thread_cpu_ns() - start;
            if measured {
                let total = rounds * batch as u64;
                results.push(CpuCost {
                    op: name.to_string(),
                    batch,
                    ops: total,
                    cpu_ns_per_op: cpu_ns as f64 / total as f64,
                });
            }
        }
    }
    Ok(results)
}

/// Random 4 KiB I/O at a fixed queue depth for `seconds`; latency from submit to completion.
pub fn latency_run(
    dev: &mut dyn BlockDevice,
    write: bool,
    queue_depth: u32,
    seconds: f64,
    seed: u64,
) -> Result<LatencySummary, DevError> {
    let lba_size = dev.info().lba_size_bytes as u64;
    let blocks = dev.info().capacity_lbas * lba_size / 4096;
    let per_io = 4096 / lba_size;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut histogram = latency_histogram();
    let mut started: Vec<Instant> = vec![Instant::now(); queue_depth as usize];
    let mut done: Vec<IoCompletion> = Vec::with_capacity(queue_depth as usize);
    let mut free_slots: Vec<u64> = (0..queue_depth as u64).collect();
    let mut spare: Vec<nvme::DmaBuf> = Vec::new();
    let begin = Instant::now();
    let end = begin + Duration::from_secs_f64(seconds);
    let mut stopping = false;
    loop {
        // Refill every free slot, unless the run is over and only draining remains.
        while let Some(slot) = (!stopping).then(|| free_slots.pop()).flatten() {
            let mut buf = match spare.pop() {
                Some(buf) => buf,
                None => dev.pool().alloc(4096).ok_or(DevError::PoolExhausted)?,
            };
            let lba = rng.random_range(0..blocks) * per_io;
            buf.as_mut_slice()[..8].copy_from_slice(&lba.to_le_bytes());
            let op = IoOp::transfer(write, lba, buf);
            started[slot as usize] = Instant::now();
            dev.submit(Request { token: slot, op })
                .map_err(|r| r.reason)?;
        }
        dev.wait(&mut done, Duration::from_secs(1))?;
        let now = Instant::now();
        for c in done.drain(..) {
            c.result?;
            histogram
                .record(
                    now.duration_since(started[c.token as usize])
                        .as_nanos()
                        .max(1) as u64,
                )
                .expect("latency within histogram bounds");
            free_slots.push(c.token);
            spare.extend(c.buf);
        }
        stopping = now >= end;
        if stopping && dev.in_flight() == 0 {
            break;
        }
    }
    Ok(LatencySummary::from_histogram(
        &histogram,
        begin.elapsed().as_secs_f64(),
    ))
}

/// Writes the whole device once, so reads and overwrites hit allocated blocks (as fio's layout
/// step does for its file).
fn prefill(dev: &mut dyn BlockDevice) -> Result<(), DevError> {
    let chunk = dev.info().max_io_bytes as u64;
    let lba_size = dev.info().lba_size_bytes as u64;
    let total = dev.info().capacity_bytes();
    let mut done = Vec::new();
    let mut offset = 0;
    let mut token = 0;
    while offset < total || dev.in_flight() > 0 {
        if offset < total && dev.in_flight() < 16 {
            let len = chunk.min(total - offset);
            let mut buf = dev
                .pool()
                .alloc(len as usize)
                .ok_or(DevError::PoolExhausted)?;
            buf.as_mut_slice().fill(0x5c);
            let op = IoOp::Write {
                lba: offset / lba_size,
                buf,
                fua: false,
            };
            dev.submit(Request { token, op }).map_err(|r| r.reason)?;
            token += 1;
            offset += len;
            continue;
        }
        dev.wait(&mut done, Duration::from_secs(1))?;
        for c in done.drain(..) {
            c.result?;
        }
    }
    nvme::flush_sync(dev)
}

/// The workloads measured on every device: (name, write?, queue depth, fio engine, figure).
const WORKLOADS: [(&str, bool, u32, &str); 3] = [
    ("randwrite", true, 1, "p50 latency"),
    ("randread", false, 1, "p50 latency"),
    ("randread", false, 32, "IOPS"),
];

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs the whole device benchmark, printing progress to stderr.
///
/// The file backend and fio take turns, `rounds` times per workload, on the same file, and
/// the comparison uses the median of the rounds: a virtual disk's speed drifts over a minute,
/// and running one side entirely before the other would measure the drift.
pub fn run(config: &DeviceBenchConfig) -> Result<DeviceBenchReport, String> {
    let mut report = DeviceBenchReport::default();
    eprintln!(
        "memory backend: CPU cost per operation ({} ops each)...",
        config.mem_ops
    );
    report.cpu = mem_cpu_cost(config.mem_ops).map_err(|e| e.to_string())?;

    let image = tempfile::Builder::new()
        .prefix("corefs-devbench-")
        .suffix(".img")
        .tempfile_in(&config.image_dir)
        .map_err(|e| format!("creating an image in {}: {e}", config.image_dir.display()))?;
    let image_path = image.path().to_path_buf();
    let file_spec = format!("file:{},size={}", image_path.display(), config.image_bytes);
    let fio_ok = config.run_fio && fio::available();
    if !config.run_fio {
        report
            .notes
            .push("fio comparison skipped (--no-fio)".into());
    } else if !fio_ok {
        report
            .notes
            .push("fio is not installed (apt-get install fio): no fio comparison".into());
    }
    let rounds = config.rounds.max(1);

    let mut specs = vec![file_spec.clone()];
    specs.extend(config.devices.iter().cloned());
    for spec in &specs {
        eprintln!("{spec}: preparing...");
        let mut dev =
            nvme::open_device(spec, &OpenOptions::default()).map_err(|e| e.to_string())?;
        let name = dev.info().name.clone();
        let is_image = spec == &file_spec;
        if is_image {
            prefill(&mut *dev).map_err(|e| e.to_string())?;
        }
        // fio on the same device, reached as corefs reaches it: a file or block device
        // (`file:`) through io_uring with O_DIRECT, an NVMe namespace (`nvme:`) through
        // passthrough. `mem:` has no fio peer.
        let fio_target: Option<(PathBuf, u64, &str)> = if !fio_ok {
            None
        } else if is_image {
            Some((image_path.clone(), config.image_bytes, "io_uring"))
        } else {
            let engine = match spec.split_once(':').map(|(kind, _)| kind) {
                Some("nvme") => Some("io_uring_cmd"),
                Some("file") => Some("io_uring"),
                _ => None,
            };
            engine
                .zip(crate::suite::machine::device_path(spec))
                .map(|(engine, path)| (path, dev.info().capacity_bytes(), engine))
        };
        for (workload, write, depth, figure) in WORKLOADS {
            let fio_job = fio_target.as_ref().map(|(path, bytes, engine)| FioJob {
                file: path,
                size_bytes: *bytes,
                ioengine: engine,
                rw: workload,
                iodepth: depth,
                seconds: config.seconds_per_test.ceil() as u32,
            });
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            for round in 1..=rounds {
                eprintln!("{name}: 4KiB {workload} QD{depth}, round {round}/{rounds}...");
                let seed = 42 + round as u64;
                ours.push(
                    latency_run(&mut *dev, write, depth, config.seconds_per_test, seed)
                        .map_err(|e| format!("{name}: {e}"))?,
                );
                if let Some(job) = &fio_job {
                    eprintln!(
                        "fio --ioengine={}: 4KiB {workload} QD{depth}, round {round}/{rounds}...",
                        job.ioengine
                    );
                    theirs.push(fio::run(job)?);
                }
            }
            // The reported run is the round with the median p50 latency.
            let mut by_p50 = ours.clone();
            by_p50.sort_by_key(|l| l.p50_ns);
            let latency = by_p50[by_p50.len() / 2].clone();
            report.latency.push(LatencyResult {
                device: name.clone(),
                workload: workload.to_string(),
                queue_depth: depth,
                latency: latency.clone(),
            });
            if !theirs.is_empty() {
                let fio_median = FioResult {
                    iops: median(theirs.iter().map(|r| r.iops).collect()),
                    clat_p50_ns: median(theirs.iter().map(|r| r.clat_p50_ns as f64).collect())
                        as u64,
                    clat_p99_ns: median(theirs.iter().map(|r| r.clat_p99_ns as f64).collect())
                        as u64,
                    lat_mean_ns: median(theirs.iter().map(|r| r.lat_mean_ns).collect()),
                };
                let ours_iops = median(ours.iter().map(|l| l.ops_per_sec).collect());
                let ours_p50 = median(ours.iter().map(|l| l.p50_ns as f64).collect());
                let ratio = if figure == "IOPS" {
                    ours_iops / fio_median.iops
                } else {
                    ours_p50 / fio_median.clat_p50_ns.max(1) as f64
                };
                let mut corefs = latency;
                corefs.ops_per_sec = ours_iops;
                corefs.p50_ns = ours_p50 as u64;
                let job = fio_job.as_ref().expect("fio ran");
                report.fio.push(FioComparison {
                    workload: format!("4KiB {workload} QD{depth}"),
                    device: name.clone(),
                    fio_command: format!("fio {}", fio::args(job).join(" ")),
                    fio: fio_median,
                    corefs,
                    ratio,
                    figure: figure.to_string(),
                });
            }
        }
    }
    drop(image);
    Ok(report)
}

impl std::fmt::Display for DeviceBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "\nCPU cost per operation, memory backend (submit + complete):"
        )?;
        writeln!(
            f,
            "  {:<12} {:>6} {:>12} {:>12}",
            "op", "batch", "ops", "ns/op"
        )?;
        for c in &self.cpu {
            writeln!(
                f,
                "  {:<12} {:>6} {:>12} {:>12.1}",
                c.op, c.batch, c.ops, c.cpu_ns_per_op
            )?;
        }
        writeln!(f, "\nLatency, 4 KiB random I/O:")?;
        writeln!(
            f,
            "  {:<44} {:<10} {:>3} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "device", "workload", "QD", "IOPS", "p50", "p90", "p99", "p99.9", "max"
        )?;
        for r in &self.latency {
            let l = &r.latency;
            let device: String = r.device.chars().take(44).collect();
            writeln!(
                f,
                "  {:<44} {:<10} {:>3} {:>10.0} {:>8} {:>8} {:>8} {:>8} {:>8}",
                device,
                r.workload,
                r.queue_depth,
                l.ops_per_sec,
                fmt_ns(l.p50_ns as f64),
                fmt_ns(l.p90_ns as f64),
                fmt_ns(l.p99_ns as f64),
                fmt_ns(l.p999_ns as f64),
                fmt_ns(l.max_ns as f64)
            )?;
        }
        if !self.fio.is_empty() {
            writeln!(
                f,
                "\ncorefs's device layer vs fio on the same device, same run (medians of alternating rounds;\n\
                 fio with io_uring, fixed buffers and no ramp, as corefs runs):"
            )?;
            writeln!(
                f,
                "  {:<20} {:<24} {:>12} {:>12} {:>10} {:>10} {:>14}",
                "workload", "device", "fio IOPS", "corefs IOPS", "fio p50", "corefs p50", "ratio"
            )?;
            for c in &self.fio {
                // The device's name ends with what tells it apart (a path, a model).
                let skip = c.device.chars().count().saturating_sub(24);
                let device: String = c.device.chars().skip(skip).collect();
                writeln!(
                    f,
                    "  {:<20} {:<24} {:>12.0} {:>12.0} {:>10} {:>10} {:>8.3} ({})",
                    c.workload,
                    device,
                    c.fio.iops,
                    c.corefs.ops_per_sec,
                    fmt_ns(c.fio.clat_p50_ns as f64),
                    fmt_ns(c.corefs.p50_ns as f64),
                    c.ratio,
                    c.figure
                )?;
            }
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }
}
