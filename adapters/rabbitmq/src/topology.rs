//! Declaring and checking exchanges and queues on a broker the adapter may
//! not own.
//!
//! Every declaration runs on a scratch channel: a refused declare closes its
//! channel, and the publishing channel must survive it. With
//! `topology = "declare"` what exists is used as it is — a queue or exchange
//! declared elsewhere with other arguments (406 PRECONDITION_FAILED) is
//! checked with a passive declare and used, with a warning — and only what is
//! missing is created. With `existing` only passive declares are made.

use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::LongString;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Connection, ErrorKind, ExchangeKind};
use ojs_queue::settings::Topology;
use ojs_queue::Source;
use ojs_queue::{BrokerErrorKind, Error, Result};
use tokio::time::Instant;

use crate::connection::Session;
use crate::Inner;

/// AMQP reply codes this module tells apart.
const ACCESS_REFUSED: u16 = 403;
const NOT_FOUND: u16 = 404;
const PRECONDITION_FAILED: u16 = 406;

/// The AMQP reply code of a broker error, if it is one.
/// `value` as an AMQP short string: names, routing keys and most
/// properties are at most 255 bytes on the wire, and lapin panics when
/// asked to build a longer one. Kafka header names and values, grpcq topics
/// and message-chosen queue names have no such bound, so a longer one is an
/// error naming `what` (the message's fault, not the broker's: not
/// retryable).
pub(crate) fn short(value: &str, what: &str) -> Result<ShortString> {
    fits(value, what)?;
    Ok(ShortString::from(value))
}

/// [`short`]'s check alone, for a name that lapin converts later (no
/// string built to be thrown away).
pub(crate) fn fits(value: &str, what: &str) -> Result<()> {
    if value.len() <= lapin::types::MAX_SHORT_STRING_LENGTH {
        return Ok(());
    }
    Err(Error::broker(
        "rabbitmq",
        format!(
            "{what} is {} bytes; AMQP carries it as a short string of at most 255",
            value.len()
        ),
        false,
    )
    .with_broker_kind(BrokerErrorKind::Rejected))
}

pub(crate) fn amqp_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// A lapin error as ours: its kind from the AMQP reply code, lapin's error
/// kept as the source.
pub(crate) fn amqp_error(e: &lapin::Error) -> Error {
    with_kind(Error::broker("rabbitmq", e.to_string(), true), e)
}

/// Sets kind and source of a broker error made from `e`.
pub(crate) fn with_kind(error: Error, e: &lapin::Error) -> Error {
    let kind = match amqp_code(e) {
        Some(ACCESS_REFUSED) => BrokerErrorKind::AccessDenied,
        Some(NOT_FOUND) => BrokerErrorKind::NotFound,
        Some(PRECONDITION_FAILED) => BrokerErrorKind::Conflict,
        // Connection forced, resource locked, resource error: the broker's
        // state, not the request.
        Some(320 | 405 | 506) => BrokerErrorKind::Unavailable,
        Some(_) => BrokerErrorKind::Other,
        // No reply code: the connection or channel is gone.
        None => BrokerErrorKind::Unavailable,
    };
    error.with_broker_kind(kind).with_source(e.clone())
}

/// What went wrong with `name`, worded for the operator.
fn refused(what: &str, name: &str, e: &lapin::Error) -> Error {
    let error = match amqp_code(e) {
        Some(ACCESS_REFUSED) => Error::broker(
            "rabbitmq",
            format!(
                "{what} {name:?}: access refused — the user lacks the `configure` permission needed to declare it ({e}); grant it, or create it beforehand and set topology = \"existing\""
            ),
            // The broker's configuration, not the message, is at fault.
            true,
        ),
        Some(NOT_FOUND) => Error::broker(
            "rabbitmq",
            format!("{what} {name:?} does not exist ({e})"),
            true,
        ),
        _ => Error::broker("rabbitmq", format!("{what} {name:?}: {e}"), true),
    };
    with_kind(error, e)
}

async fn scratch<T>(
    connection: &Connection,
    call: impl AsyncFnOnce(&lapin::Channel) -> lapin::Result<T>,
) -> Result<lapin::Result<T>> {
    let ch = connection
        .create_channel()
        .await
        .map_err(|e| amqp_error(&e))?;
    let result = call(&ch).await;
    if ch.status().connected() {
        let _ = ch.close(200, "ok".into()).await;
    }
    Ok(result)
}

/// Checks that queue `name` exists (a passive declare, which needs no
/// permission); its message count when it does.
pub(crate) async fn check_queue(connection: &Connection, name: &str) -> Result<u32> {
    fits(name, "queue name")?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match scratch(connection, async |ch| {
        ch.queue_declare(name.into(), passive, FieldTable::default())
            .await
    })
    .await?
    {
        Ok(q) => Ok(q.message_count()),
        Err(e) if amqp_code(&e) == Some(NOT_FOUND) => Err(with_kind(Error::broker(
            "rabbitmq",
            format!("queue {name:?} does not exist (topology = \"existing\" declares nothing; create it, or use topology = \"declare\")"),
            true,
        ), &e)),
        Err(e) => Err(refused("queue", name, &e)),
    }
}

/// Checks that exchange `name` exists.
pub(crate) async fn check_exchange(connection: &Connection, name: &str) -> Result<()> {
    fits(name, "exchange name")?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match scratch(connection, async |ch| {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await
    })
    .await?
    {
        Ok(()) => Ok(()),
        Err(e) if amqp_code(&e) == Some(NOT_FOUND) => Err(with_kind(
            Error::broker(
                "rabbitmq",
                format!(
                    "exchange {name:?} does not exist (topology = \"existing\" declares nothing)"
                ),
                true,
            ),
            &e,
        )),
        Err(e) => Err(refused("exchange", name, &e)),
    }
}

/// How long a reply queue outlives its last consumer (`x-expires`).
pub(crate) const REPLY_QUEUE_EXPIRES_MS: i32 = 60_000;

/// Declares a client instance's reply queue: not durable, and removed by
/// the broker once unused for [`REPLY_QUEUE_EXPIRES_MS`] (`x-expires`), so
/// a client that crashed leaves nothing behind. Not `exclusive`: an
/// exclusive queue dies with the connection that declared it, and a
/// reconnect would then lose the replies in flight.
pub(crate) async fn declare_reply_queue(connection: &Connection, name: &str) -> Result<()> {
    fits(name, "reply queue name")?;
    let mut args = FieldTable::default();
    args.insert(
        "x-expires".into(),
        AMQPValue::LongInt(REPLY_QUEUE_EXPIRES_MS),
    );
    match scratch(connection, async |ch| {
        ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)
            .await
    })
    .await?
    {
        Ok(_) => Ok(()),
        Err(e) => Err(refused("reply queue", name, &e)),
    }
}

/// Deletes queue `name` with what is in it; one that is gone already is
/// fine.
pub(crate) async fn delete_queue(connection: &Connection, name: &str) -> Result<()> {
    fits(name, "queue name")?;
    match scratch(connection, async |ch| {
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await
    })
    .await?
    {
        Ok(_) => Ok(()),
        Err(e) if amqp_code(&e) == Some(NOT_FOUND) => Ok(()),
        Err(e) => Err(refused("queue", name, &e)),
    }
}

/// Declares a durable queue with `args`; one that exists with other
/// arguments is used as it is.
pub(crate) async fn declare_queue(
    connection: &Connection,
    name: &str,
    args: FieldTable,
) -> Result<()> {
    match try_declare_queue(connection, name, args).await? {
        Declared::Usable => Ok(()),
        Declared::Refused(e) => Err(e),
    }
}

/// What a declaration came to.
pub(crate) enum Declared {
    /// The queue exists now (declared, or found and used as it is).
    Usable,
    /// It does not exist and the user may not create it (no `configure`).
    Refused(Error),
}

/// [`declare_queue`], telling a refusal (missing permission) apart from
/// other failures, which are errors.
pub(crate) async fn try_declare_queue(
    connection: &Connection,
    name: &str,
    args: FieldTable,
) -> Result<Declared> {
    fits(name, "queue name")?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    match scratch(connection, async |ch| {
        ch.queue_declare(name.into(), durable, args).await
    })
    .await?
    {
        Ok(_) => Ok(Declared::Usable),
        Err(e) if amqp_code(&e) == Some(PRECONDITION_FAILED) => {
            check_queue(connection, name).await?;
            tracing::warn!(queue = %name, reason = %e, "queue exists with other arguments; using it as it is");
            Ok(Declared::Usable)
        }
        Err(e) if amqp_code(&e) == Some(ACCESS_REFUSED) => {
            // No `configure` permission: an existing queue is still usable.
            if check_queue(connection, name).await.is_err() {
                return Ok(Declared::Refused(refused("queue", name, &e)));
            }
            tracing::warn!(queue = %name, "no permission to declare the queue; using the existing one as it is");
            Ok(Declared::Usable)
        }
        Err(e) => Err(refused("queue", name, &e)),
    }
}

/// Declares a durable exchange of `kind`; one that exists with another
/// type or other settings is used as it is. `""`, the default exchange,
/// always exists.
pub(crate) async fn declare_exchange(
    connection: &Connection,
    name: &str,
    kind: ExchangeKind,
) -> Result<()> {
    if name.is_empty() {
        return Ok(());
    }
    fits(name, "exchange name")?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    match scratch(connection, async |ch| {
        ch.exchange_declare(name.into(), kind, durable, FieldTable::default())
            .await
    })
    .await?
    {
        Ok(()) => Ok(()),
        Err(e) if matches!(amqp_code(&e), Some(PRECONDITION_FAILED | ACCESS_REFUSED)) => {
            check_exchange(connection, name)
                .await
                .map_err(|_| refused("exchange", name, &e))?;
            tracing::warn!(exchange = %name, reason = %e, "exchange exists with other settings or cannot be declared; using it as it is");
            Ok(())
        }
        Err(e) => Err(refused("exchange", name, &e)),
    }
}

/// Binds queue `queue` to `exchange` with `routing_key`.
pub(crate) async fn bind(
    connection: &Connection,
    queue: &str,
    exchange: &str,
    routing_key: &str,
) -> Result<()> {
    if exchange.is_empty() {
        return Ok(());
    }
    fits(queue, "queue name")?;
    fits(exchange, "exchange name")?;
    fits(routing_key, "routing key")?;
    scratch(connection, async |ch| {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    })
    .await?
    .map_err(|e| refused("binding of queue", &format!("{queue} to {exchange}"), &e))
}

// Declaring what a queue needs, on the adapter's session.

impl Inner {
    pub(crate) fn queue_args(&self, extra: &[(&str, AMQPValue)]) -> FieldTable {
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
    pub(crate) async fn declare_queue(
        &self,
        s: &Session,
        queue: &str,
        source: Source,
    ) -> Result<()> {
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
            check_queue(&s.connection, name).await?;
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
                AMQPValue::LongString(LongString::from(c.dead_letter_routing_key_of(queue))),
            ));
        }
        if let (false, Some(max)) = (c.quorum_queues, c.max_priority) {
            extra.push(("x-max-priority", AMQPValue::ShortShortUInt(max)));
        }
        declare_queue(&s.connection, &main, self.queue_args(&extra)).await?;
        let (exchange, routing_key) = c.publish_route_of(queue);
        bind(&s.connection, &main, &exchange, &routing_key).await?;
        if let Some(dlx) = c.dead_letter_exchange_in_force() {
            match try_declare_queue(&s.connection, &dlq, self.queue_args(&[])).await? {
                Declared::Usable => {
                    bind(
                        &s.connection,
                        &dlq,
                        dlx,
                        &c.dead_letter_routing_key_of(queue),
                    )
                    .await?;
                }
                // Refused (no `configure` permission): the queue itself works;
                // dead-lettering fails, named, until someone creates the DLQ.
                Declared::Refused(e) => {
                    tracing::warn!(queue = %main, dead_letter_queue = %dlq, error = %e, "cannot declare the dead-letter queue; dead-lettering from this queue will fail until it exists");
                }
            }
        }
        for binding in c.grpcq_bindings_of(queue) {
            self.ensure_grpcq_exchange(s, &binding.exchange).await?;
            bind(
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
    pub(crate) async fn ensure_grpcq_exchange(&self, s: &Session, topic: &str) -> Result<()> {
        fits(topic, "grpcq exchange (the call's topic)")?;
        let key = format!("exchange:{topic}");
        if s.declared().contains(&key) {
            return Ok(());
        }
        if self.config.topology == Topology::Existing {
            check_exchange(&s.connection, topic).await?;
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
    pub(crate) async fn declare_retry(
        &self,
        s: &Session,
        queue: &str,
        delay_ms: u64,
    ) -> Result<()> {
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
        bind(
            &s.connection,
            &name,
            &c.retry_exchange,
            &c.retry_routing_key_of(queue, delay_ms),
        )
        .await?;
        s.retry_declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, Instant::now());
        Ok(())
    }
}

pub(crate) fn topology_error(name: &str, e: &lapin::Error) -> Error {
    with_kind(
        Error::broker("rabbitmq", format!("declaring {name}: {e}"), true),
        e,
    )
}
