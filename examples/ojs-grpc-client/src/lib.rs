//! An OJS producer and worker over the gRPC binding: what an OJS SDK does,
//! with the tonic client generated from the binding's protos
//! (`ojs_api::grpc::pb`). `ojs-bridge run` serves the binding on its HTTP
//! port (`127.0.0.1:9464` by default).

use std::collections::HashSet;
use std::time::Duration;

use ojs_api::grpc::convert::{json_to_struct, json_to_value};
use ojs_api::grpc::pb;
use ojs_api::grpc::pb::ojs_service_client::OjsServiceClient;
use serde_json::json;
use tonic::transport::Channel;

/// Why the example stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint is not a URI.
    #[error("{endpoint:?} is not an endpoint URI (http://host:port): {source}")]
    Endpoint {
        /// What was given.
        endpoint: String,
        /// Why.
        #[source]
        source: tonic::codegen::http::uri::InvalidUri,
    },
    /// The server could not be reached.
    #[error("cannot reach {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server refused a call.
    #[error("{method} refused: {source}")]
    Call {
        /// Which method.
        method: &'static str,
        /// The server's status.
        #[source]
        source: tonic::Status,
    },
    /// The stream ended or went quiet before every job came.
    #[error("the job stream gave {got} of {want} jobs")]
    Incomplete {
        /// Jobs received.
        got: usize,
        /// Jobs enqueued.
        want: usize,
    },
}

/// What a run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Jobs enqueued (one batch).
    pub enqueued: usize,
    /// Jobs the stream delivered and this worker acked.
    pub worked: usize,
    /// Jobs delivered more than once.
    pub duplicated: usize,
}

/// A client of the binding at `endpoint` (`http://host:port`).
pub async fn connect(endpoint: &str) -> Result<OjsServiceClient<Channel>, ClientError> {
    let connect = |source| ClientError::Connect {
        endpoint: endpoint.to_owned(),
        source,
    };
    let channel = Channel::from_shared(endpoint.to_owned())
        .map_err(|source| ClientError::Endpoint {
            endpoint: endpoint.to_owned(),
            source,
        })?
        .connect()
        .await
        .map_err(connect)?;
    Ok(OjsServiceClient::new(channel))
}

/// Enqueues `n` jobs of type `greeting.send` on `queue` in one batch, then
/// works them from `StreamJobs` (at most `concurrency` unsettled at once),
/// acking each with a result.
pub async fn enqueue_and_work(
    client: &mut OjsServiceClient<Channel>,
    queue: &str,
    n: usize,
    concurrency: i32,
) -> Result<Summary, ClientError> {
    let jobs = (0..n)
        .map(|i| pb::BatchJobEntry {
            r#type: "greeting.send".into(),
            args: vec![json_to_value(&json!(format!("friend {i}")))],
            options: None,
        })
        .collect();
    let batch = client
        .enqueue_batch(pb::EnqueueBatchRequest {
            jobs,
            default_options: Some(pb::EnqueueOptions {
                queue: queue.into(),
                ..Default::default()
            }),
        })
        .await
        .map_err(|source| ClientError::Call {
            method: "EnqueueBatch",
            source,
        })?
        .into_inner();
    let want: HashSet<String> = batch.jobs.into_iter().map(|j| j.id).collect();

    let mut stream = client
        .stream_jobs(pb::StreamJobsRequest {
            queues: vec![queue.into()],
            worker_id: "example-grpc-worker".into(),
            max_concurrent: concurrency,
        })
        .await
        .map_err(|source| ClientError::Call {
            method: "StreamJobs",
            source,
        })?
        .into_inner();
    let mut seen = HashSet::new();
    let mut duplicated = 0;
    while seen.len() < want.len() {
        let next = tokio::time::timeout(Duration::from_secs(10), stream.message()).await;
        let job = match next {
            Ok(Ok(Some(job))) => job,
            Ok(Err(source)) => {
                return Err(ClientError::Call {
                    method: "StreamJobs",
                    source,
                })
            }
            Ok(Ok(None)) | Err(_) => break,
        };
        let greeting = format!(
            "hello, {}",
            job.args.first().map_or(String::new(), |a| {
                ojs_api::grpc::convert::value_to_json(a.clone())
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
        );
        client
            .ack(pb::AckRequest {
                job_id: job.id.clone(),
                result: json!({ "greeting": greeting })
                    .as_object()
                    .map(json_to_struct),
            })
            .await
            .map_err(|source| ClientError::Call {
                method: "Ack",
                source,
            })?;
        if want.contains(&job.id) && !seen.insert(job.id) {
            duplicated += 1;
        }
    }
    if seen.len() < want.len() {
        return Err(ClientError::Incomplete {
            got: seen.len(),
            want: want.len(),
        });
    }
    Ok(Summary {
        enqueued: want.len(),
        worked: seen.len(),
        duplicated,
    })
}
