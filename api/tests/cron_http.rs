//! The cron endpoints of the HTTP binding, in process (`http::handle` over
//! the service on the in-memory broker and the embedded store): every
//! client's field names and paths, the answers' shapes, paging, enabling,
//! deleting, the refusals by status and field, and who may do what.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::server;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_jobs_are_registered_listed_changed_and_deleted_under_every_client_s_names() {
    let s = server().await;
    // The cases' shape, under /cron.
    let (status, body) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "nightly", "expression": "0 3 * * *",
            "timezone": "Europe/Berlin", "job_template": {"type": "report.build", "args": [1],
            "options": {"queue": "reports"}}})),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    for key in ["cron", "cron_job"] {
        let c = &body[key];
        assert_eq!(c["name"], "nightly");
        assert_eq!(c["id"], "nightly");
        assert_eq!(c["expression"], "0 3 * * *");
        assert_eq!(c["cron"], "0 3 * * *");
        assert_eq!(c["timezone"], "Europe/Berlin");
        assert_eq!(c["queue"], "reports");
        assert_eq!(c["enabled"], true);
        assert_eq!(c["status"], "active");
        assert_eq!(c["overlap_policy"], "skip");
        assert!(c["next_run_at"].as_str().unwrap().ends_with(":00.000Z"));
        assert_eq!(c["run_count"], 0);
    }
    // The docs' shape, under the admin UI's /crons.
    let (status, body) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/crons",
            Some(json!({"name": "hourly", "cron": "@hourly",
            "type": "cache.warm", "args": [], "queue": "cache"})),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    // Registered again: replaced, 200.
    let (status, body) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "hourly", "cron": "15 * * * *",
            "type": "cache.warm", "queue": "cache"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cron"]["cron"], "15 * * * *");
    let (status, list) = s.call("reader", "GET", "/ojs/v1/cron", None).await;
    assert_eq!(status, 200);
    for key in ["crons", "cron_jobs", "items"] {
        let names: Vec<&str> = list[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["hourly", "nightly"], "{key}");
    }
    assert_eq!(list["pagination"]["total"], 2);
    let (_, page) = s
        .call("reader", "GET", "/ojs/v1/crons?page=2&per_page=1", None)
        .await;
    assert_eq!(page["items"][0]["name"], "nightly");
    assert_eq!(page["pagination"]["has_more"], false);
    // Disabled: no next run, listed as disabled.
    let (status, body) = s
        .call(
            "root",
            "PATCH",
            "/ojs/v1/crons/nightly",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cron"]["status"], "disabled");
    assert_eq!(body["cron"]["next_run_at"], Value::Null);
    let (_, off) = s
        .call("reader", "GET", "/ojs/v1/cron?enabled=false", None)
        .await;
    assert_eq!(off["crons"].as_array().unwrap().len(), 1);
    let (status, one) = s.call("reader", "GET", "/ojs/v1/cron/nightly", None).await;
    assert_eq!((status, &one["cron"]["enabled"]), (200, &json!(false)));
    let (status, body) = s.call("root", "DELETE", "/ojs/v1/cron/nightly", None).await;
    assert_eq!(status, 200);
    assert_eq!(body["deleted"], true);
    assert_eq!(body["name"], "nightly");
    assert_eq!(body["cron"]["name"], "nightly");
    let (status, body) = s.call("root", "DELETE", "/ojs/v1/cron/nightly", None).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cron_jobs_are_refused_naming_the_field_and_tokens_keep_their_scope() {
    let s = server().await;
    for (body, field) in [
        (
            json!({"name": "x", "expression": "not a valid cron", "type": "t"}),
            "expression",
        ),
        (
            json!({"name": "x", "expression": "0 0 0 0 0 0 0", "type": "t"}),
            "expression",
        ),
        (
            json!({"name": "x", "expression": "99 25 32 13 8", "type": "t"}),
            "expression",
        ),
        (
            json!({"name": "x", "cron": "* * * * *", "type": "t", "timezone": "+05:00"}),
            "timezone",
        ),
        (
            json!({"name": "X", "cron": "* * * * *", "type": "t"}),
            "name",
        ),
        (
            json!({"name": "x", "cron": "* * * * *", "type": "t", "options": {"priority": 1000}}),
            "job_template.options.priority",
        ),
    ] {
        let (status, answer) = s
            .call("root", "POST", "/ojs/v1/cron", Some(body.clone()))
            .await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_request");
        assert!(!answer["error"]["message"].as_str().unwrap().is_empty());
        assert_eq!(answer["error"]["details"]["attribute"], field, "{answer}");
    }
    let (status, _) = s
        .call(
            "root",
            "PATCH",
            "/ojs/v1/cron/none",
            Some(json!({"enabled": "no"})),
        )
        .await;
    assert_eq!(status, 400);
    // A reader may list, not register.
    let (status, _) = s
        .call(
            "reader",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "r", "cron": "@daily", "type": "t"})),
        )
        .await;
    assert_eq!(status, 403);
    // A token of some queues registers crons of those queues only, and
    // sees no other.
    let (status, _) = s
        .call(
            "team",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "elsewhere", "cron": "@daily", "type": "t", "queue": "other"})),
        )
        .await;
    assert_eq!(status, 403);
    let (status, _) = s
        .call(
            "team",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "mine", "cron": "@daily", "type": "t", "queue": "team.a"})),
        )
        .await;
    assert_eq!(status, 201);
    let (status, _) = s
        .call(
            "root",
            "POST",
            "/ojs/v1/cron",
            Some(json!({"name": "theirs", "cron": "@daily", "type": "t", "queue": "other"})),
        )
        .await;
    assert_eq!(status, 201);
    let (_, list) = s.call("team", "GET", "/ojs/v1/cron", None).await;
    let names: Vec<&str> = list["crons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["mine"]);
    assert_eq!(
        s.call("team", "GET", "/ojs/v1/cron/theirs", None).await.0,
        404
    );
    assert_eq!(
        s.call("team", "DELETE", "/ojs/v1/cron/theirs", None)
            .await
            .0,
        404
    );
    let (status, _) = s
        .call(
            "team",
            "PATCH",
            "/ojs/v1/cron/theirs",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, 404);
    let (_, theirs) = s.call("root", "GET", "/ojs/v1/cron/theirs", None).await;
    assert_eq!(
        theirs["cron"]["enabled"], true,
        "untouched by a token that cannot see it"
    );
    assert_eq!(
        s.call("root", "GET", "/ojs/v1/cron/theirs", None).await.0,
        200
    );
}
