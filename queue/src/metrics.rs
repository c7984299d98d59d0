//! A latency histogram in the Prometheus text format, shared by the
//! daemon's and the OJS API's metrics.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The bucket a duration falls in; `None` beyond the last.
fn bucket_of(d: Duration) -> Option<usize> {
    let secs = d.as_secs_f64();
    BUCKETS.iter().position(|b| secs <= *b)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A cumulative histogram of durations.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        self.observe_n(d, 1);
    }

    /// Records `n` observations of one duration (a batch's bridge latency):
    /// its bucket found once, not once per message.
    pub fn observe_n(&self, d: Duration, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(i) = bucket_of(d) {
            self.buckets[i].fetch_add(n, Ordering::Relaxed);
        }
        self.count.fetch_add(n, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(micros(d).saturating_mul(n), Ordering::Relaxed);
    }

    /// Records a batch's observations, counted here first: the histogram
    /// is shared by every batch of a route on every runtime thread, and an
    /// atomic add per message per field made its cache lines travel
    /// between the cores once per message.
    pub fn observe_all(&self, durations: impl IntoIterator<Item = Duration>) {
        let mut buckets = [0u64; BUCKETS.len()];
        let (mut count, mut sum_micros) = (0u64, 0u64);
        for d in durations {
            if let Some(i) = bucket_of(d) {
                buckets[i] += 1;
            }
            count += 1;
            sum_micros = sum_micros.saturating_add(micros(d));
        }
        if count == 0 {
            return;
        }
        for (shared, n) in self.buckets.iter().zip(buckets) {
            if n > 0 {
                shared.fetch_add(n, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(count, Ordering::Relaxed);
        self.sum_micros.fetch_add(sum_micros, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The upper bound (seconds) of the bucket holding quantile `q` (0..=1);
    /// `None` without observations or beyond the last bucket.
    pub fn quantile_upper_bound(&self, q: f64) -> Option<f64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * count as f64).ceil().max(1.0) as u64;
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            if cumulative >= rank {
                return Some(*bound);
            }
        }
        None
    }

    /// Writes the histogram's samples (`_bucket`, `_sum`, `_count`) in
    /// the Prometheus text format, with `labels` (`route="r"`) on each.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}
