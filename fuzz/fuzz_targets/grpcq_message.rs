#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ojs_grpcq::fuzz_targets::grpcq_message(data));
