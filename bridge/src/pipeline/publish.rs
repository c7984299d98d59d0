//! Publish: one publish per (route, queue) group while the source leases
//! are held; what the sink confirmed is acked at the source. A refusal
//! about the message (too large, refused for what it is) is dead-lettered;
//! one about the sink (down, full, unroutable, no permission) is retried
//! with backoff while health names the sink — an outage slows the daemon,
//! it never dead-letters good messages.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::future::join_all;
use ojs_queue::backoff::reconnect_delay;
use ojs_queue::receiver::keep_leased;
use ojs_queue::{DeadLetterKind, DeadLetterReason, Delivery, Error, Nack, OutgoingMessage};

use super::plan::Group;
use super::{is_permanent, SourceCtx, MAX_BACKOFF};

/// Publishes one group and settles its deliveries; dead letters go to
/// `dead`.
pub(super) async fn publish_group(
    ctx: &SourceCtx,
    group: Group<'_>,
    received_at: Instant,
    dead: &mut Vec<(Delivery, DeadLetterReason)>,
) {
    let plan = &ctx.routes[group.route];
    let (route, sink) = (&plan.route, &plan.sink);
    let mut waiting: Vec<(Delivery, Option<i64>)> = Vec::with_capacity(group.items.len());
    let mut pending: Vec<OutgoingMessage> = Vec::with_capacity(group.items.len());
    for item in group.items {
        waiting.push((item.delivery, item.created_ms));
        pending.push(item.message);
    }
    let mut attempt = 0u32;
    loop {
        let published = hold_leases(
            ctx,
            &waiting,
            sink.publish(&group.queue, std::mem::take(&mut pending)),
        )
        .await;
        match published {
            Ok(()) => {
                route.sink_alarm.ok();
                confirmed(ctx, group.route, waiting, received_at).await;
                return;
            }
            Err(Error::Publish(failure)) => {
                let total = waiting.len();
                let mut slots: Vec<Option<(Delivery, Option<i64>)>> =
                    waiting.into_iter().map(Some).collect();
                let mut retry_waiting = Vec::new();
                let mut retry_pending = Vec::new();
                let mut last_error = None;
                for f in failure.failed {
                    let Some(slot) = slots.get_mut(f.index).and_then(Option::take) else {
                        continue;
                    };
                    if is_permanent(&f.error) {
                        let kind = match &f.error {
                            Error::PayloadTooLarge { .. } => DeadLetterKind::PayloadTooLarge,
                            Error::UnknownRegion(_) => DeadLetterKind::UnknownRegion,
                            _ => DeadLetterKind::SinkRejected,
                        };
                        let reason = DeadLetterReason::of(kind, f.error.to_string());
                        dead.push((slot.0, reason));
                    } else {
                        last_error = Some(f.error);
                        retry_waiting.push(slot);
                        retry_pending.push(f.message);
                    }
                }
                let done: Vec<_> = slots.into_iter().flatten().collect();
                tracing::debug!(route = %route.name, total, confirmed = done.len(), retrying = retry_waiting.len(), "partial publish");
                confirmed(ctx, group.route, done, received_at).await;
                if retry_waiting.is_empty() {
                    return;
                }
                waiting = retry_waiting;
                pending = retry_pending;
                attempt += 1;
                let reason = last_error.as_ref().map_or("publish", Error::kind);
                ctx.metrics.error(&route.name, reason);
                let delay = reconnect_delay(attempt, MAX_BACKOFF);
                // The source must not hand these out again (or count a
                // receive towards its redrive policy) while we wait for the
                // sink: their leases cover the wait and the next attempt.
                let lease = delay + ctx.config.visibility_timeout;
                let extended = join_all(waiting.iter().map(|(d, _)| d.extend(lease))).await;
                let failed_extends = extended.iter().filter(|r| r.is_err()).count();
                if failed_extends > 0 {
                    tracing::debug!(source = %ctx.name(), failed_extends, "could not extend some source leases while the sink is retried");
                }
                let error =
                    last_error.map_or_else(|| "not confirmed".to_owned(), |e| e.to_string());
                tracing::debug!(route = %route.name, sink = %route.sink, queue = %group.queue, messages = waiting.len(), attempt, delay_ms = delay.as_millis() as u64, %error, "sink did not confirm; retrying");
                route.sink_alarm.failing(&group.queue, &error, delay);
                tokio::time::sleep(delay).await;
            }
            Err(e) => {
                // Adapters hand failed messages back in Error::Publish; any
                // other error leaves nothing to retry here, so the source
                // redelivers them.
                ctx.metrics.error(&route.name, e.kind());
                tracing::debug!(route = %route.name, error = %e, "publish failed; the source will deliver these messages again");
                route.sink_alarm.failing(
                    &group.queue,
                    &e.to_string(),
                    reconnect_delay(1, MAX_BACKOFF),
                );
                let delay = reconnect_delay(1, MAX_BACKOFF);
                join_all(
                    waiting
                        .iter()
                        .map(|(d, _)| d.nack(Nack::retry_after(delay))),
                )
                .await;
                return;
            }
        }
    }
}

/// Runs `publish` while keeping the source leases of `held` alive: a
/// publish that waits longer than the visibility timeout (a blocked broker,
/// a slow confirm) must not let the source hand the messages out again.
async fn hold_leases<T>(
    ctx: &SourceCtx,
    held: &[(Delivery, Option<i64>)],
    publish: impl Future<Output = T>,
) -> T {
    let deliveries: Vec<&Delivery> = held.iter().map(|(d, _)| d).collect();
    keep_leased(&deliveries, ctx.config.visibility_timeout, publish).await
}

/// The sink confirmed these: ack them at the source.
async fn confirmed(
    ctx: &SourceCtx,
    route: usize,
    done: Vec<(Delivery, Option<i64>)>,
    received_at: Instant,
) {
    if done.is_empty() {
        return;
    }
    let route_metrics = &ctx.routes[route].metrics;
    route_metrics
        .published
        .fetch_add(done.len() as u64, Ordering::Relaxed);
    let now_ms = chrono::Utc::now().timestamp_millis();
    let bridge = received_at.elapsed();
    route_metrics
        .bridge_latency
        .observe_n(bridge, done.len() as u64);
    route_metrics
        .end_to_end_latency
        .observe_all(done.iter().filter_map(|(_, created)| {
            let ms = u64::try_from(now_ms.saturating_sub((*created)?)).unwrap_or(0);
            Some(Duration::from_millis(ms))
        }));
    // One settle for the batch where the adapter has one (Kafka's offsets
    // and memory under one lock, the local broker in one commit); the
    // others' acks run together.
    let deliveries: Vec<&Delivery> = done.iter().map(|(d, _)| d).collect();
    let results = Delivery::ack_all(&deliveries).await;
    let acked = results.iter().filter(|r| r.is_ok()).count();
    ctx.counters()
        .acked
        .fetch_add(acked as u64, Ordering::Relaxed);
    if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
        ctx.metrics.error(ctx.name(), "ack");
        tracing::warn!(source = %ctx.name(), failed = done.len() - acked, error = %e, "ack failed after the sink confirmed; those messages will be delivered again (same job ids)");
    }
}
