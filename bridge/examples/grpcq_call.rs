//! An asynchronous gRPC-style call across two processes.
//!
//! Delivery semantics: at least once. The publisher returns once the broker
//! has the call; the worker acks it only after the handler succeeded, retries
//! failures with the OJS backoff, and dead-letters what keeps failing. The
//! handler must therefore be idempotent (use the message id).
//!
//! ```text
//! # terminal 1: handle calls (Ctrl-C drains in-flight work and exits)
//! cargo run -p ojs-bridge --example grpcq_call -- work local:./ojs-bridge-data
//! # terminal 2: publish one typed request
//! cargo run -p ojs-bridge --example grpcq_call -- publish local:./ojs-bridge-data 42
//! ```
//!
//! Any adapter URL works (`amqp://…`, `kafka://…`, `memory://` only within
//! one process). The request type is `google.protobuf.Timestamp`, standing in
//! for any prost message.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use ojs_bridge::endpoint;
use ojs_core::Encoding;
use ojs_grpcq::publisher::GrpcqPublisher;
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};

const QUEUE: &str = "calls";
const TOPIC: &str = "clock.ClockService";
const ACTION: &str = "SetAlarm";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, url) = match args.as_slice() {
        [mode, url, ..] => (mode.as_str(), url.as_str()),
        _ => bail!("usage: grpcq_call publish|work URL [SECONDS]"),
    };
    let adapter = endpoint::connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    match mode {
        "publish" => {
            let seconds: i64 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(60);
            let publisher = GrpcqPublisher::new(adapter.clone(), QUEUE, "example-publisher");
            let request = prost_types::Timestamp { seconds, nanos: 0 };
            let metadata = [(
                "traceparent".to_string(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
            )]
            .into();
            let id = publisher.publish(TOPIC, ACTION, &request, metadata).await?;
            adapter.close().await?;
            println!("published {TOPIC}/{ACTION} as message {id}");
        }
        "work" => {
            let mut registry = Registry::new();
            registry.on_request(
                TOPIC,
                ACTION,
                |ctx, req: prost_types::Timestamp| async move {
                    println!(
                        "{}/{} #{} (attempt {}): alarm in {} s",
                        ctx.topic, ctx.action, ctx.message_id, ctx.attempt, req.seconds
                    );
                    Ok(())
                },
            )?;
            let mut config = WorkerConfig::new(QUEUE);
            // grpcq publishers of other languages send no content type.
            config.default_encoding = Some(Encoding::GrpcqProto);
            config.shutdown_timeout = Duration::from_secs(10);
            let worker = Worker::new(Arc::clone(&adapter), registry, config);
            println!("handling {TOPIC}/{ACTION} on queue {QUEUE:?}; Ctrl-C to stop");
            let stats = worker
                .run(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await?;
            println!(
                "handled {} call(s)",
                stats.succeeded.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        other => bail!("unknown mode {other:?}: publish or work"),
    }
    Ok(())
}
