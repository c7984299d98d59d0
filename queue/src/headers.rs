//! Message headers without per-message allocations for what is fixed.
//!
//! Header names are mostly the dozen of [`super::header`]: a [`HeaderName`]
//! is a `&'static str` for those (names read off the wire are matched
//! against them first) and a shared `Arc<str>` otherwise, so copying a
//! message never copies a name. Values are [`HeaderValue`]s, which are
//! [`Bytes`]: a static media type costs nothing, a value taken from a
//! `String` is moved rather than copied, and a binary Kafka header value
//! stays the bytes it was (a retry or dead-letter copy carries it
//! unchanged). [`Headers`] is a small vector sorted by name: one allocation
//! for the whole set, lookups by binary search over a handful of entries.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use super::header;

/// Every name of [`header`]: names read from a broker that equal one of
/// these become the static string, so they are never allocated.
const KNOWN: &[&str] = &[
    header::CONTENT_TYPE,
    header::SPECVERSION,
    header::ID,
    header::TYPE,
    header::QUEUE,
    header::ATTEMPT,
    header::TRACEPARENT,
    header::TRACESTATE,
    header::ERROR_TYPE,
    header::ERROR_MESSAGE,
    header::PAYLOAD_OMITTED,
    header::HEADERS_OMITTED,
    header::DEAD_LETTER_RECORD,
    header::GRPCQ_TOPIC,
    header::GRPCQ_ACTION,
    header::GRPCQ_ORIGINATOR,
];

/// Whether `name` is one of [`header`]'s.
pub(super) fn is_known(name: &str) -> bool {
    KNOWN.contains(&name)
}

/// A header name: static for the names of [`header`], shared otherwise.
#[derive(Clone)]
pub struct HeaderName(NameRepr);

#[derive(Clone)]
enum NameRepr {
    Static(&'static str),
    Shared(Arc<str>),
}

impl HeaderName {
    /// A name known at compile time (no allocation).
    pub const fn from_static(name: &'static str) -> Self {
        HeaderName(NameRepr::Static(name))
    }

    /// A name read at run time: one of [`header`]'s is not allocated.
    pub fn new(name: &str) -> Self {
        match KNOWN.iter().find(|k| **k == name) {
            Some(known) => HeaderName(NameRepr::Static(known)),
            None => HeaderName(NameRepr::Shared(Arc::from(name))),
        }
    }

    /// `prefix` + `rest` (a broker's spelling of a name turned back into
    /// ours): one of [`header`]'s is not allocated.
    pub fn with_prefix(prefix: &str, rest: &str) -> Self {
        let known = KNOWN.iter().find(|k| {
            k.len() == prefix.len() + rest.len() && k.starts_with(prefix) && k.ends_with(rest)
        });
        match known {
            Some(known) => HeaderName(NameRepr::Static(known)),
            None => HeaderName(NameRepr::Shared(Arc::from(format!("{prefix}{rest}")))),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            NameRepr::Static(s) => s,
            NameRepr::Shared(s) => s,
        }
    }
}

impl Deref for HeaderName {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for HeaderName {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for HeaderName {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl From<&'static str> for HeaderName {
    fn from(name: &'static str) -> Self {
        HeaderName::from_static(name)
    }
}

impl From<String> for HeaderName {
    fn from(name: String) -> Self {
        HeaderName::new(&name)
    }
}

impl From<&String> for HeaderName {
    fn from(name: &String) -> Self {
        HeaderName::new(name)
    }
}

impl PartialEq for HeaderName {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}
impl Eq for HeaderName {}

impl PartialEq<str> for HeaderName {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for HeaderName {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialOrd for HeaderName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeaderName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for HeaderName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for HeaderName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for HeaderName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A header value: bytes, usually UTF-8 text. Kafka and SQS (binary
/// attributes) carry any bytes; text-only destinations say how they write
/// the others.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HeaderValue(Bytes);

impl HeaderValue {
    /// A value known at compile time (no allocation).
    pub const fn from_static(value: &'static str) -> Self {
        HeaderValue(Bytes::from_static(value.as_bytes()))
    }

    /// A content type: the media types of [`ojs_core::envelope::media`] are static (no
    /// allocation), any other is copied.
    pub fn media_type(content_type: &str) -> Self {
        use ojs_core::envelope::media::{
            GRPCQ_PROTO, JSON, OJS_JSON, OJS_PROTO, OJS_PROTO_DELIMITED,
        };
        match [OJS_PROTO, GRPCQ_PROTO, OJS_JSON, OJS_PROTO_DELIMITED, JSON]
            .into_iter()
            .find(|m| *m == content_type)
        {
            Some(known) => HeaderValue::from_static(known),
            None => HeaderValue::from(content_type),
        }
    }

    /// The value as text, when it is UTF-8.
    pub fn to_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// The value as text, invalid UTF-8 replaced (for text-only
    /// destinations and messages).
    pub fn to_str_lossy(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.0)
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The bytes, shared.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the value is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for HeaderValue {
    fn from(v: String) -> Self {
        // Trimmed to its length first: `Bytes` takes an exact allocation
        // as it is, but one with room to spare costs a second allocation
        // for its bookkeeping (trimming is usually in place).
        HeaderValue(Bytes::from(v.into_boxed_str().into_boxed_bytes()))
    }
}

impl From<&str> for HeaderValue {
    fn from(v: &str) -> Self {
        HeaderValue(Bytes::copy_from_slice(v.as_bytes()))
    }
}

impl From<&String> for HeaderValue {
    fn from(v: &String) -> Self {
        HeaderValue(Bytes::copy_from_slice(v.as_bytes()))
    }
}

impl From<Bytes> for HeaderValue {
    fn from(v: Bytes) -> Self {
        HeaderValue(v)
    }
}

impl From<Vec<u8>> for HeaderValue {
    fn from(v: Vec<u8>) -> Self {
        HeaderValue(Bytes::from(v))
    }
}

impl From<&[u8]> for HeaderValue {
    fn from(v: &[u8]) -> Self {
        HeaderValue(Bytes::copy_from_slice(v))
    }
}

impl PartialEq<str> for HeaderValue {
    fn eq(&self, other: &str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<&str> for HeaderValue {
    fn eq(&self, other: &&str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<String> for HeaderValue {
    fn eq(&self, other: &String) -> bool {
        self.0 == other.as_bytes()
    }
}

impl fmt::Debug for HeaderValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_str() {
            Some(s) => fmt::Debug::fmt(s, f),
            None => write!(f, "<{} bytes>", self.0.len()),
        }
    }
}

impl Serialize for HeaderValue {
    /// Text as a string, other bytes as an array of numbers (the embedded
    /// broker's rows and `tail` output stay readable JSON).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.to_str() {
            Some(text) => s.serialize_str(text),
            None => s.serialize_bytes(&self.0),
        }
    }
}

impl<'de> Deserialize<'de> for HeaderValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = HeaderValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HeaderValue, E> {
                Ok(HeaderValue::from(v))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<HeaderValue, E> {
                Ok(HeaderValue::from(v))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<HeaderValue, E> {
                Ok(HeaderValue::from(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HeaderValue, A::Error> {
                let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(b) = seq.next_element::<u8>()? {
                    bytes.push(b);
                }
                Ok(HeaderValue::from(bytes))
            }
        }
        d.deserialize_any(ValueVisitor)
    }
}

/// Message headers: unique names, iterated in name order. Adapters map
/// them onto broker properties and back, so the names of [`header`] mean
/// the same thing on every broker.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    entries: Vec<(HeaderName, HeaderValue)>,
}

impl Headers {
    /// No headers.
    pub const fn new() -> Self {
        Headers {
            entries: Vec::new(),
        }
    }

    /// Room for `n` headers in one allocation.
    pub fn with_capacity(n: usize) -> Self {
        Headers {
            entries: Vec::with_capacity(n),
        }
    }

    fn find(&self, name: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    /// Sets a header, returning the value it replaced.
    pub fn insert(
        &mut self,
        name: impl Into<HeaderName>,
        value: impl Into<HeaderValue>,
    ) -> Option<HeaderValue> {
        let name = name.into();
        let value = value.into();
        // Headers are mostly written in name order: one comparison then.
        if self
            .entries
            .last()
            .is_none_or(|(last, _)| last.as_str() < name.as_str())
        {
            self.entries.push((name, value));
            return None;
        }
        match self.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (name, value));
                None
            }
        }
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&HeaderValue> {
        self.find(name).ok().map(|i| &self.entries[i].1)
    }

    /// The value of `name` as text (absent when it is not UTF-8).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(HeaderValue::to_str)
    }

    /// Whether `name` is set.
    pub fn contains_key(&self, name: &str) -> bool {
        self.find(name).is_ok()
    }

    /// Removes `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderValue> {
        self.find(name).ok().map(|i| self.entries.remove(i).1)
    }

    /// Keeps the headers `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &HeaderValue) -> bool) {
        self.entries.retain(|(k, v)| keep(k, v));
    }

    /// Removes every header.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Number of headers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Headers in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    /// Names in order.
    pub fn keys(&self) -> impl Iterator<Item = &HeaderName> {
        self.entries.iter().map(|(k, _)| k)
    }

    /// Bytes of all names and values (for size limits).
    pub fn encoded_size(&self) -> usize {
        self.entries.iter().map(|(k, v)| k.len() + v.len()).sum()
    }
}

/// `headers["name"]`, like a map's index: panics when `name` is not set
/// (for tests and values known to be there; use [`Headers::get`] on
/// anything read from outside).
impl std::ops::Index<&str> for Headers {
    type Output = HeaderValue;
    fn index(&self, name: &str) -> &HeaderValue {
        match self.get(name) {
            Some(v) => v,
            None => panic!("no header {name:?}"),
        }
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a HeaderName, &'a HeaderValue);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (HeaderName, HeaderValue)>,
        fn(&'a (HeaderName, HeaderValue)) -> (&'a HeaderName, &'a HeaderValue),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

impl IntoIterator for Headers {
    type Item = (HeaderName, HeaderValue);
    type IntoIter = std::vec::IntoIter<(HeaderName, HeaderValue)>;
    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

impl<N: Into<HeaderName>, V: Into<HeaderValue>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        let mut headers = Headers::new();
        headers.extend(iter);
        headers
    }
}

impl<N: Into<HeaderName>, V: Into<HeaderValue>> Extend<(N, V)> for Headers {
    fn extend<I: IntoIterator<Item = (N, V)>>(&mut self, iter: I) {
        for (n, v) in iter {
            self.insert(n, v);
        }
    }
}

impl<N: Into<HeaderName>, V: Into<HeaderValue>, const K: usize> From<[(N, V); K]> for Headers {
    fn from(pairs: [(N, V); K]) -> Self {
        pairs.into_iter().collect()
    }
}

impl Serialize for Headers {
    /// A JSON object of name → value (what the embedded broker stored
    /// before headers were bytes, so old rows read back unchanged).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.entries.len()))?;
        for (k, v) in &self.entries {
            map.serialize_entry(k.as_str(), v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Headers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HeadersVisitor;
        impl<'de> Visitor<'de> for HeadersVisitor {
            type Value = Headers;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of header names to values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Headers, A::Error> {
                let mut headers = Headers::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((k, v)) = map.next_entry::<String, HeaderValue>()? {
                    headers.insert(k, v);
                }
                Ok(headers)
            }
        }
        d.deserialize_map(HeadersVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_read_from_the_wire_are_static() {
        assert!(matches!(HeaderName::new("ojs-id").0, NameRepr::Static(_)));
        assert!(matches!(HeaderName::new("x-tenant").0, NameRepr::Shared(_)));
    }

    #[test]
    fn unique_names_in_order() {
        let mut h = Headers::new();
        assert_eq!(h.insert("b", "1"), None);
        h.insert("a", "2");
        assert_eq!(h.insert("b", "3"), Some(HeaderValue::from("1")));
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(h.get_str("b"), Some("3"));
        assert_eq!(h.remove("a"), Some(HeaderValue::from("2")));
        assert!(!h.contains_key("a"));
        assert_eq!(h.encoded_size(), 2);
    }

    #[test]
    fn binary_values_survive_json() {
        let mut h = Headers::new();
        h.insert("text", "plain");
        h.insert("bin", vec![0xff, 0x00, 0x80]);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, r#"{"bin":[255,0,128],"text":"plain"}"#);
        let back: Headers = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.get_str("bin"), None);
        assert_eq!(back.get("bin").unwrap().as_bytes(), [0xff, 0x00, 0x80]);
    }

    #[test]
    fn stored_headers_of_another_shape_are_an_error_not_a_guess() {
        // The embedded broker reads its rows with this: a value that is
        // neither text nor bytes is refused (the row then delivers its body
        // without headers), never turned into something else.
        for bad in [
            r#"{"a":5}"#,
            r#"{"a":[256]}"#,
            r#"{"a":{"b":"c"}}"#,
            r#"["a"]"#,
        ] {
            assert!(serde_json::from_str::<Headers>(bad).is_err(), "{bad}");
        }
    }
}
