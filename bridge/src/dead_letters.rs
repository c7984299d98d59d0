//! `ojs-bridge dead-letters list|retry|purge`: a queue's dead letters, on
//! the broker itself (`--from amqp://…`, `kafka://…`, `sqs://…`,
//! `local:…`: the adapter's dead-letter destination — the RabbitMQ DLX
//! queue, the Kafka dead topic, the SQS redrive target — for queues
//! ojs-bridge serves or not) or through an OJS server (`--from
//! http://host:port`: its `/ojs/v1/dead-letter` endpoints).
//!
//! On a broker, the dead letters are read until none comes for the idle
//! time; the selected ones are retried (published to the queue, then
//! removed from the dead letters: at least once) or purged, the others
//! left. One NDJSON line per dead letter on stdout, a summary on stderr.

use ojs_grpcq::Decode as _;
use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use ojs_core::glob::Glob;
use ojs_core::redact::Secret;
use ojs_grpcq::decode::Incoming;
use ojs_queue::{header, Delivery, Nack, OutgoingMessage, QueueAdapter};
use serde_json::{json, Value};

/// What to do with the selected dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Action {
    /// Print them.
    List,
    /// Back to their queue.
    Retry,
    /// Remove them for good.
    Purge,
}

impl Action {
    fn done(self) -> &'static str {
        match self {
            Action::List => "listed",
            Action::Retry => "retried",
            Action::Purge => "purged",
        }
    }
}

/// Which dead letters, and how long to wait for them.
#[derive(Debug, Clone)]
pub struct Selection {
    /// The queue whose dead letters these are.
    pub queue: String,
    /// Only these job ids (empty: any).
    pub ids: Vec<String>,
    /// Every one (retry and purge need it, or ids).
    pub all: bool,
    /// Only job types matching this pattern (`*`: any run of characters),
    /// as given and compiled.
    pub job_type: Option<(String, Glob)>,
    /// Stop reading after this long without a dead letter (brokers).
    pub idle: Duration,
    /// Where the count of dead letters read is drawn.
    pub progress: crate::progress::Progress,
    /// Retry or purge on the broker also copies whose record an OJS
    /// server keeps (the server's record then stays as it was).
    pub force: bool,
}

impl Selection {
    fn wants(&self, id: &str, job_type: &str) -> bool {
        (self.ids.is_empty() || self.ids.iter().any(|i| i == id))
            && self
                .job_type
                .as_ref()
                .is_none_or(|(_, g)| g.matches(job_type))
    }
}

/// What happened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Dead letters read.
    pub seen: usize,
    /// Selected and done (listed, retried, purged).
    pub done: usize,
    /// Selected but left alone: an OJS server keeps their record (retry
    /// or purge them through it, or with `--force`).
    pub recorded_elsewhere: usize,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] ojs_queue::Error),
    /// The OJS server failed or answered with an error.
    #[error("{0}")]
    Server(String),
    /// stdout failed.
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

/// The dead letters of `selection.queue` on the adapter's dead-letter
/// destination.
pub async fn on_broker(
    adapter: &dyn QueueAdapter,
    action: Action,
    selection: &Selection,
    out: &mut impl Write,
) -> Result<Summary, DeadLetterError> {
    let kafka = adapter.kind() == "kafka";
    let mut consumer = adapter
        .consumer(
            &selection.queue,
            ojs_api::dead::dead_letter_reader(adapter, &selection.queue),
        )
        .await?;
    let mut summary = Summary::default();
    let mut left: Vec<Delivery> = Vec::new();
    // A Kafka consumer's group join comes before the idle timeout counts.
    if !consumer.ready(crate::tail::JOIN_LIMIT).await? {
        tracing::warn!(queue = %selection.queue, "the dead-letter consumer is not assigned anything yet; reading anyway");
    }
    loop {
        let batch = consumer.receive(100, selection.idle).await?;
        if batch.is_empty() {
            break;
        }
        for delivery in batch {
            summary.seen += 1;
            selection.progress.add(1);
            let (id, job_type) = identify(&delivery);
            if !selection.wants(&id, &job_type) {
                left.push(delivery);
                continue;
            }
            let recorded = delivery
                .headers
                .get_str(header::DEAD_LETTER_RECORD)
                .is_some();
            if recorded && action != Action::List && !selection.force {
                summary.recorded_elsewhere += 1;
                left.push(delivery);
                continue;
            }
            match action {
                Action::List => {
                    summary.done += 1;
                    writeln!(out, "{}", line(&delivery, &id, &job_type, action))?;
                    left.push(delivery);
                    continue;
                }
                Action::Retry => {
                    let mut message = OutgoingMessage {
                        payload: delivery.payload.clone(),
                        headers: delivery.headers.clone(),
                        key: delivery.key.clone(),
                        message_id: delivery.message_id.clone(),
                        priority: 0,
                        deliver_at: None,
                        envelope: None,
                    };
                    // A fresh start: no reason, no attempts counted.
                    message.headers.remove(header::ERROR_TYPE);
                    message.headers.remove(header::ERROR_MESSAGE);
                    message.headers.remove(header::ATTEMPT);
                    adapter.publish(&selection.queue, vec![message]).await?;
                    delivery.ack().await?;
                }
                Action::Purge => delivery.ack().await?,
            }
            summary.done += 1;
            writeln!(out, "{}", line(&delivery, &id, &job_type, action))?;
        }
    }
    for delivery in left {
        // Listed: the broker keeps them where they are, uncounted (a look
        // is not a delivery attempt). Kafka's commits are contiguous:
        // after a retry or purge the records left are moved to the back of
        // the dead topic so that the consumed ones are not read again; a
        // list commits nothing.
        let settled = if kafka && action == Action::List {
            Ok(())
        } else {
            delivery.nack(Nack::Release).await
        };
        if let Err(e) = settled {
            tracing::warn!(error = %e, "leaving a dead letter in place failed; it comes back when its lease ends");
        }
    }
    consumer.close().await?;
    selection.progress.finish();
    Ok(summary)
}

/// The job id and type of a dead letter (a grpcq call: its message id and
/// method).
fn identify(delivery: &Delivery) -> (String, String) {
    match delivery.decode(None) {
        Ok(Incoming::Job(e)) => (e.id.clone(), e.job_type.clone()),
        Ok(Incoming::Call(c)) => {
            let m = c.to_message();
            (m.message_id.clone(), format!("{}/{}", m.topic, m.action))
        }
        Err(_) => (
            delivery.message_id.clone().unwrap_or_default(),
            String::new(),
        ),
    }
}

fn line(delivery: &Delivery, id: &str, job_type: &str, action: Action) -> Value {
    json!({
        "id": id,
        "type": job_type,
        "queue": delivery.queue.as_ref(),
        "error_type": delivery.headers.get_str(header::ERROR_TYPE),
        "error_message": delivery.headers.get_str(header::ERROR_MESSAGE),
        "attempt": delivery.attempt,
        "action": action.done(),
        "record": delivery.headers.get_str(header::DEAD_LETTER_RECORD).unwrap_or("broker"),
    })
}

/// The same through an OJS server's dead-letter endpoints (`base`:
/// `http://host:port`).
pub async fn on_server(
    base: &str,
    token: Option<&Secret>,
    action: Action,
    selection: &Selection,
    out: &mut impl Write,
) -> Result<Summary, DeadLetterError> {
    let server = Server::new(base, token)?;
    let mut summary = Summary::default();
    let mut cursor = 0usize;
    let mut chosen = Vec::new();
    loop {
        let mut path = format!(
            "/ojs/v1/dead-letter?queue={}&limit=500&cursor={cursor}",
            selection.queue
        );
        if let Some((pattern, _)) = &selection.job_type {
            path.push_str(&format!("&type={pattern}"));
        }
        let body = server.call("GET", &path, 200).await?;
        let jobs = body["jobs"].as_array().cloned().unwrap_or_default();
        for job in jobs {
            summary.seen += 1;
            selection.progress.add(1);
            let id = job["id"].as_str().unwrap_or_default().to_owned();
            let job_type = job["type"].as_str().unwrap_or_default().to_owned();
            if selection.wants(&id, &job_type) {
                chosen.push((id, job_type, job));
            }
        }
        match body["next_cursor"].as_str().and_then(|c| c.parse().ok()) {
            Some(next) => cursor = next,
            None => break,
        }
    }
    for (id, job_type, job) in chosen {
        match action {
            Action::List => {}
            Action::Retry => {
                server
                    .call("POST", &format!("/ojs/v1/dead-letter/{id}/retry"), 200)
                    .await?;
            }
            Action::Purge => {
                server
                    .call("DELETE", &format!("/ojs/v1/dead-letter/{id}"), 200)
                    .await?;
            }
        }
        summary.done += 1;
        writeln!(
            out,
            "{}",
            json!({
                "id": id,
                "type": job_type,
                "queue": job["queue"],
                "error_type": job["error"]["type"],
                "error_message": job["error"]["message"],
                "attempt": job["attempt"],
                "action": action.done(),
            })
        )?;
    }
    selection.progress.finish();
    Ok(summary)
}

/// An OJS server over plain HTTP/1.1.
struct Server {
    authority: String,
    authorization: Option<String>,
}

impl Server {
    fn new(base: &str, token: Option<&Secret>) -> Result<Server, DeadLetterError> {
        let Some(rest) = base.strip_prefix("http://") else {
            return Err(DeadLetterError::Server(format!(
                "{base:?}: an OJS server is reached over http:// here (for https, run the command beside it or on the broker's URL)"
            )));
        };
        Ok(Server {
            authority: rest.trim_end_matches('/').to_owned(),
            authorization: token.map(|t| format!("Bearer {}", t.expose())),
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        expected: u16,
    ) -> Result<Value, DeadLetterError> {
        let failed = |e: String| DeadLetterError::Server(format!("{method} {path}: {e}"));
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| failed(format!("connecting to {}: {e}", self.authority)))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.authority)
            .header("accept", "application/json");
        if let Some(a) = &self.authorization {
            request = request.header("authorization", a);
        }
        let request = request
            .body(Full::new(Bytes::new()))
            .map_err(|e| failed(e.to_string()))?;
        let answer = sender
            .send_request(request)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let status = answer.status().as_u16();
        let body = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| failed(e.to_string()))?
            .to_bytes();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status != expected {
            let message = body["error"]["message"]
                .as_str()
                .map_or_else(|| format!("status {status}"), |m| format!("{status}: {m}"));
            return Err(failed(message));
        }
        Ok(body)
    }
}
