//! What a filesystem says of itself (statistics, statfs), and whom a thread creates as.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// Reactor and engine statistics.
///
/// # Safety
/// `out` is valid for writing one `corefs_stats`.
#[no_mangle]
pub unsafe extern "C" fn corefs_get_stats(fs: corefs_fs, out: *mut corefs_stats) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_get_stats", fs, out, |fs| {
            let s = expect_reply!(call(fs, Op::Stats)?, Reply::Stats(s) => s)?;
            Ok(corefs_stats {
                ops: s.ops,
                reactor_cpu_ns: s.cpu_ns,
                commits: s.commit.commits,
                commit_ns_total: s.commit.commit_ns_total,
                commit_ns_max: s.commit.commit_ns_max,
                fsyncs: s.log.fsyncs,
                log_writes: s.log.log_writes,
                log_blocks: s.log.log_blocks,
                fallback_commits: s.log.fallback_commits(),
                fsync_groups: s.fsync_groups,
                fsync_p50_ns: s.fsync_total.p50_ns,
                fsync_p99_ns: s.fsync_total.p99_ns,
                fsync_max_ns: s.fsync_total.max_ns,
                replayed_records: s.log.replayed_records,
            })
        })
    }
}

/// Filesystem statistics: space and inode counts (what df and df -i show).
///
/// # Safety
/// `out` is valid for writing one `corefs_statfs`.
#[no_mangle]
pub unsafe extern "C" fn corefs_statfs(fs: corefs_fs, out: *mut corefs_statfs) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_statfs", fs, out, |fs| {
            let s = expect_reply!(call(fs, Op::Statfs)?, Reply::Statfs(s) => s)?;
            Ok(corefs_statfs {
                block_bytes: s.block_bytes as u64,
                total_blocks: s.total_blocks,
                free_blocks: s.free_blocks,
                inodes_used: s.inodes,
                inodes_free: s.free_inodes,
                name_max_bytes: s.name_max as u64,
            })
        })
    }
}

/// Sets who the calling thread creates files, directories and symbolic links as on `fs`
/// from now on: owner `uid` and group `gid` (per thread, as setfsuid(2) and setfsgid(2)).
/// COREFS_OWNER_DEFAULT for either gives it back to the mount's default (`corefs_options`'s
/// owner, else the process's effective id). Nothing else changes: corefs checks no
/// permissions in the C ABI (the calling process has them all). -EBADF for a bad `fs`.
#[no_mangle]
pub extern "C" fn corefs_set_owner(fs: corefs_fs, uid: u32, gid: u32) -> c_int {
    status("corefs_set_owner", || {
        let fs = fs_of(fs)?;
        let id = |v: u32| (v != COREFS_OWNER_DEFAULT).then_some(v);
        handles::set_thread_owner(fs.id, (id(uid), id(gid)))
    })
}
