//! Federation over two real brokers: region `rmq` (RabbitMQ, local) and
//! region `embedded` (the embedded durable broker). RabbitMQ is taken away
//! mid-stream: affinity traffic moves to `embedded`, jobs geo-pinned to
//! `rmq` fail as temporarily unavailable, nothing is lost; when it is back
//! the breaker closes and traffic returns.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_bridge_tests::brokers::{bounce, bounce_command, find, unique_queue, Broker};
use ojs_bridge_tests::tally::Tally;
use ojs_bridge_tests::tempdir::TempDir;
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::federation::{
    AdapterProbe, BreakerState, Federation, FederationSettings, RegionSpec, META_REGION,
};
use ojs_queue::{ConsumerOptions, Error, OutgoingMessage, QueueAdapter};
use serde_json::json;

/// Awaits one step of the scenario no longer than `secs`: a step that hangs
/// fails the test with its name (and the steps before it are in the output).
async fn step<T>(what: &str, secs: u64, fut: impl std::future::Future<Output = T>) -> T {
    eprintln!("step: {what}");
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("step {what:?} did not finish in {secs} s"),
    }
}

async fn drain(adapter: &dyn QueueAdapter, queue: &str, into: &mut Vec<String>) {
    let mut c = adapter
        .consumer(queue, ConsumerOptions::default())
        .await
        .unwrap();
    loop {
        let batch = c.receive(500, Duration::from_millis(1500)).await.unwrap();
        if batch.is_empty() {
            break;
        }
        for d in batch {
            into.push(
                Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0]
                    .id
                    .clone(),
            );
            d.ack().await.unwrap();
        }
    }
    c.close().await.unwrap();
}

async fn publish(f: &Federation, queue: &str, pinned: bool) -> (String, ojs_queue::Result<()>) {
    let mut job = JobEnvelope::new("fed.item", vec![json!(1)]);
    if pinned {
        job.meta.insert(META_REGION.into(), json!("rmq"));
    }
    let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap();
    (job.id, f.publish(queue, vec![msg]).await)
}

fn breaker(f: &Federation, region: &str) -> BreakerState {
    f.snapshot()
        .into_iter()
        .find(|s| s.name == region)
        .unwrap()
        .breaker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_region_goes_away_and_comes_back() {
    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    let Some(command) = bounce_command(Broker::RabbitMq) else {
        return;
    };
    let dir = TempDir::new("federation");
    let queue = unique_queue("fed");
    let rabbit: Arc<dyn QueueAdapter> = Arc::new(
        RabbitAdapter::connect(RabbitConfig::new(&amqp.url))
            .await
            .unwrap(),
    );
    let embedded: Arc<dyn QueueAdapter> = Arc::new(
        LocalAdapter::open(LocalConfig::new(dir.path()))
            .await
            .unwrap(),
    );
    rabbit.depth(&queue).await.unwrap(); // declare the queue
    let mut settings = FederationSettings::new("rmq");
    settings.fallback = vec!["embedded".into()];
    settings.failure_threshold = 2;
    settings.cooldown = Duration::from_secs(1);
    settings.health_interval = Duration::from_millis(200);
    settings.health_timeout = Duration::from_secs(1);
    let federation = Arc::new(
        Federation::new(
            settings,
            vec![
                RegionSpec {
                    name: "rmq".into(),
                    adapter: rabbit.clone(),
                    probe: Arc::new(AdapterProbe(rabbit.clone())),
                },
                RegionSpec {
                    name: "embedded".into(),
                    adapter: embedded.clone(),
                    probe: Arc::new(AdapterProbe(embedded.clone())),
                },
            ],
        )
        .unwrap(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let monitor = tokio::spawn(federation.clone().run_monitor(async {
        let _ = stopped.await;
    }));

    let mut tally = Tally::new();
    let mut pinned_refused = 0;
    // Before: affinity lands in rmq.
    for _ in 0..20 {
        let (id, r) = step("publish before", 60, publish(&federation, &queue, false)).await;
        r.unwrap();
        tally.sent(id);
    }
    // RabbitMQ away for 6 s while jobs keep coming.
    let bouncer = bounce(&command, Some(6));
    let deadline = Instant::now() + Duration::from_secs(30);
    while breaker(&federation, "rmq") != BreakerState::Open {
        assert!(Instant::now() < deadline, "the rmq breaker never opened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..60 {
        let pinned = i % 10 == 0;
        let (id, r) = step(
            "publish while away",
            60,
            publish(&federation, &queue, pinned),
        )
        .await;
        match r {
            Ok(()) => tally.sent(id),
            Err(Error::Publish(f)) if pinned => {
                let e = &f.failed[0].error;
                assert!(
                    matches!(e, Error::RegionUnavailable { region, .. } if region == "rmq"),
                    "{e}"
                );
                pinned_refused += 1;
            }
            Err(e) => panic!("an affinity job must fail over, got {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        step("bounce", 300, bouncer).await.unwrap(),
        "bounce command failed"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while breaker(&federation, "rmq") != BreakerState::Closed {
        assert!(
            Instant::now() < deadline,
            "the rmq breaker never closed after RabbitMQ came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let routed_rmq = |f: &Federation| {
        f.snapshot()
            .into_iter()
            .find(|s| s.name == "rmq")
            .unwrap()
            .routed
    };
    let before = routed_rmq(&federation);
    for _ in 0..20 {
        let (id, r) = step("publish after", 60, publish(&federation, &queue, false)).await;
        r.unwrap();
        tally.sent(id);
    }
    assert_eq!(
        routed_rmq(&federation),
        before + 20,
        "traffic returned to rmq"
    );
    let _ = stop.send(());
    step("monitor stop", 30, monitor).await.unwrap();

    let mut in_rmq = Vec::new();
    let mut in_embedded = Vec::new();
    step("drain rmq", 180, drain(&*rabbit, &queue, &mut in_rmq)).await;
    step(
        "drain embedded",
        180,
        drain(&*embedded, &queue, &mut in_embedded),
    )
    .await;
    println!(
        "rmq {} embedded {} pinned refused {pinned_refused} failovers {}",
        in_rmq.len(),
        in_embedded.len(),
        federation.failovers()
    );
    for id in in_rmq.iter().chain(&in_embedded) {
        tally.received(id.clone());
    }
    tally.assert_none_lost("federation across a RabbitMQ outage");
    assert!(
        !in_embedded.is_empty(),
        "affinity traffic moved to the other region"
    );
    assert!(
        pinned_refused > 0,
        "jobs pinned to rmq were refused while it was down"
    );
    let distinct: BTreeSet<_> = in_embedded.iter().collect();
    assert_eq!(distinct.len(), in_embedded.len());
    step("close", 30, rabbit.close()).await.unwrap();
}
