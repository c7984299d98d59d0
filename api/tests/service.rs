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
use ojs_queue::QueueAdapter;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

struct Service {
    api: Arc<Api>,
    /// The service's time, moved by the test.
    clock: Arc<ManualClock>,
    /// Where the clock started.
    start: DateTime<Utc>,
    /// The broker the service's queues are on, read to see what it holds.
    broker: Arc<ojs_adapter_memory::MemoryAdapter>,
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
    let api = Api::open_with_clock(settings, adapter.clone(), "memory", clock.clone())
        .await
        .unwrap();
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(api.clone().run(stopped));
    Service {
        api,
        clock,
        start,
        broker: adapter,
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

/// Pushes and fetches `jobs` jobs of `mail`, ACKs them all at once and
/// answers the service once every ACK is answered.
async fn all_fetched_and_acked(linger: Duration, jobs: usize) -> Service {
    let s = service(|settings| settings.ack_linger = linger).await;
    let grant = s.api.tokens().identify(None).unwrap();
    let pushed = (0..jobs)
        .map(|i| s.job(json!({"type": "email.send", "args": [i], "options": {"queue": "mail"}})))
        .collect();
    s.api.push(&grant, pushed).await.unwrap();
    let mut ids = Vec::new();
    while ids.len() < jobs {
        let fetched = s.fetch("mail", WAIT).await;
        assert!(!fetched.is_empty(), "{} of {jobs} fetched", ids.len());
        ids.extend(fetched.into_iter().map(|j| j.envelope.id));
    }
    assert_eq!(s.broker.in_flight("mail"), jobs);
    let mut acks = tokio::task::JoinSet::new();
    for id in ids {
        let api = s.api.clone();
        acks.spawn(async move {
            let grant = api.tokens().identify(None)?;
            api.ack(&grant, &id, None).await
        });
    }
    let mut completed = 0;
    while let Some(answer) = acks.join_next().await {
        assert_eq!(answer.unwrap().unwrap().state(), JobState::Completed);
        completed += 1;
    }
    assert_eq!(completed, jobs);
    s
}

/// The broker acks of answered ACKs wait for each other (`ack_linger`),
/// and a drain sends them at once rather than after the linger: nothing
/// the workers finished is left held on the broker, to be handed out
/// again, when the service stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_sends_the_lingering_broker_acks_at_once() {
    let s = all_fetched_and_acked(Duration::from_secs(600), 300).await;
    assert_eq!(
        s.broker.in_flight("mail"),
        300,
        "the broker acks wait for the linger"
    );
    // A drain that waited for the linger would give up after its own
    // timeout (10 s) with every ack still waiting.
    s.api.drain().await;
    assert_eq!(s.broker.in_flight("mail"), 0, "acks left unsent");
    assert_eq!(s.broker.depth("mail").await.unwrap(), Some(0));
}

/// Without a linger each broker ack goes at once; concurrent ones still
/// share a request where they meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_linger_every_broker_ack_is_sent() {
    let s = all_fetched_and_acked(Duration::ZERO, 300).await;
    s.api.drain().await;
    assert_eq!(s.broker.in_flight("mail"), 0, "acks left unsent");
    assert_eq!(s.broker.depth("mail").await.unwrap(), Some(0));
}

/// A FETCH reads only the id of a binary envelope whose job the store
/// holds (the store's row is the job) and decodes the others, another
/// producer's, then: one that is a valid job is stored and handed out
/// beside the pushed one, one that is not goes to the dead letters with
/// its reason and is never stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_producers_binary_envelopes_are_stored_when_valid_and_dead_lettered_when_not() {
    let s = service(|_| {}).await;
    let pushed = s
        .push(json!({"type": "a.b", "args": [1], "options": {"queue": "q"}}))
        .await
        .unwrap();
    let mut valid = ojs_core::JobEnvelope::new("c.d", vec![json!(2)]);
    valid.queue = "q".into();
    let mut invalid = ojs_core::JobEnvelope::new("e.f", vec![json!(3)]);
    invalid.queue = "q".into();
    // A second `specversion` on the wire, which decoding keeps: not 1.0.
    let mut invalid_bytes = invalid.to_proto_bytes().unwrap();
    invalid_bytes.extend_from_slice(&[0x0a, 3, b'9', b'.', b'9']);
    let proto = ojs_core::envelope::media::OJS_PROTO;
    s.broker
        .publish(
            "q",
            vec![
                ojs_queue::OutgoingMessage::new(invalid_bytes, proto),
                ojs_queue::OutgoingMessage::new(valid.to_proto_bytes().unwrap(), proto),
            ],
        )
        .await
        .unwrap();
    let mut got: Vec<String> = s
        .fetch("q", WAIT)
        .await
        .into_iter()
        .map(|j| j.envelope.id)
        .collect();
    got.sort();
    let mut expected = vec![pushed.envelope.id.clone(), valid.id.clone()];
    expected.sort();
    assert_eq!(got, expected);
    let stored = s.info(&valid.id).await.unwrap();
    assert_eq!(stored.envelope.args, vec![json!(2)]);
    assert_eq!(stored.state(), JobState::Active);
    let never = s.info(&invalid.id).await.unwrap_err();
    assert_eq!(never.code(), ErrorCode::NotFound, "{never:?}");
    // The invalid one is in the queue's dead letters, with why.
    let mut dead = s
        .broker
        .consumer(
            "q",
            ojs_queue::ConsumerOptions {
                source: ojs_queue::Source::DeadLetters,
                ..ojs_queue::ConsumerOptions::default()
            },
        )
        .await
        .unwrap();
    let letters = dead.receive(10, WAIT).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(
        ojs_core::JobEnvelope::proto_id(&letters[0].payload),
        Some(invalid.id.as_str())
    );
    let reason = letters[0].dead_letter_reason().unwrap();
    assert_eq!(reason.error_type, "invalid_envelope", "{reason:?}");
    assert_eq!(s.broker.depth("q").await.unwrap(), Some(0));
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

impl Service {
    async fn register_cron(&self, body: Value) -> Result<ojs_api::model::cron::CronJob, ApiError> {
        let grant = self.api.tokens().identify(None)?;
        Ok(self.api.register_cron(&grant, body).await?.0)
    }

    async fn cron(&self, name: &str) -> ojs_api::model::cron::CronJob {
        let grant = self.api.tokens().identify(None).unwrap();
        self.api.cron(&grant, name).await.unwrap()
    }

    /// Moves the service's clock to `at`.
    fn move_to(&self, at: DateTime<Utc>) {
        let by = (at - self.clock.now()).to_std().unwrap();
        self.clock.advance(by);
    }
}

/// The first whole minute after `t`.
fn next_minute(t: DateTime<Utc>) -> DateTime<Utc> {
    let m = t.timestamp() / 60 + 1;
    DateTime::from_timestamp(m * 60, 0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_fires_each_slot_once_on_the_service_clock() {
    let s = service(|_| {}).await;
    let cron = s
        .register_cron(json!({"name": "every-minute", "expression": "* * * * *",
            "job_template": {"type": "cron.tick", "args": [1], "options": {"queue": "ticks"}}}))
        .await
        .unwrap();
    let first = next_minute(s.start);
    assert_eq!(cron.next_run_at, Some(first));
    assert!(s
        .fetch("ticks", Duration::from_millis(1200))
        .await
        .is_empty());
    s.move_to(first + chrono::Duration::seconds(1));
    let jobs = s.fetch("ticks", WAIT).await;
    assert_eq!(jobs.len(), 1, "one job for the slot");
    let job = &jobs[0];
    assert_eq!(job.envelope.id, cron.fire_id(first));
    assert_eq!(job.envelope.job_type, "cron.tick");
    assert_eq!(job.envelope.meta["cron_name"], "every-minute");
    assert_eq!(
        job.envelope.meta["cron_triggered_at"],
        ojs_api::job::timestamp(first)
    );
    // The fired job runs under the long default, not the binding's 30 s.
    assert_eq!(
        job.envelope.unknown_attributes.get("visibility_timeout_ms"),
        Some(&json!(1_800_000))
    );
    s.ack(&job.envelope.id).await.unwrap();
    // Several passes of the loop over the same slot made one job.
    assert!(s
        .fetch("ticks", Duration::from_millis(1500))
        .await
        .is_empty());
    let after = s.cron("every-minute").await;
    assert_eq!(after.run_count, 1);
    assert_eq!(after.last_job_id.as_deref(), Some(job.envelope.id.as_str()));
    assert_eq!(
        after.next_run_at,
        Some(first + chrono::Duration::minutes(1))
    );
    s.move_to(first + chrono::Duration::seconds(61));
    let second = s.fetch("ticks", WAIT).await;
    assert_eq!(second.len(), 1);
    assert_eq!(
        second[0].envelope.id,
        cron.fire_id(first + chrono::Duration::minutes(1))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_skip_holds_slots_while_the_last_job_has_not_finished() {
    let s = service(|_| {}).await;
    s.register_cron(
        json!({"name": "long", "cron": "* * * * *", "type": "cron.long", "queue": "long"}),
    )
    .await
    .unwrap();
    let first = next_minute(s.start);
    s.move_to(first + chrono::Duration::seconds(1));
    let jobs = s.fetch("long", WAIT).await;
    assert_eq!(jobs.len(), 1);
    // Two slots pass while the job runs: skipped, and the job is not
    // handed out again (its visibility is the long default).
    for minute in 1..=2 {
        s.move_to(first + chrono::Duration::minutes(minute) + chrono::Duration::seconds(1));
        assert!(s
            .fetch("long", Duration::from_millis(1500))
            .await
            .is_empty());
    }
    let held = s.cron("long").await;
    assert_eq!((held.run_count, held.skip_count), (1, 2));
    s.ack(&jobs[0].envelope.id).await.unwrap();
    s.move_to(first + chrono::Duration::minutes(3) + chrono::Duration::seconds(1));
    assert_eq!(
        s.fetch("long", WAIT).await.len(),
        1,
        "fires again once the last job finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_previous_cancels_the_running_job_and_fires() {
    let s = service(|_| {}).await;
    s.register_cron(
        json!({"name": "fresh", "cron": "* * * * *", "type": "cron.fresh",
        "queue": "fresh", "overlap_policy": "cancel_previous"}),
    )
    .await
    .unwrap();
    let first = next_minute(s.start);
    s.move_to(first + chrono::Duration::seconds(1));
    let old = s.fetch("fresh", WAIT).await.remove(0);
    s.move_to(first + chrono::Duration::seconds(61));
    let new = s.fetch("fresh", WAIT).await;
    assert_eq!(new.len(), 1);
    assert_ne!(new[0].envelope.id, old.envelope.id);
    assert_eq!(
        s.info(&old.envelope.id).await.unwrap().state(),
        JobState::Cancelled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_stall_a_cron_catches_up_once_then_keeps_its_schedule() {
    let s = service(|_| {}).await;
    s.register_cron(
        json!({"name": "stalled", "cron": "* * * * *", "type": "cron.s",
        "queue": "stalled", "overlap_policy": "allow"}),
    )
    .await
    .unwrap();
    let first = next_minute(s.start);
    // Ten slots pass at once.
    s.move_to(first + chrono::Duration::minutes(9) + chrono::Duration::seconds(30));
    let jobs = s.fetch("stalled", WAIT).await;
    assert_eq!(jobs.len(), 1, "one catch-up, not a burst");
    assert_eq!(
        jobs[0].envelope.meta["cron_triggered_at"],
        ojs_api::job::timestamp(first)
    );
    assert!(s
        .fetch("stalled", Duration::from_millis(1500))
        .await
        .is_empty());
    let cron = s.cron("stalled").await;
    assert_eq!(
        cron.next_run_at,
        Some(first + chrono::Duration::minutes(10))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_or_deleted_cron_fires_nothing_and_its_jobs_stay() {
    let s = service(|_| {}).await;
    let grant = s.api.tokens().identify(None).unwrap();
    s.register_cron(
        json!({"name": "off", "cron": "* * * * *", "type": "cron.off", "queue": "off"}),
    )
    .await
    .unwrap();
    let off = s.api.set_cron_enabled(&grant, "off", false).await.unwrap();
    assert_eq!(off.next_run_at, None);
    let first = next_minute(s.start);
    s.move_to(first + chrono::Duration::seconds(1));
    assert!(s.fetch("off", Duration::from_millis(1500)).await.is_empty());
    // Enabled again: from its next slot after now, no catch-up.
    let on = s.api.set_cron_enabled(&grant, "off", true).await.unwrap();
    assert_eq!(on.next_run_at, Some(first + chrono::Duration::minutes(1)));
    s.move_to(first + chrono::Duration::seconds(61));
    let fired = s.fetch("off", WAIT).await;
    assert_eq!(fired.len(), 1);
    s.api.delete_cron(&grant, "off").await.unwrap();
    s.move_to(first + chrono::Duration::seconds(121));
    assert!(s.fetch("off", Duration::from_millis(1500)).await.is_empty());
    // The job it pushed stays.
    assert_eq!(
        s.info(&fired[0].envelope.id).await.unwrap().state(),
        JobState::Active
    );
    let gone = s.api.cron(&grant, "off").await.unwrap_err();
    assert_eq!(gone.code(), ErrorCode::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_is_checked_as_its_push_would_be_and_bounded() {
    let s = service(|settings| settings.max_crons = 2).await;
    let refused = |e: ApiError| match e {
        ApiError::InvalidRequest { attribute, .. } => attribute.unwrap_or_default(),
        other => panic!("{other:?}"),
    };
    let e = s
        .register_cron(json!({"name": "a", "cron": "0 0 * * *", "type": "t.a",
            "options": {"priority": 1000}}))
        .await
        .unwrap_err();
    assert_eq!(refused(e), "job_template.options.priority");
    let e = s
        .register_cron(json!({"name": "a", "cron": "0 0 * * *", "type": "t.a", "timezone": "EST"}))
        .await
        .unwrap_err();
    assert_eq!(refused(e), "timezone");
    s.register_cron(json!({"name": "a", "cron": "0 0 * * *", "type": "t.a"}))
        .await
        .unwrap();
    s.register_cron(json!({"name": "b", "cron": "0 0 * * *", "type": "t.b"}))
        .await
        .unwrap();
    // Registering a name again replaces it (and is not a new one).
    let grant = s.api.tokens().identify(None).unwrap();
    let (again, new) = s
        .api
        .register_cron(
            &grant,
            json!({"name": "a", "cron": "30 0 * * *", "type": "t.a"}),
        )
        .await
        .unwrap();
    assert!(!new);
    assert_eq!(again.expression, "30 0 * * *");
    let e = s
        .register_cron(json!({"name": "c", "cron": "0 0 * * *", "type": "t.c"}))
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Conflict);
    assert!(matches!(e, ApiError::CronLimit { limit: 2 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_queue_takes_pushes_and_hands_out_nothing_until_resumed() {
    let s = service(|_| {}).await;
    let grant = s.api.tokens().identify(None).unwrap();
    let paused = s.api.pause_queue(&grant, "held").await.unwrap();
    assert!(paused.paused);
    let job = s
        .push(json!({"type": "a.b", "args": [], "options": {"queue": "held"}}))
        .await
        .unwrap();
    assert_eq!(job.state(), JobState::Available);
    assert!(s.fetch("held", Duration::from_millis(500)).await.is_empty());
    // Another queue of the same FETCH is served meanwhile.
    s.push(json!({"type": "a.b", "args": [], "options": {"queue": "open"}}))
        .await
        .unwrap();
    let other = s
        .api
        .fetch(
            &grant,
            Fetch {
                queues: vec!["held".into(), "open".into()],
                count: 10,
                worker_id: None,
                visibility: None,
                wait: WAIT,
            },
        )
        .await
        .unwrap();
    assert_eq!(other.len(), 1);
    assert_eq!(other[0].envelope.queue, "open");
    let listed = s.api.queues(&grant).await.unwrap();
    assert!(listed.iter().any(|q| q.name == "held" && q.paused));
    assert!(listed.iter().any(|q| q.name == "open" && !q.paused));
    s.api.resume_queue(&grant, "held").await.unwrap();
    let fetched = s.fetch("held", WAIT).await;
    assert_eq!(fetched.len(), 1);
    assert_eq!(fetched[0].envelope.id, job.envelope.id);
    // Pausing a queue never seen makes it known; a bad name is refused.
    s.api.pause_queue(&grant, "fresh").await.unwrap();
    assert!(s
        .api
        .queues(&grant)
        .await
        .unwrap()
        .iter()
        .any(|q| q.name == "fresh" && q.paused));
    let e = s.api.pause_queue(&grant, "").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_stats_count_jobs_by_state_and_time_the_last_hour() {
    let s = service(|_| {}).await;
    let grant = s.api.tokens().identify(None).unwrap();
    for i in 0..3 {
        s.push(json!({"type": "a.b", "args": [i], "options": {"queue": "counted"}}))
            .await
            .unwrap();
    }
    let stats = s.api.queue_stats(&grant, "counted").await.unwrap();
    assert_eq!(stats.by_state["available"], 3);
    assert_eq!(stats.by_state["active"], 0);
    assert_eq!(stats.by_state["completed"], 0);
    assert_eq!(stats.avg_duration_ms, None);
    // The in-memory broker counts what it holds.
    assert_eq!(stats.broker_depth, Some(3));
    let fetched = s.fetch("counted", WAIT).await;
    assert_eq!(fetched.len(), 3);
    s.clock.advance(Duration::from_millis(1500));
    s.ack(&fetched[0].envelope.id).await.unwrap();
    s.nack(
        &fetched[1].envelope.id,
        json!({"code": "x", "message": "m", "retryable": false}),
    )
    .await
    .unwrap();
    let stats = s.api.queue_stats(&grant, "counted").await.unwrap();
    assert_eq!(stats.by_state["active"], 1);
    assert_eq!(stats.by_state["completed"], 1);
    assert_eq!(stats.by_state["discarded"], 1);
    assert_eq!((stats.completed_last_hour, stats.failed_last_hour), (1, 1));
    assert_eq!(stats.avg_duration_ms, Some(1500.0));
    assert_eq!(stats.avg_wait_ms, Some(0.0));
    assert!(!stats.paused);
    // Past the hour, the rates count nothing; the states stay.
    s.clock.advance(Duration::from_secs(3601));
    let stats = s.api.queue_stats(&grant, "counted").await.unwrap();
    assert_eq!(stats.by_state["completed"], 1);
    assert_eq!((stats.completed_last_hour, stats.failed_last_hour), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_queue_starts_its_limit_per_window_on_the_service_clock() {
    let s = service(|_| {}).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let job = s
            .push(
                json!({"type": "a.b", "args": [i], "options": {"queue": "slow",
                "rate_limit": {"max_per_second": 1}}}),
            )
            .await
            .unwrap();
        assert_eq!(
            job.envelope.unknown_attributes["rate_limit"],
            json!({"rate": {"limit": 1, "period": "PT1S"}})
        );
        ids.push(job.envelope.id);
    }
    let first = s.fetch("slow", Duration::ZERO).await;
    assert_eq!(
        first.len(),
        1,
        "one start in the window, though 10 were asked"
    );
    assert!(s.fetch("slow", Duration::ZERO).await.is_empty());
    // Waiting within the window hands out nothing either.
    assert!(s.fetch("slow", Duration::from_millis(300)).await.is_empty());
    for id in ids.iter().filter(|id| **id != first[0].envelope.id) {
        let job = s.info(id).await.unwrap();
        assert_eq!(
            (job.state(), job.envelope.attempt),
            (JobState::Available, 0),
            "a look is no attempt"
        );
    }
    s.clock.advance(Duration::from_millis(1500));
    assert_eq!(s.fetch("slow", WAIT).await.len(), 1);
    s.clock.advance(Duration::from_millis(1000));
    assert_eq!(s.fetch("slow", WAIT).await.len(), 1);
    // A limit that cannot be followed is refused with the push.
    let read = |body: Value| ojs_api::job::from_json(body, s.api.now()).unwrap_err();
    let refused = read(
        json!({"type": "a.b", "args": [], "options": {"rate_limit": {"concurrency": 1, "on_limit": "later"}}}),
    );
    assert_eq!(refused.code(), ErrorCode::InvalidRequest);
    let refused = read(json!({"type": "a.b", "args": [], "rate_limit": {"max_per_second": 0}}));
    assert_eq!(refused.code(), ErrorCode::InvalidRequest);
}
