//! Rate limits (`options.rate_limit`): at most `limit` jobs of one key
//! start per `period`, across every replica. The key defaults to the
//! job's queue (`queue:<name>`), so a limit without a key limits the queue.
//!
//! A job's limit is read and checked at PUSH and kept on the job (its
//! `rate_limit` attribute, normalized to `{key?, rate: {limit, period}}`);
//! FETCH takes a slot of the key's window in the same store transaction
//! that starts the job. A job over its limit is not started: it stays
//! `available` and goes back to the broker for a later FETCH. Windows are
//! fixed: the first start opens one of `period`, and `limit` starts fit in
//! it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::duration::parse_iso8601_duration;
use ojs_core::JobEnvelope;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Longest window.
pub const MAX_PERIOD: Duration = Duration::from_secs(86_400);
/// Longest key.
pub const MAX_KEY_CHARS: usize = 256;

/// A job's rate limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// Jobs of one key share a window.
    pub key: String,
    /// Starts per window.
    pub limit: u32,
    /// The window.
    pub period: Duration,
}

/// One key's window as the store keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// When it opened.
    pub start: DateTime<Utc>,
    /// Starts in it.
    pub count: u32,
}

impl RateLimit {
    /// Reads `options.rate_limit` of a PUSH (`at` names it in errors):
    /// `max_per_second: n`, or `rate: {limit, period}` (ISO 8601), and an
    /// optional `key`; answers the form kept on the job. What this server
    /// does not enforce (`concurrency`, `throttle`, an `on_limit` other
    /// than `wait`) is refused as unsupported, never kept and ignored.
    pub fn read(at: &str, value: &Value) -> Result<Value, ApiError> {
        let Value::Object(m) = value else {
            return Err(ApiError::invalid(at, "must be an object"));
        };
        for k in m.keys() {
            match k.as_str() {
                "key" | "max_per_second" | "rate" | "on_limit" => {}
                "concurrency" | "throttle" => {
                    return Err(ApiError::Unsupported {
                        feature: "rate limits by concurrency or throttle",
                    })
                }
                other => {
                    return Err(ApiError::invalid(
                        format!("{at}.{other}"),
                        format!("{other:?} is not a field of a rate limit (key, max_per_second, rate, on_limit)"),
                    ))
                }
            }
        }
        match m.get("on_limit") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "wait" => {}
            Some(Value::String(_)) => {
                return Err(ApiError::Unsupported {
                    feature: "rate limits that reschedule or drop",
                })
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{at}.on_limit"),
                    "must be a string",
                ))
            }
        }
        let mut out = Map::new();
        match m.get("key") {
            None | Some(Value::Null) => {}
            Some(Value::String(k)) => {
                check_key(&format!("{at}.key"), k)?;
                out.insert("key".into(), json!(k));
            }
            Some(_) => return Err(ApiError::invalid(format!("{at}.key"), "must be a string")),
        }
        let (limit, period) = match (m.get("max_per_second"), m.get("rate")) {
            (Some(n), None) => (
                count(&format!("{at}.max_per_second"), n)?,
                "PT1S".to_owned(),
            ),
            (None, Some(Value::Object(r))) => {
                let limit = count(
                    &format!("{at}.rate.limit"),
                    r.get("limit").unwrap_or(&Value::Null),
                )?;
                let field = format!("{at}.rate.period");
                let period = match r.get("period") {
                    Some(Value::String(p)) => p.clone(),
                    _ => {
                        return Err(ApiError::invalid(
                            field,
                            "is required: an ISO 8601 duration such as PT1S or PT1M",
                        ))
                    }
                };
                period_of(&field, &period)?;
                (limit, period)
            }
            (None, Some(_)) => {
                return Err(ApiError::invalid(
                    format!("{at}.rate"),
                    "must be an object {limit, period}",
                ))
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    at,
                    "gives both `max_per_second` and `rate`; give one",
                ))
            }
            (None, None) => {
                return Err(ApiError::invalid(
                    at,
                    "needs `max_per_second` or `rate` {limit, period}",
                ))
            }
        };
        out.insert("rate".into(), json!({"limit": limit, "period": period}));
        Ok(Value::Object(out))
    }

    /// The rate limit a job carries, if any (its `rate_limit` attribute, as
    /// [`RateLimit::read`] keeps it); an attribute this server cannot
    /// follow is refused naming it.
    pub fn of(envelope: &JobEnvelope) -> Result<Option<RateLimit>, ApiError> {
        let Some(value) = envelope.unknown_attributes.get("rate_limit") else {
            return Ok(None);
        };
        if value.is_null() {
            return Ok(None);
        }
        let kept = Self::read("rate_limit", value)?;
        let limit = kept["rate"]["limit"].as_u64().unwrap_or(1);
        let period = kept["rate"]["period"].as_str().unwrap_or("PT1S");
        Ok(Some(RateLimit {
            key: kept["key"]
                .as_str()
                .map_or_else(|| format!("queue:{}", envelope.queue), str::to_owned),
            limit: u32::try_from(limit).unwrap_or(u32::MAX),
            period: period_of("rate_limit.rate.period", period)?,
        }))
    }

    /// Takes a start in `window` (the key's, if it has one) at `now`: the
    /// window as it becomes, or, when it is full, when it ends.
    pub fn take(
        &self,
        window: Option<Window>,
        now: DateTime<Utc>,
    ) -> Result<Window, DateTime<Utc>> {
        let period = chrono::Duration::from_std(self.period).unwrap_or(chrono::Duration::MAX);
        match window {
            Some(w) if now < w.start + period => {
                if w.count < self.limit {
                    Ok(Window {
                        count: w.count + 1,
                        ..w
                    })
                } else {
                    Err(w.start + period)
                }
            }
            _ => Ok(Window {
                start: now,
                count: 1,
            }),
        }
    }
}

fn count(at: &str, v: &Value) -> Result<u64, ApiError> {
    v.as_u64()
        .filter(|n| (1..=u64::from(u32::MAX)).contains(n))
        .ok_or_else(|| ApiError::invalid(at, "must be a whole number of at least 1"))
}

fn period_of(at: &str, text: &str) -> Result<Duration, ApiError> {
    let d = parse_iso8601_duration(text).map_err(|e| ApiError::invalid(at, e))?;
    if d < Duration::from_millis(1) || d > MAX_PERIOD {
        return Err(ApiError::invalid(
            at,
            "must be from 1 ms to 1 day (PT0.001S … P1D)",
        ));
    }
    Ok(d)
}

fn check_key(at: &str, key: &str) -> Result<(), ApiError> {
    let mut chars = key.chars();
    let first = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    let rest = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'));
    if !first || !rest || key.len() > MAX_KEY_CHARS {
        return Err(ApiError::invalid(
            at,
            format!("{key:?} is not a rate-limit key: letters, digits, '.', '_', ':', '-', starting with a letter or digit, at most {MAX_KEY_CHARS} characters"),
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn a_limit_is_kept_in_one_form() {
        let kept = RateLimit::read("options.rate_limit", &json!({"max_per_second": 2})).unwrap();
        assert_eq!(kept, json!({"rate": {"limit": 2, "period": "PT1S"}}));
        let kept = RateLimit::read(
            "options.rate_limit",
            &json!({"key": "tenant:42", "rate": {"limit": 10, "period": "PT1M"}, "on_limit": "wait"}),
        )
        .unwrap();
        assert_eq!(
            kept,
            json!({"key": "tenant:42", "rate": {"limit": 10, "period": "PT1M"}})
        );
        let mut envelope = JobEnvelope::with_id("x".to_owned(), "t.a", vec![]);
        envelope.queue = "mail".into();
        envelope
            .unknown_attributes
            .insert("rate_limit".into(), json!({"max_per_second": 1}));
        let limit = RateLimit::of(&envelope).unwrap().unwrap();
        assert_eq!(limit.key, "queue:mail");
        assert_eq!((limit.limit, limit.period), (1, Duration::from_secs(1)));
    }

    #[test]
    fn what_cannot_be_followed_is_refused_by_name() {
        for (value, field) in [
            (json!({}), "options.rate_limit"),
            (json!(3), "options.rate_limit"),
            (
                json!({"max_per_second": 0}),
                "options.rate_limit.max_per_second",
            ),
            (
                json!({"max_per_second": 1.5}),
                "options.rate_limit.max_per_second",
            ),
            (
                json!({"rate": {"limit": 1}}),
                "options.rate_limit.rate.period",
            ),
            (
                json!({"rate": {"limit": 1, "period": "soon"}}),
                "options.rate_limit.rate.period",
            ),
            (
                json!({"rate": {"limit": 1, "period": "P2D"}}),
                "options.rate_limit.rate.period",
            ),
            (
                json!({"max_per_second": 1, "rate": {"limit": 1, "period": "PT1S"}}),
                "options.rate_limit",
            ),
            (
                json!({"max_per_second": 1, "key": "-x"}),
                "options.rate_limit.key",
            ),
            (
                json!({"max_per_second": 1, "burst": 3}),
                "options.rate_limit.burst",
            ),
        ] {
            match RateLimit::read("options.rate_limit", &value) {
                Err(ApiError::InvalidRequest { attribute, .. }) => {
                    assert_eq!(attribute.as_deref(), Some(field), "{value}")
                }
                other => panic!("{value}: {other:?}"),
            }
        }
        for value in [
            json!({"concurrency": 2}),
            json!({"max_per_second": 1, "on_limit": "drop"}),
            json!({"throttle": {"limit": 1, "period": "PT1S"}}),
        ] {
            assert!(matches!(
                RateLimit::read("options.rate_limit", &value),
                Err(ApiError::Unsupported { .. })
            ));
        }
    }

    #[test]
    fn a_window_takes_its_limit_then_waits_for_its_end() {
        let limit = RateLimit {
            key: "k".into(),
            limit: 2,
            period: Duration::from_secs(1),
        };
        let t0 = at("2026-01-01T00:00:00.100Z");
        let w = limit.take(None, t0).unwrap();
        let w = limit
            .take(Some(w), t0 + chrono::Duration::milliseconds(300))
            .unwrap();
        assert_eq!(w.count, 2);
        let full = limit.take(Some(w), t0 + chrono::Duration::milliseconds(900));
        assert_eq!(full, Err(at("2026-01-01T00:00:01.100Z")));
        let next = limit.take(Some(w), at("2026-01-01T00:00:01.100Z")).unwrap();
        assert_eq!(
            (next.start, next.count),
            (at("2026-01-01T00:00:01.100Z"), 1)
        );
    }
}
