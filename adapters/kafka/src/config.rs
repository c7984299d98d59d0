//! Kafka adapter settings (serde data; the runtime lives in `lib.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use ojs_core::{Error, Result};
use serde::{Deserialize, Serialize};

/// Settings of a `kafka://` adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port]`.
    pub brokers: String,
    /// Topic of a queue; `{queue}` is replaced by the OJS queue name.
    #[serde(default = "default_topic_template")]
    pub topic_template: String,
    /// Topic of delayed retries and scheduled jobs.
    #[serde(default = "default_retry_topic_template")]
    pub retry_topic_template: String,
    /// Topic of dead letters.
    #[serde(default = "default_dead_topic_template")]
    pub dead_topic_template: String,
    /// Partitions of topics the adapter creates.
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Replication factor of topics the adapter creates.
    #[serde(default = "default_replication")]
    pub replication: i32,
    /// Largest message (body + headers), bytes; Kafka's broker default
    /// `message.max.bytes` is about 1 MiB.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// How long a publish may wait for delivery reports (librdkafka
    /// `message.timeout.ms`).
    #[serde(default = "default_publish_timeout_ms")]
    pub publish_timeout_ms: u64,
    /// Consumer group session timeout.
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Retry records held in memory until due before the retry topic's
    /// partitions are paused.
    #[serde(default = "default_max_delayed_in_memory")]
    pub max_delayed_in_memory: usize,
    /// How often a consumer commits the contiguous prefix of settled
    /// offsets (only when it advanced).
    #[serde(default = "default_commit_interval_ms")]
    pub commit_interval_ms: u64,
    /// Consumer group whose lag `depth` reports.
    #[serde(default = "default_depth_group")]
    pub depth_group: String,
    /// Any librdkafka option, passed through (SASL, SSL, tuning), e.g.
    /// `security.protocol = "SASL_SSL"`. Applied to producer and consumers,
    /// after ours, so they win.
    #[serde(default)]
    pub librdkafka_options: BTreeMap<String, String>,
}

fn default_topic_template() -> String {
    "ojs.queue.{queue}".into()
}
fn default_retry_topic_template() -> String {
    "ojs.queue.{queue}.retry".into()
}
fn default_dead_topic_template() -> String {
    "ojs.dead.{queue}".into()
}
/// 3: parallelism for a small consumer group without many empty partitions.
fn default_partitions() -> i32 {
    3
}
/// 1: works on a single broker; production clusters should set 3.
fn default_replication() -> i32 {
    1
}
/// 1 MiB minus room for the record overhead under Kafka's 1,048,588 default.
fn default_max_message_bytes() -> usize {
    1024 * 1024
}
/// 30 s.
fn default_publish_timeout_ms() -> u64 {
    30_000
}
/// 10 s: notices a dead consumer quickly without flapping.
fn default_session_timeout_ms() -> u64 {
    10_000
}
/// 10,000 records.
fn default_max_delayed_in_memory() -> usize {
    10_000
}
/// 200 ms: commits stay close to acks without a commit per ack.
fn default_commit_interval_ms() -> u64 {
    200
}
fn default_depth_group() -> String {
    "ojs-bridge".into()
}

impl KafkaConfig {
    /// Defaults for a bootstrap server list.
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            topic_template: default_topic_template(),
            retry_topic_template: default_retry_topic_template(),
            dead_topic_template: default_dead_topic_template(),
            partitions: default_partitions(),
            replication: default_replication(),
            max_message_bytes: default_max_message_bytes(),
            publish_timeout_ms: default_publish_timeout_ms(),
            session_timeout_ms: default_session_timeout_ms(),
            max_delayed_in_memory: default_max_delayed_in_memory(),
            commit_interval_ms: default_commit_interval_ms(),
            depth_group: default_depth_group(),
            librdkafka_options: BTreeMap::new(),
        }
    }

    /// Parses `kafka://host:port[,host:port][?librdkafka.option=value…]`.
    pub fn from_url(url: &str) -> Result<Self> {
        let rest = url
            .strip_prefix("kafka://")
            .ok_or_else(|| Error::InvalidConfig {
                field: "url".into(),
                reason: format!("{url:?} must start with kafka://"),
            })?;
        let (brokers, query) = rest.split_once('?').unwrap_or((rest, ""));
        let brokers = brokers.trim_end_matches('/');
        if brokers.is_empty() {
            return Err(Error::InvalidConfig {
                field: "url".into(),
                reason: format!("{url:?} names no broker (kafka://host:port)"),
            });
        }
        let mut config = KafkaConfig::new(brokers);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| Error::InvalidConfig {
                field: "url".into(),
                reason: format!("query item {pair:?} is not option=value"),
            })?;
            config.librdkafka_options.insert(k.to_owned(), v.to_owned());
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the settings once, naming the field to change.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(Error::InvalidConfig {
                field: field.into(),
                reason,
            })
        };
        for (field, t) in [
            ("topic_template", &self.topic_template),
            ("retry_topic_template", &self.retry_topic_template),
            ("dead_topic_template", &self.dead_topic_template),
        ] {
            if !t.contains("{queue}") {
                return bad(field, format!("{t:?} must contain {{queue}}"));
            }
        }
        if self.topic_of("q") == self.retry_topic_of("q")
            || self.topic_of("q") == self.dead_topic_of("q")
        {
            return bad(
                "retry_topic_template",
                "queue, retry and dead topics must differ".into(),
            );
        }
        if self.partitions < 1 {
            return bad(
                "partitions",
                format!("must be at least 1, got {}", self.partitions),
            );
        }
        if self.replication < 1 {
            return bad(
                "replication",
                format!("must be at least 1, got {}", self.replication),
            );
        }
        Ok(())
    }

    /// Topic of `queue`.
    pub fn topic_of(&self, queue: &str) -> String {
        self.topic_template.replace("{queue}", queue)
    }

    /// Retry topic of `queue`.
    pub fn retry_topic_of(&self, queue: &str) -> String {
        self.retry_topic_template.replace("{queue}", queue)
    }

    /// Dead-letter topic of `queue`.
    pub fn dead_topic_of(&self, queue: &str) -> String {
        self.dead_topic_template.replace("{queue}", queue)
    }

    pub(crate) fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_templates() {
        let c =
            KafkaConfig::from_url("kafka://a:9092,b:9092?security.protocol=SASL_SSL&linger.ms=5")
                .unwrap();
        assert_eq!(c.brokers, "a:9092,b:9092");
        assert_eq!(c.librdkafka_options["security.protocol"], "SASL_SSL");
        assert_eq!(c.topic_of("mail"), "ojs.queue.mail");
        assert_eq!(c.retry_topic_of("mail"), "ojs.queue.mail.retry");
        assert_eq!(c.dead_topic_of("mail"), "ojs.dead.mail");
        assert!(KafkaConfig::from_url("kafka://").is_err());
        assert!(KafkaConfig::from_url("kafka://h:1?novalue").is_err());
        let mut c = KafkaConfig::new("h:1");
        c.topic_template = "fixed".into();
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "topic_template")
        );
    }
}
