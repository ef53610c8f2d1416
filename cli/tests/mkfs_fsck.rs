//! `corefs mkfs` and `corefs fsck` as an operator runs them: a clean image checks clean (exit
//! 0); a corrupted one is reported by name with e2fsck's exit code 4; a missing one is an
//! operational error (exit 8).

use std::process::Command;

fn corefs(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_corefs"))
        .args(args)
        .env("COREFS_LOG", "error")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn mkfs_then_fsck_clean_then_corrupt() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let image = dir.path().join("fs.img");
    let spec = format!("file:{}", image.display());
    let (code, text) = corefs(&[
        "mkfs", &spec, "--size", "64MiB", "--shards", "8", "--label", "t",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("8 shards"), "{text}");
    let (code, text) = corefs(&["fsck", &spec]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("clean at generation 2"), "{text}");

    // Flip a byte inside the root tree node: the first block shard 0's allocator hands out,
    // right after its log area (the superblock's log size is at byte 96).
    let mut bytes = std::fs::read(&image).unwrap();
    let log_blocks = u64::from_le_bytes(bytes[96..104].try_into().unwrap());
    let node = 2 + log_blocks;
    bytes[node as usize * 4096 + 200] ^= 0xff;
    std::fs::write(&image, &bytes).unwrap();
    let (code, text) = corefs(&["fsck", &spec]);
    assert_eq!(code, 4, "{text}");
    assert!(
        text.contains("CORRUPT")
            && text.contains(&format!("block {node}"))
            && text.contains("checksum"),
        "{text}"
    );

    // Both superblocks gone.
    bytes[..8192].fill(0);
    std::fs::write(&image, &bytes).unwrap();
    let (code, text) = corefs(&["fsck", &spec]);
    assert_eq!(code, 4, "{text}");
    assert!(text.contains("superblock"), "{text}");

    let (code, text) = corefs(&[
        "fsck",
        &format!("file:{}/missing.img", dir.path().display()),
    ]);
    assert_eq!(code, 8, "{text}");
}
