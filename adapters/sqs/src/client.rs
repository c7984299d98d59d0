//! The SQS client and the errors it reports as ours: which are the
//! queue's state (retry) and which refuse what a message carries.

use aws_sdk_sqs::Client;
use ojs_queue::{BrokerErrorKind, Error};

use crate::SqsConfig;

/// An aws-sdk-sqs client for these settings (region, endpoint, credentials
/// from the standard chain): the one the adapter uses, and the one tools and
/// benchmarks need to talk to the same server directly.
pub async fn sdk_client(config: &SqsConfig) -> Client {
    let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(config.region.clone()))
        .load()
        .await;
    let mut b = aws_sdk_sqs::config::Builder::from(&shared).timeout_config(
        aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
            .connect_timeout(config.call_timeout())
            .operation_attempt_timeout(config.call_timeout())
            .build(),
    );
    if let Some(ep) = &config.endpoint {
        b = b.endpoint_url(ep);
    }
    Client::from_conf(b.build())
}

pub(crate) fn sqs_error(e: impl std::fmt::Display) -> Error {
    Error::broker("sqs", e.to_string(), true)
}

/// A failed SQS call: no answer (dispatch failure, timeout) is
/// [`Error::Unreachable`], an answer is what SQS said.
pub(crate) fn call_error<E, R>(e: aws_sdk_sqs::error::SdkError<E, R>) -> Error
where
    E: std::error::Error + aws_sdk_sqs::error::ProvideErrorMetadata + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
    let unreachable = matches!(e, SdkError::DispatchFailure(_) | SdkError::TimeoutError(_));
    let message = aws_sdk_sqs::error::DisplayErrorContext(&e).to_string();
    if unreachable {
        Error::Unreachable {
            broker: "sqs",
            message,
        }
    } else {
        let kind = error_kind(e.code());
        Error::broker("sqs", message, true)
            .with_broker_kind(kind)
            .with_source(e)
    }
}

/// The kind of an SQS error code.
pub(crate) fn error_kind(code: Option<&str>) -> BrokerErrorKind {
    match code {
        Some("AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist") => {
            BrokerErrorKind::NotFound
        }
        Some(
            "AccessDenied"
            | "AccessDeniedException"
            | "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "SignatureDoesNotMatch"
            | "KmsAccessDenied",
        ) => BrokerErrorKind::AccessDenied,
        Some("QueueAlreadyExists" | "QueueNameExists") => BrokerErrorKind::Conflict,
        Some(code) if refuses_the_content(code) => BrokerErrorKind::Rejected,
        Some(
            "ThrottlingException"
            | "RequestThrottled"
            | "ServiceUnavailable"
            | "InternalError"
            | "InternalFailure"
            | "OverLimit"
            | "KmsThrottled",
        ) => BrokerErrorKind::Unavailable,
        _ => BrokerErrorKind::Other,
    }
}

/// Error codes with which SQS refuses what a request carries (a message, an
/// attribute, the size of a batch), not the caller or the queue.
pub(crate) fn refuses_the_content(code: &str) -> bool {
    matches!(
        code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code),
        "InvalidMessageContents"
            | "MessageTooLong"
            | "BatchRequestTooLong"
            | "InvalidParameterValue"
            | "InvalidAttributeName"
            | "InvalidAttributeValue"
    )
}
