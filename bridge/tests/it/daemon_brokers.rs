//! The daemon between real brokers: grpcq calls on RabbitMQ become OJS jobs
//! on Kafka, calls on SQS become jobs on RabbitMQ; health follows a broker
//! that goes away and comes back; a message RabbitMQ or an SQS queue cannot
//! carry is dead-lettered at the source while the rest flow.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{call, collect, http_get, start};
use ojs_adapter_kafka::KafkaAdapter;
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_bridge_tests::brokers::{bounce, bounce_command, find, unique_queue, Broker};
use ojs_bridge_tests::tally::Tally;
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping::call_job_id;
use ojs_queue::{header, Delivery, OutgoingMessage, QueueAdapter, Source};

/// Checks every job against the call it came from and counts them.
fn check_jobs(sent: &HashMap<String, grpcq::Message>, jobs: &[Delivery], context: &str) {
    let mut tally = Tally::new();
    for id in sent.keys() {
        tally.sent(id.clone());
    }
    for d in jobs {
        assert_eq!(
            d.content_type(),
            Some("application/openjobspec+proto"),
            "{context}"
        );
        let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
        tally.received(job.id.clone());
        let Some(msg) = sent.get(&job.id) else {
            continue;
        };
        assert_eq!(
            job.job_type,
            ojs_core::envelope::type_from_topic_action(&msg.topic, &msg.action)
        );
        assert_eq!(d.headers[header::ID], job.id);
        assert_eq!(d.headers[header::TYPE], job.job_type);
        assert_eq!(d.headers[header::SPECVERSION], "1.0");
        assert_eq!(d.headers[header::TRACEPARENT], msg.metadata["traceparent"]);
        assert_eq!(job.meta_str("tenant"), Some("acme"));
    }
    tally.assert_none_lost(context);
    assert_eq!(tally.unexpected(), 0, "{context}");
}

fn calls(n: usize, topic: &str) -> HashMap<String, grpcq::Message> {
    (0..n)
        .map(|i| call(i, topic, "ProcessPayment"))
        .map(|c| (call_job_id(&c.message_id, c.timestamp_ms), c))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcq_calls_on_rabbitmq_become_ojs_jobs_on_kafka() {
    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    let Some(kafka) = find(Broker::Kafka).await else {
        return;
    };
    let source_queue = unique_queue("bridge-calls");
    let topic = unique_queue("bridge-jobs");
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        rabbit = "{amqp}"
        kafka = "{kafka}"
        [[sources]]
        name = "calls"
        adapter = "rabbit"
        queue = "{source_queue}"
        [[routes]]
        name = "to-kafka"
        sink = "kafka"
        queue = "{topic}"
        "#,
        amqp = amqp.url,
        kafka = kafka.url
    );
    let rabbit = RabbitAdapter::connect(RabbitConfig::new(&amqp.url))
        .await
        .unwrap();
    let daemon = start(&toml, BTreeMap::new()).await;
    let sent = calls(2000, "payment.PaymentService");
    for chunk in sent.values().collect::<Vec<_>>().chunks(500) {
        rabbit
            .publish(
                &source_queue,
                chunk.iter().map(|c| ojs_grpcq::outgoing(c)).collect(),
            )
            .await
            .unwrap();
    }
    let kafka_adapter = KafkaAdapter::connect(ojs_bridge_tests::kafka::test_config(&kafka.url))
        .await
        .unwrap();
    let jobs = collect(
        &kafka_adapter,
        &topic,
        Source::Queue,
        sent.len(),
        Duration::from_secs(30),
    )
    .await;
    check_jobs(&sent, &jobs, "RabbitMQ → Kafka");
    for d in &jobs {
        // Kafka key: the job id (docs/design.md §4), so one job's copies share a partition.
        assert_eq!(d.key.as_deref(), Some(d.headers[header::ID].as_bytes()));
    }
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].acked,
        sent.len() as u64,
        "every call acked at the source"
    );
    // RabbitMQ suites run one at a time (.config/nextest.toml): no restart
    // can overlap this.
    assert_eq!(rabbit.depth(&source_queue).await.unwrap(), Some(0));
    kafka_adapter.close().await.unwrap();
    rabbit.close().await.unwrap();
}

/// A call whose message id is longer than AMQP's 255-byte `message_id`
/// (grpcq and Kafka set no such bound) cannot be published to RabbitMQ:
/// that is the message's fault, so the daemon dead-letters it at the
/// source as `sink_rejected`, naming what does not fit, and the calls
/// around it flow. The sink is not marked failing and nothing waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_rabbitmq_cannot_carry_is_dead_lettered_and_the_rest_flow() {
    use ojs_adapter_memory::MemoryAdapter;

    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    let name = unique_queue("mem");
    let out = unique_queue("bridge-too-long");
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        rabbit = "{amqp}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[routes]]
        name = "to-rabbit"
        sink = "rabbit"
        to = "grpcq"
        queue = "{out}"
        "#,
        amqp = amqp.url,
    );
    let memory = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let before = call(0, "payment.PaymentService", "Pay");
    let mut long = call(1, "payment.PaymentService", "Pay");
    long.message_id = "m".repeat(300);
    let after = call(2, "payment.PaymentService", "Pay");
    memory
        .publish(
            "calls",
            [&before, &long, &after]
                .into_iter()
                .map(ojs_grpcq::outgoing)
                .collect(),
        )
        .await
        .unwrap();
    let rabbit = RabbitAdapter::connect(RabbitConfig::new(&amqp.url))
        .await
        .unwrap();
    let got = collect(&rabbit, &out, Source::Queue, 2, Duration::from_secs(20)).await;
    let mut ids: Vec<String> = got
        .iter()
        .map(|d| grpcq::decode(&d.payload).unwrap().message_id)
        .collect();
    ids.sort();
    let mut want = vec![before.message_id.clone(), after.message_id.clone()];
    want.sort();
    assert_eq!(ids, want, "the calls around it arrive");
    let dead = collect(
        &memory,
        "calls",
        Source::DeadLetters,
        1,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        grpcq::decode(&dead[0].payload).unwrap().message_id,
        long.message_id
    );
    let reason = dead[0].dead_letter_reason().unwrap();
    assert_eq!(reason.error_type, "sink_rejected");
    assert!(
        reason.message.contains("message_id") && reason.message.contains("255"),
        "{}",
        reason.message
    );
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].acked, 3,
        "all three settled at the source"
    );
    rabbit.close().await.unwrap();
}

/// An SQS queue made by another team with a small `MaximumMessageSize`:
/// SQS refuses a batch as a whole when one message is over it. The daemon
/// used to take that as SQS failing and retry the whole batch for ever,
/// the calls next to the large one included. Now the large one alone is
/// dead-lettered at the source as `sink_rejected`, the others arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_over_the_sqs_queues_own_size_limit_is_dead_lettered_and_the_rest_flow() {
    use ojs_adapter_memory::MemoryAdapter;
    use ojs_bridge_tests::independent;

    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let name = unique_queue("mem");
    let out = unique_queue("bridge-sqs-small");
    independent::run(&["sqs-queue", &out, "--attr", "MaximumMessageSize=1024"]).unwrap();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        sqs = "{sqs}&topology=existing"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[routes]]
        name = "to-sqs"
        sink = "sqs"
        to = "grpcq"
        queue = "{out}"
        "#,
        sqs = sqs.url,
    );
    let memory = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let before = call(0, "payment.PaymentService", "Pay");
    let mut large = call(1, "payment.PaymentService", "Pay");
    large.payload = vec![b'x'; 1500];
    let after = call(2, "payment.PaymentService", "Pay");
    memory
        .publish(
            "calls",
            [&before, &large, &after]
                .into_iter()
                .map(ojs_grpcq::outgoing)
                .collect(),
        )
        .await
        .unwrap();
    let sqs_adapter = SqsAdapter::connect(SqsConfig::from_url(&sqs.url).unwrap())
        .await
        .unwrap();
    let got = collect(
        &sqs_adapter,
        &out,
        Source::Queue,
        2,
        Duration::from_secs(20),
    )
    .await;
    let mut ids: Vec<String> = got
        .iter()
        .map(|d| grpcq::decode(&d.payload).unwrap().message_id)
        .collect();
    ids.sort();
    let mut want = vec![before.message_id.clone(), after.message_id.clone()];
    want.sort();
    assert_eq!(ids, want, "the calls around it arrive");
    let dead = collect(
        &memory,
        "calls",
        Source::DeadLetters,
        1,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        grpcq::decode(&dead[0].payload).unwrap().message_id,
        large.message_id
    );
    let reason = dead[0].dead_letter_reason().unwrap();
    assert_eq!(reason.error_type, "sink_rejected");
    assert!(
        reason.message.contains("InvalidParameterValue"),
        "{}",
        reason.message
    );
    let summary = daemon.shutdown().await;
    assert_eq!(
        summary.sources[0].acked, 3,
        "all three settled at the source"
    );
    sqs_adapter.close().await.unwrap();
}

/// A configured dead-letter destination on another broker can refuse the
/// copy for what the source gave it: a header name SQS does not allow, a
/// body over the dead-letter queue's own `MaximumMessageSize`. The daemon
/// used to retry the same copy for ever, holding the message (and on Kafka
/// its partition). Now it sends the copy without the headers OJS does not
/// name, then without its body, each step saying what it left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_its_destination_refuses_goes_with_less_and_never_holds_the_source() {
    use base64::Engine as _;
    use ojs_adapter_memory::MemoryAdapter;
    use ojs_bridge_tests::independent;

    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let name = unique_queue("mem");
    let dead = unique_queue("bridge-dead-small");
    independent::run(&["sqs-queue", &dead, "--attr", "MaximumMessageSize=1024"]).unwrap();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        sqs = "{sqs}&topology=existing"
        [[sources]]
        name = "jobs"
        adapter = "mem"
        queue = "in"
        dead_letter = {{ adapter = "sqs", queue = "{dead}" }}
        [[routes]]
        name = "out"
        sink = "mem"
        queue = "out"
        "#,
        sqs = sqs.url,
    );
    let memory = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let garbage = b"\xff\xfe not a protobuf job".to_vec();
    let named_badly = OutgoingMessage::new(garbage.clone(), "application/openjobspec+proto")
        .with_header("bad name!", "v")
        .with_header("x-team", "payments");
    let too_big = OutgoingMessage::new(vec![0xff; 1500], "application/openjobspec+proto");
    memory
        .publish("in", vec![named_badly, too_big])
        .await
        .unwrap();
    let got =
        independent::lines(&["sqs-receive", &dead, "--count", "2", "--timeout", "30"]).unwrap();
    assert_eq!(got.len(), 2, "both dead letters landed: {got:?}");
    let body = |m: &serde_json::Value| {
        base64::engine::general_purpose::STANDARD
            .decode(m["body"].as_str().unwrap().trim())
            .unwrap()
    };
    let stripped = got
        .iter()
        .find(|m| !body(m).is_empty())
        .expect("the one that kept its body");
    assert_eq!(body(stripped), garbage);
    assert_eq!(
        stripped["attributes"]["ojs-headers-omitted"], "2",
        "{stripped}"
    );
    assert!(stripped["attributes"].get("x-team").is_none(), "{stripped}");
    assert!(
        stripped["attributes"]["ojs-error-type"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{stripped}"
    );
    let bodiless = got
        .iter()
        .find(|m| body(m).is_empty())
        .expect("the one that went without");
    assert_eq!(
        bodiless["attributes"]["ojs-payload-omitted"], "1500",
        "{bodiless}"
    );
    assert!(
        bodiless["attributes"]["ojs-error-type"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{bodiless}"
    );
    let summary = daemon.shutdown().await;
    assert_eq!(summary.sources[0].acked, 2, "both settled at the source");
}

/// The same on RabbitMQ: a dead letter whose header name and message id
/// are longer than AMQP's 255-byte short strings (both come from a Kafka
/// record or a grpcq call unchecked) lands without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_amqp_cannot_carry_lands_without_what_does_not_fit() {
    use ojs_adapter_memory::MemoryAdapter;
    use ojs_bridge_tests::independent;

    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    if independent::available().is_none() {
        return;
    }
    let name = unique_queue("mem");
    let dead = unique_queue("bridge-dead-amqp");
    independent::run(&["rabbit-queue", &dead]).unwrap();
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        mem = "memory://{name}"
        [adapters.rabbit]
        url = "{url}"
        topology = "existing"
        queue_template = "{{queue}}"
        exchange = ""
        [[sources]]
        name = "jobs"
        adapter = "mem"
        queue = "in"
        dead_letter = {{ adapter = "rabbit", queue = "{dead}" }}
        [[routes]]
        name = "out"
        sink = "mem"
        queue = "out"
        "#,
        url = amqp.url,
    );
    let memory = MemoryAdapter::named(&name);
    let daemon = start(&toml, BTreeMap::new()).await;
    let mut poison = OutgoingMessage::new(&b"\xff not a job"[..], "application/openjobspec+proto")
        .with_header("n".repeat(300), "v");
    poison.message_id = Some("m".repeat(300));
    memory.publish("in", vec![poison]).await.unwrap();
    let got =
        independent::lines(&["rabbit-get", &dead, "--count", "1", "--timeout", "20"]).unwrap();
    assert_eq!(got.len(), 1, "the dead letter landed");
    assert_eq!(
        got[0]["headers"]["x-ojs-headers-omitted"], "1",
        "{}",
        got[0]
    );
    assert!(got[0]["message_id"].is_null(), "{}", got[0]);
    assert!(
        got[0]["headers"]["x-ojs-error-type"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{}",
        got[0]
    );
    let summary = daemon.shutdown().await;
    assert_eq!(summary.sources[0].acked, 1, "settled at the source");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcq_calls_on_sqs_become_ojs_jobs_on_rabbitmq() {
    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    let source_queue = unique_queue("bridge-sqs-calls");
    let sink_queue = unique_queue("bridge-rmq-jobs");
    let toml = format!(
        r#"
        [http]
        listen = "off"
        [adapters]
        sqs = "{sqs}"
        rabbit = "{amqp}"
        [[sources]]
        name = "calls"
        adapter = "sqs"
        queue = "{source_queue}"
        batch_size = 10
        [[routes]]
        name = "to-rabbit"
        sink = "rabbit"
        queue = "{sink_queue}"
        "#,
        amqp = amqp.url,
        sqs = sqs.url
    );
    let sqs_adapter = SqsAdapter::connect(SqsConfig::from_url(&sqs.url).unwrap())
        .await
        .unwrap();
    let rabbit = RabbitAdapter::connect(RabbitConfig::new(&amqp.url))
        .await
        .unwrap();
    // Declare the sink queue before the first job, as an operator would.
    rabbit.depth(&sink_queue).await.unwrap();
    let daemon = start(&toml, BTreeMap::new()).await;
    let sent = calls(300, "payment.PaymentService");
    // As grpcq's own SQS adapter sends them: base64 body plus the String
    // attributes topic/action/originator, no content type.
    let messages: Vec<OutgoingMessage> = sent
        .values()
        .map(|c| {
            let mut m = ojs_grpcq::outgoing(c);
            m.headers.remove(header::CONTENT_TYPE);
            m
        })
        .collect();
    for chunk in messages.chunks(100) {
        sqs_adapter
            .publish(&source_queue, chunk.to_vec())
            .await
            .unwrap();
    }
    let jobs = collect(
        &rabbit,
        &sink_queue,
        Source::Queue,
        sent.len(),
        Duration::from_secs(20),
    )
    .await;
    check_jobs(&sent, &jobs, "SQS → RabbitMQ");
    let summary = daemon.shutdown().await;
    assert_eq!(summary.sources[0].acked, sent.len() as u64);
    rabbit.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_503_when_rabbitmq_goes_away_and_200_when_it_is_back() {
    let Some(amqp) = find(Broker::RabbitMq).await else {
        return;
    };
    let Some(command) = bounce_command(Broker::RabbitMq) else {
        return;
    };
    let queue = unique_queue("bridge-health");
    let toml = format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        [adapters]
        rabbit = "{amqp}"
        local = "memory://health-{queue}"
        [[sources]]
        name = "calls"
        adapter = "rabbit"
        queue = "{queue}"
        [[routes]]
        name = "all"
        sink = "local"
        "#,
        amqp = amqp.url
    );
    let daemon = start(&toml, BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    assert_eq!(http_get(addr, "/ojs/v1/health").await.0, 200);
    let bouncer = bounce(&command, Some(6));
    let deadline = Instant::now() + Duration::from_secs(30);
    // 503 may come first from the failing source (at once) and then from
    // the background probe of the adapter (every health_interval): wait for
    // the probe to name RabbitMQ down. The bounce runs to its end whatever
    // happens, so a failure here never leaves the broker stopped for the
    // next suite.
    let mut seen = None;
    while Instant::now() < deadline {
        let (status, body) = http_get(addr, "/ojs/v1/health").await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        if status == 503 && v["adapters"]["rabbit"]["status"] == "down" {
            seen = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let bounced = bouncer.await.unwrap();
    let v = seen.expect("health never turned 503 naming RabbitMQ down while it was down");
    assert_eq!(v["adapters"]["local"]["status"], "ok", "{v}");
    assert!(bounced, "bounce command failed");
    let deadline = Instant::now() + Duration::from_secs(60);
    while http_get(addr, "/ojs/v1/health").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "health never returned to 200 after RabbitMQ came back"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // And the daemon works again: a call goes through.
    let rabbit: Arc<dyn QueueAdapter> = Arc::new(
        RabbitAdapter::connect(RabbitConfig::new(&amqp.url))
            .await
            .unwrap(),
    );
    rabbit
        .publish(&queue, vec![ojs_grpcq::outgoing(&call(0, "a.B", "C"))])
        .await
        .unwrap();
    let sink = ojs_adapter_memory::MemoryAdapter::named(&format!("health-{queue}"));
    let got = collect(&sink, "default", Source::Queue, 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "a call after the broker came back is bridged");
    daemon.shutdown().await;
    rabbit.close().await.unwrap();
}
