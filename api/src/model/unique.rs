//! Unique jobs: the key a job's policy (`options.unique`) derives from the
//! job, and when a job already stored under that key makes a push a
//! duplicate. What a duplicate push becomes (`on_conflict`) is decided in
//! the store's insert transaction, so that of concurrent pushes of one key
//! exactly one wins.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::duration::parse_iso8601_duration;
use ojs_core::{JobEnvelope, JobState};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use unicode_normalization::UnicodeNormalization;

use crate::error::ApiError;
use crate::job::Job;

/// What a push does when its key is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnConflict {
    /// Nothing is stored; the push is refused as a duplicate (the default).
    Reject,
    /// The stored job is cancelled and the new one stored.
    Replace,
    /// As [`OnConflict::Replace`], the new job keeping the stored one's
    /// schedule.
    ReplaceExceptSchedule,
    /// Nothing is stored; the push answers the stored job.
    Ignore,
}

/// A job's uniqueness, built from its policy when it is pushed.
#[derive(Debug, Clone, PartialEq)]
pub struct Uniqueness {
    /// The fingerprint of the chosen dimensions: lowercase hex SHA-256 of
    /// their canonical JSON.
    pub key: String,
    /// The states of a stored job that make a push a duplicate.
    pub states: Vec<JobState>,
    /// How long after the stored job was created it counts; none: as long
    /// as it is in one of `states`.
    pub period: Option<Duration>,
    /// What a duplicate push does.
    pub on_conflict: OnConflict,
}

/// The dimensions a key may be made of.
const DIMENSIONS: [&str; 4] = ["type", "queue", "args", "meta"];

/// The states that make a duplicate when a policy names none.
const DEFAULT_STATES: [JobState; 5] = [
    JobState::Available,
    JobState::Active,
    JobState::Scheduled,
    JobState::Retryable,
    JobState::Pending,
];

impl Uniqueness {
    /// The uniqueness of a job about to be stored; none without a policy.
    /// A policy that cannot be followed is refused, naming its field.
    pub fn of(envelope: &JobEnvelope) -> Result<Option<Uniqueness>, ApiError> {
        let Some(policy) = &envelope.unique else {
            return Ok(None);
        };
        let at = |field: &str| format!("options.unique.{field}");
        for (i, k) in policy.keys.iter().enumerate() {
            if !DIMENSIONS.contains(&k.as_str()) {
                return Err(ApiError::invalid(
                    format!("options.unique.keys[{i}]"),
                    format!("{k:?} is not a dimension of a key (type, queue, args, meta)"),
                ));
            }
        }
        let named = |d: &str| policy.keys.iter().any(|k| k == d);
        // The type is always part of the key.
        let mut chosen = Map::new();
        chosen.insert("type".into(), Value::String(envelope.job_type.clone()));
        if named("queue") {
            chosen.insert("queue".into(), Value::String(envelope.queue.clone()));
        }
        if named("args") {
            chosen.insert("args".into(), chosen_args(envelope, &policy.args_keys)?);
        }
        if named("meta") {
            if policy.meta_keys.is_empty() {
                return Err(ApiError::invalid(
                    at("meta_keys"),
                    "must name the meta keys when `meta` is one of `keys`",
                ));
            }
            let meta: Map<String, Value> = policy
                .meta_keys
                .iter()
                .map(|k| {
                    (
                        k.clone(),
                        envelope.meta.get(k).cloned().unwrap_or(Value::Null),
                    )
                })
                .collect();
            chosen.insert("meta".into(), Value::Object(meta));
        }
        let period = match policy.period.as_str() {
            "" => None,
            text => {
                Some(parse_iso8601_duration(text).map_err(|e| ApiError::invalid(at("period"), e))?)
            }
        };
        let states = if policy.states.is_empty() {
            DEFAULT_STATES.to_vec()
        } else {
            policy
                .states
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    JobState::parse(s).ok_or_else(|| {
                        ApiError::invalid(
                            format!("options.unique.states[{i}]"),
                            format!("{s:?} is not an OJS state"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?
        };
        let on_conflict = match policy.on_conflict.as_str() {
            "" | "reject" => OnConflict::Reject,
            "replace" => OnConflict::Replace,
            "replace_except_schedule" => OnConflict::ReplaceExceptSchedule,
            "ignore" => OnConflict::Ignore,
            other => {
                return Err(ApiError::invalid(
                    at("on_conflict"),
                    format!(
                        "{other:?} is not one of reject, replace, replace_except_schedule, ignore"
                    ),
                ))
            }
        };
        Ok(Some(Uniqueness {
            key: fingerprint(&Value::Object(chosen)),
            states,
            period,
            on_conflict,
        }))
    }

    /// Whether `stored`, found under the same key, makes the push a
    /// duplicate at `now`: in one of the policy's states and, where the
    /// policy has a period, created less than that long ago.
    pub fn is_taken_by(&self, stored: &Job, now: DateTime<Utc>) -> bool {
        if !self.states.contains(&stored.state()) {
            return false;
        }
        match (self.period, stored.envelope.created_at) {
            (Some(period), Some(created)) => chrono::Duration::from_std(period)
                .ok()
                .and_then(|p| created.checked_add_signed(p))
                .is_none_or(|until| now < until),
            _ => true,
        }
    }
}

/// The `args` part of a key: every argument, or the named keys of the
/// arguments that are objects (the first object that has each).
fn chosen_args(envelope: &JobEnvelope, args_keys: &[String]) -> Result<Value, ApiError> {
    if args_keys.is_empty() {
        return Ok(Value::Array(envelope.args.clone()));
    }
    let mut chosen = Map::new();
    for (i, key) in args_keys.iter().enumerate() {
        let found = envelope
            .args
            .iter()
            .filter_map(Value::as_object)
            .find_map(|object| object.get(key));
        match found {
            Some(v) => {
                chosen.insert(key.clone(), v.clone());
            }
            None => {
                return Err(ApiError::invalid(
                    format!("options.unique.args_keys[{i}]"),
                    format!("no argument of the job is an object with the key {key:?}"),
                ))
            }
        }
    }
    Ok(Value::Object(chosen))
}

/// Lowercase hex SHA-256 of `value`'s canonical JSON.
fn fingerprint(value: &Value) -> String {
    let mut text = String::new();
    canonical(value, &mut text);
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compact JSON with every object's keys sorted and every string in
/// Unicode normal form C, so that equal values give equal text.
fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, &Value)> =
                map.iter().map(|(k, v)| (k.nfc().collect(), v)).collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(v, out);
            }
            out.push(']');
        }
        Value::String(s) => out.push_str(&Value::String(s.nfc().collect()).to_string()),
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ojs_core::envelope::UniquePolicy;
    use serde_json::json;

    fn envelope(args: Value, policy: UniquePolicy) -> JobEnvelope {
        let mut e = JobEnvelope::new("email.send", args.as_array().cloned().unwrap_or_default());
        e.queue = "mail".into();
        e.meta.insert("tenant".into(), json!("t1"));
        e.unique = Some(policy);
        e
    }

    fn policy(keys: &[&str]) -> UniquePolicy {
        UniquePolicy {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            ..UniquePolicy::default()
        }
    }

    fn key(args: Value, policy: UniquePolicy) -> String {
        Uniqueness::of(&envelope(args, policy))
            .unwrap()
            .unwrap()
            .key
    }

    #[test]
    fn the_key_is_made_of_the_chosen_dimensions_only() {
        let by_type = key(json!([1]), policy(&["type"]));
        assert_eq!(by_type, key(json!([2]), policy(&["type"])));
        assert_eq!(by_type, key(json!([2]), policy(&[])), "type is the default");
        let by_args = key(json!([{"to": "a", "n": 1}]), policy(&["type", "args"]));
        assert_ne!(by_type, by_args);
        assert_eq!(
            by_args,
            key(json!([{"n": 1, "to": "a"}]), policy(&["type", "args"])),
            "object keys are sorted"
        );
        assert_ne!(
            by_args,
            key(json!([{"to": "b", "n": 1}]), policy(&["type", "args"]))
        );
        let to_only = |args: Value| {
            key(
                args,
                UniquePolicy {
                    args_keys: vec!["to".into()],
                    ..policy(&["args"])
                },
            )
        };
        assert_eq!(
            to_only(json!([{"to": "a", "n": 1}])),
            to_only(json!([{"to": "a", "n": 2}]))
        );
        assert_eq!(by_type.len(), 64);
        assert!(by_type
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }

    #[test]
    fn equal_text_in_another_normal_form_is_the_same_key() {
        let composed = key(json!(["caf\u{e9}"]), policy(&["args"]));
        let decomposed = key(json!(["cafe\u{301}"]), policy(&["args"]));
        assert_eq!(composed, decomposed);
    }

    #[test]
    fn a_policy_that_cannot_be_followed_is_refused_by_field() {
        let refused = |p: UniquePolicy, args: Value| {
            Uniqueness::of(&envelope(args, p)).unwrap_err().details()
        };
        assert_eq!(
            refused(policy(&["type", "colour"]), json!([])),
            Some(json!({"attribute": "options.unique.keys[1]"}))
        );
        assert_eq!(
            refused(policy(&["meta"]), json!([])),
            Some(json!({"attribute": "options.unique.meta_keys"}))
        );
        assert_eq!(
            refused(
                UniquePolicy {
                    args_keys: vec!["to".into()],
                    ..policy(&["args"])
                },
                json!([{"from": "x"}])
            ),
            Some(json!({"attribute": "options.unique.args_keys[0]"}))
        );
        assert_eq!(
            refused(
                UniquePolicy {
                    on_conflict: "merge".into(),
                    ..policy(&[])
                },
                json!([])
            ),
            Some(json!({"attribute": "options.unique.on_conflict"}))
        );
        assert_eq!(
            refused(
                UniquePolicy {
                    states: vec!["waiting".into()],
                    ..policy(&[])
                },
                json!([])
            ),
            Some(json!({"attribute": "options.unique.states[0]"}))
        );
        assert_eq!(
            refused(
                UniquePolicy {
                    period: "soon".into(),
                    ..policy(&[])
                },
                json!([])
            ),
            Some(json!({"attribute": "options.unique.period"}))
        );
    }

    #[test]
    fn a_stored_job_counts_in_the_policy_s_states_and_within_its_period() {
        let mut stored_env = envelope(json!([]), policy(&[]));
        let created = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        stored_env.created_at = Some(created);
        stored_env.state = Some(JobState::Available);
        let stored = Job {
            envelope: stored_env,
            extra: Map::new(),
        };
        let u = Uniqueness {
            key: String::new(),
            states: vec![JobState::Available],
            period: Some(Duration::from_secs(2)),
            on_conflict: OnConflict::Reject,
        };
        assert!(u.is_taken_by(&stored, created + chrono::Duration::seconds(1)));
        assert!(!u.is_taken_by(&stored, created + chrono::Duration::seconds(2)));
        let mut done = stored.clone();
        done.envelope.state = Some(JobState::Completed);
        assert!(!u.is_taken_by(&done, created));
        let forever = Uniqueness { period: None, ..u };
        assert!(forever.is_taken_by(&stored, created + chrono::Duration::days(365)));
    }
}
