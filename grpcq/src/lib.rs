//! grpcq calls over any `ojs_queue::QueueAdapter`: the `grpcq.Message`, read
//! in place ([`Call`]) or through prost, its JSON form (what the CLI reads
//! and prints), decoding that accepts binary and base64 bodies (grpcq's SQS
//! adapter sends base64; legacy publishers sent raw bytes); the runtime
//! (`publisher`, `registry`, `worker`, `retry`, `trace`); decoding a
//! delivery where both codecs are known (`decode`: a call or a job); and
//! the mapping of a call to an OJS job (`mapping`).
//!
//! Built on `ojs-queue` and `ojs-core`, which know no grpcq: Cargo keeps
//! the queue contract below this crate.

mod call;
pub mod decode;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod mapping;
pub mod publisher;
pub mod registry;
pub mod retry;
pub mod trace;
pub mod worker;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
pub use call::Call;
pub use ojs_proto::grpcq::Message;
use prost::Message as _;
use serde_json::{json, Map, Value};

use ojs_core::{Error, Result};
use ojs_queue::{header, OutgoingMessage};

pub use decode::{Decode, Decoded, Incoming};

/// Builds a `grpcq.Message` from its JSON form, with the proto's own field
/// names: `originator`, `topic`, `action`, `payload` (standard base64),
/// `message_id`, `timestamp_ms`, `metadata` (string → string). A missing
/// `message_id` gets a UUID; a missing `timestamp_ms` gets now.
pub fn message_from_json(value: Value) -> Result<Message> {
    let Value::Object(map) = value else {
        return Err(Error::json("a grpcq message must be a JSON object"));
    };
    let mut msg = Message::default();
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let text = |v: Value| match v {
            Value::String(s) => Ok(s),
            other => Err(Error::invalid(
                key.clone(),
                format!("must be a string, got {other}"),
            )),
        };
        match key.as_str() {
            "originator" => msg.originator = text(v)?,
            "topic" => msg.topic = text(v)?,
            "action" => msg.action = text(v)?,
            "payload" => {
                let s = text(v)?;
                msg.payload = STANDARD
                    .decode(s.as_bytes())
                    .map_err(|e| Error::invalid("payload", format!("not standard base64: {e}")))?;
            }
            "message_id" => msg.message_id = text(v)?,
            "timestamp_ms" => {
                // int64 may come as a JSON string (proto3 JSON mapping) or number.
                msg.timestamp_ms = match &v {
                    Value::Number(n) => n.as_i64(),
                    Value::String(s) => s.parse().ok(),
                    _ => None,
                }
                .ok_or_else(|| {
                    Error::invalid("timestamp_ms", format!("must be an integer, got {v}"))
                })?;
            }
            "metadata" => {
                let Value::Object(m) = v else {
                    return Err(Error::invalid("metadata", "must be an object of strings"));
                };
                for (k, v) in m {
                    match v {
                        Value::String(s) => {
                            msg.metadata.insert(k, s);
                        }
                        other => {
                            return Err(Error::invalid(
                                format!("metadata.{k}"),
                                format!("must be a string, got {other}"),
                            ))
                        }
                    }
                }
            }
            other => return Err(Error::invalid(other, "unknown grpcq.Message field")),
        }
    }
    if msg.topic.is_empty() {
        return Err(Error::MissingAttribute("topic"));
    }
    if msg.action.is_empty() {
        return Err(Error::MissingAttribute("action"));
    }
    if msg.message_id.is_empty() {
        msg.message_id = uuid::Uuid::new_v4().to_string();
    }
    if msg.timestamp_ms == 0 {
        msg.timestamp_ms = chrono::Utc::now().timestamp_millis();
    }
    Ok(msg)
}

/// The JSON form of a message (payload as standard base64).
pub fn message_to_json(msg: &Message) -> Value {
    let metadata: Map<String, Value> = msg
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    json!({
        "originator": msg.originator,
        "topic": msg.topic,
        "action": msg.action,
        "payload": STANDARD.encode(&msg.payload),
        "message_id": msg.message_id,
        "timestamp_ms": msg.timestamp_ms,
        "metadata": metadata,
    })
}

/// Encodes a message as binary protobuf.
pub fn encode(msg: &Message) -> Vec<u8> {
    msg.encode_to_vec()
}

/// Decodes a binary `grpcq.Message`.
pub fn decode(bytes: &[u8]) -> Result<Message> {
    let msg =
        Message::decode(bytes).map_err(|e| Error::malformed(0, format!("grpcq.Message: {e}")))?;
    if msg.topic.is_empty() || msg.action.is_empty() {
        return Err(Error::MissingAttribute(if msg.topic.is_empty() {
            "topic"
        } else {
            "action"
        }));
    }
    Ok(msg)
}

/// Decodes a body that is either base64 text of a message (grpcq's SQS
/// convention) or the raw binary message (legacy publishers).
pub fn decode_lenient(body: &[u8]) -> Result<Message> {
    if let Some(raw) = base64_body(body) {
        if let Ok(msg) = decode(&raw) {
            return Ok(msg);
        }
    }
    decode(body)
}

/// The bytes a body holds if it is base64 text (surrounding whitespace
/// allowed): the first reading of [`decode_lenient`] and
/// [`Call::decode_lenient`]. A binary body is recognised without decoding:
/// it has bytes no base64 text has, or a length no padded one has.
fn base64_body(body: &[u8]) -> Option<Vec<u8>> {
    let text = body.trim_ascii();
    let letters = text
        .strip_suffix(b"==")
        .or_else(|| text.strip_suffix(b"="))
        .unwrap_or(text);
    let could_be = text.len() % 4 == 0
        && letters
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/');
    if !could_be {
        return None;
    }
    STANDARD.decode(text).ok()
}

/// A call as a message to publish: binary `grpcq.Message`, content type
/// `application/grpcq+proto`, `topic`/`action`/`originator` headers,
/// key = action (grpcq's Kafka convention), id = message id.
pub fn outgoing(msg: &Message) -> OutgoingMessage {
    outgoing_parts(
        encode(msg),
        &msg.topic,
        &msg.action,
        &msg.originator,
        &msg.message_id,
    )
}

impl Call {
    /// [`outgoing`] for a call read in place: the same bytes and headers.
    pub fn to_outgoing(&self) -> OutgoingMessage {
        outgoing_parts(
            self.encode_to_vec(),
            self.topic(),
            self.action(),
            self.originator(),
            self.message_id(),
        )
    }
}

fn outgoing_parts(
    encoded: Vec<u8>,
    topic: &str,
    action: &str,
    originator: &str,
    message_id: &str,
) -> OutgoingMessage {
    let mut out = OutgoingMessage::new(encoded, ojs_core::envelope::media::GRPCQ_PROTO);
    out.headers.insert(header::GRPCQ_TOPIC, topic);
    out.headers.insert(header::GRPCQ_ACTION, action);
    if !originator.is_empty() {
        out.headers.insert(header::GRPCQ_ORIGINATOR, originator);
    }
    out.key = Some(bytes::Bytes::copy_from_slice(action.as_bytes()));
    out.message_id = Some(message_id.to_owned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_defaults() {
        let msg = message_from_json(json!({
            "originator": "svc", "topic": "payment.PaymentService", "action": "ProcessPayment",
            "payload": STANDARD.encode([1u8, 2, 3]), "metadata": {"trace_id": "t"}
        }))
        .unwrap();
        assert_eq!(msg.payload, vec![1, 2, 3]);
        assert!(!msg.message_id.is_empty());
        assert!(msg.timestamp_ms > 0);
        assert_eq!(message_from_json(message_to_json(&msg)).unwrap(), msg);
    }

    #[test]
    fn bad_json_is_named() {
        assert!(matches!(
            message_from_json(json!({"topic": "t"})),
            Err(Error::MissingAttribute("action"))
        ));
        assert!(
            message_from_json(json!({"topic": "t", "action": "a", "payload": "!!"}))
                .unwrap_err()
                .to_string()
                .contains("payload")
        );
        assert!(
            message_from_json(json!({"topic": "t", "action": "a", "metadata": {"k": 1}})).is_err()
        );
    }

    #[test]
    fn base64_and_raw_bodies_both_decode() {
        let msg = message_from_json(json!({"topic": "t.S", "action": "A"})).unwrap();
        let raw = encode(&msg);
        assert_eq!(decode_lenient(&raw).unwrap(), msg);
        assert_eq!(
            decode_lenient(STANDARD.encode(&raw).as_bytes()).unwrap(),
            msg
        );
        assert!(decode_lenient(b"\xff\xff\xff").is_err());
    }
}
