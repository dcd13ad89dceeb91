//! `rdzv rendezvous elastic://…`: join an elastic rendezvous as one node, print every
//! round this node becomes a member of, and keep heartbeating until killed. Operators use
//! it to watch or poke a job's rendezvous (a node that joins a full job is a hot spare; one
//! that joins a job with room makes the job re-rendezvous).
//!
//! Output, one line per event, on stdout:
//! `round R rank K world_size N store_prefix P`, `waiting after round R (hot spare|asked
//! for the next round)`, `left`. SIGINT and SIGTERM make the node leave (which ends the
//! round it is part of) and exit 0. When the run is closed, a hot spare prints `graceful
//! exit` and exits 0 (PyTorch's `RendezvousGracefulExitError`); a member fails with
//! `RendezvousClosedError`.
//!
//! `rdzv rendezvous --close elastic://…` closes the run for good instead of joining
//! (torchelastic's `set_closed`): every node's next rendezvous fails, nodes waiting in an
//! open round are woken, and the run id cannot be used again.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use rdzv_core::rendezvous::elastic::{ElasticErrorKind, ElasticUrl, StoreAction};
use rdzv_uring::rendezvous::elastic::{default_node_id, ElasticFailure, ElasticRendezvous};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::Store;

use crate::cli::CliError;

/// Options of `rdzv rendezvous`.
#[derive(Debug, Args)]
pub(crate) struct RendezvousArgs {
    /// elastic://HOST:PORT/RUN_ID?nodes=MIN:MAX&last_call=30s&join_timeout=600s&
    /// keep_alive_interval=5s&keep_alive_max_attempts=3 (the store at HOST:PORT must be
    /// running, e.g. `rdzv store serve`).
    url: String,
    /// This node's name (default: HOST_PID_0, as PyTorch's node descriptors).
    #[arg(long)]
    node_id: Option<String>,
    /// Timeout for connecting to the store, in seconds.
    #[arg(long, default_value_t = 30.0)]
    connect_timeout: f64,
    /// Close the run for good instead of joining it (torchelastic's `set_closed`).
    #[arg(long)]
    close: bool,
}

/// Runs `rdzv rendezvous`.
pub(crate) fn run(args: RendezvousArgs) -> Result<ExitCode, CliError> {
    let url = ElasticUrl::parse(&args.url).map_err(|e| format!("{}: {e}", args.url))?;
    let node = match (args.node_id, url.node_id.clone()) {
        (Some(_), Some(_)) => {
            return Err("give the node id once: --node-id or node_id= in the URL".into())
        }
        (Some(node), None) | (None, Some(node)) => node,
        (None, None) => default_node_id(),
    };
    if args.close {
        return close(&url, args.connect_timeout);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    let timeout = Duration::try_from_secs_f64(args.connect_timeout)
        .map_err(|_| "--connect-timeout must be a non-negative number of seconds")?;
    let store = TcpStore::connect(&url.host, url.port, timeout)
        .map_err(|e| format!("connecting to the store at {}:{}: {e}", url.host, url.port))?;
    let settings = url.settings.clone();
    let handle = ElasticRendezvous::start(Arc::new(store), settings, node.clone())?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "node {node} joining rendezvous {} (nodes {}:{}) at {}:{}",
        url.settings.run_id, url.settings.nodes.min, url.settings.nodes.max, url.host, url.port
    )?;
    out.flush()?;
    let mut last_round = None;
    let mut reported_wait = None;
    while !stop.load(Ordering::Relaxed) {
        match handle.next_round(last_round, Duration::from_millis(200)) {
            Ok(round) => {
                writeln!(
                    out,
                    "round {} rank {} world_size {} store_prefix {}",
                    round.round, round.rank, round.world_size, round.store_prefix
                )?;
                out.flush()?;
                last_round = Some(round.round);
            }
            Err(ElasticFailure::NotYet { .. }) => {
                let waiting = handle.waiting();
                if waiting.is_some() && waiting != reported_wait {
                    if let Some((round, hot_spare)) = waiting {
                        let how = if hot_spare {
                            "hot spare"
                        } else {
                            "asked for the next round"
                        };
                        writeln!(out, "waiting after round {round} ({how})")?;
                        out.flush()?;
                    }
                    reported_wait = waiting;
                }
            }
            Err(failure) if failure.kind() == ElasticErrorKind::GracefulExit => {
                writeln!(out, "graceful exit: {failure}")?;
                return Ok(ExitCode::SUCCESS);
            }
            Err(failure) => return Err(failure.into()),
        }
    }
    let left = handle.leave(Duration::from_secs(30));
    writeln!(out, "{}", if left { "left" } else { "leaving timed out" })?;
    Ok(ExitCode::SUCCESS)
}

/// `--close`: writes the run's closed key.
fn close(url: &ElasticUrl, connect_timeout: f64) -> Result<ExitCode, CliError> {
    let timeout = Duration::try_from_secs_f64(connect_timeout)
        .map_err(|_| "--connect-timeout must be a non-negative number of seconds")?;
    let store = TcpStore::connect(&url.host, url.port, timeout)
        .map_err(|e| format!("connecting to the store at {}:{}: {e}", url.host, url.port))?;
    for action in url.settings.close_actions("rdzv rendezvous --close") {
        let done = match &action {
            StoreAction::Set { key, value } => store.set(key, value).map(|_| ()),
            StoreAction::Add { key, delta } => store.add(key, *delta).map(|_| ()),
            other => return Err(format!("closing: unexpected store action {other:?}").into()),
        };
        done.map_err(|e| {
            format!(
                "closing: {} of {} at {}:{}: {e}",
                action.name(),
                action.key(),
                url.host,
                url.port
            )
        })?;
    }
    println!("closed rendezvous {}", url.settings.run_id);
    Ok(ExitCode::SUCCESS)
}
