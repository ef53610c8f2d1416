//! The differential run against the kernel, shared by the C ABI's test
//! (`bindings/tests/differential.rs`) and the FUSE mount's (`cli/tests/differential.rs`):
//! seeded random sequences of mkdir, open (O_CREAT, O_EXCL, O_TRUNC, O_DIRECTORY, O_APPEND,
//! each access mode) with writes, ftruncate, unlink, rmdir, rename (plain, NOREPLACE,
//! EXCHANGE), link, symlink, stat and xattrs, on a namespace of four names three deep (so
//! names collide, directories fill and empty, renames land on what exists), run on the side
//! under test and through the system calls on a directory of the machine's filesystem.
//! Every call's result or errno, every file's bytes and the final trees must agree.
//!
//! Not compared, because corefs differs by design (docs/embedding.md: how the C ABI treats paths): calls whose path the
//! kernel would resolve through a symbolic link (corefs never follows one); they are
//! skipped and counted. Opens name a symbolic link as their last component freely: the
//! kernel side opens with O_NOFOLLOW, and both answer ELOOP. Extended attributes of a
//! symbolic link are not compared (Linux refuses user.* ones; corefs keeps them).
//! Permissions are not exercised (the tests may run as root).
//! `COREFS_SEED=N` replays a seed; `COREFS_DIFF_OPS` sets the operations per run.

#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::PathBuf;

pub fn c(s: &str) -> CString {
    CString::new(s).expect("no NUL")
}

pub fn errno() -> i64 {
    -(std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO) as i64)
}

/// The open flags the runs use (Linux's values, which corefs.h shares).
pub const OPEN_MASK: i32 =
    libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_APPEND | libc::O_DIRECTORY | 3;

/// One side of the comparison.
pub trait Side {
    fn mkdir(&mut self, path: &str) -> i64;
    /// open(2), then (when it opened and may write) a pwrite, then close: the open's result
    /// (0 or -errno) and the write's.
    fn open_write(&mut self, path: &str, flags: i32, data: &[u8], offset: u64) -> (i64, i64);
    fn truncate(&mut self, path: &str, size: u64) -> i64;
    fn unlink(&mut self, path: &str) -> i64;
    fn rmdir(&mut self, path: &str) -> i64;
    fn rename(&mut self, from: &str, to: &str, flags: u32) -> i64;
    fn link(&mut self, from: &str, to: &str) -> i64;
    fn symlink(&mut self, target: &str, path: &str) -> i64;
    /// Kind ('d', 'f', 'l') and size, or -errno.
    fn stat(&mut self, path: &str) -> Result<(char, u64), i64>;
    fn read_all(&mut self, path: &str) -> Result<Vec<u8>, i64>;
    fn names(&mut self, path: &str) -> Result<Vec<String>, i64>;
    fn setxattr(&mut self, path: &str, name: &str, value: &[u8]) -> i64;
    fn getxattr(&mut self, path: &str, name: &str) -> Result<Vec<u8>, i64>;
}

pub fn kind_of(mode: u32) -> char {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        _ => 'f',
    }
}

pub struct Kernel(pub PathBuf);

impl Kernel {
    fn at(&self, path: &str) -> CString {
        c(self.0.join(path).to_str().expect("UTF-8"))
    }
}

/// The kernel's answer: 0 or -errno.
pub fn k(r: libc::c_int) -> i64 {
    if r < 0 {
        errno()
    } else {
        0
    }
}

impl Side for Kernel {
    fn mkdir(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        k(unsafe { libc::mkdir(self.at(path).as_ptr(), 0o755) })
    }
    fn open_write(&mut self, path: &str, flags: i32, data: &[u8], offset: u64) -> (i64, i64) {
        // The flags' values are Linux's (corefs.h says so, and a test checks it).
        // SAFETY: a NUL-terminated path.
        let fd = unsafe {
            libc::open(
                self.at(path).as_ptr(),
                (flags & OPEN_MASK) | libc::O_NOFOLLOW,
                0o644,
            )
        };
        if fd < 0 {
            return (errno(), 0);
        }
        let wrote = if flags & 3 != libc::O_RDONLY && flags & libc::O_DIRECTORY == 0 {
            // SAFETY: a live buffer of the length given.
            let n = unsafe {
                libc::pwrite(fd, data.as_ptr().cast(), data.len(), offset as libc::off_t)
            };
            if n < 0 {
                errno()
            } else {
                n as i64
            }
        } else {
            0
        };
        // SAFETY: a descriptor this function opened.
        unsafe { libc::close(fd) };
        (0, wrote)
    }
    fn truncate(&mut self, path: &str, size: u64) -> i64 {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(self.at(path).as_ptr(), libc::O_WRONLY | libc::O_NOFOLLOW) };
        if fd < 0 {
            return errno();
        }
        // SAFETY: a descriptor this function opened.
        let r = k(unsafe { libc::ftruncate(fd, size as libc::off_t) });
        // SAFETY: as above.
        unsafe { libc::close(fd) };
        r
    }
    fn unlink(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        k(unsafe { libc::unlink(self.at(path).as_ptr()) })
    }
    fn rmdir(&mut self, path: &str) -> i64 {
        // SAFETY: a NUL-terminated path.
        k(unsafe { libc::rmdir(self.at(path).as_ptr()) })
    }
    fn rename(&mut self, from: &str, to: &str, flags: u32) -> i64 {
        // SAFETY: NUL-terminated paths.
        k(unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                self.at(from).as_ptr(),
                libc::AT_FDCWD,
                self.at(to).as_ptr(),
                flags,
            )
        })
    }
    fn link(&mut self, from: &str, to: &str) -> i64 {
        // SAFETY: NUL-terminated paths.
        k(unsafe { libc::link(self.at(from).as_ptr(), self.at(to).as_ptr()) })
    }
    fn symlink(&mut self, target: &str, path: &str) -> i64 {
        // SAFETY: NUL-terminated strings.
        k(unsafe { libc::symlink(c(target).as_ptr(), self.at(path).as_ptr()) })
    }
    fn stat(&mut self, path: &str) -> Result<(char, u64), i64> {
        match std::fs::symlink_metadata(self.0.join(path)) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                let kind = kind_of(m.mode());
                // A directory's size is the filesystem's own business.
                Ok((kind, if kind == 'd' { 0 } else { m.size() }))
            }
            Err(e) => Err(-(e.raw_os_error().unwrap_or(libc::EIO) as i64)),
        }
    }
    fn read_all(&mut self, path: &str) -> Result<Vec<u8>, i64> {
        std::fs::read(self.0.join(path)).map_err(|e| -(e.raw_os_error().unwrap_or(5) as i64))
    }
    fn names(&mut self, path: &str) -> Result<Vec<String>, i64> {
        let dir = std::fs::read_dir(self.0.join(path))
            .map_err(|e| -(e.raw_os_error().unwrap_or(5) as i64))?;
        let mut names: Vec<String> = dir
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        Ok(names)
    }
    fn setxattr(&mut self, path: &str, name: &str, value: &[u8]) -> i64 {
        // SAFETY: NUL-terminated strings and a live value.
        k(unsafe {
            libc::lsetxattr(
                self.at(path).as_ptr(),
                c(name).as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        })
    }
    fn getxattr(&mut self, path: &str, name: &str) -> Result<Vec<u8>, i64> {
        let mut buf = vec![0u8; 256];
        // SAFETY: NUL-terminated strings and a live buffer of the length given.
        let n = unsafe {
            libc::lgetxattr(
                self.at(path).as_ptr(),
                c(name).as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(errno());
        }
        buf.truncate(n as usize);
        Ok(buf)
    }
}

/// The names the operations use: few, so they collide.
const NAMES: [&str; 4] = ["a", "b", "c", "d"];

pub fn random_path(rng: &mut Xoshiro256PlusPlus) -> String {
    let depth = rng.random_range(1..=3);
    (0..depth)
        .map(|_| NAMES[rng.random_range(0..NAMES.len())])
        .collect::<Vec<_>>()
        .join("/")
}

/// True when the kernel would follow a symbolic link on the way to `path` (every component
/// but the last) or, with `last`, at its last component.
pub fn through_symlink(kernel: &Kernel, path: &str, last: bool) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let upto = if last { parts.len() } else { parts.len() - 1 };
    (1..=upto).any(|n| {
        std::fs::symlink_metadata(kernel.0.join(parts[..n].join("/")))
            .is_ok_and(|m| m.file_type().is_symlink())
    })
}

/// Every path under the root with its kind and (for files) bytes, on one side.
pub fn snapshot(side: &mut dyn Side, dir: &str, out: &mut BTreeMap<String, (char, Vec<u8>)>) {
    let Ok(names) = side.names(dir) else { return };
    for name in names {
        let path = if dir.is_empty() {
            name
        } else {
            format!("{dir}/{name}")
        };
        let (kind, _) = side.stat(&path).expect("listed");
        let bytes = if kind == 'f' {
            side.read_all(&path).expect("a listed file reads")
        } else {
            Vec::new()
        };
        out.insert(path.clone(), (kind, bytes));
        if kind == 'd' {
            snapshot(side, &path, out);
        }
    }
}

/// Runs `ops` seeded random operations on `mine` and on `kernel` (the reference) and
/// asserts that every answer, every file's bytes and the final trees agree; `label` names
/// `mine` in messages. Returns the operations skipped because the kernel would have
/// followed a symbolic link.
pub fn compare(
    mine: &mut dyn Side,
    kernel: &mut Kernel,
    seed: u64,
    ops: usize,
    label: &str,
) -> usize {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut skipped = 0;
    for step in 0..ops {
        let what = |extra: &str| format!("seed {seed} {label} step {step}: {extra}");
        let path = random_path(&mut rng);
        let other = random_path(&mut rng);
        match rng.random_range(0..13) {
            0 | 1 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                assert_eq!(
                    mine.mkdir(&path),
                    kernel.mkdir(&path),
                    "{}",
                    what(&format!("mkdir {path}"))
                );
            }
            2..=4 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                let flags = [
                    0,
                    libc::O_CREAT | libc::O_WRONLY,
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                    libc::O_CREAT | libc::O_TRUNC | libc::O_RDWR,
                    libc::O_TRUNC | libc::O_WRONLY,
                    libc::O_APPEND | libc::O_WRONLY,
                    libc::O_DIRECTORY,
                    libc::O_RDWR,
                    libc::O_CREAT | libc::O_DIRECTORY,
                ][rng.random_range(0..9)];
                let len = rng.random_range(0..9000);
                let data: Vec<u8> = (0..len).map(|i| (i as u64 ^ step as u64) as u8).collect();
                let offset = rng.random_range(0..20000);
                let got = mine.open_write(&path, flags, &data, offset);
                let want = kernel.open_write(&path, flags, &data, offset);
                assert_eq!(
                    got,
                    want,
                    "{}",
                    what(&format!("open {path} {flags:#o} + write {len} at {offset}"))
                );
            }
            5 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                let size = rng.random_range(0..30000);
                assert_eq!(
                    mine.truncate(&path, size),
                    kernel.truncate(&path, size),
                    "{}",
                    what(&format!("truncate {path} {size}"))
                );
            }
            6 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                assert_eq!(
                    mine.unlink(&path),
                    kernel.unlink(&path),
                    "{}",
                    what(&format!("unlink {path}"))
                );
            }
            7 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                assert_eq!(
                    mine.rmdir(&path),
                    kernel.rmdir(&path),
                    "{}",
                    what(&format!("rmdir {path}"))
                );
            }
            8 | 9 => {
                if through_symlink(kernel, &path, false) || through_symlink(kernel, &other, false) {
                    skipped += 1;
                    continue;
                }
                let flags =
                    [0, libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE][rng.random_range(0..3)];
                assert_eq!(
                    mine.rename(&path, &other, flags),
                    kernel.rename(&path, &other, flags),
                    "{}",
                    what(&format!("rename {path} {other} {flags}"))
                );
            }
            10 => {
                if through_symlink(kernel, &path, false) || through_symlink(kernel, &other, false) {
                    skipped += 1;
                    continue;
                }
                if rng.random_bool(0.5) {
                    assert_eq!(
                        mine.link(&path, &other),
                        kernel.link(&path, &other),
                        "{}",
                        what(&format!("link {path} {other}"))
                    );
                } else {
                    assert_eq!(
                        mine.symlink("nowhere", &other),
                        kernel.symlink("nowhere", &other),
                        "{}",
                        what(&format!("symlink {other}"))
                    );
                }
            }
            11 => {
                if through_symlink(kernel, &path, false) {
                    skipped += 1;
                    continue;
                }
                let (mine, theirs) = (mine.stat(&path), kernel.stat(&path));
                // A directory's size is the filesystem's own business.
                let dir_size_free =
                    |r: Result<(char, u64), i64>| r.map(|(k, s)| (k, if k == 'd' { 0 } else { s }));
                assert_eq!(
                    dir_size_free(mine),
                    dir_size_free(theirs),
                    "{}",
                    what(&format!("stat {path}"))
                );
            }
            _ => {
                if through_symlink(kernel, &path, true) {
                    skipped += 1;
                    continue;
                }
                let name = ["user.x", "user.y", "user."][rng.random_range(0..3)];
                if rng.random_bool(0.5) {
                    let value = format!("v{step}");
                    assert_eq!(
                        mine.setxattr(&path, name, value.as_bytes()),
                        kernel.setxattr(&path, name, value.as_bytes()),
                        "{}",
                        what(&format!("setxattr {path} {name}"))
                    );
                } else {
                    assert_eq!(
                        mine.getxattr(&path, name),
                        kernel.getxattr(&path, name),
                        "{}",
                        what(&format!("getxattr {path} {name}"))
                    );
                }
            }
        }
    }
    let (mut ours, mut theirs) = (BTreeMap::new(), BTreeMap::new());
    snapshot(mine, "", &mut ours);
    snapshot(kernel, "", &mut theirs);
    // A directory's size is the filesystem's own business: compare kinds and file bytes.
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "seed {seed} {label}: the trees' names differ"
    );
    for (path, (kind, bytes)) in &ours {
        let (their_kind, their_bytes) = &theirs[path];
        assert_eq!(kind, their_kind, "seed {seed}: {path}");
        assert!(
            bytes == their_bytes,
            "seed {seed}: {path}: {} bytes vs {}",
            bytes.len(),
            their_bytes.len()
        );
    }
    skipped
}

pub fn ops() -> usize {
    std::env::var("COREFS_DIFF_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000)
}

pub fn seed() -> u64 {
    let seed = std::env::var("COREFS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64
                ^ std::process::id() as u64
        });
    eprintln!("seed {seed} (replay with COREFS_SEED={seed})");
    seed
}
