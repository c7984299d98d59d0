//! The OJS API's worker side through a real daemon: HTTP workers share a
//! queue without a job handed to two of them, and a `kill -9` of the
//! daemon holding active jobs loses none — the broker gives them back and
//! they are fetched again. Each prints sent / completed / duplicated /
//! lost (lost 0).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_queue::QueueAdapter;
use serde_json::{json, Value};

use crate::ojs_server::{post_json, push_all, tally, work_across, OjsServer};

async fn fetch(server: &OjsServer, queue: &str, count: usize, worker: &str) -> Vec<Value> {
    let a = post_json(
        server.addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "count": count, "worker_id": worker, "wait_ms": 500}),
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()["jobs"].as_array().cloned().unwrap_or_default()
}

/// The ids of `n` jobs fetched by `worker` (active now), within 30 s.
async fn fetch_ids(
    server: &OjsServer,
    queue: &str,
    n: usize,
    worker: &str,
    what: &str,
) -> Vec<String> {
    let mut jobs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while jobs.len() < n && Instant::now() < deadline {
        jobs.extend(fetch(server, queue, n - jobs.len(), worker).await);
    }
    assert_eq!(jobs.len(), n, "{what}: {n} jobs active");
    jobs.iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn workers_share_a_queue(config: Option<String>, what: &str) {
    let server = OjsServer::start(config.as_deref()).await;
    let queue = "work";
    let sent = push_all(server.addr, queue, 300, json!({})).await;
    let completed = work_across(&[server.addr], queue, 4, sent.len()).await;
    let (duplicated, lost) = tally(what, &sent, &completed);
    assert_eq!(lost, 0, "{what}: jobs never completed");
    // One worker per job while it is held: a second ACK would be 409.
    assert_eq!(duplicated, 0, "{what}: a job was completed twice");
    // Every job reads back completed, with its result.
    for id in sent.iter().step_by(37) {
        let a = crate::ojs_server::get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
        assert_eq!(a.json()["job"]["state"], "completed", "{:?}", a.body);
        assert!(a.json()["job"]["result"]["by"].is_string());
    }
    server.stop();
}

/// A clean stop copies the job store's log into its file: the process
/// exits with the store's connections open, so SQLite's own checkpoint on
/// the last close never ran, and every job lived in `jobs.sqlite-wal`
/// beside a database file that held none (a copy of the file alone, a
/// backup that skips the log, had no jobs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_every_job_in_the_store_file_itself() {
    let server = OjsServer::start(None).await;
    let queue = "work";
    let sent = push_all(server.addr, queue, 120, json!({})).await;
    let mut completed = Vec::new();
    while completed.len() < 30 {
        let jobs = fetch(&server, queue, 30 - completed.len(), "w1").await;
        assert!(!jobs.is_empty(), "the queue holds 120 jobs");
        for job in jobs {
            let id = job["id"].as_str().unwrap().to_owned();
            let a = post_json(
                server.addr,
                "/ojs/v1/workers/ack",
                &json!({"job_id": id, "worker_id": "w1", "result": {"ok": true}}),
            )
            .await;
            assert_eq!(a.status, 200, "{:?}", a.body);
            completed.push(id);
        }
    }
    assert_eq!(completed.len(), 30);
    let dir = server.stop();
    let data = dir.path().join("ojs-bridge-data");
    let log = data.join("jobs.sqlite-wal");
    let log_size = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    assert_eq!(log_size, 0, "the store's log after a clean stop");
    // The database file alone: its log and shared memory gone.
    for file in ["jobs.sqlite-wal", "jobs.sqlite-shm"] {
        match std::fs::remove_file(data.join(file)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("{file}: {e}"),
        }
    }
    let server = OjsServer::start_in(dir, None).await;
    let mut states = std::collections::BTreeMap::<String, usize>::new();
    for id in &sent {
        let a = crate::ojs_server::get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
        assert_eq!(a.status, 200, "job {id} after the restart: {:?}", a.body);
        *states
            .entry(a.json()["job"]["state"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;
    }
    println!("after a clean stop, the file alone: {states:?}");
    assert_eq!(states.get("completed"), Some(&30), "{states:?}");
    assert_eq!(states.get("available"), Some(&90), "{states:?}");
    for id in &completed {
        let a = crate::ojs_server::get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
        assert_eq!(
            a.json()["job"]["result"],
            json!({"ok": true}),
            "{:?}",
            a.body
        );
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_http_workers_share_a_queue_on_the_embedded_default() {
    workers_share_a_queue(None, "4 workers on the embedded broker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_http_workers_share_a_queue_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("work");
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    workers_share_a_queue(Some(config), "4 workers on RabbitMQ").await;
}

/// Active jobs held by a daemon that is killed come back: fetched again
/// after the restart (attempt 2), completed once, none lost.
async fn kill_9_with_active_jobs(config: Option<String>, what: &str) {
    let server = OjsServer::start(config.as_deref()).await;
    let queue = "held";
    let sent = push_all(server.addr, queue, 100, json!({})).await;
    let held: HashSet<String> = fetch_ids(&server, queue, 60, "doomed", what)
        .await
        .into_iter()
        .collect();
    let dir = server.kill();
    let server = OjsServer::start_in(dir, config.as_deref()).await;
    let completed = work_across(&[server.addr], queue, 2, sent.len()).await;
    let (duplicated, lost) = tally(what, &sent, &completed);
    assert_eq!(lost, 0, "{what}: jobs lost");
    assert_eq!(duplicated, 0, "{what}: jobs completed twice");
    // The held ones ran a second time.
    let id = held.iter().next().unwrap();
    let a = crate::ojs_server::get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
    assert_eq!(a.json()["job"]["state"], "completed");
    assert_eq!(a.json()["job"]["attempt"], 2, "{:?}", a.body);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_active_jobs_loses_none_on_the_embedded_default() {
    // The embedded broker gives a dead process's deliveries back after
    // [api] visibility_timeout: short here so it happens within the test.
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\nvisibility_timeout = \"3s\"\n".to_owned();
    kill_9_with_active_jobs(Some(config), "kill -9 holding 60 active jobs, embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_active_jobs_loses_none_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("held");
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    kill_9_with_active_jobs(Some(config), "kill -9 holding 60 active jobs, RabbitMQ").await;
}

/// ACKs answered while their broker acks still wait in the daemon's queue
/// (`[api] ack_linger`, here its longest, 1 s) when it is killed: the
/// store said completed before each answer, so the broker's copies that
/// come back after the restart are settled and handed to no worker. None
/// completed twice, none lost, each acked job still attempt 1 with its
/// result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_broker_acks_lingering_completes_none_twice() {
    let what = "kill -9 with 40 broker acks lingering, embedded";
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\nvisibility_timeout = \"3s\"\nack_linger = \"1s\"\n".to_owned();
    let server = OjsServer::start(Some(&config)).await;
    let queue = "lingering";
    let sent = push_all(server.addr, queue, 100, json!({})).await;
    let held = fetch_ids(&server, queue, 60, "w1", what).await;
    let acked: HashSet<String> = held[..40].iter().cloned().collect();
    // All 40 at once, so that they are answered well inside the linger.
    let addr = server.addr;
    let answers = futures::future::join_all(acked.iter().map(|id| async move {
        let body = json!({"job_id": id, "worker_id": "w1", "result": {"first": true}});
        post_json(addr, "/ojs/v1/workers/ack", &body).await
    }))
    .await;
    for a in &answers {
        assert_eq!(a.status, 200, "{:?}", a.body);
    }
    let dir = server.kill();
    // What the broker still held at the kill, once the dead process's
    // leases ran out (3 s): the 40 never fetched, the 20 fetched and not
    // acked, and the acked ones whose broker acks were still waiting.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let data = dir.path().join("ojs-bridge-data");
    let broker = LocalAdapter::open(LocalConfig::new(&data)).await.unwrap();
    let on_the_broker = broker.depth(queue).await.unwrap().unwrap_or(0);
    broker.close().await.unwrap();
    println!("{what}: {on_the_broker} of 100 messages on the broker after the kill (60 unless acks were waiting)");
    assert!(
        on_the_broker > 60,
        "{what}: no broker ack was waiting at the kill, so this test did not test it"
    );
    let server = OjsServer::start_in(dir, Some(&config)).await;
    let completed = work_across(&[server.addr], queue, 2, sent.len() - acked.len()).await;
    let mut all = completed.clone();
    all.extend(acked.iter().cloned());
    let (duplicated, lost) = tally(what, &sent, &all);
    assert_eq!(lost, 0, "{what}: jobs lost");
    assert_eq!(duplicated, 0, "{what}: jobs completed twice");
    // Past the visibility timeout nothing more comes: every broker copy of
    // an acked job was settled, not left to come back.
    let late = fetch(&server, queue, 10, "late").await;
    assert!(
        late.is_empty(),
        "{what}: fetched after all were done: {late:?}"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let late = fetch(&server, queue, 10, "late").await;
    assert!(
        late.is_empty(),
        "{what}: fetched after the visibility timeout: {late:?}"
    );
    for id in &acked {
        let job = info(&server, id).await;
        assert_eq!(job["state"], "completed", "{job}");
        assert_eq!(job["attempt"], 1, "{job}");
        assert_eq!(job["result"], json!({"first": true}), "{job}");
    }
    server.stop();
}

pub(crate) fn rabbit_config(rabbit_url: &str, prefix: &str) -> String {
    format!(
        "[adapters.rabbit]\nurl = \"{rabbit_url}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\n"
    )
}

async fn info(server: &OjsServer, id: &str) -> Value {
    let a = crate::ojs_server::get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()["job"].clone()
}

async fn activate(server: &OjsServer, id: &str) -> crate::ojs_server::Answer {
    post_json(
        server.addr,
        &format!("/ojs/v1/jobs/{id}/activate"),
        &json!({}),
    )
    .await
}

/// Pending jobs are kept in the store, never on the broker, until
/// ACTIVATE publishes them; ACTIVATE of anything not pending is 409 with
/// the state it is in.
async fn pending_jobs_wait_for_activate(config: Option<String>, what: &str) {
    let server = OjsServer::start(config.as_deref()).await;
    let queue = "gated";
    let pending = push_all(server.addr, queue, 5, json!({"pending": true})).await;
    for id in &pending {
        assert_eq!(info(&server, id).await["state"], "pending", "{what}");
    }
    assert!(
        fetch(&server, queue, 10, "eager").await.is_empty(),
        "{what}: a pending job was handed to a worker"
    );
    for id in &pending[..3] {
        let a = activate(&server, id).await;
        assert_eq!(a.status, 200, "{what}: {:?}", a.body);
        let job = &a.json()["job"];
        assert_eq!(job["id"], json!(id));
        assert_eq!(job["state"], "available");
        assert_eq!(job["previous_state"], "pending");
        assert!(job["activated_at"].is_string(), "{what}: {job}");
    }
    // Twice: the job is no longer pending.
    let again = activate(&server, &pending[0]).await;
    assert_eq!(again.status, 409, "{what}: {:?}", again.body);
    assert_eq!(
        again.json()["error"]["details"]["current_state"],
        "available"
    );
    // Cancelled before it was activated: stays cancelled.
    let cancel = crate::ojs_server::request(
        server.addr,
        "DELETE",
        &format!("/ojs/v1/jobs/{}", pending[3]),
        &[],
        None,
    )
    .await;
    assert_eq!(cancel.status, 200, "{:?}", cancel.body);
    let late = activate(&server, &pending[3]).await;
    assert_eq!(late.status, 409, "{what}: {:?}", late.body);
    assert_eq!(
        late.json()["error"]["details"]["current_state"],
        "cancelled"
    );
    let unknown = activate(&server, "01890000-0000-7000-8000-000000000000").await;
    assert_eq!(unknown.status, 404, "{:?}", unknown.body);
    let wrong_method = crate::ojs_server::get(
        server.addr,
        &format!("/ojs/v1/jobs/{}/activate", pending[4]),
    )
    .await;
    assert_eq!(wrong_method.status, 405);

    // Exactly the three activated ones reach a worker.
    let mut fetched = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while fetched.len() < 3 && Instant::now() < deadline {
        for job in fetch(&server, queue, 10, "eager").await {
            fetched.insert(job["id"].as_str().unwrap().to_owned());
        }
    }
    let activated: HashSet<String> = pending[..3].iter().cloned().collect();
    assert_eq!(
        fetched, activated,
        "{what}: the activated jobs, and only those"
    );
    assert!(fetch(&server, queue, 10, "eager").await.is_empty());
    assert_eq!(info(&server, &pending[4]).await["state"], "pending");
    println!("{what}: 5 pending, 3 activated and fetched, 1 cancelled, 1 still pending");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_jobs_wait_for_activate_on_the_embedded_default() {
    pending_jobs_wait_for_activate(None, "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_jobs_wait_for_activate_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let config = rabbit_config(&rabbit.url, &unique_queue("gated"));
    pending_jobs_wait_for_activate(Some(config), "RabbitMQ").await;
}

/// A job that runs past its `timeout_ms` fails as a failure of type
/// `timeout` would: retried by its policy (the worker's late ACK is a
/// conflict), dead-lettered when exhausted; a job that names no timeout
/// stays its worker's.
async fn execution_timeouts_fail_jobs(config: Option<String>, what: &str) {
    let server = OjsServer::start(config.as_deref()).await;
    let queue = "slow";
    let retried = push_all(
        server.addr,
        queue,
        1,
        json!({"timeout_ms": 1000, "retry": {"max_attempts": 2, "initial_interval": "PT1S", "jitter": false}}),
    )
    .await
    .remove(0);
    let exhausted = push_all(
        server.addr,
        queue,
        1,
        json!({"timeout_ms": 1000, "retry": {"max_attempts": 1, "on_exhaustion": "dead_letter"}}),
    )
    .await
    .remove(0);
    let untimed = push_all(server.addr, queue, 1, json!({})).await.remove(0);
    let mut fetched = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while fetched.len() < 3 && Instant::now() < deadline {
        for job in fetch(&server, queue, 3, "sluggish").await {
            fetched.insert(job["id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(fetched.len(), 3, "{what}: all three active");
    // Well past the timeout, well within the visibility (30 s).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let job = info(&server, &retried).await;
    assert!(
        job["state"] == "retryable" || job["state"] == "available",
        "{what}: {job}"
    );
    assert_eq!(job["error"]["type"], "timeout", "{what}: {job}");
    assert_eq!(job["errors"][0]["code"], "timeout", "{what}: {job}");
    let late = post_json(
        server.addr,
        "/ojs/v1/workers/ack",
        &json!({"job_id": retried, "worker_id": "sluggish"}),
    )
    .await;
    assert_eq!(late.status, 409, "{what}: a late ACK {:?}", late.body);
    let job = info(&server, &exhausted).await;
    assert_eq!(job["state"], "discarded", "{what}: {job}");
    assert_eq!(job["error"]["type"], "timeout");
    assert_eq!(info(&server, &untimed).await["state"], "active", "{what}");
    // The dead letter is there, with the error.
    let dead =
        crate::ojs_server::get(server.addr, &format!("/ojs/v1/dead-letter?queue={queue}")).await;
    assert_eq!(dead.status, 200, "{:?}", dead.body);
    let ids: Vec<Value> = dead.json()["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!(exhausted)], "{what}: dead letters");
    // The retry comes back as attempt 2 and completes.
    let mut again = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while again.is_none() && Instant::now() < deadline {
        again = fetch(&server, queue, 1, "prompt").await.into_iter().next();
    }
    let again = again.unwrap_or_else(|| panic!("{what}: the timed-out job came back"));
    assert_eq!(again["id"], json!(retried));
    assert_eq!(again["attempt"], 2);
    let ack = post_json(
        server.addr,
        "/ojs/v1/workers/ack",
        &json!({"job_id": retried, "worker_id": "prompt"}),
    )
    .await;
    assert_eq!(ack.status, 200, "{:?}", ack.body);
    println!("{what}: one timed out and retried, one timed out and dead-lettered, one without a timeout still active");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execution_timeouts_fail_jobs_on_the_embedded_default() {
    execution_timeouts_fail_jobs(None, "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execution_timeouts_fail_jobs_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let config = rabbit_config(&rabbit.url, &unique_queue("slow"));
    execution_timeouts_fail_jobs(Some(config), "RabbitMQ").await;
}

async fn beat(addr: std::net::SocketAddr, worker: &str, active: &[&str]) -> Value {
    let a = post_json(
        addr,
        "/ojs/v1/workers/heartbeat",
        &json!({"worker_id": worker, "active_jobs": active, "hostname": format!("{worker}.example"),
                "version": "sdk-1.2"}),
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()
}

async fn fetch_at(
    addr: std::net::SocketAddr,
    queue: &str,
    count: usize,
    worker: &str,
) -> Vec<Value> {
    let a = post_json(
        addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "count": count, "worker_id": worker, "wait_ms": 500}),
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()["jobs"].as_array().cloned().unwrap_or_default()
}

/// An operator tells a worker to be quiet, then to terminate, through `b`;
/// the worker hears it on its heartbeats through `a`, FETCH hands it
/// nothing through either, it still finishes the job it holds, other
/// workers go on; `terminate` is final. `a` and `b` may be one server.
pub(crate) async fn operators_direct_workers(
    a: std::net::SocketAddr,
    b: std::net::SocketAddr,
    what: &str,
) {
    let queue = "directed";
    let sent = push_all(a, queue, 4, json!({})).await;
    assert_eq!(beat(a, "w1", &[]).await["state"], "running", "{what}");
    assert_eq!(beat(b, "w2", &[]).await["state"], "running", "{what}");
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while held.is_empty() && Instant::now() < deadline {
        held = fetch_at(a, queue, 1, "w1").await;
    }
    let job = held[0]["id"].as_str().unwrap().to_owned();

    let roster = crate::ojs_server::get(b, "/ojs/v1/admin/workers").await;
    assert_eq!(roster.status, 200, "{:?}", roster.body);
    let roster = roster.json();
    assert_eq!(roster["summary"]["total"], 2, "{what}: {roster}");
    assert_eq!(roster["summary"]["running"], 2);
    let w1 = &roster["items"][0];
    assert_eq!(w1["id"], "w1");
    assert_eq!(w1["state"], "running");
    assert_eq!(w1["hostname"], "w1.example");
    assert_eq!(w1["version"], "sdk-1.2");
    assert_eq!(w1["stale"], false);
    let page = crate::ojs_server::get(b, "/ojs/v1/admin/workers?page=2&per_page=1").await;
    assert_eq!(page.json()["items"][0]["id"], "w2", "{:?}", page.body);
    assert_eq!(page.json()["pagination"]["total"], 2);
    let bad = crate::ojs_server::get(b, "/ojs/v1/admin/workers?per_page=0").await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);

    // Quiet: told on the next heartbeat (through the other replica), no
    // more jobs, the held one still finishes.
    let quiet = post_json(b, "/ojs/v1/admin/workers/w1/quiet", &json!({})).await;
    assert_eq!(quiet.status, 200, "{:?}", quiet.body);
    assert_eq!(quiet.json()["worker"]["state"], "quiet");
    let answer = beat(a, "w1", &[&job]).await;
    assert_eq!(answer["state"], "quiet", "{what}: {answer}");
    assert_eq!(answer["jobs_extended"], json!([job]));
    assert!(
        fetch_at(a, queue, 4, "w1").await.is_empty(),
        "{what}: a quiet worker got a job"
    );
    assert!(
        fetch_at(b, queue, 4, "w1").await.is_empty(),
        "{what}: a quiet worker got a job"
    );
    let ack = post_json(
        a,
        "/ojs/v1/workers/ack",
        &json!({"job_id": job, "worker_id": "w1"}),
    )
    .await;
    assert_eq!(ack.status, 200, "{what}: {:?}", ack.body);
    // Everyone else goes on.
    let mut rest = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while rest.len() < 3 && Instant::now() < deadline {
        for j in fetch_at(b, queue, 3, "w2").await {
            rest.insert(j["id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(rest.len(), 3, "{what}: w2 took the other jobs");
    for id in &rest {
        let ack = post_json(b, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
        assert_eq!(ack.status, 200, "{:?}", ack.body);
    }
    let done: HashSet<String> = rest.into_iter().chain([job]).collect();
    assert_eq!(done, sent.into_iter().collect::<HashSet<_>>(), "{what}");

    // Terminate is final.
    let terminate = post_json(b, "/ojs/v1/admin/workers/w1/terminate", &json!({})).await;
    assert_eq!(terminate.status, 200, "{:?}", terminate.body);
    let back = post_json(b, "/ojs/v1/admin/workers/w1/quiet", &json!({})).await;
    assert_eq!(back.status, 409, "{what}: {:?}", back.body);
    assert_eq!(
        back.json()["error"]["details"]["current_state"],
        "terminate"
    );
    assert_eq!(beat(a, "w1", &[]).await["state"], "terminate", "{what}");
    assert_eq!(beat(a, "w2", &[]).await["state"], "running", "{what}");
    let w1 = crate::ojs_server::get(a, "/ojs/v1/admin/workers/w1").await;
    assert_eq!(w1.json()["worker"]["state"], "terminate", "{:?}", w1.body);
    // A worker heard from just now is not removed; unknown ones are 404.
    let remove =
        crate::ojs_server::request(a, "DELETE", "/ojs/v1/admin/workers/w1", &[], None).await;
    assert_eq!(remove.status, 409, "{what}: {:?}", remove.body);
    let unknown = crate::ojs_server::get(a, "/ojs/v1/admin/workers/nobody").await;
    assert_eq!(unknown.status, 404);
    let no_route = post_json(a, "/ojs/v1/admin/workers/w1/pause", &json!({})).await;
    assert_eq!(no_route.status, 404);
    let wrong = crate::ojs_server::get(a, "/ojs/v1/admin/workers/w1/quiet").await;
    assert_eq!(wrong.status, 405);
    println!("{what}: w1 quiet then terminated through the other server, finished its job; w2 took the other 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_direct_workers_on_the_embedded_default() {
    let server = OjsServer::start(None).await;
    operators_direct_workers(server.addr, server.addr, "embedded").await;
    // The directives outlive a restart.
    let dir = server.stop();
    let server = OjsServer::start_in(dir, None).await;
    assert!(fetch_at(server.addr, "directed", 1, "w1").await.is_empty());
    assert_eq!(beat(server.addr, "w1", &[]).await["state"], "terminate");
    server.stop();
}

/// A daemon told to stop lets its workers finish: FETCH hands out nothing,
/// the jobs it handed out are still acknowledged and failed through it, and
/// it exits once they are settled; after the restart nothing settled is
/// handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_workers_settle_the_jobs_they_hold() {
    let server = OjsServer::start(None).await;
    let queue = "draining";
    let sent = push_all(server.addr, queue, 3, json!({})).await;
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while held.len() < 3 && Instant::now() < deadline {
        held.extend(fetch(&server, queue, 3 - held.len(), "finisher").await);
    }
    assert_eq!(held.len(), 3);
    let ids: Vec<String> = held
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let more = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "work.item", "args": [9], "options": {"queue": queue}}),
    )
    .await;
    assert_eq!(
        more.status, 201,
        "PUSH still works while draining: {:?}",
        more.body
    );
    let late = more.json()["job"]["id"].as_str().unwrap().to_owned();
    assert!(
        fetch(&server, queue, 5, "newcomer").await.is_empty(),
        "a draining daemon handed out a job"
    );
    for id in &ids[..2] {
        let ack = post_json(server.addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
        assert_eq!(ack.status, 200, "{:?}", ack.body);
    }
    let nack = post_json(
        server.addr,
        "/ojs/v1/workers/nack",
        &json!({"job_id": ids[2], "error": {"code": "flaky", "message": "try again"}}),
    )
    .await;
    assert_eq!(nack.status, 200, "{:?}", nack.body);
    let dir = server.wait_exit(Duration::from_secs(20));
    let server = OjsServer::start_in(dir, None).await;
    for id in &ids[..2] {
        assert_eq!(info(&server, id).await["state"], "completed");
    }
    // The failed one comes back (attempt 2), with the one pushed while
    // draining; the completed ones never do.
    let mut again = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while again.len() < 2 && Instant::now() < deadline {
        for job in fetch(&server, queue, 5, "after").await {
            again.insert(job["id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(again, HashSet::from([ids[2].clone(), late]));
    assert_eq!(info(&server, &ids[2]).await["attempt"], 2);
    assert!(sent.iter().all(|id| ids.contains(id)));
    println!("shutdown with 3 jobs held: 2 acked and 1 failed through the draining daemon, none handed out twice");
    server.stop();
}

/// Workers take jobs off a RabbitMQ queue another team made, through a
/// user that may read and write but configure nothing: jobs their producer
/// put there (pika, JSON envelopes) and jobs pushed through the API (some
/// pending, then ACTIVATEd) are fetched and completed; a failed one is
/// retried after its backoff (with no delay queues to declare, the adapter
/// holds the delivery for the delay — the NACK answers at once anyway) and
/// an exhausted one goes through the queue's own dead-letter exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_take_jobs_off_a_rabbitmq_queue_another_client_made_for_a_user_that_cannot_create_anything(
) {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    ojs_bridge_tests::independent::available().expect("the independent clients");
    let user = unique_queue("api-worker-user");
    const PASSWORD: &str = "Worker-pw-7c1d-secret";
    assert!(
        ojs_bridge_tests::brokers::rabbitmqctl(&["add_user", &user, PASSWORD]),
        "rabbitmqctl add_user"
    );
    // Read and write, configure nothing.
    assert!(ojs_bridge_tests::brokers::rabbitmq_may_not_configure(&user));
    let prefix = unique_queue("team");
    let (theirs, their_dlx, their_dlq) = (
        format!("{prefix}.billing"),
        format!("{prefix}.dlx"),
        format!("{prefix}.billing.dead"),
    );
    ojs_bridge_tests::independent::run(&[
        "rabbit-queue",
        &theirs,
        "--dead-letter-exchange",
        &their_dlx,
        "--dlq",
        &their_dlq,
    ])
    .unwrap();
    // Their producer's jobs: OJS JSON envelopes, ids of their own.
    let base = uuid::Uuid::now_v7().to_string();
    let their_ids: Vec<String> = (0..10).map(|i| format!("{}{i}", &base[..35])).collect();
    ojs_bridge_tests::independent::run(&[
        "rabbit-publish",
        "--routing-key",
        &theirs,
        "--content-type",
        "application/openjobspec+json",
        "--count",
        "10",
        "--body",
        &format!(
            r#"{{"specversion":"1.0","id":"{}{{i}}","type":"invoice.send","queue":"billing","args":[{{i}}],"retry":{{"initial_interval":"PT4S","jitter":false}}}}"#,
            &base[..35]
        ),
    ])
    .unwrap();
    let host = rabbit.url.rsplit('@').next().unwrap();
    let config = format!(
        "[adapters.theirs]\nurl = \"amqp://{user}:{PASSWORD}@{host}\"\ntopology = \"existing\"\nexchange = \"\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"theirs\"\nqueues = [\"billing\"]\nencoding = \"json\"\n# Their jobs name no on_exhaustion; the operator keeps every exhausted one.\non_exhaustion = \"dead_letter\"\n"
    );
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    // Pushed through the API: 5 available, 5 pending then activated.
    let mut ours = Vec::new();
    for i in 0..10 {
        let options = if i < 5 {
            json!({"queue": "billing"})
        } else {
            json!({"queue": "billing", "pending": true})
        };
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": "invoice.send", "args": [100 + i], "options": options}),
        )
        .await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        ours.push(a.json()["job"]["id"].as_str().unwrap().to_owned());
    }
    for id in &ours[5..] {
        let a = post_json(addr, &format!("/ojs/v1/jobs/{id}/activate"), &json!({})).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
    }
    // One of theirs fails once (retried after its policy's 4 s), one fails
    // for good (a non-retryable error).
    let (retried, doomed) = (their_ids[0].clone(), their_ids[1].clone());
    let mut completed = Vec::new();
    let mut nack_answers = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let expected = their_ids.len() + ours.len() - 1;
    while completed.len() < expected && Instant::now() < deadline {
        for job in fetch(&server, "billing", 10, "team-worker").await {
            let id = job["id"].as_str().unwrap().to_owned();
            let first_try = job["attempt"] == 1;
            if (id == retried && first_try) || id == doomed {
                let retryable = id == retried;
                let t = Instant::now();
                let a = post_json(
                    addr,
                    "/ojs/v1/workers/nack",
                    &json!({"job_id": id, "error": {"code": "card_declined", "message": "declined", "retryable": retryable}}),
                )
                .await;
                nack_answers.push(t.elapsed());
                assert_eq!(a.status, 200, "{:?}", a.body);
                continue;
            }
            let a = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
            assert_eq!(a.status, 200, "{:?}", a.body);
            completed.push(id);
        }
    }
    let sent: Vec<String> = their_ids
        .iter()
        .filter(|id| **id != doomed)
        .chain(ours.iter())
        .cloned()
        .collect();
    let (duplicated, lost) = tally(
        "their 10 jobs and our 10 (5 activated) on their RabbitMQ queue",
        &sent,
        &completed,
    );
    assert_eq!((duplicated, lost), (0, 0));
    // The retried one came back after its backoff at attempt 2.
    let info = crate::ojs_server::get(addr, &format!("/ojs/v1/jobs/{retried}")).await;
    assert_eq!(info.json()["job"]["state"], "completed");
    assert_eq!(info.json()["job"]["attempt"], 2, "{:?}", info.body);
    let info = crate::ojs_server::get(addr, &format!("/ojs/v1/jobs/{doomed}")).await;
    assert_eq!(info.json()["job"]["state"], "discarded", "{:?}", info.body);
    // Each NACK answered before the retry was due: the adapter's wait for
    // the delay is not the worker's.
    println!("NACK answers on their queue: {nack_answers:?}");
    assert!(
        nack_answers.iter().all(|d| *d < Duration::from_secs(2)),
        "a NACK waited for the retry's 4 s delay: {nack_answers:?}"
    );
    // Their queue is empty; the exhausted one is in their dead-letter queue.
    let server_log = {
        let log = server.log();
        server.stop();
        log
    };
    assert_eq!(
        ojs_bridge_tests::brokers::rabbitmq_messages(&theirs),
        Some(0)
    );
    assert_eq!(
        ojs_bridge_tests::brokers::rabbitmq_messages(&their_dlq),
        Some(1)
    );
    assert!(
        !server_log.contains(PASSWORD),
        "the password reached the log"
    );
    let _ = ojs_bridge_tests::independent::run(&["rabbit-delete", &theirs, &their_dlq]);
    let _ = ojs_bridge_tests::independent::run(&["rabbit-delete", "--exchange", &their_dlx]);
    let _ = ojs_bridge_tests::brokers::rabbitmqctl(&["delete_user", &user]);
}
