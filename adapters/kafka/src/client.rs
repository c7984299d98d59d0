//! The librdkafka clients: their configuration, the producer, and the
//! errors they report as ours.

use std::sync::Arc;
use std::time::Duration;

use ojs_queue::settings::Topology;
use ojs_queue::{BrokerErrorKind, Error, Result};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::ThreadedProducer;

use crate::{ClientLog, Inner, KafkaConfig, Reports};

/// The adapter's producer: librdkafka's polling thread counts delivery
/// reports into the publishes they belong to ([`reports`]).
pub(crate) type Producer = ThreadedProducer<Reports>;

/// How long a record waits before it is offered again to a full local
/// queue (librdkafka's `queue.buffering.max.*`).
pub(crate) const QUEUE_FULL_WAIT: Duration = Duration::from_millis(10);

/// Header with the earliest delivery time (Unix ms) of a retry record.
pub const NOT_BEFORE_HEADER: &str = "ojs-not-before";
/// Header of a record on a retry topic: the queue topic it belongs to. A
/// consumer goes back only to its own: deployments that share a cluster
/// (and, by their settings, a retry topic) never take each other's
/// retries.
pub const ORIGIN_TOPIC_HEADER: &str = "ojs-origin-topic";

/// How long a request made while starting (a topic's metadata, creating
/// topics) waits: less than the daemon's start attempt, so that an
/// unreachable cluster is reported with librdkafka's reason rather than as
/// the attempt's time-out.
pub(crate) const START_REQUEST_TIMEOUT: Duration = Duration::from_secs(8);

impl Inner {
    /// A client error as the adapter reports it: where the cluster did not
    /// answer, `Unreachable` (waited for at start) with the brokers'
    /// addresses and librdkafka's latest reason (connection refused, a TLS
    /// or SASL failure) when it gave one.
    pub(crate) fn unreachable(&self, e: &KafkaError) -> Error {
        use RDKafkaErrorCode as C;
        // rdkafka gives an admin operation's code only through its variant.
        let code = match e {
            KafkaError::AdminOp(code) => Some(*code),
            other => other.rdkafka_error_code(),
        };
        let silent = matches!(
            code,
            Some(
                C::OperationTimedOut
                    | C::RequestTimedOut
                    | C::AllBrokersDown
                    | C::BrokerTransportFailure
                    | C::BrokerNotAvailable
            )
        );
        if !silent {
            return kafka_error(e);
        }
        let reason = self
            .log
            .recent_error()
            .unwrap_or_else(|| format!("no answer ({e})"));
        Error::Unreachable {
            broker: "kafka",
            message: format!("{}: {reason}", self.config.brokers),
        }
    }
}

pub(crate) fn kafka_error(e: &KafkaError) -> Error {
    let retryable = !matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessage)
    );
    Error::broker("kafka", e.to_string(), retryable)
        .with_broker_kind(broker_kind(e.rdkafka_error_code()))
        .with_source(e.clone())
}

/// The kind of a librdkafka error code.
pub(crate) fn broker_kind(code: Option<RDKafkaErrorCode>) -> BrokerErrorKind {
    use RDKafkaErrorCode as C;
    match code {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            BrokerErrorKind::NotFound
        }
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SaslAuthenticationFailed
            | C::Authentication,
        ) => BrokerErrorKind::AccessDenied,
        Some(C::TopicAlreadyExists) => BrokerErrorKind::Conflict,
        Some(
            C::MessageSizeTooLarge | C::InvalidMessage | C::InvalidMessageSize | C::InvalidRecord,
        ) => BrokerErrorKind::Rejected,
        Some(
            C::QueueFull
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::BrokerNotAvailable
            | C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::RequestTimedOut
            | C::MessageTimedOut
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::NotCoordinator
            | C::CoordinatorNotAvailable
            | C::CoordinatorLoadInProgress
            | C::ThrottlingQuotaExceeded,
        ) => BrokerErrorKind::Unavailable,
        _ => BrokerErrorKind::Other,
    }
}

pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub(crate) fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.brokers);
    if config.topology == Topology::Existing {
        // Not even a metadata request may create a topic.
        c.set("allow.auto.create.topics", "false");
    }
    c
}

/// Our librdkafka options, then the user's (they win), then the SASL
/// password from `sasl_password_file`.
pub(crate) fn apply_overrides(c: &mut ClientConfig, config: &KafkaConfig) -> Result<()> {
    for (k, v) in &config.librdkafka_options {
        c.set(k, v);
    }
    if let Some(path) = &config.sasl_password_file {
        let password = std::fs::read_to_string(path).map_err(|e| Error::InvalidConfig {
            field: "sasl_password_file".into(),
            reason: format!("cannot read {}: {e}", path.display()),
        })?;
        c.set("sasl.password", password.trim_end_matches(['\r', '\n']));
    }
    Ok(())
}

pub(crate) fn make_producer(config: &KafkaConfig, log: &Arc<ClientLog>) -> Result<Producer> {
    let mut p = client_config(config);
    p.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", config.publish_timeout_ms.to_string())
        .set(
            "message.max.bytes",
            (config.max_message_bytes + 64 * 1024).to_string(),
        )
        .set("linger.ms", "5");
    apply_overrides(&mut p, config)?;
    p.create_with_context(Reports::new(log.clone()))
        .map_err(|e| kafka_error(&e))
}
