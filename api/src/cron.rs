//! Cron jobs served: registration, listing, enabling and removal, and the
//! loop that fires them.
//!
//! One process fires: alone on the embedded store, that process; among
//! replicas on PostgreSQL, the one holding the `cron` role in the store (a
//! lease renewed every pass; a replica that cannot renew stops firing, and
//! another takes the role once the lease has run out). A slot's job has an
//! id derived from the cron and the slot (`model::cron`), and the slot is
//! recorded as fired only after its job is stored: a slot fired twice — a
//! leader that stalled past its lease, a crash between the push and the
//! record — is refused by the store as a duplicate id and is one job.
//!
//! After a stop, a cron whose slots passed meanwhile fires once for the
//! oldest of them and then at its next slot after now: one catch-up, not a
//! burst.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::model::cron::{CronJob, SlotAction};
use crate::model::EventData;
use crate::store::StoreError;
use crate::Api;

/// The role in the store of the replica that fires cron jobs.
const ROLE: &str = "cron";
/// How long the role is held without a renewal: a replica that died is
/// replaced as the firing one this much later at most.
const LEASE: Duration = Duration::from_secs(10);
/// Longest time between two passes (a cron registered through another
/// replica is seen this late at most, and the role renewed this often).
const PASS: Duration = Duration::from_secs(1);
/// Shortest time between two passes.
const MIN_PASS: Duration = Duration::from_millis(50);

/// Why a slot has no job (the `reason` of its `cron.skipped` event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SkipReason {
    /// The job of the last slot has not finished.
    Overlap,
    /// The template no longer makes a job, or its PUSH was refused.
    Refused,
}

impl SkipReason {
    fn as_str(self) -> &'static str {
        match self {
            SkipReason::Overlap => "overlap_skip",
            SkipReason::Refused => "refused",
        }
    }
}

/// What a pass did with one cron.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fired {
    /// Its slot's job was pushed (or had been, by an earlier try).
    Pushed,
    /// The slot has no job: the overlap policy skipped it (the job of the
    /// last slot still runs), or its job was refused.
    Skipped(SkipReason),
    /// The push failed in a way that may pass: tried again next pass.
    Later,
}

impl Api {
    /// `POST /ojs/v1/cron`: registers a cron job, or replaces the one of
    /// that name (its counts, last run and job ids stay). `true` when it is
    /// new. The template is checked as a PUSH of it would be.
    pub async fn register_cron(
        &self,
        grant: &Grant<'_>,
        body: Value,
    ) -> Result<(CronJob, bool), ApiError> {
        let now = self.now();
        let cron = CronJob::from_json(body, now)?;
        self.check_cron(grant, &cron, now)?;
        let limit = self.settings.max_crons;
        let _firing = self.cron_firing.lock().await;
        let (cron, new) = self
            .store
            .run(move |tx| {
                let (cron, new) = match tx.cron(&cron.name)? {
                    Some(old) => (
                        CronJob {
                            created_at: old.created_at,
                            last_run_at: old.last_run_at,
                            run_count: old.run_count,
                            skip_count: old.skip_count,
                            last_job_id: old.last_job_id,
                            salt: old.salt,
                            ..cron
                        },
                        false,
                    ),
                    None => {
                        if tx.crons()?.len() >= limit {
                            return Ok(Err(ApiError::CronLimit { limit }));
                        }
                        (cron, true)
                    }
                };
                tx.save_cron(&cron)?;
                Ok(Ok((cron, new)))
            })
            .await??;
        tracing::info!(cron = %cron.name, expression = %cron.expression, timezone = %cron.timezone, queue = %cron.queue(), new, "cron job registered");
        self.crons_changed.notify_one();
        Ok((cron, new))
    }

    /// Whether `grant` may register `cron`, and whether its template is a
    /// job a PUSH would take.
    fn check_cron(
        &self,
        grant: &Grant<'_>,
        cron: &CronJob,
        now: DateTime<Utc>,
    ) -> Result<(), ApiError> {
        grant.allow(Operation::Admin)?;
        grant.allow_on(Operation::Push, cron.queue())?;
        if !self.serves_queue(cron.queue()) {
            return Err(ApiError::QueueNotServed {
                queue: cron.queue().to_owned(),
            });
        }
        let slot = cron.next_run_at.unwrap_or(now);
        crate::job::from_json(cron.fire_body(slot), now).map_err(|e| e.under("job_template"))?;
        Ok(())
    }

    /// `GET /ojs/v1/cron`: the cron jobs of the token's queues, by name;
    /// only enabled or disabled ones when `enabled` says.
    pub async fn crons(
        &self,
        grant: &Grant<'_>,
        enabled: Option<bool>,
    ) -> Result<Vec<CronJob>, ApiError> {
        grant.allow(Operation::Read)?;
        let all = self.store.run(|tx| tx.crons()).await?;
        Ok(all
            .into_iter()
            .filter(|c| grant.sees(c.queue()) && enabled.is_none_or(|e| e == c.enabled))
            .collect())
    }

    /// `GET /ojs/v1/cron/{name}`.
    pub async fn cron(&self, grant: &Grant<'_>, name: &str) -> Result<CronJob, ApiError> {
        grant.allow(Operation::Read)?;
        let key = name.to_owned();
        let cron = self.store.run(move |tx| tx.cron(&key)).await?;
        cron.filter(|c| grant.sees(c.queue()))
            .ok_or_else(|| not_found(name))
    }

    /// `PATCH /ojs/v1/cron/{name}` with `enabled`: a disabled cron fires
    /// nothing and has no next run; enabled again, it fires from its next
    /// slot after now (no catch-up for the time it was off).
    pub async fn set_cron_enabled(
        &self,
        grant: &Grant<'_>,
        name: &str,
        enabled: bool,
    ) -> Result<CronJob, ApiError> {
        grant.allow(Operation::Admin)?;
        let now = self.now();
        let key = name.to_owned();
        let scope = grant.scope().to_vec();
        let _firing = self.cron_firing.lock().await;
        let found = self
            .store
            .run(move |tx| {
                let Some(mut cron) = tx.cron(&key)? else {
                    return Ok(None);
                };
                // Outside the token's queues a cron job does not exist for it.
                if !crate::auth::in_scope(&scope, cron.queue()) {
                    return Ok(None);
                }
                if cron.enabled != enabled {
                    cron.enabled = enabled;
                    cron.updated_at = now;
                    cron.next_run_at = if enabled {
                        cron.schedule().ok().and_then(|s| s.next_after(now))
                    } else {
                        None
                    };
                    tx.save_cron(&cron)?;
                }
                Ok(Some(cron))
            })
            .await?;
        let cron = found.ok_or_else(|| not_found(name))?;
        tracing::info!(cron = %cron.name, enabled, "cron job changed");
        self.crons_changed.notify_one();
        Ok(cron)
    }

    /// `DELETE /ojs/v1/cron/{name}`: it fires no more; jobs it pushed stay.
    /// A slot this process is firing is pushed and recorded before the
    /// deletion, so no job of it comes after the answer.
    pub async fn delete_cron(&self, grant: &Grant<'_>, name: &str) -> Result<CronJob, ApiError> {
        grant.allow(Operation::Admin)?;
        let key = name.to_owned();
        let scope: Vec<_> = grant.scope().to_vec();
        let _firing = self.cron_firing.lock().await;
        let removed = self
            .store
            .run(move |tx| {
                let Some(cron) = tx.cron(&key)? else {
                    return Ok(None);
                };
                // Outside the token's queues a cron job does not exist for it.
                if !crate::auth::in_scope(&scope, cron.queue()) {
                    return Ok(None);
                }
                tx.remove_cron(&key)?;
                Ok(Some(cron))
            })
            .await?;
        let cron = removed.ok_or_else(|| not_found(name))?;
        tracing::info!(cron = %cron.name, "cron job deleted");
        Ok(cron)
    }

    /// Fires cron jobs when their slots come, until `stop`.
    pub(crate) async fn run_crons(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut leading = false;
        loop {
            let wait = match self.cron_pass(&mut leading).await {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "a pass over the cron jobs failed; tried again");
                    PASS
                }
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = self.crons_changed.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One pass: where this process fires, every due cron fires its slot.
    /// Answers how long to sleep.
    async fn cron_pass(&self, leading: &mut bool) -> Result<Duration, ApiError> {
        let now = self.clock.now();
        if self.in_maintenance() {
            // Held: a slot that passes meanwhile fires once afterwards (the
            // catch-up after a stop).
            return Ok(PASS);
        }
        if let Some(me) = self.replication.id() {
            let holder = me.to_owned();
            let until = now + chrono::Duration::from_std(LEASE).unwrap_or_default();
            let held = self
                .store
                .run(move |tx| tx.hold_role(ROLE, &holder, now, until))
                .await;
            let held = match held {
                Ok(held) => held,
                Err(e) => {
                    // Not renewed: another replica may take the role once
                    // the lease runs out, so this one stops firing now.
                    *leading = false;
                    return Err(e.into());
                }
            };
            if held != *leading {
                tracing::info!(replica = %me, firing = held, "cron jobs are fired by this replica: {held}");
                *leading = held;
            }
            if !held {
                return Ok(PASS);
            }
        }
        // A deletion or change waits for the pass, and the pass for it:
        // what a pass fires is what the cron jobs were when it read them,
        // and nothing it read outlives a change that answered.
        let _firing = self.cron_firing.lock().await;
        let crons = self.store.run(|tx| tx.crons()).await?;
        let mut next: Option<DateTime<Utc>> = None;
        for cron in crons {
            let Some(slot) = cron.next_run_at.filter(|_| cron.enabled) else {
                continue;
            };
            let due_at = if slot <= now {
                match self.fire(&cron, slot).await {
                    Fired::Later => {
                        Some(now + chrono::Duration::from_std(PASS).unwrap_or_default())
                    }
                    done => self.advance(&cron.name, slot, done, now).await?,
                }
            } else {
                Some(slot)
            };
            if let Some(at) = due_at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        let wait = next
            .and_then(|at| (at - self.clock.now()).to_std().ok())
            .unwrap_or(Duration::ZERO);
        Ok(wait.clamp(MIN_PASS, PASS))
    }

    /// Fires `slot` of `cron` as its overlap policy says.
    async fn fire(&self, cron: &CronJob, slot: DateTime<Utc>) -> Fired {
        let previous = match &cron.last_job_id {
            Some(id) => match self.store.get(id.clone()).await {
                Ok(job) => job,
                Err(e) => {
                    tracing::warn!(cron = %cron.name, error = %e, "reading a cron job's last job failed; its slot is tried again");
                    return Fired::Later;
                }
            },
            None => None,
        };
        match cron
            .overlap
            .decide(previous.as_ref().map(crate::Job::state))
        {
            SlotAction::Skip => {
                tracing::debug!(cron = %cron.name, slot = %crate::job::timestamp(slot), "a cron slot skipped: the job of the last one has not finished");
                return Fired::Skipped(SkipReason::Overlap);
            }
            SlotAction::CancelThenFire => {
                if let Some(job) = &previous {
                    match self.store.cancel(job.envelope.id.clone(), self.now()).await {
                        Ok(_)
                        | Err(StoreError::WrongState { .. })
                        | Err(StoreError::NotFound(_)) => {}
                        Err(e) => {
                            tracing::warn!(cron = %cron.name, error = %e, "cancelling a cron job's last job failed; its slot is tried again");
                            return Fired::Later;
                        }
                    }
                }
            }
            SlotAction::Fire => {}
        }
        let now = self.now();
        let job = match crate::job::from_json(cron.fire_body(slot), now) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(cron = %cron.name, error = %e, "a cron job's template no longer makes a job; the slot is skipped");
                return Fired::Skipped(SkipReason::Refused);
            }
        };
        match self.push_all(&Grant::open(), vec![job]).await {
            Ok(_) | Err(ApiError::Duplicate { .. }) => {
                tracing::debug!(cron = %cron.name, slot = %crate::job::timestamp(slot), "a cron slot fired");
                Fired::Pushed
            }
            Err(e) if e.code().is_server_side() || matches!(e, ApiError::Store(_)) => {
                tracing::warn!(cron = %cron.name, error = %e, "a cron slot's job was not taken; tried again");
                Fired::Later
            }
            Err(e) => {
                // Refused as a PUSH would be (a unique key held under
                // `reject`, a queue no longer served): this slot has no job.
                tracing::warn!(cron = %cron.name, error = %e, "a cron slot's job was refused; the slot is skipped");
                Fired::Skipped(SkipReason::Refused)
            }
        }
    }

    /// Records that `slot` of the cron named `name` is done (its job
    /// pushed, or skipped) and sets its next slot after `now`, unless the
    /// cron was changed, removed or advanced meanwhile; the slot's event
    /// (`cron.triggered`, `cron.skipped`) is written in the same
    /// transaction. Answers its next slot.
    async fn advance(
        &self,
        name: &str,
        slot: DateTime<Utc>,
        done: Fired,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, ApiError> {
        let key = name.to_owned();
        let next = self
            .store
            .run(move |tx| {
                let Some(mut cron) = tx.cron(&key)? else {
                    return Ok(None);
                };
                if cron.next_run_at != Some(slot) || !cron.enabled {
                    return Ok(cron.next_run_at);
                }
                let mut data = json!({
                    "cron_name": cron.name,
                    "cron_expr": cron.expression,
                    "job_type": cron.job_type(),
                    "scheduled_at": crate::job::timestamp(slot),
                });
                let kind = if let Fired::Skipped(reason) = done {
                    data["reason"] = json!(reason.as_str());
                    if let Some(id) = cron
                        .last_job_id
                        .as_ref()
                        .filter(|_| reason == SkipReason::Overlap)
                    {
                        data["existing_job_id"] = json!(id);
                    }
                    cron.skip_count += 1;
                    "cron.skipped"
                } else {
                    cron.run_count += 1;
                    cron.last_run_at = Some(now);
                    let id = cron.fire_id(slot);
                    data["job_id"] = json!(id);
                    cron.last_job_id = Some(id);
                    "cron.triggered"
                };
                let subject = crate::store::Subject {
                    job_id: data.get("job_id").and_then(Value::as_str).unwrap_or(""),
                    queue: cron.queue(),
                    job_type: cron.job_type(),
                };
                tx.fact(kind, &subject, now, &EventData::of_value(&data))?;
                // One catch-up at most: the next slot is after now.
                cron.next_run_at = cron
                    .schedule()
                    .ok()
                    .and_then(|s| s.next_after(now.max(slot)));
                tx.save_cron(&cron)?;
                Ok(cron.next_run_at)
            })
            .await?;
        Ok(next)
    }
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound {
        resource_type: "cron",
        resource_id: name.to_owned(),
    }
}
