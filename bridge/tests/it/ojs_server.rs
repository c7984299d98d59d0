//! A real `ojs-bridge run` process serving the OJS API on a free loopback
//! port, and a plain HTTP/1.1 client for it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use ojs_bridge_tests::tempdir::TempDir;
use serde_json::{json, Value};

/// A daemon process in a directory of its own; killed (by its PID) when
/// dropped.
pub struct OjsServer {
    child: Child,
    pub addr: SocketAddr,
    pub dir: TempDir,
    /// Every line the daemon wrote to stderr so far.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl OjsServer {
    /// `ojs-bridge run` (with `config` as its file, else the built-in
    /// default) in a fresh directory, listening on a free port.
    pub async fn start(config: Option<&str>) -> OjsServer {
        let dir = TempDir::new("ojs-api");
        OjsServer::start_in(dir, config).await
    }

    /// The same in `dir` (a restart keeps the data directory).
    pub async fn start_in(dir: TempDir, config: Option<&str>) -> OjsServer {
        OjsServer::start_with(dir, config, &[]).await
    }

    /// The same with environment variables for the daemon.
    pub async fn start_with(dir: TempDir, config: Option<&str>, env: &[(&str, &str)]) -> OjsServer {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"));
        command
            .current_dir(dir.path())
            .envs(env.iter().copied())
            .env("OJS_BRIDGE_HTTP_LISTEN", "127.0.0.1:0")
            .arg("run");
        if let Some(text) = config {
            let file: PathBuf = dir.path().join("bridge.toml");
            std::fs::write(&file, text).unwrap();
            command.args(["--config", file.to_str().unwrap()]);
        }
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        // Killed if this start is dropped (a failing test's other tasks
        // cancelled) or panics before the server is made: a `Child` alone
        // is left running, holding its connections (PostgreSQL's among
        // them) after the test has ended.
        let mut starting = Starting(Some(child));
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                eprintln!("[daemon] {line}");
                kept.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let addr = tokio::task::spawn_blocking(move || loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("the daemon says where it listens");
            if let Some(rest) = line
                .split("health on http://")
                .nth(1)
                .or_else(|| line.split("health on https://").nth(1))
            {
                let addr = rest.split('/').next().unwrap();
                break addr.parse::<SocketAddr>().unwrap();
            }
        })
        .await
        .unwrap();
        OjsServer {
            child: starting.0.take().unwrap(),
            addr,
            dir,
            log,
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the daemon logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// SIGKILL by PID (`Child::kill`). Hands back its directory.
    pub fn kill(mut self) -> TempDir {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let dir = TempDir::new("ojs-api-moved");
        std::mem::replace(&mut self.dir, dir)
    }

    /// SIGTERM by PID; the daemon must exit 0. Hands back its directory.
    pub fn stop(self) -> TempDir {
        self.terminate();
        self.wait_exit(Duration::from_secs(30))
    }

    /// SIGTERM by PID, without waiting.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the daemon to exit 0 (at most `limit`); hands back its
    /// directory.
    pub fn wait_exit(mut self, limit: Duration) -> TempDir {
        // Bounded: a daemon that does not exit fails the test, it does not
        // hang it.
        let deadline = std::time::Instant::now() + limit;
        let exited = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the daemon did not exit within {limit:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(exited.success(), "SIGTERM must exit 0");
        let dir = TempDir::new("ojs-api-moved");
        std::mem::replace(&mut self.dir, dir)
    }
}

/// A daemon that has not said where it listens yet: killed when dropped.
struct Starting(Option<Child>);

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OjsServer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Answer {
    /// A header's value (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// One request on a new connection.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&[u8]>,
) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (k, v) in headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    let request = builder
        .body(Full::new(Bytes::from(
            body.map(<[u8]>::to_vec).unwrap_or_default(),
        )))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}

/// A JSON POST.
pub async fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Answer {
    request(
        addr,
        "POST",
        path,
        &[("content-type".into(), "application/openjobspec+json".into())],
        Some(body.to_string().as_bytes()),
    )
    .await
}

/// A GET.
pub async fn get(addr: SocketAddr, path: &str) -> Answer {
    request(addr, "GET", path, &[], None).await
}

/// A JSON POST on a new connection; its status, or `None` when the
/// connection failed (the daemon is gone).
pub async fn try_request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Option<u16> {
    try_answer(addr, method, path, body)
        .await
        .map(|(status, _)| status)
}

/// The same with the answer's body, when it came whole.
pub async fn try_answer(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> Option<(u16, Bytes)> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .ok()?;
    tokio::spawn(conn);
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/openjobspec+json")
        .body(Full::new(Bytes::from(body.to_vec())))
        .ok()?;
    let response = sender.send_request(request).await.ok()?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

/// `n` jobs of type `work.item` onto `queue` through `addr`, 100 a batch,
/// with `options` (the queue set); their ids.
pub async fn push_all(addr: SocketAddr, queue: &str, n: usize, options: Value) -> Vec<String> {
    let mut ids = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let jobs: Vec<Value> = chunk
            .iter()
            .map(|i| {
                let mut o = options.clone();
                o["queue"] = json!(queue);
                json!({"type": "work.item", "args": [i], "options": o})
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

/// Workers fetching from every replica in turn and acking each job through
/// the next replica (never the one that fetched it) until `want` jobs were
/// completed or nothing came for 15 s; every job id completed.
pub async fn work_across(
    replicas: &[SocketAddr],
    queue: &str,
    workers: usize,
    want: usize,
) -> Vec<String> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (got, replicas, queue) = (got.clone(), replicas.to_vec(), queue.to_owned());
        tasks.push(tokio::spawn(async move {
            let worker = format!("worker-{w}");
            let mut idle_since = Instant::now();
            let mut turn = w;
            while got.lock().unwrap().len() < want && idle_since.elapsed() < Duration::from_secs(15)
            {
                let from = replicas[turn % replicas.len()];
                turn += 1;
                let a = post_json(
                    from,
                    "/ojs/v1/workers/fetch",
                    &json!({"queues": [queue], "count": 10, "worker_id": worker, "wait_ms": 300}),
                )
                .await;
                assert_eq!(a.status, 200, "{:?}", a.body);
                let jobs = a.json()["jobs"].as_array().cloned().unwrap_or_default();
                if !jobs.is_empty() {
                    idle_since = Instant::now();
                }
                for job in jobs {
                    let id = job["id"].as_str().unwrap().to_owned();
                    let to = replicas[turn % replicas.len()];
                    let a = post_json(
                        to,
                        "/ojs/v1/workers/ack",
                        &json!({"job_id": id, "result": {"by": worker}}),
                    )
                    .await;
                    assert_eq!(a.status, 200, "ack of {id}: {:?}", a.body);
                    got.lock().unwrap().push(id);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let got = got.lock().unwrap().clone();
    got
}

/// Prints and returns (duplicated, lost) of `completed` against `sent`.
pub fn tally(what: &str, sent: &[String], completed: &[String]) -> (usize, usize) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for id in completed {
        *counts.entry(id.as_str()).or_default() += 1;
    }
    let duplicated = counts.values().filter(|n| **n > 1).count();
    let lost = sent
        .iter()
        .filter(|id| !counts.contains_key(id.as_str()))
        .count();
    println!(
        "{what}: sent {}, completed {}, duplicated {duplicated}, lost {lost}",
        sent.len(),
        completed.len()
    );
    (duplicated, lost)
}
