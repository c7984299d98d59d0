//! Any JSON value as the body of PUSH, batch PUSH, FETCH, ACK, NACK or
//! heartbeat gets an answer of 2xx or 4xx from the binding: never a panic,
//! never a 5xx for the client's bytes. Run against the service over the
//! in-process memory broker and the embedded job store (a property test;
//! the daemon's own listener is tested through a real process elsewhere).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ojs_api::{Api, ApiSettings};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Names the binding reads, so that generated objects reach its rules.
const KEYS: &[&str] = &[
    "type",
    "args",
    "id",
    "meta",
    "options",
    "queue",
    "priority",
    "retry",
    "unique",
    "tags",
    "timeout_ms",
    "visibility_timeout_ms",
    "scheduled_at",
    "delay_until",
    "expires_at",
    "max_attempts",
    "initial_interval",
    "max_interval",
    "backoff_coefficient",
    "jitter",
    "on_exhaustion",
    "jobs",
    "queues",
    "count",
    "wait_ms",
    "worker_id",
    "job_id",
    "result",
    "error",
    "code",
    "message",
    "retryable",
    "details",
    "requeue",
    "active_jobs",
    "pending",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (-1e12f64..1e12).prop_map(|f| json!(f)),
        "[a-z.\\-_*]{0,12}".prop_map(Value::String),
        Just(json!("PT1S")),
        Just(json!("2030-01-01T00:00:00Z")),
        Just(json!("q")),
        Just(json!("a.b")),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(|pairs| {
                Value::Object(
                    pairs
                        .into_iter()
                        .map(|(k, v)| ((*k).to_owned(), v))
                        .collect::<Map<_, _>>(),
                )
            }),
        ]
    })
}

const PATHS: &[&str] = &[
    "/ojs/v1/jobs",
    "/ojs/v1/jobs/batch",
    "/ojs/v1/workers/fetch",
    "/ojs/v1/workers/ack",
    "/ojs/v1/workers/nack",
    "/ojs/v1/workers/heartbeat",
];

fn service(runtime: &tokio::runtime::Runtime) -> (Arc<Api>, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("ojs-api-bodies-{}", uuid::Uuid::new_v4()));
    let settings = ApiSettings {
        state_dir: dir.clone(),
        ..ApiSettings::default()
    };
    let adapter = Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ));
    let api = runtime
        .block_on(Api::open(settings, adapter, "memory"))
        .unwrap();
    (api, dir)
}

async fn answer(api: &Api, path: &str, body: Bytes) -> u16 {
    let request = http::Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/openjobspec+json")
        .body(body)
        .unwrap();
    let answered = tokio::time::timeout(
        Duration::from_secs(15),
        ojs_api::http::handle(api, request, "req_property"),
    )
    .await
    .expect("an answer within the longest FETCH wait");
    answered.status().as_u16()
}

#[test]
fn any_json_body_gets_a_2xx_or_a_4xx() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, dir) = service(&runtime);
    let config = ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(path in prop::sample::select(PATHS), body in value())| {
        let bytes = Bytes::from(body.to_string());
        let status = runtime.block_on(answer(&api, path, bytes));
        prop_assert!((200..500).contains(&status), "{path} {body}: {status}");
    });
    // Bytes that are not JSON at all, and JSON cut short.
    proptest!(config, |(path in prop::sample::select(PATHS), bytes in prop::collection::vec(any::<u8>(), 0..64))| {
        let status = runtime.block_on(answer(&api, path, Bytes::from(bytes.clone())));
        prop_assert!((200..500).contains(&status), "{path} {bytes:?}: {status}");
    });
    drop(api);
    let _ = std::fs::remove_dir_all(dir);
}

/// The jobs a property run pushed are real: one that is valid is taken,
/// fetched and acknowledged through the same calls.
#[test]
fn a_valid_body_is_served_through_the_same_calls() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, dir) = service(&runtime);
    runtime.block_on(async {
        let push = json!({"type": "a.b", "args": [1], "options": {"queue": "q"}});
        assert_eq!(
            answer(&api, PATHS[0], Bytes::from(push.to_string())).await,
            201
        );
        let request = http::Request::builder()
            .method("POST")
            .uri(PATHS[2])
            .body(Bytes::from(json!({"queues": ["q"]}).to_string()))
            .unwrap();
        let fetched = ojs_api::http::handle(&api, request, "req_valid").await;
        let jobs: Value = serde_json::from_slice(fetched.body()).unwrap();
        let id = jobs["jobs"][0]["id"].clone();
        let ack = json!({"job_id": id});
        assert_eq!(
            answer(&api, PATHS[3], Bytes::from(ack.to_string())).await,
            200
        );
    });
    drop(api);
    let _ = std::fs::remove_dir_all(dir);
}
