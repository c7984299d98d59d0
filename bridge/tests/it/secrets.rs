//! No secret in any output: a secret placed in each kind of place (URL
//! userinfo, a URL query item, an environment variable, a `*_file`, the
//! HTTP token) never appears in stdout, stderr with logs at `trace`,
//! `/metrics`, `/ojs/v1/health` or a `Debug` string — when things work and
//! when they fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::http_get;
use ojs_bridge::config::BridgeConfig;
use ojs_bridge_tests::brokers::{find, missing, rabbitmqctl, unique_queue, Broker};
use ojs_bridge_tests::tempdir::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const USERINFO: &str = "Sec1-userinfo-p4ss";
const QUERY: &str = "Sec2-query-p4ss";
const ENV: &str = "Sec3-env-p4ss";
const FILE: &str = "Sec4-file-p4ss";
const TOKEN: &str = "Sec5-token-t0k3n";
const SCHEME: &str = "Sec6-scheme-p4ss";
/// Not secrets, but never to be logged either.
const PAYLOAD: &str = "payload-marker-1b2c";
const METADATA: &str = "metadata-marker-3d4e";

async fn get_with_token(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    String::from_utf8_lossy(&raw).into_owned()
}

/// Reads a child's pipe to its end in the background: logs at trace
/// would fill a pipe nobody reads and stall the child.
fn read_all(
    mut pipe: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text).await;
        text
    })
}

/// Waits until the daemon on `addr` serves: something listens, and it no
/// longer answers 503 `starting` (the listener is bound before the brokers
/// are reached and answers that meanwhile, to every path).
async fn wait_serving(addr: std::net::SocketAddr, patience: Duration, what: &str) {
    let deadline = Instant::now() + patience;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            let (status, body) = http_get(addr, "/metrics").await;
            if status != 503 || !body.contains("starting") {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what}: nothing serves on {addr} yet"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_clean(what: &str, text: &str) {
    for secret in [USERINFO, QUERY, ENV, FILE, TOKEN, SCHEME] {
        assert!(!text.contains(secret), "{what} shows {secret}:\n{text}");
    }
}

#[test]
fn bad_configs_and_unreachable_brokers_never_echo_a_secret() {
    let dir = TempDir::new("secrets-fail");
    let cases = [
        // A mistyped scheme.
        format!("[adapters]\nk = \"kafkx://u:{SCHEME}@127.0.0.1:9\"\n"),
        // A bad setting next to a secret query item.
        format!("[adapters]\nk = \"kafka://127.0.0.1:9?sasl.password={QUERY}&replication=x\"\n"),
        // Userinfo of a RabbitMQ URL with a bad setting.
        format!("[adapters]\nr = \"amqp://u:{USERINFO}@127.0.0.1:9/%2f?prefetch=0\"\n"),
    ];
    for (i, text) in cases.iter().enumerate() {
        let file = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&file, format!("{text}[[sources]]\nname = \"s\"\nadapter = \"k\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"k\"\n")).unwrap();
        for command in ["check-config", "run"] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"));
            if command == "run" {
                cmd.args(["run", "--config"]);
            } else {
                cmd.arg("check-config");
            }
            let out = cmd
                .arg(&file)
                .env("OJS_BRIDGE_LOG", "trace")
                .output()
                .unwrap();
            assert!(!out.status.success());
            assert_clean(
                &format!("{command} case {i} stdout"),
                &String::from_utf8_lossy(&out.stdout),
            );
            assert_clean(
                &format!("{command} case {i} stderr"),
                &String::from_utf8_lossy(&out.stderr),
            );
        }
    }
    // The OJS API's job store on PostgreSQL: its password shows neither
    // beside a bad setting (check-config) nor when the server is not there
    // (run fails to open the store).
    for (i, extra) in ["state_connections = 0\n", ""].into_iter().enumerate() {
        let file = dir.path().join(format!("pg{i}.toml"));
        std::fs::write(
            &file,
            format!("[http]\nlisten = \"127.0.0.1:0\"\n[adapters]\nlocal = \"local:./pg-data\"\n[api]\nadapter = \"local\"\nstate = \"postgres://u:{USERINFO}@127.0.0.1:1/jobs\"\n{extra}"),
        )
        .unwrap();
        for command in ["check-config", "run"] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"));
            cmd.current_dir(dir.path()).env("OJS_BRIDGE_LOG", "trace");
            if command == "run" {
                cmd.args(["run", "--config"]);
            } else {
                cmd.arg("check-config");
            }
            let out = cmd.arg(&file).output().unwrap();
            // A bad setting fails both; the unreachable server fails run.
            assert_eq!(
                out.status.success(),
                extra.is_empty() && command == "check-config",
                "pg case {i} {command}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_clean(
                &format!("pg case {i} {command} stdout"),
                &String::from_utf8_lossy(&out.stdout),
            );
            assert_clean(
                &format!("pg case {i} {command} stderr"),
                &String::from_utf8_lossy(&out.stderr),
            );
        }
    }
    // A broker that refuses the credentials: the connect error is printed.
    let file = dir.path().join("refused.toml");
    std::fs::write(
        &file,
        format!("[http]\nlisten = \"off\"\n[adapters]\nr = \"amqp://nobody:{USERINFO}@127.0.0.1:1/%2f?publish_timeout_secs=1\"\n[[sources]]\nname = \"s\"\nadapter = \"r\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"r\"\n"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(["run", "--wait-for-brokers=false", "--config"])
        .arg(&file)
        .env("OJS_BRIDGE_LOG", "trace")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("nobody:***@127.0.0.1:1"), "{stderr}");
    assert_clean("unreachable broker stderr", &stderr);
    // Waiting for it (the default): the wait is logged, never with the
    // secret. Stopped after the first attempts.
    let mut child = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(["run", "--config"])
        .arg(&file)
        .env("OJS_BRIDGE_LOG", "trace")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(12));
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("connecting in the background"), "{stderr}");
    assert!(stderr.contains("nobody:***@127.0.0.1:1"), "{stderr}");
    assert_clean("waiting for a broker stderr", &stderr);
    // The CLI, with the secret on its command line.
    let out = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args([
            "tail",
            "--from",
            &format!("amqp://nobody:{USERINFO}@127.0.0.1:1/%2f"),
            "--queue",
            "q",
            "--timeout-secs",
            "1",
        ])
        .env("OJS_BRIDGE_LOG", "trace")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_clean("tail stderr", &String::from_utf8_lossy(&out.stderr));
}

#[test]
fn debug_of_a_config_shows_no_secret() {
    let text = format!(
        r#"
        [adapters.kafka]
        url = "kafka://127.0.0.1:9092?sasl.password={QUERY}"
        librdkafka_options = {{ "sasl.username" = "{ENV}" }}
        [adapters]
        rabbit = "amqp://u:{USERINFO}@h/%2f"
        [[sources]]
        name = "s"
        adapter = "rabbit"
        queue = "q"
        [[routes]]
        name = "r"
        sink = "kafka"
        "#
    );
    let config = BridgeConfig::parse(&text, "t", &[]).unwrap();
    assert_clean("Debug of BridgeConfig", &format!("{config:?} {config:#?}"));
    for (name, entry) in &config.adapters {
        let compiled = entry.compile(name).unwrap();
        assert_clean(
            "Debug of an AdapterConfig",
            &format!("{compiled:?} {compiled:#?}"),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_daemon_logs_serves_and_exits_without_a_secret() {
    let (Some(rabbit), Some(kafka)) = (find(Broker::RabbitMq).await, find(Broker::Kafka).await)
    else {
        return;
    };
    // A RabbitMQ user whose password lives only in a file.
    let user = unique_queue("secrets-user");
    if !rabbitmqctl(&["add_user", &user, FILE]) {
        missing::<()>(
            "rabbitmqctl",
            "cannot add a user (set OJS_BRIDGE_TEST_RABBITMQCTL)",
        );
        return;
    }
    assert!(rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &user,
        ".*",
        ".*",
        ".*"
    ]));
    let dir = TempDir::new("secrets-run");
    let password_file = dir.path().join("rabbit-password");
    std::fs::write(&password_file, format!("{FILE}\n")).unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let host = rabbit.url.rsplit('@').next().unwrap();
    let queue = unique_queue("secrets");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = dir.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            [http]
            listen = "127.0.0.1:{port}"
            token_file = "{}"
            [adapters.rabbit]
            url = "amqp://{user}@{host}"
            password_file = "{}"
            [adapters]
            kafka = "kafka://{}?sasl.password={QUERY}"
            [[sources]]
            name = "calls"
            adapter = "rabbit"
            queue = "{queue}"
            [[routes]]
            name = "jobs"
            sink = "kafka"
            queue = "{queue}"
            "#,
            token_file.display(),
            password_file.display(),
            kafka.url.trim_start_matches("kafka://"),
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(["run", "--config"])
        .arg(&config)
        .env("OJS_BRIDGE_LOG", "trace")
        .env("OJS_BRIDGE_ADAPTER_KAFKA__SASL_USERNAME", ENV)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Read both pipes from the start: trace logs would fill a pipe nobody reads.
    let stdout_task = read_all(child.stdout.take().unwrap());
    let stderr_task = read_all(child.stderr.take().unwrap());
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_serving(addr, Duration::from_secs(30), "the daemon").await;
    // Without the token: 401; with it: health and metrics, free of secrets.
    assert_eq!(http_get(addr, "/metrics").await.0, 401);
    // A call flows through at trace level: its payload and metadata values
    // are never logged either.
    use base64::Engine as _;
    let payload = base64::engine::general_purpose::STANDARD.encode(PAYLOAD);
    let call = format!(
        r#"{{"originator":"o","topic":"a.B","action":"C","payload":"{payload}","message_id":"m-1","timestamp_ms":1704067200000,"metadata":{{"tenant":"{METADATA}"}}}}"#
    );
    let mut send = tokio::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args([
            "send",
            "--to",
            &rabbit.url,
            "--queue",
            &queue,
            "--format",
            "grpcq",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = send.stdin.take().unwrap();
    stdin.write_all(call.as_bytes()).await.unwrap();
    drop(stdin);
    assert!(send.wait().await.unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = get_with_token(addr, "/metrics").await;
        if text.contains("ojs_bridge_acked_total{source=\"calls\"} 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the call was not bridged: {text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for path in ["/ojs/v1/health", "/metrics"] {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8_lossy(&raw);
        assert!(
            text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.1 503"),
            "{text}"
        );
        assert_clean(path, &text);
    }
    // SIGTERM: a clean exit, and everything it printed is clean too.
    let pid = child.id().unwrap();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let out = tokio::time::timeout(Duration::from_secs(60), async {
        let status = child.wait().await.unwrap();
        (
            status,
            stdout_task.await.unwrap(),
            stderr_task.await.unwrap(),
        )
    })
    .await
    .expect("the daemon exits after SIGTERM");
    let (status, stdout, stderr) = out;
    println!(
        "daemon exited {status}; {} lines of trace-level logs",
        stderr.lines().count()
    );
    assert!(stderr.contains(" TRACE "), "trace logging was on: {stderr}");
    assert_clean("stdout", &stdout);
    assert_clean("stderr at trace", &stderr);
    for marker in [PAYLOAD, METADATA] {
        assert!(!stderr.contains(marker), "logs show {marker}");
    }
    rabbitmqctl(&["delete_user", &user]);
}

/// Every form in which a marker could show in output: as text, in base64
/// (standard and URL-safe, at each of the three byte alignments inside a
/// longer buffer), in hex, and as a list of byte values (a `Debug` of
/// bytes, a JSON array).
fn marker_forms(marker: &str) -> Vec<String> {
    use base64::Engine as _;
    let bytes = marker.as_bytes();
    let mut forms = vec![marker.to_owned()];
    for engine in [
        base64::engine::general_purpose::STANDARD_NO_PAD,
        base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        for pad in 0..3usize {
            let mut buf = vec![0u8; pad];
            buf.extend_from_slice(bytes);
            let text = engine.encode(&buf);
            // Characters fed only by the marker's own bits.
            let first = (pad * 8).div_ceil(6);
            let last = (buf.len() * 8) / 6;
            forms.push(text[first..last].to_owned());
        }
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    forms.push(hex.to_uppercase());
    forms.push(hex);
    let values: Vec<String> = bytes.iter().map(u8::to_string).collect();
    forms.push(values.join(", "));
    forms.push(values.join(","));
    forms
}

fn assert_no_content(what: &str, text: &str) {
    for marker in [PAYLOAD, METADATA] {
        for form in marker_forms(marker) {
            assert!(
                !text.contains(&form),
                "{what} shows {marker} as {form:?}:\n{text}"
            );
        }
    }
}

#[test]
fn marker_forms_find_a_marker_inside_encoded_buffers() {
    use base64::Engine as _;
    for prefix in ["", "a", "ab", "abc"] {
        let buffer = format!("{prefix}{PAYLOAD}tail");
        let b64 = base64::engine::general_purpose::STANDARD.encode(&buffer);
        assert!(
            marker_forms(PAYLOAD)
                .iter()
                .any(|f| b64.contains(f.as_str())),
            "{b64}"
        );
    }
    let listed = format!("{:?}", format!("x{METADATA}").into_bytes());
    assert!(marker_forms(METADATA)
        .iter()
        .any(|f| listed.contains(f.as_str())));
}

/// `ojs-bridge` run as a process with logs at `trace`.
fn traced(args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(args)
        .env("OJS_BRIDGE_LOG", "trace")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

/// A job whose args and meta hold the markers, as `send` reads it.
fn marked_job() -> String {
    format!(
        r#"{{"specversion":"1.0","id":"{}","type":"mark.job","queue":"default","args":["{PAYLOAD}"],"meta":{{"authorization":"Bearer {METADATA}"}}}}"#,
        uuid::Uuid::now_v7()
    ) + "\n"
}

/// Runs one adapter through the paths that log while a message is in hand
/// — publish, receive, decode failure, unknown content type, unknown
/// route, dead letter, reading dead letters, an oversized message, and
/// whatever `extra` adds (a broker's own refusals, a reconnect) — with
/// logs at `trace` and the markers in payloads and metadata, and checks
/// every byte the processes wrote to standard error (and JSON logs parse,
/// with `json`).
async fn content_never_reaches_the_log(
    url: &str,
    tag: &str,
    json: bool,
    extra: impl AsyncFnOnce(&str, &str) -> Vec<(String, String)>,
) {
    use base64::Engine as _;
    let queue = unique_queue(tag);
    let (inq, outq) = (format!("{queue}-in"), format!("{queue}-out"));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = TempDir::new("content-logs");
    let config = dir.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            [http]
            listen = "127.0.0.1:{port}"
            [adapters]
            broker = "{url}"
            [[sources]]
            name = "in"
            adapter = "broker"
            queue = "{inq}"
            [[routes]]
            name = "marked"
            match = {{ topic = "mark.*" }}
            sink = "broker"
            queue = "{outq}"
            "#
        ),
    )
    .unwrap();
    let mut outputs: Vec<(String, String)> = Vec::new();
    // Publish: the CLI's path, then the messages the daemon will take.
    let out = traced(&["send", "--to", url, "--queue", &outq], &marked_job());
    assert!(out.status.success(), "{out:?}");
    outputs.push(("send".into(), String::from_utf8_lossy(&out.stderr).into()));
    let adapter = ojs_bridge::endpoint::connect(url).await.unwrap();
    let mut call = ojs_grpcq::Message {
        originator: "o".into(),
        topic: "mark.Service".into(),
        action: "Do".into(),
        payload: PAYLOAD.as_bytes().to_vec(),
        message_id: "m-1".into(),
        timestamp_ms: 1_704_067_200_000,
        metadata: Default::default(),
    };
    call.metadata.insert("tenant".into(), METADATA.into());
    let mut unrouted = call.clone();
    unrouted.topic = "other.Service".into();
    unrouted.message_id = "m-2".into();
    let broken_json =
        format!(r#"{{"type":"mark.job","args":["{PAYLOAD}"],"meta":{{"t":"{METADATA}"}}"#);
    adapter
        .publish(
            &inq,
            vec![
                ojs_grpcq::outgoing(&call),
                ojs_grpcq::outgoing(&unrouted),
                ojs_queue::OutgoingMessage::new(broken_json, "application/openjobspec+json"),
                ojs_queue::OutgoingMessage::new(
                    format!("{PAYLOAD} {METADATA}"),
                    "application/x-marker",
                ),
            ],
        )
        .await
        .unwrap();
    // The daemon: one call bridged, three dead-lettered.
    let mut args = vec!["run", "--config", config.to_str().unwrap()];
    if json {
        args.extend(["--log-format", "json"]);
    }
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(&args)
        .env("OJS_BRIDGE_LOG", "trace")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr_task = read_all(child.stderr.take().unwrap());
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_serving(addr, Duration::from_secs(90), tag).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let text = http_get(addr, "/metrics").await.1;
        if text.contains("ojs_bridge_acked_total{source=\"in\"} 4") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{tag}: the daemon did not settle the four messages: {text}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    outputs.extend(extra(url, &format!("127.0.0.1:{port}")).await);
    let pid = child.id().unwrap();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the daemon exits after SIGTERM")
        .unwrap();
    assert!(status.success());
    let daemon_log = stderr_task.await.unwrap();
    assert!(
        daemon_log.contains(" TRACE ") || daemon_log.contains(r#""level":"TRACE""#),
        "trace logging was on: {daemon_log}"
    );
    if json {
        for line in daemon_log.lines() {
            let event: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
            assert!(
                event["level"].is_string() && event["timestamp"].is_string(),
                "{line}"
            );
            assert!(event["fields"].is_object(), "{line}");
            assert!(
                !line.contains("Some("),
                "Rust debug syntax in a field: {line}"
            );
        }
        assert!(
            daemon_log.contains("\"message\":\"dead-lettering\""),
            "{daemon_log}"
        );
    }
    assert!(
        !daemon_log.contains('\x1b'),
        "no colour codes when standard error is a pipe"
    );
    outputs.push(("daemon".into(), daemon_log));
    // Reading: the bridged job and the dead letters, printed on stdout
    // (that is the command's output) and never in its log.
    let out = traced(
        &[
            "tail",
            "--from",
            url,
            "--queue",
            &outq,
            "--count",
            "2",
            "--timeout-secs",
            "10",
            "--ack",
        ],
        "",
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(printed.lines().count(), 2, "{out:?}");
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(PAYLOAD);
    assert!(
        printed.contains(PAYLOAD) || printed.contains(&b64),
        "the job is printed: {printed}"
    );
    outputs.push(("tail".into(), String::from_utf8_lossy(&out.stderr).into()));
    let out = traced(
        &[
            "tail",
            "--from",
            url,
            "--queue",
            &inq,
            "--dead-letters",
            "--count",
            "3",
            "--timeout-secs",
            "10",
            "--ack",
        ],
        "",
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        3,
        "{out:?}"
    );
    outputs.push((
        "tail --dead-letters".into(),
        String::from_utf8_lossy(&out.stderr).into(),
    ));
    // An oversized message, refused before it leaves.
    let big = format!(
        "{url}{}max_message_bytes=64",
        if url.contains('?') { '&' } else { '?' }
    );
    let out = traced(&["send", "--to", &big, "--queue", &outq], &marked_job());
    assert!(!out.status.success(), "{out:?}");
    outputs.push((
        "oversized send".into(),
        String::from_utf8_lossy(&out.stderr).into(),
    ));
    let mut lines = 0;
    for (what, text) in &outputs {
        lines += text.lines().count();
        assert_no_content(&format!("{tag}: {what} at trace"), text);
        assert_clean(&format!("{tag}: {what} at trace"), text);
    }
    println!(
        "{tag}: {} outputs, {lines} lines at trace, no marker in any form",
        outputs.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_content_never_reaches_the_log_local() {
    let dir = TempDir::new("content-local");
    let url = format!("local://{}", dir.path().display());
    content_never_reaches_the_log(&url, "local", true, async |_, _| Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_content_never_reaches_the_log_kafka() {
    let Some(kafka) = find(Broker::Kafka).await else {
        return;
    };
    content_never_reaches_the_log(&kafka.url, "kafka", false, async |_, _| Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_content_never_reaches_the_log_sqs() {
    let Some(sqs) = find(Broker::Sqs).await else {
        return;
    };
    content_never_reaches_the_log(&sqs.url, "sqs", true, async |_, _| Vec::new()).await;
}

/// RabbitMQ adds its own refusals: a returned (unroutable) publish, a
/// publish the broker nacks (a full queue that rejects publishes), and a
/// reconnect while the daemon runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_content_never_reaches_the_log_rabbitmq() {
    let Some(rabbit) = find(Broker::RabbitMq).await else {
        return;
    };
    if ojs_bridge_tests::independent::available().is_none() {
        missing::<()>("independent clients", "pika is needed to make the queues");
        return;
    }
    content_never_reaches_the_log(&rabbit.url, "rabbitmq", false, async |url, http| {
        let mut outputs = Vec::new();
        let full = unique_queue("content-full");
        ojs_bridge_tests::independent::run(&[
            "rabbit-queue",
            &full,
            "--arg",
            "x-max-length=1",
            "--arg",
            "x-overflow=reject-publish",
        ])
        .unwrap();
        // Returned: amq.direct has no binding for this queue.
        let unroutable = format!(
            "{url}?exchange=amq.direct&queue_template={{queue}}&topology=existing&publish_timeout_secs=2"
        );
        let out = traced(&["send", "--to", &unroutable, "--queue", &full], &marked_job());
        assert!(!out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(text.contains("NO_ROUTE"), "{text}");
        outputs.push(("unroutable send".into(), text));
        // Nacked: the queue holds one; the second publish is refused.
        let direct = format!(
            "{url}?exchange=&queue_template={{queue}}&topology=existing&publish_timeout_secs=2"
        );
        let two = marked_job() + &marked_job();
        let out = traced(&["send", "--to", &direct, "--queue", &full], &two);
        assert!(!out.status.success(), "{out:?}");
        outputs.push(("nacked send".into(), String::from_utf8_lossy(&out.stderr).into()));
        // A refused login: our one warning per attempt, none of lapin's
        // own connection chatter, and never the password.
        let (scheme, rest) = url.split_once("://").unwrap();
        let (userinfo, host) = rest.split_once('@').unwrap_or(("guest", rest));
        let user = userinfo.split(':').next().unwrap_or("guest");
        let refused = format!("{scheme}://{user}:Sec7-wrong-p4ss@{host}");
        let out = traced(&["send", "--to", &refused, "--queue", &full], &marked_job());
        assert!(!out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(text.contains("ACCESS_REFUSED"), "{text}");
        for chatter in ["Exponential backoff", "Connection error", "Sec7-wrong-p4ss"] {
            assert!(!text.contains(chatter), "{chatter:?} in {text}");
        }
        outputs.push(("refused login".into(), text));
        // Reconnect: the broker drops every connection while the daemon runs.
        assert!(rabbitmqctl(&["close_all_connections", "content-log test"]));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let addr: std::net::SocketAddr = http.parse().unwrap();
        let _ = http_get(addr, "/ojs/v1/health").await;
        outputs
    })
    .await;
}
