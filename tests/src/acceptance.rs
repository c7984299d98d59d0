//! The universal adapter acceptance suite (in the spirit of Watermill's
//! `pubsub/tests`): one set of cases, run against every [`QueueAdapter`],
//! parameterised by what the broker guarantees ([`Features`]).
//!
//! Every case counts sent, received, duplicates and lost, and asserts
//! `lost == 0`. Messages are real OJS envelopes, so "intact" means the
//! envelope decodes to what was sent.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{
    header, ConsumerOptions, DeadLetterReason, Delivery, Error, Nack, OutgoingMessage,
    QueueAdapter, Source,
};
use serde_json::json;
use tokio::time::Instant;

use crate::brokers::unique_queue;
use crate::tally::Tally;

/// What a broker guarantees; cases that depend on a guarantee the broker
/// lacks say so and check the weaker promise instead.
#[derive(Debug, Clone)]
pub struct Features {
    /// Adapter name for messages.
    pub name: &'static str,
    /// A new connection sees what a closed one published.
    pub persistent: bool,
    /// Messages with the same key are delivered in publish order.
    pub ordered_by_key: bool,
    /// Unsettled messages come back when their consumer is dropped.
    pub redelivers_on_consumer_drop: bool,
    /// Unsettled messages come back after the visibility timeout.
    pub visibility_timeout: bool,
    /// `ConsumerOptions::max_deliveries` dead-letters on its own.
    pub max_deliveries: bool,
    /// A message the broker delivers again (its consumer went away) comes
    /// with a higher attempt. Kafka has no delivery counter, so it cannot.
    pub counts_redeliveries: bool,
    /// The broker counts every receive itself (SQS's
    /// `ApproximateReceiveCount`): a released message comes back with one
    /// more attempt.
    pub counts_receives: bool,
    /// `depth` is exact. False only for test brokers known to report
    /// approximate watermarks (tansu reports a batch's base offset + 1).
    pub exact_depth: bool,
    /// The adapter may create broker resources (`topology = "declare"`, or
    /// no broker). False for the `existing` suites, where it creates nothing.
    pub creates_resources: bool,
    /// How long a new consumer may take before its first delivery (Kafka:
    /// joining the group).
    pub consumer_startup: Duration,
    /// Scale for message counts (1.0 = the counts in the case; moto needs less).
    pub volume: f64,
    /// How long a case waits for everything to arrive.
    pub patience: Duration,
}

impl Features {
    fn scaled(&self, n: usize) -> usize {
        ((n as f64 * self.volume).round() as usize).max(1)
    }
}

/// Opens connections to one broker.
#[async_trait]
pub trait AdapterFactory: Send + Sync {
    /// A new connection (adapter instance) to the broker under test.
    async fn connect(&self) -> Result<Arc<dyn QueueAdapter>>;
    /// The broker's guarantees.
    fn features(&self) -> Features;
    /// Options for a consumer of this test (e.g. a fresh Kafka group).
    fn consumer_options(&self) -> ConsumerOptions {
        ConsumerOptions::default()
    }
    /// A fresh queue for one case. Adapters that declare their own topology
    /// just name one; factories for `topology = "existing"` create it (and
    /// its dead-letter wiring) here with an independent client first.
    async fn queue(&self, prefix: &str) -> Result<String> {
        Ok(unique_queue(prefix))
    }
    /// The broker's adapter URL, where the suite's independent clients
    /// check what the adapter did; `None`: the broker the suites'
    /// environment names.
    fn broker_url(&self) -> Option<String> {
        None
    }
}

fn job(queue: &str, i: usize) -> JobEnvelope {
    JobEnvelope::new("acceptance.case", vec![json!(i), json!("payload-ü-✓")])
        .with_queue(queue)
        .with_meta(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .with_meta("index", i as u64)
}

fn message(queue: &str, i: usize) -> (String, OutgoingMessage) {
    let job = job(queue, i);
    let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto)
        .expect("valid envelope")
        .with_header("x-test-index", i.to_string());
    (job.id, msg)
}

fn id_of(d: &Delivery) -> Result<String> {
    let jobs = d
        .encoding(None)?
        .decode_envelopes(&d.payload)
        .context("body does not decode as the envelope that was sent")?;
    Ok(jobs[0].id.clone())
}

async fn publish_all(
    adapter: &dyn QueueAdapter,
    queue: &str,
    n: usize,
    tally: &mut Tally,
) -> Result<()> {
    let mut batch = Vec::new();
    for i in 0..n {
        let (id, msg) = message(queue, i);
        tally.sent(id);
        batch.push(msg);
        if batch.len() == 100 {
            adapter.publish(queue, std::mem::take(&mut batch)).await?;
        }
    }
    if !batch.is_empty() {
        adapter.publish(queue, batch).await?;
    }
    Ok(())
}

/// Receives and acks until every sent id arrived or patience runs out.
async fn drain_acking(
    consumer: &mut dyn ojs_queue::Consumer,
    tally: &mut Tally,
    patience: Duration,
) -> Result<()> {
    let deadline = Instant::now() + patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in consumer.receive(50, Duration::from_millis(500)).await? {
            tally.received(id_of(&d)?);
            d.ack().await?;
        }
    }
    Ok(())
}

/// Receives until exactly `n` deliveries are held (none settled), or fails
/// once `patience` runs out.
async fn receive_exactly(
    consumer: &mut dyn ojs_queue::Consumer,
    n: usize,
    patience: Duration,
) -> Result<Vec<Delivery>> {
    let deadline = Instant::now() + patience;
    let mut held = Vec::with_capacity(n);
    while held.len() < n && Instant::now() < deadline {
        held.extend(
            consumer
                .receive(n - held.len(), Duration::from_millis(500))
                .await?,
        );
    }
    if held.len() != n {
        bail!("received {} of {n}", held.len());
    }
    Ok(held)
}

/// 100 messages: body, headers and content type arrive intact.
pub async fn publish_consume_intact(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-intact").await?;
    let n = features.scaled(100);
    let mut tally = Tally::new();
    let mut expected = HashMap::new();
    for i in 0..n {
        let (id, msg) = message(&queue, i);
        tally.sent(id.clone());
        expected.insert(id, (i, msg));
    }
    let batch: Vec<_> = (0..n)
        .map(|i| {
            expected
                .values()
                .find(|(j, _)| *j == i)
                .map(|(_, m)| m.clone())
                .unwrap()
        })
        .collect();
    adapter.publish(&queue, batch).await?;
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in consumer.receive(50, Duration::from_millis(500)).await? {
            let job = &d.encoding(None)?.decode_envelopes(&d.payload)?[0];
            let (i, sent) = expected.get(&job.id).context("unknown id")?;
            assert_eq!(d.payload, sent.payload, "body bytes intact");
            assert_eq!(d.content_type(), Some(ojs_core::envelope::media::OJS_PROTO));
            assert_eq!(d.attempt, 1, "first delivery");
            for name in [
                header::ID,
                header::TYPE,
                header::QUEUE,
                header::SPECVERSION,
                header::TRACEPARENT,
            ] {
                assert_eq!(d.headers.get(name), sent.headers.get(name), "header {name}");
            }
            assert_eq!(
                d.headers.get_str("x-test-index"),
                Some(i.to_string().as_str())
            );
            assert_eq!(job.args[0], json!(*i));
            assert_eq!(job.args[1], json!("payload-ü-✓"));
            tally.received(job.id.clone());
            d.ack().await?;
        }
    }
    tally.assert_none_lost(&format!("{} intact", features.name));
    assert_eq!(tally.duplicates(), 0, "no redelivery without a failure");
    consumer.close().await?;
    Ok(())
}

/// Concurrent publishers and consumers: nothing lost.
pub async fn concurrent_publishers_and_consumers(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-concurrent").await?;
    let publishers = 20;
    let per_publisher = features.scaled(100);
    let mut ids = Vec::new();
    let mut tasks = Vec::new();
    for p in 0..publishers {
        let mut msgs = Vec::new();
        for i in 0..per_publisher {
            let (id, msg) = message(&queue, p * per_publisher + i);
            ids.push(id);
            msgs.push(msg);
        }
        let adapter = adapter.clone();
        let queue = queue.clone();
        tasks.push(tokio::spawn(async move {
            for chunk in msgs.chunks(25) {
                adapter.publish(&queue, chunk.to_vec()).await?;
            }
            Ok::<_, Error>(())
        }));
    }
    let mut consumers = Vec::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // A watch channel, unlike Notify::notify_waiters, is seen by consumers
    // that are busy acking when the stop is sent.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Acks that came after their delivery's visibility timeout: the broker
    // hands the message out again (at least once; the tally counts it as a
    // duplicate), which on a broker with visibility timeouts is an outcome
    // of a slow broker, not a failure. Seen on moto in a container beside
    // other container suites: its deletes answered `ReceiptHandleIsInvalid`.
    // Any other failed ack fails the case.
    let expired = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..4 {
        let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
        let tx = tx.clone();
        let mut stopped = stopped.clone();
        let expired = expired.clone();
        let may_expire = features.visibility_timeout;
        consumers.push(tokio::spawn(async move {
            while !*stopped.borrow() {
                let batch = tokio::select! {
                    _ = stopped.changed() => break,
                    b = consumer.receive(20, Duration::from_millis(300)) => b?,
                };
                for d in batch {
                    let _ = tx
                        .send(id_of(&d).map_err(|e| Error::broker("test", e.to_string(), false))?);
                    match d.ack().await {
                        Ok(()) => {}
                        Err(Error::DeliveryExpired) if may_expire => {
                            expired.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            consumer.close().await
        }));
    }
    drop(tx);
    for t in tasks {
        t.await??;
    }
    let mut tally = Tally::new();
    ids.into_iter().for_each(|id| tally.sent(id));
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        if let Ok(Some(id)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
            tally.received(id);
        }
    }
    let _ = stop.send(true);
    for c in consumers {
        tokio::time::timeout(Duration::from_secs(30), c)
            .await
            .context("consumer did not stop")???;
    }
    let expired = expired.load(std::sync::atomic::Ordering::Relaxed);
    if expired > 0 {
        println!(
            "{} concurrent: {expired} acks came after their visibility timeout (delivered again)",
            features.name
        );
    }
    tally.assert_none_lost(&format!(
        "{} {publishers}x{per_publisher} concurrent",
        features.name
    ));
    Ok(())
}

/// Several queues at once: each consumer sees only its own queue.
pub async fn queues_are_isolated(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let n = features.scaled(50);
    let mut queues = Vec::new();
    for _ in 0..3 {
        queues.push(f.queue("acc-isolated").await?);
    }
    let mut tallies = Vec::new();
    for q in &queues {
        let mut t = Tally::new();
        publish_all(&*adapter, q, n, &mut t).await?;
        tallies.push(t);
    }
    for (q, tally) in queues.iter().zip(tallies.iter_mut()) {
        let mut consumer = adapter.consumer(q, f.consumer_options()).await?;
        drain_acking(&mut *consumer, tally, features.patience).await?;
        // Anything more on this queue would be crosstalk.
        for d in consumer.receive(10, Duration::from_millis(500)).await? {
            tally.received(id_of(&d)?);
            d.ack().await?;
        }
        tally.assert_none_lost(&format!("{} queue {q}", features.name));
        consumer.close().await?;
    }
    Ok(())
}

/// The first delivery of every message is nacked: each still arrives, with
/// its attempt counted up.
pub async fn nacked_messages_are_redelivered(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-nack").await?;
    let n = features.scaled(50);
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, n, &mut sent).await?;
    let mut acked = sent.clone();
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let mut nacked = 0;
    let deadline = Instant::now() + features.patience;
    while !acked.complete() && Instant::now() < deadline {
        for d in consumer.receive(25, Duration::from_millis(500)).await? {
            let id = id_of(&d)?;
            if d.attempt == 1 {
                nacked += 1;
                d.nack(Nack::requeue()).await?;
            } else {
                acked.received(id);
                d.ack().await?;
            }
        }
    }
    acked.assert_none_lost(&format!("{} nack→redelivery", features.name));
    assert_eq!(nacked, n, "every first delivery was nacked once");
    Ok(())
}

/// Receives until every id of `tally` came once more; gives each back with
/// `Nack::Release` unless `settle` says otherwise. Returns the attempt seen
/// per id.
async fn attempts_seen(
    consumer: &mut dyn ojs_queue::Consumer,
    tally: &Tally,
    patience: Duration,
    release: bool,
) -> Result<HashMap<String, u32>> {
    let mut seen = HashMap::new();
    let deadline = Instant::now() + patience;
    let mut left = tally.clone();
    while !left.complete() && Instant::now() < deadline {
        for d in consumer.receive(10, Duration::from_millis(500)).await? {
            let id = id_of(&d)?;
            left.received(id.clone());
            seen.insert(id, d.attempt);
            if release {
                d.nack(Nack::Release).await?;
            } else {
                d.ack().await?;
            }
        }
    }
    left.assert_none_lost("released messages come back");
    Ok(seen)
}

/// A message given back with `Nack::Release` (looked at, not attempted)
/// comes back with the attempt it had, from the queue and from the dead
/// letters alike; where the broker counts receives itself (SQS) it is one
/// more, as documented.
pub async fn released_messages_keep_their_attempt(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-release").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 2, &mut sent).await?;
    let expected = |before: u32| before + u32::from(features.counts_receives);
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let first = attempts_seen(&mut *consumer, &sent, features.patience, true).await?;
    let again = attempts_seen(&mut *consumer, &sent, features.patience, true).await?;
    for (id, a) in &first {
        assert_eq!(
            again[id],
            expected(*a),
            "{}: attempt after a release",
            features.name
        );
    }
    // Dead-lettered, then listed twice: a look is not an attempt there either.
    let mut dead = 0;
    let deadline = Instant::now() + features.patience;
    while dead < 2 {
        if Instant::now() >= deadline {
            bail!(
                "{}: the released messages did not come back a third time",
                features.name
            );
        }
        for d in consumer.receive(2, Duration::from_millis(500)).await? {
            d.nack(Nack::DeadLetter(DeadLetterReason::new("test", "released")))
                .await?;
            dead += 1;
        }
    }
    consumer.close().await?;
    let mut options = f.consumer_options();
    options.source = Source::DeadLetters;
    let mut dlq = adapter.consumer(&queue, options).await?;
    let first = attempts_seen(&mut *dlq, &sent, features.patience, true).await?;
    let again = attempts_seen(&mut *dlq, &sent, features.patience, false).await?;
    for (id, a) in &first {
        assert_eq!(
            again[id],
            expected(*a),
            "{}: a dead letter's attempt after a listing",
            features.name
        );
    }
    Ok(())
}

/// A delayed nack is not redelivered before its delay.
pub async fn delayed_nack_waits(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-delay").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 3, &mut sent).await?;
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let delay = Duration::from_secs(2);
    let mut nacked_at = HashMap::new();
    let mut tally = sent.clone();
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in consumer.receive(10, Duration::from_millis(300)).await? {
            let id = id_of(&d)?;
            match nacked_at.get(&id) {
                None => {
                    nacked_at.insert(id, Instant::now());
                    d.nack(Nack::retry_after(delay)).await?;
                }
                Some(at) => {
                    let waited = at.elapsed();
                    assert!(
                        waited >= delay,
                        "redelivered after {waited:?}, before its {delay:?} delay"
                    );
                    assert!(d.attempt >= 2);
                    tally.received(id);
                    d.ack().await?;
                }
            }
        }
    }
    tally.assert_none_lost(&format!("{} delayed nack", features.name));
    Ok(())
}

/// An unsettled message comes back once its consumer goes away (or its
/// visibility timeout ends).
pub async fn unacked_messages_come_back(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-unacked").await?;
    let n = features.scaled(10);
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, n, &mut sent).await?;
    let mut options = f.consumer_options();
    options.visibility_timeout = Duration::from_secs(2);
    let mut first = adapter.consumer(&queue, options.clone()).await?;
    let held = receive_exactly(&mut *first, n, features.patience)
        .await
        .context("before going away")?;
    if features.redelivers_on_consumer_drop {
        drop(first);
    } else if !features.visibility_timeout {
        bail!(
            "{}: declares neither redelivery on drop nor visibility timeouts",
            features.name
        );
    }
    let mut tally = sent.clone();
    let mut second = adapter.consumer(&queue, options).await?;
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in second.receive(n, Duration::from_millis(500)).await? {
            if features.counts_redeliveries {
                assert!(d.attempt >= 2, "a redelivery counts as a new attempt");
            }
            tally.received(id_of(&d)?);
            d.ack().await?;
        }
    }
    tally.assert_none_lost(&format!("{} unacked come back", features.name));
    drop(held);
    Ok(())
}

/// Restarts that abandon a third of each batch: a fixed number of
/// consumers each take up to 30 deliveries, ack two thirds and go away
/// with the rest unsettled; then one consumer drains and acks what is
/// left. Every message arrives (the abandoned ones again, after the
/// restart). The restarts are counted, not timed: with contiguous commits
/// (Kafka) a restart advances a partition by only a few records, so a
/// time limit on them would measure how fast the machine joins a group.
pub async fn consumer_restarts_lose_nothing(f: &dyn AdapterFactory) -> Result<()> {
    const RESTARTS: usize = 20;
    let features = f.features();
    let publisher = f.connect().await?;
    let queue = f.queue("acc-restart").await?;
    let n = features.scaled(200);
    let mut sent = Tally::new();
    publish_all(&*publisher, &queue, n, &mut sent).await?;
    let mut tally = sent.clone();
    let mut options = f.consumer_options();
    options.visibility_timeout = Duration::from_secs(2);
    let mut restarts = 0;
    let mut abandoned = 0;
    while restarts < RESTARTS && !tally.complete() {
        let adapter = if features.persistent {
            f.connect().await?
        } else {
            publisher.clone()
        };
        let mut consumer = adapter.consumer(&queue, options.clone()).await?;
        // Up to 30, gathered while they keep coming (a broker that pushes
        // deliveries hands the first receive only what arrived so far).
        let mut batch = consumer.receive(30, features.consumer_startup).await?;
        while !batch.is_empty() && batch.len() < 30 {
            let more = consumer
                .receive(30 - batch.len(), Duration::from_millis(200))
                .await?;
            if more.is_empty() {
                break;
            }
            batch.extend(more);
        }
        // Ack two thirds; the rest are abandoned with the consumer.
        for (i, d) in batch.into_iter().enumerate() {
            if i % 3 == 2 {
                abandoned += 1;
            } else {
                tally.received(id_of(&d)?);
                d.ack().await?;
            }
        }
        drop(consumer);
        if features.persistent {
            adapter.close().await?;
        }
        restarts += 1;
    }
    // What the restarts left (abandoned, or never reached) comes to one
    // consumer that stays.
    let adapter = if features.persistent {
        f.connect().await?
    } else {
        publisher.clone()
    };
    let mut consumer = adapter.consumer(&queue, options).await?;
    drain_acking(
        &mut *consumer,
        &mut tally,
        features.patience + features.consumer_startup,
    )
    .await?;
    tally.assert_none_lost(&format!(
        "{} {restarts} consumer restarts ({abandoned} deliveries abandoned), then a drain",
        features.name
    ));
    assert!(
        abandoned > 0,
        "no restart abandoned anything: nothing was tested"
    );
    Ok(())
}

/// Acking twice is an error (the documented behaviour), and so is nacking
/// an acked delivery; the same through `ack_now`, which acks at once or
/// leaves the delivery as it was.
pub async fn ack_twice_is_an_error(f: &dyn AdapterFactory) -> Result<()> {
    let adapter = f.connect().await?;
    let queue = f.queue("acc-acktwice").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 2, &mut sent).await?;
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let received = receive_exactly(&mut *consumer, 2, f.features().patience).await?;
    let (d, other) = (&received[0], &received[1]);
    match other.ack_now() {
        Some(result) => result?,
        // The adapter's ack waits for its broker: nothing happened yet.
        None => {
            assert!(!other.is_settled());
            other.ack().await?;
        }
    }
    assert!(other.is_settled());
    assert!(matches!(
        other.ack_now(),
        Some(Err(Error::AlreadyAcknowledged("acked")))
    ));
    d.ack().await?;
    assert!(matches!(
        d.ack().await,
        Err(Error::AlreadyAcknowledged("acked"))
    ));
    assert!(matches!(
        d.nack(Nack::requeue()).await,
        Err(Error::AlreadyAcknowledged("acked"))
    ));
    assert!(d.is_settled());
    Ok(())
}

/// `Delivery::ack_all` settles a batch at once (one lock, one commit, one
/// request where the adapter can): each member is acked once, a member
/// acked before gets `AlreadyAcknowledged`, and none of them is delivered
/// again — not to a new consumer, not after the visibility timeout.
pub async fn ack_all_settles_each_once(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-ackall").await?;
    let n = features.scaled(20).max(3);
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, n, &mut sent).await?;
    let mut options = f.consumer_options();
    options.visibility_timeout = Duration::from_secs(2);
    let mut consumer = adapter.consumer(&queue, options.clone()).await?;
    let received = receive_exactly(&mut *consumer, n, features.patience).await?;
    let mut acked = HashSet::new();
    for d in &received {
        let id = id_of(d)?;
        sent.received(id.clone());
        acked.insert(id);
    }
    received[1].ack().await?;
    let all: Vec<&Delivery> = received.iter().collect();
    let results = Delivery::ack_all(&all).await;
    assert_eq!(results.len(), n);
    for (i, result) in results.iter().enumerate() {
        if i == 1 {
            assert!(
                matches!(result, Err(Error::AlreadyAcknowledged("acked"))),
                "{}: a member acked before: {result:?}",
                features.name
            );
        } else {
            assert!(result.is_ok(), "{}: member {i}: {result:?}", features.name);
        }
    }
    assert!(received.iter().all(Delivery::is_settled));
    let settled_at = Instant::now();
    consumer.close().await?;
    // A message published after: once it is through, and the visibility
    // timeout has passed, anything unsettled would have come back.
    let (marker, last) = message(&queue, n);
    sent.sent(marker.clone());
    adapter.publish(&queue, vec![last]).await?;
    let mut again = adapter.consumer(&queue, options).await?;
    let mut marker_seen = false;
    let deadline = Instant::now() + features.patience + features.consumer_startup;
    while !(marker_seen && settled_at.elapsed() > Duration::from_secs(3)) {
        if Instant::now() > deadline {
            bail!(
                "{}: the message published after the batch did not arrive",
                features.name
            );
        }
        for d in again.receive(n + 1, Duration::from_millis(500)).await? {
            let id = id_of(&d)?;
            assert!(
                !acked.contains(&id),
                "{}: {id} was acked by ack_all and delivered again",
                features.name
            );
            marker_seen |= id == marker;
            sent.received(id);
            d.ack().await?;
        }
    }
    let context = format!("{} ack_all", features.name);
    sent.assert_none_lost(&context);
    assert_eq!(sent.duplicates(), 0, "{context}: {sent}");
    Ok(())
}

/// Closing a publisher loses nothing it accepted; publishing after close fails.
pub async fn close_loses_nothing_accepted(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let publisher = f.connect().await?;
    let queue = f.queue("acc-close").await?;
    let n = features.scaled(100);
    let mut tally = Tally::new();
    publish_all(&*publisher, &queue, n, &mut tally).await?;
    publisher.close().await?;
    let (_, late) = message(&queue, n);
    let err = publisher.publish(&queue, vec![late]).await.unwrap_err();
    assert!(
        matches!(err, Error::Closed)
            || matches!(&err, Error::Publish(p) if matches!(p.failed[0].error, Error::Closed)),
        "{err}"
    );
    let reader = f.connect().await?;
    let mut consumer = reader.consumer(&queue, f.consumer_options()).await?;
    drain_acking(&mut *consumer, &mut tally, features.patience).await?;
    tally.assert_none_lost(&format!("{} close", features.name));
    Ok(())
}

/// Order within a key, where the broker guarantees it.
pub async fn order_within_a_key(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    if !features.ordered_by_key {
        println!(
            "{}: no per-key order guarantee; checking delivery only",
            features.name
        );
    }
    let adapter = f.connect().await?;
    let queue = f.queue("acc-order").await?;
    let n = features.scaled(100);
    let mut tally = Tally::new();
    let mut batch = Vec::new();
    for i in 0..n {
        let (id, msg) = message(&queue, i);
        tally.sent(id);
        batch.push(msg.with_key("one-key"));
    }
    for chunk in batch.chunks(10) {
        adapter.publish(&queue, chunk.to_vec()).await?;
    }
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let mut order = Vec::new();
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in consumer.receive(50, Duration::from_millis(500)).await? {
            let job = &d.encoding(None)?.decode_envelopes(&d.payload)?[0];
            assert_eq!(d.key.as_deref(), Some(&b"one-key"[..]), "key kept");
            order.push(job.args[0].as_u64().context("index")?);
            tally.received(job.id.clone());
            d.ack().await?;
        }
    }
    tally.assert_none_lost(&format!("{} keyed", features.name));
    if features.ordered_by_key {
        let expected: Vec<u64> = (0..n as u64).collect();
        assert_eq!(order, expected, "per-key order");
    }
    Ok(())
}

/// A key and a header value that are not UTF-8 (a Kafka producer's binary
/// key and headers) come back byte for byte: on delivery, after a retry and
/// in the dead letters, so the copy lands in the same partition as the
/// original and carries what it carried.
pub async fn binary_keys_and_header_values_survive_retries_and_dead_letters(
    f: &dyn AdapterFactory,
) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-binkey").await?;
    let key: &'static [u8] = b"\xff\x00\xfek\x80";
    // A header value that is not UTF-8 (a Kafka header can hold any
    // bytes): it must come back as the same bytes, never "repaired".
    let value: &'static [u8] = b"\x00\xc3(\xff";
    let (id, msg) = message(&queue, 0);
    let msg = msg.with_key(key).with_header("x-binary", value);
    adapter.publish(&queue, vec![msg]).await?;
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let deadline = Instant::now() + features.patience;
    let mut seen = 0;
    while seen < 2 && Instant::now() < deadline {
        for d in consumer.receive(1, Duration::from_millis(500)).await? {
            assert_eq!(id_of(&d)?, id);
            assert_eq!(
                d.key.as_deref(),
                Some(key),
                "key kept (delivery {})",
                seen + 1
            );
            assert_eq!(
                d.headers.get("x-binary").map(|v| v.as_bytes()),
                Some(value),
                "binary header value kept (delivery {})",
                seen + 1
            );
            seen += 1;
            let action = if seen == 1 {
                Nack::requeue()
            } else {
                Nack::DeadLetter(DeadLetterReason::new("test", "binary key"))
            };
            d.nack(action).await?;
        }
    }
    assert_eq!(seen, 2, "{}: delivered, then retried", features.name);
    consumer.close().await?;
    let mut options = f.consumer_options();
    options.source = Source::DeadLetters;
    let mut dlq = adapter.consumer(&queue, options).await?;
    let deadline = Instant::now() + features.patience;
    let mut dead = None;
    while dead.is_none() && Instant::now() < deadline {
        for d in dlq.receive(1, Duration::from_millis(500)).await? {
            dead = Some((d.key.clone(), d.headers.get("x-binary").cloned()));
            d.ack().await?;
        }
    }
    dlq.close().await?;
    let (dead_key, dead_value) = dead.context("the dead letter arrives")?;
    assert_eq!(
        dead_key.as_deref(),
        Some(key),
        "{}: key kept in the dead letters",
        features.name
    );
    assert_eq!(
        dead_value.as_ref().map(|v| v.as_bytes()),
        Some(value),
        "{}: binary header value kept in the dead letters",
        features.name
    );
    Ok(())
}

async fn read_dead_letters(
    f: &dyn AdapterFactory,
    adapter: &dyn QueueAdapter,
    queue: &str,
    tally: &mut Tally,
) -> Result<Vec<DeadLetterReason>> {
    let mut options = f.consumer_options();
    options.source = Source::DeadLetters;
    let mut dlq = adapter.consumer(queue, options).await?;
    let mut reasons = Vec::new();
    let deadline = Instant::now() + f.features().patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in dlq.receive(10, Duration::from_millis(500)).await? {
            reasons.push(
                d.dead_letter_reason()
                    .context("dead letter without a reason")?,
            );
            tally.received(id_of(&d)?);
            d.ack().await?;
        }
    }
    Ok(reasons)
}

/// Dead-lettering: explicitly with a reason, and after the maximum number of
/// deliveries where the broker counts them.
pub async fn dead_letter_with_reason(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-dlq").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 3, &mut sent).await?;
    let mut options = f.consumer_options();
    let max = 3;
    options.max_deliveries = features.max_deliveries.then_some(max);
    let mut consumer = adapter.consumer(&queue, options).await?;
    let mut attempts: HashMap<String, u32> = HashMap::new();
    let mut done = Tally::new();
    for id in attempts_keys(&sent) {
        done.sent(id);
    }
    let deadline = Instant::now() + features.patience;
    while !done.complete() && Instant::now() < deadline {
        for d in consumer.receive(10, Duration::from_millis(300)).await? {
            let id = id_of(&d)?;
            *attempts.entry(id.clone()).or_default() += 1;
            assert!(
                d.attempt <= max,
                "delivered {} times, max is {max}",
                d.attempt
            );
            if !features.max_deliveries && d.attempt >= max {
                // The worker's rule when the broker does not count for us.
                d.nack(Nack::DeadLetter(DeadLetterReason::new(
                    "max_attempts",
                    format!("failed {max} times"),
                )))
                .await?;
                done.received(id);
            } else {
                if d.attempt >= max {
                    done.received(id);
                }
                d.nack(Nack::requeue()).await?;
            }
        }
    }
    done.assert_none_lost(&format!("{} attempts before dead-lettering", features.name));
    // Done with it: an idle member of a Kafka group stalls the group's
    // rebalances until max.poll.interval.ms, so close what is not polled.
    consumer.close().await?;
    let mut dead = sent.clone();
    let reasons = read_dead_letters(f, &*adapter, &queue, &mut dead).await?;
    dead.assert_none_lost(&format!("{} dead letters", features.name));
    for r in &reasons {
        assert!(
            !r.error_type.is_empty() && !r.message.is_empty(),
            "reason readable: {r:?}"
        );
    }
    assert_eq!(
        adapter.depth(&queue).await?.unwrap_or(0),
        0,
        "nothing left in the queue"
    );

    // An explicit dead-letter carries the caller's reason verbatim.
    let queue = f.queue("acc-dlq-explicit").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 1, &mut sent).await?;
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    let mut tally = sent.clone();
    let deadline = Instant::now() + features.patience;
    while !tally.complete() && Instant::now() < deadline {
        for d in consumer.receive(1, Duration::from_millis(500)).await? {
            tally.received(id_of(&d)?);
            d.nack(Nack::DeadLetter(DeadLetterReason::new(
                "unknown_route",
                "no route for acceptance.case",
            )))
            .await?;
        }
    }
    consumer.close().await?;
    let mut dead = sent.clone();
    let reasons = read_dead_letters(f, &*adapter, &queue, &mut dead).await?;
    dead.assert_none_lost(&format!("{} explicit dead letter", features.name));
    assert_eq!(
        reasons,
        vec![DeadLetterReason::new(
            "unknown_route",
            "no route for acceptance.case"
        )]
    );
    Ok(())
}

fn attempts_keys(t: &Tally) -> Vec<String> {
    t.lost().into_iter().cloned().collect()
}

/// An oversized message fails alone with `PayloadTooLarge`; its batch
/// neighbours are published; nothing half-sent arrives.
pub async fn oversized_message_is_rejected(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("acc-oversize").await?;
    let limit = adapter.max_message_bytes();
    let (id_a, a) = message(&queue, 0);
    let (id_c, c) = message(&queue, 2);
    let big = OutgoingMessage::new(vec![b'x'; limit + 1], ojs_core::envelope::media::OJS_PROTO);
    let err = adapter.publish(&queue, vec![a, big, c]).await.unwrap_err();
    let Error::Publish(failure) = err else {
        bail!("expected a per-message failure, got {err}")
    };
    assert_eq!(failure.total, 3);
    assert_eq!(failure.failed.len(), 1);
    assert_eq!(failure.failed[0].index, 1);
    assert!(
        matches!(failure.failed[0].error, Error::PayloadTooLarge { size, limit: l } if size > l && l == limit),
        "{}",
        failure.failed[0].error
    );
    assert_eq!(
        failure.failed[0].message.payload.len(),
        limit + 1,
        "handed back whole"
    );
    let mut tally = Tally::new();
    tally.sent(id_a);
    tally.sent(id_c);
    let mut consumer = adapter.consumer(&queue, f.consumer_options()).await?;
    drain_acking(&mut *consumer, &mut tally, features.patience).await?;
    for d in consumer.receive(10, Duration::from_millis(500)).await? {
        tally.received(id_of(&d)?); // an oversized fragment would count as unexpected
    }
    tally.assert_none_lost(&format!("{} oversize neighbours", features.name));
    Ok(())
}

/// Health is reported and depth counts waiting messages.
pub async fn health_and_depth(f: &dyn AdapterFactory) -> Result<()> {
    let adapter = f.connect().await?;
    let health = adapter.health().await;
    assert!(health.healthy, "{}", health.detail);
    let queue = f.queue("acc-depth").await?;
    let mut sent = Tally::new();
    publish_all(&*adapter, &queue, 5, &mut sent).await?;
    if let Some(depth) = adapter.depth(&queue).await? {
        if f.features().exact_depth {
            assert_eq!(depth, 5);
        } else {
            println!(
                "{}: depth {depth} for 5 waiting (this test broker reports approximate watermarks)",
                f.features().name
            );
            assert!((1..=5).contains(&depth), "depth {depth} out of bounds");
        }
    } else {
        println!("{}: depth not reported by this broker", f.features().name);
    }
    Ok(())
}

/// Generates one `#[tokio::test]` per acceptance case for a factory.
///
/// `$factory` is an async fn returning `Option<impl AdapterFactory>`; `None`
/// means the broker is unavailable and the skip (or failure, under
/// `OJS_BRIDGE_REQUIRE_BROKERS=1`) was already reported.
pub use crate::tonic_cases::{
    tonic_calls_over_the_queue_run_once_each, tonic_lost_reply_is_a_timeout,
    tonic_reply_queue_of_its_own, tonic_status_table,
};

#[macro_export]
macro_rules! acceptance_tests {
    // Every case in one test, one after the other, each with a factory
    // made by `$factory(&setup)` from what `$setup().await` gave (a broker
    // started for this test, dropped at its end).
    (@in_one_test $name:ident, $setup:path, $factory:path) => {
        $crate::acceptance_tests!(@cases @one $name $setup, $factory =>);
    };
    (@one $name:ident $setup:path, $factory:path => $($case:ident),+ $(,)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(setup) = $setup().await else { return };
            $(
                println!("acceptance case {}", stringify!($case));
                let factory = $factory(&setup);
                if let Err(e) = $crate::acceptance::$case(&factory).await {
                    panic!("acceptance case {}: {e:#}", stringify!($case));
                }
            )+
            drop(setup);
        }
    };
    // The list of cases, handed to the arm `$($arm)*` names.
    (@cases $($arm:tt)*) => {
        $crate::acceptance_tests!($($arm)*
            publish_consume_intact,
            concurrent_publishers_and_consumers,
            queues_are_isolated,
            nacked_messages_are_redelivered,
            released_messages_keep_their_attempt,
            delayed_nack_waits,
            unacked_messages_come_back,
            consumer_restarts_lose_nothing,
            ack_twice_is_an_error,
            ack_all_settles_each_once,
            close_loses_nothing_accepted,
            order_within_a_key,
            binary_keys_and_header_values_survive_retries_and_dead_letters,
            dead_letter_with_reason,
            oversized_message_is_rejected,
            health_and_depth,
            tonic_calls_over_the_queue_run_once_each,
            tonic_status_table,
            tonic_lost_reply_is_a_timeout,
            tonic_reply_queue_of_its_own,
        );
    };
    ($factory:path) => {
        $crate::acceptance_tests!(@cases $factory =>);
    };
    ($factory:path => $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(factory) = $factory().await else { return };
                $crate::acceptance::$case(&factory).await.unwrap();
            }
        )+
    };
}
