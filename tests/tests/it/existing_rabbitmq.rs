//! RabbitMQ that ojs-bridge does not own: queues and exchanges made by pika
//! with their own names and arguments, `topology = "existing"` (the shared
//! acceptance suite runs in that mode), `declare` over queues declared with
//! other arguments, a user without `configure` permission, and TLS.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_bridge_tests::acceptance::{AdapterFactory, Features};
use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{find, missing, rabbitmqctl, unique_queue, Broker};
use ojs_bridge_tests::consume::{drain_payloads, first_delivery, next_delivery};
use ojs_bridge_tests::independent;
use ojs_queue::{ConsumerOptions, DeadLetterReason, Nack, OutgoingMessage, QueueAdapter};

/// Exchange the acceptance queues' dead letters go to (made by pika).
const DEAD_EXCHANGE: &str = "acc.existing.dead";

/// Adapters on queues named like the OJS queue, published through the
/// default exchange, declaring nothing; dead letters to a pre-made exchange.
struct ExistingRabbit {
    url: String,
}

impl ExistingRabbit {
    fn config(&self) -> RabbitConfig {
        RabbitConfig::from_url(&format!(
            "{}?topology=existing&queue_template={{queue}}&exchange=&dead_letter_exchange={DEAD_EXCHANGE}&dead_letter_queue_template={{queue}}.dead",
            self.url
        ))
        .unwrap()
    }
}

#[async_trait]
impl AdapterFactory for ExistingRabbit {
    async fn connect(&self) -> anyhow::Result<Arc<dyn QueueAdapter>> {
        Ok(Arc::new(RabbitAdapter::connect(self.config()).await?))
    }

    fn features(&self) -> Features {
        Features {
            name: "rabbitmq (topology = existing)",
            persistent: true,
            ordered_by_key: true,
            redelivers_on_consumer_drop: true,
            visibility_timeout: false,
            max_deliveries: true,
            counts_redeliveries: true,
            counts_receives: false,
            exact_depth: true,
            creates_resources: false,
            consumer_startup: Duration::from_secs(1),
            volume: 1.0,
            patience: Duration::from_secs(30),
        }
    }

    /// The queue as another team would have made it: its own name, its own
    /// arguments (lazy mode, no priority, no dead-letter exchange), and a
    /// dead-letter queue bound to their exchange.
    async fn queue(&self, prefix: &str) -> anyhow::Result<String> {
        let queue = unique_queue(prefix);
        let dead = format!("{queue}.dead");
        independent::run(&["rabbit-queue", &queue, "--arg", "x-queue-mode=lazy"])?;
        independent::run(&["rabbit-queue", &dead])?;
        independent::run(&[
            "rabbit-exchange",
            DEAD_EXCHANGE,
            "--bind",
            &format!("{dead}:{queue}"),
        ])?;
        Ok(queue)
    }
}

async fn existing_rabbit() -> Option<ExistingRabbit> {
    let url = find(Broker::RabbitMq).await?.url;
    independent::available()?;
    // Their dead-letter exchange exists before any adapter connects.
    independent::run(&["rabbit-exchange", DEAD_EXCHANGE]).unwrap();
    Some(ExistingRabbit { url })
}

acceptance_tests!(existing_rabbit);

fn job(i: usize) -> OutgoingMessage {
    OutgoingMessage::new(format!("job-{i}"), "text/plain")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_topology_never_declares_and_names_what_is_missing() {
    let Some(f) = existing_rabbit().await else {
        return;
    };
    let queue = unique_queue("existing-missing");
    let started = std::time::Instant::now();
    let adapter = RabbitAdapter::connect(f.config()).await.unwrap();
    let Err(err) = adapter.consumer(&queue, ConsumerOptions::default()).await else {
        panic!("a missing queue must be an error");
    };
    // Callers match on the kind, and lapin's own error is the source.
    assert_eq!(
        err.broker_kind(),
        Some(ojs_queue::BrokerErrorKind::NotFound),
        "{err}"
    );
    let source = std::error::Error::source(&err).expect("lapin's error is kept");
    assert!(
        source.downcast_ref::<lapin::Error>().is_some(),
        "{source:?}"
    );
    let err = err.to_string();
    assert!(
        err.contains(&queue) && err.contains("does not exist"),
        "{err}"
    );
    let err = adapter.prepare(&queue).await.unwrap_err().to_string();
    assert!(err.contains(&queue), "{err}");
    let err = adapter
        .publish(&queue, vec![job(0)])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&queue), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Nothing was created, as RabbitMQ itself says.
    assert!(!independent::rabbit_exists(&queue, false).unwrap());
    assert!(!independent::rabbit_exists(&format!("{queue}.dead"), false).unwrap());
    // A missing exchange named in the config stops the connect, named.
    let config = RabbitConfig::from_url(&format!(
        "{}?topology=existing&exchange=no.such.exchange",
        f.url
    ))
    .unwrap();
    let err = RabbitAdapter::connect(config)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("no.such.exchange"), "{err}");
    assert!(!independent::rabbit_exists("no.such.exchange", true).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_uses_a_queue_declared_elsewhere_with_other_arguments() {
    let Some(f) = existing_rabbit().await else {
        return;
    };
    // Another tool declared the queue our default template names, with
    // arguments that differ from ours (no priority, no DLX, a length cap):
    // a plain re-declare would fail with 406 PRECONDITION_FAILED.
    let queue = unique_queue("declared-elsewhere");
    let name = format!("ojs.queue.{queue}");
    independent::run(&["rabbit-queue", &name, "--arg", "x-max-length=5000"]).unwrap();
    let adapter = RabbitAdapter::connect(RabbitConfig::new(&f.url))
        .await
        .unwrap();
    adapter.prepare(&queue).await.unwrap();
    adapter
        .publish(&queue, (0..20).map(job).collect())
        .await
        .unwrap();
    let got = drain_payloads(
        &adapter,
        &queue,
        ConsumerOptions::default(),
        20,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    println!(
        "sent 20 received {} lost {}",
        got.len(),
        20 - got.len().min(20)
    );
    assert_eq!(got.len(), 20);
    adapter.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_follow_the_queues_own_dead_letter_exchange() {
    let Some(f) = existing_rabbit().await else {
        return;
    };
    // topology = existing and no dead_letter_exchange configured: the
    // queue's own x-dead-letter-exchange (fanout → its DLQ) takes them.
    let queue = unique_queue("own-dlx");
    let dlx = format!("{queue}.dlx");
    let dlq = format!("{queue}.their-dlq");
    independent::run(&[
        "rabbit-queue",
        &queue,
        "--dead-letter-exchange",
        &dlx,
        "--dlq",
        &dlq,
    ])
    .unwrap();
    let config = RabbitConfig::from_url(&format!(
        "{}?topology=existing&queue_template={{queue}}&exchange=",
        f.url
    ))
    .unwrap();
    let adapter = RabbitAdapter::connect(config).await.unwrap();
    adapter.publish(&queue, vec![job(1)]).await.unwrap();
    let (consumer, d) = first_delivery(&adapter, &queue, Duration::from_secs(20))
        .await
        .unwrap();
    d.nack(Nack::DeadLetter(DeadLetterReason::new("poison", "test")))
        .await
        .unwrap();
    let dead = independent::lines(&["rabbit-get", &dlq, "--count", "1"]).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["body"], "job-1");
    consumer.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_configure_permission_reads_and_writes_existing_queues() {
    let Some(f) = existing_rabbit().await else {
        return;
    };
    let user = unique_queue("bridge-lp");
    let secret = "lp-secret-9c1d";
    if !rabbitmqctl(&["add_user", &user, secret]) {
        missing::<()>(
            "rabbitmqctl",
            "cannot add a user (set OJS_BRIDGE_TEST_RABBITMQCTL)",
        );
        return;
    }
    // No configure (declare) permission at all; read and write everywhere.
    assert!(ojs_bridge_tests::brokers::rabbitmq_may_not_configure(&user));
    let queue = unique_queue("least-privilege");
    independent::run(&["rabbit-queue", &queue]).unwrap();
    let host = f.url.rsplit('@').next().unwrap();
    let url = format!("amqp://{user}:{secret}@{host}");
    let settings = "topology=existing&queue_template={queue}&exchange=";
    let adapter =
        RabbitAdapter::connect(RabbitConfig::from_url(&format!("{url}?{settings}")).unwrap())
            .await
            .unwrap();
    adapter
        .publish(&queue, (0..10).map(job).collect())
        .await
        .unwrap();
    let got = drain_payloads(
        &adapter,
        &queue,
        ConsumerOptions::default(),
        10,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    println!(
        "least privilege: sent 10 received {} lost {}",
        got.len(),
        10 - got.len().min(10)
    );
    assert_eq!(got.len(), 10);
    adapter.close().await.unwrap();

    // `declare` without the permission: what exists is still used.
    let adapter = RabbitAdapter::connect(
        RabbitConfig::from_url(&format!("{url}?queue_template={{queue}}&exchange=")).unwrap(),
    )
    .await
    .unwrap();
    adapter.publish(&queue, vec![job(99)]).await.unwrap();
    assert_eq!(
        drain_payloads(
            &adapter,
            &queue,
            ConsumerOptions::default(),
            1,
            Duration::from_secs(20)
        )
        .await
        .unwrap(),
        vec!["job-99"]
    );
    // …and what is missing is a clear error naming the permission, at once.
    let started = std::time::Instant::now();
    let err = adapter
        .prepare(&unique_queue("lp-missing"))
        .await
        .unwrap_err();
    assert_eq!(
        err.broker_kind(),
        Some(ojs_queue::BrokerErrorKind::AccessDenied),
        "{err}"
    );
    let err = err.to_string();
    assert!(err.contains("configure"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    adapter.close().await.unwrap();

    // Without `write` permission a publish fails once, naming it, instead
    // of reconnecting until the publish timeout.
    assert!(rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &user,
        "^$",
        "^$",
        ".*"
    ]));
    let adapter =
        RabbitAdapter::connect(RabbitConfig::from_url(&format!("{url}?{settings}")).unwrap())
            .await
            .unwrap();
    let started = std::time::Instant::now();
    let err = adapter
        .publish(&queue, vec![job(1)])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("write"), "{err}");
    assert!(!err.contains(secret), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    adapter.close().await.unwrap();
    rabbitmqctl(&["delete_user", &user]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_ca_file() {
    let Some(_) = existing_rabbit().await else {
        return;
    };
    let (Ok(url), Ok(tls)) = (
        std::env::var("OJS_BRIDGE_TEST_AMQPS_URL"),
        std::env::var("OJS_BRIDGE_TEST_TLS_DIR"),
    ) else {
        missing::<()>(
            "OJS_BRIDGE_TEST_AMQPS_URL",
            "no TLS listener (scripts/brokers.sh up tls)",
        );
        return;
    };
    let queue = unique_queue("amqps");
    let config = RabbitConfig::from_url(&format!("{url}?ca_file={tls}/ca.pem")).unwrap();
    let adapter = RabbitAdapter::connect(config).await.unwrap();
    adapter
        .publish(&queue, (0..5).map(job).collect())
        .await
        .unwrap();
    assert_eq!(
        drain_payloads(
            &adapter,
            &queue,
            ConsumerOptions::default(),
            5,
            Duration::from_secs(20)
        )
        .await
        .unwrap()
        .len(),
        5
    );
    adapter.close().await.unwrap();
    // Without the CA the broker's certificate is not trusted.
    let err = RabbitAdapter::connect(
        RabbitConfig::from_url(&format!("{url}?publish_timeout_secs=2")).unwrap(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(!err.contains("guest:guest"), "{err}");
}

/// Other AMQP clients write typed headers: integers, booleans, tables,
/// arrays, voids (Celery, Spring, MassTransit do). The neutral headers hold
/// numbers and booleans as text and cannot hold the rest, so a retry or
/// dead-letter copy used to turn `5` into `"5"` and drop tables, arrays and
/// voids. Now each copy carries them as they came, through a retry and
/// then a dead letter of the retried copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_headers_from_other_clients_survive_retry_and_dead_letter_copies() {
    let Some(f) = existing_rabbit().await else {
        return;
    };
    let queue = f.queue("typed-headers").await.unwrap();
    let typed = [
        ("count", "5"),
        ("urgent", "true"),
        ("meta", r#"{"tenant": "acme", "shard": 3}"#),
        ("tags", r#"[1, "two"]"#),
        ("nothing", "null"),
        ("plain", r#""text""#),
    ];
    let mut args = vec![
        "rabbit-publish".to_owned(),
        "--routing-key".to_owned(),
        queue.clone(),
        "--body".to_owned(),
        "typed".to_owned(),
    ];
    for (name, json) in typed {
        args.push("--header-json".to_owned());
        args.push(format!("{name}={json}"));
    }
    independent::run(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();

    let adapter = RabbitAdapter::connect(f.config()).await.unwrap();
    let (mut consumer, d) = first_delivery(&adapter, &queue, Duration::from_secs(20))
        .await
        .unwrap();
    // What the neutral headers hold: scalars as text, the rest not at all.
    assert_eq!(d.headers.get_str("count"), Some("5"));
    assert_eq!(d.headers.get_str("urgent"), Some("true"));
    assert_eq!(d.headers.get_str("plain"), Some("text"));
    assert!(d.headers.get("meta").is_none());
    d.nack(Nack::Retry {
        delay: Duration::ZERO,
    })
    .await
    .unwrap();
    let retried = next_delivery(&mut *consumer, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(retried.attempt, 2);
    assert_eq!(retried.headers.get_str("count"), Some("5"));
    retried
        .nack(Nack::DeadLetter(DeadLetterReason::new("poison", "test")))
        .await
        .unwrap();
    consumer.close().await.unwrap();

    let dead =
        independent::lines(&["rabbit-get", &format!("{queue}.dead"), "--count", "1"]).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let m = &dead[0];
    assert_eq!(m["body"], "typed");
    for (name, ty) in [
        ("count", "int"),
        ("urgent", "bool"),
        ("meta", "dict"),
        ("tags", "list"),
        ("nothing", "NoneType"),
        ("plain", "str"),
    ] {
        assert_eq!(m["header_types"][name], ty, "{name}: {m}");
    }
    for (name, json) in typed {
        let want: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(m["header_json"][name], want, "{name}: {m}");
    }
    assert_eq!(m["header_json"]["x-ojs-attempt"], "2", "{m}");
    assert_eq!(m["header_json"]["x-ojs-error-type"], "poison", "{m}");
}
