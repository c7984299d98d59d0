//! Envelope codec behaviour: interop with prost, unknown fields, the JSON ↔
//! protobuf edges of docs/design.md §3, limits, and one test per kind of bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{TimeZone, Utc};
use ojs_core::envelope::stream::{decode_batch, decode_delimited, encode_batch, encode_delimited};
use ojs_core::{Encoding, Error, JobEnvelope, JobState, RetryPolicy};
use ojs_proto::openjobspec::v1 as pb;
use prost::Message;
use serde_json::json;

const MINIMAL: &str = r#"{
  "specversion": "1.0",
  "id": "019539a4-b68c-7def-8000-1a2b3c4d5e6f",
  "type": "email.send",
  "queue": "default",
  "args": ["user@example.com", "welcome"]
}"#;

fn full_json() -> serde_json::Value {
    json!({
        "specversion": "1.0",
        "id": "019539a4-b68c-7def-8000-2b3c4d5e6f7a",
        "type": "video.transcode",
        "queue": "media",
        "args": ["video_001", "1080p", 3, 2.5, true, null, {"nested": [1, {"x": "y"}]}],
        "meta": {"trace_id": "abc", "tenant": {"id": 7}},
        "priority": 5,
        "timeout": 3600,
        "scheduled_at": "2026-03-01T10:00:00.123456789Z",
        "expires_at": "2026-03-02T10:00:00Z",
        "retry": {"max_attempts": 3, "initial_interval": "PT10S", "backoff_coefficient": 2.0,
                  "max_interval": "PT5M", "jitter": true, "non_retryable_errors": ["ValidationError"],
                  "on_exhaustion": "dead_letter"},
        "unique": {"keys": ["type", "args"], "period": "PT1H", "on_conflict": "reject"},
        "schema": "https://example.com/schemas/transcode.json",
        "state": "retryable",
        "attempt": 2,
        "created_at": "2026-03-01T09:59:00Z",
        "enqueued_at": "2026-03-01T09:59:01Z",
        "started_at": "2026-03-01T10:00:01Z",
        "completed_at": "2026-03-01T10:00:02Z",
        "error": {"type": "Timeout", "message": "took too long", "backtrace": ["at a", "at b"],
                  "timeout_kind": "execution", "limit_seconds": 30, "elapsed_seconds": 31},
        "result": {"ok": false},
        "total_timeout": 86400,
        "enqueue_ttl": 600,
        "grace_period": 60,
        "heartbeat_timeout": 30,
        "result_ttl": 3600,
        "extensions": {"x-acme-gpu-tier": "a100"}
    })
}

#[test]
fn spec_minimal_example_matches_prost_generated_encoding() {
    let job = JobEnvelope::from_json_slice(MINIMAL.as_bytes()).unwrap();
    let ours = job.to_proto_bytes().unwrap();
    let theirs = pb::JobEnvelope {
        specversion: "1.0".into(),
        id: "019539a4-b68c-7def-8000-1a2b3c4d5e6f".into(),
        r#type: "email.send".into(),
        queue: "default".into(),
        args: vec![
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(
                    "user@example.com".into(),
                )),
            },
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue("welcome".into())),
            },
        ],
        ..Default::default()
    };
    assert_eq!(ours, theirs.encode_to_vec());
}

#[test]
fn full_envelope_is_byte_identical_to_prost_and_round_trips() {
    let job = JobEnvelope::from_json_value(full_json()).unwrap();
    let ours = job.to_proto_bytes().unwrap();
    // prost reads our bytes and writes exactly the same bytes back.
    let decoded = pb::JobEnvelope::decode(ours.as_slice()).unwrap();
    assert_eq!(decoded.r#type, "video.transcode");
    assert_eq!(
        decoded.retry.as_ref().unwrap().non_retryable_errors,
        vec!["ValidationError"]
    );
    assert_eq!(decoded.scheduled_at.as_ref().unwrap().nanos, 123_456_789);
    assert_eq!(decoded.error.as_ref().unwrap().backtrace, "at a\nat b");
    assert_eq!(decoded.encode_to_vec(), ours);
    // proto → model → JSON gives back the document.
    let back = JobEnvelope::from_proto_bytes(&ours).unwrap();
    assert_eq!(back, job);
    assert_eq!(back.to_json_value().unwrap(), full_json());
}

#[test]
fn unknown_top_level_and_nested_fields_survive_byte_for_byte() {
    let job = JobEnvelope::from_json_value(full_json()).unwrap();
    let mut msg = job.to_proto_bytes().unwrap();
    // Unknown top-level fields: 50 (varint), 300 (bytes), 7000 (fixed32).
    let unknown: &[u8] = &[
        0x90, 0x03, 0x2a, // field 50, varint 42
        0xe2, 0x12, 0x03, b'n', b'e', b'w', // field 300, "new"
        0xc5, 0xb5, 0x03, 1, 2, 3, 4, // field 7000, fixed32
    ];
    msg.extend_from_slice(unknown);
    let decoded = JobEnvelope::from_proto_bytes(&msg).unwrap();
    assert!(decoded.has_unknown_fields());
    assert_eq!(decoded.unknown_fields, unknown);
    assert_eq!(
        decoded.to_proto_bytes().unwrap(),
        msg,
        "re-encoded byte-for-byte"
    );

    // Unknown field inside RetryPolicy (field 9 of retry) survives too.
    let mut inner = pb::RetryPolicy {
        max_attempts: Some(4),
        ..Default::default()
    }
    .encode_to_vec();
    inner.extend_from_slice(&[0x48, 0x07]); // field 9 varint 7
    let mut outer = pb::JobEnvelope {
        specversion: "1.0".into(),
        id: "019539a4-b68c-7def-8000-1a2b3c4d5e6f".into(),
        r#type: "a.b".into(),
        queue: "q".into(),
        ..Default::default()
    }
    .encode_to_vec();
    outer.push(0x5a); // field 11, length-delimited
    outer.push(inner.len() as u8);
    outer.extend_from_slice(&inner);
    let decoded = JobEnvelope::from_proto_bytes(&outer).unwrap();
    assert_eq!(
        decoded.retry.as_ref().unwrap().unknown_fields,
        vec![0x48, 0x07]
    );
    assert_eq!(decoded.to_proto_bytes().unwrap(), outer);
}

#[test]
fn unknown_fields_in_the_middle_keep_their_bytes() {
    let job = JobEnvelope::from_json_slice(MINIMAL.as_bytes()).unwrap();
    let plain = job.to_proto_bytes().unwrap();
    let unknown = [0x90, 0x03, 0x2a];
    // Put the unknown field first: we re-encode it after the known ones.
    let mut msg = unknown.to_vec();
    msg.extend_from_slice(&plain);
    let re = JobEnvelope::from_proto_bytes(&msg)
        .unwrap()
        .to_proto_bytes()
        .unwrap();
    assert_eq!(re.len(), msg.len());
    assert!(re.ends_with(&unknown));
    assert_eq!(
        JobEnvelope::from_proto_bytes(&re).unwrap().unknown_fields,
        unknown
    );
}

#[test]
fn integers_beyond_2_53_are_rejected_with_their_path() {
    let mut doc = full_json();
    doc["args"] = json!([1, {"amount": 9_007_199_254_740_993u64}]);
    let err = JobEnvelope::from_json_value(doc).unwrap_err();
    match err {
        Error::NumberOutOfRange { path, .. } => assert_eq!(path, "args[1].amount"),
        other => panic!("unexpected {other}"),
    }
    let mut doc = full_json();
    doc["meta"] = json!({"big": -9_007_199_254_740_993i64});
    assert!(
        matches!(JobEnvelope::from_json_value(doc), Err(Error::NumberOutOfRange { path, .. }) if path == "meta.big")
    );
    // 2^53 itself is exact and fine.
    let mut doc = full_json();
    doc["args"] = json!([9_007_199_254_740_992u64]);
    let job = JobEnvelope::from_json_value(doc).unwrap();
    let back = JobEnvelope::from_proto_bytes(&job.to_proto_bytes().unwrap()).unwrap();
    assert_eq!(back.args, vec![json!(9_007_199_254_740_992u64)]);
}

#[test]
fn timestamp_offsets_are_normalised_to_utc() {
    let mut doc = full_json();
    doc["scheduled_at"] = json!("2026-03-01T12:30:00+02:30");
    let job = JobEnvelope::from_json_value(doc).unwrap();
    assert_eq!(
        job.scheduled_at,
        Some(Utc.with_ymd_and_hms(2026, 3, 1, 10, 0, 0).unwrap())
    );
    let out = job.to_json_value().unwrap();
    assert_eq!(out["scheduled_at"], "2026-03-01T10:00:00Z");
    let back = JobEnvelope::from_proto_bytes(&job.to_proto_bytes().unwrap()).unwrap();
    assert_eq!(back.scheduled_at, job.scheduled_at);
}

#[test]
fn the_epoch_means_unset_in_both_codecs() {
    let mut doc = full_json();
    doc["expires_at"] = json!("1970-01-01T00:00:00Z");
    let job = JobEnvelope::from_json_value(doc).unwrap();
    assert_eq!(job.expires_at, None);
    assert!(job.to_json_value().unwrap().get("expires_at").is_none());
    // A protobuf Timestamp {0, 0} present on the wire is also unset.
    let msg = pb::JobEnvelope {
        specversion: "1.0".into(),
        id: "019539a4-b68c-7def-8000-1a2b3c4d5e6f".into(),
        r#type: "a.b".into(),
        queue: "q".into(),
        expires_at: Some(prost_types::Timestamp {
            seconds: 0,
            nanos: 0,
        }),
        ..Default::default()
    };
    let job = JobEnvelope::from_proto_bytes(&msg.encode_to_vec()).unwrap();
    assert_eq!(job.expires_at, None);
}

#[test]
fn durations_stay_iso8601_strings() {
    let job = JobEnvelope::from_json_value(full_json()).unwrap();
    let msg = pb::JobEnvelope::decode(job.to_proto_bytes().unwrap().as_slice()).unwrap();
    let retry = msg.retry.unwrap();
    assert_eq!(retry.initial_interval, "PT10S");
    assert_eq!(retry.max_interval, "PT5M");
    assert_eq!(msg.unique.unwrap().period, "PT1H");
}

#[test]
fn json_without_jitter_means_jitter_true_and_survives_protobuf() {
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    doc["retry"] = json!({"max_attempts": 5});
    let job = JobEnvelope::from_json_value(doc).unwrap();
    assert!(job.retry.as_ref().unwrap().jitter);
    let back = JobEnvelope::from_proto_bytes(&job.to_proto_bytes().unwrap()).unwrap();
    assert_eq!(back.retry, job.retry);
    assert_eq!(
        back.to_json_value().unwrap()["retry"],
        json!({"max_attempts": 5, "jitter": true})
    );
}

#[test]
fn null_is_absent_and_absent_attributes_are_omitted() {
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    doc["result"] = json!(null);
    doc["meta"] = json!(null);
    doc["priority"] = json!(null);
    let job = JobEnvelope::from_json_value(doc).unwrap();
    assert_eq!(job.result, None);
    let out = job.to_json_value().unwrap();
    assert_eq!(
        out,
        serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap()
    );
}

#[test]
fn unknown_json_attributes_survive_protobuf_in_field_22() {
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    doc["tags"] = json!(["a"]);
    doc["x_hint"] = json!({"shard": 3, "none": null});
    doc["x_null"] = json!(null);
    let job = JobEnvelope::from_json_value(doc.clone()).unwrap();
    assert_eq!(job.to_json_value().unwrap(), doc);
    let back = JobEnvelope::from_proto_bytes(&job.to_proto_bytes().unwrap()).unwrap();
    assert_eq!(back.to_json_value().unwrap(), doc);
    // A prost peer sees field 22 as the `attributes` map.
    let generated = pb::JobEnvelope::decode(job.to_proto_bytes().unwrap().as_slice()).unwrap();
    assert_eq!(generated.attributes.len(), 3);
}

#[test]
fn unknown_attribute_keys_that_need_escapes_are_written_escaped() {
    // Keys the input gave are the one kind of key the envelope's writer
    // does not know at compile time: each goes through the escaping writer.
    let keys = [
        "x\"quoted\"",
        "back\\slash",
        "line\nbreak\ttab",
        "bell\u{7}and\u{1f}",
        "del\u{7f}",
        "ünïcödé ✓",
        "\u{2028}sep",
    ];
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    for (i, key) in keys.iter().enumerate() {
        doc[*key] = json!({ "n": i, "s": *key });
    }
    let job = JobEnvelope::from_json_value(doc.clone()).unwrap();
    assert_eq!(job.unknown_attributes.len(), keys.len());
    let bytes = job.to_json_vec().unwrap();
    // Valid JSON, the same object, and each key spelled as serde_json
    // spells it (the escapes of `write_str`, not a copy of the raw key).
    let back: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(back, doc);
    let text = std::str::from_utf8(&bytes).unwrap();
    for key in keys {
        let escaped = serde_json::to_string(key).unwrap();
        assert!(text.contains(&format!("{escaped}:")), "{escaped} in {text}");
    }
    assert!(!text.contains('\n'), "a raw line break in {text}");
    assert_eq!(job.to_json_string().unwrap().as_bytes(), bytes.as_slice());
}

#[test]
fn the_id_alone_is_read_from_well_formed_bytes_only() {
    let job = JobEnvelope::from_json_slice(MINIMAL.as_bytes()).unwrap();
    let bytes = job.to_proto_bytes().unwrap();
    assert_eq!(
        JobEnvelope::proto_id(&bytes),
        Some("019539a4-b68c-7def-8000-1a2b3c4d5e6f")
    );
    // Unknown fields and invalid known ones around it do not matter: only
    // decoding and validating the whole envelope says what is wrong.
    let mut invalid = bytes.clone();
    invalid.extend_from_slice(&[0x0a, 3, b'9', b'.', b'9', 0x90, 0x03, 0x2a]);
    assert!(JobEnvelope::from_proto_bytes(&invalid).is_err());
    assert_eq!(
        JobEnvelope::proto_id(&invalid),
        JobEnvelope::proto_id(&bytes)
    );
    // No id, an empty one, one of the wrong wire type, one that is not
    // UTF-8, truncated bytes, JSON: none.
    let mut without = Vec::new();
    for (field, value) in [(1u8, "1.0"), (3, "email.send")] {
        without.extend_from_slice(&[field << 3 | 2, value.len() as u8]);
        without.extend_from_slice(value.as_bytes());
    }
    let wrong_type = [&bytes[..], &[0x10, 0x01]].concat();
    let empty = [&bytes[..], &[0x12, 0x00]].concat();
    let not_utf8 = [&bytes[..], &[0x12, 0x02, 0xff, 0xfe]].concat();
    for (name, b) in [
        ("no id", &without[..]),
        ("empty", &empty[..]),
        ("wrong wire type", &wrong_type[..]),
        ("not UTF-8", &not_utf8[..]),
        ("truncated", &bytes[..bytes.len() - 3]),
        ("JSON", MINIMAL.as_bytes()),
    ] {
        assert_eq!(JobEnvelope::proto_id(b), None, "{name}");
    }
}

#[test]
fn one_mebibyte_envelopes_work_in_both_codecs() {
    let big = "x".repeat(1024 * 1024);
    let job = JobEnvelope::new("blob.store", vec![json!(big)]);
    let bytes = job.to_proto_bytes().unwrap();
    assert!(bytes.len() > 1024 * 1024);
    assert_eq!(JobEnvelope::from_proto_bytes(&bytes).unwrap(), job);
    let text = job.to_json_vec().unwrap();
    assert_eq!(JobEnvelope::from_json_slice(&text).unwrap(), job);
    assert_eq!(job.to_json_string().unwrap().as_bytes(), text.as_slice());
}

#[test]
fn an_invalid_envelope_is_written_as_text_no_more_than_as_bytes() {
    let mut job = JobEnvelope::new("email.send", vec![json!(1)]);
    job.queue = String::new();
    let as_bytes = job.to_json_vec().unwrap_err().to_string();
    let as_text = job.to_json_string().unwrap_err().to_string();
    assert_eq!(as_text, as_bytes);
    assert!(as_text.contains("queue"), "{as_text}");
}

#[test]
fn deep_nesting_is_rejected_with_a_clear_error() {
    let mut v = json!("leaf");
    for _ in 0..100 {
        v = json!({"k": v});
    }
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    doc["args"] = json!([v]);
    let text = serde_json::to_vec(&doc).unwrap();
    let err = JobEnvelope::from_json_value(doc).unwrap_err();
    assert!(
        matches!(err, Error::NestingTooDeep { limit: 64, .. }),
        "{err}"
    );
    // The same text read from bytes (the one-pass reader, then the general
    // path for its error) gives the same error.
    let err = JobEnvelope::from_json_slice(&text).unwrap_err();
    assert!(
        matches!(err, Error::NestingTooDeep { limit: 64, .. }),
        "{err}"
    );
    // serde_json's own limit (128) also ends in a typed error, not a crash.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let text = MINIMAL.replace(r#"["user@example.com", "welcome"]"#, &deep);
    assert!(matches!(
        JobEnvelope::from_json_slice(text.as_bytes()),
        Err(Error::InvalidJson { .. })
    ));
}

// ---- bad input: one test per kind ------------------------------------------------

fn minimal_proto() -> Vec<u8> {
    JobEnvelope::from_json_slice(MINIMAL.as_bytes())
        .unwrap()
        .to_proto_bytes()
        .unwrap()
}

#[test]
fn bad_input_truncated_bytes() {
    let bytes = minimal_proto();
    // Cuts inside a field (the specversion string, the id, the last arg).
    for cut in [1, 3, 10, bytes.len() - 1] {
        let err = JobEnvelope::from_proto_bytes(&bytes[..cut]).unwrap_err();
        assert!(
            matches!(err, Error::MalformedProtobuf { .. }),
            "cut {cut}: {err}"
        );
    }
    // A cut on a field boundary is well-formed protobuf that lacks attributes
    // (protobuf has no end marker): it is refused, or at least never mistaken
    // for the whole job.
    let whole = JobEnvelope::from_proto_bytes(&bytes).unwrap();
    for cut in 0..bytes.len() {
        if let Ok(partial) = JobEnvelope::from_proto_bytes(&bytes[..cut]) {
            assert_ne!(partial, whole, "cut {cut}");
        }
    }
}

#[test]
fn bad_input_wrong_wire_type() {
    // field 1 (specversion) sent as a varint
    let mut bytes = vec![0x08, 0x01];
    bytes.extend_from_slice(&minimal_proto());
    let err = JobEnvelope::from_proto_bytes(&bytes).unwrap_err();
    assert!(err.to_string().contains("specversion"), "{err}");
    assert!(
        matches!(err, Error::MalformedProtobuf { offset: 1, .. }),
        "{err}"
    );
}

#[test]
fn bad_input_invalid_utf8() {
    let mut bytes = minimal_proto();
    bytes.extend_from_slice(&[0x1a, 0x02, 0xff, 0xfe]); // field 3 (type) = invalid UTF-8
    let err = JobEnvelope::from_proto_bytes(&bytes).unwrap_err();
    assert!(
        matches!(err, Error::MalformedProtobuf { ref reason, .. } if reason.contains("UTF-8")),
        "{err}"
    );
    let err = JobEnvelope::from_json_slice(b"{\"type\": \"\xff\"}").unwrap_err();
    assert!(matches!(err, Error::InvalidJson { .. }), "{err}");
}

#[test]
fn bad_input_malformed_uuid() {
    let text = MINIMAL.replace("019539a4-b68c-7def-8000-1a2b3c4d5e6f", "not-a-uuid");
    let err = JobEnvelope::from_json_slice(text.as_bytes()).unwrap_err();
    assert!(
        matches!(err, Error::InvalidAttribute { ref attribute, .. } if attribute == "id"),
        "{err}"
    );
    let v4 = MINIMAL.replace(
        "019539a4-b68c-7def-8000-1a2b3c4d5e6f",
        "550e8400-e29b-41d4-a716-446655440000",
    );
    assert!(JobEnvelope::from_json_slice(v4.as_bytes())
        .unwrap_err()
        .to_string()
        .contains("UUIDv7"));
}

#[test]
fn bad_input_missing_required_attribute() {
    for attr in ["specversion", "id", "type", "args"] {
        let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
        doc.as_object_mut().unwrap().remove(attr);
        let err = JobEnvelope::from_json_value(doc).unwrap_err();
        assert!(
            matches!(err, Error::MissingAttribute(a) if a == attr),
            "{attr}: {err}"
        );
    }
    let msg = pb::JobEnvelope {
        specversion: "1.0".into(),
        r#type: "a.b".into(),
        ..Default::default()
    };
    assert!(matches!(
        JobEnvelope::from_proto_bytes(&msg.encode_to_vec()),
        Err(Error::MissingAttribute("id"))
    ));
}

#[test]
fn bad_input_args_not_an_array() {
    let mut doc = serde_json::from_str::<serde_json::Value>(MINIMAL).unwrap();
    doc["args"] = json!({"to": "x"});
    let err = JobEnvelope::from_json_value(doc).unwrap_err();
    assert!(
        matches!(err, Error::InvalidAttribute { ref attribute, .. } if attribute == "args"),
        "{err}"
    );
}

#[test]
fn bad_input_unknown_specversion() {
    let text = MINIMAL.replace("\"1.0\"", "\"2.0\"");
    let err = JobEnvelope::from_json_slice(text.as_bytes()).unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedSpecVersion(ref v) if v == "2.0"),
        "{err}"
    );
    let rc = MINIMAL.replace("\"1.0\"", "\"1.0.0-rc.1\"");
    assert_eq!(
        JobEnvelope::from_json_slice(rc.as_bytes())
            .unwrap()
            .specversion,
        "1.0.0-rc.1"
    );
}

#[test]
fn bad_input_unknown_content_type() {
    let err = Encoding::from_content_type("application/xml").unwrap_err();
    assert!(
        matches!(err, Error::UnknownContentType(ref ct) if ct == "application/xml"),
        "{err}"
    );
    let err = Encoding::GrpcqProto.decode_envelopes(b"").unwrap_err();
    assert!(matches!(err, Error::UnknownContentType(_)));
}

#[test]
fn bad_input_unknown_enum_value_is_kept_but_has_no_json_name() {
    let msg = pb::JobEnvelope {
        specversion: "1.0".into(),
        id: "019539a4-b68c-7def-8000-1a2b3c4d5e6f".into(),
        r#type: "a.b".into(),
        queue: "q".into(),
        state: 42,
        ..Default::default()
    };
    let bytes = msg.encode_to_vec();
    let job = JobEnvelope::from_proto_bytes(&bytes).unwrap();
    assert_eq!(job.state, Some(JobState::Other(42)));
    assert_eq!(job.to_proto_bytes().unwrap(), bytes);
    assert!(job.to_json_value().unwrap_err().to_string().contains("42"));
}

// ---- streams and batches ------------------------------------------------------------

#[test]
fn delimited_streams_round_trip_and_match_prost_length_delimited() {
    let jobs: Vec<JobEnvelope> = (0..5)
        .map(|i| JobEnvelope::new("a.b", vec![json!(i)]).with_queue("q"))
        .collect();
    let stream = encode_delimited(&jobs).unwrap();
    let mut expected = Vec::new();
    for job in &jobs {
        let msg = pb::JobEnvelope::decode(job.to_proto_bytes().unwrap().as_slice()).unwrap();
        msg.encode_length_delimited(&mut expected).unwrap();
    }
    assert_eq!(stream, expected, "standard varint-delimited format");
    let back: Vec<JobEnvelope> = decode_delimited(&stream).collect::<Result<_, _>>().unwrap();
    assert_eq!(back, jobs);
    // A truncated stream yields the whole envelopes then one error.
    let cut = &stream[..stream.len() - 3];
    let items: Vec<_> = decode_delimited(cut).collect();
    assert_eq!(items.len(), 5);
    assert!(items[..4].iter().all(Result::is_ok));
    assert!(matches!(items[4], Err(Error::MalformedProtobuf { .. })));
}

#[test]
fn batches_validate_each_job_on_its_own() {
    let good = JobEnvelope::new("a.b", vec![]);
    let bytes = encode_batch(std::slice::from_ref(&good)).unwrap();
    let as_prost = pb::BatchEnqueueRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(as_prost.jobs.len(), 1);
    // Append a second job that is invalid (no id).
    let bad = pb::BatchEnqueueRequest {
        jobs: vec![pb::JobEnvelope {
            specversion: "1.0".into(),
            r#type: "a.b".into(),
            ..Default::default()
        }],
    };
    let mut both = bytes.clone();
    both.extend_from_slice(&bad.encode_to_vec());
    let results = decode_batch(&both).unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].as_ref().unwrap(), &good);
    assert!(matches!(results[1], Err(Error::MissingAttribute("id"))));
}

#[test]
fn retry_policy_defaults_are_what_protobuf_can_carry() {
    let p = RetryPolicy::default();
    assert!(p.jitter);
    assert_eq!(p.max_attempts, None);
}
