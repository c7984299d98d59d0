//! The OJS server under abuse, as an attacker or a careless client would
//! try it: a real `ojs-bridge run` on the embedded default, each finding
//! of the abuse review reproduced and its fixed behaviour asserted. Memory
//! is read from the process itself (`VmHWM`, its peak resident set).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ojs_bridge_tests::tempdir::TempDir;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ojs_server::{get, post_json, request, Answer, OjsServer};

const JSON: &str = "application/openjobspec+json";
/// 2^53 - 1.
const MAX_EXACT: u64 = (1 << 53) - 1;

/// A kilobyte-scale figure of the daemon's `/proc/<pid>/status` (`VmHWM`,
/// `VmRSS`), in bytes.
fn memory(server: &OjsServer, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc status"))
}

/// A configuration on the embedded broker with the API, `api` more lines
/// of `[api]` (and tables after it).
fn embedded(api: &str) -> String {
    format!("[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n{api}")
}

/// A PUSH of `body` as it is, in `content_type`.
async fn push_bytes(addr: SocketAddr, content_type: &str, body: &[u8]) -> Answer {
    request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &[("content-type".into(), content_type.into())],
        Some(body),
    )
    .await
}

fn error_code(a: &Answer) -> String {
    a.json()["error"]["code"].as_str().unwrap_or("").to_owned()
}

fn attribute(a: &Answer) -> String {
    a.json()["error"]["details"]["attribute"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

async fn fetch(addr: SocketAddr, queue: &str, count: usize) -> Vec<Value> {
    let a = post_json(
        addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "count": count, "wait_ms": 500}),
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()["jobs"].as_array().cloned().unwrap_or_default()
}

/// Puts a job straight onto the embedded broker, as another producer
/// would: the server's validation never sees it.
fn put_on_broker(server: &OjsServer, queue: &str, job: &Value) {
    let out = crate::support::ojs_bridge_in(
        server.dir.path(),
        &["send", "--to", "local:./ojs-bridge-data", "--queue", queue],
        format!("{job}\n").as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Finding 1: a retry interval no calendar holds was refused at PUSH, and
/// the same job put on the broker by another producer (never validated)
/// is NACKed without taking the store down: later PUSHes, ACKs and health
/// answer as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_a_nack_with_an_overflowing_backoff_leaves_the_store_serving() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let retry = json!({"max_attempts": 5, "initial_interval": "PT90000000000000S",
                       "max_interval": "PT90000000000000S", "jitter": false});
    let refused = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "t.p", "args": [], "options": {"queue": "q", "retry": retry}}),
    )
    .await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    assert_eq!(attribute(&refused), "options.retry.initial_interval");
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("30 days"),
        "{:?}",
        refused.body
    );

    let id = ojs_core::envelope::new_job_id();
    put_on_broker(
        &server,
        "q",
        &json!({"specversion": "1.0", "id": id, "type": "t.p", "queue": "q", "args": [],
                "retry": retry}),
    );
    for round in 0..2 {
        let jobs = fetch(addr, "q", 1).await;
        assert_eq!(jobs.len(), 1, "round {round}");
        assert_eq!(jobs[0]["id"], json!(id));
        let nack = post_json(
            addr,
            "/ojs/v1/workers/nack",
            &json!({"job_id": id, "error": {"code": "boom", "message": "failed"},
                    "requeue": round == 0}),
        )
        .await;
        assert_eq!(nack.status, 200, "round {round}: {:?}", nack.body);
    }
    let info = get(addr, &format!("/ojs/v1/jobs/{id}")).await;
    assert_eq!(info.json()["job"]["state"], "retryable", "{:?}", info.body);
    // The retry waits the longest interval, not forever and not never.
    let next = info.json()["job"]["next_attempt_at"]
        .as_str()
        .unwrap()
        .to_owned();
    let next = chrono::DateTime::parse_from_rfc3339(&next).unwrap();
    let days = (next.with_timezone(&chrono::Utc) - chrono::Utc::now()).num_days();
    assert!((20..=31).contains(&days), "next attempt in {days} days");

    let after = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "t.p", "args": [1], "options": {"queue": "q2"}}),
    )
    .await;
    assert_eq!(after.status, 201, "the store goes on: {:?}", after.body);
    let jobs = fetch(addr, "q2", 1).await;
    let ack = post_json(
        addr,
        "/ojs/v1/workers/ack",
        &json!({"job_id": jobs[0]["id"]}),
    )
    .await;
    assert_eq!(ack.status, 200, "{:?}", ack.body);
    let health = get(addr, "/ojs/v1/health").await;
    assert_eq!(health.status, 200, "{:?}", health.body);
    assert_eq!(health.json()["store"]["status"], "ok");
    assert!(!server.log().contains("panicked"), "{}", server.log());
    server.stop();
}

/// The store that cannot write (another process holds its file's write
/// lock past the busy wait) fails requests as retryable, and health says
/// so, 503 with the reason, as does the metric; once it writes again both
/// say so within the probe's second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_a_store_that_cannot_write_turns_health_503_until_it_can() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let push = json!({"type": "t.w", "args": []});
    assert_eq!(post_json(addr, "/ojs/v1/jobs", &push).await.status, 201);
    let file = server
        .dir
        .path()
        .join("ojs-bridge-data")
        .join("jobs.sqlite");
    let blocker = rusqlite::Connection::open(&file).unwrap();
    blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let refused = post_json(addr, "/ojs/v1/jobs", &push).await;
    assert_eq!(refused.status, 500, "{:?}", refused.body);
    assert_eq!(refused.json()["error"]["retryable"], true);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut health = get(addr, "/ojs/v1/health").await;
    while health.status != 503 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        health = get(addr, "/ojs/v1/health").await;
    }
    assert_eq!(health.status, 503, "{:?}", health.body);
    assert_eq!(health.json()["store"]["status"], "unavailable");
    assert!(
        health.json()["store"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("locked")),
        "{:?}",
        health.body
    );
    let metrics = String::from_utf8_lossy(&get(addr, "/metrics").await.body).to_string();
    assert_eq!(
        crate::support::metric(&metrics, "ojs_bridge_api_store_up"),
        Some(0.0)
    );
    blocker.execute_batch("ROLLBACK").unwrap();
    drop(blocker);
    assert_eq!(post_json(addr, "/ojs/v1/jobs", &push).await.status, 201);
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(addr, "/ojs/v1/health").await.status != 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(get(addr, "/ojs/v1/health").await.status, 200);
    let metrics = String::from_utf8_lossy(&get(addr, "/metrics").await.body).to_string();
    assert_eq!(
        crate::support::metric(&metrics, "ojs_bridge_api_store_up"),
        Some(1.0)
    );
    server.stop();
}

/// Finding 3: a NACK without `error`, without `error.message`, or with
/// empty strings fails the job (never 500, never left active); fields of
/// the wrong type are 400 naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_a_nack_without_a_message_fails_the_job_not_the_request() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    for (i, error) in [
        None,
        Some(json!({})),
        Some(json!({"code": "x"})),
        Some(json!({"code": "", "message": "", "type": ""})),
    ]
    .into_iter()
    .enumerate()
    {
        let queue = format!("nack{i}");
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": "t.n", "args": [], "options": {"queue": queue}}),
        )
        .await;
        assert_eq!(a.status, 201);
        let id = fetch(addr, &queue, 1).await[0]["id"].clone();
        let mut body = json!({"job_id": id});
        if let Some(e) = &error {
            body["error"] = e.clone();
        }
        let nack = post_json(addr, "/ojs/v1/workers/nack", &body).await;
        assert_eq!(nack.status, 200, "{error:?}: {:?}", nack.body);
        assert_eq!(nack.json()["state"], "retryable", "{error:?}");
        let message = nack.json()["job"]["error"]["message"].clone();
        assert!(message.as_str().is_some_and(|m| !m.is_empty()), "{message}");
    }
    let wrong = post_json(
        addr,
        "/ojs/v1/workers/nack",
        &json!({"job_id": "x", "error": "boom"}),
    )
    .await;
    assert_eq!(wrong.status, 400);
    assert_eq!(attribute(&wrong), "error");
    // An ACK whose result the job cannot carry is the request's fault;
    // the job stays active for a good one.
    post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "t.n", "args": [], "options": {"queue": "acks"}}),
    )
    .await;
    let id = fetch(addr, "acks", 1).await[0]["id"].clone();
    let bad = request(
        addr,
        "POST",
        "/ojs/v1/workers/ack",
        &[("content-type".into(), JSON.into())],
        Some(format!(r#"{{"job_id":{id},"result":{{"n":18014398509481984}}}}"#).as_bytes()),
    )
    .await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    let good = post_json(
        addr,
        "/ojs/v1/workers/ack",
        &json!({"job_id": id, "result": {"n": 1}}),
    )
    .await;
    assert_eq!(good.status, 200, "{:?}", good.body);
    server.stop();
}

/// Finding 2: a FETCH's answer is bounded by bytes as well as by count
/// (fewer jobs, at least one), every job is still handed out once, and
/// the daemon's peak memory stays a small multiple of what it answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_one_fetch_answer_is_bounded_by_bytes() {
    let config = embedded("max_fetch_bytes = 4194304\n");
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    let big = "x".repeat(1 << 20);
    let sent = 12;
    for i in 0..sent {
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": "t.big", "args": [i, big], "options": {"queue": "big"}}),
        )
        .await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    let before = memory(&server, "VmRSS");
    let mut seen = std::collections::BTreeSet::new();
    let mut largest_answer = 0;
    let mut duplicated = 0;
    while seen.len() < sent {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": ["big"], "count": 250, "wait_ms": 500}),
        )
        .await;
        assert_eq!(a.status, 200);
        let jobs = a.json()["jobs"].as_array().cloned().unwrap();
        assert!(!jobs.is_empty(), "jobs are left: a FETCH gets at least one");
        assert!(
            jobs.len() <= 4,
            "{} jobs of 1 MiB in an answer bounded by 4 MiB",
            jobs.len()
        );
        largest_answer = largest_answer.max(a.body.len());
        for j in jobs {
            if !seen.insert(j["id"].as_str().unwrap().to_owned()) {
                duplicated += 1;
            }
            let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": j["id"]})).await;
            assert_eq!(ack.status, 200);
        }
    }
    let peak = memory(&server, "VmHWM");
    println!(
        "fetch bound: sent {sent}, received {}, duplicated {duplicated}, lost {}; largest answer {} bytes; RSS before {} MiB, peak {} MiB",
        seen.len(),
        sent - seen.len(),
        largest_answer,
        before >> 20,
        peak >> 20
    );
    assert_eq!(duplicated, 0);
    assert!(
        peak.saturating_sub(before) <= 4 * 4 * (1 << 20) + (64 << 20),
        "peak {peak} before {before}"
    );
    server.stop();
}

/// The daemon's gauge of bytes of active jobs' messages it holds.
async fn held_bytes(addr: SocketAddr) -> f64 {
    let text = String::from_utf8_lossy(&get(addr, "/metrics").await.body).to_string();
    crate::support::metric(&text, "ojs_bridge_api_held_bytes").expect("the gauge is rendered")
}

/// A worker that fetches and never acks held every job's message in the
/// daemon until its visibility ran out, whatever their size: the queue's
/// whole content could be pulled into memory. What the process holds for
/// active jobs is bounded by `[api] max_held_bytes`, concurrent FETCHes
/// included: a FETCH takes what fits, waits for an ACK or NACK when
/// nothing does, and answers 429 when none came within its wait; every job
/// is still handed out once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_the_active_jobs_a_process_holds_are_bounded_by_bytes() {
    let limit: u64 = 4 << 20;
    let config = embedded(&format!("max_held_bytes = {limit}\n"));
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    let big = "x".repeat(1 << 20);
    let push = |n: usize| {
        let big = big.clone();
        async move {
            for i in 0..n {
                let body = json!({"type": "t.big", "args": [i, big], "options": {"queue": "held"}});
                let a = post_json(addr, "/ojs/v1/jobs", &body).await;
                assert_eq!(a.status, 201, "{:?}", a.body);
            }
        }
    };
    let fetch_all = |wait_ms: u64| async move {
        let body = json!({"queues": ["held"], "count": 250, "wait_ms": wait_ms});
        post_json(addr, "/ojs/v1/workers/fetch", &body).await
    };
    let jobs_of = |a: &Answer| a.json()["jobs"].as_array().cloned().unwrap_or_default();
    // FETCHes waiting on an empty queue hold no room: another one
    // answers empty, not 429.
    let idle = |wait_ms: u64| async move {
        let body = json!({"queues": ["held-idle"], "count": 250, "wait_ms": wait_ms});
        post_json(addr, "/ojs/v1/workers/fetch", &body).await
    };
    let long_poll = tokio::spawn(idle(2_000));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = idle(300).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(jobs_of(&a).is_empty());
    assert_eq!(long_poll.await.unwrap().status, 200);
    let sent = 10;
    push(sent).await;
    let before = memory(&server, "VmRSS");
    // Fetched and not acked: three jobs of a little over 1 MiB fit.
    let a = fetch_all(500).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let mut active = jobs_of(&a);
    assert_eq!(active.len(), 3);
    let held = held_bytes(addr).await;
    assert!(
        held >= (3 << 20) as f64 && held <= limit as f64,
        "held {held}"
    );
    // No room for another: the FETCH waits, then says why.
    let full = fetch_all(300).await;
    assert_eq!(full.status, 429, "{:?}", full.body);
    assert_eq!(error_code(&full), "rate_limited");
    assert_eq!(full.header("retry-after").as_deref(), Some("1"));
    assert_eq!(full.json()["error"]["details"]["limit_bytes"], json!(limit));
    assert!(full.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("max_held_bytes"));
    // An ACK makes room for a FETCH waiting meanwhile.
    let waiting = tokio::spawn(fetch_all(5_000));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = active.remove(0);
    let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": first["id"]})).await;
    assert_eq!(ack.status, 200, "{:?}", ack.body);
    let woken = waiting.await.unwrap();
    assert_eq!(woken.status, 200, "{:?}", woken.body);
    let jobs = jobs_of(&woken);
    assert_eq!(jobs.len(), 1, "the room the ACK made is used");
    active.extend(jobs);
    // Every job handed out once, acking as we go.
    let mut seen: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    seen.insert(first["id"].as_str().unwrap().to_owned());
    let mut duplicated = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < sent && Instant::now() < deadline {
        for j in active.drain(..) {
            if !seen.insert(j["id"].as_str().unwrap().to_owned()) {
                duplicated += 1;
            }
            let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": j["id"]})).await;
            assert_eq!(ack.status, 200, "{:?}", ack.body);
        }
        if seen.len() < sent {
            let a = fetch_all(500).await;
            assert_eq!(a.status, 200, "{:?}", a.body);
            active = jobs_of(&a);
        }
    }
    assert_eq!(held_bytes(addr).await, 0.0, "every job acked: nothing held");
    // Concurrent FETCHes share the room: together they take what fits.
    push(sent).await;
    let racing: Vec<_> = (0..8).map(|_| tokio::spawn(fetch_all(300))).collect();
    let mut handed_out = 0;
    for r in racing {
        let a = r.await.unwrap();
        assert!(a.status == 200 || a.status == 429, "{:?}", a.body);
        if a.status == 200 {
            handed_out += jobs_of(&a).len();
        }
    }
    let held = held_bytes(addr).await;
    let peak = memory(&server, "VmHWM");
    println!(
        "held bound: sent {sent}, received {}, duplicated {duplicated}, lost {}; 8 concurrent FETCHes took {handed_out} of {sent}, {held} bytes held; RSS before {} MiB, peak {} MiB",
        seen.len(),
        sent - seen.len(),
        before >> 20,
        peak >> 20
    );
    assert_eq!(seen.len(), sent, "lost");
    assert_eq!(duplicated, 0);
    assert_eq!(handed_out, 3, "{held} bytes held");
    assert!(held <= limit as f64, "held {held}");
    server.stop();
}

/// Findings 2 and 5: what a body can make the server allocate is bounded
/// before a value is built (1.3 M empty arrays are 400, not 122 MB), and
/// bodies in flight share one budget: concurrent pushes past it are 429
/// with `Retry-After`, and the daemon's peak memory stays within a small
/// multiple of the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_large_pushes_stay_within_the_budget_of_bodies_in_flight() {
    let config = embedded("max_body_bytes_in_flight = 16777216\n");
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    let arrays = format!(r#"{{"type":"t.a","args":[{}[]]}}"#, "[],".repeat(1_300_000));
    let a = push_bytes(addr, JSON, arrays.as_bytes()).await;
    assert_eq!(a.status, 400, "{:?}", &a.body[..a.body.len().min(300)]);
    assert!(a.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_json_values"));
    // The same in protobuf: its values are counted as they are decoded.
    let lists: Vec<Value> = (0..300_000).map(|_| json!([])).collect();
    let envelope = ojs_core::JobEnvelope::from_json_value(json!({
        "specversion": "1.0", "id": ojs_core::envelope::new_job_id(), "type": "t.a",
        "args": [lists]}))
    .unwrap();
    let a = request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &[(
            "content-type".into(),
            "application/openjobspec+proto".into(),
        )],
        Some(&envelope.to_proto_bytes().unwrap()),
    )
    .await;
    assert_eq!(a.status, 400, "{:?}", &a.body[..a.body.len().min(300)]);
    let huge = br#"{"type":"t.i","args":[123456789012345678901234567890123456789]}"#;
    let a = push_bytes(addr, JSON, huge).await;
    assert_eq!(
        a.status, 400,
        "an integer beyond 64 bits is refused, never rounded"
    );

    let body =
        json!({"type": "t.big", "args": ["y".repeat(3_900_000)], "options": {"queue": "bulk"}})
            .to_string();
    let body = bytes::Bytes::from(body);
    // The page caches of the store and of the embedded broker fill with
    // the first large jobs (a fixed cost, not a request's): filled first,
    // so that what follows measures what requests hold.
    for _ in 0..8 {
        let a = push_bytes(addr, JSON, &body).await;
        assert_eq!(a.status, 201);
    }
    let before = memory(&server, "VmHWM");
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let a = push_bytes(addr, JSON, &body).await;
            (a.status, a.header("retry-after"))
        }));
    }
    let mut created = 0;
    let mut limited = 0;
    for t in tasks {
        match t.await.unwrap() {
            (201, _) => created += 1,
            (429, Some(after)) => {
                assert_eq!(after, "1");
                limited += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    let peak = memory(&server, "VmHWM");
    let growth = peak.saturating_sub(before);
    println!(
        "64 pushes of 3.9 MB: {created} created, {limited} refused 429; RSS before {} MiB, peak {} MiB, growth {:.1}x the 16 MiB budget",
        before >> 20,
        peak >> 20,
        growth as f64 / (16 << 20) as f64
    );
    assert!(created >= 1 && created + limited == 64);
    assert!(
        growth <= 4 * (16 << 20),
        "peak memory grew {growth} bytes for a 16 MiB budget"
    );
    server.stop();
}

/// Opens a connection that sends a request head and one byte of its body,
/// then nothing.
async fn slow_body(addr: SocketAddr, token: Option<&str>) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    s.write_all(
        format!("POST /ojs/v1/jobs HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{").as_bytes(),
    )
    .await
    .unwrap();
    s
}

/// Finding 4: a head with a bad token is answered 401 at once, without its
/// body; a body that trickles is cut off by its deadline and minimum
/// rate; and 300 connections waiting on their bodies do not keep a new
/// client (HTTP/1.1 or TLS) waiting: they count for eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_slow_bodies_do_not_starve_the_listener() {
    let dir = TempDir::new("abuse-slow");
    std::fs::write(dir.path().join("push.token"), "push-secret\n").unwrap();
    let config = embedded("body_timeout = \"5s\"\n\n[[api.tokens]]\nname = \"push\"\nfile = \"push.token\"\noperations = [\"push\", \"read\"]\n");
    let server = OjsServer::start_in(dir, Some(&config)).await;
    let addr = server.addr;

    // A bad token: 401 before the body, which is never sent.
    let mut s = slow_body(addr, Some("wrong")).await;
    let mut text = Vec::new();
    let started = Instant::now();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut text)).await;
    let text = String::from_utf8_lossy(&text);
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // A trickle: a byte a second is far below the minimum rate.
    let mut s = slow_body(addr, Some("push-secret")).await;
    let started = Instant::now();
    let mut text = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        if s.write_all(b" ").await.is_err() {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut text)).await;
    let text = String::from_utf8_lossy(&text);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    println!("a trickling body was cut off after {:?}", started.elapsed());

    // 300 stalled bodies; then a new client.
    let mut stalled = Vec::new();
    for _ in 0..300 {
        stalled.push(slow_body(addr, Some("push-secret")).await);
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let started = Instant::now();
    let health = request(
        addr,
        "GET",
        "/ojs/v1/jobs/00000000-0000-7000-8000-000000000000",
        &[("authorization".into(), "Bearer push-secret".into())],
        None,
    )
    .await;
    let waited = started.elapsed();
    println!("with 300 stalled bodies open, a new HTTP/1.1 client was answered in {waited:?}");
    assert_eq!(health.status, 404);
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    drop(stalled);
    server.stop();
}

/// The same over TLS: 300 TLS connections waiting on their bodies, and a
/// new TLS client is answered (its handshake included) within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_slow_bodies_over_tls_do_not_starve_the_listener() {
    let Some(tls) = crate::ojs_api_security::tls_dir() else {
        return;
    };
    let pem = |f: &str| tls.join(f).display().to_string();
    let config = format!(
        "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[http]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n[api]\nadapter = \"local\"\n",
        pem("server.pem"),
        pem("server.key")
    );
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    let connector = crate::ojs_api_security::connector(&tls, false, b"http/1.1");
    let open = |connector: tokio_rustls::TlsConnector| async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        connector.connect(name, tcp).await
    };
    let mut stalled = Vec::new();
    for _ in 0..300 {
        let Ok(mut s) = open(connector.clone()).await else {
            continue;
        };
        let _ = s
            .write_all(b"POST /ojs/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            .await;
        stalled.push(s);
    }
    assert!(
        stalled.len() >= 250,
        "{} TLS connections opened",
        stalled.len()
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let started = Instant::now();
    let mut s = open(connector.clone()).await.expect("a new TLS handshake");
    s.write_all(b"GET /ojs/v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut text)).await;
    let waited = started.elapsed();
    println!("with 300 stalled TLS bodies open, a new TLS client was answered in {waited:?}");
    assert!(String::from_utf8_lossy(&text).starts_with("HTTP/1.1 200"));
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    drop(stalled);
    server.stop();
}

/// Finding 6: `kill -9` while 32 clients push; after the restart, jobs
/// whose broker confirm was not recorded are published again, and a copy
/// of a job active here is never handed out beside it: each job is handed
/// out once and every ACK succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_a_republished_copy_is_never_handed_out_beside_the_active_job() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let mut tasks = Vec::new();
    for c in 0..32 {
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0.. {
                let body = json!({"type": "t.k", "args": [c, i], "options": {"queue": "killed"}});
                let Some(a) = try_push(addr, &body).await else {
                    break;
                };
                ids.push(a);
            }
            ids
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dir = server.kill();
    let mut sent = std::collections::BTreeSet::new();
    for t in tasks {
        sent.extend(t.await.unwrap());
    }
    assert!(sent.len() > 100, "{} pushes answered 201", sent.len());
    let server = OjsServer::start_in(dir, None).await;
    let addr = server.addr;
    let mut received = std::collections::BTreeSet::new();
    let mut duplicated = 0;
    let mut conflicts = 0;
    let mut idle = 0;
    while idle < 4 {
        let jobs = fetch(addr, "killed", 10).await;
        if jobs.is_empty() {
            idle += 1;
            continue;
        }
        idle = 0;
        let ids: Vec<String> = jobs
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_owned())
            .collect();
        for id in &ids {
            if !received.insert(id.clone()) {
                duplicated += 1;
            }
        }
        for id in ids {
            let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
            if ack.status == 409 {
                conflicts += 1;
            }
        }
    }
    let lost = sent.difference(&received).count();
    println!(
        "kill -9 under 32 pushing clients: sent {}, received {}, duplicated {duplicated}, lost {lost}, ACK conflicts {conflicts}",
        sent.len(),
        received.len()
    );
    assert_eq!((duplicated, lost, conflicts), (0, 0, 0));
    server.stop();
}

/// A PUSH whose answer may never come (the daemon is killed): the job's
/// id when it was answered 201.
async fn try_push(addr: SocketAddr, body: &Value) -> Option<String> {
    let (status, body) =
        crate::ojs_server::try_answer(addr, "POST", "/ojs/v1/jobs", body.to_string().as_bytes())
            .await?;
    let v: Value = serde_json::from_slice(&body).ok()?;
    (status == 201).then(|| v["job"]["id"].as_str().map(str::to_owned))?
}

/// Finding 7: outside the token's queues a job does not exist: INFO,
/// CANCEL, ACK and NACK answer 404 as for an unknown id, naming no queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_a_job_outside_the_token_s_queues_does_not_exist_for_it() {
    let dir = TempDir::new("abuse-scope");
    std::fs::write(dir.path().join("ops.token"), "ops-secret\n").unwrap();
    std::fs::write(dir.path().join("tenant.token"), "tenant-secret\n").unwrap();
    let config = embedded("\n[[api.tokens]]\nname = \"ops\"\nfile = \"ops.token\"\noperations = [\"admin\"]\n\n[[api.tokens]]\nname = \"tenant\"\nfile = \"tenant.token\"\noperations = [\"admin\"]\nqueues = [\"tenant-a.*\"]\n");
    let server = OjsServer::start_in(dir, Some(&config)).await;
    let addr = server.addr;
    let with = |token: &str| {
        vec![
            ("content-type".to_owned(), JSON.to_owned()),
            ("authorization".to_owned(), format!("Bearer {token}")),
        ]
    };
    let a = request(
        addr,
        "POST",
        "/ojs/v1/jobs",
        &with("ops-secret"),
        Some(
            json!({"type": "t.s", "args": [], "options": {"queue": "secret-payroll"}})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(a.status, 201);
    let hidden = a.json()["job"]["id"].as_str().unwrap().to_owned();
    let jobs = request(
        addr,
        "POST",
        "/ojs/v1/workers/fetch",
        &with("ops-secret"),
        Some(json!({"queues": ["secret-payroll"]}).to_string().as_bytes()),
    )
    .await;
    assert_eq!(jobs.json()["jobs"][0]["id"], json!(hidden));
    let unknown = ojs_core::envelope::new_job_id();
    for id in [&hidden, &unknown] {
        let answers = [
            request(
                addr,
                "GET",
                &format!("/ojs/v1/jobs/{id}"),
                &with("tenant-secret"),
                None,
            )
            .await,
            request(
                addr,
                "DELETE",
                &format!("/ojs/v1/jobs/{id}"),
                &with("tenant-secret"),
                None,
            )
            .await,
            request(
                addr,
                "POST",
                "/ojs/v1/workers/ack",
                &with("tenant-secret"),
                Some(json!({"job_id": id}).to_string().as_bytes()),
            )
            .await,
            request(
                addr,
                "POST",
                "/ojs/v1/workers/nack",
                &with("tenant-secret"),
                Some(
                    json!({"job_id": id, "error": {"message": "x"}})
                        .to_string()
                        .as_bytes(),
                ),
            )
            .await,
        ];
        for a in answers {
            assert_eq!(a.status, 404, "{:?}", a.body);
            assert_eq!(error_code(&a), "not_found");
            assert!(!String::from_utf8_lossy(&a.body).contains("payroll"));
        }
    }
    // The job is still active, for its worker.
    let info = request(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{hidden}"),
        &with("ops-secret"),
        None,
    )
    .await;
    assert_eq!(info.json()["job"]["state"], "active");
    server.stop();
}

/// Finding 9: every duration a request names is bounded (400 naming the
/// field and its bound); a FETCH names at most 32 queues; `/metrics` and
/// health take the `bearer` scheme in any case, as the API does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_durations_queues_and_schemes_are_bounded_and_named() {
    let dir = TempDir::new("abuse-bounds");
    std::fs::write(dir.path().join("http.token"), "http-secret\n").unwrap();
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[http]\ntoken_file = \"http.token\"\n[api]\nadapter = \"local\"\n";
    let server = OjsServer::start_in(dir, Some(config)).await;
    let addr = server.addr;
    let auth = |scheme: &str| {
        vec![
            ("content-type".to_owned(), JSON.to_owned()),
            ("authorization".to_owned(), format!("{scheme} http-secret")),
        ]
    };
    for scheme in ["Bearer", "bearer", "BEARER"] {
        for path in ["/metrics", "/ojs/v1/health", "/ojs/manifest"] {
            let a = request(addr, "GET", path, &auth(scheme), None).await;
            assert_eq!(a.status, 200, "{scheme} {path}");
        }
    }
    let push = |options: Value| {
        let headers = auth("Bearer");
        async move {
            request(
                addr,
                "POST",
                "/ojs/v1/jobs",
                &headers,
                Some(
                    json!({"type": "t.b", "args": [], "options": options})
                        .to_string()
                        .as_bytes(),
                ),
            )
            .await
        }
    };
    for (options, field) in [
        // The largest integers a job carries exactly (2^53 - 1); beyond
        // them the body itself is refused.
        (
            json!({"visibility_timeout_ms": MAX_EXACT}),
            "options.visibility_timeout_ms",
        ),
        (json!({"timeout_ms": MAX_EXACT}), "options.timeout_ms"),
        (
            json!({"retry": {"max_interval_ms": MAX_EXACT}}),
            "options.retry.max_interval",
        ),
        (
            json!({"retry": {"initial_interval": "P31D"}}),
            "options.retry.initial_interval",
        ),
    ] {
        let a = push(options.clone()).await;
        assert_eq!(a.status, 400, "{options}: {:?}", a.body);
        assert_eq!(attribute(&a), field);
    }
    let queues: Vec<String> = (0..1000).map(|i| format!("q{i}")).collect();
    let started = Instant::now();
    let a = request(
        addr,
        "POST",
        "/ojs/v1/workers/fetch",
        &auth("Bearer"),
        Some(
            json!({"queues": queues, "wait_ms": 100})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert_eq!(attribute(&a), "queues");
    assert!(started.elapsed() < Duration::from_secs(5));
    let a = request(
        addr,
        "POST",
        "/ojs/v1/workers/heartbeat",
        &auth("Bearer"),
        Some(
            json!({"worker_id": "w", "visibility_timeout_ms": 1_000_000_000_000u64})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(attribute(&a), "visibility_timeout_ms");
    server.stop();
}

/// The daemon's gauge of queue consumers kept for FETCH.
async fn consumers(addr: SocketAddr) -> f64 {
    let text = String::from_utf8_lossy(&get(addr, "/metrics").await.body).to_string();
    crate::support::metric(&text, "ojs_bridge_api_consumers").expect("the gauge is rendered")
}

/// Finding 9: consumers of queues no FETCH uses are closed after `[api]
/// consumer_idle_timeout`, and no more than `max_consumers` are open
/// (the idlest makes room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_idle_consumers_are_reaped_and_capped() {
    let config = embedded("consumer_idle_timeout = \"2s\"\nmax_consumers = 4\n");
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    for i in 0..6 {
        let queue = format!("idle{i}");
        let a = post_json(addr, "/ojs/v1/workers/fetch", &json!({"queues": [queue]})).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert!(consumers(addr).await <= 4.0);
    }
    assert_eq!(consumers(addr).await, 4.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while consumers(addr).await > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(consumers(addr).await, 0.0, "every idle consumer is closed");
    server.stop();
}

/// Findings 7, 8 and 9 over gRPC: the same auth rule per operation as HTTP
/// (`Manifest` and reflection need a token where tokens are set, health
/// and `grpc.health.v1` the `[http]` token where it is set, with the
/// detail for it alone), a job outside the token's queues is `NOT_FOUND`
/// as an unknown one, and a heartbeat's `extend_by` is bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_grpc_follows_the_same_auth_rules_and_bounds_as_http() {
    use ojs_api::grpc::pb;
    use tonic::Code;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let dir = TempDir::new("abuse-grpc");
    std::fs::write(dir.path().join("http.token"), "http-secret\n").unwrap();
    std::fs::write(dir.path().join("tenant.token"), "tenant-secret\n").unwrap();
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[http]\ntoken_file = \"http.token\"\n[api]\nadapter = \"local\"\n\n[[api.tokens]]\nname = \"tenant\"\nfile = \"tenant.token\"\noperations = [\"admin\"]\nqueues = [\"tenant-a.*\"]\n";
    let server = OjsServer::start_in(dir, Some(config)).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // No token: nothing but UNAUTHENTICATED, health included.
    let mut anonymous = crate::ojs_grpc::client(server.addr).await;
    let status = anonymous
        .manifest(pb::ManifestRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let status = anonymous.health(pb::HealthRequest {}).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let refused = reflection
        .server_reflection_info(tokio_stream::iter(vec![ask]))
        .await;
    assert_eq!(refused.unwrap_err().code(), Code::Unauthenticated);

    // A scoped token: the manifest, but health is the [http] token's.
    let mut tenant = crate::ojs_grpc::with_token(channel.clone(), "bearer tenant-secret");
    assert!(tenant.manifest(pb::ManifestRequest {}).await.is_ok());
    let status = tenant.health(pb::HealthRequest {}).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let mut operator = crate::ojs_grpc::with_token(channel.clone(), "Bearer http-secret");
    let h = operator
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    let details = Value::Object(ojs_api::grpc::convert::struct_to_json(h.details.unwrap()));
    assert_eq!(details["backend"]["name"], "local", "{details}");

    // Outside the tenant's queues a job does not exist.
    let job = operator
        .enqueue(crate::ojs_grpc::enqueue("t.g", json!([1]), "payroll"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    for id in [job.id.clone(), ojs_core::envelope::new_job_id()] {
        let status = tenant
            .get_job(pb::GetJobRequest { job_id: id.clone() })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        assert!(!status.message().contains("payroll"));
        let status = tenant
            .cancel_job(pb::CancelJobRequest {
                job_id: id,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
    }

    // A heartbeat cannot hold a job for 10^12 s.
    let (code, _, status) = crate::ojs_grpc::refused(
        operator
            .heartbeat(pb::HeartbeatRequest {
                id: String::new(),
                worker_id: "w".into(),
                extend_by: Some(prost_types::Duration {
                    seconds: 1_000_000_000_000,
                    nanos: 0,
                }),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(code, Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("43200000"), "{status:?}");
    server.stop();
}

/// Finding 9: the event log is read from a cursor and each read looks at a
/// bounded part of it, so readers of 100,000 events with a filter that
/// matches nothing neither scan the whole log nor hold up INFO (its
/// latencies are printed without and with 8 such readers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_the_event_log_is_read_by_cursor_in_bounded_steps() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    for chunk in 0..100 {
        let jobs: Vec<Value> = (0..1000)
            .map(|i| json!({"type": "t.e", "args": [chunk, i], "options": {"queue": "events"}}))
            .collect();
        let a = post_json(addr, "/ojs/v1/jobs/batch", &json!({ "jobs": jobs })).await;
        assert_eq!(a.status, 201);
    }
    let probe = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "t.e", "args": [], "options": {"queue": "probe"}}),
    )
    .await;
    let id = probe.json()["job"]["id"].as_str().unwrap().to_owned();

    // A filter that matches nothing: each read looks at a bounded part and
    // hands back a cursor past it; the reader walks the log in steps.
    let mut cursor = String::from("0");
    let mut steps = 0;
    loop {
        let a = get(
            addr,
            &format!("/ojs/v1/events?types=job.nothing&after={cursor}"),
        )
        .await;
        assert_eq!(a.status, 200);
        let page = a.json();
        assert!(page["events"].as_array().unwrap().is_empty());
        steps += 1;
        if page["has_more"] != json!(true) {
            break;
        }
        let next = page["cursor"].as_str().unwrap().to_owned();
        assert!(next.parse::<i64>().unwrap() > cursor.parse::<i64>().unwrap());
        cursor = next;
        assert!(steps < 100, "the cursor does not move on");
    }
    assert!(
        steps >= 20,
        "100,000 events in steps of at most 5,000: {steps}"
    );

    let info_p99 = |n: usize| {
        let id = id.clone();
        async move {
            let mut took = Vec::with_capacity(n);
            for _ in 0..n {
                let started = Instant::now();
                let a = get(addr, &format!("/ojs/v1/jobs/{id}")).await;
                assert_eq!(a.status, 200);
                took.push(started.elapsed());
            }
            took.sort();
            took[n * 99 / 100]
        }
    };
    let alone = info_p99(200).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..8 {
        let stop = stop.clone();
        readers.push(tokio::spawn(async move {
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let a = get(addr, "/ojs/v1/events?types=job.nothing").await;
                assert_eq!(a.status, 200);
                reads += 1;
            }
            reads
        }));
    }
    let loaded = info_p99(200).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap();
    }
    println!(
        "INFO p99 with 100,001 events: {alone:?} alone, {loaded:?} beside 8 event readers ({reads} reads of a filter matching nothing)"
    );
    server.stop();
}
