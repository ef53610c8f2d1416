//! `corefs mkfs`: formats a device and gives its root directory to whoever made it.

use super::{open, parse_size};

/// Create a filesystem (destroys what the device holds). Refused while another mount,
/// mkfs or fsck holds the device.
#[derive(clap::Args)]
pub struct Args {
    /// Device string: file:PATH, nvme:/dev/ngXnY, mem:SIZE.
    device: String,
    /// Create or grow a file image to this size (file: devices).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Shards (1..=64): units of parallelism, each with its own tree, log and allocator.
    /// They share the device's space: any file may use all of it.
    #[arg(long, default_value_t = engine::format::DEFAULT_SHARDS)]
    shards: u32,
    /// Block group size (32KiB..16MiB, a power of two): the unit of space a shard takes
    /// from the free pool and gives back. Default: by device size, at least eight per shard
    /// (1 MiB on a 1 GiB device, 16 MiB from 8 GiB with 64 shards).
    #[arg(long, value_parser = parse_size)]
    group_size: Option<u64>,
    #[arg(long, default_value = "")]
    label: String,
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        device,
        size,
        shards,
        group_size,
        label,
    } = args;
    let group_blocks = match group_size {
        Some(bytes) if bytes % 4096 != 0 => {
            return Err(format!("--group-size {bytes}: not a multiple of 4 KiB"))
        }
        other => other.map(|bytes| bytes / 4096),
    };
    let dev = open(&device, size)?;
    let bytes = dev.info().capacity_bytes();
    let options = engine::MkfsOptions {
        shards,
        label,
        group_blocks,
    };
    let dev = engine::Filesystem::mkfs(dev, &options).map_err(|e| e.to_string())?;
    let mut fs = engine::Filesystem::mount(dev, Default::default()).map_err(|e| e.to_string())?;
    // The root directory belongs to whoever makes the filesystem, as mke2fs does: a user who
    // formats an image and mounts it (through fusermount3) can then write to it.
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if (uid, gid) != (0, 0) {
        let owner = engine::SetAttr {
            uid: Some(uid),
            gid: Some(gid),
            ..Default::default()
        };
        fs.setattr(fs.root(), owner).map_err(|e| e.to_string())?;
        fs.sync().map_err(|e| e.to_string())?;
    }
    let sb = fs.superblock();
    let groups = fs.space_pool().stats().groups;
    println!(
        "corefs: {} MiB on {device}: {} shards sharing {groups} block groups of {} KiB \
         ({} MiB for files and trees), generation {}, label {:?}",
        bytes >> 20,
        sb.shards.len(),
        sb.group_blocks * 4,
        (sb.data_area_blocks() * 4096) >> 20,
        sb.generation,
        sb.label
    );
    Ok(())
}
