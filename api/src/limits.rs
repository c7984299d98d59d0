//! Every bound a request's content meets, in one place, so that both
//! bindings refuse the same values with the same words (docs/security.md
//! lists them): durations a job or a worker names, and what a FETCH may
//! ask for. A value past a bound is refused when the request is validated
//! (400 `invalid_request` naming the field and the bound), never stored,
//! so no later step (a retry's backoff, a visibility deadline) meets a
//! time it cannot compute.

use std::time::Duration;

use ojs_core::JobEnvelope;
use serde_json::Value;

use crate::error::ApiError;

/// Longest retry interval (`retry.initial_interval`, `retry.max_interval`):
/// 30 days.
pub const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(30 * 86_400);
/// Largest `retry.backoff_coefficient`.
pub const MAX_BACKOFF_COEFFICIENT: f64 = 100.0;
/// Longest visibility a job, a FETCH or a heartbeat may ask for: 12 hours.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3_600);
/// Longest execution timeout (`timeout_ms`, `timeout`): 7 days.
pub const MAX_EXECUTION_TIMEOUT: Duration = Duration::from_secs(7 * 86_400);
/// Most queues one FETCH (or job stream) may name.
pub const MAX_FETCH_QUEUES: usize = 32;
/// Most jobs one FETCH may ask for.
pub const MAX_FETCH_COUNT: usize = 1000;

/// Deepest nesting of a request body: a job's values may nest
/// [`ojs_core::MAX_VALUE_DEPTH`] levels, inside a batch, a job and
/// `args`.
pub const MAX_BODY_DEPTH: usize = ojs_core::MAX_VALUE_DEPTH + 4;
/// Largest integer a job may carry exactly (2^53: the protobuf form holds
/// numbers as doubles).
const MAX_SAFE_INTEGER: &[u8] = b"9007199254740992";

/// Checks a JSON body on its bytes, before any value is built: nesting at
/// most [`MAX_BODY_DEPTH`], at most `max_values` values (arrays, objects
/// and their members: what parsing would allocate for), and no integer
/// beyond ±2^53 (a parser would turn one beyond 64 bits into a double and
/// change it silently). Bytes that are not JSON pass, for the parser to
/// name what is wrong with them.
pub fn check_json_shape(bytes: &[u8], max_values: usize) -> Result<(), ApiError> {
    let mut depth = 0usize;
    let mut values = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            i += 1;
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                values += 1;
                if depth > MAX_BODY_DEPTH {
                    return Err(ApiError::invalid(
                        "",
                        format!("the body nests deeper than {MAX_BODY_DEPTH} levels (at byte {i})"),
                    ));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' => values += 1,
            b'-' | b'0'..=b'9' => {
                let start = i;
                let digits_from = if b == b'-' { i + 1 } else { i };
                let mut end = digits_from;
                while end < bytes.len() && bytes[end].is_ascii_digit() {
                    end += 1;
                }
                let fraction = end < bytes.len() && matches!(bytes[end], b'.' | b'e' | b'E');
                let digits = &bytes[digits_from..end];
                if !fraction && beyond_safe_integer(digits) {
                    let literal = String::from_utf8_lossy(&bytes[start..end.min(start + 40)]);
                    return Err(ApiError::invalid(
                        "",
                        format!(
                            "the integer {literal}{} at byte {start} is beyond ±2^53 and cannot be carried exactly; send it as a string",
                            if end - start > 40 { "…" } else { "" }
                        ),
                    ));
                }
                i = end.max(i + 1);
                continue;
            }
            _ => {}
        }
        if values > max_values {
            return Err(ApiError::invalid(
                "",
                format!("the body has more than {max_values} values ([api] max_json_values)"),
            ));
        }
        i += 1;
    }
    Ok(())
}

fn beyond_safe_integer(digits: &[u8]) -> bool {
    let significant = match digits.iter().position(|d| *d != b'0') {
        Some(first) => &digits[first..],
        None => return false,
    };
    significant.len() > MAX_SAFE_INTEGER.len()
        || (significant.len() == MAX_SAFE_INTEGER.len() && significant > MAX_SAFE_INTEGER)
}

/// A whole number of milliseconds from 1 to `max`, or the binding's error
/// naming `field`.
pub fn millis(field: &str, value: &Value, max: Duration) -> Result<Duration, ApiError> {
    value
        .as_u64()
        .filter(|ms| *ms > 0 && u128::from(*ms) <= max.as_millis())
        .map(Duration::from_millis)
        .ok_or_else(|| out_of_range_ms(field, max))
}

/// The error of a millisecond field past its bound.
pub fn out_of_range_ms(field: &str, max: Duration) -> ApiError {
    ApiError::invalid(
        field,
        format!(
            "must be a whole number of milliseconds from 1 to {}",
            max.as_millis()
        ),
    )
}

/// A duration a worker names in milliseconds (gRPC), within `max`.
pub fn bounded_ms(field: &str, ms: u64, max: Duration) -> Result<Duration, ApiError> {
    if ms == 0 || u128::from(ms) > max.as_millis() {
        return Err(out_of_range_ms(field, max));
    }
    Ok(Duration::from_millis(ms))
}

/// The queues of a FETCH or job stream: valid names, at most
/// [`MAX_FETCH_QUEUES`] of them.
pub fn check_fetch_queues(queues: &[String]) -> Result<(), ApiError> {
    if queues.len() > MAX_FETCH_QUEUES {
        return Err(ApiError::invalid(
            "queues",
            format!(
                "names {} queues; one FETCH takes at most {MAX_FETCH_QUEUES}",
                queues.len()
            ),
        ));
    }
    for q in queues {
        ojs_core::envelope::validate_queue_name(q)
            .map_err(|e| ApiError::invalid("queues", e.to_string()))?;
    }
    Ok(())
}

/// The bounds of a job this server takes, whichever binding pushed it.
pub fn check_job(envelope: &JobEnvelope) -> Result<(), ApiError> {
    if let Some(policy) = &envelope.retry {
        for (field, text) in [
            ("options.retry.initial_interval", &policy.initial_interval),
            ("options.retry.max_interval", &policy.max_interval),
        ] {
            if text.is_empty() {
                continue;
            }
            let d = ojs_core::duration::parse_iso8601_duration(text)
                .map_err(|e| ApiError::invalid(field, e))?;
            if d > MAX_RETRY_INTERVAL {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "{text} is longer than {} s (30 days), the longest retry interval",
                        MAX_RETRY_INTERVAL.as_secs()
                    ),
                ));
            }
        }
        if policy.backoff_coefficient > MAX_BACKOFF_COEFFICIENT {
            return Err(ApiError::invalid(
                "options.retry.backoff_coefficient",
                format!("must be from 1.0 to {MAX_BACKOFF_COEFFICIENT}"),
            ));
        }
    }
    if u64::try_from(envelope.timeout).is_ok_and(|s| s > MAX_EXECUTION_TIMEOUT.as_secs()) {
        return Err(ApiError::invalid(
            "options.timeout_ms",
            format!(
                "must be at most {} ms (7 days)",
                MAX_EXECUTION_TIMEOUT.as_millis()
            ),
        ));
    }
    for (key, max) in [
        ("timeout_ms", MAX_EXECUTION_TIMEOUT),
        ("visibility_timeout_ms", MAX_VISIBILITY),
    ] {
        if let Some(v) = envelope.unknown_attributes.get(key) {
            // 0 is "none" for the execution timeout; the visibility's
            // lower bound is the binding's own (1000).
            if v.as_u64() != Some(0) {
                millis(&format!("options.{key}"), v, max)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn job(options: Value) -> Result<crate::Job, ApiError> {
        crate::job::from_json(
            json!({"type": "a.b", "args": [], "options": options}),
            chrono::Utc::now(),
        )
    }

    #[test]
    fn a_body_s_shape_is_checked_before_it_is_parsed() {
        let ok = br#"{"type":"a.b","args":[1,-2,9007199254740992,-9007199254740992,1.5e300,"12345678901234567890123"],"meta":{"k":[[],{}]}}"#;
        assert!(check_json_shape(ok, 100).is_ok());
        for (body, says) in [
            (&b"[9007199254740993]"[..], "beyond ±2^53"),
            (
                b"{\"a\":-123456789012345678901234567890123456789}",
                "beyond ±2^53",
            ),
            (b"[[],[],[],[],[]]", "more than 5 values"),
        ] {
            let e = check_json_shape(body, 5).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
            assert_eq!(e.code(), crate::error::ErrorCode::InvalidRequest);
        }
        let deep = format!(
            "{}{}",
            "[".repeat(MAX_BODY_DEPTH + 1),
            "]".repeat(MAX_BODY_DEPTH + 1)
        );
        assert!(check_json_shape(deep.as_bytes(), usize::MAX)
            .unwrap_err()
            .to_string()
            .contains("nests deeper"));
        // Brackets, commas and digits inside strings are text.
        assert!(check_json_shape(br#"["[[[,,,99999999999999999999\"]]"]"#, 3).is_ok());
    }

    #[test]
    fn durations_past_their_bounds_are_refused_by_name() {
        for (options, field) in [
            (
                json!({"retry": {"initial_interval": "PT90000000000000S"}}),
                "options.retry.initial_interval",
            ),
            (
                json!({"retry": {"max_interval": "P31D"}}),
                "options.retry.max_interval",
            ),
            (
                json!({"retry": {"max_interval_ms": u64::MAX}}),
                "options.retry.max_interval",
            ),
            (
                json!({"retry": {"backoff_coefficient": 1e9}}),
                "options.retry.backoff_coefficient",
            ),
            (json!({"timeout_ms": u64::MAX}), "options.timeout_ms"),
            (
                json!({"visibility_timeout_ms": u64::MAX}),
                "options.visibility_timeout_ms",
            ),
            (
                json!({"visibility_timeout_ms": 43_200_001}),
                "options.visibility_timeout_ms",
            ),
        ] {
            match job(options.clone()) {
                Err(ApiError::InvalidRequest {
                    attribute: Some(a), ..
                }) => assert_eq!(a, field, "{options}"),
                other => panic!("{options}: {other:?}"),
            }
        }
        for ok in [
            json!({"retry": {"initial_interval": "P30D", "max_interval": "P30D"}}),
            json!({"timeout_ms": 604_800_000u64}),
            json!({"visibility_timeout_ms": 43_200_000u64}),
        ] {
            assert!(job(ok.clone()).is_ok(), "{ok}");
        }
    }
}
