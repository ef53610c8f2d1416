//! The committed header is what cbindgen generates from the source today.

#[test]
fn the_committed_header_matches_a_fresh_generation() {
    let crate_dir = env!("CARGO_MANIFEST_DIR");
    let config =
        cbindgen::Config::from_file(format!("{crate_dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("UTF-8");
    let path = format!("{crate_dir}/include/corefs.h");
    if std::env::var_os("COREFS_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing the header");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/corefs.h is stale: regenerate with COREFS_BLESS=1 cargo test -p corefs-bindings --test header"
    );
}
