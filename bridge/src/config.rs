//! The daemon's configuration: TOML, plain serde data, validated before
//! anything connects. Every field has a documented default (see
//! `examples/embedded.toml`, which is also the configuration used when no
//! file is given).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::routes::template::{Glob, Template, TemplateVar};

/// The configuration `ojs-bridge run` uses without `--config`: the embedded
/// broker in `./ojs-bridge-data`, grpcq calls from its `calls` queue become
/// OJS jobs of type `{topic}.{action}` (snake_case segments) on its
/// `default` queue.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../examples/embedded.toml");

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
}

/// One `[adapters]` entry: `name = "URL"`, or `[adapters.NAME]` with `url`
/// and settings (typed as the adapter's table in docs/adapters/ says; a string is read
/// according to its setting's type, as URL query items and environment
/// variables are).
#[derive(Clone, PartialEq, Default)]
pub struct AdapterEntry {
    /// The broker URL (query items are settings too).
    pub url: String,
    /// Settings from the table, as TOML wrote them.
    pub settings: toml::Table,
}

impl AdapterEntry {
    /// An entry of the `name = "URL"` form.
    pub fn url(url: impl Into<String>) -> Self {
        AdapterEntry {
            url: url.into(),
            settings: toml::Table::new(),
        }
    }

    /// The typed, validated settings of adapter `name`.
    pub fn compile(&self, name: &str) -> Result<crate::endpoint::AdapterConfig, ConfigError> {
        use ojs_core::settings::SettingValue;
        let at = |field: &str| {
            if field == "url" {
                format!("adapters.{name}")
            } else {
                format!("adapters.{name}.{field}")
            }
        };
        if self.url.is_empty() {
            return Err(invalid(
                at("url"),
                "needs a url (`name = \"URL\"`, or `url = \"URL\"` in [adapters.NAME])",
            ));
        }
        let known = crate::endpoint::AdapterConfig::setting_names(&self.url)
            .map_err(|e| core_invalid(&at, e))?;
        let mut items = Vec::new();
        for (key, value) in &self.settings {
            if !known.contains(key) {
                return Err(invalid(
                    at(key),
                    format!(
                        "unknown setting {key:?} for this adapter{}; known settings: url, {}",
                        ojs_core::settings::suggestion(
                            key,
                            known.iter().map(String::as_str).chain(["url"])
                        ),
                        known.join(", ")
                    ),
                ));
            }
            let value = match value {
                toml::Value::String(text) => SettingValue::Text(text.clone()),
                other => SettingValue::Typed(
                    serde_json::to_value(other).map_err(|e| invalid(at(key), e.to_string()))?,
                ),
            };
            items.push((key.clone(), value));
        }
        crate::endpoint::AdapterConfig::from_url_with(&self.url, items)
            .map_err(|e| core_invalid(&at, e))
    }
}

fn core_invalid(at: &dyn Fn(&str) -> String, e: ojs_core::Error) -> ConfigError {
    match e {
        ojs_core::Error::InvalidConfig { field, reason } => invalid(at(&field), reason),
        other => invalid(at("url"), other.to_string()),
    }
}

impl std::fmt::Debug for AdapterEntry {
    // The URL and settings may carry credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings: BTreeMap<&str, String> = self
            .settings
            .iter()
            .map(|(k, v)| {
                let shown = if ojs_core::redact::is_secret_name(k) {
                    ojs_core::redact::MASK.to_owned()
                } else if let toml::Value::Table(t) = v {
                    // librdkafka_options and the like: mask secret keys.
                    let inner: Vec<String> = t
                        .iter()
                        .map(|(ik, iv)| {
                            if ojs_core::redact::is_secret_name(ik) {
                                format!("{ik} = {}", ojs_core::redact::MASK)
                            } else {
                                format!("{ik} = {iv}")
                            }
                        })
                        .collect();
                    format!("{{ {} }}", inner.join(", "))
                } else {
                    v.to_string()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("AdapterEntry")
            .field("url", &ojs_core::redact::url(&self.url))
            .field("settings", &settings)
            .finish()
    }
}

impl Serialize for AdapterEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.settings.is_empty() {
            return s.serialize_str(&self.url);
        }
        let mut table = self.settings.clone();
        table.insert("url".into(), toml::Value::String(self.url.clone()));
        table.serialize(s)
    }
}

impl<'de> Deserialize<'de> for AdapterEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match toml::Value::deserialize(d)? {
            toml::Value::String(url) => Ok(AdapterEntry::url(url)),
            toml::Value::Table(mut settings) => {
                let url = match settings.remove("url") {
                    Some(toml::Value::String(u)) => u,
                    Some(_) => return Err(serde::de::Error::custom("`url` must be a string")),
                    // Reported by `compile`, which knows the adapter's name.
                    None => String::new(),
                };
                Ok(AdapterEntry { url, settings })
            }
            _ => Err(serde::de::Error::custom(
                "an adapter is `name = \"URL\"` or a table [adapters.NAME] with `url` and settings",
            )),
        }
    }
}

/// `[federations.NAME]`: regions over adapters, routed per job
/// (docs/design.md §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FederationConfig {
    /// The local region (affinity's first choice).
    pub local: String,
    /// Affinity's order after the local region. Default: none (then the
    /// lowest observed latency).
    #[serde(default)]
    pub fallback: Vec<String>,
    /// Strategy of jobs whose meta names none: `affinity` (default) or
    /// `overflow`.
    #[serde(default)]
    pub strategy: ojs_core::federation::Strategy,
    /// Consecutive failures that open a region's breaker. Default 5.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// Open breaker → half-open probe after this. Default `30s`.
    #[serde(default = "default_cooldown", with = "duration_text")]
    pub cooldown: Duration,
    /// Health probe interval. Default `5s`.
    #[serde(default = "default_health_interval", with = "duration_text")]
    pub health_interval: Duration,
    /// Longest wait for one probe. Default `2s`.
    #[serde(default = "default_health_timeout", with = "duration_text")]
    pub health_timeout: Duration,
    /// Queue-depth collection interval (overflow). Default `10s`.
    #[serde(default = "default_load_interval", with = "duration_text")]
    pub load_interval: Duration,
    /// Most redirects of one job. Default 3.
    #[serde(default = "default_max_redirects")]
    pub max_redirects: usize,
    /// Copy job metadata to the other regions. Default false.
    #[serde(default)]
    pub replicate: bool,
    /// Queue of replicas. Default `ojs-federation-replicas`.
    #[serde(default = "default_replication_queue")]
    pub replication_queue: String,
    /// Regions by id.
    pub regions: BTreeMap<String, RegionConfig>,
}

/// `[federations.NAME.regions.ID]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    /// Adapter name from `[adapters]`.
    pub adapter: String,
    /// `http://host:port/ojs/v1/health` of an OJS server (an ojs-bridge
    /// daemon answers it too). Default: the adapter's own health check.
    #[serde(default)]
    pub health: Option<String>,
}

fn default_failure_threshold() -> u32 {
    5
}
fn default_cooldown() -> Duration {
    Duration::from_secs(30)
}
fn default_health_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_health_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_load_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_max_redirects() -> usize {
    3
}
fn default_replication_queue() -> String {
    "ojs-federation-replicas".to_owned()
}

impl FederationConfig {
    /// The core settings.
    pub fn settings(&self) -> ojs_core::federation::FederationSettings {
        let mut s = ojs_core::federation::FederationSettings::new(self.local.clone());
        s.fallback = self.fallback.clone();
        s.default_strategy = self.strategy;
        s.failure_threshold = self.failure_threshold;
        s.cooldown = self.cooldown;
        s.health_interval = self.health_interval;
        s.health_timeout = self.health_timeout;
        s.load_interval = self.load_interval;
        s.max_redirects = self.max_redirects;
        s.replicate = self.replicate;
        s.replication_queue = self.replication_queue.clone();
        s
    }
}

fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}

/// `[http]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `GET /ojs/v1/health` and `GET /metrics`; `off` disables the
    /// endpoint. Default `127.0.0.1:9464` (loopback only).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// A file holding a bearer token both paths then require
    /// (`Authorization: Bearer …`). Default: none (no token).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// A connection must send its request head within this. Default `5s`.
    #[serde(default = "default_header_read_timeout", with = "duration_text")]
    pub header_read_timeout: Duration,
    /// A connection is closed after this, whatever it does (one request per
    /// connection). Default `30s`.
    #[serde(default = "default_idle_timeout", with = "duration_text")]
    pub idle_timeout: Duration,
    /// Connections open at once; beyond it a new connection evicts the
    /// oldest one that has not sent a request yet. Default 256.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How often adapter health is probed in the background (health
    /// requests read the last probe). Default `5s`.
    #[serde(default = "default_http_health_interval", with = "duration_text")]
    pub health_interval: Duration,
    /// Longest wait for one adapter's health answer. Default `3s`.
    #[serde(default = "default_http_health_timeout", with = "duration_text")]
    pub health_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_listen(),
            token_file: None,
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_connections: default_max_connections(),
            health_interval: default_http_health_interval(),
            health_timeout: default_http_health_timeout(),
        }
    }
}

fn default_header_read_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_connections() -> usize {
    256
}
fn default_http_health_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_http_health_timeout() -> Duration {
    Duration::from_secs(3)
}

fn default_listen() -> String {
    "127.0.0.1:9464".to_owned()
}

/// What messages without a `content-type` header are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// grpcq calls (binary `grpcq.Message`, or base64 of one as grpcq's SQS
    /// adapter writes). The default: native grpcq publishers send no
    /// content type.
    #[default]
    Grpcq,
    /// OJS envelopes in protobuf.
    Ojs,
}

/// `[[sources]]`: one queue the daemon consumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Name used by routes, metrics and logs.
    pub name: String,
    /// Adapter name from `[adapters]`.
    pub adapter: String,
    /// Queue (Kafka topic, SQS queue, RabbitMQ queue) to consume.
    pub queue: String,
    /// Format of messages without a content type. Messages with one are
    /// decoded by it. Default `grpcq`.
    #[serde(default)]
    pub format: InputFormat,
    /// Consumer group (Kafka). Default `ojs-bridge`.
    #[serde(default = "default_group")]
    pub group: String,
    /// Messages fetched per receive. Default 256.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Messages received but not yet acked, at most; a slow sink slows
    /// consumption instead of growing memory. Default 2048.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Payload bytes received but not yet acked, at most (plus the one batch
    /// that crossed the line): memory is bounded by size, not only by count,
    /// when messages are large. Default 256 MiB.
    #[serde(default = "default_max_in_flight_bytes")]
    pub max_in_flight_bytes: usize,
    /// How long a received message stays invisible to other consumers
    /// (SQS, local, memory). Default `60s`.
    #[serde(default = "default_visibility_timeout", with = "duration_text")]
    pub visibility_timeout: Duration,
    /// Where poison messages go. Default: the source queue's own dead-letter
    /// destination (`ojs-bridge tail --dead-letters` reads it).
    #[serde(default)]
    pub dead_letter: Option<DeadLetterConfig>,
    /// `none` (default): batches run side by side, up to
    /// `max_in_flight / batch_size` at once, so a later batch may reach the
    /// sink before an earlier one. `per_key`: messages with the same key
    /// (Kafka record key, RabbitMQ `x-ojs-key`, SQS `ojs-key`) reach the
    /// sink in the order they were received, across batches and retries.
    #[serde(default)]
    pub ordering: OrderingMode,
    /// With `ordering = "per_key"`: keys are spread over this many lanes,
    /// each publishing one batch at a time. Default `max_in_flight /
    /// batch_size`.
    #[serde(default)]
    pub lanes: Option<usize>,
}

/// What order a source keeps; see [`SourceConfig::ordering`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderingMode {
    /// No order across batches.
    #[default]
    None,
    /// Per-key order across batches and retries.
    PerKey,
}

impl SourceConfig {
    /// Ordered lanes in force: `None` without `ordering = "per_key"`.
    pub fn ordered_lanes(&self) -> Option<usize> {
        match self.ordering {
            OrderingMode::None => None,
            OrderingMode::PerKey => Some(
                self.lanes
                    .unwrap_or(self.max_in_flight / self.batch_size.max(1))
                    .max(1),
            ),
        }
    }
}

fn default_group() -> String {
    "ojs-bridge".to_owned()
}
fn default_batch_size() -> usize {
    256
}
fn default_max_in_flight() -> usize {
    2048
}
fn default_max_in_flight_bytes() -> usize {
    256 * 1024 * 1024
}
fn default_visibility_timeout() -> Duration {
    Duration::from_secs(60)
}

/// `dead_letter = { adapter = "…", queue = "…" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// Adapter name from `[adapters]`.
    pub adapter: String,
    /// Queue that receives the message as it was, with `ojs-error-type` and
    /// `ojs-error-message` headers.
    pub queue: String,
}

/// What a route publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// OJS jobs (grpcq calls are mapped per docs/design.md §5). The default.
    #[default]
    Ojs,
    /// grpcq calls (OJS jobs are mapped back).
    Grpcq,
}

/// Encoding of published OJS envelopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EnvelopeEncoding {
    /// `application/openjobspec+proto`. The default.
    #[default]
    Proto,
    /// `application/openjobspec+json`.
    Json,
}

/// `match = { … }`: every given pattern must match; `*` matches any run of
/// characters. An empty match matches every message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// grpcq topic pattern (matches calls only).
    #[serde(default)]
    pub topic: Option<String>,
    /// grpcq action pattern (matches calls only).
    #[serde(default)]
    pub action: Option<String>,
    /// OJS job type pattern (matches jobs only).
    #[serde(default, rename = "type")]
    pub job_type: Option<String>,
}

/// `[[routes]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name used by metrics and logs.
    pub name: String,
    /// Sources this route applies to. Default: all.
    #[serde(default)]
    pub sources: Vec<String>,
    /// Which messages this route takes. Default: all.
    #[serde(default, rename = "match")]
    pub matcher: MatchConfig,
    /// Adapter name from `[adapters]` to publish to.
    pub sink: String,
    /// What to publish. Default `ojs`.
    #[serde(default)]
    pub to: OutputFormat,
    /// Destination queue template. Default `default` for OJS output and
    /// `{topic}` for grpcq output (grpcq's Kafka/RabbitMQ convention).
    #[serde(default)]
    pub queue: Option<String>,
    /// OJS job type template; placeholders are inserted as lowercase
    /// snake_case segments. Default `{topic}.{action}` for calls and
    /// `{type}` (unchanged) for jobs.
    #[serde(default, rename = "type")]
    pub job_type: Option<String>,
    /// grpcq topic template for jobs turned into calls. Default: the
    /// job's `grpcq.topic` meta, else its type up to the last dot.
    #[serde(default)]
    pub topic: Option<String>,
    /// grpcq action template for jobs turned into calls. Default: the
    /// job's `grpcq.action` meta, else its type after the last dot.
    #[serde(default)]
    pub action: Option<String>,
    /// OJS envelope encoding. Default `proto`.
    #[serde(default)]
    pub encoding: EnvelopeEncoding,
    /// A protobuf FileDescriptorSet (`protoc --descriptor_set_out`,
    /// `buf build -o`): requests are transcoded to proto3 JSON args (and
    /// back on the reverse route). Default: payload as base64url.
    #[serde(default)]
    pub descriptor_set: Option<PathBuf>,
    /// Request message type in the descriptor set. Default: the input type
    /// of method `{action}` of service `{topic}`.
    #[serde(default)]
    pub message_type: Option<String>,
    /// Globs (`*` = any run of characters) a destination chosen by the
    /// message (a `{queue}`/`{topic}`/… template, a call's topic) must
    /// match; anything else is dead-lettered `forbidden_destination`.
    /// Default: a literal `queue` allows itself only; a template is bounded
    /// by the route's `match` globs (and refused at config check when a
    /// placeholder has none); a job keeping its own queue is bounded only
    /// by the sink's reserved names and `max_destinations`.
    #[serde(default)]
    pub allowed_queues: Vec<String>,
    /// Distinct destinations this route may publish to; messages for more
    /// are dead-lettered `too_many_destinations`. Default 100.
    #[serde(default = "default_max_destinations")]
    pub max_destinations: usize,
}

fn default_max_destinations() -> usize {
    100
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
        for (name, entry) in &self.adapters {
            for (setting, path) in entry.compile(name)?.files_read() {
                if let Err(e) = std::fs::File::open(&path) {
                    unreadable.push(format!(
                        "adapters.{name}.{setting}: cannot read {}: {e}",
                        path.display()
                    ));
                }
            }
        }
        match unreadable.split_first() {
            None => Ok(()),
            Some((first, rest)) => {
                let (field, reason) = first.split_once(": ").unwrap_or((first.as_str(), ""));
                let mut reason = reason.to_owned();
                for more in rest {
                    reason.push_str("; ");
                    reason.push_str(more);
                }
                Err(invalid(field, reason))
            }
        }
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
        if self.sources.is_empty() {
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
        if self.routes.is_empty() {
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

/// Parses `250ms`, `30s`, `5m`, `1h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits_end);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 250ms, 30s, 5m or 1h"))?;
    let per_unit = match unit.trim() {
        "ms" => Duration::from_millis(1),
        "" | "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use ms, s, m or h)"
            ))
        }
    };
    per_unit
        .checked_mul(u32::try_from(n).map_err(|_| format!("{text:?} is too long"))?)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// The destination template of a route whose messages choose their
/// destination: its `queue` template, or `{topic}` for grpcq output without
/// one. `None` for a literal queue and for OJS output without a queue (each
/// job keeps its queue; calls go to `default`).
fn destination_template(config: &RouteConfig) -> Option<String> {
    match (&config.queue, config.to) {
        (Some(q), _) => Some(q.clone()),
        (None, OutputFormat::Grpcq) => Some("{topic}".to_owned()),
        (None, OutputFormat::Ojs) => None,
    }
}

/// The globs a route's destination must match: `allowed_queues` when set;
/// otherwise, for a destination template, the template with each
/// placeholder replaced by the route's `match` glob for it (`{topic}` with
/// `match.topic = "payment.*"` allows `payment.*`) — and an error when a
/// placeholder has no such glob (`{queue}`, `{originator}`, or an unmatched
/// `{topic}`), because then any message could choose any destination.
/// Empty: no bound beyond reserved names and `max_destinations`.
pub fn allowed_destinations(config: &RouteConfig) -> Result<Vec<String>, String> {
    if !config.allowed_queues.is_empty() {
        return Ok(config.allowed_queues.clone());
    }
    let Some(text) = destination_template(config) else {
        return Ok(Vec::new());
    };
    let template = Template::parse(&text, TemplateVar::ALL)?;
    if template.as_literal().is_some() {
        return Ok(Vec::new());
    }
    let bound = |v: TemplateVar| match v {
        TemplateVar::Topic => config.matcher.topic.clone(),
        TemplateVar::Action => config.matcher.action.clone(),
        TemplateVar::Type => config.matcher.job_type.clone(),
        TemplateVar::Queue | TemplateVar::Originator => None,
    };
    if let Some(free) = template.vars().find(|v| bound(*v).is_none()) {
        return Err(format!(
            "messages choose this route's destination through {{{}}} in {text:?}, and nothing bounds it: list the queues they may choose (allowed_queues = [\"orders\", \"payment.*\"]), or match the {} this placeholder takes",
            free.name(),
            free.name()
        ));
    }
    Ok(vec![template.render_with(|v| bound(v).unwrap_or_default())])
}

/// Durations as text (`"30s"`) or a number of seconds.
mod duration_text {
    use std::time::Duration;

    use serde::{de, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        if d.subsec_millis() == 0 {
            s.serialize_str(&format!("{}s", d.as_secs()))
        } else {
            s.serialize_str(&format!("{}ms", d.as_millis()))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Text {
            Secs(u64),
            Text(String),
        }
        match Text::deserialize(d)? {
            Text::Secs(n) => Ok(Duration::from_secs(n)),
            Text::Text(t) => super::parse_duration(&t).map_err(de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<BridgeConfig, ConfigError> {
        BridgeConfig::parse(text, "test.toml", &[])
    }

    const MINIMAL: &str = r#"
        [adapters]
        local = "local:./data"
        [[sources]]
        name = "calls"
        adapter = "local"
        queue = "calls"
        [[routes]]
        name = "all"
        sink = "local"
    "#;

    #[test]
    fn the_embedded_default_is_valid_and_documented_values_hold() {
        let c = BridgeConfig::embedded_default(&[]).unwrap();
        assert_eq!(c.http.listen, "127.0.0.1:9464");
        assert_eq!(
            c.adapters.get("local").map(|a| a.url.as_str()),
            Some("local:./ojs-bridge-data")
        );
        assert_eq!(c.sources[0].queue, "calls");
        assert_eq!(c.sources[0].format, InputFormat::Grpcq);
        assert_eq!(c.routes[0].queue.as_deref(), Some("default"));
        assert_eq!(c.routes[0].job_type.as_deref(), Some("{topic}.{action}"));
        assert_eq!(c.shutdown_timeout, Duration::from_secs(30));
    }

    #[test]
    fn defaults_fill_what_a_file_leaves_out() {
        let c = parse(MINIMAL).unwrap();
        let s = &c.sources[0];
        assert_eq!(
            (s.batch_size, s.max_in_flight, s.group.as_str()),
            (256, 2048, "ojs-bridge")
        );
        assert_eq!(s.visibility_timeout, Duration::from_secs(60));
        assert_eq!(c.routes[0].to, OutputFormat::Ojs);
        assert_eq!(c.routes[0].encoding, EnvelopeEncoding::Proto);
    }

    #[test]
    fn worker_threads_from_the_file_or_the_environment_and_never_zero() {
        assert_eq!(parse(MINIMAL).unwrap().worker_threads, None);
        let file = format!("worker_threads = 1\n{MINIMAL}");
        assert_eq!(parse(&file).unwrap().worker_threads, Some(1));
        let env = |v: &str| vec![("OJS_BRIDGE_WORKER_THREADS".to_owned(), v.to_owned())];
        let c = BridgeConfig::parse(&file, "t", &env("3")).unwrap();
        assert_eq!(c.worker_threads, Some(3), "the environment wins");
        for bad in ["0", "two"] {
            match BridgeConfig::parse(MINIMAL, "t", &env(bad)) {
                Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "worker_threads"),
                other => panic!("{bad}: expected worker_threads refused, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_runtime_leaves_a_cpu_to_librdkafka_when_an_adapter_is_kafka() {
        let without_kafka = parse(MINIMAL).unwrap();
        assert_eq!(without_kafka.runtime_threads(2), 2);
        assert_eq!(without_kafka.runtime_threads(8), 8);
        assert_eq!(without_kafka.runtime_threads(0), 1);
        let kafka = format!(
            "{}\n[adapters.events]\nurl = \"kafka://127.0.0.1:9092\"\n",
            MINIMAL.replace("[adapters]\n", "[adapters]\nbus = \"memory://bus\"\n")
        );
        let with_kafka = parse(&kafka).unwrap();
        assert_eq!(with_kafka.runtime_threads(2), 1);
        assert_eq!(with_kafka.runtime_threads(8), 7);
        assert_eq!(with_kafka.runtime_threads(1), 1, "never none");
        let set = parse(&format!("worker_threads = 2\n{kafka}")).unwrap();
        assert_eq!(set.runtime_threads(2), 2, "a setting wins");
        assert_eq!(set.runtime_threads(16), 2);
    }

    #[test]
    fn environment_overrides_listen_timeout_and_adapter_urls() {
        let env = vec![
            (
                "OJS_BRIDGE_HTTP_LISTEN".to_owned(),
                "127.0.0.1:19464".to_owned(),
            ),
            ("OJS_BRIDGE_SHUTDOWN_TIMEOUT".to_owned(), "5s".to_owned()),
            (
                "OJS_BRIDGE_ADAPTER_LOCAL".to_owned(),
                "local:./elsewhere".to_owned(),
            ),
            ("OJS_BRIDGE_LOG".to_owned(), "debug".to_owned()),
            ("PATH".to_owned(), "/bin".to_owned()),
        ];
        let c = BridgeConfig::parse(MINIMAL, "t", &env).unwrap();
        assert_eq!(c.http.listen, "127.0.0.1:19464");
        assert_eq!(c.shutdown_timeout, Duration::from_secs(5));
        assert_eq!(
            c.adapters.get("local").map(|a| a.url.as_str()),
            Some("local:./elsewhere")
        );
        assert_eq!(c.adapters.len(), 1);
    }

    fn error_of(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn a_file_is_refused_with_every_problem_in_it() {
        let text = MINIMAL
            .replace("queue = \"calls\"", "queue = \"\"\nbatch_size = 0")
            .replace("sink = \"local\"", "sink = \"nope\"");
        let err = parse(&text).unwrap_err();
        let ConfigError::Several(problems) = &err else {
            panic!("expected every problem, got {err}");
        };
        let fields: Vec<String> = problems
            .iter()
            .map(|p| match p {
                ConfigError::Invalid { field, .. } => field.clone(),
                other => other.to_string(),
            })
            .collect();
        assert_eq!(
            fields,
            [
                "sources[0].queue",
                "sources[0].batch_size",
                "routes[0].sink"
            ],
            "{err}"
        );
        let text = err.to_string();
        assert!(text.starts_with("3 problems:\n"), "{text}");
        assert_eq!(text.lines().count(), 4, "one line each: {text}");
    }

    #[test]
    fn near_misses_get_a_did_you_mean() {
        let text = error_of(&MINIMAL.replace("[[sources]]", "[[sourcs]]"));
        assert!(text.contains("did you mean `sources`?"), "{text}");
        let text = error_of(&MINIMAL.replace(
            "queue = \"calls\"",
            "queue = \"calls\"\nvisibility_timout = \"1s\"",
        ));
        assert!(
            text.contains("did you mean `visibility_timeout`?"),
            "{text}"
        );
        let text = error_of(&MINIMAL.replace("sink = \"local\"", "sink = \"locla\""));
        assert!(text.contains("did you mean `local`?"), "{text}");
        assert_eq!(
            suggest_known_field("unknown field `zzz`, expected `a`".into()),
            "unknown field `zzz`, expected `a`"
        );
    }

    #[test]
    fn each_bad_file_names_what_to_fix() {
        let cases: &[(&str, &str)] = &[
            ("adapters = [", "test.toml"),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nbatch = 3"),
                "unknown field `batch`",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"kafak\""),
                "routes[0].sink: names adapter \"kafak\"",
            ),
            (
                &MINIMAL.replace("adapter = \"local\"", "adapter = \"nope\""),
                "sources[0].adapter",
            ),
            (
                &MINIMAL.replace("local:./data", "ftp://x"),
                "adapters.local",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nbatch_size = 0"),
                "sources[0].batch_size",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nmax_in_flight = 2\nbatch_size = 10",
                ),
                "sources[0].max_in_flight",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nmax_in_flight_bytes = 0"),
                "sources[0].max_in_flight_bytes",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nordering = \"per_key\"\nlanes = 0",
                ),
                "sources[0].lanes",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nlanes = 4"),
                "sources[0].lanes",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nordering = \"by_key\""),
                "ordering",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nvisibility_timeout = \"ten\"",
                ),
                "not a duration",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\ntype = \"{topik}\""),
                "routes[0].type",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\nsources = [\"x\"]"),
                "routes[0].sources[0]",
            ),
            (
                &MINIMAL.replace(
                    "sink = \"local\"",
                    "sink = \"local\"\nmatch = { type = \"a\", topic = \"b\" }",
                ),
                "routes[0].match",
            ),
            (
                &MINIMAL.replace(
                    "sink = \"local\"",
                    "sink = \"local\"\nmessage_type = \"a.B\"",
                ),
                "needs descriptor_set",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\nto = \"xml\""),
                "unknown variant `xml`",
            ),
            (
                &format!("{MINIMAL}\n[http]\nlisten = \"everywhere\""),
                "http.listen",
            ),
            (
                &format!("{MINIMAL}\n[[routes]]\nname = \"all\"\nsink = \"local\""),
                "routes[1].name",
            ),
            (
                &MINIMAL.replace(
                    "[[routes]]\n        name = \"all\"\n        sink = \"local\"",
                    "",
                ),
                "routes: no route",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"eu\"\n[federations.g.regions.us]\nadapter = \"local\""),
                "federations.g.local",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"us\"\n[federations.g.regions.us]\nadapter = \"nope\""),
                "federations.g.regions.us.adapter",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"us\"\n[federations.g.regions.us]\nadapter = \"local\"\nhealth = \"https://x\""),
                "federations.g.regions.us.health",
            ),
        ];
        for (text, expected) in cases {
            let e = error_of(text);
            assert!(e.contains(expected), "expected {expected:?} in {e:?}");
        }
    }

    #[test]
    fn durations_parse_in_every_documented_unit() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("").is_err());
    }
}

#[cfg(test)]
mod documented_settings {
    use std::collections::BTreeSet;

    use super::*;
    use crate::endpoint::AdapterConfig;

    /// The setting names of each adapter's table in `docs/adapters/`.
    fn documented_settings() -> BTreeMap<&'static str, BTreeSet<String>> {
        let pages = [
            ("memory", include_str!("../../docs/adapters/memory.md")),
            ("local", include_str!("../../docs/adapters/local.md")),
            ("rabbitmq", include_str!("../../docs/adapters/rabbitmq.md")),
            ("kafka", include_str!("../../docs/adapters/kafka.md")),
            ("sqs", include_str!("../../docs/adapters/sqs.md")),
        ];
        let mut out = BTreeMap::new();
        for (kind, section) in pages {
            let table = section
                .split("| setting | default | meaning |")
                .nth(1)
                .expect("a settings table");
            let mut names = BTreeSet::new();
            for row in table.lines().skip(2) {
                let Some(cell) = row.strip_prefix('|').and_then(|r| r.split('|').next()) else {
                    break;
                };
                // Backticked words of the first cell; `(URL …)` notes aside.
                let cell = cell.split("(URL").next().unwrap_or(cell);
                for name in cell.split('`').skip(1).step_by(2) {
                    if name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                        names.insert(name.to_owned());
                    }
                }
            }
            names.remove("url");
            out.insert(kind, names);
        }
        out
    }

    #[test]
    fn every_dead_letter_reason_is_documented() {
        let operations = include_str!("../../docs/operations.md");
        for kind in ojs_core::DeadLetterKind::ALL {
            assert!(
                operations.contains(&format!("`{kind}`")),
                "docs/operations.md does not name dead-letter reason {kind}"
            );
        }
    }

    #[test]
    fn every_documented_setting_is_reachable_from_a_config_file() {
        let documented = documented_settings();
        let text = include_str!("../../examples/all-adapter-settings.toml");
        let config = BridgeConfig::parse(text, "all-adapter-settings.toml", &[]).unwrap();
        let mut kinds = BTreeSet::new();
        for (name, entry) in &config.adapters {
            let compiled = entry.compile(name).unwrap();
            let kind = compiled.kind();
            kinds.insert(kind);
            let names = &documented[kind];
            // Its page documents exactly the settings the adapter has.
            let actual: BTreeSet<String> = AdapterConfig::setting_names(&entry.url)
                .unwrap()
                .into_iter()
                .collect();
            assert_eq!(names, &actual, "docs/adapters/{kind}.md table");
            // The file sets each of them, and each arrived (differs from
            // the default of the same URL).
            let set: BTreeSet<String> = entry.settings.keys().cloned().collect();
            assert_eq!(names, &set, "settings the example sets for {kind}");
            let base = AdapterConfig::from_url(&entry.url).unwrap();
            let as_json = |c: &AdapterConfig| {
                match c {
                    AdapterConfig::Memory { config, .. } => serde_json::to_value(config),
                    AdapterConfig::Local(c) => serde_json::to_value(c),
                    AdapterConfig::Rabbit(c) => serde_json::to_value(c),
                    AdapterConfig::Kafka(c) => serde_json::to_value(c),
                    AdapterConfig::Sqs(c) => serde_json::to_value(c),
                }
                .unwrap()
            };
            let (got, default) = (as_json(&compiled), as_json(&base));
            for setting in names {
                assert_ne!(
                    got[setting.as_str()],
                    default[setting.as_str()],
                    "{kind}.{setting} did not arrive"
                );
            }
        }
        assert_eq!(kinds.len(), documented.len(), "one adapter of each kind");
    }

    #[test]
    fn settings_come_from_urls_tables_and_the_environment_in_that_order() {
        let text = r#"
            [adapters.events]
            url = "kafka://h:9092?replication=2&partitions=4&linger.ms=5"
            replication = 3
            [adapters.rabbit]
            url = "amqp://u@h/%2f"
            [[sources]]
            name = "s"
            adapter = "rabbit"
            queue = "q"
            [[routes]]
            name = "r"
            sink = "events"
        "#;
        let env = vec![
            (
                "OJS_BRIDGE_ADAPTER_EVENTS__PARTITIONS".to_owned(),
                "8".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_EVENTS__SASL_PASSWORD".to_owned(),
                "pw-1".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_RABBIT__TOPOLOGY".to_owned(),
                "existing".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_RABBIT__QUEUE_TEMPLATE".to_owned(),
                "{queue}".to_owned(),
            ),
        ];
        let config = BridgeConfig::parse(text, "t", &env).unwrap();
        let AdapterConfig::Kafka(k) = config.adapters["events"].compile("events").unwrap() else {
            panic!()
        };
        assert_eq!((k.replication, k.partitions), (3, 8));
        assert_eq!(k.librdkafka_options["linger.ms"], "5");
        assert_eq!(k.librdkafka_options["sasl.password"], "pw-1");
        assert!(!format!("{:?} {k:?}", config.adapters["events"]).contains("pw-1"));
        let AdapterConfig::Rabbit(r) = config.adapters["rabbit"].compile("rabbit").unwrap() else {
            panic!()
        };
        assert_eq!(r.topology, ojs_core::settings::Topology::Existing);
        assert_eq!(r.queue_name_of("orders"), "orders");
    }

    #[test]
    fn bad_settings_name_the_adapter_and_the_setting() {
        for (table, field) in [
            ("replication = \"many\"", "adapters.events.replication"),
            ("bogus = 1", "adapters.events.bogus"),
            ("topology = \"create\"", "adapters.events.topology"),
            ("partitions = 0", "adapters.events.partitions"),
        ] {
            let text = format!(
                "[adapters.events]\nurl = \"kafka://h:9092\"\n{table}\n[[sources]]\nname = \"s\"\nadapter = \"events\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"events\"\n"
            );
            let e = BridgeConfig::parse(&text, "t", &[])
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(field), "{table}: {e}");
        }
        let e = BridgeConfig::parse(
            "[adapters.x]\nqueue_template = \"{queue}\"\n[[sources]]\nname = \"s\"\nadapter = \"x\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"x\"\n",
            "t",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("adapters.x") && e.contains("url"), "{e}");
    }
}

#[cfg(test)]
mod type_templates {
    use super::*;

    fn with_type(t: &str) -> Result<BridgeConfig, ConfigError> {
        BridgeConfig::parse(
            &format!(
                "[adapters]\nm = \"memory://x\"\n[[sources]]\nname = \"s\"\nadapter = \"m\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"m\"\ntype = \"{t}\"\n"
            ),
            "t",
            &[],
        )
    }

    #[test]
    fn a_type_template_must_render_an_ojs_type() {
        assert!(with_type("{topic}.{action}").is_ok());
        assert!(with_type("billing.{action}").is_ok());
        assert!(with_type("billing.invoice.generate").is_ok());
        for bad in [
            "Billing.{action}",
            "billing-{action}",
            "Billing.Invoice",
            "2fa.send",
        ] {
            let e = with_type(bad).unwrap_err().to_string();
            assert!(e.starts_with("routes[0].type"), "{bad}: {e}");
        }
    }
}

#[cfg(test)]
mod destinations {
    use super::*;

    fn route(extra: &str) -> Result<BridgeConfig, ConfigError> {
        BridgeConfig::parse(
            &format!(
                "[adapters]\nm = \"memory://x\"\n[[sources]]\nname = \"s\"\nadapter = \"m\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"m\"\n{extra}\n"
            ),
            "t",
            &[],
        )
    }

    #[test]
    fn a_message_chosen_destination_must_be_bounded_by_the_config() {
        // Literal, match-bounded and explicitly allowed destinations are fine.
        for ok in [
            "queue = \"jobs\"",
            "to = \"grpcq\"\nmatch = { topic = \"payment.*\" }",
            "queue = \"calls.{topic}\"\nmatch = { topic = \"payment.*\" }",
            "queue = \"{queue}\"\nallowed_queues = [\"orders\", \"billing.*\"]",
            "",
        ] {
            let c = route(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
            crate::routes::Route::compile(&c.routes[0], 0).unwrap();
        }
        assert_eq!(
            crate::config::allowed_destinations(
                &route("queue = \"calls.{topic}\"\nmatch = { topic = \"payment.*\" }")
                    .unwrap()
                    .routes[0]
            )
            .unwrap(),
            vec!["calls.payment.*".to_owned()]
        );
        // Unbounded: grpcq output to any topic, a job's queue, the originator.
        for bad in [
            "to = \"grpcq\"",
            "queue = \"{queue}\"",
            "queue = \"x.{originator}\"\nmatch = { topic = \"a.*\" }",
        ] {
            let e = route(bad).unwrap_err().to_string();
            assert!(e.starts_with("routes[0].allowed_queues"), "{bad}: {e}");
        }
    }
}
