//! Rate limits (`options.rate_limit`, and a queue's own limit): how many
//! jobs of one key may run at once (`concurrency`), start per window
//! (`rate`), or start how far apart (`throttle`), across every replica.
//! The key defaults to the job's queue (`queue:<name>`), so a limit without
//! a key limits the queue; a queue's configured limit has that key too.
//!
//! A job's limit is read and checked at PUSH and kept on the job (its
//! `rate_limit` attribute, normalized to `{key?, concurrency?, rate?,
//! throttle?, on_limit?}`). FETCH admits a start of each key the job falls
//! under in the same store transaction that starts the job ([`admit`]
//! decides, on the key's state the store keeps and locks). A job over a
//! limit is not started: with `on_limit = "wait"` (the default) it stays
//! `available` and goes back to the broker for a later FETCH; `reschedule`
//! makes it `scheduled` for when the limit frees; `drop` discards it.
//! Windows are fixed: the first start opens one of `period`, and `limit`
//! starts fit in it. An operator's override (`PUT /ojs/v1/rate-limits/
//! {key}`) replaces a key's limits until it expires.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::duration::parse_iso8601_duration;
use ojs_core::JobEnvelope;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Longest window.
pub const MAX_PERIOD: Duration = Duration::from_secs(86_400);
/// Longest key.
pub const MAX_KEY_CHARS: usize = 256;
/// How soon a FETCH looks again at a key held by its concurrency (a slot
/// frees when a job of the key finishes, which nothing here waits on).
pub const CONCURRENCY_RECHECK: Duration = Duration::from_millis(250);

/// `limit` starts per `period`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rate {
    /// Starts per period.
    pub limit: u32,
    /// The period, as given (ISO 8601).
    pub period: String,
}

impl Rate {
    /// The period (checked when the rate was read).
    pub fn period(&self) -> Duration {
        parse_iso8601_duration(&self.period).unwrap_or(MAX_PERIOD)
    }

    /// Reads `{limit, period}` at `at`.
    pub fn read(at: &str, value: &Value) -> Result<Rate, ApiError> {
        let Value::Object(r) = value else {
            return Err(ApiError::invalid(at, "must be an object {limit, period}"));
        };
        let limit = count(
            &format!("{at}.limit"),
            r.get("limit").unwrap_or(&Value::Null),
            1,
        )?;
        let field = format!("{at}.period");
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
        Ok(Rate { limit, period })
    }

    fn to_json(&self) -> Value {
        json!({"limit": self.limit, "period": self.period})
    }
}

/// What a job over its limit becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    /// It stays `available` and is looked at again by a later FETCH.
    #[default]
    Wait,
    /// It is `scheduled` for when the limit frees.
    Reschedule,
    /// It is discarded (`rate_limit.dropped`).
    Drop,
}

impl OnLimit {
    fn parse(s: &str) -> Option<OnLimit> {
        match s {
            "wait" => Some(OnLimit::Wait),
            "reschedule" => Some(OnLimit::Reschedule),
            "drop" => Some(OnLimit::Drop),
            _ => None,
        }
    }

    /// The name the bindings use.
    pub fn as_str(self) -> &'static str {
        match self {
            OnLimit::Wait => "wait",
            OnLimit::Reschedule => "reschedule",
            OnLimit::Drop => "drop",
        }
    }
}

/// The limits of one key: any of the three, all of which must pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Jobs of the key active at once at most (0: none starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// Starts per window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Starts spaced evenly: one every `period / limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<Rate>,
}

impl Limits {
    fn is_empty(&self) -> bool {
        self.concurrency.is_none() && self.rate.is_none() && self.throttle.is_none()
    }

    /// Both sets of limits at once: the stricter of each.
    pub fn and(&self, other: &Limits) -> Limits {
        fn stricter(a: &Option<Rate>, b: &Option<Rate>) -> Option<Rate> {
            match (a, b) {
                (Some(a), Some(b)) => {
                    // Fewer starts per second is stricter.
                    let per = |r: &Rate| f64::from(r.limit) / r.period().as_secs_f64().max(1e-3);
                    Some(if per(a) <= per(b) {
                        a.clone()
                    } else {
                        b.clone()
                    })
                }
                (a, b) => a.clone().or_else(|| b.clone()),
            }
        }
        Limits {
            concurrency: match (self.concurrency, other.concurrency) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            rate: stricter(&self.rate, &other.rate),
            throttle: stricter(&self.throttle, &other.throttle),
        }
    }

    /// Reads `{concurrency?, rate?, throttle?, max_per_second?}` at `at`
    /// (the limits of a queue's configuration, an override); other fields
    /// are the caller's.
    pub fn read(at: &str, m: &Map<String, Value>) -> Result<Limits, ApiError> {
        let concurrency = match m.get("concurrency") {
            None | Some(Value::Null) => None,
            Some(v) => Some(count(&format!("{at}.concurrency"), v, 0)?),
        };
        let rate = match (m.get("max_per_second"), m.get("rate")) {
            (None | Some(Value::Null), None | Some(Value::Null)) => None,
            (Some(n), None | Some(Value::Null)) => Some(Rate {
                limit: count(&format!("{at}.max_per_second"), n, 1)?,
                period: "PT1S".to_owned(),
            }),
            (None | Some(Value::Null), Some(r)) => Some(Rate::read(&format!("{at}.rate"), r)?),
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    at,
                    "gives both `max_per_second` and `rate`; give one",
                ))
            }
        };
        let throttle = match m.get("throttle") {
            None | Some(Value::Null) => None,
            Some(t) => Some(Rate::read(&format!("{at}.throttle"), t)?),
        };
        Ok(Limits {
            concurrency,
            rate,
            throttle,
        })
    }

    fn write(&self, out: &mut Map<String, Value>) {
        if let Some(c) = self.concurrency {
            out.insert("concurrency".into(), json!(c));
        }
        if let Some(r) = &self.rate {
            out.insert("rate".into(), r.to_json());
        }
        if let Some(t) = &self.throttle {
            out.insert("throttle".into(), t.to_json());
        }
    }
}

/// A job's rate limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// Jobs of one key share its limits.
    pub key: String,
    /// The limits.
    pub limits: Limits,
    /// What a job over them becomes.
    pub on_limit: OnLimit,
}

/// An operator's limits for a key, in place of those its jobs carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Override {
    /// The limits (a dimension not given is the jobs' own).
    pub limits: Limits,
    /// Until when; none: until removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

/// One key's state as the store keeps it (one row a key, locked while a
/// start is admitted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyState {
    /// When the current rate window opened (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_start_ms: Option<i64>,
    /// Starts in it.
    #[serde(default)]
    pub window_count: u32,
    /// The last start (ms), for the throttle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_start_ms: Option<i64>,
    /// When a start was last refused, if that was after the last start:
    /// the key is limited now (`rate_limit.exceeded` was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limited_ms: Option<i64>,
    /// The limits the last job admitted under it carried.
    #[serde(default)]
    pub limits: Limits,
    /// An operator's override.
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub overridden: Option<Override>,
}

/// What [`admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Started: the key's state moved.
    Started {
        /// The key was limited before this start (`rate_limit.released`).
        released: bool,
    },
    /// Over a limit until then.
    Limited {
        /// When to look again.
        until: DateTime<Utc>,
        /// The key was not limited before (`rate_limit.exceeded`).
        newly: bool,
    },
}

/// The limits that hold for a key now: its override's where it has one
/// that has not expired, else `limits`.
pub fn effective(limits: &Limits, state: &KeyState, now: DateTime<Utc>) -> Limits {
    match &state.overridden {
        Some(o) if o.expires_at.is_none_or(|at| now < at) => Limits {
            concurrency: o.limits.concurrency.or(limits.concurrency),
            rate: o.limits.rate.clone().or_else(|| limits.rate.clone()),
            throttle: o
                .limits
                .throttle
                .clone()
                .or_else(|| limits.throttle.clone()),
        },
        _ => limits.clone(),
    }
}

fn ms_time(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

fn chrono_of(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// Whether a start of a key with `limits` (as its jobs carry them) may
/// begin at `now`, `active` of its jobs running: the state moved when it
/// may, else when to look again. All three limits must pass.
pub fn admit(limits: &Limits, state: &mut KeyState, active: u64, now: DateTime<Utc>) -> Admission {
    let held = effective(limits, state, now);
    let now_ms = now.timestamp_millis();
    let mut until: Option<DateTime<Utc>> = None;
    let mut later =
        |at: DateTime<Utc>| until = Some(until.map_or(at, |u: DateTime<Utc>| u.max(at)));
    if let Some(c) = held.concurrency {
        if active >= u64::from(c) {
            later(now + chrono_of(CONCURRENCY_RECHECK));
        }
    }
    let mut window = (state.window_start_ms, state.window_count);
    if let Some(rate) = &held.rate {
        let period = chrono_of(rate.period());
        match state.window_start_ms.map(ms_time) {
            Some(start) if now < start + period => {
                if state.window_count >= rate.limit {
                    later(start + period);
                } else {
                    window.1 = state.window_count + 1;
                }
            }
            _ => window = (Some(now_ms), 1),
        }
    }
    if let Some(throttle) = &held.throttle {
        let spacing = chrono_of(rate_spacing(throttle));
        if let Some(last) = state.last_start_ms.map(ms_time) {
            if now < last + spacing {
                later(last + spacing);
            }
        }
    }
    match until {
        Some(until) => {
            let newly = state.limited_ms.is_none();
            if newly {
                state.limited_ms = Some(now_ms);
            }
            Admission::Limited { until, newly }
        }
        None => {
            let released = state.limited_ms.is_some();
            state.window_start_ms = window.0;
            state.window_count = window.1;
            state.last_start_ms = Some(now_ms);
            state.limited_ms = None;
            state.limits = limits.clone();
            Admission::Started { released }
        }
    }
}

/// A throttle's spacing between two starts.
fn rate_spacing(throttle: &Rate) -> Duration {
    throttle.period() / throttle.limit.max(1)
}

impl RateLimit {
    /// Reads `options.rate_limit` of a PUSH (`at` names it in errors):
    /// `concurrency`, `max_per_second: n` or `rate: {limit, period}`
    /// (ISO 8601), `throttle: {limit, period}`, at least one of them; an
    /// optional `key` and `on_limit` (`wait`, `reschedule`, `drop`).
    /// Answers the form kept on the job.
    pub fn read(at: &str, value: &Value) -> Result<Value, ApiError> {
        let Value::Object(m) = value else {
            return Err(ApiError::invalid(at, "must be an object"));
        };
        for k in m.keys() {
            match k.as_str() {
                "key" | "max_per_second" | "rate" | "on_limit" | "concurrency" | "throttle" => {}
                other => {
                    return Err(ApiError::invalid(
                        format!("{at}.{other}"),
                        format!("{other:?} is not a field of a rate limit (key, concurrency, max_per_second, rate, throttle, on_limit)"),
                    ))
                }
            }
        }
        let on_limit = match m.get("on_limit") {
            None | Some(Value::Null) => OnLimit::Wait,
            Some(Value::String(s)) => OnLimit::parse(s).ok_or_else(|| {
                ApiError::invalid(
                    format!("{at}.on_limit"),
                    format!("{s:?} is not wait, reschedule or drop"),
                )
            })?,
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{at}.on_limit"),
                    "must be a string",
                ))
            }
        };
        let mut out = Map::new();
        match m.get("key") {
            None | Some(Value::Null) => {}
            Some(Value::String(k)) => {
                check_key(&format!("{at}.key"), k)?;
                out.insert("key".into(), json!(k));
            }
            Some(_) => return Err(ApiError::invalid(format!("{at}.key"), "must be a string")),
        }
        let limits = Limits::read(at, m)?;
        if limits.is_empty() {
            return Err(ApiError::invalid(
                at,
                "needs `concurrency`, `max_per_second`, `rate` {limit, period} or `throttle` {limit, period}",
            ));
        }
        limits.write(&mut out);
        if on_limit != OnLimit::Wait {
            out.insert("on_limit".into(), json!(on_limit.as_str()));
        }
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
        let Value::Object(m) = &kept else {
            return Ok(None);
        };
        Ok(Some(RateLimit {
            key: m
                .get("key")
                .and_then(Value::as_str)
                .map_or_else(|| queue_key(&envelope.queue), str::to_owned),
            limits: Limits::read("rate_limit", m)?,
            on_limit: m
                .get("on_limit")
                .and_then(Value::as_str)
                .and_then(OnLimit::parse)
                .unwrap_or_default(),
        }))
    }
}

/// The key of a queue's own limit, and of a job's limit that names none.
pub fn queue_key(queue: &str) -> String {
    format!("queue:{queue}")
}

/// The limits a job falls under: its own and its queue's (`queue`, from
/// the queue's configuration), merged where they share a key. Its own
/// `on_limit` holds for both.
pub fn limits_of(own: Option<RateLimit>, queue: Option<(&str, &Limits)>) -> Vec<RateLimit> {
    let mut out: Vec<RateLimit> = own.into_iter().collect();
    if let Some((name, limits)) = queue.filter(|(_, l)| !l.is_empty()) {
        let key = queue_key(name);
        let on_limit = out.first().map(|l| l.on_limit).unwrap_or_default();
        match out.iter_mut().find(|l| l.key == key) {
            Some(l) => l.limits = l.limits.and(limits),
            None => out.push(RateLimit {
                key,
                limits: limits.clone(),
                on_limit,
            }),
        }
    }
    out
}

fn count(at: &str, v: &Value, least: u64) -> Result<u32, ApiError> {
    v.as_u64()
        .filter(|n| (least..=u64::from(u32::MAX)).contains(n))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| ApiError::invalid(at, format!("must be a whole number of at least {least}")))
}

/// Reads a period (ISO 8601), bounded from 1 ms to [`MAX_PERIOD`].
pub fn period_of(at: &str, text: &str) -> Result<Duration, ApiError> {
    let d = parse_iso8601_duration(text).map_err(|e| ApiError::invalid(at, e))?;
    if d < Duration::from_millis(1) || d > MAX_PERIOD {
        return Err(ApiError::invalid(
            at,
            "must be from 1 ms to 1 day (PT0.001S … P1D)",
        ));
    }
    Ok(d)
}

/// Checks a rate-limit key (`^[a-zA-Z0-9][a-zA-Z0-9._:-]*$`, bounded).
pub fn check_key(at: &str, key: &str) -> Result<(), ApiError> {
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

    fn ms(n: i64) -> chrono::Duration {
        chrono::Duration::milliseconds(n)
    }

    fn rate(limit: u32, period: &str) -> Option<Rate> {
        Some(Rate {
            limit,
            period: period.into(),
        })
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
        let kept = RateLimit::read(
            "options.rate_limit",
            &json!({"concurrency": 0, "throttle": {"limit": 2, "period": "PT1S"}, "on_limit": "drop"}),
        )
        .unwrap();
        assert_eq!(
            kept,
            json!({"concurrency": 0, "throttle": {"limit": 2, "period": "PT1S"}, "on_limit": "drop"})
        );
        let mut envelope = JobEnvelope::with_id("x".to_owned(), "t.a", vec![]);
        envelope.queue = "mail".into();
        envelope.unknown_attributes.insert(
            "rate_limit".into(),
            json!({"max_per_second": 1, "concurrency": 3, "on_limit": "reschedule"}),
        );
        let limit = RateLimit::of(&envelope).unwrap().unwrap();
        assert_eq!(limit.key, "queue:mail");
        assert_eq!(limit.limits.rate, rate(1, "PT1S"));
        assert_eq!(limit.limits.concurrency, Some(3));
        assert_eq!(limit.on_limit, OnLimit::Reschedule);
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
            (json!({"concurrency": -1}), "options.rate_limit.concurrency"),
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
                json!({"throttle": {"limit": 0, "period": "PT1S"}}),
                "options.rate_limit.throttle.limit",
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
            (
                json!({"max_per_second": 1, "on_limit": "later"}),
                "options.rate_limit.on_limit",
            ),
        ] {
            match RateLimit::read("options.rate_limit", &value) {
                Err(ApiError::InvalidRequest { attribute, .. }) => {
                    assert_eq!(attribute.as_deref(), Some(field), "{value}")
                }
                other => panic!("{value}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_window_takes_its_limit_then_waits_for_its_end() {
        let limits = Limits {
            rate: rate(2, "PT1S"),
            ..Limits::default()
        };
        let mut key = KeyState::default();
        let t0 = at("2026-01-01T00:00:00.100Z");
        assert_eq!(
            admit(&limits, &mut key, 0, t0),
            Admission::Started { released: false }
        );
        assert!(matches!(
            admit(&limits, &mut key, 0, t0 + ms(300)),
            Admission::Started { .. }
        ));
        assert_eq!(key.window_count, 2);
        assert_eq!(
            admit(&limits, &mut key, 0, t0 + ms(900)),
            Admission::Limited {
                until: at("2026-01-01T00:00:01.100Z"),
                newly: true
            }
        );
        // Told once: a second refusal in the same stretch is not new.
        assert!(matches!(
            admit(&limits, &mut key, 0, t0 + ms(950)),
            Admission::Limited { newly: false, .. }
        ));
        assert_eq!(
            admit(&limits, &mut key, 0, at("2026-01-01T00:00:01.100Z")),
            Admission::Started { released: true }
        );
        assert_eq!(key.window_count, 1);
        assert_eq!(
            key.window_start_ms,
            Some(at("2026-01-01T00:00:01.100Z").timestamp_millis())
        );
    }

    #[test]
    fn concurrency_counts_the_key_s_active_jobs_and_zero_stops_the_key() {
        let limits = Limits {
            concurrency: Some(2),
            ..Limits::default()
        };
        let t0 = at("2026-01-01T00:00:00Z");
        let mut key = KeyState::default();
        assert!(matches!(
            admit(&limits, &mut key, 1, t0),
            Admission::Started { .. }
        ));
        assert_eq!(
            admit(&limits, &mut key, 2, t0),
            Admission::Limited {
                until: t0 + chrono_of(CONCURRENCY_RECHECK),
                newly: true
            }
        );
        let stop = Limits {
            concurrency: Some(0),
            ..Limits::default()
        };
        assert!(matches!(
            admit(&stop, &mut KeyState::default(), 0, t0),
            Admission::Limited { .. }
        ));
    }

    #[test]
    fn a_throttle_spaces_starts_evenly() {
        let limits = Limits {
            throttle: rate(4, "PT1S"),
            ..Limits::default()
        };
        let t0 = at("2026-01-01T00:00:00Z");
        let mut key = KeyState::default();
        assert!(matches!(
            admit(&limits, &mut key, 0, t0),
            Admission::Started { .. }
        ));
        assert_eq!(
            admit(&limits, &mut key, 0, t0 + ms(100)),
            Admission::Limited {
                until: t0 + ms(250),
                newly: true
            }
        );
        assert!(matches!(
            admit(&limits, &mut key, 0, t0 + ms(250)),
            Admission::Started { released: true }
        ));
    }

    #[test]
    fn every_limit_must_pass_and_a_refusal_moves_nothing() {
        let limits = Limits {
            concurrency: Some(1),
            rate: rate(10, "PT1S"),
            throttle: None,
        };
        let t0 = at("2026-01-01T00:00:00Z");
        let mut key = KeyState::default();
        assert!(matches!(
            admit(&limits, &mut key, 0, t0),
            Admission::Started { .. }
        ));
        let before = (key.window_start_ms, key.window_count, key.last_start_ms);
        assert!(matches!(
            admit(&limits, &mut key, 1, t0 + ms(10)),
            Admission::Limited { .. }
        ));
        assert_eq!(
            (key.window_start_ms, key.window_count, key.last_start_ms),
            before
        );
    }

    #[test]
    fn an_override_replaces_the_jobs_limits_until_it_expires() {
        let limits = Limits {
            rate: rate(1, "PT1M"),
            ..Limits::default()
        };
        let t0 = at("2026-01-01T00:00:00Z");
        let mut key = KeyState {
            overridden: Some(Override {
                limits: Limits {
                    rate: rate(100, "PT1M"),
                    ..Limits::default()
                },
                expires_at: Some(t0 + ms(1_000)),
            }),
            ..KeyState::default()
        };
        for i in 0..5 {
            assert!(
                matches!(
                    admit(&limits, &mut key, 0, t0 + ms(i)),
                    Admission::Started { .. }
                ),
                "{i}"
            );
        }
        // Expired: the jobs' own one a minute holds (the window has 5).
        assert!(matches!(
            admit(&limits, &mut key, 0, t0 + ms(2_000)),
            Admission::Limited { .. }
        ));
    }

    #[test]
    fn a_job_and_its_queue_limits_merge_on_a_shared_key() {
        let own = RateLimit {
            key: "queue:mail".into(),
            limits: Limits {
                rate: rate(10, "PT1S"),
                ..Limits::default()
            },
            on_limit: OnLimit::Drop,
        };
        let queue = Limits {
            concurrency: Some(3),
            rate: rate(2, "PT1S"),
            throttle: None,
        };
        let all = limits_of(Some(own.clone()), Some(("mail", &queue)));
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].limits.rate, rate(2, "PT1S"));
        assert_eq!(all[0].limits.concurrency, Some(3));
        assert_eq!(all[0].on_limit, OnLimit::Drop);
        let other = RateLimit {
            key: "tenant:1".into(),
            ..own
        };
        let all = limits_of(Some(other), Some(("mail", &queue)));
        assert_eq!(
            all.iter().map(|l| l.key.as_str()).collect::<Vec<_>>(),
            ["tenant:1", "queue:mail"]
        );
        assert!(limits_of(None, Some(("mail", &Limits::default()))).is_empty());
    }
}
