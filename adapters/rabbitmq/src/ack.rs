//! Settling a delivery: ack, or a nack that republishes a copy (retry with
//! the attempt counted up, or dead letter with the reason) under confirms
//! and only then acks the original; with `topology = "existing"` and no
//! dead-letter exchange, a reject the queue's own dead-lettering takes.

use std::sync::Arc;

use async_trait::async_trait;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::FieldTable;
use ojs_queue::settings::Topology;
use ojs_queue::{
    header, Acknowledger, DeadLetterReason, DeliveryRef, Error, Nack, OutgoingMessage, Result,
    Source,
};
use tokio::time::Instant;

use crate::publish::Destination;
use crate::{bucket_delay_ms, within, Inner};

#[derive(Debug)]
pub(crate) struct RabbitAcker {
    pub(crate) inner: Arc<Inner>,
    pub(crate) acker: lapin::Acker,
    pub(crate) queue: Arc<str>,
    pub(crate) source: Source,
    pub(crate) max_deliveries: Option<u32>,
    /// Priority as received (the neutral delivery does not carry it).
    pub(crate) priority: i32,
    pub(crate) attempt: u32,
    /// Header entries the neutral delivery does not hold as they came
    /// (integers, tables, …): copies carry them unchanged.
    pub(crate) typed: Option<FieldTable>,
}

impl RabbitAcker {
    pub(crate) async fn ack_original(&self) -> Result<()> {
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
    pub(crate) async fn move_to(&self, route: Destination, copy: OutgoingMessage) -> Result<()> {
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

    pub(crate) fn copy_of(&self, delivery: &DeliveryRef<'_>) -> OutgoingMessage {
        let mut copy = delivery.to_outgoing();
        copy.priority = self.priority;
        copy
    }

    pub(crate) async fn dead_letter(
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
        // The attempts it had, redeliveries included: the dead queue's own
        // redeliveries (listings) are not counted on top.
        copy.headers
            .insert(header::ATTEMPT, self.attempt.to_string());
        self.move_to(Destination::DeadLetters, copy).await
    }
}

#[async_trait]
impl Acknowledger for RabbitAcker {
    async fn ack(&self) -> Result<()> {
        self.ack_original().await
    }

    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()> {
        match action {
            // A dead letter retried or released stays where it is (its
            // attempt is read from its header alone, see
            // `RabbitConsumer::delivery`).
            Nack::Retry { .. } | Nack::Release if self.source == Source::DeadLetters => self
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
                        ojs_queue::DeadLetterKind::MaxDeliveries,
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
                    Destination::Queue
                } else if self.inner.config.topology == Topology::Existing {
                    // No TTL queues to wait in: the original is held
                    // unacknowledged for the delay (a crash redelivers it),
                    // then the copy goes to the back of the queue.
                    tokio::time::sleep(delay).await;
                    Destination::Queue
                } else {
                    Destination::Delayed(bucket_delay_ms(delay))
                };
                self.move_to(route, copy).await
            }
            Nack::DeadLetter(reason) => self.dead_letter(&reason, &delivery).await,
            // A requeue would count as a redelivery (the redelivered flag,
            // a quorum queue's x-delivery-count): a copy carrying the
            // attempt as it was goes to the back of the queue instead.
            Nack::Release => {
                let mut copy = self.copy_of(&delivery);
                copy.headers
                    .insert(header::ATTEMPT, self.attempt.to_string());
                self.move_to(Destination::Queue, copy).await
            }
        }
    }
}
