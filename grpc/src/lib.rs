//! Existing tonic services over queues.
//!
//! grpcq's promise is that an ordinary gRPC service becomes a
//! queue-dispatched service without rewriting it. This crate keeps it for
//! tonic, on every [`QueueAdapter`](ojs_queue::QueueAdapter):
//!
//! - **Serve** ([`QueueServer`]): a worker serves any tonic-generated server
//!   from a queue. A grpcq call (topic = fully-qualified service name,
//!   action = method) becomes a unary gRPC request `/{topic}/{action}` whose
//!   body is the gRPC-framed payload and whose metadata is the call's
//!   metadata (`traceparent` included); the response status decides the
//!   outcome (see [`status`]).
//! - **Call** ([`QueueChannel`]): a tonic-generated client works unchanged on
//!   a queue (`MyServiceClient::new(channel)`). Each unary call is published
//!   as a grpcq call. Without a reply queue the call returns once the broker
//!   confirmed it, with an empty message of the method's output type
//!   (fire-and-forget).
//! - **Request/response** ([`QueueChannel::with_replies`]): the channel owns a
//!   reply queue; each call carries `reply-to` and `correlation-id` in its
//!   metadata, the server publishes the gRPC response (status, message,
//!   body) there, and the call resolves with it, or with
//!   `DEADLINE_EXCEEDED` when no reply came in time (never a hang).
//!
//! At least once, end to end: a call can run more than once (a worker
//! killed after executing and before settling runs it again); a duplicated
//! reply is ignored; a lost reply is a timeout for the caller. Services
//! whose methods are not idempotent should deduplicate on the grpcq message
//! id, passed in the `grpcq-message-id` request header.

#![forbid(unsafe_code)]

mod channel;
pub mod frame;
mod serve;
pub mod status;

pub use channel::{QueueChannel, ReplyOptions, ReplyStats};
pub use serve::QueueServer;

/// Metadata key of the queue a server publishes its reply to.
pub const REPLY_TO: &str = "reply-to";
/// Metadata key pairing a reply with its call (the call's message id).
pub const CORRELATION_ID: &str = "correlation-id";
/// Metadata key of the caller's deadline, Unix milliseconds. A call still
/// queued past it is not run (`deadline_expired`).
pub const DEADLINE: &str = "grpc-deadline-unix-ms";
/// Request header through which a served method sees the grpcq message id
/// (stable across redeliveries: the key to deduplicate on).
pub const MESSAGE_ID_HEADER: &str = "grpcq-message-id";
/// Reply metadata: the gRPC status code, as a decimal number.
pub const REPLY_STATUS: &str = "grpc-status";
/// Reply metadata: the gRPC status message.
pub const REPLY_MESSAGE: &str = "grpc-message";
/// Prefix every reply queue name has; a server publishes replies only to
/// queues under it, so a message cannot aim a reply at any other queue.
pub const DEFAULT_REPLY_PREFIX: &str = "grpcq-reply-";

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The queue side failed (publish, consume, reply queue).
    #[error(transparent)]
    Queue(#[from] ojs_queue::Error),
    /// A reply-queue setting is unusable.
    #[error("invalid reply queue {queue:?}: {reason}")]
    InvalidReplyQueue {
        /// The queue name.
        queue: String,
        /// Why.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
