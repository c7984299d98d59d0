//! The daemon's decoders of outside bytes, as fuzz targets (the wire-format
//! ones are in `ojs_core::fuzz_targets`): the configuration file and its
//! environment overrides, each adapter's headers as its broker hands them
//! over (then the daemon's decode of the delivery), and descriptor-set
//! transcoding. Shared by the cargo-fuzz harness (`fuzz/`) and by a test
//! that replays the committed corpus (`bridge/tests/fuzz_corpus.rs`).
//!
//! Inputs that carry several parts are split by [`Parts`]: a part is a
//! little-endian `u16` length and that many bytes (a length past the end
//! takes what is left), so the fuzzer can grow each part on its own.

use ojs_grpcq::Decode as _;
use std::collections::HashMap;

use async_trait::async_trait;
use bytes::Bytes;
use ojs_core::Encoding;
use ojs_queue::{Acknowledger, Delivery, DeliveryRef, Nack, OutgoingMessage};

use crate::config::BridgeConfig;
use crate::routes::transcode::Transcoder;

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// Every target, by name (the corpus folder and the fuzz binary).
pub const TARGETS: &[(&str, Target)] = &[
    ("config_toml", config_toml),
    ("rabbitmq_properties", rabbitmq_properties),
    ("kafka_headers", kafka_headers),
    ("sqs_attributes", sqs_attributes),
    ("descriptor_transcode", descriptor_transcode),
];

/// Splits an input into length-prefixed parts (see the module docs).
#[derive(Debug)]
pub struct Parts<'a>(&'a [u8]);

impl<'a> Parts<'a> {
    /// Parts of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Parts(data)
    }

    /// The next part; the rest of the input when its length prefix is
    /// missing or longer than what is left.
    pub fn next_part(&mut self) -> &'a [u8] {
        let data = self.0;
        let (part, rest) = match data {
            [a, b, rest @ ..] => {
                let n = usize::from(u16::from_le_bytes([*a, *b]));
                if n <= rest.len() {
                    rest.split_at(n)
                } else {
                    (rest, &[][..])
                }
            }
            _ => (data, &[][..]),
        };
        self.0 = rest;
        part
    }

    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Writes parts in this format (for seeds).
    pub fn join(parts: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts {
            let n = u16::try_from(p.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&p[..usize::from(n)]);
        }
        out
    }
}

/// A delivery's acknowledgement that settles nothing (decode never settles).
#[derive(Debug)]
struct Unsettled;

#[async_trait]
impl Acknowledger for Unsettled {
    async fn ack(&self) -> ojs_queue::Result<()> {
        Ok(())
    }
    async fn nack(&self, _action: Nack, _delivery: DeliveryRef<'_>) -> ojs_queue::Result<()> {
        Ok(())
    }
}

/// What the daemon does with a delivery before routing: decode it by its
/// content type, read a dead-letter reason. Both must take anything.
fn decode_like_the_daemon(
    payload: Bytes,
    headers: ojs_queue::Headers,
    attempt: u32,
    key: Option<Bytes>,
) {
    assert!(attempt >= 1, "attempts are 1-based");
    let mut d = Delivery::new(payload, headers, attempt, "fuzz", Box::new(Unsettled));
    d.key = key;
    for default in [Encoding::OjsProto, Encoding::OjsJson, Encoding::GrpcqProto] {
        let _ = d.decode(Some(default));
    }
    let _ = d.decode_all(None);
    let _ = d.dead_letter_reason();
}

/// A configuration file (part 1, TOML) with environment overrides (part 2,
/// `NAME=value` lines): what `run` and `check-config` read. A file that
/// passes must also compile every adapter and route without a panic.
pub fn config_toml(data: &[u8]) {
    let mut parts = Parts::new(data);
    let Ok(text) = std::str::from_utf8(parts.next_part()) else {
        return;
    };
    let env: Vec<(String, String)> = String::from_utf8_lossy(parts.next_part())
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let Ok(config) = BridgeConfig::parse(text, "fuzz", &env) else {
        return;
    };
    let _ = crate::blueprint::Blueprint::build(config);
}

/// A RabbitMQ content header's property list as it comes off the wire
/// (part 1; the first byte of part 2 is the redelivered flag, the rest the
/// body). What is read must survive a republish (a retry, a dead letter):
/// written back on the wire and read again, headers, key and message id
/// are the same.
pub fn rabbitmq_properties(data: &[u8]) {
    let mut parts = Parts::new(data);
    let wire = parts.next_part();
    let rest = parts.next_part();
    let redelivered = rest.first().is_some_and(|b| b & 1 == 1);
    let body = rest.get(1..).unwrap_or_default();
    let Some(first) = ojs_adapter_rabbitmq::received_from_wire(wire, redelivered) else {
        return;
    };
    let mut out = OutgoingMessage::new(Bytes::new(), "");
    out.headers = first.headers.clone();
    out.key = first.key.clone();
    out.message_id = first.message_id.clone();
    out.priority = first
        .rank
        .map_or(0, |r| ojs_adapter_rabbitmq::priority_of_rank(r, u8::MAX));
    // A message read off AMQP always fits AMQP again (each short string was
    // at most 255 bytes, and names keep their length through the mapping).
    // As a retry or dead-letter copy is made: with the entries the neutral
    // headers do not hold as they came.
    let props = ojs_adapter_rabbitmq::properties_keeping(&out, Some(u8::MAX), first.typed.as_ref())
        .unwrap_or_else(|e| panic!("what was read cannot be published again: {e}"));
    let again = ojs_adapter_rabbitmq::to_wire(&props)
        .ok()
        .and_then(|w| ojs_adapter_rabbitmq::received_from_wire(&w, false))
        .unwrap_or_else(|| panic!("what was read cannot be published again: {first:?}"));
    assert_eq!(first.headers, again.headers, "headers changed on republish");
    assert_eq!(first.key, again.key, "key changed on republish");
    assert_eq!(
        first.message_id, again.message_id,
        "message id changed on republish"
    );
    decode_like_the_daemon(
        Bytes::copy_from_slice(body),
        first.headers,
        first.attempt,
        first.key,
    );
}

/// Kafka record headers as librdkafka hands them over: pairs of parts
/// (name, then value; a value part starting with 0xFF is a null value)
/// after the key (part 1, empty = no key) and the body (part 2).
pub fn kafka_headers(data: &[u8]) {
    let mut parts = Parts::new(data);
    let key = parts.next_part();
    let body = parts.next_part();
    let mut pairs: Vec<(&[u8], Option<&[u8]>)> = Vec::new();
    while !parts.is_empty() && pairs.len() < 64 {
        // Any bytes, as on the wire: librdkafka ends a name at its first NUL.
        let name = parts.next_part();
        let name = name.split(|b| *b == 0).next().unwrap_or_default();
        let value = parts.next_part();
        let value = match value.first() {
            Some(0xFF) => None,
            _ => Some(value),
        };
        pairs.push((name, value));
    }
    let record = ojs_adapter_kafka::received_record(
        pairs.iter().copied(),
        (!key.is_empty()).then_some(key),
        body,
    );
    assert_eq!(
        &record.payload[..],
        body,
        "the payload is read back as it came"
    );
    decode_like_the_daemon(record.payload, record.headers, record.attempt, record.key);
}

/// An SQS message: body (part 1, as text), ApproximateReceiveCount (part
/// 2), then attributes as (name, kind, value) parts, kind 0 = String,
/// 1 = Number, anything else Binary.
pub fn sqs_attributes(data: &[u8]) {
    let mut parts = Parts::new(data);
    let body = String::from_utf8_lossy(parts.next_part()).into_owned();
    let count = String::from_utf8_lossy(parts.next_part()).into_owned();
    let mut attributes = HashMap::new();
    while !parts.is_empty() && attributes.len() < 64 {
        let name = String::from_utf8_lossy(parts.next_part()).into_owned();
        let kind = parts.next_part().first().copied().unwrap_or(0);
        let value = parts.next_part();
        let builder = ojs_adapter_sqs::AttributeValue::builder();
        let builder = match kind {
            0 => builder
                .data_type("String")
                .string_value(String::from_utf8_lossy(value)),
            1 => builder
                .data_type("Number")
                .string_value(String::from_utf8_lossy(value)),
            _ => builder
                .data_type("Binary")
                .binary_value(ojs_adapter_sqs::Blob::new(value)),
        };
        if let Ok(v) = builder.build() {
            attributes.insert(name, v);
        }
    }
    let m = ojs_adapter_sqs::received_message(&body, Some(&attributes), Some(&count));
    decode_like_the_daemon(m.payload, m.headers, m.attempt, m.key);
}

/// A FileDescriptorSet (part 1) and a request payload (part 2), tried as
/// each of the set's first 16 message types: what the transcoder turns
/// into JSON must give back the same bytes.
pub fn descriptor_transcode(data: &[u8]) {
    let mut parts = Parts::new(data);
    let set = parts.next_part();
    let payload = parts.next_part();
    let Ok(any) = Transcoder::from_bytes(set, None) else {
        return;
    };
    for name in any.message_types().take(16).collect::<Vec<_>>() {
        // prost-reflect lists types whose names are not identifiers (".x",
        // "a..b") but cannot look them up: such a type cannot be named in
        // a config either, so there is nothing to transcode.
        let Some(t) = any.for_type(&name) else {
            continue;
        };
        let Ok(Some(json)) = t.to_json("", "", payload) else {
            continue;
        };
        let back = t
            .from_json(&json.json, Some(&json.message_type), "", "")
            .unwrap_or_else(|e| panic!("JSON made by the transcoder is refused: {e}"));
        assert_eq!(back, payload, "{name}: JSON did not give back the bytes");
    }
}
