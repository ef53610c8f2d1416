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
/// is done here. `system.` is refused whole: its names mean something to the kernel. POSIX
/// ACLs above all, which corefs does not store: a minimal one is taken as its chmod, any
/// other refused, so cp -a, tar and rsync fall back to modes instead of storing an ACL
/// nothing would apply ([`minimal_acl_bits`], [`is_posix_acl`]).
pub(super) fn xattr_namespace_stored(name: &OsStr) -> bool {
    let name = name.as_bytes();
    [&b"user."[..], b"trusted.", b"security."]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// The POSIX access ACL's extended attribute, which the kernel hands on as it is (corefs does
/// not ask for FUSE's POSIX ACL support).
pub(super) const ACL_ACCESS: &[u8] = b"system.posix_acl_access";

/// Whether `name` is one of the two POSIX ACL attributes. corefs stores no ACL, so reading or
/// removing one finds none (ENODATA, as ext4 answers for a file whose ACL is its mode);
/// setting one is [`minimal_acl_bits`]'s or refused.
pub(super) fn is_posix_acl(name: &OsStr) -> bool {
    [ACL_ACCESS, b"system.posix_acl_default"].contains(&name.as_bytes())
}

/// The permission bits (`0o777`) a *minimal* POSIX access ACL stands for: one owner, one
/// group and one other entry and nothing else, which says exactly what a mode says (ext4
/// stores no ACL for one either: `posix_acl_equiv_mode`). None for an extended ACL (named
/// users or groups, a mask) or one that is not the kernel's `posix_acl_xattr` encoding
/// (little-endian: a `u32` version 2, then `u16` tag, `u16` permissions, `u32` id per entry).
pub(super) fn minimal_acl_bits(value: &[u8]) -> Option<u32> {
    const VERSION: u32 = 2;
    const USER_OBJ: u16 = 0x01;
    const GROUP_OBJ: u16 = 0x04;
    const OTHER: u16 = 0x20;
    let (version, entries) = value.split_first_chunk::<4>()?;
    if u32::from_le_bytes(*version) != VERSION || entries.len() != 3 * 8 {
        return None;
    }
    let (mut owner, mut group, mut other) = (None, None, None);
    for entry in entries.chunks_exact(8) {
        let tag = u16::from_le_bytes([entry[0], entry[1]]);
        let perm = u32::from(u16::from_le_bytes([entry[2], entry[3]]));
        if perm > 0o7 {
            return None;
        }
        let slot = match tag {
            USER_OBJ => &mut owner,
            GROUP_OBJ => &mut group,
            OTHER => &mut other,
            _ => return None,
        };
        if slot.replace(perm).is_some() {
            return None;
        }
    }
    Some(owner? << 6 | group? << 3 | other?)
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

    fn acl(entries: &[(u16, u16)]) -> Vec<u8> {
        let mut out = 2u32.to_le_bytes().to_vec();
        for &(tag, perm) in entries {
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&perm.to_le_bytes());
            out.extend_from_slice(&u32::MAX.to_le_bytes());
        }
        out
    }

    /// A minimal ACL is its mode bits, in any entry order; an extended, repeated, truncated or
    /// other-version one is none.
    #[test]
    fn a_minimal_acl_is_its_mode_bits_and_nothing_else_is() {
        assert_eq!(
            minimal_acl_bits(&acl(&[(0x01, 6), (0x04, 4), (0x20, 0)])),
            Some(0o640)
        );
        assert_eq!(
            minimal_acl_bits(&acl(&[(0x20, 7), (0x01, 5), (0x04, 1)])),
            Some(0o517)
        );
        let extended = [
            acl(&[(0x01, 6), (0x02, 4), (0x04, 4), (0x10, 4), (0x20, 0)]),
            acl(&[(0x01, 6), (0x04, 4), (0x10, 4)]),
            acl(&[(0x01, 6), (0x01, 4), (0x20, 0)]),
            acl(&[(0x01, 6), (0x04, 8), (0x20, 0)]),
            acl(&[(0x01, 6), (0x04, 4)]),
        ];
        for value in &extended {
            assert_eq!(minimal_acl_bits(value), None, "{value:?}");
        }
        let mut version_1 = acl(&[(0x01, 6), (0x04, 4), (0x20, 0)]);
        version_1[0] = 1;
        assert_eq!(minimal_acl_bits(&version_1), None);
        assert_eq!(minimal_acl_bits(&[2, 0, 0]), None);
    }

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
