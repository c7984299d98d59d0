//! The admin API's reads and bulk operations over the job store: system
//! statistics, queues with their counts, the job list with its filters,
//! and bulk retry, cancel and delete. Workers and dead letters have their
//! own modules (`roster`, `dead`).
//!
//! Every call needs the `admin` operation. A token scoped to some queues
//! sees only those: its statistics and queue list count only them, and a
//! job list or bulk operation must name one queue of its scope (a filter
//! that could reach past the scope is refused, never narrowed silently).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::job::Job;
use crate::store::{JobCounts, JobQuery, StoreError, LIST_COUNT_LIMIT};
use crate::Api;

/// Every state a stored job can be in, as the admin counts list them.
pub const STATES: [&str; 8] = [
    "available",
    "active",
    "scheduled",
    "retryable",
    "completed",
    "discarded",
    "cancelled",
    "pending",
];

/// Most jobs one bulk operation touches; a filter matching more is done
/// in several calls.
pub const MAX_BULK: usize = 10_000;

/// Longest page of the admin job list.
pub const MAX_PAGE: usize = 100;

/// A queue as the admin API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdminQueue {
    /// Its name.
    pub name: String,
    /// Whether it is paused.
    pub paused: bool,
    /// When its first job came.
    pub created_at: DateTime<Utc>,
    /// Stored jobs by state (every state of [`STATES`]).
    pub counts: BTreeMap<&'static str, u64>,
    /// Completed in the last minute.
    pub processed_per_minute: u64,
    /// Discarded in the last minute.
    pub failed_per_minute: u64,
}

/// The whole server as the admin dashboard shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemStats {
    /// Queues known.
    pub queues: usize,
    /// Workers heard from (not stale).
    pub workers: usize,
    /// Stored jobs by state.
    pub jobs: BTreeMap<&'static str, u64>,
    /// Completed in the last minute.
    pub processed_per_minute: u64,
    /// Discarded in the last minute.
    pub failed_per_minute: u64,
    /// Since this process started.
    pub uptime_seconds: u64,
}

/// A page of the admin job list.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPage {
    /// The jobs.
    pub items: Vec<Job>,
    /// How many match, up to [`LIST_COUNT_LIMIT`].
    pub total: u64,
    /// More than [`LIST_COUNT_LIMIT`] match (not counted further).
    pub total_capped: bool,
    /// The page, from 1.
    pub page: usize,
    /// Its size.
    pub per_page: usize,
}

/// What a bulk operation does to each job it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkAction {
    /// A dead letter back to its queue.
    Retry,
    /// A job that has not finished, cancelled.
    Cancel,
    /// A finished job removed from the store.
    Delete,
}

impl BulkAction {
    /// The binding's name.
    pub fn as_str(self) -> &'static str {
        match self {
            BulkAction::Retry => "retry",
            BulkAction::Cancel => "cancel",
            BulkAction::Delete => "delete",
        }
    }
}

/// What a bulk operation did.
#[derive(Debug, Clone, PartialEq)]
pub struct BulkOutcome {
    /// The action.
    pub action: BulkAction,
    /// Jobs the filter matched (at most [`MAX_BULK`]).
    pub matched: usize,
    /// Done.
    pub succeeded: usize,
    /// Not done, with why.
    pub errors: Vec<(String, String)>,
}

/// Most points one history answers.
pub const MAX_HISTORY_POINTS: i64 = 1_440;

/// One bucket of the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryPoint {
    /// Its start.
    pub at: DateTime<Utc>,
    /// Jobs completed in it.
    pub processed: u64,
    /// Jobs discarded in it.
    pub failed: u64,
    /// Jobs created in it.
    pub enqueued: u64,
}

impl Api {
    /// `GET /ojs/v1/admin/stats/history`: per `period` from `since` to
    /// `until` (of `queue`, or of every queue: a scoped token names one of
    /// its own), what was
    /// created, completed and discarded; every bucket is there, empty ones
    /// with zeros. Read from the stored jobs: nothing older than `[api]
    /// retention`.
    pub async fn admin_history(
        &self,
        grant: &Grant<'_>,
        period: std::time::Duration,
        since: Option<DateTime<Utc>>,
        until: Option<DateTime<Utc>>,
        queue: Option<String>,
    ) -> Result<Vec<HistoryPoint>, ApiError> {
        match &queue {
            Some(q) => grant.allow_on(Operation::Admin, q)?,
            None => grant.allow_everywhere(Operation::Admin)?,
        }
        let bucket = i64::try_from(period.as_millis())
            .unwrap_or(i64::MAX)
            .max(1000);
        let until = until.unwrap_or_else(|| self.now());
        let since = since.unwrap_or(until - chrono::Duration::hours(1));
        if since >= until {
            return Err(ApiError::invalid("since", "must be before `until`"));
        }
        let first = crate::store::ms(since) / bucket * bucket;
        let points = (crate::store::ms(until) - first + bucket - 1) / bucket;
        if points > MAX_HISTORY_POINTS {
            return Err(ApiError::invalid(
                "period",
                format!("{points} points from `since` to `until`; at most {MAX_HISTORY_POINTS} (a longer period, or a shorter span)"),
            ));
        }
        let from = DateTime::from_timestamp_millis(first).unwrap_or(since);
        let rows = self
            .store
            .run(move |tx| tx.history(from, until, bucket, queue.as_deref()))
            .await?;
        let mut out: Vec<HistoryPoint> = (0..points)
            .map(|i| HistoryPoint {
                at: DateTime::from_timestamp_millis(first + i * bucket).unwrap_or(since),
                processed: 0,
                failed: 0,
                enqueued: 0,
            })
            .collect();
        for (at, kind, n) in rows {
            let Some(point) = usize::try_from((at - first) / bucket)
                .ok()
                .and_then(|i| out.get_mut(i))
            else {
                continue;
            };
            match kind.as_str() {
                "created" => point.enqueued += n,
                "completed" => point.processed += n,
                "discarded" => point.failed += n,
                _ => {}
            }
        }
        Ok(out)
    }

    /// `GET /ojs/v1/admin/stats`.
    pub async fn admin_stats(&self, grant: &Grant<'_>) -> Result<SystemStats, ApiError> {
        grant.allow(Operation::Admin)?;
        let queues = self.admin_queues(grant).await?;
        let mut jobs: BTreeMap<&'static str, u64> = STATES.iter().map(|s| (*s, 0)).collect();
        for q in &queues {
            for (state, n) in &q.counts {
                *jobs.entry(state).or_default() += n;
            }
        }
        let summary = self.workers_list(grant, 1, 1).await?.summary;
        let workers = summary.total.saturating_sub(summary.stale);
        Ok(SystemStats {
            queues: queues.len(),
            workers,
            jobs,
            processed_per_minute: queues.iter().map(|q| q.processed_per_minute).sum(),
            failed_per_minute: queues.iter().map(|q| q.failed_per_minute).sum(),
            uptime_seconds: self.started.elapsed().as_secs(),
        })
    }

    /// `GET /ojs/v1/admin/queues`: every queue the token sees, by name,
    /// with its stored jobs by state and its last minute's throughput.
    pub async fn admin_queues(&self, grant: &Grant<'_>) -> Result<Vec<AdminQueue>, ApiError> {
        grant.allow(Operation::Admin)?;
        let since = self.now() - chrono::Duration::minutes(1);
        let counts: JobCounts = self.store.run(move |tx| tx.job_counts(since)).await?;
        let known = self.queues(grant).await?;
        let mut out: BTreeMap<String, AdminQueue> = known
            .into_iter()
            .map(|q| {
                (
                    q.name.clone(),
                    AdminQueue {
                        name: q.name,
                        paused: q.paused,
                        created_at: q.created_at,
                        counts: STATES.iter().map(|s| (*s, 0)).collect(),
                        processed_per_minute: 0,
                        failed_per_minute: 0,
                    },
                )
            })
            .collect();
        for (queue, state, n) in counts.by_queue {
            if let Some(q) = out.get_mut(&queue) {
                if let Some(s) = STATES.iter().find(|s| **s == state) {
                    q.counts.insert(s, n);
                }
            }
        }
        for (queue, state, n) in counts.finished {
            if let Some(q) = out.get_mut(&queue) {
                match state.as_str() {
                    "completed" => q.processed_per_minute += n,
                    "discarded" => q.failed_per_minute += n,
                    _ => {}
                }
            }
        }
        Ok(out.into_values().collect())
    }

    /// `GET /ojs/v1/admin/queues/{name}`.
    pub async fn admin_queue(&self, grant: &Grant<'_>, name: &str) -> Result<AdminQueue, ApiError> {
        grant.allow_on(Operation::Admin, name)?;
        self.admin_queues(grant)
            .await?
            .into_iter()
            .find(|q| q.name == name)
            .ok_or_else(|| ApiError::NotFound {
                resource_type: "queue",
                resource_id: name.to_owned(),
            })
    }

    /// `GET /ojs/v1/admin/jobs`: the jobs `query` matches, a page of them.
    pub async fn admin_jobs(
        &self,
        grant: &Grant<'_>,
        query: JobQuery,
        page: usize,
        per_page: usize,
    ) -> Result<JobPage, ApiError> {
        self.allow_query(grant, &query)?;
        let page = page.max(1);
        let per_page = per_page.clamp(1, MAX_PAGE);
        let offset = (page - 1).saturating_mul(per_page);
        if (offset as u64) >= LIST_COUNT_LIMIT {
            return Err(ApiError::invalid(
                "page",
                format!("pages reach the first {LIST_COUNT_LIMIT} jobs a filter matches: narrow the filter (queue, state, type, since, until) or turn the order"),
            ));
        }
        let (items, total) = self
            .store
            .run(move |tx| tx.list_jobs(&query, per_page, offset))
            .await?;
        Ok(JobPage {
            items,
            total: total.min(LIST_COUNT_LIMIT),
            total_capped: total > LIST_COUNT_LIMIT,
            page,
            per_page,
        })
    }

    /// A bulk operation on what `query` matches (at most [`MAX_BULK`]
    /// jobs); refused unless `confirm` (nothing touched).
    pub async fn bulk(
        &self,
        grant: &Grant<'_>,
        action: BulkAction,
        query: JobQuery,
        confirm: bool,
    ) -> Result<BulkOutcome, ApiError> {
        self.allow_query(grant, &query)?;
        if !confirm {
            return Err(ApiError::invalid(
                "confirm",
                format!(
                    "a bulk {} changes every job its filter matches: send `\"confirm\": true`",
                    action.as_str()
                ),
            ));
        }
        let (jobs, _) = self
            .store
            .run(move |tx| tx.list_jobs(&query, MAX_BULK, 0))
            .await?;
        let mut outcome = BulkOutcome {
            action,
            matched: jobs.len(),
            succeeded: 0,
            errors: Vec::new(),
        };
        for job in jobs {
            let id = job.envelope.id.clone();
            let done = match action {
                BulkAction::Retry => self.retry_dead_letter(grant, &id).await.map(|_| ()),
                BulkAction::Cancel => self.cancel(grant, &id).await.map(|_| ()),
                BulkAction::Delete => self.delete_finished(grant, &job).await,
            };
            match done {
                Ok(()) => outcome.succeeded += 1,
                Err(e) => outcome.errors.push((id, e.to_string())),
            }
        }
        tracing::info!(
            action = action.as_str(),
            matched = outcome.matched,
            succeeded = outcome.succeeded,
            token = grant.token_name().unwrap_or(""),
            "bulk operation"
        );
        Ok(outcome)
    }

    /// Removes a finished job from the store (its broker copy is gone or
    /// settled already).
    async fn delete_finished(&self, grant: &Grant<'_>, job: &Job) -> Result<(), ApiError> {
        grant.allow_job(Operation::Admin, &job.envelope.queue, &job.envelope.id)?;
        let id = job.envelope.id.clone();
        self.store
            .run(move |tx| {
                let now = tx.load(&id)?;
                if !crate::model::is_final(now.state()) || now.is_dead_letter() {
                    return Err(crate::store::wrong_state(&id, crate::model::Refused(now.state())));
                }
                tx.delete(&id)
            })
            .await
            .map_err(|e| match e {
                StoreError::WrongState { id, current } => ApiError::Conflict {
                    job_id: id,
                    current_state: current.as_str().unwrap_or("unknown").to_owned(),
                    operation: "delete",
                    expected: "completed, cancelled or discarded (dead letters: DELETE /ojs/v1/dead-letter/{id})",
                },
                other => crate::error::store_error(other, "delete", "finished"),
            })
    }

    /// A scoped token's listing or bulk operation must name one queue of
    /// its scope; an open token may filter as it likes.
    fn allow_query(&self, grant: &Grant<'_>, query: &JobQuery) -> Result<(), ApiError> {
        grant.allow(Operation::Admin)?;
        if grant.scope().is_empty() {
            return Ok(());
        }
        match query.queue.as_deref() {
            Some(q) if !q.ends_with('*') => grant.allow_on(Operation::Admin, q),
            // A token scoped to some queues names one of them (`queue`)
            // in a job list or bulk operation.
            _ => Err(ApiError::PermissionDenied {
                operation: Operation::Admin.as_str(),
                scope: "every queue (name one queue of the token's)".into(),
            }),
        }
    }
}
