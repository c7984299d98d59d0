//! RabbitMQ specifics beyond the shared suite: the wire binding as other AMQP
//! clients see it, unroutable publishes, a broker restart mid-stream, a
//! subscription cut short between `basic.consume` and its answer, and short
//! strings that are not UTF-8 from another client.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use ojs_adapter_rabbitmq::{
    dead_letter_queue_name, queue_name, retry_queue_name, RabbitAdapter, RabbitConfig,
};
use ojs_bridge_tests::brokers::{bounce, bounce_command, find, unique_queue, Broker};
use ojs_bridge_tests::independent;
use ojs_bridge_tests::tally::Tally;
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, DeadLetterReason, Error, Nack, OutgoingMessage, QueueAdapter};
use serde_json::json;
use tokio::time::Instant;

async fn setup() -> Option<(String, RabbitAdapter, Connection)> {
    let url = find(Broker::RabbitMq).await?.url;
    let adapter = RabbitAdapter::connect(RabbitConfig::new(&url))
        .await
        .unwrap();
    let raw = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    Some((url, adapter, raw))
}

fn header_text(table: &FieldTable, name: &str) -> Option<String> {
    match table.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

#[tokio::test]
async fn the_wire_binding_is_what_other_amqp_clients_see() {
    let Some((_url, adapter, raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-wire");
    let job = JobEnvelope::new("email.send", vec![json!("a@b.c")])
        .with_queue(&queue)
        .with_priority(3)
        .with_meta(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
    let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap();
    adapter.publish(&queue, vec![msg.clone()]).await.unwrap();

    let ch = raw.create_channel().await.unwrap();
    let got = ch
        .basic_get(
            queue_name(&queue).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("message in ojs.queue.{queue}");
    let d = &got.delivery;
    assert_eq!(d.exchange.as_str(), "ojs.exchange.direct");
    assert_eq!(d.routing_key.as_str(), queue);
    assert_eq!(d.data, msg.payload.to_vec(), "body is the binary envelope");
    let p = &d.properties;
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/openjobspec+proto"
    );
    assert_eq!(p.message_id().as_ref().unwrap().as_str(), job.id);
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "email.send");
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    // OJS 3 on a queue of ranks 0…10: one rank above the middle (OJS 0).
    assert_eq!(*p.priority(), Some(6));
    assert!(p.timestamp().is_some());
    let h = p.headers().as_ref().unwrap();
    assert_eq!(header_text(h, "x-ojs-specversion").as_deref(), Some("1.0"));
    assert_eq!(
        header_text(h, "x-ojs-queue").as_deref(),
        Some(queue.as_str())
    );
    assert_eq!(
        header_text(h, "traceparent").as_deref(),
        job.meta_str("traceparent")
    );
    assert_eq!(JobEnvelope::from_proto_bytes(&d.data).unwrap(), job);

    // Dead letters land in ojs.queue.dlx.{queue} with the reason in headers.
    adapter.publish(&queue, vec![msg.clone()]).await.unwrap();
    let mut c = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let d = c
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    d.nack(Nack::DeadLetter(DeadLetterReason::new(
        "ValidationError",
        "bad address",
    )))
    .await
    .unwrap();
    let dead = ch
        .basic_get(
            dead_letter_queue_name(&queue).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("message in ojs.queue.dlx.{queue}");
    let h = dead.delivery.properties.headers().as_ref().unwrap();
    assert_eq!(
        header_text(h, "x-ojs-error-type").as_deref(),
        Some("ValidationError")
    );
    assert_eq!(
        header_text(h, "x-ojs-error-message").as_deref(),
        Some("bad address")
    );
    assert_eq!(dead.delivery.exchange.as_str(), "ojs.exchange.dlx");

    // A delayed retry goes through the per-delay TTL queue.
    adapter.publish(&queue, vec![msg]).await.unwrap();
    let d = c
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    d.nack(Nack::retry_after(Duration::from_millis(1500)))
        .await
        .unwrap();
    let retry_q = ch
        .queue_declare(
            retry_queue_name(&queue, 1500).as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("ojs.queue.retry.{queue}.1500 exists");
    assert_eq!(retry_q.message_count(), 1, "waiting out its delay there");
    let back = c
        .receive(1, Duration::from_secs(10))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(back.attempt, 2);
    back.ack().await.unwrap();
}

#[tokio::test]
async fn an_unroutable_publish_is_an_error_for_that_message() {
    let Some((_url, adapter, raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-unroutable");
    let (a, b) = (
        OutgoingMessage::new("a", "text/plain"),
        OutgoingMessage::new("b", "text/plain"),
    );
    adapter.publish(&queue, vec![a.clone()]).await.unwrap();
    // Someone deletes the queue behind the adapter's back: with `mandatory`
    // the broker returns the message instead of dropping it silently.
    let ch = raw.create_channel().await.unwrap();
    ch.queue_delete(
        queue_name(&queue).as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    let err = adapter.publish(&queue, vec![b.clone()]).await.unwrap_err();
    let Error::Publish(failure) = err else {
        panic!("expected a per-message failure, got {err}")
    };
    assert_eq!(failure.failed.len(), 1);
    assert_eq!(failure.failed[0].message, b, "handed back");
    let text = failure.failed[0].error.to_string();
    assert!(
        text.contains("unroutable") && text.contains("NO_ROUTE"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_stream_loses_nothing() {
    let Some((url, _adapter, _raw)) = setup().await else {
        return;
    };
    let Some(command) = bounce_command(Broker::RabbitMq) else {
        return;
    };
    restart_mid_stream(&url, &command, "rabbitmq broker restart mid-stream").await;
}

/// 10,000 jobs published (batches of 50, failures sent again) and consumed
/// while `command` stops and starts the broker at `url`: none lost
/// (duplicates are redeliveries of acks lost with the channel).
pub(crate) async fn restart_mid_stream(url: &str, command: &str, what: &str) {
    let adapter = RabbitAdapter::connect(RabbitConfig::new(url))
        .await
        .unwrap();
    let command = command.to_owned();
    let queue = unique_queue("rmq-restart");
    let n = 10_000;
    let adapter = Arc::new(adapter);
    let consumer_adapter = Arc::new(
        RabbitAdapter::connect(RabbitConfig::new(url))
            .await
            .unwrap(),
    );

    // Publisher: batches of 50; whatever a batch reports failed is sent again.
    let publisher = {
        let adapter = adapter.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            let mut ids = Vec::with_capacity(n);
            let mut resent = 0;
            for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
                let mut batch: Vec<OutgoingMessage> = chunk
                    .iter()
                    .map(|i| {
                        let job =
                            JobEnvelope::new("restart.item", vec![json!(i)]).with_queue(&queue);
                        ids.push(job.id.clone());
                        OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()
                    })
                    .collect();
                loop {
                    match adapter.publish(&queue, batch).await {
                        Ok(()) => break,
                        Err(Error::Publish(f)) => {
                            resent += f.failed.len();
                            batch = f.failed.into_iter().map(|f| f.message).collect();
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            (ids, resent)
        })
    };

    let bouncer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            bounce(&command, None).await.unwrap(),
            "bounce command failed"
        );
    });

    let mut received: HashMap<String, u32> = HashMap::new();
    let mut consumer = consumer_adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let mut settle_errors = 0;
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut published = None;
    loop {
        if published.is_none() && publisher.is_finished() {
            published = Some(());
        }
        if published.is_some() && received.len() >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timed out with {} of {n}",
            received.len()
        );
        match consumer.receive(100, Duration::from_millis(500)).await {
            Ok(batch) => {
                for d in batch {
                    let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
                    *received.entry(job.id.clone()).or_default() += 1;
                    // An ack on a channel lost in the restart fails; the broker
                    // redelivers that message, which the tally shows as a duplicate.
                    if d.ack().await.is_err() {
                        settle_errors += 1;
                    }
                }
            }
            Err(e) => {
                println!("receive error during restart (retried): {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    bouncer.await.unwrap();
    let (ids, resent) = publisher.await.unwrap();
    let mut tally = Tally::new();
    ids.iter().for_each(|id| tally.sent(id.clone()));
    for (id, count) in &received {
        for _ in 0..*count {
            tally.received(id.clone());
        }
    }
    println!("{what}: resent by caller {resent}, acks lost with the channel {settle_errors}");
    tally.assert_none_lost(what);
    assert!(tally.distinct_received() == n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_promptly_while_a_publisher_is_reconnecting() {
    let Some((_url, adapter, _raw)) = setup().await else {
        return;
    };
    let Some(command) = bounce_command(Broker::RabbitMq) else {
        return;
    };
    let adapter = Arc::new(adapter);
    let queue = unique_queue("rmq-health");
    // Down for 8 seconds.
    let bouncer = bounce(&command, Some(8));
    // Wait until the broker is gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while adapter.health().await.healthy {
        assert!(Instant::now() < deadline, "broker never went down");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A publisher now reconnects with backoff, holding the session lock.
    let publisher = {
        let adapter = adapter.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            adapter
                .publish(&queue, vec![OutgoingMessage::new("during", "text/plain")])
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    let health = adapter.health().await;
    let took = asked.elapsed();
    assert!(
        !health.healthy,
        "down while the broker is stopped: {}",
        health.detail
    );
    assert!(
        took < Duration::from_secs(4),
        "health waited {took:?} behind the reconnecting publisher"
    );
    assert!(bouncer.await.unwrap(), "bounce command failed");
    // Back: health recovers and the publish that waited went through.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !adapter.health().await.healthy {
        assert!(Instant::now() < deadline, "health never recovered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    publisher.await.unwrap().unwrap();
    assert_eq!(
        adapter.depth(&queue).await.unwrap(),
        Some(1),
        "the publish made during the outage arrived"
    );
}

/// A grpcq call as grpcq's publishers build it.
fn grpcq_call(topic: &str, action: &str, n: u8) -> ojs_grpcq::Message {
    ojs_grpcq::Message {
        originator: "native-grpcq".into(),
        topic: topic.into(),
        action: action.into(),
        payload: vec![n, 1, 2],
        message_id: uuid::Uuid::new_v4().to_string(),
        timestamp_ms: 1_763_700_000_000,
        metadata: Default::default(),
    }
}

#[tokio::test]
async fn calls_from_a_native_grpcq_publisher_reach_a_bound_queue_and_the_worker() {
    use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions};
    use lapin::{BasicProperties, ExchangeKind};
    let Some((url, _adapter, raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-grpcq-in");
    let suffix = &queue[queue.len() - 12..];
    // One exchange declared by the grpcq side as *direct* (one action
    // bound), one left for the adapter to declare (every action bound).
    let direct = format!("billing.Invoices-{suffix}");
    let topic = format!("payment.PaymentService-{suffix}");
    let ch = raw.create_channel().await.unwrap();
    ch.exchange_declare(
        direct.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let config =
        RabbitConfig::from_url(&format!("{url}?grpcq_bind.{queue}={topic},{direct}:Issue"))
            .unwrap();
    let adapter = RabbitAdapter::connect(config).await.unwrap();
    // The queue and its bindings are declared when a consumer starts (or on
    // the first publish to the queue).
    let mut consumer = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    assert!(consumer
        .receive(1, Duration::from_millis(100))
        .await
        .unwrap()
        .is_empty());
    consumer.close().await.unwrap();
    // The native publisher: exchange = topic, routing key = action, the
    // binary message as body, no content type, no headers.
    let calls = [
        grpcq_call(&topic, "ProcessPayment", 1),
        grpcq_call(&topic, "Refund", 2),
        grpcq_call(&direct, "Issue", 3),
    ];
    for c in &calls {
        ch.basic_publish(
            c.topic.as_str().into(),
            c.action.as_str().into(),
            BasicPublishOptions::default(),
            &ojs_grpcq::encode(c),
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    // Not bound: another action on the direct exchange goes nowhere here.
    ch.basic_publish(
        direct.as_str().into(),
        "Void".into(),
        BasicPublishOptions::default(),
        &ojs_grpcq::encode(&grpcq_call(&direct, "Void", 4)),
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    // The worker handles them (no content type: default_encoding grpcq).
    let mut registry = ojs_grpcq::registry::Registry::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for (t, a) in [
        (&topic, "ProcessPayment"),
        (&topic, "Refund"),
        (&direct, "Issue"),
    ] {
        let seen = seen.clone();
        registry
            .on_call(t, a, move |ctx, payload| {
                let seen = seen.clone();
                async move {
                    seen.lock()
                        .unwrap()
                        .push((ctx.message_id, payload.to_vec()));
                    Ok(())
                }
            })
            .unwrap();
    }
    let mut config = ojs_grpcq::worker::WorkerConfig::new(&queue);
    config.default_encoding = Some(Encoding::GrpcqProto);
    let adapter = Arc::new(adapter);
    let worker = ojs_grpcq::worker::Worker::new(adapter.clone(), registry, config);
    let stats = worker.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.lock().unwrap().len() < calls.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let mut got: Vec<_> = seen.lock().unwrap().clone();
    got.sort();
    let mut want: Vec<_> = calls
        .iter()
        .map(|c| (c.message_id.clone(), c.payload.clone()))
        .collect();
    want.sort();
    assert_eq!(got, want, "every bound call handled once, with its payload");
    assert_eq!(
        stats
            .dead_lettered
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    for e in [&direct, &topic] {
        ch.exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn grpcq_exchanges_publish_calls_the_way_grpcq_workers_read_them() {
    use lapin::options::{ExchangeDeleteOptions, QueueBindOptions};
    let Some((url, _adapter, raw)) = setup().await else {
        return;
    };
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("payment.PaymentService-{}", &suffix[..12]);
    let adapter = RabbitAdapter::connect(
        RabbitConfig::from_url(&format!("{url}?grpcq_exchanges=true")).unwrap(),
    )
    .await
    .unwrap();
    let call = grpcq_call(&topic, "ProcessPayment", 9);
    // Nobody reads the exchange yet: mandatory publishing reports it.
    let err = adapter
        .publish("ignored", vec![ojs_grpcq::outgoing(&call)])
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&format!("exchange {topic}")),
        "{err}"
    );
    // A native grpcq worker's queue, bound to exchange = topic, key = action.
    let ch = raw.create_channel().await.unwrap();
    let worker_queue = format!("grpcq-worker-{}", &suffix[..12]);
    ch.queue_declare(
        worker_queue.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        worker_queue.as_str().into(),
        topic.as_str().into(),
        "ProcessPayment".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    adapter
        .publish("ignored", vec![ojs_grpcq::outgoing(&call)])
        .await
        .unwrap();
    let got = ch
        .basic_get(
            worker_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the call reached the grpcq worker's queue");
    assert_eq!(ojs_grpcq::decode(&got.delivery.data).unwrap(), call);
    assert_eq!(got.delivery.routing_key.as_str(), "ProcessPayment");
    assert_eq!(got.delivery.exchange.as_str(), topic);
    // OJS envelopes still go to their OJS queue.
    let queue = unique_queue("rmq-grpcq-ojs");
    let job = JobEnvelope::new("a.b", vec![]).with_queue(&queue);
    adapter
        .publish(
            &queue,
            vec![OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()],
        )
        .await
        .unwrap();
    assert_eq!(adapter.depth(&queue).await.unwrap(), Some(1));
    ch.queue_delete(worker_queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    ch.exchange_delete(topic.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

/// A TCP proxy to RabbitMQ that forwards everything, except that on the
/// first connection whose broker side answers a `basic.consume` it drops
/// that answer and everything the broker sends after it: the client's
/// subscription never completes (and times out) while the broker has
/// registered the consumer and delivers to it. The client's own frames
/// still reach the broker.
struct ConsumeOkSwallower {
    addr: std::net::SocketAddr,
    swallowed: Arc<std::sync::atomic::AtomicBool>,
}

impl ConsumeOkSwallower {
    async fn start(broker: &str) -> ConsumeOkSwallower {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let swallowed = Arc::new(AtomicBool::new(false));
        let broker = broker.to_owned();
        let flag = swallowed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(&broker).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut broker_read, mut broker_write) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut broker_write).await;
                });
                let flag = flag.clone();
                tokio::spawn(async move {
                    // Broker → client is a sequence of frames: type (1),
                    // channel (2), size (4), payload, 0xCE. A method frame's
                    // payload starts with class and method: 60/21 is
                    // basic.consume-ok.
                    let mut pending = Vec::new();
                    let mut chunk = vec![0u8; 64 * 1024];
                    let mut dropping = false;
                    loop {
                        let n = match broker_read.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if dropping {
                            continue;
                        }
                        pending.extend_from_slice(&chunk[..n]);
                        let mut forward = 0;
                        while pending.len() >= forward + 7 {
                            let size = u32::from_be_bytes(
                                pending[forward + 3..forward + 7].try_into().unwrap(),
                            ) as usize;
                            let end = forward + 7 + size + 1;
                            if pending.len() < end {
                                break;
                            }
                            let payload = &pending[forward + 7..forward + 7 + size];
                            let consume_ok = pending[forward] == 1
                                && size >= 4
                                && payload[..4] == [0, 60, 0, 21];
                            if consume_ok && !flag.swap(true, Ordering::SeqCst) {
                                dropping = true;
                                break;
                            }
                            forward = end;
                        }
                        if client_write.write_all(&pending[..forward]).await.is_err() {
                            return;
                        }
                        pending.drain(..forward);
                        if dropping {
                            pending.clear();
                        }
                    }
                });
            }
        });
        ConsumeOkSwallower { addr, swallowed }
    }
}

/// A subscription whose `basic.consume` reached the broker but whose answer
/// did not arrive in time (a slow broker after a restart, a stalled
/// network) registered a consumer all the same: the broker delivers a
/// prefetch window to it. The adapter gives up on that channel, and must
/// close it — else those deliveries wait, unacknowledged and never
/// redelivered, for as long as the connection lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_cut_short_strands_no_deliveries() {
    let Some((url, adapter, _raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-cut-short");
    let n = 20;
    let jobs: Vec<JobEnvelope> = (0..n)
        .map(|i| JobEnvelope::new("cut.short", vec![json!(i)]).with_queue(&queue))
        .collect();
    let batch = jobs
        .iter()
        .map(|j| OutgoingMessage::from_envelope(j, Encoding::OjsProto).unwrap())
        .collect();
    adapter.publish(&queue, batch).await.unwrap();

    // amqp://user:pass@host:port/vhost → host:port
    let broker = url
        .rsplit_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap()
        .to_owned();
    let proxy = ConsumeOkSwallower::start(&broker).await;
    let proxied = url.replacen(&broker, &proxy.addr.to_string(), 1);
    let consumer_adapter = RabbitAdapter::connect(RabbitConfig::new(&proxied))
        .await
        .unwrap();
    // The first subscription is the one cut short (its 10 s run out);
    // the caller tries again, as the daemon does.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut consumer = loop {
        match consumer_adapter
            .consumer(&queue, ConsumerOptions::default())
            .await
        {
            Ok(c) => break c,
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                assert!(Instant::now() < deadline, "no subscription: {e}");
                println!("consumer (retried): {e}");
            }
        }
    };

    let mut received: HashMap<String, u32> = HashMap::new();
    while received.len() < n && Instant::now() < deadline {
        match consumer.receive(n, Duration::from_millis(500)).await {
            Ok(batch) => {
                for d in batch {
                    let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
                    *received.entry(job.id.clone()).or_default() += 1;
                    d.ack().await.unwrap();
                }
            }
            // The cut-short subscription, then whatever its reconnect meets.
            Err(e) => println!("receive (retried): {e}"),
        }
    }
    assert!(
        proxy.swallowed.load(std::sync::atomic::Ordering::SeqCst),
        "the proxy never saw a basic.consume-ok: the test did not cut a subscription short"
    );
    let mut tally = Tally::new();
    jobs.iter().for_each(|j| tally.sent(j.id.clone()));
    for (id, count) in &received {
        for _ in 0..*count {
            tally.received(id.clone());
        }
    }
    tally.assert_none_lost("a subscription cut short");
}

/// AMQP says short strings are UTF-8, but RabbitMQ relays whatever a
/// publisher writes: pika sends a `bytes` header name or message id as it
/// is. Such a message, from a queue and a publisher that are not ours, is
/// delivered with the string read as RabbitMQ's Java client reads it
/// (U+FFFD for the invalid bytes), and the message after it follows. lapin
/// used to fail the frame, drop the connection and get the same message
/// first again, for ever (third_party/README.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_string_that_is_not_utf8_is_read_and_never_stops_the_consumer() {
    let Some((url, _, _raw)) = setup().await else {
        return;
    };
    independent::available().unwrap();
    let queue = unique_queue("rmq-not-utf8");
    independent::run(&["rabbit-queue", &queue]).unwrap();
    for (i, extra) in [
        vec![
            "--header-hex",
            "fffe6e616d65=v",
            "--message-id-hex",
            "ff6964",
        ],
        vec!["--header", "plain=w"],
    ]
    .into_iter()
    .enumerate()
    {
        let body = format!("{{\"id\":\"j{i}\"}}");
        let mut args = vec![
            "rabbit-publish",
            "--routing-key",
            &queue,
            "--content-type",
            "application/json",
            "--body",
            &body,
        ];
        args.extend(extra);
        independent::run(&args).unwrap();
    }
    let mut config = RabbitConfig::new(&url);
    config.topology = ojs_adapter_rabbitmq::Topology::Existing;
    config.queue_template = "{queue}".into();
    config.exchange = String::new();
    let adapter = RabbitAdapter::connect(config).await.unwrap();
    let mut consumer = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(
            consumer
                .receive(2 - got.len(), Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    assert_eq!(got.len(), 2, "both messages delivered");
    let first = got
        .iter()
        .find(|d| &d.payload[..] == b"{\"id\":\"j0\"}")
        .unwrap();
    assert_eq!(first.headers.get_str("\u{FFFD}\u{FFFD}name"), Some("v"));
    assert_eq!(first.message_id.as_deref(), Some("\u{FFFD}id"));
    let second = got
        .iter()
        .find(|d| &d.payload[..] == b"{\"id\":\"j1\"}")
        .unwrap();
    assert_eq!(second.headers.get_str("plain"), Some("w"));
    for d in &got {
        d.ack().await.unwrap();
    }
    consumer.close().await.unwrap();
    let left = independent::lines(&["rabbit-exists", &queue]).unwrap();
    assert_eq!(left[0]["messages"], 0, "both acked: {left:?}");
    independent::run(&["rabbit-delete", &queue]).unwrap();
}

/// A connection that breaks each time it delivers (here the link is cut
/// mid-frame, after the handshake, by a 200 KB message) is not reconnected
/// to in a loop: the first resubscription is immediate (a broker restart),
/// each further one waits longer (`max_backoff_secs` caps it). Once the
/// link is whole the message arrives and nothing is lost. While it waits,
/// receive returns an error saying so, which the daemon's health reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_that_keeps_breaking_backs_off_instead_of_looping() {
    use ojs_bridge_tests::fault_proxy::{FaultProxy, Mode};

    let Some((url, adapter, _raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-keeps-breaking");
    let broker = url
        .rsplit_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap()
        .to_owned();
    let proxy = FaultProxy::start(broker.parse().unwrap()).await.unwrap();
    let proxied = url.replacen(&broker, &proxy.host_port(), 1);
    let mut config = RabbitConfig::new(&proxied);
    config.max_backoff_secs = 4;
    let cut = RabbitAdapter::connect(config).await.unwrap();
    let mut consumer = cut
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    // From now on a connection carries 16 KB each way, then is cut: enough
    // for a handshake and a subscription, not for the delivery.
    proxy.set(Mode::CutAfter(16 * 1024));
    let big = OutgoingMessage::new(vec![b'x'; 200_000], "application/octet-stream");
    adapter.publish(&queue, vec![big]).await.unwrap();
    let watch_for = Duration::from_secs(8);
    let start = Instant::now();
    // Every error a receive returned: the broken link itself when an
    // attempt fails, and while the consumer waits before the next one,
    // the wait.
    let mut errors = Vec::new();
    while start.elapsed() < watch_for {
        match consumer.receive(1, Duration::from_millis(500)).await {
            Ok(got) => assert!(got.is_empty(), "nothing gets through a cut link"),
            // While it waits, a receive says why (the daemon's health shows
            // it) rather than returning an empty batch.
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                errors.push(e.to_string());
            }
        }
    }
    assert!(
        errors.iter().all(|e| !e.contains("guest:guest")),
        "{errors:?}"
    );
    let reported = errors
        .iter()
        .find(|e| e.contains("in a row"))
        .unwrap_or_else(|| panic!("no receive reported the failing subscription: {errors:?}"));
    println!("reported: {reported}");
    assert!(
        reported.contains(&queue) && reported.contains("next attempt"),
        "{reported}"
    );
    let connections = proxy.accepted();
    println!("connections in {watch_for:?} of a link cut at every delivery: {connections}");
    // Without the backoff this was hundreds (one per round trip).
    assert!(
        (3..=8).contains(&connections),
        "{connections} connections in {watch_for:?}"
    );

    proxy.set(Mode::Pass);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < deadline {
        got = consumer
            .receive(1, Duration::from_millis(500))
            .await
            .unwrap_or_default();
    }
    assert_eq!(got.len(), 1, "the message arrives once the link is whole");
    assert_eq!(got[0].payload.len(), 200_000);
    got[0].ack().await.unwrap();
    consumer.close().await.unwrap();
}

/// AMQP carries header names, `content_type`, `type` and `message_id` as
/// short strings (255 bytes at most); Kafka header names and values, where
/// such messages come from, have no such bound. A message that does not fit
/// is an error for that message, naming what does not fit; the others in
/// the batch are published, and the connection is not disturbed.
#[tokio::test]
async fn a_message_whose_short_strings_do_not_fit_is_an_error_for_that_message() {
    let Some((_url, adapter, _raw)) = setup().await else {
        return;
    };
    let queue = unique_queue("rmq-short-string");
    let long = "n".repeat(300);
    let mut named = OutgoingMessage::new("named", "text/plain");
    named.headers.insert(long.clone(), "v");
    let typed = OutgoingMessage::new("typed", &format!("text/{long}"));
    let mut id = OutgoingMessage::new("id", "text/plain");
    id.message_id = Some(long.clone());
    let fits = OutgoingMessage::new("fits", "text/plain");
    let err = adapter
        .publish(&queue, vec![named, typed, fits.clone(), id])
        .await
        .unwrap_err();
    let Error::Publish(failure) = err else {
        panic!("expected per-message failures, got {err}")
    };
    let failed: Vec<(usize, String)> = failure
        .failed
        .iter()
        .map(|f| (f.index, f.error.to_string()))
        .collect();
    assert_eq!(
        failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![0, 1, 3],
        "{failed:?}"
    );
    for (_, text) in &failed {
        assert!(text.contains("255"), "{text}");
        assert!(!failure.failed[0].error.is_retryable());
    }
    assert!(failed[0].1.contains("header name"), "{failed:?}");
    assert!(failed[1].1.contains("content_type"), "{failed:?}");
    assert!(failed[2].1.contains("message_id"), "{failed:?}");
    // The one that fits went out, on a connection that still works.
    let mut c = adapter
        .consumer(&queue, ConsumerOptions::default())
        .await
        .unwrap();
    let got = c.receive(1, Duration::from_secs(10)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].payload[..], b"fits");
    got[0].ack().await.unwrap();
    adapter.publish(&queue, vec![fits]).await.unwrap();
    c.close().await.unwrap();
}
