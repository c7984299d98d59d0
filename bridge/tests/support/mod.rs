//! Helpers shared by the daemon test binaries.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_bridge::config::BridgeConfig;
use ojs_bridge::daemon::{Daemon, RunSummary};
use ojs_bridge::metrics::Metrics;
use ojs_core::{grpcq, ConsumerOptions, Delivery, QueueAdapter, Source};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A daemon running in this process.
pub struct Running {
    pub stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<RunSummary>,
    pub http: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
}

impl Running {
    /// Signals shutdown and waits for the run to return.
    pub async fn shutdown(mut self) -> RunSummary {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.unwrap()
    }
}

/// Parses `toml` and runs a daemon with `provided` adapters.
pub async fn start(toml: &str, provided: BTreeMap<String, Arc<dyn QueueAdapter>>) -> Running {
    let config = BridgeConfig::parse(toml, "test config", &[]).unwrap();
    let daemon = Daemon::start_with(config, provided).await.unwrap();
    let http = daemon.http_addr();
    let metrics = daemon.metrics();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(daemon.run(async move {
        let _ = stopped.await;
    }));
    Running {
        stop: Some(stop),
        task,
        http,
        metrics,
    }
}

/// A grpcq call with metadata, numbered.
pub fn call(i: usize, topic: &str, action: &str) -> grpcq::Message {
    let mut msg = grpcq::Message {
        originator: "test-service-pod-1".into(),
        topic: topic.into(),
        action: action.into(),
        payload: format!("request-{i}").into_bytes(),
        message_id: uuid::Uuid::new_v4().to_string(),
        timestamp_ms: 1_763_700_000_000 + i as i64,
        metadata: Default::default(),
    };
    msg.metadata.insert(
        "traceparent".into(),
        format!("00-{:032x}-{:016x}-01", i + 1, i + 1),
    );
    msg.metadata.insert("tenant".into(), "acme".into());
    msg
}

/// Receives from `queue` (or its dead letters) until `want` deliveries or
/// `idle` without one, acking each.
pub async fn collect(
    adapter: &dyn QueueAdapter,
    queue: &str,
    source: Source,
    want: usize,
    idle: Duration,
) -> Vec<Delivery> {
    let options = ConsumerOptions {
        group: format!("collect-{}", uuid::Uuid::new_v4().simple()),
        source,
        ..ConsumerOptions::default()
    };
    let mut consumer = adapter.consumer(queue, options).await.unwrap();
    let mut out = Vec::new();
    let mut last = Instant::now();
    while out.len() < want && last.elapsed() < idle {
        let batch = consumer
            .receive(500, Duration::from_millis(200))
            .await
            .unwrap();
        if !batch.is_empty() {
            last = Instant::now();
        }
        for d in batch {
            d.ack().await.unwrap();
            out.push(d);
        }
    }
    consumer.close().await.unwrap();
    out
}

/// `GET path` on the daemon's endpoint: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of a Prometheus sample line `name{labels} value`.
pub fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}
