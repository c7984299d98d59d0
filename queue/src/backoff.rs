//! Backoff and jitter shared by reconnect loops and retry policies.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// A uniformly distributed number in [0, 1). Jitter needs spread, not
/// cryptographic quality: std's per-instance random hash keys are enough.
pub fn random_unit() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Reconnect delay of docs/design.md §4: min(2^(attempt−1), max) seconds, ±25 %
/// jitter. `attempt` starts at 1.
pub fn reconnect_delay(attempt: u32, max: Duration) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    let base = Duration::from_secs(1u64 << exp).min(max);
    base.mul_f64(0.75 + 0.5 * random_unit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delays_grow_to_the_cap_with_bounded_jitter() {
        let max = Duration::from_secs(60);
        for (attempt, base) in [(1, 1.0), (2, 2.0), (3, 4.0), (7, 60.0), (40, 60.0)] {
            for _ in 0..50 {
                let d = reconnect_delay(attempt, max).as_secs_f64();
                assert!(
                    d >= base * 0.75 && d <= base * 1.25,
                    "attempt {attempt}: {d}"
                );
            }
        }
        let spread: std::collections::HashSet<u64> =
            (0..20).map(|_| (random_unit() * 1e9) as u64).collect();
        assert!(spread.len() > 15, "jitter varies");
    }
}
