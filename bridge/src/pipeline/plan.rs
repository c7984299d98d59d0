//! Plan: each delivery of a batch is decoded by its content type, matched
//! to the first route that takes it, mapped (call → job, job → call, job →
//! job) and its destination checked, then grouped by (route, queue) for
//! publishing. What cannot be planned is dead-lettered with its reason.

use ojs_grpcq::Decode as _;
use std::borrow::Cow;
use std::time::Instant;

use ojs_grpcq::mapping::JobTypes;
use ojs_queue::{DeadLetterKind, DeadLetterReason, Delivery, OutgoingMessage};

use super::dead_letter::dead_letter;
use super::publish::publish_group;
use super::SourceCtx;
use crate::routes::Incoming;

/// Messages of one batch bound for one (route, queue).
pub(super) struct Group<'a> {
    /// Index of the route in configuration order.
    pub(super) route: usize,
    /// Borrowed from the route when the route names it.
    pub(super) queue: Cow<'a, str>,
    pub(super) items: Vec<Outgoing>,
}

/// A source delivery and the message it became.
pub(super) struct Outgoing {
    pub(super) delivery: Delivery,
    pub(super) message: OutgoingMessage,
    /// When the message was created (ms since the epoch), for the
    /// end-to-end latency.
    pub(super) created_ms: Option<i64>,
}

/// Where a planned message goes and what it is.
struct Planned<'a> {
    route: usize,
    queue: Cow<'a, str>,
    message: OutgoingMessage,
    created_ms: Option<i64>,
}

/// Plans, publishes and settles one batch.
pub(super) async fn process_batch(ctx: &SourceCtx, deliveries: Vec<Delivery>) {
    let received_at = Instant::now();
    let n = deliveries.len();
    let mut groups: Vec<Group> = Vec::new();
    let mut dead: Vec<(Delivery, DeadLetterReason)> = Vec::new();
    let mut job_types = JobTypes::new();
    for d in deliveries {
        match plan(ctx, &d, &mut job_types) {
            Ok(Planned {
                route,
                queue,
                message,
                created_ms,
            }) => {
                let item = Outgoing {
                    delivery: d,
                    message,
                    created_ms,
                };
                match groups
                    .iter_mut()
                    .find(|g| g.route == route && g.queue == queue)
                {
                    Some(g) => g.items.push(item),
                    None => {
                        // Most batches have one destination: room for the
                        // whole batch up front, not a regrowth (and a copy
                        // of every message) at each doubling.
                        let mut items = Vec::with_capacity(if groups.is_empty() { n } else { 4 });
                        items.push(item);
                        groups.push(Group {
                            route,
                            queue,
                            items,
                        });
                    }
                }
            }
            Err(reason) => dead.push((d, reason)),
        }
    }
    for group in groups {
        publish_group(ctx, group, received_at, &mut dead).await;
    }
    for (d, reason) in dead {
        dead_letter(ctx, d, reason).await;
    }
}

/// Where a delivery goes and what it becomes — or why it cannot go.
fn plan<'a>(
    ctx: &'a SourceCtx,
    d: &Delivery,
    job_types: &mut JobTypes,
) -> Result<Planned<'a>, DeadLetterReason> {
    let msg = d.decode(Some(ctx.default_encoding))?;
    let Some(route) = ctx
        .routes
        .iter()
        .position(|p| p.route.matches(ctx.name(), &msg))
    else {
        return Err(DeadLetterReason::of(
            DeadLetterKind::UnknownRoute,
            match &msg {
                Incoming::Call(c) => {
                    format!("no route takes grpcq call {}/{}", c.topic(), c.action())
                }
                Incoming::Job(j) => format!("no route takes job type {}", j.job_type),
            },
        ));
    };
    let created_ms = msg.created_ms();
    let plan = &ctx.routes[route];
    let (queue, message) = plan.route.map(msg, &ctx.config.queue, job_types)?;
    plan.route
        .admit_destination(&queue, |q| plan.sink.is_reserved(q))?;
    // No size check here: the sink's `publish` makes the one check (its
    // limit, its way of counting) and hands an oversized message back as
    // `PayloadTooLarge`, which `publish_group` dead-letters.
    Ok(Planned {
        route,
        queue,
        message,
        created_ms,
    })
}
