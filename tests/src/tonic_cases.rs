//! Tonic services over queues (`ojs-grpc`), runnable on any adapter: part
//! of the acceptance suite.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use ojs_core::{Encoding, RetryPolicy};
use ojs_example_invoices::pb::{CreateInvoiceRequest, GetInvoiceRequest, Invoice};
use ojs_example_invoices::{InvoiceBook, Invoices, InvoicesClient, InvoicesServer};
use ojs_grpc::{QueueChannel, QueueServer, ReplyOptions};
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};
use ojs_queue::{ConsumerOptions, QueueAdapter, Source};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

use crate::acceptance::AdapterFactory;

/// The example's Invoices service with behaviours chosen by the customer
/// name, counting executions per idempotency key.
#[derive(Debug, Clone, Default)]
struct TestInvoices {
    book: InvoiceBook,
    runs: Arc<Mutex<HashMap<String, u32>>>,
    /// Told when a "hang" call has run.
    hung: Arc<tokio::sync::Notify>,
}

impl TestInvoices {
    fn runs(&self, key: &str) -> u32 {
        self.runs
            .lock()
            .map(|r| r.get(key).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    fn total_runs(&self) -> u32 {
        self.runs.lock().map(|r| r.values().sum()).unwrap_or(0)
    }
}

#[tonic::async_trait]
impl Invoices for TestInvoices {
    async fn create(
        &self,
        request: Request<CreateInvoiceRequest>,
    ) -> Result<Response<Invoice>, Status> {
        let req = request.get_ref().clone();
        let run = {
            let mut runs = self.runs.lock().map_err(|_| Status::internal("poisoned"))?;
            let n = runs.entry(req.idempotency_key.clone()).or_default();
            *n += 1;
            *n
        };
        match req.customer.as_str() {
            "unavailable-once" if run == 1 => Err(Status::unavailable("warming up")),
            "panic" => panic!("the service panicked on purpose"),
            "slow" => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                self.book.create(request).await
            }
            // Executes, then never answers: a worker that dies after the
            // work and before the reply.
            "hang" => {
                self.hung.notify_one();
                futures::future::pending().await
            }
            _ => self.book.create(request).await,
        }
    }

    async fn get(&self, request: Request<GetInvoiceRequest>) -> Result<Response<Invoice>, Status> {
        self.book.get(request).await
    }
}

/// A worker serving `service` on `queue`, stopped by the returned sender
/// (or aborted through the handle, like a kill).
async fn serve(
    f: &dyn AdapterFactory,
    queue: &str,
    service: TestInvoices,
    retry: RetryPolicy,
) -> Result<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)> {
    let adapter = f.connect().await?;
    let mut registry = Registry::new();
    QueueServer::new(adapter.clone()).add_service(&mut registry, InvoicesServer::new(service))?;
    let mut config = WorkerConfig::new(queue);
    config.default_encoding = Some(Encoding::GrpcqProto);
    config.consumer = f.consumer_options();
    config.receive_wait = Duration::from_millis(200);
    config.retry = ojs_grpcq::retry::ResolvedRetry::resolve(Some(&retry), &Default::default());
    let worker = Worker::new(adapter, registry, config);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = worker
            .run(async {
                let _ = stopped.await;
            })
            .await;
    });
    Ok((stop, task))
}

fn quick_retry(max_attempts: i32) -> RetryPolicy {
    RetryPolicy {
        max_attempts: Some(max_attempts),
        initial_interval: "PT0.1S".into(),
        jitter: false,
        ..RetryPolicy::default()
    }
}

async fn reply_channel(
    f: &dyn AdapterFactory,
    adapter: Arc<dyn QueueAdapter>,
    queue: &str,
    timeout: Duration,
) -> Result<QueueChannel> {
    // A reply queue of this client instance, provisioned like any queue of
    // the suite (created by an independent client where the adapter may
    // create nothing).
    let reply_queue = f.queue("grpcq-reply").await?;
    let options = ReplyOptions {
        queue: Some(reply_queue),
        timeout,
        consumer: ConsumerOptions {
            group: format!("reply-{}", uuid::Uuid::new_v4().simple()),
            ..f.consumer_options()
        },
        ..ReplyOptions::default()
    };
    Ok(QueueChannel::with_replies(adapter, queue, options).await?)
}

fn create(customer: &str, key: &str) -> CreateInvoiceRequest {
    CreateInvoiceRequest {
        customer: customer.into(),
        amount_cents: 1200,
        idempotency_key: key.into(),
    }
}

/// N calls from a tonic client over the queue channel arrive once each and
/// their responses come back; fire-and-forget calls return at once with an
/// empty response and run.
pub async fn tonic_calls_over_the_queue_run_once_each(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let queue = f.queue("tonic").await?;
    let service = TestInvoices::default();
    let (stop, task) = serve(f, &queue, service.clone(), quick_retry(3)).await?;
    let adapter = f.connect().await?;
    let channel = reply_channel(f, adapter.clone(), &queue, features.patience).await?;
    let n = ((40.0 * features.volume).round() as usize).max(4);
    let mut calls = Vec::new();
    for i in 0..n {
        let mut client = InvoicesClient::new(channel.clone());
        calls.push(tokio::spawn(async move {
            client
                .create(create(&format!("c{i}"), &format!("rr-{i}")))
                .await
        }));
    }
    let mut received = 0;
    for (i, call) in calls.into_iter().enumerate() {
        let invoice = call
            .await?
            .with_context(|| format!("call {i}"))?
            .into_inner();
        ensure!(
            invoice.customer == format!("c{i}") && invoice.amount_cents == 1200,
            "{invoice:?}"
        );
        received += 1;
    }
    // Fire-and-forget: the response is the output type's empty message.
    let mut forget = InvoicesClient::new(QueueChannel::new(adapter.clone(), queue.clone()));
    for i in 0..n {
        let empty = forget
            .create(create("ff", &format!("ff-{i}")))
            .await?
            .into_inner();
        ensure!(
            empty == Invoice::default(),
            "fire-and-forget returned {empty:?}"
        );
    }
    let deadline = Instant::now() + features.patience;
    while (0..n).any(|i| service.runs(&format!("ff-{i}")) == 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keys: Vec<String> = (0..n)
        .flat_map(|i| [format!("rr-{i}"), format!("ff-{i}")])
        .collect();
    let lost = keys.iter().filter(|k| service.runs(k) == 0).count();
    let duplicated: u32 = keys.iter().map(|k| service.runs(k).saturating_sub(1)).sum();
    println!(
        "{}: tonic over the queue: sent {} received {} (replies {received}) duplicated {duplicated} lost {lost}",
        features.name,
        2 * n,
        keys.len() - lost,
    );
    ensure!(lost == 0, "{lost} calls never ran");
    let stats = channel.reply_stats().context("reply stats")?;
    ensure!(
        stats.matched.load(std::sync::atomic::Ordering::Relaxed) == n as u64,
        "replies matched: {stats:?}"
    );
    channel.close().await?;
    let _ = stop.send(());
    task.await?;
    Ok(())
}

/// The status table: a permanent status reaches the caller at once and
/// dead-letters the call as `grpc.<CODE>`; a retryable one is retried and
/// the caller gets the retry's response; a panic is INTERNAL, retried, and
/// reaches the caller when attempts run out; a service slower than the
/// caller's deadline is DEADLINE_EXCEEDED.
pub async fn tonic_status_table(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let queue = f.queue("tonic-status").await?;
    let service = TestInvoices::default();
    let (stop, task) = serve(f, &queue, service.clone(), quick_retry(2)).await?;
    let adapter = f.connect().await?;
    let channel = reply_channel(f, adapter.clone(), &queue, features.patience).await?;
    let mut client = InvoicesClient::new(channel.clone());

    let mut bad = create("acme", "bad");
    bad.amount_cents = -5;
    let err = client
        .create(bad)
        .await
        .err()
        .context("a negative amount was accepted")?;
    ensure!(err.code() == Code::InvalidArgument, "{err:?}");
    ensure!(err.message().contains("amount_cents"), "{err:?}");

    let ok = client
        .create(create("unavailable-once", "retry"))
        .await?
        .into_inner();
    ensure!(ok.customer == "unavailable-once", "{ok:?}");
    ensure!(
        service.runs("retry") == 2,
        "runs: {}",
        service.runs("retry")
    );

    let err = client
        .create(create("panic", "panic"))
        .await
        .err()
        .context("a panic succeeded")?;
    ensure!(
        err.code() == Code::Internal && err.message().contains("panicked"),
        "{err:?}"
    );
    ensure!(
        service.runs("panic") == 2,
        "panic runs: {}",
        service.runs("panic")
    );

    let mut slow = Request::new(create("slow", "slow"));
    slow.set_timeout(Duration::from_secs(1));
    let started = Instant::now();
    let err = client
        .create(slow)
        .await
        .err()
        .context("a slow call succeeded")?;
    ensure!(err.code() == Code::DeadlineExceeded, "{err:?}");
    ensure!(
        started.elapsed() < features.patience,
        "the deadline was not kept"
    );

    // The permanent failure and the exhausted panic are dead letters that
    // name the status.
    let mut dead = adapter
        .consumer(
            &queue,
            ConsumerOptions {
                source: Source::DeadLetters,
                group: format!("dlq-{}", uuid::Uuid::new_v4().simple()),
                ..f.consumer_options()
            },
        )
        .await?;
    let mut reasons = Vec::new();
    let deadline = Instant::now() + features.patience;
    while reasons.len() < 2 && Instant::now() < deadline {
        for d in dead.receive(10, Duration::from_millis(500)).await? {
            let r = d
                .dead_letter_reason()
                .context("dead letter without reason")?;
            reasons.push(r.error_type);
            d.ack().await?;
        }
    }
    reasons.sort();
    ensure!(
        reasons.iter().any(|r| r == "grpc.INVALID_ARGUMENT")
            && reasons.iter().any(|r| r == "grpc.INTERNAL"),
        "dead letters: {reasons:?}"
    );
    dead.close().await?;
    channel.close().await?;
    let _ = stop.send(());
    task.await?;
    Ok(())
}

/// A reply that never comes (the worker dies after executing, before it
/// replies) is a timeout for the caller with a clear error, never a hang;
/// and a redelivered copy past the caller's deadline is not run again.
pub async fn tonic_lost_reply_is_a_timeout(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let queue = f.queue("tonic-lost").await?;
    let service = TestInvoices::default();
    let (_stop, task) = serve(f, &queue, service.clone(), quick_retry(3)).await?;
    let adapter = f.connect().await?;
    let channel = reply_channel(f, adapter.clone(), &queue, Duration::from_secs(3)).await?;
    let mut client = InvoicesClient::new(channel.clone());
    // Once the worker serves (a Kafka consumer takes a while to join):
    let mut warm = Request::new(create("acme", "warm-up"));
    warm.set_timeout(features.patience);
    client.create(warm).await?;
    let started = Instant::now();
    let call = tokio::spawn(async move { client.create(create("hang", "lost")).await });
    // The service has run: kill the worker before it can reply.
    tokio::time::timeout(features.patience, service.hung.notified())
        .await
        .context("the call never ran")?;
    task.abort();
    let _ = task.await;
    let err = call
        .await?
        .err()
        .context("a call without a reply succeeded")?;
    ensure!(err.code() == Code::DeadlineExceeded, "{err:?}");
    ensure!(err.message().contains("no reply within"), "{err:?}");
    ensure!(
        started.elapsed() < Duration::from_secs(20),
        "waited {:?}",
        started.elapsed()
    );
    ensure!(service.runs("lost") == 1, "runs: {}", service.runs("lost"));
    // The killed worker's message comes back unsettled; served again, the
    // copy is past its deadline and is dead-lettered without running.
    if features.redelivers_on_consumer_drop {
        let again = TestInvoices::default();
        let (stop, task) = serve(f, &queue, again.clone(), quick_retry(3)).await?;
        let mut dead = adapter
            .consumer(
                &queue,
                ConsumerOptions {
                    source: Source::DeadLetters,
                    group: format!("dlq-{}", uuid::Uuid::new_v4().simple()),
                    ..f.consumer_options()
                },
            )
            .await?;
        let mut reason = None;
        let deadline = Instant::now() + 2 * features.patience + features.consumer_startup;
        while reason.is_none() && Instant::now() < deadline {
            if let Some(d) = dead.receive(1, Duration::from_millis(500)).await?.pop() {
                reason = d.dead_letter_reason().map(|r| r.error_type);
                d.ack().await?;
            }
        }
        ensure!(
            reason.as_deref() == Some("deadline_expired"),
            "dead letter: {reason:?}"
        );
        ensure!(again.total_runs() == 0, "the expired call ran again");
        dead.close().await?;
        let _ = stop.send(());
        task.await?;
    }
    channel.close().await?;
    Ok(())
}

/// Whether the broker still has something of reply queue `queue`; `None`
/// where there is no broker resource to look at (memory, embedded).
fn broker_has(f: &dyn AdapterFactory, queue: &str) -> Result<Option<bool>> {
    let at = f.broker_url();
    let at = at.as_deref();
    Ok(match f.features().name {
        "rabbitmq" => Some(crate::independent::rabbit_exists_at(
            at,
            &format!("ojs.queue.{queue}"),
            false,
        )?),
        "kafka" => Some(
            crate::independent::kafka_topics_at(at, "ojs.")?
                .iter()
                .any(|t| t.contains(queue)),
        ),
        "sqs" => Some(
            crate::independent::sqs_queues_at(at, "")?
                .iter()
                .any(|q| q.contains(queue)),
        ),
        _ => None,
    })
}

/// A channel that may create its reply queue makes its own
/// (`grpcq-reply-<uuid>`), gets its replies there, and removes it on
/// `close()`; where the adapter may create nothing (`topology =
/// "existing"`), asking for one is a clear error, not a hang, and nothing
/// is created.
pub async fn tonic_reply_queue_of_its_own(f: &dyn AdapterFactory) -> Result<()> {
    let features = f.features();
    let adapter = f.connect().await?;
    let queue = f.queue("tonic-own").await?;
    let options = ReplyOptions {
        timeout: features.patience,
        consumer: ConsumerOptions {
            group: format!("reply-{}", uuid::Uuid::new_v4().simple()),
            ..f.consumer_options()
        },
        ..ReplyOptions::default()
    };
    if !features.creates_resources {
        let err = QueueChannel::with_replies(adapter.clone(), &queue, options)
            .await
            .err()
            .context("a reply queue was created where the adapter may create nothing")?;
        ensure!(err.to_string().contains("existing"), "{err}");
        return Ok(());
    }
    let broker_checks = crate::independent::available().is_some()
        && matches!(features.name, "rabbitmq" | "kafka" | "sqs");
    let service = TestInvoices::default();
    let (stop, task) = serve(f, &queue, service.clone(), quick_retry(3)).await?;
    let channel = QueueChannel::with_replies(adapter.clone(), &queue, options).await?;
    let reply_queue = channel.reply_queue().context("no reply queue")?.to_owned();
    ensure!(
        reply_queue.starts_with(ojs_grpc::DEFAULT_REPLY_PREFIX),
        "{reply_queue}"
    );
    let mut client = InvoicesClient::new(channel.clone());
    for i in 0..3 {
        let invoice = client
            .create(create("own", &format!("own-{i}")))
            .await?
            .into_inner();
        ensure!(invoice.customer == "own", "{invoice:?}");
    }
    if broker_checks {
        ensure!(
            broker_has(f, &reply_queue)? == Some(true),
            "the reply queue is not on the broker"
        );
    }
    channel.close().await?;
    if broker_checks {
        // Topic deletion is asynchronous on Kafka brokers.
        let deadline = Instant::now() + features.patience;
        while broker_has(f, &reply_queue)? == Some(true) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        ensure!(
            broker_has(f, &reply_queue)? == Some(false),
            "the reply queue {reply_queue} is still on the broker after close()"
        );
    }
    let _ = stop.send(());
    task.await?;
    Ok(())
}
