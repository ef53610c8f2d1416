//! The C example program `tests/c/api_test.c` exercises the whole ABI, error cases included:
//! compiled against the committed header and the freshly built libcorefs through its
//! pkg-config file, then run. A missing C compiler or pkg-config fails the test (the test
//! command installs them), never skips it.
//!
//! `cargo test` builds the crate as an rlib for its tests, not necessarily the shared library:
//! build it first (`cargo build -p corefs-bindings`; the test command does). A library older
//! than any source it is built from fails the test rather than testing stale code.

use std::path::Path;
use std::process::Command;

#[path = "support/built_lib.rs"]
mod built_lib;

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn the_c_program_exercises_the_whole_api() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = built_lib::fresh_lib_dir();
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // An install tree as scripts/install-libcorefs.sh makes one: lib/, include/, the .pc file.
    let prefix = work.path().join("prefix");
    for sub in ["lib/pkgconfig", "include"] {
        std::fs::create_dir_all(prefix.join(sub)).unwrap();
    }
    std::fs::copy(
        lib_dir.join("libcorefs.so"),
        prefix.join("lib/libcorefs.so"),
    )
    .unwrap();
    std::fs::copy(
        crate_dir.join("include/corefs.h"),
        prefix.join("include/corefs.h"),
    )
    .unwrap();
    let pc = std::fs::read_to_string(crate_dir.join("corefs.pc.in"))
        .unwrap()
        .replace("@PREFIX@", prefix.to_str().unwrap())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(prefix.join("lib/pkgconfig/corefs.pc"), pc).unwrap();
    let flags = run(Command::new("pkg-config")
        .args(["--cflags", "--libs", "corefs"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    let exe = work.path().join("api_test");
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(crate_dir.join("tests/c/api_test.c"))
        .args(flags.split_whitespace())
        .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
    run(&mut cc);
    let images = work.path().join("images");
    std::fs::create_dir_all(&images).unwrap();
    let out = run(Command::new(&exe).arg(&images).env("COREFS_LOG", "error"));
    assert!(out.contains("checks passed"), "{out}");
    println!("{out}");
}
