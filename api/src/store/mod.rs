//! Job state beside the broker: each job's envelope, state and lifecycle
//! timestamps, the scheduled jobs that have not reached the broker yet, and
//! the event log. The broker holds the queue; the store holds what OJS
//! INFO, CANCEL, the state machine and the scheduler need.
//!
//! Two backends of one [`JobStore`] trait behind one [`Store`]: an SQLite
//! file in the data directory for one process (the default), and PostgreSQL
//! for several replicas that must act as one server, which also does what
//! only replicas need ([`SharedStore`]). Every state transition is the
//! model's (`crate::model`), written once against [`Tx`], and runs in one
//! transaction of either.

use std::any::Any;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::{JobEnvelope, JobState};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::job::{timestamp, Extra, Job};
use crate::model::cron::CronJob;
use crate::model::rate::{admit, Admission, KeyState, OnLimit, RateLimit};
use crate::model::unique::{OnConflict, Uniqueness};
use crate::model::workflow::Workflow;
use crate::model::{self, Command, EventData};
use crate::roster::WorkerRecord;

mod postgres;
mod sql;
mod sqlite;

pub use self::postgres::PostgresSettings;
pub use self::sqlite::STORE_FILE;

/// What the store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A job id that is already stored.
    #[error("job {0} already exists")]
    Duplicate(String),
    /// A job of the insert has a unique key a stored job holds, and its
    /// policy rejects duplicates; nothing of the insert was stored.
    #[error("job {index} of the insert is a duplicate of job {}", .existing.envelope.id)]
    Taken {
        /// The job's position in the insert.
        index: usize,
        /// The unique key.
        key: String,
        /// The stored job holding it.
        existing: Box<Job>,
    },
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
    /// The store cannot be opened or belongs to something else.
    #[error("cannot open the job store {place}: {reason}")]
    Open {
        /// The file, or the PostgreSQL server (never its credentials).
        place: String,
        /// Why.
        reason: String,
    },
    /// SQLite failed.
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL answered with an error; shown with the server's code
    /// and message (the client's own text is only "db error"), never its
    /// detail, which can quote a row's values.
    #[error("PostgreSQL: {}", postgres_said(.0))]
    Postgres(#[source] ::postgres::Error),
    /// PostgreSQL cannot be reached (down, restarting, the connection
    /// lost): the request may be repeated; the next one connects again.
    #[error("PostgreSQL is unavailable: {reason}")]
    Unavailable {
        /// What the connection attempt or the lost connection said.
        reason: String,
    },
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
    /// The store's threads are gone (the store is closing).
    #[error("the job store is closed")]
    Closed,
    /// A transition failed in a way no request should be able to cause (a
    /// bug): that request fails, its writes are rolled back, and the store
    /// goes on serving every other request.
    #[error("a job store transition failed unexpectedly: {reason}")]
    Internal {
        /// What the failure said.
        reason: String,
    },
}

impl StoreError {
    /// Whether the same request may succeed when repeated (the store, not
    /// the request, failed).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. } | StoreError::Closed)
    }

    /// Whether the failure belongs to the data, not to the store: a
    /// stored job this build cannot read, or a transition that failed
    /// unexpectedly. Repeating the request cannot help.
    pub fn is_data_error(&self) -> bool {
        matches!(
            self,
            StoreError::Corrupt { .. } | StoreError::Internal { .. }
        )
    }
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
    /// Jobs (empty: all).
    pub job_ids: Vec<String>,
    /// Queue patterns the reader may see (empty: all): a token's scope.
    pub scope: Vec<ojs_core::glob::Glob>,
    /// At most this many.
    pub limit: usize,
}

/// Positions of the log one read looks at, at most: a filter that
/// matches little is answered with what it found so far and a cursor past
/// what it looked at, so that no reader scans the whole log at once.
pub const MAX_EVENTS_SCANNED: i64 = 5_000;

/// A page of the event log.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventPage {
    /// The events that matched.
    pub events: Vec<Event>,
    /// More of the log may match after `cursor`.
    pub has_more: bool,
    /// Where the next read starts: the last event looked at.
    pub cursor: i64,
}

impl EventFilter {
    /// The query of one read: events at positions after `after` and at
    /// most [`MAX_EVENTS_SCANNED`] past it, with the filter's lists as SQL
    /// (the token's scope is matched on the rows), `placeholder(n)` naming
    /// the n-th parameter; and the parameters after the two bounds.
    pub(crate) fn sql(&self, placeholder: impl Fn(usize) -> String) -> (String, Vec<String>) {
        let mut sql = format!(
            "SELECT seq, type, job_id, queue, job_type, time_ms, data FROM events
             WHERE seq > {} AND seq <= {}",
            placeholder(1),
            placeholder(2)
        );
        let mut params = Vec::new();
        for (column, values) in [
            ("type", &self.types),
            ("queue", &self.queues),
            ("job_type", &self.job_types),
            ("job_id", &self.job_ids),
        ] {
            if values.is_empty() {
                continue;
            }
            let names: Vec<String> = values
                .iter()
                .map(|v| {
                    params.push(v.clone());
                    placeholder(params.len() + 2)
                })
                .collect();
            sql.push_str(&format!(" AND {column} IN ({})", names.join(", ")));
        }
        sql.push_str(" ORDER BY seq");
        (sql, params)
    }

    /// Whether the reader may see events of `queue` (the token's scope;
    /// the other filters are the query's).
    fn sees(&self, queue: &str) -> bool {
        crate::auth::in_scope(&self.scope, queue)
    }

    /// Whether `event` (of the log, as read) passes every filter: what
    /// the query selects, read in memory (the live stream's shared tail).
    pub(crate) fn admits(&self, event: &Event) -> bool {
        let field = |k: &str| event.body[k].as_str().unwrap_or_default();
        let listed = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == v);
        event.seq > self.after
            && listed(&self.types, field("type"))
            && listed(&self.queues, field("queue"))
            && listed(&self.job_types, field("job_type"))
            && listed(&self.job_ids, field("job_id"))
            && self.sees(field("queue"))
    }
}

/// What a commit of the embedded store survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// A crash of the process (`kill -9`): WAL with `synchronous=NORMAL`,
    /// written to the OS before the request is answered, synced at
    /// checkpoints. The embedded broker's default too.
    #[default]
    Process,
    /// Also power loss: an fsync per group commit (`synchronous=FULL`).
    Power,
}

/// Which replica holds an active job's broker delivery, and until when the
/// job is its worker's without a heartbeat. Kept only where several
/// replicas share the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The replica (its id for this run).
    pub holder: String,
    /// When the job goes back to the queue unless heartbeat.
    pub until: DateTime<Utc>,
}

/// What the replica holding a delivery is asked to do with it, because
/// the request that decided it reached another replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "do", rename_all = "snake_case")]
pub enum Settle {
    /// Completed: ack the delivery.
    Ack,
    /// Failed, to be tried again after this long (the adapter's delayed
    /// retry).
    Retry {
        /// The delay.
        delay_ms: u64,
    },
    /// Back to the queue as it is.
    Requeue,
    /// Exhausted: the adapter's dead-letter path, with the error kept.
    DeadLetter {
        /// The error's type.
        error_type: String,
        /// Its message.
        message: String,
    },
    /// Exhausted with `on_exhaustion = "discard"`: ack, nothing kept.
    Drop,
    /// A heartbeat: the job stays its worker's this much longer.
    Extend {
        /// From now.
        by_ms: u64,
    },
}

/// What PostgreSQL said: its SQLSTATE and message for a server error,
/// the client's text and its cause otherwise.
pub(crate) fn postgres_said(e: &::postgres::Error) -> String {
    match (e.as_db_error(), std::error::Error::source(e)) {
        (Some(db), _) => format!("{} ({})", db.message(), db.code().code()),
        (None, Some(cause)) => format!("{e}: {cause}"),
        (None, None) => e.to_string(),
    }
}

/// How much older than the retention cut a rate-limit window must be to be
/// pruned: the longest window, so that no running one goes.
pub(crate) const RATE_WINDOW_SLACK_MS: i64 = 86_400_000;

/// When a rate-limit key may be pruned from: its last use at `now`, or
/// when its override ends (never, for one without an end).
pub(crate) fn rate_key_seen(state: &KeyState, now: DateTime<Utc>) -> i64 {
    match &state.overridden {
        Some(o) => o.expires_at.map_or(i64::MAX, |at| ms(at.max(now))),
        None => ms(now),
    }
}

/// What the rate limits a job falls under decided at its start.
#[derive(Debug, Clone, PartialEq)]
pub enum RateDecision {
    /// Every key admitted it: the job is filed active under them.
    Started,
    /// A key refused it until then: nothing moved but the key's
    /// `limited` mark.
    Limited {
        /// When the first refusing key may admit it.
        until: DateTime<Utc>,
        /// The key that refused it (the latest to free, of those that did).
        key: String,
        /// What its limit says the job becomes.
        on_limit: OnLimit,
    },
}

/// Admits a start of `job` under each of `limits` at `now` (each key's
/// state locked until the commit where replicas share the store, in key
/// order so that two starts never wait on each other), recording
/// `rate_limit.exceeded` when a key becomes limited and
/// `rate_limit.released` when it admits again. A start admitted by every
/// key moves them all and files the job active under them.
pub fn take_rate(
    tx: &mut dyn Tx,
    job: &Job,
    limits: &[RateLimit],
    now: DateTime<Utc>,
) -> Result<RateDecision, StoreError> {
    let mut order: Vec<&RateLimit> = limits.iter().collect();
    order.sort_by(|a, b| a.key.cmp(&b.key));
    let mut admitted = Vec::with_capacity(order.len());
    let mut refused: Option<(DateTime<Utc>, &RateLimit)> = None;
    for limit in order {
        let mut state = tx.rate_key(&limit.key)?.unwrap_or_default();
        let (active, _) = tx.rate_jobs(&limit.key)?;
        match admit(&limit.limits, &mut state, active, now) {
            Admission::Started { released } => admitted.push((limit, state, released)),
            Admission::Limited { until, newly } => {
                if newly {
                    tx.save_rate_key(&limit.key, &state, now)?;
                    tx.event(
                        "rate_limit.exceeded",
                        &job.envelope,
                        now,
                        &EventData::empty()
                            .field("job_type", &job.envelope.job_type)
                            .field("key", &limit.key)
                            .field("queue", &job.envelope.queue)
                            .field("until", &timestamp(until)),
                    )?;
                }
                if refused.is_none_or(|(u, _)| until > u) {
                    refused = Some((until, limit));
                }
            }
        }
    }
    if let Some((until, limit)) = refused {
        return Ok(RateDecision::Limited {
            until,
            key: limit.key.clone(),
            on_limit: limit.on_limit,
        });
    }
    let keys: Vec<String> = admitted.iter().map(|(l, _, _)| l.key.clone()).collect();
    for (limit, state, released) in admitted {
        tx.save_rate_key(&limit.key, &state, now)?;
        if released {
            tx.event(
                "rate_limit.released",
                &job.envelope,
                now,
                &EventData::empty()
                    .field("job_type", &job.envelope.job_type)
                    .field("key", &limit.key)
                    .field("queue", &job.envelope.queue),
            )?;
        }
    }
    tx.file_rate_job(&job.envelope.id, &keys, RATE_ACTIVE)?;
    Ok(RateDecision::Started)
}

/// A job filed under a key runs.
pub(crate) const RATE_ACTIVE: &str = "active";
/// A job filed under a key waits for it.
pub(crate) const RATE_WAITING: &str = "waiting";
/// The extra field of a job that was ever filed under a rate-limit key:
/// its transitions unfile it when it leaves `active`.
pub(crate) const RATE_FILED: &str = "rate_keys";

/// Counts `envelopes` (stored JSON) by their `priority` (0 when none).
pub(crate) fn count_priorities(envelopes: impl Iterator<Item = String>) -> Vec<(i64, u64)> {
    let mut counts = std::collections::BTreeMap::<i64, u64>::new();
    for text in envelopes {
        let priority = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("priority").and_then(Value::as_i64))
            .unwrap_or(0);
        *counts.entry(priority).or_default() += 1;
    }
    counts.into_iter().collect()
}

/// A rate-limit key as the endpoints show it.
#[derive(Debug, Clone, PartialEq)]
pub struct RateKeyView {
    /// The key.
    pub key: String,
    /// Its state.
    pub state: KeyState,
    /// Its jobs running now.
    pub active: u64,
    /// Its jobs given back over its limit and not started since.
    pub waiting: u64,
}

/// A queue's stored jobs, as its statistics read them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueJobs {
    /// Jobs by state (the binding's state names).
    pub by_state: Vec<(String, u64)>,
    /// Dead letters among them.
    pub dead: u64,
    /// Jobs finished since the time asked, by state.
    pub finished_by_state: Vec<(String, u64)>,
    /// The newest completed since then.
    pub completed: Vec<Job>,
}

/// Which jobs an admin listing reads (`GET /ojs/v1/admin/jobs`, the bulk
/// operations): every filter is optional and they all hold together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobQuery {
    /// The queue: a name, or a prefix ending in `*`.
    pub queue: Option<String>,
    /// The state (the binding's name).
    pub state: Option<String>,
    /// The job type: a type, or a prefix ending in `*`.
    pub job_type: Option<String>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Created before.
    pub until: Option<DateTime<Utc>>,
    /// By when it is scheduled (else when it was created). Only scheduled
    /// jobs have a due time: listed with another state, jobs come in the
    /// order they were created either way.
    pub by_schedule: bool,
    /// Oldest first (else newest first).
    pub ascending: bool,
}

/// How many jobs a listing counts at most (its `total` stops there), and
/// how deep its pages go: a count or an offset past it would read a large
/// store's jobs one by one.
pub const LIST_COUNT_LIMIT: u64 = 10_000;

/// A value a [`JobQuery`] binds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Bound {
    Text(String),
    Int(i64),
}

impl JobQuery {
    /// Whether it lists the scheduled jobs by when they are due: the one
    /// listing a partial index of the store holds in order.
    pub(crate) fn scheduled_by_due_time(&self) -> bool {
        self.by_schedule && self.state.as_deref() == Some(state_name(JobState::Scheduled))
    }

    /// The query's `WHERE` clause (`TRUE` without filters) and its `ORDER
    /// BY`, with the values to bind in order; `placeholder(n)` names the
    /// n-th, `job_type` is the dialect's expression of the envelope's type,
    /// `tiebreak` the column that orders jobs of one time (one the
    /// indexes by time hold: SQLite's `rowid`, PostgreSQL's `id`).
    /// `queues_held`, where given, names a table whose `queue` column holds
    /// every queue that has jobs (and maybe others): a queue prefix becomes
    /// the list of those queues it matches, which the index on the jobs'
    /// queue serves, instead of a test of every row.
    pub(crate) fn sql(
        &self,
        job_type: &str,
        tiebreak: &str,
        queues_held: Option<&str>,
        placeholder: impl Fn(usize) -> String,
    ) -> (String, String, Vec<Bound>) {
        let mut clauses = Vec::new();
        let mut values = Vec::new();
        let bind = |v: Bound, values: &mut Vec<Bound>| {
            values.push(v);
            placeholder(values.len())
        };
        for (column, filter) in [("queue", &self.queue), (job_type, &self.job_type)] {
            match filter.as_deref() {
                None | Some("") => {}
                Some(f) => match f.strip_suffix('*') {
                    Some(prefix) => {
                        // Not LIKE (whose `_` and `%` a name may hold),
                        // nor a range (a collation may order `-` apart).
                        let p = bind(Bound::Text(prefix.to_owned()), &mut values);
                        match queues_held {
                            Some(table) if column == "queue" => clauses.push(format!(
                                "queue = ANY(ARRAY(SELECT DISTINCT queue FROM {table} \
                                 WHERE substr(queue, 1, length({p})) = {p}))"
                            )),
                            _ => clauses.push(format!("substr({column}, 1, length({p})) = {p}")),
                        }
                    }
                    None => {
                        let p = bind(Bound::Text(f.to_owned()), &mut values);
                        clauses.push(format!("{column} = {p}"));
                    }
                },
            }
        }
        if let Some(state) = &self.state {
            // A state the binding names is written as a literal: a partial
            // index (the scheduled jobs by due time) serves only a query
            // whose text names its condition, never a bound value.
            match crate::admin::STATES.iter().find(|s| **s == state.as_str()) {
                Some(known) => clauses.push(format!("state = '{known}'")),
                None => {
                    let p = bind(Bound::Text(state.clone()), &mut values);
                    clauses.push(format!("state = {p}"));
                }
            }
        }
        if let Some(t) = self.since {
            let p = bind(Bound::Int(ms(t)), &mut values);
            clauses.push(format!("created_ms >= {p}"));
        }
        if let Some(t) = self.until {
            let p = bind(Bound::Int(ms(t)), &mut values);
            clauses.push(format!("created_ms < {p}"));
        }
        let filter = if clauses.is_empty() {
            "TRUE".to_owned()
        } else {
            clauses.join(" AND ")
        };
        let direction = if self.ascending { "ASC" } else { "DESC" };
        // Only a scheduled job has a due time: by schedule, the jobs of
        // another state come in the order they were created, which an index
        // holds (ordered by a column empty throughout, every job of the
        // state would be sorted for one page).
        let column = if self.by_schedule && (self.state.is_none() || self.scheduled_by_due_time()) {
            "due_ms"
        } else {
            "created_ms"
        };
        (
            filter,
            format!("{column} {direction}, {tiebreak} {direction}"),
            values,
        )
    }
}

/// Stored jobs counted: by queue and state, and those finished since a
/// time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobCounts {
    /// (queue, state, how many).
    pub by_queue: Vec<(String, String, u64)>,
    /// (queue, state, how many) of the jobs that finished since the time
    /// asked.
    pub finished: Vec<(String, String, u64)>,
}

/// What an event is about, as the log files it (filters read these).
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// The job, or empty for an event of a queue or a cron that made none.
    pub job_id: &'a str,
    /// Its queue.
    pub queue: &'a str,
    /// Its job type, or empty.
    pub job_type: &'a str,
}

/// One transaction of the store, as a state transition sees it: read a
/// job (locked until the commit where that matters), write it back, log
/// what happened. Written once for both backends.
pub trait Tx {
    /// The job, or [`StoreError::NotFound`].
    fn load(&mut self, id: &str) -> Result<Job, StoreError>;
    /// Writes the job back (state, envelope, extra); `finished` when it
    /// reached a final state (retention counts from then).
    fn save(&mut self, job: &Job, finished: Option<DateTime<Utc>>) -> Result<(), StoreError>;
    /// Appends a job's event to the event log.
    fn event(
        &mut self,
        event_type: &str,
        job: &JobEnvelope,
        now: DateTime<Utc>,
        data: &EventData,
    ) -> Result<(), StoreError> {
        let subject = Subject {
            job_id: &job.id,
            queue: &job.queue,
            job_type: &job.job_type,
        };
        self.fact(event_type, &subject, now, data)
    }
    /// Appends an event to the event log: a job's, a queue's (no job id),
    /// a cron's (the job it fired, if any).
    fn fact(
        &mut self,
        event_type: &str,
        subject: &Subject<'_>,
        now: DateTime<Utc>,
        data: &EventData,
    ) -> Result<(), StoreError>;
    /// Stored jobs under a unique key (any state; the policy decides which
    /// count).
    fn jobs_with_unique_key(&mut self, key: &str) -> Result<Vec<Job>, StoreError>;
    /// Files a stored job under its unique key.
    fn keep_unique_key(&mut self, job_id: &str, key: &str) -> Result<(), StoreError>;
    /// Holds a unique key until the transaction ends, where concurrent
    /// transactions could otherwise both find it free (replicas).
    fn lock_unique_key(&mut self, _key: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Stores a job another producer put on the broker (a FETCH found it):
    /// it is on the broker already, nothing waits for a confirmation.
    fn insert_seen(&mut self, job: &Job) -> Result<(), StoreError>;
    /// Removes the job and its events.
    fn delete(&mut self, id: &str) -> Result<(), StoreError>;
    /// The job's lease, where replicas share the store.
    fn lease(&mut self, _id: &str) -> Result<Option<Lease>, StoreError> {
        Ok(None)
    }
    /// Sets (or clears) the job's lease, where replicas share the store.
    fn set_lease(&mut self, _id: &str, _lease: Option<&Lease>) -> Result<(), StoreError> {
        Ok(())
    }
    /// A worker's record (`crate::roster`), if it has one.
    fn worker(&mut self, id: &str) -> Result<Option<WorkerRecord>, StoreError>;
    /// Writes a worker's record; `seen`: its last heartbeat (records not
    /// seen for `[api] retention` are removed).
    fn save_worker(
        &mut self,
        id: &str,
        seen: DateTime<Utc>,
        record: &WorkerRecord,
    ) -> Result<(), StoreError>;
    /// Removes a worker's record; `false` when it had none.
    fn remove_worker(&mut self, id: &str) -> Result<bool, StoreError>;
    /// Every worker's record, by id.
    fn workers(&mut self) -> Result<Vec<WorkerRecord>, StoreError>;
    /// Jobs matching `query`, `limit` from `offset`, and how many match.
    fn list_jobs(
        &mut self,
        query: &JobQuery,
        limit: usize,
        offset: usize,
    ) -> Result<(Vec<Job>, u64), StoreError>;
    /// The positions of the oldest and the newest event the log holds
    /// (none when it is empty).
    fn event_bounds(&mut self) -> Result<(Option<i64>, Option<i64>), StoreError>;
    /// Stored jobs by queue and state, and those finished since `since`.
    fn job_counts(&mut self, since: DateTime<Utc>) -> Result<JobCounts, StoreError>;
    /// Per `bucket_ms` from `since` to `until` (of `queue`, or all): the
    /// jobs created, completed and discarded in it, as (bucket start,
    /// kind, how many); kind is `created`, `completed` or `discarded`.
    fn history(
        &mut self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_ms: i64,
        queue: Option<&str>,
    ) -> Result<Vec<(i64, String, u64)>, StoreError>;
    /// A workflow's record, locked until the commit where replicas share
    /// the store.
    fn workflow(&mut self, id: &str) -> Result<Option<Workflow>, StoreError>;
    /// Writes a workflow's record.
    fn save_workflow(&mut self, workflow: &Workflow) -> Result<(), StoreError>;
    /// Empties every table of jobs, events, workers, cron jobs, workflows
    /// and settings (`POST /ojs/v1/admin/reset`); the schema stays.
    fn reset(&mut self) -> Result<(), StoreError>;
    /// A setting of the server kept in the store, shared by replicas
    /// (`maintenance`).
    fn system(&mut self, key: &str) -> Result<Option<String>, StoreError>;
    /// Writes (or, with `None`, removes) a setting of the server.
    fn set_system(&mut self, key: &str, value: Option<&str>) -> Result<(), StoreError>;
    /// Removes a workflow's record (not its jobs).
    fn delete_workflow(&mut self, id: &str) -> Result<(), StoreError>;
    /// Workflows, newest first (only those in `state` when given).
    fn workflows(
        &mut self,
        state: Option<&str>,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<Workflow>, StoreError>;
    /// Jobs this transaction made available that are to be published once
    /// it commits (each carries the publishing mark until the broker
    /// confirmed it, so that a start publishes what a crash left).
    fn outbox(&mut self) -> &mut Vec<Job>;
    /// A cron job (`crate::cron`), locked until the commit where replicas
    /// share the store.
    fn cron(&mut self, name: &str) -> Result<Option<CronJob>, StoreError>;
    /// Writes a cron job.
    fn save_cron(&mut self, cron: &CronJob) -> Result<(), StoreError>;
    /// Removes a cron job; `false` when there was none.
    fn remove_cron(&mut self, name: &str) -> Result<bool, StoreError>;
    /// Every cron job, by name.
    fn crons(&mut self) -> Result<Vec<CronJob>, StoreError>;
    /// Takes `role` for `holder` until `until`, or renews it: `false` when
    /// another holder has it and its time has not run out at `now`.
    fn hold_role(
        &mut self,
        role: &str,
        holder: &str,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
    /// Paused queues, with when each was paused.
    fn paused_queues(&mut self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError>;
    /// Pauses (`true`) or resumes a queue, making it known when it was
    /// not; `false` when it already was so.
    fn set_paused(
        &mut self,
        queue: &str,
        paused: bool,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
    /// A queue's stored jobs: counts by state, the counts by state of those
    /// finished since `since`, and the newest of those completed since then
    /// (at most `sample`).
    fn queue_jobs(
        &mut self,
        queue: &str,
        since: DateTime<Utc>,
        sample: usize,
    ) -> Result<QueueJobs, StoreError>;
    /// A rate-limit key's state, locked until the commit where replicas
    /// share the store; none for a key never used.
    fn rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError>;
    /// A rate-limit key's state, read without a lock.
    fn peek_rate_key(&mut self, key: &str) -> Result<Option<KeyState>, StoreError>;
    /// Writes a rate-limit key's state (used at `now`).
    fn save_rate_key(
        &mut self,
        key: &str,
        state: &KeyState,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError>;
    /// A key's jobs (running, waiting).
    fn rate_jobs(&mut self, key: &str) -> Result<(u64, u64), StoreError>;
    /// Files a job under `keys` as [`RATE_ACTIVE`] or [`RATE_WAITING`].
    fn file_rate_job(
        &mut self,
        job_id: &str,
        keys: &[String],
        state: &str,
    ) -> Result<(), StoreError>;
    /// Unfiles a job from every key.
    fn unfile_rate_job(&mut self, job_id: &str) -> Result<(), StoreError>;
    /// A page of rate-limit keys (by key), and how many there are.
    fn rate_keys(
        &mut self,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<(String, KeyState)>, u64), StoreError>;
    /// Jobs filed under unique keys, by key, at most `limit`: (key, job).
    fn unique_holders(&mut self, limit: u64) -> Result<Vec<(String, Job)>, StoreError>;
    /// The priorities of a queue's jobs that wait to run (at most
    /// `limit` of them looked at), and how many have each.
    fn priority_counts(&mut self, queue: &str, limit: u64) -> Result<Vec<(i64, u64)>, StoreError>;
    /// Every queue's configuration (its record).
    fn queue_configs(&mut self) -> Result<Vec<(String, String)>, StoreError>;
    /// Writes a queue's configuration record.
    fn save_queue_config(&mut self, name: &str, record: &str) -> Result<(), StoreError>;
    /// Asks the replica `holder` to settle the job's delivery.
    fn send_settle(
        &mut self,
        _holder: &str,
        _id: &str,
        _settle: &Settle,
    ) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A transition run by [`Store::run`].
pub(crate) type RunFn =
    Box<dyn FnOnce(&mut dyn Tx) -> Result<Box<dyn Any + Send>, StoreError> + Send>;

/// How a transition's failure is kept from the other requests that share
/// its commit (the embedded store's group commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// It may refuse after writing: it runs in a savepoint of its own,
    /// which undoes its writes alone.
    Savepoint,
    /// Every check that can refuse it comes before its first write; once
    /// it writes, only the storage can fail it. It runs without a
    /// savepoint (under one SQLite copies each page it changes, about 3 %
    /// of a FETCH + ACK): a refusal needs no undo, and a failure after a
    /// write, which rolls SQLite's transaction back or is a bug, fails
    /// every request of its group, none of which keeps a write.
    ChecksFirst,
}

/// A backend of the job store: SQLite in the data directory (one process)
/// or PostgreSQL (replicas). [`Store`] is what callers hold; every
/// transition is written once, against [`Tx`], and the backend runs it in
/// one of its transactions.
#[async_trait::async_trait]
pub(crate) trait JobStore: std::fmt::Debug + Send + Sync {
    /// The backend's name, as health shows it (`sqlite`, `postgres`).
    fn kind(&self) -> &'static str;
    /// Where the store is, for the log (never credentials).
    fn place(&self) -> String;
    /// What the store does for replicas sharing it, when it is shared.
    fn shared(&self) -> Option<&dyn SharedStore> {
        None
    }
    /// Whether the store answers now.
    async fn ping(&self) -> Result<(), StoreError>;
    /// See [`Store::insert`].
    async fn insert(&self, jobs: Vec<Job>, uniques: Uniques) -> Result<Vec<Inserted>, StoreError>;
    /// See [`Store::published`].
    fn published(&self, ids: Vec<String>);
    /// See [`Store::remove`].
    async fn remove(&self, ids: Vec<String>) -> Result<(), StoreError>;
    /// Runs `f` in one transaction; `isolation` says what keeps its
    /// failure from the requests sharing that transaction, where some do.
    async fn run(&self, f: RunFn, isolation: Isolation) -> Result<Box<dyn Any + Send>, StoreError>;
    /// See [`Store::prune`].
    async fn prune(&self, before: DateTime<Utc>) -> Result<u64, StoreError>;
    /// See [`Store::get`].
    async fn get(&self, id: String) -> Result<Option<Job>, StoreError>;
    /// See [`Store::due`].
    async fn due(&self, now: DateTime<Utc>, limit: usize) -> Result<Vec<Job>, StoreError>;
    /// See [`Store::next_due`].
    async fn next_due(&self) -> Result<Option<DateTime<Utc>>, StoreError>;
    /// See [`Store::unpublished`].
    async fn unpublished(&self, limit: usize) -> Result<Vec<Job>, StoreError>;
    /// See [`Store::dead_letters`].
    async fn dead_letters(&self) -> Result<Vec<Job>, StoreError>;
    /// See [`Store::queues`].
    async fn queues(&self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError>;
    /// See [`Store::events`].
    async fn events(&self, filter: EventFilter) -> Result<EventPage, StoreError>;
    /// See [`Store::close`]. A store that keeps no log of its own (a
    /// server's) has nothing to do.
    async fn close(&self) -> Result<bool, StoreError> {
        Ok(true)
    }
}

/// What only a store shared by replicas does: pass settlements between
/// them (each replica holds its own broker deliveries). Leases are part
/// of [`Tx`], whose defaults keep none.
#[async_trait::async_trait]
pub(crate) trait SharedStore: Send + Sync {
    /// Settlements other replicas asked of `holder`, taken.
    async fn take_settles(&self, holder: String) -> Result<Vec<(String, Settle)>, StoreError>;
}

/// Jobs committed as available in a transaction that are not on the broker
/// yet (the next steps of workflows): the API's publisher takes them.
/// Each also carries the publishing mark in the store, so that what a
/// crash leaves here is published by the next start.
#[derive(Debug, Default)]
pub struct Outbox {
    jobs: std::sync::Mutex<Vec<Job>>,
    added: tokio::sync::Notify,
}

impl Outbox {
    fn add(&self, jobs: Vec<Job>) {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(jobs);
        self.added.notify_one();
    }

    /// Waits for jobs and takes them all.
    pub async fn take(&self) -> Vec<Job> {
        loop {
            let added = self.added.notified();
            let jobs = std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()));
            if !jobs.is_empty() {
                return jobs;
            }
            added.await;
        }
    }

    /// Puts back jobs whose publish failed, to be tried again.
    pub fn put_back(&self, jobs: Vec<Job>) {
        self.add(jobs);
    }
}

/// The store.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn JobStore>,
    /// Jobs readied in transactions (a workflow's next steps), for the
    /// API's publisher.
    outbox: Arc<Outbox>,
    /// Woken after every write through this process (readers of the event
    /// log look again; writes of other replicas are found by looking
    /// every second).
    written: Arc<tokio::sync::Notify>,
    /// Where each operation's latency is recorded.
    timings: Arc<crate::metrics::ApiMetrics>,
}

impl Store {
    /// Opens (creating when needed) the embedded store in `dir`.
    pub async fn open(dir: &Path, durability: Durability) -> Result<Store, StoreError> {
        Ok(Store {
            backend: Arc::new(sqlite::SqliteStore::open(dir, durability).await?),
            outbox: Arc::default(),
            written: Arc::default(),
            timings: Arc::default(),
        })
    }

    /// Connects to PostgreSQL and brings its schema up to date.
    pub async fn connect(settings: &PostgresSettings) -> Result<Store, StoreError> {
        Ok(Store {
            backend: Arc::new(postgres::PostgresStore::connect(settings).await?),
            outbox: Arc::default(),
            written: Arc::default(),
            timings: Arc::default(),
        })
    }

    /// The same store, recording its latency in `metrics`.
    pub fn timed_into(mut self, metrics: Arc<crate::metrics::ApiMetrics>) -> Self {
        self.timings = metrics;
        self
    }

    /// Runs one operation, recording how long it took under `op`.
    async fn timed<T>(
        &self,
        op: &'static str,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let began = std::time::Instant::now();
        let done = work.await;
        self.timings.store_op(op, began.elapsed(), done.is_err());
        done
    }

    /// The backend's name, as health shows it (`sqlite`, `postgres`).
    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Where the store is, for the log (a file, or a PostgreSQL server
    /// without its credentials).
    pub fn place(&self) -> String {
        self.backend.place()
    }

    /// Whether several processes share this store (replicas must then
    /// pass settlements and leases through it).
    pub fn is_shared(&self) -> bool {
        self.backend.shared().is_some()
    }

    /// Whether the store answers now (the embedded one: whether its last
    /// commit went through).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.backend.ping().await
    }

    /// Before the process stops: what the store keeps in a log of its own
    /// is written into its files (the embedded store's write-ahead log is
    /// copied into the database and emptied), so that a clean stop leaves
    /// files that need no recovery and that any SQLite program reads
    /// whole. Whether the log was emptied: a read still running keeps it,
    /// and the next open recovers from it as after a crash. Writes after
    /// it still work (they go to the log again).
    pub async fn close(&self) -> Result<bool, StoreError> {
        self.backend.close().await
    }

    /// Stores new jobs, all or none: a stored id is
    /// [`StoreError::Duplicate`]. They count as not yet on the broker until
    /// [`Store::published`]. The jobs come back (a request's jobs are not
    /// copied to be stored).
    pub async fn insert(&self, jobs: Vec<Job>) -> Result<Vec<Job>, StoreError> {
        let uniques = vec![None; jobs.len()];
        let inserted = self.insert_unique(jobs, uniques).await?;
        Ok(inserted
            .into_iter()
            .map(|i| match i {
                Inserted::Stored(job) | Inserted::Existing(job) => job,
            })
            .collect())
    }

    /// [`Store::insert`] of jobs some of which have a unique key (by
    /// position in `uniques`): in the same transaction, a job whose key a
    /// stored job holds is refused ([`StoreError::Taken`], nothing stored),
    /// answered by that job, or replaces it, as its policy says. Of
    /// concurrent inserts of one key, also through other replicas, exactly
    /// one finds it free.
    pub async fn insert_unique(
        &self,
        jobs: Vec<Job>,
        uniques: Uniques,
    ) -> Result<Vec<Inserted>, StoreError> {
        let inserted = self
            .timed("insert", self.backend.insert(jobs, uniques))
            .await;
        self.written.notify_waiters();
        inserted
    }

    /// Wakes after the next write through this process.
    pub fn written(&self) -> tokio::sync::futures::Notified<'_> {
        self.written.notified()
    }

    /// Records that the broker confirmed these jobs. Not awaited: a job
    /// whose mark is lost is published again (at least once).
    pub fn published(&self, ids: Vec<String>) {
        self.backend.published(ids);
    }

    /// Removes jobs the broker did not take, so that nothing is half-stored.
    pub async fn remove(&self, ids: Vec<String>) -> Result<(), StoreError> {
        self.timed("other", self.backend.remove(ids)).await
    }

    /// Cancels a job that is not finished; returns its previous state and
    /// the job now.
    pub async fn cancel(
        &self,
        id: String,
        now: DateTime<Utc>,
    ) -> Result<(JobState, Job), StoreError> {
        self.run(move |tx| cancel(tx, &id, now)).await
    }

    /// Scheduled jobs the broker confirmed become available.
    pub async fn promote(&self, ids: Vec<String>, now: DateTime<Utc>) -> Result<(), StoreError> {
        self.run(move |tx| promote(tx, &ids, now)).await
    }

    /// ACTIVATE: a pending job becomes available (not on the broker yet:
    /// the caller publishes it); returns the job now.
    pub async fn activate(&self, id: String, now: DateTime<Utc>) -> Result<Job, StoreError> {
        self.run(move |tx| activate(tx, &id, now)).await
    }

    /// Puts an activated job back to pending when the broker did not take
    /// it (unless something else moved it meanwhile).
    pub async fn deactivate(&self, id: String, now: DateTime<Utc>) -> Result<(), StoreError> {
        self.run(move |tx| deactivate(tx, &id, now)).await
    }

    /// Runs the transition `f` in one transaction and answers after the
    /// commit; when `f` fails nothing it wrote stays.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Tx) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.run_isolated(f, Isolation::Savepoint).await
    }

    /// [`Store::run`] for a transition whose every check that can refuse
    /// it comes before its first write ([`Isolation::ChecksFirst`]): a
    /// refusal is answered as by `run`; a failure after a write (only the
    /// storage's, or a bug) fails the other requests of its commit too.
    pub async fn run_checks_first<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Tx) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.run_isolated(f, Isolation::ChecksFirst).await
    }

    async fn run_isolated<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Tx) -> Result<T, StoreError> + Send + 'static,
        isolation: Isolation,
    ) -> Result<T, StoreError> {
        let f: RunFn = Box::new(move |tx| {
            let answer = f(tx)?;
            let readied = std::mem::take(tx.outbox());
            Ok(Box::new((answer, readied)) as Box<dyn Any + Send>)
        });
        let any = self
            .timed("transition", self.backend.run(f, isolation))
            .await?;
        let (answer, readied) = any
            .downcast::<(T, Vec<Job>)>()
            .map(|b| *b)
            .map_err(|_| StoreError::Commit("a store answer of the wrong type".into()))?;
        if !readied.is_empty() {
            self.outbox.add(readied);
        }
        self.written.notify_waiters();
        Ok(answer)
    }

    /// Jobs readied by committed transactions, waiting to be published.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// Removes finished jobs (and events) older than `before`.
    pub async fn prune(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        self.timed("maintenance", self.backend.prune(before)).await
    }

    /// One job.
    pub async fn get(&self, id: String) -> Result<Option<Job>, StoreError> {
        self.timed("get", self.backend.get(id)).await
    }

    /// Scheduled jobs due at `now`, oldest first. Where replicas share the
    /// store, the jobs returned are claimed for a while, so that one
    /// replica publishes each.
    pub async fn due(&self, now: DateTime<Utc>, limit: usize) -> Result<Vec<Job>, StoreError> {
        self.timed("scheduled", self.backend.due(now, limit)).await
    }

    /// When the next scheduled job is due, if any is.
    pub async fn next_due(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.timed("scheduled", self.backend.next_due()).await
    }

    /// Available jobs whose publish was never confirmed (a process stopped
    /// between storing and publishing them): publish them again.
    pub async fn unpublished(&self, limit: usize) -> Result<Vec<Job>, StoreError> {
        self.timed("scheduled", self.backend.unpublished(limit))
            .await
    }

    /// Every dead letter (a job discarded into its queue's dead-letter
    /// path), oldest first.
    pub async fn dead_letters(&self) -> Result<Vec<Job>, StoreError> {
        self.timed("other", self.backend.dead_letters()).await
    }

    /// Queues that have had a job, with when the first arrived.
    pub async fn queues(&self) -> Result<Vec<(String, DateTime<Utc>)>, StoreError> {
        self.timed("other", self.backend.queues()).await
    }

    /// Events matching `filter`, oldest first, looking at no more than
    /// [`MAX_EVENTS_SCANNED`] of the log.
    pub async fn events(&self, filter: EventFilter) -> Result<EventPage, StoreError> {
        self.timed("events", self.backend.events(filter)).await
    }

    /// Settlements other replicas asked of `holder`, taken (each is
    /// handed out once); none where no replica shares the store.
    pub async fn take_settles(&self, holder: &str) -> Result<Vec<(String, Settle)>, StoreError> {
        match self.backend.shared() {
            Some(shared) => {
                self.timed("maintenance", shared.take_settles(holder.to_owned()))
                    .await
            }
            None => Ok(Vec::new()),
        }
    }
}

/// Runs one store request so that a panic in it (a bug) fails that request
/// alone with [`StoreError::Internal`] instead of taking the store's thread,
/// and with it every later request, down.
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(done) => done,
        Err(panic) => {
            let reason = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            tracing::error!(%reason, "a job store request failed unexpectedly; it was rolled back and the store goes on");
            Err(StoreError::Internal { reason })
        }
    }
}

pub(crate) fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// A record (a worker's, a cron job's) as stored.
pub(crate) fn record_text<T: Serialize>(id: &str, record: &T) -> Result<String, StoreError> {
    serde_json::to_string(record).map_err(|e| StoreError::Corrupt {
        id: id.to_owned(),
        reason: e.to_string(),
    })
}

/// A stored record (a worker's, `crate::roster`; a cron job's), or why it
/// does not decode.
pub(crate) fn record_of<T: serde::de::DeserializeOwned>(
    id: &str,
    record: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(record).map_err(|e| StoreError::Corrupt {
        id: id.to_owned(),
        reason: e.to_string(),
    })
}

pub(crate) fn decode(id: &str, envelope: &str, extra: &str) -> Result<Job, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.to_owned(),
        reason,
    };
    let envelope =
        JobEnvelope::from_json_slice(envelope.as_bytes()).map_err(|e| corrupt(e.to_string()))?;
    let extra: Extra = serde_json::from_str(extra).map_err(|e| corrupt(e.to_string()))?;
    Ok(Job { envelope, extra })
}

pub(crate) fn encode(job: &Job) -> Result<(String, String), StoreError> {
    let envelope = job
        .envelope
        .to_json_string()
        .map_err(|e| StoreError::Corrupt {
            id: job.envelope.id.clone(),
            reason: e.to_string(),
        })?;
    // Written straight into a string: `Value`'s `Display` writes the same
    // text through `fmt`'s machinery, and needed the map cloned.
    let extra = ojs_core::json_out::to_string(&job.extra).map_err(|e| StoreError::Corrupt {
        id: job.envelope.id.clone(),
        reason: e.to_string(),
    })?;
    Ok((envelope, extra))
}

/// `value` as compact JSON text, for a TEXT column: the text `Display`
/// writes, written straight into a string instead of through `fmt`'s
/// machinery (a call per token).
pub(crate) fn json_text(value: &Value) -> String {
    // A `Value`'s keys are strings, so writing it cannot fail; the
    // fallback is the same text by the slower path.
    ojs_core::json_out::to_string(value).unwrap_or_else(|_| value.to_string())
}

pub(crate) use crate::model::state_name;

/// When a scheduled job is due (its row's `due_ms`); none for the others.
pub(crate) fn due_ms(job: &Job) -> Option<i64> {
    (job.state() == JobState::Scheduled)
        .then(|| job.envelope.scheduled_at.map(ms))
        .flatten()
}

/// The event `job.enqueued` or `job.scheduled` of a job just stored.
pub(crate) fn stored_event(job: &Job) -> (&'static str, DateTime<Utc>, EventData) {
    let e = &job.envelope;
    let state = job.state();
    let name = if state == JobState::Scheduled {
        "job.scheduled"
    } else {
        "job.enqueued"
    };
    (
        name,
        e.created_at.unwrap_or_else(Utc::now),
        EventData::of_job(&e.job_type, &e.queue, state_name(state)),
    )
}

/// An event as the binding shows it; its log position names it (unique
/// and stable).
pub(crate) fn event_body(
    seq: i64,
    event_type: &str,
    job_id: &str,
    queue: &str,
    job_type: &str,
    time_ms: i64,
    data: &str,
) -> Event {
    let id = crate::events::event_id(seq);
    let time = timestamp(DateTime::from_timestamp_millis(time_ms).unwrap_or_default());
    let data: Value = serde_json::from_str(data).unwrap_or(Value::Null);
    Event {
        seq,
        body: json!({
            "specversion": "1.0",
            "id": id,
            "type": event_type,
            "source": "ojs-bridge",
            "time": time,
            "timestamp": time,
            "subject": subject_of(job_id, queue, &data),
            "job_id": job_id,
            "queue": queue,
            "job_type": job_type,
            "data": data,
        }),
    }
}

/// An event's `subject`: its job, else its cron, else its queue.
fn subject_of(job_id: &str, queue: &str, data: &Value) -> String {
    if let Some(name) = data.get("cron_name").and_then(Value::as_str) {
        return name.to_owned();
    }
    if job_id.is_empty() {
        queue.to_owned()
    } else {
        job_id.to_owned()
    }
}

/// How long a replica's claim on due scheduled jobs lasts: another replica
/// publishes them if the first has not promoted them by then.
pub(crate) const SCHEDULE_CLAIM: Duration = Duration::from_secs(30);

/// Writes a transition in `tx`: the job as it became, then its events.
/// A job of a workflow that finishes moves its workflow on in the same
/// transaction (`crate::workflow`).
pub(crate) fn record(
    tx: &mut dyn Tx,
    t: &model::Transition,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    record_alone(tx, t, now)?;
    if model::is_final(t.job.state()) && !model::is_final(t.previous) {
        crate::workflow::member_finished(tx, &t.job, now)?;
    }
    Ok(())
}

/// [`record`] without moving the job's workflow on: for the changes a
/// workflow makes to its own members.
pub(crate) fn record_alone(
    tx: &mut dyn Tx,
    t: &model::Transition,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    // The events first: the embedded store lists their numbers on the
    // job's row with the save, not with a write of their own.
    for e in &t.events {
        tx.event(e.kind, &t.job.envelope, now, &e.data)?;
    }
    tx.save(&t.job, t.finished)?;
    // A job filed under rate-limit keys that stops running (or waiting)
    // frees its place there in the same transaction.
    if t.job.extra.contains_key(RATE_FILED)
        && t.job.state() != JobState::Active
        && t.job.state() != t.previous
    {
        tx.unfile_rate_job(&t.job.envelope.id)?;
    }
    Ok(())
}

/// The store's error for a command the job's state refused.
/// The unique keys of an insert's jobs, by position; none for a job
/// without a policy.
pub type Uniques = Vec<Option<Uniqueness>>;

/// One job of an insert.
#[derive(Debug, Clone, PartialEq)]
pub enum Inserted {
    /// Stored, as it was stored.
    Stored(Job),
    /// Not stored: a stored job holds its unique key and its policy says
    /// to answer that job (`on_conflict: ignore`).
    Existing(Job),
}

/// The unique-key step of an insert, the same in both stores and run in
/// the insert's transaction before its rows are written. For each job with
/// a key: the stored job that holds the key (or an earlier job of the same
/// insert), if any, decides by the job's policy — `reject` fails the whole
/// insert, `ignore` answers the holder instead of storing the job,
/// `replace` cancels the holder (`replace_except_schedule` also gives the
/// new job the holder's schedule). The answer says, per job, the holder
/// that answers for it; none: the job is to be stored.
pub(crate) fn claim_unique_keys(
    tx: &mut dyn Tx,
    jobs: &mut [Job],
    uniques: &[Option<Uniqueness>],
) -> Result<Vec<Option<Job>>, StoreError> {
    let mut answered: Vec<Option<Job>> = vec![None; jobs.len()];
    let mut locked: Vec<&str> = uniques.iter().flatten().map(|u| u.key.as_str()).collect();
    // One order for every transaction: two inserts holding keys the other
    // wants never wait on each other.
    locked.sort_unstable();
    locked.dedup();
    for key in locked {
        tx.lock_unique_key(key)?;
    }
    for i in 0..jobs.len() {
        let Some(unique) = uniques.get(i).and_then(Option::as_ref) else {
            continue;
        };
        let now = jobs[i].envelope.created_at.unwrap_or_else(Utc::now);
        // An earlier job of this insert with the same key, still to be
        // stored, holds it first.
        let earlier = (0..i).rev().find(|&j| {
            answered[j].is_none()
                && uniques[j].as_ref().is_some_and(|u| u.key == unique.key)
                && unique.is_taken_by(&jobs[j], now)
        });
        let holder = match earlier {
            Some(j) => Some(Holder::Earlier(j)),
            None => tx
                .jobs_with_unique_key(&unique.key)?
                .into_iter()
                .find(|stored| unique.is_taken_by(stored, now))
                .map(|stored| Holder::Stored(Box::new(stored))),
        };
        let Some(holder) = holder else { continue };
        let holding = match &holder {
            Holder::Earlier(j) => jobs[*j].clone(),
            Holder::Stored(stored) => (**stored).clone(),
        };
        match unique.on_conflict {
            OnConflict::Reject => {
                return Err(StoreError::Taken {
                    index: i,
                    key: unique.key.clone(),
                    existing: Box::new(holding),
                })
            }
            OnConflict::Ignore => answered[i] = Some(holding),
            OnConflict::Replace | OnConflict::ReplaceExceptSchedule => {
                if unique.on_conflict == OnConflict::ReplaceExceptSchedule {
                    take_schedule(&mut jobs[i], &holding, now);
                }
                let id = holding.envelope.id.clone();
                let cancelled =
                    model::apply(holding, Command::Cancel, now).map_err(|r| wrong_state(&id, r))?;
                match holder {
                    // Not stored yet: it is stored cancelled.
                    Holder::Earlier(j) => jobs[j] = cancelled.job,
                    Holder::Stored(_) => record(tx, &cancelled, now)?,
                }
            }
        }
    }
    Ok(answered)
}

/// The jobs of an insert to be stored: those no holder answers for.
pub(crate) fn unanswered(jobs: &[Job], answered: &[Option<Job>]) -> Vec<Job> {
    jobs.iter()
        .zip(answered)
        .filter(|(_, holder)| holder.is_none())
        .map(|(job, _)| job.clone())
        .collect()
}

/// Files each stored job of an insert under its unique key.
pub(crate) fn keep_unique_keys(
    tx: &mut dyn Tx,
    jobs: &[Job],
    uniques: &[Option<Uniqueness>],
    answered: &[Option<Job>],
) -> Result<(), StoreError> {
    for ((job, unique), holder) in jobs.iter().zip(uniques).zip(answered) {
        if let (Some(unique), None) = (unique, holder) {
            tx.keep_unique_key(&job.envelope.id, &unique.key)?;
        }
    }
    Ok(())
}

/// The job that holds a unique key.
enum Holder {
    /// An earlier job of the same insert, by position.
    Earlier(usize),
    /// A stored job.
    Stored(Box<Job>),
}

/// `replace_except_schedule`: the new job runs when the one it replaces
/// would have.
fn take_schedule(job: &mut Job, replaced: &Job, now: DateTime<Utc>) {
    job.envelope.scheduled_at = replaced.envelope.scheduled_at;
    if job.state() == JobState::Pending {
        return;
    }
    let later = job.envelope.scheduled_at.is_some_and(|t| t > now);
    job.envelope.state = Some(if later {
        JobState::Scheduled
    } else {
        JobState::Available
    });
    job.envelope.enqueued_at = (!later).then_some(now);
}

pub(crate) fn wrong_state(id: &str, refused: model::Refused) -> StoreError {
    StoreError::WrongState {
        id: id.to_owned(),
        current: refused.0,
    }
}

/// Loads `id`, applies `command` and records the transition.
fn transition(
    tx: &mut dyn Tx,
    id: &str,
    command: Command<'_>,
    now: DateTime<Utc>,
) -> Result<model::Transition, StoreError> {
    let t = model::apply(tx.load(id)?, command, now).map_err(|r| wrong_state(id, r))?;
    record(tx, &t, now)?;
    Ok(t)
}

fn cancel(tx: &mut dyn Tx, id: &str, now: DateTime<Utc>) -> Result<(JobState, Job), StoreError> {
    let t = transition(tx, id, Command::Cancel, now)?;
    Ok((t.previous, t.job))
}

fn activate(tx: &mut dyn Tx, id: &str, now: DateTime<Utc>) -> Result<Job, StoreError> {
    Ok(transition(tx, id, Command::Activate, now)?.job)
}

/// Undoes an activation whose publish failed; a job gone or changed
/// meanwhile is left as it is.
fn deactivate(tx: &mut dyn Tx, id: &str, now: DateTime<Utc>) -> Result<(), StoreError> {
    match transition(tx, id, Command::Deactivate, now) {
        Ok(_) | Err(StoreError::NotFound(_) | StoreError::WrongState { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

fn promote(tx: &mut dyn Tx, ids: &[String], now: DateTime<Utc>) -> Result<(), StoreError> {
    for id in ids {
        // Gone, or cancelled (or anything else) while it was being
        // published: the worker side skips it on the broker.
        match transition(tx, id, Command::Promote, now) {
            Ok(_) | Err(StoreError::NotFound(_) | StoreError::WrongState { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
