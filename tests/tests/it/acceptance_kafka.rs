//! The acceptance suite on Kafka (a real Kafka-compatible broker).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_kafka::KafkaAdapter;
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_bridge_tests::kafka::test_config;
use ojs_queue::{ConsumerOptions, QueueAdapter};

pub(crate) struct Kafka {
    pub(crate) url: String,
    /// One consumer group per test, so restarts resume its offsets.
    pub(crate) group: String,
    /// Whether the broker reports exact high watermarks (tansu reports a
    /// batch's base offset + 1: depth is approximate there).
    pub(crate) exact_depth: bool,
}

#[async_trait]
impl AdapterFactory for Kafka {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        let mut config = test_config(&self.url);
        // Kafka's depth is the lag of a consumer group: this test's.
        config.depth_group = self.group.clone();
        Ok(Arc::new(KafkaAdapter::connect(config).await?))
    }

    fn broker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }

    fn features(&self) -> Features {
        Features {
            name: "kafka",
            persistent: true,
            ordered_by_key: true,
            // Leaving the group hands uncommitted records to the next member.
            redelivers_on_consumer_drop: true,
            visibility_timeout: false,
            max_deliveries: true,
            counts_redeliveries: false,
            counts_receives: false,
            exact_depth: self.exact_depth,
            creates_resources: true,
            consumer_startup: Duration::from_secs(15),
            volume: 1.0,
            patience: Duration::from_secs(60),
        }
    }

    fn consumer_options(&self) -> ConsumerOptions {
        ConsumerOptions {
            group: self.group.clone(),
            ..ConsumerOptions::default()
        }
    }
}

async fn kafka() -> Option<Kafka> {
    find(Broker::Kafka).await.map(|e| Kafka {
        url: e.url,
        group: unique_queue("acc-group"),
        exact_depth: std::env::var("OJS_BRIDGE_TEST_KAFKA_FLAVOR").as_deref() != Ok("tansu"),
    })
}

acceptance_tests!(kafka);
