//! The realtime views of the event log on a real daemon: one job's and
//! one queue's Server-Sent Events (`job.state_changed` beside each
//! event, a finished job's stream ending), the WebSocket (`/ojs/v1/ws`:
//! both dialects, resume after a reconnect, bad messages, the bound on
//! open streams) and gRPC `StreamEvents`.

use std::net::SocketAddr;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::ojs_events::{Sse, Subscriber};
use crate::ojs_server::{get, post_json, request, OjsServer};

const EMBEDDED: &str = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\nmax_event_streams = 4\n";

async fn push(addr: SocketAddr, queue: &str) -> String {
    let a = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "realtime.job", "args": [1], "options": {"queue": queue}}),
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    a.json()["job"]["id"].as_str().unwrap().to_owned()
}

/// FETCHes `id` from `queue` and ACKs it.
async fn work(addr: SocketAddr, queue: &str, id: &str) {
    let f = post_json(
        addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "count": 1, "worker_id": "w1", "wait_ms": 5000}),
    )
    .await;
    assert_eq!(f.json()["jobs"][0]["id"], id, "{:?}", f.body);
    let a = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
}

/// The stream's events until it ends (or `limit` of quiet).
async fn drain(s: &mut Subscriber, limit: Duration) -> Vec<Sse> {
    let mut out = Vec::new();
    while let Some(e) = s.next(limit).await {
        out.push(e);
    }
    out
}

fn data(e: &Sse) -> Value {
    serde_json::from_str(&e.data).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_s_and_a_queue_s_streams_show_each_state_change() {
    let server = OjsServer::start(Some(EMBEDDED)).await;
    let addr = server.addr;
    let id = push(addr, "rt").await;
    let mut job = Subscriber::at(addr, &format!("/ojs/v1/jobs/{id}/events"), None)
        .await
        .unwrap();
    let mut queue = Subscriber::at(addr, "/ojs/v1/queues/rt/events", None)
        .await
        .unwrap();
    let other = push(addr, "rt").await;
    work(addr, "rt", &id).await;

    // The job's stream: each event, then its state change, and it ends
    // when the job finished.
    let seen = drain(&mut job, Duration::from_secs(10)).await;
    let kinds: Vec<&str> = seen.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "job.started",
            "job.state_changed",
            "job.completed",
            "job.state_changed"
        ],
        "{seen:?}"
    );
    let changes: Vec<(Value, Value)> = seen
        .iter()
        .filter(|e| e.event == "job.state_changed")
        .map(|e| {
            (
                data(e)["data"]["from"].clone(),
                data(e)["data"]["to"].clone(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        [
            (json!("available"), json!("active")),
            (json!("active"), json!("completed"))
        ]
    );
    let change = data(&seen[3]);
    assert_eq!(change["data"]["job_id"], id.as_str());
    assert_eq!(change["data"]["queue"], "rt");
    assert_eq!(change["data"]["type"], "realtime.job");
    assert!(change["data"]["timestamp"].is_string(), "{change}");

    // The queue's stream: the other job's push, then the first one's work.
    let mut kinds = Vec::new();
    while kinds.len() < 6 {
        let e = queue
            .next(Duration::from_secs(10))
            .await
            .expect("the queue's events");
        kinds.push((
            e.event.clone(),
            data(&e)["job_id"].as_str().map(str::to_owned),
        ));
    }
    assert_eq!(kinds[0], ("job.enqueued".into(), Some(other.clone())));
    assert_eq!(kinds[1].0, "job.state_changed");
    assert_eq!(kinds[2], ("job.started".into(), Some(id.clone())));
    // The queue's stream did not see this job before: its `from` is not known.
    let states: Vec<&str> = kinds.iter().map(|k| k.0.as_str()).collect();
    assert_eq!(
        states,
        [
            "job.enqueued",
            "job.state_changed",
            "job.started",
            "job.state_changed",
            "job.completed",
            "job.state_changed"
        ]
    );

    // A finished job's stream says where it is and ends.
    let mut done = Subscriber::at(addr, &format!("/ojs/v1/jobs/{id}/events"), None)
        .await
        .unwrap();
    let seen = drain(&mut done, Duration::from_secs(5)).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].event, "job.state_changed");
    assert_eq!(data(&seen[0])["data"]["to"], "completed");

    // Unknown job, unknown queue: a JSON 404.
    for path in [
        "/ojs/v1/jobs/019a0000-0000-7000-8000-000000000000/events".to_owned(),
        "/ojs/v1/queues/never-pushed/events".to_owned(),
    ] {
        let Err((status, body)) = Subscriber::at(addr, &path, None).await else {
            panic!("{path} opened");
        };
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (404, Some("not_found")),
            "{path}: {body}"
        );
    }
    server.stop();
}

/// A failed attempt is two events (`job.failed`, `job.retrying`) and one
/// state change; a cancel is one, and ends the job's stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_and_a_cancel_are_one_state_change_each() {
    let server = OjsServer::start(Some(EMBEDDED)).await;
    let addr = server.addr;
    let id = push(addr, "rt-fail").await;
    let mut job = Subscriber::at(addr, &format!("/ojs/v1/jobs/{id}/events"), None)
        .await
        .unwrap();
    let f = post_json(
        addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": ["rt-fail"], "count": 1, "wait_ms": 5000}),
    )
    .await;
    assert_eq!(f.json()["jobs"][0]["id"], id.as_str(), "{:?}", f.body);
    let n = post_json(
        addr,
        "/ojs/v1/workers/nack",
        &json!({"job_id": id, "error": {"code": "boom", "message": "failed on purpose"}}),
    )
    .await;
    assert_eq!(n.json()["state"], "retryable", "{:?}", n.body);
    let c = request(addr, "DELETE", &format!("/ojs/v1/jobs/{id}"), &[], None).await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    let seen = drain(&mut job, Duration::from_secs(10)).await;
    let shown: Vec<String> = seen
        .iter()
        .map(|e| match e.event.as_str() {
            "job.state_changed" => format!(
                "{}→{}",
                data(e)["data"]["from"].as_str().unwrap(),
                data(e)["data"]["to"].as_str().unwrap()
            ),
            other => other.to_owned(),
        })
        .collect();
    assert_eq!(
        shown,
        [
            "job.started",
            "available→active",
            "job.failed",
            "active→retryable",
            "job.retrying",
            "job.cancelled",
            "retryable→cancelled"
        ],
        "{seen:?}"
    );
    server.stop();
}

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens the WebSocket offering `ojs.v1`: the connection and the
/// subprotocol the server chose, or the refusal's status.
async fn connect(addr: SocketAddr) -> Result<(Ws, Option<String>), u16> {
    connect_as(addr, None).await
}

/// The same with a bearer token.
async fn connect_as(addr: SocketAddr, token: Option<&str>) -> Result<(Ws, Option<String>), u16> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!("ws://{addr}/ojs/v1/ws")
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("sec-websocket-protocol", "ojs.v1".parse().unwrap());
    if let Some(t) = token {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    match tokio_tungstenite::client_async(request, stream).await {
        Ok((ws, answer)) => {
            let protocol = answer
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap().to_owned());
            Ok((ws, protocol))
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(answer)) => Err(answer.status().as_u16()),
        Err(e) => panic!("{e}"),
    }
}

async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::text(v.to_string())).await.unwrap();
}

/// Sends `v` and reads the answer.
async fn ask(ws: &mut Ws, v: Value) -> Value {
    send(ws, v).await;
    receive(ws).await
}

/// The next JSON message (pings skipped), within 10 s.
async fn receive(ws: &mut Ws) -> Value {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("a message within 10 s")
            .expect("the connection is open")
            .unwrap();
        if let Message::Text(t) = m {
            return serde_json::from_str(t.as_str()).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_websocket_serves_both_dialects_resumes_and_refuses_what_it_should() {
    let server = OjsServer::start(Some(EMBEDDED)).await;
    let addr = server.addr;
    let id = push(addr, "ws").await;

    let (mut ws, protocol) = connect(addr).await.unwrap();
    assert_eq!(protocol.as_deref(), Some("ojs.v1"));
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "subscribe", "channel": "queue:ws"})
        )
        .await,
        json!({"type": "subscribed", "channel": "queue:ws"})
    );
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "subscribe", "channel": "job:019a0000-0000-7000-8000-000000000000"})
        )
        .await["code"],
        "not_found"
    );
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "subscribe", "channel": "queue:nobody"})
        )
        .await["code"],
        "not_found"
    );
    send(
        &mut ws,
        json!({"action": "subscribe", "channel": "events", "filter": {"event_types": ["job.completed"]}}),
    )
    .await;
    let subscribed = receive(&mut ws).await;
    assert_eq!(subscribed["action"], "subscribed");
    let sub_id = subscribed["subscription_id"].as_str().unwrap().to_owned();
    assert!(sub_id.starts_with("sub_"), "{subscribed}");
    ws.send(Message::text("not json")).await.unwrap();
    assert_eq!(receive(&mut ws).await["code"], "invalid_request");
    assert_eq!(
        ask(&mut ws, json!({"action": "dance"})).await["code"],
        "invalid_request"
    );
    // A subscription holds at most 1 KiB of names (what a closed
    // connection leaves remembered is bounded by it).
    for big in [
        json!({"action": "subscribe", "channel": "events", "filter": {"queues": ["q".repeat(2000)]}}),
        json!({"action": "subscribe", "channel": "all", "event_types": ["t".repeat(2000)]}),
    ] {
        let refused = ask(&mut ws, big).await;
        assert_eq!(refused["code"], "invalid_request", "{refused}");
    }

    work(addr, "ws", &id).await;
    let started = receive(&mut ws).await;
    assert_eq!(started["type"], "event");
    assert_eq!(started["channel"], "queue:ws");
    assert_eq!(started["event"], "job.started");
    assert_eq!(started["data"]["job_id"], id.as_str());
    assert!(started["id"].as_str().unwrap().starts_with("evt_"));
    assert!(started["timestamp"].is_string());
    // `job.completed` goes to both subscriptions, each in its dialect.
    let (a, b) = (receive(&mut ws).await, receive(&mut ws).await);
    let (realtime, bare) = if a["type"] == "event" { (a, b) } else { (b, a) };
    assert_eq!(realtime["event"], "job.completed");
    assert_eq!(bare["type"], "job.completed");
    assert_eq!(bare["job_id"], id.as_str());
    assert_eq!(bare["specversion"], "1.0");

    // Away and back: resume restores the subscriptions and sends again
    // what came after the id.
    let started_id = started["id"].as_str().unwrap().to_owned();
    ws.close(None).await.unwrap();
    drop(ws);
    let (mut ws, _) = connect_when_free(addr).await;
    let completed_id = realtime["id"].as_str().unwrap().to_owned();
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "resume", "last_event_id": "evt_x"})
        )
        .await["code"],
        "unknown_event_id"
    );
    send(
        &mut ws,
        json!({"action": "resume", "last_event_id": completed_id}),
    )
    .await;
    let resumed = receive(&mut ws).await;
    assert_eq!(resumed["type"], "resumed", "{resumed}");
    let mut channels: Vec<&str> = resumed["channels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    channels.sort_unstable();
    assert_eq!(channels, ["events", "queue:ws"]);
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "resume", "last_event_id": started_id})
        )
        .await["type"],
        "resumed"
    );
    let (a, b) = (receive(&mut ws).await, receive(&mut ws).await);
    let mut again = [a["event"].clone(), b["type"].clone()];
    again.sort_by_key(|v| v.to_string());
    assert_eq!(
        again,
        [json!("job.completed"), json!("job.completed")],
        "{a} {b}"
    );
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "unsubscribe", "subscription_id": sub_id})
        )
        .await["action"],
        "unsubscribed"
    );
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "unsubscribe", "channel": "queue:ws"})
        )
        .await,
        json!({"type": "unsubscribed", "channel": "queue:ws"})
    );

    // A message past 64 KiB closes the connection with 1009.
    let (mut big, _) = connect_when_free(addr).await;
    big.send(Message::text("x".repeat(100 * 1024)))
        .await
        .unwrap();
    let mut code = None;
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(10), big.next()).await {
        if let Message::Close(frame) = m {
            code = frame.map(|f| u16::from(f.code));
            break;
        }
    }
    assert_eq!(code, Some(1009));
    drop(big);

    // A plain GET is not a WebSocket: 400 naming the header.
    let plain = get(addr, "/ojs/v1/ws").await;
    assert_eq!(plain.status, 400, "{:?}", plain.body);
    assert_eq!(plain.json()["error"]["code"], "invalid_request");
    // Past [api] max_event_streams (4): 429.
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(connect_when_free(addr).await);
    }
    assert_eq!(connect(addr).await.err(), Some(429));
    drop(open);
    drop(ws);

    // Draining: the server says so and closes with 1001.
    let (mut ws, _) = connect_when_free(addr).await;
    send(&mut ws, json!({"action": "subscribe", "channel": "all"})).await;
    receive(&mut ws).await;
    server.terminate();
    let mut said_shutdown = false;
    let mut close_code = None;
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
        match m {
            Message::Text(t) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                said_shutdown |= v["event"] == "server.shutdown";
            }
            Message::Close(frame) => {
                close_code = frame.map(|f| u16::from(f.code));
                break;
            }
            _ => {}
        }
    }
    assert!(said_shutdown, "server.shutdown before the close");
    assert_eq!(close_code, Some(1001));
    server.stop();
}

async fn connect_when_free(addr: SocketAddr) -> (Ws, Option<String>) {
    for _ in 0..50 {
        match connect(addr).await {
            Ok(c) => return c,
            Err(429) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(other) => panic!("{other}"),
        }
    }
    panic!("no stream place freed within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_stream_events_sends_what_its_filters_select() {
    use ojs_api::grpc::pb;
    let server = OjsServer::start(Some(EMBEDDED)).await;
    let addr = server.addr;
    let mut client = crate::ojs_grpc::client(addr).await;
    let mut events = client
        .stream_events(pb::StreamEventsRequest {
            queues: vec!["ge".into()],
            event_types: vec!["job.*".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    push(addr, "elsewhere").await;
    let id = push(addr, "ge").await;
    let first = tokio::time::timeout(Duration::from_secs(10), events.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.r#type, "job.enqueued");
    assert_eq!(first.job_id, id);
    assert_eq!(first.queue, "ge");
    assert_eq!(first.job_type, "realtime.job");
    assert!(first.id.starts_with("evt_"), "{first:?}");
    assert!(first.timestamp.is_some());
    assert!(first.data.is_some());
    server.stop();
}

/// Tokens: no token or one without `read` is refused at the handshake; a
/// token scoped to one queue sees that queue's events on `all`, cannot
/// subscribe to another queue, nor open another queue's job stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_views_show_a_token_only_its_queues() {
    use crate::ojs_api_security::{AUDITOR, OPERATOR, OPS, PRODUCER, TOKENS_CONFIG};
    let dir = ojs_bridge_tests::tempdir::TempDir::new("ojs-realtime-tokens");
    for (file, secret) in [
        ("operator.token", OPERATOR),
        ("producer.token", PRODUCER),
        ("auditor.token", AUDITOR),
        ("ops.token", OPS),
    ] {
        std::fs::write(dir.path().join(file), secret).unwrap();
    }
    let server =
        OjsServer::start_with(dir, Some(TOKENS_CONFIG), &[("OJS_BRIDGE_LOG", "trace")]).await;
    let addr = server.addr;
    assert_eq!(connect_as(addr, None).await.err(), Some(401));
    assert_eq!(connect_as(addr, Some("nope")).await.err(), Some(401));
    assert_eq!(connect_as(addr, Some(PRODUCER)).await.err(), Some(403));

    let push_as = |queue: &'static str| async move {
        let a = request(
            addr,
            "POST",
            "/ojs/v1/jobs",
            &[
                ("content-type".into(), "application/json".into()),
                ("authorization".into(), format!("Bearer {PRODUCER}")),
            ],
            Some(
                json!({"type": "scope.check", "args": [1], "options": {"queue": queue}})
                    .to_string()
                    .as_bytes(),
            ),
        )
        .await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        a.json()["job"]["id"].as_str().unwrap().to_owned()
    };
    let mail = push_as("mail.x").await;
    push_as("orders").await;

    let (mut ws, _) = connect_as(addr, Some(AUDITOR)).await.unwrap();
    assert_eq!(
        ask(
            &mut ws,
            json!({"action": "subscribe", "channel": "queue:mail.x"})
        )
        .await["code"],
        "not_found"
    );
    assert_ne!(
        ask(
            &mut ws,
            json!({"action": "subscribe", "channel": format!("job:{mail}")})
        )
        .await["type"],
        "subscribed"
    );
    assert_eq!(
        ask(&mut ws, json!({"action": "subscribe", "channel": "all"})).await["type"],
        "subscribed"
    );
    push_as("mail.x").await;
    let orders = push_as("orders").await;
    // The first event it is sent is the orders job's: the mail.x one, pushed
    // first, never comes.
    let first = receive(&mut ws).await;
    assert_eq!(first["data"]["job_id"], orders.as_str(), "{first}");
    assert_eq!(first["data"]["queue"], "orders");

    let job_stream = request(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{mail}/events"),
        &[("authorization".into(), format!("Bearer {AUDITOR}"))],
        None,
    )
    .await;
    assert!(
        matches!(job_stream.status, 403 | 404),
        "another queue's job stream: {} {:?}",
        job_stream.status,
        job_stream.body
    );
    drop(ws);
    // No log line, even at trace, holds a token the WebSocket was opened with.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = server.log();
    for secret in [OPERATOR, PRODUCER, AUDITOR, OPS] {
        assert!(!log.contains(secret), "the log holds a token");
    }
    assert!(!String::from_utf8_lossy(&job_stream.body).contains(AUDITOR));
    server.stop();
}
