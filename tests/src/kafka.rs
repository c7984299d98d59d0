//! Kafka test settings shared by the Kafka suites.

use ojs_adapter_kafka::KafkaConfig;

/// A config for tests: the tansu test broker holds a group join for half the
/// session timeout, so a short session keeps rebalances quick
/// (shared/BROKERS.md).
pub fn test_config(url: &str) -> KafkaConfig {
    let mut c = KafkaConfig::from_url(url).expect("valid kafka URL");
    c.session_timeout_ms = 2000;
    c.librdkafka_options
        .insert("heartbeat.interval.ms".into(), "500".into());
    c
}
