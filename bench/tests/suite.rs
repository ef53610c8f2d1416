//! The benchmark suite's machinery (not its speed): every workload runs on corefs and on a
//! kernel directory and yields sane, complete results; JSON round-trips; plots and tables are
//! written; compare's statistics and significance marks are right; loop-device kernel peers
//! are made and torn down (as root) or refused with a clear error (otherwise).

use corefs_bench::suite::compare::{compare, mean_stdev};
use corefs_bench::suite::results::{Percentiles, RunResult, SuiteResults};
use corefs_bench::suite::workloads::Sizes;
use corefs_bench::suite::{self, Placement, SuiteConfig, TargetSpec};

fn tiny_config(dir: &std::path::Path, targets: Vec<TargetSpec>) -> SuiteConfig {
    SuiteConfig {
        dir: dir.to_path_buf(),
        image_bytes: 256 << 20,
        shards: 2,
        seconds: 0.25,
        repeats: 1,
        targets,
        only: Vec::new(),
        sizes: Sizes {
            writers: 2,
            write_file_bytes: 1 << 20,
            fsync_every: 4,
            create_clients: 2,
            create_dirs: 2,
            dbench_clients: 2,
            read_file_bytes: 4 << 20,
            seq_file_bytes: 8 << 20,
        },
        placement: Placement::Shared,
        reactors: 1,
        seed: 7,
        neighbours: 0,
        neighbours_pinned: false,
    }
}

/// A directory on a filesystem with O_DIRECT (the kernel target's random reads need it).
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("corefs-suite-test-")
        .tempdir_in("/var/tmp")
        .expect("a scratch directory in /var/tmp")
}

/// The default placement on a machine with a core to spare: the reactor busy-polls on a core
/// of its own (the last), the clients are pinned to the others, and every workload runs; the
/// placement is recorded with the results.
#[test]
fn every_workload_runs_with_the_reactor_on_a_dedicated_core() {
    let cores = reactor::affinity::allowed_cores().map_or(0, |c| c.len());
    let placement = Placement::choose(1, false);
    if cores >= 2 {
        let Placement::Dedicated {
            reactor_cores,
            client_cores,
        } = &placement
        else {
            panic!("{cores} cores but {placement:?}");
        };
        assert_eq!(reactor_cores.len(), 1);
        assert_eq!(client_cores.len(), cores - 1);
        assert!(!client_cores.contains(&reactor_cores[0]));
    } else {
        assert_eq!(
            placement,
            Placement::Shared,
            "one core: nothing to dedicate"
        );
    }
    assert_eq!(Placement::choose(1, true), Placement::Shared);
    let dir = scratch();
    let mut config = tiny_config(dir.path(), vec![TargetSpec::CorefsMem]);
    config.placement = placement.clone();
    let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
    assert_eq!(results.runs.len(), 12);
    assert!(results.runs.iter().all(|r| r.ops > 0), "every workload ran");
    assert_eq!(results.meta.placement, placement.describe());
}

/// Every workload through two reactors (creates, renames, deltree spanning them; the reads
/// after a remount of the memory device, whose queues the reactors share).
/// The neighbour rows' smoke (no timing: the suite measures it): every workload runs on
/// corefs and on a kernel directory with a CPU-bound process spinning beside it, in both
/// placements, and the results say so; the spinner is gone afterwards.
#[test]
fn every_workload_runs_beside_a_cpu_bound_neighbour() {
    for shared in [false, true] {
        let dir = scratch();
        let mut config = tiny_config(
            dir.path(),
            vec![
                TargetSpec::CorefsMem,
                TargetSpec::KernelDir(dir.path().to_path_buf()),
            ],
        );
        config.placement = Placement::choose(1, shared);
        config.neighbours = 1;
        config.repeats = 2;
        let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
        assert_eq!(results.meta.neighbours, 1);
        assert_eq!(results.runs.len(), 2 * 2 * 12);
        assert!(results.runs.iter().all(|r| r.ops > 0), "{:?}", results.runs);
        let table = suite::side_by_side(&results);
        assert!(table.contains("with 1 CPU-bound neighbour"), "{table}");
        assert!(table.contains("ratios over paired repeats"), "{table}");
    }
    let spinners = std::process::Command::new("pgrep")
        .args(["-f", "while :; do :; done"])
        .output()
        .unwrap();
    assert!(
        spinners.stdout.is_empty(),
        "a neighbour outlived the suite: {}",
        String::from_utf8_lossy(&spinners.stdout)
    );
}

#[test]
fn every_workload_runs_on_two_reactors() {
    let dir = scratch();
    let mut config = tiny_config(dir.path(), vec![TargetSpec::CorefsMem]);
    config.reactors = 2;
    let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
    assert_eq!(results.runs.len(), 12);
    for run in &results.runs {
        assert!(
            run.ops > 0,
            "{} on two reactors: no operations",
            run.workload
        );
        let engine = run.engine.as_ref().expect("engine figures");
        if ["append", "randwrite", "fsync"]
            .iter()
            .any(|w| run.workload.starts_with(w))
        {
            assert!(engine.log_writes > 0, "{}: {engine:?}", run.workload);
        }
    }
}

#[test]
fn every_workload_runs_on_corefs_and_a_kernel_directory() {
    let dir = scratch();
    let config = tiny_config(
        dir.path(),
        vec![
            TargetSpec::CorefsFile,
            TargetSpec::CorefsMem,
            TargetSpec::KernelDir(dir.path().to_path_buf()),
        ],
    );
    let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
    let workloads = results.workloads();
    assert_eq!(workloads.len(), 12, "{workloads:?}");
    // With fio installed, the two random-read workloads also have fio's rows on corefs-file's
    // image; without it, the results say why there are none.
    let fio = suite::fio_raw::version().is_ok();
    let fio_rows = if fio { 2 } else { 0 };
    assert_eq!(
        results.targets().len(),
        3 + usize::from(fio),
        "{:?}",
        results.targets()
    );
    assert_eq!(results.runs.len(), 36 + fio_rows);
    let comparison = suite::fio_raw::comparison(&results);
    if fio {
        assert!(results.meta.fio.starts_with("fio-"), "{}", results.meta.fio);
        for w in ["randread-qd1", "randread-qd32"] {
            let fio_run = results
                .runs_of(w, suite::fio_raw::TARGET)
                .next()
                .unwrap_or_else(|| panic!("{w} has no fio row"));
            assert!(fio_run.bytes == fio_run.ops * 4096, "{fio_run:?}");
        }
        assert!(
            comparison.contains("randread-qd1: corefs-file p50")
                && comparison.contains("randread-qd32: corefs-file")
                && comparison.contains("fio io_uring QD32 IOPS"),
            "{comparison}"
        );
    } else {
        assert!(
            results.meta.fio.contains("not installed"),
            "{:?}",
            results.meta
        );
        assert!(comparison.contains("no fio comparison"), "{comparison}");
    }
    for run in &results.runs {
        let what = format!("{} on {}", run.workload, run.target);
        assert!(run.ops > 0, "{what}: no operations");
        assert!(run.ops_per_sec > 0.0, "{what}");
        let l = &run.latency;
        assert_eq!(l.count, run.ops, "{what}");
        assert!(
            l.p50_ns <= l.p90_ns && l.p90_ns <= l.p99_ns,
            "{what}: {l:?}"
        );
        assert!(
            l.p99_ns <= l.p999_ns && l.p999_ns <= l.max_ns,
            "{what}: {l:?}"
        );
        assert!(run.cpu_ns_per_op > 0.0, "{what}");
        assert!(!run.cdf.is_empty() && !run.buckets.is_empty(), "{what}");
        assert_eq!(
            run.buckets.iter().map(|b| b.1).sum::<u64>(),
            run.ops,
            "{what}: histogram buckets hold every sample"
        );
        let corefs = run.target.starts_with("corefs");
        assert_eq!(run.engine.is_some(), corefs, "{what}: engine figures");
        // corefs remounts after every run (but a memory device mounted through the C ABI
        // goes with that mount); a plain kernel directory cannot be remounted.
        let abi = run.workload.starts_with("abi-");
        let remountable = corefs && !(abi && run.target == "corefs-mem");
        assert_eq!(run.mount_ms.is_some(), remountable, "{what}: mount time");
        if !run.workload.starts_with("creates") && !abi {
            assert!(run.bytes > 0, "{what}: moved no data");
        }
    }
    // dbench's per-operation table has every operation of the mix.
    let dbench = results
        .runs
        .iter()
        .find(|r| r.workload == "dbench" && r.target == "corefs-file")
        .expect("dbench on corefs");
    for op in [
        "Mkdir",
        "Create",
        "WriteX",
        "Close",
        "Qpathinfo",
        "Find",
        "Open",
        "ReadX",
        "Rename",
        "Flush",
        "Unlink",
        "Deltree",
    ] {
        let row = dbench.op_table.iter().find(|r| r.op == op);
        assert!(
            row.is_some_and(|r| r.latency.count > 0),
            "dbench lacks {op}"
        );
    }
    // fsyncs on corefs went through its log (the engine figures are live, not zeros).
    let append = results
        .runs
        .iter()
        .find(|r| r.workload == "append-fdatasync" && r.target == "corefs-mem")
        .expect("append on corefs-mem");
    let engine = append.engine.as_ref().expect("engine figures");
    assert!(engine.log_writes > 0, "{engine:?}");

    // The outputs: JSON that loads back equal, the table, one CDF per workload and one
    // histogram per workload and target, each an SVG naming what it shows.
    let out = dir.path().join("out");
    let files = suite::write_outputs(&results, &out).expect("outputs");
    let loaded = SuiteResults::load(&out.join("results.json")).expect("load");
    assert!(loaded == results, "results.json does not load back equal");
    assert_eq!(files.len(), 2 + 12 + 12 * 3 + fio_rows, "{files:?}");
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "svg"))
    {
        let text = std::fs::read_to_string(file).expect("svg");
        assert!(text.contains("<svg"), "{}", file.display());
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let workload = workloads
            .iter()
            .find(|w| name.contains(w.as_str()))
            .expect("file named after a workload");
        assert!(
            text.contains(workload.as_str()),
            "{name} does not name {workload}"
        );
    }
    let table = std::fs::read_to_string(out.join("table.txt")).expect("table");
    assert!(table.contains("corefs-file/"), "ratio rows: {table}");
    assert!(table.contains("Deltree"), "dbench table: {table}");
    assert!(table.contains(comparison.trim()), "fio comparison: {table}");
}

fn run_with(target: &str, ops_per_sec: f64, p99_ns: u64) -> RunResult {
    RunResult {
        workload: "w".into(),
        target: target.into(),
        repeat: 0,
        seconds: 1.0,
        ops: ops_per_sec as u64,
        ops_per_sec,
        bytes: 0,
        mib_per_sec: 0.0,
        latency: Percentiles {
            count: 1,
            p99_ns,
            ..Percentiles::default()
        },
        op_table: Vec::new(),
        cpu_ns_per_op: 1.0,
        engine: None,
        mount_ms: None,
        host_steal_ms: Some(40.0),
        cdf: Vec::new(),
        buckets: Vec::new(),
    }
}

fn results_of(runs: Vec<RunResult>) -> SuiteResults {
    let mut r = SuiteResults::default();
    r.meta.repeats = runs.len() as u32;
    r.runs = runs;
    r
}

#[test]
fn compare_marks_only_differences_beyond_two_stdevs() {
    let (mean, sd) = mean_stdev(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
    assert_eq!(mean, 5.0);
    assert!((sd - 2.138).abs() < 0.001, "{sd}");
    assert_eq!(mean_stdev(&[3.0]), (3.0, 0.0));

    let base = results_of(vec![
        run_with("t", 100.0, 1000),
        run_with("t", 110.0, 1100),
        run_with("t", 90.0, 900),
    ]);
    // Throughput +5% is within 2 sd (sd = 10); p99 doubled is far outside (sd = 100 ns).
    let current = results_of(vec![run_with("t", 105.0, 2000), run_with("t", 105.0, 2000)]);
    let lines = compare(&base, &current);
    let ops = lines.iter().find(|l| l.metric == "ops/s").expect("ops/s");
    assert!((ops.diff_pct - 5.0).abs() < 1e-9, "{ops:?}");
    assert!(!ops.significant, "{ops:?}");
    let p99 = lines.iter().find(|l| l.metric == "p99").expect("p99");
    assert!((p99.diff_pct - 100.0).abs() < 1e-9, "{p99:?}");
    assert!(p99.significant && !p99.higher_is_better, "{p99:?}");
    let report = corefs_bench::suite::compare::report(&base, &current);
    assert!(report.contains("* worse"), "{report}");

    // One baseline repeat: no spread, so nothing is marked, and the report says why.
    let single = results_of(vec![run_with("t", 100.0, 1000)]);
    assert!(compare(&single, &current).iter().all(|l| !l.significant));
    assert!(corefs_bench::suite::compare::report(&single, &current).contains("one repeat"));
}

#[test]
fn targets_parse_and_bad_ones_are_named() {
    assert_eq!(TargetSpec::parse("corefs-file"), Ok(TargetSpec::CorefsFile));
    assert_eq!(
        TargetSpec::parse("corefs:nvme:/dev/ng0n1"),
        Ok(TargetSpec::CorefsDevice("nvme:/dev/ng0n1".into()))
    );
    assert_eq!(
        TargetSpec::parse("xfs"),
        Ok(TargetSpec::KernelLoop("xfs".into()))
    );
    let err = TargetSpec::parse("zfs").unwrap_err();
    assert!(err.contains("zfs") && err.contains("ext4"), "{err}");
}

/// As root (CI), ext4 is made on a loop device, used by a workload, remounted (timed) and torn
/// down; otherwise making it fails with an error that says root is needed.
#[test]
fn loop_device_kernel_peer() {
    let dir = scratch();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut config = tiny_config(dir.path(), vec![TargetSpec::KernelLoop("ext4".into())]);
    config.only = vec!["creates".into()];
    let result = suite::run(&config, &|line| eprintln!("{line}"));
    if !root {
        let err = result.expect_err("loop devices need root");
        assert!(err.contains("root"), "{err}");
        eprintln!("not root: checked the refusal only");
        return;
    }
    let results = result.expect("ext4 on a loop device");
    let run = &results.runs[0];
    assert_eq!(run.target, "ext4-loop");
    assert!(run.ops > 0);
    assert!(
        run.mount_ms.is_some_and(|ms| ms > 0.0),
        "{:?}",
        run.mount_ms
    );
    // Torn down: nothing of the run is left in the directory.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The clients benchmark (docs/reactors.md's figures) places corefs as the suite does — a dedicated
/// busy-polling reactor core when there is one to spare, shared cores on request — and its
/// figures come from real fsyncs: every client's fsyncs were counted by the reactor, almost none
/// fell back to a commit, and the idle instance was measured.
#[test]
fn the_clients_benchmark_runs_dedicated_and_shared_and_counts_real_fsyncs() {
    let dir = scratch();
    for shared_cores in [false, true] {
        let config = corefs_bench::clients::ClientsBenchConfig {
            dir: dir.path().to_path_buf(),
            // 16 shards, a file's data in its inode's shard: 32 MiB each.
            image_bytes: 512 << 20,
            clients: vec![1, 4],
            seconds: 0.3,
            idle_seconds: 0.2,
            shared_cores,
            reactors: vec![1],
            ..Default::default()
        };
        let report = corefs_bench::clients::run(&config).expect("clients bench runs");
        assert_eq!(report.results.len(), 2);
        for r in &report.results {
            assert_eq!(
                r.placement,
                Placement::choose(1, shared_cores).describe(),
                "{shared_cores}"
            );
            assert!(r.fsyncs >= r.latency.ops, "{r:?}");
            assert!(r.latency.ops > 0 && r.log_writes > 0, "{r:?}");
            // Nearly every fsync is a log record. A few may fall back when the log half fills
            // before the commit started to free the other one has finished, which a loaded
            // machine (CI beside crash tests: 2 of 2,689) can delay; that fallback is the
            // designed answer to a full log, not a wrong one.
            assert!(r.fallback_share < 0.01, "{r:?}");
        }
        assert_eq!(report.idle_core_share.len(), 1);
        assert!(report.idle_core_share[0].1.is_finite());
    }
}

/// corefs's random reads measure the device path, as the kernel's O_DIRECT reads do: the
/// data-block cache is off for them (no hits, every block from the device) and on for the
/// other workloads, and each corefs run reports its hits.
#[test]
fn randread_runs_with_the_data_cache_off_and_hits_are_reported() {
    let dir = scratch();
    let mut config = tiny_config(dir.path(), vec![TargetSpec::CorefsMem]);
    config.only = vec!["randread-qd1".into(), "dbench".into()];
    let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
    let engine_of = |workload: &str| {
        results
            .runs
            .iter()
            .find(|r| r.workload == workload)
            .and_then(|r| r.engine.clone())
            .unwrap_or_else(|| panic!("{workload} ran with engine figures"))
    };
    let reads = engine_of("randread-qd1");
    assert_eq!(reads.data_cache_blocks, Some(0), "{reads:?}");
    assert_eq!(reads.data_cache_hits, 0, "{reads:?}");
    assert!(reads.data_blocks_read > 0, "{reads:?}");
    let dbench = engine_of("dbench");
    assert_eq!(
        dbench.data_cache_blocks,
        Some(engine::writeback::CACHE_BLOCKS as u64)
    );
    // dbench reads back files it just wrote: the cache serves them.
    assert!(dbench.data_cache_hits > 0, "{dbench:?}");
    let details = suite::details(&results);
    assert!(details.contains("off"), "{details}");
    assert!(details.contains(" hits ("), "{details}");
}

/// The table's "max" is the largest latency of any repeat, not the mean of their maxima.
#[test]
fn the_max_column_is_the_maximum_over_repeats() {
    let mut a = run_with("corefs-x", 100.0, 1000);
    a.latency.max_ns = 1_000_000;
    let mut b = run_with("corefs-x", 100.0, 1000);
    b.latency.max_ns = 9_000_000;
    b.repeat = 1;
    let table = suite::side_by_side(&results_of(vec![a, b]));
    assert!(table.contains("9.00ms"), "{table}");
    assert!(!table.contains("5.00ms"), "{table}");
}

/// A run records the machine and the code it ran on, and compare warns when two differ.
#[test]
fn results_record_the_machine_and_compare_warns_when_it_differs() {
    let dir = scratch();
    let mut config = tiny_config(dir.path(), vec![TargetSpec::CorefsMem]);
    config.only = vec!["creates".into()];
    let results = suite::run(&config, &|line| eprintln!("{line}")).expect("suite runs");
    let meta = &results.meta;
    for (what, value) in [
        ("kernel", &meta.kernel),
        ("cpu_model", &meta.cpu_model),
        ("device_model", &meta.device_model),
        ("corefs_commit", &meta.corefs_commit),
    ] {
        assert!(!value.is_empty(), "{what} not recorded: {meta:?}");
    }
    assert!(meta.load_avg_start.is_some(), "load not recorded: {meta:?}");
    // As if the run started on an idle machine (other builds may have loaded this one); the
    // busy case is checked below.
    let mut results = results.clone();
    results.meta.load_avg_start = Some(0.1);
    assert!(
        corefs_bench::suite::compare::differences(&results, &results).is_empty(),
        "a run differs from itself"
    );
    let mut other = results.clone();
    other.meta.cpu_model = "another CPU".into();
    other.meta.corefs_commit = "0123456789ab".into();
    let report = corefs_bench::suite::compare::report(&results, &other);
    assert!(
        report.contains("warning: the runs differ in CPU model"),
        "{report}"
    );
    assert!(report.contains("note: corefs commit"), "{report}");
    assert!(!report.contains("differ in kernel"), "{report}");
    // A run that started on a busy machine is said.
    let mut busy = results.clone();
    busy.meta.load_avg_start = Some(2.4);
    let report = corefs_bench::suite::compare::report(&results, &busy);
    assert!(
        report.contains("warning: the current run started on a busy machine (load average 2.40"),
        "{report}"
    );
    // Settings that change the figures are said too.
    let mut longer = results.clone();
    longer.meta.seconds_per_run *= 2.0;
    let report = corefs_bench::suite::compare::report(&results, &longer);
    assert!(
        report.contains("warning: the runs differ in seconds per run"),
        "{report}"
    );
    // Results from before these were recorded: said, not silently compared.
    let mut old = results.clone();
    old.meta.device_model.clear();
    let report = corefs_bench::suite::compare::report(&old, &results);
    assert!(
        report.contains("device model is not recorded in the baseline"),
        "{report}"
    );
}

/// `bench fsync` runs corefs on the device it is given, calls fdatasync as the kernel side
/// does, and times corefs's commits inside the operations that paid for them (as ext4's
/// journal commits land inside its fdatasync): an operation that ran a commit took at least
/// the commit's time.
#[test]
fn the_fsync_benchmark_runs_on_a_given_device_with_commits_inside_the_timer() {
    let dir = scratch();
    let config = corefs_bench::fsync::FsyncBenchConfig {
        dir: dir.path().to_path_buf(),
        kernel_dir: None,
        device: Some("mem:1GiB".into()),
        image_bytes: 256 << 20,
        // Longer than the commit interval (5 s), so the run has a commit however slow the
        // machine: in 1 s a loaded CI machine made 1,706 fsyncs, too few to fill half the
        // log, and the run had none to check.
        seconds_per_round: 5.5,
        rounds: 1,
    };
    let report = corefs_bench::fsync::run(&config).expect("fsync bench runs");
    let corefs = &report.targets[0];
    assert_eq!(corefs.target, "corefs (mem backend)", "{report:?}");
    // Nothing of the image is left behind, and no image was made for a given device.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    let c = &report.corefs;
    assert!(c.fsyncs >= corefs.latency.ops, "{c:?} for {corefs:?}");
    assert!(
        c.tick_commits > 0,
        "no commit in the run, nothing checked: {c:?}"
    );
    // The operations that ran a commit took the commit's time and their own.
    assert!(
        c.commit_op_ns_mean >= c.tick_commit_ns_mean,
        "commits of {} ns on average outside the time of the operations that ran them ({} ns)",
        c.tick_commit_ns_mean,
        c.commit_op_ns_mean
    );
    assert!(
        corefs.latency.max_ns >= c.tick_commit_ns_max,
        "{c:?} {corefs:?}"
    );
}

/// A ratio over paired repeats is the median of the per-repeat ratios with its spread, and
/// pairs only repeats both targets ran.
#[test]
fn ratios_pair_repeats_and_take_the_median() {
    let mut runs = Vec::new();
    for (repeat, (a, b)) in [(100.0, 50.0), (90.0, 100.0), (120.0, 40.0), (80.0, 0.0)]
        .into_iter()
        .enumerate()
    {
        let mut x = run_with("corefs-mem", a, 10);
        x.repeat = repeat as u32;
        runs.push(x);
        if b > 0.0 {
            let mut y = run_with("ext4", b, 20);
            y.repeat = repeat as u32;
            runs.push(y);
        }
    }
    let results = results_of(runs);
    let r = suite::paired_ratio(&results, "w", "corefs-mem", "ext4", |r| r.ops_per_sec).unwrap();
    assert_eq!(r.pairs, 3, "the fourth repeat has no ext4 run");
    assert_eq!(r.median, 2.0);
    assert_eq!((r.min, r.max), (0.9, 3.0));
    assert!(suite::paired_ratio(&results, "w", "corefs-mem", "xfs", |r| r.ops_per_sec).is_none());
}
