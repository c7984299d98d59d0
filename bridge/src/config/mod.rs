//! The daemon's configuration: TOML, plain serde data, validated before
//! anything connects. Every field has a documented default (see
//! `examples/embedded.toml`, which is also the configuration used when no
//! file is given).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The configuration `ojs-bridge run` uses without `--config`: the embedded
/// broker in `./ojs-bridge-data`, grpcq calls from its `calls` queue become
/// OJS jobs of type `{topic}.{action}` (snake_case segments) on its
/// `default` queue.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../examples/embedded.toml");

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "OJS_BRIDGE_";

/// A configuration that cannot be used, naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML, an unknown field, or a value of the wrong type.
    #[error("{origin}: {message}")]
    Parse {
        /// File name or `built-in default`.
        origin: String,
        /// The TOML error, with line and field.
        message: String,
    },
    /// Several values that parse but cannot work, each with its field, in
    /// file order: a file is refused with everything wrong in it, not one
    /// problem at a time.
    #[error("{} problems:\n{}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Several(Vec<ConfigError>),
    /// A value that parses but cannot work.
    #[error("{field}: {reason}")]
    Invalid {
        /// Dotted path of the field, e.g. `routes[1].sink`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

/// Adds "did you mean" to serde's "unknown field `sourcs`, expected one of
/// `adapters`, `sources`, …" when one of the expected names is close.
/// A typing error of the file as one line that names where it is: the
/// field's path (`sources[1].formt`) and, when the file alone has it, its
/// line.
fn placed(text: &str, error: serde_path_to_error::Error<toml::de::Error>) -> String {
    let path = error.path().to_string();
    let message = error.into_inner().to_string();
    // toml's own "in `sources`" trailer says less than the path does.
    let message = message
        .split("\nin `")
        .next()
        .unwrap_or(&message)
        .trim_end()
        .to_owned();
    // The file parsed with its spans finds the line (an error that came
    // from an environment override has none there).
    let line = toml::from_str::<BridgeConfig>(text)
        .err()
        .filter(|e| e.message().lines().next() == message.lines().next())
        .and_then(|e| e.span())
        .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
    let at = match (path.as_str(), line) {
        (".", None) => String::new(),
        (".", Some(line)) => format!("line {line}: "),
        (path, None) => format!("{path}: "),
        (path, Some(line)) => format!("{path} (line {line}): "),
    };
    format!("{at}{}", suggest_known_field(message))
}

fn suggest_known_field(message: String) -> String {
    let Some(start) = message.find("unknown field `") else {
        return message;
    };
    let rest = &message[start + "unknown field `".len()..];
    let Some(end) = rest.find('`') else {
        return message;
    };
    let unknown = &rest[..end];
    let expected: Vec<&str> = rest[end + 1..].split('`').skip(1).step_by(2).collect();
    let hint = ojs_queue::settings::suggestion(unknown, expected);
    if hint.is_empty() {
        return message;
    }
    let at = start + "unknown field `".len() + end + 1;
    format!("{}{hint}{}", &message[..at], &message[at..])
}

impl ConfigError {
    /// `Ok` without problems, the one problem, or all of them (a
    /// [`ConfigError::Several`] among them is flattened).
    pub fn all(problems: impl IntoIterator<Item = ConfigError>) -> Result<(), ConfigError> {
        let mut flat = Vec::new();
        for p in problems {
            match p {
                ConfigError::Several(inner) => flat.extend(inner),
                other => flat.push(other),
            }
        }
        match flat.len() {
            0 => Ok(()),
            1 => Err(flat.remove(0)),
            _ => Err(ConfigError::Several(flat)),
        }
    }
}

fn default_true() -> bool {
    true
}

pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeConfig {
    /// Time in-flight messages get to be published and acked after SIGINT or
    /// SIGTERM; what is left is delivered again later. Default `30s`.
    #[serde(default = "default_shutdown_timeout", with = "duration_text")]
    pub shutdown_timeout: Duration,
    /// Start while a broker is unreachable (connect it in the background,
    /// health 503 naming it) instead of exiting. Default `true`; `false`
    /// (or `run --wait-for-brokers=false`) exits at once, as supervisors
    /// that restart on failure may prefer.
    #[serde(default = "default_true")]
    pub wait_for_brokers: bool,
    /// Threads of the async runtime that runs sources, routes and sinks
    /// (`ojs-bridge run` only). Default ([`BridgeConfig::runtime_threads`]):
    /// one per CPU, one fewer when a Kafka adapter is configured, since
    /// librdkafka runs its own threads for the broker connections and the
    /// delivery reports (docs/benchmarks.md).
    #[serde(default)]
    pub worker_threads: Option<usize>,
    /// The health and metrics endpoint.
    #[serde(default)]
    pub http: HttpConfig,
    /// Brokers by name: `name = "URL"` (docs/design.md §7 URLs, settings as query
    /// items), or a table `[adapters.NAME]` with `url` and the adapter's
    /// settings.
    #[serde(default)]
    pub adapters: BTreeMap<String, AdapterEntry>,
    /// Queues the daemon consumes.
    #[serde(default)]
    pub sources: Vec<SourceConfig>,
    /// Where messages go; the first route that matches wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Federated sinks by name: a route's `sink` may name one.
    #[serde(default)]
    pub federations: BTreeMap<String, FederationConfig>,
    /// The OJS HTTP binding on the `[http]` listener. Off unless the file
    /// has this table (the built-in default has it).
    #[serde(default)]
    pub api: Option<ApiConfig>,
}

mod adapters;
mod api;
mod duration;
mod federation;
mod http;
mod routes;
mod sources;

pub use adapters::AdapterEntry;
pub use api::{read_token_file, ApiConfig, ApiTokenConfig};
use duration::duration_text;
pub use duration::parse_duration;
pub use federation::{FederationConfig, RegionConfig};
pub use http::HttpConfig;
pub use routes::{allowed_destinations, EnvelopeEncoding, MatchConfig, OutputFormat, RouteConfig};
pub use sources::{DeadLetterConfig, InputFormat, OrderingMode, SourceConfig};

fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}

impl BridgeConfig {
    /// How many threads `ojs-bridge run` gives its async runtime on a
    /// machine with `cpus` CPUs: `worker_threads` when set; otherwise one
    /// per CPU, less one (at least one) when any adapter is Kafka.
    ///
    /// librdkafka does much of a Kafka message's work on threads of its
    /// own (a thread per broker connection writes and reads the records;
    /// another runs the delivery reports). A runtime thread per CPU on top
    /// of them is more threads than CPUs: on two CPUs, Kafka → Kafka calls
    /// becoming jobs ran at 185–200k msg/s and 5.8–6.5 µs of CPU per
    /// message with two runtime threads against 212–249k msg/s and 4.4–5.3
    /// µs with one, the same at 500k (docs/benchmarks.md). Without Kafka
    /// all of the work is the runtime's, and memory → memory is faster on
    /// one thread per CPU.
    pub fn runtime_threads(&self, cpus: usize) -> usize {
        if let Some(threads) = self.worker_threads {
            return threads.max(1);
        }
        let kafka = self
            .adapters
            .values()
            .any(|a| crate::endpoint::scheme(&a.url) == "kafka");
        if kafka {
            cpus.saturating_sub(1).max(1)
        } else {
            cpus.max(1)
        }
    }

    /// The built-in default (see [`EMBEDDED_DEFAULT`]) with environment
    /// overrides applied.
    pub fn embedded_default(env: &[(String, String)]) -> Result<Self, ConfigError> {
        Self::parse(EMBEDDED_DEFAULT, "built-in default configuration", env)
    }

    /// Reads and parses a file, applying environment overrides.
    pub fn load(path: &Path, env: &[(String, String)]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string(), env)
    }

    /// Parses TOML and applies overrides from `env` (name, value pairs;
    /// pass `std::env::vars()`): the file's data, its values typed. Its
    /// rules are checked by [`crate::blueprint::Blueprint::build`], which
    /// makes the runtime from it. Descriptor set paths are taken as given
    /// (relative to the working directory).
    pub fn parse(text: &str, origin: &str, env: &[(String, String)]) -> Result<Self, ConfigError> {
        let mut table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: origin.to_owned(),
                    message: e.to_string(),
                })?;
        apply_env(&mut table, env)?;
        let config: BridgeConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| ConfigError::Parse {
                origin: origin.to_owned(),
                message: placed(text, e),
            })?;
        Ok(config)
    }
}

/// Applies `OJS_BRIDGE_…` overrides to the parsed table:
/// `OJS_BRIDGE_HTTP_LISTEN` → `http.listen`,
/// `OJS_BRIDGE_API_ADAPTER` → `api.adapter` (serving the API if the file
/// did not), `OJS_BRIDGE_API_STATE` → `api.state` (a replica's PostgreSQL
/// URL, password included, kept out of the file),
/// `OJS_BRIDGE_SHUTDOWN_TIMEOUT` → `shutdown_timeout`,
/// `OJS_BRIDGE_WORKER_THREADS` → `worker_threads`,
/// `OJS_BRIDGE_ADAPTER_<NAME>` → the URL of `adapters.<name>` (the name
/// compared case-insensitively with `-` and `_` alike; a new adapter
/// otherwise), `OJS_BRIDGE_ADAPTER_<NAME>__<SETTING>` → one setting of it
/// (`OJS_BRIDGE_ADAPTER_EVENTS__REPLICATION=3`); for Kafka a name that is not
/// a setting is a librdkafka option with `_` as `.`
/// (`…__SASL_PASSWORD` → `sasl.password`).
/// Other `OJS_BRIDGE_` variables belong to the CLI and tests and are ignored.
fn apply_env(table: &mut toml::Table, env: &[(String, String)]) -> Result<(), ConfigError> {
    let mut settings = Vec::new();
    for (key, value) in env {
        let Some(name) = key.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if name == "HTTP_LISTEN" {
            let http = table
                .entry("http")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(http) = http else {
                return Err(invalid("http", "must be a table"));
            };
            http.insert("listen".into(), toml::Value::String(value.clone()));
        } else if name == "API_ADAPTER" || name == "API_STATE" {
            let api = table
                .entry("api")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(api) = api else {
                return Err(invalid("api", "must be a table"));
            };
            let key = if name == "API_STATE" {
                "state"
            } else {
                "adapter"
            };
            api.insert(key.into(), toml::Value::String(value.clone()));
        } else if name == "SHUTDOWN_TIMEOUT" {
            table.insert(
                "shutdown_timeout".into(),
                toml::Value::String(value.clone()),
            );
        } else if name == "WORKER_THREADS" {
            let threads = value.trim().parse::<i64>().map_err(|_| {
                invalid(
                    "worker_threads",
                    format!("OJS_BRIDGE_WORKER_THREADS={value:?} is not a whole number"),
                )
            })?;
            table.insert("worker_threads".into(), toml::Value::Integer(threads));
        } else if let Some(rest) = name.strip_prefix("ADAPTER_") {
            match rest.split_once("__") {
                Some((adapter, setting)) => settings.push((adapter, setting, value)),
                None => {
                    let entry = adapter_entry(table, rest)?;
                    match entry {
                        toml::Value::Table(t) => {
                            t.insert("url".into(), toml::Value::String(value.clone()));
                        }
                        other => *other = toml::Value::String(value.clone()),
                    }
                }
            }
        }
    }
    // Settings after URLs, so a URL override does not drop them.
    for (adapter, setting, value) in settings {
        let entry = adapter_entry(table, adapter)?;
        if let toml::Value::String(url) = entry {
            let mut t = toml::Table::new();
            t.insert("url".into(), toml::Value::String(url.clone()));
            *entry = toml::Value::Table(t);
        }
        let toml::Value::Table(t) = entry else {
            return Err(invalid(
                format!("adapters.{}", adapter.to_ascii_lowercase()),
                "must be a URL or a table",
            ));
        };
        let setting = setting.to_ascii_lowercase();
        let url = t.get("url").and_then(|u| u.as_str()).unwrap_or_default();
        let is_kafka = url.starts_with("kafka:");
        let known = crate::endpoint::AdapterConfig::setting_names(url).unwrap_or_default();
        if is_kafka && !known.contains(&setting) {
            let options = t
                .entry("librdkafka_options")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let toml::Value::Table(o) = options {
                o.insert(
                    setting.replace('_', "."),
                    toml::Value::String(value.clone()),
                );
            }
        } else {
            t.insert(setting, toml::Value::String(value.clone()));
        }
    }
    Ok(())
}

/// The `[adapters]` entry an environment variable names (created as an
/// empty URL when missing).
fn adapter_entry<'t>(
    table: &'t mut toml::Table,
    name: &str,
) -> Result<&'t mut toml::Value, ConfigError> {
    let adapters = table
        .entry("adapters")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(adapters) = adapters else {
        return Err(invalid("adapters", "must be a table of adapters"));
    };
    let normal = |s: &str| s.to_ascii_lowercase().replace('-', "_");
    let existing = adapters.keys().find(|k| normal(k) == normal(name)).cloned();
    let key = existing.unwrap_or_else(|| name.to_ascii_lowercase());
    Ok(adapters
        .entry(key)
        .or_insert_with(|| toml::Value::String(String::new())))
}

#[cfg(test)]
mod tests;
