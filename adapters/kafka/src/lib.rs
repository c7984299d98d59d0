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
//! # async fn demo() -> ojs_queue::Result<()> {
//! use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
//! use ojs_queue::{OutgoingMessage, QueueAdapter};
//! let adapter = KafkaAdapter::connect(KafkaConfig::from_url("kafka://127.0.0.1:9092")?).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

mod ack;
mod client;
mod client_log;
mod config;
mod consume;
mod publish;
mod record_headers;
mod reports;
mod topology;
mod tracker;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{admit, publish_outcome};
use ojs_queue::{
    BrokerErrorKind, Consumer, ConsumerOptions, Error, Health, OutgoingMessage, QueueAdapter,
    Result, Source,
};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use client_log::{ClientLog, LogContext};
pub use config::KafkaConfig;
pub use ojs_queue::settings::Topology;
use record_headers::RecordHeaders;
use reports::Reports;
use tracker::{Tp, Tracker};

use crate::client::{
    apply_overrides, broker_kind, client_config, kafka_error, make_producer, now_ms, Producer,
    NOT_BEFORE_HEADER,
};
use crate::topology::{Destination, Destinations};
pub use consume::{received_record, KafkaConsumer, ReceivedRecord};

struct Inner {
    config: KafkaConfig,
    /// Replaced when it fails fatally (see `produce`).
    producer: std::sync::RwLock<Arc<Producer>>,
    admin: AdminClient<LogContext>,
    /// librdkafka's reports of every client of this adapter, gated.
    log: Arc<ClientLog>,
    /// Topics known to exist (created or found).
    topics: Mutex<HashSet<String>>,
    /// `topology = "existing"`: each queue's destinations as found on the broker.
    resolved: Mutex<HashMap<String, Destinations>>,
    closed: AtomicBool,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaInner")
            .field("brokers", &self.config.brokers)
            .finish_non_exhaustive()
    }
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
        let log = Arc::new(ClientLog::default());
        let producer = make_producer(&config, &log)?;
        let mut a = client_config(&config);
        apply_overrides(&mut a, &config)?;
        let admin: AdminClient<LogContext> = a
            .create_with_context(LogContext(log.clone()))
            .map_err(|e| kafka_error(&e))?;
        Ok(KafkaAdapter {
            inner: Arc::new(Inner {
                config,
                producer: std::sync::RwLock::new(Arc::new(producer)),
                admin,
                log,
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
                let destination = match m.deliver_at.map(|t| t.timestamp_millis()) {
                    Some(at) if at > now => {
                        m.headers.insert(NOT_BEFORE_HEADER, at.to_string());
                        Destination::Retry
                    }
                    _ => Destination::Queue,
                };
                (i, destination, m)
            })
            .collect();
        failed.extend(self.inner.produce(queue, items).await);
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let [main, retry, dead] = self.inner.destinations(queue).await?;
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
        self.inner.destinations(queue).await.map(|_| ())
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

    fn group_scope(&self, queue: &str) -> Option<String> {
        let config = &self.inner.config;
        config.custom_topics().then(|| config.topic_of(queue))
    }

    async fn health(&self) -> Health {
        let inner = self.inner.clone();
        let r = tokio::task::spawn_blocking(move || {
            use rdkafka::producer::Producer as _;
            inner
                .producer()
                .client()
                // Under the health probe's own 3 s, so that an unreachable
                // cluster is reported with its reason.
                .fetch_metadata(None, Duration::from_secs(2))
                .map(|m| m.brokers().len())
        })
        .await;
        match r {
            Ok(Ok(n)) => Health::ok(format!("{n} broker(s) at {}", self.inner.config.brokers)),
            Ok(Err(e)) => Health::down(self.inner.unreachable(&e).to_string()),
            Err(e) => Health::down(e.to_string()),
        }
    }

    /// Lag of `depth_group` on the queue and retry topics (records not yet
    /// committed by that group).
    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let config = self.inner.config.clone();
        let log = self.inner.log.clone();
        let queue = queue.to_owned();
        tokio::task::spawn_blocking(move || -> Result<Option<u64>> {
            let mut c = client_config(&config);
            c.set("group.id", &config.depth_group)
                .set("enable.auto.commit", "false");
            apply_overrides(&mut c, &config)?;
            let consumer: BaseConsumer<LogContext> = c
                .create_with_context(LogContext(log))
                .map_err(|e| kafka_error(&e))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::config::ClientConfig;

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
