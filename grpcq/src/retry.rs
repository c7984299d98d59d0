//! The OJS retry policy as the worker applies it (docs/design.md §6): 3 attempts in
//! total, initial `PT1S`, coefficient 2.0, cap `PT5M`, jitter multiplying by a
//! factor in [0.5, 1.5), `on_exhaustion` `dead_letter` unless `discard`.

use std::time::Duration;

use ojs_core::duration::parse_iso8601_duration;
use ojs_core::envelope::RetryPolicy;
use ojs_queue::backoff::random_unit;

/// What to do when attempts run out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExhaustion {
    /// Move to the dead-letter destination with the last error.
    DeadLetter,
    /// Drop the message (acknowledge it) and log.
    Discard,
}

/// A retry policy with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedRetry {
    /// Attempts in total, including the first.
    pub max_attempts: u32,
    /// Delay before the first retry.
    pub initial_interval: Duration,
    /// Growth factor between retries.
    pub backoff_coefficient: f64,
    /// Cap on one delay.
    pub max_interval: Duration,
    /// Randomise delays by a factor in [0.5, 1.5).
    pub jitter: bool,
    /// Error types never retried.
    pub non_retryable_errors: Vec<String>,
    /// What happens after the last attempt.
    pub on_exhaustion: OnExhaustion,
}

impl Default for ResolvedRetry {
    fn default() -> Self {
        ResolvedRetry {
            max_attempts: 3,
            initial_interval: Duration::from_secs(1),
            backoff_coefficient: 2.0,
            max_interval: Duration::from_secs(300),
            jitter: true,
            non_retryable_errors: Vec::new(),
            on_exhaustion: OnExhaustion::DeadLetter,
        }
    }
}

/// What the worker does with a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryDecision {
    /// Try again after this delay.
    Retry(Duration),
    /// No more attempts: dead-letter or discard.
    Exhausted(OnExhaustion),
}

impl ResolvedRetry {
    /// Fills the unset fields of a job's policy from `defaults` (proto3:
    /// zero and empty mean unset). Unparseable durations fall back to the
    /// default; envelope validation rejects them before they get here.
    pub fn resolve(policy: Option<&RetryPolicy>, defaults: &ResolvedRetry) -> ResolvedRetry {
        let Some(p) = policy else {
            return defaults.clone();
        };
        let duration = |s: &str, d: Duration| {
            if s.is_empty() {
                d
            } else {
                parse_iso8601_duration(s).unwrap_or(d)
            }
        };
        ResolvedRetry {
            max_attempts: match p.max_attempts {
                // 0 disables retries: one run, like 1.
                Some(n) => n.max(0) as u32,
                None => defaults.max_attempts,
            },
            initial_interval: duration(&p.initial_interval, defaults.initial_interval),
            backoff_coefficient: if p.backoff_coefficient > 0.0 {
                p.backoff_coefficient
            } else {
                defaults.backoff_coefficient
            },
            max_interval: duration(&p.max_interval, defaults.max_interval),
            jitter: p.jitter,
            non_retryable_errors: if p.non_retryable_errors.is_empty() {
                defaults.non_retryable_errors.clone()
            } else {
                p.non_retryable_errors.clone()
            },
            on_exhaustion: match p.on_exhaustion.as_str() {
                "discard" => OnExhaustion::Discard,
                "dead_letter" => OnExhaustion::DeadLetter,
                _ => defaults.on_exhaustion,
            },
        }
    }

    /// Delay before retry number `attempt` (1 = the delay after the first
    /// failure), without jitter.
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let exp = self
            .backoff_coefficient
            .powi(attempt.saturating_sub(1).min(63) as i32);
        let secs = self.initial_interval.as_secs_f64() * exp;
        let capped = secs.min(self.max_interval.as_secs_f64());
        Duration::try_from_secs_f64(capped).unwrap_or(self.max_interval)
    }

    /// Decides after `attempt` (1-based) failed with `error_type`.
    pub fn decide(&self, attempt: u32, error_type: &str, retryable: bool) -> RetryDecision {
        let non_retryable = !retryable || self.non_retryable_errors.iter().any(|e| e == error_type);
        if non_retryable || attempt >= self.max_attempts {
            return RetryDecision::Exhausted(self.on_exhaustion);
        }
        let base = self.base_delay(attempt);
        let delay = if self.jitter {
            base.mul_f64(0.5 + random_unit())
        } else {
            base
        };
        RetryDecision::Retry(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_ojs_retry_spec() {
        let r = ResolvedRetry::default();
        assert_eq!(r.base_delay(1), Duration::from_secs(1));
        assert_eq!(r.base_delay(2), Duration::from_secs(2));
        assert_eq!(r.base_delay(3), Duration::from_secs(4));
        assert_eq!(r.base_delay(20), Duration::from_secs(300), "capped at PT5M");
        assert!(matches!(r.decide(1, "Io", true), RetryDecision::Retry(_)));
        assert!(matches!(r.decide(2, "Io", true), RetryDecision::Retry(_)));
        assert_eq!(
            r.decide(3, "Io", true),
            RetryDecision::Exhausted(OnExhaustion::DeadLetter),
            "3 attempts in total"
        );
    }

    #[test]
    fn jitter_stays_within_half_to_one_and_a_half() {
        let r = ResolvedRetry::default();
        for _ in 0..200 {
            let RetryDecision::Retry(d) = r.decide(2, "x", true) else {
                panic!()
            };
            assert!(
                d >= Duration::from_secs(1) && d < Duration::from_secs(3),
                "{d:?}"
            );
        }
    }

    #[test]
    fn job_policies_override_defaults_and_name_permanent_errors() {
        let p = RetryPolicy {
            max_attempts: Some(5),
            initial_interval: "PT10S".into(),
            jitter: false,
            non_retryable_errors: vec!["ValidationError".into()],
            on_exhaustion: "discard".into(),
            ..RetryPolicy::default()
        };
        let r = ResolvedRetry::resolve(Some(&p), &ResolvedRetry::default());
        assert_eq!(r.max_attempts, 5);
        assert_eq!(
            r.decide(1, "Io", true),
            RetryDecision::Retry(Duration::from_secs(10))
        );
        assert_eq!(
            r.decide(1, "ValidationError", true),
            RetryDecision::Exhausted(OnExhaustion::Discard)
        );
        assert_eq!(
            r.decide(1, "Io", false),
            RetryDecision::Exhausted(OnExhaustion::Discard)
        );
        assert_eq!(
            r.decide(5, "Io", true),
            RetryDecision::Exhausted(OnExhaustion::Discard)
        );
    }
}
