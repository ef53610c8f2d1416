//! Inodes: numbering, sharding, loading and storing inode items, attributes.
//!
//! An inode lives in shard `ino % shard_count`: its inode item, back-references, extents and
//! xattrs are all in that shard's tree. A directory's entries (directory and index items) live
//! in the directory's shard. New inodes are spread over shards round-robin, so creates in one
//! directory spread their inode items over every shard.
//!
//! Each shard hands out inode numbers of its own residue class, counting up from a per-shard
//! counter item (object id [`INO_COUNTER_OBJECTID`]), so shards never coordinate to allocate.

use crate::format::items::FIRST_INODE;
use crate::format::items::{InodeItem, Timespec};
use crate::format::{ItemKind, Key};

mod ops;

/// Object id of each shard's next-inode counter item.
pub const INO_COUNTER_OBJECTID: u64 = 2;
/// Object id of the orphan index items ([`ItemKind::OrphanIndex`]).
pub const ORPHAN_OBJECTID: u64 = 3;
/// The root directory's inode number.
pub const ROOT_INO: u64 = FIRST_INODE;

pub const S_IFMT: u32 = 0o170000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFIFO: u32 = 0o010000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFSOCK: u32 = 0o140000;
pub const S_ISGID: u32 = 0o2000;

/// File attributes as `stat` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stat {
    pub ino: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// 512-byte units, as st_blocks.
    pub blocks_512: u64,
    pub rdev: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    /// Birth time: when the inode was created (statx's btime).
    pub crtime: Timespec,
}

/// When a read moves a file's access time (mount option; Linux's `relatime`, `noatime`,
/// `strictatime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Atime {
    /// Only when the access time is not after the last modification or change, or is a day
    /// old: a program can still tell whether a file was read since it was written (mail
    /// readers, tmpwatch), and a file read over and over changes once a day, not once a
    /// read.
    #[default]
    Relative,
    /// Never.
    Never,
    /// On every read (each one dirties the inode, which the next commit writes).
    Strict,
}

impl Atime {
    /// Whether a read at `now` moves `item`'s access time.
    pub fn moves(self, item: &InodeItem, now: Timespec) -> bool {
        self.moves_times(item.atime, item.mtime, item.ctime, now)
    }

    /// [`Atime::moves`] for a file whose attributes are `stat` (what a server answering
    /// reads from a cache decides by: FUSE's page cache is kept across opens only while no
    /// read would move atime).
    pub fn moves_stat(self, stat: &Stat, now: Timespec) -> bool {
        self.moves_times(stat.atime, stat.mtime, stat.ctime, now)
    }

    fn moves_times(self, atime: Timespec, mtime: Timespec, ctime: Timespec, now: Timespec) -> bool {
        const DAY_SECS: i64 = 24 * 60 * 60;
        match self {
            Atime::Never => false,
            Atime::Strict => atime != now,
            Atime::Relative => {
                atime <= mtime || atime <= ctime || now.sec.saturating_sub(atime.sec) >= DAY_SECS
            }
        }
    }

    pub fn from_name(name: &str) -> Option<Atime> {
        match name {
            "relatime" => Some(Atime::Relative),
            "noatime" => Some(Atime::Never),
            "strictatime" => Some(Atime::Strict),
            _ => None,
        }
    }
}

impl Stat {
    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }
    pub fn is_symlink(&self) -> bool {
        self.mode & S_IFMT == S_IFLNK
    }
}

/// Attribute changes for [`Filesystem::setattr`](crate::Filesystem::setattr); `None` leaves a field alone.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Timespec>,
    pub mtime: Option<Timespec>,
}

pub(crate) fn inode_key(ino: u64) -> Key {
    Key::new(ino, ItemKind::InodeItem, 0)
}

/// What the namespace owns of a filesystem: where new inodes go and their numbers, the holds
/// on inodes, and the directory index items waiting for the commit.
pub(crate) struct Namespace {
    /// Round-robin cursor spreading new inodes over shards.
    pub next_create_shard: u64,
    /// Each shard's next inode number, once read; `ino_counters_dirty` marks the ones the next
    /// commit must write.
    pub ino_counters: Vec<Option<u64>>,
    pub ino_counters_dirty: Vec<bool>,
    /// Holds per inode ([`Filesystem::hold`](crate::Filesystem::hold)): open files, kernel references.
    pub inode_holds: std::collections::HashMap<u64, u32>,
    /// Directory index items waiting for the commit ([`crate::delayed`]).
    pub delayed: crate::delayed::DelayedIndex,
}

impl Namespace {
    /// Nothing read, held or delayed yet over `shards` shards; new inodes start at shard
    /// `first_shard` (round-robin).
    pub fn new(shards: usize, first_shard: u64) -> Namespace {
        Namespace {
            next_create_shard: first_shard,
            ino_counters: vec![None; shards],
            ino_counters_dirty: vec![false; shards],
            inode_holds: Default::default(),
            delayed: crate::delayed::DelayedIndex::new(shards as u32),
        }
    }
}

/// Where mount finds orphan `ino`: its index item, in its own shard.
pub(crate) fn orphan_index_key(ino: u64) -> Key {
    Key::new(ORPHAN_OBJECTID, ItemKind::OrphanIndex, ino)
}

#[cfg(test)]
mod tests {
    use super::Atime;

    use crate::format::items::{InodeItem, Timespec};

    fn at(sec: i64) -> Timespec {
        Timespec { sec, nsec: 0 }
    }

    /// relatime's three reasons to move, and its one reason not to.
    #[test]
    fn relatime_moves_when_not_after_a_change_or_a_day_old() {
        let now = at(1_000_000);
        let item = |atime: i64, mtime: i64, ctime: i64| InodeItem {
            atime: at(atime),
            mtime: at(mtime),
            ctime: at(ctime),
            ..Default::default()
        };
        let r = Atime::Relative;
        assert!(r.moves(&item(10, 10, 5), now), "atime == mtime");
        assert!(r.moves(&item(10, 5, 20), now), "atime before ctime");
        assert!(
            !r.moves(&item(999_000, 5, 5), now),
            "read since the last change"
        );
        assert!(r.moves(&item(1_000_000 - 86_400, 5, 5), now), "a day old");
        assert!(
            !r.moves(&item(1_000_000 - 86_399, 5, 5), now),
            "not quite a day"
        );
        assert!(!Atime::Never.moves(&item(10, 10, 10), now));
        assert!(Atime::Strict.moves(&item(999_999, 5, 5), now));
        assert!(
            !Atime::Strict.moves(&item(1_000_000, 5, 5), now),
            "same instant"
        );
        for name in ["relatime", "noatime", "strictatime"] {
            assert!(Atime::from_name(name).is_some(), "{name}");
        }
        assert_eq!(Atime::from_name("atime"), None);
    }
}
