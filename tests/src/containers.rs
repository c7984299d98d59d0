//! Brokers in containers of the suite's own: a RabbitMQ, a Kafka (tansu)
//! or an SQS (moto) started for one test and removed when it is dropped.
//!
//! By default the images are the ones `scripts/containers.sh up` builds
//! from Debian packages (`docker/*/Dockerfile`), named by
//! `OJS_BRIDGE_TEST_{RABBITMQ,KAFKA,SQS}_IMAGE` (`scripts/containers.sh env`
//! prints them), run with the host's network: an engine started with no
//! bridge maps no ports, so each container listens on free loopback ports
//! this module picks. With `OJS_BRIDGE_TEST_IMAGES=official` and the
//! `testcontainers` feature, the public images of testcontainers' modules
//! are used instead, with mapped ports, for machines that reach Docker Hub.
//!
//! No engine (neither `DOCKER_HOST` nor `/var/run/docker.sock`), or an
//! image that will not start: a skip, or a failure under
//! `OJS_BRIDGE_REQUIRE_BROKERS=1`.

use std::hash::{Hash, Hasher};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use testcontainers::core::WaitFor;
use testcontainers::runners::AsyncRunner;
use testcontainers::{GenericImage, ImageExt};

use crate::brokers::{missing, reachable, Broker};

/// How long a broker container may take to listen (RabbitMQ boots in 4–6 s
/// on an idle machine, tansu and moto in about one).
const STARTUP: Duration = Duration::from_secs(120);

/// A broker in a container of this test's own; removed when dropped.
pub struct BrokerContainer {
    /// The adapter URL that reaches it.
    pub url: String,
    /// The `host:port` it listens on.
    pub address: String,
    /// The image it runs (`name:tag`).
    pub image: String,
    id: String,
    _container: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for BrokerContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerContainer")
            .field("url", &self.url)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl BrokerContainer {
    /// The container's id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// Whether a Docker engine is configured here.
fn engine_configured() -> bool {
    std::env::var_os("DOCKER_HOST").is_some()
        || std::path::Path::new("/var/run/docker.sock").exists()
}

/// A free TCP port on 127.0.0.1 (free when asked: the container binds it
/// a moment later).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn listening(address: &str) -> anyhow::Result<()> {
    let until = Instant::now() + STARTUP;
    loop {
        let a = address.to_owned();
        if tokio::task::spawn_blocking(move || reachable(&a)).await? {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "nothing listened on {address} within {STARTUP:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn image_var(broker: Broker) -> &'static str {
    match broker {
        Broker::RabbitMq => "OJS_BRIDGE_TEST_RABBITMQ_IMAGE",
        Broker::Kafka => "OJS_BRIDGE_TEST_KAFKA_IMAGE",
        Broker::Sqs => "OJS_BRIDGE_TEST_SQS_IMAGE",
    }
}

/// Starts `broker` in a container of its own; `None` (a skip, or a panic
/// under `OJS_BRIDGE_REQUIRE_BROKERS=1`) when that cannot be done here.
pub async fn start(broker: Broker) -> Option<BrokerContainer> {
    if !engine_configured() {
        return missing(
            "a Docker engine",
            "neither DOCKER_HOST nor /var/run/docker.sock; `scripts/containers.sh up` starts one, `eval \"$(scripts/containers.sh env)\"` points the suites at it",
        );
    }
    if std::env::var("OJS_BRIDGE_TEST_IMAGES").is_ok_and(|v| v == "official") {
        return official(broker).await;
    }
    let Ok(image) = std::env::var(image_var(broker)) else {
        return missing(
            image_var(broker),
            "it names the broker image `scripts/containers.sh up` built (`eval \"$(scripts/containers.sh env)\"`), or set OJS_BRIDGE_TEST_IMAGES=official",
        );
    };
    match start_local(broker, &image).await {
        Ok(c) => Some(c),
        Err(e) => missing(&format!("a container of {image}"), &format!("{e:#}")),
    }
}

async fn start_local(broker: Broker, image: &str) -> anyhow::Result<BrokerContainer> {
    let (name, tag) = image.rsplit_once(':').unwrap_or((image, "latest"));
    let port = free_port()?;
    let base = GenericImage::new(name, tag).with_wait_for(WaitFor::Nothing);
    let (request, url) = match broker {
        Broker::RabbitMq => (
            base.with_network("host")
                .with_env_var("AMQP_PORT", port.to_string())
                .with_env_var("EPMD_PORT", free_port()?.to_string())
                .with_env_var("DIST_PORT", free_port()?.to_string()),
            format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        ),
        Broker::Kafka => (
            base.with_network("host")
                .with_env_var("KAFKA_PORT", port.to_string()),
            format!("kafka://127.0.0.1:{port}"),
        ),
        Broker::Sqs => (
            base.with_network("host")
                .with_env_var("SQS_PORT", port.to_string()),
            format!("sqs://us-east-1?endpoint=http://127.0.0.1:{port}"),
        ),
    };
    let container = request
        .with_startup_timeout(STARTUP)
        .start()
        .await
        .map_err(|e| anyhow::anyhow!("starting {image}: {e}"))?;
    let address = format!("127.0.0.1:{port}");
    listening(&address).await?;
    Ok(BrokerContainer {
        url,
        address,
        image: image.to_owned(),
        id: container.id().to_owned(),
        _container: Box::new(container),
    })
}

#[cfg(feature = "testcontainers")]
async fn official(broker: Broker) -> Option<BrokerContainer> {
    use testcontainers_modules::testcontainers::runners::AsyncRunner as _;
    async fn run<I: testcontainers_modules::testcontainers::Image + 'static>(
        image: I,
        port: u16,
    ) -> anyhow::Result<(Box<dyn std::any::Any + Send + Sync>, String, u16)> {
        let container = image.start().await?;
        let host_port = container.get_host_port_ipv4(port).await?;
        let id = container.id().to_owned();
        Ok((Box::new(container), id, host_port))
    }
    let started = match broker {
        Broker::RabbitMq => run(testcontainers_modules::rabbitmq::RabbitMq::default(), 5672)
            .await
            .map(|(c, i, p)| (c, i, p, format!("amqp://guest:guest@127.0.0.1:{p}/%2f"))),
        Broker::Kafka => run(
            testcontainers_modules::kafka::apache::Kafka::default(),
            testcontainers_modules::kafka::apache::KAFKA_PORT.as_u16(),
        )
        .await
        .map(|(c, i, p)| (c, i, p, format!("kafka://127.0.0.1:{p}"))),
        Broker::Sqs => run(
            testcontainers_modules::localstack::LocalStack::default(),
            4566,
        )
        .await
        .map(|(c, i, p)| {
            (
                c,
                i,
                p,
                format!("sqs://us-east-1?endpoint=http://127.0.0.1:{p}"),
            )
        }),
    };
    match started {
        Ok((container, id, port, url)) => Some(BrokerContainer {
            url,
            address: format!("127.0.0.1:{port}"),
            image: "testcontainers-modules' default".to_owned(),
            id,
            _container: container,
        }),
        Err(e) => missing("an official broker image", &format!("{e:#}")),
    }
}

#[cfg(not(feature = "testcontainers"))]
async fn official(_broker: Broker) -> Option<BrokerContainer> {
    missing(
        "the official broker images",
        "OJS_BRIDGE_TEST_IMAGES=official needs the `testcontainers` feature of ojs-bridge-tests",
    )
}

/// Runs `docker ARGS` (the engine `DOCKER_HOST` names); its stdout, or an
/// error carrying its stderr.
pub fn docker(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("docker")
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("running docker {args:?}: {e}"))?;
    anyhow::ensure!(
        out.status.success(),
        "docker {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The project's image as the Dockerfile makes it: its runtime stage
/// (`OJS_BRIDGE_TEST_RUNTIME_IMAGE`, which `scripts/containers.sh up` builds
/// on the local Debian base) with `binary`, the `ojs-bridge` cargo built for
/// this run, added the way the Dockerfile's last stage adds it. Tagged by
/// the binary's content, so a run builds it once. `None` (a skip, or a
/// panic under `OJS_BRIDGE_REQUIRE_BROKERS=1`) when that cannot be done here.
pub fn project_image(binary: &Path) -> Option<String> {
    if !engine_configured() {
        return missing(
            "a Docker engine",
            "neither DOCKER_HOST nor /var/run/docker.sock; `scripts/containers.sh up` starts one",
        );
    }
    let Ok(runtime) = std::env::var("OJS_BRIDGE_TEST_RUNTIME_IMAGE") else {
        return missing(
            "OJS_BRIDGE_TEST_RUNTIME_IMAGE",
            "it names the Dockerfile's runtime stage `scripts/containers.sh up` built (`eval \"$(scripts/containers.sh env)\"`)",
        );
    };
    match build_project_image(&runtime, binary) {
        Ok(image) => Some(image),
        Err(e) => missing("the project's image", &format!("{e:#}")),
    }
}

fn build_project_image(runtime: &str, binary: &Path) -> anyhow::Result<String> {
    let bytes =
        std::fs::read(binary).map_err(|e| anyhow::anyhow!("reading {}: {e}", binary.display()))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    runtime.hash(&mut hasher);
    bytes.hash(&mut hasher);
    let image = format!("ojs-bridge-test/ojs-bridge:{:016x}", hasher.finish());
    if docker(&["image", "inspect", "--format", "{{.Id}}", &image]).is_ok() {
        return Ok(image);
    }
    let context = crate::tempdir::TempDir::new("image-context");
    std::fs::write(context.path().join("ojs-bridge"), &bytes)?;
    std::fs::set_permissions(
        context.path().join("ojs-bridge"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    std::fs::write(
        context.path().join("Dockerfile"),
        "ARG RUNTIME\nFROM ${RUNTIME}\nCOPY ojs-bridge /usr/local/bin/ojs-bridge\n",
    )?;
    let context_path = context.path().to_string_lossy().into_owned();
    docker(&[
        "build",
        "--quiet",
        "--network",
        "host",
        "--build-arg",
        &format!("RUNTIME={runtime}"),
        "-t",
        &image,
        &context_path,
    ])?;
    // Images of earlier binaries go (one still in use stays, refused).
    if let Ok(tags) = docker(&[
        "image",
        "ls",
        "--format",
        "{{.Repository}}:{{.Tag}}",
        "ojs-bridge-test/ojs-bridge",
    ]) {
        for old in tags.lines().filter(|t| *t != image) {
            let _ = docker(&["rmi", old]);
        }
    }
    Ok(image)
}
