//! The `corefs` commands, one module each: its clap `Args` (flags and help text) and its
//! `run`, which prints what the command reports and returns an error message for main to
//! print (`fsck` returns its verdict instead, since its exit codes are e2fsck's). What
//! several commands share (opening a device, sizes, seeds, JSON output) is here.

pub mod bench;
pub mod crashtest;
pub mod dump;
pub mod fsck;
pub mod mkfs;
pub mod mount;
pub mod probe;
pub mod serve;
pub mod sim;
pub mod soak;
pub mod sync;
pub mod top;

use std::path::PathBuf;

/// Opens a device for writing, exclusively, creating or growing a file image to `size`.
fn open(device: &str, size: Option<u64>) -> Result<Box<dyn nvme::BlockDevice>, String> {
    let defaults = nvme::OpenOptions {
        size_bytes: size,
        ..Default::default()
    };
    nvme::open_device(device, &defaults).map_err(|e| e.to_string())
}

/// Opens a device read-only and without its exclusive lock, for tools that write nothing;
/// says so when a writer holds it, since what they read may then be stale or change under
/// them.
fn open_read_only(device: &str, tool: &str) -> Result<Box<dyn nvme::BlockDevice>, String> {
    let defaults = nvme::OpenOptions {
        access: nvme::Access::ReadShared,
        ..Default::default()
    };
    let dev = nvme::open_device(device, &defaults).map_err(|e| e.to_string())?;
    match nvme::lock::in_use(device) {
        Ok(Some(holder)) => eprintln!(
            "corefs {tool}: warning: {device} is in use ({holder}): it is read as it is now, \
             while it may be changing, so what this shows may be stale or inconsistent"
        ),
        Ok(None) => {}
        Err(e) => eprintln!("corefs {tool}: warning: cannot tell whether {device} is in use: {e}"),
    }
    Ok(dev)
}

/// A size with a unit (`1GiB`, `256MiB`), as device strings take it.
fn parse_size(text: &str) -> Result<u64, String> {
    nvme::spec::parse_size(text)
}

/// A seed from the clock, for runs not given one (printed, so they replay).
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

/// Writes `report` as pretty JSON to `path`, when one is given (`--json`).
fn write_json(path: Option<PathBuf>, report: &impl serde::Serialize) -> Result<(), String> {
    match path {
        Some(path) => std::fs::write(
            &path,
            serde_json::to_string_pretty(report).expect("serializable"),
        )
        .map_err(|e| format!("writing {}: {e}", path.display())),
        None => Ok(()),
    }
}
