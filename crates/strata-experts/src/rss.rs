//! The process's resident set, which a budget caps (the runtime gives pages back under
//! pressure; `--stats` reports the peak).

/// A `/proc/self/status` field in bytes (its kB value x 1024), 0 where unknown.
fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Peak resident set size of this process (VmHWM), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// Resident set of this process now (VmRSS), 0 where unknown.
pub fn current_rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}
