//! Argument parsing and the store subcommands.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::{ServerOptions, Store, StoreError, StoreServer};

/// Errors the CLI reports: one line on stderr, exit code 1.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// rdzv: rendezvous, key-value stores and tensor RPC, compatible with PyTorch's c10d.
#[derive(Debug, Parser)]
#[command(name = "rdzv", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a store server, or talk to one.
    Store(StoreArgs),
    /// Start an embedded store and N worker processes that rendezvous through tcp://,
    /// meet at a barrier and all-gather their names; print what happened.
    Demo(crate::demo::DemoArgs),
    /// Measure a store: round-trip latency, throughput, connection storms.
    #[command(subcommand)]
    Bench(crate::bench::BenchCommand),
    /// Inspect the RDMA and CUDA stacks of this host.
    #[command(subcommand)]
    Rdma(RdmaOp),
    /// Join an elastic rendezvous (elastic://HOST:PORT/RUN_ID?nodes=MIN:MAX) as one node,
    /// print each round it is a member of, and heartbeat until killed.
    Rendezvous(crate::elastic_cli::RendezvousArgs),
    /// Internal: one worker of `rdzv demo`.
    #[command(hide = true)]
    DemoWorker(crate::demo::WorkerArgs),
}

#[derive(Debug, Subcommand)]
enum RdmaOp {
    /// Say whether the IBV transport and the CUDA channels can run here, and why not.
    /// Honours RDZV_IB_DEVICE, RDZV_IB_PORT and RDZV_IB_GID_INDEX.
    Probe,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = false)]
struct StoreArgs {
    /// The store to talk to, as HOST:PORT (not needed for `serve`).
    #[arg(long, global = true)]
    addr: Option<String>,
    /// Timeout for connecting and for blocking calls, in seconds.
    #[arg(long, global = true, default_value_t = 30.0)]
    connect_timeout: f64,
    #[command(subcommand)]
    op: StoreOp,
}

#[derive(Debug, Subcommand)]
enum StoreOp {
    /// Run a TCPStore server until SIGINT/SIGTERM. Prints `listening on HOST:PORT` once
    /// it accepts connections.
    Serve {
        /// Address to listen on (default: all interfaces, IPv6 and IPv4).
        #[arg(long)]
        host: Option<String>,
        /// Port to listen on (0 picks a free one).
        #[arg(long, default_value_t = rdzv_uring::server::DEFAULT_PORT)]
        port: u16,
        /// Executor threads. One owns the key space; see ARCHITECTURE.md.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Pin executors to CPUs (slower on small VMs; off by default).
        #[arg(long)]
        pin: bool,
        /// Microseconds an idle executor keeps polling before it sleeps (0: sleep at
        /// once). Saves the sleep/wake-up syscalls between back-to-back requests.
        #[arg(long, default_value_t = 0)]
        spin_us: u64,
        /// Event loop of a one-thread server: `io-uring` (one system call per batch of
        /// requests) or `glommio`. More threads always use glommio.
        #[arg(long, default_value = "io-uring")]
        backend: rdzv_uring::Backend,
    },
    /// Set KEY to VALUE.
    Set { key: String, value: String },
    /// Print the value of KEY (waits for it up to the timeout).
    Get { key: String },
    /// Add N to the counter KEY and print the result.
    Add {
        key: String,
        #[arg(allow_hyphen_values = true)]
        n: i64,
    },
    /// Wait until every KEY exists.
    Wait {
        #[arg(required = true)]
        keys: Vec<String>,
        /// Seconds to wait (default: the connect timeout).
        #[arg(long)]
        timeout: Option<f64>,
    },
    /// Print `true` if every KEY exists, else `false` (exit code 1).
    Check {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Delete KEY; prints whether it existed.
    Delete { key: String },
    /// List the user keys.
    Keys,
    /// Print the number of keys (PyTorch counts internal keys too).
    NumKeys,
}

fn seconds(s: f64, what: &str) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| format!("{what} must be a non-negative number of seconds, got {s}").into())
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Store(args) => store(args),
        Command::Demo(args) => crate::demo::run(args),
        Command::Bench(command) => crate::bench::run(command),
        Command::DemoWorker(args) => crate::demo::worker(args),
        Command::Rendezvous(args) => crate::elastic_cli::run(args),
        Command::Rdma(RdmaOp::Probe) => {
            print!("{}", rdzv::rdma::ViabilityReport::probe_env());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn store(args: StoreArgs) -> Result<ExitCode, CliError> {
    let timeout = seconds(args.connect_timeout, "--connect-timeout")?;
    if let StoreOp::Serve {
        host,
        port,
        threads,
        pin,
        spin_us,
        backend,
    } = args.op
    {
        return serve(host, port, threads, pin, spin_us, backend);
    }
    let addr = args
        .addr
        .ok_or("this command needs --addr HOST:PORT (the store to talk to)")?;
    let (host, port) = split_addr(&addr)?;
    let store = TcpStore::connect(&host, port, timeout)
        .map_err(|e| format!("cannot reach the store at {addr}: {e}"))?;
    let mut stdout = std::io::stdout().lock();
    match args.op {
        StoreOp::Serve { .. } => unreachable!("handled above"),
        StoreOp::Set { key, value } => {
            store.set(&key, value.as_bytes())?;
            // SET has no reply; a round trip makes sure the server has applied it.
            store.check(&[&key])?;
        }
        StoreOp::Get { key } => {
            let value = store.get(&key)?;
            stdout.write_all(&value)?;
            stdout.write_all(b"\n")?;
        }
        StoreOp::Add { key, n } => writeln!(stdout, "{}", store.add(&key, n)?)?,
        StoreOp::Wait { keys, timeout: t } => {
            let t = t.map(|t| seconds(t, "--timeout")).transpose()?;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.wait(&refs, t) {
                Ok(()) => {}
                Err(e @ StoreError::Timeout { .. }) => {
                    eprintln!("rdzv: timeout: {e}");
                    return Ok(ExitCode::from(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
        StoreOp::Check { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let ready = store.check(&refs)?;
            writeln!(stdout, "{ready}")?;
            if !ready {
                return Ok(ExitCode::FAILURE);
            }
        }
        StoreOp::Delete { key } => writeln!(stdout, "{}", store.delete_key(&key)?)?,
        StoreOp::Keys => {
            for key in store.list_keys()? {
                writeln!(stdout, "{key}")?;
            }
        }
        StoreOp::NumKeys => writeln!(stdout, "{}", store.num_keys()?)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Splits `HOST:PORT` (or `[V6]:PORT`) and checks that it resolves.
pub fn split_addr(addr: &str) -> Result<(String, u16), CliError> {
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| format!("--addr must be HOST:PORT, got {addr:?}"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port must have value from 0 to 65535 but was {port}."))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?;
    Ok((host, port))
}

fn serve(
    host: Option<String>,
    port: u16,
    threads: usize,
    pin: bool,
    spin_us: u64,
    backend: rdzv_uring::Backend,
) -> Result<ExitCode, CliError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    if threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    // Block the signals before any thread starts, then wait for them here.
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    let server = StoreServer::start(ServerOptions {
        host,
        port,
        threads,
        pin,
        spin_before_park: (spin_us > 0).then(|| Duration::from_micros(spin_us)),
        backend,
        ..ServerOptions::default()
    })?;
    println!("listening on {}", server.local_addr());
    std::io::stdout().flush()?;
    if let Some(signal) = signals.forever().next() {
        tracing::info!(signal, "stopping the store server");
    }
    server.shutdown();
    Ok(ExitCode::SUCCESS)
}
