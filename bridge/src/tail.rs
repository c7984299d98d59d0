//! `ojs-bridge tail`: one NDJSON line per message, `{"headers":…,"message":…}`.

use std::io::Write;
use std::time::Duration;

use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::{Decode as _, Decoded};
use ojs_queue::{ConsumerOptions, Delivery, Nack, QueueAdapter, Result};
use serde_json::{json, Value};

use crate::send::MessageFormat;

/// How `tail` reads.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// Queue to read.
    pub queue: String,
    /// Expected message format (decides the default content type).
    pub format: MessageFormat,
    /// Stop after this many messages.
    pub count: Option<usize>,
    /// Stop after this long without a message.
    pub idle_timeout: Duration,
    /// Where the count of messages shown is drawn.
    pub progress: crate::progress::Progress,
    /// Acknowledge what was printed.
    pub ack: bool,
    /// Consumer settings (group, visibility timeout).
    pub consumer: ConsumerOptions,
}

/// How long a reader waits for its consumer to be ready (a Kafka group
/// join: at most a session timeout for a member that left without saying so,
/// then the rebalance) before its idle timeout starts.
pub const JOIN_LIMIT: Duration = Duration::from_secs(30);

/// The JSON line for one delivery.
pub fn render(d: &Delivery, format: MessageFormat) -> (Value, bool) {
    let default = match format {
        MessageFormat::Ojs => Encoding::OjsProto,
        MessageFormat::Grpcq => Encoding::GrpcqProto,
    };
    let headers = serde_json::to_value(&d.headers).unwrap_or(Value::Null);
    let decoded = d
        .decode_all(Some(default))
        .and_then(|decoded| match decoded {
            Decoded::Call(m) => Ok(grpcq::message_to_json(&m.to_message())),
            Decoded::Jobs(jobs) => {
                let values: ojs_core::Result<Vec<Value>> =
                    jobs.iter().map(|j| j.to_json_value()).collect();
                values.map(|mut v| {
                    if v.len() == 1 {
                        v.remove(0)
                    } else {
                        Value::Array(v)
                    }
                })
            }
        });
    match decoded {
        Ok(message) => (
            json!({"headers": headers, "attempt": d.attempt, "message": message}),
            true,
        ),
        Err(e) => (
            json!({"headers": headers, "attempt": d.attempt, "message": null, "error": e.to_string()}),
            false,
        ),
    }
}

/// Prints messages until the count or the idle timeout; returns how many.
pub async fn tail(
    adapter: &dyn QueueAdapter,
    opts: TailOptions,
    out: &mut impl Write,
) -> Result<usize> {
    let mut consumer = adapter.consumer(&opts.queue, opts.consumer.clone()).await?;
    // The idle timeout counts from when the consumer can receive: a Kafka
    // group join can take longer than a short timeout.
    if !consumer.ready(JOIN_LIMIT).await? {
        tracing::warn!(queue = %opts.queue, limit_s = JOIN_LIMIT.as_secs(), "the consumer is not assigned anything yet; reading anyway");
    }
    let mut printed = 0;
    // Unacked deliveries are held until we exit, so nothing is shown twice.
    let mut held = Vec::new();
    loop {
        let want = opts.count.map_or(100, |c| (c - printed).min(100));
        if want == 0 {
            break;
        }
        let batch = consumer.receive(want, opts.idle_timeout).await?;
        if batch.is_empty() {
            break;
        }
        for d in batch {
            let (line, decoded) = render(&d, opts.format);
            writeln!(out, "{line}")?;
            out.flush()?;
            printed += 1;
            opts.progress.add(1);
            // Undecodable messages are shown but never acknowledged here:
            // they wait for a consumer that can dead-letter them.
            if opts.ack && decoded {
                d.ack().await?;
            } else {
                held.push(d);
            }
        }
    }
    // Shown, not handled: given back uncounted (a look is not a delivery
    // attempt). Kafka's are simply not committed.
    if adapter.kind() != "kafka" {
        for d in held.drain(..) {
            if let Err(e) = d.nack(Nack::Release).await {
                tracing::debug!(error = %e, "giving back a message tail showed failed; it comes back when its lease ends");
            }
        }
    }
    drop(held);
    opts.progress.finish();
    consumer.close().await?;
    Ok(printed)
}
