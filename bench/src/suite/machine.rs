//! What a suite run records about the machine and the code, so that `corefs bench compare`
//! can say when two runs were not taken on the same kernel, CPU, disk or code, or on a busy
//! machine: the CPU model, the model of the disk holding a path (or of an NVMe namespace), the
//! commit of the corefs source tree, and the load average when the run started. Each is best
//! effort: a figure that cannot be read is "unknown" (or none), never an error.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// /proc/cpuinfo's first "model name".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, model)| model.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn read_trimmed(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// The sysfs directory of a block or character device number.
fn sys_dir(kind: &str, rdev: u64) -> Option<PathBuf> {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    std::fs::canonicalize(format!("/sys/dev/{kind}/{major}:{minor}")).ok()
}

/// "name: model" of the device a sysfs directory describes (a partition's disk for a
/// partition); the vendor id where there is no model (a virtio disk).
fn describe(dir: &Path) -> Option<String> {
    let disk = if dir.join("partition").exists() {
        dir.parent()?.to_path_buf()
    } else {
        dir.to_path_buf()
    };
    let name = disk.file_name()?.to_string_lossy().into_owned();
    let device = disk.join("device");
    let model = read_trimmed(&device.join("model"))
        .or_else(|| read_trimmed(&device.join("vendor")).map(|v| format!("vendor {v}")))
        .unwrap_or_else(|| "no model in sysfs".into());
    Some(format!("{name}: {model}"))
}

/// The model of the device `path` is (a block or NVMe character device) or lives on.
pub fn device_model(path: &Path) -> String {
    let described = std::fs::metadata(path).ok().and_then(|m| {
        let ft = m.file_type();
        if ft.is_block_device() {
            describe(&sys_dir("block", m.rdev())?)
        } else if ft.is_char_device() {
            describe(&sys_dir("char", m.rdev())?)
        } else {
            describe(&sys_dir("block", m.dev())?)
        }
    });
    described.unwrap_or_else(|| "unknown".into())
}

/// The path inside a device string (`nvme:/dev/ng0n1`, `file:/srv/x.img,size=1G`); none for
/// `mem:`.
pub fn device_path(spec: &str) -> Option<PathBuf> {
    let (kind, rest) = spec.split_once(':')?;
    (kind != "mem").then(|| PathBuf::from(rest.split(',').next().unwrap_or(rest)))
}

/// Load average over the last minute (/proc/loadavg's first field): runnable work already on
/// the machine when read before a run starts.
pub fn load_avg_1min() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Load average past which other work competes with a benchmark: a whole core's worth of
/// runnable threads (on this 2-core VM a concurrent build made corefs's fsync figures 20x
/// worse at a load of 2.4).
pub const BUSY_LOAD_AVG: f64 = 1.0;

/// The commit of the corefs source tree this binary was built from, `+dirty` with uncommitted
/// changes ("unknown" without git or outside the tree). Read at run time: scripts/bench.sh
/// builds before it runs, so the tree is what the binary was built from.
pub fn corefs_commit() -> String {
    let tree = env!("CARGO_MANIFEST_DIR");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(tree)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(commit) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{commit}{}", if dirty { "+dirty" } else { "" })
        }
        None => "unknown".into(),
    }
}
