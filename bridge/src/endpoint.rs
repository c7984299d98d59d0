//! Adapters chosen by URL (docs/design.md §7), with their settings: the CLI reads a
//! URL with settings as query items, the daemon a URL plus a table of
//! settings and environment overrides. Both compile into one
//! [`AdapterConfig`] before anything connects.

use std::sync::Arc;

use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_memory::{MemoryAdapter, MemoryConfig};
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_queue::settings::SettingValue;
use ojs_queue::{Error, QueueAdapter, Result};

/// Where a queue's messages live on its broker, and the destinations
/// beside it that must be the queue's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destinations {
    /// The broker, without credentials.
    pub broker: String,
    /// The queue's own destination (topic, queue).
    pub own: String,
    /// What else is the queue's, by kind (`retry topic`, …).
    pub beside: Vec<(&'static str, String)>,
}

/// One adapter's settings, typed and validated.
#[derive(Debug, Clone, PartialEq)]
pub enum AdapterConfig {
    /// `memory://NAME`: the in-process broker called NAME.
    Memory {
        /// Broker name.
        name: String,
        /// Settings.
        config: MemoryConfig,
    },
    /// `local:` (the embedded broker).
    Local(LocalConfig),
    /// `amqp://`, `amqps://`.
    Rabbit(RabbitConfig),
    /// `kafka://`.
    Kafka(KafkaConfig),
    /// `sqs://`.
    Sqs(SqsConfig),
}

/// The URL forms, for errors.
const URL_FORMS: &str = "memory://NAME, local:///abs/dir, local:./dir, kafka://host:port, amqp://user:pass@host:port/vhost, amqps://…, or sqs://REGION";

/// The scheme of a URL (`local:` has no `//`).
pub(crate) fn scheme(url: &str) -> &str {
    url.split(':').next().unwrap_or_default()
}

impl AdapterConfig {
    /// Reads a URL; its query items are settings (for Kafka, items that are
    /// not settings are librdkafka options).
    pub fn from_url(url: &str) -> Result<AdapterConfig> {
        Self::from_url_with(url, Vec::new())
    }

    /// Reads a URL, then `settings` over it (later items win).
    pub fn from_url_with(
        url: &str,
        settings: Vec<(String, SettingValue)>,
    ) -> Result<AdapterConfig> {
        Ok(match scheme(url) {
            "memory" => {
                let (name, config) = MemoryConfig::from_url_with(url, settings)?;
                AdapterConfig::Memory { name, config }
            }
            "local" => AdapterConfig::Local(LocalConfig::from_url_with(url, settings)?),
            "amqp" | "amqps" => AdapterConfig::Rabbit(RabbitConfig::from_url_with(url, settings)?),
            "kafka" => AdapterConfig::Kafka(KafkaConfig::from_url_with(url, settings)?),
            "sqs" => AdapterConfig::Sqs(SqsConfig::from_url_with(url, settings)?),
            _ => {
                return Err(Error::InvalidConfig {
                    field: "url".into(),
                    reason: format!(
                        "{:?} names no adapter; use {URL_FORMS}",
                        ojs_core::redact::url(url)
                    ),
                })
            }
        })
    }

    /// The settings a config-file table may set for the adapter `url`
    /// names (`url` itself excluded).
    pub fn setting_names(url: &str) -> Result<Vec<String>> {
        use ojs_queue::settings::setting_names;
        let names = match Self::from_url(url)? {
            AdapterConfig::Memory { config, .. } => setting_names(&config),
            AdapterConfig::Local(c) => setting_names(&c),
            AdapterConfig::Rabbit(c) => setting_names(&c),
            AdapterConfig::Kafka(c) => setting_names(&c),
            AdapterConfig::Sqs(c) => setting_names(&c),
        };
        Ok(names
            .into_iter()
            .filter(|n| n != "url" && n != "path" && n != "region" && n != "brokers")
            .collect())
    }

    /// Short backend name, as [`QueueAdapter::kind`] says it.
    pub fn kind(&self) -> &'static str {
        match self {
            AdapterConfig::Memory { .. } => "memory",
            AdapterConfig::Local(_) => "local",
            AdapterConfig::Rabbit(_) => "rabbitmq",
            AdapterConfig::Kafka(_) => "kafka",
            AdapterConfig::Sqs(_) => "sqs",
        }
    }

    /// The files the adapter reads when it connects (certificates, keys,
    /// password files), by setting.
    pub fn files_read(&self) -> Vec<(String, std::path::PathBuf)> {
        match self {
            AdapterConfig::Memory { .. } | AdapterConfig::Local(_) | AdapterConfig::Sqs(_) => {
                Vec::new()
            }
            AdapterConfig::Rabbit(c) => c
                .files_read()
                .into_iter()
                .map(|(setting, path)| (setting.to_owned(), path.to_owned()))
                .collect(),
            AdapterConfig::Kafka(c) => c.files_read(),
        }
    }

    /// The largest message the adapter accepts (known before it connects).
    pub fn max_message_bytes(&self) -> usize {
        match self {
            AdapterConfig::Memory { config, .. } => config.max_message_bytes,
            AdapterConfig::Local(c) => c.max_message_bytes,
            AdapterConfig::Rabbit(c) => c.max_message_bytes,
            AdapterConfig::Kafka(c) => c.max_message_bytes,
            AdapterConfig::Sqs(c) => c.max_message_bytes,
        }
    }

    /// [`QueueAdapter::is_reserved`], from the settings alone.
    pub fn is_reserved(&self, queue: &str) -> bool {
        match self {
            AdapterConfig::Memory { .. } | AdapterConfig::Local(_) => false,
            AdapterConfig::Rabbit(c) => c.is_reserved(queue),
            AdapterConfig::Kafka(c) => c.is_reserved(queue),
            AdapterConfig::Sqs(c) => c.is_reserved(queue),
        }
    }

    /// Where a queue's messages live on its broker, and the destinations
    /// beside it that must be the queue's own. Two queues on one broker with
    /// different destinations must not share a name of the list (each
    /// would take the other's retries or dead letters). `None` for brokers
    /// with nothing shared (the embedded and in-process ones; SQS's
    /// dead-letter queues follow each queue's name).
    pub fn destinations(&self, queue: &str) -> Option<Destinations> {
        match self {
            AdapterConfig::Kafka(c) => Some(Destinations {
                broker: format!("kafka://{}", c.brokers),
                own: c.topic_of(queue),
                beside: vec![
                    ("retry topic", c.retry_topic_of(queue)),
                    ("dead-letter topic", c.dead_topic_of(queue)),
                ],
            }),
            AdapterConfig::Rabbit(c) => {
                let (exchange, key) = c.publish_route_of(queue);
                let mut shared = vec![("dead-letter queue", c.dead_letter_queue_of(queue))];
                if !exchange.is_empty() {
                    shared.push(("routing key", format!("{exchange} → {key}")));
                }
                Some(Destinations {
                    broker: ojs_core::redact::url(&c.url).to_string(),
                    own: c.queue_name_of(queue),
                    beside: shared,
                })
            }
            _ => None,
        }
    }

    /// [`QueueAdapter::group_scope`], from the settings alone.
    pub fn group_scope(&self, queue: &str) -> Option<String> {
        match self {
            AdapterConfig::Kafka(c) => c.custom_topics().then(|| c.topic_of(queue)),
            _ => None,
        }
    }

    /// Opens the adapter.
    pub async fn connect(&self) -> Result<Arc<dyn QueueAdapter>> {
        Ok(match self {
            AdapterConfig::Memory { name, config } => {
                Arc::new(MemoryAdapter::named(name).with_config(config.clone()))
            }
            AdapterConfig::Local(c) => Arc::new(LocalAdapter::open(c.clone()).await?),
            AdapterConfig::Rabbit(c) => Arc::new(RabbitAdapter::connect(c.clone()).await?),
            AdapterConfig::Kafka(c) => Arc::new(KafkaAdapter::connect(c.clone()).await?),
            AdapterConfig::Sqs(c) => Arc::new(SqsAdapter::connect(c.clone()).await?),
        })
    }
}

/// Opens the adapter a URL names: `memory://NAME`, `local:///abs/dir`,
/// `local:./dir`, `amqp://user:pass@host:port/vhost`, `amqps://…`,
/// `kafka://host:port[,host:port]`, `sqs://REGION`, each with its settings
/// as query items.
pub async fn connect(url: &str) -> Result<Arc<dyn QueueAdapter>> {
    AdapterConfig::from_url(url)?.connect().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_reads_its_settings_from_the_query() {
        let c = AdapterConfig::from_url(
            "kafka://h:9092?topic_template={queue}&replication=3&linger.ms=5",
        )
        .unwrap();
        let AdapterConfig::Kafka(k) = c else { panic!() };
        assert_eq!(k.replication, 3);
        assert_eq!(k.librdkafka_options["linger.ms"], "5");
        let c =
            AdapterConfig::from_url("amqp://g:g@h/%2f?queue_template={queue}&topology=existing")
                .unwrap();
        assert_eq!(c.kind(), "rabbitmq");
        let c = AdapterConfig::from_url(
            "sqs://us-east-1?endpoint=http://127.0.0.1:4566&topology=existing",
        )
        .unwrap();
        let AdapterConfig::Sqs(s) = c else { panic!() };
        assert_eq!(s.endpoint.as_deref(), Some("http://127.0.0.1:4566"));
        let c = AdapterConfig::from_url("memory://x?max_message_bytes=10").unwrap();
        assert_eq!(
            c,
            AdapterConfig::Memory {
                name: "x".into(),
                config: MemoryConfig {
                    max_message_bytes: 10
                }
            }
        );
        for bad in [
            "amqp://h/%2f?bogus=1",
            "sqs://r?bogus=1",
            "local:./d?bogus=1",
            "memory://x?bogus=1",
            "kafka://h:1?replication=x",
        ] {
            assert!(AdapterConfig::from_url(bad).is_err(), "{bad}");
        }
        let e = AdapterConfig::from_url("kafkx://u:s3cret@h")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }
}
