//! Dead letters through the OJS API, a thousand at a time: jobs whose
//! retries are exhausted are listed (paged, filtered by queue and type),
//! counted, retried (same id, attempt 0, fetched and completed again) and
//! deleted; two concurrent retries of one dead letter retry it once. On
//! the embedded default and on RabbitMQ, whose dead-letter queue is counted
//! with rabbitmqctl (it keeps the broker's copy of every dead letter).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ojs_bridge_tests::brokers::{find, rabbitmq_messages, unique_queue, Broker};
use serde_json::{json, Value};

use crate::ojs_server::{get, post_json, request, OjsServer};

const JOBS: usize = 1000;

async fn push(addr: SocketAddr, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for chunk in (0..JOBS).collect::<Vec<_>>().chunks(100) {
        let jobs: Vec<Value> = chunk
            .iter()
            .map(|i| {
                // Half of each type, so that the type filter has something
                // to tell apart.
                let kind = if i % 2 == 0 {
                    "alpha.doomed"
                } else {
                    "beta.doomed"
                };
                json!({"type": kind, "args": [i],
                       "options": {"queue": queue, "retry": {"max_attempts": 1, "on_exhaustion": "dead_letter"}}})
            })
            .collect();
        let a = post_json(addr, "/ojs/v1/jobs/batch", &json!({ "jobs": jobs })).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        for j in a.json()["jobs"].as_array().unwrap() {
            ids.push(j["id"].as_str().unwrap().to_owned());
        }
    }
    ids
}

/// Fetches and fails `n` jobs (each exhausted at its first attempt).
async fn fail_all(addr: SocketAddr, queue: &str, n: usize) {
    let mut failed = 0;
    // Generous: on SQS (moto) each dead letter is a send and a delete, and
    // CI runs other suites beside this one.
    let deadline = Instant::now() + Duration::from_secs(400);
    while failed < n && Instant::now() < deadline {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": [queue], "count": 100, "worker_id": "w", "wait_ms": 500}),
        )
        .await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        // Eight NACKs at a time, as eight worker threads would send them.
        let jobs = a.json()["jobs"].as_array().cloned().unwrap_or_default();
        for chunk in jobs.chunks(8) {
            let mut nacks = tokio::task::JoinSet::new();
            for job in chunk {
                let id = job["id"].as_str().unwrap().to_owned();
                nacks.spawn(async move {
                    post_json(
                        addr,
                        "/ojs/v1/workers/nack",
                        &json!({"job_id": id, "error": {"code": "upstream_gone", "message": "the upstream said no"}}),
                    )
                    .await
                });
            }
            while let Some(answer) = nacks.join_next().await {
                let n = answer.unwrap();
                assert_eq!(n.status, 200, "{:?}", n.body);
                assert_eq!(n.json()["state"], "discarded");
                failed += 1;
            }
        }
    }
    assert_eq!(failed, n, "every job fetched and failed");
}

/// Every dead letter of `queue` (with `extra` query items), page by page.
async fn list_all(addr: SocketAddr, queue: &str, extra: &str) -> (Vec<Value>, u64) {
    let mut out = Vec::new();
    let mut cursor = String::new();
    loop {
        let a = get(
            addr,
            &format!("/ojs/v1/dead-letter?queue={queue}&limit=300{extra}{cursor}"),
        )
        .await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let body = a.json();
        let total = body["pagination"]["total"].as_u64().unwrap();
        out.extend(body["jobs"].as_array().cloned().unwrap_or_default());
        match body["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={c}"),
            None => return (out, total),
        }
    }
}

async fn status_of(addr: SocketAddr, method: &str, path: &str) -> u16 {
    request(addr, method, path, &[], None).await.status
}

async fn a_thousand_dead_letters(
    config: Option<String>,
    what: &str,
    broker_count: impl Fn() -> Option<u64>,
) {
    let server = OjsServer::start(config.as_deref()).await;
    let addr = server.addr;
    let queue = "doomed";
    let sent = push(addr, queue).await;
    fail_all(addr, queue, sent.len()).await;

    // Listed, all of them once, newest first, with their errors.
    let (listed, total) = list_all(addr, queue, "").await;
    let ids: Vec<&str> = listed.iter().map(|j| j["id"].as_str().unwrap()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(total, JOBS as u64);
    assert_eq!(ids.len(), JOBS, "every dead letter listed once");
    assert_eq!(unique.len(), JOBS);
    assert!(sent.iter().all(|id| unique.contains(id.as_str())));
    assert_eq!(listed[0]["state"], "discarded");
    assert_eq!(
        listed[0]["errors"][0]["code"], "upstream_gone",
        "{}",
        listed[0]
    );
    let (alpha, alpha_total) = list_all(addr, queue, "&type=alpha.*").await;
    assert_eq!(alpha_total, (JOBS / 2) as u64);
    assert!(alpha.iter().all(|j| j["type"] == "alpha.doomed"));
    let stats = get(addr, "/ojs/v1/dead-letter/stats").await.json();
    assert_eq!(stats["by_queue"][queue], JOBS, "{stats}");
    assert_eq!(stats["by_error_type"]["upstream_gone"], JOBS, "{stats}");
    let on_broker = broker_count();
    println!(
        "{what}: sent {JOBS}, dead letters listed {}, on the broker's dead-letter queue {on_broker:?}",
        ids.len()
    );
    if let Some(n) = on_broker {
        assert_eq!(
            n, JOBS as u64,
            "the broker's dead-letter queue holds each once"
        );
    }

    // Two retries of one dead letter at once: one wins.
    let contested = alpha[0]["id"].as_str().unwrap().to_owned();
    let path = format!("/ojs/v1/dead-letter/{contested}/retry");
    let (x, y) = tokio::join!(
        status_of(addr, "POST", &path),
        status_of(addr, "POST", &path)
    );
    let mut statuses = [x, y];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 404], "two concurrent retries");

    // The other alpha ones are retried one by one; all go back to work.
    for job in &alpha[1..] {
        let id = job["id"].as_str().unwrap();
        let r = post_json(addr, &format!("/ojs/v1/dead-letter/{id}/retry"), &json!({})).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.json()["job"]["state"], "available");
        assert_eq!(r.json()["job"]["attempt"], 0);
    }
    let mut completed: BTreeMap<String, usize> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while completed.len() < alpha.len() && Instant::now() < deadline {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": [queue], "count": 100, "worker_id": "w2", "wait_ms": 500}),
        )
        .await;
        for job in a.json()["jobs"].as_array().cloned().unwrap_or_default() {
            let id = job["id"].as_str().unwrap().to_owned();
            assert_eq!(
                job["attempt"], 1,
                "a retried dead letter starts again: {job}"
            );
            let ack = post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id})).await;
            assert_eq!(ack.status, 200, "{:?}", ack.body);
            *completed.entry(id).or_default() += 1;
        }
    }
    let twice = completed.values().filter(|n| **n > 1).count();
    println!(
        "{what}: retried {}, completed {}, completed twice {twice}",
        alpha.len(),
        completed.len()
    );
    assert_eq!(
        completed.len(),
        alpha.len(),
        "every retried dead letter ran again"
    );
    assert_eq!(twice, 0);
    let (_, left) = list_all(addr, queue, "").await;
    assert_eq!(left, (JOBS / 2) as u64);

    // The rest are deleted: gone from the list and from INFO.
    let (beta, _) = list_all(addr, queue, "&type=beta.*").await;
    for job in &beta {
        let id = job["id"].as_str().unwrap();
        let d = request(
            addr,
            "DELETE",
            &format!("/ojs/v1/dead-letter/{id}"),
            &[],
            None,
        )
        .await;
        assert_eq!(d.status, 200, "{:?}", d.body);
        assert_eq!(d.json()["deleted"], true);
    }
    let (_, left) = list_all(addr, queue, "").await;
    println!("{what}: deleted {}, left {left}", beta.len());
    assert_eq!(left, 0);
    let id = beta[0]["id"].as_str().unwrap();
    assert_eq!(get(addr, &format!("/ojs/v1/jobs/{id}")).await.status, 404);
    assert_eq!(
        status_of(addr, "DELETE", &format!("/ojs/v1/dead-letter/{id}")).await,
        404
    );
    // Bad requests are named, and change nothing.
    let bad = get(addr, "/ojs/v1/dead-letter?limit=many").await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    assert_eq!(bad.json()["error"]["code"], "invalid_request");
    assert_eq!(
        status_of(addr, "POST", "/ojs/v1/dead-letter/no-such-job/retry").await,
        404
    );
    assert_eq!(status_of(addr, "POST", "/ojs/v1/dead-letter").await, 405);
    assert_eq!(
        status_of(addr, "GET", "/ojs/v1/dead-letter/a/b/c").await,
        404
    );
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_dead_letters_listed_retried_and_deleted_on_the_embedded_default() {
    a_thousand_dead_letters(None, "dead letters, embedded", || None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_dead_letters_listed_retried_and_deleted_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("dlq");
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{prefix}.{{queue}}\"\ndead_letter_queue_template = \"{prefix}.{{queue}}.dead\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    let dead_queue = format!("{prefix}.doomed.dead");
    let count = move || rabbitmq_messages(&dead_queue);
    a_thousand_dead_letters(Some(config), "dead letters, RabbitMQ", count).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_dead_letters_listed_retried_and_deleted_on_kafka() {
    let Some(kafka) = find(Broker::Kafka).await else {
        return;
    };
    let prefix = unique_queue("dlq");
    let config = format!(
        "[adapters.kafka]\nurl = \"{}\"\ntopic_template = \"{prefix}.{{queue}}\"\nretry_topic_template = \"{prefix}.{{queue}}.retry\"\ndead_topic_template = \"{prefix}.{{queue}}.dead\"\npartitions = 1\n\n[api]\nadapter = \"kafka\"\n",
        kafka.url
    );
    // Read by confluent-kafka with a group of its own: every record of
    // the dead topic, counted.
    let dead_topic = format!("{prefix}.doomed.dead");
    let count = move || {
        ojs_bridge_tests::independent::available()?;
        let group = unique_queue("dlq-reader");
        let records = ojs_bridge_tests::independent::lines(&[
            "kafka-consume",
            &dead_topic,
            "--group",
            &group,
            "--count",
            &(JOBS + 1).to_string(),
            "--timeout",
            "15",
        ])
        .unwrap();
        Some(records.len() as u64)
    };
    a_thousand_dead_letters(Some(config), "dead letters, Kafka", count).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_dead_letters_listed_retried_and_deleted_on_sqs() {
    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    let prefix = unique_queue("dlq");
    let config = format!(
        "[adapters.sqs]\nurl = \"{}\"\nprefix = \"{prefix}-\"\n\n[api]\nadapter = \"sqs\"\n",
        sqs.url
    );
    // Counted by boto3: the messages in the queue's dead-letter queue.
    let dead_queue = format!("{prefix}-doomed_dlq");
    let count = move || {
        ojs_bridge_tests::independent::available()?;
        let attrs = ojs_bridge_tests::independent::lines(&["sqs-count", &dead_queue]).unwrap();
        attrs[0]["ApproximateNumberOfMessages"]
            .as_str()
            .and_then(|n| n.parse().ok())
    };
    a_thousand_dead_letters(Some(config), "dead letters, SQS", count).await;
}

/// Runs `ojs-bridge dead-letters ARGS`; its NDJSON lines.
fn cli(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["dead-letters"];
    all.extend_from_slice(args);
    let out = crate::support::ojs_bridge(&all, b"");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "dead-letters {args:?}: {stderr}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// How a broker's own client counts what the CLI did, beside ojs-bridge.
struct BrokerCounts {
    /// Dead letters left on the queue's dead-letter destination.
    dead: Box<dyn Fn() -> Option<u64>>,
    /// Messages a retry put back on the queue (read before any FETCH).
    retried_onto_queue: Box<dyn Fn() -> Option<u64>>,
    /// Whether `retried_onto_queue` is the queue's depth (0 once the jobs
    /// are done); a Kafka topic keeps its records.
    drains: bool,
}

/// The server's store is the record of its dead letters and the broker's
/// copy follows it: listed through either path, the same set; retry or
/// purge on the broker leaves the server's copies alone (named, exit 1);
/// through the server, the broker's copies go too. Each step is checked
/// against the broker's own client and the server's list.
async fn the_cli_on_a_broker(what: &str, config: &str, broker_url: &str, counts: BrokerCounts) {
    let queue = "doomed";
    let dead = &counts.dead;
    let server = OjsServer::start(Some(config)).await;
    let addr = server.addr;
    let base = format!("http://{addr}");
    let mut ids = Vec::new();
    for i in 0..40 {
        let kind = if i % 2 == 0 {
            "alpha.doomed"
        } else {
            "beta.doomed"
        };
        let a = post_json(
            addr,
            "/ojs/v1/jobs",
            &json!({"type": kind, "args": [i], "options": {"queue": queue, "retry": {"max_attempts": 1, "on_exhaustion": "dead_letter"}}}),
        )
        .await;
        assert_eq!(a.status, 201);
        ids.push(a.json()["job"]["id"].as_str().unwrap().to_owned());
    }
    fail_all(addr, queue, 40).await;
    assert_eq!(
        dead(),
        Some(40),
        "{what}: the broker's dead letters after the failures"
    );
    let ids_of = |lines: &[Value]| -> BTreeSet<String> {
        lines
            .iter()
            .map(|l| l["id"].as_str().unwrap().to_owned())
            .collect()
    };
    // The same set through both paths, the broker's marked as the server's.
    let same_set = |step: &str| {
        let on_broker = cli(&["list", "--from", broker_url, "--queue", queue]);
        let on_server = cli(&["list", "--from", &base, "--queue", queue]);
        assert!(
            on_broker.iter().all(|l| l["record"] == "ojs-server"),
            "{what}, {step}: {on_broker:?}"
        );
        assert_eq!(ids_of(&on_broker), ids_of(&on_server), "{what}, {step}");
        ids_of(&on_server)
    };
    let listed = same_set("after the failures");
    assert_eq!(listed.len(), 40);
    assert!(ids.iter().all(|id| listed.contains(id)));
    assert_eq!(dead(), Some(40), "{what}: a list leaves every dead letter");

    // On the broker, without --force: left alone, named, nothing changes.
    let out = crate::support::ojs_bridge(
        &[
            "dead-letters",
            "retry",
            "--from",
            broker_url,
            "--queue",
            queue,
            "--all",
            "--type",
            "alpha.*",
        ],
        b"",
    );
    assert_eq!(out.status.code(), Some(1), "{what}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("20 selected") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(same_set("after a refused retry on the broker").len(), 40);

    // Through the server: the alpha ones back to the queue, and their
    // broker copies removed.
    let retried = cli(&[
        "retry", "--from", &base, "--queue", queue, "--all", "--type", "alpha.*",
    ]);
    assert_eq!(retried.len(), 20);
    swept(addr, 20).await;
    let on_dead = dead();
    println!("dead-letters, {what}: retried 20 through the server → broker dead letters {on_dead:?}, on the queue {:?}", (counts.retried_onto_queue)());
    assert_eq!(
        on_dead,
        Some(20),
        "{what}: the broker's copies follow a retry"
    );
    let left = same_set("after a retry through the server");
    assert!(left
        .iter()
        .all(|id| ids.iter().position(|i| i == id).is_some_and(|p| p % 2 == 1)));
    // Fetched from attempt 1, completed, no longer dead letters.
    let mut completed = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while completed.len() < 20 && Instant::now() < deadline {
        let a = post_json(
            addr,
            "/ojs/v1/workers/fetch",
            &json!({"queues": [queue], "count": 100, "wait_ms": 500}),
        )
        .await;
        for job in a.json()["jobs"].as_array().cloned().unwrap_or_default() {
            assert_eq!(job["type"], "alpha.doomed");
            assert_eq!(job["attempt"], 1, "{job}");
            let id = job["id"].as_str().unwrap().to_owned();
            assert_eq!(
                post_json(addr, "/ojs/v1/workers/ack", &json!({"job_id": id}))
                    .await
                    .status,
                200
            );
            assert!(
                completed.insert(id),
                "a retried dead letter handed out twice"
            );
        }
    }
    assert_eq!(completed.len(), 20);
    if counts.drains {
        assert_eq!((counts.retried_onto_queue)(), Some(0));
    }

    // The rest purged through the server: gone from the broker too.
    let purged = cli(&["purge", "--from", &base, "--queue", queue, "--all"]);
    assert_eq!(purged.len(), 20);
    assert!(purged.iter().all(|l| l["type"] == "beta.doomed"));
    swept(addr, 40).await;
    let on_dead = dead();
    println!(
        "dead-letters, {what}: purged 20 through the server → broker dead letters {on_dead:?}"
    );
    assert_eq!(
        on_dead,
        Some(0),
        "{what}: the broker's copies follow a purge"
    );
    assert!(same_set("after a purge through the server").is_empty());
    let (_, left) = list_all(addr, queue, "").await;
    assert_eq!(left, 0);
    // retry and purge name what they act on.
    let out = crate::support::ojs_bridge(
        &["dead-letters", "purge", "--from", &base, "--queue", queue],
        b"",
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "purge without --id or --all is a usage error"
    );
    server.stop();
}

/// Waits (at most a minute) until the server says it removed `removed`
/// broker copies of dead letters in all: the broker is counted after that,
/// not while the server's sweep reads it (on Kafka, a reader joining the
/// same group meanwhile would only see a rebalance).
async fn swept(addr: SocketAddr, removed: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = String::from_utf8_lossy(&get(addr, "/metrics").await.body).into_owned();
        let n = crate::support::metric(&text, "ojs_bridge_api_dead_letter_copies_removed_total");
        if n.is_some_and(|n| n >= removed as f64) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{removed} broker copies never removed: {n:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_retries_and_purges_dead_letters_on_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let prefix = unique_queue("dlq-cli");
    let settings = format!(
        "queue_template={prefix}.{{queue}}&dead_letter_queue_template={prefix}.{{queue}}.dead"
    );
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\nqueue_template = \"{prefix}.{{queue}}\"\ndead_letter_queue_template = \"{prefix}.{{queue}}.dead\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    let broker_url = with_settings(&rabbit.url, &settings);
    let (main, dead) = (format!("{prefix}.doomed"), format!("{prefix}.doomed.dead"));
    let counts = BrokerCounts {
        dead: Box::new(move || rabbitmq_messages(&dead)),
        retried_onto_queue: Box::new(move || rabbitmq_messages(&main)),
        drains: true,
    };
    the_cli_on_a_broker("RabbitMQ", &config, &broker_url, counts).await;
}

/// Kafka: the dead topic keeps every record, so what is left is what the
/// CLI's group has still to read (confluent-kafka in that group, committing
/// nothing); a retry appends to the queue's topic (its records counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_retries_and_purges_dead_letters_on_kafka() {
    let Some(kafka) = find(Broker::Kafka).await else {
        return;
    };
    ojs_bridge_tests::independent::available().expect("the independent clients");
    let prefix = unique_queue("dlq-cli");
    let settings = format!(
        "topic_template={prefix}.{{queue}}&retry_topic_template={prefix}.{{queue}}.retry&dead_topic_template={prefix}.{{queue}}.dead&partitions=1"
    );
    let config = format!(
        "[adapters.kafka]\nurl = \"{}\"\ntopic_template = \"{prefix}.{{queue}}\"\nretry_topic_template = \"{prefix}.{{queue}}.retry\"\ndead_topic_template = \"{prefix}.{{queue}}.dead\"\npartitions = 1\n\n[api]\nadapter = \"kafka\"\n",
        kafka.url
    );
    let broker_url = with_settings(&kafka.url, &settings);
    let records = |topic: &str, group: &str| -> Option<u64> {
        let read = ojs_bridge_tests::independent::lines(&[
            "kafka-consume",
            topic,
            "--group",
            group,
            "--count",
            "1000",
            "--timeout",
            "8",
            "--no-commit",
        ])
        .expect("confluent-kafka reads the topic");
        Some(read.len() as u64)
    };
    let (main, dead) = (format!("{prefix}.doomed"), format!("{prefix}.doomed.dead"));
    let counts = BrokerCounts {
        // The CLI (and the server's sweeps) read dead letters as
        // `ojs-bridge-dead-letters.TOPIC` (the template is this test's
        // own), which the adapter suffixes for its dead-letter readers.
        dead: Box::new({
            let group = format!("ojs-bridge-dead-letters.{main}.dead");
            move || records(&dead, &group)
        }),
        // The 40 pushed at the start, and what the retry appended.
        retried_onto_queue: Box::new(move || {
            records(&main, &unique_queue("dlq-cli-reader")).map(|n| n.saturating_sub(40))
        }),
        drains: false,
    };
    the_cli_on_a_broker("Kafka", &config, &broker_url, counts).await;
}

/// SQS: the redrive target and the queue, counted by boto3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_retries_and_purges_dead_letters_on_sqs() {
    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    ojs_bridge_tests::independent::available().expect("the independent clients");
    let prefix = unique_queue("dlq-cli");
    let config = format!(
        "[adapters.sqs]\nurl = \"{}\"\nprefix = \"{prefix}-\"\n\n[api]\nadapter = \"sqs\"\n",
        sqs.url
    );
    let broker_url = with_settings(&sqs.url, &format!("prefix={prefix}-"));
    let depth = |queue: String| -> Option<u64> {
        let attrs = ojs_bridge_tests::independent::lines(&["sqs-count", &queue])
            .expect("boto3 counts the queue");
        let number = |name: &str| -> Option<u64> { attrs[0][name].as_str()?.parse().ok() };
        Some(
            number("ApproximateNumberOfMessages")?
                + number("ApproximateNumberOfMessagesNotVisible")?,
        )
    };
    let (main, dead) = (format!("{prefix}-doomed"), format!("{prefix}-doomed_dlq"));
    let counts = BrokerCounts {
        dead: Box::new(move || depth(dead.clone())),
        retried_onto_queue: Box::new(move || depth(main.clone())),
        drains: true,
    };
    the_cli_on_a_broker("SQS", &config, &broker_url, counts).await;
}

/// `url` with adapter settings added to its query.
fn with_settings(url: &str, settings: &str) -> String {
    if url.contains('?') {
        format!("{url}&{settings}")
    } else {
        format!("{url}?{settings}")
    }
}

/// A NACK storm: 8 workers fail 400 jobs at once, half with an error the
/// jobs' policy lists in `non_retryable_errors` (dead letters at the first
/// attempt, never retried) and half retryable (tried again after the
/// backoff, up to `max_attempts`, then dead letters). Every job ends a dead
/// letter exactly once with the attempts its policy allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_storm_follows_each_jobs_retry_policy() {
    let server = OjsServer::start(None).await;
    let addr = server.addr;
    let queue = "storm";
    let mut ids = Vec::new();
    for chunk in (0..400).collect::<Vec<usize>>().chunks(100) {
        let jobs: Vec<Value> = chunk
            .iter()
            .map(|i| {
                json!({"type": if i % 2 == 0 { "storm.fatal" } else { "storm.flaky" }, "args": [i],
                       "options": {"queue": queue, "retry": {"max_attempts": 3, "initial_interval": "PT0.1S",
                                   "backoff_coefficient": 1.0, "non_retryable_errors": ["InvalidInput"],
                                   "on_exhaustion": "dead_letter"}}})
            })
            .collect();
        let a = post_json(addr, "/ojs/v1/jobs/batch", &json!({ "jobs": jobs })).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        ids.extend(
            a.json()["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|j| j["id"].as_str().unwrap().to_owned()),
        );
    }
    let nacks = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, Vec<u64>>::new()));
    let mut workers = Vec::new();
    for w in 0..8 {
        let nacks = nacks.clone();
        workers.push(tokio::spawn(async move {
            let mut idle = Instant::now();
            while idle.elapsed() < Duration::from_secs(3) {
                let a = post_json(
                    addr,
                    "/ojs/v1/workers/fetch",
                    &json!({"queues": [queue], "count": 20, "worker_id": format!("w{w}"), "wait_ms": 300}),
                )
                .await;
                let jobs = a.json()["jobs"].as_array().cloned().unwrap_or_default();
                if !jobs.is_empty() {
                    idle = Instant::now();
                }
                for job in jobs {
                    let id = job["id"].as_str().unwrap().to_owned();
                    let fatal = job["type"] == "storm.fatal";
                    let error = if fatal {
                        json!({"code": "invalid_input", "message": "bad", "details": {"error_class": "InvalidInput"}})
                    } else {
                        json!({"code": "flaky", "message": "try again", "retryable": true})
                    };
                    let n = post_json(addr, "/ojs/v1/workers/nack", &json!({"job_id": id, "error": error})).await;
                    assert_eq!(n.status, 200, "{:?}", n.body);
                    nacks.lock().unwrap().entry(id).or_default().push(job["attempt"].as_u64().unwrap());
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let nacks = nacks.lock().unwrap().clone();
    let (fatal_retried, flaky_wrong): (usize, usize) =
        ids.iter().enumerate().fold((0, 0), |(f, r), (i, id)| {
            let attempts = nacks.get(id).cloned().unwrap_or_default();
            if i % 2 == 0 {
                (f + usize::from(attempts != vec![1]), r)
            } else {
                (f, r + usize::from(attempts != vec![1, 2, 3]))
            }
        });
    let (_, dead) = list_all(addr, queue, "").await;
    println!(
        "NACK storm: 400 jobs, {} NACKs; non-retryable retried {fatal_retried}, retryable not tried 3 times {flaky_wrong}, dead letters {dead}",
        nacks.values().map(Vec::len).sum::<usize>()
    );
    assert_eq!(fatal_retried, 0, "a non-retryable error was retried");
    assert_eq!(
        flaky_wrong, 0,
        "a retryable job was not tried exactly 3 times"
    );
    assert_eq!(dead, 400, "every job a dead letter once");
    server.stop();
}
