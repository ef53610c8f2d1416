//! Running one engine operation for a request ([`execute_on`]): the mapping from an [`Op`] to
//! the [`Filesystem`] call and its [`Reply`].
//!
//! # Invariants
//! - Only operations that run one by one go through here: fsync, fdatasync, atomic writes,
//!   sync and stats are the batch's (`runtime::batch`) and are refused with Invalid.
//! - The caller is the thread that owns `fs` (a reactor, or the coordinator running a span).

use crate::op::{Op, Reply};
use engine::{EngineError, Filesystem};

/// Runs one engine operation (not fsync, sync or stats, which the batch handles).
pub(crate) fn execute_on(fs: &mut Filesystem, op: &Op) -> Result<Reply, EngineError> {
    Ok(match *op {
        Op::Resolve { ref path } => {
            let ino = fs.resolve(path)?;
            Reply::Stat(fs.stat(ino)?)
        }
        Op::ResolveAt { dir, ref path } => {
            let mut ino = dir;
            for part in path.split('/').filter(|p| !p.is_empty()) {
                ino = fs
                    .lookup_ino(ino, part.as_bytes())?
                    .ok_or(EngineError::NotFound)?;
            }
            Reply::Stat(fs.stat(ino)?)
        }
        Op::Lookup { dir, ref name } => Reply::Stat(fs.lookup(dir, name)?),
        Op::Create {
            dir,
            ref name,
            mode,
            owner,
        } => Reply::Stat(fs.create(dir, name, mode, owner.uid, owner.gid)?),
        Op::CreateHeld {
            dir,
            ref name,
            mode,
            owner,
        } => {
            // A new inode goes to a shard of the reactor holding `dir` (creates run where
            // their directory is), so its hold is counted where Op::Release will find it.
            let stat = fs.create(dir, name, mode, owner.uid, owner.gid)?;
            fs.hold(stat.ino)?;
            Reply::Stat(stat)
        }
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
            let (offset, written) = fs.append(ino, data)?;
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
        } => Reply::Written(fs.write(ino, offset, data)?),
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
