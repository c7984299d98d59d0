//! The OJS service in process: `Api` over the in-memory broker and the
//! embedded job store, called as the bindings call it (no listener, no
//! daemon process). Each case asserts what the service answers, in its own
//! types and error codes; the bindings' statuses are their own tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use ojs_api::worker::{Failure, Fetch};
use ojs_api::{Api, ApiError, ApiSettings, ErrorCode, Exhaustion, Job};
use ojs_core::JobState;
use serde_json::{json, Map, Value};

struct Service {
    api: Arc<Api>,
    _dir: ojs_bridge_tests::tempdir::TempDir,
}

async fn service(adjust: impl FnOnce(&mut ApiSettings)) -> Service {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("ojs-service");
    let mut settings = ApiSettings {
        state_dir: dir.path().to_path_buf(),
        ..ApiSettings::default()
    };
    adjust(&mut settings);
    let adapter = Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ));
    let api = Api::open(settings, adapter, "memory").await.unwrap();
    Service { api, _dir: dir }
}

fn job(body: Value) -> Job {
    ojs_api::job::from_json(body, Utc::now()).unwrap()
}

impl Service {
    async fn push(&self, body: Value) -> Result<Job, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        let mut pushed = self.api.push(&grant, vec![job(body)]).await?;
        Ok(pushed.remove(0))
    }

    async fn fetch(&self, queue: &str, wait: Duration) -> Vec<Job> {
        let grant = self.api.tokens().identify(None).unwrap();
        self.api
            .fetch(
                &grant,
                Fetch {
                    queues: vec![queue.to_owned()],
                    count: 10,
                    worker_id: Some("w1".into()),
                    visibility: None,
                    wait,
                },
            )
            .await
            .unwrap()
    }

    async fn ack(&self, id: &str) -> Result<Job, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        self.api.ack(&grant, id, Some(json!({"done": true}))).await
    }

    async fn nack(&self, id: &str, error: Value) -> Result<Job, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        let error: Map<String, Value> = error.as_object().cloned().unwrap_or_default();
        self.api
            .nack(
                &grant,
                Failure {
                    job_id: id.to_owned(),
                    error,
                    requeue: false,
                },
            )
            .await
    }

    async fn info(&self, id: &str) -> Result<Job, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        self.api.info(&grant, id).await
    }

    async fn cancel(&self, id: &str) -> Result<(JobState, Job), ApiError> {
        let grant = self.api.tokens().identify(None)?;
        self.api.cancel(&grant, id).await
    }
}

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_job_is_fetched_once_and_acked_once() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(json!({"type": "email.send", "args": [1], "options": {"queue": "mail"}}))
        .await
        .unwrap();
    assert_eq!(pushed.state(), JobState::Available);
    let fetched = s.fetch("mail", WAIT).await;
    assert_eq!(fetched.len(), 1);
    assert_eq!(fetched[0].envelope.id, pushed.envelope.id);
    assert_eq!(fetched[0].state(), JobState::Active);
    assert_eq!(fetched[0].envelope.attempt, 1);
    // Nothing else to hand out: the job is its worker's.
    assert!(s.fetch("mail", Duration::from_millis(200)).await.is_empty());
    let done = s.ack(&pushed.envelope.id).await.unwrap();
    assert_eq!(done.state(), JobState::Completed);
    assert_eq!(done.envelope.result, Some(json!({"done": true})));
    // A second ACK finds the job finished: the state machine's conflict.
    let again = s.ack(&pushed.envelope.id).await.unwrap_err();
    assert_eq!(again.code(), ErrorCode::Conflict, "{again}");
    assert_eq!(
        s.info(&pushed.envelope.id).await.unwrap().state(),
        JobState::Completed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_is_retried_then_discarded_by_its_policy() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "q",
            "retry": {"max_attempts": 2, "initial_interval": "PT0.2S", "jitter": false}}}))
        .await
        .unwrap();
    let id = pushed.envelope.id.clone();
    assert_eq!(s.fetch("q", WAIT).await.len(), 1);
    let failed = s
        .nack(&id, json!({"code": "smtp", "message": "refused"}))
        .await
        .unwrap();
    assert_eq!(failed.state(), JobState::Retryable);
    assert_eq!(failed.extra.get("retry_delay_ms"), Some(&json!(200)));
    // The broker redelivers it after the backoff: attempt 2.
    let again = s.fetch("q", WAIT).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].envelope.attempt, 2);
    let last = s
        .nack(&id, json!({"code": "smtp", "message": "refused again"}))
        .await
        .unwrap();
    // Exhausted, and neither the job nor the server keeps dead letters.
    assert_eq!(last.state(), JobState::Discarded);
    assert!(!last.is_dead_letter());
    assert_eq!(last.envelope.errors.len(), 2);
    let grant = s.api.tokens().identify(None).unwrap();
    assert_eq!(s.api.dead_letter_stats(&grant).await.unwrap().total, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_keeps_dead_letters_lists_a_job_that_fails_for_good() {
    let s = service(|settings| settings.on_exhaustion = Exhaustion::DeadLetter).await;
    let pushed = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "q",
            "retry": {"non_retryable_errors": ["Fatal"]}}}))
        .await
        .unwrap();
    assert_eq!(s.fetch("q", WAIT).await.len(), 1);
    let dead = s
        .nack(
            &pushed.envelope.id,
            json!({"code": "Fatal", "message": "no"}),
        )
        .await
        .unwrap();
    assert!(dead.is_dead_letter(), "{:?}", dead.extra);
    let grant = s.api.tokens().identify(None).unwrap();
    let stats = s.api.dead_letter_stats(&grant).await.unwrap();
    assert_eq!(stats.total, 1);
    assert_eq!(stats.by_queue.get("q"), Some(&1));
    assert_eq!(stats.by_error_type.get("Fatal"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_answers_the_previous_state_and_refuses_a_finished_job() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "q"}}))
        .await
        .unwrap();
    let (previous, cancelled) = s.cancel(&pushed.envelope.id).await.unwrap();
    assert_eq!(previous, JobState::Available);
    assert_eq!(cancelled.state(), JobState::Cancelled);
    // Its copy on the broker is never handed out.
    assert!(s.fetch("q", Duration::from_millis(300)).await.is_empty());
    let again = s.cancel(&pushed.envelope.id).await.unwrap_err();
    assert_eq!(again.code(), ErrorCode::Conflict);
    let unknown = s.info("no-such-job").await.unwrap_err();
    assert_eq!(unknown.code(), ErrorCode::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_push_is_refused_for_is_named_by_its_code() {
    let s = service(|settings| {
        settings.queues = vec![ojs_core::glob::Glob::new("mail.*").unwrap()];
    })
    .await;
    let outside = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "billing"}}))
        .await
        .unwrap_err();
    assert_eq!(outside.code(), ErrorCode::NotFound, "{outside}");
    assert!(matches!(outside, ApiError::QueueNotServed { .. }));
    let first = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "mail.eu"}}))
        .await
        .unwrap();
    let duplicate = s
        .push(json!({"id": first.envelope.id, "type": "a.b", "args": [],
                     "options": {"queue": "mail.eu"}}))
        .await
        .unwrap_err();
    assert_eq!(duplicate.code(), ErrorCode::Duplicate, "{duplicate}");
    assert!(!duplicate.retryable());
}
