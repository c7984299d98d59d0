//! What a request can fail with, under the OJS error codes. Nothing here
//! is of HTTP or gRPC: each binding maps an error to its own status
//! (`http::status_of`, `grpc::status`).

use serde_json::{json, Value};

use crate::store::StoreError;

/// The OJS error codes (the `code` of an error body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The body does not parse.
    InvalidPayload,
    /// The request breaks a rule of the binding or the schemas.
    InvalidRequest,
    /// A job, queue or other resource that does not exist.
    NotFound,
    /// A job id that is already stored.
    Duplicate,
    /// A state that does not allow what was asked.
    Conflict,
    /// No accepted media type is served.
    NotAcceptable,
    /// A feature or version this server does not serve.
    Unsupported,
    /// A body, batch or job over its limit.
    PayloadTooLarge,
    /// No valid token.
    Unauthenticated,
    /// The server is at a limit; retry shortly.
    RateLimited,
    /// The token does not allow the operation.
    PermissionDenied,
    /// A backend (broker, store) cannot be reached now.
    BackendUnavailable,
    /// A backend refused or failed.
    BackendError,
    /// Stored data this server cannot read.
    InternalError,
    /// A workflow request that breaks a rule of workflows.
    InvalidWorkflow,
}

impl ErrorCode {
    /// The code as the bindings write it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidPayload => "invalid_payload",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Duplicate => "duplicate",
            ErrorCode::Conflict => "conflict",
            ErrorCode::NotAcceptable => "not_acceptable",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::BackendUnavailable => "backend_unavailable",
            ErrorCode::BackendError => "backend_error",
            ErrorCode::InternalError => "internal_error",
            ErrorCode::InvalidWorkflow => "invalid_workflow",
        }
    }

    /// A failure of the server or its backends (not of the request).
    pub fn is_server_side(self) -> bool {
        matches!(
            self,
            ErrorCode::BackendUnavailable | ErrorCode::BackendError | ErrorCode::InternalError
        )
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request the API refuses or cannot carry out. Each variant has one OJS
/// error code ([`ApiError::code`]).
/// Messages name what was wrong in the request; they never carry a job's
/// content beyond the offending attribute's own rule.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body does not parse (not JSON, not protobuf, empty).
    #[error("the body is not a valid {encoding} request: {reason}")]
    InvalidPayload {
        /// What the body was read as.
        encoding: &'static str,
        /// Why it does not parse.
        reason: String,
    },
    /// The request parses but breaks a rule of the binding or the schemas.
    #[error("{message}")]
    InvalidRequest {
        /// The offending attribute, e.g. `options.priority`.
        attribute: Option<String>,
        /// What is wrong with it.
        message: String,
        /// The job's place in a batch.
        index: Option<usize>,
    },
    /// A job, queue or other resource that does not exist.
    #[error("{resource_type} {resource_id:?} not found")]
    NotFound {
        /// `job`, `queue`, `route`.
        resource_type: &'static str,
        /// Its id or name.
        resource_id: String,
    },
    /// A client-given id that is already stored.
    #[error("a job with id {id} already exists")]
    Duplicate {
        /// The id.
        id: String,
    },
    /// A job whose unique key a stored job holds, under a policy that
    /// rejects duplicates (`on_conflict: reject`).
    #[error("a job with the same unique key exists: {existing_id} ({existing_state})")]
    UniqueConflict {
        /// The job's position in a batch.
        index: Option<usize>,
        /// The stored job holding the key.
        existing_id: String,
        /// Its state.
        existing_state: &'static str,
        /// The key.
        key: String,
    },
    /// A workflow request that breaks a rule of workflows (no steps, a
    /// cycle, a step that is no valid job, …).
    #[error("{path}: {message}")]
    InvalidWorkflow {
        /// Where in the request (`steps[1].depends_on`).
        path: String,
        /// What is wrong there.
        message: String,
    },
    /// A workflow that has finished cannot be cancelled.
    #[error("workflow {workflow_id} is {state}; only a running workflow is cancelled")]
    WorkflowFinished {
        /// The workflow.
        workflow_id: String,
        /// Its state.
        state: &'static str,
    },
    /// A live event stream past `[api] max_event_streams`.
    #[error("the server has {limit} event streams open ([api] max_event_streams); retry later or poll /ojs/v1/events")]
    StreamLimit {
        /// The limit.
        limit: usize,
    },
    /// The active jobs this process holds take `[api] max_held_bytes`, and
    /// no ACK or NACK made room within the FETCH's wait.
    #[error("the active jobs this process holds take {limit} bytes ([api] max_held_bytes); ACK or NACK some, then FETCH again")]
    HeldLimit {
        /// The limit.
        limit: usize,
    },
    /// A new cron job past `[api] max_crons`.
    #[error("the server keeps at most {limit} cron jobs ([api] max_crons); delete one first")]
    CronLimit {
        /// The limit.
        limit: usize,
    },
    /// A transition the job's state does not allow.
    #[error("job {job_id} is {current_state}; {operation} needs it {expected}")]
    Conflict {
        /// The job.
        job_id: String,
        /// Its state now.
        current_state: String,
        /// What was asked (`cancel`).
        operation: &'static str,
        /// The states the operation needs, in words.
        expected: &'static str,
    },
    /// A worker directive the worker's state does not allow (`terminate`
    /// is final), or the removal of a worker that is not stale.
    #[error("worker {worker_id} is {current_state}; cannot {asked}")]
    WorkerConflict {
        /// The worker.
        worker_id: String,
        /// What it is told now.
        current_state: &'static str,
        /// What was asked.
        asked: &'static str,
    },
    /// A queue outside `[api] queues`.
    #[error("queue {queue:?} is not served here (not in [api] queues)")]
    QueueNotServed {
        /// The queue.
        queue: String,
    },
    /// `Accept` names no encoding this server writes.
    #[error("none of the accepted media types is served: {accept:?}; ask for application/openjobspec+json or application/openjobspec+proto")]
    NotAcceptable {
        /// The header as sent.
        accept: String,
    },
    /// A request body in a media type this server does not read.
    #[error("unsupported content type {content_type:?}; send application/openjobspec+json, application/json or application/openjobspec+proto")]
    UnsupportedContentType {
        /// The header as sent.
        content_type: String,
    },
    /// The request body did not arrive in time (a client that stalls
    /// mid-body cannot hold a connection).
    #[error("the request body did not arrive within {seconds} s")]
    BodyTimeout {
        /// The limit.
        seconds: u64,
    },
    /// An `OJS-Version` this server does not speak.
    #[error("OJS-Version {0:?} is not supported; this server speaks 1.0")]
    UnsupportedVersion(String),
    /// A body larger than `max_body_bytes`.
    #[error("the body has more than {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// A batch with more jobs than `max_batch_jobs`.
    #[error("the batch has {count} jobs; at most {limit} are taken in one request")]
    BatchTooLarge {
        /// Jobs sent.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// One encoded job larger than the adapter carries.
    #[error("job {index} is {size} bytes encoded; the queue's broker takes at most {limit}")]
    JobTooLarge {
        /// Its place in the request.
        index: usize,
        /// Encoded size.
        size: usize,
        /// The adapter's limit.
        limit: usize,
    },
    /// Request bodies in flight fill `[api] max_body_bytes_in_flight`: the
    /// request was refused before its body was read.
    #[error("the server is reading as many request bodies as it takes at once; retry shortly")]
    Busy,
    /// No valid bearer token.
    #[error("a valid bearer token is required")]
    Unauthenticated,
    /// A token that does not allow this operation on this queue.
    #[error("the token does not allow {operation} on {scope}")]
    PermissionDenied {
        /// `push`, `read`, `admin`.
        operation: &'static str,
        /// The queue or `this server`.
        scope: String,
    },
    /// An endpoint of an OJS feature this server does not serve (yet):
    /// the binding's 422 `unsupported`, naming the feature.
    #[error("{feature} are not supported by this server (see /ojs/manifest for what is)")]
    Unsupported {
        /// The feature, as a plural: `cron jobs`, `workflows`.
        feature: &'static str,
    },
    /// A path this binding does not have.
    #[error("no such endpoint: {method} {path}")]
    NoRoute {
        /// The method.
        method: String,
        /// The path.
        path: String,
    },
    /// A known path with a method it does not take.
    #[error("{path} takes {allowed}")]
    MethodNotAllowed {
        /// The path.
        path: String,
        /// The methods it takes.
        allowed: &'static str,
    },
    /// The broker did not confirm the job; nothing was stored. The
    /// broker's own words stay in the log: an HTTP client is not told the
    /// broker's address or account.
    #[error("the broker did not take the job; nothing was stored, retry later")]
    Broker {
        /// The adapter's error.
        #[source]
        source: ojs_queue::Error,
    },
    /// The queue's destination does not exist on the broker and this server
    /// creates none (`topology = "existing"`): the same request fails until
    /// whoever owns the topology creates it, so it is not retryable. The
    /// answer names the OJS queue, never the broker's address or account.
    #[error("queue {queue:?} does not exist on the broker, and this server creates none; nothing was stored")]
    QueueMissing {
        /// The OJS queue.
        queue: String,
        /// The adapter's error (for the log).
        #[source]
        source: ojs_queue::Error,
    },
    /// The broker refuses this server's credentials for the queue: not the
    /// client's fault, and not fixed by retrying.
    #[error("the broker refuses this server's access to queue {queue:?}; nothing was stored")]
    BrokerDenied {
        /// The OJS queue.
        queue: String,
        /// The adapter's error (for the log).
        #[source]
        source: ojs_queue::Error,
    },
    /// The job store failed (its detail stays in the log).
    #[error("the job store failed")]
    Store(#[from] StoreError),
}

/// Where a client reads what an error code means.
const DOCS_URL: &str = "https://github.com/ojs-bridge/ojs-bridge/blob/main/docs/api.md#errors";

impl ApiError {
    /// What a broker's refusal to take a job of `queue` is to the client:
    /// a missing destination or a refused account is the operator's to
    /// fix (not retryable); anything else may pass later.
    pub fn broker(queue: &str, source: ojs_queue::Error) -> Self {
        let kind = match &source {
            ojs_queue::Error::Publish(failure) => {
                failure.failed.first().and_then(|f| f.error.broker_kind())
            }
            other => other.broker_kind(),
        };
        match kind {
            Some(ojs_queue::BrokerErrorKind::NotFound) => ApiError::QueueMissing {
                queue: queue.to_owned(),
                source,
            },
            Some(ojs_queue::BrokerErrorKind::AccessDenied) => ApiError::BrokerDenied {
                queue: queue.to_owned(),
                source,
            },
            _ => ApiError::Broker { source },
        }
    }

    /// A validation error of one attribute.
    pub fn invalid(attribute: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            attribute: Some(attribute.into()),
            message: message.into(),
            index: None,
        }
    }

    /// The same error, placed at job `index` of a batch.
    pub fn at_index(self, i: usize) -> Self {
        match self {
            ApiError::InvalidRequest {
                attribute, message, ..
            } => ApiError::InvalidRequest {
                attribute,
                message: format!("jobs[{i}]: {message}"),
                index: Some(i),
            },
            other => other,
        }
    }

    /// The same error, its attribute placed under `prefix` (a job template
    /// inside a cron job: `job_template.options.priority`).
    pub fn under(self, prefix: &str) -> Self {
        match self {
            ApiError::InvalidRequest {
                attribute,
                message,
                index,
            } => ApiError::InvalidRequest {
                attribute: Some(match attribute.as_deref() {
                    None | Some("") => prefix.to_owned(),
                    Some(a) => format!("{prefix}.{a}"),
                }),
                message: format!("{prefix}: {message}"),
                index,
            },
            other => other,
        }
    }

    /// The OJS error code.
    pub fn code(&self) -> ErrorCode {
        use ErrorCode as C;
        match self {
            ApiError::InvalidPayload { .. } => C::InvalidPayload,
            ApiError::InvalidRequest { .. }
            | ApiError::UnsupportedContentType { .. }
            | ApiError::BodyTimeout { .. }
            | ApiError::NoRoute { .. }
            | ApiError::MethodNotAllowed { .. } => C::InvalidRequest,
            ApiError::NotFound { .. }
            | ApiError::QueueNotServed { .. }
            | ApiError::QueueMissing { .. } => C::NotFound,
            ApiError::Duplicate { .. } | ApiError::UniqueConflict { .. } => C::Duplicate,
            ApiError::Conflict { .. }
            | ApiError::WorkerConflict { .. }
            | ApiError::CronLimit { .. }
            | ApiError::WorkflowFinished { .. } => C::Conflict,
            ApiError::InvalidWorkflow { .. } => C::InvalidWorkflow,
            ApiError::NotAcceptable { .. } => C::NotAcceptable,
            ApiError::UnsupportedVersion(_) | ApiError::Unsupported { .. } => C::Unsupported,
            ApiError::BodyTooLarge { .. }
            | ApiError::BatchTooLarge { .. }
            | ApiError::JobTooLarge { .. } => C::PayloadTooLarge,
            ApiError::Unauthenticated => C::Unauthenticated,
            ApiError::Busy | ApiError::StreamLimit { .. } | ApiError::HeldLimit { .. } => {
                C::RateLimited
            }
            ApiError::PermissionDenied { .. } => C::PermissionDenied,
            ApiError::Broker { .. } => C::BackendUnavailable,
            ApiError::BrokerDenied { .. } => C::BackendError,
            ApiError::Store(e) if e.is_unavailable() => C::BackendUnavailable,
            ApiError::Store(e) if e.is_data_error() => C::InternalError,
            ApiError::Store(_) => C::BackendError,
        }
    }

    /// Whether the operator has something to fix (logged as a warning
    /// with the source's detail): a failure of the server or its
    /// backends, or a queue missing on the broker.
    pub fn needs_operator(&self) -> bool {
        self.code().is_server_side() || matches!(self, ApiError::QueueMissing { .. })
    }

    /// Whether the same request may succeed later.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            ApiError::Broker { .. }
                | ApiError::BodyTimeout { .. }
                | ApiError::Busy
                | ApiError::StreamLimit { .. }
                | ApiError::HeldLimit { .. }
        ) || matches!(self, ApiError::Store(e) if !e.is_data_error())
    }

    /// The binding's `details`, when the error has any.
    pub fn details(&self) -> Option<Value> {
        match self {
            ApiError::InvalidRequest {
                attribute, index, ..
            } => {
                let mut d = serde_json::Map::new();
                if let Some(a) = attribute {
                    d.insert("attribute".into(), json!(a));
                }
                if let Some(i) = index {
                    d.insert("index".into(), json!(i));
                }
                (!d.is_empty()).then_some(Value::Object(d))
            }
            ApiError::NotFound {
                resource_type,
                resource_id,
            } => Some(json!({"resource_type": resource_type, "resource_id": resource_id})),
            ApiError::QueueNotServed { queue } | ApiError::QueueMissing { queue, .. } => {
                Some(json!({"resource_type": "queue", "resource_id": queue}))
            }
            ApiError::Duplicate { id } => Some(json!({"existing_job_id": id})),
            ApiError::UniqueConflict {
                index,
                existing_id,
                existing_state,
                key,
            } => {
                // Both names of the key: the extension's and the binding's.
                let mut d = json!({
                    "existing_job_id": existing_id,
                    "existing_job_state": existing_state,
                    "uniqueness_key": key,
                    "unique_key": key,
                });
                if let Some(i) = index {
                    d["index"] = json!(i);
                }
                Some(d)
            }
            ApiError::Conflict {
                job_id,
                current_state,
                expected,
                ..
            } => Some(json!({
                "job_id": job_id,
                "current_state": current_state,
                "expected_state": expected,
            })),
            ApiError::WorkerConflict {
                worker_id,
                current_state,
                ..
            } => Some(json!({"worker_id": worker_id, "current_state": current_state})),
            ApiError::BodyTooLarge { limit } | ApiError::HeldLimit { limit } => {
                Some(json!({"limit_bytes": limit}))
            }
            ApiError::CronLimit { limit } | ApiError::StreamLimit { limit } => {
                Some(json!({"limit": limit}))
            }
            ApiError::InvalidWorkflow { path, message } => Some(json!({
                "attribute": path,
                "validation_errors": [{"path": path, "message": message}],
            })),
            ApiError::WorkflowFinished { workflow_id, state } => {
                Some(json!({"workflow_id": workflow_id, "current_state": state}))
            }
            ApiError::BatchTooLarge { count, limit } => {
                Some(json!({"count": count, "limit": limit}))
            }
            ApiError::JobTooLarge { index, size, limit } => {
                Some(json!({"index": index, "size_bytes": size, "limit_bytes": limit}))
            }
            _ => None,
        }
    }

    /// The binding's error body: `{"error": {code, message, retryable,
    /// details?, request_id, hint?, docs_url?}}`.
    pub fn body(&self, request_id: &str) -> Value {
        let mut error = json!({
            "code": self.code().as_str(),
            "message": self.to_string(),
            "retryable": self.retryable(),
            "request_id": request_id,
        });
        if let Some(d) = self.details() {
            error["details"] = d;
        }
        if let Some(hint) = self.hint() {
            error["hint"] = json!(hint);
            error["docs_url"] = json!(DOCS_URL);
        }
        json!({ "error": error })
    }

    fn hint(&self) -> Option<&'static str> {
        Some(match self {
            ApiError::NotFound { .. } => {
                "check the id; finished jobs are kept for [api] retention and then removed"
            }
            ApiError::QueueNotServed { .. } => "ask the operator to add the queue to [api] queues",
            ApiError::QueueMissing { .. } => {
                "ask the operator to create the queue on the broker (docs/adapters) or use another queue"
            }
            ApiError::BrokerDenied { .. } => {
                "ask the operator to grant the server's broker account access to the queue"
            }
            ApiError::NoRoute { .. } => {
                "the OJS HTTP binding lives under /ojs/v1 and /ojs/manifest"
            }
            ApiError::Unauthenticated => "send Authorization: Bearer <token>",
            ApiError::Broker { .. } => "the broker is unreachable or refused the job; retry later",
            _ => return None,
        })
    }
}

/// A store failure of a transition as the binding answers it: an unknown
/// job is 404, a job in the wrong state 409 `conflict` naming `operation`
/// and the states it needs, anything else the store's own failure.
pub fn store_error(e: StoreError, operation: &'static str, expected: &'static str) -> ApiError {
    match e {
        StoreError::NotFound(id) => ApiError::NotFound {
            resource_type: "job",
            resource_id: id,
        },
        StoreError::WrongState { id, current } => ApiError::Conflict {
            job_id: id,
            current_state: current.as_str().unwrap_or("unknown").to_owned(),
            operation,
            expected,
        },
        other => ApiError::Store(other),
    }
}
