//! The decoders that take bytes from outside, as fuzz targets: one function
//! per target, shared by the cargo-fuzz harness (`fuzz/`) and by a normal
//! test that replays the committed corpus (`core/tests/fuzz_corpus.rs`).
//!
//! Each target must never panic, and where a decode succeeds the value must
//! survive its own encoder: encoding is canonical (decode → encode → decode
//! → encode gives the same bytes twice), which is what "lossless" means for
//! bytes the bridge forwards.

use crate::media::Encoding;
use crate::{grpcq, stream, JobEnvelope};

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// Every target, by name (the corpus folder and the fuzz binary).
pub const TARGETS: &[(&str, Target)] = &[
    ("envelope_proto", envelope_proto),
    ("envelope_json", envelope_json),
    ("delimited_stream", delimited_stream),
    ("grpcq_message", grpcq_message),
    ("grpcq_json", grpcq_json),
    ("content_type", content_type),
];

/// `application/openjobspec+proto`: one `JobEnvelope`.
pub fn envelope_proto(data: &[u8]) {
    let Ok(job) = JobEnvelope::from_proto_bytes(data) else {
        return;
    };
    let Ok(first) = job.to_proto_bytes() else {
        return;
    };
    let again = JobEnvelope::from_proto_bytes(&first)
        .unwrap_or_else(|e| panic!("an encoded envelope does not decode: {e}"));
    let second = again
        .to_proto_bytes()
        .unwrap_or_else(|e| panic!("a decoded envelope does not encode: {e}"));
    assert_eq!(first, second, "proto encoding is not canonical");
}

/// `application/openjobspec+json`: one envelope or a batch.
pub fn envelope_json(data: &[u8]) {
    let _ = Encoding::OjsJson.decode_envelopes(data);
    let Ok(job) = JobEnvelope::from_json_slice(data) else {
        return;
    };
    let Ok(first) = job.to_json_vec() else {
        return;
    };
    let again = JobEnvelope::from_json_slice(&first)
        .unwrap_or_else(|e| panic!("encoded JSON does not decode: {e}"));
    let second = again
        .to_json_vec()
        .unwrap_or_else(|e| panic!("a decoded envelope does not encode: {e}"));
    assert_eq!(first, second, "JSON encoding is not canonical");
}

/// Length-delimited envelope streams and `BatchEnqueueRequest`s.
pub fn delimited_stream(data: &[u8]) {
    for job in stream::decode_delimited(data).flatten() {
        let _ = job.to_proto_bytes();
    }
    let _ = stream::decode_batch(data);
    let _ = Encoding::OjsProtoDelimited.decode_envelopes(data);
}

/// `grpcq.Message` bytes, strict and as the daemon reads them.
pub fn grpcq_message(data: &[u8]) {
    // The call read in place must decode exactly what prost decodes.
    let bytes = bytes::Bytes::copy_from_slice(data);
    let lenient = grpcq::decode_lenient(data);
    let in_place = grpcq::Call::decode_lenient(&bytes).map(|c| c.to_message());
    assert_eq!(lenient.ok(), in_place.ok(), "lenient decoders disagree");
    let in_place = grpcq::Call::decode(bytes);
    let Ok(msg) = grpcq::decode(data) else {
        assert!(in_place.is_err(), "a call prost refuses was read in place");
        return;
    };
    let call = in_place.unwrap_or_else(|e| panic!("a call prost reads was refused in place: {e}"));
    assert_eq!(call.to_message(), msg, "the call read in place differs");
    let first = grpcq::encode(&msg);
    assert_eq!(
        call.encode_to_vec(),
        first,
        "the call read in place encodes differently"
    );
    let again = grpcq::decode(&first)
        .unwrap_or_else(|e| panic!("an encoded grpcq message does not decode: {e}"));
    assert_eq!(msg, again, "grpcq message changed through its encoder");
}

/// The JSON form of a grpcq message (`ojs-bridge send --format grpcq`).
pub fn grpcq_json(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(msg) = grpcq::message_from_json(value) else {
        return;
    };
    let again = grpcq::message_from_json(grpcq::message_to_json(&msg))
        .unwrap_or_else(|e| panic!("grpcq JSON does not read back: {e}"));
    assert_eq!(msg, again, "grpcq message changed through its JSON form");
}

/// `content-type` and `accept` header values.
pub fn content_type(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(encoding) = Encoding::from_content_type(text) {
        assert_eq!(
            Encoding::from_content_type(encoding.media_type()).ok(),
            Some(encoding),
            "a media type does not name its own encoding"
        );
    }
    let _ = Encoding::negotiate(text);
}
