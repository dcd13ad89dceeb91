//! Benchmark results as values, and the two ways they are shown: a table for people and
//! one JSON object per result for scripts.
//!
//! Every field is named for what it is, with its unit in the name (`p50_us`,
//! `ops_per_s`, `seconds`), and every object carries `mode` and `target` so that a
//! script can compare results from several runs (`benches/compare_pytorch.py` does).
//! This module measures nothing.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Percentiles of a latency histogram recorded in nanoseconds, in microseconds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) struct LatencySummary {
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl LatencySummary {
    /// Summarises `histogram` (values in nanoseconds). All zeros if it is empty.
    pub(super) fn from_ns(histogram: &Histogram<u64>) -> LatencySummary {
        if histogram.is_empty() {
            return LatencySummary::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencySummary {
            mean_us: histogram.mean() / 1000.0,
            p50_us: us(histogram.value_at_quantile(0.50)),
            p90_us: us(histogram.value_at_quantile(0.90)),
            p99_us: us(histogram.value_at_quantile(0.99)),
            p999_us: us(histogram.value_at_quantile(0.999)),
            max_us: us(histogram.max()),
        }
    }
}

/// One connection's round trips (`latency` and `baseline` modes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct RoundTripResult {
    /// What was measured: the store's address or label, or `raw-loopback`.
    pub target: String,
    /// `ADD` for the store, `ping-pong` for the raw baseline.
    pub op: &'static str,
    /// Bytes each request takes on the wire.
    pub request_bytes: usize,
    /// Bytes each reply takes on the wire.
    pub reply_bytes: usize,
    /// Round trips measured.
    pub samples: u64,
    /// Time spent measuring them, seconds.
    pub seconds: f64,
    /// Round trips per second (one at a time).
    pub ops_per_s: f64,
    /// Latency percentiles.
    #[serde(flatten)]
    pub latency: LatencySummary,
}

/// The store's round trip against the raw ping-pong, measured interleaved in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct RoundTripRatio {
    /// The store.
    pub target: String,
    /// Store `ADD` median, microseconds.
    pub store_p50_us: f64,
    /// Raw ping-pong median, microseconds.
    pub raw_p50_us: f64,
    /// `store_p50_us / raw_p50_us` (the goal is at most 1.2).
    pub p50_ratio: f64,
    /// Store `ADD` 99th percentile, microseconds.
    pub store_p99_us: f64,
    /// Raw ping-pong 99th percentile, microseconds.
    pub raw_p99_us: f64,
    /// `store_p99_us / raw_p99_us`.
    pub p99_ratio: f64,
}

/// Many connections doing `ADD` + `GET` (`throughput` mode).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ThroughputResult {
    /// The store.
    pub target: String,
    /// Concurrent connections.
    pub conns: usize,
    /// Client threads driving them.
    pub client_threads: usize,
    /// Length of the measurement window, seconds.
    pub seconds: f64,
    /// Operations completed in the window (each `ADD` and each `GET` counts one).
    pub ops: u64,
    /// `ops / seconds`.
    pub ops_per_s: f64,
    /// Per-operation latency percentiles.
    #[serde(flatten)]
    pub latency: LatencySummary,
    /// CPU time of the load generator per operation (only with `--addr`, where the
    /// bench process holds no server), microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_op: Option<f64>,
    /// CPU time of the server process (`--server-pid`) per operation, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_us_per_op: Option<f64>,
}

/// A rendezvous storm (`storm` mode).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct StormResult {
    /// The store.
    pub target: String,
    /// Ranks.
    pub ranks: usize,
    /// Client threads that drove them.
    pub client_threads: usize,
    /// First connect to last release (the timeout if some rank never was), seconds.
    pub seconds: f64,
    /// First connect until every rank had its `PING` answered, seconds.
    pub all_connected_seconds: Option<f64>,
    /// Ranks released by `STOP_WAITING`.
    pub released: usize,
    /// Ranks lost after their `ADD`, or not released by the timeout.
    pub failed: usize,
    /// Connection attempts retried before `ADD` (refused, reset).
    pub connect_retries: u64,
    /// The counter read back afterwards (`None` if it could not be read).
    pub counter: Option<i64>,
    /// Whether the `ADD` results were exactly 1..=ranks and the counter is `ranks`.
    pub counter_ok: bool,
    /// Median rank's time from the start to its release, seconds.
    pub release_p50_seconds: f64,
    /// 99th percentile of the same, seconds.
    pub release_p99_seconds: f64,
    /// The first error a rank hit, if any.
    pub first_error: Option<String>,
}

impl StormResult {
    /// Whether every rank was released and the counter is exact.
    pub(super) fn succeeded(&self) -> bool {
        self.released == self.ranks && self.failed == 0 && self.counter_ok
    }
}

/// One result, tagged with its mode in JSON (`"mode": "throughput"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub(super) enum BenchResult {
    /// `latency`: the store's `ADD` round trip.
    Latency(RoundTripResult),
    /// `baseline` (or `latency --compare-baseline`): the raw ping-pong.
    Baseline(RoundTripResult),
    /// `latency --compare-baseline`: the two compared.
    LatencyRatio(RoundTripRatio),
    /// `throughput`: one connection count.
    Throughput(ThroughputResult),
    /// `storm`.
    Storm(StormResult),
    /// `simulate`: one rank count.
    Simulation(SimulationResult),
}

/// `simulate`: one rank count's CPU time (this thread's) per phase and the engine's
/// memory (its own account, `Engine::heap_bytes`), with no sockets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct SimulationResult {
    /// Virtual connections.
    pub ranks: usize,
    /// Connect and `VALIDATE`, every rank.
    pub connect_cpu_s: f64,
    /// `ADD` and `WAIT` from every rank, the last one's `SET` of `done`, every release.
    pub barrier_cpu_s: f64,
    /// Every rank's `SET` of its address, then every rank's `GET` of its neighbour's.
    pub allgather_cpu_s: f64,
    /// The three phases.
    pub total_cpu_s: f64,
    /// `barrier_cpu_s` per rank, in microseconds.
    pub barrier_us_per_rank: f64,
    /// `total_cpu_s` per rank, in microseconds.
    pub total_us_per_rank: f64,
    /// Engine heap per connected, validated, idle connection.
    pub engine_bytes_per_idle_conn: usize,
    /// Engine heap per connection with every rank but the last waiting on the barrier.
    pub engine_bytes_per_waiting_conn: usize,
    /// Engine heap after the all-gather (N address keys and values, the counter).
    pub engine_bytes_after_allgather: usize,
    /// One connection's session (the runtime's, beside the engine), inline bytes.
    pub session_bytes: usize,
}

/// One JSON object per line, one per result.
pub(super) fn to_json_lines(results: &[BenchResult]) -> Result<String, serde_json::Error> {
    let mut out = String::new();
    for result in results {
        out.push_str(&serde_json::to_string(result)?);
        out.push('\n');
    }
    Ok(out)
}

/// The header of the round-trip rows.
const ROUND_TRIP_HEADER: &str = "round trip               op         bytes   samples      ops/s  \
    mean µs   p50 µs   p99 µs p99.9 µs    max µs";
/// The header of the throughput rows.
const THROUGHPUT_HEADER: &str = "throughput (ADD+GET)      conns threads   secs        ops      \
    ops/s  mean µs   p50 µs    p99 µs  p99.9 µs    max µs";
/// The header of the `simulate` rows.
const SIMULATION_HEADER: &str = "    ranks  connect s  barrier s   gather s    total s bar µs/rk \
    tot µs/rk   idle B   wait B  after MiB";

/// The results as aligned tables, one per kind: the round trips and their ratios, the
/// throughput rows (then the CPU per operation where it was measured), each storm, and
/// the `simulate` rows, each after a blank line.
pub(super) fn to_table(results: &[BenchResult]) -> String {
    let [mut round_trips, mut ratios, mut throughput, mut cpu]: [String; 4] = Default::default();
    let (mut storms, mut simulations, mut session_bytes) = (Vec::new(), String::new(), None);
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    for result in results {
        match result {
            BenchResult::Latency(r) | BenchResult::Baseline(r) => {
                round_trip_row(&mut round_trips, r)
            }
            BenchResult::LatencyRatio(r) => {
                let _ = writeln!(
                    ratios,
                    "{}: ADD p50 {:.1} µs / raw ping-pong p50 {:.1} µs = {:.2}× (goal ≤ 1.2×); \
                     p99 {:.2}×",
                    r.target, r.store_p50_us, r.raw_p50_us, r.p50_ratio, r.p99_ratio
                );
            }
            BenchResult::Throughput(r) => {
                throughput_row(&mut throughput, r);
                if r.client_cpu_us_per_op.is_some() || r.server_cpu_us_per_op.is_some() {
                    let (client, server) = (r.client_cpu_us_per_op, r.server_cpu_us_per_op);
                    let _ = writeln!(
                        cpu,
                        "  {} conns: CPU per op: client {} µs, server {} µs",
                        r.conns,
                        us(client),
                        us(server)
                    );
                }
            }
            BenchResult::Storm(s) => storms.push(storm_lines(s)),
            BenchResult::Simulation(s) => {
                session_bytes.get_or_insert(s.session_bytes);
                simulation_row(&mut simulations, s);
            }
        }
    }
    let mut out = String::new();
    section(&mut out, ROUND_TRIP_HEADER, &round_trips);
    out.push_str(&ratios);
    section(&mut out, THROUGHPUT_HEADER, &(throughput + &cpu));
    for storm in storms {
        section(&mut out, "", &storm);
    }
    if let Some(bytes) = session_bytes {
        let _ = writeln!(
            simulations,
            "CPU time of one thread (no sockets); B: engine heap bytes per connection, idle \
             and waiting; a session adds {bytes} bytes"
        );
    }
    section(&mut out, SIMULATION_HEADER, &simulations);
    out
}

/// Appends `header` (a line, unless empty) and `body` to `out`, after a blank line when
/// `out` has something already; nothing when `body` is empty.
fn section(out: &mut String, header: &str, body: &str) {
    if body.is_empty() {
        return;
    }
    if !out.is_empty() {
        out.push('\n');
    }
    if !header.is_empty() {
        out.push_str(header);
        out.push('\n');
    }
    out.push_str(body);
}

/// One `simulate` row.
fn simulation_row(out: &mut String, r: &SimulationResult) {
    let _ = writeln!(
        out,
        "{:>9} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>9.3} {:>9.3} {:>8} {:>8} {:>10.1}",
        r.ranks,
        r.connect_cpu_s,
        r.barrier_cpu_s,
        r.allgather_cpu_s,
        r.total_cpu_s,
        r.barrier_us_per_rank,
        r.total_us_per_rank,
        r.engine_bytes_per_idle_conn,
        r.engine_bytes_per_waiting_conn,
        r.engine_bytes_after_allgather as f64 / (1 << 20) as f64
    );
}

/// One latency or baseline row.
fn round_trip_row(out: &mut String, r: &RoundTripResult) {
    let _ = writeln!(
        out,
        "{:<24} {:<9} {:>6} {:>9} {:>10.0} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1}",
        r.target,
        r.op,
        format!("{}/{}", r.request_bytes, r.reply_bytes),
        r.samples,
        r.ops_per_s,
        r.latency.mean_us,
        r.latency.p50_us,
        r.latency.p99_us,
        r.latency.p999_us,
        r.latency.max_us
    );
}

/// One throughput row.
fn throughput_row(out: &mut String, r: &ThroughputResult) {
    let _ = writeln!(
        out,
        "{:<24} {:>6} {:>7} {:>6.1} {:>10} {:>10.0} {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>9.1}",
        r.target,
        r.conns,
        r.client_threads,
        r.seconds,
        r.ops,
        r.ops_per_s,
        r.latency.mean_us,
        r.latency.p50_us,
        r.latency.p99_us,
        r.latency.p999_us,
        r.latency.max_us
    );
}

/// A few lines per storm.
fn storm_lines(s: &StormResult) -> String {
    let verdict = if s.succeeded() {
        "all released"
    } else {
        "FAILED"
    };
    let connected = s
        .all_connected_seconds
        .map_or_else(|| "never".to_string(), |t| format!("{t:.3} s"));
    let counter = s
        .counter
        .map_or_else(|| "unreadable".to_string(), |c| c.to_string());
    let mut out = format!(
        "storm of {} ranks on {} ({} client threads): {verdict} in {:.3} s\n  all connected: \
         {connected}; released {}/{}; failed {}; connect retries {}\n  release time p50 \
         {:.3} s, p99 {:.3} s; counter {counter} ({})\n",
        s.ranks,
        s.target,
        s.client_threads,
        s.seconds,
        s.released,
        s.ranks,
        s.failed,
        s.connect_retries,
        s.release_p50_seconds,
        s.release_p99_seconds,
        if s.counter_ok { "exact" } else { "WRONG" }
    );
    if let Some(error) = &s.first_error {
        let _ = writeln!(out, "  first error: {error}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(p50: f64) -> LatencySummary {
        LatencySummary {
            mean_us: p50,
            p50_us: p50,
            p90_us: p50 * 2.0,
            p99_us: p50 * 3.0,
            p999_us: p50 * 4.0,
            max_us: p50 * 5.0,
        }
    }

    #[test]
    fn summary_converts_nanoseconds_to_microseconds() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        for ns in 1..=1000u64 {
            h.record(ns * 1000).unwrap();
        }
        let s = LatencySummary::from_ns(&h);
        assert!((s.p50_us - 500.0).abs() < 1.0, "{s:?}");
        assert!((s.p99_us - 990.0).abs() < 1.0, "{s:?}");
        assert!((s.max_us - 1000.0).abs() < 1.0, "{s:?}");
        assert!((s.mean_us - 500.5).abs() < 1.0, "{s:?}");
        let empty = Histogram::<u64>::new(3).unwrap();
        assert_eq!(LatencySummary::from_ns(&empty).p99_us, 0.0);
    }

    #[test]
    fn json_has_mode_and_units_in_field_names() {
        let results = [
            BenchResult::Throughput(ThroughputResult {
                target: "rdzv".into(),
                conns: 64,
                client_threads: 1,
                seconds: 2.0,
                ops: 1000,
                ops_per_s: 500.0,
                latency: summary(10.0),
                client_cpu_us_per_op: Some(4.5),
                server_cpu_us_per_op: None,
            }),
            BenchResult::Storm(StormResult {
                target: "rdzv".into(),
                ranks: 4,
                client_threads: 2,
                seconds: 0.5,
                all_connected_seconds: Some(0.1),
                released: 4,
                failed: 0,
                connect_retries: 0,
                counter: Some(4),
                counter_ok: true,
                release_p50_seconds: 0.4,
                release_p99_seconds: 0.5,
                first_error: None,
            }),
        ];
        let text = to_json_lines(&results).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["mode"], "throughput");
        assert_eq!(lines[0]["ops_per_s"], 500.0);
        assert_eq!(lines[0]["p99_us"], 30.0);
        assert_eq!(lines[0]["conns"], 64);
        assert_eq!(lines[0]["client_cpu_us_per_op"], 4.5);
        assert!(lines[0].get("server_cpu_us_per_op").is_none());
        assert_eq!(lines[1]["mode"], "storm");
        assert_eq!(lines[1]["seconds"], 0.5);
        assert_eq!(lines[1]["counter"], 4);
    }

    #[test]
    fn table_shows_each_kind_and_flags_failures() {
        let rt = RoundTripResult {
            target: "rdzv".into(),
            op: "ADD",
            request_bytes: 36,
            reply_bytes: 8,
            samples: 100,
            seconds: 1.0,
            ops_per_s: 100.0,
            latency: summary(12.5),
        };
        let results = [
            BenchResult::Latency(rt.clone()),
            BenchResult::Baseline(RoundTripResult {
                target: "raw-loopback".into(),
                op: "ping-pong",
                ..rt
            }),
            BenchResult::LatencyRatio(RoundTripRatio {
                target: "rdzv".into(),
                store_p50_us: 12.5,
                raw_p50_us: 10.0,
                p50_ratio: 1.25,
                store_p99_us: 30.0,
                raw_p99_us: 20.0,
                p99_ratio: 1.5,
            }),
            BenchResult::Storm(StormResult {
                target: "rdzv".into(),
                ranks: 4,
                client_threads: 2,
                seconds: 9.0,
                all_connected_seconds: None,
                released: 3,
                failed: 1,
                connect_retries: 2,
                counter: Some(3),
                counter_ok: false,
                release_p50_seconds: 0.4,
                release_p99_seconds: 0.5,
                first_error: Some("rank 2: reset".into()),
            }),
        ];
        let table = to_table(&results);
        assert!(table.contains("36/8"), "{table}");
        assert!(table.contains("raw-loopback"), "{table}");
        assert!(table.contains("1.25×"), "{table}");
        assert!(table.contains("FAILED"), "{table}");
        assert!(table.contains("released 3/4"), "{table}");
        assert!(table.contains("first error: rank 2: reset"), "{table}");
    }
}

/// The throughput results among JSON lines as `--json` prints them (other modes and
/// blank lines are skipped), for `rdzv bench plot`.
///
/// # Errors
/// The line number and what is wrong with a line that is not JSON, or a `throughput`
/// object that lacks a field.
pub(super) fn throughput_from_json_lines(text: &str) -> Result<Vec<ThroughputResult>, String> {
    let mut out = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", index + 1))?;
        if value.get("mode").and_then(|m| m.as_str()) != Some("throughput") {
            continue;
        }
        out.push(
            serde_json::from_value(value)
                .map_err(|e| format!("line {}: not a throughput result: {e}", index + 1))?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod json_lines_tests {
    use super::*;

    #[test]
    fn reads_back_what_json_prints() {
        let original = ThroughputResult {
            target: "rdzv".into(),
            conns: 64,
            client_threads: 1,
            seconds: 2.0,
            ops: 1000,
            ops_per_s: 500.0,
            latency: LatencySummary {
                mean_us: 1.0,
                p50_us: 2.0,
                p90_us: 3.0,
                p99_us: 4.0,
                p999_us: 5.0,
                max_us: 6.0,
            },
            client_cpu_us_per_op: Some(9.5),
            server_cpu_us_per_op: None,
        };
        let text = to_json_lines(&[BenchResult::Throughput(original.clone())]).unwrap();
        let storm = r#"{"mode":"storm","target":"x","ranks":4}"#;
        let all = format!("{storm}\n\n{text}");
        assert_eq!(throughput_from_json_lines(&all).unwrap(), vec![original]);
    }

    #[test]
    fn says_which_line_is_bad() {
        let err = throughput_from_json_lines("{}\nnot json").unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
        let err = throughput_from_json_lines(r#"{"mode":"throughput","conns":1}"#).unwrap_err();
        assert!(err.contains("not a throughput result"), "{err}");
    }
}
