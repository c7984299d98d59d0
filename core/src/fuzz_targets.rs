//! The decoders that take bytes from outside, as fuzz targets: one function
//! per target, shared by the cargo-fuzz harness (`fuzz/`) and by a normal
//! test that replays the committed corpus (`grpcq/tests/fuzz_corpus.rs`,
//! with the grpcq targets of `ojs_grpcq::fuzz_targets`).
//!
//! Each target must never panic, and where a decode succeeds the value must
//! survive its own encoder: encoding is canonical (decode → encode → decode
//! → encode gives the same bytes twice), which is what "lossless" means for
//! bytes the bridge forwards.

use crate::envelope::media::Encoding;
use crate::envelope::stream;
use crate::JobEnvelope;

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// Every target, by name (the corpus folder and the fuzz binary).
pub const TARGETS: &[(&str, Target)] = &[
    ("envelope_proto", envelope_proto),
    ("envelope_json", envelope_json),
    ("delimited_stream", delimited_stream),
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
