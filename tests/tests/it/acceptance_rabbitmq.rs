//! The acceptance suite on RabbitMQ (real broker; see scripts/brokers.sh).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, Broker};
use ojs_queue::QueueAdapter;

pub(crate) struct Rabbit {
    pub(crate) url: String,
}

#[async_trait]
impl AdapterFactory for Rabbit {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(
            RabbitAdapter::connect(RabbitConfig::new(&self.url)).await?,
        ))
    }

    fn broker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }

    fn features(&self) -> Features {
        Features {
            name: "rabbitmq",
            persistent: true,
            // One queue, one consumer: FIFO.
            ordered_by_key: true,
            // Closing a channel hands its unacked deliveries back.
            redelivers_on_consumer_drop: true,
            visibility_timeout: false,
            max_deliveries: true,
            counts_redeliveries: true,
            counts_receives: false,
            exact_depth: true,
            creates_resources: true,
            consumer_startup: Duration::from_secs(1),
            volume: 1.0,
            patience: Duration::from_secs(30),
        }
    }
}

async fn rabbit() -> Option<Rabbit> {
    find(Broker::RabbitMq).await.map(|e| Rabbit { url: e.url })
}

acceptance_tests!(rabbit);
