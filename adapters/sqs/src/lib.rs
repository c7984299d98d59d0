//! SQS adapter (aws-sdk-sqs) following docs/design.md §4 "SQS".
//!
//! Delivery semantics: at least once.
//! * Queue `{prefix}{queue}` (`.` → `_`), its DLQ `{name}_dlq` with a
//!   RedrivePolicy (`max_receive_count`), both created on first use.
//! * Body: base64 of the message (SQS bodies must be XML-safe text). On
//!   receive a body that is not base64 is handed over as it is (grpcq's
//!   legacy publishers sent raw bytes); the consumer decides, and the worker
//!   dead-letters what does not decode.
//! * Headers travel as String message attributes, at most 10 (SQS limit); a
//!   message with more fails before sending, naming the limit. A value that
//!   is not XML text travels as a Binary attribute and an empty one with the
//!   type `String.ojs-empty` (SQS refuses both as String values); a header
//!   name SQS refuses fails that message alone (see [`attributes`]).
//! * Size is checked before sending against the encoded size (base64 body +
//!   attribute names, types and values): `PayloadTooLarge` names both sizes.
//! * Publish uses SendMessageBatch in chunks of at most 10 entries and
//!   1 MiB, and checks every entry: failed entries are retried
//!   (`send_attempts`), what still fails is reported per message — never
//!   silently dropped. A batch SQS refuses as a whole for its content is
//!   sent again one message per request, so only the message at fault fails.
//! * ack = DeleteMessageBatch (acks waiting at the same time share a call,
//!   each answered by its own entry); a retry nack = ChangeMessageVisibility(delay); a
//!   dead-letter nack sends a copy with the reason to the DLQ, then deletes;
//!   `extend` = ChangeMessageVisibility (the worker's heartbeat). The attempt
//!   is SQS's ApproximateReceiveCount.
//!
//! ```no_run
//! # async fn demo() -> ojs_queue::Result<()> {
//! use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
//! use ojs_queue::{OutgoingMessage, QueueAdapter};
//! let adapter = SqsAdapter::connect(SqsConfig::from_url("sqs://us-east-1")?).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

mod ack;
pub mod attributes;
mod client;
mod config;
mod consume;
mod publish;
mod topology;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;
use ojs_queue::{admit, publish_outcome};
use ojs_queue::{
    BrokerErrorKind, Consumer, ConsumerOptions, Error, FailedPublish, Health, OutgoingMessage,
    QueueAdapter, Result, Source,
};

/// The SDK types [`received_message`] takes.
pub use aws_sdk_sqs::{primitives::Blob, types::MessageAttributeValue as AttributeValue};
pub use config::*;
pub use ojs_queue::settings::Topology;

use crate::ack::DeleteRequest;
use crate::client::call_error;
pub use client::sdk_client;
pub use consume::{received_message, ReceivedMessage, SqsConsumer, Typed};
pub use publish::encoded_size;

/// Attribute carrying the ordering key (SQS has no key outside FIFO groups).
pub const KEY_ATTRIBUTE: &str = "ojs-key";

#[derive(Debug)]
struct Inner {
    config: SqsConfig,
    client: Client,
    /// Queue name → URL.
    urls: Mutex<HashMap<String, String>>,
    /// OJS queue → its URL and its dead-letter queue's URL, if any.
    resolved: Mutex<HashMap<String, (String, Option<String>)>>,
    /// Queue URL → its delete batcher.
    deleters: Mutex<HashMap<String, tokio::sync::mpsc::UnboundedSender<DeleteRequest>>>,
    closed: AtomicBool,
}

/// A connection to SQS.
#[derive(Debug, Clone)]
pub struct SqsAdapter {
    inner: Arc<Inner>,
}

impl SqsAdapter {
    /// Loads credentials from the standard chain and builds the client.
    pub async fn connect(config: SqsConfig) -> Result<Self> {
        config.validate()?;
        Ok(SqsAdapter {
            inner: Arc::new(Inner {
                client: sdk_client(&config).await,
                config,
                urls: Mutex::new(HashMap::new()),
                resolved: Mutex::new(HashMap::new()),
                deleters: Mutex::new(HashMap::new()),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &SqsConfig {
        &self.inner.config
    }
}

#[async_trait]
impl QueueAdapter for SqsAdapter {
    fn kind(&self) -> &'static str {
        "sqs"
    }

    fn max_message_bytes(&self) -> usize {
        // Before base64: the encoded limit leaves 3/4 of it for the body.
        self.inner.config.max_message_bytes / 4 * 3
    }

    #[tracing::instrument(skip_all, fields(queue = %queue, count = messages.len()))]
    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        let (total, accepted, mut failed) = admit(
            messages,
            self.max_message_bytes(),
            self.inner.closed.load(Ordering::Acquire),
        )?;
        if !accepted.is_empty() {
            match self.inner.urls(queue).await {
                Ok((url, _)) => failed.extend(self.inner.send(&url, accepted, None).await),
                Err(e) => {
                    failed.extend(accepted.into_iter().map(|(index, message)| FailedPublish {
                        index,
                        message,
                        error: Error::broker("sqs", e.to_string(), e.is_retryable()),
                    }))
                }
            }
        }
        publish_outcome(total, failed)
    }

    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let (url, dlq) = self.inner.urls(queue).await?;
        let source_url = match options.source {
            Source::Queue => url,
            Source::DeadLetters => dlq.clone().ok_or_else(|| {
                Error::broker(
                    "sqs",
                    format!(
                        "queue {:?} has no dead-letter queue (no RedrivePolicy, and {:?} does not exist)",
                        self.inner.config.queue_name(queue),
                        self.inner.config.dead_letter_queue_name(queue)
                    ),
                    true,
                )
.with_broker_kind(BrokerErrorKind::NotFound)
            })?,
        };
        Ok(Box::new(SqsConsumer {
            inner: self.inner.clone(),
            queue: Arc::from(queue),
            url: source_url,
            dlq,
            options,
        }))
    }

    fn is_reserved(&self, queue: &str) -> bool {
        self.inner.config.is_reserved(queue)
    }

    async fn prepare(&self, queue: &str) -> Result<()> {
        self.inner.urls(queue).await.map(|_| ())
    }

    async fn open_reply_queue(&self, queue: &str) -> Result<()> {
        self.inner.config.topology.may_create_reply_queue(queue)?;
        self.prepare(queue).await
    }

    async fn delete_reply_queue(&self, queue: &str) -> Result<()> {
        // The queue and the dead-letter queue made with it.
        let (url, dead) = self.inner.urls(queue).await?;
        for url in std::iter::once(url).chain(dead) {
            if let Err(e) = self
                .inner
                .client
                .delete_queue()
                .queue_url(&url)
                .send()
                .await
            {
                let e = call_error(e);
                if e.broker_kind() != Some(BrokerErrorKind::NotFound) {
                    return Err(e);
                }
            }
        }
        {
            let mut urls = self.inner.urls.lock().unwrap_or_else(|e| e.into_inner());
            urls.remove(&self.inner.config.queue_name(queue));
            urls.remove(&self.inner.config.dead_letter_queue_name(queue));
        }
        self.inner
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
        Ok(())
    }

    async fn health(&self) -> Health {
        match self.inner.client.list_queues().max_results(1).send().await {
            Ok(_) => Health::ok(format!("sqs {}", self.inner.config.region)),
            Err(e) => Health::down(aws_sdk_sqs::error::DisplayErrorContext(e).to_string()),
        }
    }

    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let (url, _) = self.inner.urls(queue).await?;
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(call_error)?;
        let n = out
            .attributes()
            .map(|a| a.values().filter_map(|v| v.parse::<u64>().ok()).sum())
            .unwrap_or(0);
        Ok(Some(n))
    }

    async fn close(&self) -> Result<()> {
        // Every publish waited for SQS's answer: nothing to flush.
        self.inner.closed.store(true, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::attribute_value;
    use aws_sdk_sqs::types::MessageAttributeValue;

    #[test]
    fn what_sqs_cannot_hold_as_sent_reads_back_as_sent() {
        // An empty payload goes as a blank body, an empty value or key as
        // the empty type with its placeholder.
        let empty = attribute_value(b"").unwrap();
        assert_eq!(empty.data_type(), attributes::EMPTY_VALUE_TYPE);
        let control = attribute_value(b"a\x01b").unwrap();
        assert_eq!(control.data_type(), "Binary");
        let attrs = HashMap::from([
            ("empty".to_owned(), empty.clone()),
            (KEY_ATTRIBUTE.to_owned(), empty),
            ("control".to_owned(), control),
        ]);
        let m = received_message(" ", Some(&attrs), None);
        assert!(m.payload.is_empty());
        assert_eq!(m.headers.get("empty").unwrap().as_bytes(), b"");
        assert_eq!(m.headers.get("control").unwrap().as_bytes(), b"a\x01b");
        assert_eq!(m.key.as_deref(), Some(&b""[..]));
        assert!(m.typed.is_none(), "our own types are not kept apart");
        let number = MessageAttributeValue::builder()
            .data_type("Number")
            .string_value("42")
            .build()
            .unwrap();
        let attrs = HashMap::from([("retries".to_owned(), number.clone())]);
        let m = received_message("eA==", Some(&attrs), None);
        assert_eq!(m.headers.get_str("retries"), Some("42"));
        assert_eq!(m.typed.unwrap().get("retries"), Some(&number));
    }
}
