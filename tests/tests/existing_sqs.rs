//! SQS that ojs-bridge does not own: queues made by boto3 with their own
//! redrive policy and dead-letter queue, `topology = "existing"` (the shared
//! acceptance suite runs in that mode) and `declare` over them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_sqs::{SqsAdapter, SqsConfig, Topology};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_bridge_tests::consume::next_delivery;
use ojs_bridge_tests::independent;
use ojs_core::{ConsumerOptions, DeadLetterReason, Nack, OutgoingMessage, QueueAdapter};

struct ExistingSqs {
    url: String,
}

impl ExistingSqs {
    fn config(&self) -> SqsConfig {
        let mut c = SqsConfig::from_url(&self.url).unwrap();
        c.topology = Topology::Existing;
        c
    }
}

#[async_trait]
impl AdapterFactory for ExistingSqs {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(SqsAdapter::connect(self.config()).await?))
    }

    fn features(&self) -> Features {
        Features {
            name: "sqs (topology = existing)",
            persistent: true,
            ordered_by_key: false,
            redelivers_on_consumer_drop: false,
            visibility_timeout: true,
            max_deliveries: true,
            counts_redeliveries: true,
            exact_depth: true,
            creates_resources: false,
            consumer_startup: Duration::from_secs(2),
            volume: 0.2,
            patience: Duration::from_secs(60),
        }
    }

    /// A queue Terraform or boto3 made: its own redrive policy to a
    /// dead-letter queue named their way (not `{name}_dlq`).
    async fn queue(&self, prefix: &str) -> anyhow::Result<String> {
        let queue = unique_queue(prefix);
        independent::run(&[
            "sqs-queue",
            &queue,
            "--dlq",
            &format!("theirs-{queue}"),
            "--max-receive",
            "50",
        ])?;
        Ok(queue)
    }
}

async fn existing_sqs() -> Option<ExistingSqs> {
    let url = find(Broker::Sqs).await?.url;
    independent::available()?;
    Some(ExistingSqs { url })
}

acceptance_tests!(existing_sqs);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_topology_creates_nothing_and_names_the_missing_queue() {
    let Some(f) = existing_sqs().await else {
        return;
    };
    let queue = unique_queue("existing-missing");
    let adapter = SqsAdapter::connect(f.config()).await.unwrap();
    let started = std::time::Instant::now();
    let Err(err) = adapter.consumer(&queue, ConsumerOptions::default()).await else {
        panic!("a missing queue must be an error");
    };
    assert_eq!(
        err.broker_kind(),
        Some(ojs_core::BrokerErrorKind::NotFound),
        "{err}"
    );
    let err = err.to_string();
    assert!(
        err.contains(&queue) && err.contains("does not exist"),
        "{err}"
    );
    let err = adapter
        .publish(&queue, vec![OutgoingMessage::new("x", "text/plain")])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&queue), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        independent::sqs_queues(&queue).unwrap(),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_keeps_the_queues_own_redrive_policy() {
    let Some(f) = existing_sqs().await else {
        return;
    };
    // Before: CreateQueue with our own RedrivePolicy failed with
    // QueueAlreadyExists on a queue made elsewhere.
    let queue = unique_queue("declared-elsewhere");
    let theirs = format!("theirs-{queue}");
    independent::run(&["sqs-queue", &queue, "--dlq", &theirs]).unwrap();
    let before = independent::run(&["sqs-count", &queue]).unwrap();
    let adapter = SqsAdapter::connect(SqsConfig::from_url(&f.url).unwrap())
        .await
        .unwrap();
    adapter
        .publish(&queue, vec![OutgoingMessage::new("poison", "text/plain")])
        .await
        .unwrap();
    let mut consumer = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let d = next_delivery(&mut *consumer, Duration::from_secs(20))
        .await
        .unwrap();
    d.nack(Nack::DeadLetter(DeadLetterReason::new("poison", "test")))
        .await
        .unwrap();
    // The dead letter went to their DLQ, with our reason; no `_dlq` queue of
    // ours appeared and their policy is unchanged.
    let dead = independent::lines(&["sqs-receive", &theirs, "--count", "1"]).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["attributes"]["ojs-error-type"], "poison");
    assert_eq!(
        independent::sqs_queues(&queue).unwrap(),
        vec![queue.clone()]
    );
    let after = independent::run(&["sqs-count", &queue]).unwrap();
    let policy =
        |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["RedrivePolicy"].clone();
    assert_eq!(policy(&before), policy(&after));
}
