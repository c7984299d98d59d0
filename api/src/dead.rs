//! Dead letters through the API: the jobs a NACK discarded into their
//! queue's dead-letter path (`on_exhaustion` other than `discard`), listed
//! from the store, retried (back to `available`, attempt 0, the same id,
//! published to the queue again) and deleted.
//!
//! The store is the record; the broker's dead-letter copy (marked
//! `ojs-dead-letter-record: ojs-server`) follows it: a dead letter retried
//! or deleted here has its broker copy removed by a sweep of the queue's
//! dead-letter destination a second later, and `ojs-bridge dead-letters`
//! on the broker lists such copies but retries or purges them only through
//! the server (or with `--force`). A copy moved back to the queue on the
//! broker anyway finds the job's state in the store and is settled, not
//! run again, once the job finished.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ojs_core::glob::Glob;
use ojs_queue::{header, ConsumerOptions, Delivery, Nack, QueueAdapter, Source};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::auth::{Grant, Operation};
use crate::error::{store_error, ApiError};
use crate::job::Job;
use crate::model::Command;
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

/// The dead letters a token sees, counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeadLetterStats {
    /// How many.
    pub total: usize,
    /// How many per queue.
    pub by_queue: BTreeMap<String, u64>,
    /// How many per error type (`unknown` when a job has none).
    pub by_error_type: BTreeMap<String, u64>,
    /// When the oldest one was discarded (RFC 3339).
    pub oldest_at: Option<String>,
    /// When the newest one was discarded (RFC 3339).
    pub newest_at: Option<String>,
    /// How long they are kept.
    pub retention: Duration,
}

impl DeadLetterStats {
    /// As the binding shows it.
    pub fn to_json(&self) -> Value {
        json!({
            "total": self.total,
            "by_queue": self.by_queue,
            "by_error_type": self.by_error_type,
            "oldest_at": self.oldest_at,
            "newest_at": self.newest_at,
            "retention": {"max_age": humantime(self.retention)},
        })
    }
}

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
    pub async fn dead_letter_stats(&self, grant: &Grant<'_>) -> Result<DeadLetterStats, ApiError> {
        let all = self.visible_dead_letters(grant, None, None).await?;
        let mut stats = DeadLetterStats {
            total: all.len(),
            retention: self.settings.retention,
            ..DeadLetterStats::default()
        };
        for job in &all {
            *stats
                .by_queue
                .entry(job.envelope.queue.clone())
                .or_default() += 1;
            let kind = job
                .envelope
                .error
                .as_ref()
                .map_or("unknown", |e| e.error_type.as_str());
            *stats.by_error_type.entry(kind.to_owned()).or_default() += 1;
        }
        let at = |j: &Job| {
            j.extra
                .get("discarded_at")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        stats.oldest_at = all.first().and_then(at);
        stats.newest_at = all.last().and_then(at);
        Ok(stats)
    }

    /// Back to its queue: `available`, attempt 0, the same id, its error
    /// history kept. One of two concurrent retries wins; the other finds
    /// no dead letter (404).
    pub async fn retry_dead_letter(&self, grant: &Grant<'_>, id: &str) -> Result<Job, ApiError> {
        let queue = self.dead_letter(grant, id).await?.envelope.queue;
        grant.allow_job(Operation::Admin, &queue, id)?;
        let now = self.now();
        let job_id = id.to_owned();
        let (before, job) = self
            .store
            .run(move |tx| {
                let before = tx.load(&job_id)?;
                let mut revived = crate::model::apply(before.clone(), Command::Revive, now)
                    .map_err(|_| StoreError::NotFound(job_id.clone()))?;
                revived.job.extra.insert(PUBLISHING.into(), json!(true));
                crate::store::record(tx, &revived, now)?;
                let job = revived.job;
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
                self.remove_broker_copy(&queue, id);
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
            })?;
        self.remove_broker_copy(&queue, id);
        Ok(())
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

/// What an OJS server writes in [`header::DEAD_LETTER_RECORD`] on the
/// broker's copy of a dead letter it keeps: its job store is the record.
pub const SERVER_RECORD: &str = "ojs-server";

/// The consumer group (Kafka) a queue's dead letters are read with, here
/// and by `ojs-bridge dead-letters`: what one removes, the other no longer
/// reads. Named by the queue's topic where the adapter's template makes it
/// a deployment's own, so that two deployments on one cluster (or two
/// test runs) never share it.
pub fn dead_letter_group(adapter: &dyn QueueAdapter, queue: &str) -> String {
    match adapter.group_scope(queue) {
        Some(scope) => format!("ojs-bridge-dead-letters.{scope}"),
        None => format!("ojs-bridge-dead-letters.{queue}"),
    }
}

/// How a queue's dead letters are read, here and by `ojs-bridge
/// dead-letters`: in [`dead_letter_group`], nothing waiting in this process
/// beyond what it reads, never dead-lettered again.
pub fn dead_letter_reader(adapter: &dyn QueueAdapter, queue: &str) -> ConsumerOptions {
    ConsumerOptions {
        group: dead_letter_group(adapter, queue),
        prefetch: 0,
        source: Source::DeadLetters,
        may_dead_letter: false,
        visibility_timeout: Duration::from_secs(60),
        ..ConsumerOptions::default()
    }
}

/// Dead letters given back at most per sweep (the rest wait for the next).
const SWEEP_HELD: usize = 10_000;
/// How long a sweep waits for its first dead letter.
const SWEEP_FIRST_WAIT: Duration = Duration::from_secs(5);
/// A sweep stops reading after this long without a dead letter.
const SWEEP_IDLE: Duration = Duration::from_secs(1);
/// Removals asked until this long passes without another are made in one
/// sweep per queue (a sweep reads the queue's dead letters, which costs a
/// Kafka group join and, on SQS, a call per ten).
const SWEEP_GATHER: Duration = Duration::from_secs(2);
/// ... but no later than this after the first.
const SWEEP_GATHER_MOST: Duration = Duration::from_secs(30);

/// Broker copies of dead letters retried or deleted through the server,
/// waiting to be removed from their queue's dead-letter destination: the
/// store is the record, the broker's copy follows it.
#[derive(Debug, Default)]
pub(crate) struct BrokerCopies {
    pending: Mutex<BTreeMap<String, HashSet<String>>>,
    asked: tokio::sync::Notify,
}

impl Api {
    /// Asks for the broker's copy of dead letter `id` of `queue` to go.
    fn remove_broker_copy(&self, queue: &str, id: &str) {
        self.broker_copies
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.to_owned())
            .or_default()
            .insert(id.to_owned());
        self.broker_copies.asked.notify_one();
    }

    /// Removes the broker copies asked for, a sweep per queue, until `stop`.
    pub(crate) async fn follow_dead_letters(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = self.broker_copies.asked.notified() => {}
            }
            // One sweep for a burst of removals: after a quiet spell, or
            // at the latest SWEEP_GATHER_MOST after the first.
            let most = tokio::time::Instant::now() + SWEEP_GATHER_MOST;
            loop {
                tokio::select! {
                    () = self.broker_copies.asked.notified() => {}
                    () = tokio::time::sleep(SWEEP_GATHER) => break,
                    () = tokio::time::sleep_until(most) => break,
                }
            }
            let pending = std::mem::take(
                &mut *self
                    .broker_copies
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            );
            for (queue, ids) in pending {
                let asked = ids.len();
                let swept = self.sweep_dead_letters(&queue, ids).await;
                self.metrics().sweep(swept.as_ref().ok().copied());
                match swept {
                    Ok(removed) => {
                        tracing::debug!(%queue, asked, removed, "broker copies of dead letters retried or deleted through the server removed")
                    }
                    Err(e) => {
                        tracing::warn!(%queue, asked, error = %e, "removing broker copies of dead letters retried or deleted through the server failed; `ojs-bridge dead-letters` on the broker still lists them")
                    }
                }
            }
        }
    }

    /// Reads the queue's dead letters on the broker, removes those of
    /// `ids`, gives the others back where they were (uncounted) once the
    /// read is over. How many were removed.
    async fn sweep_dead_letters(
        &self,
        queue: &str,
        mut ids: HashSet<String>,
    ) -> Result<usize, ojs_queue::Error> {
        let kafka = self.adapter.kind() == "kafka";
        let mut consumer = self
            .adapter
            .consumer(queue, dead_letter_reader(&*self.adapter, queue))
            .await?;
        consumer.ready(Duration::from_secs(30)).await?;
        let mut left: Vec<Delivery> = Vec::new();
        let mut removed = 0;
        // The first records after a Kafka join take a fetch round trip.
        let mut wait = SWEEP_FIRST_WAIT;
        while !ids.is_empty() && left.len() < SWEEP_HELD {
            let batch = consumer.receive(100, wait).await?;
            if batch.is_empty() {
                break;
            }
            wait = SWEEP_IDLE;
            let mut found = Vec::new();
            for d in batch {
                let id = job_id_of(&d);
                if id.as_ref().is_some_and(|id| ids.remove(id)) {
                    found.push(d);
                } else {
                    left.push(d);
                }
            }
            // At once: acks waiting together share a call where the broker
            // batches them (SQS's DeleteMessageBatch, the embedded commit).
            let refs: Vec<&Delivery> = found.iter().collect();
            for acked in Delivery::ack_all(&refs).await {
                acked?;
                removed += 1;
            }
        }
        // Kafka: a record read and left uncommitted is read again; once one
        // was removed, the ones before it go to the back of the dead topic
        // so that the group's commits can pass them.
        if !(kafka && removed == 0) {
            let released = left.into_iter().map(|d| {
                let queue = queue.to_owned();
                async move {
                    if let Err(e) = d.nack(Nack::Release).await {
                        tracing::debug!(%queue, error = %e, "giving back a dead letter failed; it comes back when its lease ends");
                    }
                }
            });
            // A few at a time: each is a broker call on SQS and RabbitMQ.
            futures_buffered(released, 16).await;
        }
        consumer.close().await?;
        Ok(removed)
    }
}

/// The job id a dead letter on the broker carries (its header, the
/// broker's message id, else its decoded envelope).
fn job_id_of(d: &Delivery) -> Option<String> {
    if let Some(id) = d.headers.get_str(header::ID) {
        return Some(id.to_owned());
    }
    if let Some(id) = &d.message_id {
        return Some(id.clone());
    }
    d.decode_job(None).ok().map(|job| job.id)
}

/// Runs `work`, at most `at_once` at a time.
async fn futures_buffered<F: std::future::Future<Output = ()>>(
    work: impl Iterator<Item = F>,
    at_once: usize,
) {
    use futures::StreamExt as _;
    futures::stream::iter(work)
        .buffer_unordered(at_once)
        .collect::<Vec<()>>()
        .await;
}
