//! The mount: starting the FUSE session (its threads, options and access), widening the
//! kernel's read-ahead for it, and ending it without unmounting what is no longer there.

use super::{CorefsFuse, SESSION_THREADS};
use fuser::{FopenFlags, InitFlags, SessionACL};
use reactor::Runtime;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Who may use a mount besides its mounter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The mounter alone (FUSE's default).
    Mounter,
    /// Every user (`allow_other`), the kernel checking each one's permissions. A mounter
    /// other than root needs `user_allow_other` in /etc/fuse.conf for fusermount3 to allow it.
    Everyone,
}

/// The INIT flags the mount asks for:
/// - parallel lookups and readdirs in one directory (FUSE_PARALLEL_DIROPS: the reactor
///   orders what must be ordered, so the kernel need not serialize lookups of one directory);
/// - listings with attributes (FUSE_DO_READDIRPLUS), when the kernel judges them useful
///   (FUSE_READDIRPLUS_AUTO: a listing's first batch, and later ones of a directory whose
///   names were looked up since). A tool that stats what it lists then makes no LOOKUP per
///   name: after `drop_caches`, `find -printf '%s %m'` and `du -s` of a copy of
///   /usr/include (8,900 entries) took 0.15 and 0.14 s against 0.29 and 0.27 s without
///   (ext4 on a loop device: 0.13 and 0.12 s), `ls -l` of 10,000 files 0.38-0.50 s against
///   0.57-0.65 s (the rest is its two GETXATTRs per file). Asked always (no AUTO), plain
///   `ls` of those 10,000 names took three times as long (0.065 s against 0.022 s), each
///   name costing a hold and a stat nobody used, for 5-10% more on `find` and `du`.
/// - killing privileges in the server (FUSE_HANDLE_KILLPRIV_V2, [`super::kill_privs`]):
///   otherwise the kernel asks for `security.capability` before every write(2), a GETXATTR
///   request beside each WRITE.
///
/// Not the kernel's writeback cache (FUSE_WRITEBACK_CACHE), though it would let write(2)
/// return once the page cache holds the data: a write error (ENOSPC, EIO) would then come
/// back from fsync or close instead of the write, so a writer checking neither (`dd` filling
/// the disk) wrote on forever into pages that could not go back (the mount test of a full
/// filesystem never ended); and on this VM it was slower, not faster (scripts/fuse-bench.sh,
/// medians of 3: `cp -a /usr/include` 3.23 s against 2.45 s, 1 GiB `dd` write+fsync 1.07 s
/// against 0.73 s).
pub(super) const INIT_FLAGS: InitFlags = InitFlags::FUSE_PARALLEL_DIROPS
    .union(InitFlags::FUSE_DO_READDIRPLUS)
    .union(InitFlags::FUSE_READDIRPLUS_AUTO)
    .union(InitFlags::FUSE_HANDLE_KILLPRIV_V2);

/// The flags of an open or create reply for a file whose attributes are `stat`, on a mount
/// whose atime rule is `atime`. The filesystem changes through this mount alone while it is
/// mounted (the device is held exclusively), so the kernel's cached pages can only be stale
/// about what the server does on its own, and the only such thing is atime: a read the page
/// cache answers never reaches the engine. So the pages are kept across the open
/// (FOPEN_KEEP_CACHE) only when no read would move atime: noatime always; relatime while atime
/// is after mtime and ctime and less than a day old, which the first read after a change makes
/// so; strictatime never. Otherwise the open drops the file's cached pages and its first read
/// goes to the engine, as every open did before (a 1 GiB file read again took 1.11 s, ext4
/// 0.04 s; kept: 0.17 s). With noatime, opens make no request at all where the kernel offers
/// zero-message opens ([`super::CorefsFuse`]).
pub(super) fn open_flags(atime: engine::Atime, stat: &engine::Stat) -> FopenFlags {
    if atime.moves_stat(stat, engine::format::items::Timespec::now()) {
        FopenFlags::empty()
    } else {
        FopenFlags::FOPEN_KEEP_CACHE
    }
}

/// The read-ahead window the mount asks for: one FUSE request (the kernel's 256-page cap on
/// a request, which fuser negotiates).
pub const READAHEAD_KB: u32 = 1024;

/// Widens the kernel's read-ahead for the mount at `mountpoint` to [`READAHEAD_KB`]. FUSE's
/// init caps a mount's window at the kernel's default (128 KiB), so a 1 MiB `dd` of a cold
/// 1 GiB file ran at half a kernel filesystem's speed (1.99 s, ext4 0.98 s); with 1 MiB it
/// took 0.92 s (4 MiB: 1.01 s). The window lives in sysfs (`/sys/class/bdi/MAJ:MIN/
/// read_ahead_kb`), writable by root only: a mount by another user keeps the kernel's and
/// says how to widen it. The mount's device number comes from /proc/self/mountinfo, not
/// from a stat of the mountpoint: a stat would hold the new mount while the server answers
/// it, and an unmount right after the mount then failed as busy.
fn widen_readahead(mountpoint: &Path) {
    let Some(dev) = mount_device(mountpoint) else {
        tracing::info!(
            "read-ahead left as the kernel set it ({} not in /proc/self/mountinfo)",
            mountpoint.display()
        );
        return;
    };
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    match std::fs::write(&knob, READAHEAD_KB.to_string()) {
        Ok(()) => tracing::debug!("{knob}: {READAHEAD_KB}"),
        Err(e) => tracing::info!(
            "read-ahead left at the kernel's 128 KiB ({knob}: {e}); as root: echo \
             {READAHEAD_KB} > {knob}"
        ),
    }
}

/// The `MAJ:MIN` of the newest mount at `mountpoint` (canonical), from /proc/self/mountinfo
/// (whose paths escape space, tab, newline and backslash as octal).
fn mount_device(mountpoint: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let mut want = Vec::new();
    for &b in mountpoint.as_os_str().as_bytes() {
        match b {
            b' ' | b'\t' | b'\n' | b'\\' => want.extend(format!("\\{b:03o}").bytes()),
            _ => want.push(b),
        }
    }
    let info = std::fs::read("/proc/self/mountinfo").ok()?;
    info.split(|&b| b == b'\n').rev().find_map(|line| {
        let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
        if fields.get(4) != Some(&want.as_slice()) {
            return None;
        }
        fields
            .get(2)
            .map(|dev| String::from_utf8_lossy(dev).into_owned())
    })
}

/// Mounts `runtime`'s filesystem at `mountpoint` and serves it until unmounted.
pub fn serve(
    runtime: Runtime,
    mountpoint: &Path,
    access: Access,
    atime: engine::Atime,
) -> std::io::Result<()> {
    // Default permissions: the kernel checks modes against the caller, as for a kernel
    // filesystem (the engine stores modes and owners but does not check them).
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("corefs".into()),
        fuser::MountOption::Subtype("corefs".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    // The session threads read one descriptor, not clones of it (FUSE_DEV_IOC_CLONE): the
    // kernel finds the request a reply answers among those read from the descriptor the reply
    // is written to, and fuser answers FUSE_INTERRUPT (ENOSYS, so the kernel stops sending
    // them) from whichever thread read the interrupt. With clones that was often another
    // descriptor than the interrupted request's, and the reply failed with ENOENT, logged as
    // an error (2 pjdfstest runs in 7 stopped on it).
    config.n_threads = Some(SESSION_THREADS);
    config.clone_fd = false;
    config.acl = match access {
        Access::Mounter => SessionACL::Owner,
        Access::Everyone => SessionACL::All,
    };
    let mountpoint = std::fs::canonicalize(mountpoint)?;
    let notifier = std::sync::Arc::new(std::sync::OnceLock::new());
    let fs = CorefsFuse::new(runtime, atime, notifier.clone());
    let mut session = fuser::spawn_mount(fs, &mountpoint, &config)?;
    let _ = notifier.set(session.notifier());
    widen_readahead(&mountpoint);
    // The session ends when the kernel's connection does (after `destroy` has committed).
    // The handle is swapped for a finished thread's so `session`, which unmounts when
    // dropped, stays whole until it is decided below whether it should.
    let serving = std::mem::replace(&mut session.guard, std::thread::spawn(|| Ok(())));
    let ended = serving
        .join()
        .map_err(|_| std::io::Error::other("the FUSE session thread panicked"))?;
    // After `umount` or `fusermount3 -u` there is nothing left to unmount, but fuser 0.18
    // would try again (its check of the connection reads POLLERR, which says the connection
    // is gone, as "still mounted") and log "Unmount failed: Invalid argument" at every clean
    // unmount; worse, the second umount could hit a filesystem mounted there since. So the
    // session is dropped (and fuser unmounts) only while the mount is still there: when the
    // connection ended some other way (aborted through /sys/fs/fuse/connections).
    if is_mounted_at(&mountpoint) {
        drop(session);
    } else {
        std::mem::forget(session);
    }
    ended
}

/// What to do about a mount that failed with `e`, if something is known ("" otherwise): a
/// user other than root mounts through fusermount3, which fuser reaches only after opening
/// /dev/fuse itself, so the device must be open to them (mode 0666, as fuse3's udev rule
/// sets it; some containers leave it 0600).
pub fn mount_hint(e: &std::io::Error) -> &'static str {
    // SAFETY: geteuid has no preconditions; access reads a NUL-terminated path.
    let refused = e.kind() == std::io::ErrorKind::PermissionDenied
        && unsafe { libc::geteuid() } != 0
        && unsafe { libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) } != 0;
    if refused {
        " (/dev/fuse is not readable and writable by this user: a user other than root \
         mounts through fusermount3 once /dev/fuse is mode 0666, as fuse3's udev rule sets it)"
    } else {
        ""
    }
}

/// Whether a corefs FUSE mount (source "corefs") is at `mountpoint` (canonical), per
/// /proc/self/mountinfo.
fn is_mounted_at(mountpoint: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return true; // unknown: let fuser try, as it would
    };
    info.lines().any(|line| {
        // "id parent major:minor root mountpoint options [optional...] - fstype source ..."
        let mut halves = line.splitn(2, " - ");
        let (Some(left), Some(right)) = (halves.next(), halves.next()) else {
            return false;
        };
        let at = left.split(' ').nth(4).map(unescape_mountinfo);
        let mut fs = right.split(' ');
        // "fuse" when mounted directly (as root), "fuse.corefs" through fusermount3.
        let fuse = fs.next().is_some_and(|t| t == "fuse" || t == "fuse.corefs");
        let corefs = fs.next() == Some("corefs");
        at.as_deref() == Some(mountpoint.as_os_str().as_bytes()) && fuse && corefs
    })
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo` (octal).
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(
            unescape_mountinfo(r"/mnt/a\040b\134c"),
            b"/mnt/a b\\c".to_vec()
        );
        assert_eq!(unescape_mountinfo(r"/x\04"), b"/x\\04".to_vec());
    }
}
