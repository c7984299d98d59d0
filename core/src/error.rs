//! The one error type of `ojs-core`: what can be wrong with an envelope or
//! its bytes.

/// Result alias used throughout `ojs-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the envelope codecs.
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
        }
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
}
