//! Where the service reads the time. Every time the service decides with
//! (when a job was created, when a retry is due, what is past retention)
//! comes from one [`Clock`]: the system's in production, one a test moves
//! by hand ([`ManualClock`]) so that backoffs and schedules are tested
//! without waiting for them.
//!
//! Deadlines measured on a monotonic clock (a held delivery's visibility,
//! heartbeats) are not read from here: they are durations, not times a
//! client sees.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that stands still until it is moved.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<DateTime<Utc>>,
}

impl ManualClock {
    /// A clock showing `at`.
    pub fn new(at: DateTime<Utc>) -> Self {
        ManualClock {
            now: Mutex::new(at),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        let by = chrono::Duration::from_std(by).unwrap_or(chrono::Duration::MAX);
        *now = now.checked_add_signed(by).unwrap_or(*now);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A time at the precision jobs keep (milliseconds, as brokers do).
pub fn whole_millis(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let start = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_millis(1500));
        assert_eq!((clock.now() - start).num_milliseconds(), 1500);
        assert_eq!(
            whole_millis(DateTime::from_timestamp(5, 123_456_789).unwrap()),
            DateTime::from_timestamp(5, 123_000_000).unwrap()
        );
    }
}
