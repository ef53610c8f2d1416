//! Latency summaries from HDR histograms, and thread CPU time.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latency percentiles in nanoseconds, plus throughput.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LatencySummary {
    pub ops: u64,
    pub ops_per_sec: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
    pub mean_ns: f64,
}

impl LatencySummary {
    pub fn from_histogram(h: &Histogram<u64>, elapsed_sec: f64) -> LatencySummary {
        LatencySummary {
            ops: h.len(),
            ops_per_sec: if elapsed_sec > 0.0 {
                h.len() as f64 / elapsed_sec
            } else {
                0.0
            },
            p50_ns: h.value_at_quantile(0.50),
            p90_ns: h.value_at_quantile(0.90),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
            mean_ns: h.mean(),
        }
    }
}

/// A histogram for latencies from 1 ns to 100 s at 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// CPU time consumed by the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(
        rc, 0,
        "CLOCK_THREAD_CPUTIME_ID is always available on Linux"
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Formats nanoseconds for a table: `850ns`, `12.3us`, `4.56ms`.
pub fn fmt_ns(ns: f64) -> String {
    if ns < 1_000.0 {
        format!("{ns:.0}ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1}us", ns / 1e3)
    } else if ns < 1_000_000_000.0 {
        format!("{:.2}ms", ns / 1e6)
    } else {
        format!("{:.2}s", ns / 1e9)
    }
}
