//! The in-process HTTP harness the binding's tests share: the service on
//! the in-memory broker and the embedded store, three tokens (`root`
//! admin, `reader`, `team` admin of `team.*`), requests through
//! `http::handle`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ojs_api::auth::{Operation, Token, Tokens};
use ojs_api::worker::{Failure, Fetch};
use ojs_api::{Api, ApiSettings};
use ojs_core::glob::Glob;
use ojs_core::redact::Secret;
use serde_json::{json, Value};

pub struct Server {
    pub api: Arc<Api>,
    _dir: ojs_bridge_tests::tempdir::TempDir,
}

pub async fn server() -> Server {
    server_with(|_| {}).await
}

pub async fn server_with(adjust: impl FnOnce(&mut ApiSettings)) -> Server {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("ojs-api-http");
    let token = |name: &str, operations: Vec<Operation>, queues: &[&str]| Token {
        name: name.into(),
        secret: Secret::new(format!("secret-{name}")),
        operations,
        queues: queues.iter().map(|q| Glob::new(q).unwrap()).collect(),
    };
    let settings = ApiSettings {
        state_dir: dir.path().to_path_buf(),
        tokens: Tokens::new(vec![
            token("root", vec![Operation::Admin], &[]),
            token("reader", vec![Operation::Read], &[]),
            token("team", vec![Operation::Admin], &["team.*"]),
        ]),
        ..ApiSettings::default()
    };
    let mut settings = settings;
    adjust(&mut settings);
    let adapter = Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ));
    let api = Api::open(settings, adapter, "memory").await.unwrap();
    Server { api, _dir: dir }
}

impl Server {
    pub async fn call(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer secret-{token}"))
            .header("content-type", "application/json")
            .body(body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string())))
            .unwrap();
        let answer = ojs_api::http::handle(&self.api, request, "req_test").await;
        let status = answer.status().as_u16();
        let body = serde_json::from_slice(answer.body()).unwrap_or(Value::Null);
        (status, body)
    }

    pub async fn push(&self, job_type: &str, queue: &str, n: usize) -> Vec<String> {
        let jobs: Vec<Value> = (0..n)
            .map(|i| json!({"type": job_type, "args": [i], "options": {"queue": queue}}))
            .collect();
        let (status, body) = self
            .call(
                "root",
                "POST",
                "/ojs/v1/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_owned())
            .collect()
    }

    /// FETCHes `n` jobs of `queue` and ACKs or (for good) NACKs them.
    pub async fn settle(&self, queue: &str, n: usize, complete: bool) {
        let grant = self
            .api
            .tokens()
            .identify(Some("Bearer secret-root"))
            .unwrap();
        let mut done = 0;
        while done < n {
            let jobs = self
                .api
                .fetch(
                    &grant,
                    Fetch {
                        queues: vec![queue.into()],
                        count: n - done,
                        worker_id: None,
                        visibility: None,
                        wait: Duration::from_secs(2),
                    },
                )
                .await
                .unwrap();
            assert!(!jobs.is_empty(), "{queue}: {done} of {n} settled");
            for job in jobs {
                if complete {
                    self.api.ack(&grant, &job.envelope.id, None).await.unwrap();
                } else {
                    let error = json!({"code": "boom", "message": "no", "retryable": false});
                    self.api
                        .nack(
                            &grant,
                            Failure {
                                job_id: job.envelope.id,
                                error: error.as_object().cloned().unwrap(),
                                requeue: false,
                            },
                        )
                        .await
                        .unwrap();
                }
                done += 1;
            }
        }
    }
}
