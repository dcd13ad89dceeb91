//! Argument parsing and the store subcommands.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};
use rdzv_uring::server::IdleSpin;
use rdzv_uring::{ServerOptions, StoreServer};

pub(crate) use crate::args::split_addr;
pub(crate) use crate::error::CliError;

/// rdzv: rendezvous, key-value stores and tensor RPC, compatible with PyTorch's c10d.
#[derive(Debug, Parser)]
#[command(name = "rdzv", version, about, long_about = None)]
pub(crate) struct Cli {
    /// How log lines on stderr look (the level comes from RUST_LOG, default `warn`).
    #[arg(long, global = true, value_enum, default_value_t)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per event.
    Json,
}

impl Cli {
    /// The log format asked for.
    pub(crate) fn log_format(&self) -> LogFormat {
        self.log_format
    }
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
    Bench(rdzv_bench::BenchCommand),
    /// Inspect the RDMA and CUDA stacks of this host.
    #[command(subcommand)]
    Rdma(RdmaOp),
    /// Join an elastic rendezvous (elastic://HOST:PORT/RUN_ID?nodes=MIN:MAX) as one node,
    /// print each round it is a member of, and heartbeat until killed.
    Rendezvous(crate::elastic_cli::RendezvousArgs),
    /// Show the elastic runs a store holds: round, state, members, waiting and struck
    /// nodes (from --metrics' /status.json, the keys, or etcd).
    Status(crate::status_cli::StatusArgs),
    /// Print a shell completion script (e.g. `rdzv completions bash > /etc/bash_completion.d/rdzv`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), or write one page per command into --out-dir.
    Man {
        /// Write `rdzv.1` and a page per subcommand (`rdzv-store.1`, …) here.
        #[arg(long)]
        out_dir: Option<std::path::PathBuf>,
    },
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
    #[command(flatten)]
    client: crate::store_client::ClientArgs,
    #[command(subcommand)]
    op: StoreOp,
}

#[derive(Debug, Subcommand)]
enum StoreOp {
    /// Run a TCPStore server until SIGINT/SIGTERM. Prints `listening on HOST:PORT` once
    /// it accepts connections.
    Serve {
        /// Listen on HOST:PORT (default: $RDZV_ADDR if set, else --host and --port).
        /// Refused, never ignored, when it cannot be bound or --host, --port or a
        /// listening socket also say where to listen.
        #[arg(long, value_name = "HOST:PORT")]
        addr: Option<String>,
        /// Address to listen on (default: all interfaces, IPv6 and IPv4).
        #[arg(long)]
        host: Option<String>,
        /// Port to listen on (0 picks a free one) [default: 29500, torch's MASTER_PORT
        /// default, where tcp:// and env:// rendezvous find a TCPStore; torchrun's
        /// --rdzv-endpoint defaults to 29400, so serve a torchrun rendezvous with
        /// --port 29400].
        #[arg(long)]
        port: Option<u16>,
        /// Event loops, each with its own listener (SO_REUSEPORT) and connections, all
        /// sharing one store (default: one per CPU this process may use, at most 16;
        /// one on hosts of 2 CPUs or fewer); see README, Performance.
        #[arg(long)]
        threads: Option<usize>,
        /// Pin loop i to the i-th CPU this process may use (slower on small VMs; off by
        /// default).
        #[arg(long)]
        pin: bool,
        /// Microseconds an idle loop keeps polling before it sleeps (0: sleep at
        /// once). Saves the sleep/wake-up syscalls between back-to-back requests.
        /// Default: 50 where CPUs are spare (at least 4, and twice the loops), else 0.
        #[arg(long)]
        spin_us: Option<u64>,
        /// Kernel interface: `io-uring`, `epoll`, or `auto` (epoll where the host refuses
        /// io_uring, as Docker's and RHEL 9's defaults do, with a log line; elsewhere
        /// whichever of the two measures cheaper per request here, in about 0.15 s).
        #[arg(long, default_value = "auto")]
        io: rdzv_uring::IoMode,
        /// Ranks expected to connect: warns at start when the listen backlog
        /// (net.core.somaxconn) or the open-file limit cannot hold that many.
        #[arg(long)]
        world_size: Option<u64>,
        /// Serve on this inherited, already-listening TCP socket instead of binding
        /// --host/--port (PyTorch's master_listen_fd). Without it, systemd socket
        /// activation (LISTEN_PID/LISTEN_FDS, fd 3) is used when set for this process.
        #[arg(long, value_name = "FD", conflicts_with = "host")]
        listen_fd: Option<i32>,
        /// Serve Prometheus metrics (the STATS figures, request-duration histograms per
        /// query type, and the process's CPU, memory and descriptors) at
        /// http://HOST:PORT/metrics; prints `metrics on ...`.
        #[arg(long, value_name = "HOST:PORT")]
        metrics: Option<String>,
        /// Admit only peers in these networks (CIDR,...; IPv4 and IPv6; an IPv4-mapped
        /// peer matches its IPv4 network); others are closed at accept and counted in
        /// STATS. Works with PyTorch's clients.
        #[arg(long, value_name = "CIDR,...")]
        allow: Option<String>,
        /// Require rdzv's AUTH query with a token from this file, each token optionally
        /// bound to a key prefix (format: README, "Limits and security", "Access
        /// control"). PyTorch clients are refused, with a log line.
        #[arg(long, value_name = "PATH")]
        token_file: Option<std::path::PathBuf>,
        /// The client flags, declared here under their own ids so that the `store`
        /// group's global client flags are not propagated to `serve` (clap skips an id
        /// a subcommand already has): hidden from `serve --help`, refused if given.
        #[command(flatten)]
        client_flags: NotForServe,
        #[command(flatten)]
        budget: ServeBudget,
    },
    #[command(flatten)]
    Client(crate::store_client::ClientOp),
}

/// The store client's flags as `serve` sees them: never shown, refused when given.
#[derive(Debug, Args)]
struct NotForServe {
    #[arg(long, hide = true)]
    connect_timeout: Option<f64>,
    #[arg(long, hide = true)]
    hex: bool,
    #[arg(short = 'o', long = "output", value_enum, hide = true)]
    output: Option<crate::store_client::Output>,
}

/// `serve --allow` and `serve --token-file`: parsed and checked (core's
/// `store::access`) into the policy the server loops enforce.
fn access_flags(
    allow: Option<&str>,
    token_file: Option<&std::path::Path>,
) -> Result<rdzv_core::store::access::AccessPolicy, CliError> {
    use rdzv_core::store::access::{AccessPolicy, Allowlist, TokenTable};
    let allow = allow.map(Allowlist::parse).transpose()?;
    let tokens = match token_file {
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("--token-file {}: {e}", path.display()))?;
            Some(
                TokenTable::parse(&bytes)
                    .map_err(|e| format!("--token-file {}: {e}", path.display()))?,
            )
        }
        None => None,
    };
    Ok(AccessPolicy::new(allow, tokens))
}

impl NotForServe {
    /// The first client flag given to `serve`, if any.
    fn given(&self) -> Option<&'static str> {
        if self.connect_timeout.is_some() {
            Some("--connect-timeout")
        } else if self.hex {
            Some("--hex")
        } else if self.output.is_some() {
            Some("--output")
        } else {
            None
        }
    }
}

/// Where `serve` listens: `--addr`, `RDZV_ADDR`, or `--host`/`--port`; `None` for the
/// host means all interfaces. Two sources that both say where are refused, never
/// silently ranked.
fn serve_address(
    addr: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    listen_fd: bool,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(Option<String>, u16), CliError> {
    let (addr, source) = match addr {
        Some(addr) => (Some(addr), "--addr"),
        None => (env("RDZV_ADDR").filter(|a| !a.is_empty()), "RDZV_ADDR"),
    };
    let Some(addr) = addr else {
        return Ok((host, port.unwrap_or(rdzv_uring::server::DEFAULT_PORT)));
    };
    let also = if host.is_some() {
        Some("--host")
    } else if port.is_some() {
        Some("--port")
    } else if listen_fd {
        Some("a listening socket (--listen-fd or systemd's LISTEN_FDS)")
    } else {
        None
    };
    if let Some(also) = also {
        return Err(format!(
            "{source} ({addr}) and {also} both say where `store serve` listens; give one \
             (unset RDZV_ADDR to use --host/--port)"
        )
        .into());
    }
    if addr.contains("://") {
        return Err(format!(
            "{source} ({addr}): `store serve` listens on HOST:PORT; a URL names a store to \
             connect to"
        )
        .into());
    }
    let (host, port) = split_addr(&addr).map_err(|e| format!("{source}: {e}"))?;
    Ok((Some(host), port))
}

/// `store serve`'s memory limits (README "Limits and security").
#[derive(Debug, clap::Args)]
struct ServeBudget {
    /// Most bytes one stored value may hold, what APPEND builds included (default:
    /// 8 MiB, PyTorch's limit). A write over it closes the writer's connection.
    #[arg(long, value_name = "BYTES")]
    max_value_bytes: Option<usize>,
    /// Most bytes the store holds in all: keys, values, queue elements and waited keys,
    /// each plus 64 bytes of bookkeeping (default: 2 GiB). A write over it closes the
    /// writer's connection.
    #[arg(long, value_name = "BYTES")]
    max_store_bytes: Option<usize>,
    /// Most bytes one connection holds: its unfinished request and its unsent replies
    /// (default: 64 MiB). A request or a reply over it closes the connection.
    #[arg(long, value_name = "BYTES")]
    max_conn_bytes: Option<usize>,
    /// A connection that owes more than this many reply bytes gets no more requests
    /// served until its peer reads (default: 4 MiB).
    #[arg(long, value_name = "BYTES")]
    out_high_water: Option<usize>,
}

impl ServeBudget {
    fn resolve(self) -> Result<rdzv::core::store::budget::Budget, CliError> {
        let mut budget = rdzv::core::store::budget::Budget::default();
        budget.max_value_bytes = self.max_value_bytes.unwrap_or(budget.max_value_bytes);
        budget.max_store_bytes = self.max_store_bytes.unwrap_or(budget.max_store_bytes);
        budget.max_conn_bytes = self.max_conn_bytes.unwrap_or(budget.max_conn_bytes);
        budget.out_high_water = self.out_high_water.unwrap_or(budget.out_high_water);
        if budget.out_high_water >= budget.max_conn_bytes {
            return Err(format!(
                "--out-high-water ({}) must be below --max-conn-bytes ({}): a connection \
                 needs room for one reply beyond the mark",
                budget.out_high_water, budget.max_conn_bytes
            )
            .into());
        }
        // A SET (or GET reply) of the largest value, with its key, must fit.
        let one_request = budget.max_value_bytes.saturating_add(16 << 10);
        if budget.max_conn_bytes < one_request {
            return Err(format!(
                "--max-conn-bytes ({}) must hold one request of the largest value \
                 (--max-value-bytes {} plus 16 KiB for its key): at least {one_request}",
                budget.max_conn_bytes, budget.max_value_bytes
            )
            .into());
        }
        Ok(budget)
    }
}

/// Runs the parsed command.
pub(crate) fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Store(args) => store(args),
        Command::Demo(args) => crate::demo::run(args),
        Command::Bench(command) => Ok(rdzv_bench::run(command)?),
        Command::DemoWorker(args) => crate::demo::worker(args),
        Command::Rendezvous(args) => crate::elastic_cli::run(args),
        Command::Status(args) => crate::status_cli::run(args),
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "rdzv", &mut script);
            std::io::stdout().lock().write_all(&script)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Man { out_dir } => man(out_dir),
        Command::Rdma(RdmaOp::Probe) => {
            print!("{}", rdzv::rdma::ViabilityReport::probe_env());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `rdzv man`: the page of `rdzv` on stdout, or every page into `out_dir`.
fn man(out_dir: Option<std::path::PathBuf>) -> Result<ExitCode, CliError> {
    let command = Cli::command();
    match out_dir {
        None => clap_mangen::Man::new(command).render(&mut std::io::stdout().lock())?,
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("creating {}: {e}", dir.display()))?;
            clap_mangen::generate_to(command, &dir)
                .map_err(|e| format!("writing the man pages into {}: {e}", dir.display()))?;
            println!("man pages written to {}", dir.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn store(args: StoreArgs) -> Result<ExitCode, CliError> {
    match args.op {
        StoreOp::Serve {
            addr,
            host,
            port,
            threads,
            pin,
            spin_us,
            io,
            world_size,
            listen_fd,
            metrics,
            allow,
            token_file,
            client_flags,
            budget,
        } => {
            if let Some(flag) = client_flags.given() {
                return Err(format!(
                    "{flag} is a client flag; `store serve` does not take it (see `rdzv store \
                     serve --help`)"
                )
                .into());
            }
            let access = access_flags(allow.as_deref(), token_file.as_deref())?;
            let metrics = match metrics {
                Some(addr) => Some(metrics_addr(&addr)?),
                None => None,
            };
            let listen_fd = match listen_fd {
                Some(fd) => Some(fd),
                None => systemd_listen_fd()?,
            };
            let (host, port) = serve_address(addr, host, port, listen_fd.is_some(), |name| {
                std::env::var(name).ok()
            })?;
            let options = ServerOptions {
                host,
                port,
                threads: match threads {
                    Some(0) => return Err("--threads must be at least 1".into()),
                    Some(n) => n,
                    None => 0,
                },
                pin,
                spin_before_park: match spin_us {
                    None => IdleSpin::Auto,
                    Some(0) => IdleSpin::Off,
                    Some(us) => IdleSpin::For(Duration::from_micros(us)),
                },
                io,
                listen_fd,
                metrics,
                access,
                limits: match budget.max_value_bytes {
                    // The wire limit follows, so that a larger value is not refused
                    // by the decoder first.
                    Some(bytes) => {
                        rdzv::core::store::codec::Limits::default().with_max_value_len(bytes as u64)
                    }
                    None => rdzv::core::store::codec::Limits::default(),
                },
                budget: budget.resolve()?,
                ..ServerOptions::default()
            };
            serve(options, world_size)
        }
        StoreOp::Client(op) => crate::store_client::run(args.client, op),
    }
}

/// The socket systemd passed (fd 3) when `LISTEN_PID` names this process; the
/// variables are then removed so that children do not take them for theirs
/// (`sd_listen_fds(1)`).
fn systemd_listen_fd() -> Result<Option<i32>, CliError> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let found = rdzv_uring::server::listener::systemd_listen_fd(
        pid.as_deref(),
        fds.as_deref(),
        std::process::id(),
    )
    .map_err(|e| format!("systemd socket activation: {e}"))?;
    let Some((fd, count)) = found else {
        return Ok(None);
    };
    for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(name);
    }
    if count > 1 {
        tracing::warn!(
            count,
            "systemd passed {count} sockets; the store serves on the first (fd {fd}) only"
        );
    }
    tracing::info!(fd, "serving on the socket systemd passed");
    Ok(Some(fd))
}

/// The address of `--metrics HOST:PORT` (the first the host resolves to).
fn metrics_addr(addr: &str) -> Result<std::net::SocketAddr, CliError> {
    let (host, port) = split_addr(addr).map_err(|e| format!("--metrics: {e}"))?;
    (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("--metrics: cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("--metrics: {host} resolves to no address").into())
}

/// Splits `HOST:PORT` (or `[V6]:PORT`) and checks that it resolves.
fn serve(options: ServerOptions, world_size: Option<u64>) -> Result<ExitCode, CliError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    // One descriptor per rank: take all the kernel allows this process.
    let open_files = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => {
            tracing::info!(
                limit,
                "open-file limit (RLIMIT_NOFILE) raised to the hard limit"
            );
            Some(limit)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot raise the open-file limit (RLIMIT_NOFILE)");
            rlimit::getrlimit(rlimit::Resource::NOFILE)
                .ok()
                .map(|(soft, _)| soft)
        }
    };
    if let (Some(world_size), Some(open_files)) = (world_size, open_files) {
        let somaxconn = rdzv_uring::server::listener::somaxconn();
        for line in
            rdzv_uring::server::capacity::capacity_shortfalls(world_size, somaxconn, open_files)
        {
            tracing::warn!("{line}");
        }
    }
    // Block the signals before any thread starts, then wait for them here.
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    let server = StoreServer::start(options)?;
    println!("listening on {}", server.local_addr());
    if let Some(addr) = server.metrics_addr() {
        println!("metrics on http://{addr}/metrics");
    }
    std::io::stdout().flush()?;
    // Type=notify (contrib/rdzv-store.service): clients can connect from now on.
    tell_systemd("READY=1");
    if let Some(signal) = signals.forever().next() {
        tracing::info!(signal, "stopping the store server");
    }
    tell_systemd("STOPPING=1");
    server.shutdown();
    Ok(ExitCode::SUCCESS)
}

/// Tells systemd `state` where it asked to be told (`$NOTIFY_SOCKET`); a failure is
/// logged, never fatal: the server serves either way.
fn tell_systemd(state: &str) {
    match crate::sd_notify::notify(state) {
        Ok(sent) => tracing::debug!(state, sent, "sd_notify"),
        Err(error) => tracing::warn!(%error, state, "cannot notify systemd"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store_client::test_env as env;

    #[test]
    fn serve_listens_where_one_source_says() {
        let none = env(&[]);
        let dflt = rdzv_uring::server::DEFAULT_PORT;
        assert_eq!(
            serve_address(None, None, None, false, &none).unwrap(),
            (None, dflt)
        );
        assert_eq!(
            serve_address(Some("127.0.0.1:7".into()), None, None, false, &none).unwrap(),
            (Some("127.0.0.1".into()), 7)
        );
        let rdzv = env(&[("RDZV_ADDR", "[::1]:9")]);
        assert_eq!(
            serve_address(None, None, None, false, &rdzv).unwrap(),
            (Some("::1".into()), 9)
        );
        // --addr wins over the environment: it is the more explicit of the two.
        assert_eq!(
            serve_address(Some("127.0.0.1:7".into()), None, None, false, &rdzv).unwrap(),
            (Some("127.0.0.1".into()), 7)
        );
        for (host, port, fd) in [
            (Some("h".to_string()), None, false),
            (None, Some(1), false),
            (None, None, true),
        ] {
            let err = serve_address(None, host, port, fd, &rdzv)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("RDZV_ADDR") && err.contains("both say"),
                "{err}"
            );
        }
        let err = serve_address(Some("etcd://h:2379".into()), None, None, false, &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("HOST:PORT"), "{err}");
        assert!(serve_address(Some("nocolon".into()), None, None, false, &none).is_err());
    }

    #[test]
    fn serve_help_shows_only_server_flags() {
        let mut command = Cli::command();
        let store = command.find_subcommand_mut("store").expect("store");
        let serve = store.find_subcommand_mut("serve").expect("serve");
        let help = serve.render_long_help().to_string();
        for client in ["--connect-timeout", "--hex", "--output"] {
            assert!(!help.contains(client), "{client} in serve --help:\n{help}");
        }
        assert!(help.contains("--addr") && help.contains("--port"), "{help}");
        Cli::command().debug_assert();
    }

    #[test]
    fn client_flags_given_to_serve_are_refused() {
        for args in [
            &["rdzv", "store", "serve", "--hex"][..],
            &["rdzv", "store", "--connect-timeout", "3", "serve"],
            &["rdzv", "store", "-o", "json", "serve"],
        ] {
            let cli = Cli::try_parse_from(args).expect("parses");
            let err = run(cli).unwrap_err().to_string();
            assert!(err.contains("client flag"), "{args:?}: {err}");
        }
    }
}
