//! Build once, then run: the configuration (plain data) is turned into a
//! [`Blueprint`] by one [`Blueprint::build`], which holds every rule and
//! reports every problem of a file at once, each with its field path, and
//! [`Blueprint::read_files`] reads the files it names (token files, the
//! listener's certificate and key) into [`Ready`]. `check-config`
//! is exactly those two steps; `run` is those two steps plus connecting
//! ([`crate::daemon::Daemon::connect`]), which does no configuration work.
//! Nothing built here is changed afterwards.

use std::collections::{BTreeMap, BTreeSet};

use ojs_core::redact::Secret;

use crate::config::{invalid, BridgeConfig, ConfigError, OrderingMode};
use crate::endpoint::AdapterConfig;
use crate::probe::HttpHealthProbe;
use crate::routes::Route;
use crate::tls::ListenerTls;

pub mod connecting;

/// A configuration built into what the daemon runs: every adapter's typed
/// settings and every route compiled, in configuration order.
#[derive(Debug)]
pub struct Blueprint {
    /// The configuration it was built from (sources, listener, API,
    /// federations are read from it as they are).
    pub config: BridgeConfig,
    /// Each adapter's typed, validated settings, by name.
    pub adapters: BTreeMap<String, AdapterConfig>,
    /// The routes, first match wins; a route whose sink is a federation
    /// keeps its jobs' envelopes (the federation works on the job).
    pub routes: Vec<Route>,
    /// The health probe of each federation region that names one, by
    /// (federation, region).
    pub health_probes: BTreeMap<(String, String), HttpHealthProbe>,
}

/// A blueprint with the files it names read: what the daemon connects.
#[derive(Debug)]
pub struct Ready {
    /// The built configuration.
    pub blueprint: Blueprint,
    /// The listener's TLS (`http.tls_cert_file`, …), when it has one.
    pub tls: Option<ListenerTls>,
    /// The listener's bearer token (`http.token_file`).
    pub http_token: Option<Secret>,
    /// The OJS API's runtime settings (its token files read), when the
    /// file has `[api]`.
    pub api: Option<ojs_api::ApiSettings>,
}

/// A queue the configuration names literally, which must be usable before
/// the first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedQueue {
    /// The field that names it, e.g. `sources[0].queue`.
    pub field: String,
    /// The adapter it is on.
    pub adapter: String,
    /// The OJS queue.
    pub queue: String,
}

impl Blueprint {
    /// Every queue `config` and its built `routes` name literally: each
    /// source's queue and dead-letter queue, each route's literal
    /// destination.
    pub fn named_queues(config: &BridgeConfig, routes: &[Route]) -> Vec<NamedQueue> {
        let mut named = Vec::new();
        let mut name = |field: String, adapter: &str, queue: &str| {
            named.push(NamedQueue {
                field,
                adapter: adapter.to_owned(),
                queue: queue.to_owned(),
            });
        };
        for (i, s) in config.sources.iter().enumerate() {
            name(format!("sources[{i}].queue"), &s.adapter, &s.queue);
            if let Some(dl) = &s.dead_letter {
                name(
                    format!("sources[{i}].dead_letter.queue"),
                    &dl.adapter,
                    &dl.queue,
                );
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if let Some(queue) = r.literal_queue() {
                name(format!("routes[{i}].queue"), &r.sink, queue);
            }
        }
        named
    }

    /// Queues of this file that would share a retry or dead-letter
    /// destination (or a routing key) on one broker while their own
    /// destinations differ: each would take the other's retries or dead
    /// letters. One line per clash, naming both queues and the fix.
    pub fn shared_destinations(&self) -> Vec<String> {
        let named = Self::named_queues(&self.config, &self.routes);
        let mut queues: Vec<(String, String)> = named
            .iter()
            .map(|q| (q.adapter.clone(), q.queue.clone()))
            .collect();
        if let Some(api) = &self.config.api {
            // Queue names of [api] queues without wildcards.
            for q in &api.queues {
                if !q.contains('*') {
                    queues.push((api.adapter.clone(), q.clone()));
                }
            }
        }
        queues.sort();
        queues.dedup();
        // (broker, what, name) → (adapter, queue, own destination)
        let mut seen: BTreeMap<(String, &'static str, String), (String, String, String)> =
            BTreeMap::new();
        let mut clashes = Vec::new();
        for (adapter, queue) in queues {
            let Some(config) = self.adapters.get(&adapter) else {
                continue;
            };
            let Some(crate::endpoint::Destinations {
                broker,
                own,
                beside,
            }) = config.destinations(&queue)
            else {
                continue;
            };
            for (what, name) in beside {
                let key = (broker.clone(), what, name.clone());
                match seen.get(&key) {
                    Some((a, q, other)) if *other != own => clashes.push(format!(
                        "adapters.{a} queue {q:?} and adapters.{adapter} queue {queue:?} share the {what} {name:?} on {broker}: each would take the other's messages there; give each adapter a template of its own (topic_template, queue_template) or name the {what}s apart"
                    )),
                    Some(_) => {}
                    None => {
                        seen.insert(key, (adapter.clone(), queue.clone(), own.clone()));
                    }
                }
            }
        }
        clashes
    }

    /// Builds `config`, or refuses it with every rule it breaks, in file
    /// order (descriptor sets are read here: a route compiles from them).
    pub fn build(config: BridgeConfig) -> Result<Blueprint, ConfigError> {
        let mut errors: Vec<ConfigError> = Vec::new();
        if config.http.listen != "off"
            && config.http.listen.parse::<std::net::SocketAddr>().is_err()
        {
            errors.push(invalid(
                "http.listen",
                format!(
                    "{:?} is not an address like 127.0.0.1:9464 (or `off`)",
                    config.http.listen
                ),
            ));
        }
        if config.http.tls_cert_file.is_some() != config.http.tls_key_file.is_some() {
            errors.push(invalid(
                if config.http.tls_cert_file.is_some() {
                    "http.tls_key_file"
                } else {
                    "http.tls_cert_file"
                },
                "tls_cert_file and tls_key_file go together",
            ));
        }
        if config.http.tls_client_ca_file.is_some() && config.http.tls_cert_file.is_none() {
            errors.push(invalid(
                "http.tls_client_ca_file",
                "mutual TLS needs the listener's own tls_cert_file and tls_key_file",
            ));
        }
        if config.http.max_connections == 0 {
            errors.push(invalid("http.max_connections", "must be at least 1"));
        }
        if config.http.listen_backlog == 0 || config.http.listen_backlog > i32::MAX as u32 {
            errors.push(invalid(
                "http.listen_backlog",
                "must be at least 1 (the kernel caps it at net.core.somaxconn)",
            ));
        }
        if config.worker_threads == Some(0) {
            errors.push(invalid("worker_threads", "must be at least 1"));
        }
        for (field, d) in [
            ("http.header_read_timeout", config.http.header_read_timeout),
            ("http.idle_timeout", config.http.idle_timeout),
            ("http.health_interval", config.http.health_interval),
            ("http.health_timeout", config.http.health_timeout),
        ] {
            if d.is_zero() {
                errors.push(invalid(field, "must be longer than 0"));
            }
        }
        if config.adapters.is_empty() {
            errors.push(invalid(
                "adapters",
                "no adapter is defined; add e.g. local = \"local:./ojs-bridge-data\"",
            ));
        }
        let mut adapters = BTreeMap::new();
        for (name, entry) in &config.adapters {
            match entry.compile(name) {
                Ok(compiled) => {
                    adapters.insert(name.clone(), compiled);
                }
                Err(e) => errors.push(e),
            }
        }
        let adapter =
            |field: String, name: &str| {
                if config.adapters.contains_key(name) {
                    Ok(())
                } else {
                    Err(invalid(
                        field,
                        format!(
                        "names adapter {name:?}, which [adapters] does not define{} (defined: {})",
                        ojs_queue::settings::suggestion(
                            name,
                            config.adapters.keys().map(String::as_str)
                        ),
                        config.adapters.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                    ))
                }
            };
        let mut health_probes = BTreeMap::new();
        for (name, f) in &config.federations {
            let at = |field: &str| format!("federations.{name}.{field}");
            if config.adapters.contains_key(name) {
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
                    let field = format!("federations.{name}.regions.{id}.health");
                    if !url.starts_with("http://") {
                        errors.push(invalid(
                            field,
                            format!("{url:?} must be http://host:port/ojs/v1/health"),
                        ));
                    } else {
                        match HttpHealthProbe::new(url, f.health_timeout) {
                            Ok(probe) => {
                                health_probes.insert((name.clone(), id.clone()), probe);
                            }
                            Err(reason) => errors.push(invalid(field, reason)),
                        }
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
            if f.strategy == ojs_queue::federation::Strategy::GeoPin {
                errors.push(invalid(
                    at("strategy"),
                    "geo-pin is chosen per job (meta ojs.federation.region); the default must be affinity or overflow",
                ));
            }
        }
        if let Some(api) = &config.api {
            errors.extend(api.problems(&config.adapters));
        }
        // A file may serve the OJS API alone: adapters and [api], nothing
        // to consume.
        if config.sources.is_empty() && config.api.is_none() {
            errors.push(invalid(
                "sources",
                "no source is defined; the daemon would consume nothing",
            ));
        }
        let mut source_names = BTreeSet::new();
        for (i, s) in config.sources.iter().enumerate() {
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
        if config.routes.is_empty() && (config.api.is_none() || !config.sources.is_empty()) {
            errors.push(invalid(
                "routes",
                "no route is defined; every message would be dead-lettered",
            ));
        }
        let mut routes = Vec::with_capacity(config.routes.len());
        let mut route_names = BTreeSet::new();
        for (i, r) in config.routes.iter().enumerate() {
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
            if !config.federations.contains_key(&r.sink) {
                if let Err(e) = adapter(at("sink"), &r.sink) {
                    errors.push(e);
                }
            }
            let federated = config.federations.contains_key(&r.sink);
            match Route::build(r, i, federated) {
                Ok(route) => routes.push(route),
                Err(problems) => errors.extend(problems),
            }
        }
        ConfigError::all(errors)?;
        Ok(Blueprint {
            config,
            adapters,
            routes,
            health_probes,
        })
    }

    /// Reads the files this blueprint names, or refuses it with every file
    /// that cannot be read (first) or whose content is not usable (once
    /// each is readable): the token files, the listener's certificate, key
    /// and client CA, the files adapters read when they connect.
    pub fn read_files(self) -> Result<Ready, ConfigError> {
        self.check_files()?;
        let mut errors = Vec::new();
        let config = &self.config;
        let tls = crate::tls::acceptor(&config.http).unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        let api =
            config
                .api
                .as_ref()
                .and_then(|a| match a.settings(&config.adapters, &config.http) {
                    Ok(settings) => Some(settings),
                    Err(e) => {
                        errors.push(e);
                        None
                    }
                });
        if let Some(dir) = &config.http.admin_ui_dir {
            if !dir.join("index.html").is_file() {
                errors.push(crate::config::invalid(
                    "http.admin_ui_dir",
                    format!(
                        "{} holds no index.html (it is the directory of a built admin UI)",
                        dir.display()
                    ),
                ));
            }
        }
        let http_token = config.http.token_file.as_ref().and_then(|path| {
            crate::config::read_token_file("http.token_file", path)
                .map_err(|e| errors.push(e))
                .ok()
        });
        ConfigError::all(errors)?;
        Ok(Ready {
            blueprint: self,
            tls,
            http_token,
            api,
        })
    }

    /// Whether every file the adapters read when they connect
    /// (certificates, keys, password files) can be read now: what `run`
    /// would refuse at connect, found by `check-config` without connecting.
    /// Every unreadable file is named with its setting.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let mut unreadable = Vec::new();
        let mut listener_files = vec![
            (
                "http.token_file".to_owned(),
                self.config.http.token_file.clone(),
            ),
            (
                "http.tls_cert_file".to_owned(),
                self.config.http.tls_cert_file.clone(),
            ),
            (
                "http.tls_key_file".to_owned(),
                self.config.http.tls_key_file.clone(),
            ),
            (
                "http.tls_client_ca_file".to_owned(),
                self.config.http.tls_client_ca_file.clone(),
            ),
        ];
        for (i, token) in self
            .config
            .api
            .iter()
            .flat_map(|a| a.tokens.iter())
            .enumerate()
        {
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
        for (name, adapter) in &self.adapters {
            for (setting, path) in adapter.files_read() {
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
}
