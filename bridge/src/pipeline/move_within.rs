//! Move: a source whose routes all publish to queues of its own broker,
//! where that broker keeps its queues in one transactional store (the
//! embedded broker, [`ojs_queue::MoveWithin`]), runs each batch as one move instead of
//! the receive, publish and settle stages: the batch is taken, planned (by
//! the same [`plan`](super::plan) as every batch), published and removed in
//! one transaction, or dead-lettered in it. Where the stages take a lease,
//! a publish commit and an ack commit, a move takes one commit, and a crash
//! leaves each message either where it was or moved: exactly once.
//!
//! A source with a dead-letter destination of its own runs the stages (its
//! dead letters go to another queue, perhaps another broker), and so does
//! one whose move fails in a way a retry cannot mend (a planner that
//! panicked): it says so and runs the stages from then on.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ojs_grpcq::mapping::JobTypes;
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::{Delivery, Error, MoveTo};
use tokio::sync::watch;

use super::plan::{plan, Destination};
use super::{SourceCtx, MAX_BACKOFF, RECEIVE_WAIT};

/// Whether `ctx` runs as moves: its broker moves within itself, every
/// route publishes to that same broker, and its dead letters stay there.
pub(super) fn runs_as_moves(ctx: &SourceCtx) -> bool {
    ctx.adapter.mover().is_some()
        && ctx.dead_letter.is_none()
        && !ctx.routes.is_empty()
        && ctx
            .routes
            .iter()
            .all(|p| Arc::ptr_eq(&p.sink, &ctx.adapter))
}

/// What the planner decided of each message of a move, for the counters
/// once it committed: the route and creation time of a published one,
/// the reason's type of a dead-lettered one.
enum Planned {
    Route(usize, Option<i64>),
    Dead(String),
}

/// Runs `ctx` as moves until `stop`. `false` when a move failed in a way
/// a retry cannot mend: the caller runs the stages instead.
pub(super) async fn run_moves(ctx: &Arc<SourceCtx>, stop: &mut watch::Receiver<bool>) -> bool {
    let Some(mover) = ctx.adapter.mover() else {
        return false;
    };
    tracing::debug!(source = %ctx.name(), queue = %ctx.config.queue, "every route stays on the source's broker: each batch moves in one transaction");
    let mut attempt = 0u32;
    loop {
        if *stop.borrow() {
            return true;
        }
        let planned: Arc<Mutex<Vec<Planned>>> = Arc::default();
        let planner = {
            let (ctx, planned) = (ctx.clone(), planned.clone());
            Box::new(move |deliveries: &[Delivery]| plan_moves(&ctx, deliveries, &planned))
        };
        let started = Instant::now();
        // Not raced against `stop`: a move that committed is counted, and
        // one waits for messages at most `RECEIVE_WAIT`.
        let moved = mover
            .move_within(
                &ctx.config.queue,
                ctx.config.batch_size,
                RECEIVE_WAIT,
                planner,
            )
            .await;
        match moved {
            Ok(published) => {
                attempt = 0;
                ctx.alarm.ok();
                if !published.is_empty() {
                    tracing::trace!(source = %ctx.name(), messages = published.len(), published = published.iter().filter(|p| **p).count(), "moved a batch");
                }
                let planned = std::mem::take(&mut *lock(&planned));
                counted(ctx, &published, planned, started.elapsed());
            }
            Err(e) if !e.is_retryable() && !matches!(e, Error::Closed) => {
                ctx.metrics.error(ctx.name(), "move");
                tracing::warn!(source = %ctx.name(), error = %e, "moving a batch within the broker failed; the source runs as receive, publish and ack from now on");
                return false;
            }
            Err(e) => {
                attempt += 1;
                ctx.metrics.error(ctx.name(), "move");
                let delay = reconnect_delay(attempt, MAX_BACKOFF);
                tracing::debug!(source = %ctx.name(), error = %e, attempt, delay_ms = delay.as_millis() as u64, "moving a batch failed; retrying");
                ctx.alarm.failing(
                    &ctx.config.queue,
                    &format!("moving a batch failed: {e}"),
                    delay,
                );
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return true,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

fn lock(planned: &Mutex<Vec<Planned>>) -> std::sync::MutexGuard<'_, Vec<Planned>> {
    planned.lock().unwrap_or_else(|e| e.into_inner())
}

/// The planner of one move: each delivery planned as every batch's are,
/// what it became noted in `planned`.
fn plan_moves(
    ctx: &SourceCtx,
    deliveries: &[Delivery],
    planned: &Mutex<Vec<Planned>>,
) -> Vec<MoveTo> {
    let mut job_types = JobTypes::new();
    let mut planned = lock(planned);
    planned.clear();
    deliveries
        .iter()
        .map(|d| match plan(ctx, d, &mut job_types) {
            Ok(Destination {
                route,
                queue,
                message,
                created_ms,
            }) => {
                planned.push(Planned::Route(route, created_ms));
                MoveTo::Queue {
                    queue: queue.into_owned(),
                    message,
                }
            }
            Err(reason) => {
                tracing::warn!(source = %ctx.name(), reason = %reason.error_type, message_id = d.message_id.as_deref(), detail = %reason.message, "dead-lettering");
                planned.push(Planned::Dead(reason.error_type.clone()));
                MoveTo::DeadLetter(reason)
            }
        })
        .collect()
}

/// A committed move in the counters, as the stages count the same
/// messages: received, published by route (with their latencies), dead
/// letters, settled.
fn counted(ctx: &SourceCtx, published: &[bool], planned: Vec<Planned>, took: Duration) {
    if published.is_empty() {
        return;
    }
    let counters = ctx.counters();
    let n = published.len() as u64;
    counters.received.fetch_add(n, Ordering::Relaxed);
    let now_ms = chrono::Utc::now().timestamp_millis();
    // Published by route: how many, and when each was created.
    let mut by_route: Vec<(u64, Vec<Duration>)> =
        ctx.routes.iter().map(|_| (0, Vec::new())).collect();
    let mut dead = 0u64;
    for (was_published, planned) in published.iter().zip(planned) {
        match (was_published, planned) {
            (true, Planned::Route(route, created_ms)) => {
                if let Some((count, ages)) = by_route.get_mut(route) {
                    *count += 1;
                    if let Some(created) = created_ms {
                        let ms = u64::try_from(now_ms.saturating_sub(created)).unwrap_or(0);
                        ages.push(Duration::from_millis(ms));
                    }
                }
            }
            // Too large for the broker: dead-lettered by the move.
            (false, Planned::Route(..)) => {
                ctx.metrics.dead_lettered(
                    ctx.name(),
                    ojs_queue::DeadLetterKind::PayloadTooLarge.as_str(),
                );
                dead += 1;
            }
            (false, Planned::Dead(error_type)) => {
                ctx.metrics.dead_lettered(ctx.name(), &error_type);
                dead += 1;
            }
            (true, Planned::Dead(_)) => {}
        }
    }
    for ((count, ages), plan) in by_route.into_iter().zip(ctx.routes.iter()) {
        if count > 0 {
            plan.metrics.published.fetch_add(count, Ordering::Relaxed);
            plan.metrics.bridge_latency.observe_n(took, count);
            plan.metrics.end_to_end_latency.observe_all(ages);
        }
    }
    counters.dead_lettered.fetch_add(dead, Ordering::Relaxed);
    counters.acked.fetch_add(n, Ordering::Relaxed);
}
