//! Settling: ack removes the message; a nack redelivers it after its delay
//! or moves it to the dead letters with the reason.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{Acknowledger, Error, Nack, Result};
use tokio::time::Instant;

use crate::broker::Queue;

#[derive(Debug)]
pub(crate) struct MemoryAcker {
    pub(crate) queue: Arc<Queue>,
    pub(crate) tag: u64,
}

impl MemoryAcker {
    /// Removes the message for good: an in-process step that never waits.
    pub(crate) fn settle(&self) -> Result<()> {
        let mut state = self.queue.lock();
        state
            .in_flight
            .remove(&self.tag)
            .map(|_| ())
            .ok_or(Error::DeliveryExpired)
    }
}

#[async_trait]
impl Acknowledger for MemoryAcker {
    async fn ack(&self) -> Result<()> {
        self.settle()
    }

    fn ack_now(&self) -> Option<Result<()>> {
        Some(self.settle())
    }

    /// A batch of this queue's deliveries under one lock, not one each.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let members =
            ojs_queue::batch_of::<MemoryAcker>(batch, |m| Arc::ptr_eq(&m.queue, &self.queue))?;
        let mut settled = Vec::with_capacity(members.len());
        let results = {
            let mut state = self.queue.lock();
            members
                .iter()
                .map(|m| match state.in_flight.remove(&m.tag) {
                    Some(flight) => {
                        settled.push(flight);
                        Ok(())
                    }
                    None => Err(Error::DeliveryExpired),
                })
                .collect()
        };
        // The messages are freed after the lock is let go.
        drop(settled);
        Some(results)
    }

    async fn nack(&self, action: Nack, _delivery: ojs_queue::DeliveryRef<'_>) -> Result<()> {
        {
            let mut state = self.queue.lock();
            let flight = state
                .in_flight
                .remove(&self.tag)
                .ok_or(Error::DeliveryExpired)?;
            match action {
                Nack::Retry { delay } => state.release(flight, Instant::now(), delay),
                Nack::Release => state.give_back(flight),
                Nack::DeadLetter(reason) => {
                    let mut message = flight.message;
                    reason.write_headers(&mut message.headers);
                    state.dead.insert(message.seq, message);
                }
            }
        }
        self.queue.notify.notify_waiters();
        Ok(())
    }

    async fn extend(&self, by: Duration) -> Result<()> {
        let mut state = self.queue.lock();
        let flight = state
            .in_flight
            .get_mut(&self.tag)
            .ok_or(Error::DeliveryExpired)?;
        flight.deadline = Instant::now() + by;
        Ok(())
    }
}
