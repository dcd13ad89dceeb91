//! `rdzv bench rendezvous --addr etcd://H:P[,H:P…] --nodes N`: the elastic rendezvous on
//! etcd, N nodes in this process, each an [`ElasticRendezvous`] (a driver thread over its
//! own [`EtcdStore`], as `rdzv rendezvous etcd://…` runs). It measures how long the N
//! nodes take to form one round, and the etcd requests each node sent (every HTTP request
//! to the gateway, retries and watches included, counted by [`EtcdStore::requests`]) to
//! join and per keep-alive interval afterwards.
//!
//! It drives no protocol of its own: the machine and the etcd mapping are the library's.
//! A thread per node (not one event loop, as the TCP bench) because the etcd store is
//! blocking; the counts do not depend on that, the time to a round does a little.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::rendezvous::elastic::EtcdRendezvousUrl;
use rdzv_uring::rendezvous::elastic::ElasticRendezvous;
use rdzv_uring::rendezvous::etcd::{lease_ttl, machine_store, MachineStore};

use super::harness::{check_world, one_round, spread};
use super::BenchError;

/// Runs the etcd bench: `addr` is `etcd://ENDPOINTS[/PREFIX]`, the rest as the TCP bench.
pub(super) fn run(
    addr: &str,
    nodes: u32,
    interval: Duration,
    heartbeat_secs: f64,
) -> Result<ExitCode, BenchError> {
    let (url, endpoints) = bench_url(addr)?;
    let run_id = url.elastic.settings.run_id.clone();
    let settings = one_round(run_id, nodes, interval, Duration::from_secs(600))?;
    super::ensure_fd_limit(u64::from(nodes) * 4 + 64)?;

    let mut stores: Vec<Arc<MachineStore>> = Vec::with_capacity(nodes as usize);
    let mut handles = Vec::with_capacity(nodes as usize);
    let started = Instant::now();
    for i in 0..nodes {
        let store = Arc::new(machine_store(&url).with_lease_ttl(lease_ttl(&settings)));
        stores.push(Arc::clone(&store));
        let handle = ElasticRendezvous::start(store, settings.clone(), format!("bench-node-{i}"))
            .map_err(|e| BenchError::Unexpected(format!("node {i}: {e}")))?;
        handles.push(handle);
    }
    eprintln!("{nodes} nodes joining over etcd {endpoints}");
    let mut ranks = Vec::with_capacity(nodes as usize);
    for (i, handle) in handles.iter().enumerate() {
        let round = handle
            .next_round(None, settings.join_timeout)
            .map_err(|e| BenchError::Unexpected(format!("node {i}: {e}")))?;
        ranks.push((round.round, round.rank, round.world_size));
    }
    let took = started.elapsed();
    // Taken once every node is a member: the join's requests, and the heartbeats of the
    // nodes that finished first (at most a few intervals' worth).
    let join_requests: Vec<u64> = stores.iter().map(|s| s.etcd().requests()).collect();
    check_world(&ranks, nodes)?;
    let (jmin, jmean, jmax) = spread(&join_requests);
    println!("rdzv elastic rendezvous on etcd: {nodes} nodes, one round, etcd {endpoints}");
    println!("  round formed in             {:.3} s", took.as_secs_f64());
    println!(
        "  etcd requests per node (join) min {jmin}, mean {jmean:.1}, max {jmax} (with the \
         heartbeats of those done first)"
    );
    if heartbeat_secs > 0.0 {
        report_keep_alive(&stores, interval, heartbeat_secs);
    }
    for handle in &handles {
        if let Some(round) = handle.current() {
            if round.rank == 0 {
                // Closing ends every node's driver at its next step.
                let _ = handle.set_closed();
            }
        }
    }
    drop(handles);
    Ok(ExitCode::SUCCESS)
}

/// The keep-alive phase: every node's etcd requests over `heartbeat_secs`, per interval.
fn report_keep_alive(stores: &[Arc<MachineStore>], interval: Duration, heartbeat_secs: f64) {
    let phase = Duration::from_secs_f64(heartbeat_secs);
    let before: Vec<u64> = stores.iter().map(|s| s.etcd().requests()).collect();
    std::thread::sleep(phase);
    let during: Vec<u64> = stores
        .iter()
        .zip(&before)
        .map(|(s, b)| s.etcd().requests() - b)
        .collect();
    let intervals = heartbeat_secs / interval.as_secs_f64();
    let (_, mean, max) = spread(&during);
    println!(
        "  etcd requests per node per keep-alive interval ({} ms, {intervals:.0} intervals): \
         mean {:.2}, max {:.2} (the lease's keep-alive, a range of the watched key, \
         and the watch on the round's end renewed each interval)",
        interval.as_millis(),
        mean / intervals,
        max as f64 / intervals
    );
}

/// The bench's own run (a fresh run id) on the cluster `addr` names (`etcd://ENDPOINTS`,
/// a path or query there is ignored), and the endpoints as text.
fn bench_url(addr: &str) -> Result<(EtcdRendezvousUrl, String), BenchError> {
    let run_id = super::harness::bench_run_id();
    // The address names the cluster (and optionally a prefix); the run id is ours.
    let endpoints = addr
        .strip_prefix("etcd://")
        .unwrap_or(addr)
        .split(['/', '?'])
        .next()
        .unwrap_or_default();
    let url_text = format!("etcd://{endpoints}/{run_id}?read_timeout=60s");
    let url = EtcdRendezvousUrl::parse(&url_text)
        .map_err(|e| BenchError::InvalidArgument(format!("--addr {addr}: {e}")))?;
    Ok((url, endpoints.to_string()))
}
