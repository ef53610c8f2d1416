//! `corefs dump`: what an image holds, decoded by `engine::inspect`, without mounting it.

use super::open_read_only;

/// Print what an image holds without mounting it (nothing is written; the device is
/// opened read-only, so this works on a mounted image too, with a warning).
#[derive(clap::Args)]
pub struct Args {
    device: String,
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Both superblock copies.
    Super,
    /// Every tree node with its items decoded (all shards, or --shard).
    Trees {
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Every item of one inode.
    Inode { ino: u64 },
    /// The fsync log records the next mount would replay, per shard.
    Logs,
    /// Nodes, items, inodes, extents and blocks per shard.
    Stats,
}

pub fn run(args: Args) -> Result<(), String> {
    use engine::inspect;
    let mut dev = open_read_only(&args.device, "dump")?;
    let dev = &mut *dev;
    let text = match args.what {
        What::Super => Ok(inspect::format_superblocks(dev)),
        What::Trees { shard } => inspect::format_trees(dev, shard),
        What::Inode { ino } => inspect::format_inode(dev, ino),
        What::Logs => inspect::format_logs(dev),
        What::Stats => inspect::format_stats(dev),
    }?;
    print!("{text}");
    Ok(())
}
