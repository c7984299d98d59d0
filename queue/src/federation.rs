//! Client-side federation across regions (docs/design.md §6).
//!
//! A [`Federation`] wraps region-local adapters (any broker) and is itself a
//! [`QueueAdapter`]: publishing routes each job to a region by its strategy
//! (affinity, overflow, geo-pin), behind a circuit breaker per region. No
//! broker changes: federation attributes travel in the envelope's meta.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::{
    publish_outcome, Consumer, ConsumerOptions, FailedPublish, Health, OutgoingMessage,
    QueueAdapter,
};
use ojs_core::envelope::media::Encoding;
use ojs_core::envelope::JobEnvelope;

/// Meta key: UUIDv7 of the federated job, stable across regions.
pub const META_FEDERATION_ID: &str = "ojs.federation.federation_id";
/// Meta key: the region the job must run in (forces geo-pin).
pub const META_REGION: &str = "ojs.federation.region";
/// Meta key: routing strategy (`affinity`, `overflow`, `geo-pin`).
pub const META_REGION_AFFINITY: &str = "ojs.federation.region_affinity";
/// Meta key: the region a replica came from; replicas are never replicated.
pub const META_REPLICATED_FROM: &str = "ojs.federation.replicated_from";

/// How a job picks its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// The local region while it is healthy, else the fallback order, else
    /// the lowest observed latency.
    #[default]
    Affinity,
    /// The least loaded region (queue depth).
    Overflow,
    /// Only the named region; never rerouted.
    GeoPin,
}

impl Strategy {
    /// Parses the meta value.
    pub fn parse(s: &str) -> Option<Strategy> {
        match s {
            "affinity" => Some(Strategy::Affinity),
            "overflow" => Some(Strategy::Overflow),
            "geo-pin" => Some(Strategy::GeoPin),
            _ => None,
        }
    }
}

/// Circuit breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Requests flow; consecutive failures are counted.
    Closed,
    /// Requests are refused until the cooldown ends.
    Open,
    /// One probe request decides.
    HalfOpen,
}

impl BreakerState {
    /// The state's name in logs and metrics: `closed`, `open`, `half_open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

impl BreakerState {
    /// Metrics value: 0 closed, 1 half-open, 2 open.
    pub fn as_gauge(self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// What a breaker let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A request in the closed state.
    Normal,
    /// The single half-open probe.
    Probe,
}

#[derive(Debug)]
enum BreakerInner {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

/// Closed → open after `failure_threshold` consecutive failures → half-open
/// after `cooldown`, admitting exactly one probe → closed on its success,
/// open again on its failure.
#[derive(Debug)]
pub struct CircuitBreaker {
    failure_threshold: u32,
    cooldown: Duration,
    inner: Mutex<BreakerInner>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(failure_threshold: u32, cooldown: Duration) -> Self {
        CircuitBreaker {
            failure_threshold: failure_threshold.max(1),
            cooldown,
            inner: Mutex::new(BreakerInner::Closed { failures: 0 }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BreakerInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets a request through, or not. An open breaker whose cooldown has
    /// passed turns half-open and admits this one request as the probe;
    /// every other caller is refused until the probe is recorded.
    pub fn admit(&self) -> Option<Admission> {
        let mut inner = self.lock();
        match *inner {
            BreakerInner::Closed { .. } => Some(Admission::Normal),
            BreakerInner::Open { until } if Instant::now() < until => None,
            BreakerInner::Open { .. } | BreakerInner::HalfOpen { probing: false } => {
                *inner = BreakerInner::HalfOpen { probing: true };
                Some(Admission::Probe)
            }
            BreakerInner::HalfOpen { probing: true } => None,
        }
    }

    /// Whether [`CircuitBreaker::admit`] would let a request through now.
    pub fn would_admit(&self) -> bool {
        match *self.lock() {
            BreakerInner::Closed { .. } | BreakerInner::HalfOpen { probing: false } => true,
            BreakerInner::Open { until } => Instant::now() >= until,
            BreakerInner::HalfOpen { probing: true } => false,
        }
    }

    /// Records the outcome of an admitted request; returns the new state
    /// when it changed.
    pub fn record(&self, admission: Admission, ok: bool) -> Option<BreakerState> {
        let mut inner = self.lock();
        match (admission, &mut *inner) {
            (Admission::Probe, BreakerInner::HalfOpen { .. }) => {
                if ok {
                    *inner = BreakerInner::Closed { failures: 0 };
                    Some(BreakerState::Closed)
                } else {
                    *inner = BreakerInner::Open {
                        until: Instant::now() + self.cooldown,
                    };
                    Some(BreakerState::Open)
                }
            }
            (Admission::Normal, BreakerInner::Closed { failures }) => {
                if ok {
                    *failures = 0;
                    None
                } else {
                    *failures += 1;
                    if *failures >= self.failure_threshold {
                        *inner = BreakerInner::Open {
                            until: Instant::now() + self.cooldown,
                        };
                        Some(BreakerState::Open)
                    } else {
                        None
                    }
                }
            }
            // A request admitted before the state changed: its outcome is
            // stale and decides nothing.
            _ => None,
        }
    }

    /// The state now.
    pub fn state(&self) -> BreakerState {
        match *self.lock() {
            BreakerInner::Closed { .. } => BreakerState::Closed,
            BreakerInner::Open { .. } => BreakerState::Open,
            BreakerInner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }
}

/// How a region's health is checked.
#[async_trait]
pub trait HealthProbe: Send + Sync + std::fmt::Debug {
    /// One check.
    async fn check(&self) -> Health;
}

/// The region adapter's own health check.
#[derive(Debug)]
pub struct AdapterProbe(pub Arc<dyn QueueAdapter>);

#[async_trait]
impl HealthProbe for AdapterProbe {
    async fn check(&self) -> Health {
        self.0.health().await
    }
}

/// Settings of a federation (plain data; the bridge's TOML maps onto it).
#[derive(Debug, Clone, PartialEq)]
pub struct FederationSettings {
    /// The local region (affinity's first choice).
    pub local: String,
    /// Affinity's order after the local region.
    pub fallback: Vec<String>,
    /// Strategy of jobs whose meta names none.
    pub default_strategy: Strategy,
    /// Consecutive failures that open a region's breaker.
    pub failure_threshold: u32,
    /// Time an open breaker waits before its half-open probe.
    pub cooldown: Duration,
    /// Interval of health probes.
    pub health_interval: Duration,
    /// Longest wait for one probe.
    pub health_timeout: Duration,
    /// Interval of queue-depth collection (overflow).
    pub load_interval: Duration,
    /// Most redirects of one job after its first region failed.
    pub max_redirects: usize,
    /// Weight of a new latency sample in the moving average.
    pub latency_alpha: f64,
    /// Copy job metadata to the other regions.
    pub replicate: bool,
    /// Queue replicas are published to.
    pub replication_queue: String,
}

impl FederationSettings {
    /// The spec's defaults around a local region: affinity, 5 failures,
    /// 30 s cooldown, probes every 5 s, load every 10 s, 3 redirects.
    pub fn new(local: impl Into<String>) -> Self {
        FederationSettings {
            local: local.into(),
            fallback: Vec::new(),
            default_strategy: Strategy::Affinity,
            failure_threshold: 5,
            cooldown: Duration::from_secs(30),
            health_interval: Duration::from_secs(5),
            health_timeout: Duration::from_secs(2),
            load_interval: Duration::from_secs(10),
            max_redirects: 3,
            latency_alpha: 0.3,
            replicate: false,
            replication_queue: "ojs-federation-replicas".into(),
        }
    }
}

/// A region: a name, an adapter and a probe.
#[derive(Debug)]
pub struct RegionSpec {
    /// Region id, e.g. `eu-west-1`.
    pub name: String,
    /// Where its jobs go.
    pub adapter: Arc<dyn QueueAdapter>,
    /// How its health is checked.
    pub probe: Arc<dyn HealthProbe>,
}

#[derive(Debug)]
struct Region {
    name: String,
    adapter: Arc<dyn QueueAdapter>,
    probe: Arc<dyn HealthProbe>,
    breaker: CircuitBreaker,
    latency: Mutex<Option<Duration>>,
    depths: Mutex<HashMap<String, u64>>,
    routed: AtomicU64,
    failures: AtomicU64,
}

impl Region {
    fn latency(&self) -> Option<Duration> {
        *self.latency.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn depth(&self, queue: &str) -> Option<u64> {
        self.depths
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .copied()
    }
}

/// One region's state, for metrics and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionSnapshot {
    /// Region id.
    pub name: String,
    /// Its breaker.
    pub breaker: BreakerState,
    /// Moving average of probe round trips.
    pub latency: Option<Duration>,
    /// Messages published there.
    pub routed: u64,
    /// Failed publishes and probes.
    pub failures: u64,
}

/// Federated publishing over named regions; see the module docs.
#[derive(Debug)]
pub struct Federation {
    settings: FederationSettings,
    regions: Vec<Region>,
    by_name: HashMap<String, usize>,
    queues: Mutex<BTreeSet<String>>,
    failovers: AtomicU64,
    replicated: AtomicU64,
}

/// A message of a publish in progress.
struct Item {
    index: usize,
    message: OutgoingMessage,
    job: Option<JobEnvelope>,
    candidates: Vec<usize>,
    position: usize,
    pinned: bool,
}

fn invalid(field: &str, reason: String) -> Error {
    Error::InvalidConfig {
        field: field.into(),
        reason,
    }
}

impl Federation {
    /// A federation of `regions`; `local` and `fallback` must name them.
    pub fn new(settings: FederationSettings, regions: Vec<RegionSpec>) -> Result<Self> {
        if regions.is_empty() {
            return Err(invalid(
                "regions",
                "a federation needs at least one region".into(),
            ));
        }
        let mut by_name = HashMap::new();
        for (i, r) in regions.iter().enumerate() {
            if by_name.insert(r.name.clone(), i).is_some() {
                return Err(invalid(
                    "regions",
                    format!("region {:?} is listed twice", r.name),
                ));
            }
        }
        let known = || by_name.keys().cloned().collect::<Vec<_>>().join(", ");
        if !by_name.contains_key(&settings.local) {
            return Err(invalid(
                "local",
                format!(
                    "{:?} is not a region (regions: {})",
                    settings.local,
                    known()
                ),
            ));
        }
        for f in &settings.fallback {
            if !by_name.contains_key(f) {
                return Err(invalid(
                    "fallback",
                    format!("{f:?} is not a region (regions: {})", known()),
                ));
            }
        }
        let regions = regions
            .into_iter()
            .map(|r| Region {
                name: r.name,
                adapter: r.adapter,
                probe: r.probe,
                breaker: CircuitBreaker::new(settings.failure_threshold, settings.cooldown),
                latency: Mutex::new(None),
                depths: Mutex::new(HashMap::new()),
                routed: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            })
            .collect();
        Ok(Federation {
            settings,
            regions,
            by_name,
            queues: Mutex::new(BTreeSet::new()),
            failovers: AtomicU64::new(0),
            replicated: AtomicU64::new(0),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &FederationSettings {
        &self.settings
    }

    /// Each region's state.
    pub fn snapshot(&self) -> Vec<RegionSnapshot> {
        self.regions
            .iter()
            .map(|r| RegionSnapshot {
                name: r.name.clone(),
                breaker: r.breaker.state(),
                latency: r.latency(),
                routed: r.routed.load(Ordering::Relaxed),
                failures: r.failures.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Failovers so far (a job moved on after its region failed).
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// Replicas published so far.
    pub fn replicated(&self) -> u64 {
        self.replicated.load(Ordering::Relaxed)
    }

    fn record(&self, region: usize, admission: Admission, ok: bool) {
        let r = &self.regions[region];
        if !ok {
            r.failures.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(state) = r.breaker.record(admission, ok) {
            tracing::warn!(region = %r.name, state = state.as_str(), "federation: circuit breaker changed state");
        }
    }

    /// One round of health probes. Regions whose breaker is open and
    /// cooling down are not probed; a cooled one gets its
    /// half-open probe here unless a publish took it first.
    pub async fn check_health(&self) {
        let checks = self.regions.iter().enumerate().map(|(i, r)| async move {
            let Some(admission) = r.breaker.admit() else {
                return;
            };
            let started = Instant::now();
            let health = tokio::time::timeout(self.settings.health_timeout, r.probe.check()).await;
            let rtt = started.elapsed();
            let ok = matches!(&health, Ok(h) if h.healthy);
            if ok {
                let mut latency = r.latency.lock().unwrap_or_else(|e| e.into_inner());
                let alpha = self.settings.latency_alpha.clamp(0.0, 1.0);
                *latency = Some(match *latency {
                    None => rtt,
                    Some(prev) => prev.mul_f64(1.0 - alpha) + rtt.mul_f64(alpha),
                });
            } else {
                let detail = match health {
                    Ok(h) => h.detail,
                    Err(_) => format!("no answer within {:?}", self.settings.health_timeout),
                };
                tracing::debug!(region = %r.name, %detail, "federation: health probe failed");
            }
            self.record(i, admission, ok);
        });
        futures::future::join_all(checks).await;
    }

    /// Collects the depth of every queue published so far, per region
    /// whose breaker is not open.
    pub async fn collect_load(&self) {
        let queues: Vec<String> = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        for r in &self.regions {
            if r.breaker.state() == BreakerState::Open {
                continue;
            }
            for q in &queues {
                if let Ok(Some(depth)) = r.adapter.depth(q).await {
                    r.depths
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(q.clone(), depth);
                }
            }
        }
    }

    /// Probes health every `health_interval` and collects load every
    /// `load_interval` until `shutdown` completes.
    pub async fn run_monitor(self: Arc<Self>, shutdown: impl Future<Output = ()>) {
        let mut health = tokio::time::interval(self.settings.health_interval);
        let mut load = tokio::time::interval(self.settings.load_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        load.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = health.tick() => self.check_health().await,
                _ = load.tick() => self.collect_load().await,
            }
        }
    }

    /// Region order for a job (at most 1 + `max_redirects`), or the
    /// geo-pin errors.
    fn plan(
        &self,
        strategy: Strategy,
        pinned: Option<&str>,
        queue: &str,
    ) -> Result<(Vec<usize>, bool)> {
        if let Some(region) = pinned {
            let Some(&i) = self.by_name.get(region) else {
                return Err(Error::UnknownRegion(region.to_owned()));
            };
            if !self.regions[i].breaker.would_admit() {
                return Err(Error::RegionUnavailable {
                    region: region.to_owned(),
                    reason: "its circuit breaker is open".into(),
                });
            }
            return Ok((vec![i], true));
        }
        let available: Vec<usize> = (0..self.regions.len())
            .filter(|&i| self.regions[i].breaker.would_admit())
            .collect();
        let by_latency = |a: &usize, b: &usize| {
            let key = |i: &usize| self.regions[*i].latency().unwrap_or(Duration::MAX);
            key(a).cmp(&key(b))
        };
        let mut order: Vec<usize> = match strategy {
            Strategy::Affinity | Strategy::GeoPin => {
                let mut order = Vec::new();
                for name in std::iter::once(&self.settings.local).chain(&self.settings.fallback) {
                    if let Some(&i) = self.by_name.get(name) {
                        if available.contains(&i) && !order.contains(&i) {
                            order.push(i);
                        }
                    }
                }
                let mut rest: Vec<usize> = available
                    .iter()
                    .copied()
                    .filter(|i| !order.contains(i))
                    .collect();
                rest.sort_by(by_latency);
                order.extend(rest);
                order
            }
            Strategy::Overflow => {
                let mut order = available.clone();
                order.sort_by(|a, b| {
                    let depth = |i: &usize| self.regions[*i].depth(queue).unwrap_or(u64::MAX);
                    depth(a).cmp(&depth(b)).then_with(|| by_latency(a, b))
                });
                order
            }
        };
        order.truncate(1 + self.settings.max_redirects);
        if order.is_empty() {
            return Err(Error::RegionUnavailable {
                region: "*".into(),
                reason: "every region's circuit breaker is open".into(),
            });
        }
        Ok((order, false))
    }

    /// Adds federation meta and decides the regions of one message.
    fn prepare(
        &self,
        queue: &str,
        index: usize,
        message: OutgoingMessage,
    ) -> std::result::Result<Item, Box<FailedPublish>> {
        let encoding = message
            .content_type()
            .and_then(|ct| Encoding::from_content_type(ct).ok())
            .filter(|e| matches!(e, Encoding::OjsProto | Encoding::OjsJson));
        let mut job = None;
        let mut message = message;
        let (mut strategy, mut pinned) = (self.settings.default_strategy, None);
        if let Some(encoding) = encoding {
            // The producer's envelope, when it kept it: no second parse.
            let decoded = match message.envelope.take() {
                Some(job) => Ok(vec![std::sync::Arc::unwrap_or_clone(job)]),
                None => encoding.decode_envelopes(&message.payload),
            };
            match decoded {
                Ok(mut jobs) if jobs.len() == 1 => {
                    let mut j = jobs.remove(0);
                    if j.meta_str(META_FEDERATION_ID).is_none() {
                        // A UUIDv7 stamped with the enqueue time (docs/design.md §6).
                        j.meta.insert(
                            META_FEDERATION_ID.into(),
                            uuid::Uuid::now_v7().hyphenated().to_string().into(),
                        );
                    }
                    if j.enqueued_at.is_none() {
                        j.enqueued_at = Some(ojs_core::envelope::now_millis());
                    }
                    if let Some(s) = j.meta_str(META_REGION_AFFINITY).and_then(Strategy::parse) {
                        strategy = s;
                    }
                    // `region` forces geo-pin whatever the affinity says.
                    pinned = j.meta_str(META_REGION).map(str::to_owned);
                    match OutgoingMessage::from_envelope(&j, encoding) {
                        Ok(mut rebuilt) => {
                            for (k, v) in &message.headers {
                                if !rebuilt.headers.contains_key(k) {
                                    rebuilt.headers.insert(k.clone(), v.clone());
                                }
                            }
                            rebuilt.key = message.key.clone().or(rebuilt.key);
                            message = rebuilt;
                        }
                        Err(error) => {
                            return Err(Box::new(FailedPublish {
                                index,
                                message,
                                error: error.into(),
                            }))
                        }
                    }
                    job = Some(j);
                }
                // Not one envelope: routed as it is, without meta.
                _ => {}
            }
        }
        if strategy == Strategy::GeoPin && pinned.is_none() {
            return Err(Box::new(FailedPublish {
                index,
                message,
                error: Error::Codec(ojs_core::Error::invalid(
                    META_REGION_AFFINITY,
                    "geo-pin needs ojs.federation.region",
                )),
            }));
        }
        match self.plan(strategy, pinned.as_deref(), queue) {
            Ok((candidates, pinned)) => Ok(Item {
                index,
                message,
                job: if self.settings.replicate { job } else { None },
                candidates,
                position: 0,
                pinned,
            }),
            Err(error) => Err(Box::new(FailedPublish {
                index,
                message,
                error,
            })),
        }
    }

    /// Copies metadata of jobs that landed in `region` to the others.
    async fn replicate(&self, region: usize, jobs: Vec<JobEnvelope>) {
        let from = &self.regions[region].name;
        let replicas: Vec<OutgoingMessage> = jobs
            .into_iter()
            .filter(|j| j.meta_str(META_REPLICATED_FROM).is_none())
            .filter_map(|mut j| {
                j.meta
                    .insert(META_REPLICATED_FROM.into(), from.clone().into());
                OutgoingMessage::from_envelope(&j, Encoding::OjsProto).ok()
            })
            .collect();
        if replicas.is_empty() {
            return;
        }
        for (i, r) in self.regions.iter().enumerate() {
            if i == region || !r.breaker.would_admit() {
                continue;
            }
            match r
                .adapter
                .publish(&self.settings.replication_queue, replicas.clone())
                .await
            {
                Ok(()) => {
                    self.replicated
                        .fetch_add(replicas.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    // Replication is eventual and best effort: the job itself is safe.
                    tracing::warn!(region = %r.name, error = %e, "federation: replication failed");
                }
            }
        }
    }
}

/// Last writer wins on `enqueued_at` at millisecond precision, ties broken
/// by `federation_id` (the lexicographically greater wins). Returns the
/// copy to keep.
pub fn resolve_conflict<'a>(a: &'a JobEnvelope, b: &'a JobEnvelope) -> &'a JobEnvelope {
    let key = |j: &'a JobEnvelope| {
        (
            j.enqueued_at.map_or(i64::MIN, |t| t.timestamp_millis()),
            j.meta_str(META_FEDERATION_ID).unwrap_or_default(),
        )
    };
    if key(b) > key(a) {
        b
    } else {
        a
    }
}

#[async_trait]
impl QueueAdapter for Federation {
    fn kind(&self) -> &'static str {
        "federated"
    }

    fn max_message_bytes(&self) -> usize {
        self.regions
            .iter()
            .map(|r| r.adapter.max_message_bytes())
            .min()
            .unwrap_or(usize::MAX)
    }

    async fn publish(&self, queue: &str, messages: Vec<OutgoingMessage>) -> Result<()> {
        self.queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned());
        let total = messages.len();
        let mut failed = Vec::new();
        let mut pending = Vec::new();
        for (index, m) in messages.into_iter().enumerate() {
            match self.prepare(queue, index, m) {
                Ok(item) => pending.push(item),
                Err(f) => failed.push(*f),
            }
        }
        while !pending.is_empty() {
            let region = pending[0].candidates[pending[0].position];
            let (group, rest): (Vec<Item>, Vec<Item>) = pending
                .into_iter()
                .partition(|it| it.candidates[it.position] == region);
            pending = rest;
            let r = &self.regions[region];
            let outcome = match r.breaker.admit() {
                None => Err(Error::RegionUnavailable {
                    region: r.name.clone(),
                    reason: "its circuit breaker is open".into(),
                }),
                Some(admission) => {
                    let result = r
                        .adapter
                        .publish(queue, group.iter().map(|it| it.message.clone()).collect())
                        .await;
                    self.record(region, admission, result.is_ok());
                    result
                }
            };
            let mut failed_here: HashMap<usize, Error> = HashMap::new();
            let mut all_failed = None;
            match outcome {
                Ok(()) => {}
                Err(Error::Publish(f)) => {
                    for fp in f.failed {
                        failed_here.insert(fp.index, fp.error);
                    }
                }
                Err(e) => all_failed = Some(e),
            }
            let mut landed = Vec::new();
            for (pos, mut item) in group.into_iter().enumerate() {
                let error = match &all_failed {
                    Some(e) => Some(Error::RegionUnavailable {
                        region: r.name.clone(),
                        reason: e.to_string(),
                    }),
                    None => failed_here.remove(&pos),
                };
                let Some(error) = error else {
                    r.routed.fetch_add(1, Ordering::Relaxed);
                    if let Some(job) = item.job.take() {
                        landed.push(job);
                    }
                    continue;
                };
                let permanent = matches!(error, Error::PayloadTooLarge { .. });
                if item.pinned || permanent || item.position + 1 >= item.candidates.len() {
                    let error = if item.pinned && !permanent {
                        Error::RegionUnavailable {
                            region: r.name.clone(),
                            reason: error.to_string(),
                        }
                    } else {
                        error
                    };
                    failed.push(FailedPublish {
                        index: item.index,
                        message: item.message,
                        error,
                    });
                } else {
                    item.position += 1;
                    let next = &self.regions[item.candidates[item.position]].name;
                    self.failovers.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(from = %r.name, to = %next, %error, "federation: failing over");
                    pending.push(item);
                }
            }
            if !landed.is_empty() {
                self.replicate(region, landed).await;
            }
        }
        publish_outcome(total, failed)
    }

    /// Consumes from the local region.
    async fn consumer(&self, queue: &str, options: ConsumerOptions) -> Result<Box<dyn Consumer>> {
        let local = self.by_name.get(&self.settings.local).copied().unwrap_or(0);
        self.regions[local].adapter.consumer(queue, options).await
    }

    /// Healthy while at least one region accepts work.
    async fn health(&self) -> Health {
        let states: Vec<String> = self
            .regions
            .iter()
            .map(|r| format!("{}: {:?}", r.name, r.breaker.state()))
            .collect();
        if self.regions.iter().any(|r| r.breaker.would_admit()) {
            Health::ok(states.join(", "))
        } else {
            Health::down(format!("no region accepts work ({})", states.join(", ")))
        }
    }

    /// Depth in the local region.
    async fn depth(&self, queue: &str) -> Result<Option<u64>> {
        let local = self.by_name.get(&self.settings.local).copied().unwrap_or(0);
        self.regions[local].adapter.depth(queue).await
    }

    /// Region adapters belong to whoever built them (they may serve other
    /// sources and sinks): closing the federation leaves them open.
    async fn close(&self) -> Result<()> {
        Ok(())
    }
}
