//! The in-process broker: named brokers shared by every adapter of the
//! process, each a set of queues with visibility timeouts, delayed
//! messages, priorities and dead letters.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ojs_queue::{DeadLetterReason, Headers};
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub(crate) seq: u64,
    pub(crate) payload: Bytes,
    pub(crate) headers: Headers,
    pub(crate) key: Option<Bytes>,
    pub(crate) message_id: Option<String>,
    pub(crate) priority: i32,
    /// Deliveries so far.
    pub(crate) deliveries: u32,
}

#[derive(Debug)]
pub(crate) struct InFlight {
    pub(crate) message: Stored,
    pub(crate) deadline: Instant,
    pub(crate) consumer: u64,
    pub(crate) max_deliveries: Option<u32>,
    /// Taken from the dead letters (and given back there).
    pub(crate) dead: bool,
}

/// Hashes delivery tags, which are a counter: one multiply spreads them
/// over the table's buckets (an odd factor permutes the low bits) and its
/// per-entry tags (the top bits). SipHash, the default, cost 4–6 % of
/// memory → memory for the same job.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TagHasher(u64);

impl Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(self.0 ^ u64::from(*byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Debug, Default)]
pub(crate) struct QueueState {
    /// Ready messages: highest priority first, then publish order.
    pub(crate) ready: BTreeMap<(Reverse<i32>, u64), Stored>,
    /// Delayed retries and scheduled messages, by due time.
    pub(crate) delayed: BTreeMap<(Instant, u64), Stored>,
    /// Delivered, not yet settled, by delivery tag.
    pub(crate) in_flight: HashMap<u64, InFlight, BuildHasherDefault<TagHasher>>,
    /// No lease in `in_flight` ends before this (it may be earlier than the
    /// earliest: settles and extends leave it as it was). Every receive
    /// looks for expired leases and for when to look again; with this it
    /// walks the leases only when one may have ended, not on every receive
    /// (thousands of leases for a batch of hundreds).
    pub(crate) leases_end_after: Option<Instant>,
    /// Dead letters, in arrival order.
    pub(crate) dead: BTreeMap<u64, Stored>,
}

impl QueueState {
    pub(crate) fn make_ready(&mut self, message: Stored) {
        self.ready
            .insert((Reverse(message.priority), message.seq), message);
    }

    /// Returns a delivered message to where it came from, uncounted
    /// (`Nack::Release`).
    pub(crate) fn give_back(&mut self, flight: InFlight) {
        let mut message = flight.message;
        message.deliveries = message.deliveries.saturating_sub(1);
        if flight.dead {
            self.dead.insert(message.seq, message);
        } else {
            self.make_ready(message);
        }
    }

    /// Returns a delivered message to the queue, or to the dead letters once
    /// it has been delivered `max_deliveries` times.
    pub(crate) fn release(&mut self, flight: InFlight, now: Instant, delay: Duration) {
        let InFlight {
            mut message,
            max_deliveries,
            ..
        } = flight;
        if max_deliveries.is_some_and(|max| message.deliveries >= max) {
            DeadLetterReason::of(
                ojs_queue::DeadLetterKind::MaxDeliveries,
                format!(
                    "delivered {} times without being acknowledged",
                    message.deliveries
                ),
            )
            .write_headers(&mut message.headers);
            self.dead.insert(message.seq, message);
        } else if delay.is_zero() {
            self.make_ready(message);
        } else {
            self.delayed.insert((now + delay, message.seq), message);
        }
    }

    /// Moves due delayed messages to ready and expired leases back.
    pub(crate) fn reclaim(&mut self, now: Instant) {
        while let Some(entry) = self.delayed.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let message = entry.remove();
            self.make_ready(message);
        }
        if self.leases_end_after.is_none_or(|at| at > now) {
            return;
        }
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(tag, _)| *tag)
            .collect();
        for tag in expired {
            if let Some(flight) = self.in_flight.remove(&tag) {
                self.release(flight, now, Duration::ZERO);
            }
        }
        self.leases_end_after = self.in_flight.values().map(|f| f.deadline).min();
    }

    /// Holds a delivered message until it is settled or its lease ends.
    pub(crate) fn lease(&mut self, tag: u64, flight: InFlight) {
        let end = flight.deadline;
        self.leases_end_after = Some(self.leases_end_after.map_or(end, |at| at.min(end)));
        self.in_flight.insert(tag, flight);
    }

    /// The next instant at which something becomes ready by itself (or
    /// may: a lease settled or extended since is found then, and skipped).
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        let delayed = self.delayed.keys().next().map(|(at, _)| *at);
        let lease = self.leases_end_after;
        match (delayed, lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Queue {
    pub(crate) state: Mutex<QueueState>,
    pub(crate) notify: Notify,
}

impl Queue {
    pub(crate) fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that loses messages, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Shared state of one in-memory broker.
#[derive(Debug, Default)]
pub(crate) struct Broker {
    pub(crate) queues: Mutex<HashMap<String, Arc<Queue>>>,
    pub(crate) seq: AtomicU64,
    pub(crate) ids: AtomicU64,
}

impl Broker {
    pub(crate) fn queue(&self, name: &str) -> Arc<Queue> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.entry(name.to_owned()).or_default().clone()
    }

    pub(crate) fn remove(&self, name: &str) {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.remove(name);
    }
}

pub(crate) fn registry() -> &'static Mutex<HashMap<String, Arc<Broker>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Arc<Broker>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}
