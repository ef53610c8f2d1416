//! The FUSE mount as a target (`corefs-fuse`): `corefs mount` of an image of its own in a
//! child process, and the workload's clients in the bench process making system calls on the
//! mountpoint, as any program on the mount does: each call crosses into the kernel, through
//! /dev/fuse to the server's session threads, to its reactor and back. It is the yardstick
//! the storage service is held to (issue 38: the service's many-small-call rows against the
//! mount's) and the row a user of the mount sees (issue 37).
//!
//! Invariants: the server is this target's child; a workload gets a freshly formatted image
//! and a fresh mount (so the kernel's page cache of the last one is gone); `finish` (and drop)
//! unmount, which makes the server commit and exit, and require it to exit cleanly; a mount
//! that is not up within 30 s is an error naming the device.

use super::serve::{child_cpu_ns, mkfs, server_command, spawn_until};
use super::session::{Session, Target, R};
use super::Placement;
use crate::suite::results::EngineFigures;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Instant;

pub const LABEL: &str = "corefs-fuse";

/// statfs(2)'s `f_type` of a FUSE mount.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

pub struct FuseTarget {
    device: String,
    mountpoint: PathBuf,
    shards: u32,
    reactors: usize,
    placement: Placement,
    data_cache: bool,
    server: Option<Child>,
}

/// Whether a FUSE filesystem is mounted at `path`.
fn fuse_mounted(path: &Path) -> bool {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: struct statfs is plain integers, for which zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs writes one struct statfs through the pointer; the path is NUL-terminated.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
}

/// Unmounts `path`: umount(2) as root, `fusermount3 -u` (which mounted it) as another user.
fn unmount(path: &Path) -> R<()> {
    let c_path =
        std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(c_path.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(format!("umount {}: {e}", path.display()));
    }
    let status = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(path)
        .status()
        .map_err(|e| format!("fusermount3 -u {}: {e}", path.display()))?;
    if !status.success() {
        return Err(format!("fusermount3 -u {}: {status}", path.display()));
    }
    Ok(())
}

impl FuseTarget {
    pub fn new(
        image: &Path,
        dir: &Path,
        shards: u32,
        placement: Placement,
        reactors: usize,
    ) -> R<FuseTarget> {
        let mountpoint = dir.join(format!("corefs-fuse-{}", std::process::id()));
        std::fs::create_dir_all(&mountpoint)
            .map_err(|e| format!("{}: {e}", mountpoint.display()))?;
        Ok(FuseTarget {
            device: format!("file:{}", image.display()),
            mountpoint,
            shards,
            reactors,
            placement,
            data_cache: true,
            server: None,
        })
    }

    fn start(&mut self, format: bool) -> R<f64> {
        let started = Instant::now();
        if format {
            mkfs(&self.device, self.shards)?;
        }
        let mut cmd = server_command(
            LABEL,
            &[
                "mount".as_ref(),
                self.device.as_ref(),
                self.mountpoint.as_ref(),
            ],
            self.reactors,
            self.data_cache,
            &self.placement,
        )?;
        let mountpoint = self.mountpoint.clone();
        self.server = Some(spawn_until(&mut cmd, &self.device, started, || {
            fuse_mounted(&mountpoint)
        })?);
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }

    /// Unmounts (the server then commits and exits) and waits for the server.
    fn stop(&mut self) -> R<()> {
        let Some(mut child) = self.server.take() else {
            return Ok(());
        };
        if fuse_mounted(&self.mountpoint) {
            if let Err(e) = unmount(&self.mountpoint) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("corefs mount {} ended with {status}", self.device));
        }
        Ok(())
    }
}

impl Drop for FuseTarget {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("stopping {LABEL}: {e}");
        }
        let _ = std::fs::remove_dir(&self.mountpoint);
    }
}

impl Target for FuseTarget {
    fn name(&self) -> String {
        LABEL.to_string()
    }

    fn prepare(&mut self) -> R<()> {
        self.stop()?;
        self.start(true).map(drop)
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        if self.server.is_none() {
            return Err(format!("{LABEL} target not prepared"));
        }
        Ok(super::target::kernel_session(self.mountpoint.clone()))
    }

    fn engine_figures(&mut self) -> R<Option<EngineFigures>> {
        // The engine runs in the server process; its figures are in its log
        // (COREFS_SERVE_STDERR=1 shows them at the unmount).
        Ok(None)
    }

    fn remount(&mut self) -> R<Option<f64>> {
        self.stop()?;
        self.start(false).map(Some)
    }

    fn finish(&mut self) -> R<()> {
        self.stop()
    }

    fn client_cores(&self) -> Vec<usize> {
        match &self.placement {
            Placement::Dedicated { client_cores, .. } => client_cores.clone(),
            Placement::Shared => Vec::new(),
        }
    }

    fn set_data_cache(&mut self, on: bool) {
        self.data_cache = on;
    }

    fn server_cpu_ns(&self) -> Option<u64> {
        child_cpu_ns(self.server.as_ref()?.id())
    }
}
