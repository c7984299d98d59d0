//! The OJS job envelope (ojs-core "Job Envelope"), independent of any encoding.

pub(crate) mod json;
pub mod media;
pub mod proto;
pub mod stream;
pub mod value;
pub mod wire;

pub use json::{EnvelopeEntries, JsonKey};

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::duration::parse_iso8601_duration;
use crate::envelope::value::{check_value, Path};
use crate::error::{Error, Result};

/// `specversion` written by this build.
pub const SPEC_VERSION: &str = "1.0";
/// Every `specversion` this build accepts.
pub const SUPPORTED_SPEC_VERSIONS: &[&str] = &["1.0", "1.0.0-rc.1"];
/// Queue used when none is given (ojs-core).
pub const DEFAULT_QUEUE: &str = "default";
/// Longest `type` and `queue` accepted; brokers build names from them.
pub const MAX_NAME_LEN: usize = 255;

/// One OJS job.
///
/// Integer attributes follow proto3: `0` means "not set" (the OJS default
/// applies), and the same holds for empty strings in the nested policies.
/// Unknown protobuf fields and unknown JSON attributes are kept so that a
/// bridge never drops what a newer producer wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEnvelope {
    /// OJS spec version (`"1.0"` when built here).
    pub specversion: String,
    /// UUIDv7, lowercase hyphenated.
    pub id: String,
    /// Dot-namespaced job type, e.g. `email.send`.
    pub job_type: String,
    /// Target queue, `[a-z0-9][a-z0-9.-]*`.
    pub queue: String,
    /// Positional arguments, JSON-native values only.
    pub args: Vec<Value>,
    /// Extensible metadata (trace ids, tenant, grpcq provenance…).
    pub meta: Map<String, Value>,
    /// Higher runs first; 0 is the default.
    pub priority: i32,
    /// Maximum execution time in seconds; 0 = implementation default.
    pub timeout: i32,
    /// Not to be run before this time.
    pub scheduled_at: Option<DateTime<Utc>>,
    /// Discarded when not started by this time.
    pub expires_at: Option<DateTime<Utc>>,
    /// Retry policy; `None` = implementation defaults.
    pub retry: Option<RetryPolicy>,
    /// Uniqueness policy.
    pub unique: Option<UniquePolicy>,
    /// URI of a schema for `args`.
    pub schema: Option<String>,
    /// Lifecycle state (system-managed).
    pub state: Option<JobState>,
    /// Current attempt, 1-indexed; 0 = not yet attempted.
    pub attempt: i32,
    /// When the job was created.
    pub created_at: Option<DateTime<Utc>>,
    /// When the job was enqueued.
    pub enqueued_at: Option<DateTime<Utc>>,
    /// When the current attempt started.
    pub started_at: Option<DateTime<Utc>>,
    /// When the job reached a terminal state.
    pub completed_at: Option<DateTime<Utc>>,
    /// Last error.
    pub error: Option<JobError>,
    /// Result value; JSON `null` and absent are the same.
    pub result: Option<Value>,
    /// Extension: overall time budget across attempts, seconds.
    pub total_timeout: i32,
    /// Extension: discard when not dequeued within this many seconds.
    pub enqueue_ttl: i32,
    /// Extension: grace period on cancellation, seconds.
    pub grace_period: i32,
    /// Extension: heartbeat deadline, seconds.
    pub heartbeat_timeout: i32,
    /// Extension: how long results are kept, seconds.
    pub result_ttl: i32,
    /// Custom extensions, keys `x-{vendor}-{name}`.
    pub extensions: Map<String, Value>,
    /// The error history (`errors`): one JSON object per failed attempt
    /// (`code`, `message`, `type`, `attempt`, `occurred_at`, and whatever
    /// else the producer wrote). Protobuf field 23.
    pub errors: Vec<Value>,
    /// Protobuf fields this build does not know, as raw wire bytes.
    pub unknown_fields: Vec<u8>,
    /// Top-level JSON attributes OJS does not define, kept as they are (OJS:
    /// unknown attributes MUST be preserved). Protobuf field 22.
    pub unknown_attributes: Map<String, Value>,
}

/// OJS retry policy (proto `RetryPolicy`). Empty strings and zeros are unset.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, including the first; `None` = default (3),
    /// `Some(0)` = never retry (protobuf `optional`, so 0 survives).
    pub max_attempts: Option<i32>,
    /// ISO 8601 duration before the first retry.
    pub initial_interval: String,
    /// Multiplier between retries; 0 = default (2.0).
    pub backoff_coefficient: f64,
    /// ISO 8601 cap on the interval.
    pub max_interval: String,
    /// Randomise intervals. JSON without `jitter` means `true` (the OJS
    /// default) because protobuf cannot tell "unset" from `false`.
    pub jitter: bool,
    /// Error types that are never retried.
    pub non_retryable_errors: Vec<String>,
    /// `discard` or `dead_letter`; empty = default.
    pub on_exhaustion: String,
    /// Unknown protobuf fields of this message.
    pub unknown_fields: Vec<u8>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: None,
            initial_interval: String::new(),
            backoff_coefficient: 0.0,
            max_interval: String::new(),
            jitter: true,
            non_retryable_errors: Vec::new(),
            on_exhaustion: String::new(),
            unknown_fields: Vec::new(),
        }
    }
}

/// OJS uniqueness policy (proto `UniquePolicy`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UniquePolicy {
    /// Attributes that make up the uniqueness key: `type`, `queue`, `args`,
    /// `meta`.
    pub keys: Vec<String>,
    /// ISO 8601 duration of the uniqueness window.
    pub period: String,
    /// `reject`, `replace`, `replace_except_schedule` or `ignore`
    /// (`reschedule`, from the protobuf binding, is read too).
    pub on_conflict: String,
    /// Top-level `args` keys of the fingerprint (protobuf field 4).
    pub args_keys: Vec<String>,
    /// Top-level `meta` keys of the fingerprint; required with `meta` in
    /// `keys` (protobuf field 5).
    pub meta_keys: Vec<String>,
    /// States checked for duplicates (protobuf field 6).
    pub states: Vec<String>,
    /// Unknown protobuf fields of this message.
    pub unknown_fields: Vec<u8>,
}

/// Structured error of a failed attempt (proto `JobError`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobError {
    /// Error class, used for matching `non_retryable_errors`.
    pub error_type: String,
    /// Human-readable message.
    pub message: String,
    /// Stack frames. Protobuf carries them joined by `\n`.
    pub backtrace: Vec<String>,
    /// Which timeout fired, if any.
    pub timeout_kind: String,
    /// The limit that was hit, seconds.
    pub limit_seconds: i32,
    /// Time spent, seconds.
    pub elapsed_seconds: i32,
    /// Unknown protobuf fields of this message.
    pub unknown_fields: Vec<u8>,
}

/// Job lifecycle state (ojs-core state machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobState {
    /// Waiting for `scheduled_at`.
    Scheduled,
    /// Ready for pickup.
    Available,
    /// Staged, awaiting activation.
    Pending,
    /// Claimed by a worker.
    Active,
    /// Finished successfully (terminal).
    Completed,
    /// Failed, will be retried.
    Retryable,
    /// Cancelled (terminal).
    Cancelled,
    /// Permanently failed (terminal).
    Discarded,
    /// A protobuf enum value this build does not know; kept as is.
    Other(i32),
}

impl JobState {
    /// The protobuf enum number.
    pub fn to_i32(self) -> i32 {
        match self {
            JobState::Scheduled => 1,
            JobState::Available => 2,
            JobState::Pending => 3,
            JobState::Active => 4,
            JobState::Completed => 5,
            JobState::Retryable => 6,
            JobState::Cancelled => 7,
            JobState::Discarded => 8,
            JobState::Other(n) => n,
        }
    }

    /// From the protobuf enum number; 0 (unspecified) is `None`.
    pub fn from_i32(n: i32) -> Option<JobState> {
        Some(match n {
            0 => return None,
            1 => JobState::Scheduled,
            2 => JobState::Available,
            3 => JobState::Pending,
            4 => JobState::Active,
            5 => JobState::Completed,
            6 => JobState::Retryable,
            7 => JobState::Cancelled,
            8 => JobState::Discarded,
            other => JobState::Other(other),
        })
    }

    /// The JSON name (`"available"`…); `None` for [`JobState::Other`].
    pub fn as_str(self) -> Option<&'static str> {
        Some(match self {
            JobState::Scheduled => "scheduled",
            JobState::Available => "available",
            JobState::Pending => "pending",
            JobState::Active => "active",
            JobState::Completed => "completed",
            JobState::Retryable => "retryable",
            JobState::Cancelled => "cancelled",
            JobState::Discarded => "discarded",
            JobState::Other(_) => return None,
        })
    }

    /// Parses the JSON name.
    pub fn parse(s: &str) -> Option<JobState> {
        Some(match s {
            "scheduled" => JobState::Scheduled,
            "available" => JobState::Available,
            "pending" => JobState::Pending,
            "active" => JobState::Active,
            "completed" => JobState::Completed,
            "retryable" => JobState::Retryable,
            "cancelled" => JobState::Cancelled,
            "discarded" => JobState::Discarded,
            _ => return None,
        })
    }
}

impl JobEnvelope {
    /// A new job of `job_type` with `args`: fresh UUIDv7 id, `specversion`
    /// 1.0, queue `default`, `created_at` now.
    pub fn new(job_type: impl Into<String>, args: Vec<Value>) -> Self {
        let mut job = JobEnvelope::with_id(new_job_id(), job_type, args);
        job.created_at = Some(now_millis());
        job
    }

    /// A job with a given id (e.g. one derived from a grpcq call) and every
    /// other attribute at its default; `created_at` unset. Unlike
    /// [`JobEnvelope::new`] it reads neither the clock nor the RNG.
    pub fn with_id(id: String, job_type: impl Into<String>, args: Vec<Value>) -> Self {
        JobEnvelope {
            specversion: SPEC_VERSION.to_owned(),
            id,
            job_type: job_type.into(),
            queue: DEFAULT_QUEUE.to_owned(),
            args,
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
        }
    }

    /// Sets the queue (builder style).
    pub fn with_queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }

    /// Sets the priority (builder style).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Adds one meta entry (builder style).
    pub fn with_meta(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.meta.insert(key.into(), value.into());
        self
    }

    /// Sets the retry policy (builder style).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// A string meta value, if present and a string.
    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta.get(key).and_then(Value::as_str)
    }

    /// Whether decoding found protobuf fields this build does not know.
    pub fn has_unknown_fields(&self) -> bool {
        !self.unknown_fields.is_empty()
            || self
                .retry
                .as_ref()
                .is_some_and(|r| !r.unknown_fields.is_empty())
            || self
                .unique
                .as_ref()
                .is_some_and(|u| !u.unknown_fields.is_empty())
            || self
                .error
                .as_ref()
                .is_some_and(|e| !e.unknown_fields.is_empty())
    }

    /// Checks every rule of ojs-core and docs/design.md §3. Both codecs call this on
    /// decode and before encode, so an invalid envelope never crosses a wire.
    pub fn validate(&self) -> Result<()> {
        if self.specversion.is_empty() {
            return Err(Error::MissingAttribute("specversion"));
        }
        if !SUPPORTED_SPEC_VERSIONS.contains(&self.specversion.as_str()) {
            return Err(Error::UnsupportedSpecVersion(self.specversion.clone()));
        }
        if self.id.is_empty() {
            return Err(Error::MissingAttribute("id"));
        }
        validate_job_id(&self.id)?;
        if self.job_type.is_empty() {
            return Err(Error::MissingAttribute("type"));
        }
        validate_job_type(&self.job_type)?;
        validate_queue_name(&self.queue)?;
        let args = Path::Root("args");
        for (i, arg) in self.args.iter().enumerate() {
            check_value(arg, &Path::Index(&args, i), 1)?;
        }
        let meta = Path::Root("meta");
        for (k, v) in &self.meta {
            check_value(v, &Path::Key(&meta, k), 1)?;
        }
        let ext = Path::Root("extensions");
        for (k, v) in &self.extensions {
            if !k.starts_with("x-") {
                return Err(Error::invalid(
                    format!("extensions.{k}"),
                    "extension keys must follow x-{vendor}-{name}",
                ));
            }
            check_value(v, &Path::Key(&ext, k), 1)?;
        }
        if let Some(result) = &self.result {
            check_value(result, &Path::Root("result"), 0)?;
        }
        for (name, v) in [
            ("timeout", self.timeout),
            ("attempt", self.attempt),
            ("total_timeout", self.total_timeout),
            ("enqueue_ttl", self.enqueue_ttl),
            ("grace_period", self.grace_period),
            ("heartbeat_timeout", self.heartbeat_timeout),
            ("result_ttl", self.result_ttl),
        ] {
            if v < 0 {
                return Err(Error::invalid(
                    name,
                    format!("must not be negative, got {v}"),
                ));
            }
        }
        if let Some(retry) = &self.retry {
            retry.validate()?;
        }
        if let Some(unique) = &self.unique {
            unique.validate()?;
        }
        if let Some(error) = &self.error {
            error.validate("error")?;
        }
        for (i, entry) in self.errors.iter().enumerate() {
            validate_history_entry(i, entry)?;
        }
        Ok(())
    }
}

/// One `errors[i]` entry: an object with `code`, `message` (non-empty
/// strings), `attempt` (≥ 1) and `occurred_at` (RFC 3339); more is allowed.
fn validate_history_entry(i: usize, entry: &Value) -> Result<()> {
    let at = |k: &str| format!("errors[{i}].{k}");
    let Some(map) = entry.as_object() else {
        return Err(Error::invalid(format!("errors[{i}]"), "must be an object"));
    };
    for k in ["code", "message"] {
        match map.get(k) {
            Some(Value::String(s)) if !s.is_empty() => {}
            Some(_) => return Err(Error::invalid(at(k), "must be a non-empty string")),
            None => return Err(Error::invalid(at(k), "is required (schema: required)")),
        }
    }
    if let Some(t) = map.get("type") {
        if !t.is_string() {
            return Err(Error::invalid(at("type"), "must be a string"));
        }
    }
    match map.get("attempt").and_then(Value::as_i64) {
        Some(n) if n >= 1 => {}
        Some(_) => {
            return Err(Error::invalid(
                at("attempt"),
                "must be 1 or more (schema: minimum 1)",
            ))
        }
        None => return Err(Error::invalid(at("attempt"), "is required: an integer ≥ 1")),
    }
    match map.get("occurred_at").and_then(Value::as_str) {
        Some(t) if DateTime::parse_from_rfc3339(t).is_ok() => Ok(()),
        Some(t) => Err(Error::invalid(
            at("occurred_at"),
            format!("{t:?} is not an RFC 3339 date-time"),
        )),
        None => Err(Error::invalid(
            at("occurred_at"),
            "is required: an RFC 3339 date-time",
        )),
    }
}

/// `unique.keys` values (schema: enum).
const UNIQUE_KEYS: [&str; 4] = ["type", "queue", "args", "meta"];
/// `unique.on_conflict` values: the schema's, plus the protobuf binding's
/// `reschedule`.
const ON_CONFLICT: [&str; 5] = [
    "reject",
    "replace",
    "replace_except_schedule",
    "ignore",
    "reschedule",
];

fn no_duplicates(name: &str, items: &[String]) -> Result<()> {
    for (i, item) in items.iter().enumerate() {
        if items[..i].contains(item) {
            return Err(Error::invalid(
                name,
                format!("{item:?} appears twice (schema: uniqueItems)"),
            ));
        }
    }
    Ok(())
}

impl UniquePolicy {
    fn validate(&self) -> Result<()> {
        if !self.period.is_empty() {
            parse_iso8601_duration(&self.period)
                .map_err(|reason| Error::invalid("unique.period", reason))?;
        }
        if !self.on_conflict.is_empty() && !ON_CONFLICT.contains(&self.on_conflict.as_str()) {
            return Err(Error::invalid(
                "unique.on_conflict",
                format!(
                    "{:?} is not one of reject, replace, replace_except_schedule, ignore (schema: enum)",
                    self.on_conflict
                ),
            ));
        }
        for (i, k) in self.keys.iter().enumerate() {
            if !UNIQUE_KEYS.contains(&k.as_str()) {
                return Err(Error::invalid(
                    format!("unique.keys[{i}]"),
                    format!("{k:?} is not one of type, queue, args, meta (schema: enum)"),
                ));
            }
        }
        no_duplicates("unique.keys", &self.keys)?;
        if self.keys.iter().any(|k| k == "meta") && self.meta_keys.is_empty() {
            return Err(Error::invalid(
                "unique.meta_keys",
                "is required when unique.keys contains \"meta\" (schema: if/then required)",
            ));
        }
        for (name, list) in [
            ("unique.args_keys", &self.args_keys),
            ("unique.meta_keys", &self.meta_keys),
        ] {
            if list.iter().any(String::is_empty) {
                return Err(Error::invalid(
                    name,
                    "entries must not be empty (schema: minLength 1)",
                ));
            }
            no_duplicates(name, list)?;
        }
        for (i, state) in self.states.iter().enumerate() {
            if JobState::parse(state).is_none() {
                return Err(Error::invalid(
                    format!("unique.states[{i}]"),
                    format!("{state:?} is not an OJS state (schema: enum)"),
                ));
            }
        }
        no_duplicates("unique.states", &self.states)
    }
}

impl JobError {
    fn validate(&self, at: &str) -> Result<()> {
        if self.error_type.is_empty() {
            return Err(Error::invalid(
                format!("{at}.type"),
                "is required (schema: required, minLength 1)",
            ));
        }
        if self.message.is_empty() {
            return Err(Error::invalid(
                format!("{at}.message"),
                "is required (schema: required, minLength 1)",
            ));
        }
        if self.backtrace.len() > 50 {
            return Err(Error::invalid(
                format!("{at}.backtrace"),
                format!(
                    "has {} frames; at most 50 (schema: maxItems)",
                    self.backtrace.len()
                ),
            ));
        }
        Ok(())
    }
}

impl RetryPolicy {
    fn validate(&self) -> Result<()> {
        if self.max_attempts.is_some_and(|n| n < 0) {
            return Err(Error::invalid(
                "retry.max_attempts",
                "must be 0 or more (schema: minimum 0)",
            ));
        }
        for (name, v) in [
            ("retry.initial_interval", &self.initial_interval),
            ("retry.max_interval", &self.max_interval),
        ] {
            if !v.is_empty() {
                parse_iso8601_duration(v).map_err(|reason| Error::invalid(name, reason))?;
            }
        }
        // 0 is protobuf's "unset" (the default, 2.0); anything set is ≥ 1.
        if !self.backoff_coefficient.is_finite()
            || (self.backoff_coefficient != 0.0 && self.backoff_coefficient < 1.0)
        {
            return Err(Error::invalid(
                "retry.backoff_coefficient",
                format!(
                    "{} must be 1.0 or more (schema: minimum 1.0)",
                    self.backoff_coefficient
                ),
            ));
        }
        if !matches!(self.on_exhaustion.as_str(), "" | "discard" | "dead_letter") {
            return Err(Error::invalid(
                "retry.on_exhaustion",
                format!("{:?} is not discard or dead_letter", self.on_exhaustion),
            ));
        }
        Ok(())
    }
}

/// A new job id: UUIDv7, lowercase hyphenated.
pub fn new_job_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// Current time truncated to milliseconds, the precision brokers keep.
pub fn now_millis() -> DateTime<Utc> {
    let now = Utc::now();
    DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now)
}

/// `id` must be a lowercase hyphenated UUIDv7.
pub fn validate_job_id(id: &str) -> Result<()> {
    // Every envelope is checked as it is decoded and again before it is
    // encoded, so ids are checked several times a job: a valid one is
    // recognised in one pass over its bytes; the parse below names what
    // is wrong with one that is not.
    if is_lowercase_uuid_v7(id) {
        return Ok(());
    }
    job_id_error(id)
}

/// What [`validate_job_id`] takes, in one pass: 36 bytes, hyphens at 8,
/// 13, 18 and 23, the version digit `7` at 14, lowercase hex elsewhere.
fn is_lowercase_uuid_v7(id: &str) -> bool {
    let b = id.as_bytes();
    if b.len() != 36 || b[8] != b'-' || b[13] != b'-' || b[18] != b'-' || b[23] != b'-' {
        return false;
    }
    if b[14] != b'7' {
        return false;
    }
    [&b[..8], &b[9..13], &b[15..18], &b[19..23], &b[24..]]
        .iter()
        .all(|digits| digits.iter().all(|&d| LOWER_HEX[usize::from(d)]))
}

/// Which bytes are lowercase hex digits.
static LOWER_HEX: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = matches!(b as u8, b'0'..=b'9' | b'a'..=b'f');
        b += 1;
    }
    table
};

/// Why `id` is not a lowercase hyphenated UUIDv7 (`Ok` if it is one).
fn job_id_error(id: &str) -> Result<()> {
    let parsed = uuid::Uuid::try_parse(id)
        .map_err(|e| Error::invalid("id", format!("{id:?} is not a UUID: {e}")))?;
    if parsed.get_version_num() != 7 {
        return Err(Error::invalid(
            "id",
            format!(
                "{id:?} is a version {} UUID, OJS requires UUIDv7",
                parsed.get_version_num()
            ),
        ));
    }
    if id.len() != 36 || id.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(Error::invalid(
            "id",
            format!("{id:?} must be lowercase hyphenated (8-4-4-4-12)"),
        ));
    }
    Ok(())
}

/// Longest `type` (schema: `maxLength` 255).
pub const MAX_TYPE_LEN: usize = 255;
/// Longest `queue` (schema: `maxLength` 128).
pub const MAX_QUEUE_LEN: usize = 128;

/// `type`: `^[a-z][a-z0-9_-]*[a-z0-9_]?(\.…)*$` — the official JSON
/// Schema's dot-separated lowercase segments (`^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$`),
/// each also taking `-` inside it (not at its end), as the public OJS
/// servers, the official conformance cases and the SDKs' users do
/// (`retry.test.attempt-counter`); 1..=255 characters.
pub fn validate_job_type(job_type: &str) -> Result<()> {
    // As for ids: a valid type in one pass, an invalid one named below.
    if is_job_type(job_type) {
        return Ok(());
    }
    job_type_error(job_type)
}

/// What [`validate_job_type`] takes, in one pass over the bytes.
fn is_job_type(job_type: &str) -> bool {
    let bytes = job_type.as_bytes();
    if bytes.len() > MAX_TYPE_LEN {
        return false;
    }
    // At the start of a segment (none read yet, or a dot just read).
    let mut segment_start = true;
    let mut previous = 0u8;
    for &b in bytes {
        if b == b'.' {
            if segment_start || previous == b'-' {
                return false;
            }
            segment_start = true;
        } else if segment_start {
            if !b.is_ascii_lowercase() {
                return false;
            }
            segment_start = false;
        } else if !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-') {
            return false;
        }
        previous = b;
    }
    !segment_start && previous != b'-'
}

/// Why `job_type` is not a valid type (`Ok` if it is one).
fn job_type_error(job_type: &str) -> Result<()> {
    let segment_ok = |seg: &str| {
        let bytes = seg.as_bytes();
        bytes.first().is_some_and(u8::is_ascii_lowercase)
            && bytes.last() != Some(&b'-')
            && bytes
                .iter()
                .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    };
    if job_type.len() > MAX_TYPE_LEN {
        return Err(Error::invalid(
            "type",
            format!(
                "is {} characters; at most {MAX_TYPE_LEN} (schema: maxLength)",
                job_type.len()
            ),
        ));
    }
    if job_type.split('.').all(segment_ok) {
        Ok(())
    } else {
        Err(Error::invalid(
            "type",
            format!("{job_type:?} does not match ^[a-z][a-z0-9_-]*(\\.[a-z][a-z0-9_-]*)*$ with no segment ending in - (dot-separated lowercase segments, each starting with a letter; the schema's pattern, with - inside a segment as the public OJS servers take it)"),
        ))
    }
}

/// `queue`: `^[a-z0-9][a-z0-9\-\.]*$`, at most 128 characters (the official
/// JSON Schema).
pub fn validate_queue_name(queue: &str) -> Result<()> {
    let bytes = queue.as_bytes();
    if bytes.len() > MAX_QUEUE_LEN {
        return Err(Error::invalid(
            "queue",
            format!(
                "is {} characters; at most {MAX_QUEUE_LEN} (schema: maxLength)",
                bytes.len()
            ),
        ));
    }
    let ok = !bytes.is_empty()
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes
            .iter()
            .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "queue",
            format!("{queue:?} does not match ^[a-z0-9][a-z0-9\\-\\.]*$ (schema: pattern)"),
        ))
    }
}

/// The OJS type for a grpcq topic and action (docs/design.md §5): each segment of
/// `{topic}.{action}` in lowercase snake_case (`payment.PaymentService` /
/// `ProcessPayment` → `payment.payment_service.process_payment`), so that a
/// conformant OJS server accepts it. Characters outside `[a-z0-9_]` become
/// `_`; a segment that would start with a digit or `_` gets an `x` in front.
pub fn type_from_topic_action(topic: &str, action: &str) -> String {
    let mut out = String::with_capacity(topic.len() + action.len() + 8);
    for (i, segment) in topic.split('.').chain(std::iter::once(action)).enumerate() {
        if i > 0 {
            out.push('.');
        }
        push_snake_segment(&mut out, segment);
    }
    out
}

/// Appends `segment` in lowercase snake_case: `ProcessPayment` →
/// `process_payment`, `HTTPServer` → `http_server`, `v2Api` → `v2_api`.
pub fn push_snake_segment(out: &mut String, segment: &str) {
    let start = out.len();
    // Walked byte by byte with one of look-behind and one of look-ahead, no
    // buffer (this runs for every bridged call). Only ASCII letters, digits
    // and `_` are kept; every byte of any other character asks for one `_`,
    // and a `_` is never written twice in a row, so a multi-byte character
    // becomes one `_` as it would walked by `char`.
    let bytes = segment.as_bytes();
    let lower_or_digit = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let mut last_underscore = false;
    let mut i = 0;
    while let Some(&c) = bytes.get(i) {
        if lower_or_digit(&c) {
            // A run of lowercase letters and digits stays as it is: copied
            // at once. It starts and ends next to ASCII bytes, so the slice
            // is always there.
            let end = bytes[i..]
                .iter()
                .position(|b| !lower_or_digit(b))
                .map_or(bytes.len(), |n| i + n);
            out.push_str(segment.get(i..end).unwrap_or_default());
            last_underscore = false;
            i = end;
            continue;
        }
        if c.is_ascii_uppercase() {
            let prev = i.checked_sub(1).map(|p| bytes[p]);
            let next = bytes.get(i + 1);
            let boundary = prev.as_ref().is_some_and(lower_or_digit)
                || (prev.is_some_and(|p| p.is_ascii_uppercase())
                    && next.is_some_and(|n| n.is_ascii_lowercase()));
            if boundary && !last_underscore {
                out.push('_');
            }
            out.push(char::from(c.to_ascii_lowercase()));
            last_underscore = false;
        } else if c == b'_' || !last_underscore {
            // A `_` of the name is kept; any other byte asks for one.
            out.push('_');
            last_underscore = true;
        }
        i += 1;
    }
    // An empty name stays empty (and the type is refused as such).
    if out.len() > start && !out[start..].starts_with(|c: char| c.is_ascii_lowercase()) {
        out.insert(start, 'x');
    }
}

#[cfg(test)]
mod tests {
    mod one_pass_checks {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// The one-pass check of a type takes exactly what the
            /// segment-by-segment check that names errors takes.
            #[test]
            fn a_type_is_taken_as_the_check_that_names_errors_takes_it(
                t in "[a-z0-9_.A-Z -]{0,12}|([a-z][a-z0-9_-]{0,4}\\.){0,3}[a-z][a-z0-9_-]{0,4}[.-]?"
            ) {
                prop_assert_eq!(is_job_type(&t), job_type_error(&t).is_ok(), "{:?}", t);
            }

            /// The same for ids: UUIDs of every version, upper and lower
            /// case, with one byte changed.
            #[test]
            fn an_id_is_taken_as_the_parse_that_names_errors_takes_it(
                raw in any::<u128>(),
                version in 0u8..16,
                upper in any::<bool>(),
                change in proptest::option::of((0usize..40, any::<u8>())),
            ) {
                let mut id = uuid::Uuid::from_u128(raw).hyphenated().to_string();
                id.replace_range(14..15, &format!("{version:x}"));
                if upper {
                    id = id.to_uppercase();
                }
                let mut bytes = id.into_bytes();
                if let Some((at, b)) = change {
                    if at < bytes.len() {
                        bytes[at] = b;
                    } else {
                        bytes.push(b);
                    }
                }
                let id = String::from_utf8_lossy(&bytes).into_owned();
                prop_assert_eq!(is_lowercase_uuid_v7(&id), job_id_error(&id).is_ok(), "{:?}", id);
            }
        }

        #[test]
        fn the_one_pass_checks_take_what_they_should() {
            for t in ["a", "bench.noop", "retry.test.attempt-counter", "a_1.b-c_"] {
                assert!(is_job_type(t) && validate_job_type(t).is_ok(), "{t}");
            }
            for t in [
                "",
                "A",
                "a.",
                ".a",
                "a-",
                "a-.b",
                "a..b",
                "1a",
                "a b",
                &"a".repeat(256),
            ] {
                assert!(!is_job_type(t), "{t}");
                assert!(validate_job_type(t).is_err(), "{t}");
            }
            let id = "01939b4e-7c3a-7def-8123-456789abcdef";
            assert!(is_lowercase_uuid_v7(id) && validate_job_id(id).is_ok());
            for bad in [
                "01939B4E-7C3A-7DEF-8123-456789ABCDEF",
                "01939b4e-7c3a-4def-8123-456789abcdef",
                "01939b4e7c3a7def8123456789abcdef",
                "{01939b4e-7c3a-7def-8123-456789abcdef}",
                "01939b4e-7c3a-7def-8123-456789abcdeg",
            ] {
                assert!(!is_lowercase_uuid_v7(bad), "{bad}");
                assert!(validate_job_id(bad).is_err(), "{bad}");
            }
        }
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn builder_fills_required_attributes() {
        let job = JobEnvelope::new("email.send", vec![json!("a@b.c")]).with_queue("mail");
        job.validate().unwrap();
        assert_eq!(job.specversion, "1.0");
        assert_eq!(job.queue, "mail");
        assert!(job.created_at.is_some());
        assert_eq!(uuid::Uuid::parse_str(&job.id).unwrap().get_version_num(), 7);
    }

    #[test]
    fn ids_must_be_lowercase_uuidv7() {
        assert!(validate_job_id("019539a4-b68c-7def-8000-1a2b3c4d5e6f").is_ok());
        assert!(validate_job_id("019539A4-B68C-7DEF-8000-1A2B3C4D5E6F").is_err());
        assert!(validate_job_id("550e8400-e29b-41d4-a716-446655440000").is_err());
        assert!(validate_job_id("not-a-uuid").is_err());
    }

    #[test]
    fn names_follow_their_patterns() {
        assert!(validate_queue_name("default").is_ok());
        assert!(validate_queue_name("media.high-1").is_ok());
        for bad in ["", "Default", "-x", "a_b", "a b"] {
            assert!(validate_queue_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_queue_name(&"q".repeat(128)).is_ok());
        assert!(validate_queue_name(&"q".repeat(129)).is_err());
        assert!(validate_job_type("payment.payment_service.process_payment").is_ok());
        for good in ["retry.test.attempt-counter", "email-send", "a-b-c.d_e-9"] {
            assert!(validate_job_type(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "a b",
            "Email.send",
            "email-",
            "a.-b",
            "-a",
            "a.b-",
            "2fa.send",
            "a._b",
            "payment.PaymentService.ProcessPayment",
        ] {
            assert!(validate_job_type(bad).is_err(), "{bad:?}");
        }
        assert!(validate_job_type(&"a".repeat(255)).is_ok());
        assert!(validate_job_type(&"a".repeat(256)).is_err());
    }

    #[test]
    fn grpcq_names_become_valid_types() {
        for (topic, action, want) in [
            (
                "payment.PaymentService",
                "ProcessPayment",
                "payment.payment_service.process_payment",
            ),
            ("api.v2.HTTPServer", "GetURL", "api.v2.http_server.get_url"),
            ("email-svc.Mailer", "send_now", "email_svc.mailer.send_now"),
            ("a.B", "C", "a.b.c"),
            ("2fa.Codes", "Issue", "x2fa.codes.issue"),
        ] {
            let t = type_from_topic_action(topic, action);
            assert_eq!(t, want);
            validate_job_type(&t).unwrap();
        }
    }

    /// The char-by-char walk the byte walk replaced, kept as its
    /// reference: a job type must not change with the walk.
    fn snake_by_chars(segment: &str) -> String {
        let mut out = String::new();
        let mut prev: Option<char> = None;
        let mut chars = segment.chars().peekable();
        while let Some(c) = chars.next() {
            let next = chars.peek();
            if c.is_ascii_uppercase() {
                let boundary = prev.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit())
                    || (prev.is_some_and(|p| p.is_ascii_uppercase())
                        && next.is_some_and(|n| n.is_ascii_lowercase()));
                if boundary && !out.ends_with('_') {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            } else if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                out.push(c);
            } else if !out.ends_with('_') {
                out.push('_');
            }
            prev = Some(c);
        }
        if !out.is_empty() && !out.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.insert(0, 'x');
        }
        out
    }

    proptest::proptest! {
        #[test]
        fn snake_segments_are_what_the_char_walk_gave(segment in "[a-zA-Z0-9_.é€😀 -]{0,12}|.{0,12}") {
            let mut out = String::from("prefix.");
            push_snake_segment(&mut out, &segment);
            proptest::prop_assert_eq!(&out["prefix.".len()..], snake_by_chars(&segment));
        }
    }

    #[test]
    fn policy_values_are_checked() {
        let mut job = JobEnvelope::new("a.b", vec![]);
        job.retry = Some(RetryPolicy {
            on_exhaustion: "explode".into(),
            ..RetryPolicy::default()
        });
        assert!(
            matches!(job.validate(), Err(Error::InvalidAttribute { attribute, .. }) if attribute == "retry.on_exhaustion")
        );
        job.retry = Some(RetryPolicy {
            initial_interval: "1 second".into(),
            ..RetryPolicy::default()
        });
        assert!(
            matches!(job.validate(), Err(Error::InvalidAttribute { attribute, .. }) if attribute == "retry.initial_interval")
        );
        job.retry = None;
        job.timeout = -1;
        assert!(job.validate().is_err());
    }
}
