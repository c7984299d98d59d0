//! `[api]`: the OJS HTTP binding on the `[http]` listener — which adapter's
//! queues hold the jobs, which queues clients may name, where job state is
//! kept.

use super::*;

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
    /// `local:./dir` or `local:///abs/dir` (file `jobs.sqlite` in it).
    /// Default: the data directory of `adapter` when it is the embedded
    /// broker, else `local:./ojs-bridge-data`.
    #[serde(default)]
    pub state: Option<String>,
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
}

fn default_max_body_bytes() -> usize {
    4 << 20
}
fn default_max_batch_jobs() -> usize {
    1000
}
fn default_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}

impl ApiConfig {
    /// The directory of the job store.
    pub fn state_dir(&self, adapters: &BTreeMap<String, AdapterEntry>) -> Result<PathBuf, String> {
        let url = match &self.state {
            Some(url) => url.clone(),
            None => match adapters.get(&self.adapter) {
                Some(a) if crate::endpoint::scheme(&a.url) == "local" => a.url.clone(),
                _ => "local:./ojs-bridge-data".to_owned(),
            },
        };
        if crate::endpoint::scheme(&url) != "local" {
            return Err(format!(
                "{:?}: job state is kept in an embedded store (local:./dir); a store shared by several replicas is not in this build",
                ojs_core::redact::url(&url)
            ));
        }
        ojs_adapter_local::LocalConfig::from_url(&url)
            .map(|c| c.path)
            .map_err(|e| e.to_string())
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
                    ojs_core::settings::suggestion(
                        &self.adapter,
                        adapters.keys().map(String::as_str)
                    )
                ),
            ));
        }
        for (i, q) in self.queues.iter().enumerate() {
            let literal = q.replace('*', "a");
            if let Err(e) = ojs_core::envelope::validate_queue_name(&literal) {
                errors.push(invalid(format!("api.queues[{i}]"), e.to_string()));
            }
        }
        if let Err(reason) = self.state_dir(adapters) {
            errors.push(invalid("api.state", reason));
        }
        if self.max_body_bytes < 1024 {
            errors.push(invalid("api.max_body_bytes", "must be at least 1024"));
        }
        if self.max_batch_jobs == 0 {
            errors.push(invalid("api.max_batch_jobs", "must be at least 1"));
        }
        errors
    }
}
