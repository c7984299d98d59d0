//! The connection: one session (a connection and its publishing channel)
//! shared by publishers, opened with TLS where asked and reopened with
//! backoff after it breaks.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::settings::Topology;
use ojs_queue::{Error, Result};
use tokio::time::Instant;

use crate::{amqp_error, redact, topology, within, Inner};

/// One connection with its confirm-mode publishing channel, and what has
/// been declared on it.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) connection: Connection,
    pub(crate) publisher: Channel,
    pub(crate) declared: Mutex<HashSet<String>>,
    /// Retry queues and when they were last declared (their `x-expires`
    /// timer restarts on each declaration).
    pub(crate) retry_declared: Mutex<HashMap<String, Instant>>,
}

impl Session {
    pub(crate) fn usable(&self) -> bool {
        self.connection.status().connected() && self.publisher.status().connected()
    }

    pub(crate) fn declared(&self) -> MutexGuard<'_, HashSet<String>> {
        self.declared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// A usable session, reconnecting with backoff until `deadline`.
    pub(crate) async fn session(&self, deadline: Instant) -> Result<Arc<Session>> {
        // Another caller may hold the lock while it backs off between
        // reconnect attempts (up to a minute): wait no longer than our own
        // deadline, so a 2 s health check answers in 2 s.
        let mut guard = tokio::time::timeout_at(deadline, self.session.lock())
            .await
            .map_err(|_| {
                Error::broker(
                    "rabbitmq",
                    "reconnecting to the broker; not connected yet",
                    true,
                )
            })?;
        if let Some(s) = guard.as_ref() {
            if s.usable() {
                return Ok(s.clone());
            }
            tracing::warn!(url = %redact(&self.config.url), "rabbitmq connection lost; reconnecting");
        }
        *guard = None;
        let mut attempt = 0;
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            match within(deadline, self.open_session()).await {
                Ok(s) => {
                    let s = Arc::new(s);
                    *guard = Some(s.clone());
                    if attempt > 0 {
                        tracing::info!(attempts = attempt + 1, "rabbitmq reconnected");
                    }
                    return Ok(s);
                }
                Err(e) => {
                    attempt += 1;
                    let delay =
                        reconnect_delay(attempt, Duration::from_secs(self.config.max_backoff_secs));
                    if Instant::now() + delay > deadline {
                        return Err(e);
                    }
                    tracing::warn!(attempt, delay_ms = delay.as_millis() as u64, error = %e, "rabbitmq connect failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// The TLS settings of an `amqps://` connection (CA and client
    /// identity read from their files at each connect).
    pub(crate) fn tls(&self) -> Result<lapin::tcp::OwnedTLSConfig> {
        let read = |field: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| Error::InvalidConfig {
                field: field.into(),
                reason: format!("cannot read {}: {e}", path.display()),
            })
        };
        let cert_chain =
            match &self.config.ca_file {
                Some(p) => Some(String::from_utf8(read("ca_file", p)?).map_err(|_| {
                    Error::InvalidConfig {
                        field: "ca_file".into(),
                        reason: format!("{} is not a PEM file", p.display()),
                    }
                })?),
                None => None,
            };
        let identity = match (&self.config.cert_file, &self.config.key_file) {
            (Some(cert), Some(key)) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                pem: read("cert_file", cert)?,
                key: read("key_file", key)?,
            }),
            _ => None,
        };
        Ok(lapin::tcp::OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }

    pub(crate) async fn open_session(&self) -> Result<Session> {
        let runtime = lapin::runtime::default_runtime().map_err(|e| amqp_error(&e))?;
        let url = self.config.connect_url()?;
        let connection = Connection::connect_with_config(
            &url,
            ConnectionProperties::default(),
            self.tls()?,
            runtime,
        )
        .await
        .map_err(|e| connect_error(&self.config.url, &e))?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| amqp_error(&e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| amqp_error(&e))?;
        let c = &self.config;
        match c.topology {
            Topology::Declare => {
                let mut exchanges = vec![c.exchange.as_str(), c.retry_exchange.as_str()];
                exchanges.extend(c.dead_letter_exchange_in_force());
                for name in exchanges {
                    topology::declare_exchange(&connection, name, ExchangeKind::Direct).await?;
                }
            }
            Topology::Existing => {
                let mut exchanges = vec![c.exchange.as_str()];
                exchanges.extend(c.dead_letter_exchange.as_deref());
                for name in exchanges.into_iter().filter(|n| !n.is_empty()) {
                    topology::check_exchange(&connection, name).await?;
                }
            }
        }
        Ok(Session {
            connection,
            publisher,
            declared: Mutex::new(HashSet::new()),
            retry_declared: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) async fn invalidate(&self, broken: &Arc<Session>) {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| Arc::ptr_eq(s, broken)) {
            *guard = None;
        }
    }
}

/// A failed connect, naming the broker without its credentials.
pub(crate) fn connect_error(url: &str, e: &lapin::Error) -> Error {
    match topology::amqp_code(e) {
        // The broker answered and refused: credentials, vhost.
        Some(code) => {
            let hint = if code == 403 {
                " (user, password or vhost permission refused)"
            } else {
                ""
            };
            topology::with_kind(
                Error::broker(
                    "rabbitmq",
                    format!("connecting to {}: {e}{hint}", redact(url)),
                    true,
                ),
                e,
            )
        }
        // No answer: refused, reset, TLS, DNS.
        None => Error::Unreachable {
            broker: "rabbitmq",
            message: format!("connecting to {}: {e}", redact(url)),
        },
    }
}
