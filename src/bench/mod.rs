//! `rdzv bench store`: measure a TCPStore server with the real protocol.
//!
//! Without `--addr` it starts rdzv's own server (`rdzv_uring::StoreServer`) in this
//! process on `127.0.0.1`; with `--addr` it measures any compatible server, PyTorch's
//! included. Four modes:
//!
//! - `latency`: one connection's `ADD` round trip (`--compare-baseline` interleaves a raw
//!   ping-pong of the same size and reports the ratio, both from the same run);
//! - `throughput --conns 1,64,512 --secs S`: N connections doing `ADD` + `GET`, one
//!   request in flight each, on an event-driven client (`--plot FILE.svg` draws the curve);
//! - `storm --ranks N`: N ranks connect at once, `VALIDATE`, `PING`, `ADD` a counter, the
//!   last sets `done`, all `WAIT`; checks every rank is released and the counter is N
//!   (the ranks are spread over `--client-threads` epoll loops, one per core by default);
//! - `baseline`: the raw loopback ping-pong alone.
//!
//! Results are tables (with progress bars on a terminal) or, with `--json`, one JSON
//! object per result. This module parses options, sets up the target and the open-file
//! limit, and runs the drivers in `latency`, `throughput` and `storm`; the measuring is
//! theirs and the formatting is `report`'s.

mod conn;
mod cpu;
mod latency;
mod plot;
mod rendezvous;
mod report;
mod rpc;
mod storm;
mod throughput;

use std::io::{IsTerminal as _, Write as _};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, Subcommand};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rdzv_core::store::codec::DecodeError;
use rdzv_core::store::Request;
use rdzv_uring::{ServerOptions, StoreServer};

use crate::error::CliError;
use report::{
    BenchResult, LatencySummary, RoundTripRatio, RoundTripResult, StormResult, ThroughputResult,
};

/// What `rdzv bench` measures.
#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
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
pub(crate) struct StoreBenchArgs {
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
        /// Seconds to measure (each, with --compare-baseline).
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        /// Seconds run before measuring.
        #[arg(long, default_value_t = 0.2)]
        warmup_secs: f64,
        /// Also measure a raw loopback ping-pong of the same size, interleaved with the
        /// store in 100 ms slices, and report the ratio.
        #[arg(long)]
        compare_baseline: bool,
    },
    /// Many connections doing ADD then GET on their own key, one request in flight each.
    Throughput {
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
    },
    /// N ranks connect at once, VALIDATE, PING, ADD a counter; the last sets "done";
    /// everyone WAITs. Fails unless every rank is released and the counter is exactly N.
    Storm {
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
    },
    /// A raw TCP ping-pong over loopback, as many bytes each way as an ADD exchange:
    /// the floor for the store's round trip.
    Baseline {
        /// Seconds to measure.
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        /// Seconds run before measuring.
        #[arg(long, default_value_t = 0.2)]
        warmup_secs: f64,
    },
}

/// What can go wrong measuring a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum BenchError {
    /// `--addr` did not resolve.
    #[error("cannot resolve the store address {addr}: {source}")]
    Resolve {
        /// What was given.
        addr: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The embedded server did not start.
    #[error("cannot start the embedded store server: {0}")]
    Server(#[from] rdzv_uring::server::ServerError),
    /// A connection could not be made.
    #[error("cannot connect to the store at {addr}: {source}")]
    Connect {
        /// The store.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// A socket (or epoll) call failed.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server's reply did not decode.
    #[error("malformed reply to {query}: {source}")]
    Decode {
        /// The query it answers.
        query: &'static str,
        /// The codec's error.
        #[source]
        source: DecodeError,
    },
    /// The server's reply decoded but was not what the protocol or the load expects.
    #[error("unexpected reply to {query}: expected {expected}")]
    UnexpectedReply {
        /// The query it answers.
        query: &'static str,
        /// What was expected.
        expected: &'static str,
    },
    /// Bytes arrived while no reply was owed.
    #[error("the server sent {len} bytes that answer no request")]
    UnexpectedBytes {
        /// How many.
        len: usize,
    },
    /// The server closed a connection in the middle of the load.
    #[error("the server closed the connection")]
    ServerClosed,
    /// CPU accounting (`--server-pid`) could not read a process's CPU time.
    #[error("cannot measure CPU time: {0}")]
    CpuTime(#[source] cpu::CpuTimeError),
    /// Not every connection was ready in time.
    #[error("only {ready} of {wanted} connections were ready after {seconds:.1} s")]
    SetupTimeout {
        /// Connections that had their PING answered.
        ready: usize,
        /// Connections wanted.
        wanted: usize,
        /// The limit.
        seconds: f64,
    },
    /// The open-file limit is too low for the run, even raised to its hard limit.
    #[error(
        "this run needs about {needed} open files but the limit is {limit} even after raising \
         the soft limit to the hard limit; raise the hard limit (`ulimit -Hn`, \
         /etc/security/limits.conf, or systemd LimitNOFILE)"
    )]
    FdLimit {
        /// Descriptors the run needs.
        needed: u64,
        /// The limit after raising.
        limit: u64,
    },
    /// A latency histogram could not be created or merged.
    #[error("latency histogram: {0}")]
    Histogram(String),
    /// The plot could not be drawn or written.
    #[error("cannot draw the plot: {0}")]
    Plot(String),
    /// A client thread panicked.
    #[error("a client thread panicked")]
    ClientThreadPanicked,
    /// An option's value is out of range.
    #[error("{0}")]
    InvalidArgument(String),
}

/// A histogram of nanoseconds from 1 ns to 10 minutes, 3 significant digits.
pub(crate) fn new_histogram() -> Result<Histogram<u64>, BenchError> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3)
        .map_err(|e| BenchError::Histogram(format!("{e:?}")))
}

/// Runs `rdzv bench ...`.
pub(crate) fn run(command: BenchCommand) -> Result<ExitCode, CliError> {
    match command {
        BenchCommand::Store(args) => store(args),
        BenchCommand::Plot { input, out } => {
            let text = if input.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
            } else {
                std::fs::read_to_string(&input)
            }
            .map_err(|e| format!("cannot read {}: {e}", input.display()))?;
            let results = report::throughput_from_json_lines(&text)
                .map_err(|e| format!("{}: {e}", input.display()))?;
            plot::throughput_svg(&out, &results)?;
            eprintln!(
                "plot of {} throughput results written to {}",
                results.len(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        BenchCommand::Rpc(args) => rpc::run(args),
        BenchCommand::Rendezvous(args) => rendezvous::run(args),
    }
}

/// Where the load goes: an embedded server (kept alive here) or a remote one.
struct Target {
    addr: SocketAddr,
    label: String,
    embedded: Option<StoreServer>,
}

impl Target {
    fn open(addr: Option<&str>, label: Option<String>) -> Result<Target, BenchError> {
        match addr {
            Some(given) => {
                let resolved = given
                    .to_socket_addrs()
                    .map_err(|source| BenchError::Resolve {
                        addr: given.to_string(),
                        source,
                    })?
                    .next()
                    .ok_or_else(|| BenchError::Resolve {
                        addr: given.to_string(),
                        source: std::io::ErrorKind::NotFound.into(),
                    })?;
                Ok(Target {
                    addr: resolved,
                    label: label.unwrap_or_else(|| given.to_string()),
                    embedded: None,
                })
            }
            None => {
                let server = StoreServer::start(ServerOptions {
                    host: Some("127.0.0.1".into()),
                    port: 0,
                    ..ServerOptions::default()
                })?;
                Ok(Target {
                    addr: server.local_addr(),
                    label: label.unwrap_or_else(|| "rdzv-embedded".into()),
                    embedded: Some(server),
                })
            }
        }
    }

    /// File descriptors the server side of `conns` connections costs this process.
    fn server_fds(&self, conns: usize) -> u64 {
        if self.embedded.is_some() {
            conns as u64
        } else {
            0
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(server) = self.embedded.take() {
            server.shutdown();
        }
    }
}

fn seconds(value: f64, option: &str) -> Result<Duration, BenchError> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        BenchError::InvalidArgument(format!(
            "{option} must be a non-negative number of seconds, got {value}"
        ))
    })
}

/// A prefix no other run uses, so that runs against a shared server do not collide.
fn key_prefix(mode: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("/rdzv-bench/{}-{nanos}/{mode}", std::process::id())
}

/// Raises the soft open-file limit to the hard limit and checks it covers `needed`.
fn ensure_fd_limit(needed: u64) -> Result<u64, BenchError> {
    let limit = rlimit::increase_nofile_limit(u64::MAX).map_err(|source| BenchError::Io {
        what: "raise the open-file limit (RLIMIT_NOFILE)",
        source,
    })?;
    tracing::debug!(limit, needed, "open-file limit");
    if limit < needed {
        return Err(BenchError::FdLimit { needed, limit });
    }
    Ok(limit)
}

fn progress_bar(json: bool, template: &str) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

const TIME_BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len} ms";
const RANK_BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len} released ({elapsed})";

fn store(args: StoreBenchArgs) -> Result<ExitCode, CliError> {
    let json = args.json;
    let mut ok = true;
    let results = match args.mode {
        Mode::Baseline { secs, warmup_secs } => {
            let measure = seconds(secs, "--secs")?;
            let warmup = seconds(warmup_secs, "--warmup-secs")?;
            let key = format!("{}/counter", key_prefix("latency")).into_bytes();
            let request_bytes = Request::Add {
                key: &key,
                delta: 1,
            }
            .encoded_len();
            let bar = progress_bar(json, TIME_BAR);
            bar.set_message("raw ping-pong");
            let result = round_trips(None, request_bytes, measure, warmup, &bar)?;
            bar.finish_and_clear();
            result
        }
        Mode::Latency {
            secs,
            warmup_secs,
            compare_baseline,
        } => {
            let measure = seconds(secs, "--secs")?;
            let warmup = seconds(warmup_secs, "--warmup-secs")?;
            let target = Target::open(args.addr.as_deref(), args.label)?;
            let key = format!("{}/counter", key_prefix("latency")).into_bytes();
            let store = latency::AddRoundTrip::connect(target.addr, key, CONNECT_TIMEOUT)?;
            let request_bytes = store.request_bytes();
            let bar = progress_bar(json, TIME_BAR);
            bar.set_message("ADD round trips");
            let results = round_trips(
                Some((store, &target.label, compare_baseline)),
                request_bytes,
                measure,
                warmup,
                &bar,
            )?;
            bar.finish_and_clear();
            results
        }
        Mode::Throughput {
            conns,
            secs,
            warmup_secs,
            client_threads,
            plot,
            server_pid,
            setup_timeout_secs,
        } => {
            let measure = seconds(secs, "--secs")?;
            let setup_timeout = seconds(setup_timeout_secs, "--setup-timeout-secs")?;
            let warmup = seconds(warmup_secs, "--warmup-secs")?;
            if conns.is_empty() || conns.contains(&0) {
                return Err(BenchError::InvalidArgument(
                    "--conns must list connection counts of at least 1".into(),
                )
                .into());
            }
            let target = Target::open(args.addr.as_deref(), args.label)?;
            let most = conns.iter().copied().max().unwrap_or(1);
            ensure_fd_limit(most as u64 + target.server_fds(most) + FD_SLACK)?;
            let mut results = Vec::with_capacity(conns.len());
            for &n in &conns {
                let bar = progress_bar(json, TIME_BAR);
                bar.set_message(format!("{n} connections"));
                let plan = throughput::ThroughputPlan {
                    addr: target.addr,
                    conns: n,
                    threads: client_threads.max(1),
                    warmup,
                    measure,
                    key_prefix: key_prefix("throughput"),
                    setup_timeout,
                    client_cpu: target.embedded.is_none(),
                    server_pid,
                };
                let outcome = throughput::run(&plan, &bar)?;
                bar.finish_and_clear();
                let result = ThroughputResult {
                    target: target.label.clone(),
                    conns: outcome.conns,
                    client_threads: outcome.threads,
                    seconds: outcome.seconds,
                    ops: outcome.ops,
                    ops_per_s: per_second(outcome.ops, outcome.seconds),
                    latency: LatencySummary::from_ns(&outcome.latency_ns),
                    client_cpu_us_per_op: outcome
                        .client_cpu
                        .and_then(|cpu| cpu::us_per_op(cpu, outcome.ops)),
                    server_cpu_us_per_op: outcome
                        .server_cpu
                        .and_then(|cpu| cpu::us_per_op(cpu, outcome.ops)),
                };
                if !json && conns.len() > 1 && std::io::stderr().is_terminal() {
                    // Show each row as it completes on long lists.
                    eprint!(
                        "{}",
                        report::to_table(&[BenchResult::Throughput(result.clone())])
                    );
                }
                results.push(result);
            }
            if let Some(path) = plot {
                plot::throughput_svg(&path, &results)?;
                if !json {
                    eprintln!("plot written to {}", path.display());
                }
            }
            results.into_iter().map(BenchResult::Throughput).collect()
        }
        Mode::Storm {
            ranks,
            timeout_secs,
            client_threads,
        } => {
            let timeout = seconds(timeout_secs, "--timeout-secs")?;
            if ranks == 0 {
                return Err(
                    BenchError::InvalidArgument("--ranks must be at least 1".into()).into(),
                );
            }
            let target = Target::open(args.addr.as_deref(), args.label)?;
            let limit = ensure_fd_limit(ranks as u64 + target.server_fds(ranks) + FD_SLACK)
                .inspect_err(|e| {
                    if let (BenchError::FdLimit { limit, .. }, true) =
                        (e, target.embedded.is_some())
                    {
                        if *limit >= ranks as u64 + FD_SLACK {
                            eprintln!(
                                "note: the embedded server's sockets count against this \
                                 process's limit too; a server of its own (`rdzv store serve`, \
                                 then --addr) leaves {ranks} ranks within it"
                            );
                        }
                    }
                })?;
            if let Some(backlog) = rdzv_uring::server::listener::somaxconn() {
                if (backlog as usize) < ranks {
                    eprintln!(
                        "note: net.core.somaxconn={backlog} is below {ranks} ranks: a server \
                         slower to accept than the storm arrives will see its listen queue \
                         overflow (SYNs dropped, connects retried after 1 s or more)"
                    );
                }
            }
            tracing::info!(limit, ranks, "storm: open-file limit");
            let threads = match client_threads {
                Some(0) => {
                    return Err(BenchError::InvalidArgument(
                        "--client-threads must be at least 1".into(),
                    )
                    .into())
                }
                Some(n) => n,
                None => std::thread::available_parallelism().map_or(1, |n| n.get()),
            };
            let plan = storm::StormPlan {
                addr: target.addr,
                ranks,
                threads,
                timeout,
                key_prefix: key_prefix("storm"),
            };
            let bar = progress_bar(json, RANK_BAR);
            bar.set_message(format!("storm of {ranks}"));
            let outcome = storm::run(&plan, &bar)?;
            bar.finish_and_clear();
            let counter =
                match storm::read_counter(target.addr, &plan.counter_key(), CONNECT_TIMEOUT) {
                    Ok(counter) => counter,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the storm counter back");
                        None
                    }
                };
            let result = StormResult {
                target: target.label.clone(),
                ranks,
                client_threads: outcome.threads,
                seconds: outcome.seconds,
                all_connected_seconds: outcome.all_connected_seconds,
                released: outcome.released,
                failed: outcome.failed,
                connect_retries: outcome.connect_retries,
                counter,
                counter_ok: outcome.add_results_ok && counter == i64::try_from(ranks).ok(),
                release_p50_seconds: outcome.release_ns.value_at_quantile(0.5) as f64 / 1e9,
                release_p99_seconds: outcome.release_ns.value_at_quantile(0.99) as f64 / 1e9,
                first_error: outcome.first_error,
            };
            ok = result.succeeded();
            vec![BenchResult::Storm(result)]
        }
    };
    let mut stdout = std::io::stdout().lock();
    if json {
        stdout.write_all(report::to_json_lines(&results)?.as_bytes())?;
    } else {
        stdout.write_all(report::to_table(&results).as_bytes())?;
    }
    stdout.flush()?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
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
    let want_raw = match &store {
        Some((_, _, compare)) => *compare,
        None => true,
    };
    let (label, mut store) = match store {
        Some((client, label, _)) => (label.to_string(), Some(client)),
        None => (String::new(), None),
    };
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

    let result =
        |target: String, op: &'static str, hist: &Histogram<u64>, time: Duration| RoundTripResult {
            target,
            op,
            request_bytes,
            reply_bytes,
            samples: hist.len(),
            seconds: time.as_secs_f64(),
            ops_per_s: per_second(hist.len(), time.as_secs_f64()),
            latency: LatencySummary::from_ns(hist),
        };
    let mut results = Vec::new();
    if store.is_some() {
        results.push(BenchResult::Latency(result(
            label.clone(),
            "ADD",
            &store_hist,
            store_time,
        )));
    }
    if want_raw {
        results.push(BenchResult::Baseline(result(
            "raw-loopback".into(),
            "ping-pong",
            &raw_hist,
            raw_time,
        )));
    }
    if store.is_some() && want_raw {
        let s = LatencySummary::from_ns(&store_hist);
        let r = LatencySummary::from_ns(&raw_hist);
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
    Ok(results)
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

    #[test]
    fn key_prefixes_differ_between_calls() {
        let a = key_prefix("storm");
        std::thread::sleep(Duration::from_millis(1));
        let b = key_prefix("storm");
        assert_ne!(a, b);
        assert!(a.starts_with("/rdzv-bench/") && a.ends_with("/storm"));
    }

    #[test]
    fn seconds_rejects_negative_and_nan() {
        assert_eq!(seconds(1.5, "--secs").unwrap(), Duration::from_millis(1500));
        assert!(seconds(-1.0, "--secs").is_err());
        assert!(seconds(f64::NAN, "--secs").is_err());
    }

    #[test]
    fn the_fd_limit_is_raised_and_checked() {
        let limit = ensure_fd_limit(16).unwrap();
        assert!(limit >= 16);
        match ensure_fd_limit(u64::MAX) {
            Err(BenchError::FdLimit { needed, .. }) => assert_eq!(needed, u64::MAX),
            other => panic!("expected FdLimit, got {other:?}"),
        }
    }

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
    fn run_cli(cli: Cli) -> Result<ExitCode, CliError> {
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
        if StoreServer::start(ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            ..ServerOptions::default()
        })
        .is_err()
        {
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
