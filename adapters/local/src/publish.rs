//! Publishing: every publish goes to one writer that commits them in
//! groups. Each commit writes whole pages to the WAL and its checksums, so
//! one commit for the publishes that waited while the last one ran is what
//! makes many concurrent small publishes fast (a single PUSH of the OJS
//! API is one); a publish still returns only after its own rows are
//! committed.

use std::sync::Weak;

use ojs_queue::{Error, OutgoingMessage, Result};
use tokio::sync::{mpsc, oneshot};

use crate::{blocking, store, Inner};

/// Most messages folded into one commit (a publish larger than this is
/// committed alone).
const MAX_MESSAGES_PER_COMMIT: usize = 1_000;
/// Most payload bytes folded into one commit, so that a group's
/// transaction stays short whatever the messages' size.
const MAX_BYTES_PER_COMMIT: usize = 16 << 20;

/// One publish waiting for the writer.
#[derive(Debug)]
pub(crate) struct PublishRequest {
    pub(crate) queue: String,
    pub(crate) messages: Vec<OutgoingMessage>,
    /// The publish's result, with its messages back (a failed publish
    /// hands them to its caller).
    pub(crate) reply: oneshot::Sender<(Result<()>, Vec<OutgoingMessage>)>,
}

fn payload_bytes(messages: &[OutgoingMessage]) -> usize {
    messages.iter().map(|m| m.payload.len()).sum()
}

/// Commits the publishes that arrive, in groups: one transaction for the
/// group, a savepoint for each publish (see `store::insert_publishes`).
/// Ends when the adapter is gone.
pub(crate) async fn publish_writer(
    inner: Weak<Inner>,
    mut requests: mpsc::UnboundedReceiver<PublishRequest>,
) {
    while let Some(first) = requests.recv().await {
        let (mut count, mut bytes) = (first.messages.len(), payload_bytes(&first.messages));
        let mut group = vec![first];
        while count < MAX_MESSAGES_PER_COMMIT && bytes < MAX_BYTES_PER_COMMIT {
            match requests.try_recv() {
                Ok(request) => {
                    count += request.messages.len();
                    bytes += payload_bytes(&request.messages);
                    group.push(request);
                }
                Err(_) => break,
            }
        }
        let Some(inner) = inner.upgrade() else { break };
        let committed = blocking(&inner, move |_, conn| {
            let publishes: Vec<(&str, &[OutgoingMessage])> = group
                .iter()
                .map(|r| (r.queue.as_str(), r.messages.as_slice()))
                .collect();
            let results = store::insert_publishes(conn, &publishes);
            Ok((results, group))
        })
        .await;
        // A store task that failed to run dropped the group: each caller
        // hears that from its dropped reply.
        let Ok((results, group)) = committed else {
            continue;
        };
        match results {
            Ok(results) => {
                for (request, result) in group.into_iter().zip(results) {
                    let _ = request.reply.send((result, request.messages));
                }
            }
            Err(e) => {
                let (text, retryable) = (e.to_string(), e.is_retryable());
                for request in group {
                    let error = Error::broker("local", text.clone(), retryable);
                    let _ = request.reply.send((Err(error), request.messages));
                }
            }
        }
    }
}
