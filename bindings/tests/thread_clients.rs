//! Per-thread clients end with their filesystem: `corefs_close` drops every thread's client
//! (each holds the runtime's request queues), not only the closing thread's, so threads that
//! used a filesystem and then idle keep nothing of it. In a binary of its own: the count it
//! reads is the whole process's.

use corefs::abi::*;
use std::ffi::CString;
use std::sync::{Arc, Barrier};

#[test]
fn closing_drops_the_clients_of_threads_that_never_call_again() {
    let device = CString::new("mem:64MiB").unwrap();
    let options = corefs_options {
        format: 1,
        shards: 4,
        ..Default::default()
    };
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &options) };
    assert!(fs > 0, "mount: {fs}");
    let before = test_hook_thread_clients();
    const THREADS: usize = 4;
    let used = Arc::new(Barrier::new(THREADS + 1));
    let closed = Arc::new(Barrier::new(THREADS + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (used, closed) = (used.clone(), closed.clone());
            std::thread::spawn(move || {
                let root = CString::new("/").unwrap();
                let mut st = corefs_stat::default();
                // SAFETY: a NUL-terminated path and a writable stat.
                assert_eq!(unsafe { corefs_stat(fs, root.as_ptr(), &mut st) }, 0);
                used.wait();
                // Idle, alive, while the filesystem closes.
                closed.wait();
                // A call after the close is EBADF and makes no client.
                // SAFETY: as above.
                let after = unsafe { corefs_stat(fs, root.as_ptr(), &mut st) };
                assert_eq!(after, -libc::EBADF);
            })
        })
        .collect();
    used.wait();
    assert_eq!(
        test_hook_thread_clients(),
        before + THREADS as i64,
        "each thread made its client"
    );
    assert_eq!(corefs_close(fs), 0);
    assert_eq!(
        test_hook_thread_clients(),
        0,
        "idle threads kept their clients of a closed filesystem"
    );
    closed.wait();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(test_hook_thread_clients(), 0);
}
