#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ojs_bridge::fuzz_targets::sqs_attributes(data));
