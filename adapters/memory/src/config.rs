//! Settings of the in-process broker.

use ojs_queue::{Error, Result};

/// Default message size limit: generous, but bounded so that a runaway
/// producer fails loudly instead of exhausting memory.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Settings of an in-memory adapter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Largest accepted message (body + headers), bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

fn default_max_message_bytes() -> usize {
    DEFAULT_MAX_MESSAGE_BYTES
}

impl MemoryConfig {
    /// Parses `memory://NAME[?max_message_bytes=N]` into the broker name and
    /// the settings, with `settings` over them.
    pub fn from_url_with(
        url: &str,
        settings: Vec<(String, ojs_queue::settings::SettingValue)>,
    ) -> Result<(String, MemoryConfig)> {
        let (base, query) = ojs_queue::settings::split_query(url)?;
        let name = base
            .strip_prefix("memory://")
            .ok_or_else(|| Error::InvalidConfig {
                field: "url".into(),
                reason: "a memory adapter URL is memory://NAME".into(),
            })?
            .trim_end_matches('/');
        let items = query
            .into_iter()
            .map(|(k, v)| (k, ojs_queue::settings::SettingValue::Text(v)))
            .chain(settings);
        let config = ojs_queue::settings::overlay(&MemoryConfig::default(), items)?;
        let name = if name.is_empty() { "default" } else { name };
        Ok((name.to_owned(), config))
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}
