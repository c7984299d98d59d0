//! The OJS API's worker side, every case in one run, against the adapter it
//! works over:
//!
//! 1. jobs/s through FETCH → ACK: 16 HTTP workers (keep-alive connections
//!    into `ojs-bridge run`, the release binary in a process of its own),
//!    each fetching 10 jobs at a time and acking each, until the queue is
//!    empty (each worker reads an answer into its own types, as a worker
//!    that declares the fields it uses does: the jobs' ids and arguments,
//!    the ACK's state) — beside the same jobs received (10 at a time) and acked
//!    straight through the adapter by one consumer in this process (the
//!    API holds one per queue), timed from its first batch;
//!    and the same through the OJS gRPC binding on the same port (16
//!    workers calling `Fetch` for 10 and `Ack` for each, over 4 HTTP/2
//!    connections);
//! 2. the latency from PUSH to FETCH on an idle queue: a worker's FETCH
//!    long-polls (`wait_ms`), a job is pushed, and the time from sending
//!    the PUSH to the FETCH's answer is taken, 200 times (p50/p99);
//!
//! on the embedded broker, and on Kafka when a broker answers at
//! `OJS_BRIDGE_TEST_KAFKA_URL` (and, asked by `OJS_API_BENCH_ONLY=memory`
//! alone, on the daemon's in-process memory broker). The jobs are pushed
//! before each timed run (untimed). The load generator shares the
//! machine's cores with the daemon; the adapter alone runs in this process.
//!
//! `cargo bench -p ojs-bridge --bench api_work [-- JOBS [ROUNDS]]`
//! (default 20000 jobs, 3 rounds, median printed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{
    callgrind_available, connect, daemon, daemon_under_callgrind, hello, line, local_adapter,
    median, median_per_job, post, post_text, rss_mib, serve_hello, work_line, Instructions,
    Measured, Work,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
use serde_json::{json, Value};

const WORKERS: usize = 16;
const FETCH: usize = 10;
const QUEUE: &str = "work";

/// `n` jobs onto the queue through the API, 100 a request (untimed).
async fn fill(addr: SocketAddr, queue: &str, n: usize) {
    let mut sender = connect(addr).await;
    for start in (0..n).step_by(100) {
        let jobs: Vec<Value> = (start..n.min(start + 100))
            .map(|i| json!({"type": "email.send", "args": ["user@example.com", i], "options": {"queue": queue}}))
            .collect();
        let (status, body) = post(&mut sender, "/ojs/v1/jobs/batch", json!({ "jobs": jobs })).await;
        assert_eq!(status, 201, "{body}");
    }
}

/// What a worker reads of a FETCH's answer: each job's id and arguments
/// (the rest of each job is skipped, as a worker that declares the fields
/// it uses reads it).
#[derive(serde::Deserialize)]
struct Fetched {
    jobs: Vec<FetchedJob>,
}

#[derive(serde::Deserialize)]
struct FetchedJob {
    id: String,
    args: Vec<Value>,
}

/// What a worker reads of an ACK's answer.
#[derive(serde::Deserialize)]
struct Acked {
    state: String,
}

/// 16 HTTP workers FETCH (10 at a time) and ACK until `n` jobs are done;
/// timed from the answer of the first FETCH that got jobs (a Kafka group
/// join is not the rate).
async fn http_work(addr: SocketAddr, n: usize) -> Measured {
    let done = Arc::new(AtomicUsize::new(0));
    let empty = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let finished = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (done, started, empty, finished) = (
            done.clone(),
            started.clone(),
            empty.clone(),
            finished.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut latencies = Vec::new();
            let worker = format!("bench-{w}");
            let fetch =
                json!({"queues": [QUEUE], "count": FETCH, "worker_id": worker, "wait_ms": 200})
                    .to_string();
            while done.load(Ordering::Relaxed) < n {
                let t = Instant::now();
                let (status, fetched, body) =
                    post_text::<Fetched>(&mut sender, "/ojs/v1/workers/fetch", fetch.clone()).await;
                let jobs = match fetched {
                    Some(f) if status == 200 => f.jobs,
                    _ => panic!("FETCH answered {status}: {body:?}"),
                };
                for job in &jobs {
                    assert_eq!(job.args.len(), 2, "{:?}", job.args);
                    let ack = json!({"job_id": job.id}).to_string();
                    let (status, acked, body) =
                        post_text::<Acked>(&mut sender, "/ojs/v1/workers/ack", ack).await;
                    match acked {
                        Some(a) if status == 200 && a.state == "completed" => {}
                        _ => panic!("ACK answered {status}: {body:?}"),
                    }
                }
                if jobs.is_empty() {
                    if started.lock().unwrap().is_some() {
                        empty.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    started.lock().unwrap().get_or_insert_with(Instant::now);
                    latencies.push(t.elapsed());
                    if done.fetch_add(jobs.len(), Ordering::Relaxed) + jobs.len() >= n {
                        finished.lock().unwrap().get_or_insert_with(Instant::now);
                    }
                }
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    // Until the last job was acked: the other workers' last, empty FETCH
    // is not work.
    let end = finished.lock().unwrap().unwrap_or_else(Instant::now);
    let elapsed = started
        .lock()
        .unwrap()
        .map_or(Duration::from_secs(1), |s| end.saturating_duration_since(s));
    // A FETCH that found nothing while jobs were left is time the
    // workers spent waiting on the broker's delivery, not on the API.
    println!(
        "  (FETCHes that got jobs: {}, {:.1} jobs each; answered empty after the first jobs: {})",
        latencies.len(),
        done.load(Ordering::Relaxed) as f64 / latencies.len().max(1) as f64,
        empty.load(Ordering::Relaxed)
    );
    Measured::from(done.load(Ordering::Relaxed), elapsed, latencies)
}

/// 16 gRPC workers (`Fetch` 10 with a 2 s deadline, then `Ack` each) over
/// 4 HTTP/2 connections until `n` jobs are done; timed as [`http_work`].
async fn grpc_work(addr: SocketAddr, n: usize) -> Measured {
    use ojs_api::grpc::pb;
    let channels = common::grpc_channels(addr, 4).await;
    let done = Arc::new(AtomicUsize::new(0));
    let late = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let finished = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (done, started, finished, late) = (
            done.clone(),
            started.clone(),
            finished.clone(),
            late.clone(),
        );
        let mut client = pb::ojs_service_client::OjsServiceClient::new(channels[w % 4].clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let worker = format!("bench-grpc-{w}");
            while done.load(Ordering::Relaxed) < n {
                let t = Instant::now();
                let mut request = tonic::Request::new(pb::FetchRequest {
                    queues: vec![QUEUE.into()],
                    count: FETCH as i32,
                    worker_id: worker.clone(),
                });
                request.set_timeout(Duration::from_secs(2));
                let jobs = match client.fetch(request).await {
                    Ok(r) => r.into_inner().jobs,
                    // Waiting in line for the queue's one consumer on a
                    // loaded machine can outlast a deadline: an empty
                    // fetch, as a worker would take it.
                    Err(e)
                        if e.code() == tonic::Code::Cancelled
                            || e.code() == tonic::Code::DeadlineExceeded =>
                    {
                        late.fetch_add(1, Ordering::Relaxed);
                        Vec::new()
                    }
                    Err(e) => panic!("Fetch failed: {e:?}"),
                };
                for job in &jobs {
                    client
                        .ack(pb::AckRequest {
                            job_id: job.id.clone(),
                            result: None,
                        })
                        .await
                        .unwrap();
                }
                if !jobs.is_empty() {
                    started.lock().unwrap().get_or_insert_with(Instant::now);
                    latencies.push(t.elapsed());
                    if done.fetch_add(jobs.len(), Ordering::Relaxed) + jobs.len() >= n {
                        finished.lock().unwrap().get_or_insert_with(Instant::now);
                    }
                }
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    let end = finished.lock().unwrap().unwrap_or_else(Instant::now);
    let elapsed = started
        .lock()
        .unwrap()
        .map_or(Duration::from_secs(1), |s| end.saturating_duration_since(s));
    println!(
        "  (gRPC Fetches that got jobs: {}; past their 2 s deadline: {})",
        latencies.len(),
        late.load(Ordering::Relaxed)
    );
    Measured::from(done.load(Ordering::Relaxed), elapsed, latencies)
}

/// The ceiling of the HTTP side: the same requests (a FETCH, then one ACK
/// per job, 10 jobs each) from 16 workers to a hello-world endpoint of the
/// daemon's HTTP stack, which answers each at once: what any API doing the
/// binding's requests could do on this machine with this client.
async fn hello_work(addr: SocketAddr, n: usize) -> Measured {
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut latencies = Vec::new();
            let worker = format!("bench-{w}");
            while done.load(Ordering::Relaxed) < n {
                let t = Instant::now();
                post(
                    &mut sender,
                    "/ojs/v1/workers/fetch",
                    json!({"queues": [QUEUE], "count": FETCH, "worker_id": worker, "wait_ms": 200}),
                )
                .await;
                for _ in 0..FETCH {
                    let id = uuid::Uuid::now_v7().to_string();
                    post(&mut sender, "/ojs/v1/workers/ack", json!({"job_id": id})).await;
                }
                latencies.push(t.elapsed());
                done.fetch_add(FETCH, Ordering::Relaxed);
            }
            latencies
        }));
    }
    let latencies = common::joined(tasks).await;
    Measured::from(done.load(Ordering::Relaxed), started.elapsed(), latencies)
}

/// The same jobs straight through the adapter: published (untimed), then
/// received 10 at a time and acked by 16 tasks.
async fn adapter_work(adapter: Arc<dyn QueueAdapter>, group: &str, n: usize) -> Measured {
    adapter.prepare(QUEUE).await.unwrap();
    for start in (0..n).step_by(100) {
        let messages = (start..n.min(start + 100))
            .map(|i| {
                let mut e =
                    JobEnvelope::new("email.send", vec![json!("user@example.com"), json!(i)]);
                e.queue = QUEUE.into();
                OutgoingMessage::from_envelope(&e, Encoding::OjsProto).unwrap()
            })
            .collect();
        adapter.publish(QUEUE, messages).await.unwrap();
    }
    // One consumer, as the API has one per queue: it receives 10 at a time
    // and acks each. The clock starts when its first batch arrived (a Kafka
    // group join is not the rate).
    let mut consumer = adapter
        .consumer(
            QUEUE,
            ConsumerOptions {
                group: group.to_owned(),
                ..ConsumerOptions::default()
            },
        )
        .await
        .unwrap();
    let mut latencies = Vec::new();
    let mut done = 0;
    let mut started = None;
    let mut idle = Instant::now();
    while done < n && idle.elapsed() < Duration::from_secs(20) {
        let t = Instant::now();
        let batch = consumer
            .receive(FETCH, Duration::from_millis(200))
            .await
            .unwrap();
        for d in &batch {
            d.ack().await.unwrap();
        }
        if !batch.is_empty() {
            started.get_or_insert_with(Instant::now);
            idle = Instant::now();
            latencies.push(t.elapsed());
            done += batch.len();
        }
    }
    consumer.close().await.unwrap();
    Measured::from(
        done,
        started.map_or(Duration::from_secs(1), |s| s.elapsed()),
        latencies,
    )
}

/// PUSH → FETCH on an idle queue with a FETCH long-polling: `samples`
/// times, the time from sending the PUSH to the FETCH's answer.
async fn push_to_fetch(addr: SocketAddr, samples: usize) -> Measured {
    let queue = "idle";
    // The queue's consumer exists (a Kafka group has joined) before timing.
    fill(addr, queue, 1).await;
    let mut warm = connect(addr).await;
    loop {
        let (_, body) = post(
            &mut warm,
            "/ojs/v1/workers/fetch",
            json!({"queues": [queue], "count": 1, "wait_ms": 2000}),
        )
        .await;
        if let Some(job) = body["jobs"].as_array().and_then(|j| j.first()) {
            post(
                &mut warm,
                "/ojs/v1/workers/ack",
                json!({"job_id": job["id"]}),
            )
            .await;
            break;
        }
    }
    // Opened now: a connection that sends nothing for the listener's
    // header_read_timeout (the Kafka group join above) is closed.
    let mut pusher = connect(addr).await;
    let mut latencies = Vec::new();
    let started = Instant::now();
    for i in 0..samples {
        let fetch = tokio::spawn(async move {
            let (_, body) = post(
                &mut warm,
                "/ojs/v1/workers/fetch",
                json!({"queues": [queue], "count": 1, "wait_ms": 10_000}),
            )
            .await;
            (Instant::now(), body, warm)
        });
        // The FETCH is waiting before the job comes.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let sent = Instant::now();
        let (status, pushed) = post(
            &mut pusher,
            "/ojs/v1/jobs",
            json!({"type": "email.send", "args": [i], "options": {"queue": queue}}),
        )
        .await;
        assert_eq!(status, 201);
        let (answered, body, w) = fetch.await.unwrap();
        warm = w;
        let job = body["jobs"][0].clone();
        // Any other job (one left on the queue) would time nothing.
        assert_eq!(
            job["id"], pushed["job"]["id"],
            "the waiting FETCH got the job just pushed: {body}"
        );
        latencies.push(answered.saturating_duration_since(sent));
        post(
            &mut warm,
            "/ojs/v1/workers/ack",
            json!({"job_id": job["id"]}),
        )
        .await;
    }
    Measured::from(samples, started.elapsed(), latencies)
}

async fn backend(
    name: &str,
    case: &str,
    config: impl Fn() -> String,
    adapter: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Arc<dyn QueueAdapter>>>>,
    jobs: usize,
    rounds: usize,
) {
    let (mut api, mut raw, mut latency) = (Vec::new(), Vec::new(), Vec::new());
    let mut grpc = Vec::new();
    let mut peak_rss = 0.0f64;
    let mut work = Vec::new();
    for round in 0..rounds {
        // A broker keeps its topics between daemons: each round's are new,
        // so that nothing a previous round left unacked is fetched again.
        let server = daemon(&config());
        fill(server.addr, QUEUE, jobs).await;
        let counting = Work::count(server.child.id());
        api.push(http_work(server.addr, jobs).await);
        work.push(counting.stop().per_job(jobs));
        fill(server.addr, QUEUE, jobs).await;
        grpc.push(grpc_work(server.addr, jobs).await);
        latency.push(push_to_fetch(server.addr, 200).await);
        peak_rss = peak_rss.max(rss_mib(server.child.id(), "VmHWM:"));
        drop(server);
        let a = adapter().await;
        raw.push(
            adapter_work(
                a.clone(),
                &format!("bench-raw-{round}-{}", uuid::Uuid::new_v4().simple()),
                jobs,
            )
            .await,
        );
        a.close().await.unwrap();
    }
    let (api, raw, latency) = (median(api), median(raw), median(latency));
    let grpc = median(grpc);
    println!("{name}:");
    line("FETCH 10 + ACK each, 16 HTTP workers", &api, Some(&raw));
    line("Fetch 10 + Ack each, 16 gRPC workers", &grpc, Some(&raw));
    println!(
        "  (gRPC workers = {:.2}× HTTP/1.1 keep-alive workers)",
        grpc.jobs_per_s / api.jobs_per_s
    );
    line("adapter receive 10 + ack, one consumer", &raw, None);
    println!(
        "  PUSH → FETCH, idle queue, long-poll waiting: p50 {:.2} ms, p99 {:.2} ms (200 jobs)",
        latency.p50.as_secs_f64() * 1e3,
        latency.p99.as_secs_f64() * 1e3
    );
    println!("  daemon peak RSS {peak_rss:.1} MiB");
    let mut work = median_per_job(&work);
    if work.0.is_none() && callgrind_available() {
        work.0 = Some(instructions_under_callgrind(&config(), jobs.min(COUNTED_JOBS)).await);
    }
    work_line("FETCH + ACK", work);
    println!(
        "{}",
        json!({"bench": "api_work", "case": case, "jobs_per_s": api.jobs_per_s,
               "adapter_jobs_per_s": raw.jobs_per_s,
               "p50_ms": latency.p50.as_secs_f64() * 1e3, "p99_ms": latency.p99.as_secs_f64() * 1e3,
               "peak_rss_mib": peak_rss, "instructions_per_job": work.0,
               "cpu_us_per_job": work.1})
    );
}

/// Jobs the round under callgrind works: enough that the daemon's
/// per-job work dwarfs its per-request setup, few enough for about a minute.
const COUNTED_JOBS: usize = 2_000;

/// Instructions per FETCH + ACK of the daemon under callgrind (see
/// `common::Instructions`): a round of its own, since it runs far slower.
async fn instructions_under_callgrind(config: &str, jobs: usize) -> f64 {
    let server = daemon_under_callgrind(config);
    fill(server.addr, QUEUE, jobs).await;
    let counting = Instructions::count(server.child.id());
    http_work(server.addr, jobs).await;
    let per_job = counting.stop() as f64 / jobs as f64;
    println!("  instructions counted by callgrind: the daemon under valgrind, {jobs} jobs");
    per_job
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
    let jobs = args.first().copied().unwrap_or(20_000);
    let rounds = args.get(1).copied().unwrap_or(3).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        println!("OJS API worker side: {jobs} jobs, {WORKERS} workers fetching {FETCH} at a time, median of {rounds} rounds");
        let ceiling = {
            let server = hello();
            let mut rounds_measured = Vec::new();
            for _ in 0..rounds {
                rounds_measured.push(hello_work(server.addr, jobs).await);
            }
            median(rounds_measured)
        };
        line(
            "same requests to a hello-world endpoint",
            &ceiling,
            None,
        );
        println!("  (the HTTP ceiling: the daemon's HTTP stack answering at once, same client)");
        if common::runs("memory") {
            // The same daemon on its in-process memory broker: what the
            // API costs when the broker persists nothing (the bound of
            // moving the embedded broker's work into the store's commit).
            backend(
                "memory broker (in the daemon's process)",
                "memory",
                || "[adapters]\nmemory = \"memory://bench\"\n[api]\nadapter = \"memory\"\n".to_owned(),
                || Box::pin(memory_adapter()),
                jobs,
                rounds,
            )
            .await;
        }
        if common::runs("embedded") {
            backend(
                "embedded broker (local:)",
                "embedded",
                || "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n".to_owned(),
                || Box::pin(local_adapter()),
                jobs,
                rounds,
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
            let topic = format!("bench-work-{}-{{queue}}", uuid::Uuid::new_v4().simple());
            let daemon_kafka = kafka.clone();
            let config = move || {
                let topic = format!("bench-work-{}-{{queue}}", uuid::Uuid::new_v4().simple());
                format!(
                    "[adapters.kafka]\nurl = \"{daemon_kafka}\"\ntopic_template = \"{topic}\"\npartitions = 4\n[api]\nadapter = \"kafka\"\n"
                )
            };
            let url = format!(
                "{kafka}{}topic_template={topic}&partitions=4",
                if kafka.contains('?') { "&" } else { "?" }
            );
            backend(
                "Kafka (4 partitions)",
                "kafka",
                config,
                move || {
                    let url = url.clone();
                    Box::pin(async move {
                        ojs_bridge::endpoint::connect(&url).await.unwrap()
                    })
                },
                jobs,
                rounds,
            )
            .await;
        } else {
            println!("Kafka: no broker at {kafka}; skipped");
        }
    });
    common::remove_adapter_dirs();
}

/// A memory broker of this process (the adapter-alone side of `memory`).
async fn memory_adapter() -> Arc<dyn ojs_queue::QueueAdapter> {
    Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ))
}
