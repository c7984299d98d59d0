//! librdkafka's log and error callbacks for every client of one adapter,
//! gated: librdkafka reports an unreachable cluster several times a second
//! per client (`AllBrokersDown`, a failed connect per broker), which would
//! be millions of lines a day. Each kind of report is logged when it starts,
//! then once more per [`REMIND_EVERY`] with how many were held back; the
//! latest broker error is kept for health and for the adapter's errors.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::ClientContext;
use tokio::time::Instant;

/// How often a report that keeps coming is logged again.
pub(crate) const REMIND_EVERY: Duration = Duration::from_secs(60);

/// How long the latest broker error says why the cluster is not answering.
const RECENT: Duration = Duration::from_secs(30);

/// The shared gate and the latest broker error of one adapter's clients.
#[derive(Debug, Default)]
pub(crate) struct ClientLog {
    state: Mutex<GateState>,
}

#[derive(Debug, Default)]
struct GateState {
    seen: HashMap<String, Seen>,
    latest_error: Option<(Instant, String)>,
}

#[derive(Debug)]
struct Seen {
    logged_at: Instant,
    last_at: Instant,
    held_back: u64,
}

/// Whether to log a report now, and how many like it were held back since
/// the last line.
#[derive(Debug, PartialEq, Eq)]
enum Gate {
    Log { held_back: u64 },
    Hold,
}

impl ClientLog {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Each step below is one assignment: a panic cannot leave it torn.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gate(&self, key: &str, now: Instant) -> Gate {
        let mut state = self.lock();
        match state.seen.get_mut(key) {
            // New, or back after a quiet spell: a change of state.
            Some(seen) if now.duration_since(seen.last_at) < REMIND_EVERY => {
                seen.last_at = now;
                if now.duration_since(seen.logged_at) >= REMIND_EVERY {
                    let held_back = std::mem::take(&mut seen.held_back);
                    seen.logged_at = now;
                    Gate::Log { held_back }
                } else {
                    seen.held_back += 1;
                    Gate::Hold
                }
            }
            _ => {
                state.seen.insert(
                    key.to_owned(),
                    Seen {
                        logged_at: now,
                        last_at: now,
                        held_back: 0,
                    },
                );
                Gate::Log { held_back: 0 }
            }
        }
    }

    /// librdkafka's error callback (the client as a whole: all brokers
    /// down, a transport failure, authentication).
    pub(crate) fn error(&self, error: &KafkaError, reason: &str) {
        let now = Instant::now();
        // "All brokers are down" sums up the failures logged before it,
        // which say why: keep theirs.
        if error.rdkafka_error_code() != Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown) {
            self.lock().latest_error = Some((now, reason.to_owned()));
        }
        let key = format!("error:{:?}", error.rdkafka_error_code());
        if let Gate::Log { held_back } = self.gate(&key, now) {
            tracing::warn!(
                target: "librdkafka",
                error = %error,
                held_back,
                "librdkafka: {reason}"
            );
        }
    }

    /// librdkafka's log callback, by facility and level.
    pub(crate) fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        let now = Instant::now();
        let serious = (level as i32) <= (RDKafkaLogLevel::Warning as i32);
        if serious {
            self.lock().latest_error = Some((now, message.to_owned()));
        }
        let key = format!("log:{}:{facility}", level as i32);
        let Gate::Log { held_back } = self.gate(&key, now) else {
            return;
        };
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", facility, held_back, "librdkafka: {message}");
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", facility, held_back, "librdkafka: {message}");
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", facility, held_back, "librdkafka: {message}");
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", facility, held_back, "librdkafka: {message}");
            }
        }
    }

    /// The latest broker error of the last half minute, in librdkafka's
    /// words (broker addresses, never credentials: librdkafka does not put
    /// them in its messages).
    pub(crate) fn recent_error(&self) -> Option<String> {
        let state = self.lock();
        state
            .latest_error
            .as_ref()
            .filter(|(at, _)| at.elapsed() < RECENT)
            .map(|(_, e)| e.clone())
    }
}

/// A client context that only logs through the adapter's [`ClientLog`]
/// (the admin client, the short-lived clients that read lag).
#[derive(Debug, Clone, Default)]
pub(crate) struct LogContext(pub(crate) Arc<ClientLog>);

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.0.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.0.error(&error, reason);
    }
}

impl rdkafka::consumer::ConsumerContext for LogContext {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_that_keeps_coming_is_logged_once_then_once_a_minute() {
        let log = ClientLog::default();
        let start = Instant::now();
        let mut logged = Vec::new();
        // Five reports a second for three minutes.
        for i in 0..900u64 {
            let now = start + Duration::from_millis(200 * i);
            if let Gate::Log { held_back } = log.gate("error:AllBrokersDown", now) {
                logged.push((now.duration_since(start).as_secs(), held_back));
            }
        }
        assert_eq!(logged, vec![(0, 0), (60, 299), (120, 299)]);
        // Another kind is its own report.
        assert_eq!(
            log.gate("log:3:FAIL", start + Duration::from_secs(1)),
            Gate::Log { held_back: 0 }
        );
        // Quiet for longer than the reminder: the next one is a new episode.
        let later = start + Duration::from_secs(180 + 61);
        assert_eq!(
            log.gate("error:AllBrokersDown", later),
            Gate::Log { held_back: 0 }
        );
    }
}
