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
//! # async fn demo() -> ojs_queue::Result<()> {
//! use ojs_adapter_memory::MemoryAdapter;
//! use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{admit, publish_outcome};
use ojs_queue::{Consumer, ConsumerOptions, Error, Health, OutgoingMessage, QueueAdapter, Result};
use tokio::time::Instant;

mod ack;
mod broker;
mod config;
mod consume;

use crate::broker::{registry, Broker, Stored};
pub use config::{MemoryConfig, DEFAULT_MAX_MESSAGE_BYTES};
pub use consume::MemoryConsumer;

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

    /// Messages of `queue` handed out and not settled yet, leases past
    /// their deadline included (what a broker's management view calls
    /// unacknowledged): what a test reads to see that a consumer settled
    /// what it took.
    pub fn in_flight(&self, queue: &str) -> usize {
        self.broker.queue(queue).lock().in_flight.len()
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

#[cfg(test)]
mod tests {
    use super::*;
    use ojs_queue::{Delivery, Nack};

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
