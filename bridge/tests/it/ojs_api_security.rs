//! The OJS API facing other services: scoped bearer tokens (401 without a
//! valid one, 403 outside its operations or queues, no token value in any
//! answer or log line) and TLS on the listener (HTTP/1.1 and h2 by ALPN,
//! mutual TLS with a client CA), through a real daemon process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use ojs_bridge_tests::tempdir::TempDir;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};

use crate::ojs_server::{request, Answer, OjsServer};

const JSON: &str = "application/openjobspec+json";

pub(crate) const OPERATOR: &str = "op-7c1d-operator-secret";
pub(crate) const PRODUCER: &str = "pr-41aa-producer-secret";
pub(crate) const AUDITOR: &str = "au-9b2e-auditor-secret";
pub(crate) const OPS: &str = "ad-55f0-ops-secret";

pub(crate) const TOKENS_CONFIG: &str = r#"
[adapters]
local = "local:./ojs-bridge-data"

[http]
token_file = "operator.token"

[api]
adapter = "local"

[[api.tokens]]
name = "producer"
file = "producer.token"
operations = ["push"]
queues = ["orders", "mail.*"]

[[api.tokens]]
name = "auditor"
file = "auditor.token"
operations = ["read"]
queues = ["orders"]

[[api.tokens]]
name = "ops"
file = "ops.token"
operations = ["admin"]
"#;

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Answer {
    let mut headers = vec![("content-type".to_owned(), JSON.to_owned())];
    if let Some(t) = token {
        headers.push(("authorization".to_owned(), format!("Bearer {t}")));
    }
    let body = body.map(|b| b.to_string().into_bytes());
    request(addr, method, path, &headers, body.as_deref()).await
}

fn job(queue: &str) -> Value {
    json!({"type": "scope.check", "args": [queue], "options": {"queue": queue}})
}

fn code(a: &Answer) -> String {
    a.json()["error"]["code"].as_str().unwrap_or("").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_allow_their_operations_on_their_queues_and_nothing_else() {
    let dir = TempDir::new("ojs-api-tokens");
    for (file, secret) in [
        ("operator.token", OPERATOR),
        ("producer.token", PRODUCER),
        ("auditor.token", AUDITOR),
        // Surrounding whitespace (an editor's newline) is not the token's.
        ("ops.token", &format!("  {OPS}\n") as &str),
    ] {
        std::fs::write(dir.path().join(file), secret).unwrap();
    }
    let server =
        OjsServer::start_with(dir, Some(TOKENS_CONFIG), &[("OJS_BRIDGE_LOG", "trace")]).await;
    let addr = server.addr;
    let mut answers = Vec::new();

    // No token, a wrong one, another scheme: 401 with the binding's body.
    for token in [None, Some("nope"), Some(&PRODUCER[..10])] {
        let a = call(addr, "POST", "/ojs/v1/jobs", token, Some(&job("orders"))).await;
        assert_eq!(a.status, 401, "{token:?}: {:?}", a.body);
        assert_eq!(code(&a), "unauthenticated");
        assert_eq!(a.header("www-authenticate").as_deref(), Some("Bearer"));
        assert!(a.header("x-request-id").is_some());
        answers.push(a);
    }
    let basic = request(
        addr,
        "GET",
        "/ojs/manifest",
        &[("authorization".into(), format!("Basic {PRODUCER}"))],
        None,
    )
    .await;
    assert_eq!(basic.status, 401);
    assert_eq!(
        call(addr, "GET", "/ojs/manifest", Some(AUDITOR), None)
            .await
            .status,
        200
    );

    // The producer pushes to its queues only; a batch that strays is
    // refused whole.
    let orders = call(
        addr,
        "POST",
        "/ojs/v1/jobs",
        Some(PRODUCER),
        Some(&job("orders")),
    )
    .await;
    assert_eq!(orders.status, 201, "{:?}", orders.body);
    let orders_id = orders.json()["job"]["id"].as_str().unwrap().to_owned();
    let mail = call(
        addr,
        "POST",
        "/ojs/v1/jobs",
        Some(PRODUCER),
        Some(&job("mail.eu")),
    )
    .await;
    assert_eq!(mail.status, 201, "{:?}", mail.body);
    let mail_id = mail.json()["job"]["id"].as_str().unwrap().to_owned();
    let billing = call(
        addr,
        "POST",
        "/ojs/v1/jobs",
        Some(PRODUCER),
        Some(&job("billing")),
    )
    .await;
    assert_eq!(billing.status, 403, "{:?}", billing.body);
    assert_eq!(code(&billing), "permission_denied");
    assert!(billing.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("billing"));
    let stray_id = ojs_core::envelope::new_job_id();
    let mut first = job("orders");
    first["id"] = json!(stray_id);
    let batch = call(
        addr,
        "POST",
        "/ojs/v1/jobs/batch",
        Some(PRODUCER),
        Some(&json!({"jobs": [first, job("billing")]})),
    )
    .await;
    assert_eq!(batch.status, 403, "{:?}", batch.body);
    let stray = call(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{stray_id}"),
        Some(OPS),
        None,
    )
    .await;
    assert_eq!(stray.status, 404, "a refused batch stores nothing");
    // …and reads nothing.
    let peek = call(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{orders_id}"),
        Some(PRODUCER),
        None,
    )
    .await;
    assert_eq!(peek.status, 403);

    // The auditor reads its queue only, and changes nothing.
    let info = call(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{orders_id}"),
        Some(AUDITOR),
        None,
    )
    .await;
    assert_eq!(info.status, 200, "{:?}", info.body);
    assert_eq!(info.json()["job"]["queue"], "orders");
    let other = call(
        addr,
        "GET",
        &format!("/ojs/v1/jobs/{mail_id}"),
        Some(AUDITOR),
        None,
    )
    .await;
    // Outside its queues a job does not exist for it: nothing says where.
    assert_eq!(other.status, 404, "{:?}", other.body);
    assert_eq!(code(&other), "not_found");
    assert!(!String::from_utf8_lossy(&other.body).contains("mail"));
    let push = call(
        addr,
        "POST",
        "/ojs/v1/jobs",
        Some(AUDITOR),
        Some(&job("orders")),
    )
    .await;
    assert_eq!(push.status, 403);
    let cancel = call(
        addr,
        "DELETE",
        &format!("/ojs/v1/jobs/{orders_id}"),
        Some(AUDITOR),
        None,
    )
    .await;
    assert_eq!(cancel.status, 403);
    let queues = call(addr, "GET", "/ojs/v1/queues", Some(AUDITOR), None).await;
    assert_eq!(queues.status, 200);
    let names: Vec<String> = queues.json()["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, vec!["orders".to_owned()]);
    let events = call(addr, "GET", "/ojs/v1/events", Some(AUDITOR), None).await;
    assert_eq!(events.status, 200);
    let event_queues: Vec<Value> = events.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["queue"].clone())
        .collect();
    assert!(!event_queues.is_empty());
    assert!(
        event_queues.iter().all(|q| q == "orders"),
        "{event_queues:?}"
    );
    let all = call(addr, "GET", "/ojs/v1/queues", Some(OPS), None).await;
    assert_eq!(all.json()["queues"].as_array().unwrap().len(), 2);

    // Admin cancels anywhere; the operator's token (http.token_file) does
    // everything and also opens health and metrics, which the API's tokens
    // do not.
    let cancel = call(
        addr,
        "DELETE",
        &format!("/ojs/v1/jobs/{mail_id}"),
        Some(OPS),
        None,
    )
    .await;
    assert_eq!(cancel.status, 200, "{:?}", cancel.body);
    assert_eq!(cancel.json()["job"]["state"], "cancelled");
    let by_operator = call(
        addr,
        "POST",
        "/ojs/v1/jobs",
        Some(OPERATOR),
        Some(&job("anything")),
    )
    .await;
    assert_eq!(by_operator.status, 201);
    assert_eq!(
        call(addr, "GET", "/ojs/v1/health", Some(OPERATOR), None)
            .await
            .status,
        200
    );
    assert_eq!(
        call(addr, "GET", "/metrics", Some(OPERATOR), None)
            .await
            .status,
        200
    );
    for token in [None, Some(OPS)] {
        let health = call(addr, "GET", "/ojs/v1/health", token, None).await;
        assert_eq!(health.status, 401, "{token:?}");
    }
    answers.extend([
        orders,
        billing,
        batch,
        peek,
        other,
        push,
        cancel,
        by_operator,
    ]);

    // No answer and no log line, even at trace, holds a token.
    let log = server.log();
    assert!(log.contains("producer"), "the log names tokens by name");
    for secret in [OPERATOR, PRODUCER, AUDITOR, OPS] {
        assert!(!log.contains(secret), "the log holds a token");
        for a in &answers {
            assert!(!String::from_utf8_lossy(&a.body).contains(secret));
            assert!(a.headers.iter().all(|(_, v)| !v.contains(secret)));
        }
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_settings_that_cannot_work_are_refused_at_start_naming_the_field() {
    let dir = TempDir::new("ojs-api-bad-tokens");
    for (file, secret) in [
        ("producer.token", PRODUCER),
        ("auditor.token", AUDITOR),
        ("ops.token", OPS),
        ("empty.token", "\n"),
    ] {
        std::fs::write(dir.path().join(file), secret).unwrap();
    }
    let config = format!(
        "{}\n[[api.tokens]]\nname = \"producer\"\nfile = \"empty.token\"\noperations = [\"push\", \"delete\"]\n\n[[api.tokens]]\nname = \"x\"\nfile = \"missing.token\"\noperations = []\n",
        TOKENS_CONFIG.replace("token_file = \"operator.token\"\n", "")
    );
    std::fs::write(dir.path().join("bridge.toml"), &config).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .args(["check-config", "bridge.toml"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for field in [
        "api.tokens[3].name",
        "api.tokens[3].operations",
        "api.tokens[4].operations",
    ] {
        assert!(text.contains(field), "{field} missing from: {text}");
    }
    // Files are checked too, and a valid file with an empty token is
    // refused when the daemon starts.
    let fixed = config
        .replace("[\"push\", \"delete\"]", "[\"push\"]")
        .replace(
            "name = \"producer\"\nfile = \"empty.token\"",
            "name = \"spare\"\nfile = \"empty.token\"",
        )
        .replace("operations = []", "operations = [\"read\"]");
    std::fs::write(dir.path().join("bridge.toml"), &fixed).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .args(["check-config", "bridge.toml"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("api.tokens[4].file") && text.contains("missing.token"),
        "{text}"
    );
    std::fs::write(dir.path().join("missing.token"), OPS).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .args(["check-config", "bridge.toml"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("api.tokens[3].file") && text.contains("is empty"),
        "{text}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .env("OJS_BRIDGE_HTTP_LISTEN", "127.0.0.1:0")
        .args(["run", "--config", "bridge.toml"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("api.tokens[3].file"), "{text}");
    assert!(!text.contains(OPS), "{text}");
}

/// The throwaway CA and certificates of `scripts/brokers.sh up tls`.
pub(crate) fn tls_dir() -> Option<std::path::PathBuf> {
    match std::env::var("OJS_BRIDGE_TEST_TLS_DIR") {
        Ok(d) if Path::new(&d).join("server.pem").exists() => Some(d.into()),
        _ => {
            ojs_bridge_tests::brokers::missing::<()>(
                "OJS_BRIDGE_TEST_TLS_DIR",
                "no test certificates (scripts/brokers.sh up tls)",
            );
            None
        }
    }
}

/// A TLS client of the test CA, with a client certificate or none, offering
/// one ALPN protocol.
pub(crate) fn connector(tls: &Path, client: bool, alpn: &[u8]) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(tls.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = if client {
        let chain = CertificateDer::pem_file_iter(tls.join("client.pem"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(tls.join("client.key")).unwrap();
        builder.with_client_auth_cert(chain, key).unwrap()
    } else {
        builder.with_no_client_auth()
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One request over TLS; `Err` when the handshake or the request failed.
async fn tls_request(
    addr: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, String, Value), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let alpn = stream
        .get_ref()
        .1
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).to_string())
        .unwrap_or_default();
    let io = hyper_util::rt::TokioIo::new(stream);
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("https://localhost:{}{path}", addr.port()))
        .header("content-type", JSON)
        .body(Full::new(Bytes::from(
            body.map(Value::to_string).unwrap_or_default(),
        )))
        .unwrap();
    let response = if alpn == "h2" {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        sender.send_request(request).await
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        sender.send_request(request).await
    }
    .map_err(|e| format!("request: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((
        status,
        alpn,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_speaks_tls_with_alpn_and_mutual_tls_with_a_client_ca() {
    let Some(tls) = tls_dir() else {
        return;
    };
    let pem = |f: &str| tls.join(f).display().to_string();
    let base = format!(
        "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n\n[http]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
        pem("server.pem"),
        pem("server.key")
    );
    let api = "\n[api]\nadapter = \"local\"\n";
    let server = OjsServer::start(Some(&format!("{base}{api}"))).await;
    assert!(
        server.log().contains("health on https://"),
        "{}",
        server.log()
    );
    let addr = server.addr;
    for alpn in [&b"http/1.1"[..], b"h2"] {
        let c = connector(&tls, false, alpn);
        let (status, got, body) = tls_request(addr, &c, "POST", "/ojs/v1/jobs", Some(&job("tls")))
            .await
            .unwrap();
        assert_eq!(status, 201, "{body}");
        assert_eq!(got.as_bytes(), alpn);
        let id = body["job"]["id"].as_str().unwrap();
        let (status, _, info) = tls_request(addr, &c, "GET", &format!("/ojs/v1/jobs/{id}"), None)
            .await
            .unwrap();
        assert_eq!(
            (status, info["job"]["state"].as_str()),
            (200, Some("available"))
        );
    }
    // Plain HTTP on the TLS port gets no answer, and the listener goes on.
    assert_eq!(
        crate::ojs_server::try_request(addr, "GET", "/ojs/v1/health", b"").await,
        None
    );
    let c = connector(&tls, false, b"http/1.1");
    assert_eq!(
        tls_request(addr, &c, "GET", "/ojs/v1/health", None)
            .await
            .unwrap()
            .0,
        200
    );
    server.stop();

    // Mutual TLS: a client without a certificate is refused in the
    // handshake; one the CA signed is served.
    let mutual = format!("{base}tls_client_ca_file = \"{}\"\n{api}", pem("ca.pem"));
    let server = OjsServer::start(Some(&mutual)).await;
    let anonymous = connector(&tls, false, b"http/1.1");
    let refused = tls_request(server.addr, &anonymous, "GET", "/ojs/manifest", None).await;
    assert!(refused.is_err(), "{refused:?}");
    let known = connector(&tls, true, b"h2");
    let (status, alpn, manifest) = tls_request(server.addr, &known, "GET", "/ojs/manifest", None)
        .await
        .unwrap();
    assert_eq!((status, alpn.as_str()), (200, "h2"));
    assert_eq!(manifest["implementation"]["name"], "ojs-bridge");
    server.stop();

    // A key without its certificate is refused before anything is served.
    let dir = TempDir::new("ojs-api-tls-bad");
    std::fs::write(
        dir.path().join("bridge.toml"),
        format!(
            "[adapters]\nlocal = \"local:./d\"\n[http]\ntls_key_file = \"{}\"\ntls_client_ca_file = \"{}\"\n[api]\nadapter = \"local\"\n",
            pem("server.key"),
            pem("ca.pem")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .current_dir(dir.path())
        .args(["check-config", "bridge.toml"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("http.tls_cert_file") && text.contains("http.tls_client_ca_file"),
        "{text}"
    );
    assert!(!text.contains("PRIVATE KEY"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_header_and_a_body_that_stalls_get_answers_and_the_listener_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[http]\nidle_timeout = \"2s\"\n[api]\nadapter = \"local\"\n";
    let server = OjsServer::start(Some(config)).await;
    let addr = server.addr;
    let answer_of = |mut s: tokio::net::TcpStream| async move {
        let mut text = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut text))
            .await;
        String::from_utf8_lossy(&text).to_string()
    };

    // A 1 MiB header: refused before any of it is kept.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let huge = "x".repeat(1 << 20);
    let head = format!("POST /ojs/v1/jobs HTTP/1.1\r\nHost: x\r\nX-Filler: {huge}\r\nContent-Length: 2\r\n\r\n{{}}");
    let _ = s.write_all(head.as_bytes()).await;
    let text = answer_of(s).await;
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "{}",
        &text[..text.len().min(200)]
    );

    // Half a body, then nothing: 408 within idle_timeout, the connection
    // closed, nothing stored.
    let id = ojs_core::envelope::new_job_id();
    let body = json!({"type": "a.b", "args": [1], "id": id}).to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "POST /ojs/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            &body[..body.len() / 2]
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let text = answer_of(s).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"invalid_request\""), "{text}");
    assert!(started.elapsed() < std::time::Duration::from_secs(8));
    let info = call(addr, "GET", &format!("/ojs/v1/jobs/{id}"), None, None).await;
    assert_eq!(info.status, 404);

    // The listener still serves.
    let a = call(addr, "POST", "/ojs/v1/jobs", None, Some(&job("after"))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    server.stop();
}
