//! Workflows served: create, read, list and cancel, the step of a store
//! transaction that moves a workflow on when one of its jobs finishes, and
//! the publisher of the jobs that step readies.
//!
//! A workflow's jobs are ordinary jobs, all stored when it is created:
//! those ready at once go to the broker before the answer (201 after the
//! broker confirmed, as a PUSH), the others wait as `pending`. The
//! transaction that finishes a member (an ACK, a NACK that discards it, a
//! cancel, an expiry) also records the outcome in the workflow and makes
//! the steps it unblocks `available` with the publishing mark, so that a
//! step is readied exactly once however many replicas settle members at
//! once (the workflow's row is locked on PostgreSQL; SQLite has one
//! writer). After the commit the publisher puts them on the broker and
//! clears the mark; a crash in between leaves the mark, and the next
//! start (or another replica, within 30 s) publishes them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ojs_core::JobState;
use ojs_queue::OutgoingMessage;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::auth::{Grant, Operation};
use crate::dead::PUBLISHING;
use crate::error::ApiError;
use crate::job::{self, Job};
use crate::model::workflow::{
    Callback, Next, Outcome, Request, State, Step, StepError, StepState, Workflow, PARENT_RESULTS,
    WORKFLOW_ID, WORKFLOW_STEP,
};
use crate::model::{self, Command, EventData};
use crate::store::{record_alone, wrong_state, StoreError, Tx};
use crate::Api;

/// A workflow with its members' jobs as they are now.
#[derive(Debug, Clone)]
pub struct WorkflowView {
    /// The record.
    pub workflow: Workflow,
    /// Its jobs, by id.
    pub jobs: HashMap<String, Job>,
}

impl WorkflowView {
    /// The binding's Workflow object.
    pub fn to_json(&self) -> Value {
        self.workflow.to_json(&self.jobs)
    }
}

/// One page of workflows.
#[derive(Debug, Clone)]
pub struct WorkflowPage {
    /// The workflows, newest first.
    pub items: Vec<Workflow>,
    /// The page (from 1).
    pub page: usize,
    /// Its size.
    pub per_page: usize,
    /// Whether a next page has any.
    pub has_more: bool,
}

/// Longest page of a workflow list.
pub const MAX_WORKFLOW_PAGE: usize = 100;

impl Api {
    /// `POST /ojs/v1/workflows`: the request checked whole (every step a
    /// valid PUSH of a queue the token may push to), its jobs and record
    /// stored in one transaction, its first steps published; the answer
    /// comes after the broker confirmed them. When the broker does not take
    /// them, nothing of the workflow stays.
    pub async fn create_workflow(
        &self,
        grant: &Grant<'_>,
        body: Value,
    ) -> Result<WorkflowView, ApiError> {
        grant.allow(Operation::Push)?;
        let request = Request::read(body, self.settings.max_workflow_steps)?;
        let members = request.steps.len() + request.callbacks.len();
        if members > self.settings.max_workflow_steps {
            return Err(ApiError::InvalidWorkflow {
                path: "callbacks".into(),
                message: format!(
                    "{members} steps and callbacks; a workflow has at most {} (`[api] max_workflow_steps`)",
                    self.settings.max_workflow_steps
                ),
            });
        }
        let now = self.now();
        let id = uuid::Uuid::now_v7().to_string();
        let limit = self.adapter.max_message_bytes();
        let member_job = |body: Value, path: &str, step: Value| -> Result<Job, ApiError> {
            let mut job = job::from_json(body, now).map_err(|e| as_workflow_error(e, path))?;
            // A step's unique key holds as a PUSH's does (checked in the
            // creation's transaction); but no other job can stand in for a
            // step, so a policy that would answer with the key's holder is
            // refused.
            if let Some(u) = crate::model::unique::Uniqueness::of(&job.envelope)
                .map_err(|e| as_workflow_error(e, path))?
            {
                if u.on_conflict == crate::model::unique::OnConflict::Ignore {
                    return Err(ApiError::InvalidWorkflow {
                        path: format!("{path}.options.unique.on_conflict"),
                        message: "a workflow's step is its own job: `ignore` would answer with another; use reject or replace".into(),
                    });
                }
            }
            grant.allow_on(Operation::Push, &job.envelope.queue)?;
            if !self.serves_queue(&job.envelope.queue) {
                return Err(ApiError::QueueNotServed {
                    queue: job.envelope.queue.clone(),
                });
            }
            job.extra.insert(WORKFLOW_ID.into(), json!(id));
            job.extra.insert(WORKFLOW_STEP.into(), step);
            let size = self
                .message(&job)
                .map_err(|e| as_workflow_error(job::invalid_envelope(e), path))?
                .encoded_size();
            if size > limit {
                return Err(ApiError::InvalidWorkflow {
                    path: path.to_owned(),
                    message: format!("the job is {size} bytes; the broker takes at most {limit}"),
                });
            }
            Ok(job)
        };
        let mut jobs = Vec::with_capacity(members);
        let mut steps = Vec::with_capacity(request.steps.len());
        for s in request.steps {
            let mut job = member_job(s.body, &s.path, json!(s.id))?;
            let ready = s.depends_on.is_empty();
            if !ready {
                // Waits for its dependencies; its own schedule (if any)
                // counts from when it is readied.
                job.envelope.state = Some(JobState::Pending);
                job.envelope.enqueued_at = None;
            }
            steps.push(Step {
                id: s.id,
                job_type: job.envelope.job_type.clone(),
                job_id: job.envelope.id.clone(),
                depends_on: s.depends_on,
                state: if ready {
                    StepState::Enqueued
                } else {
                    StepState::Waiting
                },
                finished_at: None,
            });
            jobs.push(job);
        }
        let mut callbacks = Vec::with_capacity(request.callbacks.len());
        for (on, body) in request.callbacks {
            let path = format!("callbacks.{}", on.as_str());
            let mut job = member_job(body, &path, json!(on.as_str()))?;
            job.envelope.state = Some(JobState::Pending);
            job.envelope.enqueued_at = None;
            callbacks.push(Callback {
                on,
                job_type: job.envelope.job_type.clone(),
                job_id: job.envelope.id.clone(),
                state: StepState::Waiting,
                fired: false,
            });
            jobs.push(job);
        }
        let workflow = Workflow {
            id: id.clone(),
            kind: request.kind,
            name: request.name,
            state: State::Running,
            created_at: now,
            finished_at: None,
            steps,
            callbacks,
            errors: Vec::new(),
            results_limit: self.settings.max_parent_results_bytes,
        };
        // The first steps carry the publishing mark until the broker took
        // them: a crash before then publishes them at the next start.
        let first: Vec<String> = jobs
            .iter()
            .filter(|j| j.state() == JobState::Available)
            .map(|j| j.envelope.id.clone())
            .collect();
        for job in &mut jobs {
            if job.state() == JobState::Available {
                job.extra.insert(PUBLISHING.into(), json!(true));
            }
        }
        let record = workflow.clone();
        let mut stored = jobs.clone();
        let uniques: crate::store::Uniques = jobs
            .iter()
            .map(|j| crate::model::unique::Uniqueness::of(&j.envelope))
            .collect::<Result<_, _>>()?;
        let steps_paths: Vec<String> = (0..jobs.len()).map(|i| member_path(&workflow, i)).collect();
        self.store
            .run(move |tx| {
                // Keys first: a held key refuses (`reject`) the whole
                // workflow, or cancels its holder (`replace`).
                let answered = crate::store::claim_unique_keys(tx, &mut stored, &uniques)?;
                crate::store::keep_unique_keys(tx, &stored, &uniques, &answered)?;
                for job in &stored {
                    // With its `job.enqueued` (or `job.scheduled`) event.
                    tx.insert_seen(job)?;
                }
                tx.save_workflow(&record)?;
                if let Some(first) = stored.first() {
                    let total = json!({"total_steps": record.steps.len()});
                    workflow_event(
                        tx,
                        "workflow.created",
                        &record,
                        &first.envelope,
                        now,
                        total.clone(),
                    )?;
                    workflow_event(tx, "workflow.started", &record, &first.envelope, now, total)?;
                }
                Ok(())
            })
            .await
            .map_err(|e| match e {
                StoreError::Duplicate(id) => ApiError::Duplicate { id },
                StoreError::Taken {
                    index,
                    key,
                    existing,
                } => {
                    tracing::debug!(step = %steps_paths.get(index).map_or("", String::as_str), "a workflow step's unique key is held");
                    ApiError::UniqueConflict {
                        index: Some(index),
                        existing_id: existing.envelope.id.clone(),
                        existing_state: existing.state().as_str().unwrap_or("unknown"),
                        key,
                    }
                }
                other => ApiError::Store(other),
            })?;
        if jobs.iter().any(|j| j.state() == JobState::Scheduled) {
            self.scheduled.notify_one();
        }
        let ready: Vec<Job> = jobs
            .iter()
            .filter(|j| first.contains(&j.envelope.id))
            .cloned()
            .collect();
        if let Err((queue, error, _)) = self.publish_members(ready).await {
            let ids: Vec<String> = jobs.iter().map(|j| j.envelope.id.clone()).collect();
            let wf = id.clone();
            if let Err(e) = self
                .store
                .run(move |tx| {
                    for id in &ids {
                        tx.delete(id)?;
                    }
                    tx.delete_workflow(&wf)
                })
                .await
            {
                tracing::warn!(workflow_id = %id, error = %e, "removing a workflow the broker refused failed; its first steps are published again after a restart");
            }
            return Err(ApiError::broker(&queue, error));
        }
        for job in &mut jobs {
            job.extra.remove(PUBLISHING);
        }
        tracing::debug!(workflow_id = %id, kind = workflow.kind.as_str(), steps = workflow.steps.len(), "workflow created");
        Ok(WorkflowView {
            jobs: jobs
                .into_iter()
                .map(|j| (j.envelope.id.clone(), j))
                .collect(),
            workflow,
        })
    }

    /// `GET /ojs/v1/workflows/{id}`.
    pub async fn workflow(&self, grant: &Grant<'_>, id: &str) -> Result<WorkflowView, ApiError> {
        grant.allow(Operation::Read)?;
        let wf_id = id.to_owned();
        let view = self
            .store
            .run(move |tx| {
                let Some(workflow) = tx.workflow(&wf_id)? else {
                    return Ok(None);
                };
                let jobs = member_jobs(tx, &workflow)?;
                Ok(Some(WorkflowView { workflow, jobs }))
            })
            .await?
            .ok_or_else(|| not_found(id))?;
        self.allow_workflow(grant, Operation::Read, &view)?;
        Ok(view)
    }

    /// `GET /ojs/v1/workflows`: a page of workflows, newest first; only
    /// those in `state` when given; only those whose jobs are all in the
    /// token's queues.
    pub async fn workflows(
        &self,
        grant: &Grant<'_>,
        state: Option<String>,
        page: usize,
        per_page: usize,
    ) -> Result<WorkflowPage, ApiError> {
        grant.allow(Operation::Read)?;
        if let Some(s) = &state {
            if !["running", "completed", "failed", "cancelled"].contains(&s.as_str()) {
                return Err(ApiError::invalid(
                    "state",
                    "a workflow is running, completed, failed or cancelled",
                ));
            }
        }
        let page = page.max(1);
        let per_page = per_page.clamp(1, MAX_WORKFLOW_PAGE);
        let offset = (page - 1).saturating_mul(per_page);
        let scoped = !grant.scope().is_empty();
        let mut items = self
            .store
            .run(move |tx| {
                let items = tx.workflows(state.as_deref(), per_page + 1, offset)?;
                if !scoped {
                    return Ok(items
                        .into_iter()
                        .map(|w| (w, Vec::new()))
                        .collect::<Vec<_>>());
                }
                items
                    .into_iter()
                    .map(|w| {
                        let queues = member_jobs(tx, &w)?
                            .into_values()
                            .map(|j| j.envelope.queue)
                            .collect::<Vec<_>>();
                        Ok((w, queues))
                    })
                    .collect()
            })
            .await?;
        let has_more = items.len() > per_page;
        items.truncate(per_page);
        let items = items
            .into_iter()
            .filter(|(_, queues)| queues.iter().all(|q| grant.sees(q)))
            .map(|(w, _)| w)
            .collect();
        Ok(WorkflowPage {
            items,
            page,
            per_page,
            has_more,
        })
    }

    /// `DELETE /ojs/v1/workflows/{id}`: what has not finished is cancelled
    /// (an active job may finish; its outcome no longer moves the
    /// workflow); a finished workflow is a conflict.
    pub async fn cancel_workflow(
        &self,
        grant: &Grant<'_>,
        id: &str,
    ) -> Result<WorkflowView, ApiError> {
        grant.allow(Operation::Admin)?;
        let view = self.workflow(grant, id).await?;
        self.allow_workflow(grant, Operation::Admin, &view)?;
        let now = self.now();
        let wf_id = id.to_owned();
        let view = self
            .store
            .run(move |tx| {
                let Some(mut workflow) = tx.workflow(&wf_id)? else {
                    return Ok(Err(not_found(&wf_id)));
                };
                let Some(unfinished) = workflow.cancel(now) else {
                    return Ok(Err(ApiError::WorkflowFinished {
                        workflow_id: wf_id,
                        state: workflow.state.as_str(),
                    }));
                };
                tx.save_workflow(&workflow)?;
                for job_id in unfinished {
                    cancel_member(tx, &job_id, now, true)?;
                }
                let jobs = member_jobs(tx, &workflow)?;
                if let Some(first) = workflow.steps.first().and_then(|s| jobs.get(&s.job_id)) {
                    let cancelled = workflow
                        .steps
                        .iter()
                        .filter(|s| s.state == StepState::Cancelled)
                        .count();
                    workflow_event(
                        tx,
                        "workflow.cancelled",
                        &workflow,
                        &first.envelope,
                        now,
                        json!({"steps_cancelled": cancelled}),
                    )?;
                }
                Ok(Ok(WorkflowView { workflow, jobs }))
            })
            .await??;
        tracing::debug!(workflow_id = %id, "workflow cancelled");
        Ok(view)
    }

    /// Whether `grant` may do `operation` on every job of the workflow.
    fn allow_workflow(
        &self,
        grant: &Grant<'_>,
        operation: Operation,
        view: &WorkflowView,
    ) -> Result<(), ApiError> {
        for job in view.jobs.values() {
            grant.allow_job(operation, &job.envelope.queue, &job.envelope.id)?;
        }
        Ok(())
    }

    /// Publishes workflows' jobs, one batch per queue (in the order given,
    /// which is each workflow's: on a queue they are delivered in that
    /// order), each under its workflow's key (on Kafka, a workflow's jobs
    /// share a partition), and clears their publishing mark. On failure:
    /// a queue and the broker's error; the jobs not taken keep their mark.
    async fn publish_members(
        &self,
        jobs: Vec<Job>,
    ) -> Result<(), (String, ojs_queue::Error, Vec<String>)> {
        let mut by_queue: BTreeMap<String, (Vec<String>, Vec<OutgoingMessage>)> = BTreeMap::new();
        for mut job in jobs {
            job.extra.remove(PUBLISHING);
            let key = job
                .extra
                .get(WORKFLOW_ID)
                .and_then(Value::as_str)
                .map(|w| bytes::Bytes::copy_from_slice(w.as_bytes()));
            match self.message(&job) {
                Ok(mut message) => {
                    if key.is_some() {
                        message.key = key;
                    }
                    let entry = by_queue.entry(job.envelope.queue.clone()).or_default();
                    entry.0.push(job.envelope.id.clone());
                    entry.1.push(message);
                }
                Err(e) => {
                    tracing::warn!(job_id = %job.envelope.id, error = %e, "a workflow job cannot be encoded; left in the store")
                }
            }
        }
        let mut first_error = None;
        let mut published = Vec::new();
        let mut not_taken = Vec::new();
        for (queue, (ids, messages)) in by_queue {
            match self.publish(&queue, ids.clone(), messages).await {
                Ok(()) => published.extend(ids),
                Err((failed, error)) => {
                    published.extend(ids.into_iter().filter(|id| !failed.contains(id)));
                    not_taken.extend(failed);
                    first_error.get_or_insert((queue, error));
                }
            }
        }
        if !published.is_empty() {
            let cleared = self
                .store
                .run(move |tx| {
                    for id in published {
                        match tx.load(&id) {
                            Ok(mut job) => {
                                if job.extra.remove(PUBLISHING).is_some() {
                                    tx.save(&job, None)?;
                                }
                            }
                            Err(StoreError::NotFound(_)) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(())
                })
                .await;
            if let Err(e) = cleared {
                // The broker has them: published once more at a start.
                tracing::warn!(error = %e, "clearing the publishing mark of workflow jobs failed");
            }
        }
        match first_error {
            None => Ok(()),
            Some((queue, error)) => Err((queue, error, not_taken)),
        }
    }

    /// Publishes the jobs transactions readied (workflows' next steps),
    /// until `stop`. A publish the broker refused is tried again a second
    /// later; the jobs keep their publishing mark meanwhile.
    pub(crate) async fn publish_readied(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let jobs = tokio::select! {
                jobs = self.store.outbox().take() => jobs,
                _ = stop.changed() => return,
            };
            // All that commits readied meanwhile in one batch per queue: a
            // publish per workflow waited for the broker's confirm each time.
            let mut failed = Vec::new();
            if let Err((queue, error, not_taken)) = self.publish_members(jobs.clone()).await {
                tracing::warn!(%queue, error = %error, jobs = not_taken.len(), "publishing workflows' next jobs failed; tried again");
                failed = jobs
                    .into_iter()
                    .filter(|j| not_taken.contains(&j.envelope.id))
                    .collect();
            }
            if !failed.is_empty() {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => return,
                }
                self.store.outbox().put_back(failed);
            }
        }
    }
}

/// Appends a workflow event to the log, filed under the job that caused
/// it (the log's rows name a job), with the workflow's id and name first.
fn workflow_event(
    tx: &mut dyn Tx,
    kind: &str,
    workflow: &Workflow,
    job: &ojs_core::JobEnvelope,
    now: DateTime<Utc>,
    more: Value,
) -> Result<(), StoreError> {
    let mut data = json!({
        "workflow_id": workflow.id,
        "workflow_name": workflow.name,
        "workflow_type": workflow.kind.as_str(),
    });
    if let (Some(d), Value::Object(m)) = (data.as_object_mut(), more) {
        d.extend(m);
    }
    tx.event(kind, job, now, &EventData::of_value(&data))
}

/// Where the `i`-th job of a workflow (its steps, then its callbacks) is
/// in the request.
fn member_path(workflow: &Workflow, i: usize) -> String {
    match workflow.callbacks.get(i.wrapping_sub(workflow.steps.len())) {
        Some(c) if i >= workflow.steps.len() => format!("callbacks.{}", c.on.as_str()),
        _ => format!("steps[{i}]"),
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        resource_type: "workflow",
        resource_id: id.to_owned(),
    }
}

/// A step's invalid job as a workflow error naming where it is.
fn as_workflow_error(e: ApiError, path: &str) -> ApiError {
    match e {
        ApiError::InvalidRequest {
            attribute, message, ..
        } => ApiError::InvalidWorkflow {
            path: match attribute.as_deref() {
                None | Some("") => path.to_owned(),
                Some(a) => format!("{path}.{a}"),
            },
            message,
        },
        other => other,
    }
}

/// Every job of a workflow that is still stored, by id.
fn member_jobs(tx: &mut dyn Tx, workflow: &Workflow) -> Result<HashMap<String, Job>, StoreError> {
    let ids = workflow
        .steps
        .iter()
        .map(|s| &s.job_id)
        .chain(workflow.callbacks.iter().map(|c| &c.job_id));
    let mut jobs = HashMap::new();
    for id in ids {
        match tx.load(id) {
            Ok(job) => {
                jobs.insert(id.clone(), job);
            }
            // Pruned past retention.
            Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(jobs)
}

/// The workflow step of a transaction in which one of a workflow's jobs
/// reached a final state: records the outcome and carries out what
/// follows (the next steps readied, the callbacks fired, the jobs that
/// will never run cancelled).
pub(crate) fn member_finished(
    tx: &mut dyn Tx,
    job: &Job,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let Some(id) = job.extra.get(WORKFLOW_ID).and_then(Value::as_str) else {
        return Ok(());
    };
    let Some(mut workflow) = tx.workflow(id)? else {
        return Ok(());
    };
    let outcome = match job.state() {
        JobState::Completed => Outcome::Completed,
        JobState::Cancelled => Outcome::Cancelled,
        _ => Outcome::Failed,
    };
    let error = (outcome == Outcome::Failed).then(|| {
        let e = job.envelope.error.as_ref();
        StepError {
            job_id: job.envelope.id.clone(),
            step: job
                .extra
                .get(WORKFLOW_STEP)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            code: e.map(|e| e.error_type.clone()).unwrap_or_default(),
            message: e.map(|e| e.message.clone()).unwrap_or_default(),
            attempt: job.envelope.attempt,
        }
    });
    let was = workflow.clone();
    let next = workflow.settle(&job.envelope.id, outcome, error, now);
    if workflow == was {
        return Ok(());
    }
    tx.save_workflow(&workflow)?;
    record_events(tx, &was, &workflow, job, &next, now)?;
    let Next {
        ready,
        fire,
        cancel,
    } = next;
    let limit = workflow.results_limit;
    for i in ready {
        let results = results_of(tx, &workflow, &workflow.ancestors_of(i), limit)?;
        ready_member(tx, &workflow.steps[i].job_id, results, now)?;
    }
    for i in fire {
        let all: Vec<usize> = (0..workflow.steps.len()).collect();
        let results = results_of(tx, &workflow, &all, limit)?;
        ready_member(tx, &workflow.callbacks[i].job_id, results, now)?;
    }
    for job_id in cancel {
        cancel_member(tx, &job_id, now, false)?;
    }
    if workflow.state.is_final() {
        tracing::debug!(workflow_id = %workflow.id, state = workflow.state.as_str(), "workflow finished");
    }
    Ok(())
}

/// The workflow events of one member's outcome: the step's (or the
/// callback's), the callbacks fired, and the workflow's end.
fn record_events(
    tx: &mut dyn Tx,
    was: &Workflow,
    now_is: &Workflow,
    job: &Job,
    next: &Next,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let e = &job.envelope;
    let duration = e.started_at.map(|s| (now - s).num_milliseconds().max(0));
    if let Some(step) = now_is.steps.iter().find(|s| s.job_id == e.id) {
        let remaining = now_is.steps.iter().filter(|s| !s.state.is_final()).count();
        let kind = match step.state {
            StepState::Completed => Some("workflow.step_completed"),
            StepState::Failed => Some("workflow.step_failed"),
            _ => None,
        };
        if let Some(kind) = kind {
            let error = e
                .error
                .as_ref()
                .map(|x| json!({"code": x.error_type, "message": x.message}));
            workflow_event(
                tx,
                kind,
                now_is,
                e,
                now,
                json!({"step_id": step.id, "step_type": step.job_type, "job_id": e.id,
                       "duration_ms": duration, "steps_remaining": remaining, "error": error}),
            )?;
        }
    }
    for &i in &next.fire {
        let c = &now_is.callbacks[i];
        workflow_event(
            tx,
            "workflow.callback_fired",
            now_is,
            e,
            now,
            json!({"callback": c.on.as_str(), "job_id": c.job_id, "job_type": c.job_type}),
        )?;
    }
    if now_is.state.is_final() && !was.state.is_final() {
        let total = json!(now_is.steps.len());
        let took = (now - now_is.created_at).num_milliseconds().max(0);
        match now_is.state {
            State::Completed => workflow_event(
                tx,
                "workflow.completed",
                now_is,
                e,
                now,
                json!({"total_steps": total, "duration_ms": took}),
            )?,
            State::Failed => {
                let failed = now_is.steps.iter().find(|s| s.state == StepState::Failed);
                let first_error = now_is.errors.first();
                workflow_event(
                    tx,
                    "workflow.failed",
                    now_is,
                    e,
                    now,
                    json!({"total_steps": total, "duration_ms": took,
                           "failed_step_id": failed.map(|s| s.id.clone()),
                           "failed_step_type": failed.map(|s| s.job_type.clone()),
                           "error": first_error.map(|x| json!({"code": x.code, "message": x.message}))}),
                )?
            }
            State::Running | State::Cancelled => {}
        }
    }
    Ok(())
}

/// The results of `steps` (in step order) for a job's `parent_results`:
/// the nearest that fit in `limit` bytes, `null` for the others and for
/// steps that answered none.
fn results_of(
    tx: &mut dyn Tx,
    workflow: &Workflow,
    steps: &[usize],
    limit: usize,
) -> Result<Vec<Value>, StoreError> {
    let mut out = vec![Value::Null; steps.len()];
    let mut used = 0usize;
    for (slot, &i) in steps.iter().enumerate().rev() {
        let result = match tx.load(&workflow.steps[i].job_id) {
            Ok(job) => job.envelope.result,
            Err(StoreError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        if let Some(r) = result {
            let size = r.to_string().len();
            if used + size > limit {
                break;
            }
            used += size;
            out[slot] = r;
        }
    }
    Ok(out)
}

/// A waiting member's job becomes available, with the results it is
/// given, to be published after the commit. A job that is no longer
/// waiting (a client cancelled it) stays as it is.
fn ready_member(
    tx: &mut dyn Tx,
    id: &str,
    parent_results: Vec<Value>,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let job = match tx.load(id) {
        Ok(job) => job,
        Err(StoreError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut t = match model::apply(job, Command::Activate, now) {
        Ok(t) => t,
        Err(_) => return Ok(()),
    };
    t.job
        .extra
        .insert(PARENT_RESULTS.into(), Value::Array(parent_results));
    t.job.extra.insert(PUBLISHING.into(), json!(true));
    record_alone(tx, &t, now)?;
    tx.outbox().push(t.job);
    Ok(())
}

/// Cancels a member's job that has not finished; one that has, or is
/// gone, stays as it is, and so does an active one when `keep_active`
/// (its worker finishes it; the workflow no longer moves on it).
fn cancel_member(
    tx: &mut dyn Tx,
    id: &str,
    now: DateTime<Utc>,
    keep_active: bool,
) -> Result<(), StoreError> {
    let job = match tx.load(id) {
        Ok(job) => job,
        Err(StoreError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    if keep_active && job.state() == JobState::Active {
        return Ok(());
    }
    match model::apply(job, Command::Cancel, now) {
        Ok(t) => record_alone(tx, &t, now),
        Err(refused) if model::is_final(refused.0) => Ok(()),
        Err(refused) => Err(wrong_state(id, refused)),
    }
}
