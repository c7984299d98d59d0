//! `application/openjobspec+proto`: the envelope as one binary `JobEnvelope`.
//!
//! Hand-written on the wire primitives so that fields this build does not
//! know are kept byte-for-byte (docs/design.md §3). Known fields
//! are written in field-number order, exactly as prost writes them, so
//! envelopes produced by any prost-based peer re-encode to identical bytes;
//! unknown fields follow the known ones.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::envelope::value::{self, Path};
use crate::envelope::wire::{self, Reader, WT_I64, WT_LEN, WT_VARINT};
use crate::envelope::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy, DEFAULT_QUEUE};
use crate::error::{Error, Result};

impl JobEnvelope {
    /// Decodes and validates one binary `JobEnvelope`.
    pub fn from_proto_bytes(bytes: &[u8]) -> Result<Self> {
        let job = decode_envelope(&mut Reader::new(bytes))?;
        job.validate()?;
        Ok(job)
    }

    /// Decodes one binary `JobEnvelope` without validating it: for a
    /// producer's request in which the server fills `id`, `specversion` and
    /// the system fields before it calls [`JobEnvelope::validate`].
    pub fn from_proto_bytes_unvalidated(bytes: &[u8]) -> Result<Self> {
        decode_envelope(&mut Reader::new(bytes))
    }

    /// Validates and encodes as one binary `JobEnvelope`.
    pub fn to_proto_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.encode_proto_into(&mut out)?;
        Ok(out)
    }

    /// Validates and appends the binary encoding to `out`.
    pub fn encode_proto_into(&self, out: &mut Vec<u8>) -> Result<()> {
        self.validate()?;
        out.reserve(envelope_len(self));
        put_envelope(out, self);
        Ok(())
    }

    /// Exact size of the binary encoding (valid envelopes only).
    pub fn proto_encoded_len(&self) -> usize {
        envelope_len(self)
    }

    /// The `id` of one binary `JobEnvelope`, read without decoding or
    /// validating anything else: the last `id` on the wire, the one
    /// decoding keeps. `None` when the bytes are no well-formed message,
    /// carry no id or an id of the wrong wire type (decoding says why).
    pub fn proto_id(bytes: &[u8]) -> Option<&str> {
        let mut r = Reader::new(bytes);
        let mut id = None;
        while !r.is_empty() {
            let (field, wt) = r.key().ok()?;
            match (field, wt) {
                (2, WT_LEN) => id = Some(r.string().ok()?),
                (2, _) => return None,
                _ => r.skip(field, wt).ok()?,
            }
        }
        id.filter(|id| !id.is_empty())
    }
}

// ---- decoding -----------------------------------------------------------------

fn decode_envelope(r: &mut Reader<'_>) -> Result<JobEnvelope> {
    let mut job = JobEnvelope {
        specversion: String::new(),
        id: String::new(),
        job_type: String::new(),
        queue: String::new(),
        args: Vec::new(),
        meta: Map::new(),
        priority: 0,
        timeout: 0,
        scheduled_at: None,
        expires_at: None,
        retry: None,
        unique: None,
        schema: None,
        state: None,
        attempt: 0,
        created_at: None,
        enqueued_at: None,
        started_at: None,
        completed_at: None,
        error: None,
        result: None,
        total_timeout: 0,
        enqueue_ttl: 0,
        grace_period: 0,
        heartbeat_timeout: 0,
        result_ttl: 0,
        extensions: Map::new(),
        errors: Vec::new(),
        unknown_fields: Vec::new(),
        unknown_attributes: Map::new(),
    };
    let args_path = Path::Root("args");
    while !r.is_empty() {
        let start = r.pos();
        let (field, wt) = r.key()?;
        match field {
            1 => job.specversion = read_string(r, "specversion", wt)?,
            2 => job.id = read_string(r, "id", wt)?,
            3 => job.job_type = read_string(r, "type", wt)?,
            4 => job.queue = read_string(r, "queue", wt)?,
            5 => {
                r.expect("args", wt, WT_LEN)?;
                let mut sub = r.sub()?;
                let p = Path::Index(&args_path, job.args.len());
                job.args.push(value::read_value(&mut sub, &p, 1)?);
            }
            6 => read_map_field(r, "meta", wt, &mut job.meta)?,
            7 => job.priority = read_int32(r, "priority", wt)?,
            8 => job.timeout = read_int32(r, "timeout", wt)?,
            9 => job.scheduled_at = read_timestamp(r, "scheduled_at", wt)?,
            10 => job.expires_at = read_timestamp(r, "expires_at", wt)?,
            11 => {
                r.expect("retry", wt, WT_LEN)?;
                let retry = job.retry.get_or_insert_with(|| RetryPolicy {
                    jitter: false,
                    ..RetryPolicy::default()
                });
                decode_retry(&mut r.sub()?, retry)?;
            }
            12 => {
                r.expect("unique", wt, WT_LEN)?;
                let unique = job.unique.get_or_insert_with(UniquePolicy::default);
                decode_unique(&mut r.sub()?, unique)?;
            }
            13 => {
                let s = read_string(r, "schema", wt)?;
                job.schema = (!s.is_empty()).then_some(s);
            }
            14 => job.state = JobState::from_i32(read_int32(r, "state", wt)?),
            15 => job.attempt = read_int32(r, "attempt", wt)?,
            16 => job.created_at = read_timestamp(r, "created_at", wt)?,
            17 => job.enqueued_at = read_timestamp(r, "enqueued_at", wt)?,
            18 => job.started_at = read_timestamp(r, "started_at", wt)?,
            19 => job.completed_at = read_timestamp(r, "completed_at", wt)?,
            20 => {
                r.expect("error", wt, WT_LEN)?;
                let error = job.error.get_or_insert_with(JobError::default);
                decode_error(&mut r.sub()?, error)?;
            }
            21 => {
                r.expect("result", wt, WT_LEN)?;
                let v = value::read_value(&mut r.sub()?, &Path::Root("result"), 0)?;
                // JSON cannot tell null from absent; neither do we.
                job.result = (!v.is_null()).then_some(v);
            }
            22 => read_map_field(r, "attributes", wt, &mut job.unknown_attributes)?,
            23 => {
                r.expect("errors", wt, WT_LEN)?;
                let mut sub = r.sub()?;
                let errors_path = Path::Root("errors");
                let p = Path::Index(&errors_path, job.errors.len());
                job.errors.push(value::read_value(&mut sub, &p, 1)?);
            }
            100 => job.total_timeout = read_int32(r, "total_timeout", wt)?,
            101 => job.enqueue_ttl = read_int32(r, "enqueue_ttl", wt)?,
            102 => job.grace_period = read_int32(r, "grace_period", wt)?,
            103 => job.heartbeat_timeout = read_int32(r, "heartbeat_timeout", wt)?,
            104 => job.result_ttl = read_int32(r, "result_ttl", wt)?,
            200 => read_map_field(r, "extensions", wt, &mut job.extensions)?,
            _ => {
                r.skip(field, wt)?;
                job.unknown_fields
                    .extend_from_slice(r.slice(start, r.pos()));
            }
        }
    }
    if job.queue.is_empty() {
        job.queue = DEFAULT_QUEUE.to_owned();
    }
    Ok(job)
}

fn read_string(r: &mut Reader<'_>, name: &str, wt: u8) -> Result<String> {
    r.expect(name, wt, WT_LEN)?;
    Ok(r.string()?.to_owned())
}

fn read_int32(r: &mut Reader<'_>, name: &str, wt: u8) -> Result<i32> {
    r.expect(name, wt, WT_VARINT)?;
    // int32 is sign-extended on the wire; truncation is the protobuf rule.
    Ok(r.varint()? as i32)
}

fn read_map_field(
    r: &mut Reader<'_>,
    name: &'static str,
    wt: u8,
    map: &mut Map<String, Value>,
) -> Result<()> {
    r.expect(name, wt, WT_LEN)?;
    let mut entry = r.sub()?;
    let (k, v) = value::read_map_entry(&mut entry, &Path::Root(name), 1)?;
    map.insert(k, v);
    Ok(())
}

fn read_timestamp(r: &mut Reader<'_>, name: &str, wt: u8) -> Result<Option<DateTime<Utc>>> {
    r.expect(name, wt, WT_LEN)?;
    let at = r.offset();
    let mut sub = r.sub()?;
    let (mut seconds, mut nanos) = (0i64, 0i32);
    while !sub.is_empty() {
        let (field, wt) = sub.key()?;
        match field {
            1 => {
                sub.expect("seconds", wt, WT_VARINT)?;
                seconds = sub.varint()? as i64;
            }
            2 => {
                sub.expect("nanos", wt, WT_VARINT)?;
                nanos = sub.varint()? as i32;
            }
            _ => sub.skip(field, wt)?,
        }
    }
    timestamp_from_parts(seconds, nanos)
        .map_err(|reason| Error::malformed(at, format!("`{name}`: {reason}")))
}

/// The protobuf epoch means "unset" (docs/design.md §3).
pub(crate) fn timestamp_from_parts(
    seconds: i64,
    nanos: i32,
) -> std::result::Result<Option<DateTime<Utc>>, String> {
    if seconds == 0 && nanos == 0 {
        return Ok(None);
    }
    let nanos = u32::try_from(nanos)
        .ok()
        .filter(|n| *n < 1_000_000_000)
        .ok_or_else(|| format!("nanos {nanos} outside 0..1e9"))?;
    // google.protobuf.Timestamp is limited to years 0001..=9999.
    if !(-62_135_596_800..=253_402_300_799).contains(&seconds) {
        return Err(format!("seconds {seconds} outside 0001-01-01..9999-12-31"));
    }
    DateTime::from_timestamp(seconds, nanos)
        .map(Some)
        .ok_or_else(|| format!("seconds {seconds} out of range"))
}

fn decode_retry(r: &mut Reader<'_>, p: &mut RetryPolicy) -> Result<()> {
    while !r.is_empty() {
        let start = r.pos();
        let (field, wt) = r.key()?;
        match field {
            1 => p.max_attempts = Some(read_int32(r, "retry.max_attempts", wt)?),
            2 => p.initial_interval = read_string(r, "retry.initial_interval", wt)?,
            3 => {
                r.expect("retry.backoff_coefficient", wt, WT_I64)?;
                p.backoff_coefficient = f64::from_bits(r.fixed64()?);
            }
            4 => p.max_interval = read_string(r, "retry.max_interval", wt)?,
            5 => {
                r.expect("retry.jitter", wt, WT_VARINT)?;
                p.jitter = r.varint()? != 0;
            }
            6 => p
                .non_retryable_errors
                .push(read_string(r, "retry.non_retryable_errors", wt)?),
            7 => p.on_exhaustion = read_string(r, "retry.on_exhaustion", wt)?,
            _ => {
                r.skip(field, wt)?;
                p.unknown_fields.extend_from_slice(r.slice(start, r.pos()));
            }
        }
    }
    Ok(())
}

fn decode_unique(r: &mut Reader<'_>, p: &mut UniquePolicy) -> Result<()> {
    while !r.is_empty() {
        let start = r.pos();
        let (field, wt) = r.key()?;
        match field {
            1 => p.keys.push(read_string(r, "unique.keys", wt)?),
            2 => p.period = read_string(r, "unique.period", wt)?,
            3 => p.on_conflict = read_string(r, "unique.on_conflict", wt)?,
            4 => p.args_keys.push(read_string(r, "unique.args_keys", wt)?),
            5 => p.meta_keys.push(read_string(r, "unique.meta_keys", wt)?),
            6 => p.states.push(read_string(r, "unique.states", wt)?),
            _ => {
                r.skip(field, wt)?;
                p.unknown_fields.extend_from_slice(r.slice(start, r.pos()));
            }
        }
    }
    Ok(())
}

fn decode_error(r: &mut Reader<'_>, e: &mut JobError) -> Result<()> {
    while !r.is_empty() {
        let start = r.pos();
        let (field, wt) = r.key()?;
        match field {
            1 => e.error_type = read_string(r, "error.type", wt)?,
            2 => e.message = read_string(r, "error.message", wt)?,
            3 => {
                let s = read_string(r, "error.backtrace", wt)?;
                e.backtrace = split_backtrace(&s);
            }
            4 => e.timeout_kind = read_string(r, "error.timeout_kind", wt)?,
            5 => e.limit_seconds = read_int32(r, "error.limit_seconds", wt)?,
            6 => e.elapsed_seconds = read_int32(r, "error.elapsed_seconds", wt)?,
            _ => {
                r.skip(field, wt)?;
                e.unknown_fields.extend_from_slice(r.slice(start, r.pos()));
            }
        }
    }
    Ok(())
}

pub(crate) fn split_backtrace(s: &str) -> Vec<String> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('\n').map(str::to_owned).collect()
    }
}

// ---- encoding -----------------------------------------------------------------

/// A `google.protobuf.Timestamp`'s two fields: seconds and nanoseconds.
/// A timestamp as protobuf writes it: seconds and nanoseconds.
pub type TimestampParts = (i64, i32);

fn parts(t: &DateTime<Utc>) -> TimestampParts {
    (t.timestamp(), t.timestamp_subsec_nanos() as i32)
}

fn timestamp_body_len((seconds, nanos): TimestampParts) -> usize {
    wire::int64_len(1, seconds) + wire::int32_len(2, nanos)
}

pub(crate) fn timestamp_len(field: u32, t: &Option<DateTime<Utc>>) -> usize {
    timestamp_parts_len(field, t.as_ref().map(parts))
}

pub(crate) fn put_timestamp(out: &mut Vec<u8>, field: u32, t: &Option<DateTime<Utc>>) {
    put_timestamp_parts(out, field, t.as_ref().map(parts));
}

/// [`timestamp_len`] of a time already in seconds and nanoseconds.
#[inline]
pub fn timestamp_parts_len(field: u32, t: Option<TimestampParts>) -> usize {
    t.map_or(0, |t| wire::len_field_len(field, timestamp_body_len(t)))
}

/// [`put_timestamp`] of a time already in seconds and nanoseconds.
#[inline]
pub fn put_timestamp_parts(out: &mut Vec<u8>, field: u32, t: Option<TimestampParts>) {
    if let Some(t @ (seconds, nanos)) = t {
        wire::put_len_header(out, field, timestamp_body_len(t));
        wire::put_int64(out, 1, seconds);
        wire::put_int32(out, 2, nanos);
    }
}

fn map_len(field: u32, map: &Map<String, Value>) -> usize {
    map.iter()
        .map(|(k, v)| wire::len_field_len(field, value::map_entry_body_len(k, v)))
        .sum()
}

fn retry_body_len(p: &RetryPolicy) -> usize {
    wire::optional_int32_len(1, p.max_attempts)
        + wire::string_len(2, &p.initial_interval)
        + wire::double_len(3, p.backoff_coefficient)
        + wire::string_len(4, &p.max_interval)
        + wire::bool_len(5, p.jitter)
        + p.non_retryable_errors
            .iter()
            .map(|s| wire::len_field_len(6, s.len()))
            .sum::<usize>()
        + wire::string_len(7, &p.on_exhaustion)
        + p.unknown_fields.len()
}

fn strings_len(field: u32, items: &[String]) -> usize {
    items
        .iter()
        .map(|s| wire::len_field_len(field, s.len()))
        .sum()
}

fn put_strings(out: &mut Vec<u8>, field: u32, items: &[String]) {
    for s in items {
        wire::put_len_header(out, field, s.len());
        out.extend_from_slice(s.as_bytes());
    }
}

fn unique_body_len(p: &UniquePolicy) -> usize {
    strings_len(1, &p.keys)
        + wire::string_len(2, &p.period)
        + wire::string_len(3, &p.on_conflict)
        + strings_len(4, &p.args_keys)
        + strings_len(5, &p.meta_keys)
        + strings_len(6, &p.states)
        + p.unknown_fields.len()
}

fn backtrace_len(frames: &[String]) -> usize {
    if frames.is_empty() {
        0
    } else {
        frames.iter().map(String::len).sum::<usize>() + frames.len() - 1
    }
}

fn error_body_len(e: &JobError) -> usize {
    let bt = backtrace_len(&e.backtrace);
    wire::string_len(1, &e.error_type)
        + wire::string_len(2, &e.message)
        + if bt == 0 {
            0
        } else {
            wire::len_field_len(3, bt)
        }
        + wire::string_len(4, &e.timeout_kind)
        + wire::int32_len(5, e.limit_seconds)
        + wire::int32_len(6, e.elapsed_seconds)
        + e.unknown_fields.len()
}

fn envelope_len(j: &JobEnvelope) -> usize {
    wire::string_len(1, &j.specversion)
        + wire::string_len(2, &j.id)
        + wire::string_len(3, &j.job_type)
        + wire::string_len(4, &j.queue)
        + j.args
            .iter()
            .map(|v| wire::len_field_len(5, value::value_body_len(v)))
            .sum::<usize>()
        + map_len(6, &j.meta)
        + wire::int32_len(7, j.priority)
        + wire::int32_len(8, j.timeout)
        + timestamp_len(9, &j.scheduled_at)
        + timestamp_len(10, &j.expires_at)
        + j.retry
            .as_ref()
            .map_or(0, |p| wire::len_field_len(11, retry_body_len(p)))
        + j.unique
            .as_ref()
            .map_or(0, |p| wire::len_field_len(12, unique_body_len(p)))
        + j.schema.as_deref().map_or(0, |s| wire::string_len(13, s))
        + wire::int32_len(14, j.state.map_or(0, JobState::to_i32))
        + wire::int32_len(15, j.attempt)
        + timestamp_len(16, &j.created_at)
        + timestamp_len(17, &j.enqueued_at)
        + timestamp_len(18, &j.started_at)
        + timestamp_len(19, &j.completed_at)
        + j.error
            .as_ref()
            .map_or(0, |e| wire::len_field_len(20, error_body_len(e)))
        + j.result
            .as_ref()
            .map_or(0, |v| wire::len_field_len(21, value::value_body_len(v)))
        + map_len(22, &j.unknown_attributes)
        + j.errors
            .iter()
            .map(|v| wire::len_field_len(23, value::value_body_len(v)))
            .sum::<usize>()
        + wire::int32_len(100, j.total_timeout)
        + wire::int32_len(101, j.enqueue_ttl)
        + wire::int32_len(102, j.grace_period)
        + wire::int32_len(103, j.heartbeat_timeout)
        + wire::int32_len(104, j.result_ttl)
        + map_len(200, &j.extensions)
        + j.unknown_fields.len()
}

fn put_envelope(out: &mut Vec<u8>, j: &JobEnvelope) {
    wire::put_string(out, 1, &j.specversion);
    wire::put_string(out, 2, &j.id);
    wire::put_string(out, 3, &j.job_type);
    wire::put_string(out, 4, &j.queue);
    for v in &j.args {
        value::put_value_field(out, 5, v);
    }
    for (k, v) in &j.meta {
        value::put_map_entry(out, 6, k, v);
    }
    wire::put_int32(out, 7, j.priority);
    wire::put_int32(out, 8, j.timeout);
    put_timestamp(out, 9, &j.scheduled_at);
    put_timestamp(out, 10, &j.expires_at);
    if let Some(p) = &j.retry {
        wire::put_len_header(out, 11, retry_body_len(p));
        wire::put_optional_int32(out, 1, p.max_attempts);
        wire::put_string(out, 2, &p.initial_interval);
        wire::put_double(out, 3, p.backoff_coefficient);
        wire::put_string(out, 4, &p.max_interval);
        wire::put_bool(out, 5, p.jitter);
        for s in &p.non_retryable_errors {
            wire::put_len_header(out, 6, s.len());
            out.extend_from_slice(s.as_bytes());
        }
        wire::put_string(out, 7, &p.on_exhaustion);
        out.extend_from_slice(&p.unknown_fields);
    }
    if let Some(p) = &j.unique {
        wire::put_len_header(out, 12, unique_body_len(p));
        put_strings(out, 1, &p.keys);
        wire::put_string(out, 2, &p.period);
        wire::put_string(out, 3, &p.on_conflict);
        put_strings(out, 4, &p.args_keys);
        put_strings(out, 5, &p.meta_keys);
        put_strings(out, 6, &p.states);
        out.extend_from_slice(&p.unknown_fields);
    }
    if let Some(s) = &j.schema {
        wire::put_string(out, 13, s);
    }
    wire::put_int32(out, 14, j.state.map_or(0, JobState::to_i32));
    wire::put_int32(out, 15, j.attempt);
    put_timestamp(out, 16, &j.created_at);
    put_timestamp(out, 17, &j.enqueued_at);
    put_timestamp(out, 18, &j.started_at);
    put_timestamp(out, 19, &j.completed_at);
    if let Some(e) = &j.error {
        wire::put_len_header(out, 20, error_body_len(e));
        wire::put_string(out, 1, &e.error_type);
        wire::put_string(out, 2, &e.message);
        let bt = backtrace_len(&e.backtrace);
        if bt > 0 {
            wire::put_len_header(out, 3, bt);
            for (i, frame) in e.backtrace.iter().enumerate() {
                if i > 0 {
                    out.push(b'\n');
                }
                out.extend_from_slice(frame.as_bytes());
            }
        }
        wire::put_string(out, 4, &e.timeout_kind);
        wire::put_int32(out, 5, e.limit_seconds);
        wire::put_int32(out, 6, e.elapsed_seconds);
        out.extend_from_slice(&e.unknown_fields);
    }
    if let Some(v) = &j.result {
        value::put_value_field(out, 21, v);
    }
    for (k, v) in &j.unknown_attributes {
        value::put_map_entry(out, 22, k, v);
    }
    for v in &j.errors {
        value::put_value_field(out, 23, v);
    }
    wire::put_int32(out, 100, j.total_timeout);
    wire::put_int32(out, 101, j.enqueue_ttl);
    wire::put_int32(out, 102, j.grace_period);
    wire::put_int32(out, 103, j.heartbeat_timeout);
    wire::put_int32(out, 104, j.result_ttl);
    for (k, v) in &j.extensions {
        value::put_map_entry(out, 200, k, v);
    }
    out.extend_from_slice(&j.unknown_fields);
}
