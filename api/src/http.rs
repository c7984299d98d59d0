//! The HTTP binding: requests under `/ojs/v1` and `/ojs/manifest` to
//! [`Api`] calls, and their answers in the encoding `Accept` asks for.
//!
//! The listener (connections, TLS, limits on heads and bodies) belongs to
//! the caller; [`handle`] takes a request whose body has been read within
//! [`ApiSettings::max_body_bytes`](crate::ApiSettings::max_body_bytes).

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::header::{HeaderMap, HeaderValue, ACCEPT, CONTENT_TYPE, LOCATION};
use http::{Method, Request, Response, StatusCode};
use ojs_core::envelope::media::{OJS_JSON, OJS_PROTO};
use ojs_core::Encoding;
use serde_json::{json, Value};

use std::time::Duration;

use serde_json::Map;

use crate::auth::Grant;
use crate::dead::DeadLetterQuery;
use crate::error::ApiError;
use crate::job::{self, Job, JobJson};
use crate::limits;
use crate::model::cron::CronJob;
use crate::roster::{self, Beat, Directive};
use crate::store::EventFilter;
use crate::worker;
use crate::Api;

/// `OJS-Version` of every answer.
pub const OJS_VERSION: &str = "1.0";
/// The binding's name for the protobuf media type (this project writes
/// `application/openjobspec+proto`; both are read).
pub const OJS_PROTOBUF_ALIAS: &str = "application/openjobspec+protobuf";

/// Whether `path` belongs to the OJS binding.
pub fn is_ojs_path(path: &str) -> bool {
    path == "/ojs/manifest" || path == "/ojs/v1" || path.starts_with("/ojs/v1/")
}

/// The request id of a request: the client's `X-Request-Id` when it is a
/// sane token, else a new `req_<uuidv7>`.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(new_request_id, str::to_owned)
}

/// `req_` and a UUIDv7, written into one string (through `format!` it was
/// the formatting machinery's, a call per piece, on every request).
fn new_request_id() -> String {
    let mut buffer = uuid::Uuid::encode_buffer();
    let uuid = uuid::Uuid::now_v7();
    let text = uuid.hyphenated().encode_lower(&mut buffer);
    let mut id = String::with_capacity(4 + text.len());
    id.push_str("req_");
    id.push_str(text);
    id
}

/// `X-Request-ID`, named once: a name given as text is parsed on each use.
const X_REQUEST_ID: http::header::HeaderName =
    http::header::HeaderName::from_static("x-request-id");

/// `OJS-Version`, likewise.
const OJS_VERSION_HEADER: http::header::HeaderName =
    http::header::HeaderName::from_static("ojs-version");

/// Adds the headers every OJS answer carries.
pub fn standard_headers(headers: &mut HeaderMap, request_id: &str) {
    headers.insert(OJS_VERSION_HEADER, HeaderValue::from_static(OJS_VERSION));
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert(X_REQUEST_ID, v);
    }
}

/// Which live event stream (Server-Sent Events) the request is for, if
/// it is for one (answered with a streaming body: [`event_stream`]):
/// `GET /ojs/v1/events/stream`, `/ojs/v1/jobs/{id}/events`,
/// `/ojs/v1/queues/{name}/events`.
pub fn event_stream_view(method: &Method, path: &str) -> Option<crate::events::StreamView> {
    use crate::events::StreamView;
    if *method != Method::GET {
        return None;
    }
    let rest = path.trim_end_matches('/').strip_prefix("/ojs/v1/")?;
    let segments: Vec<&str> = rest.split('/').collect();
    match segments.as_slice() {
        ["events", "stream"] => Some(StreamView::Log),
        ["jobs", id, "events"] if !id.is_empty() => Some(StreamView::Job { id: id.to_string() }),
        ["queues", q, "events"] if !q.is_empty() => Some(StreamView::Queue {
            name: q.to_string(),
        }),
        _ => None,
    }
}

/// A live event stream: the answer's head and the SSE frames of its body
/// (`crate::events`), or the error answer. Filters as `GET
/// /ojs/v1/events` (`types` or `event_types`, `queues`, `job_types`); where
/// to go on from: `Last-Event-ID`, or `after`.
pub async fn event_stream(
    api: &std::sync::Arc<Api>,
    request: &Request<()>,
    request_id: &str,
    view: crate::events::StreamView,
) -> Result<
    (
        Response<()>,
        impl tokio_stream::Stream<Item = Bytes> + Send + 'static,
    ),
    Response<Bytes>,
> {
    let began = std::time::Instant::now();
    let opened = async {
        let authorization = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let grant = api.tokens().identify(authorization)?;
        let query = request.uri().query().unwrap_or("");
        // The realtime extension's name for the types, beside the log's.
        let query = query.replace("event_types=", "types=");
        let mut filter = event_filter(&query)?;
        let after = request
            .headers()
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| (filter.after > 0).then(|| filter.after.to_string()));
        let after = match after {
            Some(id) => Some(crate::events::cursor_of(&id).ok_or_else(|| {
                ApiError::invalid("Last-Event-ID", "must be an event id this server sent")
            })?),
            None => None,
        };
        filter.after = 0;
        api.event_stream(&grant, filter, after, view).await
    }
    .await;
    let status = match &opened {
        Ok(_) => 200,
        Err(e) => status_of(e),
    };
    api.metrics().request(
        crate::metrics::Binding::Http,
        "events",
        status,
        began.elapsed(),
    );
    match opened {
        Ok(stream) => {
            let mut head = Response::new(());
            let h = head.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(
                http::header::CACHE_CONTROL,
                HeaderValue::from_static("no-cache"),
            );
            // Proxies that buffer answers (nginx) send each event at once.
            h.insert("x-accel-buffering", HeaderValue::from_static("no"));
            standard_headers(h, request_id);
            Ok((head, stream))
        }
        Err(e) => Err(error_response(&e, request_id)),
    }
}

/// A JSON answer.
pub fn json_response(status: u16, body: &Value, request_id: &str) -> Response<Bytes> {
    json_bytes_response(status, json_text(body), request_id)
}

/// A JSON answer written straight from `body`, without a `Value` tree;
/// should writing it fail (a job whose state has no JSON name),
/// `as_value` builds the answer as the `Value` it was built as before.
/// Bytes an answer written straight starts with room for: one job's JSON.
const ANSWER_ROOM: usize = 1024;

/// An answer `write` writes straight into bytes; `as_value` builds the
/// same object if writing fails.
fn written_response(
    status: u16,
    write: impl FnOnce(&mut Vec<u8>) -> Result<(), ojs_core::json_out::Error>,
    as_value: impl FnOnce() -> Value,
    request_id: &str,
) -> Response<Bytes> {
    // Room for a job from the start (a vector grown from serde's 128
    // bytes was reallocated three times for one job, six for ten).
    let mut bytes = Vec::with_capacity(ANSWER_ROOM);
    if write(&mut bytes).is_err() {
        bytes = json_text(&as_value());
    }
    json_bytes_response(status, bytes, request_id)
}

fn json_bytes_response(status: u16, bytes: Vec<u8>, request_id: &str) -> Response<Bytes> {
    let mut r = Response::new(Bytes::from(bytes));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(OJS_JSON));
    standard_headers(r.headers_mut(), request_id);
    r
}

/// `value` as compact JSON bytes (the store's `json_text`, the one rule).
fn json_text(value: &Value) -> Vec<u8> {
    crate::store::json_text(value).into_bytes()
}

/// The HTTP status of an error (the binding's table). The gRPC binding
/// counts its answers under the same status, so that the request metrics
/// have one set of labels.
pub fn status_of(error: &ApiError) -> u16 {
    match error {
        ApiError::InvalidPayload { .. }
        | ApiError::InvalidRequest { .. }
        | ApiError::InvalidWorkflow { .. }
        | ApiError::UnsupportedContentType { .. } => 400,
        ApiError::Unauthenticated => 401,
        ApiError::Busy | ApiError::StreamLimit { .. } | ApiError::HeldLimit { .. } => 429,
        ApiError::PermissionDenied { .. } => 403,
        ApiError::NotFound { .. }
        | ApiError::QueueNotServed { .. }
        | ApiError::QueueMissing { .. }
        | ApiError::NoRoute { .. } => 404,
        ApiError::MethodNotAllowed { .. } => 405,
        ApiError::BodyTimeout { .. } => 408,
        ApiError::NotAcceptable { .. } => 406,
        ApiError::Duplicate { .. }
        | ApiError::UniqueConflict { .. }
        | ApiError::Conflict { .. }
        | ApiError::WorkerConflict { .. }
        | ApiError::WorkflowFinished { .. }
        | ApiError::CronLimit { .. } => 409,
        ApiError::BodyTooLarge { .. }
        | ApiError::BatchTooLarge { .. }
        | ApiError::JobTooLarge { .. } => 413,
        ApiError::UnsupportedVersion(_) | ApiError::Unsupported { .. } => 422,
        // The store cannot be reached (PostgreSQL restarting): the request
        // may be repeated, like a broker that is down.
        ApiError::Store(e) if e.is_unavailable() => 503,
        ApiError::Store(_) => 500,
        ApiError::Broker { .. } => 503,
        ApiError::BrokerDenied { .. } => 500,
    }
}

/// An error answer.
pub fn error_response(error: &ApiError, request_id: &str) -> Response<Bytes> {
    if error.needs_operator() {
        let detail = std::error::Error::source(error)
            .map(ToString::to_string)
            .unwrap_or_default();
        tracing::warn!(code = %error.code(), error = %error, %detail, request_id, "OJS request failed");
    } else {
        tracing::debug!(
            code = %error.code(),
            status = status_of(error),
            request_id,
            "OJS request refused"
        );
    }
    let mut r = json_response(status_of(error), &error.body(request_id), request_id);
    if matches!(error, ApiError::Unauthenticated) {
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        );
    }
    if matches!(
        error,
        ApiError::Broker { .. } | ApiError::Busy | ApiError::HeldLimit { .. }
    ) {
        r.headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The encoding of an answer, from `Accept`.
fn answer_encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    let accept = headers
        .get(ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // Most requests name no media type with a `+` (or send no `Accept`):
    // nothing to rewrite, and no search for the alias on every request.
    let normalised = if accept.contains('+') {
        std::borrow::Cow::Owned(accept.replace(OJS_PROTOBUF_ALIAS, OJS_PROTO))
    } else {
        std::borrow::Cow::Borrowed(accept)
    };
    match Encoding::negotiate(&normalised) {
        Ok(Encoding::OjsJson) => Ok(Encoding::OjsJson),
        Ok(Encoding::OjsProto | Encoding::OjsProtoDelimited) => Ok(Encoding::OjsProto),
        _ => Err(ApiError::NotAcceptable {
            accept: accept.to_owned(),
        }),
    }
}

/// The encoding of a request body, from `Content-Type` (JSON when absent).
fn body_encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return Ok(Encoding::OjsJson);
    };
    let text = value.to_str().unwrap_or("");
    let unsupported = || ApiError::UnsupportedContentType {
        content_type: text.to_owned(),
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case(OJS_PROTOBUF_ALIAS) {
        return Ok(Encoding::OjsProto);
    }
    match Encoding::from_content_type(text) {
        Ok(e @ (Encoding::OjsJson | Encoding::OjsProto)) => Ok(e),
        _ => Err(unsupported()),
    }
}

/// What the head of a request must pass before its body is read: a valid
/// token (401), and for the routes that take a body, the operation they
/// need (403). The queue a body names is checked once it is read.
pub fn admit(api: &Api, method: &Method, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
    let authorization = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let grant = api.tokens().identify(authorization)?;
    if matches!(*method, Method::POST | Method::PATCH | Method::PUT) {
        let segments: Vec<&str> = path
            .strip_prefix("/ojs/v1/")
            .map(|p| p.trim_end_matches('/').split('/').collect())
            .unwrap_or_default();
        match segments.as_slice() {
            ["jobs"] | ["jobs", "batch"] | ["workflows"] => {
                grant.allow(crate::auth::Operation::Push)?
            }
            ["workflows", _, "cancel"] | ["admin", ..] => {
                grant.allow(crate::auth::Operation::Admin)?
            }
            ["workers", _] => grant.allow(crate::auth::Operation::Work)?,
            ["cron" | "crons", ..] | ["queues", _, "pause" | "resume"] | ["rate-limits", ..] => {
                grant.allow(crate::auth::Operation::Admin)?
            }
            _ => {}
        }
    }
    Ok(())
}

/// Serves one request of the binding; `request_id` is [`request_id`] of
/// its headers (the caller may have logged it already).
pub async fn handle(api: &Api, request: Request<Bytes>, request_id: &str) -> Response<Bytes> {
    let began = std::time::Instant::now();
    let counted = crate::metrics::http_route(request.method().as_str(), request.uri().path());
    let answer = match route(api, request, request_id).await {
        Ok(r) => r,
        Err(e) => error_response(&e, request_id),
    };
    api.metrics().request(
        crate::metrics::Binding::Http,
        counted,
        answer.status().as_u16(),
        began.elapsed(),
    );
    answer
}

async fn route(
    api: &Api,
    request: Request<Bytes>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    // The body is taken by what parses it, and dropped once parsed: a
    // request does not hold its bytes beside the values made of them.
    let (parts, mut body) = request.into_parts();
    let request = &Request::from_parts(parts, ());
    if let Some(v) = request.headers().get(OJS_VERSION_HEADER) {
        let v = v.to_str().unwrap_or("").trim();
        if !(v == "1" || v == "1.0" || v.starts_with("1.0.")) {
            return Err(ApiError::UnsupportedVersion(v.to_owned()));
        }
    }
    let authorization = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let grant = api.tokens().identify(authorization)?;
    if !body.is_empty() && matches!(body_encoding(request.headers()), Ok(Encoding::OjsJson)) {
        limits::check_json_shape(&body, api.settings().max_json_values)?;
    }
    let path = request.uri().path();
    let method = request.method();
    let segments: Vec<&str> = path
        .strip_prefix("/ojs/v1/")
        .map(|p| p.trim_end_matches('/').split('/').collect())
        .unwrap_or_default();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: path.to_owned(),
        allowed,
    };
    match (path, segments.as_slice()) {
        ("/ojs/manifest", _) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            Ok(json_response(200, &json!(api.manifest()), request_id))
        }
        (_, ["jobs"]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let answer = answer_encoding(request.headers())?;
            let job = read_job(
                request.headers(),
                std::mem::take(&mut body),
                api.settings().max_json_values,
                api.now(),
            )?;
            let mut pushed = api.push_all(&grant, vec![job]).await?;
            let pushed = pushed
                .pop()
                .ok_or_else(|| ApiError::invalid("", "no job"))?;
            if pushed.deduplicated {
                // `on_conflict: ignore`: 200 with the job holding the key.
                if answer == Encoding::OjsProto {
                    return job_response(200, &pushed.job, answer, request_id);
                }
                return Ok(json_response(
                    200,
                    &json!({"job": pushed.job.to_json(), "deduplicated": true}),
                    request_id,
                ));
            }
            let job = pushed.job;
            let mut r = job_response(201, &job, answer, request_id)?;
            if let Ok(v) = HeaderValue::from_str(&format!("/ojs/v1/jobs/{}", job.envelope.id)) {
                r.headers_mut().insert(LOCATION, v);
            }
            Ok(r)
        }
        (_, ["jobs", "batch"]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let answer = answer_encoding(request.headers())?;
            let jobs = read_batch(api, request.headers(), std::mem::take(&mut body))?;
            let jobs = api.push(&grant, jobs).await?;
            batch_response(&jobs, answer, request_id)
        }
        (_, ["jobs", id]) => match *method {
            Method::GET => {
                let answer = answer_encoding(request.headers())?;
                let job = api.info(&grant, id).await?;
                job_response(200, &job, answer, request_id)
            }
            Method::DELETE => {
                json_only(request.headers())?;
                let (previous, job) = api.cancel(&grant, id).await?;
                let mut body = job.to_json();
                body["previous_state"] = json!(previous.as_str().unwrap_or("unknown"));
                Ok(json_response(200, &job_body(body), request_id))
            }
            _ => Err(not_allowed("GET, DELETE")),
        },
        (_, ["jobs", id, "activate"]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            json_only(request.headers())?;
            let job = api.activate(&grant, id).await?;
            let mut body = job.to_json();
            body["previous_state"] = json!("pending");
            Ok(json_response(200, &job_body(body), request_id))
        }
        (_, ["queues"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            let queues: Vec<Value> = api
                .queues(&grant)
                .await?
                .into_iter()
                .map(|q| {
                    json!({"name": q.name, "status": if q.paused { "paused" } else { "active" },
                           "paused": q.paused, "created_at": job::timestamp(q.created_at)})
                })
                .collect();
            let total = queues.len();
            let body = json!({
                "queues": queues,
                "pagination": {"total": total, "limit": total, "offset": 0, "has_more": false},
            });
            Ok(json_response(200, &body, request_id))
        }
        (_, ["queues", queue, action @ ("pause" | "resume")]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            json_only(request.headers())?;
            let state = if *action == "pause" {
                api.pause_queue(&grant, queue).await?
            } else {
                api.resume_queue(&grant, queue).await?
            };
            let status = if state.paused { "paused" } else { "active" };
            let at = if state.paused {
                "paused_at"
            } else {
                "resumed_at"
            };
            let by = if state.paused {
                "paused_by"
            } else {
                "resumed_by"
            };
            Ok(json_response(
                200,
                &json!({
                    "name": state.name,
                    "paused": state.paused,
                    "state": status,
                    "status": status,
                    at: job::timestamp(state.at),
                    by: grant.token_name(),
                    "queue": {"name": state.name, "paused": state.paused, "status": status},
                }),
                request_id,
            ))
        }
        (_, ["queues", queue, "priority-stats"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            let counts = api.priority_stats(&grant, queue).await?;
            let total: u64 = counts.iter().map(|(_, n)| n).sum();
            let by_priority: Map<String, Value> = counts
                .iter()
                .map(|(p, n)| (p.to_string(), json!(n)))
                .collect();
            let distribution: Vec<Value> = counts
                .iter()
                .map(|(p, n)| json!({"priority": p, "count": n}))
                .collect();
            Ok(json_response(
                200,
                &json!({"queue": queue, "counts_by_priority": by_priority, "distribution": distribution, "total": total}),
                request_id,
            ))
        }
        (_, ["unique-jobs"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            let (page, per_page) = page_query(request.uri().query().unwrap_or(""))?;
            let (holds, total) = api.unique_jobs(&grant, page, per_page).await?;
            let items: Vec<Value> = holds
                .iter()
                .map(|h| {
                    json!({
                        "key": h.key,
                        "job_id": h.job.envelope.id,
                        "type": h.job.envelope.job_type,
                        "queue": h.job.envelope.queue,
                        "state": crate::model::state_name(h.job.state()),
                        "locked_until": h.until.map(crate::job::timestamp),
                    })
                })
                .collect();
            Ok(json_response(
                200,
                &json!({"items": items, "unique_jobs": items, "pagination": {"total": total, "page": page, "per_page": per_page}}),
                request_id,
            ))
        }
        (_, ["queues", queue, "stats"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            let stats = api.queue_stats(&grant, queue).await?;
            Ok(json_response(200, &queue_stats_body(&stats), request_id))
        }
        (_, ["events"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            json_only(request.headers())?;
            let query = request.uri().query().unwrap_or("");
            let filter = event_filter(query)?;
            // The admin UI pages the log (`page`, `per_page`) and reads
            // `items` and `pagination`: the newest events first.
            let paged = query.split('&').any(|p| {
                let k = p.split_once('=').map_or(p, |(k, _)| k);
                k == "page" || k == "per_page"
            });
            if paged {
                let (page, per_page) = page_query(query)?;
                let (events, total) = api.recent_events(&grant, filter, page, per_page).await?;
                let events: Vec<Value> = events.into_iter().map(|e| e.body).collect();
                return Ok(json_response(
                    200,
                    &json!({"events": events, "items": events, "cursor": null, "has_more": page * per_page < total,
                            "pagination": {"total": total, "page": page, "per_page": per_page}}),
                    request_id,
                ));
            }
            let page = api.events(&grant, filter).await?;
            let has_more = page.has_more;
            // Past what was looked at (filtered-out events included), so
            // that the next read does not look at them again.
            let cursor = (page.cursor > 0).then(|| page.cursor.to_string());
            let events: Vec<Value> = page.events.into_iter().map(|e| e.body).collect();
            Ok(json_response(
                200,
                &json!({"events": events, "cursor": cursor, "has_more": has_more}),
                request_id,
            ))
        }
        (_, ["dead-letter", rest @ ..]) => {
            json_only(request.headers())?;
            dead_letter_route(api, &grant, request, rest, false, request_id).await
        }
        (_, ["admin", "dead-letter", rest @ ..]) => {
            json_only(request.headers())?;
            dead_letter_route(api, &grant, request, rest, true, request_id).await
        }
        (_, ["workflows", rest @ ..]) => {
            json_only(request.headers())?;
            let body = if *method == Method::POST && rest.is_empty() {
                Some(parse_json(&std::mem::take(&mut body))?)
            } else {
                None
            };
            workflow_route(api, &grant, request, rest, body, request_id).await
        }
        (_, [root @ ("cron" | "crons"), rest @ ..]) => {
            json_only(request.headers())?;
            let body = if matches!(*method, Method::POST | Method::PATCH | Method::PUT) {
                Some(parse_json(&std::mem::take(&mut body))?)
            } else {
                None
            };
            cron_route(api, &grant, request, root, rest, body, request_id).await
        }
        (_, ["admin", "reset"]) => {
            if *method != Method::POST {
                return Err(not_allowed("POST"));
            }
            json_only(request.headers())?;
            let drained = api.reset(&grant).await?;
            Ok(json_response(
                200,
                &json!({"reset": true, "drained": drained}),
                request_id,
            ))
        }
        (_, ["admin", "workers", rest @ ..]) => {
            json_only(request.headers())?;
            worker_admin_route(api, &grant, request, rest, request_id).await
        }
        (_, ["rate-limits", rest @ ..]) => {
            json_only(request.headers())?;
            let body = if *method == Method::PUT {
                Some(parse_json(&std::mem::take(&mut body))?)
            } else {
                None
            };
            rate_limit_route(api, &grant, request, rest, body, request_id).await
        }
        (_, ["admin", rest @ ("stats" | "queues" | "jobs" | "system"), more @ ..]) => {
            json_only(request.headers())?;
            let body = if matches!(*method, Method::POST | Method::PUT) {
                let raw = std::mem::take(&mut body);
                // The admin UI sends a JSON content type on body-less POSTs.
                if raw.iter().all(u8::is_ascii_whitespace) {
                    None
                } else {
                    Some(parse_json(&raw)?)
                }
            } else {
                None
            };
            admin_route(api, &grant, request, rest, more, body, request_id).await
        }
        (_, ["workers", action]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            json_only(request.headers())?;
            let body = match parse_json(&std::mem::take(&mut body))? {
                Value::Object(m) => m,
                _ => return Err(ApiError::invalid("", "the body must be a JSON object")),
            };
            worker_route(api, &grant, action, body, request_id).await
        }
        _ => Err(match unserved_feature(&segments) {
            Some(feature) => ApiError::Unsupported { feature },
            None => ApiError::NoRoute {
                method: method.to_string(),
                path: path.to_owned(),
            },
        }),
    }
}

/// The OJS feature a path of the binding belongs to, when this server does
/// not serve it: clients (the SDKs) are told it is unsupported (422), not
/// that the resource is missing.
fn unserved_feature(segments: &[&str]) -> Option<&'static str> {
    match segments {
        ["admin", second, ..]
            if !matches!(
                *second,
                "workers" | "dead-letter" | "stats" | "queues" | "jobs"
            ) =>
        {
            Some("admin endpoints other than stats, queues, jobs, maintenance, workers and dead letters")
        }
        _ => None,
    }
}

fn millis(body: &Map<String, Value>, key: &str) -> Result<Option<Duration>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => limits::millis(key, v, limits::MAX_VISIBILITY).map(Some),
    }
}

fn job_id(body: &Map<String, Value>) -> Result<String, ApiError> {
    body.get("job_id")
        .or_else(|| body.get("id"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid("job_id", "`job_id` is required"))
}

/// A worker's request (`POST /ojs/v1/workers/{action}`), parsed and
/// validated before anything is asked of the service.
#[derive(Debug)]
pub enum WorkerRequest {
    /// FETCH.
    Fetch(worker::Fetch),
    /// ACK, with the job's result.
    Ack {
        /// The job.
        job_id: String,
        /// What the handler returned.
        result: Option<Value>,
    },
    /// NACK (or `fail`).
    Nack(worker::Failure),
    /// A heartbeat.
    Heartbeat {
        /// The worker (empty: the jobs alone are named).
        worker_id: String,
        /// The jobs it names; none: all it holds.
        jobs: Option<Vec<String>>,
        /// How much longer they stay its.
        visibility: Option<Duration>,
        /// How many jobs it runs, as it says.
        active: Option<u64>,
        /// What it says of itself (`crate::roster::ABOUT`).
        about: Map<String, Value>,
    },
}

/// Parses a worker's request body; every rule of the binding is applied
/// here (400 naming the field), none needs the service.
pub fn worker_request(
    action: &str,
    mut body: Map<String, Value>,
) -> Result<WorkerRequest, ApiError> {
    match action {
        "fetch" => {
            let queues = match body.get("queues") {
                Some(Value::Array(qs)) if !qs.is_empty() => qs
                    .iter()
                    .map(|q| {
                        q.as_str().map(str::to_owned).ok_or_else(|| {
                            ApiError::invalid("queues", "must be an array of queue names")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                _ => {
                    return Err(ApiError::invalid(
                        "queues",
                        "`queues` is required: a non-empty array of queue names",
                    ))
                }
            };
            limits::check_fetch_queues(&queues)?;
            let count = match body.get("count") {
                None | Some(Value::Null) => 1,
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|n| (1..=limits::MAX_FETCH_COUNT).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "count",
                            format!("must be an integer from 1 to {}", limits::MAX_FETCH_COUNT),
                        )
                    })?,
            };
            Ok(WorkerRequest::Fetch(worker::Fetch {
                queues,
                count,
                worker_id: body
                    .get("worker_id")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                visibility: millis(&body, "visibility_timeout_ms")?,
                wait: millis(&body, "wait_ms")?.unwrap_or(Duration::ZERO),
            }))
        }
        "ack" => Ok(WorkerRequest::Ack {
            job_id: job_id(&body)?,
            result: body.remove("result"),
        }),
        "nack" | "fail" => {
            let job_id = job_id(&body)?;
            let error = match body.remove("error") {
                Some(Value::Object(e)) => e,
                None | Some(Value::Null) => Map::new(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "error",
                        "must be an object {code, message}",
                    ))
                }
            };
            for key in ["code", "message", "type"] {
                if error
                    .get(key)
                    .is_some_and(|v| !v.is_string() && !v.is_null())
                {
                    return Err(ApiError::invalid(
                        format!("error.{key}"),
                        "must be a string",
                    ));
                }
            }
            let requeue = body
                .get("requeue")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            Ok(WorkerRequest::Nack(worker::Failure {
                job_id,
                error,
                requeue,
            }))
        }
        "heartbeat" => {
            let worker_id = body
                .get("worker_id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            let jobs = body
                .get("active_jobs")
                .or_else(|| body.get("active_job_ids"))
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                });
            if worker_id.is_empty() && jobs.is_none() {
                return Err(ApiError::invalid("worker_id", "`worker_id` is required"));
            }
            let visibility = millis(&body, "visibility_timeout_ms")?;
            // `active_jobs` is a list of ids (binding) or a count (worker
            // protocol document).
            let active = body
                .get("active_jobs")
                .and_then(Value::as_u64)
                .or_else(|| jobs.as_ref().map(|j: &Vec<String>| j.len() as u64));
            let about = roster::ABOUT
                .iter()
                .filter_map(|k| body.get(*k).map(|v| ((*k).to_owned(), v.clone())))
                .collect();
            Ok(WorkerRequest::Heartbeat {
                worker_id,
                jobs,
                visibility,
                active,
                about,
            })
        }
        _ => Err(ApiError::NoRoute {
            method: "POST".into(),
            path: format!("/ojs/v1/workers/{action}"),
        }),
    }
}

async fn worker_route(
    api: &Api,
    grant: &Grant<'_>,
    action: &str,
    body: Map<String, Value>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    match worker_request(action, body)? {
        WorkerRequest::Fetch(fetch) => {
            let jobs = api.fetch(grant, fetch).await?;
            Ok(written_response(
                200,
                |out| write_job_list(out, &jobs, None),
                || json!({"jobs": jobs.iter().map(Job::to_json).collect::<Vec<_>>()}),
                request_id,
            ))
        }
        WorkerRequest::Ack { job_id, result } => {
            let job = api.ack(grant, &job_id, result).await?;
            Ok(settle_response(&job, true, request_id))
        }
        WorkerRequest::Nack(failure) => {
            let job = api.nack(grant, failure).await?;
            Ok(settle_response(&job, false, request_id))
        }
        WorkerRequest::Heartbeat {
            worker_id,
            jobs,
            visibility,
            active,
            about,
        } => {
            let extended = api.heartbeat(grant, &worker_id, jobs, visibility).await?;
            let directive = if worker_id.is_empty() {
                Directive::Running
            } else {
                api.beat(
                    grant,
                    Beat {
                        worker_id,
                        active_jobs: active,
                        about,
                    },
                )
                .await?
            };
            Ok(json_response(
                200,
                &json!({"state": directive.as_str(), "jobs_extended": extended,
                        "server_time": crate::job::timestamp(api.now())}),
                request_id,
            ))
        }
    }
}

/// A query value with `%XX` escapes and `+` decoded.
fn query_value(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The filter of an admin job list or bulk operation, from a query
/// string's or a body's `filter` fields.
fn job_query(fields: &[(String, String)]) -> Result<crate::store::JobQuery, ApiError> {
    let mut q = crate::store::JobQuery::default();
    let time = |k: &str, v: &str| {
        DateTime::parse_from_rfc3339(v)
            .map(|t| t.with_timezone(&chrono::Utc))
            .map_err(|_| ApiError::invalid(k, "must be an RFC 3339 time"))
    };
    for (k, v) in fields {
        let v = v.as_str();
        match k.as_str() {
            "queue" if !v.is_empty() => q.queue = Some(v.to_owned()),
            "state" if !v.is_empty() => {
                if !crate::admin::STATES.contains(&v) {
                    return Err(ApiError::invalid(
                        "state",
                        format!(
                            "`{v}` is no job state ({})",
                            crate::admin::STATES.join(", ")
                        ),
                    ));
                }
                q.state = Some(v.to_owned());
            }
            "type" if !v.is_empty() => q.job_type = Some(v.to_owned()),
            "since" if !v.is_empty() => q.since = Some(time("since", v)?),
            "until" if !v.is_empty() => q.until = Some(time("until", v)?),
            "sort" => match v {
                "" | "created_at" => q.by_schedule = false,
                "scheduled_at" => q.by_schedule = true,
                "priority" => {
                    return Err(ApiError::Unsupported {
                        feature: "job lists sorted by priority",
                    })
                }
                other => {
                    return Err(ApiError::invalid(
                        "sort",
                        format!("`{other}`: sort by created_at or scheduled_at"),
                    ))
                }
            },
            "order" => match v {
                "" | "desc" => q.ascending = false,
                "asc" => q.ascending = true,
                _ => return Err(ApiError::invalid("order", "is asc or desc")),
            },
            _ => {}
        }
    }
    Ok(q)
}

/// `/ojs/v1/rate-limits…`: the keys, one key, its override.
async fn rate_limit_route(
    api: &Api,
    grant: &Grant<'_>,
    request: &Request<()>,
    rest: &[&str],
    body: Option<Value>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: request.uri().path().to_owned(),
        allowed,
    };
    let now = api.now();
    match rest {
        [] => {
            if *method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let (page, per_page) = page_query(request.uri().query().unwrap_or(""))?;
            let (keys, total) = api.rate_limits(grant, page, per_page).await?;
            let items: Vec<Value> = keys
                .iter()
                .map(|k| crate::rate_limits::key_json(k, now))
                .collect();
            Ok(json_response(
                200,
                &json!({"items": items, "rate_limits": items, "pagination": {"total": total, "page": page, "per_page": per_page}}),
                request_id,
            ))
        }
        [key] => {
            let key = query_value(key);
            let view = match *method {
                Method::GET => api.rate_limit(grant, &key).await?,
                Method::PUT => {
                    let body =
                        body.ok_or_else(|| ApiError::invalid("", "a JSON body is required"))?;
                    api.override_rate_limit(grant, &key, Some(body)).await?
                }
                _ => return Err(not_allowed("GET, PUT")),
            };
            Ok(json_response(
                200,
                &crate::rate_limits::key_json(&view, now),
                request_id,
            ))
        }
        [key, "override"] => {
            if *method != Method::DELETE {
                return Err(not_allowed("DELETE"));
            }
            let key = query_value(key);
            let view = api.override_rate_limit(grant, &key, None).await?;
            Ok(json_response(
                200,
                &crate::rate_limits::key_json(&view, now),
                request_id,
            ))
        }
        _ => Err(ApiError::NoRoute {
            method: method.to_string(),
            path: request.uri().path().to_owned(),
        }),
    }
}

/// `/ojs/v1/admin/stats`, `/queues…` and `/jobs…`.
async fn admin_route(
    api: &Api,
    grant: &Grant<'_>,
    request: &Request<()>,
    root: &str,
    rest: &[&str],
    body: Option<Value>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method().clone();
    let path = request.uri().path();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: path.to_owned(),
        allowed,
    };
    let query = request.uri().query().unwrap_or("");
    let pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (query_value(k), query_value(v))
        })
        .collect();
    let queue_json = |q: &crate::admin::AdminQueue| {
        json!({
            "name": q.name,
            "state": if q.paused { "paused" } else { "active" },
            "status": if q.paused { "paused" } else { "active" },
            "paused": q.paused,
            "created_at": crate::job::timestamp(q.created_at),
            "counts": q.counts,
            "throughput": {"processed_per_minute": q.processed_per_minute, "failed_per_minute": q.failed_per_minute},
        })
    };
    match (root, rest) {
        ("stats", []) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let s = api.admin_stats(grant).await?;
            Ok(json_response(
                200,
                &json!({
                    "queues": s.queues,
                    "workers": s.workers,
                    "jobs": s.jobs,
                    "throughput": {"processed_per_minute": s.processed_per_minute, "failed_per_minute": s.failed_per_minute},
                    "uptime_seconds": s.uptime_seconds,
                }),
                request_id,
            ))
        }
        ("stats", ["history"]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let field = |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| key == k)
                    .map(|(_, v)| v.clone())
                    .filter(|v| !v.is_empty())
            };
            let period_text = field("period").unwrap_or_else(|| "5m".into());
            let period = match period_text.as_str() {
                "1m" => Duration::from_secs(60),
                "5m" => Duration::from_secs(300),
                "1h" => Duration::from_secs(3600),
                "1d" => Duration::from_secs(86_400),
                _ => return Err(ApiError::invalid("period", "is 1m, 5m, 1h or 1d")),
            };
            let time = |k: &str| {
                field(k)
                    .map(|v| {
                        DateTime::parse_from_rfc3339(&v)
                            .map(|t| t.with_timezone(&chrono::Utc))
                            .map_err(|_| ApiError::invalid(k, "must be an RFC 3339 time"))
                    })
                    .transpose()
            };
            let points = api
                .admin_history(
                    grant,
                    period,
                    time("since")?,
                    time("until")?,
                    field("queue"),
                )
                .await?;
            let data: Vec<Value> = points
                .iter()
                .map(|p| {
                    json!({
                        "timestamp": crate::job::timestamp(p.at),
                        "processed": p.processed,
                        "failed": p.failed,
                        "enqueued": p.enqueued,
                        "latency_p50_ms": null,
                        "latency_p99_ms": null,
                    })
                })
                .collect();
            Ok(json_response(
                200,
                &json!({"period": period_text, "data": data}),
                request_id,
            ))
        }
        ("system", ["maintenance"]) => {
            let state = match method {
                Method::GET => api.read_maintenance(grant).await?,
                Method::POST => {
                    let body = body.unwrap_or(Value::Null);
                    let enabled = match body.get("enabled") {
                        Some(Value::Bool(b)) => *b,
                        _ => return Err(ApiError::invalid("enabled", "is required: true or false")),
                    };
                    let reason = match body.get("reason") {
                        None | Some(Value::Null) => None,
                        Some(Value::String(r)) => Some(r.clone()),
                        Some(_) => return Err(ApiError::invalid("reason", "must be a string")),
                    };
                    let expected = ["duration", "estimated_duration"]
                        .iter()
                        .find_map(|k| body.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
                        .map(|(k, v)| expected_duration(k, v))
                        .transpose()?;
                    api.set_maintenance(grant, enabled, reason, expected).await?
                }
                _ => return Err(not_allowed("GET, POST")),
            };
            let t = |at: Option<chrono::DateTime<chrono::Utc>>| at.map(crate::job::timestamp);
            Ok(json_response(
                200,
                &json!({
                    "enabled": state.enabled,
                    "maintenance": state.enabled,
                    "reason": state.reason,
                    "started_at": t(state.started_at),
                    "enabled_at": t(state.started_at),
                    "ends_at": t(state.ends_at),
                    "estimated_end": t(state.ends_at),
                }),
                request_id,
            ))
        }
        ("queues", []) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let (page, per_page) = page_query(query)?;
            let all = api.admin_queues(grant).await?;
            let items: Vec<Value> = all
                .iter()
                .skip((page - 1).saturating_mul(per_page))
                .take(per_page)
                .map(queue_json)
                .collect();
            Ok(json_response(
                200,
                &json!({"items": items, "queues": items, "pagination": {"total": all.len(), "page": page, "per_page": per_page}}),
                request_id,
            ))
        }
        ("queues", [name]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let q = api.admin_queue(grant, name).await?;
            let mut v = queue_json(&q);
            let config = api.queue_config(grant, name).await?;
            v["configuration"] = config.clone();
            v["config"] = config;
            Ok(json_response(200, &v, request_id))
        }
        ("queues", [name, "config"]) => match method {
            Method::GET => {
                let config = api.queue_config(grant, name).await?;
                Ok(json_response(
                    200,
                    &json!({"name": name, "config": config, "configuration": config}),
                    request_id,
                ))
            }
            Method::PUT => {
                let body = body.ok_or_else(|| ApiError::invalid("", "a JSON body is required"))?;
                let config = api.set_queue_config(grant, name, body).await?;
                Ok(json_response(
                    200,
                    &json!({"name": name, "config": config, "configuration": config}),
                    request_id,
                ))
            }
            _ => Err(not_allowed("GET, PUT")),
        },
        ("queues", [name, "rate-limit"]) => {
            if method != Method::PUT {
                return Err(not_allowed("PUT"));
            }
            // `{limit, period}` (or `max_per_second`), `null` for none,
            // and a `concurrency` beside it.
            let body = body.unwrap_or(Value::Null);
            let mut config = Map::new();
            match &body {
                Value::Object(m) => {
                    let mut rate = m.clone();
                    if let Some(c) = rate.remove("concurrency") {
                        config.insert("concurrency".into(), c);
                    }
                    if !rate.is_empty() {
                        config.insert("rate_limit".into(), Value::Object(rate));
                    }
                }
                Value::Null => {
                    config.insert("rate_limit".into(), Value::Null);
                }
                _ => {
                    return Err(ApiError::invalid(
                        "",
                        "the body must be {limit, period}, {max_per_second} or null",
                    ))
                }
            }
            let config = api
                .set_queue_config(grant, name, Value::Object(config))
                .await?;
            Ok(json_response(
                200,
                &json!({"name": name, "rate_limit": config["rate_limit"], "config": config}),
                request_id,
            ))
        }
        ("queues", [name, action @ ("pause" | "resume")]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let state = if *action == "pause" {
                api.pause_queue(grant, name).await?
            } else {
                api.resume_queue(grant, name).await?
            };
            let at = if state.paused {
                "paused_at"
            } else {
                "resumed_at"
            };
            Ok(json_response(
                200,
                &json!({
                    "name": state.name,
                    "paused": state.paused,
                    at: crate::job::timestamp(state.at),
                    "queue": {"name": state.name, "paused": state.paused},
                }),
                request_id,
            ))
        }
        ("jobs", []) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let (page, per_page) = page_query(query)?;
            let listed = api
                .admin_jobs(grant, job_query(&pairs)?, page, per_page)
                .await?;
            let items: Vec<Value> = listed.items.iter().map(Job::to_json).collect();
            Ok(json_response(
                200,
                &json!({"items": items, "jobs": items, "pagination": {"total": listed.total, "total_capped": listed.total_capped, "page": listed.page, "per_page": listed.per_page}}),
                request_id,
            ))
        }
        ("jobs", ["bulk", action]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let action = match *action {
                "retry" => crate::admin::BulkAction::Retry,
                "cancel" => crate::admin::BulkAction::Cancel,
                "delete" => crate::admin::BulkAction::Delete,
                _ => {
                    return Err(ApiError::NoRoute {
                        method: method.to_string(),
                        path: path.to_owned(),
                    })
                }
            };
            let body = body.unwrap_or(Value::Null);
            let confirm = body.get("confirm").and_then(Value::as_bool) == Some(true);
            let filter: Vec<(String, String)> = match body.get("filter") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Object(f)) => f
                    .iter()
                    .map(|(k, v)| {
                        let text = match v {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        (k.clone(), text)
                    })
                    .collect(),
                Some(_) => return Err(ApiError::invalid("filter", "must be an object")),
            };
            let outcome = api
                .bulk(grant, action, job_query(&filter)?, confirm)
                .await?;
            let errors: Vec<Value> = outcome
                .errors
                .iter()
                .map(|(id, e)| json!({"job_id": id, "error": e}))
                .collect();
            Ok(json_response(
                200,
                &json!({
                    "action": outcome.action.as_str(),
                    "matched": outcome.matched,
                    "succeeded": outcome.succeeded,
                    "failed": outcome.errors.len(),
                    "errors": errors,
                }),
                request_id,
            ))
        }
        ("jobs", [id]) => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            grant.allow(crate::auth::Operation::Admin)?;
            let job = api.info(grant, id).await?;
            Ok(json_response(200, &admin_job(&job), request_id))
        }
        ("jobs", [id, "cancel"]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let (_, job) = api.cancel(grant, id).await?;
            Ok(json_response(200, &admin_job(&job), request_id))
        }
        ("jobs", [id, "retry"]) => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let job = api.retry_dead_letter(grant, id).await?;
            Ok(json_response(200, &admin_job(&job), request_id))
        }
        // The rest of the admin API (queue configuration) is not served
        // yet.
        _ => Err(ApiError::Unsupported {
            feature: "admin endpoints other than stats, queues, jobs, maintenance, workers and dead letters",
        }),
    }
}

/// How long a maintenance is expected to last: seconds, or a number and a
/// unit (`90s`, `15m`, `2h`, `1d`), at most a week.
fn expected_duration(field: &str, v: &Value) -> Result<Duration, ApiError> {
    let bad = || {
        ApiError::invalid(
            field,
            "is seconds, or a number with s, m, h or d (`15m`), at most a week",
        )
    };
    let seconds = match v {
        Value::Number(n) => n.as_u64().ok_or_else(bad)?,
        Value::String(t) => {
            let t = t.trim();
            let (n, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
            let n: u64 = n.parse().map_err(|_| bad())?;
            let per = match unit {
                "" | "s" => 1,
                "m" => 60,
                "h" => 3_600,
                "d" => 86_400,
                _ => return Err(bad()),
            };
            n.checked_mul(per).ok_or_else(bad)?
        }
        _ => return Err(bad()),
    };
    if seconds > 7 * 86_400 {
        return Err(bad());
    }
    Ok(Duration::from_secs(seconds))
}

/// A job as the admin UI's job page reads it: the job's fields at the top
/// (with `errors` always an array and `retry_policy`), the lifecycle times
/// under `metadata`, and the job under `job` too.
fn admin_job(job: &Job) -> Value {
    let mut v = job.to_json();
    if !v.get("errors").is_some_and(Value::is_array) {
        v["errors"] = json!([]);
    }
    // The drawer lists each error's backtrace as an array.
    if let Some(Value::Array(errors)) = v.get_mut("errors") {
        for e in errors.iter_mut().filter_map(Value::as_object_mut) {
            if !e.get("backtrace").is_some_and(Value::is_array) {
                let lines: Vec<Value> = match e.get("backtrace") {
                    Some(Value::String(s)) => s.lines().map(|l| json!(l)).collect(),
                    _ => Vec::new(),
                };
                e.insert("backtrace".into(), Value::Array(lines));
            }
        }
    }
    // The policy the job is retried by: its own, else the defaults.
    v["retry_policy"] = match v.get("retry").filter(|r| !r.is_null()) {
        Some(retry) => retry.clone(),
        None => json!({
            "max_attempts": crate::job::max_attempts(&job.envelope),
            "initial_interval": "PT1S",
            "backoff_coefficient": 2.0,
            "max_interval": "PT5M",
            "jitter": true,
            "non_retryable_errors": [],
        }),
    };
    if v.get("result").is_none() {
        v["result"] = Value::Null;
    }
    let mut metadata = serde_json::Map::new();
    for k in [
        "created_at",
        "enqueued_at",
        "started_at",
        "scheduled_at",
        "completed_at",
        "cancelled_at",
        "discarded_at",
    ] {
        if let Some(t) = v.get(k).filter(|t| !t.is_null()) {
            metadata.insert(k.into(), t.clone());
        }
    }
    v["metadata"] = Value::Object(metadata);
    job_body(v)
}

/// `/ojs/v1/admin/workers…`: the roster, and the operator's directives.
async fn worker_admin_route(
    api: &Api,
    grant: &Grant<'_>,
    request: &Request<()>,
    rest: &[&str],
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method();
    let path = request.uri().path();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: path.to_owned(),
        allowed,
    };
    match rest {
        [] => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let (page, per_page) = page_query(request.uri().query().unwrap_or(""))?;
            Ok(json_response(
                200,
                &json!(api.workers_list(grant, page, per_page).await?),
                request_id,
            ))
        }
        [id] => match *method {
            Method::GET => Ok(json_response(
                200,
                &json!({"worker": api.worker_info(grant, id).await?}),
                request_id,
            )),
            Method::DELETE => {
                api.deregister(grant, id).await?;
                Ok(json_response(
                    200,
                    &json!({"deleted": true, "worker_id": id}),
                    request_id,
                ))
            }
            _ => Err(not_allowed("GET, DELETE")),
        },
        [id, action @ ("quiet" | "terminate")] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let directive = if *action == "quiet" {
                Directive::Quiet
            } else {
                Directive::Terminate
            };
            Ok(json_response(
                200,
                &json!({"worker": api.direct(grant, id, directive).await?}),
                request_id,
            ))
        }
        _ => Err(ApiError::NoRoute {
            method: method.to_string(),
            path: path.to_owned(),
        }),
    }
}

/// A workflow answer: the workflow under `workflow` (as the conformance
/// cases read it) and its fields at the top level (as the admin UI reads
/// them).
fn workflow_body(view: &crate::workflow::WorkflowView) -> Value {
    let mut v = view.to_json();
    // What the admin UI's workflow page reads, there while unset.
    if let Value::Object(m) = &mut v {
        m.entry("completed_at").or_insert(Value::Null);
        m.entry("meta").or_insert_with(|| json!({}));
    }
    job_body(v).as_object().map_or(Value::Null, |m| {
        let mut m = m.clone();
        if let Some(w) = m.remove("job") {
            m.insert("workflow".into(), w);
        }
        Value::Object(m)
    })
}

/// `/ojs/v1/workflows`: create, list, read, cancel (`DELETE` or `POST
/// …/cancel`), progress.
async fn workflow_route(
    api: &Api,
    grant: &Grant<'_>,
    request: &Request<()>,
    rest: &[&str],
    body: Option<Value>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method();
    let path = request.uri().path();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: path.to_owned(),
        allowed,
    };
    let cancelled = |view: &crate::workflow::WorkflowView| {
        let mut b = workflow_body(view);
        let steps = &view.workflow.steps;
        let count =
            |s: crate::model::workflow::StepState| steps.iter().filter(|x| x.state == s).count();
        b["steps_cancelled"] = json!(count(crate::model::workflow::StepState::Cancelled));
        b["steps_already_completed"] = json!(count(crate::model::workflow::StepState::Completed));
        b
    };
    match rest {
        [] => match *method {
            Method::POST => {
                let view = api
                    .create_workflow(grant, body.unwrap_or(Value::Null))
                    .await?;
                let mut r = json_response(201, &workflow_body(&view), request_id);
                if let Ok(v) =
                    HeaderValue::from_str(&format!("/ojs/v1/workflows/{}", view.workflow.id))
                {
                    r.headers_mut().insert(http::header::LOCATION, v);
                }
                Ok(r)
            }
            Method::GET => {
                let query = request.uri().query().unwrap_or("");
                let (page, per_page) = page_query(query)?;
                let state = query
                    .split('&')
                    .filter_map(|p| p.split_once('='))
                    .find(|(k, _)| *k == "state")
                    .map(|(_, v)| v.to_owned())
                    .filter(|v| !v.is_empty());
                let listed = api.workflows(grant, state, page, per_page).await?;
                let items: Vec<Value> = listed
                    .items
                    .iter()
                    .map(|w| w.to_json(&Default::default()))
                    .collect();
                Ok(json_response(
                    200,
                    &json!({
                        "items": items,
                        "workflows": items,
                        "pagination": {"page": listed.page, "per_page": listed.per_page, "has_more": listed.has_more},
                    }),
                    request_id,
                ))
            }
            _ => Err(not_allowed("GET, POST")),
        },
        [id] => match *method {
            Method::GET => Ok(json_response(
                200,
                &workflow_body(&api.workflow(grant, id).await?),
                request_id,
            )),
            Method::DELETE => Ok(json_response(
                200,
                &cancelled(&api.cancel_workflow(grant, id).await?),
                request_id,
            )),
            _ => Err(not_allowed("GET, DELETE")),
        },
        [id, "cancel"] => match *method {
            Method::POST => Ok(json_response(
                200,
                &cancelled(&api.cancel_workflow(grant, id).await?),
                request_id,
            )),
            _ => Err(not_allowed("POST")),
        },
        [id, "progress"] => match *method {
            Method::GET => {
                let view = api.workflow(grant, id).await?;
                let w = view.to_json();
                let total = view.workflow.steps.len().max(1);
                let steps: Vec<Value> = w["steps"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        let done = s["state"] == "completed";
                        json!({"id": s["id"], "state": s["state"], "progress": if done { 1.0 } else { 0.0 }})
                    })
                    .collect();
                Ok(json_response(
                    200,
                    &json!({
                        "workflow_id": view.workflow.id,
                        "state": w["state"],
                        "progress": view.workflow.completed() as f64 / total as f64,
                        "steps": steps,
                        "updated_at": w.get("completed_at").or(w.get("cancelled_at")).unwrap_or(&w["created_at"]),
                    }),
                    request_id,
                ))
            }
            _ => Err(not_allowed("GET")),
        },
        _ => Err(ApiError::NoRoute {
            method: method.to_string(),
            path: path.to_owned(),
        }),
    }
}

/// `/ojs/v1/cron` (and the admin UI's `/ojs/v1/crons`): register, list,
/// read, enable or disable, delete.
async fn cron_route(
    api: &Api,
    grant: &Grant<'_>,
    request: &Request<()>,
    root: &str,
    rest: &[&str],
    body: Option<Value>,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method();
    let path = request.uri().path();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: path.to_owned(),
        allowed,
    };
    // Each client reads the cron under its own key.
    let one = |cron: &CronJob| {
        let c = cron.to_json();
        json!({"cron": c, "cron_job": c})
    };
    match rest {
        [] => match *method {
            Method::GET => {
                let query = request.uri().query().unwrap_or("");
                let enabled = cron_enabled_query(query)?;
                let all = api.crons(grant, enabled).await?;
                let total = all.len();
                let (page, per_page) = if query.contains("page") {
                    page_query(query)?
                } else {
                    (1, total.max(1))
                };
                let items: Vec<Value> = all
                    .iter()
                    .skip((page - 1).saturating_mul(per_page))
                    .take(per_page)
                    .map(CronJob::to_json)
                    .collect();
                let has_more = page.saturating_mul(per_page) < total;
                Ok(json_response(
                    200,
                    &json!({
                        "crons": items,
                        "cron_jobs": items,
                        "items": items,
                        "count": items.len(),
                        "pagination": {"total": total, "page": page, "per_page": per_page, "has_more": has_more},
                    }),
                    request_id,
                ))
            }
            Method::POST => {
                let (cron, new) = api
                    .register_cron(grant, body.unwrap_or(Value::Null))
                    .await?;
                let mut r = json_response(if new { 201 } else { 200 }, &one(&cron), request_id);
                if let Ok(v) = HeaderValue::from_str(&format!("/ojs/v1/{root}/{}", cron.name)) {
                    r.headers_mut().insert(LOCATION, v);
                }
                Ok(r)
            }
            _ => Err(not_allowed("GET, POST")),
        },
        [name] => match *method {
            Method::GET => Ok(json_response(
                200,
                &one(&api.cron(grant, name).await?),
                request_id,
            )),
            Method::PATCH | Method::PUT => {
                let enabled = match body.as_ref().and_then(|b| b.get("enabled")) {
                    Some(Value::Bool(b)) => *b,
                    _ => {
                        return Err(ApiError::invalid(
                            "enabled",
                            "`enabled` (a boolean) is what a cron job's PATCH changes; register it again to change the rest",
                        ))
                    }
                };
                let cron = api.set_cron_enabled(grant, name, enabled).await?;
                Ok(json_response(200, &one(&cron), request_id))
            }
            Method::DELETE => {
                let cron = api.delete_cron(grant, name).await?;
                Ok(json_response(
                    200,
                    &json!({"deleted": true, "name": cron.name, "cron": cron.to_json()}),
                    request_id,
                ))
            }
            _ => Err(not_allowed("GET, PATCH, DELETE")),
        },
        [name, action @ ("enable" | "disable" | "pause" | "resume")] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let enabled = matches!(*action, "enable" | "resume");
            let cron = api.set_cron_enabled(grant, name, enabled).await?;
            Ok(json_response(200, &one(&cron), request_id))
        }
        _ => Err(ApiError::NoRoute {
            method: method.to_string(),
            path: path.to_owned(),
        }),
    }
}

/// A queue's statistics as every client reads them: the counts by state
/// under `queue` (the cases) and `stats` (the spec), with the rates.
fn queue_stats_body(s: &crate::queues::QueueStats) -> Value {
    let status = if s.paused { "paused" } else { "active" };
    let mut queue = json!({"name": s.name, "paused": s.paused, "status": status});
    let mut stats = json!({
        "completed_last_hour": s.completed_last_hour,
        "failed_last_hour": s.failed_last_hour,
        "dead": s.dead,
        "avg_duration_ms": s.avg_duration_ms,
        "avg_wait_ms": s.avg_wait_ms,
        "throughput_per_second": s.throughput_per_second,
        "broker_depth": s.broker_depth,
    });
    queue["broker_depth"] = json!(s.broker_depth);
    for (state, n) in &s.by_state {
        queue[*state] = json!(n);
        stats[*state] = json!(n);
    }
    json!({
        "name": s.name,
        "paused": s.paused,
        "status": status,
        "queue": queue,
        "stats": stats,
        "computed_at": job::timestamp(s.computed_at),
    })
}

/// `enabled=true|false` of a cron list.
fn cron_enabled_query(query: &str) -> Result<Option<bool>, ApiError> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("enabled", "true")) => return Ok(Some(true)),
            Some(("enabled", "false")) => return Ok(Some(false)),
            Some(("enabled", _)) => {
                return Err(ApiError::invalid("enabled", "must be true or false"))
            }
            _ => {}
        }
    }
    Ok(None)
}

/// The answer of ACK and NACK: the binding's fields at the top (`job_id`
/// and `id`, as the cases read), and the whole job.
/// The answer to an ACK or a NACK: the fields of [`settle_body`], written
/// straight.
fn settle_response(job: &Job, acknowledged: bool, request_id: &str) -> Response<Bytes> {
    written_response(
        200,
        |out| write_settled(out, job, acknowledged),
        || settle_body(job, acknowledged),
        request_id,
    )
}

/// [`settle_body`]'s object, in its order, written straight into `out`.
fn write_settled(
    out: &mut Vec<u8>,
    job: &Job,
    acknowledged: bool,
) -> Result<(), ojs_core::json_out::Error> {
    let mut o = ojs_core::json_out::Object::open(out);
    o.key_text("\"job_id\":");
    o.str_value(&job.envelope.id);
    o.key_text("\"id\":");
    o.str_value(&job.envelope.id);
    o.key_text("\"state\":");
    o.str_value(job.state().as_str().unwrap_or("unknown"));
    o.key_text("\"attempt\":");
    o.value(&job.envelope.attempt)?;
    o.key_text("\"max_attempts\":");
    o.value(&job::max_attempts(&job.envelope))?;
    o.key_text("\"job\":");
    JobJson(job).write(o.raw_value())?;
    if acknowledged {
        o.key_text("\"acknowledged\":");
        o.value(&true)?;
    }
    if let Some(t) = job.envelope.completed_at {
        o.key_text("\"completed_at\":");
        // As `job::timestamp` writes it.
        o.time_value(&t, chrono::SecondsFormat::Millis);
    }
    if let Some(v) = job.extra.get("next_attempt_at") {
        o.key_text("\"next_attempt_at\":");
        o.value(v)?;
    }
    if let Some(v) = job.extra.get("retry_delay_ms") {
        o.key_text("\"retry_delay_ms\":");
        o.value(v)?;
    }
    if let Some(v) = job.extra.get("discarded_at") {
        o.key_text("\"discarded_at\":");
        o.value(v)?;
    }
    o.close();
    Ok(())
}

fn settle_body(job: &Job, acknowledged: bool) -> Value {
    let mut body = json!({
        "job_id": job.envelope.id,
        "id": job.envelope.id,
        "state": job.state().as_str().unwrap_or("unknown"),
        "attempt": job.envelope.attempt,
        "max_attempts": job::max_attempts(&job.envelope),
        "job": job.to_json(),
    });
    if acknowledged {
        body["acknowledged"] = json!(true);
    }
    if let Some(t) = job.envelope.completed_at {
        body["completed_at"] = json!(job::timestamp(t));
    }
    for k in ["next_attempt_at", "retry_delay_ms", "discarded_at"] {
        if let Some(v) = job.extra.get(k) {
            body[k] = v.clone();
        }
    }
    body
}

/// `page` (from 1) and `per_page` (1…100, default 20) of a list.
fn page_query(query: &str) -> Result<(usize, usize), ApiError> {
    let mut page = 1;
    let mut per_page = 20;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let number = |field: &str, max: usize| {
            v.parse::<usize>()
                .ok()
                .filter(|n| (1..=max).contains(n))
                .ok_or_else(|| {
                    ApiError::invalid(field, format!("must be a whole number from 1 to {max}"))
                })
        };
        match k {
            "page" => page = number("page", usize::MAX)?,
            "per_page" => per_page = number("per_page", 100)?,
            _ => {}
        }
    }
    Ok((page, per_page))
}

/// Answers that have only a JSON form.
fn json_only(headers: &HeaderMap) -> Result<(), ApiError> {
    match answer_encoding(headers)? {
        Encoding::OjsJson => Ok(()),
        _ => Err(ApiError::NotAcceptable {
            accept: headers
                .get(ACCEPT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned(),
        }),
    }
}

/// The job of a PUSH body, validated.
pub fn read_job(
    headers: &HeaderMap,
    body: Bytes,
    max_values: usize,
    now: DateTime<Utc>,
) -> Result<Job, ApiError> {
    match body_encoding(headers)? {
        // As a JSON body's values are counted on its bytes, a protobuf
        // body's are counted as they are decoded.
        Encoding::OjsProto => {
            ojs_core::envelope::value::with_value_budget(max_values, || job::from_proto(&body, now))
        }
        // The common body in one pass over its text; anything else (and
        // every error) as a parsed body.
        _ => match job::push_in_one_pass(&body, now) {
            Some((envelope, pending)) => job::accept(envelope, pending, now),
            None => job::from_json(parse_json(&body)?, now),
        },
    }
}

/// A JSON body, parsed (its shape checked first by the caller,
/// [`limits::check_json_shape`]).
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::InvalidPayload {
            encoding: "JSON",
            reason: "the body is empty".into(),
        });
    }
    serde_json::from_slice(body).map_err(|e| ApiError::InvalidPayload {
        encoding: "JSON",
        reason: e.to_string(),
    })
}

fn read_batch(api: &Api, headers: &HeaderMap, body: Bytes) -> Result<Vec<Job>, ApiError> {
    ojs_core::envelope::value::with_value_budget(api.settings().max_json_values, || {
        batch(headers, &body, api.settings().max_batch_jobs, api.now())
    })
}

/// The jobs of a batch PUSH body (at most `limit`), validated.
pub fn batch(
    headers: &HeaderMap,
    body: &[u8],
    limit: usize,
    now: DateTime<Utc>,
) -> Result<Vec<Job>, ApiError> {
    let too_many = |count| ApiError::BatchTooLarge { count, limit };
    let jobs = match body_encoding(headers)? {
        Encoding::OjsProto => {
            let parts = ojs_core::envelope::stream::split_batch(body).map_err(|e| {
                ApiError::InvalidPayload {
                    encoding: "protobuf BatchEnqueueRequest",
                    reason: e.to_string(),
                }
            })?;
            if parts.len() > limit {
                return Err(too_many(parts.len()));
            }
            parts
                .into_iter()
                .enumerate()
                .map(|(i, bytes)| job::from_proto(bytes, now).map_err(|e| e.at_index(i)))
                .collect::<Result<Vec<_>, _>>()?
        }
        _ => {
            if let Some(read) = job::batch_in_one_pass(body, limit, now) {
                // A list sized at once: collected through `Result`, it
                // began at four jobs and was copied as it grew.
                let mut jobs = Vec::with_capacity(read.len());
                for (i, (envelope, pending)) in read.into_iter().enumerate() {
                    jobs.push(job::accept(envelope, pending, now).map_err(|e| e.at_index(i))?);
                }
                jobs
            } else {
                let body = parse_json(body)?;
                let Value::Object(mut body) = body else {
                    return Err(ApiError::invalid(
                        "jobs",
                        "the body must be {\"jobs\": [...]}",
                    ));
                };
                let Some(Value::Array(items)) = body.remove("jobs") else {
                    return Err(ApiError::invalid(
                        "jobs",
                        "`jobs` is required: an array of jobs",
                    ));
                };
                if items.len() > limit {
                    return Err(too_many(items.len()));
                }
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, item)| job::from_json(item, now).map_err(|e| e.at_index(i)))
                    .collect::<Result<Vec<_>, _>>()?
            }
        }
    };
    if jobs.is_empty() {
        return Err(ApiError::invalid("jobs", "the batch has no jobs"));
    }
    let mut ids: Vec<&str> = jobs.iter().map(|j| j.envelope.id.as_str()).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(ApiError::Duplicate {
            id: w[0].to_owned(),
        });
    }
    Ok(jobs)
}

/// An answer about one job: the job under `job` (as the conformance cases
/// read it) and its fields at the top level too (as the official Rust SDK
/// and the admin UI's job page read them), as ACK answers `id` beside
/// `job_id`.
fn job_body(job: Value) -> Value {
    let mut body = match &job {
        Value::Object(fields) => fields.clone(),
        _ => Map::new(),
    };
    body.insert("job".into(), job);
    Value::Object(body)
}

/// The job as a protobuf `JobEnvelope`: the binding's fields the envelope
/// has no number for ride in its unknown attributes.
fn job_proto(job: &Job) -> ojs_core::JobEnvelope {
    let mut e = job.envelope.clone();
    for (k, v) in &job.extra {
        e.unknown_attributes.insert(k.clone(), v.clone());
    }
    e
}

fn job_response(
    status: u16,
    job: &Job,
    answer: Encoding,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    if answer != Encoding::OjsProto {
        // INFO answers with the job's fields at the top too; a PUSH answers
        // `{"job": …}` alone, as every SDK reads it (a large job is not
        // answered twice over).
        if status == 201 {
            return Ok(written_response(
                status,
                |out| {
                    let mut o = ojs_core::json_out::Object::open(out);
                    o.key_text("\"job\":");
                    JobJson(job).write(o.raw_value())?;
                    o.close();
                    Ok(())
                },
                || json!({"job": job.to_json()}),
                request_id,
            ));
        }
        return Ok(json_response(status, &job_body(job.to_json()), request_id));
    }
    let bytes = job_proto(job)
        .to_proto_bytes()
        .map_err(job::invalid_envelope)?;
    Ok(proto_response(status, bytes, request_id))
}

/// `{"jobs": [...]}` (a FETCH) or `{"jobs": [...], "count": n}` (a batch
/// PUSH), written straight.
fn write_job_list(
    out: &mut Vec<u8>,
    jobs: &[Job],
    count: Option<usize>,
) -> Result<(), ojs_core::json_out::Error> {
    let mut o = ojs_core::json_out::Object::open(out);
    o.key_text("\"jobs\":");
    let list = o.raw_value();
    list.push(b'[');
    for (n, job) in jobs.iter().enumerate() {
        if n > 0 {
            list.push(b',');
        }
        JobJson(job).write(list)?;
    }
    list.push(b']');
    if let Some(count) = count {
        o.key_text("\"count\":");
        o.value(&count)?;
    }
    o.close();
    Ok(())
}

fn batch_response(
    jobs: &[Job],
    answer: Encoding,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    if answer != Encoding::OjsProto {
        return Ok(written_response(
            201,
            |out| write_job_list(out, jobs, Some(jobs.len())),
            || json!({"jobs": jobs.iter().map(Job::to_json).collect::<Vec<_>>(), "count": jobs.len()}),
            request_id,
        ));
    }
    let envelopes: Vec<_> = jobs.iter().map(job_proto).collect();
    let bytes =
        ojs_core::envelope::stream::encode_batch(&envelopes).map_err(job::invalid_envelope)?;
    Ok(proto_response(201, bytes, request_id))
}

fn proto_response(status: u16, body: Vec<u8>, request_id: &str) -> Response<Bytes> {
    let mut r = Response::new(Bytes::from(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(OJS_PROTO));
    standard_headers(r.headers_mut(), request_id);
    r
}

/// `/ojs/v1/dead-letter…` and its admin form (`admin`: a page of `items`
/// with `page`/`per_page`, and 204 for a delete, as the extension's cases
/// read).
async fn dead_letter_route(
    api: &Api,
    grant: &crate::auth::Grant<'_>,
    request: &Request<()>,
    rest: &[&str],
    admin: bool,
    request_id: &str,
) -> Result<Response<Bytes>, ApiError> {
    let method = request.method();
    let not_allowed = |allowed| ApiError::MethodNotAllowed {
        path: request.uri().path().to_owned(),
        allowed,
    };
    match rest {
        [] => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let (query, page) = dead_letter_query(request.uri().query().unwrap_or(""))?;
            let (jobs, total) = api.dead_letters(grant, &query).await?;
            let jobs: Vec<Value> = jobs.iter().map(Job::to_json).collect();
            let shown = query.offset + jobs.len();
            let body = if admin {
                json!({"items": jobs, "pagination": {"total": total, "page": page, "per_page": query.limit}})
            } else {
                json!({
                    "jobs": jobs,
                    "pagination": {"total": total, "limit": query.limit, "offset": query.offset,
                                   "has_more": shown < total},
                    "next_cursor": (shown < total).then(|| shown.to_string()),
                })
            };
            Ok(json_response(200, &body, request_id))
        }
        ["stats"] => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            Ok(json_response(
                200,
                &api.dead_letter_stats(grant).await?.to_json(),
                request_id,
            ))
        }
        [id] => match *method {
            Method::GET => {
                let job = api.dead_letter(grant, id).await?;
                Ok(json_response(200, &job_body(job.to_json()), request_id))
            }
            Method::DELETE => {
                api.delete_dead_letter(grant, id).await?;
                if admin {
                    let mut r = Response::new(Bytes::new());
                    *r.status_mut() = StatusCode::NO_CONTENT;
                    standard_headers(r.headers_mut(), request_id);
                    Ok(r)
                } else {
                    Ok(json_response(
                        200,
                        &json!({"deleted": true, "job_id": id}),
                        request_id,
                    ))
                }
            }
            _ => Err(not_allowed("GET, DELETE")),
        },
        [id, "retry"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let job = api.retry_dead_letter(grant, id).await?;
            Ok(json_response(200, &job_body(job.to_json()), request_id))
        }
        _ => Err(ApiError::NoRoute {
            method: method.to_string(),
            path: request.uri().path().to_owned(),
        }),
    }
}

/// The list's query: `queue`, `type` (a pattern), `limit` (1–1000,
/// default 50) and `offset` or `cursor` (the `next_cursor` of the page
/// before), or `page` and `per_page`; and the page number.
fn dead_letter_query(query: &str) -> Result<(DeadLetterQuery, usize), ApiError> {
    let mut q = DeadLetterQuery {
        limit: 50,
        ..DeadLetterQuery::default()
    };
    let mut page = None;
    let number = |k: &str, v: &str, max: usize| -> Result<usize, ApiError> {
        v.parse::<usize>()
            .ok()
            .filter(|n| *n <= max)
            .ok_or_else(|| ApiError::invalid(k, format!("must be an integer from 0 to {max}")))
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "queue" if !v.is_empty() => q.queue = Some(v.to_owned()),
            "type" if !v.is_empty() => {
                q.job_type =
                    Some(ojs_core::glob::Glob::new(v).map_err(|e| ApiError::invalid("type", e))?)
            }
            "limit" | "per_page" => {
                q.limit = number(k, v, 1000)?.max(1);
            }
            "offset" | "cursor" => q.offset = number(k, v, usize::MAX)?,
            "page" => page = Some(number(k, v, usize::MAX)?.max(1)),
            _ => {}
        }
    }
    if let Some(p) = page {
        q.offset = (p - 1).saturating_mul(q.limit);
    }
    let page = q.offset / q.limit + 1;
    Ok((q, page))
}

fn event_filter(query: &str) -> Result<EventFilter, ApiError> {
    let mut f = EventFilter {
        limit: 100,
        ..EventFilter::default()
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = query_value(v);
        let list = || {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        };
        match k {
            "after" | "cursor" => {
                f.after = v.parse().map_err(|_| {
                    ApiError::invalid(k, "must be a cursor returned by this endpoint")
                })?
            }
            // `type` is the admin UI's name, `event_types` the stream's.
            "types" | "type" | "event_types" => f.types = list(),
            "queues" => f.queues = list(),
            "job_types" => f.job_types = list(),
            "limit" => {
                let n: usize = v
                    .parse()
                    .map_err(|_| ApiError::invalid("limit", "must be an integer from 1 to 1000"))?;
                if !(1..=1000).contains(&n) {
                    return Err(ApiError::invalid(
                        "limit",
                        "must be an integer from 1 to 1000",
                    ));
                }
                f.limit = n;
            }
            _ => {}
        }
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's id: the client's `X-Request-ID` when it is one (printable
    /// ASCII, 1–128 bytes), else `req_` and a fresh UUIDv7.
    #[test]
    fn a_request_keeps_its_id_or_gets_a_fresh_one() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(value) {
                headers.insert(X_REQUEST_ID, v);
            }
            request_id(&headers)
        };
        assert_eq!(with("abc-123"), "abc-123");
        let long = "x".repeat(128);
        assert_eq!(with(&long), long);
        let mut fresh = Vec::new();
        for value in ["", "has space", &"x".repeat(129)] {
            let id = with(value);
            let Some(uuid) = id.strip_prefix("req_") else {
                panic!("{value:?} gave {id}");
            };
            let parsed = uuid::Uuid::parse_str(uuid).unwrap_or_else(|e| panic!("{id}: {e}"));
            assert_eq!(parsed.get_version_num(), 7, "{id}");
            assert_eq!(
                uuid,
                parsed.hyphenated().to_string(),
                "lowercase, hyphenated"
            );
            fresh.push(id);
        }
        fresh.push(request_id(&HeaderMap::new()));
        fresh.sort();
        fresh.dedup();
        assert_eq!(fresh.len(), 4, "each fresh id is new");
        let mut answer = HeaderMap::new();
        standard_headers(&mut answer, "abc-123");
        assert_eq!(
            answer.get("x-request-id").and_then(|v| v.to_str().ok()),
            Some("abc-123")
        );
        assert_eq!(
            answer.get("ojs-version").and_then(|v| v.to_str().ok()),
            Some(OJS_VERSION)
        );
    }

    /// The answer's encoding by `Accept`, the binding's alias for protobuf
    /// included, with and without other media types around it.
    #[test]
    fn an_answer_is_encoded_as_accept_asks() {
        let asked = |accept: Option<&str>| {
            let mut headers = HeaderMap::new();
            if let Some(a) = accept {
                headers.insert(
                    ACCEPT,
                    HeaderValue::from_str(a).unwrap_or(HeaderValue::from_static("")),
                );
            }
            answer_encoding(&headers)
        };
        for (accept, expected) in [
            (None, Encoding::OjsJson),
            (Some(""), Encoding::OjsJson),
            (Some("*/*"), Encoding::OjsJson),
            (Some("application/json"), Encoding::OjsJson),
            (Some(OJS_JSON), Encoding::OjsJson),
            (Some(OJS_PROTO), Encoding::OjsProto),
            (Some(OJS_PROTOBUF_ALIAS), Encoding::OjsProto),
            (
                Some("text/html;q=0.9, application/openjobspec+protobuf"),
                Encoding::OjsProto,
            ),
            (
                Some("application/openjobspec+protobuf;q=0.1, application/json"),
                Encoding::OjsJson,
            ),
        ] {
            match asked(accept) {
                Ok(e) => assert_eq!(e, expected, "{accept:?}"),
                Err(e) => panic!("{accept:?}: {e}"),
            }
        }
        for accept in ["text/html", "application/grpcq+proto", "application/x+y"] {
            assert!(
                matches!(asked(Some(accept)), Err(ApiError::NotAcceptable { .. })),
                "{accept}"
            );
        }
    }

    /// A FETCH's and a batch PUSH's answer written straight are the object
    /// the `Value` path builds: no job, one, several, with and without the
    /// count.
    #[test]
    fn a_job_list_written_straight_is_the_one_built_as_a_value() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-26T10:00:00Z")
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap_or_default();
        let jobs: Vec<Job> = (0..3)
            .filter_map(|n| {
                job::from_json(
                    json!({"type": "a.b", "args": [n], "options": {"queue": format!("q{n}")}}),
                    now,
                )
                .ok()
            })
            .collect();
        assert_eq!(jobs.len(), 3, "a valid job was refused");
        for n in [0, 1, 3] {
            let jobs = &jobs[..n];
            let values: Vec<Value> = jobs.iter().map(Job::to_json).collect();
            for count in [None, Some(n)] {
                let mut out = Vec::new();
                assert!(write_job_list(&mut out, jobs, count).is_ok());
                let written: Value = serde_json::from_slice(&out).unwrap_or_default();
                let expected = match count {
                    Some(c) => json!({"jobs": values, "count": c}),
                    None => json!({"jobs": values}),
                };
                assert_eq!(written, expected, "{}", String::from_utf8_lossy(&out));
            }
        }
    }

    /// An ACK's and a NACK's answer written straight are the object the
    /// `Value` path builds, with and without the optional fields.
    #[test]
    fn a_settle_answer_written_straight_is_the_one_built_as_a_value() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-26T10:00:00Z")
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap_or_default();
        let Ok(mut job) = job::from_json(
            json!({"type": "a.b", "args": [1], "options": {"tags": ["x"]}}),
            now,
        ) else {
            panic!("a valid job was refused");
        };
        for (acknowledged, finished) in [(true, true), (false, false), (false, true)] {
            if finished {
                job.envelope.completed_at = Some(now);
                for (k, v) in [
                    ("next_attempt_at", json!("2026-11-26T10:00:05.000Z")),
                    ("retry_delay_ms", json!(5000)),
                    ("discarded_at", json!("2026-11-26T10:00:01.000Z")),
                ] {
                    job.extra.insert(k.into(), v);
                }
            }
            let response = settle_response(&job, acknowledged, "r");
            let written: Value = serde_json::from_slice(response.body()).unwrap_or_default();
            assert_eq!(written, settle_body(&job, acknowledged));
        }
    }
}
