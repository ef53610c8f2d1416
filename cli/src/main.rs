//! `corefs`: the command-line tool for operators and benchmarkers: `mkfs`, `fsck`, `mount`
//! (FUSE), `probe` (kernel features), `crashtest`, and `bench` (the suite, compare, and the
//! narrower device, engine, fsync and clients benchmarks).
//!
//! Each command is a module of [`cmd`] with its flags and its `run`; this file parses the
//! command line, sets up logging and the process (allocator, huge pages), dispatches, and
//! turns the outcome into the exit code: 0 or 1 with the error on stderr, and e2fsck's codes
//! for `fsck`. Clap's own errors (bad flags) exit 2.

mod cmd;
mod fuse;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "corefs",
    version,
    about = "corefs: a polled-mode userspace filesystem"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Mkfs(cmd::mkfs::Args),
    Fsck(cmd::fsck::Args),
    Dump(cmd::dump::Args),
    Probe(cmd::probe::Args),
    Crashtest(cmd::crashtest::Args),
    Mount(cmd::mount::Args),
    Serve(cmd::serve::Args),
    Sync(cmd::sync::Args),
    Top(cmd::top::Args),
    Soak(cmd::soak::Args),
    Sim(cmd::sim::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
}

/// The tool's allocator. The reactor frees what client threads allocated (an operation's
/// names and data) and the clients free its replies; glibc's malloc takes a lock per such free
/// and consolidates arenas on the reactor's time. An application embedding corefs chooses its
/// own allocator; this one is for the tool's runs (docs/reactors.md has the measurement).
/// Transparent huge pages are turned off for the process in `main` (see there).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (`mi_option_e` in mimalloc.h: 15 in its v2 and v3; a
/// test checks that the option has the purge delay's default).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

extern "C" {
    // mimalloc's option calls (linked through the `mimalloc` crate, which declares them only
    // behind a feature that pulls in one more crate).
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
    #[cfg(test)]
    fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
}

/// The allocator keeps the memory freed to it instead of returning it to the kernel. mimalloc
/// returns free memory (`madvise(MADV_DONTNEED)`) a second after it was freed, in whichever
/// thread next allocates and finds the purge due: the reactor, in a create run, which then
/// spent up to 10 ms in `madvise` and the TLB shootdowns it sends to the clients' core (a
/// 5 s run purged 378 MiB in 274 purges, every page of it faulted back in afterwards). Those
/// were the longest turns of the reactor's loop that the host's steal did not explain
/// (docs/reactors.md). The process keeps its peak heap instead; the engine's caches are
/// bounded, so that peak is too.
fn keep_freed_memory() {
    // SAFETY: mi_option_set takes two integers and may be called at any time.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// No transparent huge pages for this process. mimalloc advises its heap segments for them,
/// so the first touch of a segment faults in and zeroes 2 MiB on whichever thread touches it,
/// the reactor included, which stalls the requests it serves for milliseconds where memory is
/// backed lazily (a VM; docs/reactors.md has the measurement). Latency-bound servers commonly
/// run without THP for the same reason. The DMA pool uses hugetlb pages when reserved, which
/// this does not affect.
fn disable_transparent_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if rc != 0 {
        tracing::debug!(
            "prctl(PR_SET_THP_DISABLE) failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// fsck's exit code, as e2fsck's: 0 clean, 1 errors corrected, 4 errors left uncorrected, 8
/// operational error.
fn fsck_exit_code(verdict: cmd::fsck::Verdict) -> ExitCode {
    use cmd::fsck::Verdict;
    ExitCode::from(match verdict {
        Verdict::Clean => 0,
        Verdict::Corrected => 1,
        Verdict::Uncorrected => 4,
        Verdict::Operational => 8,
    })
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    keep_freed_memory();
    let cli = Cli::parse();
    // The crash tester mounts millions of crash states, most of which replay or drop a log
    // record: only errors are worth a line there.
    let default_level = match cli.command {
        Command::Crashtest(_) | Command::Sim(_) => "error",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COREFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Mkfs(args) => cmd::mkfs::run(args),
        Command::Fsck(args) => return fsck_exit_code(cmd::fsck::run(args)),
        Command::Dump(args) => cmd::dump::run(args),
        Command::Probe(args) => cmd::probe::run(args),
        Command::Crashtest(args) => cmd::crashtest::run(args),
        Command::Mount(args) => cmd::mount::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Sync(args) => cmd::sync::run(args),
        Command::Top(args) => cmd::top::run(args),
        Command::Soak(args) => cmd::soak::run(args),
        Command::Sim(args) => cmd::sim::run(args),
        Command::Bench(bench) => cmd::bench::run(bench),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("corefs: {why}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option index is mimalloc's purge delay: before the tool sets it, it has the delay's
    /// default (1000 ms in mimalloc 3.x, unless MIMALLOC_PURGE_DELAY says otherwise); after,
    /// it says never. An upgrade that renumbers the options fails here rather than setting
    /// some other option to -1.
    #[test]
    fn keep_freed_memory_sets_mimallocs_purge_delay_to_never() {
        let from_env = std::env::var("MIMALLOC_PURGE_DELAY")
            .ok()
            .and_then(|v| v.parse::<std::ffi::c_long>().ok());
        // SAFETY: mi_option_get takes an integer and only reads mimalloc's option table.
        let before = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(
            before,
            from_env.unwrap_or(1000),
            "option {MI_OPTION_PURGE_DELAY} is not mimalloc's purge delay"
        );
        keep_freed_memory();
        // SAFETY: as above.
        assert_eq!(unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }, -1);
    }
}
