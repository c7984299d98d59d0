//! Publishing: publishes are committed in groups (see `group`). Each commit
//! writes whole pages to the WAL and its checksums, so one commit for the
//! publishes that waited while the last one ran is what makes many
//! concurrent small publishes fast (a single PUSH of the OJS API is one); a
//! publish still returns only after its own rows are committed.

use std::sync::Arc;

use ojs_queue::{Error, OutgoingMessage, Result};
use tokio::sync::oneshot;

use crate::group::Member;
use crate::{store, Inner};

/// One publish waiting for its commit.
#[derive(Debug)]
pub(crate) struct PublishRequest {
    pub(crate) queue: String,
    pub(crate) messages: Vec<OutgoingMessage>,
    /// The publish's result, with its messages back (a failed publish
    /// hands them to its caller).
    pub(crate) reply: oneshot::Sender<(Result<()>, Vec<OutgoingMessage>)>,
}

impl Member for PublishRequest {
    /// A group stays a short transaction whatever the messages' size.
    const LIMITS: (usize, usize) = (1_000, 16 << 20);

    fn size(&self) -> (usize, usize) {
        let bytes = self.messages.iter().map(|m| m.payload.len()).sum();
        (self.messages.len(), bytes)
    }
}

/// Commits a group of publishes in one transaction, each publish in a
/// savepoint of its own (see `store::insert_publishes`), and answers each.
/// Runs on the blocking pool.
pub(crate) fn commit_publishes(inner: &Arc<Inner>, group: Vec<PublishRequest>) {
    let results = {
        let mut conn = inner.lock();
        let publishes: Vec<(&str, &[OutgoingMessage])> = group
            .iter()
            .map(|r| (r.queue.as_str(), r.messages.as_slice()))
            .collect();
        let results = store::insert_publishes(&mut conn, &publishes);
        inner.checkpointer.committed(&conn);
        results
    };
    match results {
        Ok(results) => {
            // Waiting consumers are woken from here, as soon as the rows
            // are readable, rather than after each publisher's task has
            // run again to hear its answer: that was one more hand-off
            // between a publish and its delivery.
            if results.iter().any(Result::is_ok) {
                inner.notify.notify_waiters();
            }
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
