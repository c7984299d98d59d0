//! Kafka adapter settings (serde data; the runtime lives in `lib.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use ojs_queue::settings::{self, SettingValue, Topology};
use ojs_queue::{Error, Result};
use serde::{Deserialize, Serialize};

/// Settings of a `kafka://` adapter.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port]`.
    pub brokers: String,
    /// `declare` creates missing topics (`partitions`, `replication`) and
    /// uses existing ones as they are; `existing` creates nothing: a missing
    /// queue topic is an error naming it, a missing retry topic sends
    /// retries back to the queue topic, a missing dead topic makes
    /// dead-lettering fail (the record stays uncommitted).
    #[serde(default)]
    pub topology: Topology,
    /// Topic of a queue; `{queue}` is replaced by the OJS queue name.
    #[serde(default = "default_topic_template")]
    pub topic_template: String,
    /// Topic of delayed retries and scheduled jobs. Default
    /// `ojs.queue.{queue}.retry`, or `{topic_template}.retry` where
    /// `topic_template` is set.
    #[serde(default = "default_retry_topic_template")]
    pub retry_topic_template: String,
    /// Topic of dead letters. Default `ojs.dead.{queue}`, or
    /// `{topic_template}.dead` where `topic_template` is set.
    #[serde(default = "default_dead_topic_template")]
    pub dead_topic_template: String,
    /// Partitions of topics the adapter creates.
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Replication factor of topics the adapter creates.
    #[serde(default = "default_replication")]
    pub replication: i32,
    /// Largest message (body + headers), bytes; Kafka's broker default
    /// `message.max.bytes` is about 1 MiB.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// How long a publish may wait for delivery reports (librdkafka
    /// `message.timeout.ms`).
    #[serde(default = "default_publish_timeout_ms")]
    pub publish_timeout_ms: u64,
    /// Consumer group session timeout.
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Retry records held in memory until due before the retry topic's
    /// partitions are paused.
    #[serde(default = "default_max_delayed_in_memory")]
    pub max_delayed_in_memory: usize,
    /// How often a consumer commits the contiguous prefix of settled
    /// offsets (only when it advanced).
    #[serde(default = "default_commit_interval_ms")]
    pub commit_interval_ms: u64,
    /// Offsets of one partition delivered but not yet committable (an
    /// unsettled offset holds back every later one) before that partition
    /// is paused: bounds the offset tracker's memory whatever one stuck
    /// record does.
    #[serde(default = "default_max_uncommitted_per_partition")]
    pub max_uncommitted_per_partition: usize,
    /// Consumer group whose lag `depth` reports.
    #[serde(default = "default_depth_group")]
    pub depth_group: String,
    /// A file holding the SASL password (librdkafka `sasl.password`), read
    /// when the clients are created, so it need not sit in the config.
    #[serde(default)]
    pub sasl_password_file: Option<std::path::PathBuf>,
    /// Any librdkafka option, passed through (SASL, SSL, tuning), e.g.
    /// `security.protocol = "SASL_SSL"`. Applied to producer and consumers,
    /// after ours, so they win.
    #[serde(default)]
    pub librdkafka_options: BTreeMap<String, String>,
}

fn default_topic_template() -> String {
    "ojs.queue.{queue}".into()
}
fn default_retry_topic_template() -> String {
    "ojs.queue.{queue}.retry".into()
}
fn default_dead_topic_template() -> String {
    "ojs.dead.{queue}".into()
}
/// 3: parallelism for a small consumer group without many empty partitions.
fn default_partitions() -> i32 {
    3
}
/// 1: works on a single broker; production clusters should set 3.
fn default_replication() -> i32 {
    1
}
/// 1 MiB minus room for the record overhead under Kafka's 1,048,588 default.
fn default_max_message_bytes() -> usize {
    1024 * 1024
}
/// 30 s.
fn default_publish_timeout_ms() -> u64 {
    30_000
}
/// 10 s: notices a dead consumer quickly without flapping.
fn default_session_timeout_ms() -> u64 {
    10_000
}
/// 10,000 records.
fn default_max_delayed_in_memory() -> usize {
    10_000
}
/// 200 ms: commits stay close to acks without a commit per ack.
fn default_commit_interval_ms() -> u64 {
    200
}
/// 100,000 offsets: a few MiB per partition at worst.
fn default_max_uncommitted_per_partition() -> usize {
    100_000
}
fn default_depth_group() -> String {
    "ojs-bridge".into()
}

impl KafkaConfig {
    /// Defaults for a bootstrap server list.
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            topology: Topology::Declare,
            topic_template: default_topic_template(),
            retry_topic_template: default_retry_topic_template(),
            dead_topic_template: default_dead_topic_template(),
            partitions: default_partitions(),
            replication: default_replication(),
            max_message_bytes: default_max_message_bytes(),
            publish_timeout_ms: default_publish_timeout_ms(),
            session_timeout_ms: default_session_timeout_ms(),
            max_delayed_in_memory: default_max_delayed_in_memory(),
            commit_interval_ms: default_commit_interval_ms(),
            max_uncommitted_per_partition: default_max_uncommitted_per_partition(),
            depth_group: default_depth_group(),
            sasl_password_file: None,
            librdkafka_options: BTreeMap::new(),
        }
    }

    /// Parses `kafka://host:port[,host:port][?item=value…]`: items named
    /// like a setting (`topic_template`, `replication`, `topology`, …) set
    /// it; every other item is a librdkafka option (`security.protocol=ssl`).
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_url_with(url, Vec::new())
    }

    /// [`Self::from_url`], then `settings` over it (a config file's table,
    /// environment overrides). Names that are not settings are librdkafka
    /// options here too.
    pub fn from_url_with(url: &str, settings: Vec<(String, SettingValue)>) -> Result<Self> {
        let bad = |reason: String| Error::InvalidConfig {
            field: "url".into(),
            reason,
        };
        let (base, query) = settings::split_query(url)?;
        let brokers = base
            .strip_prefix("kafka://")
            .ok_or_else(|| {
                bad(format!(
                    "{:?} must start with kafka://",
                    ojs_core::redact::url(url)
                ))
            })?
            .trim_end_matches('/');
        if brokers.is_empty() {
            return Err(bad(format!(
                "{:?} names no broker (kafka://host:port)",
                ojs_core::redact::url(url)
            )));
        }
        let mut config = KafkaConfig::new(brokers);
        let known = settings::setting_names(&config);
        let mut ours = Vec::new();
        let items = query
            .into_iter()
            .map(|(k, v)| (k, SettingValue::Text(v)))
            .chain(settings);
        for (name, value) in items {
            if name == "librdkafka_options" {
                // Merged with the URL's options rather than replacing them.
                let options: BTreeMap<String, SettingValue> = match value {
                    SettingValue::Typed(serde_json::Value::Object(map)) => map
                        .into_iter()
                        .map(|(k, v)| (k, SettingValue::Typed(v)))
                        .collect(),
                    _ => {
                        return Err(Error::InvalidConfig {
                            field: name,
                            reason: "must be a table of librdkafka option = \"value\"".into(),
                        })
                    }
                };
                for (k, v) in options {
                    config.librdkafka_options.insert(k, v.into_text());
                }
            } else if known.contains(&name) {
                ours.push((name, value));
            } else {
                config.librdkafka_options.insert(name, value.into_text());
            }
        }
        let named = |field: &str| ours.iter().any(|(name, _)| name == field);
        let (retry_named, dead_named) =
            (named("retry_topic_template"), named("dead_topic_template"));
        config = settings::overlay(&config, ours)?;
        // A deployment's own topic template makes its retry and dead topics
        // its own too, unless they are named: with the defaults, two
        // deployments on one cluster would share `ojs.queue.{queue}.retry`
        // and `ojs.dead.{queue}` and receive each other's jobs.
        if config.custom_topics() {
            if !retry_named {
                config.retry_topic_template = format!("{}.retry", config.topic_template);
            }
            if !dead_named {
                config.dead_topic_template = format!("{}.dead", config.topic_template);
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Whether `queue` maps to one of the adapter's own retry or dead-letter
    /// topics (a job must not pick it as its destination).
    pub fn is_reserved(&self, queue: &str) -> bool {
        let topic = self.topic_of(queue);
        ojs_queue::settings::matches_template(&self.retry_topic_template, &topic)
            || ojs_queue::settings::matches_template(&self.dead_topic_template, &topic)
    }

    /// Checks the settings once, naming the field to change.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(Error::InvalidConfig {
                field: field.into(),
                reason,
            })
        };
        for (field, t) in [
            ("topic_template", &self.topic_template),
            ("retry_topic_template", &self.retry_topic_template),
            ("dead_topic_template", &self.dead_topic_template),
        ] {
            if !t.contains("{queue}") {
                return bad(field, format!("{t:?} must contain {{queue}}"));
            }
        }
        if self.topic_of("q") == self.retry_topic_of("q")
            || self.topic_of("q") == self.dead_topic_of("q")
        {
            return bad(
                "retry_topic_template",
                "queue, retry and dead topics must differ".into(),
            );
        }
        if self.partitions < 1 {
            return bad(
                "partitions",
                format!("must be at least 1, got {}", self.partitions),
            );
        }
        if self.replication < 1 {
            return bad(
                "replication",
                format!("must be at least 1, got {}", self.replication),
            );
        }
        self.check_librdkafka_options()?;
        if self.max_uncommitted_per_partition < 2 {
            return bad(
                "max_uncommitted_per_partition",
                format!(
                    "must be at least 2, got {}",
                    self.max_uncommitted_per_partition
                ),
            );
        }
        Ok(())
    }

    /// Asks librdkafka whether it knows each pass-through option and takes
    /// its value, without creating a client (so `check-config` refuses what
    /// `run` would). Every refused option is named; a name close to one of
    /// our settings gets a "did you mean" (a misspelt setting is otherwise
    /// taken for a librdkafka option). Values of secret-looking options are
    /// never repeated.
    pub fn check_librdkafka_options(&self) -> Result<()> {
        let ours = settings::setting_names(self);
        let mut refused = Vec::new();
        for (key, value) in &self.librdkafka_options {
            let mut c = rdkafka::ClientConfig::new();
            c.set(key, value);
            let Err(e) = c.create_native_config() else {
                continue;
            };
            let text = match &e {
                rdkafka::error::KafkaError::ClientConfig(_, description, _, _) => {
                    description.clone()
                }
                // A NUL byte in the name or value: CString refused it.
                other => format!("{key:?}: {other}"),
            };
            let text = if ojs_core::redact::is_secret_name(key) && !value.is_empty() {
                text.replace(value.as_str(), ojs_core::redact::MASK)
            } else {
                text
            };
            // librdkafka may name an alias (`acks` → `request.required.acks`):
            // say which option the user wrote.
            let text = if text.contains(&format!("{key:?}")) {
                text
            } else {
                format!("{key:?}: {text}")
            };
            refused.push(format!(
                "{text}{}",
                settings::suggestion(key, ours.iter().map(String::as_str))
            ));
        }
        if refused.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidConfig {
            field: "librdkafka_options".into(),
            reason: format!(
                "librdkafka refuses {}: {}",
                if refused.len() == 1 {
                    "an option"
                } else {
                    "options"
                },
                refused.join("; ")
            ),
        })
    }

    /// The files a client reads when it is created, by setting:
    /// `sasl_password_file` and librdkafka's own `*.location` options (a
    /// value of `probe` asks librdkafka to search, and names no file).
    pub fn files_read(&self) -> Vec<(String, std::path::PathBuf)> {
        let mut files: Vec<(String, std::path::PathBuf)> = self
            .sasl_password_file
            .iter()
            .map(|p| ("sasl_password_file".to_owned(), p.clone()))
            .collect();
        for (key, value) in &self.librdkafka_options {
            if key.ends_with(".location") && value != "probe" && !value.is_empty() {
                files.push((format!("librdkafka_options.{key}"), value.into()));
            }
        }
        files
    }

    /// librdkafka's `max.poll.interval.ms` as configured (its default is
    /// 300,000): a consumer that does not poll for that long leaves its group.
    pub fn max_poll_interval(&self) -> std::time::Duration {
        let ms = self
            .librdkafka_options
            .get("max.poll.interval.ms")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(300_000);
        std::time::Duration::from_millis(ms)
    }

    /// Whether the topics are named by a template of the user's, not the
    /// default one.
    pub fn custom_topics(&self) -> bool {
        self.topic_template != default_topic_template()
    }

    /// Topic of `queue`.
    pub fn topic_of(&self, queue: &str) -> String {
        self.topic_template.replace("{queue}", queue)
    }

    /// Retry topic of `queue`.
    pub fn retry_topic_of(&self, queue: &str) -> String {
        self.retry_topic_template.replace("{queue}", queue)
    }

    /// Dead-letter topic of `queue`.
    pub fn dead_topic_of(&self, queue: &str) -> String {
        self.dead_topic_template.replace("{queue}", queue)
    }

    pub(crate) fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms.max(1))
    }
}

impl std::fmt::Debug for KafkaConfig {
    // librdkafka options carry SASL passwords and key material: values of
    // secret-looking names are masked.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: BTreeMap<&str, &str> = self
            .librdkafka_options
            .iter()
            .map(|(k, v)| {
                let shown = if ojs_core::redact::is_secret_name(k) {
                    ojs_core::redact::MASK
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topology", &self.topology)
            .field("topic_template", &self.topic_template)
            .field("retry_topic_template", &self.retry_topic_template)
            .field("dead_topic_template", &self.dead_topic_template)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("publish_timeout_ms", &self.publish_timeout_ms)
            .field("session_timeout_ms", &self.session_timeout_ms)
            .field("max_delayed_in_memory", &self.max_delayed_in_memory)
            .field("commit_interval_ms", &self.commit_interval_ms)
            .field(
                "max_uncommitted_per_partition",
                &self.max_uncommitted_per_partition,
            )
            .field("depth_group", &self.depth_group)
            .field("sasl_password_file", &self.sasl_password_file)
            .field("librdkafka_options", &options)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deployment_s_own_topic_template_makes_its_retry_and_dead_topics_its_own() {
        let mine = KafkaConfig::from_url("kafka://k:9092?topic_template=tenant-a.{queue}")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mine.retry_topic_of("orders"), "tenant-a.orders.retry");
        assert_eq!(mine.dead_topic_of("orders"), "tenant-a.orders.dead");
        assert!(mine.custom_topics());
        // Named ones are kept; the defaults stay as they were.
        let named = KafkaConfig::from_url(
            "kafka://k:9092?topic_template=t.{queue}&retry_topic_template=r.{queue}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(named.retry_topic_of("q"), "r.q");
        assert_eq!(named.dead_topic_of("q"), "t.q.dead");
        let plain = KafkaConfig::from_url("kafka://k:9092").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plain.retry_topic_of("q"), "ojs.queue.q.retry");
        assert_eq!(plain.dead_topic_of("q"), "ojs.dead.q");
        assert!(!plain.custom_topics());
    }

    #[test]
    fn urls_and_templates() {
        let c =
            KafkaConfig::from_url("kafka://a:9092,b:9092?security.protocol=SASL_SSL&linger.ms=5")
                .unwrap();
        assert_eq!(c.brokers, "a:9092,b:9092");
        assert_eq!(c.librdkafka_options["security.protocol"], "SASL_SSL");
        assert_eq!(c.topic_of("mail"), "ojs.queue.mail");
        assert_eq!(c.retry_topic_of("mail"), "ojs.queue.mail.retry");
        assert_eq!(c.dead_topic_of("mail"), "ojs.dead.mail");
        assert!(KafkaConfig::from_url("kafka://").is_err());
        assert!(KafkaConfig::from_url("kafka://h:1?novalue").is_err());
        let c = KafkaConfig::from_url(
            "kafka://h:1?topic_template={queue}&replication=3&topology=existing&sasl.password=pw",
        )
        .unwrap();
        assert_eq!(
            c.topic_of("payment.PaymentService"),
            "payment.PaymentService"
        );
        assert_eq!(c.replication, 3);
        assert_eq!(c.topology, Topology::Existing);
        assert_eq!(c.librdkafka_options["sasl.password"], "pw");
        assert!(!c.librdkafka_options.contains_key("replication"));
        assert!(!format!("{c:?}").contains("pw"), "{c:?}");
        match KafkaConfig::from_url("kafka://h:1?replication=many") {
            Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "replication"),
            other => panic!("{other:?}"),
        }
        let mut c = KafkaConfig::new("h:1");
        c.topic_template = "fixed".into();
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "topic_template")
        );
    }

    fn refusal(url: &str) -> String {
        match KafkaConfig::from_url(url) {
            Err(Error::InvalidConfig { field, reason }) => {
                assert_eq!(field, "librdkafka_options", "{reason}");
                reason
            }
            other => panic!("{url}: expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn librdkafka_refuses_unknown_options_and_bad_values_before_any_client_exists() {
        let reason = refusal("kafka://h:1?topic_templat={queue}");
        assert!(
            reason.contains("topic_templat") && reason.contains("did you mean `topic_template`?"),
            "{reason}"
        );
        let reason = refusal("kafka://h:1?acks=banana&linger.ms=5&socket.timeout.mz=1");
        assert!(
            reason.contains("acks") && reason.contains("socket.timeout.mz"),
            "every refused option is named: {reason}"
        );
        assert!(!reason.contains("linger.ms"), "{reason}");
        let reason = refusal("kafka://h:1?enable.idempotence=perhaps");
        assert!(reason.contains("enable.idempotence"), "{reason}");
        assert!(KafkaConfig::from_url(
            "kafka://h:1?security.protocol=SASL_SSL&sasl.mechanisms=PLAIN"
        )
        .is_ok());
    }
}
