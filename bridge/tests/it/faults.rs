//! The daemon under broker faults that a graceful restart does not show,
//! through the fault proxy (tests/src/fault_proxy.rs): a broker that is not
//! there when the daemon starts, a link that black-holes, a sink that hangs.
//! Each case prints sent / received / duplicates / lost; lost must be 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::{call, collect, http_get, start, Running};
use ojs_adapter_memory::MemoryAdapter;
use ojs_bridge::endpoint::AdapterConfig;
use ojs_bridge_tests::brokers::{find, probe_address, unique_queue, Broker};
use ojs_bridge_tests::fault_proxy::{unused_port, FaultProxy, Mode};
use ojs_bridge_tests::tally::Tally;
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping::call_job_id;
use ojs_queue::{OutgoingMessage, QueueAdapter, Source};

/// The broker's URL with its address replaced by `addr`.
fn through(url: &str, addr: SocketAddr) -> String {
    url.replacen(&probe_address(url), &addr.to_string(), 1)
}

fn upstream(url: &str) -> SocketAddr {
    let host_port = probe_address(url);
    host_port
        .replace("localhost", "127.0.0.1")
        .parse()
        .unwrap_or_else(|e| panic!("{host_port}: {e}"))
}

fn calls(n: usize, tag: &str) -> HashMap<String, grpcq::Message> {
    (0..n)
        .map(|i| call(i, &format!("faults.{tag}"), "Run"))
        .map(|c| (call_job_id(&c.message_id, c.timestamp_ms), c))
        .collect()
}

fn tally(sent: &HashMap<String, grpcq::Message>, jobs: &[ojs_queue::Delivery]) -> Tally {
    let mut t = Tally::new();
    for id in sent.keys() {
        t.sent(id.clone());
    }
    for d in jobs {
        let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
        t.received(job.id.clone());
    }
    t
}

/// The source queue's dead letters are empty: a fault of the sink or the
/// network is never the message's.
async fn assert_nothing_dead_lettered(source: &MemoryAdapter, queue: &str) {
    let dead = collect(
        source,
        queue,
        Source::DeadLetters,
        1,
        Duration::from_millis(500),
    )
    .await;
    assert!(dead.is_empty(), "{} dead-lettered", dead.len());
}

async fn health(daemon: &Running) -> (u16, String) {
    http_get(daemon.http.unwrap(), "/ojs/v1/health").await
}

async fn wait_for_health(daemon: &Running, status: u16, patience: Duration) -> String {
    let started = Instant::now();
    loop {
        let (got, body) = health(daemon).await;
        if got == status {
            return body;
        }
        assert!(
            started.elapsed() < patience,
            "health stayed {got} (wanted {status}): {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The broker is not there when the daemon starts (the port refuses
/// connections): the daemon starts anyway, health is 503 naming the
/// adapter, nothing is lost or dead-lettered; once the broker is reachable
/// (the proxy takes the port) calls flow both ways: from the broker (as a
/// source) and to it (as a sink).
async fn starts_before_the_broker(broker: Broker, tag: &str) {
    let Some(endpoint) = find(broker).await else {
        return;
    };
    let port = unused_port().unwrap();
    let url = through(&endpoint.url, port);
    let from_broker = unique_queue(&format!("faults-{tag}-in"));
    let to_broker = unique_queue(&format!("faults-{tag}-out"));
    let memory = format!("faults-{}", uuid::Uuid::new_v4().simple());
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        health_interval = "200ms"
        [adapters]
        memory = "memory://{memory}"
        broker = "{url}"
        [[sources]]
        name = "from-memory"
        adapter = "memory"
        queue = "calls"
        [[sources]]
        name = "from-broker"
        adapter = "broker"
        queue = "{from_broker}"
        group = "faults-{tag}"
        batch_size = 10
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
        "#
    );
    let t0 = Instant::now();
    let daemon = start(&toml, BTreeMap::new()).await;
    println!("{tag}: daemon started in {:?}", t0.elapsed());
    let body = wait_for_health(&daemon, 503, Duration::from_secs(10)).await;
    assert!(body.contains("broker"), "health names the adapter: {body}");
    assert!(body.contains("not connected yet"), "{body}");

    // Calls wait on both sides while the broker is away.
    let memory_adapter = MemoryAdapter::named(&memory);
    let direct = AdapterConfig::from_url(&endpoint.url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    direct.prepare(&from_broker).await.unwrap();
    direct.prepare(&to_broker).await.unwrap();
    let to_sink = calls(50, &format!("{tag}.out"));
    let from_source = calls(50, &format!("{tag}.in"));
    memory_adapter
        .publish("calls", to_sink.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    direct
        .publish(
            &from_broker,
            from_source.values().map(ojs_grpcq::outgoing).collect(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(health(&daemon).await.0, 503);

    let proxy = FaultProxy::start_on(port, upstream(&endpoint.url))
        .await
        .unwrap();
    assert_eq!(proxy.mode(), Mode::Pass);
    let t1 = Instant::now();
    wait_for_health(&daemon, 200, Duration::from_secs(60)).await;
    println!(
        "{tag}: healthy {:?} after the broker became reachable",
        t1.elapsed()
    );

    let out = collect(
        direct.as_ref(),
        &to_broker,
        Source::Queue,
        to_sink.len(),
        Duration::from_secs(30),
    )
    .await;
    let t = tally(&to_sink, &out);
    t.assert_none_lost(&format!("{tag}: sink unreachable at start"));
    let jobs = collect(
        &memory_adapter,
        "jobs",
        Source::Queue,
        from_source.len(),
        Duration::from_secs(30),
    )
    .await;
    println!(
        "{tag}: all flowed {:?} after the broker became reachable",
        t1.elapsed()
    );
    let t = tally(&from_source, &jobs);
    t.assert_none_lost(&format!("{tag}: source unreachable at start"));
    assert_nothing_dead_lettered(&memory_adapter, "calls").await;
    let metrics = daemon.metrics.clone();
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.counts(),
        vec![
            ("from-memory".to_owned(), 50, 50),
            ("from-broker".to_owned(), 50, 50)
        ]
    );
    drop(metrics);
    direct.close().await.unwrap();
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_rabbitmq() {
    starts_before_the_broker(Broker::RabbitMq, "rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_kafka() {
    starts_before_the_broker(Broker::Kafka, "kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_sqs() {
    starts_before_the_broker(Broker::Sqs, "sqs").await;
}

/// `wait_for_brokers = false` keeps the fail-fast start.
#[tokio::test]
async fn fail_fast_when_asked() {
    let port = unused_port().unwrap();
    let toml = format!(
        r#"
        wait_for_brokers = false
        [http]
        listen = "off"
        [adapters]
        memory = "memory://fail-fast"
        rabbit = "amqp://guest:guest@{port}/%2f"
        [[sources]]
        name = "in"
        adapter = "memory"
        queue = "calls"
        [[routes]]
        name = "out"
        sink = "rabbit"
        queue = "jobs"
        "#
    );
    let config = ojs_bridge::config::BridgeConfig::parse(&toml, "test", &[]).unwrap();
    let err = ojs_bridge::daemon::Daemon::start(config).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("adapter `rabbit`"), "{text}");
    assert!(!text.contains("guest:guest"), "{text}");

    // The same from the command line: the flag wins over the file.
    let dir = ojs_bridge_tests::tempdir::TempDir::new("fail-fast");
    let path = dir.path().join("bridge.toml");
    std::fs::write(&path, toml.replace("wait_for_brokers = false", "")).unwrap();
    let out = support::ojs_bridge(
        &[
            "run",
            "--config",
            path.to_str().unwrap(),
            "--wait-for-brokers=false",
        ],
        b"",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("adapter `rabbit`"), "{stderr}");
    assert!(!stderr.contains("guest:guest"), "{stderr}");
}

/// An SQS endpoint that accepts connections and never answers (a black
/// hole): every call fails, as retryable, within its timeout instead of
/// hanging — a publish, a receive and an ack (DeleteMessageBatch) alike —
/// and works again once the link is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_calls_time_out_in_a_black_hole() {
    let Some(endpoint) = find(Broker::Sqs).await else {
        return;
    };
    let proxy = FaultProxy::start(upstream(&endpoint.url)).await.unwrap();
    let url = format!(
        "{}&call_timeout_secs=1",
        through(&endpoint.url, proxy.addr())
    );
    let sqs = AdapterConfig::from_url(&url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let queue = unique_queue("faults-sqs-hole");
    sqs.prepare(&queue).await.unwrap();
    let message = || OutgoingMessage::new(b"x".to_vec(), "application/octet-stream");
    sqs.publish(&queue, vec![message()]).await.unwrap();
    let mut consumer = sqs
        .consumer(&queue, ojs_queue::ConsumerOptions::default())
        .await
        .unwrap();
    let delivery =
        ojs_bridge_tests::consume::next_delivery(consumer.as_mut(), Duration::from_secs(10))
            .await
            .unwrap();

    proxy.set(Mode::BlackHole);
    let patience = Duration::from_secs(60);
    let publish = tokio::time::timeout(patience, sqs.publish(&queue, vec![message()]))
        .await
        .expect("a publish into a black hole returns");
    let e = publish.unwrap_err();
    assert!(
        e.is_retryable() || matches!(e, ojs_queue::Error::Publish(_)),
        "{e}"
    );
    let ack = tokio::time::timeout(patience, delivery.ack())
        .await
        .expect("an ack into a black hole returns");
    assert!(ack.is_err(), "the ack did not reach SQS");
    let receive = tokio::time::timeout(patience, consumer.receive(1, Duration::from_secs(1)))
        .await
        .expect("a receive from a black hole returns");
    assert!(receive.unwrap_err().is_retryable());

    proxy.set(Mode::Pass);
    sqs.publish(&queue, vec![message()]).await.unwrap();
    consumer.close().await.unwrap();
    sqs.close().await.unwrap();
}

/// A RabbitMQ memory alarm for 30 s at a sink: RabbitMQ blocks the
/// publishing connection; health turns 503 saying so, the source messages
/// wait (nothing dead-lettered), and all arrive once the alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_memory_alarm_holds_the_sink_and_loses_nothing() {
    let Some(endpoint) = find(Broker::RabbitMq).await else {
        return;
    };
    let sink_queue = unique_queue("faults-alarm");
    let memory = format!("faults-{}", uuid::Uuid::new_v4().simple());
    let url = format!(
        "{}{}publish_timeout_secs=3",
        endpoint.url,
        if endpoint.url.contains('?') { '&' } else { '?' }
    );
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        health_interval = "200ms"
        [adapters]
        memory = "memory://{memory}"
        rabbit = "{url}"
        [[sources]]
        name = "calls"
        adapter = "memory"
        queue = "calls"
        visibility_timeout = "2s"
        [[routes]]
        name = "to-rabbit"
        sink = "rabbit"
        queue = "{sink_queue}"
        "#
    );
    let direct = AdapterConfig::from_url(&endpoint.url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    direct.prepare(&sink_queue).await.unwrap();
    let daemon = start(&toml, BTreeMap::new()).await;
    wait_for_health(&daemon, 200, Duration::from_secs(10)).await;
    let memory_adapter = MemoryAdapter::named(&memory);
    let before = calls(20, "alarm.before");
    memory_adapter
        .publish("calls", before.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let first = collect(
        direct.as_ref(),
        &sink_queue,
        Source::Queue,
        before.len(),
        Duration::from_secs(10),
    )
    .await;
    tally(&before, &first).assert_none_lost("before the alarm");

    let Some(alarm) = ojs_bridge_tests::brokers::MemoryAlarm::raise() else {
        ojs_bridge_tests::brokers::missing::<()>(
            "OJS_BRIDGE_TEST_RABBITMQCTL",
            "rabbitmqctl cannot set the memory watermark",
        );
        return;
    };
    let during = calls(200, "alarm.during");
    memory_adapter
        .publish("calls", during.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let body = wait_for_health(&daemon, 503, Duration::from_secs(20)).await;
    assert!(body.contains("rabbit"), "{body}");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (status, body) = health(&daemon).await;
    assert_eq!(status, 503, "still held after 30 s: {body}");
    drop(alarm);

    wait_for_health(&daemon, 200, Duration::from_secs(60)).await;
    let after = collect(
        direct.as_ref(),
        &sink_queue,
        Source::Queue,
        during.len(),
        Duration::from_secs(30),
    )
    .await;
    tally(&during, &after).assert_none_lost("RabbitMQ memory alarm 30 s at the sink");
    assert_nothing_dead_lettered(&memory_adapter, "calls").await;
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].acked, 220,
        "every call acked at the source"
    );
    direct.close().await.unwrap();
}

/// The embedded broker as a sink runs out of room (its `max_size_bytes`
/// quota, as a full disk would): publishes fail as the sink's fault, health
/// turns 503, source messages wait and nothing is dead-lettered; once a
/// consumer drains the sink and frees room, everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_embedded_sink_holds_the_source_until_room_is_freed() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("faults-full");
    let sink_url = format!(
        "local:{}?max_size_bytes=262144",
        dir.path().join("sink").display()
    );
    let memory = format!("faults-{}", uuid::Uuid::new_v4().simple());
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        health_interval = "200ms"
        [adapters]
        memory = "memory://{memory}"
        sink = "{sink_url}"
        [[sources]]
        name = "calls"
        adapter = "memory"
        queue = "calls"
        batch_size = 20
        [[routes]]
        name = "to-local"
        sink = "sink"
        queue = "jobs"
        "#
    );
    let daemon = start(&toml, BTreeMap::new()).await;
    let memory_adapter = MemoryAdapter::named(&memory);
    let sent: HashMap<String, grpcq::Message> = (0..400)
        .map(|i| {
            let mut c = call(i, "faults.full", "Run");
            c.payload = vec![b'p'; 2048];
            (call_job_id(&c.message_id, c.timestamp_ms), c)
        })
        .collect();
    memory_adapter
        .publish("calls", sent.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let body = wait_for_health(&daemon, 503, Duration::from_secs(30)).await;
    assert!(
        body.contains("to-local"),
        "the failing sink is named: {body}"
    );

    let sink = AdapterConfig::from_url(&format!("local:{}", dir.path().join("sink").display()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let jobs = collect(
        sink.as_ref(),
        "jobs",
        Source::Queue,
        sent.len(),
        Duration::from_secs(30),
    )
    .await;
    tally(&sent, &jobs).assert_none_lost("embedded sink full, then room freed");
    assert_nothing_dead_lettered(&memory_adapter, "calls").await;
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].acked, 400,
        "every call acked at the source"
    );
    sink.close().await.unwrap();
}

/// Where the calls come from in the SIGKILL tests.
#[derive(Debug, Clone, Copy)]
enum KillSource {
    Broker(Broker),
    /// An embedded broker of the test's own.
    Local,
    /// The sink's own embedded broker, one adapter for both: the route
    /// runs as moves within it (`ojs_queue::MoveWithin`), exactly once.
    SinkItself,
}

/// When the daemon process is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillAt {
    /// While it runs.
    Running,
    /// After SIGTERM, once it logged that it is finishing in-flight work.
    Draining,
}

/// The daemon process SIGKILLed once 30 % of the calls on a source reached
/// the sink (an embedded broker), while running or during its shutdown
/// drain, then restarted: every call arrives, duplicates keep their job id.
async fn sigkill_at_30_percent(source_kind: KillSource, tag: &str, n: usize, at: KillAt) {
    let dir = ojs_bridge_tests::tempdir::TempDir::new(&format!("faults-kill-{tag}"));
    let url = match source_kind {
        KillSource::Broker(broker) => {
            let Some(endpoint) = find(broker).await else {
                return;
            };
            endpoint.url
        }
        KillSource::Local => format!("local:{}", dir.path().join("source").display()),
        KillSource::SinkItself => format!("local:{}", dir.path().join("sink").display()),
    };
    let data = dir.path().join("sink");
    let within = matches!(source_kind, KillSource::SinkItself);
    let route_sink = if within { "broker" } else { "sink" };
    let queue = unique_queue(&format!("faults-kill-{tag}"));
    let config = dir.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            shutdown_timeout = "10s"
            [http]
            listen = "off"
            [adapters]
            broker = "{url}"
            sink = "local:{data}"
            [[sources]]
            name = "calls"
            adapter = "broker"
            queue = "{queue}"
            group = "faults-kill-{tag}"
            visibility_timeout = "5s"
            [[routes]]
            name = "to-local"
            sink = "{route_sink}"
            queue = "jobs"
            "#,
            data = data.display()
        ),
    )
    .unwrap();
    let source = AdapterConfig::from_url(&url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    source.prepare(&queue).await.unwrap();
    let sent = calls(n, &format!("kill.{tag}"));
    let messages: Vec<OutgoingMessage> = sent.values().map(ojs_grpcq::outgoing).collect();
    for chunk in messages.chunks(500) {
        source.publish(&queue, chunk.to_vec()).await.unwrap();
    }
    let sink = AdapterConfig::from_url(&format!("local:{}", data.display()))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // Generous for moto, which serves tens of messages a second.
    let patience = Duration::from_secs(120).max(Duration::from_millis(n as u64 * 30));
    let (mut daemon, lines) = support::spawn_daemon_watched(&config);
    let deadline = Instant::now() + patience;
    loop {
        let done = sink.depth("jobs").await.unwrap().unwrap_or(0) as usize;
        if done >= n * 3 / 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done} of {n} in {patience:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if at == KillAt::Draining {
        let term = std::process::Command::new("kill")
            .args(["-TERM", &daemon.id().to_string()])
            .status()
            .unwrap();
        assert!(term.success());
        let log_deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let line = lines
                .recv_timeout(log_deadline.saturating_duration_since(Instant::now()))
                .expect("the daemon logs that it is draining");
            if line.contains("finishing in-flight") {
                break;
            }
        }
    }
    daemon.kill().unwrap(); // SIGKILL
    let status = daemon.wait().unwrap();
    std::thread::spawn(move || while lines.recv().is_ok() {});
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "the daemon was killed, not finished ({status})"
        );
    }
    let at_kill = sink.depth("jobs").await.unwrap().unwrap_or(0);

    let mut daemon = support::spawn_daemon(&config);
    let deadline = Instant::now() + patience + Duration::from_secs(60);
    let mut jobs = Vec::new();
    let mut t = tally(&sent, &jobs);
    while !t.complete() {
        assert!(Instant::now() < deadline, "not complete in time: {t}");
        jobs.extend(
            collect(
                sink.as_ref(),
                "jobs",
                Source::Queue,
                n,
                Duration::from_secs(2),
            )
            .await,
        );
        t = tally(&sent, &jobs);
    }
    let status = std::process::Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(daemon.wait().unwrap().success(), "SIGTERM exits 0");
    jobs.extend(
        collect(
            sink.as_ref(),
            "jobs",
            Source::Queue,
            usize::MAX,
            Duration::from_secs(2),
        )
        .await,
    );
    println!("{tag}: killed ({at:?}) with {at_kill} of {n} at the sink");
    let t = tally(&sent, &jobs);
    t.assert_none_lost(&format!("{tag} source: SIGKILL at 30 % ({at:?}), restart"));
    if within {
        assert!(
            (at_kill as usize) < n,
            "{tag}: every call was moved before the kill: nothing tested"
        );
        // Each call was taken, published and removed in one transaction:
        // the kill left it either a call or a job, never both.
        assert_eq!(t.duplicates(), 0, "{tag}: moved twice: {t}");
        assert_eq!(
            source.depth(&queue).await.unwrap(),
            Some(0),
            "{tag}: calls left"
        );
    }
    source.close().await.unwrap();
    sink.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_a_rabbitmq_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::RabbitMq),
        "rabbitmq",
        10_000,
        KillAt::Running,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_a_kafka_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::Kafka),
        "kafka",
        10_000,
        KillAt::Running,
    )
    .await;
}

/// Calls for the SQS kill tests: 1,000 in CI, not 10,000, because moto
/// serves tens of messages a second here; `OJS_BRIDGE_FAULT_SQS_CALLS=10000`
/// runs the full figure.
fn sqs_calls() -> usize {
    std::env::var("OJS_BRIDGE_FAULT_SQS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_an_sqs_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::Sqs),
        "sqs",
        sqs_calls(),
        KillAt::Running,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_an_embedded_source() {
    sigkill_at_30_percent(KillSource::Local, "local", 10_000, KillAt::Running).await;
}

/// A route from one queue of the embedded broker to another of the same
/// one runs as moves: killed at 30 % and restarted, no call is lost and
/// none becomes a job twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_within_one_embedded_broker_moves_each_call_once() {
    sigkill_at_30_percent(KillSource::SinkItself, "within", 50_000, KillAt::Running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_the_drain_with_a_rabbitmq_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::RabbitMq),
        "rabbitmq-drain",
        10_000,
        KillAt::Draining,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_the_drain_with_a_kafka_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::Kafka),
        "kafka-drain",
        10_000,
        KillAt::Draining,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_the_drain_with_an_sqs_source() {
    sigkill_at_30_percent(
        KillSource::Broker(Broker::Sqs),
        "sqs-drain",
        sqs_calls(),
        KillAt::Draining,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_the_drain_with_an_embedded_source() {
    sigkill_at_30_percent(KillSource::Local, "local-drain", 10_000, KillAt::Draining).await;
}

/// What reached the memory sink `name` once it works again: `n` jobs (the
/// daemon retries on its backoff, up to 10 s apart), then anything more
/// within 2 s (duplicates).
async fn settled_jobs(name: &str, n: usize) -> Vec<ojs_queue::Delivery> {
    let sink = MemoryAdapter::named(name);
    let mut jobs = collect(&sink, "jobs", Source::Queue, n, Duration::from_secs(40)).await;
    jobs.extend(
        collect(
            &sink,
            "jobs",
            Source::Queue,
            usize::MAX,
            Duration::from_secs(2),
        )
        .await,
    );
    jobs
}

/// A daemon config for one Kafka (or SQS) source into an embedded sink.
fn broker_to_local(url: &str, queue: &str, group: &str, sink: &std::path::Path) -> String {
    format!(
        r#"
        shutdown_timeout = "10s"
        [http]
        listen = "off"
        [adapters]
        broker = "{url}"
        sink = "local:{sink}"
        [[sources]]
        name = "calls"
        adapter = "broker"
        queue = "{queue}"
        group = "{group}"
        [[routes]]
        name = "to-local"
        sink = "sink"
        queue = "jobs"
        "#,
        sink = sink.display()
    )
}

/// Scale-out and failover on one Kafka consumer group: a daemon process
/// reads 10,000 calls; a second joins the group at 30 % (a rebalance with
/// batches in flight), the first is SIGKILLed at 60 % (its partitions go to
/// the second once its session expires). Each has its own embedded sink.
/// On tansu the first daemon usually reaches 60 % before the second's join
/// completes (tansu holds a join for half the session timeout): the figure
/// printed says how much each had delivered at the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_rebalance_two_daemons_in_one_group() {
    let Some(endpoint) = find(Broker::Kafka).await else {
        return;
    };
    let broker_url = endpoint.url;
    let n = 10_000;
    let dir = ojs_bridge_tests::tempdir::TempDir::new("faults-rebalance");
    let queue = unique_queue("faults-rebalance");
    let group = format!("g-{queue}");
    // Kafka's smallest session by default (group.min.session.timeout.ms).
    // Kafka's smallest session by default (group.min.session.timeout.ms).
    let url = format!("{broker_url}?session_timeout_ms=6000");
    let mut configs = Vec::new();
    let mut sinks = Vec::new();
    for name in ["a", "b"] {
        let data = dir.path().join(name);
        let config = dir.path().join(format!("{name}.toml"));
        std::fs::write(&config, broker_to_local(&url, &queue, &group, &data)).unwrap();
        configs.push(config);
        sinks.push(
            AdapterConfig::from_url(&format!("local:{}", data.display()))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
    }
    let source = AdapterConfig::from_url(&broker_url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    source.prepare(&queue).await.unwrap();
    let sent = calls(n, "rebalance");
    let messages: Vec<OutgoingMessage> = sent.values().map(ojs_grpcq::outgoing).collect();
    for chunk in messages.chunks(500) {
        source.publish(&queue, chunk.to_vec()).await.unwrap();
    }
    let started = Instant::now();
    let depth = |i: usize| {
        let sink = sinks[i].clone();
        async move { sink.depth("jobs").await.unwrap().unwrap_or(0) as usize }
    };
    let wait_until = |what: &'static str, want: usize| {
        let sinks = sinks.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(180);
            loop {
                let mut total = 0;
                for s in &sinks {
                    total += s.depth("jobs").await.unwrap().unwrap_or(0) as usize;
                }
                if total >= want {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: only {total} in 180 s");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let mut first = support::spawn_daemon(&configs[0]);
    wait_until("30 %", n * 3 / 10).await;
    let mut second = support::spawn_daemon(&configs[1]);
    wait_until("60 %", n * 6 / 10).await;
    let (first_had, second_had) = (depth(0).await, depth(1).await);
    let killed_at = started.elapsed();
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();

    let deadline = Instant::now() + Duration::from_secs(180);
    let mut jobs = Vec::new();
    let mut t = tally(&sent, &jobs);
    while !t.complete() {
        assert!(Instant::now() < deadline, "not complete after 180 s: {t}");
        for sink in &sinks {
            jobs.extend(
                collect(
                    sink.as_ref(),
                    "jobs",
                    Source::Queue,
                    n,
                    Duration::from_secs(1),
                )
                .await,
            );
        }
        t = tally(&sent, &jobs);
    }
    let term = std::process::Command::new("kill")
        .args(["-TERM", &second.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(second.wait().unwrap().success(), "SIGTERM exits 0");
    for sink in &sinks {
        jobs.extend(
            collect(
                sink.as_ref(),
                "jobs",
                Source::Queue,
                usize::MAX,
                Duration::from_secs(2),
            )
            .await,
        );
    }
    let t = tally(&sent, &jobs);
    println!(
        "kafka rebalance: killed the first daemon after {killed_at:?}, when it had delivered {first_had} \
         and the second {second_had}; sent {} received {} duplicated {} lost {}",
        t.sent_count(),
        t.distinct_received(),
        t.duplicates(),
        t.lost().len()
    );
    t.assert_none_lost("kafka: a second daemon joins at 30 %, the first is killed at 60 %");
    source.close().await.unwrap();
}

/// A Kafka source behind a sink that fails for four times librdkafka's
/// `max.poll.interval.ms`: the daemon stops receiving (it holds what it has
/// and retries the sink), and the consumer stays in its group (the adapter
/// pauses and keeps polling), so nothing is received twice and nothing is
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_source_behind_a_stalled_sink_stays_in_its_group() {
    let Some(endpoint) = find(Broker::Kafka).await else {
        return;
    };
    let queue = unique_queue("faults-stalled");
    let sink_name = format!("faults-stalled-{}", uuid::Uuid::new_v4().simple());
    let url = format!(
        // librdkafka wants max.poll.interval.ms ≥ the session, and
        // heartbeats well inside the session (3 s by default would expire it).
        "{}?max.poll.interval.ms=3000&session_timeout_ms=3000&heartbeat.interval.ms=500",
        endpoint.url
    );
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        broker = "{url}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "broker"
        queue = "{queue}"
        group = "g-{queue}"
        batch_size = 10
        max_in_flight = 50
        [[routes]]
        name = "stalled"
        sink = "sink"
        queue = "jobs"
        "#
    );
    let source = AdapterConfig::from_url(&endpoint.url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    source.prepare(&queue).await.unwrap();
    let sent = calls(200, "stalled");
    let sink = support::TestSink::new(&sink_name).starting_down();
    let down = sink.down.clone();
    let sink: std::sync::Arc<dyn QueueAdapter> = std::sync::Arc::new(sink);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    source
        .publish(&queue, sent.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    // 12 s of failing sink: four times max.poll.interval.ms.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (status, body) = health(&daemon).await;
    assert_eq!(status, 503, "the failing sink shows: {body}");
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let jobs = settled_jobs(&sink_name, sent.len()).await;
    let t = tally(&sent, &jobs);
    println!(
        "kafka source, sink stalled 12 s (max.poll.interval.ms 3000): sent {} received {} duplicated {} lost {}",
        t.sent_count(),
        t.distinct_received(),
        t.duplicates(),
        t.lost().len()
    );
    t.assert_none_lost("kafka source behind a stalled sink");
    assert_eq!(t.duplicates(), 0, "the consumer never left its group");
    let summary = daemon.shutdown().await;
    assert_eq!(summary.counts(), vec![("calls".to_owned(), 200, 200)]);
    let dead = collect(
        source.as_ref(),
        &queue,
        Source::DeadLetters,
        1,
        Duration::from_secs(8),
    )
    .await;
    assert!(dead.is_empty(), "{} dead-lettered", dead.len());
    source.close().await.unwrap();
}

/// The operator's case from the issue: an SQS source whose redrive policy
/// moves a message after 3 receives, a 2 s visibility timeout, and a sink
/// down for 20 s (ten visibility timeouts). The daemon extends the leases
/// of what it holds, so every call is received once and the source's
/// dead-letter queue stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_source_outlives_a_sink_down_for_ten_visibility_timeouts() {
    let Some(endpoint) = find(Broker::Sqs).await else {
        return;
    };
    let queue = unique_queue("faults-sqs-lease");
    let sink_name = format!("faults-sqs-lease-{}", uuid::Uuid::new_v4().simple());
    let url = if endpoint.url.contains('?') {
        format!("{}&max_receive_count=3", endpoint.url)
    } else {
        format!("{}?max_receive_count=3", endpoint.url)
    };
    let toml = format!(
        r#"
        shutdown_timeout = "5s"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        broker = "{url}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "broker"
        queue = "{queue}"
        visibility_timeout = "2s"
        [[routes]]
        name = "down"
        sink = "sink"
        queue = "jobs"
        "#
    );
    let source = AdapterConfig::from_url(&url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    source.prepare(&queue).await.unwrap();
    let sent = calls(20, "sqs-lease");
    let sink = support::TestSink::new(&sink_name).starting_down();
    let down = sink.down.clone();
    let sink: std::sync::Arc<dyn QueueAdapter> = std::sync::Arc::new(sink);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    source
        .publish(&queue, sent.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(20)).await;
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let jobs = settled_jobs(&sink_name, sent.len()).await;
    let t = tally(&sent, &jobs);
    let summary = daemon.shutdown().await;
    let dlq_depth = collect(
        source.as_ref(),
        &queue,
        Source::DeadLetters,
        usize::MAX,
        Duration::from_secs(3),
    )
    .await
    .len();
    println!(
        "sqs source, sink down 20 s (visibility 2 s, max_receive_count 3): sent {} received {} \
         duplicated {} lost {}; source receives {:?}; dead-letter queue depth {dlq_depth}",
        t.sent_count(),
        t.distinct_received(),
        t.duplicates(),
        t.lost().len(),
        summary.counts()
    );
    t.assert_none_lost("sqs source behind a sink down for ten visibility timeouts");
    assert_eq!(dlq_depth, 0, "nothing moved to the dead-letter queue");
    assert_eq!(
        summary.counts(),
        vec![("calls".to_owned(), 20, 20)],
        "each call received once"
    );
    source.close().await.unwrap();
}
