//! The OJS HTTP binding served over any [`QueueAdapter`]: an OJS client
//! pushes a job, the job goes to the queue of the user's own broker through
//! the same adapter (envelope, headers, content type) as every sink of the
//! bridge writes, and its state (INFO, CANCEL, scheduled jobs, events) is
//! kept in a [`Store`] beside the broker.
//!
//! [`Api`] is the service core: every binding (the HTTP one in [`http`])
//! calls it, so no rule is written twice. A PUSH answers only after the
//! broker confirmed the job (publisher confirm, delivery report, SQS answer,
//! SQLite commit); a job the broker refused is removed from the store
//! again, so nothing is half-stored.

pub mod admin;
pub mod auth;
pub mod body;
pub mod clock;
pub mod cron;
pub mod dead;
pub mod error;
pub mod events;
pub mod fuzz_targets;
pub mod grpc;
pub mod http;
pub mod job;
pub mod limits;
pub mod maintenance;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod queues;
pub mod rate_limits;
pub mod realtime;
pub mod roster;
pub mod store;
pub mod worker;
pub mod workflow;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use auth::{Grant, Operation, Tokens};
use chrono::{DateTime, Utc};
use ojs_core::glob::Glob;
use ojs_core::{Encoding, JobState};
use ojs_queue::{OutgoingMessage, QueueAdapter};
use tokio::sync::{watch, Notify};

pub use error::{ApiError, ErrorCode};
pub use job::Job;
pub use store::{Store, StoreError};

use model::unique::Uniqueness;
use store::Inserted;

/// A queue as LIST QUEUES answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    /// The OJS queue.
    pub name: String,
    /// When its first job arrived (or the server started, for a queue
    /// named in `[api] queues`).
    pub created_at: DateTime<Utc>,
    /// Whether FETCH hands out none of its jobs.
    pub paused: bool,
}

/// One job of a PUSH, as it is answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Pushed {
    /// The job stored, or the job holding its unique key.
    pub job: Job,
    /// Not stored: the job holding its unique key answers for it
    /// (`on_conflict: ignore`).
    pub deduplicated: bool,
}

/// What becomes of a job whose attempts are exhausted when its own retry
/// policy does not say (`on_exhaustion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Exhaustion {
    /// Discarded and not kept as a dead letter: the spec's default.
    #[default]
    Discard,
    /// Discarded into the queue's dead-letter path, listed as a dead
    /// letter.
    DeadLetter,
}

/// The API's settings, built once from `[api]`.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Queues a client may name; empty: any queue.
    pub queues: Vec<Glob>,
    /// How jobs are written to the broker: [`Encoding::OjsProto`] (the
    /// sinks' default) or [`Encoding::OjsJson`].
    pub encoding: Encoding,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most jobs in one batch.
    pub max_batch_jobs: usize,
    /// How long finished jobs and events are kept.
    pub retention: Duration,
    /// Directory of the job store.
    pub state_dir: PathBuf,
    /// Bearer tokens; none: the API is open.
    pub tokens: Tokens,
    /// The listener's own token (`[http] token_file`), which health needs
    /// where it is set and which alone sees health's detail where any
    /// token is set.
    pub health_token: Option<ojs_core::redact::Secret>,
    /// What a commit of the embedded job store survives.
    pub durability: store::Durability,
    /// The job store on PostgreSQL, shared by replicas; none: the embedded
    /// store in `state_dir`.
    pub postgres: Option<store::PostgresSettings>,
    /// How long the broker keeps a fetched job's delivery from others
    /// (SQS, the embedded broker); held deliveries are extended well
    /// before, so this is how soon the jobs of a process that died come
    /// back.
    pub visibility_timeout: Duration,
    /// At shutdown, how long workers may still acknowledge or fail the
    /// jobs this process handed out (FETCH hands out nothing meanwhile).
    pub drain_timeout: Duration,
    /// How long the broker ack of a finished job waits for others to be
    /// sent with it (one request or commit for them all). The job store
    /// says the job is finished when its ACK is answered; this only delays
    /// the broker's copy going away. A drain sends them at once.
    pub ack_linger: Duration,
    /// Most values (arrays, objects and their members) in one JSON body,
    /// checked on its bytes before it is parsed.
    pub max_json_values: usize,
    /// Request bodies being read or served at once, in bytes, across every
    /// connection and both bindings: past it a request is answered 429
    /// without its body being read.
    pub max_body_bytes_in_flight: usize,
    /// Longest time one request body may take to arrive.
    pub body_timeout: Duration,
    /// Slowest a request body may arrive, bytes per second, after a first
    /// second of grace.
    pub body_min_rate: u64,
    /// Most bytes of jobs one FETCH answers with (by their size on the
    /// broker); it always answers at least one job when one is there.
    pub max_fetch_bytes: usize,
    /// Most bytes of messages (by their size on the broker) of the active
    /// jobs this process holds deliveries of, concurrent FETCHes sharing
    /// what is left: a FETCH takes only jobs that fit (any one when the
    /// process holds nothing), waits for an ACK or NACK to make room, and
    /// answers 429 when none came within its wait.
    pub max_held_bytes: usize,
    /// Most queues this process holds a consumer of for FETCH; the one
    /// idle longest is closed to make room.
    pub max_consumers: usize,
    /// A queue's consumer no FETCH used for this long is closed.
    pub consumer_idle_timeout: Duration,
    /// What an exhausted job whose policy names no `on_exhaustion` becomes.
    pub on_exhaustion: Exhaustion,
    /// Most cron jobs the server keeps.
    pub max_crons: usize,
    /// Most steps (callbacks included) of one workflow.
    pub max_workflow_steps: usize,
    /// Most live event streams open at once.
    pub max_event_streams: usize,
    /// Whether `POST /ojs/v1/admin/reset` may empty the store and its
    /// queues (test runs only).
    pub allow_reset: bool,
    /// Most bytes of results one workflow job is given (`parent_results`):
    /// the results of the nearest steps that fit, `null` for older ones.
    pub max_parent_results_bytes: usize,
}

impl Default for ApiSettings {
    fn default() -> Self {
        ApiSettings {
            queues: Vec::new(),
            encoding: Encoding::OjsProto,
            max_body_bytes: 4 << 20,
            max_batch_jobs: 1000,
            retention: Duration::from_secs(7 * 86_400),
            state_dir: PathBuf::from("./ojs-bridge-data"),
            tokens: Tokens::default(),
            health_token: None,
            durability: store::Durability::default(),
            postgres: None,
            visibility_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(10),
            ack_linger: Duration::from_millis(2),
            max_json_values: 200_000,
            max_body_bytes_in_flight: 64 << 20,
            body_timeout: Duration::from_secs(30),
            body_min_rate: 16 << 10,
            max_fetch_bytes: 8 << 20,
            max_held_bytes: 256 << 20,
            max_consumers: 256,
            consumer_idle_timeout: Duration::from_secs(300),
            on_exhaustion: Exhaustion::Discard,
            max_crons: 1_000,
            max_workflow_steps: 1_000,
            max_event_streams: 1_000,
            allow_reset: false,
            max_parent_results_bytes: 1 << 20,
        }
    }
}

/// The OJS service over one adapter.
#[derive(Debug)]
pub struct Api {
    adapter: Arc<dyn QueueAdapter>,
    adapter_name: String,
    store: Store,
    settings: ApiSettings,
    started: Instant,
    started_at: DateTime<Utc>,
    /// Queues made ready for publishing (`QueueAdapter::prepare`).
    prepared: Mutex<HashSet<String>>,
    /// Wakes the scheduler when a scheduled job was stored.
    scheduled: Notify,
    /// Wakes the cron loop when a cron job was registered or changed here.
    crons_changed: Notify,
    /// Held by a pass of the cron loop from reading the cron jobs to
    /// recording their slots, and by a registration, change or deletion:
    /// once one of those answers, this process fires only what it wrote.
    cron_firing: tokio::sync::Mutex<()>,
    /// Queues paused (`queues`): the record alone on the store, the last
    /// read among replicas.
    paused: Mutex<HashSet<String>>,
    /// Queues' configured limits (`rate_limits`), kept as `paused` is.
    queue_limits: Mutex<HashMap<String, model::rate::Limits>>,
    /// Deliveries of active jobs, and each queue's consumer.
    workers: worker::Workers,
    /// Workers told to be quiet or to terminate: FETCH hands them nothing.
    directives: roster::Directives,
    /// Whether other processes share the store, decided once at open.
    replication: Replication,
    /// Why the store did not answer the last check, while it does not.
    store_down: Mutex<Option<String>>,
    /// Request bodies in flight, across both bindings.
    body_budget: Arc<body::BodyBudget>,
    /// The figures `/metrics` shows (the store records its own latency).
    metrics: Arc<metrics::ApiMetrics>,
    /// Broker copies of dead letters to remove (the store is the record).
    /// Maintenance mode as this process follows it.
    maintenance: Mutex<maintenance::Maintenance>,
    /// Live event streams open now.
    streams: events::Streams,
    /// Closed WebSocket connections' subscriptions, for `resume`.
    sessions: realtime::Sessions,
    broker_copies: dead::BrokerCopies,
    /// Where the time comes from.
    clock: Arc<dyn clock::Clock>,
}

/// How this process stands to the others on its store: what only replicas
/// do is asked of this value, once built, not of the store each time.
#[derive(Debug)]
enum Replication {
    /// The only process on its store (the embedded one).
    Alone,
    /// One of the replicas sharing a PostgreSQL store; settlements for the
    /// deliveries it holds are addressed to `id`.
    Replica { id: String },
}

impl Replication {
    fn of(store: &Store) -> Self {
        if store.is_shared() {
            Replication::Replica {
                id: uuid::Uuid::new_v4().simple().to_string(),
            }
        } else {
            Replication::Alone
        }
    }

    /// This replica's id, among replicas.
    fn id(&self) -> Option<&str> {
        match self {
            Replication::Alone => None,
            Replication::Replica { id } => Some(id),
        }
    }

    /// Deliveries a FETCH consumer may buffer. Among replicas none: a FETCH
    /// through another replica could not reach them, so a FETCH takes from
    /// the broker only what it hands out (RabbitMQ `basic.get`).
    fn prefetch(&self) -> u16 {
        match self {
            Replication::Alone => 100,
            Replication::Replica { .. } => 0,
        }
    }

    /// How often visibility deadlines are checked (and, among replicas,
    /// settlements other replicas decided).
    fn poll(&self) -> Duration {
        match self {
            Replication::Alone => Duration::from_millis(250),
            Replication::Replica { .. } => Duration::from_millis(100),
        }
    }
}

/// Scheduled jobs published per pass.
const SCHEDULER_BATCH: usize = 500;
/// Longest sleep of the scheduler: a job stored by another process on the
/// same store is found this late at most.
const SCHEDULER_TICK: Duration = Duration::from_millis(500);

/// How often health asks the store whether it answers.
const STORE_PING_EVERY: Duration = Duration::from_secs(1);

/// How long health waits for the store's answer before it says the store
/// does not answer.
const STORE_PING_TIMEOUT: Duration = Duration::from_secs(5);

impl Api {
    /// Opens the store and serves `adapter` (named `adapter_name` in the
    /// configuration).
    pub async fn open(
        settings: ApiSettings,
        adapter: Arc<dyn QueueAdapter>,
        adapter_name: impl Into<String>,
    ) -> Result<Arc<Api>, ApiError> {
        Self::open_with_clock(
            settings,
            adapter,
            adapter_name,
            Arc::new(clock::SystemClock),
        )
        .await
    }

    /// [`Api::open`] with the time read from `clock`.
    pub async fn open_with_clock(
        settings: ApiSettings,
        adapter: Arc<dyn QueueAdapter>,
        adapter_name: impl Into<String>,
        clock: Arc<dyn clock::Clock>,
    ) -> Result<Arc<Api>, ApiError> {
        let metrics = Arc::new(metrics::ApiMetrics::default());
        let store = match &settings.postgres {
            Some(pg) => Store::connect(pg).await?,
            None => Store::open(&settings.state_dir, settings.durability).await?,
        }
        .timed_into(metrics.clone());
        let replication = Replication::of(&store);
        let paused = store
            .run(|tx| tx.paused_queues())
            .await?
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let queue_configs = store.run(|tx| tx.queue_configs()).await?;
        let api = Arc::new(Api {
            adapter,
            adapter_name: adapter_name.into(),
            store,
            started: Instant::now(),
            started_at: clock.now(),
            prepared: Mutex::new(HashSet::new()),
            scheduled: Notify::new(),
            crons_changed: Notify::new(),
            cron_firing: tokio::sync::Mutex::new(()),
            paused: Mutex::new(paused),
            queue_limits: Mutex::new(HashMap::new()),
            workers: worker::Workers::default(),
            directives: roster::Directives::default(),
            replication,
            store_down: Mutex::new(None),
            body_budget: body::BodyBudget::new(settings.max_body_bytes_in_flight),
            metrics,
            broker_copies: dead::BrokerCopies::default(),
            streams: events::Streams::default(),
            sessions: realtime::Sessions::default(),
            maintenance: Mutex::new(maintenance::Maintenance::default()),
            settings,
            clock,
        });
        api.keep_queue_configs(queue_configs);
        Ok(api)
    }

    /// Now, at the precision jobs keep (milliseconds).
    pub fn now(&self) -> DateTime<Utc> {
        clock::whole_millis(self.clock.now())
    }

    /// The settings.
    pub fn settings(&self) -> &ApiSettings {
        &self.settings
    }

    /// The figures `/metrics` shows.
    pub fn metrics(&self) -> &metrics::ApiMetrics {
        &self.metrics
    }

    /// The budget of request bodies in flight.
    pub fn body_budget(&self) -> &Arc<body::BodyBudget> {
        &self.body_budget
    }

    /// Health's rule, the same in both bindings (HTTP `/ojs/v1/health`,
    /// gRPC `Health` and `grpc.health.v1`): where `[http] token_file` is
    /// set, health needs that token; elsewhere it is open (probes). The
    /// answer is whether the caller sees the detail (the backend's name,
    /// why a part is down): the `[http]` token's holder, or anyone where no
    /// token at all is set; never a token of `[[api.tokens]]`.
    pub fn health_access(&self, authorization: Option<&str>) -> Result<bool, ApiError> {
        match &self.settings.health_token {
            Some(token) => match auth::bearer(authorization) {
                Some(given) if token.matches(given) => Ok(true),
                _ => Err(ApiError::Unauthenticated),
            },
            None => Ok(self.settings.tokens.is_open()),
        }
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Whether clients may name `queue`.
    pub fn serves_queue(&self, queue: &str) -> bool {
        self.settings.queues.is_empty() || self.settings.queues.iter().any(|g| g.matches(queue))
    }

    /// PUSH of one or more jobs, all or nothing: validated (by the caller,
    /// [`job::from_json`] / [`job::from_proto`]), checked against
    /// `[api] queues` and the broker's size limit, stored, published; the
    /// answer comes after the broker confirmed.
    pub async fn push(&self, grant: &Grant<'_>, jobs: Vec<Job>) -> Result<Vec<Job>, ApiError> {
        Ok(self
            .push_all(grant, jobs)
            .await?
            .into_iter()
            .map(|p| p.job)
            .collect())
    }

    /// [`Api::push`], saying of each job whether a job holding its unique
    /// key answers for it (`on_conflict: ignore`). A job whose key is held
    /// under `reject` fails the push (nothing stored); under `replace` the
    /// holder is cancelled in the same transaction.
    pub async fn push_all(
        &self,
        grant: &Grant<'_>,
        jobs: Vec<Job>,
    ) -> Result<Vec<Pushed>, ApiError> {
        for job in &jobs {
            grant.allow_on(Operation::Push, &job.envelope.queue)?;
        }
        for job in &jobs {
            if !self.serves_queue(&job.envelope.queue) {
                return Err(ApiError::QueueNotServed {
                    queue: job.envelope.queue.clone(),
                });
            }
        }
        let limit = self.adapter.max_message_bytes();
        let mut messages = Vec::with_capacity(jobs.len());
        for (index, job) in jobs.iter().enumerate() {
            let message = self
                .message(job)
                .map_err(|e| job::invalid_envelope(e).at_index(index))?;
            let size = message.encoded_size();
            if size > limit {
                return Err(ApiError::JobTooLarge { index, size, limit });
            }
            messages.push(message);
        }
        let mut uniques = Vec::with_capacity(jobs.len());
        for job in &jobs {
            uniques.push(Uniqueness::of(&job.envelope)?);
        }
        let batch = jobs.len() > 1;
        let had_unique: Vec<bool> = uniques.iter().map(Option::is_some).collect();
        let inserted = self
            .store
            .insert_unique(jobs, uniques)
            .await
            .map_err(|e| match e {
                StoreError::Duplicate(id) => ApiError::Duplicate { id },
                StoreError::Taken {
                    index,
                    key,
                    existing,
                } => ApiError::UniqueConflict {
                    index: batch.then_some(index),
                    existing_id: existing.envelope.id.clone(),
                    existing_state: existing.state().as_str().unwrap_or("unknown"),
                    key,
                },
                other => ApiError::Store(other),
            })?;
        let pushed: Vec<Pushed> = inserted
            .into_iter()
            .map(|i| match i {
                Inserted::Stored(job) => Pushed {
                    job,
                    deduplicated: false,
                },
                Inserted::Existing(job) => Pushed {
                    job,
                    deduplicated: true,
                },
            })
            .collect();
        let mut by_queue: BTreeMap<&str, (Vec<String>, Vec<OutgoingMessage>)> = BTreeMap::new();
        let mut scheduled = false;
        for ((Pushed { job, deduplicated }, message), unique) in
            pushed.iter().zip(messages).zip(had_unique)
        {
            // A job a unique key's holder answers for was not stored.
            if *deduplicated {
                continue;
            }
            if job.state() != JobState::Available {
                scheduled |= job.state() == JobState::Scheduled;
                continue;
            }
            // A replacement may have taken its holder's schedule: encoded
            // again as stored.
            let message = if unique {
                self.message(job).map_err(job::invalid_envelope)?
            } else {
                message
            };
            let entry = by_queue.entry(job.envelope.queue.as_str()).or_default();
            entry.0.push(job.envelope.id.clone());
            entry.1.push(message);
        }
        if scheduled {
            self.scheduled.notify_one();
        }
        let mut first_error = None;
        for (queue, (ids, messages)) in by_queue {
            match self.publish(queue, ids, messages).await {
                Ok(()) => {}
                Err((failed, error)) => {
                    if let Err(e) = self.store.remove(failed).await {
                        tracing::warn!(error = %e, "removing jobs the broker refused from the store failed; they are published again after a restart");
                    }
                    first_error.get_or_insert_with(|| ApiError::broker(queue, error));
                }
            }
        }
        match first_error {
            None => {
                // Counted without copying the jobs: this is every PUSH.
                let stored = pushed.iter().filter(|p| !p.deduplicated).map(|p| &p.job);
                worker::count_by_queue(&self.metrics, stored, metrics::JobEvent::Pushed);
                Ok(pushed)
            }
            Some(error) => Err(error),
        }
    }

    fn message(&self, job: &Job) -> ojs_core::Result<OutgoingMessage> {
        OutgoingMessage::from_envelope(&job.envelope, self.settings.encoding)
    }

    /// Publishes one queue's jobs; marks the confirmed ones in the store.
    /// On failure: the ids the broker did not take, and why.
    async fn publish(
        &self,
        queue: &str,
        ids: Vec<String>,
        messages: Vec<OutgoingMessage>,
    ) -> Result<(), (Vec<String>, ojs_queue::Error)> {
        let fresh = !self
            .prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue);
        if fresh {
            if let Err(e) = self.adapter.prepare(queue).await {
                return Err((ids, e));
            }
            self.prepared
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(queue.to_owned());
        }
        match self.adapter.publish(queue, messages).await {
            Ok(()) => {
                self.store.published(ids);
                self.workers.published.notify_waiters();
                Ok(())
            }
            Err(ojs_queue::Error::Publish(failure)) => {
                let failed: HashSet<usize> = failure.failed.iter().map(|f| f.index).collect();
                let (bad, good): (Vec<_>, Vec<_>) = ids
                    .into_iter()
                    .enumerate()
                    .partition(|(i, _)| failed.contains(i));
                self.store
                    .published(good.into_iter().map(|(_, id)| id).collect());
                Err((
                    bad.into_iter().map(|(_, id)| id).collect(),
                    ojs_queue::Error::Publish(failure),
                ))
            }
            Err(e) => Err((ids, e)),
        }
    }

    /// The tokens requests are checked against.
    pub fn tokens(&self) -> &Tokens {
        &self.settings.tokens
    }

    /// INFO.
    pub async fn info(&self, grant: &Grant<'_>, id: &str) -> Result<Job, ApiError> {
        grant.allow(Operation::Read)?;
        let job = self.job(id).await?;
        grant.allow_job(Operation::Read, &job.envelope.queue, id)?;
        Ok(job)
    }

    async fn job(&self, id: &str) -> Result<Job, ApiError> {
        self.store
            .get(id.to_owned())
            .await?
            .ok_or_else(|| ApiError::NotFound {
                resource_type: "job",
                resource_id: id.to_owned(),
            })
    }

    /// CANCEL: a job that has not finished becomes `cancelled`; a scheduled
    /// one never reaches the broker, an available one stays there and is
    /// never handed to an OJS worker.
    pub async fn cancel(&self, grant: &Grant<'_>, id: &str) -> Result<(JobState, Job), ApiError> {
        grant.allow(Operation::Admin)?;
        if !grant.scope().is_empty() {
            let job = self.job(id).await?;
            grant.allow_job(Operation::Admin, &job.envelope.queue, id)?;
        }
        self.store
            .cancel(id.to_owned(), self.now())
            .await
            .map_err(|e| {
                error::store_error(
                    e,
                    "cancel",
                    "scheduled, available, pending, retryable or active",
                )
            })
    }

    /// ACTIVATE: a pending job becomes available and goes to the broker;
    /// the answer comes after the broker confirmed. When the broker does
    /// not take it the job is pending again and the answer says why.
    pub async fn activate(&self, grant: &Grant<'_>, id: &str) -> Result<Job, ApiError> {
        grant.allow(Operation::Push)?;
        if !grant.scope().is_empty() {
            let job = self.job(id).await?;
            grant.allow_job(Operation::Push, &job.envelope.queue, id)?;
        }
        let now = self.now();
        let job = self
            .store
            .activate(id.to_owned(), now)
            .await
            .map_err(|e| error::store_error(e, "activate", "pending"))?;
        let published = match self.message(&job) {
            Ok(message) => self
                .publish(&job.envelope.queue, vec![id.to_owned()], vec![message])
                .await
                .map_err(|(_, e)| e),
            Err(e) => Err(e.into()),
        };
        match published {
            Ok(()) => Ok(job),
            Err(source) => {
                if let Err(e) = self.store.deactivate(id.to_owned(), self.now()).await {
                    tracing::warn!(job_id = %id, error = %e, "putting a job the broker refused back to pending failed; it is published again by recovery");
                }
                Err(ApiError::broker(&job.envelope.queue, source))
            }
        }
    }

    /// `GET /ojs/v1/events`: the event log after a cursor, within the
    /// token's queues.
    pub async fn events(
        &self,
        grant: &Grant<'_>,
        mut filter: store::EventFilter,
    ) -> Result<store::EventPage, ApiError> {
        grant.allow(Operation::Read)?;
        filter.scope = grant.scope().to_vec();
        Ok(self.store.events(filter).await?)
    }

    /// The manifest (`GET /ojs/manifest`).
    pub fn manifest(&self) -> manifest::Manifest {
        manifest::Manifest::of(self.adapter.kind())
    }

    /// The broker, as health names it.
    pub fn backend(&self) -> manifest::Backend {
        manifest::Backend {
            kind: self.adapter.kind(),
            name: self.adapter_name.clone(),
        }
    }

    /// Whether the store answers, and if not why, as health reports it.
    pub fn store_health(&self) -> manifest::StoreHealth {
        let reason = self
            .store_down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        manifest::StoreHealth {
            kind: self.store.kind(),
            status: if reason.is_none() {
                "ok"
            } else {
                "unavailable"
            },
            reason,
        }
    }

    /// Seconds since the API started.
    pub fn uptime_seconds(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// LIST QUEUES: queues jobs were pushed to, and those named in
    /// `[api] queues` without a wildcard, by name.
    pub async fn queues(&self, grant: &Grant<'_>) -> Result<Vec<QueueInfo>, ApiError> {
        grant.allow(Operation::Read)?;
        if self.replication.id().is_some() {
            self.refresh_paused().await;
        }
        let paused = self
            .paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut seen: BTreeMap<String, DateTime<Utc>> =
            self.store.queues().await?.into_iter().collect();
        for q in self.settings.queues.iter().filter_map(Glob::literal) {
            seen.entry(q.to_owned()).or_insert(self.started_at);
        }
        Ok(seen
            .into_iter()
            .filter(|(name, _)| self.serves_queue(name) && grant.sees(name))
            .map(|(name, created_at)| QueueInfo {
                paused: paused.contains(&name),
                name,
                created_at,
            })
            .collect())
    }

    /// Publishes scheduled jobs when due, jobs stored before a crash whose
    /// publish was never confirmed, and prunes finished jobs; until `stop`.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        tokio::spawn(self.clone().follow_dead_letters(stop.clone()));
        tokio::spawn(self.clone().run_crons(stop.clone()));
        tokio::spawn(self.clone().publish_readied(stop.clone()));
        tokio::spawn(self.clone().watch_store(stop.clone()));
        self.recover().await;
        self.refresh_directives().await;
        self.refresh_maintenance().await;
        let mut last_prune = Instant::now();
        let mut last_recover = Instant::now();
        let mut last_refresh = Instant::now();
        let mut last_feed_reap = Instant::now();
        loop {
            if let Some(me) = self.replication.id() {
                // Replicas: what other replicas decided for deliveries held
                // here, and jobs a stopped replica stored but never
                // published.
                self.apply_settles(me).await;
                if last_recover.elapsed() >= Duration::from_secs(30) {
                    last_recover = Instant::now();
                    self.recover().await;
                }
            }
            if self.replication.id().is_some() && last_refresh.elapsed() >= Duration::from_secs(1) {
                last_refresh = Instant::now();
                // Directives another replica was given, and maintenance
                // switched through another replica (a process alone on its
                // store keeps its own state).
                self.refresh_directives().await;
                self.refresh_maintenance().await;
            }
            let due = if self.in_maintenance() {
                // Held: scheduled jobs wait in the store.
                Ok(false)
            } else {
                self.publish_due().await
            };
            let wait = match due {
                Ok(true) => Duration::ZERO,
                Ok(false) => match self.store.next_due().await {
                    Ok(Some(at)) => (at - self.clock.now())
                        .to_std()
                        .unwrap_or(Duration::ZERO)
                        .min(SCHEDULER_TICK),
                    _ => SCHEDULER_TICK,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "publishing scheduled jobs failed; retrying");
                    Duration::from_secs(1)
                }
            };
            self.reap().await;
            if last_feed_reap.elapsed() >= Duration::from_secs(1) {
                last_feed_reap = Instant::now();
                self.reap_feeds().await;
            }
            // Visibility deadlines (and settlements from other replicas)
            // are checked this often.
            let wait = wait.min(self.replication.poll());
            if last_prune.elapsed() >= Duration::from_secs(60) {
                last_prune = Instant::now();
                let before = self.clock.now()
                    - chrono::Duration::from_std(self.settings.retention).unwrap_or_default();
                match self.store.prune(before).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::debug!(removed = n, "finished jobs past [api] retention removed")
                    }
                    Err(e) => tracing::warn!(error = %e, "removing finished jobs failed"),
                }
            }
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = self.scheduled.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Asks the store every second whether it answers (PostgreSQL) or
    /// writes (the embedded one), for health; until `stop`. A task of its
    /// own: the scheduler's loop waits on the store's writes, and health
    /// must say the store is down while they wait.
    async fn watch_store(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let asked = Instant::now();
            let down = match tokio::time::timeout(STORE_PING_TIMEOUT, self.store.ping()).await {
                Ok(answer) => answer.err().map(|e| e.to_string()),
                Err(_) => Some(format!(
                    "the job store did not answer within {} s",
                    STORE_PING_TIMEOUT.as_secs()
                )),
            };
            {
                let mut was = self.store_down.lock().unwrap_or_else(|e| e.into_inner());
                match (&*was, &down) {
                    (None, Some(reason)) => {
                        tracing::warn!(%reason, "the job store does not answer; requests fail as retryable until it does")
                    }
                    (Some(_), None) => tracing::info!("the job store answers again"),
                    _ => {}
                }
                *was = down;
            }
            let rest = STORE_PING_EVERY.saturating_sub(asked.elapsed());
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(rest) => {}
            }
        }
    }

    /// Publishes one batch of due jobs; `true` when there may be more.
    async fn publish_due(&self) -> Result<bool, ApiError> {
        let due = self.store.due(self.clock.now(), SCHEDULER_BATCH).await?;
        let more = due.len() == SCHEDULER_BATCH;
        let mut by_queue: BTreeMap<String, Vec<Job>> = BTreeMap::new();
        for job in due {
            by_queue
                .entry(job.envelope.queue.clone())
                .or_default()
                .push(job);
        }
        for (queue, jobs) in by_queue {
            // The time the broker's copy and the store both say it was enqueued.
            let now = self.now();
            let mut ids = Vec::with_capacity(jobs.len());
            let mut messages = Vec::with_capacity(jobs.len());
            for mut job in jobs {
                job.envelope.state = Some(JobState::Available);
                job.envelope.enqueued_at = Some(now);
                match self.message(&job) {
                    Ok(m) => {
                        ids.push(job.envelope.id.clone());
                        messages.push(m);
                    }
                    Err(e) => {
                        tracing::warn!(job_id = %job.envelope.id, error = %e, "a stored scheduled job cannot be encoded; left in the store")
                    }
                }
            }
            let published = match self.publish(&queue, ids.clone(), messages).await {
                Ok(()) => ids,
                Err((failed, error)) => {
                    tracing::warn!(%queue, failed = failed.len(), error = %error, "the broker did not take scheduled jobs; they stay scheduled and are tried again");
                    ids.into_iter().filter(|id| !failed.contains(id)).collect()
                }
            };
            self.store.promote(published, now).await?;
        }
        Ok(more)
    }

    /// Publishes available jobs stored before this start whose publish was
    /// never confirmed: the daemon stopped between the two.
    async fn recover(&self) {
        let jobs = match self.store.unpublished(100_000).await {
            Ok(jobs) => jobs,
            Err(e) => {
                tracing::warn!(error = %e, "reading unconfirmed jobs from the store failed");
                return;
            }
        };
        if jobs.is_empty() {
            return;
        }
        tracing::info!(
            jobs = jobs.len(),
            "publishing jobs whose publish was not confirmed before the last stop"
        );
        let mut by_queue: BTreeMap<String, (Vec<String>, Vec<OutgoingMessage>)> = BTreeMap::new();
        for job in jobs {
            if let Ok(m) = self.message(&job) {
                let e = by_queue.entry(job.envelope.queue.clone()).or_default();
                e.0.push(job.envelope.id.clone());
                e.1.push(m);
            }
        }
        for (queue, (ids, messages)) in by_queue {
            match self.publish(&queue, ids.clone(), messages).await {
                Ok(()) => {
                    // Retried dead letters among them are on the broker now.
                    let cleared = self
                        .store
                        .run(move |tx| {
                            for id in ids {
                                let mut job = tx.load(&id)?;
                                if job.extra.remove(dead::PUBLISHING).is_some() {
                                    tx.save(&job, None)?;
                                }
                            }
                            Ok(())
                        })
                        .await;
                    if let Err(e) = cleared {
                        tracing::warn!(%queue, error = %e, "clearing the publishing mark of republished dead letters failed");
                    }
                }
                Err((failed, error)) => {
                    tracing::warn!(%queue, failed = failed.len(), error = %error, "republishing unconfirmed jobs failed; tried again later");
                }
            }
        }
    }
}
