//! Who may do what: the server's permission checks for a connection's user, as the kernel
//! makes them for a filesystem mounted with `default_permissions` (modes, owners, groups
//! including supplementary ones, sticky directories). Root (uid 0) passes every check, as
//! CAP_DAC_OVERRIDE and CAP_FOWNER would let it.
//!
//! # Invariants
//! - A non-root request is admitted only after its checks passed, on the inodes it will act
//!   on: a walk is taken apart here, one checked lookup per name (search permission on each
//!   directory), and the operation then runs on the inode reached.
//! - What a non-root user creates is theirs: its owner is the connection's uid and gid,
//!   whatever the request said (a set-group-ID directory still gives its group: the engine's
//!   rule).
//!
//! # What is not the kernel's exactly
//! - The checks and the operation are two requests: a chmod landing between them is not seen
//!   (the kernel holds the inode lock across both). Each check is on the state of a moment.
//! - A request cannot say "now" for a time: a non-owner with write permission may set both
//!   times when both are within two seconds of the server's clock (what `utimensat(NULL)`
//!   and `UTIME_NOW` send), and nothing else.
//! - Reads, writes and fsyncs are not checked here but against the connection's open
//!   handles ([`super::server`]), as the kernel checks them at open.

use engine::inode::{S_IFBLK, S_IFCHR, S_IFMT, S_ISGID};
use engine::{EngineError, SetAttr, Stat};
use reactor::{Client, Op, Owner, Reply};

const READ: u32 = 4;
const WRITE: u32 = 2;
const SEARCH: u32 = 1;
const S_ISVTX: u32 = 0o1000;

/// A connection's user, from the socket's peer credentials.
#[derive(Debug, Clone)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Caller {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    fn owns(&self, s: &Stat) -> bool {
        self.is_root() || self.uid == s.uid
    }

    /// Whether the mode bits of `s` grant `want` (READ | WRITE | SEARCH) to this user.
    fn may(&self, s: &Stat, want: u32) -> bool {
        if self.is_root() {
            // Root may execute only what someone may; searching a directory is always open.
            return want & SEARCH == 0 || s.is_dir() || s.mode & 0o111 != 0;
        }
        let bits = if self.uid == s.uid {
            s.mode >> 6
        } else if self.in_group(s.gid) {
            s.mode >> 3
        } else {
            s.mode
        } & 7;
        bits & want == want
    }

    fn owner(&self) -> Owner {
        Owner {
            uid: self.uid,
            gid: self.gid,
        }
    }
}

fn denied(what: &str) -> EngineError {
    EngineError::Refused {
        errno: libc::EACCES,
        message: format!("permission denied: {what}"),
    }
}

fn not_permitted(what: &str) -> EngineError {
    EngineError::Refused {
        errno: libc::EPERM,
        message: format!("operation not permitted: {what}"),
    }
}

/// The checks' view of the filesystem: lookups through the worker's own reactor client.
struct Look<'a> {
    client: &'a mut Client,
}

impl Look<'_> {
    fn stat(&mut self, ino: u64) -> Result<Stat, EngineError> {
        match self.client.call(Op::Stat { ino })? {
            Reply::Stat(s) => Ok(s),
            other => Err(EngineError::Internal(format!("stat answered {other:?}"))),
        }
    }

    fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Option<Stat>, EngineError> {
        match self.client.call(Op::Lookup {
            dir,
            name: name.to_vec(),
        }) {
            Ok(Reply::Stat(s)) => Ok(Some(s)),
            Ok(other) => Err(EngineError::Internal(format!("lookup answered {other:?}"))),
            Err(EngineError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The directory `dir`, which `caller` must be allowed `want` in.
    fn dir(&mut self, caller: &Caller, dir: u64, want: u32) -> Result<Stat, EngineError> {
        let d = self.stat(dir)?;
        if !d.is_dir() {
            return Err(EngineError::NotDir);
        }
        if !caller.may(&d, want) {
            return Err(denied(&format!("directory {dir}")));
        }
        Ok(d)
    }

    /// A sticky directory's rule: only the owner of the entry, or of the directory, removes
    /// or replaces it.
    fn sticky(
        &mut self,
        caller: &Caller,
        d: &Stat,
        name: &[u8],
    ) -> Result<Option<Stat>, EngineError> {
        let victim = self.lookup(d.ino, name)?;
        if let Some(v) = &victim {
            if d.mode & S_ISVTX != 0 && !caller.owns(d) && !caller.owns(v) {
                return Err(not_permitted(
                    "an entry of a sticky directory that is not yours",
                ));
            }
        }
        Ok(victim)
    }
}

/// The operation to run for `caller`, checked (and for a non-root caller, with its walk
/// done here and its owners made the caller's); or the error the kernel would give.
pub fn admit(caller: &Caller, client: &mut Client, op: Op) -> Result<Op, EngineError> {
    if caller.is_root() {
        return Ok(op);
    }
    let mut look = Look { client };
    let mut op = match op {
        Op::Walk { from, path, then } => {
            let mut ino = from;
            for (k, name) in path.iter().enumerate() {
                look.dir(caller, ino, SEARCH)?;
                let next = look.lookup(ino, name)?.ok_or(EngineError::NotFound)?;
                if k + 1 < path.len() && !next.is_dir() {
                    return Err(if next.is_symlink() {
                        EngineError::SymlinkNotFollowed
                    } else {
                        EngineError::NotDir
                    });
                }
                ino = next.ino;
            }
            let mut then = *then;
            // What no walk may carry was refused before (the server's `bound`).
            then.walked_to(ino);
            then
        }
        op => op,
    };
    check(caller, &mut look, &mut op)?;
    Ok(op)
}

/// True for the requests a non-root caller makes without any permission check here: those
/// through an open handle (checked against the connection's handles instead, as the kernel
/// checks at open) and those by number that change nothing. The server's reactor takes these
/// off a ring itself, whoever the client; the rest go through a worker that calls
/// [`admit`]. Exhaustive: a new operation must be placed here, and `check` must check the
/// ones placed `false` (it answers any other with an internal error).
pub fn needs_no_check(op: &Op) -> bool {
    match op {
        // Through an open handle: checked against the connection's handles by the server.
        Op::Read { .. }
        | Op::Write { .. }
        | Op::Append { .. }
        | Op::Release { .. }
        | Op::Truncate { .. }
        | Op::Fallocate { .. }
        | Op::Fsync { .. }
        | Op::Fdatasync { .. }
        | Op::WriteAtomic { .. }
        // By number, changing nothing: the kernel's rule is search permission on the path,
        // which the walk that found the number checked.
        | Op::Stat { .. }
        | Op::Readlink { .. }
        | Op::ListXattr { .. }
        | Op::Hold { .. }
        | Op::Sync
        | Op::Statfs
        | Op::Stats => true,
        Op::Walk { .. }
        | Op::Lookup { .. }
        | Op::Open { .. }
        | Op::Create { .. }
        | Op::Mkdir { .. }
        | Op::Symlink { .. }
        | Op::Mknod { .. }
        | Op::Link { .. }
        | Op::Unlink { .. }
        | Op::Rmdir { .. }
        | Op::Rename { .. }
        | Op::Readdir { .. }
        | Op::SetAttr { .. }
        | Op::SetXattr { .. }
        | Op::RemoveXattr { .. }
        | Op::GetXattr { .. } => false,
    }
}

fn check(caller: &Caller, look: &mut Look<'_>, op: &mut Op) -> Result<(), EngineError> {
    if needs_no_check(op) {
        return Ok(());
    }
    match op {
        Op::Lookup { dir, .. } => {
            look.dir(caller, *dir, SEARCH)?;
        }
        Op::Open { dir, name, how } => {
            let existing = if name.is_empty() {
                Some(look.stat(*dir)?)
            } else {
                look.dir(caller, *dir, SEARCH)?;
                look.lookup(*dir, name)?
            };
            match existing {
                Some(s) => {
                    let mut want = 0;
                    if how.readable {
                        want |= READ;
                    }
                    if how.writable || how.truncate {
                        want |= WRITE;
                    }
                    // O_CREAT|O_EXCL on an existing name is the engine's EEXIST.
                    let exists_error = how.create.is_some() && how.exclusive;
                    if !exists_error && !caller.may(&s, want) {
                        return Err(denied(&format!("open of inode {}", s.ino)));
                    }
                }
                None => {
                    if how.create.is_some() {
                        look.dir(caller, *dir, WRITE | SEARCH)?;
                    }
                }
            }
            if let Some((_, owner)) = how.create.as_mut() {
                *owner = caller.owner();
            }
        }
        Op::Create { dir, owner, .. }
        | Op::Mkdir { dir, owner, .. }
        | Op::Symlink { dir, owner, .. } => {
            look.dir(caller, *dir, WRITE | SEARCH)?;
            *owner = caller.owner();
        }
        Op::Mknod {
            dir, mode, owner, ..
        } => {
            let kind = *mode & S_IFMT;
            if kind == S_IFCHR || kind == S_IFBLK {
                return Err(not_permitted("a device node (root only)"));
            }
            look.dir(caller, *dir, WRITE | SEARCH)?;
            *owner = caller.owner();
        }
        Op::Link { dir, .. } => {
            look.dir(caller, *dir, WRITE | SEARCH)?;
        }
        Op::Unlink { dir, name } | Op::Rmdir { dir, name } => {
            let d = look.dir(caller, *dir, WRITE | SEARCH)?;
            look.sticky(caller, &d, name)?;
        }
        Op::Rename {
            from_dir,
            from,
            to_dir,
            to,
            ..
        } => {
            let fd = look.dir(caller, *from_dir, WRITE | SEARCH)?;
            let td = look.dir(caller, *to_dir, WRITE | SEARCH)?;
            let moved = look.sticky(caller, &fd, from)?;
            look.sticky(caller, &td, to)?;
            // A directory moving to another parent rewrites its "..": the kernel asks for
            // write permission on it.
            if let Some(m) = moved {
                if m.is_dir() && from_dir != to_dir && !caller.may(&m, WRITE) {
                    return Err(denied("moving a directory you may not write"));
                }
            }
        }
        Op::Readdir { dir, .. } => {
            look.dir(caller, *dir, READ)?;
        }
        Op::SetAttr { ino, change } => {
            let s = look.stat(*ino)?;
            set_attr(caller, &s, change)?;
        }
        Op::SetXattr { ino, name, .. } | Op::RemoveXattr { ino, name } => {
            let s = look.stat(*ino)?;
            if name.starts_with(b"user.") {
                if !caller.may(&s, WRITE) {
                    return Err(denied("an extended attribute of a file you may not write"));
                }
            } else if name.starts_with(b"system.") {
                if !caller.owns(&s) {
                    return Err(not_permitted("an ACL of a file that is not yours"));
                }
            } else {
                return Err(not_permitted("trusted and security attributes (root only)"));
            }
        }
        Op::GetXattr { ino, name } => {
            let s = look.stat(*ino)?;
            if name.starts_with(b"user.") && !caller.may(&s, READ) {
                return Err(denied("an extended attribute of a file you may not read"));
            }
            if name.starts_with(b"trusted.") {
                return Err(EngineError::NoData);
            }
        }
        // What needs no check returned above; a walk was taken apart by `admit`.
        other => {
            return Err(EngineError::Internal(format!(
                "no permission check for {other:?}"
            )))
        }
    }
    Ok(())
}

/// chmod, chown, truncate and utimes by a non-root caller, as the kernel's setattr rules.
fn set_attr(caller: &Caller, s: &Stat, change: &mut SetAttr) -> Result<(), EngineError> {
    let owner = caller.owns(s);
    if let Some(uid) = change.uid {
        if uid != s.uid {
            return Err(not_permitted("giving a file away (root only)"));
        }
    }
    if let Some(gid) = change.gid {
        if gid != s.gid && !(owner && caller.in_group(gid)) {
            return Err(not_permitted("a group you are not in, or a file not yours"));
        }
    }
    if let Some(mode) = change.mode.as_mut() {
        if !owner {
            return Err(not_permitted("chmod of a file that is not yours"));
        }
        // As the kernel: set-group-ID only for a member of the file's group.
        if !caller.in_group(change.gid.unwrap_or(s.gid)) {
            *mode &= !S_ISGID;
        }
    }
    if change.size.is_some() && !caller.may(s, WRITE) {
        return Err(denied("truncating a file you may not write"));
    }
    if (change.atime.is_some() || change.mtime.is_some()) && !owner {
        let now = engine::format::items::Timespec::now().sec;
        let is_now = |t: Option<engine::format::items::Timespec>| {
            t.is_some_and(|t| (t.sec - now).abs() <= 2)
        };
        if !(is_now(change.atime) && is_now(change.mtime)) {
            return Err(not_permitted(
                "setting the times of a file that is not yours",
            ));
        }
        if !caller.may(s, WRITE) {
            return Err(denied("touching a file you may not write"));
        }
    }
    Ok(())
}
