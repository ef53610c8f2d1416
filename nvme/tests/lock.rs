//! One writer per device (nvme::lock): a second exclusive open of a file image fails with an
//! error naming the holder's pid, in this process as in another; the lock goes with the last
//! queue holding it; a read-shared open works beside the writer and refuses writes; another
//! queue of the holding process shares the lock, and cannot be opened without a holder.
//! Bad sizes reaching a backend directly (not through a device string) are errors, not panics.

use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::backend::uring_file::{FileConfig, FileDevice};
use nvme::dma::{DmaPool, HugepagePolicy};
use nvme::{Access, DevError, OpenOptions};
use std::path::Path;

fn image(dir: &tempfile::TempDir) -> String {
    format!(
        "file:{},size=4MiB,hugepages=off",
        dir.path().join("img").display()
    )
}

fn open(spec: &str, access: Access) -> Result<Box<dyn nvme::BlockDevice>, DevError> {
    nvme::open_device(
        spec,
        &OpenOptions {
            access,
            ..Default::default()
        },
    )
}

fn busy_holder(result: Result<Box<dyn nvme::BlockDevice>, DevError>) -> String {
    match result {
        Err(DevError::Busy { holder, .. }) => holder,
        Err(e) => panic!("expected a busy error, got {e}"),
        Ok(_) => panic!("a second exclusive open of a held image succeeded"),
    }
}

#[test]
fn a_second_exclusive_open_fails_naming_the_holder_until_the_first_is_dropped() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = image(&dir);
    let first = open(&spec, Access::Exclusive).unwrap();
    let err = open(&spec, Access::Exclusive)
        .err()
        .expect("second open fails");
    let text = err.to_string();
    let pid = format!("pid {}", std::process::id());
    assert!(
        text.contains("in use") && text.contains(&pid) && text.contains("this process"),
        "{text}"
    );
    assert_eq!(
        nvme::lock::in_use(&spec).unwrap().and_then(|h| h.pid),
        Some(std::process::id())
    );
    drop(first);
    // (Not checked with in_use: a child another test spawns holds a copy of the descriptor
    // until it execs, and the exclusive open waits for that, in_use does not.)
    let again = open(&spec, Access::Exclusive).expect("free again after the drop");
    drop(again);
}

#[test]
fn read_shared_opens_beside_the_writer_and_refuses_writes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = image(&dir);
    let mut writer = open(&spec, Access::Exclusive).unwrap();
    nvme::write_sync(&mut *writer, 3, &[0x5a; 4096], true).unwrap();
    let mut reader = open(&spec, Access::ReadShared).expect("a reader while held");
    let mut back = [0u8; 4096];
    nvme::read_sync(&mut *reader, 3, &mut back).unwrap();
    assert_eq!(back, [0x5a; 4096]);
    for result in [
        nvme::write_sync(&mut *reader, 3, &[0u8; 4096], false),
        nvme::run_sync(
            &mut *reader,
            nvme::IoOp::WriteZeroes { lba: 3, lbas: 1 },
            &mut Vec::new(),
        )
        .map(drop),
    ] {
        match result {
            Err(DevError::Io { errno, .. }) if errno == libc::EROFS => {}
            other => panic!("a write on a read-shared device gave {other:?}"),
        }
    }
    // The reader holds no lock: with the writer gone, an exclusive open works beside it.
    drop(writer);
    let writer = open(&spec, Access::Exclusive).expect("a reader does not lock");
    drop((writer, reader));
}

#[test]
fn another_queue_shares_the_lock_and_keeps_it() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = image(&dir);
    let err = open(&spec, Access::AnotherQueue).err().expect("no holder");
    assert!(err.to_string().contains("does not hold"), "{err}");
    let first = open(&spec, Access::Exclusive).unwrap();
    let mut second = open(&spec, Access::AnotherQueue).expect("joins the holder");
    nvme::write_sync(&mut *second, 0, &[1u8; 4096], true).unwrap();
    drop(first);
    // The second queue still writes: the lock stays until it is gone too.
    busy_holder(open(&spec, Access::Exclusive));
    drop(second);
    open(&spec, Access::Exclusive).expect("released with the last queue");
}

#[test]
fn another_process_holding_the_image_is_named() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = image(&dir);
    drop(open(&spec, Access::Exclusive).unwrap()); // creates it
    let path = dir.path().join("img");
    // flock(1) holds no OFD lock, so the holder is a small program of our own: this test
    // binary re-run as a child that takes the lock and waits on stdin.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hold_lock_child",
            "--nocapture",
            "--include-ignored",
        ])
        .env("COREFS_HOLD", &path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the child says it holds the lock.
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.unwrap().contains("holding")),
        "the child did not take the lock"
    );
    let holder = busy_holder(open(&spec, Access::Exclusive));
    assert_eq!(holder, format!("held by pid {}", child.id()));
    drop(child.stdin.take()); // EOF: the child exits
    assert!(child.wait().unwrap().success());
    open(&spec, Access::Exclusive).expect("free once the holder exited");
}

/// Not a test on its own: the holder process of the test above.
#[test]
#[ignore = "run by another_process_holding_the_image_is_named"]
fn hold_lock_child() {
    let Some(path) = std::env::var_os("COREFS_HOLD") else {
        return;
    };
    let spec = format!("file:{}", Path::new(&path).display());
    let dev = open(&spec, Access::Exclusive).unwrap();
    println!("holding {spec}");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(dev);
}

#[test]
fn bad_sizes_reaching_a_backend_directly_are_errors() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // 2^63 + 4096 buffers of which two wrap to 8 KiB: once a segfault in the pool's iovecs.
    let cases: [(usize, u32, &str); 4] = [
        ((1 << 63) + 4096, 2, "buf="),
        (4096, 20000, "bufs="),
        (4 << 30, 1, "buf="),
        (16 << 20, 16384, "buf="),
    ];
    for (buf_bytes, buf_count, names) in cases {
        let err = DmaPool::new(buf_bytes, buf_count, HugepagePolicy::Never).unwrap_err();
        assert!(err.to_string().contains(names), "pool: {err}");
        let err = MemDevice::new(MemConfig {
            buf_bytes,
            buf_count,
            ..Default::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains(names), "mem: {err}");
        let err = FileDevice::open(
            &dir.path().join("direct"),
            &FileConfig {
                create_bytes: Some(1 << 20),
                buf_bytes,
                buf_count,
                ..Default::default()
            },
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains(names), "file: {err}");
    }
    for (config, names) in [
        (
            MemConfig {
                lba_size_bytes: 300,
                ..Default::default()
            },
            "lba=",
        ),
        (
            MemConfig {
                queue_depth: 0,
                ..Default::default()
            },
            "qd=",
        ),
        (
            MemConfig {
                capacity_bytes: u64::MAX,
                ..Default::default()
            },
            "size=",
        ),
    ] {
        let err = MemDevice::new(config).err().unwrap();
        assert!(err.to_string().contains(names), "{err}");
    }
    let err = FileDevice::open(
        &dir.path().join("direct"),
        &FileConfig {
            create_bytes: Some(1 << 20),
            queue_depth: u32::MAX,
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("qd="), "{err}");
}
