//! CPU time spent by a process, read from `/proc/<pid>/stat`, to split a throughput
//! run's cost between the load generator and the server.
//!
//! On a machine where the client and the server share the cores, the throughput any
//! server can reach is bounded by `cores / (client CPU per op + server CPU per op)`;
//! with a perfect (zero-cost) server it is `cores / client CPU per op`. Reporting both
//! per-operation costs shows whether a goal is within reach at all, and how much of the
//! cost is the server's. It decides nothing about what is shown (see `report`).

use std::time::Duration;

/// Which process to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Process {
    /// This process (`/proc/self/stat`).
    Current,
    /// Another process by pid.
    Pid(u32),
}

impl Process {
    fn stat_path(self) -> String {
        match self {
            Process::Current => "/proc/self/stat".to_string(),
            Process::Pid(pid) => format!("/proc/{pid}/stat"),
        }
    }
}

/// Why a process's CPU time could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CpuTimeError {
    /// The stat file cannot be read (the process is gone, or this is not Linux).
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The stat file does not have the fields expected.
    #[error("cannot parse {path}")]
    Parse { path: String },
    /// The kernel gives no tick rate to convert with.
    #[error("the kernel reports 0 clock ticks per second")]
    NoClockTicks,
}

/// User plus system CPU time of every thread of `process` so far.
///
/// # Errors
/// [`CpuTimeError`], naming the file when it cannot be read or does not parse.
pub(super) fn cpu_time(process: Process) -> Result<Duration, CpuTimeError> {
    let path = process.stat_path();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(source) => return Err(CpuTimeError::Read { path, source }),
    };
    let Some(ticks) = parse_stat_ticks(&text) else {
        return Err(CpuTimeError::Parse { path });
    };
    let per_second = rustix::param::clock_ticks_per_second();
    if per_second == 0 {
        return Err(CpuTimeError::NoClockTicks);
    }
    let nanos = u128::from(ticks) * 1_000_000_000 / u128::from(per_second);
    Ok(Duration::from_nanos(
        u64::try_from(nanos).unwrap_or(u64::MAX),
    ))
}

/// `utime + stime` (fields 14 and 15, in clock ticks) of a `/proc/<pid>/stat` line. The
/// command name (field 2) is in parentheses and may itself hold spaces and parentheses,
/// so fields are counted from the last `)`.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    // After the name come field 3 (state), 4, ...; utime is field 14, stime field 15.
    let mut fields = after_name.split_ascii_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    utime.checked_add(stime)
}

/// Microseconds of CPU per operation, or `None` when nothing was measured.
pub(super) fn us_per_op(cpu: Duration, ops: u64) -> Option<f64> {
    (ops > 0).then(|| cpu.as_secs_f64() * 1e6 / ops as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_with_an_awkward_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        let line = "4242 (we (ird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0";
        assert_eq!(parse_stat_ticks(line), Some(325));
    }

    #[test]
    fn refuses_truncated_or_garbled_lines() {
        assert_eq!(parse_stat_ticks(""), None);
        assert_eq!(parse_stat_ticks("1 (x) S 1 2 3"), None);
        assert_eq!(parse_stat_ticks("1 (x) S 1 1 1 0 -1 0 0 0 0 0 abc 1"), None);
    }

    #[test]
    fn this_process_has_a_cpu_time() {
        let before = cpu_time(Process::Current).expect("own stat");
        // Burn a little CPU so the clock moves at least one tick.
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let after = cpu_time(Process::Current).expect("own stat");
        assert!(after >= before, "{before:?} -> {after:?}");
        assert!(matches!(
            cpu_time(Process::Pid(u32::MAX)),
            Err(CpuTimeError::Read { .. })
        ));
    }

    #[test]
    fn per_op() {
        assert_eq!(us_per_op(Duration::from_millis(1), 0), None);
        assert_eq!(us_per_op(Duration::from_millis(1), 100), Some(10.0));
    }
}
