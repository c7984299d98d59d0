//! `ojs-bridge`: the daemon and the CLI (the kcat of OJS).
//!
//! The binary is thin; each subcommand lives in its own module here so it can
//! be tested without spawning processes.

pub mod alarm;
pub mod blueprint;
pub mod config;
pub mod convert;
pub mod daemon;
pub mod dead_letters;
pub mod endpoint;
pub mod fuzz_targets;
pub mod http;
pub mod logging;
pub mod metrics;
mod pipeline;
pub mod probe;
pub mod progress;
pub mod routes;
pub mod send;
pub mod tail;
pub mod tls;
