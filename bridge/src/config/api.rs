//! `[api]`: the OJS HTTP binding on the `[http]` listener — which adapter's
//! queues hold the jobs, which queues clients may name, where job state is
//! kept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ojs_api::auth::{Operation, Token, Tokens};
use ojs_core::glob::Glob;
use ojs_core::redact::Secret;
use serde::{Deserialize, Serialize};

use crate::config::duration::duration_text;
use crate::config::{invalid, AdapterEntry, ConfigError, EnvelopeEncoding, HttpConfig};

/// `[api]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// The adapter (from `[adapters]`) whose queues hold the jobs: an OJS
    /// queue `q` is that adapter's queue `q`, through its own
    /// `queue_template`, topology and credentials.
    pub adapter: String,
    /// Queues a client may name (`*` matches any run of characters); a
    /// push to any other is refused (404 `not_found`) and nothing is
    /// published. Default: any queue.
    #[serde(default)]
    pub queues: Vec<String>,
    /// Where job state (INFO, CANCEL, scheduled jobs, events) is kept:
    /// `local:./dir` or `local:///abs/dir` (file `jobs.sqlite` in it, for
    /// one process), or `postgres://user@host:port/db` (shared by
    /// replicas). Default: the data directory of `adapter` when it is the
    /// embedded broker, else `local:./ojs-bridge-data`.
    #[serde(default)]
    pub state: Option<StateUrl>,
    /// The file holding the PostgreSQL password, so that `state` need not
    /// hold it.
    #[serde(default)]
    pub state_password_file: Option<PathBuf>,
    /// The PostgreSQL schema (namespace) of the job store's tables, made
    /// when missing. Default `ojs_bridge`.
    #[serde(default = "default_state_schema")]
    pub state_schema: String,
    /// PostgreSQL connections of this process. Default 8.
    #[serde(default = "default_state_connections")]
    pub state_connections: usize,
    /// How jobs are written to the broker: `proto` (the default, as sinks
    /// write) or `json`.
    #[serde(default)]
    pub encoding: EnvelopeEncoding,
    /// Largest request body, bytes; larger is 413. Default 4194304 (4 MiB).
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Most jobs in one batch; more is 413. Default 1000.
    #[serde(default = "default_max_batch_jobs")]
    pub max_batch_jobs: usize,
    /// How long finished (cancelled, completed, discarded) jobs and events
    /// are kept for INFO. Default `7d`.
    #[serde(default = "default_retention", with = "duration_text")]
    pub retention: Duration,
    /// How long the broker keeps a fetched job's delivery from others
    /// (SQS, the embedded broker): how soon the active jobs of a process
    /// that died come back. Held deliveries are extended every third of
    /// it. Default `60s`.
    #[serde(default = "default_visibility_timeout", with = "duration_text")]
    pub visibility_timeout: Duration,
    /// At shutdown, how long workers may still acknowledge or fail the
    /// jobs this process handed out, while FETCH hands out nothing;
    /// `0s`: they go back to the broker at once. Default `10s`.
    #[serde(default = "default_drain_timeout", with = "duration_text")]
    pub drain_timeout: Duration,
    /// How long the broker ack of a finished job waits for others to be
    /// sent with it (one request or commit for them all); the job is
    /// finished in the store when its ACK is answered. `0ms`: each is sent
    /// at once. At most `1s`. Default `2ms`.
    #[serde(default = "default_ack_linger", with = "duration_text")]
    pub ack_linger: Duration,
    /// Most values (arrays, objects and their members) one JSON body may
    /// hold, counted on its bytes before it is parsed; more is 400.
    /// Default 200000.
    #[serde(default = "default_max_json_values")]
    pub max_json_values: usize,
    /// Request bodies being read or served at once, bytes, across every
    /// connection and both bindings; a request past it is answered 429
    /// with `Retry-After` (gRPC `RESOURCE_EXHAUSTED`) before its body is
    /// read. Default 67108864 (64 MiB).
    #[serde(default = "default_max_body_bytes_in_flight")]
    pub max_body_bytes_in_flight: usize,
    /// Longest one request body may take to arrive; past it, 408 and the
    /// connection is closed. Default `30s`.
    #[serde(default = "default_body_timeout", with = "duration_text")]
    pub body_timeout: Duration,
    /// Slowest a request body may arrive after its first second, bytes
    /// per second; slower is 408 and the connection is closed. Default
    /// 16384.
    #[serde(default = "default_body_min_rate")]
    pub body_min_rate: u64,
    /// Most bytes of jobs (their size on the broker) one FETCH answers
    /// with; a FETCH always gets at least one job when one is there.
    /// Default 8388608 (8 MiB).
    #[serde(default = "default_max_fetch_bytes")]
    pub max_fetch_bytes: usize,
    /// Most bytes of messages of the active jobs this process holds (their
    /// deliveries are kept until each is acked or failed): past it a FETCH
    /// waits for room and answers 429 when none came within its wait.
    /// Default 268435456 (256 MiB).
    #[serde(default = "default_max_held_bytes")]
    pub max_held_bytes: usize,
    /// Most queues this process keeps a consumer of for FETCH; the one
    /// idle longest is closed to make room. Default 256.
    #[serde(default = "default_max_consumers")]
    pub max_consumers: usize,
    /// A queue's consumer that no FETCH used for this long is closed.
    /// Default `5m`.
    #[serde(default = "default_consumer_idle_timeout", with = "duration_text")]
    pub consumer_idle_timeout: Duration,
    /// Most cron jobs the server keeps; registering one more is refused
    /// (409) until one is deleted. Default 1000.
    #[serde(default = "default_max_crons")]
    pub max_crons: usize,
    /// Most steps of one workflow, callbacks included; a larger workflow
    /// is refused (400 `invalid_workflow`). Default 1000.
    #[serde(default = "default_max_workflow_steps")]
    pub max_workflow_steps: usize,
    /// Most bytes of earlier steps' results a workflow job is given as
    /// `parent_results`: the nearest that fit, older ones as `null`.
    /// Default 1 MiB.
    #[serde(default = "default_max_parent_results_bytes")]
    pub max_parent_results_bytes: usize,
    /// Most live event streams (`GET /ojs/v1/events/stream`) open at once;
    /// one more is refused (429). Default 1000.
    #[serde(default = "default_max_event_streams")]
    pub max_event_streams: usize,
    /// Whether `POST /ojs/v1/admin/reset` (admin on every queue) may empty
    /// the job store and its queues on the broker: for test runs (the
    /// official OJS runner's `-reset-url`), never production. Default
    /// false (refused, 403).
    #[serde(default)]
    pub allow_reset: bool,
    /// What an exhausted job becomes when its own retry policy names no
    /// `on_exhaustion`: `discard` (the spec's default: not kept as a dead
    /// letter) or `dead_letter` (every exhausted job kept as one).
    #[serde(default)]
    pub on_exhaustion: ExhaustionConfig,
    /// What a commit of the job store survives: `process` (a crash of
    /// the process; the default, as the embedded broker's) or `power`
    /// (also power loss: an fsync per group commit).
    #[serde(default)]
    pub durability: StoreDurability,
    /// Bearer tokens, each with its operations and queues. With any token
    /// (or `[http] token_file`, which allows everything) every request
    /// needs one. Default: none (open; the listener is on loopback).
    #[serde(default)]
    pub tokens: Vec<ApiTokenConfig>,
}

/// `[api] state`: a URL that may hold a password, never shown.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StateUrl(pub String);

impl std::fmt::Debug for StateUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&ojs_core::redact::url(&self.0))
    }
}

/// Where `[api] state` keeps job state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateLocation {
    /// The embedded store's directory.
    Dir(PathBuf),
    /// A PostgreSQL URL.
    Postgres(String),
}

/// `[api] on_exhaustion`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExhaustionConfig {
    /// Dropped, not listed as a dead letter.
    #[default]
    Discard,
    /// Kept as a dead letter.
    DeadLetter,
}

/// `[api] durability`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreDurability {
    /// Survives a crash of the process.
    #[default]
    Process,
    /// Also survives power loss.
    Power,
}

/// `[[api.tokens]]`: one bearer token and its scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiTokenConfig {
    /// How logs and errors name the token (never its value).
    pub name: String,
    /// The file holding the token (surrounding whitespace ignored).
    pub file: PathBuf,
    /// `push`, `read`, `admin` (everything, CANCEL included).
    pub operations: Vec<String>,
    /// Queues the token may touch (`*` matches any run of characters).
    /// Default: every queue.
    #[serde(default)]
    pub queues: Vec<String>,
}

/// Reads a token file: its contents, trimmed, refused when empty.
pub fn read_token_file(field: &str, path: &Path) -> Result<Secret, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(field, format!("cannot read {}: {e}", path.display())))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(invalid(field, format!("{} is empty", path.display())));
    }
    Ok(Secret::new(token))
}

// The defaults are the API's own, written once (`ojs_api::ApiSettings`).
fn default_max_body_bytes() -> usize {
    ojs_api::ApiSettings::default().max_body_bytes
}
fn default_max_batch_jobs() -> usize {
    ojs_api::ApiSettings::default().max_batch_jobs
}
fn default_retention() -> Duration {
    ojs_api::ApiSettings::default().retention
}
fn default_visibility_timeout() -> Duration {
    ojs_api::ApiSettings::default().visibility_timeout
}
fn default_drain_timeout() -> Duration {
    ojs_api::ApiSettings::default().drain_timeout
}
fn default_ack_linger() -> Duration {
    ojs_api::ApiSettings::default().ack_linger
}
fn default_max_json_values() -> usize {
    ojs_api::ApiSettings::default().max_json_values
}
fn default_max_body_bytes_in_flight() -> usize {
    ojs_api::ApiSettings::default().max_body_bytes_in_flight
}
fn default_body_timeout() -> Duration {
    ojs_api::ApiSettings::default().body_timeout
}
fn default_body_min_rate() -> u64 {
    ojs_api::ApiSettings::default().body_min_rate
}
fn default_max_fetch_bytes() -> usize {
    ojs_api::ApiSettings::default().max_fetch_bytes
}
fn default_max_held_bytes() -> usize {
    ojs_api::ApiSettings::default().max_held_bytes
}
fn default_max_consumers() -> usize {
    ojs_api::ApiSettings::default().max_consumers
}
fn default_max_crons() -> usize {
    ojs_api::ApiSettings::default().max_crons
}
fn default_max_workflow_steps() -> usize {
    ojs_api::ApiSettings::default().max_workflow_steps
}
fn default_max_event_streams() -> usize {
    ojs_api::ApiSettings::default().max_event_streams
}
fn default_max_parent_results_bytes() -> usize {
    ojs_api::ApiSettings::default().max_parent_results_bytes
}
fn default_consumer_idle_timeout() -> Duration {
    ojs_api::ApiSettings::default().consumer_idle_timeout
}
fn default_state_schema() -> String {
    "ojs_bridge".to_owned()
}
fn default_state_connections() -> usize {
    8
}

impl ApiConfig {
    /// Where the job store is.
    pub fn state_location(
        &self,
        adapters: &BTreeMap<String, AdapterEntry>,
    ) -> Result<StateLocation, String> {
        let url = match &self.state {
            Some(url) => url.0.clone(),
            None => match adapters.get(&self.adapter) {
                Some(a) if crate::endpoint::scheme(&a.url) == "local" => a.url.clone(),
                _ => "local:./ojs-bridge-data".to_owned(),
            },
        };
        match crate::endpoint::scheme(&url) {
            "local" => ojs_adapter_local::LocalConfig::from_url(&url)
                .map(|c| StateLocation::Dir(c.path))
                .map_err(|e| e.to_string()),
            "postgres" | "postgresql" => Ok(StateLocation::Postgres(url)),
            _ => Err(format!(
                "{:?}: job state is kept in an embedded store (local:./dir) or in PostgreSQL (postgres://…)",
                ojs_core::redact::url(&url)
            )),
        }
    }

    /// The PostgreSQL settings as written (`problems` checks them).
    fn postgres_settings(
        &self,
        url: &str,
        password: Option<Secret>,
    ) -> ojs_api::store::PostgresSettings {
        ojs_api::store::PostgresSettings {
            url: Secret::new(url),
            password,
            schema: self.state_schema.clone(),
            connections: self.state_connections,
        }
    }

    /// The API's runtime settings, built once from these.
    /// `http` is the listener's table: its `token_file` is a token that
    /// allows everything. Token files are read here.
    pub fn settings(
        &self,
        adapters: &BTreeMap<String, AdapterEntry>,
        http: &HttpConfig,
    ) -> Result<ojs_api::ApiSettings, ConfigError> {
        ConfigError::all(self.problems(adapters))?;
        let mut tokens = Vec::new();
        let health_token = http
            .token_file
            .as_deref()
            .map(|path| read_token_file("http.token_file", path))
            .transpose()?;
        if let Some(secret) = &health_token {
            tokens.push(Token {
                name: "http.token_file".into(),
                secret: secret.clone(),
                operations: vec![Operation::Admin],
                queues: Vec::new(),
            });
        }
        for (i, t) in self.tokens.iter().enumerate() {
            let field = format!("api.tokens[{i}]");
            tokens.push(Token {
                name: t.name.clone(),
                secret: read_token_file(&format!("{field}.file"), &t.file)?,
                operations: t
                    .operations
                    .iter()
                    .filter_map(|o| Operation::parse(o))
                    .collect(),
                queues: t
                    .queues
                    .iter()
                    .map(|q| Glob::new(q).map_err(|e| invalid(format!("{field}.queues"), e)))
                    .collect::<Result<_, _>>()?,
            });
        }
        let location = self
            .state_location(adapters)
            .map_err(|reason| invalid("api.state", reason))?;
        let (state_dir, postgres) = match location {
            StateLocation::Dir(dir) => (dir, None),
            StateLocation::Postgres(url) => {
                let password = self
                    .state_password_file
                    .as_deref()
                    .map(|p| read_token_file("api.state_password_file", p))
                    .transpose()?;
                let pg = self.postgres_settings(&url, password);
                (ojs_api::ApiSettings::default().state_dir, Some(pg))
            }
        };
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| Glob::new(q).map_err(|e| invalid(format!("api.queues[{i}]"), e)))
            .collect::<Result<_, _>>()?;
        Ok(ojs_api::ApiSettings {
            queues,
            encoding: match self.encoding {
                EnvelopeEncoding::Proto => ojs_core::Encoding::OjsProto,
                EnvelopeEncoding::Json => ojs_core::Encoding::OjsJson,
            },
            max_body_bytes: self.max_body_bytes,
            max_batch_jobs: self.max_batch_jobs,
            retention: self.retention,
            state_dir,
            postgres,
            tokens: Tokens::new(tokens),
            health_token,
            visibility_timeout: self.visibility_timeout,
            drain_timeout: self.drain_timeout,
            ack_linger: self.ack_linger,
            max_json_values: self.max_json_values,
            max_body_bytes_in_flight: self.max_body_bytes_in_flight,
            body_timeout: self.body_timeout,
            body_min_rate: self.body_min_rate,
            max_fetch_bytes: self.max_fetch_bytes,
            max_held_bytes: self.max_held_bytes,
            max_consumers: self.max_consumers,
            consumer_idle_timeout: self.consumer_idle_timeout,
            max_crons: self.max_crons,
            max_workflow_steps: self.max_workflow_steps,
            max_parent_results_bytes: self.max_parent_results_bytes,
            max_event_streams: self.max_event_streams,
            allow_reset: self.allow_reset,
            on_exhaustion: match self.on_exhaustion {
                ExhaustionConfig::Discard => ojs_api::Exhaustion::Discard,
                ExhaustionConfig::DeadLetter => ojs_api::Exhaustion::DeadLetter,
            },
            durability: match self.durability {
                StoreDurability::Process => ojs_api::store::Durability::Process,
                StoreDurability::Power => ojs_api::store::Durability::Power,
            },
        })
    }

    /// Problems with these settings, each with its field.
    pub(crate) fn problems(&self, adapters: &BTreeMap<String, AdapterEntry>) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        if !adapters.contains_key(&self.adapter) {
            errors.push(invalid(
                "api.adapter",
                format!(
                    "names adapter {:?}, which [adapters] does not define{}",
                    self.adapter,
                    ojs_queue::settings::suggestion(
                        &self.adapter,
                        adapters.keys().map(String::as_str)
                    )
                ),
            ));
        }
        for (i, q) in self.queues.iter().enumerate() {
            if let Err(e) = Glob::new(q) {
                errors.push(invalid(format!("api.queues[{i}]"), e));
                continue;
            }
            let literal = q.replace('*', "a");
            if let Err(e) = ojs_core::envelope::validate_queue_name(&literal) {
                errors.push(invalid(format!("api.queues[{i}]"), e.to_string()));
            }
        }
        match self.state_location(adapters) {
            Err(reason) => errors.push(invalid("api.state", reason)),
            Ok(StateLocation::Dir(_)) if self.state_password_file.is_some() => {
                errors.push(invalid(
                    "api.state_password_file",
                    "only a PostgreSQL state has a password",
                ))
            }
            Ok(StateLocation::Postgres(url)) => {
                for (setting, why) in self.postgres_settings(&url, None).problems() {
                    let field = match setting {
                        "url" => "api.state",
                        "schema" => "api.state_schema",
                        _ => "api.state_connections",
                    };
                    errors.push(invalid(field, why));
                }
            }
            Ok(StateLocation::Dir(_)) => {}
        }
        if self.max_body_bytes < 1024 {
            errors.push(invalid("api.max_body_bytes", "must be at least 1024"));
        }
        if self.max_batch_jobs == 0 {
            errors.push(invalid("api.max_batch_jobs", "must be at least 1"));
        }
        if self.visibility_timeout < Duration::from_secs(1) {
            errors.push(invalid("api.visibility_timeout", "must be at least 1s"));
        }
        if self.ack_linger > Duration::from_secs(1) {
            // Past a second the broker's copy of a finished job lingers
            // long enough to come back on a short visibility timeout.
            errors.push(invalid("api.ack_linger", "must be at most 1s"));
        }
        if self.max_json_values < 100 {
            errors.push(invalid("api.max_json_values", "must be at least 100"));
        }
        if self.max_body_bytes_in_flight < self.max_body_bytes {
            errors.push(invalid(
                "api.max_body_bytes_in_flight",
                format!(
                    "must be at least api.max_body_bytes ({}): one largest body must fit",
                    self.max_body_bytes
                ),
            ));
        }
        if self.body_timeout < Duration::from_secs(1) {
            errors.push(invalid("api.body_timeout", "must be at least 1s"));
        }
        if self.body_min_rate == 0 {
            errors.push(invalid(
                "api.body_min_rate",
                "must be at least 1 byte per second",
            ));
        }
        if self.max_fetch_bytes < 1024 {
            errors.push(invalid("api.max_fetch_bytes", "must be at least 1024"));
        }
        if self.max_held_bytes < 1024 {
            errors.push(invalid("api.max_held_bytes", "must be at least 1024"));
        }
        if self.max_consumers == 0 {
            errors.push(invalid("api.max_consumers", "must be at least 1"));
        }
        if self.consumer_idle_timeout < Duration::from_secs(1) {
            errors.push(invalid("api.consumer_idle_timeout", "must be at least 1s"));
        }
        if self.max_crons > 100_000 {
            errors.push(invalid("api.max_crons", "must be at most 100000"));
        }
        if !(1..=100_000).contains(&self.max_workflow_steps) {
            errors.push(invalid(
                "api.max_workflow_steps",
                "must be between 1 and 100000",
            ));
        }
        if !(1..=100_000).contains(&self.max_event_streams) {
            errors.push(invalid(
                "api.max_event_streams",
                "must be between 1 and 100000",
            ));
        }
        if self.max_parent_results_bytes > 64 << 20 {
            errors.push(invalid(
                "api.max_parent_results_bytes",
                "must be at most 64 MiB",
            ));
        }
        let mut names = BTreeSet::new();
        for (i, token) in self.tokens.iter().enumerate() {
            let field = format!("api.tokens[{i}]");
            if token.name.trim().is_empty() {
                errors.push(invalid(format!("{field}.name"), "must not be empty"));
            } else if !names.insert(token.name.as_str()) {
                errors.push(invalid(
                    format!("{field}.name"),
                    format!("{:?} names another token too", token.name),
                ));
            }
            if token.operations.is_empty() {
                errors.push(invalid(
                    format!("{field}.operations"),
                    "must list at least one of push, read, admin",
                ));
            }
            for op in &token.operations {
                if Operation::parse(op).is_none() {
                    errors.push(invalid(
                        format!("{field}.operations"),
                        format!("{op:?} is not an operation; use push, read or admin"),
                    ));
                }
            }
            for q in &token.queues {
                if let Err(e) = Glob::new(q) {
                    errors.push(invalid(format!("{field}.queues"), e));
                }
            }
        }
        errors
    }
}
