//! The OJS gRPC binding: `ojs.v1.OJSService` over the same [`Api`] as the
//! HTTP binding, so a job pushed over one reads the same over the other
//! and no rule is written twice (messages are turned into the HTTP
//! binding's JSON and back in [`convert`]).
//!
//! [`services`] gives the three gRPC services the daemon serves on its
//! HTTP listener (HTTP/2, cleartext or TLS with ALPN `h2`): this binding,
//! server reflection (so `grpcurl` and dynamic clients need no protos)
//! and `grpc.health.v1`. Methods it does not know answer `UNIMPLEMENTED`
//! from the router.

pub mod convert;

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio_stream::Stream;
use tonic::metadata::MetadataMap;
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::auth::Grant;
use crate::dead::DeadLetterQuery;
use crate::error::ApiError;
use crate::events::Delivery;
use crate::metrics::Binding;
use crate::roster::{Beat, Directive};
use crate::{worker, Api};

/// The generated `ojs.v1` messages, server and client.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/ojs.v1.rs"));
}

/// The encoded descriptors of `ojs.v1` (and the well-known types it
/// imports), which server reflection serves.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ojs_v1.binpb"));

/// The gRPC path prefix of the binding's service.
pub const SERVICE_PATH: &str = "/ojs.v1.OJSService/";

/// The domain of every `ErrorInfo` this binding sends.
pub const ERROR_DOMAIN: &str = "openjobspec.org";

/// How long before the caller's deadline a waiting `Fetch` answers: a
/// fifth of the deadline, at least `DEADLINE_MARGIN_MIN` and at most
/// `DEADLINE_MARGIN_MAX`. The caller's clock started before its request
/// was sent (a connection made, a loaded machine's scheduling) and this
/// wait starts when the request is read, so the margin must cover both
/// ends' delays, not only the answer's way back: 100 ms at a 1 s deadline
/// was once too little on a loaded 2-core machine.
const DEADLINE_MARGIN_MIN: Duration = Duration::from_millis(250);
const DEADLINE_MARGIN_MAX: Duration = Duration::from_secs(1);

/// How long a `Fetch` with the caller's deadline `d` waits for jobs.
fn fetch_wait(d: Duration) -> Duration {
    let margin = (d / 5).clamp(DEADLINE_MARGIN_MIN, DEADLINE_MARGIN_MAX);
    d.saturating_sub(margin).min(crate::worker::MAX_FETCH_WAIT)
}

/// `ojs.v1.OJSService` over an [`Api`].
#[derive(Debug, Clone)]
pub struct OjsGrpc {
    api: Arc<Api>,
}

impl OjsGrpc {
    /// The binding over `api`.
    pub fn new(api: Arc<Api>) -> Self {
        OjsGrpc { api }
    }

    /// The tonic server of the binding, with the API's message-size limit
    /// for requests.
    pub fn server(self) -> pb::ojs_service_server::OjsServiceServer<OjsGrpc> {
        let limit = self.api.settings().max_body_bytes;
        pb::ojs_service_server::OjsServiceServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(usize::MAX)
    }
}

/// The level the manifest declares (`Api::manifest`), said on every answer.
const CONFORMANCE_LEVEL: &str = "0";

/// The request id of a call: the caller's `x-ojs-request-id` when it is a
/// sane token, else a new one.
fn request_id(metadata: &MetadataMap) -> String {
    metadata
        .get("x-ojs-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("req_{}", uuid::Uuid::now_v7()), str::to_owned)
}

/// The status of an error: the binding's code map, one `ErrorInfo`
/// (reason = the HTTP binding's code, `retryable`, `request_id`) and, for
/// a validation error, a `BadRequest` naming the attribute.
pub fn status(error: &ApiError, request_id: &str) -> Status {
    let code = match error {
        ApiError::InvalidPayload { .. }
        | ApiError::InvalidRequest { .. }
        | ApiError::InvalidWorkflow { .. }
        | ApiError::UnsupportedContentType { .. }
        | ApiError::NotAcceptable { .. }
        | ApiError::NoRoute { .. }
        | ApiError::MethodNotAllowed { .. } => Code::InvalidArgument,
        ApiError::NotFound { .. }
        | ApiError::QueueNotServed { .. }
        | ApiError::QueueMissing { .. } => Code::NotFound,
        ApiError::Duplicate { .. } | ApiError::UniqueConflict { .. } => Code::AlreadyExists,
        ApiError::Conflict { .. }
        | ApiError::WorkerConflict { .. }
        | ApiError::WorkflowFinished { .. } => Code::FailedPrecondition,
        ApiError::CronLimit { .. } => Code::ResourceExhausted,
        ApiError::UnsupportedVersion(_) => Code::FailedPrecondition,
        ApiError::Unsupported { .. } => Code::Unimplemented,
        ApiError::BodyTooLarge { .. }
        | ApiError::BatchTooLarge { .. }
        | ApiError::JobTooLarge { .. }
        | ApiError::Busy
        | ApiError::StreamLimit { .. }
        | ApiError::HeldLimit { .. } => Code::ResourceExhausted,
        ApiError::Unauthenticated => Code::Unauthenticated,
        ApiError::PermissionDenied { .. } => Code::PermissionDenied,
        ApiError::BodyTimeout { .. } => Code::DeadlineExceeded,
        ApiError::Broker { .. } => Code::Unavailable,
        ApiError::BrokerDenied { .. } => Code::Internal,
        ApiError::Store(e) if e.is_unavailable() => Code::Unavailable,
        ApiError::Store(_) => Code::Internal,
    };
    if error.needs_operator() {
        let detail = std::error::Error::source(error)
            .map(ToString::to_string)
            .unwrap_or_default();
        tracing::warn!(code = %error.code(), error = %error, %detail, request_id, "OJS gRPC call failed");
    } else {
        tracing::debug!(code = %error.code(), request_id, "OJS gRPC call refused");
    }
    let mut details = ErrorDetails::with_error_info(
        error.code().as_str(),
        ERROR_DOMAIN,
        [
            ("retryable".to_owned(), error.retryable().to_string()),
            ("request_id".to_owned(), request_id.to_owned()),
        ],
    );
    match error {
        ApiError::InvalidRequest { attribute, .. } => {
            details.add_bad_request_violation(
                attribute.clone().unwrap_or_default(),
                error.to_string(),
            );
        }
        ApiError::InvalidWorkflow { path, message } => {
            details.add_bad_request_violation(path.clone(), message.clone());
        }
        _ => {}
    }
    Status::with_error_details(code, error.to_string(), details)
}

/// One RPC's context: its request id, the grant of its token, and what
/// its metrics are counted under.
struct Rpc<'a> {
    request_id: String,
    grant: Grant<'a>,
    api: &'a Api,
    route: &'static str,
    began: Instant,
}

impl Rpc<'_> {
    /// The call's answer: the message with the binding's metadata, or the
    /// error as the binding's status. Counted in the metrics, under the
    /// HTTP status of the same answer.
    fn reply<T>(&self, done: Result<T, ApiError>) -> Result<Response<T>, Status> {
        let code = done.as_ref().map_or_else(crate::http::status_of, |_| 200);
        self.api
            .metrics()
            .request(Binding::Grpc, self.route, code, self.began.elapsed());
        match done {
            Ok(message) => Ok(answer(message, &self.request_id)),
            Err(e) => Err(status(&e, &self.request_id)),
        }
    }
}

impl OjsGrpc {
    fn begin<'a>(&'a self, metadata: &MetadataMap, route: &'static str) -> Result<Rpc<'a>, Status> {
        let began = Instant::now();
        let request_id = request_id(metadata);
        let authorization = metadata.get("authorization").and_then(|v| v.to_str().ok());
        let grant = match self.api.tokens().identify(authorization) {
            Ok(grant) => grant,
            Err(e) => {
                self.api.metrics().request(
                    Binding::Grpc,
                    route,
                    crate::http::status_of(&e),
                    began.elapsed(),
                );
                return Err(status(&e, &request_id));
            }
        };
        Ok(Rpc {
            request_id,
            grant,
            api: &self.api,
            route,
            began,
        })
    }
}

/// An answer with the metadata every answer of the binding carries.
fn answer<T>(message: T, request_id: &str) -> Response<T> {
    let mut r = Response::new(message);
    let m = r.metadata_mut();
    if let Ok(v) = request_id.parse() {
        m.insert("x-ojs-request-id", v);
    }
    if let Ok(v) = env!("CARGO_PKG_VERSION").parse() {
        m.insert("x-ojs-server-version", v);
    }
    m.insert(
        "x-ojs-conformance-level",
        tonic::metadata::MetadataValue::from_static(CONFORMANCE_LEVEL),
    );
    r
}

/// How long the caller will wait for an answer (`grpc-timeout`), if it
/// said.
pub fn deadline(metadata: &MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn job_message(job: &crate::Job) -> pb::Job {
    convert::job_message(job)
}

fn queues(names: Vec<String>) -> Result<Vec<String>, ApiError> {
    if names.is_empty() {
        return Err(ApiError::invalid(
            "queues",
            "`queues` is required: one or more queue names",
        ));
    }
    crate::limits::check_fetch_queues(&names)?;
    Ok(names)
}

/// A list request's page: its `limit` (zero: `default`) and the offset its
/// `cursor` stands for (this server's cursors are offsets).
fn page(limit: i32, cursor: &str, default: usize) -> Result<(usize, usize), ApiError> {
    let limit = match limit {
        0 => default,
        n @ 1..=1000 => n as usize,
        _ => return Err(ApiError::invalid("limit", "must be from 1 to 1000")),
    };
    let offset = if cursor.is_empty() {
        0
    } else {
        cursor
            .parse()
            .map_err(|_| ApiError::invalid("cursor", "is not a cursor this server gave"))?
    };
    Ok((limit, offset))
}

fn job_id(id: &str) -> Result<&str, ApiError> {
    if id.is_empty() {
        return Err(ApiError::invalid("job_id", "`job_id` is required"));
    }
    Ok(id)
}

type JobStream = Pin<Box<dyn Stream<Item = Result<pb::Job, Status>> + Send + 'static>>;
type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send + 'static>>;

/// An event of the log (as the HTTP binding shows it) as the gRPC
/// binding's message.
fn event_message(body: &Value) -> pb::Event {
    let text = |k: &str| body[k].as_str().unwrap_or_default().to_owned();
    pb::Event {
        id: text("id"),
        r#type: text("type"),
        job_id: text("job_id"),
        job_type: text("job_type"),
        queue: text("queue"),
        timestamp: body["timestamp"].as_str().and_then(convert::text_timestamp),
        data: body["data"].as_object().map(convert::json_to_struct),
        workflow_id: body["data"]["workflow_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    }
}

#[tonic::async_trait]
impl pb::ojs_service_server::OjsService for OjsGrpc {
    async fn manifest(
        &self,
        request: Request<pb::ManifestRequest>,
    ) -> Result<Response<pb::ManifestResponse>, Status> {
        let rpc = self.begin(request.metadata(), "manifest")?;
        let id = rpc.request_id;
        let m = self.api.manifest();
        let texts = |list: &[&str]| list.iter().map(|t| (*t).to_owned()).collect();
        Ok(answer(
            pb::ManifestResponse {
                ojs_version: m.ojs_version.to_owned(),
                implementation: Some(pb::Implementation {
                    name: m.implementation.name.to_owned(),
                    version: m.implementation.version.to_owned(),
                    language: m.implementation.language.to_owned(),
                }),
                conformance_level: i32::from(m.conformance_level),
                protocols: texts(&m.protocols),
                backend: m.backend.to_owned(),
                extensions: texts(&m.extensions),
                schema_validation: m.capabilities.schema_validation,
            },
            &id,
        ))
    }

    async fn health(
        &self,
        request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        let id = request_id(request.metadata());
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let detail = self
            .api
            .health_access(authorization)
            .map_err(|e| status(&e, &id))?;
        let store = self.api.store_health();
        let store_up = store.is_up();
        let mut details = serde_json::Map::new();
        let store = if detail {
            details.insert("backend".into(), json!(self.api.backend()));
            details.insert("uptime_seconds".into(), json!(self.api.uptime_seconds()));
            store
        } else {
            store.without_detail()
        };
        details.insert("store".into(), json!(store));
        let status = if store_up {
            pb::HealthStatus::Ok
        } else {
            pb::HealthStatus::Unhealthy
        };
        Ok(answer(
            pb::HealthResponse {
                status: status as i32,
                timestamp: Some(convert::time_stamp(self.api.now())),
                details: Some(convert::json_to_struct(&details)),
            },
            &id,
        ))
    }

    async fn enqueue(
        &self,
        request: Request<pb::EnqueueRequest>,
    ) -> Result<Response<pb::EnqueueResponse>, Status> {
        let rpc = self.begin(request.metadata(), "push")?;
        let traceparent = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let r = request.into_inner();
        let done = async {
            let job = convert::enqueue_job(
                r.r#type,
                r.args,
                r.options,
                None,
                traceparent.as_deref(),
                self.api.now(),
            )?;
            let mut jobs = self.api.push(&rpc.grant, vec![job]).await?;
            jobs.pop().ok_or_else(|| ApiError::invalid("", "no job"))
        }
        .await;
        rpc.reply(done.map(|job| pb::EnqueueResponse {
            job: Some(job_message(&job)),
        }))
    }

    async fn enqueue_batch(
        &self,
        request: Request<pb::EnqueueBatchRequest>,
    ) -> Result<Response<pb::EnqueueBatchResponse>, Status> {
        let rpc = self.begin(request.metadata(), "batch")?;
        let traceparent = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let r = request.into_inner();
        let done = async {
            if r.jobs.is_empty() {
                return Err(ApiError::invalid(
                    "jobs",
                    "`jobs` must hold at least one job",
                ));
            }
            let limit = self.api.settings().max_batch_jobs;
            if r.jobs.len() > limit {
                return Err(ApiError::BatchTooLarge {
                    count: r.jobs.len(),
                    limit,
                });
            }
            let now = self.api.now();
            let mut jobs = Vec::with_capacity(r.jobs.len());
            for (i, entry) in r.jobs.into_iter().enumerate() {
                let job = convert::enqueue_job(
                    entry.r#type,
                    entry.args,
                    entry.options,
                    r.default_options.as_ref(),
                    traceparent.as_deref(),
                    now,
                )
                .map_err(|e| e.at_index(i))?;
                jobs.push(job);
            }
            self.api.push(&rpc.grant, jobs).await
        }
        .await;
        rpc.reply(done.map(|jobs| pb::EnqueueBatchResponse {
            count: i32::try_from(jobs.len()).unwrap_or(i32::MAX),
            jobs: jobs.iter().map(job_message).collect(),
            errors: Default::default(),
        }))
    }

    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::GetJobResponse>, Status> {
        let rpc = self.begin(request.metadata(), "info")?;
        let r = request.into_inner();
        let done = async { self.api.info(&rpc.grant, job_id(&r.job_id)?).await }.await;
        rpc.reply(done.map(|job| pb::GetJobResponse {
            job: Some(job_message(&job)),
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let rpc = self.begin(request.metadata(), "cancel")?;
        let r = request.into_inner();
        let done = async { self.api.cancel(&rpc.grant, job_id(&r.job_id)?).await }.await;
        rpc.reply(done.map(|(_, job)| pb::CancelJobResponse {
            job: Some(job_message(&job)),
        }))
    }

    async fn fetch(
        &self,
        request: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchResponse>, Status> {
        let rpc = self.begin(request.metadata(), "fetch")?;
        // A long poll as long as the caller waits (less a margin to
        // answer in), at most the FETCH's longest wait; no deadline, no wait.
        let wait = deadline(request.metadata())
            .map(fetch_wait)
            .unwrap_or(Duration::ZERO);
        let r = request.into_inner();
        let done = async {
            let count = match r.count {
                0 => 1,
                n @ 1..=1000 => n as usize,
                _ => {
                    return Err(ApiError::invalid(
                        "count",
                        "must be an integer from 1 to 1000",
                    ))
                }
            };
            let fetch = worker::Fetch {
                queues: queues(r.queues)?,
                count,
                worker_id: (!r.worker_id.is_empty()).then_some(r.worker_id),
                visibility: None,
                wait,
            };
            self.api.fetch(&rpc.grant, fetch).await
        }
        .await;
        rpc.reply(done.map(|jobs| pb::FetchResponse {
            jobs: jobs.iter().map(job_message).collect(),
        }))
    }

    async fn ack(
        &self,
        request: Request<pb::AckRequest>,
    ) -> Result<Response<pb::AckResponse>, Status> {
        let rpc = self.begin(request.metadata(), "ack")?;
        let r = request.into_inner();
        let result = r.result.map(|s| Value::Object(convert::struct_to_json(s)));
        let done = async { self.api.ack(&rpc.grant, job_id(&r.job_id)?, result).await }.await;
        rpc.reply(done.map(|_| pb::AckResponse { acknowledged: true }))
    }

    async fn nack(
        &self,
        request: Request<pb::NackRequest>,
    ) -> Result<Response<pb::NackResponse>, Status> {
        let rpc = self.begin(request.metadata(), "nack")?;
        let r = request.into_inner();
        let done = async {
            let failure = worker::Failure {
                job_id: job_id(&r.job_id)?.to_owned(),
                error: convert::failure_error(r.error),
                requeue: false,
            };
            self.api.nack(&rpc.grant, failure).await
        }
        .await;
        rpc.reply(done.map(|job| {
            pb::NackResponse {
                state: convert::state_of(job.state().as_str().unwrap_or("")) as i32,
                next_attempt_at: job
                    .extra
                    .get("next_attempt_at")
                    .and_then(Value::as_str)
                    .and_then(convert::text_timestamp),
            }
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let rpc = self.begin(request.metadata(), "heartbeat")?;
        let r = request.into_inner();
        let done = async {
            if r.id.is_empty() && r.worker_id.is_empty() {
                return Err(ApiError::invalid(
                    "id",
                    "`id` (a job's or the worker's) or `worker_id` is required",
                ));
            }
            let extend_by = r
                .extend_by
                .as_ref()
                .map(|d| {
                    convert::millis(d, "extend_by").and_then(|ms| {
                        crate::limits::bounded_ms("extend_by", ms, crate::limits::MAX_VISIBILITY)
                    })
                })
                .transpose()?;
            // `id` names a job unless it is the worker's own id.
            let worker_level = r.id.is_empty() || r.id == r.worker_id;
            let jobs = (!worker_level).then(|| vec![r.id.clone()]);
            let extended = self
                .api
                .heartbeat(&rpc.grant, &r.worker_id, jobs, extend_by)
                .await?;
            let directive = if r.worker_id.is_empty() {
                Directive::Running
            } else {
                self.api
                    .beat(
                        &rpc.grant,
                        Beat {
                            worker_id: r.worker_id.clone(),
                            active_jobs: None,
                            about: serde_json::Map::new(),
                        },
                    )
                    .await?
            };
            let deadline = match (extended.is_empty(), extend_by) {
                (false, Some(d)) => chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| self.api.now().checked_add_signed(d))
                    .map(convert::time_stamp),
                _ => None,
            };
            Ok((directive, deadline))
        }
        .await;
        rpc.reply(done.map(|(directive, new_deadline)| pb::HeartbeatResponse {
            directed_state: worker_state(directive) as i32,
            new_deadline,
        }))
    }

    type StreamJobsStream = JobStream;

    async fn stream_jobs(
        &self,
        request: Request<pb::StreamJobsRequest>,
    ) -> Result<Response<Self::StreamJobsStream>, Status> {
        let rpc = self.begin(request.metadata(), "fetch")?;
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let authorization = authorization.as_deref();
        let r = request.into_inner();
        let max = match r.max_concurrent {
            0 => 1,
            n @ 1..=1000 => n as usize,
            _ => {
                let e = ApiError::invalid("max_concurrent", "must be an integer from 1 to 1000");
                return Err(status(&e, &rpc.request_id));
            }
        };
        let queues = queues(r.queues).map_err(|e| status(&e, &rpc.request_id))?;
        // The token must allow working those queues now, not at the first
        // job.
        for q in &queues {
            if let Err(e) = rpc.grant.allow_on(crate::auth::Operation::Work, q) {
                return Err(status(&e, &rpc.request_id));
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let feed = JobFeed {
            api: self.api.clone(),
            authorization: authorization.map(str::to_owned),
            queues,
            worker_id: (!r.worker_id.is_empty()).then_some(r.worker_id),
            max,
            request_id: rpc.request_id.clone(),
        };
        tokio::spawn(feed.run(tx));
        Ok(answer(
            Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as JobStream,
            &rpc.request_id,
        ))
    }

    type StreamEventsStream = EventStream;

    async fn stream_events(
        &self,
        request: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        use futures::StreamExt;
        let rpc = self.begin(request.metadata(), "events")?;
        let r = request.into_inner();
        // Exact types are selected by the log's reader; `job.*` patterns
        // here.
        let patterns = r.event_types.iter().any(|t| t.ends_with('*'));
        let filter = crate::store::EventFilter {
            queues: r.queues,
            types: if patterns {
                Vec::new()
            } else {
                r.event_types.clone()
            },
            job_ids: if r.job_id.is_empty() {
                Vec::new()
            } else {
                vec![r.job_id]
            },
            ..crate::store::EventFilter::default()
        };
        let follower = match self.api.follow(&rpc.grant, filter, None).await {
            Ok(f) => f,
            Err(e) => return rpc.reply(Err(e)),
        };
        let (types, workflow_id) = (r.event_types, r.workflow_id);
        let events = follower
            .take_while(|d| futures::future::ready(!matches!(d, Delivery::Shutdown)))
            .filter_map(move |d| {
                let out = match d {
                    Delivery::Event(e) => {
                        let kind = e.body["type"].as_str().unwrap_or_default();
                        let typed = !patterns
                            || types.iter().any(|t| crate::realtime::type_matches(t, kind));
                        let in_workflow = workflow_id.is_empty()
                            || e.body["data"]["workflow_id"].as_str() == Some(workflow_id.as_str());
                        (typed && in_workflow).then(|| event_message(&e.body))
                    }
                    Delivery::Gap { after, oldest } => {
                        Some(event_message(&Delivery::gap_body(after, oldest)))
                    }
                    Delivery::Idle => Some(pb::Event {
                        r#type: "stream.keepalive".to_owned(),
                        timestamp: Some(convert::time_stamp(chrono::Utc::now())),
                        ..pb::Event::default()
                    }),
                    Delivery::Shutdown => None,
                };
                futures::future::ready(out.map(Ok))
            });
        rpc.reply(Ok(Box::pin(events) as EventStream))
    }

    async fn list_queues(
        &self,
        request: Request<pb::ListQueuesRequest>,
    ) -> Result<Response<pb::ListQueuesResponse>, Status> {
        let rpc = self.begin(request.metadata(), "queues")?;
        let r = request.into_inner();
        let done = async {
            let (limit, offset) = page(r.limit, &r.cursor, 100)?;
            let list: Vec<pb::QueueInfo> = self
                .api
                .queues(&rpc.grant)
                .await?
                .into_iter()
                .map(|q| pb::QueueInfo {
                    name: q.name,
                    paused: q.paused,
                    available_count: 0,
                    created_at: Some(convert::time_stamp(q.created_at)),
                })
                .collect();
            let total = list.len();
            let page: Vec<_> = list.into_iter().skip(offset).take(limit).collect();
            let next = offset + page.len();
            Ok((page, (next < total).then(|| next.to_string())))
        }
        .await;
        rpc.reply(done.map(|(queues, next)| pb::ListQueuesResponse {
            queues,
            next_cursor: next.unwrap_or_default(),
        }))
    }

    async fn queue_stats(
        &self,
        request: Request<pb::QueueStatsRequest>,
    ) -> Result<Response<pb::QueueStatsResponse>, Status> {
        let rpc = self.begin(request.metadata(), "queues")?;
        let r = request.into_inner();
        let done = self.api.queue_stats(&rpc.grant, &r.queue).await;
        rpc.reply(done.map(|s| {
            let count = |state: &str| {
                i64::try_from(s.by_state.get(state).copied().unwrap_or(0)).unwrap_or(i64::MAX)
            };
            let stats = pb::QueueStatistics {
                available: count("available"),
                active: count("active"),
                scheduled: count("scheduled"),
                retryable: count("retryable"),
                dead: i64::try_from(s.dead).unwrap_or(i64::MAX),
                completed_last_hour: i64::try_from(s.completed_last_hour).unwrap_or(i64::MAX),
                failed_last_hour: i64::try_from(s.failed_last_hour).unwrap_or(i64::MAX),
                avg_duration_ms: s.avg_duration_ms.unwrap_or(0.0),
                avg_wait_ms: s.avg_wait_ms.unwrap_or(0.0),
                throughput_per_second: s.throughput_per_second,
                paused: s.paused,
            };
            pb::QueueStatsResponse {
                queue: s.name,
                stats: Some(stats),
            }
        }))
    }

    async fn pause_queue(
        &self,
        request: Request<pb::PauseQueueRequest>,
    ) -> Result<Response<pb::PauseQueueResponse>, Status> {
        let rpc = self.begin(request.metadata(), "queues")?;
        let r = request.into_inner();
        let done = self.api.pause_queue(&rpc.grant, &r.queue).await;
        rpc.reply(done.map(|_| pb::PauseQueueResponse {}))
    }

    async fn resume_queue(
        &self,
        request: Request<pb::ResumeQueueRequest>,
    ) -> Result<Response<pb::ResumeQueueResponse>, Status> {
        let rpc = self.begin(request.metadata(), "queues")?;
        let r = request.into_inner();
        let done = self.api.resume_queue(&rpc.grant, &r.queue).await;
        rpc.reply(done.map(|_| pb::ResumeQueueResponse {}))
    }

    async fn list_dead_letter(
        &self,
        request: Request<pb::ListDeadLetterRequest>,
    ) -> Result<Response<pb::ListDeadLetterResponse>, Status> {
        let rpc = self.begin(request.metadata(), "dead_letters")?;
        let r = request.into_inner();
        let done = async {
            let (limit, offset) = page(r.limit, &r.cursor, 50)?;
            let query = DeadLetterQuery {
                queue: (!r.queue.is_empty()).then_some(r.queue),
                job_type: None,
                limit,
                offset,
            };
            let (jobs, total) = self.api.dead_letters(&rpc.grant, &query).await?;
            let next = offset + jobs.len();
            Ok((jobs, total, (next < total).then(|| next.to_string())))
        }
        .await;
        rpc.reply(done.map(|(jobs, total, next)| pb::ListDeadLetterResponse {
            jobs: jobs.iter().map(job_message).collect(),
            total_count: i64::try_from(total).unwrap_or(i64::MAX),
            next_cursor: next.unwrap_or_default(),
        }))
    }

    async fn retry_dead_letter(
        &self,
        request: Request<pb::RetryDeadLetterRequest>,
    ) -> Result<Response<pb::RetryDeadLetterResponse>, Status> {
        let rpc = self.begin(request.metadata(), "dead_letters")?;
        let r = request.into_inner();
        let done = async {
            self.api
                .retry_dead_letter(&rpc.grant, job_id(&r.job_id)?)
                .await
        }
        .await;
        rpc.reply(done.map(|job| pb::RetryDeadLetterResponse {
            job: Some(job_message(&job)),
        }))
    }

    async fn delete_dead_letter(
        &self,
        request: Request<pb::DeleteDeadLetterRequest>,
    ) -> Result<Response<pb::DeleteDeadLetterResponse>, Status> {
        let rpc = self.begin(request.metadata(), "dead_letters")?;
        let r = request.into_inner();
        let done = async {
            self.api
                .delete_dead_letter(&rpc.grant, job_id(&r.job_id)?)
                .await
        }
        .await;
        rpc.reply(done.map(|()| pb::DeleteDeadLetterResponse {}))
    }

    async fn register_cron(
        &self,
        request: Request<pb::RegisterCronRequest>,
    ) -> Result<Response<pb::RegisterCronResponse>, Status> {
        let rpc = self.begin(request.metadata(), "cron")?;
        let r = request.into_inner();
        let done = async {
            let body = convert::cron_body(r, self.api.now())?;
            self.api.register_cron(&rpc.grant, body).await
        }
        .await;
        rpc.reply(done.map(|(cron, _)| pb::RegisterCronResponse {
            name: cron.name,
            next_run_at: cron.next_run_at.map(convert::time_stamp),
        }))
    }

    async fn unregister_cron(
        &self,
        request: Request<pb::UnregisterCronRequest>,
    ) -> Result<Response<pb::UnregisterCronResponse>, Status> {
        let rpc = self.begin(request.metadata(), "cron")?;
        let r = request.into_inner();
        let done = self.api.delete_cron(&rpc.grant, &r.name).await;
        rpc.reply(done.map(|_| pb::UnregisterCronResponse {}))
    }

    async fn list_cron(
        &self,
        request: Request<pb::ListCronRequest>,
    ) -> Result<Response<pb::ListCronResponse>, Status> {
        let rpc = self.begin(request.metadata(), "cron")?;
        let done = self.api.crons(&rpc.grant, None).await;
        rpc.reply(done.map(|crons| pb::ListCronResponse {
            entries: crons.iter().map(convert::cron_entry).collect(),
        }))
    }

    async fn create_workflow(
        &self,
        request: Request<pb::CreateWorkflowRequest>,
    ) -> Result<Response<pb::CreateWorkflowResponse>, Status> {
        let rpc = self.begin(request.metadata(), "workflows")?;
        let r = request.into_inner();
        let done = async {
            let body = convert::workflow_body(r, self.api.now())?;
            self.api.create_workflow(&rpc.grant, body).await
        }
        .await;
        rpc.reply(done.map(|view| pb::CreateWorkflowResponse {
            workflow: Some(convert::workflow(&view)),
        }))
    }

    async fn get_workflow(
        &self,
        request: Request<pb::GetWorkflowRequest>,
    ) -> Result<Response<pb::GetWorkflowResponse>, Status> {
        let rpc = self.begin(request.metadata(), "workflows")?;
        let r = request.into_inner();
        let done = self.api.workflow(&rpc.grant, &r.workflow_id).await;
        rpc.reply(done.map(|view| pb::GetWorkflowResponse {
            workflow: Some(convert::workflow(&view)),
        }))
    }

    async fn cancel_workflow(
        &self,
        request: Request<pb::CancelWorkflowRequest>,
    ) -> Result<Response<pb::CancelWorkflowResponse>, Status> {
        let rpc = self.begin(request.metadata(), "workflows")?;
        let r = request.into_inner();
        let done = self.api.cancel_workflow(&rpc.grant, &r.workflow_id).await;
        rpc.reply(done.map(|view| pb::CancelWorkflowResponse {
            workflow: Some(convert::workflow(&view)),
        }))
    }
}

fn worker_state(d: Directive) -> pb::WorkerState {
    match d {
        Directive::Running => pb::WorkerState::Running,
        Directive::Quiet => pb::WorkerState::Quiet,
        Directive::Terminate => pb::WorkerState::Terminate,
    }
}

/// How long one fetch of a job stream waits before it looks again whether
/// the worker is still there.
const STREAM_POLL: Duration = Duration::from_secs(1);

/// The jobs of one `StreamJobs` call: fetched for the worker as they come,
/// never more unsettled at once than it asked for.
struct JobFeed {
    api: Arc<Api>,
    /// The call's `authorization`, identified again for each fetch (a
    /// stream outlives the call's borrow of the token list).
    authorization: Option<String>,
    queues: Vec<String>,
    worker_id: Option<String>,
    max: usize,
    request_id: String,
}

impl JobFeed {
    async fn run(self, tx: tokio::sync::mpsc::Sender<Result<pb::Job, Status>>) {
        let mut unsettled: HashSet<String> = HashSet::new();
        let settled = self.api.workers().settled.clone();
        while !tx.is_closed() {
            if self.api.is_draining() {
                // Shutting down: the worker's unsettled jobs may still be
                // acked here until the drain ends; new ones it gets from
                // another server.
                let _ = tx
                    .send(Err(Status::unavailable(
                        "the server is shutting down; reconnect to another",
                    )))
                    .await;
                return;
            }
            let grant = match self.api.tokens().identify(self.authorization.as_deref()) {
                Ok(g) => g,
                Err(e) => {
                    let _ = tx.send(Err(status(&e, &self.request_id))).await;
                    return;
                }
            };
            if unsettled.len() >= self.max {
                // Registered before looking, so a settlement in between
                // is not missed; settlements through another replica are
                // seen at the next poll.
                let notified = settled.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                self.forget_settled(&grant, &mut unsettled).await;
                if unsettled.len() >= self.max {
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep(STREAM_POLL) => {}
                        () = tx.closed() => return,
                    }
                }
                continue;
            }
            let fetch = worker::Fetch {
                queues: self.queues.clone(),
                count: self.max - unsettled.len(),
                worker_id: self.worker_id.clone(),
                visibility: None,
                wait: STREAM_POLL,
            };
            let jobs = match self.api.fetch(&grant, fetch).await {
                Ok(jobs) => jobs,
                // This process holds all it may of active jobs: the
                // stream waits for room as a FETCH does, and stays open.
                Err(ApiError::HeldLimit { .. }) => {
                    tokio::select! {
                        () = settled.notified() => {}
                        () = tokio::time::sleep(STREAM_POLL) => {}
                        () = tx.closed() => return,
                    }
                    continue;
                }
                Err(e) => {
                    // The worker reconnects; a broker or store that is
                    // down says UNAVAILABLE. A fetch that was waiting when
                    // shutdown closed the adapter is the shutdown, not a
                    // failure to report.
                    let answer = if self.api.is_draining() {
                        Status::unavailable("the server is shutting down; reconnect to another")
                    } else {
                        status(&e, &self.request_id)
                    };
                    let _ = tx.send(Err(answer)).await;
                    return;
                }
            };
            let mut jobs = jobs.into_iter();
            while let Some(job) = jobs.next() {
                let id = job.envelope.id.clone();
                if tx.send(Ok(job_message(&job))).await.is_err() {
                    // The worker left between the fetch and the send:
                    // these jobs go back at once rather than after their
                    // visibility timeout.
                    let back: Vec<String> = std::iter::once(id)
                        .chain(jobs.map(|j| j.envelope.id))
                        .collect();
                    self.put_back(&grant, back).await;
                    return;
                }
                unsettled.insert(id);
            }
        }
    }

    /// Drops the jobs that are no longer active (acked, failed, timed out
    /// or cancelled) from `unsettled`.
    async fn forget_settled(&self, grant: &Grant<'_>, unsettled: &mut HashSet<String>) {
        let mut still = HashSet::new();
        for id in unsettled.drain() {
            let active = match self.api.info(grant, &id).await {
                Ok(job) => job.state() == ojs_core::JobState::Active,
                // Gone (retention) or unreadable: not held against the
                // worker's allowance.
                Err(_) => false,
            };
            if active {
                still.insert(id);
            }
        }
        *unsettled = still;
    }

    async fn put_back(&self, grant: &Grant<'_>, ids: Vec<String>) {
        for id in ids {
            let failure = worker::Failure {
                job_id: id.clone(),
                error: serde_json::Map::new(),
                requeue: true,
            };
            if let Err(e) = self.api.nack(grant, failure).await {
                tracing::debug!(job_id = %id, error = %e, "a streamed job its worker left before receiving comes back after its visibility timeout");
            }
        }
    }
}

/// The gRPC services the daemon serves beside the HTTP binding: this
/// binding, server reflection (v1 and v1alpha) and `grpc.health.v1`.
#[derive(Clone)]
pub struct GrpcServices {
    api: Arc<Api>,
    ojs: Handler,
    reflection_v1: Handler,
    reflection_v1alpha: Handler,
    health: Handler,
    health_reporter: tonic_health::server::HealthReporter,
}

type Answer = Pin<Box<dyn std::future::Future<Output = http::Response<GrpcBody>> + Send>>;

/// One tonic service, its type erased (reflection's cannot be named).
type Handler = Arc<dyn Fn(http::Request<GrpcBody>) -> Answer + Send + Sync>;

fn handler<S>(service: S) -> Handler
where
    S: tonic::codegen::Service<
            http::Request<GrpcBody>,
            Response = http::Response<GrpcBody>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    Arc::new(move |request| {
        let mut service = service.clone();
        Box::pin(async move {
            match service.call(request).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        })
    })
}

impl std::fmt::Debug for GrpcServices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcServices").finish_non_exhaustive()
    }
}

/// The request body the services take.
pub type GrpcBody = tonic::body::Body;

impl GrpcServices {
    /// The services over `api`.
    pub fn new(api: Arc<Api>) -> Result<Self, ApiError> {
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let broken = |e: tonic_reflection::server::Error| {
            ApiError::invalid("", format!("the gRPC descriptors do not load: {e}"))
        };
        let health_reporter = tonic_health::server::HealthReporter::new();
        let health = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(health_reporter.clone()),
        );
        Ok(GrpcServices {
            ojs: handler(OjsGrpc::new(api.clone()).server()),
            api,
            reflection_v1: handler(reflection().build_v1().map_err(broken)?),
            reflection_v1alpha: handler(reflection().build_v1alpha().map_err(broken)?),
            health: handler(health),
            health_reporter,
        })
    }

    /// Whether a request is a gRPC call (by its content type).
    pub fn is_grpc<B>(request: &http::Request<B>) -> bool {
        request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/grpc"))
    }

    /// Answers one gRPC call; a service or method not served answers
    /// `UNIMPLEMENTED`. The token is checked on the call's head, before
    /// its message is read, by the rule of each service
    /// ([`crate::http::admit`], [`Api::health_access`](crate::Api::health_access)).
    pub async fn call(&self, request: http::Request<GrpcBody>) -> http::Response<GrpcBody> {
        let path = request.uri().path().to_owned();
        let authorization = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let refused = |error: ApiError| {
            let request_id = request_id(&MetadataMap::from_headers(request.headers().clone()));
            status(&error, &request_id).into_http()
        };
        if path.starts_with(SERVICE_PATH) {
            if let Some(refused) = unsupported_codec(&request) {
                return refused;
            }
            if let Err(e) = self.api.tokens().identify(authorization.as_deref()) {
                return refused(e);
            }
            match self.read_within_limit(request).await {
                Ok((request, permit)) => {
                    let answer = malformed_is_invalid_argument((self.ojs)(request).await);
                    drop(permit);
                    answer
                }
                Err(refused) => refused,
            }
        } else if path.starts_with("/grpc.reflection.") {
            // What the service is, as the manifest: any valid token.
            if let Err(e) = self.api.tokens().identify(authorization.as_deref()) {
                return refused(e);
            }
            if path.starts_with("/grpc.reflection.v1.ServerReflection/") {
                (self.reflection_v1)(request).await
            } else if path.starts_with("/grpc.reflection.v1alpha.ServerReflection/") {
                (self.reflection_v1alpha)(request).await
            } else {
                Status::unimplemented(format!("no gRPC service serves {path}")).into_http()
            }
        } else if path.starts_with("/grpc.health.v1.Health/") {
            if let Err(e) = self.api.health_access(authorization.as_deref()) {
                return refused(e);
            }
            self.report_health().await;
            (self.health)(request).await
        } else {
            Status::unimplemented(format!("no gRPC service serves {path}")).into_http()
        }
    }

    /// The request with its body read within the API's body bounds
    /// ([`crate::body`]: `[api] max_body_bytes` and the 5 bytes that frame
    /// a message, the budget of bodies in flight, the deadline and the
    /// minimum rate), and the budget it holds; else the binding's answer
    /// (`RESOURCE_EXHAUSTED` for a request too large or past the budget,
    /// as the HTTP binding answers 413 and 429; tonic's own limit would
    /// say `OUT_OF_RANGE`). Every method of the binding takes one message,
    /// so reading it whole first costs nothing.
    async fn read_within_limit(
        &self,
        request: http::Request<GrpcBody>,
    ) -> Result<(http::Request<GrpcBody>, crate::body::BodyPermit), http::Response<GrpcBody>> {
        let (parts, body) = request.into_parts();
        let read = match crate::body::admit(None, self.api.settings(), self.api.body_budget(), 5) {
            Ok(permit) => crate::body::read(body, permit, self.api.settings(), 5).await,
            Err(e) => Err(e),
        };
        match read {
            Ok((bytes, permit)) => Ok((
                http::Request::from_parts(parts, GrpcBody::new(http_body_util::Full::new(bytes))),
                permit,
            )),
            Err(error) => {
                let request_id = request_id(&MetadataMap::from_headers(parts.headers));
                let error = match error {
                    ApiError::InvalidPayload { reason, .. } => ApiError::InvalidPayload {
                        encoding: "gRPC",
                        reason,
                    },
                    other => other,
                };
                Err(status(&error, &request_id).into_http())
            }
        }
    }

    /// Brings `grpc.health.v1` up to date: serving while the job store
    /// answers.
    async fn report_health(&self) {
        let status = if self.api.store_health().is_up() {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        for name in ["", "ojs.v1.OJSService"] {
            self.health_reporter.set_service_status(name, status).await;
        }
    }
}

/// A call whose content type names a codec other than protobuf
/// (`application/grpc+json`): refused by name before anything is read.
fn unsupported_codec(request: &http::Request<GrpcBody>) -> Option<http::Response<GrpcBody>> {
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let codec = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .strip_prefix("application/grpc")
        .unwrap_or("");
    if codec.is_empty() || codec == "+proto" {
        return None;
    }
    let request_id = request_id(&MetadataMap::from_headers(request.headers().clone()));
    let error = ApiError::UnsupportedContentType {
        content_type: content_type.to_owned(),
    };
    Some(status(&error, &request_id).into_http())
}

/// tonic answers a message that does not decode as protobuf `INTERNAL`,
/// before the method runs; that is the caller's bytes, not the server, so
/// the answer is rewritten as the binding's `INVALID_ARGUMENT`
/// (`invalid_payload`), as the HTTP binding answers 400.
fn malformed_is_invalid_argument(response: http::Response<GrpcBody>) -> http::Response<GrpcBody> {
    let headers = response.headers();
    if headers.get("grpc-status").map(http::HeaderValue::as_bytes) != Some(b"13") {
        return response;
    }
    let message = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decoded)
        .unwrap_or_default();
    let Some(reason) = message.strip_prefix("failed to decode Protobuf message: ") else {
        return response;
    };
    let error = ApiError::InvalidPayload {
        encoding: "protobuf ojs.v1",
        reason: reason.to_owned(),
    };
    status(&error, &format!("req_{}", uuid::Uuid::now_v7())).into_http()
}

/// `grpc-message` as text (it is percent-encoded on the wire).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_waits_its_deadline_less_a_margin_to_answer_in() {
        let ms = Duration::from_millis;
        // A fifth of the deadline, at least 250 ms, at most 1 s.
        assert_eq!(fetch_wait(ms(1_000)), ms(750));
        assert_eq!(fetch_wait(ms(2_000)), ms(1_600));
        assert_eq!(fetch_wait(ms(8_000)), ms(7_000));
        // Never past the FETCH's longest wait.
        assert_eq!(
            fetch_wait(Duration::from_secs(60)),
            crate::worker::MAX_FETCH_WAIT
        );
        // Too short a deadline to wait in: what is there, at once.
        assert_eq!(fetch_wait(ms(250)), Duration::ZERO);
        assert_eq!(fetch_wait(ms(100)), Duration::ZERO);
    }
}
