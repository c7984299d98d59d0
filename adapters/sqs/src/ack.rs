//! Settling a message: ack deletes it (batched per queue), a retry changes
//! its visibility, a dead letter sends a copy with the reason to the
//! dead-letter queue and deletes the original.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use aws_sdk_sqs::Client;
use ojs_queue::{
    header, Acknowledger, DeadLetterReason, DeliveryRef, Error, Nack, OutgoingMessage, Result,
};

use crate::client::call_error;
use crate::{
    Inner, Typed, KEY_ATTRIBUTE, SQS_BATCH_LIMIT, SQS_MAX_ATTRIBUTES, SQS_MAX_VISIBILITY_SECS,
};

pub(crate) type DeleteRequest = (String, tokio::sync::oneshot::Sender<Result<()>>);

/// Deletes acked messages with DeleteMessageBatch: every ack waiting when a
/// call starts goes into it (up to 10, SQS's limit), and each ack gets the
/// result of its own entry.
pub(crate) async fn delete_batcher(
    client: Client,
    url: String,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<DeleteRequest>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < SQS_BATCH_LIMIT {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let entries: Vec<DeleteMessageBatchRequestEntry> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, (receipt, _))| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(receipt)
                    .build()
                    .ok()
            })
            .collect();
        match client
            .delete_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            Ok(out) => {
                let mut failures: HashMap<String, Error> = out
                    .failed()
                    .iter()
                    .map(|f| {
                        let error = if f.code() == "ReceiptHandleIsInvalid" {
                            Error::DeliveryExpired
                        } else {
                            Error::broker(
                                "sqs",
                                format!("{}: {}", f.code(), f.message().unwrap_or("delete failed")),
                                !f.sender_fault(),
                            )
                        };
                        (f.id().to_owned(), error)
                    })
                    .collect();
                for (i, (_, reply)) in batch.into_iter().enumerate() {
                    let _ = reply.send(failures.remove(&i.to_string()).map_or(Ok(()), Err));
                }
            }
            Err(e) => {
                let text = aws_sdk_sqs::error::DisplayErrorContext(e).to_string();
                for (_, reply) in batch {
                    let _ = reply.send(Err(Error::broker("sqs", text.clone(), true)));
                }
            }
        }
    }
}

impl Inner {
    pub(crate) async fn delete(&self, url: &str, receipt: &str) -> Result<()> {
        let sender = {
            let mut deleters = self.deleters.lock().unwrap_or_else(|e| e.into_inner());
            deleters
                .entry(url.to_owned())
                .or_insert_with(|| {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    tokio::spawn(delete_batcher(self.client.clone(), url.to_owned(), rx));
                    tx
                })
                .clone()
        };
        let (reply, done) = tokio::sync::oneshot::channel();
        sender
            .send((receipt.to_owned(), reply))
            .map_err(|_| Error::Closed)?;
        done.await
            .unwrap_or_else(|_| Err(Error::broker("sqs", "delete batcher stopped", true)))
    }
}

/// Binding headers a dead letter can go without: an OJS body holds each
/// of them, in this order of need.
pub(crate) const REDUNDANT_IN_DEAD_LETTERS: [&str; 3] =
    [header::SPECVERSION, header::QUEUE, header::TYPE];

/// A dead letter carries its reason in two attributes; a message that
/// already used most of SQS's 10 would not fit any more and could never be
/// dead-lettered. Binding headers the body repeats make room, in the order
/// of [`REDUNDANT_IN_DEAD_LETTERS`]; the reason and everything else stay.
pub(crate) fn make_room_for_the_reason(copy: &mut OutgoingMessage) {
    let needed = |m: &OutgoingMessage| {
        m.headers.len() + usize::from(m.key.is_some() && !m.headers.contains_key(KEY_ATTRIBUTE))
    };
    for name in REDUNDANT_IN_DEAD_LETTERS {
        if needed(copy) <= SQS_MAX_ATTRIBUTES {
            return;
        }
        if copy.headers.remove(name).is_some() {
            tracing::debug!(
                header = name,
                "dead letter over SQS's attribute limit: left out a header its body repeats"
            );
        }
    }
}

#[derive(Debug)]
pub(crate) struct SqsAcker {
    pub(crate) inner: Arc<Inner>,
    pub(crate) url: String,
    pub(crate) dlq: Option<String>,
    pub(crate) receipt: String,
    pub(crate) attempt: u32,
    /// The message's attributes of their own type ([`ReceivedMessage::typed`]).
    pub(crate) typed: Option<Typed>,
    pub(crate) max_deliveries: Option<u32>,
}

impl SqsAcker {
    pub(crate) async fn visibility(&self, secs: u64) -> Result<()> {
        self.inner
            .client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(&self.receipt)
            .visibility_timeout(secs.min(SQS_MAX_VISIBILITY_SECS) as i32)
            .send()
            .await
            .map(|_| ())
            .map_err(call_error)
    }

    pub(crate) async fn dead_letter(
        &self,
        reason: &DeadLetterReason,
        delivery: &DeliveryRef<'_>,
    ) -> Result<()> {
        let mut copy = delivery.to_outgoing();
        copy.message_id = None;
        reason.write_headers(&mut copy.headers);
        make_room_for_the_reason(&mut copy);
        let Some(dlq) = &self.dlq else {
            return Err(Error::broker(
                "sqs",
                "this queue has no dead-letter queue (no RedrivePolicy and no queue named by dead_letter_queue_template); the message stays in its queue",
                true,
            ));
        };
        let failed = self
            .inner
            .send(dlq, vec![(0, copy)], self.typed.as_ref())
            .await;
        if let Some(f) = failed.into_iter().next() {
            return Err(f.error);
        }
        self.ack().await
    }
}

#[async_trait]
impl Acknowledger for SqsAcker {
    async fn ack(&self) -> Result<()> {
        self.inner.delete(&self.url, &self.receipt).await
    }

    async fn nack(&self, action: Nack, delivery: DeliveryRef<'_>) -> Result<()> {
        match action {
            Nack::Retry { .. } if self.max_deliveries.is_some_and(|m| self.attempt >= m) => {
                let reason = DeadLetterReason::of(
                    ojs_queue::DeadLetterKind::MaxDeliveries,
                    format!(
                        "delivered {} times without being acknowledged",
                        self.attempt
                    ),
                );
                self.dead_letter(&reason, &delivery).await
            }
            Nack::Retry { delay } => self.visibility(delay.as_secs_f64().ceil() as u64).await,
            // SQS counts every receive itself (ApproximateReceiveCount):
            // a released message's next receive still shows one more.
            Nack::Release => self.visibility(0).await,
            Nack::DeadLetter(reason) => self.dead_letter(&reason, &delivery).await,
        }
    }

    async fn extend(&self, by: Duration) -> Result<()> {
        self.visibility(by.as_secs().max(1)).await
    }
}
