//! `corefs mount` serving unmodified programs through FUSE: cp -a, tar, find and diff -r
//! round-trip a directory tree exactly; a seeded exerciser compares every read through the
//! mount with an in-memory copy over thousands of operations; unmount commits, fsck is clean,
//! and a second mount shows the same data. Needs root (FUSE mounts, /dev/fuse); otherwise
//! the mount must fail with a clear error, which is what is checked then. Seeds print;
//! `COREFS_SEED=N` replays.

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

/// A mounted corefs; unmounted (and the server reaped) at drop.
struct Mounted {
    child: Option<Child>,
    mountpoint: PathBuf,
}

impl Mounted {
    fn start(device: &str, mountpoint: &Path, reactors: usize) -> Result<Mounted, String> {
        let mut child = corefs()
            .args(["mount", device])
            .arg(mountpoint)
            .args(["--reactors", &reactors.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_mounted(mountpoint) {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                use std::io::Read;
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                return Err(format!("corefs mount exited ({status}): {err}"));
            }
            assert!(Instant::now() < deadline, "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Mounted {
            child: Some(child),
            mountpoint: mountpoint.to_path_buf(),
        })
    }

    /// Unmounts and waits for the server, which commits before it exits.
    fn unmount(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let status = Command::new("umount")
                .arg(&self.mountpoint)
                .status()
                .unwrap();
            assert!(status.success(), "umount failed");
            let exit = child.wait().unwrap();
            assert!(exit.success(), "corefs mount exited with {exit}");
        }
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

    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mounted = match Mounted::start(&device, &mountpoint, reactors) {
        Ok(m) => m,
        Err(e) if !root => {
            // Without root a FUSE mount needs fusermount3 and access to /dev/fuse.
            assert!(e.contains("mount"), "unclear error: {e}");
            eprintln!("not root: checked that mounting fails clearly: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };

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
