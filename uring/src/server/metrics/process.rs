//! The process figures Prometheus' client libraries export under `process_*`: CPU
//! seconds, resident and virtual memory, open and maximum file descriptors, start time.
//!
//! Read from `/proc/self/stat`, `/proc/stat` (boot time), `/proc/self/fd` and the
//! open-file limit at each scrape. Parsing ([`parse_stat`]) is a pure function of the
//! file's text; a figure that cannot be read is left out of the exposition rather than
//! reported as 0. Linux only, like the rest of this crate.

use std::fmt::Write as _;

/// The fields of `/proc/self/stat` that the exposition uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// User-mode CPU time, in clock ticks (field 14).
    pub utime: u64,
    /// Kernel-mode CPU time, in clock ticks (field 15).
    pub stime: u64,
    /// Start time after boot, in clock ticks (field 22).
    pub starttime: u64,
    /// Virtual memory size, in bytes (field 23).
    pub vsize: u64,
    /// Resident set size, in pages (field 24).
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may hold
/// spaces and parentheses itself, so fields are counted from its last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let (_, after) = text.rsplit_once(')')?;
    // After the name: field 3 (state) is index 0, so field n is index n - 3.
    let fields: Vec<&str> = after.split_ascii_whitespace().collect();
    let field = |n: usize| fields.get(n.checked_sub(3)?)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
        vsize: field(23)?,
        rss_pages: field(24)?,
    })
}

/// The boot time in `/proc/stat` (`btime`, seconds since the epoch).
pub(crate) fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Appends the process figures to `out` in Prometheus' text format.
pub(crate) fn render(out: &mut String) {
    let ticks = rustix::param::clock_ticks_per_second().max(1);
    let page = rustix::param::page_size() as u64;
    let stat = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .as_deref()
        .and_then(parse_stat);
    if let Some(stat) = stat {
        let cpu = stat.utime.saturating_add(stat.stime);
        gauge(
            out,
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            &format!("{}.{:02}", cpu / ticks, (cpu % ticks) * 100 / ticks),
        );
        gauge(
            out,
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            &stat.rss_pages.saturating_mul(page).to_string(),
        );
        gauge(
            out,
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            &stat.vsize.to_string(),
        );
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .as_deref()
            .and_then(parse_boot_time);
        if let Some(boot) = boot {
            gauge(
                out,
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                &boot.saturating_add(stat.starttime / ticks).to_string(),
            );
        }
    }
    let (open, max) = descriptors();
    if let Some(open) = open {
        gauge(
            out,
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            &open.to_string(),
        );
    }
    if let Some(max) = max {
        gauge(
            out,
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            &max.to_string(),
        );
    }
}

/// The open file descriptors and the most there may be (`RLIMIT_NOFILE`'s soft limit).
pub(crate) fn descriptors() -> (Option<usize>, Option<u64>) {
    // The directory's own descriptor, open while it is read, is counted out.
    let open = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|entries| entries.count().saturating_sub(1));
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (open, limit.current)
}

fn gauge(out: &mut String, name: &str, kind: &str, help: &str, value: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name} {value}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let text = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    150 25 0 0 20 0 3 0 777 123456789 2048 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                utime: 150,
                stime: 25,
                starttime: 777,
                vsize: 123456789,
                rss_pages: 2048,
            })
        );
        assert_eq!(parse_stat("no parenthesis 1 2 3"), None);
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
        assert_eq!(
            parse_boot_time("cpu 1 2\nbtime 1700000000\nprocesses 5\n"),
            Some(1_700_000_000)
        );
        assert_eq!(parse_boot_time("cpu 1 2\n"), None);
    }

    #[test]
    fn this_process_reports_memory_and_descriptors() {
        let mut out = String::new();
        render(&mut out);
        let value = |name: &str| -> f64 {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("no {name} in\n{out}"))
                .parse()
                .unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(value("process_start_time_seconds") > 1.0e9);
    }
}
