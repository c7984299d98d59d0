//! The grpcq decoders that take bytes from outside, as fuzz targets (the
//! envelope's are `ojs_core::fuzz_targets`): shared by the cargo-fuzz
//! harness (`fuzz/`) and the corpus replay (`tests/fuzz_corpus.rs`). Each
//! must never panic, and a decoded message must survive its own encoder.

/// Every target, by name (the corpus folder and the fuzz binary).
pub const TARGETS: &[(&str, ojs_core::fuzz_targets::Target)] =
    &[("grpcq_message", grpcq_message), ("grpcq_json", grpcq_json)];

/// `grpcq.Message` bytes, strict and as the daemon reads them.
pub fn grpcq_message(data: &[u8]) {
    // The call read in place must decode exactly what prost decodes.
    let bytes = bytes::Bytes::copy_from_slice(data);
    let lenient = crate::decode_lenient(data);
    let in_place = crate::Call::decode_lenient(&bytes).map(|c| c.to_message());
    assert_eq!(lenient.ok(), in_place.ok(), "lenient decoders disagree");
    let in_place = crate::Call::decode(bytes);
    let Ok(msg) = crate::decode(data) else {
        assert!(in_place.is_err(), "a call prost refuses was read in place");
        return;
    };
    let call = in_place.unwrap_or_else(|e| panic!("a call prost reads was refused in place: {e}"));
    assert_eq!(call.to_message(), msg, "the call read in place differs");
    let first = crate::encode(&msg);
    assert_eq!(
        call.encode_to_vec(),
        first,
        "the call read in place encodes differently"
    );
    let again = crate::decode(&first)
        .unwrap_or_else(|e| panic!("an encoded grpcq message does not decode: {e}"));
    assert_eq!(msg, again, "grpcq message changed through its encoder");
}

/// The JSON form of a grpcq message (`ojs-bridge send --format grpcq`).
pub fn grpcq_json(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(msg) = crate::message_from_json(value) else {
        return;
    };
    let again = crate::message_from_json(crate::message_to_json(&msg))
        .unwrap_or_else(|e| panic!("grpcq JSON does not read back: {e}"));
    assert_eq!(msg, again, "grpcq message changed through its JSON form");
}
