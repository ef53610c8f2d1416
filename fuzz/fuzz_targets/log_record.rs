//! The fsync log record decoder and mount's replay on arbitrary log bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| engine::fuzz_harness::log_record(data));
