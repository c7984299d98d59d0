//! The embedded broker shared by processes: `ojs-bridge send` in one process
//! while another consumes, and a consumer killed with SIGKILL mid-batch.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_core::{Encoding, JobEnvelope};
use ojs_queue::{ConsumerOptions, OutgoingMessage, QueueAdapter};
use serde_json::json;

fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ojs-proc-{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_sends_10000_while_another_consumes() {
    let dir = temp_dir("two");
    let n = 10_000;
    let mut ids = Vec::with_capacity(n);
    let mut ndjson = String::new();
    for i in 0..n {
        let job = JobEnvelope::new("load.item", vec![json!(i)]).with_queue("twoproc");
        ids.push(job.id.clone());
        ndjson.push_str(&String::from_utf8(job.to_json_vec().unwrap()).unwrap());
        ndjson.push('\n');
    }
    let file = dir.join("jobs.ndjson");
    std::fs::write(&file, ndjson).unwrap();

    // The consumer opens the directory first, so it is consuming while the
    // other process is still publishing.
    let adapter = LocalAdapter::open(LocalConfig::new(dir.join("data")))
        .await
        .unwrap();
    let mut consumer = adapter
        .consumer("twoproc", ConsumerOptions::default())
        .await
        .unwrap();
    let sender = bin()
        .args([
            "send",
            "--to",
            &format!("local:{}", dir.join("data").display()),
            file.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    let mut received: HashMap<String, u32> = HashMap::new();
    let mut while_sending = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut sender = Some(sender);
    let mut send_output = None;
    while received.len() < n && Instant::now() < deadline {
        for d in consumer
            .receive(200, Duration::from_millis(200))
            .await
            .unwrap()
        {
            let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
            *received.entry(job.id.clone()).or_default() += 1;
            d.ack().await.unwrap();
            if sender.is_some() {
                while_sending += 1;
            }
        }
        if let Some(child) = sender.as_mut() {
            if child.try_wait().unwrap().is_some() {
                send_output = Some(sender.take().unwrap().wait_with_output().unwrap());
            }
        }
    }
    let out = match send_output {
        Some(o) => o,
        None => sender.take().unwrap().wait_with_output().unwrap(),
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("sent {n}")
    );
    let lost = ids.iter().filter(|id| !received.contains_key(*id)).count();
    let duplicates: u32 = received.values().map(|c| c - 1).sum();
    println!("two processes: sent {n} received {} duplicates {duplicates} lost {lost} (consumed while sending: {while_sending})", received.len());
    assert_eq!(lost, 0);
    assert_eq!(received.len(), n);
    assert_eq!(adapter.depth("twoproc").await.unwrap(), Some(0));
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_batch_loses_nothing() {
    let dir = temp_dir("kill9");
    let url = format!("local:{}", dir.display());
    let adapter = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
    let n = 100;
    let mut ids = Vec::new();
    let batch: Vec<OutgoingMessage> = (0..n)
        .map(|i| {
            let job = JobEnvelope::new("kill.item", vec![json!(i)]).with_queue("victim");
            ids.push(job.id.clone());
            OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()
        })
        .collect();
    adapter.publish("victim", batch).await.unwrap();

    // `tail` without --ack holds what it printed; it waits for more.
    let mut tail = bin()
        .args([
            "tail",
            "--from",
            &url,
            "--queue",
            "victim",
            "--timeout-secs",
            "60",
            "--visibility-timeout-secs",
            "2",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    for _ in 0..n {
        lines.next().unwrap().unwrap();
    }
    assert_eq!(
        adapter.depth("victim").await.unwrap(),
        Some(0),
        "all leased by the tail process"
    );
    tail.kill().unwrap(); // SIGKILL: no chance to release its leases
    tail.wait().unwrap();

    let mut consumer = adapter
        .consumer("victim", ConsumerOptions::default())
        .await
        .unwrap();
    let mut received: HashMap<String, u32> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.len() < n && Instant::now() < deadline {
        for d in consumer
            .receive(50, Duration::from_millis(500))
            .await
            .unwrap()
        {
            assert_eq!(d.attempt, 2, "second delivery after the killed one");
            let job = &Encoding::OjsProto.decode_envelopes(&d.payload).unwrap()[0];
            *received.entry(job.id.clone()).or_default() += 1;
            d.ack().await.unwrap();
        }
    }
    let lost = ids.iter().filter(|id| !received.contains_key(*id)).count();
    println!("kill -9: sent {n} received {} lost {lost}", received.len());
    assert_eq!(lost, 0);
    std::fs::remove_dir_all(dir).ok();
}

/// A look is not a delivery attempt: `dead-letters list` and `tail`
/// without `--ack`, run again and again on the embedded broker, show each
/// message's attempt as it was, and a consumer then gets attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_and_tailing_count_no_attempt() {
    // Removed when the test ends, however it ends.
    let kept = ojs_bridge_tests::tempdir::TempDir::new("proc-looks");
    let dir = kept.path().to_path_buf();
    let url = format!("local:{}", dir.display());
    let adapter = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
    let messages: Vec<OutgoingMessage> = (0..2)
        .map(|i| {
            let job = JobEnvelope::new("look.item", vec![json!(i)]).with_queue("looked");
            OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()
        })
        .collect();
    adapter.publish("looked", messages).await.unwrap();
    let mut consumer = adapter
        .consumer("looked", ConsumerOptions::default())
        .await
        .unwrap();
    let first = consumer.receive(1, Duration::from_secs(5)).await.unwrap();
    let dead = first.into_iter().next().unwrap();
    dead.nack(ojs_queue::Nack::DeadLetter(
        ojs_queue::DeadLetterReason::new("test", "looked at"),
    ))
    .await
    .unwrap();
    consumer.close().await.unwrap();
    let run = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = bin().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let listed = run(&[
            "dead-letters",
            "list",
            "--from",
            &url,
            "--queue",
            "looked",
            "--timeout-secs",
            "1",
        ]);
        assert_eq!(listed.len(), 1, "{listed:?}");
        seen.push(listed[0]["attempt"].clone());
        let tailed = run(&[
            "tail",
            "--from",
            &url,
            "--queue",
            "looked",
            "--timeout-secs",
            "1",
        ]);
        assert_eq!(tailed.len(), 1, "{tailed:?}");
        seen.push(tailed[0]["attempt"].clone());
    }
    assert!(
        seen.iter().all(|a| *a == json!(1)),
        "attempts shown: {seen:?}"
    );
    let mut consumer = adapter
        .consumer("looked", ConsumerOptions::default())
        .await
        .unwrap();
    let next = consumer.receive(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(next[0].attempt, 1, "the first real delivery");
    next[0].ack().await.unwrap();
}

/// Long CLI work shows its progress on a terminal (a pseudo-terminal made
/// by `script`): `send` of 2,000 lines, and `tail --count 2000` writing to
/// a file; piped, or with `--quiet`, nothing but the command's own output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_cli_work_shows_progress_on_a_terminal_only() {
    if Command::new("script").arg("--version").output().is_err() {
        panic!("`script` (util-linux) is needed to give the CLI a terminal");
    }
    // Removed when the test ends, however it ends.
    let kept = ojs_bridge_tests::tempdir::TempDir::new("proc-progress");
    let dir = kept.path().to_path_buf();
    let url = format!("local:{}", dir.display());
    let mut ndjson = String::new();
    for i in 0..2000 {
        let job = JobEnvelope::new("progress.item", vec![json!(i)]).with_queue("shown");
        ndjson.push_str(&String::from_utf8(job.to_json_vec().unwrap()).unwrap());
        ndjson.push('\n');
    }
    let file = dir.join("jobs.ndjson");
    std::fs::write(&file, ndjson).unwrap();
    let bin = env!("CARGO_BIN_EXE_ojs-bridge");
    let on_terminal = |command: &str| -> String {
        let out = Command::new("script")
            .args(["-qec", command, "/dev/null"])
            .env("TERM", "xterm")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{command}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let file = file.display();
    let shown = on_terminal(&format!("{bin} send --to {url} {file}"));
    assert!(
        shown.contains("2000/2000") && shown.contains("sent 2000"),
        "{shown:?}"
    );
    let quiet = on_terminal(&format!("{bin} send --quiet --to {url} {file}"));
    assert!(
        !quiet.contains("/2000") && quiet.contains("sent 2000"),
        "{quiet:?}"
    );
    let piped = bin_output(&["send", "--to", &url, &file.to_string()]);
    assert!(!String::from_utf8_lossy(&piped.stderr).contains("/2000"));
    assert_eq!(String::from_utf8_lossy(&piped.stdout).trim(), "sent 2000");
    let lines = dir.join("tail.ndjson");
    let tailed = on_terminal(&format!(
        "{bin} tail --from {url} --queue shown --count 2000 --timeout-secs 2 --ack > {}",
        lines.display()
    ));
    assert!(tailed.contains("2000/2000"), "{tailed:?}");
    assert_eq!(
        std::fs::read_to_string(&lines).unwrap().lines().count(),
        2000
    );
    println!("progress on a terminal: {:?}", shown.lines().last());
}

fn bin_output(args: &[&str]) -> std::process::Output {
    bin().args(args).output().unwrap()
}
