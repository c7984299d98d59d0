//! The embedded store: one SQLite file (`jobs.sqlite` in the data
//! directory), for one process.
//!
//! Writes go through one thread that commits everything that arrived while
//! the previous commit ran in one transaction (each request in its own
//! savepoint, so one request's failure leaves the others; a transition
//! whose checks all come before its writes, an ACK or a PUSH without unique
//! keys, needs none): a thousand concurrent PUSHes cost a few fsyncs, not a
//! thousand. Reads use other connections (WAL readers do not wait for the
//! writer), and checkpoints one more, on a thread of its own
//! ([`ojs_sqlite::Checkpointer`]): a commit no longer waits for the log to
//! be copied into the file.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::JobState;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use super::sql;
use super::{
    claim_unique_keys, decode, due_ms, encode, event_body, keep_unique_keys, ms, rate_key_seen,
    record_of, record_text, state_name, stored_event, unanswered, Durability, EventFilter,
    EventPage, Inserted, Isolation, QueueJobs, RunFn, StoreError, Tx, Uniques, MAX_EVENTS_SCANNED,
    RATE_ACTIVE, RATE_WINDOW_SLACK_MS,
};
use super::{count_priorities, Bound, JobCounts, JobQuery, Subject};
use crate::job::Job;
use crate::model::cron::CronJob;
use crate::model::rate::KeyState;
use crate::model::unique::Uniqueness;
use crate::model::workflow::Workflow;
use crate::model::EventData;
use crate::roster::WorkerRecord;
use recent::Recent;

mod recent;

/// The store's file in the data directory.
pub const STORE_FILE: &str = "jobs.sqlite";
/// `PRAGMA application_id` of the file ("OJSA"), so another program's
/// SQLite file is refused, not changed.
const APPLICATION_ID: i64 = 0x4f4a_5341;
/// `PRAGMA user_version` this build writes. Version 1 marked every job
/// published with an UPDATE of its row and gave each event a random id;
/// version 2 keeps a watermark in `meta` and numbers events by `seq`.
/// Version 4 adds the workers' records (`crate::roster`), 5 unique keys, 6
/// cron jobs, roles (`crate::cron`), paused queues and rate-limit windows,
/// 7 workflows, 8 rate-limit keys with the jobs filed under them (in place
/// of the windows) and queue configurations, 9 the jobs counted by queue and
/// state (`job_counts`, kept by the writer: [`Tally`]), 10 indexes by when
/// they are due only the scheduled jobs (`jobs_scheduled`, in place of
/// `jobs_due` on every job's state and due time, which each change of state
/// rewrote), 11 numbers events itself (`events` without `AUTOINCREMENT`,
/// the highest number given kept in `meta` when events are deleted) and
/// indexes them by job (`events_job`: deleting a job read every event), 12
/// keeps the numbers of a job's events on its row (`jobs.event_seqs`) in
/// place of that index, which every event's insert paid for (5 % of a
/// FETCH + ACK's instructions): a row is written with each of its job's
/// transitions anyway.
const SCHEMA_VERSION: i64 = 12;
/// Requests one commit takes at most.
const MAX_GROUP: usize = 4096;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    queue       TEXT NOT NULL,
    state       TEXT NOT NULL,
    due_ms      INTEGER,
    created_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    envelope    TEXT NOT NULL,
    extra       TEXT NOT NULL DEFAULT '{}',
    dead        INTEGER NOT NULL DEFAULT 0,
    event_seqs  TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_scheduled ON jobs (due_ms) WHERE state = 'scheduled';
CREATE INDEX IF NOT EXISTS jobs_dead ON jobs (finished_ms) WHERE dead = 1;
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_ms);
CREATE INDEX IF NOT EXISTS jobs_queue_created ON jobs (queue, created_ms);
CREATE INDEX IF NOT EXISTS jobs_state_created ON jobs (state, created_ms);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (key, value) VALUES ('published_through', 0);
CREATE TABLE IF NOT EXISTS queues (
    name       TEXT PRIMARY KEY,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq      INTEGER PRIMARY KEY,
    type     TEXT NOT NULL,
    job_id   TEXT NOT NULL,
    queue    TEXT NOT NULL,
    job_type TEXT NOT NULL,
    time_ms  INTEGER NOT NULL,
    data     TEXT NOT NULL
);
INSERT OR IGNORE INTO meta (key, value) VALUES ('events_through', 0);
CREATE TABLE IF NOT EXISTS workers (
    id      TEXT PRIMARY KEY,
    seen_ms INTEGER NOT NULL,
    record  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS unique_keys (
    job_id TEXT PRIMARY KEY,
    key    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS unique_keys_key ON unique_keys (key);
CREATE TABLE IF NOT EXISTS crons (
    name   TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS paused_queues (
    name      TEXT PRIMARY KEY,
    paused_ms INTEGER NOT NULL
);
DROP TABLE IF EXISTS rate_windows;
CREATE TABLE IF NOT EXISTS rate_keys (
    key     TEXT PRIMARY KEY,
    seen_ms INTEGER NOT NULL,
    record  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rate_jobs (
    job_id TEXT NOT NULL,
    key    TEXT NOT NULL,
    state  TEXT NOT NULL,
    PRIMARY KEY (job_id, key)
);
CREATE INDEX IF NOT EXISTS rate_jobs_by_key ON rate_jobs (key, state);
CREATE TABLE IF NOT EXISTS queue_configs (
    name   TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS leaders (
    role     TEXT PRIMARY KEY,
    holder   TEXT NOT NULL,
    until_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS workflows (
    id          TEXT PRIMARY KEY,
    state       TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    finished_ms INTEGER,
    record      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS workflows_by_state ON workflows (state, created_ms);
CREATE INDEX IF NOT EXISTS workflows_by_created ON workflows (created_ms);
CREATE INDEX IF NOT EXISTS workflows_finished ON workflows (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE TABLE IF NOT EXISTS system (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_counts (
    queue TEXT NOT NULL,
    state TEXT NOT NULL,
    n     INTEGER NOT NULL,
    PRIMARY KEY (queue, state)
) WITHOUT ROWID;
";

/// Before version 11 events were numbered by SQLite (`AUTOINCREMENT`, which
/// reads and rewrites `sqlite_sequence` on every insert): their table is
/// copied into one the writer numbers, and the highest number SQLite gave
/// (deleted events included) is kept, so that no number is given twice.
const NUMBER_EVENTS: &str = "
CREATE TABLE events_numbered (
    seq      INTEGER PRIMARY KEY,
    type     TEXT NOT NULL,
    job_id   TEXT NOT NULL,
    queue    TEXT NOT NULL,
    job_type TEXT NOT NULL,
    time_ms  INTEGER NOT NULL,
    data     TEXT NOT NULL
);
INSERT INTO events_numbered (seq, type, job_id, queue, job_type, time_ms, data)
    SELECT seq, type, job_id, queue, job_type, time_ms, data FROM events ORDER BY seq;
DROP TABLE events;
ALTER TABLE events_numbered RENAME TO events;
";

/// From version 11 (or before): each job's row lists the numbers of its
/// events (`,12,15,19`), found once through the index of the log by job
/// (or, before version 11, one sort of the log); that index goes after.
const LIST_JOB_EVENTS: &str = "
ALTER TABLE jobs ADD COLUMN event_seqs TEXT NOT NULL DEFAULT '';
UPDATE jobs SET event_seqs = listed.seqs
    FROM (SELECT job_id, group_concat(',' || seq, '') AS seqs FROM events GROUP BY job_id) AS listed
    WHERE jobs.id = listed.job_id;
";

/// Appends one event under the number the writer gives it.
const INSERT_EVENT: &str = "INSERT INTO events (seq, type, job_id, queue, job_type, time_ms, data)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

/// Keeps the highest event number given before events are deleted: the
/// next start numbers from above it even when the newest are gone.
const KEEP_EVENTS_THROUGH: &str =
    "UPDATE meta SET value = max(value, ?1) WHERE key = 'events_through'";

/// Events from before `?1`, the oldest first, up to the first that is not:
/// the events are in the order of their time (one writer stamps them), so
/// a prune reads the ones it deletes and one more, not the whole log. One
/// stamped before an older one (the clock set back) waits for the next
/// prune after those before it.
const PRUNE_EVENTS: &str = "DELETE FROM events WHERE seq < coalesce(
    (SELECT seq FROM events WHERE time_ms >= ?1 ORDER BY seq LIMIT 1),
    (SELECT max(seq) + 1 FROM events))";

/// Before version 9 the counts were not kept: they are counted once, in the
/// migration's transaction.
const COUNT_JOBS: &str = "
DELETE FROM job_counts;
INSERT INTO job_counts (queue, state, n) SELECT queue, state, count(*) FROM jobs GROUP BY queue, state;
";

/// From version 1: the broker-confirmed mark of each row becomes the
/// watermark (every available job at or below it was confirmed), and
/// events lose their random ids.
/// From version 2: dead letters are marked, so that they are listed
/// without reading every discarded job.
const MIGRATE_2_TO_3: &str = "
ALTER TABLE jobs ADD COLUMN dead INTEGER NOT NULL DEFAULT 0;
";

const MIGRATE_1_TO_2: &str = "
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR REPLACE INTO meta (key, value) VALUES ('published_through', coalesce(
    (SELECT min(rowid) - 1 FROM jobs WHERE published = 0 AND state = 'available'),
    (SELECT max(rowid) FROM jobs),
    0));
DROP INDEX IF EXISTS jobs_unpublished;
ALTER TABLE jobs DROP COLUMN published;
ALTER TABLE events DROP COLUMN id;
";

enum Write {
    Insert {
        jobs: Vec<Job>,
        uniques: Uniques,
        reply: oneshot::Sender<Result<Vec<Inserted>, StoreError>>,
    },
    Published {
        ids: Vec<String>,
    },
    Remove {
        ids: Vec<String>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Prune {
        before: DateTime<Utc>,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    /// A transition of the worker side, run in its own savepoint unless
    /// it checks first; it may number new rows from the writer's counter.
    Run {
        /// Taken when it runs.
        f: Option<RunFn>,
        isolation: Isolation,
        reply: oneshot::Sender<Result<Box<dyn Any + Send>, StoreError>>,
    },
}

/// The embedded store: a writer thread and a reader connection.
#[derive(Debug, Clone)]
pub(super) struct SqliteStore {
    writes: mpsc::Sender<Request>,
    readers: Arc<Readers>,
    path: PathBuf,
    /// The watermark and the last job number when the store was opened:
    /// available jobs between them may never have reached the broker.
    recover: (i64, i64),
    /// Whether the writer's commits fail.
    health: Arc<WriterHealth>,
    /// Reads waiting for a connection wait here, not on a blocking thread
    /// each: a thousand event streams reading at once used to start
    /// hundreds of threads (and their allocator heaps) that only waited.
    /// Point reads may take any connection; the others all but one.
    point_slots: Arc<tokio::sync::Semaphore>,
    list_slots: Arc<tokio::sync::Semaphore>,
}

/// Reader connections: a long read (the event log, a list) does not hold
/// up the others; the first is kept for point reads (INFO).
const READERS: usize = 4;

/// The reader connections, each used by one read at a time.
#[derive(Debug)]
struct Readers {
    connections: Vec<Mutex<Connection>>,
    next: std::sync::atomic::AtomicUsize,
}

impl Readers {
    /// The connection of point reads (the first), or any free one.
    fn point(&self) -> std::sync::MutexGuard<'_, Connection> {
        for conn in &self.connections {
            if let Ok(conn) = conn.try_lock() {
                return conn;
            }
        }
        self.connections[0]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A free connection other than the point reads', else the next in
    /// turn once it is free.
    fn take(&self) -> std::sync::MutexGuard<'_, Connection> {
        let start = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = self.connections.len() - 1;
        for i in 0..n {
            if let Ok(conn) = self.connections[1 + (start + i) % n].try_lock() {
                return conn;
            }
        }
        self.connections[1 + start % n]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// What the writer thread is sent: a write, or the store's close (its log
/// checkpointed and emptied between two commits, answered whether it was).
enum Request {
    Write(Write),
    Close(oneshot::Sender<Result<bool, StoreError>>),
}

// `Write` is not `Debug` (it holds reply channels); the channel needs it.
impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Request::Write(_) => "Write",
            Request::Close(_) => "Close",
        })
    }
}

fn open_connection(path: &Path, durability: Durability) -> Result<Connection, StoreError> {
    let open_err = |reason: String| StoreError::Open {
        place: path.display().to_string(),
        reason,
    };
    let conn = ojs_sqlite::open(
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
    let sync = match durability {
        Durability::Process => "NORMAL",
        Durability::Power => "FULL",
    };
    conn.execute_batch(&format!("PRAGMA synchronous = {sync};"))?;
    Ok(conn)
}

/// The statements of an admin job listing on SQLite: how many jobs match
/// (counted up to [`super::LIST_COUNT_LIMIT`] and one), one page of them,
/// and the values both bind.
struct JobList {
    count: String,
    page: String,
    values: Vec<rusqlite::types::Value>,
}

impl JobList {
    fn new(query: &JobQuery, limit: usize, offset: usize) -> JobList {
        let (filter, order, values) =
            query.sql("json_extract(envelope, '$.type')", "rowid", None, |n| {
                format!("?{n}")
            });
        // Without statistics SQLite takes the index of states by creation
        // and sorts the state's jobs for one page: the partial index of
        // scheduled jobs is named (as it was chosen when every state's jobs
        // were indexed by due time), which reads a page in order.
        let jobs = if query.scheduled_by_due_time() {
            "jobs INDEXED BY jobs_scheduled"
        } else {
            "jobs"
        };
        JobList {
            count: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {jobs} WHERE {filter} LIMIT {})",
                super::LIST_COUNT_LIMIT + 1
            ),
            page: format!(
                "SELECT id, envelope, extra FROM {jobs} WHERE {filter} ORDER BY {order} \
                 LIMIT {} OFFSET {}",
                i64::try_from(limit).unwrap_or(i64::MAX),
                i64::try_from(offset).unwrap_or(i64::MAX),
            ),
            values: values
                .into_iter()
                .map(|v| match v {
                    Bound::Text(t) => rusqlite::types::Value::Text(t),
                    Bound::Int(i) => rusqlite::types::Value::Integer(i),
                })
                .collect(),
        }
    }
}

impl SqliteStore {
    /// Opens (creating when needed) the store in `dir`.
    pub(super) async fn open(
        dir: &Path,
        durability: Durability,
    ) -> Result<SqliteStore, StoreError> {
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(&dir, durability))
            .await
            .map_err(|e| StoreError::Open {
                place: STORE_FILE.to_owned(),
                reason: e.to_string(),
            })?
    }

    fn open_blocking(dir: &Path, durability: Durability) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
            place: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let path = dir.join(STORE_FILE);
        let mut writer = open_connection(&path, durability)?;
        if let Err(e) =
            ojs_sqlite::set_lookaside(&writer, WRITER_LOOKASIDE_BYTES, WRITER_LOOKASIDE_SLOTS)
        {
            tracing::warn!(error = %e, "the job store's writer keeps SQLite's default lookaside; its statements' values go to malloc sooner");
        }
        let tally = RefCell::new(Tally::default());
        // The writer's page cache is kept small (2 MiB, about the 2,000 KiB
        // of SQLite's default that the readers keep): what it writes is the
        // tails of the tables and indexes. A large one costs commits: when a B-tree balance splits
        // pages, SQLite gives one for a moment the number of the 1 GiB lock
        // page, the cache then counts that as its highest page, and the
        // commit, which drops pages past the end of the file, walks every
        // page cached instead of the few past the end. With 32 MiB that
        // walk was 7-9 % of the daemon's CPU under FETCH + ACK.
        writer.execute_batch("PRAGMA cache_size = -2048;")?;
        let version: i64 = writer.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        let tx = writer.transaction()?;
        if version == 1 {
            tx.execute_batch(MIGRATE_1_TO_2)?;
        }
        if version == 1 || version == 2 {
            tx.execute_batch(MIGRATE_2_TO_3)?;
        }
        if version < 10 {
            tx.execute_batch("DROP INDEX IF EXISTS jobs_due;")?;
        }
        if (1..11).contains(&version) {
            // SQLite makes `sqlite_sequence` with the first table that has
            // `AUTOINCREMENT`: without it, it gave no number.
            let numbered: bool = tx.query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE name = 'sqlite_sequence'",
                [],
                |r| r.get(0),
            )?;
            let given: i64 = if numbered {
                tx.query_row(
                    "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
                    [],
                    |r| r.get(0),
                )?
            } else {
                0
            };
            tx.execute_batch(NUMBER_EVENTS)?;
            tx.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('events_through', ?1)",
                params![given],
            )?;
        }
        if (1..12).contains(&version) {
            // A file set back to an older version keeps its newer columns.
            let listed: bool = tx.query_row(
                "SELECT count(*) > 0 FROM pragma_table_info('jobs') WHERE name = 'event_seqs'",
                [],
                |r| r.get(0),
            )?;
            if !listed {
                tx.execute_batch(LIST_JOB_EVENTS)?;
            }
            tx.execute_batch("DROP INDEX IF EXISTS events_job;")?;
        }
        tx.execute_batch(SCHEMA)?;
        if version < 9 {
            tx.execute_batch(COUNT_JOBS)?;
        }
        tx.execute_batch(&format!(
            "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {SCHEMA_VERSION};"
        ))?;
        tx.commit()?;
        let confirmed = Confirmed::load(&writer)?;
        let next_event: i64 = writer.query_row(
            "SELECT max((SELECT value FROM meta WHERE key = 'events_through'),
                        coalesce((SELECT max(seq) FROM events), 0)) + 1",
            [],
            |r| r.get(0),
        )?;
        let recover = (confirmed.persisted, confirmed.next_seq - 1);
        let reader = Arc::new(Readers {
            connections: (0..READERS)
                .map(|_| open_connection(&path, durability).map(Mutex::new))
                .collect::<Result<_, _>>()?,
            next: std::sync::atomic::AtomicUsize::new(0),
        });
        let (tx, rx) = mpsc::channel::<Request>();
        // The writer thread keeps the reader alive until it has closed the
        // writer: SQLite's unix VFS deadlocks when two connections to one
        // file close at the same time on two threads (one holds the global
        // VFS mutex and waits for the file's, the other the reverse; seen
        // as a daemon that never exited after SIGTERM).
        let keep_reader = reader.clone();
        let checkpoints = open_connection(&path, durability)?;
        let health = Arc::new(WriterHealth::default());
        let writer_health = health.clone();
        std::thread::Builder::new()
            .name("ojs-api-store".into())
            .spawn(move || {
                // Checkpoints run on a thread of their own, stopped (its
                // connection closed) before the writer's connection closes
                // (one connection closing at a time, as above).
                let checkpointer =
                    ojs_sqlite::Checkpointer::start(STORE_FILE, checkpoints, &writer);
                write_loop(
                    writer,
                    rx,
                    (confirmed, next_event),
                    &writer_health,
                    &tally,
                    checkpointer,
                );
                drop(keep_reader);
            })
            .map_err(|e| StoreError::Open {
                place: path.display().to_string(),
                reason: format!("cannot start the writer thread: {e}"),
            })?;
        Ok(SqliteStore {
            writes: tx,
            readers: reader,
            path,
            recover,
            health,
            point_slots: Arc::new(tokio::sync::Semaphore::new(READERS)),
            list_slots: Arc::new(tokio::sync::Semaphore::new(READERS - 1)),
        })
    }

    async fn write<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Write,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.writes
            .send(Request::Write(make(tx)))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.read_on(false, f).await
    }

    /// A read on a connection of its own kind: `point` reads (one job by
    /// its key) have one that lists and log reads never take, so that
    /// INFO does not wait behind them.
    async fn read_on<T: Send + 'static>(
        &self,
        point: bool,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let slots = if point {
            &self.point_slots
        } else {
            &self.list_slots
        };
        let _slot = slots.acquire().await.map_err(|_| StoreError::Closed)?;
        let readers = self.readers.clone();
        tokio::task::spawn_blocking(move || {
            let conn = if point {
                readers.point()
            } else {
                readers.take()
            };
            f(&conn)
        })
        .await
        .map_err(|_| StoreError::Closed)?
    }
}

#[async_trait::async_trait]
impl super::JobStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn insert(&self, jobs: Vec<Job>, uniques: Uniques) -> Result<Vec<Inserted>, StoreError> {
        self.write(|reply| Write::Insert {
            jobs,
            uniques,
            reply,
        })
        .await
    }

    fn published(&self, ids: Vec<String>) {
        let _ = self.writes.send(Request::Write(Write::Published { ids }));
    }

    async fn remove(&self, ids: Vec<String>) -> Result<(), StoreError> {
        self.write(|reply| Write::Remove { ids, reply }).await
    }

    async fn run(&self, f: RunFn, isolation: Isolation) -> Result<Box<dyn Any + Send>, StoreError> {
        self.write(|reply| Write::Run {
            f: Some(f),
            isolation,
            reply,
        })
        .await
    }

    async fn prune(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        self.write(|reply| Write::Prune { before, reply }).await
    }

    async fn get(&self, id: String) -> Result<Option<Job>, StoreError> {
        self.read_on(true, move |conn| {
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

    async fn due(&self, now: DateTime<Utc>, limit: usize) -> Result<Vec<Job>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, envelope, extra FROM jobs INDEXED BY jobs_scheduled
                 WHERE state = 'scheduled' AND due_ms <= ?1 ORDER BY due_ms LIMIT ?2",
            )?;
            jobs(&mut stmt, params![ms(now), limit as i64])
        })
        .await
    }

    async fn next_due(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.read(|conn| {
            let at: Option<i64> = conn.query_row(
                "SELECT min(due_ms) FROM jobs INDEXED BY jobs_scheduled WHERE state = 'scheduled'",
                [],
                |r| r.get(0),
            )?;
            Ok(at.and_then(DateTime::from_timestamp_millis))
        })
        .await
    }

    async fn unpublished(&self, limit: usize) -> Result<Vec<Job>, StoreError> {
        let (above, through) = self.recover;
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, envelope, extra FROM jobs
                 WHERE (rowid > ?1 AND rowid <= ?2 AND state = 'available') OR dead = 2
                 ORDER BY rowid LIMIT ?3",
            )?;
            jobs(&mut stmt, params![above, through, limit as i64])
        })
        .await
    }

    async fn dead_letters(&self) -> Result<Vec<Job>, StoreError> {
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, envelope, extra FROM jobs WHERE dead = 1 ORDER BY finished_ms, rowid",
            )?;
            jobs(&mut stmt, [])
        })
        .await
    }

    async fn queues(&self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(sql::QUEUES.sqlite)?;
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

    async fn events(&self, filter: EventFilter) -> Result<EventPage, StoreError> {
        self.read(move |conn| {
            let last: i64 =
                conn.query_row("SELECT coalesce(max(seq), 0) FROM events", [], |r| r.get(0))?;
            let until = filter.after.saturating_add(MAX_EVENTS_SCANNED).min(last);
            let (sql, lists) = filter.sql(|n| format!("?{n}"));
            let mut stmt = conn.prepare_cached(&sql)?;
            let mut values: Vec<&dyn rusqlite::ToSql> = vec![&filter.after, &until];
            values.extend(lists.iter().map(|v| v as &dyn rusqlite::ToSql));
            let mut rows = stmt.query(values.as_slice())?;
            let mut page = EventPage {
                cursor: until.max(filter.after),
                has_more: until < last,
                ..EventPage::default()
            };
            while let Some(r) = rows.next()? {
                let seq: i64 = r.get(0)?;
                let queue: String = r.get(3)?;
                if !filter.sees(&queue) {
                    continue;
                }
                if page.events.len() == filter.limit {
                    page.has_more = true;
                    page.cursor = page.events.last().map_or(filter.after, |e| e.seq);
                    return Ok(page);
                }
                let (event_type, job_id, job_type, time_ms, data): (
                    String,
                    String,
                    String,
                    i64,
                    String,
                ) = (r.get(1)?, r.get(2)?, r.get(4)?, r.get(5)?, r.get(6)?);
                page.events.push(event_body(
                    seq,
                    &event_type,
                    &job_id,
                    &queue,
                    &job_type,
                    time_ms,
                    &data,
                ));
            }
            Ok(page)
        })
        .await
    }

    fn place(&self) -> String {
        self.path.display().to_string()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        match self.health.down() {
            None => Ok(()),
            Some(reason) => Err(StoreError::Commit(reason)),
        }
    }

    async fn close(&self) -> Result<bool, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.writes
            .send(Request::Close(tx))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

/// The jobs a `SELECT id, envelope, extra …` statement finds.
fn jobs(
    stmt: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
) -> Result<Vec<Job>, StoreError> {
    let rows = stmt.query_map(params, |r| {
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
}

fn event(
    prepared: &Prepared<'_>,
    event_type: &str,
    job: &Subject<'_>,
    now: DateTime<Utc>,
    data: &EventData,
) -> Result<(), StoreError> {
    let seq = prepared.next_event.get();
    // Bound through `params!` rather than [`bind_event`] (the same order,
    // for the 16-row statement): one `raw_bind_parameter` a value cost a
    // FETCH + ACK 1.3k instructions more an event.
    prepared.run(&prepared.event, |s| {
        s.execute(params![
            seq,
            event_type,
            job.job_id,
            job.queue,
            job.job_type,
            ms(now),
            data.text(),
        ])
    })?;
    // A number is not given again even when its request or group is rolled
    // back: the log may have gaps, never a number twice.
    prepared.next_event.set(seq + 1);
    Ok(())
}

/// Binds one event's values after parameter `before` of `s`, in
/// [`INSERT_EVENT`]'s order.
fn bind_event(
    s: &mut rusqlite::Statement<'_>,
    before: usize,
    seq: i64,
    event_type: &str,
    job: &Subject<'_>,
    now: DateTime<Utc>,
    data: &EventData,
) -> rusqlite::Result<()> {
    let at = before + 1;
    s.raw_bind_parameter(at, seq)?;
    s.raw_bind_parameter(at + 1, event_type)?;
    s.raw_bind_parameter(at + 2, job.job_id)?;
    s.raw_bind_parameter(at + 3, job.queue)?;
    s.raw_bind_parameter(at + 4, job.job_type)?;
    s.raw_bind_parameter(at + 5, ms(now))?;
    s.raw_bind_parameter(at + 6, data.text())
}

/// Keeps the highest event number given so far in `meta`, before a
/// statement that may delete the newest events.
fn keep_events_through(prepared: &Prepared<'_>) -> Result<(), StoreError> {
    prepared
        .conn
        .prepare_cached(KEEP_EVENTS_THROUGH)?
        .execute(params![prepared.next_event.get() - 1])?;
    Ok(())
}

/// The statements of every job's insert and transitions, prepared once on
/// the writer's connection and kept for its life. Through rusqlite's statement
/// cache each use hashed the statement's text to take it out and again to
/// put it back (2–3 % of a FETCH + ACK's instructions).
struct Prepared<'c> {
    conn: &'c Connection,
    insert: Slot<'c>,
    /// [`INSERT_JOB`] and [`INSERT_EVENT`] of [`ROWS_PER_INSERT`] rows (a
    /// batch PUSH's): preparing them for each batch was a tenth of its
    /// store's work; kept, they need the writer's larger lookaside
    /// ([`WRITER_LOOKASIDE_SLOTS`]).
    insert_many: Slot<'c>,
    event_many: Slot<'c>,
    /// An insert's check of its ids ([`refuse_stored_ids`]).
    stored_id: Slot<'c>,
    add_queue: Slot<'c>,
    load: Slot<'c>,
    save: Slot<'c>,
    save_at_row: Slot<'c>,
    event: Slot<'c>,
    savepoint: Slot<'c>,
    release: Slot<'c>,
    data_version: Slot<'c>,
    /// Active jobs as the writer committed them.
    recent: RefCell<Recent>,
    /// The number the next event gets: one more than any given before, in
    /// the log or deleted from it (`events_through`).
    next_event: Cell<i64>,
}

/// One statement of [`Prepared`], prepared at its first use.
struct Slot<'c> {
    sql: &'static str,
    statement: RefCell<Option<rusqlite::Statement<'c>>>,
}

impl<'c> Slot<'c> {
    fn new(sql: &'static str) -> Slot<'c> {
        Slot {
            sql,
            statement: RefCell::new(None),
        }
    }
}

impl<'c> Prepared<'c> {
    fn new(conn: &'c Connection, next_event: i64) -> Prepared<'c> {
        // Without the hook nothing may be kept: a change the writer did
        // not make itself would go unseen.
        let changed = recent::Changed::default();
        let named = changed.clone();
        let hooked = conn.update_hook(Some(
            move |action: rusqlite::hooks::Action, _: &str, table: &str, row: i64| {
                // A new row cannot be one kept: the writer numbers rows
                // upwards and never again (a row kept and then deleted was
                // named when it was deleted). Every PUSH is inserts.
                if table == "jobs" && action != rusqlite::hooks::Action::SQLITE_INSERT {
                    named.lock().unwrap_or_else(|e| e.into_inner()).push(row);
                }
            },
        ));
        let limits = match hooked {
            Ok(()) => recent::Limits::WRITER,
            Err(e) => {
                tracing::warn!(error = %e, "the job store's writer reads every job from its row");
                recent::Limits::NONE
            }
        };
        Prepared {
            conn,
            recent: RefCell::new(Recent::new(changed, limits)),
            data_version: Slot::new("PRAGMA data_version"),
            insert: Slot::new(INSERT_JOB),
            insert_many: Slot::new(insert_jobs_many()),
            event_many: Slot::new(insert_events_many()),
            stored_id: Slot::new(STORED_ID),
            add_queue: Slot::new(ADD_QUEUE),
            load: Slot::new(LOAD_JOB),
            save: Slot::new(SAVE_JOB),
            save_at_row: Slot::new(SAVE_JOB_AT_ROW),
            event: Slot::new(INSERT_EVENT),
            savepoint: Slot::new("SAVEPOINT request"),
            release: Slot::new("RELEASE request"),
            next_event: Cell::new(next_event),
        }
    }

    /// Runs `f` on `slot`'s statement, preparing it first if it is not yet.
    /// A statement is used by one call at a time: `f` runs no other.
    fn run<T>(
        &self,
        slot: &Slot<'c>,
        f: impl FnOnce(&mut rusqlite::Statement<'c>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        let mut statement = slot.statement.borrow_mut();
        let statement = match &mut *statement {
            Some(s) => s,
            none => none.insert(self.conn.prepare(slot.sql)?),
        };
        f(statement)
    }
}

/// Inserts `jobs`, numbering rows from `next_seq`; the available ones
/// (to be published now) with their numbers.
fn insert(
    prepared: &Prepared<'_>,
    jobs: &[Job],
    next_seq: i64,
    tally: &RefCell<Tally>,
) -> Result<Vec<(String, i64)>, StoreError> {
    // Before any work on the rows: a refused batch encodes nothing.
    refuse_stored_ids(prepared, jobs)?;
    let mut queues: Vec<(&str, i64)> = Vec::new();
    let mut available = Vec::new();
    let mut rows = Vec::with_capacity(jobs.len());
    for (n, job) in jobs.iter().enumerate() {
        let seq = next_seq + n as i64;
        let e = &job.envelope;
        let (envelope, extra) = encode(job)?;
        let state = job.state();
        let created = e.created_at.map_or(0, ms);
        moved(tally, &e.queue, state_name(state), 1);
        if !queues.iter().any(|(q, _)| *q == e.queue) {
            queues.push((&e.queue, created));
        }
        if state == JobState::Available {
            available.push((e.id.clone(), seq));
        }
        rows.push(NewJobRow {
            seq,
            job,
            state,
            created,
            envelope,
            extra,
        });
    }
    let events: Vec<_> = jobs.iter().map(stored_event).collect();
    // Each chunk's rows, then their events: rows and events in the order
    // of the jobs, numbered as they go.
    let mut chunks = rows.chunks_exact(ROWS_PER_INSERT);
    let mut at = 0;
    for chunk in chunks.by_ref() {
        // Each row lists the number its event gets below.
        let seq = prepared.next_event.get();
        prepared.run(&prepared.insert_many, |insert_many| {
            for (i, row) in chunk.iter().enumerate() {
                row.bind(insert_many, i * JOB_COLUMNS, seq + i as i64)?;
            }
            let r = insert_many.raw_execute();
            // The kept statement would hold its copies of 16 envelopes.
            insert_many.clear_bindings();
            r
        })?;
        prepared.run(&prepared.event_many, |event_many| {
            for (i, row) in chunk.iter().enumerate() {
                let (name, time, data) = &events[at + i];
                bind_event(
                    event_many,
                    i * EVENT_COLUMNS,
                    seq + i as i64,
                    name,
                    &row.subject(),
                    *time,
                    data,
                )?;
            }
            let r = event_many.raw_execute();
            event_many.clear_bindings();
            r
        })?;
        // As in `event`: numbers of a group rolled back are not given again.
        prepared.next_event.set(seq + chunk.len() as i64);
        at += chunk.len();
    }
    for (row, (name, time, data)) in chunks.remainder().iter().zip(&events[at..]) {
        insert_row(prepared, row, prepared.next_event.get())?;
        event(prepared, name, &row.subject(), *time, data)?;
    }
    for (queue, created) in queues {
        prepared.run(&prepared.add_queue, |s| s.execute(params![queue, created]))?;
    }
    Ok(available)
}

/// The writer's lookaside (see `ojs_sqlite::set_lookaside`): slots of
/// SQLite's default size, five times its default number (600 KiB), so that
/// the statements it keeps prepared, the batch inserts of 16 rows among
/// them, leave room for the values of the statements it runs.
const WRITER_LOOKASIDE_BYTES: u16 = 1200;
const WRITER_LOOKASIDE_SLOTS: u16 = 500;

/// Rows one statement of a larger insert writes (jobs, and their events).
/// Each statement run opens its cursors on the table and each of its
/// indexes once, whatever its rows: a batch of 100 runs 6 statements and
/// 4 single rows, not 100.
const ROWS_PER_INSERT: usize = 16;
/// The `?` of one row of [`INSERT_JOB`].
const JOB_COLUMNS: usize = 9;
/// The `?` of one row of [`INSERT_EVENT`].
const EVENT_COLUMNS: usize = 7;

/// `sql` (an `INSERT INTO … VALUES` of one row) with [`ROWS_PER_INSERT`]
/// rows, `OR ROLLBACK`. SQLite keeps a journal of the pages a statement of
/// several rows changes, to undo it alone should a later row break a
/// constraint, unless that failure rolls the whole transaction back: with
/// 16 rows and their indexes those copies passed its 64 KiB in memory and
/// went through a temporary file, most of what a batch PUSH wrote. The
/// insert has checked its ids first ([`refuse_stored_ids`]), so no row
/// breaks a constraint short of a bug, and a rollback then fails its group
/// commit whole ([`Isolation::ChecksFirst`]).
fn many_rows(sql: &str, columns: usize) -> String {
    let (head, _) = sql.split_once("VALUES").unwrap_or((sql, ""));
    let head = head.replacen("INSERT INTO", "INSERT OR ROLLBACK INTO", 1);
    let row = format!("({})", vec!["?"; columns].join(", "));
    format!("{head}VALUES {}", vec![row; ROWS_PER_INSERT].join(", "))
}

/// Whether an id is stored (one prepared lookup an id: counted by
/// callgrind, within 1 % of one `IN` list of 16 ids a statement).
const STORED_ID: &str = "SELECT 1 FROM jobs WHERE id = ?1";

/// [`StoreError::Duplicate`] naming the first id of `jobs` given twice in
/// them, or else the first stored already, before anything is written: the
/// insert then needs no savepoint and its statements no journal
/// ([`many_rows`]). A lone job is not looked up: the INSERT of one row
/// checks its key before it writes anything ([`insert_row`]).
fn refuse_stored_ids(prepared: &Prepared<'_>, jobs: &[Job]) -> Result<(), StoreError> {
    if jobs.len() < 2 {
        return Ok(());
    }
    let duplicate = |id: &str| StoreError::Duplicate(id.to_owned());
    let mut seen = HashSet::with_capacity(jobs.len());
    if let Some(j) = jobs.iter().find(|j| !seen.insert(j.envelope.id.as_str())) {
        return Err(duplicate(&j.envelope.id));
    }
    prepared.run(&prepared.stored_id, |s| {
        for j in jobs {
            s.raw_bind_parameter(1, j.envelope.id.as_str())?;
            let found = s.raw_query().next()?.is_some();
            if found {
                return Ok(Err(duplicate(&j.envelope.id)));
            }
        }
        Ok(Ok(()))
    })?
}

/// [`INSERT_JOB`] of [`ROWS_PER_INSERT`] rows.
fn insert_jobs_many() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| many_rows(INSERT_JOB, JOB_COLUMNS))
}

/// [`INSERT_EVENT`] of [`ROWS_PER_INSERT`] rows.
fn insert_events_many() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| many_rows(INSERT_EVENT, EVENT_COLUMNS))
}

/// A new job's row, its values encoded once.
struct NewJobRow<'j> {
    seq: i64,
    job: &'j Job,
    state: JobState,
    created: i64,
    envelope: String,
    extra: String,
}

impl NewJobRow<'_> {
    fn subject(&self) -> Subject<'_> {
        let e = &self.job.envelope;
        Subject {
            job_id: &e.id,
            queue: &e.queue,
            job_type: &e.job_type,
        }
    }

    /// Binds the row's values after parameter `before` of `s`, in
    /// [`INSERT_JOB`]'s order; `event` is the number of the job's first
    /// event (written after the row).
    fn bind(
        &self,
        s: &mut rusqlite::Statement<'_>,
        before: usize,
        event: i64,
    ) -> rusqlite::Result<()> {
        let e = &self.job.envelope;
        let at = before + 1;
        s.raw_bind_parameter(at, self.seq)?;
        s.raw_bind_parameter(at + 1, &e.id)?;
        s.raw_bind_parameter(at + 2, &e.queue)?;
        s.raw_bind_parameter(at + 3, state_name(self.state))?;
        s.raw_bind_parameter(at + 4, due_ms(self.job))?;
        s.raw_bind_parameter(at + 5, self.created)?;
        s.raw_bind_parameter(at + 6, &self.envelope)?;
        s.raw_bind_parameter(at + 7, &self.extra)?;
        s.raw_bind_parameter(at + 8, listed(event).as_str())
    }
}

fn is_primary_key(e: &rusqlite::Error) -> bool {
    e.sqlite_error()
        .is_some_and(|f| f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY)
}

/// Inserts one new job's row, its first event numbered `event`; a stored
/// id is [`StoreError::Duplicate`].
fn insert_row(prepared: &Prepared<'_>, row: &NewJobRow<'_>, event: i64) -> Result<(), StoreError> {
    prepared
        .run(&prepared.insert, |s| {
            row.bind(s, 0, event)?;
            s.raw_execute()
        })
        .map_err(|err| {
            if is_primary_key(&err) {
                StoreError::Duplicate(row.job.envelope.id.clone())
            } else {
                StoreError::from(err)
            }
        })?;
    Ok(())
}

/// What an insert of new jobs wrote.
struct NewRows {
    /// The stored jobs that wait for the broker, with their numbers.
    available: Vec<(String, i64)>,
    /// Per job, the holder of its unique key answering for it; empty:
    /// every job was stored.
    answered: Vec<Option<Job>>,
    /// Row numbers used.
    used: i64,
}

/// An insert of new jobs: the unique-key step where a job has a key
/// ([`claim_unique_keys`]), then the rows.
fn insert_new(
    prepared: &Prepared<'_>,
    jobs: &mut [Job],
    uniques: &[Option<Uniqueness>],
    next_seq: i64,
    tally: &RefCell<Tally>,
) -> Result<NewRows, StoreError> {
    if uniques.iter().all(Option::is_none) {
        return Ok(NewRows {
            available: insert(prepared, jobs, next_seq, tally)?,
            answered: Vec::new(),
            used: jobs.len() as i64,
        });
    }
    let mut seq = next_seq;
    let mut tx = SqliteTx::new(prepared.conn, prepared, &mut seq, tally);
    let answered = claim_unique_keys(&mut tx, jobs, uniques)?;
    tx.list_events()?;
    let stored = unanswered(jobs, &answered);
    let available = insert(prepared, &stored, seq, tally)?;
    let mut tx = SqliteTx::new(prepared.conn, prepared, &mut seq, tally);
    keep_unique_keys(&mut tx, jobs, uniques, &answered)?;
    tx.list_events()?;
    Ok(NewRows {
        available,
        answered,
        used: seq - next_seq + stored.len() as i64,
    })
}

/// The answer of an insert: each job stored, or the holder answering for it.
fn inserted(jobs: Vec<Job>, answered: Vec<Option<Job>>) -> Vec<Inserted> {
    if answered.is_empty() {
        return jobs.into_iter().map(Inserted::Stored).collect();
    }
    jobs.into_iter()
        .zip(answered)
        .map(|(job, holder)| match holder {
            Some(holder) => Inserted::Existing(holder),
            None => Inserted::Stored(job),
        })
        .collect()
}

/// A job and its row id, read from its row.
fn load(prepared: &Prepared<'_>, id: &str) -> Result<(i64, Job), StoreError> {
    let row = prepared.run(&prepared.load, |s| {
        s.query_row(params![id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
        .optional()
    })?;
    let (envelope, extra, row) = row.ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    Ok((row, decode(id, &envelope, &extra)?))
}

/// A job's row, read by the writer: its row id too (what the update hook
/// names).
const LOAD_JOB: &str = "SELECT envelope, extra, rowid FROM jobs WHERE id = ?1";

/// Stores a new job under the number the writer gives it.
const INSERT_JOB: &str =
    "INSERT INTO jobs (rowid, id, queue, state, due_ms, created_ms, envelope, extra, event_seqs)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)";

/// Names a queue the first time a job arrives in it.
const ADD_QUEUE: &str = "INSERT OR IGNORE INTO queues (name, created_ms) VALUES (?1, ?2)";

/// A job's queue, state and row id: what a save moves it from.
const JOB_PLACE: &str = "SELECT queue, state, rowid FROM jobs WHERE id = ?1";

/// A row's list of event numbers with more appended: past 8 KiB (about
/// 1,000 events: a job retried without end, say) its older half goes
/// first, so that a row, written whole with each transition, stays
/// bounded. Deleting such a job leaves those older events to the prune
/// (`[api] retention`).
macro_rules! listed_with {
    ($more:literal) => {
        concat!(
            "CASE WHEN length(event_seqs) > 8192 ",
            "THEN substr(event_seqs, 4096 + instr(substr(event_seqs, 4097), ',')) ",
            "ELSE event_seqs END || ",
            $more
        )
    };
}

/// Writes a job's row; `?8` lists the numbers of the events its request
/// wrote for it since (`,21,22`, or empty), after those listed.
const SAVE_JOB: &str = concat!(
    "UPDATE jobs SET state = ?2, envelope = ?3, extra = ?4, finished_ms = ?5, due_ms = ?6,
         dead = ?7, event_seqs = ",
    listed_with!("?8"),
    " WHERE id = ?1"
);

/// [`SAVE_JOB`] of a row whose number the transaction knows (it read or
/// wrote the job): found by the table's own key, not through the index of
/// text ids.
const SAVE_JOB_AT_ROW: &str = concat!(
    "UPDATE jobs SET state = ?2, envelope = ?3, extra = ?4, finished_ms = ?5, due_ms = ?6,
         dead = ?7, event_seqs = ",
    listed_with!("?8"),
    " WHERE rowid = ?1"
);

/// Lists events of a job its request wrote without saving the job after
/// them (a fact about it, a job it did not load).
const LIST_EVENTS: &str = concat!(
    "UPDATE jobs SET event_seqs = ",
    listed_with!("?2"),
    " WHERE id = ?1"
);

/// Removes a job's row; answers what a deletion moves and the numbers of
/// the job's events.
const DELETE_JOB_LISTED: &str = "DELETE FROM jobs WHERE id = ?1 RETURNING queue, state, event_seqs";

/// Removes one event of a job by its number (the job's id checked too).
const DELETE_EVENT: &str = "DELETE FROM events WHERE seq = ?1 AND job_id = ?2";

/// An event's number as a job's row lists it ([`LIST_JOB_EVENTS`]).
fn listed(seq: i64) -> String {
    let mut text = String::with_capacity(12);
    push_listed(&mut text, seq);
    text
}

/// Appends `seq` to `list` as a job's row lists it.
fn push_listed(list: &mut String, seq: i64) {
    // Not `write!`: its formatting machinery was 290 instructions a number,
    // two numbers a FETCH + ACK.
    list.push(',');
    list.push_str(itoa::Buffer::new().format(seq));
}

/// The numbers a row's `event_seqs` lists; a damaged entry is skipped (its
/// event stays until a prune).
fn listed_seqs(text: &str) -> impl Iterator<Item = i64> + '_ {
    text.split(',').filter_map(|n| n.parse().ok())
}

/// Writes `job` to its row, listing `events` (numbers of events written
/// for it since its row was; see [`SAVE_JOB`]); answers how many bytes it
/// stored (its JSON).
fn save(
    prepared: &Prepared<'_>,
    job: &Job,
    finished: Option<DateTime<Utc>>,
    row: Option<i64>,
    events: &str,
) -> Result<usize, StoreError> {
    let (envelope, extra) = encode(job)?;
    let bytes = envelope.len() + extra.len();
    let (statement, at): (_, &dyn rusqlite::ToSql) = match &row {
        Some(row) => {
            // Every test runs this: the row a transaction knows is the job's
            // (or gone, when the UPDATE by id would have changed nothing too).
            #[cfg(debug_assertions)]
            {
                let id: Option<String> = prepared
                    .conn
                    .query_row("SELECT id FROM jobs WHERE rowid = ?1", [row], |r| r.get(0))
                    .optional()?;
                if let Some(id) = id {
                    assert_eq!(id, job.envelope.id, "row {row}");
                }
            }
            (&prepared.save_at_row, row)
        }
        None => (&prepared.save, &job.envelope.id),
    };
    prepared.run(statement, |s| {
        s.execute(params![
            at,
            state_name(job.state()),
            envelope,
            extra,
            finished.map(ms),
            due_ms(job),
            job.store_mark(),
            events
        ])
    })?;
    Ok(bytes)
}

/// A transition's view of the group's transaction: it numbers any job it
/// stores from the writer's counter.
struct SqliteTx<'a, 'c> {
    conn: &'a Connection,
    prepared: &'a Prepared<'c>,
    next_seq: &'a mut i64,
    /// Jobs this transaction readied, published after its commit.
    outbox: Vec<Job>,
    /// The moves between queues and states not yet in `job_counts`.
    tally: &'a RefCell<Tally>,
    /// The queue and state of each job this transaction read or wrote
    /// (what a save moves it from), and its row id where known.
    loaded: Vec<Loaded>,
    /// Numbers of the events this request wrote about each job, not yet
    /// listed on its row: the job's next save lists them, and
    /// [`SqliteTx::list_events`] what no save took.
    unlisted: Vec<(String, String)>,
}

/// A job a transaction read or wrote: id, queue, state, row id.
type Loaded = (String, String, String, Option<i64>);

impl<'a, 'c> SqliteTx<'a, 'c> {
    /// A request's view of the group's transaction.
    fn new(
        conn: &'a Connection,
        prepared: &'a Prepared<'c>,
        next_seq: &'a mut i64,
        tally: &'a RefCell<Tally>,
    ) -> Self {
        SqliteTx {
            conn,
            prepared,
            next_seq,
            outbox: Vec::new(),
            tally,
            loaded: Vec::new(),
            unlisted: Vec::new(),
        }
    }

    /// The numbers of `id`'s events not yet on its row, taken.
    fn take_unlisted(&mut self, id: &str) -> String {
        match self.unlisted.iter().position(|(i, _)| i == id) {
            Some(at) => self.unlisted.swap_remove(at).1,
            None => String::new(),
        }
    }

    /// Lists on their jobs' rows the events no save took (a job that has
    /// no row lists nothing): run when the request's work is done.
    fn list_events(&mut self) -> Result<(), StoreError> {
        for (id, seqs) in std::mem::take(&mut self.unlisted) {
            self.conn
                .prepare_cached(LIST_EVENTS)?
                .execute(params![id, seqs])?;
        }
        Ok(())
    }

    fn remember(&mut self, id: &str, queue: &str, state: &str, row: Option<i64>) {
        match self.loaded.iter_mut().find(|(i, _, _, _)| i == id) {
            Some(entry) => {
                state.clone_into(&mut entry.2);
                if row.is_some() {
                    entry.3 = row;
                }
            }
            None => self
                .loaded
                .push((id.to_owned(), queue.to_owned(), state.to_owned(), row)),
        }
    }
}

impl Tx for SqliteTx<'_, '_> {
    fn load(&mut self, id: &str) -> Result<Job, StoreError> {
        let kept = self.prepared.recent.borrow_mut().take(id);
        let (row, job) = match kept {
            Some(kept) => {
                // Every test runs this: what the writer kept is what its
                // row reads as.
                #[cfg(debug_assertions)]
                {
                    let read = load(self.prepared, id);
                    assert!(
                        matches!(&read, Ok((row, job)) if *row == kept.0 && *job == kept.1),
                        "the writer kept {kept:?}, its row reads {read:?}"
                    );
                }
                kept
            }
            None => load(self.prepared, id)?,
        };
        self.remember(id, &job.envelope.queue, state_name(job.state()), Some(row));
        Ok(job)
    }

    fn save(&mut self, job: &Job, finished: Option<DateTime<Utc>>) -> Result<(), StoreError> {
        let id = &job.envelope.id;
        let row = match self.loaded.iter().find(|(i, _, _, _)| i == id) {
            Some((_, _, _, row)) => *row,
            None => {
                let place: Option<(String, String, i64)> = self
                    .conn
                    .prepare_cached(JOB_PLACE)?
                    .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .optional()?;
                let Some((queue, state, row)) = place else {
                    // No such row: the UPDATE changes nothing.
                    return save(self.prepared, job, finished, None, "").map(drop);
                };
                self.loaded.push((id.clone(), queue, state, Some(row)));
                Some(row)
            }
        };
        let events = self.take_unlisted(id);
        let bytes = save(self.prepared, job, finished, row, &events)?;
        let now = state_name(job.state());
        if let Some((_, queue, was, row)) = self.loaded.iter_mut().find(|(i, _, _, _)| i == id) {
            if was.as_str() != now {
                moved(self.tally, queue, was, -1);
                moved(self.tally, queue, now, 1);
                now.clone_into(was);
            }
            // An active job is what a worker's next step loads.
            if let (Some(row), JobState::Active) = (*row, job.state()) {
                self.prepared.recent.borrow_mut().stage(row, job, bytes);
            }
        }
        Ok(())
    }

    fn fact(
        &mut self,
        event_type: &str,
        job: &Subject<'_>,
        now: DateTime<Utc>,
        data: &EventData,
    ) -> Result<(), StoreError> {
        let seq = self.prepared.next_event.get();
        event(self.prepared, event_type, job, now, data)?;
        // Listed on the job's row, so that deleting the job deletes it.
        if !job.job_id.is_empty() {
            match self.unlisted.iter_mut().find(|(i, _)| i == job.job_id) {
                Some((_, seqs)) => push_listed(seqs, seq),
                None => self.unlisted.push((job.job_id.to_owned(), listed(seq))),
            }
        }
        Ok(())
    }

    fn jobs_with_unique_key(&mut self, key: &str) -> Result<Vec<Job>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::JOBS_WITH_UNIQUE_KEY.sqlite)?;
        jobs(&mut stmt, params![key])
    }

    fn keep_unique_key(&mut self, job_id: &str, key: &str) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::KEEP_UNIQUE_KEY.sqlite)?
            .execute(params![job_id, key])?;
        Ok(())
    }

    fn insert_seen(&mut self, job: &Job) -> Result<(), StoreError> {
        insert(
            self.prepared,
            std::slice::from_ref(job),
            *self.next_seq,
            self.tally,
        )?;
        self.remember(
            &job.envelope.id,
            &job.envelope.queue,
            state_name(job.state()),
            Some(*self.next_seq),
        );
        *self.next_seq += 1;
        Ok(())
    }

    fn delete(&mut self, id: &str) -> Result<(), StoreError> {
        let unlisted = self.take_unlisted(id);
        delete_job(self.prepared, id, &unlisted, self.tally)?;
        self.loaded.retain(|(i, _, _, _)| i != id);
        Ok(())
    }

    fn worker(&mut self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        let record: Option<String> = self
            .conn
            .prepare_cached(sql::WORKER.sqlite)?
            .query_row(params![id], |r| r.get(0))
            .optional()?;
        record.map(|r| record_of(id, &r)).transpose()
    }

    fn save_worker(
        &mut self,
        id: &str,
        seen: DateTime<Utc>,
        record: &WorkerRecord,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::SAVE_WORKER.sqlite)?
            .execute(params![id, ms(seen), record_text(id, record)?])?;
        Ok(())
    }

    fn remove_worker(&mut self, id: &str) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached(sql::DELETE_WORKER.sqlite)?
            .execute(params![id])?;
        Ok(n > 0)
    }

    fn workflow(&mut self, id: &str) -> Result<Option<Workflow>, StoreError> {
        let record: Option<String> = self
            .conn
            .prepare_cached("SELECT record FROM workflows WHERE id = ?1")?
            .query_row(params![id], |r| r.get(0))
            .optional()?;
        record.map(|r| record_of(id, &r)).transpose()
    }

    fn save_workflow(&mut self, workflow: &Workflow) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::SAVE_WORKFLOW.sqlite)?
            .execute(params![
                workflow.id,
                workflow.state.as_str(),
                ms(workflow.created_at),
                workflow.finished_at.map(ms),
                record_text(&workflow.id, workflow)?
            ])?;
        Ok(())
    }

    fn reset(&mut self) -> Result<(), StoreError> {
        // The counts go to zero with the jobs (at the commit, or not at
        // all): what `job_counts` holds and what this transaction moved so
        // far, taken back.
        let counts = self.job_counts(Utc::now())?.by_queue;
        for (queue, state, n) in counts {
            moved(self.tally, &queue, &state, -i64::try_from(n).unwrap_or(0));
        }
        self.loaded.clear();
        // SQLite deletes every row of a table without naming them to the
        // update hook.
        self.prepared.recent.borrow_mut().clear();
        // Numbering goes on after a reset (as PostgreSQL's sequence does):
        // a reader's cursor from before never skips what comes after.
        keep_events_through(self.prepared)?;
        for table in sql::RESET_TABLES {
            // `settles` is PostgreSQL's alone.
            if table != "settles" && table != "job_counts" {
                self.conn.execute(&format!("DELETE FROM {table}"), [])?;
            }
        }
        Ok(())
    }

    fn system(&mut self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn
            .prepare_cached(sql::SYSTEM.sqlite)?
            .query_row(params![key], |r| r.get(0))
            .optional()?)
    }

    fn set_system(&mut self, key: &str, value: Option<&str>) -> Result<(), StoreError> {
        match value {
            Some(v) => self
                .conn
                .prepare_cached(sql::SET_SYSTEM.sqlite)?
                .execute(params![key, v])?,
            None => self
                .conn
                .prepare_cached(sql::DELETE_SYSTEM.sqlite)?
                .execute(params![key])?,
        };
        Ok(())
    }

    fn delete_workflow(&mut self, id: &str) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::DELETE_WORKFLOW.sqlite)?
            .execute(params![id])?;
        Ok(())
    }

    fn workflows(
        &mut self,
        state: Option<&str>,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<Workflow>, StoreError> {
        let (limit, offset) = (limit as i64, offset as i64);
        let rows: Vec<(String, String)> = match state {
            Some(state) => self
                .conn
                .prepare_cached(sql::WORKFLOWS_IN.sqlite)?
                .query_map(params![limit, offset, state], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?
                .collect::<Result<_, _>>()?,
            None => self
                .conn
                .prepare_cached(sql::WORKFLOWS.sqlite)?
                .query_map(params![limit, offset], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()?,
        };
        rows.iter().map(|(id, r)| record_of(id, r)).collect()
    }

    fn list_jobs(
        &mut self,
        query: &JobQuery,
        limit: usize,
        offset: usize,
    ) -> Result<(Vec<Job>, u64), StoreError> {
        let list = JobList::new(query, limit, offset);
        let total: i64 = self.conn.query_row(
            &list.count,
            rusqlite::params_from_iter(list.values.iter()),
            |r| r.get(0),
        )?;
        let mut stmt = self.conn.prepare(&list.page)?;
        let values = list.values;
        let rows = stmt.query_map(rusqlite::params_from_iter(values.iter()), |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, envelope, extra) = row?;
            out.push(decode(&id, &envelope, &extra)?);
        }
        Ok((out, u64::try_from(total).unwrap_or(0)))
    }

    fn job_counts(&mut self, since: DateTime<Utc>) -> Result<JobCounts, StoreError> {
        let read = |sql: &str,
                    p: &[&dyn rusqlite::ToSql]|
         -> Result<Vec<(String, String, u64)>, StoreError> {
            let mut stmt = self.conn.prepare_cached(sql)?;
            let rows = stmt.query_map(p, |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            let mut out = Vec::new();
            for row in rows {
                let (q, state, n) = row?;
                out.push((q, state, u64::try_from(n).unwrap_or(0)));
            }
            Ok(out)
        };
        let mut by_queue = read(sql::COUNTS_BY_QUEUE.sqlite, &[])?;
        let finished = read(sql::FINISHED_BY_QUEUE.sqlite, &[&ms(since)])?;
        // What this transaction moved so far is in `job_counts` only once
        // it commits: the jobs' rows it already shows.
        {
            let tally = self.tally.borrow_mut();
            let mut counts: HashMap<(String, String), i64> = by_queue
                .drain(..)
                .map(|(q, s, n)| ((q, s), i64::try_from(n).unwrap_or(i64::MAX)))
                .collect();
            for (queue, state, n) in tally.pending() {
                *counts
                    .entry((queue.to_owned(), state.to_owned()))
                    .or_default() += n;
            }
            by_queue = counts
                .into_iter()
                .filter(|(_, n)| *n != 0)
                .map(|((q, s), n)| (q, s, u64::try_from(n).unwrap_or(0)))
                .collect();
        }
        Ok(JobCounts { by_queue, finished })
    }

    fn event_bounds(&mut self) -> Result<(Option<i64>, Option<i64>), StoreError> {
        Ok(self
            .conn
            .query_row("SELECT min(seq), max(seq) FROM events", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?)
    }

    fn history(
        &mut self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_ms: i64,
        queue: Option<&str>,
    ) -> Result<Vec<(i64, String, u64)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::HISTORY.sqlite)?;
        let rows = stmt.query_map(
            params![ms(since), ms(until), bucket_ms.max(1), queue.unwrap_or("")],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            },
        )?;
        let mut out = Vec::new();
        for row in rows {
            let (at, kind, n) = row?;
            out.push((at, kind, u64::try_from(n).unwrap_or(0)));
        }
        Ok(out)
    }

    fn outbox(&mut self) -> &mut Vec<Job> {
        &mut self.outbox
    }

    fn cron(&mut self, name: &str) -> Result<Option<CronJob>, StoreError> {
        let record: Option<String> = self
            .conn
            .prepare_cached(sql::CRON.sqlite)?
            .query_row(params![name], |r| r.get(0))
            .optional()?;
        record.map(|r| record_of(name, &r)).transpose()
    }

    fn save_cron(&mut self, cron: &CronJob) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::SAVE_CRON.sqlite)?
            .execute(params![cron.name, record_text(&cron.name, cron)?])?;
        Ok(())
    }

    fn remove_cron(&mut self, name: &str) -> Result<bool, StoreError> {
        let n = self
            .conn
            .prepare_cached(sql::DELETE_CRON.sqlite)?
            .execute(params![name])?;
        Ok(n > 0)
    }

    fn crons(&mut self) -> Result<Vec<CronJob>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::CRONS.sqlite)?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (name, record) = row?;
            out.push(record_of(&name, &record)?);
        }
        Ok(out)
    }

    fn paused_queues(&mut self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::PAUSED_QUEUES.sqlite)?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (name, at) = row?;
            out.push((
                name,
                DateTime::from_timestamp_millis(at).unwrap_or_default(),
            ));
        }
        Ok(out)
    }

    fn set_paused(
        &mut self,
        queue: &str,
        paused: bool,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached(sql::ADD_QUEUE.sqlite)?
            .execute(params![queue, ms(now)])?;
        let n = if paused {
            self.conn
                .prepare_cached(sql::PAUSE_QUEUE.sqlite)?
                .execute(params![queue, ms(now)])?
        } else {
            self.conn
                .prepare_cached(sql::RESUME_QUEUE.sqlite)?
                .execute(params![queue])?
        };
        Ok(n > 0)
    }

    fn queue_jobs(
        &mut self,
        queue: &str,
        since: DateTime<Utc>,
        sample: usize,
    ) -> Result<QueueJobs, StoreError> {
        let counts = |sql: &str,
                      p: &[&dyn rusqlite::ToSql]|
         -> Result<Vec<(String, u64)>, StoreError> {
            let mut stmt = self.conn.prepare_cached(sql)?;
            let rows = stmt.query_map(p, |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            let mut out = Vec::new();
            for row in rows {
                let (state, n) = row?;
                out.push((state, u64::try_from(n).unwrap_or(0)));
            }
            Ok(out)
        };
        let mut by_state = Vec::new();
        let mut dead = 0;
        {
            let mut stmt = self.conn.prepare_cached(sql::QUEUE_STATES.sqlite)?;
            let rows = stmt.query_map([&queue], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            for row in rows {
                let (state, n, d) = row?;
                by_state.push((state, u64::try_from(n).unwrap_or(0)));
                dead += u64::try_from(d).unwrap_or(0);
            }
        }
        let finished_by_state = counts(sql::QUEUE_FINISHED.sqlite, &[&queue, &ms(since)])?;
        let mut stmt = self.conn.prepare_cached(sql::QUEUE_COMPLETED.sqlite)?;
        let limit = i64::try_from(sample).unwrap_or(i64::MAX);
        let completed = jobs(&mut stmt, params![queue, ms(since), limit])?;
        Ok(QueueJobs {
            by_state,
            dead,
            finished_by_state,
            completed,
        })
    }

    fn rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError> {
        let record: Option<String> = self
            .conn
            .prepare_cached(sql::RATE_KEY.sqlite)?
            .query_row(params![key], |r| r.get(0))
            .optional()?;
        record.map(|r| record_of(key, &r)).transpose()
    }

    fn peek_rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError> {
        self.rate_key(key)
    }

    fn save_rate_key(
        &mut self,
        key: &str,
        state: &KeyState,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::SAVE_RATE_KEY.sqlite)?
            .execute(params![
                key,
                rate_key_seen(state, now),
                record_text(key, state)?
            ])?;
        Ok(())
    }

    fn rate_jobs(&mut self, key: &str) -> Result<(u64, u64), StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::RATE_JOB_COUNTS.sqlite)?;
        let rows = stmt.query_map(params![key], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
        })?;
        let mut counts = (0, 0);
        for row in rows {
            let (state, n) = row?;
            let n = u64::try_from(n).unwrap_or(0);
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
        let mut stmt = self.conn.prepare_cached(sql::FILE_RATE_JOB.sqlite)?;
        for key in keys {
            stmt.execute(params![job_id, key, state])?;
        }
        Ok(())
    }

    fn unfile_rate_job(&mut self, job_id: &str) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::UNFILE_RATE_JOB.sqlite)?
            .execute(params![job_id])?;
        Ok(())
    }

    fn rate_keys(
        &mut self,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<(String, KeyState)>, u64), StoreError> {
        let total: i64 = self
            .conn
            .prepare_cached(sql::COUNT_RATE_KEYS.sqlite)?
            .query_row([], |r| r.get(0))?;
        let mut stmt = self.conn.prepare_cached(sql::RATE_KEYS.sqlite)?;
        let rows = stmt.query_map(
            params![
                i64::try_from(limit).unwrap_or(i64::MAX),
                i64::try_from(offset).unwrap_or(i64::MAX)
            ],
            |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
        )?;
        let mut out = Vec::new();
        for row in rows {
            let (key, record) = row?;
            let state = record_of(&key, &record)?;
            out.push((key, state));
        }
        Ok((out, u64::try_from(total).unwrap_or(0)))
    }

    fn unique_holders(&mut self, limit: u64) -> Result<Vec<(String, Job)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::UNIQUE_HOLDERS.sqlite)?;
        let rows = stmt.query_map(params![i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (key, id, envelope, extra) = row?;
            out.push((key, decode(&id, &envelope, &extra)?));
        }
        Ok(out)
    }

    fn priority_counts(&mut self, queue: &str, limit: u64) -> Result<Vec<(i64, u64)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::PRIORITY_COUNTS.sqlite)?;
        let rows = stmt.query_map(
            params![queue, i64::try_from(limit).unwrap_or(i64::MAX)],
            |r| r.get::<_, String>(0),
        )?;
        let envelopes = rows.collect::<Result<Vec<_>, _>>()?;
        Ok(count_priorities(envelopes.into_iter()))
    }

    fn queue_configs(&mut self) -> Result<Vec<(String, String)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::QUEUE_CONFIGS.sqlite)?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn save_queue_config(&mut self, name: &str, record: &str) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(sql::SAVE_QUEUE_CONFIG.sqlite)?
            .execute(params![name, record])?;
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
            .conn
            .prepare_cached(sql::HOLD_ROLE.sqlite)?
            .execute(params![role, holder, ms(until), ms(now)])?;
        Ok(n > 0)
    }

    fn workers(&mut self) -> Result<Vec<WorkerRecord>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql::WORKERS.sqlite)?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, record) = row?;
            out.push(record_of(&id, &record)?);
        }
        Ok(out)
    }
}

/// Which available jobs the broker has not confirmed yet, kept by the
/// writer thread, and the watermark it keeps in `meta`: every available
/// job numbered at or below it was confirmed. Instead of a write per job
/// when the broker confirms it (which rewrote the whole row), one small
/// update per group commit; after a crash the jobs above the watermark are
/// published again (at least once: some of them twice).
#[derive(Debug)]
struct Confirmed {
    /// Unconfirmed job ids and their numbers.
    waiting: HashMap<String, i64>,
    /// The same numbers, ordered.
    seqs: BTreeSet<i64>,
    /// The number the next job gets (never reused: a reused number at or
    /// below the watermark would not be recovered).
    next_seq: i64,
    /// The watermark as `meta` holds it.
    persisted: i64,
}

impl Confirmed {
    /// The state of an opened store: jobs above the watermark wait for the
    /// republish that follows the start.
    fn load(conn: &Connection) -> Result<Confirmed, StoreError> {
        let persisted: i64 = conn.query_row(
            "SELECT value FROM meta WHERE key = 'published_through'",
            [],
            |r| r.get(0),
        )?;
        let max: i64 =
            conn.query_row("SELECT coalesce(max(rowid), 0) FROM jobs", [], |r| r.get(0))?;
        let mut confirmed = Confirmed {
            waiting: HashMap::new(),
            seqs: BTreeSet::new(),
            next_seq: max.max(persisted) + 1,
            persisted,
        };
        let mut stmt =
            conn.prepare("SELECT id, rowid FROM jobs WHERE rowid > ?1 AND state = 'available'")?;
        let rows = stmt.query_map(params![persisted], |r| {
            Ok((r.get::<_, String>(0)?, r.get(1)?))
        })?;
        for row in rows {
            let (id, seq) = row?;
            confirmed.wait(id, seq);
        }
        Ok(confirmed)
    }

    fn wait(&mut self, id: String, seq: i64) {
        self.seqs.insert(seq);
        self.waiting.insert(id, seq);
    }

    fn done(&mut self, ids: &[String]) {
        for id in ids {
            if let Some(seq) = self.waiting.remove(id) {
                self.seqs.remove(&seq);
            }
        }
    }

    /// The watermark once a group that `added` jobs waiting (numbered above
    /// every number waiting now), `removed` jobs (deleted, so no longer
    /// waiting) and numbers up to `next_seq` is committed.
    fn watermark_after(
        &self,
        added: &[(String, i64)],
        removed: &[Vec<String>],
        next_seq: i64,
    ) -> i64 {
        let gone: Vec<i64> = removed
            .iter()
            .flatten()
            .filter_map(|id| self.waiting.get(id).copied())
            .collect();
        // At most `gone.len() + 1` numbers are looked at.
        let first = self
            .seqs
            .iter()
            .copied()
            .find(|seq| !gone.contains(seq))
            .or_else(|| added.iter().map(|(_, seq)| *seq).min());
        first.map_or(next_seq - 1, |first| first - 1)
    }
}

/// The jobs the writer's open transaction moved between queues and states,
/// not yet in `job_counts`: every statement that writes `jobs` (they are all
/// in this file: [`insert`], [`SqliteTx::save`], [`delete_counted`]) says
/// what it moved, and the group's commit writes one row per queue and state
/// it touched. Triggers counting each row instead cost a batch PUSH a
/// quarter of its rate (SQLite runs a trigger program per row).
/// A request's moves count once its savepoint is released; a rolled-back
/// request's, or a failed group's, are dropped with its writes. Only the
/// writer's thread touches it.
#[derive(Debug, Default)]
struct Tally {
    /// Of the requests released in this transaction.
    transaction: Moves,
    /// Of the request running now.
    request: Moves,
}

/// Jobs moved, by queue and state (a map of maps: a move is looked up by
/// two borrowed names, without making a key).
type Moves = HashMap<String, HashMap<String, i64>>;

fn add_move(moves: &mut Moves, queue: &str, state: &str, n: i64) {
    let states = match moves.get_mut(queue) {
        Some(states) => states,
        None => moves.entry(queue.to_owned()).or_default(),
    };
    match states.get_mut(state) {
        Some(count) => *count += n,
        None => {
            states.insert(state.to_owned(), n);
        }
    }
}

impl Tally {
    /// Adds the request's moves to the transaction's. The request's entries
    /// stay, at zero, for the group's next requests: most move jobs
    /// between the same few queues and states, which then find their
    /// entries instead of making them (names, maps) each time.
    fn released(&mut self) {
        for (queue, states) in &mut self.request {
            for (state, n) in states.iter_mut() {
                if *n != 0 {
                    add_move(&mut self.transaction, queue, state, std::mem::take(n));
                }
            }
        }
    }

    fn clear(&mut self) {
        self.transaction.clear();
        self.request.clear();
    }

    /// What the open transaction moved so far, nonzero.
    fn pending(&self) -> Vec<(&str, &str, i64)> {
        let mut out = Vec::new();
        for moves in [&self.transaction, &self.request] {
            for (queue, states) in moves {
                for (state, n) in states {
                    if *n != 0 {
                        out.push((queue.as_str(), state.as_str(), *n));
                    }
                }
            }
        }
        out
    }
}

fn moved(tally: &RefCell<Tally>, queue: &str, state: &str, n: i64) {
    let mut tally = tally.borrow_mut();
    add_move(&mut tally.request, queue, state, n);
}

/// Runs a `DELETE FROM jobs …` (`sql`), counting the rows it removes out
/// of their queue and state; how many.
fn delete_counted(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    tally: &RefCell<Tally>,
) -> Result<usize, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("{sql} RETURNING queue, state"))?;
    let mut rows = stmt.query(params)?;
    let mut removed = 0;
    while let Some(row) = rows.next()? {
        let queue: String = row.get(0)?;
        let state: String = row.get(1)?;
        moved(tally, &queue, &state, -1);
        removed += 1;
    }
    Ok(removed)
}

/// Deletes job `id`'s row and its events: those its row lists and
/// `unlisted` (written by the request deleting it, not on the row yet).
fn delete_job(
    prepared: &Prepared<'_>,
    id: &str,
    unlisted: &str,
    tally: &RefCell<Tally>,
) -> Result<(), StoreError> {
    let conn = prepared.conn;
    let listed: Option<(String, String, String)> = conn
        .prepare_cached(DELETE_JOB_LISTED)?
        .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    let listed = match listed {
        Some((queue, state, listed)) => {
            moved(tally, &queue, &state, -1);
            listed
        }
        None => String::new(),
    };
    if listed.is_empty() && unlisted.is_empty() {
        return Ok(());
    }
    keep_events_through(prepared)?;
    let mut delete = conn.prepare_cached(DELETE_EVENT)?;
    for seq in listed_seqs(&listed).chain(listed_seqs(unlisted)) {
        delete.execute(params![seq, id])?;
    }
    Ok(())
}

/// Writes what the transaction moved into `job_counts`, one upsert per
/// queue and state.
fn write_counts(conn: &Connection, tally: &RefCell<Tally>) -> rusqlite::Result<()> {
    let mut tally = tally.borrow_mut();
    tally.released();
    let mut upsert = conn.prepare_cached(
        "INSERT INTO job_counts (queue, state, n) VALUES (?1, ?2, ?3)
         ON CONFLICT (queue, state) DO UPDATE SET n = n + excluded.n",
    )?;
    for (queue, states) in &tally.transaction {
        for (state, n) in states {
            if *n != 0 {
                upsert.execute(params![queue, state, n])?;
            }
        }
    }
    Ok(())
}

fn write_loop(
    conn: Connection,
    rx: mpsc::Receiver<Request>,
    (mut confirmed, next_event): (Confirmed, i64),
    health: &WriterHealth,
    tally: &RefCell<Tally>,
    mut checkpointer: ojs_sqlite::Checkpointer,
) {
    let prepared = Prepared::new(&conn, next_event);
    while let Ok(first) = rx.recv() {
        let (mut group, mut closing) = match first {
            Request::Write(w) => (vec![w], None),
            Request::Close(reply) => (Vec::new(), Some(reply)),
        };
        // A close ends the group: the writes sent before it are committed
        // first, and it checkpoints what they wrote.
        while closing.is_none() && group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(Request::Write(w)) => group.push(w),
                Ok(Request::Close(reply)) => closing = Some(reply),
                Err(_) => break,
            }
        }
        commit_and_deliver(
            &prepared,
            group,
            &mut confirmed,
            health,
            tally,
            &checkpointer,
        );
        if let Some(reply) = closing {
            let _ = reply.send(checkpointer.truncate(&conn).map_err(StoreError::from));
        }
    }
    checkpointer.stop();
    drop(prepared);
    drop(conn);
    // Every sender is gone: the store is closing, nothing to warn of.
    *health.0.lock().unwrap_or_else(|e| e.into_inner()) =
        Some("the job store is closed".to_owned());
}

/// Commits one group of writes (none: nothing) and answers each.
fn commit_and_deliver(
    prepared: &Prepared<'_>,
    mut group: Vec<Write>,
    confirmed: &mut Confirmed,
    health: &WriterHealth,
    tally: &RefCell<Tally>,
    checkpointer: &ojs_sqlite::Checkpointer,
) {
    if group.is_empty() {
        return;
    }
    // Each transition runs guarded already; this catches a failure of
    // the group's own steps, so that the group's requests fail and the
    // writer goes on (its transaction is rolled back as it unwinds).
    let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        commit_group(prepared, &mut group, confirmed, tally)
    }))
    .unwrap_or_else(|_| {
        tracing::error!(
            "a job store commit failed unexpectedly; its requests fail and the store goes on"
        );
        group
            .iter()
            .map(|_| failed("the commit failed unexpectedly"))
            .collect()
    });
    health.record(&results);
    deliver(group, results);
    checkpointer.committed(prepared.conn);
}

/// Whether the writer's last commit failed, and why: while it does, the
/// store cannot write and health says so.
#[derive(Debug, Default)]
pub(super) struct WriterHealth(Mutex<Option<String>>);

impl WriterHealth {
    fn set(&self, down: Option<String>) {
        let mut was = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match (&*was, &down) {
            (None, Some(reason)) => {
                tracing::warn!(%reason, "the job store cannot write; requests fail as retryable until it can")
            }
            (Some(_), None) => tracing::info!("the job store writes again"),
            _ => {}
        }
        *was = down;
    }

    fn record(&self, results: &[Outcome]) {
        let commit_failed = results.iter().find_map(|o| match o {
            Outcome::Unit(Err(StoreError::Commit(reason))) => Some(reason.clone()),
            _ => None,
        });
        // A group that committed (or failed only requests of its own)
        // shows the store writes.
        if commit_failed.is_some()
            && results
                .iter()
                .all(|o| matches!(o, Outcome::Unit(Err(StoreError::Commit(_)))))
        {
            self.set(commit_failed);
        } else {
            self.set(None);
        }
    }

    /// Why the store cannot write, while it cannot.
    pub(super) fn down(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// What one request produced, before its reply is sent (after the commit).
enum Outcome {
    Any(Result<Box<dyn Any + Send>, StoreError>),
    Inserted(Result<Vec<Option<Job>>, StoreError>),
    Unit(Result<(), StoreError>),
    Pruned(Result<u64, StoreError>),
}

fn commit_group(
    prepared: &Prepared<'_>,
    group: &mut [Write],
    confirmed: &mut Confirmed,
    tally: &RefCell<Tally>,
) -> Vec<Outcome> {
    // What a failed group (or one that panicked) moved went with it.
    tally.borrow_mut().clear();
    // Confirmations need no write of their own.
    for write in group.iter() {
        if let Write::Published { ids } = write {
            confirmed.done(ids);
        }
    }
    if group.iter().all(|w| matches!(w, Write::Published { .. })) {
        return group.iter().map(|_| Outcome::Unit(Ok(()))).collect();
    }
    // Begun and committed through prepared statements (rusqlite's own
    // `Transaction` parses both each time).
    let tx = match ojs_sqlite::WriteTransaction::begin(prepared.conn) {
        Ok(tx) => tx,
        Err(e) => {
            let reason = e.to_string();
            return group.iter().map(|_| failed(&reason)).collect();
        }
    };
    begin_recent(prepared);
    let mut outcomes = Vec::with_capacity(group.len());
    let mut next_seq = confirmed.next_seq;
    let mut added: Vec<(String, i64)> = Vec::new();
    let mut removed: Vec<Vec<String>> = Vec::new();
    // Until a request of the group has written, a failed one is undone by
    // rolling the transaction back: it needs no savepoint (SQLite copies
    // every page a request changes under one, a few per cent of a FETCH +
    // ACK where groups are small).
    let mut undo = Undo::Transaction;
    let mut lost: Option<String> = None;
    for write in group.iter_mut() {
        if lost.is_some() {
            break;
        }
        let outcome = match write {
            Write::Run { f, isolation, .. } => match f.take() {
                Some(f) => {
                    let before = next_seq;
                    let r = in_request(prepared, tally, &mut undo, &mut lost, *isolation, |conn| {
                        super::guarded(|| {
                            let mut tx = SqliteTx::new(conn, prepared, &mut next_seq, tally);
                            let answer = f(&mut tx)?;
                            tx.list_events()?;
                            Ok(answer)
                        })
                    });
                    if r.is_err() {
                        next_seq = before;
                    }
                    Outcome::Any(r)
                }
                None => Outcome::Any(Err(StoreError::Commit("ran twice".into()))),
            },
            Write::Insert { jobs, uniques, .. } => {
                // Without unique keys an insert checks its ids before its
                // first write; claiming keys may refuse after writing.
                let isolation = if uniques.iter().all(Option::is_none) {
                    Isolation::ChecksFirst
                } else {
                    Isolation::Savepoint
                };
                match in_request(prepared, tally, &mut undo, &mut lost, isolation, |_| {
                    insert_new(prepared, jobs, uniques, next_seq, tally)
                }) {
                    Ok(rows) => {
                        next_seq += rows.used;
                        added.extend(rows.available);
                        Outcome::Inserted(Ok(rows.answered))
                    }
                    Err(e) => Outcome::Inserted(Err(e)),
                }
            }
            Write::Published { .. } => Outcome::Unit(Ok(())),
            Write::Remove { ids, .. } => Outcome::Unit(in_request(
                prepared,
                tally,
                &mut undo,
                &mut lost,
                Isolation::Savepoint,
                |_| {
                    for id in ids.iter() {
                        delete_job(prepared, id, "", tally)?;
                    }
                    Ok(())
                },
            )),
            Write::Prune { before, .. } => Outcome::Pruned(in_request(
                prepared,
                tally,
                &mut undo,
                &mut lost,
                Isolation::Savepoint,
                |c| {
                    let cut = ms(*before);
                    let jobs = delete_counted(c, sql::PRUNE_JOBS.sqlite, params![cut], tally)?;
                    keep_events_through(prepared)?;
                    c.prepare_cached(PRUNE_EVENTS)?.execute(params![cut])?;
                    c.prepare_cached(sql::PRUNE_WORKERS.sqlite)?
                        .execute(params![cut])?;
                    c.prepare_cached(sql::PRUNE_UNIQUE_KEYS.sqlite)?
                        .execute([])?;
                    c.prepare_cached(sql::PRUNE_RATE_KEYS.sqlite)?
                        .execute(params![cut - RATE_WINDOW_SLACK_MS])?;
                    c.prepare_cached(sql::PRUNE_WORKFLOWS.sqlite)?
                        .execute(params![cut])?;
                    Ok(jobs as u64)
                },
            )),
        };
        if let (Write::Remove { ids, .. }, Outcome::Unit(Ok(()))) = (&*write, &outcome) {
            removed.push(ids.clone());
        }
        outcomes.push(outcome);
    }
    // The transaction was rolled back under the group (by SQLite, after an
    // error such as a full disk, or when it could not begin again): what
    // the requests before wrote is gone with it, and the rest never ran.
    if let Some(reason) = lost {
        prepared.recent.borrow_mut().failed();
        return group.iter().map(|_| failed(&reason)).collect();
    }
    // The watermark as it stands once this group is committed, found
    // without copying the numbers still waiting (thousands while a broker
    // confirms a burst: the copy was a few per cent of a batch PUSH).
    let watermark = confirmed.watermark_after(&added, &removed, next_seq);
    if watermark != confirmed.persisted {
        let updated = tx
            .prepare_cached("UPDATE meta SET value = ?1 WHERE key = 'published_through'")
            .and_then(|mut s| s.execute(params![watermark]));
        if let Err(e) = updated {
            let reason = e.to_string();
            prepared.recent.borrow_mut().failed();
            return group.iter().map(|_| failed(&reason)).collect();
        }
    }
    if let Err(e) = write_counts(&tx, tally) {
        let reason = e.to_string();
        prepared.recent.borrow_mut().failed();
        return group.iter().map(|_| failed(&reason)).collect();
    }
    if let Err(e) = tx.commit() {
        let reason = e.to_string();
        prepared.recent.borrow_mut().failed();
        return group.iter().map(|_| failed(&reason)).collect();
    }
    prepared.recent.borrow_mut().committed();
    confirmed.next_seq = next_seq;
    confirmed.persisted = watermark;
    for (id, seq) in added {
        confirmed.wait(id, seq);
    }
    for ids in removed {
        confirmed.done(&ids);
    }
    outcomes
}

fn failed(reason: &str) -> Outcome {
    Outcome::Unit(Err(StoreError::Commit(reason.to_owned())))
}

/// Reads `data_version` holding the write lock (no other connection
/// commits until the transaction ends) and tells the kept jobs a group's
/// transaction began.
fn begin_recent(prepared: &Prepared<'_>) {
    let data_version = prepared
        .run(&prepared.data_version, |s| {
            s.query_row([], |r| r.get::<_, i64>(0))
        })
        .ok();
    prepared.recent.borrow_mut().begin(data_version);
}

/// How a request of a group is undone if it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Undo {
    /// Nothing of the group is written yet: the transaction is rolled back
    /// and begun again.
    Transaction,
    /// By its own savepoint: the requests before it keep their writes.
    Savepoint,
}

/// Runs one request of the group's transaction: its failure undoes its own
/// writes and nobody else's. `undo` says how (and becomes
/// [`Undo::Savepoint`] once a request has written); `lost` is set when the
/// transaction itself is gone (the group then fails as a whole). A request
/// that checks first ([`Isolation::ChecksFirst`]) takes no savepoint: when
/// it fails having written nothing there is nothing to undo, and when it
/// fails after a write the group is lost.
fn in_request<T>(
    prepared: &Prepared<'_>,
    tally: &RefCell<Tally>,
    undo: &mut Undo,
    lost: &mut Option<String>,
    isolation: Isolation,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let conn = prepared.conn;
    let savepoint = *undo == Undo::Savepoint && isolation == Isolation::Savepoint;
    // Every write of a request is an INSERT, UPDATE or DELETE, which this
    // counts: unchanged, the request wrote nothing.
    let changes = conn.total_changes();
    // Prepared once: a group has a savepoint per request, and parsing the
    // two statements each time was a few per cent of a single PUSH.
    if savepoint {
        prepared.run(&prepared.savepoint, |s| s.execute([]))?;
    }
    let done = f(conn).and_then(|v| {
        if savepoint {
            prepared.run(&prepared.release, |s| s.execute([]))?;
        }
        Ok(v)
    });
    let mut kept = tally.borrow_mut();
    match done {
        Ok(v) => {
            kept.released();
            prepared.recent.borrow_mut().released();
            *undo = Undo::Savepoint;
            Ok(v)
        }
        Err(e) => {
            kept.request.clear();
            prepared.recent.borrow_mut().rolled_back();
            drop(kept);
            let undone = if conn.is_autocommit() {
                // SQLite rolls a transaction back itself after some errors
                // (a full disk, I/O): the writes of the requests before
                // this one went with it, unless there were none.
                match *undo {
                    Undo::Transaction => restart(prepared, tally),
                    Undo::Savepoint => Err("the group's transaction was rolled back".to_owned()),
                }
            } else if savepoint {
                conn.execute_batch("ROLLBACK TO request; RELEASE request")
                    .map_err(|e| e.to_string())
            } else if conn.total_changes() == changes {
                // It refused before its first write: nothing to undo.
                Ok(())
            } else if *undo == Undo::Transaction {
                // Nothing of the group is kept yet: begun again.
                restart(prepared, tally)
            } else {
                tracing::warn!(error = %e, "a transition that checks first failed after writing: every request of its group commit fails");
                Err(format!(
                    "a request of the group failed after writing without a savepoint: {e}"
                ))
            };
            if let Err(reason) = undone {
                *lost = Some(reason);
            }
            Err(e)
        }
    }
}

/// Rolls back a group's transaction in which nothing was kept yet and
/// begins it again, for the group's next requests.
fn restart(prepared: &Prepared<'_>, tally: &RefCell<Tally>) -> Result<(), String> {
    let conn = prepared.conn;
    if !conn.is_autocommit() {
        conn.execute_batch("ROLLBACK").map_err(|e| e.to_string())?;
    }
    tally.borrow_mut().clear();
    ojs_sqlite::begin_immediate(conn).map_err(|e| e.to_string())?;
    begin_recent(prepared);
    Ok(())
}

fn deliver(group: Vec<Write>, results: Vec<Outcome>) {
    for (write, outcome) in group.into_iter().zip(results) {
        match (write, outcome) {
            (Write::Insert { reply, jobs, .. }, Outcome::Inserted(r)) => {
                let _ = reply.send(r.map(|answered| inserted(jobs, answered)));
            }
            (Write::Insert { reply, .. }, Outcome::Unit(Err(e))) => {
                let _ = reply.send(Err(e));
            }
            (Write::Remove { reply, .. }, Outcome::Unit(r)) => {
                let _ = reply.send(r);
            }
            (Write::Prune { reply, .. }, Outcome::Pruned(r)) => {
                let _ = reply.send(r);
            }
            (Write::Prune { reply, .. }, Outcome::Unit(Err(e))) => {
                let _ = reply.send(Err(e));
            }
            (Write::Run { reply, .. }, Outcome::Any(r)) => {
                let _ = reply.send(r);
            }
            (Write::Run { reply, .. }, Outcome::Unit(Err(e))) => {
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
    use crate::store::Store;
    use serde_json::{json, Value};

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
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
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

    /// The daemon closes the store before it exits with its connections
    /// open: SQLite's own checkpoint on the last close never runs then, and
    /// every commit stayed in the log beside an empty database file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_copies_the_log_into_the_file_and_writes_go_on_after_it() -> Result<(), StoreError>
    {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let handles: Vec<_> = (0..50)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.insert(vec![job(None), job(None)]).await })
            })
            .collect();
        for h in handles {
            assert!(h.await.is_ok_and(|r| r.is_ok()));
        }
        let log = dir.join(format!("{STORE_FILE}-wal"));
        let log_size = || std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        assert!(
            log_size() > 0,
            "the commits are in the log before the close"
        );
        // The file alone, as a copy without its log would be read.
        let rows_in_file_alone = |name: &str| -> rusqlite::Result<i64> {
            let copy = dir.join(name);
            std::fs::copy(dir.join(STORE_FILE), &copy).map_err(|e| {
                rusqlite::Error::InvalidPath(format!("{}: {e}", copy.display()).into())
            })?;
            let conn = Connection::open(&copy)?;
            let rows = conn
                .query_row("SELECT count(*) FROM jobs", [], |r| r.get(0))
                .unwrap_or(-1);
            Ok(rows)
        };
        assert_ne!(rows_in_file_alone("before.sqlite")?, 100);

        assert!(store.close().await?, "no read runs: the log is emptied");
        assert_eq!(log_size(), 0);
        assert_eq!(rows_in_file_alone("after.sqlite")?, 100);

        let late = job(None);
        let late_id = late.envelope.id.clone();
        store.insert(vec![late]).await?;
        assert!(store.get(late_id.clone()).await?.is_some());
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        assert!(
            store.get(late_id).await?.is_some(),
            "a write after the close is kept"
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    fn ids(jobs: &[Job]) -> Vec<String> {
        jobs.iter().map(|j| j.envelope.id.clone()).collect()
    }

    /// Waits until the writer has handled everything sent before.
    async fn settle(store: &Store) -> Result<(), StoreError> {
        store.prune(DateTime::<Utc>::UNIX_EPOCH).await.map(|_| ())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_the_broker_did_not_confirm_are_found_again_after_a_reopen(
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (a, b, c, d) = (job(None), job(None), job(None), job(None));
        let all = ids(&[a.clone(), b.clone(), c.clone(), d.clone()]);
        store.insert(vec![a, b]).await?;
        store.insert(vec![c]).await?;
        store.insert(vec![d]).await?;
        // a and c confirmed, d refused (removed); b never confirmed.
        store.published(vec![all[0].clone(), all[2].clone()]);
        store.remove(vec![all[3].clone()]).await?;
        settle(&store).await?;
        assert!(
            store.unpublished(10).await?.is_empty(),
            "nothing to recover at first open"
        );
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        // b, and c above it (republished: at least once); never a, never d.
        assert_eq!(
            ids(&store.unpublished(10).await?),
            vec![all[1].clone(), all[2].clone()]
        );
        store.published(vec![all[1].clone(), all[2].clone()]);
        let e = job(None);
        let e_id = e.envelope.id.clone();
        store.insert(vec![e]).await?;
        store.published(vec![e_id]);
        settle(&store).await?;
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        assert!(store.unpublished(10).await?.is_empty());
        // A removed job's number is not given again.
        let f = job(None);
        store.insert(vec![f.clone()]).await?;
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        assert_eq!(ids(&store.unpublished(10).await?), ids(&[f]));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_1_store_is_migrated_keeping_what_was_not_confirmed() -> Result<(), StoreError>
    {
        let dir = fresh_dir();
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::Commit(e.to_string()))?;
        let (a, b, c) = (job(None), job(None), job(None));
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            conn.execute_batch(&format!(
                "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 1;
                 CREATE TABLE jobs (id TEXT PRIMARY KEY, queue TEXT NOT NULL, state TEXT NOT NULL,
                   due_ms INTEGER, published INTEGER NOT NULL DEFAULT 0, created_ms INTEGER NOT NULL,
                   finished_ms INTEGER, envelope TEXT NOT NULL, extra TEXT NOT NULL DEFAULT '{{}}');
                 CREATE INDEX jobs_unpublished ON jobs (published) WHERE published = 0;
                 CREATE TABLE queues (name TEXT PRIMARY KEY, created_ms INTEGER NOT NULL);
                 CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL,
                   type TEXT NOT NULL, job_id TEXT NOT NULL, queue TEXT NOT NULL,
                   job_type TEXT NOT NULL, time_ms INTEGER NOT NULL, data TEXT NOT NULL);
                 INSERT INTO events (id, type, job_id, queue, job_type, time_ms, data)
                   VALUES ('evt_old', 'job.enqueued', 'x', 'default', 'a.b', 0, '{{}}');"
            ))?;
            for (job, published) in [(&a, 1), (&b, 0), (&c, 1)] {
                let (envelope, extra) = encode(job)?;
                conn.execute(
                    "INSERT INTO jobs (id, queue, state, published, created_ms, envelope, extra)
                     VALUES (?1, 'default', 'available', ?2, 0, ?3, ?4)",
                    params![job.envelope.id, published, envelope, extra],
                )?;
            }
        }
        let store = Store::open(&dir, Durability::Process).await?;
        assert_eq!(
            ids(&store.unpublished(10).await?),
            ids(&[b.clone(), c.clone()])
        );
        assert_eq!(
            store
                .get(a.envelope.id.clone())
                .await?
                .map(|j| j.envelope.id),
            Some(a.envelope.id.clone())
        );
        let events = events_of(&store).await?.events;
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].body["id"], "evt_0000000000000001");
        // The jobs it found are counted (version 9).
        let counts = store.run(|tx| tx.job_counts(Utc::now())).await?.by_queue;
        assert_eq!(counts, [("default".to_owned(), "available".to_owned(), 3)]);
        // The workers' records (version 4) are there too.
        let now = Utc::now();
        let record = store
            .run(move |tx| {
                let record =
                    serde_json::from_value(serde_json::json!({"id": "w1"})).map_err(|e| {
                        StoreError::Corrupt {
                            id: "w1".into(),
                            reason: e.to_string(),
                        }
                    })?;
                tx.save_worker("w1", now, &record)?;
                tx.worker("w1")
            })
            .await?;
        assert_eq!(record.map(|r| r.id), Some("w1".to_owned()));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transition_that_panics_fails_alone_and_the_store_goes_on() -> Result<(), StoreError>
    {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let a = job(None);
        let id = a.envelope.id.clone();
        store.insert(vec![a]).await?;
        let panicked = store
            .run(move |tx| -> Result<(), StoreError> {
                let mut job = tx.load(&id)?;
                job.envelope.priority = 7;
                tx.save(&job, None)?;
                panic!("a bug in a transition");
            })
            .await;
        match panicked {
            Err(StoreError::Internal { reason }) => assert!(reason.contains("a bug"), "{reason}"),
            other => panic!("{other:?}"),
        }
        // Its write was rolled back; the writer serves the next requests.
        let b = job(None);
        let b_id = b.envelope.id.clone();
        store.insert(vec![b]).await?;
        assert!(store.get(b_id).await?.is_some());
        let all = store.run(|tx| tx.workers().map(|w| w.len())).await?;
        assert_eq!(all, 0);
        assert!(store.ping().await.is_ok());
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A request of a group that fails is undone wherever it stands in the
    /// group: the first ones (nothing of the group written yet: the
    /// transaction is rolled back and begun again, no savepoint) or a later
    /// one (its savepoint). The others' rows, the counts by queue and state
    /// and the jobs the writer keeps are the succeeding requests' only.
    #[test]
    fn a_failed_request_is_undone_alone_wherever_it_stands_in_its_group() -> Result<(), StoreError>
    {
        let cases: [&[usize]; 8] = [
            &[],
            &[0],
            &[1],
            &[3],
            &[0, 1],
            &[0, 2],
            &[1, 3],
            &[0, 1, 2, 3],
        ];
        for failing in cases {
            with_available_jobs(4, |conn, prepared, tally, confirmed, ids| {
                // Each request starts its job and raises its priority; the
                // failing ones fail after writing.
                let mut group: Vec<Write> = ids
                    .iter()
                    .enumerate()
                    .map(|(n, id)| {
                        let (id, fails) = (id.clone(), failing.contains(&n));
                        let (reply, _) = oneshot::channel();
                        let f: RunFn = Box::new(move |tx| {
                            let mut job = tx.load(&id)?;
                            job.envelope.state = Some(JobState::Active);
                            job.envelope.priority = 7;
                            tx.save(&job, None)?;
                            if fails {
                                return Err(StoreError::Internal {
                                    reason: format!("request {n} fails"),
                                });
                            }
                            Ok(Box::new(()) as Box<dyn Any + Send>)
                        });
                        Write::Run {
                            f: Some(f),
                            isolation: Isolation::Savepoint,
                            reply,
                        }
                    })
                    .collect();
                let outcomes = commit_group(prepared, &mut group, confirmed, tally);
                for (n, outcome) in outcomes.iter().enumerate() {
                    match (failing.contains(&n), outcome) {
                        (false, Outcome::Any(Ok(_))) => {}
                        (true, Outcome::Any(Err(StoreError::Internal { reason }))) => {
                            assert_eq!(reason, &format!("request {n} fails"));
                        }
                        (_, Outcome::Any(other)) => panic!("{failing:?}, request {n}: {other:?}"),
                        _ => panic!("{failing:?}, request {n}: another outcome"),
                    }
                }
                for (n, id) in ids.iter().enumerate() {
                    let (state, priority): (String, i64) = conn.query_row(
                    "SELECT state, json_extract(envelope, '$.priority') FROM jobs WHERE id = ?1",
                    params![id],
                    |r| Ok((r.get(0)?, r.get::<_, Option<i64>>(1)?.unwrap_or(0))),
                )?;
                    let kept = prepared.recent.borrow_mut().get(id);
                    if failing.contains(&n) {
                        assert_eq!(
                            (state.as_str(), priority),
                            ("available", 0),
                            "{failing:?} {n}"
                        );
                        assert!(kept.is_none(), "{failing:?}: request {n}'s job is kept");
                    } else {
                        assert_eq!((state.as_str(), priority), ("active", 7), "{failing:?} {n}");
                        let kept = kept.map(|(_, job)| job.envelope.priority);
                        assert_eq!(kept, Some(7), "{failing:?}: request {n}'s job");
                    }
                }
                let counted: Vec<(String, i64)> = conn
                    .prepare("SELECT state, n FROM job_counts WHERE n != 0 ORDER BY state")?
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<Result<_, _>>()?;
                let actual: Vec<(String, i64)> = conn
                    .prepare("SELECT state, count(*) FROM jobs GROUP BY state ORDER BY state")?
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<Result<_, _>>()?;
                assert_eq!(counted, actual, "{failing:?}");
                let started = 4 - failing.len() as i64;
                let expected: Vec<(String, i64)> =
                    [("active", started), ("available", 4 - started)]
                        .into_iter()
                        .filter(|(_, n)| *n != 0)
                        .map(|(s, n)| (s.to_owned(), n))
                        .collect();
                assert_eq!(actual, expected, "{failing:?}");
                // The writer goes on: the transaction of the next group begins.
                assert!(conn.is_autocommit());
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Requests that check first run without a savepoint. One that refuses
    /// before writing is answered alone wherever it stands; one that fails
    /// after writing is undone alone while nothing of its group is kept
    /// (the transaction begins again), and otherwise fails its whole group:
    /// every request errs and none of their writes, counts or kept jobs
    /// remain. Requests with savepoints beside them behave as before.
    #[test]
    fn a_request_that_checks_first_refuses_alone_and_fails_after_writing_with_its_group(
    ) -> Result<(), StoreError> {
        // o: a savepoint request that succeeds; s: one that fails after
        // writing; c: a request that checks first and succeeds; r: one
        // that refuses before writing; f: one that fails after writing.
        let cases = [
            "cccc", "rccc", "crcc", "cccr", "rcrc", "fccc", "rfcc", "rrfc", "sfcc", "cfcc", "ccfc",
            "cccf", "ocfc", "scfc", "csrc", "ofoo",
        ];
        for case in cases {
            let kinds: Vec<char> = case.chars().collect();
            with_available_jobs(kinds.len(), |conn, prepared, tally, confirmed, ids| {
                let mut group: Vec<Write> = ids
                    .iter()
                    .zip(&kinds)
                    .enumerate()
                    .map(|(n, (id, &kind))| {
                        let id = id.clone();
                        let (reply, _) = oneshot::channel();
                        let f: RunFn = Box::new(move |tx| {
                            let mut job = tx.load(&id)?;
                            if kind == 'r' {
                                return Err(StoreError::Internal {
                                    reason: format!("request {n} refuses"),
                                });
                            }
                            job.envelope.state = Some(JobState::Active);
                            job.envelope.priority = 7;
                            tx.event(
                                "job.started",
                                &job.envelope,
                                Utc::now(),
                                &EventData::empty(),
                            )?;
                            tx.save(&job, None)?;
                            if kind == 's' || kind == 'f' {
                                return Err(StoreError::Internal {
                                    reason: format!("request {n} fails"),
                                });
                            }
                            Ok(Box::new(()) as Box<dyn Any + Send>)
                        });
                        let isolation = match kind {
                            'o' | 's' => Isolation::Savepoint,
                            _ => Isolation::ChecksFirst,
                        };
                        Write::Run {
                            f: Some(f),
                            isolation,
                            reply,
                        }
                    })
                    .collect();
                let outcomes = commit_group(prepared, &mut group, confirmed, tally);
                // The group is lost when a request that checks first fails
                // after writing once an earlier request of the group is kept.
                let lost = kinds
                    .iter()
                    .enumerate()
                    .any(|(n, &k)| k == 'f' && kinds[..n].iter().any(|&e| e == 'o' || e == 'c'));
                let kept: Vec<bool> = kinds
                    .iter()
                    .map(|&k| !lost && (k == 'o' || k == 'c'))
                    .collect();
                for (n, outcome) in outcomes.iter().enumerate() {
                    match (lost, kinds[n], outcome) {
                        (true, _, Outcome::Unit(Err(StoreError::Commit(reason)))) => {
                            assert!(reason.contains("failed after writing"), "{case}: {reason}");
                        }
                        (false, 'o' | 'c', Outcome::Any(Ok(_))) => {}
                        (false, 'r', Outcome::Any(Err(StoreError::Internal { reason }))) => {
                            assert_eq!(reason, &format!("request {n} refuses"), "{case}");
                        }
                        (false, 's' | 'f', Outcome::Any(Err(StoreError::Internal { reason }))) => {
                            assert_eq!(reason, &format!("request {n} fails"), "{case}");
                        }
                        (_, _, Outcome::Any(other)) => panic!("{case}, request {n}: {other:?}"),
                        _ => panic!("{case}, request {n}: another outcome"),
                    }
                }
                if lost {
                    // The writer's next group finds no transaction open.
                    prepared.recent.borrow_mut().failed();
                }
                for (n, id) in ids.iter().enumerate() {
                    let (state, priority, listed): (String, i64, String) = conn.query_row(
                        "SELECT state, json_extract(envelope, '$.priority'), event_seqs
                     FROM jobs WHERE id = ?1",
                        params![id],
                        |r| {
                            Ok((
                                r.get(0)?,
                                r.get::<_, Option<i64>>(1)?.unwrap_or(0),
                                r.get(2)?,
                            ))
                        },
                    )?;
                    let cached = prepared.recent.borrow_mut().get(id);
                    if kept[n] {
                        assert_eq!((state.as_str(), priority), ("active", 7), "{case} {n}");
                        assert_eq!(listed.split(',').filter(|s| !s.is_empty()).count(), 2);
                        let cached = cached.map(|(_, job)| job.envelope.priority);
                        assert_eq!(cached, Some(7), "{case}: request {n}'s job");
                    } else {
                        assert_eq!((state.as_str(), priority), ("available", 0), "{case} {n}");
                        assert_eq!(listed.split(',').filter(|s| !s.is_empty()).count(), 1);
                        assert!(cached.is_none(), "{case}: request {n}'s job is kept");
                    }
                }
                let started_events: i64 = conn.query_row(
                    "SELECT count(*) FROM events WHERE type = 'job.started'",
                    [],
                    |r| r.get(0),
                )?;
                let started = kept.iter().filter(|k| **k).count() as i64;
                assert_eq!(started_events, started, "{case}");
                let counted: Vec<(String, i64)> = conn
                    .prepare("SELECT state, n FROM job_counts WHERE n != 0 ORDER BY state")?
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<Result<_, _>>()?;
                let total = kinds.len() as i64;
                let expected: Vec<(String, i64)> =
                    [("active", started), ("available", total - started)]
                        .into_iter()
                        .filter(|(_, n)| *n != 0)
                        .map(|(s, n)| (s.to_owned(), n))
                        .collect();
                assert_eq!(counted, expected, "{case}");
                assert!(conn.is_autocommit(), "{case}");
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The watermark a group leaves is one below the first number still
    /// waiting after it: of those waiting before it less the ones it
    /// deleted, else of those it added, else all it numbered.
    #[test]
    fn the_watermark_after_a_group_is_below_the_first_number_still_waiting() {
        let mut confirmed = Confirmed {
            waiting: HashMap::new(),
            seqs: BTreeSet::new(),
            next_seq: 10,
            persisted: 2,
        };
        for (id, seq) in [("a", 3), ("b", 5), ("c", 9)] {
            confirmed.wait(id.to_owned(), seq);
        }
        let ids = |ids: &[&str]| vec![ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>()];
        let added = vec![("d".to_owned(), 12), ("e".to_owned(), 11)];
        assert_eq!(confirmed.watermark_after(&[], &[], 10), 2);
        assert_eq!(confirmed.watermark_after(&added, &[], 13), 2);
        assert_eq!(confirmed.watermark_after(&added, &ids(&["a"]), 13), 4);
        assert_eq!(confirmed.watermark_after(&added, &ids(&["b", "a"]), 13), 8);
        assert_eq!(
            confirmed.watermark_after(&added, &ids(&["a", "c", "b"]), 13),
            10
        );
        assert_eq!(
            confirmed.watermark_after(&[], &ids(&["a", "c", "b"]), 13),
            12
        );
        // An id not waiting (confirmed already, or unknown) moves nothing.
        assert_eq!(confirmed.watermark_after(&[], &ids(&["x"]), 10), 2);
        confirmed.done(&["a".to_owned()]);
        assert_eq!(confirmed.watermark_after(&[], &[], 10), 4);
    }

    /// Inserts check their ids before writing and run without a savepoint:
    /// in one group commit, one holding a stored id (in its second
    /// statement of 16 rows, or alone) or an id twice is refused alone,
    /// writing nothing, and the requests before and after it are stored
    /// whole, with their events and counts.
    #[test]
    fn inserts_refused_by_their_check_leave_their_group_whole() -> Result<(), StoreError> {
        with_available_jobs(1, |conn, prepared, tally, confirmed, ids| {
            let stored = ids[0].clone();
            let batch = |n: usize| -> Vec<Job> { (0..n).map(|_| job(None)).collect() };
            let mut holding_stored = batch(20);
            holding_stored[18] = job(Some(&stored));
            let mut twice = batch(3);
            twice[2] = twice[0].clone();
            let batches = [
                batch(20),
                holding_stored,
                batch(17),
                twice,
                vec![job(Some(&stored))],
                batch(5),
            ];
            let mut group: Vec<Write> = batches
                .iter()
                .map(|jobs| {
                    let (reply, _) = oneshot::channel();
                    Write::Insert {
                        jobs: jobs.clone(),
                        uniques: vec![None; jobs.len()],
                        reply,
                    }
                })
                .collect();
            let outcomes = commit_group(prepared, &mut group, confirmed, tally);
            let refused = [false, true, false, true, true, false];
            for (n, outcome) in outcomes.iter().enumerate() {
                match (refused[n], outcome) {
                    (false, Outcome::Inserted(Ok(answered))) => assert!(answered.is_empty()),
                    (true, Outcome::Inserted(Err(StoreError::Duplicate(id)))) => {
                        let named = if n == 3 {
                            &batches[3][0].envelope.id
                        } else {
                            &stored
                        };
                        assert_eq!(id, named, "request {n}");
                    }
                    _ => panic!("request {n}: another outcome"),
                }
            }
            for (n, jobs) in batches.iter().enumerate() {
                for j in jobs.iter().filter(|j| j.envelope.id != stored) {
                    let listed: Option<String> = conn
                        .query_row(
                            "SELECT event_seqs FROM jobs WHERE id = ?1",
                            params![j.envelope.id],
                            |r| r.get(0),
                        )
                        .optional()?;
                    match listed {
                        Some(listed) => {
                            assert!(!refused[n], "request {n} wrote a row");
                            assert_eq!(listed.split(',').filter(|s| !s.is_empty()).count(), 1);
                        }
                        None => assert!(refused[n], "request {n}'s job is missing"),
                    }
                }
            }
            let events: i64 = conn.query_row("SELECT count(*) FROM events", [], |r| r.get(0))?;
            let counted: i64 = conn.query_row(
                "SELECT n FROM job_counts WHERE state = 'available'",
                [],
                |r| r.get(0),
            )?;
            let expected = 1 + 20 + 17 + 5;
            assert_eq!((events, counted), (expected, expected));
            // The events are numbered without gaps: nothing refused took one.
            let highest: i64 = conn.query_row("SELECT max(seq) FROM events", [], |r| r.get(0))?;
            assert_eq!(highest, expected);
            assert!(conn.is_autocommit());
            Ok(())
        })
    }

    /// Batch PUSHes sharing a group commit keep no copies of pages in a
    /// temporary file: twelve batches of 100 whose ids interleave (as
    /// concurrent batches' UUIDv7s do) each change pages the ones before
    /// wrote, which a savepoint, or a statement of 16 rows that may stop
    /// halfway, would copy past SQLite's 64 KiB in memory into a file
    /// (`etilqs_…`) held open until the commit.
    #[cfg(target_os = "linux")]
    #[test]
    fn batches_in_one_group_commit_spill_no_page_copies_to_a_file() -> Result<(), StoreError> {
        with_available_jobs(1, |_, prepared, tally, confirmed, _| {
            let ids: Vec<String> = (0..1200)
                .map(|_| ojs_core::envelope::new_job_id())
                .collect();
            let mut group: Vec<Write> = (0..12)
                .map(|k| {
                    let jobs: Vec<Job> = ids
                        .iter()
                        .skip(k)
                        .step_by(12)
                        .map(|id| job(Some(id)))
                        .collect();
                    let (reply, _) = oneshot::channel();
                    Write::Insert {
                        uniques: vec![None; jobs.len()],
                        jobs,
                        reply,
                    }
                })
                .collect();
            // Last in the group, inside its transaction: the files SQLite
            // holds open for it.
            let (reply, _) = oneshot::channel();
            let temporary_files: RunFn = Box::new(|_| {
                let open = std::fs::read_dir("/proc/self/fd")
                    .map_err(|e| StoreError::Commit(e.to_string()))?
                    .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                    .filter(|target| target.to_string_lossy().contains("etilqs"))
                    .count();
                Ok(Box::new(open) as Box<dyn Any + Send>)
            });
            group.push(Write::Run {
                f: Some(temporary_files),
                isolation: Isolation::ChecksFirst,
                reply,
            });
            let outcomes = commit_group(prepared, &mut group, confirmed, tally);
            for (n, outcome) in outcomes[..12].iter().enumerate() {
                assert!(
                    matches!(outcome, Outcome::Inserted(Ok(_))),
                    "batch {n} was not stored"
                );
            }
            match &outcomes[12] {
                Outcome::Any(Ok(open)) => {
                    assert_eq!(
                        open.downcast_ref::<usize>(),
                        Some(&0),
                        "temporary files open"
                    );
                }
                _ => panic!("the last request failed"),
            }
            Ok(())
        })
    }

    /// A fresh store file with `n` available jobs, inserted by one group
    /// commit, handed to `test` with the writer's state and the jobs' ids.
    fn with_available_jobs(
        n: usize,
        test: impl FnOnce(
            &Connection,
            &Prepared<'_>,
            &RefCell<Tally>,
            &mut Confirmed,
            Vec<String>,
        ) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::Commit(e.to_string()))?;
        let conn = Connection::open(dir.join(STORE_FILE))?;
        conn.execute_batch(SCHEMA)?;
        let prepared = Prepared::new(&conn, 1);
        let tally = RefCell::new(Tally::default());
        let mut confirmed = Confirmed::load(&conn)?;
        let jobs: Vec<Job> = (0..n).map(|_| job(None)).collect();
        let ids: Vec<String> = jobs.iter().map(|j| j.envelope.id.clone()).collect();
        let (reply, _answer) = oneshot::channel();
        let mut group = vec![Write::Insert {
            jobs,
            uniques: vec![None; n],
            reply,
        }];
        let outcomes = commit_group(&prepared, &mut group, &mut confirmed, &tally);
        assert!(matches!(outcomes[..], [Outcome::Inserted(Ok(_))]));
        test(&conn, &prepared, &tally, &mut confirmed, ids)?;
        drop(prepared);
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_cannot_write_says_so_until_it_writes_again() -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        store.insert(vec![job(None)]).await?;
        // Another process holds the file's write lock past the busy wait.
        let blocker = Connection::open(dir.join(STORE_FILE))?;
        blocker.execute_batch("BEGIN EXCLUSIVE")?;
        match store.insert(vec![job(None)]).await {
            Err(StoreError::Commit(_)) => {}
            other => panic!("{other:?}"),
        }
        let down = store.ping().await.unwrap_err();
        assert!(down.to_string().contains("locked"), "{down}");
        blocker.execute_batch("ROLLBACK")?;
        store.insert(vec![job(None)]).await?;
        assert!(store.ping().await.is_ok());
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A job of `job_type` scheduled `hours` from `now` (or available).
    fn scheduled_in(hours: Option<i64>, now: DateTime<Utc>) -> Job {
        let mut body = json!({"type": "a.b", "args": []});
        if let Some(h) = hours {
            body["scheduled_at"] = json!(crate::job::timestamp(now + chrono::Duration::hours(h)));
        }
        crate::job::from_json(body, now).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The plan SQLite makes for a page of `query`, one line per step.
    fn page_plan(conn: &Connection, query: &JobQuery) -> Result<Vec<String>, StoreError> {
        let list = JobList::new(query, 50, 0);
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {}", list.page))?;
        let rows = stmt.query_map(rusqlite::params_from_iter(list.values.iter()), |r| {
            r.get::<_, String>(3)
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scheduled_jobs_are_listed_by_due_time_and_other_states_unsorted_from_indexes(
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let now = Utc::now();
        let (late, early, middle) = (
            scheduled_in(Some(3), now),
            scheduled_in(Some(1), now),
            scheduled_in(Some(2), now),
        );
        let (first, second) = (scheduled_in(None, now), scheduled_in(None, now));
        let due_order = ids(&[early.clone(), middle.clone(), late.clone()]);
        store
            .insert(vec![
                late,
                first.clone(),
                early.clone(),
                second.clone(),
                middle,
            ])
            .await?;
        let list = |state: &'static str, ascending: bool| {
            let store = store.clone();
            async move {
                let query = JobQuery {
                    state: Some(state.to_owned()),
                    by_schedule: true,
                    ascending,
                    ..JobQuery::default()
                };
                store
                    .run(move |tx| tx.list_jobs(&query, 50, 0))
                    .await
                    .map(|(jobs, total)| (ids(&jobs), total))
            }
        };
        assert_eq!(list("scheduled", true).await?, (due_order.clone(), 3));
        let mut reversed = due_order.clone();
        reversed.reverse();
        assert_eq!(list("scheduled", false).await?, (reversed, 3));
        assert_eq!(list("available", true).await?, (ids(&[first, second]), 2));
        // The scheduler finds them by the same index.
        let half_past = now + chrono::Duration::minutes(90);
        assert_eq!(
            ids(&store.due(half_past, 10).await?),
            ids(std::slice::from_ref(&early))
        );
        assert_eq!(
            store.next_due().await?.map(|t| t.timestamp_millis()),
            early.envelope.scheduled_at.map(|t| t.timestamp_millis())
        );
        // No page sorts the jobs of its state: the scheduled ones are read
        // from the partial index in order, the others from the index of
        // states by creation.
        let conn = Connection::open(dir.join(STORE_FILE))?;
        for (state, index) in [
            ("scheduled", "jobs_scheduled"),
            ("available", "jobs_state_created"),
        ] {
            for ascending in [true, false] {
                let plan = page_plan(
                    &conn,
                    &JobQuery {
                        state: Some(state.to_owned()),
                        by_schedule: true,
                        ascending,
                        ..JobQuery::default()
                    },
                )?;
                assert!(
                    plan.iter().any(|step| step.contains(index))
                        && !plan.iter().any(|step| step.contains("TEMP B-TREE")),
                    "{state}: {plan:?}"
                );
            }
        }
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_9_store_finds_its_scheduled_jobs_by_the_new_index() -> Result<(), StoreError>
    {
        let dir = fresh_dir();
        let now = Utc::now();
        let scheduled = scheduled_in(Some(1), now);
        let store = Store::open(&dir, Durability::Process).await?;
        store.insert(vec![scheduled.clone()]).await?;
        drop(store);
        // Back to version 9's index.
        let indexes = |conn: &Connection| -> Result<Vec<String>, StoreError> {
            let mut stmt = conn.prepare(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'jobs_%' \
                 ORDER BY name",
            )?;
            let names = stmt.query_map([], |r| r.get::<_, String>(0))?;
            Ok(names.collect::<Result<_, _>>()?)
        };
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            conn.execute_batch(
                "DROP INDEX jobs_scheduled; CREATE INDEX jobs_due ON jobs (state, due_ms);
                 PRAGMA user_version = 9;",
            )?;
            assert!(indexes(&conn)?.contains(&"jobs_due".to_owned()));
        }
        let store = Store::open(&dir, Durability::Process).await?;
        assert_eq!(
            ids(&store.due(now + chrono::Duration::hours(2), 10).await?),
            ids(&[scheduled])
        );
        drop(store);
        let conn = Connection::open(dir.join(STORE_FILE))?;
        let names = indexes(&conn)?;
        assert!(
            names.contains(&"jobs_scheduled".to_owned()) && !names.contains(&"jobs_due".to_owned()),
            "{names:?}"
        );
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        assert_eq!(version, SCHEMA_VERSION);
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
    /// A directory of its own for a test's store.
    fn fresh_dir() -> PathBuf {
        std::env::temp_dir().join(format!("ojs-api-store-{}", uuid::Uuid::new_v4().simple()))
    }

    /// The first page of the log, oldest first.
    async fn events_of(store: &Store) -> Result<EventPage, StoreError> {
        store
            .events(EventFilter {
                limit: 100,
                ..EventFilter::default()
            })
            .await
    }

    /// The log's numbers, oldest first.
    async fn event_seqs(store: &Store) -> Result<Vec<i64>, StoreError> {
        let page = events_of(store).await?;
        Ok(page.events.iter().map(|e| e.seq).collect())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_event_number_is_given_twice_after_deletes_and_reopens() -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (a, b) = (job(None), job(None));
        store.insert(vec![a.clone()]).await?;
        store.insert(vec![b.clone()]).await?;
        assert_eq!(event_seqs(&store).await?, [1, 2]);
        // The newest event goes with its job (a PUSH the broker refused).
        store.remove(vec![b.envelope.id.clone()]).await?;
        assert_eq!(event_seqs(&store).await?, [1]);
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        store.insert(vec![job(None)]).await?;
        assert_eq!(event_seqs(&store).await?, [1, 3]);
        // A prune past every event empties the log.
        store.prune(Utc::now() + chrono::Duration::days(1)).await?;
        assert_eq!(event_seqs(&store).await?, Vec::<i64>::new());
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        store.insert(vec![job(None)]).await?;
        assert_eq!(event_seqs(&store).await?, [4]);
        // A reset empties the log; the numbering goes on.
        store.run(|tx| tx.reset()).await?;
        drop(store);
        let store = Store::open(&dir, Durability::Process).await?;
        store.insert(vec![job(None)]).await?;
        assert_eq!(event_seqs(&store).await?, [5]);
        // A batch refused by its check (its 17th job a copy of the first,
        // or of a stored job) wrote nothing and numbered nothing: the next
        // job's event is the next number.
        let mut batch: Vec<Job> = (0..16).map(|_| job(None)).collect();
        batch.push(batch[0].clone());
        let twice = batch[0].envelope.id.clone();
        let failed = store.insert(batch).await;
        assert!(
            matches!(&failed, Err(StoreError::Duplicate(id)) if *id == twice),
            "{failed:?}"
        );
        store.insert(vec![job(None)]).await?;
        let seqs = event_seqs(&store).await?;
        assert_eq!(seqs, [5, 6]);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A batch of 37 is written 16 rows a statement (jobs, then their
    /// events), two statements and five single rows: every job stored with
    /// its fields and its event, in the batch's order; one id already
    /// stored, inside a statement of 16, fails the whole batch naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_is_written_sixteen_rows_a_statement_and_fails_whole() -> Result<(), StoreError>
    {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let stored = job(None);
        store.insert(vec![stored.clone()]).await?;
        let batch: Vec<Job> = (0..37)
            .map(|i| {
                let body = json!({"type": format!("t.n{i}"), "args": [i],
                    "options": {"queue": format!("q{}", i % 3)}});
                crate::job::from_json(body, Utc::now()).unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        store.insert(batch.clone()).await?;
        for (i, j) in batch.iter().enumerate() {
            let read = store
                .get(j.envelope.id.clone())
                .await?
                .unwrap_or_else(|| panic!("job {i} not stored"));
            assert_eq!(read.envelope.job_type, format!("t.n{i}"));
            assert_eq!(read.envelope.queue, format!("q{}", i % 3));
            assert_eq!(read.envelope.args, vec![json!(i)]);
            assert_eq!(read.state(), JobState::Available);
        }
        let page = events_of(&store).await?;
        let logged: Vec<(i64, &Value, &Value)> = page
            .events
            .iter()
            .map(|e| (e.seq, &e.body["job_id"], &e.body["type"]))
            .collect();
        assert_eq!(logged.len(), 38);
        for (i, j) in batch.iter().enumerate() {
            let (seq, id, kind) = logged[i + 1];
            assert_eq!(seq, i as i64 + 2, "event {i} numbered in order");
            assert_eq!(id, &json!(j.envelope.id), "event {i}");
            assert_eq!(kind, &json!("job.enqueued"));
        }
        // The stored id sixth in a batch of 20: nothing of it is stored.
        let mut refused: Vec<Job> = (0..20).map(|_| job(None)).collect();
        refused[5] = stored.clone();
        let failed = store.insert(refused.clone()).await;
        assert!(
            matches!(&failed, Err(StoreError::Duplicate(id)) if *id == stored.envelope.id),
            "{failed:?}"
        );
        for j in refused
            .iter()
            .filter(|j| j.envelope.id != stored.envelope.id)
        {
            assert!(store.get(j.envelope.id.clone()).await?.is_none());
        }
        assert_eq!(events_of(&store).await?.events.len(), 38);
        // The statements of 16 rows are kept: after the refused batch, the
        // next one is stored whole, with its events.
        let next: Vec<Job> = (0..20).map(|_| job(None)).collect();
        store.insert(next.clone()).await?;
        for j in &next {
            let read = store.get(j.envelope.id.clone()).await?;
            assert_eq!(read.map(|r| r.envelope.id), Some(j.envelope.id.clone()));
        }
        assert_eq!(events_of(&store).await?.events.len(), 58);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Makes the job active (what a FETCH saves) with `args`, then fails
    /// the transaction when `fail`.
    async fn activate_with(
        store: &Store,
        id: &str,
        args: Value,
        fail: bool,
    ) -> Result<(), StoreError> {
        let id = id.to_owned();
        store
            .run(move |tx| {
                let mut job = tx.load(&id)?;
                job.envelope.state = Some(JobState::Active);
                job.envelope.args =
                    serde_json::from_value(args).map_err(|e| StoreError::Commit(e.to_string()))?;
                tx.save(&job, None)?;
                if fail {
                    return Err(StoreError::Commit("rolled back on purpose".into()));
                }
                Ok(())
            })
            .await
    }

    async fn args_of(store: &Store, id: &str) -> Result<Value, StoreError> {
        let id = id.to_owned();
        let job = store.run(move |tx| tx.load(&id)).await?;
        serde_json::to_value(&job.envelope.args).map_err(|e| StoreError::Commit(e.to_string()))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_active_job_the_writer_keeps_is_read_again_after_any_change_it_did_not_make(
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let pushed = job(None);
        let id = pushed.envelope.id.clone();
        store.insert(vec![pushed]).await?;
        activate_with(&store, &id, json!([1]), false).await?;
        assert_eq!(args_of(&store, &id).await?, json!([1]));
        // Another connection (another process) changes the row.
        let other = Connection::open(dir.join(STORE_FILE))?;
        other.busy_timeout(Duration::from_secs(5))?;
        other.execute(
            "UPDATE jobs SET envelope = json_set(envelope, '$.args', json('[2]')) WHERE id = ?1",
            params![id],
        )?;
        assert_eq!(args_of(&store, &id).await?, json!([2]));
        // A transition that saved and then failed: what it saved is gone.
        activate_with(&store, &id, json!([3]), false).await?;
        let failed = activate_with(&store, &id, json!([4]), true).await;
        assert!(failed.is_err());
        assert_eq!(args_of(&store, &id).await?, json!([3]));
        // A removal through the writer's own statements.
        store.remove(vec![id.clone()]).await?;
        let gone = args_of(&store, &id).await;
        assert!(matches!(gone, Err(StoreError::NotFound(_))), "{gone:?}");
        // A reset, whose DELETE SQLite does not name to the update hook.
        let pushed = job(None);
        let id = pushed.envelope.id.clone();
        store.insert(vec![pushed]).await?;
        activate_with(&store, &id, json!([5]), false).await?;
        assert_eq!(args_of(&store, &id).await?, json!([5]));
        store.run(|tx| tx.reset()).await?;
        let gone = args_of(&store, &id).await;
        assert!(matches!(gone, Err(StoreError::NotFound(_))), "{gone:?}");
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Job `id`'s events in the log, by number.
    async fn seqs_of(store: &Store, id: &str) -> Result<Vec<i64>, StoreError> {
        let page = events_of(store).await?;
        Ok(page
            .events
            .iter()
            .filter(|e| e.body["job_id"] == id)
            .map(|e| e.seq)
            .collect())
    }

    /// The numbers job `id`'s row lists.
    fn listed_on_row(dir: &Path, id: &str) -> Result<Vec<i64>, StoreError> {
        let conn = Connection::open(dir.join(STORE_FILE))?;
        let listed: String = conn.query_row(
            "SELECT event_seqs FROM jobs WHERE id = ?1",
            params![id],
            |r| r.get(0),
        )?;
        Ok(listed_seqs(&listed).collect())
    }

    /// A transition of job `id` as the worker side records one (its events,
    /// then its row), and a fact about it after that in the same request.
    async fn start_with_a_fact(store: &Store, id: &str) -> Result<(), StoreError> {
        let id = id.to_owned();
        store
            .run(move |tx| {
                let now = Utc::now();
                let job = tx.load(&id)?;
                let started =
                    crate::model::apply(job, crate::model::Command::Start { worker: None }, now)
                        .map_err(|_| StoreError::Commit("the job did not start".into()))?;
                super::super::record(tx, &started, now)?;
                let subject = Subject {
                    job_id: &id,
                    queue: "default",
                    job_type: "a.b",
                };
                tx.fact("test.noted", &subject, now, &EventData::empty())
            })
            .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deleting_a_job_deletes_the_events_its_row_lists_and_a_prune_only_the_old_ones(
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (old, gone, refused) = (job(None), job(None), job(None));
        store
            .insert(vec![old.clone(), gone.clone(), refused.clone()])
            .await?;
        let gone_id = gone.envelope.id.clone();
        start_with_a_fact(&store, &gone_id).await?;
        start_with_a_fact(&store, &old.envelope.id).await?;
        // Each row lists its job's events: the insert's, the transition's
        // (listed with its save) and the fact after it (listed when the
        // request ended).
        for id in [&gone_id, &old.envelope.id, &refused.envelope.id] {
            let in_log = seqs_of(&store, id).await?;
            assert!(!in_log.is_empty());
            assert_eq!(listed_on_row(&dir, id)?, in_log, "{id}");
        }
        assert_eq!(seqs_of(&store, &gone_id).await?.len(), 3);
        let before = event_seqs(&store).await?;
        // A deletion in a request that wrote one more event about the job
        // first (not on its row yet) takes that one too, and nothing else.
        let id = gone_id.clone();
        store
            .run(move |tx| {
                let subject = Subject {
                    job_id: &id,
                    queue: "default",
                    job_type: "a.b",
                };
                tx.fact("test.noted", &subject, Utc::now(), &EventData::empty())?;
                tx.delete(&id)
            })
            .await?;
        assert!(store.get(gone_id.clone()).await?.is_none());
        assert_eq!(seqs_of(&store, &gone_id).await?, Vec::<i64>::new());
        // A PUSH the broker refused: its job and its event go.
        store.remove(vec![refused.envelope.id.clone()]).await?;
        assert_eq!(
            seqs_of(&store, &refused.envelope.id).await?,
            Vec::<i64>::new()
        );
        // What the log held of the other two jobs (refused: 1, gone: 3)
        // went; the old job's events are all that is left.
        let old_listed = listed_on_row(&dir, &old.envelope.id)?;
        let others = before.iter().filter(|s| !old_listed.contains(s)).count();
        assert_eq!(others, 4, "{before:?}");
        assert_eq!(event_seqs(&store).await?, old_listed);
        drop(store);
        // The old job's events date from a day ago; a prune of what is
        // older than an hour takes them and keeps the new job's.
        let conn = Connection::open(dir.join(STORE_FILE))?;
        conn.execute(
            "UPDATE events SET time_ms = time_ms - 86400000 WHERE job_id = ?1",
            params![old.envelope.id],
        )?;
        drop(conn);
        let store = Store::open(&dir, Durability::Process).await?;
        let new = job(None);
        store.insert(vec![new.clone()]).await?;
        store.prune(Utc::now() - chrono::Duration::hours(1)).await?;
        let page = events_of(&store).await?;
        let kept: Vec<&Value> = page.events.iter().map(|e| &e.body["job_id"]).collect();
        assert_eq!(kept, [&json!(new.envelope.id)], "{:?}", page.events);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A row's list of event numbers stays bounded: past 8 KiB its older
    /// half goes as more are added; what stays reads as whole numbers, the
    /// newest last, and deleting the job deletes the events it lists.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_jobs_list_of_events_stays_bounded() -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let pushed = job(None);
        let id = pushed.envelope.id.clone();
        store.insert(vec![pushed]).await?;
        let enqueued = seqs_of(&store, &id).await?;
        drop(store);
        // As if the job had 2,000 events before (numbers no event has).
        let older: Vec<i64> = (0..2000).map(|n| 9_000_000 + n).collect();
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            let list: String = older.iter().chain(&enqueued).map(|n| listed(*n)).collect();
            assert!(list.len() > 8192);
            conn.execute(
                "UPDATE jobs SET event_seqs = ?2 WHERE id = ?1",
                params![id, list],
            )?;
        }
        let store = Store::open(&dir, Durability::Process).await?;
        start_with_a_fact(&store, &id).await?;
        let in_log = seqs_of(&store, &id).await?;
        assert_eq!(in_log.len(), 3);
        let conn = Connection::open(dir.join(STORE_FILE))?;
        let text: String = conn.query_row(
            "SELECT event_seqs FROM jobs WHERE id = ?1",
            params![id],
            |r| r.get(0),
        )?;
        assert!(text.len() <= 8192, "{}", text.len());
        assert!(text.starts_with(','), "{}", &text[..20]);
        let kept: Vec<i64> = listed_seqs(&text).collect();
        assert_eq!(kept.len(), text.matches(',').count());
        // The newest stay, in order: the older half of the made-up ones
        // went, whole numbers at a time.
        assert!(kept.ends_with(&in_log), "{:?}", &kept[kept.len() - 5..]);
        let made_up = &kept[..kept.len() - in_log.len()];
        assert!(made_up.len() < older.len());
        assert!(older.ends_with(made_up));
        drop(conn);
        store.run(move |tx| tx.delete(&id)).await?;
        assert_eq!(event_seqs(&store).await?, Vec::<i64>::new());
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A damaged list (edited by hand, cut short, naming another job's
    /// event) deletes only events of its own job: what does not read as a
    /// number is skipped, and a number of another job's event deletes
    /// nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_damaged_list_deletes_only_its_own_jobs_events() -> Result<(), StoreError> {
        assert_eq!(
            listed_seqs(",1,x,,3,-,4.5,9999999999999999999999,7").collect::<Vec<_>>(),
            [1, 3, 7]
        );
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (damaged, other) = (job(None), job(None));
        store.insert(vec![damaged.clone(), other.clone()]).await?;
        let own = seqs_of(&store, &damaged.envelope.id).await?;
        let others = seqs_of(&store, &other.envelope.id).await?;
        assert_eq!((own.len(), others.len()), (1, 1));
        drop(store);
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            let list = format!(",x{},{},,12a,{}", own[0], others[0], own[0]);
            conn.execute(
                "UPDATE jobs SET event_seqs = ?2 WHERE id = ?1",
                params![damaged.envelope.id, list],
            )?;
        }
        let store = Store::open(&dir, Durability::Process).await?;
        let id = damaged.envelope.id.clone();
        store.run(move |tx| tx.delete(&id)).await?;
        assert_eq!(
            seqs_of(&store, &damaged.envelope.id).await?,
            Vec::<i64>::new()
        );
        assert_eq!(event_seqs(&store).await?, others);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// A store of version 11 (events found through `events_job`) opens as
    /// the current version: each row lists its job's events, found once,
    /// the index is gone, and deleting a job deletes exactly its events.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_11_store_lists_each_jobs_events_on_its_row() -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (a, b) = (job(None), job(None));
        store.insert(vec![a.clone(), b.clone()]).await?;
        start_with_a_fact(&store, &a.envelope.id).await?;
        let (a_seqs, b_seqs) = (
            seqs_of(&store, &a.envelope.id).await?,
            seqs_of(&store, &b.envelope.id).await?,
        );
        drop(store);
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            conn.execute_batch(
                "ALTER TABLE jobs DROP COLUMN event_seqs;
                 CREATE INDEX events_job ON events (job_id);
                 PRAGMA user_version = 11;",
            )?;
        }
        let store = Store::open(&dir, Durability::Process).await?;
        assert_eq!(listed_on_row(&dir, &a.envelope.id)?, a_seqs);
        assert_eq!(listed_on_row(&dir, &b.envelope.id)?, b_seqs);
        let id = a.envelope.id.clone();
        store.run(move |tx| tx.delete(&id)).await?;
        assert_eq!(event_seqs(&store).await?, b_seqs);
        drop(store);
        let conn = Connection::open(dir.join(STORE_FILE))?;
        let (version, index): (i64, i64) = conn.query_row(
            "SELECT (SELECT user_version FROM pragma_user_version),
                    (SELECT count(*) FROM sqlite_master WHERE name = 'events_job')",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        assert_eq!((version, index), (SCHEMA_VERSION, 0));
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_10_store_keeps_its_events_and_numbers_above_sqlites(
    ) -> Result<(), StoreError> {
        let dir = fresh_dir();
        let store = Store::open(&dir, Durability::Process).await?;
        let (a, b) = (job(None), job(None));
        store.insert(vec![a.clone(), b.clone()]).await?;
        let before = events_of(&store).await?.events;
        drop(store);
        // Back to version 10's log: numbered by SQLite, which gave 40 last
        // (the events after the second deleted).
        {
            let conn = Connection::open(dir.join(STORE_FILE))?;
            conn.execute_batch(
                "ALTER TABLE jobs DROP COLUMN event_seqs;
                 ALTER TABLE events RENAME TO events_11;
                 CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, type TEXT NOT NULL,
                   job_id TEXT NOT NULL, queue TEXT NOT NULL, job_type TEXT NOT NULL,
                   time_ms INTEGER NOT NULL, data TEXT NOT NULL);
                 INSERT INTO events SELECT * FROM events_11;
                 DROP TABLE events_11;
                 UPDATE sqlite_sequence SET seq = 40 WHERE name = 'events';
                 DELETE FROM meta WHERE key = 'events_through';
                 PRAGMA user_version = 10;",
            )?;
            let given: i64 = conn.query_row(
                "SELECT seq FROM sqlite_sequence WHERE name = 'events'",
                [],
                |r| r.get(0),
            )?;
            assert_eq!(given, 40);
        }
        let store = Store::open(&dir, Durability::Process).await?;
        let after = events_of(&store).await?.events;
        assert_eq!(
            after.iter().map(|e| (e.seq, &e.body)).collect::<Vec<_>>(),
            before.iter().map(|e| (e.seq, &e.body)).collect::<Vec<_>>()
        );
        assert_eq!(after.len(), 2);
        store.insert(vec![job(None)]).await?;
        assert_eq!(event_seqs(&store).await?, [1, 2, 41]);
        drop(store);
        let conn = Connection::open(dir.join(STORE_FILE))?;
        let (version, table, index): (i64, String, i64) = conn.query_row(
            "SELECT (SELECT user_version FROM pragma_user_version),
                    (SELECT sql FROM sqlite_master WHERE name = 'events'),
                    (SELECT count(*) FROM sqlite_master WHERE name = 'events_job')",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        assert_eq!((version, index), (SCHEMA_VERSION, 0));
        assert!(!table.contains("AUTOINCREMENT"), "{table}");
        // Each job's row lists its event, found by one sort of the log.
        for (id, seq) in [(&a.envelope.id, 1), (&b.envelope.id, 2)] {
            assert_eq!(listed_on_row(&dir, id)?, [seq]);
        }
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
    #[test]
    fn no_statement_of_a_request_reads_a_whole_table() -> Result<(), StoreError> {
        let dir = fresh_dir();
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::Commit(e.to_string()))?;
        let conn = Connection::open(dir.join(STORE_FILE))?;
        conn.execute_batch(SCHEMA)?;
        // What the writer runs for one job, worker, workflow, key or cron
        // job: each finds its rows through the table's key or an index,
        // however many jobs and events the store holds. (Lists, counts and
        // prunes read more by design, within their own limits.)
        let per_request = [
            sql::JOB.sqlite,
            JOB_PLACE,
            INSERT_JOB,
            ADD_QUEUE,
            SAVE_JOB,
            SAVE_JOB_AT_ROW,
            LIST_EVENTS,
            INSERT_EVENT,
            KEEP_EVENTS_THROUGH,
            DELETE_JOB_LISTED,
            DELETE_EVENT,
            sql::WORKER.sqlite,
            sql::SAVE_WORKER.sqlite,
            sql::DELETE_WORKER.sqlite,
            sql::SAVE_WORKFLOW.sqlite,
            sql::DELETE_WORKFLOW.sqlite,
            sql::RATE_KEY.sqlite,
            sql::SAVE_RATE_KEY.sqlite,
            sql::RATE_JOB_COUNTS.sqlite,
            sql::FILE_RATE_JOB.sqlite,
            sql::UNFILE_RATE_JOB.sqlite,
            sql::JOBS_WITH_UNIQUE_KEY.sqlite,
            sql::KEEP_UNIQUE_KEY.sqlite,
            sql::CRON.sqlite,
            sql::SAVE_CRON.sqlite,
            sql::DELETE_CRON.sqlite,
        ];
        for statement in per_request {
            let mut plan = conn.prepare(&format!("EXPLAIN QUERY PLAN {statement}"))?;
            let unbound = vec![rusqlite::types::Null; plan.parameter_count()];
            let steps: Vec<String> = plan
                .query_map(rusqlite::params_from_iter(unbound), |r| {
                    r.get::<_, String>(3)
                })?
                .collect::<Result<_, _>>()?;
            assert!(
                !steps.iter().any(|step| step.starts_with("SCAN ")),
                "{statement}: {steps:?}"
            );
        }
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
