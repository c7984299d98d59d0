//! OJS workflows through `ojs-bridge run` (the release binary in a process
//! of its own), on the embedded broker and on Kafka when a broker answers
//! at `OJS_BRIDGE_TEST_KAFKA_URL`:
//!
//! 1. workflows/s: chains of 3 steps are created through the API (16
//!    creators, untimed), then 16 HTTP workers (keep-alive connections)
//!    FETCH 10 at a time and ACK each until every step of every chain
//!    completed — timed from the first FETCH that got jobs to the last
//!    ACK; beside it the same number of plain jobs (3 per chain, pushed
//!    in batches) through the same workers: what the workflow costs over
//!    the jobs alone;
//! 2. step-to-step latency on an idle queue: a worker's FETCH long-polls,
//!    another ACKs a chain's first step, and the time from sending that
//!    ACK to the FETCH's answer with the next step is taken, 200 times.
//!
//! Each case ends with one JSON line: `{"bench":"api_workflow","case":…,
//! "workflows_per_s":…,"jobs_per_s":…,"plain_jobs_per_s":…,"p50_ms":…,
//! "p99_ms":…,"peak_rss_mib":…}`.
//!
//! `cargo bench -p ojs-bridge --bench api_workflow [-- CHAINS]` (default
//! 10000).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{connect, daemon, post, rss_mib, Measured};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use serde_json::{json, Value};

const WORKERS: usize = 16;
const CREATORS: usize = 16;
const FETCH: usize = 10;
const STEPS: usize = 3;

fn chain(queue: &str, n: usize) -> Value {
    let steps: Vec<Value> = (0..STEPS)
        .map(|i| json!({"type": format!("flow.step{i}"), "args": [n, i], "options": {"queue": queue}}))
        .collect();
    json!({"type": "chain", "steps": steps})
}

/// `chains` chains onto `queue`, `CREATORS` at a time.
async fn create(addr: SocketAddr, queue: &'static str, chains: usize) -> Duration {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CREATORS {
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= chains {
                    break;
                }
                let (status, body) = post(&mut sender, "/ojs/v1/workflows", chain(queue, n)).await;
                assert_eq!(status, 201, "{body}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

/// `n` plain jobs onto `queue`, 100 a request.
async fn fill(addr: SocketAddr, queue: &str, n: usize) {
    let mut sender = connect(addr).await;
    for start in (0..n).step_by(100) {
        let jobs: Vec<Value> = (start..n.min(start + 100))
            .map(|i| json!({"type": "plain.job", "args": [i], "options": {"queue": queue}}))
            .collect();
        let (status, body) = post(&mut sender, "/ojs/v1/jobs/batch", json!({ "jobs": jobs })).await;
        assert_eq!(status, 201, "{body}");
    }
}

/// 16 workers FETCH (10 at a time) and ACK each until `n` jobs were
/// completed; timed from the first FETCH that got jobs to the last ACK.
async fn work(addr: SocketAddr, queue: &'static str, n: usize) -> Duration {
    let done = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let finished = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (done, started, finished) = (done.clone(), started.clone(), finished.clone());
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let worker = format!("bench-{w}");
            let idle_since = Instant::now();
            while done.load(Ordering::Relaxed) < n {
                let (status, body) = post(
                    &mut sender,
                    "/ojs/v1/workers/fetch",
                    json!({"queues": [queue], "count": FETCH, "worker_id": worker, "wait_ms": 200}),
                )
                .await;
                assert_eq!(status, 200, "{body}");
                let jobs = body["jobs"].as_array().cloned().unwrap_or_default();
                if jobs.is_empty() {
                    assert!(
                        idle_since.elapsed() < Duration::from_secs(600),
                        "the workers starved"
                    );
                    continue;
                }
                started.lock().unwrap().get_or_insert_with(Instant::now);
                for job in &jobs {
                    let (status, body) = post(
                        &mut sender,
                        "/ojs/v1/workers/ack",
                        json!({"job_id": job["id"], "result": {"step": job["args"][1]}}),
                    )
                    .await;
                    assert_eq!(status, 200, "{body}");
                }
                if done.fetch_add(jobs.len(), Ordering::Relaxed) + jobs.len() >= n {
                    finished.lock().unwrap().get_or_insert_with(Instant::now);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let end = finished.lock().unwrap().unwrap_or_else(Instant::now);
    let began = *started.lock().unwrap();
    began.map_or(Duration::from_secs(1), |s| end.saturating_duration_since(s))
}

/// From sending the ACK of a chain's first step to the answer of a
/// waiting FETCH with its second, on an idle queue, `samples` times.
async fn step_to_step(addr: SocketAddr, samples: usize) -> Measured {
    let queue = "idle-flow";
    let mut acker = connect(addr).await;
    // Opened after the first step came (a Kafka group join can take
    // longer than the listener lets a new connection sit without a
    // request).
    let mut waiter: Option<SendRequest<Full<Bytes>>> = None;
    let mut latencies = Vec::with_capacity(samples);
    let started = Instant::now();
    for i in 0..samples {
        let (status, body) = post(&mut acker, "/ojs/v1/workflows", chain(queue, i)).await;
        assert_eq!(status, 201, "{body}");
        // The first step (the first FETCH of a Kafka queue also waits for
        // its group join).
        let first = loop {
            let (_, body) = post(
                &mut acker,
                "/ojs/v1/workers/fetch",
                json!({"queues": [queue], "count": 1, "wait_ms": 5000}),
            )
            .await;
            if let Some(job) = body["jobs"].as_array().and_then(|j| j.first()) {
                break job.clone();
            }
        };
        let mut w = match waiter.take() {
            Some(w) => w,
            None => connect(addr).await,
        };
        let fetch = tokio::spawn(async move {
            let (_, body) = post(
                &mut w,
                "/ojs/v1/workers/fetch",
                json!({"queues": [queue], "count": 1, "wait_ms": 10_000}),
            )
            .await;
            (Instant::now(), body, w)
        });
        // The FETCH is waiting before the ACK is sent.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let sent = Instant::now();
        let (status, body) = post(
            &mut acker,
            "/ojs/v1/workers/ack",
            json!({"job_id": first["id"], "result": {"n": i}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let (answered, body, w) = fetch.await.unwrap();
        waiter = Some(w);
        let next = body["jobs"][0].clone();
        assert_eq!(
            next["type"], "flow.step1",
            "the waiting FETCH got the next step: {body}"
        );
        latencies.push(answered.saturating_duration_since(sent));
        // The chain's last two steps, so the queue is idle again.
        post(
            &mut acker,
            "/ojs/v1/workers/ack",
            json!({"job_id": next["id"]}),
        )
        .await;
        let last = loop {
            let (_, body) = post(
                &mut acker,
                "/ojs/v1/workers/fetch",
                json!({"queues": [queue], "count": 1, "wait_ms": 5000}),
            )
            .await;
            if let Some(job) = body["jobs"].as_array().and_then(|j| j.first()) {
                break job.clone();
            }
        };
        post(
            &mut acker,
            "/ojs/v1/workers/ack",
            json!({"job_id": last["id"]}),
        )
        .await;
    }
    Measured::from(samples, started.elapsed(), latencies)
}

async fn case(name: &str, case: &str, config: &str, chains: usize) {
    let server = daemon(config);
    let pid = server.child.id();
    let created = create(server.addr, "flow", chains).await;
    let elapsed = work(server.addr, "flow", chains * STEPS).await;
    fill(server.addr, "plain", chains * STEPS).await;
    let plain = work(server.addr, "plain", chains * STEPS).await;
    let latency = step_to_step(server.addr, 200).await;
    let peak = rss_mib(pid, "VmHWM:");
    drop(server);
    let workflows_per_s = chains as f64 / elapsed.as_secs_f64();
    let jobs_per_s = (chains * STEPS) as f64 / elapsed.as_secs_f64();
    let plain_per_s = (chains * STEPS) as f64 / plain.as_secs_f64();
    println!("{name}:");
    println!(
        "  created {chains} chains of {STEPS} in {:.2} s ({:.0} workflows/s, {CREATORS} creators)",
        created.as_secs_f64(),
        chains as f64 / created.as_secs_f64()
    );
    println!(
        "  chains run by {WORKERS} HTTP workers: {workflows_per_s:>8.0} workflows/s  {jobs_per_s:>8.0} steps/s  ({:.2}× the same number of plain jobs: {plain_per_s:.0} jobs/s)",
        jobs_per_s / plain_per_s
    );
    println!(
        "  step → next step, idle queue, a FETCH waiting: p50 {:.2} ms, p99 {:.2} ms (200 chains)",
        latency.p50.as_secs_f64() * 1e3,
        latency.p99.as_secs_f64() * 1e3
    );
    println!("  peak RSS of the daemon {peak:.1} MiB");
    println!(
        "{}",
        json!({
            "bench": "api_workflow",
            "case": case,
            "workflows_per_s": workflows_per_s.round(),
            "jobs_per_s": jobs_per_s.round(),
            "plain_jobs_per_s": plain_per_s.round(),
            "p50_ms": (latency.p50.as_secs_f64() * 1e5).round() / 100.0,
            "p99_ms": (latency.p99.as_secs_f64() * 1e5).round() / 100.0,
            "peak_rss_mib": (peak * 10.0).round() / 10.0,
        })
    );
}

fn main() {
    let chains = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        println!("OJS workflows: {chains} chains of {STEPS} steps, {WORKERS} workers fetching {FETCH} at a time");
        if !common::runs("embedded") {
            println!("embedded broker: skipped (OJS_API_BENCH_ONLY)");
        } else {
            case(
                "embedded broker (local:)",
                "embedded",
                "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n",
                chains,
            )
            .await;
        }
        let kafka = std::env::var("OJS_BRIDGE_TEST_KAFKA_URL")
            .unwrap_or_else(|_| "kafka://127.0.0.1:9092".into());
        if !common::runs("kafka") {
            println!("Kafka: skipped (OJS_API_BENCH_ONLY)");
        } else if ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::Kafka)
            .await
            .is_some()
        {
            let topic = format!("bench-flow-{}-{{queue}}", uuid::Uuid::new_v4().simple());
            let config = format!(
                "[adapters.kafka]\nurl = \"{kafka}\"\ntopic_template = \"{topic}\"\npartitions = 4\n[api]\nadapter = \"kafka\"\n"
            );
            case("Kafka (4 partitions)", "kafka", &config, chains).await;
        } else {
            println!("Kafka: no broker at {kafka}; skipped");
        }
    });
}
