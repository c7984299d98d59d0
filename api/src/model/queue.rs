//! A queue's configuration (`PUT /ojs/v1/admin/queues/{name}/config`,
//! `…/rate-limit`): the limits every job of the queue starts under, beside
//! those a job carries (`crate::model::rate`, key `queue:<name>`).
//!
//! Retention is the server's (`[api] retention`) for every queue: a
//! configuration that names the same is taken (the admin UI sends back
//! what it read), another is refused as unsupported rather than kept and
//! ignored.

use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::model::rate::{Limits, Rate};

/// The fields a configuration may carry.
const FIELDS: &str = "concurrency, rate_limit, throttle, retention";

/// Reads a configuration's limits from `body`, starting from `current`
/// (a field not given keeps its value; `null` removes it).
/// `retention` is the server's.
pub fn read(current: &Limits, body: &Value, retention: Duration) -> Result<Limits, ApiError> {
    let Value::Object(m) = body else {
        return Err(ApiError::invalid("config", "must be a JSON object"));
    };
    let mut out = current.clone();
    for (k, v) in m {
        match k.as_str() {
            "concurrency" | "throttle" => {
                let mut one = Map::new();
                one.insert(k.clone(), v.clone());
                let read = Limits::read("config", &one)?;
                if k == "concurrency" {
                    out.concurrency = read.concurrency;
                } else {
                    out.throttle = read.throttle;
                }
            }
            "rate_limit" => out.rate = rate_limit("rate_limit", v)?,
            "retention" => check_retention(v, retention)?,
            // What the admin UI shows beside the limits and sends back.
            "backpressure" | "name" => {}
            other => {
                return Err(ApiError::invalid(
                    other,
                    format!("{other:?} is not a field of a queue's configuration ({FIELDS})"),
                ))
            }
        }
    }
    Ok(out)
}

/// A queue's `rate_limit`: `{limit, period}` (`max_per_second` taken too),
/// or `null` for none.
pub fn rate_limit(at: &str, v: &Value) -> Result<Option<Rate>, ApiError> {
    match v {
        Value::Null => Ok(None),
        Value::Object(r) if r.contains_key("max_per_second") => {
            let mut m = Map::new();
            m.insert("max_per_second".into(), r["max_per_second"].clone());
            Ok(Limits::read(at, &m)?.rate)
        }
        Value::Object(_) => Rate::read(at, v).map(Some),
        _ => Err(ApiError::invalid(
            at,
            "must be an object {limit, period} or null",
        )),
    }
}

fn check_retention(v: &Value, retention: Duration) -> Result<(), ApiError> {
    let Value::Object(m) = v else {
        return if v.is_null() {
            Ok(())
        } else {
            Err(ApiError::invalid("retention", "must be an object"))
        };
    };
    for (k, v) in m {
        let given = match v {
            Value::Null => continue,
            Value::Number(n) => n.as_u64().map(Duration::from_secs),
            Value::String(s) => ojs_core::duration::parse_iso8601_duration(s).ok(),
            _ => None,
        };
        if given != Some(retention) {
            return Err(ApiError::Unsupported {
                feature: "a queue retention other than the server's [api] retention",
            });
        }
        if !matches!(k.as_str(), "completed" | "discarded" | "cancelled") {
            return Err(ApiError::invalid(
                format!("retention.{k}"),
                "is not completed, discarded or cancelled",
            ));
        }
    }
    Ok(())
}

/// A configuration as the admin API shows it (`configuration`/`config`).
pub fn to_json(limits: &Limits, retention: Duration) -> Value {
    let secs = retention.as_secs();
    json!({
        "concurrency": limits.concurrency,
        "rate_limit": limits.rate.as_ref().map(|r| json!({"limit": r.limit, "period": r.period})),
        "throttle": limits.throttle.as_ref().map(|r| json!({"limit": r.limit, "period": r.period})),
        "retention": {"completed": secs, "discarded": secs, "cancelled": secs},
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const WEEK: Duration = Duration::from_secs(7 * 86_400);

    #[test]
    fn a_configuration_changes_what_it_names_and_keeps_the_rest() {
        let c = read(
            &Limits::default(),
            &json!({"concurrency": 4, "rate_limit": {"limit": 10, "period": "PT1M"}}),
            WEEK,
        )
        .unwrap();
        assert_eq!(c.concurrency, Some(4));
        assert_eq!(c.rate.as_ref().unwrap().limit, 10);
        let c = read(&c, &json!({"concurrency": null}), WEEK).unwrap();
        assert_eq!(c.concurrency, None);
        assert_eq!(c.rate.as_ref().unwrap().period, "PT1M");
        let c = read(&c, &json!({"rate_limit": {"max_per_second": 3}}), WEEK).unwrap();
        assert_eq!(c.rate.as_ref().unwrap().limit, 3);
        assert_eq!(c.rate.as_ref().unwrap().period, "PT1S");
        // What the UI read, sent back.
        let shown = to_json(&c, WEEK);
        assert_eq!(read(&c, &shown, WEEK).unwrap(), c);
    }

    #[test]
    fn what_cannot_be_followed_is_refused_by_name() {
        for (body, field) in [
            (json!({"concurrency": -1}), "config.concurrency"),
            (json!({"rate_limit": {"limit": 1}}), "rate_limit.period"),
            (json!({"rate_limit": 3}), "rate_limit"),
            (json!({"max_size": 3}), "max_size"),
        ] {
            match read(&Limits::default(), &body, WEEK) {
                Err(ApiError::InvalidRequest { attribute, .. }) => {
                    assert_eq!(attribute.as_deref(), Some(field), "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(
            read(
                &Limits::default(),
                &json!({"retention": {"completed": "P1D"}}),
                WEEK
            ),
            Err(ApiError::Unsupported { .. })
        ));
        assert!(read(
            &Limits::default(),
            &json!({"retention": {"completed": "P7D"}}),
            WEEK
        )
        .is_ok());
    }
}
