#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ojs_api::fuzz_targets::api_request(data));
