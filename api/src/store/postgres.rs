//! The shared store: PostgreSQL, for several `ojs-bridge run` replicas
//! behind one load balancer that act as one OJS server.
//!
//! A few threads each own one connection (the synchronous client, so that
//! the transitions written for [`Tx`] run here as they run on SQLite); a
//! request takes whichever thread is free. A connection that is lost is
//! dropped and made again by the next request; while PostgreSQL cannot be
//! reached every request fails with [`StoreError::Unavailable`] at once
//! instead of waiting.
//!
//! Rows are locked (`SELECT … FOR UPDATE`) by the transition that reads
//! them, so two replicas changing one job serialise: one ACK wins, the
//! other finds the job completed.

use std::any::Any;
use std::str::FromStr;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::redact::Secret;
use ojs_core::JobState;
use postgres::error::SqlState;
use postgres::{Client, Config, NoTls, Transaction};
use tokio::sync::oneshot;

use super::sql;
use super::{
    claim_unique_keys, decode, due_ms, encode, event_body, keep_unique_keys, ms, rate_key_seen,
    record_of, record_text, state_name, stored_event, unanswered, EventFilter, EventPage, Inserted,
    Isolation, Lease, QueueJobs, RunFn, Settle, StoreError, Tx, Uniques, MAX_EVENTS_SCANNED,
    RATE_ACTIVE, RATE_WINDOW_SLACK_MS, SCHEDULE_CLAIM,
};
use super::{count_priorities, Bound, JobCounts, JobQuery, Subject};
use crate::job::Job;
use crate::model::cron::CronJob;
use crate::model::rate::KeyState;
use crate::model::workflow::Workflow;
use crate::model::EventData;
use crate::roster::WorkerRecord;

/// The schema version this build writes: 2 adds the workers' records.
const SCHEMA_VERSION: i32 = 8;
/// Taken while the schema is made or migrated: replicas starting together
/// do it once.
const MIGRATION_LOCK: i64 = 0x4f4a_5341;
/// An available job not confirmed by the broker this long after it was
/// stored belongs to a process that stopped between the two: another
/// replica publishes it.
const ORPHAN_AFTER: Duration = Duration::from_secs(60);

/// Appends one event (numbered by its sequence; the embedded store numbers
/// its own).
const INSERT_EVENT: &str = "INSERT INTO events (type, job_id, queue, job_type, time_ms, data)
     VALUES ($1, $2, $3, $4, $5, $6)";

/// Events past retention (read through `events_time`).
const PRUNE_EVENTS: &str = "DELETE FROM events WHERE time_ms < $1";

const SCHEMA_V1: &str = "
CREATE TABLE jobs (
    seq              bigserial NOT NULL,
    id               text PRIMARY KEY,
    queue            text NOT NULL,
    state            text NOT NULL,
    due_ms           bigint,
    created_ms       bigint NOT NULL,
    stored_ms        bigint NOT NULL,
    finished_ms      bigint,
    published        boolean NOT NULL,
    holder           text,
    visible_until_ms bigint,
    envelope         text NOT NULL,
    extra            text NOT NULL,
    dead             smallint NOT NULL DEFAULT 0
);
CREATE INDEX jobs_dead ON jobs (finished_ms) WHERE dead > 0;
CREATE INDEX jobs_due ON jobs (due_ms) WHERE state = 'scheduled';
CREATE INDEX jobs_finished ON jobs (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE INDEX jobs_unpublished ON jobs (stored_ms) WHERE NOT published;
CREATE TABLE queues (
    name       text PRIMARY KEY,
    created_ms bigint NOT NULL
);
CREATE TABLE events (
    seq      bigserial PRIMARY KEY,
    type     text NOT NULL,
    job_id   text NOT NULL,
    queue    text NOT NULL,
    job_type text NOT NULL,
    time_ms  bigint NOT NULL,
    data     text NOT NULL
);
CREATE INDEX events_job ON events (job_id);
CREATE INDEX events_time ON events (time_ms);
CREATE TABLE settles (
    seq    bigserial PRIMARY KEY,
    holder text NOT NULL,
    job_id text NOT NULL,
    action text NOT NULL
);
CREATE INDEX settles_holder ON settles (holder);
";

/// From version 1: the workers' records (`crate::roster`).
const MIGRATE_1_TO_2: &str = "
CREATE TABLE workers (
    id      text PRIMARY KEY,
    seen_ms bigint NOT NULL,
    record  text NOT NULL
);
";

/// Version 3: jobs filed under their unique keys.
const MIGRATE_2_TO_3: &str = "
CREATE TABLE unique_keys (
    job_id text PRIMARY KEY,
    key    text NOT NULL
);
CREATE INDEX unique_keys_key ON unique_keys (key);
";

/// Version 4: cron jobs, the roles one replica holds at a time
/// (`crate::cron`), paused queues and rate-limit windows.
const MIGRATE_3_TO_4: &str = "
CREATE TABLE crons (
    name   text PRIMARY KEY,
    record text NOT NULL
);
CREATE TABLE paused_queues (
    name      text PRIMARY KEY,
    paused_ms bigint NOT NULL
);
CREATE TABLE rate_windows (
    key      text PRIMARY KEY,
    start_ms bigint NOT NULL,
    count    bigint NOT NULL
);
CREATE TABLE leaders (
    role     text PRIMARY KEY,
    holder   text NOT NULL,
    until_ms bigint NOT NULL
);
";

/// From version 4: workflows.
const MIGRATE_4_TO_5: &str = "
CREATE TABLE workflows (
    id          text PRIMARY KEY,
    state       text NOT NULL,
    created_ms  bigint NOT NULL,
    finished_ms bigint,
    record      text NOT NULL
);
CREATE INDEX workflows_by_state ON workflows (state, created_ms);
CREATE INDEX workflows_by_created ON workflows (created_ms);
CREATE INDEX workflows_finished ON workflows (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE TABLE system (
    key   text PRIMARY KEY,
    value text NOT NULL
);
";

/// From version 5: rate-limit keys with the jobs filed under them (in
/// place of the windows, which are only ever a second to a day old),
/// queue configurations, and the indexes the admin job list reads by.
const MIGRATE_5_TO_6: &str = "
DROP TABLE rate_windows;
CREATE TABLE rate_keys (
    key     text PRIMARY KEY,
    seen_ms bigint NOT NULL,
    record  text NOT NULL
);
CREATE TABLE rate_jobs (
    job_id text NOT NULL,
    key    text NOT NULL,
    state  text NOT NULL,
    PRIMARY KEY (job_id, key)
);
CREATE INDEX rate_jobs_by_key ON rate_jobs (key, state);
CREATE TABLE queue_configs (
    name   text PRIMARY KEY,
    record text NOT NULL
);
CREATE INDEX jobs_created ON jobs (created_ms, id);
CREATE INDEX jobs_queue_created ON jobs (queue, created_ms, id);
CREATE INDEX jobs_state_created ON jobs (state, created_ms, id);
";

/// From version 6: the job's type in a column of its own, indexed as the
/// admin job list reads it (reading it out of the envelope's JSON took
/// 100 ms and more over a million jobs). Existing rows are filled once,
/// under the migration lock.
const MIGRATE_6_TO_7: &str = "
ALTER TABLE jobs ADD COLUMN job_type text;
UPDATE jobs SET job_type = envelope::jsonb ->> 'type';
CREATE INDEX jobs_type_created ON jobs (job_type, created_ms, id);
";

/// From version 7: the jobs counted by queue and state, kept by triggers
/// in the writing transaction, so the admin statistics read a row per
/// queue and state instead of counting the table. Each connection writes
/// rows of its own (`slot` = its backend's pid): concurrent transactions
/// never wait on one counter, nor lock two in opposite orders. The rows of
/// connections gone are folded into slot 0 as jobs are pruned
/// ([`FOLD_JOB_COUNTS`]). The function keeps the schema it was made in, so
/// a role with another search path counts into the right table.
const MIGRATE_7_TO_8: &str = "
CREATE TABLE job_counts (
    queue text NOT NULL,
    state text NOT NULL,
    slot  integer NOT NULL,
    n     bigint NOT NULL,
    PRIMARY KEY (queue, state, slot)
);
INSERT INTO job_counts (queue, state, slot, n)
    SELECT queue, state, 0, count(*) FROM jobs GROUP BY queue, state;
CREATE FUNCTION count_jobs() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO job_counts (queue, state, slot, n)
            VALUES (OLD.queue, OLD.state, pg_backend_pid(), -1)
            ON CONFLICT (queue, state, slot) DO UPDATE SET n = job_counts.n - 1;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO job_counts (queue, state, slot, n)
            VALUES (NEW.queue, NEW.state, pg_backend_pid(), 1)
            ON CONFLICT (queue, state, slot) DO UPDATE SET n = job_counts.n + 1;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER jobs_counted_in AFTER INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION count_jobs();
CREATE TRIGGER jobs_counted_out AFTER DELETE ON jobs
    FOR EACH ROW EXECUTE FUNCTION count_jobs();
CREATE TRIGGER jobs_counted_moved AFTER UPDATE OF queue, state ON jobs
    FOR EACH ROW WHEN (OLD.queue IS DISTINCT FROM NEW.queue OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION count_jobs();
";

/// Folds the counter rows of connections no longer open into slot 0 (one
/// replica at a time: the caller holds [`FOLD_LOCK`]), and drops counters
/// at zero.
const FOLD_JOB_COUNTS: &str = "
WITH gone AS (
    DELETE FROM job_counts
    WHERE slot <> 0 AND slot NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)
    RETURNING queue, state, n
)
INSERT INTO job_counts (queue, state, slot, n)
    SELECT queue, state, 0, sum(n) FROM gone GROUP BY queue, state
    ON CONFLICT (queue, state, slot) DO UPDATE SET n = job_counts.n + excluded.n;
DELETE FROM job_counts WHERE slot = 0 AND n = 0;
";
/// Taken (for the transaction) while counter rows are folded.
const FOLD_LOCK: i64 = 0x4f4a_5342;

/// How to reach PostgreSQL.
#[derive(Debug, Clone)]
pub struct PostgresSettings {
    /// `postgres://user:password@host:port/db` or the key=value form; a
    /// secret (it may hold the password).
    pub url: Secret,
    /// The password, when the URL does not hold it.
    pub password: Option<Secret>,
    /// The PostgreSQL schema (namespace) holding the tables, made when
    /// missing.
    pub schema: String,
    /// Connections (and threads) of this process.
    pub connections: usize,
}

impl PostgresSettings {
    /// Every problem with these settings, without connecting: the setting
    /// (`url`, `schema`, `connections`) and why.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if let Err(e) = Config::from_str(self.url.expose()) {
            problems.push(("url", e.to_string()));
        }
        if self.schema.is_empty()
            || self.schema.len() > 63
            || !self
                .schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            || self.schema.starts_with(|c: char| c.is_ascii_digit())
        {
            problems.push((
                "schema",
                format!(
                    "{:?}: lowercase letters, digits and _, at most 63, not starting with a digit",
                    self.schema
                ),
            ));
        }
        if self.connections == 0 {
            problems.push(("connections", "must be at least 1".into()));
        }
        problems
    }

    /// The first of [`PostgresSettings::problems`], if any.
    pub fn check(&self) -> Result<(), String> {
        match self.problems().into_iter().next() {
            Some((setting, why)) => Err(format!("{setting}: {why}")),
            None => Ok(()),
        }
    }
}

type Job1 = Box<dyn FnOnce(&mut Connection) + Send>;

/// The store on PostgreSQL.
#[derive(Clone)]
pub(super) struct PostgresStore {
    jobs: mpsc::Sender<Job1>,
    place: Arc<str>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("place", &self.place)
            .finish_non_exhaustive()
    }
}

/// One thread's connection, made when needed.
struct Connection {
    config: Config,
    schema: String,
    client: Option<Client>,
}

impl Connection {
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        let client = match self.client.take() {
            Some(c) => c,
            None => {
                let mut c = self.config.connect(NoTls).map_err(unavailable)?;
                c.batch_execute(&format!("SET search_path TO \"{}\"", self.schema))
                    .map_err(pg)?;
                c
            }
        };
        Ok(self.client.insert(client))
    }
}

fn unavailable(e: postgres::Error) -> StoreError {
    StoreError::Unavailable {
        reason: super::postgres_said(&e),
    }
}

/// A PostgreSQL error as the store reports it: a lost connection (no
/// SQLSTATE, or the server going away) is [`StoreError::Unavailable`].
fn pg(e: postgres::Error) -> StoreError {
    let gone = e.is_closed()
        || match e.code() {
            None => std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>()),
            Some(code) => {
                *code == SqlState::ADMIN_SHUTDOWN
                    || *code == SqlState::CRASH_SHUTDOWN
                    || *code == SqlState::CANNOT_CONNECT_NOW
            }
        };
    if gone {
        unavailable(e)
    } else {
        StoreError::Postgres(e)
    }
}

/// The server and database, never the user's password.
fn place(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            postgres::config::Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "postgres://{}:{}/{}",
        hosts.join(","),
        port,
        config.get_dbname().unwrap_or_default()
    )
}

impl PostgresStore {
    pub(super) async fn connect(settings: &PostgresSettings) -> Result<PostgresStore, StoreError> {
        let open_err = |place: String, reason: String| StoreError::Open { place, reason };
        settings
            .check()
            .map_err(|reason| open_err("PostgreSQL".into(), reason))?;
        let mut config = Config::from_str(settings.url.expose())
            .map_err(|e| open_err("PostgreSQL".into(), e.to_string()))?;
        if let Some(password) = &settings.password {
            config.password(password.expose());
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        if config.get_application_name().is_none() {
            config.application_name("ojs-bridge");
        }
        // The client's default logs every notice at INFO; the ones this
        // store meets ("already exists, skipping" when replicas start
        // together) are expected, so they are debug lines.
        config.notice_callback(|notice| {
            tracing::debug!(
                severity = notice.severity(),
                code = notice.code().code(),
                "PostgreSQL notice: {}",
                notice.message()
            );
        });
        let where_ = place(&config);
        let (tx, rx) = mpsc::channel::<Job1>();
        let rx = Arc::new(Mutex::new(rx));
        for n in 0..settings.connections {
            let rx = rx.clone();
            let mut conn = Connection {
                config: config.clone(),
                schema: settings.schema.clone(),
                client: None,
            };
            std::thread::Builder::new()
                .name(format!("ojs-api-pg-{n}"))
                .spawn(move || loop {
                    let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    match next {
                        Ok(job) => job(&mut conn),
                        Err(_) => return,
                    }
                })
                .map_err(|e| open_err(where_.clone(), format!("cannot start a thread: {e}")))?;
        }
        let store = PostgresStore {
            jobs: tx,
            place: where_.clone().into(),
        };
        let schema = settings.schema.clone();
        store
            .call_raw(move |conn| migrate(conn, &schema))
            .await
            .map_err(|e| match e {
                StoreError::Open { place, reason } => {
                    open_err(format!("{where_}, {place}"), reason)
                }
                other => open_err(where_, other.to_string()),
            })?;
        Ok(store)
    }

    /// Runs `f` on a free connection's thread.
    async fn call_raw<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job: Job1 = Box::new(move |conn| {
            let _ = reply.send(super::guarded(|| f(conn)));
        });
        self.jobs.send(job).map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.call_raw(move |conn| f(conn.client()?)).await
    }

    /// Runs `f` in one transaction, committed when it succeeds.
    async fn transaction<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Transaction<'_>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.call(move |client| {
            let mut t = client.transaction().map_err(pg)?;
            let out = f(&mut t)?;
            t.commit().map_err(pg)?;
            Ok(out)
        })
        .await
    }
}

#[async_trait::async_trait]
impl super::JobStore for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn place(&self) -> String {
        self.place.to_string()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(|c| c.simple_query("SELECT 1").map(|_| ()).map_err(pg))
            .await
    }

    async fn insert(&self, jobs: Vec<Job>, uniques: Uniques) -> Result<Vec<Inserted>, StoreError> {
        self.transaction(move |t| {
            let mut jobs = jobs;
            if uniques.iter().all(Option::is_none) {
                insert(t, &jobs, false)?;
                return Ok(jobs.into_iter().map(Inserted::Stored).collect());
            }
            let answered = claim_unique_keys(
                &mut PostgresTx {
                    t,
                    outbox: Vec::new(),
                },
                &mut jobs,
                &uniques,
            )?;
            insert(t, &unanswered(&jobs, &answered), false)?;
            keep_unique_keys(
                &mut PostgresTx {
                    t,
                    outbox: Vec::new(),
                },
                &jobs,
                &uniques,
                &answered,
            )?;
            Ok(jobs
                .into_iter()
                .zip(answered)
                .map(|(job, holder)| match holder {
                    Some(holder) => Inserted::Existing(holder),
                    None => Inserted::Stored(job),
                })
                .collect())
        })
        .await
    }

    fn published(&self, ids: Vec<String>) {
        let job: Job1 = Box::new(move |conn| {
            let done = conn.client().and_then(|c| {
                c.execute(
                    "UPDATE jobs SET published = true WHERE id = ANY($1)",
                    &[&ids],
                )
                .map_err(pg)
            });
            if let Err(e) = done {
                tracing::debug!(error = %e, "marking jobs confirmed failed; they are published again later (at least once)");
            }
        });
        let _ = self.jobs.send(job);
    }

    async fn remove(&self, ids: Vec<String>) -> Result<(), StoreError> {
        self.transaction(move |t| {
            t.execute("DELETE FROM events WHERE job_id = ANY($1)", &[&ids])
                .map_err(pg)?;
            t.execute("DELETE FROM jobs WHERE id = ANY($1)", &[&ids])
                .map_err(pg)?;
            Ok(())
        })
        .await
    }

    async fn run(
        &self,
        f: RunFn,
        // Each transition is a transaction of its own here: its failure
        // is its own whatever it wrote.
        _isolation: Isolation,
    ) -> Result<Box<dyn Any + Send>, StoreError> {
        self.transaction(move |t| {
            f(&mut PostgresTx {
                t,
                outbox: Vec::new(),
            })
        })
        .await
    }

    async fn prune(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let cut = ms(before);
        self.transaction(move |t| {
            let jobs = t.execute(sql::PRUNE_JOBS.postgres, &[&cut]).map_err(pg)?;
            t.execute(PRUNE_EVENTS, &[&cut]).map_err(pg)?;
            t.execute(sql::PRUNE_UNIQUE_KEYS.postgres, &[])
                .map_err(pg)?;
            t.execute(sql::PRUNE_WORKERS.postgres, &[&cut])
                .map_err(pg)?;
            t.execute(
                sql::PRUNE_RATE_KEYS.postgres,
                &[&(cut - RATE_WINDOW_SLACK_MS)],
            )
            .map_err(pg)?;
            t.execute(sql::PRUNE_WORKFLOWS.postgres, &[&cut])
                .map_err(pg)?;
            let folding: bool = t
                .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&FOLD_LOCK])
                .map_err(pg)?
                .get(0);
            if folding {
                t.batch_execute(FOLD_JOB_COUNTS).map_err(pg)?;
            }
            Ok(jobs)
        })
        .await
    }

    async fn get(&self, id: String) -> Result<Option<Job>, StoreError> {
        self.call(move |c| {
            let row = c.query_opt(sql::JOB.postgres, &[&id]).map_err(pg)?;
            row.map(|r| decode(&id, r.get(0), r.get(1))).transpose()
        })
        .await
    }

    async fn due(&self, now: DateTime<Utc>, limit: usize) -> Result<Vec<Job>, StoreError> {
        let (at, until, limit) = (
            ms(now),
            ms(now) + SCHEDULE_CLAIM.as_millis() as i64,
            limit as i64,
        );
        self.transaction(move |t| {
            // The claim: moving `due_ms` on hides the jobs from the other
            // replicas until this one has promoted them (or, if it stops,
            // until the claim runs out).
            let rows = t
                .query(
                    "UPDATE jobs SET due_ms = $2 WHERE id IN (
                         SELECT id FROM jobs WHERE state = 'scheduled' AND due_ms <= $1
                         ORDER BY due_ms LIMIT $3 FOR UPDATE SKIP LOCKED)
                     RETURNING id, envelope, extra",
                    &[&at, &until, &limit],
                )
                .map_err(pg)?;
            rows.iter()
                .map(|r| decode(r.get(0), r.get(1), r.get(2)))
                .collect()
        })
        .await
    }

    async fn next_due(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.call(|c| {
            let at: Option<i64> = c
                .query_one(
                    "SELECT min(due_ms) FROM jobs WHERE state = 'scheduled'",
                    &[],
                )
                .map_err(pg)?
                .get(0);
            Ok(at.and_then(DateTime::from_timestamp_millis))
        })
        .await
    }

    async fn unpublished(&self, limit: usize) -> Result<Vec<Job>, StoreError> {
        let before = ms(Utc::now()) - ORPHAN_AFTER.as_millis() as i64;
        let limit = limit as i64;
        self.call(move |c| {
            let rows = c
                .query(
                    "SELECT id, envelope, extra FROM jobs
                     WHERE (NOT published AND state = 'available' AND stored_ms < $1)
                        OR dead = 2
                     ORDER BY stored_ms LIMIT $2",
                    &[&before, &limit],
                )
                .map_err(pg)?;
            rows.iter()
                .map(|r| decode(r.get(0), r.get(1), r.get(2)))
                .collect()
        })
        .await
    }

    async fn dead_letters(&self) -> Result<Vec<Job>, StoreError> {
        self.call(|c| {
            let rows = c
                .query(
                    "SELECT id, envelope, extra FROM jobs WHERE dead = 1 ORDER BY finished_ms, seq",
                    &[],
                )
                .map_err(pg)?;
            rows.iter()
                .map(|r| decode(r.get(0), r.get(1), r.get(2)))
                .collect()
        })
        .await
    }

    async fn queues(&self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        self.call(|c| {
            let rows = c.query(sql::QUEUES.postgres, &[]).map_err(pg)?;
            Ok(rows
                .iter()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        DateTime::from_timestamp_millis(r.get(1)).unwrap_or_default(),
                    )
                })
                .collect())
        })
        .await
    }

    async fn events(&self, filter: EventFilter) -> Result<EventPage, StoreError> {
        self.call(move |c| {
            let last: i64 = c
                .query_one("SELECT coalesce(max(seq), 0)::bigint FROM events", &[])
                .map_err(pg)?
                .get(0);
            let until = filter.after.saturating_add(MAX_EVENTS_SCANNED).min(last);
            let (sql, lists) = filter.sql(|n| format!("${n}"));
            let mut values: Vec<&(dyn ::postgres::types::ToSql + Sync)> =
                vec![&filter.after, &until];
            values.extend(
                lists
                    .iter()
                    .map(|v| v as &(dyn ::postgres::types::ToSql + Sync)),
            );
            let rows = c.query(sql.as_str(), &values).map_err(pg)?;
            let mut page = EventPage {
                cursor: until.max(filter.after),
                has_more: until < last,
                ..EventPage::default()
            };
            for r in &rows {
                let seq: i64 = r.get(0);
                let queue: &str = r.get(3);
                if !filter.sees(queue) {
                    continue;
                }
                if page.events.len() == filter.limit {
                    page.has_more = true;
                    page.cursor = page.events.last().map_or(filter.after, |e| e.seq);
                    return Ok(page);
                }
                page.events.push(event_body(
                    seq,
                    r.get(1),
                    r.get(2),
                    queue,
                    r.get(4),
                    r.get(5),
                    r.get(6),
                ));
            }
            Ok(page)
        })
        .await
    }

    fn shared(&self) -> Option<&dyn super::SharedStore> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl super::SharedStore for PostgresStore {
    async fn take_settles(&self, holder: String) -> Result<Vec<(String, Settle)>, StoreError> {
        self.call(move |c| {
            let rows = c
                .query(
                    "DELETE FROM settles WHERE holder = $1
                     RETURNING seq, job_id, action, (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
                    &[&holder],
                )
                .map_err(pg)?;
            let mut out: Vec<(i64, String, Settle)> = Vec::with_capacity(rows.len());
            for r in &rows {
                let id: String = r.get(1);
                match read_settle(r.get(2), r.get(3)) {
                    Ok(s) => out.push((r.get(0), id, s)),
                    Err(e) => {
                        tracing::warn!(job_id = %id, error = %e, "a settlement this build cannot read is dropped; the job's delivery is settled when the broker gives it back")
                    }
                }
            }
            out.sort_by_key(|(seq, _, _)| *seq);
            Ok(out.into_iter().map(|(_, id, s)| (id, s)).collect())
        })
        .await
    }
}

/// A settlement as stored (`action`), taken when the database's clock
/// said `now_ms`: a retry's delay less the time since it was sent
/// (`sent_ms`, by the same clock), so that the job comes back when the
/// request that failed it was told.
fn read_settle(action: &str, now_ms: i64) -> Result<Settle, serde_json::Error> {
    let mut v: serde_json::Value = serde_json::from_str(action)?;
    let sent_ms = v
        .as_object_mut()
        .and_then(|m| m.remove("sent_ms"))
        .and_then(|t| t.as_i64());
    let mut settle: Settle = serde_json::from_value(v)?;
    if let (Settle::Retry { delay_ms }, Some(sent_ms)) = (&mut settle, sent_ms) {
        let waited = u64::try_from(now_ms.saturating_sub(sent_ms)).unwrap_or(0);
        *delay_ms = delay_ms.saturating_sub(waited);
    }
    Ok(settle)
}

/// The schema's version, read without creating anything; `None` when it
/// has no version table (or does not exist).
fn schema_version(client: &mut Client, schema: &str) -> Result<Option<i32>, StoreError> {
    let table = format!("\"{schema}\".schema_version");
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .map_err(pg)?
        .get(0);
    if !exists {
        return Ok(None);
    }
    Ok(client
        .query_one(&format!("SELECT max(version) FROM {table}"), &[])
        .map_err(pg)?
        .get(0))
}

/// Makes the schema, or checks that it is one this build can use. A
/// schema already at this build's version is used as it is, with no DDL:
/// a role that may only read and write its tables (made by someone else)
/// is enough.
fn migrate(conn: &mut Connection, schema: &str) -> Result<(), StoreError> {
    // Connect without the search path (the schema may not exist yet).
    let client = conn.client()?;
    match schema_version(client, schema)? {
        Some(v) if v == SCHEMA_VERSION => return Ok(()),
        Some(v) if v > SCHEMA_VERSION => {
            return Err(StoreError::Open {
                place: format!("schema {schema}"),
                reason: format!("schema version {v} is newer than this build's {SCHEMA_VERSION}"),
            })
        }
        _ => {}
    }
    make_schema(client, schema).map_err(|e| match e {
        StoreError::Postgres(ref p) if p.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            let said = p.as_db_error().map_or_else(|| p.to_string(), |d| d.message().to_owned());
            StoreError::Open {
                place: format!("schema {schema}"),
                reason: format!(
                    "the role may not create the job store's schema or tables ({said}); have a role that may run ojs-bridge once against this schema (it makes them), then grant this one USAGE on the schema and SELECT, INSERT, UPDATE, DELETE on its tables and USAGE on its sequences"
                ),
            }
        }
        other => other,
    })
}

/// Creates or migrates the schema under the migration lock.
fn make_schema(client: &mut Client, schema: &str) -> Result<(), StoreError> {
    let mut t = client.transaction().map_err(pg)?;
    t.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(pg)?;
    t.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
         SET LOCAL search_path TO \"{schema}\";
         CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL);"
    ))
    .map_err(pg)?;
    let version: Option<i32> = t
        .query_opt("SELECT max(version) FROM schema_version", &[])
        .map_err(pg)?
        .and_then(|r| r.get(0));
    match version {
        None | Some(1..=7) => {
            if version.is_none() {
                t.batch_execute(SCHEMA_V1).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 2) {
                t.batch_execute(MIGRATE_1_TO_2).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 3) {
                t.batch_execute(MIGRATE_2_TO_3).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 4) {
                t.batch_execute(MIGRATE_3_TO_4).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 5) {
                t.batch_execute(MIGRATE_4_TO_5).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 6) {
                t.batch_execute(MIGRATE_5_TO_6).map_err(pg)?;
            }
            if version.is_none_or(|v| v < 7) {
                t.batch_execute(MIGRATE_6_TO_7).map_err(pg)?;
            }
            t.batch_execute(MIGRATE_7_TO_8).map_err(pg)?;
            t.execute(
                "INSERT INTO schema_version (version) VALUES ($1)",
                &[&SCHEMA_VERSION],
            )
            .map_err(pg)?;
        }
        Some(v) if v > SCHEMA_VERSION => {
            return Err(StoreError::Open {
                place: format!("schema {schema}"),
                reason: format!("schema version {v} is newer than this build's {SCHEMA_VERSION}"),
            })
        }
        Some(_) => {}
    }
    t.commit().map_err(pg)?;
    Ok(())
}

/// Inserts `jobs` in one statement; `seen`: they are on the broker already
/// (a FETCH found them), so a stored copy is kept as it is.
fn insert(t: &mut Transaction<'_>, jobs: &[Job], seen: bool) -> Result<(), StoreError> {
    let now = ms(Utc::now());
    let n = jobs.len();
    let mut types = Vec::with_capacity(n);
    let (mut ids, mut queues, mut states, mut dues, mut created, mut published) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut envelopes, mut extras) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut ev_types, mut ev_times, mut ev_data, mut ev_job_types) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for job in jobs {
        let e = &job.envelope;
        let (envelope, extra) = encode(job)?;
        ids.push(e.id.clone());
        queues.push(e.queue.clone());
        types.push(e.job_type.clone());
        states.push(state_name(job.state()).to_owned());
        dues.push(due_ms(job));
        created.push(e.created_at.map_or(0, ms));
        published.push(seen || job.state() != JobState::Available);
        envelopes.push(envelope);
        extras.push(extra);
        let (name, at, data) = stored_event(job);
        ev_types.push(name.to_owned());
        ev_times.push(ms(at));
        ev_data.push(data.text().to_owned());
        ev_job_types.push(e.job_type.clone());
    }
    let conflict = if seen {
        "ON CONFLICT (id) DO NOTHING"
    } else {
        ""
    };
    let stored = t
        .execute(
            &format!(
                "INSERT INTO jobs (id, queue, state, due_ms, created_ms, stored_ms, published,
                                   envelope, extra, job_type)
                 SELECT i, q, s, d, c, $6, p, e, x, y
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                             $7::boolean[], $8::text[], $9::text[], $10::text[])
                      AS u(i, q, s, d, c, p, e, x, y)
                 {conflict}"
            ),
            &[
                &ids, &queues, &states, &dues, &created, &now, &published, &envelopes, &extras,
                &types,
            ],
        )
        .map_err(|e| match e.as_db_error() {
            Some(db) if *db.code() == SqlState::UNIQUE_VIOLATION => {
                // "Key (id)=(…) already exists."
                let id = db
                    .detail()
                    .and_then(|d| d.split_once("=(")?.1.rsplit_once(") ").map(|(id, _)| id))
                    .map_or_else(|| ids.first().cloned().unwrap_or_default(), str::to_owned);
                StoreError::Duplicate(id)
            }
            _ => pg(e),
        })?;
    if seen && stored == 0 {
        return Ok(());
    }
    t.execute(
        "INSERT INTO events (type, job_id, queue, job_type, time_ms, data)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[],
                              $6::text[])",
        &[&ev_types, &ids, &queues, &ev_job_types, &ev_times, &ev_data],
    )
    .map_err(pg)?;
    t.execute(
        "INSERT INTO queues (name, created_ms)
         SELECT q, min(c) FROM unnest($1::text[], $2::bigint[]) AS u(q, c) GROUP BY q
         ON CONFLICT (name) DO NOTHING",
        &[&queues, &created],
    )
    .map_err(pg)?;
    Ok(())
}

/// A transition's view of one PostgreSQL transaction.
struct PostgresTx<'a, 'b> {
    t: &'a mut Transaction<'b>,
    /// Jobs this transaction readied, published after its commit.
    outbox: Vec<Job>,
}

impl Tx for PostgresTx<'_, '_> {
    fn load(&mut self, id: &str) -> Result<Job, StoreError> {
        let row = self
            .t
            .query_opt(
                "SELECT envelope, extra FROM jobs WHERE id = $1 FOR UPDATE",
                &[&id],
            )
            .map_err(pg)?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        decode(id, row.get(0), row.get(1))
    }

    fn save(&mut self, job: &Job, finished: Option<DateTime<Utc>>) -> Result<(), StoreError> {
        let (envelope, extra) = encode(job)?;
        let state = state_name(job.state());
        self.t
            .execute(
                "UPDATE jobs SET state = $2, envelope = $3, extra = $4, finished_ms = $5,
                     due_ms = $6, dead = $7,
                     holder = CASE WHEN $2 = 'active' THEN holder END,
                     visible_until_ms = CASE WHEN $2 = 'active' THEN visible_until_ms END
                 WHERE id = $1",
                &[
                    &job.envelope.id,
                    &state,
                    &envelope,
                    &extra,
                    &finished.map(ms),
                    &due_ms(job),
                    &job.store_mark(),
                ],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn fact(
        &mut self,
        event_type: &str,
        job: &Subject<'_>,
        now: DateTime<Utc>,
        data: &EventData,
    ) -> Result<(), StoreError> {
        self.t
            .execute(
                INSERT_EVENT,
                &[
                    &event_type,
                    &job.job_id,
                    &job.queue,
                    &job.job_type,
                    &ms(now),
                    &data.text(),
                ],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn jobs_with_unique_key(&mut self, key: &str) -> Result<Vec<Job>, StoreError> {
        self.t
            .query(sql::JOBS_WITH_UNIQUE_KEY.postgres, &[&key])
            .map_err(pg)?
            .iter()
            .map(|r| decode(r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    fn keep_unique_key(&mut self, job_id: &str, key: &str) -> Result<(), StoreError> {
        self.t
            .execute(sql::KEEP_UNIQUE_KEY.postgres, &[&job_id, &key])
            .map_err(pg)?;
        Ok(())
    }

    fn lock_unique_key(&mut self, key: &str) -> Result<(), StoreError> {
        // Replicas: of two transactions inserting one key, the second waits
        // here until the first committed, then finds the key held.
        self.t
            .execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                &[&key],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn insert_seen(&mut self, job: &Job) -> Result<(), StoreError> {
        insert(self.t, std::slice::from_ref(job), true)
    }

    fn delete(&mut self, id: &str) -> Result<(), StoreError> {
        self.t
            .execute(sql::DELETE_JOB_EVENTS.postgres, &[&id])
            .map_err(pg)?;
        self.t
            .execute(sql::DELETE_JOB.postgres, &[&id])
            .map_err(pg)?;
        Ok(())
    }

    fn lease(&mut self, id: &str) -> Result<Option<Lease>, StoreError> {
        let row = self
            .t
            .query_opt(
                "SELECT holder, visible_until_ms FROM jobs WHERE id = $1",
                &[&id],
            )
            .map_err(pg)?;
        Ok(row.and_then(|r| {
            let holder: Option<String> = r.get(0);
            let until: Option<i64> = r.get(1);
            Some(Lease {
                holder: holder?,
                until: DateTime::from_timestamp_millis(until?)?,
            })
        }))
    }

    fn set_lease(&mut self, id: &str, lease: Option<&Lease>) -> Result<(), StoreError> {
        let (holder, until) = match lease {
            Some(l) => (Some(l.holder.as_str()), Some(ms(l.until))),
            None => (None, None),
        };
        self.t
            .execute(
                "UPDATE jobs SET holder = $2, visible_until_ms = $3 WHERE id = $1",
                &[&id, &holder, &until],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn send_settle(&mut self, holder: &str, id: &str, settle: &Settle) -> Result<(), StoreError> {
        let action = serde_json::to_string(settle).map_err(|e| StoreError::Corrupt {
            id: id.to_owned(),
            reason: e.to_string(),
        })?;
        // A retry's delay counts from the decision, not from when the
        // holder reads it (its next look at the store, a loop's turn
        // later): the database's clock says when it was sent, and the
        // same clock how long ago when it is taken (`read_settle`).
        let sql = if matches!(settle, Settle::Retry { .. }) {
            "INSERT INTO settles (holder, job_id, action) VALUES ($1, $2,
             jsonb_set($3::text::jsonb, '{sent_ms}',
                       to_jsonb((extract(epoch FROM clock_timestamp()) * 1000)::bigint))::text)"
        } else {
            "INSERT INTO settles (holder, job_id, action) VALUES ($1, $2, $3)"
        };
        self.t.execute(sql, &[&holder, &id, &action]).map_err(pg)?;
        Ok(())
    }

    fn worker(&mut self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        let row = self
            .t
            .query_opt(
                "SELECT record FROM workers WHERE id = $1 FOR UPDATE",
                &[&id],
            )
            .map_err(pg)?;
        row.map(|r| record_of(id, r.get(0))).transpose()
    }

    fn save_worker(
        &mut self,
        id: &str,
        seen: DateTime<Utc>,
        record: &WorkerRecord,
    ) -> Result<(), StoreError> {
        self.t
            .execute(
                sql::SAVE_WORKER.postgres,
                &[&id, &ms(seen), &record_text(id, record)?],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn remove_worker(&mut self, id: &str) -> Result<bool, StoreError> {
        let n = self
            .t
            .execute(sql::DELETE_WORKER.postgres, &[&id])
            .map_err(pg)?;
        Ok(n > 0)
    }

    fn workflow(&mut self, id: &str) -> Result<Option<Workflow>, StoreError> {
        // Locked: two replicas settling members of one workflow at once
        // decide one after the other.
        let row = self
            .t
            .query_opt(
                "SELECT record FROM workflows WHERE id = $1 FOR UPDATE",
                &[&id],
            )
            .map_err(pg)?;
        row.map(|r| record_of(id, r.get(0))).transpose()
    }

    fn save_workflow(&mut self, workflow: &Workflow) -> Result<(), StoreError> {
        self.t
            .execute(
                sql::SAVE_WORKFLOW.postgres,
                &[
                    &workflow.id,
                    &workflow.state.as_str(),
                    &ms(workflow.created_at),
                    &workflow.finished_at.map(ms),
                    &record_text(&workflow.id, workflow)?,
                ],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn reset(&mut self) -> Result<(), StoreError> {
        let tables = sql::RESET_TABLES.join(", ");
        self.t
            .batch_execute(&format!("TRUNCATE {tables}"))
            .map_err(pg)?;
        Ok(())
    }

    fn system(&mut self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .t
            .query_opt(sql::SYSTEM.postgres, &[&key])
            .map_err(pg)?
            .map(|r| r.get(0)))
    }

    fn set_system(&mut self, key: &str, value: Option<&str>) -> Result<(), StoreError> {
        match value {
            Some(v) => self.t.execute(sql::SET_SYSTEM.postgres, &[&key, &v]),
            None => self.t.execute(sql::DELETE_SYSTEM.postgres, &[&key]),
        }
        .map_err(pg)?;
        Ok(())
    }

    fn delete_workflow(&mut self, id: &str) -> Result<(), StoreError> {
        self.t
            .execute(sql::DELETE_WORKFLOW.postgres, &[&id])
            .map_err(pg)?;
        Ok(())
    }

    fn workflows(
        &mut self,
        state: Option<&str>,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<Workflow>, StoreError> {
        let (limit, offset) = (limit as i64, offset as i64);
        let rows = match state {
            Some(state) => self
                .t
                .query(sql::WORKFLOWS_IN.postgres, &[&limit, &offset, &state])
                .map_err(pg)?,
            None => self
                .t
                .query(sql::WORKFLOWS.postgres, &[&limit, &offset])
                .map_err(pg)?,
        };
        rows.iter().map(|r| record_of(r.get(0), r.get(1))).collect()
    }

    fn list_jobs(
        &mut self,
        query: &JobQuery,
        limit: usize,
        offset: usize,
    ) -> Result<(Vec<Job>, u64), StoreError> {
        // Every queue with jobs has a row in `job_counts` (a counter
        // left at zero names a queue with none: harmless).
        let (filter, order, values) =
            query.sql("job_type", "id", Some("job_counts"), |n| format!("${n}"));
        let values: Vec<Box<dyn ::postgres::types::ToSql + Sync>> = values
            .into_iter()
            .map(|v| match v {
                Bound::Text(t) => Box::new(t) as Box<dyn ::postgres::types::ToSql + Sync>,
                Bound::Int(i) => Box::new(i) as Box<dyn ::postgres::types::ToSql + Sync>,
            })
            .collect();
        let refs: Vec<&(dyn ::postgres::types::ToSql + Sync)> =
            values.iter().map(|v| v.as_ref()).collect();
        let total: i64 = self
            .t
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT 1 FROM jobs WHERE {filter} LIMIT {}) AS matched",
                    super::LIST_COUNT_LIMIT + 1
                ),
                &refs,
            )
            .map_err(pg)?
            .get(0);
        let rows = self
            .t
            .query(
                &format!(
                    "SELECT id, envelope, extra FROM jobs WHERE {filter} ORDER BY {order} LIMIT {} OFFSET {}",
                    i64::try_from(limit).unwrap_or(i64::MAX),
                    i64::try_from(offset).unwrap_or(i64::MAX),
                ),
                &refs,
            )
            .map_err(pg)?;
        let jobs = rows
            .iter()
            .map(|r| decode(r.get(0), r.get(1), r.get(2)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((jobs, u64::try_from(total).unwrap_or(0)))
    }

    fn job_counts(&mut self, since: DateTime<Utc>) -> Result<JobCounts, StoreError> {
        let read = |rows: Vec<::postgres::Row>| {
            rows.iter()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        r.get::<_, String>(1),
                        u64::try_from(r.get::<_, i64>(2)).unwrap_or(0),
                    )
                })
                .collect()
        };
        let by_queue = read(
            self.t
                .query(sql::COUNTS_BY_QUEUE.postgres, &[])
                .map_err(pg)?,
        );
        let finished = read(
            self.t
                .query(sql::FINISHED_BY_QUEUE.postgres, &[&ms(since)])
                .map_err(pg)?,
        );
        Ok(JobCounts { by_queue, finished })
    }

    fn event_bounds(&mut self) -> Result<(Option<i64>, Option<i64>), StoreError> {
        let row = self
            .t
            .query_one("SELECT min(seq), max(seq) FROM events", &[])
            .map_err(pg)?;
        Ok((row.get(0), row.get(1)))
    }

    fn history(
        &mut self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_ms: i64,
        queue: Option<&str>,
    ) -> Result<Vec<(i64, String, u64)>, StoreError> {
        let rows = self
            .t
            .query(
                sql::HISTORY.postgres,
                &[
                    &ms(since),
                    &ms(until),
                    &bucket_ms.max(1),
                    &queue.unwrap_or(""),
                ],
            )
            .map_err(pg)?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, i64>(0),
                    r.get::<_, String>(1),
                    u64::try_from(r.get::<_, i64>(2)).unwrap_or(0),
                )
            })
            .collect())
    }

    fn outbox(&mut self) -> &mut Vec<Job> {
        &mut self.outbox
    }

    fn cron(&mut self, name: &str) -> Result<Option<CronJob>, StoreError> {
        let row = self
            .t
            .query_opt(
                "SELECT record FROM crons WHERE name = $1 FOR UPDATE",
                &[&name],
            )
            .map_err(pg)?;
        row.map(|r| record_of(name, r.get(0))).transpose()
    }

    fn save_cron(&mut self, cron: &CronJob) -> Result<(), StoreError> {
        self.t
            .execute(
                sql::SAVE_CRON.postgres,
                &[&cron.name, &record_text(&cron.name, cron)?],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn remove_cron(&mut self, name: &str) -> Result<bool, StoreError> {
        let n = self
            .t
            .execute(sql::DELETE_CRON.postgres, &[&name])
            .map_err(pg)?;
        Ok(n > 0)
    }

    fn crons(&mut self) -> Result<Vec<CronJob>, StoreError> {
        let rows = self.t.query(sql::CRONS.postgres, &[]).map_err(pg)?;
        rows.iter().map(|r| record_of(r.get(0), r.get(1))).collect()
    }

    fn paused_queues(&mut self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        let rows = self.t.query(sql::PAUSED_QUEUES.postgres, &[]).map_err(pg)?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, String>(0),
                    DateTime::from_timestamp_millis(r.get(1)).unwrap_or_default(),
                )
            })
            .collect())
    }

    fn set_paused(
        &mut self,
        queue: &str,
        paused: bool,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        self.t
            .execute(sql::ADD_QUEUE.postgres, &[&queue, &ms(now)])
            .map_err(pg)?;
        let n = if paused {
            self.t
                .execute(sql::PAUSE_QUEUE.postgres, &[&queue, &ms(now)])
                .map_err(pg)?
        } else {
            self.t
                .execute(sql::RESUME_QUEUE.postgres, &[&queue])
                .map_err(pg)?
        };
        Ok(n > 0)
    }

    fn queue_jobs(
        &mut self,
        queue: &str,
        since: DateTime<Utc>,
        sample: usize,
    ) -> Result<QueueJobs, StoreError> {
        let counts = |rows: Vec<::postgres::Row>| -> Vec<(String, u64)> {
            rows.iter()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        u64::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                    )
                })
                .collect()
        };
        let rows = self
            .t
            .query(sql::QUEUE_STATES.postgres, &[&queue])
            .map_err(pg)?;
        let dead = rows
            .iter()
            .map(|r| u64::try_from(r.get::<_, i64>(2)).unwrap_or(0))
            .sum();
        let by_state = rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, String>(0),
                    u64::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                )
            })
            .collect();
        let finished_by_state = counts(
            self.t
                .query(sql::QUEUE_FINISHED.postgres, &[&queue, &ms(since)])
                .map_err(pg)?,
        );
        let limit = i64::try_from(sample).unwrap_or(i64::MAX);
        let rows = self
            .t
            .query(sql::QUEUE_COMPLETED.postgres, &[&queue, &ms(since), &limit])
            .map_err(pg)?;
        let completed = rows
            .iter()
            .map(|r| decode(r.get(0), r.get(1), r.get(2)))
            .collect::<Result<_, _>>()?;
        Ok(QueueJobs {
            by_state,
            dead,
            finished_by_state,
            completed,
        })
    }

    fn rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError> {
        // The row exists before it is locked, so that concurrent first
        // uses of a key wait for each other.
        self.t
            .execute(
                "INSERT INTO rate_keys (key, seen_ms, record) VALUES ($1, 0, '{}')
                 ON CONFLICT (key) DO NOTHING",
                &[&key],
            )
            .map_err(pg)?;
        let row = self
            .t
            .query_one(
                "SELECT record FROM rate_keys WHERE key = $1 FOR UPDATE",
                &[&key],
            )
            .map_err(pg)?;
        let record: String = row.get(0);
        Ok(Some(record_of(key, &record)?))
    }

    fn peek_rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError> {
        let row = self
            .t
            .query_opt(sql::RATE_KEY.postgres, &[&key])
            .map_err(pg)?;
        row.map(|r| record_of(key, &r.get::<_, String>(0)))
            .transpose()
    }

    fn save_rate_key(
        &mut self,
        key: &str,
        state: &KeyState,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        self.t
            .execute(
                sql::SAVE_RATE_KEY.postgres,
                &[&key, &rate_key_seen(state, now), &record_text(key, state)?],
            )
            .map_err(pg)?;
        Ok(())
    }

    fn rate_jobs(&mut self, key: &str) -> Result<(u64, u64), StoreError> {
        let rows = self
            .t
            .query(sql::RATE_JOB_COUNTS.postgres, &[&key])
            .map_err(pg)?;
        let mut counts = (0, 0);
        for row in rows {
            let state: String = row.get(0);
            let n = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
            if state == RATE_ACTIVE {
                counts.0 = n;
            } else {
                counts.1 = n;
            }
        }
        Ok(counts)
    }

    fn file_rate_job(
        &mut self,
        job_id: &str,
        keys: &[String],
        state: &str,
    ) -> Result<(), StoreError> {
        for key in keys {
            self.t
                .execute(sql::FILE_RATE_JOB.postgres, &[&job_id, key, &state])
                .map_err(pg)?;
        }
        Ok(())
    }

    fn unfile_rate_job(&mut self, job_id: &str) -> Result<(), StoreError> {
        self.t
            .execute(sql::UNFILE_RATE_JOB.postgres, &[&job_id])
            .map_err(pg)?;
        Ok(())
    }

    fn rate_keys(
        &mut self,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<(String, KeyState)>, u64), StoreError> {
        let total: i64 = self
            .t
            .query_one(sql::COUNT_RATE_KEYS.postgres, &[])
            .map_err(pg)?
            .get(0);
        let rows = self
            .t
            .query(
                sql::RATE_KEYS.postgres,
                &[
                    &i64::try_from(limit).unwrap_or(i64::MAX),
                    &i64::try_from(offset).unwrap_or(i64::MAX),
                ],
            )
            .map_err(pg)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let key: String = row.get(0);
            let record: String = row.get(1);
            let state = record_of(&key, &record)?;
            out.push((key, state));
        }
        Ok((out, u64::try_from(total).unwrap_or(0)))
    }

    fn unique_holders(&mut self, limit: u64) -> Result<Vec<(String, Job)>, StoreError> {
        let rows = self
            .t
            .query(
                sql::UNIQUE_HOLDERS.postgres,
                &[&i64::try_from(limit).unwrap_or(i64::MAX)],
            )
            .map_err(pg)?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            out.push((r.get(0), decode(r.get(1), r.get(2), r.get(3))?));
        }
        Ok(out)
    }

    fn priority_counts(&mut self, queue: &str, limit: u64) -> Result<Vec<(i64, u64)>, StoreError> {
        let rows = self
            .t
            .query(
                sql::PRIORITY_COUNTS.postgres,
                &[&queue, &i64::try_from(limit).unwrap_or(i64::MAX)],
            )
            .map_err(pg)?;
        Ok(count_priorities(rows.iter().map(|r| r.get::<_, String>(0))))
    }

    fn queue_configs(&mut self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self.t.query(sql::QUEUE_CONFIGS.postgres, &[]).map_err(pg)?;
        Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    fn save_queue_config(&mut self, name: &str, record: &str) -> Result<(), StoreError> {
        self.t
            .execute(sql::SAVE_QUEUE_CONFIG.postgres, &[&name, &record])
            .map_err(pg)?;
        Ok(())
    }

    fn hold_role(
        &mut self,
        role: &str,
        holder: &str,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let n = self
            .t
            .execute(
                sql::HOLD_ROLE.postgres,
                &[&role, &holder, &ms(until), &ms(now)],
            )
            .map_err(pg)?;
        Ok(n > 0)
    }

    fn workers(&mut self) -> Result<Vec<WorkerRecord>, StoreError> {
        let rows = self.t.query(sql::WORKERS.postgres, &[]).map_err(pg)?;
        rows.iter().map(|r| record_of(r.get(0), r.get(1))).collect()
    }
}
