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
use serde_json::{json, Map, Value};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::job::timestamp;
use crate::store::{StoreError, Tx};
use crate::Api;

/// A worker silent this long is stale: its record may be removed (its
/// jobs come back through their visibility anyway).
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// What a worker is told in answer to its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Directive {
    /// Fetch and work.
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

    fn of(record: &Value) -> Directive {
        match record["state"].as_str() {
            Some("quiet") => Directive::Quiet,
            Some("terminate") => Directive::Terminate,
            _ => Directive::Running,
        }
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

fn new_record(id: &str, now: DateTime<Utc>) -> Value {
    json!({"id": id, "state": "running", "first_seen_at": timestamp(now)})
}

/// The heartbeat's transition: the record is made or updated; the answer
/// is the worker's directive.
fn record_beat(tx: &mut dyn Tx, beat: &Beat, now: DateTime<Utc>) -> Result<Directive, StoreError> {
    let existing = tx.worker(&beat.worker_id)?;
    let directive = existing.as_ref().map_or(Directive::Running, Directive::of);
    let mut record = existing.unwrap_or_else(|| new_record(&beat.worker_id, now));
    record["last_heartbeat_at"] = json!(timestamp(now));
    if let Some(n) = beat.active_jobs {
        record["active_jobs"] = json!(n);
    }
    for (k, v) in &beat.about {
        // `state` on the record is the directive; the worker's own word
        // for its state is kept beside it.
        let key = if k == "state" {
            "reported_state"
        } else {
            k.as_str()
        };
        record[key] = v.clone();
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
) -> Result<Result<Value, Directive>, StoreError> {
    let mut record = tx.worker(id)?.unwrap_or_else(|| new_record(id, now));
    let current = Directive::of(&record);
    if current == Directive::Terminate && directive != Directive::Terminate {
        return Ok(Err(current));
    }
    record["state"] = json!(directive.as_str());
    record["directed_at"] = json!(timestamp(now));
    let seen = record["last_heartbeat_at"]
        .as_str()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map_or(now, |t| t.with_timezone(&Utc));
    tx.save_worker(id, seen, &record)?;
    Ok(Ok(record))
}

/// The record as the admin API shows it: with `stale`.
fn shown(mut record: Value, now: DateTime<Utc>) -> Value {
    let stale = record["last_heartbeat_at"]
        .as_str()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .is_none_or(|t| {
            (now - t.with_timezone(&Utc))
                .to_std()
                .is_ok_and(|age| age > STALE_AFTER)
        });
    record["stale"] = json!(stale);
    // What the admin UI reads without checking: always there, of its type
    // (a heartbeat over gRPC, or an operator's directive before any
    // heartbeat, names none of them).
    if !record["queues"].is_array() {
        record["queues"] = json!([]);
    }
    for key in ["concurrency", "active_jobs"] {
        if !record[key].is_number() {
            record[key] = json!(0);
        }
    }
    record
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
                    .filter_map(|r| {
                        let d = Directive::of(r);
                        let id = r["id"].as_str()?;
                        (d != Directive::Running).then(|| (id.to_owned(), d))
                    })
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
    ) -> Result<Value, ApiError> {
        // Workers belong to no queue: a token scoped to some queues must
        // not see who works the others.
        grant.allow_everywhere(Operation::Admin)?;
        let now = self.clock.now();
        let records = self.store.run(|tx| tx.workers()).await?;
        let all: Vec<Value> = records.into_iter().map(|r| shown(r, now)).collect();
        let count = |state: &str| all.iter().filter(|r| r["state"] == state).count();
        let stale = all.iter().filter(|r| r["stale"] == true).count();
        let summary = json!({
            "total": all.len(),
            "running": count("running"),
            "quiet": count("quiet"),
            "terminate": count("terminate"),
            "stale": stale,
        });
        let total = all.len();
        let items: Vec<Value> = all
            .into_iter()
            .skip(page.saturating_sub(1) * per_page)
            .take(per_page)
            .collect();
        Ok(json!({
            "items": items,
            "summary": summary,
            "pagination": {"total": total, "page": page, "per_page": per_page},
        }))
    }

    /// `GET /ojs/v1/admin/workers/{id}`.
    pub async fn worker_info(&self, grant: &Grant<'_>, id: &str) -> Result<Value, ApiError> {
        // Workers belong to no queue: a token scoped to some queues must
        // not see who works the others.
        grant.allow_everywhere(Operation::Admin)?;
        let key = id.to_owned();
        let record = self.store.run(move |tx| tx.worker(&key)).await?;
        record
            .map(|r| shown(r, self.clock.now()))
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
    ) -> Result<Value, ApiError> {
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
                Ok(shown(record, now))
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
                let record = shown(record, now);
                if record["stale"] != true {
                    return Ok(Some(Err(Directive::of(&record))));
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

    #[test]
    fn a_worker_silent_past_the_limit_is_stale() {
        let now = Utc::now();
        let at = |secs: i64| {
            json!({"id": "w", "state": "running",
                   "last_heartbeat_at": timestamp(now - chrono::Duration::seconds(secs))})
        };
        assert_eq!(shown(at(5), now)["stale"], false);
        assert_eq!(shown(at(31), now)["stale"], true);
        // Directed before it ever beat: stale until it does.
        assert_eq!(shown(new_record("w", now), now)["stale"], true);
    }

    #[test]
    fn what_the_admin_ui_reads_is_always_there() {
        let now = Utc::now();
        let bare = shown(json!({"id": "w", "state": "quiet"}), now);
        assert_eq!(bare["queues"], json!([]));
        assert_eq!(bare["concurrency"], 0);
        assert_eq!(bare["active_jobs"], 0);
        let told = shown(
            json!({"id": "w", "queues": ["a"], "concurrency": 4, "active_jobs": 2}),
            now,
        );
        assert_eq!(told["queues"], json!(["a"]));
        assert_eq!(
            (told["concurrency"].clone(), told["active_jobs"].clone()),
            (json!(4), json!(2))
        );
    }

    #[test]
    fn directives_read_back_from_records() {
        for d in [Directive::Running, Directive::Quiet, Directive::Terminate] {
            assert_eq!(Directive::of(&json!({"state": d.as_str()})), d);
        }
        assert_eq!(Directive::of(&json!({})), Directive::Running);
    }
}
