//! Dead letter: a message that cannot be delivered goes, with its reason
//! (`ojs-error-type`, `ojs-error-message`), to the source's configured
//! dead-letter destination or to the adapter's own. A failure there is the
//! destination's, not the message's: retried while the source lease is
//! kept; a configured destination that refuses the copy for what it carries
//! gets it with less.

use std::sync::atomic::Ordering;

use ojs_queue::backoff::reconnect_delay;
use ojs_queue::{header, DeadLetterReason, Delivery, Error, Nack, OutgoingMessage};

use super::{is_permanent, SourceCtx, MAX_BACKOFF};

/// Whether a publish failed because the destination refuses what this one
/// message carries (not because it is down or denies us).
fn refused_for_its_content(e: &Error) -> bool {
    match e {
        Error::Publish(failure) => failure.failed.iter().any(|f| is_permanent(&f.error)),
        other => is_permanent(other),
    }
}

/// How much of a dead letter a configured destination gets: all of it,
/// then without the headers OJS does not name (and the broker message id
/// property), then without its body as well. Each step is taken only when the destination refused the one
/// before for its content, so a dead letter always lands somewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeadLetterTrim {
    Whole,
    KnownHeadersOnly,
    Bodiless,
}

impl DeadLetterTrim {
    /// Takes the next step on `copy`; the step taken.
    fn next(self, copy: &mut OutgoingMessage) -> Self {
        match self {
            DeadLetterTrim::Whole => {
                let before = copy.headers.len();
                copy.headers.retain(|name, _| header::is_known(name));
                let omitted = before - copy.headers.len();
                copy.headers
                    .insert(header::HEADERS_OMITTED, omitted.to_string());
                // The broker's message id property has rules of its own
                // (AMQP: 255 bytes); `ojs-id` still carries the job's id.
                copy.message_id = None;
                DeadLetterTrim::KnownHeadersOnly
            }
            DeadLetterTrim::KnownHeadersOnly | DeadLetterTrim::Bodiless => {
                let size = copy.payload.len();
                copy.payload = bytes::Bytes::new();
                copy.headers
                    .insert(header::PAYLOAD_OMITTED, size.to_string());
                DeadLetterTrim::Bodiless
            }
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            DeadLetterTrim::Whole => "nothing",
            DeadLetterTrim::KnownHeadersOnly => "headers OJS does not name, message id",
            DeadLetterTrim::Bodiless => "headers OJS does not name, message id, body",
        }
    }
}

/// Sends a poison message to the dead-letter destination with its reason.
pub(super) async fn dead_letter(ctx: &SourceCtx, d: Delivery, reason: DeadLetterReason) {
    ctx.metrics.dead_lettered(ctx.name(), &reason.error_type);
    tracing::warn!(source = %ctx.name(), reason = %reason.error_type, message_id = d.message_id.as_deref(), detail = %reason.message, "dead-lettering");
    let result = match &ctx.dead_letter {
        // The adapter's own dead-letter destination. A failure there is the
        // destination's, not the message's: retried while the source lease
        // is kept (on Kafka an unsettled record holds its partition's commit
        // point, so giving up is not an option either).
        None => {
            let mut attempt = 0;
            loop {
                match d.nack(Nack::DeadLetter(reason.clone())).await {
                    Err(e) if e.is_retryable() => {
                        attempt += 1;
                        ctx.metrics.error(ctx.name(), "dead_letter");
                        let delay = reconnect_delay(attempt, MAX_BACKOFF);
                        let _ = d.extend(delay + ctx.config.visibility_timeout).await;
                        tracing::warn!(source = %ctx.name(), error = %e, attempt, "dead-letter destination did not confirm; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    other => break other,
                }
            }
        }
        Some((adapter, queue)) => {
            let mut copy = d.to_outgoing();
            reason.write_headers(&mut copy.headers);
            let mut attempt = 0;
            let mut trimmed = DeadLetterTrim::Whole;
            loop {
                match adapter.publish(queue, vec![copy.clone()]).await {
                    Ok(()) => break d.ack().await,
                    Err(e)
                        if refused_for_its_content(&e) && trimmed != DeadLetterTrim::Bodiless =>
                    {
                        // Another broker's headers or size can be what the
                        // destination refuses (an SQS attribute name, an
                        // AMQP short string, a smaller queue): retrying the
                        // same copy would hold the source for ever.
                        trimmed = trimmed.next(&mut copy);
                        tracing::warn!(source = %ctx.name(), error = %e, left_out = trimmed.as_str(), "dead-letter destination refused the copy; sending it with less");
                    }
                    Err(e) => {
                        attempt += 1;
                        ctx.metrics.error(ctx.name(), "dead_letter_publish");
                        let delay = reconnect_delay(attempt, MAX_BACKOFF);
                        tracing::warn!(source = %ctx.name(), error = %e, attempt, "dead-letter queue did not confirm; retrying");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    };
    match result {
        Ok(()) => {
            let counters = ctx.counters();
            counters.acked.fetch_add(1, Ordering::Relaxed);
            counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            ctx.metrics.error(ctx.name(), "dead_letter");
            tracing::warn!(source = %ctx.name(), error = %e, "dead-lettering failed; the message will be delivered again");
        }
    }
}
