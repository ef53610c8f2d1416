//! `COREFS_LOG`: set at the first mount, libcorefs installs a stderr subscriber with that
//! filter; unset, none; a host's own subscriber stays. A subscriber is process-wide and
//! installed once, so each case runs in a child process (this test binary again, running
//! only `child`, with the case in `COREFS_LOG_TEST_CASE`).

use corefs::abi::*;
use std::process::Command;

/// What the child logs after mounting: a warning, which the filters below let through.
const PROBE: &str = "corefs-log-probe";

fn mount_and_close() {
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    let mut o: corefs_options = unsafe { std::mem::zeroed() };
    o.format = 1;
    o.shards = 4;
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(c"mem:64MiB".as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs}");
    tracing::warn!("{PROBE}");
    assert_eq!(corefs_close(fs), 0);
}

/// The child's side: runs only when the parent asks (otherwise it passes at once).
#[test]
fn child() {
    let Ok(case) = std::env::var("COREFS_LOG_TEST_CASE") else {
        return;
    };
    match case.as_str() {
        "off" | "on" | "bad" => mount_and_close(),
        "host" => {
            // The host's subscriber, installed first: to stdout.
            let host = tracing_subscriber::fmt()
                .with_writer(std::io::stdout)
                .with_ansi(false)
                .finish();
            tracing::subscriber::set_global_default(host).expect("the host's subscriber");
            mount_and_close();
        }
        other => panic!("unknown case {other}"),
    }
    println!(
        "subscriber installed: {}",
        tracing::dispatcher::has_been_set()
    );
}

/// Runs the child with `case` and COREFS_LOG (`None`: unset); returns its stdout and stderr.
fn run_child(case: &str, corefs_log: Option<&str>) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
    cmd.args(["child", "--exact", "--nocapture", "--test-threads", "1"])
        .env("COREFS_LOG_TEST_CASE", case)
        .env_remove("COREFS_LOG");
    if let Some(value) = corefs_log {
        cmd.env("COREFS_LOG", value);
    }
    let out = cmd.output().expect("run the child");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "child {case} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

#[test]
fn corefs_log_set_installs_a_stderr_subscriber() {
    let (stdout, stderr) = run_child("on", Some("warn"));
    assert!(stdout.contains("subscriber installed: true"), "{stdout}");
    assert!(stderr.contains(PROBE), "no probe on stderr:\n{stderr}");
    assert!(!stdout.contains(PROBE), "{stdout}");
}

#[test]
fn corefs_log_unset_installs_nothing() {
    let (stdout, stderr) = run_child("off", None);
    assert!(stdout.contains("subscriber installed: false"), "{stdout}");
    assert!(!stderr.contains(PROBE), "{stderr}");
}

#[test]
fn a_hosts_subscriber_stays() {
    let (stdout, stderr) = run_child("host", Some("warn"));
    assert!(
        stdout.contains(PROBE),
        "the host's subscriber lost the probe:\n{stdout}"
    );
    assert!(
        !stderr.contains(PROBE),
        "libcorefs replaced the host's subscriber:\n{stderr}"
    );
}

#[test]
fn a_bad_filter_is_reported_and_logging_stays_off() {
    let (stdout, stderr) = run_child("bad", Some("corefs=notalevel"));
    assert!(stdout.contains("subscriber installed: false"), "{stdout}");
    assert!(
        stderr.contains("COREFS_LOG"),
        "no report of the bad filter:\n{stderr}"
    );
}
