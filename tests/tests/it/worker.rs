//! The grpcq runtime and OJS worker: outcome table on several adapters,
//! shutdown, panics, timeouts, retries with backoff, grpcq wire bodies,
//! middleware and the publishers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use futures::future::BoxFuture;
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_memory::{MemoryAdapter, MemoryConfig};
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_bridge_tests::tempdir::TempDir;
use ojs_bridge_tests::worker_cases::outcome_table;
use ojs_core::{Encoding, JobEnvelope};
use ojs_grpcq as grpcq;
use ojs_grpcq::publisher::{EnqueueMiddleware, EnqueueNext, GrpcqPublisher, JobClient};
use ojs_grpcq::registry::{HandlerError, HandlerResult, Registry};
use ojs_grpcq::worker::{MessageInfo, Middleware, Next, Worker, WorkerConfig};
use ojs_queue::{OutgoingMessage, QueueAdapter};
use serde_json::json;
use tokio::time::Instant;

fn memory() -> Arc<dyn QueueAdapter> {
    Arc::new(MemoryAdapter::new(MemoryConfig::default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_table_on_memory() {
    outcome_table(memory(), "g").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_table_on_the_embedded_broker() {
    let dir = TempDir::new("worker-local");
    let adapter = LocalAdapter::open(LocalConfig::new(dir.path()))
        .await
        .unwrap();
    outcome_table(Arc::new(adapter), "g").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_table_on_rabbitmq() {
    let Some(e) = find(Broker::RabbitMq).await else {
        return;
    };
    let adapter = RabbitAdapter::connect(RabbitConfig::new(e.url))
        .await
        .unwrap();
    outcome_table(Arc::new(adapter), "g").await.unwrap();
}

fn calls(n: usize, action: &str) -> Vec<OutgoingMessage> {
    (0..n)
        .map(|i| {
            ojs_grpcq::outgoing(&grpcq::Message {
                topic: "t.Svc".into(),
                action: action.into(),
                payload: vec![i as u8],
                message_id: format!("m-{i}"),
                timestamp_ms: 1,
                ..Default::default()
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_50_in_flight_handlers_finish_and_starts_none_after() {
    let adapter = memory();
    adapter.publish("q", calls(60, "Slow")).await.unwrap();
    let (started, finished) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let mut registry = Registry::new();
    let (s, f) = (started.clone(), finished.clone());
    registry
        .on_call("t.Svc", "Slow", move |_, _| {
            s.fetch_add(1, Ordering::SeqCst);
            let f = f.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                f.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .unwrap();
    let mut config = WorkerConfig::new("q");
    config.concurrency = 50;
    config.batch_size = 50;
    config.shutdown_timeout = Duration::from_secs(10);
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    while started.load(Ordering::SeqCst) < 50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let signalled = Instant::now();
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    let took = signalled.elapsed();
    assert_eq!(
        started.load(Ordering::SeqCst),
        50,
        "none started after the signal"
    );
    assert_eq!(
        finished.load(Ordering::SeqCst),
        50,
        "every in-flight handler finished"
    );
    assert_eq!(stats.succeeded.load(Ordering::SeqCst), 50, "and was acked");
    assert_eq!(
        adapter.depth("q").await.unwrap(),
        Some(10),
        "the 10 never started are still queued"
    );
    assert!(
        took < Duration::from_secs(10),
        "returned within the shutdown bound ({took:?})"
    );
    println!("drained 50 in-flight handlers in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_timeout_cancels_stragglers_and_their_messages_come_back() {
    let adapter = memory();
    adapter.publish("q", calls(1, "Hang")).await.unwrap();
    let mut registry = Registry::new();
    registry
        .on_call("t.Svc", "Hang", |_, _| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        })
        .unwrap();
    let mut config = WorkerConfig::new("q");
    config.shutdown_timeout = Duration::from_millis(300);
    config.handler_timeout = Duration::from_secs(3600);
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    let running = tokio::spawn(worker.run(tokio::time::sleep(Duration::from_millis(300))));
    running.await.unwrap().unwrap();
    assert_eq!(stats.started.load(Ordering::SeqCst), 1);
    assert_eq!(
        adapter.depth("q").await.unwrap(),
        Some(1),
        "unsettled message is back in the queue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_fails_only_its_message() {
    let adapter = memory();
    adapter.publish("q", calls(1, "Panic")).await.unwrap();
    adapter.publish("q", calls(5, "Ok")).await.unwrap();
    let mut registry = Registry::new();
    registry
        .on_call("t.Svc", "Panic", |ctx, _| async move {
            if ctx.attempt == 1 {
                panic!("boom on attempt 1");
            }
            Ok(())
        })
        .unwrap();
    registry
        .on_call("t.Svc", "Ok", |_, _| async { Ok(()) })
        .unwrap();
    let mut config = WorkerConfig::new("q");
    config.retry.initial_interval = Duration::from_millis(50);
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(30))));
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats.succeeded.load(Ordering::SeqCst) < 6 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stats.panics.load(Ordering::SeqCst), 1);
    assert_eq!(
        stats.retried.load(Ordering::SeqCst),
        1,
        "the panic nacked its message for a retry"
    );
    assert_eq!(
        stats.succeeded.load(Ordering::SeqCst),
        6,
        "the worker went on: 5 others and the retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_times_out_is_retried() {
    let adapter = memory();
    adapter.publish("q", calls(1, "Slow")).await.unwrap();
    let mut registry = Registry::new();
    registry
        .on_call("t.Svc", "Slow", |ctx, _| async move {
            if ctx.attempt == 1 {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            Ok(())
        })
        .unwrap();
    let mut config = WorkerConfig::new("q");
    config.handler_timeout = Duration::from_millis(200);
    config.retry.initial_interval = Duration::from_millis(50);
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(30))));
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats.succeeded.load(Ordering::SeqCst) < 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stats.timeouts.load(Ordering::SeqCst), 1);
    assert_eq!(stats.retried.load(Ordering::SeqCst), 1);
    assert_eq!(stats.succeeded.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn fails_twice_then_succeeds_with_backoff_respected() {
    let adapter = memory();
    adapter.publish("q", calls(1, "Flaky")).await.unwrap();
    let attempts: Arc<Mutex<Vec<(u32, Instant)>>> = Arc::default();
    let mut registry = Registry::new();
    let a = attempts.clone();
    registry
        .on_call("t.Svc", "Flaky", move |ctx, _| {
            a.lock().unwrap().push((ctx.attempt, Instant::now()));
            async move {
                if ctx.attempt < 3 {
                    Err(HandlerError::new("Io", "flaky"))
                } else {
                    Ok(())
                }
            }
        })
        .unwrap();
    let mut config = WorkerConfig::new("q");
    config.retry.jitter = false; // exact delays: 1 s, then 2 s
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(60))));
    // Paused time: the deadline is virtual and auto-advances while idle.
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.succeeded.load(Ordering::SeqCst) < 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = attempts.lock().unwrap().clone();
    let numbers: Vec<u32> = seen.iter().map(|(n, _)| *n).collect();
    assert_eq!(numbers, [1, 2, 3], "attempts counted");
    let gap1 = seen[1].1 - seen[0].1;
    let gap2 = seen[2].1 - seen[1].1;
    assert!(gap1 >= Duration::from_secs(1), "first backoff {gap1:?}");
    assert!(gap2 >= Duration::from_secs(2), "second backoff {gap2:?}");
    assert_eq!(stats.retried.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcq_sqs_style_bodies_are_handled() {
    // grpcq's own SQS adapter: base64 of the Message as the body, String
    // attributes topic/action/originator, no content type; legacy
    // publishers sent the raw bytes.
    let adapter = memory();
    let msg = grpcq::Message {
        originator: "legacy-go".into(),
        topic: "pay.Payments".into(),
        action: "Charge".into(),
        payload: vec![8, 42],
        message_id: "550e8400-e29b-41d4-a716-446655440000".into(),
        timestamp_ms: 1_704_067_200_000,
        metadata: [("trace_id".to_string(), "t".to_string())].into(),
    };
    let raw = grpcq::encode(&msg);
    let b64 = base64::engine::general_purpose::STANDARD.encode(&raw);
    let mut sqs_style = OutgoingMessage::new(b64.into_bytes(), "x");
    sqs_style.headers.clear();
    for (k, v) in [
        ("topic", "pay.Payments"),
        ("action", "Charge"),
        ("originator", "legacy-go"),
    ] {
        sqs_style.headers.insert(k, v);
    }
    let mut legacy = OutgoingMessage::new(raw, "x");
    legacy.headers.clear();
    adapter
        .publish("calls", vec![sqs_style, legacy])
        .await
        .unwrap();

    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let s = seen.clone();
    registry
        .on_call("pay.Payments", "Charge", move |ctx, payload| {
            s.lock().unwrap().push((
                ctx.message_id.clone(),
                ctx.originator.clone(),
                payload.to_vec(),
                ctx.metadata.clone(),
            ));
            async { Ok(()) }
        })
        .unwrap();
    let mut config = WorkerConfig::new("calls");
    config.default_encoding = Some(Encoding::GrpcqProto);
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(30))));
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.succeeded.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "base64 and raw bodies both handled");
    for (id, originator, payload, metadata) in seen {
        assert_eq!(id, msg.message_id);
        assert_eq!(originator, "legacy-go");
        assert_eq!(payload, vec![8, 42]);
        assert_eq!(metadata.get("trace_id").map(String::as_str), Some("t"));
    }
}

struct Recorder(Arc<Mutex<Vec<String>>>);

impl Middleware for Recorder {
    fn handle(&self, info: Arc<MessageInfo>, next: Next) -> BoxFuture<'static, HandlerResult> {
        let log = self.0.clone();
        Box::pin(async move {
            log.lock()
                .unwrap()
                .push(format!("before {} {}", info.kind, info.route));
            let r = next().await;
            log.lock().unwrap().push(format!("after {}", r.is_ok()));
            r
        })
    }
}

struct Traceparent;

impl EnqueueMiddleware for Traceparent {
    fn handle(
        &self,
        mut job: JobEnvelope,
        next: EnqueueNext,
    ) -> BoxFuture<'static, ojs_queue::Result<JobEnvelope>> {
        job.meta.insert(
            "traceparent".into(),
            json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        next(job)
    }
}

struct RejectTests;

impl EnqueueMiddleware for RejectTests {
    fn handle(
        &self,
        job: JobEnvelope,
        next: EnqueueNext,
    ) -> BoxFuture<'static, ojs_queue::Result<JobEnvelope>> {
        if job.job_type.starts_with("test.") {
            return Box::pin(async {
                Err(ojs_queue::Error::InvalidConfig {
                    field: "type".into(),
                    reason: "test jobs are not enqueued".into(),
                })
            });
        }
        next(job)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn middleware_on_both_sides_and_typed_requests() {
    let adapter = memory();
    let client = JobClient::new(adapter.clone())
        .with_middleware(Arc::new(Traceparent))
        .with_middleware(Arc::new(RejectTests));
    let job = client
        .enqueue(JobEnvelope::new("email.send", vec![json!("a@b.c")]).with_queue("jobs"))
        .await
        .unwrap();
    assert!(job.enqueued_at.is_some());
    assert_eq!(job.state, Some(ojs_core::JobState::Available));
    assert!(client
        .enqueue(JobEnvelope::new("test.skip", vec![]).with_queue("jobs"))
        .await
        .is_err());
    assert_eq!(
        adapter.depth("jobs").await.unwrap(),
        Some(1),
        "the rejected job was not published"
    );

    // Typed grpcq request through the publisher; a payload that is not the
    // request type is a permanent failure.
    let publisher = GrpcqPublisher::new(adapter.clone(), "jobs", "svc-a");
    let request = prost_types::Timestamp {
        seconds: 42,
        nanos: 0,
    };
    publisher
        .publish("clock.Clock", "Set", &request, Default::default())
        .await
        .unwrap();

    let log = Arc::new(Mutex::new(Vec::new()));
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let g = got.clone();
    registry
        .on_job("email.send", move |job, _| {
            g.lock()
                .unwrap()
                .push(job.meta_str("traceparent").map(str::to_owned));
            async { Ok(()) }
        })
        .unwrap();
    let g = got.clone();
    registry
        .on_request(
            "clock.Clock",
            "Set",
            move |_, req: prost_types::Timestamp| {
                g.lock().unwrap().push(Some(req.seconds.to_string()));
                async { Ok(()) }
            },
        )
        .unwrap();
    let worker = Worker::new(adapter.clone(), registry, WorkerConfig::new("jobs"))
        .with_middleware(Arc::new(Recorder(log.clone())));
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(30))));
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.succeeded.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = got.lock().unwrap().clone();
    assert!(
        got.contains(&Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()
        )),
        "{got:?}"
    );
    assert!(
        got.contains(&Some("42".into())),
        "typed request decoded: {got:?}"
    );
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains(&"before job email.send".to_string())
            && log.contains(&"before call clock.Clock/Set".to_string()),
        "{log:?}"
    );
    assert_eq!(log.iter().filter(|l| *l == "after true").count(), 2);

    // Oversized calls fail before sending.
    let small = Arc::new(MemoryAdapter::new(MemoryConfig {
        max_message_bytes: 64,
    }));
    let p = GrpcqPublisher::new(small.clone(), "q", "svc");
    let big = prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue("x".repeat(100))),
    };
    let err = p
        .publish("a.B", "C", &big, Default::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ojs_queue::Error::PayloadTooLarge { .. }),
        "{err}"
    );
    assert_eq!(small.depth("q").await.unwrap(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_errors_do_not_kill_the_worker() {
    // Every attempt to open a consumer fails (the adapter is closed): the
    // worker keeps retrying with backoff and still returns cleanly on
    // shutdown.
    let adapter = memory();
    adapter.close().await.unwrap();
    let worker = Worker::new(
        adapter,
        Registry::new(),
        WorkerConfig::new(unique_queue("w")),
    );
    let stats = worker.stats();
    let out = worker
        .run(tokio::time::sleep(Duration::from_millis(2500)))
        .await;
    assert!(out.is_ok(), "the worker returned normally");
    let errors = stats.consume_errors.load(Ordering::SeqCst);
    assert!(errors >= 2, "retried with backoff, not once: {errors}");
    assert!(errors < 10, "backoff, not a busy loop: {errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_jobs_published_by_a_handler_continue_its_trace() {
    use ojs_grpcq::trace::TraceContext;
    let adapter = memory();
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut call = grpcq::Message {
        originator: "o".into(),
        topic: "t.Svc".into(),
        action: "Fan".into(),
        payload: vec![],
        message_id: "m-1".into(),
        timestamp_ms: 1,
        metadata: Default::default(),
    };
    call.metadata.insert("traceparent".into(), incoming.into());
    adapter
        .publish("q", vec![ojs_grpcq::outgoing(&call)])
        .await
        .unwrap();
    // One call without trace context: nothing is invented for it.
    let mut bare = call.clone();
    bare.metadata.clear();
    bare.message_id = "m-2".into();
    adapter
        .publish("q", vec![ojs_grpcq::outgoing(&bare)])
        .await
        .unwrap();

    let mut registry = Registry::new();
    let (publisher, jobs) = (
        GrpcqPublisher::new(adapter.clone(), "next", "fan-out"),
        JobClient::new(adapter.clone()),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    registry
        .on_call("t.Svc", "Fan", move |ctx, _| {
            let (publisher, jobs, seen) = (publisher.clone(), jobs.clone(), seen2.clone());
            async move {
                seen.lock()
                    .unwrap()
                    .push((ctx.message_id.clone(), TraceContext::current()));
                publisher
                    .publish(
                        "t.Next",
                        "Go",
                        &prost_types::Duration::default(),
                        Default::default(),
                    )
                    .await
                    .map_err(|e| HandlerError::new("publish", e.to_string()))?;
                jobs.enqueue(JobEnvelope::new("next.job", vec![]).with_queue("next-jobs"))
                    .await
                    .map_err(|e| HandlerError::new("enqueue", e.to_string()))?;
                Ok(())
            }
        })
        .unwrap();
    let worker = Worker::new(adapter.clone(), registry, WorkerConfig::new("q"));
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.succeeded.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();

    let seen = seen.lock().unwrap().clone();
    let handler = seen
        .iter()
        .find(|(id, _)| id == "m-1")
        .unwrap()
        .1
        .expect("a current context");
    let parent = TraceContext::parse(incoming).unwrap();
    assert_eq!(handler.trace_id, parent.trace_id, "same trace");
    assert_ne!(
        handler.span_id, parent.span_id,
        "the handler is a child span"
    );
    assert_eq!(seen.iter().find(|(id, _)| id == "m-2").unwrap().1, None);

    let mut next = adapter.consumer("next", Default::default()).await.unwrap();
    let mut traced = Vec::new();
    for d in next.receive(10, Duration::from_secs(1)).await.unwrap() {
        traced.push(
            grpcq::decode(&d.payload)
                .unwrap()
                .metadata
                .get("traceparent")
                .cloned(),
        );
    }
    let mut next_jobs = adapter
        .consumer("next-jobs", Default::default())
        .await
        .unwrap();
    for d in next_jobs.receive(10, Duration::from_secs(1)).await.unwrap() {
        let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
        assert_eq!(
            d.headers.get_str("traceparent"),
            job.meta_str("traceparent")
        );
        traced.push(job.meta_str("traceparent").map(str::to_owned));
    }
    // Two calls and two jobs; the traced pair names the handler as parent.
    assert_eq!(traced.len(), 4);
    let with: Vec<_> = traced.iter().flatten().collect();
    assert_eq!(
        with.len(),
        2,
        "only the traced call's work carries trace context: {traced:?}"
    );
    for tp in with {
        assert_eq!(tp, &handler.traceparent());
    }
}
