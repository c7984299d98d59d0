//! Helpers shared by the daemon test binaries.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_bridge::config::BridgeConfig;
use ojs_bridge::daemon::{Daemon, RunSummary};
use ojs_bridge::metrics::Metrics;
use ojs_grpcq as grpcq;
use ojs_queue::{ConsumerOptions, Delivery, QueueAdapter, Source};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A daemon running in this process.
pub struct Running {
    pub stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<RunSummary>,
    pub http: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
}

impl Running {
    /// Signals shutdown and waits for the run to return.
    pub async fn shutdown(mut self) -> RunSummary {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.unwrap()
    }
}

/// Parses `toml` and runs a daemon with `provided` adapters.
pub async fn start(toml: &str, provided: BTreeMap<String, Arc<dyn QueueAdapter>>) -> Running {
    let config = BridgeConfig::parse(toml, "test config", &[]).unwrap();
    let daemon = Daemon::start_with(config, provided).await.unwrap();
    let http = daemon.http_addr();
    let metrics = daemon.metrics();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(daemon.run(async move {
        let _ = stopped.await;
    }));
    Running {
        stop: Some(stop),
        task,
        http,
        metrics,
    }
}

/// A grpcq call with metadata, numbered.
pub fn call(i: usize, topic: &str, action: &str) -> grpcq::Message {
    let mut msg = grpcq::Message {
        originator: "test-service-pod-1".into(),
        topic: topic.into(),
        action: action.into(),
        payload: format!("request-{i}").into_bytes(),
        message_id: uuid::Uuid::new_v4().to_string(),
        timestamp_ms: 1_763_700_000_000 + i as i64,
        metadata: Default::default(),
    };
    msg.metadata.insert(
        "traceparent".into(),
        format!("00-{:032x}-{:016x}-01", i + 1, i + 1),
    );
    msg.metadata.insert("tenant".into(), "acme".into());
    msg
}

/// Receives from `queue` (or its dead letters) until `want` deliveries or
/// `idle` without one, acking each.
pub async fn collect(
    adapter: &dyn QueueAdapter,
    queue: &str,
    source: Source,
    want: usize,
    idle: Duration,
) -> Vec<Delivery> {
    let options = ConsumerOptions {
        group: format!("collect-{}", uuid::Uuid::new_v4().simple()),
        source,
        ..ConsumerOptions::default()
    };
    let mut consumer = adapter.consumer(queue, options).await.unwrap();
    let mut out = Vec::new();
    let mut last = Instant::now();
    while out.len() < want && last.elapsed() < idle {
        let batch = consumer
            .receive(500, Duration::from_millis(200))
            .await
            .unwrap();
        if !batch.is_empty() {
            last = Instant::now();
        }
        for d in batch {
            d.ack().await.unwrap();
            out.push(d);
        }
    }
    consumer.close().await.unwrap();
    out
}

/// `GET path` on the daemon's endpoint: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of a Prometheus sample line `name{labels} value`.
pub fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}

/// Runs the `ojs-bridge` binary with `args`, `stdin` written to it, as a
/// user runs it.
pub fn ojs_bridge(args: &[&str], stdin: &[u8]) -> std::process::Output {
    ojs_bridge_in(&std::env::current_dir().unwrap(), args, stdin)
}

/// A real in-memory broker behind a sink with the knobs tests turn: an
/// outage (every publish fails with a retryable broker error), a slow first
/// publish, names it reserves (as broker adapters reserve their dead-letter
/// and retry names), and counted health checks.
#[derive(Debug)]
pub struct TestSink {
    pub inner: ojs_adapter_memory::MemoryAdapter,
    pub down: Arc<std::sync::atomic::AtomicBool>,
    pub health_probes: Arc<std::sync::atomic::AtomicUsize>,
    first_publish_delay: Option<Duration>,
    first: std::sync::atomic::AtomicBool,
    reserved_suffix: Option<&'static str>,
}

impl TestSink {
    /// The memory broker called `name`, working.
    pub fn new(name: &str) -> Self {
        TestSink {
            inner: ojs_adapter_memory::MemoryAdapter::named(name),
            down: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            health_probes: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            first_publish_delay: None,
            first: std::sync::atomic::AtomicBool::new(true),
            reserved_suffix: None,
        }
    }

    /// Its first publish waits `delay` before it goes through.
    pub fn slow_first_publish(mut self, delay: Duration) -> Self {
        self.first_publish_delay = Some(delay);
        self
    }

    /// Names ending in `suffix` are reserved.
    pub fn reserving(mut self, suffix: &'static str) -> Self {
        self.reserved_suffix = Some(suffix);
        self
    }

    /// Starts down (publishes fail until `down` is cleared).
    pub fn starting_down(self) -> Self {
        self.down.store(true, std::sync::atomic::Ordering::SeqCst);
        self
    }
}

#[async_trait::async_trait]
impl QueueAdapter for TestSink {
    fn kind(&self) -> &'static str {
        "test-sink"
    }
    fn max_message_bytes(&self) -> usize {
        self.inner.max_message_bytes()
    }
    async fn publish(
        &self,
        queue: &str,
        messages: Vec<ojs_queue::OutgoingMessage>,
    ) -> ojs_queue::Result<()> {
        use std::sync::atomic::Ordering;
        if self.down.load(Ordering::SeqCst) {
            return Err(ojs_queue::Error::Publish(ojs_queue::PublishFailure::all(
                messages,
                || ojs_queue::Error::broker("test-sink", "sink is down", true),
            )));
        }
        if let Some(delay) = self.first_publish_delay {
            if self.first.swap(false, Ordering::SeqCst) {
                tokio::time::sleep(delay).await;
            }
        }
        self.inner.publish(queue, messages).await
    }
    async fn consumer(
        &self,
        queue: &str,
        options: ConsumerOptions,
    ) -> ojs_queue::Result<Box<dyn ojs_queue::Consumer>> {
        self.inner.consumer(queue, options).await
    }
    fn is_reserved(&self, queue: &str) -> bool {
        self.reserved_suffix.is_some_and(|s| queue.ends_with(s))
    }
    async fn health(&self) -> ojs_queue::Health {
        self.health_probes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.health().await
    }
    async fn depth(&self, queue: &str) -> ojs_queue::Result<Option<u64>> {
        self.inner.depth(queue).await
    }
    async fn close(&self) -> ojs_queue::Result<()> {
        self.inner.close().await
    }
}

/// Runs the `ojs-bridge` binary in `dir` (relative paths in its arguments
/// and configuration are from there), `stdin` written to it.
#[allow(dead_code)]
pub fn ojs_bridge_in(dir: &std::path::Path, args: &[&str], stdin: &[u8]) -> std::process::Output {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// A daemon process that is killed (by its PID) when dropped, so that a
/// failing test leaves no daemon behind.
#[allow(dead_code)]
pub struct DaemonProcess(std::process::Child);

impl DaemonProcess {
    /// The daemon's process id.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM (by PID); the daemon must exit 0.
    pub fn stop(mut self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        assert!(self.0.wait().unwrap().success(), "SIGTERM must exit 0");
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts the daemon in `dir` with `config` (a path from there) and waits
/// for its "running" line.
#[allow(dead_code)]
pub fn spawn_daemon_in(dir: &std::path::Path, config: &str) -> DaemonProcess {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"));
    command.current_dir(dir).args(["run", "--config", config]);
    let (child, rx) = start_watched(command);
    std::thread::spawn(move || while rx.recv().is_ok() {});
    DaemonProcess(child)
}

/// Starts the daemon and waits for its "running" line.
pub fn spawn_daemon(config: &std::path::Path) -> std::process::Child {
    let (child, rx) = spawn_daemon_watched(config);
    // Keep draining stderr in the thread; lines go to our stderr.
    std::thread::spawn(move || while rx.recv().is_ok() {});
    child
}

/// [`spawn_daemon`], handing back the daemon's later stderr lines (they
/// are echoed to ours too).
pub fn spawn_daemon_watched(
    config: &std::path::Path,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"));
    command.args(["run", "--config", config.to_str().unwrap()]);
    start_watched(command)
}

/// Runs a daemon `command`, echoes its stderr, and waits for its "running"
/// line; the daemon's later stderr lines.
fn start_watched(
    mut command: std::process::Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            eprintln!("[daemon] {line}");
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
            let _ = child.kill();
            let status = child.wait();
            panic!("the daemon did not report running (exit: {status:?})");
        };
        if line.contains("running") {
            return (child, rx);
        }
    }
}
