//! Job state beside the broker: one SQLite file (`jobs.sqlite` in the data
//! directory) holding each job's envelope, state and lifecycle timestamps,
//! the scheduled jobs that have not reached the broker yet, and the event log.
//!
//! The broker holds the queue; this holds what OJS INFO, CANCEL and the
//! scheduler need. Writes go through one thread that commits everything that
//! arrived while the previous commit ran in one transaction (each request in
//! its own savepoint, so one request's failure leaves the others): a
//! thousand concurrent PUSHes cost a few fsyncs, not a thousand. Reads use a
//! second connection (WAL readers do not wait for the writer).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::{JobEnvelope, JobState};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::job::{timestamp, Extra, Job};

/// The store's file in the data directory.
pub const STORE_FILE: &str = "jobs.sqlite";
/// `PRAGMA application_id` of the file ("OJSA"), so another program's
/// SQLite file is refused, not changed.
const APPLICATION_ID: i64 = 0x4f4a_5341;
/// `PRAGMA user_version` this build writes.
const SCHEMA_VERSION: i64 = 1;
/// Requests one commit takes at most.
const MAX_GROUP: usize = 4096;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    queue       TEXT NOT NULL,
    state       TEXT NOT NULL,
    due_ms      INTEGER,
    published   INTEGER NOT NULL DEFAULT 0,
    created_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    envelope    TEXT NOT NULL,
    extra       TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS jobs_due ON jobs (state, due_ms);
CREATE INDEX IF NOT EXISTS jobs_unpublished ON jobs (published) WHERE published = 0;
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE TABLE IF NOT EXISTS queues (
    name       TEXT PRIMARY KEY,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    id       TEXT NOT NULL,
    type     TEXT NOT NULL,
    job_id   TEXT NOT NULL,
    queue    TEXT NOT NULL,
    job_type TEXT NOT NULL,
    time_ms  INTEGER NOT NULL,
    data     TEXT NOT NULL
);
";

/// What the store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A job id that is already stored.
    #[error("job {0} already exists")]
    Duplicate(String),
    /// No job with this id.
    #[error("job {0} not found")]
    NotFound(String),
    /// The job's state does not allow the change.
    #[error("job {id} is {}", .current.as_str().unwrap_or("in an unknown state"))]
    WrongState {
        /// The job.
        id: String,
        /// Its state.
        current: JobState,
    },
    /// The file cannot be opened or belongs to something else.
    #[error("cannot open the job store {path}: {reason}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// SQLite failed.
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The group's transaction could not begin or commit; every request in
    /// it failed with the same reason (SQLite's errors cannot be cloned).
    #[error("SQLite commit: {0}")]
    Commit(String),
    /// A stored row that does not decode (written by something else).
    #[error("job {id} is stored in a form this build cannot read: {reason}")]
    Corrupt {
        /// The job.
        id: String,
        /// Why.
        reason: String,
    },
    /// The writer thread is gone (the store is closing).
    #[error("the job store is closed")]
    Closed,
}

/// One event of the log (`GET /ojs/v1/events`).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Position in the log: the cursor.
    pub seq: i64,
    /// The event as the binding shows it.
    pub body: Value,
}

/// Which events to read.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Only after this position.
    pub after: i64,
    /// Event types (empty: all).
    pub types: Vec<String>,
    /// Queues (empty: all).
    pub queues: Vec<String>,
    /// Job types (empty: all).
    pub job_types: Vec<String>,
    /// Queue patterns the reader may see (empty: all): a token's scope.
    pub scope: Vec<ojs_core::glob::Glob>,
    /// At most this many.
    pub limit: usize,
}

enum Write {
    Insert {
        jobs: Vec<Job>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Published {
        ids: Vec<String>,
    },
    Remove {
        ids: Vec<String>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Cancel {
        id: String,
        now: DateTime<Utc>,
        reply: oneshot::Sender<Result<(JobState, Job), StoreError>>,
    },
    Promote {
        ids: Vec<String>,
        now: DateTime<Utc>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Prune {
        before: DateTime<Utc>,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
}

/// The store: a writer thread and a reader connection.
#[derive(Debug, Clone)]
pub struct Store {
    writes: mpsc::Sender<WriteBox>,
    reader: Arc<Mutex<Connection>>,
    path: PathBuf,
}

/// `Write` is not `Debug` (it holds reply channels); the channel needs a
/// named type.
struct WriteBox(Write);

impl std::fmt::Debug for WriteBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Write")
    }
}

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

fn open_connection(path: &Path) -> Result<Connection, StoreError> {
    let open_err = |reason: String| StoreError::Open {
        path: path.to_owned(),
        reason,
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| open_err(e.to_string()))?;
    conn.busy_timeout(Duration::from_secs(5))?;
    let app_id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| open_err(e.to_string()))?;
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| open_err(e.to_string()))?;
    if app_id != APPLICATION_ID && (app_id != 0 || tables > 0) {
        return Err(open_err("it belongs to another application".into()));
    }
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(open_err(format!(
            "schema version {version} is newer than this build's {SCHEMA_VERSION}"
        )));
    }
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
    // A 201 promises the job is kept: scheduled jobs live only here until
    // they are due.
    conn.execute_batch("PRAGMA synchronous = FULL;")?;
    Ok(conn)
}

impl Store {
    /// Opens (creating when needed) the store in `dir`.
    pub async fn open(dir: &Path) -> Result<Store, StoreError> {
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || Store::open_blocking(&dir))
            .await
            .map_err(|e| StoreError::Open {
                path: PathBuf::from(STORE_FILE),
                reason: e.to_string(),
            })?
    }

    fn open_blocking(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
            path: dir.to_owned(),
            reason: e.to_string(),
        })?;
        let path = dir.join(STORE_FILE);
        let writer = open_connection(&path)?;
        writer.execute_batch(SCHEMA)?;
        writer.execute_batch(&format!(
            "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {SCHEMA_VERSION};"
        ))?;
        let reader = open_connection(&path)?;
        let (tx, rx) = mpsc::channel::<WriteBox>();
        std::thread::Builder::new()
            .name("ojs-api-store".into())
            .spawn(move || write_loop(writer, rx))
            .map_err(|e| StoreError::Open {
                path: path.clone(),
                reason: format!("cannot start the writer thread: {e}"),
            })?;
        Ok(Store {
            writes: tx,
            reader: Arc::new(Mutex::new(reader)),
            path,
        })
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn write<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Write,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.writes
            .send(WriteBox(make(tx)))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let conn = reader.lock().unwrap_or_else(|e| e.into_inner());
            f(&conn)
        })
        .await
        .map_err(|_| StoreError::Closed)?
    }

    /// Stores new jobs, all or none: a stored id is
    /// [`StoreError::Duplicate`]. They count as not yet on the broker until
    /// [`Store::published`].
    pub async fn insert(&self, jobs: Vec<Job>) -> Result<(), StoreError> {
        self.write(|reply| Write::Insert { jobs, reply }).await
    }

    /// Records that the broker confirmed these jobs. Not awaited: a job
    /// whose mark is lost is published again after a restart (at least
    /// once).
    pub fn published(&self, ids: Vec<String>) {
        let _ = self.writes.send(WriteBox(Write::Published { ids }));
    }

    /// Removes jobs the broker did not take, so that nothing is half-stored.
    pub async fn remove(&self, ids: Vec<String>) -> Result<(), StoreError> {
        self.write(|reply| Write::Remove { ids, reply }).await
    }

    /// Cancels a job that is not finished; returns its previous state and
    /// the job now.
    pub async fn cancel(
        &self,
        id: String,
        now: DateTime<Utc>,
    ) -> Result<(JobState, Job), StoreError> {
        self.write(|reply| Write::Cancel { id, now, reply }).await
    }

    /// Scheduled jobs the broker confirmed become available.
    pub async fn promote(&self, ids: Vec<String>, now: DateTime<Utc>) -> Result<(), StoreError> {
        self.write(|reply| Write::Promote { ids, now, reply }).await
    }

    /// Removes finished jobs (and events) older than `before`.
    pub async fn prune(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        self.write(|reply| Write::Prune { before, reply }).await
    }

    /// One job.
    pub async fn get(&self, id: String) -> Result<Option<Job>, StoreError> {
        self.read(move |conn| {
            let row = conn
                .query_row(
                    "SELECT envelope, extra FROM jobs WHERE id = ?1",
                    params![id],
                    |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
                )
                .optional()?;
            row.map(|(envelope, extra)| decode(&id, &envelope, &extra))
                .transpose()
        })
        .await
    }

    /// Scheduled jobs due at `now`, oldest first.
    pub async fn due(&self, now: DateTime<Utc>, limit: usize) -> Result<Vec<Job>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, envelope, extra FROM jobs WHERE state = 'scheduled' AND due_ms <= ?1
                 ORDER BY due_ms LIMIT ?2",
            )?;
            let rows = stmt.query_map(params![ms(now), limit as i64], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?;
            rows.map(|r| {
                let (id, envelope, extra) = r?;
                decode(&id, &envelope, &extra)
            })
            .collect()
        })
        .await
    }

    /// When the next scheduled job is due, if any is.
    pub async fn next_due(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.read(|conn| {
            let at: Option<i64> = conn.query_row(
                "SELECT min(due_ms) FROM jobs WHERE state = 'scheduled'",
                [],
                |r| r.get(0),
            )?;
            Ok(at.and_then(DateTime::from_timestamp_millis))
        })
        .await
    }

    /// Available jobs stored before `before` whose publish was never
    /// confirmed (the daemon stopped in between): publish them again.
    pub async fn unpublished(
        &self,
        before: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<Job>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, envelope, extra FROM jobs
                 WHERE published = 0 AND state = 'available' AND created_ms < ?1 LIMIT ?2",
            )?;
            let rows = stmt.query_map(params![ms(before), limit as i64], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?;
            rows.map(|r| {
                let (id, envelope, extra) = r?;
                decode(&id, &envelope, &extra)
            })
            .collect()
        })
        .await
    }

    /// Queues that have had a job, with when the first arrived.
    pub async fn queues(&self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        self.read(|conn| {
            let mut stmt =
                conn.prepare_cached("SELECT name, created_ms FROM queues ORDER BY name")?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            rows.map(|r| {
                let (name, at) = r?;
                Ok((
                    name,
                    DateTime::from_timestamp_millis(at).unwrap_or_default(),
                ))
            })
            .collect()
        })
        .await
    }

    /// Events matching `filter`, oldest first, and whether more match.
    pub async fn events(&self, filter: EventFilter) -> Result<(Vec<Event>, bool), StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT seq, id, type, job_id, queue, job_type, time_ms, data FROM events
                 WHERE seq > ?1 ORDER BY seq",
            )?;
            let mut rows = stmt.query(params![filter.after])?;
            let mut out = Vec::new();
            let wanted = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == v);
            while let Some(r) = rows.next()? {
                let (event_type, queue, job_type): (String, String, String) =
                    (r.get(2)?, r.get(4)?, r.get(5)?);
                if !wanted(&filter.types, &event_type)
                    || !wanted(&filter.queues, &queue)
                    || !wanted(&filter.job_types, &job_type)
                    || !(filter.scope.is_empty() || filter.scope.iter().any(|g| g.matches(&queue)))
                {
                    continue;
                }
                if out.len() == filter.limit {
                    return Ok((out, true));
                }
                let seq: i64 = r.get(0)?;
                let (id, job_id, time_ms, data): (String, String, i64, String) =
                    (r.get(1)?, r.get(3)?, r.get(6)?, r.get(7)?);
                let time = timestamp(DateTime::from_timestamp_millis(time_ms).unwrap_or_default());
                let data: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                out.push(Event {
                    seq,
                    body: json!({
                        "specversion": "1.0",
                        "id": id,
                        "type": event_type,
                        "source": "ojs-bridge",
                        "time": time,
                        "timestamp": time,
                        "subject": job_id,
                        "job_id": job_id,
                        "queue": queue,
                        "data": data,
                    }),
                });
            }
            Ok((out, false))
        })
        .await
    }
}

fn decode(id: &str, envelope: &str, extra: &str) -> Result<Job, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.to_owned(),
        reason,
    };
    let envelope =
        JobEnvelope::from_json_slice(envelope.as_bytes()).map_err(|e| corrupt(e.to_string()))?;
    let extra: Extra = serde_json::from_str(extra).map_err(|e| corrupt(e.to_string()))?;
    Ok(Job { envelope, extra })
}

fn encode(job: &Job) -> Result<(String, String), StoreError> {
    let envelope = job
        .envelope
        .to_json_vec()
        .map_err(|e| StoreError::Corrupt {
            id: job.envelope.id.clone(),
            reason: e.to_string(),
        })?;
    let envelope = String::from_utf8(envelope).map_err(|e| StoreError::Corrupt {
        id: job.envelope.id.clone(),
        reason: e.to_string(),
    })?;
    Ok((envelope, Value::Object(job.extra.clone()).to_string()))
}

fn state_name(s: JobState) -> &'static str {
    s.as_str().unwrap_or("unknown")
}

fn event(
    tx: &Connection,
    event_type: &str,
    job: &JobEnvelope,
    now: DateTime<Utc>,
    data: Value,
) -> Result<(), StoreError> {
    tx.prepare_cached(
        "INSERT INTO events (id, type, job_id, queue, job_type, time_ms, data)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        format!("evt_{}", uuid::Uuid::now_v7()),
        event_type,
        job.id,
        job.queue,
        job.job_type,
        ms(now),
        data.to_string(),
    ])?;
    Ok(())
}

fn insert(tx: &Connection, jobs: &[Job]) -> Result<(), StoreError> {
    for job in jobs {
        let e = &job.envelope;
        let exists: Option<i64> = tx
            .prepare_cached("SELECT 1 FROM jobs WHERE id = ?1")?
            .query_row(params![e.id], |r| r.get(0))
            .optional()?;
        if exists.is_some() {
            return Err(StoreError::Duplicate(e.id.clone()));
        }
        let (envelope, extra) = encode(job)?;
        let state = job.state();
        let due = (state == JobState::Scheduled)
            .then(|| e.scheduled_at.map(ms))
            .flatten();
        let created = e.created_at.map_or(0, ms);
        tx.prepare_cached(
            "INSERT INTO jobs (id, queue, state, due_ms, published, created_ms, envelope, extra)
             VALUES (?1, ?2, ?3, ?4, 0, ?5, ?6, ?7)",
        )?
        .execute(params![
            e.id,
            e.queue,
            state_name(state),
            due,
            created,
            envelope,
            extra
        ])?;
        tx.prepare_cached("INSERT OR IGNORE INTO queues (name, created_ms) VALUES (?1, ?2)")?
            .execute(params![e.queue, created])?;
        let now = e.created_at.unwrap_or_else(Utc::now);
        let name = if state == JobState::Scheduled {
            "job.scheduled"
        } else {
            "job.enqueued"
        };
        event(
            tx,
            name,
            e,
            now,
            json!({"job_type": e.job_type, "queue": e.queue, "state": state_name(state)}),
        )?;
    }
    Ok(())
}

fn load(tx: &Connection, id: &str) -> Result<Job, StoreError> {
    let row = tx
        .prepare_cached("SELECT envelope, extra FROM jobs WHERE id = ?1")?
        .query_row(params![id], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })
        .optional()?;
    let (envelope, extra) = row.ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    decode(id, &envelope, &extra)
}

fn save(tx: &Connection, job: &Job, finished: Option<DateTime<Utc>>) -> Result<(), StoreError> {
    let (envelope, extra) = encode(job)?;
    tx.prepare_cached(
        "UPDATE jobs SET state = ?2, envelope = ?3, extra = ?4, finished_ms = ?5 WHERE id = ?1",
    )?
    .execute(params![
        job.envelope.id,
        state_name(job.state()),
        envelope,
        extra,
        finished.map(ms)
    ])?;
    Ok(())
}

fn cancel(tx: &Connection, id: &str, now: DateTime<Utc>) -> Result<(JobState, Job), StoreError> {
    let mut job = load(tx, id)?;
    let previous = job.state();
    if matches!(
        previous,
        JobState::Completed | JobState::Cancelled | JobState::Discarded | JobState::Other(_)
    ) {
        return Err(StoreError::WrongState {
            id: id.to_owned(),
            current: previous,
        });
    }
    job.envelope.state = Some(JobState::Cancelled);
    job.extra
        .insert("cancelled_at".into(), json!(timestamp(now)));
    job.extra
        .insert("previous_state".into(), json!(state_name(previous)));
    save(tx, &job, Some(now))?;
    event(
        tx,
        "job.cancelled",
        &job.envelope,
        now,
        json!({"job_type": job.envelope.job_type, "queue": job.envelope.queue, "previous_state": state_name(previous)}),
    )?;
    Ok((previous, job))
}

fn promote(tx: &Connection, ids: &[String], now: DateTime<Utc>) -> Result<(), StoreError> {
    for id in ids {
        let mut job = match load(tx, id) {
            Ok(job) => job,
            Err(StoreError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        // Cancelled (or anything else) while it was being published: the
        // worker side skips it on the broker.
        if job.state() != JobState::Scheduled {
            continue;
        }
        job.envelope.state = Some(JobState::Available);
        job.envelope.enqueued_at = Some(now);
        save(tx, &job, None)?;
        tx.prepare_cached("UPDATE jobs SET published = 1, due_ms = NULL WHERE id = ?1")?
            .execute(params![id])?;
        event(
            tx,
            "job.enqueued",
            &job.envelope,
            now,
            json!({"job_type": job.envelope.job_type, "queue": job.envelope.queue, "state": "available"}),
        )?;
    }
    Ok(())
}

fn write_loop(mut conn: Connection, rx: mpsc::Receiver<WriteBox>) {
    while let Ok(first) = rx.recv() {
        let mut group = vec![first.0];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(w) => group.push(w.0),
                Err(_) => break,
            }
        }
        let results = commit_group(&mut conn, &group);
        deliver(group, results);
    }
}

/// What one request produced, before its reply is sent (after the commit).
enum Outcome {
    Unit(Result<(), StoreError>),
    Cancelled(Result<Box<(JobState, Job)>, StoreError>),
    Pruned(Result<u64, StoreError>),
}

fn commit_group(conn: &mut Connection, group: &[Write]) -> Vec<Outcome> {
    let tx = match rusqlite::Transaction::new(conn, rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            let reason = e.to_string();
            return group.iter().map(|_| failed(&reason)).collect();
        }
    };
    let mut outcomes = Vec::with_capacity(group.len());
    for write in group {
        let outcome = match write {
            Write::Insert { jobs, .. } => Outcome::Unit(in_savepoint(&tx, |c| insert(c, jobs))),
            Write::Published { ids } => Outcome::Unit(in_savepoint(&tx, |c| {
                let mut stmt = c.prepare_cached("UPDATE jobs SET published = 1 WHERE id = ?1")?;
                for id in ids {
                    stmt.execute(params![id])?;
                }
                Ok(())
            })),
            Write::Remove { ids, .. } => Outcome::Unit(in_savepoint(&tx, |c| {
                let mut jobs =
                    c.prepare_cached("DELETE FROM jobs WHERE id = ?1 AND published = 0")?;
                let mut events = c.prepare_cached("DELETE FROM events WHERE job_id = ?1")?;
                for id in ids {
                    if jobs.execute(params![id])? > 0 {
                        events.execute(params![id])?;
                    }
                }
                Ok(())
            })),
            Write::Cancel { id, now, .. } => {
                Outcome::Cancelled(in_savepoint(&tx, |c| cancel(c, id, *now)).map(Box::new))
            }
            Write::Promote { ids, now, .. } => {
                Outcome::Unit(in_savepoint(&tx, |c| promote(c, ids, *now)))
            }
            Write::Prune { before, .. } => Outcome::Pruned(in_savepoint(&tx, |c| {
                let cut = ms(*before);
                let jobs = c
                    .prepare_cached(
                        "DELETE FROM jobs WHERE finished_ms IS NOT NULL AND finished_ms < ?1",
                    )?
                    .execute(params![cut])?;
                c.prepare_cached("DELETE FROM events WHERE time_ms < ?1")?
                    .execute(params![cut])?;
                Ok(jobs as u64)
            })),
        };
        outcomes.push(outcome);
    }
    if let Err(e) = tx.commit() {
        let reason = e.to_string();
        return group.iter().map(|_| failed(&reason)).collect();
    }
    outcomes
}

fn failed(reason: &str) -> Outcome {
    Outcome::Unit(Err(StoreError::Commit(reason.to_owned())))
}

/// Runs one request in a savepoint of the group's transaction: its failure
/// undoes its own writes and nobody else's.
fn in_savepoint<T>(
    conn: &Connection,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    conn.execute_batch("SAVEPOINT request")?;
    match f(conn) {
        Ok(v) => {
            conn.execute_batch("RELEASE request")?;
            Ok(v)
        }
        Err(e) => {
            conn.execute_batch("ROLLBACK TO request; RELEASE request")?;
            Err(e)
        }
    }
}

fn deliver(group: Vec<Write>, results: Vec<Outcome>) {
    for (write, outcome) in group.into_iter().zip(results) {
        match (write, outcome) {
            (Write::Insert { reply, .. }, Outcome::Unit(r))
            | (Write::Remove { reply, .. }, Outcome::Unit(r))
            | (Write::Promote { reply, .. }, Outcome::Unit(r)) => {
                let _ = reply.send(r);
            }
            (Write::Cancel { reply, .. }, Outcome::Cancelled(r)) => {
                let _ = reply.send(r.map(|b| *b));
            }
            (Write::Cancel { reply, .. }, Outcome::Unit(Err(e))) => {
                let _ = reply.send(Err(e));
            }
            (Write::Prune { reply, .. }, Outcome::Pruned(r)) => {
                let _ = reply.send(r);
            }
            (Write::Prune { reply, .. }, Outcome::Unit(Err(e))) => {
                let _ = reply.send(Err(e));
            }
            // `Published` has no reply; other pairs are not built above.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: Option<&str>) -> Job {
        let mut body = json!({"type": "a.b", "args": [1]});
        if let Some(id) = id {
            body["id"] = json!(id);
        }
        crate::job::from_json(body, Utc::now()).unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inserts_are_all_or_nothing_and_cancel_follows_the_state_machine(
    ) -> Result<(), StoreError> {
        let dir =
            std::env::temp_dir().join(format!("ojs-api-store-{}", uuid::Uuid::new_v4().simple()));
        let store = Store::open(&dir).await?;
        let first = job(None);
        let id = first.envelope.id.clone();
        store.insert(vec![first]).await?;
        // A batch holding a stored id stores none of its jobs.
        let fresh = job(None);
        let fresh_id = fresh.envelope.id.clone();
        match store.insert(vec![fresh, job(Some(&id))]).await {
            Err(StoreError::Duplicate(d)) => assert_eq!(d, id),
            other => panic!("{other:?}"),
        }
        assert!(store.get(fresh_id).await?.is_none());
        // Concurrent requests share commits; each gets its own answer.
        let handles: Vec<_> = (0..64)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.insert(vec![job(None)]).await })
            })
            .collect();
        for h in handles {
            assert!(h.await.is_ok_and(|r| r.is_ok()));
        }
        let (previous, cancelled) = store.cancel(id.clone(), Utc::now()).await?;
        assert_eq!(previous, JobState::Available);
        assert_eq!(cancelled.state(), JobState::Cancelled);
        assert!(cancelled.extra.contains_key("cancelled_at"));
        match store.cancel(id.clone(), Utc::now()).await {
            Err(StoreError::WrongState { current, .. }) => assert_eq!(current, JobState::Cancelled),
            other => panic!("{other:?}"),
        }
        match store
            .cancel(crate::job::timestamp(Utc::now()), Utc::now())
            .await
        {
            Err(StoreError::NotFound(_)) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(
            store.get(id).await?.map(|j| j.state()),
            Some(JobState::Cancelled)
        );
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
