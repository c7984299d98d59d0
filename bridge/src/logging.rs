//! The process's log output: where it goes, in which format, and which
//! events of other libraries may reach it at all.
//!
//! Two filters decide whether an event is written, and both must agree:
//!
//! * the operator's, from `OJS_BRIDGE_LOG` (`info`, `ojs_adapter_kafka=debug`,
//!   `trace`, …), or the command's default;
//! * [`LIBRARY_CAPS`], which no setting loosens: the most a library's events
//!   may show. Several client libraries print message contents at their
//!   most verbose levels (lapin every frame, bodies included, at `trace`
//!   and each returned message at `warn`; librdkafka's debug contexts;
//!   the AWS SDK's request and response dumps), and a message's payload
//!   and metadata may hold personal data or credentials. What such an
//!   event would have said that an operator needs (queue, routing key,
//!   reply code, sizes) the adapters report themselves.
//!
//! The format is `text` (one line per event, colour only when standard
//! error is a terminal and `NO_COLOR` is unset) or `json` (one JSON object
//! per line: `timestamp`, `level`, `target`, `fields`).

use std::io::IsTerminal;

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The environment variable holding the operator's filter.
pub const FILTER_ENV: &str = "OJS_BRIDGE_LOG";

/// How log events are written to standard error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The most each library's events may show, whatever `OJS_BRIDGE_LOG` says.
/// A target covers its submodules (`lapin` covers `lapin::frames`); the
/// most specific entry wins.
pub const LIBRARY_CAPS: &[(&str, LevelFilter)] = &[
    // Every frame at trace (`frame=?f`: content headers and bodies as byte
    // lists); its debug events hold no message content.
    ("lapin", LevelFilter::DEBUG),
    // A returned (unroutable) message, whole, at warn: properties, headers
    // and body. The RabbitMQ adapter reports the return itself (exchange,
    // routing key, reply code and text).
    ("lapin::returned_messages", LevelFilter::OFF),
    // Every channel the broker closes, at error, including the scratch
    // channels of passive declares that find nothing; the adapter reports
    // what matters.
    ("lapin::channel", LevelFilter::OFF),
    // Its connection chatter ("Connection error" and "Exponential backoff
    // attempts exhausted, aborting recovery" after every failed attempt):
    // each of these ends the connection, which the adapter sees, reports
    // once per attempt (with the broker's reason, without credentials)
    // and reconnects itself.
    ("lapin::io_loop", LevelFilter::OFF),
    ("lapin::channels", LevelFilter::OFF),
    ("amq_protocol", LevelFilter::DEBUG),
    ("amq_protocol_tcp", LevelFilter::DEBUG),
    // librdkafka's own log (the `debug` contexts a user may switch on) can
    // print record fields; its warnings and errors are about the cluster.
    ("librdkafka", LevelFilter::INFO),
    ("rdkafka", LevelFilter::DEBUG),
    // The AWS SDK dumps requests and responses (message bodies and
    // attributes) at trace; its orchestrator's debug events name each
    // step and carry bodies too.
    ("aws_smithy_runtime", LevelFilter::INFO),
    ("aws_smithy_runtime_api", LevelFilter::INFO),
    ("aws_smithy_http_client", LevelFilter::INFO),
    ("aws_smithy_http", LevelFilter::INFO),
    ("aws_smithy_types", LevelFilter::INFO),
    ("aws_sigv4", LevelFilter::INFO),
    ("aws_sdk_sqs", LevelFilter::INFO),
    ("aws_sdk_sts", LevelFilter::INFO),
    ("aws_sdk_sso", LevelFilter::INFO),
    ("aws_sdk_ssooidc", LevelFilter::INFO),
    ("aws_config", LevelFilter::INFO),
    ("aws_runtime", LevelFilter::INFO),
    // HTTP stacks: wire-level events (header blocks, buffers).
    ("hyper", LevelFilter::DEBUG),
    ("hyper_util", LevelFilter::DEBUG),
    ("h2", LevelFilter::DEBUG),
    ("rustls", LevelFilter::DEBUG),
    ("tonic", LevelFilter::DEBUG),
    ("tower", LevelFilter::DEBUG),
];

/// The library caps as a filter; targets not listed (ours) pass at any level.
pub fn library_caps() -> Targets {
    Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_targets(LIBRARY_CAPS.iter().copied())
}

/// The operator's filter from `directives` (the value of `OJS_BRIDGE_LOG`),
/// or `default` when unset; a value that does not parse is reported on
/// standard error and `default` used instead.
pub fn operator_filter(directives: Option<&str>, default: &str) -> EnvFilter {
    match directives {
        Some(text) if !text.trim().is_empty() => match EnvFilter::try_new(text) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("ojs-bridge: {FILTER_ENV}={text:?} is not a log filter ({e}); using {default:?}");
                EnvFilter::new(default)
            }
        },
        _ => EnvFilter::new(default),
    }
}

/// Whether text output gets colour: only on a terminal, never with
/// `NO_COLOR` set to anything but the empty string (no-color.org).
pub fn use_colour(no_color: Option<&str>, terminal: bool) -> bool {
    terminal && no_color.is_none_or(str::is_empty)
}

/// Installs the process's subscriber, writing to standard error. Records of
/// the `log` crate (librdkafka's, rustls') go through the same filters.
pub fn init(format: LogFormat, default: &str) {
    let directives = std::env::var(FILTER_ENV).ok();
    let filter = operator_filter(directives.as_deref(), default).and(library_caps());
    let colour = use_colour(
        std::env::var("NO_COLOR").ok().as_deref(),
        std::io::stderr().is_terminal(),
    );
    let layer = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(colour)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    // Fails only when a subscriber is already installed (a test harness).
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    fn caps_allow(target: &str, level: Level) -> bool {
        library_caps().would_enable(target, &level)
    }

    #[test]
    fn library_caps_hold_content_bearing_targets_down_and_leave_ours_alone() {
        assert!(!caps_allow("lapin::returned_messages", Level::ERROR));
        assert!(!caps_allow("lapin::frames", Level::TRACE));
        assert!(caps_allow("lapin::frames", Level::DEBUG));
        assert!(!caps_allow("librdkafka", Level::DEBUG));
        assert!(caps_allow("librdkafka", Level::WARN));
        assert!(!caps_allow(
            "aws_smithy_runtime::client::orchestrator",
            Level::DEBUG
        ));
        assert!(caps_allow("ojs_adapter_rabbitmq", Level::TRACE));
        assert!(caps_allow("ojs_bridge::daemon", Level::TRACE));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(None, true));
        assert!(use_colour(Some(""), true));
        assert!(!use_colour(Some("1"), true));
        assert!(!use_colour(None, false));
    }

    #[test]
    fn a_bad_filter_falls_back_to_the_default() {
        let f = operator_filter(Some("lapin=[[["), "warn");
        assert_eq!(f.max_level_hint(), Some(LevelFilter::WARN));
        let f = operator_filter(None, "info");
        assert_eq!(f.max_level_hint(), Some(LevelFilter::INFO));
    }
}
