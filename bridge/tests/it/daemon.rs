//! The daemon in-process on the in-memory broker: mapping, round trip,
//! poison messages, transcoding, backpressure, shutdown, health and metrics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{call, collect, http_get, metric, start, TestSink};
use ojs_adapter_memory::{MemoryAdapter, MemoryConfig};
use ojs_bridge_tests::tally::Tally;
use ojs_core::{Encoding, JobEnvelope};
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping::{self, call_job_id};
use ojs_queue::{header, OutgoingMessage, QueueAdapter, Source};
use prost::Message as _;
use serde_json::json;

fn broker_name() -> String {
    format!("daemon-{}", uuid::Uuid::new_v4().simple())
}

const IDLE: Duration = Duration::from_secs(3);

/// The smallest useful daemon: memory broker `name`, its queue `calls` to its
/// queue `default`, health and metrics on an ephemeral loopback port.
fn one_route_config(name: &str) -> String {
    format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[routes]]
        name = "all"
        sink = "mem"
        "#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcq_calls_become_ojs_jobs_with_binding_headers_and_deterministic_ids() {
    let name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        batch_size = 64
        max_in_flight = 256
        [[routes]]
        name = "payments"
        match = {{ topic = "payment.*" }}
        sink = "mem"
        queue = "payments"
        [[routes]]
        name = "default"
        sink = "mem"
        "#
    );
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let n = 600;
    let mut sent = HashMap::new();
    let mut tally = Tally::new();
    let mut batch = Vec::new();
    for i in 0..n {
        let topic = if i % 3 == 0 {
            "email.Mailer"
        } else {
            "payment.PaymentService"
        };
        let msg = call(i, topic, "Process");
        let id = call_job_id(&msg.message_id, msg.timestamp_ms);
        tally.sent(id.clone());
        batch.push(ojs_grpcq::outgoing(&msg));
        sent.insert(id, msg);
    }
    broker.publish("calls", batch).await.unwrap();

    let mut got = collect(&broker, "payments", Source::Queue, 400, IDLE).await;
    assert_eq!(got.len(), 400, "two thirds go to the payments route");
    got.extend(collect(&broker, "default", Source::Queue, 200, IDLE).await);
    for d in &got {
        assert_eq!(d.content_type(), Some("application/openjobspec+proto"));
        let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
        let msg = &sent[&job.id];
        tally.received(job.id.clone());
        assert_eq!(
            job.job_type,
            ojs_core::envelope::type_from_topic_action(&msg.topic, &msg.action)
        );
        assert_eq!(job.queue, *d.queue);
        assert_eq!(d.headers[header::ID], job.id);
        assert_eq!(d.headers[header::TYPE], job.job_type);
        assert_eq!(d.headers[header::QUEUE], job.queue);
        assert_eq!(d.headers[header::TRACEPARENT], msg.metadata["traceparent"]);
        assert_eq!(
            job.meta_str(mapping::META_MESSAGE_ID),
            Some(msg.message_id.as_str())
        );
        assert_eq!(
            job.meta_str(mapping::META_ORIGINATOR),
            Some("test-service-pod-1")
        );
        assert_eq!(job.meta_str("tenant"), Some("acme"));
        assert_eq!(job.created_at.unwrap().timestamp_millis(), msg.timestamp_ms);
    }
    tally.assert_none_lost("memory → memory");
    assert_eq!(tally.duplicates(), 0);
    let summary = daemon.shutdown().await;
    let source = &summary.sources[0];
    assert_eq!(
        (
            summary.sources.len(),
            source.name.as_str(),
            source.received,
            source.acked,
            source.dead_lettered
        ),
        (1, "calls", n as u64, n as u64, 0)
    );
    assert_eq!(
        broker.depth("calls").await.unwrap(),
        Some(0),
        "every call was acked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_to_job_to_call_returns_the_original_message() {
    let name = broker_name();
    // Calls → OJS JSON jobs on `jobs`; jobs → grpcq calls on `back`.
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[sources]]
        name = "jobs"
        adapter = "mem"
        queue = "jobs"
        format = "ojs"
        [[routes]]
        name = "to-ojs"
        sources = ["calls"]
        sink = "mem"
        queue = "jobs"
        encoding = "json"
        [[routes]]
        name = "to-grpcq"
        sources = ["jobs"]
        sink = "mem"
        to = "grpcq"
        queue = "back"
        "#
    );
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let originals: Vec<grpcq::Message> = (0..200)
        .map(|i| {
            let mut m = call(i, "payment.PaymentService", "ProcessPayment");
            m.payload = vec![0, 0xff, i as u8, 0x80];
            m.metadata.insert("priority".into(), "5".into());
            m.metadata
                .insert("deadline_ms".into(), "1893456000000".into());
            m
        })
        .collect();
    broker
        .publish("calls", originals.iter().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let back = collect(&broker, "back", Source::Queue, originals.len(), IDLE).await;
    assert_eq!(back.len(), originals.len());
    let by_id: HashMap<String, grpcq::Message> = back
        .iter()
        .map(|d| {
            assert_eq!(d.content_type(), Some("application/grpcq+proto"));
            assert_eq!(d.headers[header::GRPCQ_TOPIC], "payment.PaymentService");
            assert_eq!(d.headers[header::GRPCQ_ACTION], "ProcessPayment");
            let m = grpcq::decode(&d.payload).unwrap();
            (m.message_id.clone(), m)
        })
        .collect();
    for original in &originals {
        assert_eq!(
            by_id.get(&original.message_id),
            Some(original),
            "round trip changed the call"
        );
    }
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_with_their_reason_and_the_daemon_goes_on() {
    let name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        small = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        batch_size = 1
        max_in_flight = 1
        [[routes]]
        name = "big"
        match = {{ topic = "big.*" }}
        sink = "small"
        queue = "out"
        [[routes]]
        name = "nameless"
        match = {{ topic = "nameless.*" }}
        sink = "mem"
        type = "{{originator}}"
        [[routes]]
        name = "payments"
        match = {{ topic = "payment.*" }}
        sink = "mem"
        queue = "out"
        "#
    );
    let broker = MemoryAdapter::named(&name);
    // The `small` sink accepts at most 2 KiB per message.
    let small: Arc<dyn QueueAdapter> =
        Arc::new(MemoryAdapter::named(&name).with_config(MemoryConfig {
            max_message_bytes: 2048,
        }));
    let daemon = start(&toml, BTreeMap::from([("small".to_owned(), small)])).await;

    let mut big = call(0, "big.Blob", "Put");
    big.payload = vec![7; 4096];
    let mut nameless = call(1, "nameless.Service", "Do");
    nameless.originator = String::new();
    let bad_envelope =
        OutgoingMessage::new(b"\x0a\xff\xff".to_vec(), "application/openjobspec+proto");
    let two_jobs = OutgoingMessage::new(
        ojs_core::envelope::stream::encode_delimited([
            &JobEnvelope::new("a.b", vec![]),
            &JobEnvelope::new("a.b", vec![]),
        ])
        .unwrap(),
        "application/openjobspec+proto; delimited=true",
    );
    let cases: Vec<(OutgoingMessage, &str)> = vec![
        (
            OutgoingMessage::new(b"\xff\xfe not protobuf".to_vec(), "application/grpcq+proto"),
            "undecodable",
        ),
        (
            OutgoingMessage::new(b"hello".to_vec(), "text/plain"),
            "unknown_content_type",
        ),
        (bad_envelope, "undecodable"),
        (two_jobs, "unsupported_batch"),
        (
            ojs_grpcq::outgoing(&call(2, "unrouted.Service", "Do")),
            "unknown_route",
        ),
        (ojs_grpcq::outgoing(&nameless), "unmappable"),
        // Parses, but the official schema refuses an uppercase type.
        (
            OutgoingMessage::new(
                br#"{"specversion":"1.0","id":"019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f","type":"Email.Send","queue":"default","args":[]}"#.to_vec(),
                "application/openjobspec+json",
            ),
            "invalid_envelope",
        ),
        (ojs_grpcq::outgoing(&big), "payload_too_large"),
    ];
    let mut expected: HashMap<Vec<u8>, &str> = HashMap::new();
    for (i, (mut m, reason)) in cases.into_iter().enumerate() {
        // Make each body unique so the dead letter can be told apart.
        m.headers.insert("case", i.to_string());
        expected.insert(i.to_string().into_bytes(), reason);
        broker.publish("calls", vec![m]).await.unwrap();
    }
    // A good call after all the poison still goes through.
    let good = call(3, "payment.PaymentService", "Pay");
    broker
        .publish("calls", vec![ojs_grpcq::outgoing(&good)])
        .await
        .unwrap();
    let out = collect(&broker, "out", Source::Queue, 1, IDLE).await;
    assert_eq!(out.len(), 1);
    let job = &Encoding::OjsProto
        .decode_envelopes(&out[0].payload)
        .unwrap()[0];
    assert_eq!(job.id, call_job_id(&good.message_id, good.timestamp_ms));

    let dead = collect(&broker, "calls", Source::DeadLetters, expected.len(), IDLE).await;
    assert_eq!(
        dead.len(),
        expected.len(),
        "every poison message is dead-lettered, none dropped"
    );
    for d in &dead {
        let case = d.headers["case"].as_bytes().to_vec();
        let reason = d.dead_letter_reason().expect("reason headers");
        assert_eq!(
            reason.error_type, expected[&case],
            "case {:?}: {}",
            d.headers["case"], reason.message
        );
        assert!(!reason.message.is_empty());
        if reason.error_type == "invalid_envelope" {
            assert!(
                reason.message.contains("`type`") && reason.message.contains("pattern"),
                "names the attribute and the rule: {}",
                reason.message
            );
        }
    }
    assert_eq!(
        daemon.metrics.dead_lettered_count("calls"),
        expected.len() as u64
    );
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].received, summary.sources[0].acked,
        "everything received was settled"
    );
    assert_eq!(
        summary.sources[0].dead_lettered,
        expected.len() as u64,
        "the summary tells dead letters from delivered messages"
    );
    assert_eq!(summary.sources[0].delivered(), 1, "the good call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_dead_letter_queue_receives_poison_with_its_reason() {
    let name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        dead_letter = {{ adapter = "mem", queue = "bridge-dead" }}
        [[routes]]
        name = "payments"
        match = {{ topic = "payment.*" }}
        sink = "mem"
        "#
    );
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let stray = call(0, "other.Service", "Do");
    broker
        .publish("calls", vec![ojs_grpcq::outgoing(&stray)])
        .await
        .unwrap();
    let dead = collect(&broker, "bridge-dead", Source::Queue, 1, IDLE).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        grpcq::decode(&dead[0].payload).unwrap(),
        stray,
        "the message as it was"
    );
    assert_eq!(dead[0].headers[header::ERROR_TYPE], "unknown_route");
    assert!(dead[0].headers[header::ERROR_MESSAGE]
        .to_str_lossy()
        .contains("other.Service/Do"));
    daemon.shutdown().await;
    assert_eq!(broker.depth("calls").await.unwrap(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_set_transcodes_requests_to_proto3_json_and_back() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("descriptors");
    std::fs::write(
        dir.path().join("payment.proto"),
        r#"syntax = "proto3";
        package payment;
        message ProcessPaymentRequest {
          string order_id = 1;
          int64 amount_cents = 2;
          repeated string tags = 3;
        }
        message ProcessPaymentResponse { bool ok = 1; }
        service PaymentService {
          rpc ProcessPayment(ProcessPaymentRequest) returns (ProcessPaymentResponse);
        }"#,
    )
    .unwrap();
    let fds = protox::compile(["payment.proto"], [dir.path()]).unwrap();
    let descriptor_path = dir.path().join("payment.binpb");
    std::fs::write(&descriptor_path, fds.encode_to_vec()).unwrap();
    let pool = prost_reflect::DescriptorPool::decode(fds.encode_to_vec().as_slice()).unwrap();
    let request_type = pool
        .get_message_by_name("payment.ProcessPaymentRequest")
        .unwrap();

    let name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[sources]]
        name = "jobs"
        adapter = "mem"
        queue = "jobs"
        format = "ojs"
        [[routes]]
        name = "to-ojs"
        sources = ["calls"]
        sink = "mem"
        queue = "jobs"
        descriptor_set = "{path}"
        [[routes]]
        name = "to-grpcq"
        sources = ["jobs"]
        sink = "mem"
        to = "grpcq"
        queue = "back"
        descriptor_set = "{path}"
        "#,
        path = descriptor_path.display()
    );
    let broker = MemoryAdapter::named(&name);
    // A second reader of `jobs` would race the daemon; watch the jobs via a
    // copy route instead: read them from `back` and check the JSON form on a
    // separate daemon-less encode below.
    let daemon = start(&toml, BTreeMap::new()).await;
    let request = prost_reflect::DynamicMessage::deserialize(
        request_type.clone(),
        json!({"orderId": "o-1", "amountCents": "1250", "tags": ["a", "b"]}),
    )
    .unwrap();
    let mut typed = call(0, "payment.PaymentService", "ProcessPayment");
    typed.payload = request.encode_to_vec();
    // A payload with a field the descriptor does not know: JSON could not
    // carry it, so it travels as base64url and still comes back intact.
    let mut unknown = call(1, "payment.PaymentService", "ProcessPayment");
    unknown.payload = [request.encode_to_vec(), vec![0xa0, 0x06, 0x01]].concat();
    broker
        .publish(
            "calls",
            vec![ojs_grpcq::outgoing(&typed), ojs_grpcq::outgoing(&unknown)],
        )
        .await
        .unwrap();
    let back = collect(&broker, "back", Source::Queue, 2, IDLE).await;
    daemon.shutdown().await;
    let back: HashMap<String, grpcq::Message> = back
        .iter()
        .map(|d| grpcq::decode(&d.payload).unwrap())
        .map(|m| (m.message_id.clone(), m))
        .collect();
    assert_eq!(back.get(&typed.message_id), Some(&typed));
    assert_eq!(back.get(&unknown.message_id), Some(&unknown));

    // The job in between, as the route builds it.
    let config = ojs_bridge::config::BridgeConfig::parse(&toml, "t", &[]).unwrap();
    let route = ojs_bridge::routes::Route::build(&config.routes[0], 0, false).unwrap();
    let mut job_types = ojs_grpcq::mapping::JobTypes::new();
    let (_, out) = route
        .map(
            ojs_bridge::routes::Incoming::Call(ojs_grpcq::Call::from_message(&typed)),
            "calls",
            &mut job_types,
        )
        .unwrap();
    let job = &Encoding::OjsProto.decode_envelopes(&out.payload).unwrap()[0];
    assert_eq!(
        job.args,
        vec![json!({"orderId": "o-1", "amountCents": "1250", "tags": ["a", "b"]})]
    );
    assert_eq!(
        job.meta_str(mapping::META_PAYLOAD_ENCODING),
        Some(mapping::PAYLOAD_PROTO3_JSON)
    );
    assert_eq!(
        job.meta_str(mapping::META_PAYLOAD_TYPE),
        Some("payment.ProcessPaymentRequest")
    );
    let (_, out) = route
        .map(
            ojs_bridge::routes::Incoming::Call(ojs_grpcq::Call::from_message(&unknown)),
            "calls",
            &mut job_types,
        )
        .unwrap();
    let job = &Encoding::OjsProto.decode_envelopes(&out.payload).unwrap()[0];
    assert_eq!(
        job.meta_str(mapping::META_PAYLOAD_ENCODING),
        Some(mapping::PAYLOAD_BASE64URL)
    );
    // A payload that is not the request type is dead-lettered, named.
    let mut wrong = call(2, "payment.PaymentService", "ProcessPayment");
    wrong.payload = vec![0x0a, 0xff];
    let reason = route
        .map(
            ojs_bridge::routes::Incoming::Call(ojs_grpcq::Call::from_message(&wrong)),
            "calls",
            &mut job_types,
        )
        .unwrap_err();
    assert_eq!(reason.error_type, "untranscodable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_sink_holds_back_consumption_and_shutdown_is_bounded() {
    let name = broker_name();
    let toml = format!(
        r#"
        shutdown_timeout = "1s"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        stalled = "memory://{name}-sink"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        batch_size = 16
        max_in_flight = 64
        visibility_timeout = "1s"
        [[routes]]
        name = "all"
        sink = "stalled"
        "#
    );
    let broker = MemoryAdapter::named(&name);
    // A sink that refuses every publish (as a broker that went away does):
    // the daemon must keep retrying, not dead-letter and not read ahead.
    let stalled = MemoryAdapter::named(&format!("{name}-sink"));
    stalled.close().await.unwrap();
    let stalled: Arc<dyn QueueAdapter> = Arc::new(stalled);
    let n = 1000;
    let mut tally = Tally::new();
    let calls: Vec<OutgoingMessage> = (0..n)
        .map(|i| {
            let c = call(i, "payment.PaymentService", "Pay");
            tally.sent(c.message_id.clone());
            ojs_grpcq::outgoing(&c)
        })
        .collect();
    broker.publish("calls", calls).await.unwrap();
    let daemon = start(&toml, BTreeMap::from([("stalled".to_owned(), stalled)])).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let received = daemon.metrics.sources[0]
        .1
        .received
        .load(std::sync::atomic::Ordering::Relaxed);
    let rendered = daemon.metrics.render();
    println!("received while the sink is stalled: {received} of {n}");
    assert!(received > 0, "the daemon consumed nothing at all");
    assert!(
        received <= 64,
        "received {received} with max_in_flight = 64"
    );
    assert_eq!(
        metric(&rendered, "ojs_bridge_published_total{route=\"all\"}"),
        Some(0.0)
    );
    assert!(
        metric(
            &rendered,
            "ojs_bridge_errors_total{at=\"all\",reason=\"closed\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{rendered}"
    );
    assert_eq!(
        daemon.metrics.dead_lettered_count("calls"),
        0,
        "a sink outage must not dead-letter"
    );

    let started = Instant::now();
    let summary = daemon.shutdown().await;
    let took = started.elapsed();
    println!("shutdown took {took:?}");
    assert!(
        took < Duration::from_secs(10),
        "shutdown must be bounded, took {took:?}"
    );
    assert_eq!(
        summary.sources[0].acked, 0,
        "nothing may be acked that no sink confirmed"
    );
    // Everything is still in the source (the abandoned ones after their
    // visibility timeout).
    for d in collect(&broker, "calls", Source::Queue, n, IDLE).await {
        tally.received(grpcq::decode(&d.payload).unwrap().message_id);
    }
    tally.assert_none_lost("stalled sink");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_200_when_every_adapter_is_healthy_and_503_naming_the_one_that_is_not() {
    let name = broker_name();
    let toml = one_route_config(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    let (status, body) = http_get(addr, "/ojs/v1/health").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "ok");
    MemoryAdapter::named(&name)
        .publish("calls", vec![ojs_grpcq::outgoing(&call(0, "a.B", "C"))])
        .await
        .unwrap();
    let deadline = Instant::now() + IDLE;
    let mut text = String::new();
    while Instant::now() < deadline {
        text = http_get(addr, "/metrics").await.1;
        if metric(&text, "ojs_bridge_acked_total{source=\"calls\"}") == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        metric(&text, "ojs_bridge_received_total{source=\"calls\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "ojs_bridge_published_total{route=\"all\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "ojs_bridge_latency_seconds_count{route=\"all\"}"),
        Some(1.0)
    );
    assert!(text.contains("# TYPE ojs_bridge_end_to_end_latency_seconds histogram"));
    assert_eq!(http_get(addr, "/nope").await.0, 404);
    daemon.shutdown().await;

    // One closed adapter: 503 naming it.
    let name2 = broker_name();
    let toml = toml
        .replace(&name, &name2)
        .replace("[[sources]]", "down = \"memory://x\"\n[[sources]]");
    let down = MemoryAdapter::named(&format!("{name2}-down"));
    down.close().await.unwrap();
    let daemon = start(
        &toml,
        BTreeMap::from([("down".to_owned(), Arc::new(down) as Arc<dyn QueueAdapter>)]),
    )
    .await;
    let (status, body) = http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_ne!(v["status"], "ok");
    assert_eq!(v["adapters"]["down"]["status"], "down");
    assert_eq!(v["adapters"]["mem"]["status"], "ok");
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_federated_sink_routes_by_region_meta_and_reports_its_state() {
    let us = broker_name();
    let eu = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        us = "memory://{us}"
        eu = "memory://{eu}"
        [[sources]]
        name = "calls"
        adapter = "us"
        queue = "calls"
        [[routes]]
        name = "jobs"
        sink = "global"
        queue = "jobs"
        [federations.global]
        local = "us"
        fallback = ["eu"]
        health_interval = "100ms"
        [federations.global.regions.us]
        adapter = "us"
        [federations.global.regions.eu]
        adapter = "eu"
        "#
    );
    let us_broker = MemoryAdapter::named(&us);
    let eu_broker = MemoryAdapter::named(&eu);
    let daemon = start(&toml, BTreeMap::new()).await;
    let plain = call(0, "report.Reports", "Build");
    // grpcq metadata becomes job meta as is: this call is pinned to eu.
    let mut pinned = call(1, "report.Reports", "Build");
    pinned
        .metadata
        .insert("ojs.federation.region".into(), "eu".into());
    let mut nowhere = call(2, "report.Reports", "Build");
    nowhere
        .metadata
        .insert("ojs.federation.region".into(), "mars".into());
    us_broker
        .publish(
            "calls",
            [&plain, &pinned, &nowhere]
                .map(ojs_grpcq::outgoing)
                .to_vec(),
        )
        .await
        .unwrap();
    let in_us = collect(&us_broker, "jobs", Source::Queue, 1, IDLE).await;
    let in_eu = collect(&eu_broker, "jobs", Source::Queue, 1, IDLE).await;
    let job_of = |d: &ojs_queue::Delivery| {
        Encoding::OjsProto
            .decode_envelopes(&d.payload)
            .unwrap()
            .remove(0)
    };
    assert_eq!(in_us.len(), 1);
    assert_eq!(in_eu.len(), 1);
    let us_job = job_of(&in_us[0]);
    assert_eq!(
        us_job.id,
        call_job_id(&plain.message_id, plain.timestamp_ms),
        "affinity: local region"
    );
    assert!(us_job
        .meta_str(ojs_queue::federation::META_FEDERATION_ID)
        .is_some());
    assert_eq!(
        job_of(&in_eu[0]).id,
        call_job_id(&pinned.message_id, pinned.timestamp_ms),
        "geo-pinned to eu"
    );
    let dead = collect(&us_broker, "calls", Source::DeadLetters, 1, IDLE).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].dead_letter_reason().unwrap().error_type,
        "unknown_region"
    );
    let (_, text) = http_get(daemon.http.unwrap(), "/metrics").await;
    assert!(
        text.contains("ojs_bridge_federation_breaker_state{federation=\"global\",region=\"us\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("ojs_bridge_federation_routed_total{federation=\"global\",region=\"eu\"} 1"),
        "{text}"
    );
    let (status, body) = http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"global\""), "{body}");
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_health_probe_reads_a_daemons_health_endpoint() {
    use ojs_queue::federation::HealthProbe;
    let name = broker_name();
    let toml = one_route_config(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let url = format!("http://{}/ojs/v1/health", daemon.http.unwrap());
    let probe = ojs_bridge::probe::HttpHealthProbe::new(&url, Duration::from_secs(2)).unwrap();
    let health = probe.check().await;
    assert!(health.healthy, "{}", health.detail);
    daemon.shutdown().await;
    let health = probe.check().await;
    assert!(!health.healthy, "a daemon that is gone is down");
    assert!(health.detail.contains(&url), "{}", health.detail);
    // A server that answers 404 (not an OJS health endpoint) is down too.
    let daemon = start(&toml.replace(&name, &broker_name()), BTreeMap::new()).await;
    let wrong = format!("http://{}/nope", daemon.http.unwrap());
    let probe = ojs_bridge::probe::HttpHealthProbe::new(&wrong, Duration::from_secs(2)).unwrap();
    let health = probe.check().await;
    assert!(!health.healthy);
    assert!(health.detail.contains("HTTP 404"), "{}", health.detail);
    daemon.shutdown().await;
    assert!(ojs_bridge::probe::HttpHealthProbe::new(
        "https://x/ojs/v1/health",
        Duration::from_secs(1)
    )
    .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_delivered_twice_becomes_the_same_job_id_twice() {
    let name = broker_name();
    let sink_name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        visibility_timeout = "300ms"
        [[routes]]
        name = "all"
        sink = "sink"
        "#
    );
    // The same call arrives twice (a producer that retried its send; a
    // source lease that ran out is held off by the daemon, see
    // publishes_that_outlast_the_lease_are_not_delivered_twice).
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let c = call(0, "payment.PaymentService", "Pay");
    for _ in 0..2 {
        broker
            .publish("calls", vec![ojs_grpcq::outgoing(&c)])
            .await
            .unwrap();
    }
    let jobs = collect(
        &MemoryAdapter::named(&sink_name),
        "default",
        Source::Queue,
        2,
        IDLE,
    )
    .await;
    let summary = daemon.shutdown().await;
    assert_eq!(
        jobs.len(),
        2,
        "the redelivered call was published again (at least once)"
    );
    let ids: Vec<String> = jobs
        .iter()
        .map(|d| {
            Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0]
                .id
                .clone()
        })
        .collect();
    assert_eq!(ids[0], ids[1], "both copies carry one job id");
    assert_eq!(ids[0], call_job_id(&c.message_id, c.timestamp_ms));
    assert_eq!(summary.sources[0].received, 2, "received twice");
    assert_eq!(
        broker.depth("calls").await.unwrap(),
        Some(0),
        "the second copy was acked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_cannot_choose_destinations_the_config_does_not_allow() {
    let name = broker_name();
    let sink_name = broker_name();
    // grpcq calls go to the queue named by their topic (message-chosen):
    // only payment.* is allowed, the sink's dead-letter names never are,
    // and at most two destinations are created.
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        dead_letter = {{ adapter = "mem", queue = "bridge-dead" }}
        [[routes]]
        name = "calls"
        sink = "sink"
        to = "grpcq"
        allowed_queues = ["payment.*", "*.dlq"]
        max_destinations = 2
        "#
    );
    let sink: Arc<dyn QueueAdapter> = Arc::new(TestSink::new(&sink_name).reserving(".dlq"));
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    let calls = [
        call(0, "payment.A", "Pay"),      // allowed
        call(1, "admin.Secrets", "Dump"), // not in allowed_queues
        call(2, "orders.dlq", "Poke"),    // allowed by glob, but reserved by the sink
        call(3, "payment.B", "Pay"),      // second destination
        call(4, "payment.C", "Pay"),      // third: over max_destinations
    ];
    broker
        .publish("calls", calls.iter().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let dead = collect(&broker, "bridge-dead", Source::Queue, 3, IDLE).await;
    let sink = MemoryAdapter::named(&sink_name);
    let a = collect(&sink, "payment.A", Source::Queue, 1, IDLE).await;
    let b = collect(&sink, "payment.B", Source::Queue, 1, IDLE).await;
    daemon.shutdown().await;
    assert_eq!((a.len(), b.len()), (1, 1));
    assert_eq!(sink.depth("admin.Secrets").await.unwrap(), Some(0));
    assert_eq!(sink.depth("orders.dlq").await.unwrap(), Some(0));
    let mut reasons: Vec<(String, String)> = dead
        .iter()
        .map(|d| {
            (
                grpcq::decode(&d.payload).unwrap().topic,
                d.headers[header::ERROR_TYPE].to_str_lossy().into_owned(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        vec![
            (
                "admin.Secrets".to_owned(),
                "forbidden_destination".to_owned()
            ),
            ("orders.dlq".to_owned(), "forbidden_destination".to_owned()),
            ("payment.C".to_owned(), "too_many_destinations".to_owned()),
        ]
    );
    assert!(dead.iter().any(|d| d.headers[header::ERROR_MESSAGE]
        .to_str_lossy()
        .contains("\"admin.Secrets\"")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_leases_are_extended_while_the_sink_is_down_for_many_visibility_timeouts() {
    let name = broker_name();
    let sink_name = broker_name();
    // The source's lease is 300 ms; the sink is down for ~10 of them. Without
    // extending, every call would be received again and again (on SQS each
    // receive counts towards the redrive policy's max_receive_count).
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        mem = "memory://{name}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        visibility_timeout = "300ms"
        [[routes]]
        name = "all"
        sink = "sink"
        "#
    );
    let sink = TestSink::new(&sink_name).starting_down();
    let down = sink.down.clone();
    let sink: Arc<dyn QueueAdapter> = Arc::new(sink);
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    let calls: Vec<_> = (0..5)
        .map(|i| call(i, "payment.PaymentService", "Pay"))
        .collect();
    broker
        .publish("calls", calls.iter().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Health says so while the sink refuses to work, naming the route.
    let (status, body) = http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"sink all\""), "{body}");
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let jobs = collect(
        &MemoryAdapter::named(&sink_name),
        "default",
        Source::Queue,
        5,
        Duration::from_secs(40),
    )
    .await;
    let (status, body) = http_get(daemon.http.unwrap(), "/ojs/v1/health").await;
    assert_eq!(status, 200, "healthy again once the sink works: {body}");
    let summary = daemon.shutdown().await;
    let dead = collect(
        &broker,
        "calls",
        Source::DeadLetters,
        1,
        Duration::from_millis(300),
    )
    .await
    .len();
    println!(
        "sink down 3 s, lease 300 ms: sent 5 received {} duplicated {} lost {} (source received {})",
        jobs.len(),
        jobs.len().saturating_sub(5),
        5usize.saturating_sub(jobs.len()),
        summary.sources[0].received
    );
    assert_eq!(jobs.len(), 5);
    assert_eq!(
        summary.sources[0].received, 5,
        "each call was received once: its lease was extended"
    );
    assert_eq!(dead, 0, "nothing was dead-lettered");
}

/// Large messages and a sink that holds them: the bytes in flight stop at
/// `max_in_flight_bytes` (plus the one batch that crossed it), far below
/// what the message count alone would let in; nothing is lost once the
/// sink works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_bounds_what_a_held_source_takes_in() {
    let name = broker_name();
    let sink_name = broker_name();
    const BUDGET: i64 = 1024 * 1024;
    const BATCH: i64 = 2;
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        mem = "memory://{name}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        batch_size = {BATCH}
        max_in_flight = 100
        max_in_flight_bytes = {BUDGET}
        [[routes]]
        name = "all"
        sink = "sink"
        "#
    );
    let sink = TestSink::new(&sink_name).starting_down();
    let down = sink.down.clone();
    let sink: Arc<dyn QueueAdapter> = Arc::new(sink);
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    let sent: HashMap<String, grpcq::Message> = (0..20)
        .map(|i| {
            let mut c = call(i, "payment.PaymentService", "Pay");
            c.payload = vec![b'x'; 256 * 1024];
            (call_job_id(&c.message_id, c.timestamp_ms), c)
        })
        .collect();
    let largest = sent
        .values()
        .map(|c| c.encode_to_vec().len() as i64)
        .max()
        .unwrap();
    broker
        .publish("calls", sent.values().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let source = &daemon.metrics.sources[0].1;
    let mut peak_bytes = 0;
    let mut peak_count = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        peak_bytes = peak_bytes.max(
            source
                .in_flight_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        peak_count = peak_count.max(source.in_flight.load(std::sync::atomic::Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "held sink: peak in flight {peak_count} messages, {peak_bytes} bytes (budget {BUDGET})"
    );
    assert!(peak_bytes > 0, "the source took messages in");
    assert!(
        peak_bytes <= BUDGET + BATCH * largest,
        "{peak_bytes} bytes in flight, budget {BUDGET} + one batch"
    );
    assert!(
        peak_count < 20,
        "the count alone (100) would have taken all 20"
    );

    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let jobs = collect(
        &MemoryAdapter::named(&sink_name),
        "default",
        Source::Queue,
        sent.len(),
        Duration::from_secs(40),
    )
    .await;
    let mut tally = Tally::new();
    sent.keys().for_each(|id| tally.sent(id.clone()));
    for d in &jobs {
        tally.received(
            Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0]
                .id
                .clone(),
        );
    }
    tally.assert_none_lost("byte budget with a held sink");
    daemon.shutdown().await;
}

/// A publish that outlasts the source lease (a slow confirm, a blocked
/// broker) keeps the lease alive: the call is not handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_that_outlast_the_lease_are_not_delivered_twice() {
    let name = broker_name();
    let sink_name = broker_name();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        sink = "memory://{sink_name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        visibility_timeout = "300ms"
        [[routes]]
        name = "all"
        sink = "sink"
        "#
    );
    // The first publish takes three leases' time.
    let sink: Arc<dyn QueueAdapter> =
        Arc::new(TestSink::new(&sink_name).slow_first_publish(Duration::from_millis(900)));
    let broker = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
    let c = call(0, "payment.PaymentService", "Pay");
    broker
        .publish("calls", vec![ojs_grpcq::outgoing(&c)])
        .await
        .unwrap();
    let jobs = collect(
        &MemoryAdapter::named(&sink_name),
        "default",
        Source::Queue,
        2,
        IDLE,
    )
    .await;
    let summary = daemon.shutdown().await;
    assert_eq!(jobs.len(), 1, "published once");
    assert_eq!(summary.sources[0].received, 1, "received once");
    assert_eq!(summary.sources[0].acked, 1, "acked");
}

/// Per-key order across batches: the sink's first publish is slow, so
/// without ordered lanes the later batches overtake the first one (shown
/// below, so this test would fail without `ordering = "per_key"`); with
/// them, each key's messages reach the sink in the order they were sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_ordering_keeps_each_keys_order_across_batches_and_a_slow_publish() {
    async fn sink_order(ordering: &str) -> BTreeMap<String, Vec<usize>> {
        let name = broker_name();
        let sink_name = broker_name();
        let toml = format!(
            r#"
            [http]
            listen = "off"
            [adapters]
            mem = "memory://{name}"
            sink = "memory://{sink_name}"
            [[sources]]
            name = "calls"
            adapter = "mem"
            queue = "calls"
            batch_size = 10
            max_in_flight = 100
            {ordering}
            [[routes]]
            name = "all"
            sink = "sink"
            "#
        );
        let sink: Arc<dyn QueueAdapter> =
            Arc::new(TestSink::new(&sink_name).slow_first_publish(Duration::from_millis(500)));
        let broker = MemoryAdapter::named(&name);
        let n = 200;
        let mut of_id = HashMap::new();
        let mut messages = Vec::new();
        for i in 0..n {
            let c = call(i, "payment.PaymentService", "Pay");
            let key = ["a", "b", "c"][i % 3];
            of_id.insert(call_job_id(&c.message_id, c.timestamp_ms), (key, i));
            messages.push(ojs_grpcq::outgoing(&c).with_key(key));
        }
        // Queued before the daemon starts, so batches are full and many
        // run at once.
        broker.publish("calls", messages).await.unwrap();
        let daemon = start(&toml, BTreeMap::from([("sink".to_owned(), sink)])).await;
        let jobs = collect(
            &MemoryAdapter::named(&sink_name),
            "default",
            Source::Queue,
            n,
            IDLE,
        )
        .await;
        daemon.shutdown().await;
        assert_eq!(jobs.len(), n, "every call arrives ({ordering})");
        let mut order: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for d in &jobs {
            let (key, i) = of_id[d.headers.get_str(header::ID).unwrap()];
            order.entry(key.to_owned()).or_default().push(i);
        }
        order
    }
    let in_order = |order: &BTreeMap<String, Vec<usize>>| {
        order
            .values()
            .all(|seq| seq.windows(2).all(|w| w[0] < w[1]))
    };
    let unordered = sink_order("").await;
    assert!(
        !in_order(&unordered),
        "the slow first batch should have been overtaken without ordered lanes"
    );
    let ordered = sink_order("ordering = \"per_key\"\n            lanes = 3").await;
    assert!(in_order(&ordered), "{ordered:?}");
    let ordered = sink_order("ordering = \"per_key\"").await;
    assert!(in_order(&ordered), "{ordered:?}");
}
