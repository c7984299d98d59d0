//! The OJS service in process: `Api` over the in-memory broker and the
//! embedded job store, called as the bindings call it (no listener, no
//! daemon process). Each case asserts what the service answers, in its own
//! types and error codes; the bindings' statuses are their own tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_api::clock::{Clock, ManualClock};
use ojs_api::roster::{Beat, Directive};
use ojs_api::worker::{Failure, Fetch};
use ojs_api::{Api, ApiError, ApiSettings, ErrorCode, Exhaustion, Job};
use ojs_core::JobState;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

struct Service {
    api: Arc<Api>,
    /// The service's time, moved by the test.
    clock: Arc<ManualClock>,
    /// Where the clock started.
    start: DateTime<Utc>,
    /// Stops the service's own loop (scheduler, recovery) when dropped.
    _stop: watch::Sender<bool>,
    _dir: ojs_bridge_tests::tempdir::TempDir,
}

/// Where the service's clock starts: two hours behind the wall clock, so a
/// time the service took from the system instead of its clock shows, while
/// what it publishes is not in the broker's future (the broker keeps the
/// system's time).
fn start() -> DateTime<Utc> {
    let t = Utc::now() - chrono::Duration::hours(2);
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap()
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
    let start = start();
    let clock = Arc::new(ManualClock::new(start));
    let api = Api::open_with_clock(settings, adapter, "memory", clock.clone())
        .await
        .unwrap();
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(api.clone().run(stopped));
    Service {
        api,
        clock,
        start,
        _stop: stop,
        _dir: dir,
    }
}

impl Service {
    /// A PUSH body as the HTTP binding reads it, at the service's time.
    fn job(&self, body: Value) -> Job {
        ojs_api::job::from_json(body, self.api.now()).unwrap()
    }

    async fn push(&self, body: Value) -> Result<Job, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        let mut pushed = self.api.push(&grant, vec![self.job(body)]).await?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_job_waits_for_the_service_clock_not_the_wall_clock() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(
            json!({"type": "a.b", "args": [], "options": {"queue": "later",
            "delay_until": "+PT1H"}}),
        )
        .await
        .unwrap();
    assert_eq!(pushed.state(), JobState::Scheduled);
    assert_eq!(pushed.envelope.created_at, Some(s.start));
    let due = s.start + chrono::Duration::hours(1);
    assert_eq!(pushed.envelope.scheduled_at, Some(due));
    // The scheduler runs meanwhile; the hour has not passed on its clock.
    assert!(s
        .fetch("later", Duration::from_millis(700))
        .await
        .is_empty());
    s.clock.advance(Duration::from_secs(3599));
    assert!(s
        .fetch("later", Duration::from_millis(700))
        .await
        .is_empty());
    assert_eq!(
        s.info(&pushed.envelope.id).await.unwrap().state(),
        JobState::Scheduled
    );
    s.clock.advance(Duration::from_secs(2));
    let fetched = s.fetch("later", WAIT).await;
    assert_eq!(fetched.len(), 1, "published once the service's hour passed");
    let enqueued = fetched[0].envelope.enqueued_at.unwrap();
    assert!(enqueued >= due && enqueued <= s.clock.now(), "{enqueued}");
    assert_eq!(fetched[0].envelope.started_at, Some(s.api.now()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_due_after_its_backoff_on_the_service_clock() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "q",
            "retry": {"max_attempts": 3, "initial_interval": "PT10S",
                      "backoff_coefficient": 3, "jitter": false}}}))
        .await
        .unwrap();
    let id = pushed.envelope.id.clone();
    assert_eq!(s.fetch("q", WAIT).await.len(), 1);
    s.clock.advance(Duration::from_secs(5));
    let failed = s
        .nack(&id, json!({"code": "x", "message": "1"}))
        .await
        .unwrap();
    assert_eq!(failed.state(), JobState::Retryable);
    assert_eq!(failed.extra.get("retry_delay_ms"), Some(&json!(10_000)));
    let next = s.start + chrono::Duration::seconds(15);
    assert_eq!(
        failed.extra.get("next_attempt_at"),
        Some(&json!(ojs_api::job::timestamp(next)))
    );
    let failed_at = failed.envelope.errors.last().cloned().unwrap_or_default();
    let stamp = ojs_api::job::timestamp(s.start + chrono::Duration::seconds(5));
    assert!(
        failed_at.to_string().contains(&stamp),
        "the failure is stamped with the service's time {stamp}: {failed_at}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_job_reaches_the_broker_only_when_activated() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(
            json!({"type": "a.b", "args": [], "options": {"queue": "gate",
            "pending": true}}),
        )
        .await
        .unwrap();
    assert_eq!(pushed.state(), JobState::Pending);
    assert!(s.fetch("gate", Duration::from_millis(300)).await.is_empty());
    let grant = s.api.tokens().identify(None).unwrap();
    let active = s.api.activate(&grant, &pushed.envelope.id).await.unwrap();
    assert_eq!(active.state(), JobState::Available);
    assert_eq!(active.envelope.enqueued_at, Some(s.start));
    assert_eq!(s.fetch("gate", WAIT).await.len(), 1);
    // Only a pending job is activated.
    let again = s
        .api
        .activate(&grant, &pushed.envelope.id)
        .await
        .unwrap_err();
    assert_eq!(again.code(), ErrorCode::Conflict, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_stored_whole_or_not_at_all() {
    let s = service(|settings| {
        settings.queues = vec![ojs_core::glob::Glob::new("ok.*").unwrap()];
    })
    .await;
    let grant = s.api.tokens().identify(None).unwrap();
    let good = s.job(json!({"type": "a.b", "args": [], "options": {"queue": "ok.1"}}));
    let bad = s.job(json!({"type": "a.b", "args": [], "options": {"queue": "elsewhere"}}));
    let refused = s
        .api
        .push(&grant, vec![good.clone(), bad])
        .await
        .unwrap_err();
    assert!(
        matches!(refused, ApiError::QueueNotServed { .. }),
        "{refused}"
    );
    let lost = s.info(&good.envelope.id).await.unwrap_err();
    assert_eq!(
        lost.code(),
        ErrorCode::NotFound,
        "nothing of the batch stored"
    );
    assert!(s.fetch("ok.1", Duration::from_millis(300)).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_stale_once_silent_past_the_limit_on_the_service_clock() {
    let s = service(|_| {}).await;
    let grant = s.api.tokens().identify(None).unwrap();
    let beat = || Beat {
        worker_id: "w-7".into(),
        active_jobs: Some(2),
        about: Map::new(),
    };
    assert_eq!(
        s.api.beat(&grant, beat()).await.unwrap(),
        Directive::Running
    );
    let listed = s.api.workers_list(&grant, 1, 50).await.unwrap();
    let worker = &listed.items[0];
    assert_eq!(worker.record.id, "w-7");
    assert!(!worker.stale, "{listed:?}");
    assert_eq!(worker.record.active_jobs, 2);
    assert_eq!(worker.record.first_seen_at, Some(s.start));
    assert_eq!(listed.summary.running, 1);
    s.clock
        .advance(ojs_api::roster::STALE_AFTER + Duration::from_secs(1));
    let listed = s.api.workers_list(&grant, 1, 50).await.unwrap();
    assert!(listed.items[0].stale, "{listed:?}");
    assert_eq!(listed.summary.stale, 1);
    // A heartbeat makes it current again.
    s.api.beat(&grant, beat()).await.unwrap();
    let listed = s.api.workers_list(&grant, 1, 50).await.unwrap();
    assert!(!listed.items[0].stale, "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_key_is_held_for_its_period_on_the_service_clock() {
    let s = service(|_| {}).await;
    let body = || {
        json!({"type": "report.build", "args": [{"day": "mon"}], "options": {"queue": "u",
            "unique": {"keys": ["type", "args"], "on_conflict": "reject", "period": "PT2S"}}})
    };
    let first = s.push(body()).await.unwrap();
    let refused = s.push(body()).await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Duplicate, "{refused}");
    let details = refused.details().unwrap();
    assert_eq!(details["existing_job_id"], json!(first.envelope.id));
    assert_eq!(details["existing_job_state"], "available");
    assert_eq!(details["uniqueness_key"], details["unique_key"]);
    assert_eq!(details["unique_key"].as_str().map(str::len), Some(64));
    // Two seconds on the service's clock, not the wall's.
    s.clock.advance(Duration::from_secs(2));
    let second = s.push(body()).await.unwrap();
    assert_ne!(second.envelope.id, first.envelope.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ignored_duplicate_is_answered_by_the_job_holding_its_key() {
    let s = service(|_| {}).await;
    let body = || {
        json!({"type": "report.build", "args": [1], "options": {"queue": "u",
            "unique": {"keys": ["type", "args"], "on_conflict": "ignore"}}})
    };
    let first = s.push(body()).await.unwrap();
    let grant = s.api.tokens().identify(None).unwrap();
    let pushed = s.api.push_all(&grant, vec![s.job(body())]).await.unwrap();
    assert!(pushed[0].deduplicated);
    assert_eq!(pushed[0].job.envelope.id, first.envelope.id);
    // Only the first reaches the broker.
    let fetched = s.fetch("u", WAIT).await;
    assert_eq!(fetched.len(), 1);
    assert!(s.fetch("u", Duration::from_millis(300)).await.is_empty());
    // A policy that cannot be followed is refused with the push.
    let bad = ojs_api::job::from_json(
        json!({"type": "a.b", "args": [], "options": {"unique": {"keys": ["colour"]}}}),
        s.api.now(),
    )
    .unwrap_err();
    assert_eq!(
        bad.details(),
        Some(json!({"attribute": "options.unique.keys[0]"}))
    );
}
