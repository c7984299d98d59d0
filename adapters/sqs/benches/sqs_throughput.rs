//! SQS throughput: N envelopes (default 2,000) published and consumed with
//! deletes, once through the adapter and once with raw aws-sdk-sqs calls
//! doing the same work (SendMessageBatch of 10 with base64 bodies and the
//! same attributes; ReceiveMessage of 10; one DeleteMessage per message),
//! against the same server in one run. Against moto the server dominates;
//! the ratio shows the adapter's overhead (target ≥ 0.9).
//!
//! `OJS_BRIDGE_TEST_SQS_URL=sqs://… cargo bench -p ojs-adapter-sqs --bench sqs_throughput [-- N]`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use base64::Engine as _;
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
use serde_json::json;

fn messages(n: usize) -> Vec<OutgoingMessage> {
    (0..n)
        .map(|i| {
            let job = JobEnvelope::new("bench.item", vec![json!(i), json!("x".repeat(110))])
                .with_queue("bench");
            OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()
        })
        .collect()
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

async fn raw(
    client: &aws_sdk_sqs::Client,
    url: &str,
    msgs: &[OutgoingMessage],
) -> (Duration, Duration) {
    let started = Instant::now();
    for chunk in msgs.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut e = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(base64::engine::general_purpose::STANDARD.encode(&m.payload));
                for (k, v) in &m.headers {
                    e = e.message_attributes(
                        k.as_str(),
                        MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value(v.to_str_lossy())
                            .build()
                            .unwrap(),
                    );
                }
                e.build().unwrap()
            })
            .collect();
        let out = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(out.failed().is_empty());
    }
    let publish = started.elapsed();
    let started = Instant::now();
    let mut done = 0;
    while done < msgs.len() {
        let out = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        for m in out.messages() {
            let _body = base64::engine::general_purpose::STANDARD
                .decode(m.body().unwrap())
                .unwrap();
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(m.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
            done += 1;
        }
    }
    (publish, started.elapsed())
}

async fn adapter(a: &SqsAdapter, queue: &str, msgs: &[OutgoingMessage]) -> (Duration, Duration) {
    let started = Instant::now();
    for chunk in msgs.chunks(10) {
        a.publish(queue, chunk.to_vec()).await.unwrap();
    }
    let publish = started.elapsed();
    let mut c = a.consumer(queue, ConsumerOptions::default()).await.unwrap();
    let started = Instant::now();
    let mut done = 0;
    while done < msgs.len() {
        for d in c.receive(10, Duration::from_secs(1)).await.unwrap() {
            d.ack().await.unwrap();
            done += 1;
        }
    }
    (publish, started.elapsed())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let url = std::env::var("OJS_BRIDGE_TEST_SQS_URL")
        .unwrap_or_else(|_| "sqs://us-east-1?endpoint=http://127.0.0.1:4566".into());
    let config = SqsConfig::from_url(&url).unwrap();
    let a = SqsAdapter::connect(config.clone()).await.unwrap();
    let client = ojs_adapter_sqs::sdk_client(&config).await;
    let id = std::process::id();
    let (raw_q, ojs_q) = (format!("bench-raw-{id}"), format!("bench-ojs-{id}"));
    a.depth(&raw_q).await.unwrap(); // creates both queues the same way
    let raw_url = client
        .get_queue_url()
        .queue_name(config.queue_name(&raw_q))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned();
    let msgs = messages(n);
    let (ojs_pub, ojs_con) = adapter(&a, &ojs_q, &msgs).await;
    let (raw_pub, raw_con) = raw(&client, &raw_url, &msgs).await;
    println!(
        "sqs, {n} envelopes of {} B, batches of 10, one delete per message",
        msgs[0].payload.len()
    );
    println!("                 raw sdk      adapter   ratio");
    println!(
        "publish      {:>8.0}/s   {:>8.0}/s    {:.2}",
        rate(n, raw_pub),
        rate(n, ojs_pub),
        raw_pub.as_secs_f64() / ojs_pub.as_secs_f64()
    );
    println!(
        "consume+ack  {:>8.0}/s   {:>8.0}/s    {:.2}",
        rate(n, raw_con),
        rate(n, ojs_con),
        raw_con.as_secs_f64() / ojs_con.as_secs_f64()
    );
}
