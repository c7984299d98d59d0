//! `[adapters]`: each adapter a URL or a table of `url` and settings,
//! compiled into the adapter's own settings.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::{invalid, ConfigError};

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
        use ojs_queue::settings::SettingValue;
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
                        ojs_queue::settings::suggestion(
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

pub(crate) fn core_invalid(at: &dyn Fn(&str) -> String, e: ojs_queue::Error) -> ConfigError {
    match e {
        ojs_queue::Error::InvalidConfig { field, reason } => invalid(at(&field), reason),
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
