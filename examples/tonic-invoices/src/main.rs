//! `invoices serve` runs the Invoices service from a queue; `invoices
//! create` calls it through the queue, fire-and-forget or (`--wait`)
//! waiting for the reply; `invoices descriptor-set FILE` writes the
//! service's FileDescriptorSet (for a daemon route that turns OJS jobs into
//! calls of it). All use the daemon's default embedded broker.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use ojs_adapter_local::{LocalAdapter, LocalConfig};
use ojs_core::Encoding;
use ojs_example_invoices::pb::{CreateInvoiceRequest, GetInvoiceRequest, Invoice};
use ojs_example_invoices::{InvoiceBook, Invoices, InvoicesClient, InvoicesServer};
use ojs_grpc::{QueueChannel, QueueServer, ReplyOptions};
use ojs_grpcq::registry::Registry;
use ojs_grpcq::worker::{Worker, WorkerConfig};
use ojs_queue::QueueAdapter;

#[derive(Parser)]
struct Cli {
    /// Embedded broker URL.
    #[arg(long, default_value = "local:./ojs-bridge-data")]
    broker: String,
    /// Queue the calls go through.
    #[arg(long, default_value = "invoices")]
    queue: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Invoices service from the queue until Ctrl-C.
    Serve,
    /// Write the service's FileDescriptorSet to FILE.
    DescriptorSet { file: std::path::PathBuf },
    /// Create an invoice through the queue.
    Create {
        #[arg(long)]
        customer: String,
        #[arg(long)]
        amount_cents: i64,
        #[arg(long, default_value = "")]
        idempotency_key: String,
        /// Wait for the service's reply (request/response).
        #[arg(long)]
        wait: bool,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::DescriptorSet { file } = &cli.command {
        std::fs::write(file, ojs_example_invoices::FILE_DESCRIPTOR_SET)
            .with_context(|| format!("writing {}", file.display()))?;
        return Ok(());
    }
    let config = LocalConfig::from_url(&cli.broker).context("broker URL")?;
    let adapter: Arc<dyn QueueAdapter> = Arc::new(LocalAdapter::open(config).await?);
    match cli.command {
        Command::Serve => {
            let mut registry = Registry::new();
            QueueServer::new(adapter.clone()).add_service(
                &mut registry,
                InvoicesServer::new(Logged(InvoiceBook::default())),
            )?;
            let mut config = WorkerConfig::new(cli.queue);
            config.default_encoding = Some(Encoding::GrpcqProto);
            println!("serving invoices.v1.Invoices from queue {:?}", config.queue);
            Worker::new(adapter.clone(), registry, config)
                .run(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await?;
        }
        Command::DescriptorSet { .. } => {}
        Command::Create {
            customer,
            amount_cents,
            idempotency_key,
            wait,
        } => {
            let channel = if wait {
                let options = ReplyOptions {
                    timeout: Duration::from_secs(10),
                    ..ReplyOptions::default()
                };
                QueueChannel::with_replies(adapter.clone(), cli.queue, options).await?
            } else {
                QueueChannel::new(adapter.clone(), cli.queue)
            };
            let mut client = InvoicesClient::new(channel.clone());
            let request = CreateInvoiceRequest {
                customer,
                amount_cents,
                idempotency_key,
            };
            let result = client.create(request).await;
            channel.close().await?;
            match result {
                Ok(r) if wait => println!("created {:?}", r.into_inner()),
                Ok(_) => println!("queued (fire-and-forget: the response is empty)"),
                Err(status) => anyhow::bail!("{:?}: {}", status.code(), status.message()),
            }
        }
    }
    adapter.close().await?;
    Ok(())
}

/// The book, printing what it creates.
struct Logged(InvoiceBook);

#[tonic::async_trait]
impl Invoices for Logged {
    async fn create(
        &self,
        request: tonic::Request<CreateInvoiceRequest>,
    ) -> Result<tonic::Response<Invoice>, tonic::Status> {
        let result = self.0.create(request).await;
        match &result {
            Ok(r) => println!("created {:?}", r.get_ref()),
            Err(s) => println!("refused: {:?} {}", s.code(), s.message()),
        }
        result
    }

    async fn get(
        &self,
        request: tonic::Request<GetInvoiceRequest>,
    ) -> Result<tonic::Response<Invoice>, tonic::Status> {
        self.0.get(request).await
    }
}
