//! Publishing under publisher confirms with `mandatory`: a broker Nack or a
//! returned message fails that message (retryable: the destination's
//! state); a dropped connection is reopened and what was not confirmed is
//! published again until `publish_timeout_secs`.

use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::Confirmation;
use ojs_queue::{BrokerErrorKind, Error, FailedPublish, OutgoingMessage, Source};
use tokio::time::Instant;

use crate::{headers, short, topology, within, Inner};

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Destination {
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
pub(crate) fn grpcq_route(message: &OutgoingMessage) -> Option<(&str, &str)> {
    if message.content_type() != Some(ojs_core::envelope::media::GRPCQ_PROTO) {
        return None;
    }
    let topic = message.headers.get_str(ojs_queue::header::GRPCQ_TOPIC)?;
    let action = message.headers.get_str(ojs_queue::header::GRPCQ_ACTION)?;
    Some((topic, action))
}

impl Inner {
    /// Publishes with confirms until every message is confirmed or the
    /// publish timeout passes; returns the failures.
    ///
    /// `typed`: for a copy of a delivery, its header entries the neutral
    /// headers do not hold as they came ([`headers::properties_keeping`]).
    pub(crate) async fn send(
        &self,
        queue: &str,
        items: Vec<(usize, Destination, OutgoingMessage)>,
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
            for (index, destination, message) in pending.drain(..) {
                if broken {
                    again.push((index, destination, message));
                    continue;
                }
                let declared = within(deadline, async {
                    if destination == Destination::Grpcq {
                        if let Some((topic, _)) = grpcq_route(&message) {
                            self.ensure_grpcq_exchange(&session, topic).await?;
                        }
                        return Ok(());
                    }
                    if destination != Destination::DeadLetters {
                        self.declare_queue(&session, queue, Source::Queue).await?;
                    }
                    if let Destination::Delayed(ms) = destination {
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
                        again.push((index, destination, message));
                    }
                    continue;
                }
                let c = &self.config;
                let (exchange, routing_key) = match destination {
                    Destination::Queue => c.publish_route_of(queue),
                    Destination::Delayed(ms) => {
                        (c.retry_exchange.clone(), c.retry_routing_key_of(queue, ms))
                    }
                    Destination::DeadLetters => (
                        c.dead_letter_exchange_in_force()
                            .unwrap_or_default()
                            .to_owned(),
                        c.dead_letter_routing_key_of(queue),
                    ),
                    Destination::Grpcq => grpcq_route(&message)
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
                    Ok(confirm) => in_flight.push((index, destination, message, confirm)),
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
                        again.push((index, destination, message));
                    }
                }
            }
            for (index, destination, message, confirm) in in_flight {
                match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None))) => {}
                    Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                        let missing = match (destination, grpcq_route(&message)) {
                            (Destination::Grpcq, Some((topic, action))) => format!(
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
                        let exchange = match destination {
                            Destination::DeadLetters => self
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
                        again.push((index, destination, message));
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

pub(crate) fn fail_all(
    failed: &mut Vec<FailedPublish>,
    items: Vec<(usize, Destination, OutgoingMessage)>,
    e: &Error,
) {
    let (text, retryable) = (e.to_string(), e.is_retryable());
    failed.extend(items.into_iter().map(|(index, _, message)| FailedPublish {
        index,
        message,
        error: Error::broker("rabbitmq", text.clone(), retryable),
    }));
}

/// A publish the broker refused for want of permission: reported once per
/// message, named, instead of a reconnect loop (retryable: granting the
/// permission fixes it, the message is not at fault).
pub(crate) fn write_refused(exchange: &str, e: &lapin::Error) -> Error {
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
pub(crate) fn blocked_error() -> Error {
    Error::broker(
        "rabbitmq",
        "the broker blocks publishing on this connection (a memory or disk alarm); waiting for it to clear",
        true,
    )
    .with_broker_kind(BrokerErrorKind::Unavailable)
}
