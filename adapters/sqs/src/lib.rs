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
//! # async fn demo() -> ojs_core::Result<()> {
//! use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
//! use ojs_core::{OutgoingMessage, QueueAdapter};
//! let adapter = SqsAdapter::connect(SqsConfig::from_url("sqs://us-east-1")?).await?;
//! adapter.publish("default", vec![OutgoingMessage::new("hi", "text/plain")]).await?;
//! # Ok(()) }
//! ```

pub mod attributes;
mod config;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName,
    QueueAttributeName, SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use ojs_core::adapter::{admit, publish_outcome};
use ojs_core::backoff::reconnect_delay;
use ojs_core::{
    header, Acknowledger, BrokerErrorKind, Consumer, ConsumerOptions, DeadLetterReason, Delivery,
    DeliveryRef, Error, FailedPublish, HeaderName, Headers, Health, Nack, OutgoingMessage,
    QueueAdapter, Result, Source,
};

/// The SDK types [`received_message`] takes.
pub use aws_sdk_sqs::{primitives::Blob, types::MessageAttributeValue as AttributeValue};
pub use config::*;
pub use ojs_core::settings::Topology;

/// Attribute carrying the ordering key (SQS has no key outside FIFO groups).
pub const KEY_ATTRIBUTE: &str = "ojs-key";

fn sqs_error(e: impl std::fmt::Display) -> Error {
    Error::broker("sqs", e.to_string(), true)
}

/// A failed SQS call: no answer (dispatch failure, timeout) is
/// [`Error::Unreachable`], an answer is what SQS said.
fn call_error<E, R>(e: aws_sdk_sqs::error::SdkError<E, R>) -> Error
where
    E: std::error::Error + aws_sdk_sqs::error::ProvideErrorMetadata + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
    let unreachable = matches!(e, SdkError::DispatchFailure(_) | SdkError::TimeoutError(_));
    let message = aws_sdk_sqs::error::DisplayErrorContext(&e).to_string();
    if unreachable {
        Error::Unreachable {
            broker: "sqs",
            message,
        }
    } else {
        let kind = error_kind(e.code());
        Error::broker("sqs", message, true)
            .with_broker_kind(kind)
            .with_source(e)
    }
}

/// The kind of an SQS error code.
fn error_kind(code: Option<&str>) -> BrokerErrorKind {
    match code {
        Some("AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist") => {
            BrokerErrorKind::NotFound
        }
        Some(
            "AccessDenied"
            | "AccessDeniedException"
            | "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "SignatureDoesNotMatch"
            | "KmsAccessDenied",
        ) => BrokerErrorKind::AccessDenied,
        Some("QueueAlreadyExists" | "QueueNameExists") => BrokerErrorKind::Conflict,
        Some(code) if refuses_the_content(code) => BrokerErrorKind::Rejected,
        Some(
            "ThrottlingException"
            | "RequestThrottled"
            | "ServiceUnavailable"
            | "InternalError"
            | "InternalFailure"
            | "OverLimit"
            | "KmsThrottled",
        ) => BrokerErrorKind::Unavailable,
        _ => BrokerErrorKind::Other,
    }
}

/// Error codes with which SQS refuses what a request carries (a message, an
/// attribute, the size of a batch), not the caller or the queue.
fn refuses_the_content(code: &str) -> bool {
    matches!(
        code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code),
        "InvalidMessageContents"
            | "MessageTooLong"
            | "BatchRequestTooLong"
            | "InvalidParameterValue"
            | "InvalidAttributeName"
            | "InvalidAttributeValue"
    )
}

/// What an SQS message carries, in neutral form.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedMessage {
    /// The body, base64-decoded (a body that is not base64 is a legacy raw
    /// body, handed over as it is).
    pub payload: Bytes,
    /// Attributes: String ones as text, Binary ones as their bytes.
    pub headers: Headers,
    /// The `ojs-key` attribute (String or Binary).
    pub key: Option<Bytes>,
    /// `ApproximateReceiveCount`, 1 when absent or unreadable.
    pub attempt: u32,
    /// Attributes of a type other than plain `String` or `Binary`
    /// (`Number`, custom labels such as `String.json`): `headers` holds
    /// their values, and a dead-letter copy sends them with their own type
    /// again. `None`, without an allocation, when there are none.
    pub typed: Option<Typed>,
}

/// Reads a received message's body and attributes. The SQS attribute fuzz
/// target starts here.
pub fn received_message(
    body: &str,
    attributes: Option<&HashMap<String, MessageAttributeValue>>,
    receive_count: Option<&str>,
) -> ReceivedMessage {
    let payload = match STANDARD.decode(body.trim()) {
        Ok(raw) => Bytes::from(raw),
        Err(_) => Bytes::copy_from_slice(body.as_bytes()),
    };
    let mut headers = Headers::with_capacity(8);
    let mut key = None;
    let mut typed: Option<Typed> = None;
    for (k, v) in attributes.into_iter().flatten() {
        if k != KEY_ATTRIBUTE
            && !matches!(
                v.data_type(),
                "String" | "Binary" | attributes::EMPTY_VALUE_TYPE
            )
        {
            typed
                .get_or_insert_with(HashMap::new)
                .insert(k.clone(), v.clone());
        }
        if k == KEY_ATTRIBUTE {
            key = match (v.string_value(), v.binary_value()) {
                _ if v.data_type() == attributes::EMPTY_VALUE_TYPE => Some(Bytes::new()),
                (Some(s), _) => Some(Bytes::copy_from_slice(s.as_bytes())),
                (None, Some(b)) => Some(Bytes::copy_from_slice(b.as_ref())),
                (None, None) => None,
            };
        } else if v.data_type() == attributes::EMPTY_VALUE_TYPE {
            headers.insert(HeaderName::new(k), "");
        } else if let Some(s) = v.string_value() {
            headers.insert(HeaderName::new(k), s);
        } else if let Some(b) = v.binary_value() {
            headers.insert(HeaderName::new(k), b.as_ref());
        }
    }
    ReceivedMessage {
        payload,
        headers,
        key,
        attempt: receive_count
            .and_then(|c| c.parse::<u32>().ok())
            .filter(|c| *c > 0)
            .unwrap_or(1),
        typed,
    }
}

/// Binding headers a dead letter can go without: an OJS body holds each
/// of them, in this order of need.
const REDUNDANT_IN_DEAD_LETTERS: [&str; 3] = [header::SPECVERSION, header::QUEUE, header::TYPE];

/// A dead letter carries its reason in two attributes; a message that
/// already used most of SQS's 10 would not fit any more and could never be
/// dead-lettered. Binding headers the body repeats make room, in the order
/// of [`REDUNDANT_IN_DEAD_LETTERS`]; the reason and everything else stay.
fn make_room_for_the_reason(copy: &mut OutgoingMessage) {
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

/// Encoded size as SQS counts it: body plus each attribute's size
/// ([`attribute_size`]).
pub fn encoded_size(body_len: usize, headers: &Headers) -> usize {
    body_len
        + headers
            .iter()
            .map(|(k, v)| attribute_size(k.len(), v.len()))
            .sum::<usize>()
}

/// One attribute's size as SQS counts it: name, type ("String" or
/// "Binary", the same length) and value; an empty value as the type and
/// placeholder it travels with.
fn attribute_size(name_len: usize, value_len: usize) -> usize {
    name_len
        + if value_len == 0 {
            attributes::EMPTY_VALUE_TYPE.len() + attributes::EMPTY_VALUE_PLACEHOLDER.len()
        } else {
            "String".len() + value_len
        }
}

type DeleteRequest = (String, tokio::sync::oneshot::Sender<Result<()>>);

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

/// Deletes acked messages with DeleteMessageBatch: every ack waiting when a
/// call starts goes into it (up to 10, SQS's limit), and each ack gets the
/// result of its own entry.
async fn delete_batcher(
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
    async fn delete(&self, url: &str, receipt: &str) -> Result<()> {
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

    fn cached(&self, name: &str) -> Option<String> {
        self.urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    async fn create(&self, name: &str, redrive_to: Option<&str>) -> Result<String> {
        let mut req = self.client.create_queue().queue_name(name);
        if self.config.fifo {
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(dlq_arn) = redrive_to {
            let policy = serde_json::json!({
                "deadLetterTargetArn": dlq_arn,
                "maxReceiveCount": self.config.max_receive_count.to_string(),
            });
            req = req.attributes(QueueAttributeName::RedrivePolicy, policy.to_string());
        }
        let out = req.send().await.map_err(call_error)?;
        let url = out
            .queue_url()
            .ok_or_else(|| sqs_error("CreateQueue returned no URL"))?
            .to_owned();
        self.urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), url.clone());
        Ok(url)
    }

    /// The URL of queue `name`, or `None` when SQS has no such queue.
    async fn lookup(&self, name: &str) -> Result<Option<String>> {
        if let Some(url) = self.cached(name) {
            return Ok(Some(url));
        }
        match self.client.get_queue_url().queue_name(name).send().await {
            Ok(out) => {
                let url = out
                    .queue_url()
                    .ok_or_else(|| sqs_error("GetQueueUrl returned no URL"))?
                    .to_owned();
                self.urls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_owned(), url.clone());
                Ok(Some(url))
            }
            Err(e) => {
                let missing = e
                    .as_service_error()
                    .is_some_and(|se| se.is_queue_does_not_exist())
                    || aws_sdk_sqs::error::ProvideErrorMetadata::code(&e).is_some_and(|c| {
                        c.contains("NonExistentQueue") || c.contains("QueueDoesNotExist")
                    });
                if missing {
                    Ok(None)
                } else {
                    Err(call_error(e))
                }
            }
        }
    }

    /// The dead-letter queue SQS's own RedrivePolicy of `url` names, if any.
    async fn redrive_target(&self, url: &str) -> Result<Option<String>> {
        let attrs = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(call_error)?;
        let Some(policy) = attrs
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::RedrivePolicy))
        else {
            return Ok(None);
        };
        let arn = serde_json::from_str::<serde_json::Value>(policy)
            .ok()
            .and_then(|p| p.get("deadLetterTargetArn")?.as_str().map(str::to_owned));
        // arn:aws:sqs:REGION:ACCOUNT:NAME
        match arn.as_deref().and_then(|a| a.rsplit(':').next()) {
            Some(name) if !name.is_empty() => self.lookup(name).await,
            _ => Ok(None),
        }
    }

    /// URLs of the queue and of where its dead letters go.
    ///
    /// `declare`: an existing queue is used as it is, its own redrive target
    /// as its DLQ (else the template's DLQ, created if missing); a missing
    /// queue is created after its DLQ, with a RedrivePolicy.
    /// `existing`: nothing is created; the queue must exist; its DLQ is its
    /// redrive target, else the template's queue if that exists, else none.
    async fn urls(&self, queue: &str) -> Result<(String, Option<String>)> {
        let (name, dlq) = (
            self.config.queue_name(queue),
            self.config.dead_letter_queue_name(queue),
        );
        if let Some(known) = self
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(known.clone());
        }
        let resolved = match (self.lookup(&name).await?, self.config.topology) {
            (Some(url), topology) => {
                let dead = match self.redrive_target(&url).await? {
                    Some(d) => Some(d),
                    None => match (self.lookup(&dlq).await?, topology) {
                        (Some(d), _) => Some(d),
                        (None, Topology::Declare) => Some(self.create(&dlq, None).await?),
                        (None, Topology::Existing) => None,
                    },
                };
                (url, dead)
            }
            (None, Topology::Existing) => {
                return Err(Error::broker(
                    "sqs",
                    format!("queue {name:?} does not exist (topology = \"existing\" creates nothing; create it, or use topology = \"declare\")"),
                    true,
                )
.with_broker_kind(BrokerErrorKind::NotFound))
            }
            (None, Topology::Declare) => {
                let dlq_url = match self.lookup(&dlq).await? {
                    Some(u) => u,
                    None => self.create(&dlq, None).await?,
                };
                let attrs = self
                    .client
                    .get_queue_attributes()
                    .queue_url(&dlq_url)
                    .attribute_names(QueueAttributeName::QueueArn)
                    .send()
                    .await
                    .map_err(call_error)?;
                let arn = attrs
                    .attributes()
                    .and_then(|a| a.get(&QueueAttributeName::QueueArn))
                    .ok_or_else(|| sqs_error("the DLQ has no QueueArn"))?
                    .clone();
                (self.create(&name, Some(&arn)).await?, Some(dlq_url))
            }
        };
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), resolved.clone());
        Ok(resolved)
    }

    /// One message as a batch entry, with its size as SQS counts it; a
    /// message SQS would refuse fails here, before any request.
    ///
    /// `typed`: for a copy of a received message, its attributes of their
    /// own type; one whose value the copy kept goes out as it came.
    fn entry(
        &self,
        id: usize,
        m: &OutgoingMessage,
        typed: Option<&Typed>,
    ) -> Result<(SendMessageBatchRequestEntry, usize)> {
        let mut attributes = m.headers.clone();
        // A text key travels as a String attribute (what other readers
        // expect), any other key as a Binary one: its bytes come back.
        let key = m.key.as_ref().map(|k| attribute_value(k)).transpose()?;
        attributes.remove(KEY_ATTRIBUTE);
        let key_size = m
            .key
            .as_ref()
            .map_or(0, |k| attribute_size(KEY_ATTRIBUTE.len(), k.len()));
        if attributes.len() + usize::from(key.is_some()) > SQS_MAX_ATTRIBUTES {
            return Err(Error::InvalidConfig {
                field: "headers".into(),
                reason: format!(
                    "SQS allows at most {SQS_MAX_ATTRIBUTES} message attributes; this message needs {} (headers and ordering key)",
                    attributes.len() + usize::from(key.is_some())
                ),
            });
        }
        for (k, _) in &attributes {
            attributes::check_name(k.as_str())?;
        }
        // SQS refuses an empty body; a blank one reads back as empty (the
        // body is trimmed before base64 decoding).
        let body = if m.payload.is_empty() {
            " ".to_owned()
        } else {
            STANDARD.encode(&m.payload)
        };
        let size = encoded_size(body.len(), &attributes) + key_size;
        if size > self.config.max_message_bytes {
            return Err(Error::PayloadTooLarge {
                size,
                limit: self.config.max_message_bytes,
            });
        }
        let mut e = SendMessageBatchRequestEntry::builder()
            .id(id.to_string())
            .message_body(body);
        for (k, v) in &attributes {
            let as_received = typed.and_then(|t| t.get(k.as_str())).filter(|t| {
                let read = t.string_value().map(str::as_bytes);
                read.or(t.binary_value().map(Blob::as_ref)) == Some(v.as_bytes())
            });
            let value = match as_received {
                Some(t) => t.clone(),
                None => attribute_value(v.as_bytes())?,
            };
            e = e.message_attributes(k.as_str(), value);
        }
        if let Some(key) = key {
            e = e.message_attributes(KEY_ATTRIBUTE, key);
        }
        if let Some(at) = m.deliver_at {
            let secs = (at - chrono::Utc::now()).num_seconds().max(0) as u64;
            if secs > SQS_MAX_DELAY_SECS {
                return Err(Error::InvalidConfig {
                    field: "scheduled_at".into(),
                    reason: format!("SQS delays delivery by at most {SQS_MAX_DELAY_SECS} s; this job is {secs} s ahead"),
                });
            }
            if secs > 0 && !self.config.fifo {
                e = e.delay_seconds(secs as i32);
            }
        }
        if self.config.fifo {
            let dedup = match &m.message_id {
                Some(id) => attributes::fifo_id(id).into_owned(),
                None => uuid_like(&m.payload),
            };
            let group = attributes::fifo_id(m.headers.get_str(header::QUEUE).unwrap_or("default"));
            e = e
                .message_group_id(group.into_owned())
                .message_deduplication_id(dedup);
        }
        Ok((e.build().map_err(sqs_error)?, size))
    }

    /// SendMessageBatch in chunks of at most 10 entries and
    /// [`SQS_MAX_MESSAGE_BYTES`]; failed entries retried; the rest reported
    /// per message.
    async fn send(
        &self,
        url: &str,
        items: Vec<(usize, OutgoingMessage)>,
        typed: Option<&Typed>,
    ) -> Vec<FailedPublish> {
        let mut failed = Vec::new();
        // Each message is encoded (base64 + attributes) once; the entry is
        // moved into the request, and only the rare retried entry is
        // encoded again.
        let mut pending: Vec<Pending> = items
            .into_iter()
            .map(|(index, message)| (index, message, None))
            .collect();
        let mut attempt = 0;
        while !pending.is_empty() {
            attempt += 1;
            let mut retry = Vec::new();
            let mut chunks = self.chunks(std::mem::take(&mut pending), typed, &mut failed);
            while let Some(chunk) = chunks.pop_front() {
                let (entries, chunk): (Vec<_>, Vec<_>) = chunk
                    .into_iter()
                    .map(|(index, message, entry)| (entry, (index, message)))
                    .unzip();
                let result = self
                    .client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries))
                    .send()
                    .await;
                match result {
                    Ok(out) => {
                        let mut errors: HashMap<String, Error> = out
                            .failed()
                            .iter()
                            .map(|f| {
                                let error = Error::broker(
                                    "sqs",
                                    format!(
                                        "{}: {}",
                                        f.code(),
                                        f.message().unwrap_or("entry failed")
                                    ),
                                    !f.sender_fault(),
                                );
                                (f.id().to_owned(), error)
                            })
                            .collect();
                        for (index, message) in chunk {
                            if let Some(error) = errors.remove(&index.to_string()) {
                                retry.push((index, message, error));
                            }
                        }
                    }
                    Err(e) => {
                        use aws_sdk_sqs::error::ProvideErrorMetadata;
                        let refused = e.code().is_some_and(refuses_the_content);
                        let text = aws_sdk_sqs::error::DisplayErrorContext(&e).to_string();
                        if refused && chunk.len() > 1 {
                            // One entry can make SQS refuse the whole
                            // request: each message goes again on its own,
                            // so the others are not held by it.
                            tracing::warn!(
                                code = e.code().unwrap_or_default(),
                                entries = chunk.len(),
                                "SQS refused a batch for its content; sending its messages one by one"
                            );
                            for (index, message) in chunk.into_iter().rev() {
                                match self.entry(index, &message, typed) {
                                    Ok((entry, _)) => {
                                        chunks.push_front(vec![(index, message, entry)])
                                    }
                                    Err(error) => failed.push(FailedPublish {
                                        index,
                                        message,
                                        error,
                                    }),
                                }
                            }
                            continue;
                        }
                        for (index, message) in chunk {
                            // A message SQS refuses on its own is that
                            // message's fault: retrying cannot change it.
                            let error = Error::broker("sqs", text.clone(), !refused);
                            let error = if refused {
                                error.with_broker_kind(BrokerErrorKind::Rejected)
                            } else {
                                error
                            };
                            retry.push((index, message, error));
                        }
                    }
                }
            }
            for (index, message, error) in retry {
                if error.is_retryable() && attempt < self.config.send_attempts {
                    pending.push((index, message, None));
                } else {
                    failed.push(FailedPublish {
                        index,
                        message,
                        error,
                    });
                }
            }
            if !pending.is_empty() {
                tokio::time::sleep(reconnect_delay(attempt, Duration::from_secs(5)) / 4).await;
            }
        }
        failed
    }

    /// Groups messages into requests of at most [`SQS_BATCH_LIMIT`] entries
    /// whose sizes add up to at most [`SQS_MAX_MESSAGE_BYTES`] (SQS refuses
    /// a larger batch as a whole), encoding those not encoded yet; a message
    /// that cannot be encoded goes to `failed`.
    fn chunks(
        &self,
        items: Vec<Pending>,
        typed: Option<&Typed>,
        failed: &mut Vec<FailedPublish>,
    ) -> std::collections::VecDeque<Vec<Encoded>> {
        let mut chunks = std::collections::VecDeque::new();
        let mut chunk: Vec<Encoded> = Vec::with_capacity(SQS_BATCH_LIMIT);
        let mut bytes = 0;
        for (index, message, entry) in items {
            let (entry, size) = match entry.map_or_else(|| self.entry(index, &message, typed), Ok) {
                Ok(encoded) => encoded,
                Err(error) => {
                    failed.push(FailedPublish {
                        index,
                        message,
                        error,
                    });
                    continue;
                }
            };
            if chunk.len() == SQS_BATCH_LIMIT
                || (!chunk.is_empty() && bytes + size > SQS_MAX_MESSAGE_BYTES)
            {
                chunks.push_back(std::mem::take(&mut chunk));
                bytes = 0;
            }
            bytes += size;
            chunk.push((index, message, entry));
        }
        if !chunk.is_empty() {
            chunks.push_back(chunk);
        }
        chunks
    }
}

/// Attributes of their own type, by name ([`ReceivedMessage::typed`]).
pub type Typed = HashMap<String, MessageAttributeValue>;
/// A message waiting to be sent, with its entry once encoded.
type Pending = (
    usize,
    OutgoingMessage,
    Option<(SendMessageBatchRequestEntry, usize)>,
);
/// A message and its entry, in a request being built.
type Encoded = (usize, OutgoingMessage, SendMessageBatchRequestEntry);

/// A header value (or key) as SQS takes it: XML text as a String
/// attribute; other bytes as a Binary one, so they arrive unchanged; an
/// empty value as [`attributes::EMPTY_VALUE_TYPE`] (SQS refuses empty
/// values of either type).
fn attribute_value(bytes: &[u8]) -> Result<MessageAttributeValue> {
    let value = if bytes.is_empty() {
        MessageAttributeValue::builder()
            .data_type(attributes::EMPTY_VALUE_TYPE)
            .string_value(attributes::EMPTY_VALUE_PLACEHOLDER)
    } else {
        match std::str::from_utf8(bytes) {
            Ok(text) if attributes::is_xml_text(text) => MessageAttributeValue::builder()
                .data_type("String")
                .string_value(text),
            _ => MessageAttributeValue::builder()
                .data_type("Binary")
                .binary_value(Blob::new(bytes.to_vec())),
        }
    };
    value.build().map_err(sqs_error)
}

fn uuid_like(payload: &[u8]) -> String {
    // Deterministic dedup id for FIFO messages without an id: a content hash.
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// A connection to SQS.
#[derive(Debug, Clone)]
pub struct SqsAdapter {
    inner: Arc<Inner>,
}

/// An aws-sdk-sqs client for these settings (region, endpoint, credentials
/// from the standard chain): the one the adapter uses, and the one tools and
/// benchmarks need to talk to the same server directly.
pub async fn sdk_client(config: &SqsConfig) -> Client {
    let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(config.region.clone()))
        .load()
        .await;
    let mut b = aws_sdk_sqs::config::Builder::from(&shared).timeout_config(
        aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
            .connect_timeout(config.call_timeout())
            .operation_attempt_timeout(config.call_timeout())
            .build(),
    );
    if let Some(ep) = &config.endpoint {
        b = b.endpoint_url(ep);
    }
    Client::from_conf(b.build())
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

/// A long-polling consumer of one SQS queue (or its DLQ).
#[derive(Debug)]
pub struct SqsConsumer {
    inner: Arc<Inner>,
    queue: Arc<str>,
    url: String,
    dlq: Option<String>,
    options: ConsumerOptions,
}

#[async_trait]
impl Consumer for SqsConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let visibility = self
            .options
            .visibility_timeout
            .as_secs()
            .clamp(0, SQS_MAX_VISIBILITY_SECS);
        // Rounded up: a sub-second wait must still long-poll, not spin.
        let wait_secs = (wait.as_secs_f64().ceil() as u64).min(SQS_MAX_WAIT_SECS);
        // The long poll is not a hang: the call's timeout starts after it.
        let timeouts = aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
            .operation_attempt_timeout(
                Duration::from_secs(wait_secs) + self.inner.config.call_timeout(),
            )
            .build();
        let out = self
            .inner
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, SQS_BATCH_LIMIT) as i32)
            .wait_time_seconds(wait_secs as i32)
            .visibility_timeout(visibility as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_attribute_names("All")
            .customize()
            .config_override(aws_sdk_sqs::config::Builder::default().timeout_config(timeouts))
            .send()
            .await
            .map_err(call_error)?;
        let mut deliveries = Vec::new();
        for m in out.messages() {
            let Some(receipt) = m.receipt_handle() else {
                continue;
            };
            let ReceivedMessage {
                payload,
                headers,
                key,
                attempt,
                typed,
            } = received_message(
                m.body().unwrap_or_default(),
                m.message_attributes(),
                m.attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .map(String::as_str),
            );
            let acker = SqsAcker {
                inner: self.inner.clone(),
                url: self.url.clone(),
                dlq: self.dlq.clone(),
                receipt: receipt.to_owned(),
                attempt,
                typed,
                max_deliveries: match self.options.source {
                    Source::Queue => self.options.max_deliveries,
                    Source::DeadLetters => None,
                },
            };
            let mut d = Delivery::new(
                payload,
                headers,
                attempt,
                self.queue.clone(),
                Box::new(acker),
            );
            d.key = key;
            d.message_id = m.message_id().map(str::to_owned);
            deliveries.push(d);
        }
        Ok(deliveries)
    }

    async fn close(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct SqsAcker {
    inner: Arc<Inner>,
    url: String,
    dlq: Option<String>,
    receipt: String,
    attempt: u32,
    /// The message's attributes of their own type ([`ReceivedMessage::typed`]).
    typed: Option<Typed>,
    max_deliveries: Option<u32>,
}

impl SqsAcker {
    async fn visibility(&self, secs: u64) -> Result<()> {
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

    async fn dead_letter(
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
                    ojs_core::DeadLetterKind::MaxDeliveries,
                    format!(
                        "delivered {} times without being acknowledged",
                        self.attempt
                    ),
                );
                self.dead_letter(&reason, &delivery).await
            }
            Nack::Retry { delay } => self.visibility(delay.as_secs_f64().ceil() as u64).await,
            Nack::DeadLetter(reason) => self.dead_letter(&reason, &delivery).await,
        }
    }

    async fn extend(&self, by: Duration) -> Result<()> {
        self.visibility(by.as_secs().max(1)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
