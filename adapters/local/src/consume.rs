//! Consuming: leases taken in the store, a consumer's held deliveries
//! given back when it closes or is dropped.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{Consumer, ConsumerOptions, Delivery, Result, Source};
use tokio::time::Instant;

use crate::ack::LocalAcker;
use crate::{blocking, store, wait_for_messages, Inner};

pub(crate) type Held = Arc<Mutex<HashSet<(i64, i64)>>>;

pub(crate) fn lock_held(held: &Held) -> MutexGuard<'_, HashSet<(i64, i64)>> {
    held.lock().unwrap_or_else(|e| e.into_inner())
}

/// A consumer of one local queue (or its dead letters).
#[derive(Debug)]
pub struct LocalConsumer {
    pub(crate) inner: Arc<Inner>,
    pub(crate) queue: Arc<str>,
    pub(crate) options: ConsumerOptions,
    /// Leases this consumer holds, released when it is dropped.
    pub(crate) held: Held,
}

#[async_trait]
impl Consumer for LocalConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        let dead = self.options.source == Source::DeadLetters;
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (queue, visibility, max_deliveries, held) = (
                self.queue.clone(),
                self.options.visibility_timeout,
                self.options.max_deliveries,
                self.held.clone(),
            );
            // The claim is recorded in `held` on the blocking thread, so even
            // if this future is dropped the leases are released with the
            // consumer instead of waiting out the visibility timeout.
            let (claimed, lease, next) = blocking(&self.inner, move |_, conn| {
                let (claimed, lease) =
                    store::claim(conn, &queue, dead, max.max(1), visibility, max_deliveries)?;
                lock_held(&held).extend(claimed.iter().map(|c| (c.id, lease)));
                let next = if claimed.is_empty() {
                    store::next_visible(conn, &queue, dead)?
                } else {
                    None
                };
                Ok((claimed, lease, next))
            })
            .await?;
            if !claimed.is_empty() {
                return Ok(claimed
                    .into_iter()
                    .map(|c| {
                        let acker = Box::new(LocalAcker {
                            inner: self.inner.clone(),
                            id: c.id,
                            lease,
                            held: self.held.clone(),
                        });
                        c.into_delivery(self.queue.clone(), acker)
                    })
                    .collect());
            }
            if !wait_for_messages(&self.inner, notified.as_mut(), next, deadline).await {
                return Ok(Vec::new());
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<()> {
        let leases: Vec<(i64, i64)> = lock_held(&self.held).drain().collect();
        if !leases.is_empty() {
            blocking(&self.inner, move |_, conn| store::release(conn, &leases)).await?;
            self.inner.notify.notify_waiters();
        }
        Ok(())
    }
}

impl Drop for LocalConsumer {
    fn drop(&mut self) {
        let leases: Vec<(i64, i64)> = lock_held(&self.held).drain().collect();
        if leases.is_empty() {
            return;
        }
        // Synchronous on purpose: the messages must be available again by the
        // time the consumer is gone. If this fails, the leases simply run out.
        let mut conn = self.inner.lock();
        if let Err(e) = store::release(&mut conn, &leases) {
            tracing::warn!(error = %e, count = leases.len(), "could not release leases; they return after the visibility timeout");
        }
        drop(conn);
        self.inner.notify.notify_waiters();
    }
}
