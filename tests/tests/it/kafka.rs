//! Kafka specifics beyond the shared suite: out-of-order acks, consumer
//! groups, resuming from committed offsets, and a broker restart.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
use ojs_bridge_tests::brokers::{bounce, bounce_command, find, unique_queue, Broker};
use ojs_bridge_tests::kafka::{produce_raw_header_names, test_config};
use ojs_bridge_tests::tally::Tally;
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{Consumer, ConsumerOptions, Delivery, Error, OutgoingMessage, QueueAdapter};
use serde_json::json;
use tokio::time::Instant;

async fn adapter(partitions: i32) -> Option<(KafkaAdapter, KafkaConfig)> {
    let url = find(Broker::Kafka).await?.url;
    let mut config = test_config(&url);
    config.partitions = partitions;
    // Fail a publish to a restarted broker fast enough for a test.
    config.publish_timeout_ms = 10_000;
    Some((KafkaAdapter::connect(config.clone()).await.unwrap(), config))
}

fn jobs(queue: &str, n: usize) -> (Vec<String>, Vec<OutgoingMessage>) {
    (0..n)
        .map(|i| {
            let job = JobEnvelope::new("kafka.item", vec![json!(i)]).with_queue(queue);
            let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap();
            (job.id, msg)
        })
        .unzip()
}

fn index(d: &Delivery) -> u64 {
    Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0].args[0]
        .as_u64()
        .unwrap()
}

fn id(d: &Delivery) -> String {
    Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0]
        .id
        .clone()
}

async fn receive_n(c: &mut Box<dyn Consumer>, n: usize, patience: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + patience;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        out.extend(
            c.receive(n - out.len(), Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    out
}

fn group(name: &str) -> ConsumerOptions {
    ConsumerOptions {
        group: name.to_owned(),
        ..ConsumerOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_acks_never_commit_past_an_unacked_offset() {
    let Some((kafka, _)) = adapter(1).await else {
        return;
    };
    let queue = unique_queue("k-ooo");
    let g = unique_queue("g");
    let (ids, msgs) = jobs(&queue, 100);
    kafka.publish(&queue, msgs).await.unwrap();
    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let batch = receive_n(&mut c, 100, Duration::from_secs(30)).await;
    assert_eq!(batch.len(), 100);
    let k = 37;
    // Ack everything but k, newest first.
    for d in batch.iter().rev() {
        if index(d) != k {
            d.ack().await.unwrap();
        }
    }
    c.close().await.unwrap();

    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let again = receive_n(&mut c, 100 - k as usize, Duration::from_secs(30)).await;
    let indices: Vec<u64> = again.iter().map(index).collect();
    assert_eq!(
        indices.first(),
        Some(&k),
        "the unacked record comes back first"
    );
    assert_eq!(
        indices,
        (k..100).collect::<Vec<_>>(),
        "replay starts at the hole, nothing after it lost"
    );
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    batch
        .iter()
        .filter(|d| index(d) != k)
        .for_each(|d| tally.received(id(d)));
    again.iter().for_each(|d| tally.received(id(d)));
    tally.assert_none_lost("kafka out-of-order acks");
    assert_eq!(
        tally.duplicates(),
        100 - k - 1,
        "acked records after the hole are replayed"
    );
    for d in &again {
        d.ack().await.unwrap();
    }
    c.close().await.unwrap();
}

/// A publish larger than librdkafka's local queue (here 16 records) waits
/// for room instead of failing, and keeps its records in order: the one
/// the queue refused goes before the ones after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_larger_than_the_local_queue_waits_for_room_in_order() {
    let Some(url) = find(Broker::Kafka).await.map(|b| b.url) else {
        return;
    };
    let mut config = test_config(&url);
    config.partitions = 1;
    config
        .librdkafka_options
        .insert("queue.buffering.max.messages".into(), "16".into());
    let kafka = KafkaAdapter::connect(config).await.unwrap();
    let queue = unique_queue("k-queue-full");
    let n = 300;
    let (ids, msgs) = jobs(&queue, n);
    kafka.publish(&queue, msgs).await.unwrap();
    let mut c = kafka
        .consumer(&queue, group(&unique_queue("g")))
        .await
        .unwrap();
    let got = receive_n(&mut c, n, Duration::from_secs(60)).await;
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    got.iter().for_each(|d| tally.received(id(d)));
    tally.assert_none_lost("kafka publish through a 16-record local queue");
    assert_eq!(tally.duplicates(), 0, "{tally}");
    assert_eq!(
        got.iter().map(index).collect::<Vec<_>>(),
        (0..n as u64).collect::<Vec<_>>(),
        "one partition: in the order published"
    );
    for d in &got {
        d.ack().await.unwrap();
    }
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_splits_partitions_and_two_groups_each_get_everything() {
    let Some((kafka, _)) = adapter(3).await else {
        return;
    };
    let queue = unique_queue("k-groups");
    let n = 300;
    let (ids, msgs) = jobs(&queue, n);
    kafka.publish(&queue, msgs).await.unwrap();

    // Two members of one group, consuming at the same time.
    let g = unique_queue("g");
    let mut c1 = kafka.consumer(&queue, group(&g)).await.unwrap();
    let mut c2 = kafka.consumer(&queue, group(&g)).await.unwrap();
    let mut per_member = [0usize; 2];
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !tally.complete() && Instant::now() < deadline {
        let (a, b) = tokio::join!(
            c1.receive(100, Duration::from_millis(500)),
            c2.receive(100, Duration::from_millis(500))
        );
        for (member, batch) in [(0, a.unwrap()), (1, b.unwrap())] {
            for d in batch {
                per_member[member] += 1;
                tally.received(id(&d));
                d.ack().await.unwrap();
            }
        }
    }
    tally.assert_none_lost("kafka one group, two members");
    println!("per member: {per_member:?}");
    assert!(
        per_member[0] > 0 && per_member[1] > 0,
        "partitions were split: {per_member:?}"
    );
    c1.close().await.unwrap();
    c2.close().await.unwrap();

    // Two other groups each see every record.
    for name in ["ga", "gb"] {
        let g = unique_queue(name);
        let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
        let mut tally = Tally::new();
        ids.iter().for_each(|i| tally.sent(i.clone()));
        for d in receive_n(&mut c, n, Duration::from_secs(60)).await {
            tally.received(id(&d));
            d.ack().await.unwrap();
        }
        tally.assert_none_lost(&format!("kafka group {name}"));
        c.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_consumer_resumes_from_the_committed_offset() {
    let Some((kafka, _)) = adapter(3).await else {
        return;
    };
    let queue = unique_queue("k-resume");
    let g = unique_queue("g");
    let n = 200;
    let (ids, msgs) = jobs(&queue, n);
    kafka.publish(&queue, msgs).await.unwrap();
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));

    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    for d in receive_n(&mut c, n / 2, Duration::from_secs(30)).await {
        tally.received(id(&d));
        d.ack().await.unwrap();
    }
    c.close().await.unwrap();
    let first = tally.distinct_received();

    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !tally.complete() && Instant::now() < deadline {
        for d in c.receive(100, Duration::from_millis(500)).await.unwrap() {
            tally.received(id(&d));
            d.ack().await.unwrap();
        }
    }
    tally.assert_none_lost("kafka resume from committed offsets");
    println!(
        "first consumer {first}, duplicates after resume {}",
        tally.duplicates()
    );
    assert_eq!(
        tally.duplicates(),
        0,
        "everything acked was committed before the close"
    );
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_continues_across_a_broker_restart() {
    let Some((kafka, _)) = adapter(1).await else {
        return;
    };
    let Some(command) = bounce_command(Broker::Kafka) else {
        return;
    };
    let queue = unique_queue("k-bounce");
    let mut before = 0;
    for _ in 0..5 {
        let (_, msgs) = jobs(&queue, 20);
        kafka.publish(&queue, msgs).await.unwrap();
        before += 20;
    }
    assert!(bounce(&command, None).await.unwrap(), "bounce failed");

    // The test broker keeps data in memory: what was published before is gone
    // with it. What this shows is the client reconnecting and the adapter
    // recreating its topics, without a restart of the application.
    let (ids, msgs) = jobs(&queue, 50);
    let mut pending = msgs;
    let mut attempts = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        attempts += 1;
        match kafka.publish(&queue, pending).await {
            Ok(()) => break,
            Err(Error::Publish(f)) if Instant::now() < deadline => {
                pending = f.failed.into_iter().map(|f| f.message).collect();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("publishing did not recover: {e}"),
        }
    }
    println!("published {before} before the restart; 50 after it in {attempts} attempt(s)");
    let mut c = kafka
        .consumer(&queue, group(&unique_queue("g")))
        .await
        .unwrap();
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    let mut seen: HashMap<String, u32> = HashMap::new();
    for d in receive_n(&mut c, 50, Duration::from_secs(60)).await {
        *seen.entry(id(&d)).or_default() += 1;
        tally.received(id(&d));
        d.ack().await.unwrap();
    }
    tally.assert_none_lost("kafka publishes after the restart");
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_native_grpcq_publishers_are_handled() {
    use ojs_grpcq::registry::Registry;
    use ojs_grpcq::worker::{Worker, WorkerConfig};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};

    let Some((_, mut config)) = adapter(1).await else {
        return;
    };
    // grpcq's Kafka convention: the Kafka topic is the grpcq topic, the key
    // is the action, the value the binary Message, no headers.
    config.topic_template = "{queue}".into();
    config.retry_topic_template = "{queue}.ojs-retry".into();
    config.dead_topic_template = "{queue}.ojs-dead".into();
    let kafka = KafkaAdapter::connect(config.clone()).await.unwrap();
    let topic = format!("pay.Payments{}", &unique_queue("x")[2..]);
    let call = ojs_grpcq::Message {
        originator: "go-service".into(),
        topic: topic.clone(),
        action: "Charge".into(),
        payload: vec![8, 9],
        message_id: "m-native".into(),
        timestamp_ms: 1_704_067_200_000,
        metadata: Default::default(),
    };
    // Topics first (as an operator would), then a raw producer.
    kafka.depth(&topic).await.ok();
    kafka
        .consumer(&topic, group(&unique_queue("setup")))
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &config.brokers)
        .create()
        .unwrap();
    let bytes = ojs_grpcq::encode(&call);
    producer
        .send(
            FutureRecord::to(&topic).key("Charge").payload(&bytes),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();

    let handled = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let h = handled.clone();
    registry
        .on_call(&topic, "Charge", move |ctx, payload| {
            h.lock()
                .unwrap()
                .push((ctx.message_id.clone(), payload.to_vec()));
            async { Ok(()) }
        })
        .unwrap();
    let mut wc = WorkerConfig::new(&topic);
    wc.default_encoding = Some(Encoding::GrpcqProto);
    wc.consumer = group(&unique_queue("g"));
    let worker = Worker::new(Arc::new(kafka), registry, wc);
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(60);
    while stats.succeeded.load(Ordering::SeqCst) < 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert_eq!(
        handled.lock().unwrap().clone(),
        vec![("m-native".to_string(), vec![8, 9])]
    );
}

/// Records from another client whose header names are not UTF-8 (the
/// protocol allows any bytes; rdkafka's own reader panics on one) are
/// delivered with each name read as Kafka's Java client reads it (U+FFFD
/// for the invalid bytes) and each value as it was: one handed out at
/// once, one held until its `ojs-not-before` (its owned copy outlives the
/// poll). The partition goes on past them, and once acked nothing comes
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_that_are_not_utf8_are_read_and_never_stop_the_consumer() {
    use std::time::{SystemTime, UNIX_EPOCH};

    let Some((kafka, config)) = adapter(1).await else {
        return;
    };
    let queue = unique_queue("k-rawname");
    let topic = config.topic_template.replace("{queue}", &queue);
    // The topic first, as an operator would make it.
    kafka
        .consumer(&queue, group(&unique_queue("setup")))
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let due = (SystemTime::now() + Duration::from_secs(3))
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    produce_raw_header_names(
        &config.brokers,
        &topic,
        &[(b"\xff\xfename", b"v\xff"), (b"ojs-attempt", b"2")],
        b"at once",
    )
    .unwrap();
    produce_raw_header_names(
        &config.brokers,
        &topic,
        &[(b"caf\xc3", b"later"), (b"ojs-not-before", due.as_bytes())],
        b"held",
    )
    .unwrap();
    let (ids, msgs) = jobs(&queue, 1);
    kafka.publish(&queue, msgs).await.unwrap();

    let g = unique_queue("g");
    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let got = receive_n(&mut c, 3, Duration::from_secs(60)).await;
    let payloads: Vec<&[u8]> = got.iter().map(|d| &d.payload[..]).collect();
    assert_eq!(payloads.len(), 3, "{payloads:?}");
    let by_payload = |p: &[u8]| got.iter().find(|d| &d.payload[..] == p).unwrap();
    let at_once = by_payload(b"at once");
    assert_eq!(
        at_once
            .headers
            .get("\u{FFFD}\u{FFFD}name")
            .map(|v| v.as_bytes()),
        Some(&b"v\xff"[..])
    );
    assert_eq!(at_once.attempt, 2);
    let held = by_payload(b"held");
    assert_eq!(held.headers.get_str("caf\u{FFFD}"), Some("later"));
    assert!(held.headers.get("ojs-not-before").is_none());
    assert_eq!(
        payloads.last(),
        Some(&&b"held"[..]),
        "the held record comes after what was due"
    );
    let job = got.iter().find(|d| d.payload.len() > 7).unwrap();
    assert_eq!(id(job), ids[0], "the record after them is delivered");
    for d in &got {
        d.ack().await.unwrap();
    }
    c.close().await.unwrap();

    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let again = receive_n(&mut c, 1, Duration::from_secs(3)).await;
    assert!(again.is_empty(), "all three were committed");
    c.close().await.unwrap();
}

/// A record whose dead-letter copy is too large for the dead topic (the
/// reason headers push it over `max_message_bytes`) goes there without its
/// body, saying where the original is, and is settled: the partition's
/// commit point moves past it, so a restarted consumer does not replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_dead_letter_goes_without_its_body_and_never_holds_the_commit_point() {
    let Some(url) = find(Broker::Kafka).await.map(|e| e.url) else {
        return;
    };
    let mut config = test_config(&url);
    config.partitions = 1;
    config.max_message_bytes = 4096;
    let kafka = KafkaAdapter::connect(config).await.unwrap();
    let queue = unique_queue("k-dead-big");
    let g = unique_queue("g");
    let big = OutgoingMessage::new(vec![b'x'; 4000], "application/octet-stream");
    let after = OutgoingMessage::new(b"next".to_vec(), "application/octet-stream");
    kafka.publish(&queue, vec![big, after]).await.unwrap();

    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let got = receive_n(&mut c, 2, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 2);
    let reason = ojs_queue::DeadLetterReason::new("sink_rejected", "r".repeat(500));
    got[0]
        .nack(ojs_queue::Nack::DeadLetter(reason))
        .await
        .unwrap();
    got[1].ack().await.unwrap();
    c.close().await.unwrap();

    let dead_options = ConsumerOptions {
        source: ojs_queue::Source::DeadLetters,
        ..group(&unique_queue("g-dead"))
    };
    let mut dead = kafka.consumer(&queue, dead_options).await.unwrap();
    let stubs = receive_n(&mut dead, 1, Duration::from_secs(30)).await;
    assert_eq!(stubs.len(), 1, "the dead letter arrived");
    let stub = &stubs[0];
    assert!(stub.payload.is_empty());
    assert_eq!(stub.headers[ojs_queue::header::PAYLOAD_OMITTED], "4000");
    assert_eq!(stub.headers[ojs_queue::header::ERROR_TYPE], "sink_rejected");
    assert_eq!(stub.headers["ojs-source-offset"], "0");
    assert_eq!(stub.headers["ojs-source-partition"], "0");
    dead.close().await.unwrap();

    // Both offsets were committed: the group has nothing left to read.
    let mut c = kafka.consumer(&queue, group(&g)).await.unwrap();
    let replayed = receive_n(&mut c, 1, Duration::from_secs(8)).await;
    assert!(replayed.is_empty(), "{} records replayed", replayed.len());
    c.close().await.unwrap();
}

/// A reader that holds back (the daemon under backpressure) for more than
/// three times `max.poll.interval.ms`: without the adapter's keep-alive,
/// librdkafka takes the consumer out of its group (the next poll fails with
/// "maximum poll interval exceeded", the partitions are revoked and the held
/// records' acks are stale, so they come again). With it: the acks count,
/// the rest follows in order, nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_held_back_past_max_poll_interval_stays_in_its_group() {
    let Some(url) = find(Broker::Kafka).await.map(|e| e.url) else {
        return;
    };
    let mut config = test_config(&url);
    config.partitions = 1;
    config
        .librdkafka_options
        .insert("max.poll.interval.ms".into(), "3000".into());
    let kafka = KafkaAdapter::connect(config).await.unwrap();
    let queue = unique_queue("k-held");
    let (ids, msgs) = jobs(&queue, 20);
    kafka.publish(&queue, msgs).await.unwrap();
    let mut c = kafka
        .consumer(&queue, group(&unique_queue("g")))
        .await
        .unwrap();
    let mut first = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while first.len() < 5 && Instant::now() < deadline {
        first.extend(
            c.receive(5 - first.len(), Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    assert_eq!(first.len(), 5);
    // Held back for 10 s > 3 × max.poll.interval.ms.
    tokio::time::sleep(Duration::from_secs(10)).await;
    for d in &first {
        d.ack().await.unwrap();
    }
    let mut rest = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while rest.len() < 15 && Instant::now() < deadline {
        let got = c
            .receive(15, Duration::from_millis(500))
            .await
            .expect("the consumer is still in its group");
        for d in &got {
            d.ack().await.unwrap();
        }
        rest.extend(got);
    }
    // Anything coming again would show up now.
    let late = c.receive(20, Duration::from_secs(3)).await.unwrap();
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    first
        .iter()
        .chain(&rest)
        .chain(&late)
        .for_each(|d| tally.received(id(d)));
    println!(
        "kafka held back 10 s (max.poll.interval.ms 3000): sent {} received {} duplicated {} lost {}",
        tally.sent_count(),
        tally.distinct_received(),
        tally.duplicates(),
        tally.lost().len()
    );
    tally.assert_none_lost("kafka consumer held back");
    assert_eq!(tally.duplicates(), 0, "nothing delivered twice");
    let order: Vec<u64> = first.iter().chain(&rest).map(index).collect();
    assert_eq!(order, (0..20).collect::<Vec<_>>(), "in order");
    c.close().await.unwrap();
}

/// One record left unsettled while later ones are acked: the partition
/// pauses once `max_uncommitted_per_partition` offsets are tracked (memory
/// stays bounded), and resumes, skipping nothing, once the hole is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offset_tracker_is_bounded_per_partition() {
    let Some(url) = find(Broker::Kafka).await.map(|e| e.url) else {
        return;
    };
    let mut config = test_config(&url);
    config.partitions = 1;
    config.max_uncommitted_per_partition = 10;
    let kafka = KafkaAdapter::connect(config).await.unwrap();
    let queue = unique_queue("k-bound");
    let (ids, msgs) = jobs(&queue, 60);
    kafka.publish(&queue, msgs).await.unwrap();
    let mut c = kafka
        .consumer(&queue, group(&unique_queue("g")))
        .await
        .unwrap();
    let mut hole = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while hole.is_empty() && Instant::now() < deadline {
        hole = c.receive(1, Duration::from_millis(500)).await.unwrap();
    }
    assert_eq!(hole.len(), 1);
    // Everything after the hole is acked as it comes, for 4 s.
    let mut behind = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let got = c.receive(5, Duration::from_millis(300)).await.unwrap();
        for d in &got {
            d.ack().await.unwrap();
        }
        behind.extend(got);
    }
    println!(
        "kafka bound 10: {} records delivered behind an unsettled one",
        behind.len()
    );
    assert!(
        behind.len() >= 9 && behind.len() <= 10 + 5,
        "paused at the bound (10 tracked, batches of 5): {} delivered",
        behind.len()
    );
    hole[0].ack().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while 1 + behind.len() < 60 && Instant::now() < deadline {
        let got = c.receive(20, Duration::from_millis(500)).await.unwrap();
        for d in &got {
            d.ack().await.unwrap();
        }
        behind.extend(got);
    }
    let mut tally = Tally::new();
    ids.iter().for_each(|i| tally.sent(i.clone()));
    hole.iter()
        .chain(&behind)
        .for_each(|d| tally.received(id(d)));
    tally.assert_none_lost("kafka bounded tracker");
    assert_eq!(tally.duplicates(), 0);
    let order: Vec<u64> = hole.iter().chain(&behind).map(index).collect();
    assert_eq!(
        order,
        (0..60).collect::<Vec<_>>(),
        "in order, nothing skipped"
    );
    c.close().await.unwrap();
}
