//! A corefs server as a target: `corefs serve` (the storage service, [`super::serve`]) or
//! `corefs mount` (the FUSE mount, [`super::fuse`]) on an image of its own, in a child
//! process, and the workload's clients in the bench process. What the two share lives here:
//! the image formatted per workload, the server's command line and reactor placement, the wait
//! until it serves, stopping it, and its CPU time, which the run's CPU per operation counts.
//!
//! Invariants: the server is this target's child; a workload gets a freshly formatted image
//! and a fresh server; `finish` (and drop) stop it and require it to exit cleanly; a server
//! that does not serve within 30 s is an error naming the device, and is killed.

use super::results::EngineFigures;
use super::session::{Session, Target, R};
use super::Placement;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What differs between the server targets: how a server is started, reached and stopped.
pub trait Kind {
    /// The target's name in the results.
    fn label(&self) -> &'static str;
    /// The server's arguments after `corefs`: its command, the device and where it serves
    /// (the reactor options are added to them).
    fn args(&self, device: &str) -> Vec<OsString>;
    /// Whether the server serves yet.
    fn serving(&self) -> bool;
    /// Once the server serves (the service's target connects to it here).
    fn started(&mut self) -> R<()> {
        Ok(())
    }
    /// Tells `server` to stop, as its users would; the target then waits for it to exit.
    fn stop(&mut self, server: &mut Child) -> R<()>;
    /// A client of the running server.
    fn session(&mut self) -> R<Box<dyn Session>>;
    /// The engine's figures, when the server gives them to clients.
    fn engine_figures(&mut self, data_cache: bool) -> R<Option<EngineFigures>>;
}

pub struct ServerTarget<K: Kind> {
    device: String,
    shards: u32,
    reactors: usize,
    placement: Placement,
    data_cache: bool,
    server: Option<Child>,
    kind: K,
}

impl<K: Kind> ServerTarget<K> {
    pub fn new(
        image: &Path,
        shards: u32,
        placement: Placement,
        reactors: usize,
        kind: K,
    ) -> ServerTarget<K> {
        ServerTarget {
            device: format!("file:{}", image.display()),
            shards,
            reactors,
            placement,
            data_cache: true,
            server: None,
            kind,
        }
    }

    fn start(&mut self, format: bool) -> R<f64> {
        let started = Instant::now();
        if format {
            mkfs(&self.device, self.shards)?;
        }
        let mut cmd = server_command(
            self.kind.label(),
            &self.kind.args(&self.device),
            self.reactors,
            self.data_cache,
            &self.placement,
        )?;
        let kind = &self.kind;
        self.server = Some(spawn_until(&mut cmd, &self.device, started, || {
            kind.serving()
        })?);
        self.kind.started()?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }

    fn stop(&mut self) -> R<()> {
        let Some(mut server) = self.server.take() else {
            return Ok(());
        };
        if let Err(e) = self.kind.stop(&mut server) {
            let _ = server.kill();
            let _ = server.wait();
            return Err(e);
        }
        let status = server.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!(
                "the corefs server of {} ended with {status}",
                self.device
            ));
        }
        Ok(())
    }
}

impl<K: Kind> Drop for ServerTarget<K> {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("stopping {}: {e}", self.kind.label());
        }
    }
}

impl<K: Kind> Target for ServerTarget<K> {
    fn name(&self) -> String {
        self.kind.label().to_string()
    }

    fn prepare(&mut self) -> R<()> {
        self.stop()?;
        self.start(true).map(drop)
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        if self.server.is_none() {
            return Err(format!("{} target not prepared", self.kind.label()));
        }
        self.kind.session()
    }

    fn engine_figures(&mut self) -> R<Option<EngineFigures>> {
        self.kind.engine_figures(self.data_cache)
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

/// Formats `device` with `shards` shards through libcorefs.
fn mkfs(device: &str, shards: u32) -> R<()> {
    let device_c = std::ffi::CString::new(device).map_err(|e| e.to_string())?;
    let options = corefs::abi::corefs_options {
        shards,
        ..Default::default()
    };
    // SAFETY: a NUL-terminated device string and options without a label.
    let rc = unsafe { corefs::abi::corefs_mkfs(device_c.as_ptr(), &options) };
    if rc < 0 {
        return Err(format!("mkfs {device}: errno {}", -rc));
    }
    Ok(())
}

/// `corefs ARGS...` with the reactor options of a target (`--reactors`; `--core` and
/// `--busy-poll` on a dedicated placement: the storage core is the reactor's, busy-polling its
/// device and the clients' rings or FUSE requests; `--no-data-cache` for workloads that
/// measure the device path), and `COREFS_SERVE_ARGS`: more options for the server
/// (`--busy-poll`, `--reactors 2`). Its log goes to the suite's stderr with
/// `COREFS_SERVE_STDERR=1` (its reactor's figures at the end).
fn server_command(
    label: &str,
    args: &[OsString],
    reactors: usize,
    data_cache: bool,
    placement: &Placement,
) -> R<Command> {
    let mut cmd = Command::new(corefs_bin(label)?);
    cmd.args(args)
        .arg("--reactors")
        .arg(reactors.to_string())
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("COREFS_SERVE_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    if !data_cache {
        cmd.arg("--no-data-cache");
    }
    if let Placement::Dedicated { reactor_cores, .. } = placement {
        if let Some(core) = reactor_cores.first() {
            cmd.arg("--core").arg(core.to_string()).arg("--busy-poll");
        }
    }
    if let Ok(extra) = std::env::var("COREFS_SERVE_ARGS") {
        cmd.args(extra.split_whitespace());
    }
    Ok(cmd)
}

/// Starts `cmd` (a server of `device`) and waits until `ready` says it serves: an error
/// names the device when it ends first or is not ready within 30 s of `started` (when
/// the child is killed).
fn spawn_until(
    cmd: &mut Command,
    device: &str,
    started: Instant,
    ready: impl Fn() -> bool,
) -> R<Child> {
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting a corefs server of {device}: {e}"))?;
    while !ready() {
        if let Some(status) = child.try_wait().ok().flatten() {
            return Err(format!("the corefs server of {device} ended: {status}"));
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the corefs server of {device} was not ready within 30 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(child)
}

/// The CPU time (ns) process `pid` has used, its ended threads' included (utime + stime of
/// /proc/PID/stat, in clock ticks); `None` once it is gone.
fn child_cpu_ns(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces, in parentheses): state is
    // the first, utime the 12th and stime the 13th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ').skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some((utime + stime) * 1_000_000_000 / ticks_per_s)
}

/// The `corefs` binary that serves or mounts: `COREFS_BIN`, or this process when it is
/// `corefs`.
fn corefs_bin(label: &str) -> R<PathBuf> {
    if let Some(bin) = std::env::var_os("COREFS_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let me = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    if me.file_name().is_some_and(|n| n == "corefs") {
        return Ok(me);
    }
    Err(format!(
        "target {label} starts a corefs server: run the suite from the corefs binary, or set \
         COREFS_BIN (this is {})",
        me.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::child_cpu_ns;
    use std::time::{Duration, Instant};

    /// A child's CPU time is read while it runs, counts what it spent computing, and is gone
    /// once the child is reaped.
    #[test]
    fn a_childs_cpu_time_is_read_from_proc() {
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 30")
            .spawn()
            .expect("sh runs");
        let pid = child.id();
        let started = Instant::now();
        let mut cpu_ns = 0;
        while cpu_ns < 50_000_000 && started.elapsed() < Duration::from_secs(60) {
            cpu_ns = child_cpu_ns(pid).expect("a running child has a CPU time");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            cpu_ns >= 50_000_000,
            "{cpu_ns} ns after {:?}",
            started.elapsed()
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(child_cpu_ns(pid), None);
    }
}
