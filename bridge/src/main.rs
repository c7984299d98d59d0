//! `ojs-bridge`: see `ojs-bridge --help`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ojs_bridge::convert::{self, Format};

#[derive(Debug, Parser)]
#[command(
    name = "ojs-bridge",
    version,
    about = "Carries OJS jobs and grpcq calls over Kafka, RabbitMQ and SQS"
)]
struct Cli {
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
}

/// Exit code for invalid input (usage errors also exit 2, as clap does).
const EXIT_INVALID_INPUT: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Convert { from, to, file } => match run_convert(from, to, file) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ojs-bridge convert: {e:#}");
                ExitCode::from(EXIT_INVALID_INPUT)
            }
        },
    }
}

fn run_convert(from: Format, to: Format, file: Option<PathBuf>) -> anyhow::Result<()> {
    let input = match &file {
        Some(path) => std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .context("reading standard input")?;
            buf
        }
    };
    let jobs = convert::read_envelopes(&input, from)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    convert::write_envelopes(&jobs, to, &mut out, &mut std::io::stderr())?;
    out.flush()?;
    Ok(())
}
