//! How the daemon's allocator (mimalloc, the binary's global allocator and,
//! through its `override` feature, the C `malloc` librdkafka uses) gives
//! memory back to the operating system.
//!
//! mimalloc's default (3.3) returns ("purges") freed arena memory a second
//! after it was freed (`purge_delay` 1000 ms × `arena_purge_mult` 1). A
//! pipeline under load leaves some of its memory unused for longer than that
//! and then needs it again (buffers that grow and shrink with the batches in
//! flight), so that memory went back and was faulted in again, zeroed, often
//! as 2 MiB transparent huge pages: in a profile of `run` carrying Kafka calls
//! to Kafka jobs, page faults were 12.7 % of the process's samples (23 % of
//! librdkafka's broker thread), 30–44 faults per 1,000 messages. With the
//! delay at ten seconds they stop (0.1 per 1,000). mimalloc only purges while
//! the process allocates, so once a burst is over [`release_when_idle`] hands
//! the memory back explicitly: an idle daemon's resident memory falls back
//! as it did before.
//!
//! A user's own `MIMALLOC_ARENA_PURGE_MULT` (or `MIMALLOC_PURGE_DELAY`) wins:
//! mimalloc reads those when the process starts, and then this leaves the
//! settings alone.
#![allow(unsafe_code)]

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;

/// `mi_option_arena_purge_mult` in mimalloc's `mi_option_e` (the same index
/// in v2 and v3; `libmimalloc-sys` names only the first options). The tests
/// check it by its documented default.
const ARENA_PURGE_MULT: libmimalloc_sys::mi_option_t = 24;
/// `mi_option_purge_delay`, in milliseconds (default 1000).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// Freed arena memory goes back after `purge_delay` × this: 10 × 1 s.
const DAEMON_ARENA_PURGE_MULT: std::os::raw::c_long = 10;
/// How long the daemon must have received nothing before its memory is
/// handed back.
const IDLE_AFTER: Duration = Duration::from_secs(2);

/// Sets the daemon's purge delay unless the environment set one. Call it
/// first thing in `main`, before any other thread exists: mimalloc's
/// option setter is not thread-safe.
pub fn configure_for_daemon() {
    if ["MIMALLOC_ARENA_PURGE_MULT", "MIMALLOC_PURGE_DELAY"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
    {
        return;
    }
    // SAFETY: a plain setter of an integer option with a valid index; the
    // caller runs it before other threads exist.
    unsafe { libmimalloc_sys::mi_option_set(ARENA_PURGE_MULT, DAEMON_ARENA_PURGE_MULT) }
}

/// The arena purge delay in force, in milliseconds (negative: never).
pub fn arena_purge_delay_ms() -> i64 {
    // SAFETY: plain getters of integer options with valid indexes.
    let (delay, mult) = unsafe {
        (
            libmimalloc_sys::mi_option_get(PURGE_DELAY),
            libmimalloc_sys::mi_option_get(ARENA_PURGE_MULT),
        )
    };
    // `c_long` is `i64` here and `i32` on other targets.
    #[allow(clippy::useless_conversion)]
    let (delay, mult) = (i64::from(delay), i64::from(mult));
    delay.saturating_mul(mult)
}

/// Hands freed memory back to the operating system now (mimalloc's forced
/// collection: this thread's free lists and every arena's pending purges).
pub fn release_now() {
    // SAFETY: mimalloc's collection has no preconditions.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// Tells, tick by tick, when a burst has ended: the first tick on which
/// the sources' received count stands still after it moved.
#[derive(Debug, Default)]
struct BurstEnd {
    seen: u64,
    busy: bool,
}

impl BurstEnd {
    fn tick(&mut self, received: u64) -> bool {
        if received != self.seen {
            (self.seen, self.busy) = (received, true);
            false
        } else {
            std::mem::take(&mut self.busy)
        }
    }
}

/// Runs until `shutdown`: whenever the sources have received nothing for
/// [`IDLE_AFTER`] after receiving something, gives the memory back once.
pub async fn release_when_idle(metrics: Arc<Metrics>, shutdown: impl Future<Output = ()>) {
    let received = || -> u64 {
        metrics
            .sources
            .iter()
            .map(|(_, m)| m.received.load(Ordering::Relaxed))
            .sum()
    };
    let mut burst = BurstEnd {
        seen: received(),
        busy: false,
    };
    let mut tick = tokio::time::interval(IDLE_AFTER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        if burst.tick(received()) {
            // A forced collection walks every arena: off the runtime.
            let _ = tokio::task::spawn_blocking(release_now).await;
            tracing::debug!(
                idle_for_ms = IDLE_AFTER.as_millis() as u64,
                "sources idle; freed memory returned"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's resident memory in KiB.
    fn rss_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn the_option_indexes_name_mimallocs_purge_settings() {
        // mimalloc 3.3's defaults (1000 ms, × 1; options.c), read through
        // the indexes this module uses: a mimalloc whose option list or
        // defaults moved fails here.
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some()
            || std::env::var_os("MIMALLOC_ARENA_PURGE_MULT").is_some()
        {
            return;
        }
        // SAFETY: getters with valid indexes.
        let (delay, mult) = unsafe {
            (
                libmimalloc_sys::mi_option_get(PURGE_DELAY),
                libmimalloc_sys::mi_option_get(ARENA_PURGE_MULT),
            )
        };
        assert_eq!((delay, mult), (1000, 1));
        configure_for_daemon();
        assert_eq!(arena_purge_delay_ms(), 10_000);
    }

    #[test]
    fn memory_is_released_once_per_burst_when_the_sources_stand_still() {
        let mut burst = BurstEnd::default();
        // Idle from the start: nothing to give back.
        assert!(!burst.tick(0));
        assert!(!burst.tick(0));
        // Busy, then still: released on the first still tick only.
        assert!(!burst.tick(500));
        assert!(!burst.tick(1500));
        assert!(burst.tick(1500));
        assert!(!burst.tick(1500));
        // A second burst ends the same way.
        assert!(!burst.tick(1501));
        assert!(burst.tick(1501));
    }

    #[test]
    fn memory_freed_after_a_burst_goes_back_when_released() {
        configure_for_daemon();
        let before = rss_kib();
        // 256 MiB in 64 KiB blocks, written so that it is resident.
        let blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8 | 1; 64 << 10]).collect();
        let held = rss_kib();
        assert!(
            held > before + 200_000,
            "the burst was not resident: {before} KiB before, {held} KiB held"
        );
        drop(blocks);
        release_now();
        let after = rss_kib();
        assert!(
            after < before + 64_000,
            "freed memory stayed resident: {before} KiB before, {held} KiB held, {after} KiB after release"
        );
    }
}
