//! The official OJS conformance cases (`../shared/conformance/ojs-conformance`,
//! unchanged from the OJS project) replayed against a real `ojs-bridge run`
//! process over HTTP: on the embedded default and with `[api] adapter` on
//! RabbitMQ, Kafka and SQS, and on two replicas sharing PostgreSQL. Each
//! case runs as written against a fresh server (fresh replicas, fresh queues)
//! of its own: nothing is renamed, drained or reset inside a case. Each run
//! prints `N passed, N failed` per folder and the cases it skips with the
//! reason; every level-0 case must pass.
//!
//! The case format (steps, templates, matchers) is described in the
//! README of that folder; [`replay`] implements it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ojs_bridge_tests::brokers::{find, missing, Broker};
use serde_json::{json, Value};

use crate::ojs_server::{request, OjsServer};

/// The servers a run talks to: one, or replicas of one OJS server, each
/// request sent to one of them chosen at random (the seed is printed, so
/// that a failing order can be replayed with `OJS_CONFORMANCE_SEED`).
struct Servers {
    addrs: Vec<std::net::SocketAddr>,
    state: std::sync::atomic::AtomicU64,
    seed: u64,
}

impl Servers {
    fn new(servers: &[&OjsServer]) -> Servers {
        let seed = std::env::var("OJS_CONFORMANCE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
                    | 1
            });
        Servers {
            addrs: servers.iter().map(|s| s.addr).collect(),
            state: std::sync::atomic::AtomicU64::new(seed),
            seed,
        }
    }

    /// The next server (xorshift64).
    fn pick(&self) -> std::net::SocketAddr {
        use std::sync::atomic::Ordering;
        let mut x = self.state.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state.store(x, Ordering::Relaxed);
        self.addrs[(x % self.addrs.len() as u64) as usize]
    }
}

fn cases_dir() -> Option<PathBuf> {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance/ojs-conformance");
    if dir.join("level-0-core").is_dir() {
        Some(dir)
    } else {
        missing(
            "the OJS conformance cases",
            "../shared/conformance/ojs-conformance is not there",
        )
    }
}

/// One case file.
struct Case {
    folder: String,
    file: String,
    case: Value,
}

fn load_cases(dir: &Path) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut folders: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.path())
        .collect();
    folders.sort();
    for folder in folders {
        let mut files = Vec::new();
        collect_json(&folder, &mut files);
        files.sort();
        for file in files {
            let case: Value = serde_json::from_slice(&std::fs::read(&file).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            cases.push(Case {
                folder: folder.file_name().unwrap().to_string_lossy().into_owned(),
                file: file.strip_prefix(dir).unwrap().display().to_string(),
                case,
            });
        }
    }
    cases
}

fn collect_json(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let p = entry.path();
        if p.is_dir() {
            collect_json(&p, out);
        } else if p.extension().is_some_and(|e| e == "json") {
            out.push(p);
        }
    }
}

/// Cases that contradict the documents or other cases, and why.
const INCONSISTENT: &[(&str, &str)] = &[
    (
        "retry-error-history-tracked",
        "it expects error types (ConnectionTimeout, …) that its NACK bodies never send",
    ),
    (
        "retry-validation-invalid-coefficient",
        "it expects 422 for a schema violation, where the level-0 cases and the binding expect 400",
    ),
    (
        "worker-quiet-signal",
        "it drives the quiet directive through options.metadata.test_directive, a test hook outside the schema; operators direct workers through /ojs/v1/admin/workers/{id}/quiet (ojs_api_worker tests it)",
    ),
    (
        "worker-graceful-shutdown",
        "it drives the terminate directive through options.metadata.test_directive, a test hook outside the schema; operators direct workers through /ojs/v1/admin/workers/{id}/terminate (ojs_api_worker tests it)",
    ),
    (
        "retry-validation-invalid-max-attempts",
        "it expects 422 for a schema violation, where the level-0 cases and the binding expect 400",
    ),
];

/// Why a case is not run here, if it is not.
fn skip_reason(case: &Value) -> Option<&'static str> {
    let steps = case["steps"].as_array()?;
    let name = case["test_id"].as_str().unwrap_or("").to_ascii_lowercase();
    for (id, why) in INCONSISTENT {
        if name.contains(id) || case["name"].as_str().is_some_and(|n| n.contains(id)) {
            return Some(why);
        }
    }
    for step in steps {
        let body = &step["body"];
        let pushes = step["path"].as_str().is_some_and(|p| p.ends_with("/jobs"));
        if pushes && !body["options"]["metadata"].is_null() {
            return Some("it sends options.metadata, which the official JSON schema does not have");
        }
        if pushes && !body["options"]["retry"]["backoff_strategy"].is_null() {
            return Some(
                "it sends retry.backoff_strategy, which the official JSON schema does not have",
            );
        }
    }
    if case.to_string().contains("{{job_id}}") {
        return Some("its steps name {{job_id}}, which no step of the case defines");
    }
    None
}

/// The whole report of one run.
#[derive(Default)]
struct Report {
    /// folder → (passed, failed, skipped)
    folders: BTreeMap<String, (usize, usize, usize)>,
    failures: Vec<(String, String)>,
    skipped: Vec<(String, &'static str)>,
}

/// What each case runs against: a fresh server (or a fresh pair of
/// replicas) of its own, so that no case meets what another left behind.
/// On a broker, each case's queues live under a prefix of its own: the
/// run's prefix and the case's number.
enum Backend {
    /// The built-in default: the embedded broker and SQLite, in a fresh
    /// directory.
    Embedded,
    /// `[api] adapter` on a broker; the adapter's settings for a prefix.
    Broker {
        broker: Broker,
        url: String,
        settings: fn(&str, &str) -> String,
        run: String,
    },
    /// Two replicas sharing a fresh PostgreSQL schema, over RabbitMQ.
    Replicas {
        rabbit: String,
        postgres: String,
        run: String,
    },
}

impl Backend {
    /// Why a case cannot pass on this backend's broker, if it cannot: the
    /// broker does not do what the case asserts (the case is skipped there
    /// with this reason, and runs everywhere else).
    fn cannot_run(&self, case: &Value) -> Option<&'static str> {
        let orders = match self {
            Backend::Broker {
                broker: Broker::Kafka,
                ..
            } => Some(
                "Kafka does not order a queue's jobs by priority (a topic's partitions are logs)",
            ),
            Backend::Broker {
                broker: Broker::Sqs,
                ..
            } => Some("SQS does not order a queue's jobs by priority"),
            _ => None,
        }?;
        // A case that pushes jobs of different priorities and fetches them
        // expects the highest first.
        let steps = case["steps"].as_array().into_iter().flatten();
        let priorities: std::collections::BTreeSet<i64> = steps
            .clone()
            .filter(|s| s["path"].as_str().is_some_and(|p| p.ends_with("/jobs")))
            .filter_map(|s| s["body"]["options"]["priority"].as_i64())
            .collect();
        let fetches = steps
            .filter(|s| {
                s["path"]
                    .as_str()
                    .is_some_and(|p| p.ends_with("/workers/fetch"))
            })
            .count();
        (priorities.len() > 1 && fetches > 1).then_some(orders)
    }
}

/// The servers of one case, and the schema they share (dropped after).
struct CaseServers {
    servers: Vec<OjsServer>,
    _schema: Option<ojs_bridge_tests::postgres::TestSchema>,
}

impl Backend {
    async fn start(&self, case: usize) -> CaseServers {
        match self {
            Backend::Embedded => CaseServers {
                servers: vec![OjsServer::start(None).await],
                _schema: None,
            },
            Backend::Broker {
                url, settings, run, ..
            } => {
                let prefix = format!("{run}-{case}");
                let config = format!(
                    "[adapters.broker]\n{}\n\n[api]\nadapter = \"broker\"\n",
                    settings(url, &prefix)
                );
                CaseServers {
                    servers: vec![OjsServer::start(Some(&config)).await],
                    _schema: None,
                }
            }
            Backend::Replicas {
                rabbit,
                postgres,
                run,
            } => {
                let schema = ojs_bridge_tests::postgres::TestSchema::new(postgres);
                let prefix = format!("{run}-{case}");
                let config = format!(
                    "[adapters.broker]\nurl = \"{rabbit}\"\nqueue_template = \"{prefix}.{{queue}}\"\n\n[api]\nadapter = \"broker\"\nstate = \"{postgres}\"\nstate_schema = \"{}\"\n",
                    schema.name
                );
                // One after the other: the first makes the schema.
                let a = OjsServer::start(Some(&config)).await;
                let b = OjsServer::start(Some(&config)).await;
                CaseServers {
                    servers: vec![a, b],
                    _schema: Some(schema),
                }
            }
        }
    }
}

impl Backend {
    /// Removes what the run's cases left on a shared RabbitMQ: every queue
    /// under the run's prefix (each case's queues, dead-letter and retry
    /// queues). Left there they pile up run after run, and a broker restart
    /// recovers every durable queue it holds: with more queues than file
    /// handles, a restart stalled.
    async fn clean_up(&self) {
        let (url, run) = match self {
            Backend::Broker {
                broker: Broker::RabbitMq,
                url,
                run,
                ..
            } => (url, run),
            Backend::Replicas { rabbit, run, .. } => (rabbit, run),
            _ => return,
        };
        let Some(listed) = ojs_bridge_tests::brokers::rabbitmqctl_output(&[
            "list_queues",
            "name",
            "--quiet",
            "--no-table-headers",
        ]) else {
            missing::<()>(
                "rabbitmqctl",
                "cannot list the run's queues to delete them (set OJS_BRIDGE_TEST_RABBITMQCTL)",
            );
            return;
        };
        let names: Vec<&str> = listed
            .lines()
            .map(str::trim)
            .filter(|q| q.starts_with(run.as_str()))
            .collect();
        let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        for name in &names {
            channel
                .queue_delete(
                    (*name).into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await
                .unwrap();
        }
        let _ = connection.close(200, "done".into()).await;
        println!("deleted the run's {} queues on RabbitMQ", names.len());
    }
}

/// How many cases run at once (each against servers of its own): most of
/// a case's time is waiting (a broker's consumer joining, a case's WAIT
/// steps), not work. On Kafka eight: a case's server waits for its consumer
/// group to form, and eight at a time took the run from about 240 s to
/// about 145 s (the cron cases, two minutes each, are the floor); elsewhere
/// four (more did not shorten the run on RabbitMQ or SQS, and two replicas
/// per case ran PostgreSQL out of connections at eight).
/// `OJS_CONFORMANCE_PARALLEL` sets it for every backend.
fn parallel_cases(backend: &Backend) -> usize {
    let default = match backend {
        Backend::Broker {
            broker: Broker::Kafka,
            ..
        } => 8,
        _ => 4,
    };
    std::env::var("OJS_CONFORMANCE_PARALLEL")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

async fn run_all(backend: Backend, dir: &Path) -> Report {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel_cases(&backend)));
    let backend = std::sync::Arc::new(backend);
    let mut report = Report::default();
    let mut runs = tokio::task::JoinSet::new();
    // The longest cases first (the cron cases wait two minutes), so that
    // they do not start last and set the run's length.
    // A developer's narrowing to some folders (`level-3,level-4`): the level checks
    // below then fail for the folders left out, so a narrowed run never
    // passes as a whole one.
    let only = std::env::var("OJS_CONFORMANCE_ONLY").unwrap_or_default();
    let mut cases: Vec<(usize, Case)> = load_cases(dir)
        .into_iter()
        .filter(|c| only.split(',').any(|o| c.file.starts_with(o)))
        .enumerate()
        .collect();
    cases.sort_by_key(|(_, c)| std::cmp::Reverse(waits_ms(&c.case)));
    for (n, c) in cases {
        if let Some(reason) = skip_reason(&c.case).or_else(|| backend.cannot_run(&c.case)) {
            report.folders.entry(c.folder.clone()).or_default().2 += 1;
            report.skipped.push((c.file.clone(), reason));
            continue;
        }
        let (backend, slots) = (backend.clone(), slots.clone());
        runs.spawn(async move {
            let _slot = slots.acquire_owned().await.unwrap();
            let started = backend.start(n).await;
            let servers = Servers::new(&started.servers.iter().collect::<Vec<_>>());
            let outcome = replay(&servers, &c.case).await.map_err(|why| {
                if servers.addrs.len() > 1 {
                    format!(
                        "{why} (replicas picked with OJS_CONFORMANCE_SEED={})",
                        servers.seed
                    )
                } else {
                    why
                }
            });
            // The servers must exit cleanly after every case (SIGTERM, exit 0).
            tokio::task::spawn_blocking(move || {
                for server in started.servers {
                    server.stop();
                }
                drop(started._schema);
            })
            .await
            .unwrap();
            (n, c, outcome)
        });
    }
    let mut outcomes = Vec::new();
    while let Some(run) = runs.join_next().await {
        outcomes.push(run.unwrap());
    }
    backend.clean_up().await;
    outcomes.sort_by_key(|(n, _, _)| *n);
    for (_, c, outcome) in outcomes {
        let entry = report.folders.entry(c.folder.clone()).or_default();
        match outcome {
            Ok(()) => entry.0 += 1,
            Err(why) => {
                entry.1 += 1;
                report.failures.push((c.file.clone(), why));
            }
        }
    }
    for (folder, (passed, failed, skipped)) in &report.folders {
        println!("{folder}: {passed} passed, {failed} failed ({skipped} skipped)");
    }
    for (file, why) in &report.failures {
        println!("FAILED {file}: {why}");
    }
    for (file, reason) in &report.skipped {
        println!("skipped {file}: {reason}");
    }
    report
}

/// How long a case's steps wait in all (`delay_ms`).
fn waits_ms(case: &Value) -> u64 {
    case["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["delay_ms"].as_u64())
        .sum()
}

/// Replays one case; the first assertion that does not hold, if any.
async fn replay(servers: &Servers, case: &Value) -> Result<(), String> {
    let mut responses: BTreeMap<String, Value> = BTreeMap::new();
    let setup = case["setup"]["steps"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let steps = case["steps"].as_array().cloned().unwrap_or_default();
    for step in setup.iter().chain(&steps) {
        let id = step["id"].as_str().unwrap_or("?").to_owned();
        let action = step["action"].as_str().unwrap_or("");
        match action {
            "WAIT" => {
                let ms = step["duration_ms"]
                    .as_u64()
                    .or(step["delay_ms"].as_u64())
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                continue;
            }
            "ASSERT" => continue,
            _ => {}
        }
        if let Some(ms) = step["delay_ms"].as_u64() {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let path = fill_str(step["path"].as_str().unwrap_or(""), &responses);
        let mut headers: Vec<(String, String)> = step["headers"]
            .as_object()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let body = match (&step["raw_body"], &step["body"]) {
            (Value::String(raw), _) => Some(raw.clone().into_bytes()),
            (_, Value::Null) => None,
            (_, body) => Some(fill(body, &responses).to_string().into_bytes()),
        };
        if body.is_some()
            && !headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        {
            headers.push(("Content-Type".into(), "application/openjobspec+json".into()));
        }
        let answer = request(servers.pick(), action, &path, &headers, body.as_deref()).await;
        let parsed: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
        let assertions = fill(&step["assertions"], &responses);
        check_step(&id, &answer, &parsed, &assertions)?;
        responses.insert(
            id,
            json!({"response": {"status": answer.status, "body": parsed}}),
        );
    }
    Ok(())
}

fn check_step(
    id: &str,
    answer: &crate::ojs_server::Answer,
    body: &Value,
    assertions: &Value,
) -> Result<(), String> {
    let fail = |what: String| {
        Err(format!(
            "{id}: {what}; got {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
                .chars()
                .take(400)
                .collect::<String>()
        ))
    };
    if let Some(expected) = assertions.get("status") {
        if !status_matches(expected, answer.status) {
            return fail(format!("status should be {expected}"));
        }
    }
    if let Some(list) = assertions["status_in"].as_array() {
        if !list
            .iter()
            .any(|s| s.as_u64() == Some(u64::from(answer.status)))
        {
            return fail(format!("status should be one of {list:?}"));
        }
    }
    if let Some(headers) = assertions["headers"].as_object() {
        for (name, expected) in headers {
            let got = answer.header(name).unwrap_or_default();
            let ok = match expected {
                Value::String(s) => {
                    let essence = |v: &str| {
                        v.split(';')
                            .next()
                            .unwrap_or("")
                            .trim()
                            .to_ascii_lowercase()
                    };
                    if name.eq_ignore_ascii_case("content-type") {
                        essence(&got) == essence(s)
                    } else {
                        &got == s
                    }
                }
                other => matches(other, Some(&json!(got))),
            };
            if !ok {
                return fail(format!("header {name} should be {expected}, is {got:?}"));
            }
        }
    }
    if let Some(paths) = assertions["body"].as_object() {
        for (path, matcher) in paths {
            // Alternatives of whole-body conditions: one must hold.
            if path == "$or" {
                let any = matcher
                    .as_array()
                    .is_some_and(|alts| alts.iter().any(|alt| body_holds(body, alt)));
                if !any {
                    return fail(format!("none of {matcher} holds"));
                }
                continue;
            }
            if !path_holds(body, path, matcher) {
                let found = json_path(body, path);
                return fail(format!("{path} should match {matcher}, is {found:?}"));
            }
        }
    }
    if let Some(paths) = assertions["body_absent"].as_array() {
        for path in paths.iter().filter_map(Value::as_str) {
            if !json_path(body, path).is_empty() {
                return fail(format!("{path} should be absent"));
            }
        }
    }
    Ok(())
}

/// Whether every `path → matcher` of `conditions` holds for `body`
/// (`$empty`: the body is empty).
fn body_holds(body: &Value, conditions: &Value) -> bool {
    conditions.as_object().is_some_and(|m| {
        m.iter().all(|(path, matcher)| {
            if path == "$empty" {
                let empty = match body {
                    Value::Null => true,
                    Value::Object(o) => o.is_empty(),
                    Value::Array(a) => a.is_empty(),
                    _ => false,
                };
                return matcher.as_bool() == Some(empty);
            }
            path_holds(body, path, matcher)
        })
    })
}

/// Whether the values at `path` of `body` meet `matcher`: each of them,
/// or the absence when there is none; `contains:X` / `not_contains:X` on a
/// path of many values (`$.crons[*].name`): whether X is among them.
fn path_holds(body: &Value, path: &str, matcher: &Value) -> bool {
    let found = json_path(body, path);
    if let Some(text) = matcher.as_str() {
        let among = |x: &str| found.iter().any(|v| v.as_str() == Some(x));
        if let Some(x) = text.strip_prefix("not_contains:") {
            return !among(x);
        }
        if let Some(x) = text.strip_prefix("contains:") {
            return among(x);
        }
    }
    if found.is_empty() {
        matches(matcher, None)
    } else {
        found.iter().all(|v| matches(matcher, Some(v)))
    }
}

/// A number against `{"$gte": n, "$lte": n, "$gt": n, "$lt": n}` (or a
/// plain number: equal).
fn compares(matcher: &Value, n: f64) -> bool {
    match matcher {
        Value::Number(x) => x.as_f64() == Some(n),
        Value::Object(m) => m.iter().all(|(k, x)| {
            let x = x.as_f64().unwrap_or(f64::NAN);
            match k.as_str() {
                "$gte" => n >= x,
                "$lte" => n <= x,
                "$gt" => n > x,
                "$lt" => n < x,
                "$eq" => n == x,
                _ => false,
            }
        }),
        _ => false,
    }
}

fn status_matches(expected: &Value, got: u16) -> bool {
    let got = f64::from(got);
    match expected {
        Value::Number(n) => n.as_f64() == Some(got),
        Value::String(s) => {
            if let Some(list) = s.strip_prefix("one_of:") {
                list.split(',')
                    .any(|x| x.trim().parse::<f64>().ok() == Some(got))
            } else {
                matches(expected, Some(&json!(got as u64)))
            }
        }
        Value::Object(_) => matches(expected, Some(&json!(got as u64))),
        _ => false,
    }
}

/// Whether `value` (`None`: absent) satisfies the matcher.
fn matches(matcher: &Value, value: Option<&Value>) -> bool {
    match matcher {
        Value::String(s) => match s.as_str() {
            "absent" => value.is_none(),
            "exists" => value.is_some(),
            "any" => true,
            "string:uuidv7" => value.and_then(Value::as_str).is_some_and(|v| {
                regex::Regex::new(
                    "^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$",
                )
                .unwrap()
                .is_match(v)
            }),
            "string:datetime" => value
                .and_then(Value::as_str)
                .is_some_and(|v| chrono::DateTime::parse_from_rfc3339(v).is_ok()),
            "string:nonempty" | "string:non_empty" => {
                value.and_then(Value::as_str).is_some_and(|v| !v.is_empty())
            }
            "array:nonempty" => value
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty()),
            _ => {
                // `~N`: about N (a quarter either way, at least 100).
                if let Some(n) = s.strip_prefix('~').and_then(|n| n.parse::<f64>().ok()) {
                    return value
                        .and_then(Value::as_f64)
                        .is_some_and(|v| (v - n).abs() <= (n * 0.25).max(100.0));
                }
                if let Some(x) = s.strip_prefix("string:contains:") {
                    return value.and_then(Value::as_str).is_some_and(|v| v.contains(x));
                }
                if let Some(n) = s
                    .strip_prefix("array:min_length:")
                    .or_else(|| s.strip_prefix("array:min:"))
                {
                    let n: usize = n.parse().unwrap_or(0);
                    return value
                        .and_then(Value::as_array)
                        .is_some_and(|a| a.len() >= n);
                }
                if let Some(n) = s
                    .strip_prefix("array:length(")
                    .and_then(|r| r.strip_suffix(')'))
                    .or_else(|| s.strip_prefix("array:length:"))
                {
                    let n: usize = n.parse().unwrap_or(0);
                    return value
                        .and_then(Value::as_array)
                        .is_some_and(|a| a.len() == n);
                }
                if let Some(r) = s
                    .strip_prefix("number:range(")
                    .and_then(|r| r.strip_suffix(')'))
                {
                    let (a, b) = r.split_once(',').unwrap_or(("0", "0"));
                    let (a, b): (f64, f64) = (
                        a.trim().parse().unwrap_or(0.0),
                        b.trim().parse().unwrap_or(0.0),
                    );
                    return value
                        .and_then(Value::as_f64)
                        .is_some_and(|v| v >= a && v <= b);
                }
                value == Some(matcher)
            }
        },
        Value::Object(m) if m.keys().any(|k| k.starts_with('$')) => {
            m.iter().all(|(k, x)| match k.as_str() {
                "$exists" => x.as_bool() == Some(value.is_some()),
                // An integer is a number too, as JSON Schema reads it.
                "$type" => value.is_some_and(|v| {
                    let want = x.as_str().unwrap_or("");
                    type_name(v) == want || (want == "number" && v.is_number())
                }),
                "$match" => value.and_then(Value::as_str).is_some_and(|v| {
                    regex::Regex::new(x.as_str().unwrap_or(""))
                        .unwrap()
                        .is_match(v)
                }),
                "$in" => x
                    .as_array()
                    .is_some_and(|list| list.iter().any(|i| matches(i, value))),
                "$size" => value
                    .and_then(Value::as_array)
                    .is_some_and(|a| compares(x, a.len() as f64)),
                "$gte" | "$lte" | "$gt" | "$lt" | "$eq" => value
                    .and_then(Value::as_f64)
                    .is_some_and(|v| compares(&json!({ k.as_str(): x }), v)),
                "$or" => x
                    .as_array()
                    .is_some_and(|list| list.iter().any(|i| matches(i, value))),
                _ => false,
            })
        }
        // `{"range": {"min": a, "max": b}}`: a number within.
        Value::Object(m) if m.len() == 1 && m.get("range").is_some_and(Value::is_object) => {
            let r = &m["range"];
            value.and_then(Value::as_f64).is_some_and(|v| {
                r["min"].as_f64().is_none_or(|a| v >= a) && r["max"].as_f64().is_none_or(|b| v <= b)
            })
        }
        Value::Object(m) => m
            .iter()
            .all(|(k, x)| matches(x, value.and_then(|v| v.get(k)))),
        Value::Number(n) => value
            .and_then(Value::as_f64)
            .is_some_and(|v| Some(v) == n.as_f64()),
        other => value == Some(other),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The values a JSONPath (`$.a.b`, `$.a[0]`, `$.a[*].b`,
/// `$.a[?(@.k=='v')]`) selects.
fn json_path<'a>(root: &'a Value, path: &str) -> Vec<&'a Value> {
    let mut current = vec![root];
    let mut rest = path.strip_prefix('$').unwrap_or(path);
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            let key = &r[..end];
            current = current.into_iter().filter_map(|v| v.get(key)).collect();
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let Some(end) = r.find(']') else {
                return Vec::new();
            };
            // A filter may hold `]` only inside quotes; these cases have none.
            let inner = &r[..end];
            rest = &r[end + 1..];
            if inner == "*" {
                current = current
                    .into_iter()
                    .flat_map(|v| match v {
                        Value::Array(a) => a.iter().collect::<Vec<_>>(),
                        Value::Object(m) => m.values().collect(),
                        _ => Vec::new(),
                    })
                    .collect();
            } else if let Some(filter) =
                inner.strip_prefix("?(@.").and_then(|f| f.strip_suffix(')'))
            {
                let (key, want) = filter.split_once("==").unwrap_or((filter, ""));
                let want = want.trim().trim_matches('\'').trim_matches('"');
                current = current
                    .into_iter()
                    .filter_map(Value::as_array)
                    .flatten()
                    .filter(|item| match item.get(key.trim()) {
                        Some(Value::String(s)) => s == want,
                        Some(other) => {
                            serde_json::from_str::<Value>(want).ok().as_ref() == Some(other)
                        }
                        None => false,
                    })
                    .collect();
            } else if let Ok(i) = inner.parse::<usize>() {
                current = current.into_iter().filter_map(|v| v.get(i)).collect();
            } else {
                let key = inner.trim_matches('\'').trim_matches('"');
                current = current.into_iter().filter_map(|v| v.get(key)).collect();
            }
        } else {
            return Vec::new();
        }
    }
    current
}

/// `{{steps.<id>.response.body.<path>}}` in every string of `v`.
fn fill(v: &Value, responses: &BTreeMap<String, Value>) -> Value {
    match v {
        Value::String(s) => {
            let t = s.trim();
            if t.starts_with("{{") && t.ends_with("}}") && t.matches("{{").count() == 1 {
                if let Some(found) = lookup(&t[2..t.len() - 2], responses) {
                    return found;
                }
            }
            Value::String(fill_str(s, responses))
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| fill(x, responses)).collect()),
        Value::Object(m) => Value::Object(
            m.iter()
                // Keys too: a JSONPath filter may name an earlier answer.
                .map(|(k, x)| (fill_str(k, responses), fill(x, responses)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn fill_str(s: &str, responses: &BTreeMap<String, Value>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let expr = &rest[start + 2..start + end];
        match lookup(expr.trim(), responses) {
            Some(Value::String(v)) => out.push_str(&v),
            Some(v) => out.push_str(&v.to_string()),
            None => out.push_str(&rest[start..start + end + 2]),
        }
        rest = &rest[start + end + 2..];
    }
    out.push_str(rest);
    out
}

fn lookup(expr: &str, responses: &BTreeMap<String, Value>) -> Option<Value> {
    let rest = expr.strip_prefix("steps.")?;
    let (id, path) = rest.split_once('.')?;
    let mut v = responses.get(id)?;
    for key in path.split('.') {
        // `jobs[0]`: a key, then indexes.
        let (name, indexes) = key.split_once('[').unwrap_or((key, ""));
        v = v.get(name)?;
        for index in indexes.split('[').filter(|i| !i.is_empty()) {
            v = v.get(index.trim_end_matches(']').parse::<usize>().ok()?)?;
        }
    }
    Some(v.clone())
}

/// Level-0 cases that need no worker must all pass.
fn assert_level_0(report: &Report) {
    let failed: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| file.starts_with("level-0-core"))
        .collect();
    let (passed, _, _) = report
        .folders
        .get("level-0-core")
        .copied()
        .unwrap_or_default();
    // All of level 0 runs: the worker side is served.
    assert!(passed >= 65, "only {passed} level-0 cases ran and passed");
    assert!(failed.is_empty(), "level-0 cases failed: {failed:#?}");
}

/// Level-1 cases that run (not skipped with a reason) must all pass.
fn assert_level_1(report: &Report) {
    let failed: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| file.starts_with("level-1-reliable"))
        .collect();
    let (passed, _, _) = report
        .folders
        .get("level-1-reliable")
        .copied()
        .unwrap_or_default();
    assert!(passed >= 19, "only {passed} level-1 cases ran and passed");
    assert!(failed.is_empty(), "level-1 cases failed: {failed:#?}");
    // The dead-letter extension's cases that can run (two name a
    // placeholder no step defines).
    let (passed, failed, _) = report
        .folders
        .get("ext-dead-letter")
        .copied()
        .unwrap_or_default();
    assert!(
        passed >= 2 && failed == 0,
        "ext-dead-letter: {passed} passed, {failed} failed"
    );
}

/// The admin extension's cases all pass but the one that cannot as
/// written (it names a `{{job_id}}` no step defines), on every backend.
fn assert_admin(report: &Report) {
    let (passed, failed, skipped) = report
        .folders
        .get("ext-admin-api")
        .copied()
        .unwrap_or_default();
    let failures: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| file.starts_with("ext-admin-api"))
        .collect();
    assert_eq!(
        (passed, failed, skipped),
        (5, 0, 1),
        "ext-admin-api: {failures:#?}"
    );
}

/// The level-2 cases (scheduled jobs, expiry, cron) all run and pass, on
/// every backend.
fn assert_level_2(report: &Report) {
    const LEVEL_2: &str = "level-2-scheduled/";
    let failed: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| file.starts_with(LEVEL_2))
        .collect();
    assert!(failed.is_empty(), "level-2 cases failed: {failed:#?}");
    let skipped: Vec<_> = report
        .skipped
        .iter()
        .filter(|(file, _)| file.starts_with(LEVEL_2))
        .collect();
    assert!(skipped.is_empty(), "level-2 cases skipped: {skipped:#?}");
    let (passed, _, _) = report
        .folders
        .get("level-2-scheduled")
        .copied()
        .unwrap_or_default();
    assert!(passed >= 13, "only {passed} level-2 cases ran and passed");
}

/// The level-4 cases of unique jobs, queue operations, bulk pushes and rate
/// limits all run and pass, on every backend (priority order is the
/// broker's: see the README's table).
fn assert_level_4_served(report: &Report) {
    const FOLDERS: [&str; 4] = [
        "level-4-advanced/unique/",
        "level-4-advanced/queue-ops/",
        "level-4-advanced/bulk/",
        "level-4-advanced/rate-limit/",
    ];
    let ours = |file: &String| FOLDERS.iter().any(|f| file.starts_with(f));
    let failed: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| ours(file))
        .collect();
    assert!(failed.is_empty(), "level-4 cases failed: {failed:#?}");
    let skipped: Vec<_> = report
        .skipped
        .iter()
        .filter(|(file, _)| ours(file))
        .collect();
    assert!(skipped.is_empty(), "level-4 cases skipped: {skipped:#?}");
}

/// Level 3: every workflow case, none skipped.
fn assert_level_3(report: &Report) {
    const LEVEL_3: &str = "level-3-workflows/";
    let failed: Vec<_> = report
        .failures
        .iter()
        .filter(|(file, _)| file.starts_with(LEVEL_3))
        .collect();
    assert!(failed.is_empty(), "level-3 cases failed: {failed:#?}");
    let (passed, _, skipped) = report
        .folders
        .get("level-3-workflows")
        .copied()
        .unwrap_or_default();
    assert_eq!(
        (passed, skipped),
        (14, 0),
        "level 3: every case runs and passes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_cases_pass_on_the_embedded_default() {
    let Some(dir) = cases_dir() else { return };
    let report = run_all(Backend::Embedded, &dir).await;
    assert_level_0(&report);
    assert_level_1(&report);
    assert_level_2(&report);
    assert_level_3(&report);
    assert_admin(&report);
    assert_level_4_served(&report);
}

async fn on_broker(broker: Broker, settings: fn(&str, &str) -> String) {
    let Some(dir) = cases_dir() else { return };
    let Some(endpoint) = find(broker).await else {
        return;
    };
    let backend = Backend::Broker {
        broker,
        url: endpoint.url.clone(),
        settings,
        run: ojs_bridge_tests::brokers::unique_queue("conf"),
    };
    let report = run_all(backend, &dir).await;
    assert_level_0(&report);
    assert_level_2(&report);
    assert_level_3(&report);
    assert_admin(&report);
    assert_level_4_served(&report);
}

/// Two replicas sharing a job store on PostgreSQL, over RabbitMQ: every
/// step of every case goes to one of them chosen at random.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_cases_pass_on_two_replicas_sharing_postgresql() {
    let Some(dir) = cases_dir() else { return };
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    let Some(postgres) = ojs_bridge_tests::postgres::find() else {
        return;
    };
    let backend = Backend::Replicas {
        rabbit: rabbit.url.clone(),
        postgres,
        run: ojs_bridge_tests::brokers::unique_queue("conf-pg"),
    };
    let report = run_all(backend, &dir).await;
    assert_level_0(&report);
    assert_level_1(&report);
    assert_level_2(&report);
    assert_level_3(&report);
    assert_admin(&report);
    assert_level_4_served(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_cases_pass_on_rabbitmq() {
    on_broker(Broker::RabbitMq, |url, prefix| {
        format!("url = \"{url}\"\nqueue_template = \"{prefix}.{{queue}}\"")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_cases_pass_on_kafka() {
    on_broker(Broker::Kafka, |url, prefix| {
        // Retry and dead-letter topics of their own too: the defaults are
        // shared by every run on the broker.
        format!("url = \"{url}\"\ntopic_template = \"{prefix}.{{queue}}\"\nretry_topic_template = \"{prefix}.{{queue}}.retry\"\ndead_topic_template = \"{prefix}.{{queue}}.dead\"\npartitions = 1")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_cases_pass_on_sqs() {
    on_broker(Broker::Sqs, |url, prefix| {
        format!("url = \"{url}\"\nprefix = \"{prefix}-\"")
    })
    .await;
}

#[test]
fn the_matchers_read_the_case_format() {
    let body = json!({"job": {"id": "019539a4-aaaa-7000-8000-111111111111", "args": [1, {"a": "b"}],
                              "list": [{"k": "v", "n": 1}, {"k": "w", "n": 2}]}});
    assert_eq!(json_path(&body, "$.job.args[1].a"), vec![&json!("b")]);
    assert_eq!(json_path(&body, "$.job.list[*].n").len(), 2);
    assert_eq!(json_path(&body, "$.job.list[?(@.k=='w')]")[0]["n"], 2);
    assert!(matches(&json!("string:uuidv7"), Some(&body["job"]["id"])));
    assert!(!matches(
        &json!("string:uuidv7"),
        Some(&json!("550e8400-e29b-41d4-a716-446655440000"))
    ));
    assert!(matches(&json!("absent"), None));
    assert!(!matches(&json!("absent"), Some(&json!(1))));
    assert!(matches(
        &json!({"$exists": true, "$type": "string"}),
        Some(&json!("x"))
    ));
    assert!(matches(&json!("number:range(400,422)"), Some(&json!(409))));
    assert!(!matches(&json!("number:range(400,422)"), Some(&json!(500))));
    assert!(matches(&json!(3.0), Some(&json!(3))));
    let crons = json!({"crons": [{"name": "a"}, {"name": "b"}], "none": []});
    assert!(body_holds(
        &crons,
        &json!({"$.crons[*].name": "contains:b"})
    ));
    assert!(!body_holds(
        &crons,
        &json!({"$.crons[*].name": "contains:c"})
    ));
    assert!(body_holds(
        &crons,
        &json!({"$.crons[*].name": "not_contains:c"})
    ));
    assert!(!body_holds(
        &crons,
        &json!({"$.crons[*].name": "not_contains:a"})
    ));
    assert!(body_holds(
        &crons,
        &json!({"$.none[*].name": "not_contains:a"})
    ));
    assert!(status_matches(&json!("one_of:409,422"), 422));
    assert!(!status_matches(&json!(201), 200));
    let mut responses = BTreeMap::new();
    responses.insert(
        "step-1".to_owned(),
        json!({"response": {"body": {"job": {"id": "abc", "n": 4}}}}),
    );
    assert_eq!(
        fill_str(
            "/ojs/v1/jobs/{{steps.step-1.response.body.job.id}}",
            &responses
        ),
        "/ojs/v1/jobs/abc"
    );
    assert_eq!(
        fill(&json!("{{steps.step-1.response.body.job.n}}"), &responses),
        json!(4)
    );
}
