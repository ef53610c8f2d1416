//! The libcorefs.so this test run links against, for tests that load the shared library
//! (the C program, the fio engine): `cargo test` builds the crate as an rlib, not
//! necessarily the shared library, so the test command builds it first. A library older than
//! any source it is built from fails the test rather than testing stale code, and so does one
//! built with the `sim` feature (the test machinery; scripts/sqlite-test.sh and
//! scripts/rocksdb-test.sh build the release library so): these tests check the library as it
//! ships. Included with `#[path]` by the tests that need it (they live in two crates).

use std::path::{Path, PathBuf};

/// target/<profile>/, where cargo put libcorefs.so for this test run.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// The workspace's root directory.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace")
        .to_path_buf()
}

fn newest_mtime(dir: &Path) -> std::time::SystemTime {
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).unwrap()
        };
        newest = newest.max(t);
    }
    newest
}

/// The directory holding this run's libcorefs.so, checked to exist and to be newer than
/// every source it is built from.
pub fn fresh_lib_dir() -> PathBuf {
    let lib_dir = target_dir();
    let lib = lib_dir.join("libcorefs.so");
    let built = std::fs::metadata(&lib)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} is missing: run `cargo build -p corefs-bindings` first",
                lib.display()
            )
        });
    for source in ["bindings/src", "reactor/src", "engine/src", "nvme/src"] {
        assert!(
            newest_mtime(&workspace().join(source)) <= built,
            "{} is older than {source}: run `cargo build -p corefs-bindings` first",
            lib.display()
        );
    }
    assert!(
        !built_with_sim(&lib),
        "{} was built with the `sim` feature (test machinery; scripts/sqlite-test.sh and \
         scripts/rocksdb-test.sh build it so): these tests check the library as it ships, run \
         `cargo build -p corefs-bindings` (without --features sim) first",
        lib.display()
    );
    lib_dir
}

/// Whether `lib` carries the test machinery. The production build refuses the simulation
/// options with a message only its code holds (nvme/src/spec.rs), so a library without that
/// text was built with `sim`.
fn built_with_sim(lib: &Path) -> bool {
    const PRODUCTION_ONLY: &[u8] = b"needs a build with the `sim` feature";
    let bytes = std::fs::read(lib).unwrap_or_else(|e| panic!("reading {}: {e}", lib.display()));
    !bytes
        .windows(PRODUCTION_ONLY.len())
        .any(|w| w == PRODUCTION_ONLY)
}
