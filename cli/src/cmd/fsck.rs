//! `corefs fsck`: checks a filesystem as a mount would find it (after replaying the fsync
//! logs), and says how it ended as e2fsck does: [`Verdict`], which main maps to e2fsck's exit
//! codes. Corruption is reported on stdout (it is the check's result), everything else on
//! stderr.

use super::{open, open_read_only};
use engine::inspect;
use std::io::IsTerminal;

/// Check a filesystem: both superblocks, the fsync logs, every tree node (checksum,
/// address, generation), every name, back-reference, link count, extent and block of the
/// space bitmap, and every data block's checksum. Exit codes as e2fsck: 0 clean, 1 errors
/// corrected, 4 errors left uncorrected, 8 operational error.
///
/// By default fsck writes, as a mount does: it replays the fsync log records the device
/// holds and commits them (it says how many before it writes), and it holds the device
/// exclusively. With -n it writes nothing: the records are replayed in memory only, and
/// the device is opened read-only, so it also works (with a warning) while mounted.
#[derive(clap::Args)]
pub struct Args {
    device: String,
    /// Repair what is safe to repair: a damaged superblock copy is rewritten from the
    /// current one. (Log records are replayed by every mount, as a journal is.)
    #[arg(long, conflicts_with = "no_write")]
    repair: bool,
    /// Check only, change nothing (e2fsck's -n): open the device read-only and replay the
    /// fsync logs in memory; the report is the one a plain fsck would give.
    #[arg(short = 'n', long = "no-write")]
    no_write: bool,
    /// Skip reading and verifying every data block.
    #[arg(long)]
    no_data: bool,
}

/// How a check ended, in e2fsck's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Clean,
    /// Errors were found and corrected (`--repair`).
    Corrected,
    /// Errors were found and left as they are.
    Uncorrected,
    /// The check could not be made (the device would not open, an I/O error).
    Operational,
}

pub fn run(args: Args) -> Verdict {
    let Args {
        device,
        repair,
        no_write,
        no_data,
    } = args;
    let device = device.as_str();
    let opened = if no_write {
        open_read_only(device, "fsck")
    } else {
        open(device, None)
    };
    let mut dev = match opened {
        Ok(dev) => dev,
        Err(why) => {
            eprintln!("corefs fsck: {why}");
            return Verdict::Operational;
        }
    };
    let mut corrected = 0u32;
    // Superblocks: mount would quietly use the good copy; fsck names a damaged one.
    let copies = inspect::superblocks(&mut *dev);
    let current = match inspect::current_superblock(&mut *dev) {
        Ok(sb) => sb,
        Err(why) => {
            println!("corefs fsck: {device}: CORRUPT: superblock: {why}");
            return Verdict::Uncorrected;
        }
    };
    for (addr, copy) in &copies {
        if let Err(why) = copy {
            if repair {
                if let Err(e) = inspect::rewrite_superblock(&mut *dev, &current, *addr) {
                    eprintln!("corefs fsck: {device}: rewriting superblock copy {addr}: {e}");
                    return Verdict::Operational;
                }
                println!(
                    "corefs fsck: {device}: superblock copy at block {addr} was damaged ({why}): \
                     rewritten from generation {}",
                    current.generation
                );
                corrected += 1;
            } else {
                println!(
                    "corefs fsck: {device}: CORRUPT: superblock copy at block {addr}: {why} \
                     (the other copy is good: --repair rewrites this one)"
                );
                return Verdict::Uncorrected;
            }
        }
    }
    let records = match inspect::pending_log_records(&mut *dev) {
        Ok(records) => records,
        Err(why) => {
            eprintln!("corefs fsck: {device}: reading the logs: {why}");
            return Verdict::Operational;
        }
    };
    // Mounting replays the records and commits them, as every mount does: said before it
    // happens, with how to check without it.
    match (records, no_write) {
        (0, _) => eprintln!("corefs fsck: fsync logs: no records to replay"),
        (n, false) => eprintln!(
            "corefs fsck: fsync logs: {n} records: replaying them and writing them to \
             {device}, as a mount would (fsck -n checks without writing)"
        ),
        (n, true) => eprintln!(
            "corefs fsck: fsync logs: {n} records: replaying them in memory only (-n: nothing \
             is written to {device})"
        ),
    }
    // -n: every write of the mount (replay, commit) stays in an in-memory overlay over the
    // read-only device, so the engine runs exactly as it would and the device is not touched.
    let dev: Box<dyn nvme::BlockDevice> = if no_write {
        Box::new(nvme::wrap::OverlayDevice::new(dev))
    } else {
        dev
    };
    let mut fs = match engine::Filesystem::mount(dev, Default::default()) {
        Ok(fs) => fs,
        Err(e) => return failed(device, "", &e),
    };
    let generation = fs.durable_generation();
    eprintln!("corefs fsck: checking the trees (names, links, extents, space)...");
    let at = format!(" at generation {generation}");
    let report = match fs.check() {
        Ok(report) => report,
        Err(e) => return failed(device, &at, &e),
    };
    let mut data_blocks = None;
    if !no_data {
        match fs.check_data(&mut progress_bar()) {
            Ok(blocks) => data_blocks = Some(blocks),
            Err(e) => return failed(device, &at, &e),
        }
    }
    println!(
        "corefs fsck: {device}: clean at generation {generation}: {} inodes ({} directories), {} names, \
         {} items, {} tree blocks, {} data blocks{}{}",
        report.inodes,
        report.directories,
        report.names,
        report.items,
        report.tree_blocks,
        report.data_blocks,
        match data_blocks {
            Some(n) => format!(" ({n} verified against their checksums)"),
            None => " (data not read: --no-data)".into(),
        },
        if corrected > 0 {
            format!("; {corrected} error(s) corrected")
        } else {
            String::new()
        }
    );
    if corrected > 0 {
        Verdict::Corrected
    } else {
        Verdict::Clean
    }
}

/// The data check's progress (shards read of all): a bar redrawn in place on a terminal, one
/// line at the end otherwise, so a log gets no carriage returns.
fn progress_bar() -> impl FnMut(u32, u32) {
    let tty = std::io::stderr().is_terminal();
    move |done: u32, total: u32| {
        if tty {
            let width = 40;
            let filled = (done as usize * width) / total.max(1) as usize;
            eprint!(
                "\rcorefs fsck: data checksums [{}{}] {done}/{total} shards",
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            if done == total {
                eprintln!();
            }
        } else if done == total {
            eprintln!("corefs fsck: data checksums: {total} shards read");
        }
    }
}

/// fsck's verdict on an engine error: corruption is reported (errors left uncorrected),
/// anything else is an operational error, as e2fsck's codes go.
fn failed(device: &str, at: &str, e: &engine::EngineError) -> Verdict {
    if matches!(e, engine::EngineError::Corrupt { .. }) {
        println!("corefs fsck: {device}: CORRUPT{at}: {e}");
        Verdict::Uncorrected
    } else {
        eprintln!("corefs fsck: {device}: {e}");
        Verdict::Operational
    }
}
