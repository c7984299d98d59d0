//! The one error type of `ojs-queue`: what can go wrong publishing,
//! consuming and settling, and an envelope's own error where one was
//! encoded or decoded on the way.

use std::time::Duration;

/// A client library's error kept as the source of [`Error::Broker`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What kind of broker failure an [`Error::Broker`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BrokerErrorKind {
    /// The queue, topic or exchange does not exist.
    NotFound,
    /// The credentials may not do this.
    AccessDenied,
    /// Something exists with other settings (AMQP 406 PRECONDITION_FAILED,
    /// a topic or queue that exists already).
    Conflict,
    /// The broker would not take this message (too large, invalid, nacked).
    Rejected,
    /// The broker cannot serve right now (alarm, leader election,
    /// throttling, a full queue or disk, a closed channel).
    Unavailable,
    /// Anything else.
    Other,
}

/// Result alias used throughout `ojs-queue` and the adapters.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the queue contract and the adapters.
///
/// Variants are named by what went wrong so that callers (the daemon's
/// dead-letter path in particular) can turn them into a reason without parsing
/// strings.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An envelope or its bytes (encoding a job to publish, decoding one
    /// received).
    #[error(transparent)]
    Codec(#[from] ojs_core::Error),
    /// A message larger than the destination accepts; nothing was sent.
    #[error("payload too large: {size} bytes encoded, limit is {limit} bytes")]
    PayloadTooLarge {
        /// Encoded size of the message.
        size: usize,
        /// The destination's limit.
        limit: usize,
    },
    /// Some messages of a batch were not published; each is listed and
    /// handed back. Messages not listed were accepted.
    #[error("{0}")]
    Publish(crate::PublishFailure),
    /// The delivery's lease ended (visibility timeout) and the message may
    /// have gone to another consumer; the ack/nack did not apply.
    #[error("delivery expired before it was settled; the message will be delivered again")]
    DeliveryExpired,
    /// A delivery was acknowledged (acked or nacked) a second time.
    #[error("delivery was already {0}")]
    AlreadyAcknowledged(&'static str),
    /// A geo-pinned job names a region the federation does not know.
    #[error("region {0:?} is not in the federation registry")]
    UnknownRegion(String),
    /// A region cannot take work right now (circuit open, broker down).
    #[error("region {region:?} is temporarily unavailable: {reason}")]
    RegionUnavailable {
        /// The region (`*` when none is available).
        region: String,
        /// Why.
        reason: String,
    },
    /// The adapter or consumer was closed.
    #[error("adapter is closed")]
    Closed,
    /// An endpoint URL or adapter setting that cannot work.
    #[error("invalid configuration `{field}`: {reason}")]
    InvalidConfig {
        /// The field or URL part to change.
        field: String,
        /// What to change.
        reason: String,
    },
    /// The broker refused or failed an operation.
    #[error("{broker} error: {message}")]
    Broker {
        /// Which adapter (`kafka`, `rabbitmq`, `sqs`, `local`, `memory`).
        broker: &'static str,
        /// What kind of failure: match on this, never on `message`.
        kind: BrokerErrorKind,
        /// What the broker said, for people (it includes the source's text).
        message: String,
        /// Whether retrying the same call may succeed.
        retryable: bool,
        /// The client library's own error (lapin, rdkafka, aws-sdk,
        /// rusqlite), for callers that want its details.
        #[source]
        source: Option<BoxError>,
    },
    /// The broker could not be reached at all (connection refused or reset,
    /// DNS, TLS handshake, no answer): nothing about the request was judged.
    #[error("{broker} unreachable: {message}")]
    Unreachable {
        /// Which adapter.
        broker: &'static str,
        /// What failed, credentials removed.
        message: String,
    },
    /// An operation did not finish in time.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// I/O on a stream or file.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// A broker error helper for adapter crates (kind `Other`, no source;
    /// see [`Error::with_broker_kind`] and [`Error::with_source`]).
    pub fn broker(broker: &'static str, message: impl Into<String>, retryable: bool) -> Self {
        Error::Broker {
            broker,
            kind: BrokerErrorKind::Other,
            message: message.into(),
            retryable,
            source: None,
        }
    }

    /// The same broker error with its kind set (other errors unchanged).
    #[must_use]
    pub fn with_broker_kind(mut self, new: BrokerErrorKind) -> Self {
        if let Error::Broker { kind, .. } = &mut self {
            *kind = new;
        }
        self
    }

    /// The same broker error with the client library's error as its
    /// source (other errors unchanged).
    #[must_use]
    pub fn with_source(mut self, error: impl Into<BoxError>) -> Self {
        if let Error::Broker { source, .. } = &mut self {
            *source = Some(error.into());
        }
        self
    }

    /// The kind of a broker error; `None` for other errors.
    pub fn broker_kind(&self) -> Option<BrokerErrorKind> {
        match self {
            Error::Broker { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// A short, stable name for the kind of error: used as the dead-letter
    /// reason type and as a metrics label.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Codec(e) => e.kind(),
            Error::PayloadTooLarge { .. } => "payload_too_large",
            Error::AlreadyAcknowledged(_) => "already_acknowledged",
            Error::Publish(_) => "publish_failed",
            Error::DeliveryExpired => "delivery_expired",
            Error::UnknownRegion(_) => "unknown_region",
            Error::RegionUnavailable { .. } => "region_unavailable",
            Error::Closed => "closed",
            Error::InvalidConfig { .. } => "invalid_config",
            Error::Broker { .. } => "broker",
            Error::Unreachable { .. } => "unreachable",
            Error::Timeout(_) => "timeout",
            Error::Io(_) => "io",
        }
    }

    /// Whether the broker was not there (or did not answer) rather than
    /// there and refusing: worth waiting for at start.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            Error::Unreachable { .. } | Error::Timeout(_) | Error::Io(_)
        )
    }

    /// Whether the input parsed but breaks a rule of the OJS schema (see
    /// [`ojs_core::Error::is_schema_violation`]).
    pub fn is_schema_violation(&self) -> bool {
        matches!(self, Error::Codec(e) if e.is_schema_violation())
    }

    /// Whether the same operation may succeed if tried again later.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Broker { retryable, .. } => *retryable,
            Error::Timeout(_)
            | Error::Io(_)
            | Error::Unreachable { .. }
            | Error::RegionUnavailable { .. } => true,
            _ => false,
        }
    }
}
