//! The one consume loop: the daemon's sources and the grpcq worker both
//! take their messages through a [`Receiver`] and keep them leased with
//! [`keep_leased`].
//!
//! A receiver opens its consumer when first asked (and again after it
//! failed), takes a batch only while its in-flight budget has room (each
//! delivery holds one unit until its work is done: backpressure), and
//! retries a failed open or receive with backoff, reporting each failure to
//! its caller instead of giving up: a broker hiccup slows a consumer down,
//! it never ends it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::backoff::reconnect_delay;
use super::{Consumer, ConsumerOptions, Delivery, QueueAdapter};
use crate::error::{Error, Result};

/// What a [`Receiver`] consumes and how (plain data).
#[derive(Debug, Clone)]
pub struct ReceiverSettings {
    /// The queue to consume.
    pub queue: String,
    /// Consumer settings (group, visibility timeout, prefetch).
    pub consumer: ConsumerOptions,
    /// Most deliveries one receive asks for.
    pub batch_size: usize,
    /// Most deliveries held at once (received, their work not done).
    pub max_in_flight: usize,
    /// Longest wait of one receive: how long an idle receiver takes to
    /// return an empty batch.
    pub receive_wait: Duration,
    /// Longest wait between two attempts after failures.
    pub max_backoff: Duration,
}

/// Where a receive failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiveStage {
    /// Opening the consumer.
    Open,
    /// Receiving from an open consumer.
    Receive,
}

/// A failure the receiver retries after `delay`, for the caller to report.
#[derive(Debug)]
pub struct ReceiveFailure<'a> {
    /// Where it failed.
    pub stage: ReceiveStage,
    /// Why.
    pub error: &'a Error,
    /// Failures in a row, this one included.
    pub failures: u32,
    /// The wait before the next attempt.
    pub delay: Duration,
}

/// A batch and its share of the in-flight budget: one unit per delivery,
/// given back when the permit (or each part split off it) is dropped.
#[derive(Debug)]
pub struct Received {
    /// The deliveries, possibly none (the receive wait passed).
    pub deliveries: Vec<Delivery>,
    /// Their budget; `None` for an empty batch.
    pub permit: Option<OwnedSemaphorePermit>,
}

/// One queue's consume loop (see the module documentation).
pub struct Receiver {
    adapter: Arc<dyn QueueAdapter>,
    settings: ReceiverSettings,
    budget: Arc<Semaphore>,
    consumer: Option<Box<dyn Consumer>>,
    failures: u32,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("queue", &self.settings.queue)
            .field("room", &self.budget.available_permits())
            .field("failures", &self.failures)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// A receiver of `settings.queue` on `adapter`; nothing is opened yet.
    pub fn new(adapter: Arc<dyn QueueAdapter>, settings: ReceiverSettings) -> Self {
        let budget = Arc::new(Semaphore::new(
            settings.max_in_flight.clamp(1, Semaphore::MAX_PERMITS),
        ));
        Receiver {
            adapter,
            settings,
            budget,
            consumer: None,
            failures: 0,
        }
    }

    /// Deliveries that may still be received before the budget is full.
    pub fn room(&self) -> usize {
        self.budget.available_permits()
    }

    /// The next batch. Waits for room in the budget, opens the consumer if
    /// it is not open, and receives up to the room left (at most
    /// `batch_size`) within `receive_wait`. A failed open or receive is
    /// passed to `on_failure` and tried again after its backoff, for as
    /// long as it takes.
    ///
    /// Cancellation-safe: dropped at any await (a shutdown, a lifecycle
    /// change), nothing received is lost and the consumer stays usable.
    pub async fn next(
        &mut self,
        on_failure: &mut (dyn FnMut(ReceiveFailure<'_>) + Send),
    ) -> Received {
        loop {
            // Backpressure: no receive while the budget is spent.
            if let Ok(unit) = self.budget.acquire().await {
                drop(unit);
            }
            let consumer = match self.consumer.as_mut() {
                Some(c) => c,
                None => match self
                    .adapter
                    .consumer(&self.settings.queue, self.settings.consumer.clone())
                    .await
                {
                    Ok(c) => {
                        self.failures = 0;
                        self.consumer.insert(c)
                    }
                    Err(e) => {
                        self.failed(ReceiveStage::Open, &e, on_failure).await;
                        continue;
                    }
                },
            };
            let want = self
                .budget
                .available_permits()
                .min(self.settings.batch_size.max(1));
            match consumer.receive(want, self.settings.receive_wait).await {
                Ok(deliveries) => {
                    self.failures = 0;
                    let n = u32::try_from(deliveries.len()).unwrap_or(u32::MAX);
                    // Only this receiver takes from the budget, and room
                    // was there before the receive: this does not fail.
                    let permit = match n {
                        0 => None,
                        n => self.budget.clone().try_acquire_many_owned(n).ok(),
                    };
                    return Received { deliveries, permit };
                }
                Err(e) => self.failed(ReceiveStage::Receive, &e, on_failure).await,
            }
        }
    }

    async fn failed(
        &mut self,
        stage: ReceiveStage,
        error: &Error,
        on_failure: &mut (dyn FnMut(ReceiveFailure<'_>) + Send),
    ) {
        self.failures = self.failures.saturating_add(1);
        let delay = reconnect_delay(self.failures, self.settings.max_backoff);
        on_failure(ReceiveFailure {
            stage,
            error,
            failures: self.failures,
            delay,
        });
        tokio::time::sleep(delay).await;
    }

    /// Closes the consumer, if one is open: what was received and not
    /// settled comes back to the queue.
    pub async fn close(self) -> Result<()> {
        match self.consumer {
            Some(c) => c.close().await,
            None => Ok(()),
        }
    }
}

/// How often a lease of `lease` is renewed: at half its length, and not
/// more often than every 50 ms.
pub fn renew_every(lease: Duration) -> Duration {
    (lease / 2).max(Duration::from_millis(50))
}

/// Runs `work` while extending each of `deliveries` by `lease` every
/// [`renew_every`]: work that takes longer than the visibility timeout (a
/// slow handler, a blocked sink) must not let the queue hand its messages
/// to another consumer. Returns what `work` returned; renewals that fail
/// are logged (the message may then be delivered twice, never lost).
pub async fn keep_leased<T>(
    deliveries: &[&Delivery],
    lease: Duration,
    work: impl Future<Output = T>,
) -> T {
    let every = renew_every(lease);
    tokio::pin!(work);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => renew(deliveries, lease).await,
        }
    }
}

/// Extends each of `deliveries` by `lease` at once, logging how many
/// could not be extended.
pub async fn renew(deliveries: &[&Delivery], lease: Duration) {
    let results = join_all(deliveries.iter().map(|d| d.extend(lease))).await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        tracing::debug!(failed, error = %e, "could not extend some leases; their messages may be delivered again");
    }
}
