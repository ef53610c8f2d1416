//! What clients ask a reactor to do, and what comes back.

use engine::fs::StatFs;
use engine::{DirEntry, EngineError, FallocateMode, RenameFlags, SetAttr, Stat, XattrFlags};

/// Who creates an inode: its owner and group (the caller's, as the kernel passes them to
/// FUSE or as a C program's credentials are; a set-group-ID directory overrides the group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// root:root, what tools and tests that act for nobody in particular use.
    pub const ROOT: Owner = Owner { uid: 0, gid: 0 };
}

/// One engine operation. Inode numbers and names are the engine's (see `engine`).
#[derive(Debug, Clone)]
pub enum Op {
    /// A path from the root (`a/b/c`; leading and repeated slashes ignored) to its inode.
    Resolve {
        path: String,
    },
    /// A path relative to directory `dir` to its inode (what a reactor forwards to the one
    /// holding the next directory of a path).
    ResolveAt {
        dir: u64,
        path: String,
    },
    Lookup {
        dir: u64,
        name: Vec<u8>,
    },
    Create {
        dir: u64,
        name: Vec<u8>,
        mode: u32,
        owner: Owner,
    },
    /// [`Op::Create`] and [`Op::Hold`] of the new file in one request, so nothing (an unlink
    /// of the new name) runs between them: what open(2) with O_CREAT does, atomically.
    /// Release the hold as after [`Op::Hold`].
    CreateHeld {
        dir: u64,
        name: Vec<u8>,
        mode: u32,
        owner: Owner,
    },
    Mkdir {
        dir: u64,
        name: Vec<u8>,
        mode: u32,
        owner: Owner,
    },
    Symlink {
        dir: u64,
        name: Vec<u8>,
        target: Vec<u8>,
        owner: Owner,
    },
    /// mknod(2): a FIFO, socket, device (`rdev`) or regular file.
    Mknod {
        dir: u64,
        name: Vec<u8>,
        mode: u32,
        rdev: u64,
        owner: Owner,
    },
    Readlink {
        ino: u64,
    },
    Link {
        ino: u64,
        dir: u64,
        name: Vec<u8>,
    },
    Unlink {
        dir: u64,
        name: Vec<u8>,
    },
    Rmdir {
        dir: u64,
        name: Vec<u8>,
    },
    Rename {
        from_dir: u64,
        from: Vec<u8>,
        to_dir: u64,
        to: Vec<u8>,
        flags: RenameFlags,
    },
    Readdir {
        dir: u64,
        cookie: u64,
        max: usize,
    },
    Stat {
        ino: u64,
    },
    SetAttr {
        ino: u64,
        change: SetAttr,
    },
    Read {
        ino: u64,
        offset: u64,
        len: usize,
    },
    Write {
        ino: u64,
        offset: u64,
        data: Vec<u8>,
    },
    /// Writes at the end of the file, atomically (O_APPEND): [`Reply::Appended`].
    Append {
        ino: u64,
        data: Vec<u8>,
    },
    /// An open handle or kernel reference to `ino`: while one is held, the inode outlives
    /// its last name (an orphan), and goes at the last [`Op::Release`].
    Hold {
        ino: u64,
    },
    Release {
        ino: u64,
    },
    Truncate {
        ino: u64,
        size: u64,
    },
    Fallocate {
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    },
    SetXattr {
        ino: u64,
        name: Vec<u8>,
        value: Vec<u8>,
        flags: XattrFlags,
    },
    GetXattr {
        ino: u64,
        name: Vec<u8>,
    },
    ListXattr {
        ino: u64,
    },
    RemoveXattr {
        ino: u64,
        name: Vec<u8>,
    },
    /// Grouped with the other fsyncs that arrive while the reactor is busy: one log record
    /// and one flush for all of them.
    Fsync {
        ino: u64,
    },
    Fdatasync {
        ino: u64,
    },
    /// An atomic batch's commit (engine `atomic`): applies `writes` to `ino` in one operation
    /// and makes them durable with the fsyncs grouped with it — one log record holds all of
    /// them, or a commit does. Answers [`Reply::Done`] once durable; a crash before leaves
    /// none of them.
    WriteAtomic {
        ino: u64,
        writes: Vec<(u64, Vec<u8>)>,
    },
    /// Commits; returns at SuperCommitted.
    Sync,
    Statfs,
    /// A snapshot of the reactor's statistics.
    Stats,
}

impl Op {
    /// True for operations that normally complete without waiting for the device (metadata
    /// changes, lookups, staged writes): a client waiting on one yields its core instead of
    /// sleeping, since a sleeping client costs the reactor a wake-up that takes longer than
    /// the operation.
    pub(crate) fn is_quick(&self) -> bool {
        !matches!(
            self,
            Op::Fsync { .. }
                | Op::Fdatasync { .. }
                | Op::WriteAtomic { .. }
                | Op::Sync
                | Op::Read { .. }
        )
    }

    pub(crate) fn is_fsync(&self) -> Option<(u64, bool)> {
        match self {
            Op::Fsync { ino } => Some((*ino, false)),
            Op::Fdatasync { ino } => Some((*ino, true)),
            _ => None,
        }
    }
}

/// A successful operation's result.
#[derive(Debug, Clone)]
pub enum Reply {
    Done,
    Stat(Stat),
    Entries(Vec<DirEntry>),
    Data(Vec<u8>),
    Written(usize),
    /// An append: where it wrote and how much.
    Appended {
        offset: u64,
        written: usize,
    },
    Names(Vec<Vec<u8>>),
    Statfs(StatFs),
    Stats(Box<crate::stats::ReactorStats>),
}

/// An operation's outcome, with the token its client gave it.
#[derive(Debug)]
pub struct Completion {
    pub token: u64,
    pub result: Result<Reply, EngineError>,
}
