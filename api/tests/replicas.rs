//! Two `Api` replicas in process sharing a job store on a real PostgreSQL
//! and one in-memory broker, on one hand-moved clock: what only shows over
//! minutes of service time runs in seconds. Each case prints what it
//! counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_api::clock::ManualClock;
use ojs_api::worker::Fetch;
use ojs_api::{Api, ApiSettings, Job};
use ojs_queue::QueueAdapter;
use serde_json::json;
use tokio::sync::watch;

struct Replica {
    api: Arc<Api>,
    /// Sending `true` stops its loops without letting go of anything it
    /// holds in the store (the cron role stays its until its lease runs
    /// out): as a process killed.
    stop: watch::Sender<bool>,
}

async fn replica(
    url: &str,
    schema: &str,
    dir: &std::path::Path,
    adapter: Arc<dyn QueueAdapter>,
    clock: Arc<ManualClock>,
) -> Replica {
    let settings = ApiSettings {
        state_dir: dir.to_path_buf(),
        postgres: Some(ojs_api::store::PostgresSettings {
            url: ojs_core::redact::Secret::new(url.to_owned()),
            password: None,
            schema: schema.to_owned(),
            connections: 4,
        }),
        ..ApiSettings::default()
    };
    let api = Api::open_with_clock(settings, adapter, "memory", clock)
        .await
        .unwrap();
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(api.clone().run(stopped));
    Replica { api, stop }
}

/// Two replicas on a fresh schema, one broker and one clock (starting now).
struct Pair {
    a: Replica,
    b: Replica,
    clock: Arc<ManualClock>,
    _schema: ojs_bridge_tests::postgres::TestSchema,
    _dir: ojs_bridge_tests::tempdir::TempDir,
}

impl Pair {
    /// `None` where PostgreSQL is not there (and not required).
    async fn start(name: &str) -> Option<Pair> {
        let url = ojs_bridge_tests::postgres::find()?;
        let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
        let dir = ojs_bridge_tests::tempdir::TempDir::new(name);
        let broker: Arc<dyn QueueAdapter> = Arc::new(ojs_adapter_memory::MemoryAdapter::new(
            ojs_adapter_memory::MemoryConfig::default(),
        ));
        let clock = Arc::new(ManualClock::new(
            DateTime::from_timestamp_millis(Utc::now().timestamp_millis()).unwrap(),
        ));
        let mut two = Vec::new();
        for side in ["a", "b"] {
            two.push(
                replica(
                    &url,
                    &schema.name,
                    &dir.path().join(side),
                    broker.clone(),
                    clock.clone(),
                )
                .await,
            );
        }
        let b = two.pop()?;
        let a = two.pop()?;
        Some(Pair {
            a,
            b,
            clock,
            _schema: schema,
            _dir: dir,
        })
    }
}

async fn drain(api: &Api, queue: &str) -> Vec<Job> {
    let grant = api.tokens().identify(None).unwrap();
    let mut out = Vec::new();
    loop {
        let jobs = api
            .fetch(
                &grant,
                Fetch {
                    queues: vec![queue.to_owned()],
                    count: 100,
                    worker_id: None,
                    visibility: None,
                    wait: Duration::from_millis(500),
                },
            )
            .await
            .unwrap();
        if jobs.is_empty() {
            return out;
        }
        for job in &jobs {
            api.ack(&grant, &job.envelope.id, None).await.unwrap();
        }
        out.extend(jobs);
    }
}

/// Stored jobs of `queue` (the slots fired), through `api`.
async fn stored(api: &Api, queue: &str) -> usize {
    let grant = api.tokens().identify(None).unwrap();
    let stats = api.queue_stats(&grant, queue).await.unwrap();
    stats.by_state.values().map(|n| *n as usize).sum()
}

/// Waits (wall time, at most 10 s) until `queue` holds `n` jobs.
async fn until_stored(api: &Api, queue: &str, n: usize) {
    for _ in 0..100 {
        if stored(api, queue).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "{queue}: {} jobs stored, {n} expected",
        stored(api, queue).await
    );
}

/// Five minutes of a cron of every minute on two replicas, the replica
/// firing it killed halfway: one job per minute, none twice, none missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_minutes_of_a_minutely_cron_through_the_death_of_the_firing_replica_fire_each_tick_once(
) {
    let Some(url) = ojs_bridge_tests::postgres::find() else {
        return;
    };
    let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
    let dir = ojs_bridge_tests::tempdir::TempDir::new("replica-cron-minutes");
    let broker: Arc<dyn QueueAdapter> = Arc::new(ojs_adapter_memory::MemoryAdapter::new(
        ojs_adapter_memory::MemoryConfig::default(),
    ));
    // Half a minute past a minute, two hours back (what the service
    // publishes is not in the broker's future).
    let wall = Utc::now() - chrono::Duration::hours(2);
    let start: DateTime<Utc> =
        DateTime::from_timestamp((wall.timestamp() / 60) * 60 + 30, 0).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let a = replica(
        &url,
        &schema.name,
        &dir.path().join("a"),
        broker.clone(),
        clock.clone(),
    )
    .await;
    let grant = a.api.tokens().identify(None).unwrap();
    a.api
        .register_cron(
            &grant,
            json!({"name": "minutely", "cron": "* * * * *", "type": "cron.tick",
                   "queue": "ticks", "overlap_policy": "allow"}),
        )
        .await
        .unwrap();
    // A fires the first two minutes alone; B joins for the third.
    for tick in 1..=2 {
        clock.advance(Duration::from_secs(60));
        until_stored(&a.api, "ticks", tick).await;
    }
    let b = replica(
        &url,
        &schema.name,
        &dir.path().join("b"),
        broker.clone(),
        clock.clone(),
    )
    .await;
    clock.advance(Duration::from_secs(60));
    until_stored(&b.api, "ticks", 3).await;
    // A holds the role: killed now, B takes it when A's lease has run out
    // on the service's clock (10 s, less than a minute).
    a.stop.send(true).unwrap();
    for tick in 4..=5 {
        clock.advance(Duration::from_secs(60));
        until_stored(&b.api, "ticks", tick).await;
    }
    // Another pass or two: nothing more fires before the next minute.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let jobs = drain(&b.api, "ticks").await;
    let slots: BTreeSet<String> = jobs
        .iter()
        .map(|j| {
            j.envelope.meta["cron_triggered_at"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    println!(
        "a minutely cron over 5 minutes on two replicas, the firing one killed after 3: ticks 5, stored {}, fetched {}, distinct slots {}",
        stored(&b.api, "ticks").await,
        jobs.len(),
        slots.len()
    );
    assert_eq!(jobs.len(), 5, "one job per tick: {slots:?}");
    assert_eq!(slots.len(), 5, "no tick fired twice: {slots:?}");
    // Each fire recorded `cron.triggered` once, naming its job.
    let page = b
        .api
        .events(
            &grant,
            ojs_api::store::EventFilter {
                types: vec!["cron.triggered".into()],
                limit: 100,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut fired: Vec<String> = page
        .events
        .iter()
        .map(|e| e.body["data"]["job_id"].as_str().unwrap().to_owned())
        .collect();
    let mut fetched: Vec<String> = jobs.iter().map(|j| j.envelope.id.clone()).collect();
    fired.sort();
    fetched.sort();
    assert_eq!(fired, fetched, "one cron.triggered per job fired");
    assert!(page.events.iter().all(|e| e.body["subject"] == "minutely"));
    let _ = b.stop.send(true);
}

/// A paused queue holds 1,000 jobs pushed through both replicas; resumed
/// through one of them, every job comes out once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holding_1000_jobs_and_its_resume_lose_none() {
    let Some(pair) = Pair::start("replica-pause").await else {
        return;
    };
    let (a, b, clock) = (pair.a, pair.b, pair.clock);
    let grant = a.api.tokens().identify(None).unwrap();
    a.api.pause_queue(&grant, "held").await.unwrap();
    let mut sent = BTreeSet::new();
    for round in 0..10 {
        let through = if round % 2 == 0 { &a } else { &b };
        let jobs = (0..100)
            .map(|i| {
                ojs_api::job::from_json(
                    json!({"type": "held.job", "args": [round, i], "options": {"queue": "held"}}),
                    ojs_api::clock::Clock::now(clock.as_ref()),
                )
                .unwrap()
            })
            .collect();
        for job in through.api.push(&grant, jobs).await.unwrap() {
            sent.insert(job.envelope.id);
        }
    }
    // B reads the pause from the store: neither hands anything out.
    assert!(drain(&b.api, "held").await.is_empty(), "paused on B");
    assert!(drain(&a.api, "held").await.is_empty(), "paused on A");
    b.api.resume_queue(&grant, "held").await.unwrap();
    let mut got: Vec<String> = drain(&a.api, "held")
        .await
        .into_iter()
        .map(|j| j.envelope.id)
        .collect();
    got.extend(
        drain(&b.api, "held")
            .await
            .into_iter()
            .map(|j| j.envelope.id),
    );
    let distinct: BTreeSet<&String> = got.iter().collect();
    let lost = sent.iter().filter(|id| !distinct.contains(id)).count();
    println!(
        "pause holding 1,000 jobs on two replicas, then resume: sent {}, received {}, duplicated {}, lost {lost}",
        sent.len(),
        got.len(),
        got.len() - distinct.len()
    );
    assert_eq!((sent.len(), got.len(), lost), (1000, 1000, 0));
    let _ = a.stop.send(true);
    let _ = b.stop.send(true);
}

/// A replica dies holding the one job a key lets run at once; its broker
/// copy comes back to the other replica, which runs it once its lease has
/// run out: the dead run holds no place of the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limited_job_a_dead_replica_held_runs_again_through_the_other() {
    let Some(pair) = Pair::start("replica-rate-held").await else {
        return;
    };
    let (a, b, clock) = (pair.a, pair.b, pair.clock);
    let fetch = |wait_ms| Fetch {
        queues: vec!["solo".into()],
        count: 1,
        worker_id: None,
        visibility: None,
        wait: Duration::from_millis(wait_ms),
    };
    {
        let grant = a.api.tokens().identify(None).unwrap();
        let job = ojs_api::job::from_json(
            json!({"type": "one.at.a.time", "args": [],
                   "options": {"queue": "solo", "rate_limit": {"concurrency": 1}}}),
            a.api.now(),
        )
        .unwrap();
        a.api.push_all(&grant, vec![job]).await.unwrap();
        assert_eq!(a.api.fetch(&grant, fetch(2_000)).await.unwrap().len(), 1);
    }
    // A dies holding it: its delivery goes back to the broker.
    a.stop.send(true).unwrap();
    drop(a);
    clock.advance(Duration::from_secs(60));
    let grant = b.api.tokens().identify(None).unwrap();
    let mut again = Vec::new();
    for _ in 0..20 {
        again = b.api.fetch(&grant, fetch(500)).await.unwrap();
        if !again.is_empty() {
            break;
        }
        clock.advance(Duration::from_secs(1));
    }
    println!(
        "a concurrency-1 job held by a replica that died: handed out again {}",
        again.len()
    );
    assert_eq!(
        again.len(),
        1,
        "the job runs again through the other replica"
    );
    let _ = b.stop.send(true);
}
