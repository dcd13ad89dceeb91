//! The set-up every bench repeats, written once: the store under load ([`Target`]: an
//! rdzv server started in this process, or one at an address), a peer process (this
//! binary again, [`PeerProcess`]) that says where it listens, the report written to
//! stdout, the small checks on options and limits around them, and the one round the
//! rendezvous benches form (its settings, its check, the spread of per-node counts).
//!
//! It decides nothing about what is measured or how results look (the drivers and
//! `report` do).

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rdzv_core::rendezvous::elastic::{ElasticSettings, NodeRange};
use rdzv_uring::{ServerOptions, StoreServer};

use super::error::BenchError;

/// Starts an rdzv store server in this process on `bind`.
pub(super) fn start_server(bind: SocketAddr) -> Result<StoreServer, BenchError> {
    Ok(StoreServer::start(ServerOptions {
        host: Some(bind.ip().to_string()),
        port: bind.port(),
        ..ServerOptions::default()
    })?)
}

/// Writes `text` to stdout and flushes it: a run's report.
pub(super) fn write_report(text: &str) -> Result<(), BenchError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(BenchError::io("write the report to stdout"))
}

/// A progress bar on stderr drawn with `template` (nothing is drawn with `json`, or when
/// stderr is not a terminal), of `len` steps.
pub(super) fn progress_bar(json: bool, template: &str, len: Option<u64>) -> ProgressBar {
    let target = if json {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    if let (Ok(style), false) = (ProgressStyle::with_template(template), json) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// This binary run again as a bench's peer (`rdzv ARGS`): it prints the port it listens
/// on as its first line on stdout, then serves until the run is over.
pub(super) struct PeerProcess {
    child: Child,
}

impl PeerProcess {
    /// Starts `rdzv ARGS` with stdout piped; its log shows errors only unless
    /// `RUST_LOG` says otherwise (its store's warnings concern no two-process run).
    pub(super) fn spawn(args: &[&str]) -> Result<PeerProcess, BenchError> {
        let mut command =
            Command::new(std::env::current_exe().map_err(BenchError::io("find this binary"))?);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "error");
        }
        let child = command
            .spawn()
            .map_err(BenchError::io("start the benchmark's peer process"))?;
        Ok(PeerProcess { child })
    }

    /// The port of the peer's first line.
    pub(super) fn port(&mut self) -> Result<u16, BenchError> {
        let stdout = self.child.stdout.take().ok_or_else(|| {
            BenchError::Unexpected("the benchmark's peer process has no stdout".into())
        })?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(BenchError::io("read the peer process's port"))?;
        line.trim().parse().map_err(|_| {
            BenchError::Unexpected(format!(
                "the benchmark's peer process did not say where it listens ({line:?})"
            ))
        })
    }

    /// Waits for the peer to exit once the run is done, or kills it when the run failed
    /// (`measured` false); a peer that fails a run that went well is an error.
    pub(super) fn finish(mut self, measured: bool) -> Result<(), BenchError> {
        if !measured {
            let _ = self.child.kill();
        }
        let status = self
            .child
            .wait()
            .map_err(BenchError::io("wait for the benchmark's peer process"))?;
        if measured && !status.success() {
            return Err(BenchError::Unexpected(format!(
                "the benchmark's peer process failed: {status}"
            )));
        }
        Ok(())
    }
}

/// Where the load goes: an embedded server (kept alive here) or a remote one.
pub(super) struct Target {
    pub(super) addr: SocketAddr,
    pub(super) label: String,
    pub(super) embedded: Option<StoreServer>,
}

impl Target {
    /// `addr` resolved, or a server started here on `127.0.0.1` when there is none.
    pub(super) fn open(addr: Option<&str>, label: Option<String>) -> Result<Target, BenchError> {
        match addr {
            Some(given) => {
                let resolved = given
                    .to_socket_addrs()
                    .and_then(|mut addrs| addrs.next().ok_or(std::io::ErrorKind::NotFound.into()))
                    .map_err(|source| BenchError::Resolve {
                        addr: given.to_string(),
                        source,
                    })?;
                Ok(Target {
                    addr: resolved,
                    label: label.unwrap_or_else(|| given.to_string()),
                    embedded: None,
                })
            }
            None => {
                let server = start_server((Ipv4Addr::LOCALHOST, 0).into())?;
                Ok(Target {
                    addr: server.local_addr(),
                    label: label.unwrap_or_else(|| "rdzv-embedded".into()),
                    embedded: Some(server),
                })
            }
        }
    }

    /// File descriptors the server side of `conns` connections costs this process.
    pub(super) fn server_fds(&self, conns: usize) -> u64 {
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

pub(super) fn seconds(value: f64, option: &str) -> Result<Duration, BenchError> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        BenchError::InvalidArgument(format!(
            "{option} must be a non-negative number of seconds, got {value}"
        ))
    })
}

/// A prefix no other run uses, so that runs against a shared server do not collide.
pub(super) fn key_prefix(mode: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("/rdzv-bench/{}-{nanos}/{mode}", std::process::id())
}

/// Raises the soft open-file limit to the hard limit and checks it covers `needed`.
pub(super) fn ensure_fd_limit(needed: u64) -> Result<u64, BenchError> {
    let limit = rlimit::increase_nofile_limit(u64::MAX)
        .map_err(BenchError::io("raise the open-file limit (RLIMIT_NOFILE)"))?;
    tracing::debug!(limit, needed, "open-file limit");
    if limit < needed {
        return Err(BenchError::FdLimit { needed, limit });
    }
    Ok(limit)
}

/// A fresh run id for one bench run: `bench-{pid}-{ms since the epoch}`.
pub(super) fn bench_run_id() -> String {
    format!(
        "bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    )
}

// What the rendezvous benches (`rendezvous`, `rendezvous_etcd`) share: their one round,
// their check of it, and the spread of per-node counts.

/// One round of exactly `n` nodes of the run `run_id`.
pub(super) fn one_round(
    run_id: String,
    n: u32,
    interval: Duration,
    join_timeout: Duration,
) -> Result<ElasticSettings, BenchError> {
    let nodes = NodeRange::new(n, n)
        .map_err(|e| BenchError::InvalidArgument(format!("--nodes {n}: {e}")))?;
    let mut settings = ElasticSettings::new(run_id, nodes);
    settings.keep_alive_interval = interval;
    settings.join_timeout = join_timeout;
    Ok(settings)
}

/// Every node must agree: one round, world `n`, distinct ranks (`(round, rank, world)`
/// each).
pub(super) fn check_world(ranks: &[(u64, u32, u32)], n: u32) -> Result<(), BenchError> {
    let mut distinct: Vec<u32> = ranks.iter().map(|(_, rank, _)| *rank).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != n as usize || ranks.iter().any(|r| r.2 != n || r.0 != ranks[0].0) {
        return Err(BenchError::Unexpected(format!(
            "the round is not one world of {n} distinct ranks: {} distinct",
            distinct.len()
        )));
    }
    Ok(())
}

/// `(min, mean, max)` of per-node counts.
pub(super) fn spread(v: &[u64]) -> (u64, f64, u64) {
    let min = v.iter().copied().min().unwrap_or(0);
    let max = v.iter().copied().max().unwrap_or(0);
    let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    (min, mean, max)
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
}
