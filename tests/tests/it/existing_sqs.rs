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
use ojs_bridge_tests::consume::first_delivery;
use ojs_bridge_tests::independent;
use ojs_queue::{ConsumerOptions, DeadLetterReason, Nack, OutgoingMessage, QueueAdapter};

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
            counts_receives: true,
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
    let (_consumer, d) = first_delivery(&adapter, &queue, Duration::from_secs(20))
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

/// SQS refuses a whole `SendMessageBatch` when one entry breaks a rule: a
/// body over the queue's own `MaximumMessageSize` (set by whoever made the
/// queue), an attribute name it does not allow. Before, that failed every
/// message of the batch as retryable, and the source retried them for
/// ever. Now only the message at fault fails, as not retryable, and
/// header values SQS refuses as String values still arrive, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sqs_refuses_for_one_message_fails_that_message_alone() {
    let Some(f) = existing_sqs().await else {
        return;
    };
    let queue = unique_queue("existing-small");
    independent::run(&["sqs-queue", &queue, "--attr", "MaximumMessageSize=1024"]).unwrap();
    let adapter = SqsAdapter::connect(f.config()).await.unwrap();

    let first = OutgoingMessage::new("first", "text/plain");
    // 1,500 bytes are 2,000 in base64: over this queue's 1,024.
    let too_big_for_the_queue = OutgoingMessage::new(vec![b'x'; 1500], "text/plain");
    let mut odd_values = OutgoingMessage::new("odd values", "text/plain");
    odd_values.headers.insert("control", &b"a\x01b"[..]);
    odd_values.headers.insert("empty", "");
    odd_values.key = Some(bytes::Bytes::new());
    let mut bad_name = OutgoingMessage::new("bad name", "text/plain");
    bad_name.headers.insert("bad name!", "v");
    let err = adapter
        .publish(
            &queue,
            vec![first, too_big_for_the_queue, odd_values.clone(), bad_name],
        )
        .await
        .unwrap_err();
    let ojs_queue::Error::Publish(failure) = err else {
        panic!("expected per-message failures, got {err}")
    };
    let failed: Vec<(usize, String, bool)> = failure
        .failed
        .iter()
        .map(|f| (f.index, f.error.to_string(), f.error.is_retryable()))
        .collect();
    assert_eq!(
        failed.iter().map(|f| f.0).collect::<Vec<_>>(),
        vec![1, 3],
        "{failed:?}"
    );
    assert!(
        failed.iter().all(|f| !f.2),
        "neither is retryable: {failed:?}"
    );
    assert!(failed[0].1.contains("InvalidParameterValue"), "{failed:?}");
    assert!(failed[1].1.contains("header name"), "{failed:?}");
    assert!(!failed[1].1.contains("bad name!"), "{failed:?}");

    // The other two arrived; another reader sees the control character's
    // bytes as a Binary attribute and the empty values with their own type.
    let got = independent::lines(&["sqs-receive", &queue, "--count", "2"]).unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    let body = |m: &serde_json::Value| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(m["body"].as_str().unwrap())
            .unwrap()
    };
    let mut bodies: Vec<Vec<u8>> = got.iter().map(body).collect();
    bodies.sort();
    assert_eq!(bodies, vec![b"first".to_vec(), b"odd values".to_vec()]);
    let odd = got.iter().find(|m| body(m) == b"odd values").unwrap();
    assert_eq!(odd["types"]["control"], "Binary", "{odd}");
    assert_eq!(odd["binary_hex"]["control"], "610162", "{odd}");
    assert_eq!(odd["types"]["empty"], "String.ojs-empty", "{odd}");
    assert_eq!(odd["types"]["ojs-key"], "String.ojs-empty", "{odd}");

    // Through our consumer the values come back as they were sent.
    adapter.publish(&queue, vec![odd_values]).await.unwrap();
    let (consumer, d) = first_delivery(&adapter, &queue, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(&d.payload[..], b"odd values");
    assert_eq!(d.headers.get("control").unwrap().as_bytes(), b"a\x01b");
    assert_eq!(d.headers.get("empty").unwrap().as_bytes(), b"");
    assert_eq!(d.key.as_deref(), Some(&b""[..]));
    d.ack().await.unwrap();
    consumer.close().await.unwrap();
}

/// Other SQS clients send attributes of their own type: `Number`, custom
/// labels such as `String.json`. The neutral headers hold their values; a
/// dead-letter copy used to send every one of them as plain `String`. Now
/// the copy in their dead-letter queue has each with the type it came with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_types_from_other_clients_survive_a_dead_letter_copy() {
    let Some(f) = existing_sqs().await else {
        return;
    };
    let queue = f.queue("typed-attrs").await.unwrap();
    let theirs = format!("theirs-{queue}");
    independent::run(&[
        "sqs-send",
        &queue,
        "--body",
        "dHlwZWQ=",
        "--attr",
        "plain=text",
        "--typed-attr",
        "retries=Number:42",
        "--typed-attr",
        r#"context=String.json:{"tenant":"acme"}"#,
    ])
    .unwrap();
    let adapter = SqsAdapter::connect(f.config()).await.unwrap();
    let (consumer, d) = first_delivery(&adapter, &queue, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(&d.payload[..], b"typed");
    assert_eq!(d.headers.get_str("retries"), Some("42"));
    assert_eq!(d.headers.get_str("context"), Some(r#"{"tenant":"acme"}"#));
    d.nack(Nack::DeadLetter(DeadLetterReason::new("poison", "test")))
        .await
        .unwrap();
    consumer.close().await.unwrap();
    let dead = independent::lines(&["sqs-receive", &theirs, "--count", "1"]).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let m = &dead[0];
    assert_eq!(m["types"]["retries"], "Number", "{m}");
    assert_eq!(m["attributes"]["retries"], "42", "{m}");
    assert_eq!(m["types"]["context"], "String.json", "{m}");
    assert_eq!(m["attributes"]["context"], r#"{"tenant":"acme"}"#, "{m}");
    assert_eq!(m["types"]["plain"], "String", "{m}");
    assert_eq!(m["types"]["ojs-error-type"], "String", "{m}");
}
