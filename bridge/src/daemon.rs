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

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use ojs_core::backoff::reconnect_delay;
use ojs_core::mapping::JobTypes;
use ojs_core::{
    header, ConsumerOptions, DeadLetterReason, Delivery, Encoding, Error, Nack, OutgoingMessage,
    QueueAdapter,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::alarm::Alarm;
use crate::config::{BridgeConfig, ConfigError, InputFormat, SourceConfig};
use crate::connecting::Connecting;
use crate::http::{self, HealthBoard, HttpState, Limits};
use crate::metrics::{Metrics, RouteMetrics};
use crate::probe::HttpHealthProbe;
use crate::routes::{Incoming, Route};
use ojs_core::federation::{AdapterProbe, Federation, HealthProbe, RegionSpec};

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
    /// The HTTP endpoint could not listen.
    #[error("http.listen {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A URL without its credentials, for messages and logs (one rule for the
/// whole program: [`ojs_core::redact::url`]).
pub fn redact(url: &str) -> String {
    ojs_core::redact::url(url)
}

/// How long the first attempt to connect an adapter and prepare its queues
/// may take before the broker counts as unreachable (librdkafka, say, waits
/// a minute for metadata by itself).
const START_ATTEMPT: Duration = Duration::from_secs(10);

/// Longest wait between two attempts at a failing sink or consumer.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Longest wait of one receive: bounds how long an idle source takes to
/// notice nothing (shutdown is noticed at once regardless).
const RECEIVE_WAIT: Duration = Duration::from_secs(1);

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
}

/// A route compiled with what it needs at run time: its matcher and
/// mapper, the sink it publishes to (an adapter or a federation) and its
/// counters. One owner of each, built once at start.
#[derive(Debug)]
struct RoutePlan {
    route: Route,
    sink: Arc<dyn QueueAdapter>,
    metrics: Arc<RouteMetrics>,
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
        mut provided: BTreeMap<String, Arc<dyn QueueAdapter>>,
    ) -> Result<Daemon, DaemonError> {
        config.validate()?;
        let mut routes = config
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| Route::compile(r, i))
            .collect::<Result<Vec<_>, _>>()?;
        // Every queue the config names literally must be usable before the
        // first message: declared where the adapter may declare, checked
        // where the topology is `existing` (a missing one stops the start,
        // named, with nothing created).
        let mut named: Vec<(String, &str, String)> = Vec::new();
        for (i, s) in config.sources.iter().enumerate() {
            named.push((format!("sources[{i}].queue"), &s.adapter, s.queue.clone()));
            if let Some(dl) = &s.dead_letter {
                named.push((
                    format!("sources[{i}].dead_letter.queue"),
                    &dl.adapter,
                    dl.queue.clone(),
                ));
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if let Some(queue) = r.literal_queue() {
                named.push((format!("routes[{i}].queue"), &r.sink, queue.to_owned()));
            }
        }
        let mut adapters = BTreeMap::new();
        for (name, entry) in &config.adapters {
            let queues: Vec<&(String, &str, String)> =
                named.iter().filter(|(_, a, _)| a == name).collect();
            if let Some(adapter) = provided.remove(name) {
                for (field, _, queue) in &queues {
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
            let compiled = entry.compile(name)?;
            // An unreachable broker is waited for (in the background, health
            // naming it); a bad setting or a missing queue on a reachable
            // broker stops the start.
            let attempt = tokio::time::timeout(START_ATTEMPT, async {
                let adapter = compiled.connect().await.map_err(|e| (None, e))?;
                for (field, _, queue) in &queues {
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
            let queues = queues.iter().map(|(_, _, q)| q.clone()).collect();
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
                    adapters
                        .get(&region.adapter)
                        .cloned()
                        .ok_or_else(|| ConfigError::Invalid {
                            field: field("adapter"),
                            reason: format!(
                                "names adapter {:?}, which [adapters] does not define",
                                region.adapter
                            ),
                        })?;
                let probe: Arc<dyn HealthProbe> = match &region.health {
                    Some(url) => Arc::new(HttpHealthProbe::new(url, f.health_timeout).map_err(
                        |reason| ConfigError::Invalid {
                            field: field("health"),
                            reason,
                        },
                    )?),
                    None => Arc::new(AdapterProbe(adapter.clone())),
                };
                regions.push(RegionSpec {
                    name: id.clone(),
                    adapter,
                    probe,
                });
            }
            let federation =
                Federation::new(f.settings(), regions).map_err(|e| ConfigError::Invalid {
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
        for (i, route) in routes.iter_mut().enumerate() {
            let federated = federations
                .iter()
                .find(|(n, _)| *n == route.sink)
                .map(|(_, f)| f.clone() as Arc<dyn QueueAdapter>);
            if federated.is_some() {
                route.keep_envelopes();
            }
            let sink = federated
                .or_else(|| adapters.get(&route.sink).cloned())
                .ok_or_else(|| ConfigError::Invalid {
                    field: format!("routes[{i}].sink"),
                    reason: format!(
                        "names adapter {:?}, which [adapters] does not define",
                        route.sink
                    ),
                })?;
            sinks.push(sink);
        }
        let http_token = match &config.http.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
                    field: "http.token_file".into(),
                    reason: format!("cannot read {}: {e}", path.display()),
                })?;
                let token = text.trim().to_owned();
                if token.is_empty() {
                    return Err(ConfigError::Invalid {
                        field: "http.token_file".into(),
                        reason: format!("{} is empty", path.display()),
                    }
                    .into());
                }
                Some(ojs_core::redact::Secret::new(token))
            }
            None => None,
        };
        let listener = if config.http.listen == "off" {
            None
        } else {
            Some(
                TcpListener::bind(&config.http.listen)
                    .await
                    .map_err(|source| DaemonError::Listen {
                        addr: config.http.listen.clone(),
                        source,
                    })?,
            )
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
                    f.render_metrics(&name, out)
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
        })
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
                    .run(http_config.health_interval, stop_rx.clone()),
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
            });
            if let Ok(addr) = listener.local_addr() {
                tracing::info!(%addr, token = state.token.is_some(), "health on /ojs/v1/health, metrics on /metrics");
            }
            http_task = Some(tokio::spawn(http::serve(listener, state, stop_rx.clone())));
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
        while sources.join_next().await.is_some() {}
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

/// Everything one source's tasks share.
struct SourceCtx {
    index: usize,
    config: SourceConfig,
    adapter: Arc<dyn QueueAdapter>,
    default_encoding: Encoding,
    routes: Arc<Vec<RoutePlan>>,
    dead_letter: Option<(Arc<dyn QueueAdapter>, String)>,
    metrics: Arc<Metrics>,
    /// Logs when consuming starts failing and when it recovers; health
    /// reads it.
    alarm: Arc<Alarm>,
}

impl SourceCtx {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn counters(&self) -> &crate::metrics::SourceMetrics {
        &self.metrics.sources[self.index].1
    }
}

async fn run_source(ctx: Arc<SourceCtx>, mut stop: watch::Receiver<bool>, drain: Duration) {
    let options = ConsumerOptions {
        group: ctx.config.group.clone(),
        visibility_timeout: ctx.config.visibility_timeout,
        prefetch: u16::try_from(ctx.config.max_in_flight).unwrap_or(u16::MAX),
        ..ConsumerOptions::default()
    };
    let permits = Arc::new(Semaphore::new(ctx.config.max_in_flight));
    // Payload bytes, as permits.
    let bytes = Arc::new(Semaphore::new(
        ctx.config.max_in_flight_bytes.min(Semaphore::MAX_PERMITS),
    ));
    let mut tasks: JoinSet<()> = JoinSet::new();
    // With per-key ordering, each lane publishes one batch at a time, in
    // the order it was handed them; a key always takes the same lane.
    let mut lanes: Vec<mpsc::UnboundedSender<(Vec<Delivery>, Arc<Held>)>> = Vec::new();
    for _ in 0..ctx.config.ordered_lanes().unwrap_or(0) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<Delivery>, Arc<Held>)>();
        let ctx = ctx.clone();
        tasks.spawn(async move {
            let lease = ctx.config.visibility_timeout;
            let every = (lease / 2).max(Duration::from_millis(50));
            let mut queued: VecDeque<(Vec<Delivery>, Arc<Held>)> = VecDeque::new();
            loop {
                if queued.is_empty() {
                    match rx.recv().await {
                        Some(next) => queued.push_back(next),
                        None => break,
                    }
                }
                let Some((batch, held)) = queued.pop_front() else {
                    continue;
                };
                let work = process_batch(&ctx, batch);
                tokio::pin!(work);
                loop {
                    tokio::select! {
                        () = &mut work => break,
                        // Batches waiting behind a slow one keep their
                        // source leases, or they would be handed out again.
                        () = tokio::time::sleep(every) => {
                            while let Ok(next) = rx.try_recv() {
                                queued.push_back(next);
                            }
                            let waiting = queued.iter().flat_map(|(b, _)| b.iter());
                            join_all(waiting.map(|d| d.extend(lease))).await;
                        }
                    }
                }
                drop(held);
            }
        });
        lanes.push(tx);
    }
    let mut keyless = 0usize;
    let mut consumer = None;
    let mut failures = 0u32;
    loop {
        while tasks.try_join_next().is_some() {}
        if *stop.borrow() {
            break;
        }
        let c = match consumer.as_mut() {
            Some(c) => c,
            None => match tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                c = ctx.adapter.consumer(&ctx.config.queue, options.clone()) => c,
            } {
                Ok(c) => {
                    failures = 0;
                    consumer.insert(c)
                }
                Err(e) => {
                    failures += 1;
                    ctx.metrics.error(ctx.name(), "consumer");
                    let delay = reconnect_delay(failures, MAX_BACKOFF);
                    tracing::debug!(source = %ctx.name(), error = %e, delay_ms = delay.as_millis() as u64, "cannot open the consumer; retrying");
                    ctx.alarm.failing(
                        &ctx.config.queue,
                        &format!("cannot open the consumer: {e}"),
                        delay,
                    );
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            },
        };
        let free = permits.available_permits();
        if free == 0 || bytes.available_permits() == 0 {
            // Backpressure: wait for a batch to finish before fetching more.
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                () = capacity(&permits, &bytes) => continue,
            }
        }
        let want = free.min(ctx.config.batch_size);
        let received = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            received = c.receive(want, RECEIVE_WAIT) => received,
        };
        match received {
            Ok(batch) if batch.is_empty() => ctx.alarm.ok(),
            Ok(batch) => {
                failures = 0;
                ctx.alarm.ok();
                let n = batch.len();
                let size: usize = batch.iter().map(|d| d.payload.len()).sum();
                tracing::trace!(source = %ctx.name(), messages = n, bytes = size, "received a batch");
                let counters = ctx.counters();
                counters.received.fetch_add(n as u64, Ordering::Relaxed);
                counters.in_flight.fetch_add(n as i64, Ordering::Relaxed);
                counters
                    .in_flight_bytes
                    .fetch_add(size as i64, Ordering::Relaxed);
                // Capacity was checked above: this does not wait.
                let Ok(permit) = permits.clone().acquire_many_owned(n as u32).await else {
                    break;
                };
                // The batch is in memory already, so it runs even when it
                // is larger than what is free: it takes what is free and
                // the next receive waits until the budget has room again.
                let take = size.min(bytes.available_permits());
                let byte_permit = bytes
                    .clone()
                    .try_acquire_many_owned(u32::try_from(take).unwrap_or(u32::MAX))
                    .ok();
                let held = Held {
                    ctx: ctx.clone(),
                    n,
                    size,
                    _permits: (permit, byte_permit),
                };
                if lanes.is_empty() {
                    let ctx = ctx.clone();
                    tasks.spawn(async move {
                        process_batch(&ctx, batch).await;
                        drop(held);
                    });
                } else {
                    let held = Arc::new(held);
                    let mut by_lane: Vec<Vec<Delivery>> =
                        (0..lanes.len()).map(|_| Vec::new()).collect();
                    for d in batch {
                        let lane = match &d.key {
                            Some(key) => lane_of(key, lanes.len()),
                            // No key, no order to keep: spread them.
                            None => {
                                keyless = keyless.wrapping_add(1);
                                keyless % lanes.len()
                            }
                        };
                        by_lane[lane].push(d);
                    }
                    for (lane, part) in lanes.iter().zip(by_lane) {
                        if !part.is_empty() {
                            // A lane ends only when `lanes` is dropped.
                            let _ = lane.send((part, held.clone()));
                        }
                    }
                }
            }
            Err(e) => {
                failures += 1;
                ctx.metrics.error(ctx.name(), "receive");
                let delay = reconnect_delay(failures, MAX_BACKOFF);
                tracing::debug!(source = %ctx.name(), error = %e, delay_ms = delay.as_millis() as u64, "receive failed; retrying");
                ctx.alarm
                    .failing(&ctx.config.queue, &format!("receive failed: {e}"), delay);
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    // Lanes finish what they were handed, then end.
    drop(lanes);
    let drained =
        tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(source = %ctx.name(), batches = tasks.len(), "shutdown timeout: abandoning in-flight messages; they will be delivered again");
        tasks.shutdown().await;
    }
    if let Some(c) = consumer {
        if let Err(e) = c.close().await {
            tracing::warn!(source = %ctx.name(), error = %e, "closing the consumer failed");
        }
    }
}

/// What a received batch holds until every part of it is settled: its
/// share of `max_in_flight` and of the byte budget, and the in-flight
/// gauges.
struct Held {
    ctx: Arc<SourceCtx>,
    n: usize,
    size: usize,
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
}

impl Drop for Held {
    fn drop(&mut self) {
        let counters = self.ctx.counters();
        counters
            .in_flight
            .fetch_sub(self.n as i64, Ordering::Relaxed);
        counters
            .in_flight_bytes
            .fetch_sub(self.size as i64, Ordering::Relaxed);
    }
}

/// Resolves once a message and a byte of budget are free.
async fn capacity(permits: &Semaphore, bytes: &Semaphore) {
    let _ = permits.acquire().await;
    let _ = bytes.acquire().await;
}

/// The lane of a key: the same key, the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}

/// Messages of one batch bound for one (route, queue).
struct Group<'a> {
    route: usize,
    /// Borrowed from the route when the route names it.
    queue: Cow<'a, str>,
    items: Vec<(Delivery, OutgoingMessage, Option<i64>)>,
}

async fn process_batch(ctx: &SourceCtx, deliveries: Vec<Delivery>) {
    let received_at = Instant::now();
    let n = deliveries.len();
    let mut groups: Vec<Group> = Vec::new();
    let mut dead: Vec<(Delivery, DeadLetterReason)> = Vec::new();
    let mut job_types = JobTypes::new();
    for d in deliveries {
        match plan(ctx, &d, &mut job_types) {
            Ok((route, queue, out, created)) => {
                match groups
                    .iter_mut()
                    .find(|g| g.route == route && g.queue == queue)
                {
                    Some(g) => g.items.push((d, out, created)),
                    None => {
                        // Most batches have one destination: room for the
                        // whole batch up front, not a regrowth (and a copy
                        // of every message) at each doubling.
                        let mut items = Vec::with_capacity(if groups.is_empty() { n } else { 4 });
                        items.push((d, out, created));
                        groups.push(Group {
                            route,
                            queue,
                            items,
                        });
                    }
                }
            }
            Err(reason) => dead.push((d, reason)),
        }
    }
    for group in groups {
        publish_group(ctx, group, received_at, &mut dead).await;
    }
    for (d, reason) in dead {
        dead_letter(ctx, d, reason).await;
    }
}

/// Route index, sink queue, message, creation time — or why not.
fn plan<'a>(
    ctx: &'a SourceCtx,
    d: &Delivery,
    job_types: &mut JobTypes,
) -> Result<(usize, Cow<'a, str>, OutgoingMessage, Option<i64>), DeadLetterReason> {
    let msg = d.decode(Some(ctx.default_encoding))?;
    let Some(route) = ctx
        .routes
        .iter()
        .position(|p| p.route.matches(ctx.name(), &msg))
    else {
        return Err(DeadLetterReason::new(
            "unknown_route",
            match &msg {
                Incoming::Call(c) => {
                    format!("no route takes grpcq call {}/{}", c.topic(), c.action())
                }
                Incoming::Job(j) => format!("no route takes job type {}", j.job_type),
            },
        ));
    };
    let created = msg.created_ms();
    let plan = &ctx.routes[route];
    let (queue, out) = plan.route.map(msg, &ctx.config.queue, job_types)?;
    plan.route
        .admit_destination(&queue, |q| plan.sink.is_reserved(q))?;
    // No size check here: the sink's `publish` makes the one check (its
    // limit, its way of counting) and hands an oversized message back as
    // `PayloadTooLarge`, which `publish_group` dead-letters.
    Ok((route, queue, out, created))
}

/// Whether a per-message publish error is the message's fault (dead-letter
/// it) rather than the sink's (retry it).
fn is_permanent(e: &Error) -> bool {
    matches!(e, Error::PayloadTooLarge { .. }) || (!e.is_retryable() && !matches!(e, Error::Closed))
}

async fn publish_group(
    ctx: &SourceCtx,
    group: Group<'_>,
    received_at: Instant,
    dead: &mut Vec<(Delivery, DeadLetterReason)>,
) {
    let plan = &ctx.routes[group.route];
    let (route, sink) = (&plan.route, &plan.sink);
    let mut waiting: Vec<(Delivery, Option<i64>)> = Vec::with_capacity(group.items.len());
    let mut pending: Vec<OutgoingMessage> = Vec::with_capacity(group.items.len());
    for (d, out, created) in group.items {
        waiting.push((d, created));
        pending.push(out);
    }
    let mut attempt = 0u32;
    loop {
        let published = hold_leases(
            ctx,
            &waiting,
            sink.publish(&group.queue, std::mem::take(&mut pending)),
        )
        .await;
        match published {
            Ok(()) => {
                route.sink_alarm.ok();
                confirmed(ctx, group.route, waiting, received_at).await;
                return;
            }
            Err(Error::Publish(failure)) => {
                let total = waiting.len();
                let mut slots: Vec<Option<(Delivery, Option<i64>)>> =
                    waiting.into_iter().map(Some).collect();
                let mut retry_waiting = Vec::new();
                let mut retry_pending = Vec::new();
                let mut last_error = None;
                for f in failure.failed {
                    let Some(slot) = slots.get_mut(f.index).and_then(Option::take) else {
                        continue;
                    };
                    if is_permanent(&f.error) {
                        let reason = match &f.error {
                            Error::PayloadTooLarge { .. } | Error::UnknownRegion(_) => {
                                DeadLetterReason::from_error(&f.error)
                            }
                            other => DeadLetterReason::new("sink_rejected", other.to_string()),
                        };
                        dead.push((slot.0, reason));
                    } else {
                        last_error = Some(f.error);
                        retry_waiting.push(slot);
                        retry_pending.push(f.message);
                    }
                }
                let done: Vec<_> = slots.into_iter().flatten().collect();
                tracing::debug!(route = %route.name, total, confirmed = done.len(), retrying = retry_waiting.len(), "partial publish");
                confirmed(ctx, group.route, done, received_at).await;
                if retry_waiting.is_empty() {
                    return;
                }
                waiting = retry_waiting;
                pending = retry_pending;
                attempt += 1;
                let reason = last_error.as_ref().map_or("publish", Error::kind);
                ctx.metrics.error(&route.name, reason);
                let delay = reconnect_delay(attempt, MAX_BACKOFF);
                // The source must not hand these out again (or count a
                // receive towards its redrive policy) while we wait for the
                // sink: their leases cover the wait and the next attempt.
                let lease = delay + ctx.config.visibility_timeout;
                let extended = join_all(waiting.iter().map(|(d, _)| d.extend(lease))).await;
                let failed_extends = extended.iter().filter(|r| r.is_err()).count();
                if failed_extends > 0 {
                    tracing::debug!(source = %ctx.name(), failed_extends, "could not extend some source leases while the sink is retried");
                }
                let error =
                    last_error.map_or_else(|| "not confirmed".to_owned(), |e| e.to_string());
                tracing::debug!(route = %route.name, sink = %route.sink, queue = %group.queue, messages = waiting.len(), attempt, delay_ms = delay.as_millis() as u64, %error, "sink did not confirm; retrying");
                route.sink_alarm.failing(&group.queue, &error, delay);
                tokio::time::sleep(delay).await;
            }
            Err(e) => {
                // Adapters hand failed messages back in Error::Publish; any
                // other error leaves nothing to retry here, so the source
                // redelivers them.
                ctx.metrics.error(&route.name, e.kind());
                tracing::debug!(route = %route.name, error = %e, "publish failed; the source will deliver these messages again");
                route.sink_alarm.failing(
                    &group.queue,
                    &e.to_string(),
                    reconnect_delay(1, MAX_BACKOFF),
                );
                let delay = reconnect_delay(1, MAX_BACKOFF);
                join_all(
                    waiting
                        .iter()
                        .map(|(d, _)| d.nack(Nack::retry_after(delay))),
                )
                .await;
                return;
            }
        }
    }
}

/// Runs `publish` while keeping the source leases of `held` alive: a
/// publish that waits longer than the visibility timeout (a blocked broker,
/// a slow confirm) must not let the source hand the messages out again.
async fn hold_leases<T>(
    ctx: &SourceCtx,
    held: &[(Delivery, Option<i64>)],
    publish: impl Future<Output = T>,
) -> T {
    let lease = ctx.config.visibility_timeout;
    let every = (lease / 2).max(Duration::from_millis(50));
    tokio::pin!(publish);
    loop {
        tokio::select! {
            done = &mut publish => return done,
            () = tokio::time::sleep(every) => {
                join_all(held.iter().map(|(d, _)| d.extend(lease))).await;
            }
        }
    }
}

/// The sink confirmed these: ack them at the source.
async fn confirmed(
    ctx: &SourceCtx,
    route: usize,
    done: Vec<(Delivery, Option<i64>)>,
    received_at: Instant,
) {
    if done.is_empty() {
        return;
    }
    let route_metrics = &ctx.routes[route].metrics;
    route_metrics
        .published
        .fetch_add(done.len() as u64, Ordering::Relaxed);
    let now_ms = chrono::Utc::now().timestamp_millis();
    let bridge = received_at.elapsed();
    route_metrics
        .bridge_latency
        .observe_n(bridge, done.len() as u64);
    route_metrics
        .end_to_end_latency
        .observe_all(done.iter().filter_map(|(_, created)| {
            let ms = u64::try_from(now_ms.saturating_sub((*created)?)).unwrap_or(0);
            Some(Duration::from_millis(ms))
        }));
    // One settle for the batch where the adapter has one (Kafka's offsets
    // and memory under one lock, the local broker in one commit); the
    // others' acks run together.
    let deliveries: Vec<&Delivery> = done.iter().map(|(d, _)| d).collect();
    let results = Delivery::ack_all(&deliveries).await;
    let acked = results.iter().filter(|r| r.is_ok()).count();
    ctx.counters()
        .acked
        .fetch_add(acked as u64, Ordering::Relaxed);
    if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
        ctx.metrics.error(ctx.name(), "ack");
        tracing::warn!(source = %ctx.name(), failed = done.len() - acked, error = %e, "ack failed after the sink confirmed; those messages will be delivered again (same job ids)");
    }
}

/// Whether a publish failed because the destination refuses what this one
/// message carries (not because it is down or denies us).
fn refused_for_its_content(e: &Error) -> bool {
    match e {
        Error::Publish(failure) => failure.failed.iter().any(|f| is_permanent(&f.error)),
        other => is_permanent(other),
    }
}

/// How much of a dead letter a configured destination gets: all of it,
/// then without the headers OJS does not name (and the broker message id
/// property), then without its body as well. Each step is taken only when the destination refused the one
/// before for its content, so a dead letter always lands somewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeadLetterTrim {
    Whole,
    KnownHeadersOnly,
    Bodiless,
}

impl DeadLetterTrim {
    /// Takes the next step on `copy`; the step taken.
    fn next(self, copy: &mut OutgoingMessage) -> Self {
        match self {
            DeadLetterTrim::Whole => {
                let before = copy.headers.len();
                copy.headers.retain(|name, _| header::is_known(name));
                let omitted = before - copy.headers.len();
                copy.headers
                    .insert(header::HEADERS_OMITTED, omitted.to_string());
                // The broker's message id property has rules of its own
                // (AMQP: 255 bytes); `ojs-id` still carries the job's id.
                copy.message_id = None;
                DeadLetterTrim::KnownHeadersOnly
            }
            DeadLetterTrim::KnownHeadersOnly | DeadLetterTrim::Bodiless => {
                let size = copy.payload.len();
                copy.payload = bytes::Bytes::new();
                copy.headers
                    .insert(header::PAYLOAD_OMITTED, size.to_string());
                DeadLetterTrim::Bodiless
            }
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            DeadLetterTrim::Whole => "nothing",
            DeadLetterTrim::KnownHeadersOnly => "headers OJS does not name, message id",
            DeadLetterTrim::Bodiless => "headers OJS does not name, message id, body",
        }
    }
}

/// Sends a poison message to the dead-letter destination with its reason.
async fn dead_letter(ctx: &SourceCtx, d: Delivery, reason: DeadLetterReason) {
    ctx.metrics.dead_lettered(ctx.name(), &reason.error_type);
    tracing::warn!(source = %ctx.name(), reason = %reason.error_type, message_id = d.message_id.as_deref(), detail = %reason.message, "dead-lettering");
    let result = match &ctx.dead_letter {
        // The adapter's own dead-letter destination. A failure there is the
        // destination's, not the message's: retried while the source lease
        // is kept (on Kafka an unsettled record holds its partition's commit
        // point, so giving up is not an option either).
        None => {
            let mut attempt = 0;
            loop {
                match d.nack(Nack::DeadLetter(reason.clone())).await {
                    Err(e) if e.is_retryable() => {
                        attempt += 1;
                        ctx.metrics.error(ctx.name(), "dead_letter");
                        let delay = reconnect_delay(attempt, MAX_BACKOFF);
                        let _ = d.extend(delay + ctx.config.visibility_timeout).await;
                        tracing::warn!(source = %ctx.name(), error = %e, attempt, "dead-letter destination did not confirm; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    other => break other,
                }
            }
        }
        Some((adapter, queue)) => {
            let mut copy = OutgoingMessage {
                payload: d.payload.clone(),
                headers: d.headers.clone(),
                key: d.key.clone(),
                message_id: d.message_id.clone(),
                priority: 0,
                deliver_at: None,
                envelope: None,
            };
            reason.write_headers(&mut copy.headers);
            let mut attempt = 0;
            let mut trimmed = DeadLetterTrim::Whole;
            loop {
                match adapter.publish(queue, vec![copy.clone()]).await {
                    Ok(()) => break d.ack().await,
                    Err(e)
                        if refused_for_its_content(&e) && trimmed != DeadLetterTrim::Bodiless =>
                    {
                        // Another broker's headers or size can be what the
                        // destination refuses (an SQS attribute name, an
                        // AMQP short string, a smaller queue): retrying the
                        // same copy would hold the source for ever.
                        trimmed = trimmed.next(&mut copy);
                        tracing::warn!(source = %ctx.name(), error = %e, left_out = trimmed.as_str(), "dead-letter destination refused the copy; sending it with less");
                    }
                    Err(e) => {
                        attempt += 1;
                        ctx.metrics.error(ctx.name(), "dead_letter_publish");
                        let delay = reconnect_delay(attempt, MAX_BACKOFF);
                        tracing::warn!(source = %ctx.name(), error = %e, attempt, "dead-letter queue did not confirm; retrying");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    };
    match result {
        Ok(()) => {
            let counters = ctx.counters();
            counters.acked.fetch_add(1, Ordering::Relaxed);
            counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            ctx.metrics.error(ctx.name(), "dead_letter");
            tracing::warn!(source = %ctx.name(), error = %e, "dead-lettering failed; the message will be delivered again");
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
