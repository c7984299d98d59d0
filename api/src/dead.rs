//! Dead letters through the API: the jobs a NACK discarded into their
//! queue's dead-letter path (`on_exhaustion` other than `discard`), listed
//! from the store, retried (back to `available`, attempt 0, the same id,
//! published to the queue again) and deleted.
//!
//! The broker's dead-letter copy stays where the adapter wrote it, for the
//! broker's own tooling and `ojs-bridge dead-letters`; a copy moved back to
//! the queue later finds the job's state in the store and is settled, not
//! run again, once the job finished.

use std::collections::BTreeMap;

use ojs_core::glob::Glob;
use ojs_core::JobState;
use serde_json::{json, Value};

use crate::auth::{Grant, Operation};
use crate::error::{store_error, ApiError};
use crate::job::{timestamp, Job};
use crate::store::StoreError;
use crate::Api;

/// Which dead letters to list.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterQuery {
    /// Only this queue.
    pub queue: Option<String>,
    /// Only job types matching this pattern (`*` any run of characters).
    pub job_type: Option<Glob>,
    /// At most this many.
    pub limit: usize,
    /// After skipping this many.
    pub offset: usize,
}

/// The extra field a retried dead letter carries until the broker took it:
/// a start finds it and publishes it again.
pub(crate) const PUBLISHING: &str = "publishing";

impl Api {
    async fn visible_dead_letters(
        &self,
        grant: &Grant<'_>,
        queue: Option<&str>,
        job_type: Option<&Glob>,
    ) -> Result<Vec<Job>, ApiError> {
        grant.allow(Operation::Read)?;
        Ok(self
            .store
            .dead_letters()
            .await?
            .into_iter()
            .filter(|j| {
                grant.sees(&j.envelope.queue)
                    && queue.is_none_or(|q| j.envelope.queue == q)
                    && job_type.is_none_or(|g| g.matches(&j.envelope.job_type))
            })
            .collect())
    }

    /// A page of dead letters, newest first (what an operator looks for),
    /// and how many match in all.
    pub async fn dead_letters(
        &self,
        grant: &Grant<'_>,
        query: &DeadLetterQuery,
    ) -> Result<(Vec<Job>, usize), ApiError> {
        let all = self
            .visible_dead_letters(grant, query.queue.as_deref(), query.job_type.as_ref())
            .await?;
        let total = all.len();
        Ok((
            all.into_iter()
                .rev()
                .skip(query.offset)
                .take(query.limit)
                .collect(),
            total,
        ))
    }

    /// One dead letter.
    pub async fn dead_letter(&self, grant: &Grant<'_>, id: &str) -> Result<Job, ApiError> {
        grant.allow(Operation::Read)?;
        match self.store.get(id.to_owned()).await? {
            Some(job) if job.is_dead_letter() && grant.sees(&job.envelope.queue) => Ok(job),
            _ => Err(not_found(id)),
        }
    }

    /// Counts by queue and error type, the oldest and newest.
    pub async fn dead_letter_stats(&self, grant: &Grant<'_>) -> Result<Value, ApiError> {
        let all = self.visible_dead_letters(grant, None, None).await?;
        let mut by_queue: BTreeMap<&str, u64> = BTreeMap::new();
        let mut by_error_type: BTreeMap<&str, u64> = BTreeMap::new();
        for job in &all {
            *by_queue.entry(&job.envelope.queue).or_default() += 1;
            let kind = job
                .envelope
                .error
                .as_ref()
                .map_or("unknown", |e| e.error_type.as_str());
            *by_error_type.entry(kind).or_default() += 1;
        }
        let at = |j: &Job| j.extra.get("discarded_at").cloned();
        Ok(json!({
            "total": all.len(),
            "by_queue": by_queue,
            "by_error_type": by_error_type,
            "oldest_at": all.first().and_then(at),
            "newest_at": all.last().and_then(at),
            "retention": {"max_age": humantime(self.settings.retention)},
        }))
    }

    /// Back to its queue: `available`, attempt 0, the same id, its error
    /// history kept. One of two concurrent retries wins; the other finds
    /// no dead letter (404).
    pub async fn retry_dead_letter(&self, grant: &Grant<'_>, id: &str) -> Result<Job, ApiError> {
        let queue = self.dead_letter(grant, id).await?.envelope.queue;
        grant.allow_job(Operation::Admin, &queue, id)?;
        let now = ojs_core::envelope::now_millis();
        let job_id = id.to_owned();
        let (before, job) = self
            .store
            .run(move |tx| {
                let before = tx.load(&job_id)?;
                if !before.is_dead_letter() {
                    return Err(StoreError::NotFound(job_id));
                }
                let mut job = before.clone();
                let e = &mut job.envelope;
                e.state = Some(JobState::Available);
                e.attempt = 0;
                e.enqueued_at = Some(now);
                e.started_at = None;
                e.completed_at = None;
                for k in [
                    "dead_letter",
                    "discarded_at",
                    "next_attempt_at",
                    "retry_delay_ms",
                    "worker_id",
                ] {
                    job.extra.remove(k);
                }
                job.extra
                    .insert("re_enqueued_at".into(), json!(timestamp(now)));
                job.extra.insert(PUBLISHING.into(), json!(true));
                tx.save(&job, None)?;
                tx.event(
                    "job.enqueued",
                    &job.envelope,
                    now,
                    json!({"job_type": job.envelope.job_type, "queue": job.envelope.queue,
                           "state": "available", "from": "dead_letter"}),
                )?;
                Ok((before, job))
            })
            .await
            .map_err(|e| match e {
                StoreError::NotFound(id) => not_found(&id),
                e => store_error(e, "retry", "discarded"),
            })?;
        let message = self
            .message(&job)
            .map_err(|e| ApiError::Broker { source: e.into() })?;
        match self
            .publish(&queue, vec![id.to_owned()], vec![message])
            .await
        {
            Ok(()) => {
                let job_id = id.to_owned();
                let settled = self
                    .store
                    .run(move |tx| {
                        let mut job = tx.load(&job_id)?;
                        if job.extra.remove(PUBLISHING).is_some() {
                            tx.save(&job, None)?;
                        }
                        Ok(job)
                    })
                    .await;
                match settled {
                    Ok(mut job) => {
                        job.extra.remove(PUBLISHING);
                        Ok(job)
                    }
                    // The broker has it; the mark is cleared when the
                    // store answers again (and the job published once more
                    // at a start meanwhile: at least once).
                    Err(e) => {
                        tracing::warn!(job_id = %id, error = %e, "clearing a retried dead letter's publishing mark failed");
                        let mut job = job;
                        job.extra.remove(PUBLISHING);
                        Ok(job)
                    }
                }
            }
            Err((_, source)) => {
                // The broker did not take it: it stays a dead letter.
                let restored = self
                    .store
                    .run(move |tx| {
                        let now = tx.load(&before.envelope.id)?;
                        if now.extra.contains_key(PUBLISHING) {
                            tx.save(&before, before.envelope.completed_at)?;
                        }
                        Ok(())
                    })
                    .await;
                if let Err(e) = restored {
                    tracing::warn!(job_id = %id, error = %e, "putting back a dead letter whose retry failed failed; a start publishes it");
                }
                Err(ApiError::broker(&queue, source))
            }
        }
    }

    /// Deletes a dead letter for good.
    pub async fn delete_dead_letter(&self, grant: &Grant<'_>, id: &str) -> Result<(), ApiError> {
        let queue = self.dead_letter(grant, id).await?.envelope.queue;
        grant.allow_job(Operation::Admin, &queue, id)?;
        let job_id = id.to_owned();
        self.store
            .run(move |tx| {
                if !tx.load(&job_id)?.is_dead_letter() {
                    return Err(StoreError::NotFound(job_id));
                }
                tx.delete(&job_id)
            })
            .await
            .map_err(|e| match e {
                StoreError::NotFound(id) => not_found(&id),
                e => store_error(e, "delete", "discarded"),
            })
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        resource_type: "dead_letter",
        resource_id: id.to_owned(),
    }
}

/// `7d`, `36h`, `90s`: the retention as a person reads it.
fn humantime(d: std::time::Duration) -> String {
    let s = d.as_secs();
    if s % 86_400 == 0 {
        format!("{}d", s / 86_400)
    } else if s % 3_600 == 0 {
        format!("{}h", s / 3_600)
    } else {
        format!("{s}s")
    }
}
