//! RabbitMQ adapter settings (serde data; the runtime lives in `lib.rs`).

use std::time::Duration;

use ojs_core::{Error, Result};
use serde::{Deserialize, Serialize};

/// Settings of an `amqp://` / `amqps://` adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitConfig {
    /// `amqp://user:pass@host:port/vhost` or `amqps://…` (vhost URL-encoded,
    /// `%2f` for `/`).
    pub url: String,
    /// Unacknowledged messages a consumer holds at once (`basic.qos`).
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// Declare queues as quorum queues (replicated; no per-message priority).
    #[serde(default)]
    pub quorum_queues: bool,
    /// `x-max-priority` of classic queues; `None` disables priorities.
    #[serde(default = "default_max_priority")]
    pub max_priority: Option<u8>,
    /// Largest message (body + headers) accepted, bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// How long a publish may spend waiting for confirms and reconnecting
    /// before the unconfirmed messages are reported as failed.
    #[serde(default = "default_publish_timeout_secs")]
    pub publish_timeout_secs: u64,
    /// Upper bound of the reconnect backoff (DESIGN §4: min(2^(n−1), 60) s).
    #[serde(default = "default_max_backoff_secs")]
    pub max_backoff_secs: u64,
    /// Idle retry queues are deleted by the broker after this long.
    #[serde(default = "default_retry_queue_expiry_secs")]
    pub retry_queue_expiry_secs: u64,
}

/// 100: a few batches in flight without hoarding work from other consumers.
fn default_prefetch() -> u16 {
    100
}

/// 10: RabbitMQ recommends at most 10 priority levels for classic queues.
fn default_max_priority() -> Option<u8> {
    Some(10)
}

/// 16 MiB: far above envelope sizes; RabbitMQ's own cap (128 MiB) is not a
/// size anyone should send through a queue.
fn default_max_message_bytes() -> usize {
    16 * 1024 * 1024
}

/// 30 s.
fn default_publish_timeout_secs() -> u64 {
    30
}

/// 60 s (DESIGN §4).
fn default_max_backoff_secs() -> u64 {
    60
}

/// 1 h.
fn default_retry_queue_expiry_secs() -> u64 {
    3600
}

impl RabbitConfig {
    /// Defaults for a broker URL.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitConfig {
            url: url.into(),
            prefetch: default_prefetch(),
            quorum_queues: false,
            max_priority: default_max_priority(),
            max_message_bytes: default_max_message_bytes(),
            publish_timeout_secs: default_publish_timeout_secs(),
            max_backoff_secs: default_max_backoff_secs(),
            retry_queue_expiry_secs: default_retry_queue_expiry_secs(),
        }
    }

    /// Checks the settings once, naming the field to change.
    pub fn validate(&self) -> Result<()> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(Error::InvalidConfig {
                field: "url".into(),
                reason: format!("{:?} must start with amqp:// or amqps://", self.url),
            });
        }
        if self.prefetch == 0 {
            return Err(Error::InvalidConfig {
                field: "prefetch".into(),
                reason: "0 means unlimited in AMQP; give a bound such as 100".into(),
            });
        }
        if self.quorum_queues && self.max_priority.is_some() {
            return Err(Error::InvalidConfig {
                field: "max_priority".into(),
                reason:
                    "quorum queues do not take x-max-priority; set it to null or use classic queues"
                        .into(),
            });
        }
        if self.max_priority == Some(0) {
            return Err(Error::InvalidConfig {
                field: "max_priority".into(),
                reason: "must be 1..=255, or null to disable priorities".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn publish_timeout(&self) -> Duration {
        Duration::from_secs(self.publish_timeout_secs.max(1))
    }
}

/// Exchange that routes jobs to their queue (routing key = OJS queue).
pub const DIRECT_EXCHANGE: &str = "ojs.exchange.direct";
/// Exchange for dead letters (routing key = OJS queue).
pub const DLX_EXCHANGE: &str = "ojs.exchange.dlx";
/// Exchange for delayed retries (routing key = `{queue}.{delay_ms}`).
pub const RETRY_EXCHANGE: &str = "ojs.exchange.retry";

/// `ojs.queue.{queue}`.
pub fn queue_name(queue: &str) -> String {
    format!("ojs.queue.{queue}")
}

/// `ojs.queue.dlx.{queue}`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("ojs.queue.dlx.{queue}")
}

/// `ojs.queue.retry.{queue}.{delay_ms}`.
pub fn retry_queue_name(queue: &str, delay_ms: u64) -> String {
    format!("ojs.queue.retry.{queue}.{delay_ms}")
}

/// Rounds a delay *up* to two significant digits (1234 ms → 1300 ms), so a
/// message never comes back early and jittered backoff creates a bounded
/// number of retry queues (about 90 per decade) instead of one per delay.
pub fn bucket_delay_ms(delay: Duration) -> u64 {
    let ms = delay.as_millis().max(1) as u64;
    let mut scale = 1;
    while ms / scale >= 100 {
        scale *= 10;
    }
    ms.div_ceil(scale) * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_two_significant_digits() {
        assert_eq!(bucket_delay_ms(Duration::from_millis(1)), 1);
        assert_eq!(bucket_delay_ms(Duration::from_millis(99)), 99);
        assert_eq!(bucket_delay_ms(Duration::from_millis(1234)), 1300);
        assert_eq!(bucket_delay_ms(Duration::from_millis(1200)), 1200);
        assert_eq!(bucket_delay_ms(Duration::from_secs(300)), 300_000);
        assert_eq!(bucket_delay_ms(Duration::ZERO), 1);
        for ms in [1u64, 17, 999, 1001, 65_432, 299_999] {
            assert!(bucket_delay_ms(Duration::from_millis(ms)) >= ms);
        }
    }

    #[test]
    fn bad_settings_name_their_field() {
        let mut c = RabbitConfig::new("http://x");
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "url"));
        c.url = "amqp://localhost".into();
        c.prefetch = 0;
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "prefetch")
        );
        c.prefetch = 10;
        c.quorum_queues = true;
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "max_priority")
        );
        c.max_priority = None;
        assert!(c.validate().is_ok());
    }
}
