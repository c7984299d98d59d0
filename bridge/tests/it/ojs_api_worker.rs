//! The OJS API's worker side through a real daemon: HTTP workers share a
//! queue without a job handed to two of them, and a `kill -9` of the
//! daemon holding active jobs loses none — the broker gives them back and
//! they are fetched again. Each prints sent / completed / duplicated /
//! lost (lost 0).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
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
    let mut first = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while first.len() < 60 && Instant::now() < deadline {
        first.extend(fetch(&server, queue, 60 - first.len(), "doomed").await);
    }
    assert_eq!(first.len(), 60, "{what}: 60 jobs active before the kill");
    let held: HashSet<String> = first
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
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
