//! What each page of the official OJS admin UI reads, through a real
//! daemon on the embedded default and on RabbitMQ: for every endpoint a
//! page calls, the answer carries every field the page reads, with the type
//! it reads it as (a missing one crashes the page; see EXTENSIONS.md, the
//! table of pages). The jobs behind them are in every state a page shows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use serde_json::{json, Value};

use crate::ojs_server::{get, post_json, request, OjsServer};

/// The type a page reads a field as.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Str,
    Num,
    Bool,
    Array,
    Object,
    /// There, possibly `null`.
    Present,
}

/// `v` at a dotted path (`a.b`, array items as `a.0.b`).
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, k| match k.parse::<usize>() {
            Ok(i) if v.is_array() => v.get(i),
            _ => v.as_object().and_then(|m| m.get(k)),
        })
}

/// Asserts each field of `fields` in `v` (named `what` in failures).
fn reads(what: &str, v: &Value, fields: &[(&str, Kind)]) {
    for (path, kind) in fields {
        let found = at(v, path);
        let ok = matches!(
            (kind, found),
            (Kind::Str, Some(Value::String(_)))
                | (Kind::Num, Some(Value::Number(_)))
                | (Kind::Bool, Some(Value::Bool(_)))
                | (Kind::Array, Some(Value::Array(_)))
                | (Kind::Object, Some(Value::Object(_)))
                | (Kind::Present, Some(_))
        );
        assert!(ok, "{what}: `{path}` is not a {kind:?}: {found:?} in {v}");
    }
}

async fn get_json(addr: SocketAddr, path: &str) -> Value {
    // The UI sends a JSON content type on every call.
    let a = request(
        addr,
        "GET",
        path,
        &[("content-type".into(), "application/json".into())],
        None,
    )
    .await;
    assert_eq!(a.status, 200, "GET {path}: {:?}", a.body);
    a.json()
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> Value {
    let a = post_json(addr, path, &body).await;
    assert!(
        (200..300).contains(&a.status),
        "POST {path}: {} {:?}",
        a.status,
        a.body
    );
    a.json()
}

/// Jobs in every state a page shows, a worker, a dead letter, a cron job,
/// a workflow, a unique job and a rate-limit key.
async fn populate(addr: SocketAddr) -> String {
    let push = |queue: &str, options: Value| {
        let mut options = options;
        options["queue"] = json!(queue);
        json!({"type": "mail.send", "args": ["a@example.com"], "options": options})
    };
    let mut ids = Vec::new();
    for priority in [0, 5, 10] {
        let job = post(
            addr,
            "/ojs/v1/jobs",
            push("mail", json!({"priority": priority})),
        )
        .await;
        ids.push(job["job"]["id"].as_str().unwrap().to_owned());
    }
    post(
        addr,
        "/ojs/v1/jobs",
        push("mail", json!({"delay_until": "2099-01-01T00:00:00Z"})),
    )
    .await;
    post(
        addr,
        "/ojs/v1/jobs",
        push(
            "once",
            json!({"unique": {"keys": ["type"], "on_conflict": "reject", "period": "PT1H"}}),
        ),
    )
    .await;
    post(
        addr,
        "/ojs/v1/jobs",
        push("limited", json!({"rate_limit": {"concurrency": 2}})),
    )
    .await;
    post(
        addr,
        "/ojs/v1/jobs",
        push(
            "dead",
            json!({"retry": {"max_attempts": 1, "on_exhaustion": "dead_letter"}}),
        ),
    )
    .await;
    // A worker holds one job, completes another, fails one for good.
    let fetch = |queue: &str| json!({"queues": [queue], "count": 1, "worker_id": "w-pages", "wait_ms": 3000});
    let mut held = Vec::new();
    for queue in ["mail", "mail", "dead", "limited"] {
        let got = post(addr, "/ojs/v1/workers/fetch", fetch(queue)).await;
        let job = got["jobs"][0].clone();
        assert!(job.is_object(), "{queue}: {got}");
        held.push(job["id"].as_str().unwrap().to_owned());
    }
    post(
        addr,
        "/ojs/v1/workers/ack",
        json!({"job_id": held[0], "result": {"sent": true}}),
    )
    .await;
    post(
        addr,
        "/ojs/v1/workers/nack",
        json!({"job_id": held[2], "error": {"code": "smtp", "message": "refused", "retryable": false}}),
    )
    .await;
    post(
        addr,
        "/ojs/v1/workers/heartbeat",
        json!({"worker_id": "w-pages", "active_jobs": [held[1]]}),
    )
    .await;
    post(
        addr,
        "/ojs/v1/cron",
        json!({"name": "pages-nightly", "cron": "0 3 * * *", "type": "report.build", "args": [], "queue": "reports"}),
    )
    .await;
    let wf = post(
        addr,
        "/ojs/v1/workflows",
        json!({"type": "chain", "name": "pages-chain", "steps": [
            {"type": "step.one", "args": [], "options": {"queue": "flow"}},
            {"type": "step.two", "args": [], "options": {"queue": "flow"}}]}),
    )
    .await;
    post(addr, "/ojs/v1/queues/reports/pause", json!({})).await;
    wf["workflow"]["id"].as_str().unwrap().to_owned()
}

async fn every_page_reads_its_fields(config: Option<String>, what: &str) {
    let server = OjsServer::start(config.as_deref()).await;
    let addr = server.addr;
    let workflow = populate(addr).await;
    let p = |page: &str| format!("{what}, {page}");

    // Dashboard.
    let stats = get_json(addr, "/ojs/v1/admin/stats").await;
    reads(
        &p("Dashboard stats"),
        &stats,
        &[
            ("jobs.available", Kind::Num),
            ("jobs.active", Kind::Num),
            ("jobs.scheduled", Kind::Num),
            ("jobs.retryable", Kind::Num),
            ("jobs.completed", Kind::Num),
            ("jobs.discarded", Kind::Num),
            ("throughput.processed_per_minute", Kind::Num),
            ("throughput.failed_per_minute", Kind::Num),
            ("queues", Kind::Num),
            ("workers", Kind::Num),
        ],
    );
    let queues = get_json(addr, "/ojs/v1/admin/queues?page=1&per_page=50").await;
    reads(
        &p("Dashboard queues"),
        &queues,
        &[("pagination.page", Kind::Num), ("items", Kind::Array)],
    );
    for q in queues["items"].as_array().unwrap() {
        reads(
            &p("Queues item"),
            q,
            &[
                ("name", Kind::Str),
                ("paused", Kind::Bool),
                ("counts.available", Kind::Num),
                ("counts.active", Kind::Num),
                ("counts.scheduled", Kind::Num),
                ("counts.retryable", Kind::Num),
                ("counts.completed", Kind::Num),
                ("counts.discarded", Kind::Num),
                ("throughput", Kind::Object),
            ],
        );
    }
    let history = get_json(addr, "/ojs/v1/admin/stats/history?period=5m").await;
    reads(
        &p("Dashboard history"),
        &history,
        &[
            ("data", Kind::Array),
            ("data.0.timestamp", Kind::Str),
            ("data.0.processed", Kind::Num),
            ("data.0.failed", Kind::Num),
        ],
    );
    let health = get_json(addr, "/ojs/v1/health").await;
    reads(&p("Dashboard health"), &health, &[("status", Kind::Str)]);
    let maintenance = get_json(addr, "/ojs/v1/admin/system/maintenance").await;
    reads(
        &p("Dashboard maintenance"),
        &maintenance,
        &[
            ("enabled", Kind::Bool),
            ("reason", Kind::Present),
            ("started_at", Kind::Present),
            ("ends_at", Kind::Present),
        ],
    );

    // Queues: the configuration dialog.
    let detail = get_json(addr, "/ojs/v1/admin/queues/mail").await;
    reads(
        &p("Queues detail"),
        &detail,
        &[
            ("configuration.concurrency", Kind::Present),
            ("configuration.rate_limit", Kind::Present),
            ("configuration.retention", Kind::Object),
        ],
    );
    let priorities = get_json(addr, "/ojs/v1/queues/mail/priority-stats").await;
    reads(
        &p("Queues priority-stats"),
        &priorities,
        &[
            ("distribution", Kind::Array),
            ("distribution.0.priority", Kind::Num),
            ("distribution.0.count", Kind::Num),
        ],
    );

    // Jobs and its drawer; Scheduled.
    let jobs = get_json(addr, "/ojs/v1/admin/jobs?queue=mail&page=1&per_page=25").await;
    reads(
        &p("Jobs"),
        &jobs,
        &[("pagination.page", Kind::Num), ("items.0", Kind::Object)],
    );
    for job in jobs["items"].as_array().unwrap() {
        reads(
            &p("Jobs item"),
            job,
            &[
                ("id", Kind::Str),
                ("type", Kind::Str),
                ("queue", Kind::Str),
                ("state", Kind::Str),
                ("attempt", Kind::Num),
                ("created_at", Kind::Str),
            ],
        );
    }
    let dead = get_json(addr, "/ojs/v1/admin/jobs?queue=dead&page=1&per_page=25").await;
    let failed_id = dead["items"][0]["id"].as_str().unwrap().to_owned();
    for id in [jobs["items"][0]["id"].as_str().unwrap(), failed_id.as_str()] {
        let drawer = get_json(addr, &format!("/ojs/v1/admin/jobs/{id}")).await;
        reads(
            &p("Jobs drawer"),
            &drawer,
            &[
                ("id", Kind::Str),
                ("type", Kind::Str),
                ("state", Kind::Str),
                ("attempt", Kind::Num),
                ("max_attempts", Kind::Num),
                ("priority", Kind::Num),
                ("created_at", Kind::Str),
                ("metadata", Kind::Object),
                ("args", Kind::Array),
                ("meta", Kind::Object),
                ("errors", Kind::Array),
                ("result", Kind::Present),
                ("retry_policy", Kind::Present),
            ],
        );
    }
    let failed = get_json(addr, &format!("/ojs/v1/admin/jobs/{failed_id}")).await;
    reads(
        &p("Jobs drawer errors"),
        &failed,
        &[
            ("errors.0.code", Kind::Present),
            ("errors.0.type", Kind::Present),
            ("errors.0.attempt", Kind::Num),
            ("errors.0.occurred_at", Kind::Str),
            ("errors.0.message", Kind::Str),
            ("errors.0.backtrace", Kind::Array),
        ],
    );
    let scheduled = get_json(
        addr,
        "/ojs/v1/admin/jobs?state=scheduled&per_page=50&sort=scheduled_at&order=asc",
    )
    .await;
    reads(
        &p("Scheduled"),
        &scheduled,
        &[
            ("pagination.page", Kind::Num),
            ("items.0.id", Kind::Str),
            ("items.0.type", Kind::Str),
            ("items.0.queue", Kind::Str),
            ("items.0.state", Kind::Str),
            ("items.0.priority", Kind::Num),
            ("items.0.scheduled_at", Kind::Str),
            ("items.0.created_at", Kind::Str),
        ],
    );

    // Workers.
    let workers = get_json(addr, "/ojs/v1/admin/workers?page=1&per_page=50").await;
    reads(
        &p("Workers"),
        &workers,
        &[
            ("pagination.page", Kind::Num),
            ("summary.running", Kind::Num),
            ("summary.quiet", Kind::Num),
            ("summary.stale", Kind::Num),
            ("items.0.id", Kind::Str),
            ("items.0.hostname", Kind::Present),
            ("items.0.state", Kind::Str),
            ("items.0.queues", Kind::Array),
            ("items.0.active_jobs", Kind::Num),
            ("items.0.last_heartbeat_at", Kind::Str),
        ],
    );

    // Dead Letter.
    let letters = get_json(addr, "/ojs/v1/admin/dead-letter?page=1&per_page=25").await;
    reads(
        &p("Dead Letter"),
        &letters,
        &[
            ("pagination.page", Kind::Num),
            ("items.0.id", Kind::Str),
            ("items.0.type", Kind::Str),
            ("items.0.queue", Kind::Str),
            ("items.0.state", Kind::Str),
            ("items.0.created_at", Kind::Str),
        ],
    );
    let letter_stats = get_json(addr, "/ojs/v1/admin/dead-letter/stats").await;
    reads(
        &p("Dead Letter stats"),
        &letter_stats,
        &[
            ("total", Kind::Num),
            ("by_error_type", Kind::Present),
            ("by_queue", Kind::Present),
        ],
    );

    // Cron Jobs.
    let crons = get_json(addr, "/ojs/v1/crons?page=1&per_page=25").await;
    let cron_fields = [
        ("id", Kind::Str),
        ("name", Kind::Str),
        ("type", Kind::Str),
        ("queue", Kind::Str),
        ("schedule", Kind::Str),
        ("timezone", Kind::Str),
        ("last_run_at", Kind::Present),
        ("next_run_at", Kind::Str),
        ("enabled", Kind::Bool),
    ];
    reads(&p("Cron Jobs"), &crons, &[("pagination.page", Kind::Num)]);
    reads(&p("Cron Jobs item"), &crons["items"][0], &cron_fields);
    let cron = get_json(addr, "/ojs/v1/crons/pages-nightly").await;
    let cron = if cron["cron"].is_object() {
        cron["cron"].clone()
    } else {
        cron
    };
    reads(
        &p("Cron Jobs detail"),
        &cron,
        &[
            ("created_at", Kind::Str),
            ("updated_at", Kind::Str),
            ("args", Kind::Array),
            ("meta", Kind::Present),
        ],
    );

    // Workflows.
    let flows = get_json(addr, "/ojs/v1/workflows?page=1&per_page=25").await;
    reads(
        &p("Workflows"),
        &flows,
        &[
            ("pagination.page", Kind::Num),
            ("items.0.id", Kind::Str),
            ("items.0.name", Kind::Present),
            ("items.0.state", Kind::Str),
            ("items.0.steps_total", Kind::Num),
            ("items.0.steps_completed", Kind::Num),
            ("items.0.created_at", Kind::Str),
        ],
    );
    let flow = get_json(addr, &format!("/ojs/v1/workflows/{workflow}")).await;
    reads(
        &p("Workflows detail"),
        &flow,
        &[
            ("id", Kind::Str),
            ("steps.0.id", Kind::Str),
            ("steps.0.type", Kind::Str),
            ("steps.0.state", Kind::Str),
            ("steps.0.job_ids", Kind::Array),
            ("steps.0.depends_on", Kind::Array),
            ("completed_at", Kind::Present),
            ("meta", Kind::Present),
        ],
    );
    let progress = get_json(addr, &format!("/ojs/v1/workflows/{workflow}/progress")).await;
    reads(
        &p("Workflows progress"),
        &progress,
        &[("steps", Kind::Array)],
    );

    // Rate Limits.
    let limits = get_json(addr, "/ojs/v1/rate-limits?page=1&per_page=25").await;
    reads(
        &p("Rate Limits"),
        &limits,
        &[
            ("pagination.page", Kind::Num),
            ("items.0.key", Kind::Str),
            ("items.0.limit", Kind::Num),
            ("items.0.period", Kind::Present),
            ("items.0.active", Kind::Num),
            ("items.0.waiting", Kind::Num),
            ("items.0.override", Kind::Present),
        ],
    );

    // Events.
    let events = get_json(addr, "/ojs/v1/events?type=&page=1&per_page=50").await;
    reads(
        &p("Events"),
        &events,
        &[("pagination.page", Kind::Num), ("items", Kind::Array)],
    );
    let items = events["items"].as_array().unwrap();
    assert!(items.len() >= 10, "{what}: events {events}");
    for e in items {
        reads(
            &p("Events item"),
            e,
            &[
                ("id", Kind::Str),
                ("type", Kind::Str),
                ("timestamp", Kind::Str),
                ("data", Kind::Object),
            ],
        );
    }

    // Unique Jobs.
    let unique = get_json(addr, "/ojs/v1/unique-jobs?page=1&per_page=25").await;
    reads(
        &p("Unique Jobs"),
        &unique,
        &[
            ("pagination.page", Kind::Num),
            ("items.0.key", Kind::Str),
            ("items.0.job_id", Kind::Str),
            ("items.0.type", Kind::Str),
            ("items.0.queue", Kind::Str),
            ("items.0.state", Kind::Str),
            ("items.0.locked_until", Kind::Str),
        ],
    );

    // Settings (and the sidebar, which reads the manifest).
    let manifest = get_json(addr, "/ojs/manifest").await;
    reads(
        &p("Settings"),
        &manifest,
        &[
            ("implementation.name", Kind::Str),
            ("implementation.version", Kind::Str),
            ("implementation.language", Kind::Str),
            ("backend", Kind::Present),
            ("conformance_level", Kind::Num),
            ("protocols", Kind::Array),
            ("capabilities", Kind::Object),
            ("extensions", Kind::Array),
        ],
    );
    // The sidebar shows a page only for a capability that is `true`.
    for page in [
        "cron",
        "workflows",
        "rate_limiting",
        "unique_jobs",
        "dead_letter",
        "events",
    ] {
        assert_eq!(
            manifest["capabilities"][page], true,
            "{what}: the sidebar hides the {page} page"
        );
    }
    assert!(
        manifest["extensions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| !e.is_object()),
        "{what}: the Settings page crashes on extension objects"
    );
    // A page the server does not serve answers no 2xx body the UI could
    // misread.
    let middleware = get(addr, "/ojs/v1/middleware").await;
    assert!(
        !(200..300).contains(&middleware.status),
        "{what}: {:?}",
        middleware.body
    );
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_page_reads_its_fields_on_the_embedded_default() {
    every_page_reads_its_fields(None, "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_page_reads_its_fields_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("pages");
    let config = crate::ojs_api_worker::rabbit_config(&rabbit.url, &prefix);
    every_page_reads_its_fields(Some(config), "RabbitMQ").await;
}
