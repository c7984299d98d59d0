//! A broker black-holed (the fault proxy keeps every socket and passes
//! nothing) or frozen (SIGSTOP) for 60 s while the daemon uses it both as a
//! source and as a sink, with calls flowing the whole time.
//!
//! Two routes: broker → memory (the broker as source) and memory → broker
//! (the broker as sink). A feeder publishes to each source at a steady rate
//! before, during and after the fault, retrying what fails (a retried
//! publish may land twice: duplicates are counted, never lost). Afterwards
//! each case prints sent / received / duplicated / lost per role; lost must
//! be 0 and nothing may be dead-lettered. Health must say 503 during the
//! fault and 200 after it.
//!
//! Kafka clients reconnect to the address the broker advertises, so Kafka
//! runs a tansu of the test's own that advertises the proxy; SQS runs a moto
//! of its own (freezing the shared one would stall other suites); RabbitMQ is
//! the machine's node (these cases run in the serial broker group).
//! `OJS_BRIDGE_FAULT_SECS` shortens the fault for a quick local run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{call, collect, http_get, start};
use ojs_adapter_memory::MemoryAdapter;
use ojs_bridge::endpoint::AdapterConfig;
use ojs_bridge_tests::brokers::{find, probe_address, unique_queue, Broker};
use ojs_bridge_tests::fault_proxy::{unused_port, FaultProxy, Mode};
use ojs_bridge_tests::processes::{own_moto, own_tansu, rabbitmq_pid, Frozen, OwnBroker};
use ojs_bridge_tests::tally::Tally;
use ojs_core::Encoding;
use ojs_grpcq::mapping::call_job_id;
use ojs_queue::{ConsumerOptions, QueueAdapter, Source};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The proxy keeps the sockets and passes nothing.
    BlackHole,
    /// The broker process is stopped (SIGSTOP), then continued.
    Freeze,
}

fn fault_length() -> Duration {
    let secs = std::env::var("OJS_BRIDGE_FAULT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

/// A broker reachable through a fault proxy.
struct Rig {
    /// What the daemon connects to: through the proxy.
    daemon_url: String,
    /// What the test's own clients connect to (through the proxy only where
    /// the broker's advertised address makes it unavoidable: Kafka).
    direct_url: String,
    proxy: FaultProxy,
    /// The process a freeze stops.
    pid: u32,
    _own: Option<OwnBroker>,
}

fn with_address(url: &str, addr: SocketAddr) -> String {
    url.replacen(&probe_address(url), &addr.to_string(), 1)
}

async fn rig(broker: Broker) -> Option<Rig> {
    let endpoint = find(broker).await?;
    match broker {
        Broker::RabbitMq => {
            let upstream: SocketAddr = probe_address(&endpoint.url)
                .replace("localhost", "127.0.0.1")
                .parse()
                .unwrap();
            let proxy = FaultProxy::start(upstream).await.unwrap();
            let pid = rabbitmq_pid().expect("rabbitmqctl status names the node's OS PID");
            Some(Rig {
                daemon_url: with_address(&endpoint.url, proxy.addr()),
                direct_url: endpoint.url,
                proxy,
                pid,
                _own: None,
            })
        }
        Broker::Kafka => {
            let backend = unused_port().unwrap();
            let front = unused_port().unwrap();
            let own = own_tansu(backend, front)?;
            let proxy = FaultProxy::start_on(front, backend).await.unwrap();
            let url = format!("kafka://{front}");
            Some(Rig {
                daemon_url: url.clone(),
                direct_url: url,
                proxy,
                pid: own.pid(),
                _own: Some(own),
            })
        }
        Broker::Sqs => {
            let backend = unused_port().unwrap();
            let own = own_moto(backend)?;
            let proxy = FaultProxy::start(backend).await.unwrap();
            Some(Rig {
                daemon_url: with_address(&endpoint.url, proxy.addr()),
                direct_url: with_address(&endpoint.url, backend),
                proxy,
                pid: own.pid(),
                _own: Some(own),
            })
        }
    }
}

/// Publishes a call every `every` until `stop`, each until it is confirmed
/// (a failed attempt is retried after 500 ms). Returns the job ids
/// of everything it set out to send and how many attempts failed.
fn feeder(
    adapter: Arc<dyn QueueAdapter>,
    queue: String,
    tag: String,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(Vec<String>, u64)> {
    tokio::spawn(async move {
        let mut sent = Vec::new();
        let failed = AtomicU64::new(0);
        let mut i = 0;
        while !stop.load(Ordering::SeqCst) {
            let c = call(i, &format!("broker_faults.{tag}"), "Run");
            i += 1;
            sent.push(call_job_id(&c.message_id, c.timestamp_ms));
            loop {
                // Bounded by the adapter's own publish timeout: a publish
                // future dropped half-way leaves its record queued in the
                // client (a retry then sends it twice).
                let attempt = adapter.publish(&queue, vec![ojs_grpcq::outgoing(&c)]).await;
                if attempt.is_ok() {
                    break;
                }
                failed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            tokio::time::sleep(every).await;
        }
        (sent, failed.into_inner())
    })
}

/// Receives from `queue` (one consumer, as a Kafka group join takes
/// seconds) until every id in `sent` arrived or `patience` ran out, then two
/// more idle seconds for late duplicates.
async fn received(
    adapter: &dyn QueueAdapter,
    queue: &str,
    sent: &[String],
    patience: Duration,
) -> Tally {
    let mut t = Tally::new();
    sent.iter().for_each(|id| t.sent(id.clone()));
    let options = ConsumerOptions {
        group: format!("collect-{}", uuid::Uuid::new_v4().simple()),
        ..ConsumerOptions::default()
    };
    let mut consumer = adapter.consumer(queue, options).await.unwrap();
    let deadline = Instant::now() + patience;
    let mut complete_at: Option<Instant> = None;
    while Instant::now() < deadline
        && complete_at.is_none_or(|at| at.elapsed() < Duration::from_secs(2))
    {
        for d in consumer
            .receive(500, Duration::from_millis(500))
            .await
            .unwrap()
        {
            let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
            t.received(job.id.clone());
            d.ack().await.unwrap();
        }
        if complete_at.is_none() && t.complete() {
            complete_at = Some(Instant::now());
        }
    }
    consumer.close().await.unwrap();
    t
}

async fn nothing_dead_lettered(adapter: &dyn QueueAdapter, queue: &str, what: &str) {
    let dead = collect(
        adapter,
        queue,
        Source::DeadLetters,
        1,
        Duration::from_secs(2),
    )
    .await;
    assert!(dead.is_empty(), "{what}: {} dead-lettered", dead.len());
}

async fn broker_fault(broker: Broker, fault: Fault, tag: &str) {
    if std::env::var_os("OJS_BRIDGE_TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(std::env::var("OJS_BRIDGE_TEST_LOG").unwrap_or_default())
            .with_test_writer()
            .try_init();
    }
    let Some(rig) = rig(broker).await else {
        return;
    };
    let length = fault_length();
    let from_broker = unique_queue(&format!("bf-{tag}-in"));
    let to_broker = unique_queue(&format!("bf-{tag}-out"));
    let memory = format!("bf-{}", uuid::Uuid::new_v4().simple());
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        health_interval = "500ms"
        [adapters]
        memory = "memory://{memory}"
        broker = "{url}"
        [[sources]]
        name = "from-memory"
        adapter = "memory"
        queue = "calls"
        visibility_timeout = "10s"
        [[sources]]
        name = "from-broker"
        adapter = "broker"
        queue = "{from_broker}"
        group = "bf-{tag}"
        visibility_timeout = "10s"
        [[routes]]
        name = "memory-to-broker"
        sources = ["from-memory"]
        sink = "broker"
        queue = "{to_broker}"
        [[routes]]
        name = "broker-to-memory"
        sources = ["from-broker"]
        sink = "memory"
        queue = "jobs"
        "#,
        url = rig.daemon_url,
    );
    let direct: Arc<dyn QueueAdapter> = AdapterConfig::from_url(&rig.direct_url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    direct.prepare(&from_broker).await.unwrap();
    direct.prepare(&to_broker).await.unwrap();
    let daemon = start(&toml, BTreeMap::new()).await;
    let memory_adapter: Arc<dyn QueueAdapter> = Arc::new(MemoryAdapter::named(&memory));
    let http = daemon.http.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    // moto (Python, one process) serves a few dozen calls a second and must
    // also work through the backlog a freeze leaves: feed it less.
    let every = if broker == Broker::Sqs {
        Duration::from_millis(500)
    } else {
        Duration::from_millis(100)
    };
    let to_source = feeder(
        direct.clone(),
        from_broker.clone(),
        format!("{tag}.in"),
        every,
        stop.clone(),
    );
    let to_sink = feeder(
        memory_adapter.clone(),
        "calls".into(),
        format!("{tag}.out"),
        every,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(http_get(http, "/ojs/v1/health").await.0, 200);

    let started = Instant::now();
    let frozen = match fault {
        Fault::BlackHole => {
            rig.proxy.set(Mode::BlackHole);
            None
        }
        Fault::Freeze => Some(Frozen::freeze(rig.pid, length + Duration::from_secs(30)).unwrap()),
    };
    let mut unhealthy = None;
    while started.elapsed() < length {
        let (status, body) = http_get(http, "/ojs/v1/health").await;
        if status == 503 && unhealthy.is_none() {
            unhealthy = Some((started.elapsed(), body));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rig.proxy.set(Mode::Pass);
    drop(frozen);
    let ended = Instant::now();
    let (after, body) = unhealthy.expect("health turned 503 during the fault");
    println!(
        "{tag}: health 503 {after:?} into the fault: {}",
        body.chars().take(300).collect::<String>()
    );
    let mut healthy_after = None;
    let mut last = String::new();
    while ended.elapsed() < Duration::from_secs(180) {
        let (status, body) = http_get(http, "/ojs/v1/health").await;
        if status == 200 {
            healthy_after = Some(ended.elapsed());
            break;
        }
        last = format!("{status} {}", body.chars().take(300).collect::<String>());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let healthy_after = healthy_after.unwrap_or_else(|| {
        panic!("health back to 200 within 180 s of the fault; its last answer: {last}")
    });
    println!("{tag}: healthy again {healthy_after:?} after the fault");
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    let (sent_in, failed_in) = tokio::time::timeout(Duration::from_secs(120), to_source)
        .await
        .expect("the feeder to the broker publishes again within 120 s of the fault")
        .unwrap();
    let (sent_out, failed_out) = to_sink.await.unwrap();

    let as_source = received(
        memory_adapter.as_ref(),
        "jobs",
        &sent_in,
        Duration::from_secs(120),
    )
    .await;
    let as_sink = received(
        direct.as_ref(),
        &to_broker,
        &sent_out,
        Duration::from_secs(120),
    )
    .await;
    println!(
        "{tag}: {fault:?} {}s; healthy {healthy_after:?} after it; feeder publish attempts failed: \
         {failed_in} to the broker, {failed_out} to memory",
        length.as_secs()
    );
    for (role, t) in [("as source", &as_source), ("as sink", &as_sink)] {
        println!(
            "{tag}: {fault:?} {}s {role}: sent {} received {} duplicated {} lost {}",
            length.as_secs(),
            t.sent_count(),
            t.distinct_received(),
            t.duplicates(),
            t.lost().len()
        );
    }
    as_source.assert_none_lost(&format!("{tag} {fault:?} as source"));
    as_sink.assert_none_lost(&format!("{tag} {fault:?} as sink"));
    nothing_dead_lettered(memory_adapter.as_ref(), "calls", "memory source").await;
    nothing_dead_lettered(direct.as_ref(), &from_broker, "broker source").await;
    daemon.shutdown().await;
    direct.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_black_holed() {
    broker_fault(Broker::RabbitMq, Fault::BlackHole, "rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_frozen() {
    broker_fault(Broker::RabbitMq, Fault::Freeze, "rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_black_holed() {
    broker_fault(Broker::Kafka, Fault::BlackHole, "kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_frozen() {
    broker_fault(Broker::Kafka, Fault::Freeze, "kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_black_holed() {
    broker_fault(Broker::Sqs, Fault::BlackHole, "sqs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_frozen() {
    broker_fault(Broker::Sqs, Fault::Freeze, "sqs").await;
}
