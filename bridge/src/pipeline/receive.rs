//! Receive: one loop per source takes batches from the adapter's consumer
//! while earlier batches are still being published, bounded by
//! `max_in_flight` (messages) and `max_in_flight_bytes`; with
//! `ordering = "per_key"` a key always takes the same lane, and a lane
//! publishes one batch at a time.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ojs_queue::receiver::{
    renew, renew_every, ReceiveFailure, ReceiveStage, Received, Receiver, ReceiverSettings,
};
use ojs_queue::{ConsumerOptions, Delivery};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::{process_batch, SourceCtx, MAX_BACKOFF, RECEIVE_WAIT};

/// Runs one source until `stop`, then gives in-flight work `drain` to
/// finish.
pub(crate) async fn run_source(
    ctx: Arc<SourceCtx>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    if super::move_within::runs_as_moves(&ctx)
        && super::move_within::run_moves(&ctx, &mut stop).await
    {
        return;
    }
    let options = ConsumerOptions {
        group: ctx.config.group.clone(),
        visibility_timeout: ctx.config.visibility_timeout,
        prefetch: u16::try_from(ctx.config.max_in_flight).unwrap_or(u16::MAX),
        ..ConsumerOptions::default()
    };
    // Payload bytes, as permits.
    let bytes = Arc::new(Semaphore::new(
        ctx.config.max_in_flight_bytes.min(Semaphore::MAX_PERMITS),
    ));
    let mut tasks: JoinSet<()> = JoinSet::new();
    // With per-key ordering, each lane publishes one batch at a time, in
    // the order it was handed them; a key always takes the same lane.
    let mut lanes: Vec<mpsc::UnboundedSender<(Vec<Delivery>, Arc<BatchShare>)>> = Vec::new();
    for _ in 0..ctx.config.ordered_lanes().unwrap_or(0) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<Delivery>, Arc<BatchShare>)>();
        let ctx = ctx.clone();
        tasks.spawn(async move {
            let lease = ctx.config.visibility_timeout;
            let every = renew_every(lease);
            let mut queued: VecDeque<(Vec<Delivery>, Arc<BatchShare>)> = VecDeque::new();
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
                            let waiting: Vec<&Delivery> =
                                queued.iter().flat_map(|(b, _)| b.iter()).collect();
                            renew(&waiting, lease).await;
                        }
                    }
                }
                drop(held);
            }
        });
        lanes.push(tx);
    }
    let mut keyless = 0usize;
    let mut receiver = Receiver::new(
        ctx.adapter.clone(),
        ReceiverSettings {
            queue: ctx.config.queue.clone(),
            consumer: options,
            batch_size: ctx.config.batch_size,
            max_in_flight: ctx.config.max_in_flight,
            receive_wait: RECEIVE_WAIT,
            max_backoff: MAX_BACKOFF,
        },
    );
    let report = ctx.clone();
    let mut on_failure = move |f: ReceiveFailure<'_>| {
        let (stage, what) = match f.stage {
            ReceiveStage::Open => ("consumer", "cannot open the consumer"),
            ReceiveStage::Receive => ("receive", "receive failed"),
        };
        report.metrics.error(report.name(), stage);
        tracing::debug!(source = %report.name(), error = %f.error, delay_ms = f.delay.as_millis() as u64, "{what}; retrying");
        report.alarm.failing(
            &report.config.queue,
            &format!("{what}: {}", f.error),
            f.delay,
        );
    };
    loop {
        while tasks.try_join_next().is_some() {}
        if *stop.borrow() {
            break;
        }
        if bytes.available_permits() == 0 {
            // Backpressure on bytes (the receiver keeps the message
            // budget): wait for a batch to finish before fetching more.
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = bytes.acquire() => continue,
            }
        }
        let received = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            received = receiver.next(&mut on_failure) => received,
        };
        ctx.alarm.ok();
        let Received {
            deliveries: batch,
            permit: Some(permit),
        } = received
        else {
            continue;
        };
        let n = batch.len();
        let size: usize = batch.iter().map(|d| d.payload.len()).sum();
        tracing::trace!(source = %ctx.name(), messages = n, bytes = size, "received a batch");
        let counters = ctx.counters();
        counters.received.fetch_add(n as u64, Ordering::Relaxed);
        counters.in_flight.fetch_add(n as i64, Ordering::Relaxed);
        counters
            .in_flight_bytes
            .fetch_add(size as i64, Ordering::Relaxed);
        // The batch is in memory already, so it runs even when it is
        // larger than what is free: it takes what is free and the next
        // receive waits until the budget has room again.
        let take = size.min(bytes.available_permits());
        let byte_permit = bytes
            .clone()
            .try_acquire_many_owned(u32::try_from(take).unwrap_or(u32::MAX))
            .ok();
        let held = BatchShare {
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
            let mut by_lane: Vec<Vec<Delivery>> = (0..lanes.len()).map(|_| Vec::new()).collect();
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
    // Lanes finish what they were handed, then end.
    drop(lanes);
    let drained =
        tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(source = %ctx.name(), batches = tasks.len(), "shutdown timeout: abandoning in-flight messages; they will be delivered again");
        tasks.shutdown().await;
    }
    if let Err(e) = receiver.close().await {
        tracing::warn!(source = %ctx.name(), error = %e, "closing the consumer failed");
    }
}

/// What a received batch holds until every part of it is settled: its
/// share of `max_in_flight` and of the byte budget, and the in-flight
/// gauges.
struct BatchShare {
    ctx: Arc<SourceCtx>,
    n: usize,
    size: usize,
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
}

impl Drop for BatchShare {
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

/// The lane of a key: the same key, the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}
