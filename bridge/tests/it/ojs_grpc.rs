//! The OJS gRPC binding (`ojs.v1.OJSService`) of a real `ojs-bridge run`,
//! on the same port as the HTTP binding, with a tonic client generated
//! from the same protos: every level-0 RPC and the state machine, one job
//! seen through both bindings, `StreamJobs` with back-pressure, bad input,
//! reflection and `grpc.health.v1`; on the embedded default and RabbitMQ.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use ojs_api::grpc::convert::json_to_value;
use ojs_api::grpc::pb;
use ojs_api::grpc::pb::ojs_service_client::OjsServiceClient;
use ojs_bridge_tests::brokers::{find, unique_queue, Broker};
use serde_json::{json, Value};
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_types::StatusExt;

use crate::ojs_server::{get, post_json, OjsServer};

pub(crate) async fn client(addr: SocketAddr) -> OjsServiceClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    OjsServiceClient::new(channel)
}

/// A client sending `authorization` with every call.
pub(crate) fn with_token(
    channel: Channel,
    authorization: &str,
) -> OjsServiceClient<
    tonic::service::interceptor::InterceptedService<Channel, impl tonic::service::Interceptor>,
> {
    let value: tonic::metadata::MetadataValue<_> = authorization.parse().unwrap();
    OjsServiceClient::with_interceptor(channel, move |mut r: Request<()>| {
        r.metadata_mut().insert("authorization", value.clone());
        Ok(r)
    })
}

pub(crate) fn enqueue(job_type: &str, args: Value, queue: &str) -> pb::EnqueueRequest {
    pb::EnqueueRequest {
        r#type: job_type.into(),
        args: args.as_array().unwrap().iter().map(json_to_value).collect(),
        options: Some(pb::EnqueueOptions {
            queue: queue.into(),
            ..Default::default()
        }),
    }
}

fn state(job: &pb::Job) -> pb::JobState {
    pb::JobState::try_from(job.state).unwrap()
}

/// The code and the binding's `ErrorInfo` reason of a failed call.
pub(crate) fn refused<T: std::fmt::Debug>(
    r: Result<T, tonic::Status>,
) -> (Code, String, tonic::Status) {
    let status = r.expect_err("the call must be refused");
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, "openjobspec.org");
    assert!(info.metadata.contains_key("request_id"), "{info:?}");
    (status.code(), info.reason, status)
}

/// Manifest, health, and a job through its whole life over gRPC:
/// enqueue, get, list queues, fetch, heartbeat, ack; a second failed into
/// its dead letters, listed, retried and deleted; a scheduled one
/// cancelled (a second cancel refused); unknown jobs, wrong transitions
/// and methods not served each with their code.
async fn every_rpc_and_the_state_machine(server: &OjsServer, queue: &str, what: &str) {
    let mut c = client(server.addr).await;
    let m = c
        .manifest(pb::ManifestRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.implementation.as_ref().unwrap().name, "ojs-bridge");
    assert!(m.protocols.contains(&"grpc".to_owned()), "{m:?}");
    let h = c.health(pb::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.status, pb::HealthStatus::Ok as i32, "{what}: {h:?}");

    let mut request = Request::new(enqueue("email.send", json!(["a@b.c", 7]), queue));
    request
        .metadata_mut()
        .insert("x-ojs-request-id", "req-test-1".parse().unwrap());
    let answered = c.enqueue(request).await.unwrap();
    assert_eq!(
        answered.metadata().get("x-ojs-request-id").unwrap(),
        "req-test-1"
    );
    let job = answered.into_inner().job.unwrap();
    assert_eq!(state(&job), pb::JobState::Available, "{what}");
    assert_eq!(job.r#type, "email.send");
    assert_eq!(job.queue, queue);
    assert_eq!(job.args.len(), 2);
    assert!(job.created_at.is_some() && job.enqueued_at.is_some());
    let got = c
        .get_job(pb::GetJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(got.id, job.id);
    let queues = c
        .list_queues(pb::ListQueuesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        queues.queues.iter().any(|q| q.name == queue),
        "{what}: {queues:?}"
    );

    let fetched = fetch(&mut c, queue, 1, "w-1").await;
    assert_eq!(fetched.len(), 1, "{what}");
    assert_eq!(fetched[0].id, job.id);
    assert_eq!(state(&fetched[0]), pb::JobState::Active);
    assert_eq!(fetched[0].attempt, 1);
    let beat = c
        .heartbeat(pb::HeartbeatRequest {
            id: job.id.clone(),
            worker_id: "w-1".into(),
            extend_by: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            current_state: pb::WorkerState::Running as i32,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(beat.directed_state, pb::WorkerState::Running as i32);
    assert!(beat.new_deadline.is_some(), "{beat:?}");
    let result = json!({"sent": true});
    let acked = c
        .ack(pb::AckRequest {
            job_id: job.id.clone(),
            result: Some(ojs_api::grpc::convert::json_to_struct(
                result.as_object().unwrap(),
            )),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(acked.acknowledged);
    let done = c
        .get_job(pb::GetJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(state(&done), pb::JobState::Completed, "{what}");
    assert!(done.completed_at.is_some());
    assert_eq!(
        ojs_api::grpc::convert::struct_to_json(done.result.unwrap()),
        *result.as_object().unwrap()
    );
    // ACK of a job that is not active: the state machine says no.
    let (code, reason, _) = refused(
        c.ack(pb::AckRequest {
            job_id: job.id.clone(),
            result: None,
        })
        .await,
    );
    assert_eq!(
        (code, reason.as_str()),
        (Code::FailedPrecondition, "conflict")
    );

    // Failed once with one attempt allowed: discarded into dead letters.
    let mut once = enqueue("report.build", json!([1]), queue);
    let options = once.options.as_mut().unwrap();
    options.max_attempts = 1;
    options.retry = Some(pb::RetryPolicy {
        on_exhaustion: "dead_letter".into(),
        ..Default::default()
    });
    let failing = c.enqueue(once).await.unwrap().into_inner().job.unwrap();
    assert_eq!(failing.max_attempts, 1);
    let fetched = fetch(&mut c, queue, 1, "w-1").await;
    assert_eq!(fetched[0].id, failing.id);
    let nacked = c
        .nack(pb::NackRequest {
            job_id: failing.id.clone(),
            error: Some(pb::JobError {
                code: "SmtpRefused".into(),
                message: "the relay said no".into(),
                retryable: true,
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(nacked.state, pb::JobState::Discarded as i32, "{what}");
    let dead = c
        .list_dead_letter(pb::ListDeadLetterRequest {
            queue: queue.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dead.total_count, 1, "{what}");
    assert_eq!(dead.jobs[0].id, failing.id);
    assert_eq!(dead.jobs[0].errors.last().unwrap().code, "SmtpRefused");
    let retried = c
        .retry_dead_letter(pb::RetryDeadLetterRequest {
            job_id: failing.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(state(&retried), pb::JobState::Available);
    let again = fetch(&mut c, queue, 1, "w-1").await;
    assert_eq!(
        again[0].id, failing.id,
        "{what}: the retried job comes back"
    );
    c.nack(pb::NackRequest {
        job_id: failing.id.clone(),
        error: Some(pb::JobError {
            code: "SmtpRefused".into(),
            message: "still no".into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    c.delete_dead_letter(pb::DeleteDeadLetterRequest {
        job_id: failing.id.clone(),
    })
    .await
    .unwrap();
    let (code, _, _) = refused(
        c.retry_dead_letter(pb::RetryDeadLetterRequest {
            job_id: failing.id.clone(),
        })
        .await,
    );
    assert_eq!(code, Code::NotFound, "{what}: deleted");

    // A scheduled job, cancelled; cancelled again: refused.
    let mut later = enqueue("report.build", json!([2]), queue);
    later.options.as_mut().unwrap().delay_until = Some(prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    });
    let scheduled = c.enqueue(later).await.unwrap().into_inner().job.unwrap();
    assert_eq!(state(&scheduled), pb::JobState::Scheduled);
    let cancelled = c
        .cancel_job(pb::CancelJobRequest {
            job_id: scheduled.id.clone(),
            reason: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(state(&cancelled), pb::JobState::Cancelled);
    let (code, reason, _) = refused(
        c.cancel_job(pb::CancelJobRequest {
            job_id: scheduled.id.clone(),
            reason: String::new(),
        })
        .await,
    );
    assert_eq!(
        (code, reason.as_str()),
        (Code::FailedPrecondition, "conflict")
    );

    let (code, reason, _) = refused(
        c.get_job(pb::GetJobRequest {
            job_id: "019a0000-0000-7000-8000-000000000000".into(),
        })
        .await,
    );
    assert_eq!((code, reason.as_str()), (Code::NotFound, "not_found"));
    // Cron jobs: registered with the options a job of it gets, listed,
    // refused with the field named, removed.
    let registered = c
        .register_cron(pb::RegisterCronRequest {
            name: "grpc.nightly".into(),
            cron: "30 2 * * *".into(),
            timezone: "Europe/Berlin".into(),
            r#type: "report.build".into(),
            args: vec![json_to_value(&json!({"day": 1}))],
            options: Some(pb::EnqueueOptions {
                queue: queue.into(),
                priority: 5,
                tags: vec!["nightly".into()],
                timeout: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
                ..pb::EnqueueOptions::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(registered.name, "grpc.nightly");
    assert!(registered.next_run_at.is_some(), "{registered:?}");
    let entries = c
        .list_cron(pb::ListCronRequest {})
        .await
        .unwrap()
        .into_inner()
        .entries;
    let entry = entries
        .iter()
        .find(|e| e.name == "grpc.nightly")
        .unwrap_or_else(|| panic!("{entries:?}"));
    assert_eq!(
        (
            entry.cron.as_str(),
            entry.timezone.as_str(),
            entry.r#type.as_str()
        ),
        ("30 2 * * *", "Europe/Berlin", "report.build")
    );
    let options = entry.options.as_ref().unwrap();
    assert_eq!((options.queue.as_str(), options.priority), (queue, 5));
    assert_eq!(options.tags, ["nightly"]);
    assert_eq!(options.timeout.as_ref().map(|d| d.seconds), Some(600));
    assert_eq!(entry.next_run_at, registered.next_run_at);
    let (code, reason, status) = refused(
        c.register_cron(pb::RegisterCronRequest {
            name: "grpc.bad".into(),
            cron: "99 25 32 13 8".into(),
            r#type: "report.build".into(),
            ..pb::RegisterCronRequest::default()
        })
        .await,
    );
    assert_eq!(
        (code, reason.as_str()),
        (Code::InvalidArgument, "invalid_request")
    );
    let fields = status.get_details_bad_request().unwrap().field_violations;
    assert_eq!(fields[0].field, "expression", "{fields:?}");
    c.unregister_cron(pb::UnregisterCronRequest {
        name: "grpc.nightly".into(),
    })
    .await
    .unwrap();
    let (code, _, _) = refused(
        c.unregister_cron(pb::UnregisterCronRequest {
            name: "grpc.nightly".into(),
        })
        .await,
    );
    assert_eq!(code, Code::NotFound);
    // A paused queue takes an Enqueue and hands out nothing until resumed;
    // its statistics count the job.
    let held = format!("{queue}.held");
    c.pause_queue(pb::PauseQueueRequest {
        queue: held.clone(),
    })
    .await
    .unwrap();
    let job = c
        .enqueue(pb::EnqueueRequest {
            r#type: "held.job".into(),
            args: vec![],
            options: Some(pb::EnqueueOptions {
                queue: held.clone(),
                ..pb::EnqueueOptions::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    let mut request = Request::new(pb::FetchRequest {
        queues: vec![held.clone()],
        count: 1,
        worker_id: "w-held".into(),
    });
    request.set_timeout(Duration::from_millis(800));
    let nothing = c.fetch(request).await.unwrap().into_inner().jobs;
    assert!(nothing.is_empty(), "{what}: {nothing:?}");
    let stats = c
        .queue_stats(pb::QueueStatsRequest {
            queue: held.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let s = stats.stats.unwrap();
    assert_eq!(
        (stats.queue.as_str(), s.paused, s.available),
        (held.as_str(), true, 1)
    );
    c.resume_queue(pb::ResumeQueueRequest {
        queue: held.clone(),
    })
    .await
    .unwrap();
    let taken = fetch(&mut c, &held, 1, "w-held").await;
    assert_eq!(taken.len(), 1, "{what}");
    assert_eq!(taken[0].id, job.id);
    c.ack(pb::AckRequest {
        job_id: job.id.clone(),
        ..pb::AckRequest::default()
    })
    .await
    .unwrap();
    // Workflows, in the graph form the gRPC binding takes: step "b" waits
    // for "a", is handed out once "a" is acked, and a cancel after that
    // finds the workflow finished.
    let flow = format!("{queue}.flow");
    let step = |id: &str, deps: &[&str]| pb::WorkflowStep {
        id: id.into(),
        r#type: format!("flow.{id}"),
        args: vec![json_to_value(&json!(id))],
        depends_on: deps.iter().map(|d| (*d).to_owned()).collect(),
        options: Some(pb::EnqueueOptions {
            queue: flow.clone(),
            ..pb::EnqueueOptions::default()
        }),
    };
    let created = c
        .create_workflow(pb::CreateWorkflowRequest {
            name: "grpc.flow".into(),
            steps: vec![step("a", &[]), step("b", &["a"])],
        })
        .await
        .unwrap()
        .into_inner()
        .workflow
        .unwrap();
    assert_eq!(created.state, pb::WorkflowState::Running as i32, "{what}");
    let states: Vec<i32> = created.steps.iter().map(|s| s.state).collect();
    assert_eq!(
        states,
        [
            pb::WorkflowStepState::Pending as i32,
            pb::WorkflowStepState::Waiting as i32
        ],
        "{what}"
    );
    assert_eq!(created.steps[1].depends_on, ["a"]);
    let a = fetch(&mut c, &flow, 10, "w-flow").await;
    assert_eq!(
        a.iter().map(|j| j.r#type.as_str()).collect::<Vec<_>>(),
        ["flow.a"],
        "{what}"
    );
    c.ack(pb::AckRequest {
        job_id: a[0].id.clone(),
        ..pb::AckRequest::default()
    })
    .await
    .unwrap();
    let b = fetch(&mut c, &flow, 10, "w-flow").await;
    assert_eq!(
        b.iter().map(|j| j.r#type.as_str()).collect::<Vec<_>>(),
        ["flow.b"],
        "{what}"
    );
    c.ack(pb::AckRequest {
        job_id: b[0].id.clone(),
        ..pb::AckRequest::default()
    })
    .await
    .unwrap();
    let done = c
        .get_workflow(pb::GetWorkflowRequest {
            workflow_id: created.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .workflow
        .unwrap();
    assert_eq!(done.state, pb::WorkflowState::Completed as i32, "{what}");
    assert!(done.completed_at.is_some());
    let (code, reason, _) = refused(
        c.cancel_workflow(pb::CancelWorkflowRequest {
            workflow_id: created.id.clone(),
            reason: String::new(),
        })
        .await,
    );
    assert_eq!(
        (code, reason.as_str()),
        (Code::FailedPrecondition, "conflict")
    );
    let (code, reason, status) = refused(
        c.create_workflow(pb::CreateWorkflowRequest {
            name: "grpc.cycle".into(),
            steps: vec![step("a", &["b"]), step("b", &["a"])],
        })
        .await,
    );
    assert_eq!(
        (code, reason.as_str()),
        (Code::InvalidArgument, "invalid_workflow")
    );
    let fields = status.get_details_bad_request().unwrap().field_violations;
    assert_eq!(fields[0].field, "steps[0].depends_on", "{fields:?}");
    // Nothing left behind: the queue is empty. (Whether an empty Fetch
    // answers within a short deadline is a test of its own, below; a 1 s
    // deadline here once ran out on a loaded machine.)
    let mut request = Request::new(pb::FetchRequest {
        queues: vec![queue.into()],
        count: 10,
        worker_id: "w-1".into(),
    });
    request.set_timeout(Duration::from_secs(3));
    assert!(
        c.fetch(request).await.unwrap().into_inner().jobs.is_empty(),
        "{what}"
    );
}

async fn fetch(
    c: &mut OjsServiceClient<Channel>,
    queue: &str,
    count: i32,
    worker: &str,
) -> Vec<pb::Job> {
    let mut request = Request::new(pb::FetchRequest {
        queues: vec![queue.into()],
        count,
        worker_id: worker.into(),
    });
    // A long poll as long as the deadline: the first fetch of a broker
    // consumer may need a moment to join.
    request.set_timeout(Duration::from_secs(5));
    c.fetch(request).await.unwrap().into_inner().jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_and_the_state_machine_over_grpc_on_the_embedded_default() {
    let server = OjsServer::start(None).await;
    every_rpc_and_the_state_machine(&server, "grpc-states", "embedded").await;
    server.stop();
}

/// A server whose `[api]` is on RabbitMQ, its queues named from `prefix`
/// (`None` when RabbitMQ is not there; a failure when it is required).
async fn rabbit_server(prefix: &str) -> Option<OjsServer> {
    let rabbit = find(Broker::RabbitMq).await?;
    let config = crate::ojs_api_worker::rabbit_config(&rabbit.url, &unique_queue(prefix));
    Some(OjsServer::start(Some(&config)).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_and_the_state_machine_over_grpc_on_rabbitmq() {
    let Some(server) = rabbit_server("grpc").await else {
        return;
    };
    every_rpc_and_the_state_machine(&server, "grpc-states", "rabbitmq").await;
    server.stop();
}

/// One job, both bindings: pushed over gRPC, fetched over HTTP, acked
/// over gRPC, read over HTTP; and pushed over HTTP, fetched and acked
/// over gRPC, read over gRPC. Each binding shows the same attributes.
async fn one_job_both_bindings(server: &OjsServer, queue: &str, what: &str) {
    let mut c = client(server.addr).await;
    let mut request = enqueue(
        "invoice.send",
        json!([{"id": 42, "lines": [1.5, 2]}, "eur"]),
        queue,
    );
    let o = request.options.as_mut().unwrap();
    o.priority = 3;
    o.tags = vec!["billing".into()];
    o.meta = Some(ojs_api::grpc::convert::json_to_struct(
        json!({"tenant": "acme"}).as_object().unwrap(),
    ));
    o.retry = Some(pb::RetryPolicy {
        max_attempts: 5,
        initial_interval: Some(prost_types::Duration {
            seconds: 2,
            nanos: 0,
        }),
        backoff_coefficient: 3.0,
        ..Default::default()
    });
    let mut request = Request::new(request);
    request.metadata_mut().insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            .parse()
            .unwrap(),
    );
    let pushed = c.enqueue(request).await.unwrap().into_inner().job.unwrap();

    let a = get(server.addr, &format!("/ojs/v1/jobs/{}", pushed.id)).await;
    assert_eq!(a.status, 200, "{what}: {:?}", a.body);
    let http_job = a.json()["job"].clone();
    assert_eq!(
        http_job["args"],
        json!([{"id": 42, "lines": [1.5, 2]}, "eur"])
    );
    assert_eq!(http_job["priority"], 3);
    assert_eq!(http_job["tags"], json!(["billing"]));
    assert_eq!(http_job["meta"]["tenant"], "acme");
    assert_eq!(
        http_job["meta"]["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert_eq!(http_job["retry"]["max_attempts"], 5);
    assert_eq!(http_job["retry"]["initial_interval"], "PT2S");
    // The protobuf answer of the HTTP binding is the same job.
    let proto = crate::ojs_server::request(
        server.addr,
        "GET",
        &format!("/ojs/v1/jobs/{}", pushed.id),
        &[("accept".into(), "application/openjobspec+proto".into())],
        None,
    )
    .await;
    assert_eq!(proto.status, 200);
    let envelope = ojs_core::JobEnvelope::from_proto_bytes_unvalidated(&proto.body).unwrap();
    assert_eq!(envelope.id, pushed.id);
    assert_eq!(envelope.priority, 3);
    assert_eq!(envelope.job_type, "invoice.send");

    let f = post_json(
        server.addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": [queue], "worker_id": "http-w", "wait_ms": 5000}),
    )
    .await;
    assert_eq!(f.status, 200, "{:?}", f.body);
    assert_eq!(f.json()["jobs"][0]["id"], json!(pushed.id), "{what}");
    c.ack(pb::AckRequest {
        job_id: pushed.id.clone(),
        result: None,
    })
    .await
    .unwrap();
    let a = get(server.addr, &format!("/ojs/v1/jobs/{}", pushed.id)).await;
    assert_eq!(a.json()["job"]["state"], "completed", "{what}");
    assert_eq!(a.json()["job"]["attempt"], 1);

    // The other way round.
    let p = post_json(
        server.addr,
        "/ojs/v1/jobs",
        &json!({"type": "invoice.send", "args": [1, "x", null, true],
                "meta": {"tenant": "acme"},
                "options": {"queue": queue, "priority": -2, "tags": ["a", "b"]}}),
    )
    .await;
    assert_eq!(p.status, 201, "{:?}", p.body);
    let id = p.json()["job"]["id"].as_str().unwrap().to_owned();
    let over_grpc = c
        .get_job(pb::GetJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(
        over_grpc
            .args
            .iter()
            .cloned()
            .map(ojs_api::grpc::convert::value_to_json)
            .collect::<Vec<_>>(),
        vec![json!(1), json!("x"), Value::Null, json!(true)]
    );
    assert_eq!(over_grpc.priority, -2);
    assert_eq!(over_grpc.tags, vec!["a", "b"]);
    assert_eq!(state(&over_grpc), pb::JobState::Available);
    let fetched = fetch(&mut c, queue, 1, "grpc-w").await;
    assert_eq!(fetched[0].id, id, "{what}");
    c.ack(pb::AckRequest {
        job_id: id.clone(),
        result: None,
    })
    .await
    .unwrap();
    let a = get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
    assert_eq!(a.json()["job"]["state"], "completed", "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_reads_the_same_over_grpc_and_http_on_the_embedded_default() {
    let server = OjsServer::start(None).await;
    one_job_both_bindings(&server, "cross", "embedded").await;
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_reads_the_same_over_grpc_and_http_on_rabbitmq() {
    let Some(server) = rabbit_server("grpc-cross").await else {
        return;
    };
    one_job_both_bindings(&server, "cross", "rabbitmq").await;
    server.stop();
}

/// Two workers stream one queue, each allowing 2 unsettled jobs: neither
/// is ever sent a third before it settles one, and the 20 jobs are each
/// delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streaming_workers_get_no_more_than_they_allow_and_every_job_once() {
    let server = OjsServer::start(None).await;
    two_streaming_workers(&server, "embedded").await;
    server.stop();
}

/// The same on RabbitMQ: the stream's jobs are the broker's deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streaming_workers_on_rabbitmq_get_no_more_than_they_allow_and_every_job_once() {
    let Some(server) = rabbit_server("grpc-stream").await else {
        return;
    };
    two_streaming_workers(&server, "rabbitmq").await;
    server.stop();
}

async fn two_streaming_workers(server: &OjsServer, what: &str) {
    let mut c = client(server.addr).await;
    let n = 20;
    let mut sent = Vec::new();
    for i in 0..n {
        let job = c
            .enqueue(enqueue("stream.item", json!([i]), "streamed"))
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        sent.push(job.id);
    }
    let received = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<String, u32>::new()));
    let mut workers = Vec::new();
    for w in 0..2 {
        let addr = server.addr;
        let received = received.clone();
        workers.push(tokio::spawn(async move {
            let mut c = client(addr).await;
            let mut stream = c
                .stream_jobs(pb::StreamJobsRequest {
                    queues: vec!["streamed".into()],
                    worker_id: format!("streamer-{w}"),
                    max_concurrent: 2,
                })
                .await
                .unwrap()
                .into_inner();
            let mut held: Vec<String> = Vec::new();
            let mut most_held = 0;
            loop {
                let next = tokio::time::timeout(Duration::from_secs(3), stream.message()).await;
                let Ok(Ok(Some(job))) = next else {
                    // Nothing for 3 s with nothing held: the queue is done.
                    if held.is_empty() {
                        break;
                    }
                    // Settle what is held: the stream sends more only then.
                    let id = held.remove(0);
                    c.ack(pb::AckRequest {
                        job_id: id,
                        result: None,
                    })
                    .await
                    .unwrap();
                    continue;
                };
                *received.lock().unwrap().entry(job.id.clone()).or_default() += 1;
                held.push(job.id);
                most_held = most_held.max(held.len());
                // A slow worker at its allowance: a job that arrives while
                // it holds two was sent beyond what it allows.
                if held.len() >= 2 {
                    if let Ok(Ok(Some(extra))) =
                        tokio::time::timeout(Duration::from_millis(300), stream.message()).await
                    {
                        *received
                            .lock()
                            .unwrap()
                            .entry(extra.id.clone())
                            .or_default() += 1;
                        held.push(extra.id);
                        most_held = most_held.max(held.len());
                    }
                    let id = held.remove(0);
                    c.ack(pb::AckRequest {
                        job_id: id,
                        result: None,
                    })
                    .await
                    .unwrap();
                }
            }
            most_held
        }));
    }
    let mut most = Vec::new();
    for w in workers {
        most.push(w.await.unwrap());
    }
    let received = received.lock().unwrap().clone();
    let lost = sent.iter().filter(|id| !received.contains_key(*id)).count();
    let duplicated: u32 = received.values().map(|c| c - 1).sum();
    println!(
        "StreamJobs on {what}, 2 workers × max_concurrent 2: sent {n} received {} duplicated {duplicated} lost {lost}; most held at once {most:?}",
        received.len()
    );
    assert_eq!(lost, 0);
    assert_eq!(duplicated, 0);
    assert!(
        most.iter().all(|m| *m <= 2),
        "a worker was sent more than it allows: {most:?}"
    );
    assert!(
        most.iter().all(|m| *m >= 1),
        "both workers got jobs: {most:?}"
    );
    for id in &sent {
        let a = get(server.addr, &format!("/ojs/v1/jobs/{id}")).await;
        assert_eq!(a.json()["job"]["state"], "completed");
    }
}

/// A job the schemas refuse, a message over the size limit, a missing or
/// wrong token, an unknown queue name: each its code and the binding's
/// reason, nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_over_grpc_gets_its_code_and_loses_nothing() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("grpc-bad");
    std::fs::write(dir.path().join("token"), "s3cret-grpc-token\n").unwrap();
    let config = "[http]\ntoken_file = \"token\"\n[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\nmax_body_bytes = 65536\n";
    let server = OjsServer::start_in(dir, Some(config)).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = with_token(channel.clone(), "Bearer s3cret-grpc-token");
    let mut anonymous = OjsServiceClient::new(channel.clone());
    let mut wrong_token = with_token(channel, "Bearer not-the-token");

    let (code, reason, _) = refused(anonymous.enqueue(enqueue("a.b", json!([]), "q")).await);
    assert_eq!(
        (code, reason.as_str()),
        (Code::Unauthenticated, "unauthenticated")
    );
    let (code, _, status) = refused(wrong_token.enqueue(enqueue("a.b", json!([]), "q")).await);
    assert_eq!(code, Code::Unauthenticated);
    assert!(!status.message().contains("s3cret") && !status.message().contains("not-the-token"));

    let (code, reason, status) = refused(c.enqueue(enqueue("", json!([]), "q")).await);
    assert_eq!(
        (code, reason.as_str()),
        (Code::InvalidArgument, "invalid_request")
    );
    let bad = status.get_details_bad_request().expect("a BadRequest");
    assert_eq!(bad.field_violations[0].field, "type");
    let (code, reason, _) = refused(c.enqueue(enqueue("Not A Type", json!([]), "q")).await);
    assert_eq!(
        (code, reason.as_str()),
        (Code::InvalidArgument, "invalid_request")
    );
    let (code, _, _) = refused(c.enqueue(enqueue("a.b", json!([]), "Bad Queue!")).await);
    assert_eq!(code, Code::InvalidArgument);
    let mut negative = enqueue("a.b", json!([]), "q");
    negative.options.as_mut().unwrap().priority = 1000;
    let (code, _, status) = refused(c.enqueue(negative).await);
    assert_eq!(code, Code::InvalidArgument);
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "options.priority"
    );
    let big = "x".repeat(70_000);
    let (code, reason, _) = refused(c.enqueue(enqueue("a.b", json!([big]), "q")).await);
    assert_eq!(
        (code, reason.as_str()),
        (Code::ResourceExhausted, "payload_too_large")
    );
    let (code, _, _) = refused(
        c.fetch(pb::FetchRequest {
            queues: vec![],
            count: 1,
            worker_id: String::new(),
        })
        .await,
    );
    assert_eq!(code, Code::InvalidArgument);

    // Nothing was stored by any of them.
    let q = c
        .list_queues(pb::ListQueuesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(q.queues.is_empty(), "{q:?}");
    assert!(
        !server.log().contains("s3cret-grpc-token"),
        "the token is in the log"
    );
    server.stop();
}

/// Reflection lists the binding (so grpcurl needs no protos) and
/// `grpc.health.v1` says SERVING; a `Fetch` on an empty queue with a 1 s
/// deadline answers, empty, before that deadline passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_health_and_a_fetch_that_waits_out_the_callers_deadline() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let server = OjsServer::start(None).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(vec![ask]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"ojs.v1.OJSService"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    // The file of the service, with what it imports, for a dynamic client.
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "ojs.v1.OJSService".into(),
        )),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(vec![ask]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
        panic!("no descriptors: {answer:?}");
    };
    assert!(!files.file_descriptor_proto.is_empty());

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let h = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "ojs.v1.OJSService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        h.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    let mut c = OjsServiceClient::new(channel);
    let mut request = Request::new(pb::FetchRequest {
        queues: vec!["nothing-here".into()],
        count: 1,
        worker_id: "patient".into(),
    });
    request.set_timeout(Duration::from_secs(1));
    let started = std::time::Instant::now();
    let jobs = c
        .fetch(request)
        .await
        .expect("an answer, not DEADLINE_EXCEEDED");
    println!(
        "empty Fetch with a 1 s deadline answered after {:?}",
        started.elapsed()
    );
    assert!(jobs.into_inner().jobs.is_empty());
    server.stop();
}

/// The example client (`examples/ojs-grpc-client`) against a real server:
/// 50 jobs enqueued in a batch, worked from `StreamJobs`, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_grpc_client_enqueues_and_works_a_batch() {
    let server = OjsServer::start(None).await;
    let mut client = ojs_example_grpc_client::connect(&format!("http://{}", server.addr))
        .await
        .unwrap();
    let summary = ojs_example_grpc_client::enqueue_and_work(&mut client, "greetings", 50, 4)
        .await
        .unwrap();
    assert_eq!(
        summary,
        ojs_example_grpc_client::Summary {
            enqueued: 50,
            worked: 50,
            duplicated: 0
        }
    );
    let dead = post_json(
        server.addr,
        "/ojs/v1/workers/fetch",
        &json!({"queues": ["greetings"]}),
    )
    .await;
    assert_eq!(dead.json()["jobs"], json!([]), "every job was worked");
    server.stop();
}

/// A token scoped to push on `orders` may enqueue there and nowhere else,
/// and may not fetch: `PERMISSION_DENIED`, with the binding's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_token_may_do_over_grpc_what_it_may_do_over_http() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("grpc-scopes");
    std::fs::write(dir.path().join("producer.token"), "producer-secret\n").unwrap();
    let config = "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n[api]\nadapter = \"local\"\n\n[[api.tokens]]\nname = \"producer\"\nfile = \"producer.token\"\noperations = [\"push\"]\nqueues = [\"orders\"]\n";
    let server = OjsServer::start_in(dir, Some(config)).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = with_token(channel, "Bearer producer-secret");
    let job = c
        .enqueue(enqueue("order.placed", json!([1]), "orders"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(state(&job), pb::JobState::Available);
    let (code, reason, _) = refused(c.enqueue(enqueue("order.placed", json!([1]), "mail")).await);
    assert_eq!(
        (code, reason.as_str()),
        (Code::PermissionDenied, "permission_denied")
    );
    let (code, _, _) = refused(
        c.fetch(pb::FetchRequest {
            queues: vec!["orders".into()],
            count: 1,
            worker_id: String::new(),
        })
        .await,
    );
    assert_eq!(code, Code::PermissionDenied);
    let (code, _, _) = refused(
        c.stream_jobs(pb::StreamJobsRequest {
            queues: vec!["orders".into()],
            worker_id: "w".into(),
            max_concurrent: 1,
        })
        .await,
    );
    assert_eq!(code, Code::PermissionDenied);
    assert!(!server.log().contains("producer-secret"));
    server.stop();
}

/// A TLS connection to `addr` for tonic, offering ALPN `h2`.
#[derive(Clone)]
struct TlsConnect {
    addr: SocketAddr,
    connector: tokio_rustls::TlsConnector,
}

impl tower_service::Service<hyper::Uri> for TlsConnect {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(this.addr).await?;
            let name = rustls_pki_types::ServerName::try_from("localhost")
                .map_err(std::io::Error::other)?;
            let tls = this.connector.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

/// With `[http] tls_cert_file`, the same port serves gRPC over TLS (ALPN
/// `h2`) beside HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_on_the_https_port() {
    let Some(tls) = crate::ojs_api_security::tls_dir() else {
        return;
    };
    let pem = |f: &str| tls.join(f).display().to_string();
    let config = format!(
        "[adapters]\nlocal = \"local:./ojs-bridge-data\"\n\n[http]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n\n[api]\nadapter = \"local\"\n",
        pem("server.pem"),
        pem("server.key")
    );
    let server = OjsServer::start(Some(&config)).await;
    let connect = TlsConnect {
        addr: server.addr,
        connector: crate::ojs_api_security::connector(&tls, false, b"h2"),
    };
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://localhost:{}", server.addr.port()))
            .unwrap()
            .connect_with_connector(connect)
            .await
            .unwrap();
    let mut c = OjsServiceClient::new(channel);
    let job = c
        .enqueue(enqueue("secure.job", json!(["x"]), "tls"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    let fetched = fetch(&mut c, "tls", 1, "tls-worker").await;
    assert_eq!(fetched[0].id, job.id);
    c.ack(pb::AckRequest {
        job_id: job.id.clone(),
        result: None,
    })
    .await
    .unwrap();
    let got = c
        .get_job(pb::GetJobRequest { job_id: job.id })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(state(&got), pb::JobState::Completed);
    // Cleartext gRPC on the TLS port is not served.
    let plain = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        let refused = OjsServiceClient::new(channel)
            .manifest(pb::ManifestRequest {})
            .await;
        assert!(refused.is_err(), "{refused:?}");
    }
    server.stop();
}

/// SIGTERM with a worker streaming: its stream ends with `UNAVAILABLE`
/// (reconnect elsewhere), the job it holds may still be acked during the
/// drain, and the daemon exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_job_stream_with_unavailable_and_its_job_may_still_be_acked() {
    let server = OjsServer::start(None).await;
    let mut c = client(server.addr).await;
    let job = c
        .enqueue(enqueue("drain.me", json!([1]), "draining"))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    let mut stream = c
        .stream_jobs(pb::StreamJobsRequest {
            queues: vec!["draining".into()],
            worker_id: "drained".into(),
            max_concurrent: 1,
        })
        .await
        .unwrap()
        .into_inner();
    let got = stream.message().await.unwrap().unwrap();
    assert_eq!(got.id, job.id);
    server.terminate();
    let ended = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the stream ends at shutdown");
    let status = ended.expect_err("the stream ends with a status");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    c.ack(pb::AckRequest {
        job_id: job.id.clone(),
        result: None,
    })
    .await
    .expect("a held job may be acked while the server drains");
    server.wait_exit(Duration::from_secs(30));
}

/// A gRPC call whose message is not protobuf (a frame of 0xff bytes), and
/// one whose content type names a codec the binding does not speak: each
/// refused by name, `INVALID_ARGUMENT`, nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bytes_and_an_unknown_grpc_codec_are_invalid_argument() {
    use http_body_util::{BodyExt, Full};
    let server = OjsServer::start(None).await;
    // (content type, frame) → the grpc-status and grpc-message answered.
    let send = |content_type: &'static str, frame: Vec<u8>| async move {
        let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let request =
            hyper::Request::post(format!("http://{}/ojs.v1.OJSService/Enqueue", server.addr))
                .header("content-type", content_type)
                .header("te", "trailers")
                .body(Full::new(bytes::Bytes::from(frame)))
                .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let mut headers = response.headers().clone();
        let collected = response.into_body().collect().await.unwrap();
        if let Some(trailers) = collected.trailers() {
            headers.extend(trailers.clone());
        }
        let text = |k: &str| {
            headers
                .get(k)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        (text("grpc-status"), text("grpc-message"))
    };
    let garbage = vec![0, 0, 0, 0, 6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
    let (code, message) = send("application/grpc", garbage).await;
    assert_eq!(
        code,
        (Code::InvalidArgument as i32).to_string(),
        "{message}"
    );
    assert!(message.contains("protobuf"), "{message}");
    let (code, message) = send("application/grpc+json", b"\0\0\0\0\x02{}".to_vec()).await;
    assert_eq!(
        code,
        (Code::InvalidArgument as i32).to_string(),
        "{message}"
    );
    let mut c = client(server.addr).await;
    let q = c
        .list_queues(pb::ListQueuesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(q.queues.is_empty(), "{q:?}");
    server.stop();
}
