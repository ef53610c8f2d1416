//! Mount, check and read back images made from arbitrary bytes (`engine::fuzz_harness`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzz_harness::mount_image(data));
