//! grpcq call ↔ OJS job (docs/design.md §5).
//!
//! A call becomes a job whose id is derived from the call (so a call
//! delivered twice becomes the same job, the idempotency key downstream),
//! whose meta carries every metadata entry plus the call's provenance, and
//! whose single argument is the payload: base64url text by default, or the
//! request's proto3 JSON form when the caller transcoded it. The reverse
//! mapping reads the same meta back, so call → job → call returns the
//! original message.

use std::fmt::Write as _;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use chrono::{DateTime, TimeZone, Utc};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use bytes::Bytes;

use crate::{Call, Message};
use ojs_core::envelope::{proto, value, wire, JobEnvelope, SPEC_VERSION};
use ojs_core::{Error, Result};
use ojs_queue::{header, HeaderValue, OutgoingMessage};

/// Meta key: the call's originator.
pub const META_ORIGINATOR: &str = "grpcq.originator";
/// Meta key: the call's message id.
pub const META_MESSAGE_ID: &str = "grpcq.message_id";
/// Meta key: the call's topic (fully qualified service name).
pub const META_TOPIC: &str = "grpcq.topic";
/// Meta key: the call's action (method name).
pub const META_ACTION: &str = "grpcq.action";
/// Meta key: how `args[0]` holds the payload ([`PAYLOAD_BASE64URL`] or
/// [`PAYLOAD_PROTO3_JSON`]).
pub const META_PAYLOAD_ENCODING: &str = "grpcq.payload_encoding";
/// Meta key: the protobuf message type of a transcoded payload.
pub const META_PAYLOAD_TYPE: &str = "grpcq.payload_type";

/// `args[0]` is the payload bytes as base64url without padding.
pub const PAYLOAD_BASE64URL: &str = "base64url";
/// `args[0]` is the request in its proto3 JSON form.
pub const PAYLOAD_PROTO3_JSON: &str = "proto3-json";

/// The meta keys the mapping writes itself; everything else in meta is
/// call metadata.
const RESERVED_META: [&str; 6] = [
    META_ORIGINATOR,
    META_MESSAGE_ID,
    META_TOPIC,
    META_ACTION,
    META_PAYLOAD_ENCODING,
    META_PAYLOAD_TYPE,
];

/// Largest Unix millisecond a UUIDv7 timestamp holds (48 bits).
const MAX_UUID_MILLIS: i64 = (1 << 48) - 1;

/// The job id of a call: a UUIDv7 whose timestamp is `timestamp_ms` and
/// whose 74 "random" bits come from SHA-256 of `message_id`. The same call
/// always gets the same id; different message ids collide with probability
/// 2^-74 within one millisecond.
pub fn call_job_id(message_id: &str, timestamp_ms: i64) -> String {
    let digest = Sha256::digest(message_id.as_bytes());
    let mut tail = [0u8; 10];
    tail.copy_from_slice(&digest[..10]);
    // Out-of-range timestamps (negative, beyond 10889 AD) are clamped: the
    // id stays a valid, deterministic UUIDv7.
    let millis = timestamp_ms.clamp(0, MAX_UUID_MILLIS) as u64;
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    // Written into a stack buffer: `to_string` goes through the formatter.
    uuid::Builder::from_unix_timestamp_millis(millis, &tail)
        .into_uuid()
        .hyphenated()
        .encode_lower(&mut text)
        .to_owned()
}

/// The job id of a call: [`call_job_id`] of its `message_id`, or — for a
/// call without one — of a digest of the whole encoded call (`content:` +
/// SHA-256 hex). A call redelivered byte for byte keeps its id; two
/// different calls without ids never share one, even in the same
/// millisecond (hashing the empty id would have collapsed them, and
/// downstream dedup would drop all but one).
pub fn call_job_id_of(msg: &Message) -> String {
    if !msg.message_id.is_empty() {
        return call_job_id(&msg.message_id, msg.timestamp_ms);
    }
    content_job_id(&crate::encode(msg), msg.timestamp_ms)
}

/// [`call_job_id_of`] for a call read in place: the same id (a call
/// without a message id is hashed in its canonical encoding, which
/// [`Call::encode_to_vec`] writes as prost does).
pub fn call_job_id_of_call(call: &Call) -> String {
    if !call.message_id().is_empty() {
        return call_job_id(call.message_id(), call.timestamp_ms());
    }
    content_job_id(&call.encode_to_vec(), call.timestamp_ms())
}

fn content_job_id(encoded: &[u8], timestamp_ms: i64) -> String {
    let digest = Sha256::digest(encoded);
    let mut key = String::with_capacity(8 + 64);
    key.push_str("content:");
    for b in digest {
        // Writing to a String cannot fail.
        let _ = write!(key, "{b:02x}");
    }
    call_job_id(&key, timestamp_ms)
}

/// A payload the caller transcoded into proto3 JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscodedPayload {
    /// The request as proto3 JSON.
    pub json: Value,
    /// Its fully qualified protobuf message type.
    pub message_type: String,
}

/// Builds the OJS job for a call (docs/design.md §5). `payload` is the transcoded
/// request, or `None` to carry the bytes as base64url.
pub fn call_to_job(
    msg: &Message,
    job_type: String,
    queue: String,
    payload: Option<TranscodedPayload>,
) -> JobEnvelope {
    let mut meta: Map<String, Value> = msg
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    let text = |s: &str| Value::String(s.to_owned());
    meta.insert(META_ORIGINATOR.into(), text(&msg.originator));
    meta.insert(META_MESSAGE_ID.into(), text(&msg.message_id));
    meta.insert(META_TOPIC.into(), text(&msg.topic));
    meta.insert(META_ACTION.into(), text(&msg.action));
    let arg = match payload {
        None => {
            meta.insert(META_PAYLOAD_ENCODING.into(), text(PAYLOAD_BASE64URL));
            Value::String(URL_SAFE_NO_PAD.encode(&msg.payload))
        }
        Some(t) => {
            meta.insert(META_PAYLOAD_ENCODING.into(), text(PAYLOAD_PROTO3_JSON));
            meta.insert(META_PAYLOAD_TYPE.into(), Value::String(t.message_type));
            t.json
        }
    };
    let mut job = JobEnvelope::with_id(call_job_id_of(msg), job_type, vec![arg]);
    job.queue = queue;
    job.created_at = millis_to_time(msg.timestamp_ms);
    job.expires_at = msg
        .metadata
        .get("deadline_ms")
        .and_then(|v| v.trim().parse::<i64>().ok())
        .and_then(millis_to_time);
    job.priority = msg
        .metadata
        .get("priority")
        .and_then(|v| v.trim().parse::<i32>().ok())
        .unwrap_or(0);
    job.meta = meta;
    job
}

/// The job of a call carried as base64url, encoded straight into an OJS
/// protobuf message with its binding headers: byte for byte what
/// [`call_to_job`] (payload `None`) and then
/// [`OutgoingMessage::from_envelope`] with [`Encoding::OjsProto`] give, but
/// without the envelope in between (no meta map of `serde_json` values, no
/// base64 `String`, no per-field copies): the bridge's hot path. `job_type`
/// and `queue` must already be valid OJS names (the caller checks them, for
/// instance with [`JobTypes`]; everything else a call can hold makes a valid
/// job). They are shared values: a route's queue and a batch's job type are
/// named once and referenced by every job's headers, not copied into each.
pub fn call_to_job_message(
    msg: &Call,
    job_type: &HeaderValue,
    queue: &HeaderValue,
) -> OutgoingMessage {
    let id = call_job_id_of_call(msg);
    // Each of the call's strings read once (a `Call` checks a field's
    // bytes each time it hands it out).
    let own = [
        (META_ACTION, msg.action()),
        (META_MESSAGE_ID, msg.message_id()),
        (META_ORIGINATOR, msg.originator()),
        (META_PAYLOAD_ENCODING, PAYLOAD_BASE64URL),
        (META_TOPIC, msg.topic()),
    ];
    // meta: the call's metadata, then the mapping's own keys over it, in
    // key order (a `serde_json::Map` is sorted, so the envelope path
    // writes them sorted too). Both lists are sorted already: merged once,
    // into the stack when there are few.
    let mut small = [("", ""); 16];
    let mut large = Vec::new();
    let meta: &[(&str, &str)] = if msg.metadata_len() + own.len() <= small.len() {
        let mut n = 0;
        for entry in merge_meta(msg.metadata(), &own) {
            small[n] = entry;
            n += 1;
        }
        &small[..n]
    } else {
        large.extend(merge_meta(msg.metadata(), &own));
        &large
    };
    // The metadata the job's attributes and headers come from, found in
    // one pass rather than a map lookup each. None of these is one of the
    // mapping's own keys.
    let (mut deadline, mut priority, mut traceparent, mut tracestate, mut partition_key) =
        (None, None, None, None, None);
    for &(k, v) in meta {
        match k {
            "deadline_ms" => deadline = Some(v),
            "priority" => priority = Some(v),
            header::TRACEPARENT => traceparent = Some(v),
            header::TRACESTATE => tracestate = Some(v),
            "partition_key" => partition_key = Some(v),
            _ => {}
        }
    }
    let created_at = millis_to_timestamp(msg.timestamp_ms());
    let expires_at = deadline
        .and_then(|v| v.trim().parse::<i64>().ok())
        .and_then(millis_to_timestamp);
    let priority = priority
        .and_then(|v| v.trim().parse::<i32>().ok())
        .unwrap_or(0);
    let payload = msg.payload();
    // Sized by the encoder that writes it.
    let arg_len = base64_simd::URL_SAFE_NO_PAD.encoded_length(payload.len());
    let arg_body = wire::len_field_len(3, arg_len);

    let size = wire::string_len(1, SPEC_VERSION)
        + wire::string_len(2, &id)
        + wire::bytes_len(3, job_type.as_bytes())
        + wire::bytes_len(4, queue.as_bytes())
        + wire::len_field_len(5, arg_body)
        + meta
            .iter()
            .map(|(k, v)| value::string_map_entry_len(6, k, v))
            .sum::<usize>()
        + wire::int32_len(7, priority)
        + proto::timestamp_parts_len(10, expires_at)
        + proto::timestamp_parts_len(16, created_at);
    let mut out = Vec::with_capacity(size);
    wire::put_string(&mut out, 1, SPEC_VERSION);
    wire::put_string(&mut out, 2, &id);
    wire::put_bytes(&mut out, 3, job_type.as_bytes());
    wire::put_bytes(&mut out, 4, queue.as_bytes());
    wire::put_len_header(&mut out, 5, arg_body);
    wire::put_len_header(&mut out, 3, arg_len);
    let start = out.len();
    out.resize(start + arg_len, 0);
    // SIMD base64 (the `base64` crate's encoder was a tenth of the call's
    // cost); the same alphabet and length, so the same bytes.
    let written = base64_simd::URL_SAFE_NO_PAD
        .encode(payload, base64_simd::Out::from_slice(&mut out[start..]))
        .len();
    debug_assert_eq!(written, arg_len);
    for (k, v) in meta {
        value::put_string_map_entry(&mut out, 6, k, v);
    }
    wire::put_int32(&mut out, 7, priority);
    proto::put_timestamp_parts(&mut out, 10, expires_at);
    proto::put_timestamp_parts(&mut out, 16, created_at);
    debug_assert_eq!(out.len(), size);

    // The id is the `ojs-id` header and, without a partition key, the key:
    // one copy shared by both.
    let id_bytes = Bytes::copy_from_slice(id.as_bytes());
    let mut message = OutgoingMessage::new(out, ojs_core::envelope::media::OJS_PROTO);
    // In name order (content-type is there already): each insert is a push.
    let h = &mut message.headers;
    h.insert(header::ID, id_bytes.clone());
    h.insert(header::QUEUE, queue.clone());
    h.insert(header::SPECVERSION, HeaderValue::from_static(SPEC_VERSION));
    h.insert(header::TYPE, job_type.clone());
    if let Some(v) = traceparent {
        h.insert(header::TRACEPARENT, v);
    }
    if let Some(v) = tracestate {
        h.insert(header::TRACESTATE, v);
    }
    message.key = Some(match partition_key {
        Some(key) => Bytes::copy_from_slice(key.as_bytes()),
        None => id_bytes,
    });
    message.priority = priority;
    message.message_id = Some(id);
    message
}

/// Two key-sorted lists of meta entries read as one, `own` winning a key
/// both have.
fn merge_meta<'a>(
    metadata: impl Iterator<Item = (&'a str, &'a str)>,
    own: &'a [(&'static str, &'a str)],
) -> impl Iterator<Item = (&'a str, &'a str)> {
    let mut metadata = metadata.peekable();
    let mut own = own.iter().peekable();
    std::iter::from_fn(move || {
        let take_own = match (metadata.peek(), own.peek()) {
            (None, None) => return None,
            (Some(_), None) => false,
            (None, Some(_)) => true,
            (Some((m, _)), Some((o, _))) => match (*m).cmp(*o) {
                std::cmp::Ordering::Less => false,
                std::cmp::Ordering::Greater => true,
                std::cmp::Ordering::Equal => {
                    // The call's entry is overwritten by the mapping's.
                    metadata.next();
                    true
                }
            },
        };
        if take_own {
            own.next().map(|(k, v)| (*k, *v))
        } else {
            metadata.next()
        }
    })
}

/// Names and checks the job types of calls ([`type_from_topic_action`],
/// then [`validate_job_type`]), remembering the last one: the calls of a
/// batch mostly name one method, and naming it again would cost a walk
/// over topic and action, a check and an allocation per call, where the
/// remembered name costs a comparison and a reference count. Keep one per
/// batch (or per thread): it is not shared.
///
/// [`type_from_topic_action`]: ojs_core::envelope::type_from_topic_action
/// [`validate_job_type`]: ojs_core::envelope::validate_job_type
#[derive(Debug, Default)]
pub struct JobTypes {
    /// Topic, action and their checked job type.
    last: Option<(String, String, HeaderValue)>,
}

impl JobTypes {
    /// Nothing remembered yet.
    pub fn new() -> Self {
        JobTypes::default()
    }

    /// The job type of `topic`/`action`, checked against the OJS schema;
    /// the schema's error when the name it makes is not a valid job type
    /// (not remembered: each such call gets its error).
    pub fn of(&mut self, topic: &str, action: &str) -> Result<HeaderValue> {
        if let Some((t, a, job_type)) = &self.last {
            if t == topic && a == action {
                return Ok(job_type.clone());
            }
        }
        let name = ojs_core::envelope::type_from_topic_action(topic, action);
        ojs_core::envelope::validate_job_type(&name)?;
        let job_type = HeaderValue::from(name);
        match &mut self.last {
            // The strings' buffers reused.
            Some((t, a, last)) => {
                t.clear();
                t.push_str(topic);
                a.clear();
                a.push_str(action);
                *last = job_type.clone();
            }
            None => self.last = Some((topic.to_owned(), action.to_owned(), job_type.clone())),
        }
        Ok(job_type)
    }
}

fn millis_to_time(ms: i64) -> Option<DateTime<Utc>> {
    if ms <= 0 {
        return None;
    }
    Utc.timestamp_millis_opt(ms).single()
}

/// The latest Unix millisecond chrono represents (the end of year 262142):
/// [`millis_to_time`] gives `None` past it.
const MAX_TIME_MILLIS: i64 = 8_210_266_876_799_999;

/// [`millis_to_time`] as a protobuf Timestamp's seconds and nanoseconds,
/// without the calendar (chrono works out the date both ways, which showed
/// in the per-call profile); the same times, the same bytes.
fn millis_to_timestamp(ms: i64) -> Option<proto::TimestampParts> {
    if ms <= 0 || ms > MAX_TIME_MILLIS {
        return None;
    }
    // Positive: the remainder is the sub-second part.
    Some((ms / 1000, (ms % 1000) as i32 * 1_000_000))
}

/// Where a job's payload is, for the reverse mapping.
#[derive(Debug, Clone, PartialEq)]
pub enum JobPayload<'a> {
    /// The payload bytes (decoded from base64url).
    Bytes(Vec<u8>),
    /// A proto3 JSON request to encode with a descriptor; `message_type`
    /// when the job names it.
    Proto3Json {
        /// The request.
        json: &'a Value,
        /// Its message type, when the job says.
        message_type: Option<&'a str>,
    },
    /// A job that did not come from a call: its args as they are.
    Native(&'a [Value]),
}

/// Reads a job's payload the way [`call_to_job`] wrote it.
pub fn job_payload(job: &JobEnvelope) -> Result<JobPayload<'_>> {
    match job.meta_str(META_PAYLOAD_ENCODING) {
        Some(PAYLOAD_BASE64URL) => {
            let Some(Value::String(text)) = job.args.first() else {
                return Err(Error::invalid(
                    "args[0]",
                    "grpcq.payload_encoding is base64url but args[0] is not a string",
                ));
            };
            URL_SAFE_NO_PAD
                .decode(text.as_bytes())
                .map(JobPayload::Bytes)
                .map_err(|e| Error::invalid("args[0]", format!("not base64url: {e}")))
        }
        Some(PAYLOAD_PROTO3_JSON) => match job.args.first() {
            Some(json) => Ok(JobPayload::Proto3Json {
                json,
                message_type: job.meta_str(META_PAYLOAD_TYPE),
            }),
            None => Err(Error::invalid(
                "args",
                "grpcq.payload_encoding is proto3-json but args is empty",
            )),
        },
        Some(other) => Err(Error::invalid(
            META_PAYLOAD_ENCODING,
            format!("unknown payload encoding {other:?} (known: base64url, proto3-json)"),
        )),
        None => Ok(JobPayload::Native(&job.args)),
    }
}

/// The call's topic and action: from meta when the job came from a call,
/// otherwise the job type split at its last dot
/// (`payment.PaymentService.ProcessPayment` → `payment.PaymentService`,
/// `ProcessPayment`).
pub fn job_topic_action(job: &JobEnvelope) -> Result<(String, String)> {
    if let (Some(t), Some(a)) = (job.meta_str(META_TOPIC), job.meta_str(META_ACTION)) {
        return Ok((t.to_owned(), a.to_owned()));
    }
    match job.job_type.rsplit_once('.') {
        Some((topic, action)) if !topic.is_empty() && !action.is_empty() => {
            Ok((topic.to_owned(), action.to_owned()))
        }
        _ => Err(Error::invalid(
            "type",
            format!(
                "{:?} has no dot to split into grpcq topic and action; give the route a topic and action",
                job.job_type
            ),
        )),
    }
}

/// Builds the call for a job: the inverse of [`call_to_job`] given the
/// payload bytes (see [`job_payload`]). Meta that is not provenance becomes
/// metadata (non-string values as JSON text); a job without provenance gets
/// its id as message id and its creation time as timestamp.
pub fn job_to_call(job: &JobEnvelope, topic: String, action: String, payload: Vec<u8>) -> Message {
    let metadata = job
        .meta
        .iter()
        .filter(|(k, _)| !RESERVED_META.contains(&k.as_str()))
        .map(|(k, v)| {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), text)
        })
        .collect();
    let timestamp_ms = job
        .created_at
        .or(job.enqueued_at)
        .map_or(0, |t| t.timestamp_millis());
    Message {
        originator: job.meta_str(META_ORIGINATOR).unwrap_or_default().to_owned(),
        topic,
        action,
        payload,
        message_id: job
            .meta_str(META_MESSAGE_ID)
            .map_or_else(|| job.id.clone(), str::to_owned),
        timestamp_ms,
        metadata,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> Message {
        let mut msg = Message {
            originator: "order-service-pod-1".into(),
            topic: "payment.PaymentService".into(),
            action: "ProcessPayment".into(),
            payload: vec![0, 1, 2, 250, 251, 252, 255],
            message_id: "3f0e9a4e-5c1b-4f7e-9a43-0b1f2c3d4e5f".into(),
            timestamp_ms: 1_763_700_000_123,
            metadata: Default::default(),
        };
        msg.metadata.insert(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        msg.metadata.insert("priority".into(), "7".into());
        msg.metadata
            .insert("deadline_ms".into(), "1763700060000".into());
        msg
    }

    fn via_envelope(msg: &Message, job_type: &str, queue: &str) -> OutgoingMessage {
        let job = call_to_job(msg, job_type.into(), queue.into(), None);
        OutgoingMessage::from_envelope(&job, ojs_core::Encoding::OjsProto).unwrap()
    }

    #[test]
    fn the_direct_encoder_writes_what_the_envelope_path_writes() {
        let mut calls = vec![call()];
        let mut plain = call();
        plain.metadata.clear();
        plain.payload.clear();
        plain.originator.clear();
        plain.timestamp_ms = 0;
        calls.push(plain);
        let mut odd = call();
        // Metadata that collides with the mapping's own keys loses to them;
        // keys sorting before and after them; a partition key; odd values.
        odd.metadata.insert(META_TOPIC.into(), "spoofed".into());
        odd.metadata.insert("a".into(), String::new());
        odd.metadata.insert("zz".into(), "é".repeat(200));
        odd.metadata
            .insert("partition_key".into(), "tenant-7".into());
        odd.metadata.insert("tracestate".into(), "k=v".into());
        odd.metadata.insert("priority".into(), "-3".into());
        odd.metadata
            .insert("deadline_ms".into(), "not a number".into());
        odd.payload = vec![7; 300];
        odd.message_id = String::new();
        calls.push(odd);
        for msg in &calls {
            let direct = call_to_job_message(
                &Call::from_message(msg),
                &"payment.process_payment".into(),
                &"payments".into(),
            );
            let slow = via_envelope(msg, "payment.process_payment", "payments");
            assert_eq!(direct, slow);
            assert!(JobEnvelope::from_proto_bytes(&direct.payload).is_ok());
        }
    }

    proptest::proptest! {
        #[test]
        fn the_direct_encoder_matches_for_any_call(
            originator in ".{0,20}",
            message_id in "[a-z0-9-]{0,40}",
            payload in proptest::collection::vec(proptest::num::u8::ANY, 0..400),
            timestamp_ms in proptest::num::i64::ANY,
            metadata in proptest::collection::btree_map("[a-z_.]{0,16}", ".{0,30}", 0..8),
        ) {
            let msg = Message {
                originator,
                topic: "t.S".into(),
                action: "Do".into(),
                payload,
                message_id,
                timestamp_ms,
                metadata,
            };
            proptest::prop_assert_eq!(
                call_to_job_message(&Call::from_message(&msg), &"t.do".into(), &"q".into()),
                via_envelope(&msg, "t.do", "q")
            );
        }
    }

    #[test]
    fn times_without_the_calendar_are_the_calendar_s_times() {
        assert_eq!(MAX_TIME_MILLIS, DateTime::<Utc>::MAX_UTC.timestamp_millis());
        for ms in [
            i64::MIN,
            -1,
            0,
            1,
            999,
            1_000,
            1_001,
            1_763_700_000_123,
            MAX_UUID_MILLIS,
            MAX_TIME_MILLIS - 1,
            MAX_TIME_MILLIS,
            MAX_TIME_MILLIS + 1,
            i64::MAX,
        ] {
            let via_chrono =
                millis_to_time(ms).map(|t| (t.timestamp(), t.timestamp_subsec_nanos() as i32));
            assert_eq!(millis_to_timestamp(ms), via_chrono, "{ms}");
        }
    }

    #[test]
    fn calls_without_a_message_id_get_distinct_stable_ids() {
        let mut a = call();
        a.message_id = String::new();
        let mut b = a.clone();
        b.payload = vec![9, 9];
        let id = |m: &Message| call_to_job(m, "a.b".into(), "q".into(), None).id;
        assert_ne!(id(&a), id(&b), "two calls in one millisecond");
        assert_eq!(id(&a), id(&a.clone()), "a redelivered call keeps its id");
        assert_eq!(id(&a), call_job_id_of(&a));
        // With a message id nothing changes.
        let c = call();
        assert_eq!(id(&c), call_job_id(&c.message_id, c.timestamp_ms));
    }

    #[test]
    fn a_call_maps_to_a_job_per_design_section_5() {
        let msg = call();
        let job = call_to_job(
            &msg,
            ojs_core::envelope::type_from_topic_action(&msg.topic, &msg.action),
            "payments".into(),
            None,
        );
        assert_eq!(job.job_type, "payment.payment_service.process_payment");
        job.validate().unwrap();
        assert_eq!(job.id, call_job_id(&msg.message_id, msg.timestamp_ms));
        assert_eq!(job.queue, "payments");
        assert_eq!(job.args, vec![Value::String("AAEC-vv8_w".into())]);
        assert_eq!(job.meta_str(META_ORIGINATOR), Some("order-service-pod-1"));
        assert_eq!(job.meta_str(META_TOPIC), Some("payment.PaymentService"));
        assert_eq!(job.meta_str(META_ACTION), Some("ProcessPayment"));
        assert_eq!(job.meta_str(META_MESSAGE_ID), Some(msg.message_id.as_str()));
        assert_eq!(job.meta_str(META_PAYLOAD_ENCODING), Some(PAYLOAD_BASE64URL));
        assert_eq!(
            job.meta_str("traceparent"),
            msg.metadata.get("traceparent").map(String::as_str)
        );
        assert_eq!(job.priority, 7);
        assert_eq!(job.created_at.unwrap().timestamp_millis(), msg.timestamp_ms);
        assert_eq!(
            job.expires_at.unwrap().timestamp_millis(),
            1_763_700_060_000
        );
    }

    #[test]
    fn job_ids_are_deterministic_uuidv7_with_the_call_timestamp() {
        let a = call_job_id("m-1", 1_763_700_000_123);
        assert_eq!(a, call_job_id("m-1", 1_763_700_000_123));
        assert_ne!(a, call_job_id("m-2", 1_763_700_000_123));
        let uuid = uuid::Uuid::parse_str(&a).unwrap();
        assert_eq!(uuid.get_version_num(), 7);
        let (secs, nanos) = uuid.get_timestamp().unwrap().to_unix();
        assert_eq!(
            secs * 1000 + u64::from(nanos) / 1_000_000,
            1_763_700_000_123
        );
        ojs_core::envelope::validate_job_id(&a).unwrap();
        // Hostile timestamps still give valid ids.
        ojs_core::envelope::validate_job_id(&call_job_id("x", -5)).unwrap();
        ojs_core::envelope::validate_job_id(&call_job_id("x", i64::MAX)).unwrap();
    }

    #[test]
    fn call_to_job_to_call_returns_the_original_message() {
        let msg = call();
        let job = call_to_job(&msg, "anything.custom".into(), "q".into(), None);
        // Through both codecs, as the job would travel.
        let job = JobEnvelope::from_proto_bytes(&job.to_proto_bytes().unwrap()).unwrap();
        let job = JobEnvelope::from_json_slice(&job.to_json_vec().unwrap()).unwrap();
        let JobPayload::Bytes(payload) = job_payload(&job).unwrap() else {
            panic!("base64url payload expected")
        };
        let (topic, action) = job_topic_action(&job).unwrap();
        assert_eq!(job_to_call(&job, topic, action, payload), msg);
    }

    #[test]
    fn a_native_job_becomes_a_call_named_by_its_type() {
        let job =
            JobEnvelope::new("email.Mailer.Send", vec![Value::from(1)]).with_meta("tenant", 5);
        let (topic, action) = job_topic_action(&job).unwrap();
        assert_eq!((topic.as_str(), action.as_str()), ("email.Mailer", "Send"));
        assert!(matches!(job_payload(&job).unwrap(), JobPayload::Native(args) if args.len() == 1));
        let call = job_to_call(&job, topic, action, b"x".to_vec());
        assert_eq!(call.message_id, job.id);
        assert_eq!(call.metadata.get("tenant").map(String::as_str), Some("5"));
        assert_eq!(
            call.timestamp_ms,
            job.created_at.unwrap().timestamp_millis()
        );
        let undotted = JobEnvelope::new("email", vec![]);
        assert!(job_topic_action(&undotted)
            .unwrap_err()
            .to_string()
            .contains("no dot"));
    }

    #[test]
    fn bad_payload_meta_is_an_error_naming_it() {
        let mut job = call_to_job(&call(), "a.b".into(), "q".into(), None);
        job.args = vec![Value::String("***".into())];
        assert!(job_payload(&job)
            .unwrap_err()
            .to_string()
            .contains("base64url"));
        job.meta
            .insert(META_PAYLOAD_ENCODING.into(), "rot13".into());
        assert!(job_payload(&job).unwrap_err().to_string().contains("rot13"));
    }

    #[test]
    fn remembered_job_types_are_the_ones_named_afresh() {
        let mut types = JobTypes::new();
        let calls = [
            ("payment.PaymentService", "ProcessPayment"),
            ("payment.PaymentService", "ProcessPayment"),
            ("payment.PaymentService", "Refund"),
            // The same joined text, split differently: another job type.
            ("payment", "PaymentServiceRefund"),
            ("payment.PaymentService", "ProcessPayment"),
        ];
        for (topic, action) in calls {
            let named = ojs_core::envelope::type_from_topic_action(topic, action);
            assert_eq!(types.of(topic, action).unwrap(), named.as_str());
        }
        // A name the schema refuses is refused every time, also right
        // after a valid one and after itself.
        let bad = ("a..b", "Do");
        for _ in 0..2 {
            let e = types.of(bad.0, bad.1).unwrap_err();
            assert!(e.to_string().contains("does not match"), "{e}");
        }
        assert_eq!(
            types.of("payment.PaymentService", "Refund").unwrap(),
            "payment.payment_service.refund"
        );
    }
}
