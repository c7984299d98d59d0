//! Failures an operator must see, without a log line per message: one
//! warning when a sink or source starts failing (with the adapter, queue,
//! reason and when it is retried), a reminder at most once a minute while
//! it keeps failing, and one info line when it recovers.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest silence about a component that is still failing.
const REMIND_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct State {
    failing_since: Option<Instant>,
    last_logged: Option<Instant>,
    failures: u64,
    /// The queue and reason of the latest failure, for health.
    last: Option<(String, String)>,
}

/// The failing/recovered state of one sink or source.
#[derive(Debug)]
pub struct Alarm {
    /// `sink` or `source`.
    role: &'static str,
    /// The route or source it belongs to.
    name: String,
    /// The adapter name.
    adapter: String,
    state: Mutex<State>,
}

impl Alarm {
    /// An alarm for `role` (`sink`, `source`) `name` on `adapter`.
    pub fn new(role: &'static str, name: &str, adapter: &str) -> Self {
        Alarm {
            role,
            name: name.to_owned(),
            adapter: adapter.to_owned(),
            state: Mutex::new(State::default()),
        }
    }

    /// Records a failure; logs when it starts failing and then at most once
    /// a minute. `reason` must not hold payloads or metadata (an error's
    /// text is enough).
    pub fn failing(&self, queue: &str, reason: &str, retry_in: Duration) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.failures += 1;
        s.last = Some((queue.to_owned(), reason.to_owned()));
        let now = Instant::now();
        let since = *s.failing_since.get_or_insert(now);
        let due = s
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= REMIND_EVERY);
        if !due {
            return;
        }
        s.last_logged = Some(now);
        let failures = s.failures;
        drop(s);
        if failures == 1 {
            tracing::warn!(
                role = self.role,
                name = %self.name,
                adapter = %self.adapter,
                queue,
                reason,
                retry_in_ms = retry_in.as_millis() as u64,
                "started failing; retrying with backoff (nothing is dead-lettered for it)"
            );
        } else {
            tracing::warn!(
                role = self.role,
                name = %self.name,
                adapter = %self.adapter,
                queue,
                reason,
                failures,
                failing_for_s = since.elapsed().as_secs(),
                retry_in_ms = retry_in.as_millis() as u64,
                "still failing"
            );
        }
    }

    /// Records a success; logs once when a failing component recovers.
    pub fn ok(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(since) = s.failing_since.take() {
            let failures = std::mem::take(&mut s.failures);
            s.last_logged = None;
            s.last = None;
            drop(s);
            tracing::info!(
                role = self.role,
                name = %self.name,
                adapter = %self.adapter,
                failures,
                failed_for_ms = since.elapsed().as_millis() as u64,
                "recovered"
            );
        }
    }

    /// Whether it is failing now.
    pub fn is_failing(&self) -> bool {
        self.failing_for().is_some()
    }

    /// How long it has been failing, if it is.
    pub fn failing_for(&self) -> Option<Duration> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failing_since
            .map(|since| since.elapsed())
    }

    /// While failing: how long, and the queue and reason of the latest
    /// failure (an error's text: never payloads, metadata or credentials).
    pub fn failure(&self) -> Option<(Duration, String, String)> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let since = s.failing_since?;
        let (queue, reason) = s.last.clone().unwrap_or_default();
        Some((since.elapsed(), queue, reason))
    }

    /// The route or source it belongs to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `sink` or `source`.
    pub fn role(&self) -> &'static str {
        self.role
    }
}
