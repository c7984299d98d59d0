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

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ojs_bridge::config::{BridgeConfig, ConfigError};
use ojs_bridge::convert::{self, Format};
use ojs_bridge::daemon::{Daemon, DaemonError};
use ojs_bridge::logging::{self, LogFormat};
use ojs_bridge::send::MessageFormat;
use ojs_bridge::topology::Topology;
use ojs_bridge::{endpoint, send, tail};
use ojs_queue::ConsumerOptions;

#[derive(Debug, Parser)]
#[command(
    name = "ojs-bridge",
    version,
    about = "Carries OJS jobs and grpcq calls over Kafka, RabbitMQ and SQS"
)]
struct Cli {
    /// Log format on standard error: `text` (colour only on a terminal,
    /// never with NO_COLOR set) or `json` (one object per line). Levels
    /// and targets: OJS_BRIDGE_LOG (`info`, `ojs_adapter_kafka=debug`).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "OJS_BRIDGE_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    /// No progress line on standard error (`send`, `tail`,
    /// `dead-letters`). It is drawn only on a terminal anyway, and not
    /// while the command's own lines go to the same terminal.
    #[arg(long, short = 'q', global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Convert envelopes between OJS JSON and protobuf (stdin → stdout).
    Convert {
        /// Input format.
        #[arg(long, value_enum)]
        from: Format,
        /// Output format.
        #[arg(long, value_enum)]
        to: Format,
        /// Input file; standard input when absent.
        file: Option<PathBuf>,
    },
    /// Publish NDJSON lines (OJS envelopes or grpcq messages) to a queue.
    Send {
        /// Destination adapter URL (memory://, local:, kafka://, amqp://,
        /// sqs://), settings as query items (`?topology=existing`).
        #[arg(long, env = "OJS_BRIDGE_SEND_TO")]
        to: String,
        /// Queue; for OJS, overrides each envelope's queue. grpcq calls
        /// without it go to the queue named by their topic (grpcq's
        /// convention; add `?topic_template={queue}` on Kafka).
        #[arg(long)]
        queue: Option<String>,
        /// What the lines are.
        #[arg(long, value_enum, default_value = "ojs")]
        format: MessageFormat,
        /// NDJSON file; standard input when absent.
        file: Option<PathBuf>,
    },
    /// Run the daemon: consume the configured sources, route, publish, ack.
    /// Without --config: the embedded broker in ./ojs-bridge-data, grpcq
    /// calls on queue `calls` become OJS jobs on queue `default`.
    Run {
        /// TOML configuration file (see examples/embedded.toml).
        #[arg(long, env = "OJS_BRIDGE_CONFIG")]
        config: Option<PathBuf>,
        /// Start while a broker is unreachable and connect in the background
        /// (default; the config's `wait_for_brokers` unless given), or exit
        /// at once with `false`.
        #[arg(long, env = "OJS_BRIDGE_WAIT_FOR_BROKERS", num_args = 0..=1, default_missing_value = "true")]
        wait_for_brokers: Option<bool>,
    },
    /// Validate a configuration file without connecting to anything.
    CheckConfig {
        /// TOML configuration file.
        file: PathBuf,
    },
    /// Print messages of a queue as NDJSON.
    Tail {
        /// Source adapter URL, settings as query items
        /// (`kafka://h:9092?topic_template={queue}`).
        #[arg(long, env = "OJS_BRIDGE_TAIL_FROM")]
        from: String,
        /// Queue to read.
        #[arg(long)]
        queue: String,
        /// How to read a message that carries no content type: as an OJS
        /// envelope (`ojs`) or a grpcq call (`grpcq`). Messages with a
        /// content type are read by it.
        #[arg(long, value_enum, default_value = "ojs")]
        format: MessageFormat,
        /// Stop after N messages.
        #[arg(long)]
        count: Option<usize>,
        /// Stop after this many seconds without a message.
        #[arg(long, default_value_t = 5)]
        timeout_secs: u64,
        /// Acknowledge (remove) what was printed; without it messages stay.
        #[arg(long)]
        ack: bool,
        /// Consumer group (Kafka).
        #[arg(long, default_value = "ojs-bridge-tail")]
        group: String,
        /// How long printed, unacknowledged messages stay invisible to others.
        #[arg(long, default_value_t = 30)]
        visibility_timeout_secs: u64,
        /// Read the queue's dead letters instead.
        #[arg(long)]
        dead_letters: bool,
    },
    /// List, retry or purge a queue's dead letters: on the broker itself
    /// (its dead-letter queue or topic), or through an OJS server.
    DeadLetters {
        /// `list` (print), `retry` (back to the queue), `purge` (remove).
        #[arg(value_enum)]
        action: ojs_bridge::dead_letters::Action,
        /// A broker URL (`amqp://…`, `kafka://…`, `sqs://…`, `local:…`,
        /// settings as query items) or an OJS server (`http://host:port`).
        #[arg(long, env = "OJS_BRIDGE_DEAD_LETTERS_FROM")]
        from: String,
        /// The queue whose dead letters these are.
        #[arg(long)]
        queue: String,
        /// Only this job (repeatable).
        #[arg(long = "id")]
        ids: Vec<String>,
        /// Every dead letter of the queue (retry and purge need it or --id).
        #[arg(long)]
        all: bool,
        /// Only job types matching this pattern (`*`: any run of characters).
        #[arg(long = "type")]
        job_type: Option<String>,
        /// Stop reading a broker after this many seconds without a dead letter.
        #[arg(long, default_value_t = 3)]
        timeout_secs: u64,
        /// A file holding the OJS server's bearer token.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// On a broker: retry or purge also the copies whose record an OJS
        /// server keeps (marked `ojs-dead-letter-record`); the server's
        /// record stays as it was. Without it they are left alone, named.
        #[arg(long)]
        force: bool,
    },
}

/// Exit code for invalid input (usage errors also exit 2, as clap does).
const EXIT_INVALID_INPUT: u8 = 2;
/// Exit code for a failed send or tail.
const EXIT_FAILED: u8 = 1;

fn read_input(file: &Option<PathBuf>) -> anyhow::Result<Vec<u8>> {
    match file {
        Some(path) => std::fs::read(path).with_context(|| format!("reading {}", path.display())),
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .context("reading standard input")?;
            Ok(buf)
        }
    }
}

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
        } => match load_config(config.as_deref()).and_then(Topology::build) {
            Ok(mut topology) => {
                if let Some(wait) = wait_for_brokers {
                    topology.config.wait_for_brokers = wait;
                }
                Work::Daemon(Box::new(topology))
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
    if let Work::Daemon(topology) = &work {
        let config = &topology.config;
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
        Work::Daemon(topology) => runtime.block_on(run_daemon(*topology, format)),
        Work::OneShot(command) => runtime.block_on(one_shot(command, cli.quiet)),
    }
}

/// What `main` runs once the runtime is up.
enum Work {
    /// `run`, its configuration read and built.
    Daemon(Box<Topology>),
    /// Any other command.
    OneShot(Command),
}

/// Every command but `run`.
async fn one_shot(command: Command, quiet: bool) -> ExitCode {
    use ojs_bridge::progress::{Progress, Show};
    match command {
        Command::Convert { from, to, file } => match run_convert(from, to, file) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ojs-bridge convert: {}", chain(e.as_ref()));
                ExitCode::from(EXIT_INVALID_INPUT)
            }
        },
        Command::Send {
            to,
            queue,
            format,
            file,
        } => match run_send(&to, queue.as_deref(), format, &file, quiet).await {
            Ok(n) => {
                println!("sent {n}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ojs-bridge send: {}", chain(e.as_ref()));
                ExitCode::from(EXIT_FAILED)
            }
        },
        // `main` runs the daemon on a runtime sized by its configuration.
        Command::Run { .. } => ExitCode::from(EXIT_FAILED),
        Command::CheckConfig { file } => match check_config(&file) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ojs-bridge check-config: {e}");
                ExitCode::from(EXIT_INVALID_INPUT)
            }
        },
        Command::DeadLetters {
            action,
            from,
            queue,
            ids,
            all,
            job_type,
            timeout_secs,
            token_file,
            force,
        } => {
            use ojs_bridge::dead_letters::{self, Action, Selection};
            if action != Action::List && ids.is_empty() && !all {
                eprintln!("ojs-bridge dead-letters: {action:?} needs --id ID or --all");
                return ExitCode::from(EXIT_INVALID_INPUT);
            }
            let job_type = match job_type
                .map(|t| ojs_core::glob::Glob::new(&t).map(|g| (t, g)))
                .transpose()
            {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("ojs-bridge dead-letters: --type: {e}");
                    return ExitCode::from(EXIT_INVALID_INPUT);
                }
            };
            let token = match token_file
                .map(|p| ojs_bridge::config::read_token_file("--token-file", &p))
                .transpose()
            {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("ojs-bridge dead-letters: {e}");
                    return ExitCode::from(EXIT_INVALID_INPUT);
                }
            };
            let selection = Selection {
                queue,
                ids,
                all,
                job_type,
                idle: Duration::from_secs(timeout_secs),
                progress: Progress::start("read", None, Show::BesideLines, quiet),
                force,
            };
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            let done = if from.starts_with("http://") || from.starts_with("https://") {
                dead_letters::on_server(&from, token.as_ref(), action, &selection, &mut out)
                    .await
                    .map_err(anyhow::Error::from)
            } else {
                match endpoint::connect(&from).await {
                    Ok(adapter) => dead_letters::on_broker(&*adapter, action, &selection, &mut out)
                        .await
                        .map_err(anyhow::Error::from),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            };
            match done {
                Ok(summary) => {
                    eprintln!(
                        "dead letters of {}: {} read, {} {}",
                        selection.queue,
                        summary.seen,
                        summary.done,
                        match action {
                            Action::List => "listed",
                            Action::Retry => "retried",
                            Action::Purge => "purged",
                        }
                    );
                    if summary.recorded_elsewhere > 0 {
                        eprintln!(
                            "ojs-bridge dead-letters: {} selected dead letters were left alone: an OJS server keeps their record (its job store; the broker's copy follows it). {action:?} them through the server (--from http://HOST:PORT), which removes the broker's copy too, or add --force to act on the broker alone",
                            summary.recorded_elsewhere
                        );
                        return ExitCode::from(EXIT_FAILED);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("ojs-bridge dead-letters: {}", chain(e.as_ref()));
                    ExitCode::from(EXIT_FAILED)
                }
            }
        }
        Command::Tail {
            from,
            queue,
            format,
            count,
            timeout_secs,
            ack,
            group,
            visibility_timeout_secs,
            dead_letters,
        } => {
            let opts = tail::TailOptions {
                queue,
                format,
                count,
                idle_timeout: Duration::from_secs(timeout_secs),
                progress: match count {
                    // A few messages need no progress line.
                    Some(n) if n >= 1000 => {
                        Progress::start("read", Some(n as u64), Show::BesideLines, quiet)
                    }
                    _ => Progress::hidden(),
                },
                ack,
                consumer: ConsumerOptions {
                    group,
                    visibility_timeout: Duration::from_secs(visibility_timeout_secs),
                    source: if dead_letters {
                        ojs_queue::Source::DeadLetters
                    } else {
                        ojs_queue::Source::Queue
                    },
                    // `tail` reads; it never dead-letters what it prints.
                    may_dead_letter: false,
                    ..ConsumerOptions::default()
                },
            };
            match run_tail(&from, opts).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ojs-bridge tail: {}", chain(e.as_ref()));
                    ExitCode::from(EXIT_FAILED)
                }
            }
        }
    }
}

fn run_convert(from: Format, to: Format, file: Option<PathBuf>) -> anyhow::Result<()> {
    let input = read_input(&file)?;
    let jobs = convert::read_envelopes(&input, from)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    convert::write_envelopes(&jobs, to, &mut out, &mut std::io::stderr())?;
    out.flush()?;
    Ok(())
}

async fn run_send(
    to: &str,
    queue: Option<&str>,
    format: MessageFormat,
    file: &Option<PathBuf>,
    quiet: bool,
) -> anyhow::Result<usize> {
    use ojs_bridge::progress::{Progress, Show};
    let input = read_input(file)?;
    let text = String::from_utf8(input).context("input is not UTF-8")?;
    let adapter = endpoint::connect(to).await?;
    let lines = text.lines().filter(|l| !l.trim().is_empty()).count() as u64;
    // A few lines need no progress line.
    let progress = if lines >= 1000 {
        Progress::start("sent", Some(lines), Show::Alone, quiet)
    } else {
        Progress::hidden()
    };
    Ok(send::send(&*adapter, &text, queue, format, &progress).await?)
}

async fn run_tail(from: &str, opts: tail::TailOptions) -> anyhow::Result<()> {
    let adapter = endpoint::connect(from).await?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    tail::tail(&*adapter, opts, &mut out).await?;
    Ok(())
}

fn load_config(path: Option<&std::path::Path>) -> Result<BridgeConfig, ConfigError> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    match path {
        Some(p) => BridgeConfig::load(p, &env),
        None => BridgeConfig::embedded_default(&env),
    }
}

fn check_config(path: &std::path::Path) -> Result<String, ConfigError> {
    // The build `run` does, every rule of the file at once.
    let topology = Topology::build(load_config(Some(path))?)?;
    // What `run` would find next, all of it: the files adapters read when
    // they connect.
    let files = topology.check_files().err();
    // With every file readable, what is in them: token files, the
    // listener's certificate and key.
    let config = &topology.config;
    let contents = if files.is_none() {
        let api = config
            .api
            .as_ref()
            .and_then(|a| a.settings(&config.adapters, &config.http).err());
        let tls = ojs_bridge::tls::acceptor(&config.http).err();
        api.into_iter().chain(tls).collect()
    } else {
        Vec::new()
    };
    ConfigError::all(files.into_iter().chain(contents))?;
    for clash in topology.shared_destinations() {
        eprintln!("warning: {clash}");
    }
    Ok(format!(
        "{}: ok ({} adapters, {} sources, {} routes)",
        path.display(),
        config.adapters.len(),
        config.sources.len(),
        config.routes.len()
    ))
}

/// An error and its causes, `: `-separated, leaving out a cause whose text
/// is already there (a broker error's message includes its source's).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut next = Some(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
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

async fn run_daemon(topology: Topology, format: LogFormat) -> ExitCode {
    let daemon = match Daemon::connect(topology, Default::default()).await {
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
