//! SQS adapter settings (serde data; the runtime lives in `lib.rs`).

use ojs_queue::settings::{self, SettingValue, Topology};
use ojs_queue::{Error, Result};
use serde::{Deserialize, Serialize};

/// SQS's largest message: body plus attributes (1 MiB since 2025).
pub const SQS_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// Entries per SendMessageBatch / DeleteMessageBatch (SQS API limit).
pub const SQS_BATCH_LIMIT: usize = 10;
/// Message attributes per message (SQS API limit).
pub const SQS_MAX_ATTRIBUTES: usize = 10;
/// Longest long-poll wait (SQS API limit).
pub const SQS_MAX_WAIT_SECS: u64 = 20;
/// Longest `DelaySeconds` (SQS API limit: 15 minutes).
pub const SQS_MAX_DELAY_SECS: u64 = 900;
/// Longest visibility timeout (SQS API limit: 12 hours).
pub const SQS_MAX_VISIBILITY_SECS: u64 = 43_200;

/// Settings of an `sqs://` adapter. Credentials come from the standard AWS
/// chain (environment, profile, IMDS/ECS roles).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqsConfig {
    /// AWS region, e.g. `us-east-1`.
    pub region: String,
    /// Endpoint override (an SQS-compatible server, LocalStack, moto).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Prepended to every queue name.
    #[serde(default)]
    pub prefix: String,
    /// `declare` (default): an existing queue is used as it is (GetQueueUrl;
    /// its own RedrivePolicy and DLQ kept), a missing one is created with a
    /// DLQ and a RedrivePolicy. `existing`: nothing is created; a missing
    /// queue is an error naming it, and dead letters go to the queue's own
    /// redrive target, else to `dead_letter_queue_template`'s queue if it
    /// exists, else dead-lettering fails (the message stays in the queue).
    #[serde(default)]
    pub topology: Topology,
    /// Dead-letter queue of a queue; `{queue}` is the queue's SQS name
    /// (prefix applied, `.` as `_`, without `.fifo`).
    #[serde(default = "default_dead_letter_queue_template")]
    pub dead_letter_queue_template: String,
    /// FIFO queues (`.fifo`; message group = queue, dedup id = message id).
    #[serde(default)]
    pub fifo: bool,
    /// Receives before SQS moves a message to the DLQ (RedrivePolicy).
    #[serde(default = "default_max_receive_count")]
    pub max_receive_count: u32,
    /// Largest encoded message (base64 body + attributes), bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Attempts at a batch entry SQS reported failed before giving up on it.
    #[serde(default = "default_send_attempts")]
    pub send_attempts: u32,
    /// Longest one SQS call (one HTTP attempt) may take, seconds; a receive
    /// gets its long-poll wait on top. A hung call fails as retryable
    /// instead of stalling the queue's acks.
    #[serde(default = "default_call_timeout_secs")]
    pub call_timeout_secs: u64,
}

fn default_dead_letter_queue_template() -> String {
    "{queue}_dlq".into()
}

/// 10: SQS's console default for redrive.
fn default_max_receive_count() -> u32 {
    10
}
fn default_max_message_bytes() -> usize {
    SQS_MAX_MESSAGE_BYTES
}
/// 3: transient entry failures (throttling) clear within a few tries.
fn default_send_attempts() -> u32 {
    3
}
/// 10 s: an SQS call answers in milliseconds; ten seconds is an outage.
fn default_call_timeout_secs() -> u64 {
    10
}

impl SqsConfig {
    /// Defaults for a region.
    pub fn new(region: impl Into<String>) -> Self {
        SqsConfig {
            region: region.into(),
            endpoint: None,
            prefix: String::new(),
            topology: Topology::Declare,
            dead_letter_queue_template: default_dead_letter_queue_template(),
            fifo: false,
            max_receive_count: default_max_receive_count(),
            max_message_bytes: default_max_message_bytes(),
            send_attempts: default_send_attempts(),
            call_timeout_secs: default_call_timeout_secs(),
        }
    }

    /// Parses `sqs://REGION[?setting=value…]`: every query item is a setting
    /// (`endpoint`, `prefix`, `fifo`, `topology`, `max_receive_count`, …);
    /// an unknown one is an error naming the known ones.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_url_with(url, Vec::new())
    }

    /// [`Self::from_url`], then `settings` over it (a config file's table,
    /// environment overrides).
    pub fn from_url_with(url: &str, settings: Vec<(String, SettingValue)>) -> Result<Self> {
        let bad = |reason: String| Error::InvalidConfig {
            field: "url".into(),
            reason,
        };
        let (base, query) = settings::split_query(url)?;
        let region = base
            .strip_prefix("sqs://")
            .ok_or_else(|| {
                bad(format!(
                    "{:?} must start with sqs://",
                    ojs_core::redact::url(url)
                ))
            })?
            .trim_end_matches('/');
        if region.is_empty() {
            return Err(bad(format!(
                "{:?} names no region (sqs://us-east-1)",
                ojs_core::redact::url(url)
            )));
        }
        let c = SqsConfig::new(region);
        let items = query
            .into_iter()
            .map(|(k, v)| (k, SettingValue::Text(v)))
            .chain(settings);
        let c = settings::overlay(&c, items)?;
        c.validate()?;
        Ok(c)
    }

    /// Whether `queue` maps to one of the adapter's own dead-letter queues (a
    /// job must not pick it as its destination).
    pub fn is_reserved(&self, queue: &str) -> bool {
        let name = self.queue_name(queue);
        let name = name.strip_suffix(".fifo").unwrap_or(&name);
        let template = format!("{}{}", self.prefix, self.dead_letter_queue_template);
        ojs_queue::settings::matches_template(&template, name)
    }

    /// [`Self::call_timeout_secs`] as a duration.
    pub fn call_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.call_timeout_secs.max(1))
    }

    /// Checks the settings once, naming the field to change.
    pub fn validate(&self) -> Result<()> {
        if self.max_message_bytes > SQS_MAX_MESSAGE_BYTES {
            return Err(Error::InvalidConfig {
                field: "max_message_bytes".into(),
                reason: format!("SQS accepts at most {SQS_MAX_MESSAGE_BYTES} bytes"),
            });
        }
        if !self.dead_letter_queue_template.contains("{queue}") {
            return Err(Error::InvalidConfig {
                field: "dead_letter_queue_template".into(),
                reason: format!(
                    "{:?} must contain {{queue}}",
                    self.dead_letter_queue_template
                ),
            });
        }
        if self.dead_letter_queue_template == "{queue}" {
            return Err(Error::InvalidConfig {
                field: "dead_letter_queue_template".into(),
                reason: "a queue and its dead-letter queue must differ".into(),
            });
        }
        if !(1..=1000).contains(&self.max_receive_count) {
            return Err(Error::InvalidConfig {
                field: "max_receive_count".into(),
                reason: "must be 1..=1000 (SQS redrive limit)".into(),
            });
        }
        Ok(())
    }

    /// SQS queue name of an OJS queue: prefix + name with `.` as `_` (OJS
    /// names cannot contain `_`, so the mapping is one-to-one).
    pub fn queue_name(&self, queue: &str) -> String {
        let base = format!("{}{}", self.prefix, queue.replace('.', "_"));
        if self.fifo {
            format!("{base}.fifo")
        } else {
            base
        }
    }

    /// Its dead-letter queue: `dead_letter_queue_template` (`{name}_dlq`).
    pub fn dead_letter_queue_name(&self, queue: &str) -> String {
        let name = format!("{}{}", self.prefix, queue.replace('.', "_"));
        let base = self.dead_letter_queue_template.replace("{queue}", &name);
        if self.fifo {
            format!("{base}.fifo")
        } else {
            base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_names() {
        let c = SqsConfig::from_url("sqs://us-east-1?endpoint=http://127.0.0.1:4566&prefix=t-")
            .unwrap();
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:4566"));
        assert_eq!(c.queue_name("media.high"), "t-media_high");
        assert_eq!(c.dead_letter_queue_name("media.high"), "t-media_high_dlq");
        let f = SqsConfig::from_url("sqs://eu-west-1?fifo=true").unwrap();
        assert_eq!(f.queue_name("q"), "q.fifo");
        assert!(SqsConfig::from_url("sqs://").is_err());
        assert!(SqsConfig::from_url("sqs://r?bogus=1").is_err());
        assert!(SqsConfig::from_url("sqs://r?max_receive_count=0").is_err());
        let e =
            SqsConfig::from_url("sqs://r?topology=existing&dead_letter_queue_template=dlq-{queue}")
                .unwrap();
        assert_eq!(e.topology, Topology::Existing);
        assert_eq!(e.dead_letter_queue_name("a.b"), "dlq-a_b");
        match SqsConfig::from_url("sqs://r?bogus=1") {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(reason.contains("endpoint"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
}
