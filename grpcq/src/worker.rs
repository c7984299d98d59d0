//! The worker: consumes a queue through any [`QueueAdapter`], runs the
//! registered handler of each message, and settles it by the outcome table
//! of the grpcq spec and the OJS retry policy.
//!
//! | outcome | action |
//! |---|---|
//! | handler succeeded | ack |
//! | handler failed (error, panic, timeout), attempts left | nack with the policy's backoff delay |
//! | handler failed, attempts exhausted or error non-retryable | dead-letter with the error (or ack, with `on_exhaustion: discard`) |
//! | unknown topic/action or job type | dead-letter `unknown_route` |
//! | unknown content type, undecodable body | dead-letter with the decode error |
//! | an envelope that breaks the OJS schema | dead-letter `invalid_envelope` naming the attribute and the rule |
//!
//! Concurrency is bounded; a panicking or hanging handler fails only its own
//! message; consume errors are retried with backoff (the worker does not die
//! on a broker hiccup). On shutdown it stops fetching, lets in-flight
//! handlers finish within `shutdown_timeout`, and returns; handlers still
//! running then are cancelled and their messages come back unsettled.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::decode::{Decode, Incoming};
use crate::registry::{CallContext, HandlerError, HandlerResult, Registry};
use crate::retry::{OnExhaustion, ResolvedRetry, RetryDecision};
use crate::trace::TraceContext;
use ojs_core::envelope::media::Encoding;
use ojs_queue::receiver::{keep_leased, ReceiveFailure, ReceiveStage, Receiver, ReceiverSettings};
use ojs_queue::Result;
use ojs_queue::{ConsumerOptions, DeadLetterReason, Delivery, Nack, QueueAdapter};

/// Settings of a worker (plain data).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Queue to consume.
    pub queue: String,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Messages fetched per receive.
    pub batch_size: usize,
    /// Time a handler may run before it is cancelled and counted as failed.
    pub handler_timeout: Duration,
    /// Time in-flight handlers get to finish after shutdown.
    pub shutdown_timeout: Duration,
    /// Longest wait of one receive (bounds shutdown latency while idle).
    pub receive_wait: Duration,
    /// Encoding of messages without a content type (grpcq publishers send
    /// none: `Some(Encoding::GrpcqProto)` for their queues).
    pub default_encoding: Option<Encoding>,
    /// Retry policy for grpcq calls and for jobs without their own.
    pub retry: ResolvedRetry,
    /// Consumer settings (group, visibility timeout, prefetch).
    pub consumer: ConsumerOptions,
    /// Extend visibility while a handler runs (SQS, local, memory).
    pub heartbeat: bool,
}

impl WorkerConfig {
    /// Defaults for a queue: 10 handlers, batches of 10, 30 s handler
    /// timeout, 30 s drain, OJS default retry policy.
    pub fn new(queue: impl Into<String>) -> Self {
        WorkerConfig {
            queue: queue.into(),
            concurrency: 10,
            batch_size: 10,
            handler_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            receive_wait: Duration::from_secs(1),
            default_encoding: None,
            retry: ResolvedRetry::default(),
            consumer: ConsumerOptions::default(),
            heartbeat: true,
        }
    }
}

/// Worker lifecycle (ojs-core "Worker Lifecycle").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Fetching and executing.
    Running,
    /// Not fetching; finishing what is in flight.
    Quiet,
    /// Stop after in-flight work finishes or the shutdown timeout passes.
    Terminate,
}

/// Counters of a worker, readable while it runs.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Messages received.
    pub received: AtomicU64,
    /// Handlers started.
    pub started: AtomicU64,
    /// Acked after success.
    pub succeeded: AtomicU64,
    /// Nacked for a retry.
    pub retried: AtomicU64,
    /// Dead-lettered.
    pub dead_lettered: AtomicU64,
    /// Acked and dropped (`on_exhaustion: discard`).
    pub discarded: AtomicU64,
    /// Handlers that panicked.
    pub panics: AtomicU64,
    /// Handlers that timed out.
    pub timeouts: AtomicU64,
    /// Receive calls that failed (retried with backoff).
    pub consume_errors: AtomicU64,
    /// Acks or nacks the broker refused.
    pub settle_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Continues the middleware chain.
pub type Next = Box<dyn FnOnce() -> BoxFuture<'static, HandlerResult> + Send>;

/// What middleware knows about the message being handled.
#[derive(Debug, Clone)]
pub struct MessageInfo {
    /// `call` or `job`.
    pub kind: &'static str,
    /// grpcq message id or job id.
    pub id: String,
    /// `topic/action` or job type.
    pub route: String,
    /// 1-based attempt.
    pub attempt: u32,
    /// W3C trace context from grpcq metadata or job meta, when present.
    pub traceparent: Option<String>,
}

/// Execution middleware (ojs-core): wraps every handler call; calls `next`
/// to continue, or returns without calling it to short-circuit.
pub trait Middleware: Send + Sync {
    /// Handles one message.
    fn handle(&self, info: Arc<MessageInfo>, next: Next) -> BoxFuture<'static, HandlerResult>;
}

/// Changes the lifecycle of a running worker.
#[derive(Debug, Clone)]
pub struct LifecycleHandle(watch::Sender<Lifecycle>);

impl LifecycleHandle {
    /// Stop fetching, keep finishing in-flight work.
    pub fn quiet(&self) {
        self.0.send_replace(Lifecycle::Quiet);
    }

    /// Fetch again after `quiet`.
    pub fn resume(&self) {
        self.0.send_replace(Lifecycle::Running);
    }

    /// Finish in-flight work (within the shutdown timeout) and return.
    pub fn terminate(&self) {
        self.0.send_replace(Lifecycle::Terminate);
    }

    /// The current state.
    pub fn state(&self) -> Lifecycle {
        *self.0.borrow()
    }
}

/// A worker over one queue.
pub struct Worker {
    adapter: Arc<dyn QueueAdapter>,
    registry: Arc<Registry>,
    config: WorkerConfig,
    middleware: Vec<Arc<dyn Middleware>>,
    stats: Arc<WorkerStats>,
    lifecycle: watch::Sender<Lifecycle>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.config.queue)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker running `registry`'s handlers on `config.queue`.
    pub fn new(adapter: Arc<dyn QueueAdapter>, registry: Registry, config: WorkerConfig) -> Self {
        Worker {
            adapter,
            registry: Arc::new(registry),
            config,
            middleware: Vec::new(),
            stats: Arc::default(),
            lifecycle: watch::channel(Lifecycle::Running).0,
        }
    }

    /// Adds execution middleware; the first added runs outermost.
    pub fn with_middleware(mut self, middleware: Arc<dyn Middleware>) -> Self {
        self.middleware.push(middleware);
        self
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Quiet / resume / terminate from outside.
    pub fn lifecycle(&self) -> LifecycleHandle {
        LifecycleHandle(self.lifecycle.clone())
    }

    /// Runs until `shutdown` resolves or the lifecycle says terminate, then
    /// drains in-flight work (bounded by `shutdown_timeout`) and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<Arc<WorkerStats>> {
        let shared = Arc::new(Shared {
            registry: self.registry.clone(),
            config: self.config.clone(),
            middleware: self.middleware.clone(),
            stats: self.stats.clone(),
        });
        tokio::pin!(shutdown);
        let mut state = self.lifecycle.subscribe();
        let mut receiver = Receiver::new(
            self.adapter.clone(),
            ReceiverSettings {
                queue: self.config.queue.clone(),
                consumer: self.config.consumer.clone(),
                batch_size: self.config.batch_size,
                max_in_flight: self.config.concurrency.max(1),
                receive_wait: self.config.receive_wait,
                max_backoff: Duration::from_secs(30),
            },
        );
        let queue = self.config.queue.clone();
        let stats = self.stats.clone();
        let mut on_failure = move |f: ReceiveFailure<'_>| {
            bump(&stats.consume_errors);
            let what = match f.stage {
                ReceiveStage::Open => "cannot open consumer; retrying",
                ReceiveStage::Receive => "receive failed; retrying",
            };
            tracing::warn!(queue = %queue, error = %f.error, delay_ms = f.delay.as_millis() as u64, "{what}");
        };
        let mut tasks: JoinSet<()> = JoinSet::new();
        loop {
            while tasks.try_join_next().is_some() {}
            let now = *state.borrow_and_update();
            match now {
                Lifecycle::Terminate => break,
                Lifecycle::Quiet => {
                    tokio::select! {
                        () = &mut shutdown => break,
                        _ = state.changed() => continue,
                        Some(_) = tasks.join_next() => continue,
                    }
                }
                Lifecycle::Running => {}
            }
            let mut received = tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = state.changed() => continue,
                received = receiver.next(&mut on_failure) => received,
            };
            for delivery in received.deliveries {
                bump(&self.stats.received);
                // Each handler holds its delivery's unit of the budget.
                let unit = received.permit.as_mut().and_then(|p| p.split(1));
                let shared = shared.clone();
                tasks.spawn(async move {
                    shared.process(delivery).await;
                    drop(unit);
                });
            }
        }
        // Stop fetching; let in-flight handlers finish within the bound.
        let drained = tokio::time::timeout(self.config.shutdown_timeout, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(queue = %self.config.queue, left = tasks.len(), "shutdown timeout: cancelling handlers; their messages will be delivered again");
            tasks.shutdown().await;
        }
        if let Err(e) = receiver.close().await {
            tracing::warn!(error = %e, "closing the consumer failed");
        }
        Ok(self.stats)
    }
}

/// What every message task needs.
struct Shared {
    registry: Arc<Registry>,
    config: WorkerConfig,
    middleware: Vec<Arc<dyn Middleware>>,
    stats: Arc<WorkerStats>,
}

enum Work {
    Run {
        info: MessageInfo,
        call: BoxFuture<'static, HandlerResult>,
        policy: ResolvedRetry,
    },
    DeadLetter(DeadLetterReason),
}

impl Shared {
    fn plan(&self, d: &Delivery) -> Work {
        let msg = match d.decode(self.config.default_encoding) {
            Ok(m) => m,
            Err(reason) => return Work::DeadLetter(reason),
        };
        match msg {
            Incoming::Call(msg) => {
                let Some(handler) = self.registry.call(msg.topic(), msg.action()) else {
                    return Work::DeadLetter(DeadLetterReason::of(
                        ojs_queue::DeadLetterKind::UnknownRoute,
                        format!("no handler for grpcq call {}/{}", msg.topic(), msg.action()),
                    ));
                };
                let info = MessageInfo {
                    kind: "call",
                    id: msg.message_id().to_owned(),
                    route: format!("{}/{}", msg.topic(), msg.action()),
                    attempt: d.attempt,
                    traceparent: msg.metadata_value("traceparent").map(str::to_owned),
                };
                let ctx = CallContext {
                    message_id: msg.message_id().to_owned(),
                    topic: msg.topic().to_owned(),
                    action: msg.action().to_owned(),
                    originator: msg.originator().to_owned(),
                    metadata: msg
                        .metadata()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                    timestamp_ms: msg.timestamp_ms(),
                    attempt: d.attempt,
                    final_attempt: d.attempt >= self.config.retry.max_attempts,
                    timeout: self.config.handler_timeout,
                };
                Work::Run {
                    info,
                    call: handler(ctx, msg.payload_bytes()),
                    policy: self.config.retry.clone(),
                }
            }
            Incoming::Job(job) => {
                let job = *job;
                let Some(handler) = self.registry.job(&job.job_type) else {
                    return Work::DeadLetter(DeadLetterReason::of(
                        ojs_queue::DeadLetterKind::UnknownRoute,
                        format!("no handler for job type {}", job.job_type),
                    ));
                };
                let info = MessageInfo {
                    kind: "job",
                    id: job.id.clone(),
                    route: job.job_type.clone(),
                    attempt: d.attempt,
                    traceparent: job.meta_str("traceparent").map(str::to_owned),
                };
                let policy = ResolvedRetry::resolve(job.retry.as_ref(), &self.config.retry);
                Work::Run {
                    info,
                    call: handler(job, d.attempt),
                    policy,
                }
            }
        }
    }

    async fn settle(&self, d: &Delivery, nack: Option<Nack>) {
        let result = match nack {
            None => d.ack().await,
            Some(n) => d.nack(n).await,
        };
        if let Err(e) = result {
            bump(&self.stats.settle_errors);
            tracing::warn!(error = %e, "settling the message failed; it will be delivered again");
        }
    }

    async fn process(&self, d: Delivery) {
        let (info, call, policy) = match self.plan(&d) {
            Work::DeadLetter(reason) => {
                tracing::warn!(error_type = %reason.error_type, queue = %d.queue, "dead-lettering: {}", reason.message);
                bump(&self.stats.dead_lettered);
                self.settle(&d, Some(Nack::DeadLetter(reason))).await;
                return;
            }
            Work::Run { info, call, policy } => (info, call, policy),
        };
        // The handler runs as a child span of the message's trace context.
        let parent = info.traceparent.as_deref().and_then(TraceContext::parse);
        let trace = parent.map(|p| p.child());
        let span = tracing::info_span!(
            "ojs.handle",
            kind = info.kind,
            id = %info.id,
            route = %info.route,
            attempt = info.attempt,
            trace_id = trace.map(|t| t.trace_id_hex()).unwrap_or_default(),
            span_id = trace.map(|t| t.span_id_hex()).unwrap_or_default(),
            parent_span_id = parent.map(|p| p.span_id_hex()).unwrap_or_default(),
        );
        let info = Arc::new(info);
        async {
            bump(&self.stats.started);
            let mut next: Next = Box::new(move || call);
            for m in self.middleware.iter().rev() {
                let (m, inner, info) = (m.clone(), next, info.clone());
                next = Box::new(move || m.handle(info, inner));
            }
            let guarded = AssertUnwindSafe(next()).catch_unwind();
            let timed = tokio::time::timeout(self.config.handler_timeout, guarded);
            // Calls and jobs published by the handler continue its trace.
            let result = match trace {
                Some(t) => self.with_heartbeat(&d, t.scope(timed)).await,
                None => self.with_heartbeat(&d, timed).await,
            };
            let outcome = match result {
                Ok(Ok(Ok(()))) => Ok(()),
                Ok(Ok(Err(e))) => Err(e),
                Ok(Err(panic)) => {
                    bump(&self.stats.panics);
                    let text = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "handler panicked".into());
                    Err(HandlerError::new("panic", text))
                }
                Err(_) => {
                    bump(&self.stats.timeouts);
                    Err(HandlerError::new(
                        "timeout",
                        format!("handler ran longer than {:?}", self.config.handler_timeout),
                    ))
                }
            };
            match outcome {
                Ok(()) => {
                    bump(&self.stats.succeeded);
                    self.settle(&d, None).await;
                }
                Err(e) => match policy.decide(d.attempt, &e.error_type, e.retryable) {
                    RetryDecision::Retry(delay) => {
                        tracing::info!(error_type = %e.error_type, delay_ms = delay.as_millis() as u64, "handler failed; retrying: {}", e.message);
                        bump(&self.stats.retried);
                        self.settle(&d, Some(Nack::retry_after(delay))).await;
                    }
                    RetryDecision::Exhausted(OnExhaustion::DeadLetter) => {
                        tracing::warn!(error_type = %e.error_type, "handler failed for the last time; dead-lettering: {}", e.message);
                        bump(&self.stats.dead_lettered);
                        self.settle(&d, Some(Nack::DeadLetter(DeadLetterReason::new(e.error_type, e.message)))).await;
                    }
                    RetryDecision::Exhausted(OnExhaustion::Discard) => {
                        tracing::warn!(error_type = %e.error_type, "handler failed for the last time; discarding: {}", e.message);
                        bump(&self.stats.discarded);
                        self.settle(&d, None).await;
                    }
                },
            }
        }
        .instrument(span)
        .await;
    }

    /// Runs `work`, keeping the message leased while it runs.
    async fn with_heartbeat<T>(&self, d: &Delivery, work: impl Future<Output = T>) -> T {
        if !self.config.heartbeat {
            return work.await;
        }
        keep_leased(&[d], self.config.consumer.visibility_timeout, work).await
    }
}
