//! Where the brokers are, and what to do when one is missing.
//!
//! Endpoints come from environment variables with loopback defaults
//! (`scripts/brokers.sh env` prints them). When `OJS_BRIDGE_REQUIRE_BROKERS=1`
//! (CI sets it) a missing broker fails the test; otherwise the test prints why
//! it skipped and returns.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Whether missing brokers must fail the run.
pub fn brokers_required() -> bool {
    std::env::var("OJS_BRIDGE_REQUIRE_BROKERS").is_ok_and(|v| v == "1")
}

/// Whether something listens on `host:port` (a quick TCP connect).
pub fn reachable(host_port: &str) -> bool {
    let addrs: Vec<SocketAddr> = match host_port.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(_) => return false,
    };
    addrs
        .iter()
        .any(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).is_ok())
}

/// Reports a missing broker: panics when brokers are required, otherwise
/// prints the reason and returns `None` so the caller can skip.
pub fn missing<T>(what: &str, reason: &str) -> Option<T> {
    if brokers_required() {
        panic!("{what} is required (OJS_BRIDGE_REQUIRE_BROKERS=1) but unavailable: {reason}");
    }
    println!("SKIPPED: {what} unavailable ({reason}); start it with `scripts/brokers.sh up` or set OJS_BRIDGE_REQUIRE_BROKERS=1 to fail instead");
    None
}

/// Runs `rabbitmqctl ARGS` against the node the suites use
/// (`OJS_BRIDGE_TEST_RABBITMQCTL`, which `scripts/brokers.sh env` sets);
/// whether it succeeded.
pub fn rabbitmqctl(args: &[&str]) -> bool {
    rabbitmqctl_output(args).is_some()
}

/// Gives RabbitMQ `user` read and write on every resource of `/` and no
/// `configure` at all: a user that can declare nothing, as other teams
/// hand out. Whether rabbitmqctl did it.
pub fn rabbitmq_may_not_configure(user: &str) -> bool {
    rabbitmqctl(&["set_permissions", "-p", "/", user, "^$", ".*", ".*"])
}

/// Messages RabbitMQ holds in the queue named `name` (ready and
/// unacknowledged), counted by `rabbitmqctl`: a count no client of the
/// bridge takes part in. `None` when the queue or `rabbitmqctl` is missing.
pub fn rabbitmq_messages(name: &str) -> Option<u64> {
    let out = rabbitmqctl_output(&[
        "list_queues",
        "-q",
        "--no-table-headers",
        "name",
        "messages",
    ])?;
    out.lines().find_map(|l| {
        let mut parts = l.split_whitespace();
        (parts.next() == Some(name))
            .then(|| parts.next()?.parse().ok())
            .flatten()
    })
}

/// [`rabbitmqctl`], returning what it printed when it succeeded.
pub fn rabbitmqctl_output(args: &[&str]) -> Option<String> {
    let command =
        std::env::var("OJS_BRIDGE_TEST_RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut parts = command.split_whitespace();
    let program = parts.next()?;
    let out = std::process::Command::new(program)
        .args(parts)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A RabbitMQ memory alarm for as long as it lives: the node's memory high
/// watermark set near zero, restored on drop (a panicking test too).
#[derive(Debug)]
pub struct MemoryAlarm {
    restore: String,
}

impl MemoryAlarm {
    /// Raises the alarm; `None` when `rabbitmqctl` cannot.
    pub fn raise() -> Option<MemoryAlarm> {
        let current =
            rabbitmqctl_output(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."])?;
        let restore = current.trim().to_owned();
        // A fraction, or {absolute, N} on nodes configured that way.
        restore.parse::<f64>().ok()?;
        rabbitmqctl(&["set_vm_memory_high_watermark", "0.00001"]).then_some(MemoryAlarm { restore })
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", &self.restore]);
    }
}

/// A fresh, valid OJS queue name for one test.
pub fn unique_queue(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &id[..12])
}

/// A broker endpoint for a suite, and whatever keeps it alive.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The URL adapters connect to (`amqp://…`, `kafka://…`, `sqs://…`).
    pub url: String,
}

/// Which broker a suite needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// RabbitMQ: `OJS_BRIDGE_TEST_AMQP_URL`.
    RabbitMq,
    /// Kafka: `OJS_BRIDGE_TEST_KAFKA_URL`.
    Kafka,
    /// SQS: `OJS_BRIDGE_TEST_SQS_URL`.
    Sqs,
}

impl Broker {
    fn var(self) -> &'static str {
        match self {
            Broker::RabbitMq => "OJS_BRIDGE_TEST_AMQP_URL",
            Broker::Kafka => "OJS_BRIDGE_TEST_KAFKA_URL",
            Broker::Sqs => "OJS_BRIDGE_TEST_SQS_URL",
        }
    }

    fn default_url(self) -> &'static str {
        match self {
            Broker::RabbitMq => "amqp://guest:guest@127.0.0.1:5672/%2f",
            Broker::Kafka => "kafka://127.0.0.1:9092",
            Broker::Sqs => "sqs://us-east-1?endpoint=http://127.0.0.1:4566",
        }
    }
}

/// `host:port` to probe for a broker URL.
pub fn probe_address(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    if let Some((_, endpoint)) = rest.split_once("endpoint=") {
        // sqs://REGION?endpoint=http://host:port
        let endpoint = endpoint.split('&').next().unwrap_or(endpoint);
        return probe_address(endpoint);
    }
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    // kafka://a:9092,b:9092 — the first bootstrap server is enough to probe.
    host_port.split(',').next().unwrap_or(host_port).to_owned()
}

/// Finds `broker`: its environment variable, else the loopback default;
/// else, with the `testcontainers` feature and a Docker engine, a container;
/// else a skip (or a failure under `OJS_BRIDGE_REQUIRE_BROKERS=1`).
pub async fn find(broker: Broker) -> Option<Endpoint> {
    let explicit = std::env::var(broker.var()).ok();
    let url = explicit
        .clone()
        .unwrap_or_else(|| broker.default_url().to_owned());
    if reachable(&probe_address(&url)) {
        return Some(Endpoint { url });
    }
    if explicit.is_none() {
        #[cfg(feature = "testcontainers")]
        if let Some(endpoint) = in_a_container(broker).await {
            return Some(endpoint);
        }
    }
    missing(
        broker.var(),
        &format!("nothing listens on {} (from {url})", probe_address(&url)),
    )
}

/// One container per broker and test process, started the first time a
/// suite finds nothing listening (the `testcontainers` feature); it lives
/// as long as the process.
#[cfg(feature = "testcontainers")]
async fn in_a_container(broker: Broker) -> Option<Endpoint> {
    use tokio::sync::OnceCell;
    static RABBITMQ: OnceCell<Option<crate::containers::BrokerContainer>> = OnceCell::const_new();
    static KAFKA: OnceCell<Option<crate::containers::BrokerContainer>> = OnceCell::const_new();
    static SQS: OnceCell<Option<crate::containers::BrokerContainer>> = OnceCell::const_new();
    let cell = match broker {
        Broker::RabbitMq => &RABBITMQ,
        Broker::Kafka => &KAFKA,
        Broker::Sqs => &SQS,
    };
    cell.get_or_init(|| crate::containers::start(broker))
        .await
        .as_ref()
        .map(|c| Endpoint { url: c.url.clone() })
}

/// The command that restarts `broker` (`OJS_BRIDGE_TEST_RABBITMQ_BOUNCE`,
/// `OJS_BRIDGE_TEST_KAFKA_BOUNCE`; `scripts/brokers.sh env` sets them), or a
/// skip (a failure under `OJS_BRIDGE_REQUIRE_BROKERS=1`).
pub fn bounce_command(broker: Broker) -> Option<String> {
    let var = match broker {
        Broker::RabbitMq => "OJS_BRIDGE_TEST_RABBITMQ_BOUNCE",
        Broker::Kafka => "OJS_BRIDGE_TEST_KAFKA_BOUNCE",
        Broker::Sqs => return missing("a bounce command for SQS", "no test restarts SQS"),
    };
    match std::env::var(var) {
        Ok(command) => Some(command),
        Err(_) => missing(var, "it must name a command that restarts the broker"),
    }
}

/// Runs a bounce command in the background: the broker is down for about
/// `down_secs` (`None`: the command's default); the handle says whether the
/// command succeeded.
pub fn bounce(command: &str, down_secs: Option<u64>) -> tokio::task::JoinHandle<bool> {
    let command = match down_secs {
        Some(s) => format!("{command} {s}"),
        None => command.to_owned(),
    };
    // A bounce that does not finish in this time failed: a hung broker tool
    // must fail the test that asked for it, not hang the suite.
    let limit = Duration::from_secs(down_secs.unwrap_or(2) + 180);
    tokio::spawn(async move {
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&command)
            .kill_on_drop(true)
            .status();
        match tokio::time::timeout(limit, status).await {
            Ok(status) => status.is_ok_and(|s| s.success()),
            Err(_) => {
                eprintln!("the bounce command {command:?} did not finish in {limit:?}");
                false
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::probe_address;

    #[test]
    fn probe_addresses_come_from_each_url_form() {
        assert_eq!(
            probe_address("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "127.0.0.1:5672"
        );
        assert_eq!(
            probe_address("kafka://127.0.0.1:9092,127.0.0.1:9093?x=y"),
            "127.0.0.1:9092"
        );
        assert_eq!(
            probe_address("sqs://us-east-1?endpoint=http://127.0.0.1:4566&prefix=t-"),
            "127.0.0.1:4566"
        );
    }
}
