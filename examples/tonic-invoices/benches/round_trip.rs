//! Request/response round trips of one tonic service, side by side in one
//! run: over a direct HTTP/2 connection (tonic's own transport), and
//! through queues with `ojs-grpc` (a `QueueChannel` with a reply queue, a
//! worker serving the service) on the embedded broker and on RabbitMQ.
//!
//! `cargo bench -p ojs-example-invoices --bench round_trip -- [CALLS] [CONCURRENCY]`
//! (default 2000 calls, 16 at a time). RabbitMQ at `OJS_BRIDGE_TEST_AMQP_URL`
//! (default the local guest account); skipped, and said so, when absent.
//! Prints calls/s and p50/p99 latency per path, and each queue path's
//! throughput as a fraction of the direct one: a figure, not a target.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_core::Encoding;
use ojs_example_invoices::pb::CreateInvoiceRequest;
use ojs_example_invoices::{InvoiceBook, InvoicesClient, InvoicesServer};
use ojs_grpc::{QueueChannel, QueueServer, ReplyOptions};
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};
use ojs_queue::QueueAdapter;
use tonic::codegen::{Body, Bytes, StdError};

struct Figures {
    path: &'static str,
    calls_per_sec: f64,
    p50: Duration,
    p99: Duration,
}

/// Runs `calls` creates, `concurrency` at a time, after a warm-up; every
/// call must succeed.
async fn measure<T>(
    path: &'static str,
    client: InvoicesClient<T>,
    calls: usize,
    concurrency: usize,
) -> Figures
where
    T: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
    T::Future: Send,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    let request = move |i: usize| CreateInvoiceRequest {
        customer: "bench".into(),
        amount_cents: 100,
        idempotency_key: format!("{path}-{i}"),
    };
    for i in 0..100 {
        client
            .clone()
            .create(request(usize::MAX - i))
            .await
            .expect("warm-up call");
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = worker;
            while i < calls {
                let t = Instant::now();
                client.create(request(i)).await.expect("call");
                latencies.push(t.elapsed());
                i += concurrency;
            }
            latencies
        }));
    }
    let mut latencies = Vec::with_capacity(calls);
    for t in tasks {
        latencies.extend(t.await.expect("task"));
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Figures {
        path,
        calls_per_sec: calls as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

async fn direct(calls: usize, concurrency: usize) -> Figures {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(InvoicesServer::new(InvoiceBook::default()))
            .serve_with_incoming(incoming),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    measure(
        "direct HTTP/2",
        InvoicesClient::new(channel),
        calls,
        concurrency,
    )
    .await
}

async fn queued(
    path: &'static str,
    adapter: Arc<dyn QueueAdapter>,
    calls: usize,
    concurrency: usize,
) -> Figures {
    let queue = format!("bench-invoices-{}", uuid_like());
    let mut registry = Registry::new();
    QueueServer::new(adapter.clone())
        .add_service(&mut registry, InvoicesServer::new(InvoiceBook::default()))
        .unwrap();
    let mut config = WorkerConfig::new(queue.clone());
    config.default_encoding = Some(Encoding::GrpcqProto);
    config.concurrency = concurrency.max(1);
    config.batch_size = concurrency.max(1);
    config.receive_wait = Duration::from_millis(100);
    let worker = Worker::new(adapter.clone(), registry, config);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        worker
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    let channel = QueueChannel::with_replies(adapter.clone(), queue, ReplyOptions::default())
        .await
        .unwrap();
    let figures = measure(
        path,
        InvoicesClient::new(channel.clone()),
        calls,
        concurrency,
    )
    .await;
    channel.close().await.unwrap();
    let _ = stop.send(());
    let _ = served.await;
    figures
}

fn uuid_like() -> String {
    format!(
        "{:x}",
        std::process::id() as u128 * 1_000_003 + Instant::now().elapsed().as_nanos()
    )
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let calls = args.first().copied().unwrap_or(2000);
    let concurrency = args.get(1).copied().unwrap_or(16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut figures = vec![direct(calls, concurrency).await];
        let dir = std::env::temp_dir().join(format!("ojs-round-trip-{}", std::process::id()));
        let local = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        figures.push(queued("embedded broker (local:)", Arc::new(local), calls, concurrency).await);
        let _ = std::fs::remove_dir_all(&dir);
        let url = std::env::var("OJS_BRIDGE_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        match RabbitAdapter::connect(RabbitConfig::new(&url)).await {
            Ok(rabbit) => figures.push(queued("RabbitMQ", Arc::new(rabbit), calls, concurrency).await),
            Err(e) => println!("RabbitMQ: skipped ({e})"),
        }
        let direct = figures[0].calls_per_sec;
        println!("round trips: {calls} calls, {concurrency} at a time, one tonic service (InvoiceBook::create)");
        println!("{:<26} {:>10} {:>10} {:>10} {:>10}", "path", "calls/s", "p50", "p99", "vs direct");
        for f in &figures {
            println!(
                "{:<26} {:>10.0} {:>8.2}ms {:>8.2}ms {:>9.3}x",
                f.path,
                f.calls_per_sec,
                f.p50.as_secs_f64() * 1e3,
                f.p99.as_secs_f64() * 1e3,
                f.calls_per_sec / direct
            );
        }
    });
}
