//! POSIX as programs expect it, through the C functions: owners of new inodes (the process's
//! credentials, the mount's, a thread's), files open after their last name (also across a
//! crash), path rules (trailing slashes, `.` and `..`, non-UTF-8 names, limits), O_CREAT
//! racing another creator, atomic O_APPEND, EBADF on a read-only handle, long symlink
//! targets, 64 KiB xattrs and statfs's inode counts.

use corefs::abi::*;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Barrier};

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(path: &[u8]) -> CString {
    CString::new(path).expect("no NUL in a test path")
}

fn no_options() -> corefs_options {
    // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
    unsafe { std::mem::zeroed() }
}

fn mount_with(device: &str, o: &corefs_options) -> corefs_fs {
    let device = c(device.as_bytes());
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    fs
}

/// A fresh memory filesystem with `reactors` reactors over 4 shards.
fn fresh(reactors: u8) -> corefs_fs {
    fresh_on("mem:64MiB", reactors)
}

fn fresh_on(device: &str, reactors: u8) -> corefs_fs {
    let o = corefs_options {
        format: 1,
        shards: 4,
        reactors,
        ..no_options()
    };
    mount_with(device, &o)
}

fn close(fs: corefs_fs) {
    assert_eq!(corefs_close(fs), 0, "close: {}", last_error());
}

fn open(fs: corefs_fs, path: &[u8], flags: i32) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_open(fs, p.as_ptr(), flags, 0o644) }
}

fn open_ok(fs: corefs_fs, path: &[u8], flags: i32) -> corefs_fd {
    let fd = open(fs, path, flags);
    assert!(fd > 0, "open {:?}: {fd} {}", show(path), last_error());
    fd
}

fn create(fs: corefs_fs, path: &[u8]) -> corefs_fd {
    open_ok(fs, path, COREFS_O_CREAT | COREFS_O_RDWR)
}

fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

fn stat(fs: corefs_fs, path: &[u8]) -> Result<corefs_stat, i64> {
    let p = c(path);
    let mut st = corefs_stat::default();
    // SAFETY: a NUL-terminated path and a writable stat.
    let r = unsafe { corefs_stat(fs, p.as_ptr(), &mut st) };
    if r == 0 {
        Ok(st)
    } else {
        Err(r as i64)
    }
}

fn fstat(fs: corefs_fs, fd: corefs_fd) -> Result<corefs_stat, i64> {
    let mut st = corefs_stat::default();
    // SAFETY: a writable stat.
    let r = unsafe { corefs_fstat(fs, fd, &mut st) };
    if r == 0 {
        Ok(st)
    } else {
        Err(r as i64)
    }
}

fn statfs(fs: corefs_fs) -> corefs_statfs {
    let mut s = corefs_statfs::default();
    // SAFETY: a writable corefs_statfs.
    assert_eq!(unsafe { corefs_statfs(fs, &mut s) }, 0, "{}", last_error());
    s
}

fn mkdir(fs: corefs_fs, path: &[u8]) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_mkdir(fs, p.as_ptr(), 0o755) as i64 }
}

fn rmdir(fs: corefs_fs, path: &[u8]) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_rmdir(fs, p.as_ptr()) as i64 }
}

fn unlink(fs: corefs_fs, path: &[u8]) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_unlink(fs, p.as_ptr()) as i64 }
}

fn rename(fs: corefs_fs, from: &[u8], to: &[u8]) -> i64 {
    let (from, to) = (c(from), c(to));
    // SAFETY: NUL-terminated paths.
    unsafe { corefs_rename(fs, from.as_ptr(), to.as_ptr(), 0) as i64 }
}

fn link(fs: corefs_fs, existing: &[u8], path: &[u8]) -> i64 {
    let (existing, path) = (c(existing), c(path));
    // SAFETY: NUL-terminated paths.
    unsafe { corefs_link(fs, existing.as_ptr(), path.as_ptr()) as i64 }
}

fn symlink(fs: corefs_fs, target: &[u8], path: &[u8]) -> i64 {
    let (target, path) = (c(target), c(path));
    // SAFETY: NUL-terminated strings.
    unsafe { corefs_symlink(fs, target.as_ptr(), path.as_ptr()) as i64 }
}

fn pwrite(fs: corefs_fs, fd: corefs_fd, data: &[u8], offset: u64) -> i64 {
    // SAFETY: `data` is valid for its length.
    unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), offset) }
}

fn pread(fs: corefs_fs, fd: corefs_fd, len: usize, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: `buf` is valid for `len` bytes.
    let n = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), len, offset) };
    assert!(n >= 0, "pread: {n} {}", last_error());
    buf.truncate(n as usize);
    buf
}

fn release(fs: corefs_fs, fd: corefs_fd) {
    assert_eq!(corefs_release(fs, fd), 0, "release: {}", last_error());
}

/// Every name in directory `path`, byte for byte.
fn names(fs: corefs_fs, path: &[u8]) -> Vec<Vec<u8>> {
    let p = c(path);
    let mut out = Vec::new();
    let mut cookie = 0;
    loop {
        // SAFETY: all-zero entries are valid.
        let mut entries: Vec<corefs_dirent> =
            (0..16).map(|_| unsafe { std::mem::zeroed() }).collect();
        // SAFETY: a NUL-terminated path and 16 writable entries.
        let n = unsafe { corefs_readdir(fs, p.as_ptr(), cookie, entries.as_mut_ptr(), 16) };
        assert!(n >= 0, "readdir: {n} {}", last_error());
        if n == 0 {
            break;
        }
        for e in &entries[..n as usize] {
            out.push(e.name[..e.name_len as usize].to_vec());
            cookie = e.cookie;
        }
    }
    out.sort();
    out
}

const fn err(errno: i32) -> i64 {
    -(errno as i64)
}

// ---- Owners --------------------------------------------------------------------------------

fn owner_of(fs: corefs_fs, path: &[u8]) -> (u32, u32) {
    let st = stat(fs, path).unwrap_or_else(|e| panic!("stat {}: {e}", show(path)));
    (st.uid, st.gid)
}

/// Creates a file, a directory and a symlink named `prefix`-*; returns their owners.
fn make_three(fs: corefs_fs, prefix: &str) -> [(u32, u32); 3] {
    let (f, d, s) = (
        format!("{prefix}-f"),
        format!("{prefix}-d"),
        format!("{prefix}-s"),
    );
    release(fs, create(fs, f.as_bytes()));
    assert_eq!(mkdir(fs, d.as_bytes()), 0, "{}", last_error());
    assert_eq!(symlink(fs, b"t", s.as_bytes()), 0, "{}", last_error());
    [
        owner_of(fs, f.as_bytes()),
        owner_of(fs, d.as_bytes()),
        owner_of(fs, s.as_bytes()),
    ]
}

#[test]
fn new_inodes_belong_to_the_process_the_mount_or_the_thread() {
    // SAFETY: geteuid and getegid cannot fail.
    let me = unsafe { (libc::geteuid(), libc::getegid()) };
    let fs = fresh(1);
    assert_eq!(make_three(fs, "process"), [me; 3]);

    // Per thread: this thread's setting, not another's; either id alone; then back.
    assert_eq!(corefs_set_owner(fs, 1001, 2002), 0, "{}", last_error());
    assert_eq!(make_three(fs, "thread"), [(1001, 2002); 3]);
    std::thread::spawn(move || assert_eq!(make_three(fs, "other"), [me; 3]))
        .join()
        .unwrap();
    assert_eq!(corefs_set_owner(fs, COREFS_OWNER_DEFAULT, 3003), 0);
    assert_eq!(make_three(fs, "gid-only"), [(me.0, 3003); 3]);
    assert_eq!(
        corefs_set_owner(fs, COREFS_OWNER_DEFAULT, COREFS_OWNER_DEFAULT),
        0
    );
    assert_eq!(make_three(fs, "back"), [me; 3]);
    assert_eq!(corefs_set_owner(fs + 1000, 1, 1) as i64, err(libc::EBADF));
    close(fs);

    // Per mount: root (0:0 is a value, not "unset", once owner_set says so), then another.
    for owner in [(0, 0), (4242, 4343)] {
        let o = corefs_options {
            format: 1,
            shards: 4,
            owner_set: 1,
            owner_uid: owner.0,
            owner_gid: owner.1,
            ..no_options()
        };
        let fs = mount_with("mem:64MiB", &o);
        assert_eq!(make_three(fs, "mount"), [owner; 3]);
        // A thread's setting beats the mount's.
        assert_eq!(corefs_set_owner(fs, 7, COREFS_OWNER_DEFAULT), 0);
        assert_eq!(make_three(fs, "mixed"), [(7, owner.1); 3]);
        close(fs);
    }
}

// ---- Files open after their last name ------------------------------------------------------

fn unlinked_files_live_while_open(reactors: u8) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let device = format!("file:{}/open.img,size=64MiB", dir.path().display());
    let fs = fresh_on(&device, reactors);
    let base = statfs(fs).inodes_used;
    let data = vec![0x5au8; 20_000];
    // Unlinked while open: every handle call goes on working, fstat says nlink 0.
    let fd = create(fs, b"victim");
    let other = open_ok(fs, b"victim", COREFS_O_RDONLY);
    assert_eq!(pwrite(fs, fd, &data, 0), data.len() as i64);
    assert_eq!(unlink(fs, b"victim"), 0, "{}", last_error());
    assert_eq!(stat(fs, b"victim").unwrap_err(), err(libc::ENOENT));
    let st = fstat(fs, fd).expect("fstat after unlink");
    assert_eq!((st.nlink, st.size), (0, 20_000));
    assert_eq!(pread(fs, other, data.len(), 0), data);
    assert_eq!(pwrite(fs, fd, b"more", 20_000), 4);
    assert_eq!(corefs_fsync(fs, fd), 0, "{}", last_error());
    assert_eq!(corefs_ftruncate(fs, fd, 100), 0, "{}", last_error());
    assert_eq!(statfs(fs).inodes_used, base + 1, "the orphan is counted");
    // The first release keeps it (another handle holds it), the last deletes it.
    release(fs, fd);
    assert_eq!(pread(fs, other, 200, 0), &data[..100]);
    release(fs, other);
    assert_eq!(statfs(fs).inodes_used, base, "the last release deletes it");

    // Renamed over while open: the old file lives on through its handle.
    let fd = create(fs, b"old");
    assert_eq!(pwrite(fs, fd, b"old contents", 0), 12);
    release(fs, create(fs, b"new"));
    assert_eq!(rename(fs, b"new", b"old"), 0, "{}", last_error());
    assert_eq!(fstat(fs, fd).unwrap().nlink, 0);
    assert_eq!(pread(fs, fd, 100, 0), b"old contents");
    release(fs, fd);
    assert_eq!(statfs(fs).inodes_used, base + 1, "only the new one is left");

    // An open directory removed: fstat works and says nlink 0.
    assert_eq!(mkdir(fs, b"dir"), 0);
    let dfd = open_ok(fs, b"dir", COREFS_O_RDONLY | COREFS_O_DIRECTORY);
    assert_eq!(rmdir(fs, b"dir"), 0, "{}", last_error());
    assert_eq!(
        fstat(fs, dfd).expect("fstat of a removed directory").nlink,
        0
    );
    release(fs, dfd);
    assert_eq!(statfs(fs).inodes_used, base + 1);

    // Closing the filesystem releases what is still open: the remount finds nothing left.
    let fd = create(fs, b"left-open");
    assert_eq!(pwrite(fs, fd, &data, 0), data.len() as i64);
    assert_eq!(unlink(fs, b"left-open"), 0);
    assert_eq!(statfs(fs).inodes_used, base + 2);
    close(fs);
    // The image holds no orphan: a mount that deleted one would commit (a new generation).
    let mut dev = nvme::open_device(&device, &nvme::OpenOptions::default()).unwrap();
    let closed = engine::inspect::current_superblock(&mut *dev)
        .unwrap()
        .generation;
    let engine = engine::Filesystem::mount(dev, engine::MountOptions::default()).unwrap();
    assert_eq!(
        engine.durable_generation(),
        closed,
        "the mount deleted an orphan"
    );
    engine.unmount().unwrap();
    let fs = mount_with(&device, &no_options());
    assert_eq!(statfs(fs).inodes_used, base + 1);
    assert_eq!(names(fs, b"/"), vec![b"old".to_vec()]);
    close(fs);
}

#[test]
fn an_unlinked_file_lives_while_a_handle_holds_it() {
    unlinked_files_live_while_open(1);
}

#[test]
fn an_unlinked_file_lives_while_a_handle_holds_it_with_two_reactors() {
    unlinked_files_live_while_open(2);
}

/// The crash half of [`an_unlinked_open_file_is_gone_after_a_crash`], run in a child process
/// (this test binary again): mounts `device` (a simulated volatile cache: the process dying is
/// a power cut), unlinks a file it holds open, fsyncs through the handle and dies without
/// closing anything. Exits 42 when everything before the crash was as expected.
fn crash_child(device: &str) -> ! {
    let o = corefs_options {
        format: 1,
        shards: 4,
        // No periodic commit before the crash: the mount after it replays the log.
        commit_interval_ms: 3_600_000,
        ..no_options()
    };
    let fs = mount_with(device, &o);
    let fd = create(fs, b"doomed");
    let data = vec![7u8; 300_000];
    assert_eq!(pwrite(fs, fd, &data, 0), data.len() as i64);
    assert_eq!(corefs_fsync(fs, fd), 0);
    let keep = create(fs, b"kept");
    assert_eq!(pwrite(fs, keep, b"kept", 0), 4);
    assert_eq!(corefs_fsync(fs, keep), 0);
    assert_eq!(unlink(fs, b"doomed"), 0);
    assert_eq!(fstat(fs, fd).unwrap().nlink, 0);
    assert_eq!(pwrite(fs, fd, b"after", 300_000), 5);
    // Makes the unlink durable (the orphan is logged with the file).
    assert_eq!(corefs_fsync(fs, fd), 0, "{}", last_error());
    assert_eq!(pread(fs, fd, 5, 300_000), b"after");
    // SAFETY: _exit ends the process at once: no close, no destructor, no flush.
    unsafe { libc::_exit(42) }
}

#[test]
fn an_unlinked_open_file_is_gone_after_a_crash() {
    if let Ok(device) = std::env::var("COREFS_TEST_CRASH_CHILD") {
        crash_child(&device);
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let image = dir.path().join("crash.img");
    let device = format!("file:{},size=64MiB", image.display());
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_unlinked_open_file_is_gone_after_a_crash",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "COREFS_TEST_CRASH_CHILD",
            format!("{device},cache=volatile"),
        )
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(42), "the child before its crash");

    let fs = mount_with(&device, &no_options());
    assert_eq!(stat(fs, b"doomed").unwrap_err(), err(libc::ENOENT));
    let keep = open_ok(fs, b"kept", COREFS_O_RDONLY);
    assert_eq!(pread(fs, keep, 10, 0), b"kept");
    release(fs, keep);
    // The root and "kept": the orphan was deleted by the mount.
    assert_eq!(statfs(fs).inodes_used, 2);
    close(fs);

    // fsck: the image is consistent, and holds no orphan.
    let dev = nvme::open_device(&device, &nvme::OpenOptions::default()).unwrap();
    let mut engine = engine::Filesystem::mount(dev, engine::MountOptions::default()).unwrap();
    let report = engine.check().expect("fsck after the crash");
    assert_eq!(report.inodes, 2, "{report:?}");
    engine.unmount().unwrap();
}

// ---- Path rules ----------------------------------------------------------------------------

/// A tree: file `f`, directory `d` holding file `g`.
fn tree() -> corefs_fs {
    let fs = fresh(1);
    release(fs, create(fs, b"f"));
    assert_eq!(mkdir(fs, b"d"), 0);
    release(fs, create(fs, b"d/g"));
    fs
}

#[test]
fn trailing_slashes_dots_and_limits_follow_linux() {
    let fs = tree();
    let ino = |p: &[u8]| stat(fs, p).map(|s| s.ino);
    let (root, f, d, g) = (
        ino(b"/").unwrap(),
        ino(b"f").unwrap(),
        ino(b"d").unwrap(),
        ino(b"d/g").unwrap(),
    );
    let (enotdir, eisdir, enoent, eexist) = (
        err(libc::ENOTDIR),
        err(libc::EISDIR),
        err(libc::ENOENT),
        err(libc::EEXIST),
    );
    // What each path names (Ok: the inode), or its error.
    let lookups: &[(&[u8], Result<u64, i64>)] = &[
        (b"f/", Err(enotdir)),
        (b"f/.", Err(enotdir)),
        (b"f/..", Err(enotdir)),
        (b"d/g/", Err(enotdir)),
        (b"d/g/..", Err(enotdir)),
        (b"d/", Ok(d)),
        (b"d//", Ok(d)),
        (b"d/.", Ok(d)),
        (b"d/./g", Ok(g)),
        (b"./d/./g", Ok(g)),
        (b"d/../f", Ok(f)),
        (b"d/../d/g", Ok(g)),
        (b"/..", Ok(root)),
        (b"..", Ok(root)),
        (b"/../../f", Ok(f)),
        (b"d/..", Ok(root)),
        (b".", Ok(root)),
        (b"/", Ok(root)),
        (b"x/..", Err(enoent)),
        (b"", Err(enoent)),
    ];
    for (path, want) in lookups {
        assert_eq!(ino(path), *want, "stat {:?}", show(path));
        let fd = open(fs, path, COREFS_O_RDONLY);
        match want {
            Ok(i) => {
                assert!(fd > 0, "open {:?}: {fd} {}", show(path), last_error());
                assert_eq!(fstat(fs, fd).unwrap().ino, *i);
                release(fs, fd);
            }
            Err(e) => assert_eq!(fd, *e, "open {:?}", show(path)),
        }
    }
    // O_CREAT with a trailing slash, or on a directory: EISDIR (O_EXCL: EEXIST).
    let creat = COREFS_O_CREAT | COREFS_O_RDWR;
    for (path, flags, want) in [
        (&b"f/"[..], creat, eisdir),
        (b"new/", creat, eisdir),
        (b"d", COREFS_O_CREAT | COREFS_O_RDONLY, eisdir),
        (b"d/..", creat, eisdir),
        (b"/", creat | COREFS_O_EXCL, eexist),
        (b"f/.", creat, enotdir),
        (b"f/new", creat, enotdir),
    ] {
        assert_eq!(
            open(fs, path, flags),
            want,
            "open(O_CREAT) {:?}",
            show(path)
        );
    }
    assert_eq!(ino(b"new"), Err(enoent));
    // Name calls on `x/`: unlink and rename refuse a file, mkdir and rmdir take a directory.
    assert_eq!(unlink(fs, b"f/"), enotdir);
    assert_eq!(unlink(fs, b"d/"), eisdir);
    assert_eq!(unlink(fs, b"nothing/"), enoent);
    assert_eq!(unlink(fs, b"."), eisdir);
    assert_eq!(unlink(fs, b"/"), eisdir);
    assert_eq!(rename(fs, b"f/", b"h"), enotdir);
    assert_eq!(rename(fs, b"f", b"h/"), enotdir);
    assert_eq!(rename(fs, b"d/..", b"h"), err(libc::EBUSY));
    assert_eq!(rename(fs, b"f", b"."), err(libc::EBUSY));
    assert_eq!(ino(b"f"), Ok(f), "f survived");
    assert_eq!(rename(fs, b"d/", b"e/"), 0, "{}", last_error());
    assert_eq!(ino(b"e/g"), Ok(g));
    assert_eq!(rename(fs, b"e/.", b"d"), err(libc::EBUSY));
    assert_eq!(rename(fs, b"e/", b"d"), 0, "{}", last_error());
    assert_eq!(mkdir(fs, b"m/"), 0, "{}", last_error());
    assert_eq!(mkdir(fs, b"d/../m2//"), 0, "{}", last_error());
    assert_eq!(ino(b"m2/").map(|_| ()), Ok(()));
    assert_eq!(rmdir(fs, b"m/"), 0, "{}", last_error());
    assert_eq!(rmdir(fs, b"./m2/"), 0, "{}", last_error());
    assert_eq!(mkdir(fs, b"."), eexist);
    assert_eq!(mkdir(fs, b"/"), eexist);
    assert_eq!(mkdir(fs, b"d/.."), eexist);
    assert_eq!(mkdir(fs, b"f/x"), enotdir);
    assert_eq!(rmdir(fs, b"/"), err(libc::EBUSY));
    assert_eq!(rmdir(fs, b"d/."), err(libc::EINVAL));
    assert_eq!(rmdir(fs, b"d/.."), err(libc::ENOTEMPTY));
    assert_eq!(rmdir(fs, b"f/"), enotdir);
    assert_eq!(link(fs, b"f", b"l/"), enoent);
    assert_eq!(link(fs, b"f", b"d/"), eexist);
    assert_eq!(link(fs, b"f/", b"l"), enotdir);
    assert_eq!(link(fs, b"d/../f", b"d/./l"), 0, "{}", last_error());
    assert_eq!(ino(b"d/l"), Ok(f));
    assert_eq!(symlink(fs, b"t", b"s/"), enoent);
    assert_eq!(symlink(fs, b"t", b".."), eexist);
    assert_eq!(symlink(fs, b"", b"s"), enoent);
    assert_eq!(ino(b"f"), Ok(f));

    // Limits: a 255-byte name works, 256 is ENAMETOOLONG, and so is a path of 4096 bytes.
    let name255 = vec![b'n'; 255];
    release(fs, create(fs, &name255));
    assert_eq!(ino(&name255).map(|_| ()), Ok(()));
    let name256 = vec![b'n'; 256];
    assert_eq!(
        open(fs, &name256, COREFS_O_CREAT | COREFS_O_RDWR),
        err(libc::ENAMETOOLONG)
    );
    assert_eq!(ino(&name256), Err(err(libc::ENAMETOOLONG)));
    let mut long = b"/".repeat(4095 - 1);
    long.push(b'f');
    assert_eq!(ino(&long), Ok(f), "4095 bytes is a path");
    long.insert(0, b'/');
    assert_eq!(ino(&long), Err(err(libc::ENAMETOOLONG)));
    close(fs);
}

#[test]
fn names_are_bytes_not_utf8() {
    let fs = tree();
    let names_in = [
        &b"\xff\xfe latin-1 \xe9"[..],
        b"\xc3(",
        b"caf\xc3\xa9",
        b"\x80",
    ];
    for name in names_in {
        release(fs, create(fs, name));
        let mut inner = b"d/".to_vec();
        inner.extend_from_slice(name);
        assert_eq!(
            mkdir(fs, &[name, &b".dir"[..]].concat()),
            0,
            "{}",
            last_error()
        );
        assert_eq!(symlink(fs, name, &inner), 0, "{}", last_error());
    }
    let mut want: Vec<Vec<u8>> = names_in.iter().map(|n| n.to_vec()).collect();
    want.extend(names_in.iter().map(|n| [n, &b".dir"[..]].concat()));
    want.extend([b"d".to_vec(), b"f".to_vec()]);
    want.sort();
    assert_eq!(names(fs, b"/"), want, "readdir of / is byte-exact");
    // Symlink targets, paths through non-UTF-8 directories, `..` out of them, xattr names.
    let link = b"d/\xff\xfe latin-1 \xe9";
    let mut target = [0u8; 64];
    let p = c(link);
    // SAFETY: a NUL-terminated path and a 64-byte buffer.
    let n = unsafe { corefs_readlink(fs, p.as_ptr(), target.as_mut_ptr(), 64) };
    assert_eq!(&target[..n as usize], &link[2..]);
    release(fs, create(fs, b"\x80.dir/inner"));
    assert_eq!(
        stat(fs, b"\x80.dir/../\x80.dir/./inner").map(|_| ()),
        Ok(())
    );
    assert_eq!(rename(fs, b"\x80.dir/inner", b"\xc3(.dir/\xfe"), 0);
    assert_eq!(names(fs, b"\xc3(.dir"), vec![b"\xfe".to_vec()]);
    let (path, name) = (c(b"\xc3("), c(b"user.\xff"));
    // SAFETY: NUL-terminated strings and a 1-byte value.
    unsafe {
        assert_eq!(
            corefs_setxattr(fs, path.as_ptr(), name.as_ptr(), b"v".as_ptr(), 1, 0),
            0,
            "{}",
            last_error()
        );
        let mut list = [0u8; 64];
        let n = corefs_listxattr(fs, path.as_ptr(), list.as_mut_ptr(), 64);
        assert_eq!(&list[..n as usize], b"user.\xff\0");
    }
    assert_eq!(unlink(fs, b"\xff\xfe latin-1 \xe9"), 0);
    assert_eq!(rmdir(fs, b"\xc3(.dir/"), err(libc::ENOTEMPTY));
    close(fs);
}

// ---- Creation races, appends, read-only handles --------------------------------------------

#[test]
fn o_creat_racing_another_creator_opens_the_same_file() {
    for reactors in [1, 2] {
        let fs = fresh(reactors);
        let rounds = 300;
        let barrier = Arc::new(Barrier::new(2));
        let racer = |barrier: Arc<Barrier>| {
            move || {
                // Failures are collected, not asserted here: a panicking thread would leave
                // the other waiting at the barrier for ever.
                let mut inos = Vec::new();
                for i in 0..rounds {
                    let name = format!("race-{i}");
                    barrier.wait();
                    let fd = open(fs, name.as_bytes(), COREFS_O_CREAT | COREFS_O_RDWR);
                    if fd < 0 {
                        inos.push(Err(format!("open {name}: {fd} {}", last_error())));
                        continue;
                    }
                    inos.push(fstat(fs, fd).map_err(|e| format!("fstat {name}: {e}")));
                    release(fs, fd);
                }
                inos
            }
        };
        let a = std::thread::spawn(racer(barrier.clone()));
        let b = std::thread::spawn(racer(barrier));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let failed: Vec<&String> = a
            .iter()
            .chain(&b)
            .filter_map(|r| r.as_ref().err())
            .collect();
        assert!(
            failed.is_empty(),
            "{} of {} opens failed, the first: {}",
            failed.len(),
            2 * rounds,
            failed[0]
        );
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(a.ino, b.ino, "round {i}: both opened the same file");
        }
        assert_eq!(names(fs, b"/").len(), rounds);
        close(fs);
    }
}

#[test]
fn o_creat_racing_an_unlink_never_fails() {
    // The open finds the file, the unlink deletes it before the open holds it: the open
    // must start over (and create it), not report ENOENT, which O_CREAT never gives.
    for reactors in [1, 2] {
        let fs = fresh(reactors);
        let rounds = 2000;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let unlinker = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut removed = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    removed += (unlink(fs, b"x") == 0) as u32;
                }
                removed
            })
        };
        let mut failed = Vec::new();
        for _ in 0..rounds {
            let fd = open(fs, b"x", COREFS_O_CREAT | COREFS_O_RDWR);
            if fd < 0 {
                failed.push(format!("{fd} {}", last_error()));
                continue;
            }
            if let Err(e) = fstat(fs, fd) {
                failed.push(format!("fstat: {e}"));
            }
            release(fs, fd);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let removed = unlinker.join().unwrap();
        assert!(
            failed.is_empty(),
            "{reactors} reactors: {} of {rounds} opens failed, the first: {}",
            failed.len(),
            failed[0]
        );
        assert!(removed > 0, "the unlinker never ran");
        close(fs);
    }
}

#[test]
fn appends_through_o_append_handles_never_overlap() {
    const RECORD: usize = 64;
    const PER_THREAD: usize = 400;
    for reactors in [1, 2] {
        let fs = fresh(reactors);
        release(fs, create(fs, b"log"));
        let barrier = Arc::new(Barrier::new(2));
        let appender = |tag: u8, barrier: Arc<Barrier>| {
            move || {
                // Before anything that can panic: the other thread must not wait for ever.
                barrier.wait();
                let fd = open_ok(fs, b"log", COREFS_O_WRONLY | COREFS_O_APPEND);
                for seq in 0..PER_THREAD as u32 {
                    let mut record = vec![tag; RECORD];
                    record[1..5].copy_from_slice(&seq.to_le_bytes());
                    // The offset is ignored: every write goes at the end.
                    assert_eq!(pwrite(fs, fd, &record, 0), RECORD as i64);
                }
                release(fs, fd);
            }
        };
        let a = std::thread::spawn(appender(b'a', barrier.clone()));
        let b = std::thread::spawn(appender(b'b', barrier));
        a.join().unwrap();
        b.join().unwrap();
        let fd = open_ok(fs, b"log", COREFS_O_RDONLY);
        let all = pread(fs, fd, 2 * PER_THREAD * RECORD + 1, 0);
        assert_eq!(all.len(), 2 * PER_THREAD * RECORD, "no append lost");
        let mut next = [0u32; 2];
        for record in all.chunks(RECORD) {
            let tag = record[0];
            assert!(tag == b'a' || tag == b'b', "a torn record {record:?}");
            assert!(record[5..].iter().all(|&x| x == tag), "a torn record");
            let seq = u32::from_le_bytes(record[1..5].try_into().unwrap());
            let n = &mut next[(tag - b'a') as usize];
            assert_eq!(seq, *n, "thread {} in order, each once", tag as char);
            *n += 1;
        }
        release(fs, fd);

        // Asynchronous writes through an O_APPEND handle append too.
        let fd = open_ok(fs, b"log", COREFS_O_RDWR | COREFS_O_APPEND);
        // SAFETY: the buffer is static; the completion is polled below.
        unsafe {
            assert_eq!(corefs_submit_pwrite(fs, fd, b"tail".as_ptr(), 4, 0, 7), 0);
            let mut done = [corefs_completion::default(); 1];
            assert_eq!(corefs_poll(fs, done.as_mut_ptr(), 1, 10_000_000), 1);
            assert_eq!((done[0].token, done[0].result), (7, 4));
        }
        let end = (2 * PER_THREAD * RECORD) as u64;
        assert_eq!(pread(fs, fd, 10, end), b"tail");
        release(fs, fd);
        close(fs);
    }
}

#[test]
fn a_read_only_handle_refuses_every_change() {
    let fs = tree();
    let fd = open_ok(fs, b"f", COREFS_O_RDONLY);
    let ebadf = err(libc::EBADF);
    assert_eq!(corefs_fallocate(fs, fd, 0, 0, 4096) as i64, ebadf);
    assert_eq!(
        corefs_fallocate(
            fs,
            fd,
            COREFS_FALLOC_PUNCH_HOLE | COREFS_FALLOC_KEEP_SIZE,
            0,
            1
        ) as i64,
        ebadf
    );
    assert_eq!(corefs_ftruncate(fs, fd, 10) as i64, ebadf);
    assert_eq!(pwrite(fs, fd, b"x", 0), ebadf);
    assert_eq!(fstat(fs, fd).unwrap().size, 0, "nothing changed");
    release(fs, fd);
    close(fs);
}

// ---- Limits and statfs ---------------------------------------------------------------------

#[test]
fn long_symlinks_and_64_kib_xattrs_pass_through_and_e2big_beyond() {
    let fs = tree();
    let target: Vec<u8> = (0..4095).map(|i| b'a' + (i % 26) as u8).collect();
    assert_eq!(symlink(fs, &target, b"long"), 0, "{}", last_error());
    let mut back = vec![0u8; 5000];
    let p = c(b"long");
    // SAFETY: a NUL-terminated path and a 5000-byte buffer.
    let n = unsafe { corefs_readlink(fs, p.as_ptr(), back.as_mut_ptr(), back.len()) };
    assert_eq!(&back[..n as usize], &target[..]);
    let too_long = [&target[..], b"z"].concat();
    assert_eq!(symlink(fs, &too_long, b"longer"), err(libc::ENAMETOOLONG));

    let (path, name) = (c(b"f"), c(b"user.big"));
    let value: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: NUL-terminated strings; every buffer is valid for the length passed.
    unsafe {
        let set = |v: &[u8]| {
            corefs_setxattr(fs, path.as_ptr(), name.as_ptr(), v.as_ptr(), v.len(), 0) as i64
        };
        assert_eq!(set(&value), 0, "{}", last_error());
        assert_eq!(set(&[&value[..], b"!"].concat()), err(libc::E2BIG));
        let get = |buf: &mut [u8]| {
            corefs_getxattr(
                fs,
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        assert_eq!(get(&mut []), 65536, "the size");
        let mut small = vec![0u8; 100];
        assert_eq!(get(&mut small), err(libc::ERANGE), "a buffer too small");
        let mut whole = vec![0u8; 70000];
        assert_eq!(get(&mut whole), 65536);
        assert_eq!(&whole[..65536], &value[..]);
        let mut list = [0u8; 4];
        assert_eq!(
            corefs_listxattr(fs, path.as_ptr(), list.as_mut_ptr(), list.len()),
            err(libc::ERANGE)
        );
        let long_name = c(&[b'u'; 256]);
        assert_eq!(
            corefs_setxattr(fs, path.as_ptr(), long_name.as_ptr(), b"v".as_ptr(), 1, 0) as i64,
            err(libc::ERANGE)
        );
    }
    close(fs);
}

#[test]
fn statfs_counts_inodes() {
    let fs = fresh(2);
    let before = statfs(fs);
    assert_eq!(before.inodes_used, 1, "the root");
    assert!(before.inodes_free > 0 && before.free_blocks > 0);
    assert_eq!((before.block_bytes, before.name_max_bytes), (4096, 255));
    for i in 0..10 {
        release(fs, create(fs, format!("f{i}").as_bytes()));
    }
    assert_eq!(mkdir(fs, b"d"), 0);
    assert_eq!(statfs(fs).inodes_used, 12);
    assert_eq!(unlink(fs, b"f0"), 0);
    assert_eq!(statfs(fs).inodes_used, 11);
    // SAFETY: NULL is refused before it is written.
    let null_out = unsafe { corefs_statfs(fs, std::ptr::null_mut()) };
    assert_eq!(null_out as i64, err(libc::EFAULT));
    close(fs);
}

/// The order arguments are checked in (the abi module's doc): an out-pointer first, then the
/// filesystem, then the path; a caller with several bad arguments learns the same errno.
#[test]
fn arguments_are_checked_out_pointer_then_filesystem_then_path() {
    let fs = fresh(1);
    let closed = fresh(1);
    close(closed);
    let path = c(b"/");
    // SAFETY: NULL out-pointers and NULL paths are refused before any is used.
    unsafe {
        let out = std::ptr::null_mut();
        assert_eq!(
            corefs_stat(closed, path.as_ptr(), out) as i64,
            err(libc::EFAULT)
        );
        assert_eq!(
            corefs_stat(closed, std::ptr::null(), out) as i64,
            err(libc::EFAULT)
        );
        assert_eq!(corefs_fstat(closed, 1, out) as i64, err(libc::EFAULT));
        assert_eq!(
            corefs_statfs(closed, std::ptr::null_mut()) as i64,
            err(libc::EFAULT)
        );
        assert_eq!(
            corefs_get_stats(closed, std::ptr::null_mut()) as i64,
            err(libc::EFAULT)
        );
        let mut st = corefs_stat::default();
        assert_eq!(
            corefs_stat(closed, std::ptr::null(), &mut st) as i64,
            err(libc::EBADF)
        );
        assert_eq!(
            corefs_stat(fs, std::ptr::null(), &mut st) as i64,
            err(libc::EFAULT)
        );
        assert_eq!(
            corefs_chmod(closed, std::ptr::null(), 0o600) as i64,
            err(libc::EBADF)
        );
        assert_eq!(
            corefs_readlink(closed, std::ptr::null(), std::ptr::null_mut(), 8),
            err(libc::EBADF)
        );
        assert_eq!(
            corefs_readlink(fs, std::ptr::null(), std::ptr::null_mut(), 8),
            err(libc::EFAULT)
        );
    }
    close(fs);
}

// ---- Special files -------------------------------------------------------------------------

fn mknod(fs: corefs_fs, path: &[u8], mode: u32, rdev: u64) -> i64 {
    let p = c(path);
    // SAFETY: a NUL-terminated path.
    unsafe { corefs_mknod(fs, p.as_ptr(), mode, rdev) as i64 }
}

#[test]
fn mknod_stores_fifos_sockets_and_devices() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let device = format!("file:{}/mknod.img,size=64MiB", dir.path().display());
    let fs = fresh_on(&device, 2);
    release(fs, create(fs, b"f"));
    // SAFETY: geteuid and getegid cannot fail.
    let me = unsafe { (libc::geteuid(), libc::getegid()) };
    // makedev(1, 3) (/dev/null) and makedev(8, 1) (/dev/sda1).
    let (null_dev, sda1_dev) = (0x103u64, 0x801u64);
    let p = c(b"fifo");
    // SAFETY: a NUL-terminated path.
    let made = unsafe { corefs_mkfifo(fs, p.as_ptr(), 0o640) };
    assert_eq!(made, 0, "{}", last_error());
    assert_eq!(
        mknod(fs, b"chr", libc::S_IFCHR | 0o600, null_dev),
        0,
        "{}",
        last_error()
    );
    assert_eq!(mknod(fs, b"blk", libc::S_IFBLK | 0o660, sda1_dev), 0);
    assert_eq!(mknod(fs, b"sock", libc::S_IFSOCK | 0o755, 99), 0);
    assert_eq!(mknod(fs, b"reg", 0o604, 0), 0, "type 0 is a regular file");
    assert_eq!(mknod(fs, b"reg2", libc::S_IFREG | 0o600, 0), 0);
    let want = [
        (&b"fifo"[..], libc::S_IFIFO | 0o640, 0u32),
        (b"chr", libc::S_IFCHR | 0o600, null_dev as u32),
        (b"blk", libc::S_IFBLK | 0o660, sda1_dev as u32),
        // A socket or FIFO keeps no device number, whatever was passed.
        (b"sock", libc::S_IFSOCK | 0o755, 0),
        (b"reg", libc::S_IFREG | 0o604, 0),
        (b"reg2", libc::S_IFREG | 0o600, 0),
    ];
    let check = |fs: corefs_fs| {
        for (name, mode, rdev) in want {
            let st = stat(fs, name).unwrap_or_else(|e| panic!("stat {}: {e}", show(name)));
            assert_eq!((st.mode, st.rdev), (mode, rdev), "{}", show(name));
            assert_eq!((st.uid, st.gid), me, "{}: the caller owns it", show(name));
        }
    };
    check(fs);
    // Refused: a directory (EPERM), a symlink or unknown type, a 33-bit device number, a name
    // that exists, a file as a directory, a trailing slash, `.`.
    assert_eq!(mknod(fs, b"d", libc::S_IFDIR | 0o755, 0), err(libc::EPERM));
    assert_eq!(mknod(fs, b"l", libc::S_IFLNK | 0o777, 0), err(libc::EINVAL));
    assert_eq!(mknod(fs, b"x", 0o170000 | 0o644, 0), err(libc::EINVAL));
    assert_eq!(
        mknod(fs, b"big", libc::S_IFCHR | 0o600, 1 << 32),
        err(libc::EINVAL)
    );
    assert_eq!(
        mknod(fs, b"fifo", libc::S_IFIFO | 0o600, 0),
        err(libc::EEXIST)
    );
    assert_eq!(
        mknod(fs, b"f/x", libc::S_IFIFO | 0o600, 0),
        err(libc::ENOTDIR)
    );
    assert_eq!(
        mknod(fs, b"new/", libc::S_IFIFO | 0o600, 0),
        err(libc::ENOENT)
    );
    assert_eq!(
        mknod(fs, b"fifo/", libc::S_IFIFO | 0o600, 0),
        err(libc::EEXIST)
    );
    assert_eq!(mknod(fs, b".", libc::S_IFIFO | 0o600, 0), err(libc::EEXIST));
    // No pipe runs behind a FIFO: it opens (a name with a type), but I/O is EINVAL.
    let fd = open_ok(fs, b"fifo", COREFS_O_RDONLY);
    let mut buf = [0u8; 8];
    // SAFETY: `buf` is valid for 8 bytes.
    let n = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), 8, 0) };
    assert_eq!(n, err(libc::EINVAL));
    release(fs, fd);
    // readdir gives each its DT_* type.
    let p = c(b"/");
    // SAFETY: all-zero entries are valid.
    let mut entries: Vec<corefs_dirent> = (0..16).map(|_| unsafe { std::mem::zeroed() }).collect();
    // SAFETY: a NUL-terminated path and 16 writable entries.
    let n = unsafe { corefs_readdir(fs, p.as_ptr(), 0, entries.as_mut_ptr(), 16) };
    let mut kinds: Vec<(Vec<u8>, u8)> = entries[..n as usize]
        .iter()
        .map(|e| (e.name[..e.name_len as usize].to_vec(), e.kind))
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            (b"blk".to_vec(), libc::DT_BLK),
            (b"chr".to_vec(), libc::DT_CHR),
            (b"f".to_vec(), libc::DT_REG),
            (b"fifo".to_vec(), libc::DT_FIFO),
            (b"reg".to_vec(), libc::DT_REG),
            (b"reg2".to_vec(), libc::DT_REG),
            (b"sock".to_vec(), libc::DT_SOCK),
        ]
    );
    close(fs);
    // Durable: the types and numbers come back after a remount.
    let fs = mount_with(&device, &no_options());
    check(fs);
    assert_eq!(unlink(fs, b"chr"), 0);
    assert_eq!(stat(fs, b"chr").unwrap_err(), err(libc::ENOENT));
    close(fs);
}

/// A poll that finds completions left over from an earlier poll (past its `max`) returns one
/// at once: it never waits for a new completion with answers in hand. fio reaps one
/// completion per call at queue depth 32, and each of its polls used to wait for the next
/// device I/O to finish while the finished ones sat in the leftover list (20k IOPS, under one
/// read on the device). Here an fsync held by a 1 s flush delay stays in flight while four
/// finished reads are polled one at a time: all four come back before it completes.
#[test]
fn a_poll_with_completions_in_hand_returns_them_without_waiting() {
    let fs = fresh_on("mem:64MiB,cache=volatile,flushdelay=1000000", 1);
    let fd = create(fs, b"/f");
    let data: Vec<u8> = (0..16384u32).map(|i| (i / 4096) as u8 + 1).collect();
    assert_eq!(pwrite(fs, fd, &data, 0), 16384);
    let mut bufs = vec![[0u8; 4096]; 4];
    for (i, buf) in bufs.iter_mut().enumerate() {
        // SAFETY: `buf` outlives the completion, polled below on this thread.
        let rc = unsafe {
            corefs_submit_pread(
                fs,
                fd,
                buf.as_mut_ptr(),
                4096,
                i as u64 * 4096,
                i as u64 + 1,
            )
        };
        assert_eq!(rc, 0, "submit: {}", last_error());
    }
    // The written data is not durable yet: this fsync needs a flush, which takes a second.
    assert_eq!(corefs_submit_fsync(fs, fd, 0, 99), 0, "{}", last_error());
    // The reads complete meanwhile; the first poll takes them from the client and returns
    // one, keeping three.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut tokens = Vec::new();
    for _ in 0..4 {
        let mut done = [corefs_completion::default(); 1];
        // SAFETY: `done` holds the one completion asked for.
        let n = unsafe { corefs_poll(fs, done.as_mut_ptr(), 1, 20_000_000) };
        assert_eq!(n, 1, "poll: {}", last_error());
        tokens.push((done[0].token, done[0].result));
    }
    tokens.sort_unstable();
    assert_eq!(tokens, vec![(1, 4096), (2, 4096), (3, 4096), (4, 4096)]);
    // None of those polls waited for the fsync: it is still in flight.
    let mut done = [corefs_completion::default(); 1];
    // SAFETY: as above.
    let n = unsafe { corefs_poll(fs, done.as_mut_ptr(), 1, 0) };
    assert_eq!(n, 0, "a poll waited for the fsync with reads in hand");
    // SAFETY: as above.
    let n = unsafe { corefs_poll(fs, done.as_mut_ptr(), 1, 20_000_000) };
    assert_eq!((n, done[0].token, done[0].result), (1, 99, 0));
    for (i, buf) in bufs.iter().enumerate() {
        assert!(
            buf.iter().all(|&b| b == i as u8 + 1),
            "read {i} holds its block"
        );
    }
    assert_eq!(corefs_release(fs, fd), 0);
    close(fs);
}

/// One file may take the whole device, whatever shard it lives in: on fresh default
/// filesystems (64 shards; before, a file had 1/64 of the device) `corefs_pwrite` of 1 MiB
/// pieces goes on until ENOSPC, by then the file holds ≥ 95% of what statfs showed free, and
/// deleting it gives it all back. With one reactor and with two (shards on different
/// reactors draw on one pool).
#[test]
fn one_file_takes_the_whole_device_through_pwrite() {
    for reactors in [1, 2] {
        let o = corefs_options {
            format: 1,
            reactors,
            ..no_options()
        };
        let fs = mount_with("mem:256MiB", &o);
        let start = statfs(fs);
        let fd = create(fs, b"/big");
        let piece = vec![0x5au8; 1 << 20];
        let mut written = 0u64;
        loop {
            let n = pwrite(fs, fd, &piece, written);
            if n == -28 {
                break;
            }
            assert_eq!(
                n,
                piece.len() as i64,
                "pwrite at {written}: {}",
                last_error()
            );
            written += n as u64;
        }
        assert_eq!(corefs_fsync(fs, fd), 0, "{}", last_error());
        let free_bytes = start.free_blocks * start.block_bytes;
        assert!(
            written * 100 >= free_bytes * 95,
            "{reactors} reactors: {} MiB of {} MiB free",
            written >> 20,
            free_bytes >> 20
        );
        assert_eq!(pread(fs, fd, 4096, written - 4096), vec![0x5au8; 4096]);
        release(fs, fd);
        assert_eq!(unlink(fs, b"/big"), 0);
        // The frees and the groups come back with the commits.
        assert_eq!(corefs_sync(fs), 0);
        assert_eq!(corefs_sync(fs), 0);
        let end = statfs(fs);
        assert!(
            end.free_blocks + end.total_blocks / 100 >= start.free_blocks,
            "{reactors} reactors: {} free after deleting, {} at the start",
            end.free_blocks,
            start.free_blocks
        );
        close(fs);
    }
}

/// The errors Linux's filesystems give where corefs once said EINVAL: a hard link to a
/// directory (EPERM), fallocate past the largest file (EFBIG), a hole punch without
/// KEEP_SIZE or an unknown mode (EOPNOTSUPP), and an attribute name that is a namespace's
/// prefix alone (EINVAL, which it already was, now also for reads and removes).
#[test]
fn errnos_follow_linux_for_links_fallocate_and_xattr_names() {
    let fs = fresh(1);
    assert_eq!(mkdir(fs, b"d"), 0);
    assert_eq!(
        link(fs, b"d", b"d2"),
        -libc::EPERM as i64,
        "{}",
        last_error()
    );
    let fd = create(fs, b"f");
    let keep = COREFS_FALLOC_KEEP_SIZE;
    assert_eq!(corefs_fallocate(fs, fd, keep, 0, 0), -libc::EINVAL);
    assert_eq!(corefs_fallocate(fs, fd, keep, 1 << 50, 1), -libc::EFBIG);
    assert_eq!(
        corefs_fallocate(fs, fd, COREFS_FALLOC_PUNCH_HOLE, 0, 4096),
        -libc::EOPNOTSUPP
    );
    assert_eq!(corefs_fallocate(fs, fd, 0x8, 0, 4096), -libc::EOPNOTSUPP);
    release(fs, fd);
    let path = c(b"f");
    for prefix in [c"user.", c"trusted.", c"security."] {
        // SAFETY: NUL-terminated strings and a live value and buffer.
        unsafe {
            let set = corefs_setxattr(fs, path.as_ptr(), prefix.as_ptr(), b"v".as_ptr(), 1, 0);
            assert_eq!(set, -libc::EINVAL, "{prefix:?}: {}", last_error());
            let mut buf = [0u8; 4];
            let got = corefs_getxattr(fs, path.as_ptr(), prefix.as_ptr(), buf.as_mut_ptr(), 4);
            assert_eq!(got, -libc::EINVAL as i64, "{prefix:?}");
        }
    }
    close(fs);
}

/// corefs never follows a symbolic link: opening one is ELOOP, as open(2) with O_NOFOLLOW,
/// after the checks Linux makes first (O_EXCL's EEXIST, O_DIRECTORY's ENOTDIR).
#[test]
fn opening_a_symbolic_link_is_eloop() {
    let fs = fresh(1);
    assert_eq!(symlink(fs, b"target", b"l"), 0);
    for flags in [
        COREFS_O_RDONLY,
        COREFS_O_RDWR,
        COREFS_O_CREAT | COREFS_O_WRONLY,
        COREFS_O_TRUNC | COREFS_O_WRONLY,
    ] {
        assert_eq!(
            open(fs, b"l", flags),
            -libc::ELOOP as i64,
            "flags {flags:#o}"
        );
    }
    assert_eq!(
        open(fs, b"l", COREFS_O_CREAT | COREFS_O_EXCL | COREFS_O_RDWR),
        -libc::EEXIST as i64
    );
    assert_eq!(open(fs, b"l", COREFS_O_DIRECTORY), -libc::ENOTDIR as i64);
    close(fs);
}

/// A fresh memory filesystem over 4 shards whose reads move access times as `atime` says.
fn fresh_with_atime(atime: u8) -> corefs_fs {
    let o = corefs_options {
        format: 1,
        shards: 4,
        atime,
        ..no_options()
    };
    mount_with("mem:64MiB", &o)
}

/// A read moves the access time as `options.atime` says (relatime by default), through the
/// reactor like any inode change; the birth time is the creation's and stays; an unknown
/// `atime` value is -EINVAL naming the choices.
#[test]
fn atime_moves_on_a_read_after_a_write_and_btime_stays() {
    let fs = fresh(1);
    let fd = create(fs, b"f");
    assert_eq!(pwrite(fs, fd, &[5u8; 4096], 0), 4096);
    let before = fstat(fs, fd).unwrap();
    assert!(before.btime_sec > 0, "{before:?}");
    assert_eq!(pread(fs, fd, 4096, 0).len(), 4096);
    let after = fstat(fs, fd).unwrap();
    let time = |sec: i64, nsec: u32| (sec, nsec);
    assert!(
        time(after.atime_sec, after.atime_nsec) > time(before.atime_sec, before.atime_nsec),
        "relatime: the first read after a write moves atime ({before:?} -> {after:?})"
    );
    assert_eq!(pread(fs, fd, 10, 0).len(), 10);
    let again = fstat(fs, fd).unwrap();
    assert_eq!(
        (again.atime_sec, again.atime_nsec),
        (after.atime_sec, after.atime_nsec),
        "a second read before any change leaves it"
    );
    assert_eq!(
        (again.btime_sec, again.btime_nsec),
        (before.btime_sec, before.btime_nsec)
    );
    release(fs, fd);
    close(fs);

    let fs = fresh_with_atime(COREFS_ATIME_STRICT);
    let fd = create(fs, b"f");
    assert_eq!(pwrite(fs, fd, b"abc", 0), 3);
    let mut last = fstat(fs, fd).unwrap();
    for _ in 0..3 {
        pread(fs, fd, 3, 0);
        let now = fstat(fs, fd).unwrap();
        assert!(
            (now.atime_sec, now.atime_nsec) > (last.atime_sec, last.atime_nsec),
            "strictatime: every read"
        );
        last = now;
    }
    release(fs, fd);
    close(fs);

    let fs = fresh_with_atime(COREFS_ATIME_NOATIME);
    let fd = create(fs, b"f");
    assert_eq!(pwrite(fs, fd, b"abc", 0), 3);
    let before = fstat(fs, fd).unwrap();
    pread(fs, fd, 3, 0);
    let after = fstat(fs, fd).unwrap();
    assert_eq!(
        (after.atime_sec, after.atime_nsec),
        (before.atime_sec, before.atime_nsec),
        "noatime"
    );
    release(fs, fd);
    close(fs);

    let bad = corefs_options {
        format: 1,
        atime: 3,
        ..no_options()
    };
    let device = c(b"mem:64MiB");
    // SAFETY: a NUL-terminated device string and options without a label.
    let got = unsafe { corefs_mount(device.as_ptr(), &bad) };
    assert_eq!(got, -libc::EINVAL as i64, "atime 3");
    assert!(last_error().contains("atime"), "{}", last_error());
}

/// pjdfstest's `link::link_count_max` through the C functions (the suite itself skips it on
/// every FUSE mount: glibc's pathconf answers 127, "unknown", there): a file takes names in
/// one directory up to ext4's 65,000 links, and the next link is EMLINK with nothing changed.
#[test]
fn a_file_takes_sixty_five_thousand_names_in_one_directory_then_emlink() {
    let fs = fresh(1);
    assert_eq!(mkdir(fs, b"d"), 0);
    let fd = create(fs, b"d/f");
    release(fs, fd);
    for i in 1..65_000 {
        let path = format!("d/{i}");
        assert_eq!(
            link(fs, b"d/f", path.as_bytes()),
            0,
            "link {i}: {}",
            last_error()
        );
    }
    assert_eq!(stat(fs, b"d/f").unwrap().nlink, 65_000);
    assert_eq!(link(fs, b"d/f", b"d/more"), -libc::EMLINK as i64);
    assert_eq!(stat(fs, b"d/more").err(), Some(-libc::ENOENT as i64));
    assert_eq!(unlink(fs, b"d/64999"), 0);
    assert_eq!(link(fs, b"d/f", b"d/more"), 0, "{}", last_error());
    close(fs);
}

/// Asynchronous operations keep their file: a handle released while writes submitted through
/// it are still in flight (parked behind write-back, past 12 MiB staged) does not delete the
/// open-unlinked file under them, even from another thread. Every write completes with its
/// length, and the file is deleted once the last completion is polled.
#[test]
fn release_waits_for_asynchronous_operations_in_flight() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: u64 = 64;
    // A file image: write-back takes real device time, so writes past the staging bound
    // park while the release from the other thread runs.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let device = format!("file:{}/async.img,size=512MiB", dir.path().display());
    let fs = mount_with(
        &device,
        &corefs_options {
            format: 1,
            shards: 4,
            ..no_options()
        },
    );
    let used_before = statfs(fs).inodes_used;
    let fd = create(fs, b"f");
    assert_eq!(unlink(fs, b"f"), 0);
    assert_eq!(statfs(fs).inodes_used, used_before + 1, "held while open");
    let data = vec![0x5au8; CHUNK];
    for i in 0..CHUNKS {
        // SAFETY: `data` is valid for CHUNK bytes during the call (the write copies it).
        let got = unsafe {
            corefs_submit_pwrite(fs, fd, data.as_ptr(), CHUNK, i * CHUNK as u64, 100 + i)
        };
        assert_eq!(got, 0, "submit {i}: {}", last_error());
    }
    let fsync = corefs_submit_fsync(fs, fd, 0, 999);
    assert_eq!(fsync, 0, "{}", last_error());
    // Released by another thread (its own client, so nothing orders it after the writes).
    std::thread::spawn(move || release(fs, fd)).join().unwrap();
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < CHUNKS as usize + 1 {
        let mut out = [corefs_completion::default(); 8];
        // SAFETY: `out` holds 8 completions.
        let n = unsafe { corefs_poll(fs, out.as_mut_ptr(), out.len(), 1_000_000) };
        assert!(n > 0, "poll: {n} {}", last_error());
        for c in &out[..n as usize] {
            seen.insert(c.token, c.result);
        }
    }
    for (token, result) in &seen {
        let want = if *token == 999 { 0 } else { CHUNK as i64 };
        assert_eq!(*result, want, "token {token}: {seen:?}");
    }
    assert_eq!(
        statfs(fs).inodes_used,
        used_before,
        "the file is deleted once its last operation completed"
    );
    close(fs);
}
