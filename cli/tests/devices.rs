//! Device strings and exclusive access as an operator meets them through `corefs`:
//! - an option out of its range is a clear error naming it, and the tool exits with an error
//!   code, never a signal (`buf=9223372036854779904,bufs=2` once wrapped `buf * bufs` and mkfs
//!   died of SIGSEGV; `bufs=20000` and `buf=4G` panicked; `lba=4294967808` was read as 512);
//! - an image another process holds (here: this test, through the device layer) cannot be
//!   mounted, formatted or fscked, with or without --repair, and the error names the holder's
//!   pid; `dump` and `fsck -n` read it and warn that it is in use; once released, all work.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

/// Runs `corefs ARGS`; returns the exit status and stdout + stderr. A `mount` that is still
/// serving after 30 s mounted what it should have refused: it is unmounted and the test fails
/// (rather than waiting for it forever).
fn corefs(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .args(args)
        .env("COREFS_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            if args[0] == "mount" {
                let _ = Command::new("umount").arg("-l").arg(args[2]).status();
            }
            let _ = child.kill();
            let _ = child.wait();
            panic!("corefs {args:?} was still running after 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

#[test]
fn out_of_range_device_options_are_errors_not_signals() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();
    let image = dir.path().join("fs.img");
    let file = |options: &str| format!("file:{},size=64MiB,{options}", image.display());
    let cases: Vec<(String, &str)> = vec![
        ("mem:64MiB,buf=9223372036854779904,bufs=2".into(), "buf="),
        ("mem:64MiB,bufs=20000".into(), "bufs=20000"),
        ("mem:64MiB,buf=4G".into(), "buf=4294967296"),
        ("mem:64MiB,lba=4294967808".into(), "lba=4294967808"),
        ("mem:64MiB,buf=16MiB,bufs=1024".into(), "bufs=1024"),
        (file("buf=9223372036854779904,bufs=2"), "buf="),
        (file("qd=99999999999"), "qd=99999999999"),
        (file("sqpoll=0"), "sqpoll=0"),
    ];
    let mp = mountpoint.to_str().unwrap();
    for (spec, names) in &cases {
        for args in [
            vec!["mkfs", spec],
            vec!["fsck", spec],
            vec!["dump", spec, "super"],
            vec!["mount", spec, mp],
        ] {
            let (status, text) = corefs(&args);
            assert_eq!(status.signal(), None, "{args:?} died of a signal: {text}");
            assert!(!status.success(), "{args:?} succeeded: {text}");
            assert!(
                text.contains("bad device string") && text.contains(names),
                "{args:?}: the error does not name {names:?}: {text}"
            );
            assert!(!text.contains("panicked"), "{args:?}: {text}");
        }
    }
    assert!(!image.exists(), "a bad string created the image");
}

#[test]
fn an_image_held_by_another_process_is_refused_to_writers_and_read_with_a_warning() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let image = dir.path().join("fs.img");
    let spec = format!("file:{}", image.display());
    let (status, text) = corefs(&["mkfs", &spec, "--size", "64MiB", "--shards", "2"]);
    assert!(status.success(), "{text}");
    let before = std::fs::read(&image).unwrap();
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();

    let held = nvme::open_device(&spec, &nvme::OpenOptions::default()).unwrap();
    let holder = format!("held by pid {}", std::process::id());
    for args in [
        vec!["mount", &spec, mountpoint.to_str().unwrap()],
        vec!["mkfs", &spec],
        vec!["fsck", &spec],
        vec!["fsck", &spec, "--repair"],
    ] {
        let (status, text) = corefs(&args);
        assert!(
            !status.success(),
            "{args:?} succeeded on a held image: {text}"
        );
        assert_eq!(status.signal(), None, "{args:?}: {text}");
        assert!(
            text.contains("is in use") && text.contains(&holder),
            "{args:?}: the error does not name the holder: {text}"
        );
    }
    assert_eq!(
        std::fs::read(&image).unwrap(),
        before,
        "a refused tool changed the image"
    );

    // Readers work beside the holder, and say it is in use.
    for args in [vec!["dump", &spec, "super"], vec!["fsck", "-n", &spec]] {
        let (status, text) = corefs(&args);
        assert!(status.success(), "{args:?} on a held image: {text}");
        assert!(
            text.contains("warning") && text.contains("is in use") && text.contains(&holder),
            "{args:?} does not warn: {text}"
        );
    }
    let (_, text) = corefs(&["dump", &spec, "super"]);
    assert!(text.contains("superblock copy at block 0"), "{text}");

    drop(held);
    let (status, text) = corefs(&["fsck", &spec]);
    assert!(status.success(), "released: {text}");
    let (status, text) = corefs(&["dump", &spec, "super"]);
    assert!(status.success() && !text.contains("warning"), "{text}");
}
