//! An adapter whose broker was not there when the daemon started.
//!
//! After a host reboot brokers and the bridge come up in any order. Instead
//! of exiting (and crash-looping under a supervisor), the daemon starts with
//! a [`Connecting`] adapter in the broker's place: it connects and prepares
//! the config's queues in the background with backoff, health says it is
//! down and why, sources on it wait, and publishes to it fail as retryable
//! (so the daemon holds the source messages and retries). Once connected it
//! is the real adapter.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::PublishFailure;
use ojs_queue::{Consumer, ConsumerOptions, Error, Health, OutgoingMessage, QueueAdapter, Result};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::endpoint::AdapterConfig;

/// Longest wait between two connection attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);

/// A broker adapter that connects in the background.
pub struct Connecting {
    name: String,
    config: AdapterConfig,
    connected: OnceLock<Arc<dyn QueueAdapter>>,
    /// Why the last attempt failed (health and errors say it).
    last_error: Mutex<String>,
    ready: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connecting")
            .field("name", &self.name)
            .field("kind", &self.config.kind())
            .field("connected", &self.connected.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Connecting {
    /// Starts connecting adapter `name` in the background; `queues` are
    /// prepared ([`QueueAdapter::prepare`]) before it counts as connected.
    /// `first_error` is why the first attempt, made by the caller, failed.
    pub fn start(
        name: &str,
        config: AdapterConfig,
        queues: Vec<String>,
        first_error: &Error,
    ) -> Arc<Connecting> {
        let (ready, _) = watch::channel(false);
        let this = Arc::new(Connecting {
            name: name.to_owned(),
            config,
            connected: OnceLock::new(),
            last_error: Mutex::new(first_error.to_string()),
            ready,
            task: Mutex::new(None),
        });
        tracing::warn!(adapter = %name, kind = this.config.kind(), error = %first_error, "broker not reachable; starting anyway and connecting in the background");
        let task = tokio::spawn(this.clone().connect_loop(queues));
        if let Ok(mut slot) = this.task.lock() {
            *slot = Some(task);
        }
        this
    }

    async fn connect_loop(self: Arc<Self>, queues: Vec<String>) {
        let mut attempt = 1u32;
        loop {
            tokio::time::sleep(reconnect_delay(attempt, MAX_RETRY_DELAY)).await;
            attempt = attempt.saturating_add(1);
            let adapter = match self.config.connect().await {
                Ok(a) => a,
                Err(e) => {
                    self.failed(format!("connecting: {e}"), attempt);
                    continue;
                }
            };
            let mut prepared = true;
            for queue in &queues {
                if let Err(e) = adapter.prepare(queue).await {
                    self.failed(format!("queue {queue:?}: {e}"), attempt);
                    prepared = false;
                    break;
                }
            }
            if !prepared {
                let _ = adapter.close().await;
                continue;
            }
            let _ = self.connected.set(adapter);
            self.ready.send_replace(true);
            tracing::info!(adapter = %self.name, kind = self.config.kind(), attempts = attempt - 1, "broker reachable; adapter connected");
            return;
        }
    }

    fn failed(&self, error: String, attempt: u32) {
        // Every attempt at debug; a reminder at warn now and then.
        if attempt % 10 == 0 {
            tracing::warn!(adapter = %self.name, attempt, %error, "still connecting");
        } else {
            tracing::debug!(adapter = %self.name, attempt, %error, "connection attempt failed");
        }
        if let Ok(mut last) = self.last_error.lock() {
            *last = error;
        }
    }

    fn last_error(&self) -> String {
        self.last_error
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    fn not_yet(&self) -> Error {
        let last = self.last_error();
        Error::broker(
            self.config.kind(),
            format!("adapter `{}` is not connected yet ({last})", self.name),
            true,
        )
    }

    fn adapter(&self) -> Option<&Arc<dyn QueueAdapter>> {
        self.connected.get()
    }
}

#[async_trait]
impl QueueAdapter for Connecting {
    fn kind(&self) -> &'static str {
        self.config.kind()
    }

    fn max_message_bytes(&self) -> usize {
        match self.adapter() {
            Some(a) => a.max_message_bytes(),
            None => self.config.max_message_bytes(),
        }
    }

    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        match self.adapter() {
            Some(a) => a.publish(queue, messages).await,
            None => Err(Error::Publish(PublishFailure::all(messages, || {
                self.not_yet()
            }))),
        }
    }

    /// Waits until the broker is there: a source has nothing to do before.
    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        let mut ready = self.ready.subscribe();
        if ready.wait_for(|r| *r).await.is_err() {
            return Err(Error::Closed);
        }
        match self.adapter() {
            Some(a) => a.consumer(queue, options).await,
            None => Err(self.not_yet()),
        }
    }

    async fn prepare(&self, queue: &str) -> Result<()> {
        match self.adapter() {
            Some(a) => a.prepare(queue).await,
            None => Err(self.not_yet()),
        }
    }

    fn is_reserved(&self, queue: &str) -> bool {
        match self.adapter() {
            Some(a) => a.is_reserved(queue),
            None => self.config.is_reserved(queue),
        }
    }

    fn group_scope(&self, queue: &str) -> Option<String> {
        match self.adapter() {
            Some(a) => a.group_scope(queue),
            None => self.config.group_scope(queue),
        }
    }

    async fn health(&self) -> Health {
        match self.adapter() {
            Some(a) => a.health().await,
            None => Health::down(format!("not connected yet: {}", self.last_error())),
        }
    }

    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        match self.adapter() {
            Some(a) => a.depth(queue).await,
            None => Err(self.not_yet()),
        }
    }

    async fn close(&self) -> Result<()> {
        if let Ok(mut task) = self.task.lock() {
            if let Some(t) = task.take() {
                t.abort();
            }
        }
        match self.adapter() {
            Some(a) => a.close().await,
            None => Ok(()),
        }
    }
}
