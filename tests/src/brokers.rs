//! Where the brokers are, and what to do when one is missing.
//!
//! Endpoints come from environment variables with loopback defaults
//! (`scripts/brokers.sh env` prints them). When `OJS_BRIDGE_REQUIRE_BROKERS=1`
//! (CI sets it) a missing broker fails the test; otherwise the test prints why
//! it skipped and returns.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Whether missing brokers must fail the run.
pub fn brokers_required() -> bool {
    std::env::var("OJS_BRIDGE_REQUIRE_BROKERS").is_ok_and(|v| v == "1")
}

/// Whether something listens on `host:port` (a quick TCP connect).
pub fn reachable(host_port: &str) -> bool {
    let addrs: Vec<SocketAddr> = match host_port.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(_) => return false,
    };
    addrs
        .iter()
        .any(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).is_ok())
}

/// Reports a missing broker: panics when brokers are required, otherwise
/// prints the reason and returns `None` so the caller can skip.
pub fn missing<T>(what: &str, reason: &str) -> Option<T> {
    if brokers_required() {
        panic!("{what} is required (OJS_BRIDGE_REQUIRE_BROKERS=1) but unavailable: {reason}");
    }
    println!("SKIPPED: {what} unavailable ({reason}); start it with `scripts/brokers.sh up` or set OJS_BRIDGE_REQUIRE_BROKERS=1 to fail instead");
    None
}

/// A broker endpoint from `var`, or `default`, checked for reachability at
/// `probe(host:port)`.
pub fn endpoint(var: &str, default: &str, probe: impl Fn(&str) -> String) -> Option<String> {
    let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let addr = probe(&url);
    if reachable(&addr) {
        Some(url)
    } else {
        missing(var, &format!("nothing listens on {addr} (from {url})"))
    }
}

/// A fresh, valid OJS queue name for one test.
pub fn unique_queue(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &id[..12])
}
