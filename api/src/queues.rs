//! Queue operations: pause, resume and statistics.
//!
//! A paused queue's jobs stay on the broker: PUSH still lands (201,
//! `available`), FETCH hands out none of it, jobs already active may still
//! be acknowledged or failed. Paused queues are kept in the job store; the
//! process alone on its store keeps the set in memory as it changes it,
//! replicas read it from the store at each FETCH, so that a pause through
//! one replica holds at once for a FETCH through another.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::model::EventData;
use crate::Api;

/// A queue after a pause or a resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// The queue.
    pub name: String,
    /// Whether it is paused now.
    pub paused: bool,
    /// When this request paused or resumed it.
    pub at: DateTime<Utc>,
}

/// A queue's statistics, from the jobs the store holds of it (those
/// pushed through this server, and those another producer put on the
/// broker that a FETCH has seen).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    /// The queue.
    pub name: String,
    /// Whether it is paused.
    pub paused: bool,
    /// Stored jobs by state (every state, 0 where none).
    pub by_state: BTreeMap<&'static str, u64>,
    /// Dead letters among the discarded.
    pub dead: u64,
    /// Completed in the last hour.
    pub completed_last_hour: u64,
    /// Discarded in the last hour.
    pub failed_last_hour: u64,
    /// Mean run time (start to completion) of up to the last
    /// [`SAMPLE`] jobs completed in the last hour; none without any.
    pub avg_duration_ms: Option<f64>,
    /// Mean wait (enqueued to start) of the same jobs.
    pub avg_wait_ms: Option<f64>,
    /// Jobs completed per second over the last hour.
    pub throughput_per_second: f64,
    /// What the broker itself says waits in the queue (not in flight),
    /// where it can tell
    /// (RabbitMQ's message count, SQS's approximate count, Kafka's
    /// consumer lag, the embedded broker's rows); none where it cannot or
    /// did not answer within [`DEPTH_WAIT`].
    pub broker_depth: Option<u64>,
    /// When these were read.
    pub computed_at: DateTime<Utc>,
}

/// Longest a statistics request waits for the broker's own count.
pub const DEPTH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Completed jobs the means are taken over, at most.
pub const SAMPLE: usize = 1_000;

/// Every state a stored job can be in.
const STATES: [&str; 8] = [
    "scheduled",
    "available",
    "pending",
    "active",
    "completed",
    "retryable",
    "cancelled",
    "discarded",
];

impl Api {
    /// What an operator's change of a queue needs: `admin` on it, a queue
    /// this server serves, a valid name (a queue never seen is made known
    /// by the change).
    pub(crate) fn admin_on_queue(&self, grant: &Grant<'_>, queue: &str) -> Result<(), ApiError> {
        grant.allow_on(Operation::Admin, queue)?;
        if !self.serves_queue(queue) {
            return Err(ApiError::QueueNotServed {
                queue: queue.to_owned(),
            });
        }
        ojs_core::envelope::validate_queue_name(queue)
            .map_err(|e| ApiError::invalid("queue", e.to_string()))
    }

    /// Pauses `queue` (admin): FETCH hands out none of its jobs until it is
    /// resumed. A queue never seen before is made known.
    pub async fn pause_queue(
        &self,
        grant: &Grant<'_>,
        queue: &str,
    ) -> Result<QueueState, ApiError> {
        self.set_paused(grant, queue, true).await
    }

    /// Resumes `queue` (admin).
    pub async fn resume_queue(
        &self,
        grant: &Grant<'_>,
        queue: &str,
    ) -> Result<QueueState, ApiError> {
        self.set_paused(grant, queue, false).await
    }

    async fn set_paused(
        &self,
        grant: &Grant<'_>,
        queue: &str,
        paused: bool,
    ) -> Result<QueueState, ApiError> {
        self.admin_on_queue(grant, queue)?;
        let now = self.now();
        let name = queue.to_owned();
        let by = grant.token_name().unwrap_or("api").to_owned();
        let changed = self
            .store
            .run(move |tx| {
                let changed = tx.set_paused(&name, paused, now)?;
                if changed {
                    let (kind, field) = if paused {
                        ("queue.paused", "paused_by")
                    } else {
                        ("queue.resumed", "resumed_by")
                    };
                    let subject = crate::store::Subject {
                        job_id: "",
                        queue: &name,
                        job_type: "",
                    };
                    let data = EventData::empty().field(field, &by).field("queue", &name);
                    tx.fact(kind, &subject, now, &data)?;
                }
                Ok(changed)
            })
            .await?;
        {
            let mut set = self.paused.lock().unwrap_or_else(|e| e.into_inner());
            if paused {
                set.insert(queue.to_owned());
            } else {
                set.remove(queue);
            }
        }
        if changed {
            tracing::info!(%queue, paused, token = grant.token_name().unwrap_or(""), "queue paused: {paused}");
        }
        Ok(QueueState {
            name: queue.to_owned(),
            paused,
            at: now,
        })
    }

    /// Of `queues`, those not paused now: among replicas the paused set is
    /// read from the store (a pause through another replica counts at
    /// once); alone, the set kept here is looked up, not copied (this is
    /// every FETCH).
    pub(crate) async fn unpaused<'q>(&self, queues: &'q [String]) -> Vec<&'q String> {
        if self.replication.id().is_some() {
            self.refresh_paused().await;
        }
        let paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        queues.iter().filter(|q| !paused.contains(*q)).collect()
    }

    /// Whether `queue` is paused now (read as [`Api::unpaused`] reads).
    pub(crate) async fn is_paused(&self, queue: &str) -> bool {
        if self.replication.id().is_some() {
            self.refresh_paused().await;
        }
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue)
    }

    /// Replaces the set kept here with the store's (replicas), and the
    /// queues' configured limits with it; on a failure the last read
    /// stand.
    pub(crate) async fn refresh_paused(&self) {
        match self
            .store
            .run(|tx| Ok((tx.paused_queues()?, tx.queue_configs()?)))
            .await
        {
            Ok((list, configs)) => {
                *self.paused.lock().unwrap_or_else(|e| e.into_inner()) =
                    list.into_iter().map(|(name, _)| name).collect();
                self.keep_queue_configs(configs);
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading the paused queues failed; the last set read is used");
            }
        }
    }

    /// `GET /ojs/v1/queues/{name}/stats`.
    pub async fn queue_stats(
        &self,
        grant: &Grant<'_>,
        queue: &str,
    ) -> Result<QueueStats, ApiError> {
        grant.allow_on(Operation::Read, queue)?;
        if !self.serves_queue(queue) {
            return Err(ApiError::QueueNotServed {
                queue: queue.to_owned(),
            });
        }
        let now = self.now();
        let since = now - chrono::Duration::hours(1);
        let name = queue.to_owned();
        let jobs = self
            .store
            .run(move |tx| tx.queue_jobs(&name, since, SAMPLE))
            .await?;
        let mut by_state: BTreeMap<&'static str, u64> = STATES.iter().map(|s| (*s, 0)).collect();
        for (state, n) in &jobs.by_state {
            if let Some(slot) = STATES.iter().find(|s| **s == state.as_str()) {
                by_state.insert(slot, *n);
            }
        }
        let finished = |state: &str| {
            jobs.finished_by_state
                .iter()
                .find(|(s, _)| s == state)
                .map_or(0, |(_, n)| *n)
        };
        let completed_last_hour = finished("completed");
        let mean = |values: Vec<f64>| {
            (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
        };
        let span = |from: Option<DateTime<Utc>>, to: Option<DateTime<Utc>>| {
            from.zip(to)
                .map(|(a, b)| (b - a).num_milliseconds().max(0) as f64)
        };
        let durations = jobs
            .completed
            .iter()
            .filter_map(|j| span(j.envelope.started_at, j.envelope.completed_at))
            .collect();
        let waits = jobs
            .completed
            .iter()
            .filter_map(|j| span(j.envelope.enqueued_at, j.envelope.started_at))
            .collect();
        let broker_depth = match tokio::time::timeout(DEPTH_WAIT, self.adapter.depth(queue)).await {
            Ok(Ok(depth)) => depth,
            Ok(Err(e)) => {
                tracing::debug!(%queue, error = %e, "the broker did not tell the queue's depth");
                None
            }
            Err(_) => {
                tracing::debug!(%queue, "the broker did not tell the queue's depth in time");
                None
            }
        };
        Ok(QueueStats {
            broker_depth,
            name: queue.to_owned(),
            paused: self.is_paused(queue).await,
            by_state,
            dead: jobs.dead,
            completed_last_hour,
            failed_last_hour: finished("discarded"),
            avg_duration_ms: mean(durations),
            avg_wait_ms: mean(waits),
            throughput_per_second: completed_last_hour as f64 / 3600.0,
            computed_at: now,
        })
    }
}

/// Jobs a listing of unique keys or priorities looks at, at most.
pub const LISTING_SCAN: u64 = 10_000;

/// A job holding its unique key now.
#[derive(Debug, Clone)]
pub struct UniqueHold {
    /// The key.
    pub key: String,
    /// The job holding it.
    pub job: crate::Job,
    /// Until when it holds it (its policy's period from its creation);
    /// none: while it is in one of the policy's states.
    pub until: Option<DateTime<Utc>>,
}

impl Api {
    /// `GET /ojs/v1/unique-jobs` (the admin UI's Unique Jobs page): the
    /// jobs holding their unique keys now, by key, of the token's queues,
    /// among the first [`LISTING_SCAN`] filed; a page and how many.
    pub async fn unique_jobs(
        &self,
        grant: &Grant<'_>,
        page: usize,
        per_page: usize,
    ) -> Result<(Vec<UniqueHold>, usize), ApiError> {
        grant.allow(Operation::Read)?;
        let now = self.now();
        let filed = self.store.run(|tx| tx.unique_holders(LISTING_SCAN)).await?;
        let holding: Vec<UniqueHold> = filed
            .into_iter()
            .filter(|(_, job)| grant.sees(&job.envelope.queue))
            .filter_map(|(key, job)| {
                let policy = crate::model::unique::Uniqueness::of(&job.envelope).ok()??;
                policy.is_taken_by(&job, now).then(|| UniqueHold {
                    until: policy
                        .period
                        .and_then(|p| chrono::Duration::from_std(p).ok())
                        .zip(job.envelope.created_at)
                        .and_then(|(p, created)| created.checked_add_signed(p)),
                    key,
                    job,
                })
            })
            .collect();
        let total = holding.len();
        let page = holding
            .into_iter()
            .skip(page.saturating_sub(1).saturating_mul(per_page))
            .take(per_page)
            .collect();
        Ok((page, total))
    }

    /// `GET /ojs/v1/queues/{name}/priority-stats`: the queue's jobs that
    /// wait to run (available, scheduled, retryable, pending), by priority,
    /// among the first [`LISTING_SCAN`] of them.
    pub async fn priority_stats(
        &self,
        grant: &Grant<'_>,
        queue: &str,
    ) -> Result<Vec<(i64, u64)>, ApiError> {
        grant.allow_on(Operation::Read, queue)?;
        if !self.serves_queue(queue) {
            return Err(ApiError::QueueNotServed {
                queue: queue.to_owned(),
            });
        }
        let name = queue.to_owned();
        Ok(self
            .store
            .run(move |tx| tx.priority_counts(&name, LISTING_SCAN))
            .await?)
    }
}
