//! Consuming with long polls: each message read back into a delivery
//! (base64 or raw bodies, attributes as headers), invisible for the
//! visibility timeout while it is held.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use ojs_queue::{Consumer, ConsumerOptions, Delivery, HeaderName, Headers, Result, Source};

use crate::ack::SqsAcker;
use crate::client::call_error;
use crate::{
    attributes, Inner, KEY_ATTRIBUTE, SQS_BATCH_LIMIT, SQS_MAX_VISIBILITY_SECS, SQS_MAX_WAIT_SECS,
};

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

/// Attributes of their own type, by name ([`ReceivedMessage::typed`]).
pub type Typed = HashMap<String, MessageAttributeValue>;
/// A long-polling consumer of one SQS queue (or its DLQ).
#[derive(Debug)]
pub struct SqsConsumer {
    pub(crate) inner: Arc<Inner>,
    pub(crate) queue: Arc<str>,
    pub(crate) url: String,
    pub(crate) dlq: Option<String>,
    pub(crate) options: ConsumerOptions,
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
