//! Kafka throughput: N envelopes of about 200 bytes produced and then
//! consumed, once through the adapter and once with raw rdkafka
//! (FutureProducer / StreamConsumer) doing the same work — same producer
//! settings (idempotent, acks=all), same headers and keys, every delivery
//! report awaited; on the consumer side the body copied, the headers read
//! into a map, offsets committed — in one run against the same broker.
//! Prints both rates and the ratio (target ≥ 0.9).
//!
//! Raw and adapter run in alternation for several rounds and the medians are
//! compared: on a small machine that shares its cores with the broker, one
//! round of either side varies by ±20 %, more than the difference measured.
//! Consumer rounds reread the topic with a fresh group each: once the first
//! N records (mostly prefetched: client cost per record), once all rounds × N
//! (the broker's fetch rate counts too).
//!
//! `OJS_BRIDGE_TEST_KAFKA_URL=kafka://… cargo bench -p ojs-adapter-kafka --bench kafka_throughput [-- N [ROUNDS]]`

#![allow(clippy::unwrap_used, clippy::expect_used)]

// The allocator the ojs-bridge binary ships with; raw and adapter share it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::json;

const BATCH: usize = 1000;
/// Same session timeout for both consumers.
const SESSION_TIMEOUT_MS: &str = "6000";

fn messages(n: usize, queue: &str) -> Vec<OutgoingMessage> {
    (0..n)
        .map(|i| {
            let job = JobEnvelope::new("bench.item", vec![json!(i), json!("x".repeat(110))])
                .with_queue(queue);
            OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()
        })
        .collect()
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// The adapter's producer settings.
fn raw_producer(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .unwrap()
}

async fn raw_produce(producer: &FutureProducer, topic: &str, msgs: &[OutgoingMessage]) -> Duration {
    let started = Instant::now();
    for chunk in msgs.chunks(BATCH) {
        let sends = chunk.iter().map(|m| {
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let record = FutureRecord::to(topic)
                .payload(m.payload.as_ref())
                .key(m.key.as_deref().unwrap_or_default())
                .headers(headers);
            producer.send(record, Duration::from_secs(30))
        });
        for r in futures::future::join_all(sends).await {
            r.unwrap();
        }
    }
    started.elapsed()
}

/// Steady-state consumption: the clock starts at the first record, so the
/// group join (which this test broker holds for half the session timeout)
/// is not counted on either side.
async fn raw_consume(brokers: &str, topic: &str, n: usize, group: &str) -> Duration {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("bench-raw-{}-{group}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", SESSION_TIMEOUT_MS)
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let first = consumer.recv().await.unwrap().detach();
    let started = Instant::now();
    let mut last = first;
    for i in 1..n {
        let m = consumer.recv().await.unwrap();
        // What any consumer of the binding does: copy the body, read the
        // headers it routes on (content-type, ojs-*), into a map.
        let _payload = bytes::Bytes::copy_from_slice(m.payload().unwrap_or_default());
        let mut headers = std::collections::BTreeMap::new();
        if let Some(h) = m.headers() {
            use rdkafka::message::Headers as _;
            for i in 0..h.count() {
                let hdr = h.get(i);
                if let Some(v) = hdr.value {
                    headers.insert(hdr.key.to_owned(), String::from_utf8_lossy(v).into_owned());
                }
            }
        }
        std::hint::black_box(&headers);
        // Commit as the adapter does (it commits in the background every 200 ms).
        if i % 2000 == 0 || i == n - 1 {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(m.topic(), m.partition(), Offset::Offset(m.offset() + 1))
                .unwrap();
            consumer.commit(&tpl, CommitMode::Async).unwrap();
        }
        last = m.detach();
    }
    let elapsed = started.elapsed();
    let _ = last;
    elapsed
}

async fn adapter_publish(
    adapter: &KafkaAdapter,
    queue: &str,
    msgs: &[OutgoingMessage],
) -> Duration {
    // `publish` takes its batch by value: the copies are made before the
    // clock runs, as the raw side borrows the same messages.
    let batches: Vec<Vec<OutgoingMessage>> = msgs.chunks(BATCH).map(<[_]>::to_vec).collect();
    let started = Instant::now();
    for batch in batches {
        adapter.publish(queue, batch).await.unwrap();
    }
    started.elapsed()
}

async fn adapter_consume(adapter: &KafkaAdapter, queue: &str, n: usize, group: &str) -> Duration {
    let options = ConsumerOptions {
        group: format!("bench-ojs-{}-{group}", std::process::id()),
        ..Default::default()
    };
    let mut consumer = adapter.consumer(queue, options).await.unwrap();
    let mut first = consumer.receive(1, Duration::from_secs(60)).await.unwrap();
    first.pop().unwrap().ack().await.unwrap();
    let started = Instant::now();
    let mut done = 1;
    while done < n {
        for d in consumer.receive(500, Duration::from_secs(5)).await.unwrap() {
            d.ack().await.unwrap();
            done += 1;
        }
    }
    let elapsed = started.elapsed();
    consumer.close().await.unwrap();
    elapsed
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn rates(n: usize, ds: &[Duration]) -> String {
    ds.iter()
        .map(|d| format!("{:.0}k", rate(n, *d) / 1000.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line of the table: median rates of both sides and their ratio.
fn report(what: &str, n: usize, raw: &[Duration], ojs: &[Duration]) {
    let raw_rate = median(raw.iter().map(|d| rate(n, *d)).collect());
    let ojs_rate = median(ojs.iter().map(|d| rate(n, *d)).collect());
    println!(
        "{what:<24} {raw_rate:>10.0}/s  {ojs_rate:>10.0}/s    {:.2}",
        ojs_rate / raw_rate
    );
    println!(
        "    rounds: raw [{}]  adapter [{}]",
        rates(n, raw),
        rates(n, ojs)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse::<usize>().ok());
    let n = args.next().unwrap_or(100_000);
    let rounds = args.next().unwrap_or(5).max(1);
    let url = std::env::var("OJS_BRIDGE_TEST_KAFKA_URL")
        .unwrap_or_else(|_| "kafka://127.0.0.1:9092".into());
    let mut config = KafkaConfig::from_url(&url).unwrap();
    config.partitions = 1;
    config.session_timeout_ms = SESSION_TIMEOUT_MS.parse().unwrap();
    let adapter = KafkaAdapter::connect(config.clone()).await.unwrap();
    let id = std::process::id();
    let raw_queue = format!("bench-raw-{id}");
    let ojs_queue = format!("bench-ojs-{id}");
    // The adapter creates both queues' topics (1 partition each) so the raw
    // client writes to an identical topic.
    adapter
        .consumer(&raw_queue, ConsumerOptions::default())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let msgs = messages(n, &ojs_queue);
    let size = msgs[0].payload.len();
    let raw_topic = config.topic_of(&raw_queue);

    // One producer per side for the whole run, as an application keeps one.
    // Each sends one record first, so connecting and getting an idempotent
    // producer id happen before the clock runs.
    let producer = raw_producer(&config.brokers);
    raw_produce(&producer, &raw_topic, &msgs[..1]).await;
    adapter_publish(&adapter, &ojs_queue, &msgs[..1]).await;
    let (mut raw_pub, mut ojs_pub) = (vec![], vec![]);
    for _ in 0..rounds {
        raw_pub.push(raw_produce(&producer, &raw_topic, &msgs).await);
        ojs_pub.push(adapter_publish(&adapter, &ojs_queue, &msgs).await);
    }
    // Two consumer measurements, each with a fresh group per round:
    // the first n records, which librdkafka has mostly prefetched while the
    // group was joining (client CPU per record: the adapter's own cost
    // shows most), and every record produced, rounds × n (the broker's
    // fetch rate shows too).
    let total = rounds * n;
    let mut consumed = Vec::new();
    for count in [n, total] {
        let (mut raw_con, mut ojs_con) = (vec![], vec![]);
        for round in 0..rounds {
            let group = format!("{count}-{round}");
            ojs_con.push(adapter_consume(&adapter, &ojs_queue, count, &group).await);
            raw_con.push(raw_consume(&config.brokers, &raw_topic, count, &group).await);
        }
        consumed.push((count, raw_con, ojs_con));
    }

    println!(
        "kafka, {n} envelopes of {size} B, idempotent producer, acks=all, 1 partition, \
         median of {rounds} alternating rounds"
    );
    println!("                         raw rdkafka      adapter   ratio");
    report(
        &format!("produce (batches of {BATCH})"),
        n,
        &raw_pub,
        &ojs_pub,
    );
    for (count, raw_con, ojs_con) in &consumed {
        report(
            &format!("consume {count} (after join)"),
            *count,
            raw_con,
            ojs_con,
        );
    }
}
