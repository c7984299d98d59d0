//! Every command but `run`: each runs once and exits.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use ojs_bridge::blueprint::Blueprint;
use ojs_bridge::config::ConfigError;
use ojs_bridge::convert::{self, Format};
use ojs_bridge::send::MessageFormat;
use ojs_bridge::{endpoint, send, tail};
use ojs_queue::ConsumerOptions;

use crate::cli::{Command, EXIT_FAILED, EXIT_INVALID_INPUT};
use crate::load_config;

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

/// Every command but `run`.
pub(crate) async fn one_shot(command: Command, quiet: bool) -> ExitCode {
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

fn check_config(path: &std::path::Path) -> Result<String, ConfigError> {
    // What `run` does before it connects: the build, every rule of the file
    // at once, then reading every file it names.
    let ready = Blueprint::build(load_config(Some(path))?)?.read_files()?;
    for clash in ready.blueprint.shared_destinations() {
        eprintln!("warning: {clash}");
    }
    let config = &ready.blueprint.config;
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
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
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
