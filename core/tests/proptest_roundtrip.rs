//! Property tests: random envelopes survive JSON → proto → JSON and
//! proto → JSON → proto unchanged (docs/design.md §3).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, SecondsFormat, Utc};
use ojs_core::{JobEnvelope, JobError, JobState, RetryPolicy, UniquePolicy};
use proptest::prelude::*;
use serde_json::{Map, Number, Value};

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..=(1i64 << 53)).prop_map(|i| Value::Number(i.into())),
        // Non-integral finite doubles (integral ones normalise to integers).
        (-1e12f64..1e12f64)
            .prop_filter("non-integral", |f| f.fract() != 0.0)
            .prop_map(|f| Value::Number(Number::from_f64(f).unwrap())),
        "\\PC{0,12}".prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{0,6}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn timestamp() -> impl Strategy<Value = Option<DateTime<Utc>>> {
    prop_oneof![
        Just(None),
        (1i64..253_402_300_799, 0u32..1_000_000_000)
            .prop_map(|(s, n)| DateTime::from_timestamp(s, n)),
    ]
}

fn small_int() -> impl Strategy<Value = i32> {
    prop_oneof![Just(0), 1..i32::MAX]
}

fn type_name() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_]{0,8}(\\.[a-z][a-z0-9_]{0,8}){0,2}"
}

fn name() -> impl Strategy<Value = String> {
    "[a-z0-9][a-z0-9-]{0,8}(\\.[a-z0-9][a-z0-9-]{0,8}){0,2}"
}

fn retry() -> impl Strategy<Value = Option<RetryPolicy>> {
    proptest::option::of(
        (
            proptest::option::of(small_int()),
            prop_oneof![
                Just(String::new()),
                Just("PT1S".to_owned()),
                Just("PT0.5S".to_owned())
            ],
            prop_oneof![Just(0.0), 1.0f64..10.0],
            any::<bool>(),
            prop::collection::vec("[A-Za-z]{1,10}", 0..3),
            prop_oneof![Just(""), Just("discard"), Just("dead_letter")],
        )
            .prop_map(
                |(max_attempts, interval, coeff, jitter, errors, exhaustion)| RetryPolicy {
                    max_attempts,
                    initial_interval: interval.clone(),
                    backoff_coefficient: coeff,
                    max_interval: interval,
                    jitter,
                    non_retryable_errors: errors,
                    on_exhaustion: exhaustion.to_owned(),
                    unknown_fields: Vec::new(),
                },
            ),
    )
}

prop_compose! {
    fn envelope()(
        specversion in prop_oneof![Just("1.0"), Just("1.0.0-rc.1")],
        job_type in type_name(),
        queue in name(),
        args in prop::collection::vec(json_value(), 0..5),
        meta in prop::collection::btree_map("[a-z_.]{1,10}", json_value(), 0..4),
        priority in any::<i32>(),
        timeout in small_int(),
        ts in prop::collection::vec(timestamp(), 6),
        retry in retry(),
        unique in proptest::option::of((
            prop::sample::subsequence(vec!["type", "queue", "args", "meta"], 0..=4),
            prop_oneof![Just(""), Just("reject"), Just("replace"), Just("ignore"), Just("replace_except_schedule")],
            prop::collection::vec("[a-z_]{1,6}", 0..3),
            prop::sample::subsequence(vec!["available", "active", "scheduled"], 0..=3),
        )),
        history in prop::collection::vec(("[A-Z_]{1,12}", "\\PC{1,20}", 1i64..20, timestamp()), 0..3),
        extra in prop::collection::btree_map("x_[a-z]{1,6}", json_value(), 0..3),
        schema in proptest::option::of("https://[a-z]{1,8}\\.example/s"),
        state in proptest::option::of(1i32..=8),
        attempt in small_int(),
        error in proptest::option::of(("[A-Za-z]{1,8}", "\\PC{1,20}", prop::collection::vec("[a-z :.()0-9]{1,20}", 0..3), small_int())),
        result in proptest::option::of(json_value().prop_filter("null is absent", |v| !v.is_null())),
        ext_ints in prop::collection::vec(small_int(), 5),
        extensions in prop::collection::btree_map("x-[a-z]{1,5}-[a-z]{1,5}", json_value(), 0..3),
    ) -> JobEnvelope {
        let mut job = JobEnvelope::new(job_type, args);
        job.specversion = specversion.to_owned();
        job.queue = queue;
        job.meta = meta.into_iter().collect();
        job.priority = priority;
        job.timeout = timeout;
        job.scheduled_at = ts[0];
        job.expires_at = ts[1];
        job.created_at = ts[2];
        job.enqueued_at = ts[3];
        job.started_at = ts[4];
        job.completed_at = ts[5];
        job.retry = retry;
        job.unique = unique.map(|(keys, on_conflict, meta_keys, states)| {
            let keys: Vec<String> = keys.into_iter().map(str::to_owned).collect();
            let mut meta_keys: Vec<String> = meta_keys;
            meta_keys.dedup();
            meta_keys.sort();
            meta_keys.dedup();
            if keys.iter().any(|k| k == "meta") && meta_keys.is_empty() {
                meta_keys.push("tenant_id".into());
            }
            UniquePolicy {
                keys, period: "PT1H".into(), on_conflict: on_conflict.to_owned(),
                args_keys: vec!["month".into()], meta_keys,
                states: states.into_iter().map(str::to_owned).collect(),
                unknown_fields: Vec::new(),
            }
        });
        job.errors = history
            .into_iter()
            .enumerate()
            .filter_map(|(i, (code, message, attempt, at))| {
                let at = at?;
                Some(serde_json::json!({
                    "code": code, "message": message, "attempt": attempt + i as i64,
                    "occurred_at": at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
                }))
            })
            .collect();
        job.unknown_attributes = extra.into_iter().collect();
        job.schema = schema;
        job.state = state.and_then(JobState::from_i32);
        job.attempt = attempt;
        job.error = error.map(|(t, m, backtrace, limit)| JobError {
            error_type: t, message: m, backtrace, timeout_kind: String::new(),
            limit_seconds: limit, elapsed_seconds: 0, unknown_fields: Vec::new(),
        });
        job.result = result;
        job.total_timeout = ext_ints[0];
        job.enqueue_ttl = ext_ints[1];
        job.grace_period = ext_ints[2];
        job.heartbeat_timeout = ext_ints[3];
        job.result_ttl = ext_ints[4];
        job.extensions = extensions.into_iter().collect();
        job
    }
}

/// An envelope's entries through a serializer's map, those in `.2` left
/// out.
struct ThroughSerializer<'a>(&'a JobEnvelope, SecondsFormat, &'a [&'a str]);

impl serde::Serialize for ThroughSerializer<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        self.0
            .write_json_entries(&mut m, self.1, |k| !self.2.contains(&k))?;
        m.end()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn json_to_proto_to_json_is_unchanged(job in envelope()) {
        let json = job.to_json_value().unwrap();
        let from_json = JobEnvelope::from_json_value(json.clone()).unwrap();
        let proto = from_json.to_proto_bytes().unwrap();
        let back = JobEnvelope::from_proto_bytes(&proto).unwrap();
        prop_assert_eq!(back.to_json_value().unwrap(), json);
        prop_assert_eq!(back, job);
    }

    /// The envelope's text written straight into bytes (each known key
    /// copied as written in the program) is the text its entries make
    /// through another serializer, serde_json's, whatever entries are left
    /// out and however times are written.
    #[test]
    fn json_written_straight_is_the_entries_through_a_serializer(
        job in envelope(),
        left_out in prop::sample::subsequence(
            vec!["id", "args", "meta", "state", "created_at", "attempt", "retry", "x_a"],
            0..4,
        ),
        millis in any::<bool>(),
    ) {
        let times = if millis { SecondsFormat::Millis } else { SecondsFormat::AutoSi };
        prop_assert_eq!(
            job.to_json_vec().unwrap(),
            serde_json::to_vec(&ThroughSerializer(&job, SecondsFormat::AutoSi, &[])).unwrap()
        );
        let mut out = Vec::new();
        let mut object = ojs_core::json_out::Object::open(&mut out);
        job.write_json_object_entries(&mut object, times, |k| !left_out.contains(&k))
            .unwrap();
        object.close();
        prop_assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(&ThroughSerializer(&job, times, &left_out)).unwrap()
        );
    }

    /// The store's text is the bytes' text, exactly.
    #[test]
    fn json_string_is_the_json_bytes(job in envelope()) {
        let bytes = job.to_json_vec().unwrap();
        prop_assert_eq!(job.to_json_string().unwrap().into_bytes(), bytes);
    }

    /// The id read alone is the id decoding gives, for any envelope and
    /// any fields after it, also a second id (the last one counts).
    #[test]
    fn the_id_read_alone_is_the_decoded_id(
        job in envelope(),
        other in envelope(),
        again in any::<bool>(),
    ) {
        let mut proto = job.to_proto_bytes().unwrap();
        if again {
            // A message of two envelopes' fields: the second's id is last.
            proto.extend(other.to_proto_bytes().unwrap());
        }
        let decoded = JobEnvelope::from_proto_bytes_unvalidated(&proto).unwrap();
        prop_assert_eq!(JobEnvelope::proto_id(&proto), Some(decoded.id.as_str()));
    }

    #[test]
    fn proto_to_json_to_proto_is_unchanged(job in envelope()) {
        let proto = job.to_proto_bytes().unwrap();
        let json = JobEnvelope::from_proto_bytes(&proto).unwrap().to_json_vec().unwrap();
        let again = JobEnvelope::from_json_slice(&json).unwrap().to_proto_bytes().unwrap();
        prop_assert_eq!(again, proto);
    }

    /// `from_json_slice` reads a common envelope in one pass and anything
    /// else through the parsed object: both read the same texts the same
    /// way, whatever the order of the keys, a key given twice (the last
    /// one counts), a `null`, an escaped key or an invalid attribute.
    #[test]
    fn one_pass_reads_as_the_parsed_object_does(
        job in envelope(),
        order in any::<prop::sample::Index>(),
        twice in proptest::option::of((any::<prop::sample::Index>(), any::<prop::sample::Index>(), json_value())),
        nulled in proptest::option::of(any::<prop::sample::Index>()),
        escaped in any::<bool>(),
    ) {
        let Value::Object(object) = job.to_json_value().unwrap() else { unreachable!() };
        let mut entries: Vec<(String, Value)> = object.into_iter().collect();
        // A rotation stands in for another order of the keys.
        let at = order.index(entries.len());
        entries.rotate_left(at);
        if let Some((which, at, value)) = twice {
            let key = entries[which.index(entries.len())].0.clone();
            entries.insert(at.index(entries.len() + 1), (key, value));
        }
        if let Some(which) = nulled {
            let i = which.index(entries.len());
            entries[i].1 = Value::Null;
        }
        let mut text = String::from("{");
        for (i, (key, value)) in entries.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            if escaped && key == "id" {
                text.push_str("\"\\u0069d\"");
            } else {
                text.push_str(&serde_json::to_string(key).unwrap());
            }
            text.push(':');
            text.push_str(&serde_json::to_string(value).unwrap());
        }
        text.push('}');
        let one_pass = JobEnvelope::from_json_slice(text.as_bytes()).map_err(|e| e.to_string());
        let parsed = JobEnvelope::from_json_value(serde_json::from_str(&text).unwrap())
            .map_err(|e| e.to_string());
        prop_assert_eq!(one_pass, parsed, "{}", text);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = JobEnvelope::from_proto_bytes(&bytes);
        let _ = JobEnvelope::from_json_slice(&bytes);
    }
}
