//! Embedded broker throughput: 100,000 envelopes of about 200 bytes published
//! singly and in batches, then consumed with acks. Prints rates; asserts none.
//!
//! Targets on the 2-core reference machine: ≥ 20,000 msg/s published in
//! batches, ≥ 10,000 msg/s consumed with acks.
//!
//! `cargo bench -p ojs-adapter-local --bench local_throughput [-- N]`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
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

/// Receives batches of 100; acks each batch concurrently (as a worker pool
/// does) or one by one.
async fn consume_all(adapter: &LocalAdapter, n: usize, concurrent_acks: bool) -> Duration {
    let mut consumer = adapter
        .consumer("bench", ConsumerOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    let mut done = 0;
    let mut in_receive = Duration::ZERO;
    while done < n {
        let t = Instant::now();
        let batch = consumer.receive(100, Duration::from_secs(1)).await.unwrap();
        in_receive += t.elapsed();
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
    }
    println!("  (of which receiving: {in_receive:.2?})");
    started.elapsed()
}

/// Moves `n` messages from `bench` to `moved` in batches of 512, each copied
/// as it is: through a consumer, a publish and an ack (as the daemon's
/// pipeline does), or in one transaction a batch (`MoveWithin`).
async fn move_all(adapter: &LocalAdapter, n: usize, within: bool) -> Duration {
    use ojs_queue::{Delivery, MoveTo};
    let started = Instant::now();
    let mut done = 0;
    if within {
        let mover = adapter.mover().unwrap();
        while done < n {
            let moved = mover
                .move_within(
                    "bench",
                    512,
                    Duration::from_secs(1),
                    Box::new(|deliveries: &[Delivery]| {
                        deliveries
                            .iter()
                            .map(|d| MoveTo::Queue {
                                queue: "moved".into(),
                                message: d.to_outgoing(),
                            })
                            .collect()
                    }),
                )
                .await
                .unwrap();
            done += moved.len();
        }
    } else {
        let mut consumer = adapter
            .consumer("bench", ConsumerOptions::default())
            .await
            .unwrap();
        while done < n {
            let batch = consumer.receive(512, Duration::from_secs(1)).await.unwrap();
            let copies: Vec<OutgoingMessage> = batch.iter().map(Delivery::to_outgoing).collect();
            adapter.publish("moved", copies).await.unwrap();
            let refs: Vec<&Delivery> = batch.iter().collect();
            for r in Delivery::ack_all(&refs).await {
                r.unwrap();
            }
            done += batch.len();
        }
    }
    started.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = std::env::temp_dir().join(format!("ojs-local-bench-{}", std::process::id()));
    let adapter = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
    let msgs = messages(n);
    let size = msgs[0].payload.len();

    let started = Instant::now();
    for chunk in msgs.chunks(100) {
        adapter.publish("bench", chunk.to_vec()).await.unwrap();
    }
    let batched = started.elapsed();
    let consumed = consume_all(&adapter, n, true).await;

    let single_n = n / 10;
    let started = Instant::now();
    for m in &msgs[..single_n] {
        adapter.publish("bench", vec![m.clone()]).await.unwrap();
    }
    let single = started.elapsed();
    let sequential = consume_all(&adapter, single_n, false).await;

    println!("local broker, {n} envelopes of {size} B (durability: process)");
    println!(
        "  publish batched (100/commit) {:>10.0} msg/s  ({batched:.2?})",
        rate(n, batched)
    );
    println!(
        "  publish single ({single_n})       {:>10.0} msg/s  ({single:.2?})",
        rate(single_n, single)
    );
    println!(
        "  consume + concurrent acks    {:>10.0} msg/s  ({consumed:.2?})",
        rate(n, consumed)
    );
    println!(
        "  consume + one ack at a time  {:>10.0} msg/s  ({sequential:.2?}, {single_n} msgs)",
        rate(single_n, sequential)
    );
    for within in [false, true, false, true] {
        for chunk in msgs.chunks(512) {
            adapter.publish("bench", chunk.to_vec()).await.unwrap();
        }
        let moved = move_all(&adapter, n, within).await;
        println!(
            "  move to another queue, {:<28} {:>10.0} msg/s  ({moved:.2?})",
            if within {
                "one transaction a batch"
            } else {
                "consume + publish + ack"
            },
            rate(n, moved)
        );
    }
    drop(adapter);
    std::fs::remove_dir_all(dir).ok();
}
