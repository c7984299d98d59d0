//! `GET /ojs/v1/health` and `GET /metrics` (hyper, HTTP/1.1).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ojs_core::QueueAdapter;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// What the endpoint reads.
#[derive(Debug)]
pub struct HttpState {
    /// Adapters whose health makes up the daemon's.
    pub adapters: Vec<(String, Arc<dyn QueueAdapter>)>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Longest wait for one adapter's health answer.
    pub health_timeout: Duration,
}

/// The daemon's health: `ok` when every adapter is healthy, with each
/// adapter's detail.
pub async fn health(state: &HttpState) -> (bool, Value) {
    let checks = state.adapters.iter().map(|(name, adapter)| async move {
        let h = tokio::time::timeout(state.health_timeout, adapter.health()).await;
        let (ok, detail) = match h {
            Ok(h) => (h.healthy, h.detail),
            Err(_) => (
                false,
                format!("no answer within {:?}", state.health_timeout),
            ),
        };
        (name.clone(), ok, detail)
    });
    let results = futures::future::join_all(checks).await;
    let all_ok = results.iter().all(|(_, ok, _)| *ok);
    let adapters: Map<String, Value> = results
        .into_iter()
        .map(|(name, ok, detail)| {
            (
                name,
                json!({"status": if ok { "ok" } else { "down" }, "detail": detail}),
            )
        })
        .collect();
    let status = if all_ok { "ok" } else { "degraded" };
    (all_ok, json!({"status": status, "adapters": adapters}))
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
    Ok(match path {
        "/ojs/v1/health" => {
            let (ok, body) = health(&state).await;
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

/// Serves until `stop` turns true.
pub async fn serve(listener: TcpListener, state: Arc<HttpState>, mut stop: watch::Receiver<bool>) {
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
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
}
