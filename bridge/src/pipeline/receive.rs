//! Receive: one loop per source takes batches from the adapter's consumer
//! while earlier batches are still being published, bounded by
//! `max_in_flight` (messages) and `max_in_flight_bytes`; with
//! `ordering = "per_key"` a key always takes the same lane, and a lane
//! publishes one batch at a time.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use ojs_core::backoff::reconnect_delay;
use ojs_core::{ConsumerOptions, Delivery};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::plan::process_batch;
use super::{SourceCtx, MAX_BACKOFF, RECEIVE_WAIT};

/// Runs one source until `stop`, then gives in-flight work `drain` to
/// finish.
pub(crate) async fn run_source(
    ctx: Arc<SourceCtx>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    let options = ConsumerOptions {
        group: ctx.config.group.clone(),
        visibility_timeout: ctx.config.visibility_timeout,
        prefetch: u16::try_from(ctx.config.max_in_flight).unwrap_or(u16::MAX),
        ..ConsumerOptions::default()
    };
    let permits = Arc::new(Semaphore::new(ctx.config.max_in_flight));
    // Payload bytes, as permits.
    let bytes = Arc::new(Semaphore::new(
        ctx.config.max_in_flight_bytes.min(Semaphore::MAX_PERMITS),
    ));
    let mut tasks: JoinSet<()> = JoinSet::new();
    // With per-key ordering, each lane publishes one batch at a time, in
    // the order it was handed them; a key always takes the same lane.
    let mut lanes: Vec<mpsc::UnboundedSender<(Vec<Delivery>, Arc<Held>)>> = Vec::new();
    for _ in 0..ctx.config.ordered_lanes().unwrap_or(0) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<Delivery>, Arc<Held>)>();
        let ctx = ctx.clone();
        tasks.spawn(async move {
            let lease = ctx.config.visibility_timeout;
            let every = (lease / 2).max(Duration::from_millis(50));
            let mut queued: VecDeque<(Vec<Delivery>, Arc<Held>)> = VecDeque::new();
            loop {
                if queued.is_empty() {
                    match rx.recv().await {
                        Some(next) => queued.push_back(next),
                        None => break,
                    }
                }
                let Some((batch, held)) = queued.pop_front() else {
                    continue;
                };
                let work = process_batch(&ctx, batch);
                tokio::pin!(work);
                loop {
                    tokio::select! {
                        () = &mut work => break,
                        // Batches waiting behind a slow one keep their
                        // source leases, or they would be handed out again.
                        () = tokio::time::sleep(every) => {
                            while let Ok(next) = rx.try_recv() {
                                queued.push_back(next);
                            }
                            let waiting = queued.iter().flat_map(|(b, _)| b.iter());
                            join_all(waiting.map(|d| d.extend(lease))).await;
                        }
                    }
                }
                drop(held);
            }
        });
        lanes.push(tx);
    }
    let mut keyless = 0usize;
    let mut consumer = None;
    let mut failures = 0u32;
    loop {
        while tasks.try_join_next().is_some() {}
        if *stop.borrow() {
            break;
        }
        let c = match consumer.as_mut() {
            Some(c) => c,
            None => match tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                c = ctx.adapter.consumer(&ctx.config.queue, options.clone()) => c,
            } {
                Ok(c) => {
                    failures = 0;
                    consumer.insert(c)
                }
                Err(e) => {
                    failures += 1;
                    ctx.metrics.error(ctx.name(), "consumer");
                    let delay = reconnect_delay(failures, MAX_BACKOFF);
                    tracing::debug!(source = %ctx.name(), error = %e, delay_ms = delay.as_millis() as u64, "cannot open the consumer; retrying");
                    ctx.alarm.failing(
                        &ctx.config.queue,
                        &format!("cannot open the consumer: {e}"),
                        delay,
                    );
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            },
        };
        let free = permits.available_permits();
        if free == 0 || bytes.available_permits() == 0 {
            // Backpressure: wait for a batch to finish before fetching more.
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                () = capacity(&permits, &bytes) => continue,
            }
        }
        let want = free.min(ctx.config.batch_size);
        let received = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            received = c.receive(want, RECEIVE_WAIT) => received,
        };
        match received {
            Ok(batch) if batch.is_empty() => ctx.alarm.ok(),
            Ok(batch) => {
                failures = 0;
                ctx.alarm.ok();
                let n = batch.len();
                let size: usize = batch.iter().map(|d| d.payload.len()).sum();
                tracing::trace!(source = %ctx.name(), messages = n, bytes = size, "received a batch");
                let counters = ctx.counters();
                counters.received.fetch_add(n as u64, Ordering::Relaxed);
                counters.in_flight.fetch_add(n as i64, Ordering::Relaxed);
                counters
                    .in_flight_bytes
                    .fetch_add(size as i64, Ordering::Relaxed);
                // Capacity was checked above: this does not wait.
                let Ok(permit) = permits.clone().acquire_many_owned(n as u32).await else {
                    break;
                };
                // The batch is in memory already, so it runs even when it
                // is larger than what is free: it takes what is free and
                // the next receive waits until the budget has room again.
                let take = size.min(bytes.available_permits());
                let byte_permit = bytes
                    .clone()
                    .try_acquire_many_owned(u32::try_from(take).unwrap_or(u32::MAX))
                    .ok();
                let held = Held {
                    ctx: ctx.clone(),
                    n,
                    size,
                    _permits: (permit, byte_permit),
                };
                if lanes.is_empty() {
                    let ctx = ctx.clone();
                    tasks.spawn(async move {
                        process_batch(&ctx, batch).await;
                        drop(held);
                    });
                } else {
                    let held = Arc::new(held);
                    let mut by_lane: Vec<Vec<Delivery>> =
                        (0..lanes.len()).map(|_| Vec::new()).collect();
                    for d in batch {
                        let lane = match &d.key {
                            Some(key) => lane_of(key, lanes.len()),
                            // No key, no order to keep: spread them.
                            None => {
                                keyless = keyless.wrapping_add(1);
                                keyless % lanes.len()
                            }
                        };
                        by_lane[lane].push(d);
                    }
                    for (lane, part) in lanes.iter().zip(by_lane) {
                        if !part.is_empty() {
                            // A lane ends only when `lanes` is dropped.
                            let _ = lane.send((part, held.clone()));
                        }
                    }
                }
            }
            Err(e) => {
                failures += 1;
                ctx.metrics.error(ctx.name(), "receive");
                let delay = reconnect_delay(failures, MAX_BACKOFF);
                tracing::debug!(source = %ctx.name(), error = %e, delay_ms = delay.as_millis() as u64, "receive failed; retrying");
                ctx.alarm
                    .failing(&ctx.config.queue, &format!("receive failed: {e}"), delay);
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    // Lanes finish what they were handed, then end.
    drop(lanes);
    let drained =
        tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(source = %ctx.name(), batches = tasks.len(), "shutdown timeout: abandoning in-flight messages; they will be delivered again");
        tasks.shutdown().await;
    }
    if let Some(c) = consumer {
        if let Err(e) = c.close().await {
            tracing::warn!(source = %ctx.name(), error = %e, "closing the consumer failed");
        }
    }
}

/// What a received batch holds until every part of it is settled: its
/// share of `max_in_flight` and of the byte budget, and the in-flight
/// gauges.
struct Held {
    ctx: Arc<SourceCtx>,
    n: usize,
    size: usize,
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
}

impl Drop for Held {
    fn drop(&mut self) {
        let counters = self.ctx.counters();
        counters
            .in_flight
            .fetch_sub(self.n as i64, Ordering::Relaxed);
        counters
            .in_flight_bytes
            .fetch_sub(self.size as i64, Ordering::Relaxed);
    }
}

/// Resolves once a message and a byte of budget are free.
async fn capacity(permits: &Semaphore, bytes: &Semaphore) {
    let _ = permits.acquire().await;
    let _ = bytes.acquire().await;
}

/// The lane of a key: the same key, the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}
