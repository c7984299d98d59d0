//! What a gRPC status means for a queued call.
//!
//! | status | outcome |
//! |---|---|
//! | `OK` | ack (and the response is the reply) |
//! | `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED`, `ABORTED`, `INTERNAL`, `UNKNOWN` (a panic is `INTERNAL`) | retried per the retry policy; dead-lettered when attempts run out |
//! | `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `UNAUTHENTICATED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`, `CANCELLED`, `DATA_LOSS` | dead-lettered at once |
//!
//! A dead letter's error type is `grpc.<CODE>` (e.g. `grpc.INVALID_ARGUMENT`)
//! and its message the status message, so `non_retryable_errors` in a
//! retry policy can name codes too.

use tonic::Code;

/// The canonical upper-case name of `code` (`INVALID_ARGUMENT`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The dead-letter error type of a failed status: `grpc.<CODE>`.
pub fn error_type(code: Code) -> String {
    format!("grpc.{}", code_name(code))
}

/// Whether a call that ended with `code` may succeed if run again.
pub fn is_retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Internal
            | Code::Unknown
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_name_and_class() {
        for n in 0..17 {
            let code = Code::from(n);
            let name = code_name(code);
            assert!(!name.is_empty() && name.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
            assert_eq!(error_type(code), format!("grpc.{name}"));
        }
        assert!(is_retryable(Code::Unavailable));
        assert!(is_retryable(Code::ResourceExhausted));
        assert!(is_retryable(Code::DeadlineExceeded));
        assert!(!is_retryable(Code::InvalidArgument));
        assert!(!is_retryable(Code::Unimplemented));
        assert!(!is_retryable(Code::Ok));
    }
}
