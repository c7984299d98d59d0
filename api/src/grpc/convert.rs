//! `ojs.v1` messages to and from the job the HTTP binding reads and shows.
//!
//! An `Enqueue` becomes an envelope field by field ([`enqueue_job`]) and
//! then passes the checks every PUSH passes ([`crate::job::accept`]), so a
//! rule of what a client may send lives in one place and no JSON is made on
//! the way; a stored job becomes an `ojs.v1.Job` straight from its envelope
//! ([`job_message`]).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::duration::{format_iso8601_duration, parse_iso8601_duration};
use ojs_core::envelope::{new_job_id, RetryPolicy, UniquePolicy};
use ojs_core::JobEnvelope;
use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Timestamp};
use serde_json::{json, Map, Number, Value};

use super::pb;
use crate::error::ApiError;
use crate::job::Job;

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

/// A protobuf `Timestamp` as a time, refused by name when it is not one.
pub fn time_of(t: &Timestamp, attribute: &str) -> Result<DateTime<Utc>, ApiError> {
    let nanos = u32::try_from(t.nanos)
        .map_err(|_| ApiError::invalid(attribute, "nanos must be from 0 to 999,999,999"))?;
    DateTime::<Utc>::from_timestamp(t.seconds, nanos)
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

/// The job an `Enqueue` (or a batch entry with the batch's defaults) asks
/// for: the protobuf fields go straight onto the envelope, then through the
/// checks every PUSH passes ([`crate::job::accept`]). Zero values are "not
/// set", as proto3 has no other way to say so; an entry's options override
/// the defaults field by field, with the retry policy and `meta` merged.
pub fn enqueue_job(
    job_type: String,
    args: Vec<prost_types::Value>,
    options: Option<pb::EnqueueOptions>,
    defaults: Option<&pb::EnqueueOptions>,
    traceparent: Option<&str>,
    now: DateTime<Utc>,
) -> Result<Job, ApiError> {
    if job_type.is_empty() {
        return Err(ApiError::invalid("type", "`type` is required"));
    }
    let args = args.into_iter().map(value_to_json).collect();
    let mut envelope = JobEnvelope::with_id(new_job_id(), job_type, args);
    for o in defaults.into_iter().chain(options.as_ref()) {
        apply_options(o, &mut envelope, now)?;
    }
    if let Some(tp) = traceparent {
        envelope
            .meta
            .entry("traceparent")
            .or_insert_with(|| Value::String(tp.to_owned()));
    }
    crate::job::accept(envelope, false, now)
}

/// A `RegisterCron` as the registration body both bindings read
/// (`model::cron::CronJob::from_json`): the job is built as an `Enqueue`
/// of it would be, so its options are checked the same way, and kept as
/// the PUSH options each slot's job is made of. A TTL or a delay is not
/// taken: every slot's job runs at its slot.
pub fn cron_body(r: pb::RegisterCronRequest, now: DateTime<Utc>) -> Result<Value, ApiError> {
    if let Some(o) = &r.options {
        if o.ttl.is_some() {
            return Err(ApiError::invalid(
                "options.ttl",
                "a cron job's jobs take no TTL here",
            ));
        }
        if o.delay_until.is_some() {
            return Err(ApiError::invalid(
                "options.delay_until",
                "a cron job's jobs run at its slots: `options.delay_until` is not taken",
            ));
        }
    }
    let job = enqueue_job(r.r#type, r.args, r.options, None, None, now)?;
    let mut body = push_body_of(&job);
    body["name"] = json!(r.name);
    body["cron"] = json!(r.cron);
    if !r.timezone.is_empty() {
        body["timezone"] = json!(r.timezone);
    }
    Ok(body)
}

/// A job read from gRPC as the HTTP binding's PUSH body of it.
fn push_body_of(job: &Job) -> Value {
    let stored = job.to_json();
    let mut options = Map::new();
    options.insert("queue".into(), json!(job.envelope.queue));
    for key in [
        "priority",
        "retry",
        "unique",
        "tags",
        "timeout_ms",
        "visibility_timeout_ms",
    ] {
        match stored.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if key == "priority" && n.as_i64() == Some(0) => {}
            Some(v) => {
                options.insert(key.into(), v.clone());
            }
        }
    }
    let mut body = json!({
        "type": job.envelope.job_type,
        "args": job.envelope.args,
        "options": options,
    });
    if !job.envelope.meta.is_empty() {
        body["meta"] = Value::Object(job.envelope.meta.clone());
    }
    for key in ["scheduled_at", "expires_at"] {
        if let Some(v) = stored.get(key).filter(|v| !v.is_null()) {
            body[key] = v.clone();
        }
    }
    body
}

/// A `CreateWorkflowRequest` as the HTTP binding's workflow body (the
/// graph form: ids and `depends_on`); a step's options are read as an
/// `Enqueue`'s, and refusals name the step (`steps[1].options.priority`).
pub fn workflow_body(r: pb::CreateWorkflowRequest, now: DateTime<Utc>) -> Result<Value, ApiError> {
    let mut steps = Vec::with_capacity(r.steps.len());
    for (i, step) in r.steps.into_iter().enumerate() {
        let job = enqueue_job(step.r#type, step.args, step.options, None, None, now)
            .map_err(|e| e.under(&format!("steps[{i}]")))?;
        let mut body = push_body_of(&job);
        if !step.id.is_empty() {
            body["id"] = json!(step.id);
        }
        body["depends_on"] = json!(step.depends_on);
        steps.push(body);
    }
    let mut body = json!({"steps": steps});
    if !r.name.is_empty() {
        body["name"] = json!(r.name);
    }
    Ok(body)
}

/// A workflow as the gRPC binding answers it.
pub fn workflow(view: &crate::workflow::WorkflowView) -> pb::Workflow {
    use crate::model::workflow::State;
    let w = view.to_json();
    let state = match view.workflow.state {
        State::Running => pb::WorkflowState::Running,
        State::Completed => pb::WorkflowState::Completed,
        State::Failed => pb::WorkflowState::Failed,
        State::Cancelled => pb::WorkflowState::Cancelled,
    };
    let steps = w["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let text = |k: &str| s[k].as_str().unwrap_or_default().to_owned();
            pb::WorkflowStepStatus {
                id: text("id"),
                r#type: text("type"),
                state: match s["state"].as_str().unwrap_or_default() {
                    "waiting" => pb::WorkflowStepState::Waiting,
                    "pending" => pb::WorkflowStepState::Pending,
                    "active" => pb::WorkflowStepState::Active,
                    "completed" => pb::WorkflowStepState::Completed,
                    "failed" => pb::WorkflowStepState::Failed,
                    "cancelled" => pb::WorkflowStepState::Cancelled,
                    _ => pb::WorkflowStepState::Unspecified,
                } as i32,
                job_id: text("job_id"),
                depends_on: s["depends_on"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect(),
            }
        })
        .collect();
    pb::Workflow {
        id: view.workflow.id.clone(),
        name: view.workflow.name.clone().unwrap_or_default(),
        state: state as i32,
        steps,
        created_at: Some(time_stamp(view.workflow.created_at)),
        completed_at: view.workflow.finished_at.map(time_stamp),
    }
}

/// A cron job as `ListCron` answers it.
pub fn cron_entry(cron: &crate::model::cron::CronJob) -> pb::CronEntry {
    let options = cron.template.get("options");
    let ms = |key: &str| {
        options
            .and_then(|o| o.get(key))
            .and_then(Value::as_u64)
            .map(duration)
    };
    pb::CronEntry {
        name: cron.name.clone(),
        cron: cron.expression.clone(),
        timezone: cron.timezone.clone(),
        r#type: cron.job_type().to_owned(),
        args: cron
            .template
            .get("args")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(json_to_value).collect())
            .unwrap_or_default(),
        options: Some(pb::EnqueueOptions {
            queue: cron.queue().to_owned(),
            priority: int(options.and_then(|o| o.get("priority"))),
            timeout: ms("timeout_ms"),
            visibility_timeout: ms("visibility_timeout_ms"),
            tags: strings(options.and_then(|o| o.get("tags"))),
            meta: object(cron.template.get("meta")),
            ..pb::EnqueueOptions::default()
        }),
        next_run_at: cron.next_run_at.map(time_stamp),
        last_run_at: cron.last_run_at.map(time_stamp),
    }
}

fn apply_options(
    o: &pb::EnqueueOptions,
    envelope: &mut JobEnvelope,
    now: DateTime<Utc>,
) -> Result<(), ApiError> {
    if !o.queue.is_empty() {
        envelope.queue.clone_from(&o.queue);
    }
    if o.priority != 0 {
        envelope.priority = o.priority;
    }
    if let Some(t) = &o.delay_until {
        envelope.scheduled_at = Some(whole_millis(time_of(t, "options.delay_until")?));
    }
    if let Some(d) = &o.timeout {
        crate::job::set_timeout_ms(envelope, millis(d, "options.timeout")?);
    }
    if let Some(d) = &o.visibility_timeout {
        let ms = millis(d, "options.visibility_timeout")?;
        crate::job::check_visibility_timeout("options.visibility_timeout", ms)?;
        envelope
            .unknown_attributes
            .insert("visibility_timeout_ms".into(), json!(ms));
    }
    if let Some(d) = &o.ttl {
        let ms = millis(d, "options.ttl")?;
        let at = i64::try_from(ms)
            .ok()
            .and_then(chrono::Duration::try_milliseconds)
            .and_then(|d| now.checked_add_signed(d))
            .ok_or_else(|| ApiError::invalid("options.ttl", "is too long"))?;
        envelope.expires_at = Some(whole_millis(at));
    }
    if o.max_attempts != 0 || o.retry.is_some() {
        let retry = envelope.retry.get_or_insert_with(RetryPolicy::default);
        if o.max_attempts != 0 {
            retry.max_attempts = Some(o.max_attempts);
        }
        if let Some(r) = &o.retry {
            apply_retry(r, retry)?;
        }
    }
    if let Some(u) = &o.unique {
        envelope.unique = Some(unique_policy(u)?);
    }
    if !o.tags.is_empty() {
        crate::job::check_tags("options.tags", &o.tags)?;
        envelope
            .unknown_attributes
            .insert("tags".into(), json!(o.tags));
    }
    if let Some(m) = &o.meta {
        envelope.meta.extend(struct_to_json(m.clone()));
    }
    if !o.trace_id.is_empty() {
        envelope.meta.insert("trace_id".into(), json!(o.trace_id));
    }
    Ok(())
}

fn apply_retry(r: &pb::RetryPolicy, retry: &mut RetryPolicy) -> Result<(), ApiError> {
    if r.max_attempts != 0 {
        // The policy's own count wins over the shorthand.
        retry.max_attempts = Some(r.max_attempts);
    }
    if let Some(d) = &r.initial_interval {
        retry.initial_interval = iso_duration(d, "options.retry.initial_interval")?;
    }
    if r.backoff_coefficient != 0.0 {
        retry.backoff_coefficient = r.backoff_coefficient;
    }
    if let Some(d) = &r.max_interval {
        retry.max_interval = iso_duration(d, "options.retry.max_interval")?;
    }
    // Unset: the spec's default.
    retry.jitter = r.jitter.unwrap_or(true);
    if !r.non_retryable_errors.is_empty() {
        retry
            .non_retryable_errors
            .clone_from(&r.non_retryable_errors);
    }
    if !r.on_exhaustion.is_empty() {
        retry.on_exhaustion.clone_from(&r.on_exhaustion);
    }
    Ok(())
}

fn unique_policy(u: &pb::UniquePolicy) -> Result<UniquePolicy, ApiError> {
    let mut unique = UniquePolicy {
        keys: u.key.clone(),
        args_keys: u.args_keys.clone(),
        meta_keys: u.meta_keys.clone(),
        ..UniquePolicy::default()
    };
    if let Some(d) = &u.period {
        unique.period = iso_duration(d, "options.unique.period")?;
    }
    let on_conflict = match pb::UniqueConflictAction::try_from(u.on_conflict) {
        Ok(pb::UniqueConflictAction::Replace) => "replace",
        Ok(pb::UniqueConflictAction::ReplaceExceptSchedule) => "replace_except_schedule",
        Ok(pb::UniqueConflictAction::Ignore) => "ignore",
        Ok(pb::UniqueConflictAction::Reject) => "reject",
        _ => "",
    };
    unique.on_conflict = on_conflict.to_owned();
    unique.states = u
        .states
        .iter()
        .filter_map(|s| pb::JobState::try_from(*s).ok())
        .filter_map(state_name)
        .map(str::to_owned)
        .collect();
    Ok(unique)
}

/// A protobuf `Duration` as the ISO 8601 text a policy carries.
fn iso_duration(d: &prost_types::Duration, attribute: &str) -> Result<String, ApiError> {
    Ok(format_iso8601_duration(Duration::from_millis(millis(
        d, attribute,
    )?)))
}

/// A time at the precision the binding keeps (milliseconds).
fn whole_millis(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap_or(t)
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

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    /// The same job asked for over gRPC and as an HTTP PUSH body: both
    /// bindings must store the same job, id aside.
    fn same_job(
        options: pb::EnqueueOptions,
        defaults: Option<pb::EnqueueOptions>,
        traceparent: Option<&str>,
        body: Value,
    ) {
        let now = at("2026-01-02T03:04:05.678Z");
        let args = vec![json_to_value(&json!("a@b.c")), json_to_value(&json!(2))];
        let over_grpc = enqueue_job(
            "email.send".into(),
            args,
            Some(options),
            defaults.as_ref(),
            traceparent,
            now,
        )
        .unwrap();
        let mut over_http = crate::job::from_json(body, now).unwrap();
        over_http.envelope.id.clone_from(&over_grpc.envelope.id);
        assert_eq!(over_grpc, over_http);
    }

    #[test]
    fn an_enqueue_stores_the_job_the_same_push_over_http_stores() {
        same_job(
            pb::EnqueueOptions {
                queue: "mail".into(),
                priority: 5,
                max_attempts: 4,
                tags: vec!["t".into()],
                trace_id: "abc".into(),
                timeout: Some(duration(1500)),
                ..Default::default()
            },
            None,
            Some("00-1-2-01"),
            json!({
                "type": "email.send",
                "args": ["a@b.c", 2],
                "meta": {"trace_id": "abc", "traceparent": "00-1-2-01"},
                "options": {"queue": "mail", "priority": 5, "timeout_ms": 1500,
                            "retry": {"max_attempts": 4}, "tags": ["t"]},
            }),
        );
        same_job(
            pb::EnqueueOptions {
                delay_until: Some(time_stamp(at("2026-01-02T04:00:00.123456Z"))),
                ttl: Some(duration(60_000)),
                visibility_timeout: Some(duration(30_000)),
                retry: Some(pb::RetryPolicy {
                    max_attempts: 7,
                    initial_interval: Some(duration(2000)),
                    backoff_coefficient: 1.5,
                    max_interval: Some(duration(60_000)),
                    jitter: Some(false),
                    non_retryable_errors: vec!["Fatal".into()],
                    on_exhaustion: "dead_letter".into(),
                }),
                unique: Some(pb::UniquePolicy {
                    key: vec!["type".into(), "args".into()],
                    period: Some(duration(3_600_000)),
                    on_conflict: pb::UniqueConflictAction::Replace as i32,
                    states: vec![pb::JobState::Available as i32],
                    args_keys: vec![],
                    meta_keys: vec!["tenant".into()],
                }),
                meta: Some(json_to_struct(json!({"tenant": "t1"}).as_object().unwrap())),
                ..Default::default()
            },
            Some(pb::EnqueueOptions {
                queue: "bulk".into(),
                meta: Some(json_to_struct(
                    json!({"from": "batch"}).as_object().unwrap(),
                )),
                max_attempts: 2,
                ..Default::default()
            }),
            None,
            json!({
                "type": "email.send",
                "args": ["a@b.c", 2],
                "meta": {"from": "batch", "tenant": "t1"},
                "options": {
                    "queue": "bulk",
                    "scheduled_at": "2026-01-02T04:00:00.123Z",
                    "expires_at": "2026-01-02T03:05:05.678Z",
                    "visibility_timeout_ms": 30000,
                    "retry": {"max_attempts": 7, "initial_interval": "PT2S",
                              "backoff_coefficient": 1.5, "max_interval": "PT60S",
                              "jitter": false, "non_retryable_errors": ["Fatal"],
                              "on_exhaustion": "dead_letter"},
                    "unique": {"keys": ["type", "args"], "period": "PT3600S",
                               "on_conflict": "replace", "states": ["available"],
                               "meta_keys": ["tenant"]},
                },
            }),
        );
    }

    #[test]
    fn what_the_http_binding_refuses_an_enqueue_is_refused_for_by_name() {
        let refused = |options: pb::EnqueueOptions| {
            enqueue_job("a.b".into(), vec![], Some(options), None, None, Utc::now())
                .unwrap_err()
                .details()
        };
        assert_eq!(
            refused(pb::EnqueueOptions {
                priority: 101,
                ..Default::default()
            }),
            Some(json!({"attribute": "options.priority"}))
        );
        assert_eq!(
            refused(pb::EnqueueOptions {
                visibility_timeout: Some(duration(999)),
                ..Default::default()
            }),
            Some(json!({"attribute": "options.visibility_timeout"}))
        );
        assert_eq!(
            refused(pb::EnqueueOptions {
                tags: vec!["x".into(), "x".into()],
                ..Default::default()
            }),
            Some(json!({"attribute": "options.tags[1]"}))
        );
        let e = enqueue_job(String::new(), vec![], None, None, None, Utc::now()).unwrap_err();
        assert_eq!(e.details(), Some(json!({"attribute": "type"})));
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
        let e =
            enqueue_job("a.b".into(), vec![], Some(options), None, None, Utc::now()).unwrap_err();
        assert!(e.to_string().contains("negative"), "{e}");
        assert_eq!(e.details(), Some(json!({"attribute": "options.timeout"})));
    }
}
