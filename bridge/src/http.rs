//! The daemon's listener: `GET /ojs/v1/health`, `GET /metrics` and, with
//! `[api]`, the OJS HTTP binding (`ojs_api::http`); HTTP/1.1 with keep-alive
//! and HTTP/2 on the same port: h2c (prior knowledge) in plain TCP, ALPN
//! with `[http]` TLS (`crate::tls`).
//!
//! Hardened for a port anyone on the network may reach: a request head must
//! arrive within `header_read_timeout`; a connection with no request in
//! flight for `idle_timeout` is closed; request bodies are read up to
//! `[api] max_body_bytes` (413 beyond); at most `max_connections` are open
//! at once (a new one evicts the oldest that has not sent a request yet). Health answers from state that a background probe refreshes
//! every `health_interval` — never a broker call per request, so a flood of
//! health requests cannot become a flood of metadata calls. With
//! `token_file`, health and metrics need `Authorization: Bearer <token>`;
//! the binding checks its own tokens (`ojs_api::auth`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use ojs_queue::QueueAdapter;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::metrics::Metrics;

/// The endpoint's limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A connection must send its request head within this.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
        }
    }
}

/// The last health probe of one adapter.
#[derive(Debug, Clone)]
struct Probe {
    healthy: bool,
    detail: String,
    at: Instant,
}

/// Health of every adapter as the background probe last saw it.
#[derive(Debug)]
pub struct HealthBoard {
    adapters: Vec<(String, Arc<dyn QueueAdapter>)>,
    last: Mutex<Vec<Option<Probe>>>,
    /// Longest wait for one adapter's answer.
    timeout: Duration,
}

impl HealthBoard {
    /// A board for `adapters`, each probe bounded by `timeout`.
    pub fn new(adapters: Vec<(String, Arc<dyn QueueAdapter>)>, timeout: Duration) -> Self {
        let n = adapters.len();
        HealthBoard {
            adapters,
            last: Mutex::new(vec![None; n]),
            timeout,
        }
    }

    /// Probes every adapter once (concurrently) and records the answers.
    pub async fn probe(&self) {
        let checks = self.adapters.iter().map(|(_, adapter)| async move {
            match tokio::time::timeout(self.timeout, adapter.health()).await {
                Ok(h) => (h.healthy, h.detail),
                Err(_) => (false, format!("no answer within {:?}", self.timeout)),
            }
        });
        let results = futures::future::join_all(checks).await;
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        for (slot, (healthy, detail)) in last.iter_mut().zip(results) {
            *slot = Some(Probe {
                healthy,
                detail,
                at: now,
            });
        }
    }

    /// Probes every `interval` (the first after one interval: the caller
    /// probes once before serving) until `stop` turns true.
    pub async fn run(self: Arc<Self>, interval: Duration, mut stop: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                () = tokio::time::sleep(interval) => {}
            }
            self.probe().await;
        }
    }

    /// `(healthy, body)`: healthy when every adapter's last probe was; an
    /// adapter not probed yet counts as down. Each entry carries the age of
    /// its probe.
    pub fn snapshot(&self) -> (bool, Value) {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let mut all_ok = true;
        let mut adapters = Map::new();
        for ((name, _), probe) in self.adapters.iter().zip(last.iter()) {
            let entry = match probe {
                Some(p) => {
                    all_ok &= p.healthy;
                    json!({
                        "status": if p.healthy { "ok" } else { "down" },
                        "detail": p.detail,
                        "age_ms": p.at.elapsed().as_millis() as u64,
                    })
                }
                None => {
                    all_ok = false;
                    json!({"status": "down", "detail": "not probed yet", "age_ms": null})
                }
            };
            adapters.insert(name.clone(), entry);
        }
        let status = if all_ok { "ok" } else { "degraded" };
        (all_ok, json!({"status": status, "adapters": adapters}))
    }
}

/// What the endpoint reads.
#[derive(Debug)]
pub struct HttpState {
    /// Adapter health, refreshed in the background.
    pub health: Arc<HealthBoard>,
    /// Sinks (by route) and sources that are failing now make the daemon
    /// unhealthy too: a broker can be reachable and still refuse to work.
    pub alarms: Vec<Arc<crate::alarm::Alarm>>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Bearer token both paths require, if any.
    pub token: Option<ojs_core::redact::Secret>,
    /// Connection limits.
    pub limits: Limits,
    /// The OJS HTTP binding, with `[api]`.
    pub api: Option<Arc<ojs_api::Api>>,
    /// The OJS gRPC binding and its companions, with `[api]`: calls come
    /// over HTTP/2 on the same listener.
    pub grpc: Option<ojs_api::grpc::GrpcServices>,
    /// The built admin UI served at `/ojs/admin/` (`http.admin_ui_dir`,
    /// resolved), when there is one.
    pub admin_ui: Option<std::path::PathBuf>,
}

/// Where the admin UI is served.
const ADMIN_UI: &str = "/ojs/admin";

/// A file of the admin UI for `path` (under [`ADMIN_UI`]): the file the
/// path names inside `root`, or `index.html` for a path of the app's own
/// (no extension: the single-page app routes it); 404 for a missing asset
/// and for any path that would leave `root` (`..`, a link out of it).
async fn admin_ui_file(root: &std::path::Path, path: &str) -> Response<Full<Bytes>> {
    let not_found = || response(StatusCode::NOT_FOUND, "text/plain", "not found\n");
    let rest = path
        .strip_prefix(ADMIN_UI)
        .unwrap_or_default()
        .trim_start_matches('/');
    let segments: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    if segments
        .iter()
        .any(|s| *s == ".." || *s == "." || s.contains('\\') || s.contains('\0'))
    {
        return not_found();
    }
    let named = segments.iter().fold(root.to_path_buf(), |p, s| p.join(s));
    let wanted = if segments.is_empty() {
        root.join("index.html")
    } else {
        named
    };
    let file = match tokio::fs::canonicalize(&wanted).await {
        Ok(found) if found.starts_with(root) && found.is_file() => found,
        // An app route (no extension) is the app's: its index.
        _ if segments.last().is_none_or(|s| !s.contains('.')) => root.join("index.html"),
        _ => return not_found(),
    };
    let Ok(body) = tokio::fs::read(&file).await else {
        return not_found();
    };
    let content_type = match file.extension().and_then(|e| e.to_str()).unwrap_or("") {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "woff" => "font/woff",
        "txt" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    };
    let mut r = response(StatusCode::OK, content_type, body);
    // The index names the assets of each build: it is always asked again.
    let cache = if file.ends_with("index.html") {
        "no-cache"
    } else {
        "public, max-age=3600"
    };
    if let Ok(v) = cache.parse() {
        r.headers_mut().insert(hyper::header::CACHE_CONTROL, v);
    }
    r
}

/// Every answer's body: the HTTP answers are whole, gRPC ones stream.
type AnswerBody = tonic::body::Body;

fn response(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Whether a request may read health or metrics (`[http] token_file`,
/// when set), and whether it sees health's detail: with the API, its
/// rule ([`ojs_api::Api::health_access`], the same over gRPC); without,
/// whoever passes.
fn authorized(state: &HttpState, req: &Request<Incoming>) -> Option<bool> {
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if let Some(api) = &state.api {
        return api.health_access(authorization).ok();
    }
    match &state.token {
        None => Some(true),
        Some(token) => ojs_api::auth::bearer(authorization)
            .is_some_and(|given| token.matches(given))
            .then_some(true),
    }
}

async fn handle(
    state: Arc<HttpState>,
    req: Request<Incoming>,
    activity: Arc<Activity>,
) -> Result<Response<AnswerBody>, Infallible> {
    if ojs_api::grpc::GrpcServices::is_grpc(&req) {
        if let Some(grpc) = &state.grpc {
            return Ok(grpc.call(req.map(AnswerBody::new)).await);
        }
        return Ok(tonic::Status::unimplemented(
            "gRPC is served with the OJS API ([api] in the configuration)",
        )
        .into_http());
    }
    let path = req.uri().path().to_owned();
    if let Some(root) = &state.admin_ui {
        if (path == ADMIN_UI || path.starts_with("/ojs/admin/"))
            && matches!(*req.method(), Method::GET | Method::HEAD)
        {
            return Ok(admin_ui_file(root, &path).await.map(AnswerBody::new));
        }
    }
    if let Some(api) = &state.api {
        if ojs_api::realtime::is_websocket(req.method(), &path) {
            return Ok(websocket(api, req).await);
        }
        if let Some(view) = ojs_api::http::event_stream_view(req.method(), &path) {
            let request_id = ojs_api::http::request_id(req.headers());
            let (parts, _) = req.into_parts();
            let head = Request::from_parts(parts, ());
            return Ok(
                match ojs_api::http::event_stream(api, &head, &request_id, view).await {
                    Ok((head, frames)) => {
                        use futures::StreamExt;
                        let body = http_body_util::StreamBody::new(
                            frames.map(|b| Ok::<_, tonic::Status>(hyper::body::Frame::data(b))),
                        );
                        head.map(|()| AnswerBody::new(body))
                    }
                    Err(answer) => answer.map(|b| AnswerBody::new(Full::new(b))),
                },
            );
        }
    }
    let ojs = ojs_api::http::is_ojs_path(&path);
    let known = matches!(path.as_str(), "/ojs/v1/health" | "/metrics");
    let request_id = ojs.then(|| ojs_api::http::request_id(req.headers()));
    let mut response = answer(&state, req, &path, known, request_id.as_deref(), &activity).await;
    if let Some(id) = &request_id {
        ojs_api::http::standard_headers(response.headers_mut(), id);
    }
    Ok(response.map(AnswerBody::new))
}

/// `GET /ojs/v1/ws`: the handshake's answer; the session runs on the
/// upgraded connection in a task of its own (bounded by `[api]
/// max_event_streams`, not by the HTTP connection limits it leaves).
async fn websocket(api: &Arc<ojs_api::Api>, mut req: Request<Incoming>) -> Response<AnswerBody> {
    let request_id = ojs_api::http::request_id(req.headers());
    let upgrade = hyper::upgrade::on(&mut req);
    let (parts, _) = req.into_parts();
    let head = Request::from_parts(parts, ());
    match ojs_api::realtime::accept(api, &head, &request_id).await {
        Ok((answer, session)) => {
            tokio::spawn(async move {
                match upgrade.await {
                    Ok(upgraded) => session.run(TokioIo::new(upgraded)).await,
                    Err(e) => tracing::debug!(error = %e, "a WebSocket upgrade did not complete"),
                }
            });
            answer.map(|()| AnswerBody::empty())
        }
        Err(answer) => answer.map(|b| AnswerBody::new(Full::new(b))),
    }
}

async fn answer(
    state: &HttpState,
    req: Request<Incoming>,
    path: &str,
    known: bool,
    request_id: Option<&str>,
    activity: &Activity,
) -> Response<Full<Bytes>> {
    let api = state
        .api
        .as_ref()
        .filter(|_| request_id.is_some() && !known);
    // The binding checks its own tokens (`[http] token_file` among them).
    let access = if known {
        authorized(state, &req)
    } else {
        Some(true)
    };
    let Some(detail) = access else {
        let mut r = response(
            StatusCode::UNAUTHORIZED,
            "text/plain",
            "a bearer token is required\n",
        );
        if let Ok(v) = "Bearer".parse() {
            r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, v);
        }
        return r;
    };
    if let (Some(api), Some(id)) = (api, request_id) {
        return full(serve_api(api, req, id, activity).await);
    }
    if known && req.method() != Method::GET && req.method() != Method::HEAD {
        return response(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "use GET\n");
    }
    match path {
        "/ojs/v1/health" => {
            let (mut ok, mut body) = state.health.snapshot();
            let mut failing = Map::new();
            for alarm in &state.alarms {
                if let Some((d, queue, reason)) = alarm.failure() {
                    failing.insert(
                        format!("{} {}", alarm.role(), alarm.name()),
                        json!({
                            "status": "failing",
                            "failing_for_ms": d.as_millis() as u64,
                            "queue": queue,
                            "reason": reason,
                        }),
                    );
                }
            }
            if !failing.is_empty() {
                ok = false;
                body["status"] = json!("degraded");
                body["failing"] = Value::Object(failing);
            }
            if let Some(api) = &state.api {
                body["version"] = json!(env!("CARGO_PKG_VERSION"));
                body["uptime_seconds"] = json!(api.uptime_seconds());
                let backend = api.backend();
                let up = body["adapters"][&backend.name]["status"] == "ok";
                let mut shown = json!(backend);
                shown["status"] = json!(if up { "connected" } else { "disconnected" });
                body["backend"] = shown;
                let store = api.store_health();
                let store_up = store.is_up();
                body["store"] = json!(store);
                if !store_up {
                    ok = false;
                    body["status"] = json!("degraded");
                }
            }
            if !detail {
                without_detail(&mut body);
            }
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            response(status, "application/json", body.to_string())
        }
        "/metrics" => response(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.metrics.render(),
        ),
        _ => response(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found; try /ojs/v1/health or /metrics\n",
        ),
    }
}

/// Health as anyone may read it: status only, without the adapters'
/// details, the backend's name or why a part is down.
fn without_detail(body: &mut Value) {
    if let Some(adapters) = body.get_mut("adapters").and_then(Value::as_object_mut) {
        for entry in adapters.values_mut() {
            if let Some(entry) = entry.as_object_mut() {
                entry.remove("detail");
            }
        }
    }
    if let Some(failing) = body.get_mut("failing").and_then(Value::as_object_mut) {
        for entry in failing.values_mut() {
            if let Some(entry) = entry.as_object_mut() {
                entry.remove("reason");
            }
        }
    }
    if let Some(backend) = body.get_mut("backend").and_then(Value::as_object_mut) {
        backend.remove("name");
    }
    if let Some(store) = body.get_mut("store").and_then(Value::as_object_mut) {
        store.remove("reason");
    }
}

/// Checks the request's head (token, operation), then reads its body
/// within the API's body bounds (`ojs_api::body`) and hands the request to
/// the binding. A request refused before its body was read, or whose body
/// did not arrive in time, closes its connection.
async fn serve_api(
    api: &Arc<ojs_api::Api>,
    req: Request<Incoming>,
    request_id: &str,
    activity: &Activity,
) -> hyper::Response<Bytes> {
    let began = Instant::now();
    let route = ojs_api::metrics::http_route(req.method().as_str(), req.uri().path());
    // Refused before the binding's handler (which counts what it answers).
    let refused = |error: &ojs_api::ApiError| {
        api.metrics().request(
            ojs_api::metrics::Binding::Http,
            route,
            ojs_api::http::status_of(error),
            began.elapsed(),
        );
        ojs_api::http::error_response(error, request_id)
    };
    let closing = |error: ojs_api::ApiError| {
        let mut r = refused(&error);
        r.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
        r
    };
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let admitted = ojs_api::http::admit(api, req.method(), req.uri().path(), req.headers())
        .and_then(|()| ojs_api::body::admit(declared, api.settings(), api.body_budget(), 0));
    let (parts, body) = req.into_parts();
    let permit = match admitted {
        Ok(permit) => permit,
        Err(e) => {
            // Answered at once; what the client sends meanwhile is read and
            // dropped behind the answer (within the body's deadline), so that
            // it reads the answer instead of a reset.
            let api = api.clone();
            tokio::spawn(async move { ojs_api::body::discard(body, api.settings()).await });
            return refused(&e);
        }
    };
    let read = {
        let _reading = activity.reading();
        ojs_api::body::read(body, permit, api.settings(), 0).await
    };
    let (body, permit) = match read {
        Ok(read) => read,
        Err(e) => return closing(e),
    };
    let answer = ojs_api::http::handle(api, Request::from_parts(parts, body), request_id).await;
    drop(permit);
    answer
}

fn full(r: hyper::Response<Bytes>) -> Response<Full<Bytes>> {
    r.map(Full::new)
}

/// The most an HTTP/1.1 connection buffers ahead of its handler, its
/// request head included (a larger head is 431).
const HTTP1_READ_BUFFER: usize = 64 << 10;

/// How long a connection may sit without a request before a new connection
/// at the cap may evict it.
const EVICTABLE_AFTER: Duration = Duration::from_millis(500);

/// One open connection, as the accept loop tracks it.
struct Open {
    /// Its requests: whether it is doing anything a real client does.
    activity: Arc<Activity>,
    /// It has ended.
    closed: Arc<AtomicBool>,
    /// Closes it early.
    evict: Arc<Notify>,
}

/// Serves until `stop` turns true.
///
/// At `max_connections`, a new connection evicts the oldest one that has
/// sat for half a second without a request head, without a request, or
/// waiting on request bodies, or waits for one to end: idle or slow
/// clients can hold at most the cap, and never keep a real request (which
/// sends its head and body at once) waiting longer than that.
pub async fn serve(
    listener: TcpListener,
    tls: Option<crate::tls::ListenerTls>,
    state: Arc<HttpState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut open: VecDeque<Open> = VecDeque::new();
    let finished = Arc::new(Notify::new());
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = accept(&listener) => accepted,
        };
        let Some((stream, peer)) = accepted else {
            continue;
        };
        // An HTTP/2 answer is several small writes (headers, data, gRPC's
        // trailers): with Nagle's algorithm the last one waits for the
        // client's delayed ACK, some 40 ms a call.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "TCP_NODELAY could not be set");
        }
        // At the cap: evict the oldest connection that has sat for a while
        // without sending a request (a fresh one is probably a real client
        // about to send); otherwise wait for one to finish.
        loop {
            open.retain(|c| !c.closed.load(Ordering::Acquire));
            if open.len() < state.limits.max_connections.max(1) {
                break;
            }
            let idle = open
                .iter()
                .position(|c| c.activity.stalled_for() >= EVICTABLE_AFTER);
            if let Some(c) = idle.and_then(|i| open.remove(i)) {
                c.evict.notify_one();
                break;
            }
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = finished.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        let conn = Open {
            activity: Arc::new(Activity::default()),
            closed: Arc::new(AtomicBool::new(false)),
            evict: Arc::new(Notify::new()),
        };
        let (activity, closed, evict) = (
            conn.activity.clone(),
            conn.closed.clone(),
            conn.evict.clone(),
        );
        open.push_back(conn);
        let state = state.clone();
        let finished = finished.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let limits = state.limits.clone();
            match tls {
                None => connection(TokioIo::new(stream), peer, state, activity, &evict).await,
                Some(tls) => {
                    // The handshake counts against the head's deadline.
                    let handshake = tokio::time::timeout(
                        limits.header_read_timeout,
                        tls.acceptor.accept(stream),
                    );
                    tokio::select! {
                        done = handshake => match done {
                            Ok(Ok(stream)) => {
                                connection(TokioIo::new(stream), peer, state, activity, &evict).await;
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake refused");
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake not done within header_read_timeout");
                            }
                        },
                        () = evict.notified() => {
                            tracing::debug!(%peer, "HTTP connection evicted during its TLS handshake");
                        }
                    }
                }
            }
            closed.store(true, Ordering::Release);
            finished.notify_one();
        });
    }
}

/// The endpoint's listener on `addr` (a socket address or `host:port`,
/// its addresses tried in turn) with `backlog` connections queued for the
/// accept loop. tokio's `TcpListener::bind` queues 128, as the standard
/// library does: a burst of a few hundred connects overflows that, and the
/// kernel drops the overflow's handshakes for their clients to retry a
/// second later (or answers with SYN cookies).
pub async fn bind(addr: &str, backlog: u32) -> std::io::Result<TcpListener> {
    let mut last = None;
    for at in tokio::net::lookup_host(addr).await? {
        let socket = if at.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        let listening = socket.and_then(|s| {
            // As tokio's own bind: a restart rebinds a port whose old
            // connections are still in TIME_WAIT.
            s.set_reuseaddr(true)?;
            s.bind(at)?;
            s.listen(backlog)
        });
        match listening {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolved to nothing",
        )
    }))
}

/// One accepted connection. A failure (out of file descriptors and the
/// like) is logged and backed off from, and `None` returned: the caller
/// keeps serving.
async fn accept(listener: &TcpListener) -> Option<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match listener.accept().await {
        Ok(accepted) => Some(accepted),
        Err(e) => {
            tracing::warn!(error = %e, "accepting an HTTP connection failed");
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        }
    }
}

/// Serves one connection until it ends, idles out or is evicted.
async fn connection<I>(
    io: TokioIo<I>,
    peer: std::net::SocketAddr,
    state: Arc<HttpState>,
    activity: Arc<Activity>,
    evict: &Notify,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let limits = state.limits.clone();
    let seen = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        let state = state.clone();
        let seen = seen.clone();
        async move {
            seen.begin();
            // The request ends with its answer's body: a gRPC stream keeps
            // the connection busy for as long as it runs.
            let request = InFlight::new(seen.clone());
            let r = handle(state, req, seen).await;
            r.map(|response| {
                response.map(|body| Tracked {
                    body,
                    _request: request,
                })
            })
        }
    });
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // What one connection reads ahead of its request's handler (its
        // head included): hyper's default of about 400 KiB, times every
        // open connection, was more than the bodies being served.
        .max_buf_size(HTTP1_READ_BUFFER)
        .keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    // Upgrades: the WebSocket (`GET /ojs/v1/ws`) leaves HTTP on its connection.
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let tick =
        (limits.idle_timeout.min(limits.header_read_timeout) / 4).max(Duration::from_millis(50));
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
                }
                break;
            }
            () = tokio::time::sleep(tick) => {
                // Until a first request starts, the protocol is not
                // chosen yet and no head timer of hyper's runs.
                if !activity.started() && activity.since.elapsed() >= limits.header_read_timeout {
                    tracing::debug!(%peer, "HTTP connection closed: no request head within header_read_timeout");
                    break;
                }
                if activity.idle_for() >= limits.idle_timeout {
                    tracing::debug!(%peer, "HTTP connection closed after idle_timeout without a request");
                    break;
                }
            }
            () = evict.notified() => {
                tracing::debug!(%peer, "idle HTTP connection evicted for a new one");
                break;
            }
        }
    }
}

/// One request in flight; it ends when dropped (with its answer's body).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> Self {
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// An answer's body that ends its request when it is done or dropped.
struct Tracked {
    body: AnswerBody,
    _request: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Requests in flight on one connection and when the last one ended.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// Requests whose body is being read.
    reading: AtomicUsize,
    /// Milliseconds after `since` when `reading` last went from none to
    /// some.
    reading_ms: AtomicU64,
    /// A request has begun on this connection.
    begun: AtomicBool,
    since: Instant,
    /// Milliseconds after `since` of the last request's end.
    last_ms: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: AtomicUsize::new(0),
            reading: AtomicUsize::new(0),
            reading_ms: AtomicU64::new(0),
            begun: AtomicBool::new(false),
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
}

/// A request body being read; it ends when dropped.
struct Reading<'a>(&'a Activity);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Activity {
    /// Marks a request body as being read until the guard is dropped.
    fn reading(&self) -> Reading<'_> {
        if self.reading.fetch_add(1, Ordering::AcqRel) == 0 {
            self.reading_ms
                .store(self.since.elapsed().as_millis() as u64, Ordering::Release);
        }
        Reading(self)
    }

    /// How long the connection has done nothing a real client does: no
    /// request head since it opened, no request since the last one
    /// ended, or every request in flight waiting on its body; zero while
    /// a request is being served.
    fn stalled_for(&self) -> Duration {
        if !self.started() {
            return self.since.elapsed();
        }
        let in_flight = self.in_flight.load(Ordering::Acquire);
        if in_flight == 0 {
            return self.idle_for();
        }
        if self.reading.load(Ordering::Acquire) >= in_flight {
            let began = Duration::from_millis(self.reading_ms.load(Ordering::Acquire));
            return self.since.elapsed().saturating_sub(began);
        }
        Duration::ZERO
    }

    fn begin(&self) {
        self.begun.store(true, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    fn started(&self) -> bool {
        self.begun.load(Ordering::Acquire)
    }

    fn end(&self) {
        self.last_ms
            .store(self.since.elapsed().as_millis() as u64, Ordering::Release);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// How long the connection has had no request in flight (zero while
    /// one is).
    fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Acquire));
        self.since.elapsed().saturating_sub(last)
    }
}

/// Connections served at once while starting; more wait in the kernel's
/// backlog (or are closed at once when this many are open).
const STARTING_CONNECTIONS: usize = 64;
/// How long one connection is served while starting.
const STARTING_CONNECTION_LIMIT: Duration = Duration::from_secs(10);

/// The listener while the daemon connects to its brokers and its job
/// store: bound first, so that a probe meets a server that says it is not
/// ready (503, health `starting`) instead of a refused connection, and a
/// port already taken stops the start before anything else. Every request
/// gets that answer and the connection is closed. Ends, handing the
/// listener back, when `ready` fires (or its sender is dropped).
pub async fn serve_starting(
    listener: TcpListener,
    tls: Option<crate::tls::ListenerTls>,
    mut ready: tokio::sync::oneshot::Receiver<()>,
) -> TcpListener {
    let started = Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(STARTING_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            _ = &mut ready => break,
            accepted = accept(&listener) => accepted,
        };
        let Some((stream, peer)) = accepted else {
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let serve = async move {
                match tls {
                    None => starting_connection(TokioIo::new(stream)).await,
                    Some(tls) => match tls.acceptor.accept(stream).await {
                        Ok(stream) => starting_connection(TokioIo::new(stream)).await,
                        Err(e) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                    },
                }
            };
            if tokio::time::timeout(STARTING_CONNECTION_LIMIT, serve)
                .await
                .is_err()
            {
                tracing::debug!(%peer, "connection closed while starting");
            }
        });
    }
    tracing::debug!(
        elapsed_ms = started.elapsed().as_millis() as u64,
        "started: the listener serves the daemon"
    );
    listener
}

async fn starting_connection<I>(io: TokioIo<I>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        Ok::<_, Infallible>(starting_answer(req.uri().path()))
    });
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(5))
        .keep_alive(false);
    builder.http2().timer(TokioTimer::new());
    if let Err(e) = builder.serve_connection(io, service).await {
        tracing::debug!(error = %e, "HTTP connection while starting ended with an error");
    }
}

/// What every request gets while the daemon starts: health says
/// `starting`; anything else is the OJS binding's retryable 503.
fn starting_answer(path: &str) -> Response<Full<Bytes>> {
    let body = if path == "/ojs/v1/health" || path == "/health" {
        json!({"status": "starting", "detail": "connecting to the brokers and the job store"})
    } else {
        json!({"error": {
            "code": "backend_unavailable",
            "message": "the server is starting: it is connecting to its brokers and job store; retry shortly",
            "retryable": true,
        }})
    };
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = r.headers_mut();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        hyper::header::RETRY_AFTER,
        hyper::header::HeaderValue::from_static("1"),
    );
    r
}
