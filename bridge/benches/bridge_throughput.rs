//! Bridge throughput, every case in one run:
//!
//! 1. memory → memory: N grpcq calls preloaded into the in-memory broker,
//!    bridged into OJS jobs (decode, map, encode, publish, ack).
//! 2. Kafka → Kafka: N calls preloaded into a topic, then copied to another
//!    topic by a raw rdkafka consume-produce loop (StreamConsumer +
//!    FutureProducer, batches pipelined as the daemon does, every delivery
//!    report awaited, offsets committed per batch after its reports) and
//!    bridged by the daemon (which also maps each call to a job), on the
//!    same broker. Prints both rates and the ratio, and two more that
//!    tell where the gap is: the daemon forwarding the calls as calls (the
//!    raw loop's work through the daemon), and the raw loop writing the
//!    same jobs the daemon writes (the daemon's work without the daemon).
//!    The daemon runs on a runtime of its own as `ojs-bridge run` would,
//!    once with the size `run` gives it
//!    (`BridgeConfig::runtime_threads`: with a Kafka adapter, one thread
//!    fewer than CPUs) and once with one thread per CPU (tokio's default,
//!    and `run`'s before that rule).
//! 3. RabbitMQ → RabbitMQ: the same with a raw lapin copy loop (consume
//!    with the daemon's prefetch, publish each body with its properties,
//!    publisher confirms awaited per batch, then each delivery acked;
//!    batches pipelined as the daemon does) against the daemon, same
//!    broker, same run, in ROUNDS alternating pairs.
//! 4. Peak RSS of the `ojs-bridge` process (the release binary, run as a
//!    user runs it) holding 10,000 messages in flight: a RabbitMQ source
//!    preloaded with 12,000 calls, `max_in_flight = 10000`, and a sink
//!    queue whose policy (`max-length` 0, `reject-publish`) makes the broker
//!    nack every publish, so the daemon keeps its 10,000 and retries.
//!
//! 5. embedded → embedded: N calls preloaded into the embedded durable
//!    broker (`local:`, the default; a fresh directory), bridged into jobs
//!    in the same store: every publish and every ack a SQLite commit.
//!
//! Rates count from the first message received to the last one confirmed,
//! so consumer-group joins (seconds on the test broker) are left out of both.
//! Over the same window the Kafka case prints the CPU time this process
//! (all its threads) spent per message: the broker runs on the same two
//! cores, so a side that spends more CPU per message leaves the broker less.
//! p50/p99 are the latency the bridge adds (receive → sink confirmed), as
//! histogram bucket bounds.
//!
//! `cargo bench -p ojs-bridge --bench bridge_throughput [-- MEMORY_N [KAFKA_N [ROUNDS [RABBITMQ_N [LOCAL_N]]]]]`
//! (Kafka from `OJS_BRIDGE_TEST_KAFKA_URL`, default kafka://127.0.0.1:9092;
//! RabbitMQ from `OJS_BRIDGE_TEST_AMQP_URL`, default the local guest
//! account). A count of 0 skips that case. `OJS_BRIDGE_BENCH_KAFKA_ONLY`
//! = `raw`, `raw-jobs`, `jobs` or `calls` runs only that side of the Kafka
//! case, ROUNDS times, with no comparison: for profiling one side.
//!
//! When the Kafka broker is a process on this machine (the first bootstrap
//! address is 127.0.0.1 or localhost), its CPU per message is printed too:
//! it shares the cores, so a record that costs the broker more leaves the
//! bridge less.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::rss_mib;

// The allocator the ojs-bridge binary ships with; raw and bridge share it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_memory::MemoryAdapter;
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_bridge::metrics::Metrics;
use ojs_grpcq as grpcq;
use ojs_queue::{OutgoingMessage, QueueAdapter};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message};

fn calls(n: usize) -> Vec<OutgoingMessage> {
    let now = chrono::Utc::now().timestamp_millis();
    (0..n)
        .map(|i| {
            let mut m = grpcq::Message {
                originator: "bench-service".into(),
                topic: "payment.PaymentService".into(),
                action: "ProcessPayment".into(),
                payload: vec![b'x'; 96],
                message_id: uuid::Uuid::new_v4().to_string(),
                timestamp_ms: now,
                metadata: Default::default(),
            };
            m.metadata.insert("tenant".into(), format!("t{}", i % 16));
            ojs_grpcq::outgoing(&m)
        })
        .collect()
}

struct Measured {
    rate: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// CPU time of this whole process (every thread: runtime workers and
    /// librdkafka's) per message, over the same window as `rate`.
    cpu_us: f64,
    /// The broker process's CPU per message over the same window (the
    /// Kafka case, when its process is known).
    broker_cpu_us: Option<f64>,
    /// This process's CPU per message by thread name, over the same window.
    by_thread: String,
    /// Share of the messages acked before the watcher started its clock
    /// (left out of `rate` and `cpu_us`).
    late_start: f64,
}

/// CPU time (user + system) of a process so far, from its `stat` file in
/// clock ticks of 10 ms (Linux's `USER_HZ`): a window of 0.3 s or more is
/// within a few per cent. `None` when the process is gone or unreadable.
fn cpu_of(stat: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(stat).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    Some(Duration::from_millis(ticks * 10))
}

/// CPU time this process (all its threads) has used so far.
fn process_cpu() -> Duration {
    cpu_of("/proc/self/stat").unwrap_or_default()
}

/// The broker process of the Kafka case, when it runs on this machine:
/// its CPU is read as this process's is, since it shares the same cores.
static BROKER_PID: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();

/// The process listening on 127.0.0.1:`port` (IPv4), found through its
/// socket's inode as `ss -p` finds it; `None` when it is not ours to see.
fn listener_pid(port: u16) -> Option<u32> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let inode = table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let local_port = f.get(1)?.rsplit_once(':')?.1;
        // State 0A is LISTEN.
        (u16::from_str_radix(local_port, 16).ok()? == port && *f.get(3)? == "0A")
            .then(|| f.get(9).map(|s| s.to_string()))
            .flatten()
    })?;
    let socket = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            std::fs::read_dir(entry.path().join("fd"))
                .ok()?
                .flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == socket.as_str())
                })
                .then_some(pid)
        })
}

/// The broker's CPU time so far, when its process is known.
fn broker_cpu() -> Option<Duration> {
    let pid = BROKER_PID.get().copied().flatten()?;
    cpu_of(&format!("/proc/{pid}/stat"))
}

/// CPU time of this process's threads so far, summed by thread name
/// (`tokio-runtime-w…`, librdkafka's `rdk:broker…`, …).
fn threads_cpu() -> BTreeMap<String, Duration> {
    let mut by_name = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    for task in tasks.flatten() {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        // librdkafka numbers its broker threads by broker id.
        let name = name.trim().trim_end_matches(|c: char| c.is_ascii_digit());
        if let Some(cpu) = cpu_of(&path.join("stat").to_string_lossy()) {
            *by_name.entry(name.to_owned()).or_default() += cpu;
        }
    }
    by_name
}

/// CPU used by this process and by the broker from one moment on.
#[derive(Clone)]
struct CpuClock {
    ours: Duration,
    broker: Option<Duration>,
    threads: BTreeMap<String, Duration>,
}

impl CpuClock {
    fn start() -> Self {
        Self {
            ours: process_cpu(),
            broker: broker_cpu(),
            threads: threads_cpu(),
        }
    }

    /// CPU µs per message since `start` by thread name, largest first
    /// (threads that ended in between are left out).
    fn by_thread(&self, n: usize) -> String {
        let mut rows: Vec<(String, f64)> = threads_cpu()
            .into_iter()
            .map(|(name, now)| {
                let then = self.threads.get(&name).copied().unwrap_or_default();
                let us = now.saturating_sub(then).as_secs_f64() * 1e6 / n as f64;
                (name, us)
            })
            .filter(|(_, us)| *us >= 0.05)
            .collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        rows.iter()
            .map(|(name, us)| format!("{name} {us:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// CPU µs per message since `start`: this process's and the broker's.
    fn per_message(&self, n: usize) -> (f64, Option<f64>) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
        let broker = match (self.broker, broker_cpu()) {
            (Some(then), Some(now)) => Some(per(now.saturating_sub(then))),
            _ => None,
        };
        (per(process_cpu().saturating_sub(self.ours)), broker)
    }
}

/// How often [`watch`] looks: the end of a run is seen at most this late
/// (under 0.5 % of the shortest window, 200k memory → memory).
const WATCH_EVERY: Duration = Duration::from_millis(1);

/// Waits until `n` are acked; times from the first receive. It runs on a
/// thread of its own and sleeps on that thread, outside the daemon's
/// runtime: a tokio timer every 200 µs made the runtime's time driver wake
/// a daemon worker 5,000 times a second, work `ojs-bridge run` never does
/// (about a tenth of the worker's samples went to being switched back in).
/// Its own CPU is left out of the daemon's.
/// A thread may still see the first receive late, so the rate and the CPU
/// count only what was acked after it looked, never the whole `n` over a
/// shortened window (which once made some runs look 2.5× as fast).
fn watch(metrics: &Metrics, n: u64) -> Measured {
    // Its own thread's CPU is the bench's, not the daemon's.
    let own_cpu = || cpu_of("/proc/thread-self/stat").unwrap_or_default();
    let source = &metrics.sources[0].1;
    while source.received.load(Ordering::Relaxed) == 0 {
        std::thread::sleep(WATCH_EVERY);
    }
    let (started, cpu, watched) = (Instant::now(), CpuClock::start(), own_cpu());
    let acked_before = source.acked.load(Ordering::Relaxed);
    let deadline = started + Duration::from_secs(600);
    while source.acked.load(Ordering::Relaxed) < n {
        assert!(Instant::now() < deadline, "bridge stalled");
        std::thread::sleep(WATCH_EVERY);
    }
    let took = started.elapsed();
    let counted = n.saturating_sub(acked_before).max(1);
    let h = &metrics.routes[0].1.bridge_latency;
    let (cpu_us, broker_cpu_us) = cpu.per_message(counted as usize);
    let cpu_us = cpu_us - own_cpu().saturating_sub(watched).as_secs_f64() * 1e6 / counted as f64;
    let by_thread = cpu.by_thread(counted as usize);
    Measured {
        rate: counted as f64 / took.as_secs_f64(),
        p50_ms: h.quantile_upper_bound(0.5).map(|s| s * 1e3),
        p99_ms: h.quantile_upper_bound(0.99).map(|s| s * 1e3),
        cpu_us,
        broker_cpu_us,
        by_thread,
        late_start: acked_before as f64 / n as f64,
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "> 10000".to_owned(), |v| format!("≤ {v}"))
}

/// The daemon's config in every case: one source read by `group` (when
/// the broker has groups), one route writing `to` (`ojs` or `grpcq`), the
/// same batch settings as the raw loops.
fn bridge_toml(url: &str, src: &str, group: Option<&str>, to: &str, dst: &str) -> String {
    let group = group.map_or_else(String::new, |g| format!("group = \"{g}\""));
    format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        broker = "{url}"
        [[sources]]
        name = "calls"
        adapter = "broker"
        queue = "{src}"
        {group}
        batch_size = 512
        max_in_flight = 4096
        [[routes]]
        name = "out"
        sink = "broker"
        to = "{to}"
        queue = "{dst}"
        "#
    )
}

/// Deletes the bench's RabbitMQ queues (its sinks keep what they got).
async fn delete_rabbit_queues(url: &str, config: &RabbitConfig, queues: &[&String]) {
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for queue in queues {
        let _ = ch
            .queue_delete(
                config.queue_name_of(queue).as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
    let _ = conn.close(200, "done".into()).await;
}

async fn run_bridge(toml: &str, n: usize) -> Measured {
    run_bridge_on(toml, n, None).await
}

/// The CPUs tokio and `ojs-bridge run` see.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Runs the daemon as `ojs-bridge run` does: on a runtime of its own,
/// apart from the one the raw loops run on, with `worker_threads` threads
/// (`None`: the size `run` gives it for this configuration).
async fn run_bridge_on(toml: &str, n: usize, worker_threads: Option<usize>) -> Measured {
    let toml = toml.to_owned();
    let threads = worker_threads.unwrap_or_else(|| {
        ojs_bridge::config::BridgeConfig::parse(&toml, "bench", &[])
            .unwrap()
            .runtime_threads(cpus())
    });
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Named apart from the raw loops' threads, for the per-thread CPU.
    let watcher = std::thread::Builder::new().name("bench-watcher".into());
    watcher
        .spawn(move || {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            runtime.enable_all();
            runtime.worker_threads(threads);
            runtime.thread_name("daemon-worker");
            let runtime = runtime.build().unwrap();
            // The daemon's tasks run on the runtime's workers while this
            // thread watches from outside it.
            let daemon = runtime.block_on(support::start(&toml, BTreeMap::new()));
            let measured = watch(&daemon.metrics, n as u64);
            runtime.block_on(daemon.shutdown());
            let _ = tx.send(measured);
        })
        .unwrap();
    rx.await.unwrap()
}

async fn memory_to_memory(n: usize) {
    let name = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let broker = MemoryAdapter::named(&name);
    for chunk in calls(n).chunks(10_000) {
        broker.publish("calls", chunk.to_vec()).await.unwrap();
    }
    let toml = bridge_toml(&format!("memory://{name}"), "calls", None, "ojs", "jobs");
    let m = run_bridge(&toml, n).await;
    assert_eq!(broker.depth("jobs").await.unwrap(), Some(n as u64));
    println!(
        "memory → memory  {n} calls: {:>9.0} msg/s (target ≥ 800000), CPU {:.2} µs per message; bridge latency p50 {} ms, p99 {} ms; clock started with {:.0} % acked",
        m.rate,
        m.cpu_us,
        ms(m.p50_ms),
        ms(m.p99_ms),
        m.late_start * 100.0
    );
}

async fn local_to_local(n: usize) {
    let dir = std::env::temp_dir().join(format!("ojs-bench-{}", uuid::Uuid::new_v4().simple()));
    let broker = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
    for chunk in calls(n).chunks(5_000) {
        broker.publish("calls", chunk.to_vec()).await.unwrap();
    }
    let toml = bridge_toml(
        &format!("local:{}", dir.display()),
        "calls",
        None,
        "ojs",
        "jobs",
    );
    let m = run_bridge(&toml, n).await;
    assert_eq!(broker.depth("jobs").await.unwrap(), Some(n as u64));
    let _ = broker.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "embedded → embedded  {n} calls: {:>7.0} msg/s, CPU {:.2} µs per message; bridge latency p50 {} ms, p99 {} ms",
        m.rate,
        m.cpu_us,
        ms(m.p50_ms),
        ms(m.p99_ms)
    );
}

/// Batches a raw copy loop keeps in flight: the daemon's `max_in_flight`
/// (4096) over its `batch_size` (512).
const RAW_BATCHES_IN_FLIGHT: usize = 8;

/// Raw rdkafka copy loop, written as a careful hand-rolled bridge would be:
/// consume `from` in batches of up to 512, produce each record to `to` (same
/// key, headers, payload) without waiting, keep up to
/// [`RAW_BATCHES_IN_FLIGHT`] batches' delivery reports outstanding, and
/// commit each batch's offsets once all its reports are in, in order. The
/// producer is connected (and has its idempotent producer id) before the
/// clock starts. Returns msg/s and the CPU µs per message of this process
/// and of the broker.
///
/// With `map_to_jobs` the loop does what the daemon's route does to each
/// record, with the same library calls: decode the call, name the job
/// type, encode the job with its headers and key
/// ([`ojs_grpcq::mapping::call_to_job_message`]), and produce that — a
/// hand-rolled bridge doing the daemon's work, to tell the cost of the
/// daemon's pipeline from the cost of writing a job instead of a copy.
async fn raw_copy(brokers: &str, from: &str, to: &str, n: usize, map_to_jobs: bool) -> RawMeasured {
    use futures::stream::{FuturesOrdered, StreamExt};
    use futures::FutureExt;
    use rdkafka::{Offset, TopicPartitionList};

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("bench-raw-{}", uuid::Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    consumer.subscribe(&[from]).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<(), _>::to(to).payload("warm-up"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let jobs_queue = ojs_queue::HeaderValue::from_static("jobs");
    let mut in_flight = FuturesOrdered::new();
    let (mut received, mut copied) = (0, 0);
    let mut started = None;
    while copied < n {
        if received < n && in_flight.len() < RAW_BATCHES_IN_FLIGHT {
            let mut batch = vec![consumer.recv().await.unwrap()];
            started.get_or_insert_with(|| (Instant::now(), CpuClock::start()));
            while batch.len() < 512 {
                match consumer.recv().now_or_never() {
                    Some(m) => batch.push(m.unwrap()),
                    None => break,
                }
            }
            received += batch.len();
            // Job types named as the daemon names them: remembered within a batch.
            let mut job_types = ojs_grpcq::mapping::JobTypes::new();
            let mut offsets = TopicPartitionList::new();
            let sends: Vec<_> = batch
                .iter()
                .map(|m| {
                    let _ = offsets.add_partition_offset(
                        m.topic(),
                        m.partition(),
                        Offset::Offset(m.offset() + 1),
                    );
                    if map_to_jobs {
                        let body = bytes::Bytes::copy_from_slice(m.payload().unwrap_or_default());
                        let call = grpcq::Call::decode_lenient(&body).unwrap();
                        let job_type = job_types.of(call.topic(), call.action()).unwrap();
                        let job =
                            ojs_grpcq::mapping::call_to_job_message(&call, &job_type, &jobs_queue);
                        let mut headers = OwnedHeaders::new_with_capacity(job.headers.len());
                        for (k, v) in &job.headers {
                            headers = headers.insert(Header {
                                key: k.as_str(),
                                value: Some(v.as_bytes()),
                            });
                        }
                        let mut record = FutureRecord::to(to)
                            .headers(headers)
                            .payload(job.payload.as_ref());
                        if let Some(k) = &job.key {
                            record = record.key(&k[..]);
                        }
                        return producer.send_result(record).map_err(|(e, _)| e).unwrap();
                    }
                    let mut headers = OwnedHeaders::new();
                    if let Some(h) = m.headers() {
                        for header in h.iter() {
                            headers = headers.insert(Header {
                                key: header.key,
                                value: header.value,
                            });
                        }
                    }
                    let mut record = FutureRecord::to(to).headers(headers);
                    if let Some(p) = m.payload() {
                        record = record.payload(p);
                    }
                    if let Some(k) = m.key() {
                        record = record.key(k);
                    }
                    producer.send_result(record).map_err(|(e, _)| e).unwrap()
                })
                .collect();
            let count = batch.len();
            in_flight.push_back(async move {
                for r in futures::future::join_all(sends).await {
                    r.unwrap().map_err(|(e, _)| e).unwrap();
                }
                (count, offsets)
            });
        } else if let Some((count, offsets)) = in_flight.next().await {
            consumer.commit(&offsets, CommitMode::Async).unwrap();
            copied += count;
        }
    }
    let Some((at, cpu)) = started else {
        return RawMeasured::default();
    };
    let took = at.elapsed();
    let (cpu_us, broker_cpu_us) = cpu.per_message(n);
    RawMeasured {
        rate: n as f64 / took.as_secs_f64(),
        cpu_us,
        broker_cpu_us,
        by_thread: cpu.by_thread(n),
    }
}

/// A raw loop's rate and CPU per message (its own, the broker's).
#[derive(Default)]
struct RawMeasured {
    rate: f64,
    cpu_us: f64,
    broker_cpu_us: Option<f64>,
    by_thread: String,
}

/// Raw lapin copy loop, written as a careful hand-rolled bridge would be:
/// one consumer with the daemon's prefetch (`max_in_flight`), batches of
/// up to 512 taken as they arrive, each delivery republished with its own
/// properties through the route the adapter uses, up to
/// [`RAW_BATCHES_IN_FLIGHT`] batches awaiting their publisher confirms,
/// and each delivery acked once its batch is confirmed. Returns msg/s.
async fn raw_rabbit_copy(
    url: &str,
    from: &str,
    exchange: &str,
    routing_key: &str,
    n: usize,
) -> f64 {
    use futures::stream::{FuturesUnordered, StreamExt};
    use futures::FutureExt;
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions,
    };
    use lapin::types::FieldTable;

    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let consume = conn.create_channel().await.unwrap();
    consume
        .basic_qos(4096, BasicQosOptions::default())
        .await
        .unwrap();
    let publish = conn.create_channel().await.unwrap();
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut consumer = consume
        .basic_consume(
            from.into(),
            "bench-raw-copy".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut in_flight = FuturesUnordered::new();
    let (mut received, mut copied) = (0, 0);
    let mut started = None;
    while copied < n {
        if received < n && in_flight.len() < RAW_BATCHES_IN_FLIGHT {
            let mut batch = vec![consumer.next().await.unwrap().unwrap()];
            started.get_or_insert_with(Instant::now);
            while batch.len() < 512 {
                match consumer.next().now_or_never() {
                    Some(Some(d)) => batch.push(d.unwrap()),
                    _ => break,
                }
            }
            received += batch.len();
            let mut confirms = Vec::with_capacity(batch.len());
            for d in &batch {
                confirms.push(
                    publish
                        .basic_publish(
                            exchange.into(),
                            routing_key.into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            &d.data,
                            d.properties.clone(),
                        )
                        .await
                        .unwrap(),
                );
            }
            in_flight.push(async move {
                for c in futures::future::join_all(confirms).await {
                    assert!(c.unwrap().is_ack());
                }
                futures::future::join_all(batch.iter().map(|d| d.ack(BasicAckOptions::default())))
                    .await
                    .into_iter()
                    .for_each(|r| {
                        r.unwrap();
                    });
                batch.len()
            });
        } else if let Some(count) = in_flight.next().await {
            copied += count;
        }
    }
    let took = started.map_or(Duration::ZERO, |s| s.elapsed());
    let _ = conn.close(200, "done".into()).await;
    n as f64 / took.as_secs_f64()
}

/// RabbitMQ: preloaded calls copied by raw lapin, then bridged by the
/// daemon into OJS jobs, each from a queue of its own holding the same
/// calls; `rounds` such pairs (fresh queues each), medians compared. With
/// persistent messages and confirms both sides wait on the broker's disk,
/// so one pair's ratio varies widely (0.61 to 1.17 on one day).
async fn rabbit_to_rabbit(url: &str, n: usize, rounds: usize) {
    let config = RabbitConfig::from_url(url).unwrap();
    let adapter = RabbitAdapter::connect(config.clone()).await.unwrap();
    let (mut raw_rates, mut bridged) = (vec![], vec![]);
    for _ in 0..rounds {
        let short = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let (raw_src, raw_dst, src, dst) = (
            format!("bench-raw-src-{short}"),
            format!("bench-raw-dst-{short}"),
            format!("bench-src-{short}"),
            format!("bench-dst-{short}"),
        );
        for queue in [&raw_src, &src] {
            for chunk in calls(n).chunks(5_000) {
                adapter.publish(queue, chunk.to_vec()).await.unwrap();
            }
        }
        // The raw sink is declared the adapter's way (same arguments).
        adapter.prepare(&raw_dst).await.unwrap();
        let (exchange, routing_key) = config.publish_route_of(&raw_dst);
        raw_rates.push(
            raw_rabbit_copy(
                url,
                &config.queue_name_of(&raw_src),
                &exchange,
                &routing_key,
                n,
            )
            .await,
        );
        let toml = bridge_toml(url, &src, None, "ojs", &dst);
        bridged.push(run_bridge(&toml, n).await);
        delete_rabbit_queues(url, &config, &[&raw_src, &raw_dst, &src, &dst]).await;
    }
    adapter.close().await.unwrap();
    let raw = median(raw_rates.clone());
    let rates: Vec<f64> = bridged.iter().map(|m| m.rate).collect();
    let bridge = median(rates.clone());
    let p = |q: fn(&Measured) -> Option<f64>| {
        ms(Some(median(
            bridged
                .iter()
                .map(|m| q(m).unwrap_or(f64::INFINITY))
                .collect(),
        )))
    };
    println!(
        "rabbitmq → rabbitmq {n} calls, median of {rounds}: raw copy {raw:>9.0} msg/s, bridge {bridge:>9.0} msg/s, ratio {:.2} (target ≥ 0.9); bridge latency p50 {} ms, p99 {} ms",
        bridge / raw,
        p(|m| m.p50_ms),
        p(|m| m.p99_ms)
    );
    println!(
        "    rounds: raw [{}]  bridge [{}]",
        thousands(&raw_rates),
        thousands(&rates)
    );
}

async fn peak_rss_at_10k_in_flight(url: &str) {
    const IN_FLIGHT: usize = 10_000;
    let config = RabbitConfig::from_url(url).unwrap();
    let adapter = RabbitAdapter::connect(config.clone()).await.unwrap();
    let short = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let (src, dst) = (
        format!("bench-rss-src-{short}"),
        format!("bench-rss-dst-{short}"),
    );
    for chunk in calls(IN_FLIGHT + 2_000).chunks(5_000) {
        adapter.publish(&src, chunk.to_vec()).await.unwrap();
    }
    let policy = format!("bench-rss-{short}");
    let pattern = format!("^{}$", config.queue_name_of(&dst).replace('.', "\\."));
    assert!(
        ojs_bridge_tests::brokers::rabbitmqctl(&[
            "set_policy",
            &policy,
            &pattern,
            r#"{"max-length":0,"overflow":"reject-publish"}"#,
            "--apply-to",
            "queues",
        ]),
        "rabbitmqctl set_policy (OJS_BRIDGE_TEST_RABBITMQCTL)"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("ojs-bench-rss-{short}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("bridge.toml"),
        format!(
            r#"
            [http]
            listen = "127.0.0.1:{port}"
            [adapters]
            source = "{url}"
            sink = "{url}"
            [[sources]]
            name = "calls"
            adapter = "source"
            queue = "{src}"
            batch_size = 500
            max_in_flight = {IN_FLIGHT}
            [[routes]]
            name = "jobs"
            sink = "sink"
            queue = "{dst}"
            "#
        ),
    )
    .unwrap();
    let daemon = support::spawn_daemon_in(&dir, "bridge.toml");
    let pid = daemon.pid();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let started_rss = rss_mib(pid, "VmRSS:");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut held = 0.0;
    while held < IN_FLIGHT as f64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (_, text) = support::http_get(addr, "/metrics").await;
        held = support::metric(&text, "ojs_bridge_in_flight{source=\"calls\"}").unwrap_or(0.0);
    }
    // Retries go on for a while with everything held.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (peak, now) = (rss_mib(pid, "VmHWM:"), rss_mib(pid, "VmRSS:"));
    daemon.stop();
    assert!(ojs_bridge_tests::brokers::rabbitmqctl(&[
        "clear_policy",
        &policy
    ]));
    let _ = std::fs::remove_dir_all(&dir);
    delete_rabbit_queues(url, &config, &[&src, &dst]).await;
    adapter.close().await.unwrap();
    println!(
        "ojs-bridge process, {held:.0} messages in flight (RabbitMQ → RabbitMQ, sink nacking): peak RSS {peak:.1} MiB (RSS {now:.1} MiB; {started_rss:.1} MiB when it started)"
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn thousands(xs: &[f64]) -> String {
    xs.iter()
        .map(|x| format!("{:.0}k", x / 1000.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Raw copy and bridge in alternating rounds over the same preloaded
/// calls (a fresh consumer group each round); medians compared, as one
/// round on a 2-core machine shared with the broker varies by ±20 %.
async fn kafka_to_kafka(url: &str, n: usize, rounds: usize) {
    let config = KafkaConfig::from_url(url).unwrap();
    let brokers = config.brokers.clone();
    // A broker on this machine shares its cores: its CPU per message is
    // read too (the first bootstrap address's listener, if ours to see).
    let broker_pid = brokers
        .split(',')
        .next()
        .and_then(|b| b.rsplit_once(':'))
        .filter(|(host, _)| matches!(*host, "127.0.0.1" | "localhost"))
        .and_then(|(_, port)| port.parse().ok())
        .and_then(listener_pid);
    let _ = BROKER_PID.set(broker_pid);
    let adapter = KafkaAdapter::connect(config.clone()).await.unwrap();
    let run = uuid::Uuid::new_v4().simple().to_string();
    let short = &run[..8];
    let src = format!("bench-src-{short}");
    for chunk in calls(n).chunks(5_000) {
        adapter.publish(&src, chunk.to_vec()).await.unwrap();
    }
    // Create the sink topics through the adapter (same partitions) before
    // any clock starts: the raw loops' and each daemon round's, so neither
    // side times a topic being created.
    let raw_sink = format!("bench-raw-{short}");
    // The daemon as `ojs-bridge run` runs it: writing jobs (`ojs`) and,
    // to tell the pipeline's cost from that of writing a job (about twice
    // the bytes and headers of the call it came from), forwarding the
    // calls as calls (`grpcq`: the raw copy loop's work); each with the
    // runtime's size as `run` chooses it and with one thread per CPU.
    let per_cpu = cpus();
    let default_threads = ojs_bridge::config::BridgeConfig::parse(
        &bridge_toml(url, &src, None, "ojs", &src),
        "bench",
        &[],
    )
    .unwrap()
    .runtime_threads(per_cpu);
    let variants: [(&str, Option<usize>); 4] = [
        ("ojs", None),
        ("grpcq", None),
        ("ojs", Some(per_cpu)),
        ("grpcq", Some(per_cpu)),
    ];
    let sink = |variant: usize, round: usize| format!("bench-dst{variant}-{short}-{round}");
    adapter.publish(&raw_sink, calls(1)).await.unwrap();
    for round in 0..rounds {
        for variant in 0..variants.len() {
            adapter
                .publish(&sink(variant, round), calls(1))
                .await
                .unwrap();
        }
    }
    if let Ok(only) = std::env::var("OJS_BRIDGE_BENCH_KAFKA_ONLY") {
        // One side alone, to profile it (`perf record` on this process).
        for round in 0..rounds {
            let (rate, cpu_us, broker_cpu_us, by_thread) = match only.as_str() {
                "raw" | "raw-jobs" => {
                    let (from, to) = (config.topic_of(&src), config.topic_of(&raw_sink));
                    let m = raw_copy(&brokers, &from, &to, n, only == "raw-jobs").await;
                    (m.rate, m.cpu_us, m.broker_cpu_us, m.by_thread)
                }
                "jobs" | "calls" => {
                    let variant = usize::from(only == "calls");
                    let toml = bridge_toml(
                        url,
                        &src,
                        Some(&format!("bench-bridge{variant}-{run}-{round}")),
                        variants[variant].0,
                        &sink(variant, round),
                    );
                    let m = run_bridge_on(&toml, n, None).await;
                    (m.rate, m.cpu_us, m.broker_cpu_us, m.by_thread)
                }
                other => {
                    panic!("OJS_BRIDGE_BENCH_KAFKA_ONLY={other}: raw, raw-jobs, jobs or calls")
                }
            };
            println!(
                "kafka → kafka {only} alone, round {round}: {rate:>9.0} msg/s, CPU {cpu_us:.1} µs per message ({by_thread}), the broker's {}",
                broker_cpu_us.map_or_else(|| "?".to_owned(), |b| format!("{b:.1} µs"))
            );
        }
        adapter.close().await.unwrap();
        return;
    }
    let (mut raw_rounds, mut mapped_rounds) = (vec![], vec![]);
    let mut daemon: [Vec<Measured>; 4] = Default::default();
    for round in 0..rounds {
        for (rounds, map_to_jobs) in [(&mut raw_rounds, false), (&mut mapped_rounds, true)] {
            let (from, to) = (config.topic_of(&src), config.topic_of(&raw_sink));
            rounds.push(raw_copy(&brokers, &from, &to, n, map_to_jobs).await);
        }
        for (variant, (to, workers)) in variants.iter().enumerate() {
            let toml = bridge_toml(
                url,
                &src,
                Some(&format!("bench-bridge{variant}-{run}-{round}")),
                to,
                &sink(variant, round),
            );
            daemon[variant].push(run_bridge_on(&toml, n, *workers).await);
        }
    }
    adapter.close().await.unwrap();
    let raw: Vec<f64> = raw_rounds.iter().map(|m| m.rate).collect();
    let raw_mapped: Vec<f64> = mapped_rounds.iter().map(|m| m.rate).collect();
    let raw_cpu = raw_rounds.iter().map(|m| m.cpu_us).collect();
    let mapped_cpu = mapped_rounds.iter().map(|m| m.cpu_us).collect();
    let rates = |v: &[Measured]| v.iter().map(|m| m.rate).collect::<Vec<_>>();
    let cpus = |v: &[Measured]| median(v.iter().map(|m| m.cpu_us).collect());
    // The broker's median CPU per message, when every round could read it.
    let broker = |v: Vec<Option<f64>>| -> String {
        v.into_iter()
            .collect::<Option<Vec<f64>>>()
            .filter(|v| !v.is_empty())
            .map_or_else(|| "?".to_owned(), |v| format!("{:.1}", median(v)))
    };
    let (raw_rate, mapped_rate) = (median(raw.clone()), median(raw_mapped.clone()));
    let [bridge_rate, copy_rate, bridge1_rate, copy1_rate] =
        [0, 1, 2, 3].map(|v| median(rates(&daemon[v])));
    let p = |q: fn(&Measured) -> Option<f64>| {
        ms(Some(median(
            daemon[0]
                .iter()
                .map(|m| q(m).unwrap_or(f64::INFINITY))
                .collect(),
        )))
    };
    println!(
        "kafka → kafka    {n} calls, median of {rounds}: raw copy {raw_rate:>9.0} msg/s, bridge (runtime threads as `run` sizes it: {default_threads}) {bridge_rate:>9.0} msg/s, ratio {:.2} (target ≥ 0.9); bridge latency p50 {} ms, p99 {} ms",
        bridge_rate / raw_rate,
        p(|m| m.p50_ms),
        p(|m| m.p99_ms),
    );
    println!(
        "                 bridge forwarding the calls as calls {copy_rate:>9.0} msg/s, ratio {:.2}",
        copy_rate / raw_rate
    );
    println!(
        "                 raw loop writing the same jobs {mapped_rate:>9.0} msg/s; bridge / it: ratio {:.2}",
        bridge_rate / mapped_rate
    );
    println!(
        "                 one runtime thread per CPU ({per_cpu}; `run` gives this configuration {default_threads}): bridge {bridge1_rate:>9.0} msg/s, ratio {:.2} (raw loop writing the same jobs: {:.2}); calls as calls {copy1_rate:>9.0} msg/s, ratio {:.2}",
        bridge1_rate / raw_rate,
        bridge1_rate / mapped_rate,
        copy1_rate / raw_rate
    );
    // The broker (another process) shares the two cores: CPU this process
    // spends per message is CPU the broker does not get.
    println!(
        "    CPU per message (this process, all threads; median): raw copy {:.1} µs, raw writing jobs {:.1} µs, bridge {:.1} µs, calls as calls {:.1} µs; one thread per CPU: bridge {:.1} µs, calls as calls {:.1} µs",
        median(raw_cpu),
        median(mapped_cpu),
        cpus(&daemon[0]),
        cpus(&daemon[1]),
        cpus(&daemon[2]),
        cpus(&daemon[3]),
    );
    match broker_pid {
        Some(pid) => println!(
            "    CPU per message of the broker (pid {pid}, another process on the same cores; median): raw copy {} µs, raw writing jobs {} µs, bridge {} µs, calls as calls {} µs; one thread per CPU: bridge {} µs, calls as calls {} µs",
            broker(raw_rounds.iter().map(|m| m.broker_cpu_us).collect()),
            broker(mapped_rounds.iter().map(|m| m.broker_cpu_us).collect()),
            broker(daemon[0].iter().map(|m| m.broker_cpu_us).collect()),
            broker(daemon[1].iter().map(|m| m.broker_cpu_us).collect()),
            broker(daemon[2].iter().map(|m| m.broker_cpu_us).collect()),
            broker(daemon[3].iter().map(|m| m.broker_cpu_us).collect()),
        ),
        None => println!("    CPU per message of the broker: not measured (no process of ours listens on the first bootstrap address)"),
    }
    println!(
        "    rounds: raw [{}]  bridge [{}]  calls as calls [{}]  raw writing jobs [{}]  one thread per CPU: bridge [{}]  calls as calls [{}]",
        thousands(&raw),
        thousands(&rates(&daemon[0])),
        thousands(&rates(&daemon[1])),
        thousands(&raw_mapped),
        thousands(&rates(&daemon[2])),
        thousands(&rates(&daemon[3])),
    );
    let late = daemon
        .iter()
        .flatten()
        .map(|m| m.late_start)
        .fold(0.0, f64::max);
    println!(
        "    the daemon's clock started with at most {:.1} % acked (left out of its rates)",
        late * 100.0
    );
}

fn main() {
    // `cargo bench` passes `--bench`; numbers are ours.
    let numbers: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let memory_n = numbers.first().copied().unwrap_or(200_000);
    let kafka_n = numbers.get(1).copied().unwrap_or(50_000);
    let rounds = numbers.get(2).copied().unwrap_or(3).max(1);
    let rabbit_n = numbers.get(3).copied().unwrap_or(50_000);
    let local_n = numbers.get(4).copied().unwrap_or(50_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if memory_n > 0 {
            memory_to_memory(memory_n).await;
        }
        if local_n > 0 {
            local_to_local(local_n).await;
        }
        let url = std::env::var("OJS_BRIDGE_TEST_KAFKA_URL")
            .unwrap_or_else(|_| "kafka://127.0.0.1:9092".to_owned());
        let probe = url
            .trim_start_matches("kafka://")
            .split(['?', ','])
            .next()
            .unwrap_or_default()
            .to_owned();
        if kafka_n == 0 {
        } else if std::net::TcpStream::connect(&probe).is_ok() {
            kafka_to_kafka(&url, kafka_n, rounds).await;
        } else {
            println!(
                "kafka → kafka skipped: nothing listens on {probe} (scripts/brokers.sh up kafka)"
            );
        }
        let amqp = std::env::var("OJS_BRIDGE_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        if rabbit_n == 0 {
        } else if std::net::TcpStream::connect("127.0.0.1:5672").is_ok() || !amqp.contains("127.0.0.1:5672") {
            rabbit_to_rabbit(&amqp, rabbit_n, rounds).await;
            peak_rss_at_10k_in_flight(&amqp).await;
        } else {
            println!("rabbitmq → rabbitmq skipped: nothing listens on 127.0.0.1:5672 (scripts/brokers.sh up rabbitmq)");
        }
    });
}
