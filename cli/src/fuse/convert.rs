//! Translations between FUSE's types and the engine's: errnos, inode numbers, times, file
//! kinds and attributes, the reactor calls that answer with them, and which extended
//! attribute namespaces are stored.

use engine::format::items::Timespec;
use engine::inode::ROOT_INO;
use engine::{EngineError, Stat};
use fuser::{Errno, FileAttr, FileType, INodeNo, ReplyXattr, Request, TimeOrNow};
use reactor::{Client, Op, Reply};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(super) fn call(client: &mut Client, op: Op) -> Result<Reply, i32> {
    client.call(op).map_err(|e| errno(&e))
}

pub(super) fn stat_reply(client: &mut Client, op: Op) -> Result<Stat, i32> {
    expect!(call(client, op)?, Reply::Stat)
}

/// An errno as fuser takes it (`e` is never 0: [`errno`] maps 0 to EIO).
pub(super) fn fuse_errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

pub(super) fn errno(e: &EngineError) -> i32 {
    match e.errno() {
        0 => libc::EIO,
        n => n,
    }
}

/// The inode owner a FUSE request creates with: the calling process's user and group, as
/// the kernel passes them.
pub(super) fn owner_of(req: &Request) -> reactor::Owner {
    reactor::Owner {
        uid: req.uid(),
        gid: req.gid(),
    }
}

pub(super) fn to_engine(ino: INodeNo) -> u64 {
    if ino == INodeNo::ROOT {
        ROOT_INO
    } else {
        ino.0
    }
}

pub(super) fn to_fuse(ino: u64) -> INodeNo {
    if ino == ROOT_INO {
        INodeNo::ROOT
    } else {
        INodeNo(ino)
    }
}

/// An engine time (whole seconds rounded down, negative before 1970, and nanoseconds after
/// them) as the `SystemTime` fuser sends the kernel; times past what `SystemTime` holds are
/// clamped to the epoch rather than panicking.
pub(super) fn time_of(t: Timespec) -> SystemTime {
    let nsec = Duration::from_nanos(u64::from(t.nsec));
    let time = if t.sec >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(t.sec.unsigned_abs()))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(t.sec.unsigned_abs()))
    };
    time.and_then(|t| t.checked_add(nsec)).unwrap_or(UNIX_EPOCH)
}

/// A time the kernel asks setattr to set, as the engine stores it.
///
/// fuser 0.18 turns the kernel's (seconds, nanoseconds) for a time before 1970 — seconds
/// negative, rounded down, nanoseconds after them — into `UNIX_EPOCH - (|seconds| +
/// nanoseconds)` where `UNIX_EPOCH - |seconds| + nanoseconds` is meant (its
/// `system_time_from_time`, marked as a to-do there). This takes the two fields back out of
/// that, so a pre-1970 time keeps its fraction. fuser is pinned (`=0.18.0`) and
/// cli/tests/mount.rs round-trips a pre-1970 time with nanoseconds through a mount, which
/// fails if fuser's conversion changes.
pub(super) fn timespec_set(t: TimeOrNow) -> Timespec {
    let t = match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => return Timespec::now(),
    };
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            nsec: d.subsec_nanos(),
        },
        Err(before) => {
            let d = before.duration();
            Timespec {
                sec: i64::try_from(d.as_secs()).map_or(i64::MIN, |s| -s),
                nsec: d.subsec_nanos(),
            }
        }
    }
}

pub(super) fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

pub(super) fn attr(s: &Stat) -> FileAttr {
    FileAttr {
        ino: to_fuse(s.ino),
        size: s.size,
        blocks: s.blocks_512,
        atime: time_of(s.atime),
        mtime: time_of(s.mtime),
        ctime: time_of(s.ctime),
        // Linux's FUSE protocol carries no birth time (statx shows none); macOS shows it.
        crtime: time_of(s.crtime),
        kind: kind_of(s.mode),
        perm: (s.mode & 0o7777) as u16,
        nlink: s.nlink,
        uid: s.uid,
        gid: s.gid,
        // The kernel's encoding of a device number (new_encode_dev), as mknod passed it.
        rdev: u32::try_from(s.rdev).unwrap_or(0),
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of a negative entry: inode 0, which FUSE reads as "no such name", cached
/// for the entry's timeout. The kernel looks at nothing else in them.
pub(super) fn negative_entry() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// Whether an extended attribute's name is in a namespace corefs stores: `user.`,
/// `trusted.` and `security.`, as ext4. The kernel hands a FUSE filesystem every name, where
/// a kernel filesystem's handlers answer EOPNOTSUPP to a namespace they do not know, so that
/// is done here. `system.` is refused whole: its names mean something to the kernel (POSIX
/// ACLs above all, which corefs does not support; refusing them makes cp -a, tar and rsync
/// fall back to chmod, instead of storing an ACL whose mode bits nothing would apply).
pub(super) fn xattr_namespace_stored(name: &OsStr) -> bool {
    let name = name.as_bytes();
    [&b"user."[..], b"trusted.", b"security."]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// getxattr/listxattr's two-step protocol: size 0 asks for the length.
pub(super) fn xattr_reply(reply: ReplyXattr, data: &[u8], size: u32) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A time before 1970 with a fraction keeps it both ways: what fuser 0.18 makes of the
    /// kernel's (-2 s, 800 ms) for -1.2 s comes back as the same two fields, and the engine's
    /// fields go out as -1.2 s.
    #[test]
    fn times_before_1970_keep_their_fraction() {
        // fuser's conversion of the kernel's fields (seconds < 0): EPOCH - (|s| + ns).
        let from_fuser = UNIX_EPOCH - Duration::new(2, 800_000_000);
        let t = timespec_set(TimeOrNow::SpecificTime(from_fuser));
        assert_eq!((t.sec, t.nsec), (-2, 800_000_000));
        let later = UNIX_EPOCH + Duration::new(5, 7);
        let t = timespec_set(TimeOrNow::SpecificTime(later));
        assert_eq!((t.sec, t.nsec), (5, 7));
        assert_eq!(
            time_of(Timespec {
                sec: -2,
                nsec: 800_000_000
            }),
            UNIX_EPOCH - Duration::from_millis(1200)
        );
        // Past what SystemTime holds: some time, not a panic in a FUSE worker.
        time_of(Timespec {
            sec: i64::MIN,
            nsec: 999_999_999,
        });
        time_of(Timespec {
            sec: i64::MAX,
            nsec: 999_999_999,
        });
    }
}
