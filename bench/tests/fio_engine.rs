//! The fio ioengine for corefs (`bindings/fio/corefs_fio.c`, built by `scripts/fio-plugin.sh`
//! against the installed fio's headers) runs real fio jobs: random reads that keep the job's
//! queue depth in flight, random writes with an fsync after each, a sequential write that fio
//! verifies (crc32c) in the same run and again in a new process after a remount, and the
//! job file docs/benchmarks.md shows. Each checks fio's JSON output.
//!
//! fio and a C compiler are required (the test command installs them); a missing one fails
//! the test, never skips it. The engine links the libcorefs.so of this test run's profile:
//! build it first (`cargo build -p corefs-bindings`; the test command does). The first build
//! fetches fio's source once (cached in ~/.cache/corefs-fio).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

#[path = "../../bindings/tests/support/built_lib.rs"]
mod built_lib;
use built_lib::workspace;

/// Builds the engine once for all the tests; its path.
fn engine() -> &'static Path {
    static ENGINE: OnceLock<PathBuf> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let lib_dir = built_lib::fresh_lib_dir();
        let out = Command::new(workspace().join("scripts/fio-plugin.sh"))
            .env("COREFS_LIB_DIR", &lib_dir)
            .output()
            .expect("running scripts/fio-plugin.sh");
        assert!(
            out.status.success(),
            "scripts/fio-plugin.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
        assert!(
            path.is_file(),
            "the script printed {path:?}, not the engine"
        );
        path
    })
}

/// A scratch directory on a filesystem with O_DIRECT (the `file:` backend needs it).
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("corefs-fio-test-")
        .tempdir_in("/var/tmp")
        .expect("a scratch directory in /var/tmp")
}

struct Run {
    ok: bool,
    json: Value,
    stderr: String,
}

/// Runs fio with the corefs engine on the image in `dir` and JSON output, in `dir`: fio
/// writes the files it keeps beside a job (a verify job's `<job>-verify.state`) into its
/// working directory, which must not be the source tree.
fn fio(dir: &Path, args: &[&str]) -> Run {
    let out = Command::new("fio")
        .current_dir(dir)
        .arg(format!("--ioengine=external:{}", engine().display()))
        .arg(format!("--corefs_dev={}", device(dir)))
        .args(args)
        .arg("--output-format=json")
        .env("COREFS_LOG", "error")
        .output()
        .expect("running fio (apt-get install fio)");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = stdout
        .find('{')
        .and_then(|at| serde_json::from_str(&stdout[at..]).ok())
        .unwrap_or(Value::Null);
    Run {
        ok: out.status.success(),
        json,
        stderr: format!("{stderr}\n{stdout}"),
    }
}

fn checked(run: &Run) -> &Value {
    assert!(run.ok, "fio failed:\n{}", run.stderr);
    let job = &run.json["jobs"][0];
    assert_eq!(job["error"].as_i64(), Some(0), "{}", run.stderr);
    job
}

fn device(dir: &Path) -> String {
    format!("file:{}/fs.img,size=512MiB", dir.display())
}

#[test]
fn randread_keeps_the_queue_depth_in_flight() {
    let dir = scratch();
    let run = fio(
        dir.path(),
        &[
            "--name=randread",
            "--corefs_format=1",
            "--filename=/bench/randread",
            "--size=32m",
            "--rw=randread",
            "--bs=4k",
            "--iodepth=8",
            "--time_based",
            "--runtime=1",
        ],
    );
    let job = checked(&run);
    let read = &job["read"];
    let ios = read["total_ios"].as_u64().unwrap();
    assert!(ios > 100, "{ios} reads in a second");
    assert!(read["iops"].as_f64().unwrap() > 0.0);
    assert!(read["clat_ns"]["percentile"]["50.000000"].as_u64().unwrap() > 0);
    assert_eq!(read["short_ios"].as_u64(), Some(0));
    assert_eq!(job["write"]["total_ios"].as_u64(), Some(0));
    // fio records the depth at each submission: an engine that completed each read inside
    // queue() would show depth 1 throughout.
    let at_8 = job["iodepth_level"]["8"].as_f64().unwrap();
    assert!(
        at_8 > 90.0,
        "only {at_8}% of submissions at depth 8: {}",
        job["iodepth_level"]
    );
}

#[test]
fn randwrite_with_an_fsync_after_each_write() {
    let dir = scratch();
    let run = fio(
        dir.path(),
        &[
            "--name=randwrite",
            "--corefs_format=1",
            "--filename=/bench/randwrite",
            "--size=16m",
            "--rw=randwrite",
            "--bs=4k",
            "--fsync=1",
            "--time_based",
            "--runtime=1",
        ],
    );
    let job = checked(&run);
    let writes = job["write"]["total_ios"].as_u64().unwrap();
    let syncs = job["sync"]["total_ios"].as_u64().unwrap();
    assert!(writes > 10, "{writes} writes in a second");
    assert!(job["write"]["iops"].as_f64().unwrap() > 0.0);
    // fsync=1: one fsync per write (the last write may be cut off by the runtime).
    assert!(
        syncs + 1 >= writes && syncs <= writes,
        "{syncs} fsyncs for {writes} writes"
    );
    assert!(job["sync"]["lat_ns"]["mean"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_sequential_write_verifies_in_the_run_and_after_a_remount() {
    let dir = scratch();
    let size = 16u64 << 20;
    let write = [
        "--name=verify",
        "--filename=/bench/verify",
        "--size=16m",
        "--rw=write",
        "--bs=64k",
        "--iodepth=4",
        "--verify=crc32c",
    ];
    let mut args = vec!["--corefs_format=1"];
    args.extend(write);
    let run = fio(dir.path(), &args);
    let job = checked(&run);
    assert_eq!(job["write"]["io_bytes"].as_u64(), Some(size));
    // The verify pass reads everything written back and checks each block's crc32c.
    assert_eq!(
        job["read"]["io_bytes"].as_u64(),
        Some(size),
        "{}",
        run.stderr
    );
    // fio saved the verify state in the scratch directory, not where cargo runs tests.
    let state = "local-verify-0-verify.state";
    assert!(
        dir.path().join(state).is_file(),
        "no {state} in the scratch dir"
    );
    assert!(!Path::new(env!("CARGO_MANIFEST_DIR")).join(state).exists());

    // A new process mounts again (replaying what the first unmount committed) and verifies.
    let mut args = write.to_vec();
    args.push("--verify_only=1");
    let run = fio(dir.path(), &args);
    let job = checked(&run);
    assert_eq!(
        job["read"]["io_bytes"].as_u64(),
        Some(size),
        "{}",
        run.stderr
    );

    // And the verify can fail: a file laid out with plain data has no verify headers.
    let run = fio(
        dir.path(),
        &[
            "--name=plain",
            "--filename=/bench/plain",
            "--size=1m",
            "--rw=read",
            "--bs=64k",
            "--verify=crc32c",
            "--verify_only=1",
        ],
    );
    assert!(
        !run.ok || run.json["jobs"][0]["error"].as_i64() != Some(0),
        "verify passed on data fio never wrote:\n{}",
        run.stderr
    );
}

/// A file may take most of the device, whatever the shards: with the library's default of 64
/// (each held 1/64 of the device before, and the engine defaulted to 4 for that reason), a
/// sequential write of 400 MiB into a 512 MiB image runs and verifies.
#[test]
fn a_file_larger_than_a_shard_share_is_written_and_verified() {
    let dir = scratch();
    let run = fio(
        dir.path(),
        &[
            "--corefs_format=1",
            "--name=big",
            "--rw=write",
            "--bs=1m",
            "--iodepth=8",
            "--size=400m",
            "--verify=crc32c",
            "--do_verify=1",
        ],
    );
    let job = checked(&run);
    assert_eq!(job["write"]["io_kbytes"].as_u64(), Some(400 << 10));
    assert!(!run.stderr.contains("full"), "{}", run.stderr);
}

#[test]
fn the_readme_job_file_runs_on_corefs() {
    let dir = scratch();
    // The documented job, shortened: 1 s on a 64 MiB file instead of 10 s on 1 GiB.
    let text = std::fs::read_to_string(workspace().join("bindings/fio/examples/randread.fio"))
        .expect("the documented job file");
    assert!(text.contains("runtime=10") && text.contains("size=1g"));
    // docs/benchmarks.md shows the job as the file holds it.
    let job = &text[text.find("[randread]").expect("the job's section")..];
    let readme = std::fs::read_to_string(workspace().join("docs/benchmarks.md")).unwrap();
    assert!(
        readme.contains(job.trim_end()),
        "docs/benchmarks.md does not show bindings/fio/examples/randread.fio's job"
    );
    let short = text
        .replace("runtime=10", "runtime=1")
        .replace("size=1g", "size=64m");
    let file = dir.path().join("randread.fio");
    std::fs::write(&file, short).unwrap();
    let run = fio(dir.path(), &["--corefs_format=1", file.to_str().unwrap()]);
    let job = checked(&run);
    assert_eq!(job["jobname"].as_str(), Some("randread"));
    assert!(job["read"]["total_ios"].as_u64().unwrap() > 100);
    assert!(job["iodepth_level"]["32"].as_f64().unwrap() > 90.0);
}
