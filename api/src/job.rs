//! A job as the HTTP binding receives and shows it, and as the broker
//! carries it.
//!
//! A PUSH body (`type`, `args`, `id`, `meta`, `schema`, `options`) becomes
//! one [`JobEnvelope`]: `options.queue`, `priority`, `delay_until` /
//! `scheduled_at`, `expires_at`, `retry` and `unique` are the envelope's own
//! attributes; `tags`, `timeout_ms` and `visibility_timeout_ms`, which the
//! envelope has no field for, travel as top-level attributes (which every
//! OJS reader keeps), so a job read off the broker still has them. The
//! envelope is validated by the same code as every envelope the bridge
//! decodes (`ojs-bridge convert` applies it too).

use chrono::{DateTime, SecondsFormat, Utc};
use ojs_core::duration::{format_iso8601_duration, parse_iso8601_duration};
use ojs_core::{JobEnvelope, JobState};
use ojs_queue::settings::suggestion;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// The range of `options.priority` (job-options schema).
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i64> = -100..=100;
/// `max_attempts` when a job names none (ojs-retry).
pub const DEFAULT_MAX_ATTEMPTS: i32 = 3;

/// `options` a PUSH takes.
const OPTIONS: [&str; 12] = [
    "queue",
    "priority",
    "timeout_ms",
    "delay_until",
    "scheduled_at",
    "expires_at",
    "retry",
    "unique",
    "tags",
    "visibility_timeout_ms",
    "pending",
    "rate_limit",
];

/// Attributes only the server sets; a client's values are replaced.
const SYSTEM_ATTRIBUTES: [&str; 10] = [
    "state",
    "attempt",
    "created_at",
    "enqueued_at",
    "started_at",
    "completed_at",
    "error",
    "errors",
    "result",
    "max_attempts",
];

/// Lifecycle timestamps and notes the envelope has no field for, kept by
/// the store beside it and shown with the job.
pub type Extra = Map<String, Value>;

/// A job as stored: the envelope (state, attempt and the core timestamps
/// included) and the binding's other fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The envelope as it goes to the broker.
    pub envelope: JobEnvelope,
    /// `cancelled_at`, `previous_state`, … (see [`Extra`]).
    pub extra: Extra,
}

impl Job {
    /// The job's state.
    pub fn state(&self) -> JobState {
        self.envelope.state.unwrap_or(JobState::Available)
    }

    /// Whether the job is a dead letter: discarded into its queue's
    /// dead-letter path (`dead_letter: true`), not dropped.
    pub fn is_dead_letter(&self) -> bool {
        self.state() == JobState::Discarded
            && self.extra.get("dead_letter").and_then(Value::as_bool) == Some(true)
    }

    /// The store's mark of the job: 1 a dead letter, 2 a retried dead
    /// letter the broker has not confirmed yet, else 0.
    pub(crate) fn store_mark(&self) -> i16 {
        if self.is_dead_letter() {
            1
        } else if self.extra.contains_key(crate::dead::PUBLISHING) {
            2
        } else {
            0
        }
    }

    /// The binding's Job object.
    pub fn to_json(&self) -> Value {
        use serde::ser::{SerializeMap, Serializer};
        // The envelope's entries as [`JobJson`] writes them (the lifecycle
        // times with milliseconds). Every stored envelope was validated
        // before it was stored.
        let entries = serde_json::value::Serializer
            .serialize_map(None)
            .and_then(|mut m| {
                self.envelope
                    .write_json_entries(&mut m, SecondsFormat::Millis, |_| true)?;
                m.end()
            });
        let mut v = match entries {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        v.entry("meta").or_insert_with(|| json!({}));
        v.entry("priority").or_insert(json!(0));
        v.entry("attempt").or_insert(json!(0));
        v.entry("tags").or_insert_with(|| json!([]));
        v.insert("max_attempts".into(), json!(max_attempts(&self.envelope)));
        for (k, x) in &self.extra {
            // The store's outbox mark is the server's, not the job's.
            if k != crate::dead::PUBLISHING {
                v.insert(k.clone(), x.clone());
            }
        }
        Value::Object(v)
    }
}

/// The binding's Job object written straight into bytes: the entries of
/// [`Job::to_json`] (in another order) without building a `Value` tree
/// first, which with writing and dropping it was a tenth of a FETCH +
/// ACK's instructions. Unlike `to_json` it does not validate the envelope
/// again (every stored one was validated before it was stored).
#[derive(Debug, Clone, Copy)]
pub struct JobJson<'a>(pub &'a Job);

impl JobJson<'_> {
    /// The object, written at the end of `out`; each key the program knows
    /// is copied as written (see [`ojs_core::json_out::Object`]).
    pub fn write(&self, out: &mut Vec<u8>) -> Result<(), ojs_core::json_out::Error> {
        let job = self.0;
        // An extra field overrides the envelope's entry of its name, as it
        // does in `to_json`; the outbox mark is never shown.
        let extra = |k: &str| k != crate::dead::PUBLISHING && job.extra.contains_key(k);
        let (mut meta, mut priority, mut attempt, mut tags) = (false, false, false, false);
        let mut o = ojs_core::json_out::Object::open(out);
        job.envelope
            .write_json_object_entries(&mut o, SecondsFormat::Millis, |k| {
                match k {
                    "meta" => meta = true,
                    "priority" => priority = true,
                    "attempt" => attempt = true,
                    "tags" => tags = true,
                    _ => {}
                }
                k != "max_attempts" && !extra(k)
            })?;
        if !meta && !extra("meta") {
            o.key_text("\"meta\":");
            o.value(&Map::new())?;
        }
        if !priority && !extra("priority") {
            o.key_text("\"priority\":");
            o.value(&0)?;
        }
        if !attempt && !extra("attempt") {
            o.key_text("\"attempt\":");
            o.value(&0)?;
        }
        if !tags && !extra("tags") {
            o.key_text("\"tags\":");
            o.value::<[Value]>(&[])?;
        }
        if !extra("max_attempts") {
            o.key_text("\"max_attempts\":");
            o.value(&max_attempts(&job.envelope))?;
        }
        for (k, x) in &job.extra {
            if k != crate::dead::PUBLISHING {
                o.key(k);
                o.value(x)?;
            }
        }
        o.close();
        Ok(())
    }
}

/// Attempts in total the job's policy allows.
pub fn max_attempts(job: &JobEnvelope) -> i32 {
    job.retry
        .as_ref()
        .and_then(|r| r.max_attempts)
        .unwrap_or(DEFAULT_MAX_ATTEMPTS)
}

/// An RFC 3339 timestamp as the binding writes it: UTC, milliseconds, `Z`.
pub fn timestamp(t: DateTime<Utc>) -> String {
    ojs_core::timestamp::rfc3339(&t, SecondsFormat::Millis)
}

/// A job from a JSON PUSH body, ready to store: id, `specversion`, state
/// and timestamps filled, validated.
pub fn from_json(body: Value, now: DateTime<Utc>) -> Result<Job, ApiError> {
    let (envelope, pending) = read_push(body, now)?;
    accept(envelope, pending, now)
}

/// A parsed PUSH body's envelope, before [`accept`], and `pending`.
fn read_push(body: Value, now: DateTime<Utc>) -> Result<(JobEnvelope, bool), ApiError> {
    let Value::Object(mut body) = body else {
        return Err(ApiError::invalid(
            "",
            "the body must be a JSON object with `type` and `args`",
        ));
    };
    if !body.contains_key("type") {
        return Err(ApiError::invalid("type", "`type` is required"));
    }
    match body.get("args") {
        None => return Err(ApiError::invalid("args", "`args` is required (an array)")),
        Some(Value::Array(_)) => {}
        Some(_) => return Err(ApiError::invalid("args", "`args` must be a JSON array")),
    }
    if let Some(id) = body.get("id") {
        if !id.is_string() {
            return Err(ApiError::invalid("id", "`id` must be a string (a UUIDv7)"));
        }
    }
    let mut pending = false;
    match body.remove("options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(options)) => {
            pending = fold_options(options, now, &mut |key, v| {
                body.insert(key.into(), v);
                Ok(())
            })?
        }
        Some(_) => return Err(ApiError::invalid("options", "`options` must be an object")),
    }
    if let Some(at) = body.get("scheduled_at").and_then(Value::as_str) {
        let t = parse_time("scheduled_at", at, now)?;
        body.insert("scheduled_at".into(), json!(timestamp(t)));
    }
    for key in SYSTEM_ATTRIBUTES {
        body.remove(key);
    }
    body.entry("specversion")
        .or_insert_with(|| json!(ojs_core::envelope::SPEC_VERSION));
    body.entry("id")
        .or_insert_with(|| json!(ojs_core::envelope::new_job_id()));
    let envelope = JobEnvelope::from_json_value(Value::Object(body)).map_err(invalid_envelope)?;
    Ok((envelope, pending))
}

/// What [`read_push`] reads from the common PUSH body (each attribute
/// once, valid), read in one pass over its text: the envelope's
/// attributes straight into it, without an object of them all built and
/// taken apart first (a batch PUSH's largest cost of ours that is not the
/// store's). `None` for anything else — a syntax error, an invalid or
/// repeated attribute, a `scheduled_at` that is not text — which
/// `read_push` reads again: its errors and its reading of a repeated key
/// stay as they were.
pub(crate) fn push_in_one_pass(bytes: &[u8], now: DateTime<Utc>) -> Option<(JobEnvelope, bool)> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let read = serde::Deserializer::deserialize_map(&mut de, PushOnePass).ok()??;
    de.end().ok()?;
    read.finish(now)
}

/// The envelopes (and `pending`) of a batch PUSH body's jobs, as
/// [`read_push`] reads each, read in one pass over the body's text as
/// [`push_in_one_pass`] reads one; `None` unless every job is read so (and
/// for more than `limit` jobs or none), for the batch to be read again
/// as a parsed body, with its errors.
pub(crate) fn batch_in_one_pass(
    bytes: &[u8],
    limit: usize,
    now: DateTime<Utc>,
) -> Option<Vec<(JobEnvelope, bool)>> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    // Room for the jobs the body could hold at a small job's size: the
    // parser cannot say how many the array has, and growing the list of
    // jobs read (each a whole envelope) copied it six times for 100.
    let room = (bytes.len() / SMALL_JOB_BYTES).clamp(1, limit.max(1));
    let read =
        serde::Deserializer::deserialize_map(&mut de, BatchOnePass { limit, room }).ok()??;
    de.end().ok()?;
    if read.is_empty() {
        return None;
    }
    // A list of its own (collected in place, the smaller envelopes'
    // list was copied again to shrink it).
    let mut out = Vec::with_capacity(read.len());
    for job in read {
        out.push(job.finish(now)?);
    }
    Some(out)
}

/// The bytes a small job takes in a batch body, `{"type":"a.b","args":[1]},`
/// and a little more: what [`batch_in_one_pass`] makes room for at first.
const SMALL_JOB_BYTES: usize = 64;

/// A PUSH body's entries as one pass reads them.
struct PushEntries {
    entries: ojs_core::envelope::EnvelopeEntries,
    options: Option<Map<String, Value>>,
    /// A top-level `scheduled_at` given as text.
    scheduled_at: Option<String>,
}

struct PushOnePass;

impl<'de> serde::de::Visitor<'de> for PushOnePass {
    type Value = Option<PushEntries>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a PUSH body object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use ojs_core::envelope::JsonKey;
        let mut read = PushEntries {
            entries: ojs_core::envelope::EnvelopeEntries::new(),
            options: None,
            scheduled_at: None,
        };
        let (mut options_seen, mut scheduled_seen, mut type_seen) = (false, false, false);
        while let Some(JsonKey(key)) = map.next_key::<JsonKey<'de>>()? {
            // Every value is read as the parsed body's (a number past
            // what a `Value` holds fails here as it fails there).
            let v: Value = map.next_value()?;
            match key.as_ref() {
                "options" => {
                    if std::mem::replace(&mut options_seen, true) {
                        return Ok(None);
                    }
                    match v {
                        Value::Null => {}
                        Value::Object(m) => read.options = Some(m),
                        _ => return Ok(None),
                    }
                }
                "scheduled_at" => {
                    if std::mem::replace(&mut scheduled_seen, true) {
                        return Ok(None);
                    }
                    match v {
                        // Absent, as a known attribute's `null` is.
                        Value::Null => {}
                        Value::String(s) => read.scheduled_at = Some(s),
                        _ => return Ok(None),
                    }
                }
                k if SYSTEM_ATTRIBUTES.contains(&k) => {}
                k => {
                    match k {
                        "type" => type_seen = true,
                        "args" if !v.is_array() => return Ok(None),
                        "id" if !v.is_string() => return Ok(None),
                        _ => {}
                    }
                    if !matches!(read.entries.set(key, v), Ok(true)) {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(type_seen.then_some(read))
    }
}

impl PushEntries {
    /// The rest of [`read_push`] on what one pass read.
    fn finish(self, now: DateTime<Utc>) -> Option<(JobEnvelope, bool)> {
        let PushEntries {
            mut entries,
            options,
            scheduled_at,
        } = self;
        // As `read_push`: an option's `scheduled_at` replaces the top-level
        // one (read first here: one that fails is read again there).
        if let Some(at) = scheduled_at {
            let t = parse_time("scheduled_at", &at, now).ok()?;
            entries.replace("scheduled_at", json!(timestamp(t))).ok()?;
        }
        let mut pending = false;
        if let Some(options) = options {
            pending = fold_options(options, now, &mut |key, v| {
                entries.replace(key, v).map_err(invalid_envelope)
            })
            .ok()?;
        }
        if !entries.has("specversion") {
            entries
                .replace("specversion", json!(ojs_core::envelope::SPEC_VERSION))
                .ok()?;
        }
        if !entries.has("id") {
            entries
                .replace("id", json!(ojs_core::envelope::new_job_id()))
                .ok()?;
        }
        Some((entries.finish().ok()?, pending))
    }
}

/// A batch PUSH body, `{"jobs": [...]}`, as one pass reads it.
struct BatchOnePass {
    limit: usize,
    /// Jobs to make room for at first.
    room: usize,
}

impl<'de> serde::de::Visitor<'de> for BatchOnePass {
    type Value = Option<Vec<PushEntries>>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a batch PUSH body object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use ojs_core::envelope::JsonKey;
        let mut jobs = None;
        while let Some(JsonKey(key)) = map.next_key::<JsonKey<'de>>()? {
            if key == "jobs" {
                if jobs.is_some() {
                    return Ok(None);
                }
                jobs = Some(map.next_value_seed(JobsOnePass {
                    limit: self.limit,
                    room: self.room,
                })?);
            } else {
                // Read as the parsed body reads it, and left.
                map.next_value::<Value>()?;
            }
        }
        Ok(jobs)
    }
}

/// The `jobs` array of a batch PUSH body: each job read by
/// [`PushOnePass`]; the first that is not ends the pass (as an error, so
/// that nothing more is read).
struct JobsOnePass {
    limit: usize,
    room: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for JobsOnePass {
    type Value = Vec<PushEntries>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for JobsOnePass {
    type Value = Vec<PushEntries>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of jobs")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error;
        let mut jobs = Vec::with_capacity(seq.size_hint().unwrap_or(self.room).min(self.limit));
        while let Some(job) = seq.next_element_seed(PushSeed)? {
            match job {
                Some(job) if jobs.len() < self.limit => jobs.push(job),
                _ => return Err(A::Error::custom("read as a parsed body")),
            }
        }
        Ok(jobs)
    }
}

/// One job of a batch, as [`PushOnePass`] reads it.
struct PushSeed;

impl<'de> serde::de::DeserializeSeed<'de> for PushSeed {
    type Value = Option<PushEntries>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(PushOnePass)
    }
}

/// A job from a protobuf PUSH (one `JobEnvelope`, `id` and `specversion`
/// optional), ready to store.
pub fn from_proto(bytes: &[u8], now: DateTime<Utc>) -> Result<Job, ApiError> {
    let mut envelope =
        JobEnvelope::from_proto_bytes_unvalidated(bytes).map_err(|e| ApiError::InvalidPayload {
            encoding: "protobuf JobEnvelope",
            reason: e.to_string(),
        })?;
    if envelope.job_type.is_empty() {
        return Err(ApiError::invalid("type", "`type` is required"));
    }
    if envelope.specversion.is_empty() {
        envelope.specversion = ojs_core::envelope::SPEC_VERSION.to_owned();
    }
    if envelope.id.is_empty() {
        envelope.id = ojs_core::envelope::new_job_id();
    }
    let pending = envelope
        .unknown_attributes
        .remove("pending")
        .is_some_and(|v| v == Value::Bool(true));
    envelope.state = None;
    envelope.attempt = 0;
    envelope.created_at = None;
    envelope.enqueued_at = None;
    envelope.started_at = None;
    envelope.completed_at = None;
    envelope.error = None;
    envelope.errors.clear();
    envelope.result = None;
    accept(envelope, pending, now)
}

/// The last step of every PUSH, whichever binding and format it came in:
/// sets the state and timestamps, checks the envelope's own rules and what
/// they leave to the API (the priority's range, the size limits).
pub(crate) fn accept(
    mut envelope: JobEnvelope,
    pending: bool,
    now: DateTime<Utc>,
) -> Result<Job, ApiError> {
    if !PRIORITY_RANGE.contains(&i64::from(envelope.priority)) {
        return Err(ApiError::invalid(
            "options.priority",
            format!(
                "priority {} is outside -100..=100 (schema: minimum -100, maximum 100)",
                envelope.priority
            ),
        ));
    }
    let state = if pending {
        JobState::Pending
    } else if envelope.scheduled_at.is_some_and(|t| t > now) {
        JobState::Scheduled
    } else {
        JobState::Available
    };
    envelope.state = Some(state);
    envelope.attempt = 0;
    envelope.created_at = Some(now);
    envelope.enqueued_at = (state == JobState::Available).then_some(now);
    envelope.validate().map_err(invalid_envelope)?;
    // A unique policy that cannot be followed is refused with the push.
    crate::model::unique::Uniqueness::of(&envelope)?;
    // So is a rate limit (given as a top-level attribute too).
    crate::model::rate::RateLimit::of(&envelope)?;
    crate::limits::check_job(&envelope)?;
    Ok(Job {
        envelope,
        extra: Extra::new(),
    })
}

/// Moves `options` onto the envelope's attributes, each through `set`
/// (which replaces what the body gave); returns `pending`.
fn fold_options(
    options: Map<String, Value>,
    now: DateTime<Utc>,
    set: &mut dyn FnMut(&'static str, Value) -> Result<(), ApiError>,
) -> Result<bool, ApiError> {
    let mut pending = false;
    for (key, v) in options {
        if v.is_null() {
            continue;
        }
        let at = format!("options.{key}");
        match key.as_str() {
            "queue" => {
                let q = v
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(&at, "must be a string"))?;
                set("queue", json!(q))?;
            }
            "priority" => {
                let p = v
                    .as_i64()
                    .ok_or_else(|| ApiError::invalid(&at, "must be an integer from -100 to 100"))?;
                if !PRIORITY_RANGE.contains(&p) {
                    return Err(ApiError::invalid(
                        &at,
                        format!("{p} is outside -100..=100 (schema: minimum -100, maximum 100)"),
                    ));
                }
                set("priority", json!(p))?;
            }
            "timeout_ms" => {
                let ms = non_negative(&at, &v)?;
                set("timeout", json!(timeout_seconds(ms)))?;
                set("timeout_ms", json!(ms))?;
            }
            "visibility_timeout_ms" => {
                let ms = non_negative(&at, &v)?;
                check_visibility_timeout(&at, ms)?;
                set("visibility_timeout_ms", json!(ms))?;
            }
            "delay_until" | "scheduled_at" => {
                let s = v
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(&at, "must be an RFC 3339 date-time"))?;
                let t = parse_time(&at, s, now)?;
                set("scheduled_at", json!(timestamp(t)))?;
            }
            "expires_at" => {
                let s = v
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(&at, "must be an RFC 3339 date-time"))?;
                let t = parse_time(&at, s, now)?;
                set("expires_at", json!(timestamp(t)))?;
            }
            "retry" => {
                let Value::Object(policy) = v else {
                    return Err(ApiError::invalid(&at, "must be an object"));
                };
                let mut policy = retry_aliases(policy)?;
                // Unset: the spec's default.
                policy.entry("jitter").or_insert(json!(true));
                set("retry", Value::Object(policy))?;
            }
            "unique" => {
                let Value::Object(mut policy) = v else {
                    return Err(ApiError::invalid(&at, "must be an object"));
                };
                // The protobuf binding's singular name.
                if let Some(k) = policy.remove("key") {
                    policy.entry("keys").or_insert(k);
                }
                set("unique", Value::Object(policy))?;
            }
            "tags" => {
                let tags = v
                    .as_array()
                    .ok_or_else(|| ApiError::invalid(&at, "must be an array of strings"))?;
                let tags = tags
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        t.as_str().map(str::to_owned).ok_or_else(|| {
                            ApiError::invalid(format!("{at}[{i}]"), "must be a non-empty string")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                check_tags(&at, &tags)?;
                set("tags", v)?;
            }
            "pending" => {
                pending = v
                    .as_bool()
                    .ok_or_else(|| ApiError::invalid(&at, "must be a boolean"))?;
            }
            "rate_limit" => {
                let kept = crate::model::rate::RateLimit::read(&at, &v)?;
                set("rate_limit", kept)?;
            }
            other => {
                return Err(ApiError::invalid(
                    &at,
                    format!(
                        "unknown option `{other}`{}",
                        suggestion(other, OPTIONS.iter().copied())
                    ),
                ))
            }
        }
    }
    Ok(pending)
}

/// `timeout_ms` as the envelope's whole seconds (rounded up).
fn timeout_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).min(i32::MAX as u64)
}

/// A job's `timeout_ms`: the envelope counts whole seconds, and the exact
/// value rides along as an attribute of its own.
pub(crate) fn set_timeout_ms(envelope: &mut JobEnvelope, ms: u64) {
    envelope.timeout = i32::try_from(timeout_seconds(ms)).unwrap_or(i32::MAX);
    envelope
        .unknown_attributes
        .insert("timeout_ms".into(), json!(ms));
}

/// A job's visibility timeout: at least a second (job-options schema).
pub(crate) fn check_visibility_timeout(at: &str, ms: u64) -> Result<(), ApiError> {
    if ms < 1000 {
        return Err(ApiError::invalid(
            at,
            format!("{ms} is below 1000 (schema: minimum 1000)"),
        ));
    }
    Ok(())
}

/// A job's tags: non-empty and each once (job-options schema).
pub(crate) fn check_tags(at: &str, tags: &[String]) -> Result<(), ApiError> {
    for (i, t) in tags.iter().enumerate() {
        if t.is_empty() {
            return Err(ApiError::invalid(
                format!("{at}[{i}]"),
                "must be a non-empty string",
            ));
        }
        if tags[..i].contains(t) {
            return Err(ApiError::invalid(
                format!("{at}[{i}]"),
                "appears twice (schema: uniqueItems)",
            ));
        }
    }
    Ok(())
}

/// The binding's `*_ms` integer spellings of retry intervals, as the
/// ISO 8601 durations the envelope carries.
fn retry_aliases(mut policy: Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    for (alias, name) in [
        ("initial_interval_ms", "initial_interval"),
        ("max_interval_ms", "max_interval"),
    ] {
        if let Some(v) = policy.remove(alias) {
            let ms = non_negative(&format!("options.retry.{alias}"), &v)?;
            let iso = format_iso8601_duration(std::time::Duration::from_millis(ms));
            policy.entry(name).or_insert(json!(iso));
        }
    }
    Ok(policy)
}

fn non_negative(at: &str, v: &Value) -> Result<u64, ApiError> {
    v.as_u64()
        .ok_or_else(|| ApiError::invalid(at, "must be an integer of 0 or more"))
}

/// An RFC 3339 date-time with a zone, or `+` and an ISO 8601 duration from
/// now (`+PT2S`).
fn parse_time(at: &str, s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
    if let Some(d) = s.strip_prefix('+') {
        let d = parse_iso8601_duration(d).map_err(|e| ApiError::invalid(at, e))?;
        let d = chrono::Duration::from_std(d)
            .map_err(|_| ApiError::invalid(at, "the duration is too long"))?;
        return now
            .checked_add_signed(d)
            .ok_or_else(|| ApiError::invalid(at, "the duration is too long"));
    }
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            ApiError::invalid(
                at,
                format!("{s:?} is not an RFC 3339 date-time with a zone: {e}"),
            )
        })
}

/// An envelope rule, as the binding's validation error.
pub(crate) fn invalid_envelope(e: ojs_core::Error) -> ApiError {
    let attribute = match &e {
        ojs_core::Error::MissingAttribute(a) => Some((*a).to_owned()),
        ojs_core::Error::InvalidAttribute { attribute, .. } => Some(attribute.clone()),
        ojs_core::Error::NumberOutOfRange { path, .. }
        | ojs_core::Error::NonFiniteNumber { path }
        | ojs_core::Error::NestingTooDeep { path, .. } => Some(path.clone()),
        _ => None,
    };
    // Envelope attributes a PUSH sends inside `options`.
    let attribute = attribute.map(|a| {
        let top = a.split(['.', '[']).next().unwrap_or("");
        if [
            "queue",
            "priority",
            "scheduled_at",
            "expires_at",
            "retry",
            "unique",
        ]
        .contains(&top)
        {
            format!("options.{a}")
        } else {
            a
        }
    });
    ApiError::InvalidRequest {
        attribute,
        message: e.to_string(),
        index: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-26T10:00:00Z")
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default()
    }

    #[test]
    fn options_become_envelope_attributes() -> Result<(), ApiError> {
        let job = from_json(
            json!({"type": "report.generate", "args": [1],
                   "options": {"queue": "reports", "priority": 10, "timeout_ms": 1500,
                               "tags": ["a"], "retry": {"max_attempts": 5, "initial_interval_ms": 250}},
                   "x_custom": {"kept": true}}),
            now(),
        )?;
        let e = &job.envelope;
        assert_eq!(e.queue, "reports");
        assert_eq!(e.priority, 10);
        assert_eq!(e.timeout, 2);
        assert_eq!(e.state, Some(JobState::Available));
        assert_eq!(
            e.retry.as_ref().map(|r| r.initial_interval.as_str()),
            Some("PT0.250S")
        );
        let v = job.to_json();
        assert_eq!(v["timeout_ms"], 1500);
        assert_eq!(v["tags"], json!(["a"]));
        assert_eq!(v["max_attempts"], 5);
        assert_eq!(v["x_custom"], json!({"kept": true}));
        assert_eq!(v["attempt"], 0);
        Ok(())
    }

    /// The keys of a JSON object as written, duplicates kept.
    fn keys_as_written(text: &str) -> Vec<String> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = Vec<String>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(keys)
            }
        }
        let mut de = serde_json::Deserializer::from_str(text);
        serde::Deserializer::deserialize_map(&mut de, Keys).unwrap_or_default()
    }

    /// The job written straight to bytes is the object `to_json` builds,
    /// each key once, whatever the envelope holds and the extra fields
    /// override (state, attempt, max_attempts, tags, meta), and without the
    /// outbox mark.
    #[test]
    fn a_job_written_straight_is_the_job_to_json_builds() -> Result<(), ApiError> {
        let bodies = [
            json!({"type": "a.b", "args": []}),
            json!({"type": "report.generate", "args": [1, "x", {"n": null}], "meta": {"k": "v"},
                   "options": {"queue": "reports", "priority": -5, "timeout_ms": 1500,
                               "tags": ["a", "b"], "retry": {"max_attempts": 5, "initial_interval_ms": 250},
                               "unique": {"keys": ["args"], "on_conflict": "reject"}},
                   "x_custom": {"kept": true}}),
            json!({"type": "later", "args": [true], "options": {"delay_until": "2030-01-01T00:00:00Z"}}),
        ];
        let extras = [
            json!({}),
            json!({"publishing": true, "previous_state": "active", "cancelled_at": "2026-11-26T10:00:01.000Z"}),
            json!({"attempt": 2, "max_attempts": 9, "tags": ["t"], "meta": {"m": 1}, "state": "retryable",
                   "next_attempt_at": "2026-11-26T10:00:05.000Z"}),
        ];
        for body in bodies {
            for extra in &extras {
                let mut job = from_json(body.clone(), now())?;
                job.envelope.attempt = 1;
                job.envelope.started_at = Some(now());
                if let Value::Object(extra) = extra {
                    job.extra = extra.clone();
                }
                let mut bytes = Vec::new();
                JobJson(&job)
                    .write(&mut bytes)
                    .map_err(|e| ApiError::invalid("", e.to_string()))?;
                let text = String::from_utf8_lossy(&bytes);
                let written: Value = serde_json::from_str(&text)
                    .map_err(|e| ApiError::invalid("", e.to_string()))?;
                assert_eq!(written, job.to_json(), "{text}");
                // Every time here is on a whole second, which the
                // envelope's own JSON writes without a fraction; the
                // binding writes the lifecycle times with milliseconds
                // all the same, and a client's own time as it was given.
                assert_eq!(written["created_at"], "2026-11-26T10:00:00.000Z", "{text}");
                assert_eq!(written["started_at"], "2026-11-26T10:00:00.000Z", "{text}");
                if job.envelope.scheduled_at.is_some() {
                    assert_eq!(written["scheduled_at"], "2030-01-01T00:00:00Z", "{text}");
                }
                let keys = keys_as_written(&text);
                let unique: std::collections::BTreeSet<&String> = keys.iter().collect();
                assert_eq!(keys.len(), unique.len(), "a key written twice: {text}");
                assert!(!keys.iter().any(|k| k == "publishing"), "{text}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_future_time_schedules_and_a_past_one_does_not() -> Result<(), ApiError> {
        let later = from_json(
            json!({"type": "a", "args": [], "options": {"delay_until": "+PT2S"}}),
            now(),
        )?;
        assert_eq!(later.state(), JobState::Scheduled);
        assert_eq!(later.envelope.enqueued_at, None);
        let past = from_json(
            json!({"type": "a", "args": [], "options": {"scheduled_at": "2020-01-01T00:00:00Z"}}),
            now(),
        )?;
        assert_eq!(past.state(), JobState::Available);
        Ok(())
    }

    #[test]
    fn each_rule_names_its_attribute() {
        let cases = [
            (json!({"args": []}), "type"),
            (json!({"type": "a"}), "args"),
            (json!({"type": "a", "args": {}}), "args"),
            (json!({"type": "Email.Send", "args": []}), "type"),
            (
                json!({"type": "a", "args": [], "id": "550e8400-e29b-41d4-a716-446655440000"}),
                "id",
            ),
            (
                json!({"type": "a", "args": [], "options": {"priority": 101}}),
                "options.priority",
            ),
            (
                json!({"type": "a", "args": [], "options": {"queue": "My queue"}}),
                "options.queue",
            ),
            (
                json!({"type": "a", "args": [], "options": {"queu": "x"}}),
                "options.queu",
            ),
            (
                json!({"type": "a", "args": [], "options": {"delay_until": "2026-01-01T00:00:00"}}),
                "options.delay_until",
            ),
            (
                json!({"type": "a", "args": [], "options": {"retry": {"backoff_coefficient": 0.5}}}),
                "options.retry.backoff_coefficient",
            ),
        ];
        for (body, attribute) in cases {
            match from_json(body.clone(), now()) {
                Err(ApiError::InvalidRequest {
                    attribute: Some(a), ..
                }) => {
                    assert_eq!(a, attribute, "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        match from_json(
            json!({"type": "a", "args": [], "options": {"queu": "x"}}),
            now(),
        ) {
            Err(e) => assert!(e.to_string().contains("did you mean `queue`"), "{e}"),
            Ok(j) => panic!("{j:?}"),
        }
    }

    #[test]
    fn a_client_cannot_set_system_attributes() -> Result<(), ApiError> {
        let job = from_json(
            json!({"type": "a", "args": [], "state": "completed", "attempt": 4}),
            now(),
        )?;
        assert_eq!(job.state(), JobState::Available);
        assert_eq!(job.envelope.attempt, 0);
        Ok(())
    }

    #[test]
    fn protobuf_and_json_pushes_make_the_same_job() -> Result<(), ApiError> {
        let json_job = from_json(
            json!({"type": "email.send", "args": ["a@example.com"], "id": "019539a4-aaaa-7000-8000-111111111111",
                   "meta": {"k": "v"}, "options": {"queue": "mail", "priority": 3}}),
            now(),
        )?;
        let mut bare = json_job.envelope.clone();
        bare.state = None;
        bare.created_at = None;
        bare.enqueued_at = None;
        let bytes = bare
            .to_proto_bytes()
            .map_err(crate::job::invalid_envelope)?;
        let proto_job = from_proto(&bytes, now())?;
        assert_eq!(proto_job.to_json(), json_job.to_json());
        Ok(())
    }

    /// The general path's reading of a PUSH body's text, before `accept`.
    fn read_parsed(bytes: &[u8]) -> Result<(JobEnvelope, bool), ApiError> {
        let body = serde_json::from_slice(bytes).map_err(|e| ApiError::InvalidPayload {
            encoding: "JSON",
            reason: e.to_string(),
        })?;
        read_push(body, now())
    }

    /// One pass and the general path read `text` alike: where one pass
    /// reads it, the general path reads the same envelope (a generated id
    /// aside) and `pending`. Whether one pass read it.
    fn reads_alike(text: &str) -> bool {
        let Some((mut fast, fast_pending)) = push_in_one_pass(text.as_bytes(), now()) else {
            return false;
        };
        let general = read_parsed(text.as_bytes());
        let Ok((mut general, general_pending)) = general else {
            panic!("one pass read {text}, the general path refused it: {general:?}");
        };
        if !text.contains("\"id\"") {
            fast.id.clear();
            general.id.clear();
        }
        assert_eq!(fast, general, "{text}");
        assert_eq!(fast_pending, general_pending, "{text}");
        true
    }

    #[test]
    fn common_push_bodies_are_read_in_one_pass_as_parsed() {
        for text in [
            r#"{"type":"email.send","args":["a@example.com"]}"#,
            r#"{"type":"t.w","args":[1,{"k":[true,null]}],"id":"019539a4-aaaa-7000-8000-111111111111","meta":{"k":"v"}}"#,
            r#"{"type":"t.w","args":[],"options":{"queue":"mail","priority":3,"timeout_ms":1500,"tags":["a","b"],
                "retry":{"max_attempts":5,"initial_interval_ms":250},"unique":{"key":["type"]},
                "visibility_timeout_ms":5000,"expires_at":"2027-01-01T00:00:00+02:00"}}"#,
            r#"{"type":"t.w","args":[],"queue":"top","options":{"queue":"option"}}"#,
            r#"{"type":"t.w","args":[],"scheduled_at":"+PT30S","x_custom":{"kept":1.5e3}}"#,
            r#"{"type":"t.w","args":[],"scheduled_at":"2020-01-01T00:00:00Z","options":{"delay_until":"+PT1M"}}"#,
            r#"{"type":"t.w","args":[],"state":"completed","attempt":4,"max_attempts":9,"options":null,"options2":null}"#,
            r#"{"type":"t.w","args":[],"options":{"pending":true,"rate_limit":{"key":"k","max_per_second":5}}}"#,
            r#"{"type":"t.w","args":[],"specversion":"1.0","schema":"urn:s","queue":null}"#,
            r#"{"qu\u0065ue":"escaped","type":"t.w","args":[]}"#,
        ] {
            assert!(reads_alike(text), "not read in one pass: {text}");
        }
    }

    #[test]
    fn a_batch_of_more_jobs_than_its_first_room_is_read_whole_and_in_order() {
        // 300 jobs of about 30 bytes: more than the room made at first for
        // the body's length (a 64-byte job each), so the list grows.
        let jobs: Vec<String> = (0..300)
            .map(|i| format!(r#"{{"type":"t.n{i}","args":[]}}"#))
            .collect();
        let body = format!(r#"{{"jobs":[{}]}}"#, jobs.join(","));
        assert!(body.len() / SMALL_JOB_BYTES < jobs.len());
        let read = batch_in_one_pass(body.as_bytes(), 1000, now()).expect("read in one pass");
        let types: Vec<String> = read.iter().map(|(e, _)| e.job_type.clone()).collect();
        let expected: Vec<String> = (0..300).map(|i| format!("t.n{i}")).collect();
        assert_eq!(types, expected);
        // One past the limit, and a limit of none, are left to the general
        // path (which answers with its error).
        assert!(batch_in_one_pass(body.as_bytes(), 299, now()).is_none());
        assert!(batch_in_one_pass(body.as_bytes(), 0, now()).is_none());
        assert_eq!(
            batch_in_one_pass(body.as_bytes(), 300, now()).map(|r| r.len()),
            Some(300)
        );
    }

    #[test]
    fn uncommon_push_bodies_are_left_to_the_general_path() {
        for text in [
            "",
            " ",
            "[]",
            r#"{"args":[]}"#,
            r#"{"type":"t","args":{}}"#,
            r#"{"type":"t","args":null}"#,
            r#"{"type":"t","args":[],"id":null}"#,
            r#"{"type":"t","args":[],"type":"u"}"#,
            r#"{"type":"t","args":[],"x":1,"x":2}"#,
            r#"{"type":"t","args":[],"options":{},"options":{}}"#,
            r#"{"type":"t","args":[],"options":[]}"#,
            r#"{"type":"t","args":[],"options":{"nope":1}}"#,
            r#"{"type":"t","args":[],"scheduled_at":5}"#,
            r#"{"type":"t","args":[],"scheduled_at":"yesterday"}"#,
            r#"{"type":"t","args":[],"state":1e999}"#,
            r#"{"type":"t","args":[]} x"#,
        ] {
            assert!(
                push_in_one_pass(text.as_bytes(), now()).is_none(),
                "read in one pass: {text}"
            );
        }
    }

    /// Entries of PUSH bodies: valid, invalid, `null`, repeated, escaped.
    fn entry() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let option = prop_oneof![
            Just(r#""queue":"o""#),
            Just(r#""queue":7"#),
            Just(r#""queue":null"#),
            Just(r#""priority":5"#),
            Just(r#""priority":500"#),
            Just(r#""timeout_ms":2500"#),
            Just(r#""timeout_ms":-1"#),
            Just(r#""visibility_timeout_ms":500"#),
            Just(r#""visibility_timeout_ms":2000"#),
            Just(r#""delay_until":"+PT5S""#),
            Just(r#""scheduled_at":"2020-01-01T00:00:00Z""#),
            Just(r#""scheduled_at":"never""#),
            Just(r#""expires_at":"2030-01-01T00:00:00Z""#),
            Just(r#""retry":{"max_attempts":2,"max_interval_ms":1000}"#),
            Just(r#""retry":{"max_attempts":"x"}"#),
            Just(r#""unique":{"key":["type"],"period":"PT1H"}"#),
            Just(r#""unique":[]"#),
            Just(r#""tags":["a","b"]"#),
            Just(r#""tags":["a","a"]"#),
            Just(r#""pending":true"#),
            Just(r#""pending":"yes""#),
            Just(r#""rate_limit":{"key":"k","max_per_second":3}"#),
            Just(r#""other":1"#),
        ];
        prop_oneof![
            Just(r#""type":"t.w""#.to_owned()),
            Just(r#""type":null"#.to_owned()),
            Just(r#""type":"bad type!""#.to_owned()),
            Just(r#""args":[1,"two",{"three":[3.5]}]"#.to_owned()),
            Just(r#""args":[]"#.to_owned()),
            Just(r#""args":"no""#.to_owned()),
            Just(r#""id":"019539a4-aaaa-7000-8000-111111111111""#.to_owned()),
            Just(r#""id":"not-a-uuid""#.to_owned()),
            Just(r#""id":5"#.to_owned()),
            Just(r#""queue":"top""#.to_owned()),
            Just(r#""qu\u0065ue":"escaped""#.to_owned()),
            Just(r#""priority":-3"#.to_owned()),
            Just(r#""priority":null"#.to_owned()),
            Just(r#""meta":{"a":{"b":null}}"#.to_owned()),
            Just(r#""meta":1"#.to_owned()),
            Just(r#""scheduled_at":"+PT10S""#.to_owned()),
            Just(r#""scheduled_at":null"#.to_owned()),
            Just(r#""scheduled_at":"later""#.to_owned()),
            Just(r#""state":"completed""#.to_owned()),
            Just(r#""attempt":9"#.to_owned()),
            Just(r#""max_attempts":1"#.to_owned()),
            Just(r#""result":{"r":1}"#.to_owned()),
            Just(r#""specversion":"1.0""#.to_owned()),
            Just(r#""specversion":null"#.to_owned()),
            Just(r#""tags":["t"]"#.to_owned()),
            Just(r#""timeout_ms":100"#.to_owned()),
            Just(r#""x_custom":{"k":[1,2.25,null]}"#.to_owned()),
            Just(r#""pending":true"#.to_owned()),
            Just(r#""options":null"#.to_owned()),
            Just(r#""options":3"#.to_owned()),
            proptest::collection::vec(option, 0..5)
                .prop_map(|o| format!(r#""options":{{{}}}"#, o.join(","))),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Whatever one pass reads of a PUSH body, the parsed body reads
        /// the same; a batch of such bodies alike.
        #[test]
        fn one_pass_reads_what_the_parsed_body_reads(
            required in proptest::bool::weighted(0.8),
            entries in proptest::collection::vec(entry(), 0..9),
            more in proptest::collection::vec(proptest::collection::vec(entry(), 0..3), 0..4),
        ) {
            // Most bodies with what a PUSH needs, so that most are read in
            // one pass (and others, which mostly are not).
            let mut entries = entries;
            if required {
                entries.insert(0, r#""type":"t.w","args":[0]"#.to_owned());
            }
            let text = format!("{{{}}}", entries.join(","));
            reads_alike(&text);
            // A batch: every job read in one pass, or the batch is read
            // as a parsed body; each job as the general path reads it.
            let jobs: Vec<String> = std::iter::once(&entries)
                .map(|e| format!("{{{}}}", e.join(",")))
                .chain(
                    more.iter().map(|e| {
                        let e: Vec<&str> = std::iter::once(r#""type":"t.b","args":[]"#)
                            .chain(e.iter().map(String::as_str))
                            .collect();
                        format!("{{{}}}", e.join(","))
                    }),
                )
                .collect();
            let batch = format!(r#"{{"jobs":[{}],"other":{{"x":1}}}}"#, jobs.join(","));
            if let Some(read) = batch_in_one_pass(batch.as_bytes(), 100, now()) {
                proptest::prop_assert_eq!(read.len(), jobs.len());
                for ((mut fast, fast_pending), text) in read.into_iter().zip(&jobs) {
                    let (mut general, general_pending) = read_parsed(text.as_bytes())
                        .unwrap_or_else(|e| panic!("one pass read {text} in a batch, the general path refused it: {e:?}"));
                    if !text.contains("\"id\"") {
                        fast.id.clear();
                        general.id.clear();
                    }
                    proptest::prop_assert_eq!(fast, general);
                    proptest::prop_assert_eq!(fast_pending, general_pending);
                }
            } else {
                // Left to the general path only when one of its jobs is.
                proptest::prop_assert!(
                    jobs.iter().any(|t| push_in_one_pass(t.as_bytes(), now()).is_none()),
                    "{}", batch
                );
            }
        }
    }
}
