//! The daemon's pipeline, one file per stage, in the order a message meets
//! them:
//!
//! 1. [`receive`]: one loop per source takes batches from the adapter's
//!    consumer within the in-flight budget and hands them to a task, or to
//!    a lane when order per key is kept;
//! 2. [`plan`]: each delivery is decoded by its content type, matched to a
//!    route, mapped and its destination checked; what cannot be planned is
//!    dead-lettered;
//! 3. [`publish`]: one publish per destination, source leases held while
//!    the sink works; what the sink confirmed is acked at the source, a
//!    refusal about the message is dead-lettered, one about the sink retried;
//! 4. [`dead_letter`]: to the source's configured destination or the
//!    adapter's own, with the reason, retried while the destination fails.
//!
//! Every source message is acked only after its sink confirmed it (or its
//! dead-letter copy was confirmed): at least once. A source whose routes
//! all stay on its own embedded broker runs as [`move_within`] instead:
//! each batch taken, published and removed in one transaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ojs_core::Encoding;
use ojs_queue::{Delivery, Error, QueueAdapter};

use crate::alarm::Alarm;
use crate::config::SourceConfig;
use crate::metrics::{Metrics, RouteMetrics};
use crate::routes::Route;

mod dead_letter;
mod move_within;
mod plan;
mod publish;
mod receive;

pub(crate) use receive::run_source;

/// Stages 2 to 4 for one batch the receive stage took: plans it, publishes
/// each group and settles its deliveries, then dead-letters what could not
/// go. Each stage is its own module and none calls a later one: this is
/// the one place their order is written.
async fn process_batch(ctx: &SourceCtx, deliveries: Vec<Delivery>) {
    let received_at = Instant::now();
    let plan::Planned { groups, mut dead } = plan::plan_batch(ctx, deliveries);
    for group in groups {
        publish::publish_group(ctx, group, received_at, &mut dead).await;
    }
    for (d, reason) in dead {
        dead_letter::dead_letter(ctx, d, reason).await;
    }
}

/// Whether a per-message publish error is the message's fault (dead-letter
/// it) rather than the sink's (retry it).
fn is_permanent(e: &Error) -> bool {
    matches!(e, Error::PayloadTooLarge { .. }) || (!e.is_retryable() && !matches!(e, Error::Closed))
}

/// Longest wait between two attempts at a failing sink or consumer.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Longest wait of one receive: bounds how long an idle source takes to
/// notice nothing (shutdown is noticed at once regardless).
const RECEIVE_WAIT: Duration = Duration::from_secs(1);

/// A route compiled with what it needs at run time: its matcher and
/// mapper, the sink it publishes to (an adapter or a federation) and its
/// counters. One owner of each, built once at start.
#[derive(Debug)]
pub(crate) struct RoutePlan {
    pub(crate) route: Route,
    pub(crate) sink: Arc<dyn QueueAdapter>,
    pub(crate) metrics: Arc<RouteMetrics>,
}

/// Everything one source's tasks share.
pub(crate) struct SourceCtx {
    pub(crate) index: usize,
    pub(crate) config: SourceConfig,
    pub(crate) adapter: Arc<dyn QueueAdapter>,
    pub(crate) default_encoding: Encoding,
    pub(crate) routes: Arc<Vec<RoutePlan>>,
    pub(crate) dead_letter: Option<(Arc<dyn QueueAdapter>, String)>,
    pub(crate) metrics: Arc<Metrics>,
    /// Logs when consuming starts failing and when it recovers; health
    /// reads it.
    pub(crate) alarm: Arc<Alarm>,
}

impl SourceCtx {
    pub(crate) fn name(&self) -> &str {
        &self.config.name
    }

    pub(crate) fn counters(&self) -> &crate::metrics::SourceMetrics {
        &self.metrics.sources[self.index].1
    }
}
