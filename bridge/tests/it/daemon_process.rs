//! The `ojs-bridge` binary as a process on the embedded broker: SIGKILL
//! mid-stream loses nothing, SIGTERM drains and exits 0, bad configuration
//! files exit non-zero naming the field.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{call, collect, spawn_daemon};
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_bridge_tests::tally::Tally;
use ojs_bridge_tests::tempdir::TempDir;
use ojs_core::Encoding;
use ojs_grpcq::mapping::{self, call_job_id};
use ojs_queue::{OutgoingMessage, QueueAdapter, Source};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
}

/// The daemon's file; `top` adds top-level settings.
fn config_file(dir: &Path, data: &Path, top: &str) -> PathBuf {
    let path = dir.join("bridge.toml");
    std::fs::write(
        &path,
        format!(
            r#"
            shutdown_timeout = "10s"
            {top}
            [http]
            listen = "off"
            [adapters]
            local = "local:{data}"
            [[sources]]
            name = "calls"
            adapter = "local"
            queue = "calls"
            visibility_timeout = "2s"
            [[routes]]
            name = "default"
            sink = "local"
            queue = "default"
            "#,
            data = data.display()
        ),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_10000_calls_flow_then_restart_loses_nothing_and_duplicates_keep_their_job_id(
) {
    let dir = TempDir::new("daemon-kill");
    let data = dir.path().join("data");
    let config = config_file(dir.path(), &data, "");
    let broker = LocalAdapter::open(LocalConfig::new(&data)).await.unwrap();
    let n = 10_000;
    let calls: Vec<_> = (0..n)
        .map(|i| call(i, "payment.PaymentService", "Pay"))
        .collect();
    let expected: HashMap<String, String> = calls
        .iter()
        .map(|c| {
            (
                c.message_id.clone(),
                call_job_id(&c.message_id, c.timestamp_ms),
            )
        })
        .collect();

    let mut daemon = spawn_daemon(&config);
    // Publish while the daemon consumes, in batches, from another task.
    let publisher = {
        let broker = LocalAdapter::open(LocalConfig::new(&data)).await.unwrap();
        let calls = calls.clone();
        tokio::spawn(async move {
            for chunk in calls.chunks(250) {
                broker
                    .publish("calls", chunk.iter().map(ojs_grpcq::outgoing).collect())
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    // Kill it mid-stream, once a good part has gone through.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = broker.depth("default").await.unwrap().unwrap_or(0);
        if done >= 2_500 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon moved only {done} calls in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    daemon.kill().unwrap(); // SIGKILL
    daemon.wait().unwrap();
    let at_kill = broker.depth("default").await.unwrap().unwrap_or(0);
    println!("killed with {at_kill} jobs out");
    publisher.await.unwrap();

    let mut daemon = spawn_daemon(&config);
    let deadline = Instant::now() + Duration::from_secs(120);
    while broker.depth("calls").await.unwrap().unwrap_or(0) > 0
        || broker.depth("default").await.unwrap().unwrap_or(0) < n as u64
    {
        assert!(
            Instant::now() < deadline,
            "the restarted daemon did not finish in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Give abandoned leases (2 s) time to come back and be bridged again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let status = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(daemon.wait().unwrap().success(), "SIGTERM must exit 0");

    let jobs = collect(
        &broker,
        "default",
        Source::Queue,
        usize::MAX,
        Duration::from_secs(3),
    )
    .await;
    let mut tally = Tally::new();
    for id in expected.keys() {
        tally.sent(id.clone());
    }
    let mut ids_per_call: HashMap<String, BTreeSet<String>> = HashMap::new();
    for d in &jobs {
        let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
        let message_id = job.meta_str(mapping::META_MESSAGE_ID).unwrap().to_owned();
        tally.received(message_id.clone());
        ids_per_call
            .entry(message_id)
            .or_default()
            .insert(job.id.clone());
    }
    tally.assert_none_lost("kill -9 mid-stream, restart");
    assert_eq!(tally.unexpected(), 0);
    for (message_id, ids) in &ids_per_call {
        assert_eq!(
            ids.len(),
            1,
            "call {message_id} became {} different jobs",
            ids.len()
        );
        assert_eq!(ids.iter().next(), expected.get(message_id));
    }
    println!(
        "duplicates {} (each with the job id of its first copy)",
        tally.duplicates()
    );
    assert_eq!(broker.depth("calls").await.unwrap(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_work_and_exits_0() {
    let dir = TempDir::new("daemon-term");
    let data = dir.path().join("data");
    // The smallest runtime the setting allows: the daemon still drains.
    let config = config_file(dir.path(), &data, "worker_threads = 1");
    let broker = LocalAdapter::open(LocalConfig::new(&data)).await.unwrap();
    let calls: Vec<OutgoingMessage> = (0..2000)
        .map(|i| ojs_grpcq::outgoing(&call(i, "a.B", "C")))
        .collect();
    broker.publish("calls", calls).await.unwrap();
    let mut daemon = spawn_daemon(&config);
    while broker.depth("default").await.unwrap().unwrap_or(0) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    let status = daemon.wait().unwrap();
    println!("exited {status} in {:?}", started.elapsed());
    assert!(status.success(), "SIGTERM must exit 0, got {status}");
    assert!(started.elapsed() < Duration::from_secs(15));
    // What was taken was published and acked; the rest is still in `calls`.
    let out = broker.depth("default").await.unwrap().unwrap_or(0);
    let left = broker.depth("calls").await.unwrap().unwrap_or(0);
    assert_eq!(
        out + left,
        2000,
        "out {out} + left {left}: nothing lost, nothing doubled"
    );
}

#[test]
fn check_config_accepts_the_shipped_examples_and_rejects_bad_files_naming_the_field() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut checked = 0;
    // Run where a user runs them: relative paths (the embedded broker's
    // directory, the example service's descriptor set) from there.
    let cwd = TempDir::new("examples-cwd");
    std::fs::write(
        cwd.path().join("invoices.binpb"),
        ojs_example_invoices::FILE_DESCRIPTOR_SET,
    )
    .unwrap();
    // The certificates and password files the examples name exist on the
    // machine they are deployed to; here they are stand-ins, given through
    // the environment overrides an operator would use.
    let stand_in = |name: &str| {
        let file = cwd.path().join(name);
        std::fs::write(&file, "stand-in").unwrap();
        file.to_str().unwrap().to_owned()
    };
    let files: &[(&str, &[(&str, &str)])] = &[
        (
            "all-adapter-settings.toml",
            &[
                ("OJS_BRIDGE_ADAPTER_RABBIT__CA_FILE", "ca.pem"),
                ("OJS_BRIDGE_ADAPTER_RABBIT__CERT_FILE", "client.pem"),
                ("OJS_BRIDGE_ADAPTER_RABBIT__KEY_FILE", "client.key"),
                (
                    "OJS_BRIDGE_ADAPTER_RABBIT__PASSWORD_FILE",
                    "rabbit-password",
                ),
                (
                    "OJS_BRIDGE_ADAPTER_KAFKA__SASL_PASSWORD_FILE",
                    "kafka-password",
                ),
            ],
        ),
        (
            "existing-rabbitmq.toml",
            &[("OJS_BRIDGE_ADAPTER_RABBIT__CA_FILE", "rabbit-ca.pem")],
        ),
    ];
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let file_name = path.file_name().unwrap().to_str().unwrap();
            let mut command = bin();
            for (example, overrides) in files {
                if *example == file_name {
                    // Without the files, check-config refuses, as run would.
                    let out = bin()
                        .current_dir(cwd.path())
                        .args(["check-config", path.to_str().unwrap()])
                        .output()
                        .unwrap();
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    assert_eq!(out.status.code(), Some(2), "{file_name}: {stderr}");
                    assert!(stderr.contains("cannot read"), "{stderr}");
                    for (var, name) in *overrides {
                        command.env(var, stand_in(name));
                    }
                }
            }
            let out = command
                .current_dir(cwd.path())
                .args(["check-config", path.to_str().unwrap()])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                !String::from_utf8_lossy(&out.stderr).contains("warning:"),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 4,
        "expected an example per broker pair, found {checked}"
    );

    // Two queues of one file that would share a retry topic on one
    // cluster: accepted, with a warning naming both and the fix.
    let dir = TempDir::new("shared-config");
    let shared = dir.path().join("shared.toml");
    std::fs::write(
        &shared,
        "[adapters.a]\nurl = \"kafka://127.0.0.1:9\"\ntopic_template = \"a.{queue}\"\nretry_topic_template = \"retries.{queue}\"\n[adapters.b]\nurl = \"kafka://127.0.0.1:9\"\ntopic_template = \"b.{queue}\"\nretry_topic_template = \"retries.{queue}\"\n[[sources]]\nname = \"s\"\nadapter = \"a\"\nqueue = \"orders\"\n[[routes]]\nname = \"r\"\nsink = \"b\"\nqueue = \"orders\"\n",
    )
    .unwrap();
    let out = bin()
        .args(["check-config", shared.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning:")
            && stderr.contains("adapters.a queue \"orders\"")
            && stderr.contains("adapters.b queue \"orders\"")
            && stderr.contains("retries.orders"),
        "{stderr}"
    );

    let dir = TempDir::new("bad-config");
    let garbage = dir.path().join("garbage.binpb");
    std::fs::write(&garbage, b"\xff\xff not a descriptor set").unwrap();
    let garbage_case = format!(
        "[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"local\"\ndescriptor_set = \"{}\"\n",
        garbage.display()
    );
    let cases = [
        ("adapters = [", "bad.toml"),
        ("[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\nbatchsize = 5\n", "unknown field `batchsize`"),
        ("[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"kafka\"\n", "routes[0].sink"),
        ("[adapters]\nlocal = \"gopher://x\"\n", "adapters.local"),
        ("[http]\nlisten_backlog = 0\n[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"local\"\n", "http.listen_backlog"),
        ("worker_threads = 0\n[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"local\"\n", "worker_threads"),
        ("[adapters]\nlocal = \"local:./d\"\n[[sources]]\nname = \"s\"\nadapter = \"local\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"local\"\ndescriptor_set = \"/nonexistent.binpb\"\n", "routes[0].descriptor_set"),
        // A misspelt Kafka setting is taken for a librdkafka option, which
        // librdkafka refuses: found without connecting, with a hint.
        ("[adapters]\nk = \"kafka://127.0.0.1:9?topic_templat={queue}\"\n[[sources]]\nname = \"s\"\nadapter = \"k\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"k\"\n", "did you mean `topic_template`?"),
        ("[adapters.k]\nurl = \"kafka://127.0.0.1:9\"\nlibrdkafka_options = { acks = \"banana\" }\n[[sources]]\nname = \"s\"\nadapter = \"k\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"k\"\n", "\"acks\""),
        ("[adapters]\nr = \"amqp://127.0.0.1:9/%2f?prefetsh=5\"\n[[sources]]\nname = \"s\"\nadapter = \"r\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"r\"\n", "did you mean `prefetch`?"),
    ];
    let cases = cases
        .iter()
        .map(|(t, e)| (t.to_string(), *e))
        .chain([(garbage_case, "not a protobuf FileDescriptorSet")]);
    for (text, expected) in cases {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, &text).unwrap();
        for args in [
            vec!["check-config", path.to_str().unwrap()],
            vec!["run", "--config", path.to_str().unwrap()],
        ] {
            let out = bin().args(&args).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?} on {text:?}: {stderr}");
            assert!(
                stderr.contains(expected),
                "{args:?}: expected {expected:?} in {stderr:?}"
            );
        }
    }
    let out = bin()
        .args(["run", "--config", "/nonexistent/bridge.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/bridge.toml"));
}

/// SIGTERM right after the daemon says it runs is a clean stop (exit 0):
/// its handlers are installed before that line (they were installed after
/// it, and a signal in between killed the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_right_after_the_running_line_is_a_clean_stop_on_rabbitmq() {
    // A broker adapter: the first health probe runs between that line and
    // the daemon's wait for a signal, which made the gap wide enough.
    let Some(rabbit) =
        ojs_bridge_tests::brokers::find(ojs_bridge_tests::brokers::Broker::RabbitMq).await
    else {
        return;
    };
    let config = format!(
        "[adapters.rabbit]\nurl = \"{}\"\n\n[api]\nadapter = \"rabbit\"\n",
        rabbit.url
    );
    for _ in 0..10 {
        crate::ojs_server::OjsServer::start(Some(&config))
            .await
            .stop();
    }
}
