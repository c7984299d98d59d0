//! The OJS HTTP API of `ojs-bridge run`, producer side, through a real
//! daemon process: encodings and negotiation, each kind of bad input with
//! its named outcome, `[api] queues`, batches all or nothing, scheduled jobs
//! across a restart, a broker that is down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_core::JobEnvelope;
use ojs_queue::{ConsumerOptions, QueueAdapter};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::ojs_server::{get, post_json, request, OjsServer};

const JSON: &str = "application/openjobspec+json";
const PROTO: &str = "application/openjobspec+proto";

/// A bad request and the answer it must get: what it is, headers, body,
/// status, error code.
type BadCase = (
    &'static str,
    Vec<(String, String)>,
    Vec<u8>,
    u16,
    &'static str,
);

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Jobs waiting in `queue` of the embedded broker in `dir`, read by an
/// adapter of our own (acked, so they are gone afterwards).
async fn drain(dir: &std::path::Path, queue: &str, want: usize) -> Vec<JobEnvelope> {
    let url = format!("local:{}", dir.join("ojs-bridge-data").display());
    let adapter = LocalAdapter::open(LocalConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let mut consumer = adapter
        .consumer(queue, ConsumerOptions::default())
        .await
        .unwrap();
    let mut jobs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while jobs.len() < want && Instant::now() < deadline {
        for d in consumer
            .receive(100, Duration::from_millis(200))
            .await
            .unwrap()
        {
            jobs.push(JobEnvelope::from_proto_bytes(&d.payload).unwrap());
            d.ack().await.unwrap();
        }
    }
    // Nothing more arrives.
    let extra = consumer
        .receive(100, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(extra.is_empty(), "{} more jobs than expected", extra.len());
    jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_pushed_as_protobuf_reads_back_as_json_and_the_reverse() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    // Protobuf in (the binding's media type name), JSON out.
    let mut envelope = JobEnvelope::new("email.send", vec![json!("a@example.com"), json!(3)]);
    envelope.queue = "mail".into();
    envelope.priority = 7;
    envelope.meta.insert("tenant".into(), json!("acme"));
    let pushed = request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &h(&[
            ("content-type", "application/openjobspec+protobuf"),
            ("accept", JSON),
        ]),
        Some(&envelope.to_proto_bytes().unwrap()),
    )
    .await;
    assert_eq!(pushed.status, 201, "{:?}", pushed.body);
    assert_eq!(pushed.header("content-type").as_deref(), Some(JSON));
    let job = pushed.json()["job"].clone();
    assert_eq!(job["id"], json!(envelope.id));
    assert_eq!(job["queue"], "mail");
    assert_eq!(job["priority"], 7);
    assert_eq!(job["meta"]["tenant"], "acme");
    assert_eq!(job["state"], "available");
    let info = get(addr, &format!("/ojs/v1/jobs/{}", envelope.id)).await;
    assert_eq!(info.json()["job"], job, "INFO shows what PUSH answered");
    // The same job as protobuf.
    let as_proto = request(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{}", envelope.id),
        &h(&[("accept", PROTO)]),
        None,
    )
    .await;
    assert_eq!(as_proto.status, 200);
    assert_eq!(as_proto.header("content-type").as_deref(), Some(PROTO));
    let read = JobEnvelope::from_proto_bytes(&as_proto.body).unwrap();
    assert_eq!(read.to_json_value().unwrap()["args"], job["args"]);
    assert_eq!(read.job_type, "email.send");
    assert_eq!(read.queue, "mail");
    assert_eq!(read.priority, 7);
    // JSON in, protobuf out.
    let pushed = request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &h(&[("content-type", "application/json"), ("accept", PROTO)]),
        Some(br#"{"type":"report.build","args":[{"year":2026}],"options":{"queue":"mail","tags":["q4"]}}"#),
    )
    .await;
    assert_eq!(pushed.status, 201);
    let back = JobEnvelope::from_proto_bytes(&pushed.body).unwrap();
    assert_eq!(back.job_type, "report.build");
    assert_eq!(back.unknown_attributes["tags"], json!(["q4"]));
    let info = get(addr, &format!("/ojs/v1/jobs/{}", back.id)).await;
    assert_eq!(info.json()["job"]["tags"], json!(["q4"]));
    assert_eq!(info.json()["job"]["args"], json!([{"year": 2026}]));
    // Both are on the embedded broker's queue, as the sinks write them.
    let dir = server.stop();
    let on_broker = drain(dir.path(), "mail", 2).await;
    let ids: Vec<_> = on_broker.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, [envelope.id.as_str(), back.id.as_str()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_their_named_errors_and_nothing_is_published() {
    let config = r#"
[adapters]
local = "local:./ojs-bridge-data"

[api]
adapter = "local"
queues = ["default", "mail.*"]
max_body_bytes = 2048
max_batch_jobs = 3
"#;
    let server = OjsServer::start(Some(config)).await;
    let addr = server.addr;
    let ok_job = json!({"type": "a.b", "args": []});
    let cases: Vec<BadCase> = vec![
        (
            "not JSON",
            h(&[("content-type", JSON)]),
            b"{ nope".to_vec(),
            400,
            "invalid_payload",
        ),
        (
            "an empty body",
            h(&[("content-type", JSON)]),
            Vec::new(),
            400,
            "invalid_payload",
        ),
        (
            "protobuf that does not decode",
            h(&[("content-type", PROTO)]),
            vec![0x0a, 0xff, 0xff],
            400,
            "invalid_payload",
        ),
        (
            "an unsupported content type",
            h(&[("content-type", "text/plain")]),
            ok_job.to_string().into_bytes(),
            400,
            "invalid_request",
        ),
        (
            "an Accept nothing is served for",
            h(&[("content-type", JSON), ("accept", "text/html")]),
            ok_job.to_string().into_bytes(),
            406,
            "not_acceptable",
        ),
        (
            "an OJS-Version not spoken",
            h(&[("content-type", JSON), ("ojs-version", "2.0")]),
            ok_job.to_string().into_bytes(),
            422,
            "unsupported",
        ),
        (
            "a queue outside [api] queues",
            h(&[("content-type", JSON)]),
            json!({"type": "a.b", "args": [], "options": {"queue": "payroll"}})
                .to_string()
                .into_bytes(),
            404,
            "not_found",
        ),
        (
            "a body over max_body_bytes",
            h(&[("content-type", JSON)]),
            json!({"type": "a.b", "args": ["x".repeat(4000)]})
                .to_string()
                .into_bytes(),
            413,
            "payload_too_large",
        ),
    ];
    for (what, headers, body, status, code) in cases {
        let a = request(addr, "POST", "/ojs/v1/jobs", &headers, Some(&body)).await;
        assert_eq!(a.status, status, "{what}: {:?}", a.body);
        let e = &a.json()["error"];
        assert_eq!(e["code"], code, "{what}");
        assert_eq!(e["retryable"], false, "{what}");
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}"
        );
        assert_eq!(a.header("content-type").as_deref(), Some(JSON), "{what}");
        assert_eq!(a.header("ojs-version").as_deref(), Some("1.0"), "{what}");
        assert_eq!(
            e["request_id"].as_str(),
            a.header("x-request-id").as_deref(),
            "{what}"
        );
    }
    // A batch over max_batch_jobs, and one with a bad job: all or nothing.
    let four = json!({"jobs": [ok_job, ok_job, ok_job, ok_job]});
    let a = post_json(addr, "/ojs/v1/jobs/batch", &four).await;
    assert_eq!(a.status, 413);
    let id = ojs_core::envelope::new_job_id();
    let mixed = json!({"jobs": [
        {"type": "a.b", "args": [], "id": id},
        {"type": "Bad Type", "args": []},
    ]});
    let a = post_json(addr, "/ojs/v1/jobs/batch", &mixed).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.json()["error"]["details"]["index"], 1);
    assert_eq!(get(addr, &format!("/ojs/v1/jobs/{id}")).await.status, 404);
    // A client that stops in the middle of its body: the listener goes on.
    let mut cut = tokio::net::TcpStream::connect(addr).await.unwrap();
    cut.write_all(b"POST /ojs/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"type\":\"a.b\",")
        .await
        .unwrap();
    drop(cut);
    // The request id a client sends comes back.
    let a = request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &h(&[("content-type", JSON), ("x-request-id", "trace-42")]),
        Some(
            json!({"type": "a.b", "args": [1], "options": {"queue": "mail.eu"}})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(a.status, 201);
    assert_eq!(a.header("x-request-id").as_deref(), Some("trace-42"));
    assert!(a
        .header("location")
        .unwrap()
        .ends_with(a.json()["job"]["id"].as_str().unwrap()));
    // Duplicate id → 409, the first job unchanged.
    let first = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "a.b", "args": [1], "id": id}),
    )
    .await;
    assert_eq!(first.status, 201);
    let again = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "a.b", "args": [2], "id": id}),
    )
    .await;
    assert_eq!(again.status, 409);
    assert_eq!(again.json()["error"]["code"], "duplicate");
    assert_eq!(
        get(addr, &format!("/ojs/v1/jobs/{id}")).await.json()["job"]["args"],
        json!([1])
    );
    let dir = server.stop();
    // Exactly the two accepted jobs reached the broker.
    assert_eq!(drain(dir.path(), "mail.eu", 1).await.len(), 1);
    assert_eq!(drain(dir.path(), "default", 1).await[0].id, id);
    assert!(drain(dir.path(), "payroll", 0).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_job_reaches_the_broker_when_due_across_a_restart() {
    let server = OjsServer::start(None).await;
    let pushed = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "later.job", "args": [], "options": {"delay_until": "+PT4S", "queue": "later"}}),
    )
    .await;
    assert_eq!(pushed.status, 201);
    let id = pushed.json()["job"]["id"].as_str().unwrap().to_owned();
    assert_eq!(pushed.json()["job"]["state"], "scheduled");
    // And one cancelled before it is due: it must never arrive.
    let cancelled = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "later.job", "args": [], "options": {"delay_until": "+PT4S", "queue": "later"}}),
    )
    .await;
    let cancelled_id = cancelled.json()["job"]["id"].as_str().unwrap().to_owned();
    let c = request(
        server.addr,
        "DELETE",
        &format!("/ojs/v1/jobs/{cancelled_id}"),
        &[],
        None,
    )
    .await;
    assert_eq!(c.status, 200);
    assert_eq!(c.json()["job"]["state"], "cancelled");
    assert_eq!(c.json()["job"]["previous_state"], "scheduled");
    let dir = server.stop();
    // Not on the broker before its time.
    assert!(drain(dir.path(), "later", 0).await.is_empty());
    let server = OjsServer::start_in(dir, None).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let state =
            get(server.addr, &format!("/ojs/v1/jobs/{id}")).await.json()["job"]["state"].clone();
        if state == "available" {
            break;
        }
        assert!(Instant::now() < deadline, "still {state} after 15 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dir = server.stop();
    let arrived = drain(dir.path(), "later", 1).await;
    assert_eq!(arrived.len(), 1);
    assert_eq!(arrived[0].id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_is_down_fails_the_push_and_stores_nothing() {
    // Port 1 on loopback: nothing listens; the daemon starts and waits.
    let config = r#"
[adapters.rabbit]
url = "amqp://guest:guest@127.0.0.1:1/%2f"

[api]
adapter = "rabbit"
"#;
    let server = OjsServer::start(Some(config)).await;
    let id = ojs_core::envelope::new_job_id();
    let started = Instant::now();
    let a = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "a.b", "args": [], "id": id}),
    )
    .await;
    println!(
        "push with the broker down answered {} in {:?}",
        a.status,
        started.elapsed()
    );
    assert_eq!(a.status, 503, "{:?}", a.body);
    let e = &a.json()["error"];
    assert_eq!(e["retryable"], true);
    assert_eq!(a.header("retry-after").as_deref(), Some("1"));
    assert!(
        !a.body.windows(5).any(|w| w == b"guest"),
        "no credentials in the answer"
    );
    // Nothing half-stored: the same id can be pushed again later.
    assert_eq!(
        get(server.addr, &format!("/ojs/v1/jobs/{id}")).await.status,
        404
    );
    let health = get(server.addr, "/ojs/v1/health").await;
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["backend"]["status"], "disconnected");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_kept_alive_across_requests() {
    let server = OjsServer::start(None).await;
    let stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    for i in 0..20 {
        let body = json!({"type": "a.b", "args": [i]}).to_string();
        let req = hyper::Request::post("/ojs/v1/jobs")
            .header("host", "x")
            .header("content-type", JSON)
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        sender.ready().await.expect("the connection stays open");
        let r = sender
            .send_request(req)
            .await
            .expect("the connection stays open");
        assert_eq!(r.status(), 201);
        let _ = http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap();
    }
    let queues = get(server.addr, "/ojs/v1/queues").await.json();
    assert_eq!(queues["queues"][0]["name"], "default");
    let events: Value = get(server.addr, "/ojs/v1/events?types=job.enqueued&limit=5")
        .await
        .json();
    assert_eq!(events["events"].as_array().unwrap().len(), 5);
    assert_eq!(events["has_more"], true);
    server.stop();
}

/// Every job of `queue` on the embedded broker in `dir`, until none comes
/// for a second (acked: gone afterwards).
async fn drain_all(dir: &std::path::Path, queue: &str) -> Vec<String> {
    let url = format!("local:{}", dir.join("ojs-bridge-data").display());
    let adapter = LocalAdapter::open(LocalConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let mut consumer = adapter
        .consumer(queue, ConsumerOptions::default())
        .await
        .unwrap();
    let mut ids = Vec::new();
    loop {
        let batch = consumer
            .receive(500, Duration::from_millis(1000))
            .await
            .unwrap();
        if batch.is_empty() {
            return ids;
        }
        for d in batch {
            ids.push(JobEnvelope::from_proto_bytes(&d.payload).unwrap().id);
            d.ack().await.unwrap();
        }
    }
}

/// Pushes from `tasks` concurrent clients until `stop` or until `budget`
/// pushes were sent; the id and status of every push (status 0: the
/// connection failed). `acked` counts the 201s as they come.
async fn push_until(
    addr: std::net::SocketAddr,
    tasks: usize,
    queue: &'static str,
    stop: tokio::sync::watch::Receiver<bool>,
    budget: usize,
    acked: Arc<AtomicUsize>,
) -> Vec<(String, u16)> {
    let sent = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let stop = stop.clone();
        let (sent, acked) = (sent.clone(), acked.clone());
        handles.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while !*stop.borrow() && sent.fetch_add(1, Ordering::AcqRel) < budget {
                let id = ojs_core::envelope::new_job_id();
                let body =
                    json!({"type": "load.job", "args": [1], "id": id, "options": {"queue": queue}});
                let status = match tokio::time::timeout(
                    Duration::from_secs(10),
                    crate::ojs_server::try_request(
                        addr,
                        "POST",
                        "/ojs/v1/jobs",
                        body.to_string().as_bytes(),
                    ),
                )
                .await
                {
                    Ok(Some(status)) => status,
                    _ => 0,
                };
                out.push((id, status));
                if status == 201 {
                    acked.fetch_add(1, Ordering::AcqRel);
                }
                if status == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all
}

/// sent / acknowledged (201) / received / duplicated / lost, printed; lost
/// must be 0.
fn tally(what: &str, pushes: &[(String, u16)], received: &[String]) {
    let acked: std::collections::HashSet<&str> = pushes
        .iter()
        .filter(|(_, s)| *s == 201)
        .map(|(id, _)| id.as_str())
        .collect();
    let mut seen = std::collections::HashSet::new();
    let duplicated = received
        .iter()
        .filter(|id| !seen.insert(id.as_str()))
        .count();
    let lost: Vec<_> = acked.iter().filter(|id| !seen.contains(**id)).collect();
    println!(
        "{what}: sent {}, acknowledged {}, refused {}, received {}, duplicated {duplicated}, lost {}",
        pushes.len(),
        acked.len(),
        pushes.iter().filter(|(_, s)| *s != 201).count(),
        received.len(),
        lost.len()
    );
    assert!(!acked.is_empty(), "{what}: no push was acknowledged");
    assert!(
        lost.is_empty(),
        "{what}: acknowledged jobs not on the broker: {lost:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_pushes_in_flight_loses_no_acknowledged_job() {
    const PUSHES: usize = 10_000;
    let server = OjsServer::start(None).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let acked = Arc::new(AtomicUsize::new(0));
    let pushes = tokio::spawn(push_until(
        server.addr,
        64,
        "load",
        stop_rx,
        PUSHES,
        acked.clone(),
    ));
    // The kill lands part-way through the 10,000.
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.load(Ordering::Acquire) < PUSHES / 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dir = server.kill();
    // The clients see refused connections for the rest of their budget.
    let pushes = tokio::time::timeout(Duration::from_secs(120), pushes)
        .await
        .unwrap()
        .unwrap();
    let _ = stop_tx.send(true);
    let received = drain_all(dir.path(), "load").await;
    tally(
        "kill -9 of the daemon during 10,000 PUSHes from 64 clients",
        &pushes,
        &received,
    );
    assert_eq!(pushes.len(), PUSHES);
    assert!(
        pushes.iter().any(|(_, s)| *s == 0),
        "the kill came while pushes were in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_through_a_cut_rabbitmq_connection_lose_no_acknowledged_job() {
    use ojs_bridge_tests::fault_proxy::{FaultProxy, Mode};
    let Some(rabbit) =
        ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::RabbitMq).await
    else {
        return;
    };
    if ojs_bridge_tests::independent::available().is_none() {
        return;
    }
    let upstream = ojs_bridge_tests::brokers::probe_address(&rabbit.url)
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let prefix = ojs_bridge_tests::brokers::unique_queue("api-cut");
    let queue = format!("{prefix}.orders");
    ojs_bridge_tests::independent::run(&["rabbit-queue", &queue]).unwrap();
    let url = rabbit.url.replacen(
        rabbit
            .url
            .rsplit('@')
            .next()
            .unwrap()
            .split('/')
            .next()
            .unwrap(),
        &proxy.host_port(),
        1,
    );
    let config = format!(
        "[adapters.rabbit]\nurl = \"{url}\"\ntopology = \"existing\"\nexchange = \"\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\nencoding = \"json\"\n"
    );
    let server = OjsServer::start(Some(&config)).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let pushes = tokio::spawn(push_until(
        server.addr,
        16,
        "orders",
        stop_rx,
        usize::MAX,
        Arc::new(AtomicUsize::new(0)),
    ));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.set(Mode::Reset);
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set(Mode::Pass);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_tx.send(true);
    let pushes = pushes.await.unwrap();
    server.stop();
    let messages = ojs_bridge_tests::independent::lines(&[
        "rabbit-get",
        &queue,
        "--count",
        "1000000",
        "--timeout",
        "3",
    ])
    .unwrap();
    let received: Vec<String> = messages
        .iter()
        .map(|m| {
            let body: Value = serde_json::from_str(m["body"].as_str().unwrap()).unwrap();
            body["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let _ = ojs_bridge_tests::independent::run(&["rabbit-delete", &queue]);
    tally(
        "RabbitMQ connection reset for 2 s during 16 concurrent PUSH clients",
        &pushes,
        &received,
    );
    // The adapter reconnected under the pushes (a 201 waits for the
    // broker's confirm, so pushes during the cut were held or refused).
    assert!(
        proxy.accepted() >= 2,
        "the cut made the adapter connect again ({} connections)",
        proxy.accepted()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_jobs_land_on_a_rabbitmq_queue_another_client_made_for_a_user_that_cannot_create_anything(
) {
    let Some(rabbit) =
        ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::RabbitMq).await
    else {
        return;
    };
    if ojs_bridge_tests::independent::available().is_none() {
        return;
    }
    let user = ojs_bridge_tests::brokers::unique_queue("api-user");
    const PASSWORD: &str = "Api-pw-9f3e-secret";
    if !ojs_bridge_tests::brokers::rabbitmqctl(&["add_user", &user, PASSWORD]) {
        ojs_bridge_tests::brokers::missing::<()>("rabbitmqctl", "cannot add a user");
        return;
    }
    // Read and write, configure nothing.
    assert!(ojs_bridge_tests::brokers::rabbitmq_may_not_configure(&user));
    // Their queue, their name and arguments, made by their client.
    let prefix = ojs_bridge_tests::brokers::unique_queue("team");
    let theirs = format!("{prefix}.orders.v2");
    ojs_bridge_tests::independent::run(&[
        "rabbit-queue",
        &theirs,
        "--arg",
        "x-max-priority=10",
        "--arg",
        "x-max-length=100000",
    ])
    .unwrap();
    let host = rabbit.url.rsplit('@').next().unwrap();
    let config = format!(
        "[adapters.theirs]\nurl = \"amqp://{user}:{PASSWORD}@{host}\"\ntopology = \"existing\"\nexchange = \"\"\nqueue_template = \"{prefix}.{{queue}}.v2\"\n\n[api]\nadapter = \"theirs\"\nqueues = [\"orders\", \"missing\"]\nencoding = \"json\"\n"
    );
    let server = OjsServer::start_with(
        ojs_bridge_tests::tempdir::TempDir::new("ojs-api"),
        Some(&config),
        &[("OJS_BRIDGE_LOG", "trace")],
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let a = post_json(
            server.addr,
            "/ojs/v1/jobs",
            &json!({"type": "order.ship", "args": [i], "meta": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                    "options": {"queue": "orders", "priority": i % 3}}),
        )
        .await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        ids.push(a.json()["job"]["id"].as_str().unwrap().to_owned());
    }
    // A queue [api] allows but nobody made: with topology = "existing" the
    // push is refused as not found and not retryable (retrying cannot make
    // the queue), naming the OJS queue and no secret, and nothing is stored.
    let id = ojs_core::envelope::new_job_id();
    let missing = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "order.ship", "args": [], "id": id, "options": {"queue": "missing"}}),
    )
    .await;
    assert_eq!(missing.status, 404, "{:?}", missing.body);
    let error = &missing.json()["error"];
    assert_eq!(error["code"], "not_found", "{error}");
    assert_eq!(error["retryable"], false, "{error}");
    assert_eq!(error["details"]["resource_id"], "missing", "{error}");
    assert!(missing.header("retry-after").is_none());
    let text = String::from_utf8_lossy(&missing.body);
    assert!(!text.contains(PASSWORD) && !text.contains(host) && !text.contains(&user));
    assert_eq!(
        get(server.addr, &format!("/ojs/v1/jobs/{id}")).await.status,
        404
    );
    let got = ojs_bridge_tests::independent::lines(&[
        "rabbit-get",
        &theirs,
        "--count",
        "20",
        "--timeout",
        "10",
    ])
    .unwrap();
    let server_log = {
        let log = server.log();
        server.stop();
        log
    };
    let mut received = Vec::new();
    for m in &got {
        let body: Value = serde_json::from_str(m["body"].as_str().unwrap()).unwrap();
        assert_eq!(m["content_type"], JSON);
        assert_eq!(m["message_id"], body["id"]);
        // The job id and type ride in the AMQP properties `message_id` and
        // `type` (docs/adapters/rabbitmq.md); the other binding headers as headers.
        assert_eq!(m["headers"]["x-ojs-queue"], "orders");
        assert_eq!(m["headers"]["x-ojs-specversion"], "1.0");
        assert_eq!(
            m["headers"]["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(body["type"], "order.ship");
        assert_eq!(body["state"], "available");
        received.push(body["id"].as_str().unwrap().to_owned());
    }
    let pushes: Vec<(String, u16)> = ids.iter().map(|id| (id.clone(), 201)).collect();
    tally(
        "20 PUSHes onto another team's queue, read by pika",
        &pushes,
        &received,
    );
    assert_eq!(received.len(), 20, "nothing more, nothing less");
    let _ = ojs_bridge_tests::independent::run(&["rabbit-delete", &theirs]);
    let _ = ojs_bridge_tests::brokers::rabbitmqctl(&["delete_user", &user]);
    assert!(
        !server_log.contains(PASSWORD),
        "the password reached the log"
    );
    assert!(
        server_log.contains("TRACE") || server_log.contains("DEBUG"),
        "the log ran at trace"
    );
}

/// Pushes 20 jobs through the API onto a queue another client made, reads
/// them back with that client (confluent-kafka / boto3), and checks each
/// decodes with the project's proto into the job that was pushed, with the
/// headers the adapter's sinks write.
async fn pushed_jobs_read_back_by_an_independent_client(
    broker: ojs_bridge_tests::brokers::Broker,
    adapter: impl FnOnce(&str, &str) -> String,
    make: &[&str],
    read: &[&str],
) -> Vec<(JobEnvelope, Value)> {
    let Some(endpoint) = ojs_bridge_tests::brokers::find(broker).await else {
        return Vec::new();
    };
    if ojs_bridge_tests::independent::available().is_none() {
        return Vec::new();
    }
    let prefix = ojs_bridge_tests::brokers::unique_queue("team");
    let theirs = format!("{prefix}-orders");
    let args: Vec<String> = make
        .iter()
        .map(|a| a.replace("{theirs}", &theirs))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ojs_bridge_tests::independent::run(&args).unwrap();
    let config = format!(
        "[adapters.theirs]\n{}\ntopology = \"existing\"\n\n[api]\nadapter = \"theirs\"\nqueues = [\"orders\"]\n",
        adapter(&endpoint.url, &prefix)
    );
    let server = OjsServer::start(Some(&config)).await;
    let mut pushed = std::collections::BTreeMap::new();
    for i in 0..20 {
        let a = post_json(
            server.addr,
            "/ojs/v1/jobs",
            &json!({"type": "order.ship", "args": [i, {"sku": "A-1"}],
                    "meta": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                    "options": {"queue": "orders"}}),
        )
        .await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        let job = a.json()["job"].clone();
        pushed.insert(job["id"].as_str().unwrap().to_owned(), job);
    }
    let args: Vec<String> = read
        .iter()
        .map(|a| a.replace("{theirs}", &theirs))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let got = ojs_bridge_tests::independent::lines(&args).unwrap();
    server.stop();
    assert_eq!(got.len(), 20, "{got:?}");
    let mut out = Vec::new();
    for m in got {
        let b64 = m["value_base64"]
            .as_str()
            .or_else(|| m["body"].as_str())
            .unwrap();
        let bytes =
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64).unwrap();
        let envelope = JobEnvelope::from_proto_bytes(&bytes).unwrap();
        let job = pushed.remove(&envelope.id).expect("a job that was pushed");
        assert_eq!(envelope.job_type, "order.ship");
        assert_eq!(envelope.queue, "orders");
        assert_eq!(serde_json::to_value(&envelope.args).unwrap(), job["args"]);
        assert_eq!(
            envelope.meta.get("traceparent").map(|v| v.to_string()),
            Some("\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"".to_owned())
        );
        out.push((envelope, m));
    }
    assert!(pushed.is_empty(), "not read back: {pushed:?}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_jobs_on_a_kafka_topic_another_client_made_read_back_with_confluent_kafka() {
    let got = pushed_jobs_read_back_by_an_independent_client(
        ojs_bridge_tests::brokers::Broker::Kafka,
        |url, prefix| format!("url = \"{url}\"\ntopic_template = \"{prefix}-{{queue}}\""),
        &["kafka-topic", "{theirs}", "--partitions", "3"],
        &[
            "kafka-consume",
            "{theirs}",
            "--count",
            "20",
            "--timeout",
            "30",
        ],
    )
    .await;
    for (envelope, m) in &got {
        let headers = &m["headers"];
        assert_eq!(headers["content-type"], PROTO, "{m}");
        assert_eq!(headers["ojs-id"], envelope.id.as_str());
        assert_eq!(headers["ojs-type"], "order.ship");
        assert_eq!(headers["ojs-queue"], "orders");
        assert_eq!(headers["ojs-specversion"], "1.0");
        assert_eq!(
            headers["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_jobs_on_an_sqs_queue_another_client_made_read_back_with_boto3() {
    let got = pushed_jobs_read_back_by_an_independent_client(
        ojs_bridge_tests::brokers::Broker::Sqs,
        |url, prefix| format!("url = \"{url}\"\nprefix = \"{prefix}-\""),
        &["sqs-queue", "{theirs}"],
        &[
            "sqs-receive",
            "{theirs}",
            "--count",
            "20",
            "--timeout",
            "20",
        ],
    )
    .await;
    for (envelope, m) in &got {
        let attributes = &m["attributes"];
        assert_eq!(attributes["content-type"], PROTO, "{m}");
        assert_eq!(attributes["ojs-id"], envelope.id.as_str());
        assert_eq!(attributes["ojs-type"], "order.ship");
        assert_eq!(attributes["ojs-queue"], "orders");
    }
}
