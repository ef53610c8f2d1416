//! The storage service as a target (`corefs-serve`): a `corefs serve` process on an image of
//! its own, and the workload's clients in the bench process connected through libcorefs
//! (`corefs_connect`), so every call crosses processes through the shared-memory ring.
//!
//! Invariants: the server is this target's child; a workload gets a freshly formatted image
//! and a fresh server; `finish` (and drop) stop the server with SIGTERM and require it to exit
//! cleanly; a server that does not listen within 30 s is an error naming it.

use super::abi::CAbiMount;
use super::results::EngineFigures;
use super::session::{Session, Target, R};
use super::Placement;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const LABEL: &str = "corefs-serve";

pub struct ServeTarget {
    device: String,
    socket: PathBuf,
    shards: u32,
    reactors: usize,
    placement: Placement,
    data_cache: bool,
    server: Option<Child>,
    mount: Option<CAbiMount>,
}

/// The `corefs` binary that serves: `COREFS_BIN`, or this process when it is `corefs`.
fn corefs_bin() -> R<PathBuf> {
    if let Some(bin) = std::env::var_os("COREFS_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let me = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    if me.file_name().is_some_and(|n| n == "corefs") {
        return Ok(me);
    }
    Err(format!(
        "target {LABEL} starts `corefs serve`: run the suite from the corefs binary, or set \
         COREFS_BIN (this is {})",
        me.display()
    ))
}

impl ServeTarget {
    pub fn new(
        image: &Path,
        dir: &Path,
        shards: u32,
        placement: Placement,
        reactors: usize,
    ) -> ServeTarget {
        ServeTarget {
            device: format!("file:{}", image.display()),
            socket: dir.join("corefs-serve.sock"),
            shards,
            reactors,
            placement,
            data_cache: true,
            server: None,
            mount: None,
        }
    }

    fn start(&mut self, format: bool) -> R<f64> {
        let started = Instant::now();
        if format {
            let device = std::ffi::CString::new(self.device.clone()).map_err(|e| e.to_string())?;
            let options = corefs::abi::corefs_options {
                shards: self.shards,
                ..Default::default()
            };
            // SAFETY: a NUL-terminated device string and options without a label.
            let rc = unsafe { corefs::abi::corefs_mkfs(device.as_ptr(), &options) };
            if rc < 0 {
                return Err(format!("mkfs {}: errno {}", self.device, -rc));
            }
        }
        let mut cmd = Command::new(corefs_bin()?);
        cmd.arg("serve")
            .arg(&self.device)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--reactors")
            .arg(self.reactors.to_string())
            .stdout(Stdio::null())
            // COREFS_SERVE_STDERR=1: the server's log (its reactor's figures at the end).
            .stderr(if std::env::var_os("COREFS_SERVE_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        if !self.data_cache {
            cmd.arg("--no-data-cache");
        }
        if let Placement::Dedicated { reactor_cores, .. } = &self.placement {
            if let Some(core) = reactor_cores.first() {
                // The storage core is the reactor's, busy-polling its device and the
                // clients' rings (a root client's requests are taken by the reactor itself).
                cmd.arg("--core").arg(core.to_string()).arg("--busy-poll");
            }
        }
        // COREFS_SERVE_ARGS: more options for the server (`--busy-poll`, `--reactors 2`).
        if let Ok(extra) = std::env::var("COREFS_SERVE_ARGS") {
            cmd.args(extra.split_whitespace());
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting corefs serve: {e}"))?;
        self.server = Some(child);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if started.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "corefs serve {} did not listen at {} within 30 s",
                    self.device,
                    self.socket.display()
                ));
            }
            if let Some(status) = self
                .server
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(format!("corefs serve {} ended: {status}", self.device));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.mount = Some(CAbiMount::connect(&self.socket)?);
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }

    fn stop(&mut self) -> R<()> {
        if let Some(mount) = self.mount.take() {
            mount.close()?;
        }
        if let Some(mut child) = self.server.take() {
            // SAFETY: a child of ours.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let status = child.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                return Err(format!("corefs serve {} ended with {status}", self.device));
            }
        }
        Ok(())
    }
}

impl Drop for ServeTarget {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

impl Target for ServeTarget {
    fn name(&self) -> String {
        LABEL.to_string()
    }

    fn prepare(&mut self) -> R<()> {
        self.stop()?;
        self.start(true).map(drop)
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        Ok(self
            .mount
            .as_ref()
            .ok_or("corefs-serve target not prepared")?
            .session())
    }

    fn engine_figures(&mut self) -> R<Option<EngineFigures>> {
        let mount = self
            .mount
            .as_ref()
            .ok_or("corefs-serve target not prepared")?;
        let stats = mount.stats().ok_or("statistics through the service")?;
        let cache = if self.data_cache {
            engine::writeback::CACHE_BLOCKS as u64
        } else {
            0
        };
        Ok(Some(super::target::figures_of(&stats, cache)))
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
}
