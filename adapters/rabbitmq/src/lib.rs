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
//! # async fn demo() -> ojs_core::Result<()> {
//! use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
//! use ojs_core::{OutgoingMessage, QueueAdapter};
//! let adapter = RabbitAdapter::connect(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

mod config;
mod headers;
mod topology;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use ojs_core::adapter::{admit, publish_outcome};
use ojs_core::backoff::reconnect_delay;
use ojs_core::{
    header, Acknowledger, BrokerErrorKind, Consumer, ConsumerOptions, DeadLetterReason, Delivery,
    DeliveryRef, Error, FailedPublish, Health, Nack, OutgoingMessage, QueueAdapter, Result, Source,
};
use tokio::time::Instant;

pub use config::{
    bucket_delay_ms, dead_letter_queue_name, queue_name, retry_queue_name, RabbitConfig,
    CLIENT_URL_OPTIONS, DIRECT_EXCHANGE, DLX_EXCHANGE, RETRY_EXCHANGE,
};
pub use headers::{
    properties, properties_keeping, received, received_from_wire, to_wire, Received, KEY_HEADER,
};
pub use ojs_core::settings::Topology;

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

use topology::{amqp_error, fits, short};

/// One connection with its confirm-mode publishing channel, and what has
/// been declared on it.
#[derive(Debug)]
struct Session {
    connection: Connection,
    publisher: Channel,
    declared: Mutex<HashSet<String>>,
    /// Retry queues and when they were last declared (their `x-expires`
    /// timer restarts on each declaration).
    retry_declared: Mutex<HashMap<String, Instant>>,
}

impl Session {
    fn usable(&self) -> bool {
        self.connection.status().connected() && self.publisher.status().connected()
    }

    fn declared(&self) -> MutexGuard<'_, HashSet<String>> {
        self.declared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `ojs.exchange.direct` → `ojs.queue.{queue}`.
    Queue,
    /// `ojs.exchange.retry` → TTL queue → back to the queue.
    Delayed(u64),
    /// `ojs.exchange.dlx` → `ojs.queue.dlx.{queue}`.
    DeadLetters,
    /// A grpcq call the grpcq way: exchange = its `topic` header, routing
    /// key = its `action` header (`grpcq_exchanges`).
    Grpcq,
}

/// The grpcq topic and action of a message, when it is a grpcq call.
fn grpcq_route(message: &OutgoingMessage) -> Option<(&str, &str)> {
    if message.content_type() != Some(ojs_core::media::GRPCQ_PROTO) {
        return None;
    }
    let topic = message.headers.get_str(ojs_core::header::GRPCQ_TOPIC)?;
    let action = message.headers.get_str(ojs_core::header::GRPCQ_ACTION)?;
    Some((topic, action))
}

#[derive(Debug)]
struct Inner {
    config: RabbitConfig,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    closed: AtomicBool,
}

impl Inner {
    /// A usable session, reconnecting with backoff until `deadline`.
    async fn session(&self, deadline: Instant) -> Result<Arc<Session>> {
        // Another caller may hold the lock while it backs off between
        // reconnect attempts (up to a minute): wait no longer than our own
        // deadline, so a 2 s health check answers in 2 s.
        let mut guard = tokio::time::timeout_at(deadline, self.session.lock())
            .await
            .map_err(|_| {
                Error::broker(
                    "rabbitmq",
                    "reconnecting to the broker; not connected yet",
                    true,
                )
            })?;
        if let Some(s) = guard.as_ref() {
            if s.usable() {
                return Ok(s.clone());
            }
            tracing::warn!(url = %redact(&self.config.url), "rabbitmq connection lost; reconnecting");
        }
        *guard = None;
        let mut attempt = 0;
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            match within(deadline, self.open_session()).await {
                Ok(s) => {
                    let s = Arc::new(s);
                    *guard = Some(s.clone());
                    if attempt > 0 {
                        tracing::info!(attempts = attempt + 1, "rabbitmq reconnected");
                    }
                    return Ok(s);
                }
                Err(e) => {
                    attempt += 1;
                    let delay =
                        reconnect_delay(attempt, Duration::from_secs(self.config.max_backoff_secs));
                    if Instant::now() + delay > deadline {
                        return Err(e);
                    }
                    tracing::warn!(attempt, delay_ms = delay.as_millis() as u64, error = %e, "rabbitmq connect failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// The TLS settings of an `amqps://` connection (CA and client
    /// identity read from their files at each connect).
    fn tls(&self) -> Result<lapin::tcp::OwnedTLSConfig> {
        let read = |field: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| Error::InvalidConfig {
                field: field.into(),
                reason: format!("cannot read {}: {e}", path.display()),
            })
        };
        let cert_chain =
            match &self.config.ca_file {
                Some(p) => Some(String::from_utf8(read("ca_file", p)?).map_err(|_| {
                    Error::InvalidConfig {
                        field: "ca_file".into(),
                        reason: format!("{} is not a PEM file", p.display()),
                    }
                })?),
                None => None,
            };
        let identity = match (&self.config.cert_file, &self.config.key_file) {
            (Some(cert), Some(key)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                pem: read("cert_file", cert)?,
                key: read("key_file", key)?,
            }),
            _ => None,
        };
        Ok(lapin::tcp::OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }

    async fn open_session(&self) -> Result<Session> {
        let runtime = lapin::runtime::default_runtime().map_err(|e| amqp_error(&e))?;
        let url = self.config.connect_url()?;
        let connection = Connection::connect_with_config(
            &url,
            ConnectionProperties::default(),
            self.tls()?,
            runtime,
        )
        .await
        .map_err(|e| connect_error(&self.config.url, &e))?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| amqp_error(&e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| amqp_error(&e))?;
        let c = &self.config;
        match c.topology {
            Topology::Declare => {
                let mut exchanges = vec![c.exchange.as_str(), c.retry_exchange.as_str()];
                exchanges.extend(c.dead_letter_exchange_in_force());
                for name in exchanges {
                    topology::declare_exchange(&connection, name, ExchangeKind::Direct).await?;
                }
            }
            Topology::Existing => {
                let mut exchanges = vec![c.exchange.as_str()];
                exchanges.extend(c.dead_letter_exchange.as_deref());
                for name in exchanges.into_iter().filter(|n| !n.is_empty()) {
                    topology::check_exchange(&connection, name).await?;
                }
            }
        }
        Ok(Session {
            connection,
            publisher,
            declared: Mutex::new(HashSet::new()),
            retry_declared: Mutex::new(HashMap::new()),
        })
    }

    async fn invalidate(&self, broken: &Arc<Session>) {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| Arc::ptr_eq(s, broken)) {
            *guard = None;
        }
    }

    fn queue_args(&self, extra: &[(&str, AMQPValue)]) -> FieldTable {
        let mut args = FieldTable::default();
        if self.config.quorum_queues {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(LongString::from("quorum")),
            );
        }
        for (k, v) in extra {
            args.insert((*k).into(), v.clone());
        }
        args
    }

    /// Makes the OJS queue usable (idempotent, cached per connection; a
    /// reconnect starts with an empty cache). `declare`: the queue and its
    /// dead-letter queue are declared (or used as they exist) and bound;
    /// `existing`: the queue (or, for a dead-letter reader, its dead-letter
    /// queue) must exist, nothing is declared.
    async fn declare_queue(&self, s: &Session, queue: &str, source: Source) -> Result<()> {
        let key = match source {
            Source::Queue => queue.to_owned(),
            Source::DeadLetters => format!("dead:{queue}"),
        };
        if s.declared().contains(&key) || s.declared().contains(queue) {
            return Ok(());
        }
        let c = &self.config;
        let main = c.queue_name_of(queue);
        let dlq = c.dead_letter_queue_of(queue);
        if c.topology == Topology::Existing {
            let name = match source {
                Source::Queue => &main,
                Source::DeadLetters => &dlq,
            };
            topology::check_queue(&s.connection, name).await?;
            s.declared().insert(key);
            return Ok(());
        }
        let mut extra = Vec::new();
        if let Some(dlx) = c.dead_letter_exchange_in_force() {
            extra.push((
                "x-dead-letter-exchange",
                AMQPValue::LongString(LongString::from(dlx)),
            ));
            extra.push((
                "x-dead-letter-routing-key",
                AMQPValue::LongString(LongString::from(queue)),
            ));
        }
        if let (false, Some(max)) = (c.quorum_queues, c.max_priority) {
            extra.push(("x-max-priority", AMQPValue::ShortShortUInt(max)));
        }
        topology::declare_queue(&s.connection, &main, self.queue_args(&extra)).await?;
        let (exchange, routing_key) = c.publish_route_of(queue);
        topology::bind(&s.connection, &main, &exchange, &routing_key).await?;
        if let Some(dlx) = c.dead_letter_exchange_in_force() {
            match topology::try_declare_queue(&s.connection, &dlq, self.queue_args(&[])).await? {
                topology::Declared::Usable => {
                    topology::bind(&s.connection, &dlq, dlx, queue).await?;
                }
                // Refused (no `configure` permission): the queue itself works;
                // dead-lettering fails, named, until someone creates the DLQ.
                topology::Declared::Refused(e) => {
                    tracing::warn!(queue = %main, dead_letter_queue = %dlq, error = %e, "cannot declare the dead-letter queue; dead-lettering from this queue will fail until it exists");
                }
            }
        }
        for binding in c.grpcq_bindings_of(queue) {
            self.ensure_grpcq_exchange(s, &binding.exchange).await?;
            topology::bind(
                &s.connection,
                &main,
                &binding.exchange,
                &binding.routing_key,
            )
            .await?;
        }
        s.declared().insert(queue.to_owned());
        Ok(())
    }

    /// Makes sure the grpcq exchange `topic` exists: one declared by grpcq
    /// publishers is used as it is, whatever its type; a missing one is
    /// declared as a durable topic exchange. Each attempt uses its own
    /// channel, because a failed passive declare closes the channel.
    async fn ensure_grpcq_exchange(&self, s: &Session, topic: &str) -> Result<()> {
        fits(topic, "grpcq exchange (the call's topic)")?;
        let key = format!("exchange:{topic}");
        if s.declared().contains(&key) {
            return Ok(());
        }
        if self.config.topology == Topology::Existing {
            topology::check_exchange(&s.connection, topic).await?;
            s.declared().insert(key);
            return Ok(());
        }
        let probe = s
            .connection
            .create_channel()
            .await
            .map_err(|e| amqp_error(&e))?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let exists = probe
            .exchange_declare(
                topic.into(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await
            .is_ok();
        let _ = probe.close(200, "ok".into()).await;
        if !exists {
            let ch = s
                .connection
                .create_channel()
                .await
                .map_err(|e| amqp_error(&e))?;
            let declared = ch
                .exchange_declare(
                    topic.into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            let _ = ch.close(200, "ok".into()).await;
            declared.map_err(|e| topology_error(topic, &e))?;
        }
        s.declared().insert(key);
        Ok(())
    }

    /// Declares the TTL queue for `delay_ms`, re-declaring it well within its
    /// `x-expires` so it never expires with messages due.
    async fn declare_retry(&self, s: &Session, queue: &str, delay_ms: u64) -> Result<()> {
        let c = &self.config;
        if c.topology == Topology::Existing {
            return Err(Error::broker(
                "rabbitmq",
                "a delayed publish needs per-delay TTL queues, which topology = \"existing\" does not declare",
                false,
            ));
        }
        let name = c.retry_queue_of(queue, delay_ms);
        let expiry = Duration::from_secs(c.retry_queue_expiry_secs.max(60));
        let fresh = s
            .retry_declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
            .is_some_and(|at| at.elapsed() < expiry / 4);
        if fresh {
            return Ok(());
        }
        let ttl = i64::try_from(delay_ms).unwrap_or(i64::MAX);
        let expires = ttl.saturating_add(expiry.as_millis() as i64);
        // Due messages dead-letter back the way a publish goes.
        let (exchange, routing_key) = c.publish_route_of(queue);
        let args = self.queue_args(&[
            ("x-message-ttl", AMQPValue::LongLongInt(ttl)),
            (
                "x-dead-letter-exchange",
                AMQPValue::LongString(LongString::from(exchange.as_str())),
            ),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString(LongString::from(routing_key.as_str())),
            ),
            ("x-expires", AMQPValue::LongLongInt(expires)),
        ]);
        fits(&name, "retry queue name")?;
        // A TTL queue's expiry restarts with every declaration, so it is
        // declared again rather than used as found.
        let declared = s
            .publisher
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await;
        declared.map_err(|e| topology_error(&name, &e))?;
        topology::bind(
            &s.connection,
            &name,
            &c.retry_exchange,
            &format!("{queue}.{delay_ms}"),
        )
        .await?;
        s.retry_declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, Instant::now());
        Ok(())
    }

    /// Publishes with confirms until every message is confirmed or the
    /// publish timeout passes; returns the failures.
    ///
    /// `typed`: for a copy of a delivery, its header entries the neutral
    /// headers do not hold as they came ([`headers::properties_keeping`]).
    async fn send(
        &self,
        queue: &str,
        items: Vec<(usize, Route, OutgoingMessage)>,
        typed: Option<&FieldTable>,
    ) -> Vec<FailedPublish> {
        let deadline = Instant::now() + self.config.publish_timeout();
        let mut pending = items;
        let mut failed = Vec::new();
        while !pending.is_empty() {
            let session = match self.session(deadline).await {
                Ok(s) => s,
                Err(e) => {
                    fail_all(&mut failed, pending, &e);
                    break;
                }
            };
            if session.connection.status().blocked() {
                // A resource alarm: the broker reads nothing we publish until
                // it clears. Say so now instead of waiting out the deadline.
                fail_all(&mut failed, pending, &blocked_error());
                break;
            }
            let mut in_flight = Vec::with_capacity(pending.len());
            let mut again = Vec::new();
            let mut broken = false;
            for (index, route, message) in pending.drain(..) {
                if broken {
                    again.push((index, route, message));
                    continue;
                }
                let declared = within(deadline, async {
                    if route == Route::Grpcq {
                        if let Some((topic, _)) = grpcq_route(&message) {
                            self.ensure_grpcq_exchange(&session, topic).await?;
                        }
                        return Ok(());
                    }
                    if route != Route::DeadLetters {
                        self.declare_queue(&session, queue, Source::Queue).await?;
                    }
                    if let Route::Delayed(ms) = route {
                        self.declare_retry(&session, queue, ms).await?;
                    }
                    Ok(())
                })
                .await;
                if let Err(e) = declared {
                    if session.usable() && !matches!(e, Error::Timeout(_)) {
                        failed.push(FailedPublish {
                            index,
                            message,
                            error: e,
                        });
                    } else {
                        broken = true;
                        again.push((index, route, message));
                    }
                    continue;
                }
                let c = &self.config;
                let (exchange, routing_key) = match route {
                    Route::Queue => c.publish_route_of(queue),
                    Route::Delayed(ms) => (c.retry_exchange.clone(), format!("{queue}.{ms}")),
                    Route::DeadLetters => (
                        c.dead_letter_exchange_in_force()
                            .unwrap_or_default()
                            .to_owned(),
                        queue.to_owned(),
                    ),
                    Route::Grpcq => grpcq_route(&message)
                        .map(|(t, a)| (t.to_owned(), a.to_owned()))
                        .unwrap_or_else(|| c.publish_route_of(queue)),
                };
                let props = headers::properties_keeping(
                    &message,
                    self.config
                        .max_priority
                        .filter(|_| !self.config.quorum_queues),
                    typed,
                )
                .and_then(|props| {
                    let exchange = short(&exchange, "exchange name")?;
                    Ok((props, exchange, short(&routing_key, "routing key")?))
                });
                let (props, exchange_name, routing_key) = match props {
                    Ok(checked) => checked,
                    Err(error) => {
                        failed.push(FailedPublish {
                            index,
                            message,
                            error,
                        });
                        continue;
                    }
                };
                let published = session
                    .publisher
                    .basic_publish(
                        exchange_name,
                        routing_key,
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &message.payload,
                        props,
                    )
                    .await;
                match published {
                    Ok(confirm) => in_flight.push((index, route, message, confirm)),
                    Err(e) if topology::amqp_code(&e) == Some(403) => {
                        broken = true;
                        failed.push(FailedPublish {
                            index,
                            message,
                            error: write_refused(&exchange, &e),
                        });
                    }
                    Err(_) => {
                        broken = true;
                        again.push((index, route, message));
                    }
                }
            }
            for (index, route, message, confirm) in in_flight {
                match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None))) => {}
                    Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                        let missing = match (route, grpcq_route(&message)) {
                            (Route::Grpcq, Some((topic, action))) => format!(
                                "is a queue bound to exchange {topic} for routing key {action}?"
                            ),
                            _ => {
                                let (exchange, routing_key) = self.config.publish_route_of(queue);
                                let direct = if exchange.is_empty() {
                                    String::new()
                                } else {
                                    " (`exchange=` with an empty value publishes straight to the queue, through the default exchange)".to_owned()
                                };
                                format!(
                                    "is queue {} missing, or exchange {exchange:?} not bound to it for routing key {routing_key:?}?{direct}",
                                    self.config.queue_name_of(queue),
                                )
                            }
                        };
                        failed.push(FailedPublish {
                            index,
                            message,
                            error: Error::broker(
                                "rabbitmq",
                                format!(
                                    "unroutable: broker returned the message ({} {}); {missing}",
                                    returned.reply_code,
                                    returned.reply_text.as_str(),
                                ),
                                // The destination's state, not the message's:
                                // a missing queue or binding is fixed by whoever
                                // owns the topology, and the message then goes
                                // through as it is. A daemon holds it (health
                                // names the sink) instead of dead-lettering it.
                                true,
                            )
                            .with_broker_kind(BrokerErrorKind::NotFound),
                        })
                    }
                    Ok(Ok(Confirmation::Nack(_))) => failed.push(FailedPublish {
                        index,
                        message,
                        error: Error::broker(
                            "rabbitmq",
                            "broker nacked the message (not stored)",
                            true,
                        )
                        .with_broker_kind(BrokerErrorKind::Rejected),
                    }),
                    Ok(Ok(Confirmation::NotRequested)) => failed.push(FailedPublish {
                        index,
                        message,
                        error: Error::broker(
                            "rabbitmq",
                            "publisher confirms were not enabled",
                            false,
                        ),
                    }),
                    Ok(Err(e)) if topology::amqp_code(&e) == Some(403) => {
                        broken = true;
                        let exchange = match route {
                            Route::DeadLetters => self
                                .config
                                .dead_letter_exchange_in_force()
                                .unwrap_or_default()
                                .to_owned(),
                            _ => self.config.publish_route_of(queue).0,
                        };
                        failed.push(FailedPublish {
                            index,
                            message,
                            error: write_refused(&exchange, &e),
                        });
                    }
                    // The connection went away before the confirm: publish again.
                    Ok(Err(_)) => {
                        broken = true;
                        again.push((index, route, message));
                    }
                    Err(_) => failed.push(FailedPublish {
                        index,
                        message,
                        error: Error::Timeout(self.config.publish_timeout()),
                    }),
                }
            }
            if broken {
                self.invalidate(&session).await;
            }
            if !again.is_empty() && Instant::now() >= deadline {
                fail_all(
                    &mut failed,
                    again,
                    &Error::Timeout(self.config.publish_timeout()),
                );
                break;
            }
            pending = again;
        }
        failed.sort_by_key(|f| f.index);
        failed
    }
}

fn fail_all(
    failed: &mut Vec<FailedPublish>,
    items: Vec<(usize, Route, OutgoingMessage)>,
    e: &Error,
) {
    let (text, retryable) = (e.to_string(), e.is_retryable());
    failed.extend(items.into_iter().map(|(index, _, message)| FailedPublish {
        index,
        message,
        error: Error::broker("rabbitmq", text.clone(), retryable),
    }));
}

fn topology_error(name: &str, e: &lapin::Error) -> Error {
    topology::with_kind(
        Error::broker("rabbitmq", format!("declaring {name}: {e}"), true),
        e,
    )
}

/// A publish the broker refused for want of permission: reported once per
/// message, named, instead of a reconnect loop (retryable: granting the
/// permission fixes it, the message is not at fault).
fn write_refused(exchange: &str, e: &lapin::Error) -> Error {
    topology::with_kind(
        Error::broker(
            "rabbitmq",
            format!("publishing to exchange {exchange:?}: access refused — the user lacks the `write` permission on it ({e})"),
            // The sink's fault, not the message's: a daemon waits for the
            // permission instead of dead-lettering good messages.
            true,
        ),
        e,
    )
}

/// Publishing while RabbitMQ blocks the connection (`connection.blocked`:
/// a memory or disk alarm). The sink's fault: retry later.
fn blocked_error() -> Error {
    Error::broker(
        "rabbitmq",
        "the broker blocks publishing on this connection (a memory or disk alarm); waiting for it to clear",
        true,
    )
    .with_broker_kind(BrokerErrorKind::Unavailable)
}

/// A failed connect, naming the broker without its credentials.
fn connect_error(url: &str, e: &lapin::Error) -> Error {
    match topology::amqp_code(e) {
        // The broker answered and refused: credentials, vhost.
        Some(code) => {
            let hint = if code == 403 {
                " (user, password or vhost permission refused)"
            } else {
                ""
            };
            topology::with_kind(
                Error::broker(
                    "rabbitmq",
                    format!("connecting to {}: {e}{hint}", redact(url)),
                    true,
                ),
                e,
            )
        }
        // No answer: refused, reset, TLS, DNS.
        None => Error::Unreachable {
            broker: "rabbitmq",
            message: format!("connecting to {}: {e}", redact(url)),
        },
    }
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
                let route = match m.deliver_at.and_then(|at| (at - now).to_std().ok()) {
                    Some(d) if !d.is_zero() => Route::Delayed(bucket_delay_ms(d)),
                    _ if self.inner.config.grpcq_exchanges && grpcq_route(&m).is_some() => {
                        Route::Grpcq
                    }
                    _ => Route::Queue,
                };
                (i, route, m)
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

/// A consumer's channel and its delivery stream.
#[derive(Debug)]
struct Live {
    channel: Channel,
    stream: lapin::Consumer,
}

/// Closes a consumer channel that is still open, without waiting. A channel
/// nobody reads any more must go: the broker keeps up to `prefetch`
/// deliveries on it, unacknowledged and never redelivered, for as long as
/// it is open (the connection lives on for the publisher and the next
/// subscription).
fn close_in_background(channel: Channel, why: &'static str) {
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
struct PendingChannel {
    channel: Channel,
    subscribed: bool,
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
    inner: Arc<Inner>,
    queue: Arc<str>,
    options: ConsumerOptions,
    live: Option<Live>,
    /// Subscriptions that failed in a row with nothing delivered: the
    /// first is followed at once (a broker restart), each further one
    /// waits longer, so a connection that breaks every time it delivers
    /// does not become a reconnect loop against the broker.
    failures: u32,
    /// When the next subscription may be made.
    resubscribe_at: Option<Instant>,
    /// Why the last subscription failed or ended (for the error a receive
    /// returns while the next one waits).
    last_failure: String,
}

impl RabbitConsumer {
    /// The subscription failed or ended: the next waits if it keeps doing so.
    fn lost(&mut self, cause: impl Into<String>) {
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

    async fn subscribe(&mut self, deadline: Instant) -> Result<()> {
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

    async fn open_stream(&self, session: &Session) -> Result<Live> {
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
        channel
            .basic_qos(self.options.prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(|e| amqp_error(&e))?;
        let source = match self.options.source {
            Source::Queue => self.inner.config.queue_name_of(&self.queue),
            Source::DeadLetters => self.inner.config.dead_letter_queue_of(&self.queue),
        };
        fits(&source, "queue name")?;
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
            stream,
        })
    }

    fn delivery(&self, d: lapin::message::Delivery) -> Delivery {
        let r = headers::received(&d.properties, d.redelivered);
        let payload = Bytes::from(d.data);
        let acker = RabbitAcker {
            inner: self.inner.clone(),
            acker: d.acker,
            queue: self.queue.clone(),
            source: self.options.source,
            max_deliveries: self.options.max_deliveries,
            priority: r.priority,
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
            let first = match tokio::time::timeout_at(deadline, live.stream.next()).await {
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
                match live.stream.next().now_or_never() {
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
            let _ = live.channel.close(200, "consumer closed".into()).await;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct RabbitAcker {
    inner: Arc<Inner>,
    acker: lapin::Acker,
    queue: Arc<str>,
    source: Source,
    max_deliveries: Option<u32>,
    /// Priority as received (the neutral delivery does not carry it).
    priority: i32,
    attempt: u32,
    /// Header entries the neutral delivery does not hold as they came
    /// (integers, tables, …): copies carry them unchanged.
    typed: Option<FieldTable>,
}

impl RabbitAcker {
    async fn ack_original(&self) -> Result<()> {
        // Bounded like every broker call: an ack stuck on a dead connection
        // is one the broker will redeliver anyway.
        let deadline = Instant::now() + self.inner.config.publish_timeout();
        within(deadline, async {
            self.acker
                .ack(BasicAckOptions::default())
                .await
                .map(|_| ())
                .map_err(|_| Error::DeliveryExpired)
        })
        .await
        .map_err(|e| match e {
            Error::Timeout(_) => Error::DeliveryExpired,
            other => other,
        })
    }

    /// Republishes `copy` on `route` under confirms, then acks the original;
    /// requeues the original if the copy was not confirmed.
    async fn move_to(&self, route: Route, copy: OutgoingMessage) -> Result<()> {
        let failed = self
            .inner
            .send(&self.queue, vec![(0, route, copy)], self.typed.as_ref())
            .await;
        if let Some(f) = failed.into_iter().next() {
            let _ = self
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await;
            return Err(f.error);
        }
        self.ack_original().await
    }

    fn copy_of(&self, delivery: &DeliveryRef<'_>) -> OutgoingMessage {
        let mut copy = delivery.to_outgoing();
        copy.priority = self.priority;
        copy
    }

    async fn dead_letter(
        &self,
        reason: &DeadLetterReason,
        delivery: &DeliveryRef<'_>,
    ) -> Result<()> {
        if self.inner.config.dead_letter_exchange_in_force().is_none() {
            // topology = "existing" without a dead-letter exchange: the
            // queue's own dead-letter wiring takes it (x-death records why
            // RabbitMQ moved it; our reason is logged, without the payload).
            tracing::warn!(
                queue = %self.queue,
                reason = %reason.error_type,
                "dead-lettering by rejecting without requeue: RabbitMQ routes it by the queue's x-dead-letter-exchange, or discards it when the queue has none"
            );
            return self
                .acker
                .nack(BasicNackOptions {
                    requeue: false,
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .map_err(|_| Error::DeliveryExpired);
        }
        let mut copy = self.copy_of(delivery);
        reason.write_headers(&mut copy.headers);
        self.move_to(Route::DeadLetters, copy).await
    }
}

#[async_trait]
impl Acknowledger for RabbitAcker {
    async fn ack(&self) -> Result<()> {
        self.ack_original().await
    }

    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()> {
        match action {
            Nack::Retry { .. } if self.source == Source::DeadLetters => self
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .map_err(|_| Error::DeliveryExpired),
            Nack::Retry { .. } if self.max_deliveries.is_some_and(|m| self.attempt >= m) => {
                self.dead_letter(
                    &DeadLetterReason::of(
                        ojs_core::DeadLetterKind::MaxDeliveries,
                        format!(
                            "delivered {} times without being acknowledged",
                            self.attempt
                        ),
                    ),
                    &delivery,
                )
                .await
            }
            Nack::Retry { delay } => {
                let mut copy = self.copy_of(&delivery);
                copy.headers
                    .insert(header::ATTEMPT, (self.attempt + 1).to_string());
                let route = if delay.is_zero() {
                    Route::Queue
                } else if self.inner.config.topology == Topology::Existing {
                    // No TTL queues to wait in: the original is held
                    // unacknowledged for the delay (a crash redelivers it),
                    // then the copy goes to the back of the queue.
                    tokio::time::sleep(delay).await;
                    Route::Queue
                } else {
                    Route::Delayed(bucket_delay_ms(delay))
                };
                self.move_to(route, copy).await
            }
            Nack::DeadLetter(reason) => self.dead_letter(&reason, &delivery).await,
        }
    }
}
