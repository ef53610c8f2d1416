//! Through the C ABI, nothing a caller passes and no panic in a reactor takes the host
//! process down: a core the process may not run on is -EINVAL at mount; read and write
//! positions and lengths are bounded before anything is sized by them; and a reactor that
//! panics (the test hook `corefs::abi::test_hook_panic_on_next_request`, armed in these tests
//! through the reactor's `test-hooks` feature) turns every call, on any thread and to any
//! reactor, into -EIO with the panic's message, and `corefs_close` into an error.

use corefs::abi::*;
use std::ffi::{CStr, CString};

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Options that format the device with `shards` shards for `reactors` reactors.
fn options(shards: u32, reactors: u8) -> corefs_options {
    corefs_options {
        format: 1,
        reactors,
        shards,
        ..Default::default()
    }
}

fn mount(device: &str, shards: u32, reactors: u8) -> corefs_fs {
    let device = CString::new(device).unwrap();
    let o = options(shards, reactors);
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &o) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    fs
}

fn open(fs: corefs_fs, path: &str) -> corefs_fd {
    let path = CString::new(path).unwrap();
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, path.as_ptr(), COREFS_O_CREAT | COREFS_O_RDWR, 0o644) };
    assert!(fd > 0, "open: {fd} {}", last_error());
    fd
}

#[test]
fn a_pinned_core_the_process_may_not_run_on_is_einval_naming_it() {
    let device = CString::new("mem:64MiB").unwrap();
    for (core, reactors) in [(5000, 1), (u32::MAX, 2)] {
        let o = corefs_options {
            pin: 1,
            core,
            ..options(4, reactors)
        };
        // SAFETY: as in `mount`. This aborted the process before the core was checked.
        let fs = unsafe { corefs_mount(device.as_ptr(), &o) };
        let e = last_error();
        assert_eq!(fs, -(libc::EINVAL as i64), "{e}");
        assert!(
            e.contains(&format!("core {core} ")) && e.contains("allowed: "),
            "{e}"
        );
    }
}

#[test]
fn read_and_write_positions_and_lengths_are_bounded_before_they_size_anything() {
    let fs = mount("mem:64MiB", 4, 1);
    let fd = open(fs, "f");
    let data = [7u8; 100];
    let mut back = [0u8; 100];
    // SAFETY: `data` and `back` are valid for every length below that is honest; the huge
    // ones are refused before a buffer is touched.
    unsafe {
        assert_eq!(corefs_pwrite(fs, fd, data.as_ptr(), 100, 0), 100);
        let einval = -(libc::EINVAL as i64);
        // SIZE_MAX made the reactor's read path overflow `offset + len` and panic.
        assert_eq!(
            corefs_submit_pread(fs, fd, back.as_mut_ptr(), usize::MAX, 1, 1) as i64,
            einval
        );
        assert!(
            last_error().contains("largest file position"),
            "{}",
            last_error()
        );
        assert_eq!(
            corefs_submit_pread(fs, fd, back.as_mut_ptr(), 16, u64::MAX, 2) as i64,
            einval
        );
        assert_eq!(
            corefs_pread(fs, fd, back.as_mut_ptr(), 16, i64::MAX as u64),
            einval
        );
        assert_eq!(
            corefs_pwrite(fs, fd, data.as_ptr(), 2, i64::MAX as u64 - 1),
            einval
        );
        // A length no buffer has: refused before it sizes the copy (that allocation aborted
        // the process).
        assert_eq!(
            corefs_submit_pwrite(fs, fd, data.as_ptr(), isize::MAX as usize, 1, 3) as i64,
            einval
        );
        // Nothing was submitted, and the filesystem still serves.
        let mut done = [corefs_completion::default(); 4];
        assert_eq!(corefs_poll(fs, done.as_mut_ptr(), 4, 0), 0);
        assert_eq!(corefs_pread(fs, fd, back.as_mut_ptr(), 100, 0), 100);
        assert_eq!(back, data);
        assert_eq!(corefs_submit_pread(fs, fd, back.as_mut_ptr(), 50, 60, 4), 0);
        let n = corefs_poll(fs, done.as_mut_ptr(), 4, 5_000_000);
        assert_eq!((n, done[0].token, done[0].result), (1, 4, 40));
    }
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
}

fn ino(fs: corefs_fs, fd: corefs_fd) -> u64 {
    let mut st = corefs_stat::default();
    // SAFETY: `st` is writable.
    let r = unsafe { corefs_fstat(fs, fd, &mut st) };
    assert_eq!(r, 0, "{}", last_error());
    st.ino
}

/// `reactors` reactors over 4 shards; the last one panics. Returns nothing: every
/// assertion is about what the caller sees afterwards.
fn a_reactor_panic_is_eio_everywhere(reactors: u8) {
    let shards = 4;
    let fs = mount("mem:64MiB", shards, reactors);
    // Files in directories spread over the shards, so each reactor serves some.
    let mut files = Vec::new();
    for i in 0..shards {
        let dir = CString::new(format!("d{i}")).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { corefs_mkdir(fs, dir.as_ptr(), 0o755) }, 0);
        let fd = open(fs, &format!("d{i}/f"));
        // SAFETY: a 4 KiB buffer.
        let written = unsafe { corefs_pwrite(fs, fd, [i as u8; 4096].as_ptr(), 4096, 0) };
        assert_eq!(written, 4096);
        assert_eq!(corefs_fsync(fs, fd), 0);
        files.push((fd, ino(fs, fd)));
    }
    let reactors = reactors as usize;
    let owner = |ino: u64| (ino % shards as u64) as usize % reactors;
    let victim = reactors - 1;
    let (victim_fd, _) = *files.iter().find(|(_, i)| owner(*i) == victim).unwrap();
    let (bystander_fd, _) = *files.iter().find(|(_, i)| owner(*i) == 0).unwrap();
    assert!(test_hook_panic_on_next_request(fs, victim));
    let eio = -(libc::EIO as i64);
    let mut buf = [0u8; 4096];
    // SAFETY: `buf` is valid for 4096 bytes.
    let r = unsafe { corefs_pread(fs, victim_fd, buf.as_mut_ptr(), 4096, 0) };
    assert_eq!(r, eio, "{}", last_error());
    assert!(
        last_error().contains("panicked: test hook"),
        "{}",
        last_error()
    );
    // Another thread (another client), the other reactor, synchronous and asynchronous.
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        // SAFETY: `buf` is valid for 4096 bytes, and polled before it goes.
        unsafe {
            assert_eq!(
                corefs_pread(fs, bystander_fd, buf.as_mut_ptr(), 4096, 0),
                eio
            );
            assert_eq!(corefs_pwrite(fs, bystander_fd, buf.as_ptr(), 10, 0), eio);
            assert_eq!(corefs_fsync(fs, bystander_fd) as i64, eio);
            assert_eq!(
                corefs_submit_pread(fs, bystander_fd, buf.as_mut_ptr(), 10, 0, 9),
                0
            );
            let mut done = [corefs_completion::default(); 2];
            let n = corefs_poll(fs, done.as_mut_ptr(), 2, 10_000_000);
            assert_eq!((n, done[0].token, done[0].result), (1, 9, eio));
        }
    })
    .join()
    .unwrap();
    let close = corefs_close(fs);
    assert_eq!(close as i64, eio, "{}", last_error());
    assert!(last_error().contains("panicked"), "{}", last_error());
    // The process lives on, and so does the library: a new filesystem serves.
    let fs = mount("mem:64MiB", shards, 1);
    let fd = open(fs, "g");
    // SAFETY: `buf` is valid for 4096 bytes.
    let written = unsafe { corefs_pwrite(fs, fd, buf.as_ptr(), 4096, 0) };
    assert_eq!(written, 4096);
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
}

#[test]
fn a_reactor_that_panics_makes_every_call_eio_and_close_an_error() {
    a_reactor_panic_is_eio_everywhere(1);
}

#[test]
fn a_panic_in_one_of_two_reactors_is_eio_on_both_and_nothing_hangs() {
    a_reactor_panic_is_eio_everywhere(2);
}
