//! Moving messages between this broker's own queues in one transaction
//! ([`MoveWithin`]): taken, published, removed, with no lease and no ack
//! between. The daemon's routes from one embedded queue to another run
//! this way.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{
    Acknowledger, Delivery, DeliveryRef, Error, MovePlanner, MoveWithin, Nack, Result,
};
use tokio::time::Instant;

use crate::{blocking, store, wait_for_messages, LocalAdapter, HOUSEKEEPING_EVERY};

/// The acknowledger of a delivery a move hands its planner: the move
/// settles it, so settling it again is refused.
#[derive(Debug)]
struct SettledByTheMove;

fn settled_by_the_move() -> Error {
    Error::broker(
        "local",
        "a moved message is settled by its move, not by an ack",
        false,
    )
}

#[async_trait]
impl Acknowledger for SettledByTheMove {
    async fn ack(&self) -> Result<()> {
        Err(settled_by_the_move())
    }

    async fn nack(&self, _action: Nack, _delivery: DeliveryRef<'_>) -> Result<()> {
        Err(settled_by_the_move())
    }
}

#[async_trait]
impl MoveWithin for LocalAdapter {
    async fn move_within(
        &self,
        queue: &str,
        max: usize,
        wait: Duration,
        plan: MovePlanner,
    ) -> Result<Vec<bool>> {
        let deadline = Instant::now() + wait;
        let source: Arc<str> = Arc::from(queue);
        let mut plan = Some(plan);
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let max_bytes = self.inner.config.max_message_bytes;
            let (queue, planner) = (source.clone(), plan.take());
            // The planner comes back when nothing was there to move.
            let (moved, planner, next) = blocking(&self.inner, move |inner, conn| {
                let mut planner = planner;
                let moved = store::move_batch(conn, &queue, max.max(1), max_bytes, |taken| {
                    let deliveries: Vec<Delivery> = taken
                        .into_iter()
                        .map(|c| c.into_delivery(queue.clone(), Box::new(SettledByTheMove)))
                        .collect();
                    // A planner that panics plans nothing: the move fails
                    // (not retryable) and nothing is taken.
                    match planner.take() {
                        Some(plan) => {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                plan(&deliveries)
                            }))
                            .unwrap_or_default()
                        }
                        None => Vec::new(),
                    }
                })?;
                if moved.is_empty() {
                    let next = store::next_visible(conn, &queue, false)?;
                    return Ok((moved, planner, next));
                }
                let removed = moved.iter().filter(|published| **published).count() as u64;
                let before = inner.deletes.fetch_add(removed, Ordering::Relaxed);
                if (before + removed) / HOUSEKEEPING_EVERY > before / HOUSEKEEPING_EVERY {
                    if let Err(e) = store::housekeeping(conn, &inner.checkpointer) {
                        tracing::warn!(error = %e, "housekeeping failed");
                    }
                }
                Ok((moved, planner, None))
            })
            .await?;
            if !moved.is_empty() {
                // Consumers of the queues published to.
                self.inner.notify.notify_waiters();
                return Ok(moved);
            }
            plan = planner;
            if plan.is_none()
                || !wait_for_messages(&self.inner, notified.as_mut(), next, deadline).await
            {
                return Ok(Vec::new());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use ojs_core::envelope::media::OJS_PROTO;
    use ojs_queue::{
        header, ConsumerOptions, DeadLetterKind, DeadLetterReason, Delivery, Error, MoveTo,
        OutgoingMessage, QueueAdapter, Source,
    };

    use crate::{LocalAdapter, LocalConfig};

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ojs-local-move-{name}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    async fn publish(a: &LocalAdapter, queue: &str, texts: &[String]) {
        let messages = texts
            .iter()
            .map(|t| OutgoingMessage::new(t.clone(), OJS_PROTO))
            .collect();
        a.publish(queue, messages).await.unwrap();
    }

    /// Every message of `queue` (or its dead letters), received and acked:
    /// body → headers.
    async fn drain(
        a: &LocalAdapter,
        queue: &str,
        source: Source,
    ) -> BTreeMap<String, ojs_queue::Headers> {
        let options = ConsumerOptions {
            source,
            ..ConsumerOptions::default()
        };
        let mut consumer = a.consumer(queue, options).await.unwrap();
        let mut out = BTreeMap::new();
        loop {
            let batch = consumer
                .receive(100, Duration::from_millis(50))
                .await
                .unwrap();
            if batch.is_empty() {
                return out;
            }
            for d in batch {
                out.insert(
                    String::from_utf8_lossy(&d.payload).into_owned(),
                    d.headers.clone(),
                );
                d.ack().await.unwrap();
            }
        }
    }

    /// Moves every message of `from`: even-numbered ones to `to`, the
    /// others to the dead letters.
    fn evens_to(to: &'static str) -> ojs_queue::MovePlanner {
        Box::new(move |deliveries: &[Delivery]| {
            deliveries
                .iter()
                .map(|d| {
                    let text = String::from_utf8_lossy(&d.payload).into_owned();
                    let n: u32 = text.trim_start_matches("m").parse().unwrap();
                    if n % 2 == 0 {
                        MoveTo::Queue {
                            queue: to.into(),
                            message: OutgoingMessage::new(format!("moved {text}"), OJS_PROTO),
                        }
                    } else {
                        MoveTo::DeadLetter(DeadLetterReason::of(
                            DeadLetterKind::UnknownRoute,
                            format!("no route takes {text}"),
                        ))
                    }
                })
                .collect()
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_move_publishes_removes_and_dead_letters_in_one_transaction() {
        let dir = temp_dir("move");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let texts: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
        publish(&a, "calls", &texts).await;
        let mover = a.mover().unwrap();
        // Batches of 16, in publish order; what each was is said in order.
        let mut outcomes = Vec::new();
        for _ in 0..10 {
            let moved = mover
                .move_within("calls", 16, Duration::from_millis(50), evens_to("jobs"))
                .await
                .unwrap();
            if moved.is_empty() {
                break;
            }
            assert!(moved.len() <= 16);
            outcomes.extend(moved);
        }
        assert_eq!(outcomes, (0..40).map(|i| i % 2 == 0).collect::<Vec<_>>());
        assert_eq!(a.depth("calls").await.unwrap(), Some(0));
        let jobs = drain(&a, "jobs", Source::Queue).await;
        let moved: Vec<String> = (0..40).step_by(2).map(|i| format!("moved m{i}")).collect();
        assert_eq!(
            jobs.keys()
                .cloned()
                .collect::<std::collections::BTreeSet<_>>(),
            moved.into_iter().collect()
        );
        let dead = drain(&a, "calls", Source::DeadLetters).await;
        assert_eq!(dead.len(), 20);
        for (text, headers) in dead {
            assert_eq!(
                headers.get_str(header::ERROR_TYPE),
                Some("unknown_route"),
                "{text}"
            );
            assert!(
                headers
                    .get_str(header::ERROR_MESSAGE)
                    .is_some_and(|m| m.ends_with(&format!("takes {text}"))),
                "{text}"
            );
        }
        drop(a);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_move_skips_what_a_consumer_holds_and_dead_letters_what_is_too_large() {
        let dir = temp_dir("held");
        let mut config = LocalConfig::new(&dir);
        config.max_message_bytes = 1024;
        let a = LocalAdapter::open(config).await.unwrap();
        let texts: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
        publish(&a, "calls", &texts).await;
        // A consumer holds the first four under its lease.
        let mut consumer = a
            .consumer("calls", ConsumerOptions::default())
            .await
            .unwrap();
        let held = consumer
            .receive(4, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(held.len(), 4);
        let planner: ojs_queue::MovePlanner = Box::new(|deliveries: &[Delivery]| {
            deliveries
                .iter()
                .map(|d| {
                    let text = String::from_utf8_lossy(&d.payload).into_owned();
                    // One grows past what the broker takes.
                    let body = if text == "m7" { "x".repeat(4096) } else { text };
                    MoveTo::Queue {
                        queue: "jobs".into(),
                        message: OutgoingMessage::new(body, OJS_PROTO),
                    }
                })
                .collect()
        });
        let moved = a
            .mover()
            .unwrap()
            .move_within("calls", 100, Duration::from_millis(50), planner)
            .await
            .unwrap();
        assert_eq!(moved, vec![true, true, true, false, true, true]);
        let jobs = drain(&a, "jobs", Source::Queue).await;
        assert_eq!(
            jobs.keys().cloned().collect::<Vec<_>>(),
            ["m4", "m5", "m6", "m8", "m9"]
        );
        let dead = drain(&a, "calls", Source::DeadLetters).await;
        assert_eq!(dead.keys().cloned().collect::<Vec<_>>(), ["m7"]);
        assert_eq!(
            dead["m7"].get_str(header::ERROR_TYPE),
            Some("payload_too_large")
        );
        // What the consumer holds is still its own, and its acks still work.
        for d in held {
            d.ack().await.unwrap();
        }
        assert_eq!(a.depth("calls").await.unwrap(), Some(0));
        drop(consumer);
        drop(a);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_move_leaves_every_message_where_it_was() {
        let dir = temp_dir("failed");
        let a = LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap();
        let texts: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
        publish(&a, "calls", &texts).await;
        let mover = a.mover().unwrap();
        // A planner that answers for fewer messages than it was given, and
        // one that panics: neither moves anything.
        let short: ojs_queue::MovePlanner = Box::new(|_: &[Delivery]| Vec::new());
        let e = mover
            .move_within("calls", 100, Duration::from_millis(50), short)
            .await
            .unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        let panics: ojs_queue::MovePlanner = Box::new(|_: &[Delivery]| panic!("a planner's bug"));
        let e = mover
            .move_within("calls", 100, Duration::from_millis(50), panics)
            .await
            .unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        assert_eq!(a.depth("calls").await.unwrap(), Some(10));
        assert_eq!(a.depth("jobs").await.unwrap(), Some(0));
        // Nothing was leased or counted as delivered: a consumer gets each
        // on its first delivery.
        let mut consumer = a
            .consumer("calls", ConsumerOptions::default())
            .await
            .unwrap();
        let batch = consumer
            .receive(100, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(batch.len(), 10);
        assert!(batch.iter().all(|d| d.attempt == 1));
        // A closed broker moves nothing.
        a.close().await.unwrap();
        assert!(matches!(
            mover
                .move_within("calls", 100, Duration::from_millis(10), evens_to("jobs"))
                .await,
            Err(Error::Closed)
        ));
        drop(batch);
        drop(consumer);
        drop(a);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_move_takes_what_is_published_meanwhile() {
        let dir = temp_dir("wait");
        let a = Arc::new(LocalAdapter::open(LocalConfig::new(&dir)).await.unwrap());
        let publisher = {
            let a = a.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                publish(&a, "calls", &["m0".to_owned()]).await;
            })
        };
        let moved = a
            .mover()
            .unwrap()
            .move_within("calls", 10, Duration::from_secs(5), evens_to("jobs"))
            .await
            .unwrap();
        assert_eq!(moved, vec![true]);
        publisher.await.unwrap();
        assert_eq!(a.depth("jobs").await.unwrap(), Some(1));
        std::fs::remove_dir_all(dir).ok();
    }
}
