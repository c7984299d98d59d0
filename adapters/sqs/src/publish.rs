//! Publishing with `SendMessageBatch`: bodies in base64, headers as
//! attributes, requests cut at 10 entries and 1 MiB, every entry checked;
//! a batch refused for its content is sent again one message per request.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::{header, BrokerErrorKind, Error, FailedPublish, Headers, OutgoingMessage, Result};

use crate::client::{refuses_the_content, sqs_error};
use crate::{
    attributes, Inner, Typed, KEY_ATTRIBUTE, SQS_BATCH_LIMIT, SQS_MAX_ATTRIBUTES,
    SQS_MAX_DELAY_SECS, SQS_MAX_MESSAGE_BYTES,
};

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

impl Inner {
    /// One message as a batch entry, with its size as SQS counts it; a
    /// message SQS would refuse fails here, before any request.
    ///
    /// `typed`: for a copy of a received message, its attributes of their
    /// own type; one whose value the copy kept goes out as it came.
    pub(crate) fn entry(
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
    pub(crate) async fn send(
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
    pub(crate) fn chunks(
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

/// A message waiting to be sent, with its entry once encoded.
pub(crate) type Pending = (
    usize,
    OutgoingMessage,
    Option<(SendMessageBatchRequestEntry, usize)>,
);
/// A message and its entry, in a request being built.
pub(crate) type Encoded = (usize, OutgoingMessage, SendMessageBatchRequestEntry);

/// A header value (or key) as SQS takes it: XML text as a String
/// attribute; other bytes as a Binary one, so they arrive unchanged; an
/// empty value as [`attributes::EMPTY_VALUE_TYPE`] (SQS refuses empty
/// values of either type).
pub(crate) fn attribute_value(bytes: &[u8]) -> Result<MessageAttributeValue> {
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

pub(crate) fn uuid_like(payload: &[u8]) -> String {
    // Deterministic dedup id for FIFO messages without an id: a content hash.
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    format!("{:016x}", h.finish())
}
