//! Shared helpers for ojs-bridge's integration suites: the adapter acceptance
//! suite, delivery tallies, and broker endpoint discovery.
//!
//! Every adapter runs the same [`acceptance`] cases through
//! [`acceptance_tests!`]; what a broker cannot guarantee is declared in its
//! [`acceptance::Features`], never by leaving cases out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod acceptance;
pub mod brokers;
pub mod consume;
pub mod containers;
pub mod fault_proxy;
pub mod independent;
pub mod kafka;
pub mod postgres;
pub mod processes;
pub mod tally;
pub mod tempdir;
pub mod tonic_cases;
pub mod worker_cases;
