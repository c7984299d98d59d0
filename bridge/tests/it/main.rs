//! The daemon's and the CLI's integration tests: real processes, real brokers.
//!
//! One test binary, one module per capability: each binary links every
//! adapter (rdkafka, lapin, the AWS SDK), so one binary links them once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod abuse;
mod broker_faults;
mod cli_brokers;
mod cli_convert;
mod conformance;
mod containers;
mod daemon;
mod daemon_brokers;
mod daemon_process;
mod existing_infra;
mod faults;
mod fuzz_corpus;
mod http_endpoint;
mod local_processes;
mod ojs_admin_pages;
mod ojs_api;
mod ojs_api_dead_letters;
mod ojs_api_replicas;
mod ojs_api_security;
mod ojs_api_worker;
mod ojs_clients;
mod ojs_conformance;
mod ojs_events;
mod ojs_grpc;
mod ojs_realtime;
mod ojs_server;
mod ojs_workflows;
mod secrets;
mod support;
mod tonic_route;
