//! `GET /ojs/v1/health` and `GET /metrics` (hyper, HTTP/1.1).
//!
//! Hardened for a port anyone on the network may reach: each connection
//! serves one request (no keep-alive), must send its request head within
//! `header_read_timeout` and is closed after `idle_timeout` whatever it does;
//! at most `max_connections` are open at once (a new one evicts the oldest
//! that has not sent a request yet). Health answers from state that a background probe refreshes
//! every `health_interval` — never a broker call per request, so a flood of
//! health requests cannot become a flood of metadata calls. With
//! `token_file`, both paths need `Authorization: Bearer <token>`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use ojs_core::QueueAdapter;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::metrics::Metrics;

/// The endpoint's limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A connection must send its request head within this.
    pub header_read_timeout: Duration,
    /// A connection is closed after this, whatever it is doing.
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
}

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

/// Compares without an early exit, so the time taken does not tell how
/// much of a guess was right.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = given.len() ^ expected.len();
    for (i, e) in expected.iter().enumerate() {
        diff |= usize::from(given.get(i).copied().unwrap_or(0) ^ e);
    }
    diff == 0
}

fn authorized(state: &HttpState, req: &Request<Incoming>) -> bool {
    let Some(token) = &state.token else {
        return true;
    };
    req.headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| same_secret(given.trim().as_bytes(), token.expose().as_bytes()))
}

async fn handle(
    state: Arc<HttpState>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path();
    let known = matches!(path, "/ojs/v1/health" | "/metrics");
    if known && req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(response(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n",
        ));
    }
    if known && !authorized(&state, &req) {
        let mut r = response(
            StatusCode::UNAUTHORIZED,
            "text/plain",
            "a bearer token is required\n",
        );
        if let Ok(v) = "Bearer".parse() {
            r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, v);
        }
        return Ok(r);
    }
    Ok(match path {
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
    })
}

/// How long a connection may sit without a request before a new connection
/// at the cap may evict it.
const EVICTABLE_AFTER: Duration = Duration::from_millis(500);

/// One open connection, as the accept loop tracks it.
struct Open {
    /// When it was accepted.
    since: Instant,
    /// Its request head arrived (it is being answered).
    answered: Arc<AtomicBool>,
    /// It has ended.
    closed: Arc<AtomicBool>,
    /// Closes it early.
    evict: Arc<Notify>,
}

/// Serves until `stop` turns true.
///
/// At `max_connections`, a new connection evicts the oldest one that has
/// sat for half a second without a request head, or waits for one to end:
/// idle or slow clients can hold at most the cap, and never keep a real
/// request (which sends its head at once) waiting longer than that.
pub async fn serve(listener: TcpListener, state: Arc<HttpState>, mut stop: watch::Receiver<bool>) {
    let mut open: VecDeque<Open> = VecDeque::new();
    let finished = Arc::new(Notify::new());
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: back off, keep serving.
                tracing::warn!(error = %e, "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // At the cap: evict the oldest connection that has sat for a while
        // without sending a request (a fresh one is probably a real client
        // about to send); otherwise wait for one to finish.
        loop {
            open.retain(|c| !c.closed.load(Ordering::Acquire));
            if open.len() < state.limits.max_connections.max(1) {
                break;
            }
            let idle = open.iter().position(|c| {
                !c.answered.load(Ordering::Acquire) && c.since.elapsed() >= EVICTABLE_AFTER
            });
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
            since: Instant::now(),
            answered: Arc::new(AtomicBool::new(false)),
            closed: Arc::new(AtomicBool::new(false)),
            evict: Arc::new(Notify::new()),
        };
        let (answered, closed, evict) = (
            conn.answered.clone(),
            conn.closed.clone(),
            conn.evict.clone(),
        );
        open.push_back(conn);
        let state = state.clone();
        let finished = finished.clone();
        tokio::spawn(async move {
            let limits = state.limits.clone();
            let service = hyper::service::service_fn(move |req| {
                answered.store(true, Ordering::Release);
                handle(state.clone(), req)
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                ended = tokio::time::timeout(limits.idle_timeout, conn) => match ended {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "HTTP connection ended with an error"),
                    Err(_) => tracing::debug!(%peer, "HTTP connection closed after idle_timeout"),
                },
                () = evict.notified() => tracing::debug!(%peer, "idle HTTP connection evicted for a new one"),
            }
            closed.store(true, Ordering::Release);
            finished.notify_one();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abd", b"abc"));
        assert!(!same_secret(b"ab", b"abc"));
        assert!(!same_secret(b"abcd", b"abc"));
        assert!(!same_secret(b"", b"abc"));
    }
}
