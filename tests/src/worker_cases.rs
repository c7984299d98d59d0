//! The worker's outcome table, runnable on any adapter.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use ojs_core::{Encoding, JobEnvelope, RetryPolicy};
use ojs_grpcq as grpcq;
use ojs_grpcq::registry::{HandlerError, Registry};
use ojs_grpcq::worker::{Worker, WorkerConfig, WorkerStats};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter, Source};
use serde_json::json;
use tokio::time::Instant;

use crate::brokers::unique_queue;

fn call(topic: &str, action: &str, payload: &[u8]) -> OutgoingMessage {
    let msg = grpcq::Message {
        originator: "worker-test".into(),
        topic: topic.into(),
        action: action.into(),
        payload: payload.to_vec(),
        message_id: uuid::Uuid::new_v4().to_string(),
        timestamp_ms: chrono::Utc::now().timestamp_millis(),
        metadata: Default::default(),
    };
    ojs_grpcq::outgoing(&msg)
}

fn job(job_type: &str, queue: &str, retry: Option<RetryPolicy>) -> OutgoingMessage {
    let mut j = JobEnvelope::new(job_type, vec![json!("x")]).with_queue(queue);
    j.retry = retry;
    OutgoingMessage::from_envelope(&j, Encoding::OjsProto).expect("valid job")
}

async fn read_dead(
    adapter: &dyn QueueAdapter,
    queue: &str,
    group: &str,
    n: usize,
) -> Result<Vec<(String, String)>> {
    let options = ConsumerOptions {
        source: Source::DeadLetters,
        group: group.into(),
        ..ConsumerOptions::default()
    };
    let mut dlq = adapter.consumer(queue, options).await?;
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < n && Instant::now() < deadline {
        for d in dlq.receive(10, Duration::from_millis(500)).await? {
            let r = d
                .dead_letter_reason()
                .context("dead letter without reason")?;
            out.push((r.error_type, r.message));
            d.ack().await?;
        }
    }
    dlq.close().await?;
    Ok(out)
}

/// Every row of the outcome table: success → ack; handler error → retried,
/// then success; permanent error → dead letter with its type; exhausted →
/// dead letter; `discard` → gone; unknown route, unknown content type and
/// undecodable bodies → dead letter with the reason.
pub async fn outcome_table(adapter: Arc<dyn QueueAdapter>, group: &str) -> Result<()> {
    let queue = unique_queue("worker-table");
    let flaky = Arc::new(AtomicU32::new(0));
    let mut registry = Registry::new();
    registry.on_call("pay.Payments", "Charge", |_, _| async { Ok(()) })?;
    let f = flaky.clone();
    registry.on_call("pay.Payments", "Flaky", move |ctx, _| {
        f.fetch_add(1, Ordering::SeqCst);
        async move {
            if ctx.attempt < 2 {
                Err(HandlerError::new("Io", "try again"))
            } else {
                Ok(())
            }
        }
    })?;
    registry.on_job("mail.bad", |_, _| async {
        Err(HandlerError::permanent(
            "ValidationError",
            "no such address",
        ))
    })?;
    registry.on_job("mail.always", |_, _| async {
        Err(HandlerError::new("Io", "down"))
    })?;
    registry.on_job("mail.discard", |_, _| async {
        Err(HandlerError::new("Io", "down"))
    })?;

    let fast = |attempts: i32, exhaustion: &str| RetryPolicy {
        max_attempts: Some(attempts),
        initial_interval: "PT0.1S".into(),
        jitter: false,
        on_exhaustion: exhaustion.into(),
        ..RetryPolicy::default()
    };
    let mut raw = OutgoingMessage::new(
        b"\xff\x00garbage".to_vec(),
        ojs_core::envelope::media::GRPCQ_PROTO,
    );
    raw.key = Some("x".into());
    let batch = vec![
        call("pay.Payments", "Charge", b"\x08\x01"),
        call("pay.Payments", "Flaky", b""),
        call("pay.Payments", "Refund", b""), // unknown route
        job("mail.bad", &queue, None),
        job("mail.always", &queue, Some(fast(2, "dead_letter"))),
        job("mail.discard", &queue, Some(fast(1, "discard"))),
        job("mail.unregistered", &queue, None),
        OutgoingMessage::new(b"<xml/>".to_vec(), "application/xml"), // unknown content type
        raw,                                                         // undecodable grpcq body
    ];
    adapter.publish(&queue, batch).await?;

    let mut config = WorkerConfig::new(&queue);
    config.consumer.group = group.into();
    config.retry.initial_interval = Duration::from_millis(100);
    config.retry.jitter = false;
    let worker = Worker::new(adapter.clone(), registry, config);
    let stats: Arc<WorkerStats> = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    // 2 succeed (Charge, Flaky on attempt 2), 6 dead letters, 1 discarded.
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        let s = (&stats.succeeded, &stats.dead_lettered, &stats.discarded);
        if s.0.load(Ordering::SeqCst) >= 2
            && s.1.load(Ordering::SeqCst) >= 6
            && s.2.load(Ordering::SeqCst) >= 1
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    running.await??;
    ensure!(
        stats.succeeded.load(Ordering::SeqCst) == 2,
        "succeeded {}",
        stats.succeeded.load(Ordering::SeqCst)
    );
    ensure!(flaky.load(Ordering::SeqCst) == 2, "flaky handler ran twice");
    ensure!(stats.discarded.load(Ordering::SeqCst) == 1);
    ensure!(
        stats.retried.load(Ordering::SeqCst) == 2,
        "Flaky once, mail.always once: {}",
        stats.retried.load(Ordering::SeqCst)
    );

    let mut dead = read_dead(&*adapter, &queue, group, 6).await?;
    dead.sort();
    let types: Vec<&str> = dead.iter().map(|(t, _)| t.as_str()).collect();
    ensure!(
        types
            == [
                "Io",
                "ValidationError",
                "undecodable",
                "unknown_content_type",
                "unknown_route",
                "unknown_route"
            ],
        "dead-letter reasons: {dead:?}"
    );
    ensure!(
        dead.iter().any(|(_, m)| m.contains("pay.Payments/Refund")),
        "{dead:?}"
    );
    ensure!(
        dead.iter().any(|(_, m)| m.contains("mail.unregistered")),
        "{dead:?}"
    );
    println!("outcome table on {}: {dead:?}", adapter.kind());
    Ok(())
}
