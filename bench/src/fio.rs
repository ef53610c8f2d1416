//! Runs `fio` on the same file (or NVMe namespace) corefs's device benchmark used, so both are
//! measured in one run on the same disk, and reads its JSON output.
//!
//! The job matches what corefs's device layer does, so the ratio compares implementations, not
//! settings: io_uring at every queue depth (corefs submits through io_uring at depth 1 too),
//! with fixed buffers (`fixedbufs`: corefs registers its DMA pool), without registered files
//! (corefs does not register its descriptor), and without a ramp (corefs's side has none; the
//! rounds alternate, so neither side starts cold more than the other).

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// What one fio job measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FioResult {
    pub iops: f64,
    pub clat_p50_ns: u64,
    pub clat_p99_ns: u64,
    pub lat_mean_ns: f64,
}

/// A fio job: 4 KiB random I/O on `file` for `seconds`.
pub struct FioJob<'a> {
    pub file: &'a Path,
    pub size_bytes: u64,
    /// `io_uring` for a file, `io_uring_cmd` (NVMe passthrough) for a `/dev/ngXnY`.
    pub ioengine: &'a str,
    pub rw: &'a str,
    pub iodepth: u32,
    pub seconds: u32,
}

pub fn available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The fio arguments of `job` (JSON output).
pub fn args(job: &FioJob) -> Vec<String> {
    let mut args = vec![
        "--name=corefs-compare".to_string(),
        format!("--filename={}", job.file.display()),
        format!("--size={}", job.size_bytes),
        format!("--ioengine={}", job.ioengine),
    ];
    if job.ioengine == "io_uring_cmd" {
        args.push("--cmd_type=nvme".into());
    }
    args.extend([
        "--fixedbufs".to_string(),
        format!("--rw={}", job.rw),
        "--bs=4k".into(),
        "--direct=1".into(),
        format!("--iodepth={}", job.iodepth),
        "--time_based".into(),
        format!("--runtime={}", job.seconds),
        "--norandommap".into(),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ]);
    args
}

pub fn run(job: &FioJob) -> Result<FioResult, String> {
    let output = Command::new("fio")
        .args(args(job))
        .output()
        .map_err(|e| format!("running fio: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    parse(&String::from_utf8_lossy(&output.stdout), job.rw)
}

/// Reads IOPS and completion-latency percentiles from fio's JSON (`jobs[0].read|write`).
pub fn parse(json: &str, rw: &str) -> Result<FioResult, String> {
    // fio may print warnings before the JSON document.
    let start = json.find('{').ok_or("fio printed no JSON")?;
    let doc: Value = serde_json::from_str(&json[start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let side = if rw.contains("read") { "read" } else { "write" };
    let stats = &doc["jobs"][0][side];
    let percentile = |p: &str| stats["clat_ns"]["percentile"][p].as_u64().unwrap_or(0);
    let iops = stats["iops"].as_f64().ok_or("fio JSON lacks iops")?;
    Ok(FioResult {
        iops,
        clat_p50_ns: percentile("50.000000"),
        clat_p99_ns: percentile("99.000000"),
        lat_mean_ns: stats["lat_ns"]["mean"].as_f64().unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_job_matches_corefs_settings() {
        let job = super::FioJob {
            file: std::path::Path::new("/dev/ng0n1"),
            size_bytes: 1 << 30,
            ioengine: "io_uring_cmd",
            rw: "randread",
            iodepth: 1,
            seconds: 2,
        };
        let args = super::args(&job);
        assert!(args.contains(&"--fixedbufs".to_string()), "{args:?}");
        assert!(args.contains(&"--cmd_type=nvme".to_string()), "{args:?}");
        assert!(
            !args.iter().any(|a| a.starts_with("--ramp_time")),
            "{args:?}"
        );
        assert!(
            !args.iter().any(|a| a.starts_with("--registerfiles")),
            "{args:?}"
        );
    }

    #[test]
    fn parses_fio_json() {
        let json = r#"note: a warning first
{"jobs":[{"write":{"iops":1234.5,"lat_ns":{"mean":810.0},
 "clat_ns":{"percentile":{"50.000000":700,"99.000000":1500}}}}]}"#;
        let r = super::parse(json, "randwrite").unwrap();
        assert_eq!((r.iops, r.clat_p50_ns, r.clat_p99_ns), (1234.5, 700, 1500));
        assert!(super::parse("{}", "randread").is_err());
    }
}
