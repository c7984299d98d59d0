//! The OJS HTTP API's PUSH, every case in one run, against what it is built
//! from:
//!
//! 1. single-job PUSH (`POST /ojs/v1/jobs`, JSON) over 64 keep-alive
//!    connections into `ojs-bridge run` (the release binary, a process of
//!    its own) on the embedded broker, beside the same jobs published
//!    straight through the embedded adapter by 64 concurrent tasks (one job
//!    per publish), and beside a hello-world endpoint of the same HTTP
//!    stack (hyper-util's auto builder, HTTP/1.1 keep-alive, a process of
//!    its own answering 201 with a small JSON body);
//! 2. batch PUSH (`POST /ojs/v1/jobs/batch`, 100 jobs a request, 64
//!    connections) beside the adapter's batched publish (100 jobs a call,
//!    64 tasks);
//! 3. the same two on Kafka (`[api] adapter` = a Kafka adapter; the
//!    adapter-alone side is the Kafka adapter in this process), when a
//!    broker answers at `OJS_BRIDGE_TEST_KAFKA_URL`;
//! 4. the daemon's resident memory with 1,000 open keep-alive connections
//!    (each has made one request);
//! 5. on each backend, the same jobs through the OJS gRPC binding on the
//!    same port: `Enqueue` (one job a call) and `EnqueueBatch` (100 a
//!    call), 64 concurrent calls over 4 HTTP/2 connections.
//!
//! Each line prints jobs/s, p50 and p99 of one request (or one publish
//! call), and the ratio to the adapter alone. The load generator runs in
//! this process on the same two cores as the daemon: it costs the same for
//! the daemon and the hello-world endpoint, and nothing for the adapter
//! alone, which therefore has an edge.
//!
//! `cargo bench -p ojs-bridge --bench api_push [-- SINGLE_N [BATCH_REQUESTS [ROUNDS]]]`
//! (default 40000 single pushes, 1000 batch requests = 100,000 jobs,
//! 3 rounds, median printed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{
    callgrind_available, daemon, daemon_under_callgrind, hello, line, local_adapter, median,
    median_per_job, rss_mib, serve_hello, work_line, Instructions, Measured, Work,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{OutgoingMessage, QueueAdapter};
use serde_json::json;

const CONNECTIONS: usize = 64;
const BATCH: usize = 100;

fn single_body(i: usize) -> Bytes {
    Bytes::from(
        json!({"type": "email.send", "args": ["user@example.com", i], "options": {"queue": "bench"}})
            .to_string(),
    )
}

fn batch_body(i: usize) -> Bytes {
    let jobs: Vec<_> = (0..BATCH)
        .map(|j| json!({"type": "email.send", "args": ["user@example.com", i * BATCH + j], "options": {"queue": "bench"}}))
        .collect();
    Bytes::from(json!({ "jobs": jobs }).to_string())
}

/// `requests` POSTs of `body(i)` to `path`, spread over `CONNECTIONS`
/// keep-alive connections; every answer must be 201.
async fn http_load(
    addr: SocketAddr,
    path: &'static str,
    requests: usize,
    jobs_per_request: usize,
    body: fn(usize) -> Bytes,
) -> Measured {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                let request = hyper::Request::post(path)
                    .header("host", "bench")
                    .header("content-type", "application/openjobspec+json")
                    .body(Full::new(body(i)))
                    .unwrap();
                let t = Instant::now();
                sender.ready().await.unwrap();
                let response = sender.send_request(request).await.unwrap();
                let status = response.status();
                let answer = response.into_body().collect().await.unwrap().to_bytes();
                latencies.push(t.elapsed());
                assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    Measured::from(requests * jobs_per_request, started.elapsed(), latencies)
}

/// HTTP/2 connections the gRPC load multiplexes its calls over.
const GRPC_CONNECTIONS: usize = 4;

/// `calls` gRPC calls of `per_call` jobs (`Enqueue` for one, else
/// `EnqueueBatch`), `CONNECTIONS` at a time over `GRPC_CONNECTIONS`
/// HTTP/2 connections; every call must succeed.
async fn grpc_load(addr: SocketAddr, calls: usize, per_call: usize) -> Measured {
    use ojs_api::grpc::convert::json_to_value;
    use ojs_api::grpc::pb;
    let channels = common::grpc_channels(addr, GRPC_CONNECTIONS).await;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..CONNECTIONS {
        let next = next.clone();
        let mut client =
            pb::ojs_service_client::OjsServiceClient::new(channels[t % GRPC_CONNECTIONS].clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let options = || {
                Some(pb::EnqueueOptions {
                    queue: "bench".into(),
                    ..Default::default()
                })
            };
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    break;
                }
                let args = |n: usize| {
                    vec![
                        json_to_value(&json!("user@example.com")),
                        json_to_value(&json!(n)),
                    ]
                };
                let t = Instant::now();
                if per_call == 1 {
                    client
                        .enqueue(pb::EnqueueRequest {
                            r#type: "email.send".into(),
                            args: args(i),
                            options: options(),
                        })
                        .await
                        .unwrap();
                } else {
                    let jobs = (0..per_call)
                        .map(|j| pb::BatchJobEntry {
                            r#type: "email.send".into(),
                            args: args(i * per_call + j),
                            options: None,
                        })
                        .collect();
                    client
                        .enqueue_batch(pb::EnqueueBatchRequest {
                            jobs,
                            default_options: options(),
                        })
                        .await
                        .unwrap();
                }
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    Measured::from(calls * per_call, started.elapsed(), latencies)
}

/// The same jobs as `calls` publish calls of `per_call` jobs from
/// `CONNECTIONS` tasks, straight through `adapter`.
async fn adapter_load(adapter: Arc<dyn QueueAdapter>, calls: usize, per_call: usize) -> Measured {
    adapter.prepare("bench").await.unwrap();
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let (next, adapter) = (next.clone(), adapter.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    break;
                }
                let t = Instant::now();
                // Built per call, as the API builds each job from its body.
                let messages = (0..per_call)
                    .map(|j| {
                        let mut e = JobEnvelope::new(
                            "email.send",
                            vec![json!("user@example.com"), json!(i * per_call + j)],
                        );
                        e.queue = "bench".into();
                        OutgoingMessage::from_envelope(&e, Encoding::OjsProto).unwrap()
                    })
                    .collect();
                adapter.publish("bench", messages).await.unwrap();
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    Measured::from(calls * per_call, started.elapsed(), latencies)
}

/// `n` single PUSHes over the bench's 64 connections.
async fn single_pushes(addr: SocketAddr, n: usize) -> Measured {
    http_load(addr, "/ojs/v1/jobs", n, 1, single_body).await
}

/// `batches` batch PUSHes of [`BATCH`] jobs over the bench's 64
/// connections.
async fn batch_pushes(addr: SocketAddr, batches: usize) -> Measured {
    http_load(addr, "/ojs/v1/jobs/batch", batches, BATCH, batch_body).await
}

/// One backend: daemon single and batch PUSH, adapter single and batched
/// publish, in `rounds` alternating rounds; medians printed.
/// `(name, case)`: the heading printed, and the case of the JSON lines.
async fn backend(
    (name, case): (&str, &str),
    config: &str,
    adapter: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Arc<dyn QueueAdapter>>>>,
    single: usize,
    batches: usize,
    rounds: usize,
    hello_single: Option<&Measured>,
) {
    let (mut push, mut push_batch, mut raw, mut raw_batch) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut enqueue, mut enqueue_batch) = (Vec::new(), Vec::new());
    let mut peak_rss = 0.0f64;
    let (mut work_single, mut work_batch) = (Vec::new(), Vec::new());
    let (mut adapter_work_single, mut adapter_work_batch) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let server = daemon(config);
        // Untimed: topics and queues exist, connections are up.
        single_pushes(server.addr, 256).await;
        let work = Work::count(server.child.id());
        push.push(single_pushes(server.addr, single).await);
        work_single.push(work.stop().per_job(single));
        let work = Work::count(server.child.id());
        push_batch.push(batch_pushes(server.addr, batches).await);
        work_batch.push(work.stop().per_job(batches * BATCH));
        grpc_load(server.addr, 256, 1).await;
        enqueue.push(grpc_load(server.addr, single, 1).await);
        enqueue_batch.push(grpc_load(server.addr, batches, BATCH).await);
        peak_rss = peak_rss.max(rss_mib(server.child.id(), "VmHWM:"));
        drop(server);
        let a = adapter().await;
        adapter_load(a.clone(), 256, 1).await;
        // This process alone runs the adapter side: its CPU is the
        // adapter's work (building the jobs, the client library's threads),
        // counted as the daemon's is (an embedded broker in both, Kafka in
        // neither).
        let work = Work::count(std::process::id());
        raw.push(adapter_load(a.clone(), single, 1).await);
        adapter_work_single.push(work.stop().per_job(single));
        let work = Work::count(std::process::id());
        raw_batch.push(adapter_load(a.clone(), batches, BATCH).await);
        adapter_work_batch.push(work.stop().per_job(batches * BATCH));
        a.close().await.unwrap();
    }
    let (push, push_batch, raw, raw_batch) = (
        median(push),
        median(push_batch),
        median(raw),
        median(raw_batch),
    );
    let (enqueue, enqueue_batch) = (median(enqueue), median(enqueue_batch));
    println!("{name}:");
    line("single PUSH, 64 keep-alive connections", &push, Some(&raw));
    line("adapter publish, 1 job a call, 64 tasks", &raw, None);
    if let Some(h) = hello_single {
        println!(
            "  (single PUSH = {:.2}× the hello-world endpoint of the same stack)",
            push.jobs_per_s / h.jobs_per_s
        );
    }
    line(
        "batch PUSH, 100 jobs a request, 64 conns",
        &push_batch,
        Some(&raw_batch),
    );
    line(
        "adapter publish, 100 jobs a call, 64 tasks",
        &raw_batch,
        None,
    );
    line(
        "gRPC Enqueue, 64 calls on 4 HTTP/2 conns",
        &enqueue,
        Some(&raw),
    );
    println!(
        "  (gRPC Enqueue = {:.2}× single PUSH over HTTP/1.1 keep-alive)",
        enqueue.jobs_per_s / push.jobs_per_s
    );
    line(
        "gRPC EnqueueBatch, 100 jobs a call",
        &enqueue_batch,
        Some(&raw_batch),
    );
    println!("  daemon peak RSS {peak_rss:.1} MiB");
    let (mut work_single, mut work_batch) =
        (median_per_job(&work_single), median_per_job(&work_batch));
    if work_single.0.is_none() && callgrind_available() {
        let (single, batch) = instructions_under_callgrind(config, single.min(COUNTED_JOBS)).await;
        (work_single.0, work_batch.0) = (Some(single), Some(batch));
    }
    work_line("single PUSH", work_single);
    work_line("batch PUSH", work_batch);
    let adapter_cpu_single = median_per_job(&adapter_work_single).1;
    let adapter_cpu_batch = median_per_job(&adapter_work_batch).1;
    for (what, cpu) in [
        ("1 job a call", adapter_cpu_single),
        ("100 jobs a call", adapter_cpu_batch),
    ] {
        if let Some(cpu) = cpu {
            println!("  adapter alone, {what}: this process per job {cpu:.1} µs CPU");
        }
    }
    for (kind, api, adapter, work, adapter_cpu) in [
        ("single", &push, &raw, work_single, adapter_cpu_single),
        (
            "batch",
            &push_batch,
            &raw_batch,
            work_batch,
            adapter_cpu_batch,
        ),
    ] {
        println!(
            "{}",
            json!({"bench": "api_push", "case": format!("{case} {kind}"),
                   "jobs_per_s": api.jobs_per_s, "adapter_jobs_per_s": adapter.jobs_per_s,
                   "p50_ms": api.p50.as_secs_f64() * 1e3, "p99_ms": api.p99.as_secs_f64() * 1e3,
                   "peak_rss_mib": peak_rss, "instructions_per_job": work.0,
                   "cpu_us_per_job": work.1, "adapter_cpu_us_per_job": adapter_cpu})
        );
    }
}

/// Jobs each PUSH kind of the round under callgrind sends: enough that
/// the daemon's per-job work dwarfs its setup, few enough for minutes.
const COUNTED_JOBS: usize = 2_000;

/// Instructions per job of single and of batch PUSH, the daemon under
/// callgrind (see `common::Instructions`): a round of its own, since it
/// runs far slower.
async fn instructions_under_callgrind(config: &str, jobs: usize) -> (f64, f64) {
    let server = daemon_under_callgrind(config);
    let pid = server.child.id();
    single_pushes(server.addr, 256).await;
    let counting = Instructions::count(pid);
    single_pushes(server.addr, jobs).await;
    let single = counting.stop() as f64 / jobs as f64;
    let batches = jobs.div_ceil(BATCH);
    let counting = Instructions::count(pid);
    batch_pushes(server.addr, batches).await;
    let batch = counting.stop() as f64 / (batches * BATCH) as f64;
    println!("  instructions counted by callgrind: the daemon under valgrind, {jobs} jobs each");
    (single, batch)
}

/// Resident memory of the daemon before and with 1,000 keep-alive
/// connections open, each after one request.
async fn rss_with_1000_connections() {
    let server = daemon(
        "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[http]\nmax_connections = 2000\nidle_timeout = \"5m\"\n[api]\nadapter = \"local\"\n",
    );
    let pid = server.child.id();
    // Warm: the store and the runtime's threads exist.
    http_load(server.addr, "/ojs/v1/jobs", 1000, 1, single_body).await;
    let before = rss_mib(pid, "VmRSS:");
    let mut held = Vec::new();
    for _ in 0..1000 {
        let stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let r = sender
            .send_request(
                hyper::Request::get("/ojs/manifest")
                    .header("host", "bench")
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.into_body().collect().await.unwrap();
        held.push(sender);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (with, peak) = (rss_mib(pid, "VmRSS:"), rss_mib(pid, "VmHWM:"));
    println!(
        "memory: daemon RSS {before:.1} MiB after 1,000 PUSHes; {with:.1} MiB with 1,000 open keep-alive connections ({:.1} KiB each); peak {peak:.1} MiB",
        (with - before) * 1024.0 / 1000.0
    );
    drop(held);
}

fn main() {
    if std::env::var_os("OJS_API_BENCH_HELLO").is_some() {
        serve_hello();
        return;
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let single = args.first().copied().unwrap_or(40_000);
    let batches = args.get(1).copied().unwrap_or(1_000);
    let rounds = args.get(2).copied().unwrap_or(3).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        println!(
            "OJS API PUSH: {single} single pushes, {batches} batches of {BATCH}, {CONNECTIONS} connections, median of {rounds} rounds"
        );
        let embedded = common::runs("embedded");
        let mut hellos = Vec::new();
        for _ in 0..if embedded { rounds } else { 0 } {
            let h = hello();
            hellos.push(http_load(h.addr, "/ojs/v1/jobs", single, 1, single_body).await);
        }
        if embedded {
        let hello_single = median(hellos);
        line("hello-world endpoint, same HTTP stack", &hello_single, None);

        backend(
            (
                "embedded broker (local:, durable: every PUSH a store commit and a broker commit)",
                "embedded",
            ),
            "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n",
            || Box::pin(local_adapter()),
            single,
            batches,
            rounds,
            Some(&hello_single),
        )
        .await;
        }

        let kafka = std::env::var("OJS_BRIDGE_TEST_KAFKA_URL")
            .unwrap_or_else(|_| "kafka://127.0.0.1:9092".into());
        let reachable = ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::Kafka)
            .await
            .is_some();
        if !common::runs("kafka") {
            println!("Kafka: skipped (OJS_API_BENCH_ONLY)");
        } else if reachable {
            let topic = format!("bench-{}-{{queue}}", uuid::Uuid::new_v4().simple());
            let config = format!(
                "[adapters.kafka]\nurl = \"{kafka}\"\ntopic_template = \"{topic}\"\npartitions = 1\n[api]\nadapter = \"kafka\"\n"
            );
            let url = format!(
                "{kafka}{}topic_template={topic}&partitions=1",
                if kafka.contains('?') { '&' } else { '?' }
            );
            backend(
                (
                    "Kafka (tansu on this machine; 201 after the delivery report)",
                    "kafka",
                ),
                &config,
                move || {
                    let url = url.clone();
                    Box::pin(async move {
                        let a = ojs_adapter_kafka::KafkaAdapter::connect(
                            ojs_adapter_kafka::KafkaConfig::from_url(&url).unwrap(),
                        )
                        .await
                        .unwrap();
                        Arc::new(a) as Arc<dyn QueueAdapter>
                    })
                },
                single / 4,
                batches / 4,
                rounds,
                None,
            )
            .await;
        } else {
            println!("Kafka: no broker at {kafka}; case skipped");
        }
        rss_with_1000_connections().await;
    });
    common::remove_adapter_dirs();
}
