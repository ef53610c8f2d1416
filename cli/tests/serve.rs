//! `corefs serve` and its clients: several processes on one filesystem through the service,
//! clients and servers killed mid-work, permissions of another user, hostile ring messages.
//!
//! Client processes are this test binary run again with `COREFS_SERVE_ROLE` set: the test
//! `role` then plays that role (and does nothing in a normal run).

use corefs::abi::*;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The user other users' requests come from (nobody on Debian).
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn corefs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_corefs"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run corefs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A work directory others may enter (the nobody client must reach the socket), and a
/// formatted image in it.
fn work_and_image(size: &str) -> (tempfile::TempDir, String) {
    let work = tempfile::Builder::new()
        .prefix("corefs-serve-")
        .tempdir_in("/var/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let device = format!("file:{}", work.path().join("fs.img").display());
    run(corefs().args(["mkfs", &device, "--size", size, "--shards", "4"]));
    (work, device)
}

/// A running `corefs serve`.
struct Server {
    child: Option<Child>,
    socket: PathBuf,
}

impl Server {
    fn start(device: &str, socket: &Path) -> Server {
        Server::start_with(device, socket, &[])
    }

    /// As `start`, with these environment variables for the server.
    fn start_with(device: &str, socket: &Path, env: &[(&str, &str)]) -> Server {
        let child = corefs()
            .envs(env.iter().copied())
            .args(["serve", device, "--socket"])
            .arg(socket)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start corefs serve");
        let server = Server {
            child: Some(child),
            socket: socket.to_path_buf(),
        };
        let started = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the server did not listen at {} within 30 s",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Everyone may connect: the tests' other user must.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o777)).unwrap();
        server
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGTERM, and the server must stop cleanly (exit 0).
    fn stop(mut self) {
        let mut child = self.child.take().unwrap();
        // SAFETY: a child of ours.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(status.success(), "corefs serve ended with {status}");
        assert!(
            !self.socket.exists(),
            "the stopped server removed its socket"
        );
    }

    /// kill -9.
    fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn connect(socket: &Path) -> i64 {
    let path = c(socket.to_str().unwrap());
    // SAFETY: a NUL-terminated path; NULL options.
    let fs = unsafe { corefs_connect(path.as_ptr(), std::ptr::null()) };
    assert!(fs > 0, "connect: {fs} {}", last_error());
    fs
}

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn open(fs: i64, path: &str, flags: i32, mode: u32) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_open(fs, p.as_ptr(), flags, mode) }
}

fn pwrite(fs: i64, fd: i64, data: &[u8], offset: u64) -> i64 {
    // SAFETY: a live buffer of the length given.
    unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), offset) }
}

fn pread(fs: i64, fd: i64, len: usize, offset: u64) -> Result<Vec<u8>, i64> {
    let mut buf = vec![0u8; len];
    // SAFETY: a live buffer of the length given.
    let n = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), len, offset) };
    if n < 0 {
        return Err(n);
    }
    buf.truncate(n as usize);
    Ok(buf)
}

fn stat(fs: i64, path: &str) -> Result<corefs_stat, i64> {
    let p = c(path);
    let mut st = corefs_stat::default();
    // SAFETY: a NUL-terminated path and a live out-struct.
    let rc = unsafe { corefs_stat(fs, p.as_ptr(), &mut st) };
    if rc < 0 {
        Err(rc as i64)
    } else {
        Ok(st)
    }
}

fn statfs(fs: i64) -> corefs_statfs {
    let mut out = corefs_statfs::default();
    // SAFETY: a live out-struct.
    let rc = unsafe { corefs_statfs(fs, &mut out) };
    assert_eq!(rc, 0, "{}", last_error());
    out
}

/// Bytes of `len` from `seed`: every file's content is checkable.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Spawns this test binary as a client playing `role` with `arg`, as `uid` when given.
fn client(role: &str, socket: &Path, arg: &str, uid: Option<u32>) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "role", "--nocapture", "--test-threads", "1"])
        .env("COREFS_SERVE_ROLE", role)
        .env("COREFS_SERVE_SOCKET", socket)
        .env("COREFS_SERVE_ARG", arg)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(uid) = uid {
        use std::os::unix::process::CommandExt;
        cmd.uid(uid).gid(uid);
    }
    cmd.spawn().expect("spawn a client")
}

/// Waits for a client and requires it to have passed, showing what it printed.
fn passed(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.contains("ROLE PASSED"),
        "client failed ({}): {text}",
        out.status
    );
    text
}

/// The client roles (see the module doc).
#[test]
fn role() {
    let Ok(role) = std::env::var("COREFS_SERVE_ROLE") else {
        return;
    };
    let socket = PathBuf::from(std::env::var("COREFS_SERVE_SOCKET").unwrap());
    let arg = std::env::var("COREFS_SERVE_ARG").unwrap_or_default();
    match role.as_str() {
        "writer" => writer(&socket, arg.parse().unwrap()),
        "holder" => holder(&socket),
        "locker" => locker(&socket),
        "appender" => appender(&socket, arg.parse().unwrap()),
        "nobody" => nobody(&socket),
        other => panic!("no role {other}"),
    }
    println!("ROLE PASSED");
}

/// Writes its own file (3 MiB: more than one message), appends records to a shared file,
/// fsyncs, renames its file into place and reads everything back.
fn writer(socket: &Path, k: u64) {
    let fs = connect(socket);
    let data = pattern(k, 3 << 20 | 123);
    let fd = open(
        fs,
        &format!("/w{k}.tmp"),
        COREFS_O_CREAT | COREFS_O_RDWR,
        0o644,
    );
    assert!(fd > 0, "{}", last_error());
    assert_eq!(
        pwrite(fs, fd, &data, 0),
        data.len() as i64,
        "{}",
        last_error()
    );
    assert_eq!(corefs_fsync(fs, fd), 0);
    let shared = open(
        fs,
        "/shared",
        COREFS_O_CREAT | COREFS_O_WRONLY | COREFS_O_APPEND,
        0o644,
    );
    assert!(shared > 0, "{}", last_error());
    for r in 0..50u64 {
        let mut record = [0u8; 64];
        record[..8].copy_from_slice(&k.to_le_bytes());
        record[8..16].copy_from_slice(&r.to_le_bytes());
        assert_eq!(pwrite(fs, shared, &record, 0), 64);
    }
    {
        assert_eq!(corefs_fsync(fs, shared), 0);
        assert_eq!(corefs_release(fs, shared), 0);
    }
    let (from, to) = (c(&format!("/w{k}.tmp")), c(&format!("/w{k}")));
    // SAFETY: NUL-terminated paths.
    let rc = unsafe { corefs_rename(fs, from.as_ptr(), to.as_ptr(), 0) };
    assert_eq!(rc, 0);
    assert_eq!(
        pread(fs, fd, data.len() + 10, 0).unwrap(),
        data,
        "read back"
    );
    {
        assert_eq!(corefs_release(fs, fd), 0);
        assert_eq!(corefs_close(fs), 0);
    }
}

/// Opens a file, writes to it, unlinks it while open, says so, then waits to be killed.
fn holder(socket: &Path) {
    let fs = connect(socket);
    let fd = open(fs, "/orphan", COREFS_O_CREAT | COREFS_O_RDWR, 0o600);
    assert!(fd > 0, "{}", last_error());
    assert_eq!(pwrite(fs, fd, &pattern(7, 1 << 20), 0), 1 << 20);
    let p = c("/orphan");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { corefs_unlink(fs, p.as_ptr()) }, 0);
    println!("HOLDING");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

/// Appends 4 KiB records to its own file with an fdatasync after each, for `millis`
/// milliseconds; prints how many.
fn appender(socket: &Path, millis: u64) {
    let fs = connect(socket);
    let fd = open(
        fs,
        &format!("/log-{}", std::process::id()),
        COREFS_O_CREAT | COREFS_O_WRONLY | COREFS_O_APPEND,
        0o644,
    );
    assert!(fd > 0, "{}", last_error());
    let record = [0x61u8; 4096];
    let until = Instant::now() + Duration::from_millis(millis);
    let mut n = 0u64;
    while Instant::now() < until {
        assert_eq!(pwrite(fs, fd, &record, 0), 4096, "{}", last_error());
        assert_eq!(corefs_fdatasync(fs, fd), 0, "{}", last_error());
        n += 1;
    }
    println!("APPENDS {n}");
    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0);
}

/// Takes a write lock on /db's first 100 bytes, says so, then waits to be killed.
fn locker(socket: &Path) {
    let fs = connect(socket);
    let fd = open(fs, "/db", COREFS_O_RDWR, 0);
    assert!(fd > 0, "{}", last_error());
    assert_eq!(
        corefs_setlk(fs, fd, COREFS_LOCK_WRITE, 0, 100),
        0,
        "{}",
        last_error()
    );
    println!("LOCKED");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

/// As user nobody: what the kernel would refuse is refused, what it allows works.
fn nobody(socket: &Path) {
    let fs = connect(socket);
    let eacces = -(libc::EACCES as i64);
    let eperm = -(libc::EPERM as i64);
    assert_eq!(
        open(fs, "/secret", COREFS_O_RDONLY, 0),
        eacces,
        "root's 0600 file"
    );
    assert_eq!(
        open(fs, "/public", COREFS_O_RDWR, 0),
        eacces,
        "root's 0644 file for writing"
    );
    let public = open(fs, "/public", COREFS_O_RDONLY, 0);
    assert!(public > 0, "root's 0644 file for reading: {}", last_error());
    assert_eq!(pread(fs, public, 5, 0).unwrap(), b"hello");
    // Writing through a read-only handle is refused by the library before the server; the
    // server's own check is the fuzz test's.
    assert!(pwrite(fs, public, b"x", 0) < 0);
    assert_eq!(
        open(fs, "/closed/f", COREFS_O_RDONLY, 0),
        eacces,
        "a name under a directory nobody may search"
    );
    assert_eq!(
        open(fs, "/new", COREFS_O_CREAT | COREFS_O_RDWR, 0o644),
        eacces,
        "creating in root's 0755 root directory"
    );
    // Asking to create as root changes nothing: the file is nobody's.
    corefs_set_owner(fs, 0, 0);
    let mine = open(fs, "/tmp/mine", COREFS_O_CREAT | COREFS_O_RDWR, 0o600);
    assert!(mine > 0, "creating in a 1777 directory: {}", last_error());
    let st = stat(fs, "/tmp/mine").unwrap();
    assert_eq!((st.uid, st.gid), (NOBODY, NOBODY), "the creator's own ids");
    let (theirs, mine_path) = (c("/tmp/roots"), c("/tmp/mine"));
    // SAFETY: NUL-terminated paths.
    unsafe {
        assert_eq!(
            corefs_unlink(fs, theirs.as_ptr()) as i64,
            eperm,
            "root's file in a sticky directory"
        );
        assert_eq!(
            corefs_chmod(fs, theirs.as_ptr(), 0o666) as i64,
            eperm,
            "chmod of root's file"
        );
        assert_eq!(
            corefs_chmod(fs, mine_path.as_ptr(), 0o640),
            0,
            "chmod of mine"
        );
        // Renames, walked by the server in the request that renames: the kernel's checks
        // on both directories and the sticky bit.
        let rename = |from: &str, to: &str| {
            let (f, t) = (c(from), c(to));
            corefs_rename(fs, f.as_ptr(), t.as_ptr(), 0) as i64
        };
        assert_eq!(
            rename("/tmp/roots", "/tmp/taken"),
            eperm,
            "renaming root's file in a sticky directory"
        );
        assert_eq!(
            rename("/closed/f", "/closed/g"),
            eacces,
            "renaming under a directory nobody may search"
        );
        assert_eq!(
            rename("/tmp/mine", "/mine"),
            eacces,
            "renaming into root's 0755 root directory"
        );
        assert_eq!(rename("/tmp/mine", "/tmp/mine2"), 0, "renaming mine");
        assert_eq!(rename("/tmp/mine2", "/tmp/mine"), 0, "and back");
        assert_eq!(corefs_unlink(fs, mine_path.as_ptr()), 0, "removing mine");
        assert_eq!(corefs_release(fs, mine), 0);
        assert_eq!(corefs_release(fs, public), 0);
        assert_eq!(corefs_close(fs), 0);
    }
}

#[test]
fn several_processes_share_one_filesystem_through_the_service() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let writers: Vec<Child> = (1..=3)
        .map(|k| client("writer", &socket, &k.to_string(), None))
        .collect();
    for w in writers {
        passed(w);
    }
    // This process, a fourth client, sees every byte.
    let fs = connect(&socket);
    for k in 1..=3u64 {
        let fd = open(fs, &format!("/w{k}"), COREFS_O_RDONLY, 0);
        assert!(fd > 0, "{}", last_error());
        let want = pattern(k, 3 << 20 | 123);
        assert_eq!(pread(fs, fd, want.len() + 1, 0).unwrap(), want);
        assert_eq!(corefs_release(fs, fd), 0);
    }
    let shared = open(fs, "/shared", COREFS_O_RDONLY, 0);
    let records = pread(fs, shared, 1 << 20, 0).unwrap();
    assert_eq!(records.len(), 3 * 50 * 64, "every append landed once");
    let mut seen = std::collections::HashSet::new();
    for r in records.chunks(64) {
        let key = (
            u64::from_le_bytes(r[..8].try_into().unwrap()),
            u64::from_le_bytes(r[8..16].try_into().unwrap()),
        );
        assert!(seen.insert(key), "record {key:?} twice");
    }
    {
        assert_eq!(corefs_release(fs, shared), 0);
        assert_eq!(corefs_close(fs), 0);
    }
    server.stop();
    let report = run(corefs().args(["fsck", &device]));
    assert!(report.contains("clean"), "{report}");
    // The image, mounted in this process: everything there.
    let dev = c(&device);
    // SAFETY: a NUL-terminated device string; NULL options.
    let fs = unsafe { corefs_mount(dev.as_ptr(), std::ptr::null()) };
    assert!(fs > 0, "{}", last_error());
    assert_eq!(stat(fs, "/w2").unwrap().size, (3 << 20 | 123) as u64);
    assert_eq!(corefs_close(fs), 0);
}

#[test]
fn a_killed_client_releases_its_open_files_and_others_go_on() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let before = statfs(fs);
    let mut holder = client("holder", &socket, "", None);
    {
        use std::io::BufRead;
        let mut line = String::new();
        let mut out = std::io::BufReader::new(holder.stdout.take().unwrap());
        while !line.contains("HOLDING") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the holder ended early"
            );
        }
    }
    let held = statfs(fs);
    assert_eq!(
        held.inodes_used,
        before.inodes_used + 1,
        "the orphan exists"
    );
    assert_eq!(stat(fs, "/orphan").unwrap_err(), -(libc::ENOENT as i64));
    holder.kill().unwrap();
    holder.wait().unwrap();
    // The server sees the socket close and releases the orphan's hold: it goes.
    let started = Instant::now();
    while statfs(fs).inodes_used != before.inodes_used {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the killed client's open-unlinked file was not released"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("orphan released {:?} after the kill", started.elapsed());
    // This client was not disturbed.
    let fd = open(fs, "/after", COREFS_O_CREAT | COREFS_O_RDWR, 0o644);
    assert_eq!(pwrite(fs, fd, b"still here", 0), 10);
    {
        assert_eq!(corefs_fsync(fs, fd), 0);
        assert_eq!(corefs_release(fs, fd), 0);
        assert_eq!(corefs_close(fs), 0);
    }
    server.stop();
    let report = run(corefs().args(["fsck", &device]));
    assert!(report.contains("clean"), "{report}");
}

#[test]
fn a_killed_server_fails_calls_at_once_and_a_restart_has_every_fsynced_byte() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let data = pattern(42, 200_000);
    let fd = open(fs, "/durable", COREFS_O_CREAT | COREFS_O_RDWR, 0o644);
    assert_eq!(pwrite(fs, fd, &data, 0), data.len() as i64);
    assert_eq!(corefs_fsync(fs, fd), 0);
    let pid = server.pid();
    server.kill();
    let started = Instant::now();
    let err = pread(fs, fd, 10, 0).unwrap_err();
    let took = started.elapsed();
    assert_eq!(err, -(libc::ENOTCONN as i64), "{}", last_error());
    eprintln!("a call after the server (pid {pid}) was killed failed in {took:?}");
    // Every later call fails at once too.
    assert_eq!(stat(fs, "/durable").unwrap_err(), -(libc::ENOTCONN as i64));
    corefs_close(fs);
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let fd = open(fs, "/durable", COREFS_O_RDONLY, 0);
    assert!(fd > 0, "{}", last_error());
    assert_eq!(
        pread(fs, fd, data.len(), 0).unwrap(),
        data,
        "every fsynced byte"
    );
    {
        assert_eq!(corefs_release(fs, fd), 0);
        assert_eq!(corefs_close(fs), 0);
    }
    server.stop();
}

#[test]
fn another_user_gets_the_kernels_permission_answers() {
    assert!(
        is_root(),
        "this test runs a client as another user (nobody): run the tests as root \
         (scripts/test.sh does)"
    );
    let (work, device) = work_and_image("128MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let make = |path: &str, mode: u32, content: &[u8]| {
        let fd = open(fs, path, COREFS_O_CREAT | COREFS_O_WRONLY, mode);
        assert!(fd > 0, "{path}: {}", last_error());
        assert_eq!(pwrite(fs, fd, content, 0), content.len() as i64);
        assert_eq!(corefs_release(fs, fd), 0);
    };
    make("/secret", 0o600, b"s3cret");
    make("/public", 0o644, b"hello");
    let (tmp, closed) = (c("/tmp"), c("/closed"));
    // SAFETY: NUL-terminated paths.
    unsafe {
        assert_eq!(corefs_mkdir(fs, tmp.as_ptr(), 0o777), 0);
        assert_eq!(corefs_chmod(fs, tmp.as_ptr(), 0o1777), 0);
        assert_eq!(corefs_mkdir(fs, closed.as_ptr(), 0o700), 0);
    }
    make("/closed/f", 0o644, b"x");
    make("/tmp/roots", 0o666, b"r");
    passed(client("nobody", &socket, "", Some(NOBODY)));
    // Root's files are as they were.
    assert_eq!(stat(fs, "/tmp/roots").unwrap().mode & 0o7777, 0o666);
    assert_eq!(stat(fs, "/tmp/mine").unwrap_err(), -(libc::ENOENT as i64));
    assert_eq!(corefs_close(fs), 0);
    server.stop();
}

#[test]
fn a_killed_server_fails_a_waiting_call_quickly() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let fd = open(fs, "/busy", COREFS_O_CREAT | COREFS_O_RDWR, 0o644);
    assert!(fd > 0, "{}", last_error());
    let writing = std::thread::spawn(move || {
        let block = pattern(3, 64 << 10);
        let mut k = 0u64;
        loop {
            let n = pwrite(fs, fd, &block, (k % 64) * block.len() as u64);
            let rc = if n < 0 {
                n
            } else {
                corefs_fsync(fs, fd) as i64
            };
            if rc < 0 {
                return (rc, Instant::now(), k);
            }
            k += 1;
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    server.kill();
    let (rc, failed, writes) = writing.join().unwrap();
    assert_eq!(rc, -(libc::ENOTCONN as i64), "{}", last_error());
    let took = failed.saturating_duration_since(killed);
    eprintln!(
        "{writes} write+fsync pairs, then the kill: the call in flight failed {took:?} after it"
    );
    assert!(
        took < Duration::from_secs(5),
        "a call waited {took:?} on a dead server (the client looks every 20 ms)"
    );
    corefs_close(fs);
}

/// A client that writes its own ring entries: random and mutated requests, lengths past the
/// slot, state words moved at random, requests on inodes it never opened. The server must
/// answer every request it is given, stay up, and leave another client's file as it was.
/// `COREFS_SERVE_FUZZ_SEED` replays a run; `COREFS_SERVE_FUZZ_REQUESTS` makes it longer.
/// A root client's ring is served by the reactor itself.
#[test]
fn a_hostile_client_cannot_crash_the_server_or_touch_others_data() {
    fuzz_the_protocol(&[]);
}

/// As above, with every request through the connection's workers (how a non-root client's
/// requests are served).
#[test]
fn a_hostile_client_cannot_crash_the_servers_workers_either() {
    fuzz_the_protocol(&[("COREFS_SERVE_WORKERS", "1")]);
}

fn fuzz_the_protocol(server_env: &[(&str, &str)]) {
    use corefs::service::ring::{self, DONE, FREE, SLOTS, SUBMITTED};
    use rand::{Rng, SeedableRng};
    use reactor::{Op, OpenHow};
    use std::sync::atomic::Ordering;
    let seed: u64 = std::env::var("COREFS_SERVE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let requests: usize = std::env::var("COREFS_SERVE_FUZZ_REQUESTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    eprintln!(
        "protocol fuzz: seed {seed} ({requests} requests; COREFS_SERVE_FUZZ_SEED={seed} replays)"
    );
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start_with(&device, &socket, server_env);
    // Another client's file, which nothing the hostile one does may change.
    let fs = connect(&socket);
    let kept = pattern(9, 100_000);
    let fd = open(fs, "/kept", COREFS_O_CREAT | COREFS_O_RDWR, 0o600);
    assert_eq!(pwrite(fs, fd, &kept, 0), kept.len() as i64);
    assert_eq!(corefs_fsync(fs, fd), 0);
    let kept_ino = stat(fs, "/kept").unwrap().ino;

    let raw = corefs::service::connect_raw(&socket).unwrap();
    let (region, reactor_doorbell) = (&raw.region, &raw.reactor_doorbell);
    let arena = raw
        .arena
        .expect("the server maps this process's buffer arena");
    // The hostile client's own buffers in its arena: the places its requests name are in
    // them, or across or past the arena's end (refused), never another buffer of this process.
    const PLAY_BYTES: usize = 8 << 20;
    let play_at = arena
        .offset_of(arena.alloc(PLAY_BYTES).unwrap(), PLAY_BYTES)
        .unwrap();
    let place = |rng: &mut rand_xoshiro::Xoshiro256PlusPlus, len: u32| -> u64 {
        let len = u64::from(len);
        match rng.random_range(0..5) {
            0 => rng.random(),
            1 => (arena.size_bytes() as u64).saturating_sub(rng.random_range(0..len.max(1))),
            _ => play_at + rng.random_range(0..=(PLAY_BYTES as u64).saturating_sub(len)),
        }
    };
    let any_len = |rng: &mut rand_xoshiro::Xoshiro256PlusPlus| -> u32 {
        match rng.random_range(0..4) {
            0 => rng.random(),
            1 => (ring::DATA_BYTES_MAX + rng.random_range(0..3)) as u32,
            _ => rng.random_range(0..70_000),
        }
    };
    assert_eq!(
        reactor_doorbell.is_some(),
        server_env.is_empty(),
        "a root client's ring is the reactor's unless the server is told otherwise"
    );
    let name = |rng: &mut rand_xoshiro::Xoshiro256PlusPlus| -> Vec<u8> {
        let len = rng.random_range(0..300);
        (0..len).map(|_| rng.random_range(b'a'..=b'z')).collect()
    };
    let mut answered = [0u64; 2];
    for k in 0..requests {
        let ino = if rng.random_bool(0.5) {
            kept_ino
        } else {
            rng.random_range(0..2000)
        };
        let op = match rng.random_range(0..14) {
            0 => Op::Read {
                ino,
                offset: rng.random(),
                len: rng.random::<u32>() as usize,
            },
            1 => Op::Write {
                ino,
                offset: rng.random_range(0..1 << 20),
                data: vec![0xEE; rng.random_range(0..5000)].into(),
            },
            2 => Op::Release { ino },
            3 => Op::Fsync { ino },
            4 => Op::Truncate { ino, size: 0 },
            5 => Op::Readdir {
                dir: engine::inode::ROOT_INO,
                cookie: rng.random(),
                max: usize::MAX,
            },
            6 => Op::Walk {
                from: engine::inode::ROOT_INO,
                path: (0..rng.random_range(0..40))
                    .map(|_| name(&mut rng))
                    .collect(),
                then: Box::new(Op::Stat { ino: 0 }),
            },
            7 => Op::Open {
                dir: engine::inode::ROOT_INO,
                name: name(&mut rng),
                how: OpenHow {
                    create: rng
                        .random_bool(0.5)
                        .then_some((0o644, reactor::Owner::ROOT)),
                    writable: true,
                    readable: true,
                    ..Default::default()
                },
            },
            8 => Op::Hold { ino },
            9 => Op::WriteAtomic {
                ino,
                writes: vec![(0, vec![0xAA; 100])],
            },
            10 => Op::SetXattr {
                ino,
                name: name(&mut rng),
                value: vec![1; rng.random_range(0..70_000)],
                flags: Default::default(),
            },
            11 => Op::Stats,
            12 => Op::Walk {
                from: engine::inode::ROOT_INO,
                path: vec![b"kept".to_vec()],
                then: Box::new(Op::Read {
                    ino: 0,
                    offset: 0,
                    len: 10,
                }),
            },
            _ => Op::Lookup {
                dir: rng.random(),
                name: name(&mut rng),
            },
        };
        // A write whose bytes go beside its message: any length, past the slot's data area
        // too, with bytes in that area or not, or in the buffer arena, anywhere.
        let len = any_len(&mut rng);
        let beside = corefs::service::wire::Request::Write(corefs::service::wire::WriteBeside {
            ino,
            offset: rng.random_range(0..1 << 20),
            append: rng.random_bool(0.2),
            len,
            shared_at: rng.random_bool(0.3).then(|| place(&mut rng, len)),
        });
        let request = if rng.random_ratio(1, 10) {
            // Pieces of requests, kept by the server until a last piece that may never come,
            // may name another request or decode to nothing, to a piece, or to a write
            // whose bytes would be beside it.
            let len = rng.random_range(0..5000);
            corefs::service::wire::Request::Piece(corefs::service::wire::Piece {
                id: rng.random_range(0..100),
                last: rng.random_bool(0.5),
                bytes: match rng.random_range(0..4) {
                    0 | 1 => postcard::to_stdvec(&corefs::service::wire::Request::Op(op.clone()))
                        .unwrap_or_default(),
                    2 => postcard::to_stdvec(&beside).unwrap_or_default(),
                    _ => (0..len).map(|_| rng.random()).collect(),
                },
            })
        } else if rng.random_ratio(1, 8) {
            if rng.random_bool(0.7) {
                let fill = rng.random_range(0..=ring::DATA_BYTES_MAX);
                region.put_data(k % SLOTS, &vec![0xDD; fill]);
            }
            beside
        } else if rng.random_ratio(1, 8) {
            // A read into the buffer arena: anywhere, any length.
            let len = any_len(&mut rng);
            corefs::service::wire::Request::Read(corefs::service::wire::ReadShared {
                ino,
                offset: rng.random_range(0..1 << 20),
                len,
                at: place(&mut rng, len),
            })
        } else if rng.random_ratio(1, 8) {
            corefs::service::wire::Request::Lock(corefs::service::wire::LockRequest {
                ino,
                kind: match rng.random_range(0..3) {
                    0 => corefs::locks::Kind::Read,
                    1 => corefs::locks::Kind::Write,
                    _ => corefs::locks::Kind::Unlock,
                },
                start: rng.random(),
                len: rng.random(),
                test: rng.random_bool(0.3),
            })
        } else {
            corefs::service::wire::Request::Op(op.clone())
        };
        let mut bytes = postcard::to_stdvec(&request).unwrap_or_default();
        match rng.random_range(0..6) {
            0 => {
                for _ in 0..rng.random_range(1..8) {
                    if !bytes.is_empty() {
                        let at = rng.random_range(0..bytes.len());
                        bytes[at] = rng.random();
                    }
                }
            }
            1 => bytes.truncate(rng.random_range(0..bytes.len().max(1))),
            2 => {
                bytes = (0..rng.random_range(0..200))
                    .map(|_| rng.random())
                    .collect()
            }
            _ => {}
        }
        bytes.truncate(ring::PAYLOAD_BYTES);
        let i = k % SLOTS;
        let slot = region.slot(i);
        assert_eq!(slot.state.load(Ordering::Acquire), FREE);
        region.put(i, &bytes);
        if rng.random_ratio(1, 50) {
            // A length past the payload.
            slot.len
                .store(u32::MAX - rng.random_range(0..10), Ordering::Relaxed);
        }
        slot.state.store(SUBMITTED, Ordering::SeqCst);
        let h = region.header();
        h.doorbell.fetch_add(1, Ordering::SeqCst);
        ring::futex_wake(&h.doorbell, 1);
        if let Some(fd) = reactor_doorbell {
            if h.reactor_parked.load(Ordering::SeqCst) == 1 {
                reactor::ring_eventfd(std::os::fd::AsRawFd::as_raw_fd(fd));
            }
        }
        if rng.random_ratio(1, 100) {
            // Scribbles over the shared header: only this client's wake-ups can suffer.
            h.sleepers.store(rng.random(), Ordering::Relaxed);
        }
        let started = Instant::now();
        while slot.state.load(Ordering::Acquire) != DONE {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "request {k} (seed {seed}) was not answered: {op:?}"
            );
            slot.waiting.store(1, Ordering::SeqCst);
            let seen = slot.state.load(Ordering::SeqCst);
            if seen != DONE {
                ring::futex_wait(&slot.state, seen, Duration::from_millis(5));
            }
            slot.waiting.store(0, Ordering::Relaxed);
        }
        let answer = region
            .take(i)
            .map(|b| corefs::service::wire::decode_answer(&b).is_ok());
        answered[usize::from(answer == Some(true))] += 1;
        slot.state.store(FREE, Ordering::Release);
    }
    eprintln!(
        "protocol fuzz: {} requests answered with success, {} with an error",
        answered[1], answered[0]
    );
    // The other client's file is intact and the server serves on.
    assert_eq!(
        pread(fs, fd, kept.len() + 1, 0).unwrap(),
        kept,
        "seed {seed}"
    );
    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0);
    server.stop();
    let report = run(corefs().args(["fsck", &device]));
    assert!(report.contains("clean"), "seed {seed}: {report}");
}

#[test]
fn locks_reach_across_processes_and_go_with_a_killed_one() {
    let (work, device) = work_and_image("128MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let fd = open(fs, "/db", COREFS_O_CREAT | COREFS_O_RDWR, 0o644);
    assert!(fd > 0, "{}", last_error());
    let mut locker = client("locker", &socket, "", None);
    {
        use std::io::BufRead;
        let mut line = String::new();
        let mut out = std::io::BufReader::new(locker.stdout.take().unwrap());
        while !line.contains("LOCKED") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the locker ended early"
            );
        }
    }
    let eagain = -libc::EAGAIN;
    assert_eq!(
        corefs_setlk(fs, fd, COREFS_LOCK_READ, 50, 1),
        eagain,
        "inside its range"
    );
    assert_eq!(corefs_testlk(fs, fd, COREFS_LOCK_WRITE, 99, 10), 1);
    assert_eq!(
        corefs_setlk(fs, fd, COREFS_LOCK_WRITE, 100, 0),
        0,
        "past its range"
    );
    assert_eq!(corefs_testlk(fs, fd, COREFS_LOCK_READ, 0, 1), 1);
    // Another connection of this process is another owner too.
    let other = connect(&socket);
    let ofd = open(other, "/db", COREFS_O_RDWR, 0);
    assert_eq!(corefs_setlk(other, ofd, COREFS_LOCK_READ, 100, 1), eagain);
    locker.kill().unwrap();
    locker.wait().unwrap();
    // The killed process's lock goes with its connection.
    let started = Instant::now();
    while corefs_setlk(fs, fd, COREFS_LOCK_WRITE, 0, 100) != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the killed process's lock was not released: {}",
            last_error()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("lock released {:?} after the kill", started.elapsed());
    // Read-only handles take no write lock; unlocking gives the range to the other owner.
    let ro = open(fs, "/db", COREFS_O_RDONLY, 0);
    assert_eq!(corefs_setlk(fs, ro, COREFS_LOCK_WRITE, 0, 1), -libc::EBADF);
    assert_eq!(corefs_setlk(fs, fd, COREFS_LOCK_UNLOCK, 0, 0), 0);
    assert_eq!(corefs_setlk(other, ofd, COREFS_LOCK_WRITE, 0, 0), 0);
    for (f, h) in [(fs, fd), (fs, ro), (other, ofd)] {
        assert_eq!(corefs_release(f, h), 0);
    }
    assert_eq!(corefs_close(other), 0);
    assert_eq!(corefs_close(fs), 0);
    server.stop();
}

#[test]
fn top_shows_a_busy_client_and_the_reactors() {
    let (work, device) = work_and_image("128MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let fd = open(fs, "/log", COREFS_O_CREAT | COREFS_O_RDWR, 0o644);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writing = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // Every other write from a buffer of corefs_buf_alloc: moved in place.
            let heap = [7u8; 4096];
            let shared = corefs_buf_alloc(4096) as usize;
            let mut k = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: 4096 bytes from corefs_buf_alloc, this thread's alone.
                let arena = unsafe { std::slice::from_raw_parts(shared as *const u8, 4096) };
                let block = if k % 2 == 0 { &heap[..] } else { arena };
                assert_eq!(pwrite(fs, fd, block, (k % 256) * 4096), 4096);
                assert_eq!(corefs_fdatasync(fs, fd), 0);
                k += 1;
            }
            // SAFETY: from corefs_buf_alloc(4096), not used after.
            unsafe { corefs_buf_free(shared as *mut u8, 4096) };
        })
    };
    let out = run(corefs()
        .args(["top", "--once", "--json", "--interval", "0.5", "--socket"])
        .arg(&socket));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writing.join().unwrap();
    let view: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rates = &view["rates"];
    assert!(rates["reactor_ops_per_s"].as_f64().unwrap() > 0.0, "{out}");
    assert!(rates["fsyncs_per_s"].as_f64().unwrap() > 0.0, "{out}");
    let me = std::process::id() as i64;
    let clients = rates["clients"].as_array().unwrap();
    let mine = clients
        .iter()
        .find(|c| c["pid"].as_i64() == Some(me) && c["writes_per_s"].as_f64().unwrap() > 0.0)
        .unwrap_or_else(|| panic!("this process's connection is not in {out}"));
    let written = mine["written_mib_per_s"].as_f64().unwrap();
    let in_place = mine["in_place_mib_per_s"].as_f64().unwrap();
    assert!(written > 0.0);
    assert!(
        in_place > 0.0 && in_place < written,
        "half the writes are from an arena buffer: {out}"
    );
    assert!(mine["fsyncs_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(mine["open"].as_i64(), Some(1), "one file open");
    eprintln!(
        "corefs top --once --json: {}",
        serde_json::to_string(rates).unwrap()
    );
    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0);
    server.stop();
}

/// Four processes appending with fdatasync at once: their fsyncs meet in the server's
/// reactor and go to the device together (group commit across processes), which the
/// server's statistics show.
#[test]
fn fsyncs_of_several_processes_group_in_the_server() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let mut observer = corefs::service::Observer::connect(&socket).unwrap();
    let before = observer.sample().unwrap().reactors;
    let appenders: Vec<Child> = (0..4)
        .map(|_| client("appender", &socket, "1500", None))
        .collect();
    let mut appends = 0u64;
    for a in appenders {
        let out = passed(a);
        let n: u64 = out
            .lines()
            .find_map(|l| l.split("APPENDS ").nth(1))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no count in {out}"));
        appends += n;
    }
    let after = observer.sample().unwrap().reactors;
    let fsyncs = after.log.fsyncs - before.log.fsyncs;
    let groups = after.fsync_groups - before.fsync_groups;
    eprintln!(
        "4 processes x 1.5 s: {appends} appends+fdatasyncs, {fsyncs} fsyncs in {groups} groups \
         (mean {:.2}, largest {})",
        fsyncs as f64 / groups.max(1) as f64,
        after.fsync_group_max
    );
    assert!(fsyncs >= appends, "every fdatasync reached the reactor");
    assert!(
        after.fsync_group_max >= 2,
        "no two processes' fsyncs shared a group in {fsyncs} fsyncs"
    );
    drop(observer);
    server.stop();
}

/// `corefs_release` through a service does not wait for the server's answer (a create
/// through the C ABI was two round trips): yet every closed handle's hold goes, in order
/// with the calls after it as far as they can see — open-unlinked files closed one after
/// another (more than a thread may leave unanswered) all go, from a thread that goes on
/// calling and from one that ends right after its last close.
#[test]
fn closes_through_the_service_free_what_they_held_without_waiting() {
    let (work, device) = work_and_image("256MiB");
    let socket = work.path().join("corefs.sock");
    let server = Server::start(&device, &socket);
    let fs = connect(&socket);
    let before = statfs(fs);
    let orphans = |prefix: &str, count: usize| {
        for k in 0..count {
            let path = format!("/{prefix}{k}");
            let fd = open(
                fs,
                &path,
                COREFS_O_CREAT | COREFS_O_EXCL | COREFS_O_RDWR,
                0o600,
            );
            assert!(fd > 0, "open {path}: {fd} {}", last_error());
            assert_eq!(pwrite(fs, fd, &pattern(k as u64, 64 << 10), 0), 64 << 10);
            let p = c(&path);
            // SAFETY: a NUL-terminated path.
            let unlinked = unsafe { corefs_unlink(fs, p.as_ptr()) };
            assert_eq!(unlinked, 0, "{}", last_error());
            assert_eq!(corefs_release(fs, fd), 0, "{}", last_error());
        }
    };
    orphans("a", 40);
    // A thread that ends right after its last close: its posted releases still reach the
    // server and are answered before the thread is gone.
    std::thread::scope(|s| {
        s.spawn(|| orphans("b", 20));
    });
    let started = Instant::now();
    loop {
        let now = statfs(fs);
        // (Their blocks come back at the next commit: freed extents stay pinned until then.)
        if now.inodes_used == before.inodes_used {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "closed open-unlinked files were not released: {} inodes used (before {})",
            now.inodes_used,
            before.inodes_used,
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "60 orphans gone {:?} after the last close",
        started.elapsed()
    );
    assert_eq!(corefs_close(fs), 0);
    server.stop();
    let report = run(corefs().args(["fsck", &device]));
    assert!(report.contains("clean"), "{report}");
}
