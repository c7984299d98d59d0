//! Reading what a suite published, for suites that count payloads rather
//! than envelope ids (the acceptance suite keeps its own tally-based loop).

use std::time::Duration;

use anyhow::{bail, Result};
use ojs_queue::{Consumer, ConsumerOptions, Delivery, QueueAdapter};
use tokio::time::Instant;

/// Receives and acks from `queue` until `want` payloads arrived or
/// `patience` ran out; the payloads as text, in arrival order.
pub async fn drain_payloads(
    adapter: &dyn QueueAdapter,
    queue: &str,
    options: ConsumerOptions,
    want: usize,
    patience: Duration,
) -> Result<Vec<String>> {
    let mut consumer = adapter.consumer(queue, options).await?;
    let mut got = Vec::new();
    let deadline = Instant::now() + patience;
    while got.len() < want && Instant::now() < deadline {
        for d in consumer.receive(500, Duration::from_millis(500)).await? {
            got.push(String::from_utf8_lossy(&d.payload).into_owned());
            d.ack().await?;
        }
    }
    consumer.close().await?;
    Ok(got)
}

/// The next delivery, unsettled, within `patience`.
pub async fn next_delivery(consumer: &mut dyn Consumer, patience: Duration) -> Result<Delivery> {
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline {
        if let Some(d) = consumer.receive(1, Duration::from_millis(500)).await?.pop() {
            return Ok(d);
        }
    }
    bail!("nothing arrived within {patience:?}")
}

/// Opens a consumer on `queue` with the default options and takes its
/// next delivery, unsettled, within `patience`. The consumer comes back
/// open: the test settles the delivery, reads on, then closes it.
pub async fn first_delivery(
    adapter: &dyn QueueAdapter,
    queue: &str,
    patience: Duration,
) -> Result<(Box<dyn Consumer>, Delivery)> {
    let mut consumer = adapter.consumer(queue, ConsumerOptions::default()).await?;
    let delivery = next_delivery(&mut *consumer, patience).await?;
    Ok((consumer, delivery))
}
