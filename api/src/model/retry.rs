//! The retry policy's decision: what becomes of a job whose attempt failed.

use std::time::Duration;

use ojs_core::JobEnvelope;
use serde_json::{Map, Value};

use crate::Exhaustion;

/// What a NACK said about the failure, read once from the binding's error
/// object (`code`, `message`, `type`, `retryable`, `details`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failed {
    pub code: String,
    pub message: String,
    /// The error's class (`details.error_class`, else `type`), else its code:
    /// what `non_retryable_errors` names.
    pub error_type: String,
    /// The worker's word; a failure is retryable unless it says not.
    pub retryable: bool,
    pub details: Option<Value>,
}

impl Failed {
    /// Reads a NACK's error object. `code` and `message` are optional in a
    /// NACK; the job's history needs both non-empty.
    pub(crate) fn read(error: &Map<String, Value>) -> Failed {
        let text = |k: &str| {
            error
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let code = text("code").unwrap_or_else(|| "handler_error".into());
        let message = text("message").unwrap_or_else(|| "the worker gave no message".into());
        let error_type = error
            .get("details")
            .and_then(|d| d.get("error_class"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| text("type"))
            .unwrap_or_else(|| code.clone());
        Failed {
            retryable: error
                .get("retryable")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            details: error.get("details").cloned(),
            code,
            message,
            error_type,
        }
    }
}

/// The policy's answer to a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decision {
    /// Tried again after this long.
    Retry(Duration),
    /// No attempt left (or not retryable): discarded and kept as a dead
    /// letter.
    DeadLetter,
    /// No attempt left (or not retryable): discarded, nothing kept.
    Discard,
}

/// Decides for `job` (its `attempt` the one that failed): retry while the
/// failure is retryable, not one the policy names non-retryable, and
/// attempts remain; else the job's own `on_exhaustion`, else the server's
/// `exhausted` default. `jitter` in `[0, 1)` places the delay inside the
/// policy's ±25 % band (the caller's clock supplies it, so that tests
/// choose it).
pub(crate) fn decide(
    job: &JobEnvelope,
    failed: &Failed,
    exhausted: Exhaustion,
    jitter: f64,
) -> Decision {
    let policy = job.retry.clone().unwrap_or_default();
    let non_retryable = policy
        .non_retryable_errors
        .iter()
        .any(|n| *n == failed.error_type || *n == failed.code);
    if failed.retryable && !non_retryable && job.attempt < crate::job::max_attempts(job) {
        return Decision::Retry(backoff(job, job.attempt, jitter));
    }
    let dead_letter = match policy.on_exhaustion.as_str() {
        "dead_letter" => true,
        "discard" => false,
        _ => exhausted == Exhaustion::DeadLetter,
    };
    if dead_letter {
        Decision::DeadLetter
    } else {
        Decision::Discard
    }
}

/// The delay before retry `attempt` (1-based: the first retry follows the
/// first failure) under the job's policy; `jitter` as in [`decide`].
pub(crate) fn backoff(job: &JobEnvelope, attempt: i32, jitter: f64) -> Duration {
    // A job without a policy gets the spec's, jitter included.
    let jittered = job.retry.as_ref().is_none_or(|p| p.jitter);
    let policy = job.retry.clone().unwrap_or_default();
    let parse = |s: &str, default: Duration| {
        if s.is_empty() {
            default
        } else {
            ojs_core::duration::parse_iso8601_duration(s).unwrap_or(default)
        }
    };
    // Validation bounds both intervals; a job stored before it did (or
    // put on the broker by another producer) is held to the same bound
    // here, so that no policy makes a time this server cannot compute.
    let bound = |d: Duration| d.min(crate::limits::MAX_RETRY_INTERVAL);
    let initial = bound(parse(&policy.initial_interval, Duration::from_secs(1)));
    let max = bound(parse(&policy.max_interval, Duration::from_secs(300)));
    let coefficient = if policy.backoff_coefficient.is_finite() && policy.backoff_coefficient > 0.0
    {
        policy.backoff_coefficient
    } else {
        2.0
    };
    let exponent = (attempt - 1).clamp(0, 60);
    let secs = initial.as_secs_f64() * coefficient.powi(exponent);
    let secs = if secs.is_finite() { secs } else { f64::MAX };
    let delay = Duration::try_from_secs_f64(secs.min(max.as_secs_f64()).max(0.0)).unwrap_or(max);
    if jittered {
        // ±25 % around the interval: spreads retries of jobs that failed
        // together.
        delay.mul_f64(0.75 + jitter.clamp(0.0, 1.0) * 0.5)
    } else {
        delay
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use ojs_core::envelope::RetryPolicy;

    fn job(attempt: i32, policy: Option<RetryPolicy>) -> JobEnvelope {
        let mut job = JobEnvelope::with_id("j".into(), "t", Vec::new());
        job.attempt = attempt;
        job.retry = policy;
        job
    }

    fn failed(error: Value) -> Failed {
        Failed::read(error.as_object().unwrap())
    }

    fn policy(max: i32) -> RetryPolicy {
        RetryPolicy {
            max_attempts: Some(max),
            initial_interval: "PT2S".into(),
            backoff_coefficient: 3.0,
            max_interval: "PT20S".into(),
            jitter: false,
            ..RetryPolicy::default()
        }
    }

    #[test]
    fn a_nack_without_code_or_message_gets_both() {
        let f = failed(serde_json::json!({"code": "", "details": {"error_class": "Timeout"}}));
        assert_eq!(f.code, "handler_error");
        assert_eq!(f.message, "the worker gave no message");
        assert_eq!(f.error_type, "Timeout");
        assert!(f.retryable);
        let f = failed(serde_json::json!({"code": "E", "type": "T", "retryable": false}));
        assert_eq!((f.code.as_str(), f.error_type.as_str()), ("E", "T"));
        assert!(!f.retryable);
    }

    #[test]
    fn backoff_grows_by_the_coefficient_up_to_the_maximum() {
        let j = job(1, Some(policy(10)));
        let delays: Vec<u64> = (1..=5).map(|a| backoff(&j, a, 0.0).as_secs()).collect();
        assert_eq!(delays, [2, 6, 18, 20, 20]);
    }

    #[test]
    fn jitter_places_the_delay_within_a_quarter_of_the_interval() {
        let mut p = policy(10);
        p.jitter = true;
        let j = job(1, Some(p));
        assert_eq!(backoff(&j, 1, 0.0), Duration::from_millis(1500));
        assert_eq!(backoff(&j, 1, 0.5), Duration::from_secs(2));
        assert_eq!(backoff(&j, 1, 1.0), Duration::from_millis(2500));
        // Without a policy: the spec's (1 s, ×2, jitter on).
        let bare = job(1, None);
        assert_eq!(backoff(&bare, 1, 0.0), Duration::from_millis(750));
        assert_eq!(backoff(&bare, 3, 0.5), Duration::from_secs(4));
    }

    #[test]
    fn absurd_policies_stay_within_the_bound() {
        let mut p = policy(10);
        p.initial_interval = "P9999D".into();
        p.max_interval = "P9999D".into();
        p.backoff_coefficient = f64::INFINITY;
        let d = backoff(&job(1, Some(p)), 60, 0.0);
        assert!(d <= crate::limits::MAX_RETRY_INTERVAL, "{d:?}");
    }

    #[test]
    fn the_decision_table() {
        let retryable = failed(serde_json::json!({"code": "E"}));
        let refused = failed(serde_json::json!({"code": "E", "retryable": false}));
        let named = failed(serde_json::json!({"code": "Fatal"}));
        let mut listing = policy(3);
        listing.non_retryable_errors = vec!["Fatal".into()];
        let mut to_dead = policy(3);
        to_dead.on_exhaustion = "dead_letter".into();
        let mut to_discard = policy(3);
        to_discard.on_exhaustion = "discard".into();
        use Decision::*;
        use Exhaustion as X;
        let cases = [
            // attempts remain
            (
                job(1, Some(policy(3))),
                &retryable,
                X::Discard,
                Retry(Duration::from_secs(2)),
            ),
            (
                job(2, Some(policy(3))),
                &retryable,
                X::Discard,
                Retry(Duration::from_secs(6)),
            ),
            // exhausted: the server's default decides
            (job(3, Some(policy(3))), &retryable, X::Discard, Discard),
            (
                job(3, Some(policy(3))),
                &retryable,
                X::DeadLetter,
                DeadLetter,
            ),
            // … unless the job's policy says
            (
                job(3, Some(to_dead.clone())),
                &retryable,
                X::Discard,
                DeadLetter,
            ),
            (
                job(3, Some(to_discard.clone())),
                &retryable,
                X::DeadLetter,
                Discard,
            ),
            // not retryable: exhausted at once
            (job(1, Some(policy(3))), &refused, X::DeadLetter, DeadLetter),
            (job(1, Some(listing.clone())), &named, X::Discard, Discard),
            (
                job(1, Some(listing)),
                &retryable,
                X::Discard,
                Retry(Duration::from_secs(2)),
            ),
        ];
        for (n, (j, f, x, want)) in cases.into_iter().enumerate() {
            assert_eq!(decide(&j, f, x, 0.5), want, "case {n}");
        }
    }
}
