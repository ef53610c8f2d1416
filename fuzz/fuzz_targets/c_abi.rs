//! The C ABI under arbitrary call programs (`corefs::fuzz_harness::abi_calls`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| corefs::fuzz_harness::abi_calls(data));
