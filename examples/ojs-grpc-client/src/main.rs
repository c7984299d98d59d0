//! `ojs-grpc-client` enqueues a batch of jobs on an OJS server's gRPC
//! binding and works them from `StreamJobs`:
//!
//! ```text
//! ojs-bridge run &                       # serves gRPC on 127.0.0.1:9464
//! ojs-grpc-client --jobs 100 --queue greetings
//! ```

use anyhow::Result;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// The OJS server.
    #[arg(long, default_value = "http://127.0.0.1:9464")]
    endpoint: String,
    /// Queue of the jobs.
    #[arg(long, default_value = "greetings")]
    queue: String,
    /// How many jobs.
    #[arg(long, default_value_t = 10)]
    jobs: usize,
    /// Jobs held unsettled at once.
    #[arg(long, default_value_t = 4)]
    concurrency: i32,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut client = ojs_example_grpc_client::connect(&cli.endpoint).await?;
    let summary = ojs_example_grpc_client::enqueue_and_work(
        &mut client,
        &cli.queue,
        cli.jobs,
        cli.concurrency,
    )
    .await?;
    println!(
        "enqueued {} worked {} duplicated {}",
        summary.enqueued, summary.worked, summary.duplicated
    );
    Ok(())
}
