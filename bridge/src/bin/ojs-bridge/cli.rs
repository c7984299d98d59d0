//! The command line: `ojs-bridge --help` is generated from these types.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use ojs_bridge::convert::Format;
use ojs_bridge::logging::LogFormat;
use ojs_bridge::send::MessageFormat;

#[derive(Debug, Parser)]
#[command(
    name = "ojs-bridge",
    version,
    about = "Carries OJS jobs and grpcq calls over Kafka, RabbitMQ and SQS"
)]
pub(crate) struct Cli {
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
    pub(crate) log_format: LogFormat,
    /// No progress line on standard error (`send`, `tail`,
    /// `dead-letters`). It is drawn only on a terminal anyway, and not
    /// while the command's own lines go to the same terminal.
    #[arg(long, short = 'q', global = true)]
    pub(crate) quiet: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
pub(crate) const EXIT_INVALID_INPUT: u8 = 2;
/// Exit code for a failed send or tail.
pub(crate) const EXIT_FAILED: u8 = 1;
