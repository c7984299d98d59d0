//! What real OJS clients (the official SDKs, the admin UI, the official
//! conformance runner) found against `ojs-bridge run`, each as it would
//! meet it, through a real daemon on the embedded default.

use std::time::Duration;

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

    for (method, path, feature) in [("GET", "/ojs/v1/admin/tenants", "admin endpoints")] {
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
    // Workflows are served: a workflow without steps is refused naming
    // the path, as the binding writes workflow validation errors.
    let no_steps = request(
        addr,
        "POST",
        "/ojs/v1/workflows",
        &[("content-type".into(), "application/json".into())],
        Some(b"{\"type\": \"chain\", \"steps\": []}"),
    )
    .await;
    assert_eq!(no_steps.status, 400, "{:?}", no_steps.body);
    assert_eq!(no_steps.json()["error"]["code"], "invalid_workflow");
    assert_eq!(
        no_steps.json()["error"]["details"]["validation_errors"][0]["path"],
        "steps"
    );
    assert_eq!(get(addr, "/ojs/v1/no-such-thing").await.status, 404);
    server.stop();
}

/// Every retry and unique option the public OJS protos carry, set over
/// gRPC, reads back the same over HTTP, and the reverse; an unset
/// `jitter` is the spec's `true` in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_option_reads_back_the_same_through_both_bindings() {
    use ojs_api::grpc::pb;
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let mut grpc = crate::ojs_grpc::client(addr).await;
    let unique = pb::UniquePolicy {
        key: vec!["type".into(), "args".into(), "meta".into()],
        args_keys: vec!["order".into()],
        meta_keys: vec!["tenant".into()],
        on_conflict: pb::UniqueConflictAction::ReplaceExceptSchedule as i32,
        ..Default::default()
    };
    let cases = [
        (
            pb::RetryPolicy {
                on_exhaustion: "dead_letter".into(),
                ..Default::default()
            },
            json!({"on_exhaustion": "dead_letter", "jitter": true}),
        ),
        (
            pb::RetryPolicy {
                jitter: Some(false),
                on_exhaustion: "discard".into(),
                max_attempts: 4,
                ..Default::default()
            },
            json!({"on_exhaustion": "discard", "jitter": false, "max_attempts": 4}),
        ),
    ];
    for (retry, expected) in cases {
        let mut request = crate::ojs_grpc::enqueue("a.b", json!([{"order": 1}]), "both");
        let options = request.options.as_mut().unwrap();
        options.retry = Some(retry);
        options.unique = Some(unique.clone());
        options.meta = Some(ojs_api::grpc::convert::json_to_struct(
            json!({"tenant": "t"}).as_object().unwrap(),
        ));
        let job = grpc
            .enqueue(request)
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        let http = get(addr, &format!("/ojs/v1/jobs/{}", job.id)).await.json();
        for (k, v) in expected.as_object().unwrap() {
            assert_eq!(&http["retry"][k], v, "{k}: {}", http["retry"]);
        }
        assert_eq!(http["unique"]["args_keys"], json!(["order"]));
        assert_eq!(http["unique"]["meta_keys"], json!(["tenant"]));
        assert_eq!(http["unique"]["on_conflict"], "replace_except_schedule");
        // And the same job read over gRPC.
        let back = grpc
            .get_job(pb::GetJobRequest { job_id: job.id })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        let policy = back.retry_policy.unwrap();
        assert_eq!(
            policy.on_exhaustion,
            expected["on_exhaustion"].as_str().unwrap()
        );
        assert_eq!(policy.jitter, expected["jitter"].as_bool());
        let u = back.unique_policy.unwrap();
        assert_eq!(
            (u.args_keys, u.meta_keys),
            (vec!["order".to_owned()], vec!["tenant".to_owned()])
        );
        assert_eq!(
            u.on_conflict,
            pb::UniqueConflictAction::ReplaceExceptSchedule as i32
        );
    }
    // The reverse: pushed over HTTP, read over gRPC.
    let a = post_json(
        addr,
        "/ojs/v1/jobs",
        &json!({"type": "a.b", "args": [{"order": 2}], "meta": {"tenant": "t"},
                "options": {"queue": "both", "retry": {"max_attempts": 2, "on_exhaustion": "dead_letter"},
                            "unique": {"keys": ["args", "meta"], "args_keys": ["order"], "meta_keys": ["tenant"],
                                       "on_conflict": "replace_except_schedule"}}}),
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let id = a.json()["job"]["id"].as_str().unwrap().to_owned();
    let back = grpc
        .get_job(pb::GetJobRequest { job_id: id })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    let policy = back.retry_policy.unwrap();
    assert_eq!(
        (
            policy.max_attempts,
            policy.on_exhaustion.as_str(),
            policy.jitter
        ),
        (2, "dead_letter", Some(true))
    );
    let u = back.unique_policy.unwrap();
    assert_eq!(u.args_keys, vec!["order".to_owned()]);
    assert_eq!(
        u.on_conflict,
        pb::UniqueConflictAction::ReplaceExceptSchedule as i32
    );
    server.stop();
}

/// An exhausted job whose policy names no `on_exhaustion` is discarded
/// and not kept as a dead letter (the spec's default); with `[api]
/// on_exhaustion = "dead_letter"` every such job is kept and listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_job_is_discarded_unless_the_operator_keeps_dead_letters() {
    let keep = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\non_exhaustion = \"dead_letter\"\n";
    for (config, listed) in [(None, 0), (Some(keep), 1)] {
        let server = OjsServer::start(config).await;
        let addr = server.addr;
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": "a.b", "args": [], "options": {"queue": "x", "retry": {"max_attempts": 1}}}),
        )
        .await;
        let id = a.json()["job"]["id"].as_str().unwrap().to_owned();
        let f = post_json(addr, "/ojs/v1/workers/fetch", &json!({"queues": ["x"]})).await;
        assert_eq!(f.json()["jobs"][0]["id"], json!(id));
        let n = post_json(
            addr,
            "/ojs/v1/workers/nack",
            &json!({"job_id": id, "error": {"code": "no_handler", "message": "no handler registered"}}),
        )
        .await;
        assert_eq!(n.json()["state"], "discarded", "{:?}", n.body);
        let dead = get(addr, "/ojs/v1/dead-letter").await.json();
        assert_eq!(dead["pagination"]["total"], listed, "{config:?}: {dead}");
        server.stop();
    }
}

/// Two deployments on one broker with templates of their own and the same
/// queue name: a job pushed, fetched and failed (retry after a second)
/// through the first comes back through the first only; the second, asking
/// all along (`b_watches` after the NACK), never sees it.
async fn two_deployments_keep_apart(config: &dyn Fn(&str) -> String, b_watches: Duration) {
    let a = OjsServer::start(Some(&config("tenanta"))).await;
    let b = OjsServer::start(Some(&config("tenantb"))).await;
    let fetch = |addr| async move {
        post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": ["default"], "wait_ms": 2000}),
        )
        .await
        .json()["jobs"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    // B's queue exists (RabbitMQ declares it at the first FETCH, a Kafka
    // consumer joins its group) before A pushes.
    assert!(fetch(b.addr).await.is_empty());
    let pushed = post_json(
        a.addr,
        "/ojs/v1/jobs",
        &json!({"type": "tenant.job", "args": [], "options": {"queue": "default",
                "retry": {"max_attempts": 3, "initial_interval": "PT1S", "jitter": false}}}),
    )
    .await;
    assert_eq!(pushed.status, 201, "{:?}", pushed.body);
    let job_id = pushed.json()["job"]["id"].clone();
    let fetch_until = |addr| async move {
        for _ in 0..10 {
            let jobs = fetch(addr).await;
            if !jobs.is_empty() {
                return jobs;
            }
        }
        Vec::new()
    };
    let first = fetch_until(a.addr).await;
    assert_eq!(first.first().map(|j| j["id"].clone()), Some(job_id.clone()));
    let nack = post_json(
        a.addr,
        "/ojs/v1/workers/nack",
        &json!({"job_id": job_id, "error": {"code": "flaky", "message": "again"}}),
    )
    .await;
    assert_eq!(nack.json()["state"], "retryable", "{:?}", nack.body);
    let started = std::time::Instant::now();
    while started.elapsed() < b_watches {
        let jobs = fetch(b.addr).await;
        assert!(jobs.is_empty(), "the other deployment took {jobs:?}");
    }
    let again = fetch_until(a.addr).await;
    assert_eq!(again.first().map(|j| j["id"].clone()), Some(job_id));
    assert_eq!(again[0]["attempt"], 2);
    a.stop();
    b.stop();
}

/// On Kafka: the retry and dead topics follow each one's template, its
/// consumer groups are named by its topics, and a retry record goes back
/// only to the topic it came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_on_one_kafka_cluster_never_take_each_other_s_jobs() {
    let Some(kafka) =
        ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::Kafka).await
    else {
        return;
    };
    let id = ojs_bridge_tests::brokers::unique_queue("t");
    let config = |tenant: &str| {
        format!(
            "[adapters.kafka]\nurl = \"{}\"\ntopic_template = \"{tenant}{id}.{{queue}}\"\n\n[api]\nadapter = \"kafka\"\n",
            kafka.url
        )
    };
    // The retry is due after 1 s; B asks for 8.
    two_deployments_keep_apart(&config, Duration::from_secs(8)).await;
}

/// A Kafka cluster nobody answers at: librdkafka reports it several
/// times a second per client; the log gets a line when a kind of report
/// starts (and a reminder a minute), and health names the address and
/// librdkafka's reason, not a time-out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_is_named_in_health_without_flooding_the_log() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = format!(
        "[adapters.kafka]\nurl = \"kafka://127.0.0.1:{port}\"\n\n[api]\nadapter = \"kafka\"\n"
    );
    let started = std::time::Instant::now();
    let server = OjsServer::start(Some(&config)).await;
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(started.elapsed())).await;
    let health = get(server.addr, "/ojs/v1/health").await;
    assert_eq!(health.status, 503, "{:?}", health.body);
    let detail = health.json()["adapters"]["kafka"]["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains(&format!("127.0.0.1:{port}")) && detail.contains("refused"),
        "health names the address and the reason: {detail}"
    );
    let log = server.log();
    let librdkafka = log.lines().filter(|l| l.contains("librdkafka")).count();
    println!(
        "unreachable Kafka, 10 s: {librdkafka} librdkafka lines, {} in all; health: {detail}",
        log.lines().count()
    );
    assert!(librdkafka <= 8, "the log was flooded:\n{log}");
    server.stop();
}

/// The listener comes first: while a broker is still being reached (a
/// wrong RabbitMQ port), a probe gets health 503 `starting` and a request
/// the binding's retryable 503, never a refused connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_answers_503_starting_while_the_brokers_are_reached() {
    let free = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (nobody, listen) = (free(), free());
    let dir = ojs_bridge_tests::tempdir::TempDir::new("starting");
    let file = dir.path().join("bridge.toml");
    std::fs::write(
        &file,
        format!("[adapters.rabbit]\nurl = \"amqp://guest:guest@{nobody}/%2f\"\n\n[api]\nadapter = \"rabbit\"\n"),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .env("OJS_BRIDGE_HTTP_LISTEN", listen.to_string())
        .args(["run", "--config", file.to_str().unwrap()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut refused = 0;
    let first = loop {
        if let Some(answer) =
            crate::ojs_server::try_answer(listen, "GET", "/ojs/v1/health", b"").await
        {
            break answer;
        }
        refused += 1;
        assert!(refused < 200, "no answer in 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let push = crate::ojs_server::try_answer(
        listen,
        "POST",
        "/ojs/v1/jobs",
        br#"{"type":"a.b","args":[]}"#,
    )
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    println!("starting: {refused} refused connect(s) before the first answer");
    assert_eq!(first.0, 503);
    let health: Value = serde_json::from_slice(&first.1).unwrap();
    assert_eq!(health["status"], "starting", "{health}");
    let (status, body) = push.expect("answered while starting");
    assert_eq!(status, 503);
    let error: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["retryable"], true, "{error}");
}

/// `/metrics` carries the OJS API's figures: requests by binding, route
/// and status with their latency; jobs pushed, fetched, acked, nacked,
/// retried, discarded and active per queue; the store's latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_what_the_api_did() {
    use crate::support::metric;
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let mut ids = Vec::new();
    for max_attempts in [1, 1, 3] {
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": "m.job", "args": [], "options": {"queue": "measured", "retry": {"max_attempts": max_attempts}}}),
        )
        .await;
        assert_eq!(a.status, 201);
        ids.push(a.json()["job"]["id"].as_str().unwrap().to_owned());
    }
    let mut fetched = 0;
    while fetched < 3 {
        let f = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": ["measured"], "count": 3}),
        )
        .await;
        fetched += f.json()["jobs"].as_array().map_or(0, Vec::len);
    }
    let held = get(addr, "/metrics").await;
    let text = String::from_utf8_lossy(&held.body).into_owned();
    assert_eq!(
        metric(&text, "ojs_bridge_api_jobs_active{queue=\"measured\"}"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": ids[0]}))
            .await
            .status,
        200
    );
    for id in &ids[1..] {
        let n = post_json(
            addr,
            "/ojs/v1/workers/nack",
            &json!({"job_id": id, "error": {"message": "no"}}),
        )
        .await;
        assert_eq!(n.status, 200);
    }
    assert_eq!(get(addr, "/ojs/v1/jobs/nope").await.status, 404);
    let text = String::from_utf8_lossy(&get(addr, "/metrics").await.body).into_owned();
    let expect = [
        (
            "ojs_bridge_api_requests_total{binding=\"http\",route=\"push\",status=\"201\"}",
            3.0,
        ),
        (
            "ojs_bridge_api_requests_total{binding=\"http\",route=\"info\",status=\"404\"}",
            1.0,
        ),
        (
            "ojs_bridge_api_requests_total{binding=\"http\",route=\"ack\",status=\"200\"}",
            1.0,
        ),
        (
            "ojs_bridge_api_request_seconds_count{binding=\"http\",route=\"push\"}",
            3.0,
        ),
        ("ojs_bridge_api_jobs_pushed_total{queue=\"measured\"}", 3.0),
        ("ojs_bridge_api_jobs_fetched_total{queue=\"measured\"}", 3.0),
        ("ojs_bridge_api_jobs_acked_total{queue=\"measured\"}", 1.0),
        ("ojs_bridge_api_jobs_nacked_total{queue=\"measured\"}", 2.0),
        ("ojs_bridge_api_jobs_retried_total{queue=\"measured\"}", 1.0),
        (
            "ojs_bridge_api_jobs_discarded_total{queue=\"measured\"}",
            1.0,
        ),
        (
            "ojs_bridge_api_jobs_dead_lettered_total{queue=\"measured\"}",
            0.0,
        ),
    ];
    for (sample, value) in expect {
        assert_eq!(metric(&text, sample), Some(value), "{sample}\n{text}");
    }
    assert!(
        metric(&text, "ojs_bridge_api_jobs_active{queue=\"measured\"}").is_none_or(|n| n == 0.0)
    );
    for op in ["insert", "transition"] {
        let n = metric(
            &text,
            &format!("ojs_bridge_api_store_seconds_count{{op=\"{op}\"}}"),
        );
        assert!(
            n.is_some_and(|n| n >= 1.0),
            "store latency of {op}: {n:?}\n{text}"
        );
    }
    server.stop();
}

/// On RabbitMQ: the queues are bound to the shared exchanges by their own
/// names, so a push through one, and its retry after a NACK, reach that
/// one only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_on_one_rabbitmq_broker_never_take_each_other_s_jobs() {
    let Some(rabbit) =
        ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::RabbitMq).await
    else {
        return;
    };
    let id = ojs_bridge_tests::brokers::unique_queue("t");
    let config = |tenant: &str| {
        format!(
            "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{tenant}{id}.{{queue}}\"\n\n[api]\nadapter = \"rabbit\"\n",
            rabbit.url
        )
    };
    two_deployments_keep_apart(&config, Duration::from_secs(3)).await;
}

/// `[http] admin_ui_dir`: a built admin UI served at `/ojs/admin/` — its
/// files with their types, the app's own routes as its index, nothing
/// outside the directory, a missing asset 404; a directory without an
/// index refused at the start, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_ui_is_served_from_its_directory_with_the_app_s_fallback() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("ojs-admin-ui");
    let ui = dir.path().join("ui");
    std::fs::create_dir_all(ui.join("assets")).unwrap();
    std::fs::write(
        ui.join("index.html"),
        "<!doctype html><title>OJS admin</title>",
    )
    .unwrap();
    std::fs::write(ui.join("assets/app.js"), "console.log('ojs')").unwrap();
    std::fs::write(dir.path().join("secret.txt"), "outside").unwrap();
    let config = format!(
        "[http]\nadmin_ui_dir = \"{}\"\n[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n",
        ui.display()
    );
    let server = OjsServer::start(Some(&config)).await;
    let addr = server.addr;
    for path in [
        "/ojs/admin/",
        "/ojs/admin",
        "/ojs/admin/queues",
        "/ojs/admin/jobs/019a",
    ] {
        let a = get(addr, path).await;
        assert_eq!(a.status, 200, "{path}");
        assert_eq!(
            a.header("content-type").as_deref(),
            Some("text/html; charset=utf-8"),
            "{path}"
        );
        assert!(
            String::from_utf8_lossy(&a.body).contains("OJS admin"),
            "{path}"
        );
    }
    let js = get(addr, "/ojs/admin/assets/app.js").await;
    assert_eq!(
        (js.status, js.header("content-type").as_deref()),
        (200, Some("text/javascript; charset=utf-8"))
    );
    assert_eq!(&js.body[..], b"console.log('ojs')");
    for path in [
        "/ojs/admin/assets/missing.js",
        "/ojs/admin/../secret.txt",
        "/ojs/admin/%2e%2e/secret.txt",
        "/ojs/admin/assets/../../secret.txt",
    ] {
        let a = get(addr, path).await;
        assert!(
            !String::from_utf8_lossy(&a.body).contains("outside"),
            "{path}: served a file outside"
        );
        assert_ne!(
            a.header("content-type").as_deref(),
            Some("text/javascript; charset=utf-8"),
            "{path}"
        );
    }
    assert_eq!(get(addr, "/ojs/admin/assets/missing.js").await.status, 404);
    // The API beside it is the API.
    assert_eq!(get(addr, "/ojs/manifest").await.status, 200);
    server.stop();

    // Without an index: the start stops, naming the field.
    std::fs::remove_file(ui.join("index.html")).unwrap();
    std::fs::write(dir.path().join("bridge.toml"), &config).unwrap();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .env("OJS_BRIDGE_HTTP_LISTEN", "127.0.0.1:0")
        .args(["run", "--config"])
        .arg(dir.path().join("bridge.toml"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("http.admin_ui_dir"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
