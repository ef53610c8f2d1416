//! `corefs sync PATH...`: commits the filesystem mounted (`corefs mount`) where each path is,
//! through the mount's sync ioctl ([`crate::fuse::SYNC_IOCTL`]). sync(1) cannot do this
//! for a FUSE mount: Linux passes sync(2) and syncfs(2) to no FUSE server but virtiofs, so
//! `sync` and `sync -f` return at once and make nothing durable there.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// Make everything written through a `corefs mount` durable (a commit): what `sync -f`
/// does on a kernel filesystem, which it cannot do through FUSE. Each PATH is any file or
/// directory of the mount; exits non-zero if one is not on a corefs mount.
#[derive(clap::Args)]
pub struct Args {
    /// Files or directories on corefs mounts.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    for path in &args.paths {
        sync(path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Commits the corefs mount `path` is on.
fn sync(path: &std::path::Path) -> Result<(), String> {
    // O_NONBLOCK: a FIFO on the mount opens without waiting for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    // SAFETY: the descriptor is open for the call; the ioctl takes no argument.
    let done = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            crate::fuse::SYNC_IOCTL as libc::Ioctl,
            0usize,
        )
    };
    if done == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(libc::ENOTTY) => {
            "not on a corefs mount (the filesystem there does not know the sync ioctl)".into()
        }
        _ => format!("the commit failed: {e}"),
    })
}
