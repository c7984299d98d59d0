//! The worker side: FETCH, ACK, NACK and heartbeat over the adapter's own
//! deliveries. A FETCH receives from the queue's consumer (Kafka offsets,
//! RabbitMQ acks, SQS visibility, the embedded broker's leases) and holds
//! each delivery while its job is active; ACK acks it; NACK retries it
//! through the adapter's delayed retry or dead-letters it; a job whose
//! visibility passes is released to the broker, which delivers it again.
//! Each change of a job's state is the model's (`model::apply`), made in
//! one store transaction: one worker gets a job, an ACK of a job that is
//! not active is 409.

use foldhash::{HashMap, HashSet, HashSetExt};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use ojs_core::{JobEnvelope, JobState};
use ojs_queue::{Consumer, ConsumerOptions, DeadLetterReason, Delivery, Nack};
use serde_json::{json, Map, Value};

use crate::auth::{Grant, Operation};
use crate::error::{store_error, ApiError};
use crate::job::Job;
use crate::metrics::JobEvent;
use crate::model::rate::{self, Limits, OnLimit, RateLimit};
use crate::model::{self, apply, Command};
use crate::store::{
    record, take_rate, wrong_state, Lease, RateDecision, Settle, StoreError, Tx, RATE_FILED,
    RATE_WAITING,
};
use crate::Api;

/// Longest a FETCH waits for jobs (the binding allows a short block).
pub const MAX_FETCH_WAIT: Duration = Duration::from_secs(10);
/// Default visibility of a fetched job.
pub const DEFAULT_VISIBILITY: Duration = Duration::from_secs(30);
/// The shortest wait of one receive: a Kafka fetch sees a record the
/// broker just took only after the broker answers its long fetch (up to
/// half a second), the other brokers at once.
fn shortest_receive(kind: &str) -> Duration {
    match kind {
        "kafka" => Duration::from_millis(600),
        _ => Duration::from_millis(20),
    }
}

/// How long one receive of a FETCH that began at `began` and may wait
/// until `until` waits: at least the broker's shortest receive counted
/// from the FETCH's start, so that FETCHes queued behind one that waited
/// on the same consumer take what is there and answer instead of each
/// waiting again (16 idle workers would otherwise answer 16 receives
/// apart).
fn receive_wait(kind: &str, began: Instant, until: Instant) -> Duration {
    let floor = began + shortest_receive(kind);
    // Records the client library has already fetched are taken within
    // this; none come from the broker in it.
    const TAKE_BUFFERED: Duration = Duration::from_millis(1);
    floor
        .max(until)
        .saturating_duration_since(Instant::now())
        .min(shortest_receive(kind))
        .max(TAKE_BUFFERED)
}

/// How long the first FETCH of a queue waits for its consumer to join:
/// a Kafka consumer has no partitions until its group join is done
/// (seconds, more on a loaded machine); the other brokers' consumers are
/// ready at once. Bounded below the HTTP timeouts of the OJS SDKs.
const JOIN_LIMIT: Duration = Duration::from_secs(20);

/// How long the first receive of a joined consumer waits for what is on
/// the broker: a Kafka consumer looks up its partitions' offsets before
/// its first fetch; the others deliver at once.
fn first_receive(kind: &str) -> Duration {
    match kind {
        "kafka" => Duration::from_secs(3),
        "rabbitmq" => Duration::from_millis(300),
        _ => Duration::from_millis(20),
    }
}

/// Whether the job a delivery carries reached its queue after `deadline`
/// (by its `enqueued_at`; a delivery that does not say is not).
fn enqueued_after(
    delivery: &Delivery,
    deadline: chrono::DateTime<chrono::Utc>,
    encoding: ojs_core::Encoding,
) -> bool {
    delivery
        .decode_job(Some(encoding))
        .ok()
        .and_then(|job| job.enqueued_at)
        .is_some_and(|at| at > deadline)
}

/// A FETCH request.
#[derive(Debug, Clone)]
pub struct Fetch {
    /// Queues in order of preference.
    pub queues: Vec<String>,
    /// Most jobs to hand out.
    pub count: usize,
    /// Who asks.
    pub worker_id: Option<String>,
    /// How long the jobs stay the worker's without a heartbeat; `None`:
    /// each job's own `visibility_timeout_ms`, else 30 s.
    pub visibility: Option<Duration>,
    /// Longest wait when no job is there.
    pub wait: Duration,
}

/// A NACK request.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The job.
    pub job_id: String,
    /// The binding's error object (`code`, `message`, `retryable`?, `details`?).
    pub error: Map<String, Value>,
    /// Put it back as it is, without counting a failure's backoff.
    pub requeue: bool,
}

/// One queue's consumer.
struct Feed {
    consumer: Box<dyn Consumer>,
    /// Nothing was received yet (the consumer may still be joining).
    fresh: bool,
    /// When a FETCH last used it: one idle for `[api]
    /// consumer_idle_timeout` is closed.
    used: Instant,
    /// About the largest job (bytes on the broker) this queue delivers
    /// lately: a FETCH asks the broker for no more jobs than its byte
    /// bound holds of these.
    largest: usize,
}

/// Longest a reset spends emptying one queue on the broker.
pub const RESET_DRAIN: Duration = Duration::from_secs(10);

/// The smallest job size a FETCH plans with.
const SMALLEST_PLANNED: usize = 256;
/// Jobs a queue's first receive asks for at most, before its jobs' size
/// is known.
const FIRST_RECEIVE_JOBS: usize = 16;

/// Held deliveries taken out of the map, with their job ids.
type HeldDeliveries = Vec<(String, HeldDelivery)>;

/// A delivery whose job is active.
struct HeldDelivery {
    delivery: Delivery,
    queue: String,
    worker_id: Option<String>,
    /// When the job goes back if no heartbeat comes.
    deadline: Instant,
    visibility: Duration,
    /// When the broker's lease was last extended.
    extended: Instant,
    /// Handed out by this process (not adopted from a replica that
    /// stopped): a shutdown waits for its worker.
    handed_out: bool,
    /// When the job has run longer than its execution timeout
    /// (`timeout_ms`): it fails then, as the worker's failure would.
    timeout: Option<(Instant, Duration)>,
}

/// The deliveries of the active jobs this process holds, by job id, and
/// how many bytes their messages take: until a job is settled its
/// delivery is kept whole (a retry or a dead letter is published from
/// it), so what FETCH may make this process hold is bounded by bytes
/// (`[api] max_held_bytes`), not only by the jobs on the broker.
#[derive(Default)]
struct Held {
    jobs: HashMap<String, HeldDelivery>,
    bytes: usize,
    /// Set aside by FETCH passes running now ([`HeldRoom`]).
    reserved: usize,
}

impl Held {
    fn insert(&mut self, id: String, held: HeldDelivery) {
        self.bytes = self.bytes.saturating_add(held.delivery.payload.len());
        if let Some(old) = self.jobs.insert(id, held) {
            self.bytes = self.bytes.saturating_sub(old.delivery.payload.len());
        }
    }

    fn remove(&mut self, id: &str) -> Option<HeldDelivery> {
        let held = self.jobs.remove(id)?;
        self.bytes = self.bytes.saturating_sub(held.delivery.payload.len());
        Some(held)
    }

    fn drain(&mut self) -> impl Iterator<Item = (String, HeldDelivery)> + '_ {
        self.bytes = 0;
        self.jobs.drain()
    }

    /// A held delivery to extend or name a worker on (its delivery stays
    /// the one counted).
    fn get_mut(&mut self, id: &str) -> Option<&mut HeldDelivery> {
        self.jobs.get_mut(id)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut HeldDelivery)> {
        self.jobs.iter_mut()
    }
}

/// See [`Api::held_room`].
fn room_of(held: &Held, want: usize, max: usize) -> (usize, bool) {
    let used = held.bytes.saturating_add(held.reserved);
    let bytes = want.min(max.saturating_sub(used));
    (bytes, bytes < want && used > 0)
}

/// Room in `[api] max_held_bytes` a FETCH set aside for the jobs it is
/// taking, given back when dropped (they are held by then).
struct HeldRoom<'a> {
    held: &'a Mutex<Held>,
    bytes: usize,
    /// The room, not `max_fetch_bytes`, bounds the pass, and something else
    /// is held: it takes only jobs that fit.
    strict: bool,
}

impl Drop for HeldRoom<'_> {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.reserved = held.reserved.saturating_sub(self.bytes);
    }
}

impl std::ops::Deref for Held {
    type Target = HashMap<String, HeldDelivery>;

    fn deref(&self) -> &Self::Target {
        &self.jobs
    }
}

/// The worker side's state in this process.
#[derive(Default)]
pub struct Workers {
    feeds: tokio::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<Feed>>>>,
    /// Jobs a FETCH is activating now (between taking their deliveries and
    /// holding them): a copy of one that another FETCH of this process
    /// receives meanwhile is a duplicate, whatever the store says yet.
    activating: Arc<Mutex<HashSet<String>>>,
    /// How many `feeds` holds, for the metrics.
    consumers: std::sync::atomic::AtomicUsize,
    held: Mutex<Held>,
    /// Woken when this process published jobs: a waiting FETCH looks again
    /// at once instead of at its next poll.
    pub(crate) published: tokio::sync::Notify,
    /// Shutting down: FETCH hands out nothing, the held jobs are settled.
    draining: std::sync::atomic::AtomicBool,
    /// Deliveries being settled on the broker after their job's
    /// transition committed.
    settling: Arc<Settling>,
    /// Woken when a job this process handed out was acked or failed: a
    /// job stream at its worker's allowance looks again.
    pub(crate) settled: Arc<tokio::sync::Notify>,
}

/// Broker settlements running in the background, counted so that shutdown
/// waits for them.
#[derive(Default)]
struct Settling {
    running: std::sync::atomic::AtomicUsize,
    finished: tokio::sync::Notify,
    /// Broker acks of finished jobs waiting to be sent together.
    acks: Mutex<AckQueue>,
    /// Set by a drain: waiting acks are sent at once, without lingering.
    urgent: std::sync::atomic::AtomicBool,
    /// Wakes a lingering [`flush_acks`] when `urgent` is set.
    flush_now: tokio::sync::Notify,
}

/// Most broker acks sent together. They wait up to `[api] ack_linger` for
/// each other: the job store already says each job is finished (a copy the
/// broker gives back meanwhile is settled, not handed out), so nobody
/// waits on them, and sent one by one each was a commit of its own on the
/// embedded broker whenever the ACKs came apart, holding the broker's
/// connection that FETCHes claim through.
const ACK_BATCH: usize = 512;

#[derive(Default)]
struct AckQueue {
    waiting: Vec<(String, HeldDelivery)>,
    /// A task is sending them ([`flush_acks`]).
    flushing: bool,
}

impl Settling {
    fn acks(&self) -> std::sync::MutexGuard<'_, AckQueue> {
        // Only pushes and drains happen under the lock.
        self.acks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` settlements are over.
    fn done(&self, n: usize) {
        if self
            .running
            .fetch_sub(n, std::sync::atomic::Ordering::SeqCst)
            == n
        {
            self.finished.notify_waiters();
        }
    }
}

/// Sends the waiting broker acks, each queue's together (one consumer per
/// queue: the adapter settles them in one request or commit where it can),
/// until none waits.
async fn flush_acks(settling: Arc<Settling>, linger: Duration) {
    /// Ends a run that stops early (its task dropped or panicking): the
    /// acks it had taken count as over (their deliveries go back to the
    /// broker and are settled by the job store then), and the next ack
    /// starts another run.
    struct Flushing {
        settling: Arc<Settling>,
        taken: usize,
        armed: bool,
    }
    impl Drop for Flushing {
        fn drop(&mut self) {
            if self.armed {
                self.settling.acks().flushing = false;
                self.settling.done(self.taken);
            }
        }
    }
    let mut run = Flushing {
        settling,
        taken: 0,
        armed: true,
    };
    loop {
        if !linger.is_zero() && run.settling.acks().waiting.len() < ACK_BATCH {
            // Enabled before `urgent` is read, so that a drain setting it
            // meanwhile is not missed.
            let now = run.settling.flush_now.notified();
            tokio::pin!(now);
            now.as_mut().enable();
            if !run
                .settling
                .urgent
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                tokio::select! {
                    () = tokio::time::sleep(linger) => {}
                    () = now => {}
                }
            }
        }
        let batch: Vec<(String, HeldDelivery)> = {
            let mut acks = run.settling.acks();
            if acks.waiting.is_empty() {
                // Under the lock: an ack pushed after this starts a run.
                acks.flushing = false;
                drop(acks);
                run.armed = false;
                return;
            }
            let n = acks.waiting.len().min(ACK_BATCH);
            acks.waiting.drain(..n).collect()
        };
        run.taken = batch.len();
        let mut by_queue: std::collections::BTreeMap<&str, Vec<&(String, HeldDelivery)>> =
            std::collections::BTreeMap::new();
        for member in &batch {
            by_queue.entry(&member.1.queue).or_default().push(member);
        }
        for (queue, members) in by_queue {
            let deliveries: Vec<&Delivery> = members.iter().map(|(_, h)| &h.delivery).collect();
            let results = Delivery::ack_all(&deliveries).await;
            for ((id, _), result) in members.iter().zip(results) {
                if let Err(e) = result {
                    tracing::warn!(job_id = %id, %queue, error = %e, "acking a delivery on the broker failed; the broker gives it back and the job store settles it then");
                }
            }
        }
        drop(batch);
        run.settling.done(std::mem::take(&mut run.taken));
    }
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held.lock().map(|h| h.len()).unwrap_or_default();
        f.debug_struct("Workers")
            .field("held", &held)
            .finish_non_exhaustive()
    }
}

/// The jobs one FETCH is activating, in the process's set until the FETCH
/// holds their deliveries (or drops them): released when dropped, on every
/// path.
struct Claim {
    set: Arc<Mutex<HashSet<String>>>,
    ids: Mutex<Vec<String>>,
}

impl Claim {
    fn new(set: Arc<Mutex<HashSet<String>>>) -> Claim {
        Claim {
            set,
            ids: Mutex::new(Vec::new()),
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        for id in self
            .ids
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            set.remove(&id);
        }
    }
}

/// What FETCH does with one delivery, decided in the store.
enum Activation {
    /// Now active for this long: hand it out.
    Active(Box<Job>, Duration),
    /// Finished or cancelled already: ack the delivery, hand nothing out.
    Settle,
    /// Redelivered while its worker (through another replica that stopped)
    /// still has it: held here until its visibility passes or it is
    /// settled, not handed out again.
    Adopt(Box<Job>, Duration),
    /// A second copy of a job active here (a publish repeated after a
    /// crash, a broker's redelivery): the copy this process holds carries
    /// the job, so this one is acked and never handed out beside it.
    Duplicate,
    /// Its rate limit's window is full until then: it stays available and
    /// goes back to the broker.
    Limited(DateTime<Utc>),
    /// The store has no such job and the message is no valid one: it goes
    /// to the dead letters.
    Invalid(DeadLetterReason),
}

/// A delivered job as a FETCH takes it: decoded, or a binary envelope of
/// which only the id is read until the rest is needed.
enum Carried {
    Decoded(Box<JobEnvelope>),
    Binary { id: String, payload: bytes::Bytes },
}

impl Carried {
    fn id(&self) -> &str {
        match self {
            Carried::Decoded(e) => &e.id,
            Carried::Binary { id, .. } => id,
        }
    }

    /// The whole envelope, or why the message is no valid job.
    fn envelope(&self) -> Result<JobEnvelope, DeadLetterReason> {
        match self {
            Carried::Decoded(e) => Ok((**e).clone()),
            Carried::Binary { payload, .. } => JobEnvelope::from_proto_bytes(payload)
                .map_err(|e| DeadLetterReason::for_envelope(&e)),
        }
    }
}

/// Puts a message that is no valid job in the dead letters.
async fn dead_letter_invalid(queue: &str, delivery: &Delivery, reason: DeadLetterReason) {
    tracing::warn!(%queue, error_type = %reason.error_type, "a message that is no valid job is dead-lettered");
    if let Err(e) = delivery.nack(Nack::DeadLetter(reason)).await {
        tracing::warn!(%queue, error = %e, "dead-lettering a message that is no job failed");
    }
}

/// Does to a held delivery what a settlement says.
async fn settle_delivery(delivery: &Delivery, settle: &Settle) -> Result<(), ojs_queue::Error> {
    match settle {
        Settle::Ack | Settle::Drop => delivery.ack().await,
        Settle::Retry { delay_ms } => {
            delivery
                .nack(Nack::retry_after(Duration::from_millis(*delay_ms)))
                .await
        }
        Settle::Requeue => delivery.nack(Nack::requeue()).await,
        Settle::DeadLetter {
            error_type,
            message,
        } => {
            delivery
                .nack(Nack::DeadLetter(
                    DeadLetterReason::new(error_type.clone(), message.clone())
                        .with_record(crate::dead::SERVER_RECORD),
                ))
                .await
        }
        // Not a settlement of the delivery.
        Settle::Extend { .. } => Ok(()),
    }
}

/// What the reaper found in the store for a job whose visibility passed
/// here.
enum Expiry {
    /// Back to available: the broker delivers it again.
    Released,
    /// A heartbeat through another replica extended it until then.
    Extended(DateTime<Utc>),
    /// Finished meanwhile, or active on another replica: this copy of the
    /// delivery is not needed.
    Gone,
    /// Failed or put back meanwhile through another replica whose
    /// settlement has not arrived: the broker keeps it.
    Waiting,
}

impl Api {
    pub(crate) fn workers(&self) -> &Workers {
        &self.workers
    }

    /// This replica's id where replicas share the store.
    fn shared_replica(&self) -> Option<String> {
        self.replication.id().map(str::to_owned)
    }

    /// This replica's id when a transition may have to be passed to the
    /// replica holding the delivery (shared store, delivery not here).
    fn remote(&self, held_here: bool) -> Option<String> {
        self.shared_replica().filter(|_| !held_here)
    }

    /// Settlements other replicas decided for deliveries held here.
    pub(crate) async fn apply_settles(&self, me: &str) {
        let settles = match self.store.take_settles(me).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "reading settlements from the store failed; tried again");
                return;
            }
        };
        for (id, settle) in settles {
            if let Settle::Extend { by_ms } = settle {
                let mut held = self
                    .workers()
                    .held
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if let Some(h) = held.get_mut(&id) {
                    h.deadline = Instant::now()
                        + Duration::from_millis(by_ms).min(crate::limits::MAX_VISIBILITY);
                }
                continue;
            }
            let Some(held) = self.take_held(&id) else {
                // Released here already: the broker has it, and the store
                // says what it is when it comes back.
                continue;
            };
            self.settle_in_background(id, held, settle);
        }
    }

    async fn feed(&self, queue: &str) -> Result<Arc<tokio::sync::Mutex<Feed>>, ApiError> {
        let mut feeds = self.workers().feeds.lock().await;
        if let Some(f) = feeds.get(queue) {
            return Ok(f.clone());
        }
        if feeds.len() >= self.settings.max_consumers {
            // Room for one more: the consumer idle longest goes, unless
            // every one is in use or holds deliveries of active jobs.
            let busy = self.queues_held();
            let idlest = feeds
                .iter()
                .filter(|(q, _)| !busy.contains(q.as_str()))
                .filter_map(|(q, f)| f.try_lock().ok().map(|f| (q.clone(), f.used)))
                .min_by_key(|(_, used)| *used)
                .map(|(q, _)| q);
            match idlest.and_then(|q| feeds.remove(&q).map(|f| (q, f))) {
                Some((q, f)) => self.close_feed(q, f),
                None => return Err(ApiError::Busy),
            }
        }
        self.adapter
            .prepare(queue)
            .await
            .map_err(|source| ApiError::broker(queue, source))?;
        let options = ConsumerOptions {
            // A group per queue: a Kafka group spanning topics rebalances
            // every member whenever one more queue is fetched from. Named
            // by the queue's topic where the adapter's template makes it
            // this deployment's own, so that two deployments on one
            // cluster never share a group.
            group: match self.adapter.group_scope(queue) {
                Some(scope) => format!("ojs-bridge-api.{scope}"),
                None => format!("ojs-bridge-api.{queue}"),
            },
            visibility_timeout: self.settings.visibility_timeout,
            prefetch: self.replication.prefetch(),
            max_deliveries: None,
            source: ojs_queue::Source::Queue,
            may_dead_letter: true,
        };
        let consumer = self
            .adapter
            .consumer(queue, options)
            .await
            .map_err(|source| ApiError::broker(queue, source))?;
        let feed = Arc::new(tokio::sync::Mutex::new(Feed {
            consumer,
            fresh: true,
            used: Instant::now(),
            largest: (self.settings.max_fetch_bytes / FIRST_RECEIVE_JOBS).max(SMALLEST_PLANNED),
        }));
        feeds.insert(queue.to_owned(), feed.clone());
        self.workers()
            .consumers
            .store(feeds.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(feed)
    }

    /// Queues with deliveries held for active jobs: their consumers stay
    /// open (closing one would give its deliveries back).
    fn queues_held(&self) -> std::collections::HashSet<String> {
        self.workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|h| h.queue.clone())
            .collect()
    }

    /// `POST /ojs/v1/admin/reset` (with `[api] allow_reset`): the store
    /// emptied, and every queue it knew emptied on the broker (its
    /// messages received and acked, at most [`RESET_DRAIN`] of time per
    /// queue), the deliveries this process held acked; for test runs (the
    /// official OJS runner's `-reset-url`). Answers how many messages
    /// left the broker.
    pub async fn reset(&self, grant: &Grant<'_>) -> Result<u64, ApiError> {
        grant.allow_everywhere(Operation::Admin)?;
        if !self.settings.allow_reset {
            return Err(ApiError::PermissionDenied {
                operation: "reset",
                scope: "this server ([api] allow_reset is off)".into(),
            });
        }
        let queues: Vec<String> = self
            .store
            .queues()
            .await?
            .into_iter()
            .map(|(q, _)| q)
            .collect();
        let held: Vec<HeldDelivery> = {
            let mut held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            held.drain().map(|(_, h)| h).collect()
        };
        for h in held {
            if let Err(e) = h.delivery.ack().await {
                tracing::debug!(error = %e, "acking a held delivery at a reset failed; the broker gives it back");
            }
        }
        let mut drained = 0u64;
        for queue in &queues {
            let feed = self.feed(queue).await?;
            let mut feed = feed.lock().await;
            let until = Instant::now() + RESET_DRAIN;
            let mut empty = 0;
            while Instant::now() < until && empty < 2 {
                let wait = if feed.fresh {
                    feed.consumer
                        .ready(JOIN_LIMIT)
                        .await
                        .map_err(|source| ApiError::broker(queue, source))?;
                    first_receive(self.adapter.kind())
                } else {
                    Duration::from_millis(200)
                };
                feed.fresh = false;
                let batch = feed
                    .consumer
                    .receive(100, wait)
                    .await
                    .map_err(|source| ApiError::broker(queue, source))?;
                if batch.is_empty() {
                    empty += 1;
                }
                for d in batch {
                    drained += 1;
                    if let Err(e) = d.ack().await {
                        tracing::debug!(%queue, error = %e, "acking a message at a reset failed");
                    }
                }
            }
        }
        self.store.run(|tx| tx.reset()).await?;
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.refresh_maintenance().await;
        tracing::info!(
            queues = queues.len(),
            drained,
            token = grant.token_name().unwrap_or(""),
            "reset: the job store and its queues emptied"
        );
        Ok(drained)
    }

    /// Closes a queue's consumer in the background.
    fn close_feed(&self, queue: String, feed: Arc<tokio::sync::Mutex<Feed>>) {
        tokio::spawn(async move {
            let Ok(feed) = Arc::try_unwrap(feed) else {
                // A FETCH still has it: it closes when that one drops it.
                return;
            };
            if let Err(e) = feed.into_inner().consumer.close().await {
                tracing::debug!(%queue, error = %e, "closing an idle queue consumer failed");
            }
            tracing::debug!(%queue, "an idle queue consumer was closed");
        });
    }

    /// Closes the consumers no FETCH used for `[api] consumer_idle_timeout`
    /// (and that hold no delivery of an active job).
    pub(crate) async fn reap_feeds(&self) {
        let idle_for = self.settings.consumer_idle_timeout;
        let busy = self.queues_held();
        let mut feeds = self.workers().feeds.lock().await;
        let idle: Vec<String> = feeds
            .iter()
            .filter(|(q, _)| !busy.contains(q.as_str()))
            .filter(|(_, f)| f.try_lock().is_ok_and(|f| f.used.elapsed() >= idle_for))
            .map(|(q, _)| q.clone())
            .collect();
        for q in idle {
            if let Some(f) = feeds.remove(&q) {
                self.close_feed(q, f);
            }
        }
        self.workers()
            .consumers
            .store(feeds.len(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Consumers open for FETCH now.
    pub fn consumers(&self) -> usize {
        self.workers()
            .consumers
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Jobs workers hold through this process now, per queue.
    pub fn active_by_queue(&self) -> std::collections::BTreeMap<String, u64> {
        let held = self
            .workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut by_queue = std::collections::BTreeMap::new();
        for h in held.values() {
            *by_queue.entry(h.queue.clone()).or_default() += 1;
        }
        by_queue
    }

    /// FETCH: up to `count` jobs from the first queues that have them;
    /// waits up to `wait` when none has. The answer holds at most `[api]
    /// max_fetch_bytes` of jobs (by their size on the broker), and at
    /// least one job when one is there: the broker is asked for no more
    /// jobs than that holds of the queue's recent largest, and what came
    /// beyond it goes back to the broker.
    pub async fn fetch(&self, grant: &Grant<'_>, request: Fetch) -> Result<Vec<Job>, ApiError> {
        let jobs = self.fetch_jobs(grant, request).await?;
        count_by_queue(self.metrics(), &jobs, JobEvent::Fetched);
        Ok(jobs)
    }

    async fn fetch_jobs(&self, grant: &Grant<'_>, request: Fetch) -> Result<Vec<Job>, ApiError> {
        grant.allow(Operation::Work)?;
        for q in &request.queues {
            grant.allow_on(Operation::Work, q)?;
            if !self.serves_queue(q) {
                return Err(ApiError::QueueNotServed { queue: q.clone() });
            }
        }
        if self.is_draining() || self.in_maintenance() {
            return Ok(Vec::new());
        }
        // A worker told to be quiet or to terminate gets nothing more (it
        // learns why from its next heartbeat).
        if let Some(worker) = &request.worker_id {
            if self.told(worker) != crate::roster::Directive::Running {
                return Ok(Vec::new());
            }
        }
        // A paused queue's jobs stay on the broker.
        let open = self.unpaused(&request.queues).await;
        let began = Instant::now();
        let until = began + request.wait.min(MAX_FETCH_WAIT);
        // The same deadline on the service's clock: a job the broker got
        // after it was not there for this FETCH (see below).
        let deadline = self.now()
            + chrono::Duration::from_std(request.wait.min(MAX_FETCH_WAIT)).unwrap_or_default();
        let mut bytes = 0usize;
        let mut out = Vec::new();
        let mut limited_until: Option<DateTime<Utc>> = None;
        loop {
            // Registered before looking, so that a publish (or, while this
            // process holds all it may, a settlement) during this pass is
            // not missed.
            let published = self.workers().published.notified();
            let settled = self.workers().settled.notified();
            // What this process holds already counts against the answer,
            // and so does what concurrent FETCHes set aside while they take
            // what they received (not while they wait for it). A FETCH the
            // room bounds takes only jobs that fit; the first job of one
            // the FETCH's own bound limits may be larger, as always.
            let (max_bytes, strict) = self.held_room(self.settings.max_fetch_bytes);
            // This pass left jobs on the broker for want of room.
            let mut short = max_bytes == 0;
            for &queue in &open {
                if out.len() >= request.count || bytes >= max_bytes {
                    break;
                }
                let feed = self.feed(queue).await?;
                let mut feed = feed.lock().await;
                if strict && max_bytes.saturating_sub(bytes) < feed.largest {
                    // The queue's jobs are larger than what is left: they
                    // stay on the broker rather than going back and forth.
                    short = true;
                    continue;
                }
                let wait = if feed.fresh {
                    // The join is waited for apart from the receive: how
                    // long it takes says nothing about what is queued.
                    if !feed
                        .consumer
                        .ready(JOIN_LIMIT)
                        .await
                        .map_err(|source| ApiError::broker(queue, source))?
                    {
                        tracing::warn!(%queue, limit_s = JOIN_LIMIT.as_secs(), "the queue's consumer is not assigned anything yet; receiving anyway");
                    }
                    first_receive(self.adapter.kind()).max(receive_wait(
                        self.adapter.kind(),
                        began,
                        until,
                    ))
                } else {
                    receive_wait(self.adapter.kind(), began, until)
                };
                let planned = (max_bytes.saturating_sub(bytes) / feed.largest.max(1)).max(1);
                let deliveries = feed
                    .consumer
                    .receive((request.count - out.len()).min(planned), wait)
                    .await
                    .map_err(|source| ApiError::broker(queue, source))?;
                feed.fresh = false;
                feed.used = Instant::now();
                if let Some(biggest) = deliveries.iter().map(|d| d.payload.len()).max() {
                    feed.largest = biggest.max(feed.largest / 2).max(SMALLEST_PLANNED);
                }
                drop(feed);
                // Only a queue's first receive waits past the FETCH's own
                // deadline (a Kafka group join takes seconds), to find what
                // was on the broker when the FETCH came; a job published
                // after that deadline (a scheduled one coming due meanwhile)
                // goes back for the next FETCH instead of being handed out
                // to one that asked for what was available.
                let late = Instant::now() > until;
                // Set aside until the jobs taken are held.
                let room = self.reserve_held(self.settings.max_fetch_bytes.saturating_sub(bytes));
                let mut taken_bytes = 0usize;
                let mut taken = Vec::with_capacity(deliveries.len());
                for d in deliveries {
                    if late && enqueued_after(&d, deadline, self.settings.encoding) {
                        if let Err(e) = d.nack(Nack::Release).await {
                            tracing::debug!(%queue, error = %e, "giving back a job published after the FETCH's deadline failed; its lease runs out instead");
                        }
                        continue;
                    }
                    let size = d.payload.len();
                    if taken_bytes.saturating_add(size) <= room.bytes
                        || (!room.strict && out.is_empty() && taken.is_empty())
                    {
                        taken_bytes = taken_bytes.saturating_add(size);
                        bytes = bytes.saturating_add(size);
                        taken.push(d);
                    } else {
                        short |= room.strict;
                        if let Err(e) = d.nack(Nack::Release).await {
                            tracing::debug!(%queue, error = %e, "giving back a delivery beyond the FETCH's byte bound failed; its lease runs out instead");
                        }
                    }
                }
                let (jobs, limited) = self.activate_deliveries(queue, taken, &request).await?;
                drop(room);
                out.extend(jobs);
                if let Some(at) = limited {
                    limited_until = Some(limited_until.map_or(at, |u: DateTime<Utc>| u.min(at)));
                }
            }
            if !out.is_empty() || self.is_draining() || self.in_maintenance() {
                return Ok(out);
            }
            if Instant::now() >= until {
                if short {
                    return Err(ApiError::HeldLimit {
                        limit: self.settings.max_held_bytes,
                    });
                }
                return Ok(out);
            }
            // Jobs over their rate limit went back: the next look is when
            // the first window ends (or a job is published), not at once.
            let pause = limited_until
                .take()
                .and_then(|at| (at - self.now()).to_std().ok())
                .unwrap_or(Duration::from_millis(20))
                .max(Duration::from_millis(20))
                .min(until.saturating_duration_since(Instant::now()));
            tokio::select! {
                () = published => {}
                () = settled, if short => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Of `want` bytes, how many fit in what is left of `[api]
    /// max_held_bytes` after what this process holds and what other FETCHes
    /// set aside; and whether the room, not `want`, is the bound while
    /// something else is held (then only jobs that fit are taken: when
    /// nothing else is, any one job can run, larger than the bound too).
    fn held_room(&self, want: usize) -> (usize, bool) {
        let held = self
            .workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        room_of(&held, want, self.settings.max_held_bytes)
    }

    /// [`Api::held_room`], set aside until the returned room is dropped.
    fn reserve_held(&self, want: usize) -> HeldRoom<'_> {
        let lock = &self.workers().held;
        let mut held = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (bytes, strict) = room_of(&held, want, self.settings.max_held_bytes);
        held.reserved = held.reserved.saturating_add(bytes);
        HeldRoom {
            held: lock,
            bytes,
            strict,
        }
    }

    /// Bytes of messages this process holds for active jobs now.
    pub fn held_bytes(&self) -> usize {
        self.workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .bytes
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.workers()
            .draining
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Shutdown: FETCH hands out nothing more (a waiting one answers at
    /// once), and this waits until the workers have acknowledged or failed
    /// the jobs this process handed out, at most `[api] drain_timeout`. A job still
    /// held then goes back to the broker when the adapter closes and is
    /// handed out again (its late ACK is a conflict, or completes it
    /// twice: at-least-once). The live event streams say the server is
    /// stopping and end meanwhile (`crate::events`).
    pub async fn drain(&self) {
        self.workers()
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.workers().published.notify_waiters();
        tokio::join!(self.drain_workers(), self.streams_closed());
    }

    async fn drain_workers(&self) {
        let timeout = self.settings.drain_timeout;
        let until = Instant::now() + timeout;
        let mut said = false;
        loop {
            let held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|h| h.handed_out)
                .count();
            if held == 0 {
                self.settled_on_the_broker(until).await;
                return;
            }
            if !said {
                said = true;
                tracing::info!(
                    held,
                    timeout_ms = timeout.as_millis() as u64,
                    "shutdown: waiting for workers to settle the jobs this process handed out"
                );
            }
            if Instant::now() >= until {
                tracing::warn!(
                    held,
                    "shutdown: jobs still active go back to the broker and are handed out again"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the settlements running in the background are done, at
    /// most until `until` (a delivery not settled by then goes back to the
    /// broker when the adapter closes; the store says what its job is).
    async fn settled_on_the_broker(&self, until: Instant) {
        let settling = &self.workers().settling;
        // Acks lingering for company go now.
        settling
            .urgent
            .store(true, std::sync::atomic::Ordering::SeqCst);
        settling.flush_now.notify_waiters();
        loop {
            let finished = settling.finished.notified();
            if settling.running.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            if tokio::time::timeout_at(until.into(), finished)
                .await
                .is_err()
            {
                tracing::warn!(
                    running = settling.running.load(std::sync::atomic::Ordering::SeqCst),
                    "shutdown: deliveries still being settled go back to the broker"
                );
                return;
            }
        }
    }

    /// Makes the jobs of `deliveries` active (one store commit) and holds
    /// their deliveries.
    async fn activate_deliveries(
        &self,
        queue: &str,
        deliveries: Vec<Delivery>,
        request: &Fetch,
    ) -> Result<(Vec<Job>, Option<DateTime<Utc>>), ApiError> {
        let mut envelopes = Vec::with_capacity(deliveries.len());
        let mut kept = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            // A binary envelope's id is all a job the store holds needs
            // (the store's row is the job); the rest is decoded when the
            // store has no row of it.
            if let Some(id) = d.job_id(Some(self.settings.encoding)) {
                envelopes.push(Carried::Binary {
                    id: id.to_owned(),
                    payload: d.payload.clone(),
                });
                kept.push(d);
                continue;
            }
            match d.decode_job(Some(self.settings.encoding)) {
                Ok(e) => {
                    envelopes.push(Carried::Decoded(Box::new(e)));
                    kept.push(d);
                }
                Err(reason) => dead_letter_invalid(queue, &d, reason).await,
            }
        }
        if envelopes.is_empty() {
            return Ok((Vec::new(), None));
        }
        let now = self.now();
        let worker = request.worker_id.clone();
        let visibility = request.visibility;
        let replica = self.shared_replica();
        // Jobs whose delivery this process holds already: another copy of
        // one of them is not handed out. Jobs another FETCH of this process
        // is activating now: neither (two copies of a job, one published
        // again after a crash, can reach two FETCHes at once, and the store
        // says `available` to both until one commits).
        let claim = Claim::new(self.workers().activating.clone());
        let (mut active_here, elsewhere): (HashSet<String>, HashSet<String>) = {
            let held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let mut activating = claim.set.lock().unwrap_or_else(|e| e.into_inner());
            let mut mine = claim.ids.lock().unwrap_or_else(|e| e.into_inner());
            let mut active_here = HashSet::new();
            let mut elsewhere = HashSet::new();
            for e in &envelopes {
                let id = e.id();
                if held.contains_key(id) {
                    active_here.insert(id.to_owned());
                } else if mine.iter().any(|m| m == id) {
                    // A second copy in this FETCH: the first decides.
                } else if activating.insert(id.to_owned()) {
                    mine.push(id.to_owned());
                } else {
                    elsewhere.insert(id.to_owned());
                }
            }
            (active_here, elsewhere)
        };
        let queue_limits = self.queue_limits(queue);
        let decided = self
            .store
            .run(move |tx| {
                let starting = Starting {
                    worker: worker.as_deref(),
                    visibility,
                    now,
                    replica: replica.as_deref(),
                    queue_limits: queue_limits.as_ref(),
                };
                envelopes
                    .into_iter()
                    .map(|e| {
                        if elsewhere.contains(e.id()) {
                            return Ok(Activation::Duplicate);
                        }
                        activate_one(tx, e, &starting, &mut active_here)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .await;
        let decided = match decided {
            Ok(d) => d,
            Err(e) => {
                // The store did not answer: the jobs go back to the broker
                // at once (not after a lease), and the FETCH fails as
                // retryable.
                for delivery in kept {
                    if let Err(e) = delivery.nack(Nack::Release).await {
                        tracing::debug!(%queue, error = %e, "giving a delivery back failed; its lease runs out instead");
                    }
                }
                return Err(e.into());
            }
        };
        let mut out = Vec::new();
        let mut limited_until = None;
        let started = Instant::now();
        for (activation, delivery) in decided.into_iter().zip(kept) {
            match activation {
                Activation::Active(job, visibility) => {
                    let held = HeldDelivery {
                        delivery,
                        queue: queue.to_owned(),
                        worker_id: request.worker_id.clone(),
                        deadline: started + visibility,
                        visibility,
                        extended: started,
                        handed_out: true,
                        timeout: job_timeout(&job).map(|t| (started + t, t)),
                    };
                    self.workers()
                        .held
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(job.envelope.id.clone(), held);
                    out.push(*job);
                }
                Activation::Adopt(job, remaining) => {
                    let held = HeldDelivery {
                        delivery,
                        queue: queue.to_owned(),
                        worker_id: job
                            .extra
                            .get("worker_id")
                            .and_then(Value::as_str)
                            .map(str::to_owned),
                        deadline: started + remaining,
                        visibility: remaining,
                        extended: started,
                        handed_out: false,
                        // Its timeout is enforced by the replica that
                        // handed it out; an adopted job only waits.
                        timeout: None,
                    };
                    tracing::debug!(job_id = %job.envelope.id, "a redelivered job still active through another replica is held until its visibility passes");
                    self.workers()
                        .held
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(job.envelope.id.clone(), held);
                }
                Activation::Settle => {
                    if let Err(e) = delivery.ack().await {
                        tracing::warn!(%queue, error = %e, "acking the broker copy of a finished job failed; it comes back and is settled again");
                    }
                }
                Activation::Duplicate => {
                    tracing::debug!(%queue, "a second copy of a job active here is acked, not handed out");
                    if let Err(e) = delivery.ack().await {
                        tracing::debug!(%queue, error = %e, "acking a second copy of an active job failed; it comes back and is looked at again");
                    }
                }
                Activation::Invalid(reason) => dead_letter_invalid(queue, &delivery, reason).await,
                Activation::Limited(until) => {
                    if let Err(e) = delivery.nack(Nack::Release).await {
                        tracing::debug!(%queue, error = %e, "giving back a job over its rate limit failed; its lease runs out instead");
                    }
                    limited_until =
                        Some(limited_until.map_or(until, |u: DateTime<Utc>| u.min(until)));
                }
            }
        }
        Ok((out, limited_until))
    }

    fn take_held(&self, id: &str) -> Option<HeldDelivery> {
        self.workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
    }

    fn put_back(&self, id: String, held: HeldDelivery) {
        self.workers()
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, held);
    }

    async fn check_scope(&self, grant: &Grant<'_>, id: &str) -> Result<(), ApiError> {
        grant.allow(Operation::Work)?;
        if !grant.scope().is_empty() {
            let held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(id)
                .map(|h| h.queue.clone());
            let queue = match held {
                Some(q) => q,
                None => self.info(&Grant::open(), id).await?.envelope.queue,
            };
            grant.allow_job(Operation::Work, &queue, id)?;
        }
        Ok(())
    }

    /// ACK: the active job is completed with `result`; its delivery is
    /// acked.
    pub async fn ack(
        &self,
        grant: &Grant<'_>,
        id: &str,
        result: Option<Value>,
    ) -> Result<Job, ApiError> {
        self.check_scope(grant, id).await?;
        // A result the job cannot carry is the request's fault (400), and
        // the job stays active for a valid ACK or NACK.
        if let Some(r) = &result {
            ojs_core::envelope::value::check_json_value("result", r)
                .map_err(crate::job::invalid_envelope)?;
        }
        let held = self.take_held(id);
        let now = self.now();
        let job_id = id.to_owned();
        let remote = self.remote(held.is_some());
        // Checks first: the job is loaded and its completion decided
        // before anything is written, so no savepoint is needed.
        let done = self
            .store
            .run_checks_first(move |tx| {
                let holder = remote_holder(tx, &job_id, remote.as_deref())?;
                let job = complete(tx, &job_id, result, now)?;
                if let Some(holder) = holder {
                    tx.send_settle(&holder, &job_id, &Settle::Ack)?;
                }
                Ok(job)
            })
            .await
            .map_err(|e| store_error(e, "ack", "active"));
        match done {
            Ok(job) => {
                self.metrics().jobs(&job.envelope.queue, JobEvent::Acked, 1);
                if let Some(held) = held {
                    self.settle_in_background(id.to_owned(), held, Settle::Ack);
                }
                self.workers().settled.notify_waiters();
                Ok(job)
            }
            Err(e) => {
                if let Some(held) = held {
                    self.put_back(id.to_owned(), held);
                }
                Err(e)
            }
        }
    }

    /// NACK: the job's retry policy decides — retryable (the adapter's
    /// delayed retry), discarded (dead-lettered or dropped), or back to
    /// available when `requeue` is asked.
    pub async fn nack(&self, grant: &Grant<'_>, failure: Failure) -> Result<Job, ApiError> {
        let id = failure.job_id.clone();
        self.check_scope(grant, &id).await?;
        let held = self.take_held(&id);
        let now = self.now();
        let remote = self.remote(held.is_some());
        let exhausted = self.settings.on_exhaustion;
        let decided = self
            .store
            .run(move |tx| {
                let holder = remote_holder(tx, &failure.job_id, remote.as_deref())?;
                let (job, decision) = fail(tx, &failure, now, exhausted)?;
                if let Some(holder) = holder {
                    tx.send_settle(&holder, &failure.job_id, &decision)?;
                }
                Ok((job, decision))
            })
            .await
            .map_err(|e| store_error(e, "nack", "active"));
        let (job, decision) = match decided {
            Ok(d) => d,
            Err(e) => {
                if let Some(held) = held {
                    self.put_back(id, held);
                }
                return Err(e);
            }
        };
        let metrics = self.metrics();
        let queue = &job.envelope.queue;
        metrics.jobs(queue, JobEvent::Nacked, 1);
        match job.state() {
            JobState::Retryable => metrics.jobs(queue, JobEvent::Retried, 1),
            JobState::Discarded if job.is_dead_letter() => {
                metrics.jobs(queue, JobEvent::DeadLettered, 1);
            }
            JobState::Discarded => metrics.jobs(queue, JobEvent::Discarded, 1),
            _ => {}
        }
        if let Some(held) = held {
            self.settle_in_background(id, held, decision);
        }
        self.workers().settled.notify_waiters();
        Ok(job)
    }

    /// Settles a held delivery on the broker after its job's transition
    /// committed, without holding the worker's request: the store already
    /// says what the job is (a delivery the broker gives back because this
    /// process stopped first is found finished or failed there), and a
    /// settlement can take long — RabbitMQ with `topology = "existing"`
    /// has no delay queues and holds a retried delivery for its backoff.
    fn settle_in_background(&self, id: String, held: HeldDelivery, settle: Settle) {
        let settling = self.workers().settling.clone();
        settling
            .running
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if matches!(settle, Settle::Ack | Settle::Drop) {
            let start = {
                let mut acks = settling.acks();
                acks.waiting.push((id, held));
                !std::mem::replace(&mut acks.flushing, true)
            };
            if start {
                tokio::spawn(flush_acks(settling, self.settings.ack_linger));
            }
            return;
        }
        tokio::spawn(async move {
            if let Err(e) = settle_delivery(&held.delivery, &settle).await {
                tracing::warn!(job_id = %id, error = %e, "settling a delivery on the broker failed; the broker gives it back and the job store settles it then");
            }
            drop(held);
            settling.done(1);
        });
    }

    /// Heartbeat: the worker's active jobs (those named, else all it
    /// holds) stay its for `visibility` more.
    pub async fn heartbeat(
        &self,
        grant: &Grant<'_>,
        worker_id: &str,
        jobs: Option<Vec<String>>,
        visibility: Option<Duration>,
    ) -> Result<Vec<String>, ApiError> {
        grant.allow(Operation::Work)?;
        let now = Instant::now();
        let mut extended = Vec::new();
        // Each job extended here, and by how much (its own visibility when
        // the heartbeat names none).
        let mut extended_by: Vec<(String, Duration)> = Vec::new();
        let mut leases = Vec::new();
        {
            let mut held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for (id, h) in held.iter_mut() {
                let named = match &jobs {
                    Some(list) => list.iter().any(|j| j == id),
                    None => h.worker_id.as_deref() == Some(worker_id),
                };
                if !named || !grant.sees(&h.queue) {
                    continue;
                }
                let by = visibility.unwrap_or(h.visibility);
                h.deadline = now + by;
                extended.push(id.clone());
                extended_by.push((id.clone(), by));
                if by > self.settings.visibility_timeout / 2 {
                    leases.push(id.clone());
                }
            }
        }
        for id in leases {
            self.extend_lease(&id).await;
        }
        if let Some(me) = self.shared_replica() {
            // Where replicas share the store, its lease is what another
            // replica goes by: extend it there, and pass the heartbeat of
            // a job held elsewhere to its holder.
            let here = extended_by;
            let remote: Vec<String> = jobs
                .unwrap_or_default()
                .into_iter()
                .filter(|j| !extended.contains(j))
                .collect();
            let now = self.clock.now();
            let by = visibility;
            let scope: Vec<ojs_core::glob::Glob> = grant.scope().to_vec();
            let more = self
                .store
                .run(move |tx| {
                    let mut more = Vec::new();
                    for (id, by) in here {
                        tx.set_lease(
                            &id,
                            Some(&Lease {
                                holder: me.clone(),
                                until: now + by,
                            }),
                        )?;
                    }
                    for id in remote {
                        let job = match tx.load(&id) {
                            Ok(job) if job.state() == JobState::Active => job,
                            Ok(_) | Err(StoreError::NotFound(_)) => continue,
                            Err(e) => return Err(e),
                        };
                        if !(scope.is_empty()
                            || scope.iter().any(|g| g.matches(&job.envelope.queue)))
                        {
                            continue;
                        }
                        let Some(lease) = tx.lease(&id)? else {
                            continue;
                        };
                        let by = by.unwrap_or_else(|| job_visibility(&job));
                        tx.set_lease(
                            &id,
                            Some(&Lease {
                                holder: lease.holder.clone(),
                                until: now + by,
                            }),
                        )?;
                        tx.send_settle(
                            &lease.holder,
                            &id,
                            &Settle::Extend {
                                by_ms: by.as_millis() as u64,
                            },
                        )?;
                        more.push(id);
                    }
                    Ok(more)
                })
                .await?;
            extended.extend(more);
        }
        extended.sort();
        Ok(extended)
    }

    /// A job that ran longer than its execution timeout fails as the
    /// worker's failure of type `timeout` would: its retry policy decides,
    /// the delivery is settled so, a later ACK of it is a conflict.
    async fn time_out(&self, id: String, mut held: HeldDelivery) {
        let Some((_, limit)) = held.timeout.take() else {
            return;
        };
        let mut error = Map::new();
        error.insert("code".into(), json!("timeout"));
        error.insert("type".into(), json!("timeout"));
        error.insert(
            "message".into(),
            json!(format!(
                "the job ran longer than its execution timeout of {} ms",
                limit.as_millis()
            )),
        );
        error.insert("retryable".into(), json!(true));
        let failure = Failure {
            job_id: id.clone(),
            error,
            requeue: false,
        };
        let now = self.now();
        let exhausted = self.settings.on_exhaustion;
        match self
            .store
            .run(move |tx| fail(tx, &failure, now, exhausted))
            .await
        {
            Ok((_, decision)) => {
                tracing::info!(job_id = %id, timeout_ms = limit.as_millis() as u64, "a job ran past its execution timeout and failed");
                if let Err(e) = settle_delivery(&held.delivery, &decision).await {
                    tracing::warn!(job_id = %id, error = %e, "settling a timed-out job's delivery failed; the broker gives it back");
                }
            }
            // Settled meanwhile (or moved by another replica): the
            // visibility reaping decides what becomes of the delivery.
            Err(StoreError::WrongState { .. } | StoreError::NotFound(_)) => {
                self.put_back(id, held);
            }
            Err(e) => {
                tracing::warn!(job_id = %id, error = %e, "failing a timed-out job in the store failed; tried again");
                held.timeout = Some((Instant::now() + Duration::from_secs(1), limit));
                self.put_back(id, held);
            }
        }
    }

    async fn extend_lease(&self, id: &str) {
        let Some(mut held) = self.take_held(id) else {
            return;
        };
        if let Err(e) = held.delivery.extend(self.settings.visibility_timeout).await {
            tracing::debug!(job_id = %id, error = %e, "extending a held delivery's lease failed");
        }
        held.extended = Instant::now();
        self.put_back(id.to_owned(), held);
    }

    /// Releases jobs whose visibility passed (the broker delivers them
    /// again) and extends the broker's lease of those still held.
    pub(crate) async fn reap(&self) {
        let now = Instant::now();
        let (timed_out, expired, renew): (HeldDeliveries, HeldDeliveries, Vec<String>) = {
            let mut held = self
                .workers()
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let over: Vec<String> = held
                .iter()
                .filter(|(_, h)| h.timeout.is_some_and(|(at, _)| at <= now))
                .map(|(id, _)| id.clone())
                .collect();
            let timed_out = over
                .into_iter()
                .filter_map(|id| held.remove(&id).map(|h| (id, h)))
                .collect();
            let ids: Vec<String> = held
                .iter()
                .filter(|(_, h)| h.deadline <= now)
                .map(|(id, _)| id.clone())
                .collect();
            let expired = ids
                .into_iter()
                .filter_map(|id| held.remove(&id).map(|h| (id, h)))
                .collect();
            let renew = held
                .iter()
                .filter(|(_, h)| {
                    now.duration_since(h.extended) >= self.settings.visibility_timeout / 3
                })
                .map(|(id, _)| id.clone())
                .collect();
            (timed_out, expired, renew)
        };
        for id in renew {
            self.extend_lease(&id).await;
        }
        for (id, held) in timed_out {
            self.time_out(id, held).await;
        }
        for (id, mut held) in expired {
            let at = self.now();
            let job_id = id.clone();
            let replica = self.shared_replica();
            match self
                .store
                .run(move |tx| release(tx, &job_id, at, replica.as_deref()))
                .await
            {
                Ok(Expiry::Released | Expiry::Waiting) => {
                    if let Err(e) = held.delivery.nack(Nack::requeue()).await {
                        tracing::warn!(job_id = %id, error = %e, "giving an expired job back to the broker failed; its lease runs out instead");
                    }
                }
                Ok(Expiry::Gone) => {
                    if let Err(e) = held.delivery.ack().await {
                        tracing::debug!(job_id = %id, error = %e, "acking the copy of a job settled elsewhere failed");
                    }
                }
                Ok(Expiry::Extended(until)) => {
                    let left = (until - at).to_std().unwrap_or_default();
                    held.deadline = Instant::now() + left;
                    self.put_back(id, held);
                }
                Err(e) => {
                    tracing::warn!(job_id = %id, error = %e, "releasing an expired job failed; tried again");
                    self.put_back(id, held);
                }
            }
        }
    }
}

/// What the starts of one FETCH share.
#[derive(Debug, Clone, Copy)]
struct Starting<'a> {
    /// The worker that asked.
    worker: Option<&'a str>,
    /// The visibility it asked for.
    visibility: Option<Duration>,
    now: DateTime<Utc>,
    /// This replica, where replicas share the store.
    replica: Option<&'a str>,
    /// The limits of the queue's configuration.
    queue_limits: Option<&'a Limits>,
}

/// FETCH of one envelope: available, retryable or (redelivered after a
/// restart) active jobs become active; a job the store has not seen (put
/// on the broker by another producer) is stored first.
fn activate_one(
    tx: &mut dyn Tx,
    carried: Carried,
    starting: &Starting<'_>,
    active_here: &mut HashSet<String>,
) -> Result<Activation, StoreError> {
    let Starting {
        worker,
        visibility,
        now,
        replica,
        queue_limits,
    } = *starting;
    let envelope_id = carried.id().to_owned();
    let mut job = match tx.load(&envelope_id) {
        Ok(job) => job,
        Err(StoreError::NotFound(_)) => {
            let mut e = match carried.envelope() {
                Ok(e) => e,
                Err(reason) => return Ok(Activation::Invalid(reason)),
            };
            e.state = Some(JobState::Available);
            e.created_at.get_or_insert(now);
            e.enqueued_at.get_or_insert(now);
            let job = Job {
                envelope: e,
                extra: Map::new(),
            };
            tx.insert_seen(&job)?;
            job
        }
        Err(e) => return Err(e),
    };
    match job.state() {
        // Active through a delivery this process holds (or one activated
        // earlier in this FETCH): this copy is a duplicate.
        JobState::Active if active_here.contains(&job.envelope.id) => {
            return Ok(Activation::Duplicate)
        }
        JobState::Active => {
            // Where replicas share the store, a job whose lease is still
            // running is its worker's: the delivery came back because the
            // replica that held it stopped.
            if let Some(me) = replica {
                if let Some(lease) = tx.lease(&job.envelope.id)? {
                    if lease.until > now {
                        let remaining = (lease.until - now).to_std().unwrap_or_default();
                        tx.set_lease(
                            &job.envelope.id,
                            Some(&Lease {
                                holder: me.to_owned(),
                                until: lease.until,
                            }),
                        )?;
                        return Ok(Activation::Adopt(Box::new(job), remaining));
                    }
                }
            }
        }
        // A dead letter moved back to its queue on the broker (its
        // tooling, `ojs-bridge dead-letters retry`): retried, as through
        // the API — from attempt 0.
        JobState::Discarded if job.is_dead_letter() => {
            let revived =
                apply(job, Command::Revive, now).map_err(|r| wrong_state(&envelope_id, r))?;
            record(tx, &revived, now)?;
            job = revived.job;
        }
        // Delivered by the scheduler before its promotion committed: the
        // broker's copy says when it was enqueued.
        JobState::Scheduled => {
            let delivered = carried.envelope().ok().and_then(|e| e.enqueued_at);
            job.envelope.enqueued_at = delivered.or(Some(now));
        }
        _ => {}
    }
    // Past its `expires_at`: discarded, never handed out.
    if model::is_expired(&job, now) && model::allows(job.state(), &Command::Expire) {
        let expired = apply(job, Command::Expire, now).map_err(|r| wrong_state(&envelope_id, r))?;
        record(tx, &expired, now)?;
        return Ok(Activation::Settle);
    }
    let visibility = visibility.unwrap_or_else(|| job_visibility(&job));
    // A start of each rate-limit key the job falls under (its own, its
    // queue's) is admitted in this transaction, so that of concurrent
    // FETCHes (also through other replicas) no more than the limits start.
    let mut filed: Option<Vec<String>> = None;
    if model::allows(job.state(), &Command::Start { worker }) {
        let own = RateLimit::of(&job.envelope).ok().flatten();
        let limits = rate::limits_of(own, queue_limits.map(|l| (job.envelope.queue.as_str(), l)));
        if !limits.is_empty() {
            // Delivered again while the store says active (its process
            // died holding it): that run is over and holds no place.
            if job.state() == JobState::Active && job.extra.contains_key(RATE_FILED) {
                tx.unfile_rate_job(&envelope_id)?;
            }
            match take_rate(tx, &job, &limits, now)? {
                RateDecision::Started => {
                    filed = Some(limits.into_iter().map(|l| l.key).collect());
                }
                RateDecision::Limited {
                    until,
                    key,
                    on_limit,
                } => {
                    let until = match on_limit {
                        OnLimit::Wait => {
                            let keys: Vec<String> = limits.into_iter().map(|l| l.key).collect();
                            tx.file_rate_job(&envelope_id, &keys, RATE_WAITING)?;
                            // Marked, so that its next transition unfiles it.
                            if !job.extra.contains_key(RATE_FILED) {
                                job.extra.insert(RATE_FILED.into(), json!(keys));
                                tx.save(&job, None)?;
                            }
                            return Ok(Activation::Limited(until));
                        }
                        OnLimit::Reschedule => Some(until),
                        OnLimit::Drop => None,
                    };
                    let t = apply(job, Command::Limit { key: &key, until }, now)
                        .map_err(|r| wrong_state(&envelope_id, r))?;
                    record(tx, &t, now)?;
                    return Ok(Activation::Settle);
                }
            }
        }
    }
    if let Some(keys) = &filed {
        job.extra.insert(RATE_FILED.into(), json!(keys));
    }
    // Finished or cancelled: the broker's copy is settled, nothing handed out.
    let started = match apply(job, Command::Start { worker }, now) {
        Ok(t) => t,
        Err(_) => return Ok(Activation::Settle),
    };
    record(tx, &started, now)?;
    if let Some(me) = replica {
        tx.set_lease(
            &envelope_id,
            Some(&Lease {
                holder: me.to_owned(),
                until: now + visibility,
            }),
        )?;
    }
    active_here.insert(envelope_id);
    Ok(Activation::Active(Box::new(started.job), visibility))
}

/// How long a job stays its worker's without a heartbeat when the FETCH
/// did not say: its own `visibility_timeout_ms`, else 30 s.
/// The job's execution timeout: `timeout_ms` as the binding sends it,
/// else the core's `timeout` in seconds; `None` when the job names none
/// (a default would fail long jobs whose workers heartbeat as asked).
fn job_timeout(job: &Job) -> Option<Duration> {
    job.envelope
        .unknown_attributes
        .get("timeout_ms")
        .and_then(Value::as_u64)
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
        .or_else(|| {
            u64::try_from(job.envelope.timeout)
                .ok()
                .filter(|s| *s > 0)
                .map(Duration::from_secs)
        })
        // Jobs other producers put on the broker are held to the bound
        // pushes are validated against.
        .map(|t| t.min(crate::limits::MAX_EXECUTION_TIMEOUT))
}

fn job_visibility(job: &Job) -> Duration {
    job.envelope
        .unknown_attributes
        .get("visibility_timeout_ms")
        .and_then(Value::as_u64)
        .filter(|ms| *ms > 0)
        .map_or(DEFAULT_VISIBILITY, Duration::from_millis)
        .min(crate::limits::MAX_VISIBILITY)
}

/// Locks the job and names the replica holding its delivery when that is
/// another one (`me` is set only where that can be).
fn remote_holder(
    tx: &mut dyn Tx,
    id: &str,
    me: Option<&str>,
) -> Result<Option<String>, StoreError> {
    let Some(me) = me else {
        return Ok(None);
    };
    tx.load(id)?;
    Ok(tx.lease(id)?.map(|l| l.holder).filter(|h| h != me))
}

fn complete(
    tx: &mut dyn Tx,
    id: &str,
    result: Option<Value>,
    now: DateTime<Utc>,
) -> Result<Job, StoreError> {
    let t =
        apply(tx.load(id)?, Command::Complete { result }, now).map_err(|r| wrong_state(id, r))?;
    record(tx, &t, now)?;
    Ok(t.job)
}

fn fail(
    tx: &mut dyn Tx,
    failure: &Failure,
    now: DateTime<Utc>,
    exhausted: crate::Exhaustion,
) -> Result<(Job, Settle), StoreError> {
    let id = &failure.job_id;
    let failed = model::Failed::read(&failure.error);
    let command = Command::Fail {
        failed: &failed,
        requeue: failure.requeue,
        exhausted,
        jitter: model::clock_jitter(),
    };
    let t = apply(tx.load(id)?, command, now).map_err(|r| wrong_state(id, r))?;
    record(tx, &t, now)?;
    // A failure always says what becomes of the delivery.
    let settle = t.settle.unwrap_or(Settle::Requeue);
    Ok((t.job, settle))
}

/// A job whose visibility passed goes back to available (the broker
/// delivers it again).
fn release(
    tx: &mut dyn Tx,
    id: &str,
    now: DateTime<Utc>,
    replica: Option<&str>,
) -> Result<Expiry, StoreError> {
    let job = match tx.load(id) {
        Ok(job) => job,
        Err(StoreError::NotFound(_)) => return Ok(Expiry::Gone),
        Err(e) => return Err(e),
    };
    match job.state() {
        JobState::Active => {}
        JobState::Available | JobState::Retryable | JobState::Scheduled => {
            return Ok(Expiry::Waiting)
        }
        _ => return Ok(Expiry::Gone),
    }
    if let Some(me) = replica {
        match tx.lease(id)? {
            Some(lease) if lease.holder != me => return Ok(Expiry::Gone),
            Some(lease) if lease.until > now => return Ok(Expiry::Extended(lease.until)),
            _ => {}
        }
    }
    let t = apply(job, Command::TimeOut, now).map_err(|r| wrong_state(id, r))?;
    record(tx, &t, now)?;
    Ok(Expiry::Released)
}

/// Counts `jobs` under `event`, per queue (one lock per queue, not per job).
pub(crate) fn count_by_queue<'a>(
    metrics: &crate::metrics::ApiMetrics,
    jobs: impl IntoIterator<Item = &'a Job>,
    event: JobEvent,
) {
    let mut by_queue: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for job in jobs {
        *by_queue.entry(job.envelope.queue.as_str()).or_default() += 1;
    }
    for (queue, n) in by_queue {
        metrics.jobs(queue, event, n);
    }
}
