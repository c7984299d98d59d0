//! What real OJS clients (the official SDKs, the admin UI, the official
//! conformance runner) found against `ojs-bridge run`, each as it would
//! meet it, through a real daemon on the embedded default.

use serde_json::{json, Value};

use crate::ojs_server::{get, post_json, request, OjsServer};

/// An RFC 3339 time with exactly milliseconds, in UTC.
fn millisecond_time(v: &Value) -> bool {
    v.as_str().is_some_and(|t| {
        let Some(rest) = t.strip_suffix('Z') else {
            return false;
        };
        rest.rsplit_once('.')
            .is_some_and(|(_, frac)| frac.len() == 3 && frac.bytes().all(|b| b.is_ascii_digit()))
            && chrono::DateTime::parse_from_rfc3339(t).is_ok()
    })
}

/// Job types with a `-` inside a segment are taken in both bindings (the
/// official cases and the public servers use them); one ending in `-` is
/// still refused. INFO and CANCEL answers carry the job's fields at the
/// top level beside `job`; every timestamp has milliseconds; an
/// endpoint of a feature not served is 422 `unsupported`, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_sdks_and_the_conformance_runner_send_is_answered_as_they_read_it() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;

    let a = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "retry.test.attempt-counter", "args": [1], "options": {"queue": "sdk"}}),
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let pushed = a.json();
    assert_eq!(pushed["job"]["type"], "retry.test.attempt-counter");
    let id = pushed["job"]["id"].as_str().unwrap().to_owned();
    let info = get(addr, &format!("/ojs/v1/jobs/{id}")).await.json();
    assert_eq!(info["id"], json!(id), "the Rust SDK reads `id` at the top");
    assert_eq!(
        info["job"]["id"],
        json!(id),
        "the conformance cases under `job`"
    );
    let refused = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "retry.test.attempt-", "args": []}),
    )
    .await;
    assert_eq!(refused.status, 400);
    let mut grpc = crate::ojs_grpc::client(addr).await;
    let over_grpc = grpc
        .enqueue(crate::ojs_grpc::enqueue(
            "image-resize.run",
            json!([2]),
            "sdk",
        ))
        .await
        .expect("a dashed type over gRPC")
        .into_inner()
        .job
        .unwrap();
    assert_eq!(over_grpc.r#type, "image-resize.run");

    let fetched = post_json(addr, "/ojs/v1/workers/fetch", &json!({"queues": ["sdk"]})).await;
    assert_eq!(fetched.json()["jobs"][0]["id"], json!(id));
    let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
    assert_eq!(ack.status, 200);
    let info = get(addr, &format!("/ojs/v1/jobs/{id}")).await;
    let body = info.json();
    assert_eq!(body["id"], json!(id), "{body}");
    assert_eq!(body["state"], "completed");
    assert_eq!(body["job"]["state"], "completed");
    for key in ["created_at", "enqueued_at", "started_at", "completed_at"] {
        assert!(millisecond_time(&body[key]), "{key}: {}", body[key]);
    }

    let later = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "a.b", "args": [], "options": {"delay_until": "+PT1H"}}),
    )
    .await;
    let later_id = later.json()["job"]["id"].as_str().unwrap().to_owned();
    let cancel = request(
        addr,
        "DELETE",
        &format!("/ojs/v1/jobs/{later_id}"),
        &[],
        None,
    )
    .await;
    assert_eq!(cancel.status, 200);
    assert_eq!(cancel.json()["state"], "cancelled");
    assert_eq!(cancel.json()["job"]["state"], "cancelled");
    assert!(millisecond_time(&cancel.json()["cancelled_at"]));

    for (method, path, feature) in [
        ("GET", "/ojs/v1/cron", "cron"),
        ("POST", "/ojs/v1/workflows", "workflows"),
        ("POST", "/ojs/v1/queues/sdk/pause", "queue operations"),
        ("GET", "/ojs/v1/admin/stats", "admin endpoints"),
    ] {
        let a = request(
            addr,
            method,
            path,
            &[("content-type".into(), "application/json".into())],
            Some(b"{}"),
        )
        .await;
        assert_eq!(a.status, 422, "{method} {path}: {:?}", a.body);
        assert_eq!(a.json()["error"]["code"], "unsupported");
        assert!(
            a.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(feature),
            "{:?}",
            a.body
        );
    }
    assert_eq!(get(addr, "/ojs/v1/no-such-thing").await.status, 404);
    server.stop();
}
