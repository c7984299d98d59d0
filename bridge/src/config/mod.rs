//! The daemon's configuration: TOML, plain serde data, validated before
//! anything connects. Every field has a documented default (see
//! `examples/embedded.toml`, which is also the configuration used when no
//! file is given).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::routes::template::{Template, TemplateVar};
use ojs_core::glob::Glob;

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
    let hint = ojs_core::settings::suggestion(unknown, expected);
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

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
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

    /// Reads and validates a file, applying environment overrides.
    pub fn load(path: &Path, env: &[(String, String)]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string(), env)
    }

    /// Parses TOML, applies overrides from `env` (name, value pairs; pass
    /// `std::env::vars()`), validates. Descriptor set paths are taken as
    /// given (relative to the working directory).
    pub fn parse(text: &str, origin: &str, env: &[(String, String)]) -> Result<Self, ConfigError> {
        let mut table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: origin.to_owned(),
                    message: e.to_string(),
                })?;
        apply_env(&mut table, env)?;
        let config: BridgeConfig =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: origin.to_owned(),
                    message: suggest_known_field(e.to_string()),
                })?;
        config.validate()?;
        Ok(config)
    }

    /// Whether every file the adapters read when they connect
    /// (certificates, keys, password files) can be read now: what `run`
    /// would refuse at connect, found by `check-config` without connecting.
    /// Every unreadable file is named with its setting.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let mut unreadable = Vec::new();
        let mut listener_files = vec![
            ("http.token_file".to_owned(), self.http.token_file.clone()),
            (
                "http.tls_cert_file".to_owned(),
                self.http.tls_cert_file.clone(),
            ),
            (
                "http.tls_key_file".to_owned(),
                self.http.tls_key_file.clone(),
            ),
            (
                "http.tls_client_ca_file".to_owned(),
                self.http.tls_client_ca_file.clone(),
            ),
        ];
        for (i, token) in self.api.iter().flat_map(|a| a.tokens.iter()).enumerate() {
            listener_files.push((format!("api.tokens[{i}].file"), Some(token.file.clone())));
        }
        for (setting, path) in listener_files {
            if let Some(path) = path {
                if let Err(e) = std::fs::File::open(&path) {
                    unreadable.push(invalid(
                        setting,
                        format!("cannot read {}: {e}", path.display()),
                    ));
                }
            }
        }
        for (name, entry) in &self.adapters {
            for (setting, path) in entry.compile(name)?.files_read() {
                if let Err(e) = std::fs::File::open(&path) {
                    unreadable.push(invalid(
                        format!("adapters.{name}.{setting}"),
                        format!("cannot read {}: {e}", path.display()),
                    ));
                }
            }
        }
        ConfigError::all(unreadable)
    }

    /// Every rule a parsed file must also follow.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::all(self.problems())
    }

    /// Every rule the file breaks, each with its field path, in file order.
    fn problems(&self) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        if self.http.listen != "off" && self.http.listen.parse::<std::net::SocketAddr>().is_err() {
            errors.push(invalid(
                "http.listen",
                format!(
                    "{:?} is not an address like 127.0.0.1:9464 (or `off`)",
                    self.http.listen
                ),
            ));
        }
        if self.http.tls_cert_file.is_some() != self.http.tls_key_file.is_some() {
            errors.push(invalid(
                if self.http.tls_cert_file.is_some() {
                    "http.tls_key_file"
                } else {
                    "http.tls_cert_file"
                },
                "tls_cert_file and tls_key_file go together",
            ));
        }
        if self.http.tls_client_ca_file.is_some() && self.http.tls_cert_file.is_none() {
            errors.push(invalid(
                "http.tls_client_ca_file",
                "mutual TLS needs the listener's own tls_cert_file and tls_key_file",
            ));
        }
        if self.http.max_connections == 0 {
            errors.push(invalid("http.max_connections", "must be at least 1"));
        }
        if self.worker_threads == Some(0) {
            errors.push(invalid("worker_threads", "must be at least 1"));
        }
        for (field, d) in [
            ("http.header_read_timeout", self.http.header_read_timeout),
            ("http.idle_timeout", self.http.idle_timeout),
            ("http.health_interval", self.http.health_interval),
            ("http.health_timeout", self.http.health_timeout),
        ] {
            if d.is_zero() {
                errors.push(invalid(field, "must be longer than 0"));
            }
        }
        if self.adapters.is_empty() {
            errors.push(invalid(
                "adapters",
                "no adapter is defined; add e.g. local = \"local:./ojs-bridge-data\"",
            ));
        }
        for (name, entry) in &self.adapters {
            if let Err(e) = entry.compile(name) {
                errors.push(e);
            }
        }
        let adapter = |field: String, name: &str| {
            if self.adapters.contains_key(name) {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!(
                        "names adapter {name:?}, which [adapters] does not define{} (defined: {})",
                        ojs_core::settings::suggestion(
                            name,
                            self.adapters.keys().map(String::as_str)
                        ),
                        self.adapters.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ))
            }
        };
        for (name, f) in &self.federations {
            let at = |field: &str| format!("federations.{name}.{field}");
            if self.adapters.contains_key(name) {
                errors.push(invalid(
                    format!("federations.{name}"),
                    "an adapter has the same name; sinks would be ambiguous",
                ));
            }
            if f.regions.is_empty() {
                errors.push(invalid(
                    at("regions"),
                    "a federation needs at least one region",
                ));
            }
            for (id, region) in &f.regions {
                if let Err(e) = adapter(
                    format!("federations.{name}.regions.{id}.adapter"),
                    &region.adapter,
                ) {
                    errors.push(e);
                }
                if let Some(url) = &region.health {
                    if !url.starts_with("http://") {
                        errors.push(invalid(
                            format!("federations.{name}.regions.{id}.health"),
                            format!("{url:?} must be http://host:port/ojs/v1/health"),
                        ));
                    }
                }
            }
            let named = std::iter::once(("local", &f.local))
                .chain(f.fallback.iter().map(|r| ("fallback", r)));
            for (field, region) in named {
                if !f.regions.contains_key(region) {
                    errors.push(invalid(
                        at(field),
                        format!("{region:?} is not one of its regions"),
                    ));
                }
            }
            if f.strategy == ojs_core::federation::Strategy::GeoPin {
                errors.push(invalid(
                    at("strategy"),
                    "geo-pin is chosen per job (meta ojs.federation.region); the default must be affinity or overflow",
                ));
            }
        }
        if let Some(api) = &self.api {
            errors.extend(api.problems(&self.adapters));
        }
        // A file may serve the OJS API alone: adapters and [api], nothing
        // to consume.
        if self.sources.is_empty() && self.api.is_none() {
            errors.push(invalid(
                "sources",
                "no source is defined; the daemon would consume nothing",
            ));
        }
        let mut source_names = BTreeSet::new();
        for (i, s) in self.sources.iter().enumerate() {
            let at = |f: &str| format!("sources[{i}].{f}");
            if s.name.is_empty() {
                errors.push(invalid(at("name"), "must not be empty"));
            }
            if !source_names.insert(s.name.as_str()) {
                errors.push(invalid(
                    at("name"),
                    format!("{:?} is used by two sources", s.name),
                ));
            }
            if let Err(e) = adapter(at("adapter"), &s.adapter) {
                errors.push(e);
            }
            if s.queue.is_empty() {
                errors.push(invalid(at("queue"), "must not be empty"));
            }
            if s.batch_size == 0 {
                errors.push(invalid(at("batch_size"), "must be at least 1"));
            }
            if s.max_in_flight_bytes == 0 {
                errors.push(invalid(
                    at("max_in_flight_bytes"),
                    "must be at least 1 (it bounds the payload bytes held at once)",
                ));
            }
            if s.lanes == Some(0) {
                errors.push(invalid(at("lanes"), "must be at least 1"));
            }
            if s.lanes.is_some() && s.ordering == OrderingMode::None {
                errors.push(invalid(
                    at("lanes"),
                    "only means something with ordering = \"per_key\"",
                ));
            }
            if s.max_in_flight < s.batch_size {
                errors.push(invalid(
                    at("max_in_flight"),
                    format!("must be at least batch_size ({})", s.batch_size),
                ));
            }
            if let Some(dl) = &s.dead_letter {
                if let Err(e) = adapter(at("dead_letter.adapter"), &dl.adapter) {
                    errors.push(e);
                }
                if dl.queue.is_empty() {
                    errors.push(invalid(at("dead_letter.queue"), "must not be empty"));
                }
            }
        }
        if self.routes.is_empty() && (self.api.is_none() || !self.sources.is_empty()) {
            errors.push(invalid(
                "routes",
                "no route is defined; every message would be dead-lettered",
            ));
        }
        let mut route_names = BTreeSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let at = |f: &str| format!("routes[{i}].{f}");
            if r.name.is_empty() {
                errors.push(invalid(at("name"), "must not be empty"));
            }
            if !route_names.insert(r.name.as_str()) {
                errors.push(invalid(
                    at("name"),
                    format!("{:?} is used by two routes", r.name),
                ));
            }
            for (j, s) in r.sources.iter().enumerate() {
                if !source_names.contains(s.as_str()) {
                    errors.push(invalid(
                        format!("routes[{i}].sources[{j}]"),
                        format!("names source {s:?}, which [[sources]] does not define"),
                    ));
                }
            }
            if !self.federations.contains_key(&r.sink) {
                if let Err(e) = adapter(at("sink"), &r.sink) {
                    errors.push(e);
                }
            }
            for (field, pattern) in [
                ("match.topic", &r.matcher.topic),
                ("match.action", &r.matcher.action),
                ("match.type", &r.matcher.job_type),
            ] {
                if let Some(p) = pattern {
                    if let Err(e) = Glob::new(p) {
                        errors.push(invalid(at(field), e));
                    }
                }
            }
            if r.matcher.job_type.is_some()
                && (r.matcher.topic.is_some() || r.matcher.action.is_some())
            {
                errors.push(invalid(
                    at("match"),
                    "match.type matches OJS jobs and match.topic/action grpcq calls; one route cannot require both",
                ));
            }
            for (field, template) in [
                ("queue", &r.queue),
                ("type", &r.job_type),
                ("topic", &r.topic),
                ("action", &r.action),
            ] {
                if let Some(t) = template {
                    if let Err(e) = Template::parse(t, TemplateVar::ALL) {
                        errors.push(invalid(at(field), e));
                    }
                }
            }
            // A type template that does not parse is reported above.
            if let Some((t, Ok(template))) = r
                .job_type
                .as_ref()
                .map(|t| (t, Template::parse(t, TemplateVar::ALL)))
            {
                // Placeholders render in type form; the literal text must
                // be type text too, or every job would be unmappable.
                let bad_text = template.literal_pieces().find(|text| {
                    !text.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.'
                    })
                });
                if let Some(text) = bad_text {
                    errors.push(invalid(
                        at("type"),
                        format!("{t:?}: the text {text:?} cannot be part of an OJS type (^[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)*$); placeholders are inserted as lowercase snake_case"),
                    ));
                } else if template.literal_pieces().next().is_none()
                    || template.as_literal().is_some()
                {
                    if let Some(literal) = template.as_literal() {
                        if let Err(e) = ojs_core::envelope::validate_job_type(&literal) {
                            errors.push(invalid(at("type"), e.to_string()));
                        }
                    }
                }
            }
            for (j, g) in r.allowed_queues.iter().enumerate() {
                if let Err(e) = Glob::new(g) {
                    errors.push(invalid(format!("routes[{i}].allowed_queues[{j}]"), e));
                }
            }
            if let Err(e) = allowed_destinations(r) {
                errors.push(invalid(at("allowed_queues"), e));
            }
            if r.max_destinations == 0 {
                errors.push(invalid(at("max_destinations"), "must be at least 1"));
            }
            if r.message_type.is_some() && r.descriptor_set.is_none() {
                errors.push(invalid(at("message_type"), "needs descriptor_set"));
            }
        }
        errors
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
