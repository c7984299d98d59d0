//! RabbitMQ adapter settings (serde data; the runtime lives in `lib.rs`).

use std::collections::BTreeMap;
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
    /// grpcq interop, consuming: OJS queue → grpcq exchanges bound to it.
    /// grpcq publishers send to exchange = topic with routing key = action;
    /// an entry `"payment.PaymentService"` binds every action (a topic
    /// exchange is declared when none exists), `"payment.PaymentService:Pay"`
    /// one action (works on direct and topic exchanges alike).
    #[serde(default)]
    pub grpcq_bindings: BTreeMap<String, Vec<String>>,
    /// grpcq interop, publishing: grpcq calls (`application/grpcq+proto`)
    /// go to exchange = topic, routing key = action, as grpcq publishers
    /// send them, instead of to an OJS queue.
    #[serde(default)]
    pub grpcq_exchanges: bool,
}

/// One grpcq binding: exchange (= grpcq topic) and routing key (= action,
/// `#` for all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcqBinding {
    /// Exchange name, the grpcq topic.
    pub exchange: String,
    /// Routing key: an action, or `#` for every action.
    pub routing_key: String,
}

impl GrpcqBinding {
    /// Parses `TOPIC` or `TOPIC:ACTION`.
    pub fn parse(text: &str) -> Result<GrpcqBinding> {
        let (exchange, routing_key) = match text.split_once(':') {
            Some((e, a)) => (e, a),
            None => (text, "#"),
        };
        if exchange.is_empty() || routing_key.is_empty() {
            return Err(Error::InvalidConfig {
                field: "grpcq_bindings".into(),
                reason: format!("{text:?} must be TOPIC or TOPIC:ACTION"),
            });
        }
        Ok(GrpcqBinding {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }
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
            grpcq_bindings: BTreeMap::new(),
            grpcq_exchanges: false,
        }
    }

    /// Parses an `amqp://` / `amqps://` URL. Query items of this adapter are
    /// taken out: `grpcq_bind.QUEUE=TOPIC[:ACTION][,…]` (repeatable) and
    /// `grpcq_exchanges=true`; the rest (`heartbeat`, `connection_timeout`…)
    /// stays for the AMQP client.
    pub fn from_url(url: &str) -> Result<Self> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut config = RabbitConfig::new(base);
        let mut rest = Vec::new();
        for item in query.split('&').filter(|i| !i.is_empty()) {
            let (key, value) = item.split_once('=').unwrap_or((item, ""));
            if let Some(queue) = key.strip_prefix("grpcq_bind.") {
                if queue.is_empty() {
                    return Err(Error::InvalidConfig {
                        field: "url".into(),
                        reason: format!("{item:?}: grpcq_bind.QUEUE=TOPIC[:ACTION] names no queue"),
                    });
                }
                let entries = config.grpcq_bindings.entry(queue.to_owned()).or_default();
                for binding in value.split(',').filter(|b| !b.is_empty()) {
                    GrpcqBinding::parse(binding)?;
                    entries.push(binding.to_owned());
                }
            } else if key == "grpcq_exchanges" {
                config.grpcq_exchanges = match value {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    other => {
                        return Err(Error::InvalidConfig {
                            field: "url".into(),
                            reason: format!("grpcq_exchanges={other:?}: use true or false"),
                        })
                    }
                };
            } else {
                rest.push(item);
            }
        }
        if !rest.is_empty() {
            config.url = format!("{base}?{}", rest.join("&"));
        }
        config.validate()?;
        Ok(config)
    }

    /// The grpcq bindings of `queue`.
    pub fn grpcq_bindings_of(&self, queue: &str) -> Vec<GrpcqBinding> {
        self.grpcq_bindings
            .get(queue)
            .into_iter()
            .flatten()
            .filter_map(|b| GrpcqBinding::parse(b).ok())
            .collect()
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
        for (queue, bindings) in &self.grpcq_bindings {
            for b in bindings {
                GrpcqBinding::parse(b).map_err(|_| Error::InvalidConfig {
                    field: format!("grpcq_bindings.{queue}"),
                    reason: format!("{b:?} must be TOPIC or TOPIC:ACTION"),
                })?;
            }
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

    #[test]
    fn urls_carry_grpcq_interop_and_leave_client_options_alone() {
        let c = RabbitConfig::from_url(
            "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10&grpcq_bind.calls=payment.PaymentService,email.Mailer:Send&grpcq_exchanges=true&grpcq_bind.calls=a.B",
        )
        .unwrap();
        assert_eq!(c.url, "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10");
        assert!(c.grpcq_exchanges);
        assert_eq!(
            c.grpcq_bindings_of("calls"),
            vec![
                GrpcqBinding {
                    exchange: "payment.PaymentService".into(),
                    routing_key: "#".into()
                },
                GrpcqBinding {
                    exchange: "email.Mailer".into(),
                    routing_key: "Send".into()
                },
                GrpcqBinding {
                    exchange: "a.B".into(),
                    routing_key: "#".into()
                },
            ]
        );
        assert!(RabbitConfig::from_url("amqp://h/%2f?grpcq_bind.q=:x").is_err());
        assert!(RabbitConfig::from_url("amqp://h/%2f?grpcq_exchanges=maybe").is_err());
        assert_eq!(
            RabbitConfig::from_url("amqp://h/%2f").unwrap().url,
            "amqp://h/%2f"
        );
    }
}
