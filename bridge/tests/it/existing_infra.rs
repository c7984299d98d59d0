//! The CLI and the daemon on brokers they do not own: queues and topics made
//! beforehand by independent clients (pika, boto3, confluent-kafka) with
//! their own names and settings, in both topology modes; grpcq's own Kafka
//! convention; messages as the OJS project's own backends write them; and a
//! missing resource under `topology = "existing"` stopping `run`, named,
//! with nothing created.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::support::ojs_bridge;
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_bridge_tests::independent;
use ojs_queue::QueueAdapter as _;
use serde_json::{json, Value};

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An OJS JSON envelope as the OJS project's backends write it.
fn ojs_job(i: usize, queue: &str) -> Value {
    json!({
        "specversion": "1.0",
        "id": uuid::Uuid::now_v7().to_string(),
        "type": "email.send",
        "queue": queue,
        "args": [format!("user{i}@example.com")],
    })
}

fn ndjson(values: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in values {
        out.extend_from_slice(v.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

/// Waits until `poll` has returned `want` items in total.
fn gather(
    want: usize,
    patience: Duration,
    mut poll: impl FnMut(usize) -> Vec<Value>,
) -> Vec<Value> {
    let deadline = Instant::now() + patience;
    let mut got = Vec::new();
    while got.len() < want && Instant::now() < deadline {
        got.extend(poll(want - got.len()));
    }
    got
}

fn report(what: &str, sent: usize, received: usize) {
    println!(
        "{what}: sent {sent} received {received} lost {}",
        sent.saturating_sub(received)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_queues_made_elsewhere_through_the_cli_and_the_daemon() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    for topology in ["declare", "existing"] {
        // Their names and their arguments; published to through the
        // default exchange.
        let input = unique_queue("orders-in");
        let output = unique_queue("orders-out");
        independent::run(&["rabbit-queue", &input, "--arg", "x-queue-mode=lazy"]).unwrap();
        independent::run(&["rabbit-queue", &output, "--arg", "x-max-length=100000"]).unwrap();
        let url = format!(
            "{}?queue_template={{queue}}&exchange=&topology={topology}",
            rabbit.url
        );
        // 10 jobs as the OJS AMQP binding writes them (JSON, content type).
        independent::run(&[
            "rabbit-publish",
            "--routing-key",
            &input,
            "--content-type",
            "application/openjobspec+json",
            "--count",
            "10",
            "--body",
            &ojs_job(0, &input).to_string(),
        ])
        .unwrap();
        // 5 through the CLI.
        let jobs: Vec<Value> = (0..5).map(|i| ojs_job(i, "ignored")).collect();
        let sent = ok(&ojs_bridge(
            &["send", "--to", &url, "--queue", &input],
            &ndjson(&jobs),
        ));
        assert_eq!(sent.trim(), "sent 5");

        let toml = format!(
            r#"
            [http]
            listen = "off"
            [adapters.rabbit]
            url = "{}"
            queue_template = "{{queue}}"
            exchange = ""
            topology = "{topology}"
            [[sources]]
            name = "in"
            adapter = "rabbit"
            queue = "{input}"
            format = "ojs"
            [[routes]]
            name = "out"
            sink = "rabbit"
            queue = "{output}"
            encoding = "json"
            "#,
            rabbit.url
        );
        let daemon = support::start(&toml, BTreeMap::new()).await;
        let got = gather(15, Duration::from_secs(30), |n| {
            independent::lines(&[
                "rabbit-get",
                &output,
                "--count",
                &n.to_string(),
                "--timeout",
                "2",
            ])
            .unwrap()
        });
        daemon.shutdown().await;
        report(&format!("rabbitmq ({topology})"), 15, got.len());
        assert_eq!(got.len(), 15);
        assert!(got
            .iter()
            .all(|m| m["content_type"] == "application/openjobspec+json"));
        // The CLI reads their queue too.
        independent::run(&[
            "rabbit-publish",
            "--routing-key",
            &output,
            "--content-type",
            "application/openjobspec+json",
            "--body",
            &ojs_job(1, &output).to_string(),
        ])
        .unwrap();
        let tailed = ok(&ojs_bridge(
            &[
                "tail",
                "--from",
                &url,
                "--queue",
                &output,
                "--count",
                "1",
                "--ack",
                "--timeout-secs",
                "10",
            ],
            b"",
        ));
        let line: Value = serde_json::from_str(tailed.trim()).unwrap();
        assert_eq!(line["message"]["type"], "email.send");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_grpcq_topics_and_ojs_backend_records_through_the_cli_and_the_daemon() {
    let Some(kafka) = find(Broker::Kafka).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    for topology in ["declare", "existing"] {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
        // grpcq's own topic naming, made by another client.
        let grpcq_topic = format!("payment{id}.PaymentService");
        let ojs_topic = format!("ojs-backend-{id}");
        let jobs_topic = format!("jobs-{id}");
        for t in [&grpcq_topic, &ojs_topic, &jobs_topic] {
            independent::run(&["kafka-topic", t, "--partitions", "2"]).unwrap();
        }
        let url = format!(
            "{}?topic_template={{queue}}&topology={topology}&session_timeout_ms=2000&heartbeat.interval.ms=500",
            kafka.url
        );
        // `send --format grpcq` without --queue: each call to its topic, key = action.
        let calls: Vec<Value> = (0..10)
            .map(|i| {
                json!({"originator": "cli", "topic": grpcq_topic, "action": "ProcessPayment",
                       "payload": "AQID", "message_id": format!("m-{i}"), "timestamp_ms": 1_704_067_200_000i64 + i})
            })
            .collect();
        let sent = ok(&ojs_bridge(
            &["send", "--to", &url, "--format", "grpcq"],
            &ndjson(&calls),
        ));
        assert_eq!(sent.trim(), "sent 10");
        let seen = independent::lines(&[
            "kafka-consume",
            &grpcq_topic,
            "--count",
            "10",
            "--group",
            &unique_queue("indep"),
        ])
        .unwrap();
        assert_eq!(seen.len(), 10);
        assert!(
            seen.iter().all(|r| r["key"] == "ProcessPayment"),
            "{seen:?}"
        );
        // `tail` reads grpcq's records.
        let tailed = ok(&ojs_bridge(
            &[
                "tail",
                "--from",
                &url,
                "--queue",
                &grpcq_topic,
                "--format",
                "grpcq",
                "--count",
                "10",
                "--timeout-secs",
                "30",
                "--group",
                &unique_queue("tail"),
            ],
            b"",
        ));
        assert_eq!(tailed.lines().count(), 10, "{tailed}");
        assert!(tailed.contains("ProcessPayment"));

        // Records as the OJS project's Kafka backend writes them: JSON value,
        // no content type, ojs-job-id / ojs-type headers.
        let job = ojs_job(7, &ojs_topic);
        independent::run(&[
            "kafka-produce",
            &ojs_topic,
            "--count",
            "5",
            "--value",
            &job.to_string(),
            "--header",
            &format!("ojs-job-id={}", job["id"].as_str().unwrap()),
            "--header",
            "ojs-type=email.send",
        ])
        .unwrap();
        let tailed = ok(&ojs_bridge(
            &[
                "tail",
                "--from",
                &url,
                "--queue",
                &ojs_topic,
                "--count",
                "1",
                "--timeout-secs",
                "30",
                "--group",
                &unique_queue("tail"),
            ],
            b"",
        ));
        let line: Value = serde_json::from_str(tailed.lines().next().unwrap()).unwrap();
        assert_eq!(line["message"]["type"], "email.send", "{tailed}");

        // The daemon: grpcq calls and OJS-backend jobs from their topics into a
        // jobs topic of theirs.
        let toml = format!(
            r#"
            [http]
            listen = "off"
            [adapters.kafka]
            url = "{}"
            topic_template = "{{queue}}"
            topology = "{topology}"
            session_timeout_ms = 2000
            [[sources]]
            name = "calls"
            adapter = "kafka"
            queue = "{grpcq_topic}"
            group = "{}"
            [[sources]]
            name = "backend"
            adapter = "kafka"
            queue = "{ojs_topic}"
            format = "ojs"
            group = "{}"
            [[routes]]
            name = "jobs"
            sink = "kafka"
            queue = "{jobs_topic}"
            encoding = "json"
            "#,
            kafka.url,
            unique_queue("calls"),
            unique_queue("backend"),
        );
        let daemon = support::start(&toml, BTreeMap::new()).await;
        let got = gather(15, Duration::from_secs(60), |n| {
            independent::lines(&[
                "kafka-consume",
                &jobs_topic,
                "--count",
                &n.to_string(),
                "--timeout",
                "5",
                "--group",
                "jobs-reader",
            ])
            .unwrap()
        });
        daemon.shutdown().await;
        report(
            &format!("kafka ({topology}) grpcq + OJS backend → jobs"),
            15,
            got.len(),
        );
        assert_eq!(got.len(), 15);
        let types: Vec<String> = got
            .iter()
            .map(|r| {
                serde_json::from_str::<Value>(r["value"].as_str().unwrap()).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(types.iter().filter(|t| *t == "email.send").count(), 5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_queues_made_elsewhere_through_the_cli_and_the_daemon() {
    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    for topology in ["declare", "existing"] {
        let input = unique_queue("sqs-in");
        let output = unique_queue("sqs-out");
        independent::run(&["sqs-queue", &input, "--dlq", &format!("{input}-their-dlq")]).unwrap();
        independent::run(&["sqs-queue", &output]).unwrap();
        // As the OJS project's SQS backend writes them: JSON body, ojs.* attributes.
        independent::run(&[
            "sqs-send",
            &input,
            "--count",
            "10",
            "--body",
            &ojs_job(0, &input).to_string(),
            "--attr",
            "ojs.type=email.send",
            "--attr",
            "ojs.queue=default",
        ])
        .unwrap();
        let url = format!("{}&topology={topology}", sqs.url);
        let jobs: Vec<Value> = (0..5).map(|i| ojs_job(i, "x")).collect();
        let sent = ok(&ojs_bridge(
            &["send", "--to", &url, "--queue", &input],
            &ndjson(&jobs),
        ));
        assert_eq!(sent.trim(), "sent 5");
        let toml = format!(
            r#"
            [http]
            listen = "off"
            [adapters]
            sqs = "{url}"
            [[sources]]
            name = "in"
            adapter = "sqs"
            queue = "{input}"
            format = "ojs"
            [[routes]]
            name = "out"
            sink = "sqs"
            queue = "{output}"
            "#
        );
        let daemon = support::start(&toml, BTreeMap::new()).await;
        let tailed = ojs_bridge(
            &[
                "tail",
                "--from",
                &url,
                "--queue",
                &output,
                "--count",
                "15",
                "--ack",
                "--timeout-secs",
                "20",
            ],
            b"",
        );
        daemon.shutdown().await;
        let lines: Vec<Value> = ok(&tailed)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        report(&format!("sqs ({topology})"), 15, lines.len());
        assert_eq!(lines.len(), 15);
        assert!(lines.iter().all(|l| l["message"]["type"] == "email.send"));
        // Nothing of ours was created next to their queues.
        assert_eq!(
            independent::sqs_queues(&input).unwrap(),
            vec![input.clone(), format!("{input}-their-dlq")]
        );
        if topology == "existing" {
            assert_eq!(
                independent::sqs_queues(&output).unwrap(),
                vec![output.clone()]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_stops_naming_a_missing_resource_and_creates_nothing() {
    let (Some(rabbit), Some(kafka), Some(sqs)) = (
        find(Broker::RabbitMq).await,
        find(Broker::Kafka).await,
        find(Broker::Sqs).await,
    ) else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let dir = ojs_bridge_tests::tempdir::TempDir::new("existing-missing");
    let cases = [
        (
            "rabbit",
            format!(
                "{}?topology=existing&queue_template={{queue}}&exchange=",
                rabbit.url
            ),
        ),
        (
            "kafka",
            format!("{}?topology=existing&topic_template={{queue}}", kafka.url),
        ),
        ("sqs", format!("{}&topology=existing", sqs.url)),
    ];
    for (name, url) in cases {
        let queue = unique_queue("nowhere");
        let config = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[http]\nlisten = \"off\"\n[adapters]\nb = \"{url}\"\n[[sources]]\nname = \"s\"\nadapter = \"b\"\nqueue = \"{queue}\"\n[[routes]]\nname = \"r\"\nsink = \"b\"\nqueue = \"out\"\n"
            ),
        )
        .unwrap();
        let started = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
            .args(["run", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!(
            "{name}: exit {} in {:?}: {stderr}",
            out.status,
            started.elapsed()
        );
        assert!(!out.status.success());
        assert!(stderr.contains(&queue), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(30));
        let created = match name {
            "rabbit" => independent::rabbit_exists(&queue, false).unwrap(),
            "kafka" => !independent::kafka_topics(&queue).unwrap().is_empty(),
            _ => !independent::sqs_queues(&queue).unwrap().is_empty(),
        };
        assert!(!created, "{name} created {queue}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_permission_at_the_sink_makes_the_daemon_wait_not_dead_letter() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let user = unique_queue("no-write");
    if !ojs_bridge_tests::brokers::rabbitmqctl(&["add_user", &user, "pw-no-write"]) {
        ojs_bridge_tests::brokers::missing::<()>("rabbitmqctl", "cannot add a user");
        return;
    }
    // Read only: publishing is refused until `write` is granted.
    assert!(ojs_bridge_tests::brokers::rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &user,
        "^$",
        "^$",
        ".*"
    ]));
    let output = unique_queue("perm-out");
    independent::run(&["rabbit-queue", &output]).unwrap();
    let host = rabbit.url.rsplit('@').next().unwrap();
    let source = unique_queue("perm-src");
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        mem = "memory://{source}"
        [adapters.rabbit]
        url = "amqp://{user}:pw-no-write@{host}"
        topology = "existing"
        queue_template = "{{queue}}"
        exchange = ""
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        dead_letter = {{ adapter = "mem", queue = "dead" }}
        [[routes]]
        name = "out"
        sink = "rabbit"
        queue = "{output}"
        "#
    );
    let daemon = support::start(&toml, BTreeMap::new()).await;
    let memory = ojs_adapter_memory::MemoryAdapter::named(&source);
    memory
        .publish(
            "calls",
            (0..5)
                .map(|i| ojs_grpcq::outgoing(&support::call(i, "a.B", "C")))
                .collect(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, body) = support::http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("sink out"), "{body}");
    assert_eq!(
        memory.depth("dead").await.unwrap(),
        Some(0),
        "nothing dead-lettered"
    );
    assert!(ojs_bridge_tests::brokers::rabbitmq_may_not_configure(&user));
    let got = gather(5, Duration::from_secs(60), |n| {
        independent::lines(&[
            "rabbit-get",
            &output,
            "--count",
            &n.to_string(),
            "--timeout",
            "2",
        ])
        .unwrap()
    });
    daemon.shutdown().await;
    report(
        "sink without write permission for 3 s, then granted",
        5,
        got.len(),
    );
    assert_eq!(got.len(), 5);
    assert_eq!(memory.depth("dead").await.unwrap(), Some(0));
    ojs_bridge_tests::brokers::rabbitmqctl(&["delete_user", &user]);
}

/// A sink queue made elsewhere with `x-max-length` and `x-overflow =
/// reject-publish`: once full, RabbitMQ nacks each publish. A full queue is
/// the sink's state, not the messages' fault: the daemon keeps them, health
/// says the sink is failing, nothing is dead-lettered, and they go out as
/// soon as a reader makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_sink_queue_that_rejects_publishes_makes_the_daemon_wait_not_dead_letter() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let output = unique_queue("full-out");
    independent::run(&[
        "rabbit-queue",
        &output,
        "--arg",
        "x-max-length=3",
        "--arg",
        "x-overflow=reject-publish",
    ])
    .unwrap();
    let sent = 6;
    let (daemon, memory) = calls_to_existing_rabbitmq(&rabbit.url, "", &output, sent).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, body) = support::http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("sink out"), "{body}");
    assert_eq!(
        memory.depth("dead").await.unwrap(),
        Some(0),
        "nothing dead-lettered while the queue is full"
    );
    // A reader makes room, three at a time; the rest follow. Read until
    // every message came at least once: a copy published again after a
    // nack is a duplicate (at-least-once), not a message. Each message is
    // a publish of its own (`batch_size = 1`) whose retries back off to
    // 30 s (37.5 with jitter): one that twice finds the queue refilled by
    // the others waits that long twice. With 60 s, a loaded CI run read 5
    // of the 6 before the deadline; 150 s leaves room for two such waits
    // after the first minute, and a message that never comes still fails.
    let mut got = Vec::new();
    let mut ids = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(150);
    while ids.len() < sent && Instant::now() < deadline {
        for m in
            independent::lines(&["rabbit-get", &output, "--count", "3", "--timeout", "2"]).unwrap()
        {
            ids.insert(m["message_id"].as_str().unwrap_or_default().to_owned());
            got.push(m);
        }
    }
    println!(
        "sink queue full: read {} copies of {} messages",
        got.len(),
        ids.len()
    );
    let (status, body) = support::http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    daemon.shutdown().await;
    report(
        "sink queue full (x-max-length 3, reject-publish) until read",
        sent,
        ids.len(),
    );
    assert_eq!(ids.len(), sent, "{got:?}");
    assert_eq!(memory.depth("dead").await.unwrap(), Some(0));
    assert_eq!(status, 200, "healthy again once it had room: {body}");
}

/// A sink whose exchange has no binding for the routing key: RabbitMQ
/// returns each publish (`NO_ROUTE`). That is the topology's state, not
/// the messages' fault: the daemon keeps them (health 503 names the sink
/// and says why), nothing is dead-lettered, and they all go out once
/// someone adds the binding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_sink_makes_the_daemon_wait_for_the_binding_not_dead_letter() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let output = unique_queue("noroute-out");
    let exchange = unique_queue("noroute-ex");
    independent::run(&["rabbit-queue", &output]).unwrap();
    independent::run(&["rabbit-exchange", &exchange]).unwrap();
    let sent = 5;
    let (daemon, memory) = calls_to_existing_rabbitmq(&rabbit.url, &exchange, &output, sent).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (status, body) = support::http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
        if status == 503 && body.contains("unroutable") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "health never reported the unroutable sink: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(body.contains("sink out"), "{body}");
    assert!(body.contains("NO_ROUTE"), "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        memory.depth("dead").await.unwrap(),
        Some(0),
        "nothing dead-lettered while the binding is missing"
    );
    assert_eq!(daemon.metrics.dead_lettered_count("calls"), 0);
    // Whoever owns the topology adds the binding; everything flows.
    independent::run(&[
        "rabbit-exchange",
        &exchange,
        "--bind",
        &format!("{output}:{output}"),
    ])
    .unwrap();
    let got = gather(sent, Duration::from_secs(90), |n| {
        independent::lines(&[
            "rabbit-get",
            &output,
            "--count",
            &n.to_string(),
            "--timeout",
            "2",
        ])
        .unwrap()
    });
    let all: Vec<String> = got
        .iter()
        .map(|m| m["message_id"].as_str().unwrap_or_default().to_owned())
        .collect();
    let mut ids = all.clone();
    ids.sort();
    ids.dedup();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (status, body) = loop {
        let (status, body) = support::http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
        if status == 200 || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    daemon.shutdown().await;
    println!(
        "unroutable sink until bound: sent {sent} received {} duplicated {} lost {} dead-lettered {}",
        ids.len(),
        all.len() - ids.len(),
        sent - ids.len(),
        memory.depth("dead").await.unwrap().unwrap_or(0)
    );
    assert_eq!(ids.len(), sent, "{got:?}");
    assert_eq!(memory.depth("dead").await.unwrap(), Some(0));
    assert_eq!(status, 200, "healthy again once bound: {body}");
}

/// A daemon bridging grpcq calls from an in-process queue to RabbitMQ queue
/// `output`, made elsewhere (`topology = "existing"`), through `exchange`
/// (`""`: the default exchange); dead letters stay in process (queue
/// `dead`). `sent` calls are waiting at the source.
async fn calls_to_existing_rabbitmq(
    url: &str,
    exchange: &str,
    output: &str,
    sent: usize,
) -> (support::Running, ojs_adapter_memory::MemoryAdapter) {
    let source = unique_queue("existing-src");
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        mem = "memory://{source}"
        [adapters.rabbit]
        url = "{url}"
        topology = "existing"
        queue_template = "{{queue}}"
        exchange = "{exchange}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        batch_size = 1
        dead_letter = {{ adapter = "mem", queue = "dead" }}
        [[routes]]
        name = "out"
        sink = "rabbit"
        queue = "{output}"
        "#
    );
    let daemon = support::start(&toml, BTreeMap::new()).await;
    let memory = ojs_adapter_memory::MemoryAdapter::named(&source);
    memory
        .publish(
            "calls",
            (0..sent)
                .map(|i| ojs_grpcq::outgoing(&support::call(i, "a.B", "C")))
                .collect(),
        )
        .await
        .unwrap();
    (daemon, memory)
}
