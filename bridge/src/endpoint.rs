//! Adapters chosen by URL (DESIGN §7), so config files and the CLI read the
//! same way.

use std::sync::Arc;

use ojs_adapter_kafka::{KafkaAdapter, KafkaConfig};
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_memory::MemoryAdapter;
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_core::{Error, QueueAdapter, Result};

/// Opens the adapter a URL names: `memory://NAME`, `local:///abs/dir`,
/// `local:./dir`, `amqp://user:pass@host:port/vhost`, `amqps://…`,
/// `kafka://host:port[,host:port][?librdkafka.option=value…]`,
/// `sqs://REGION[?endpoint=URL&prefix=P&fifo=true]`.
pub async fn connect(url: &str) -> Result<Arc<dyn QueueAdapter>> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "memory" => {
            let name = url.strip_prefix("memory://").unwrap_or("default");
            Ok(Arc::new(MemoryAdapter::named(if name.is_empty() { "default" } else { name })))
        }
        "local" => Ok(Arc::new(LocalAdapter::open(LocalConfig::from_url(url)?).await?)),
        "amqp" | "amqps" => Ok(Arc::new(RabbitAdapter::connect(RabbitConfig::from_url(url)?).await?)),
        "kafka" => Ok(Arc::new(KafkaAdapter::connect(KafkaConfig::from_url(url)?).await?)),
        "sqs" => Ok(Arc::new(SqsAdapter::connect(SqsConfig::from_url(url)?).await?)),
        _ => Err(Error::InvalidConfig {
            field: "url".into(),
            reason: format!(
                "{url:?} names no adapter; use memory://NAME, local:///abs/dir, local:./dir, kafka://host:port, amqp://user:pass@host:port/vhost or sqs://REGION"
            ),
        }),
    }
}

/// Checks a URL the way [`connect`] reads it, without connecting.
pub fn validate_url(url: &str) -> Result<()> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "memory" => Ok(()),
        "local" => LocalConfig::from_url(url).map(|_| ()),
        "amqp" | "amqps" => RabbitConfig::from_url(url).map(|_| ()),
        "kafka" => KafkaConfig::from_url(url).map(|_| ()),
        "sqs" => SqsConfig::from_url(url).map(|_| ()),
        _ => Err(Error::InvalidConfig {
            field: "url".into(),
            reason: format!(
                "{url:?} names no adapter; use memory://NAME, local:///abs/dir, local:./dir, kafka://host:port, amqp://user:pass@host:port/vhost or sqs://REGION"
            ),
        }),
    }
}
