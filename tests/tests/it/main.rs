//! The acceptance suite on every adapter, and each adapter's own broker tests.
//!
//! One test binary, one module per capability: each binary links every
//! adapter (rdkafka, lapin, the AWS SDK), so one binary links them once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod acceptance_kafka;
mod acceptance_local;
mod acceptance_memory;
mod acceptance_rabbitmq;
mod acceptance_sqs;
mod containers;
mod existing_kafka;
mod existing_rabbitmq;
mod existing_sqs;
mod federation;
mod federation_brokers;
mod kafka;
mod rabbitmq;
mod sqs;
mod worker;
