//! The API's request parsing and validation as a fuzz target, shared by
//! the cargo-fuzz harness (`fuzz/`) and a test that replays its committed
//! corpus (`api/tests/fuzz_corpus.rs`).
//!
//! It must never panic, and a job it accepts must be one this build can
//! store and read back (what the job store writes decodes again, and the
//! broker's protobuf form encodes): a request can never make a stored job
//! unreadable.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use serde_json::Value;

use crate::http::{batch, parse_json, read_job, worker_request};
use crate::limits::check_json_shape;
use crate::Job;

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// Every target, by name (the corpus folder and the fuzz binary).
pub const TARGETS: &[(&str, Target)] = &[("api_request", api_request)];

/// The first byte picks the route (and, with its high bit, a protobuf
/// body); the rest is the body: PUSH, batch PUSH, FETCH, ACK, NACK or
/// heartbeat, through the binding's own parsing and validation.
pub fn api_request(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let mut headers = HeaderMap::new();
    if selector & 0x80 != 0 {
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static(ojs_core::envelope::media::OJS_PROTO),
        );
    } else if check_json_shape(body, 10_000).is_err() {
        return;
    }
    match selector & 0x07 {
        0 => {
            if let Ok(job) = read_job(
                &headers,
                Bytes::copy_from_slice(body),
                10_000,
                chrono::Utc::now(),
            ) {
                storable(&job);
            }
        }
        1 => {
            if let Ok(jobs) = batch(&headers, body, 1000, chrono::Utc::now()) {
                jobs.iter().for_each(storable);
            }
        }
        n => {
            let action =
                ["fetch", "ack", "nack", "heartbeat", "fail", "unknown"][usize::from(n) - 2];
            if let Ok(Value::Object(map)) = parse_json(body) {
                let _ = worker_request(action, map);
            }
        }
    }
}

/// What the store and the broker do with an accepted job succeeds.
fn storable(job: &Job) {
    let (envelope, extra) = crate::store::encode(job)
        .unwrap_or_else(|e| panic!("an accepted job does not encode for the store: {e}"));
    let back = crate::store::decode(&job.envelope.id, &envelope, &extra)
        .unwrap_or_else(|e| panic!("a stored job does not decode: {e}"));
    assert_eq!(back.envelope.id, job.envelope.id);
    job.envelope
        .to_proto_bytes()
        .unwrap_or_else(|e| panic!("an accepted job does not encode for the broker: {e}"));
}
