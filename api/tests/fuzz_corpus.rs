//! Replays the API's fuzz corpus (`fuzz/corpus/api_request/`) through its
//! target (`ojs_api::fuzz_targets`), with the corpus's seeds cut at every
//! length and with each route byte: what the fuzzer found, and what it
//! starts from, is checked by every `cargo test`, with or without
//! cargo-fuzz.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn the_api_request_corpus_replays_without_a_panic() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/api_request");
    let mut inputs = Vec::new();
    for e in std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
    {
        inputs.push(std::fs::read(e.path()).unwrap());
    }
    assert!(inputs.len() >= 5, "the seeds are in {}", dir.display());
    for (name, target) in ojs_api::fuzz_targets::TARGETS {
        let mut runs = 0;
        for input in &inputs {
            let Some((_, body)) = input.split_first() else {
                continue;
            };
            for route in 0u8..8 {
                for proto in [0u8, 0x80] {
                    let mut data = vec![route | proto];
                    data.extend_from_slice(body);
                    target(&data);
                    runs += 1;
                    for cut in (0..body.len()).step_by(7) {
                        target(&data[..=cut]);
                        runs += 1;
                    }
                }
            }
        }
        println!("{name}: {runs} inputs replayed");
    }
}
