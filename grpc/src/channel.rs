//! A queue-backed channel for tonic-generated clients.

use ojs_grpcq::Decode as _;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::HeaderValue;
use http::HeaderMap;
use http_body_util::{BodyExt, StreamBody};
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_queue::{ConsumerOptions, QueueAdapter};
use tokio::sync::{oneshot, watch};
use tonic::codegen::Service;
use tonic::{Code, Status};

use crate::frame::{frame, parse_timeout, unframe};
use crate::{
    Error, Result, CORRELATION_ID, DEADLINE, DEFAULT_REPLY_PREFIX, REPLY_MESSAGE, REPLY_STATUS,
    REPLY_TO,
};

/// Request/response settings of a [`QueueChannel`].
#[derive(Debug, Clone)]
pub struct ReplyOptions {
    /// Reply queue name: `{prefix}{uuid}`, one per channel, created and
    /// removed by the channel.
    pub prefix: String,
    /// Instead: a queue provisioned for this client instance by whoever
    /// owns the broker (with `topology = "existing"`, where the channel
    /// may create nothing). Its name must start with the servers' reply
    /// prefix. Not created, not removed.
    pub queue: Option<String>,
    /// Longest wait for a reply when the call sets no shorter deadline.
    pub timeout: Duration,
    /// Consumer settings of the reply queue (group, prefetch).
    pub consumer: ConsumerOptions,
}

impl Default for ReplyOptions {
    fn default() -> Self {
        ReplyOptions {
            prefix: DEFAULT_REPLY_PREFIX.into(),
            queue: None,
            timeout: Duration::from_secs(30),
            consumer: ConsumerOptions::default(),
        }
    }
}

/// Counters of a channel's reply queue.
#[derive(Debug, Default)]
pub struct ReplyStats {
    /// Replies that resolved a waiting call.
    pub matched: AtomicU64,
    /// Replies nobody waited for: duplicates, and replies that came after
    /// their call timed out. Ignored (acked).
    pub unmatched: AtomicU64,
    /// Calls that timed out waiting.
    pub timed_out: AtomicU64,
    /// Reply queue messages that were not replies (acked, dropped).
    pub malformed: AtomicU64,
}

type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<grpcq::Message>>>>;

struct Replies {
    queue: String,
    /// Created by the channel (and so removed by it).
    owned: bool,
    timeout: Duration,
    pending: Pending,
    stats: Arc<ReplyStats>,
    stop: watch::Sender<bool>,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct Inner {
    adapter: Arc<dyn QueueAdapter>,
    queue: String,
    originator: String,
    replies: Option<Replies>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(r) = &self.replies {
            r.stop.send_replace(true);
        }
    }
}

/// A channel a tonic-generated client uses unchanged:
/// `InvoicesClient::new(QueueChannel::new(adapter, "invoices"))`.
///
/// Each unary call is published to the channel's queue as a grpcq call
/// (topic = service, action = method, payload = the request message,
/// metadata = the request's ASCII metadata). Without replies the call
/// returns as soon as the broker confirmed the publish, with an empty
/// message of the method's output type: the call is queued, not done.
/// With replies ([`QueueChannel::with_replies`]) it returns the server's
/// response. A failed publish is `UNAVAILABLE`; no reply in time is
/// `DEADLINE_EXCEEDED` (the call may still run). Streaming methods are not
/// supported (`UNIMPLEMENTED` when the body is not one message).
#[derive(Clone)]
pub struct QueueChannel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for QueueChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueChannel")
            .field("queue", &self.inner.queue)
            .field("reply_queue", &self.reply_queue())
            .finish_non_exhaustive()
    }
}

impl QueueChannel {
    /// Fire-and-forget calls to `queue`.
    pub fn new(adapter: Arc<dyn QueueAdapter>, queue: impl Into<String>) -> Self {
        QueueChannel {
            inner: Arc::new(Inner {
                adapter,
                queue: queue.into(),
                originator: "ojs-grpc-client".into(),
                replies: None,
            }),
        }
    }

    /// Request/response calls to `queue`: opens this channel's own reply
    /// queue (`{prefix}{uuid}`) and listens on it until [`close`](Self::close)
    /// or the last clone is dropped.
    pub async fn with_replies(
        adapter: Arc<dyn QueueAdapter>,
        queue: impl Into<String>,
        options: ReplyOptions,
    ) -> Result<Self> {
        let owned = options.queue.is_none();
        let reply_queue = match &options.queue {
            Some(q) => q.clone(),
            None => format!("{}{}", options.prefix, uuid::Uuid::new_v4().simple()),
        };
        if options.prefix.is_empty() || !reply_queue.starts_with(&options.prefix) {
            return Err(Error::InvalidReplyQueue {
                queue: reply_queue,
                reason: format!(
                    "must start with a non-empty prefix ({:?}); servers reply only to queues under theirs",
                    options.prefix
                ),
            });
        }
        if owned {
            adapter.open_reply_queue(&reply_queue).await?;
        } else {
            adapter.prepare(&reply_queue).await?;
        }
        let mut consumer_options = options.consumer.clone();
        if consumer_options.group.is_empty() {
            consumer_options.group = reply_queue.clone();
        }
        let consumer = match adapter.consumer(&reply_queue, consumer_options).await {
            Ok(c) => c,
            Err(e) => {
                if owned {
                    let _ = adapter.delete_reply_queue(&reply_queue).await;
                }
                return Err(e.into());
            }
        };
        let pending: Pending = Arc::default();
        let stats = Arc::new(ReplyStats::default());
        let (stop, stopped) = watch::channel(false);
        let listener = tokio::spawn(listen(consumer, pending.clone(), stats.clone(), stopped));
        Ok(QueueChannel {
            inner: Arc::new(Inner {
                adapter,
                queue: queue.into(),
                originator: "ojs-grpc-client".into(),
                replies: Some(Replies {
                    queue: reply_queue,
                    owned,
                    timeout: options.timeout,
                    pending,
                    stats,
                    stop,
                    listener: Mutex::new(Some(listener)),
                }),
            }),
        })
    }

    /// The originator of calls (service name + instance).
    pub fn with_originator(mut self, originator: impl Into<String>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.originator = originator.into();
        }
        self
    }

    /// The queue calls are published to.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// This channel's reply queue, when it waits for replies.
    pub fn reply_queue(&self) -> Option<&str> {
        self.inner.replies.as_ref().map(|r| r.queue.as_str())
    }

    /// Reply counters, when the channel waits for replies.
    pub fn reply_stats(&self) -> Option<Arc<ReplyStats>> {
        self.inner.replies.as_ref().map(|r| r.stats.clone())
    }

    /// Stops listening and removes the reply queue. Calls still waiting
    /// end with `UNAVAILABLE`.
    pub async fn close(&self) -> Result<()> {
        let Some(r) = &self.inner.replies else {
            return Ok(());
        };
        r.stop.send_replace(true);
        let listener = r.listener.lock().ok().and_then(|mut l| l.take());
        if let Some(listener) = listener {
            let _ = listener.await;
        }
        if let Ok(mut pending) = r.pending.lock() {
            pending.clear();
        }
        if r.owned {
            self.inner.adapter.delete_reply_queue(&r.queue).await?;
        }
        Ok(())
    }
}

/// Delivers replies to the calls waiting for them, until stopped.
async fn listen(
    mut consumer: Box<dyn ojs_queue::Consumer>,
    pending: Pending,
    stats: Arc<ReplyStats>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    loop {
        if *stopped.borrow() {
            break;
        }
        let batch = tokio::select! {
            b = consumer.receive(64, Duration::from_millis(500)) => b,
            _ = stopped.changed() => break,
        };
        let deliveries = match batch {
            Ok(d) => {
                failures = 0;
                d
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(error = %e, "receiving replies failed; retrying");
                tokio::time::sleep(ojs_queue::backoff::reconnect_delay(
                    failures,
                    Duration::from_secs(10),
                ))
                .await;
                continue;
            }
        };
        for d in deliveries {
            let reply = match d.decode(Some(Encoding::GrpcqProto)) {
                Ok(ojs_grpcq::Incoming::Call(m)) => Some(m.to_message()),
                _ => None,
            };
            match reply {
                Some(m) => {
                    let waiting = m
                        .metadata
                        .get(CORRELATION_ID)
                        .and_then(|id| pending.lock().ok()?.remove(id));
                    let delivered = waiting.is_some_and(|tx| tx.send(m).is_ok());
                    let counter = if delivered {
                        &stats.matched
                    } else {
                        &stats.unmatched
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    stats.malformed.fetch_add(1, Ordering::Relaxed);
                }
            }
            // A reply is settled once handed over: at-least-once ends here,
            // a redelivered copy finds nobody waiting and is ignored.
            if let Err(e) = d.ack().await {
                tracing::debug!(error = %e, "acking a reply failed");
            }
        }
    }
    if let Err(e) = consumer.close().await {
        tracing::debug!(error = %e, "closing the reply consumer failed");
    }
}

impl Service<http::Request<tonic::body::Body>> for QueueChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, std::result::Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            Ok(match inner.call(request).await {
                Ok(body) => ok_response(body),
                Err(status) => status_response(&status),
            })
        })
    }
}

impl Inner {
    async fn call(
        &self,
        request: http::Request<tonic::body::Body>,
    ) -> std::result::Result<Bytes, Status> {
        let (parts, body) = request.into_parts();
        let (topic, action) = parts
            .uri
            .path()
            .strip_prefix('/')
            .and_then(|p| p.split_once('/'))
            .filter(|(t, a)| !t.is_empty() && !a.is_empty() && !a.contains('/'))
            .ok_or_else(|| {
                Status::unimplemented(format!("{} is not a gRPC method path", parts.uri))
            })?;
        let body = body
            .collect()
            .await
            .map_err(|e| Status::internal(format!("request body: {e}")))?
            .to_bytes();
        let payload = unframe(&body).map_err(|e| Status::unimplemented(e.to_string()))?;
        let message_id = uuid::Uuid::now_v7().to_string();
        let mut metadata = metadata_of(&parts.headers);
        let now = chrono::Utc::now().timestamp_millis();
        let waiting = match &self.replies {
            Some(r) => {
                let timeout = parts
                    .headers
                    .get("grpc-timeout")
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_timeout)
                    .map_or(r.timeout, |t| t.min(r.timeout));
                metadata.insert(REPLY_TO.into(), r.queue.clone());
                metadata.insert(CORRELATION_ID.into(), message_id.clone());
                let deadline =
                    now.saturating_add(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX));
                metadata.insert(DEADLINE.into(), deadline.to_string());
                let (tx, rx) = oneshot::channel();
                r.pending
                    .lock()
                    .map_err(|_| Status::internal("reply table poisoned"))?
                    .insert(message_id.clone(), tx);
                Some((r, rx, timeout))
            }
            None => None,
        };
        let call = grpcq::Message {
            originator: self.originator.clone(),
            topic: topic.to_owned(),
            action: action.to_owned(),
            payload: payload.to_vec(),
            message_id: message_id.clone(),
            timestamp_ms: now,
            metadata,
        };
        let published = self
            .adapter
            .publish(&self.queue, vec![ojs_grpcq::outgoing(&call)])
            .await;
        let forget = |r: &Replies| {
            if let Ok(mut p) = r.pending.lock() {
                p.remove(&message_id);
            }
        };
        if let Err(e) = published {
            if let Some((r, _, _)) = &waiting {
                forget(r);
            }
            return Err(Status::unavailable(format!(
                "publishing the call to {:?} failed: {e}",
                self.queue
            )));
        }
        let Some((r, rx, timeout)) = waiting else {
            // Fire-and-forget: an empty message of the output type.
            return Ok(Bytes::new());
        };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => reply_result(reply),
            Ok(Err(_)) => Err(Status::unavailable(
                "the channel was closed while the call waited",
            )),
            Err(_) => {
                forget(r);
                r.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                Err(Status::deadline_exceeded(format!(
                    "no reply within {} ms; the call was queued and may still run",
                    timeout.as_millis()
                )))
            }
        }
    }
}

/// The response a reply carries.
fn reply_result(reply: grpcq::Message) -> std::result::Result<Bytes, Status> {
    let code = reply
        .metadata
        .get(REPLY_STATUS)
        .and_then(|c| c.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from);
    if code == Code::Ok {
        return Ok(Bytes::from(reply.payload));
    }
    let message = reply
        .metadata
        .get(REPLY_MESSAGE)
        .cloned()
        .unwrap_or_default();
    Err(Status::new(code, message))
}

/// The request's metadata that travels with the call: ASCII values of
/// custom headers (HTTP/2 and gRPC protocol headers stay behind).
fn metadata_of(headers: &HeaderMap) -> BTreeMap<String, String> {
    const PROTOCOL: [&str; 7] = [
        "content-type",
        "te",
        "user-agent",
        "grpc-timeout",
        "grpc-encoding",
        "grpc-accept-encoding",
        "grpc-message-type",
    ];
    headers
        .iter()
        .filter(|(name, _)| !PROTOCOL.contains(&name.as_str()))
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect()
}

fn grpc_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers
}

fn ok_response(body: Bytes) -> http::Response<tonic::body::Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = futures::stream::iter([
        Ok::<_, Infallible>(http_body::Frame::data(frame(&body))),
        Ok(http_body::Frame::trailers(trailers)),
    ]);
    let mut response = http::Response::new(tonic::body::Body::new(StreamBody::new(frames)));
    *response.headers_mut() = grpc_headers();
    response
}

/// A trailers-only response: the status in the headers, no body.
fn status_response(status: &Status) -> http::Response<tonic::body::Body> {
    let mut headers = grpc_headers();
    if status.add_header(&mut headers).is_err() {
        headers.insert("grpc-status", HeaderValue::from_static("13"));
    }
    let mut response = http::Response::new(tonic::body::Body::empty());
    *response.headers_mut() = headers;
    response
}
