//! What a suite run records, as JSON: one [`RunResult`] per workload, target and repeat, with
//! the latency distribution kept (CDF points and log-spaced histogram buckets) so that plots and
//! comparisons can be made later from the file alone.

use crate::stats::latency_histogram;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Latency percentiles of one operation kind, nanoseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
}

impl Percentiles {
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        Percentiles {
            count: h.len(),
            mean_ns: h.mean(),
            p50_ns: h.value_at_quantile(0.50),
            p90_ns: h.value_at_quantile(0.90),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
        }
    }
}

/// One row of the per-operation table (dbench's Count / AvgLat / MaxLat, plus p99).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpRow {
    pub op: String,
    pub latency: Percentiles,
}

/// The engine's own figures over a run (corefs targets only).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineFigures {
    /// Block groups shards took from the pool and gave back, since the mount (absent from
    /// results written before the pool).
    #[serde(default)]
    pub groups_taken: u64,
    #[serde(default)]
    pub groups_returned: u64,
    pub commits: u64,
    pub commit_ms_avg: f64,
    pub commit_ms_max: f64,
    /// The longest a commit held the reactor (its writes run in the background).
    #[serde(default)]
    pub commit_pause_ms_max: f64,
    pub log_writes: u64,
    pub fallback_commits: u64,
    pub fsync_groups: u64,
    pub fsync_group_max: u64,
    /// Blocks unpinned after the last commit's SuperCommitted, and how long that took.
    pub unpinned_blocks_last: u64,
    pub unpin_ms_last: f64,
    /// CPU time of the reactor thread per operation it ran.
    pub reactor_cpu_ns_per_op: f64,
    /// File data blocks reads took from the engine's block cache and from the device, and
    /// the cache's size for the run (0: off, as for the random-read workloads). Absent from
    /// results written before they were recorded.
    #[serde(default)]
    pub data_cache_hits: u64,
    #[serde(default)]
    pub data_blocks_read: u64,
    #[serde(default)]
    pub data_cache_blocks: Option<u64>,
    /// The longest commit serialization slice, the longest the reactor's loop went without
    /// looking at its queue, and the longest synchronous device wait inside an operation.
    #[serde(default)]
    pub commit_slice_ms_max: f64,
    #[serde(default)]
    pub loop_gap_ms_max: f64,
    /// Of the loop's gaps, the most the reactor can have spent running in one
    /// ([`reactor::ReactorStats::loop_gap_on_cpu_ns_max`]); the rest of `loop_gap_ms_max`
    /// its thread or its virtual CPU was descheduled.
    #[serde(default)]
    pub loop_gap_on_cpu_ms_max: f64,
    #[serde(default)]
    pub device_wait_ms_max: f64,
    /// The longest any request took inside corefs, from its client's submit to its reply
    /// pushed ([`reactor::ReactorStats::reply`]): a client's max above it was the client's
    /// own wake-up or scheduling.
    #[serde(default)]
    pub reply_ms_max: f64,
    /// fsync's phases at the 99th percentile ([`reactor::ReactorStats::fsync_queue_wait`],
    /// `fsync_log_write`): waiting in the reactor's queue, and its group's log record write
    /// and flush. What an fsync's p99 is made of, inside corefs.
    #[serde(default)]
    pub fsync_queue_p99_ms: f64,
    #[serde(default)]
    pub fsync_log_p99_ms: f64,
}

/// (percentile, latency ns) points.
pub type Cdf = Vec<(f64, u64)>;
/// (bucket upper bound ns, count) pairs.
pub type Buckets = Vec<(u64, u64)>;

/// One workload on one target, one repeat.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunResult {
    pub workload: String,
    pub target: String,
    pub repeat: u32,
    pub seconds: f64,
    /// Operations of the workload's main kind (the one `latency` describes).
    pub ops: u64,
    pub ops_per_sec: f64,
    /// File data moved by the workload (written + read).
    pub bytes: u64,
    pub mib_per_sec: f64,
    /// Latency of the main operation kind.
    pub latency: Percentiles,
    /// Every operation kind the workload ran.
    pub op_table: Vec<OpRow>,
    /// Process CPU time (user + system, every thread) per main operation, with the target's
    /// server process's (corefs-serve, corefs-fuse).
    pub cpu_ns_per_op: f64,
    pub engine: Option<EngineFigures>,
    /// Time to mount the filesystem again after the run (unmount not counted), when the
    /// target can be remounted.
    pub mount_ms: Option<f64>,
    /// (percentile, latency ns) of the main operation, for CDF plots.
    pub cdf: Cdf,
    /// (bucket upper bound ns, count), log-spaced, for histogram plots.
    pub buckets: Buckets,
    /// CPU time the hypervisor took from this machine's cores during the run (steal, summed
    /// over the cores, from /proc/stat at its 10 ms resolution); None where not measured.
    /// On a virtual machine whose host preempts its vCPUs, a stolen slice of the reactor's
    /// core stops every client for that long, whatever corefs does: a max latency reads
    /// against it.
    #[serde(default)]
    pub host_steal_ms: Option<f64>,
}

/// Percentiles at which the CDF is sampled: dense in the tail, where latency stories are.
pub fn cdf_points() -> Vec<f64> {
    let mut points: Vec<f64> = (0..=90).map(|p| p as f64).collect();
    points.extend((1..=18).map(|i| 90.0 + i as f64 * 0.5));
    points.extend([99.5, 99.7, 99.8, 99.9, 99.95, 99.99, 99.999, 100.0]);
    points.dedup();
    points
}

impl RunResult {
    pub fn distribution(h: &Histogram<u64>) -> (Cdf, Buckets) {
        if h.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let cdf = cdf_points()
            .into_iter()
            .map(|p| (p, h.value_at_quantile(p / 100.0)))
            .collect();
        let start = h.min().max(1);
        let buckets = h
            .iter_log(start, 1.25)
            .map(|v| (v.value_iterated_to(), v.count_since_last_iteration()))
            .collect();
        (cdf, buckets)
    }
}

/// Where and how a suite ran.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Meta {
    pub corefs_version: String,
    pub started_unix: u64,
    pub kernel: String,
    pub cpus: usize,
    pub seconds_per_run: f64,
    pub image_bytes: u64,
    pub repeats: u32,
    /// The directory holding images and kernel targets, and its filesystem type.
    pub dir: String,
    pub dir_fs: String,
    /// Where corefs's reactors and clients ran (absent from results written before it was
    /// recorded).
    #[serde(default)]
    pub placement: String,
    /// What a comparison of two runs must hold equal (`corefs bench compare` warns when they
    /// differ; empty in results written before they were recorded): the CPU (/proc/cpuinfo's
    /// model name), the disk under `dir` and any corefs device target (sysfs model, or vendor
    /// id where a virtual disk has no model), and the corefs source tree's commit.
    #[serde(default)]
    pub cpu_model: String,
    #[serde(default)]
    pub device_model: String,
    #[serde(default)]
    pub corefs_commit: String,
    /// The machine's 1-minute load average when the run started (none: not recorded).
    #[serde(default)]
    pub load_avg_start: Option<f64>,
    /// The fio yardstick of the random-read workloads ([`super::fio_raw`]): fio's version and
    /// what it read, or why it did not run; empty where no random-read workload ran on
    /// corefs-file (and in results written before it was recorded).
    #[serde(default)]
    pub fio: String,
    /// CPU-bound neighbour processes spinning beside every run, and whether pinned one per
    /// core (0: a quiet run; absent from results written before).
    #[serde(default)]
    pub neighbours: u32,
    #[serde(default)]
    pub neighbours_pinned: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SuiteResults {
    pub meta: Meta,
    pub runs: Vec<RunResult>,
}

impl SuiteResults {
    pub fn load(path: &std::path::Path) -> Result<SuiteResults, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{} is not suite results: {e}", path.display()))
    }

    pub fn save(&self, path: &std::path::Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Workloads and targets in first-seen order.
    pub fn workloads(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.workload) {
                out.push(r.workload.clone());
            }
        }
        out
    }

    pub fn targets(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.target) {
                out.push(r.target.clone());
            }
        }
        out
    }

    pub fn runs_of<'a>(
        &'a self,
        workload: &'a str,
        target: &'a str,
    ) -> impl Iterator<Item = &'a RunResult> + 'a {
        self.runs
            .iter()
            .filter(move |r| r.workload == workload && r.target == target)
    }
}

/// A fresh histogram per operation kind.
pub fn new_histogram() -> Histogram<u64> {
    latency_histogram()
}
