//! `[http]`: the listener of health and metrics, and its limits.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::duration::duration_text;

/// `[http]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `GET /ojs/v1/health` and `GET /metrics`; `off` disables the
    /// endpoint. Default `127.0.0.1:9464` (loopback only).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// A file holding a bearer token health, metrics and the OJS API then
    /// require (`Authorization: Bearer …`); for the API it allows every
    /// operation on every queue (`[[api.tokens]]` for scoped ones).
    /// Default: none (no token).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// PEM certificate chain: with `tls_key_file`, the listener speaks
    /// TLS only (ALPN `h2` and `http/1.1`). Default: none (plain TCP).
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA(s): clients must present a certificate one of them signed
    /// (mutual TLS). Default: none (no client certificate asked for).
    #[serde(default)]
    pub tls_client_ca_file: Option<PathBuf>,
    /// A connection must send its request head within this. Default `5s`.
    #[serde(default = "default_header_read_timeout", with = "duration_text")]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed
    /// (keep-alive). Default `30s`.
    #[serde(default = "default_idle_timeout", with = "duration_text")]
    pub idle_timeout: Duration,
    /// Connections open at once; beyond it a new connection evicts the
    /// oldest one that has not sent a request yet. Default 256.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections the kernel completes and queues for the accept loop
    /// (`listen(2)`'s backlog; the kernel caps it at
    /// `net.core.somaxconn`). Past it a burst's connects are dropped and
    /// retried by their clients a second later. Default 1024.
    #[serde(default = "default_listen_backlog")]
    pub listen_backlog: u32,
    /// How often adapter health is probed in the background (health
    /// requests read the last probe). Default `5s`.
    #[serde(default = "default_http_health_interval", with = "duration_text")]
    pub health_interval: Duration,
    /// Longest wait for one adapter's health answer. Default `3s`.
    #[serde(default = "default_http_health_timeout", with = "duration_text")]
    pub health_timeout: Duration,
    /// A directory holding a built OJS admin UI (its `index.html` and
    /// assets), served at `/ojs/admin/` with the single-page fallback.
    /// Default: none (not served).
    #[serde(default)]
    pub admin_ui_dir: Option<PathBuf>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_listen(),
            token_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_connections: default_max_connections(),
            listen_backlog: default_listen_backlog(),
            health_interval: default_http_health_interval(),
            health_timeout: default_http_health_timeout(),
            admin_ui_dir: None,
        }
    }
}

pub(crate) fn default_header_read_timeout() -> Duration {
    Duration::from_secs(5)
}
pub(crate) fn default_idle_timeout() -> Duration {
    Duration::from_secs(30)
}
pub(crate) fn default_max_connections() -> usize {
    256
}
pub(crate) fn default_listen_backlog() -> u32 {
    1024
}
pub(crate) fn default_http_health_interval() -> Duration {
    Duration::from_secs(5)
}
pub(crate) fn default_http_health_timeout() -> Duration {
    Duration::from_secs(3)
}

pub(crate) fn default_listen() -> String {
    "127.0.0.1:9464".to_owned()
}
