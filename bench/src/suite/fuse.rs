//! The FUSE mount as a target (`corefs-fuse`, a [`ServerTarget`]): `corefs mount` in a
//! child process, and the workload's clients in the bench process making system calls on the
//! mountpoint, as any program on the mount does: each call crosses into the kernel, through
//! /dev/fuse to the server's session threads, to its reactor and back. It is the yardstick
//! the storage service is held to (issue 38: the service's many-small-call rows against the
//! mount's) and the row a user of the mount sees (issue 37).
//!
//! A fresh mount per workload means the kernel's page cache of the last one is gone too. It
//! stops when unmounted (the server then commits and exits).

use super::results::EngineFigures;
use super::server::{Kind, ServerTarget};
use super::session::{Session, R};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Child;

pub const LABEL: &str = "corefs-fuse";

pub type FuseTarget = ServerTarget<Fuse>;

/// statfs(2)'s `f_type` of a FUSE mount.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

pub struct Fuse {
    mountpoint: PathBuf,
}

impl Fuse {
    /// A mount at a new directory in `dir` (removed when dropped).
    pub fn new(dir: &Path) -> R<Fuse> {
        let mountpoint = dir.join(format!("corefs-fuse-{}", std::process::id()));
        std::fs::create_dir_all(&mountpoint)
            .map_err(|e| format!("{}: {e}", mountpoint.display()))?;
        Ok(Fuse { mountpoint })
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        // After the target's own drop, which unmounted.
        let _ = std::fs::remove_dir(&self.mountpoint);
    }
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

impl Kind for Fuse {
    fn label(&self) -> &'static str {
        LABEL
    }

    fn args(&self, device: &str) -> Vec<OsString> {
        vec![
            "mount".into(),
            device.into(),
            self.mountpoint.clone().into(),
        ]
    }

    fn serving(&self) -> bool {
        fuse_mounted(&self.mountpoint)
    }

    fn stop(&mut self, _server: &mut Child) -> R<()> {
        if fuse_mounted(&self.mountpoint) {
            unmount(&self.mountpoint)?;
        }
        Ok(())
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        Ok(super::target::kernel_session(self.mountpoint.clone()))
    }

    fn engine_figures(&mut self, _data_cache: bool) -> R<Option<EngineFigures>> {
        // The engine runs in the server process; its figures are in its log
        // (COREFS_SERVE_STDERR=1 shows them at the unmount).
        Ok(None)
    }
}
