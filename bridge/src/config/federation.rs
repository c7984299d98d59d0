//! `[federations.NAME]`: a federated sink over regions, each an adapter.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::duration::duration_text;

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
    pub strategy: ojs_queue::federation::Strategy,
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

pub(crate) fn default_failure_threshold() -> u32 {
    5
}
pub(crate) fn default_cooldown() -> Duration {
    Duration::from_secs(30)
}
pub(crate) fn default_health_interval() -> Duration {
    Duration::from_secs(5)
}
pub(crate) fn default_health_timeout() -> Duration {
    Duration::from_secs(2)
}
pub(crate) fn default_load_interval() -> Duration {
    Duration::from_secs(10)
}
pub(crate) fn default_max_redirects() -> usize {
    3
}
pub(crate) fn default_replication_queue() -> String {
    "ojs-federation-replicas".to_owned()
}

impl FederationConfig {
    /// The core settings.
    pub fn settings(&self) -> ojs_queue::federation::FederationSettings {
        let mut s = ojs_queue::federation::FederationSettings::new(self.local.clone());
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
