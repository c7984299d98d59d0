//! The admin endpoints of the HTTP binding, in process (`http::handle` over
//! the service on the in-memory broker and the embedded store): the shapes
//! the admin UI's pages read, the job list's filters and paging, the bulk
//! operations' confirmation rule, and what a scoped token may reach.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{server, server_with};
use ojs_api::worker::Fetch;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_queues_and_jobs_carry_every_field_the_admin_pages_read() {
    let s = server().await;
    s.push("mail.send", "mail", 5).await;
    s.push("report.build", "team.reports", 3).await;
    s.settle("mail", 2, true).await;
    s.settle("mail", 1, false).await;

    let (status, stats) = s.call("root", "GET", "/ojs/v1/admin/stats", None).await;
    assert_eq!(status, 200, "{stats}");
    for state in [
        "available",
        "active",
        "scheduled",
        "retryable",
        "completed",
        "discarded",
    ] {
        assert!(stats["jobs"][state].is_u64(), "jobs.{state}: {stats}");
    }
    assert_eq!(
        (
            stats["jobs"]["available"].as_u64(),
            stats["jobs"]["completed"].as_u64(),
            stats["jobs"]["discarded"].as_u64()
        ),
        (Some(5), Some(2), Some(1)),
        "{stats}"
    );
    assert_eq!(stats["queues"], 2);
    assert!(stats["workers"].is_u64() && stats["uptime_seconds"].is_u64());
    assert_eq!(stats["throughput"]["processed_per_minute"], 2, "{stats}");
    assert_eq!(stats["throughput"]["failed_per_minute"], 1);

    let (status, queues) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/queues?page=1&per_page=50",
            None,
        )
        .await;
    assert_eq!(status, 200, "{queues}");
    let mail = queues["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "mail")
        .unwrap()
        .clone();
    for state in [
        "available",
        "active",
        "scheduled",
        "retryable",
        "completed",
        "discarded",
    ] {
        assert!(mail["counts"][state].is_u64(), "counts.{state}: {mail}");
    }
    assert_eq!(
        (
            mail["counts"]["available"].as_u64(),
            mail["paused"].as_bool()
        ),
        (Some(2), Some(false))
    );
    assert_eq!(queues["pagination"]["total"], 2);
    assert_eq!(queues["pagination"]["page"], 1);

    let (status, paused) = s
        .call("root", "POST", "/ojs/v1/admin/queues/mail/pause", None)
        .await;
    assert_eq!(
        (status, paused["paused"].as_bool()),
        (200, Some(true)),
        "{paused}"
    );
    let (_, detail) = s
        .call("root", "GET", "/ojs/v1/admin/queues/mail", None)
        .await;
    assert_eq!(detail["paused"], true);
    assert!(detail["configuration"].is_object());
    let (status, resumed) = s
        .call("root", "POST", "/ojs/v1/admin/queues/mail/resume", None)
        .await;
    assert_eq!((status, resumed["paused"].as_bool()), (200, Some(false)));

    // The job list: filters, paging, totals.
    let (status, page) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=mail&state=available&page=1&per_page=1",
            None,
        )
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["pagination"]["total"], 2);
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    let item = &page["items"][0];
    for key in [
        "id",
        "type",
        "queue",
        "state",
        "attempt",
        "created_at",
        "priority",
    ] {
        assert!(!item[key].is_null(), "{key}: {item}");
    }
    let (_, by_type) = s
        .call("root", "GET", "/ojs/v1/admin/jobs?type=report.%2A", None)
        .await;
    assert_eq!(
        by_type["pagination"]["total"], 3,
        "a type prefix: {by_type}"
    );
    let (_, by_queue) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=team.*&order=asc",
            None,
        )
        .await;
    assert_eq!(by_queue["pagination"]["total"], 3);
    let (status, bad) = s
        .call("root", "GET", "/ojs/v1/admin/jobs?state=sleeping", None)
        .await;
    assert_eq!(
        (status, bad["error"]["details"]["attribute"].as_str()),
        (400, Some("state"))
    );

    // A job's detail: unwrapped, with errors and metadata.
    let id = item["id"].as_str().unwrap();
    let (status, job) = s
        .call("root", "GET", &format!("/ojs/v1/admin/jobs/{id}"), None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(job["id"], id);
    assert!(
        job["meta"].is_object()
            && job["errors"].is_array()
            && job["metadata"]["created_at"].is_string(),
        "{job}"
    );

    // The history: every bucket of the last hour, what was created,
    // completed and discarded in it.
    let (status, history) = s
        .call("root", "GET", "/ojs/v1/admin/stats/history?period=5m", None)
        .await;
    assert_eq!(status, 200, "{history}");
    let data = history["data"].as_array().unwrap();
    assert!((12..=13).contains(&data.len()), "{} points", data.len());
    let sum = |k: &str| data.iter().map(|p| p[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!(
        (sum("enqueued"), sum("processed"), sum("failed")),
        (8, 2, 1),
        "{history}"
    );
    assert!(data.iter().all(|p| p["timestamp"].is_string()));
    let (_, of_queue) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/stats/history?period=1m&queue=team.reports",
            None,
        )
        .await;
    let data = of_queue["data"].as_array().unwrap();
    assert_eq!(
        data.iter()
            .map(|p| p["enqueued"].as_u64().unwrap())
            .sum::<u64>(),
        3
    );
    let (status, _) = s
        .call("root", "GET", "/ojs/v1/admin/stats/history?period=7m", None)
        .await;
    assert_eq!(status, 400);
    let (status, _) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/stats/history?period=1m&since=2026-01-01T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(status, 400, "more points than a history answers");
    let (status, _) = s
        .call("team", "GET", "/ojs/v1/admin/stats/history", None)
        .await;
    assert_eq!(status, 403, "a scoped token names a queue of its own");

    // Reading needs admin.
    let (status, _) = s.call("reader", "GET", "/ojs/v1/admin/stats", None).await;
    assert_eq!(status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_operations_need_confirmation_and_stay_inside_the_token_s_queues() {
    let s = server().await;
    let mail = s.push("mail.send", "mail", 4).await;
    s.push("report.build", "team.reports", 3).await;
    s.settle("team.reports", 1, false).await;

    // Without confirm: 400, nothing touched.
    let (status, body) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/jobs/bulk/cancel",
            Some(json!({"filter": {"queue": "mail"}, "confirm": false})),
        )
        .await;
    assert_eq!(
        (status, body["error"]["details"]["attribute"].as_str()),
        (400, Some("confirm")),
        "{body}"
    );
    let (_, still) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=mail&state=available",
            None,
        )
        .await;
    assert_eq!(still["pagination"]["total"], 4);

    // A scoped token names a queue of its own; anything else touches nothing.
    for filter in [
        json!({}),
        json!({"queue": "mail"}),
        json!({"queue": "team.*"}),
    ] {
        let (status, body) = s
            .call(
                "team",
                "POST",
                "/ojs/v1/admin/jobs/bulk/cancel",
                Some(json!({"filter": filter, "confirm": true})),
            )
            .await;
        assert_eq!(status, 403, "{filter}: {body}");
    }
    let (_, still) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=mail&state=available",
            None,
        )
        .await;
    assert_eq!(
        still["pagination"]["total"], 4,
        "nothing outside the scope was cancelled"
    );
    let (status, list) = s.call("team", "GET", "/ojs/v1/admin/jobs", None).await;
    assert_eq!(status, 403, "{list}");
    let (_, stats) = s.call("team", "GET", "/ojs/v1/admin/queues", None).await;
    let names: Vec<&str> = stats["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["team.reports"],
        "a scoped token sees its queues only"
    );

    // Confirmed: the scoped token cancels its queue's unfinished jobs.
    let (status, done) = s
        .call(
            "team",
            "POST",
            "/ojs/v1/admin/jobs/bulk/cancel",
            Some(
                json!({"filter": {"queue": "team.reports", "state": "available"}, "confirm": true}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(
        (
            done["action"].as_str(),
            done["matched"].as_u64(),
            done["succeeded"].as_u64(),
            done["failed"].as_u64()
        ),
        (Some("cancel"), Some(2), Some(2), Some(0))
    );

    // Delete takes finished jobs only: of mail, none is finished.
    let (_, deleted) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/jobs/bulk/delete",
            Some(json!({"filter": {"queue": "mail"}, "confirm": true})),
        )
        .await;
    assert_eq!(
        (
            deleted["matched"].as_u64(),
            deleted["succeeded"].as_u64(),
            deleted["failed"].as_u64()
        ),
        (Some(4), Some(0), Some(4)),
        "{deleted}"
    );
    let (status, _) = s
        .call("root", "GET", &format!("/ojs/v1/jobs/{}", mail[0]), None)
        .await;
    assert_eq!(status, 200, "an unfinished job is not deleted");
    let (_, deleted) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/jobs/bulk/delete",
            Some(
                json!({"filter": {"queue": "team.reports", "state": "cancelled"}, "confirm": true}),
            ),
        )
        .await;
    assert_eq!(
        (deleted["matched"].as_u64(), deleted["succeeded"].as_u64()),
        (Some(2), Some(2)),
        "{deleted}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_holds_fetch_and_takes_pushes_until_it_is_switched_off() {
    let s = server().await;
    let (status, state) = s
        .call("root", "GET", "/ojs/v1/admin/system/maintenance", None)
        .await;
    assert_eq!(
        (status, state["enabled"].as_bool()),
        (200, Some(false)),
        "{state}"
    );
    let (status, on) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/system/maintenance",
            Some(json!({"enabled": true, "reason": "broker upgrade", "duration": "15m"})),
        )
        .await;
    assert_eq!(status, 200, "{on}");
    assert_eq!(
        (
            on["enabled"].as_bool(),
            on["maintenance"].as_bool(),
            on["reason"].as_str()
        ),
        (Some(true), Some(true), Some("broker upgrade"))
    );
    assert!(
        on["started_at"].is_string()
            && on["ends_at"].is_string()
            && on["estimated_end"].is_string(),
        "{on}"
    );
    // PUSH lands; FETCH hands out nothing.
    let pushed = s.push("mail.send", "mail", 1).await;
    let grant = s.api.tokens().identify(Some("Bearer secret-root")).unwrap();
    let fetch = || Fetch {
        queues: vec!["mail".into()],
        count: 1,
        worker_id: None,
        visibility: None,
        wait: Duration::from_secs(2),
    };
    let began = std::time::Instant::now();
    assert!(s.api.fetch(&grant, fetch()).await.unwrap().is_empty());
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "answered without waiting out the FETCH"
    );
    // Only a token for every queue switches it.
    let (status, _) = s
        .call(
            "team",
            "POST",
            "/ojs/v1/admin/system/maintenance",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, 403);
    let (status, bad) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/system/maintenance",
            Some(json!({"enabled": true, "duration": "3 weeks"})),
        )
        .await;
    assert_eq!(
        (status, bad["error"]["details"]["attribute"].as_str()),
        (400, Some("duration"))
    );
    let (status, off) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/admin/system/maintenance",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!((status, off["enabled"].as_bool()), (200, Some(false)));
    let got = s.api.fetch(&grant, fetch()).await.unwrap();
    assert_eq!(
        got.iter()
            .map(|j| j.envelope.id.clone())
            .collect::<Vec<_>>(),
        pushed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_empties_the_store_and_its_queues_only_where_it_is_allowed() {
    let s = server().await;
    s.push("mail.send", "mail", 2).await;
    let (status, body) = s.call("root", "POST", "/ojs/v1/admin/reset", None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("permission_denied")),
        "{body}"
    );
    let (_, still) = s.call("root", "GET", "/ojs/v1/admin/stats", None).await;
    assert_eq!(still["jobs"]["available"], 2, "nothing was touched");

    let s = server_with(|settings| settings.allow_reset = true).await;
    s.push("mail.send", "mail", 3).await;
    s.push("report.build", "team.reports", 2).await;
    s.settle("team.reports", 1, true).await;
    let (status, _) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "nightly", "cron": "0 3 * * *",
            "type": "report.build", "queue": "team.reports"})),
        )
        .await;
    assert_eq!(status, 201);
    let (status, _) = s.call("team", "POST", "/ojs/v1/admin/reset", None).await;
    assert_eq!(status, 403, "a scoped token resets nothing");
    let (status, reset) = s.call("root", "POST", "/ojs/v1/admin/reset", None).await;
    assert_eq!(status, 200, "{reset}");
    assert_eq!(reset["drained"], 4, "what was on the broker: {reset}");
    let (_, stats) = s.call("root", "GET", "/ojs/v1/admin/stats", None).await;
    assert_eq!(
        (
            stats["queues"].as_u64(),
            stats["jobs"]["available"].as_u64(),
            stats["jobs"]["completed"].as_u64()
        ),
        (Some(0), Some(0), Some(0)),
        "{stats}"
    );
    let (_, crons) = s.call("root", "GET", "/ojs/v1/cron", None).await;
    assert_eq!(crons["crons"].as_array().map(Vec::len), Some(0));
    // The queues are empty on the broker too, and take new jobs.
    let grant = s.api.tokens().identify(Some("Bearer secret-root")).unwrap();
    let fetch = |queue: &str| Fetch {
        queues: vec![queue.into()],
        count: 10,
        worker_id: None,
        visibility: None,
        wait: Duration::from_millis(300),
    };
    assert!(s.api.fetch(&grant, fetch("mail")).await.unwrap().is_empty());
    let after = s.push("mail.send", "mail", 1).await;
    let got = s.api.fetch(&grant, fetch("mail")).await.unwrap();
    assert_eq!(
        got.iter()
            .map(|j| j.envelope.id.clone())
            .collect::<Vec<_>>(),
        after
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_events_unique_jobs_and_priority_pages_read_what_they_show() {
    let s = server().await;
    s.push("mail.send", "mail", 3).await;
    for (priority, n) in [(5, 2), (-3, 1)] {
        for _ in 0..n {
            let (status, body) = s
                .call(
                    "root",
                    "POST",
                    "/ojs/v1/jobs",
                    Some(json!({"type": "mail.send", "args": [], "options": {"queue": "mail", "priority": priority}})),
                )
                .await;
            assert_eq!(status, 201, "{body}");
        }
    }
    let (status, body) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/jobs",
            Some(
                json!({"type": "invoice.make", "args": [7], "options": {"queue": "team.billing",
                "unique": {"keys": ["type", "args"], "period": "PT1H"}}}),
            ),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let holder = body["job"]["id"].as_str().unwrap().to_owned();

    // Events, newest first, a page at a time, filtered by `type`.
    let (status, page) = s
        .call("root", "GET", "/ojs/v1/events?page=1&per_page=2", None)
        .await;
    assert_eq!(status, 200, "{page}");
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[0]["job_id"], holder.as_str(), "newest first: {page}");
    assert_eq!(page["pagination"]["total"], 7);
    assert_eq!(page["events"], page["items"]);
    let (_, page) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/events?type=job.enqueued&page=4&per_page=2",
            None,
        )
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
    assert_eq!(page["has_more"], false);
    let (_, page) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/events?type=job.completed&page=1&per_page=2",
            None,
        )
        .await;
    assert_eq!(page["pagination"]["total"], 0, "{page}");

    // Unique jobs: the holder, until its period ends; only for its queue's
    // tokens.
    let (status, unique) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/unique-jobs?page=1&per_page=25",
            None,
        )
        .await;
    assert_eq!(status, 200, "{unique}");
    let item = &unique["items"][0];
    assert_eq!(unique["pagination"]["total"], 1);
    assert_eq!(item["job_id"], holder.as_str());
    assert_eq!(item["type"], "invoice.make");
    assert_eq!(item["queue"], "team.billing");
    assert_eq!(item["state"], "available");
    assert_eq!(item["key"].as_str().unwrap().len(), 64, "{item}");
    let created =
        chrono::DateTime::parse_from_rfc3339(body["job"]["created_at"].as_str().unwrap()).unwrap();
    let until =
        chrono::DateTime::parse_from_rfc3339(item["locked_until"].as_str().unwrap()).unwrap();
    assert_eq!(until - created, chrono::Duration::hours(1));
    let (_, seen) = s.call("team", "GET", "/ojs/v1/unique-jobs", None).await;
    assert_eq!(seen["pagination"]["total"], 1);
    s.settle("team.billing", 1, true).await;
    let (_, unique) = s.call("root", "GET", "/ojs/v1/unique-jobs", None).await;
    assert_eq!(
        unique["pagination"]["total"], 0,
        "a completed job holds no key: {unique}"
    );

    // Priorities of the jobs that wait.
    let (status, stats) = s
        .call("root", "GET", "/ojs/v1/queues/mail/priority-stats", None)
        .await;
    assert_eq!(status, 200, "{stats}");
    assert_eq!(stats["total"], 6);
    assert_eq!(
        stats["counts_by_priority"],
        json!({"-3": 1, "0": 3, "5": 2})
    );
    assert_eq!(
        stats["distribution"],
        json!([{"priority": -3, "count": 1}, {"priority": 0, "count": 3}, {"priority": 5, "count": 2}])
    );
    let (status, _) = s
        .call("team", "GET", "/ojs/v1/queues/mail/priority-stats", None)
        .await;
    assert_eq!(status, 403);
}

/// Past 10,000 matching jobs a listing stops counting and paging (a count
/// or an offset beyond would read a large store's jobs one by one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_listing_counts_and_pages_to_a_bound() {
    let s = server().await;
    for _ in 0..11 {
        s.push("bulk.item", "bulk", 1_000).await;
    }
    let (status, page) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=bulk&page=1&per_page=50",
            None,
        )
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["pagination"]["total"], 10_000);
    assert_eq!(page["pagination"]["total_capped"], true);
    let (status, last) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=bulk&page=200&per_page=50",
            None,
        )
        .await;
    assert_eq!(status, 200, "{last}");
    assert_eq!(last["items"].as_array().unwrap().len(), 50);
    let (status, beyond) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=bulk&page=201&per_page=50",
            None,
        )
        .await;
    assert_eq!(status, 400, "{beyond}");
    assert_eq!(beyond["error"]["details"]["attribute"], "page");
    // Newest first, each once, across pages.
    let (_, first) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=bulk&page=1&per_page=100",
            None,
        )
        .await;
    let (_, second) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=bulk&page=2&per_page=100",
            None,
        )
        .await;
    let ids: std::collections::HashSet<&str> = first["items"]
        .as_array()
        .unwrap()
        .iter()
        .chain(second["items"].as_array().unwrap())
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 200);
    let (_, small) = s
        .call(
            "root",
            "GET",
            "/ojs/v1/admin/jobs?queue=nothing&page=1&per_page=50",
            None,
        )
        .await;
    assert_eq!(small["pagination"]["total_capped"], false);
}
