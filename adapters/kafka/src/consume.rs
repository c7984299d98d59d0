//! Consuming: a consumer group member that tracks every record it hands
//! out and commits only the contiguous prefix of settled offsets per
//! partition; retry records held until due; partitions paused while nobody
//! receives, so the member stays in its group.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use ojs_queue::log_limit::LogLimiter;
use ojs_queue::{
    header, Consumer, ConsumerOptions, Delivery, Error, HeaderName, Headers, Result, Source,
};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::time::Instant;

use crate::ack::KafkaAcker;
use crate::client::{
    apply_overrides, client_config, kafka_error, now_ms, NOT_BEFORE_HEADER, ORIGIN_TOPIC_HEADER,
};
use crate::{ClientLog, Inner, KafkaConfig, RecordHeaders, Tp, Tracker};

/// A record held until its `ojs-not-before` time.
#[derive(Debug)]
pub(crate) struct DelayedRecord {
    pub(crate) message: OwnedMessage,
    pub(crate) generation: u64,
}

/// State shared by a consumer, its deliveries and its rebalance callbacks.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) tracker: Tracker,
    /// Retry records not yet due, by (due ms, sequence).
    pub(crate) delayed: BTreeMap<(i64, u64), DelayedRecord>,
    pub(crate) paused: bool,
    /// Records polled while nobody was receiving (see [`keep_alive`]),
    /// handed out first, in order, by the next `receive`.
    pub(crate) parked: VecDeque<OwnedMessage>,
    /// Partitions [`keep_alive`] paused because nobody is receiving (only
    /// these are resumed: resuming a partition that is not paused still
    /// makes librdkafka drop what it had fetched for it).
    pub(crate) idle_paused: Vec<Tp>,
    /// Partitions paused because `max_uncommitted_per_partition` offsets
    /// wait behind an unsettled one.
    pub(crate) over_bound: Vec<Tp>,
}

impl Shared {
    /// Forgets what belonged to revoked partitions: their next owner reads
    /// it again from the committed offset.
    pub(crate) fn forget(&mut self, tps: &[Tp]) {
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
pub(crate) trait Detach: rdkafka::Message {
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
pub(crate) fn detach(m: &rdkafka::message::BorrowedMessage<'_>) -> OwnedMessage {
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
pub(crate) struct Context {
    pub(crate) shared: Arc<Mutex<Shared>>,
    pub(crate) log: Arc<ClientLog>,
}

impl Context {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(crate) fn commit_list(offsets: &[(String, i32, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for (t, p, o) in offsets {
        let _ = tpl.add_partition_offset(t, *p, Offset::Offset(*o));
    }
    tpl
}

impl ClientContext for Context {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(&error, reason);
    }
}

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
                // Delayed retries and parked records of revoked partitions are
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

pub(crate) fn commit_pending(
    consumer: &StreamConsumer<Context>,
    context: &Context,
    mode: CommitMode,
) {
    let offsets = context.lock().tracker.committable();
    if !offsets.is_empty() {
        if let Err(e) = consumer.commit(&commit_list(&offsets), mode) {
            tracing::warn!(error = %e, "offset commit failed; later offsets will cover it");
        }
    }
}

/// How long a consumer may go without a `receive` before [`keep_alive`]
/// serves it: a fifth of `max.poll.interval.ms`, between 200 ms and 10 s.
pub(crate) fn keep_alive_after(config: &KafkaConfig) -> Duration {
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
pub(crate) fn keep_alive(
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
pub(crate) struct Settler {
    pub(crate) inner: Arc<Inner>,
    pub(crate) context: Context,
    /// The OJS queue name.
    pub(crate) queue: Arc<str>,
    pub(crate) source: Source,
    pub(crate) max_deliveries: Option<u32>,
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

/// How long a consumer's fetch may wait at the broker for a record. Not
/// every broker answers a waiting fetch when a record arrives (tansu, the
/// Kafka-compatible broker of this project's tests, answers it when the
/// wait runs out): with librdkafka's 500 ms a record pushed to an idle
/// queue reached an OJS FETCH after 220 ms, and after 9–16 ms with 25 ms.
/// Brokers that do answer at once are not slowed; an idle consumer sends
/// some 40 fetches a second to each broker. `librdkafka_options` overrides
/// it.
const FETCH_WAIT_MAX_MS: &str = "25";

impl KafkaConsumer {
    pub(crate) fn new(
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
            .set("session.timeout.ms", config.session_timeout_ms.to_string())
            .set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
        apply_overrides(&mut c, config)?;
        let context = Context {
            log: inner.log.clone(),
            ..Context::default()
        };
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
    pub(crate) fn wake_up(&self) {
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
    pub(crate) fn bound_partitions(&self) {
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

    pub(crate) fn commit_pending(&self, mode: CommitMode) {
        commit_pending(&self.consumer, &self.context, mode);
    }

    pub(crate) fn not_before<M: Detach>(m: &M) -> Option<i64> {
        m.header_parts()
            .find(|(name, _)| *name == NOT_BEFORE_HEADER.as_bytes())
            .and_then(|(_, value)| std::str::from_utf8(value?).ok()?.parse().ok())
    }

    /// The interned name of a subscribed topic (no allocation per record).
    pub(crate) fn topic_name(&self, topic: &str) -> Arc<str> {
        self.topics
            .iter()
            .find(|t| &***t == topic)
            .cloned()
            .unwrap_or_else(|| Arc::from(topic))
    }

    /// Registers received records (one lock for the batch); each becomes a
    /// delivery now, or is held (detached) until due.
    pub(crate) fn accept_all<M: Detach>(&self, batch: &[M], out: &mut Vec<Delivery>) {
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

    /// Whether a record of the retry topic belongs to another queue topic
    /// (another deployment sharing the retry topic): it is not ours to
    /// deliver.
    fn foreign_retry<M: Detach>(&self, m: &M, tp: &Tp) -> bool {
        let (Some(queue_topic), Some(retry_topic)) = (self.topics.first(), self.topics.last())
        else {
            return false;
        };
        if self.topics.len() < 2 || tp.0 != *retry_topic {
            return false;
        }
        m.header_parts()
            .find(|(name, _)| *name == ORIGIN_TOPIC_HEADER.as_bytes())
            .and_then(|(_, value)| value)
            .is_some_and(|origin| origin != queue_topic.as_bytes())
    }

    pub(crate) fn accept<M: Detach>(
        &self,
        m: &M,
        tp: Tp,
        generation: u64,
        out: &mut Vec<Delivery>,
    ) {
        if self.foreign_retry(m, &tp) {
            // Its own deployment's group reads it; this group only moves
            // past it.
            let settled = self
                .context
                .lock()
                .tracker
                .settle(&tp, m.offset(), generation);
            if settled.is_err() {
                tracing::debug!(
                    partition = tp.1,
                    "a foreign retry record of a revoked partition is left"
                );
            }
            return;
        }
        match Self::not_before(m) {
            Some(due) if due > now_ms() => {
                let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                let mut shared = self.context.lock();
                shared.delayed.insert(
                    (due, seq),
                    DelayedRecord {
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

    pub(crate) fn set_retry_paused(&self, pause: bool) {
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

    pub(crate) fn take_due(&self, max: usize, out: &mut Vec<Delivery>) -> Option<i64> {
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
    pub(crate) fn delivery<M: Detach>(&self, m: &M, tp: Tp, generation: u64) -> Delivery {
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
    pub(crate) async fn poll_batch(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
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

    async fn ready(&mut self, limit: Duration) -> Result<bool> {
        let deadline = Instant::now() + limit;
        let _poll = self.poll_lock.clone().lock_owned().await;
        loop {
            let assigned = self.consumer.assignment().is_ok_and(|a| a.count() > 0);
            if assigned {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            // The join happens while polling; a record that comes meanwhile
            // waits (parked) for the next `receive`.
            let consumer = self.consumer.clone();
            let mut stream = consumer.stream();
            let step = deadline.min(Instant::now() + Duration::from_millis(100));
            match tokio::time::timeout_at(step, stream.next()).await {
                Ok(Some(Ok(m))) => self.context.lock().parked.push_back(m.detach()),
                Ok(Some(Err(e))) => return Err(kafka_error(&e)),
                Ok(None) | Err(_) => {}
            }
        }
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
/// again exactly as it came in); the names of `ojs_queue::header` are not
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
