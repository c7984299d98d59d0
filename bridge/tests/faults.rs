//! The daemon under broker faults that a graceful restart does not show,
//! through the fault proxy (tests/src/fault_proxy.rs): a broker that is not
//! there when the daemon starts, a link that black-holes, a sink that hangs.
//! Each case prints sent / received / duplicates / lost; lost must be 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ojs_adapter_memory::MemoryAdapter;
use ojs_bridge::endpoint::AdapterConfig;
use ojs_bridge_tests::brokers::{find, probe_address, unique_queue, Broker};
use ojs_bridge_tests::fault_proxy::{unused_port, FaultProxy, Mode};
use ojs_bridge_tests::tally::Tally;
use ojs_core::mapping::call_job_id;
use ojs_core::{grpcq, Encoding, OutgoingMessage, QueueAdapter, Source};
use support::{call, collect, http_get, start, Running};

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

fn tally(sent: &HashMap<String, grpcq::Message>, jobs: &[ojs_core::Delivery]) -> Tally {
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
        .publish(
            "calls",
            to_sink.values().map(OutgoingMessage::from_grpcq).collect(),
        )
        .await
        .unwrap();
    direct
        .publish(
            &from_broker,
            from_source
                .values()
                .map(OutgoingMessage::from_grpcq)
                .collect(),
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
        summary.sources,
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
        .consumer(&queue, ojs_core::ConsumerOptions::default())
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
        e.is_retryable() || matches!(e, ojs_core::Error::Publish(_)),
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
        .publish(
            "calls",
            before.values().map(OutgoingMessage::from_grpcq).collect(),
        )
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
        .publish(
            "calls",
            during.values().map(OutgoingMessage::from_grpcq).collect(),
        )
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
    assert_eq!(summary.sources[0].2, 220, "every call acked at the source");
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
        .publish(
            "calls",
            sent.values().map(OutgoingMessage::from_grpcq).collect(),
        )
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
    assert_eq!(summary.sources[0].2, 400, "every call acked at the source");
    sink.close().await.unwrap();
}

/// The daemon process SIGKILLed once 30 % of the calls on a broker source
/// reached the sink (an embedded broker), then restarted: every call
/// arrives, duplicates keep their job id.
async fn sigkill_at_30_percent(broker: Broker, tag: &str, n: usize) {
    let Some(endpoint) = find(broker).await else {
        return;
    };
    let dir = ojs_bridge_tests::tempdir::TempDir::new(&format!("faults-kill-{tag}"));
    let data = dir.path().join("sink");
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
            sink = "sink"
            queue = "jobs"
            "#,
            url = endpoint.url,
            data = data.display()
        ),
    )
    .unwrap();
    let source = AdapterConfig::from_url(&endpoint.url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    source.prepare(&queue).await.unwrap();
    let sent = calls(n, &format!("kill.{tag}"));
    let messages: Vec<OutgoingMessage> = sent.values().map(OutgoingMessage::from_grpcq).collect();
    for chunk in messages.chunks(500) {
        source.publish(&queue, chunk.to_vec()).await.unwrap();
    }
    let sink = AdapterConfig::from_url(&format!("local:{}", data.display()))
        .unwrap()
        .connect()
        .await
        .unwrap();

    let mut daemon = support::spawn_daemon(&config);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = sink.depth("jobs").await.unwrap().unwrap_or(0) as usize;
        if done >= n * 3 / 10 {
            break;
        }
        assert!(Instant::now() < deadline, "only {done} of {n} in 120 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    daemon.kill().unwrap(); // SIGKILL
    daemon.wait().unwrap();
    let at_kill = sink.depth("jobs").await.unwrap().unwrap_or(0);

    let mut daemon = support::spawn_daemon(&config);
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut jobs = Vec::new();
    let mut t = tally(&sent, &jobs);
    while !t.complete() {
        assert!(Instant::now() < deadline, "not complete after 180 s: {t}");
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
    println!("{tag}: killed with {at_kill} of {n} at the sink");
    tally(&sent, &jobs).assert_none_lost(&format!("{tag} source: SIGKILL at 30 %, restart"));
    source.close().await.unwrap();
    sink.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_a_rabbitmq_source() {
    sigkill_at_30_percent(Broker::RabbitMq, "rabbitmq", 10_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_a_kafka_source() {
    sigkill_at_30_percent(Broker::Kafka, "kafka", 10_000).await;
}

/// 1,000, not 10,000: moto serves about twenty messages a second here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_30_percent_with_an_sqs_source() {
    sigkill_at_30_percent(Broker::Sqs, "sqs", 1_000).await;
}
