//! A grpcq call read in place: [`Call`] keeps the bytes it arrived in (the
//! payload is never copied) and its strings side by side in one `String`,
//! checked to be UTF-8 once when the call is decoded — one allocation for
//! all of them instead of one per field, and handing a field out costs a
//! slice, not a second UTF-8 check (the daemon reads topic and action to
//! route, to name the job and to write it).
//!
//! It decodes exactly what prost's generated `grpcq.Message` decodes and
//! refuses exactly what it refuses (tested against it, and fuzzed): the
//! last occurrence of a field wins, unknown fields and groups are skipped
//! to the same depth, strings must be UTF-8, a metadata key given twice
//! keeps its last value. [`Call::to_message`] gives the prost message where
//! one is wanted (the worker's handlers, `tail`).

use std::ops::Range;

use bytes::Bytes;
use prost::encoding::{decode_key, decode_varint, WireType};

use super::Message;
use ojs_core::envelope::wire;
use ojs_core::{Error, Result};

/// How deep unknown groups may nest, as prost counts it (its recursion
/// limit; a metadata entry is one level already).
const GROUP_DEPTH: u32 = 100;

/// The most a call's text reserves up front (its strings are usually far
/// shorter: a topic, an action, an id and a little metadata).
const TEXT_RESERVE: usize = 256;

/// Where a field is: the payload in the call's bytes, a string in the
/// call's text. Ranges are checked when the call is decoded, and a string's
/// range is a whole UTF-8 string of the text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Span {
    // u32 keeps a call small (it is moved about per message); a call is
    // never near 4 GiB, and one that claims to be is refused.
    start: u32,
    end: u32,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }

    fn is_empty(self) -> bool {
        self.start == self.end
    }
}

/// A decoded `grpcq.Message` that shares the bytes it was decoded from.
#[derive(Clone)]
pub struct Call {
    /// The bytes decoded: the payload is a span of them.
    buf: Bytes,
    /// Every string field's text, one after another (spans below).
    text: String,
    originator: Span,
    topic: Span,
    action: Span,
    payload: Span,
    message_id: Span,
    timestamp_ms: i64,
    /// Sorted by key, one entry per key (a key given twice keeps its last
    /// value, as prost's map does).
    metadata: Vec<(Span, Span)>,
}

// Payloads and metadata may be anything (a secret in a header, a card
// number in a request): `Debug` names the call, never its contents.
impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("topic", &self.topic())
            .field("action", &self.action())
            .field("message_id", &self.message_id())
            .field("payload_len", &self.payload().len())
            .field("metadata_len", &self.metadata.len())
            .finish_non_exhaustive()
    }
}

// Equal calls hold equal fields, however their bytes were laid out (field
// order, unknown fields, a field given twice).
impl PartialEq for Call {
    fn eq(&self, other: &Self) -> bool {
        self.originator() == other.originator()
            && self.topic() == other.topic()
            && self.action() == other.action()
            && self.payload() == other.payload()
            && self.message_id() == other.message_id()
            && self.timestamp_ms == other.timestamp_ms
            && self.metadata().eq(other.metadata())
    }
}
impl Eq for Call {}

/// Where decoding is, for the offsets errors name.
struct Reader<'a> {
    rest: &'a [u8],
    total: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader {
            rest: bytes,
            total: bytes.len(),
        }
    }

    #[inline]
    fn at(&self) -> usize {
        self.total - self.rest.len()
    }

    /// The span of `len` bytes from here (the buffer is under 4 GiB).
    #[inline]
    fn span(&self, len: usize) -> Span {
        let start = self.at();
        Span {
            start: start as u32,
            end: (start + len) as u32,
        }
    }

    fn fail(&self, reason: impl std::fmt::Display) -> Error {
        Error::malformed(self.at(), format!("grpcq.Message: {reason}"))
    }

    #[inline]
    fn key(&mut self) -> Result<(u32, WireType)> {
        let at = self.at();
        decode_key(&mut self.rest).map_err(|e| Error::malformed(at, format!("grpcq.Message: {e}")))
    }

    #[inline]
    fn varint(&mut self) -> Result<u64> {
        let at = self.at();
        decode_varint(&mut self.rest)
            .map_err(|e| Error::malformed(at, format!("grpcq.Message: {e}")))
    }

    /// A length-delimited field's body, as a span of the whole buffer.
    fn len_delimited(&mut self) -> Result<Span> {
        let len = self.varint()?;
        if len > self.rest.len() as u64 {
            return Err(self.fail("buffer underflow"));
        }
        let span = self.span(len as usize);
        self.rest = &self.rest[len as usize..];
        Ok(span)
    }

    /// A string field: length-delimited and UTF-8, appended to `text`; its
    /// span there.
    #[inline]
    fn string(
        &mut self,
        whole: &[u8],
        text: &mut String,
        wire_type: WireType,
        field: u32,
    ) -> Result<Span> {
        self.expect(wire_type, WireType::LengthDelimited, field)?;
        let span = self.len_delimited()?;
        let Ok(s) = std::str::from_utf8(&whole[span.range()]) else {
            return Err(Error::malformed(
                span.start as usize,
                format!("grpcq.Message: field {field} is not UTF-8"),
            ));
        };
        // The text is shorter than the buffer, so it is under 4 GiB too.
        let start = text.len() as u32;
        text.push_str(s);
        Ok(Span {
            start,
            end: text.len() as u32,
        })
    }

    #[inline]
    fn expect(&self, got: WireType, want: WireType, field: u32) -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(self.fail(format!(
                "field {field} has wire type {got:?}, expected {want:?}"
            )))
        }
    }

    /// Skips an unknown field, groups included, `depth` levels at most.
    fn skip(&mut self, wire_type: WireType, tag: u32, depth: u32) -> Result<()> {
        if depth == 0 {
            return Err(self.fail("recursion limit reached"));
        }
        let len = match wire_type {
            WireType::Varint => {
                self.varint()?;
                0
            }
            WireType::ThirtyTwoBit => 4,
            WireType::SixtyFourBit => 8,
            WireType::LengthDelimited => self.varint()?,
            WireType::StartGroup => loop {
                let (inner, inner_type) = self.key()?;
                if inner_type == WireType::EndGroup {
                    if inner != tag {
                        return Err(self.fail("unexpected end group tag"));
                    }
                    break 0;
                }
                self.skip(inner_type, inner, depth - 1)?;
            },
            WireType::EndGroup => return Err(self.fail("unexpected end group tag")),
        };
        if len > self.rest.len() as u64 {
            return Err(self.fail("buffer underflow"));
        }
        self.rest = &self.rest[len as usize..];
        Ok(())
    }
}

impl Call {
    /// Decodes a binary `grpcq.Message`; a call needs a topic and an action.
    pub fn decode(buf: Bytes) -> Result<Call> {
        let call = Call::decode_fields(buf)?;
        if call.topic.is_empty() {
            return Err(Error::MissingAttribute("topic"));
        }
        if call.action.is_empty() {
            return Err(Error::MissingAttribute("action"));
        }
        Ok(call)
    }

    fn empty() -> Call {
        Call {
            buf: Bytes::new(),
            text: String::new(),
            originator: Span::default(),
            topic: Span::default(),
            action: Span::default(),
            payload: Span::default(),
            message_id: Span::default(),
            timestamp_ms: 0,
            metadata: Vec::new(),
        }
    }

    /// The fields, whatever they hold.
    fn decode_fields(buf: Bytes) -> Result<Call> {
        let mut call = Call::empty();
        let whole: &[u8] = &buf;
        if u32::try_from(whole.len()).is_err() {
            return Err(Error::malformed(0, "grpcq.Message: 4 GiB or more"));
        }
        // The strings are part of the bytes: a small call's fit at once, a
        // large one's (its payload is most of it) grow as they come.
        let mut text = String::with_capacity(whole.len().min(TEXT_RESERVE));
        let mut r = Reader::new(whole);
        let mut sorted = true;
        while !r.rest.is_empty() {
            let (tag, wire_type) = r.key()?;
            match tag {
                1 => call.originator = r.string(whole, &mut text, wire_type, tag)?,
                2 => call.topic = r.string(whole, &mut text, wire_type, tag)?,
                3 => call.action = r.string(whole, &mut text, wire_type, tag)?,
                4 => {
                    r.expect(wire_type, WireType::LengthDelimited, tag)?;
                    call.payload = r.len_delimited()?;
                }
                5 => call.message_id = r.string(whole, &mut text, wire_type, tag)?,
                6 => {
                    r.expect(wire_type, WireType::Varint, tag)?;
                    // int64 is the varint's 64 bits, as prost reads it.
                    call.timestamp_ms = r.varint()? as i64;
                }
                7 => {
                    r.expect(wire_type, WireType::LengthDelimited, tag)?;
                    let entry = metadata_entry(&mut r, whole, &mut text)?;
                    if let Some((last_key, _)) = call.metadata.last() {
                        sorted &= text[last_key.range()] < text[entry.0.range()];
                    }
                    call.metadata.push(entry);
                }
                _ => r.skip(wire_type, tag, GROUP_DEPTH)?,
            }
        }
        if !sorted {
            // Sorted by key, the last of equal keys kept (a stable sort
            // keeps their order; dedup keeps the first of a run, so the
            // run is reversed first).
            let key = |span: &Span| &text[span.range()];
            call.metadata.sort_by(|a, b| key(&a.0).cmp(key(&b.0)));
            let mut i = 0;
            while i < call.metadata.len() {
                let mut j = i + 1;
                while j < call.metadata.len()
                    && key(&call.metadata[j].0) == key(&call.metadata[i].0)
                {
                    j += 1;
                }
                call.metadata[i..j].reverse();
                i = j;
            }
            call.metadata.dedup_by(|b, a| key(&a.0) == key(&b.0));
        }
        call.buf = buf;
        call.text = text;
        Ok(call)
    }

    /// Decodes a body that is either base64 text of a message (grpcq's SQS
    /// convention) or the raw binary message (legacy publishers), as
    /// [`super::decode_lenient`] does.
    pub fn decode_lenient(body: &Bytes) -> Result<Call> {
        if let Some(raw) = super::base64_body(body) {
            if let Ok(call) = Call::decode(Bytes::from(raw)) {
                return Ok(call);
            }
        }
        Call::decode(body.clone())
    }

    /// The same call from a prost message (tests and the CLI build calls
    /// as messages; a message without topic or action is kept as it is).
    pub fn from_message(msg: &Message) -> Call {
        // What prost encodes always decodes: the fallback is never taken.
        Call::decode_fields(Bytes::from(super::encode(msg))).unwrap_or_else(|_| Call::empty())
    }

    /// The prost message (allocates every field).
    pub fn to_message(&self) -> Message {
        Message {
            originator: self.originator().to_owned(),
            topic: self.topic().to_owned(),
            action: self.action().to_owned(),
            payload: self.payload().to_vec(),
            message_id: self.message_id().to_owned(),
            timestamp_ms: self.timestamp_ms,
            metadata: self
                .metadata()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    fn text(&self, span: Span) -> &str {
        // Spans are whole strings of the text, so the slice is always
        // there; `get` checks only the two ends, not the UTF-8 again.
        self.text.get(span.range()).unwrap_or_default()
    }

    /// The calling service.
    pub fn originator(&self) -> &str {
        self.text(self.originator)
    }

    /// Fully qualified gRPC service name.
    pub fn topic(&self) -> &str {
        self.text(self.topic)
    }

    /// gRPC method name.
    pub fn action(&self) -> &str {
        self.text(self.action)
    }

    /// The serialized request.
    pub fn payload(&self) -> &[u8] {
        &self.buf[self.payload.range()]
    }

    /// The serialized request, sharing the call's bytes.
    pub fn payload_bytes(&self) -> Bytes {
        self.buf.slice(self.payload.range())
    }

    /// The call's id (empty when the publisher set none).
    pub fn message_id(&self) -> &str {
        self.text(self.message_id)
    }

    /// When the call was made, Unix ms (0 when unset).
    pub fn timestamp_ms(&self) -> i64 {
        self.timestamp_ms
    }

    /// Metadata entries, sorted by key.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + Clone + '_ {
        self.metadata
            .iter()
            .map(|(k, v)| (self.text(*k), self.text(*v)))
    }

    /// How many metadata entries the call has.
    pub fn metadata_len(&self) -> usize {
        self.metadata.len()
    }

    /// One metadata value.
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.metadata
            .binary_search_by(|(k, _)| self.text(*k).cmp(key))
            .ok()
            .map(|i| self.text(self.metadata[i].1))
    }

    /// The binary message, byte for byte what prost writes for
    /// [`Call::to_message`] (fields in order, defaults left out, metadata
    /// sorted by key): unknown fields are dropped, as a prost round trip
    /// drops them.
    pub fn encode_to_vec(&self) -> Vec<u8> {
        let entry_body = |k: &str, v: &str| wire::string_len(1, k) + wire::string_len(2, v);
        let size = wire::string_len(1, self.originator())
            + wire::string_len(2, self.topic())
            + wire::string_len(3, self.action())
            + bytes_len(4, self.payload())
            + wire::string_len(5, self.message_id())
            + wire::int64_len(6, self.timestamp_ms)
            + self
                .metadata()
                .map(|(k, v)| wire::len_field_len(7, entry_body(k, v)))
                .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        wire::put_string(&mut out, 1, self.originator());
        wire::put_string(&mut out, 2, self.topic());
        wire::put_string(&mut out, 3, self.action());
        if !self.payload().is_empty() {
            wire::put_len_header(&mut out, 4, self.payload().len());
            out.extend_from_slice(self.payload());
        }
        wire::put_string(&mut out, 5, self.message_id());
        wire::put_int64(&mut out, 6, self.timestamp_ms);
        for (k, v) in self.metadata() {
            wire::put_len_header(&mut out, 7, entry_body(k, v));
            wire::put_string(&mut out, 1, k);
            wire::put_string(&mut out, 2, v);
        }
        debug_assert_eq!(out.len(), size);
        out
    }
}

fn bytes_len(field: u32, b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        wire::len_field_len(field, b.len())
    }
}

/// A metadata entry: its own small message with key 1 and value 2.
fn metadata_entry(r: &mut Reader<'_>, whole: &[u8], text: &mut String) -> Result<(Span, Span)> {
    let body = r.len_delimited()?;
    let mut inner = Reader {
        rest: &whole[body.range()],
        total: body.end as usize,
    };
    // Empty unless given, as a map entry's fields default.
    let mut key = Span::default();
    let mut value = key;
    while !inner.rest.is_empty() {
        let (tag, wire_type) = inner.key()?;
        match tag {
            1 => key = inner.string(whole, text, wire_type, tag)?,
            2 => value = inner.string(whole, text, wire_type, tag)?,
            _ => inner.skip(wire_type, tag, GROUP_DEPTH - 1)?,
        }
    }
    Ok((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;
    use proptest::prelude::*;

    /// What prost makes of `bytes`, and what `Call` makes of them, must
    /// agree: both fail, or both give the same message.
    fn agree(bytes: &[u8]) -> std::result::Result<(), TestCaseError> {
        let ours = Call::decode(Bytes::copy_from_slice(bytes)).map(|c| c.to_message());
        let prost = super::super::decode(bytes);
        match (&ours, &prost) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "ours {ours:?}, prost {prost:?}"),
        }
        let ours = Call::decode_lenient(&Bytes::copy_from_slice(bytes)).map(|c| c.to_message());
        let prost = super::super::decode_lenient(bytes);
        prop_assert_eq!(ours.is_ok(), prost.is_ok());
        if let (Ok(a), Ok(b)) = (ours, prost) {
            prop_assert_eq!(a, b);
        }
        Ok(())
    }

    fn put_key(out: &mut Vec<u8>, tag: u32, wire_type: u8) {
        wire::put_varint(out, (u64::from(tag) << 3) | u64::from(wire_type));
    }

    fn len_field(tag: u32, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_key(&mut out, tag, 2);
        wire::put_varint(&mut out, body.len() as u64);
        out.extend_from_slice(body);
        out
    }

    /// One field as protobuf bytes, mostly well formed (so that whole calls
    /// decode and their values are compared), sometimes not: known or
    /// unknown, right or wrong wire type, UTF-8 or not.
    fn field() -> impl Strategy<Value = Vec<u8>> {
        // Short keys and values, so that entries collide.
        let text = "[a-c]{0,2}".prop_map(String::into_bytes);
        let entry_part = prop_oneof![
            4 => (1u32..=2, text.clone()).prop_map(|(tag, b)| len_field(tag, &b)),
            1 => (3u32..=4, any::<u8>()).prop_map(|(tag, v)| {
                let mut out = Vec::new();
                put_key(&mut out, tag, 0);
                wire::put_varint(&mut out, u64::from(v));
                out
            }),
        ];
        let junk = proptest::collection::vec(any::<u8>(), 0..9);
        prop_oneof![
            // String fields, the payload, unknown length-delimited ones.
            3 => (prop_oneof![1u32..=5, 8u32..=9], text.clone()).prop_map(|(tag, b)| len_field(tag, &b)),
            // Metadata entries: key and value in any order, either given
            // twice or left out, unknown fields among them.
            4 => proptest::collection::vec(entry_part, 0..4)
                .prop_map(|parts| len_field(7, &parts.concat())),
            // Varints: the timestamp, unknown ones.
            2 => (prop_oneof![Just(6u32), 8u32..=9], any::<u64>()).prop_map(|(tag, v)| {
                let mut out = Vec::new();
                put_key(&mut out, tag, 0);
                wire::put_varint(&mut out, v);
                out
            }),
            // What prost refuses or skips: invalid UTF-8, a known tag
            // with another wire type, fixed-size and group fields, an entry
            // holding junk.
            1 => (1u32..=9, junk.clone()).prop_map(|(tag, b)| len_field(tag, &b)),
            1 => (1u32..=9, 0u8..=5, junk.clone()).prop_map(|(tag, wt, rest)| {
                let mut out = Vec::new();
                put_key(&mut out, tag, wt);
                out.extend(rest);
                out
            }),
            1 => junk.prop_map(|b| len_field(7, &b)),
        ]
    }

    proptest! {
        #[test]
        fn decodes_what_prost_decodes(
            named in any::<bool>(),
            fields in proptest::collection::vec(field(), 0..10),
        ) {
            // Mostly calls prost accepts (a topic and an action first, so
            // the rest decides), some that it refuses.
            let mut bytes = Vec::new();
            if named {
                wire::put_string(&mut bytes, 2, "t.S");
                wire::put_string(&mut bytes, 3, "A");
            }
            bytes.extend(fields.concat());
            agree(&bytes)?;
        }

        #[test]
        fn decodes_any_bytes_as_prost_does(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            agree(&bytes)?;
        }

        #[test]
        fn a_message_survives_and_encodes_as_prost_does(
            originator in ".{0,8}",
            topic in "[a-z.]{1,8}",
            payload in proptest::collection::vec(any::<u8>(), 0..40),
            message_id in ".{0,8}",
            timestamp_ms in any::<i64>(),
            metadata in proptest::collection::btree_map(".{0,6}", ".{0,6}", 0..6),
        ) {
            let msg = Message {
                originator, topic, action: "A".into(), payload, message_id, timestamp_ms, metadata,
            };
            let encoded = super::super::encode(&msg);
            let call = Call::decode(Bytes::from(encoded.clone())).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(call.to_message(), msg.clone());
            prop_assert_eq!(call.encode_to_vec(), encoded.clone());
            prop_assert_eq!(Call::from_message(&msg).to_message(), msg.clone());
            for (k, v) in &msg.metadata {
                prop_assert_eq!(call.metadata_value(k), Some(v.as_str()));
            }
            let text = Bytes::from(STANDARD.encode(&encoded));
            prop_assert_eq!(Call::decode_lenient(&text).map(|c| c.to_message()).ok(), Some(msg));
        }
    }

    #[test]
    fn a_key_given_twice_keeps_its_last_value_and_keys_come_sorted() {
        let mut bytes = Vec::new();
        for (k, v) in [("b", "1"), ("a", "2"), ("b", "3"), ("c", "4"), ("a", "5")] {
            let mut entry = Vec::new();
            wire::put_string(&mut entry, 1, k);
            wire::put_string(&mut entry, 2, v);
            put_key(&mut bytes, 7, 2);
            wire::put_varint(&mut bytes, entry.len() as u64);
            bytes.extend(entry);
        }
        wire::put_string(&mut bytes, 2, "t.S");
        wire::put_string(&mut bytes, 3, "A");
        let call = Call::decode(Bytes::from(bytes.clone())).unwrap();
        let got: Vec<_> = call.metadata().collect();
        assert_eq!(got, [("a", "5"), ("b", "3"), ("c", "4")]);
        assert_eq!(call.metadata_value("b"), Some("3"));
        assert_eq!(call.metadata_value("d"), None);
        assert_eq!(call.to_message(), super::super::decode(&bytes).unwrap());
    }

    /// Unknown groups nested `depth` deep, at the top or in an entry:
    /// prost's recursion limit, to the level.
    #[test]
    fn nested_groups_are_refused_where_prost_refuses_them() {
        fn groups(depth: usize) -> Vec<u8> {
            let mut out = Vec::new();
            for _ in 0..depth {
                put_key(&mut out, 9, 3);
            }
            for _ in 0..depth {
                put_key(&mut out, 9, 4);
            }
            out
        }
        for depth in [1, 98, 99, 100, 101] {
            let mut top = Vec::new();
            wire::put_string(&mut top, 2, "t.S");
            wire::put_string(&mut top, 3, "A");
            top.extend(groups(depth));
            let mut in_entry = Vec::new();
            wire::put_string(&mut in_entry, 2, "t.S");
            wire::put_string(&mut in_entry, 3, "A");
            let entry = groups(depth);
            put_key(&mut in_entry, 7, 2);
            wire::put_varint(&mut in_entry, entry.len() as u64);
            in_entry.extend(entry);
            for bytes in [top, in_entry] {
                let ours = Call::decode(Bytes::from(bytes.clone())).is_ok();
                let prost = super::super::decode(&bytes).is_ok();
                assert_eq!(ours, prost, "depth {depth}");
            }
        }
    }

    #[test]
    fn the_payload_is_shared_not_copied() {
        let msg = Message {
            topic: "t.S".into(),
            action: "A".into(),
            payload: vec![9; 64],
            ..Message::default()
        };
        let buf = Bytes::from(super::super::encode(&msg));
        let call = Call::decode(buf.clone()).unwrap();
        let payload = call.payload_bytes();
        assert_eq!(&payload[..], &[9; 64][..]);
        let inside = buf.as_ptr_range();
        assert!(inside.contains(&payload.as_ptr()));
    }

    #[test]
    fn refusals_are_named() {
        assert!(matches!(
            Call::decode(Bytes::from_static(b"\x12\x03t.S")),
            Err(Error::MissingAttribute("action"))
        ));
        assert!(matches!(
            Call::decode(Bytes::from_static(b"\x1a\x01A")),
            Err(Error::MissingAttribute("topic"))
        ));
        // Field 2 (topic) cut short: the offset is where it went wrong.
        let err = Call::decode(Bytes::from_static(b"\x12\x09t.S")).unwrap_err();
        assert!(matches!(err, Error::MalformedProtobuf { .. }), "{err}");
        let err = Call::decode(Bytes::from_static(b"\x12\x02\xff\xfe\x1a\x01A")).unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }

    #[test]
    fn debug_names_the_call_without_its_contents() {
        let mut msg = Message {
            topic: "t.S".into(),
            action: "A".into(),
            payload: b"card 4111111111111111".to_vec(),
            ..Message::default()
        };
        msg.metadata
            .insert("authorization".into(), "Bearer s3cret".into());
        let shown = format!("{:?}", Call::from_message(&msg));
        assert!(shown.contains("t.S"), "{shown}");
        assert!(
            !shown.contains("4111") && !shown.contains("s3cret"),
            "{shown}"
        );
    }
}
