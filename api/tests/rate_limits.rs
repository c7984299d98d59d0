//! Rate limits in process (`http::handle` over the service on the
//! in-memory broker and the embedded store): concurrency, throttle and
//! windows at FETCH, what `on_limit` makes of a job over them, a queue's
//! configured limits, operators' overrides, the keys' endpoints and who may
//! see and steer them, and the events they record. Across replicas on
//! PostgreSQL the store's side is in `job_store.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{server, Server};
use serde_json::{json, Value};

impl Server {
    async fn push_limited(&self, queue: &str, n: usize, rate_limit: Value) -> Vec<String> {
        let mut ids = Vec::new();
        for i in 0..n {
            let (status, body) = self
                .call(
                    "root",
                    "POST",
                    "/ojs/v1/jobs",
                    Some(json!({"type": "api.call", "args": [i],
                        "options": {"queue": queue, "rate_limit": rate_limit}})),
                )
                .await;
            assert_eq!(status, 201, "{body}");
            ids.push(body["job"]["id"].as_str().unwrap().to_owned());
        }
        ids
    }

    async fn fetch(&self, queue: &str, count: usize, wait_ms: u64) -> Vec<String> {
        let mut request = json!({"queues": [queue], "count": count});
        if wait_ms > 0 {
            request["wait_ms"] = json!(wait_ms);
        }
        let (status, body) = self
            .call("root", "POST", "/ojs/v1/workers/fetch", Some(request))
            .await;
        assert_eq!(status, 200, "{body}");
        body["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_owned())
            .collect()
    }

    async fn ack(&self, id: &str) {
        let (status, body) = self
            .call(
                "root",
                "POST",
                "/ojs/v1/workers/ack",
                Some(json!({"job_id": id})),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }

    async fn state(&self, id: &str) -> Value {
        let (status, body) = self
            .call("root", "GET", &format!("/ojs/v1/jobs/{id}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        body["job"].clone()
    }

    async fn events(&self, kind: &str) -> Vec<Value> {
        let (status, body) = self
            .call(
                "root",
                "GET",
                &format!("/ojs/v1/events?types={kind}&limit=1000"),
                None,
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body["events"].as_array().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_holds_a_key_s_running_jobs_and_a_finished_one_frees_a_place() {
    let s = server().await;
    s.push_limited("calls", 5, json!({"key": "tenant:1", "concurrency": 2}))
        .await;
    let first = s.fetch("calls", 5, 500).await;
    assert_eq!(first.len(), 2, "two of five run at once");
    assert!(s.fetch("calls", 5, 300).await.is_empty(), "no third");
    let (status, key) = s
        .call("root", "GET", "/ojs/v1/rate-limits/tenant:1", None)
        .await;
    assert_eq!(status, 200, "{key}");
    assert_eq!(key["key"], "tenant:1");
    assert_eq!(
        key["concurrency"],
        json!({"limit": 2, "active": 2, "available": 0})
    );
    assert_eq!(key["active"], 2);
    assert!(key["waiting"].as_u64().unwrap() >= 1, "{key}");
    assert_eq!(key["waiting"], key["waiting_count"]);
    // One finishes: one more starts, never more than two.
    s.ack(&first[0]).await;
    let next = s.fetch("calls", 5, 1_000).await;
    assert_eq!(next.len(), 1, "{next:?}");
    for id in first.iter().skip(1).chain(&next) {
        s.ack(id).await;
    }
    let mut rest = Vec::new();
    while rest.len() < 2 {
        let got = s.fetch("calls", 5, 1_000).await;
        assert!(!got.is_empty() && got.len() <= 2, "{got:?}");
        for id in &got {
            s.ack(id).await;
        }
        rest.extend(got);
    }
    let (_, key) = s
        .call("root", "GET", "/ojs/v1/rate-limits/tenant:1", None)
        .await;
    assert_eq!(key["active"], 0, "{key}");
    assert_eq!(key["waiting"], 0, "{key}");
    // Told once when it filled, once when it freed.
    assert!(!s.events("rate_limit.exceeded").await.is_empty());
    assert!(!s.events("rate_limit.released").await.is_empty());
    // Concurrency 0 stops a key.
    s.push_limited("stopped", 1, json!({"concurrency": 0}))
        .await;
    assert!(s.fetch("stopped", 1, 300).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttle_spaces_starts_and_a_window_admits_its_limit() {
    let s = server().await;
    s.push_limited(
        "spaced",
        3,
        json!({"throttle": {"limit": 2, "period": "PT1S"}}),
    )
    .await;
    assert_eq!(s.fetch("spaced", 3, 0).await.len(), 1, "one at once");
    // The next is due half a second after the first: a FETCH that waits
    // gets it then.
    assert_eq!(s.fetch("spaced", 3, 3_000).await.len(), 1);
    s.push_limited(
        "windowed",
        4,
        json!({"rate": {"limit": 2, "period": "PT1H"}}),
    )
    .await;
    assert_eq!(s.fetch("windowed", 4, 300).await.len(), 2);
    assert!(s.fetch("windowed", 4, 300).await.is_empty());
    let (_, key) = s
        .call("root", "GET", "/ojs/v1/rate-limits/queue:windowed", None)
        .await;
    assert_eq!(key["rate"]["limit"], 2);
    assert_eq!(key["rate"]["period"], "PT1H");
    assert_eq!(key["rate"]["current_count"], 2);
    assert!(key["rate"]["window_resets_at"].is_string(), "{key}");
    assert_eq!(
        (key["limit"].clone(), key["period"].clone()),
        (json!(2), json!("PT1H"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_limit_a_job_is_rescheduled_or_dropped_as_it_asks() {
    let s = server().await;
    let dropped = s
        .push_limited(
            "dropping",
            2,
            json!({"rate": {"limit": 1, "period": "PT1H"}, "on_limit": "drop"}),
        )
        .await;
    let got = s.fetch("dropping", 2, 500).await;
    assert_eq!(got.len(), 1);
    let other = dropped.iter().find(|id| **id != got[0]).unwrap();
    let job = s.state(other).await;
    assert_eq!(job["state"], "discarded", "{job}");
    let drops = s.events("rate_limit.dropped").await;
    assert_eq!(drops.len(), 1);
    assert_eq!(drops[0]["job_id"], other.as_str());
    assert_eq!(drops[0]["data"]["key"], "queue:dropping");

    let later = s
        .push_limited(
            "later",
            2,
            json!({"key": "later", "rate": {"limit": 1, "period": "PT1H"}, "on_limit": "reschedule"}),
        )
        .await;
    let got = s.fetch("later", 2, 500).await;
    assert_eq!(got.len(), 1);
    let other = later.iter().find(|id| **id != got[0]).unwrap();
    let job = s.state(other).await;
    assert_eq!(job["state"], "scheduled", "{job}");
    let (_, key) = s
        .call("root", "GET", "/ojs/v1/rate-limits/later", None)
        .await;
    assert_eq!(
        job["scheduled_at"], key["rate"]["window_resets_at"],
        "{job} {key}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_s_configuration_limits_every_job_of_it() {
    let s = server().await;
    let (status, body) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/admin/queues/reports/config",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config"]["concurrency"], 1);
    s.push("report.build", "reports", 3).await;
    let first = s.fetch("reports", 3, 300).await;
    assert_eq!(first.len(), 1, "the queue runs one at a time");
    assert!(s.fetch("reports", 3, 300).await.is_empty());
    s.ack(&first[0]).await;
    assert_eq!(s.fetch("reports", 3, 1_000).await.len(), 1);
    // The detail shows it where the admin UI reads it; the UI sends back
    // what it read, retention included.
    let (status, queue) = s
        .call("root", "GET", "/ojs/v1/admin/queues/reports", None)
        .await;
    assert_eq!(status, 200, "{queue}");
    assert_eq!(queue["configuration"]["concurrency"], 1);
    let mut sent = queue["configuration"].clone();
    sent["concurrency"] = json!(null);
    let (status, body) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/admin/queues/reports/config",
            Some(sent),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config"]["concurrency"], Value::Null);
    let (status, body) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/admin/queues/reports/rate-limit",
            Some(json!({"limit": 5, "period": "PT1M"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["rate_limit"], json!({"limit": 5, "period": "PT1M"}));
    // Refusals, named.
    for (body, status, field) in [
        (json!({"concurrency": -1}), 400, Some("config.concurrency")),
        (
            json!({"rate_limit": {"limit": 1}}),
            400,
            Some("rate_limit.period"),
        ),
        (json!({"max_size": 10}), 400, Some("max_size")),
        (json!({"retention": {"completed": "P1D"}}), 422, None),
    ] {
        let (got, answer) = s
            .call(
                "root",
                "PUT",
                "/ojs/v1/admin/queues/reports/config",
                Some(body.clone()),
            )
            .await;
        assert_eq!(got, status, "{body}: {answer}");
        if let Some(field) = field {
            assert_eq!(answer["error"]["details"]["attribute"], field, "{answer}");
        }
    }
    // Admin only, and within a scoped token's queues.
    let (status, _) = s
        .call(
            "reader",
            "PUT",
            "/ojs/v1/admin/queues/reports/config",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 403);
    let (status, _) = s
        .call(
            "team",
            "PUT",
            "/ojs/v1/admin/queues/reports/config",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_replaces_a_key_s_limits_until_it_is_removed() {
    let s = server().await;
    s.push_limited("bulk", 6, json!({"rate": {"limit": 1, "period": "PT1H"}}))
        .await;
    assert_eq!(s.fetch("bulk", 6, 300).await.len(), 1);
    let (status, key) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/rate-limits/queue:bulk",
            Some(json!({"limit": 3, "period": "PT1H"})),
        )
        .await;
    assert_eq!(status, 200, "{key}");
    assert_eq!(key["override"]["limit"], 3);
    assert_eq!(key["limit"], 3);
    assert_eq!(
        s.fetch("bulk", 6, 500).await.len(),
        2,
        "three in the window now"
    );
    let (status, page) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/rate-limits?page=1&per_page=25",
            None,
        )
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["pagination"]["page"], 1);
    assert_eq!(page["pagination"]["total"], 1);
    let item = &page["items"][0];
    for field in ["key", "limit", "period", "active", "waiting"] {
        assert!(!item[field].is_null(), "{field}: {item}");
    }
    let (status, key) = s
        .call(
            "root",
            "DELETE",
            "/ojs/v1/rate-limits/queue:bulk/override",
            None,
        )
        .await;
    assert_eq!(status, 200, "{key}");
    assert!(key["override"].is_null());
    assert!(
        s.fetch("bulk", 6, 300).await.is_empty(),
        "back to one an hour"
    );
    // An override that expires, and refusals.
    let (status, _) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/rate-limits/queue:bulk",
            Some(json!({"concurrency": 5, "expires_at": "2000-01-01T00:00:00Z"})),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/rate-limits/queue:bulk",
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = s
        .call(
            "root",
            "PUT",
            "/ojs/v1/rate-limits/-bad",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 400);
    // Unknown keys are not found; a scoped token sees its queues' keys only.
    let (status, _) = s
        .call("root", "GET", "/ojs/v1/rate-limits/nobody", None)
        .await;
    assert_eq!(status, 404);
    let (status, _) = s
        .call("team", "GET", "/ojs/v1/rate-limits/queue:bulk", None)
        .await;
    assert_eq!(status, 404);
    let (_, page) = s.call("team", "GET", "/ojs/v1/rate-limits", None).await;
    assert_eq!(page["pagination"]["total"], 0, "{page}");
    let (status, _) = s
        .call(
            "team",
            "PUT",
            "/ojs/v1/rate-limits/queue:bulk",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 403);
    let (status, _) = s
        .call(
            "reader",
            "PUT",
            "/ojs/v1/rate-limits/queue:bulk",
            Some(json!({"concurrency": 1})),
        )
        .await;
    assert_eq!(status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_and_resuming_a_queue_are_recorded_once_each() {
    let s = server().await;
    for action in ["pause", "pause", "resume"] {
        let (status, body) = s
            .call(
                "root",
                "POST",
                &format!("/ojs/v1/queues/mail/{action}"),
                None,
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let paused = s.events("queue.paused").await;
    assert_eq!(paused.len(), 1, "a second pause changed nothing");
    assert_eq!(paused[0]["queue"], "mail");
    assert_eq!(paused[0]["subject"], "mail");
    assert_eq!(paused[0]["data"]["paused_by"], "root");
    let resumed = s.events("queue.resumed").await;
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0]["data"]["resumed_by"], "root");
}

/// A job delivered again while the store says it is active (the process
/// that held it died) runs again: its old run holds no place of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_its_dead_process_held_is_not_kept_out_by_its_own_place() {
    use std::sync::Arc;
    use std::time::Duration;

    use ojs_api::worker::Fetch;
    use ojs_api::{Api, ApiSettings};

    let dir = ojs_bridge_tests::tempdir::TempDir::new("rate-redelivered");
    let broker: Arc<dyn ojs_queue::QueueAdapter> = Arc::new(
        ojs_adapter_memory::MemoryAdapter::new(ojs_adapter_memory::MemoryConfig::default()),
    );
    let open = || {
        Api::open(
            ApiSettings {
                state_dir: dir.path().to_path_buf(),
                ..ApiSettings::default()
            },
            broker.clone(),
            "memory",
        )
    };
    let fetch = || Fetch {
        queues: vec!["solo".into()],
        count: 1,
        worker_id: None,
        visibility: None,
        wait: Duration::from_secs(2),
    };
    {
        let first = open().await.unwrap();
        let grant = first.tokens().identify(None).unwrap();
        let job = ojs_api::job::from_json(
            json!({"type": "one.at.a.time", "args": [],
                   "options": {"queue": "solo", "rate_limit": {"concurrency": 1}}}),
            first.now(),
        )
        .unwrap();
        first.push_all(&grant, vec![job]).await.unwrap();
        let held = first.fetch(&grant, fetch()).await.unwrap();
        assert_eq!(held.len(), 1);
        // The process goes without settling anything: its delivery goes
        // back to the broker.
    }
    let second = open().await.unwrap();
    let grant = second.tokens().identify(None).unwrap();
    let mut again = Vec::new();
    for _ in 0..10 {
        again = second.fetch(&grant, fetch()).await.unwrap();
        if !again.is_empty() {
            break;
        }
    }
    assert_eq!(again.len(), 1, "the job runs again");
}
