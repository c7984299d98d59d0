//! The live event stream (`GET /ojs/v1/events/stream`, Server-Sent
//! Events): the job store's event log, followed.
//!
//! A subscriber is a cursor into the log, not a queue of its own: it takes
//! the events after its cursor a page at a time ([`PAGE`]) as the client
//! takes them, so a slow subscriber holds one page and falls behind in the
//! log instead of holding memory or slowing the server, and every event
//! comes in the log's order, none lost, also across replicas (they share
//! the log on PostgreSQL). The newest events are kept once for all
//! subscribers ([`TAIL`] of them, read from the store by one subscriber at
//! a time): subscribers that keep up take their pages from there, in
//! memory, and only one that fell further behind reads the store itself. A client that reconnects with `Last-Event-ID`
//! (or `?after=`) goes on after that event; when the log no longer holds
//! what came after it (pruned past `[api] retention`) the stream first says
//! so with a `system.gap` event. New events wake the readers of this
//! process at once; those written by another replica are found within a
//! second. A comment line every 15 s keeps proxies from closing an idle
//! stream. The number of streams open at once is bounded (`[api]
//! max_event_streams`); the stream ends when the server drains.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::store::EventFilter;
use crate::Api;

/// Events one read of the log hands a subscriber, at most.
pub const PAGE: usize = 100;
/// How often a stream with nothing to send says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// How often a stream looks at the log without being woken (another
/// replica's events, the server draining).
const LOOK: Duration = Duration::from_secs(1);

/// How long a draining server gives its streams to end.
pub const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// The newest events kept for every subscriber, at most.
pub const TAIL: usize = 10_000;

/// Streams open now, against `[api] max_event_streams`, and the log's
/// newest events they share.
#[derive(Debug, Default)]
pub struct Streams {
    open: AtomicUsize,
    tail: tokio::sync::RwLock<Tail>,
    /// One subscriber at a time reads the store for the tail.
    refreshing: tokio::sync::Mutex<()>,
}

/// The log's newest events, unfiltered, as read.
#[derive(Debug, Default)]
struct Tail {
    events: std::collections::VecDeque<crate::store::Event>,
    /// Where the next read of the log starts (the last position read);
    /// `None` until the first.
    read_to: Option<i64>,
    /// When it was last read.
    read_at: Option<Instant>,
}

impl Tail {
    /// The events `filter` admits after its cursor, at most a page, and
    /// the cursor after them; `None` when the tail does not reach back to
    /// the cursor (the subscriber reads the store).
    fn page(&self, filter: &EventFilter) -> Option<(Vec<crate::store::Event>, i64)> {
        let read_to = self.read_to?;
        let first = self.events.front().map_or(read_to + 1, |e| e.seq);
        if filter.after + 1 < first && filter.after < read_to {
            return None;
        }
        let mut out = Vec::new();
        let mut cursor = filter.after.max(read_to.min(filter.after));
        for e in self.events.iter().filter(|e| e.seq > filter.after) {
            if out.len() == PAGE {
                return Some((out, cursor));
            }
            cursor = e.seq;
            if filter.admits(e) {
                out.push(e.clone());
            }
        }
        Some((out, read_to.max(filter.after)))
    }
}

impl Streams {
    /// Reads what the log holds after the tail, unless another subscriber
    /// did since `woken`.
    /// A subscriber that only looks again (no write woke it) takes a tail
    /// read within the last half second: a thousand of them looking each
    /// second do not read the store a thousand times.
    async fn refresh(&self, api: &Api, woken: Instant, by_write: bool) -> Result<(), ApiError> {
        let _one = self.refreshing.lock().await;
        let from = {
            let tail = self.tail.read().await;
            let recent = |at: Instant| at >= woken || (!by_write && at.elapsed() < LOOK / 2);
            if tail.read_at.is_some_and(recent) {
                return Ok(());
            }
            tail.read_to
        };
        let mut read = Vec::new();
        let mut to = match from {
            Some(to) => to,
            // The first read starts at the log's end.
            None => api.store.run(|tx| tx.event_bounds()).await?.1.unwrap_or(0),
        };
        let began = Instant::now();
        loop {
            let page = api
                .store
                .events(EventFilter {
                    after: to,
                    limit: 1_000,
                    ..EventFilter::default()
                })
                .await?;
            to = page.cursor.max(to);
            read.extend(page.events);
            if !page.has_more || read.len() >= TAIL {
                break;
            }
        }
        let mut tail = self.tail.write().await;
        tail.events.extend(read);
        while tail.events.len() > TAIL {
            tail.events.pop_front();
        }
        tail.read_to = Some(to);
        tail.read_at = Some(began);
        Ok(())
    }
}

/// One open stream's place in [`Streams`]; freed when dropped.
struct Slot(Arc<Api>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.streams.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads `Last-Event-ID` (or `after`): this server's `evt_<n>` or `<n>`.
pub fn cursor_of(id: &str) -> Option<i64> {
    id.trim()
        .strip_prefix("evt_")
        .unwrap_or(id.trim())
        .parse()
        .ok()
}

/// The id the bindings show for the event at log position `seq`.
pub fn event_id(seq: i64) -> String {
    format!("evt_{seq:016}")
}

fn frame(id: Option<&str>, event: &str, data: &serde_json::Value) -> Bytes {
    let mut text = String::new();
    if let Some(id) = id {
        text.push_str("id: ");
        text.push_str(id);
        text.push('\n');
    }
    text.push_str("event: ");
    text.push_str(event);
    text.push_str("\ndata: ");
    text.push_str(&data.to_string());
    text.push_str("\n\n");
    Bytes::from(text)
}

/// How far back the admin UI's paged view of the log looks: one read of
/// the store (the newest this many positions).
pub const PAGED_WINDOW: i64 = crate::store::MAX_EVENTS_SCANNED;

impl Api {
    /// `GET /ojs/v1/events?page&per_page` (the admin UI's Events page): the
    /// events `filter` selects among the newest [`PAGED_WINDOW`] of the
    /// log, newest first, page `page` of `per_page`; and how many matched
    /// there.
    pub async fn recent_events(
        &self,
        grant: &Grant<'_>,
        mut filter: EventFilter,
        page: usize,
        per_page: usize,
    ) -> Result<(Vec<crate::store::Event>, usize), ApiError> {
        grant.allow(Operation::Read)?;
        let newest = self.store.run(|tx| tx.event_bounds()).await?.1.unwrap_or(0);
        filter.scope = grant.scope().to_vec();
        filter.after = newest.saturating_sub(PAGED_WINDOW).max(0);
        filter.limit = usize::try_from(PAGED_WINDOW).unwrap_or(usize::MAX);
        let mut events = self.store.events(filter).await?.events;
        events.reverse();
        let total = events.len();
        let page = events
            .into_iter()
            .skip(page.saturating_sub(1).saturating_mul(per_page))
            .take(per_page)
            .collect();
        Ok((page, total))
    }

    /// While the server drains: waits for the open streams to tell their
    /// clients and end, at most [`CLOSE_WITHIN`] (a client that reads
    /// nothing cannot be told).
    pub(crate) async fn streams_closed(&self) {
        let until = Instant::now() + CLOSE_WITHIN;
        while self.streams.open.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Follows the log: the events `filter` selects after `after` (`None`:
    /// from now on), as [`Delivery`]s, holding one of `[api]
    /// max_event_streams` until dropped. The SSE stream, the WebSocket and
    /// gRPC `StreamEvents` are each a view of one.
    pub async fn follow(
        self: &Arc<Self>,
        grant: &Grant<'_>,
        mut filter: EventFilter,
        after: Option<i64>,
    ) -> Result<impl tokio_stream::Stream<Item = Delivery> + Send + 'static, ApiError> {
        grant.allow(Operation::Read)?;
        filter.scope = grant.scope().to_vec();
        filter.limit = PAGE;
        let limit = self.settings.max_event_streams;
        if self.streams.open.fetch_add(1, Ordering::SeqCst) >= limit {
            self.streams.open.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::StreamLimit { limit });
        }
        let slot = Slot(self.clone());
        // From now on, unless the client says where it was.
        let (oldest, newest) = self.store.run(|tx| tx.event_bounds()).await?;
        let (start, gap) = match after {
            Some(after) => (after, oldest.filter(|o| *o > after + 1).map(|o| (after, o))),
            None => (newest.unwrap_or(0), None),
        };
        Ok(follow_log(slot, self.clone(), filter, start, gap))
    }

    /// Opens a Server-Sent Events stream of `view` (the events `filter`
    /// selects, narrowed to the view's job or queue, after `after`; `None`:
    /// from now on). The stream yields SSE text frames.
    pub async fn event_stream(
        self: &Arc<Self>,
        grant: &Grant<'_>,
        mut filter: EventFilter,
        after: Option<i64>,
        view: StreamView,
    ) -> Result<impl tokio_stream::Stream<Item = Bytes> + Send + 'static, ApiError> {
        use futures::StreamExt;
        match &view {
            StreamView::Job { id } => filter.job_ids = vec![id.clone()],
            StreamView::Queue { name } => filter.queues = vec![name.clone()],
            StreamView::Log => {}
        }
        let view = match view {
            StreamView::Job { id } => {
                let job = self.info(grant, &id).await?;
                ViewState::Job {
                    id,
                    queue: job.envelope.queue.clone(),
                    job_type: job.envelope.job_type.clone(),
                    state: job.state(),
                }
            }
            StreamView::Queue { name } => {
                let known = self.queues(grant).await?.iter().any(|q| q.name == name);
                if !known {
                    return Err(ApiError::NotFound {
                        resource_type: "queue",
                        resource_id: name,
                    });
                }
                ViewState::Queue {
                    states: Default::default(),
                }
            }
            StreamView::Log => ViewState::Log,
        };
        let mut first = vec![Bytes::from_static(b"retry: 3000\n\n")];
        let mut ended = false;
        if let ViewState::Job {
            id,
            queue,
            job_type,
            state,
        } = &view
        {
            // A finished job's stream says where it is and ends.
            if crate::model::is_final(*state) {
                let to = state.as_str().unwrap_or("unknown");
                let data = state_changed(id, queue, job_type, None, to, &timestamp_now());
                first.push(frame(None, "job.state_changed", &data));
                ended = true;
            }
        }
        let follower = if ended {
            None
        } else {
            Some(self.follow(grant, filter, after).await?.boxed())
        };
        let head = futures::stream::iter(first);
        // Ends right after the frames that finish the view (a finished
        // job), not at the follower's next delivery.
        let tail = futures::stream::unfold((view, follower), |(mut view, follower)| async move {
            let mut follower = follower?;
            let delivery = follower.next().await?;
            let (frames, end) = view.frames(delivery);
            let follower = (!end).then_some(follower);
            Some((futures::stream::iter(frames), (view, follower)))
        })
        .flatten();
        Ok(head.chain(tail))
    }
}

/// What a follower of the log hands on, in the log's order.
#[derive(Debug, Clone)]
pub enum Delivery {
    /// The next event that matched.
    Event(crate::store::Event),
    /// The log no longer holds the events after `after` up to `oldest`
    /// (pruned past `[api] retention`): the client resumed too late.
    Gap {
        /// Where the client was.
        after: i64,
        /// The oldest event the log holds.
        oldest: i64,
    },
    /// Nothing for a while: a keep-alive is due.
    Idle,
    /// The server is draining: the last delivery.
    Shutdown,
}

impl Delivery {
    /// The `system.gap` event's body.
    pub fn gap_body(after: i64, oldest: i64) -> serde_json::Value {
        json!({"type": "system.gap", "timestamp": timestamp_now(),
               "data": {"gap_start": after + 1, "gap_end": oldest - 1,
                        "estimated_missed_count": oldest - 1 - after}})
    }

    /// The `server.shutdown` event's body.
    pub fn shutdown_body() -> serde_json::Value {
        json!({"type": "server.shutdown", "timestamp": timestamp_now(),
               "data": {"reason": "the server is stopping", "grace_period_ms": 0}})
    }
}

/// Which events an SSE stream shows.
#[derive(Debug, Clone)]
pub enum StreamView {
    /// `GET /ojs/v1/events/stream`: the log as filtered.
    Log,
    /// `GET /ojs/v1/jobs/{id}/events`: one job's events, each state change
    /// also as `job.state_changed`; ends when the job finishes.
    Job {
        /// The job.
        id: String,
    },
    /// `GET /ojs/v1/queues/{name}/events`: one queue's events, each state
    /// change also as `job.state_changed`.
    Queue {
        /// The queue.
        name: String,
    },
}

/// A view's state while it streams.
enum ViewState {
    Log,
    Job {
        id: String,
        queue: String,
        job_type: String,
        state: ojs_core::JobState,
    },
    Queue {
        /// The last state seen of the queue's jobs (bounded: forgotten
        /// all at once when full, which only costs a `from` of `null`).
        states: std::collections::HashMap<String, ojs_core::JobState>,
    },
}

/// Jobs whose last state a queue's stream remembers, at most.
const STATES_KEPT: usize = 10_000;

impl ViewState {
    /// The frames of one delivery, and whether the stream ends after them.
    fn frames(&mut self, delivery: Delivery) -> (Vec<Bytes>, bool) {
        match delivery {
            Delivery::Idle => (vec![Bytes::from_static(b":heartbeat\n\n")], false),
            Delivery::Shutdown => (
                vec![frame(None, "server.shutdown", &Delivery::shutdown_body())],
                true,
            ),
            Delivery::Gap { after, oldest } => (
                vec![frame(
                    None,
                    "system.gap",
                    &Delivery::gap_body(after, oldest),
                )],
                false,
            ),
            Delivery::Event(e) => {
                let id = e.body["id"].as_str().unwrap_or_default().to_owned();
                let kind = e.body["type"].as_str().unwrap_or("event").to_owned();
                let mut out = vec![frame(Some(&id), &kind, &e.body)];
                // Every event that moves a job names the state it left the
                // job in (the model writes it); a second event of one move
                // (`job.failed`, then `job.retrying`) changes nothing.
                let Some(to) = e.body["data"]["state"]
                    .as_str()
                    .and_then(ojs_core::JobState::parse)
                else {
                    return (out, false);
                };
                let field = |k: &str| e.body[k].as_str().unwrap_or_default().to_owned();
                let job_id = field("job_id");
                let from = match self {
                    ViewState::Log => return (out, false),
                    ViewState::Job { state, .. } => Some(std::mem::replace(state, to)),
                    ViewState::Queue { states } => {
                        if states.len() >= STATES_KEPT && !states.contains_key(&job_id) {
                            states.clear();
                        }
                        states.insert(job_id.clone(), to)
                    }
                };
                if from == Some(to) {
                    return (out, false);
                }
                let data = state_changed(
                    &job_id,
                    &field("queue"),
                    &field("job_type"),
                    from.and_then(ojs_core::JobState::as_str),
                    to.as_str().unwrap_or("unknown"),
                    &field("time"),
                );
                out.push(frame(Some(&id), "job.state_changed", &data));
                let end = matches!(self, ViewState::Job { .. }) && crate::model::is_final(to);
                (out, end)
            }
        }
    }
}

fn state_changed(
    job_id: &str,
    queue: &str,
    job_type: &str,
    from: Option<&str>,
    to: &str,
    timestamp: &str,
) -> serde_json::Value {
    json!({"type": "job.state_changed", "job_id": job_id, "queue": queue, "job_type": job_type,
           "timestamp": timestamp,
           "data": {"job_id": job_id, "queue": queue, "type": job_type, "from": from, "to": to,
                    "timestamp": timestamp}})
}

fn timestamp_now() -> String {
    crate::job::timestamp(chrono::Utc::now())
}

/// The follower itself: pages of the log after the cursor.
fn follow_log(
    slot: Slot,
    api: Arc<Api>,
    mut filter: EventFilter,
    start: i64,
    gap: Option<(i64, i64)>,
) -> impl tokio_stream::Stream<Item = Delivery> + Send + 'static {
    struct State {
        _slot: Slot,
        api: Arc<Api>,
        filter: EventFilter,
        pending: std::collections::VecDeque<Delivery>,
        quiet_since: Instant,
        /// When it last woke to look (the tail read after that serves it).
        woken: Instant,
        /// Whether a write woke it.
        by_write: bool,
        done: bool,
    }
    filter.after = start;
    let mut pending = std::collections::VecDeque::new();
    if let Some((after, oldest)) = gap {
        pending.push_back(Delivery::Gap { after, oldest });
    }
    let state = State {
        _slot: slot,
        api,
        filter,
        pending,
        quiet_since: Instant::now(),
        woken: Instant::now(),
        by_write: true,
        done: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(next) = s.pending.pop_front() {
                return Some((next, s));
            }
            if s.done {
                return None;
            }
            if s.api.is_draining() {
                s.done = true;
                s.pending.push_back(Delivery::Shutdown);
                continue;
            }
            // Registered before the read: a write while it runs wakes the
            // wait below.
            let api = s.api.clone();
            let written = api.store.written();
            let woken = s.woken;
            if let Err(e) = api.streams.refresh(&api, woken, s.by_write).await {
                tracing::debug!(error = %e, "reading the event log's tail failed; tried again");
            }
            let shared = api.streams.tail.read().await.page(&s.filter);
            let page = match shared {
                Some((events, cursor)) => Ok(crate::store::EventPage {
                    has_more: events.len() == PAGE,
                    events,
                    cursor,
                }),
                // Behind the tail: from the store.
                None => s.api.store.events(s.filter.clone()).await,
            };
            match page {
                Ok(page) => {
                    s.filter.after = page.cursor.max(s.filter.after);
                    s.pending
                        .extend(page.events.into_iter().map(Delivery::Event));
                    if !s.pending.is_empty() || page.has_more {
                        s.quiet_since = Instant::now();
                        continue;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reading the event log for a stream failed; tried again");
                }
            }
            if s.quiet_since.elapsed() >= HEARTBEAT {
                s.quiet_since = Instant::now();
                return Some((Delivery::Idle, s));
            }
            s.by_write = tokio::select! {
                () = written => true,
                () = tokio::time::sleep(LOOK) => false,
            };
            s.woken = Instant::now();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Event;

    fn tail(seqs: std::ops::RangeInclusive<i64>, read_to: i64) -> Tail {
        Tail {
            events: seqs
                .map(|seq| Event {
                    seq,
                    body: json!({"type": if seq % 2 == 0 { "job.completed" } else { "job.started" },
                                 "queue": "q", "job_type": "t"}),
                })
                .collect(),
            read_to: Some(read_to),
            read_at: None,
        }
    }

    fn after(n: i64) -> EventFilter {
        EventFilter {
            after: n,
            ..EventFilter::default()
        }
    }

    #[test]
    fn a_subscriber_takes_from_the_tail_what_it_reaches_and_reads_the_store_for_the_rest() {
        let t = tail(5..=14, 20);
        let (events, cursor) = t.page(&after(4)).unwrap();
        assert_eq!(
            (events.len(), cursor),
            (10, 20),
            "all of it, up to what was read"
        );
        assert!(t.page(&after(2)).is_none(), "3 and 4 are not in the tail");
        let (events, cursor) = t.page(&after(20)).unwrap();
        assert_eq!((events.len(), cursor), (0, 20), "caught up");
        let mut only = after(4);
        only.types = vec!["job.completed".into()];
        let (events, _) = t.page(&only).unwrap();
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [6, 8, 10, 12, 14]
        );
        assert!(Tail::default().page(&after(0)).is_none(), "not read yet");
    }

    #[test]
    fn a_page_holds_at_most_its_size_and_its_cursor_is_the_last_event_taken() {
        let t = tail(1..=250, 250);
        let (events, cursor) = t.page(&after(0)).unwrap();
        assert_eq!((events.len(), cursor), (PAGE, 100));
        let (events, cursor) = t.page(&after(cursor)).unwrap();
        assert_eq!((events.first().map(|e| e.seq), cursor), (Some(101), 200));
    }

    #[test]
    fn last_event_ids_read_as_positions() {
        assert_eq!(cursor_of("evt_0000000000001843"), Some(1843));
        assert_eq!(cursor_of(" 17 "), Some(17));
        assert_eq!(cursor_of("evt_x"), None);
    }
}
