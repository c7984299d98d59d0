//! What the bridge's benches share: the daemon as a process of its own,
//! rates and latencies, the lines they print.

// Each bench uses its part of this.
#![allow(dead_code)]

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `VmRSS` / `VmHWM` (the `field` of `/proc/<pid>/status`) of a process, in
/// MiB.
pub fn rss_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024.0
}

/// A process serving HTTP on a free loopback port; killed by its PID when
/// dropped.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub _dir: ojs_bridge_tests::tempdir::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ojs-bridge run` with `config` in a fresh directory.
pub fn daemon(config: &str) -> Server {
    spawn_daemon(config, false)
}

/// `ojs-bridge run` under callgrind, which counts the instructions it runs
/// (see [`Instructions`]). It runs some 50 times slower: only the count is
/// worth reading.
pub fn daemon_under_callgrind(config: &str) -> Server {
    spawn_daemon(config, true)
}

fn spawn_daemon(config: &str, under_callgrind: bool) -> Server {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("api-bench");
    let file = dir.path().join("bridge.toml");
    // `OJS_API_BENCH_THREADS=N`: the daemon's runtime with N threads.
    let threads = std::env::var("OJS_API_BENCH_THREADS")
        .map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default();
    std::fs::write(&file, format!("{threads}{config}")).unwrap();
    let program = env!("CARGO_BIN_EXE_ojs-bridge");
    let mut command = if under_callgrind {
        let mut c = Command::new("valgrind");
        c.arg("--tool=callgrind")
            // Valgrind's own lines and the profile stay out of the daemon's
            // stderr, which says where it listens.
            .arg(format!(
                "--log-file={}",
                dir.path().join("valgrind.log").display()
            ))
            // `OJS_BENCH_CALLGRIND_OUT=<dir>` keeps each counted part's
            // profile there, for `callgrind_annotate`.
            .arg(format!(
                "--callgrind-out-file={}/callgrind.out.%p",
                std::env::var("OJS_BENCH_CALLGRIND_OUT")
                    .unwrap_or_else(|_| dir.path().display().to_string())
            ))
            .arg(program);
        c
    } else {
        Command::new(program)
    };
    let mut child = command
        .current_dir(dir.path())
        .env("OJS_BRIDGE_HTTP_LISTEN", "127.0.0.1:0")
        .env(
            "OJS_BRIDGE_LOG",
            std::env::var("OJS_BENCH_DAEMON_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .args(["run", "--config", file.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = listening(&mut child, "health on http://");
    Server {
        child,
        addr,
        _dir: dir,
    }
}

/// Reads stderr until the line that says where the process listens; the
/// rest of stderr is drained (and shown) in the background.
pub fn listening(child: &mut Child, marker: &str) -> SocketAddr {
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the server says where it listens")
            .unwrap();
        if let Some(rest) = line.split(marker).nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            eprintln!("  [server] {line}");
        }
    });
    addr
}

/// Rate and latency of one side.
pub struct Measured {
    pub jobs_per_s: f64,
    pub p50: Duration,
    pub p99: Duration,
}

impl Measured {
    pub fn from(jobs: usize, elapsed: Duration, mut latencies: Vec<Duration>) -> Measured {
        latencies.sort_unstable();
        let at = |q: f64| {
            latencies
                .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        Measured {
            jobs_per_s: jobs as f64 / elapsed.as_secs_f64(),
            p50: at(0.50),
            p99: at(0.99),
        }
    }
}

pub fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.jobs_per_s.total_cmp(&b.jobs_per_s));
    runs.swap_remove(runs.len() / 2)
}

pub fn line(what: &str, m: &Measured, against: Option<&Measured>) {
    let ratio = against
        .map(|a| format!("  {:.2}× the adapter alone", m.jobs_per_s / a.jobs_per_s))
        .unwrap_or_default();
    println!(
        "  {what:<44} {:>9.0} jobs/s   p50 {:>7.2} ms   p99 {:>7.2} ms{ratio}",
        m.jobs_per_s,
        m.p50.as_secs_f64() * 1e3,
        m.p99.as_secs_f64() * 1e3,
    );
}

/// Whether a backend's case runs: `OJS_API_BENCH_ONLY=embedded|kafka`
/// runs that one alone (unset: both). `memory` (`api_work` only) runs the
/// daemon on the in-process memory broker alone, never by default: a
/// bound on what the broker's own persistence costs the API, not a
/// deployment. Any other value is refused, so that a misspelt backend does
/// not quietly run none or both.
pub fn runs(backend: &str) -> bool {
    match std::env::var("OJS_API_BENCH_ONLY") {
        Err(_) => backend != "memory",
        Ok(only) if only == "embedded" || only == "kafka" || only == "memory" => only == backend,
        Ok(other) => panic!("OJS_API_BENCH_ONLY={other}: embedded, kafka or memory"),
    }
}

/// The embedded adapter in a fresh directory that lives as long as the
/// bench (the adapter-alone side of the API benches).
pub async fn local_adapter() -> std::sync::Arc<dyn ojs_queue::QueueAdapter> {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("api-bench-adapter");
    let url = format!("local:{}", dir.path().display());
    let adapter = ojs_adapter_local::LocalAdapter::open(
        ojs_adapter_local::LocalConfig::from_url(&url).unwrap(),
    )
    .await
    .unwrap();
    ADAPTER_DIRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(dir);
    std::sync::Arc::new(adapter)
}

/// The directories of the embedded adapters [`local_adapter`] opened, kept
/// until the bench ends: an adapter's files stay open until its last task
/// ends, after the round that used it. (They were left behind, tens of MiB
/// each run.)
static ADAPTER_DIRS: std::sync::Mutex<Vec<ojs_bridge_tests::tempdir::TempDir>> =
    std::sync::Mutex::new(Vec::new());

/// Removes the directories of every adapter [`local_adapter`] opened; for
/// the end of a bench's `main`.
pub fn remove_adapter_dirs() {
    ADAPTER_DIRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
}

/// This bench's own executable as the hello-world server (its `main`
/// calls [`serve_hello`] when `OJS_API_BENCH_HELLO` is set).
pub fn hello() -> Server {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("OJS_API_BENCH_HELLO", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = listening(&mut child, "hello on http://");
    Server {
        child,
        addr,
        _dir: ojs_bridge_tests::tempdir::TempDir::new("api-bench-hello"),
    }
}

/// The hello-world endpoint: the listener stack of the daemon (hyper-util
/// auto builder, keep-alive) with nothing behind it.
pub fn serve_hello() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        eprintln!("hello on http://{}/", listener.local_addr().unwrap());
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                    let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                    let mut r = hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(
                        br#"{"job":{"id":"019a0000-0000-7000-8000-000000000000","state":"available"}}"#,
                    )));
                    *r.status_mut() = hyper::StatusCode::CREATED;
                    Ok::<_, std::convert::Infallible>(r)
                });
                let mut builder = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                builder.http1().keep_alive(true);
                let _ = builder
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

/// `n` HTTP/2 connections to the OJS gRPC binding of the daemon at `addr`.
pub async fn grpc_channels(addr: SocketAddr, n: usize) -> Vec<tonic::transport::Channel> {
    let mut channels = Vec::with_capacity(n);
    for _ in 0..n {
        channels.push(
            tonic::transport::Channel::from_shared(format!("http://{addr}"))
                .expect("a URI of an address")
                .tcp_nodelay(true)
                .connect()
                .await
                .expect("the daemon's listener answers"),
        );
    }
    channels
}

/// The latencies every load task measured, together.
pub async fn joined(tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.expect("a load task panicked"));
    }
    latencies
}

/// A keep-alive HTTP/1.1 connection to `addr` (`TCP_NODELAY`), as the
/// benches' workers hold one each.
pub async fn connect(
    addr: SocketAddr,
) -> hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender
}

/// A JSON POST on `sender`'s connection: the status and the answer.
pub async fn post(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let request = hyper::Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// A POST of `body` (JSON text) on `sender`'s connection: the status and
/// the answer read into `T`, as a worker reads it into its own types: the
/// fields it uses, the rest of the answer skipped (`None` when the answer
/// is not a `T`, an error's body say).
pub async fn post_text<T: serde::de::DeserializeOwned>(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    path: &str,
    body: String,
) -> (u16, Option<T>, bytes::Bytes) {
    use http_body_util::BodyExt;
    let request = hyper::Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).ok(), bytes)
}

/// A GET on `sender`'s connection: the status and the answer.
pub async fn get_json(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    path: &str,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let request = hyper::Request::get(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// The work a process does from [`Work::count`] to [`Work::stop`], by
/// `perf stat`: the instructions it retires where the machine has hardware
/// counters, and its CPU time (a software counter, always). A rate on a
/// shared 2-core machine moves from run to run; the work per job moves
/// much less (instructions not at all).
pub struct Work(Option<Child>);

/// What [`Work`] counted.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counted {
    pub instructions: Option<u64>,
    pub cpu_ms: Option<f64>,
}

impl Counted {
    /// Per job: (instructions, CPU µs).
    pub fn per_job(&self, jobs: usize) -> (Option<f64>, Option<f64>) {
        let jobs = jobs.max(1) as f64;
        (
            self.instructions.map(|i| i as f64 / jobs),
            self.cpu_ms.map(|ms| ms * 1e3 / jobs),
        )
    }
}

impl Work {
    pub fn count(pid: u32) -> Work {
        let child = Command::new("perf")
            .args([
                "stat",
                "-x,",
                "-e",
                "instructions,task-clock",
                "-p",
                &pid.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .ok();
        // perf attaches to the process's threads before it counts.
        std::thread::sleep(Duration::from_millis(200));
        Work(child)
    }

    /// What was counted (nothing where perf does not run).
    pub fn stop(self) -> Counted {
        let Some(child) = self.0 else {
            return Counted::default();
        };
        // perf prints its counts when interrupted.
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        let Ok(out) = child.wait_with_output() else {
            return Counted::default();
        };
        let mut counted = Counted::default();
        for l in String::from_utf8_lossy(&out.stderr).lines() {
            // value,unit,event,...; "<not supported>" without a PMU.
            let fields: Vec<&str> = l.split(',').collect();
            if fields.len() < 3 {
                continue;
            }
            if fields[2].starts_with("instructions") {
                counted.instructions = fields[0].parse().ok();
            } else if fields[2].starts_with("task-clock") {
                counted.cpu_ms = fields[0].parse().ok();
            }
        }
        counted
    }
}

/// Whether [`daemon_under_callgrind`] can run here: valgrind is installed
/// and `OJS_BENCH_CALLGRIND` is not `0` (a round under callgrind takes a
/// minute or more).
pub fn callgrind_available() -> bool {
    std::env::var("OJS_BENCH_CALLGRIND").map_or(true, |v| v != "0")
        && Command::new("callgrind_control")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        && Command::new("valgrind")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// The instructions a process under callgrind runs from
/// [`Instructions::count`] to [`Instructions::stop`], all its threads: the
/// count where the machine has no hardware counters (a virtual machine's
/// `perf stat` has none). Callgrind runs one thread at a time, so batches
/// that form from concurrent requests (group commits) may differ from a
/// native run's; the count still moves far less than a rate.
pub struct Instructions(u32);

impl Instructions {
    pub fn count(pid: u32) -> Instructions {
        let zeroed = Command::new("callgrind_control")
            .args(["--zero", &pid.to_string()])
            .output()
            .unwrap();
        assert!(
            zeroed.status.success(),
            "callgrind_control --zero: {}",
            String::from_utf8_lossy(&zeroed.stderr)
        );
        Instructions(pid)
    }

    /// The sum over the threads of what `callgrind_control -e Ir` prints.
    pub fn stop(self) -> u64 {
        let out = Command::new("callgrind_control")
            .args(["-e", "Ir", &self.0.to_string()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let counts: Vec<u64> = text
            .lines()
            // "Th 9  1,234" and "Th10  1,234".
            .filter_map(|l| l.trim().strip_prefix("Th"))
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter_map(|n| n.replace(',', "").parse().ok())
            .collect();
        assert!(
            !counts.is_empty(),
            "callgrind_control -e Ir printed: {text}"
        );
        if std::env::var_os("OJS_BENCH_CALLGRIND_OUT").is_some() {
            let dumped = Command::new("callgrind_control")
                .args(["--dump=counted", &self.0.to_string()])
                .output()
                .unwrap();
            assert!(dumped.status.success(), "callgrind_control --dump failed");
        }
        counts.iter().sum()
    }
}

/// The median of what was counted in each round (per job), where it was.
pub fn median_per_job(rounds: &[(Option<f64>, Option<f64>)]) -> (Option<f64>, Option<f64>) {
    let mid = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    (
        mid(rounds.iter().filter_map(|r| r.0).collect()),
        mid(rounds.iter().filter_map(|r| r.1).collect()),
    )
}

/// The daemon's work per job, as printed beside a rate.
pub fn work_line(what: &str, (instructions, cpu_us): (Option<f64>, Option<f64>)) {
    let instructions = instructions.map_or_else(
        || "instructions not counted (no hardware counters)".to_owned(),
        |i| format!("{:.0} instructions", i),
    );
    let cpu = cpu_us.map_or_else(
        || "CPU not counted".to_owned(),
        |c| format!("{c:.1} µs CPU"),
    );
    println!("  {what}: daemon per job {cpu}, {instructions}");
}
