//! The project's own image and compose file, run by the engine the
//! container suites use (`scripts/containers.sh`): the image as a
//! testcontainers container (uid 10001, read-only root file system, its
//! configuration mounted) carrying a grpcq call from the embedded broker to
//! a RabbitMQ container, and `docker-compose.yml` validated and brought up
//! with the local images (`docker/compose.ci.yml`), a call flowing through
//! each of its routes.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{call, collect, http_get};
use ojs_adapter_kafka::KafkaAdapter;
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_adapter_rabbitmq::{RabbitAdapter, RabbitConfig};
use ojs_adapter_sqs::{SqsAdapter, SqsConfig};
use ojs_bridge_tests::brokers::{missing, unique_queue, Broker};
use ojs_bridge_tests::containers::{docker, free_port, project_image, start};
use ojs_bridge_tests::tempdir::TempDir;
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping::call_job_id;
use ojs_queue::{header, Delivery, QueueAdapter, Source};
use testcontainers::core::{AccessMode, Mount, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{GenericImage, ImageExt};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Polls `GET /ojs/v1/health` on `addr` until it answers 200; the last
/// answer (or refusal) when it does not within `limit`.
async fn healthy(addr: SocketAddr, limit: Duration) -> Result<(), String> {
    let until = Instant::now() + limit;
    let mut last = String::from("nothing listened");
    while Instant::now() < until {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            let (status, body) = http_get(addr, "/ojs/v1/health").await;
            if status == 200 {
                return Ok(());
            }
            last = format!("{status} {body}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(last)
}

/// The OJS job each call became, checked against the call: the id derived
/// from the call's id, its type, its trace context.
fn check_job(d: &Delivery, sent: &HashMap<String, grpcq::Message>) -> String {
    assert_eq!(d.content_type(), Some("application/openjobspec+proto"));
    let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
    let msg = sent
        .get(&job.id)
        .unwrap_or_else(|| panic!("job {} came from no call sent", job.id));
    assert_eq!(
        job.job_type,
        ojs_core::envelope::type_from_topic_action(&msg.topic, &msg.action)
    );
    assert_eq!(d.headers[header::ID], job.id);
    assert_eq!(d.headers[header::TRACEPARENT], msg.metadata["traceparent"]);
    assert_eq!(job.meta_str("tenant"), Some("acme"));
    job.id.clone()
}

fn sent_calls(calls: &[grpcq::Message]) -> HashMap<String, grpcq::Message> {
    calls
        .iter()
        .map(|c| (call_job_id(&c.message_id, c.timestamp_ms), c.clone()))
        .collect()
}

/// The process of a running container as the host sees it: its `Uid:` line
/// (real, effective, saved, file system).
fn container_uids(id: &str) -> String {
    let pid = docker(&["inspect", "--format", "{{.State.Pid}}", id]).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The image cargo's binary makes, run as a user would run it in a
/// testcontainers suite: as uid 10001 (the image's user), with a read-only
/// root file system, the configuration mounted read-only and only the data
/// directory writable. Health answers 200; three grpcq calls published on
/// the embedded broker (in the mounted directory, from this process) come
/// out of a RabbitMQ container as OJS jobs; the call's payload is nowhere
/// in the container's trace log; `docker stop` (SIGTERM) ends it with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_project_image_runs_as_10001_read_only_and_carries_grpcq_calls_to_a_rabbitmq_container()
{
    let Some(image) = project_image(Path::new(env!("CARGO_BIN_EXE_ojs-bridge"))) else {
        return;
    };
    let Some(rabbit) = start(Broker::RabbitMq).await else {
        return;
    };
    let dir = TempDir::new("image");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    // The container's user owns nothing on the host: the directory it
    // writes is open to it, as a volume's would be.
    std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let jobs = unique_queue("image-jobs");
    let config = dir.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            shutdown_timeout = "10s"
            [adapters]
            local = "local:/var/lib/ojs-bridge/data"
            rabbit = "{rabbit}"
            [[sources]]
            name = "calls"
            adapter = "local"
            queue = "calls"
            [[routes]]
            name = "to-rabbit"
            sources = ["calls"]
            sink = "rabbit"
            queue = "{jobs}"
            "#,
            rabbit = rabbit.url
        ),
    )
    .unwrap();
    let port = free_port().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let (name, tag) = image.rsplit_once(':').unwrap();
    let container = GenericImage::new(name, tag)
        .with_wait_for(WaitFor::Nothing)
        .with_network("host")
        .with_readonly_rootfs(true)
        .with_mount(Mount::bind_mount(
            data.to_string_lossy(),
            "/var/lib/ojs-bridge/data",
        ))
        .with_mount(
            Mount::bind_mount(config.to_string_lossy(), "/etc/ojs-bridge/bridge.toml")
                .with_access_mode(AccessMode::ReadOnly),
        )
        // The image listens on every interface of its own network; on the
        // host's network, loopback and a port of this test's.
        .with_env_var("OJS_BRIDGE_HTTP_LISTEN", addr.to_string())
        .with_env_var("OJS_BRIDGE_LOG", "trace")
        .with_cmd(["run", "--config", "/etc/ojs-bridge/bridge.toml"])
        .start()
        .await
        .unwrap();
    let id = container.id().to_owned();
    if let Err(last) = healthy(addr, Duration::from_secs(60)).await {
        let logs = docker(&["logs", &id]).unwrap_or_default();
        panic!("the image's daemon was not healthy within 60 s (last: {last}); its log:\n{logs}");
    }
    assert_eq!(
        container_uids(&id),
        "10001 10001 10001 10001",
        "the daemon runs as the image's user"
    );
    let written = docker(&["exec", &id, "sh", "-c", "touch /usr/local/bin/probe"]);
    let refused = written.expect_err("the root file system must be read-only");
    assert!(
        refused.to_string().contains("Read-only file system"),
        "{refused:#}"
    );

    let calls: Vec<_> = (0..3)
        .map(|i| call(i, "image.ImageService", "Carry"))
        .collect();
    let sent = sent_calls(&calls);
    let local = LocalAdapter::open(LocalConfig::new(&data)).await.unwrap();
    local
        .publish("calls", calls.iter().map(ojs_grpcq::outgoing).collect())
        .await
        .unwrap();
    let sink = RabbitAdapter::connect(RabbitConfig::new(&rabbit.url))
        .await
        .unwrap();
    let out = collect(&sink, &jobs, Source::Queue, 3, Duration::from_secs(30)).await;
    let mut ids: Vec<_> = out.iter().map(|d| check_job(d, &sent)).collect();
    ids.sort();
    let mut want: Vec<_> = sent.keys().cloned().collect();
    want.sort();
    println!(
        "image {image}: sent 3, received {} on the rabbitmq container",
        out.len()
    );
    assert_eq!(ids, want, "each call once, as an OJS job");
    assert_eq!(local.depth("calls").await.unwrap(), Some(0));

    container.stop_with_timeout(Some(20)).await.unwrap();
    assert_eq!(
        container.exit_code().await.unwrap(),
        Some(0),
        "SIGTERM ends the image's daemon cleanly"
    );
    let logs = Command::new("docker").args(["logs", &id]).output().unwrap();
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&logs.stdout),
        String::from_utf8_lossy(&logs.stderr)
    );
    assert!(
        logs.contains("TRACE") && logs.contains("received a batch"),
        "the trace log was captured: {logs}"
    );
    assert!(
        !logs.contains("request-0"),
        "a call's payload is in the log: {logs}"
    );
    assert!(!logs.contains("guest:guest"), "a password is in the log");
}

/// `docker-compose`, or a skip (a failure when brokers are required).
fn compose_available() -> Option<()> {
    let ok = Command::new("docker-compose")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(())
    } else {
        missing(
            "docker-compose",
            "`scripts/containers.sh up` installs Debian's docker-compose",
        )
    }
}

/// A compose project of this test's own, taken down (with its volumes)
/// when dropped.
struct ComposeProject {
    name: String,
    env: BTreeMap<String, String>,
}

impl ComposeProject {
    fn run(&self, args: &[&str]) -> std::process::Output {
        let root = repository();
        Command::new("docker-compose")
            .current_dir(&root)
            .args(["--project-name", &self.name])
            .args(["-f", "docker-compose.yml", "-f", "docker/compose.ci.yml"])
            .args(args)
            .envs(&self.env)
            .output()
            .unwrap()
    }
}

impl Drop for ComposeProject {
    fn drop(&mut self) {
        let _ = self.run(&["down", "--volumes", "--timeout", "10"]);
    }
}

/// The compose file users run, validated as it is, then brought up with
/// the CI override (the images `scripts/containers.sh` built, host
/// networking, loopback ports of this test's): a grpcq call on the
/// RabbitMQ service comes out of the Kafka service as an OJS job, and one
/// on the SQS service out of the RabbitMQ service, as
/// `examples/docker-compose.toml` routes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_stack_brought_up_from_containers_carries_a_call_through_each_route() {
    if compose_available().is_none() {
        return;
    }
    let Some(bridge_image) = project_image(Path::new(env!("CARGO_BIN_EXE_ojs-bridge"))) else {
        return;
    };
    let mut env = BTreeMap::new();
    for var in [
        "OJS_BRIDGE_TEST_RABBITMQ_IMAGE",
        "OJS_BRIDGE_TEST_KAFKA_IMAGE",
        "OJS_BRIDGE_TEST_SQS_IMAGE",
    ] {
        let Ok(value) = std::env::var(var) else {
            missing::<()>(var, "`eval \"$(scripts/containers.sh env)\"` sets it");
            return;
        };
        env.insert(var.to_owned(), value);
    }
    // As users run it: the file validates with no override and no variable.
    let validated = Command::new("docker-compose")
        .current_dir(repository())
        .args(["-f", "docker-compose.yml", "config", "--quiet"])
        .output()
        .unwrap();
    assert!(
        validated.status.success(),
        "docker-compose.yml does not validate: {}",
        String::from_utf8_lossy(&validated.stderr)
    );

    let ports: Vec<u16> = (0..6).map(|_| free_port().unwrap()).collect();
    let (amqp, kafka, sqs, http) = (ports[0], ports[1], ports[2], ports[3]);
    // The example's routes with the services' addresses on this host.
    let example =
        std::fs::read_to_string(repository().join("examples/docker-compose.toml")).unwrap();
    let replaced = example
        .replace("rabbitmq:5672", &format!("127.0.0.1:{amqp}"))
        .replace("kafka:29092", &format!("127.0.0.1:{kafka}"))
        .replace("sqs:5000", &format!("127.0.0.1:{sqs}"));
    for service in ["rabbitmq:5672", "kafka:29092", "sqs:5000"] {
        assert!(
            example.contains(service),
            "examples/docker-compose.toml no longer names {service}"
        );
    }
    let dir = TempDir::new("compose");
    let config = dir.path().join("docker-compose.toml");
    std::fs::write(&config, replaced).unwrap();
    env.insert("OJS_BRIDGE_TEST_BRIDGE_IMAGE".into(), bridge_image);
    env.insert(
        "OJS_BRIDGE_COMPOSE_CONFIG".into(),
        config.to_string_lossy().into_owned(),
    );
    env.insert("OJS_BRIDGE_COMPOSE_AMQP_PORT".into(), amqp.to_string());
    env.insert("OJS_BRIDGE_COMPOSE_EPMD_PORT".into(), ports[4].to_string());
    env.insert("OJS_BRIDGE_COMPOSE_DIST_PORT".into(), ports[5].to_string());
    env.insert("OJS_BRIDGE_COMPOSE_KAFKA_PORT".into(), kafka.to_string());
    env.insert("OJS_BRIDGE_COMPOSE_SQS_PORT".into(), sqs.to_string());
    env.insert(
        "OJS_BRIDGE_COMPOSE_HTTP_LISTEN".into(),
        format!("127.0.0.1:{http}"),
    );
    let project = ComposeProject {
        name: unique_queue("ojscompose").replace(['-', '.'], ""),
        env,
    };
    let up = project.run(&["up", "--detach", "--no-build"]);
    assert!(
        up.status.success(),
        "docker-compose up failed: {}",
        String::from_utf8_lossy(&up.stderr)
    );
    let addr: SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    if let Err(last) = healthy(addr, Duration::from_secs(120)).await {
        let logs = project.run(&["logs", "--no-color"]);
        panic!(
            "the compose stack's bridge was not healthy within 120 s (last: {last}); logs:\n{}",
            String::from_utf8_lossy(&logs.stdout)
        );
    }

    let rabbit_url = format!("amqp://guest:guest@127.0.0.1:{amqp}/%2f");
    let sqs_url = format!("sqs://us-east-1?endpoint=http://127.0.0.1:{sqs}");
    let rabbit = RabbitAdapter::connect(RabbitConfig::new(&rabbit_url))
        .await
        .unwrap();
    let sqs_adapter = SqsAdapter::connect(SqsConfig::from_url(&sqs_url).unwrap())
        .await
        .unwrap();
    let kafka_adapter = KafkaAdapter::connect(ojs_bridge_tests::kafka::test_config(&format!(
        "kafka://127.0.0.1:{kafka}"
    )))
    .await
    .unwrap();

    let via_rabbit = call(1, "compose.RabbitService", "Carry");
    let via_sqs = call(2, "compose.SqsService", "Carry");
    rabbit
        .publish("grpcq-calls", vec![ojs_grpcq::outgoing(&via_rabbit)])
        .await
        .unwrap();
    sqs_adapter
        .publish("grpcq-calls", vec![ojs_grpcq::outgoing(&via_sqs)])
        .await
        .unwrap();

    let on_kafka = collect(
        &kafka_adapter,
        "jobs",
        Source::Queue,
        1,
        Duration::from_secs(60),
    )
    .await;
    let on_rabbit = collect(&rabbit, "jobs", Source::Queue, 1, Duration::from_secs(60)).await;
    println!(
        "compose stack: rabbitmq → kafka {} job(s), sqs → rabbitmq {} job(s)",
        on_kafka.len(),
        on_rabbit.len()
    );
    assert_eq!(on_kafka.len(), 1, "the call on RabbitMQ reached Kafka once");
    assert_eq!(on_rabbit.len(), 1, "the call on SQS reached RabbitMQ once");
    check_job(&on_kafka[0], &sent_calls(&[via_rabbit]));
    check_job(&on_rabbit[0], &sent_calls(&[via_sqs]));
}
