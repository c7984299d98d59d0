//! Reading request bodies within bounds, for both bindings: one budget of
//! bytes in flight across every connection (`[api]
//! max_body_bytes_in_flight`), a size limit per body (`max_body_bytes`), a
//! deadline and a minimum rate (`body_timeout`, `body_min_rate`). A body
//! past the budget is refused before it is read; one that arrives too
//! slowly is cut off, so a client that stalls mid-body holds neither
//! memory nor a slot for long.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::ApiSettings;

/// How long a body may take before the minimum rate counts.
pub const BODY_GRACE: Duration = Duration::from_secs(1);

/// Bytes of request bodies held at once, across every request.
#[derive(Debug)]
pub struct BodyBudget {
    used: AtomicUsize,
    limit: usize,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<BodyBudget> {
        Arc::new(BodyBudget {
            used: AtomicUsize::new(0),
            limit,
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// A permit for `bytes`, if the budget has room for them.
    pub fn try_take(self: &Arc<Self>, bytes: usize) -> Option<BodyPermit> {
        let mut permit = BodyPermit {
            budget: self.clone(),
            bytes: 0,
        };
        permit.try_grow(bytes).then_some(permit)
    }
}

/// Bytes of the budget one request holds; given back when dropped (with
/// the request's answer).
#[derive(Debug)]
pub struct BodyPermit {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyPermit {
    /// Takes `more` bytes of the budget, if it has room.
    pub fn try_grow(&mut self, more: usize) -> bool {
        let taken = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more)
                    .filter(|after| *after <= self.budget.limit)
            });
        if taken.is_ok() {
            self.bytes += more;
        }
        taken.is_ok()
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// How long a body of which `received` bytes have arrived may have taken
/// so far: a second of grace, then `min_rate` bytes a second, at most
/// `timeout`.
fn allowed(received: usize, min_rate: u64, timeout: Duration) -> Duration {
    let rate = min_rate.max(1) as f64;
    let for_received = Duration::try_from_secs_f64(received as f64 / rate).unwrap_or(timeout);
    BODY_GRACE.saturating_add(for_received).min(timeout)
}

/// What a body's head must pass before any of it is read: a declared
/// `Content-Length` within `max_body_bytes` (and `slack` framing bytes;
/// 413), and room in the budget for it (429). The permit holds its bytes.
pub fn admit(
    declared: Option<u64>,
    settings: &ApiSettings,
    budget: &Arc<BodyBudget>,
    slack: usize,
) -> Result<BodyPermit, ApiError> {
    let limit = settings.max_body_bytes.saturating_add(slack);
    let declared = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if declared > limit {
        return Err(ApiError::BodyTooLarge {
            limit: settings.max_body_bytes,
        });
    }
    budget.try_take(declared).ok_or(ApiError::Busy)
}

/// Reads `body` (`slack` framing bytes allowed beyond `max_body_bytes`)
/// within the settings' bounds, growing `permit` for bytes beyond what was
/// declared; the permit holds the body's bytes until it is dropped.
pub async fn read<B>(
    body: B,
    mut permit: BodyPermit,
    settings: &ApiSettings,
    slack: usize,
) -> Result<(Bytes, BodyPermit), ApiError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let limit = settings.max_body_bytes.saturating_add(slack);
    let declared = permit.bytes;
    let mut body = body;
    let started = Instant::now();
    let mut out = BytesMut::with_capacity(declared.min(limit));
    loop {
        let until = started + allowed(out.len(), settings.body_min_rate, settings.body_timeout);
        let frame = match tokio::time::timeout_at(until, body.frame()).await {
            Err(_) => {
                return Err(ApiError::BodyTimeout {
                    seconds: started.elapsed().as_secs(),
                })
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(ApiError::InvalidPayload {
                    encoding: "HTTP",
                    reason: format!("the body was cut off: {e}"),
                })
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            // Trailers: nothing of the body.
            continue;
        };
        if out.len() + data.len() > limit {
            return Err(ApiError::BodyTooLarge {
                limit: settings.max_body_bytes,
            });
        }
        let more = (out.len() + data.len()).saturating_sub(permit.bytes);
        if more > 0 && !permit.try_grow(more) {
            return Err(ApiError::Busy);
        }
        out.extend_from_slice(&data);
    }
    Ok((out.freeze(), permit))
}

/// Reads and drops what is left of a body the request was refused
/// without (a 401, 413 or 429 answered on its head), within the same
/// deadline and minimum rate as a body that is kept, and at most
/// `max_body_bytes` of it: a client that sent its whole body then reads
/// its answer instead of a connection reset, and one that trickles or
/// sends more is cut off. Holds no bytes.
pub async fn discard<B>(body: B, settings: &ApiSettings) -> bool
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut body = body;
    let started = Instant::now();
    let mut received = 0usize;
    loop {
        let until = started + allowed(received, settings.body_min_rate, settings.body_timeout);
        match tokio::time::timeout_at(until, body.frame()).await {
            Ok(None) => return true,
            Ok(Some(Ok(frame))) => {
                received += frame.data_ref().map_or(0, |d| d.len());
                if received > settings.max_body_bytes {
                    return false;
                }
            }
            Ok(Some(Err(_))) | Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_shared_and_given_back() {
        let budget = BodyBudget::new(100);
        let a = budget.try_take(60);
        assert!(a.is_some());
        assert!(budget.try_take(41).is_none());
        let mut b = budget.try_take(40).unwrap_or_else(|| panic!("room for 40"));
        assert!(!b.try_grow(1));
        drop(a);
        assert!(b.try_grow(60));
        assert_eq!(budget.used(), 100);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_body_may_take_a_second_then_must_keep_the_rate() {
        let timeout = Duration::from_secs(30);
        assert_eq!(allowed(0, 1024, timeout), Duration::from_secs(1));
        assert_eq!(allowed(2048, 1024, timeout), Duration::from_secs(3));
        assert_eq!(allowed(usize::MAX, 1, timeout), timeout);
    }
}
