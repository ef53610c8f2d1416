//! Running one engine operation for a request ([`execute_on`]): the mapping from an [`Op`] to
//! the [`Filesystem`] call and its [`Reply`].
//!
//! # Invariants
//! - Only operations that run one by one go through here: fsync, fdatasync, atomic writes,
//!   sync and stats are the batch's (`runtime::batch`) and are refused with Invalid.
//! - The caller is the thread that owns `fs` (a reactor, or the coordinator running a span).

use crate::op::{Op, OpenHow, Opened, Reply};
use engine::{EngineError, Filesystem, Stat};

/// Runs one engine operation (not fsync, sync or stats, which the batch handles).
pub(crate) fn execute_on(fs: &mut Filesystem, op: &Op) -> Result<Reply, EngineError> {
    Ok(match *op {
        Op::Walk {
            from,
            ref path,
            ref then,
        } => {
            // Here only where the whole walk is this engine's (one reactor, or a span's):
            // reactors walk in their batch, handing walks on (`runtime::batch`).
            let (ino, taken) = walk(fs, from, path)?;
            if taken < path.len() {
                return Err(EngineError::Invalid(
                    "a walk reached a directory another partition holds".into(),
                ));
            }
            execute_on(fs, &walked(then, ino)?)?
        }
        Op::Lookup { dir, ref name } => Reply::Stat(fs.lookup(dir, name)?),
        Op::Open { dir, ref name, how } => Reply::Opened(open(fs, dir, name, how)?),
        Op::Create {
            dir,
            ref name,
            mode,
            owner,
        } => Reply::Stat(fs.create(dir, name, mode, owner.uid, owner.gid)?),
        Op::Mkdir {
            dir,
            ref name,
            mode,
            owner,
        } => Reply::Stat(fs.mkdir(dir, name, mode, owner.uid, owner.gid)?),
        Op::Symlink {
            dir,
            ref name,
            ref target,
            owner,
        } => Reply::Stat(fs.symlink(dir, name, target, owner.uid, owner.gid)?),
        Op::Mknod {
            dir,
            ref name,
            mode,
            rdev,
            owner,
        } => Reply::Stat(fs.mknod(dir, name, mode, rdev, owner.uid, owner.gid)?),
        Op::Append { ino, ref data } => {
            let (offset, written) = fs.append_shared(ino, data.clone())?;
            Reply::Appended { offset, written }
        }
        Op::Hold { ino } => fs.hold(ino).map(|()| Reply::Done)?,
        Op::Release { ino } => fs.release(ino).map(|()| Reply::Done)?,
        Op::Readlink { ino } => Reply::Data(fs.readlink(ino)?),
        Op::Link { ino, dir, ref name } => Reply::Stat(fs.link(ino, dir, name)?),
        Op::Unlink { dir, ref name } => fs.unlink(dir, name).map(|()| Reply::Done)?,
        Op::Rmdir { dir, ref name } => fs.rmdir(dir, name).map(|()| Reply::Done)?,
        Op::Rename {
            from_dir,
            ref from,
            to_dir,
            ref to,
            flags,
        } => fs
            .rename(from_dir, from, to_dir, to, flags)
            .map(|()| Reply::Done)?,
        Op::Readdir { dir, cookie, max } => Reply::Entries(fs.readdir(dir, cookie, max)?),
        Op::Stat { ino } => Reply::Stat(fs.stat(ino)?),
        Op::SetAttr { ino, change } => Reply::Stat(fs.setattr(ino, change)?),
        Op::Read { ino, offset, len } => Reply::Data(fs.read(ino, offset, len)?),
        Op::Write {
            ino,
            offset,
            ref data,
        } => Reply::Written(fs.write_shared(ino, offset, data.clone())?),
        Op::Truncate { ino, size } => fs.truncate(ino, size).map(|()| Reply::Done)?,
        Op::Fallocate {
            ino,
            mode,
            offset,
            len,
        } => fs.fallocate(ino, mode, offset, len).map(|()| Reply::Done)?,
        Op::SetXattr {
            ino,
            ref name,
            ref value,
            flags,
        } => fs.setxattr(ino, name, value, flags).map(|()| Reply::Done)?,
        Op::GetXattr { ino, ref name } => Reply::Data(fs.getxattr(ino, name)?),
        Op::ListXattr { ino } => Reply::Names(fs.listxattr(ino)?),
        Op::RemoveXattr { ino, ref name } => fs.removexattr(ino, name).map(|()| Reply::Done)?,
        Op::Statfs => Reply::Statfs(fs.statfs()),
        Op::Fsync { .. } | Op::Fdatasync { .. } | Op::WriteAtomic { .. } | Op::Sync | Op::Stats => {
            return Err(EngineError::Invalid(
                "fsync, sync and stats are not run one by one".into(),
            ))
        }
    })
}

/// Walks `path`'s names from directory `from` while the directories are held here (each
/// before the last must be a directory: ENOTDIR; a missing one: ENOENT): the inode reached
/// and the names taken (all of them on a whole mount).
pub(crate) fn walk(
    fs: &mut Filesystem,
    from: u64,
    path: &[Vec<u8>],
) -> Result<(u64, usize), EngineError> {
    let mut ino = from;
    let mut taken = 0;
    while taken < path.len() && fs.holds(fs.shard_of(ino)) {
        ino = fs
            .lookup_ino(ino, &path[taken])?
            .ok_or(EngineError::NotFound)?;
        taken += 1;
    }
    Ok((ino, taken))
}

/// What a request that changes the filesystem looks up first (the name in its directory,
/// its inode, the extents or blocks it covers), ignoring the answers: run deferred or from
/// memory, a miss says the request would wait for the device.
pub(crate) fn lookups(fs: &mut Filesystem, op: &Op) {
    match op {
        // Walks run deferred in the batch; one that reaches here runs whole (a span's).
        Op::Walk { from, path, .. } => {
            let _ = walk(fs, *from, path);
        }
        Op::Open { dir, name, how } => {
            let found = if name.is_empty() {
                fs.stat(*dir).ok()
            } else {
                fs.lookup(*dir, name).ok()
            };
            if let Some(stat) = found {
                if how.truncate {
                    let _ = fs.probe_range(stat.ino, 0, 1);
                }
            }
        }
        Op::Create { dir, name, .. }
        | Op::Mkdir { dir, name, .. }
        | Op::Symlink { dir, name, .. }
        | Op::Mknod { dir, name, .. }
        | Op::Unlink { dir, name }
        | Op::Rmdir { dir, name } => {
            let _ = fs.lookup(*dir, name);
        }
        Op::Link { ino, dir, name } => {
            let _ = fs.stat(*ino);
            let _ = fs.lookup(*dir, name);
        }
        Op::Rename {
            from_dir,
            from,
            to_dir,
            to,
            ..
        } => {
            let _ = fs.lookup(*from_dir, from);
            let _ = fs.lookup(*to_dir, to);
        }
        // A write inside a block reads the rest of it: parked until it is in memory.
        Op::Write { ino, offset, data } => {
            let _ = fs.probe_write_edges(*ino, Some(*offset), data.len());
        }
        Op::Append { ino, data } => {
            let _ = fs.probe_write_edges(*ino, None, data.len());
        }
        Op::Truncate { ino, size: offset } | Op::Fallocate { ino, offset, .. } => {
            let _ = fs.probe_range(*ino, *offset, 1);
        }
        Op::SetXattr { ino, name, .. } | Op::RemoveXattr { ino, name } => {
            let _ = fs.getxattr(*ino, name);
        }
        Op::WriteAtomic { ino, .. }
        | Op::Hold { ino }
        | Op::Release { ino }
        | Op::SetAttr { ino, .. }
        | Op::Fsync { ino }
        | Op::Fdatasync { ino } => {
            let _ = fs.stat(*ino);
        }
        Op::Lookup { .. }
        | Op::Readlink { .. }
        | Op::Readdir { .. }
        | Op::Stat { .. }
        | Op::GetXattr { .. }
        | Op::ListXattr { .. }
        | Op::Read { .. }
        | Op::Statfs
        | Op::Sync
        | Op::Stats => {}
    }
}

/// A walk's operation with its target replaced by the inode the walk reached.
pub(crate) fn walked(then: &Op, ino: u64) -> Result<Op, EngineError> {
    let mut op = then.clone();
    if op.walked_to(ino) {
        Ok(op)
    } else {
        Err(EngineError::Invalid(format!(
            "a walk cannot carry {then:?}: it has no inode to replace"
        )))
    }
}

/// [`Op::Open`]: the lookup, the create, the checks, the hold and the truncate of open(2),
/// with nothing between them.
pub(crate) fn open(
    fs: &mut Filesystem,
    dir: u64,
    name: &[u8],
    how: OpenHow,
) -> Result<Opened, EngineError> {
    let found = if name.is_empty() {
        match fs.stat(dir) {
            Ok(stat) => stat,
            Err(EngineError::NotFound) => return Ok(Opened::Gone),
            Err(e) => return Err(e),
        }
    } else {
        match fs.lookup(dir, name) {
            Ok(stat) => stat,
            Err(EngineError::NotFound) => {
                let Some((mode, owner)) = how.create else {
                    return Err(EngineError::NotFound);
                };
                if how.directory {
                    // O_CREAT|O_DIRECTORY never creates (Linux refuses the pair with
                    // EINVAL before the path; the C ABI does too).
                    return Err(EngineError::Invalid("O_CREAT with O_DIRECTORY".into()));
                }
                // A new inode goes to a shard this engine holds (creates run where their
                // directory is), so the hold is counted where Op::Release will find it.
                let stat = fs.create(dir, name, mode & 0o7777, owner.uid, owner.gid)?;
                fs.hold(stat.ino)?;
                return Ok(Opened::Created(stat));
            }
            Err(e) => return Err(e),
        }
    };
    check_open(&found, how)?;
    fs.hold(found.ino)?;
    if how.truncate && how.writable && !found.is_dir() {
        if let Err(e) = fs.truncate(found.ino, 0) {
            // The open failed: it keeps no hold.
            let _ = fs.release(found.ino);
            return Err(e);
        }
        return Ok(Opened::Found(fs.stat(found.ino)?));
    }
    Ok(Opened::Found(found))
}

/// open(2)'s checks of an existing inode against its flags.
fn check_open(stat: &Stat, how: OpenHow) -> Result<(), EngineError> {
    if how.create.is_some() {
        if how.exclusive {
            return Err(EngineError::Exists);
        }
        if stat.is_dir() {
            return Err(EngineError::IsDir);
        }
    }
    if how.directory && !stat.is_dir() {
        return Err(EngineError::NotDir);
    }
    if how.writable && stat.is_dir() {
        return Err(EngineError::IsDir);
    }
    // Opening a symbolic link would follow it: ELOOP, as open(2) with O_NOFOLLOW (Linux's
    // order: after EEXIST, EISDIR and ENOTDIR).
    if stat.mode & libc::S_IFMT == libc::S_IFLNK {
        return Err(EngineError::SymlinkNotFollowed);
    }
    Ok(())
}
