//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) and seeds made from the
//! official OJS vectors through every fuzz target: what the fuzzers found
//! (and what they start from) is checked by every `cargo test`, with or
//! without cargo-fuzz.
//!
//! The envelope's targets (`ojs_core::fuzz_targets`) are replayed here with
//! grpcq's, in the crate that sees both.
//! `OJS_BRIDGE_WRITE_FUZZ_SEEDS=1 cargo test -p ojs-grpcq --test fuzz_corpus`
//! writes the vector-derived seeds into the corpus folders.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use ojs_core::JobEnvelope;
use ojs_grpcq as grpcq;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn vectors() -> Vec<Vec<u8>> {
    let root = repo().join("../shared/conformance/ojs-json-schema");
    let mut out = Vec::new();
    for dir in ["valid", "invalid"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for e in entries.flatten() {
            out.push(std::fs::read(e.path()).unwrap());
        }
    }
    out
}

/// Seeds for a target, made from the vectors.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    let jobs: Vec<JobEnvelope> = vectors()
        .iter()
        .filter_map(|v| JobEnvelope::from_json_slice(v).ok())
        .collect();
    let call = grpcq::Message {
        originator: "svc-1".into(),
        topic: "payment.PaymentService".into(),
        action: "ProcessPayment".into(),
        payload: b"request".to_vec(),
        message_id: "m-1".into(),
        timestamp_ms: 1_763_700_000_000,
        metadata: [("traceparent".to_owned(), "00-01-02-01".to_owned())].into(),
    };
    match target {
        "envelope_json" => vectors(),
        "envelope_proto" => jobs
            .iter()
            .filter_map(|j| j.to_proto_bytes().ok())
            .collect(),
        "delimited_stream" => vec![
            ojs_core::envelope::stream::encode_delimited(&jobs).unwrap_or_default(),
            ojs_core::envelope::stream::encode_batch(&jobs).unwrap_or_default(),
        ],
        "grpcq_message" => vec![grpcq::encode(&call)],
        "grpcq_json" => vec![serde_json::to_vec(&grpcq::message_to_json(&call)).unwrap()],
        "content_type" => [
            "application/openjobspec+proto",
            "application/openjobspec+json; charset=utf-8",
            "application/openjobspec+proto; delimited=true",
            "application/grpcq+proto",
            "application/json, application/openjobspec+proto;q=0.5",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect(),
        other => panic!("no seeds for {other}"),
    }
}

#[test]
fn every_target_takes_its_corpus_and_the_vector_seeds_without_a_panic() {
    let write = std::env::var_os("OJS_BRIDGE_WRITE_FUZZ_SEEDS").is_some();
    let targets = ojs_core::fuzz_targets::TARGETS
        .iter()
        .chain(ojs_grpcq::fuzz_targets::TARGETS);
    for (name, target) in targets {
        let dir = repo().join("fuzz/corpus").join(name);
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "{name}: no seeds");
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i:03}")), seed).unwrap();
            }
        }
        let mut replayed = 0;
        for seed in &seeds {
            target(seed);
        }
        for entry in std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .flatten()
        {
            target(&std::fs::read(entry.path()).unwrap());
            replayed += 1;
        }
        assert!(replayed > 0, "{name}: empty corpus at {}", dir.display());
        println!("{name}: {} seeds, {replayed} corpus files", seeds.len());
    }
}
