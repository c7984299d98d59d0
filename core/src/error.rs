//! The one error type of `ojs-core`.

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

/// Result alias used throughout `ojs-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the envelope codecs and the adapter contract.
///
/// Variants are named by what went wrong so that callers (the daemon's
/// dead-letter path in particular) can turn them into a reason without parsing
/// strings.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Protobuf bytes that do not parse: truncated, wrong wire type, bad varint.
    #[error("malformed protobuf at byte {offset}: {reason}")]
    MalformedProtobuf {
        /// Byte offset in the input where parsing failed.
        offset: usize,
        /// What was wrong there.
        reason: String,
    },
    /// Text that is not JSON, or JSON of the wrong shape.
    #[error("invalid JSON{}: {reason}", at_line(*.line))]
    InvalidJson {
        /// 1-based line of the input, when known.
        line: Option<usize>,
        /// What was wrong.
        reason: String,
    },
    /// A required attribute (`specversion`, `id`, `type`, `args`) is absent.
    #[error("missing required attribute `{0}`")]
    MissingAttribute(&'static str),
    /// An attribute is present but its value is not allowed.
    #[error("invalid attribute `{attribute}`: {reason}")]
    InvalidAttribute {
        /// Path of the attribute, e.g. `retry.max_attempts`.
        attribute: String,
        /// Why the value is rejected.
        reason: String,
    },
    /// `specversion` names a version this build does not speak.
    #[error("invalid attribute `specversion`: {0:?} is not supported (schema: const \"1.0\"; \"1.0.0-rc.1\" is read too)")]
    UnsupportedSpecVersion(String),
    /// A JSON number that a double cannot represent exactly.
    #[error("number at `{path}` ({value}) is beyond ±2^53 and cannot be carried exactly; send it as a string")]
    NumberOutOfRange {
        /// JSON path of the number, e.g. `args[2].amount`.
        path: String,
        /// The number as written.
        value: String,
    },
    /// A non-finite double (NaN, ±inf) that JSON cannot carry.
    #[error("number at `{path}` is not finite and has no JSON form")]
    NonFiniteNumber {
        /// Path of the value.
        path: String,
    },
    /// Values nested deeper than [`crate::MAX_VALUE_DEPTH`].
    #[error("value at `{path}` is nested deeper than {limit} levels")]
    NestingTooDeep {
        /// Path where the limit was crossed.
        path: String,
        /// The limit.
        limit: usize,
    },
    /// A JSON attribute that has no protobuf field, so converting would lose it.
    #[error("attribute `{0}` has no protobuf field; move it into `meta` or `extensions` to carry it as protobuf")]
    Unrepresentable(String),
    /// A content type this build cannot decode.
    #[error("unknown content type {0:?}")]
    UnknownContentType(String),
    /// Content negotiation found nothing acceptable.
    #[error("none of the accepted media types is supported: {0:?}")]
    NotAcceptable(String),
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
    Publish(crate::adapter::PublishFailure),
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

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" on line {l}")).unwrap_or_default()
}

impl Error {
    /// [`Error::MalformedProtobuf`] at `offset`.
    pub fn malformed(offset: usize, reason: impl Into<String>) -> Self {
        Error::MalformedProtobuf {
            offset,
            reason: reason.into(),
        }
    }

    /// [`Error::InvalidAttribute`] naming the attribute.
    pub fn invalid(attribute: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidAttribute {
            attribute: attribute.into(),
            reason: reason.into(),
        }
    }

    /// [`Error::InvalidJson`] without a line.
    pub fn json(reason: impl Into<String>) -> Self {
        Error::InvalidJson {
            line: None,
            reason: reason.into(),
        }
    }

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
            Error::MalformedProtobuf { .. } => "malformed_protobuf",
            Error::InvalidJson { .. } => "invalid_json",
            Error::MissingAttribute(_) => "missing_attribute",
            Error::InvalidAttribute { .. } => "invalid_attribute",
            Error::UnsupportedSpecVersion(_) => "unsupported_specversion",
            Error::NumberOutOfRange { .. } => "number_out_of_range",
            Error::NonFiniteNumber { .. } => "non_finite_number",
            Error::NestingTooDeep { .. } => "nesting_too_deep",
            Error::Unrepresentable(_) => "unrepresentable",
            Error::UnknownContentType(_) => "unknown_content_type",
            Error::NotAcceptable(_) => "not_acceptable",
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

    /// Whether the input parsed but breaks a rule of the OJS schema (a
    /// missing or invalid attribute, an unsupported specversion), as
    /// opposed to bytes that do not parse at all.
    pub fn is_schema_violation(&self) -> bool {
        matches!(
            self,
            Error::MissingAttribute(_)
                | Error::InvalidAttribute { .. }
                | Error::UnsupportedSpecVersion(_)
        )
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
