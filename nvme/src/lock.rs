//! One writer per device: the exclusive lock every open for writing takes.
//!
//! Two writers of one image destroy each other's data: each commits its own view of the
//! filesystem over the other's, and the last to unmount erases what the other fsynced. So an
//! open for writing ([`Access::Exclusive`], the default) takes an exclusive lock and fails with
//! [`DevError::Busy`], naming the holder's pid where it can be found, when someone has it:
//!
//! - regular files and the NVMe generic char device (`/dev/ngXnY`): an OFD write lock
//!   (`F_OFD_SETLK`) over the whole file. An OFD lock belongs to the open file description, not
//!   to the process, so two opens in one process conflict too (two `corefs_mount` of one image
//!   in one program), and closing some other descriptor of the file does not drop it (as it
//!   would drop a POSIX `F_SETLK` lock);
//! - block devices: `O_EXCL` at open (the kernel refuses it while the device is mounted or
//!   opened with `O_EXCL` by anyone) plus the same OFD lock on the device node;
//! - `mem:` devices live in one process and need none.
//!
//! Read-only tools open with [`Access::ReadShared`]: read-only, no lock; [`in_use`] tells them
//! whether a writer holds the device, so that they can warn that what they show may be stale.
//! Another queue of a device this process already holds ([`Access::AnotherQueue`]: each
//! reactor opens its own ring from the device string) shares the holder's lock through a
//! process-wide table of the locks held, and fails when this process holds none.
//!
//! # Invariants
//! - A forked child shares its parent's open file descriptions, and so the lock, until it
//!   execs (every descriptor here is `O_CLOEXEC`) or exits: an exclusive open waits a moment
//!   ([`BUSY_WAIT`]) before it reports a conflict, so that such a passing copy does not fail it.
//! - The lock lives on a duplicate of the first queue's descriptor, owned by a [`DeviceLock`]
//!   that every queue sharing it keeps through an `Arc`: it is released when the last of them
//!   is dropped, never earlier.
//! - The lock is advisory: it keeps corefs's tools and programs from one another, not an
//!   arbitrary program that writes the file (`dd`).
//!
//! # Fault model
//! A filesystem that refuses OFD locks (`ENOLCK`, `EINVAL`) fails the open: running unprotected
//! is how data is lost. Finding the holder's pid reads `/proc/locks`, which shows `-1` for OFD
//! locks on the kernels seen so far, and then the `lock:` lines of `/proc/*/fdinfo/*`; a
//! holder this process may not inspect is reported as "another process".

use crate::DevError;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How a device is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Read-write, holding the device's exclusive lock: what every tool that may write (mkfs,
    /// mount, fsck, the benchmarks, the C ABI) opens with. Fails while another holds it.
    #[default]
    Exclusive,
    /// Read-only and without the lock, so it works while a writer holds the device (whose
    /// writes it may or may not see): `corefs dump`, `corefs fsck -n`. Writes are refused.
    ReadShared,
    /// Read-write, sharing the lock that a live queue of this process already holds on the
    /// device (each reactor's own queue of one filesystem). Fails when this process holds
    /// none: it never makes a second writer.
    AnotherQueue,
}

/// Identifies a locked inode: the device and inode numbers of the file or device node.
type InodeKey = (u64, u64);

/// The exclusive lock on one device, shared by every queue of the process on it.
pub struct DeviceLock {
    /// A duplicate of the descriptor the lock was taken through: it shares that open file
    /// description, so the lock stays until this and the queue's own descriptor are closed.
    _fd: File,
    key: InodeKey,
}

impl std::fmt::Debug for DeviceLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceLock(dev {} ino {})", self.key.0, self.key.1)
    }
}

/// The locks this process holds, so that [`Access::AnotherQueue`] can share one. Weak: an entry
/// never keeps a lock alive.
static HELD: Mutex<Option<HashMap<InodeKey, Weak<DeviceLock>>>> = Mutex::new(None);

impl Drop for DeviceLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(map) = held.as_mut() {
            // Another lock of the same inode may have been registered since (after this one's
            // last queue was dropped and before this drop ran): keep a live entry.
            if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
                map.remove(&self.key);
            }
        }
    }
}

/// Who holds a device's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// The holder's pid, when it could be found.
    pub pid: Option<u32>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) if pid == std::process::id() => {
                write!(f, "held by pid {pid} (this process)")
            }
            Some(pid) => write!(f, "held by pid {pid}"),
            None => f.write_str("held by another process"),
        }
    }
}

fn key_of(file: &File, device: &str) -> Result<InodeKey, DevError> {
    let meta = file
        .metadata()
        .map_err(|e| DevError::setup(format!("stat {device}"), &e, ""))?;
    Ok((meta.dev(), meta.ino()))
}

fn whole_file_lock(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is plain integers; all-zero is a valid value that is then filled in.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 0; // to the end of the file, however it grows
    lock.l_pid = 0; // must be 0 for OFD locks
    lock
}

/// How long an exclusive open waits for a conflicting lock to go before it reports the device
/// busy. Why wait at all: a descriptor is copied into every child the process forks and stays
/// there until the child execs (`O_CLOEXEC` acts only then), and an OFD lock lives as long as
/// any copy of its open file description. So for a moment after a multi-threaded program
/// closes a device while another thread spawns a process, the closed device's lock lives on
/// in the child, and reopening the device then would fail for nothing. A real holder is
/// reported after this wait.
const BUSY_WAIT: Duration = Duration::from_secs(1);
const BUSY_RETRY: Duration = Duration::from_millis(10);

/// The lock an open with `access` holds, taken through `file` before the device is read or
/// written: the exclusive lock ([`lock_exclusive`]), a share of the one this process holds
/// ([`join`]), or none for a read-shared open. `device` names the device in errors.
pub(crate) fn for_access(
    file: &File,
    access: Access,
    device: &str,
) -> Result<Option<Arc<DeviceLock>>, DevError> {
    match access {
        Access::Exclusive => lock_exclusive(file, device).map(Some),
        Access::AnotherQueue => join(file, device).map(Some),
        Access::ReadShared => Ok(None),
    }
}

/// Takes the exclusive lock through `file` (opened for writing) and registers it for
/// [`Access::AnotherQueue`]. `device` names the device in errors.
pub(crate) fn lock_exclusive(file: &File, device: &str) -> Result<Arc<DeviceLock>, DevError> {
    let key = key_of(file, device)?;
    let lock = whole_file_lock(libc::F_WRLCK);
    let started = Instant::now();
    loop {
        // SAFETY: F_OFD_SETLK reads one struct flock through the pointer, which outlives the
        // call.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
        if rc == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        let conflict = matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES));
        if conflict && started.elapsed() < BUSY_WAIT {
            std::thread::sleep(BUSY_RETRY);
            continue;
        }
        return Err(match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EACCES) => DevError::Busy {
                device: device.to_string(),
                holder: Holder {
                    pid: holder_pid(key),
                }
                .to_string(),
            },
            _ => DevError::setup(
                format!("locking {device} for exclusive use"),
                &e,
                "corefs needs OFD locks (Linux 3.15+) on the filesystem holding the image, so \
                 that two writers cannot open it at once",
            ),
        });
    }
    let dup = file
        .try_clone()
        .map_err(|e| DevError::setup(format!("duplicating the descriptor of {device}"), &e, ""))?;
    let held = Arc::new(DeviceLock { _fd: dup, key });
    let mut table = HELD.lock().unwrap_or_else(|e| e.into_inner());
    table
        .get_or_insert_with(HashMap::new)
        .insert(key, Arc::downgrade(&held));
    Ok(held)
}

/// Shares the lock this process already holds on the device `file` refers to.
pub(crate) fn join(file: &File, device: &str) -> Result<Arc<DeviceLock>, DevError> {
    let key = key_of(file, device)?;
    let table = HELD.lock().unwrap_or_else(|e| e.into_inner());
    table
        .as_ref()
        .and_then(|map| map.get(&key))
        .and_then(Weak::upgrade)
        .ok_or_else(|| DevError::Setup {
            what: format!("opening another queue of {device}"),
            errno: libc::ENOLCK,
            hint: "this process does not hold the device: another queue is opened only while a \
                   queue opened for exclusive use is alive"
                .into(),
        })
}

/// Who holds the lock on the file `file` refers to (opened for reading or writing), if anyone.
pub(crate) fn holder(file: &File, device: &str) -> Result<Option<Holder>, DevError> {
    let key = key_of(file, device)?;
    let mut lock = whole_file_lock(libc::F_WRLCK);
    // SAFETY: F_OFD_GETLK reads and rewrites one struct flock through the pointer.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(DevError::setup(
            format!("testing the lock on {device}"),
            &e,
            "",
        ));
    }
    Ok(
        (lock.l_type != libc::F_UNLCK as libc::c_short).then(|| Holder {
            pid: holder_pid(key),
        }),
    )
}

/// Whether a writer holds the device a device string names (`None` for `mem:`, which no other
/// process can open). For read-only tools, to warn that what they show may be stale.
pub fn in_use(spec: &str) -> Result<Option<Holder>, DevError> {
    let (device, _) = crate::DeviceSpec::parse(spec, &crate::OpenOptions::default())?;
    let path = match device {
        crate::DeviceSpec::Nvme { path } | crate::DeviceSpec::File { path } => path,
        crate::DeviceSpec::Mem => return Ok(None),
    };
    let file = File::open(&path)
        .map_err(|e| DevError::setup(format!("opening {}", path.display()), &e, ""))?;
    holder(&file, &path.display().to_string())
}

/// The glibc encoding of a device number's major and minor halves.
fn major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// Whether a `/proc/locks` line (or the part of a fdinfo `lock:` line after the tag) is a
/// granted OFD write lock on `key`; returns the pid column.
fn parse_lock_line(line: &str, key: InodeKey) -> Option<i64> {
    let mut fields = line.split_whitespace();
    let _id = fields.next()?;
    let class = fields.next()?;
    // A waiter is shown as "N: -> OFDLCK ...": it holds nothing.
    if class != "OFDLCK" {
        return None;
    }
    let _advisory = fields.next()?;
    if fields.next()? != "WRITE" {
        return None;
    }
    let pid: i64 = fields.next()?.parse().ok()?;
    let mut place = fields.next()?.split(':');
    let major = u64::from_str_radix(place.next()?, 16).ok()?;
    let minor = u64::from_str_radix(place.next()?, 16).ok()?;
    let ino: u64 = place.next()?.parse().ok()?;
    ((major, minor) == major_minor(key.0) && ino == key.1).then_some(pid)
}

/// Most `/proc/*/fdinfo/*` files read while looking for a holder: the search runs only when an
/// open has already failed, but stays bounded on a machine with very many descriptors.
const FDINFO_SCAN_MAX: usize = 1 << 20;

/// The pid holding an OFD write lock on `key`, if it can be found.
fn holder_pid(key: InodeKey) -> Option<u32> {
    if let Ok(locks) = std::fs::read_to_string("/proc/locks") {
        for line in locks.lines() {
            if let Some(pid) = parse_lock_line(line, key) {
                if pid > 0 {
                    return u32::try_from(pid).ok();
                }
                // -1: the kernel does not say whose an OFD lock is; the fdinfo files do.
                break;
            }
        }
    }
    let mut scanned = 0usize;
    let own = std::process::id();
    // This process first: a conflict with one of its own queues is the common case in tests
    // and in programs that open a device twice.
    let pids = std::iter::once(own.to_string()).chain(
        std::fs::read_dir("/proc")
            .ok()?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.bytes().all(|b| b.is_ascii_digit()) && *name != own.to_string()),
    );
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(Path::new("/proc").join(&pid).join("fdinfo")) else {
            continue;
        };
        for fd in fds.flatten() {
            scanned += 1;
            if scanned > FDINFO_SCAN_MAX {
                return None;
            }
            let Ok(info) = std::fs::read_to_string(fd.path()) else {
                continue;
            };
            let found = info.lines().any(|line| {
                line.strip_prefix("lock:")
                    .is_some_and(|rest| parse_lock_line(rest, key).is_some())
            });
            if found {
                return pid.parse().ok();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_lines_are_matched_by_device_and_inode() {
        let key = ((0xfe << 8) | 0x01, 2162689);
        assert_eq!(
            parse_lock_line("1: OFDLCK ADVISORY  WRITE -1 fe:01:2162689 0 EOF", key),
            Some(-1)
        );
        assert_eq!(
            parse_lock_line("\t7: OFDLCK ADVISORY  WRITE 4242 fe:01:2162689 0 EOF", key),
            Some(4242)
        );
        for other in [
            "1: OFDLCK ADVISORY  WRITE -1 fe:01:2162680 0 EOF",
            "1: OFDLCK ADVISORY  WRITE -1 fe:02:2162689 0 EOF",
            "1: OFDLCK ADVISORY  READ -1 fe:01:2162689 0 EOF",
            "1: POSIX  ADVISORY  WRITE 77 fe:01:2162689 0 EOF",
            "1: -> OFDLCK ADVISORY  WRITE -1 fe:01:2162689 0 EOF",
            "garbage",
        ] {
            assert_eq!(parse_lock_line(other, key), None, "{other}");
        }
    }

    #[test]
    fn major_minor_follow_glibc() {
        // makedev(259, 3): an NVMe namespace's usual major.
        let dev = (3 & 0xff) | ((259 & 0xfff) << 8);
        assert_eq!(major_minor(dev), (259, 3));
        let big = (0x12345 & 0xff) | ((0x12345 & !0xff) << 12) | ((0x678 & 0xfff) << 8);
        assert_eq!(major_minor(big), (0x678, 0x12345));
    }
}
