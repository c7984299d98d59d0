//! `GET /ojs/v1/health` on an OJS server as a federation health probe
//! (healthy on HTTP 200 with `"status": "ok"`).

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use ojs_queue::federation::HealthProbe;
use ojs_queue::Health;

/// Probes an `http://host:port/path` health endpoint.
#[derive(Debug, Clone)]
pub struct HttpHealthProbe {
    url: String,
    authority: String,
    path: String,
    timeout: Duration,
}

impl HttpHealthProbe {
    /// A probe of `url` (`http://` only), each check bounded by `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, String> {
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "{url:?}: only http:// health endpoints are supported"
            ));
        }
        let authority = uri
            .authority()
            .map(|a| {
                if a.port().is_some() {
                    a.to_string()
                } else {
                    format!("{a}:80")
                }
            })
            .ok_or_else(|| format!("{url:?} names no host"))?;
        let path = uri
            .path_and_query()
            .map_or_else(|| "/ojs/v1/health".to_owned(), |p| p.to_string());
        Ok(HttpHealthProbe {
            url: url.to_owned(),
            authority,
            path,
            timeout,
        })
    }

    async fn get(&self) -> Result<(u16, Bytes), String> {
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| format!("connect {}: {e}", self.authority))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        // The connection task ends when the response is read and the sender dropped.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let request = Request::get(self.path.as_str())
            .header(hyper::header::HOST, self.authority.as_str())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }
}

#[async_trait]
impl HealthProbe for HttpHealthProbe {
    async fn check(&self) -> Health {
        match tokio::time::timeout(self.timeout, self.get()).await {
            Err(_) => Health::down(format!("{}: no answer within {:?}", self.url, self.timeout)),
            Ok(Err(e)) => Health::down(format!("{}: {e}", self.url)),
            Ok(Ok((status, body))) => {
                let ok_status = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .is_some_and(|v| v["status"] == "ok");
                if status == 200 && ok_status {
                    Health::ok(format!("{}: ok", self.url))
                } else {
                    Health::down(format!("{}: HTTP {status}", self.url))
                }
            }
        }
    }
}
