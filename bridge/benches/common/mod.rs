//! What the bridge's benches share.

/// `VmRSS` / `VmHWM` (the `field` of `/proc/<pid>/status`) of a process, in
/// MiB.
pub fn rss_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024.0
}
