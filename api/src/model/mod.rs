//! The job model: every change of a job's state, in one table.
//!
//! [`apply`] is the only place a job's state changes. It is a function of
//! the job as stored, a [`Command`] and the clock's `now`: it answers the
//! job as it becomes, the events that record the change and, for a failed
//! attempt, what becomes of the broker's delivery; or the state that
//! refuses the command. It reads and writes nothing else, so the table is
//! tested here without a store, a broker or a clock; the store's
//! transactions (`store`) and the worker protocol (`worker`) load, call and
//! save.

pub mod cron;
mod event_data;
pub mod queue;
pub mod rate;
pub(crate) mod retry;
pub mod unique;
pub mod workflow;

use chrono::{DateTime, Utc};
use ojs_core::{JobError, JobState};
use serde_json::{json, Value};

use crate::job::{timestamp, Job};
use crate::store::Settle;
use crate::Exhaustion;

pub use event_data::EventData;
pub(crate) use retry::Failed;

/// How many entries of a job's error history are kept (the oldest go).
pub(crate) const ERROR_HISTORY: usize = 50;

/// What is asked of a job.
#[derive(Debug, Clone)]
pub(crate) enum Command<'a> {
    /// A worker takes it (FETCH): an attempt starts.
    Start { worker: Option<&'a str> },
    /// Its worker finished it (ACK).
    Complete { result: Option<Value> },
    /// Its worker failed this attempt (NACK); `requeue` puts it back as it
    /// is. `jitter` in `[0, 1)` as in [`retry::decide`].
    Fail {
        failed: &'a Failed,
        requeue: bool,
        exhausted: Exhaustion,
        jitter: f64,
    },
    /// Its worker neither acknowledged nor heartbeat it in time.
    TimeOut,
    /// A client cancelled it.
    Cancel,
    /// A staged (`pending`) job is released to its queue.
    Activate,
    /// An activation whose publish failed is undone: staged again.
    Deactivate,
    /// A scheduled job was published when it came due.
    Promote,
    /// A dead letter goes back to its queue, from attempt 0.
    Revive,
    /// Past its `expires_at`: never handed out.
    Expire,
    /// Over its rate limit `key` when it would start, with `on_limit`
    /// `reschedule` (`until`: when the key frees) or `drop` (none).
    Limit {
        key: &'a str,
        until: Option<DateTime<Utc>>,
    },
}

impl Command<'_> {
    /// The command's name in the table.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Command::Start { .. } => "start",
            Command::Complete { .. } => "complete",
            Command::Fail { .. } => "fail",
            Command::TimeOut => "time_out",
            Command::Cancel => "cancel",
            Command::Activate => "activate",
            Command::Deactivate => "deactivate",
            Command::Promote => "promote",
            Command::Revive => "revive",
            Command::Expire => "expire",
            Command::Limit { .. } => "limit",
        }
    }
}

/// Whether `command` applies to a job in `state`: the transition table.
///
/// - `start` from `available`, `retryable`, `scheduled` (published by the
///   scheduler before its promotion committed: the broker has it) and
///   `active` (delivered again after its worker's lease ran out);
/// - `complete`, `fail`, `time_out` from `active` only;
/// - `cancel` from any state that is not final;
/// - `activate` from `pending`, `deactivate` from `available` (of an
///   activated job), `promote` from `scheduled`;
/// - `revive` from `discarded` (of a dead letter);
/// - `expire` and `limit` from the states a job is handed out from.
pub(crate) fn allows(state: JobState, command: &Command<'_>) -> bool {
    use JobState::*;
    match command {
        Command::Start { .. } | Command::Expire | Command::Limit { .. } => {
            matches!(state, Available | Retryable | Scheduled | Active)
        }
        Command::Complete { .. } | Command::Fail { .. } | Command::TimeOut => state == Active,
        Command::Cancel => !is_final(state),
        Command::Activate => state == Pending,
        Command::Deactivate => state == Available,
        Command::Promote => state == Scheduled,
        Command::Revive => state == Discarded,
    }
}

/// A state no command but `revive` (of a dead letter) leaves.
pub(crate) fn is_final(state: JobState) -> bool {
    matches!(
        state,
        JobState::Completed | JobState::Cancelled | JobState::Discarded | JobState::Other(_)
    )
}

/// One event a transition records (`job.started`, …) with its data.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Happened {
    pub kind: &'static str,
    pub data: EventData,
}

/// A transition's outcome.
#[derive(Debug, Clone)]
pub(crate) struct Transition {
    /// The job as it becomes.
    pub job: Job,
    /// Its state before.
    pub previous: JobState,
    /// When it finished, if it did now (the store keeps finished jobs for
    /// a while from then).
    pub finished: Option<DateTime<Utc>>,
    /// What to record, in order.
    pub events: Vec<Happened>,
    /// For a failed attempt: what becomes of the broker's delivery.
    pub settle: Option<Settle>,
}

/// The state that refused a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused(pub JobState);

/// Applies `command` to `job` at `now`.
pub(crate) fn apply(
    mut job: Job,
    command: Command<'_>,
    now: DateTime<Utc>,
) -> Result<Transition, Refused> {
    let previous = job.state();
    let refused = !allows(previous, &command)
        || match command {
            Command::Deactivate => !job.extra.contains_key("activated_at"),
            Command::Revive => !job.is_dead_letter(),
            _ => false,
        };
    if refused {
        return Err(Refused(previous));
    }
    let mut finished = None;
    let mut settle = None;
    let mut events = Vec::with_capacity(2);
    let mut happened = |kind, data: EventData| events.push(Happened { kind, data });
    match command {
        Command::Start { worker } => {
            let e = &mut job.envelope;
            e.state = Some(JobState::Active);
            e.attempt += 1;
            e.started_at = Some(now);
            e.completed_at = None;
            job.extra.remove("next_attempt_at");
            match worker {
                Some(w) => job.extra.insert("worker_id".into(), json!(w)),
                None => job.extra.remove("worker_id"),
            };
            happened(
                "job.started",
                job_event(&job, "active")
                    .field("attempt", &job.envelope.attempt)
                    .field("worker_id", &worker),
            );
        }
        Command::Complete { result } => {
            let e = &mut job.envelope;
            e.state = Some(JobState::Completed);
            e.completed_at = Some(now);
            e.error = None;
            e.result = result;
            finished = Some(now);
            let duration = e.started_at.map(|s| (now - s).num_milliseconds().max(0));
            happened(
                "job.completed",
                job_event(&job, "completed")
                    .field("attempt", &job.envelope.attempt)
                    .field("duration_ms", &duration)
                    .field("result", &job.envelope.result),
            );
        }
        Command::Fail {
            failed,
            requeue,
            exhausted,
            jitter,
        } => {
            let attempt = job.envelope.attempt;
            let mut entry = json!({
                "code": failed.code,
                "message": failed.message,
                "type": failed.error_type,
                "attempt": attempt,
                "occurred_at": timestamp(now),
            });
            if let Some(d) = &failed.details {
                entry["details"] = d.clone();
            }
            let errors = &mut job.envelope.errors;
            errors.push(entry);
            let excess = errors.len().saturating_sub(ERROR_HISTORY);
            errors.drain(..excess);
            job.envelope.error = Some(JobError {
                error_type: failed.error_type.clone(),
                message: failed.message.clone(),
                ..JobError::default()
            });
            let error = json!({"code": failed.code, "message": failed.message});
            let decision =
                (!requeue).then(|| retry::decide(&job.envelope, failed, exhausted, jitter));
            let (state, data) = match decision {
                None => {
                    settle = Some(Settle::Requeue);
                    let mut error = error;
                    error["retryable"] = json!(failed.retryable);
                    (
                        JobState::Available,
                        job_event(&job, "available")
                            .field("attempt", &attempt)
                            .field("error", &error),
                    )
                }
                Some(retry::Decision::Retry(delay)) => {
                    let next = later(now, delay);
                    job.extra
                        .insert("next_attempt_at".into(), json!(timestamp(next)));
                    job.extra
                        .insert("retry_delay_ms".into(), json!(delay.as_millis() as u64));
                    settle = Some(Settle::Retry {
                        delay_ms: delay.as_millis() as u64,
                    });
                    let mut error = error;
                    error["retryable"] = json!(true);
                    (
                        JobState::Retryable,
                        job_event(&job, "retryable")
                            .field("attempt", &attempt)
                            .field("error", &error),
                    )
                }
                Some(exhausted) => {
                    job.envelope.completed_at = Some(now);
                    job.extra
                        .insert("discarded_at".into(), json!(timestamp(now)));
                    finished = Some(now);
                    settle = Some(if exhausted == retry::Decision::DeadLetter {
                        job.extra.insert("dead_letter".into(), json!(true));
                        Settle::DeadLetter {
                            error_type: failed.error_type.clone(),
                            message: failed.message.clone(),
                        }
                    } else {
                        Settle::Drop
                    });
                    (
                        JobState::Discarded,
                        job_event(&job, "discarded")
                            .field("total_attempts", &attempt)
                            .field("last_error", &error),
                    )
                }
            };
            job.envelope.state = Some(state);
            // Every failed attempt is a `job.failed`; a retry or a discard
            // is recorded after it.
            happened("job.failed", data.clone());
            match state {
                JobState::Retryable => happened("job.retrying", data),
                JobState::Discarded => happened("job.discarded", data),
                _ => {}
            }
        }
        Command::TimeOut => {
            job.envelope.state = Some(JobState::Available);
            job.envelope.error = Some(JobError {
                error_type: "visibility_timeout".into(),
                message: "the worker neither acknowledged nor heartbeat the job in time".into(),
                ..JobError::default()
            });
            job.extra.remove("worker_id");
            happened(
                "job.failed",
                job_event(&job, "available").field(
                    "error",
                    &json!({"code": "visibility_timeout", "retryable": true}),
                ),
            );
        }
        Command::Cancel => {
            job.envelope.state = Some(JobState::Cancelled);
            job.extra
                .insert("cancelled_at".into(), json!(timestamp(now)));
            job.extra
                .insert("previous_state".into(), json!(state_name(previous)));
            finished = Some(now);
            happened(
                "job.cancelled",
                job_event(&job, "cancelled").field("previous_state", state_name(previous)),
            );
        }
        Command::Activate => {
            job.envelope.state = Some(JobState::Available);
            job.envelope.enqueued_at = Some(now);
            job.extra
                .insert("activated_at".into(), json!(timestamp(now)));
            job.extra.insert("previous_state".into(), json!("pending"));
            happened(
                "job.enqueued",
                job_event(&job, "available").field("previous_state", "pending"),
            );
        }
        Command::Deactivate => {
            job.envelope.state = Some(JobState::Pending);
            job.envelope.enqueued_at = None;
            job.extra.remove("activated_at");
            job.extra.remove("previous_state");
        }
        Command::Promote => {
            job.envelope.state = Some(JobState::Available);
            job.envelope.enqueued_at = Some(now);
            happened("job.enqueued", job_event(&job, "available"));
        }
        Command::Revive => {
            let e = &mut job.envelope;
            e.state = Some(JobState::Available);
            e.attempt = 0;
            e.enqueued_at = Some(now);
            e.started_at = None;
            e.completed_at = None;
            for k in [
                "dead_letter",
                "discarded_at",
                "next_attempt_at",
                "retry_delay_ms",
                "worker_id",
            ] {
                job.extra.remove(k);
            }
            job.extra
                .insert("re_enqueued_at".into(), json!(timestamp(now)));
            happened(
                "job.enqueued",
                job_event(&job, "available").field("from", "dead_letter"),
            );
        }
        Command::Expire => {
            job.envelope.state = Some(JobState::Discarded);
            job.extra
                .insert("discarded_at".into(), json!(timestamp(now)));
            finished = Some(now);
            happened(
                "job.discarded",
                job_event(&job, "discarded").field("reason", "expired"),
            );
        }
        Command::Limit {
            key,
            until: Some(until),
        } => {
            job.envelope.state = Some(JobState::Scheduled);
            job.envelope.scheduled_at = Some(until);
            job.extra.remove("worker_id");
            happened(
                "job.scheduled",
                job_event(&job, "scheduled")
                    .field("scheduled_at", &timestamp(until))
                    .field("reason", "rate_limited")
                    .field("key", key),
            );
        }
        Command::Limit { key, until: None } => {
            job.envelope.state = Some(JobState::Discarded);
            job.extra.remove("worker_id");
            job.extra
                .insert("discarded_at".into(), json!(timestamp(now)));
            finished = Some(now);
            happened(
                "job.discarded",
                job_event(&job, "discarded")
                    .field("reason", "rate_limited")
                    .field("key", key),
            );
            happened(
                "rate_limit.dropped",
                EventData::empty()
                    .field("job_type", &job.envelope.job_type)
                    .field("queue", &job.envelope.queue)
                    .field("key", key),
            );
        }
    }
    Ok(Transition {
        job,
        previous,
        finished,
        events,
        settle,
    })
}

/// A job event's data: the job's type and queue (no command changes them)
/// and the state it is in.
fn job_event(job: &Job, state: &str) -> EventData {
    EventData::of_job(&job.envelope.job_type, &job.envelope.queue, state)
}

/// Whether `job` is past its `expires_at` at `now`.
pub(crate) fn is_expired(job: &Job, now: DateTime<Utc>) -> bool {
    job.envelope.expires_at.is_some_and(|at| at <= now)
}

/// The state's name as the binding writes it.
pub(crate) fn state_name(s: JobState) -> &'static str {
    s.as_str().unwrap_or("unknown")
}

/// `now` plus `delay`, or the latest time the calendar holds when that is
/// past it (never a panic: a bound was missed somewhere, not a reason to
/// stop the store).
pub(crate) fn later(now: DateTime<Utc>, delay: std::time::Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(delay)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The clock's sub-second noise in `[0, 1)`: the jitter of retries that
/// failed together.
pub(crate) fn clock_jitter() -> f64 {
    f64::from(Utc::now().timestamp_subsec_nanos() % 1000) / 1000.0
}

#[cfg(test)]
mod tests;
