//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) and seeds made from
//! the examples, the official OJS vectors and a small proto through every
//! target of `ojs_bridge::fuzz_targets`, in every `cargo test`, with or
//! without cargo-fuzz.
//!
//! `OJS_BRIDGE_WRITE_FUZZ_SEEDS=1 cargo test -p ojs-bridge --test fuzz_corpus`
//! writes the seeds into the corpus folders.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use base64::Engine as _;
use ojs_bridge::fuzz_targets::{Parts, TARGETS};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::OutgoingMessage;
use prost::Message as _;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Outgoing messages as the daemon publishes them: jobs from the official
/// vectors in both encodings, with a key, a trace context and a retry
/// attempt.
fn messages() -> Vec<OutgoingMessage> {
    let root = repo().join("../shared/conformance/ojs-json-schema/valid");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .take(4)
    {
        let Ok(job) = JobEnvelope::from_json_slice(&std::fs::read(e.path()).unwrap()) else {
            continue;
        };
        for encoding in [Encoding::OjsProto, Encoding::OjsJson] {
            let mut m = OutgoingMessage::from_envelope(&job, encoding)
                .unwrap()
                .with_key(job.id.clone())
                .with_header(
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                )
                .with_header("ojs-attempt", "2");
            m.priority = 3;
            out.push(m);
        }
    }
    assert!(!out.is_empty(), "no vectors under {}", root.display());
    out
}

fn descriptor_seeds() -> Vec<Vec<u8>> {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("fuzz-descriptors");
    std::fs::write(
        dir.path().join("payment.proto"),
        r#"syntax = "proto3";
        package payment;
        enum Currency { CURRENCY_UNSPECIFIED = 0; EUR = 1; }
        message ProcessPaymentRequest {
          string order_id = 1;
          int64 amount_cents = 2;
          repeated string tags = 3;
          map<string, string> meta = 4;
          Currency currency = 5;
          optional bytes note = 6;
          double rate = 7;
        }
        message ProcessPaymentResponse { bool ok = 1; }
        service PaymentService {
          rpc ProcessPayment(ProcessPaymentRequest) returns (ProcessPaymentResponse);
        }"#,
    )
    .unwrap();
    let set = protox::compile(["payment.proto"], [dir.path()])
        .unwrap()
        .encode_to_vec();
    // order_id "o-1", amount_cents 1250, tags ["a"], meta {"k": "v"},
    // currency EUR, note "n", rate 0.5.
    let mut payload = vec![0x0A, 3, b'o', b'-', b'1', 0x10, 0xE2, 0x09, 0x1A, 1, b'a'];
    payload.extend_from_slice(&[
        0x22, 6, 0x0A, 1, b'k', 0x12, 1, b'v', 0x28, 1, 0x32, 1, b'n',
    ]);
    payload.push(0x39);
    payload.extend_from_slice(&0.5f64.to_le_bytes());
    vec![
        Parts::join(&[&set, &payload]),
        Parts::join(&[&set, &[]]),
        // An unknown field: JSON cannot carry it, the bytes go as base64.
        Parts::join(&[&set, &[0x78, 1]]),
    ]
}

/// Seeds for a target.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "config_toml" => {
            let mut out: Vec<Vec<u8>> = std::fs::read_dir(repo().join("examples"))
                .unwrap()
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "toml"))
                .map(|e| Parts::join(&[&std::fs::read(e.path()).unwrap(), b""]))
                .collect();
            out.push(Parts::join(&[
                ojs_bridge::config::EMBEDDED_DEFAULT.as_bytes(),
                b"OJS_BRIDGE_ADAPTER_LOCAL=memory://fuzz\nOJS_BRIDGE_HTTP_LISTEN=off\nOJS_BRIDGE_SHUTDOWN_TIMEOUT=5s\n",
            ]));
            out
        }
        "rabbitmq_properties" => messages()
            .iter()
            .map(|m| {
                let wire = ojs_adapter_rabbitmq::to_wire(
                    &ojs_adapter_rabbitmq::properties(m, Some(9)).unwrap(),
                )
                .unwrap();
                let mut rest = vec![1];
                rest.extend_from_slice(&m.payload);
                Parts::join(&[&wire, &rest])
            })
            .collect(),
        "kafka_headers" => messages()
            .iter()
            .map(|m| {
                let key = m.key.clone().unwrap_or_default();
                let mut parts: Vec<&[u8]> = vec![&key[..], &m.payload];
                for (name, value) in &m.headers {
                    parts.push(name.as_bytes());
                    parts.push(value.as_bytes());
                }
                parts.push(b"ojs-not-before");
                parts.push(b"1700000000000");
                parts.push(b"null-valued");
                parts.push(&[0xFF]);
                Parts::join(&parts)
            })
            .collect(),
        "sqs_attributes" => messages()
            .iter()
            .map(|m| {
                let body = base64::engine::general_purpose::STANDARD.encode(&m.payload);
                let key = m.key.clone().unwrap_or_default();
                let mut parts: Vec<&[u8]> = vec![body.as_bytes(), b"3", b"ojs-key", &[0], &key[..]];
                for (name, value) in &m.headers {
                    parts.push(name.as_bytes());
                    parts.push(&[0]);
                    parts.push(value.as_bytes());
                }
                parts.extend_from_slice(&[b"binary-one", &[2], &[0, 1, 2]]);
                Parts::join(&parts)
            })
            .collect(),
        "descriptor_transcode" => descriptor_seeds(),
        other => panic!("no seeds for {other}"),
    }
}

#[test]
fn every_target_takes_its_corpus_and_the_seeds_without_a_panic() {
    let write = std::env::var_os("OJS_BRIDGE_WRITE_FUZZ_SEEDS").is_some();
    for (name, target) in TARGETS {
        let dir = repo().join("fuzz/corpus").join(name);
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "{name}: no seeds");
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i:03}")), seed).unwrap();
            }
        }
        for seed in &seeds {
            target(seed);
        }
        let mut replayed = 0;
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

/// The seeds must reach the code they are for, or the fuzzer starts blind:
/// each decodes into what it was made from.
#[test]
fn the_seeds_decode_into_what_they_were_made_from() {
    let m = &messages()[0];
    let wire =
        ojs_adapter_rabbitmq::to_wire(&ojs_adapter_rabbitmq::properties(m, Some(9)).unwrap())
            .unwrap();
    let r = ojs_adapter_rabbitmq::received_from_wire(&wire, true).unwrap();
    assert_eq!(r.headers.get("traceparent"), m.headers.get("traceparent"));
    assert_eq!(r.key, m.key);
    assert_eq!(r.attempt, 3, "ojs-attempt 2 + one redelivery");

    let seed = &seeds("kafka_headers")[0];
    let mut parts = Parts::new(seed);
    assert_eq!(parts.next_part(), m.key.as_deref().unwrap());
    assert_eq!(parts.next_part(), &m.payload[..]);
    let record = ojs_adapter_kafka::received_record(
        [
            ("ojs-attempt", Some(&b"2"[..])),
            ("ojs-not-before", Some(&b"1"[..])),
            ("n", None),
        ]
        .into_iter()
        .map(|(name, value)| (name.as_bytes(), value)),
        Some(b"k"),
        b"body",
    );
    assert_eq!(record.attempt, 2);
    assert_eq!(record.key.as_deref(), Some(&b"k"[..]));
    assert_eq!(&record.payload[..], b"body");
    assert_eq!(
        record.headers.len(),
        1,
        "ojs-not-before and null values left out"
    );

    let attrs = [(
        "ojs-key".to_owned(),
        ojs_adapter_sqs::AttributeValue::builder()
            .data_type("String")
            .string_value("k")
            .build()
            .unwrap(),
    )]
    .into();
    let sqs = ojs_adapter_sqs::received_message("aGk=", Some(&attrs), Some("0"));
    assert_eq!(
        (&sqs.payload[..], sqs.key.as_deref(), sqs.attempt),
        (&b"hi"[..], Some(&b"k"[..]), 1)
    );

    let set = &seeds("descriptor_transcode")[0];
    let mut parts = Parts::new(set);
    let t = ojs_bridge::routes::transcode::Transcoder::from_bytes(
        parts.next_part(),
        Some("payment.ProcessPaymentRequest"),
    )
    .unwrap();
    let json = t
        .to_json("", "", parts.next_part())
        .unwrap()
        .expect("the seed payload is canonical");
    assert_eq!(json.json["orderId"], "o-1");
    assert_eq!(json.json["meta"]["k"], "v");

    for seed in seeds("config_toml") {
        let mut parts = Parts::new(&seed);
        let text = std::str::from_utf8(parts.next_part()).unwrap();
        let env: Vec<(String, String)> = String::from_utf8_lossy(parts.next_part())
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        // Examples name descriptor files relative to the repository and
        // env files that need not exist here: parsing is what is checked.
        if let Err(e) = ojs_bridge::config::BridgeConfig::parse(text, "seed", &env) {
            panic!("a config seed does not parse: {e}");
        }
    }
}
