//! RabbitMQ throughput: N envelopes of about 200 bytes, persistent, with
//! publisher confirms, published and then consumed with acks — once through
//! the adapter and once with raw lapin doing the same work, in the same run
//! against the same broker. Prints both rates and the ratio (target ≥ 0.9).
//!
//! "The same work": raw lapin publishes the same properties and headers
//! (the OJS binding) through the same exchange into a queue declared with
//! the same arguments, so the ratio measures the adapter, not the binding.
//!
//! `OJS_BRIDGE_TEST_AMQP_URL=amqp://… cargo bench -p ojs-adapter-rabbitmq --bench rabbit_throughput [-- N]`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use ojs_adapter_rabbitmq::{
    properties, queue_name, RabbitAdapter, RabbitConfig, DIRECT_EXCHANGE, DLX_EXCHANGE,
};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
use serde_json::json;

const WINDOW: usize = 1000;

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

async fn raw_publish(conn: &Connection, queue: &str, msgs: &[OutgoingMessage]) -> Duration {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(DLX_EXCHANGE)),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    args.insert("x-max-priority".into(), AMQPValue::ShortShortUInt(10));
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.into(),
        DIRECT_EXCHANGE.into(),
        queue.into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let started = Instant::now();
    for window in msgs.chunks(WINDOW) {
        let mut confirms = Vec::with_capacity(window.len());
        for m in window {
            let props: BasicProperties = properties(m, Some(10)).unwrap();
            confirms.push(
                ch.basic_publish(
                    DIRECT_EXCHANGE.into(),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &m.payload,
                    props,
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
    }
    started.elapsed()
}

/// `batched`: wait for one, take what else is ready (up to 100), ack them
/// one by one — the adapter's receive pattern. Otherwise: next, ack, next.
async fn raw_consume(conn: &Connection, queue: &str, n: usize, batched: bool) -> Duration {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "bench-raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut done = 0;
    while done < n {
        let mut batch = vec![consumer.next().await.unwrap().unwrap()];
        while batched && batch.len() < 100 {
            match futures::FutureExt::now_or_never(consumer.next()) {
                Some(Some(Ok(d))) => batch.push(d),
                _ => break,
            }
        }
        for d in batch {
            d.ack(BasicAckOptions::default()).await.unwrap();
            done += 1;
        }
    }
    let elapsed = started.elapsed();
    let _ = ch.close(200, "done".into()).await;
    elapsed
}

async fn adapter_publish(
    adapter: &RabbitAdapter,
    queue: &str,
    msgs: &[OutgoingMessage],
) -> Duration {
    let started = Instant::now();
    for window in msgs.chunks(WINDOW) {
        adapter.publish(queue, window.to_vec()).await.unwrap();
    }
    started.elapsed()
}

/// `concurrent_acks`: ack each received batch concurrently, as the worker does.
async fn adapter_consume(
    adapter: &RabbitAdapter,
    queue: &str,
    n: usize,
    concurrent_acks: bool,
) -> Duration {
    let mut consumer = adapter
        .consumer(queue, ConsumerOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    let mut done = 0;
    let (mut calls, mut in_ack) = (0u64, Duration::ZERO);
    while done < n {
        let batch = consumer.receive(100, Duration::from_secs(5)).await.unwrap();
        calls += 1;
        let t = Instant::now();
        done += batch.len();
        if concurrent_acks {
            for r in futures::future::join_all(batch.iter().map(|d| d.ack())).await {
                r.unwrap();
            }
        } else {
            for d in batch {
                d.ack().await.unwrap();
            }
        }
        in_ack += t.elapsed();
    }
    let elapsed = started.elapsed();
    let _ = (calls, in_ack);
    elapsed
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let url = std::env::var("OJS_BRIDGE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let suffix = std::process::id();
    let raw_a = format!("bench-raw-a-{suffix}");
    let raw_b = format!("bench-raw-b-{suffix}");
    let ojs_a = format!("bench-ojs-a-{suffix}");
    let ojs_b = format!("bench-ojs-b-{suffix}");
    let msgs = messages(n, &ojs_a);
    let size = msgs[0].payload.len();

    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let adapter = RabbitAdapter::connect(RabbitConfig::new(&url))
        .await
        .unwrap();
    // Warm up both paths (connections, declarations) outside the timings.
    raw_publish(&conn, &raw_a, &msgs[..100]).await;
    raw_consume(&conn, &raw_a, 100, false).await;
    adapter_publish(&adapter, &ojs_a, &msgs[..100]).await;
    adapter_consume(&adapter, &ojs_a, 100, false).await;

    let raw_pub = raw_publish(&conn, &raw_a, &msgs).await;
    let ojs_pub = adapter_publish(&adapter, &ojs_a, &msgs).await;
    raw_publish(&conn, &raw_b, &msgs).await;
    adapter_publish(&adapter, &ojs_b, &msgs).await;
    // Consume in an order that does not always favour one side while the
    // broker is still flushing the other's writes.
    let ojs_seq = adapter_consume(&adapter, &ojs_a, n, false).await;
    let raw_batched = raw_consume(&conn, &raw_a, n, true).await;
    let raw_stream = raw_consume(&conn, &raw_b, n, false).await;
    let ojs_conc = adapter_consume(&adapter, &ojs_b, n, true).await;

    let ratio = |raw: Duration, ojs: Duration| raw.as_secs_f64() / ojs.as_secs_f64();
    println!("rabbitmq, {n} persistent envelopes of {size} B, publisher confirms (window {WINDOW}), acks");
    println!("                                         raw lapin      adapter   ratio");
    println!(
        "publish (same properties, exchange)   {:>10.0}/s  {:>10.0}/s    {:.2}",
        rate(n, raw_pub),
        rate(n, ojs_pub),
        ratio(raw_pub, ojs_pub)
    );
    println!(
        "consume, batch then ack one by one    {:>10.0}/s  {:>10.0}/s    {:.2}",
        rate(n, raw_batched),
        rate(n, ojs_seq),
        ratio(raw_batched, ojs_seq)
    );
    println!(
        "consume, raw next+ack vs adapter batch with concurrent acks {:>8.0}/s  {:>8.0}/s    {:.2}",
        rate(n, raw_stream),
        rate(n, ojs_conc),
        ratio(raw_stream, ojs_conc)
    );
    let ch = conn.create_channel().await.unwrap();
    for q in [
        raw_a,
        raw_b,
        queue_name(&ojs_a),
        queue_name(&ojs_b),
        format!("ojs.queue.dlx.{ojs_a}"),
        format!("ojs.queue.dlx.{ojs_b}"),
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}
