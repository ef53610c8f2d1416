//! The suite's RocksDB rows: `corefs bench suite --only rocksdb` runs `corefs_db_bench`
//! (bindings/rocksdb/corefs_db_bench.cc, built by scripts/rocksdb-build.sh against Debian's
//! librocksdb-dev) — db_bench's fillseq, fillrandom, overwrite, readrandom and readwhilewriting
//! on corefs (through its RocksDB FileSystem) and on the kernel directory — and reads its
//! JSON lines into [`RunResult`]s, which join the suite's table, results.json and plots.
//!
//! Invariants: RocksDB workloads run only when an `--only` entry starts with "rocksdb" (the
//! full suite stays the same length); when they are asked for but cannot run (the library or
//! the program is missing) the reason is said, and it is an error when nothing else was asked;
//! every run the program reports becomes exactly one result, and a malformed line is an error
//! naming it, never a silent gap.

use super::results::{Percentiles, RunResult};
use super::session::R;
use super::SuiteConfig;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where librocksdb-dev puts the header the FileSystem is built against.
const ROCKSDB_HEADER: &str = "/usr/include/rocksdb/file_system.h";
/// The program's name, next to the `corefs` binary in target/release.
const PROGRAM: &str = "corefs_db_bench";
/// How corefs runs under RocksDB (the C ABI's defaults), for the table's header line.
pub const PLACEMENT: &str = "rocksdb rows: corefs's reactor spins then parks, unpinned, \
     sharing every core with RocksDB's threads";
/// Latencies above this are clamped into the histogram's top (100 s, as the suite's).
const LATENCY_NS_MAX: u64 = 100_000_000_000;

/// The `--only` entries that select RocksDB workloads.
pub fn entries(only: &[String]) -> Vec<String> {
    only.iter()
        .filter(|o| o.starts_with("rocksdb"))
        .cloned()
        .collect()
}

/// The program to run, or why RocksDB workloads are skipped.
pub fn program() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("COREFS_DB_BENCH") {
        return Ok(PathBuf::from(path));
    }
    if !Path::new(ROCKSDB_HEADER).exists() {
        return Err(format!(
            "rocksdb: skipped: librocksdb-dev is not installed ({ROCKSDB_HEADER} is missing; \
             apt-get install librocksdb-dev g++, then scripts/rocksdb-build.sh)"
        ));
    }
    let exe = std::env::current_exe().map_err(|e| format!("rocksdb: skipped: {e}"))?;
    let path = exe
        .parent()
        .map(|d| d.join(PROGRAM))
        .unwrap_or_else(|| PathBuf::from(PROGRAM));
    if !path.exists() {
        return Err(format!(
            "rocksdb: skipped: {} is not built (run scripts/rocksdb-build.sh)",
            path.display()
        ));
    }
    Ok(path)
}

/// One JSON line of the program.
#[derive(serde::Deserialize)]
struct Line {
    workload: String,
    target: String,
    seconds: f64,
    ops: u64,
    bytes: u64,
    cpu_ns: u64,
    /// (latency ns, count) pairs.
    buckets: Vec<(u64, u64)>,
}

/// Turns one JSON line into a result of repeat `repeat`.
pub fn parse_line(text: &str, repeat: u32) -> R<RunResult> {
    let line: Line = serde_json::from_str(text)
        .map_err(|e| format!("rocksdb: bad result line {text:.80}...: {e}"))?;
    let mut h = crate::stats::latency_histogram();
    for &(ns, count) in &line.buckets {
        h.record_n(ns.clamp(1, LATENCY_NS_MAX), count)
            .map_err(|e| format!("rocksdb: latency {ns} ns: {e}"))?;
    }
    if h.len() != line.ops {
        return Err(format!(
            "rocksdb: {} on {}: {} latencies for {} operations",
            line.workload,
            line.target,
            h.len(),
            line.ops
        ));
    }
    let (cdf, buckets) = RunResult::distribution(&h);
    let per_sec = |x: f64| {
        if line.seconds > 0.0 {
            x / line.seconds
        } else {
            0.0
        }
    };
    Ok(RunResult {
        latency: Percentiles::of(&h),
        op_table: Vec::new(),
        workload: line.workload,
        target: line.target,
        repeat,
        seconds: line.seconds,
        ops: line.ops,
        ops_per_sec: per_sec(line.ops as f64),
        bytes: line.bytes,
        mib_per_sec: per_sec(line.bytes as f64) / (1 << 20) as f64,
        cpu_ns_per_op: if line.ops > 0 {
            line.cpu_ns as f64 / line.ops as f64
        } else {
            0.0
        },
        engine: None,
        mount_ms: None,
        host_steal_ms: None,
        cdf,
        buckets,
    })
}

/// Runs the program once per repeat with the suite's directory, image size, shards, seconds
/// and seed; its progress lines go to `progress`.
pub fn run(
    program: &Path,
    config: &SuiteConfig,
    only: &[String],
    progress: &(dyn Fn(&str) + Sync),
) -> R<Vec<RunResult>> {
    let mut out = Vec::new();
    for repeat in 0..config.repeats {
        let json = tempfile::Builder::new()
            .prefix("corefs-rocksdb-")
            .suffix(".json")
            .tempfile()
            .map_err(|e| format!("rocksdb: a results file: {e}"))?;
        let mut child = Command::new(program)
            .arg("--dir")
            .arg(&config.dir)
            .args(["--seconds", &config.seconds.to_string()])
            .args([
                "--seed",
                &config.seed.wrapping_add(repeat as u64).to_string(),
            ])
            .args(["--image-bytes", &config.image_bytes.to_string()])
            .args(["--shards", &config.shards.to_string()])
            .args(["--only", &only.join(",")])
            .arg("--json")
            .arg(json.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("rocksdb: starting {}: {e}", program.display()))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let mut last = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.map_err(|e| format!("rocksdb: reading its output: {e}"))?;
            progress(&format!("rocksdb: {line}"));
            last.push(line);
            if last.len() > 5 {
                last.remove(0);
            }
        }
        let status = child
            .wait()
            .map_err(|e| format!("rocksdb: waiting for {}: {e}", program.display()))?;
        if !status.success() {
            return Err(format!(
                "rocksdb: {} failed ({status}): {}",
                program.display(),
                last.join(" | ")
            ));
        }
        let text = std::fs::read_to_string(json.path())
            .map_err(|e| format!("rocksdb: {}: {e}", json.path().display()))?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            out.push(parse_line(line, repeat)?);
        }
    }
    if out.is_empty() {
        return Err(format!("rocksdb: no workload matches {only:?}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_becomes_a_result_with_its_percentiles() {
        let text = r#"{"workload":"rocksdb-fillrand-sync","target":"corefs-file","seconds":2.0,"ops":100,"bytes":11600,"cpu_ns":5000000,"buckets":[[1000,50],[2000,49],[90000,1]]}"#;
        let r = parse_line(text, 1).unwrap();
        assert_eq!(r.workload, "rocksdb-fillrand-sync");
        assert_eq!(r.repeat, 1);
        assert_eq!(r.ops, 100);
        assert_eq!(r.ops_per_sec, 50.0);
        assert_eq!(r.cpu_ns_per_op, 50_000.0);
        assert_eq!(r.latency.count, 100);
        // HDR's 3 significant digits: within 0.1%.
        assert!(
            (999..=1001).contains(&r.latency.p50_ns),
            "{}",
            r.latency.p50_ns
        );
        assert!(
            (1998..=2002).contains(&r.latency.p99_ns),
            "{}",
            r.latency.p99_ns
        );
        assert!((89_900..=90_100).contains(&r.latency.max_ns));
    }

    #[test]
    fn a_count_that_does_not_match_the_operations_is_an_error() {
        let text = r#"{"workload":"w","target":"t","seconds":1.0,"ops":3,"bytes":0,"cpu_ns":0,"buckets":[[1000,2]]}"#;
        assert!(parse_line(text, 0)
            .unwrap_err()
            .contains("2 latencies for 3"));
    }

    #[test]
    fn only_entries_starting_with_rocksdb_select_it() {
        let only = vec!["fsync".to_string(), "rocksdb-read".to_string()];
        assert_eq!(entries(&only), vec!["rocksdb-read".to_string()]);
        assert!(entries(&[]).is_empty());
    }
}
