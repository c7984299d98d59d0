//! SQS specifics beyond the shared suite: redrive after maxReceiveCount,
//! the visibility heartbeat, and bodies written by other SQS clients (grpcq's
//! own adapter, raw legacy bodies, garbage) going through the worker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::MessageAttributeValue;
use base64::Engine as _;
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter, Source};
use tokio::time::Instant;

async fn setup(query: &str) -> Option<(SqsAdapter, SqsConfig, aws_sdk_sqs::Client)> {
    let url = find(Broker::Sqs).await?.url;
    let config = SqsConfig::from_url(&format!("{url}{query}")).unwrap();
    let adapter = SqsAdapter::connect(config.clone()).await.unwrap();
    let client = ojs_adapter_sqs::sdk_client(&config).await;
    Some((adapter, config, client))
}

#[tokio::test]
async fn the_redrive_policy_moves_a_message_after_max_receive_count() {
    let Some((adapter, _, _)) = setup("&max_receive_count=2").await else {
        return;
    };
    let queue = unique_queue("sqs-redrive");
    adapter
        .publish(&queue, vec![OutgoingMessage::new("poison", "text/plain")])
        .await
        .unwrap();
    let options = ConsumerOptions {
        visibility_timeout: Duration::from_secs(1),
        ..ConsumerOptions::default()
    };
    let mut c = adapter.consumer(&queue, options.clone()).await.unwrap();
    let mut receives = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Receive without settling until SQS stops handing it out.
    while Instant::now() < deadline {
        let got = c.receive(1, Duration::from_secs(2)).await.unwrap();
        if got.is_empty() && receives >= 2 {
            break;
        }
        receives += got.len();
    }
    assert_eq!(receives, 2, "delivered exactly maxReceiveCount times");
    let mut dlq = adapter
        .consumer(
            &queue,
            ConsumerOptions {
                source: Source::DeadLetters,
                ..options
            },
        )
        .await
        .unwrap();
    let dead = dlq.receive(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(dead.len(), 1, "moved to {queue}_dlq by SQS itself");
    assert_eq!(&dead[0].payload[..], b"poison");
    dead[0].ack().await.unwrap();
}

#[tokio::test]
async fn the_heartbeat_keeps_a_long_job_from_being_delivered_twice() {
    let Some((adapter, _, _)) = setup("").await else {
        return;
    };
    let queue = unique_queue("sqs-heartbeat");
    adapter
        .publish(&queue, vec![OutgoingMessage::new("long", "text/plain")])
        .await
        .unwrap();
    let options = ConsumerOptions {
        visibility_timeout: Duration::from_secs(2),
        ..ConsumerOptions::default()
    };
    let mut holder = adapter.consumer(&queue, options.clone()).await.unwrap();
    let mut other = adapter.consumer(&queue, options).await.unwrap();
    let d = holder
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    // Hold it 3x the visibility timeout, extending every second.
    let until = Instant::now() + Duration::from_secs(6);
    let mut stolen = 0;
    while Instant::now() < until {
        d.extend(Duration::from_secs(2)).await.unwrap();
        stolen += other
            .receive(1, Duration::from_secs(1))
            .await
            .unwrap()
            .len();
    }
    assert_eq!(
        stolen, 0,
        "never delivered to another consumer while extended"
    );
    d.ack().await.unwrap();
    assert_eq!(adapter.depth(&queue).await.unwrap(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_from_other_sqs_clients_are_handled_or_dead_lettered() {
    let Some((adapter, config, client)) = setup("").await else {
        return;
    };
    let queue = unique_queue("sqs-foreign");
    // Create the queues through the adapter, then write as other clients do.
    adapter.depth(&queue).await.unwrap();
    let url = client
        .get_queue_url()
        .queue_name(config.queue_name(&queue))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned();
    let call = grpcq::Message {
        originator: "go-service".into(),
        topic: "pay.Payments".into(),
        action: "Charge".into(),
        payload: vec![8, 7],
        message_id: "m-1".into(),
        timestamp_ms: 1_704_067_200_000,
        metadata: Default::default(),
    };
    let attr = |v: &str| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
            .unwrap()
    };
    // grpcq's own SQS adapter: base64 body, String attributes topic/action/originator.
    client
        .send_message()
        .queue_url(&url)
        .message_body(base64::engine::general_purpose::STANDARD.encode(grpcq::encode(&call)))
        .message_attributes("topic", attr("pay.Payments"))
        .message_attributes("action", attr("Charge"))
        .message_attributes("originator", attr("go-service"))
        .send()
        .await
        .unwrap();
    // A raw body that is not base64, claiming to be an OJS envelope.
    client
        .send_message()
        .queue_url(&url)
        .message_body("this is not base64 !!!")
        .message_attributes("content-type", attr(Encoding::OjsProto.media_type()))
        .send()
        .await
        .unwrap();
    // Valid base64 of bytes that are no envelope.
    client
        .send_message()
        .queue_url(&url)
        .message_body(base64::engine::general_purpose::STANDARD.encode(b"\xff\xfe\xfd"))
        .message_attributes("content-type", attr(Encoding::OjsProto.media_type()))
        .send()
        .await
        .unwrap();

    let handled = Arc::new(Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let h = handled.clone();
    registry
        .on_call("pay.Payments", "Charge", move |ctx, payload| {
            h.lock()
                .unwrap()
                .push((ctx.originator.clone(), payload.to_vec()));
            async { Ok(()) }
        })
        .unwrap();
    let mut wc = WorkerConfig::new(&queue);
    wc.default_encoding = Some(Encoding::GrpcqProto);
    let worker = Worker::new(Arc::new(adapter.clone()), registry, wc);
    let stats = worker.stats();
    tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(60))));
    let deadline = Instant::now() + Duration::from_secs(30);
    while (stats.succeeded.load(Ordering::SeqCst) < 1
        || stats.dead_lettered.load(Ordering::SeqCst) < 2)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        handled.lock().unwrap().clone(),
        vec![("go-service".to_string(), vec![8, 7])]
    );
    let mut dlq = adapter
        .consumer(
            &queue,
            ConsumerOptions {
                source: Source::DeadLetters,
                ..ConsumerOptions::default()
            },
        )
        .await
        .unwrap();
    let mut reasons = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while reasons.len() < 2 && Instant::now() < deadline {
        for d in dlq.receive(10, Duration::from_secs(1)).await.unwrap() {
            reasons.push(d.dead_letter_reason().unwrap());
            d.ack().await.unwrap();
        }
    }
    assert_eq!(
        reasons.len(),
        2,
        "both bad bodies dead-lettered: {reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .all(|r| r.error_type == "undecodable" && !r.message.is_empty()),
        "{reasons:?}"
    );
}

/// Ten messages of 200 KB are 2.7 MB in base64, over the 1 MiB SQS takes
/// in one SendMessageBatch. Before, the batch went out as one request that
/// SQS refused as a whole (BatchRequestTooLong), every time: the publish
/// failed as retryable and a source behind it retried it for ever. Now
/// requests are cut by size as well as by count.
#[tokio::test]
async fn a_batch_over_the_request_size_sqs_takes_goes_out_in_several_requests() {
    let Some((adapter, _, _)) = setup("").await else {
        return;
    };
    let queue = unique_queue("sqs-big-batch");
    let messages: Vec<OutgoingMessage> = (0..10u8)
        .map(|i| OutgoingMessage::new(vec![b'a' + i; 200_000], "application/octet-stream"))
        .collect();
    adapter.publish(&queue, messages).await.unwrap();
    let mut c = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let mut firsts = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while firsts.len() < 10 && Instant::now() < deadline {
        for d in c.receive(10, Duration::from_secs(2)).await.unwrap() {
            assert_eq!(d.payload.len(), 200_000);
            assert!(d.payload.iter().all(|b| *b == d.payload[0]));
            firsts.push(d.payload[0]);
            d.ack().await.unwrap();
        }
    }
    firsts.sort_unstable();
    assert_eq!(firsts, (0..10u8).map(|i| b'a' + i).collect::<Vec<_>>());
    c.close().await.unwrap();
}
