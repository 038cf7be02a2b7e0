//! CPU time and memory of the processes a run watches, read from `/proc` (Linux only;
//! elsewhere nothing is reported).

use std::time::Instant;

use serde::Serialize;

/// `/proc/<pid>/stat` counts CPU time in clock ticks of `USER_HZ`, which Linux fixes at 100
/// for every architecture it exposes to user space.
const TICKS_PER_SECOND: f64 = 100.0;

/// A process a run watches, by role ("worker bench-worker-1", "nats-server", ...).
#[derive(Debug, Clone)]
pub struct Watched {
    pub role: String,
    pub pid: u32,
}

/// The CPU counters of the watched processes at one moment.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    at: Instant,
    ticks: Vec<Option<u64>>,
}

/// What one process used during a phase.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessUsage {
    pub role: String,
    pub pid: u32,
    /// CPU seconds (user + system) during the phase.
    pub cpu_seconds: f64,
    /// CPU seconds per wall-clock second: 1.0 is one core kept busy.
    pub cpu_cores: f64,
    /// CPU microseconds per request completed in the phase; absent when none completed.
    pub cpu_us_per_request: Option<f64>,
    /// Resident set size at the end of the phase, MiB.
    pub rss_mib: Option<f64>,
    /// Peak resident set size since the process started (VmHWM), MiB.
    pub peak_rss_mib: Option<f64>,
}

pub fn snapshot(watched: &[Watched]) -> CpuSnapshot {
    CpuSnapshot {
        at: Instant::now(),
        ticks: watched.iter().map(|w| cpu_ticks(w.pid)).collect(),
    }
}

/// Usage of each watched process between `before` (taken with the same list) and now.
pub fn usage_since(watched: &[Watched], before: &CpuSnapshot) -> Vec<ProcessUsage> {
    let wall = before.at.elapsed().as_secs_f64().max(1e-9);
    watched
        .iter()
        .zip(&before.ticks)
        .filter_map(|(w, then)| {
            let now = cpu_ticks(w.pid)?;
            let seconds = now.saturating_sub((*then)?) as f64 / TICKS_PER_SECOND;
            let memory = memory(w.pid);
            Some(ProcessUsage {
                role: w.role.clone(),
                pid: w.pid,
                cpu_seconds: seconds,
                cpu_cores: seconds / wall,
                cpu_us_per_request: None,
                rss_mib: memory.map(|m| kib_to_mib(m.rss_kib)),
                peak_rss_mib: memory.map(|m| kib_to_mib(m.peak_rss_kib)),
            })
        })
        .collect()
}

/// Resident memory of a process, KiB.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
}

pub fn memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some(Memory {
        rss_kib: field("VmRSS:")?,
        peak_rss_kib: field("VmHWM:")?,
    })
}

pub fn kib_to_mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// utime + stime of a process (threads included), in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat)
}

/// The command name (field 2) may hold spaces and parentheses, so fields are counted from the
/// last `)`: utime and stime are fields 14 and 15 of the line, 12 and 13 after it.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The 1-minute load average, to judge how quiet the machine was.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_after_the_command_name() {
        let stat = "4242 (genfleet (x) y) S 1 4242 4242 0 -1 4194560 2311 0 0 0 \
                    120 35 0 0 20 0 5 0 1234 1000000 500 18446744073709551615";
        assert_eq!(parse_cpu_ticks(stat), Some(155));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_readable() {
        let pid = std::process::id();
        assert!(cpu_ticks(pid).is_some());
        let m = memory(pid).expect("status readable");
        assert!(m.rss_kib > 0 && m.peak_rss_kib >= m.rss_kib);
    }
}
