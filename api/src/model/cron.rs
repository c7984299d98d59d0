//! Cron jobs: a named schedule that pushes a job built from its template at
//! every time its expression names, in its time zone.
//!
//! What is here is pure: reading a registration (either binding's field
//! names), the schedule's next time after an instant, the id of the job a
//! slot fires (the same for the same slot, so that a slot fired twice —
//! a leader that stalled past its lease, a crash between the push and the
//! record of it — is one job), and what the overlap policy says of the
//! previous run. The firing loop is `crate::cron`.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SubsecRound, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use ojs_core::JobState;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Longest cron name.
pub const MAX_NAME_CHARS: usize = 255;
/// Longest description.
pub const MAX_DESCRIPTION_CHARS: usize = 1_000;
/// The execution timeout and visibility of a fired job whose template
/// names none: the core spec's default timeout (30 minutes) rather than
/// the binding's 30 s, because scheduled work is mostly batch work that
/// runs longer than a request, and a job handed out again before its run
/// ended would overlap itself.
pub const DEFAULT_FIRED_TIMEOUT_MS: u64 = 30 * 60 * 1000;

/// What a slot does while the job of an earlier slot has not finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// No job for this slot (the default).
    #[default]
    Skip,
    /// A job for every slot, whatever runs.
    Allow,
    /// The earlier job is cancelled, then this slot's is pushed.
    CancelPrevious,
    /// A job for every slot; they wait on the queue behind each other.
    Enqueue,
}

impl Overlap {
    /// The name the bindings use.
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::Allow => "allow",
            Overlap::CancelPrevious => "cancel_previous",
            Overlap::Enqueue => "enqueue",
        }
    }

    fn parse(name: &str) -> Option<Overlap> {
        Some(match name {
            "skip" => Overlap::Skip,
            "allow" => Overlap::Allow,
            "cancel_previous" => Overlap::CancelPrevious,
            "enqueue" => Overlap::Enqueue,
            _ => return None,
        })
    }
}

/// What a due slot does, given the state of the job of the last slot that
/// fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotAction {
    /// Push this slot's job.
    Fire,
    /// Cancel the earlier job, then push this slot's.
    CancelThenFire,
    /// No job for this slot.
    Skip,
}

impl Overlap {
    /// What a slot does when the last fired job is in `previous` (none: no
    /// job fired yet, or it is gone).
    pub fn decide(self, previous: Option<JobState>) -> SlotAction {
        let running = previous.is_some_and(|s| !is_final(s));
        match (self, running) {
            (_, false) | (Overlap::Allow | Overlap::Enqueue, true) => SlotAction::Fire,
            (Overlap::Skip, true) => SlotAction::Skip,
            (Overlap::CancelPrevious, true) => SlotAction::CancelThenFire,
        }
    }
}

fn is_final(state: JobState) -> bool {
    matches!(
        state,
        JobState::Completed | JobState::Cancelled | JobState::Discarded
    )
}

/// A parsed expression in its zone.
#[derive(Debug, Clone)]
pub struct Schedule {
    times: Times,
    zone: Tz,
}

/// What a schedule names.
#[derive(Debug, Clone)]
enum Times {
    /// The times a cron expression names.
    Cron(Box<Cron>),
    /// Every `interval` from `anchor` (`@every 5m`), whatever the zone.
    Every {
        interval: Duration,
        anchor: DateTime<Utc>,
    },
}

/// Shortest `@every` interval: the firing loop's resolution is a second.
pub const MIN_EVERY: Duration = Duration::from_secs(1);
/// Longest `@every` interval.
pub const MAX_EVERY: Duration = Duration::from_secs(366 * 86_400);

impl Schedule {
    /// Reads `expression` (5 fields, or 6 with seconds first, an
    /// `@hourly`-style name, or `@every <duration>` in Go's duration form
    /// such as `90s`, `5m`, `1h30m`) in the IANA zone `timezone`. Errors
    /// name the field (`expression`, `timezone`). An `@every` schedule
    /// counts from the epoch here; a cron's from its registration
    /// ([`Schedule::anchored`]).
    pub fn parse(expression: &str, timezone: &str) -> Result<Schedule, ApiError> {
        Self::anchored(expression, timezone, DateTime::<Utc>::UNIX_EPOCH)
    }

    /// [`Schedule::parse`], an `@every` schedule counting from `anchor` (a
    /// cron's last registration or change).
    pub fn anchored(
        expression: &str,
        timezone: &str,
        anchor: DateTime<Utc>,
    ) -> Result<Schedule, ApiError> {
        let zone = zone(timezone)?;
        let trimmed = expression.trim();
        if trimmed.is_empty() {
            return Err(ApiError::invalid(
                "expression",
                "the cron expression is empty",
            ));
        }
        if trimmed.len() > 256 {
            return Err(ApiError::invalid(
                "expression",
                "the cron expression is longer than 256 characters",
            ));
        }
        if let Some(interval) = trimmed
            .get(..6)
            .filter(|head| head.eq_ignore_ascii_case("@every"))
            .map(|_| trimmed[6..].trim())
        {
            let interval = go_duration(interval)
                .filter(|d| (MIN_EVERY..=MAX_EVERY).contains(d))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "expression",
                        format!("{trimmed:?} is not an interval from 1s to 8784h: @every takes a duration such as 90s, 5m or 1h30m"),
                    )
                })?;
            return Ok(Schedule {
                times: Times::Every { interval, anchor },
                zone,
            });
        }
        // croner knows every name the spec lists but `@midnight`.
        let text = if trimmed.eq_ignore_ascii_case("@midnight") {
            "@daily"
        } else {
            trimmed
        };
        if text.starts_with('@') && !NAMES.iter().any(|n| text.eq_ignore_ascii_case(n)) {
            return Err(ApiError::invalid(
                "expression",
                format!(
                    "{trimmed:?} is not a schedule name this server knows ({}, @midnight)",
                    NAMES.join(", ")
                ),
            ));
        }
        let fields = text.split_whitespace().count();
        if !text.starts_with('@') && !(5..=6).contains(&fields) {
            return Err(ApiError::invalid(
                "expression",
                format!("{trimmed:?} has {fields} fields; a cron expression has 5 (minute hour day-of-month month day-of-week) or 6 (seconds first)"),
            ));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(text)
            .map_err(|e| {
                ApiError::invalid(
                    "expression",
                    format!("{trimmed:?} is not a valid cron expression: {e}"),
                )
            })?;
        let schedule = Schedule {
            times: Times::Cron(Box::new(cron)),
            zone,
        };
        // An expression that names no real time (`0 0 31 2 *`) never fires.
        if schedule.next_after(DateTime::<Utc>::UNIX_EPOCH).is_none() {
            return Err(ApiError::invalid(
                "expression",
                format!("{trimmed:?} names no time that exists"),
            ));
        }
        Ok(schedule)
    }

    /// The first time of the schedule strictly after `t`; none when there is
    /// none (the parser searches a bounded range of years).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.times {
            Times::Cron(cron) => {
                // Slots are whole seconds: the search starts at `t`'s second
                // (a slot in it has passed, strictly after is after it).
                let local = t.trunc_subsecs(0).with_timezone(&self.zone);
                cron.find_next_occurrence(&local, false)
                    .ok()
                    .map(|at| at.with_timezone(&Utc).trunc_subsecs(0))
            }
            Times::Every { interval, anchor } => {
                let step = i64::try_from(interval.as_millis()).ok()?.max(1);
                let since = (t - *anchor).num_milliseconds();
                let k = if since < 0 { 0 } else { since / step + 1 };
                anchor.checked_add_signed(chrono::Duration::milliseconds(k.checked_mul(step)?))
            }
        }
    }
}

/// A duration in Go's form (`300ms`, `90s`, `5m`, `1h30m`, `1.5h`): one or
/// more numbers, each with its unit (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`).
fn go_duration(text: &str) -> Option<Duration> {
    let mut rest = text;
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * seconds;
    }
    (total.is_finite() && total <= MAX_EVERY.as_secs_f64() * 2.0)
        .then(|| Duration::from_secs_f64(total))
}

/// The schedule names (besides `@midnight`).
const NAMES: [&str; 6] = [
    "@yearly",
    "@annually",
    "@monthly",
    "@weekly",
    "@daily",
    "@hourly",
];

/// An IANA zone name. Abbreviations and offsets (`EST`, `+05:00`, `UTC+5`)
/// are refused: they do not follow daylight saving as the place does.
fn zone(name: &str) -> Result<Tz, ApiError> {
    let refuse = || {
        ApiError::invalid(
            "timezone",
            format!("{name:?} is not an IANA time zone name (such as UTC, Europe/Berlin, America/New_York)"),
        )
    };
    if name != "UTC" && !name.contains('/') {
        return Err(refuse());
    }
    Tz::from_str(name).map_err(|_| refuse())
}

/// A cron job as stored: its registration and what its firing keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CronJob {
    /// Its name, unique on the server.
    pub name: String,
    /// The expression as registered.
    pub expression: String,
    /// The IANA zone it is evaluated in.
    pub timezone: String,
    /// What a slot does while an earlier job runs.
    pub overlap: Overlap,
    /// Whether it fires.
    pub enabled: bool,
    /// Free text.
    pub description: Option<String>,
    /// The PUSH body every slot pushes: `type`, `args`, and `meta` and
    /// `options` when given (`options.queue` holds the queue).
    pub template: Map<String, Value>,
    /// When it was registered.
    pub created_at: DateTime<Utc>,
    /// When it was last changed.
    pub updated_at: DateTime<Utc>,
    /// The slot fired last.
    pub last_run_at: Option<DateTime<Utc>>,
    /// The next slot; none while disabled.
    pub next_run_at: Option<DateTime<Utc>>,
    /// Slots fired (jobs pushed).
    pub run_count: u64,
    /// Slots skipped by the overlap policy.
    #[serde(default)]
    pub skip_count: u64,
    /// The job of the last slot that fired.
    pub last_job_id: Option<String>,
    /// Random, set at registration: the ids of its jobs derive from it, so
    /// that a name registered again does not find its predecessor's jobs.
    pub salt: String,
}

impl CronJob {
    /// A registration from a JSON body, in any of the field names clients
    /// use: the expression in `cron`, `expression` or `schedule`; the job in
    /// `job_template` or at the top level (`type`, `args`, `meta`,
    /// `options`, `queue`). Fields the server keeps (`next_run_at`,
    /// `run_count`, …) are ignored; unknown fields are refused.
    pub fn from_json(body: Value, now: DateTime<Utc>) -> Result<CronJob, ApiError> {
        let Value::Object(body) = body else {
            return Err(ApiError::invalid(
                "",
                "the body must be a JSON object with `name`, `cron` and the job",
            ));
        };
        for key in body.keys() {
            if !FIELDS.contains(&key.as_str()) && !SERVER_OWNED.contains(&key.as_str()) {
                return Err(ApiError::invalid(
                    key.clone(),
                    format!("{key:?} is not a field of a cron job"),
                ));
            }
        }
        let name = match body.get("name") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(ApiError::invalid("name", "`name` must be a string")),
            None => return Err(ApiError::invalid("name", "`name` is required")),
        };
        check_name(&name)?;
        let mut expression = None::<(&str, &str)>;
        for key in ["cron", "expression", "schedule"] {
            match body.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => match expression {
                    Some((_, e)) if e != s => {
                        return Err(ApiError::invalid(
                            key,
                            format!("`{key}` differs from the expression given in another field"),
                        ))
                    }
                    _ => expression = Some((key, s)),
                },
                Some(_) => return Err(ApiError::invalid(key, format!("`{key}` must be a string"))),
            }
        }
        let Some((_, expression)) = expression else {
            return Err(ApiError::invalid(
                "cron",
                "the schedule is required (`cron`, also read as `expression` or `schedule`)",
            ));
        };
        let timezone = match body.get("timezone") {
            None | Some(Value::Null) => "UTC".to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(ApiError::invalid("timezone", "`timezone` must be a string")),
        };
        let schedule = Schedule::anchored(expression, &timezone, now)?;
        let overlap = match body.get("overlap_policy") {
            None | Some(Value::Null) => Overlap::Skip,
            Some(Value::String(s)) => Overlap::parse(s).ok_or_else(|| {
                ApiError::invalid(
                    "overlap_policy",
                    format!(
                        "{s:?} is not an overlap policy (skip, allow, cancel_previous, enqueue)"
                    ),
                )
            })?,
            Some(_) => {
                return Err(ApiError::invalid(
                    "overlap_policy",
                    "`overlap_policy` must be a string",
                ))
            }
        };
        let enabled = match body.get("enabled") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("enabled", "`enabled` must be a boolean")),
        };
        let description = match body.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.chars().count() <= MAX_DESCRIPTION_CHARS => Some(s.clone()),
            Some(Value::String(_)) => {
                return Err(ApiError::invalid(
                    "description",
                    format!("`description` is longer than {MAX_DESCRIPTION_CHARS} characters"),
                ))
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "description",
                    "`description` must be a string",
                ))
            }
        };
        let template = template(&body)?;
        Ok(CronJob {
            name,
            expression: expression.trim().to_owned(),
            timezone,
            overlap,
            enabled,
            description,
            template,
            created_at: now,
            updated_at: now,
            last_run_at: None,
            next_run_at: if enabled {
                schedule.next_after(now)
            } else {
                None
            },
            run_count: 0,
            skip_count: 0,
            last_job_id: None,
            salt: uuid::Uuid::new_v4().simple().to_string(),
        })
    }

    /// The schedule (the stored expression was checked when registered).
    pub fn schedule(&self) -> Result<Schedule, ApiError> {
        Schedule::anchored(&self.expression, &self.timezone, self.updated_at)
    }

    /// The queue its jobs go to.
    pub fn queue(&self) -> &str {
        self.template
            .get("options")
            .and_then(|o| o.get("queue"))
            .and_then(Value::as_str)
            .unwrap_or("default")
    }

    /// The job type of its jobs.
    pub fn job_type(&self) -> &str {
        self.template
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// The PUSH body of the job that `slot` fires: the template, the slot's
    /// id, `meta.cron_name` and `meta.cron_triggered_at`, and the fired
    /// job's default timeout and visibility where the template names none.
    pub fn fire_body(&self, slot: DateTime<Utc>) -> Value {
        let mut body = self.template.clone();
        body.insert("id".into(), json!(self.fire_id(slot)));
        let meta = body
            .entry("meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(meta) = meta {
            meta.insert("cron_name".into(), json!(self.name));
            meta.insert(
                "cron_triggered_at".into(),
                json!(crate::job::timestamp(slot)),
            );
        }
        let options = body
            .entry("options")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(options) = options {
            options
                .entry("timeout_ms")
                .or_insert(json!(DEFAULT_FIRED_TIMEOUT_MS));
            options
                .entry("visibility_timeout_ms")
                .or_insert(json!(DEFAULT_FIRED_TIMEOUT_MS));
        }
        Value::Object(body)
    }

    /// The id of the job `slot` fires: a UUIDv7 whose time is the slot's
    /// and whose other bits are a digest of the cron's salt and the slot.
    pub fn fire_id(&self, slot: DateTime<Utc>) -> String {
        let ms = u64::try_from(slot.timestamp_millis()).unwrap_or(0) & 0xFFFF_FFFF_FFFF;
        let digest = Sha256::new()
            .chain_update(self.salt.as_bytes())
            .chain_update(slot.timestamp_millis().to_be_bytes())
            .finalize();
        let mut bytes = [0u8; 16];
        bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
        bytes[6..].copy_from_slice(&digest[..10]);
        bytes[6] = 0x70 | (bytes[6] & 0x0F);
        bytes[8] = 0x80 | (bytes[8] & 0x3F);
        uuid::Uuid::from_bytes(bytes).to_string()
    }

    /// The cron as both bindings' clients read it: every name a client
    /// looks for (`cron`, `expression`, `schedule`; the job at the top
    /// level and as `job_template`).
    pub fn to_json(&self) -> Value {
        let time = |t: Option<DateTime<Utc>>| t.map(crate::job::timestamp);
        let options = self.template.get("options").cloned().unwrap_or(json!({}));
        json!({
            "name": self.name,
            "id": self.name,
            "cron": self.expression,
            "expression": self.expression,
            "schedule": self.expression,
            "timezone": self.timezone,
            "type": self.job_type(),
            "queue": self.queue(),
            "args": self.template.get("args").cloned().unwrap_or(json!([])),
            "meta": self.template.get("meta").cloned().unwrap_or(json!({})),
            "options": options,
            "job_template": Value::Object(self.template.clone()),
            "overlap_policy": self.overlap.as_str(),
            "enabled": self.enabled,
            "status": if self.enabled { "active" } else { "disabled" },
            "description": self.description,
            "last_run_at": time(self.last_run_at),
            "next_run_at": time(self.next_run_at),
            "run_count": self.run_count,
            "skip_count": self.skip_count,
            "created_at": crate::job::timestamp(self.created_at),
            "updated_at": crate::job::timestamp(self.updated_at),
        })
    }
}

/// Fields a registration may carry.
const FIELDS: [&str; 14] = [
    "name",
    "cron",
    "expression",
    "schedule",
    "timezone",
    "type",
    "args",
    "meta",
    "options",
    "queue",
    "job_template",
    "overlap_policy",
    "enabled",
    "description",
];

/// Fields the server keeps, which a client may send back (a cron it read)
/// and which are ignored.
const SERVER_OWNED: [&str; 9] = [
    "id",
    "status",
    "last_run_at",
    "next_run_at",
    "run_count",
    "skip_count",
    "created_at",
    "updated_at",
    "salt",
];

/// A cron name: lowercase letters and digits, then also `-` and `.`.
pub fn check_name(name: &str) -> Result<(), ApiError> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let rest_ok =
        chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if !first_ok || !rest_ok || name.len() > MAX_NAME_CHARS {
        return Err(ApiError::invalid(
            "name",
            format!("{name:?} is not a cron name: lowercase letters, digits, '-' and '.', starting with a letter or digit, at most {MAX_NAME_CHARS} characters"),
        ));
    }
    Ok(())
}

/// The job template of a registration: `job_template`, or the top-level
/// job fields; `queue` at either level goes into `options.queue`.
fn template(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let (source, prefix) = match body.get("job_template") {
        None | Some(Value::Null) => (body, ""),
        Some(Value::Object(t)) => {
            for key in ["type", "args", "meta", "options"] {
                if body.contains_key(key) {
                    return Err(ApiError::invalid(
                        key,
                        format!("`{key}` is given both at the top level and in `job_template`"),
                    ));
                }
            }
            for key in t.keys() {
                if !["type", "args", "meta", "options", "queue"].contains(&key.as_str()) {
                    return Err(ApiError::invalid(
                        format!("job_template.{key}"),
                        format!("{key:?} is not a field of a job template (type, args, meta, options, queue)"),
                    ));
                }
            }
            (t, "job_template.")
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "job_template",
                "`job_template` must be an object",
            ))
        }
    };
    let mut template = Map::new();
    match source.get("type") {
        Some(Value::String(t)) => {
            template.insert("type".into(), json!(t));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{prefix}type"),
                "`type` must be a string",
            ))
        }
        None => {
            return Err(ApiError::invalid(
                format!("{prefix}type"),
                "the job's `type` is required",
            ))
        }
    }
    match source.get("args") {
        None | Some(Value::Null) => {
            template.insert("args".into(), json!([]));
        }
        Some(a @ Value::Array(_)) => {
            template.insert("args".into(), a.clone());
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{prefix}args"),
                "`args` must be an array",
            ))
        }
    }
    match source.get("meta") {
        None | Some(Value::Null) => {}
        Some(m @ Value::Object(_)) => {
            template.insert("meta".into(), m.clone());
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{prefix}meta"),
                "`meta` must be an object",
            ))
        }
    }
    let mut options = match source.get("options") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{prefix}options"),
                "`options` must be an object",
            ))
        }
    };
    for forbidden in ["delay_until", "scheduled_at", "pending"] {
        if options.contains_key(forbidden) {
            return Err(ApiError::invalid(
                format!("{prefix}options.{forbidden}"),
                format!("a cron job's jobs run at its slots: `options.{forbidden}` is not taken"),
            ));
        }
    }
    let queue = source.get("queue").or_else(|| body.get("queue"));
    match queue {
        None | Some(Value::Null) => {}
        Some(Value::String(q)) => match options.get("queue") {
            Some(Value::String(o)) if o != q => {
                return Err(ApiError::invalid(
                    format!("{prefix}queue"),
                    "`queue` differs from `options.queue`",
                ))
            }
            _ => {
                options.insert("queue".into(), json!(q));
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{prefix}queue"),
                "`queue` must be a string",
            ))
        }
    }
    if !options.is_empty() {
        template.insert("options".into(), Value::Object(options));
    }
    Ok(template)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn next(expr: &str, zone: &str, after: &str) -> String {
        let s = Schedule::parse(expr, zone).unwrap();
        crate::job::timestamp(s.next_after(at(after)).unwrap())
    }

    #[test]
    fn five_and_six_fields_and_the_names() {
        assert_eq!(
            next("*/5 * * * *", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-01T10:05:00.000Z"
        );
        assert_eq!(
            next("30 * * * * *", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-01T10:02:30.000Z"
        );
        assert_eq!(
            next("@daily", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-02T00:00:00.000Z"
        );
        assert_eq!(
            next("@midnight", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-02T00:00:00.000Z"
        );
        assert_eq!(
            next("@hourly", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-01T11:00:00.000Z"
        );
        // 2026-01-04 is a Sunday.
        assert_eq!(
            next("@weekly", "UTC", "2026-01-01T10:02:00Z"),
            "2026-01-04T00:00:00.000Z"
        );
        assert_eq!(
            next("@monthly", "UTC", "2026-01-01T10:02:00Z"),
            "2026-02-01T00:00:00.000Z"
        );
        assert_eq!(
            next("@yearly", "UTC", "2026-01-01T10:02:00Z"),
            "2027-01-01T00:00:00.000Z"
        );
        // Names of months and days, any case; 7 is Sunday too.
        assert_eq!(
            next("0 9 * jan mon", "UTC", "2026-01-01T00:00:00Z"),
            "2026-01-05T09:00:00.000Z"
        );
        assert_eq!(
            next("0 9 * * 7", "UTC", "2026-01-01T00:00:00Z"),
            "2026-01-04T09:00:00.000Z"
        );
        // Last day of the month.
        assert_eq!(
            next("0 0 L * *", "UTC", "2026-02-01T00:00:00Z"),
            "2026-02-28T00:00:00.000Z"
        );
        // Strictly after, in whole seconds.
        assert_eq!(
            next("0 * * * *", "UTC", "2026-01-01T10:00:00Z"),
            "2026-01-01T11:00:00.000Z"
        );
        assert_eq!(
            next("* * * * * *", "UTC", "2026-01-01T10:00:00.704Z"),
            "2026-01-01T10:00:01.000Z"
        );
        assert_eq!(
            next("* * * * *", "UTC", "2026-01-01T10:00:59.999Z"),
            "2026-01-01T10:01:00.000Z"
        );
    }

    #[test]
    fn every_counts_intervals_from_its_anchor() {
        let anchor = at("2026-01-01T10:00:07Z");
        let s = Schedule::anchored("@every 1h30m", "UTC", anchor).unwrap();
        let next = |t: &str| crate::job::timestamp(s.next_after(at(t)).unwrap());
        assert_eq!(next("2026-01-01T10:00:07Z"), "2026-01-01T11:30:07.000Z");
        assert_eq!(next("2026-01-01T09:00:00Z"), "2026-01-01T10:00:07.000Z");
        assert_eq!(next("2026-01-01T13:00:00Z"), "2026-01-01T13:00:07.000Z");
        let s = Schedule::anchored("@EVERY 90s", "Europe/Berlin", anchor).unwrap();
        assert_eq!(
            crate::job::timestamp(s.next_after(anchor).unwrap()),
            "2026-01-01T10:01:37.000Z"
        );
        for d in ["1.5h", "300ms5s", "2h45m30s"] {
            assert!(go_duration(d).is_some(), "{d}");
        }
        assert_eq!(go_duration("1.5h"), Some(Duration::from_secs(5400)));
    }

    #[test]
    fn zones_follow_the_place_and_its_daylight_saving() {
        // 09:00 in Tokyo (UTC+9, no daylight saving) and New York (EST).
        assert_eq!(
            next("0 9 * * *", "Asia/Tokyo", "2026-01-01T00:00:00Z"),
            "2026-01-02T00:00:00.000Z"
        );
        assert_eq!(
            next("0 9 * * *", "America/New_York", "2026-01-01T00:00:00Z"),
            "2026-01-01T14:00:00.000Z"
        );
        // In summer New York is UTC−4.
        assert_eq!(
            next("0 9 * * *", "America/New_York", "2026-07-01T00:00:00Z"),
            "2026-07-01T13:00:00.000Z"
        );
        // 01:30 happens twice on 2026-11-01 in New York: it fires once, at
        // the first (EDT, UTC−4).
        let s = Schedule::parse("30 1 * * *", "America/New_York").unwrap();
        let first = s.next_after(at("2026-11-01T04:00:00Z")).unwrap();
        assert_eq!(crate::job::timestamp(first), "2026-11-01T05:30:00.000Z");
        let then = s.next_after(first).unwrap();
        assert_eq!(crate::job::timestamp(then), "2026-11-02T06:30:00.000Z");
    }

    #[test]
    fn a_time_skipped_by_spring_forward_fires_once_when_the_clocks_jump() {
        // 02:30 does not exist on 2026-03-08 in New York (02:00 EST is
        // 03:00 EDT): the slot fires at the jump, as Vixie cron runs it,
        // rather than not at all that day; the day after at 02:30 EDT.
        let s = Schedule::parse("30 2 * * *", "America/New_York").unwrap();
        let jump = s.next_after(at("2026-03-08T05:00:00Z")).unwrap();
        assert_eq!(crate::job::timestamp(jump), "2026-03-08T07:00:00.000Z");
        let then = s.next_after(jump).unwrap();
        assert_eq!(crate::job::timestamp(then), "2026-03-09T06:30:00.000Z");
    }

    #[test]
    fn bad_expressions_and_zones_name_their_field() {
        for bad in [
            "not a valid cron",
            "0 0 0 0 0 0 0",
            "99 25 32 13 8",
            "",
            "*/0 * * * *",
            "@every",
            "@every 0s",
            "@every 5 minutes",
            "@every 10000h",
            "@sometimes",
            "0 0 31 2 *",
            "* * * *",
        ] {
            let e = Schedule::parse(bad, "UTC").unwrap_err();
            match e {
                ApiError::InvalidRequest {
                    attribute, message, ..
                } => {
                    assert_eq!(attribute.as_deref(), Some("expression"), "{bad}");
                    assert!(!message.is_empty());
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        for bad in ["EST", "+05:00", "UTC+5", "Mars/Olympus", "", "utc"] {
            let e = Schedule::parse("* * * * *", bad).unwrap_err();
            assert!(
                matches!(&e, ApiError::InvalidRequest { attribute: Some(a), .. } if a == "timezone"),
                "{bad}: {e:?}"
            );
        }
        assert!(Schedule::parse("31 * * * *", "Europe/Berlin").is_ok());
    }

    #[test]
    fn a_registration_reads_every_client_s_field_names() {
        let now = at("2026-01-01T10:02:03Z");
        let test_style = CronJob::from_json(
            json!({"name": "a.b-1", "expression": "0 * * * *", "overlap_policy": "allow",
                   "job_template": {"type": "t.x", "args": [1], "options": {"queue": "q"}}}),
            now,
        )
        .unwrap();
        assert_eq!(test_style.queue(), "q");
        assert_eq!(test_style.overlap, Overlap::Allow);
        assert_eq!(test_style.next_run_at, Some(at("2026-01-01T11:00:00Z")));
        let doc_style = CronJob::from_json(
            json!({"name": "a", "cron": "0 * * * *", "timezone": "UTC", "type": "t.x",
                   "args": [1], "queue": "q", "next_run_at": "ignored"}),
            now,
        )
        .unwrap();
        assert_eq!(doc_style.template, test_style.template);
        let ui_style = CronJob::from_json(
            json!({"name": "a", "schedule": "0 * * * *", "type": "t.x", "enabled": false}),
            now,
        )
        .unwrap();
        assert_eq!(ui_style.queue(), "default");
        assert_eq!(ui_style.next_run_at, None);
        let out = test_style.to_json();
        for key in ["cron", "expression", "schedule"] {
            assert_eq!(out[key], "0 * * * *");
        }
        assert_eq!(out["job_template"]["type"], "t.x");
        assert_eq!(out["status"], "active");
    }

    #[test]
    fn bad_registrations_name_their_field() {
        let now = at("2026-01-01T10:02:03Z");
        let cases = [
            (json!({"cron": "* * * * *", "type": "t"}), "name"),
            (
                json!({"name": "Upper", "cron": "* * * * *", "type": "t"}),
                "name",
            ),
            (
                json!({"name": "-a", "cron": "* * * * *", "type": "t"}),
                "name",
            ),
            (
                json!({"name": "a_b", "cron": "* * * * *", "type": "t"}),
                "name",
            ),
            (json!({"name": "a", "type": "t"}), "cron"),
            (
                json!({"name": "a", "cron": "* * * * *", "expression": "0 * * * *", "type": "t"}),
                "expression",
            ),
            (json!({"name": "a", "cron": "* * * * *"}), "type"),
            (
                json!({"name": "a", "cron": "* * * * *", "job_template": {"args": []}}),
                "job_template.type",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "job_template": {"type": "t", "when": 1}}),
                "job_template.when",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "args": {}}),
                "args",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "overlap_policy": "never"}),
                "overlap_policy",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "enabled": "yes"}),
                "enabled",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "colour": "red"}),
                "colour",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "options": {"delay_until": "2026-01-01T00:00:00Z"}}),
                "options.delay_until",
            ),
            (
                json!({"name": "a", "cron": "* * * * *", "type": "t", "timezone": "CET"}),
                "timezone",
            ),
        ];
        for (body, field) in cases {
            match CronJob::from_json(body.clone(), now) {
                Err(ApiError::InvalidRequest { attribute, .. }) => {
                    assert_eq!(attribute.as_deref(), Some(field), "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_slot_s_job_id_is_a_uuidv7_of_its_time_and_the_same_for_the_same_slot() {
        let now = at("2026-01-01T10:02:03Z");
        let cron = CronJob::from_json(json!({"name": "a", "cron": "* * * * *", "type": "t"}), now)
            .unwrap();
        let slot = at("2026-01-01T10:03:00Z");
        let id = cron.fire_id(slot);
        assert_eq!(id, cron.fire_id(slot));
        assert_ne!(id, cron.fire_id(at("2026-01-01T10:04:00Z")));
        let parsed = uuid::Uuid::parse_str(&id).unwrap();
        assert_eq!(parsed.get_version_num(), 7);
        let (secs, nanos) = parsed.get_timestamp().unwrap().to_unix();
        assert_eq!(
            secs as i64 * 1000 + i64::from(nanos / 1_000_000),
            slot.timestamp_millis()
        );
        // A cron registered again under the name fires other ids.
        let again = CronJob::from_json(json!({"name": "a", "cron": "* * * * *", "type": "t"}), now)
            .unwrap();
        assert_ne!(again.fire_id(slot), id);
        let body = cron.fire_body(slot);
        assert_eq!(body["id"], id);
        assert_eq!(body["meta"]["cron_name"], "a");
        assert_eq!(
            body["meta"]["cron_triggered_at"],
            "2026-01-01T10:03:00.000Z"
        );
        assert_eq!(body["options"]["timeout_ms"], DEFAULT_FIRED_TIMEOUT_MS);
        let job = crate::job::from_json(body, now).unwrap();
        assert_eq!(job.envelope.id, id);
    }

    #[test]
    fn overlap_decides_by_the_last_job_s_state() {
        use JobState as S;
        for state in [
            S::Available,
            S::Active,
            S::Scheduled,
            S::Retryable,
            S::Pending,
        ] {
            assert_eq!(Overlap::Skip.decide(Some(state)), SlotAction::Skip);
            assert_eq!(
                Overlap::CancelPrevious.decide(Some(state)),
                SlotAction::CancelThenFire
            );
            assert_eq!(Overlap::Allow.decide(Some(state)), SlotAction::Fire);
            assert_eq!(Overlap::Enqueue.decide(Some(state)), SlotAction::Fire);
        }
        for state in [
            Some(S::Completed),
            Some(S::Cancelled),
            Some(S::Discarded),
            None,
        ] {
            for policy in [
                Overlap::Skip,
                Overlap::CancelPrevious,
                Overlap::Allow,
                Overlap::Enqueue,
            ] {
                assert_eq!(policy.decide(state), SlotAction::Fire);
            }
        }
    }
}
