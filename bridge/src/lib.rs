//! `ojs-bridge`: the daemon and the CLI (the kcat of OJS).
//!
//! The binary is thin; each subcommand lives in its own module here so it can
//! be tested without spawning processes.

pub mod convert;
pub mod endpoint;
pub mod send;
pub mod tail;
