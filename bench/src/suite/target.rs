//! What a workload runs against: a [`Target`] (a fresh filesystem per workload, remountable)
//! hands out one [`Session`] per client thread. Sessions speak paths relative to the target's
//! root so one workload body runs unchanged on corefs (through the reactor's client API, the
//! API Rust embedders use; the C ABI is a thin layer over it) and on a kernel filesystem
//! (through POSIX calls).
//!
//! Invariants: a session is used by one thread; handles are small integers valid in the session
//! that made them. A corefs session caches directory inode numbers it resolved or made (the
//! kernel's dentry cache does the same for POSIX callers) and forgets them when it removes or
//! renames a directory.

use super::loopdev::LoopFs;
use super::results::EngineFigures;
use super::session::{Fh, Handles, Session, Target, R};
use super::Placement;
use engine::{MkfsOptions, MountOptions, RenameFlags};
use reactor::{Config, IdlePolicy, Op, Reply, Runtime};
use std::collections::HashMap;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Splits `a/b/c` into (`a/b`, `c`).
fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

// ---------------------------------------------------------------------------------------------
// corefs

/// corefs on a device string, through the reactor.
pub struct CorefsTarget {
    label: String,
    device: String,
    shards: u32,
    placement: Placement,
    reactors: usize,
    runtime: Option<Runtime>,
    /// A memory device lives only as long as its handle: it is kept across remounts.
    kept_device: Option<Box<dyn nvme::BlockDevice>>,
    /// The engine's data-block cache for the next mounts, in blocks (0: off).
    data_cache_blocks: usize,
    /// The image file the suite made for this target (corefs-file only).
    image: Option<PathBuf>,
    /// The mount through the C ABI that serves the sessions instead of `runtime`, while a
    /// workload runs through it.
    c_abi: Option<super::abi::CAbiMount>,
}

impl CorefsTarget {
    pub fn new(
        label: &str,
        device: &str,
        shards: u32,
        placement: Placement,
        reactors: usize,
    ) -> CorefsTarget {
        CorefsTarget {
            label: label.to_string(),
            device: device.to_string(),
            shards,
            placement,
            reactors,
            runtime: None,
            kept_device: None,
            data_cache_blocks: engine::writeback::CACHE_BLOCKS,
            image: None,
            c_abi: None,
        }
    }

    /// Records that the device is this image file, made by the suite.
    pub fn with_image(mut self, image: &Path) -> CorefsTarget {
        self.image = Some(image.to_path_buf());
        self
    }

    fn start(&mut self, mkfs: bool) -> R<f64> {
        let started = Instant::now();
        let config = Config {
            device: self.device.clone(),
            mkfs: mkfs.then(|| MkfsOptions {
                shards: self.shards,
                label: "bench".into(),
                ..Default::default()
            }),
            idle: match self.placement {
                Placement::Dedicated { .. } => IdlePolicy::BusyPoll,
                Placement::Shared => IdlePolicy::default(),
            },
            cores: match &self.placement {
                Placement::Dedicated { reactor_cores, .. } => reactor_cores.clone(),
                Placement::Shared => Vec::new(),
            },
            reactors: self.reactors,
            mount: MountOptions {
                data_cache_blocks: self.data_cache_blocks,
                ..MountOptions::default()
            },
            ..Config::default()
        };
        let runtime = match self.kept_device.take() {
            Some(dev) if !mkfs => Runtime::start_with_device(config, dev),
            _ => Runtime::start(config),
        }
        .map_err(|e| format!("{}: {e}", self.device))?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.runtime = Some(runtime);
        Ok(ms)
    }

    fn stop(&mut self) -> R<()> {
        if let Some(mount) = self.c_abi.take() {
            mount.close()?;
        }
        if let Some(runtime) = self.runtime.take() {
            let (_, dev) = runtime
                .shutdown_into_device()
                .map_err(|e| format!("unmounting {}: {e}", self.device))?;
            if self.device.starts_with("mem:") {
                self.kept_device = Some(dev);
            }
        }
        Ok(())
    }
}

impl Target for CorefsTarget {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn client_cores(&self) -> Vec<usize> {
        match &self.placement {
            Placement::Dedicated { client_cores, .. } => client_cores.clone(),
            Placement::Shared => Vec::new(),
        }
    }

    fn set_data_cache(&mut self, on: bool) {
        self.data_cache_blocks = if on {
            engine::writeback::CACHE_BLOCKS
        } else {
            0
        };
    }

    fn image(&self) -> Option<&Path> {
        self.image.as_deref()
    }

    fn prepare(&mut self) -> R<()> {
        self.stop()?;
        self.start(true).map(drop)
    }

    fn through_c_abi(&mut self) -> R<()> {
        // The prepared filesystem is closed and mounted again through libcorefs with the
        // same placement; a memory device (which lives only as long as its mount) is
        // formatted afresh by it.
        self.stop()?;
        let mem = self.device.starts_with("mem:");
        self.kept_device = None;
        let mount = super::abi::CAbiMount::mount(&super::abi::CAbiOptions {
            device: &self.device,
            format: mem,
            shards: self.shards,
            reactors: self.reactors,
            pinned_from: match &self.placement {
                Placement::Dedicated { reactor_cores, .. } => reactor_cores.first().copied(),
                Placement::Shared => None,
            },
            data_cache_off: self.data_cache_blocks == 0,
        })?;
        self.c_abi = Some(mount);
        Ok(())
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        if let Some(mount) = &self.c_abi {
            return Ok(mount.session());
        }
        let runtime = self.runtime.as_ref().ok_or("corefs target not prepared")?;
        Ok(Box::new(CorefsSession {
            client: runtime.client(64),
            dirs: HashMap::new(),
            files: Handles::new(),
            read_buf: Vec::new(),
        }))
    }

    fn engine_figures(&mut self) -> R<Option<EngineFigures>> {
        let stats = if let Some(mount) = &self.c_abi {
            mount.stats().ok_or("statistics through the C ABI")?
        } else {
            let runtime = self.runtime.as_ref().ok_or("corefs target not prepared")?;
            let mut client = runtime.client(1);
            match client.call(Op::Stats).map_err(|e| e.to_string())? {
                Reply::Stats(s) => *s,
                other => return Err(format!("unexpected reply {other:?}")),
            }
        };
        Ok(Some(figures_of(&stats, self.data_cache_blocks as u64)))
    }

    fn remount(&mut self) -> R<Option<f64>> {
        self.stop()?;
        if self.device.starts_with("mem:") && self.kept_device.is_none() {
            // Mounted through the C ABI: the memory device went with that mount.
            return Ok(None);
        }
        self.start(false).map(Some)
    }

    fn finish(&mut self) -> R<()> {
        self.stop()
    }
}

/// The figures a run records from a reactor's statistics; `data_cache_blocks` is the
/// engine's data cache the mount was given.
pub(super) fn figures_of(stats: &reactor::ReactorStats, data_cache_blocks: u64) -> EngineFigures {
    let c = &stats.commit;
    EngineFigures {
        groups_taken: stats.space.taken,
        groups_returned: stats.space.returned,
        commits: c.commits,
        commit_ms_avg: if c.commits > 0 {
            c.commit_ns_total as f64 / c.commits as f64 / 1e6
        } else {
            0.0
        },
        commit_ms_max: c.commit_ns_max as f64 / 1e6,
        commit_pause_ms_max: c.pause_ns_max as f64 / 1e6,
        log_writes: stats.log.log_writes,
        fallback_commits: stats.log.fallback_commits(),
        fsync_groups: stats.fsync_groups,
        fsync_group_max: stats.fsync_group_max,
        unpinned_blocks_last: c.last_unpinned_blocks,
        unpin_ms_last: c.last_unpin_ns as f64 / 1e6,
        reactor_cpu_ns_per_op: stats.cpu_ns_per_op(),
        data_cache_hits: stats.data_cache_hits,
        data_blocks_read: stats.data_blocks_read,
        data_cache_blocks: Some(data_cache_blocks),
        commit_slice_ms_max: c.slice_ns_max as f64 / 1e6,
        loop_gap_ms_max: stats.loop_gap_ns_max as f64 / 1e6,
        loop_gap_on_cpu_ms_max: stats.loop_gap_on_cpu_ns_max as f64 / 1e6,
        device_wait_ms_max: stats.device_waits.wait_ns_max as f64 / 1e6,
        reply_ms_max: stats.reply.max_ns as f64 / 1e6,
        fsync_queue_p99_ms: stats.fsync_queue_wait.p99_ns as f64 / 1e6,
        fsync_log_p99_ms: stats.fsync_log_write.p99_ns as f64 / 1e6,
    }
}

struct CorefsSession {
    client: reactor::Client,
    /// Directory path → inode number ("" is the root).
    dirs: HashMap<String, u64>,
    /// Handle → inode number.
    files: Handles<u64>,
    read_buf: Vec<u8>,
}

impl CorefsSession {
    fn call(&mut self, op: Op) -> R<Reply> {
        self.client.call(op).map_err(|e| e.to_string())
    }

    fn dir(&mut self, path: &str) -> R<u64> {
        if path.is_empty() {
            return Ok(engine::inode::ROOT_INO);
        }
        if let Some(&ino) = self.dirs.get(path) {
            return Ok(ino);
        }
        let ino = match self.call(Op::resolve(path))? {
            Reply::Stat(s) => s.ino,
            other => return Err(format!("unexpected reply {other:?}")),
        };
        self.dirs.insert(path.to_string(), ino);
        Ok(ino)
    }

    fn forget_dirs(&mut self, path: &str) {
        let prefix = format!("{path}/");
        self.dirs
            .retain(|p, _| p != path && !p.starts_with(&prefix));
    }

    fn handle(&mut self, ino: u64) -> Fh {
        self.files.add(ino)
    }

    fn ino(&self, fh: Fh) -> R<u64> {
        self.files.get(fh).copied()
    }

    fn lookup(&mut self, path: &str) -> R<engine::Stat> {
        let (parent, name) = split(path);
        let dir = self.dir(parent)?;
        match self.call(Op::Lookup {
            dir,
            name: name.as_bytes().to_vec(),
        })? {
            Reply::Stat(s) => Ok(s),
            other => Err(format!("unexpected reply {other:?}")),
        }
    }
}

impl Session for CorefsSession {
    fn create(&mut self, path: &str) -> R<Fh> {
        let (parent, name) = split(path);
        let dir = self.dir(parent)?;
        match self.call(Op::Create {
            dir,
            name: name.as_bytes().to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })? {
            Reply::Stat(s) => Ok(self.handle(s.ino)),
            other => Err(format!("unexpected reply {other:?}")),
        }
    }

    fn open(&mut self, path: &str) -> R<Fh> {
        let ino = self.lookup(path)?.ino;
        Ok(self.handle(ino))
    }

    fn close(&mut self, fh: Fh) -> R<()> {
        self.files.close(fh)
    }

    fn pwrite(&mut self, fh: Fh, offset: u64, data: &[u8]) -> R<()> {
        let ino = self.ino(fh)?;
        match self.call(Op::Write {
            ino,
            offset,
            // Copied as the C ABI copies a caller's bytes: the staging copy, with the
            // blocks' crcs taken as it is made.
            data: engine::Staged::copy_of(data),
        })? {
            Reply::Written(n) if n == data.len() => Ok(()),
            other => Err(format!("short write: {other:?}")),
        }
    }

    fn pread(&mut self, fh: Fh, offset: u64, len: usize) -> R<usize> {
        let ino = self.ino(fh)?;
        let buf = super::session::read_buf(&mut self.read_buf, len);
        self.client
            .read_into(ino, offset, buf)
            .map_err(|e| e.to_string())
    }

    fn fsync(&mut self, fh: Fh) -> R<()> {
        let ino = self.ino(fh)?;
        self.call(Op::Fsync { ino }).map(drop)
    }

    fn fdatasync(&mut self, fh: Fh) -> R<()> {
        let ino = self.ino(fh)?;
        self.call(Op::Fdatasync { ino }).map(drop)
    }

    fn mkdir(&mut self, path: &str) -> R<()> {
        let (parent, name) = split(path);
        let dir = self.dir(parent)?;
        match self.call(Op::Mkdir {
            dir,
            name: name.as_bytes().to_vec(),
            mode: 0o755,
            owner: reactor::Owner::ROOT,
        })? {
            Reply::Stat(s) => {
                self.dirs.insert(path.to_string(), s.ino);
                Ok(())
            }
            other => Err(format!("unexpected reply {other:?}")),
        }
    }

    fn rmdir(&mut self, path: &str) -> R<()> {
        let (parent, name) = split(path);
        let dir = self.dir(parent)?;
        self.forget_dirs(path);
        self.call(Op::Rmdir {
            dir,
            name: name.as_bytes().to_vec(),
        })
        .map(drop)
    }

    fn unlink(&mut self, path: &str) -> R<()> {
        let (parent, name) = split(path);
        let dir = self.dir(parent)?;
        self.call(Op::Unlink {
            dir,
            name: name.as_bytes().to_vec(),
        })
        .map(drop)
    }

    fn rename(&mut self, from: &str, to: &str) -> R<()> {
        let (from_parent, from_name) = split(from);
        let (to_parent, to_name) = split(to);
        let from_dir = self.dir(from_parent)?;
        let to_dir = self.dir(to_parent)?;
        self.forget_dirs(from);
        self.forget_dirs(to);
        self.call(Op::Rename {
            from_dir,
            from: from_name.as_bytes().to_vec(),
            to_dir,
            to: to_name.as_bytes().to_vec(),
            flags: RenameFlags::default(),
        })
        .map(drop)
    }

    fn stat(&mut self, path: &str) -> R<u64> {
        self.lookup(path).map(|s| s.size)
    }

    fn readdir(&mut self, path: &str) -> R<Vec<(String, bool)>> {
        let dir = self.dir(path)?;
        let mut out = Vec::new();
        let mut cookie = 0;
        loop {
            let entries = match self.call(Op::Readdir {
                dir,
                cookie,
                max: 256,
            })? {
                Reply::Entries(e) => e,
                other => return Err(format!("unexpected reply {other:?}")),
            };
            let Some(last) = entries.last() else {
                return Ok(out);
            };
            cookie = last.cookie;
            out.extend(entries.into_iter().map(|e| {
                (
                    String::from_utf8_lossy(&e.name).into_owned(),
                    e.kind == (libc::S_IFDIR >> 12) as u8,
                )
            }));
        }
    }

    fn random_reads(
        &mut self,
        fh: Fh,
        file_bytes: u64,
        qd: usize,
        until: Instant,
        seed: u64,
        record: &mut dyn FnMut(u64),
    ) -> R<u64> {
        use rand::{Rng, SeedableRng};
        let ino = self.ino(fh)?;
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let blocks = file_bytes / 4096;
        // Submission time per token; tokens are slots 0..qd.
        let mut submitted: Vec<Instant> = vec![Instant::now(); qd];
        let mut free: Vec<u64> = (0..qd as u64).collect();
        let mut done = 0u64;
        let mut completions = Vec::with_capacity(qd);
        loop {
            // At least one read, however late the start (see workloads::keep_going).
            while Instant::now() < until || (done == 0 && self.client.in_flight() == 0) {
                let Some(slot) = free.pop() else { break };
                let offset = rng.random_range(0..blocks) * 4096;
                submitted[slot as usize] = Instant::now();
                if let Err(e) = self.client.submit(
                    Op::Read {
                        ino,
                        offset,
                        len: 4096,
                    },
                    slot,
                ) {
                    return Err(format!("submit: {e:?}"));
                }
            }
            if self.client.in_flight() == 0 {
                return Ok(done);
            }
            completions.clear();
            self.client
                .wait(&mut completions, std::time::Duration::from_secs(5));
            let now = Instant::now();
            for c in completions.drain(..) {
                match c.result {
                    Ok(Reply::Data(d)) if d.len() == 4096 => {}
                    other => return Err(format!("random read: {other:?}")),
                }
                record(now.duration_since(submitted[c.token as usize]).as_nanos() as u64);
                free.push(c.token);
                done += 1;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel filesystems

/// A directory on a kernel filesystem, optionally one this run made on a loop device.
pub struct KernelTarget {
    label: String,
    /// Where workloads make their trees: a fresh subdirectory per workload.
    base: PathBuf,
    run_dir: Option<PathBuf>,
    runs: u32,
    loop_fs: Option<LoopFs>,
}

impl KernelTarget {
    /// A directory on whatever filesystem holds it (not remountable here).
    pub fn dir(label: &str, base: &Path) -> KernelTarget {
        KernelTarget {
            label: label.to_string(),
            base: base.to_path_buf(),
            run_dir: None,
            runs: 0,
            loop_fs: None,
        }
    }

    /// A filesystem this run made on a loop device (remountable, removed at drop).
    pub fn on_loop(loop_fs: LoopFs) -> KernelTarget {
        KernelTarget {
            label: format!("{}-loop", loop_fs.fs_type()),
            base: loop_fs.mountpoint().to_path_buf(),
            run_dir: None,
            runs: 0,
            loop_fs: Some(loop_fs),
        }
    }
}

impl Target for KernelTarget {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn prepare(&mut self) -> R<()> {
        self.finish()?;
        // The last run's deletions and writeback go to disk now, not into this run's time
        // (fsperf syncs between runs too).
        sync_filesystem(&self.base)?;
        self.runs += 1;
        let dir = self
            .base
            .join(format!("corefs-suite-{}-{}", std::process::id(), self.runs));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        self.run_dir = Some(dir);
        Ok(())
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        let root = self.run_dir.clone().ok_or("kernel target not prepared")?;
        Ok(kernel_session(root))
    }

    fn engine_figures(&mut self) -> R<Option<EngineFigures>> {
        Ok(None)
    }

    fn remount(&mut self) -> R<Option<f64>> {
        match &mut self.loop_fs {
            Some(fs) => fs.remount().map(Some),
            None => Ok(None),
        }
    }

    fn finish(&mut self) -> R<()> {
        if let Some(dir) = self.run_dir.take() {
            std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            // The deletion's writes go to disk now, not into the next target's run (the
            // suite runs each workload on every target in turn): what the loop targets left
            // behind made corefs's next fsyncs wait behind it (dbench's Flush p99 13.6 ms,
            // 1.7 ms with this sync; its throughput 80k -> 108k ops/s).
            sync_filesystem(&self.base)?;
        }
        Ok(())
    }
}

impl Drop for KernelTarget {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!("cleaning up {}: {e}", self.label);
        }
    }
}

/// syncfs(2) on the filesystem holding `dir`.
fn sync_filesystem(dir: &Path) -> R<()> {
    use std::os::fd::AsRawFd;
    let handle = std::fs::File::open(dir).map_err(|e| io(dir, e))?;
    // SAFETY: `handle` is an open descriptor for the duration of the call.
    if unsafe { libc::syncfs(handle.as_raw_fd()) } != 0 {
        return Err(io(dir, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// A session of system calls on the tree at `root` (a kernel filesystem, or a FUSE mount).
pub(super) fn kernel_session(root: PathBuf) -> Box<dyn Session> {
    Box::new(KernelSession {
        root,
        files: Handles::new(),
        read_buf: Vec::new(),
    })
}

struct KernelSession {
    root: PathBuf,
    /// Handle → (path, open file).
    files: Handles<(PathBuf, std::fs::File)>,
    read_buf: Vec<u8>,
}

fn io(path: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", path.display())
}

impl KernelSession {
    fn file(&self, fh: Fh) -> R<&std::fs::File> {
        self.files.get(fh).map(|(_, f)| f)
    }

    fn handle(&mut self, path: PathBuf, file: std::fs::File) -> Fh {
        self.files.add((path, file))
    }
}

impl Session for KernelSession {
    fn create(&mut self, path: &str) -> R<Fh> {
        let path = self.root.join(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        Ok(self.handle(path, file))
    }

    fn open(&mut self, path: &str) -> R<Fh> {
        let path = self.root.join(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        Ok(self.handle(path, file))
    }

    fn close(&mut self, fh: Fh) -> R<()> {
        self.files.close(fh)
    }

    fn pwrite(&mut self, fh: Fh, offset: u64, data: &[u8]) -> R<()> {
        self.file(fh)?
            .write_all_at(data, offset)
            .map_err(|e| format!("pwrite: {e}"))
    }

    fn pread(&mut self, fh: Fh, offset: u64, len: usize) -> R<usize> {
        let file = self.files.get(fh).map(|(_, f)| f)?;
        let buf = super::session::read_buf(&mut self.read_buf, len);
        file.read_at(buf, offset).map_err(|e| format!("pread: {e}"))
    }

    fn fsync(&mut self, fh: Fh) -> R<()> {
        self.file(fh)?.sync_all().map_err(|e| format!("fsync: {e}"))
    }

    fn fdatasync(&mut self, fh: Fh) -> R<()> {
        self.file(fh)?
            .sync_data()
            .map_err(|e| format!("fdatasync: {e}"))
    }

    fn mkdir(&mut self, path: &str) -> R<()> {
        let path = self.root.join(path);
        std::fs::create_dir(&path).map_err(|e| io(&path, e))
    }

    fn rmdir(&mut self, path: &str) -> R<()> {
        let path = self.root.join(path);
        std::fs::remove_dir(&path).map_err(|e| io(&path, e))
    }

    fn unlink(&mut self, path: &str) -> R<()> {
        let path = self.root.join(path);
        std::fs::remove_file(&path).map_err(|e| io(&path, e))
    }

    fn rename(&mut self, from: &str, to: &str) -> R<()> {
        let from = self.root.join(from);
        let to = self.root.join(to);
        std::fs::rename(&from, &to).map_err(|e| io(&from, e))
    }

    fn stat(&mut self, path: &str) -> R<u64> {
        let path = self.root.join(path);
        std::fs::symlink_metadata(&path)
            .map(|m| m.len())
            .map_err(|e| io(&path, e))
    }

    fn readdir(&mut self, path: &str) -> R<Vec<(String, bool)>> {
        let path = self.root.join(path);
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&path).map_err(|e| io(&path, e))? {
            let entry = entry.map_err(|e| io(&path, e))?;
            let is_dir = entry.file_type().map_err(|e| io(&path, e))?.is_dir();
            out.push((entry.file_name().to_string_lossy().into_owned(), is_dir));
        }
        Ok(out)
    }

    fn random_reads(
        &mut self,
        fh: Fh,
        file_bytes: u64,
        qd: usize,
        until: Instant,
        seed: u64,
        record: &mut dyn FnMut(u64),
    ) -> R<u64> {
        let path = self.files.get(fh)?.0.clone();
        super::direct::random_reads(&path, file_bytes, qd, until, seed, record)
    }
}
