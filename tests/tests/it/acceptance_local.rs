//! The acceptance suite on the embedded durable broker (`local://`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::tempdir::TempDir;
use ojs_queue::QueueAdapter;

struct Local {
    dir: TempDir,
}

#[async_trait]
impl AdapterFactory for Local {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        // Every connect is a new SQLite connection to the same directory, as
        // a second process would open it.
        Ok(Arc::new(
            LocalAdapter::open(LocalConfig::new(self.dir.path())).await?,
        ))
    }

    fn features(&self) -> Features {
        Features {
            name: "local",
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
            patience: Duration::from_secs(30),
        }
    }
}

async fn local() -> Option<Local> {
    Some(Local {
        dir: TempDir::new("acceptance-local"),
    })
}

acceptance_tests!(local);
