//! The workers the server has heard from, and what each is told: a
//! heartbeat registers its worker and answers its directive (`running`,
//! `quiet`: stop fetching and finish what you hold, `terminate`: stop
//! fetching, finish within your grace period and exit); an operator sets
//! one through `POST /ojs/v1/admin/workers/{id}/quiet` or `…/terminate`.
//! A worker told to be quiet or to terminate gets no more jobs from FETCH.
//! Records live in the job store, so every replica sharing it tells a
//! worker the same; each replica keeps the directives it must enforce on
//! FETCH in memory, read again from the store every second.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::store::{StoreError, Tx};
use crate::Api;

/// A worker silent this long is stale: its record may be removed (its
/// jobs come back through their visibility anyway).
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// What a worker is told in answer to its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Directive {
    /// Fetch and work.
    #[default]
    Running,
    /// Stop fetching; finish the active jobs.
    Quiet,
    /// Stop fetching; finish within the grace period, then exit. Final.
    Terminate,
}

impl Directive {
    /// The binding's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Directive::Running => "running",
            Directive::Quiet => "quiet",
            Directive::Terminate => "terminate",
        }
    }

    /// The directive a word names; any other word (a record written by
    /// hand) is `running`.
    fn named(word: &str) -> Directive {
        match word {
            "quiet" => Directive::Quiet,
            "terminate" => Directive::Terminate,
            _ => Directive::Running,
        }
    }
}

impl Serialize for Directive {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Directive {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match Value::deserialize(deserializer)? {
            Value::String(word) => Directive::named(&word),
            _ => Directive::Running,
        })
    }
}

/// A heartbeat, as far as the roster keeps it.
#[derive(Debug, Clone, Default)]
pub struct Beat {
    /// The worker.
    pub worker_id: String,
    /// How many jobs it says it holds.
    pub active_jobs: Option<u64>,
    /// What it says about itself ([`ABOUT`]), kept as sent.
    pub about: Map<String, Value>,
}

/// The fields of a heartbeat kept on the worker's record.
pub const ABOUT: [&str; 7] = [
    "hostname",
    "pid",
    "version",
    "queues",
    "concurrency",
    "labels",
    "state",
];

/// A worker as the roster keeps it (in the job store, as JSON). The
/// fields the admin UI reads without checking are always there, of their
/// type: a heartbeat over gRPC, or an operator's directive before any
/// heartbeat, names none of them, and one that sends them mistyped is
/// read as not having sent them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// The worker's id.
    pub id: String,
    /// The directive it is under.
    #[serde(default)]
    pub state: Directive,
    /// Its first heartbeat (or directive).
    #[serde(default, with = "millis_time")]
    pub first_seen_at: Option<DateTime<Utc>>,
    /// Its last heartbeat; none: never heard from.
    #[serde(default, with = "millis_time", skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    /// When an operator last directed it.
    #[serde(default, with = "millis_time", skip_serializing_if = "Option::is_none")]
    pub directed_at: Option<DateTime<Utc>>,
    /// The queues it says it works.
    #[serde(default, deserialize_with = "lenient")]
    pub queues: Vec<String>,
    /// How many jobs it says it runs at once.
    #[serde(default, deserialize_with = "lenient")]
    pub concurrency: u64,
    /// How many jobs it says it holds.
    #[serde(default, deserialize_with = "lenient")]
    pub active_jobs: u64,
    /// The rest of what it said about itself (`hostname`, `pid`,
    /// `version`, `labels`, and its own word for its state as
    /// `reported_state`), kept as sent.
    #[serde(flatten)]
    pub about: Map<String, Value>,
}

impl WorkerRecord {
    fn new(id: &str, now: DateTime<Utc>) -> Self {
        WorkerRecord {
            id: id.to_owned(),
            state: Directive::Running,
            first_seen_at: Some(now),
            last_heartbeat_at: None,
            directed_at: None,
            queues: Vec::new(),
            concurrency: 0,
            active_jobs: 0,
            about: Map::new(),
        }
    }

    /// Whether it has been silent past [`STALE_AFTER`] (or never beat).
    pub fn is_stale(&self, now: DateTime<Utc>) -> bool {
        self.last_heartbeat_at
            .is_none_or(|t| (now - t).to_std().is_ok_and(|age| age > STALE_AFTER))
    }

    /// The record as the admin API shows it at `now`.
    pub fn view(mut self, now: DateTime<Utc>) -> WorkerView {
        // What the admin UI's Workers page shows of every worker, there
        // (`null` where the worker did not say).
        for key in ["hostname", "version"] {
            self.about.entry(key).or_insert(Value::Null);
        }
        self.about
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(first) = self.first_seen_at {
            self.about
                .entry("started_at")
                .or_insert_with(|| Value::String(crate::job::timestamp(first)));
        }
        WorkerView {
            stale: self.is_stale(now),
            record: self,
        }
    }
}

/// A worker as the admin API shows it: its record and whether it is stale.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerView {
    /// The record.
    #[serde(flatten)]
    pub record: WorkerRecord,
    /// Silent past [`STALE_AFTER`].
    pub stale: bool,
}

/// How many workers are under each directive, and how many are stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct WorkerSummary {
    /// Every worker.
    pub total: usize,
    /// Running.
    pub running: usize,
    /// Told to be quiet.
    pub quiet: usize,
    /// Told to terminate.
    pub terminate: usize,
    /// Silent past [`STALE_AFTER`].
    pub stale: usize,
}

/// Where a page lies in a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Pagination {
    /// Items in the whole list.
    pub total: usize,
    /// This page, from 1.
    pub page: usize,
    /// Items per page.
    pub per_page: usize,
}

/// One page of the worker list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerPage {
    /// The page's workers, by id.
    pub items: Vec<WorkerView>,
    /// Over the whole list.
    pub summary: WorkerSummary,
    /// Where the page lies.
    pub pagination: Pagination,
}

/// A value of the wrong type reads as its default: what a worker sent is
/// kept as far as it is usable, never a reason to lose its record.
fn lenient<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: serde::de::DeserializeOwned + Default,
{
    Ok(serde_json::from_value(Value::deserialize(deserializer)?).unwrap_or_default())
}

/// Times on a record: RFC 3339, UTC, milliseconds (the binding's form).
mod millis_time {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&crate::job::timestamp(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        Ok(text
            .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
            .map(|t| t.with_timezone(&Utc)))
    }
}

/// The directives this replica enforces on FETCH (workers not running).
#[derive(Debug, Default)]
pub struct Directives {
    told: std::sync::Mutex<HashMap<String, Directive>>,
}

impl Directives {
    fn set(&self, worker_id: &str, directive: Directive) {
        let mut told = self.told.lock().unwrap_or_else(|e| e.into_inner());
        if directive == Directive::Running {
            told.remove(worker_id);
        } else {
            told.insert(worker_id.to_owned(), directive);
        }
    }

    /// What `worker_id` was told.
    pub fn of(&self, worker_id: &str) -> Directive {
        self.told
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(worker_id)
            .copied()
            .unwrap_or(Directive::Running)
    }

    fn replace(&self, all: HashMap<String, Directive>) {
        *self.told.lock().unwrap_or_else(|e| e.into_inner()) = all;
    }
}

/// The heartbeat's transition: the record is made or updated; the answer
/// is the worker's directive.
fn record_beat(tx: &mut dyn Tx, beat: &Beat, now: DateTime<Utc>) -> Result<Directive, StoreError> {
    let mut record = tx
        .worker(&beat.worker_id)?
        .unwrap_or_else(|| WorkerRecord::new(&beat.worker_id, now));
    let directive = record.state;
    record.last_heartbeat_at = Some(now);
    if let Some(n) = beat.active_jobs {
        record.active_jobs = n;
    }
    for (k, v) in &beat.about {
        match k.as_str() {
            "queues" => record.queues = serde_json::from_value(v.clone()).unwrap_or_default(),
            "concurrency" => record.concurrency = v.as_u64().unwrap_or_default(),
            // `state` on the record is the directive; the worker's own
            // word for its state is kept beside it.
            "state" => {
                record.about.insert("reported_state".into(), v.clone());
            }
            other => {
                record.about.insert(other.to_owned(), v.clone());
            }
        }
    }
    tx.save_worker(&beat.worker_id, now, &record)?;
    Ok(directive)
}

/// An operator's directive; `terminate` is final.
fn direct(
    tx: &mut dyn Tx,
    id: &str,
    directive: Directive,
    now: DateTime<Utc>,
) -> Result<Result<WorkerRecord, Directive>, StoreError> {
    let mut record = tx.worker(id)?.unwrap_or_else(|| WorkerRecord::new(id, now));
    let current = record.state;
    if current == Directive::Terminate && directive != Directive::Terminate {
        return Ok(Err(current));
    }
    record.state = directive;
    record.directed_at = Some(now);
    let seen = record.last_heartbeat_at.unwrap_or(now);
    tx.save_worker(id, seen, &record)?;
    Ok(Ok(record))
}

impl Api {
    /// A heartbeat's part in the roster: registers the worker, answers
    /// what it is told.
    pub async fn beat(&self, grant: &Grant<'_>, beat: Beat) -> Result<Directive, ApiError> {
        grant.allow(Operation::Work)?;
        let now = self.clock.now();
        let id = beat.worker_id.clone();
        let directive = self
            .store
            .run(move |tx| record_beat(tx, &beat, now))
            .await?;
        self.directives.set(&id, directive);
        Ok(directive)
    }

    /// What FETCH goes by for `worker_id`.
    pub(crate) fn told(&self, worker_id: &str) -> Directive {
        self.directives.of(worker_id)
    }

    /// Reads every directive again (other replicas may have set some).
    pub(crate) async fn refresh_directives(&self) {
        match self.store.run(|tx| tx.workers()).await {
            Ok(records) => self.directives.replace(
                records
                    .iter()
                    .filter(|r| r.state != Directive::Running)
                    .map(|r| (r.id.clone(), r.state))
                    .collect(),
            ),
            Err(e) => {
                tracing::debug!(error = %e, "reading the workers' directives failed; the last ones stay")
            }
        }
    }

    /// `GET /ojs/v1/admin/workers`: every worker, `page` by `per_page`.
    pub async fn workers_list(
        &self,
        grant: &Grant<'_>,
        page: usize,
        per_page: usize,
    ) -> Result<WorkerPage, ApiError> {
        // Workers belong to no queue: a token scoped to some queues must
        // not see who works the others.
        grant.allow_everywhere(Operation::Admin)?;
        let now = self.clock.now();
        let records = self.store.run(|tx| tx.workers()).await?;
        let all: Vec<WorkerView> = records.into_iter().map(|r| r.view(now)).collect();
        let count = |d: Directive| all.iter().filter(|w| w.record.state == d).count();
        let summary = WorkerSummary {
            total: all.len(),
            running: count(Directive::Running),
            quiet: count(Directive::Quiet),
            terminate: count(Directive::Terminate),
            stale: all.iter().filter(|w| w.stale).count(),
        };
        let total = all.len();
        let items = all
            .into_iter()
            .skip(page.saturating_sub(1) * per_page)
            .take(per_page)
            .collect();
        Ok(WorkerPage {
            items,
            summary,
            pagination: Pagination {
                total,
                page,
                per_page,
            },
        })
    }

    /// `GET /ojs/v1/admin/workers/{id}`.
    pub async fn worker_info(&self, grant: &Grant<'_>, id: &str) -> Result<WorkerView, ApiError> {
        // Workers belong to no queue: a token scoped to some queues must
        // not see who works the others.
        grant.allow_everywhere(Operation::Admin)?;
        let key = id.to_owned();
        let record = self.store.run(move |tx| tx.worker(&key)).await?;
        record
            .map(|r| r.view(self.clock.now()))
            .ok_or_else(|| ApiError::NotFound {
                resource_type: "worker",
                resource_id: id.to_owned(),
            })
    }

    /// `POST /ojs/v1/admin/workers/{id}/quiet` and `…/terminate`: told on
    /// its next heartbeat, and no job from FETCH from now on. A worker not
    /// heard from yet gets a record, so that it is told at its first.
    pub async fn direct(
        &self,
        grant: &Grant<'_>,
        id: &str,
        directive: Directive,
    ) -> Result<WorkerView, ApiError> {
        grant.allow_everywhere(Operation::Admin)?;
        let now = self.clock.now();
        let key = id.to_owned();
        let answer = self
            .store
            .run(move |tx| direct(tx, &key, directive, now))
            .await?;
        match answer {
            Ok(record) => {
                self.directives.set(id, directive);
                tracing::info!(worker_id = %id, directive = directive.as_str(), "a worker was directed");
                Ok(record.view(now))
            }
            Err(current) => Err(ApiError::WorkerConflict {
                worker_id: id.to_owned(),
                current_state: current.as_str(),
                asked: directive.as_str(),
            }),
        }
    }

    /// `DELETE /ojs/v1/admin/workers/{id}`: the record of a stale worker
    /// goes (its jobs come back through their visibility); a worker heard
    /// from within [`STALE_AFTER`] is a conflict.
    pub async fn deregister(&self, grant: &Grant<'_>, id: &str) -> Result<(), ApiError> {
        grant.allow_everywhere(Operation::Admin)?;
        let now = self.clock.now();
        let key = id.to_owned();
        let removed = self
            .store
            .run(move |tx| {
                let Some(record) = tx.worker(&key)? else {
                    return Ok(None);
                };
                if !record.is_stale(now) {
                    return Ok(Some(Err(record.state)));
                }
                tx.remove_worker(&key)?;
                Ok(Some(Ok(())))
            })
            .await?;
        match removed {
            None => Err(ApiError::NotFound {
                resource_type: "worker",
                resource_id: id.to_owned(),
            }),
            Some(Ok(())) => {
                self.directives.set(id, Directive::Running);
                Ok(())
            }
            Some(Err(current)) => Err(ApiError::WorkerConflict {
                worker_id: id.to_owned(),
                current_state: current.as_str(),
                asked: "deregister (only a worker silent for 30 s)",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::timestamp;
    use serde_json::json;

    fn record(value: Value) -> WorkerRecord {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_worker_silent_past_the_limit_is_stale() {
        let now = Utc::now();
        let at = |secs: i64| {
            record(json!({"id": "w", "state": "running",
                   "last_heartbeat_at": timestamp(now - chrono::Duration::seconds(secs))}))
        };
        assert!(!at(5).is_stale(now));
        assert!(at(31).is_stale(now));
        // Directed before it ever beat: stale until it does.
        assert!(WorkerRecord::new("w", now).is_stale(now));
    }

    #[test]
    fn what_the_admin_ui_reads_is_always_there() {
        let now = Utc::now();
        let bare =
            serde_json::to_value(record(json!({"id": "w", "state": "quiet"})).view(now)).unwrap();
        assert_eq!(bare["queues"], json!([]));
        assert_eq!(bare["concurrency"], 0);
        assert_eq!(bare["active_jobs"], 0);
        assert_eq!(bare["state"], "quiet");
        assert_eq!(bare["stale"], true);
        // Mistyped values a worker sent read as not sent; the rest is kept.
        let odd = record(json!({"id": "w", "queues": "a", "concurrency": "4",
                                "hostname": "h1", "labels": {"zone": "a"}}));
        assert_eq!(odd.queues, Vec::<String>::new());
        assert_eq!(odd.concurrency, 0);
        assert_eq!(odd.about.get("hostname"), Some(&json!("h1")));
        let told = serde_json::to_value(
            record(json!({"id": "w", "queues": ["a"], "concurrency": 4, "active_jobs": 2}))
                .view(now),
        )
        .unwrap();
        assert_eq!(told["queues"], json!(["a"]));
        assert_eq!(
            (told["concurrency"].clone(), told["active_jobs"].clone()),
            (json!(4), json!(2))
        );
    }

    #[test]
    fn a_record_reads_back_as_it_was_written_with_millisecond_times() {
        let now = DateTime::from_timestamp(1_800_000_000, 123_456_789).unwrap();
        let mut r = WorkerRecord::new("w", now);
        r.last_heartbeat_at = Some(now);
        r.state = Directive::Terminate;
        r.about.insert("pid".into(), json!(42));
        let text = serde_json::to_value(&r).unwrap();
        assert_eq!(text["first_seen_at"], "2027-01-15T08:00:00.123Z");
        assert_eq!(text["state"], "terminate");
        assert_eq!(text["pid"], 42);
        let back: WorkerRecord = serde_json::from_value(text).unwrap();
        assert_eq!(back.state, Directive::Terminate);
        assert_eq!(
            back.first_seen_at,
            DateTime::from_timestamp(1_800_000_000, 123_000_000)
        );
    }

    #[test]
    fn directives_read_back_from_records() {
        for d in [Directive::Running, Directive::Quiet, Directive::Terminate] {
            assert_eq!(record(json!({"id": "w", "state": d.as_str()})).state, d);
        }
        assert_eq!(record(json!({"id": "w"})).state, Directive::Running);
        assert_eq!(
            record(json!({"id": "w", "state": 7})).state,
            Directive::Running
        );
    }
}
