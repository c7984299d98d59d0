#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ojs_core::fuzz_targets::content_type(data));
