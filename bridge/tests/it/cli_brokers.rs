//! `ojs-bridge send` and `tail` against real brokers, as a user runs them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use serde_json::Value;

use crate::support::ojs_bridge as run;

/// `patience_secs`: how long a `tail` may wait for its first message; Kafka
/// consumers first join their group, which takes seconds on a loaded machine.
fn send_then_tail(url: &str, queue: &str, patience_secs: u64) {
    let patience = patience_secs.to_string();
    // Long enough for an empty read to mean "empty", not "not joined yet".
    let quiet = (patience_secs / 3).max(1).to_string();
    let ojs = r#"{"specversion":"1.0","id":"019539a4-b68c-7def-8000-1a2b3c4d5e6f","type":"email.send","queue":"default","args":["a@b.c"]}"#;
    let grpcq = r#"{"originator":"cli-test","topic":"payment.PaymentService","action":"ProcessPayment","payload":"AQID","message_id":"m-1","timestamp_ms":1704067200000,"metadata":{"trace_id":"t"}}"#;
    let out = run(
        &["send", "--to", url, "--queue", queue],
        format!("{ojs}\n").as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "sent 1");
    let out = run(
        &["send", "--to", url, "--queue", queue, "--format", "grpcq"],
        format!("{grpcq}\n").as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = run(
        &[
            "tail",
            "--from",
            url,
            "--queue",
            queue,
            "--count",
            "2",
            "--timeout-secs",
            &patience,
            "--ack",
        ],
        b"",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    // Two keys may land on two partitions (Kafka): order is per key only.
    let (ojs_line, grpcq_line) = if lines[0]["message"]["type"].is_string() {
        (&lines[0], &lines[1])
    } else {
        (&lines[1], &lines[0])
    };
    let lines = [ojs_line.clone(), grpcq_line.clone()];
    assert_eq!(lines[0]["message"]["type"], "email.send");
    assert_eq!(
        lines[0]["message"]["queue"], queue,
        "--queue overrides the envelope's queue"
    );
    assert_eq!(
        lines[0]["headers"]["content-type"],
        "application/openjobspec+proto"
    );
    assert_eq!(lines[1]["message"]["action"], "ProcessPayment");
    assert_eq!(lines[1]["message"]["payload"], "AQID");
    assert_eq!(lines[1]["message"]["metadata"]["trace_id"], "t");
    assert_eq!(
        lines[1]["headers"]["content-type"],
        "application/grpcq+proto"
    );

    // Acked: nothing left.
    let out = run(
        &[
            "tail",
            "--from",
            url,
            "--queue",
            queue,
            "--timeout-secs",
            &quiet,
        ],
        b"",
    );
    assert!(out.status.success());
    assert!(out.stdout.is_empty(), "queue drained by --ack");

    // A bad line names itself and nothing is sent.
    let out = run(
        &["send", "--to", url, "--queue", queue],
        format!("{ojs}\n{{\"type\":1}}\n").as_bytes(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    let out = run(
        &[
            "tail",
            "--from",
            url,
            "--queue",
            queue,
            "--timeout-secs",
            &quiet,
        ],
        b"",
    );
    assert!(
        out.stdout.is_empty(),
        "all-or-nothing parse: line 1 was not sent either"
    );
}

#[tokio::test]
async fn send_and_tail_over_rabbitmq() {
    let Some(endpoint) = find(Broker::RabbitMq).await else {
        return;
    };
    send_then_tail(&endpoint.url, &unique_queue("cli"), 10);
}

#[tokio::test]
async fn send_and_tail_over_kafka() {
    let Some(endpoint) = find(Broker::Kafka).await else {
        return;
    };
    // A 2 s timeout, default sessions: the group join is not counted in it.
    send_then_tail(&endpoint.url, &unique_queue("cli"), 2);
}

/// `tail` on Kafka with a short timeout and a group of one's own, twice:
/// each prints the record (the join is not counted in the timeout), and
/// the first, leaving without `--ack`, neither commits nor keeps the second
/// from its partitions.
#[tokio::test]
async fn tail_on_kafka_twice_in_one_group_with_a_short_timeout() {
    let Some(endpoint) = find(Broker::Kafka).await else {
        return;
    };
    let queue = unique_queue("tail");
    let url = format!("{}?topic_template={{queue}}", endpoint.url);
    let ojs = r#"{"specversion":"1.0","id":"019539a4-b68c-7def-8000-1a2b3c4d5e70","type":"email.send","queue":"default","args":["a@b.c"]}"#;
    let out = run(
        &["send", "--to", &url, "--queue", &queue],
        format!("{ojs}\n").as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let group = unique_queue("group");
    for round in 1..=2 {
        let started = std::time::Instant::now();
        let out = run(
            &[
                "tail",
                "--from",
                &url,
                "--queue",
                &queue,
                "--timeout-secs",
                "2",
                "--group",
                &group,
            ],
            b"",
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines = String::from_utf8_lossy(&out.stdout).lines().count();
        println!(
            "tail on Kafka, round {round}: {lines} line(s) in {:?}",
            started.elapsed()
        );
        assert_eq!(
            lines,
            1,
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test]
async fn send_and_tail_over_sqs() {
    let Some(endpoint) = find(Broker::Sqs).await else {
        return;
    };
    send_then_tail(&endpoint.url, &unique_queue("cli"), 10);
}

#[test]
fn send_and_tail_over_the_embedded_broker() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("cli-local");
    send_then_tail(&format!("local:{}", dir.path().display()), "cli", 10);
}

#[test]
fn an_unknown_url_scheme_is_a_clear_error() {
    let out = run(&["tail", "--from", "redis://x", "--queue", "q"], b"");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("names no adapter") && err.contains("local:"),
        "{err}"
    );
}
