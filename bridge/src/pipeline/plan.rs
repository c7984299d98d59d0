//! Plan: each delivery of a batch is decoded by its content type, matched
//! to the first route that takes it, mapped (call → job, job → call, job →
//! job) and its destination checked, then grouped by (route, queue) for
//! publishing. What cannot be planned is set aside with its reason, for
//! the dead-letter stage.

use ojs_grpcq::Decode as _;
use std::borrow::Cow;

use ojs_grpcq::mapping::JobTypes;
use ojs_queue::{DeadLetterKind, DeadLetterReason, Delivery, OutgoingMessage};

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
pub(super) struct Destination<'a> {
    pub(super) route: usize,
    pub(super) queue: Cow<'a, str>,
    pub(super) message: OutgoingMessage,
    pub(super) created_ms: Option<i64>,
}

/// A batch planned: its messages grouped by destination, and what cannot
/// go anywhere with the reason.
pub(super) struct Planned<'a> {
    pub(super) groups: Vec<Group<'a>>,
    pub(super) dead: Vec<(Delivery, DeadLetterReason)>,
}

/// Plans one batch.
pub(super) fn plan_batch(ctx: &SourceCtx, deliveries: Vec<Delivery>) -> Planned<'_> {
    let n = deliveries.len();
    let mut groups: Vec<Group> = Vec::new();
    let mut dead: Vec<(Delivery, DeadLetterReason)> = Vec::new();
    let mut job_types = JobTypes::new();
    for d in deliveries {
        match plan(ctx, &d, &mut job_types) {
            Ok(Destination {
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
    Planned { groups, dead }
}

/// Where a delivery goes and what it becomes — or why it cannot go.
pub(super) fn plan<'a>(
    ctx: &'a SourceCtx,
    d: &Delivery,
    job_types: &mut JobTypes,
) -> Result<Destination<'a>, DeadLetterReason> {
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
    Ok(Destination {
        route,
        queue,
        message,
        created_ms,
    })
}
