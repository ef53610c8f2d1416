//! Mount, check, read, change and remount a valid image with one tree node, superblock or log
//! record mutated field by field and re-checksummed (`engine::fuzz_harness::structured_image`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzz_harness::structured_image(data));
