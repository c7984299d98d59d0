//! The daemon's counters, rendered in the Prometheus text format.
//!
//! Hot counters are atomics allocated per source and per route at start;
//! the rare labelled ones (dead letters and errors by reason) sit behind a
//! mutex.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

use ojs_queue::federation::{Federation, RegionSnapshot};

pub use ojs_queue::metrics::Histogram;

/// Counters of one source.
#[derive(Debug, Default)]
pub struct SourceMetrics {
    /// Messages received.
    pub received: AtomicU64,
    /// Messages acked at the source (after the sink confirmed, or after
    /// their dead-letter copy was confirmed).
    pub acked: AtomicU64,
    /// Of `acked`, those settled by dead-lettering.
    pub dead_lettered: AtomicU64,
    /// Messages received and not yet settled.
    pub in_flight: AtomicI64,
    /// Their payload bytes.
    pub in_flight_bytes: AtomicI64,
}

/// Counters of one route.
#[derive(Debug, Default)]
pub struct RouteMetrics {
    /// Messages the sink confirmed.
    pub published: AtomicU64,
    /// Receive → sink confirmed, the latency the bridge adds.
    pub bridge_latency: Histogram,
    /// Message creation → sink confirmed.
    pub end_to_end_latency: Histogram,
}

/// Appends more metrics text (e.g. federation state) to `/metrics`.
pub type Renderer = Box<dyn Fn(&mut String) + Send + Sync>;

/// Every counter of a daemon.
#[derive(Default)]
pub struct Metrics {
    /// Per source, in configuration order.
    pub sources: Vec<(String, SourceMetrics)>,
    /// Per route, in configuration order.
    /// Per route, in configuration order; each compiled route holds its own.
    pub routes: Vec<(String, Arc<RouteMetrics>)>,
    dead_lettered: Mutex<BTreeMap<(String, String), u64>>,
    errors: Mutex<BTreeMap<(String, String), u64>>,
    /// Extra text appended to the rendering (federation state).
    pub extra: Mutex<Vec<Renderer>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("sources", &self.sources)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

fn bump(map: &Mutex<BTreeMap<(String, String), u64>>, a: &str, b: &str) {
    if let Ok(mut m) = map.lock() {
        *m.entry((a.to_owned(), b.to_owned())).or_default() += 1;
    }
}

/// Escapes a label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Counters for these sources and routes.
    pub fn new(sources: &[String], routes: &[String]) -> Self {
        Metrics {
            sources: sources
                .iter()
                .map(|s| (s.clone(), SourceMetrics::default()))
                .collect(),
            routes: routes
                .iter()
                .map(|r| (r.clone(), Arc::new(RouteMetrics::default())))
                .collect(),
            ..Metrics::default()
        }
    }

    /// One message of `source` dead-lettered for `reason`.
    pub fn dead_lettered(&self, source: &str, reason: &str) {
        bump(&self.dead_lettered, source, reason);
    }

    /// One error at `place` (a route or source name) of kind `reason`.
    pub fn error(&self, place: &str, reason: &str) {
        bump(&self.errors, place, reason);
    }

    /// Dead letters of `source` so far, all reasons.
    pub fn dead_lettered_count(&self, source: &str) -> u64 {
        self.dead_lettered
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((s, _), _)| s == source)
                    .map(|(_, n)| n)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        };
        counter(
            &mut out,
            "ojs_bridge_received_total",
            "Messages received from a source.",
        );
        for (s, m) in &self.sources {
            let _ = writeln!(
                out,
                "ojs_bridge_received_total{{source=\"{}\"}} {}",
                label(s),
                m.received.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut out,
            "ojs_bridge_acked_total",
            "Source messages acked after the sink confirmed (or after dead-lettering).",
        );
        for (s, m) in &self.sources {
            let _ = writeln!(
                out,
                "ojs_bridge_acked_total{{source=\"{}\"}} {}",
                label(s),
                m.acked.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(out, "# HELP ojs_bridge_in_flight Messages received and not yet settled.\n# TYPE ojs_bridge_in_flight gauge");
        for (s, m) in &self.sources {
            let _ = writeln!(
                out,
                "ojs_bridge_in_flight{{source=\"{}\"}} {}",
                label(s),
                m.in_flight.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(out, "# HELP ojs_bridge_in_flight_bytes Payload bytes received and not yet settled.\n# TYPE ojs_bridge_in_flight_bytes gauge");
        for (s, m) in &self.sources {
            let _ = writeln!(
                out,
                "ojs_bridge_in_flight_bytes{{source=\"{}\"}} {}",
                label(s),
                m.in_flight_bytes.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut out,
            "ojs_bridge_published_total",
            "Messages a sink confirmed.",
        );
        for (r, m) in &self.routes {
            let _ = writeln!(
                out,
                "ojs_bridge_published_total{{route=\"{}\"}} {}",
                label(r),
                m.published.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut out,
            "ojs_bridge_dead_lettered_total",
            "Messages dead-lettered, by source and reason.",
        );
        if let Ok(m) = self.dead_lettered.lock() {
            for ((s, reason), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "ojs_bridge_dead_lettered_total{{source=\"{}\",reason=\"{}\"}} {n}",
                    label(s),
                    label(reason)
                );
            }
        }
        counter(&mut out, "ojs_bridge_errors_total", "Errors (retried publishes, failed settles, consume errors) by route or source and reason.");
        if let Ok(m) = self.errors.lock() {
            for ((place, reason), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "ojs_bridge_errors_total{{at=\"{}\",reason=\"{}\"}} {n}",
                    label(place),
                    label(reason)
                );
            }
        }
        for (name, help, pick) in [
            (
                "ojs_bridge_latency_seconds",
                "Time from receive to sink confirmation: the latency the bridge adds.",
                0,
            ),
            (
                "ojs_bridge_end_to_end_latency_seconds",
                "Time from message creation to sink confirmation.",
                1,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (r, m) in &self.routes {
                let h = if pick == 0 {
                    &m.bridge_latency
                } else {
                    &m.end_to_end_latency
                };
                h.render(&mut out, name, &format!("route=\"{}\"", label(r)));
            }
        }
        if let Ok(extra) = self.extra.lock() {
            for f in extra.iter() {
                f(&mut out);
            }
        }
        out
    }
}

/// A federation's state as Prometheus text under `name`: each region's
/// breaker (0 closed, 1 half-open, 2 open), probe latency, messages routed
/// and failures, and the federation's failovers.
/// The OJS API's gauges: whether its job store answers and writes, the
/// request bodies it holds, and the queue consumers it keeps for FETCH.
pub fn render_api(api: &ojs_api::Api, out: &mut String) {
    let store_up = api.store_health().is_up();
    let _ = writeln!(
        out,
        "# HELP ojs_bridge_api_store_up Whether the OJS API's job store answers and writes (1) or not (0).\n# TYPE ojs_bridge_api_store_up gauge\nojs_bridge_api_store_up {}",
        u8::from(store_up)
    );
    let _ = writeln!(
        out,
        "# HELP ojs_bridge_api_body_bytes_in_flight Request bytes the OJS API holds now ([api] max_body_bytes_in_flight).\n# TYPE ojs_bridge_api_body_bytes_in_flight gauge\nojs_bridge_api_body_bytes_in_flight {}",
        api.body_budget().used()
    );
    let _ = writeln!(
        out,
        "# HELP ojs_bridge_api_consumers Queue consumers the OJS API keeps for FETCH ([api] max_consumers).\n# TYPE ojs_bridge_api_consumers gauge\nojs_bridge_api_consumers {}",
        api.consumers()
    );
    let _ = writeln!(
        out,
        "# HELP ojs_bridge_api_held_bytes Bytes of messages of the active jobs the OJS API holds deliveries of ([api] max_held_bytes).\n# TYPE ojs_bridge_api_held_bytes gauge\nojs_bridge_api_held_bytes {}",
        api.held_bytes()
    );
    api.metrics().render(out, &api.active_by_queue());
}

pub fn render_federation(name: &str, federation: &Federation, out: &mut String) {
    let n = label(name);
    let regions = federation.snapshot();
    let mut per_region =
        |metric: &str,
         help: &str,
         kind: &str,
         value: &dyn Fn(&RegionSnapshot) -> Option<String>| {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} {kind}");
            for r in &regions {
                if let Some(v) = value(r) {
                    let region = label(&r.name);
                    let _ = writeln!(
                        out,
                        "{metric}{{federation=\"{n}\",region=\"{region}\"}} {v}"
                    );
                }
            }
        };
    per_region(
        "ojs_bridge_federation_breaker_state",
        "Circuit breaker per region: 0 closed, 1 half-open, 2 open.",
        "gauge",
        &|r| Some(r.breaker.as_gauge().to_string()),
    );
    per_region(
        "ojs_bridge_federation_latency_seconds",
        "Moving average of health probe round trips.",
        "gauge",
        &|r| r.latency.map(|l| l.as_secs_f64().to_string()),
    );
    per_region(
        "ojs_bridge_federation_routed_total",
        "Messages published per region.",
        "counter",
        &|r| Some(r.routed.to_string()),
    );
    per_region(
        "ojs_bridge_federation_failures_total",
        "Failed publishes and probes per region.",
        "counter",
        &|r| Some(r.failures.to_string()),
    );
    let _ = writeln!(out, "# HELP ojs_bridge_federation_failovers_total Jobs moved to another region after theirs failed.\n# TYPE ojs_bridge_federation_failovers_total counter\nojs_bridge_federation_failovers_total{{federation=\"{n}\"}} {}", federation.failovers());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_batch_observed_at_once_counts_as_each_observed_alone() {
        let durations = [0, 1, 2, 2, 40, 700, 3_000, 99_000].map(Duration::from_millis);
        let (alone, batch) = (Histogram::default(), Histogram::default());
        for d in durations {
            alone.observe(d);
        }
        batch.observe_all(durations);
        batch.observe_all([]);
        batch.observe_n(Duration::from_secs(1), 0);
        let (repeated, one_by_one) = (Histogram::default(), Histogram::default());
        repeated.observe_n(Duration::from_millis(7), 3);
        for _ in 0..3 {
            one_by_one.observe(Duration::from_millis(7));
        }
        let render = |h: &Histogram| {
            let mut out = String::new();
            h.render(&mut out, "h", "route=\"r\"");
            out
        };
        assert_eq!(render(&batch), render(&alone));
        assert_eq!(render(&repeated), render(&one_by_one));
        assert_eq!(repeated.count(), 3);
        assert!(
            render(&repeated).contains("h_sum{route=\"r\"} 0.021"),
            "{}",
            render(&repeated)
        );
        assert_eq!(batch.count(), 8);
        assert_eq!(batch.quantile_upper_bound(0.5), Some(0.0025));
        assert_eq!(
            batch.quantile_upper_bound(1.0),
            None,
            "99 s is beyond the last bucket"
        );
    }

    #[test]
    fn renders_counters_and_cumulative_histograms() {
        let m = Metrics::new(&["calls".into()], &["r\"1".into()]);
        m.sources[0].1.received.fetch_add(3, Ordering::Relaxed);
        m.routes[0]
            .1
            .bridge_latency
            .observe(Duration::from_millis(2));
        m.routes[0]
            .1
            .bridge_latency
            .observe(Duration::from_secs(60));
        m.dead_lettered("calls", "undecodable");
        m.dead_lettered("calls", "undecodable");
        let text = m.render();
        assert!(
            text.contains("ojs_bridge_received_total{source=\"calls\"} 3"),
            "{text}"
        );
        assert!(text
            .contains("ojs_bridge_dead_lettered_total{source=\"calls\",reason=\"undecodable\"} 2"));
        assert!(
            text.contains("ojs_bridge_latency_seconds_bucket{route=\"r\\\"1\",le=\"0.0025\"} 1")
        );
        assert!(text.contains("ojs_bridge_latency_seconds_bucket{route=\"r\\\"1\",le=\"10\"} 1"));
        assert!(text.contains("ojs_bridge_latency_seconds_bucket{route=\"r\\\"1\",le=\"+Inf\"} 2"));
        assert!(text.contains("ojs_bridge_latency_seconds_count{route=\"r\\\"1\"} 2"));
        assert_eq!(m.dead_lettered_count("calls"), 2);
        let h = &m.routes[0].1.bridge_latency;
        assert_eq!(h.quantile_upper_bound(0.5), Some(0.0025));
        assert_eq!(
            h.quantile_upper_bound(0.99),
            None,
            "60 s is beyond the last bucket"
        );
    }

    #[tokio::test]
    async fn a_federation_is_rendered_per_region_under_its_name() {
        use ojs_queue::federation::{AdapterProbe, FederationSettings, RegionSpec};
        use ojs_queue::QueueAdapter as _;
        let region = |name: &str| {
            let adapter: Arc<dyn ojs_queue::QueueAdapter> = Arc::new(
                ojs_adapter_memory::MemoryAdapter::new(ojs_adapter_memory::MemoryConfig::default()),
            );
            RegionSpec {
                name: name.into(),
                adapter: adapter.clone(),
                probe: Arc::new(AdapterProbe(adapter)),
            }
        };
        let federation = Federation::new(
            FederationSettings::new("eu"),
            vec![region("eu"), region("us")],
        )
        .unwrap();
        federation
            .publish(
                "q",
                vec![ojs_queue::OutgoingMessage::new(
                    b"x".to_vec(),
                    "application/octet-stream",
                )],
            )
            .await
            .unwrap();
        let mut text = String::new();
        render_federation("glo\"bal", &federation, &mut text);
        for line in [
            "ojs_bridge_federation_breaker_state{federation=\"glo\\\"bal\",region=\"eu\"} 0",
            "ojs_bridge_federation_breaker_state{federation=\"glo\\\"bal\",region=\"us\"} 0",
            "ojs_bridge_federation_routed_total{federation=\"glo\\\"bal\",region=\"eu\"} 1",
            "ojs_bridge_federation_routed_total{federation=\"glo\\\"bal\",region=\"us\"} 0",
            "ojs_bridge_federation_failures_total{federation=\"glo\\\"bal\",region=\"eu\"} 0",
            "ojs_bridge_federation_failovers_total{federation=\"glo\\\"bal\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
        }
    }
}
