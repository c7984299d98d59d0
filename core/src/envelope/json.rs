//! `application/openjobspec+json`: the OJS JSON envelope.
//!
//! snake_case attributes, RFC 3339 timestamps (normalised to UTC, because
//! protobuf `Timestamp` has no offset), absent attributes omitted, and `null`
//! read as absent. Numbers go through the same ±2^53 check as protobuf so that
//! a JSON envelope that decodes here always converts to protobuf.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{Map, Value};

use crate::envelope::proto::split_backtrace;
use crate::envelope::value::normalize_value;
use crate::envelope::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy};
use crate::error::{Error, Result};

impl JobEnvelope {
    /// Decodes and validates one JSON envelope.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Self> {
        if let Some(job) = read_in_one_pass(bytes) {
            return Ok(job);
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| Error::InvalidJson {
            line: Some(e.line()),
            reason: e.to_string(),
        })?;
        Self::from_json_value(value)
    }

    /// Decodes and validates an already parsed JSON value.
    pub fn from_json_value(value: Value) -> Result<Self> {
        let Value::Object(map) = value else {
            return Err(Error::json(format!(
                "an envelope must be a JSON object, got {}",
                kind_of(&value)
            )));
        };
        let job = decode_object(map)?;
        job.validate()?;
        Ok(job)
    }

    /// Validates and encodes as compact JSON.
    pub fn to_json_vec(&self) -> Result<Vec<u8>> {
        self.validate()?;
        // An envelope's text is a few hundred bytes.
        let mut out = Vec::with_capacity(384);
        let mut object = crate::json_out::Object::open(&mut out);
        write_entries(self, &mut object, SecondsFormat::AutoSi, &mut |_| true)
            .map_err(|e| Error::json(e.to_string()))?;
        object.close();
        Ok(out)
    }

    /// Validates and encodes as compact JSON text: what
    /// [`JobEnvelope::to_json_vec`] writes, as a `String`.
    pub fn to_json_string(&self) -> Result<String> {
        // Every byte written is ASCII punctuation, digits, or a whole UTF-8
        // string copied or escaped character by character.
        String::from_utf8(self.to_json_vec()?).map_err(|e| Error::json(e.to_string()))
    }

    /// Writes the entries of the envelope's JSON object (what
    /// [`JobEnvelope::to_json_vec`] writes, without validating) into `map`,
    /// each one only if `keep` says so: `keep` sees every key about to be
    /// written. For an object that adds to the envelope's or overrides
    /// some of its entries, written without a `Value` tree in between.
    ///
    /// `times` is how the lifecycle timestamps (`created_at`,
    /// `enqueued_at`, `started_at`, `completed_at`) are written: the
    /// envelope's own JSON writes the fewest digits that keep a time exact
    /// ([`SecondsFormat::AutoSi`]: none on a whole second), a binding that
    /// promises milliseconds passes [`SecondsFormat::Millis`].
    /// `scheduled_at` and `expires_at` are times a client gives, so they
    /// are always written exact ([`SecondsFormat::AutoSi`]): one sent on a
    /// whole second, or with milliseconds, comes back as it was sent.
    pub fn write_json_entries<M: SerializeMap>(
        &self,
        map: &mut M,
        times: SecondsFormat,
        mut keep: impl FnMut(&str) -> bool,
    ) -> std::result::Result<(), M::Error> {
        write_entries(self, &mut MapEntries(map), times, &mut keep)
    }

    /// [`JobEnvelope::write_json_entries`] into an object being written
    /// straight into bytes ([`crate::json_out::Object`]): the same text,
    /// each known key copied as written where the program was compiled.
    pub fn write_json_object_entries(
        &self,
        object: &mut crate::json_out::Object<'_>,
        times: SecondsFormat,
        mut keep: impl FnMut(&str) -> bool,
    ) -> std::result::Result<(), crate::json_out::Error> {
        write_entries(self, object, times, &mut keep)
    }

    /// Validates and encodes as a JSON value.
    pub fn to_json_value(&self) -> Result<Value> {
        self.validate()?;
        serde_json::to_value(JsonView(self)).map_err(|e| Error::json(e.to_string()))
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn want_string(name: &str, v: Value) -> Result<String> {
    match v {
        Value::String(s) => Ok(s),
        other => Err(Error::invalid(
            name,
            format!("must be a string, got {}", kind_of(&other)),
        )),
    }
}

fn want_i32(name: &str, v: &Value) -> Result<i32> {
    v.as_i64()
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| Error::invalid(name, format!("must be a 32-bit integer, got {v}")))
}

fn want_object(name: &str, v: Value) -> Result<Map<String, Value>> {
    match v {
        Value::Object(m) => Ok(m),
        other => Err(Error::invalid(
            name,
            format!("must be an object, got {}", kind_of(&other)),
        )),
    }
}

fn want_string_list(name: &str, v: Value) -> Result<Vec<String>> {
    match v {
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| want_string(&format!("{name}[{i}]"), item))
            .collect(),
        other => Err(Error::invalid(
            name,
            format!("must be an array of strings, got {}", kind_of(&other)),
        )),
    }
}

fn want_timestamp(name: &str, v: Value) -> Result<Option<DateTime<Utc>>> {
    let s = want_string(name, v)?;
    // The text this codec writes is read digit by digit; chrono reads the
    // rest (and says what is wrong with the text neither reads).
    let t = match crate::timestamp::parse_rfc3339(&s) {
        Some(t) => t,
        None => DateTime::parse_from_rfc3339(&s)
            .map_err(|e| Error::invalid(name, format!("{s:?} is not an RFC 3339 timestamp: {e}")))?
            .with_timezone(&Utc),
    };
    // The epoch is protobuf's "unset"; reading it as unset here keeps both
    // codecs in agreement (docs/design.md §3).
    if t.timestamp() == 0 && t.timestamp_subsec_nanos() == 0 {
        return Ok(None);
    }
    if !(1..=9999).contains(&chrono::Datelike::year(&t)) {
        return Err(Error::invalid(name, "year must be within 0001..=9999"));
    }
    Ok(Some(t))
}

/// The attributes the codec reads into fields; every other top-level
/// attribute is kept as it is, `null` included.
#[cfg(test)]
const KNOWN_ATTRIBUTES: [&str; 28] = [
    "specversion",
    "id",
    "type",
    "queue",
    "args",
    "meta",
    "priority",
    "timeout",
    "scheduled_at",
    "expires_at",
    "retry",
    "unique",
    "schema",
    "state",
    "attempt",
    "created_at",
    "enqueued_at",
    "started_at",
    "completed_at",
    "error",
    "result",
    "total_timeout",
    "enqueue_ttl",
    "grace_period",
    "heartbeat_timeout",
    "result_ttl",
    "extensions",
    "errors",
];

/// The index of `key` in [`KNOWN_ATTRIBUTES`], if it is one (a `match`
/// compiles to a jump on the length and a comparison or two, where a scan
/// of the list compares up to 28 names for each key of every envelope).
fn known_attribute(key: &str) -> Option<u32> {
    Some(match key {
        "specversion" => 0,
        "id" => 1,
        "type" => 2,
        "queue" => 3,
        "args" => 4,
        "meta" => 5,
        "priority" => 6,
        "timeout" => 7,
        "scheduled_at" => 8,
        "expires_at" => 9,
        "retry" => 10,
        "unique" => 11,
        "schema" => 12,
        "state" => 13,
        "attempt" => 14,
        "created_at" => 15,
        "enqueued_at" => 16,
        "started_at" => 17,
        "completed_at" => 18,
        "error" => 19,
        "result" => 20,
        "total_timeout" => 21,
        "enqueue_ttl" => 22,
        "grace_period" => 23,
        "heartbeat_timeout" => 24,
        "result_ttl" => 25,
        "extensions" => 26,
        "errors" => 27,
        _ => return None,
    })
}

/// Reads the common envelope — valid, each attribute once — as the
/// general path ([`decode_object`] on the parsed object) does, but in one
/// pass over the text: no object of every attribute built first, no key
/// copied unless it is kept. `None` for anything else (a syntax error, an
/// invalid attribute, a key given twice, an envelope that fails
/// validation), which the general path reads again: its error, and its
/// reading of a repeated key (the last one), stay as they were.
fn read_in_one_pass(bytes: &[u8]) -> Option<JobEnvelope> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let job = serde::Deserializer::deserialize_map(&mut de, OnePass).ok()??;
    de.end().ok()?;
    job.validate().ok()?;
    Some(job)
}

struct OnePass;

impl<'de> serde::de::Visitor<'de> for OnePass {
    type Value = Option<JobEnvelope>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an OJS envelope object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut entries = EnvelopeEntries::new();
        while let Some(JsonKey(key)) = map.next_key::<JsonKey<'de>>()? {
            let v: Value = map.next_value()?;
            if !matches!(entries.set(key, v), Ok(true)) {
                return Ok(None);
            }
        }
        Ok(entries.into_unvalidated())
    }
}

/// An envelope read one attribute of its JSON object at a time, for a
/// reader that goes over the object's text once (a PUSH body's, which
/// holds other entries beside the envelope's): each attribute as the
/// general path reads it from a parsed object (`null` is absent for an
/// attribute the codec knows, an unknown one is kept as it is).
#[derive(Debug)]
pub struct EnvelopeEntries {
    job: JobEnvelope,
    /// The known attributes set so far, by their index.
    seen: u32,
    saw_args: bool,
}

impl Default for EnvelopeEntries {
    fn default() -> Self {
        Self::new()
    }
}

impl EnvelopeEntries {
    /// Nothing set yet.
    pub fn new() -> Self {
        EnvelopeEntries {
            job: blank(),
            seen: 0,
            saw_args: false,
        }
    }

    /// Sets the attribute `key` from `v`; `Ok(false)` when `key` was set
    /// already (what a key given twice means is the reader's to decide:
    /// a parsed object keeps the last).
    pub fn set(&mut self, key: std::borrow::Cow<'_, str>, v: Value) -> Result<bool> {
        match known_attribute(&key) {
            Some(bit) => {
                if self.seen & (1 << bit) != 0 {
                    return Ok(false);
                }
                self.seen |= 1 << bit;
                if !v.is_null() {
                    set_known(&mut self.job, &key, v, &mut self.saw_args)?;
                }
                Ok(true)
            }
            None => {
                if self.job.unknown_attributes.contains_key(key.as_ref()) {
                    return Ok(false);
                }
                let mut v = v;
                normalize_value(&mut v);
                self.job.unknown_attributes.insert(key.into_owned(), v);
                Ok(true)
            }
        }
    }

    /// Sets the attribute `key` from `v` (not `null`) whether or not it
    /// was set before, replacing what was.
    pub fn replace(&mut self, key: &str, v: Value) -> Result<()> {
        match known_attribute(key) {
            Some(bit) => {
                self.seen |= 1 << bit;
                set_known(&mut self.job, key, v, &mut self.saw_args)
            }
            None => {
                let mut v = v;
                normalize_value(&mut v);
                self.job.unknown_attributes.insert(key.to_owned(), v);
                Ok(())
            }
        }
    }

    /// Whether the attribute `key` was given (as `null` too).
    pub fn has(&self, key: &str) -> bool {
        match known_attribute(key) {
            Some(bit) => self.seen & (1 << bit) != 0,
            None => self.job.unknown_attributes.contains_key(key),
        }
    }

    /// The envelope, validated; an error as the general path's for a
    /// missing `args` or an invalid envelope.
    pub fn finish(self) -> Result<JobEnvelope> {
        if !self.saw_args {
            return Err(Error::MissingAttribute("args"));
        }
        self.job.validate()?;
        Ok(self.job)
    }

    fn into_unvalidated(self) -> Option<JobEnvelope> {
        self.saw_args.then_some(self.job)
    }
}

/// A key of a JSON object, borrowed from the text unless it holds an
/// escape: a one-pass reader's keys, without a copy of each.
#[derive(Debug)]
pub struct JsonKey<'de>(pub std::borrow::Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for JsonKey<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> serde::de::Visitor<'de> for KeyVisitor {
    type Value = JsonKey<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an attribute name")
    }

    fn visit_borrowed_str<E: serde::de::Error>(
        self,
        v: &'de str,
    ) -> std::result::Result<JsonKey<'de>, E> {
        Ok(JsonKey(std::borrow::Cow::Borrowed(v)))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<JsonKey<'de>, E> {
        Ok(JsonKey(std::borrow::Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> std::result::Result<JsonKey<'de>, E> {
        Ok(JsonKey(std::borrow::Cow::Owned(v)))
    }
}

/// An envelope with nothing set: the decoders fill it from the text.
fn blank() -> JobEnvelope {
    let mut job = JobEnvelope::with_id(String::new(), String::new(), Vec::new());
    job.specversion.clear();
    job
}

fn decode_object(map: Map<String, Value>) -> Result<JobEnvelope> {
    let mut job = blank();
    let mut saw_args = false;
    for (key, v) in map {
        match known_attribute(&key) {
            // null = absent (an unknown attribute keeps its null)
            Some(_) if v.is_null() => {}
            Some(_) => set_known(&mut job, &key, v, &mut saw_args)?,
            None => {
                let mut v = v;
                normalize_value(&mut v);
                job.unknown_attributes.insert(key, v);
            }
        }
    }
    if !saw_args {
        return Err(Error::MissingAttribute("args"));
    }
    Ok(job)
}

/// Sets the attribute `key` (one of [`KNOWN_ATTRIBUTES`], not `null`) of
/// `job` from `v`.
fn set_known(job: &mut JobEnvelope, key: &str, v: Value, saw_args: &mut bool) -> Result<()> {
    match key {
        "specversion" => job.specversion = want_string(key, v)?,
        "id" => job.id = want_string(key, v)?,
        "type" => job.job_type = want_string(key, v)?,
        "queue" => job.queue = want_string(key, v)?,
        "args" => match v {
            Value::Array(mut items) => {
                items.iter_mut().for_each(normalize_value);
                job.args = items;
                *saw_args = true;
            }
            other => {
                return Err(Error::invalid(
                    "args",
                    format!("must be a JSON array, got {}", kind_of(&other)),
                ))
            }
        },
        "meta" => {
            job.meta = want_object(key, v)?;
            job.meta.values_mut().for_each(normalize_value);
        }
        "priority" => job.priority = want_i32(key, &v)?,
        "timeout" => job.timeout = want_i32(key, &v)?,
        "scheduled_at" => job.scheduled_at = want_timestamp(key, v)?,
        "expires_at" => job.expires_at = want_timestamp(key, v)?,
        "retry" => job.retry = Some(decode_retry(want_object(key, v)?)?),
        "unique" => job.unique = Some(decode_unique(want_object(key, v)?)?),
        "schema" => {
            let s = want_string(key, v)?;
            job.schema = (!s.is_empty()).then_some(s);
        }
        "state" => {
            let s = want_string(key, v)?;
            job.state =
                Some(JobState::parse(&s).ok_or_else(|| {
                    Error::invalid("state", format!("{s:?} is not an OJS state"))
                })?);
        }
        "attempt" => job.attempt = want_i32(key, &v)?,
        "created_at" => job.created_at = want_timestamp(key, v)?,
        "enqueued_at" => job.enqueued_at = want_timestamp(key, v)?,
        "started_at" => job.started_at = want_timestamp(key, v)?,
        "completed_at" => job.completed_at = want_timestamp(key, v)?,
        "error" => job.error = Some(decode_error(want_object(key, v)?)?),
        "result" => {
            let mut v = v;
            normalize_value(&mut v);
            job.result = Some(v);
        }
        "total_timeout" => job.total_timeout = want_i32(key, &v)?,
        "enqueue_ttl" => job.enqueue_ttl = want_i32(key, &v)?,
        "grace_period" => job.grace_period = want_i32(key, &v)?,
        "heartbeat_timeout" => job.heartbeat_timeout = want_i32(key, &v)?,
        "result_ttl" => job.result_ttl = want_i32(key, &v)?,
        "extensions" => {
            job.extensions = want_object(key, v)?;
            job.extensions.values_mut().for_each(normalize_value);
        }
        "errors" => match v {
            Value::Array(mut items) => {
                items.iter_mut().for_each(normalize_value);
                job.errors = items;
            }
            other => {
                return Err(Error::invalid(
                    "errors",
                    format!("must be an array, got {}", kind_of(&other)),
                ))
            }
        },
        // Only the names above reach here.
        _ => {}
    }
    Ok(())
}

fn unknown_key(object: &str, key: &str) -> Error {
    Error::invalid(format!("{object}.{key}"), "unknown attribute")
}

fn decode_retry(map: Map<String, Value>) -> Result<RetryPolicy> {
    let mut p = RetryPolicy::default();
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let name = format!("retry.{key}");
        match key.as_str() {
            "max_attempts" => p.max_attempts = Some(want_i32(&name, &v)?),
            "initial_interval" => p.initial_interval = want_string(&name, v)?,
            "backoff_coefficient" => {
                p.backoff_coefficient = v
                    .as_f64()
                    .ok_or_else(|| Error::invalid(&name, format!("must be a number, got {v}")))?
            }
            "max_interval" => p.max_interval = want_string(&name, v)?,
            "jitter" => {
                p.jitter = v
                    .as_bool()
                    .ok_or_else(|| Error::invalid(&name, format!("must be a boolean, got {v}")))?
            }
            "non_retryable_errors" => p.non_retryable_errors = want_string_list(&name, v)?,
            "on_exhaustion" => p.on_exhaustion = want_string(&name, v)?,
            _ => return Err(unknown_key("retry", &key)),
        }
    }
    Ok(p)
}

fn decode_unique(map: Map<String, Value>) -> Result<UniquePolicy> {
    let mut p = UniquePolicy::default();
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let name = format!("unique.{key}");
        match key.as_str() {
            "keys" => p.keys = want_string_list(&name, v)?,
            "period" => p.period = want_string(&name, v)?,
            "on_conflict" => p.on_conflict = want_string(&name, v)?,
            "args_keys" => p.args_keys = want_string_list(&name, v)?,
            "meta_keys" => p.meta_keys = want_string_list(&name, v)?,
            "states" => p.states = want_string_list(&name, v)?,
            _ => return Err(unknown_key("unique", &key)),
        }
    }
    Ok(p)
}

fn decode_error(map: Map<String, Value>) -> Result<JobError> {
    let mut e = JobError::default();
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let name = format!("error.{key}");
        match key.as_str() {
            "type" => e.error_type = want_string(&name, v)?,
            "message" => e.message = want_string(&name, v)?,
            // ojs-core sends frames as an array; a single string is split on
            // newlines, which is also how protobuf carries them.
            "backtrace" => {
                e.backtrace = match v {
                    Value::String(s) => split_backtrace(&s),
                    other => want_string_list(&name, other)?,
                };
                if e.backtrace.iter().any(|f| f.contains('\n')) {
                    return Err(Error::invalid(&name, "frames must not contain newlines"));
                }
            }
            "timeout_kind" => e.timeout_kind = want_string(&name, v)?,
            "limit_seconds" => e.limit_seconds = want_i32(&name, &v)?,
            "elapsed_seconds" => e.elapsed_seconds = want_i32(&name, &v)?,
            _ => return Err(unknown_key("error", &key)),
        }
    }
    Ok(e)
}

// ---- encoding -----------------------------------------------------------------

struct JsonView<'a>(&'a JobEnvelope);
struct RetryView<'a>(&'a RetryPolicy);
struct UniqueView<'a>(&'a UniquePolicy);
struct ErrorView<'a>(&'a JobError);

/// Whether to write a key: every entry of an envelope's object asks it
/// first (see [`JobEnvelope::write_json_entries`]).
type Keep<'k> = &'k mut dyn FnMut(&str) -> bool;

/// A key of the envelope's object: its name, and its JSON text with the
/// colon after it, written once here (see [`crate::json_out::Object`]).
struct Key {
    name: &'static str,
    text: &'static str,
}

/// The [`Key`] of a name of plain letters, digits and `_`.
macro_rules! key {
    ($name:literal) => {
        &Key {
            name: $name,
            text: concat!("\"", $name, "\":"),
        }
    };
}

/// Where an envelope's entries go: a serializer's map, or an object
/// written straight into bytes.
trait Entries {
    type Error: serde::ser::Error;
    fn entry<V: Serialize + ?Sized>(
        &mut self,
        key: &Key,
        v: &V,
    ) -> std::result::Result<(), Self::Error>;
    fn entry_time(
        &mut self,
        key: &Key,
        t: &DateTime<Utc>,
        times: SecondsFormat,
    ) -> std::result::Result<(), Self::Error> {
        crate::timestamp::with_rfc3339(t, times, |text| self.entry(key, text))
    }
    /// An entry whose key the input gave (an unknown attribute).
    fn entry_named<V: Serialize + ?Sized>(
        &mut self,
        key: &str,
        v: &V,
    ) -> std::result::Result<(), Self::Error>;
}

struct MapEntries<'m, M>(&'m mut M);

impl<M: SerializeMap> Entries for MapEntries<'_, M> {
    type Error = M::Error;
    fn entry<V: Serialize + ?Sized>(
        &mut self,
        key: &Key,
        v: &V,
    ) -> std::result::Result<(), M::Error> {
        self.0.serialize_entry(key.name, v)
    }
    fn entry_named<V: Serialize + ?Sized>(
        &mut self,
        key: &str,
        v: &V,
    ) -> std::result::Result<(), M::Error> {
        self.0.serialize_entry(key, v)
    }
}

impl Entries for crate::json_out::Object<'_> {
    type Error = crate::json_out::Error;
    fn entry<V: Serialize + ?Sized>(
        &mut self,
        key: &Key,
        v: &V,
    ) -> std::result::Result<(), Self::Error> {
        self.key_text(key.text);
        self.value(v)
    }
    fn entry_time(
        &mut self,
        key: &Key,
        t: &DateTime<Utc>,
        times: SecondsFormat,
    ) -> std::result::Result<(), Self::Error> {
        self.key_text(key.text);
        self.time_value(t, times);
        Ok(())
    }
    fn entry_named<V: Serialize + ?Sized>(
        &mut self,
        key: &str,
        v: &V,
    ) -> std::result::Result<(), Self::Error> {
        self.key(key);
        self.value(v)
    }
}

fn put<E: Entries, V: Serialize + ?Sized>(
    e: &mut E,
    keep: Keep<'_>,
    k: &Key,
    v: &V,
) -> std::result::Result<(), E::Error> {
    if keep(k.name) {
        e.entry(k, v)?;
    }
    Ok(())
}

fn put_ts<E: Entries>(
    e: &mut E,
    keep: Keep<'_>,
    k: &Key,
    t: &Option<DateTime<Utc>>,
    times: SecondsFormat,
) -> std::result::Result<(), E::Error> {
    if let Some(t) = t {
        if keep(k.name) {
            e.entry_time(k, t, times)?;
        }
    }
    Ok(())
}

fn put_i32<E: Entries>(
    e: &mut E,
    keep: Keep<'_>,
    k: &Key,
    v: i32,
) -> std::result::Result<(), E::Error> {
    if v != 0 {
        put(e, keep, k, &v)?;
    }
    Ok(())
}

/// A string entry of a map, written when not empty (the nested policies'
/// fields).
fn put_str<M: SerializeMap>(m: &mut M, k: &str, v: &str) -> std::result::Result<(), M::Error> {
    if !v.is_empty() {
        m.serialize_entry(k, v)?;
    }
    Ok(())
}

/// [`put_str`] of the envelope's own entries.
fn put_nonempty<E: Entries>(
    e: &mut E,
    keep: Keep<'_>,
    k: &Key,
    v: &str,
) -> std::result::Result<(), E::Error> {
    if !v.is_empty() {
        put(e, keep, k, v)?;
    }
    Ok(())
}

impl Serialize for JsonView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        write_entries(
            self.0,
            &mut MapEntries(&mut m),
            SecondsFormat::AutoSi,
            &mut |_| true,
        )?;
        m.end()
    }
}

fn write_entries<E: Entries>(
    j: &JobEnvelope,
    m: &mut E,
    times: SecondsFormat,
    keep: Keep<'_>,
) -> std::result::Result<(), E::Error> {
    use serde::ser::Error as _;
    put(m, keep, key!("specversion"), &j.specversion)?;
    put(m, keep, key!("id"), &j.id)?;
    put(m, keep, key!("type"), &j.job_type)?;
    put(m, keep, key!("queue"), &j.queue)?;
    put(m, keep, key!("args"), &j.args)?;
    if !j.meta.is_empty() {
        put(m, keep, key!("meta"), &j.meta)?;
    }
    put_i32(m, keep, key!("priority"), j.priority)?;
    put_i32(m, keep, key!("timeout"), j.timeout)?;
    put_ts(
        m,
        keep,
        key!("scheduled_at"),
        &j.scheduled_at,
        SecondsFormat::AutoSi,
    )?;
    put_ts(
        m,
        keep,
        key!("expires_at"),
        &j.expires_at,
        SecondsFormat::AutoSi,
    )?;
    if let Some(p) = &j.retry {
        put(m, keep, key!("retry"), &RetryView(p))?;
    }
    if let Some(p) = &j.unique {
        put(m, keep, key!("unique"), &UniqueView(p))?;
    }
    if let Some(schema) = &j.schema {
        put_nonempty(m, keep, key!("schema"), schema)?;
    }
    if let Some(state) = j.state {
        let name = state.as_str().ok_or_else(|| {
            E::Error::custom(format!(
                "state {} is unknown to this build and has no JSON name",
                state.to_i32()
            ))
        })?;
        put(m, keep, key!("state"), name)?;
    }
    put_i32(m, keep, key!("attempt"), j.attempt)?;
    put_ts(m, keep, key!("created_at"), &j.created_at, times)?;
    put_ts(m, keep, key!("enqueued_at"), &j.enqueued_at, times)?;
    put_ts(m, keep, key!("started_at"), &j.started_at, times)?;
    put_ts(m, keep, key!("completed_at"), &j.completed_at, times)?;
    if let Some(e) = &j.error {
        put(m, keep, key!("error"), &ErrorView(e))?;
    }
    if let Some(r) = &j.result {
        put(m, keep, key!("result"), r)?;
    }
    put_i32(m, keep, key!("total_timeout"), j.total_timeout)?;
    put_i32(m, keep, key!("enqueue_ttl"), j.enqueue_ttl)?;
    put_i32(m, keep, key!("grace_period"), j.grace_period)?;
    put_i32(m, keep, key!("heartbeat_timeout"), j.heartbeat_timeout)?;
    put_i32(m, keep, key!("result_ttl"), j.result_ttl)?;
    if !j.extensions.is_empty() {
        put(m, keep, key!("extensions"), &j.extensions)?;
    }
    if !j.errors.is_empty() {
        put(m, keep, key!("errors"), &j.errors)?;
    }
    for (k, v) in &j.unknown_attributes {
        if keep(k) {
            m.entry_named(k, v)?;
        }
    }
    Ok(())
}

impl Serialize for RetryView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let p = self.0;
        let mut m = s.serialize_map(None)?;
        if let Some(n) = p.max_attempts {
            m.serialize_entry("max_attempts", &n)?;
        }
        put_str(&mut m, "initial_interval", &p.initial_interval)?;
        if p.backoff_coefficient != 0.0 {
            m.serialize_entry("backoff_coefficient", &p.backoff_coefficient)?;
        }
        put_str(&mut m, "max_interval", &p.max_interval)?;
        // Always written: JSON without it means `true`.
        m.serialize_entry("jitter", &p.jitter)?;
        if !p.non_retryable_errors.is_empty() {
            m.serialize_entry("non_retryable_errors", &p.non_retryable_errors)?;
        }
        put_str(&mut m, "on_exhaustion", &p.on_exhaustion)?;
        m.end()
    }
}

impl Serialize for UniqueView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let p = self.0;
        let mut m = s.serialize_map(None)?;
        if !p.keys.is_empty() {
            m.serialize_entry("keys", &p.keys)?;
        }
        put_str(&mut m, "period", &p.period)?;
        put_str(&mut m, "on_conflict", &p.on_conflict)?;
        for (k, list) in [
            ("args_keys", &p.args_keys),
            ("meta_keys", &p.meta_keys),
            ("states", &p.states),
        ] {
            if !list.is_empty() {
                m.serialize_entry(k, list)?;
            }
        }
        m.end()
    }
}

impl Serialize for ErrorView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let e = self.0;
        let mut m = s.serialize_map(None)?;
        put_str(&mut m, "type", &e.error_type)?;
        put_str(&mut m, "message", &e.message)?;
        if !e.backtrace.is_empty() {
            m.serialize_entry("backtrace", &e.backtrace)?;
        }
        put_str(&mut m, "timeout_kind", &e.timeout_kind)?;
        if e.limit_seconds != 0 {
            m.serialize_entry("limit_seconds", &e.limit_seconds)?;
        }
        if e.elapsed_seconds != 0 {
            m.serialize_entry("elapsed_seconds", &e.elapsed_seconds)?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_attributes_are_the_listed_ones() {
        for (i, name) in KNOWN_ATTRIBUTES.iter().enumerate() {
            assert_eq!(known_attribute(name), u32::try_from(i).ok(), "{name}");
        }
        for name in ["", "ID", "args ", "x-known", "tags", "priorities"] {
            assert_eq!(known_attribute(name), None, "{name}");
        }
    }

    #[test]
    fn every_known_attribute_is_read_into_its_field() {
        let mut job = JobEnvelope::with_id(
            "019438a2-7c1e-7000-8000-000000000001".to_owned(),
            "a.b",
            Vec::new(),
        );
        // `blank()` leaves every field empty; each listed attribute, set,
        // must leave the unknown ones empty too.
        for name in KNOWN_ATTRIBUTES {
            let mut saw_args = false;
            let value = match name {
                "args" | "errors" => serde_json::json!([]),
                "meta" | "extensions" | "retry" | "unique" => serde_json::json!({}),
                "error" => serde_json::json!({"type": "t"}),
                "state" => serde_json::json!("active"),
                n if n.ends_with("_at") => serde_json::json!("2026-11-30T03:04:05Z"),
                "priority" | "timeout" | "attempt" | "total_timeout" | "enqueue_ttl"
                | "grace_period" | "heartbeat_timeout" | "result_ttl" => serde_json::json!(1),
                _ => serde_json::json!("1.0"),
            };
            set_known(&mut job, name, value, &mut saw_args).unwrap();
            assert!(job.unknown_attributes.is_empty(), "{name}");
        }
    }
}
