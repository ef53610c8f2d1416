//! Lines up two suite results (baseline and current), like fsperf-compare: per workload,
//! target and metric, the mean and standard deviation over each side's repeats, the percent
//! difference, and a `*` where the difference exceeds two of the baseline's standard
//! deviations (with one repeat there is no spread to judge by, which the report says).

use super::results::{RunResult, SuiteResults};
use crate::stats::fmt_ns;

/// Mean and sample standard deviation.
pub fn mean_stdev(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// One compared figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub workload: String,
    pub target: String,
    pub metric: &'static str,
    pub base: (f64, f64),
    pub current: (f64, f64),
    /// (current - base) / base, in percent.
    pub diff_pct: f64,
    /// The difference exceeds two baseline standard deviations.
    pub significant: bool,
    /// Whether a larger value is better (throughput) or worse (latency).
    pub higher_is_better: bool,
}

type Metric = (&'static str, bool, fn(&RunResult) -> f64);

const METRICS: [Metric; 6] = [
    ("ops/s", true, |r| r.ops_per_sec),
    ("MiB/s", true, |r| r.mib_per_sec),
    ("p50", false, |r| r.latency.p50_ns as f64),
    ("p99", false, |r| r.latency.p99_ns as f64),
    ("max", false, |r| r.latency.max_ns as f64),
    ("cpu/op", false, |r| r.cpu_ns_per_op),
];

/// Every metric of every workload and target present in both result sets.
pub fn compare(base: &SuiteResults, current: &SuiteResults) -> Vec<Line> {
    let mut lines = Vec::new();
    for workload in current.workloads() {
        for target in current.targets() {
            let b: Vec<&RunResult> = base.runs_of(&workload, &target).collect();
            let c: Vec<&RunResult> = current.runs_of(&workload, &target).collect();
            if b.is_empty() || c.is_empty() {
                continue;
            }
            for (metric, higher_is_better, f) in METRICS {
                let bv: Vec<f64> = b.iter().map(|r| f(r)).collect();
                let cv: Vec<f64> = c.iter().map(|r| f(r)).collect();
                let base_ms = mean_stdev(&bv);
                let cur_ms = mean_stdev(&cv);
                let diff_pct = if base_ms.0 != 0.0 {
                    (cur_ms.0 - base_ms.0) / base_ms.0 * 100.0
                } else {
                    0.0
                };
                lines.push(Line {
                    workload: workload.clone(),
                    target: target.clone(),
                    metric,
                    base: base_ms,
                    current: cur_ms,
                    diff_pct,
                    significant: bv.len() >= 2 && (cur_ms.0 - base_ms.0).abs() > 2.0 * base_ms.1,
                    higher_is_better,
                });
            }
        }
    }
    lines
}

fn fmt_value(metric: &str, v: f64) -> String {
    match metric {
        "ops/s" => format!("{v:.0}"),
        "MiB/s" => format!("{v:.1}"),
        _ => fmt_ns(v),
    }
}

/// Where the two runs' machines, settings or code differ: one line each, "warning: ..." for
/// what makes the figures incomparable (kernel, CPU, cores, disk, the filesystem under the
/// suite directory, placement, seconds per run, image size, a machine field one file lacks,
/// or a run that started on a busy machine) and a note for the corefs commit (comparing two commits is what compare is for, but
/// it is said).
pub fn differences(base: &SuiteResults, current: &SuiteResults) -> Vec<String> {
    let (b, c) = (&base.meta, &current.meta);
    let mut out = Vec::new();
    for (what, x, y) in [
        ("kernel", &b.kernel, &c.kernel),
        ("CPU model", &b.cpu_model, &c.cpu_model),
        ("device model", &b.device_model, &c.device_model),
    ] {
        if x.is_empty() || y.is_empty() {
            let which = match (x.is_empty(), y.is_empty()) {
                (true, true) => "either",
                (true, false) => "the baseline",
                _ => "the current",
            };
            out.push(format!(
                "warning: the {what} is not recorded in {which} result set: the runs may not be comparable"
            ));
        } else if x != y {
            out.push(format!(
                "warning: the runs differ in {what}: baseline {x:?}, current {y:?}"
            ));
        }
    }
    // Settings every result file records (placement: since it was added; an empty one is
    // not a difference).
    let settings = [
        ("CPU count", b.cpus.to_string(), c.cpus.to_string()),
        (
            "suite directory's filesystem",
            b.dir_fs.clone(),
            c.dir_fs.clone(),
        ),
        ("placement", b.placement.clone(), c.placement.clone()),
        (
            "seconds per run",
            b.seconds_per_run.to_string(),
            c.seconds_per_run.to_string(),
        ),
        (
            "image size",
            b.image_bytes.to_string(),
            c.image_bytes.to_string(),
        ),
    ];
    for (what, x, y) in settings {
        if !x.is_empty() && !y.is_empty() && x != y {
            out.push(format!(
                "warning: the runs differ in {what}: baseline {x:?}, current {y:?}"
            ));
        }
    }
    for (which, meta) in [("baseline", b), ("current", c)] {
        if let Some(load) = meta
            .load_avg_start
            .filter(|l| *l >= super::machine::BUSY_LOAD_AVG)
        {
            out.push(format!(
                "warning: the {which} run started on a busy machine (load average {load:.2} on {} CPUs)",
                meta.cpus
            ));
        }
    }
    if b.corefs_commit != c.corefs_commit {
        let name = |s: &str| {
            if s.is_empty() {
                "not recorded".to_string()
            } else {
                s.to_string()
            }
        };
        out.push(format!(
            "note: corefs commit {} (baseline) vs {} (current)",
            name(&b.corefs_commit),
            name(&c.corefs_commit)
        ));
    }
    out
}

/// The comparison as a table, after [`differences`].
pub fn report(base: &SuiteResults, current: &SuiteResults) -> String {
    use std::fmt::Write;
    let lines = compare(base, current);
    let mut out = String::new();
    for line in differences(base, current) {
        let _ = writeln!(out, "{line}");
    }
    if lines.is_empty() {
        out.push_str("no workload and target appear in both result sets\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<22} {:<14} {:<7} {:>20} {:>20} {:>9}",
        "workload", "target", "metric", "baseline (sd)", "current (sd)", "diff"
    );
    for l in &lines {
        let better = (l.diff_pct > 0.0) == l.higher_is_better;
        let _ = writeln!(
            out,
            "{:<22} {:<14} {:<7} {:>20} {:>20} {:>+8.1}%{}",
            l.workload,
            l.target,
            l.metric,
            format!(
                "{} ({})",
                fmt_value(l.metric, l.base.0),
                fmt_value(l.metric, l.base.1)
            ),
            format!(
                "{} ({})",
                fmt_value(l.metric, l.current.0),
                fmt_value(l.metric, l.current.1)
            ),
            l.diff_pct,
            match (l.significant, better) {
                (true, true) => " * better",
                (true, false) => " * worse",
                _ => "",
            }
        );
    }
    if base.meta.repeats < 2 {
        let _ = writeln!(
            out,
            "(the baseline has one repeat: no spread to judge significance by; run with --repeat 3)"
        );
    }
    out
}
