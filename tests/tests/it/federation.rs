//! Federation routing, breakers, meta, replication and conflict resolution,
//! deterministic under paused time. Regions are in-memory brokers; a region
//! "goes down" through [`Switch`], which refuses publishes and health as a
//! broker that went away does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_memory::MemoryAdapter;
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::federation::{
    resolve_conflict, Admission, BreakerState, CircuitBreaker, Federation, FederationSettings,
    HealthProbe, RegionSpec, Strategy, META_FEDERATION_ID, META_REGION, META_REGION_AFFINITY,
    META_REPLICATED_FROM,
};
use ojs_queue::{
    Consumer, ConsumerOptions, Error, Health, OutgoingMessage, PublishFailure, QueueAdapter,
};
use serde_json::json;

/// An in-memory region that can be switched off.
#[derive(Debug)]
struct Switch {
    inner: MemoryAdapter,
    down: AtomicBool,
    /// Time a publish takes (a slow region).
    publish_delay_ms: std::sync::atomic::AtomicU64,
}

impl Switch {
    fn new() -> Arc<Switch> {
        Arc::new(Switch {
            inner: MemoryAdapter::new(Default::default()),
            down: AtomicBool::new(false),
            publish_delay_ms: std::sync::atomic::AtomicU64::new(0),
        })
    }
    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

#[async_trait]
impl QueueAdapter for Switch {
    fn kind(&self) -> &'static str {
        "switch"
    }
    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> ojs_queue::Result<()> {
        let delay = self.publish_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::Publish(PublishFailure::all(messages, || {
                Error::broker("memory", "connection refused", true)
            })));
        }
        self.inner.publish(queue, messages).await
    }
    async fn consumer(
        &self,
        queue: &str,
        o: ConsumerOptions,
    ) -> ojs_queue::Result<Box<dyn Consumer>> {
        self.inner.consumer(queue, o).await
    }
    async fn health(&self) -> Health {
        if self.down.load(Ordering::SeqCst) {
            Health::down("switched off")
        } else {
            Health::ok("on")
        }
    }
    async fn depth(&self, queue: &str) -> ojs_queue::Result<Option<u64>> {
        self.inner.depth(queue).await
    }
    async fn close(&self) -> ojs_queue::Result<()> {
        Ok(())
    }
}

/// A probe that answers after a fixed delay (latency under paused time).
#[derive(Debug)]
struct SlowProbe {
    region: Arc<Switch>,
    delay: Duration,
}

#[async_trait]
impl HealthProbe for SlowProbe {
    async fn check(&self) -> Health {
        tokio::time::sleep(self.delay).await;
        self.region.health().await
    }
}

struct Fixture {
    federation: Arc<Federation>,
    regions: Vec<(String, Arc<Switch>)>,
}

impl Fixture {
    fn region(&self, name: &str) -> &Arc<Switch> {
        &self.regions.iter().find(|(n, _)| n == name).unwrap().1
    }
    async fn depth(&self, name: &str, queue: &str) -> u64 {
        self.region(name).depth(queue).await.unwrap().unwrap_or(0)
    }
    fn breaker(&self, name: &str) -> BreakerState {
        self.federation
            .snapshot()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap()
            .breaker
    }
}

/// Regions with probe delays (ms); local is the first.
fn fixture(regions: &[(&str, u64)], configure: impl FnOnce(&mut FederationSettings)) -> Fixture {
    let mut settings = FederationSettings::new(regions[0].0);
    settings.health_interval = Duration::from_secs(1);
    configure(&mut settings);
    let mut specs = Vec::new();
    let mut handles = Vec::new();
    for (name, delay) in regions {
        let region = Switch::new();
        specs.push(RegionSpec {
            name: (*name).into(),
            adapter: region.clone(),
            probe: Arc::new(SlowProbe {
                region: region.clone(),
                delay: Duration::from_millis(*delay),
            }),
        });
        handles.push(((*name).to_owned(), region));
    }
    Fixture {
        federation: Arc::new(Federation::new(settings, specs).unwrap()),
        regions: handles,
    }
}

fn job(meta: &[(&str, &str)]) -> OutgoingMessage {
    let mut j = JobEnvelope::new("report.build", vec![json!(1)]);
    for (k, v) in meta {
        j.meta.insert((*k).into(), json!(v));
    }
    OutgoingMessage::from_envelope(&j, Encoding::OjsProto).unwrap()
}

async fn open_breaker(f: &Fixture, name: &str) {
    f.region(name).set_down(true);
    for _ in 0..5 {
        f.federation.check_health().await;
    }
    assert_eq!(f.breaker(name), BreakerState::Open);
}

#[tokio::test(start_paused = true)]
async fn breaker_opens_after_5_failures_half_opens_after_30s_with_one_probe() {
    let b = CircuitBreaker::new(5, Duration::from_secs(30));
    for i in 0..4 {
        assert_eq!(b.admit(), Some(Admission::Normal), "failure {i}");
        b.record(Admission::Normal, false);
        assert_eq!(b.state(), BreakerState::Closed);
    }
    // A success resets the count.
    b.record(Admission::Normal, true);
    for _ in 0..4 {
        b.record(Admission::Normal, false);
    }
    assert_eq!(b.state(), BreakerState::Closed);
    assert_eq!(b.record(Admission::Normal, false), Some(BreakerState::Open));
    assert_eq!(b.admit(), None, "open refuses");
    tokio::time::advance(Duration::from_secs(29)).await;
    assert_eq!(b.admit(), None, "still cooling down");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(b.admit(), Some(Admission::Probe));
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert_eq!(b.admit(), None, "exactly one probe");
    assert!(!b.would_admit());
    // Probe fails: open again, a new cooldown.
    assert_eq!(b.record(Admission::Probe, false), Some(BreakerState::Open));
    tokio::time::advance(Duration::from_secs(29)).await;
    assert_eq!(b.admit(), None);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(b.admit(), Some(Admission::Probe));
    assert_eq!(b.record(Admission::Probe, true), Some(BreakerState::Closed));
    assert_eq!(b.admit(), Some(Admission::Normal));
    // A stale outcome of a request admitted earlier decides nothing.
    assert_eq!(b.record(Admission::Probe, false), None);
    assert_eq!(b.state(), BreakerState::Closed);
}

#[tokio::test(start_paused = true)]
async fn only_one_half_open_probe_reaches_a_recovering_region_under_concurrent_publishes() {
    let f = fixture(&[("us", 5), ("eu", 10)], |_| {});
    open_breaker(&f, "us").await;
    tokio::time::advance(Duration::from_secs(30)).await;
    f.region("us").set_down(false);
    // The probe takes 100 ms: every publish in the meantime finds us
    // half-open with its probe in flight.
    f.region("us").publish_delay_ms.store(100, Ordering::SeqCst);
    let publishes: Vec<_> = (0..20)
        .map(|_| {
            let fed = f.federation.clone();
            tokio::spawn(async move { fed.publish("q", vec![job(&[])]).await })
        })
        .collect();
    for p in publishes {
        p.await.unwrap().unwrap();
    }
    let us = f.depth("us", "q").await;
    let eu = f.depth("eu", "q").await;
    println!("us {us}, eu {eu}");
    assert_eq!(us + eu, 20, "nothing lost");
    assert_eq!(us, 1, "exactly one probe reached the half-open region");
    assert_eq!(
        f.breaker("us"),
        BreakerState::Closed,
        "probe success closes"
    );
    // Closed again: affinity traffic returns.
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(f.depth("us", "q").await, 2);
}

#[tokio::test(start_paused = true)]
async fn affinity_prefers_local_then_fallback_order_then_lowest_latency() {
    let f = fixture(&[("us", 50), ("eu", 40), ("ap", 5), ("sa", 20)], |s| {
        s.fallback = vec!["eu".into()];
    });
    f.federation.check_health().await; // latencies: ap 5 < sa 20
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(f.depth("us", "q").await, 1, "local while healthy");
    open_breaker(&f, "us").await;
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(
        f.depth("eu", "q").await,
        1,
        "then the fallback order, though slower than ap"
    );
    open_breaker(&f, "eu").await;
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(f.depth("ap", "q").await, 1, "then the lowest latency");
    let latency = |name: &str| {
        f.federation
            .snapshot()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap()
            .latency
            .unwrap()
    };
    assert!(latency("ap") < latency("sa"));
}

#[tokio::test(start_paused = true)]
async fn a_failing_region_fails_over_at_most_3_times_and_each_failover_is_counted() {
    let f = fixture(
        &[("r1", 1), ("r2", 2), ("r3", 3), ("r4", 4), ("r5", 5)],
        |_| {},
    );
    f.federation.check_health().await;
    for (_, r) in &f.regions {
        r.set_down(true);
    }
    let err = f.federation.publish("q", vec![job(&[])]).await.unwrap_err();
    let Error::Publish(failure) = err else {
        panic!("per-message failure expected")
    };
    assert_eq!(failure.failed.len(), 1, "the message is handed back");
    assert_eq!(f.federation.failovers(), 3, "1 + 3 redirects");
    let tried: u64 = f.federation.snapshot().iter().map(|s| s.failures).sum();
    assert_eq!(tried, 4);
    // r1 down, r2 up: one failover and the job lands.
    f.region("r2").set_down(false);
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(f.depth("r2", "q").await, 1);
    assert_eq!(f.federation.failovers(), 4);
}

#[tokio::test(start_paused = true)]
async fn overflow_picks_the_least_loaded_region() {
    let f = fixture(&[("us", 1), ("eu", 1), ("ap", 1)], |s| {
        s.default_strategy = Strategy::Overflow;
    });
    f.region("us")
        .publish("q", vec![job(&[]); 5])
        .await
        .unwrap();
    f.region("eu")
        .publish("q", vec![job(&[]); 1])
        .await
        .unwrap();
    f.region("ap")
        .publish("q", vec![job(&[]); 3])
        .await
        .unwrap();
    f.federation.publish("q", vec![job(&[])]).await.unwrap(); // registers the queue
    f.federation.collect_load().await;
    let before = (
        f.depth("us", "q").await,
        f.depth("eu", "q").await,
        f.depth("ap", "q").await,
    );
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    let after = (
        f.depth("us", "q").await,
        f.depth("eu", "q").await,
        f.depth("ap", "q").await,
    );
    assert_eq!(
        after.1,
        before.1 + 1,
        "eu had the fewest: {before:?} → {after:?}"
    );
    // Per job: region_affinity = overflow in meta under an affinity default.
    let g = fixture(&[("us", 1), ("eu", 1)], |_| {});
    g.region("us")
        .publish("q", vec![job(&[]); 4])
        .await
        .unwrap();
    g.federation.publish("q", vec![job(&[])]).await.unwrap(); // affinity: us
    g.federation.collect_load().await;
    g.federation
        .publish("q", vec![job(&[(META_REGION_AFFINITY, "overflow")])])
        .await
        .unwrap();
    assert_eq!(g.depth("eu", "q").await, 1);
}

#[tokio::test(start_paused = true)]
async fn geo_pin_goes_only_to_its_region_with_two_distinct_errors() {
    let f = fixture(&[("us", 1), ("eu", 1)], |_| {});
    f.federation
        .publish("q", vec![job(&[(META_REGION, "eu")])])
        .await
        .unwrap();
    assert_eq!(
        f.depth("eu", "q").await,
        1,
        "pinned to eu although us is local"
    );
    // `region` forces geo-pin whatever region_affinity says.
    f.federation
        .publish(
            "q",
            vec![job(&[
                (META_REGION, "eu"),
                (META_REGION_AFFINITY, "affinity"),
            ])],
        )
        .await
        .unwrap();
    assert_eq!(f.depth("eu", "q").await, 2);

    let unknown = f
        .federation
        .publish("q", vec![job(&[(META_REGION, "mars")])])
        .await;
    let Err(Error::Publish(failure)) = unknown else {
        panic!("{unknown:?}")
    };
    assert!(matches!(&failure.failed[0].error, Error::UnknownRegion(r) if r == "mars"));

    // Region down, breaker still closed: the publish fails, never rerouted.
    f.region("eu").set_down(true);
    let down = f
        .federation
        .publish("q", vec![job(&[(META_REGION, "eu")])])
        .await;
    let Err(Error::Publish(failure)) = down else {
        panic!("{down:?}")
    };
    assert!(
        matches!(&failure.failed[0].error, Error::RegionUnavailable { region, .. } if region == "eu")
    );
    assert_eq!(
        f.federation.failovers(),
        0,
        "geo-pinned jobs are never rerouted"
    );
    assert_eq!(f.depth("us", "q").await, 0);
    // Breaker open: refused at once, the same named error.
    open_breaker(&f, "eu").await;
    let open = f
        .federation
        .publish("q", vec![job(&[(META_REGION, "eu")])])
        .await;
    let Err(Error::Publish(failure)) = open else {
        panic!("{open:?}")
    };
    assert!(failure.failed[0]
        .error
        .to_string()
        .contains("temporarily unavailable"));
    assert!(
        failure.failed[0].error.is_retryable(),
        "unavailable is worth retrying; unknown is not"
    );
    assert!(!Error::UnknownRegion("x".into()).is_retryable());
}

#[tokio::test(start_paused = true)]
async fn federation_meta_is_added_and_other_messages_pass_untouched() {
    let f = fixture(&[("us", 1)], |_| {});
    let before = chrono::Utc::now().timestamp_millis();
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    let grpcq = OutgoingMessage::new(b"\x0a\x01x".to_vec(), "application/grpcq+proto");
    f.federation
        .publish("calls", vec![grpcq.clone()])
        .await
        .unwrap();
    let mut c = f
        .region("us")
        .consumer("q", ConsumerOptions::default())
        .await
        .unwrap();
    let d = c
        .receive(1, Duration::from_secs(1))
        .await
        .unwrap()
        .remove(0);
    let j = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
    let fid = uuid::Uuid::parse_str(j.meta_str(META_FEDERATION_ID).unwrap()).unwrap();
    assert_eq!(fid.get_version_num(), 7);
    let (secs, nanos) = fid.get_timestamp().unwrap().to_unix();
    let ms = (secs * 1000 + u64::from(nanos) / 1_000_000) as i64;
    assert!(
        (before - 5..=chrono::Utc::now().timestamp_millis() + 5).contains(&ms),
        "timestamp = enqueue time"
    );
    assert!(j.enqueued_at.is_some());
    let mut c = f
        .region("us")
        .consumer("calls", ConsumerOptions::default())
        .await
        .unwrap();
    let d = c
        .receive(1, Duration::from_secs(1))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        d.payload, grpcq.payload,
        "no federation meta on non-envelopes"
    );
    // A job that already has a federation id keeps it.
    let fixed = "01912e4a-7b3c-7def-8a12-abcdef123456";
    f.federation
        .publish("q2", vec![job(&[(META_FEDERATION_ID, fixed)])])
        .await
        .unwrap();
    let mut c = f
        .region("us")
        .consumer("q2", ConsumerOptions::default())
        .await
        .unwrap();
    let d = c
        .receive(1, Duration::from_secs(1))
        .await
        .unwrap()
        .remove(0);
    let j = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
    assert_eq!(j.meta_str(META_FEDERATION_ID), Some(fixed));
}

/// A message that carries the envelope it was encoded from (the daemon's
/// routes to a federated sink keep it) is federated from that envelope:
/// the payload is not parsed again. Here the payload is not an envelope at
/// all, so only the kept envelope can be what arrives, with its meta.
#[tokio::test(start_paused = true)]
async fn a_kept_envelope_is_used_and_the_payload_not_parsed_again() {
    let f = fixture(&[("us", 1)], |_| {});
    let kept = JobEnvelope::new("report.build", vec![json!("kept")]);
    let mut message = OutgoingMessage::from_envelope(&kept, Encoding::OjsProto).unwrap();
    message.payload = bytes::Bytes::from_static(b"\xff not protobuf");
    f.federation
        .publish("kept", vec![message.with_envelope(kept.clone())])
        .await
        .unwrap();
    let mut c = f
        .region("us")
        .consumer("kept", ConsumerOptions::default())
        .await
        .unwrap();
    let d = c
        .receive(1, Duration::from_secs(1))
        .await
        .unwrap()
        .remove(0);
    let j = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
    assert_eq!((j.id.as_str(), &j.args), (kept.id.as_str(), &kept.args));
    assert!(j.meta_str(META_FEDERATION_ID).is_some());
}

#[tokio::test(start_paused = true)]
async fn replicas_are_marked_and_never_replicated_again() {
    let f = fixture(&[("us", 1), ("eu", 1), ("ap", 1)], |s| s.replicate = true);
    f.federation.publish("q", vec![job(&[])]).await.unwrap();
    assert_eq!(f.depth("us", "q").await, 1);
    for other in ["eu", "ap"] {
        let mut c = f
            .region(other)
            .consumer("ojs-federation-replicas", ConsumerOptions::default())
            .await
            .unwrap();
        let d = c.receive(10, Duration::from_secs(1)).await.unwrap();
        assert_eq!(d.len(), 1);
        let j = &Encoding::OjsProto.decode_envelopes(&d[0].payload).unwrap()[0];
        assert_eq!(j.meta_str(META_REPLICATED_FROM), Some("us"));
        d[0].ack().await.unwrap();
    }
    assert_eq!(f.federation.replicated(), 2);
    // Publishing a replica (e.g. a bridge forwarding the replica queue)
    // does not replicate it again.
    f.federation
        .publish("q", vec![job(&[(META_REPLICATED_FROM, "eu")])])
        .await
        .unwrap();
    assert_eq!(f.federation.replicated(), 2, "no replication loop");
    assert_eq!(f.depth("eu", "ojs-federation-replicas").await, 0);
}

#[test]
fn last_writer_wins_at_millisecond_precision_ties_broken_by_federation_id() {
    let at = |ms: i64, micros: u32, fid: &str| {
        let mut j = JobEnvelope::new("a.b", vec![]);
        j.enqueued_at = Some(
            chrono::DateTime::from_timestamp_millis(ms).unwrap()
                + chrono::Duration::microseconds(i64::from(micros)),
        );
        j.meta.insert(META_FEDERATION_ID.into(), json!(fid));
        j
    };
    let older = at(1_000, 0, "ffff");
    let newer = at(1_001, 0, "0000");
    assert_eq!(resolve_conflict(&older, &newer).id, newer.id);
    assert_eq!(resolve_conflict(&newer, &older).id, newer.id);
    // Same millisecond (microseconds differ): a tie, the greater id wins.
    let a = at(2_000, 100, "01912e4a-0000-7000-8000-000000000001");
    let b = at(2_000, 900, "01912e4a-0000-7000-8000-000000000002");
    assert_eq!(resolve_conflict(&a, &b).id, b.id);
    assert_eq!(resolve_conflict(&b, &a).id, b.id);
}

#[tokio::test(start_paused = true)]
async fn health_probes_feed_the_breaker_and_the_monitor_runs_on_its_interval() {
    let f = fixture(&[("us", 1), ("eu", 1)], |s| {
        s.failure_threshold = 3;
        s.cooldown = Duration::from_secs(10);
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let monitor = tokio::spawn(f.federation.clone().run_monitor(async {
        let _ = stopped.await;
    }));
    f.region("eu").set_down(true);
    tokio::time::sleep(Duration::from_millis(3500)).await; // ticks at 0,1,2,3 s
    assert_eq!(f.breaker("eu"), BreakerState::Open);
    assert_eq!(f.breaker("us"), BreakerState::Closed);
    f.region("eu").set_down(false);
    tokio::time::sleep(Duration::from_secs(12)).await; // cooldown, then a probe
    assert_eq!(
        f.breaker("eu"),
        BreakerState::Closed,
        "the half-open probe succeeded"
    );
    // What the metrics show of it: the bridge renders this snapshot
    // (`ojs_bridge::metrics::render_federation`, tested there).
    let eu = f
        .federation
        .snapshot()
        .into_iter()
        .find(|r| r.name == "eu")
        .map(|r| r.breaker.as_gauge());
    assert_eq!(eu, Some(0), "the breaker gauge of eu");
    let _ = stop.send(());
    monitor.await.unwrap();
}
