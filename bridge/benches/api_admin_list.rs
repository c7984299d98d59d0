//! The admin job list over a large store, through `ojs-bridge run` (the
//! release binary in a process of its own) on the embedded default, then
//! with the store on PostgreSQL (`OJS_BRIDGE_TEST_POSTGRES_URL`, a schema
//! of the run's own; `OJS_ADMIN_BENCH_ONLY=embedded|postgres` runs one): JOBS
//! jobs (default 1,000,000) are pushed in batches of 100 over ten queues
//! and five types (untimed; one in seven scheduled in the next century), a
//! thousand of one queue completed; then each
//! listing the admin UI's Jobs and Scheduled pages make, and the Dashboard's
//! statistics and queue list, is asked 100 times
//! on one keep-alive connection, a page of 50, and its latency taken.
//!
//! Each case ends with one JSON line: `{"bench":"api_admin_list","case":…,
//! "jobs":…,"p50_ms":…,"p99_ms":…,"peak_rss_mib":…}` (cases on PostgreSQL
//! start with `postgres `).
//!
//! `cargo bench -p ojs-bridge --bench api_admin_list [-- JOBS]`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{connect, daemon, get_json, post, rss_mib};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

const FILLERS: usize = 8;
const QUEUES: usize = 10;
const TYPES: usize = 5;
const ASKS: usize = 100;

/// One job in this many is scheduled (the Scheduled page's): prime to
/// `QUEUES`, so every queue has some.
const SCHEDULED_EVERY: usize = 7;

/// When the `i`-th of `n` jobs is due: in the next century (none comes due
/// during the run), in an order unlike the pushes' (a multiplicative
/// scramble by a prime), so a listing by due time is not the one by creation.
fn scheduled_at(i: usize, n: usize) -> String {
    let base = chrono::DateTime::parse_from_rfc3339("2100-01-01T00:00:00Z").unwrap();
    let scrambled = (i as u64).wrapping_mul(7_919) % (n as u64).max(1);
    (base + chrono::Duration::seconds(scrambled as i64))
        .to_utc()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// `n` jobs, 100 a request, `FILLERS` at a time.
async fn fill(addr: SocketAddr, n: usize) -> Duration {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..FILLERS {
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            loop {
                let start = next.fetch_add(100, Ordering::Relaxed);
                if start >= n {
                    break;
                }
                let jobs: Vec<_> = (start..n.min(start + 100))
                    .map(|i| {
                        let mut job = json!({"type": format!("report.kind{}", i % TYPES),
                                             "args": [i],
                                             "options": {"queue": format!("q{}", i % QUEUES)}});
                        if i % SCHEDULED_EVERY == 0 {
                            job["scheduled_at"] = json!(scheduled_at(i, n));
                        }
                        job
                    })
                    .collect();
                let (status, body) =
                    post(&mut sender, "/ojs/v1/jobs/batch", json!({ "jobs": jobs })).await;
                assert_eq!(status, 201, "{body}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

async fn complete(addr: SocketAddr, queue: &str, n: usize) {
    let mut sender = connect(addr).await;
    let mut done = 0;
    while done < n {
        let (status, body) = post(
            &mut sender,
            "/ojs/v1/workers/fetch",
            json!({"queues": [queue], "count": 100, "wait_ms": 1000}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        for job in body["jobs"].as_array().unwrap() {
            let (status, body) = post(
                &mut sender,
                "/ojs/v1/workers/ack",
                json!({"job_id": job["id"]}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            done += 1;
        }
    }
}

fn main() {
    let jobs = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000usize);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let only = std::env::var("OJS_ADMIN_BENCH_ONLY").unwrap_or_default();
    let embedded = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n";
    if only.is_empty() || only == "embedded" {
        runtime.block_on(run("embedded", "", embedded, jobs, None));
    }
    if only.is_empty() || only == "postgres" {
        let Some(url) = ojs_bridge_tests::postgres::find() else {
            println!("PostgreSQL: no server; the postgres cases are skipped");
            return;
        };
        let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
        let config = format!(
            "{embedded}state = \"{url}\"\nstate_schema = \"{}\"\n",
            schema.name
        );
        runtime.block_on(run("postgres", "postgres ", &config, jobs, Some(&schema)));
    }
}

/// Fills a store and asks it every listing; on PostgreSQL (`schema`) also
/// again after `VACUUM ANALYZE` (what autovacuum does after a bulk load:
/// statistics for the planner, and a visibility map that lets a count read
/// the index alone).
async fn run(
    store: &str,
    prefix: &str,
    config: &str,
    jobs: usize,
    schema: Option<&ojs_bridge_tests::postgres::TestSchema>,
) {
    {
        let server = daemon(config);
        let addr = server.addr;
        let took = fill(addr, jobs).await;
        println!(
            "admin job list ({store} store): {jobs} jobs pushed in {:.1} s ({:.0} jobs/s), {QUEUES} queues, {TYPES} types",
            took.as_secs_f64(),
            jobs as f64 / took.as_secs_f64()
        );
        complete(addr, "q0", 1_000).await;
        let mut sender = connect(addr).await;
        let mut rounds = vec![prefix.to_owned()];
        if schema.is_some() {
            rounds.push(format!("{prefix}vacuumed "));
        }
        for round in rounds {
            if round.contains("vacuumed") {
                if let Some(schema) = schema {
                    let began = Instant::now();
                    schema
                        .execute(&format!("VACUUM ANALYZE \"{}\".jobs", schema.name))
                        .unwrap();
                    println!(
                        "  VACUUM ANALYZE of the jobs table took {:.1} s",
                        began.elapsed().as_secs_f64()
                    );
                }
            }
            for (case, path) in [
                ("newest", "/ojs/v1/admin/jobs?page=1&per_page=50"),
                ("queue", "/ojs/v1/admin/jobs?queue=q3&page=1&per_page=50"),
                (
                    "queue prefix",
                    "/ojs/v1/admin/jobs?queue=q*&page=1&per_page=50",
                ),
                (
                    "state common",
                    "/ojs/v1/admin/jobs?state=available&page=1&per_page=50",
                ),
                (
                    "state rare",
                    "/ojs/v1/admin/jobs?state=completed&page=1&per_page=50",
                ),
                (
                    "queue and state",
                    "/ojs/v1/admin/jobs?queue=q0&state=completed&page=1&per_page=50",
                ),
                (
                    "type",
                    "/ojs/v1/admin/jobs?type=report.kind2&page=1&per_page=50",
                ),
                ("page 100", "/ojs/v1/admin/jobs?page=100&per_page=50"),
                (
                    "scheduled page",
                    "/ojs/v1/admin/jobs?state=scheduled&per_page=50&sort=scheduled_at&order=asc",
                ),
                ("dashboard stats", "/ojs/v1/admin/stats"),
                ("queue list", "/ojs/v1/admin/queues?page=1&per_page=50"),
            ] {
                let mut latencies = Vec::with_capacity(ASKS);
                let mut total = 0;
                for _ in 0..ASKS {
                    let began = Instant::now();
                    let (status, body) = get_json(&mut sender, path).await;
                    latencies.push(began.elapsed());
                    assert_eq!(status, 200, "{path}: {body}");
                    total = body["pagination"]["total"].as_u64().unwrap_or(0);
                }
                latencies.sort_unstable();
                let at = |q: f64| {
                    latencies[((ASKS as f64 * q) as usize).min(ASKS - 1)].as_secs_f64() * 1e3
                };
                let rss = rss_mib(server.child.id(), "VmHWM:");
                println!(
                    "  {round}{case:<18} total {total:>8}   p50 {:>8.2} ms   p99 {:>8.2} ms",
                    at(0.5),
                    at(0.99)
                );
                println!(
                    "{}",
                    json!({"bench": "api_admin_list", "case": format!("{round}{case}"), "jobs": jobs,
                       "p50_ms": at(0.5), "p99_ms": at(0.99), "peak_rss_mib": rss})
                );
            }
        }
    }
}
