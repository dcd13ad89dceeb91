//! `rdzv-bench`: the benchmarks behind `rdzv bench` (the CLI calls [`run`]), a crate of
//! their own so that the facade stays re-exports and the CLI, and the load generators'
//! dependencies (mio, hdrhistogram, indicatif, plotters) stay out of the library.
//!
//! `rdzv bench store`: measure a TCPStore server with the real protocol.
//!
//! Without `--addr` it starts rdzv's own server (`rdzv_uring::StoreServer`) in this
//! process on `127.0.0.1`; with `--addr` it measures any compatible server, PyTorch's
//! included. Five modes:
//!
//! - `latency`: one connection's `ADD` round trip (`--compare-baseline` interleaves a raw
//!   ping-pong of the same size and reports the ratio, both from the same run);
//! - `throughput --conns 1,64,512 --secs S`: N connections doing `ADD` + `GET`, one
//!   request in flight each, on an event-driven client (`--plot FILE.svg` draws the curve);
//! - `storm --ranks N`: N ranks connect at once, `VALIDATE`, `PING`, `ADD` a counter, the
//!   last sets `done`, all `WAIT`; checks every rank is released and the counter is N
//!   (the ranks are spread over `--client-threads` epoll loops, one per core by default);
//! - `simulate --ranks 10000,100000,1000000`: N virtual ranks on core's session and engine
//!   with no sockets (connect, `VALIDATE`, a barrier, the all-gather of addresses): CPU
//!   time and engine memory per connection at scales no one host's sockets reach;
//! - `baseline`: the raw loopback ping-pong alone.
//!
//! Results are tables (with progress bars on a terminal) or, with `--json`, one JSON
//! object per result. This module parses options, sets up the target and the open-file
//! limit, and runs the drivers in `latency`, `throughput` and `storm`; the measuring is
//! theirs and the formatting is `report`'s.

mod conn;
mod cpu;
mod error;
mod harness;
mod latency;
mod plot;
mod rendezvous;
mod rendezvous_etcd;
mod report;
mod rpc;
mod simulate;
mod storm;
mod throughput;

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rdzv_core::store::Request;

pub use cpu::CpuTimeError;
pub use error::BenchError;
use harness::{ensure_fd_limit, key_prefix, progress_bar, seconds, write_report, Target};
pub use rendezvous::RendezvousBenchArgs;
use report::{BenchResult, LatencySummary, RoundTripRatio, RoundTripResult, StormResult};
pub use rpc::RpcBenchArgs;

/// What `rdzv bench` measures.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Measure a TCPStore server (rdzv's embedded one, or any at --addr): latency,
    /// throughput, connection storms, and a raw TCP baseline.
    Store(StoreBenchArgs),
    /// Draw throughput and p99 against the connection count from `--json` output, one
    /// line per target (`benches/compare_pytorch.py --plot` uses it for rdzv next to
    /// PyTorch).
    Plot {
        /// JSON lines as `rdzv bench store --json` prints them (`-` for stdin).
        #[arg(long)]
        input: PathBuf,
        /// The SVG file to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Measure the RPC agent between two worker processes, local or on two hosts
    /// (--listen/--connect): `rpc_sync` echo latency and bandwidth per payload size for
    /// each transport side by side, next to a raw TCP ping-pong (see `bench::rpc`).
    Rpc(rpc::RpcBenchArgs),
    /// N elastic-rendezvous nodes on one event loop against a store: time to one round,
    /// store operations per node per join and per heartbeat, next to torchrun's design.
    Rendezvous(rendezvous::RendezvousBenchArgs),
}

/// Options of `rdzv bench store`.
#[derive(Debug, Args)]
pub struct StoreBenchArgs {
    /// The store to measure, as HOST:PORT. Without it, an rdzv store server is started in
    /// this process on 127.0.0.1.
    #[arg(long, global = true)]
    addr: Option<String>,
    /// Print one JSON object per result (fields carry their unit: p50_us, ops_per_s,
    /// seconds) instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Name of the target in the results (default: `rdzv-embedded`, or the address).
    #[arg(long, global = true)]
    label: Option<String>,
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// One connection's ADD round trip, one request at a time.
    Latency {
        #[command(flatten)]
        timing: RoundTripArgs,
        /// Also measure a raw loopback ping-pong of the same size, interleaved with the
        /// store in 100 ms slices, and report the ratio.
        #[arg(long)]
        compare_baseline: bool,
    },
    /// Many connections doing ADD then GET on their own key, one request in flight each.
    Throughput(ThroughputArgs),
    /// N ranks connect at once, VALIDATE, PING, ADD a counter; the last sets "done";
    /// everyone WAITs. Fails unless every rank is released and the counter is exactly N.
    Storm(StormArgs),
    /// N virtual ranks on core's serve step and engine, no sockets, on this thread:
    /// connect, VALIDATE, a barrier (ADD, WAIT, release), then the all-gather of their
    /// addresses (SET each, GET a neighbour's). Reports CPU time and engine memory per
    /// connection (see `bench::simulate`); --addr does not apply.
    Simulate {
        /// Rank counts, each run in turn (10000,100000,1000000).
        #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
        ranks: Vec<usize>,
    },
    /// A raw TCP ping-pong over loopback, as many bytes each way as an ADD exchange:
    /// the floor for the store's round trip.
    Baseline(RoundTripArgs),
}

/// How long `rdzv bench store latency` and `baseline` run.
#[derive(Debug, Args)]
struct RoundTripArgs {
    /// Seconds to measure (each, with latency --compare-baseline).
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Seconds run before measuring.
    #[arg(long, default_value_t = 0.2)]
    warmup_secs: f64,
}

impl RoundTripArgs {
    /// `(measure, warmup)`, checked.
    fn durations(&self) -> Result<(Duration, Duration), BenchError> {
        let measure = seconds(self.secs, "--secs")?;
        Ok((measure, seconds(self.warmup_secs, "--warmup-secs")?))
    }
}

/// Options of `rdzv bench store throughput`.
#[derive(Debug, Args)]
struct ThroughputArgs {
    /// Concurrent connections; a list (1,16,64,512) runs each in turn.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    conns: Vec<usize>,
    /// Seconds to measure, per connection count.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Seconds run before measuring, per connection count.
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// Client threads driving the connections (each runs one epoll loop).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Draw throughput and p99 against the connection count into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// The server's process id: its CPU time over the window is reported as
    /// `server_cpu_us_per_op` (Linux `/proc`). With `--addr`, the bench's own CPU is
    /// reported as `client_cpu_us_per_op` either way.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Seconds every connection may take to be accepted and answer a PING before
    /// the run starts (a slowly accepting server needs long: PyTorch's takes about
    /// 10 connections per second once hundreds are queued).
    #[arg(long, default_value_t = 120.0)]
    setup_timeout_secs: f64,
}

/// Options of `rdzv bench store storm`.
#[derive(Debug, Args)]
struct StormArgs {
    /// Ranks (concurrent connections).
    #[arg(long, default_value_t = 512)]
    ranks: usize,
    /// Seconds before giving up on ranks not yet released.
    #[arg(long, default_value_t = 60.0)]
    timeout_secs: f64,
    /// Client threads the ranks are dealt to, each running one epoll loop (default:
    /// the cores this process may use).
    #[arg(long)]
    client_threads: Option<usize>,
}

/// A histogram of nanoseconds from 1 ns to 10 minutes, 3 significant digits.
pub(crate) fn new_histogram() -> Result<Histogram<u64>, BenchError> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3)
        .map_err(|e| BenchError::Histogram(format!("{e:?}")))
}

/// Runs `rdzv bench ...`.
pub fn run(command: BenchCommand) -> Result<ExitCode, BenchError> {
    match command {
        BenchCommand::Store(args) => store(args),
        BenchCommand::Plot { input, out } => plot_file(&input, &out),
        BenchCommand::Rpc(args) => rpc::run(args),
        BenchCommand::Rendezvous(args) => rendezvous::run(args),
    }
}

/// `rdzv bench plot`: the throughput curve of `--json` lines read from `input` (`-`:
/// stdin), drawn into `out`.
fn plot_file(input: &Path, out: &Path) -> Result<ExitCode, BenchError> {
    let text = if input.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(input)
    }
    .map_err(|source| BenchError::ReadInput {
        path: input.to_path_buf(),
        source,
    })?;
    let results =
        report::throughput_from_json_lines(&text).map_err(|reason| BenchError::ParseInput {
            path: input.to_path_buf(),
            reason,
        })?;
    plot::throughput_svg(out, &results)?;
    eprintln!(
        "plot of {} throughput results written to {}",
        results.len(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

const TIME_BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len} ms";
const SIM_BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len} rank steps ({elapsed})";
const RANK_BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len} released ({elapsed})";

fn store(args: StoreBenchArgs) -> Result<ExitCode, BenchError> {
    let json = args.json;
    let (addr, label) = (args.addr, args.label);
    let target = || Target::open(addr.as_deref(), label);
    let (results, ok) = match args.mode {
        Mode::Baseline(timing) => (
            round_trip_mode(None, timing.durations()?, false, json)?,
            true,
        ),
        Mode::Latency {
            timing,
            compare_baseline,
        } => {
            let timing = timing.durations()?;
            let target = target()?;
            (
                round_trip_mode(Some(&target), timing, compare_baseline, json)?,
                true,
            )
        }
        Mode::Throughput(throughput) => (throughput_mode(&throughput, json, target)?, true),
        Mode::Storm(storm) => {
            let result = storm_mode(&storm, json, target)?;
            let ok = result.succeeded();
            (vec![BenchResult::Storm(result)], ok)
        }
        Mode::Simulate { ranks } => (simulate_mode(&ranks, json)?, true),
    };
    let report = if json {
        report::to_json_lines(&results).map_err(|source| BenchError::Record {
            what: "encoding the results as JSON".into(),
            source,
        })?
    } else {
        report::to_table(&results)
    };
    write_report(&report)?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `bench store simulate`: each rank count in turn, each row shown as it completes on a
/// terminal.
fn simulate_mode(ranks: &[usize], json: bool) -> Result<Vec<BenchResult>, BenchError> {
    let mut results = Vec::with_capacity(ranks.len());
    for &n in ranks {
        let bar = progress_bar(json, SIM_BAR, None);
        let result = simulate::simulate(n, &bar)?;
        bar.finish_and_clear();
        let row = BenchResult::Simulation(result);
        show_as_done(json, ranks.len(), &row);
        results.push(row);
    }
    Ok(results)
}

/// `bench store latency`: one connection's ADD round trips to `target` (and the raw
/// ping-pong beside them with `compare_baseline`); `bench store baseline` (no target):
/// the raw loopback ping-pong alone.
fn round_trip_mode(
    target: Option<&Target>,
    (measure, warmup): (Duration, Duration),
    compare_baseline: bool,
    json: bool,
) -> Result<Vec<BenchResult>, BenchError> {
    let key = format!("{}/counter", key_prefix("latency")).into_bytes();
    let request_bytes = Request::Add {
        key: &key,
        delta: 1,
    }
    .encoded_len();
    let store = match target {
        Some(target) => {
            let client = latency::AddRoundTrip::connect(target.addr, key, CONNECT_TIMEOUT)?;
            Some((client, target.label.as_str(), compare_baseline))
        }
        None => None,
    };
    let bar = progress_bar(json, TIME_BAR, None);
    bar.set_message(match store {
        Some(_) => "ADD round trips",
        None => "raw ping-pong",
    });
    let results = round_trips(store, request_bytes, measure, warmup, &bar)?;
    bar.finish_and_clear();
    Ok(results)
}

/// Shows `row`, the result of one of `of` runs, as it completes: on a terminal, when the
/// list has more than one.
fn show_as_done(json: bool, of: usize, row: &BenchResult) {
    if !json && of > 1 && std::io::stderr().is_terminal() {
        eprint!("{}", report::to_table(std::slice::from_ref(row)));
    }
}

/// `bench store throughput`: each connection count in turn (and the plot).
fn throughput_mode(
    args: &ThroughputArgs,
    json: bool,
    target: impl FnOnce() -> Result<Target, BenchError>,
) -> Result<Vec<BenchResult>, BenchError> {
    let measure = seconds(args.secs, "--secs")?;
    let setup_timeout = seconds(args.setup_timeout_secs, "--setup-timeout-secs")?;
    let warmup = seconds(args.warmup_secs, "--warmup-secs")?;
    let conns = &args.conns;
    if conns.is_empty() || conns.contains(&0) {
        return Err(BenchError::invalid(
            "--conns must list connection counts of at least 1",
        ));
    }
    let target = target()?;
    let most = conns.iter().copied().max().unwrap_or(1);
    ensure_fd_limit(most as u64 + target.server_fds(most) + FD_SLACK)?;
    let mut results = Vec::with_capacity(conns.len());
    for &n in conns {
        let bar = progress_bar(json, TIME_BAR, None);
        bar.set_message(format!("{n} connections"));
        let plan = throughput::ThroughputPlan {
            addr: target.addr,
            conns: n,
            threads: args.client_threads.max(1),
            warmup,
            measure,
            key_prefix: key_prefix("throughput"),
            setup_timeout,
            client_cpu: target.embedded.is_none(),
            server_pid: args.server_pid,
            label: target.label.clone(),
        };
        let result = throughput::run(&plan, &bar)?;
        bar.finish_and_clear();
        show_as_done(json, conns.len(), &BenchResult::Throughput(result.clone()));
        results.push(result);
    }
    if let Some(path) = &args.plot {
        plot::throughput_svg(path, &results)?;
        if !json {
            eprintln!("plot written to {}", path.display());
        }
    }
    Ok(results.into_iter().map(BenchResult::Throughput).collect())
}

/// `bench store storm`: checks the limits, runs the storm, reads the counter back.
fn storm_mode(
    args: &StormArgs,
    json: bool,
    target: impl FnOnce() -> Result<Target, BenchError>,
) -> Result<StormResult, BenchError> {
    let ranks = args.ranks;
    let timeout = seconds(args.timeout_secs, "--timeout-secs")?;
    if ranks == 0 {
        return Err(BenchError::invalid("--ranks must be at least 1"));
    }
    let target = target()?;
    storm_limits(&target, ranks)?;
    let threads = match args.client_threads {
        Some(0) => return Err(BenchError::invalid("--client-threads must be at least 1")),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let plan = storm::StormPlan {
        addr: target.addr,
        ranks,
        threads,
        timeout,
        key_prefix: key_prefix("storm"),
        label: target.label.clone(),
    };
    let bar = progress_bar(json, RANK_BAR, None);
    bar.set_message(format!("storm of {ranks}"));
    let result = storm::run(&plan, &bar)?;
    bar.finish_and_clear();
    Ok(result)
}

/// The open-file limit a storm of `ranks` needs (with a note when the embedded server's
/// sockets are what breaks it), and a note when the listen backlog is below `ranks`.
fn storm_limits(target: &Target, ranks: usize) -> Result<(), BenchError> {
    let limit =
        ensure_fd_limit(ranks as u64 + target.server_fds(ranks) + FD_SLACK).inspect_err(|e| {
            let ours =
                matches!(e, BenchError::FdLimit { limit, .. } if *limit >= ranks as u64 + FD_SLACK);
            if ours && target.embedded.is_some() {
                eprintln!(
                    "note: the embedded server's sockets count against this process's \
                     limit too; a server of its own (`rdzv store serve`, then --addr) \
                     leaves {ranks} ranks within it"
                );
            }
        })?;
    let backlog = rdzv_uring::server::listener::somaxconn();
    if let Some(backlog) = backlog.filter(|&backlog| (backlog as usize) < ranks) {
        eprintln!(
            "note: net.core.somaxconn={backlog} is below {ranks} ranks: a server slower to \
             accept than the storm arrives will see its listen queue overflow (SYNs \
             dropped, connects retried after 1 s or more)"
        );
    }
    tracing::info!(limit, ranks, "storm: open-file limit");
    Ok(())
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Descriptors beyond the connections: stdio, epoll, the executor's io_uring, listeners.
const FD_SLACK: u64 = 128;
/// Length of one interleaved slice of `latency --compare-baseline`.
const SLICE: Duration = Duration::from_millis(100);

fn per_second(count: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

/// Runs the round-trip modes. `store` is the store client, its label, and whether to
/// interleave the raw ping-pong; `None` runs the raw ping-pong alone (`baseline`).
fn round_trips(
    store: Option<(latency::AddRoundTrip, &str, bool)>,
    request_bytes: usize,
    measure: Duration,
    warmup: Duration,
    bar: &ProgressBar,
) -> Result<Vec<BenchResult>, BenchError> {
    let reply_bytes = latency::ADD_REPLY_BYTES;
    let want_raw = store.as_ref().is_none_or(|(_, _, compare)| *compare);
    let (mut store, label) = store.map_or((None, String::new()), |(client, label, _)| {
        (Some(client), label.to_string())
    });
    let echo = want_raw
        .then(|| latency::EchoServer::start(request_bytes, reply_bytes))
        .transpose()?;
    let mut raw = echo
        .as_ref()
        .map(|e| {
            latency::RawPingPong::connect(e.addr(), request_bytes, reply_bytes, CONNECT_TIMEOUT)
        })
        .transpose()?;

    let mut store_hist = new_histogram()?;
    let mut raw_hist = new_histogram()?;
    let mut store_time = Duration::ZERO;
    let mut raw_time = Duration::ZERO;
    let kinds = usize::from(store.is_some()) + usize::from(raw.is_some());
    bar.set_length(u64::try_from((measure * kinds as u32).as_millis()).unwrap_or(u64::MAX));

    // Warm both paths up (caches, TCP windows, the executor), unrecorded.
    let warm_until = Instant::now() + warmup;
    while Instant::now() < warm_until {
        if let Some(client) = store.as_mut() {
            client.round_trip()?;
        }
        if let Some(client) = raw.as_mut() {
            client.round_trip()?;
        }
    }
    // Interleave in slices so that both see the same machine (other load, frequency).
    loop {
        let store_done = store.is_none() || store_time >= measure;
        let raw_done = raw.is_none() || raw_time >= measure;
        if store_done && raw_done {
            break;
        }
        if let (Some(client), false) = (store.as_mut(), store_done) {
            store_time += slice(|| client.round_trip(), &mut store_hist)?;
        }
        if let (Some(client), false) = (raw.as_mut(), raw_done) {
            raw_time += slice(|| client.round_trip(), &mut raw_hist)?;
        }
        bar.set_position(u64::try_from((store_time + raw_time).as_millis()).unwrap_or(u64::MAX));
    }
    drop(raw);
    drop(echo);

    let store = store.is_some().then_some((&store_hist, store_time));
    let raw = want_raw.then_some((&raw_hist, raw_time));
    let bytes = (request_bytes, reply_bytes);
    Ok(round_trip_results(label, store, raw, bytes))
}

/// The rows of a round-trip run: the store's ADD (labelled `label`) and the raw
/// ping-pong, each as its histogram and the time it ran, and their ratio when both ran.
fn round_trip_results(
    label: String,
    store: Option<(&Histogram<u64>, Duration)>,
    raw: Option<(&Histogram<u64>, Duration)>,
    (request_bytes, reply_bytes): (usize, usize),
) -> Vec<BenchResult> {
    let result = |target: String, op: &'static str, (hist, time): (&Histogram<u64>, Duration)| {
        RoundTripResult {
            target,
            op,
            request_bytes,
            reply_bytes,
            samples: hist.len(),
            seconds: time.as_secs_f64(),
            ops_per_s: per_second(hist.len(), time.as_secs_f64()),
            latency: LatencySummary::from_ns(hist),
        }
    };
    let mut results = Vec::new();
    if let Some(store) = store {
        results.push(BenchResult::Latency(result(label.clone(), "ADD", store)));
    }
    if let Some(raw) = raw {
        results.push(BenchResult::Baseline(result(
            "raw-loopback".into(),
            "ping-pong",
            raw,
        )));
    }
    if let (Some((store_hist, _)), Some((raw_hist, _))) = (store, raw) {
        let s = LatencySummary::from_ns(store_hist);
        let r = LatencySummary::from_ns(raw_hist);
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        results.push(BenchResult::LatencyRatio(RoundTripRatio {
            target: label,
            store_p50_us: s.p50_us,
            raw_p50_us: r.p50_us,
            p50_ratio: ratio(s.p50_us, r.p50_us),
            store_p99_us: s.p99_us,
            raw_p99_us: r.p99_us,
            p99_ratio: ratio(s.p99_us, r.p99_us),
        }));
    }
    results
}

/// Runs `round_trip` for one [`SLICE`], recording each into `hist`; returns the time
/// spent.
fn slice(
    mut round_trip: impl FnMut() -> Result<Duration, BenchError>,
    hist: &mut Histogram<u64>,
) -> Result<Duration, BenchError> {
    let start = Instant::now();
    while start.elapsed() < SLICE {
        let took = round_trip()?;
        hist.saturating_record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).max(1));
    }
    Ok(start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rdzv bench ...` as the command line parses it (`cli::Command::Bench` holds a
    /// [`BenchCommand`] as its subcommand), without naming `cli`, which is above `bench`.
    #[derive(Debug, clap::Parser)]
    #[command(name = "rdzv")]
    struct Cli {
        #[command(subcommand)]
        command: TopCommand,
    }

    #[derive(Debug, clap::Subcommand)]
    enum TopCommand {
        #[command(subcommand)]
        Bench(BenchCommand),
    }

    fn cli(args: &[&str]) -> Cli {
        use clap::Parser as _;
        Cli::try_parse_from(args).expect("arguments parse")
    }

    /// Runs a parsed `rdzv bench` command as `cli::run` does.
    fn run_cli(cli: Cli) -> Result<ExitCode, BenchError> {
        match cli.command {
            TopCommand::Bench(command) => run(command),
        }
    }

    #[test]
    fn options_parse_in_any_position() {
        use clap::Parser as _;
        cli(&[
            "rdzv",
            "bench",
            "store",
            "--json",
            "throughput",
            "--conns",
            "1,16,64",
        ]);
        cli(&[
            "rdzv",
            "bench",
            "store",
            "throughput",
            "--conns",
            "8",
            "--json",
        ]);
        cli(&[
            "rdzv", "bench", "store", "storm", "--ranks", "4096", "--addr", "h:1",
        ]);
        cli(&[
            "rdzv",
            "bench",
            "store",
            "storm",
            "--ranks",
            "16384",
            "--client-threads",
            "4",
        ]);
        cli(&[
            "rdzv",
            "bench",
            "store",
            "latency",
            "--compare-baseline",
            "--secs",
            "2",
        ]);
        cli(&["rdzv", "bench", "store", "baseline", "--label", "x"]);
        assert!(Cli::try_parse_from(["rdzv", "bench", "store"]).is_err());
        assert!(Cli::try_parse_from(["rdzv", "bench", "store", "storm", "--ranks", "x"]).is_err());
    }

    #[test]
    fn bad_values_are_refused_before_anything_runs() {
        for args in [
            &["rdzv", "bench", "store", "throughput", "--conns", "0"][..],
            &["rdzv", "bench", "store", "storm", "--ranks", "0"],
            &["rdzv", "bench", "store", "storm", "--client-threads", "0"],
            &["rdzv", "bench", "store", "latency", "--secs=-1"],
        ] {
            assert!(run_cli(cli(args)).is_err(), "{args:?}");
        }
    }

    #[test]
    fn a_small_storm_through_the_command_line_succeeds() {
        if harness::start_server(([127, 0, 0, 1], 0).into()).is_err() {
            eprintln!("SKIP: cannot start the io_uring store server here");
            return;
        }
        let code = run_cli(cli(&[
            "rdzv", "bench", "store", "--json", "storm", "--ranks", "16",
        ]))
        .unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
    }

    #[test]
    fn baseline_and_latency_compare_in_one_run() {
        let bar = ProgressBar::hidden();
        let results =
            round_trips(None, 36, Duration::from_millis(150), Duration::ZERO, &bar).unwrap();
        assert_eq!(results.len(), 1);
        assert!(matches!(&results[0], BenchResult::Baseline(r) if r.samples > 0));

        let target = match Target::open(None, None) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("SKIP: cannot start the io_uring store server here: {e}");
                return;
            }
        };
        let client = latency::AddRoundTrip::connect(
            target.addr,
            b"/bench-test/ratio".to_vec(),
            CONNECT_TIMEOUT,
        )
        .unwrap();
        let bytes = client.request_bytes();
        let results = round_trips(
            Some((client, "rdzv-embedded", true)),
            bytes,
            Duration::from_millis(200),
            Duration::from_millis(10),
            &bar,
        )
        .unwrap();
        assert_eq!(results.len(), 3);
        match &results[2] {
            BenchResult::LatencyRatio(r) => {
                assert!(r.p50_ratio > 0.0);
                assert_eq!(r.target, "rdzv-embedded");
            }
            other => panic!("expected a ratio, got {other:?}"),
        }
    }
}
