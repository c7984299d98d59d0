//! Several `ojs-bridge run` replicas sharing one job store on PostgreSQL
//! act as one OJS server: a job pushed through one is read, fetched,
//! acknowledged and failed through any other; an ACK reaching a replica
//! that does not hold the broker delivery gets to the broker through the
//! store; a replica killed with active jobs loses none; PostgreSQL going
//! away makes requests fail as retryable and loses nothing acknowledged.
//! Real processes, RabbitMQ, PostgreSQL; each prints sent / completed /
//! duplicated / lost (lost 0).

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ojs_bridge_tests::brokers::{find, rabbitmq_messages, unique_queue, Broker};
use ojs_bridge_tests::fault_proxy::{FaultProxy, Mode};
use ojs_bridge_tests::postgres::{self, TestSchema};
use serde_json::{json, Value};

use crate::ojs_server::{get, post_json, push_all, tally, work_across, OjsServer};

/// Two replicas' configuration: RabbitMQ queues under `prefix`, job state
/// in `schema` on `pg_url`.
fn config(rabbit: &str, prefix: &str, pg_url: &str, schema: &str) -> String {
    format!(
        "[adapters.rabbit]\nurl = \"{rabbit}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n\
         [api]\nadapter = \"rabbit\"\nstate = \"{pg_url}\"\nstate_schema = \"{schema}\"\n"
    )
}

struct Setup {
    rabbit: String,
    prefix: String,
    pg_url: String,
    schema: TestSchema,
}

async fn setup(name: &str) -> Option<Setup> {
    let rabbit = find(Broker::RabbitMq).await?;
    let pg_url = postgres::find()?;
    Some(Setup {
        rabbit: rabbit.url,
        prefix: unique_queue(name),
        schema: TestSchema::new(&pg_url),
        pg_url,
    })
}

impl Setup {
    fn config(&self) -> String {
        config(&self.rabbit, &self.prefix, &self.pg_url, &self.schema.name)
    }

    /// Messages RabbitMQ holds for the OJS queue `queue` (ready and
    /// unacknowledged).
    fn broker_messages(&self, queue: &str) -> Option<u64> {
        let name = format!("{}.{queue}", self.prefix);
        rabbitmq_messages(&name)
    }
}

/// Exactly `n` jobs fetched through `addr` (waits up to 30 s).
async fn fetch_n(
    addr: SocketAddr,
    queue: &str,
    n: usize,
    worker: &str,
    visibility_ms: u64,
) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < n && Instant::now() < deadline {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": [queue], "count": n - got.len(), "worker_id": worker,
                    "visibility_timeout_ms": visibility_ms, "wait_ms": 500}),
        )
        .await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        for j in a.json()["jobs"].as_array().cloned().unwrap_or_default() {
            got.push(j["id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(got.len(), n, "{n} jobs fetched within 30 s");
    got
}

async fn ack(addr: SocketAddr, id: &str) -> u16 {
    post_json(
        addr,
        "/ojs/v1/workers/ack",
        &json!({"job_id": id, "result": {"ok": true}}),
    )
    .await
    .status
}

async fn state(addr: SocketAddr, id: &str) -> Value {
    let a = get(addr, &format!("/ojs/v1/jobs/{id}")).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.json()["job"].clone()
}

/// Waits until RabbitMQ holds no message of `queue` (every delivery was
/// settled on the broker), up to 20 s; what it held last.
async fn broker_drains(setup: &Setup, queue: &str) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = setup.broker_messages(queue);
        if n == Some(0) || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgresql_act_as_one_server() {
    let Some(setup) = setup("replicas").await else {
        return;
    };
    let config = setup.config();
    // Started together: one makes the schema, the other waits for it, and
    // PostgreSQL's notices about what exists already are no log lines at
    // the default level.
    let (a, b) = tokio::join!(
        OjsServer::start(Some(&config)),
        OjsServer::start(Some(&config))
    );
    let queue = "shared";
    let sent = push_all(a.addr, queue, 60, json!({})).await;
    for log in [a.log(), b.log()] {
        assert!(
            !log.contains("NOTICE") && !log.contains("skipping"),
            "a PostgreSQL notice at the default level:\n{log}"
        );
    }

    // Pushed through A, read through B.
    for id in sent.iter().take(5) {
        assert_eq!(state(b.addr, id).await["state"], "available");
    }

    // Fetched through B (B holds the deliveries), settled through A: the
    // ACK and the NACK travel to B through the store, which settles the
    // broker's deliveries.
    let held_by_b = fetch_n(b.addr, queue, 6, "w-b", 30_000).await;
    for id in &held_by_b[..3] {
        assert_eq!(ack(a.addr, id).await, 200);
        assert_eq!(state(b.addr, id).await["state"], "completed");
    }
    for id in &held_by_b[3..] {
        let n = post_json(
            a.addr,
            "/ojs/v1/workers/nack",
            &json!({"job_id": id, "error": {"code": "flaky", "message": "try again", "retryable": true}}),
        )
        .await;
        assert_eq!(n.status, 200, "{:?}", n.body);
        assert_eq!(n.json()["state"], "retryable", "{:?}", n.body);
    }

    // Two ACKs of one job through two replicas at once: one wins, the
    // other is 409.
    let contested = fetch_n(a.addr, queue, 1, "w-a", 30_000).await.remove(0);
    let (first, second) = tokio::join!(ack(a.addr, &contested), ack(b.addr, &contested));
    let mut statuses = [first, second];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 409], "two concurrent ACKs: one wins");

    // A heartbeat through A keeps a job held by B past its visibility; a
    // job without one goes back to the queue.
    let pair = fetch_n(b.addr, queue, 2, "w-beat", 2_000).await;
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let h = post_json(
            a.addr,
            "/ojs/v1/workers/heartbeat",
            &json!({"worker_id": "w-beat", "active_jobs": [pair[0]], "visibility_timeout_ms": 2_000}),
        )
        .await;
        assert_eq!(h.status, 200, "{:?}", h.body);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    assert_eq!(
        state(a.addr, &pair[0]).await["state"],
        "active",
        "heartbeat through another replica keeps the job"
    );
    assert_eq!(ack(a.addr, &pair[0]).await, 200);
    assert_eq!(
        ack(a.addr, &pair[1]).await,
        409,
        "a job that was not heartbeat went back"
    );

    // Everything else, fetched and acked across both replicas (the failed
    // ones come back after their backoff; the released one at once).
    let mut completed: Vec<String> = held_by_b[..3].to_vec();
    completed.push(contested);
    completed.push(pair[0].clone());
    let rest = work_across(&[a.addr, b.addr], queue, 4, sent.len() - completed.len()).await;
    completed.extend(rest);
    let (duplicated, lost) = tally("two replicas on PostgreSQL", &sent, &completed);
    assert_eq!(lost, 0, "jobs never completed");
    assert_eq!(duplicated, 0, "a job completed twice");
    for id in sent.iter().step_by(7) {
        assert_eq!(state(b.addr, id).await["state"], "completed");
    }
    // Every delivery was settled on the broker while both still run:
    // nothing is left on (or held from) the queue.
    assert_eq!(
        broker_drains(&setup, queue).await,
        Some(0),
        "RabbitMQ still holds messages of the queue"
    );
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_replica_holding_500_active_jobs_loses_none() {
    let Some(setup) = setup("replica-kill").await else {
        return;
    };
    let config = setup.config();
    let a = OjsServer::start(Some(&config)).await;
    let b = OjsServer::start(Some(&config)).await;
    let queue = "held";
    let sent = push_all(b.addr, queue, 600, json!({})).await;
    let leased_at = chrono::Utc::now();
    let held: HashSet<String> = fetch_n(a.addr, queue, 500, "doomed", 5_000)
        .await
        .into_iter()
        .collect();
    // The worker of A's jobs is gone with A; B must hand them out again
    // once their visibility passed, not before.
    drop(a.kill());
    let completed = work_across(&[b.addr], queue, 4, sent.len()).await;
    let (duplicated, lost) = tally(
        "kill -9 of a replica holding 500 active jobs",
        &sent,
        &completed,
    );
    assert_eq!(lost, 0, "jobs lost");
    assert_eq!(duplicated, 0, "jobs completed twice");
    let id = held.iter().next().unwrap();
    let job = state(b.addr, id).await;
    assert_eq!(job["state"], "completed");
    assert_eq!(job["attempt"], 2, "{job}");
    // Handed out again only once its visibility (5 s from the FETCH) had
    // passed: B held the redelivered copies until then.
    for id in &held {
        let job = state(b.addr, id).await;
        let started =
            chrono::DateTime::parse_from_rfc3339(job["started_at"].as_str().unwrap()).unwrap();
        assert!(
            started >= leased_at + chrono::Duration::seconds(5),
            "{id} handed out again at {started}, before its visibility from {leased_at} passed"
        );
    }
    assert_eq!(broker_drains(&setup, queue).await, Some(0));
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_jobs_are_published_once_by_two_replicas() {
    let Some(setup) = setup("replica-sched").await else {
        return;
    };
    let config = setup.config();
    let a = OjsServer::start(Some(&config)).await;
    let b = OjsServer::start(Some(&config)).await;
    let queue = "later";
    let at = chrono::Utc::now() + chrono::Duration::seconds(2);
    let sent = push_all(
        a.addr,
        queue,
        50,
        json!({"scheduled_at": at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)}),
    )
    .await;
    assert_eq!(state(b.addr, &sent[0]).await["state"], "scheduled");
    // Both replicas' schedulers race for the due jobs: the broker must get
    // one copy of each, counted on RabbitMQ before any worker takes one.
    let deadline = Instant::now() + Duration::from_secs(15);
    while setup.broker_messages(queue) != Some(50) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        setup.broker_messages(queue),
        Some(50),
        "each scheduled job published once"
    );
    let completed = work_across(&[a.addr, b.addr], queue, 2, sent.len()).await;
    let (duplicated, lost) = tally("scheduled jobs, two replicas", &sent, &completed);
    assert_eq!((duplicated, lost), (0, 0));
    assert_eq!(broker_drains(&setup, queue).await, Some(0));
    let started = setup
        .schema
        .count("SELECT count(*) FROM events WHERE type = 'job.started'")
        .unwrap();
    assert_eq!(started, 50, "each scheduled job handed out once");
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_gone_for_20_s_fails_requests_as_retryable_and_loses_nothing() {
    let Some(setup) = setup("replica-pgdown").await else {
        return;
    };
    let upstream = ojs_bridge_tests::brokers::probe_address(&setup.pg_url)
        .parse::<SocketAddr>()
        .unwrap_or_else(|_| "127.0.0.1:5432".parse().unwrap());
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let via_proxy = setup
        .pg_url
        .replacen(&upstream.to_string(), &proxy.host_port(), 1);
    assert_ne!(
        via_proxy, setup.pg_url,
        "the URL names the server by address"
    );
    let config = config(&setup.rabbit, &setup.prefix, &via_proxy, &setup.schema.name);
    let a = OjsServer::start(Some(&config)).await;
    let queue = "steady";
    // Clients push all along; what got 201 must all be fetched at the end.
    let accepted = Arc::new(Mutex::new(Vec::<String>::new()));
    let refused = Arc::new(Mutex::new(BTreeMap::<u16, usize>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..4 {
        let (accepted, refused, stop, addr) =
            (accepted.clone(), refused.clone(), stop.clone(), a.addr);
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let r = post_json(
                    addr,
                    "/ojs/v1/jobs",
                    &json!({"type": "steady.push", "args": [c, n], "options": {"queue": queue}}),
                )
                .await;
                match r.status {
                    201 => accepted
                        .lock()
                        .unwrap()
                        .push(r.json()["job"]["id"].as_str().unwrap().to_owned()),
                    s => {
                        assert_eq!(r.json()["error"]["retryable"], true, "{s}: {:?}", r.body);
                        *refused.lock().unwrap().entry(s).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set(Mode::Reset);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Health says so while it lasts; a FETCH fails as retryable too.
    let h = get(a.addr, "/ojs/v1/health").await;
    assert_eq!(h.status, 503, "{:?}", h.body);
    assert_eq!(h.json()["store"]["status"], "unavailable", "{:?}", h.body);
    let f = post_json(
        a.addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "count": 1}),
    )
    .await;
    assert!(f.status == 503 || f.status == 200, "{:?}", f.body);
    if f.status == 503 {
        assert_eq!(f.json()["error"]["retryable"], true);
    }
    tokio::time::sleep(Duration::from_secs(17)).await;
    proxy.set(Mode::Pass);
    // Work resumes.
    let deadline = Instant::now() + Duration::from_secs(20);
    let during = accepted.lock().unwrap().len();
    while accepted.lock().unwrap().len() < during + 50 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let sent = accepted.lock().unwrap().clone();
    assert!(
        sent.len() > during,
        "pushes succeed again after PostgreSQL is back"
    );
    let refused = refused.lock().unwrap().clone();
    println!("PostgreSQL gone for 20 s: refused (retryable) {refused:?}");
    assert!(
        refused.values().sum::<usize>() > 0,
        "pushes were refused while PostgreSQL was gone"
    );
    // Health follows within its check interval.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut health = get(a.addr, "/ojs/v1/health").await;
    while health.status != 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        health = get(a.addr, "/ojs/v1/health").await;
    }
    assert_eq!(health.status, 200, "{:?}", health.body);
    let completed = work_across(&[a.addr], queue, 2, sent.len()).await;
    let (duplicated, lost) = tally("PostgreSQL gone for 20 s under pushes", &sent, &completed);
    assert_eq!(lost, 0, "a job answered 201 was lost");
    assert_eq!(duplicated, 0);
    a.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_direct_workers_through_either_replica() {
    let Some(setup) = setup("directed").await else {
        return;
    };
    let config = setup.config();
    let a = OjsServer::start(Some(&config)).await;
    let b = OjsServer::start(Some(&config)).await;
    crate::ojs_api_worker::operators_direct_workers(a.addr, b.addr, "two replicas").await;
    a.stop();
    b.stop();
}

/// A job store made by the previous build (schema version 1, before the
/// workers' records) is migrated by the first replica that starts, and
/// keeps its jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_schema_is_migrated_keeping_its_jobs() {
    let Some(setup) = setup("migrated").await else {
        return;
    };
    let config = setup.config();
    let server = OjsServer::start(Some(&config)).await;
    let sent = push_all(server.addr, "kept", 3, json!({})).await;
    server.stop();
    let schema = &setup.schema.name;
    setup
        .schema
        .execute(&format!(
            "SET search_path TO \"{schema}\"; DROP TABLE workers; DROP TABLE unique_keys;
             DROP TABLE crons; DROP TABLE paused_queues; DROP TABLE rate_keys; DROP TABLE rate_jobs;
             DROP TABLE queue_configs; DROP TABLE leaders; DROP TABLE workflows; DROP TABLE system;
             DROP INDEX jobs_created; DROP INDEX jobs_queue_created; DROP INDEX jobs_state_created;
             DROP INDEX jobs_type_created; ALTER TABLE jobs DROP COLUMN job_type;
             DROP TRIGGER jobs_counted_in ON jobs; DROP TRIGGER jobs_counted_out ON jobs;
             DROP TRIGGER jobs_counted_moved ON jobs; DROP FUNCTION count_jobs(); DROP TABLE job_counts;
             DELETE FROM schema_version; INSERT INTO schema_version (version) VALUES (1);"
        ))
        .unwrap();
    let server = OjsServer::start(Some(&config)).await;
    assert_eq!(
        setup
            .schema
            .count("SELECT max(version)::bigint FROM schema_version")
            .unwrap(),
        8
    );
    let beat = post_json(
        server.addr,
        "/ojs/v1/workers/heartbeat",
        &json!({"worker_id": "after-migration"}),
    )
    .await;
    assert_eq!(beat.status, 200, "{:?}", beat.body);
    assert_eq!(
        setup.schema.count("SELECT count(*) FROM workers").unwrap(),
        1
    );
    // The tables of later versions are there (cron jobs, paused queues).
    assert_eq!(
        post_json(server.addr, "/ojs/v1/queues/kept/pause", &json!({}))
            .await
            .status,
        200
    );
    assert_eq!(
        setup
            .schema
            .count("SELECT count(*) FROM paused_queues")
            .unwrap(),
        1
    );
    assert_eq!(
        setup
            .schema
            .count("SELECT count(*) FROM workflows")
            .unwrap(),
        0,
        "version 5's tables are there"
    );
    for table in ["rate_keys", "rate_jobs", "queue_configs"] {
        assert_eq!(
            setup
                .schema
                .count(&format!("SELECT count(*) FROM {table}"))
                .unwrap(),
            0,
            "version 6's {table} is there"
        );
    }
    assert_eq!(
        setup
            .schema
            .count(&format!(
                "SELECT count(*) FROM pg_indexes WHERE schemaname = '{schema}' \
                 AND indexname IN ('jobs_created', 'jobs_queue_created', 'jobs_state_created', \
                                   'jobs_type_created')"
            ))
            .unwrap(),
        4,
        "the indexes of the admin job list (versions 6 and 7) are there"
    );
    // Version 7 filled the type of the jobs it found.
    assert_eq!(
        setup
            .schema
            .count("SELECT count(*) FROM jobs WHERE job_type = 'work.item'")
            .unwrap(),
        3,
        "the kept jobs' types"
    );
    // Version 8 counted the jobs it found, and its triggers count the next.
    let counted = "SELECT coalesce(sum(n), 0)::bigint FROM job_counts WHERE queue = 'kept' AND state = 'available'";
    assert_eq!(
        setup.schema.count(counted).unwrap(),
        3,
        "the kept jobs counted"
    );
    push_all(server.addr, "kept", 2, json!({})).await;
    assert_eq!(setup.schema.count(counted).unwrap(), 5, "new jobs counted");
    for id in &sent {
        let a = get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
        assert_eq!(a.json()["job"]["state"], "available", "{:?}", a.body);
    }
    server.stop();
}

/// Other people's database: a role that may only read and write the job
/// store's tables (made beforehand by a role that may create them) runs a
/// replica; with a schema nobody made, the same role gets an error that
/// says what it lacks, and no password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_create_anything_works_on_a_schema_made_for_it() {
    let Some(setup) = setup("limited").await else {
        return;
    };
    // Made by the owner's role.
    let server = OjsServer::start(Some(&setup.config())).await;
    server.stop();
    let schema = &setup.schema.name;
    let role = format!("ojs_limited_{}", &schema[2..14]);
    const PASSWORD: &str = "limited-role-secret";
    setup
        .schema
        .execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN PASSWORD '{PASSWORD}';
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\";
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" TO \"{role}\";
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA \"{schema}\" TO \"{role}\";"
        ))
        .unwrap();
    let (_, host) = setup.pg_url.split_once('@').unwrap();
    let limited_url = format!("postgres://{role}:{PASSWORD}@{host}");
    let limited = config(&setup.rabbit, &setup.prefix, &limited_url, schema);
    let server = OjsServer::start(Some(&limited)).await;
    let sent = push_all(server.addr, "limited", 50, json!({})).await;
    let completed = work_across(&[server.addr], "limited", 2, sent.len()).await;
    let (duplicated, lost) = tally("a role that cannot create anything", &sent, &completed);
    assert_eq!((duplicated, lost), (0, 0));
    let beat = post_json(
        server.addr,
        "/ojs/v1/workers/heartbeat",
        &json!({"worker_id": "limited-worker"}),
    )
    .await;
    assert_eq!(beat.status, 200, "{:?}", beat.body);
    server.stop();

    // A schema nobody made: the role may not make it.
    let other = format!("{schema}_unmade");
    let unmade = config(&setup.rabbit, &setup.prefix, &limited_url, &other);
    let dir = ojs_bridge_tests::tempdir::TempDir::new("limited");
    std::fs::write(dir.path().join("bridge.toml"), unmade).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .env("OJS_BRIDGE_HTTP_LISTEN", "127.0.0.1:0")
        .args(["run", "--config", "bridge.toml"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("may not create the job store's schema"),
        "the error says what the role lacks: {text}"
    );
    assert!(!text.contains(PASSWORD), "{text}");
    println!(
        "a role without CREATE: 50 jobs pushed, fetched, completed; an unmade schema: {}",
        text.lines().last().unwrap_or("")
    );
    setup
        .schema
        .execute(&format!(
            "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE; DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\";"
        ))
        .unwrap();
}

/// Fetches and acknowledges through `addr` every job of `queue` until
/// `want` were taken or 45 s passed; the fetched jobs.
async fn drain_jobs(addr: SocketAddr, queue: &str, want: usize) -> Vec<Value> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(45);
    while got.len() < want && Instant::now() < deadline {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": [queue], "count": 50, "worker_id": "drain", "wait_ms": 500}),
        )
        .await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        for job in a.json()["jobs"].as_array().cloned().unwrap_or_default() {
            assert_eq!(ack(addr, job["id"].as_str().unwrap()).await, 200);
            got.push(job);
        }
    }
    got
}

/// A cron job of every second on two replicas, then through the death of
/// the replica firing it: each slot fires at most once (one job, one id),
/// and firing goes on through the replica left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_slot_fires_once_across_replicas_and_firing_survives_kill_9() {
    let Some(setup) = setup("replica-cron").await else {
        return;
    };
    let config = setup.config();
    let a = OjsServer::start(Some(&config)).await;
    let b = OjsServer::start(Some(&config)).await;
    let queue = "ticks";
    let r = post_json(
        a.addr,
        "/ojs/v1/cron",
        &json!({"name": "every-second", "cron": "* * * * * *", "type": "cron.tick",
                "queue": queue, "overlap_policy": "allow"}),
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    tokio::time::sleep(Duration::from_secs(5)).await;
    // One of the two fires; A goes (it may be that one).
    drop(a.kill());
    tokio::time::sleep(Duration::from_secs(3)).await;
    // B fires now; C joins, then B is killed while it holds the role: C
    // must take over once B's lease has run out.
    let c = OjsServer::start(Some(&config)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let b_killed = chrono::Utc::now();
    drop(b.kill());
    tokio::time::sleep(Duration::from_secs(16)).await;
    let gone =
        crate::ojs_server::try_request(c.addr, "DELETE", "/ojs/v1/cron/every-second", b"").await;
    assert_eq!(gone, Some(200));
    // What was stored (a job stored by a killed replica but not published
    // is published by recovery) is what must come out, once each.
    let stored = setup
        .schema
        .count("SELECT count(*) FROM jobs WHERE queue = 'ticks'")
        .unwrap();
    let jobs = drain_jobs(c.addr, queue, usize::try_from(stored).unwrap()).await;
    let ids: Vec<String> = jobs
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    let (duplicated, lost) = tally("cron slots across replicas", &ids, &ids);
    let mut slots: Vec<&str> = jobs
        .iter()
        .map(|j| j["meta"]["cron_triggered_at"].as_str().unwrap())
        .collect();
    slots.sort_unstable();
    let distinct = slots.iter().collect::<HashSet<_>>().len();
    println!(
        "cron across replicas: stored {stored}, fetched {}, distinct slots {distinct}, duplicated {duplicated}, lost {lost}",
        jobs.len()
    );
    assert_eq!(jobs.len() as i64, stored, "every stored job fetched");
    assert_eq!(duplicated, 0);
    assert_eq!(distinct, jobs.len(), "no slot fired twice: {slots:?}");
    // About 26 s of slots, less the gaps while a lease ran out (10 s at
    // most, twice); it fired before and after each kill.
    assert!(jobs.len() >= 8, "{slots:?}");
    let last = chrono::DateTime::parse_from_rfc3339(slots.last().unwrap()).unwrap();
    assert!(
        last > b_killed + chrono::Duration::seconds(5),
        "firing went on after the firing replica died: last slot {last}"
    );
    c.stop();
}
