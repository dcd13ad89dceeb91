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
//! While the node waits in an open round, stderr says how the round stands: on a terminal
//! a line that updates ("round 0: 3 nodes (min 2, max 4); last call ends in 12 s"), else
//! one line when a round's last call starts ("last call: waiting up to 30 s for more
//! nodes").
//!
//! `rdzv rendezvous etcd://h1:2379,h2:2379/RUN_ID?…` does the same with the rendezvous
//! kept in an etcd cluster (`rdzv_uring::rendezvous::etcd`).
//!
//! `rdzv rendezvous --close elastic://…` closes the run for good instead of joining
//! (torchelastic's `set_closed`): every node's next rendezvous fails, nodes waiting in an
//! open round are woken, and the run id cannot be used again.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rdzv_core::rendezvous::elastic::{
    ElasticErrorKind, ElasticUrl, EtcdRendezvousUrl, StoreAction,
};
use rdzv_uring::rendezvous::elastic::{
    default_node_id, ElasticFailure, ElasticRendezvous, OpenProgress,
};
use rdzv_uring::rendezvous::etcd::machine_store;
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::Store;

use crate::error::CliError;

/// Options of `rdzv rendezvous`.
#[derive(Debug, Args)]
pub(crate) struct RendezvousArgs {
    /// elastic://HOST:PORT/RUN_ID?nodes=MIN:MAX&last_call=30s&join_timeout=600s&
    /// keep_alive_interval=5s&keep_alive_max_attempts=3 (the store at HOST:PORT must be
    /// running, e.g. `rdzv store serve`), or
    /// etcd://HOST:PORT[,HOST:PORT...]/RUN_ID?… (the same keys, plus etcd_prefix) to keep
    /// the rendezvous in an etcd cluster.
    url: String,
    /// This node's name (default: HOST_PID_0, as PyTorch's node descriptors).
    #[arg(long)]
    node_id: Option<String>,
    /// Timeout for connecting to the store, in seconds (never past the URL's
    /// join_timeout).
    #[arg(long, default_value_t = 30.0)]
    connect_timeout: f64,
    /// Close the run for good instead of joining it (torchelastic's `set_closed`).
    #[arg(long)]
    close: bool,
}

/// Runs `rdzv rendezvous`.
pub(crate) fn run(args: RendezvousArgs) -> Result<ExitCode, CliError> {
    let etcd = is_etcd(&args.url)
        .then(|| EtcdRendezvousUrl::parse(&args.url))
        .transpose()
        .map_err(|e| format!("{}: {e}", args.url))?;
    let url = match &etcd {
        Some(etcd) => etcd.elastic.clone(),
        None => ElasticUrl::parse(&args.url).map_err(|e| format!("{}: {e}", args.url))?,
    };
    let node = match (args.node_id, url.node_id.clone()) {
        (Some(_), Some(_)) => {
            return Err("give the node id once: --node-id or node_id= in the URL".into())
        }
        (Some(node), None) | (None, Some(node)) => node,
        (None, None) => default_node_id(),
    };
    if args.close {
        return close(&url, etcd.as_ref(), args.connect_timeout);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    let timeout = Duration::try_from_secs_f64(args.connect_timeout)
        .map_err(|_| "--connect-timeout must be a non-negative number of seconds")?;
    // A join ends by the join timeout, connecting included.
    let timeout = timeout.min(url.settings.join_timeout);
    let (store, place) = open_store(&url, etcd.as_ref(), timeout)?;
    let settings = url.settings.clone();
    let handle = ElasticRendezvous::start(store, settings, node.clone())?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "node {node} joining rendezvous {} (nodes {}:{}) at {place}",
        url.settings.run_id, url.settings.nodes.min, url.settings.nodes.max
    )?;
    out.flush()?;
    let mut last_round = None;
    let mut reported_wait = None;
    let mut progress = Progress::new(url.settings.last_call);
    while !stop.load(Ordering::Relaxed) {
        let next = handle.next_round(last_round, Duration::from_millis(200));
        progress.show(handle.open_round());
        match next {
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

/// How the open round stands, on stderr: a line that updates on a terminal, else one line
/// when a round's last call starts.
struct Progress {
    /// The updating line, when stderr is a terminal.
    bar: Option<ProgressBar>,
    last_call: Duration,
    /// The last round whose last call was announced (without a terminal).
    announced: Option<u64>,
}

impl Progress {
    fn new(last_call: Duration) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_draw_target(ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg}") {
                bar.set_style(style);
            }
            bar
        });
        Progress {
            bar,
            last_call,
            announced: None,
        }
    }

    fn show(&mut self, open: Option<OpenProgress>) {
        let Some(open) = open else {
            if let Some(bar) = &self.bar {
                bar.finish_and_clear();
            }
            return;
        };
        match &self.bar {
            Some(bar) => {
                bar.set_message(open.line(Instant::now()));
                bar.tick();
            }
            None if open.last_call_ends.is_some() && self.announced != Some(open.round) => {
                self.announced = Some(open.round);
                eprintln!("{}", last_call_line(self.last_call));
            }
            None => {}
        }
    }
}

/// The line a round's last call starts with, where no line updates.
fn last_call_line(last_call: Duration) -> String {
    format!(
        "last call: waiting up to {} s for more nodes",
        last_call.as_secs_f64()
    )
}

/// Whether `url` is an `etcd://` rendezvous (else it is `elastic://`).
fn is_etcd(url: &str) -> bool {
    url.get(..7)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("etcd://"))
}

/// The store the rendezvous lives in, and how to name it in messages: the etcd cluster of
/// an `etcd://` URL, else the TCPStore server of an `elastic://` one.
fn open_store(
    url: &ElasticUrl,
    etcd: Option<&EtcdRendezvousUrl>,
    timeout: Duration,
) -> Result<(Arc<dyn Store>, String), CliError> {
    if let Some(etcd) = etcd {
        let place = format!("etcd {} (prefix /{}/)", etcd.endpoints_text(), etcd.prefix);
        return Ok((Arc::new(machine_store(etcd)), place));
    }
    let store = TcpStore::connect(&url.host, url.port, timeout)
        .map_err(|e| format!("connecting to the store at {}:{}: {e}", url.host, url.port))?;
    Ok((Arc::new(store), format!("{}:{}", url.host, url.port)))
}

/// `--close`: writes the run's closed key.
fn close(
    url: &ElasticUrl,
    etcd: Option<&EtcdRendezvousUrl>,
    connect_timeout: f64,
) -> Result<ExitCode, CliError> {
    let timeout = Duration::try_from_secs_f64(connect_timeout)
        .map_err(|_| "--connect-timeout must be a non-negative number of seconds")?;
    let (store, place) = open_store(url, etcd, timeout)?;
    for action in url.settings.close_actions("rdzv rendezvous --close") {
        let done = match &action {
            StoreAction::Set { key, value } => store.set(key, value).map(|_| ()),
            StoreAction::Add { key, delta } => store.add(key, *delta).map(|_| ()),
            other => return Err(format!("closing: unexpected store action {other:?}").into()),
        };
        done.map_err(|e| {
            format!(
                "closing: {} of {} at {place}: {e}",
                action.name(),
                action.key(),
            )
        })?;
    }
    println!("closed rendezvous {}", url.settings.run_id);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(live: u32, ends_in: Option<Duration>, now: Instant) -> OpenProgress {
        OpenProgress {
            round: 2,
            live,
            min: 2,
            max: 4,
            last_call_ends: ends_in.map(|d| now + d),
        }
    }

    #[test]
    fn the_progress_line_says_the_nodes_and_the_last_call() {
        let now = Instant::now();
        assert_eq!(
            open(1, None, now).line(now),
            "round 2: 1 of min 2 nodes; waiting for 1 more"
        );
        assert_eq!(
            open(3, Some(Duration::from_millis(11_200)), now).line(now),
            "round 2: 3 nodes (min 2, max 4); last call ends in 12 s"
        );
        assert_eq!(
            last_call_line(Duration::from_secs(30)),
            "last call: waiting up to 30 s for more nodes"
        );
    }
}
