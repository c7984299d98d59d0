//! One suite for the job store, run on both of its backends: SQLite in a
//! fresh directory, and PostgreSQL (`OJS_BRIDGE_TEST_POSTGRES_URL`, the
//! server `scripts/brokers.sh up` makes sure of) in a fresh schema. Each
//! case is written once against [`Store`]; `sqlite::<case>` and
//! `postgres::<case>` run it on each.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use ojs_api::model::cron::CronJob;
use ojs_api::model::rate::{Limits, OnLimit, Rate, RateLimit};
use ojs_api::model::unique::Uniqueness;
use ojs_api::model::EventData;
use ojs_api::roster::WorkerRecord;
use ojs_api::store::{
    take_rate, Durability, EventFilter, Inserted, JobQuery, Lease, PostgresSettings, RateDecision,
    Settle, Store, StoreError,
};
use ojs_api::Job;
use ojs_core::redact::Secret;
use ojs_core::JobState;
use serde_json::json;

/// What keeps a store's place alive until the case ends.
enum Place {
    Dir(#[allow(dead_code)] ojs_bridge_tests::tempdir::TempDir),
    Schema(#[allow(dead_code)] ojs_bridge_tests::postgres::TestSchema),
}

async fn sqlite() -> (Store, Place) {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("job-store");
    let store = Store::open(dir.path(), Durability::Process).await.unwrap();
    (store, Place::Dir(dir))
}

async fn postgres() -> Option<(Store, Place)> {
    let url = ojs_bridge_tests::postgres::find()?;
    let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
    let store = Store::connect(&PostgresSettings {
        url: Secret::new(url),
        password: None,
        schema: schema.name.clone(),
        connections: 4,
    })
    .await
    .unwrap();
    Some((store, Place::Schema(schema)))
}

fn job(body: serde_json::Value) -> Job {
    ojs_api::job::from_json(body, Utc::now()).unwrap()
}

fn plain(queue: &str) -> Job {
    job(json!({"type": "email.send", "args": [1], "options": {"queue": queue}}))
}

fn ids(jobs: &[Job]) -> Vec<String> {
    jobs.iter().map(|j| j.envelope.id.clone()).collect()
}

/// A later time, in whole milliseconds (what the store keeps).
fn in_ms(ms: i64) -> DateTime<Utc> {
    let t = Utc::now() + chrono::Duration::milliseconds(ms);
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap()
}

async fn inserts_are_all_or_nothing(store: &Store, _: &Place) {
    let first = plain("mail");
    let id = first.envelope.id.clone();
    store.insert(vec![first]).await.unwrap();
    let fresh = plain("mail");
    let fresh_id = fresh.envelope.id.clone();
    let mut again = plain("mail");
    again.envelope.id = id.clone();
    match store.insert(vec![fresh, again]).await {
        Err(StoreError::Duplicate(d)) => assert_eq!(d, id),
        other => panic!("{other:?}"),
    }
    assert!(store.get(fresh_id).await.unwrap().is_none());
    // Concurrent inserts each get their own answer.
    let handles: Vec<_> = (0..32)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.insert(vec![plain("mail")]).await })
        })
        .collect();
    for h in handles {
        assert!(h.await.unwrap().is_ok());
    }
}

async fn a_job_reads_back_as_it_was_stored(store: &Store, _: &Place) {
    let mut j = job(json!({
        "type": "report.build",
        "args": [{"month": "2026-01"}, 7],
        "meta": {"tenant": "a"},
        "options": {"queue": "reports", "priority": 5, "tags": ["x"],
                    "retry": {"max_attempts": 4, "on_exhaustion": "dead_letter"}}
    }));
    j.extra.insert("note".into(), json!({"kept": true}));
    store.insert(vec![j.clone()]).await.unwrap();
    let read = store.get(j.envelope.id.clone()).await.unwrap().unwrap();
    assert_eq!(read, j);
}

/// Recovery (`unpublished`) hands out what a stopped process stored but
/// never published, and a retried dead letter whose publish was not
/// confirmed (`publishing` mark); never a job being published right now.
/// (When a job counts as abandoned differs: SQLite's after a reopen of the
/// file, tested in its module; PostgreSQL's a minute after it was stored,
/// tested with replicas.)
async fn recovery_finds_retried_dead_letters_not_jobs_being_published(store: &Store, _: &Place) {
    let (a, b) = (plain("mail"), plain("mail"));
    store.insert(vec![a.clone(), b.clone()]).await.unwrap();
    assert!(store.unpublished(100).await.unwrap().is_empty());
    store.published(vec![a.envelope.id.clone()]);
    let id = b.envelope.id.clone();
    store
        .run(move |tx| {
            let mut job = tx.load(&id)?;
            job.extra.insert("publishing".into(), json!(true));
            tx.save(&job, None)
        })
        .await
        .unwrap();
    assert_eq!(ids(&store.unpublished(100).await.unwrap()), ids(&[b]));
}

async fn a_failed_transition_writes_nothing(store: &Store, _: &Place) {
    let j = plain("mail");
    let id = j.envelope.id.clone();
    store.insert(vec![j.clone()]).await.unwrap();
    let before = store.events(all_events()).await.unwrap().events.len();
    let target = id.clone();
    let failed = store
        .run(move |tx| {
            let mut job = tx.load(&target)?;
            job.envelope.state = Some(JobState::Completed);
            tx.save(&job, Some(Utc::now()))?;
            tx.event(
                "job.completed",
                &job.envelope,
                Utc::now(),
                &EventData::empty(),
            )?;
            Err::<(), _>(StoreError::NotFound("on purpose".into()))
        })
        .await;
    assert!(matches!(failed, Err(StoreError::NotFound(_))), "{failed:?}");
    assert_eq!(store.get(id).await.unwrap().unwrap(), j);
    assert_eq!(
        store.events(all_events()).await.unwrap().events.len(),
        before
    );
}

async fn cancel_follows_the_state_machine(store: &Store, _: &Place) {
    let j = plain("mail");
    let id = j.envelope.id.clone();
    store.insert(vec![j]).await.unwrap();
    let (previous, cancelled) = store.cancel(id.clone(), Utc::now()).await.unwrap();
    assert_eq!(previous, JobState::Available);
    assert_eq!(cancelled.state(), JobState::Cancelled);
    match store.cancel(id.clone(), Utc::now()).await {
        Err(StoreError::WrongState { current, .. }) => assert_eq!(current, JobState::Cancelled),
        other => panic!("{other:?}"),
    }
    match store.cancel("no-such-job".into(), Utc::now()).await {
        Err(StoreError::NotFound(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.get(id.clone()).await.unwrap().map(|j| j.state()),
        Some(JobState::Cancelled)
    );
    let kinds: Vec<String> = store
        .events(EventFilter {
            limit: 100,
            ..EventFilter::default()
        })
        .await
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.body["job_id"] == id.as_str())
        .map(|e| e.body["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["job.enqueued", "job.cancelled"]);
}

async fn scheduled_jobs_come_due_in_their_order(store: &Store, _: &Place) {
    let soon = in_ms(200);
    let later = in_ms(60_000);
    let at = |t: DateTime<Utc>| {
        job(
            json!({"type": "a.b", "args": [], "options": {"scheduled_at": ojs_api::job::timestamp(t)}}),
        )
    };
    let (first, second) = (at(soon), at(later));
    assert_eq!(first.state(), JobState::Scheduled);
    store
        .insert(vec![second.clone(), first.clone()])
        .await
        .unwrap();
    assert_eq!(store.next_due().await.unwrap(), Some(soon));
    assert!(store.due(Utc::now(), 10).await.unwrap().is_empty());
    let due = store.due(soon, 10).await.unwrap();
    assert_eq!(ids(&due), ids(std::slice::from_ref(&first)));
    store.promote(ids(&due), Utc::now()).await.unwrap();
    let promoted = store.get(first.envelope.id.clone()).await.unwrap().unwrap();
    assert_eq!(promoted.state(), JobState::Available);
    assert!(promoted.envelope.enqueued_at.is_some());
    assert_eq!(store.next_due().await.unwrap(), Some(later));
    // A job gone meanwhile is skipped, not an error.
    store
        .promote(vec!["gone".into()], Utc::now())
        .await
        .unwrap();
}

async fn dead_letters_are_listed_oldest_first(store: &Store, _: &Place) {
    let (a, b, c) = (plain("mail"), plain("mail"), plain("mail"));
    store
        .insert(vec![a.clone(), b.clone(), c.clone()])
        .await
        .unwrap();
    for id in [a.envelope.id.clone(), c.envelope.id.clone()] {
        store
            .run(move |tx| {
                let mut job = tx.load(&id)?;
                job.envelope.state = Some(JobState::Discarded);
                job.extra.insert("dead_letter".into(), json!(true));
                tx.save(&job, Some(Utc::now()))
            })
            .await
            .unwrap();
    }
    let dead = store.dead_letters().await.unwrap();
    assert_eq!(ids(&dead), ids(&[a, c]));
    assert!(dead.iter().all(Job::is_dead_letter));
}

async fn prune_removes_finished_jobs_past_retention(store: &Store, _: &Place) {
    let (done, waiting) = (plain("mail"), plain("mail"));
    store
        .insert(vec![done.clone(), waiting.clone()])
        .await
        .unwrap();
    store
        .cancel(done.envelope.id.clone(), Utc::now())
        .await
        .unwrap();
    // Nothing finished before a time in the past.
    store
        .prune(Utc::now() - chrono::Duration::hours(1))
        .await
        .unwrap();
    assert!(store.get(done.envelope.id.clone()).await.unwrap().is_some());
    let removed = store.prune(in_ms(1_000)).await.unwrap();
    assert!(removed >= 1, "{removed}");
    assert!(store.get(done.envelope.id.clone()).await.unwrap().is_none());
    assert!(store
        .get(waiting.envelope.id.clone())
        .await
        .unwrap()
        .is_some());
}

fn all_events() -> EventFilter {
    EventFilter {
        limit: 1_000,
        ..EventFilter::default()
    }
}

async fn events_are_read_by_filter_and_cursor(store: &Store, _: &Place) {
    let jobs = [plain("q1"), plain("q2"), plain("q1"), plain("q1")];
    for j in &jobs {
        store.insert(vec![j.clone()]).await.unwrap();
    }
    let q1 = |after: i64, limit: usize| EventFilter {
        after,
        queues: vec!["q1".into()],
        limit,
        ..EventFilter::default()
    };
    let page = store.events(q1(0, 100)).await.unwrap();
    let seen: Vec<&str> = page
        .events
        .iter()
        .map(|e| e.body["job_id"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = [&jobs[0], &jobs[2], &jobs[3]]
        .iter()
        .map(|j| j.envelope.id.as_str())
        .collect();
    assert_eq!(seen, want);
    // One at a time, each read after the last one's cursor.
    let mut after = 0;
    let mut one_by_one = Vec::new();
    loop {
        let page = store.events(q1(after, 1)).await.unwrap();
        one_by_one.extend(page.events.iter().map(|e| e.seq));
        if page.events.is_empty() && !page.has_more {
            break;
        }
        assert!(page.cursor > after, "the cursor moves on");
        after = page.cursor;
    }
    let seqs: Vec<i64> = page.events.iter().map(|e| e.seq).collect();
    assert_eq!(one_by_one, seqs);
    let types = store
        .events(EventFilter {
            types: vec!["job.cancelled".into()],
            limit: 100,
            ..EventFilter::default()
        })
        .await
        .unwrap();
    assert!(types.events.is_empty());
}

fn worker(value: serde_json::Value) -> WorkerRecord {
    serde_json::from_value(value).unwrap()
}

async fn worker_records_round_trip(store: &Store, _: &Place) {
    let done = store
        .run(|tx| {
            assert_eq!(tx.worker("w1")?, None);
            tx.save_worker(
                "w1",
                Utc::now(),
                &worker(json!({"id": "w1", "queues": ["a"]})),
            )?;
            tx.save_worker("w2", Utc::now(), &worker(json!({"id": "w2"})))?;
            tx.save_worker(
                "w1",
                Utc::now(),
                &worker(json!({"id": "w1", "queues": ["b"], "hostname": "h"})),
            )?;
            let one = tx.worker("w1")?;
            let removed = tx.remove_worker("w2")?;
            let removed_again = tx.remove_worker("w2")?;
            Ok((one, removed, removed_again, tx.workers()?))
        })
        .await
        .unwrap();
    let w1 = worker(json!({"id": "w1", "queues": ["b"], "hostname": "h"}));
    assert_eq!(done.0, Some(w1.clone()));
    assert_eq!(
        done.0.as_ref().map(|w| w.queues.clone()),
        Some(vec!["b".to_owned()])
    );
    assert!(done.1 && !done.2);
    assert_eq!(done.3, [w1]);
}

async fn leases_are_kept_only_where_replicas_share_the_store(store: &Store, place: &Place) {
    let j = plain("mail");
    let id = j.envelope.id.clone();
    store.insert(vec![j]).await.unwrap();
    let lease = Lease {
        holder: "replica-a".into(),
        until: in_ms(30_000),
    };
    let kept = lease.clone();
    let read = store
        .run(move |tx| {
            tx.set_lease(&id, Some(&kept))?;
            tx.lease(&id)
        })
        .await
        .unwrap();
    match place {
        Place::Schema(_) => {
            assert!(store.is_shared());
            assert_eq!(store.kind(), "postgres");
            assert_eq!(read, Some(lease));
            // Settlements for the holder, in the order sent; a retry's
            // delay counts from when it was sent, not from when the
            // holder takes it.
            store
                .run(|tx| {
                    tx.send_settle("replica-a", "j1", &Settle::Retry { delay_ms: 1_000 })?;
                    tx.send_settle("replica-a", "j2", &Settle::Extend { by_ms: 1_000 })?;
                    tx.send_settle("replica-b", "j3", &Settle::Retry { delay_ms: 1_000 })?;
                    tx.send_settle("replica-a", "j4", &Settle::Ack)
                })
                .await
                .unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let taken = store.take_settles("replica-a").await.unwrap();
            let ids: Vec<&str> = taken.iter().map(|(id, _)| id.as_str()).collect();
            assert_eq!(ids, ["j1", "j2", "j4"]);
            match &taken[0].1 {
                Settle::Retry { delay_ms } => {
                    assert!(
                        *delay_ms <= 700,
                        "a retry taken 300 ms late waits {delay_ms} ms"
                    )
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(taken[1].1, Settle::Extend { by_ms: 1_000 });
            assert_eq!(taken[2].1, Settle::Ack);
            assert!(store.take_settles("replica-a").await.unwrap().is_empty());
            assert_eq!(store.take_settles("replica-b").await.unwrap().len(), 1);
        }
        Place::Dir(_) => {
            assert!(!store.is_shared());
            assert_eq!(store.kind(), "sqlite");
            assert_eq!(read, None);
            assert!(store.take_settles("replica-a").await.unwrap().is_empty());
        }
    }
    store.ping().await.unwrap();
}

async fn queues_are_listed_once_each(store: &Store, _: &Place) {
    for q in ["b", "a", "b"] {
        store.insert(vec![plain(q)]).await.unwrap();
    }
    let mut names: Vec<String> = store
        .queues()
        .await
        .unwrap()
        .into_iter()
        .map(|(q, _)| q)
        .collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
}

/// The admin API's reads: the job list's filters, paging and order, the
/// counts by queue and state, and the history's buckets.
async fn admin_reads_list_count_and_bucket_jobs(store: &Store, _: &Place) {
    let mut jobs = Vec::new();
    for (queue, job_type, n) in [
        ("mail", "mail.send", 3),
        ("mail", "mail.digest", 2),
        ("team.a", "report.build", 4),
    ] {
        for i in 0..n {
            jobs.push(job(
                json!({"type": job_type, "args": [i], "options": {"queue": queue}}),
            ));
        }
    }
    let first = jobs[0].envelope.id.clone();
    store.insert(jobs).await.unwrap();
    let now = Utc::now();
    store.cancel(first.clone(), now).await.unwrap();
    let query = |f: &dyn Fn(&mut JobQuery)| {
        let mut q = JobQuery::default();
        f(&mut q);
        q
    };
    let list = |q: JobQuery, limit: usize, offset: usize| {
        store.run(move |tx| tx.list_jobs(&q, limit, offset))
    };
    let (page, total) = list(query(&|q| q.queue = Some("mail".into())), 2, 0)
        .await
        .unwrap();
    assert_eq!((page.len(), total), (2, 5));
    let (_, total) = list(query(&|q| q.job_type = Some("mail.*".into())), 10, 0)
        .await
        .unwrap();
    assert_eq!(total, 5, "a type prefix");
    let (_, total) = list(query(&|q| q.queue = Some("team.*".into())), 10, 0)
        .await
        .unwrap();
    assert_eq!(total, 4, "a queue prefix");
    let (_, total) = list(query(&|q| q.job_type = Some("mail.send".into())), 10, 0)
        .await
        .unwrap();
    assert_eq!(total, 3, "an exact type");
    let (cancelled, total) = list(query(&|q| q.state = Some("cancelled".into())), 10, 0)
        .await
        .unwrap();
    assert_eq!(
        (total, cancelled[0].envelope.id.as_str()),
        (1, first.as_str())
    );
    let (_, total) = list(
        query(&|q| q.since = Some(now + chrono::Duration::hours(1))),
        10,
        0,
    )
    .await
    .unwrap();
    assert_eq!(total, 0, "created before `since`");
    let (oldest, _) = list(query(&|q| q.ascending = true), 1, 0).await.unwrap();
    assert_eq!(oldest[0].envelope.id, first, "oldest first");

    let counts = store
        .run(move |tx| tx.job_counts(now - chrono::Duration::minutes(1)))
        .await
        .unwrap();
    let count = |queue: &str, state: &str| {
        counts
            .by_queue
            .iter()
            .find(|(q, s, _)| q == queue && s == state)
            .map_or(0, |c| c.2)
    };
    assert_eq!(
        (
            count("mail", "available"),
            count("mail", "cancelled"),
            count("team.a", "available")
        ),
        (4, 1, 4)
    );
    assert_eq!(
        counts.finished.iter().map(|c| c.2).sum::<u64>(),
        1,
        "the cancelled job finished"
    );

    let (since, until) = (
        now - chrono::Duration::hours(1),
        now + chrono::Duration::minutes(1),
    );
    let rows = store
        .run(move |tx| tx.history(since, until, 60_000, None))
        .await
        .unwrap();
    let created: u64 = rows
        .iter()
        .filter(|(_, k, _)| k == "created")
        .map(|r| r.2)
        .sum();
    assert_eq!(created, 9);
    let rows = store
        .run(move |tx| tx.history(since, until, 60_000, Some("team.a")))
        .await
        .unwrap();
    let created: u64 = rows
        .iter()
        .filter(|(_, k, _)| k == "created")
        .map(|r| r.2)
        .sum();
    assert_eq!(created, 4, "of one queue");

    // A reset empties it all; the schema stays.
    store.run(|tx| tx.reset()).await.unwrap();
    let (_, total) = list(JobQuery::default(), 10, 0).await.unwrap();
    assert_eq!(total, 0);
    assert!(store.queues().await.unwrap().is_empty());
    store.insert(vec![plain("after")]).await.unwrap();
    let (_, total) = list(JobQuery::default(), 10, 0).await.unwrap();
    assert_eq!(total, 1, "the store takes jobs again");
}

macro_rules! on_both_backends {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let (store, place) = super::sqlite().await;
                    super::$case(&store, &place).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some((store, place)) = super::postgres().await else {
                        return;
                    };
                    super::$case(&store, &place).await;
                }
            )*
        }
    };
}

/// A second process on the same store: on PostgreSQL another pool on the
/// same schema (a replica), on SQLite the same store (one process only).
async fn replica(store: &Store, place: &Place) -> Store {
    match place {
        Place::Schema(schema) => Store::connect(&PostgresSettings {
            url: Secret::new(ojs_bridge_tests::postgres::find().unwrap()),
            password: None,
            schema: schema.name.clone(),
            connections: 4,
        })
        .await
        .unwrap(),
        Place::Dir(_) => store.clone(),
    }
}

fn unique(on_conflict: &str, extra: serde_json::Value) -> (Job, Option<Uniqueness>) {
    let mut policy = json!({"keys": ["type", "args"], "on_conflict": on_conflict});
    if let (Some(p), Some(e)) = (policy.as_object_mut(), extra.as_object()) {
        p.extend(e.clone());
    }
    let j = job(json!({"type": "report.build", "args": [7],
                       "options": {"queue": "u", "unique": policy}}));
    let u = Uniqueness::of(&j.envelope).unwrap();
    (j, u)
}

async fn of_concurrent_pushes_of_one_unique_key_exactly_one_is_stored(
    store: &Store,
    place: &Place,
) {
    let other = replica(store, place).await;
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let s = if i % 2 == 0 {
                store.clone()
            } else {
                other.clone()
            };
            tokio::spawn(async move {
                let (j, u) = unique("reject", json!({}));
                s.insert_unique(vec![j], vec![u]).await
            })
        })
        .collect();
    let (mut stored, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(inserted) => {
                assert!(matches!(inserted[..], [Inserted::Stored(_)]));
                stored += 1;
            }
            Err(StoreError::Taken { .. }) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    println!(
        "50 concurrent pushes of one key through two processes: stored {stored}, refused {refused}"
    );
    assert_eq!((stored, refused), (1, 49));
}

async fn a_unique_key_s_holder_is_answered_replaced_or_freed(store: &Store, _: &Place) {
    let (first, u) = unique("ignore", json!({}));
    let first_id = first.envelope.id.clone();
    store.insert_unique(vec![first], vec![u]).await.unwrap();
    // ignore: the holder answers, nothing stored.
    let (again, u) = unique("ignore", json!({}));
    let again_id = again.envelope.id.clone();
    match &store.insert_unique(vec![again], vec![u]).await.unwrap()[..] {
        [Inserted::Existing(holder)] => assert_eq!(holder.envelope.id, first_id),
        other => panic!("{other:?}"),
    }
    assert!(store.get(again_id).await.unwrap().is_none());
    // replace: the holder is cancelled, the new job stored.
    let (new, u) = unique("replace", json!({}));
    let new_id = new.envelope.id.clone();
    store.insert_unique(vec![new], vec![u]).await.unwrap();
    let old = store.get(first_id.clone()).await.unwrap().unwrap();
    assert_eq!(old.state(), JobState::Cancelled);
    assert_eq!(
        store.get(new_id.clone()).await.unwrap().unwrap().state(),
        JobState::Available
    );
    // A holder outside the policy's states does not hold the key.
    let (other, u) = unique("reject", json!({"states": ["scheduled"]}));
    store.insert_unique(vec![other], vec![u]).await.unwrap();
    // Two jobs of one insert with one key: the second meets the first.
    let (a, ua) = unique("reject", json!({"keys": ["type", "queue"]}));
    let (b, ub) = unique("reject", json!({"keys": ["type", "queue"]}));
    let (a_id, b_id) = (a.envelope.id.clone(), b.envelope.id.clone());
    match store.insert_unique(vec![a, b], vec![ua, ub]).await {
        Err(StoreError::Taken {
            index, existing, ..
        }) => {
            assert_eq!(index, 1);
            assert_eq!(existing.envelope.id, a_id);
        }
        other => panic!("{other:?}"),
    }
    assert!(store.get(a_id).await.unwrap().is_none());
    assert!(store.get(b_id).await.unwrap().is_none());
}

async fn cron_jobs_round_trip_and_are_removed(store: &Store, _: &Place) {
    let now = in_ms(0);
    let mut cron = CronJob::from_json(
        json!({"name": "nightly", "cron": "0 3 * * *", "timezone": "Europe/Berlin",
               "type": "report.build", "args": [{"day": 1}], "queue": "reports"}),
        now,
    )
    .unwrap();
    let saved = cron.clone();
    store.run(move |tx| tx.save_cron(&saved)).await.unwrap();
    let other = CronJob::from_json(
        json!({"name": "a-first", "cron": "@hourly", "type": "t.x"}),
        now,
    )
    .unwrap();
    store.run(move |tx| tx.save_cron(&other)).await.unwrap();
    let read = store.run(|tx| tx.cron("nightly")).await.unwrap();
    assert_eq!(read.as_ref(), Some(&cron));
    // Written again: replaced, not added.
    cron.run_count = 3;
    cron.last_job_id = Some("j".into());
    let saved = cron.clone();
    store.run(move |tx| tx.save_cron(&saved)).await.unwrap();
    let all = store.run(|tx| tx.crons()).await.unwrap();
    let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["a-first", "nightly"]);
    assert_eq!(all[1], cron);
    assert!(store.run(|tx| tx.remove_cron("nightly")).await.unwrap());
    assert!(!store.run(|tx| tx.remove_cron("nightly")).await.unwrap());
    assert_eq!(store.run(|tx| tx.cron("nightly")).await.unwrap(), None);
}

async fn a_role_has_one_holder_until_its_time_runs_out(store: &Store, place: &Place) {
    let other = replica(store, place).await;
    let now = in_ms(0);
    let until = now + chrono::Duration::seconds(10);
    let take = |s: &Store, who: &'static str, at: DateTime<Utc>, until: DateTime<Utc>| {
        let s = s.clone();
        async move {
            s.run(move |tx| tx.hold_role("cron", who, at, until))
                .await
                .unwrap()
        }
    };
    assert!(take(store, "a", now, until).await);
    // Renewed by its holder, refused to another while it runs.
    assert!(take(store, "a", now, until).await);
    assert!(!take(&other, "b", now + chrono::Duration::seconds(9), until).await);
    // Run out: another takes it, and the first cannot renew.
    let later = now + chrono::Duration::seconds(11);
    assert!(take(&other, "b", later, later + chrono::Duration::seconds(10)).await);
    assert!(!take(store, "a", later, later + chrono::Duration::seconds(10)).await);
    // Of concurrent takers of a free role, one wins.
    let free = later + chrono::Duration::seconds(60);
    let handles: Vec<_> = ["c", "d", "e", "f", "g", "h"]
        .into_iter()
        .enumerate()
        .map(|(i, who)| {
            let s = if i % 2 == 0 {
                store.clone()
            } else {
                other.clone()
            };
            tokio::spawn(async move {
                s.run(move |tx| {
                    tx.hold_role("cron", who, free, free + chrono::Duration::seconds(10))
                })
                .await
                .unwrap()
            })
        })
        .collect();
    let mut winners = 0;
    for h in handles {
        winners += usize::from(h.await.unwrap());
    }
    assert_eq!(winners, 1);
}

fn rate(limit: u32) -> Limits {
    Limits {
        rate: Some(Rate {
            limit,
            period: "PT1S".into(),
        }),
        ..Limits::default()
    }
}

async fn take(store: &Store, job: &Job, limits: &[RateLimit], now: DateTime<Utc>) -> RateDecision {
    let (job, limits) = (job.clone(), limits.to_vec());
    store
        .run(move |tx| take_rate(tx, &job, &limits, now))
        .await
        .unwrap()
}

async fn a_rate_window_admits_its_limit_across_stores(store: &Store, place: &Place) {
    let other = replica(store, place).await;
    let limit = RateLimit {
        key: "queue:limited".into(),
        limits: rate(5),
        on_limit: OnLimit::Wait,
    };
    let now = in_ms(0);
    let handles: Vec<_> = (0..20)
        .map(|i| {
            let s = if i % 2 == 0 {
                store.clone()
            } else {
                other.clone()
            };
            let limit = limit.clone();
            let job = plain("limited");
            tokio::spawn(async move { take(&s, &job, &[limit], now).await })
        })
        .collect();
    let mut taken = 0;
    let mut until = None;
    for h in handles {
        match h.await.unwrap() {
            RateDecision::Started => taken += 1,
            RateDecision::Limited { until: at, .. } => until = Some(at),
        }
    }
    assert_eq!(
        taken, 5,
        "the limit, of 20 concurrent takes through two stores"
    );
    assert_eq!(until, Some(now + chrono::Duration::seconds(1)));
    // The next window.
    let later = now + chrono::Duration::seconds(1);
    let l = [limit.clone()];
    assert_eq!(
        take(store, &plain("limited"), &l, later).await,
        RateDecision::Started
    );
    // Another key has its own window.
    let mine = [RateLimit {
        key: "tenant:1".into(),
        ..limit.clone()
    }];
    assert_eq!(
        take(&other, &plain("limited"), &mine, now).await,
        RateDecision::Started
    );
    // Keys are pruned a day past the retention cut, not before.
    let full = [RateLimit {
        limits: rate(1),
        ..limit
    }];
    assert!(matches!(
        take(store, &plain("limited"), &full, later).await,
        RateDecision::Limited { .. }
    ));
    store
        .prune(later + chrono::Duration::hours(23))
        .await
        .unwrap();
    assert!(matches!(
        take(store, &plain("limited"), &full, later).await,
        RateDecision::Limited { .. }
    ));
    // Filed jobs keep their key: unfiled, it goes at the next prune.
    let (a, b) = store.run(|tx| tx.rate_jobs("queue:limited")).await.unwrap();
    assert_eq!((a, b), (6, 0), "the jobs admitted under it run");
    let gone = plain("limited");
    let alone = [RateLimit {
        key: "tenant:2".into(),
        ..full[0].clone()
    }];
    assert_eq!(
        take(store, &gone, &alone, later).await,
        RateDecision::Started
    );
    let id = gone.envelope.id.clone();
    store.run(move |tx| tx.unfile_rate_job(&id)).await.unwrap();
    store
        .prune(later + chrono::Duration::hours(25))
        .await
        .unwrap();
    assert!(
        matches!(
            take(store, &plain("limited"), &full, later).await,
            RateDecision::Limited { .. }
        ),
        "a key jobs still run under is kept"
    );
    let keys = store.run(|tx| tx.rate_keys(0, 100)).await.unwrap();
    let names: Vec<&str> = keys.0.iter().map(|(k, _)| k.as_str()).collect();
    assert!(!names.contains(&"tenant:2"), "{names:?}");
}

async fn concurrency_counts_running_jobs_across_stores(store: &Store, place: &Place) {
    let other = replica(store, place).await;
    let limit = RateLimit {
        key: "tenant:7".into(),
        limits: Limits {
            concurrency: Some(3),
            ..Limits::default()
        },
        on_limit: OnLimit::Wait,
    };
    let now = in_ms(0);
    let jobs: Vec<Job> = (0..12).map(|_| plain("conc")).collect();
    let handles: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(i, job)| {
            let s = if i % 2 == 0 {
                store.clone()
            } else {
                other.clone()
            };
            let (job, limit) = (job.clone(), limit.clone());
            tokio::spawn(
                async move { (job.envelope.id.clone(), take(&s, &job, &[limit], now).await) },
            )
        })
        .collect();
    let mut running = Vec::new();
    for h in handles {
        if let (id, RateDecision::Started) = h.await.unwrap() {
            running.push(id);
        }
    }
    assert_eq!(
        running.len(),
        3,
        "of 12 concurrent starts through two stores"
    );
    let counts = store.run(|tx| tx.rate_jobs("tenant:7")).await.unwrap();
    assert_eq!(counts, (3, 0));
    // One finishes: a place frees.
    let done = running[0].clone();
    store
        .run(move |tx| tx.unfile_rate_job(&done))
        .await
        .unwrap();
    assert_eq!(
        take(&other, &plain("conc"), std::slice::from_ref(&limit), now).await,
        RateDecision::Started
    );
    assert!(matches!(
        take(store, &plain("conc"), &[limit], now).await,
        RateDecision::Limited { .. }
    ));
}

/// The counts the admin statistics read are kept as jobs are written, by
/// every writer of the store (on PostgreSQL two pools, each connection
/// counting into rows of its own), through inserts, moves, removals,
/// prunes and resets: they always say what counting the table says.
async fn job_counts_follow_every_write(store: &Store, place: &Place) {
    let other = replica(store, place).await;
    let counted = |store: &Store| {
        let store = store.clone();
        async move {
            let counts = store
                .run(|tx| tx.job_counts(Utc::now()))
                .await
                .unwrap()
                .by_queue;
            let mut kept: Vec<(String, String, u64)> = counts
                .into_iter()
                .filter(|(q, _, _)| q.starts_with("counted"))
                .collect();
            kept.sort();
            // What counting the table says, queue by queue and state by
            // state (a state the counts miss shows too).
            let mut listed = Vec::new();
            for queue in ["counted", "counted.b"] {
                for state in [
                    "active",
                    "available",
                    "cancelled",
                    "completed",
                    "discarded",
                    "pending",
                    "retryable",
                    "scheduled",
                ] {
                    let q = JobQuery {
                        queue: Some(queue.into()),
                        state: Some(state.into()),
                        ..JobQuery::default()
                    };
                    let (_, total) = store.run(move |tx| tx.list_jobs(&q, 1, 0)).await.unwrap();
                    if total > 0 {
                        listed.push((queue.to_owned(), state.to_owned(), total));
                    }
                }
            }
            assert_eq!(kept, listed, "the kept counts are the table's");
            kept.into_iter()
                .map(|(q, s, n)| format!("{q}/{s}={n}"))
                .collect::<Vec<_>>()
        }
    };
    let jobs: Vec<Job> = (0..3).map(|_| plain("counted")).collect();
    store.insert(jobs.clone()).await.unwrap();
    store
        .cancel(jobs[0].envelope.id.clone(), Utc::now())
        .await
        .unwrap();
    assert_eq!(
        counted(store).await,
        ["counted/available=2", "counted/cancelled=1"]
    );
    // A transition that fails moves nothing; one that reads the counts
    // after a write of its own sees it (the embedded store writes them at
    // its commit).
    let target = jobs[1].envelope.id.clone();
    let failed = store
        .run(move |tx| {
            tx.insert_seen(&plain("counted"))?;
            let mut job = tx.load(&target)?;
            job.envelope.state = Some(JobState::Completed);
            tx.save(&job, Some(Utc::now()))?;
            Err::<(), _>(StoreError::NotFound("on purpose".into()))
        })
        .await;
    assert!(matches!(failed, Err(StoreError::NotFound(_))), "{failed:?}");
    let extra = plain("counted");
    let extra_id = extra.envelope.id.clone();
    let during = store
        .run(move |tx| {
            tx.insert_seen(&extra)?;
            tx.job_counts(Utc::now())
        })
        .await
        .unwrap()
        .by_queue;
    assert!(
        during.contains(&("counted".into(), "available".into(), 3)),
        "{during:?}"
    );
    assert_eq!(
        counted(store).await,
        ["counted/available=3", "counted/cancelled=1"]
    );
    store.remove(vec![extra_id]).await.unwrap();
    // Another writer (a replica's pool on PostgreSQL) counts too.
    let more: Vec<Job> = (0..2).map(|_| plain("counted.b")).collect();
    other.insert(more.clone()).await.unwrap();
    other
        .cancel(more[0].envelope.id.clone(), Utc::now())
        .await
        .unwrap();
    assert_eq!(
        counted(store).await,
        [
            "counted/available=2",
            "counted/cancelled=1",
            "counted.b/available=1",
            "counted.b/cancelled=1"
        ]
    );
    // A job the broker refused is removed; one deleted in a transaction.
    store
        .remove(vec![jobs[1].envelope.id.clone()])
        .await
        .unwrap();
    let gone = more[1].envelope.id.clone();
    other.run(move |tx| tx.delete(&gone)).await.unwrap();
    // Finished jobs past retention are pruned (on PostgreSQL the rows of
    // connections that closed are folded into one as well).
    store.prune(in_ms(1_000)).await.unwrap();
    assert_eq!(counted(store).await, ["counted/available=1"]);
    if let Place::Schema(schema) = place {
        assert_eq!(
            schema
                .count(
                    "SELECT count(*) FROM job_counts WHERE slot <> 0 \
                     AND slot NOT IN (SELECT pid FROM pg_stat_activity)"
                )
                .unwrap(),
            0,
            "no counter of a closed connection is left after a prune"
        );
    }
    store.run(|tx| tx.reset()).await.unwrap();
    assert!(
        counted(store).await.is_empty(),
        "a reset empties the counts"
    );
    store.insert(vec![plain("counted")]).await.unwrap();
    assert_eq!(counted(store).await, ["counted/available=1"]);
}

on_both_backends!(
    job_counts_follow_every_write,
    admin_reads_list_count_and_bucket_jobs,
    a_rate_window_admits_its_limit_across_stores,
    concurrency_counts_running_jobs_across_stores,
    cron_jobs_round_trip_and_are_removed,
    a_role_has_one_holder_until_its_time_runs_out,
    of_concurrent_pushes_of_one_unique_key_exactly_one_is_stored,
    a_unique_key_s_holder_is_answered_replaced_or_freed,
    inserts_are_all_or_nothing,
    a_job_reads_back_as_it_was_stored,
    recovery_finds_retried_dead_letters_not_jobs_being_published,
    a_failed_transition_writes_nothing,
    cancel_follows_the_state_machine,
    scheduled_jobs_come_due_in_their_order,
    dead_letters_are_listed_oldest_first,
    prune_removes_finished_jobs_past_retention,
    events_are_read_by_filter_and_cursor,
    worker_records_round_trip,
    leases_are_kept_only_where_replicas_share_the_store,
    queues_are_listed_once_each,
);

/// A migration PostgreSQL refuses says PostgreSQL's own reason and code
/// (the client's text alone is "db error"), and changes nothing.
#[tokio::test]
async fn a_refused_migration_names_what_postgres_said() {
    let Some(url) = ojs_bridge_tests::postgres::find() else {
        return;
    };
    let schema = ojs_bridge_tests::postgres::TestSchema::new(&url);
    let name = &schema.name;
    // A version-5 schema that already has a relation version 6 makes.
    schema
        .execute(&format!(
            "CREATE SCHEMA \"{name}\"; SET search_path TO \"{name}\";
             CREATE TABLE schema_version (version integer NOT NULL);
             INSERT INTO schema_version (version) VALUES (5);
             CREATE TABLE rate_windows (key text);
             CREATE TABLE rate_keys (key text);"
        ))
        .unwrap();
    let opened = Store::connect(&PostgresSettings {
        url: Secret::new(url),
        password: None,
        schema: name.clone(),
        connections: 1,
    })
    .await;
    let Err(e) = opened else {
        panic!("a schema that cannot be migrated was opened");
    };
    let said = e.to_string();
    assert!(
        said.contains("relation \"rate_keys\" already exists") && said.contains("42P07"),
        "{said}"
    );
    assert_eq!(
        schema
            .count(&format!(
                "SELECT max(version)::bigint FROM \"{name}\".schema_version"
            ))
            .unwrap(),
        5,
        "the failed migration is rolled back"
    );
}
