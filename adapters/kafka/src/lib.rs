//! Kafka adapter (rdkafka) following docs/design.md §4 "Kafka".
//!
//! Delivery semantics: at least once.
//! * Topics: `ojs.queue.{queue}`, retries and scheduled jobs in
//!   `ojs.queue.{queue}.retry`, dead letters in `ojs.dead.{queue}` (templates
//!   configurable), created on first use with the admin client.
//! * Records: key = ordering key (meta `partition_key`, else the job id);
//!   headers `content-type`, `ojs-specversion`, `ojs-id`, `ojs-type`,
//!   `ojs-queue`, `ojs-attempt`, `traceparent`/`tracestate`.
//! * Publish: idempotent producer, `acks=all`; resolves on the delivery
//!   reports and reports failures per message.
//! * Consume: consumer groups with `enable.auto.commit=false` and
//!   `enable.auto.offset.store=false`. Only the **contiguous prefix** of
//!   settled offsets is committed per partition: an unsettled offset N is
//!   never skipped because N+1 was acked. Commits are made in the background
//!   every `commit_interval_ms` when the prefix advanced, on close, and,
//!   synchronously, when partitions are revoked.
//! * Nack: a copy goes to the retry topic (attempt counted up, `ojs-not-before`
//!   set) or the dead topic (reason in `ojs-error-type`/`ojs-error-message`);
//!   the original offset is settled only after the copy's delivery report.
//!   Retry records are held until due (still uncommitted, so a crash
//!   replays them) and never handed out early; if too many are held, the
//!   retry partitions are paused until the backlog drains.
//!
//!
//! Kafka caveat: group rebalances wait for every member to poll. A consumer
//! that is kept open but not `receive`d from stalls its group (up to
//! librdkafka's `max.poll.interval.ms`); close consumers you stop using.
//!
//! ```no_run
//! # async fn demo() -> ojs_core::Result<()> {
//! use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
//! use ojs_core::{OutgoingMessage, QueueAdapter};
//! let adapter = KafkaAdapter::connect(KafkaConfig::from_url("kafka://127.0.0.1:9092")?).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

mod config;
mod record_headers;
mod reports;
mod tracker;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use ojs_core::adapter::{admit, publish_outcome};
use ojs_core::log_limit::LogLimiter;
use ojs_core::{
    header, Acknowledger, BrokerErrorKind, Consumer, ConsumerOptions, DeadLetterReason, Delivery,
    DeliveryRef, Error, FailedPublish, HeaderName, Headers, Health, Nack, OutgoingMessage,
    QueueAdapter, Result, Source,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseRecord, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::time::Instant;

pub use config::KafkaConfig;
pub use ojs_core::settings::Topology;
use record_headers::RecordHeaders;
use reports::Reports;
use tracker::{Stale, Tp, Tracker};

/// The adapter's producer: librdkafka's polling thread counts delivery
/// reports into the publishes they belong to ([`reports`]).
type Producer = ThreadedProducer<Reports>;

/// How long a record waits before it is offered again to a full local
/// queue (librdkafka's `queue.buffering.max.*`).
const QUEUE_FULL_WAIT: Duration = Duration::from_millis(10);

/// Header with the earliest delivery time (Unix ms) of a retry record.
pub const NOT_BEFORE_HEADER: &str = "ojs-not-before";

fn kafka_error(e: &KafkaError) -> Error {
    let retryable = !matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessage)
    );
    Error::broker("kafka", e.to_string(), retryable)
        .with_broker_kind(broker_kind(e.rdkafka_error_code()))
        .with_source(e.clone())
}

/// The kind of a librdkafka error code.
fn broker_kind(code: Option<RDKafkaErrorCode>) -> BrokerErrorKind {
    use RDKafkaErrorCode as C;
    match code {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            BrokerErrorKind::NotFound
        }
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SaslAuthenticationFailed
            | C::Authentication,
        ) => BrokerErrorKind::AccessDenied,
        Some(C::TopicAlreadyExists) => BrokerErrorKind::Conflict,
        Some(
            C::MessageSizeTooLarge | C::InvalidMessage | C::InvalidMessageSize | C::InvalidRecord,
        ) => BrokerErrorKind::Rejected,
        Some(
            C::QueueFull
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::BrokerNotAvailable
            | C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::RequestTimedOut
            | C::MessageTimedOut
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::NotCoordinator
            | C::CoordinatorNotAvailable
            | C::CoordinatorLoadInProgress
            | C::ThrottlingQuotaExceeded,
        ) => BrokerErrorKind::Unavailable,
        _ => BrokerErrorKind::Other,
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.brokers);
    if config.topology == Topology::Existing {
        // Not even a metadata request may create a topic.
        c.set("allow.auto.create.topics", "false");
    }
    c
}

/// Our librdkafka options, then the user's (they win), then the SASL
/// password from `sasl_password_file`.
fn apply_overrides(c: &mut ClientConfig, config: &KafkaConfig) -> Result<()> {
    for (k, v) in &config.librdkafka_options {
        c.set(k, v);
    }
    if let Some(path) = &config.sasl_password_file {
        let password = std::fs::read_to_string(path).map_err(|e| Error::InvalidConfig {
            field: "sasl_password_file".into(),
            reason: format!("cannot read {}: {e}", path.display()),
        })?;
        c.set("sasl.password", password.trim_end_matches(['\r', '\n']));
    }
    Ok(())
}

struct Inner {
    config: KafkaConfig,
    /// Replaced when it fails fatally (see `produce`).
    producer: std::sync::RwLock<Arc<Producer>>,
    admin: AdminClient<DefaultClientContext>,
    /// Topics known to exist (created or found).
    topics: Mutex<HashSet<String>>,
    /// `topology = "existing"`: each queue's lanes as found on the broker.
    resolved: Mutex<HashMap<String, Lanes>>,
    closed: AtomicBool,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaInner")
            .field("brokers", &self.config.brokers)
            .finish_non_exhaustive()
    }
}

/// The topic of each [`Lane`] of a queue; `None` where the broker has none
/// (only with `topology = "existing"`).
type Lanes = [Option<String>; 3];

/// Which of a queue's three topics a record goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Queue = 0,
    Retry = 1,
    Dead = 2,
}

impl Inner {
    /// The queue's topics, indexed by [`Lane`].
    fn topic_names(&self, queue: &str) -> [String; 3] {
        [
            self.config.topic_of(queue),
            self.config.retry_topic_of(queue),
            self.config.dead_topic_of(queue),
        ]
    }

    /// The topics a queue's records go to: with `declare` its three topics,
    /// created when missing; with `existing` those the broker has — the
    /// queue topic must exist (an error names it otherwise), retries go
    /// back to the queue topic when there is no retry topic, and a missing
    /// dead topic is `None`.
    async fn lanes(&self, queue: &str) -> Result<Lanes> {
        if self.config.topology == Topology::Declare {
            self.ensure_topics(queue).await?;
            return Ok(self.topic_names(queue).map(Some));
        }
        if let Some(l) = self
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(l.clone());
        }
        let [main, retry, dead] = self.topic_names(queue);
        let mut found = Vec::new();
        for topic in [&main, &retry, &dead] {
            found.push(self.topic_exists(topic).await?);
        }
        if !found[0] {
            return Err(Error::broker(
                "kafka",
                format!("topic {main:?} does not exist (topology = \"existing\" creates nothing; create it, or use topology = \"declare\")"),
                true,
            )
.with_broker_kind(BrokerErrorKind::NotFound));
        }
        if !found[1] {
            tracing::info!(queue, topic = %main, "no retry topic; delayed retries go back to the queue topic");
        }
        let lanes = [
            Some(main.clone()),
            Some(if found[1] { retry } else { main }),
            found[2].then_some(dead),
        ];
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), lanes.clone());
        Ok(lanes)
    }

    /// Whether the broker has `topic` (a metadata request for it alone;
    /// auto-creation is off with `topology = "existing"`).
    async fn topic_exists(&self, topic: &str) -> Result<bool> {
        let producer = self.producer();
        let name = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            use rdkafka::producer::Producer as _;
            let md = producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
                .map_err(|e| kafka_error(&e))?;
            Ok(md
                .topics()
                .iter()
                .any(|t| t.name() == name && t.error().is_none() && !t.partitions().is_empty()))
        })
        .await
        .map_err(|e| Error::broker("kafka", e.to_string(), true))?
    }

    /// Creates the queue's three topics if this process has not seen them.
    async fn ensure_topics(&self, queue: &str) -> Result<()> {
        let names = self.topic_names(queue);
        let missing: Vec<&String> = {
            let known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
            names.iter().filter(|n| !known.contains(*n)).collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let new: Vec<NewTopic<'_>> = missing
            .iter()
            .map(|n| {
                NewTopic::new(
                    n,
                    self.config.partitions,
                    TopicReplication::Fixed(self.config.replication),
                )
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self
            .admin
            .create_topics(new.iter(), &opts)
            .await
            .map_err(|e| kafka_error(&e))?;
        for r in results {
            match r {
                // An existing topic is used with the settings it has.
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code @ RDKafkaErrorCode::TopicAuthorizationFailed))
                | Err((name, code @ RDKafkaErrorCode::ClusterAuthorizationFailed)) => {
                    // No CreateTopics ACL: a topic created by someone else
                    // still works.
                    if !self.topic_exists(&name).await? {
                        return Err(Error::broker(
                            "kafka",
                            format!("creating topic {name}: {code} (the principal may not create topics; create it beforehand and set topology = \"existing\")"),
                            // The cluster's ACLs, not the message, are at fault.
                            true,
                        ));
                    }
                }
                Err((name, code)) => {
                    return Err(Error::broker(
                        "kafka",
                        format!("creating topic {name}: {code}"),
                        true,
                    ));
                }
            }
        }
        let mut known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        known.extend(names);
        Ok(())
    }

    fn producer(&self) -> Arc<Producer> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Swaps in a new producer unless someone already replaced `broken`.
    fn rebuild_producer(&self, broken: &Arc<Producer>) -> Result<()> {
        let fresh = Arc::new(make_producer(&self.config)?);
        let mut slot = self.producer.write().unwrap_or_else(|e| e.into_inner());
        if Arc::ptr_eq(&slot, broken) {
            *slot = fresh;
        }
        Ok(())
    }

    fn forget_topics(&self, queue: &str) {
        let mut known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        for t in self.topic_names(queue) {
            known.remove(&t);
        }
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
    }

    /// Hands `records` to librdkafka in order and waits for every report;
    /// returns the records that failed, by their index in `records`. A
    /// record a full local queue refuses is offered again, and the ones
    /// after it wait with it, until the publish timeout.
    async fn enqueue_and_wait(
        &self,
        producer: &Producer,
        topics: &Lanes,
        records: &[(usize, Lane, OutgoingMessage)],
    ) -> Vec<(usize, KafkaError)> {
        use rdkafka::producer::Producer as _;
        let mut pending = producer.client().context().open(records.len());
        let deadline = Instant::now() + self.config.publish_timeout();
        for (index, (_, lane, m)) in records.iter().enumerate() {
            let Some(topic) = &topics[*lane as usize] else {
                pending.not_enqueued(
                    index,
                    KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopic),
                );
                continue;
            };
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k.as_str(),
                    value: Some(v.as_bytes()),
                });
            }
            let mut record: BaseRecord<'_, [u8], [u8], usize> =
                BaseRecord::with_opaque_to(topic, pending.opaque(index))
                    .payload(m.payload.as_ref())
                    .headers(headers);
            if let Some(key) = &m.key {
                record = record.key(&key[..]);
            }
            loop {
                match producer.send(record) {
                    Ok(()) => {
                        pending.enqueued();
                        break;
                    }
                    Err((e, back))
                        if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                            && Instant::now() < deadline =>
                    {
                        record = back;
                        tokio::time::sleep(QUEUE_FULL_WAIT).await;
                    }
                    Err((e, _)) => {
                        pending.not_enqueued(index, e);
                        break;
                    }
                }
            }
        }
        pending.await
    }

    /// Produces each message to its lane's topic and waits for every
    /// delivery report. Topic names are rendered once per call, not per
    /// record.
    async fn produce(
        &self,
        queue: &str,
        items: Vec<(usize, Lane, OutgoingMessage)>,
    ) -> Vec<FailedPublish> {
        let topics = match self.lanes(queue).await {
            Ok(t) => t,
            Err(e) => {
                let (text, retryable) = (e.to_string(), e.is_retryable());
                return items
                    .into_iter()
                    .map(|(index, _, message)| FailedPublish {
                        index,
                        message,
                        error: Error::broker("kafka", text.clone(), retryable),
                    })
                    .collect();
            }
        };
        let producer = self.producer();
        // Every record is enqueued before any report is awaited, and the
        // reports are awaited as one: the task wakes once, when the last is
        // in (not once per record, as a future per record would have it).
        let mut errors: Vec<Option<KafkaError>> = items.iter().map(|_| None).collect();
        for (part, first) in items
            .chunks(reports::MAX_RECORDS)
            .zip((0..).step_by(reports::MAX_RECORDS))
        {
            for (index, error) in self.enqueue_and_wait(&producer, &topics, part).await {
                errors[first + index] = Some(error);
            }
        }
        let mut failed = Vec::new();
        let mut timed_out = 0;
        for ((index, lane, message), error) in items.into_iter().zip(errors) {
            if topics[lane as usize].is_none() {
                failed.push(FailedPublish {
                    index,
                    message,
                    error: Error::broker(
                        "kafka",
                        format!(
                            "topic {:?} does not exist (topology = \"existing\" creates nothing)",
                            self.topic_names(queue)[lane as usize]
                        ),
                        true,
                    )
                    .with_broker_kind(BrokerErrorKind::NotFound),
                });
                continue;
            }
            if let Some(e) = error {
                timed_out += usize::from(matches!(
                    e.rdkafka_error_code(),
                    Some(RDKafkaErrorCode::MessageTimedOut)
                ));
                failed.push(FailedPublish {
                    index,
                    message,
                    error: kafka_error(&e),
                });
            }
        }
        if !failed.is_empty() {
            // The topic may have gone away (a broker restarted without its
            // data): librdkafka then only waits for metadata until the message
            // times out. Make the next publish check the topics again;
            // creating an existing topic is a cheap no-op.
            self.forget_topics(queue);
            // An idempotent producer whose id the cluster no longer knows can
            // stay stuck; a fatal error or a batch that timed out entirely
            // gets a fresh producer (new id) for the next publish.
            let fatal = {
                use rdkafka::producer::Producer as _;
                producer.client().fatal_error()
            };
            if fatal.is_some() || timed_out == failed.len() {
                let fatal = fatal.map(|(code, reason)| format!("{code:?}: {reason}"));
                tracing::warn!(fatal, timed_out, "rebuilding the kafka producer");
                if let Err(e) = self.rebuild_producer(&producer) {
                    tracing::warn!(error = %e, "could not rebuild the kafka producer");
                }
            }
        }
        failed
    }
}

fn make_producer(config: &KafkaConfig) -> Result<Producer> {
    let mut p = client_config(config);
    p.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", config.publish_timeout_ms.to_string())
        .set(
            "message.max.bytes",
            (config.max_message_bytes + 64 * 1024).to_string(),
        )
        .set("linger.ms", "5");
    apply_overrides(&mut p, config)?;
    p.create_with_context(Reports::default())
        .map_err(|e| kafka_error(&e))
}

/// A connection to a Kafka cluster: one idempotent producer, consumers on demand.
#[derive(Debug, Clone)]
pub struct KafkaAdapter {
    inner: Arc<Inner>,
}

impl KafkaAdapter {
    /// Validates the settings and creates the producer and admin clients.
    pub async fn connect(config: KafkaConfig) -> Result<Self> {
        config.validate()?;
        let producer = make_producer(&config)?;
        let mut a = client_config(&config);
        apply_overrides(&mut a, &config)?;
        let admin: AdminClient<DefaultClientContext> = a.create().map_err(|e| kafka_error(&e))?;
        Ok(KafkaAdapter {
            inner: Arc::new(Inner {
                config,
                producer: std::sync::RwLock::new(Arc::new(producer)),
                admin,
                topics: Mutex::new(HashSet::new()),
                resolved: Mutex::new(HashMap::new()),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &KafkaConfig {
        &self.inner.config
    }
}

#[async_trait]
impl QueueAdapter for KafkaAdapter {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn max_message_bytes(&self) -> usize {
        self.inner.config.max_message_bytes
    }

    #[tracing::instrument(skip_all, fields(queue = %queue, count = messages.len()))]
    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        let (total, accepted, mut failed) = admit(
            messages,
            self.inner.config.max_message_bytes,
            self.inner.closed.load(Ordering::Acquire),
        )?;
        let now = now_ms();
        let items = accepted
            .into_iter()
            .map(|(i, mut m)| {
                // Scheduled jobs wait in the retry topic like delayed retries.
                let lane = match m.deliver_at.map(|t| t.timestamp_millis()) {
                    Some(at) if at > now => {
                        m.headers.insert(NOT_BEFORE_HEADER, at.to_string());
                        Lane::Retry
                    }
                    _ => Lane::Queue,
                };
                (i, lane, m)
            })
            .collect();
        failed.extend(self.inner.produce(queue, items).await);
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let [main, retry, dead] = self.inner.lanes(queue).await?;
        if dead.is_none() && options.source == Source::Queue && options.may_dead_letter {
            // Only a consumer whose records may be dead-lettered needs the
            // dead topic; a sink or a reader (`tail`) never writes there.
            tracing::warn!(queue, topic = %self.inner.config.dead_topic_of(queue), "no dead-letter topic; dead-lettering a record of this queue waits until it exists");
        }
        let topics: Vec<String> = match options.source {
            Source::Queue => {
                let mut t: Vec<String> = main.into_iter().collect();
                t.extend(retry.filter(|r| !t.contains(r)));
                t
            }
            Source::DeadLetters => vec![dead.ok_or_else(|| {
                Error::broker(
                    "kafka",
                    format!(
                        "dead-letter topic {:?} does not exist (topology = \"existing\")",
                        self.inner.config.dead_topic_of(queue)
                    ),
                    true,
                )
                .with_broker_kind(BrokerErrorKind::NotFound)
            })?],
        };
        Ok(Box::new(KafkaConsumer::new(
            self.inner.clone(),
            queue,
            topics,
            options,
        )?))
    }

    async fn prepare(&self, queue: &str) -> Result<()> {
        self.inner.lanes(queue).await.map(|_| ())
    }

    async fn open_reply_queue(&self, queue: &str) -> Result<()> {
        // A per-instance topic (its retry and dead topics too: the
        // consumer's contract needs them), created like any queue's.
        self.inner.config.topology.may_create_reply_queue(queue)?;
        self.prepare(queue).await
    }

    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        let names = self.inner.topic_names(queue);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self
            .inner
            .admin
            .delete_topics(&refs, &opts)
            .await
            .map_err(|e| kafka_error(&e))?;
        {
            let mut known = self.inner.topics.lock().unwrap_or_else(|e| e.into_inner());
            for n in &names {
                known.remove(n);
            }
        }
        self.inner
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((name, code)) => {
                    return Err(Error::broker(
                        "kafka",
                        format!("deleting reply topic {name:?}: {code}"),
                        true,
                    )
                    .with_broker_kind(broker_kind(Some(code))))
                }
            }
        }
        Ok(())
    }

    fn is_reserved(&self, queue: &str) -> bool {
        self.inner.config.is_reserved(queue)
    }

    async fn health(&self) -> Health {
        let inner = self.inner.clone();
        let r = tokio::task::spawn_blocking(move || {
            use rdkafka::producer::Producer as _;
            inner
                .producer()
                .client()
                .fetch_metadata(None, Duration::from_secs(3))
                .map(|m| m.brokers().len())
        })
        .await;
        match r {
            Ok(Ok(n)) => Health::ok(format!("{n} broker(s) at {}", self.inner.config.brokers)),
            Ok(Err(e)) => Health::down(e.to_string()),
            Err(e) => Health::down(e.to_string()),
        }
    }

    /// Lag of `depth_group` on the queue and retry topics (records not yet
    /// committed by that group).
    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let config = self.inner.config.clone();
        let queue = queue.to_owned();
        tokio::task::spawn_blocking(move || -> Result<Option<u64>> {
            let mut c = client_config(&config);
            c.set("group.id", &config.depth_group)
                .set("enable.auto.commit", "false");
            apply_overrides(&mut c, &config)?;
            let consumer: BaseConsumer = c.create().map_err(|e| kafka_error(&e))?;
            let timeout = Duration::from_secs(5);
            let mut total = 0u64;
            for topic in [config.topic_of(&queue), config.retry_topic_of(&queue)] {
                let md = consumer
                    .fetch_metadata(Some(&topic), timeout)
                    .map_err(|e| kafka_error(&e))?;
                let Some(t) = md.topics().first() else {
                    continue;
                };
                let mut tpl = TopicPartitionList::new();
                for p in t.partitions() {
                    tpl.add_partition(&topic, p.id());
                }
                let committed = consumer
                    .committed_offsets(tpl, timeout)
                    .map_err(|e| kafka_error(&e))?;
                for p in t.partitions() {
                    let (low, high) = consumer
                        .fetch_watermarks(&topic, p.id(), timeout)
                        .map_err(|e| kafka_error(&e))?;
                    let from = match committed.find_partition(&topic, p.id()).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => o.max(low),
                        _ => low,
                    };
                    total += (high - from).max(0) as u64;
                }
            }
            Ok(Some(total))
        })
        .await
        .map_err(|e| Error::broker("kafka", e.to_string(), true))?
    }

    async fn close(&self) -> Result<()> {
        self.inner.closed.store(true, Ordering::Release);
        let inner = self.inner.clone();
        // Every publish awaited its delivery reports; flush catches stragglers.
        tokio::task::spawn_blocking(move || {
            use rdkafka::producer::Producer as _;
            inner.producer().flush(inner.config.publish_timeout())
        })
        .await
        .map_err(|e| Error::broker("kafka", e.to_string(), true))?
        .map_err(|e| kafka_error(&e))
    }
}

/// A record held until its `ojs-not-before` time.
#[derive(Debug)]
struct Held {
    message: OwnedMessage,
    generation: u64,
}

/// State shared by a consumer, its deliveries and its rebalance callbacks.
#[derive(Debug, Default)]
struct Shared {
    tracker: Tracker,
    /// Retry records not yet due, by (due ms, sequence).
    delayed: BTreeMap<(i64, u64), Held>,
    paused: bool,
    /// Records polled while nobody was receiving (see [`keep_alive`]),
    /// handed out first, in order, by the next `receive`.
    parked: VecDeque<OwnedMessage>,
    /// Partitions [`keep_alive`] paused because nobody is receiving (only
    /// these are resumed: resuming a partition that is not paused still
    /// makes librdkafka drop what it had fetched for it).
    idle_paused: Vec<Tp>,
    /// Partitions paused because `max_uncommitted_per_partition` offsets
    /// wait behind an unsettled one.
    over_bound: Vec<Tp>,
}

impl Shared {
    /// Forgets what belonged to revoked partitions: their next owner reads
    /// it again from the committed offset.
    fn forget(&mut self, tps: &[Tp]) {
        let revoked =
            |topic: &str, partition: i32| tps.iter().any(|(t, p)| topic == &**t && partition == *p);
        self.tracker.revoke(tps);
        self.delayed
            .retain(|_, h| !revoked(h.message.topic(), h.message.partition()));
        self.parked.retain(|m| !revoked(m.topic(), m.partition()));
        self.over_bound.retain(|(t, p)| !revoked(t, *p));
        self.idle_paused.retain(|(t, p)| !revoked(t, *p));
    }
}

/// A record as received or as held: turned into an owned copy only when it
/// must outlive the poll that returned it.
trait Detach: rdkafka::Message {
    fn owned(&self) -> OwnedMessage;
    /// Its headers, names as bytes ([`record_headers`]).
    fn header_parts(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)>;
}

impl Detach for rdkafka::message::BorrowedMessage<'_> {
    fn owned(&self) -> OwnedMessage {
        detach(self)
    }

    fn header_parts(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        RecordHeaders::of(self)
    }
}

impl Detach for OwnedMessage {
    fn owned(&self) -> OwnedMessage {
        self.clone()
    }

    /// rdkafka's reader panics on a name that is not UTF-8; every
    /// `OwnedMessage` here comes from [`detach`], which leaves none.
    fn header_parts(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.headers()
            .into_iter()
            .flat_map(|h| h.iter().map(|h| (h.key.as_bytes(), h.value)))
    }
}

/// An owned copy of a received record. librdkafka's copy keeps header names
/// as they are, and rdkafka could not read back one that is not UTF-8, so
/// a record with such a name is copied with its names read as
/// [`received_record`] reads them (U+FFFD for what is not UTF-8).
fn detach(m: &rdkafka::message::BorrowedMessage<'_>) -> OwnedMessage {
    if RecordHeaders::of(m).all(|(name, _)| std::str::from_utf8(name).is_ok()) {
        return m.detach();
    }
    let mut headers = OwnedHeaders::new_with_capacity(RecordHeaders::of(m).count());
    for (name, value) in RecordHeaders::of(m) {
        headers = headers.insert(Header {
            key: &String::from_utf8_lossy(name),
            value,
        });
    }
    OwnedMessage::new(
        m.payload().map(<[u8]>::to_vec),
        m.key().map(<[u8]>::to_vec),
        m.topic().to_owned(),
        m.timestamp(),
        m.partition(),
        m.offset(),
        Some(headers),
    )
}

#[derive(Debug, Clone, Default)]
struct Context {
    shared: Arc<Mutex<Shared>>,
}

impl Context {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn commit_list(offsets: &[(String, i32, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for (t, p, o) in offsets {
        let _ = tpl.add_partition_offset(t, *p, Offset::Offset(*o));
    }
    tpl
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let tps: Vec<Tp> = tpl
                .elements()
                .iter()
                .map(|e| (Arc::<str>::from(e.topic()), e.partition()))
                .collect();
            let offsets = {
                let mut shared = self.lock();
                let offsets = shared.tracker.committable_for(&tps);
                // Held retries and parked records of revoked partitions are
                // uncommitted: the new owner reads them again.
                shared.forget(&tps);
                offsets
            };
            if !offsets.is_empty() {
                // Drain before giving the partitions away.
                if let Err(e) = consumer.commit(&commit_list(&offsets), CommitMode::Sync) {
                    tracing::warn!(error = %e, "commit on revoke failed; the next owner may see duplicates");
                }
            }
        }
    }
}

fn commit_pending(consumer: &StreamConsumer<Context>, context: &Context, mode: CommitMode) {
    let offsets = context.lock().tracker.committable();
    if !offsets.is_empty() {
        if let Err(e) = consumer.commit(&commit_list(&offsets), mode) {
            tracing::warn!(error = %e, "offset commit failed; later offsets will cover it");
        }
    }
}

/// How long a consumer may go without a `receive` before [`keep_alive`]
/// serves it: a fifth of `max.poll.interval.ms`, between 200 ms and 10 s.
fn keep_alive_after(config: &KafkaConfig) -> Duration {
    (config.max_poll_interval() / 5).clamp(Duration::from_millis(200), Duration::from_secs(10))
}

/// Serves a consumer that nobody is receiving from (its caller holds back
/// under backpressure: a slow sink, a full in-flight budget). librdkafka
/// takes a consumer that does not poll for `max.poll.interval.ms` out of its
/// group, and a rebalance waits for every member to poll: so every assigned
/// partition is paused (fetching stops; what was fetched and not handed out
/// is fetched again on resume) and the consumer is polled, which serves
/// rebalances and keeps its membership. A record that still comes out is
/// parked for the next `receive`. `receive` resumes the partitions.
fn keep_alive(
    consumer: &StreamConsumer<Context>,
    context: &Context,
    poll_lock: &tokio::sync::Mutex<std::time::Instant>,
    idle_after: Duration,
) {
    // Held by `receive` while it polls: nothing to do then.
    let Ok(last_poll) = poll_lock.try_lock() else {
        return;
    };
    if last_poll.elapsed() < idle_after {
        return;
    }
    // Checked every time: a rebalance may have assigned partitions, which
    // start unpaused.
    if let Ok(assignment) = consumer.assignment() {
        let mut tpl = TopicPartitionList::new();
        let mut newly = Vec::new();
        {
            let shared = context.lock();
            for e in assignment.elements() {
                let paused = shared
                    .idle_paused
                    .iter()
                    .any(|(t, p)| e.topic() == &**t && e.partition() == *p);
                if !paused {
                    tpl.add_partition(e.topic(), e.partition());
                    newly.push((Arc::<str>::from(e.topic()), e.partition()));
                }
            }
        }
        if !newly.is_empty() {
            match consumer.pause(&tpl) {
                Ok(()) => {
                    tracing::debug!(
                        partitions = newly.len(),
                        idle_ms = last_poll.elapsed().as_millis() as u64,
                        "no receive for a while: partitions paused, consumer kept alive"
                    );
                    context.lock().idle_paused.extend(newly);
                }
                Err(e) => tracing::warn!(error = %e, "pausing an idle consumer failed"),
            }
        }
    }
    let mut stream = consumer.stream();
    let mut quiet = 0;
    for _ in 0..256 {
        match stream.next().now_or_never() {
            Some(Some(Ok(m))) => context.lock().parked.push_back(detach(&m)),
            Some(Some(Err(e))) => {
                tracing::warn!(error = %e, "kafka consumer error while receives are held back");
            }
            Some(None) => break,
            // Nothing ready (or an event such as a rebalance was served).
            None => {
                quiet += 1;
                if quiet >= 2 {
                    break;
                }
            }
        }
    }
}

/// What every delivery of one consumer needs to settle itself: shared
/// behind one `Arc`, so a delivery costs one reference count, not one per
/// field.
#[derive(Debug)]
struct Settler {
    inner: Arc<Inner>,
    context: Context,
    /// The OJS queue name.
    queue: Arc<str>,
    source: Source,
    max_deliveries: Option<u32>,
}

/// A consumer-group member reading one queue (its topic and retry topic) or
/// its dead letters.
pub struct KafkaConsumer {
    inner: Arc<Inner>,
    queue: String,
    /// Subscribed topic names, interned for the offset tracker.
    topics: Vec<Arc<str>>,
    consumer: Arc<StreamConsumer<Context>>,
    context: Context,
    settler: Arc<Settler>,
    seq: AtomicU64,
    /// Held by `receive` while it polls; holds when it last returned.
    poll_lock: Arc<tokio::sync::Mutex<std::time::Instant>>,
    /// A topic can hold many records with header names that are not UTF-8:
    /// one warning per interval says so, with how many it held back.
    renamed_warnings: LogLimiter,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    fn new(
        inner: Arc<Inner>,
        queue: &str,
        topics: Vec<String>,
        options: ConsumerOptions,
    ) -> Result<Self> {
        let config = &inner.config;
        // Dead-letter readers get their own group so they never rebalance
        // the workers of the queue.
        let group = match options.source {
            Source::Queue => options.group.clone(),
            Source::DeadLetters => format!("{}.dead", options.group),
        };
        let mut c = client_config(config);
        c.set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            .set("session.timeout.ms", config.session_timeout_ms.to_string());
        apply_overrides(&mut c, config)?;
        let context = Context::default();
        let consumer: StreamConsumer<Context> = c
            .create_with_context(context.clone())
            .map_err(|e| kafka_error(&e))?;
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&refs).map_err(|e| kafka_error(&e))?;
        let consumer = Arc::new(consumer);
        // Commits settled offsets in the background, so acks made after the
        // last `receive` are committed too, and keeps the consumer in its
        // group while nobody receives. It stops with the consumer.
        let commit_every = Duration::from_millis(inner.config.commit_interval_ms.max(10));
        let idle_after = keep_alive_after(&inner.config);
        let tick = commit_every
            .min(idle_after / 2)
            .max(Duration::from_millis(10));
        let poll_lock = Arc::new(tokio::sync::Mutex::new(std::time::Instant::now()));
        let weak = Arc::downgrade(&consumer);
        let ticker_context = context.clone();
        let ticker_lock = poll_lock.clone();
        tokio::spawn(async move {
            let mut last_commit = std::time::Instant::now();
            loop {
                tokio::time::sleep(tick).await;
                let Some(consumer) = weak.upgrade() else {
                    break;
                };
                if last_commit.elapsed() >= commit_every {
                    commit_pending(&consumer, &ticker_context, CommitMode::Async);
                    last_commit = std::time::Instant::now();
                }
                keep_alive(&consumer, &ticker_context, &ticker_lock, idle_after);
            }
        });
        let interned = topics.iter().map(|t| Arc::from(t.as_str())).collect();
        let settler = Arc::new(Settler {
            inner: inner.clone(),
            context: context.clone(),
            queue: Arc::from(queue),
            source: options.source,
            max_deliveries: options.max_deliveries,
        });
        Ok(KafkaConsumer {
            inner,
            queue: queue.to_owned(),
            topics: interned,
            consumer,
            context,
            settler,
            seq: AtomicU64::new(0),
            poll_lock,
            renamed_warnings: LogLimiter::new(Duration::from_secs(10)),
        })
    }

    /// Resumes what [`keep_alive`] paused, except partitions held for their
    /// own reasons (retry backlog, uncommitted bound).
    fn wake_up(&self) {
        let retry = self.topics.last();
        let mut tpl = TopicPartitionList::new();
        {
            let mut shared = self.context.lock();
            if shared.idle_paused.is_empty() {
                return;
            }
            let paused = std::mem::take(&mut shared.idle_paused);
            for (topic, partition) in paused {
                let held_retry = shared.paused && retry.is_some_and(|r| *r == topic);
                let held_bound = shared.over_bound.contains(&(topic.clone(), partition));
                if !held_retry && !held_bound {
                    tpl.add_partition(&topic, partition);
                }
            }
        }
        if tpl.count() > 0 {
            if let Err(e) = self.consumer.resume(&tpl) {
                tracing::warn!(error = %e, "resuming partitions failed");
            }
        }
    }

    /// Pauses a partition whose tracked offsets reached
    /// `max_uncommitted_per_partition` (one unsettled record holds back
    /// every later one, and each is remembered until it is), and resumes it
    /// once it is under half of that.
    fn bound_partitions(&self) {
        let limit = self.inner.config.max_uncommitted_per_partition;
        let (pause, resume) = {
            let mut guard = self.context.lock();
            let shared = &mut *guard;
            let pause: Vec<Tp> = shared
                .tracker
                .tracked()
                .filter(|(tp, n)| *n >= limit && !shared.over_bound.contains(tp))
                .map(|(tp, _)| tp.clone())
                .collect();
            let mut resume = Vec::new();
            let retry = self.topics.last();
            shared.over_bound.retain(|tp| {
                let n = shared
                    .tracker
                    .tracked()
                    .find(|(t, _)| *t == tp)
                    .map_or(0, |(_, n)| n);
                let keep = n >= limit / 2;
                let retry_held = shared.paused && retry.is_some_and(|r| *r == tp.0);
                if !keep && !retry_held {
                    resume.push(tp.clone());
                }
                keep
            });
            shared.over_bound.extend(pause.iter().cloned());
            (pause, resume)
        };
        for (tps, pausing) in [(&pause, true), (&resume, false)] {
            if tps.is_empty() {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            for (topic, partition) in tps {
                tpl.add_partition(topic, *partition);
                if pausing {
                    tracing::warn!(
                        topic = &**topic,
                        partition,
                        limit,
                        "partition paused: max_uncommitted_per_partition offsets wait behind an unsettled record"
                    );
                }
            }
            let r = if pausing {
                self.consumer.pause(&tpl)
            } else {
                self.consumer.resume(&tpl)
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, pausing, "pausing/resuming partitions failed");
            }
        }
    }

    fn commit_pending(&self, mode: CommitMode) {
        commit_pending(&self.consumer, &self.context, mode);
    }

    fn not_before<M: Detach>(m: &M) -> Option<i64> {
        m.header_parts()
            .find(|(name, _)| *name == NOT_BEFORE_HEADER.as_bytes())
            .and_then(|(_, value)| std::str::from_utf8(value?).ok()?.parse().ok())
    }

    /// The interned name of a subscribed topic (no allocation per record).
    fn topic_name(&self, topic: &str) -> Arc<str> {
        self.topics
            .iter()
            .find(|t| &***t == topic)
            .cloned()
            .unwrap_or_else(|| Arc::from(topic))
    }

    /// Registers received records (one lock for the batch); each becomes a
    /// delivery now, or is held (detached) until due.
    fn accept_all<M: Detach>(&self, batch: &[M], out: &mut Vec<Delivery>) {
        let tps: Vec<Tp> = batch
            .iter()
            .map(|m| (self.topic_name(m.topic()), m.partition()))
            .collect();
        let generations: Vec<u64> = {
            let mut shared = self.context.lock();
            batch
                .iter()
                .zip(&tps)
                .map(|(m, tp)| shared.tracker.deliver(tp, m.offset()))
                .collect()
        };
        for ((m, tp), generation) in batch.iter().zip(tps).zip(generations) {
            self.accept(m, tp, generation, out);
        }
    }

    fn accept<M: Detach>(&self, m: &M, tp: Tp, generation: u64, out: &mut Vec<Delivery>) {
        match Self::not_before(m) {
            Some(due) if due > now_ms() => {
                let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                let mut shared = self.context.lock();
                shared.delayed.insert(
                    (due, seq),
                    Held {
                        message: m.owned(),
                        generation,
                    },
                );
                if shared.delayed.len() >= self.inner.config.max_delayed_in_memory && !shared.paused
                {
                    shared.paused = true;
                    drop(shared);
                    self.set_retry_paused(true);
                }
            }
            _ => out.push(self.delivery(m, tp, generation)),
        }
    }

    fn set_retry_paused(&self, pause: bool) {
        // The retry topic, or the queue topic where retries go back to it
        // (topology = "existing" without a retry topic): the last subscribed.
        let Some(retry) = self.topics.last() else {
            return;
        };
        let Ok(assignment) = self.consumer.assignment() else {
            return;
        };
        let mut tpl = TopicPartitionList::new();
        for e in assignment
            .elements()
            .iter()
            .filter(|e| e.topic() == &**retry)
        {
            tpl.add_partition(e.topic(), e.partition());
        }
        let r = if pause {
            self.consumer.pause(&tpl)
        } else {
            self.consumer.resume(&tpl)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, pause, "pausing/resuming retry partitions failed");
        }
    }

    fn take_due(&self, max: usize, out: &mut Vec<Delivery>) -> Option<i64> {
        let now = now_ms();
        let mut due = Vec::new();
        let (next, resume) = {
            let mut shared = self.context.lock();
            while out.len() + due.len() < max {
                let Some(entry) = shared.delayed.first_entry() else {
                    break;
                };
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            let resume =
                shared.paused && shared.delayed.len() < self.inner.config.max_delayed_in_memory / 2;
            if resume {
                shared.paused = false;
            }
            (shared.delayed.keys().next().map(|(at, _)| *at), resume)
        };
        if resume {
            self.set_retry_paused(false);
        }
        out.extend(due.into_iter().map(|h| {
            let tp = (self.topic_name(h.message.topic()), h.message.partition());
            self.delivery(&h.message, tp, h.generation)
        }));
        next
    }

    /// One copy of the payload, key and header values, straight from
    /// librdkafka's buffer ([`received_record`]).
    fn delivery<M: Detach>(&self, m: &M, tp: Tp, generation: u64) -> Delivery {
        let ReceivedRecord {
            payload,
            headers,
            key,
            attempt,
            renamed,
        } = received_record(m.header_parts(), m.key(), m.payload().unwrap_or_default());
        if renamed > 0 {
            if let Some(held_back) = self.renamed_warnings.allow() {
                tracing::warn!(
                    topic = m.topic(),
                    partition = m.partition(),
                    offset = m.offset(),
                    renamed,
                    records_since_last_warning = held_back,
                    "record header names that are not UTF-8 read with U+FFFD in place of the invalid bytes (as Kafka's Java client reads them)"
                );
            }
        }
        let message_id = headers.get_str(header::ID).map(str::to_owned);
        let acker = KafkaAcker {
            settler: self.settler.clone(),
            tp,
            offset: m.offset(),
            generation,
            attempt,
        };
        let mut d = Delivery::new(
            payload,
            headers,
            attempt,
            self.settler.queue.clone(),
            Box::new(acker),
        );
        d.key = key;
        d.message_id = message_id;
        d
    }
    /// One batch: held retries that are due, parked records, then what
    /// librdkafka has, waiting up to `wait`.
    async fn poll_batch(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        let max = max.max(1);
        loop {
            // Commits are left to the background committer (every
            // `commit_interval_ms`): one commit per receive call would be a
            // broker request per batch.
            let mut out = Vec::new();
            let next_due = self.take_due(max, &mut out);
            if !out.is_empty() {
                return Ok(out);
            }
            let parked: Vec<OwnedMessage> = {
                let mut shared = self.context.lock();
                let n = shared.parked.len().min(max);
                shared.parked.drain(..n).collect()
            };
            if !parked.is_empty() {
                self.accept_all(&parked, &mut out);
                if !out.is_empty() {
                    return Ok(out);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(out);
            }
            let wake = next_due.map_or(deadline, |at| {
                let until = Duration::from_millis((at - now_ms()).max(0) as u64);
                deadline.min(now + until)
            });
            let consumer = self.consumer.clone();
            // One stream for the whole batch: each `recv` would register and
            // unregister a waker (two lock round trips per record).
            let mut stream = consumer.stream();
            let first = tokio::time::timeout_at(wake, stream.next()).await;
            match first {
                Err(_) => continue,         // a held record is due, or the wait is over
                Ok(None) => return Ok(out), // rdkafka streams never end
                Ok(Some(Err(e))) => return Err(kafka_error(&e)),
                Ok(Some(Ok(m))) => {
                    let mut batch = Vec::with_capacity(max.min(1024));
                    batch.push(m);
                    while batch.len() < max {
                        match stream.next().now_or_never() {
                            Some(Some(Ok(m))) => batch.push(m),
                            _ => break,
                        }
                    }
                    self.accept_all(&batch, &mut out);
                    drop(batch);
                    if !out.is_empty() {
                        return Ok(out);
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Consumer for KafkaConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let poll_lock = self.poll_lock.clone();
        let mut last_poll = poll_lock.lock().await;
        self.wake_up();
        self.bound_partitions();
        let received = self.poll_batch(max, wait).await;
        *last_poll = std::time::Instant::now();
        received
    }

    async fn close(self: Box<Self>) -> Result<()> {
        let consumer = self.consumer.clone();
        let offsets = self.context.lock().tracker.committable();
        tokio::task::spawn_blocking(move || {
            if !offsets.is_empty() {
                if let Err(e) = consumer.commit(&commit_list(&offsets), CommitMode::Sync) {
                    tracing::warn!(error = %e, "final commit failed");
                }
            }
            consumer.unsubscribe();
        })
        .await
        .map_err(|e| Error::broker("kafka", e.to_string(), true))
    }
}

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        // Leaving the group hands the partitions (and everything not yet
        // committed) to the remaining members.
        self.commit_pending(CommitMode::Async);
    }
}

#[derive(Debug)]
struct KafkaAcker {
    settler: Arc<Settler>,
    tp: Tp,
    offset: i64,
    generation: u64,
    attempt: u32,
}

impl KafkaAcker {
    /// Marks the offset settled: bookkeeping only (the background committer
    /// commits the contiguous prefix), so it never waits.
    fn settle(&self) -> Result<()> {
        self.settler
            .context
            .lock()
            .tracker
            .settle(&self.tp, self.offset, self.generation)
            .map_err(|Stale| Error::DeliveryExpired)
    }

    /// Produces `copy` to the lane's topic, then settles the original offset. When
    /// the copy is not confirmed the original stays unsettled (uncommitted),
    /// so it is delivered again after a restart: never lost.
    async fn move_to(&self, lane: Lane, copy: OutgoingMessage) -> Result<()> {
        // A dead letter too large for the dead topic (the reason headers
        // pushed it over, or the topic takes less than the source) would
        // hold the partition's commit point for good: it goes without its
        // body, saying where the original is.
        let limit = self.settler.inner.config.max_message_bytes;
        let dead = matches!(lane, Lane::Dead);
        let copy = if dead && copy.check_size(limit).is_err() {
            self.without_body(copy)
        } else {
            copy
        };
        let failed = self
            .settler
            .inner
            .produce(&self.settler.queue, vec![(0, lane, copy)])
            .await;
        let Some(f) = failed.into_iter().next() else {
            return self.settle();
        };
        // The broker refused the dead letter itself (its topic's
        // max.message.bytes: a permanent error): the same, without the body.
        let refused_as_too_large = dead && !f.error.is_retryable() && !f.message.payload.is_empty();
        if !refused_as_too_large {
            return Err(f.error);
        }
        let stub = self.without_body(f.message);
        let failed = self
            .settler
            .inner
            .produce(&self.settler.queue, vec![(0, lane, stub)])
            .await;
        match failed.into_iter().next() {
            Some(f) => Err(f.error),
            None => self.settle(),
        }
    }

    fn without_body(&self, mut copy: OutgoingMessage) -> OutgoingMessage {
        let size = copy.payload.len();
        copy.payload = bytes::Bytes::new();
        copy.envelope = None;
        copy.headers
            .insert(header::PAYLOAD_OMITTED, size.to_string());
        copy.headers
            .insert("ojs-source-topic", self.tp.0.to_string());
        copy.headers
            .insert("ojs-source-partition", self.tp.1.to_string());
        copy.headers
            .insert("ojs-source-offset", self.offset.to_string());
        copy
    }
}

#[async_trait]
impl Acknowledger for KafkaAcker {
    async fn ack(&self) -> Result<()> {
        self.settle()
    }

    fn ack_now(&self) -> Option<Result<()>> {
        Some(self.settle())
    }

    /// A batch of this consumer's records under one lock of its offset
    /// tracker, not one each.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let members =
            ojs_core::batch_of::<KafkaAcker>(batch, |k| Arc::ptr_eq(&k.settler, &self.settler))?;
        let mut context = self.settler.context.lock();
        Some(
            members
                .iter()
                .map(|k| {
                    context
                        .tracker
                        .settle(&k.tp, k.offset, k.generation)
                        .map_err(|Stale| Error::DeliveryExpired)
                })
                .collect(),
        )
    }

    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()> {
        let Settler {
            source,
            max_deliveries,
            ..
        } = &*self.settler;
        let mut copy = delivery.to_outgoing();
        match action {
            Nack::Retry { delay } if *source == Source::Queue => {
                if max_deliveries.is_some_and(|m| self.attempt >= m) {
                    DeadLetterReason::of(
                        ojs_core::DeadLetterKind::MaxDeliveries,
                        format!(
                            "delivered {} times without being acknowledged",
                            self.attempt
                        ),
                    )
                    .write_headers(&mut copy.headers);
                    return self.move_to(Lane::Dead, copy).await;
                }
                copy.headers
                    .insert(header::ATTEMPT, (self.attempt + 1).to_string());
                // Whole milliseconds, rounded up: the clock read here is
                // truncated, so +1 keeps the record from coming back early.
                let due = now_ms().saturating_add(delay.as_micros().div_ceil(1000) as i64 + 1);
                copy.headers.insert(NOT_BEFORE_HEADER, due.to_string());
                self.move_to(Lane::Retry, copy).await
            }
            // A dead letter that is retried goes to the back of the dead topic.
            Nack::Retry { .. } => self.move_to(Lane::Dead, copy).await,
            Nack::DeadLetter(reason) => {
                reason.write_headers(&mut copy.headers);
                self.move_to(Lane::Dead, copy).await
            }
        }
    }
}

/// What a record carries, in neutral form.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedRecord {
    /// The record's value (empty when it had none).
    pub payload: Bytes,
    /// Headers with a value (the adapter's own `ojs-not-before` left out).
    pub headers: Headers,
    /// The record key, as bytes: a retry or dead-letter copy keeps it.
    pub key: Option<Bytes>,
    /// 1-based attempt from `ojs-attempt`.
    pub attempt: u32,
    /// How many header names were not UTF-8 (read with U+FFFD in place of
    /// the invalid bytes).
    pub renamed: usize,
}

/// Reads a record's value, headers and key as librdkafka hands them over.
/// Header values and the key are kept as bytes (a binary value goes out
/// again exactly as it came in); the names of `ojs_core::header` are not
/// allocated. A header name is text to every OJS binding, but the Kafka
/// protocol lets a client write any bytes there: one that is not UTF-8 is
/// read as Kafka's Java client reads it (each invalid sequence becomes
/// U+FFFD), so the record is delivered, not stuck, and counted in
/// `renamed`.
///
/// One allocation holds the payload, the key and every header value, and
/// each is a slice of it (a reference count, not a copy): a record used
/// to cost one allocation per value, freed again on whichever thread
/// drops the delivery. They live as long as the delivery anyway.
/// The Kafka header fuzz target starts here.
pub fn received_record<'a>(
    headers: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    key: Option<&[u8]>,
    payload: &[u8],
) -> ReceivedRecord {
    // The kept headers read once (each read of a librdkafka header looks
    // its name up again): onto the stack when there are few.
    let mut small: [(&[u8], &[u8]); 16] = [(&[], &[]); 16];
    let mut large = Vec::new();
    let mut n = 0;
    for (name, value) in headers {
        let Some(value) = value.filter(|_| name != NOT_BEFORE_HEADER.as_bytes()) else {
            continue;
        };
        if n < small.len() {
            small[n] = (name, value);
        } else {
            if large.is_empty() {
                large.extend_from_slice(&small);
            }
            large.push((name, value));
        }
        n += 1;
    }
    let kept: &[(&[u8], &[u8])] = if large.is_empty() {
        &small[..n]
    } else {
        &large
    };
    let key_len = key.map_or(0, <[u8]>::len);
    let values_len: usize = kept.iter().map(|(_, v)| v.len()).sum();
    let mut buf = Vec::with_capacity(payload.len() + key_len + values_len);
    buf.extend_from_slice(payload);
    buf.extend_from_slice(key.unwrap_or_default());
    for (_, v) in kept {
        buf.extend_from_slice(v);
    }
    let buf = Bytes::from(buf);
    let mut at = payload.len() + key_len;
    let mut map = Headers::with_capacity(kept.len());
    let mut renamed = 0;
    for &(name, v) in kept {
        let name = match std::str::from_utf8(name) {
            Ok(name) => HeaderName::new(name),
            Err(_) => {
                renamed += 1;
                HeaderName::new(&String::from_utf8_lossy(name))
            }
        };
        map.insert(name, buf.slice(at..at + v.len()));
        at += v.len();
    }
    let attempt = map
        .get_str(header::ATTEMPT)
        .and_then(|a| a.parse::<u32>().ok())
        .filter(|a| *a > 0)
        .unwrap_or(1);
    ReceivedRecord {
        payload: buf.slice(..payload.len()),
        headers: map,
        key: key.map(|_| buf.slice(payload.len()..payload.len() + key_len)),
        attempt,
        renamed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time (user + system) of the calling thread so far, in clock
    /// ticks (1/100 s).
    #[cfg(target_os = "linux")]
    fn thread_cpu_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        // Fields after the command name (which may hold spaces) start at
        // `state`; utime and stime are fields 14 and 15 of the line.
        let after_comm = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        let tick = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        tick(11) + tick(12)
    }

    /// rdkafka turned a wait of less than a millisecond into a
    /// non-blocking poll, so its poll loops spun through their last
    /// millisecond: the producer's polling thread, every 100 ms, for as
    /// long as the adapter lives (1.2 % of a core for an idle daemon).
    /// The patched rdkafka (`third_party/rdkafka`) rounds the wait up.
    /// Without it, this thread spends about all of the 0.27 s below on
    /// the CPU; with it, close to nothing.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_wait_of_less_than_a_millisecond_blocks_instead_of_spinning() {
        use rdkafka::producer::BaseProducer;
        // Nothing listens there: polling is local to the client.
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("log_level", "0")
            .create()
            .expect("a producer needs no broker to be created");
        let (cpu_before, started) = (thread_cpu_ticks(), std::time::Instant::now());
        for _ in 0..300 {
            producer.poll(Duration::from_micros(900));
        }
        let wall_ticks = started.elapsed().as_millis() as u64 / 10;
        let cpu = thread_cpu_ticks() - cpu_before;
        assert!(
            wall_ticks >= 25,
            "300 waits of 0.9 ms took {wall_ticks} ticks"
        );
        assert!(
            cpu * 4 < wall_ticks,
            "the waits spun: {cpu} ticks of CPU in {wall_ticks} ticks"
        );
    }

    #[test]
    fn a_received_record_reads_back_every_part_from_its_one_buffer() {
        let binary = [0u8, 0xFF, 0x80, b'x'];
        let record = received_record(
            [
                ("ojs-attempt", Some(&b"3"[..])),
                (NOT_BEFORE_HEADER, Some(&b"123"[..])),
                ("no-value", None),
                ("empty", Some(&b""[..])),
                ("binary", Some(&binary[..])),
                ("traceparent", Some(&b"00-abc-def-01"[..])),
            ]
            .into_iter()
            .map(|(name, value)| (name.as_bytes(), value)),
            Some(&b"key\x00bytes"[..]),
            b"the payload",
        );
        assert_eq!(&record.payload[..], b"the payload");
        assert_eq!(record.key.as_deref(), Some(&b"key\x00bytes"[..]));
        assert_eq!(record.attempt, 3);
        assert_eq!(record.renamed, 0);
        let mut got: Vec<(&str, &[u8])> = record
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        got.sort_unstable();
        assert_eq!(
            got,
            vec![
                ("binary", &binary[..]),
                ("empty", &b""[..]),
                ("ojs-attempt", &b"3"[..]),
                ("traceparent", &b"00-abc-def-01"[..]),
            ]
        );

        // No key, no headers, no payload: nothing is invented.
        let bare = received_record(std::iter::empty(), None, b"");
        assert!(bare.payload.is_empty() && bare.key.is_none() && bare.headers.is_empty());
        assert_eq!(bare.attempt, 1);
        // An empty key is a key.
        let empty_key = received_record(std::iter::empty(), Some(b""), b"p");
        assert_eq!(empty_key.key.as_deref(), Some(&b""[..]));
        assert_eq!(&empty_key.payload[..], b"p");

        // More headers than fit on the stack: every one read back.
        let names: Vec<String> = (0..20).map(|i| format!("h{i:02}")).collect();
        let many = received_record(
            names.iter().map(|n| (n.as_bytes(), Some(n.as_bytes()))),
            Some(b"k"),
            b"p",
        );
        assert_eq!(many.headers.len(), 20);
        for n in &names {
            assert_eq!(many.headers.get_str(n), Some(n.as_str()));
        }
        assert_eq!(
            (&many.payload[..], many.key.as_deref()),
            (&b"p"[..], Some(&b"k"[..]))
        );
    }

    /// The Kafka protocol lets a client write any bytes as a header name;
    /// such a record is read, not refused or stuck: each invalid sequence
    /// becomes U+FFFD (as Kafka's Java client reads it), its value is kept
    /// as it is, and the OJS headers beside it still count.
    #[test]
    fn a_header_name_that_is_not_utf8_is_read_as_java_clients_read_it() {
        let record = received_record(
            [
                (&b"\xff\xfename"[..], Some(&b"v\xff"[..])),
                (&b"ojs-attempt"[..], Some(&b"2"[..])),
                (&b"caf\xc3"[..], Some(&b""[..])),
                (&b"\x80"[..], None),
            ]
            .into_iter(),
            None,
            b"p",
        );
        assert_eq!(record.renamed, 2, "the null-valued header is left out");
        assert_eq!(record.attempt, 2);
        assert_eq!(
            record
                .headers
                .get("\u{FFFD}\u{FFFD}name")
                .map(|v| v.as_bytes()),
            Some(&b"v\xff"[..])
        );
        assert_eq!(
            record.headers.get("caf\u{FFFD}").map(|v| v.as_bytes()),
            Some(&b""[..])
        );
        assert_eq!(record.headers.len(), 3);
    }

    #[tokio::test]
    async fn dead_letter_and_retry_topics_are_reserved() {
        // librdkafka connects lazily: no broker needed.
        let adapter = KafkaAdapter::connect(KafkaConfig::new("127.0.0.1:1"))
            .await
            .unwrap();
        assert!(adapter.is_reserved("orders.retry"));
        assert!(!adapter.is_reserved("orders"));
        let mut c = KafkaConfig::new("127.0.0.1:1");
        c.topic_template = "{queue}".into();
        c.dead_topic_template = "{queue}.dlq".into();
        let adapter = KafkaAdapter::connect(c).await.unwrap();
        assert!(adapter.is_reserved("orders.dlq"));
        assert!(!adapter.is_reserved("orders"));
    }
}
