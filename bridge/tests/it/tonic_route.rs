//! The daemon turns OJS jobs into calls of a tonic service served from a
//! queue: `examples/jobs-to-invoices.toml` as committed, run as a user runs
//! it, on the embedded broker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_core::Encoding;
use ojs_example_invoices::pb::GetInvoiceRequest;
use ojs_example_invoices::{InvoiceBook, Invoices, InvoicesServer};
use ojs_grpc::QueueServer;
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};
use ojs_queue::QueueAdapter;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_becomes_a_call_of_the_served_tonic_service() {
    let dir = ojs_bridge_tests::tempdir::TempDir::new("tonic-route");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::copy(
        repo.join("examples/jobs-to-invoices.toml"),
        dir.path().join("jobs-to-invoices.toml"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("invoices.binpb"),
        ojs_example_invoices::FILE_DESCRIPTOR_SET,
    )
    .unwrap();

    // The served service, on the embedded broker the daemon uses.
    let url = format!("local://{}", dir.path().join("ojs-bridge-data").display());
    let adapter: Arc<dyn QueueAdapter> = Arc::new(
        LocalAdapter::open(LocalConfig::from_url(&url).unwrap())
            .await
            .unwrap(),
    );
    let book = InvoiceBook::default();
    let mut registry = Registry::new();
    QueueServer::new(adapter.clone())
        .add_service(&mut registry, InvoicesServer::new(book.clone()))
        .unwrap();
    let mut config = WorkerConfig::new("invoices");
    config.default_encoding = Some(Encoding::GrpcqProto);
    config.receive_wait = Duration::from_millis(200);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(Worker::new(adapter.clone(), registry, config).run(async {
        let _ = stopped.await;
    }));

    let daemon = support::spawn_daemon_in(dir.path(), "jobs-to-invoices.toml");
    let job = br#"{"specversion":"1.0","id":"01966f3e-8a2b-7c3d-9e4f-0a1b2c3d4e5f","type":"invoices.create","queue":"invoice-jobs","args":[{"customer":"acme","amountCents":"1200"}],"meta":{"grpcq.topic":"invoices.v1.Invoices","grpcq.action":"Create"}}"#;
    let out = support::ojs_bridge_in(
        dir.path(),
        &[
            "send",
            "--to",
            "local:./ojs-bridge-data",
            "--queue",
            "invoice-jobs",
            "--format",
            "ojs",
        ],
        job,
    );
    assert!(
        out.status.success(),
        "send: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let deadline = Instant::now() + Duration::from_secs(30);
    while book.created() < 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let invoice = book
        .get(tonic::Request::new(GetInvoiceRequest {
            id: "inv-1".into(),
        }))
        .await
        .expect("the job never became a call of the service")
        .into_inner();
    assert_eq!(
        (invoice.customer.as_str(), invoice.amount_cents),
        ("acme", 1200)
    );

    daemon.stop();
    let _ = stop.send(());
    worker.await.unwrap().unwrap();
}
