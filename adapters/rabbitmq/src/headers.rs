//! Mapping between the adapter-neutral headers of `ojs-core` and AMQP
//! properties and headers (docs/design.md §4 "RabbitMQ").
//!
//! | neutral header | AMQP |
//! |---|---|
//! | `content-type` | `content_type` property |
//! | `ojs-id` | `message_id` property (read back when `type` is set, i.e. for OJS jobs) |
//! | `ojs-type` | `type` property |
//! | other `ojs-*` | `x-ojs-*` header (`x-ojs-specversion`, `x-ojs-queue`, `x-ojs-attempt`, `x-ojs-error-*`) |
//! | anything else | header of the same name (`traceparent`, grpcq `topic`/`action`…) |
//!
//! The ordering key travels in `x-ojs-key`.

use bytes::Bytes;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use ojs_queue::{header, HeaderName, HeaderValue, Headers, OutgoingMessage, Result};

use crate::topology::short;

/// AMQP header carrying the ordering key.
pub const KEY_HEADER: &str = "x-ojs-key";
/// Quorum queues count deliveries here.
const DELIVERY_COUNT: &str = "x-delivery-count";
/// Headers RabbitMQ adds on dead-lettering and federation.
const BROKER_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-",
    "x-last-death-",
    "x-received-from",
];

fn amqp_name(name: &str) -> String {
    if name.starts_with("ojs-") {
        format!("x-{name}")
    } else {
        name.to_owned()
    }
}

fn neutral_name(name: &str) -> Option<HeaderName> {
    if let Some(rest) = name.strip_prefix("x-ojs-") {
        (name != KEY_HEADER).then(|| HeaderName::with_prefix("ojs-", rest))
    } else if is_broker_header(name) {
        // Broker bookkeeping is not part of the message.
        None
    } else {
        Some(HeaderName::new(name))
    }
}

/// Broker bookkeeping (dead-lettering, federation), not part of the message.
fn is_broker_header(name: &str) -> bool {
    BROKER_HEADERS.iter().any(|p| name.starts_with(p))
}

/// A header's value: long strings (what this adapter writes) and byte
/// arrays as the bytes they are, numbers and booleans as text.
fn value_of(v: &AMQPValue) -> Option<HeaderValue> {
    match v {
        AMQPValue::LongString(s) => Some(HeaderValue::from(s.as_bytes())),
        AMQPValue::ByteArray(b) => Some(HeaderValue::from(b.as_slice())),
        other => text(other).map(HeaderValue::from),
    }
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        AMQPValue::LongUInt(n) => Some(n.to_string()),
        AMQPValue::ShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortUInt(n) => Some(n.to_string()),
        AMQPValue::ShortShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Some(n.to_string()),
        AMQPValue::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Properties for a message; its OJS `priority` as one of the queue's
/// ranks (see `priority`).
/// An error when a header name, the content type, the job type or the
/// message id is longer than an AMQP short string holds (255 bytes).
pub fn properties(m: &OutgoingMessage, max_priority: Option<u8>) -> Result<BasicProperties> {
    properties_keeping(m, max_priority, None)
}

/// [`properties`] for a copy of a delivery, with the delivery's
/// [`Received::typed`] entries: a header whose value is still what was read
/// from its typed entry goes out as that entry (an integer stays an
/// integer); entries the neutral headers never held (tables, arrays, …) go
/// out as they came.
pub fn properties_keeping(
    m: &OutgoingMessage,
    max_priority: Option<u8>,
    typed: Option<&FieldTable>,
) -> Result<BasicProperties> {
    let mut table = FieldTable::default();
    let mut props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_timestamp(chrono::Utc::now().timestamp().max(0) as u64);
    for (name, value) in &m.headers {
        match name.as_str() {
            header::CONTENT_TYPE => {
                props = props.with_content_type(short(&value.to_str_lossy(), "content_type")?)
            }
            header::ID if m.headers.contains_key(header::TYPE) => {}
            header::TYPE => props = props.with_type(short(&value.to_str_lossy(), "type")?),
            _ => {
                let name = short(&amqp_name(name), "header name")?;
                let as_read = typed.and_then(|t| t.inner().get(&name)).filter(|v| {
                    value_of(v).is_some_and(|read| read.as_bytes() == value.as_bytes())
                });
                let value = match as_read {
                    Some(v) => v.clone(),
                    None => AMQPValue::LongString(LongString::from(value.as_bytes())),
                };
                table.insert(name, value);
            }
        }
    }
    for (name, value) in typed.map(FieldTable::inner).into_iter().flatten() {
        if value_of(value).is_none() && !table.contains_key(name.as_str()) {
            table.insert(name.clone(), value.clone());
        }
    }
    // A job's `ojs-id` is its message_id (read back as such because `type`
    // is set); any other message's travels as the `x-ojs-id` header alone.
    let job_id = m
        .headers
        .get_str(header::ID)
        .filter(|_| m.headers.contains_key(header::TYPE));
    let id = m.message_id.as_deref().or(job_id);
    if let Some(id) = id {
        props = props.with_message_id(short(id, "message_id")?);
    }
    if let Some(key) = &m.key {
        table.insert(
            KEY_HEADER.into(),
            AMQPValue::LongString(LongString::from(key.to_vec())),
        );
    }
    if let Some(max) = max_priority {
        props = props.with_priority(crate::priority::rank(m.priority, max));
    }
    Ok(props.with_headers(table))
}

/// What a delivery carries, in neutral form.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: Headers,
    /// The ordering key, as bytes (a long string carries any).
    pub key: Option<Bytes>,
    pub message_id: Option<String>,
    /// The AMQP priority, when the message has one.
    pub rank: Option<u8>,
    /// 1-based attempt: `x-ojs-attempt` (set when a retry was republished),
    /// plus the broker's redeliveries.
    pub attempt: u32,
    /// The attempt the header recorded, before this delivery's redeliveries.
    pub base_attempt: u32,
    /// Header entries `headers` cannot give back as they came: numbers,
    /// booleans, short strings and byte arrays (read as text or bytes, which
    /// would go out again as long strings), and tables, arrays, floats,
    /// decimals, timestamps and voids (not read at all). `None`, without an
    /// allocation, for a message with long-string headers only, which is
    /// what this adapter writes. [`properties_keeping`] puts them back on a
    /// retry or dead-letter copy.
    pub typed: Option<FieldTable>,
}

/// Reads properties and headers back into neutral form.
pub fn received(props: &BasicProperties, redelivered: bool) -> Received {
    let mut headers = Headers::new();
    let mut key = None;
    let mut delivery_count = None;
    let mut typed: Option<FieldTable> = None;
    if let Some(table) = props.headers() {
        for (amqp, value) in table.inner() {
            let name = amqp.as_str();
            if name == KEY_HEADER {
                key = match value {
                    AMQPValue::LongString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
                    AMQPValue::ByteArray(b) => Some(Bytes::copy_from_slice(b.as_slice())),
                    other => text(other).map(Bytes::from),
                };
            } else if name == DELIVERY_COUNT {
                delivery_count = text(value).and_then(|t| t.parse::<u32>().ok());
            } else if !is_broker_header(name) {
                // What the neutral headers cannot give back as it came
                // (anything but a long string, which is all we write) is
                // kept apart for copies: one pass, no allocation otherwise.
                if !matches!(value, AMQPValue::LongString(_)) {
                    typed
                        .get_or_insert_with(FieldTable::default)
                        .insert(amqp.clone(), value.clone());
                }
                if let (Some(n), Some(v)) = (neutral_name(name), value_of(value)) {
                    headers.insert(n, v);
                }
            }
        }
    }
    if let Some(ct) = props.content_type() {
        headers.insert(header::CONTENT_TYPE, ct.as_str());
    }
    let message_id = props.message_id().as_ref().map(|s| s.as_str().to_owned());
    if let Some(kind) = props.kind() {
        headers.insert(header::TYPE, kind.as_str());
        if let Some(id) = &message_id {
            headers.insert(header::ID, id.as_str());
        }
    }
    let base: u32 = headers
        .get_str(header::ATTEMPT)
        .and_then(|a| a.parse().ok())
        .filter(|a| *a > 0)
        .unwrap_or(1);
    // Quorum queues count redeliveries exactly; classic queues only flag them.
    let redeliveries = delivery_count.unwrap_or(u32::from(redelivered));
    Received {
        headers,
        key,
        message_id,
        rank: *props.priority(),
        attempt: base.saturating_add(redeliveries),
        base_attempt: base,
        typed,
    }
}

/// Reads a content header's property list as it comes off the wire, the
/// way lapin does before it hands properties over, then like a delivery.
/// `None` when the bytes are not a property list. The AMQP header fuzz
/// target starts here.
pub fn received_from_wire(bytes: &[u8], redelivered: bool) -> Option<Received> {
    let (_, props) = lapin::protocol::basic::parse_properties(bytes).ok()?;
    Some(received(&props, redelivered))
}

/// A property list as it goes on the wire; an error when a value does not
/// fit its AMQP type (a short string over 255 bytes).
pub fn to_wire(props: &BasicProperties) -> Result<Vec<u8>, String> {
    cookie_factory::gen_simple(lapin::protocol::basic::gen_properties(props), Vec::new())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ojs_core::{Encoding, JobEnvelope};

    #[test]
    fn a_copy_keeps_typed_headers_unless_their_value_changed() {
        let mut theirs = FieldTable::default();
        theirs.insert("count".into(), AMQPValue::LongInt(5));
        theirs.insert("retries".into(), AMQPValue::LongInt(1));
        theirs.insert("meta".into(), AMQPValue::FieldTable(FieldTable::default()));
        theirs.insert("nothing".into(), AMQPValue::Void);
        theirs.insert("plain".into(), AMQPValue::LongString("text".into()));
        theirs.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        let props = BasicProperties::default().with_headers(theirs);
        let r = received(&props, false);
        let typed = r.typed.clone().unwrap();
        assert!(
            !typed.contains_key("plain"),
            "long strings come back as they are"
        );
        assert!(
            !typed.contains_key("x-death"),
            "broker bookkeeping is not kept"
        );
        let mut copy = OutgoingMessage::new("x", "text/plain");
        copy.headers = r.headers;
        copy.headers.insert("retries", "2");
        let out = properties_keeping(&copy, None, r.typed.as_ref()).unwrap();
        let table = out.headers().clone().unwrap();
        let get = |n: &str| table.inner().get(n).cloned();
        assert_eq!(get("count"), Some(AMQPValue::LongInt(5)));
        assert_eq!(
            get("retries"),
            Some(AMQPValue::LongString("2".into())),
            "changed: as written"
        );
        assert_eq!(
            get("meta"),
            Some(AMQPValue::FieldTable(FieldTable::default()))
        );
        assert_eq!(get("nothing"), Some(AMQPValue::Void));
        assert_eq!(get("plain"), Some(AMQPValue::LongString("text".into())));
        assert_eq!(get("x-death"), None);
        let plain = received(
            &BasicProperties::default().with_headers(FieldTable::default()),
            false,
        );
        assert!(plain.typed.is_none(), "nothing kept, nothing allocated");
    }

    #[test]
    fn headers_round_trip_through_amqp_properties() {
        let job = JobEnvelope::new("email.send", vec![])
            .with_queue("mail")
            .with_priority(50)
            .with_meta("traceparent", "00-abc-def-01");
        let mut m = OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap();
        m.headers.insert("x-custom", "kept");
        m.headers.insert(header::ATTEMPT, "3");
        let props = properties(&m, Some(10)).unwrap();
        assert_eq!(props.message_id().as_ref().unwrap().as_str(), job.id);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), "email.send");
        assert_eq!(
            *props.priority(),
            Some(8),
            "50 of 100 above the middle rank 5"
        );
        assert_eq!(*props.delivery_mode(), Some(2));
        let table = props.headers().as_ref().unwrap();
        assert!(table.contains_key("x-ojs-specversion") && table.contains_key("x-ojs-queue"));
        assert!(table.contains_key("traceparent"));
        let back = received(&props, true);
        for name in [
            header::CONTENT_TYPE,
            header::ID,
            header::TYPE,
            header::SPECVERSION,
            header::QUEUE,
            header::TRACEPARENT,
        ] {
            assert_eq!(back.headers.get(name), m.headers.get(name), "{name}");
        }
        assert_eq!(back.headers.get_str("x-custom"), Some("kept"));
        assert_eq!(back.key.as_deref(), Some(job.id.as_bytes()));
        assert_eq!(back.attempt, 4, "3 from the header + 1 broker redelivery");
    }
}
