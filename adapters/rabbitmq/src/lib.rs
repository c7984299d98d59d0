//! RabbitMQ adapter (lapin) following the OJS AMQP binding's topology with
//! protobuf bodies (docs/design.md §4 "RabbitMQ").
//!
//! Delivery semantics: at least once.
//! * `publish` waits for **publisher confirms** with `mandatory` set: a broker
//!   Nack or a returned (unroutable) message fails that message (retryable:
//!   a missing queue or binding is the destination's state). When the
//!   connection drops, the adapter reconnects with backoff
//!   (min(2^(n−1), 60) s, ±25 % jitter), re-declares its topology and
//!   publishes the unconfirmed messages again until `publish_timeout_secs`;
//!   what is still unconfirmed then is reported per message, never dropped.
//! * Consumers use `basic.qos` prefetch and resubscribe after reconnecting.
//!   Unacknowledged deliveries of a lost channel are redelivered by the
//!   broker; settling them afterwards reports [`Error::DeliveryExpired`].
//! * A retry (`Nack::Retry`) or dead-letter nack republishes a copy (with
//!   the attempt counted up, or with `x-ojs-error-type`/`x-ojs-error-message`) under confirms,
//!   and only then acks the original; if the copy cannot be confirmed the
//!   original is requeued. Delays go through per-delay TTL queues
//!   `ojs.queue.retry.{queue}.{delay_ms}` that dead-letter back to
//!   `ojs.exchange.direct`.
//!
//! ```no_run
//! # async fn demo() -> ojs_queue::Result<()> {
//! use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
//! use ojs_queue::{OutgoingMessage, QueueAdapter};
//! let adapter = RabbitAdapter::connect(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

mod ack;
mod config;
mod connection;
mod consume;
mod headers;
mod priority;
mod publish;
mod topology;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ojs_queue::{admit, publish_outcome};
use ojs_queue::{
    Consumer, ConsumerOptions, Error, Health, OutgoingMessage, QueueAdapter, Result, Source,
};
use tokio::time::Instant;

pub use config::{
    bucket_delay_ms, dead_letter_queue_name, queue_name, retry_queue_name, RabbitConfig,
    CLIENT_URL_OPTIONS, DIRECT_EXCHANGE, DLX_EXCHANGE, RETRY_EXCHANGE,
};
pub use headers::{
    properties, properties_keeping, received, received_from_wire, to_wire, Received, KEY_HEADER,
};
pub use ojs_queue::settings::Topology;
pub use priority::ojs_priority as priority_of_rank;

/// Runs a broker call no longer than `deadline`. lapin's RPCs have no
/// timeout of their own, and on a half-open connection (a broker that went
/// away without closing the socket) they would wait forever; an expired call
/// is a retryable [`Error::Timeout`] and the caller treats the connection as
/// broken.
async fn within<T>(
    deadline: Instant,
    call: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let budget = deadline.saturating_duration_since(Instant::now());
    tokio::time::timeout_at(deadline, call)
        .await
        .unwrap_or(Err(Error::Timeout(budget)))
}

use crate::connection::Session;
use crate::consume::RabbitConsumer;
use crate::publish::{blocked_error, grpcq_route, Destination};
use topology::{amqp_error, fits, short};

#[derive(Debug)]
struct Inner {
    config: RabbitConfig,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    closed: AtomicBool,
}

/// The URL without its password, for logs.
fn redact(url: &str) -> String {
    ojs_core::redact::url(url)
}

/// A connection to RabbitMQ.
#[derive(Debug, Clone)]
pub struct RabbitAdapter {
    inner: Arc<Inner>,
}

impl RabbitAdapter {
    /// Validates the settings and connects (once; later losses reconnect).
    pub async fn connect(config: RabbitConfig) -> Result<Self> {
        config.validate()?;
        let inner = Arc::new(Inner {
            session: tokio::sync::Mutex::new(None),
            closed: AtomicBool::new(false),
            config,
        });
        inner
            .session(Instant::now() + Duration::from_secs(10))
            .await?;
        Ok(RabbitAdapter { inner })
    }

    /// The settings in force.
    pub fn config(&self) -> &RabbitConfig {
        &self.inner.config
    }
}

#[async_trait]
impl QueueAdapter for RabbitAdapter {
    fn kind(&self) -> &'static str {
        "rabbitmq"
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
        let now = chrono::Utc::now();
        let items = accepted
            .into_iter()
            .map(|(i, m)| {
                // Scheduled messages wait in a TTL queue like delayed retries.
                let destination = match m.deliver_at.and_then(|at| (at - now).to_std().ok()) {
                    Some(d) if !d.is_zero() => Destination::Delayed(bucket_delay_ms(d)),
                    _ if self.inner.config.grpcq_exchanges && grpcq_route(&m).is_some() => {
                        Destination::Grpcq
                    }
                    _ => Destination::Queue,
                };
                (i, destination, m)
            })
            .collect();
        failed.extend(self.inner.send(queue, items, None).await);
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let mut consumer = RabbitConsumer {
            inner: self.inner.clone(),
            queue: Arc::from(queue),
            options,
            live: None,
            failures: 0,
            resubscribe_at: None,
            last_failure: String::new(),
        };
        consumer
            .subscribe(Instant::now() + Duration::from_secs(10))
            .await?;
        Ok(Box::new(consumer))
    }

    fn is_reserved(&self, queue: &str) -> bool {
        self.inner.config.is_reserved(queue)
    }

    async fn prepare(&self, queue: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let session = self.inner.session(deadline).await?;
        within(
            deadline,
            self.inner.declare_queue(&session, queue, Source::Queue),
        )
        .await
    }

    async fn open_reply_queue(&self, queue: &str) -> Result<()> {
        self.inner.config.topology.may_create_reply_queue(queue)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let session = self.inner.session(deadline).await?;
        let name = self.inner.config.queue_name_of(queue);
        let (exchange, routing_key) = self.inner.config.publish_route_of(queue);
        within(deadline, async {
            topology::declare_reply_queue(&session.connection, &name).await?;
            topology::bind(&session.connection, &name, &exchange, &routing_key).await
        })
        .await?;
        // The consumer must not declare it again with the queue arguments.
        session.declared().insert(queue.to_owned());
        Ok(())
    }

    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let session = self.inner.session(deadline).await?;
        let name = self.inner.config.queue_name_of(queue);
        within(deadline, topology::delete_queue(&session.connection, &name)).await?;
        session.declared().remove(queue);
        Ok(())
    }

    async fn health(&self) -> Health {
        let deadline = Instant::now() + Duration::from_secs(2);
        let s = match self.inner.session(deadline).await {
            Ok(s) => s,
            Err(e) => return Health::down(e.to_string()),
        };
        if s.connection.status().blocked() {
            return Health::down(blocked_error().to_string());
        }
        // A socket that is open says nothing about a broker that stopped
        // answering (a frozen node, a link that black-holes: heartbeats
        // notice only after twice their interval). One round trip does:
        // basic.qos on the publishing channel needs no permission and
        // changes nothing for a channel that never consumes; a late answer
        // is consumed by lapin like any other.
        let probe = within(deadline, async {
            s.publisher
                .basic_qos(0, BasicQosOptions::default())
                .await
                .map_err(|e| amqp_error(&e))
        })
        .await;
        match probe {
            Ok(()) => Health::ok(format!("connected to {}", redact(&self.inner.config.url))),
            Err(Error::Timeout(_)) => Health::down("connected, but no answer within 2s"),
            Err(e) => Health::down(e.to_string()),
        }
    }

    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        fits(&self.inner.config.queue_name_of(queue), "queue name")?;
        let s = self.inner.session(deadline).await?;
        within(deadline, async {
            // A passive declare that fails closes its channel: use a scratch one.
            let ch = s
                .connection
                .create_channel()
                .await
                .map_err(|e| amqp_error(&e))?;
            let result = ch
                .queue_declare(
                    self.inner.config.queue_name_of(queue).as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            let _ = ch.close(200, "depth".into()).await;
            match result {
                Ok(q) => Ok(Some(u64::from(q.message_count()))),
                Err(e) if topology::amqp_code(&e) == Some(404) => Ok(Some(0)),
                Err(e) => Err(amqp_error(&e)),
            }
        })
        .await
    }

    async fn close(&self) -> Result<()> {
        self.inner.closed.store(true, Ordering::Release);
        let session = self.inner.session.lock().await.take();
        if let Some(s) = session {
            // Every publish awaited its confirms; this only catches stragglers.
            let _ = s.publisher.wait_for_confirms().await;
            let _ = s.connection.close(200, "closed by ojs-bridge".into()).await;
        }
        Ok(())
    }
}
