//! `corefs mount`: starts the reactors on a device and serves them through FUSE
//! ([`crate::fuse`]) until the filesystem is unmounted.

use crate::fuse;
use std::path::PathBuf;

/// Serve a filesystem at a mountpoint through FUSE until it is unmounted (umount or
/// fusermount3 -u); the unmount commits. The device is held exclusively meanwhile: a
/// second mount, mkfs or fsck of it fails (dump and fsck -n still read it).
#[derive(clap::Args)]
pub struct Args {
    /// Device string: file:PATH, nvme:/dev/ngXnY.
    device: String,
    mountpoint: PathBuf,
    #[command(flatten)]
    reactors: Reactors,
    /// Let every user use the mount, not only the mounter (FUSE's allow_other), as a
    /// storage service run by root serves others: the kernel checks each caller's
    /// permissions against modes and owners (default_permissions), as on a kernel
    /// filesystem. A mounter other than root needs `user_allow_other` in /etc/fuse.conf
    /// (fusermount3 refuses the option otherwise).
    #[arg(long)]
    allow_other: bool,
}

/// The reactors' options, as `corefs mount` and `corefs serve` take them.
#[derive(clap::Args)]
pub(super) struct Reactors {
    /// Pin the reactor to this core (with several reactors: this core and the next ones).
    #[arg(long, value_parser = parse_core)]
    pub core: Option<usize>,
    /// Reactors, each serving every N-th shard on its own device queue (0: one per core).
    #[arg(long, default_value_t = 1)]
    pub reactors: usize,
    /// Busy-poll (a dedicated core) instead of spin-then-park.
    #[arg(long)]
    pub busy_poll: bool,
    /// When reads move a file's access time: relatime (when it is not after the last
    /// modification or change, or is a day old), noatime (never), strictatime (every read).
    #[arg(long, default_value = "relatime", value_parser = parse_atime)]
    pub atime: engine::Atime,
    /// No data-block cache: reads of committed data go to the device, as O_DIRECT reads do
    /// on a kernel filesystem (for a database with a cache of its own, and fair benchmarks).
    #[arg(long)]
    pub no_data_cache: bool,
}

fn parse_atime(text: &str) -> Result<engine::Atime, String> {
    engine::Atime::from_name(text)
        .ok_or_else(|| format!("{text}: use relatime, noatime or strictatime"))
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        device,
        mountpoint,
        reactors,
        allow_other,
    } = args;
    let atime = reactors.atime;
    let runtime = reactors.start(&device, engine::MountOptions::default())?;
    eprintln!(
        "corefs: serving {device} at {} (unmount with: umount {})",
        mountpoint.display(),
        mountpoint.display()
    );
    let access = if allow_other {
        fuse::Access::Everyone
    } else {
        fuse::Access::Mounter
    };
    fuse::serve(runtime, &mountpoint, access, atime).map_err(|e| {
        format!(
            "mounting at {}: {e}{}",
            mountpoint.display(),
            fuse::mount_hint(&e)
        )
    })
}

impl Reactors {
    /// Starts the reactors on `device`, with these options over `mount`.
    pub(super) fn start(
        &self,
        device: &str,
        mount: engine::MountOptions,
    ) -> Result<reactor::Runtime, String> {
        start_reactors(
            device,
            self.core,
            self.reactors,
            self.busy_poll,
            engine::MountOptions {
                atime: self.atime,
                data_cache_blocks: if self.no_data_cache {
                    0
                } else {
                    mount.data_cache_blocks
                },
                ..mount
            },
        )
    }
}

fn start_reactors(
    device: &str,
    core: Option<usize>,
    reactors: usize,
    busy_poll: bool,
    mount: engine::MountOptions,
) -> Result<reactor::Runtime, String> {
    let cores = match core {
        // One core per reactor from `core` on, each one the process may run on (with
        // reactors 0, the number is not known yet: `core` alone).
        Some(c) if reactors > 0 => reactor::affinity::consecutive_cores(c, reactors),
        _ => Ok(Vec::new()),
    }
    .map_err(|e| format!("--core: {e}"))?;
    reactor::Runtime::start(reactor::Config {
        device: device.to_string(),
        core,
        reactors,
        cores,
        idle: if busy_poll {
            reactor::IdlePolicy::BusyPoll
        } else {
            reactor::IdlePolicy::default()
        },
        mount,
        ..reactor::Config::default()
    })
    .map_err(|e| format!("{device}: {e}"))
}

/// A core id the process may run on (`reactor::affinity`): an error naming the allowed set
/// otherwise, while the arguments are parsed.
fn parse_core(text: &str) -> Result<usize, String> {
    let core: usize = text
        .parse()
        .map_err(|e| format!("{text:?} is not a core id: {e}"))?;
    reactor::affinity::check_cores(&[core]).map_err(|e| e.to_string())?;
    Ok(core)
}
