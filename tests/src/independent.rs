//! Independent clients: `tests/scripts/independent.py` drives pika, boto3
//! and confluent-kafka, so resources and records the suites start from are
//! made the way other teams' tools make them, never by our adapters.
//!
//! The interpreter is `OJS_BRIDGE_TEST_PYTHON` (`scripts/brokers.sh env`
//! points it at the venv where `brokers.sh up` installed the clients).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::brokers::missing;

fn python() -> String {
    std::env::var("OJS_BRIDGE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/independent.py")
}

/// Whether the independent clients can run here; reports them missing
/// (a failure under `OJS_BRIDGE_REQUIRE_BROKERS=1`) otherwise.
pub fn available() -> Option<()> {
    let ok = Command::new(python())
        .args(["-c", "import pika, boto3, confluent_kafka"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(())
    } else {
        missing(
            "independent clients (pika, boto3, confluent-kafka)",
            "set OJS_BRIDGE_TEST_PYTHON to a python with them (scripts/brokers.sh up installs them)",
        )
    }
}

/// Runs one command of the script; its stdout.
pub fn run(args: &[&str]) -> Result<String> {
    run_at(None, args)
}

/// [`run`] against the broker at `at` (an adapter URL).
pub fn run_at(at: Option<&str>, args: &[&str]) -> Result<String> {
    let out = client(at)
        .args(args)
        .output()
        .with_context(|| format!("running {} {args:?}", python()))?;
    if !out.status.success() {
        bail!(
            "independent client {args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Each line of a command's output as JSON.
pub fn lines(args: &[&str]) -> Result<Vec<serde_json::Value>> {
    run(args)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("not JSON: {l}")))
        .collect()
}

/// The client script, talking to the broker at `at` (an adapter URL) or,
/// without one, to those the suites' environment names.
fn client(at: Option<&str>) -> Command {
    let mut command = Command::new(python());
    command.arg(script());
    if let Some(url) = at {
        let var = if url.starts_with("amqp") {
            "OJS_BRIDGE_TEST_AMQP_URL"
        } else if url.starts_with("kafka") {
            "OJS_BRIDGE_TEST_KAFKA_URL"
        } else {
            "OJS_BRIDGE_TEST_SQS_URL"
        };
        command.env(var, url);
    }
    command
}

/// Whether RabbitMQ has queue (or, with `exchange`, exchange) `name`.
pub fn rabbit_exists(name: &str, exchange: bool) -> Result<bool> {
    rabbit_exists_at(None, name, exchange)
}

/// [`rabbit_exists`] on the RabbitMQ at `at`.
pub fn rabbit_exists_at(at: Option<&str>, name: &str, exchange: bool) -> Result<bool> {
    let mut args = vec!["rabbit-exists", name];
    if exchange {
        args.push("--exchange");
    }
    let out = client(at).args(&args).output()?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(3) => Ok(false),
        _ => bail!(
            "rabbit-exists failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Kafka topics whose names start with `prefix`, as the broker lists them.
pub fn kafka_topics(prefix: &str) -> Result<Vec<String>> {
    kafka_topics_at(None, prefix)
}

/// [`kafka_topics`] of the Kafka at `at`.
pub fn kafka_topics_at(at: Option<&str>, prefix: &str) -> Result<Vec<String>> {
    Ok(serde_json::from_str(&run_at(
        at,
        &["kafka-list", "--prefix", prefix],
    )?)?)
}

/// SQS queues whose names start with `prefix`.
pub fn sqs_queues(prefix: &str) -> Result<Vec<String>> {
    sqs_queues_at(None, prefix)
}

/// [`sqs_queues`] of the SQS at `at`.
pub fn sqs_queues_at(at: Option<&str>, prefix: &str) -> Result<Vec<String>> {
    Ok(serde_json::from_str(&run_at(
        at,
        &["sqs-list", "--prefix", prefix],
    )?)?)
}
