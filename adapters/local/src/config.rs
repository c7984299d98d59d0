//! Settings of the embedded broker (serde data, separate from the runtime).

use std::path::PathBuf;
use std::time::Duration;

use ojs_queue::settings::{self, SettingValue};
use ojs_queue::{Error, Result};
use serde::{Deserialize, Serialize};

/// File name of the queue database inside the data directory.
pub const DATABASE_FILE: &str = "queues.sqlite3";

/// How hard SQLite works to make a commit durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// A published message survives a crash of the process (WAL with
    /// `synchronous=NORMAL`: written to the OS before publish returns, synced
    /// at checkpoints). The default.
    #[default]
    Process,
    /// A published message also survives power loss (`synchronous=FULL`:
    /// an fsync per commit; much slower for single publishes and acks).
    Power,
}

/// Settings of a `local://` adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    /// Data directory; created when missing.
    pub path: PathBuf,
    /// Largest message (body + headers) accepted, bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// What a commit survives.
    #[serde(default)]
    pub durability: Durability,
    /// How often a waiting consumer looks for messages published by other
    /// processes (same-process publishes wake it at once).
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// How long to wait for another process's lock before failing.
    #[serde(default = "default_busy_timeout_ms")]
    pub busy_timeout_ms: u64,
    /// A quota for the database file, bytes (SQLite `max_page_count`); `0`
    /// = only the disk's. A full store refuses publishes as retryable
    /// (the daemon holds its source and waits) until consumers free room.
    #[serde(default)]
    pub max_size_bytes: u64,
}

/// 8 MiB: well above the 1 MiB envelopes must carry, bounded so a runaway
/// producer fails loudly.
fn default_max_message_bytes() -> usize {
    8 * 1024 * 1024
}

/// 50 ms: cross-process latency bound without busy polling.
fn default_poll_interval_ms() -> u64 {
    50
}

/// 10 s: ample for another process's batch commit.
fn default_busy_timeout_ms() -> u64 {
    10_000
}

impl LocalConfig {
    /// Defaults for a data directory.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        LocalConfig {
            path: path.into(),
            max_message_bytes: default_max_message_bytes(),
            durability: Durability::default(),
            max_size_bytes: 0,
            poll_interval_ms: default_poll_interval_ms(),
            busy_timeout_ms: default_busy_timeout_ms(),
        }
    }

    /// Parses `local:///abs/dir`, `local:./relative/dir` or `local:dir`,
    /// with settings as query items (`local:./data?durability=power`).
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_url_with(url, Vec::new())
    }

    /// [`Self::from_url`], then `settings` over it (a config file's table,
    /// environment overrides).
    pub fn from_url_with(url: &str, settings: Vec<(String, SettingValue)>) -> Result<Self> {
        let (url, query) = settings::split_query(url)?;
        let rest = url
            .strip_prefix("local:")
            .ok_or_else(|| Error::InvalidConfig {
                field: "url".into(),
                reason: format!("{url:?} is not a local: URL (local:///abs/dir or local:./dir)"),
            })?;
        // local:///abs → "///abs" → "/abs"; local://rel is ambiguous: refuse.
        let path = if let Some(abs) = rest.strip_prefix("//") {
            if !abs.starts_with('/') {
                return Err(Error::InvalidConfig {
                    field: "url".into(),
                    reason: format!("{url:?}: use local:///absolute/dir or local:./relative/dir"),
                });
            }
            abs
        } else {
            rest
        };
        if path.is_empty() {
            return Err(Error::InvalidConfig {
                field: "url".into(),
                reason: format!("{url:?} names no directory"),
            });
        }
        let items = query
            .into_iter()
            .map(|(k, v)| (k, SettingValue::Text(v)))
            .chain(settings);
        settings::overlay(&LocalConfig::new(path), items)
    }

    /// The database file.
    pub fn database_path(&self) -> PathBuf {
        self.path.join(DATABASE_FILE)
    }

    pub(crate) fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            LocalConfig::from_url("local:///var/lib/ojs").unwrap().path,
            PathBuf::from("/var/lib/ojs")
        );
        assert_eq!(
            LocalConfig::from_url("local:./data").unwrap().path,
            PathBuf::from("./data")
        );
        assert_eq!(
            LocalConfig::from_url("local:data").unwrap().path,
            PathBuf::from("data")
        );
        let c = LocalConfig::from_url("local:./d?durability=power&poll_interval_ms=5").unwrap();
        assert_eq!(c.durability, Durability::Power);
        assert_eq!(c.poll_interval_ms, 5);
        for bad in ["local:", "local://host/x", "file:///x", "local:./d?bogus=1"] {
            assert!(
                matches!(LocalConfig::from_url(bad), Err(Error::InvalidConfig { .. })),
                "{bad}"
            );
        }
    }
}
