//! Consuming: leases on the in-process queue, given back when the consumer
//! closes or is dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{Consumer, ConsumerOptions, Delivery, Result, Source};
use tokio::time::Instant;

use crate::ack::MemoryAcker;
use crate::broker::{Broker, InFlight, Queue};

/// A consumer of one in-memory queue (or its dead letters).
#[derive(Debug)]
pub struct MemoryConsumer {
    pub(crate) id: u64,
    pub(crate) queue_name: Arc<str>,
    pub(crate) queue: Arc<Queue>,
    pub(crate) broker: Arc<Broker>,
    pub(crate) options: ConsumerOptions,
}

impl MemoryConsumer {
    fn take(&self, max: usize, now: Instant) -> (Vec<Delivery>, Option<Instant>) {
        let mut state = self.queue.lock();
        state.reclaim(now);
        let mut out = Vec::new();
        while out.len() < max {
            let message = match self.options.source {
                Source::Queue => state.ready.pop_first().map(|(_, m)| m),
                Source::DeadLetters => state.dead.pop_first().map(|(_, m)| m),
            };
            let Some(mut message) = message else { break };
            message.deliveries += 1;
            let tag = self.broker.ids.fetch_add(1, Ordering::Relaxed);
            let mut delivery = Delivery::new(
                message.payload.clone(),
                message.headers.clone(),
                message.deliveries,
                self.queue_name.clone(),
                Box::new(MemoryAcker {
                    queue: self.queue.clone(),
                    tag,
                }),
            );
            delivery.key = message.key.clone();
            delivery.message_id = message.message_id.clone();
            let max_deliveries = match self.options.source {
                Source::Queue => self.options.max_deliveries,
                // Dead letters are never dead-lettered again.
                Source::DeadLetters => None,
            };
            state.lease(
                tag,
                InFlight {
                    message,
                    deadline: now + self.options.visibility_timeout,
                    consumer: self.id,
                    max_deliveries,
                    dead: self.options.source == Source::DeadLetters,
                },
            );
            out.push(delivery);
        }
        (out, state.next_wake())
    }
}

#[async_trait]
impl Consumer for MemoryConsumer {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        loop {
            // Register interest before looking, so a publish between the look
            // and the wait is not missed.
            let notified = self.queue.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let (deliveries, next_wake) = self.take(max.max(1), now);
            if !deliveries.is_empty() || now >= deadline {
                return Ok(deliveries);
            }
            let wake = next_wake.map_or(deadline, |w| w.min(deadline));
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}

impl Drop for MemoryConsumer {
    fn drop(&mut self) {
        // A consumer that goes away gives its unsettled messages back at once,
        // as an AMQP channel close does.
        let now = Instant::now();
        let mut state = self.queue.lock();
        let mine: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(_, f)| f.consumer == self.id)
            .map(|(tag, _)| *tag)
            .collect();
        let released = !mine.is_empty();
        for tag in mine {
            if let Some(flight) = state.in_flight.remove(&tag) {
                state.release(flight, now, Duration::ZERO);
            }
        }
        drop(state);
        if released {
            self.queue.notify.notify_waiters();
        }
    }
}
