//! What clients ask a reactor to do, and what comes back.

use engine::fs::StatFs;
use engine::{DirEntry, EngineError, FallocateMode, RenameFlags, SetAttr, Stat, XattrFlags};

/// Who creates an inode: its owner and group (the caller's, as the kernel passes them to
/// FUSE or as a C program's credentials are; a set-group-ID directory overrides the group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// root:root, what tools and tests that act for nobody in particular use.
    pub const ROOT: Owner = Owner { uid: 0, gid: 0 };
}

/// What [`Op::Open`] does besides holding what it opens: open(2)'s flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OpenHow {
    /// O_CREAT: a missing name is created as a regular file with this mode (permission bits)
    /// and owner; an existing directory is EISDIR.
    pub create: Option<(u32, Owner)>,
    /// O_EXCL with O_CREAT: an existing name is EEXIST.
    pub exclusive: bool,
    /// Opened for writing: a directory is EISDIR.
    pub writable: bool,
    /// Opened for reading. The engine does not look at it; the storage service checks the
    /// caller's read permission with it, as open(2) does.
    pub readable: bool,
    /// O_TRUNC (with `writable`): an existing file that is not a directory is cut to zero.
    pub truncate: bool,
    /// O_DIRECTORY, or a path ending in `/`: anything but a directory is ENOTDIR.
    pub directory: bool,
}

/// A read or write of at least this many bytes is a large transfer
/// ([`Op::is_large_transfer`]): about 150 µs of this VM's disk at 1.6 GB/s.
pub const LARGE_TRANSFER_BYTES: usize = 256 << 10;

/// What [`Op::Open`] opened.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub enum Opened {
    /// An existing inode, held (and truncated if asked).
    Found(Stat),
    /// A new file, held.
    Created(Stat),
    /// The inode to open by number (an empty name) no longer exists: its last name went
    /// after the caller (or the reactor that handed the open on) found it. Start over, as if
    /// the open came after that unlink.
    Gone,
}

/// A rename's `to_dir` inside a walk that means "the directory the walk reached" (no inode
/// is numbered 0).
pub const SAME_DIR: u64 = 0;

/// One engine operation. Inode numbers and names are the engine's (see `engine`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Op {
    /// Walks `path` (names, each looked up in the directory before it) from directory
    /// `from`, then runs `then` on the inode reached: its target ([`Op::target_mut`]: the
    /// directory of a name operation, the inode of any other) is replaced by it. One request
    /// for what a path names, however long the path: a reactor walks as far as it holds the
    /// directories and hands the rest on to the reactor holding the next one.
    Walk {
        from: u64,
        path: Vec<Vec<u8>>,
        #[serde(deserialize_with = "walk_then")]
        then: Box<Op>,
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
    /// open(2) of `name` in `dir` (an empty name: `dir` itself) in one request: looks it up,
    /// creates it if absent and asked to, checks its kind against `how`, holds it, and cuts
    /// it to zero if asked to. Answers [`Reply::Opened`]; the hold is released as after
    /// [`Op::Hold`]. Nothing runs between the lookup and the hold, so the inode opened is the
    /// one the name named.
    Open {
        dir: u64,
        name: Vec<u8>,
        how: OpenHow,
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
    /// Moves `from` in `from_dir` to `to` in `to_dir`. Carried by a walk, `from_dir` is the
    /// directory the walk reached, and so is `to_dir` when it is [`SAME_DIR`] (a rename within
    /// one directory, the common one: a file written aside and renamed over the old).
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
    /// The bytes are shared ([`engine::Staged`]): the engine stages them as they are
    /// ([`engine::Filesystem::write_shared`]) and, when they are aligned
    /// ([`nvme::staging_copy`]), the device writes them back from there; a request parked to
    /// run again keeps them. Made with [`engine::Staged::copy_of`], they bring their blocks'
    /// crcs, taken while the copy was hot. Read from a message (the storage service's), they
    /// are copied once, into a staging copy ([`staged_in`]).
    Write {
        ino: u64,
        offset: u64,
        #[serde(serialize_with = "staged_out", deserialize_with = "staged_in")]
        data: engine::Staged,
    },
    /// Writes at the end of the file, atomically (O_APPEND): [`Reply::Appended`].
    Append {
        ino: u64,
        #[serde(serialize_with = "staged_out", deserialize_with = "staged_in")]
        data: engine::Staged,
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
        #[serde(with = "serde_bytes")]
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

/// A walk's `then` as read from bytes someone else wrote (the storage service's clients): a
/// walk is never inside a walk, so a message nesting walks is refused at the second one
/// rather than recursed into (a hostile client's deep nesting would overflow the stack).
fn walk_then<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<Op>, D::Error> {
    use serde::de::Error as _;
    use serde::Deserialize as _;
    thread_local!(static IN_WALK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if IN_WALK.with(|w| w.replace(true)) {
        return Err(D::Error::custom("a walk inside a walk"));
    }
    let then = Op::deserialize(d);
    IN_WALK.with(|w| w.set(false));
    then.map(Box::new)
}

/// A write's bytes as written to a message: the bytes alone (their blocks' crcs are worked
/// out again by the side that reads them, [`staged_in`]).
fn staged_out<S: serde::Serializer>(data: &engine::Staged, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(data)
}

/// A write's bytes as read from a message: copied once, out of the message and into a
/// staging copy ([`engine::Staged::copy_of`]: aligned when large, so the device writes from
/// it, and each block's crc32c taken as it is copied), instead of into an ordinary allocation
/// that the write back would copy again.
fn staged_in<'de, D: serde::Deserializer<'de>>(d: D) -> Result<engine::Staged, D::Error> {
    struct Staged;
    impl<'de> serde::de::Visitor<'de> for Staged {
        type Value = engine::Staged;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a write's bytes")
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
            Ok(engine::Staged::copy_of(v))
        }
        // A self-describing format without a bytes type (JSON) writes them as a sequence.
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
            while let Some(b) = seq.next_element::<u8>()? {
                v.push(b);
            }
            Ok(engine::Staged::copy_of(&v))
        }
    }
    d.deserialize_bytes(Staged)
}

impl Op {
    /// A write of `data` at `offset` of `ino`, or with `append` at its end, atomically
    /// ([`Op::Append`], which has no offset).
    pub fn write_or_append(ino: u64, offset: u64, append: bool, data: engine::Staged) -> Op {
        if append {
            Op::Append { ino, data }
        } else {
            Op::Write { ino, offset, data }
        }
    }

    /// What an absolute path (`a/b/c`; leading and repeated slashes ignored, every component
    /// a name) names: a [`Op::Walk`] to [`Op::Stat`].
    pub fn resolve(path: &str) -> Op {
        Op::Walk {
            from: engine::inode::ROOT_INO,
            path: path
                .split('/')
                .filter(|p| !p.is_empty())
                .map(|p| p.as_bytes().to_vec())
                .collect(),
            then: Box::new(Op::Stat { ino: 0 }),
        }
    }

    /// Gives the operation a [`Op::Walk`] carries the inode the walk reached
    /// ([`Op::target_mut`]; a rename's source directory, and its target directory too when
    /// that is [`SAME_DIR`]). False, changing nothing, for what a walk cannot carry.
    pub fn walked_to(&mut self, ino: u64) -> bool {
        if let Op::Rename {
            from_dir, to_dir, ..
        } = self
        {
            *from_dir = ino;
            if *to_dir == SAME_DIR {
                *to_dir = ino;
            }
            return true;
        }
        match self.target_mut() {
            Some(target) => {
                *target = ino;
                true
            }
            None => false,
        }
    }

    /// True for what a [`Op::Walk`] may carry ([`Op::walked_to`]).
    pub fn walkable(&mut self) -> bool {
        matches!(self, Op::Rename { .. }) || self.target_mut().is_some()
    }

    /// The inode a [`Op::Walk`] replaces: the directory a name operation works in, the
    /// inode a path call (stat, chmod, truncate, xattrs) works on; a link's new name's
    /// directory. None for what a walk does not carry: what acts on no inode (sync, statfs,
    /// stats), a walk (walks do not nest), a rename (two directories: [`Op::walked_to`]),
    /// and what goes through an open handle (reads, writes, fsyncs: the batch runs them
    /// apart from the rest).
    pub fn target_mut(&mut self) -> Option<&mut u64> {
        match self {
            Op::Lookup { dir, .. }
            | Op::Open { dir, .. }
            | Op::Create { dir, .. }
            | Op::Mkdir { dir, .. }
            | Op::Symlink { dir, .. }
            | Op::Mknod { dir, .. }
            | Op::Unlink { dir, .. }
            | Op::Rmdir { dir, .. }
            | Op::Link { dir, .. }
            | Op::Readdir { dir, .. } => Some(dir),
            Op::Readlink { ino }
            | Op::Stat { ino }
            | Op::SetAttr { ino, .. }
            | Op::Hold { ino }
            | Op::Truncate { ino, .. }
            | Op::SetXattr { ino, .. }
            | Op::GetXattr { ino, .. }
            | Op::ListXattr { ino }
            | Op::RemoveXattr { ino, .. } => Some(ino),
            Op::Walk { .. }
            | Op::Read { .. }
            | Op::Write { .. }
            | Op::Append { .. }
            | Op::Release { .. }
            | Op::Fallocate { .. }
            | Op::Fsync { .. }
            | Op::Fdatasync { .. }
            | Op::WriteAtomic { .. }
            | Op::Rename { .. }
            | Op::Sync
            | Op::Statfs
            | Op::Stats => None,
        }
    }

    /// True for operations that normally complete without waiting for the device (metadata
    /// changes, lookups, staged writes): a client waiting on one yields its core instead of
    /// sleeping, since a sleeping client costs the reactor a wake-up that takes longer than
    /// the operation.
    pub(crate) fn is_quick(&self) -> bool {
        if let Op::Walk { then, .. } = self {
            return then.is_quick();
        }
        !matches!(
            self,
            Op::Fsync { .. }
                | Op::Fdatasync { .. }
                | Op::WriteAtomic { .. }
                | Op::Sync
                | Op::Read { .. }
        )
    }

    /// Whether a client waiting for this operation waits awake (spinning or yielding, as
    /// [`crate::wait_policy`] says) rather than sleeping at once: a quick operation, or a
    /// read, which is answered within the batch when its blocks are cached (when they are
    /// not, an in-process reactor says so and its client stops yielding and sleeps).
    pub fn waits_awake(&self) -> bool {
        self.is_quick() || matches!(self, Op::Read { .. })
    }

    /// Whether this is a large data transfer ([`LARGE_TRANSFER_BYTES`] or more read or
    /// written): its reply is hundreds of microseconds of device time away, and a client
    /// whose requests in flight are all such does not spin for them ([`crate::client`]).
    pub fn is_large_transfer(&self) -> bool {
        match self {
            Op::Read { len, .. } => *len >= LARGE_TRANSFER_BYTES,
            Op::Write { data, .. } => data.len() >= LARGE_TRANSFER_BYTES,
            _ => false,
        }
    }

    /// Whether and how a client may run this request itself while the reactor sleeps
    /// ([`crate::caller`]).
    pub(crate) fn caller_run(&self) -> CallerRun {
        match self {
            Op::Walk { then, .. } => then.caller_run(),
            // They change nothing but caches (a read that would move an access time is
            // left to the reactor).
            Op::Lookup { .. }
            | Op::Stat { .. }
            | Op::Readlink { .. }
            | Op::Readdir { .. }
            | Op::Read { .. }
            | Op::GetXattr { .. }
            | Op::ListXattr { .. } => CallerRun::FromMemory,
            // Names, links, attributes and holds: tree items only, nothing the change itself
            // writes to the device. Truncation, an open that truncates, appends and atomic
            // batches are the reactor's.
            Op::Create { .. }
            | Op::Mkdir { .. }
            | Op::Symlink { .. }
            | Op::Mknod { .. }
            | Op::Link { .. }
            | Op::Unlink { .. }
            | Op::Rmdir { .. }
            | Op::Rename { .. }
            | Op::SetXattr { .. }
            | Op::RemoveXattr { .. }
            | Op::Hold { .. }
            | Op::Release { .. } => CallerRun::Change,
            Op::Open { how, .. } if !how.truncate => CallerRun::Change,
            // A write that only stages its bytes ([`engine::Filesystem::write_lent`]).
            Op::Write { .. } => CallerRun::Write,
            Op::SetAttr { change, .. } if change.size.is_none() => CallerRun::Change,
            // Its record written and flushed beside the queue
            // ([`engine::Filesystem::fsync_beside`]).
            Op::Fsync { .. } | Op::Fdatasync { .. } => CallerRun::Fsync,
            _ => CallerRun::No,
        }
    }

    pub(crate) fn is_fsync(&self) -> Option<(u64, bool)> {
        match self {
            Op::Fsync { ino } => Some((*ino, false)),
            Op::Fdatasync { ino } => Some((*ino, true)),
            _ => None,
        }
    }
}

/// How a client may run a request itself ([`Op::caller_run`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallerRun {
    /// A lookup or a read, from memory alone ([`engine::Filesystem::from_memory`]).
    FromMemory,
    /// A change, once its lookups were found in memory
    /// ([`engine::Filesystem::change_lent`]).
    Change,
    /// A write that only stages its bytes ([`engine::Filesystem::write_lent`]), when the
    /// reactor holds no writes back for a commit.
    Write,
    /// An fsync whose record the client writes beside the queue
    /// ([`engine::Filesystem::fsync_beside`]), while the cores are shared and the reactor
    /// holds no writes back for a commit.
    Fsync,
    /// Only the reactor runs it.
    No,
}

/// A successful operation's result.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Reply {
    Done,
    Stat(Stat),
    Entries(Vec<DirEntry>),
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    Written(usize),
    /// An append: where it wrote and how much.
    Appended {
        offset: u64,
        written: usize,
    },
    Names(Vec<Vec<u8>>),
    Opened(Opened),
    Statfs(StatFs),
    Stats(Box<crate::stats::ReactorStats>),
    /// A read's bytes (this many), already in the buffer its caller gave: a storage-service
    /// client decodes an answer's data straight there, a read run in the caller's thread
    /// copies it there ([`crate::Client::read_into`]). Never a reactor's reply.
    Placed(usize),
}

/// An operation's outcome, with the token its client gave it.
#[derive(Debug)]
pub struct Completion {
    pub token: u64,
    pub result: Result<Reply, EngineError>,
}
