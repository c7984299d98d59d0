//! Workflows: a chain, a group or a batch of jobs, as one record.
//!
//! Every primitive is a graph of steps: a chain's step depends on the one
//! before it, a group's steps on none; a batch is a group with callbacks,
//! jobs fired once when every member has finished. Each step (and each
//! callback) is an ordinary job, stored when the workflow is created:
//! those ready at once as `available`, the others as `pending` until the
//! steps they depend on have completed. This module decides, from the
//! record and one member's outcome, what happens next ([`Workflow::settle`]);
//! the store runs it in the transaction that settled the member
//! (`crate::workflow`), so that a step is readied exactly once.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::job::timestamp;

/// The extra field of a member job naming its workflow.
pub const WORKFLOW_ID: &str = "workflow_id";
/// The extra field of a member job naming its place in the workflow
/// (the step's index, or the callback's name).
pub const WORKFLOW_STEP: &str = "workflow_step";
/// The extra field of a readied job with the results of the steps it
/// depends on (all its ancestors, in step order; `null` where a step
/// answered none).
pub const PARENT_RESULTS: &str = "parent_results";

/// The three primitives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Steps one after another; a failed step stops the rest.
    Chain,
    /// Steps at once, independent of each other.
    Group,
    /// A group whose callbacks fire when every member has finished.
    Batch,
}

impl Kind {
    /// The binding's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Chain => "chain",
            Kind::Group => "group",
            Kind::Batch => "batch",
        }
    }
}

/// A workflow's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Created: its first steps are on the broker.
    Running,
    /// Finished as the primitive defines success.
    Completed,
    /// Finished otherwise.
    Failed,
    /// A client cancelled it.
    Cancelled,
}

impl State {
    /// The binding's name.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Completed => "completed",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
        }
    }

    /// Whether nothing changes it any more.
    pub fn is_final(self) -> bool {
        self != State::Running
    }
}

/// A step's (or a callback's) state as the workflow records it; while its
/// job is on the broker, the job says more (`pending` or `active`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// Waiting for the steps it depends on (its job is `pending`).
    Waiting,
    /// Its job is on the broker.
    Enqueued,
    /// Its job completed.
    Completed,
    /// Its job was discarded.
    Failed,
    /// Its job was cancelled, or never ran because the workflow stopped.
    Cancelled,
}

impl StepState {
    /// Whether the step is over.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            StepState::Completed | StepState::Failed | StepState::Cancelled
        )
    }
}

/// One step of a workflow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// Its id: the request's, or its index.
    pub id: String,
    /// The job's type.
    pub job_type: String,
    /// The job.
    pub job_id: String,
    /// Steps (by index) it waits for.
    pub depends_on: Vec<usize>,
    /// Where it is.
    pub state: StepState,
    /// When its job finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
}

/// When a batch callback fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum On {
    /// Every member finished, however.
    Complete,
    /// Every member completed.
    Success,
    /// At least one member failed.
    Failure,
}

impl On {
    /// The binding's name of the callback.
    pub fn as_str(self) -> &'static str {
        match self {
            On::Complete => "on_complete",
            On::Success => "on_success",
            On::Failure => "on_failure",
        }
    }
}

/// A batch callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Callback {
    /// When it fires.
    pub on: On,
    /// The job's type.
    pub job_type: String,
    /// The job (stored `pending` until it fires; cancelled when it does
    /// not).
    pub job_id: String,
    /// Where it is (`Waiting` until the members have finished).
    pub state: StepState,
    /// Whether it fired (its job went to the broker).
    #[serde(default)]
    pub fired: bool,
}

/// A member's failure, as the workflow lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepError {
    /// The job.
    pub job_id: String,
    /// The step's id, or the callback's name.
    pub step: String,
    /// The error's code (or type).
    pub code: String,
    /// Its message.
    pub message: String,
    /// The attempt that failed.
    pub attempt: i32,
}

/// A workflow as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workflow {
    /// UUIDv7.
    pub id: String,
    /// The primitive.
    pub kind: Kind,
    /// The client's name for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where it is.
    pub state: State,
    /// When it was created (and started: its first steps were published).
    pub created_at: DateTime<Utc>,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    /// The steps, in the request's order.
    pub steps: Vec<Step>,
    /// A batch's callbacks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub callbacks: Vec<Callback>,
    /// The members' failures, in the order they came.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<StepError>,
    /// Most bytes of results a job of this workflow is given (`[api]
    /// max_parent_results_bytes` when it was created).
    #[serde(default = "default_results_limit")]
    pub results_limit: usize,
}

fn default_results_limit() -> usize {
    1 << 20
}

/// What a member's outcome does to its workflow: the steps (and callbacks)
/// whose jobs go to the broker now, and those whose jobs are cancelled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Next {
    /// Steps (by index) now ready.
    pub ready: Vec<usize>,
    /// Callbacks (by index) that fire.
    pub fire: Vec<usize>,
    /// Jobs never to run.
    pub cancel: Vec<String>,
}

/// How a member's job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Completed.
    Completed,
    /// Discarded (its attempts ran out, or it failed for good).
    Failed,
    /// Cancelled.
    Cancelled,
}

impl Workflow {
    /// The jobs of the workflow's members that are still to finish, or
    /// wait: cancelled with the workflow.
    pub fn unfinished_jobs(&self) -> Vec<String> {
        self.steps
            .iter()
            .map(|s| (&s.job_id, s.state))
            .chain(self.callbacks.iter().map(|c| (&c.job_id, c.state)))
            .filter(|(_, state)| !state.is_final())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Cancels the workflow: what has not finished is cancelled (a job
    /// active now may finish, but its outcome no longer moves the
    /// workflow). `None` when the workflow had finished.
    pub fn cancel(&mut self, now: DateTime<Utc>) -> Option<Vec<String>> {
        if self.state.is_final() {
            return None;
        }
        let jobs = self.unfinished_jobs();
        for s in &mut self.steps {
            if !s.state.is_final() {
                s.state = StepState::Cancelled;
            }
        }
        for c in &mut self.callbacks {
            if !c.state.is_final() {
                c.state = StepState::Cancelled;
            }
        }
        self.state = State::Cancelled;
        self.finished_at = Some(now);
        Some(jobs)
    }

    /// A member's job ended: records it and decides what follows. Nothing
    /// follows a workflow that has finished (or been cancelled) already,
    /// nor a job it does not know or has settled before.
    pub fn settle(
        &mut self,
        job_id: &str,
        outcome: Outcome,
        error: Option<StepError>,
        now: DateTime<Utc>,
    ) -> Next {
        let mut next = Next::default();
        if self.state.is_final() {
            return next;
        }
        let state = match outcome {
            Outcome::Completed => StepState::Completed,
            Outcome::Failed => StepState::Failed,
            Outcome::Cancelled => StepState::Cancelled,
        };
        if let Some(i) = self.steps.iter().position(|s| s.job_id == job_id) {
            if self.steps[i].state.is_final() {
                return next;
            }
            self.steps[i].state = state;
            self.steps[i].finished_at = Some(now);
            if outcome == Outcome::Completed {
                next.ready = self.newly_ready();
                for &r in &next.ready {
                    self.steps[r].state = StepState::Enqueued;
                }
            } else {
                // What depends on a step that did not complete never runs.
                for d in self.dependents_of(i) {
                    if !self.steps[d].state.is_final() {
                        self.steps[d].state = StepState::Cancelled;
                        self.steps[d].finished_at = Some(now);
                        next.cancel.push(self.steps[d].job_id.clone());
                    }
                }
            }
        } else if let Some(c) = self.callbacks.iter_mut().find(|c| c.job_id == job_id) {
            if c.state.is_final() {
                return next;
            }
            c.state = state;
        } else {
            return next;
        }
        if let Some(e) = error {
            self.errors.push(e);
        }
        let members_done = self.steps.iter().all(|s| s.state.is_final());
        if !members_done {
            return next;
        }
        let all_completed = self.steps.iter().all(|s| s.state == StepState::Completed);
        // A batch's callbacks fire once, when the last member finished.
        if self.callbacks.iter().any(|c| c.state == StepState::Waiting) {
            for (i, c) in self.callbacks.iter_mut().enumerate() {
                let fires = match c.on {
                    On::Complete => true,
                    On::Success => all_completed,
                    On::Failure => !all_completed,
                };
                if fires {
                    c.state = StepState::Enqueued;
                    c.fired = true;
                    next.fire.push(i);
                } else {
                    c.state = StepState::Cancelled;
                    next.cancel.push(c.job_id.clone());
                }
            }
        }
        if self.callbacks.iter().any(|c| !c.state.is_final()) {
            return next;
        }
        self.state = match self.kind {
            // A batch succeeds when the callbacks that fired completed,
            // whatever became of its members.
            Kind::Batch => {
                let fired_failed = self
                    .callbacks
                    .iter()
                    .any(|c| matches!(c.state, StepState::Failed));
                if fired_failed {
                    State::Failed
                } else {
                    State::Completed
                }
            }
            Kind::Chain | Kind::Group if all_completed => State::Completed,
            Kind::Chain | Kind::Group => State::Failed,
        };
        self.finished_at = Some(now);
        next
    }

    /// Waiting steps whose dependencies have all completed.
    fn newly_ready(&self) -> Vec<usize> {
        (0..self.steps.len())
            .filter(|&i| {
                self.steps[i].state == StepState::Waiting
                    && self.steps[i]
                        .depends_on
                        .iter()
                        .all(|&d| self.steps[d].state == StepState::Completed)
            })
            .collect()
    }

    /// Every step that depends on step `i`, directly or not.
    fn dependents_of(&self, i: usize) -> Vec<usize> {
        let mut found: Vec<usize> = Vec::new();
        let mut seen = HashSet::from([i]);
        let mut frontier = vec![i];
        while let Some(at) = frontier.pop() {
            for (j, s) in self.steps.iter().enumerate() {
                if s.depends_on.contains(&at) && seen.insert(j) {
                    found.push(j);
                    frontier.push(j);
                }
            }
        }
        found.sort_unstable();
        found
    }

    /// The steps whose results a step's job is given: every step it
    /// depends on, directly or not, in step order.
    pub fn ancestors_of(&self, i: usize) -> Vec<usize> {
        let mut seen: HashSet<usize> = HashSet::new();
        let mut frontier: Vec<usize> = self.steps[i].depends_on.clone();
        while let Some(at) = frontier.pop() {
            if seen.insert(at) {
                frontier.extend(self.steps[at].depends_on.iter().copied());
            }
        }
        let mut all: Vec<usize> = seen.into_iter().collect();
        all.sort_unstable();
        all
    }

    /// Members that completed.
    pub fn completed(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.state == StepState::Completed)
            .count()
    }

    /// The binding's Workflow object; `jobs` are the members' jobs as they
    /// are now, by id (for the states of those on the broker, and results).
    pub fn to_json(&self, jobs: &HashMap<String, crate::job::Job>) -> Value {
        let state_of = |id: &str, recorded: StepState| -> &'static str {
            match recorded {
                StepState::Waiting => "waiting",
                StepState::Completed => "completed",
                StepState::Failed => "failed",
                StepState::Cancelled => "cancelled",
                StepState::Enqueued => match jobs.get(id).map(crate::job::Job::state) {
                    Some(ojs_core::JobState::Active) => "active",
                    _ => "pending",
                },
            }
        };
        let steps: Vec<Value> = self
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let job = jobs.get(&s.job_id).map(|j| &j.envelope);
                let mut v = json!({
                    "index": i,
                    "id": s.id,
                    "type": s.job_type,
                    "state": state_of(&s.job_id, s.state),
                    "job_id": s.job_id,
                    "job_ids": [s.job_id],
                    "depends_on": s.depends_on.iter().map(|d| self.steps[*d].id.clone()).collect::<Vec<_>>(),
                });
                if let Some(e) = job {
                    if let Some(r) = &e.result {
                        v["result"] = r.clone();
                    }
                    if let Some(t) = e.started_at {
                        v["started_at"] = json!(timestamp(t));
                    }
                }
                if let Some(t) = s.finished_at {
                    v["completed_at"] = json!(timestamp(t));
                }
                v
            })
            .collect();
        let failed: Vec<&Step> = self
            .steps
            .iter()
            .filter(|s| s.state == StepState::Failed)
            .collect();
        let total = self.steps.len();
        let completed = self.completed();
        let created = timestamp(self.created_at);
        let finished = self.finished_at.map(timestamp);
        let mut metadata = json!({
            "created_at": created,
            "started_at": created,
            "job_count": total,
            "completed_count": completed,
            "failed_count": failed.len(),
        });
        let mut v = json!({
            "id": self.id,
            "type": self.kind.as_str(),
            "name": self.name,
            "state": self.state.as_str(),
            "created_at": created,
            "started_at": created,
            "steps_total": total,
            "steps_completed": completed,
            "jobs_total": total,
            "jobs_completed": completed,
            "steps": steps,
            "failed_job_ids": failed.iter().map(|s| s.job_id.clone()).collect::<Vec<_>>(),
            "errors": self.errors.iter().map(|e| json!({
                "job_id": e.job_id, "step": e.step, "code": e.code,
                "message": e.message, "attempt": e.attempt,
            })).collect::<Vec<_>>(),
        });
        if let Some(at) = &finished {
            let key = if self.state == State::Cancelled {
                "cancelled_at"
            } else {
                "completed_at"
            };
            v[key] = json!(at);
            metadata[key] = json!(at);
        }
        v["metadata"] = metadata;
        if self.kind == Kind::Chain {
            if let Some(i) = self.steps.iter().position(|s| s.state == StepState::Failed) {
                v["failed_step_index"] = json!(i);
            }
        }
        if !self.callbacks.is_empty() {
            let callbacks: Map<String, Value> = self
                .callbacks
                .iter()
                .map(|c| {
                    (
                        c.on.as_str().to_owned(),
                        json!({
                            "type": c.job_type,
                            "job_id": c.job_id,
                            "state": state_of(&c.job_id, c.state),
                            "fired": c.fired,
                        }),
                    )
                })
                .collect();
            v["callbacks"] = Value::Object(callbacks);
        }
        v
    }
}

/// A workflow request, read and checked: what `crate::workflow` makes jobs
/// of.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The primitive.
    pub kind: Kind,
    /// The client's name.
    pub name: Option<String>,
    /// The steps: each one's id, the indexes it depends on, its PUSH body
    /// and the body's path in the request (for errors).
    pub steps: Vec<StepRequest>,
    /// A batch's callbacks, with their PUSH bodies.
    pub callbacks: Vec<(On, Value)>,
}

/// One step of a [`Request`].
#[derive(Debug, Clone, PartialEq)]
pub struct StepRequest {
    /// The step's id.
    pub id: String,
    /// Steps it waits for, by index.
    pub depends_on: Vec<usize>,
    /// Its job, as a PUSH body.
    pub body: Value,
    /// Where the body is in the request (`steps[2]`).
    pub path: String,
}

fn invalid(path: &str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidWorkflow {
        path: path.to_owned(),
        message: message.into(),
    }
}

impl Request {
    /// Reads a workflow request in each dialect clients send: `{type:
    /// "chain", steps|jobs: [...]}`, `{type: "group"|"batch", jobs|tasks|steps:
    /// [...], callbacks: {on_complete, on_success, on_failure}}` (the admin
    /// UI's batch callback at the top level), and the graph form without a
    /// `type`: `{name, steps: [{id, type, args, depends_on, options}]}`.
    /// Nothing is stored before all of it is checked.
    pub fn read(body: Value, max_steps: usize) -> Result<Request, ApiError> {
        let Value::Object(mut body) = body else {
            return Err(invalid("", "the body must be a JSON object"));
        };
        let kind = match body.get("type") {
            None | Some(Value::Null) => None,
            Some(Value::String(k)) => Some(match k.as_str() {
                "chain" => Kind::Chain,
                "group" => Kind::Group,
                "batch" => Kind::Batch,
                other => {
                    return Err(invalid(
                        "type",
                        format!("`{other}` is no workflow primitive (chain, group, batch)"),
                    ))
                }
            }),
            Some(_) => return Err(invalid("type", "must be a string")),
        };
        let name = match body.remove("name") {
            None | Some(Value::Null) => None,
            Some(Value::String(n)) if n.len() <= 1024 => Some(n),
            Some(_) => return Err(invalid("name", "must be a string of at most 1024 bytes")),
        };
        let (key, members) = ["steps", "jobs", "tasks"]
            .into_iter()
            .find_map(|k| body.remove(k).map(|v| (k, v)))
            .ok_or_else(|| invalid("steps", "a workflow needs its steps (`steps` or `jobs`)"))?;
        let Value::Array(members) = members else {
            return Err(invalid(key, "must be an array"));
        };
        if members.is_empty() {
            return Err(invalid(key, "a workflow needs at least one step"));
        }
        if members.len() > max_steps {
            return Err(invalid(
                key,
                format!(
                    "{} steps; a workflow has at most {max_steps} (`[api] max_workflow_steps`)",
                    members.len()
                ),
            ));
        }
        // The graph form: ids and `depends_on`; without a type it is a graph.
        let graph = kind.is_none();
        let mut ids: Vec<String> = Vec::with_capacity(members.len());
        let mut bodies = Vec::with_capacity(members.len());
        let mut named_deps: Vec<Vec<String>> = Vec::with_capacity(members.len());
        for (i, m) in members.into_iter().enumerate() {
            let path = format!("{key}[{i}]");
            let Value::Object(mut m) = m else {
                return Err(invalid(&path, "each step must be a JSON object"));
            };
            if matches!(
                m.get("type").and_then(Value::as_str),
                Some("chain" | "group" | "batch")
            ) && ["steps", "jobs", "tasks"]
                .iter()
                .any(|k| m.contains_key(*k))
            {
                return Err(ApiError::Unsupported {
                    feature: "nested workflows",
                });
            }
            let id = match m.remove("id") {
                None | Some(Value::Null) => i.to_string(),
                Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => s,
                Some(_) => {
                    return Err(invalid(
                        &format!("{path}.id"),
                        "must be a non-empty string of at most 256 bytes",
                    ))
                }
            };
            if ids.contains(&id) {
                return Err(invalid(
                    &format!("{path}.id"),
                    format!("`{id}` names two steps"),
                ));
            }
            let deps = match m.remove("depends_on") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(d)) if graph => d
                    .into_iter()
                    .map(|d| match d {
                        Value::String(s) => Ok(s),
                        _ => Err(invalid(
                            &format!("{path}.depends_on"),
                            "must be an array of step ids",
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                Some(_) if graph => {
                    return Err(invalid(
                        &format!("{path}.depends_on"),
                        "must be an array of step ids",
                    ))
                }
                Some(_) => {
                    return Err(invalid(
                        &format!("{path}.depends_on"),
                        "a chain, group or batch orders its steps itself; `depends_on` belongs to a workflow without a `type`",
                    ))
                }
            };
            ids.push(id);
            named_deps.push(deps);
            bodies.push((path, Value::Object(m)));
        }
        let mut steps = Vec::with_capacity(bodies.len());
        for (i, (path, body)) in bodies.into_iter().enumerate() {
            let depends_on = match kind {
                Some(Kind::Chain) => {
                    if i == 0 {
                        Vec::new()
                    } else {
                        vec![i - 1]
                    }
                }
                Some(Kind::Group | Kind::Batch) => Vec::new(),
                None => named_deps[i]
                    .iter()
                    .map(|d| {
                        ids.iter().position(|id| id == d).ok_or_else(|| {
                            invalid(
                                &format!("{path}.depends_on"),
                                format!("`{d}` names no step of the workflow"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            };
            steps.push(StepRequest {
                id: ids[i].clone(),
                depends_on,
                body,
                path,
            });
        }
        if let Some(step) = cycle(&steps) {
            return Err(invalid(
                &format!("{}.depends_on", steps[step].path),
                format!(
                    "step `{}` depends on itself through its dependencies",
                    steps[step].id
                ),
            ));
        }
        let mut callbacks = Vec::new();
        let mut from_callbacks = match body.remove("callbacks") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(c)) => c,
            Some(_) => return Err(invalid("callbacks", "must be an object")),
        };
        for on in [On::Complete, On::Success, On::Failure] {
            let (path, cb) = match from_callbacks.remove(on.as_str()) {
                Some(cb) => (format!("callbacks.{}", on.as_str()), cb),
                None => match body.remove(on.as_str()) {
                    Some(cb) => (on.as_str().to_owned(), cb),
                    None => continue,
                },
            };
            if cb.is_null() {
                continue;
            }
            if !cb.is_object() {
                return Err(invalid(&path, "a callback is a job: a JSON object"));
            }
            callbacks.push((on, cb, path));
        }
        if let Some(other) = from_callbacks.keys().next() {
            return Err(invalid(
                &format!("callbacks.{other}"),
                "callbacks are on_complete, on_success and on_failure",
            ));
        }
        let kind = kind.unwrap_or(Kind::Chain);
        let kind = match (kind, graph) {
            // A graph is run as its dependencies say; recorded as a chain
            // when it is one, else as a group.
            (_, true) => {
                if steps
                    .iter()
                    .enumerate()
                    .all(|(i, s)| s.depends_on == if i == 0 { vec![] } else { vec![i - 1] })
                {
                    Kind::Chain
                } else {
                    Kind::Group
                }
            }
            (k, false) => k,
        };
        match kind {
            Kind::Batch if callbacks.is_empty() => {
                return Err(invalid(
                    "callbacks",
                    "a batch needs at least one callback (on_complete, on_success or on_failure)",
                ))
            }
            Kind::Chain | Kind::Group if !callbacks.is_empty() => {
                return Err(invalid(&callbacks[0].2, "callbacks belong to a batch"))
            }
            _ => {}
        }
        Ok(Request {
            kind,
            name,
            steps,
            callbacks: callbacks.into_iter().map(|(on, cb, _)| (on, cb)).collect(),
        })
    }
}

/// A step that lies on a cycle of dependencies, if any.
fn cycle(steps: &[StepRequest]) -> Option<usize> {
    // Kahn's algorithm: steps never freed lie on (or behind) a cycle.
    let mut waiting: Vec<usize> = steps.iter().map(|s| s.depends_on.len()).collect();
    let mut free: Vec<usize> = (0..steps.len()).filter(|&i| waiting[i] == 0).collect();
    let mut dependents: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, s) in steps.iter().enumerate() {
        for &d in &s.depends_on {
            dependents.entry(d).or_default().push(i);
        }
    }
    let mut freed = 0;
    while let Some(i) = free.pop() {
        freed += 1;
        for &j in dependents.get(&i).into_iter().flatten() {
            waiting[j] -= 1;
            if waiting[j] == 0 {
                free.push(j);
            }
        }
    }
    (freed < steps.len()).then(|| (0..steps.len()).find(|&i| waiting[i] > 0))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000).unwrap_or_default()
    }

    fn workflow(kind: Kind, deps: &[&[usize]], callbacks: &[On]) -> Workflow {
        Workflow {
            id: "wf".into(),
            kind,
            name: None,
            state: State::Running,
            created_at: now(),
            finished_at: None,
            steps: deps
                .iter()
                .enumerate()
                .map(|(i, d)| Step {
                    id: i.to_string(),
                    job_type: "t".into(),
                    job_id: format!("j{i}"),
                    depends_on: d.to_vec(),
                    state: if d.is_empty() {
                        StepState::Enqueued
                    } else {
                        StepState::Waiting
                    },
                    finished_at: None,
                })
                .collect(),
            callbacks: callbacks
                .iter()
                .map(|on| Callback {
                    on: *on,
                    job_type: "cb".into(),
                    job_id: on.as_str().into(),
                    state: StepState::Waiting,
                    fired: false,
                })
                .collect(),
            errors: Vec::new(),
            results_limit: default_results_limit(),
        }
    }

    #[test]
    fn a_chain_readies_each_step_after_the_one_before_and_completes() {
        let mut w = workflow(Kind::Chain, &[&[], &[0], &[1]], &[]);
        assert_eq!(
            w.settle("j0", Outcome::Completed, None, now()).ready,
            vec![1]
        );
        assert_eq!(
            w.settle("j0", Outcome::Completed, None, now()),
            Next::default(),
            "settled once"
        );
        assert_eq!(
            w.settle("j1", Outcome::Completed, None, now()).ready,
            vec![2]
        );
        assert_eq!(w.state, State::Running);
        assert_eq!(
            w.settle("j2", Outcome::Completed, None, now()),
            Next::default()
        );
        assert_eq!((w.state, w.completed()), (State::Completed, 3));
    }

    #[test]
    fn a_failed_chain_step_cancels_the_rest_and_fails_the_chain() {
        let mut w = workflow(Kind::Chain, &[&[], &[0], &[1]], &[]);
        w.settle("j0", Outcome::Completed, None, now());
        let next = w.settle("j1", Outcome::Failed, None, now());
        assert_eq!(next.cancel, vec!["j2".to_owned()]);
        assert_eq!((w.state, w.completed()), (State::Failed, 1));
    }

    #[test]
    fn a_group_fails_only_once_every_member_finished() {
        let mut w = workflow(Kind::Group, &[&[], &[], &[]], &[]);
        assert_eq!(
            w.settle("j1", Outcome::Failed, None, now()),
            Next::default()
        );
        assert_eq!(w.state, State::Running, "siblings go on");
        w.settle("j0", Outcome::Completed, None, now());
        w.settle("j2", Outcome::Completed, None, now());
        assert_eq!(w.state, State::Failed);
    }

    #[test]
    fn batch_callbacks_fire_once_by_outcome_and_decide_the_state() {
        let all = [On::Complete, On::Success, On::Failure];
        let mut w = workflow(Kind::Batch, &[&[], &[]], &all);
        w.settle("j0", Outcome::Completed, None, now());
        let next = w.settle("j1", Outcome::Failed, None, now());
        assert_eq!(next.fire, vec![0, 2], "on_complete and on_failure");
        assert_eq!(next.cancel, vec!["on_success".to_owned()]);
        assert_eq!(w.state, State::Running, "until the fired callbacks finish");
        w.settle("on_complete", Outcome::Completed, None, now());
        w.settle("on_failure", Outcome::Completed, None, now());
        assert_eq!(
            w.state,
            State::Completed,
            "a batch whose callbacks completed"
        );

        let mut w = workflow(Kind::Batch, &[&[], &[]], &all);
        w.settle("j0", Outcome::Completed, None, now());
        assert_eq!(
            w.settle("j1", Outcome::Completed, None, now()).fire,
            vec![0, 1]
        );
        w.settle("on_complete", Outcome::Completed, None, now());
        w.settle("on_success", Outcome::Failed, None, now());
        assert_eq!(w.state, State::Failed, "a fired callback failed");
    }

    #[test]
    fn a_graph_step_waits_for_all_its_dependencies_and_gets_its_ancestors_results() {
        let mut w = workflow(Kind::Group, &[&[], &[], &[0, 1], &[2]], &[]);
        assert!(w
            .settle("j0", Outcome::Completed, None, now())
            .ready
            .is_empty());
        assert_eq!(
            w.settle("j1", Outcome::Completed, None, now()).ready,
            vec![2]
        );
        assert_eq!(w.ancestors_of(3), vec![0, 1, 2]);
    }

    #[test]
    fn cancel_names_what_has_not_finished_and_stops_the_workflow() {
        let mut w = workflow(Kind::Chain, &[&[], &[0], &[1]], &[]);
        w.settle("j0", Outcome::Completed, None, now());
        assert_eq!(
            w.cancel(now()),
            Some(vec!["j1".to_owned(), "j2".to_owned()])
        );
        assert_eq!(w.state, State::Cancelled);
        assert_eq!(
            w.settle("j1", Outcome::Completed, None, now()),
            Next::default()
        );
        assert_eq!(
            w.cancel(now()),
            None,
            "a finished workflow is not cancelled again"
        );
    }

    fn read(v: Value) -> Result<Request, ApiError> {
        Request::read(v, 100)
    }

    fn path_of(e: ApiError) -> String {
        match e {
            ApiError::InvalidWorkflow { path, .. } => path,
            other => format!("not invalid_workflow: {other:?}"),
        }
    }

    #[test]
    fn every_dialect_reads_and_bad_requests_name_their_path() {
        let chain =
            read(json!({"type": "chain", "steps": [{"type": "a"}, {"type": "b"}]})).unwrap();
        assert_eq!(
            (chain.kind, chain.steps[1].depends_on.clone()),
            (Kind::Chain, vec![0])
        );
        let batch = read(json!({"type": "batch", "tasks": [{"type": "a"}],
                                "on_complete": {"type": "done"}}))
        .unwrap();
        assert_eq!(batch.callbacks.len(), 1);
        let graph = read(json!({"name": "g", "steps": [
            {"id": "a", "type": "x"}, {"id": "b", "type": "x"},
            {"id": "c", "type": "x", "depends_on": ["a", "b"]}]}))
        .unwrap();
        assert_eq!(
            (graph.kind, graph.steps[2].depends_on.clone()),
            (Kind::Group, vec![0, 1])
        );

        assert_eq!(
            path_of(read(json!({"type": "chain", "steps": []})).unwrap_err()),
            "steps"
        );
        assert_eq!(
            path_of(read(json!({"type": "loop", "steps": [{}]})).unwrap_err()),
            "type"
        );
        assert_eq!(
            path_of(read(json!({"type": "batch", "jobs": [{"type": "a"}]})).unwrap_err()),
            "callbacks"
        );
        assert_eq!(
            path_of(
                read(
                    json!({"steps": [{"id": "a", "type": "x", "depends_on": ["b"]},
                                          {"id": "b", "type": "x", "depends_on": ["a"]}]})
                )
                .unwrap_err()
            ),
            "steps[0].depends_on",
            "a cycle"
        );
        assert_eq!(
            path_of(
                read(json!({"steps": [{"id": "a", "type": "x", "depends_on": ["z"]}]}))
                    .unwrap_err()
            ),
            "steps[0].depends_on"
        );
        assert_eq!(
            path_of(
                read(json!({"steps": [{"id": "a", "type": "x"}, {"id": "a", "type": "y"}]}))
                    .unwrap_err()
            ),
            "steps[1].id"
        );
        let many: Vec<Value> = (0..101).map(|_| json!({"type": "a"})).collect();
        assert_eq!(
            path_of(read(json!({"type": "group", "jobs": many})).unwrap_err()),
            "jobs"
        );
        assert!(matches!(
            read(json!({"type": "group", "jobs": [{"type": "chain", "steps": []}]})),
            Err(ApiError::Unsupported { .. })
        ));
    }
}
