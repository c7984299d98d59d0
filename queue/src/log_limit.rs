//! A warning that one input can repeat for every message (a broker handing
//! over many records of the same odd kind) is logged at most once per
//! interval, with how many it held back, so it informs without flooding.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lets a repeated warning through at most once per `interval`.
#[derive(Debug)]
pub struct LogLimiter {
    interval: Duration,
    /// When one last went through, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimiter {
    /// A limiter letting one occurrence through per `interval`.
    pub const fn new(interval: Duration) -> Self {
        LogLimiter {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last one)` when this occurrence should be
    /// logged, `None` when it is held back (and counted).
    pub fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, held) = &mut *state;
        if last.is_some_and(|at| now.duration_since(at) < self.interval) {
            *held += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_occurrence_per_interval_goes_through_with_the_count_held_back() {
        let limiter = LogLimiter::new(Duration::from_millis(200));
        assert_eq!(limiter.allow(), Some(0));
        assert_eq!(limiter.allow(), None);
        assert_eq!(limiter.allow(), None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limiter.allow(), Some(2));
        assert_eq!(limiter.allow(), None);
    }
}
