//! Settling a record: ack marks its offset settled; a nack produces a copy
//! to the retry or dead topic and settles the original only after the
//! copy's delivery report.

use std::sync::Arc;

use async_trait::async_trait;
use ojs_queue::{
    header, Acknowledger, DeadLetterReason, DeliveryRef, Error, Nack, OutgoingMessage, Result,
    Source,
};

use crate::client::{now_ms, NOT_BEFORE_HEADER};
use crate::consume::Settler;
use crate::topology::Destination;
use crate::tracker::Stale;
use crate::Tp;

#[derive(Debug)]
pub(crate) struct KafkaAcker {
    pub(crate) settler: Arc<Settler>,
    pub(crate) tp: Tp,
    pub(crate) offset: i64,
    pub(crate) generation: u64,
    pub(crate) attempt: u32,
}

impl KafkaAcker {
    /// Marks the offset settled: bookkeeping only (the background committer
    /// commits the contiguous prefix), so it never waits.
    pub(crate) fn settle(&self) -> Result<()> {
        self.settler
            .context
            .lock()
            .tracker
            .settle(&self.tp, self.offset, self.generation)
            .map_err(|Stale| Error::DeliveryExpired)
    }

    /// Produces `copy` to the destination's topic, then settles the original offset. When
    /// the copy is not confirmed the original stays unsettled (uncommitted),
    /// so it is delivered again after a restart: never lost.
    pub(crate) async fn move_to(
        &self,
        destination: Destination,
        copy: OutgoingMessage,
    ) -> Result<()> {
        // A dead letter too large for the dead topic (the reason headers
        // pushed it over, or the topic takes less than the source) would
        // hold the partition's commit point for good: it goes without its
        // body, saying where the original is.
        let limit = self.settler.inner.config.max_message_bytes;
        let dead = matches!(destination, Destination::DeadLetters);
        let copy = if dead && copy.check_size(limit).is_err() {
            self.without_body(copy)
        } else {
            copy
        };
        let failed = self
            .settler
            .inner
            .produce(&self.settler.queue, vec![(0, destination, copy)])
            .await;
        let Some(f) = failed.into_iter().next() else {
            return self.settle();
        };
        // The broker refused the dead letter itself (its topic's
        // max.message.bytes: a permanent error): the same, without the body.
        let refused_as_too_large = dead && !f.error.is_retryable() && !f.message.payload.is_empty();
        if !refused_as_too_large {
            return Err(f.error);
        }
        let stub = self.without_body(f.message);
        let failed = self
            .settler
            .inner
            .produce(&self.settler.queue, vec![(0, destination, stub)])
            .await;
        match failed.into_iter().next() {
            Some(f) => Err(f.error),
            None => self.settle(),
        }
    }

    pub(crate) fn without_body(&self, mut copy: OutgoingMessage) -> OutgoingMessage {
        let size = copy.payload.len();
        copy.payload = bytes::Bytes::new();
        copy.envelope = None;
        copy.headers
            .insert(header::PAYLOAD_OMITTED, size.to_string());
        copy.headers
            .insert("ojs-source-topic", self.tp.0.to_string());
        copy.headers
            .insert("ojs-source-partition", self.tp.1.to_string());
        copy.headers
            .insert("ojs-source-offset", self.offset.to_string());
        copy
    }
}

#[async_trait]
impl Acknowledger for KafkaAcker {
    async fn ack(&self) -> Result<()> {
        self.settle()
    }

    fn ack_now(&self) -> Option<Result<()>> {
        Some(self.settle())
    }

    /// A batch of this consumer's records under one lock of its offset
    /// tracker, not one each.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let members =
            ojs_queue::batch_of::<KafkaAcker>(batch, |k| Arc::ptr_eq(&k.settler, &self.settler))?;
        let mut context = self.settler.context.lock();
        Some(
            members
                .iter()
                .map(|k| {
                    context
                        .tracker
                        .settle(&k.tp, k.offset, k.generation)
                        .map_err(|Stale| Error::DeliveryExpired)
                })
                .collect(),
        )
    }

    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()> {
        let Settler {
            source,
            max_deliveries,
            ..
        } = &*self.settler;
        let mut copy = delivery.to_outgoing();
        match action {
            Nack::Retry { delay } if *source == Source::Queue => {
                if max_deliveries.is_some_and(|m| self.attempt >= m) {
                    DeadLetterReason::of(
                        ojs_queue::DeadLetterKind::MaxDeliveries,
                        format!(
                            "delivered {} times without being acknowledged",
                            self.attempt
                        ),
                    )
                    .write_headers(&mut copy.headers);
                    return self.move_to(Destination::DeadLetters, copy).await;
                }
                copy.headers
                    .insert(header::ATTEMPT, (self.attempt + 1).to_string());
                // Whole milliseconds, rounded up: the clock read here is
                // truncated, so +1 keeps the record from coming back early.
                let due = now_ms().saturating_add(delay.as_micros().div_ceil(1000) as i64 + 1);
                copy.headers.insert(NOT_BEFORE_HEADER, due.to_string());
                self.move_to(Destination::Retry, copy).await
            }
            // Given back uncounted: to the retry topic, due now, with its
            // attempt as it was (a dead letter to the back of the dead topic).
            Nack::Release if *source == Source::Queue => {
                copy.headers.insert(NOT_BEFORE_HEADER, now_ms().to_string());
                self.move_to(Destination::Retry, copy).await
            }
            Nack::Release => self.move_to(Destination::DeadLetters, copy).await,
            // A dead letter that is retried goes to the back of the dead topic.
            Nack::Retry { .. } => self.move_to(Destination::DeadLetters, copy).await,
            Nack::DeadLetter(reason) => {
                reason.write_headers(&mut copy.headers);
                self.move_to(Destination::DeadLetters, copy).await
            }
        }
    }
}
