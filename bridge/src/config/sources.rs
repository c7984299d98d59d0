//! `[[sources]]`: the queues the daemon consumes, and how.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::duration::duration_text;

/// What messages without a `content-type` header are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// grpcq calls (binary `grpcq.Message`, or base64 of one as grpcq's SQS
    /// adapter writes). The default: native grpcq publishers send no
    /// content type.
    #[default]
    Grpcq,
    /// OJS envelopes in protobuf.
    Ojs,
}

/// `[[sources]]`: one queue the daemon consumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Name used by routes, metrics and logs.
    pub name: String,
    /// Adapter name from `[adapters]`.
    pub adapter: String,
    /// Queue (Kafka topic, SQS queue, RabbitMQ queue) to consume.
    pub queue: String,
    /// Format of messages without a content type. Messages with one are
    /// decoded by it. Default `grpcq`.
    #[serde(default)]
    pub format: InputFormat,
    /// Consumer group (Kafka). Default `ojs-bridge`.
    #[serde(default = "default_group")]
    pub group: String,
    /// Messages fetched per receive. Default 256.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Messages received but not yet acked, at most; a slow sink slows
    /// consumption instead of growing memory. Default 2048.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Payload bytes received but not yet acked, at most (plus the one batch
    /// that crossed the line): memory is bounded by size, not only by count,
    /// when messages are large. Default 256 MiB.
    #[serde(default = "default_max_in_flight_bytes")]
    pub max_in_flight_bytes: usize,
    /// How long a received message stays invisible to other consumers
    /// (SQS, local, memory). Default `60s`.
    #[serde(default = "default_visibility_timeout", with = "duration_text")]
    pub visibility_timeout: Duration,
    /// Where poison messages go. Default: the source queue's own dead-letter
    /// destination (`ojs-bridge tail --dead-letters` reads it).
    #[serde(default)]
    pub dead_letter: Option<DeadLetterConfig>,
    /// `none` (default): batches run side by side, up to
    /// `max_in_flight / batch_size` at once, so a later batch may reach the
    /// sink before an earlier one. `per_key`: messages with the same key
    /// (Kafka record key, RabbitMQ `x-ojs-key`, SQS `ojs-key`) reach the
    /// sink in the order they were received, across batches and retries.
    #[serde(default)]
    pub ordering: OrderingMode,
    /// With `ordering = "per_key"`: keys are spread over this many lanes,
    /// each publishing one batch at a time. Default `max_in_flight /
    /// batch_size`.
    #[serde(default)]
    pub lanes: Option<usize>,
}

/// What order a source keeps; see [`SourceConfig::ordering`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderingMode {
    /// No order across batches.
    #[default]
    None,
    /// Per-key order across batches and retries.
    PerKey,
}

impl SourceConfig {
    /// Ordered lanes in force: `None` without `ordering = "per_key"`.
    pub fn ordered_lanes(&self) -> Option<usize> {
        match self.ordering {
            OrderingMode::None => None,
            OrderingMode::PerKey => Some(
                self.lanes
                    .unwrap_or(self.max_in_flight / self.batch_size.max(1))
                    .max(1),
            ),
        }
    }
}

pub(crate) fn default_group() -> String {
    "ojs-bridge".to_owned()
}
pub(crate) fn default_batch_size() -> usize {
    256
}
pub(crate) fn default_max_in_flight() -> usize {
    2048
}
pub(crate) fn default_max_in_flight_bytes() -> usize {
    256 * 1024 * 1024
}
pub(crate) fn default_visibility_timeout() -> Duration {
    Duration::from_secs(60)
}

/// `dead_letter = { adapter = "…", queue = "…" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// Adapter name from `[adapters]`.
    pub adapter: String,
    /// Queue that receives the message as it was, with `ojs-error-type` and
    /// `ojs-error-message` headers.
    pub queue: String,
}
