//! Publishing: grpcq calls (fire-and-forget async gRPC) and OJS jobs through
//! enqueue middleware.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::Message;
use ojs_core::envelope::media::Encoding;
use ojs_core::envelope::{JobEnvelope, JobState};
use ojs_queue::{Error, Result};
use ojs_queue::{OutgoingMessage, QueueAdapter};

/// Publishes grpcq calls to one queue.
#[derive(Clone)]
pub struct GrpcqPublisher {
    adapter: Arc<dyn QueueAdapter>,
    queue: String,
    originator: String,
}

impl std::fmt::Debug for GrpcqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcqPublisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl GrpcqPublisher {
    /// A publisher of calls from `originator` (service name + instance).
    pub fn new(
        adapter: Arc<dyn QueueAdapter>,
        queue: impl Into<String>,
        originator: impl Into<String>,
    ) -> Self {
        GrpcqPublisher {
            adapter,
            queue: queue.into(),
            originator: originator.into(),
        }
    }

    /// Builds a call: a fresh UUID message id, `timestamp_ms` now.
    pub fn message<M: prost::Message>(
        &self,
        topic: &str,
        action: &str,
        request: &M,
        mut metadata: BTreeMap<String, String>,
    ) -> Message {
        // Inside a handler: the call continues the handler's trace.
        if !metadata.contains_key("traceparent") {
            if let Some(tp) = crate::trace::TraceContext::outgoing() {
                metadata.insert("traceparent".into(), tp);
            }
        }
        Message {
            originator: self.originator.clone(),
            topic: topic.to_owned(),
            action: action.to_owned(),
            payload: request.encode_to_vec(),
            message_id: uuid::Uuid::new_v4().to_string(),
            timestamp_ms: chrono::Utc::now().timestamp_millis(),
            metadata,
        }
    }

    /// Publishes one typed request; returns its message id. A call larger
    /// than the broker accepts fails with [`Error::PayloadTooLarge`] before
    /// anything is sent.
    pub async fn publish<M: prost::Message>(
        &self,
        topic: &str,
        action: &str,
        request: &M,
        metadata: BTreeMap<String, String>,
    ) -> Result<String> {
        let msg = self.message(topic, action, request, metadata);
        let id = msg.message_id.clone();
        self.publish_batch(vec![msg]).await.map_err(|e| match e {
            Error::Publish(mut f) if f.failed.len() == 1 => f.failed.remove(0).error,
            other => other,
        })?;
        Ok(id)
    }

    /// Publishes prepared calls; failures are reported per message.
    pub async fn publish_batch(&self, messages: Vec<Message>) -> Result<()> {
        let outgoing: Vec<OutgoingMessage> = messages.iter().map(crate::outgoing).collect();
        self.adapter.publish(&self.queue, outgoing).await
    }
}

/// Continues the enqueue middleware chain with the (possibly changed) job.
pub type EnqueueNext =
    Box<dyn FnOnce(JobEnvelope) -> BoxFuture<'static, Result<JobEnvelope>> + Send>;

/// Enqueue middleware (ojs-core): runs before a job is published; may change
/// it (inject trace context, defaults), reject it (return an error), or
/// call `next` to continue.
pub trait EnqueueMiddleware: Send + Sync {
    /// Handles one job.
    fn handle(
        &self,
        job: JobEnvelope,
        next: EnqueueNext,
    ) -> BoxFuture<'static, Result<JobEnvelope>>;
}

/// Enqueues OJS jobs on their queue as `application/openjobspec+proto`.
#[derive(Clone)]
pub struct JobClient {
    adapter: Arc<dyn QueueAdapter>,
    middleware: Vec<Arc<dyn EnqueueMiddleware>>,
}

impl std::fmt::Debug for JobClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobClient")
            .field("middleware", &self.middleware.len())
            .finish_non_exhaustive()
    }
}

impl JobClient {
    /// A client on `adapter`.
    pub fn new(adapter: Arc<dyn QueueAdapter>) -> Self {
        JobClient {
            adapter,
            middleware: Vec::new(),
        }
    }

    /// Adds enqueue middleware; the first added runs first.
    pub fn with_middleware(mut self, m: Arc<dyn EnqueueMiddleware>) -> Self {
        self.middleware.push(m);
        self
    }

    /// Runs the middleware chain, sets `enqueued_at` and the state, and
    /// publishes. Returns the job as enqueued.
    pub async fn enqueue(&self, mut job: JobEnvelope) -> Result<JobEnvelope> {
        // Inside a handler: the job continues the handler's trace.
        if job.meta_str("traceparent").is_none() {
            if let Some(tp) = crate::trace::TraceContext::outgoing() {
                job.meta.insert("traceparent".into(), tp.into());
            }
        }
        let adapter = self.adapter.clone();
        let mut next: EnqueueNext = Box::new(move |mut job: JobEnvelope| {
            Box::pin(async move {
                let now = chrono::Utc::now();
                job.enqueued_at = Some(now);
                job.state = Some(if job.scheduled_at.is_some_and(|t| t > now) {
                    JobState::Scheduled
                } else {
                    JobState::Available
                });
                let msg = OutgoingMessage::from_envelope(&job, Encoding::OjsProto)?;
                adapter
                    .publish(&job.queue, vec![msg])
                    .await
                    .map_err(|e| match e {
                        Error::Publish(mut f) if f.failed.len() == 1 => f.failed.remove(0).error,
                        other => other,
                    })?;
                Ok(job)
            })
        });
        for m in self.middleware.iter().rev() {
            let (m, inner) = (m.clone(), next);
            next = Box::new(move |job| m.handle(job, inner));
        }
        next(job).await
    }
}
