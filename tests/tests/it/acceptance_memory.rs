//! The acceptance suite on the in-memory adapter.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_memory::{MemoryAdapter, MemoryConfig};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_queue::QueueAdapter;

struct Memory {
    broker: MemoryAdapter,
}

#[async_trait]
impl AdapterFactory for Memory {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(self.broker.connect()))
    }

    fn features(&self) -> Features {
        Features {
            name: "memory",
            // Every connection of one test shares the broker.
            persistent: true,
            ordered_by_key: true,
            redelivers_on_consumer_drop: true,
            visibility_timeout: true,
            max_deliveries: true,
            counts_redeliveries: true,
            counts_receives: false,
            exact_depth: true,
            creates_resources: true,
            consumer_startup: Duration::from_secs(1),
            volume: 1.0,
            patience: Duration::from_secs(20),
        }
    }
}

async fn memory() -> Option<Memory> {
    Some(Memory {
        broker: MemoryAdapter::new(MemoryConfig::default()),
    })
}

acceptance_tests!(memory);
