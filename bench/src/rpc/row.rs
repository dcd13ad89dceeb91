//! What `rdzv bench rpc` reports: measured rows, skipped transports, and how both print
//! (JSON lines, or a table with one column group per transport, side by side).
//!
//! This module summarises samples and formats; it measures nothing.

use std::fmt::Write as _;
use std::time::Duration;

use indicatif::ProgressBar;

use crate::BenchError;

/// Where the two sides of the benchmark run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunMode {
    /// Two processes on this host, started by one command.
    Local,
    /// `--listen` on one host, `--connect` on another (or the same).
    TwoHost,
}

impl RunMode {
    /// The `mode` field: `local` or `two-host`.
    pub(super) fn name(self) -> &'static str {
        match self {
            RunMode::Local => "local",
            RunMode::TwoHost => "two-host",
        }
    }
}

/// The `channel` of rows that are not RPC (raw-tcp, the CUDA copy).
pub(super) const NO_CHANNEL: &str = "-";

/// One measured payload size over one transport and channel.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Row {
    pub(super) transport: String,
    pub(super) channel: String,
    pub(super) mode: RunMode,
    pub(super) payload_bytes: u64,
    pub(super) iters: usize,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    /// Echo bandwidth: both directions counted.
    pub(super) gbytes_per_s: f64,
}

/// A transport (and channel) that was asked for, or is measured by default, but cannot
/// run, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Skip {
    pub(super) transport: String,
    pub(super) channel: String,
    pub(super) mode: RunMode,
    pub(super) reason: String,
}

impl Row {
    /// Summarises round-trip samples of `payload_bytes` each way.
    pub(super) fn from_samples(
        transport: &str,
        channel: &str,
        mode: RunMode,
        payload_bytes: u64,
        mut samples: Vec<Duration>,
    ) -> Row {
        samples.sort_unstable();
        let at = |p: usize| {
            samples
                .get(samples.len().saturating_sub(1) * p / 100)
                .map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        let total: f64 = samples.iter().map(Duration::as_secs_f64).sum();
        let gbytes_per_s = if total > 0.0 {
            2.0 * payload_bytes as f64 * samples.len() as f64 / total / 1e9
        } else {
            0.0
        };
        Row {
            transport: transport.to_string(),
            channel: channel.to_string(),
            mode,
            payload_bytes,
            iters: samples.len(),
            p50_us: at(50),
            p99_us: at(99),
            gbytes_per_s,
        }
    }

    /// The row as one JSON object.
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "bench": "rpc",
            "mode": self.mode.name(),
            "transport": self.transport,
            "channel": self.channel,
            "payload_bytes": self.payload_bytes,
            "iters": self.iters,
            "p50_us": round_to(self.p50_us, 1e3),
            "p99_us": round_to(self.p99_us, 1e3),
            "gbytes_per_s": round_to(self.gbytes_per_s, 1e6),
        })
    }

    fn column(&self) -> String {
        column_label(&self.transport, &self.channel)
    }
}

impl Skip {
    /// The skip as one JSON object: no measurement fields, a `skipped` reason.
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "bench": "rpc",
            "mode": self.mode.name(),
            "transport": self.transport,
            "channel": self.channel,
            "skipped": self.reason,
        })
    }
}

/// Runs `sample` for iterations 0 to `iters`, each returning the time of its timed part,
/// and keeps the times of all but iteration 0 (an unrecorded warm-up), ticking `bar`
/// (when given) for each.
pub(super) fn samples(
    iters: usize,
    bar: Option<&ProgressBar>,
    mut sample: impl FnMut(u64) -> Result<Duration, BenchError>,
) -> Result<Vec<Duration>, BenchError> {
    let mut samples = Vec::with_capacity(iters);
    for iter in 0..=iters as u64 {
        let took = sample(iter)?;
        if iter > 0 {
            samples.push(took);
            bar.inspect(|bar| bar.inc(1));
        }
    }
    Ok(samples)
}

/// `value` to the nearest `1 / scale` (nanoseconds for µs; kB/s for GB/s), so that JSON
/// shows `137.979` rather than `137.97899999999998`.
fn round_to(value: f64, scale: f64) -> f64 {
    (value * scale).round() / scale
}

fn column_label(transport: &str, channel: &str) -> String {
    if channel == NO_CHANNEL {
        transport.to_string()
    } else {
        format!("{transport}/{channel}")
    }
}

/// `0 B`, `64 B`, `4 KiB`, `1.5 MiB`, `64 MiB`.
pub(super) fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let name = UNITS.get(unit).copied().unwrap_or("TiB");
    if value.fract() == 0.0 {
        format!("{value:.0} {name}")
    } else {
        format!("{value:.1} {name}")
    }
}

/// One line per payload size, one column group (p50, p99, GB/s) per transport in the
/// order they first appear in `rows`, then one line per skip.
pub(super) fn table(rows: &[Row], skips: &[Skip]) -> String {
    const GROUP: usize = 30;
    let mut columns: Vec<String> = Vec::new();
    let mut sizes: Vec<u64> = Vec::new();
    for row in rows {
        let column = row.column();
        if !columns.contains(&column) {
            columns.push(column);
        }
        if !sizes.contains(&row.payload_bytes) {
            sizes.push(row.payload_bytes);
        }
    }
    sizes.sort_unstable();
    let mut out = String::new();
    if !rows.is_empty() {
        let _ = write!(out, "{:<10}", "payload");
        for column in &columns {
            let _ = write!(out, " |{column:^GROUP$}");
        }
        out.push('\n');
        let _ = write!(out, "{:<10}", "");
        for _ in &columns {
            let _ = write!(out, " |{:>10}{:>10}{:>10}", "p50 µs", "p99 µs", "GB/s");
        }
        out.push('\n');
        for &size in &sizes {
            let _ = write!(out, "{:<10}", human_size(size));
            for column in &columns {
                match rows
                    .iter()
                    .find(|r| r.payload_bytes == size && &r.column() == column)
                {
                    Some(r) => {
                        let _ = write!(
                            out,
                            " |{:>10.1}{:>10.1}{:>10.3}",
                            r.p50_us, r.p99_us, r.gbytes_per_s
                        );
                    }
                    None => {
                        let _ = write!(out, " |{:>GROUP$}", "-");
                    }
                }
            }
            out.push('\n');
        }
    }
    for skip in skips {
        let _ = writeln!(
            out,
            "skipped {}: {}",
            column_label(&skip.transport, &skip.channel),
            skip.reason
        );
    }
    out.lines().fold(String::new(), |mut text, line| {
        text.push_str(line.trim_end());
        text.push('\n');
        text
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_summarise_samples() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let row = Row::from_samples("tcp", "basic", RunMode::Local, 1_000, samples);
        assert_eq!(row.p50_us.round(), 50.0);
        assert_eq!(row.p99_us.round(), 99.0);
        assert_eq!(row.iters, 100);
        // 100 echoes of 1000 bytes each way in 5050 µs.
        let expected = 2.0 * 1_000.0 * 100.0 / 5_050e-6 / 1e9;
        assert!((row.gbytes_per_s - expected).abs() < 1e-9);
        let json = row.json();
        assert_eq!(json["bench"], "rpc");
        assert_eq!(json["mode"], "local");
        assert_eq!(json["transport"], "tcp");
        assert_eq!(json["channel"], "basic");
        assert_eq!(json["payload_bytes"], 1_000);
        assert_eq!(json["iters"], 100);
        let odd = Row::from_samples(
            "tcp",
            "basic",
            RunMode::Local,
            0,
            vec![Duration::from_nanos(137_979); 2],
        );
        assert_eq!(odd.json()["p50_us"].to_string(), "137.979");
    }

    #[test]
    fn no_samples_make_a_zero_row_not_a_panic() {
        let row = Row::from_samples("tcp", "basic", RunMode::TwoHost, 64, Vec::new());
        assert_eq!((row.p50_us, row.p99_us, row.gbytes_per_s), (0.0, 0.0, 0.0));
        assert_eq!(row.json()["mode"], "two-host");
    }

    #[test]
    fn skips_carry_a_reason_and_no_measurements() {
        let skip = Skip {
            transport: "ibv".into(),
            channel: "basic".into(),
            mode: RunMode::Local,
            reason: "not viable: no verbs".into(),
        };
        let json = skip.json();
        assert_eq!(json["skipped"], "not viable: no verbs");
        assert!(json.get("p50_us").is_none());
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(64), "64 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1536 * 1024), "1.5 MiB");
        assert_eq!(human_size(64 << 20), "64 MiB");
    }

    #[test]
    fn the_table_puts_transports_side_by_side() {
        let sample = |us| vec![Duration::from_micros(us); 3];
        let rows = vec![
            Row::from_samples("tcp", "basic", RunMode::Local, 0, sample(20)),
            Row::from_samples("raw-tcp", NO_CHANNEL, RunMode::Local, 0, sample(10)),
            Row::from_samples("tcp", "basic", RunMode::Local, 4096, sample(30)),
        ];
        let skips = vec![Skip {
            transport: "shm".into(),
            channel: "basic".into(),
            mode: RunMode::Local,
            reason: "not viable: test".into(),
        }];
        let text = table(&rows, &skips);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].contains("tcp/basic") && lines[0].contains("raw-tcp"));
        assert!(
            lines[2].starts_with("0 B") && lines[2].contains("20.0") && lines[2].contains("10.0")
        );
        // raw-tcp was not measured at 4 KiB: a dash, not a shifted column.
        assert!(lines[3].starts_with("4 KiB") && lines[3].trim_end().ends_with('-'));
        assert_eq!(lines[4], "skipped shm/basic: not viable: test");
    }
}
