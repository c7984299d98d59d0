//! `ojs-bridge run`: sources → routes → sinks, at least once.
//!
//! Each source runs one loop that receives batches while earlier batches are
//! still being published (bounded by `max_in_flight`). A batch is decoded,
//! routed and mapped message by message, published per (route, queue) group,
//! and each source message is acked only after its sink confirmed. A sink
//! that fails is retried with backoff while the source waits: an outage slows
//! the daemon down, it never dead-letters good messages. Poison messages
//! (undecodable, unknown content type, unmappable, no route, too large) are
//! dead-lettered with their reason and the daemon goes on.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ojs_core::Encoding;
use ojs_queue::{Error, QueueAdapter};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::alarm::Alarm;
use crate::blueprint::connecting::Connecting;
use crate::blueprint::{Blueprint, NamedQueue, Ready};
use crate::config::{BridgeConfig, ConfigError, InputFormat};
use crate::http::{self, HealthBoard, HttpState, Limits};
use crate::metrics::Metrics;
use crate::pipeline::{run_source, RoutePlan, SourceCtx};
use ojs_queue::federation::{AdapterProbe, Federation, HealthProbe, RegionSpec};

/// Why the daemon cannot start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration is not usable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An adapter could not be opened.
    #[error("adapter `{name}` ({url}): {source}")]
    Connect {
        /// Adapter name.
        name: String,
        /// Its URL, credentials removed.
        url: String,
        /// Why.
        source: Error,
    },
    /// A queue the daemon reads or writes is not usable (with
    /// `topology = "existing"`: it does not exist).
    #[error("{field} (adapter `{adapter}`, queue {queue:?}): {source}")]
    Prepare {
        /// The config field that names the queue.
        field: String,
        /// Adapter name.
        adapter: String,
        /// The OJS queue.
        queue: String,
        /// Why.
        source: Error,
    },
    /// The OJS API's job store could not be opened.
    #[error("api.state: {0}")]
    Api(#[source] ojs_api::ApiError),
    /// The HTTP endpoint could not listen.
    #[error("http.listen {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// A part of the configuration the build accepted could not be put
    /// together (a bug: the build checks what connect relies on).
    #[error("{field}: the configuration was built without it ({reason})")]
    Unbuilt {
        /// The config field.
        field: String,
        /// What was missing or refused.
        reason: String,
    },
}

/// A URL without its credentials, for messages and logs (one rule for the
/// whole program: [`ojs_core::redact::url`]).
pub fn redact(url: &str) -> String {
    ojs_core::redact::url(url)
}

/// Adapter `name`, connected. The build checked that every adapter a field
/// names exists, so a miss here is a bug: reported, never panicked on.
fn connected(
    adapters: &BTreeMap<String, Arc<dyn QueueAdapter>>,
    field: String,
    name: &str,
) -> Result<Arc<dyn QueueAdapter>, Box<DaemonError>> {
    adapters.get(name).cloned().ok_or_else(|| {
        Box::new(DaemonError::Unbuilt {
            field,
            reason: format!("adapter {name:?} is not connected"),
        })
    })
}

/// How long the first attempt to connect an adapter and prepare its queues
/// may take before the broker counts as unreachable (librdkafka, say, waits
/// a minute for metadata by itself).
const START_ATTEMPT: Duration = Duration::from_secs(10);

/// A started daemon: adapters connected, routes compiled, endpoint bound.
#[derive(Debug)]
pub struct Daemon {
    config: BridgeConfig,
    adapters: BTreeMap<String, Arc<dyn QueueAdapter>>,
    /// Routes in configuration order (first match wins), each with its
    /// sink and counters.
    routes: Arc<Vec<RoutePlan>>,
    /// Federated sinks, by name.
    federations: Vec<(String, Arc<Federation>)>,
    metrics: Arc<Metrics>,
    listener: Option<TcpListener>,
    /// The bearer token of the HTTP endpoint (`http.token_file`).
    http_token: Option<ojs_core::redact::Secret>,
    /// TLS of the endpoint (`http.tls_cert_file`).
    tls: Option<crate::tls::ListenerTls>,
    /// The OJS HTTP binding (`[api]`).
    api: Option<Arc<ojs_api::Api>>,
    /// The OJS gRPC binding over `api`, served on the same listener.
    grpc: Option<ojs_api::grpc::GrpcServices>,
}

/// What a run did, per source: received and acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSummary {
    /// Per source, in configuration order.
    pub sources: Vec<SourceSummary>,
}

impl RunSummary {
    /// (source, received, acked) per source, in configuration order.
    pub fn counts(&self) -> Vec<(String, u64, u64)> {
        self.sources
            .iter()
            .map(|s| (s.name.clone(), s.received, s.acked))
            .collect()
    }
}

/// What one source did in a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSummary {
    /// The source's name.
    pub name: String,
    /// Messages received (a redelivered message counts again).
    pub received: u64,
    /// Messages settled at the source: acked after their sink confirmed, or
    /// after their dead-letter copy was confirmed.
    pub acked: u64,
    /// Of `acked`, those settled by dead-lettering.
    pub dead_lettered: u64,
}

impl SourceSummary {
    /// Messages acked after their sink confirmed them.
    pub fn delivered(&self) -> u64 {
        self.acked.saturating_sub(self.dead_lettered)
    }
}

/// The listener while the daemon starts (`http::serve_starting`); the
/// task ends (closing the listener) if the start fails.
struct Starting {
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<TcpListener>>,
}

impl Starting {
    fn serve(listener: TcpListener, tls: Option<crate::tls::ListenerTls>) -> Self {
        let (ready, wait) = tokio::sync::oneshot::channel();
        Starting {
            ready: Some(ready),
            task: Some(tokio::spawn(crate::http::serve_starting(
                listener, tls, wait,
            ))),
        }
    }

    /// Stops answering `starting`; the listener, for the daemon.
    async fn finish(mut self) -> Result<TcpListener, DaemonError> {
        if let Some(ready) = self.ready.take() {
            let _ = ready.send(());
        }
        let task = self.task.take();
        match task {
            Some(task) => task.await.map_err(|e| DaemonError::Listen {
                addr: "the starting listener".into(),
                source: std::io::Error::other(e.to_string()),
            }),
            None => Err(DaemonError::Listen {
                addr: "the starting listener".into(),
                source: std::io::Error::other("already handed over"),
            }),
        }
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Daemon {
    /// Compiles routes, connects every adapter, binds the endpoint.
    pub async fn start(config: BridgeConfig) -> Result<Daemon, DaemonError> {
        Self::start_with(config, BTreeMap::new()).await
    }

    /// Like [`Daemon::start`], with some adapters built by the caller (a
    /// memory adapter with its own limits, a federated sink…): an adapter
    /// named in `provided` is used instead of connecting its URL.
    pub async fn start_with(
        config: BridgeConfig,
        provided: BTreeMap<String, Arc<dyn QueueAdapter>>,
    ) -> Result<Daemon, DaemonError> {
        Self::connect(Blueprint::build(config)?.read_files()?, provided).await
    }

    /// Connects a blueprint whose files were read: every adapter (or
    /// the one `provided` under its name), the queues the configuration
    /// names, the OJS API's store, the listener. No configuration work is
    /// left here: what can fail is the brokers, the store and the port.
    pub async fn connect(
        ready: Ready,
        mut provided: BTreeMap<String, Arc<dyn QueueAdapter>>,
    ) -> Result<Daemon, DaemonError> {
        for clash in ready.blueprint.shared_destinations() {
            tracing::warn!("{clash}");
        }
        let Ready {
            blueprint:
                Blueprint {
                    config,
                    adapters: mut compiled_adapters,
                    routes,
                    mut health_probes,
                },
            tls,
            http_token,
            api: api_settings,
        } = ready;
        // The listener first: probes get 503 `starting` while the brokers
        // and the store are connected, and a port already taken stops the
        // start before anything else.
        let starting = if config.http.listen == "off" {
            None
        } else {
            let listener = crate::http::bind(&config.http.listen, config.http.listen_backlog)
                .await
                .map_err(|source| DaemonError::Listen {
                    addr: config.http.listen.clone(),
                    source,
                })?;
            if let Ok(addr) = listener.local_addr() {
                tracing::info!(%addr, "listening; 503 (starting) until the brokers and the job store are connected");
            }
            Some(Starting::serve(listener, tls.clone()))
        };
        // Every queue the config names literally must be usable before the
        // first message: declared where the adapter may declare, checked
        // where the topology is `existing` (a missing one stops the start,
        // named, with nothing created).
        let named = Blueprint::named_queues(&config, &routes);
        let mut adapters = BTreeMap::new();
        for (name, entry) in &config.adapters {
            let queues: Vec<&NamedQueue> = named.iter().filter(|q| q.adapter == *name).collect();
            if let Some(adapter) = provided.remove(name) {
                for NamedQueue { field, queue, .. } in &queues {
                    adapter
                        .prepare(queue)
                        .await
                        .map_err(|source| DaemonError::Prepare {
                            field: field.clone(),
                            adapter: name.clone(),
                            queue: queue.clone(),
                            source,
                        })?;
                }
                adapters.insert(name.clone(), adapter);
                continue;
            }
            let compiled = compiled_adapters
                .remove(name)
                .ok_or_else(|| DaemonError::Unbuilt {
                    field: format!("adapters.{name}"),
                    reason: "its settings were not compiled".into(),
                })?;
            // An unreachable broker is waited for (in the background, health
            // naming it); a bad setting or a missing queue on a reachable
            // broker stops the start.
            let attempt = tokio::time::timeout(START_ATTEMPT, async {
                let adapter = compiled.connect().await.map_err(|e| (None, e))?;
                for NamedQueue { field, queue, .. } in &queues {
                    if let Err(e) = adapter.prepare(queue).await {
                        let _ = adapter.close().await;
                        return Err((Some((field.clone(), queue.clone())), e));
                    }
                }
                Ok(adapter)
            })
            .await
            .unwrap_or(Err((None, Error::Timeout(START_ATTEMPT))));
            let unreachable = match attempt {
                Ok(adapter) => {
                    adapters.insert(name.clone(), adapter);
                    continue;
                }
                Err((_, source)) if config.wait_for_brokers && source.is_unreachable() => source,
                Err((None, source)) => {
                    return Err(DaemonError::Connect {
                        name: name.clone(),
                        url: redact(&entry.url),
                        source,
                    })
                }
                Err((Some((field, queue)), source)) => {
                    return Err(DaemonError::Prepare {
                        field,
                        adapter: name.clone(),
                        queue,
                        source,
                    })
                }
            };
            let queues = queues.iter().map(|q| q.queue.clone()).collect();
            let waiting: Arc<dyn QueueAdapter> =
                Connecting::start(name, compiled, queues, &unreachable);
            adapters.insert(name.clone(), waiting);
        }
        let mut federations = Vec::new();
        for (name, f) in &config.federations {
            let mut regions = Vec::new();
            for (id, region) in &f.regions {
                let field = |f: &str| format!("federations.{name}.regions.{id}.{f}");
                let adapter =
                    connected(&adapters, field("adapter"), &region.adapter).map_err(|e| *e)?;
                let probe: Arc<dyn HealthProbe> =
                    match health_probes.remove(&(name.clone(), id.clone())) {
                        Some(probe) => Arc::new(probe),
                        None => Arc::new(AdapterProbe(adapter.clone())),
                    };
                regions.push(RegionSpec {
                    name: id.clone(),
                    adapter,
                    probe,
                });
            }
            let federation =
                Federation::new(f.settings(), regions).map_err(|e| DaemonError::Unbuilt {
                    field: format!("federations.{name}"),
                    reason: e.to_string(),
                })?;
            federations.push((name.clone(), Arc::new(federation)));
        }
        for (i, route) in routes.iter().enumerate() {
            if !route.is_bounded() {
                tracing::warn!(
                    route = %route.name,
                    max_destinations = config.routes[i].max_destinations,
                    "jobs on this route keep their own queue, which the config does not bound; bound it with allowed_queues"
                );
            }
        }
        let mut sinks = Vec::with_capacity(routes.len());
        for (i, route) in routes.iter().enumerate() {
            let federated = federations
                .iter()
                .find(|(n, _)| *n == route.sink)
                .map(|(_, f)| f.clone() as Arc<dyn QueueAdapter>);
            let sink = match federated {
                Some(federation) => federation,
                None => connected(&adapters, format!("routes[{i}].sink"), &route.sink)
                    .map_err(|e| *e)?,
            };
            sinks.push(sink);
        }
        let api = match &config.api {
            // Nothing to serve it on (`OJS_BRIDGE_HTTP_LISTEN=off` with the
            // built-in default): the daemon runs without it, as before.
            Some(_) if config.http.listen == "off" => {
                tracing::info!("http.listen is off: the OJS HTTP API of [api] is not served");
                None
            }
            Some(api) => {
                let adapter =
                    connected(&adapters, "api.adapter".into(), &api.adapter).map_err(|e| *e)?;
                let settings = api_settings.ok_or_else(|| DaemonError::Unbuilt {
                    field: "api".into(),
                    reason: "its settings were not read".into(),
                })?;
                Some(
                    ojs_api::Api::open(settings, adapter, api.adapter.clone())
                        .await
                        .map_err(DaemonError::Api)?,
                )
            }
            None => None,
        };
        let grpc = match &api {
            Some(api) => {
                Some(ojs_api::grpc::GrpcServices::new(api.clone()).map_err(DaemonError::Api)?)
            }
            None => None,
        };
        let listener = match starting {
            Some(starting) => Some(starting.finish().await?),
            None => None,
        };
        let metrics = Arc::new(Metrics::new(
            &config
                .sources
                .iter()
                .map(|s| s.name.clone())
                .collect::<Vec<_>>(),
            &config
                .routes
                .iter()
                .map(|r| r.name.clone())
                .collect::<Vec<_>>(),
        ));
        for (name, f) in &federations {
            let (name, f) = (name.clone(), f.clone());
            if let Ok(mut extra) = metrics.extra.lock() {
                extra.push(Box::new(move |out: &mut String| {
                    crate::metrics::render_federation(&name, &f, out)
                }));
            }
        }
        if let Some(api) = &api {
            let api = api.clone();
            if let Ok(mut extra) = metrics.extra.lock() {
                extra.push(Box::new(move |out: &mut String| {
                    crate::metrics::render_api(&api, out)
                }));
            }
        }
        let plans = routes
            .into_iter()
            .zip(sinks)
            .zip(&metrics.routes)
            .map(|((route, sink), (_, counters))| RoutePlan {
                route,
                sink,
                metrics: counters.clone(),
            })
            .collect();
        Ok(Daemon {
            federations,
            config,
            adapters,
            routes: Arc::new(plans),
            metrics,
            listener,
            http_token,
            tls,
            api,
            grpc,
        })
    }

    /// `https` when the endpoint speaks TLS, else `http`.
    pub fn http_scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// Where the endpoint listens (useful with port 0).
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The daemon's counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Runs until `shutdown` completes; then stops consuming, gives
    /// in-flight messages `shutdown_timeout` to be published and acked, and
    /// returns. Messages still unsettled after that are delivered again.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> RunSummary {
        let (stop_tx, stop_rx) = watch::channel(false);
        // The HTTP listener and the OJS API stop after the rest: while the
        // API drains, workers still ACK the jobs this process holds.
        let (serve_stop_tx, serve_stop_rx) = watch::channel(false);
        let mut http_task = None;
        let mut monitors = Vec::new();
        let source_alarms: Vec<Arc<Alarm>> = self
            .config
            .sources
            .iter()
            .map(|s| Arc::new(Alarm::new("source", &s.name, &s.adapter)))
            .collect();
        if let Some(listener) = self.listener {
            let adapters = self
                .adapters
                .iter()
                .map(|(n, a)| (n.clone(), a.clone()))
                .chain(
                    self.federations
                        .iter()
                        .map(|(n, f)| (n.clone(), f.clone() as Arc<dyn QueueAdapter>)),
                )
                .collect();
            let http_config = &self.config.http;
            let board = Arc::new(HealthBoard::new(adapters, http_config.health_timeout));
            // The first probe before the first request, then every interval.
            board.probe().await;
            monitors.push(tokio::spawn(
                board
                    .clone()
                    .run(http_config.health_interval, serve_stop_rx.clone()),
            ));
            let state = Arc::new(HttpState {
                health: board,
                alarms: self
                    .routes
                    .iter()
                    .map(|p| p.route.sink_alarm.clone())
                    .chain(source_alarms.iter().cloned())
                    .collect(),
                metrics: self.metrics.clone(),
                token: self.http_token.clone(),
                limits: Limits {
                    header_read_timeout: http_config.header_read_timeout,
                    idle_timeout: http_config.idle_timeout,
                    max_connections: http_config.max_connections,
                },
                grpc: self.grpc.clone(),
                api: self.api.clone(),
                admin_ui: http_config.admin_ui_dir.as_ref().and_then(|dir| {
                    std::fs::canonicalize(dir)
                        .map_err(|e| tracing::warn!(dir = %dir.display(), error = %e, "the admin UI's directory cannot be read; not served"))
                        .ok()
                }),
            });
            if let Ok(addr) = listener.local_addr() {
                tracing::info!(%addr, token = state.token.is_some(), tls = self.tls.as_ref().map_or("off", |t| if t.mutual { "mutual" } else { "on" }), "health on /ojs/v1/health, metrics on /metrics");
                if let (Some(api), Some(config)) = (&self.api, &self.config.api) {
                    tracing::info!(%addr, adapter = %config.adapter, store = %api.store().place(), "OJS HTTP API on /ojs/v1 and /ojs/manifest, OJS gRPC (ojs.v1.OJSService, reflection, grpc.health.v1) on the same port");
                }
            }
            http_task = Some(tokio::spawn(http::serve(
                listener,
                self.tls.clone(),
                state,
                serve_stop_rx.clone(),
            )));
        }
        if let Some(api) = &self.api {
            monitors.push(tokio::spawn(api.clone().run(serve_stop_rx.clone())));
        }
        for (name, federation) in &self.federations {
            let mut stop = stop_rx.clone();
            tracing::info!(federation = %name, "federation monitor started");
            monitors.push(tokio::spawn(federation.clone().run_monitor(async move {
                let _ = stop.wait_for(|s| *s).await;
            })));
        }
        let mut sources = JoinSet::new();
        for (index, source) in self.config.sources.iter().enumerate() {
            let Some(adapter) = self.adapters.get(&source.adapter).cloned() else {
                continue;
            };
            let dead_letter = source.dead_letter.as_ref().and_then(|dl| {
                self.adapters
                    .get(&dl.adapter)
                    .map(|a| (a.clone(), dl.queue.clone()))
            });
            let ctx = Arc::new(SourceCtx {
                index,
                config: source.clone(),
                adapter,
                default_encoding: match source.format {
                    InputFormat::Grpcq => Encoding::GrpcqProto,
                    InputFormat::Ojs => Encoding::OjsProto,
                },
                routes: self.routes.clone(),
                dead_letter,
                metrics: self.metrics.clone(),
                alarm: source_alarms[index].clone(),
            });
            tracing::info!(source = %source.name, queue = %source.queue, adapter = %source.adapter, "consuming");
            sources.spawn(run_source(
                ctx,
                stop_rx.clone(),
                self.config.shutdown_timeout,
            ));
        }
        shutdown.await;
        tracing::info!(
            timeout_ms = self.config.shutdown_timeout.as_millis() as u64,
            "shutting down: no new messages; finishing in-flight ones"
        );
        let _ = stop_tx.send(true);
        let drain_api = async {
            if let Some(api) = &self.api {
                api.drain().await;
            }
        };
        let drain_sources = async { while sources.join_next().await.is_some() {} };
        tokio::join!(drain_api, drain_sources);
        let _ = serve_stop_tx.send(true);
        if let Some(task) = http_task {
            let _ = task.await;
        }
        for monitor in monitors {
            let _ = monitor.await;
        }
        for (name, adapter) in &self.adapters {
            if let Err(e) = adapter.close().await {
                tracing::warn!(adapter = %name, error = %e, "closing the adapter failed");
            }
        }
        // Last, once nothing writes jobs any more: the process exits with
        // the store's connections open, so SQLite's own checkpoint on the
        // last close never runs. Bounded like the rest of the stop (a
        // stalled disk must not keep the process).
        if let Some(api) = &self.api {
            let limit = self.config.shutdown_timeout;
            match tokio::time::timeout(limit, api.store().close()).await {
                Ok(Ok(true)) => tracing::debug!("the job store's log is copied into its file"),
                Ok(Ok(false)) => tracing::info!("the job store's log is kept (a read was still running); the next start recovers from it"),
                Ok(Err(e)) => tracing::warn!(error = %e, "the job store's log could not be copied into its file; the next start recovers from it"),
                Err(_) => tracing::warn!(timeout_ms = limit.as_millis() as u64, "the job store's log was not copied into its file in time; the next start recovers from it"),
            }
        }
        RunSummary {
            sources: self
                .metrics
                .sources
                .iter()
                .map(|(name, m)| SourceSummary {
                    name: name.clone(),
                    received: m.received.load(Ordering::Relaxed),
                    acked: m.acked.load(Ordering::Relaxed),
                    dead_lettered: m.dead_lettered.load(Ordering::Relaxed),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("kafka://127.0.0.1:9092"), "kafka://127.0.0.1:9092");
        assert_eq!(redact("local:./data"), "local:./data");
    }
}
