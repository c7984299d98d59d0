//! RabbitMQ adapter settings (serde data; the runtime lives in `lib.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use ojs_queue::settings::{self, SettingValue, Topology};
use ojs_queue::{Error, Result};
use serde::{Deserialize, Serialize};

/// Query items of an AMQP URL that belong to the AMQP client (lapin), not to
/// the adapter.
pub const CLIENT_URL_OPTIONS: &[&str] = &[
    "heartbeat",
    "connection_timeout",
    "channel_max",
    "frame_max",
    "auth_mechanism",
];

/// Settings of an `amqp://` / `amqps://` adapter.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitConfig {
    /// `amqp://user:pass@host:port/vhost` or `amqps://…` (vhost URL-encoded,
    /// `%2f` for `/`).
    pub url: String,
    /// `declare` (default) declares what is missing and uses what exists as
    /// it is (a queue declared elsewhere with other arguments is used via a
    /// passive declare, with a warning); `existing` declares nothing at all
    /// (no exchange, queue or binding): a missing queue is an error naming it.
    #[serde(default)]
    pub topology: Topology,
    /// Queue of an OJS queue; `{queue}` is the OJS queue name. `{queue}`
    /// alone reads and writes queues named like the OJS queue (`orders`).
    #[serde(default = "default_queue_template")]
    pub queue_template: String,
    /// Exchange messages are published to, with routing key
    /// `routing_key_template`. `""` is the default exchange: it routes
    /// straight to the queue named by `queue_template` (no binding needed).
    #[serde(default = "default_exchange")]
    pub exchange: String,
    /// Routing key for `exchange` (ignored for the default exchange, whose
    /// routing key is the queue name).
    #[serde(default = "default_routing_key_template")]
    pub routing_key_template: String,
    /// Exchange dead letters are published to (routing key = OJS queue).
    /// Default with `topology = "declare"`: `ojs.exchange.dlx`, declared.
    /// Default with `existing`: none — a dead letter is rejected without
    /// requeue, so RabbitMQ routes it by the queue's own
    /// `x-dead-letter-exchange` (and discards it when the queue has none).
    #[serde(default)]
    pub dead_letter_exchange: Option<String>,
    /// Queue dead letters land in (declared and bound with `declare`; read by
    /// `tail --dead-letters`).
    #[serde(default = "default_dead_letter_queue_template")]
    pub dead_letter_queue_template: String,
    /// Exchange of delayed retries (`declare` only; `existing` holds a
    /// delayed retry unacknowledged for its delay, then publishes it again).
    #[serde(default = "default_retry_exchange")]
    pub retry_exchange: String,
    /// Per-delay TTL queue of delayed retries; `{queue}` and `{delay_ms}`.
    #[serde(default = "default_retry_queue_template")]
    pub retry_queue_template: String,
    /// PEM file of the CA(s) that signed the broker's certificate
    /// (`amqps://`). Default: the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with `key_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM (PKCS#8) private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// A file holding the password of the URL's user (read at each
    /// connect), so it need not sit in the config or the process list.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Unacknowledged messages a consumer holds at once (`basic.qos`).
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// Declare queues as quorum queues (replicated; no per-message priority).
    #[serde(default)]
    pub quorum_queues: bool,
    /// `x-max-priority` of classic queues; `None` disables priorities.
    #[serde(default = "default_max_priority")]
    pub max_priority: Option<u8>,
    /// Largest message (body + headers) accepted, bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// How long a publish may spend waiting for confirms and reconnecting
    /// before the unconfirmed messages are reported as failed.
    #[serde(default = "default_publish_timeout_secs")]
    pub publish_timeout_secs: u64,
    /// Upper bound of the reconnect backoff (docs/design.md §4: min(2^(n−1), 60) s).
    #[serde(default = "default_max_backoff_secs")]
    pub max_backoff_secs: u64,
    /// Idle retry queues are deleted by the broker after this long.
    #[serde(default = "default_retry_queue_expiry_secs")]
    pub retry_queue_expiry_secs: u64,
    /// grpcq interop, consuming: OJS queue → grpcq exchanges bound to it.
    /// grpcq publishers send to exchange = topic with routing key = action;
    /// an entry `"payment.PaymentService"` binds every action (a topic
    /// exchange is declared when none exists), `"payment.PaymentService:Pay"`
    /// one action (works on direct and topic exchanges alike).
    #[serde(default)]
    pub grpcq_bindings: BTreeMap<String, Vec<String>>,
    /// grpcq interop, publishing: grpcq calls (`application/grpcq+proto`)
    /// go to exchange = topic, routing key = action, as grpcq publishers
    /// send them, instead of to an OJS queue.
    #[serde(default)]
    pub grpcq_exchanges: bool,
}

/// One grpcq binding: exchange (= grpcq topic) and routing key (= action,
/// `#` for all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcqBinding {
    /// Exchange name, the grpcq topic.
    pub exchange: String,
    /// Routing key: an action, or `#` for every action.
    pub routing_key: String,
}

impl GrpcqBinding {
    /// Parses `TOPIC` or `TOPIC:ACTION`.
    pub fn parse(text: &str) -> Result<GrpcqBinding> {
        let (exchange, routing_key) = match text.split_once(':') {
            Some((e, a)) => (e, a),
            None => (text, "#"),
        };
        if exchange.is_empty() || routing_key.is_empty() {
            return Err(Error::InvalidConfig {
                field: "grpcq_bindings".into(),
                reason: format!("{text:?} must be TOPIC or TOPIC:ACTION"),
            });
        }
        Ok(GrpcqBinding {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }
}

fn default_queue_template() -> String {
    "ojs.queue.{queue}".into()
}
fn default_exchange() -> String {
    DIRECT_EXCHANGE.into()
}
fn default_routing_key_template() -> String {
    "{queue}".into()
}
fn default_dead_letter_queue_template() -> String {
    "ojs.queue.dlx.{queue}".into()
}
fn default_retry_exchange() -> String {
    RETRY_EXCHANGE.into()
}
fn default_retry_queue_template() -> String {
    "ojs.queue.retry.{queue}.{delay_ms}".into()
}

/// 100: a few batches in flight without hoarding work from other consumers.
fn default_prefetch() -> u16 {
    100
}

/// 10: RabbitMQ recommends at most 10 priority levels for classic queues.
fn default_max_priority() -> Option<u8> {
    Some(10)
}

/// 16 MiB: far above envelope sizes; RabbitMQ's own cap (128 MiB) is not a
/// size anyone should send through a queue.
fn default_max_message_bytes() -> usize {
    16 * 1024 * 1024
}

/// 30 s.
fn default_publish_timeout_secs() -> u64 {
    30
}

/// 60 s (docs/design.md §4).
fn default_max_backoff_secs() -> u64 {
    60
}

/// 1 h.
fn default_retry_queue_expiry_secs() -> u64 {
    3600
}

impl RabbitConfig {
    /// Defaults for a broker URL.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitConfig {
            url: url.into(),
            topology: Topology::Declare,
            queue_template: default_queue_template(),
            exchange: default_exchange(),
            routing_key_template: default_routing_key_template(),
            dead_letter_exchange: None,
            dead_letter_queue_template: default_dead_letter_queue_template(),
            retry_exchange: default_retry_exchange(),
            retry_queue_template: default_retry_queue_template(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            password_file: None,
            prefetch: default_prefetch(),
            quorum_queues: false,
            max_priority: default_max_priority(),
            max_message_bytes: default_max_message_bytes(),
            publish_timeout_secs: default_publish_timeout_secs(),
            max_backoff_secs: default_max_backoff_secs(),
            retry_queue_expiry_secs: default_retry_queue_expiry_secs(),
            grpcq_bindings: BTreeMap::new(),
            grpcq_exchanges: false,
        }
    }

    /// Parses an `amqp://` / `amqps://` URL. Query items naming a setting
    /// (`queue_template`, `exchange`, `topology`, `prefetch`, …) set it;
    /// `grpcq_bind.QUEUE=TOPIC[:ACTION][,…]` (repeatable) adds grpcq
    /// bindings; the AMQP client's own items ([`CLIENT_URL_OPTIONS`]) stay in
    /// the URL; anything else is an error naming the known items.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_url_with(url, Vec::new())
    }

    /// [`Self::from_url`], then `settings` over it (a config file's table,
    /// environment overrides).
    pub fn from_url_with(url: &str, settings: Vec<(String, SettingValue)>) -> Result<Self> {
        let (base, query) = settings::split_query(url)?;
        let mut config = RabbitConfig::new(base);
        let known = settings::setting_names(&config);
        let mut client = Vec::new();
        let mut ours = Vec::new();
        for (key, value) in query {
            if let Some(queue) = key.strip_prefix("grpcq_bind.") {
                if queue.is_empty() {
                    return Err(Error::InvalidConfig {
                        field: "url".into(),
                        reason: format!("{key:?}: grpcq_bind.QUEUE=TOPIC[:ACTION] names no queue"),
                    });
                }
                let entries = config.grpcq_bindings.entry(queue.to_owned()).or_default();
                for binding in value.split(',').filter(|b| !b.is_empty()) {
                    GrpcqBinding::parse(binding)?;
                    entries.push(binding.to_owned());
                }
            } else if CLIENT_URL_OPTIONS.contains(&key.as_str()) {
                client.push(format!("{key}={value}"));
            } else if known.contains(&key) && key != "url" && key != "grpcq_bindings" {
                ours.push((key, SettingValue::Text(value)));
            } else {
                return Err(Error::InvalidConfig {
                    field: "url".into(),
                    reason: format!(
                        "unknown query item {key:?}{}; known: {}, grpcq_bind.QUEUE, and the AMQP client's {}",
                        settings::suggestion(
                            &key,
                            known
                                .iter()
                                .map(String::as_str)
                                .chain(CLIENT_URL_OPTIONS.iter().copied())
                        ),
                        known
                            .iter()
                            .filter(|k| *k != "url" && *k != "grpcq_bindings")
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", "),
                        CLIENT_URL_OPTIONS.join(", ")
                    ),
                });
            }
        }
        if !client.is_empty() {
            config.url = format!("{base}?{}", client.join("&"));
        }
        let named: Vec<String> = ours
            .iter()
            .chain(settings.iter())
            .map(|(name, _)| name.clone())
            .collect();
        let named = |field: &str| named.iter().any(|n| n == field);
        let (routing_named, dead_named, retry_named) = (
            named("routing_key_template"),
            named("dead_letter_queue_template"),
            named("retry_queue_template"),
        );
        config = settings::overlay(&config, ours.into_iter().chain(settings))?;
        // A deployment's own queue template makes its routing keys, its
        // dead-letter queues and its retry queues its own too, unless they
        // are named: with the defaults, two deployments on one broker would
        // bind their queues to one exchange with the same key (each getting
        // the other's jobs) and share `ojs.queue.dlx.{queue}` and the retry
        // queues.
        if config.custom_queues() {
            if !routing_named {
                config.routing_key_template = config.queue_template.clone();
            }
            if !dead_named {
                config.dead_letter_queue_template = format!("{}.dlx", config.queue_template);
            }
            if !retry_named {
                config.retry_queue_template =
                    format!("{}.retry.{{delay_ms}}", config.queue_template);
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// The files the adapter reads when it connects, by setting, so that
    /// `check-config` can find one that is missing before anything connects.
    pub fn files_read(&self) -> Vec<(&'static str, &std::path::Path)> {
        [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
            ("password_file", &self.password_file),
        ]
        .into_iter()
        .filter_map(|(setting, path)| Some((setting, path.as_deref()?)))
        .collect()
    }

    /// The grpcq bindings of `queue`.
    pub fn grpcq_bindings_of(&self, queue: &str) -> Vec<GrpcqBinding> {
        self.grpcq_bindings
            .get(queue)
            .into_iter()
            .flatten()
            .filter_map(|b| GrpcqBinding::parse(b).ok())
            .collect()
    }

    /// Whether `queue` maps to one of the adapter's own dead-letter or retry
    /// queues (a job must not pick it as its destination).
    pub fn is_reserved(&self, queue: &str) -> bool {
        let name = self.queue_name_of(queue);
        ojs_queue::settings::matches_template(&self.dead_letter_queue_template, &name)
            || ojs_queue::settings::matches_template(&self.retry_queue_template, &name)
    }

    /// Checks the settings once, naming the field to change.
    pub fn validate(&self) -> Result<()> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(Error::InvalidConfig {
                field: "url".into(),
                reason: format!(
                    "{:?} must start with amqp:// or amqps://",
                    ojs_core::redact::url(&self.url)
                ),
            });
        }
        for (field, template, vars) in [
            ("queue_template", &self.queue_template, &["{queue}"][..]),
            (
                "dead_letter_queue_template",
                &self.dead_letter_queue_template,
                &["{queue}"][..],
            ),
            (
                "retry_queue_template",
                &self.retry_queue_template,
                &["{queue}", "{delay_ms}"][..],
            ),
        ] {
            if let Some(missing) = vars.iter().find(|v| !template.contains(**v)) {
                return Err(Error::InvalidConfig {
                    field: field.into(),
                    reason: format!("{template:?} must contain {missing}"),
                });
            }
        }
        if self.queue_name_of("q") == self.dead_letter_queue_of("q") {
            return Err(Error::InvalidConfig {
                field: "dead_letter_queue_template".into(),
                reason: "a queue and its dead-letter queue must differ".into(),
            });
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(Error::InvalidConfig {
                field: if self.cert_file.is_some() {
                    "key_file"
                } else {
                    "cert_file"
                }
                .into(),
                reason: "mutual TLS needs both cert_file and key_file".into(),
            });
        }
        if self.prefetch == 0 {
            return Err(Error::InvalidConfig {
                field: "prefetch".into(),
                reason: "0 means unlimited in AMQP; give a bound such as 100".into(),
            });
        }
        if self.quorum_queues && self.max_priority.is_some() {
            return Err(Error::InvalidConfig {
                field: "max_priority".into(),
                reason:
                    "quorum queues do not take x-max-priority; set it to null or use classic queues"
                        .into(),
            });
        }
        for (queue, bindings) in &self.grpcq_bindings {
            for b in bindings {
                GrpcqBinding::parse(b).map_err(|_| Error::InvalidConfig {
                    field: format!("grpcq_bindings.{queue}"),
                    reason: format!("{b:?} must be TOPIC or TOPIC:ACTION"),
                })?;
            }
        }
        if self.max_priority == Some(0) {
            return Err(Error::InvalidConfig {
                field: "max_priority".into(),
                reason: "must be 1..=255, or null to disable priorities".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn publish_timeout(&self) -> Duration {
        Duration::from_secs(self.publish_timeout_secs.max(1))
    }

    /// The URL to connect with: `url`, with the password from
    /// `password_file` when one is set.
    pub fn connect_url(&self) -> Result<String> {
        let Some(path) = &self.password_file else {
            return Ok(self.url.clone());
        };
        let password = std::fs::read_to_string(path).map_err(|e| Error::InvalidConfig {
            field: "password_file".into(),
            reason: format!("cannot read {}: {e}", path.display()),
        })?;
        let password = password.trim_end_matches(['\r', '\n']);
        let (scheme, rest) = self.url.split_once("://").unwrap_or(("amqp", &self.url));
        let (userinfo, host) = match rest.split_once('@') {
            Some((u, h)) if !u.contains('/') => (u, h),
            _ => {
                return Err(Error::InvalidConfig {
                    field: "password_file".into(),
                    reason: "the URL names no user (amqp://USER@host/vhost)".into(),
                })
            }
        };
        let user = userinfo.split(':').next().unwrap_or(userinfo);
        Ok(format!(
            "{scheme}://{user}:{}@{host}",
            ojs_queue::settings::percent_encode(password)
        ))
    }

    /// Whether `queue_template` is this deployment's own (not the default)
    /// and the adapter declares its topology: routing keys on the shared
    /// exchanges are then the queues' names. With `topology = "existing"`
    /// the bindings someone else made decide, and nothing is derived.
    pub fn custom_queues(&self) -> bool {
        self.topology == Topology::Declare && self.queue_template != default_queue_template()
    }

    /// The routing key of a queue's dead letters on the dead-letter
    /// exchange: the OJS queue, or with a queue template of one's own the
    /// dead-letter queue's name.
    pub fn dead_letter_routing_key_of(&self, queue: &str) -> String {
        if self.custom_queues() {
            self.dead_letter_queue_of(queue)
        } else {
            queue.to_owned()
        }
    }

    /// The routing key of a queue's retries delayed by `delay_ms` on the
    /// retry exchange: `{queue}.{delay_ms}`, or with a queue template of
    /// one's own the retry queue's name.
    pub fn retry_routing_key_of(&self, queue: &str, delay_ms: u64) -> String {
        if self.custom_queues() {
            self.retry_queue_of(queue, delay_ms)
        } else {
            format!("{queue}.{delay_ms}")
        }
    }

    /// The RabbitMQ queue of an OJS queue.
    pub fn queue_name_of(&self, queue: &str) -> String {
        self.queue_template.replace("{queue}", queue)
    }

    /// The dead-letter queue of an OJS queue.
    pub fn dead_letter_queue_of(&self, queue: &str) -> String {
        self.dead_letter_queue_template.replace("{queue}", queue)
    }

    /// The TTL queue of an OJS queue's retries delayed by `delay_ms`.
    pub fn retry_queue_of(&self, queue: &str, delay_ms: u64) -> String {
        self.retry_queue_template
            .replace("{queue}", queue)
            .replace("{delay_ms}", &delay_ms.to_string())
    }

    /// Exchange and routing key a message for `queue` is published with.
    pub fn publish_route_of(&self, queue: &str) -> (String, String) {
        if self.exchange.is_empty() {
            (String::new(), self.queue_name_of(queue))
        } else {
            (
                self.exchange.clone(),
                self.routing_key_template.replace("{queue}", queue),
            )
        }
    }

    /// The exchange dead letters are published to, if any (see
    /// `dead_letter_exchange`).
    pub fn dead_letter_exchange_in_force(&self) -> Option<&str> {
        match (&self.dead_letter_exchange, self.topology) {
            (Some(x), _) => Some(x),
            (None, Topology::Declare) => Some(DLX_EXCHANGE),
            (None, Topology::Existing) => None,
        }
    }
}

impl std::fmt::Debug for RabbitConfig {
    // The URL carries the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &ojs_core::redact::url(&self.url))
            .field("topology", &self.topology)
            .field("queue_template", &self.queue_template)
            .field("exchange", &self.exchange)
            .field("routing_key_template", &self.routing_key_template)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field(
                "dead_letter_queue_template",
                &self.dead_letter_queue_template,
            )
            .field("retry_exchange", &self.retry_exchange)
            .field("retry_queue_template", &self.retry_queue_template)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("password_file", &self.password_file)
            .field("prefetch", &self.prefetch)
            .field("quorum_queues", &self.quorum_queues)
            .field("max_priority", &self.max_priority)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("publish_timeout_secs", &self.publish_timeout_secs)
            .field("max_backoff_secs", &self.max_backoff_secs)
            .field("retry_queue_expiry_secs", &self.retry_queue_expiry_secs)
            .field("grpcq_bindings", &self.grpcq_bindings)
            .field("grpcq_exchanges", &self.grpcq_exchanges)
            .finish()
    }
}

/// Exchange that routes jobs to their queue (routing key = OJS queue).
pub const DIRECT_EXCHANGE: &str = "ojs.exchange.direct";
/// Exchange for dead letters (routing key = OJS queue).
pub const DLX_EXCHANGE: &str = "ojs.exchange.dlx";
/// Exchange for delayed retries (routing key = `{queue}.{delay_ms}`).
pub const RETRY_EXCHANGE: &str = "ojs.exchange.retry";

/// `ojs.queue.{queue}` (the default `queue_template`).
pub fn queue_name(queue: &str) -> String {
    format!("ojs.queue.{queue}")
}

/// `ojs.queue.dlx.{queue}`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("ojs.queue.dlx.{queue}")
}

/// `ojs.queue.retry.{queue}.{delay_ms}`.
pub fn retry_queue_name(queue: &str, delay_ms: u64) -> String {
    format!("ojs.queue.retry.{queue}.{delay_ms}")
}

/// Rounds a delay *up* to two significant digits (1234 ms → 1300 ms), so a
/// message never comes back early and jittered backoff creates a bounded
/// number of retry queues (about 90 per decade) instead of one per delay.
pub fn bucket_delay_ms(delay: Duration) -> u64 {
    let ms = delay.as_millis().max(1) as u64;
    let mut scale = 1;
    while ms / scale >= 100 {
        scale *= 10;
    }
    ms.div_ceil(scale) * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_two_significant_digits() {
        assert_eq!(bucket_delay_ms(Duration::from_millis(1)), 1);
        assert_eq!(bucket_delay_ms(Duration::from_millis(99)), 99);
        assert_eq!(bucket_delay_ms(Duration::from_millis(1234)), 1300);
        assert_eq!(bucket_delay_ms(Duration::from_millis(1200)), 1200);
        assert_eq!(bucket_delay_ms(Duration::from_secs(300)), 300_000);
        assert_eq!(bucket_delay_ms(Duration::ZERO), 1);
        for ms in [1u64, 17, 999, 1001, 65_432, 299_999] {
            assert!(bucket_delay_ms(Duration::from_millis(ms)) >= ms);
        }
    }

    #[test]
    fn bad_settings_name_their_field() {
        let mut c = RabbitConfig::new("http://x");
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "url"));
        c.url = "amqp://localhost".into();
        c.prefetch = 0;
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "prefetch")
        );
        c.prefetch = 10;
        c.quorum_queues = true;
        assert!(
            matches!(c.validate(), Err(Error::InvalidConfig { field, .. }) if field == "max_priority")
        );
        c.max_priority = None;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn urls_carry_grpcq_interop_and_leave_client_options_alone() {
        let c = RabbitConfig::from_url(
            "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10&grpcq_bind.calls=payment.PaymentService,email.Mailer:Send&grpcq_exchanges=true&grpcq_bind.calls=a.B",
        )
        .unwrap();
        assert_eq!(c.url, "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10");
        assert!(c.grpcq_exchanges);
        assert_eq!(
            c.grpcq_bindings_of("calls"),
            vec![
                GrpcqBinding {
                    exchange: "payment.PaymentService".into(),
                    routing_key: "#".into()
                },
                GrpcqBinding {
                    exchange: "email.Mailer".into(),
                    routing_key: "Send".into()
                },
                GrpcqBinding {
                    exchange: "a.B".into(),
                    routing_key: "#".into()
                },
            ]
        );
        assert!(RabbitConfig::from_url("amqp://h/%2f?grpcq_bind.q=:x").is_err());
        match RabbitConfig::from_url("amqp://h/%2f?bogus=1") {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(
                    reason.contains("queue_template") && reason.contains("heartbeat"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        let c = RabbitConfig::from_url(
            "amqp://u:pw@h/%2f?queue_template={queue}&exchange=&topology=existing&prefetch=7",
        )
        .unwrap();
        assert_eq!(c.queue_name_of("orders"), "orders");
        assert_eq!(c.publish_route_of("orders"), ("".into(), "orders".into()));
        assert_eq!(c.topology, Topology::Existing);
        assert_eq!(c.prefetch, 7);
        assert_eq!(c.dead_letter_exchange_in_force(), None);
        assert!(!format!("{c:?}").contains("pw"));
        assert!(RabbitConfig::from_url("amqp://h/%2f?grpcq_exchanges=maybe").is_err());
        assert_eq!(
            RabbitConfig::from_url("amqp://h/%2f").unwrap().url,
            "amqp://h/%2f"
        );
    }

    #[test]
    fn a_queue_template_of_ones_own_makes_keys_and_queues_ones_own() {
        let c = RabbitConfig::from_url("amqp://h/%2f?queue_template=tenant.{queue}").unwrap();
        assert_eq!(c.publish_route_of("orders").1, "tenant.orders");
        assert_eq!(c.dead_letter_queue_of("orders"), "tenant.orders.dlx");
        assert_eq!(c.dead_letter_routing_key_of("orders"), "tenant.orders.dlx");
        assert_eq!(c.retry_queue_of("orders", 1000), "tenant.orders.retry.1000");
        assert_eq!(
            c.retry_routing_key_of("orders", 1000),
            "tenant.orders.retry.1000"
        );
        // Named settings stay as named; the defaults stay as they were.
        let named = RabbitConfig::from_url(
            "amqp://h/%2f?queue_template=tenant.{queue}&dead_letter_queue_template=dlq.{queue}",
        )
        .unwrap();
        assert_eq!(named.dead_letter_queue_of("orders"), "dlq.orders");
        let plain = RabbitConfig::from_url("amqp://h/%2f").unwrap();
        assert_eq!(plain.publish_route_of("orders").1, "orders");
        assert_eq!(plain.dead_letter_routing_key_of("orders"), "orders");
        assert_eq!(plain.retry_routing_key_of("orders", 1000), "orders.1000");
        // Someone else's topology: their bindings decide.
        let existing =
            RabbitConfig::from_url("amqp://h/%2f?queue_template=team.{queue}&topology=existing")
                .unwrap();
        assert_eq!(existing.publish_route_of("orders").1, "orders");
    }
}
