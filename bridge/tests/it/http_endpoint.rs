//! The health and metrics endpoint as an attacker would use it: idle and
//! slow connections, floods of health requests, missing tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{http_get, start, TestSink};
use ojs_queue::QueueAdapter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(http: &str) -> String {
    let name = uuid::Uuid::new_v4().simple().to_string();
    format!(
        r#"
        [http]
        listen = "127.0.0.1:0"
        {http}
        [adapters]
        mem = "memory://{name}"
        [[sources]]
        name = "calls"
        adapter = "mem"
        queue = "calls"
        [[routes]]
        name = "all"
        sink = "mem"
        "#
    )
}

/// A memory sink whose health checks are counted.
fn counted() -> (Arc<AtomicUsize>, BTreeMap<String, Arc<dyn QueueAdapter>>) {
    let sink = TestSink::new(&uuid::Uuid::new_v4().simple().to_string());
    let probes = sink.health_probes.clone();
    (
        probes,
        BTreeMap::from([("mem".to_owned(), Arc::new(sink) as Arc<dyn QueueAdapter>)]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_health_requests_cause_at_most_one_probe_per_interval() {
    let (probes, sinks) = counted();
    // Room for all 1000 at once: the cap's eviction of a connection that
    // has not sent its head for half a second is tested on its own, and on
    // a loaded machine a client task can take that long between its
    // connect and its write (seen: 194 of 1000 evicted, reset).
    let daemon = start(
        &config("health_interval = \"1s\"\nmax_connections = 2000"),
        sinks,
    )
    .await;
    let addr = daemon.http.unwrap();
    let before = probes.load(Ordering::SeqCst);
    let started = Instant::now();
    let requests =
        (0..1000).map(|_| tokio::spawn(async move { http_get(addr, "/ojs/v1/health").await }));
    let answers = futures::future::join_all(requests).await;
    let elapsed = started.elapsed();
    let ok = answers
        .iter()
        .filter(|a| a.as_ref().is_ok_and(|(status, _)| *status == 200))
        .count();
    let during = probes.load(Ordering::SeqCst) - before;
    // One probe per started interval at most (plus the one in progress).
    let allowed = elapsed.as_secs() as usize + 2;
    println!("1000 health requests in {elapsed:?}: {ok} answered 200, {during} probes (allowed {allowed})");
    assert_eq!(ok, 1000);
    assert!(during <= allowed, "{during} probes in {elapsed:?}");
    // The body says how old each probe is.
    let (_, body) = http_get(addr, "/ojs/v1/health").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["adapters"]["mem"]["age_ms"]
            .as_u64()
            .is_some_and(|a| a < 5_000),
        "{body}"
    );
    daemon.shutdown().await;
}

/// A listening socket's backlog as the kernel holds it: `ss` shows it as
/// the socket's Send-Q.
fn listen_backlog(addr: std::net::SocketAddr) -> u32 {
    let out = std::process::Command::new("ss")
        .args(["-Hltn", &format!("sport = :{}", addr.port())])
        .output()
        .expect("`ss` (Debian's iproute2) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(&addr.to_string()))
        .unwrap_or_else(|| panic!("no listener on {addr} in `ss`: {text}"));
    // State, Recv-Q, Send-Q, local address, peer address.
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_queues_listen_backlog_connections_for_the_accept_loop() {
    // The kernel caps a backlog at net.core.somaxconn.
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // By default 1024, not the 128 of tokio's and the standard library's
    // bind: a burst of connects beyond that had its handshakes dropped.
    let daemon = start(&config(""), BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    assert_eq!(listen_backlog(addr), 1024.min(somaxconn));
    daemon.shutdown().await;
    let daemon = start(&config("listen_backlog = 300"), BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    assert_eq!(listen_backlog(addr), 300.min(somaxconn));
    // Served as before.
    let (status, _) = http_get(addr, "/ojs/v1/health").await;
    assert_eq!(status, 200);
    daemon.shutdown().await;
}

async fn idle_connections(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_idle_connections_do_not_stop_health_from_answering() {
    // Defaults: 256 connections at most, 5 s to send a request head.
    let daemon = start(&config(""), BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    let held = idle_connections(addr, 500).await;
    // A slow client that sends half a request head and stops.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /ojs/v1/health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    for _ in 0..5 {
        let (status, _) =
            tokio::time::timeout(Duration::from_secs(3), http_get(addr, "/ojs/v1/health"))
                .await
                .expect("health answers while 500 idle connections are open");
        assert_eq!(status, 200);
    }
    println!(
        "5 health requests beside 500 idle connections: {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(held);
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_no_request_head_is_closed() {
    let daemon = start(&config("header_read_timeout = \"300ms\""), BTreeMap::new()).await;
    let addr = daemon.http.unwrap();
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(3), idle.read(&mut buf))
        .await
        .expect("the server closes an idle connection");
    // Closed (0 bytes) or answered with 408 and closed; never held open.
    let n = n.unwrap_or(0);
    assert!(
        n == 0 || String::from_utf8_lossy(&buf[..n]).contains("408"),
        "{:?}",
        &buf[..n]
    );
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_guards_health_and_metrics() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("http-token");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cr3t-token-77\n").unwrap();
    let daemon = start(
        &config(&format!("token_file = \"{}\"", token_file.display())),
        BTreeMap::new(),
    )
    .await;
    let addr = daemon.http.unwrap();
    for path in ["/ojs/v1/health", "/metrics"] {
        assert_eq!(http_get(addr, path).await.0, 401, "{path} without a token");
        let wrong = get_with(addr, path, "Bearer s3cr3t-token-78").await;
        assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
        let right = get_with(addr, path, "Bearer s3cr3t-token-77").await;
        assert!(right.starts_with("HTTP/1.1 200"), "{right}");
        assert!(!right.contains("s3cr3t"), "the token is never echoed");
    }
    daemon.shutdown().await;
}

async fn get_with(addr: std::net::SocketAddr, path: &str, authorization: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {authorization}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    String::from_utf8_lossy(&raw).into_owned()
}
