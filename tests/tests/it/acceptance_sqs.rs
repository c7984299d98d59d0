//! The acceptance suite on SQS (an SQS-compatible server; moto in CI).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, Broker};
use ojs_queue::QueueAdapter;

pub(crate) struct Sqs {
    pub(crate) url: String,
}

#[async_trait]
impl AdapterFactory for Sqs {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(
            SqsAdapter::connect(SqsConfig::from_url(&self.url)?).await?,
        ))
    }

    fn broker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }

    fn features(&self) -> Features {
        Features {
            name: "sqs",
            persistent: true,
            // Standard queues promise no order (FIFO queues do, per group).
            ordered_by_key: false,
            redelivers_on_consumer_drop: false,
            visibility_timeout: true,
            max_deliveries: true,
            counts_redeliveries: true,
            counts_receives: true,
            exact_depth: true,
            creates_resources: true,
            consumer_startup: Duration::from_secs(2),
            // moto answers a few hundred requests a second.
            volume: 0.2,
            patience: Duration::from_secs(60),
        }
    }
}

async fn sqs() -> Option<Sqs> {
    find(Broker::Sqs).await.map(|e| Sqs { url: e.url })
}

acceptance_tests!(sqs);
