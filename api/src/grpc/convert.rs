//! `ojs.v1` messages to and from the job the HTTP binding reads and shows.
//!
//! An `Enqueue` becomes the JSON body of a PUSH and goes through the same
//! validation ([`crate::job::from_json`]), so a rule of what a client may
//! send lives in one place; a stored job becomes an `ojs.v1.Job` straight
//! from its envelope ([`job_message`]).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::duration::{format_iso8601_duration, parse_iso8601_duration};
use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Timestamp};
use serde_json::{json, Map, Number, Value};

use super::pb;
use crate::error::ApiError;

/// A protobuf `Value` as JSON. Numbers that are whole (and fit) become
/// integers, so `1` pushed over gRPC reads back as `1` over HTTP.
pub fn value_to_json(v: prost_types::Value) -> Value {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::NumberValue(n)) => number(n),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(value_to_json).collect()),
        Some(Kind::StructValue(s)) => Value::Object(struct_to_json(s)),
    }
}

fn number(n: f64) -> Value {
    // Whole numbers within the range a double holds exactly.
    if n.fract() == 0.0 && n.abs() < 9_007_199_254_740_992.0 {
        return json!(n as i64);
    }
    // NaN and the infinities have no JSON form; the envelope's own rules
    // then refuse the job by name.
    Number::from_f64(n).map_or(Value::Null, Value::Number)
}

/// A protobuf `Struct` as a JSON object.
pub fn struct_to_json(s: Struct) -> Map<String, Value> {
    s.fields
        .into_iter()
        .map(|(k, v)| (k, value_to_json(v)))
        .collect()
}

/// JSON as a protobuf `Value`.
pub fn json_to_value(v: &Value) -> prost_types::Value {
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(json_to_value).collect(),
        }),
        Value::Object(m) => Kind::StructValue(json_to_struct(m)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// A JSON object as a protobuf `Struct`.
pub fn json_to_struct(m: &Map<String, Value>) -> Struct {
    Struct {
        fields: m
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// A protobuf `Timestamp` as the binding's RFC 3339 text.
pub fn timestamp_text(t: &Timestamp, attribute: &str) -> Result<String, ApiError> {
    let nanos = u32::try_from(t.nanos)
        .map_err(|_| ApiError::invalid(attribute, "nanos must be from 0 to 999,999,999"))?;
    DateTime::<Utc>::from_timestamp(t.seconds, nanos)
        .map(crate::job::timestamp)
        .ok_or_else(|| ApiError::invalid(attribute, "is not a representable time"))
}

/// RFC 3339 text as a protobuf `Timestamp`; `None` when it does not parse
/// (never for what the store wrote).
pub fn text_timestamp(s: &str) -> Option<Timestamp> {
    let t = DateTime::parse_from_rfc3339(s).ok()?;
    Some(Timestamp {
        seconds: t.timestamp(),
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    })
}

/// A time as a protobuf `Timestamp`.
pub fn time_stamp(t: DateTime<Utc>) -> Timestamp {
    Timestamp {
        seconds: t.timestamp(),
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

/// A protobuf `Duration` in whole milliseconds, refused when negative.
pub fn millis(d: &prost_types::Duration, attribute: &str) -> Result<u64, ApiError> {
    if d.seconds < 0 || d.nanos < 0 {
        return Err(ApiError::invalid(attribute, "must not be negative"));
    }
    Ok((d.seconds as u64)
        .saturating_mul(1000)
        .saturating_add(d.nanos as u64 / 1_000_000))
}

/// Milliseconds as a protobuf `Duration`.
pub fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// The PUSH body an `Enqueue` (or a batch entry with its defaults) stands
/// for. Zero values are "not set", as proto3 has no other way to say so.
pub fn enqueue_body(
    job_type: String,
    args: Vec<prost_types::Value>,
    options: Option<pb::EnqueueOptions>,
    defaults: Option<&pb::EnqueueOptions>,
    traceparent: Option<&str>,
) -> Result<Value, ApiError> {
    let mut body = Map::new();
    body.insert("type".into(), Value::String(job_type));
    body.insert(
        "args".into(),
        Value::Array(args.into_iter().map(value_to_json).collect()),
    );
    let mut opts = Map::new();
    let mut meta = Map::new();
    for o in defaults.into_iter().chain(options.as_ref()) {
        fold_options(o, &mut opts, &mut meta)?;
    }
    if let Some(tp) = traceparent {
        meta.entry("traceparent")
            .or_insert_with(|| Value::String(tp.to_owned()));
    }
    if !meta.is_empty() {
        body.insert("meta".into(), Value::Object(meta));
    }
    if !opts.is_empty() {
        body.insert("options".into(), Value::Object(opts));
    }
    Ok(body.into())
}

fn fold_options(
    o: &pb::EnqueueOptions,
    opts: &mut Map<String, Value>,
    meta: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    if !o.queue.is_empty() {
        opts.insert("queue".into(), json!(o.queue));
    }
    if o.priority != 0 {
        opts.insert("priority".into(), json!(o.priority));
    }
    if let Some(t) = &o.delay_until {
        opts.insert(
            "scheduled_at".into(),
            json!(timestamp_text(t, "options.delay_until")?),
        );
    }
    if let Some(d) = &o.timeout {
        opts.insert("timeout_ms".into(), json!(millis(d, "options.timeout")?));
    }
    if let Some(d) = &o.visibility_timeout {
        opts.insert(
            "visibility_timeout_ms".into(),
            json!(millis(d, "options.visibility_timeout")?),
        );
    }
    if let Some(d) = &o.ttl {
        let ms = millis(d, "options.ttl")?;
        let at = i64::try_from(ms)
            .ok()
            .and_then(chrono::Duration::try_milliseconds)
            .and_then(|d| Utc::now().checked_add_signed(d))
            .ok_or_else(|| ApiError::invalid("options.ttl", "is too long"))?;
        opts.insert("expires_at".into(), json!(crate::job::timestamp(at)));
    }
    let mut retry = opts
        .remove("retry")
        .and_then(|r| match r {
            Value::Object(m) => Some(m),
            _ => None,
        })
        .unwrap_or_default();
    if o.max_attempts != 0 {
        retry.insert("max_attempts".into(), json!(o.max_attempts));
    }
    if let Some(r) = &o.retry {
        if r.max_attempts != 0 {
            // The policy's own count wins over the shorthand.
            retry.insert("max_attempts".into(), json!(r.max_attempts));
        }
        if let Some(d) = &r.initial_interval {
            let ms = millis(d, "options.retry.initial_interval")?;
            retry.insert(
                "initial_interval".into(),
                json!(format_iso8601_duration(Duration::from_millis(ms))),
            );
        }
        if r.backoff_coefficient != 0.0 {
            retry.insert("backoff_coefficient".into(), json!(r.backoff_coefficient));
        }
        if let Some(d) = &r.max_interval {
            let ms = millis(d, "options.retry.max_interval")?;
            retry.insert(
                "max_interval".into(),
                json!(format_iso8601_duration(Duration::from_millis(ms))),
            );
        }
        // Unset: the spec's default.
        retry.insert("jitter".into(), json!(r.jitter.unwrap_or(true)));
        if !r.non_retryable_errors.is_empty() {
            retry.insert("non_retryable_errors".into(), json!(r.non_retryable_errors));
        }
        if !r.on_exhaustion.is_empty() {
            retry.insert("on_exhaustion".into(), json!(r.on_exhaustion));
        }
    }
    if !retry.is_empty() {
        opts.insert("retry".into(), Value::Object(retry));
    }
    if let Some(u) = &o.unique {
        let mut unique = Map::new();
        if !u.key.is_empty() {
            unique.insert("keys".into(), json!(u.key));
        }
        if let Some(d) = &u.period {
            let ms = millis(d, "options.unique.period")?;
            unique.insert(
                "period".into(),
                json!(format_iso8601_duration(Duration::from_millis(ms))),
            );
        }
        for (key, list) in [("args_keys", &u.args_keys), ("meta_keys", &u.meta_keys)] {
            if !list.is_empty() {
                unique.insert(key.into(), json!(list));
            }
        }
        let on_conflict = match pb::UniqueConflictAction::try_from(u.on_conflict) {
            Ok(pb::UniqueConflictAction::Replace) => Some("replace"),
            Ok(pb::UniqueConflictAction::ReplaceExceptSchedule) => Some("replace_except_schedule"),
            Ok(pb::UniqueConflictAction::Ignore) => Some("ignore"),
            Ok(pb::UniqueConflictAction::Reject) => Some("reject"),
            _ => None,
        };
        if let Some(c) = on_conflict {
            unique.insert("on_conflict".into(), json!(c));
        }
        let states: Vec<&str> = u
            .states
            .iter()
            .filter_map(|s| pb::JobState::try_from(*s).ok())
            .filter_map(state_name)
            .collect();
        if !states.is_empty() {
            unique.insert("states".into(), json!(states));
        }
        opts.insert("unique".into(), Value::Object(unique));
    }
    if !o.tags.is_empty() {
        opts.insert("tags".into(), json!(o.tags));
    }
    if let Some(m) = &o.meta {
        meta.extend(struct_to_json(m.clone()));
    }
    if !o.trace_id.is_empty() {
        meta.insert("trace_id".into(), json!(o.trace_id));
    }
    Ok(())
}

/// The binding's state name of an `ojs.v1.JobState`.
pub fn state_name(s: pb::JobState) -> Option<&'static str> {
    Some(match s {
        pb::JobState::Unspecified => return None,
        pb::JobState::Scheduled => "scheduled",
        pb::JobState::Available => "available",
        pb::JobState::Pending => "pending",
        pb::JobState::Active => "active",
        pb::JobState::Completed => "completed",
        pb::JobState::Retryable => "retryable",
        pb::JobState::Cancelled => "cancelled",
        pb::JobState::Discarded => "discarded",
    })
}

/// The `ojs.v1.JobState` of a state name.
pub fn state_of(name: &str) -> pb::JobState {
    match name {
        "scheduled" => pb::JobState::Scheduled,
        "available" => pb::JobState::Available,
        "pending" => pb::JobState::Pending,
        "active" => pb::JobState::Active,
        "completed" => pb::JobState::Completed,
        "retryable" => pb::JobState::Retryable,
        "cancelled" => pb::JobState::Cancelled,
        "discarded" => pb::JobState::Discarded,
        _ => pb::JobState::Unspecified,
    }
}

fn int(v: Option<&Value>) -> i32 {
    v.and_then(Value::as_i64)
        .and_then(|n| i32::try_from(n).ok())
        .unwrap_or(0)
}

fn text(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or("").to_owned()
}

fn stamp(v: Option<&Value>) -> Option<Timestamp> {
    v.and_then(Value::as_str).and_then(text_timestamp)
}

fn object(v: Option<&Value>) -> Option<Struct> {
    match v? {
        Value::Object(m) => Some(json_to_struct(m)),
        Value::Null => None,
        // A result that is not an object keeps its value under `value`:
        // the binding's `result` is a Struct.
        other => Some(json_to_struct(
            &[("value".to_owned(), other.clone())].into_iter().collect(),
        )),
    }
}

fn job_error(e: &Value) -> pb::JobError {
    let backtrace = match e.get("backtrace") {
        Some(Value::Array(lines)) => lines
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        other => text(other),
    };
    pb::JobError {
        code: e
            .get("code")
            .or_else(|| e.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        message: text(e.get("message")),
        retryable: e.get("retryable").and_then(Value::as_bool).unwrap_or(false),
        attempt: int(e.get("attempt")),
        occurred_at: stamp(e.get("occurred_at")),
        backtrace,
        details: object(e.get("details")),
    }
}

/// An ISO 8601 duration of a policy as a protobuf `Duration`; unset when
/// empty (or, for a stored policy, unreadable).
fn policy_duration(text: &str) -> Option<prost_types::Duration> {
    if text.is_empty() {
        return None;
    }
    let d = parse_iso8601_duration(text).ok()?;
    Some(duration(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
}

/// The `ojs.v1.Job` of a stored job, read from its envelope (the fields the
/// envelope has no room for travel as its top-level attributes:
/// `timeout_ms`, `visibility_timeout_ms`, `tags`).
pub fn job_message(job: &crate::Job) -> pb::Job {
    let e = &job.envelope;
    let attribute = |k: &str| e.unknown_attributes.get(k);
    let retry = e.retry.as_ref().map(|r| pb::RetryPolicy {
        max_attempts: r.max_attempts.unwrap_or(0),
        initial_interval: policy_duration(&r.initial_interval),
        backoff_coefficient: r.backoff_coefficient,
        max_interval: policy_duration(&r.max_interval),
        jitter: Some(r.jitter),
        non_retryable_errors: r.non_retryable_errors.clone(),
        on_exhaustion: r.on_exhaustion.clone(),
    });
    let unique = e.unique.as_ref().map(|u| pb::UniquePolicy {
        key: u.keys.clone(),
        period: policy_duration(&u.period),
        on_conflict: match u.on_conflict.as_str() {
            "reject" => pb::UniqueConflictAction::Reject as i32,
            "replace" => pb::UniqueConflictAction::Replace as i32,
            "replace_except_schedule" => pb::UniqueConflictAction::ReplaceExceptSchedule as i32,
            "ignore" => pb::UniqueConflictAction::Ignore as i32,
            _ => pb::UniqueConflictAction::Unspecified as i32,
        },
        states: u.states.iter().map(|s| state_of(s) as i32).collect(),
        args_keys: u.args_keys.clone(),
        meta_keys: u.meta_keys.clone(),
    });
    // The history when there is one, else the last error alone.
    let errors: Vec<pb::JobError> = if e.errors.is_empty() {
        e.error
            .iter()
            .map(|last| pb::JobError {
                code: last.error_type.clone(),
                message: last.message.clone(),
                backtrace: last.backtrace.join("\n"),
                ..pb::JobError::default()
            })
            .collect()
    } else {
        e.errors.iter().map(job_error).collect()
    };
    let timeout = attribute("timeout_ms")
        .and_then(Value::as_u64)
        .or_else(|| {
            u64::try_from(e.timeout)
                .ok()
                .filter(|s| *s > 0)
                .map(|s| s.saturating_mul(1000))
        })
        .map(duration);
    let meta_text = |k: &str| {
        e.meta
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    pb::Job {
        id: e.id.clone(),
        r#type: e.job_type.clone(),
        queue: e.queue.clone(),
        args: e.args.iter().map(json_to_value).collect(),
        meta: Some(json_to_struct(&e.meta)),
        state: state_of(e.state.and_then(|s| s.as_str()).unwrap_or("")) as i32,
        priority: e.priority,
        attempt: e.attempt,
        max_attempts: crate::job::max_attempts(e),
        retry_policy: retry,
        unique_policy: unique,
        result: object(e.result.as_ref()),
        errors,
        created_at: e.created_at.map(time_stamp),
        enqueued_at: e.enqueued_at.map(time_stamp),
        scheduled_at: e.scheduled_at.map(time_stamp),
        started_at: e.started_at.map(time_stamp),
        completed_at: e.completed_at.map(time_stamp),
        expires_at: e.expires_at.map(time_stamp),
        timeout,
        visibility_timeout: attribute("visibility_timeout_ms")
            .and_then(Value::as_u64)
            .map(duration),
        tags: strings(attribute("tags")),
        trace_id: meta_text("trace_id"),
        workflow_id: meta_text("workflow_id"),
        specversion: e.specversion.clone(),
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The NACK error object of a `JobError`.
pub fn failure_error(e: Option<pb::JobError>) -> Map<String, Value> {
    let mut m = Map::new();
    let Some(e) = e else {
        return m;
    };
    if !e.code.is_empty() {
        m.insert("code".into(), json!(e.code));
    }
    m.insert("message".into(), json!(e.message));
    m.insert("retryable".into(), json!(e.retryable));
    if !e.backtrace.is_empty() {
        m.insert(
            "backtrace".into(),
            json!(e.backtrace.lines().collect::<Vec<_>>()),
        );
    }
    if let Some(d) = e.details {
        m.insert("details".into(), Value::Object(struct_to_json(d)));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_the_round_trip_and_whole_numbers_stay_integers() {
        let v = json!({"a": [1, 2.5, "x", null, true, {"b": -3}], "big": 1e300});
        assert_eq!(value_to_json(json_to_value(&v)), v);
        assert_eq!(value_to_json(json_to_value(&json!(7))), json!(7));
    }

    #[test]
    fn an_enqueue_becomes_the_push_body_the_http_binding_reads() {
        let options = pb::EnqueueOptions {
            queue: "mail".into(),
            priority: 5,
            max_attempts: 4,
            tags: vec!["t".into()],
            trace_id: "abc".into(),
            timeout: Some(duration(1500)),
            ..Default::default()
        };
        let body = enqueue_body(
            "email.send".into(),
            vec![json_to_value(&json!("a@b.c"))],
            Some(options),
            None,
            Some("00-1-2-01"),
        )
        .unwrap();
        assert_eq!(
            body,
            json!({
                "type": "email.send",
                "args": ["a@b.c"],
                "meta": {"trace_id": "abc", "traceparent": "00-1-2-01"},
                "options": {"queue": "mail", "priority": 5, "timeout_ms": 1500,
                            "retry": {"max_attempts": 4}, "tags": ["t"]},
            })
        );
    }

    #[test]
    fn a_negative_duration_is_refused_by_name() {
        let options = pb::EnqueueOptions {
            timeout: Some(prost_types::Duration {
                seconds: -1,
                nanos: 0,
            }),
            ..Default::default()
        };
        let e = enqueue_body("a.b".into(), vec![], Some(options), None, None).unwrap_err();
        assert!(e.to_string().contains("negative"), "{e}");
        assert_eq!(e.details(), Some(json!({"attribute": "options.timeout"})));
    }
}
