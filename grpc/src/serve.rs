//! Serving a tonic service from a queue.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http::header::{HeaderName, HeaderValue};
use http_body_util::{BodyExt, Full};
use ojs_grpcq as grpcq;
use ojs_grpcq::registry::{CallContext, HandlerError, Registry};
use ojs_queue::QueueAdapter;
use tonic::codegen::{Service, StdError};
use tonic::server::NamedService;
use tonic::{Code, Status};

use crate::frame::{frame, timeout_header, unframe};
use crate::status::{error_type, is_retryable};
use crate::{
    CORRELATION_ID, DEADLINE, DEFAULT_REPLY_PREFIX, MESSAGE_ID_HEADER, REPLY_MESSAGE, REPLY_STATUS,
    REPLY_TO,
};

/// Serves tonic services from a queue: add each service to a worker's
/// [`Registry`], then run the worker on the queue the calls arrive on.
///
/// ```ignore
/// let server = QueueServer::new(adapter.clone());
/// let mut registry = Registry::new();
/// server.add_service(&mut registry, InvoicesServer::new(MyInvoices::default()))?;
/// Worker::new(adapter, registry, WorkerConfig::new("invoices")).run(shutdown).await;
/// ```
#[derive(Clone)]
pub struct QueueServer {
    replies: Arc<dyn QueueAdapter>,
    reply_prefix: String,
    originator: String,
}

impl std::fmt::Debug for QueueServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueServer")
            .field("reply_prefix", &self.reply_prefix)
            .finish_non_exhaustive()
    }
}

impl QueueServer {
    /// A server publishing replies through `replies` (usually the adapter
    /// the worker consumes from), to queues under
    /// [`DEFAULT_REPLY_PREFIX`].
    pub fn new(replies: Arc<dyn QueueAdapter>) -> Self {
        QueueServer {
            replies,
            reply_prefix: DEFAULT_REPLY_PREFIX.into(),
            originator: "ojs-grpc-server".into(),
        }
    }

    /// Replies go only to queues whose names start with `prefix`.
    pub fn with_reply_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.reply_prefix = prefix.into();
        self
    }

    /// The originator of replies (service name + instance).
    pub fn with_originator(mut self, originator: impl Into<String>) -> Self {
        self.originator = originator.into();
        self
    }

    /// Registers every method of `service` (a tonic-generated server, or
    /// anything that answers gRPC requests the way one does) as the
    /// handler of topic `S::NAME`.
    pub fn add_service<S, B>(&self, registry: &mut Registry, service: S) -> ojs_queue::Result<()>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<B>>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<StdError> + Send + 'static,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        let server = self.clone();
        registry.on_service(S::NAME, move |ctx, payload| {
            let (server, service) = (server.clone(), service.clone());
            async move { server.handle(service, ctx, payload).await }
        })?;
        Ok(())
    }

    async fn handle<S, B>(
        &self,
        service: S,
        ctx: CallContext,
        payload: Bytes,
    ) -> Result<(), HandlerError>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<B>> + Send,
        S::Future: Send,
        S::Error: Into<StdError>,
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<StdError>,
    {
        let reply_to = ctx.metadata.get(REPLY_TO).cloned();
        if let Some(queue) = &reply_to {
            // A message must not aim a reply at any queue it likes.
            if !queue.starts_with(&self.reply_prefix) || self.replies.is_reserved(queue) {
                return Err(HandlerError::permanent(
                    "forbidden_reply_to",
                    format!(
                        "reply queue {queue:?} is not under the reply prefix {:?}",
                        self.reply_prefix
                    ),
                ));
            }
        }
        let result = match remaining(&ctx) {
            Some(timeout) => call(service, &ctx, payload, timeout).await,
            None => Err(Status::deadline_exceeded(
                "the caller's deadline passed while the call was queued; not run",
            )),
        };
        let status = match &result {
            Ok(_) => Status::new(Code::Ok, ""),
            Err(s) => s.clone(),
        };
        let expired = status.code() == Code::DeadlineExceeded && remaining(&ctx).is_none();
        let final_outcome = status.code() == Code::Ok
            || !is_retryable(status.code())
            || ctx.final_attempt
            || expired;
        if let (Some(queue), true) = (&reply_to, final_outcome) {
            let body = result.clone().unwrap_or_default();
            self.reply(queue, &ctx, &status, body).await.map_err(|e| {
                // Retried: the call runs again (at least once) and replies then.
                HandlerError::new("reply_unpublished", format!("reply to {queue:?}: {e}"))
            })?;
        }
        match result {
            Ok(_) => Ok(()),
            Err(_) if expired => Err(HandlerError::permanent(
                "deadline_expired",
                status.message().to_owned(),
            )),
            Err(s) => Err(HandlerError {
                error_type: error_type(s.code()),
                message: s.message().to_owned(),
                backtrace: Vec::new(),
                retryable: is_retryable(s.code()),
            }),
        }
    }

    async fn reply(
        &self,
        queue: &str,
        ctx: &CallContext,
        status: &Status,
        body: Bytes,
    ) -> ojs_queue::Result<()> {
        let mut metadata = BTreeMap::new();
        metadata.insert(CORRELATION_ID.to_owned(), ctx.message_id.clone());
        metadata.insert(REPLY_STATUS.to_owned(), (status.code() as i32).to_string());
        if !status.message().is_empty() {
            metadata.insert(REPLY_MESSAGE.to_owned(), status.message().to_owned());
        }
        let reply = grpcq::Message {
            originator: self.originator.clone(),
            topic: ctx.topic.clone(),
            action: ctx.action.clone(),
            payload: body.to_vec(),
            message_id: uuid::Uuid::now_v7().to_string(),
            timestamp_ms: chrono::Utc::now().timestamp_millis(),
            metadata,
        };
        let mut out = ojs_grpcq::outgoing(&reply);
        // A reply is addressed to its queue, never routed by service name
        // (RabbitMQ's `grpcq_exchanges` routes grpcq calls by these).
        out.headers.remove(ojs_queue::header::GRPCQ_TOPIC);
        out.headers.remove(ojs_queue::header::GRPCQ_ACTION);
        self.replies.publish(queue, vec![out]).await
    }
}

/// Time left to run the call: the handler's timeout, cut to the caller's
/// deadline when it sent one; `None` when that deadline has passed.
fn remaining(ctx: &CallContext) -> Option<Duration> {
    let Some(deadline) = ctx
        .metadata
        .get(DEADLINE)
        .and_then(|d| d.parse::<i64>().ok())
    else {
        return Some(ctx.timeout);
    };
    let left = deadline - chrono::Utc::now().timestamp_millis();
    let left = Duration::from_millis(u64::try_from(left).ok().filter(|l| *l > 0)?);
    Some(left.min(ctx.timeout))
}

/// Runs one unary call through `service`; the response message's bytes, or
/// its status. A panic in the service is `INTERNAL`; running past `timeout`
/// is `DEADLINE_EXCEEDED`.
async fn call<S, B>(
    mut service: S,
    ctx: &CallContext,
    payload: Bytes,
    timeout: Duration,
) -> Result<Bytes, Status>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<B>>,
    S::Error: Into<StdError>,
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<StdError>,
{
    let request = request(ctx, payload, timeout)?;
    let run = async {
        futures::future::poll_fn(|cx| service.poll_ready(cx))
            .await
            .map_err(|e| Status::unavailable(format!("service not ready: {}", e.into())))?;
        let response = service
            .call(request)
            .await
            .map_err(|e| Status::internal(format!("service failed: {}", e.into())))?;
        let (parts, body) = response.into_parts();
        // Trailers-only: an error status comes in the headers.
        if let Some(status) = Status::from_header_map(&parts.headers) {
            if status.code() != Code::Ok {
                return Err(status);
            }
        }
        let collected = body
            .collect()
            .await
            .map_err(|e| Status::internal(format!("response body: {}", e.into())))?;
        let status = collected
            .trailers()
            .and_then(Status::from_header_map)
            .or_else(|| Status::from_header_map(&parts.headers))
            .ok_or_else(|| Status::internal("response without grpc-status"))?;
        if status.code() != Code::Ok {
            return Err(status);
        }
        unframe(&collected.to_bytes()).map_err(|e| Status::internal(e.to_string()))
    };
    match tokio::time::timeout(timeout, AssertUnwindSafe(run).catch_unwind()).await {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(Status::internal(format!("the service panicked: {text}")))
        }
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no response within {} ms",
            timeout.as_millis()
        ))),
    }
}

/// The unary gRPC request of a call: path `/{topic}/{action}`, the framed
/// payload, metadata as headers (names that are not header names are left
/// out), the timeout as `grpc-timeout`.
fn request(
    ctx: &CallContext,
    payload: Bytes,
    timeout: Duration,
) -> Result<http::Request<tonic::body::Body>, Status> {
    let uri = format!("/{}/{}", ctx.topic, ctx.action);
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(&uri)
        .version(http::Version::HTTP_2)
        .body(tonic::body::Body::new(Full::new(frame(&payload))))
        .map_err(|e| Status::unimplemented(format!("{uri:?} is not a gRPC method path: {e}")))?;
    let headers = request.headers_mut();
    for (key, value) in &ctx.metadata {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(value),
        ) else {
            tracing::debug!(key = %key, "metadata entry is not a valid gRPC header; left out");
            continue;
        };
        headers.append(name, value);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
    if let Ok(v) = HeaderValue::from_str(&timeout_header(timeout)) {
        headers.insert("grpc-timeout", v);
    }
    if let Ok(v) = HeaderValue::from_str(&ctx.message_id) {
        headers.insert(MESSAGE_ID_HEADER, v);
    }
    Ok(request)
}
