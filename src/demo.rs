//! `rdzv demo`: the main job on an embedded default.
//!
//! Starts a store server in this process, then N worker processes (this binary, hidden
//! `demo-worker` subcommand). The parent plays torchelastic's agent: it hosts the store
//! and starts the workers with `TORCHELASTIC_USE_AGENT_STORE=True`, so that every worker's
//! `tcp://` rendezvous (rdzv's `rendezvous`, as PyTorch's) connects to it as a client,
//! rank 0 included. Each worker meets the others at a store barrier, publishes its name, all-gathers everyone's names with one
//! `multi_get`, and meets them again at a closing barrier. The parent checks that every
//! worker saw the same, complete list and prints a table of what happened and how long
//! each step took.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use rdzv_core::rendezvous::NodeParams;
use rdzv_uring::rendezvous::{rendezvous_with, ProcessEnv, RendezvousOptions};
use rdzv_uring::{ServerOptions, StoreServer};

use crate::error::CliError;

/// Options of `rdzv demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Number of worker processes.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Seconds each worker may wait at a barrier.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

/// Options of one demo worker (internal).
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// The rendezvous URL.
    #[arg(long)]
    url: String,
    /// This worker's rank.
    #[arg(long)]
    rank: u32,
    /// Number of workers.
    #[arg(long)]
    world_size: u32,
    /// Barrier timeout, seconds.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

struct WorkerReport {
    rank: u32,
    pid: u32,
    connect_us: u64,
    barrier_us: u64,
    allgather_us: u64,
    total_us: u64,
    names: String,
}

fn parse_report(line: &str) -> Option<WorkerReport> {
    let mut fields = line.strip_prefix("RDZV-DEMO ")?.split('\t');
    let mut next = || fields.next();
    Some(WorkerReport {
        rank: next()?.parse().ok()?,
        pid: next()?.parse().ok()?,
        connect_us: next()?.parse().ok()?,
        barrier_us: next()?.parse().ok()?,
        allgather_us: next()?.parse().ok()?,
        total_us: next()?.parse().ok()?,
        names: next()?.to_string(),
    })
}

/// Runs the demo.
pub(crate) fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    if args.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    let started = Instant::now();
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        ..ServerOptions::default()
    })?;
    let url = format!("tcp://127.0.0.1:{}", server.port());
    println!(
        "rdzv demo: store server on 127.0.0.1:{} (embedded, io_uring); starting {} worker processes",
        server.port(),
        args.workers
    );
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..args.workers {
        let child = Command::new(&exe)
            .args(["demo-worker", "--url", &url])
            .args(["--rank", &rank.to_string()])
            .args(["--world-size", &args.workers.to_string()])
            .args(["--timeout", &args.timeout.to_string()])
            // The agent-store mode of torchelastic: this process hosts the store.
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.port().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start worker {rank} ({}): {e}", exe.display()))?;
        children.push((rank, child));
    }
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for (rank, mut child) in children {
        let stdout = child.stdout.take();
        let mut report = None;
        if let Some(out) = stdout {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(r) = parse_report(&line) {
                    report = Some(r);
                }
            }
        }
        let status = child.wait()?;
        match (status.success(), report) {
            (true, Some(r)) => reports.push(r),
            (ok, _) => failures.push(format!(
                "worker {rank} {}",
                if ok {
                    "printed no report".to_string()
                } else {
                    format!("exited with {status}")
                }
            )),
        }
    }
    let elapsed = started.elapsed();
    server.shutdown();
    if !failures.is_empty() {
        return Err(format!("demo failed: {}", failures.join("; ")).into());
    }
    reports.sort_by_key(|r| r.rank);
    println!();
    println!(
        "{:>5} {:>8} {:>12} {:>12} {:>14} {:>10}",
        "rank", "pid", "connect µs", "barrier µs", "all-gather µs", "total µs"
    );
    for r in &reports {
        println!(
            "{:>5} {:>8} {:>12} {:>12} {:>14} {:>10}",
            r.rank, r.pid, r.connect_us, r.barrier_us, r.allgather_us, r.total_us
        );
    }
    let first = &reports[0].names;
    let agree = reports.iter().all(|r| &r.names == first);
    let gathered = first.split(',').count();
    println!();
    println!(
        "all-gather: every worker saw the same {gathered} names: {}",
        if agree && gathered == reports.len() {
            "yes"
        } else {
            "NO"
        }
    );
    println!("names: {first}");
    println!(
        "{} workers rendezvoused, met at 2 barriers and all-gathered in {:.1} ms (wall, including process start)",
        reports.len(),
        elapsed.as_secs_f64() * 1e3
    );
    if !agree || gathered != reports.len() {
        return Err("workers disagree about the gathered names".into());
    }
    Ok(ExitCode::SUCCESS)
}

/// One worker: rendezvous, barrier, publish, all-gather, barrier; prints one report line.
pub(crate) fn worker(args: WorkerArgs) -> Result<ExitCode, CliError> {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(args.timeout);
    let rdzv = rendezvous_with(
        &args.url,
        NodeParams::Given {
            rank: Some(args.rank),
            world_size: Some(args.world_size),
        },
        &ProcessEnv::snapshot(),
        &RendezvousOptions::with_timeout(timeout),
    )?;
    let (store, rank) = (rdzv.store, rdzv.rank);
    let world_size = rdzv
        .world_size
        .ok_or_else(|| format!("{} gave no fixed world size", args.url))?;
    let connected = t0.elapsed();
    let ws = i64::from(world_size);
    store.barrier("demo/joined", ws, Some(timeout))?;
    let barrier = t0.elapsed();
    let me = format!("worker{rank}@{}", std::process::id());
    store.set(&format!("demo/name/{rank}"), me.as_bytes())?;
    let keys: Vec<String> = (0..world_size).map(|r| format!("demo/name/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let names = store.multi_get(&refs)?;
    let gathered = t0.elapsed();
    store.barrier("demo/done", ws, Some(timeout))?;
    let total = t0.elapsed();
    let names: Vec<String> = names
        .iter()
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    println!(
        "RDZV-DEMO {rank}\t{}\t{}\t{}\t{}\t{}\t{}",
        std::process::id(),
        connected.as_micros(),
        (barrier - connected).as_micros(),
        (gathered - barrier).as_micros(),
        total.as_micros(),
        names.join(",")
    );
    Ok(ExitCode::SUCCESS)
}
