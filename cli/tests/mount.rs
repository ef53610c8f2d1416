//! `corefs mount` serving unmodified programs through FUSE: cp -a, tar, find and diff -r
//! round-trip a directory tree exactly; a seeded exerciser compares every read through the
//! mount with an in-memory copy over thousands of operations; unmount commits, fsck is clean,
//! and a second mount shows the same data. Owners, set-group-ID directories, special files,
//! open-unlinked files, fallocate's modes and renameat2's flags are checked through the mount
//! too, and a user other than root mounts through fusermount3 and owns what it makes.
//!
//! Who runs them: root (as CI does) mounts directly and acts as another user (nobody, 65534)
//! through setpriv; the fusermount3 test mounts as nobody. A user other than root mounts
//! through fusermount3: the fusermount3 test then mounts as that user (and fails if it
//! cannot: that is what it checks), the others check that a mount that fails says so
//! clearly, and the two that need root (a second user to act as, holding an image through
//! a root mount) say they were not run and pass. Seeds print; `COREFS_SEED=N` replays.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn corefs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_corefs"))
}

fn is_mounted(mountpoint: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let mp = mountpoint.to_string_lossy();
    mounts.lines().any(|l| l.split(' ').nth(1) == Some(&*mp))
}

/// A mounted corefs; unmounted (and the server reaped) at drop. The server's stderr goes to
/// a file beside the mountpoint, read at unmount.
struct Mounted {
    child: Option<Child>,
    mountpoint: PathBuf,
    log: PathBuf,
    /// The mounter, when not root: it unmounts through fusermount3.
    user: Option<u32>,
}

/// `program` run as user and group `id` (no supplementary groups), through setpriv; or as
/// this process's user, when that is `id` (a test run by a user other than root).
fn as_user(id: u32, program: &str) -> Command {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == id {
        return Command::new(program);
    }
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={id}"))
        .arg(format!("--regid={id}"))
        .arg("--clear-groups")
        .arg(program);
    cmd
}

impl Mounted {
    fn start(device: &str, mountpoint: &Path, reactors: usize) -> Result<Mounted, String> {
        Mounted::start_with(device, mountpoint, reactors, &[], None)
    }

    /// Mounts with `args` added, as user `user` (through setpriv) if given.
    fn start_with(
        device: &str,
        mountpoint: &Path,
        reactors: usize,
        args: &[&str],
        user: Option<u32>,
    ) -> Result<Mounted, String> {
        Mounted::start_logging(device, mountpoint, reactors, args, user, "")
    }

    /// [`Mounted::start_with`], the server logging what `log_filter` (`COREFS_LOG`) asks for
    /// into the log the test can read (`Mounted::log`).
    fn start_logging(
        device: &str,
        mountpoint: &Path,
        reactors: usize,
        args: &[&str],
        user: Option<u32>,
        log_filter: &str,
    ) -> Result<Mounted, String> {
        let log = mountpoint.with_extension("server.log");
        let stderr = std::fs::File::create(&log).unwrap();
        let mut cmd = match user {
            Some(id) => as_user(id, env!("CARGO_BIN_EXE_corefs")),
            None => corefs(),
        };
        if !log_filter.is_empty() {
            cmd.env("COREFS_LOG", log_filter);
        }
        let mut child = cmd
            .args(["mount", device])
            .arg(mountpoint)
            .args(["--reactors", &reactors.to_string()])
            .args(args)
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_mounted(mountpoint) {
            if let Some(status) = child.try_wait().unwrap() {
                let err = std::fs::read_to_string(&log).unwrap();
                return Err(format!("corefs mount exited ({status}): {err}"));
            }
            assert!(Instant::now() < deadline, "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Mounted {
            child: Some(child),
            mountpoint: mountpoint.to_path_buf(),
            log,
            user,
        })
    }

    /// Unmounts and waits for the server, which commits before it exits; returns what the
    /// server logged, in which a clean unmount has no failed second unmount.
    fn unmount(mut self) -> String {
        self.stop();
        let log = std::fs::read_to_string(&self.log).unwrap();
        for wrong in ["Unmount failed", "Failed to umount", " ERROR "] {
            assert!(!log.contains(wrong), "the server logged {wrong:?}: {log}");
        }
        log
    }

    fn stop(&mut self) {
        if self.child.is_none() {
            return;
        }
        let status = match self.user {
            Some(id) => as_user(id, "fusermount3")
                .arg("-u")
                .arg(&self.mountpoint)
                .status(),
            None => Command::new("umount").arg(&self.mountpoint).status(),
        }
        .unwrap();
        // The server stays ours until the unmount worked: if it failed (a file still open),
        // the panic's drop detaches the mount and kills the server instead of leaving both
        // behind, mounted, for every later run to trip over.
        assert!(status.success(), "unmounting failed");
        let mut child = self.child.take().expect("checked above");
        let exit = child.wait().unwrap();
        assert!(exit.success(), "corefs mount exited with {exit}");
    }

    /// Kills the server (a crash: nothing more is committed) and detaches the dead mount.
    fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        run(Command::new("umount").arg("-l").arg(&self.mountpoint));
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.child.is_some() && !std::thread::panicking() {
            self.stop();
        } else if let Some(mut child) = self.child.take() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.mountpoint)
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A test's first mount: as root it must succeed; a user other than root mounts through
/// fusermount3 when /dev/fuse is open to them, and otherwise the mount must fail with a clear
/// error, which is then all the test checks (None).
fn first_mount(device: &str, mountpoint: &Path, reactors: usize) -> Option<Mounted> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match Mounted::start(device, mountpoint, reactors) {
        Ok(m) => Some(m),
        Err(e) if !root => {
            assert!(e.contains("mount"), "unclear error: {e}");
            eprintln!("not root: checked that mounting fails clearly: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A deterministic tree: nested directories, files of many sizes (empty to 300 KiB), a
/// symlink, a hard link, an executable.
fn make_tree(root: &Path, rng: &mut Xoshiro256PlusPlus) {
    for d in 0..4 {
        for e in 0..3 {
            let dir = root.join(format!("d{d}/e{e}"));
            std::fs::create_dir_all(&dir).unwrap();
            for f in 0..6 {
                let len = match rng.random_range(0..4) {
                    0 => 0,
                    1 => rng.random_range(1..4096),
                    2 => rng.random_range(4096..65536),
                    _ => rng.random_range(65536..300_000),
                };
                let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                std::fs::write(dir.join(format!("f{f}.bin")), data).unwrap();
            }
        }
    }
    std::os::unix::fs::symlink("d0/e0/f0.bin", root.join("link")).unwrap();
    std::fs::hard_link(root.join("d1/e1/f1.bin"), root.join("hard")).unwrap();
    std::fs::write(root.join("run.sh"), "#!/bin/sh\necho hi\n").unwrap();
    run(Command::new("chmod").arg("755").arg(root.join("run.sh")));
}

/// `--core` names a core the process may run on, for every reactor: anything else is a
/// clear error before anything starts (a core past 1023 used to abort the process from the
/// reactor thread). Needs no root: nothing is mounted.
#[test]
fn a_core_the_process_may_not_run_on_is_refused_with_the_allowed_set() {
    let allowed = reactor::affinity::allowed_cores().unwrap();
    let past = allowed[allowed.len() - 1] + 1;
    for (core, reactors, named) in [
        (5000, 1, 5000),
        (past, 1, past),
        (allowed[allowed.len() - 1], 2, past),
    ] {
        let out = corefs()
            .args(["mount", "mem:64MiB", "/nonexistent-mountpoint", "--core"])
            .arg(core.to_string())
            .args(["--reactors", &reactors.to_string()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code().is_some_and(|c| c != 0),
            "--core {core} --reactors {reactors}: {} {err}",
            out.status
        );
        assert!(
            err.contains(&format!("core {named} ")) && err.contains("allowed: "),
            "--core {core} --reactors {reactors}: {err}"
        );
    }
}

#[test]
fn standard_tools_and_an_exerciser_through_the_mount() {
    through_the_mount(1);
}

/// The same through two reactors: the copied trees' directories spread over both, so copies,
/// renames and removals span them.
#[test]
fn standard_tools_and_an_exerciser_through_a_mount_on_two_reactors() {
    through_the_mount(2);
}

fn through_the_mount(reactors: usize) {
    let seed = nvme::wrap::seed_from_env();
    eprintln!("seed {seed} (COREFS_SEED={seed} replays)");
    let work = tempfile::Builder::new()
        .prefix("corefs-mount-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = work.path().join("fs.img");
    let device = format!("file:{},size=512MiB", image.display());
    run(corefs().args(["mkfs", &device, "--shards", "4"]));
    let mountpoint = work.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();

    let Some(mounted) = first_mount(&device, &mountpoint, reactors) else {
        return;
    };

    // As root, the server widens the kernel's read-ahead for the mount to one FUSE request.
    if is_root() {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(&mountpoint).unwrap().dev();
        let knob = format!(
            "/sys/class/bdi/{}:{}/read_ahead_kb",
            libc::major(dev),
            libc::minor(dev)
        );
        // The server sets it just after the mount is made: give it the time to.
        wait_until(&format!("{knob} at 1024"), || {
            std::fs::read_to_string(&knob).is_ok_and(|w| w.trim() == "1024")
        });
    }

    // cp -a, tar and find round-trip a tree exactly.
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let src = work.path().join("src");
    std::fs::create_dir(&src).unwrap();
    make_tree(&src, &mut rng);
    run(Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(mountpoint.join("copy")));
    run(Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(&src)
        .arg(mountpoint.join("copy")));
    std::fs::create_dir(mountpoint.join("untar")).unwrap();
    run(Command::new("sh").arg("-c").arg(format!(
        "tar -C {} -cf - . | tar -C {} -xpf -",
        src.display(),
        mountpoint.join("untar").display()
    )));
    run(Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(&src)
        .arg(mountpoint.join("untar")));
    run(Command::new("rsync")
        .arg("-a")
        .arg(format!("{}/", src.display()))
        .arg(mountpoint.join("rsynced")));
    run(Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(&src)
        .arg(mountpoint.join("rsynced")));
    // A second rsync finds nothing to send: sizes and times came through exactly.
    let out = Command::new("rsync")
        .arg("-a")
        .arg("--itemize-changes")
        .arg(format!("{}/", src.display()))
        .arg(mountpoint.join("rsynced"))
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        out.stdout.is_empty(),
        "rsync found differences: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let count = |dir: &Path| {
        let out = Command::new("find").arg(dir).output().unwrap();
        assert!(out.status.success());
        out.stdout.iter().filter(|&&b| b == b'\n').count()
    };
    assert_eq!(
        count(&src),
        count(&mountpoint.join("copy")),
        "find {} vs {}",
        src.display(),
        mountpoint.join("copy").display()
    );
    let meta = std::fs::symlink_metadata(mountpoint.join("copy/run.sh")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o755);
    assert_eq!(
        std::fs::read_link(mountpoint.join("copy/link")).unwrap(),
        Path::new("d0/e0/f0.bin")
    );

    // The exerciser: random writes, truncates, reads, renames, fsyncs on a few files,
    // every read compared with the model.
    let ex = mountpoint.join("ex");
    std::fs::create_dir(&ex).unwrap();
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let names = ["a", "b", "c", "d"];
    let mut ops = 0u32;
    for step in 0..3000 {
        let name = names[rng.random_range(0..names.len())].to_string();
        let path = ex.join(&name);
        let ctx = format!("seed {seed} step {step} {name}");
        match rng.random_range(0..10) {
            0..=3 => {
                let data = model.entry(name.clone()).or_default();
                let offset = rng.random_range(0..200_000usize);
                let len = rng.random_range(1..20_000usize);
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(false)
                    .open(&path)
                    .unwrap();
                f.write_all_at(&bytes, offset as u64).unwrap();
                if data.len() < offset + len {
                    data.resize(offset + len, 0);
                }
                data[offset..offset + len].copy_from_slice(&bytes);
                if rng.random_range(0..4) == 0 {
                    f.sync_all().unwrap();
                }
            }
            4 => {
                if let Some(data) = model.get_mut(&name) {
                    let size = rng.random_range(0..150_000usize);
                    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                    f.set_len(size as u64).unwrap();
                    data.resize(size, 0);
                }
            }
            5..=7 => {
                if let Some(data) = model.get(&name) {
                    let got = std::fs::read(&path).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert!(
                        got == *data,
                        "{ctx}: {} bytes read, {} in the model",
                        got.len(),
                        data.len()
                    );
                }
            }
            8 => {
                let to = names[rng.random_range(0..names.len())].to_string();
                if to != name && model.contains_key(&name) {
                    std::fs::rename(&path, ex.join(&to)).unwrap();
                    let data = model.remove(&name).unwrap();
                    model.insert(to, data);
                }
            }
            _ => {
                if model.remove(&name).is_some() {
                    std::fs::remove_file(&path).unwrap();
                }
            }
        }
        ops += 1;
    }
    let listed: Vec<String> = std::fs::read_dir(&ex)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(listed, model.keys().cloned().collect::<Vec<_>>());
    eprintln!("exerciser: {ops} operations checked");

    // Four threads appending and fsyncing their own files at once: the FUSE workers keep
    // several requests at the reactor, and every byte arrives.
    let par = mountpoint.join("par");
    std::fs::create_dir(&par).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let path = par.join(format!("t{t}"));
            scope.spawn(move || {
                let f = std::fs::File::create(&path).unwrap();
                for i in 0..50u64 {
                    f.write_all_at(&[t ^ i as u8; 4096], i * 4096).unwrap();
                    f.sync_data().unwrap();
                }
            });
        }
    });
    for t in 0..4u8 {
        let data = std::fs::read(par.join(format!("t{t}"))).unwrap();
        assert_eq!(data.len(), 50 * 4096);
        for (i, block) in data.chunks(4096).enumerate() {
            assert!(block.iter().all(|&b| b == t ^ i as u8), "t{t} block {i}");
        }
    }

    // Unmount commits; fsck is clean; a new mount shows the same.
    mounted.unmount();
    run(corefs().args(["fsck", &device]));
    let mounted = Mounted::start(&device, &mountpoint, reactors).unwrap();
    run(Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(&src)
        .arg(mountpoint.join("copy")));
    for (name, data) in &model {
        assert!(
            std::fs::read(ex.join(name)).unwrap() == *data,
            "{name} after remount"
        );
    }
    mounted.unmount();
}

/// A served image is held by its server (here on two reactors, whose queues share the lock):
/// a second mount, mkfs and fsck (with or without --repair) fail naming the server's pid and
/// change nothing; dump and fsck -n read it with a warning; after the unmount the fsynced
/// file is there and fsck is clean. Before the lock, the second mount succeeded and the last
/// unmount erased the other's fsynced data.
#[test]
fn a_served_image_is_held_by_its_server() {
    let work = tempfile::Builder::new()
        .prefix("corefs-mount-held-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = work.path().join("fs.img");
    let device = format!("file:{}", image.display());
    run(corefs().args(["mkfs", &device, "--size", "128MiB", "--shards", "4"]));
    let mountpoint = work.path().join("mnt");
    let second = work.path().join("mnt2");
    std::fs::create_dir(&mountpoint).unwrap();
    std::fs::create_dir(&second).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: no FUSE mount to hold the image (cli/tests/devices.rs holds one)");
        return;
    }
    let mounted = Mounted::start(&device, &mountpoint, 2).unwrap();
    let pid = mounted.child.as_ref().unwrap().id();
    let file = mountpoint.join("kept");
    let data = vec![0x6b_u8; 20_000];
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&file).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    let holder = format!("held by pid {pid}");
    let output = |args: &[&str]| {
        let out = corefs()
            .args(args)
            .env("COREFS_LOG", "error")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status, text)
    };
    // The second mount fails at once; if it mounts instead, it is undone and the test fails.
    match Mounted::start(&device, &second, 1) {
        Ok(m) => {
            m.unmount();
            panic!("a second mount of a served image succeeded");
        }
        Err(e) => assert!(e.contains("is in use") && e.contains(&holder), "{e}"),
    }
    for args in [
        vec!["mkfs", &device],
        vec!["fsck", &device],
        vec!["fsck", &device, "--repair"],
    ] {
        let (status, text) = output(&args);
        assert!(
            !status.success(),
            "{args:?} succeeded on a served image: {text}"
        );
        assert!(
            text.contains("is in use") && text.contains(&holder),
            "{args:?}: {text}"
        );
    }
    assert!(!is_mounted(&second), "the second mount appeared");
    for args in [vec!["dump", &device, "logs"], vec!["fsck", "-n", &device]] {
        let (status, text) = output(&args);
        assert!(status.success(), "{args:?} on a served image: {text}");
        assert!(
            text.contains("warning") && text.contains(&holder),
            "{args:?}: {text}"
        );
    }
    assert_eq!(std::fs::read(&file).unwrap(), data);
    mounted.unmount();
    let (status, text) = output(&["fsck", &device]);
    assert!(status.success(), "{text}");
    let again = Mounted::start(&device, &mountpoint, 1).unwrap();
    assert_eq!(
        std::fs::read(&file).unwrap(),
        data,
        "the fsynced file survived"
    );
    again.unmount();
}

/// The user and group other users' requests come from here (nobody, nogroup on Debian).
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A work directory in /var/tmp others may enter, and a formatted image in it.
fn work_and_image(prefix: &str, size: &str, shards: u32) -> (tempfile::TempDir, String) {
    let work = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let device = format!("file:{}", work.path().join("fs.img").display());
    run(corefs().args([
        "mkfs",
        &device,
        "--size",
        size,
        "--shards",
        &shards.to_string(),
    ]));
    (work, device)
}

fn statvfs(path: &Path) -> libc::statvfs {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs is all integers (zeroes are valid); the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` outlives the call.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0, "statvfs");
    st
}

/// Inodes in use per statfs (what `df -i` shows as used).
fn used_inodes(path: &Path) -> u64 {
    let st = statvfs(path);
    st.f_files - st.f_ffree
}

/// Waits (up to 20 s) for `cond`, which something asynchronous makes true (the kernel's
/// forgets, the server's setup after the mount is made).
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The inode count fsck reports for a clean image.
fn fsck_inodes(device: &str) -> u64 {
    let out = corefs().args(["fsck", device]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fsck: {text}");
    let (_, after) = text
        .split_once(": clean at generation ")
        .expect("fsck's summary");
    let counted = after.split(": ").nth(1).and_then(|s| s.split(' ').next());
    counted
        .and_then(|n| n.parse().ok())
        .expect("an inode count")
}

fn c_path(path: &Path) -> std::ffi::CString {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

fn ids(meta: &std::fs::Metadata) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    (meta.uid(), meta.gid())
}

/// Runs `script` under sh as `id`, with the path `arg` as $1.
fn sh_as(id: u32, script: &str, arg: &Path) -> std::process::Output {
    as_user(id, "sh")
        .args(["-c", script, "sh"])
        .arg(arg)
        .output()
        .unwrap()
}

/// Owners (of root's and another user's creations, with --allow-other; without it, only the
/// mounter gets in), set-group-ID directories, set-ID bits cleared by chown and by a write,
/// special files (devices keep their numbers, a socket, a FIFO that carries data), statfs's
/// inode counts (df -i), times before 1970 with their nanoseconds (through a remount), and
/// ioctls answered ENOTTY and logged once. Before this, files were all root's, mknod and
/// sockets failed (ENOSYS), df -i showed 0 and a pre-1970 time lost its fraction.
#[test]
fn owners_special_files_statfs_and_times_through_the_mount() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    if !is_root() {
        eprintln!(
            "not root: no second user to act as (a_user_mounts_through_fusermount3 checks \
             this user's owners)"
        );
        return;
    }
    let (work, device) = work_and_image("corefs-mount-posix-", "256MiB", 4);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();

    // Without --allow-other, the mounter alone may use the mount.
    let mounted = Mounted::start(&device, &mnt, 1).unwrap();
    let out = sh_as(NOBODY, "stat \"$1\"", &mnt);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("denied"),
        "another user reached a mount without --allow-other: {out:?}"
    );
    mounted.unmount();

    let mounted = Mounted::start_with(&device, &mnt, 2, &["--allow-other"], None).unwrap();
    std::fs::write(mnt.join("rootfile"), b"r").unwrap();
    assert_eq!(
        ids(&std::fs::metadata(mnt.join("rootfile")).unwrap()),
        (0, 0)
    );
    let shared = mnt.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = sh_as(
        NOBODY,
        "cd \"$1\" && echo n > f && mkdir d && ln -s f l && mkfifo p",
        &shared,
    );
    assert!(out.status.success(), "{out:?}");
    for name in ["f", "d", "l", "p"] {
        let meta = std::fs::symlink_metadata(shared.join(name)).unwrap();
        assert_eq!(ids(&meta), (NOBODY, NOBODY), "{name} made by nobody");
    }
    // Permissions are the kernel's to check, against the caller: root's file is not nobody's.
    let out = sh_as(NOBODY, "echo x >> \"$1\"", &mnt.join("rootfile"));
    assert!(!out.status.success(), "nobody wrote root's 0644 file");

    // A set-group-ID directory gives its group to what is made in it, and its bit to
    // directories, as on ext4.
    let sg = mnt.join("sg");
    std::fs::create_dir(&sg).unwrap();
    std::os::unix::fs::chown(&sg, Some(0), Some(4321)).unwrap();
    std::fs::set_permissions(&sg, std::fs::Permissions::from_mode(0o2777)).unwrap();
    let out = sh_as(NOBODY, "cd \"$1\" && touch f && mkdir d", &sg);
    assert!(out.status.success(), "{out:?}");
    let f = std::fs::metadata(sg.join("f")).unwrap();
    assert_eq!(ids(&f), (NOBODY, 4321));
    assert_eq!(f.mode() & 0o2000, 0, "a file does not take the bit");
    let d = std::fs::metadata(sg.join("d")).unwrap();
    assert_eq!(ids(&d), (NOBODY, 4321));
    assert_ne!(d.mode() & 0o2000, 0, "a directory takes the bit");

    // chown clears set-user-ID, and set-group-ID with group execute; so does a write by a
    // user without CAP_FSETID (the server kills them: a_write_truncate_and_chown_kill_...).
    let su = mnt.join("su");
    std::fs::write(&su, b"x").unwrap();
    std::fs::set_permissions(&su, std::fs::Permissions::from_mode(0o6755)).unwrap();
    std::os::unix::fs::chown(&su, Some(NOBODY), Some(NOBODY)).unwrap();
    assert_eq!(std::fs::metadata(&su).unwrap().mode() & 0o7777, 0o755);
    let sw = shared.join("sw");
    let out = sh_as(
        NOBODY,
        "echo a > \"$1\" && chmod 4755 \"$1\" && echo b >> \"$1\"",
        &sw,
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::metadata(&sw).unwrap().mode() & 0o7777, 0o755);

    // Special files.
    run(Command::new("mknod")
        .arg(mnt.join("chr"))
        .args(["c", "1", "3"]));
    run(Command::new("mknod")
        .arg(mnt.join("blk"))
        .args(["b", "259", "70000"]));
    let chr = std::fs::symlink_metadata(mnt.join("chr")).unwrap();
    assert!(chr.file_type().is_char_device());
    assert_eq!(chr.rdev(), libc::makedev(1, 3));
    let blk = std::fs::symlink_metadata(mnt.join("blk")).unwrap();
    assert!(blk.file_type().is_block_device());
    assert_eq!(blk.rdev(), libc::makedev(259, 70000));
    let listener = std::os::unix::net::UnixListener::bind(mnt.join("sock")).unwrap();
    assert!(std::fs::symlink_metadata(mnt.join("sock"))
        .unwrap()
        .file_type()
        .is_socket());
    drop(listener);
    run(Command::new("mkfifo").arg(mnt.join("fifo")));
    let fifo = mnt.join("fifo");
    let writer = std::thread::spawn(move || std::fs::write(fifo, b"through the fifo").unwrap());
    assert_eq!(
        std::fs::read(mnt.join("fifo")).unwrap(),
        b"through the fifo".to_vec()
    );
    writer.join().unwrap();

    // statfs counts inodes, and df -i shows them.
    let before = used_inodes(&mnt);
    assert!(before > 10 && statvfs(&mnt).f_files > before, "{before}");
    for i in 0..10 {
        std::fs::write(mnt.join(format!("count{i}")), b"").unwrap();
    }
    assert_eq!(used_inodes(&mnt), before + 10);
    // df's inode columns (what `df -i` shows; -i and --output do not go together).
    let out = Command::new("df")
        .arg("--output=iused,itotal")
        .arg(&mnt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<u64> = text
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("df: {out:?}"))
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(numbers[0], before + 10, "df -i: {text}");
    assert!(numbers[1] > numbers[0], "df -i: {text}");

    // A time before 1970 with nanoseconds, set and read back through the mount.
    let old = mnt.join("old");
    std::fs::write(&old, b"o").unwrap();
    let times = [
        libc::timespec {
            tv_sec: -1,
            tv_nsec: 999_999_999,
        },
        libc::timespec {
            tv_sec: -12_345,
            tv_nsec: 678_901_234,
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c_path(&old).as_ptr(), times.as_ptr(), 0) };
    assert_eq!(rc, 0, "utimensat: errno {}", last_errno());
    let check_times = |when: &str| {
        let meta = std::fs::metadata(&old).unwrap();
        assert_eq!(
            (meta.atime(), meta.atime_nsec()),
            (-1, 999_999_999),
            "atime {when}"
        );
        assert_eq!(
            (meta.mtime(), meta.mtime_nsec()),
            (-12_345, 678_901_234),
            "mtime {when}"
        );
    };
    check_times("through the mount");

    // Unsupported ioctls: ENOTTY every time, one log line.
    let file = std::fs::File::open(mnt.join("rootfile")).unwrap();
    use std::os::fd::AsRawFd;
    // _IOR('x', 0x42, u32): no filesystem's ioctl.
    const UNKNOWN_IOCTL: libc::c_ulong = 0x8004_7842;
    for _ in 0..50 {
        let mut arg = 0u32;
        // SAFETY: the request reads into one u32 at most, which `arg` is.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), UNKNOWN_IOCTL, &mut arg) };
        assert_eq!((rc, last_errno()), (-1, libc::ENOTTY));
    }
    drop(file);

    // Extended attributes in the namespaces ext4 stores (user, trusted, security); any
    // other is EOPNOTSUPP, as a kernel filesystem answers, where every name used to be
    // stored. (The kernel parses a POSIX ACL before passing it on: a one-byte one is EINVAL.)
    let rootfile = c_path(&mnt.join("rootfile"));
    let setxattr = |name: &str| {
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: NUL-terminated path and name; a one-byte value.
        let rc =
            unsafe { libc::setxattr(rootfile.as_ptr(), name.as_ptr(), b"v".as_ptr().cast(), 1, 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_errno())
        }
    };
    let getxattr = |name: &str| {
        let name = std::ffi::CString::new(name).unwrap();
        let mut value = [0u8; 8];
        // SAFETY: NUL-terminated path and name; `value` is 8 writable bytes.
        let rc = unsafe {
            libc::getxattr(
                rootfile.as_ptr(),
                name.as_ptr(),
                value.as_mut_ptr().cast(),
                8,
            )
        };
        if rc >= 0 {
            Ok(value[..rc as usize].to_vec())
        } else {
            Err(last_errno())
        }
    };
    for name in ["user.a", "trusted.a", "security.a"] {
        assert_eq!(setxattr(name), Ok(()), "{name}");
        assert_eq!(getxattr(name), Ok(b"v".to_vec()), "{name}");
    }
    for name in ["bogus.a", "system.a", "user"] {
        assert_eq!(setxattr(name), Err(libc::EOPNOTSUPP), "{name}");
        assert_eq!(getxattr(name), Err(libc::EOPNOTSUPP), "{name}");
    }

    let log = mounted.unmount();
    let ioctl_lines = log.lines().filter(|l| l.contains("ioctl")).count();
    assert_eq!(ioctl_lines, 1, "{log}");

    // All of it is stored: owners, groups, device numbers, times.
    run(corefs().args(["fsck", &device]));
    let mounted = Mounted::start(&device, &mnt, 1).unwrap();
    check_times("after a remount");
    assert_eq!(
        ids(&std::fs::metadata(sg.join("d")).unwrap()),
        (NOBODY, 4321)
    );
    assert_eq!(
        std::fs::symlink_metadata(mnt.join("blk")).unwrap().rdev(),
        libc::makedev(259, 70000)
    );
    assert_eq!(
        ids(&std::fs::symlink_metadata(shared.join("p")).unwrap()),
        (NOBODY, NOBODY)
    );
    mounted.unmount();
}

/// A file open when its last name goes (unlink, or a rename over it) lives on: read, write,
/// truncate and fstat (nlink 0) through the descriptor work, and it is deleted when the
/// kernel lets go of it after the close. An open file at a lazy unmount is released when the
/// mount finally goes; one held at a crash is deleted by the next mount. Before this, the
/// unlink freed the inode at once and reads through the descriptor failed with ENOENT.
#[test]
fn open_files_outlive_their_last_name_until_closed() {
    use std::os::unix::fs::MetadataExt;
    let (work, device) = work_and_image("corefs-mount-orphans-", "256MiB", 4);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 2) else {
        return;
    };
    let base = used_inodes(&mnt);

    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let path = mnt.join("a");
    std::fs::write(&path, &data).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!path.exists());
    let meta = f.metadata().unwrap();
    assert_eq!((meta.nlink(), meta.len()), (0, 100_000));
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data, "read through the descriptor after unlink");
    f.write_all_at(b"more", 100_000).unwrap();
    let mut tail = [0u8; 4];
    f.read_exact_at(&mut tail, 100_000).unwrap();
    assert_eq!(&tail, b"more");
    f.set_len(5000).unwrap();
    f.sync_all().unwrap();
    assert_eq!(f.metadata().unwrap().len(), 5000);
    assert_eq!(
        used_inodes(&mnt),
        base + 1,
        "the orphan is an inode while open"
    );
    drop(f);
    wait_until("the orphan deleted after the close", || {
        used_inodes(&mnt) == base
    });

    // A rename over an open file.
    std::fs::write(mnt.join("b"), b"old").unwrap();
    std::fs::write(mnt.join("c"), b"new").unwrap();
    let f = std::fs::File::open(mnt.join("b")).unwrap();
    std::fs::rename(mnt.join("c"), mnt.join("b")).unwrap();
    let mut back = [0u8; 3];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"old");
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    assert_eq!(std::fs::read(mnt.join("b")).unwrap(), b"new");
    drop(f);
    wait_until("the renamed-over file deleted after the close", || {
        used_inodes(&mnt) == base + 1
    });

    // Open at a lazy unmount: the mount goes at the close, and the release with it.
    let kept = used_inodes(&mnt);
    std::fs::write(mnt.join("d"), b"d").unwrap();
    let f = std::fs::File::open(mnt.join("d")).unwrap();
    std::fs::remove_file(mnt.join("d")).unwrap();
    run(Command::new("umount").arg("-l").arg(&mnt));
    let mut back = [0u8; 1];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"d", "read after the lazy unmount");
    drop(f);
    let mut mounted = mounted;
    let exit = mounted.child.take().unwrap().wait().unwrap();
    assert!(exit.success(), "the server after a lazy unmount: {exit}");
    // The server let go of what the kernel still held (fsck, which mounts, would delete a
    // leftover orphan itself, so the count below alone would not tell).
    let log = std::fs::read_to_string(&mounted.log).unwrap();
    let released = log
        .split("kernel_refs_released=")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<u64>().ok());
    assert!(released.is_some_and(|n| n >= 1), "{log}");
    assert_eq!(fsck_inodes(&device), kept, "the orphan went with the mount");

    // Held at a crash: the unlink is durable (fsync of the directory), the release never
    // comes; the next mount deletes the orphan.
    let mounted = Mounted::start(&device, &mnt, 2).unwrap();
    std::fs::write(mnt.join("e"), b"e").unwrap();
    let f = std::fs::File::open(mnt.join("e")).unwrap();
    std::fs::remove_file(mnt.join("e")).unwrap();
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    assert_eq!(used_inodes(&mnt), kept + 1);
    mounted.kill();
    drop(f);
    let mounted = Mounted::start(&device, &mnt, 2).unwrap();
    assert!(!mnt.join("e").exists());
    assert_eq!(used_inodes(&mnt), kept, "the next mount deleted the orphan");
    mounted.unmount();
    assert_eq!(fsck_inodes(&device), kept);
}

/// A listing hands the kernel each name's inode with its attributes (READDIRPLUS), as `ls
/// -l`, `find` and `du` want them: after a remount (the kernel's caches cold), stat-ing every
/// listed file gives the sizes and modes written and costs no LOOKUP for most of them (the
/// kernel's first batch of a listing is always a READDIRPLUS; one page holds ~23 of these
/// entries before Linux 6.16, the whole listing after). The references those entries gave the
/// kernel are counted as lookups' are: files unlinked after being listed are deleted when
/// the kernel forgets them, one held open lives until its close, and nothing is left at
/// unmount.
#[test]
fn a_listing_carries_attributes_and_the_references_it_gives_are_counted() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    const FILES: usize = 100;
    let (work, device) = work_and_image("corefs-mount-readdirplus-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 1) else {
        return;
    };
    let base = used_inodes(&mnt);
    let dir = mnt.join("d");
    std::fs::create_dir(&dir).unwrap();
    let mode_of = |i: usize| 0o600 | if i % 3 == 0 { 0o044 } else { 0 };
    for i in 0..FILES {
        let path = dir.join(format!("f{i}"));
        std::fs::write(&path, vec![i as u8; i * 37]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode_of(i))).unwrap();
    }
    mounted.unmount();

    let mounted = Mounted::start_logging(&device, &mnt, 1, &[], None, "fuser=debug").unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort_by_key(|n| n[1..].parse::<usize>().unwrap());
    let want: Vec<String> = (0..FILES).map(|i| format!("f{i}")).collect();
    assert_eq!(names, want);
    for (i, name) in names.iter().enumerate() {
        let meta = std::fs::symlink_metadata(dir.join(name)).unwrap();
        assert_eq!(
            (meta.len(), meta.mode() & 0o7777),
            ((i * 37) as u64, mode_of(i)),
            "{name}'s attributes"
        );
    }
    let log = std::fs::read_to_string(&mounted.log).unwrap();
    let requests = |op: &str| {
        log.lines()
            .filter(|l| l.contains(&format!(" {op} ")))
            .count()
    };
    let (plus, lookups) = (requests("READDIRPLUS"), requests("LOOKUP"));
    assert!(
        plus >= 1 && lookups < FILES / 2,
        "{plus} READDIRPLUS and {lookups} LOOKUP requests to list and stat {FILES} files"
    );

    // Every listed file unlinked, one of them open: the others go as the kernel forgets
    // them, the open one at its close.
    let kept = std::fs::File::open(dir.join("f7")).unwrap();
    for name in &names {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    wait_until("the listed files deleted but the open one", || {
        used_inodes(&mnt) == base + 2
    });
    let mut back = vec![0u8; 7 * 37];
    kept.read_exact_at(&mut back, 0).unwrap();
    assert!(back.iter().all(|&b| b == 7), "read after the unlink");
    drop(kept);
    std::fs::remove_dir(&dir).unwrap();
    wait_until("the open file deleted after its close", || {
        used_inodes(&mnt) == base
    });
    mounted.unmount();
    assert_eq!(fsck_inodes(&device), base, "nothing left held at unmount");
}

/// Privileges go as the kernel's VFS takes them, now that the kernel leaves it to the server
/// (FUSE_HANDLE_KILLPRIV_V2): a write takes the file capability whoever writes, and
/// set-user-ID and set-group-ID (without group execute, only from a writer outside the file's
/// group) when the writer lacks CAP_FSETID; a truncate likewise; a chown of a file takes
/// both bits; a directory keeps its. Each case as ext4 on this kernel does it.
/// And a write no longer asks the server for `security.capability` first: 20 writes make at
/// most one GETXATTR request (they made 20).
#[test]
fn a_write_truncate_and_chown_kill_privileges_as_the_kernel_would() {
    use std::io::Write;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !is_root() {
        eprintln!("not root: no second user to write as, and no capability to set");
        return;
    }
    let (work, device) = work_and_image("corefs-mount-killpriv-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted =
        Mounted::start_logging(&device, &mnt, 1, &["--allow-other"], None, "fuser=debug").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let make = |name: &str, bits: u32| {
        let p = mnt.join(name);
        std::fs::write(&p, b"x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(bits)).unwrap();
        p
    };
    // A file capability (cap_net_raw in the permitted set), as setcap writes it: revision 2,
    // no effective bit, two 32-bit halves of permitted and inheritable sets.
    let mut cap = Vec::new();
    for word in [0x0200_0000u32, 1 << 13, 0, 0, 0] {
        cap.extend_from_slice(&word.to_le_bytes());
    }
    let set_cap = |p: &Path| {
        let name = c"security.capability";
        // SAFETY: NUL-terminated path and name, and a buffer of `cap.len()` bytes.
        let r = unsafe {
            libc::setxattr(
                c_path(p).as_ptr(),
                name.as_ptr(),
                cap.as_ptr().cast(),
                cap.len(),
                0,
            )
        };
        assert_eq!(r, 0, "setxattr security.capability: errno {}", last_errno());
    };
    let has_cap = |p: &Path| {
        let name = c"security.capability";
        let mut buf = [0u8; 64];
        // SAFETY: as above, into a buffer of its length.
        let r = unsafe {
            libc::getxattr(
                c_path(p).as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert!(
            r >= 0 || last_errno() == libc::ENODATA,
            "getxattr: errno {}",
            last_errno()
        );
        r >= 0
    };
    let append_as = |id: u32, p: &Path| {
        let out = sh_as(id, "echo more >> \"$1\"", p);
        assert!(out.status.success(), "{out:?}");
    };
    let truncate_as = |id: u32, p: &Path| {
        let out = sh_as(id, "truncate -s 1 \"$1\"", p);
        assert!(out.status.success(), "{out:?}");
    };

    // Root writes (CAP_FSETID): the bits stay, the capability goes.
    let a = make("a", 0o6755);
    set_cap(&a);
    assert!(has_cap(&a));
    std::fs::OpenOptions::new()
        .append(true)
        .open(&a)
        .unwrap()
        .write_all(b"r")
        .unwrap();
    assert_eq!(
        mode(&a),
        0o6755,
        "root's write keeps set-user-ID and set-group-ID"
    );
    assert!(!has_cap(&a), "a write takes the file capability");

    // Another user writes: set-user-ID goes, set-group-ID with group execute too; without
    // it (a mandatory-locking mark) it goes only from a writer outside the file's group.
    let b = make("b", 0o6777);
    append_as(NOBODY, &b);
    assert_eq!(mode(&b), 0o777);
    let c = make("c", 0o6766);
    append_as(NOBODY, &c);
    assert_eq!(mode(&c), 0o766, "a writer outside the group");
    let g = make("g", 0o2766);
    std::os::unix::fs::chown(&g, None, Some(NOBODY)).unwrap();
    std::fs::set_permissions(&g, std::fs::Permissions::from_mode(0o2766)).unwrap();
    append_as(NOBODY, &g);
    assert_eq!(mode(&g), 0o2766, "a writer in the group");

    // Truncates: by another user as its write; by root the bits stay, the capability goes.
    let d = make("d", 0o6777);
    truncate_as(NOBODY, &d);
    assert_eq!((mode(&d), std::fs::metadata(&d).unwrap().len()), (0o777, 1));
    let e = make("e", 0o4755);
    set_cap(&e);
    truncate_as(0, &e);
    assert_eq!(mode(&e), 0o4755);
    assert!(!has_cap(&e), "a truncate takes the file capability");

    // chown: a file loses both bits (root's chown too), a directory keeps them.
    let f = make("f", 0o6755);
    std::os::unix::fs::chown(&f, Some(NOBODY), None).unwrap();
    assert_eq!(mode(&f), 0o755);
    let dir = mnt.join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o2775)).unwrap();
    std::os::unix::fs::chown(&dir, Some(NOBODY), None).unwrap();
    assert_eq!(mode(&dir), 0o2775);

    // No GETXATTR per write.
    let log_before = std::fs::read_to_string(&mounted.log).unwrap();
    let getxattrs = |log: &str| log.lines().filter(|l| l.contains(" GETXATTR ")).count();
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(mnt.join("b"))
        .unwrap();
    for _ in 0..20 {
        file.write_all(b"w").unwrap();
    }
    drop(file);
    let log_after = std::fs::read_to_string(&mounted.log).unwrap();
    let asked = getxattrs(&log_after) - getxattrs(&log_before);
    // At most the kernel's own look before the first write since the inode's mode changed
    // (then it marks the inode as having nothing to kill); 20 before.
    assert!(
        asked <= 1,
        "{asked} GETXATTR requests for 20 writes: {}",
        &log_after[log_before.len()..]
    );
    mounted.unmount();
}

/// `corefs sync PATH` commits what was written through the mount, which `sync -f` cannot
/// (Linux passes syncfs to no FUSE server but virtiofs): a tree written with no fsync and
/// synced so is all there after the server is killed, well inside the commit interval; on a
/// path outside a corefs mount the command fails and says so.
#[test]
fn corefs_sync_makes_a_tree_written_through_the_mount_durable() {
    let (work, device) = work_and_image("corefs-mount-sync-", "256MiB", 4);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 1) else {
        return;
    };
    let started = Instant::now();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(37);
    make_tree(&mnt.join("tree"), &mut rng);
    let before = snapshot(&mnt.join("tree"));
    run(corefs().arg("sync").arg(mnt.join("tree")));
    mounted.kill();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "slower than the commit interval: the test shows nothing ({:?})",
        started.elapsed()
    );
    let mounted = Mounted::start(&device, &mnt, 1).unwrap();
    assert_eq!(
        snapshot(&mnt.join("tree")),
        before,
        "the synced tree after a crash"
    );
    mounted.unmount();

    let out = corefs().arg("sync").arg(work.path()).output().unwrap();
    assert!(!out.status.success(), "synced a path outside corefs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not on a corefs mount"), "{err}");
}

/// Every file under `root` (relative path and bytes), sorted.
fn snapshot(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                files.push((path.strip_prefix(root).unwrap().to_path_buf(), bytes));
            }
        }
    }
    files.sort();
    files
}

/// fallocate's modes through the mount against a model (an fsx in small: writes,
/// preallocation with and without KEEP_SIZE, punched holes, zeroed ranges, truncates, each
/// read back), modes the engine lacks refused with EOPNOTSUPP, and renameat2's
/// RENAME_NOREPLACE and RENAME_EXCHANGE (RENAME_WHITEOUT refused with EINVAL). Before fuser
/// routed them, every fallocate failed with EOPNOTSUPP and every rename flag with EINVAL.
#[test]
fn fallocate_modes_and_rename_flags_through_the_mount() {
    use std::os::fd::AsRawFd;
    let seed = nvme::wrap::seed_from_env();
    eprintln!("seed {seed} (COREFS_SEED={seed} replays)");
    let (work, device) = work_and_image("corefs-mount-falloc-", "256MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 1) else {
        return;
    };

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(mnt.join("fsx"))
        .unwrap();
    let fd = f.as_raw_fd();
    let mut model: Vec<u8> = Vec::new();
    let fallocate = |mode: i32, offset: usize, len: usize| {
        // SAFETY: plain integers on an open descriptor.
        let rc = unsafe { libc::fallocate(fd, mode, offset as i64, len as i64) };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_errno())
        }
    };
    for step in 0..1200 {
        let offset = rng.random_range(0..400_000usize);
        let len = rng.random_range(1..40_000usize);
        let op = rng.random_range(0..8);
        let ctx = format!("seed {seed} step {step} op {op} offset {offset} len {len}");
        match op {
            0 | 1 => {
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                f.write_all_at(&bytes, offset as u64).unwrap();
                if model.len() < offset + len {
                    model.resize(offset + len, 0);
                }
                model[offset..offset + len].copy_from_slice(&bytes);
            }
            2 => {
                fallocate(0, offset, len).unwrap_or_else(|e| panic!("{ctx}: errno {e}"));
                if model.len() < offset + len {
                    model.resize(offset + len, 0);
                }
            }
            3 => fallocate(libc::FALLOC_FL_KEEP_SIZE, offset, len)
                .unwrap_or_else(|e| panic!("{ctx}: errno {e}")),
            4 => {
                fallocate(
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                )
                .unwrap_or_else(|e| panic!("{ctx}: errno {e}"));
                let end = (offset + len).min(model.len());
                if offset < end {
                    model[offset..end].fill(0);
                }
            }
            5 | 6 => {
                let keep = op == 6;
                let mode =
                    libc::FALLOC_FL_ZERO_RANGE | if keep { libc::FALLOC_FL_KEEP_SIZE } else { 0 };
                fallocate(mode, offset, len).unwrap_or_else(|e| panic!("{ctx}: errno {e}"));
                if !keep && model.len() < offset + len {
                    model.resize(offset + len, 0);
                }
                let end = (offset + len).min(model.len());
                if offset < end {
                    model[offset..end].fill(0);
                }
            }
            _ => {
                let size = rng.random_range(0..300_000usize);
                f.set_len(size as u64).unwrap();
                model.resize(size, 0);
            }
        }
        assert_eq!(f.metadata().unwrap().len(), model.len() as u64, "{ctx}");
        if step % 8 == 0 || step == 1199 {
            let mut back = vec![0u8; model.len()];
            f.read_exact_at(&mut back, 0).unwrap();
            let first = back.iter().zip(&model).position(|(a, b)| a != b);
            assert!(first.is_none(), "{ctx}: first difference at byte {first:?}");
        }
    }
    for mode in [libc::FALLOC_FL_COLLAPSE_RANGE, libc::FALLOC_FL_INSERT_RANGE] {
        assert_eq!(
            fallocate(mode, 0, 4096),
            Err(libc::EOPNOTSUPP),
            "mode {mode:#x}"
        );
    }
    drop(f);

    let rename2 = |from: &str, to: &str, flags: u32| {
        let (from, to) = (c_path(&mnt.join(from)), c_path(&mnt.join(to)));
        // SAFETY: NUL-terminated paths.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                flags,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_errno())
        }
    };
    std::fs::write(mnt.join("x"), b"x").unwrap();
    std::fs::write(mnt.join("y"), b"y").unwrap();
    assert_eq!(rename2("x", "y", libc::RENAME_NOREPLACE), Err(libc::EEXIST));
    assert_eq!(std::fs::read(mnt.join("y")).unwrap(), b"y");
    assert_eq!(rename2("x", "z", libc::RENAME_NOREPLACE), Ok(()));
    assert!(!mnt.join("x").exists());
    assert_eq!(std::fs::read(mnt.join("z")).unwrap(), b"x");
    std::fs::create_dir(mnt.join("dir")).unwrap();
    std::fs::write(mnt.join("dir/inside"), b"i").unwrap();
    assert_eq!(rename2("z", "dir", libc::RENAME_EXCHANGE), Ok(()));
    assert_eq!(std::fs::read(mnt.join("dir")).unwrap(), b"x");
    assert_eq!(std::fs::read(mnt.join("z/inside")).unwrap(), b"i");
    assert_eq!(
        rename2("dir", "missing", libc::RENAME_EXCHANGE),
        Err(libc::ENOENT)
    );
    assert_eq!(rename2("y", "w", libc::RENAME_WHITEOUT), Err(libc::EINVAL));
    mounted.unmount();
    run(corefs().args(["fsck", &device]));
}

/// Restores /dev/fuse's mode when dropped.
struct DevFuseMode(u32);

impl Drop for DevFuseMode {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions("/dev/fuse", std::fs::Permissions::from_mode(self.0));
    }
}

/// A user other than root formats an image and mounts it through fusermount3: the root
/// directory is the user's, what it makes is its own, root is kept out (no --allow-other),
/// --allow-other is refused by fusermount3 unless /etc/fuse.conf has user_allow_other, and
/// the user unmounts with fusermount3 -u. Run as root, the user is nobody (through setpriv);
/// run as another user, that user. A mount that cannot be made (no fusermount3, /dev/fuse
/// closed to the user) fails the test: the point is that such a user can mount.
#[test]
fn a_user_mounts_through_fusermount3() {
    use std::os::unix::fs::PermissionsExt;
    let root = is_root();
    let (uid, gid) = if root {
        (NOBODY, NOBODY)
    } else {
        // SAFETY: geteuid and getegid have no preconditions.
        unsafe { (libc::geteuid(), libc::getegid()) }
    };
    // scripts/test.sh installs fuse3; without it this test cannot check anything, which is
    // a failure, not a skip.
    assert!(
        Command::new("fusermount3").arg("-V").output().is_ok(),
        "fusermount3 is not installed (package fuse3): a user other than root cannot mount"
    );
    // fuser opens /dev/fuse itself before it turns to fusermount3, so users need it open
    // to them: mode 0666, as fuse3's udev rule sets it (a container may leave it 0600).
    let mode = std::fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    let _restore = DevFuseMode(mode);
    if root && mode & 0o666 != 0o666 {
        std::fs::set_permissions("/dev/fuse", std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let work = tempfile::Builder::new()
        .prefix("corefs-mount-user-")
        .tempdir_in("/var/tmp")
        .unwrap();
    if root {
        std::os::unix::fs::chown(work.path(), Some(uid), Some(gid)).unwrap();
    }
    let bin = env!("CARGO_BIN_EXE_corefs");
    let device = format!("file:{}", work.path().join("fs.img").display());
    let mkfs = |device: &str| {
        run(as_user(uid, bin).args(["mkfs", device, "--size", "128MiB", "--shards", "2"]))
    };
    mkfs(&device);
    let mnt = work.path().join("mnt");
    run(as_user(uid, "mkdir").arg(&mnt));
    let mounted = Mounted::start_with(&device, &mnt, 1, &[], Some(uid))
        .unwrap_or_else(|e| panic!("user {uid} could not mount through fusermount3: {e}"));
    let out = sh_as(
        uid,
        "cd \"$1\" && echo a > f && mkdir d && ln -s f l && mkfifo p && \
         stat -c '%u:%g %n' . f d l p",
        &mnt,
    );
    assert!(out.status.success(), "{out:?}");
    let listed = String::from_utf8_lossy(&out.stdout);
    let owners: Vec<&str> = listed.lines().collect();
    let expected: Vec<String> = [".", "f", "d", "l", "p"]
        .iter()
        .map(|name| format!("{uid}:{gid} {name}"))
        .collect();
    assert_eq!(owners, expected);
    if root {
        let refused = std::fs::metadata(mnt.join("f")).unwrap_err();
        assert_eq!(
            refused.kind(),
            std::io::ErrorKind::PermissionDenied,
            "root got in"
        );
    }

    let conf = std::fs::read_to_string("/etc/fuse.conf").unwrap_or_default();
    if !conf.lines().any(|l| l.trim() == "user_allow_other") {
        let second = format!("file:{}", work.path().join("second.img").display());
        mkfs(&second);
        let mnt2 = work.path().join("mnt2");
        run(as_user(uid, "mkdir").arg(&mnt2));
        match Mounted::start_with(&second, &mnt2, 1, &["--allow-other"], Some(uid)) {
            Ok(m) => {
                m.unmount();
                panic!("--allow-other mounted for a user without user_allow_other");
            }
            Err(e) => assert!(e.contains("user_allow_other"), "{e}"),
        }
    }
    mounted.unmount();
    run(corefs().args(["fsck", &device]));
}

/// The report that opened the pool of space, replayed through the mount: on a fresh default
/// 1 GiB image (64 shards) a 100 MB file written with `dd` (it stopped at 14 MiB with ENOSPC
/// when each file had its shard's 1/64 of the device), then a second file until the device
/// is full: together ≥ 95% of what `df` showed available, and `df` then near zero. Deleted,
/// the space comes back, and fsck is clean. With one reactor and with two.
#[test]
fn a_large_file_fills_a_fresh_image_through_the_mount() {
    for reactors in [1, 2] {
        let (work, device) = work_and_image("corefs-mount-big-", "1GiB", 64);
        let mnt = work.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let Some(mounted) = first_mount(&device, &mnt, reactors) else {
            return;
        };
        let start = statvfs(&mnt);
        let avail = |st: &libc::statvfs| st.f_bavail * st.f_frsize;
        run(Command::new("dd")
            .arg("if=/dev/zero")
            .arg(format!("of={}", mnt.join("f").display()))
            .args(["bs=1M", "count=100", "conv=fsync", "status=none"]));
        // dd until the device is full: its ENOSPC is the expected end.
        let out = Command::new("dd")
            .arg("if=/dev/zero")
            .arg(format!("of={}", mnt.join("g").display()))
            .args(["bs=1M", "status=none"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("No space left on device"),
            "{out:?}"
        );
        let written = std::fs::metadata(mnt.join("f")).unwrap().len()
            + std::fs::metadata(mnt.join("g")).unwrap().len();
        assert_eq!(std::fs::metadata(mnt.join("f")).unwrap().len(), 100 << 20);
        assert!(
            written * 100 >= avail(&start) * 95,
            "{reactors} reactors: {} MiB written of {} MiB available",
            written >> 20,
            avail(&start) >> 20
        );
        let full = statvfs(&mnt);
        assert!(
            avail(&full) * 100 <= full.f_blocks * full.f_frsize * 2,
            "full, yet {} MiB available",
            avail(&full) >> 20
        );
        std::fs::remove_file(mnt.join("f")).unwrap();
        std::fs::remove_file(mnt.join("g")).unwrap();
        // The frees come back with the commit (the timer's, within 5 s).
        wait_until("the deleted files' space back", || {
            avail(&statvfs(&mnt)) + start.f_blocks * start.f_frsize / 100 >= avail(&start)
        });
        mounted.unmount();
        let out = corefs().args(["fsck", &device]).output().unwrap();
        assert!(out.status.success(), "fsck: {out:?}");
    }
}

/// A missing name is answered as a negative entry the kernel keeps for a second: whatever
/// makes the name through the mount (create, exclusive create, mkdir, a rename onto it, a hard
/// link, a symbolic link, mknod) is seen at once, and a name removed is missing at once, each
/// probed for just before (so the negative entry is in the kernel's cache).
#[test]
fn a_missing_name_made_through_the_mount_is_seen_at_once() {
    use std::os::unix::fs::OpenOptionsExt;
    let (work, device) = work_and_image("corefs-mount-negative-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 1) else {
        return;
    };
    std::fs::write(mnt.join("source"), b"s").unwrap();
    std::fs::write(mnt.join("moved"), b"m").unwrap();
    type Maker<'a> = (&'a str, &'a dyn Fn(&Path));
    let make: [Maker; 7] = [
        ("create", &|p| std::fs::write(p, b"x").unwrap()),
        ("exclusive create", &|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(p)
                .unwrap();
        }),
        ("mkdir", &|p| std::fs::create_dir(p).unwrap()),
        ("rename onto", &|p| {
            std::fs::rename(p.with_file_name("moved"), p).unwrap();
            std::fs::write(p.with_file_name("moved"), b"m").unwrap();
        }),
        ("link", &|p| {
            std::fs::hard_link(p.with_file_name("source"), p).unwrap()
        }),
        ("symlink", &|p| {
            std::os::unix::fs::symlink("source", p).unwrap()
        }),
        ("mknod (fifo)", &|p| {
            let c = c_path(p);
            // SAFETY: a NUL-terminated path alive for the call.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        }),
    ];
    for (i, (how, make)) in make.iter().enumerate() {
        let p = mnt.join(format!("name{i}"));
        for _ in 0..3 {
            assert!(
                std::fs::symlink_metadata(&p).is_err(),
                "{how}: missing first"
            );
        }
        make(&p);
        assert!(
            std::fs::symlink_metadata(&p).is_ok(),
            "{how}: the name made is not seen"
        );
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            std::fs::remove_dir(&p).unwrap();
        } else {
            std::fs::remove_file(&p).unwrap();
        }
        assert!(
            std::fs::symlink_metadata(&p).is_err(),
            "{how}: the name removed is still seen"
        );
    }
    mounted.unmount();
}

/// A file opened again keeps its pages in the kernel's page cache only while no read would
/// move its atime (relatime, the default): read after a change, it is read from the engine
/// again, and atime moves as on a kernel filesystem; its bytes are the latest through every
/// descriptor, old or new.
#[test]
fn reads_through_the_page_cache_keep_relatime_and_the_latest_bytes() {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::MetadataExt;
    let (work, device) = work_and_image("corefs-mount-cache-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mounted) = first_mount(&device, &mnt, 1) else {
        return;
    };
    let f = mnt.join("f");
    let read_all = |what: &str| -> Vec<u8> {
        let mut data = Vec::new();
        std::fs::File::open(&f)
            .unwrap()
            .read_to_end(&mut data)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        data
    };
    let atime = || {
        let m = std::fs::metadata(&f).unwrap();
        (m.atime(), m.atime_nsec())
    };
    let mtime = || {
        let m = std::fs::metadata(&f).unwrap();
        (m.mtime(), m.mtime_nsec())
    };
    std::fs::write(&f, vec![b'a'; 1 << 20]).unwrap();
    // atime before mtime: the next read must move it.
    let times = [
        libc::timespec {
            tv_sec: 1_000,
            tv_nsec: 0,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c_path(&f).as_ptr(), times.as_ptr(), 0) };
    assert_eq!(rc, 0, "utimensat: errno {}", last_errno());
    assert_eq!(atime(), (1_000, 0));
    assert_eq!(read_all("first read"), vec![b'a'; 1 << 20]);
    wait_until("atime moved by the first read", || atime() > mtime());
    let after_first = atime();
    // Read again: atime is after mtime and ctime, so the pages may stay cached and nothing moves.
    assert_eq!(read_all("second read"), vec![b'a'; 1 << 20]);
    assert_eq!(atime(), after_first, "relatime moved atime twice");

    // A reader holding the file open sees a change made through another descriptor.
    let mut reader = std::fs::File::open(&f).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut writer = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    writer.seek(std::io::SeekFrom::Start(4096)).unwrap();
    writer.write_all(&[b'b'; 8192]).unwrap();
    drop(writer);
    let mut expected = vec![b'a'; 1 << 20];
    expected[4096..4096 + 8192].fill(b'b');
    let mut seen = Vec::new();
    reader.read_to_end(&mut seen).unwrap();
    assert!(seen == expected, "an open reader sees the old bytes");
    drop(reader);
    // Changed after atime: the next open drops the cached pages, its read reaches the engine
    // and moves atime past the new mtime.
    wait_until("mtime after atime", || mtime() > after_first);
    assert!(read_all("read after the change") == expected);
    wait_until("atime moved by the read after the change", || {
        atime() > mtime()
    });
    mounted.unmount();
}

/// A minimal POSIX access ACL (owner, group, other) is taken as the chmod it stands for, and
/// takes effect at once: another user's permission check right after it sees the new mode,
/// not the one the kernel had cached. Extended ACLs and default ACLs are refused
/// (EOPNOTSUPP); none is ever stored, so reading or removing one finds none (ENODATA).
#[test]
fn a_minimal_acl_is_a_chmod_and_takes_effect_at_once() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !is_root() {
        eprintln!("not root: no second user whose permission check to watch");
        return;
    }
    let (work, device) = work_and_image("corefs-mount-acl-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Mounted::start_with(&device, &mnt, 1, &["--allow-other"], None).unwrap();
    let f = mnt.join("f");
    std::fs::write(&f, b"secret").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    // The kernel's encoding; a named user or group (tags 2 and 8) is uid/gid 1000.
    let acl = |entries: &[(u16, u16)]| {
        let mut out = 2u32.to_le_bytes().to_vec();
        for &(tag, perm) in entries {
            let id = if tag == 0x02 || tag == 0x08 {
                1000
            } else {
                u32::MAX
            };
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&perm.to_le_bytes());
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    };
    let set_on = |path: &Path, name: &std::ffi::CStr, value: &[u8]| {
        // SAFETY: a NUL-terminated path and name, and `value` for its length.
        let rc = unsafe {
            libc::setxattr(
                c_path(path).as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc == 0 {
            0
        } else {
            last_errno()
        }
    };
    let set = |name: &std::ffi::CStr, value: &[u8]| set_on(&f, name, value);
    // nobody reads it (and the kernel caches its 0644).
    let out = sh_as(NOBODY, "cat \"$1\"", &f);
    assert!(out.status.success(), "{out:?}");
    // u::rw-, g::---, o::--- is chmod 600.
    let minimal = acl(&[(0x01, 6), (0x04, 0), (0x20, 0)]);
    // nobody's check comes first: a stat would refresh the kernel's attributes itself.
    assert_eq!(set(c"system.posix_acl_access", &minimal), 0);
    let out = sh_as(NOBODY, "cat \"$1\"", &f);
    assert!(
        !out.status.success(),
        "nobody read a file chmod 600 through an ACL (a stale cached mode): {out:?}"
    );
    assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);
    // An extended ACL (a named user and a mask) and a directory's default ACL are refused;
    // nothing changed.
    let extended = acl(&[(0x01, 6), (0x02, 4), (0x04, 4), (0x10, 4), (0x20, 0)]);
    assert_eq!(set(c"system.posix_acl_access", &extended), libc::EOPNOTSUPP);
    let dir = mnt.join("dir");
    std::fs::create_dir(&dir).unwrap();
    assert_eq!(
        set_on(&dir, c"system.posix_acl_default", &minimal),
        libc::EOPNOTSUPP
    );
    assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);
    // None is stored: reading or removing one finds none.
    for (path, name) in [
        (&f, c"system.posix_acl_access"),
        (&dir, c"system.posix_acl_access"),
        (&dir, c"system.posix_acl_default"),
    ] {
        let mut buf = [0u8; 64];
        // SAFETY: a NUL-terminated path and name, and a buffer of its length.
        let rc = unsafe {
            libc::getxattr(
                c_path(path).as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!((rc, last_errno()), (-1, libc::ENODATA), "get {name:?}");
        // SAFETY: a NUL-terminated path and name.
        let rc = unsafe { libc::removexattr(c_path(path).as_ptr(), name.as_ptr()) };
        assert_eq!((rc, last_errno()), (-1, libc::ENODATA), "remove {name:?}");
    }
    // A copy with `cp -a` keeps every mode, with no error.
    let tree = mnt.join("tree");
    std::fs::create_dir_all(tree.join("d")).unwrap();
    std::fs::write(tree.join("d/x"), b"x").unwrap();
    std::fs::set_permissions(tree.join("d/x"), std::fs::Permissions::from_mode(0o751)).unwrap();
    std::fs::set_permissions(tree.join("d"), std::fs::Permissions::from_mode(0o705)).unwrap();
    let out = Command::new("cp")
        .arg("-a")
        .arg(&tree)
        .arg(mnt.join("copy"))
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "cp -a: {out:?}"
    );
    let mode = |p: &str| std::fs::metadata(mnt.join(p)).unwrap().mode() & 0o7777;
    assert_eq!((mode("copy/d"), mode("copy/d/x")), (0o705, 0o751));
    mounted.unmount();
}

/// With noatime, opens make no request (FUSE's zero-message open, where the kernel has it) and
/// the kernel keeps files' pages and directories' listings across opens; every change made
/// through the mount is still seen at once: names created, renamed and removed in a listed
/// directory, and bytes written through another descriptor.
#[test]
fn a_noatime_mount_opens_without_requests_and_sees_every_change() {
    use std::io::{Read, Write};
    let (work, device) = work_and_image("corefs-mount-noatime-", "128MiB", 2);
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let root = is_root();
    let args = ["--atime", "noatime"];
    let mounted = match Mounted::start_logging(&device, &mnt, 1, &args, None, "fuser=debug") {
        Ok(m) => m,
        Err(e) if !root => {
            assert!(e.contains("mount"), "unclear error: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let dir = mnt.join("d");
    std::fs::create_dir(&dir).unwrap();
    let names = || {
        let mut v: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    let f = dir.join("a");
    std::fs::write(&f, b"one").unwrap();
    for _ in 0..20 {
        assert_eq!(names(), ["a"]);
        assert_eq!(std::fs::read(&f).unwrap(), b"one");
    }
    std::fs::write(dir.join("b"), b"").unwrap();
    assert_eq!(names(), ["a", "b"]);
    std::fs::rename(dir.join("b"), dir.join("c")).unwrap();
    assert_eq!(names(), ["a", "c"]);
    std::fs::remove_file(dir.join("c")).unwrap();
    assert_eq!(names(), ["a"]);
    let mut reader = std::fs::File::open(&f).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&f)
        .unwrap()
        .write_all(b" two")
        .unwrap();
    let mut seen = Vec::new();
    reader.read_to_end(&mut seen).unwrap();
    assert_eq!(seen, b"one two");
    drop(reader);
    assert_eq!(std::fs::read(&f).unwrap(), b"one two");
    let log = std::fs::read_to_string(&mounted.log).unwrap();
    let requests = |op: &str| {
        log.lines()
            .filter(|l| l.contains(&format!(" {op} ")))
            .count()
    };
    // One OPEN and one OPENDIR at most: the first, answered ENOSYS (none at all if the
    // kernel lacks zero-message opens, which would answer each: then more than one).
    assert!(
        requests("OPEN") <= 1 && requests("OPENDIR") <= 1,
        "{} OPEN and {} OPENDIR requests for 27 opens and 24 listings",
        requests("OPEN"),
        requests("OPENDIR")
    );
    mounted.unmount();
}

/// The bench suite's FUSE target (`corefs-fuse`: `corefs mount` in a child, the clients'
/// system calls on it) runs every workload beside the storage service's (`corefs-serve`):
/// each run has operations and a CPU time per operation that counts its server process, the
/// FUSE runs report no engine figures (the engine is the server's), and nothing is left
/// mounted or behind in the suite's directory.
#[test]
fn the_bench_suite_runs_every_workload_through_the_mount_and_the_service() {
    let dir = tempfile::Builder::new()
        .prefix("corefs-fuse-suite-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let out = dir.path().join("out");
    run(corefs()
        .args(["bench", "suite", "--targets", "corefs-fuse,corefs-serve"])
        .args([
            "--seconds",
            "0.25",
            "--image-size",
            "256MiB",
            "--shards",
            "2",
            "--writers",
            "2",
            "--write-file-size",
            "1MiB",
            "--fsync-every",
            "4",
            "--create-clients",
            "2",
            "--create-dirs",
            "2",
            "--dbench-clients",
            "2",
            "--read-file-size",
            "4MiB",
            "--seq-file-size",
            "8MiB",
            "--shared-cores",
            "--dir",
            dir.path().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]));
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let runs = results["runs"].as_array().unwrap();
    let mut workloads = std::collections::BTreeSet::new();
    for target in ["corefs-fuse", "corefs-serve"] {
        let mine: Vec<_> = runs.iter().filter(|r| r["target"] == target).collect();
        assert_eq!(mine.len(), 12, "{target}: {mine:?}");
        for run in mine {
            let what = format!("{} on {target}", run["workload"]);
            assert!(run["ops"].as_u64().unwrap() > 0, "{what}: {run}");
            assert!(
                run["cpu_ns_per_op"].as_f64().unwrap() > 0.0,
                "{what}: {run}"
            );
            assert_eq!(
                run["engine"].is_null(),
                target == "corefs-fuse",
                "{what}: {run}"
            );
            workloads.insert(run["workload"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(workloads.len(), 12, "{workloads:?}");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(
        !mounts.contains(dir.path().to_str().unwrap()),
        "left mounted: {mounts}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "out")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
