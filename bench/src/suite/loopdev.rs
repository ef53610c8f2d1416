//! Kernel peers on equal terms: a filesystem (ext4, xfs, btrfs) made on a loop device over a
//! file in the same directory as corefs's image, so both sit on the same disk. Needs root and
//! the mkfs tools (`e2fsprogs`, `xfsprogs`, `btrfs-progs`).
//!
//! Invariants: what `make` set up (image file, loop device, mountpoint, mount) is torn down
//! in reverse at drop, also after errors; nothing outside the run's own files is touched.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub struct LoopFs {
    fs_type: String,
    image: PathBuf,
    device: String,
    mountpoint: PathBuf,
    mounted: bool,
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e} (is it installed?)"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl LoopFs {
    /// Makes `fs_type` on a loop device over a new `bytes`-sized file in `dir` and mounts it.
    pub fn make(fs_type: &str, dir: &Path, bytes: u64) -> Result<LoopFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(format!(
                "making {fs_type} on a loop device needs root (run as root, or give a kernel \
                 directory with --kernel-dir)"
            ));
        }
        let mkfs = match fs_type {
            // One inode per KiB (mke2fs's densest), written out at mkfs: the default ratio
            // gives a 1 GiB image 65,536 inodes, which `creates` used up within a second
            // (ENOSPC ended the run), while corefs allocates inodes without a table. The
            // tables are initialized now so no lazy-init thread writes during a run.
            "ext4" => (
                "mkfs.ext4",
                vec!["-q", "-F", "-i", "1024", "-E", "lazy_itable_init=0"],
            ),
            "xfs" => ("mkfs.xfs", vec!["-q", "-f"]),
            "btrfs" => ("mkfs.btrfs", vec!["-q", "-f"]),
            other => {
                return Err(format!(
                    "unknown kernel filesystem {other} (ext4, xfs, btrfs)"
                ))
            }
        };
        let image = dir.join(format!("corefs-suite-{fs_type}-{}.img", std::process::id()));
        let file =
            std::fs::File::create(&image).map_err(|e| format!("{}: {e}", image.display()))?;
        file.set_len(bytes)
            .map_err(|e| format!("{}: {e}", image.display()))?;
        drop(file);
        let mut fs = LoopFs {
            fs_type: fs_type.to_string(),
            image: image.clone(),
            device: String::new(),
            mountpoint: dir.join(format!("corefs-suite-{fs_type}-{}.mnt", std::process::id())),
            mounted: false,
        };
        let image_str = image.to_string_lossy().into_owned();
        // Direct I/O on the backing file, so the loop device does not double-cache.
        fs.device = run(
            "losetup",
            &["--find", "--show", "--direct-io=on", &image_str],
        )?;
        let mut args = mkfs.1.clone();
        args.push(&fs.device);
        run(mkfs.0, &args)?;
        std::fs::create_dir_all(&fs.mountpoint)
            .map_err(|e| format!("{}: {e}", fs.mountpoint.display()))?;
        fs.mount()?;
        Ok(fs)
    }

    pub fn fs_type(&self) -> &str {
        &self.fs_type
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    fn mount(&mut self) -> Result<(), String> {
        run("mount", &[&self.device, &self.mountpoint.to_string_lossy()])?;
        self.mounted = true;
        Ok(())
    }

    fn unmount(&mut self) -> Result<(), String> {
        if self.mounted {
            run("umount", &[&self.mountpoint.to_string_lossy()])?;
            self.mounted = false;
        }
        Ok(())
    }

    /// Unmounts (which writes back and drops the page cache) and mounts again; returns the
    /// mount time in milliseconds.
    pub fn remount(&mut self) -> Result<f64, String> {
        self.unmount()?;
        let started = Instant::now();
        self.mount()?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::warn!("{e}");
        }
        let _ = std::fs::remove_dir(&self.mountpoint);
        if !self.device.is_empty() {
            if let Err(e) = run("losetup", &["-d", &self.device]) {
                tracing::warn!("{e}");
            }
        }
        let _ = std::fs::remove_file(&self.image);
    }
}
