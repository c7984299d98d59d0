//! Consuming: a subscription with `basic.qos` prefetch on a channel of its
//! own, resubscribed after the connection breaks (with backoff when it keeps
//! breaking); a channel nobody reads is closed so its deliveries come back.
//! With `prefetch = 0` nothing is subscribed: each receive takes messages
//! with `basic.get`, so none waits in this process between receives where
//! another process's receive could have had it (the OJS API's replicas).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicGetOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::{BrokerErrorKind, Consumer, ConsumerOptions, Delivery, Error, Result, Source};
use tokio::time::Instant;

use crate::ack::RabbitAcker;
use crate::connection::Session;
use crate::{amqp_error, fits, headers, topology, within, Inner};

/// How long a channel call may take beyond the caller's own deadline (a
/// `basic.get` at the end of a receive, a channel close).
const CALL_GRACE: Duration = Duration::from_secs(5);

/// A consumer's channel and its delivery stream.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) channel: Channel,
    /// The subscription; none when messages are pulled (`prefetch = 0`).
    pub(crate) stream: Option<lapin::Consumer>,
}

/// Closes a consumer channel that is still open, without waiting. A channel
/// nobody reads any more must go: the broker keeps up to `prefetch`
/// deliveries on it, unacknowledged and never redelivered, for as long as
/// it is open (the connection lives on for the publisher and the next
/// subscription).
pub(crate) fn close_in_background(channel: Channel, why: &'static str) {
    if !channel.status().connected() {
        return;
    }
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = channel.close(200, why.into()).await;
        });
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // Replaced after a stream error, or its consumer dropped.
        close_in_background(self.channel.clone(), "consumer closed");
    }
}

/// A channel being set up for a consumer: closed again unless the
/// subscription completes. A subscription cut short — its deadline drops
/// the future between `basic_consume` reaching the broker and its answer —
/// would otherwise leave a registered consumer behind that holds a prefetch
/// window of deliveries nobody reads.
pub(crate) struct PendingChannel {
    pub(crate) channel: Channel,
    pub(crate) subscribed: bool,
}

impl Drop for PendingChannel {
    fn drop(&mut self) {
        if !self.subscribed {
            close_in_background(self.channel.clone(), "subscription abandoned");
        }
    }
}

/// A consumer of `ojs.queue.{queue}` (or its dead letters).
#[derive(Debug)]
pub struct RabbitConsumer {
    pub(crate) inner: Arc<Inner>,
    pub(crate) queue: Arc<str>,
    pub(crate) options: ConsumerOptions,
    pub(crate) live: Option<Live>,
    /// Subscriptions that failed in a row with nothing delivered: the
    /// first is followed at once (a broker restart), each further one
    /// waits longer, so a connection that breaks every time it delivers
    /// does not become a reconnect loop against the broker.
    pub(crate) failures: u32,
    /// When the next subscription may be made.
    pub(crate) resubscribe_at: Option<Instant>,
    /// Why the last subscription failed or ended (for the error a receive
    /// returns while the next one waits).
    pub(crate) last_failure: String,
}

impl RabbitConsumer {
    /// The subscription failed or ended: the next waits if it keeps doing so.
    pub(crate) fn lost(&mut self, cause: impl Into<String>) {
        self.live = None;
        self.last_failure = cause.into();
        self.failures += 1;
        if self.failures > 1 {
            let delay = reconnect_delay(
                self.failures - 1,
                Duration::from_secs(self.inner.config.max_backoff_secs),
            );
            tracing::warn!(
                queue = %self.queue,
                failures = self.failures,
                delay_ms = delay.as_millis() as u64,
                "rabbitmq subscription keeps failing before delivering anything; waiting before the next"
            );
            self.resubscribe_at = Some(Instant::now() + delay);
        }
    }

    pub(crate) async fn subscribe(&mut self, deadline: Instant) -> Result<()> {
        let session = self.inner.session(deadline).await?;
        // Reconnecting may have used up the caller's wait: the subscription
        // still gets a second of its own (a restarted broker answers
        // slowly, and a subscription given milliseconds only times out).
        let deadline = deadline.max(Instant::now() + Duration::from_secs(1));
        match within(deadline, self.open_stream(&session)).await {
            Ok(live) => {
                self.live = Some(live);
                Ok(())
            }
            Err(e) => {
                if matches!(e, Error::Timeout(_)) {
                    // A connection that does not answer is as good as gone.
                    self.inner.invalidate(&session).await;
                }
                Err(e)
            }
        }
    }

    pub(crate) async fn open_stream(&self, session: &Session) -> Result<Live> {
        self.inner
            .declare_queue(session, &self.queue, self.options.source)
            .await?;
        let mut pending = PendingChannel {
            channel: session
                .connection
                .create_channel()
                .await
                .map_err(|e| amqp_error(&e))?,
            subscribed: false,
        };
        let channel = &pending.channel;
        let source = self.source();
        fits(&source, "queue name")?;
        if self.options.prefetch == 0 {
            pending.subscribed = true;
            return Ok(Live {
                channel: pending.channel.clone(),
                stream: None,
            });
        }
        channel
            .basic_qos(self.options.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| amqp_error(&e))?;
        let tag = format!("ojs-bridge-{}", uuid::Uuid::new_v4().simple());
        let stream = channel
            .basic_consume(
                source.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| topology::with_kind(match topology::amqp_code(&e) {
                Some(403) => Error::broker(
                    "rabbitmq",
                    format!("consuming from queue {source:?}: access refused — the user lacks the `read` permission on it ({e})"),
                    false,
                ),
                Some(404) => Error::broker(
                    "rabbitmq",
                    format!("queue {source:?} does not exist ({e})"),
                    true,
                ),
                _ => amqp_error(&e),
            }, &e))?;
        pending.subscribed = true;
        Ok(Live {
            channel: pending.channel.clone(),
            stream: Some(stream),
        })
    }

    fn source(&self) -> String {
        match self.options.source {
            Source::Queue => self.inner.config.queue_name_of(&self.queue),
            Source::DeadLetters => self.inner.config.dead_letter_queue_of(&self.queue),
        }
    }

    /// Pull mode: up to `max` messages with `basic.get`, polling until one
    /// comes or `deadline`. `Err` is the channel's failure.
    async fn pull(
        &self,
        channel: &Channel,
        max: usize,
        deadline: Instant,
    ) -> Result<Vec<lapin::message::Delivery>> {
        let source = self.source();
        let mut raw = Vec::new();
        loop {
            while raw.len() < max {
                // Bounded like every other call on the channel: on a
                // half-open connection `basic.get` would wait forever.
                let get =
                    channel.basic_get(source.as_str().into(), BasicGetOptions { no_ack: false });
                let answer = within(deadline.max(Instant::now() + CALL_GRACE), async {
                    get.await.map_err(|e| amqp_error(&e))
                })
                .await?;
                match answer {
                    Some(m) => raw.push(m.delivery),
                    None => break,
                }
            }
            let now = Instant::now();
            if !raw.is_empty() || now >= deadline {
                return Ok(raw);
            }
            // An empty queue is asked again this often while the receive
            // may wait: the latency a pulled message can have.
            tokio::time::sleep_until(deadline.min(now + Duration::from_millis(10))).await;
        }
    }

    pub(crate) fn delivery(&self, d: lapin::message::Delivery) -> Delivery {
        let mut r = headers::received(&d.properties, d.redelivered);
        if self.options.source == Source::DeadLetters {
            // A dead letter is redelivered when it is listed and left
            // (`Nack::Release`): that is a look, not an attempt. Its
            // attempts are the ones its header recorded.
            r.attempt = r.base_attempt;
        }
        let payload = Bytes::from(d.data);
        let acker = RabbitAcker {
            inner: self.inner.clone(),
            acker: d.acker,
            queue: self.queue.clone(),
            source: self.options.source,
            max_deliveries: self.options.max_deliveries,
            // A copy (retry, dead letter) goes out with the rank it came
            // with; a message without one ranks as OJS 0.
            priority: match (r.rank, self.inner.config.max_priority) {
                (Some(rank), Some(max)) if !self.inner.config.quorum_queues => {
                    crate::priority::ojs_priority(rank, max)
                }
                _ => 0,
            },
            attempt: r.attempt,
            typed: r.typed,
        };
        let mut delivery = Delivery::new(
            payload,
            r.headers,
            r.attempt,
            self.queue.clone(),
            Box::new(acker),
        );
        delivery.key = r.key;
        delivery.message_id = r.message_id;
        delivery
    }
}

#[async_trait]
impl Consumer for RabbitConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        loop {
            if self
                .live
                .as_ref()
                .is_some_and(|l| !l.channel.status().connected())
            {
                self.lost("the channel closed");
            }
            if self.live.is_none() {
                if let Some(at) = self.resubscribe_at {
                    if at > deadline {
                        tokio::time::sleep_until(deadline).await;
                        // An error, not an empty batch: the daemon's health
                        // says this source is failing while it waits.
                        return Err(Error::broker(
                            "rabbitmq",
                            format!(
                                "the subscription to {} failed {} times in a row before delivering anything (last: {}); next attempt in {} ms",
                                self.queue,
                                self.failures,
                                self.last_failure,
                                at.saturating_duration_since(Instant::now()).as_millis()
                            ),
                            true,
                        )
                        .with_broker_kind(BrokerErrorKind::Unavailable));
                    }
                    tokio::time::sleep_until(at).await;
                    self.resubscribe_at = None;
                }
                if let Err(e) = self
                    .subscribe(deadline.max(Instant::now() + Duration::from_secs(1)))
                    .await
                {
                    if Instant::now() >= deadline || !e.is_retryable() {
                        return Err(e);
                    }
                    // 200 ms between attempts at least, longer as they
                    // keep failing.
                    self.lost(e.to_string());
                    let floor = Instant::now() + Duration::from_millis(200);
                    self.resubscribe_at =
                        Some(self.resubscribe_at.map_or(floor, |at| at.max(floor)));
                    continue;
                }
            }
            let Some(live) = self.live.as_mut() else {
                continue;
            };
            let Some(stream) = live.stream.as_mut() else {
                let channel = live.channel.clone();
                match self.pull(&channel, max, deadline).await {
                    Ok(raw) => {
                        self.failures = 0;
                        return Ok(raw.into_iter().map(|d| self.delivery(d)).collect());
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, queue = %self.queue, "rabbitmq basic.get failed; opening a new channel");
                        self.lost(e.to_string());
                        if Instant::now() >= deadline {
                            return Err(e);
                        }
                        continue;
                    }
                }
            };
            let first = match tokio::time::timeout_at(deadline, stream.next()).await {
                Err(_) => return Ok(Vec::new()),
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(e))) => {
                    tracing::warn!(error = %e, queue = %self.queue, "rabbitmq consumer failed; resubscribing");
                    self.lost(e.to_string());
                    continue;
                }
                Ok(None) => {
                    self.lost("the subscription ended");
                    continue;
                }
            };
            self.failures = 0;
            let mut raw = vec![first];
            while raw.len() < max {
                match stream.next().now_or_never() {
                    Some(Some(Ok(d))) => raw.push(d),
                    _ => break,
                }
            }
            return Ok(raw.into_iter().map(|d| self.delivery(d)).collect());
        }
    }

    async fn close(mut self: Box<Self>) -> Result<()> {
        if let Some(live) = self.live.take() {
            // Closing the channel hands unacknowledged deliveries back
            // (dropping it would too, without waiting: see `Live`).
            // Bounded: a broker that went away without closing the socket
            // never answers, and the broker hands the deliveries back when
            // the connection finally drops anyway.
            let closing = live.channel.close(200, "consumer closed".into());
            let _ = tokio::time::timeout(CALL_GRACE, closing).await;
        }
        Ok(())
    }
}
