//! `corefs mount` against the kernel, call by call: the differential run of
//! `bindings/tests/support/differential.rs` through the FUSE mount (one reactor and two)
//! against a directory of the machine's own filesystem. Needs root to mount (as CI runs);
//! another user is told so and the test passes having checked nothing else.
//! `COREFS_DIFF_OPS` sets the operations (CI: 3,000; `scripts/big-tests.sh`: 200,000).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../bindings/tests/support/differential.rs"]
mod differential;
use differential::Kernel;

fn is_mounted(mountpoint: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let mp = mountpoint.to_string_lossy();
    mounts.lines().any(|l| l.split(' ').nth(1) == Some(&*mp))
}

fn through_the_mount(reactors: usize) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: the differential run through the mount was not run");
        return;
    }
    let seed = differential::seed();
    let ops = differential::ops();
    let work = tempfile::Builder::new()
        .prefix("corefs-diff-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let device = format!("file:{},size=256MiB", work.path().join("fs.img").display());
    let mkfs = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .args(["mkfs", &device, "--shards", "8"])
        .output()
        .unwrap();
    assert!(mkfs.status.success(), "{mkfs:?}");
    let mountpoint = work.path().join("mnt");
    let reference = work.path().join("k");
    std::fs::create_dir(&mountpoint).unwrap();
    std::fs::create_dir(&reference).unwrap();
    let log = work.path().join("server.log");
    let mut server = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .args(["mount", &device])
        .arg(&mountpoint)
        .args(["--reactors", &reactors.to_string()])
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !is_mounted(&mountpoint) {
        if let Some(status) = server.try_wait().unwrap() {
            panic!(
                "corefs mount exited ({status}): {}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        assert!(Instant::now() < deadline, "the mount did not appear");
        std::thread::sleep(Duration::from_millis(20));
    }
    let label = format!("FUSE, {reactors} reactor(s)");
    let outcome = std::panic::catch_unwind(|| {
        differential::compare(
            &mut Kernel(mountpoint.clone()),
            &mut Kernel(reference.clone()),
            seed,
            ops,
            &label,
        )
    });
    let unmounted = Command::new("umount").arg(&mountpoint).status().unwrap();
    let exit = server.wait().unwrap();
    let skipped = match outcome {
        Ok(skipped) => skipped,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    assert!(
        unmounted.success() && exit.success(),
        "unmount: {unmounted}, server: {exit}"
    );
    eprintln!(
        "differential ({label}): seed {seed}, {ops} operations, {skipped} through symlinks skipped"
    );
}

#[test]
fn random_operations_answer_as_the_kernel_through_the_mount() {
    through_the_mount(1);
}

#[test]
fn random_operations_answer_as_the_kernel_through_a_mount_on_two_reactors() {
    through_the_mount(2);
}
