//! `ojs-bridge send`: NDJSON in, messages out.

use ojs_core::{Encoding, JobEnvelope};
use ojs_grpcq as grpcq;
use ojs_queue::{Error, OutgoingMessage, QueueAdapter};
use serde_json::Value;

/// What the messages are: `send`'s input lines, or how `tail` reads a
/// message that carries no content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MessageFormat {
    /// OJS jobs (send: OJS JSON envelopes, published as
    /// application/openjobspec+proto)
    Ojs,
    /// grpcq calls (send: grpcq messages as JSON, `payload` in standard
    /// base64)
    Grpcq,
}

/// A send that failed, naming the line.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// A line that does not parse.
    #[error("line {line}: {error}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        error: ojs_core::Error,
    },
    /// A message the broker did not accept.
    #[error("line {line}: not published: {error}")]
    Publish {
        /// 1-based line number.
        line: usize,
        /// Why.
        error: Error,
    },
    /// Missing or conflicting flags.
    #[error("{0}")]
    Usage(String),
    /// The broker failed as a whole.
    #[error("{0}")]
    Broker(Error),
}

/// Messages per publish call.
const BATCH: usize = 500;

/// Parses every line (nothing is sent unless all parse), then publishes in
/// batches. Returns the number sent.
pub async fn send(
    adapter: &dyn QueueAdapter,
    input: &str,
    queue: Option<&str>,
    format: MessageFormat,
    progress: &crate::progress::Progress,
) -> Result<usize, SendError> {
    let mut messages: Vec<(usize, String, OutgoingMessage)> = Vec::new();
    for (i, text) in input.lines().enumerate() {
        let line = i + 1;
        if text.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(text).map_err(|e| SendError::Line {
            line,
            error: ojs_core::Error::InvalidJson {
                line: None,
                reason: e.to_string(),
            },
        })?;
        let (q, msg) = match format {
            MessageFormat::Ojs => {
                let mut job = JobEnvelope::from_json_value(value)
                    .map_err(|error| SendError::Line { line, error })?;
                if let Some(q) = queue {
                    job.queue = q.to_owned();
                }
                let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto)
                    .map_err(|error| SendError::Line { line, error })?;
                (job.queue, msg)
            }
            MessageFormat::Grpcq => {
                let m = grpcq::message_from_json(value)
                    .map_err(|error| SendError::Line { line, error })?;
                // grpcq's own convention: without --queue a call goes to the
                // queue named by its topic (with `topic_template={queue}` the
                // Kafka topic is the grpcq topic, the key its action).
                let q = match queue {
                    Some(q) => q.to_owned(),
                    None if !m.topic.is_empty() => m.topic.clone(),
                    None => return Err(SendError::Line {
                        line,
                        error: ojs_core::Error::InvalidAttribute {
                            attribute: "topic".into(),
                            reason:
                                "a call without --queue goes to its topic, and this one has none"
                                    .into(),
                        },
                    }),
                };
                (q, ojs_grpcq::outgoing(&m))
            }
        };
        messages.push((line, q, msg));
    }
    let total = messages.len();
    // Group consecutive lines by queue so each publish names one queue.
    let mut start = 0;
    while start < messages.len() {
        let q = messages[start].1.clone();
        let mut end = start;
        while end < messages.len() && end - start < BATCH && messages[end].1 == q {
            end += 1;
        }
        let lines: Vec<usize> = messages[start..end].iter().map(|(l, _, _)| *l).collect();
        let batch: Vec<OutgoingMessage> = messages[start..end]
            .iter()
            .map(|(_, _, m)| m.clone())
            .collect();
        match adapter.publish(&q, batch).await {
            Ok(()) => {}
            Err(Error::Publish(failure)) => {
                let first = failure.failed.into_iter().next();
                return Err(match first {
                    Some(f) => SendError::Publish {
                        line: lines[f.index],
                        error: f.error,
                    },
                    None => SendError::Broker(Error::broker("publish", "failed", false)),
                });
            }
            Err(error) => {
                return Err(SendError::Publish {
                    line: lines[0],
                    error,
                })
            }
        }
        progress.add((end - start) as u64);
        start = end;
    }
    progress.finish();
    adapter.close().await.map_err(SendError::Broker)?;
    Ok(total)
}
