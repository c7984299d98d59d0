//! Handlers by grpcq topic → action, and by OJS job type.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use ojs_core::envelope::JobEnvelope;
use ojs_queue::{Error, Result};

/// Why a handler failed: what the retry policy matches on and what a dead
/// letter records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    /// Error class (`non_retryable_errors` match on it).
    pub error_type: String,
    /// Human-readable message.
    pub message: String,
    /// Stack frames, when the handler has them.
    pub backtrace: Vec<String>,
    /// False: never retried, whatever the policy says.
    pub retryable: bool,
}

impl HandlerError {
    /// A failure that may succeed on retry.
    pub fn new(error_type: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError {
            error_type: error_type.into(),
            message: message.into(),
            backtrace: Vec::new(),
            retryable: true,
        }
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(error_type: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError {
            retryable: false,
            ..HandlerError::new(error_type, message)
        }
    }

    /// Any error, by its display text.
    pub fn from_error(error_type: impl Into<String>, e: &dyn std::error::Error) -> Self {
        HandlerError::new(error_type, e.to_string())
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.error_type, self.message)
    }
}

/// What a grpcq call handler gets besides the request bytes.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// grpcq message id.
    pub message_id: String,
    /// Fully qualified service name.
    pub topic: String,
    /// Method name.
    pub action: String,
    /// Sender.
    pub originator: String,
    /// grpcq metadata (trace context, tenant…).
    pub metadata: BTreeMap<String, String>,
    /// Publish time, Unix ms.
    pub timestamp_ms: i64,
    /// 1-based delivery attempt.
    pub attempt: u32,
    /// Whether a failure of this attempt is final (the retry policy has no
    /// attempt left): the last chance to tell a waiting caller.
    pub final_attempt: bool,
    /// Time the handler has before it is cancelled (the worker's
    /// `handler_timeout`).
    pub timeout: std::time::Duration,
}

/// Result of a handler.
pub type HandlerResult = std::result::Result<(), HandlerError>;

/// A grpcq call handler.
pub type CallHandler =
    Arc<dyn Fn(CallContext, Bytes) -> BoxFuture<'static, HandlerResult> + Send + Sync>;
/// An OJS job handler: the job and its 1-based attempt.
pub type JobHandler =
    Arc<dyn Fn(JobEnvelope, u32) -> BoxFuture<'static, HandlerResult> + Send + Sync>;

/// Handlers by grpcq topic/action and by job type. Registering the same
/// route twice is an error.
#[derive(Default, Clone)]
pub struct Registry {
    calls: BTreeMap<String, BTreeMap<String, CallHandler>>,
    /// Whole services: one handler for every action of a topic (a served
    /// tonic service), used when the action has no handler of its own.
    services: BTreeMap<String, CallHandler>,
    jobs: BTreeMap<String, JobHandler>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("routes", &self.routes())
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a handler for raw request bytes of `topic`/`action`.
    pub fn on_call<F, Fut>(&mut self, topic: &str, action: &str, handler: F) -> Result<&mut Self>
    where
        F: Fn(CallContext, Bytes) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        let actions = self.calls.entry(topic.to_owned()).or_default();
        if actions.contains_key(action) {
            return Err(Error::InvalidConfig {
                field: format!("handler {topic}/{action}"),
                reason: "registered twice".into(),
            });
        }
        actions.insert(
            action.to_owned(),
            Arc::new(move |ctx, payload| handler(ctx, payload).boxed()),
        );
        Ok(self)
    }

    /// Registers a typed handler: the payload is decoded as `Req`; a payload
    /// that does not decode is a permanent `undecodable_payload` failure.
    pub fn on_request<Req, F, Fut>(
        &mut self,
        topic: &str,
        action: &str,
        handler: F,
    ) -> Result<&mut Self>
    where
        Req: prost::Message + Default + 'static,
        F: Fn(CallContext, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        let handler = Arc::new(handler);
        self.on_call(topic, action, move |ctx, payload: Bytes| {
            let decoded = Req::decode(payload);
            let handler = handler.clone();
            async move {
                match decoded {
                    Ok(req) => handler(ctx, req).await,
                    Err(e) => Err(HandlerError::permanent(
                        "undecodable_payload",
                        e.to_string(),
                    )),
                }
            }
        })
    }

    /// Registers one handler for every action of `topic` (a whole service,
    /// e.g. a tonic server; the action is in [`CallContext::action`]).
    /// Handlers registered for single actions of the topic win.
    pub fn on_service<F, Fut>(&mut self, topic: &str, handler: F) -> Result<&mut Self>
    where
        F: Fn(CallContext, Bytes) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        if self.services.contains_key(topic) {
            return Err(Error::InvalidConfig {
                field: format!("service {topic}"),
                reason: "registered twice".into(),
            });
        }
        self.services.insert(
            topic.to_owned(),
            Arc::new(move |ctx, payload| handler(ctx, payload).boxed()),
        );
        Ok(self)
    }

    /// Registers a handler for OJS jobs of `job_type`.
    pub fn on_job<F, Fut>(&mut self, job_type: &str, handler: F) -> Result<&mut Self>
    where
        F: Fn(JobEnvelope, u32) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        if self.jobs.contains_key(job_type) {
            return Err(Error::InvalidConfig {
                field: format!("handler {job_type}"),
                reason: "registered twice".into(),
            });
        }
        self.jobs.insert(
            job_type.to_owned(),
            Arc::new(move |job, attempt| handler(job, attempt).boxed()),
        );
        Ok(self)
    }

    /// The call handler of `topic`/`action`.
    pub fn call(&self, topic: &str, action: &str) -> Option<CallHandler> {
        self.calls
            .get(topic)
            .and_then(|actions| actions.get(action))
            .or_else(|| self.services.get(topic))
            .cloned()
    }

    /// The job handler of `job_type`.
    pub fn job(&self, job_type: &str) -> Option<JobHandler> {
        self.jobs.get(job_type).cloned()
    }

    /// What is registered: `call topic/action` and `job type` lines, sorted.
    pub fn routes(&self) -> Vec<String> {
        let calls = self
            .calls
            .iter()
            .flat_map(|(t, actions)| actions.keys().map(move |a| format!("call {t}/{a}")));
        let services = self.services.keys().map(|t| format!("call {t}/*"));
        let jobs = self.jobs.keys().map(|t| format!("job {t}"));
        calls.chain(services).chain(jobs).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_errors_and_routes_are_listed() {
        let mut r = Registry::new();
        r.on_call("pay.Svc", "Charge", |_, _| async { Ok(()) })
            .unwrap();
        r.on_job("email.send", |_, _| async { Ok(()) }).unwrap();
        assert!(r
            .on_call("pay.Svc", "Charge", |_, _| async { Ok(()) })
            .is_err());
        assert!(r.on_job("email.send", |_, _| async { Ok(()) }).is_err());
        assert_eq!(r.routes(), ["call pay.Svc/Charge", "job email.send"]);
        assert!(r.call("pay.Svc", "Refund").is_none());
        r.on_service("pay.Svc", |_, _| async { Ok(()) }).unwrap();
        assert!(r.on_service("pay.Svc", |_, _| async { Ok(()) }).is_err());
        assert!(r.call("pay.Svc", "Refund").is_some());
        assert_eq!(
            r.routes(),
            ["call pay.Svc/Charge", "call pay.Svc/*", "job email.send"]
        );
        assert!(r.job("email.send").is_some());
    }
}
