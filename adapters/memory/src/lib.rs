//! The in-memory queue backend: a complete [`QueueAdapter`] that lives inside
//! the process (`memory://NAME`).
//!
//! It is a product feature, not a test double: the daemon uses it to bridge
//! within one process, demos run on it, and it passes the same acceptance
//! suite as the broker adapters. It keeps nothing across restarts; use the
//! embedded `local://` broker for durability.
//!
//! Delivery semantics: at least once. A received message is invisible to other
//! consumers for the consumer's visibility timeout; it comes back when that
//! ends, when it is nacked, or when its consumer is dropped. Within a queue,
//! higher priority first, then publish order.
//!
//! ```no_run
//! # async fn demo() -> ojs_core::Result<()> {
//! use ojs_adapter_memory::MemoryAdapter;
//! use ojs_core::{ConsumerOptions, OutgoingMessage, QueueAdapter};
//! use std::time::Duration;
//!
//! let adapter = MemoryAdapter::named("demo");
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! let mut consumer = adapter.consumer("default", ConsumerOptions::default()).await?;
//! for delivery in consumer.receive(10, Duration::from_secs(1)).await? {
//!     delivery.ack().await?;
//! }
//! # Ok(()) }
//! ```

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ojs_core::adapter::{admit, publish_outcome};
use ojs_core::{
    Acknowledger, Consumer, ConsumerOptions, DeadLetterReason, Delivery, Error, Headers, Health,
    Nack, OutgoingMessage, QueueAdapter, Result, Source,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Default message size limit: generous, but bounded so that a runaway
/// producer fails loudly instead of exhausting memory.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Settings of an in-memory adapter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Largest accepted message (body + headers), bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

fn default_max_message_bytes() -> usize {
    DEFAULT_MAX_MESSAGE_BYTES
}

impl MemoryConfig {
    /// Parses `memory://NAME[?max_message_bytes=N]` into the broker name and
    /// the settings, with `settings` over them.
    pub fn from_url_with(
        url: &str,
        settings: Vec<(String, ojs_core::settings::SettingValue)>,
    ) -> Result<(String, MemoryConfig)> {
        let (base, query) = ojs_core::settings::split_query(url)?;
        let name = base
            .strip_prefix("memory://")
            .ok_or_else(|| Error::InvalidConfig {
                field: "url".into(),
                reason: "a memory adapter URL is memory://NAME".into(),
            })?
            .trim_end_matches('/');
        let items = query
            .into_iter()
            .map(|(k, v)| (k, ojs_core::settings::SettingValue::Text(v)))
            .chain(settings);
        let config = ojs_core::settings::overlay(&MemoryConfig::default(), items)?;
        let name = if name.is_empty() { "default" } else { name };
        Ok((name.to_owned(), config))
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

#[derive(Debug, Clone)]
struct Stored {
    seq: u64,
    payload: Bytes,
    headers: Headers,
    key: Option<Bytes>,
    message_id: Option<String>,
    priority: i32,
    /// Deliveries so far.
    deliveries: u32,
}

#[derive(Debug)]
struct InFlight {
    message: Stored,
    deadline: Instant,
    consumer: u64,
    max_deliveries: Option<u32>,
}

/// Hashes delivery tags, which are a counter: one multiply spreads them
/// over the table's buckets (an odd factor permutes the low bits) and its
/// per-entry tags (the top bits). SipHash, the default, cost 4–6 % of
/// memory → memory for the same job.
#[derive(Debug, Default, Clone, Copy)]
struct TagHasher(u64);

impl Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(self.0 ^ u64::from(*byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Debug, Default)]
struct QueueState {
    /// Ready messages: highest priority first, then publish order.
    ready: BTreeMap<(Reverse<i32>, u64), Stored>,
    /// Delayed retries and scheduled messages, by due time.
    delayed: BTreeMap<(Instant, u64), Stored>,
    /// Delivered, not yet settled, by delivery tag.
    in_flight: HashMap<u64, InFlight, BuildHasherDefault<TagHasher>>,
    /// No lease in `in_flight` ends before this (it may be earlier than the
    /// earliest: settles and extends leave it as it was). Every receive
    /// looks for expired leases and for when to look again; with this it
    /// walks the leases only when one may have ended, not on every receive
    /// (thousands of leases for a batch of hundreds).
    leases_end_after: Option<Instant>,
    /// Dead letters, in arrival order.
    dead: BTreeMap<u64, Stored>,
}

impl QueueState {
    fn make_ready(&mut self, message: Stored) {
        self.ready
            .insert((Reverse(message.priority), message.seq), message);
    }

    /// Returns a delivered message to the queue, or to the dead letters once
    /// it has been delivered `max_deliveries` times.
    fn release(&mut self, flight: InFlight, now: Instant, delay: Duration) {
        let InFlight {
            mut message,
            max_deliveries,
            ..
        } = flight;
        if max_deliveries.is_some_and(|max| message.deliveries >= max) {
            DeadLetterReason::of(
                ojs_core::DeadLetterKind::MaxDeliveries,
                format!(
                    "delivered {} times without being acknowledged",
                    message.deliveries
                ),
            )
            .write_headers(&mut message.headers);
            self.dead.insert(message.seq, message);
        } else if delay.is_zero() {
            self.make_ready(message);
        } else {
            self.delayed.insert((now + delay, message.seq), message);
        }
    }

    /// Moves due delayed messages to ready and expired leases back.
    fn reclaim(&mut self, now: Instant) {
        while let Some(entry) = self.delayed.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let message = entry.remove();
            self.make_ready(message);
        }
        if self.leases_end_after.is_none_or(|at| at > now) {
            return;
        }
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(tag, _)| *tag)
            .collect();
        for tag in expired {
            if let Some(flight) = self.in_flight.remove(&tag) {
                self.release(flight, now, Duration::ZERO);
            }
        }
        self.leases_end_after = self.in_flight.values().map(|f| f.deadline).min();
    }

    /// Holds a delivered message until it is settled or its lease ends.
    fn lease(&mut self, tag: u64, flight: InFlight) {
        let end = flight.deadline;
        self.leases_end_after = Some(self.leases_end_after.map_or(end, |at| at.min(end)));
        self.in_flight.insert(tag, flight);
    }

    /// The next instant at which something becomes ready by itself (or
    /// may: a lease settled or extended since is found then, and skipped).
    fn next_wake(&self) -> Option<Instant> {
        let delayed = self.delayed.keys().next().map(|(at, _)| *at);
        let lease = self.leases_end_after;
        match (delayed, lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    state: Mutex<QueueState>,
    notify: Notify,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that loses messages, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Shared state of one in-memory broker.
#[derive(Debug, Default)]
struct Broker {
    queues: Mutex<HashMap<String, Arc<Queue>>>,
    seq: AtomicU64,
    ids: AtomicU64,
}

impl Broker {
    fn queue(&self, name: &str) -> Arc<Queue> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.entry(name.to_owned()).or_default().clone()
    }

    fn remove(&self, name: &str) {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.remove(name);
    }
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Broker>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Arc<Broker>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// A handle on an in-memory broker. Handles made by [`MemoryAdapter::named`]
/// with the same name, or by [`MemoryAdapter::connect`], share one broker.
#[derive(Debug)]
pub struct MemoryAdapter {
    broker: Arc<Broker>,
    config: MemoryConfig,
    closed: AtomicBool,
}

impl MemoryAdapter {
    /// A new, private broker.
    pub fn new(config: MemoryConfig) -> Self {
        MemoryAdapter {
            broker: Arc::new(Broker::default()),
            config,
            closed: AtomicBool::new(false),
        }
    }

    /// A handle on the process-wide broker called `name` (`memory://NAME`),
    /// created on first use.
    pub fn named(name: &str) -> Self {
        let broker = registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_owned())
            .or_default()
            .clone();
        MemoryAdapter {
            broker,
            config: MemoryConfig::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// Another handle on the same broker, as a second connection would be.
    pub fn connect(&self) -> Self {
        MemoryAdapter {
            broker: self.broker.clone(),
            config: self.config.clone(),
            closed: AtomicBool::new(false),
        }
    }

    /// Replaces the settings of this handle (builder style).
    pub fn with_config(mut self, config: MemoryConfig) -> Self {
        self.config = config;
        self
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }
}

fn delay_until(deliver_at: Option<chrono::DateTime<chrono::Utc>>) -> Duration {
    deliver_at
        .and_then(|at| (at - chrono::Utc::now()).to_std().ok())
        .unwrap_or(Duration::ZERO)
}

#[async_trait]
impl QueueAdapter for MemoryAdapter {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn max_message_bytes(&self) -> usize {
        self.config.max_message_bytes
    }

    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        let (total, accepted, failed) = admit(
            messages,
            self.config.max_message_bytes,
            self.check_open().is_err(),
        )?;
        let q = self.broker.queue(queue);
        {
            let now = Instant::now();
            let mut state = q.lock();
            for (_, m) in accepted {
                let delay = delay_until(m.deliver_at);
                let stored = Stored {
                    seq: self.broker.seq.fetch_add(1, Ordering::Relaxed),
                    payload: m.payload,
                    headers: m.headers,
                    key: m.key,
                    message_id: m.message_id,
                    priority: m.priority,
                    deliveries: 0,
                };
                if delay.is_zero() {
                    state.make_ready(stored);
                } else {
                    state.delayed.insert((now + delay, stored.seq), stored);
                }
            }
        }
        q.notify.notify_waiters();
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        self.check_open()?;
        Ok(Box::new(MemoryConsumer {
            id: self.broker.ids.fetch_add(1, Ordering::Relaxed),
            queue_name: Arc::from(queue),
            queue: self.broker.queue(queue),
            broker: self.broker.clone(),
            options,
        }))
    }

    async fn health(&self) -> Health {
        match self.check_open() {
            Ok(()) => Health::ok("in-process broker"),
            Err(e) => Health::down(e.to_string()),
        }
    }

    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        self.broker.remove(queue);
        Ok(())
    }

    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let q = self.broker.queue(queue);
        let mut state = q.lock();
        state.reclaim(Instant::now());
        Ok(Some((state.ready.len() + state.delayed.len()) as u64))
    }

    async fn close(&self) -> Result<()> {
        // Publishes complete synchronously, so nothing is pending to flush.
        self.closed.store(true, Ordering::Release);
        Ok(())
    }
}

/// A consumer of one in-memory queue (or its dead letters).
#[derive(Debug)]
pub struct MemoryConsumer {
    id: u64,
    queue_name: Arc<str>,
    queue: Arc<Queue>,
    broker: Arc<Broker>,
    options: ConsumerOptions,
}

impl MemoryConsumer {
    fn take(&self, max: usize, now: Instant) -> (Vec<Delivery>, Option<Instant>) {
        let mut state = self.queue.lock();
        state.reclaim(now);
        let mut out = Vec::new();
        while out.len() < max {
            let message = match self.options.source {
                Source::Queue => state.ready.pop_first().map(|(_, m)| m),
                Source::DeadLetters => state.dead.pop_first().map(|(_, m)| m),
            };
            let Some(mut message) = message else { break };
            message.deliveries += 1;
            let tag = self.broker.ids.fetch_add(1, Ordering::Relaxed);
            let mut delivery = Delivery::new(
                message.payload.clone(),
                message.headers.clone(),
                message.deliveries,
                self.queue_name.clone(),
                Box::new(MemoryAcker {
                    queue: self.queue.clone(),
                    tag,
                }),
            );
            delivery.key = message.key.clone();
            delivery.message_id = message.message_id.clone();
            let max_deliveries = match self.options.source {
                Source::Queue => self.options.max_deliveries,
                // Dead letters are never dead-lettered again.
                Source::DeadLetters => None,
            };
            state.lease(
                tag,
                InFlight {
                    message,
                    deadline: now + self.options.visibility_timeout,
                    consumer: self.id,
                    max_deliveries,
                },
            );
            out.push(delivery);
        }
        (out, state.next_wake())
    }
}

#[async_trait]
impl Consumer for MemoryConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        loop {
            // Register interest before looking, so a publish between the look
            // and the wait is not missed.
            let notified = self.queue.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let (deliveries, next_wake) = self.take(max.max(1), now);
            if !deliveries.is_empty() || now >= deadline {
                return Ok(deliveries);
            }
            let wake = next_wake.map_or(deadline, |w| w.min(deadline));
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}

impl Drop for MemoryConsumer {
    fn drop(&mut self) {
        // A consumer that goes away gives its unsettled messages back at once,
        // as an AMQP channel close does.
        let now = Instant::now();
        let mut state = self.queue.lock();
        let mine: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(_, f)| f.consumer == self.id)
            .map(|(tag, _)| *tag)
            .collect();
        let released = !mine.is_empty();
        for tag in mine {
            if let Some(flight) = state.in_flight.remove(&tag) {
                state.release(flight, now, Duration::ZERO);
            }
        }
        drop(state);
        if released {
            self.queue.notify.notify_waiters();
        }
    }
}

#[derive(Debug)]
struct MemoryAcker {
    queue: Arc<Queue>,
    tag: u64,
}

impl MemoryAcker {
    /// Removes the message for good: an in-process step that never waits.
    fn settle(&self) -> Result<()> {
        let mut state = self.queue.lock();
        state
            .in_flight
            .remove(&self.tag)
            .map(|_| ())
            .ok_or(Error::DeliveryExpired)
    }
}

#[async_trait]
impl Acknowledger for MemoryAcker {
    async fn ack(&self) -> Result<()> {
        self.settle()
    }

    fn ack_now(&self) -> Option<Result<()>> {
        Some(self.settle())
    }

    /// A batch of this queue's deliveries under one lock, not one each.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let members =
            ojs_core::batch_of::<MemoryAcker>(batch, |m| Arc::ptr_eq(&m.queue, &self.queue))?;
        let mut settled = Vec::with_capacity(members.len());
        let results = {
            let mut state = self.queue.lock();
            members
                .iter()
                .map(|m| match state.in_flight.remove(&m.tag) {
                    Some(flight) => {
                        settled.push(flight);
                        Ok(())
                    }
                    None => Err(Error::DeliveryExpired),
                })
                .collect()
        };
        // The messages are freed after the lock is let go.
        drop(settled);
        Some(results)
    }

    async fn nack(&self, action: Nack, _delivery: ojs_core::DeliveryRef<'_>) -> Result<()> {
        {
            let mut state = self.queue.lock();
            let flight = state
                .in_flight
                .remove(&self.tag)
                .ok_or(Error::DeliveryExpired)?;
            match action {
                Nack::Retry { delay } => state.release(flight, Instant::now(), delay),
                Nack::DeadLetter(reason) => {
                    let mut message = flight.message;
                    reason.write_headers(&mut message.headers);
                    state.dead.insert(message.seq, message);
                }
            }
        }
        self.queue.notify.notify_waiters();
        Ok(())
    }

    async fn extend(&self, by: Duration) -> Result<()> {
        let mut state = self.queue.lock();
        let flight = state
            .in_flight
            .get_mut(&self.tag)
            .ok_or(Error::DeliveryExpired)?;
        flight.deadline = Instant::now() + by;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn five_second_lease() -> ConsumerOptions {
        ConsumerOptions {
            visibility_timeout: Duration::from_secs(5),
            ..ConsumerOptions::default()
        }
    }

    fn msg(body: &str) -> OutgoingMessage {
        OutgoingMessage::new(body.to_owned(), "text/plain")
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_nack_is_not_redelivered_before_its_delay() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        a.publish("q", vec![msg("x")]).await.unwrap();
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let d = c
            .receive(1, Duration::from_secs(1))
            .await
            .unwrap()
            .remove(0);
        d.nack(Nack::retry_after(Duration::from_secs(10)))
            .await
            .unwrap();
        let started = Instant::now();
        let again = c.receive(1, Duration::from_secs(60)).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].attempt, 2);
        assert!(started.elapsed() >= Duration::from_secs(10));
    }

    /// A batch mixing two queues' deliveries is not one adapter batch
    /// (`ack_batch` declines it): each is acked on its own queue, and none
    /// comes back after its lease.
    #[tokio::test(start_paused = true)]
    async fn ack_all_of_two_queues_acks_each_on_its_own() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        a.publish("q1", vec![msg("a"), msg("b")]).await.unwrap();
        a.publish("q2", vec![msg("c")]).await.unwrap();
        let opts = five_second_lease();
        let mut c1 = a.consumer("q1", opts.clone()).await.unwrap();
        let mut c2 = a.consumer("q2", opts).await.unwrap();
        let mut one = c1.receive(2, Duration::ZERO).await.unwrap();
        let two = c2.receive(1, Duration::ZERO).await.unwrap();
        assert_eq!((one.len(), two.len()), (2, 1));
        let last = one.pop().unwrap();
        let mixed = [&one[0], &two[0], &last];
        let results = Delivery::ack_all(&mixed).await;
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(mixed.iter().all(|d| d.is_settled()));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(c1.receive(2, Duration::ZERO).await.unwrap().is_empty());
        assert!(c2.receive(1, Duration::ZERO).await.unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn visibility_timeout_and_extend() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        a.publish("q", vec![msg("x")]).await.unwrap();
        let opts = five_second_lease();
        let mut c1 = a.consumer("q", opts.clone()).await.unwrap();
        let mut c2 = a.consumer("q", opts).await.unwrap();
        let d = c1.receive(1, Duration::ZERO).await.unwrap().remove(0);
        tokio::time::advance(Duration::from_secs(4)).await;
        d.extend(Duration::from_secs(5)).await.unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(
            c2.receive(1, Duration::ZERO).await.unwrap().is_empty(),
            "extended lease holds"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        let again = c2.receive(1, Duration::ZERO).await.unwrap();
        assert_eq!(again.len(), 1, "lease over: delivered again");
        assert!(matches!(d.ack().await, Err(Error::DeliveryExpired)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_consumer_gets_a_message_when_its_lease_ends_after_others_settled() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        a.publish("q", vec![msg("first"), msg("second")])
            .await
            .unwrap();
        let opts = five_second_lease();
        let mut c1 = a.consumer("q", opts.clone()).await.unwrap();
        let mut c2 = a.consumer("q", opts).await.unwrap();
        let start = Instant::now();
        let first = c1.receive(1, Duration::ZERO).await.unwrap().remove(0);
        tokio::time::advance(Duration::from_secs(1)).await;
        let _second = c1.receive(1, Duration::ZERO).await.unwrap().remove(0);
        // The earliest lease is settled: the next one ends at 6 s.
        first.ack().await.unwrap();
        let again = c2.receive(1, Duration::from_secs(30)).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(&again[0].payload[..], b"second");
        let waited = start.elapsed();
        assert!(
            (Duration::from_secs(6)..Duration::from_secs(7)).contains(&waited),
            "delivered again when its lease ended, not at the settled one's end or the wait's: {waited:?}"
        );
        assert!(
            c2.receive(1, Duration::ZERO).await.unwrap().is_empty(),
            "the first stays acked"
        );
    }

    #[tokio::test]
    async fn priority_then_publish_order() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        let mut low = msg("low");
        low.priority = -1;
        let mut high = msg("high");
        high.priority = 10;
        a.publish("q", vec![low, msg("a"), high, msg("b")])
            .await
            .unwrap();
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let got: Vec<_> = c
            .receive(10, Duration::ZERO)
            .await
            .unwrap()
            .into_iter()
            .map(|d| String::from_utf8(d.payload.to_vec()).unwrap())
            .collect();
        assert_eq!(got, ["high", "a", "b", "low"]);
    }

    #[tokio::test]
    async fn a_message_given_back_returns_to_its_place_in_publish_order() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        a.publish("q", ["a", "b", "c", "d"].map(msg).to_vec())
            .await
            .unwrap();
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        let first = c.receive(2, Duration::ZERO).await.unwrap();
        // Given back in the reverse order, both ahead of c and d.
        for d in first.iter().rev() {
            d.nack(Nack::retry_after(Duration::ZERO)).await.unwrap();
        }
        let body = |d: &Delivery| String::from_utf8(d.payload.to_vec()).unwrap();
        let again: Vec<_> = c
            .receive(10, Duration::ZERO)
            .await
            .unwrap()
            .iter()
            .map(body)
            .collect();
        assert_eq!(again, ["a", "b", "c", "d"]);
        assert_eq!(a.depth("q").await.unwrap(), Some(0));
    }

    #[tokio::test]
    async fn scheduled_messages_wait_for_their_time() {
        let a = MemoryAdapter::new(MemoryConfig::default());
        let mut m = msg("later");
        m.deliver_at = Some(chrono::Utc::now() + chrono::Duration::milliseconds(300));
        a.publish("q", vec![m]).await.unwrap();
        let mut c = a.consumer("q", ConsumerOptions::default()).await.unwrap();
        assert!(c
            .receive(1, Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty());
        assert_eq!(a.depth("q").await.unwrap(), Some(1));
        assert_eq!(c.receive(1, Duration::from_secs(2)).await.unwrap().len(), 1);
    }
}
