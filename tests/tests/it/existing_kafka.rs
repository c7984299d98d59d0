//! Kafka that ojs-bridge does not own: topics made by confluent-kafka with
//! their own names and settings, `topology = "existing"` (the shared
//! acceptance suite runs in that mode, with no retry topic, so retries go
//! back to the queue topic), records compressed by an independent producer
//! in every codec, and mutual TLS.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_kafka::{KafkaAdapter, Topology};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, missing, unique_queue, Broker};
use ojs_bridge_tests::consume::drain_payloads;
use ojs_bridge_tests::independent;
use ojs_bridge_tests::kafka::test_config;
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};

struct ExistingKafka {
    url: String,
    group: String,
}

impl ExistingKafka {
    fn config(&self) -> ojs_adapter_kafka::KafkaConfig {
        let mut c = test_config(&self.url);
        c.topology = Topology::Existing;
        c.topic_template = "{queue}".into();
        c.dead_topic_template = "{queue}.dlq".into();
        c.depth_group = self.group.clone();
        c
    }
}

#[async_trait]
impl AdapterFactory for ExistingKafka {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(KafkaAdapter::connect(self.config()).await?))
    }

    fn features(&self) -> Features {
        Features {
            name: "kafka (topology = existing)",
            persistent: true,
            ordered_by_key: true,
            redelivers_on_consumer_drop: true,
            visibility_timeout: false,
            max_deliveries: true,
            counts_redeliveries: false,
            counts_receives: false,
            exact_depth: std::env::var("OJS_BRIDGE_TEST_KAFKA_FLAVOR").as_deref() != Ok("tansu"),
            creates_resources: false,
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

    /// Topics as another team made them: the queue topic (2 partitions) and
    /// a dead-letter topic of their naming; no retry topic.
    async fn queue(&self, prefix: &str) -> anyhow::Result<String> {
        let queue = unique_queue(prefix);
        independent::run(&["kafka-topic", &queue, "--partitions", "2"])?;
        independent::run(&["kafka-topic", &format!("{queue}.dlq")])?;
        Ok(queue)
    }
}

async fn existing_kafka() -> Option<ExistingKafka> {
    let url = find(Broker::Kafka).await?.url;
    independent::available()?;
    Some(ExistingKafka {
        url,
        group: unique_queue("acc-existing-group"),
    })
}

acceptance_tests!(existing_kafka);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_topology_creates_nothing_and_names_the_missing_topic() {
    let Some(f) = existing_kafka().await else {
        return;
    };
    let queue = unique_queue("existing-missing");
    let started = std::time::Instant::now();
    let adapter = KafkaAdapter::connect(f.config()).await.unwrap();
    let Err(err) = adapter.consumer(&queue, f.consumer_options()).await else {
        panic!("a missing topic must be an error");
    };
    assert_eq!(
        err.broker_kind(),
        Some(ojs_queue::BrokerErrorKind::NotFound),
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
    assert!(started.elapsed() < Duration::from_secs(30));
    // The broker's own listing: nothing was created, not even the retry or
    // dead topic.
    assert_eq!(
        independent::kafka_topics(&queue).unwrap(),
        Vec::<String>::new()
    );
    adapter.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_compressed_by_another_producer_are_read_in_every_codec() {
    let Some(f) = existing_kafka().await else {
        return;
    };
    let queue = unique_queue("codecs");
    independent::run(&["kafka-topic", &queue]).unwrap();
    let codecs = ["none", "gzip", "snappy", "lz4", "zstd"];
    for codec in codecs {
        independent::run(&[
            "kafka-produce",
            &queue,
            "--compression",
            codec,
            "--count",
            "20",
            "--value",
            &format!("{codec}-{{i}}"),
        ])
        .unwrap();
    }
    let adapter = KafkaAdapter::connect(f.config()).await.unwrap();
    let got = drain_payloads(
        &adapter,
        &queue,
        ConsumerOptions {
            group: unique_queue("codec-group"),
            ..ConsumerOptions::default()
        },
        100,
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    for codec in codecs {
        let n = got
            .iter()
            .filter(|v| v.starts_with(&format!("{codec}-")))
            .count();
        println!("{codec}: sent 20 received {n} lost {}", 20 - n.min(20));
        assert_eq!(n, 20, "{codec}");
    }
    // Our own producer can compress too (a librdkafka option).
    let mut config = f.config();
    config
        .librdkafka_options
        .insert("compression.type".into(), "zstd".into());
    let zstd = KafkaAdapter::connect(config).await.unwrap();
    zstd.publish(
        &queue,
        vec![OutgoingMessage::new("ours-zstd", "text/plain")],
    )
    .await
    .unwrap();
    let seen = independent::lines(&[
        "kafka-consume",
        &queue,
        "--count",
        "101",
        "--group",
        &unique_queue("indep"),
    ])
    .unwrap();
    assert!(seen.iter().any(|m| m["value"] == "ours-zstd"), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls() {
    let Some(_) = existing_kafka().await else {
        return;
    };
    let (Ok(url), Ok(tls)) = (
        std::env::var("OJS_BRIDGE_TEST_KAFKA_TLS_URL"),
        std::env::var("OJS_BRIDGE_TEST_TLS_DIR"),
    ) else {
        missing::<()>(
            "OJS_BRIDGE_TEST_KAFKA_TLS_URL",
            "no TLS listener (scripts/brokers.sh up tls)",
        );
        return;
    };
    let queue = unique_queue("mtls");
    let with_cert = format!(
        "{url}?security.protocol=ssl&ssl.ca.location={tls}/ca.pem&ssl.certificate.location={tls}/client.pem&ssl.key.location={tls}/client.key"
    );
    let mut config = test_config(&with_cert);
    config.partitions = 1;
    let adapter = KafkaAdapter::connect(config).await.unwrap();
    adapter
        .publish(
            &queue,
            (0..10)
                .map(|i| OutgoingMessage::new(format!("tls-{i}"), "text/plain"))
                .collect(),
        )
        .await
        .unwrap();
    let got = drain_payloads(
        &adapter,
        &queue,
        ConsumerOptions {
            group: unique_queue("tls-group"),
            ..ConsumerOptions::default()
        },
        10,
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    println!(
        "mutual TLS: sent 10 received {} lost {}",
        got.len(),
        10 - got.len().min(10)
    );
    assert_eq!(got.len(), 10);
    adapter.close().await.unwrap();

    // Without the client certificate the proxy refuses the handshake: the
    // publish fails (bounded by the publish timeout) instead of succeeding.
    let mut config = test_config(&format!(
        "{url}?security.protocol=ssl&ssl.ca.location={tls}/ca.pem&publish_timeout_ms=3000&topology=existing"
    ));
    config.topic_template = "ojs.queue.{queue}".into();
    let adapter = KafkaAdapter::connect(config).await.unwrap();
    assert!(adapter
        .publish(&queue, vec![OutgoingMessage::new("no-cert", "text/plain")])
        .await
        .is_err());
}
