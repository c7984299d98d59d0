//! Settling: acks are committed in groups (one SQLite transaction for many
//! acks, see `group`); nacks reschedule or dead-letter the
//! row in the store.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ojs_queue::{Acknowledger, Error, Nack, Result};

use crate::group::{GroupCommit, Member};
use crate::{blocking, lock_held, store, Held, Inner, HOUSEKEEPING_EVERY};

/// Acks to commit together, and where to send their results (one per key,
/// in order): one request per delivery, or one for a batch of them.
#[derive(Debug)]
pub(crate) struct AckRequest {
    keys: Vec<(i64, i64)>,
    reply: tokio::sync::oneshot::Sender<Vec<Result<()>>>,
}

impl Member for AckRequest {
    const LIMITS: (usize, usize) = (1_000, usize::MAX);

    fn size(&self) -> (usize, usize) {
        (self.keys.len(), 0)
    }
}

/// Commits a group of acks in one transaction (group commit: each commit
/// writes whole pages to the WAL, so one commit for many acks is what makes
/// concurrent consumers fast) and answers each; an ack still resolves only
/// after its own delete is committed. Runs on the blocking pool.
fn commit_ack_group(inner: &Arc<Inner>, group: Vec<AckRequest>) {
    let keys: Vec<(i64, i64)> = group.iter().flat_map(|r| r.keys.iter().copied()).collect();
    let outcome = {
        let mut conn = inner.lock();
        let outcome = store::ack_many(&mut conn, &keys);
        if outcome.is_ok() {
            let count = keys.len() as u64;
            let before = inner.deletes.fetch_add(count, Ordering::Relaxed);
            if (before + count) / HOUSEKEEPING_EVERY > before / HOUSEKEEPING_EVERY {
                if let Err(e) = store::housekeeping(&conn, &inner.checkpointer) {
                    tracing::warn!(error = %e, "housekeeping failed");
                }
            }
        }
        inner.checkpointer.committed(&conn);
        outcome
    };
    match outcome {
        Ok(results) => {
            let mut results = results.into_iter();
            for request in group {
                let size = request.keys.len();
                let _ = request.reply.send(results.by_ref().take(size).collect());
            }
        }
        Err(e) => {
            let (text, retryable) = (e.to_string(), e.is_retryable());
            for request in group {
                let failed = request
                    .keys
                    .iter()
                    .map(|_| Err(Error::broker("local", text.clone(), retryable)))
                    .collect();
                let _ = request.reply.send(failed);
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct LocalAcker {
    pub(crate) inner: Arc<Inner>,
    pub(crate) id: i64,
    pub(crate) lease: i64,
    pub(crate) held: Held,
}

impl LocalAcker {
    pub(crate) fn forget(&self) {
        lock_held(&self.held).remove(&(self.id, self.lease));
    }
}

/// Hands `keys` to the group commit and waits for their commit: exactly one
/// result per key, in order.
pub(crate) async fn commit_acks(inner: &Arc<Inner>, keys: Vec<(i64, i64)>) -> Vec<Result<()>> {
    let size = keys.len();
    let (reply, done) = tokio::sync::oneshot::channel();
    let request = AckRequest { keys, reply };
    GroupCommit::submit(inner, |i| &i.acks, request, commit_ack_group);
    let mut results = done.await.unwrap_or_default();
    // A commit that never ran (or answered short) leaves these unsettled:
    // retryable, as the broker will hand them out again.
    results.resize_with(size, || {
        Err(Error::broker("local", "the ack commit stopped", true))
    });
    results
}

#[async_trait]
impl Acknowledger for LocalAcker {
    async fn ack(&self) -> Result<()> {
        let mut results = commit_acks(&self.inner, vec![(self.id, self.lease)]).await;
        // One key, one result: `commit_acks` answers for each.
        let result = results.pop().unwrap_or(Err(Error::Closed));
        if !matches!(result, Err(ref e) if e.is_retryable()) {
            self.forget();
        }
        result
    }

    /// A batch of this consumer's deliveries as one request to the ack
    /// commit (one commit, one reply), not one each.
    async fn ack_batch(&self, batch: &[&dyn Acknowledger]) -> Option<Vec<Result<()>>> {
        let members = ojs_queue::batch_of::<LocalAcker>(batch, |l| {
            Arc::ptr_eq(&l.inner, &self.inner) && Arc::ptr_eq(&l.held, &self.held)
        })?;
        let keys = members.iter().map(|l| (l.id, l.lease)).collect();
        let results = commit_acks(&self.inner, keys).await;
        let mut held = lock_held(&self.held);
        for (l, result) in members.iter().zip(&results) {
            if !matches!(result, Err(e) if e.is_retryable()) {
                held.remove(&(l.id, l.lease));
            }
        }
        Some(results)
    }

    async fn nack(&self, action: Nack, _delivery: ojs_queue::DeliveryRef<'_>) -> Result<()> {
        let (id, lease) = (self.id, self.lease);
        let result = blocking(&self.inner, move |_, conn| match action {
            Nack::Retry { delay } => store::retry(conn, id, lease, delay),
            Nack::DeadLetter(reason) => store::dead_letter(conn, id, lease, &reason),
            Nack::Release => store::give_back(conn, id, lease),
        })
        .await;
        if !matches!(result, Err(ref e) if e.is_retryable()) {
            self.forget();
        }
        if result.is_ok() {
            self.inner.notify.notify_waiters();
        }
        result
    }

    async fn extend(&self, by: Duration) -> Result<()> {
        let (id, lease) = (self.id, self.lease);
        blocking(&self.inner, move |_, conn| {
            store::extend(conn, id, lease, by)
        })
        .await
    }
}
