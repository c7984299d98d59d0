//! `ojs-bridge`: see `ojs-bridge --help`.

// Every message allocates a few small buffers (headers, envelopes, acks);
// mimalloc's thread-local free lists make those markedly cheaper than
// glibc's malloc on the hot path (kafka_throughput: adapter consume +50 %).
// With its `override` feature it is also the C `malloc` of the process, so
// librdkafka's per-record allocations (messages, each header) — made on
// the runtime's threads and freed on librdkafka's — stop taking glibc's
// arena locks (`_int_free` was 11 % of the workers' samples on Kafka → Kafka).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod cli;
mod commands;

use std::process::ExitCode;

use clap::Parser;
use ojs_bridge::blueprint::{Blueprint, Ready};
use ojs_bridge::config::{BridgeConfig, ConfigError};
use ojs_bridge::daemon::{Daemon, DaemonError};
use ojs_bridge::logging::{self, LogFormat};

use cli::{Cli, Command, EXIT_FAILED, EXIT_INVALID_INPUT};
use commands::{chain, one_shot};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Visible by default: the daemon logs at info (a failing sink or source
    // is a warning an operator sees); the one-shot commands only warn.
    let default_filter = match cli.command {
        Command::Run { .. } => "info",
        _ => "warn",
    };
    logging::init(cli.log_format, default_filter);
    let format = cli.log_format;
    // `run` reads its configuration before the runtime exists: the
    // runtime's size (`worker_threads`) is part of it.
    let work = match cli.command {
        Command::Run {
            config,
            wait_for_brokers,
        } => match load_config(config.as_deref())
            .and_then(Blueprint::build)
            .and_then(Blueprint::read_files)
        {
            Ok(mut ready) => {
                if let Some(wait) = wait_for_brokers {
                    ready.blueprint.config.wait_for_brokers = wait;
                }
                Work::Daemon(Box::new(ready))
            }
            Err(e) => {
                fatal(format, &format!("ojs-bridge run: {e}"));
                return ExitCode::from(EXIT_INVALID_INPUT);
            }
        },
        other => Work::OneShot(other),
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Work::Daemon(ready) = &work {
        let config = &ready.blueprint.config;
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = config.runtime_threads(cpus);
        tracing::info!(
            worker_threads = threads,
            cpus,
            set = config.worker_threads.is_some(),
            "async runtime"
        );
        runtime.worker_threads(threads);
    }
    let runtime = match runtime.build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ojs-bridge: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    match work {
        Work::Daemon(ready) => runtime.block_on(run_daemon(*ready, format)),
        Work::OneShot(command) => runtime.block_on(one_shot(command, cli.quiet)),
    }
}

/// What `main` runs once the runtime is up.
enum Work {
    /// `run`, its configuration built and its files read.
    Daemon(Box<Ready>),
    /// Any other command.
    OneShot(Command),
}

pub(crate) fn load_config(path: Option<&std::path::Path>) -> Result<BridgeConfig, ConfigError> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    match path {
        Some(p) => BridgeConfig::load(p, &env),
        None => BridgeConfig::embedded_default(&env),
    }
}

/// Watches SIGINT and SIGTERM from the call on, and resolves on either.
/// Installed before the daemon says it runs: a signal right after that
/// line must stop it cleanly, not kill it by the signal's default action.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (Ok(mut only), Err(e)) | (Err(e), Ok(mut only)) => {
                    tracing::warn!(error = %e, "cannot watch one of SIGTERM and SIGINT; the other stops the daemon");
                    only.recv().await;
                }
                (Err(e), Err(_)) => {
                    tracing::warn!(error = %e, "cannot watch SIGTERM or SIGINT; stop the daemon with SIGKILL");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// A failure that ends `run`: a plain line, or with `--log-format json` an
/// error event, so that a log collector reading JSON lines sees it too.
fn fatal(format: LogFormat, text: &str) {
    match format {
        LogFormat::Text => eprintln!("{text}"),
        LogFormat::Json => tracing::error!("{text}"),
    }
}

async fn run_daemon(ready: Ready, format: LogFormat) -> ExitCode {
    let daemon = match Daemon::connect(ready, Default::default()).await {
        Ok(d) => d,
        Err(e) => {
            // With its causes: "the job store failed" alone does not say
            // that the role may not create the schema.
            fatal(format, &format!("ojs-bridge run: {}", chain(&e)));
            return ExitCode::from(match e {
                DaemonError::Config(_) => EXIT_INVALID_INPUT,
                _ => EXIT_FAILED,
            });
        }
    };
    let shutdown = shutdown_signal();
    let scheme = daemon.http_scheme();
    match (daemon.http_addr(), format) {
        (Some(addr), LogFormat::Text) => eprintln!("ojs-bridge: running; health on {scheme}://{addr}/ojs/v1/health, metrics on {scheme}://{addr}/metrics"),
        (None, LogFormat::Text) => eprintln!("ojs-bridge: running (HTTP endpoint off)"),
        (addr, LogFormat::Json) => tracing::info!(
            http = addr.map(|a| a.to_string()),
            "running"
        ),
    }
    let summary = daemon.run(shutdown).await;
    for s in summary.sources {
        match format {
            LogFormat::Text => eprintln!(
                "ojs-bridge: source {}: received {}, acked {}, dead-lettered {}",
                s.name, s.received, s.acked, s.dead_lettered
            ),
            LogFormat::Json => tracing::info!(
                source = %s.name,
                received = s.received,
                acked = s.acked,
                dead_lettered = s.dead_lettered,
                "source summary"
            ),
        }
    }
    ExitCode::SUCCESS
}
