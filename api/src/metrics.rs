//! The OJS API's figures for `/metrics`: requests by binding, route and
//! status with their latency, what happened to jobs per queue, and how
//! long the job store takes.
//!
//! Labels come from a fixed set (routes, store operations) or from queue
//! names, which a client chooses: at most [`MAX_QUEUE_LABELS`] queues get a
//! series of their own, the rest are counted under `queue="_other"`, so a
//! client cannot grow the metrics without bound.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ojs_queue::metrics::Histogram;

/// Queues with series of their own.
pub const MAX_QUEUE_LABELS: usize = 1000;
/// The queue label of every queue beyond [`MAX_QUEUE_LABELS`].
const OTHER_QUEUE: &str = "_other";

/// Which binding a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Binding {
    /// The HTTP binding.
    Http,
    /// The gRPC binding.
    Grpc,
}

impl Binding {
    fn as_str(self) -> &'static str {
        match self {
            Binding::Http => "http",
            Binding::Grpc => "grpc",
        }
    }
}

/// The routes requests are counted by (an operation, not a path: a job id
/// is never a label).
pub const ROUTES: [&str; 19] = [
    "push",
    "batch",
    "info",
    "cancel",
    "activate",
    "fetch",
    "ack",
    "nack",
    "heartbeat",
    "dead_letters",
    "workers",
    "queues",
    "events",
    "cron",
    "manifest",
    "health",
    "unsupported",
    "unknown",
    "other",
];

/// What happened to a job, counted per queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEvent {
    /// Pushed (the broker confirmed it).
    Pushed,
    /// Handed to a worker by FETCH.
    Fetched,
    /// Completed by ACK.
    Acked,
    /// Failed by NACK.
    Nacked,
    /// Failed and scheduled again.
    Retried,
    /// Exhausted and kept as a dead letter.
    DeadLettered,
    /// Exhausted (or not retryable) and discarded.
    Discarded,
}

const JOB_EVENTS: [(JobEvent, &str, &str); 7] = [
    (
        JobEvent::Pushed,
        "ojs_bridge_api_jobs_pushed_total",
        "Jobs pushed through the OJS API (the broker confirmed them), per queue.",
    ),
    (
        JobEvent::Fetched,
        "ojs_bridge_api_jobs_fetched_total",
        "Jobs handed to workers by FETCH, per queue.",
    ),
    (
        JobEvent::Acked,
        "ojs_bridge_api_jobs_acked_total",
        "Jobs completed by ACK, per queue.",
    ),
    (
        JobEvent::Nacked,
        "ojs_bridge_api_jobs_nacked_total",
        "Jobs failed by NACK, per queue.",
    ),
    (
        JobEvent::Retried,
        "ojs_bridge_api_jobs_retried_total",
        "Failed jobs scheduled for another attempt, per queue.",
    ),
    (
        JobEvent::DeadLettered,
        "ojs_bridge_api_jobs_dead_lettered_total",
        "Jobs kept as dead letters, per queue.",
    ),
    (
        JobEvent::Discarded,
        "ojs_bridge_api_jobs_discarded_total",
        "Jobs discarded after their last attempt (or a non-retryable error), per queue.",
    ),
];

/// The store operations timed.
pub const STORE_OPS: [&str; 7] = [
    "insert",
    "transition",
    "get",
    "events",
    "scheduled",
    "maintenance",
    "other",
];

/// The OJS API's counters.
#[derive(Debug)]
pub struct ApiMetrics {
    requests: Mutex<HashMap<(Binding, usize, u16), u64>>,
    latency: [Histogram; ROUTES.len() * 2],
    jobs: Mutex<BTreeMap<String, [u64; JOB_EVENTS.len()]>>,
    store: [Histogram; STORE_OPS.len()],
    store_errors: [AtomicU64; STORE_OPS.len()],
    /// Broker copies of dead letters removed after a retry or delete
    /// through the server, and sweeps that failed.
    copies_removed: AtomicU64,
    sweeps_failed: AtomicU64,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        ApiMetrics {
            requests: Mutex::default(),
            latency: std::array::from_fn(|_| Histogram::default()),
            jobs: Mutex::default(),
            store: std::array::from_fn(|_| Histogram::default()),
            store_errors: std::array::from_fn(|_| AtomicU64::new(0)),
            copies_removed: AtomicU64::new(0),
            sweeps_failed: AtomicU64::new(0),
        }
    }
}

/// The index of a route name in [`ROUTES`] (`other` when unknown).
pub fn route_index(route: &str) -> usize {
    ROUTES
        .iter()
        .position(|r| *r == route)
        .unwrap_or(ROUTES.len() - 1)
}

impl ApiMetrics {
    /// One request answered.
    pub fn request(&self, binding: Binding, route: &str, status: u16, took: Duration) {
        let route = route_index(route);
        let slot = match binding {
            Binding::Http => route,
            Binding::Grpc => ROUTES.len() + route,
        };
        self.latency[slot].observe(took);
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((binding, route, status))
            .or_default() += 1;
    }

    /// `n` jobs of `queue` had `event`.
    pub fn jobs(&self, queue: &str, event: JobEvent, n: u64) {
        if n == 0 {
            return;
        }
        let Some(i) = JOB_EVENTS.iter().position(|(e, _, _)| *e == event) else {
            return;
        };
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let key = if jobs.contains_key(queue) || jobs.len() < MAX_QUEUE_LABELS {
            queue
        } else {
            OTHER_QUEUE
        };
        match jobs.get_mut(key) {
            Some(counts) => counts[i] += n,
            None => {
                let mut counts = [0; JOB_EVENTS.len()];
                counts[i] = n;
                jobs.insert(key.to_owned(), counts);
            }
        }
    }

    /// One store operation (`op` from [`STORE_OPS`]) took `took`.
    pub fn store_op(&self, op: &str, took: Duration, failed: bool) {
        let i = STORE_OPS
            .iter()
            .position(|o| *o == op)
            .unwrap_or(STORE_OPS.len() - 1);
        self.store[i].observe(took);
        if failed {
            self.store_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A sweep of a queue's dead letters on the broker ended: `removed`
    /// copies removed, or it failed.
    pub fn sweep(&self, removed: Option<usize>) {
        match removed {
            Some(n) => {
                self.copies_removed.fetch_add(n as u64, Ordering::Relaxed);
            }
            None => {
                self.sweeps_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Writes the figures in the Prometheus text format; `active` is the
    /// jobs held by workers now, per queue.
    pub fn render(&self, out: &mut String, active: &BTreeMap<String, u64>) {
        let requests: Vec<((Binding, usize, u16), u64)> = {
            let map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
            v.sort_unstable();
            v
        };
        let _ = writeln!(out, "# HELP ojs_bridge_api_requests_total OJS API requests answered, by binding, route and status (HTTP status; gRPC: the HTTP status of the same error).\n# TYPE ojs_bridge_api_requests_total counter");
        for ((binding, route, status), n) in requests {
            let _ = writeln!(
                out,
                "ojs_bridge_api_requests_total{{binding=\"{}\",route=\"{}\",status=\"{status}\"}} {n}",
                binding.as_str(),
                ROUTES[route]
            );
        }
        let _ = writeln!(out, "# HELP ojs_bridge_api_request_seconds OJS API request latency (body read to answer), by binding and route.\n# TYPE ojs_bridge_api_request_seconds histogram");
        for (slot, h) in self.latency.iter().enumerate() {
            if h.count() == 0 {
                continue;
            }
            let binding = if slot < ROUTES.len() { "http" } else { "grpc" };
            let route = ROUTES[slot % ROUTES.len()];
            h.render(
                out,
                "ojs_bridge_api_request_seconds",
                &format!("binding=\"{binding}\",route=\"{route}\""),
            );
        }
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (i, (_, name, help)) in JOB_EVENTS.iter().enumerate() {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (queue, counts) in &jobs {
                let _ = writeln!(out, "{name}{{queue=\"{}\"}} {}", label(queue), counts[i]);
            }
        }
        let _ = writeln!(out, "# HELP ojs_bridge_api_jobs_active Jobs workers hold now through this process, per queue.\n# TYPE ojs_bridge_api_jobs_active gauge");
        for (queue, n) in active {
            let _ = writeln!(
                out,
                "ojs_bridge_api_jobs_active{{queue=\"{}\"}} {n}",
                label(queue)
            );
        }
        let _ = writeln!(out, "# HELP ojs_bridge_api_store_seconds Job store latency, by operation.\n# TYPE ojs_bridge_api_store_seconds histogram");
        for (op, h) in STORE_OPS.iter().zip(&self.store) {
            if h.count() > 0 {
                h.render(out, "ojs_bridge_api_store_seconds", &format!("op=\"{op}\""));
            }
        }
        let _ = writeln!(
            out,
            "# HELP ojs_bridge_api_dead_letter_copies_removed_total Broker copies of dead letters removed after a retry or delete through the server.\n# TYPE ojs_bridge_api_dead_letter_copies_removed_total counter\nojs_bridge_api_dead_letter_copies_removed_total {}",
            self.copies_removed.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP ojs_bridge_api_dead_letter_sweeps_failed_total Sweeps of a queue's dead letters on the broker that failed (their copies stay).\n# TYPE ojs_bridge_api_dead_letter_sweeps_failed_total counter\nojs_bridge_api_dead_letter_sweeps_failed_total {}",
            self.sweeps_failed.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# HELP ojs_bridge_api_store_errors_total Job store operations that failed, by operation.\n# TYPE ojs_bridge_api_store_errors_total counter");
        for (op, n) in STORE_OPS.iter().zip(&self.store_errors) {
            let _ = writeln!(
                out,
                "ojs_bridge_api_store_errors_total{{op=\"{op}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

/// A label value in the text format: `\`, `"` and newlines escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The route a path of the HTTP binding belongs to.
pub fn http_route(method: &str, path: &str) -> &'static str {
    if path == "/ojs/manifest" {
        return "manifest";
    }
    let Some(rest) = path.strip_prefix("/ojs/v1/") else {
        return "unknown";
    };
    let segments: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    match segments.as_slice() {
        ["health"] => "health",
        ["jobs"] => "push",
        ["jobs", "batch"] => "batch",
        ["jobs", _] if method == "DELETE" => "cancel",
        ["jobs", _] => "info",
        ["jobs", _, "activate"] => "activate",
        ["workers", "fetch"] => "fetch",
        ["workers", "ack"] => "ack",
        ["workers", "nack"] => "nack",
        ["workers", "heartbeat"] => "heartbeat",
        ["workers", ..] | ["admin", "workers", ..] => "workers",
        ["dead-letter", ..] | ["admin", "dead-letter", ..] => "dead_letters",
        ["queues", ..] => "queues",
        ["events", ..] => "events",
        ["cron" | "crons", ..] => "cron",
        ["workflows", ..] => "workflows",
        ["rate-limits", ..] => "rate_limits",
        ["unique-jobs"] => "unique_jobs",
        ["admin", "stats" | "queues" | "jobs" | "system" | "reset", ..] => "admin",
        ["admin", ..] => "unsupported",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_cannot_grow_the_queue_labels_without_bound() {
        let m = ApiMetrics::default();
        for i in 0..(MAX_QUEUE_LABELS + 50) {
            m.jobs(&format!("q{i}"), JobEvent::Pushed, 1);
        }
        let jobs = m.jobs.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(jobs.len(), MAX_QUEUE_LABELS + 1);
        assert_eq!(jobs[OTHER_QUEUE][0], 50);
    }

    #[test]
    fn paths_are_counted_by_operation_never_by_id() {
        assert_eq!(http_route("GET", "/ojs/v1/jobs/019a-x"), "info");
        assert_eq!(http_route("DELETE", "/ojs/v1/jobs/019a-x"), "cancel");
        assert_eq!(http_route("POST", "/ojs/v1/workers/fetch"), "fetch");
        assert_eq!(http_route("GET", "/ojs/v1/dead-letter/x"), "dead_letters");
        assert_eq!(http_route("GET", "/nowhere"), "unknown");
        assert_eq!(http_route("POST", "/ojs/v1/cron"), "cron");
        assert_eq!(http_route("DELETE", "/ojs/v1/crons/nightly"), "cron");
        assert_eq!(http_route("POST", "/ojs/v1/workflows"), "workflows");
        assert_eq!(http_route("GET", "/ojs/v1/workflows/019a-x"), "workflows");
        assert_eq!(http_route("GET", "/ojs/v1/admin/stats"), "admin");
        assert_eq!(http_route("GET", "/ojs/v1/admin/jobs/019a-x"), "admin");
        assert_eq!(
            http_route("GET", "/ojs/v1/admin/system/maintenance"),
            "admin"
        );
        assert_eq!(http_route("POST", "/ojs/v1/admin/reset"), "admin");
        assert_eq!(http_route("GET", "/ojs/v1/admin/tenants"), "unsupported");
    }
}
