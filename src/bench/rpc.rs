//! `rdzv bench rpc`: two local worker processes (this one, rank 0, hosting the store, and
//! a child `rdzv bench rpc --peer URL`, rank 1) rendezvous through an embedded
//! `tcp://` store; rank 0 measures `rpc_sync` echoes of one CPU tensor per payload size
//! over every viable transport (`shm` when shared memory works here, then `tcp`; one pair
//! of processes per transport, both asking for only that one), and a plain TCP ping-pong
//! of the same size (the physical limit; an empty payload pings 40 bytes, the size of an
//! empty RPC frame).
//!
//! Rows carry `bench` ("rpc"), `transport`, `channel`, `payload_bytes`, `p50_us`,
//! `p99_us` and `gbytes_per_s` (echo bandwidth, both directions counted). This module
//! only measures and prints; the agent is `rdzv_uring::rpc`'s.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Args;
use rdzv_uring::rpc::{init_rpc, CallContext, Inline, Message, RpcAgent, RpcOptions, Tensor};

use super::latency::EchoServer;
use crate::cli::CliError;

/// Options of `rdzv bench rpc`.
#[derive(Debug, Args)]
pub struct RpcBenchArgs {
    /// Payload sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 64 << 20])]
    sizes: Vec<u64>,
    /// Round trips per size for payloads under 1 MiB.
    #[arg(long, default_value_t = 2_000)]
    iters: usize,
    /// Round trips per size for payloads of 1 MiB or more.
    #[arg(long, default_value_t = 20)]
    big_iters: usize,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    json: bool,
    /// Run as the benchmark's peer worker, rendezvousing at this `tcp://` URL (used by
    /// the benchmark itself).
    #[arg(long, hide = true)]
    peer: Option<String>,
    /// The transport the peer worker offers (used by the benchmark itself).
    #[arg(long, hide = true, default_value = "tcp")]
    peer_transport: String,
}

/// One measured row.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    transport: &'static str,
    channel: &'static str,
    payload_bytes: u64,
    p50_us: f64,
    p99_us: f64,
    gbytes_per_s: f64,
}

impl Row {
    fn from_samples(
        transport: &'static str,
        channel: &'static str,
        payload_bytes: u64,
        mut samples: Vec<Duration>,
    ) -> Row {
        samples.sort();
        let at = |p: usize| {
            samples
                .get((samples.len().saturating_sub(1)) * p / 100)
                .map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        let total: f64 = samples.iter().map(Duration::as_secs_f64).sum();
        let gbytes_per_s = if total > 0.0 {
            2.0 * payload_bytes as f64 * samples.len() as f64 / total / 1e9
        } else {
            0.0
        };
        Row {
            transport,
            channel,
            payload_bytes,
            p50_us: at(50),
            p99_us: at(99),
            gbytes_per_s,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "bench": "rpc",
            "transport": self.transport,
            "channel": self.channel,
            "payload_bytes": self.payload_bytes,
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
            "gbytes_per_s": self.gbytes_per_s,
        })
    }
}

const NAMES: [&str; 2] = ["bench-rpc-0", "bench-rpc-1"];

fn options(url: &str, transport: &str) -> RpcOptions {
    // The echo only moves the message: it runs on the I/O thread (`Inline`).
    let mut options = RpcOptions::new(url).with_handler(
        "echo",
        Inline(|_: &CallContext, m: Message| -> Result<Message, String> { Ok(m) }),
    );
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.rpc_timeout = Duration::from_secs(120);
    options.transports = Some(vec![transport.to_string()]);
    options
}

/// The transports measured, best first: `shm` if it is viable here, and `tcp`.
fn transports(json: bool) -> Vec<&'static str> {
    let mut transports = Vec::new();
    match rdzv_uring::transport::shm::viability() {
        Ok(_) => transports.push("shm"),
        Err(e) if !json => eprintln!("skipping shm: {e}"),
        Err(_) => {}
    }
    transports.push("tcp");
    transports
}

/// Runs `rdzv bench rpc`.
///
/// # Errors
/// When the peer cannot be started, the agents cannot start, or a call fails.
pub fn run(args: RpcBenchArgs) -> Result<ExitCode, CliError> {
    if let Some(url) = &args.peer {
        let agent = init_rpc(NAMES[1], 1, Some(2), options(url, &args.peer_transport))?;
        agent.join()?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows = Vec::new();
    for transport in transports(args.json) {
        rows.extend(measure_pair(&args, transport)?);
    }
    for &size in &args.sizes {
        rows.push(raw_row(
            usize::try_from(size)?,
            iters_for(&args, size),
            args.json,
        )?);
    }
    // Per payload: each transport, then raw-tcp.
    rows.sort_by_key(|row| row.payload_bytes);
    if args.json {
        for row in &rows {
            println!("{}", row.json());
        }
    } else {
        println!(
            "{:<10} {:<8} {:>14} {:>12} {:>12} {:>12}",
            "transport", "channel", "payload_bytes", "p50_us", "p99_us", "GB/s"
        );
        for row in &rows {
            println!(
                "{:<10} {:<8} {:>14} {:>12.1} {:>12.1} {:>12.3}",
                row.transport,
                row.channel,
                row.payload_bytes,
                row.p50_us,
                row.p99_us,
                row.gbytes_per_s
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Waits for the peer (it exits once both agents have joined); kills it if the
/// measurement failed.
fn child_status(child: &mut Child, measured: bool) -> Result<(), CliError> {
    if !measured {
        let _ = child.kill();
    }
    let status = child.wait()?;
    if measured && !status.success() {
        return Err(format!("the benchmark's peer process failed: {status}").into());
    }
    Ok(())
}

fn iters_for(args: &RpcBenchArgs, size: u64) -> usize {
    if size >= 1 << 20 {
        args.big_iters
    } else {
        args.iters
    }
    .max(1)
}

/// Starts a peer process offering only `transport` and measures every size over it.
fn measure_pair(args: &RpcBenchArgs, transport: &'static str) -> Result<Vec<Row>, CliError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let url = format!("tcp://127.0.0.1:{port}");
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "bench",
            "rpc",
            "--peer",
            &url,
            "--peer-transport",
            transport,
        ])
        .spawn()?;
    let measured = measure(args, &url, transport);
    let status = child_status(&mut child, measured.is_ok());
    let rows = measured?;
    status?;
    Ok(rows)
}

fn measure(args: &RpcBenchArgs, url: &str, transport: &'static str) -> Result<Vec<Row>, CliError> {
    let agent = init_rpc(NAMES[0], 0, Some(2), options(url, transport))?;
    let result = (|| {
        // Open the pipe and check what it runs on.
        agent.rpc_sync(NAMES[1], "echo", Message::default())?;
        let running = agent.pipe_transport(NAMES[1]).map(|k| k.name());
        if running != Some(transport) {
            return Err(format!(
                "the pipe asked to run on {transport} runs on {}",
                running.unwrap_or("nothing")
            )
            .into());
        }
        let mut rows = Vec::new();
        for &size in &args.sizes {
            let len = usize::try_from(size)?;
            rows.push(rpc_row(
                &agent,
                transport,
                len,
                iters_for(args, size),
                args.json,
            )?);
        }
        Ok::<_, CliError>(rows)
    })();
    let joined = agent.join();
    let rows = result?;
    joined?;
    Ok(rows)
}

fn rpc_row(
    agent: &RpcAgent,
    transport: &'static str,
    len: usize,
    iters: usize,
    json: bool,
) -> Result<Row, CliError> {
    let data = vec![0xA5u8; len];
    let bar = super::progress_bar(json, BAR);
    bar.set_length(iters as u64);
    bar.set_message(format!("rpc {transport} {len} B"));
    // Warm up the pipe.
    agent.rpc_sync(NAMES[1], "echo", Message::default())?;
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let message = Message::default().with_tensor(Tensor::cpu(data.clone()));
        let started = Instant::now();
        let reply = agent.rpc_sync(NAMES[1], "echo", message)?;
        samples.push(started.elapsed());
        let echoed = reply.tensors.first().map_or(0, |t| t.data.len());
        if echoed != len {
            return Err(format!("the echo returned {echoed} bytes instead of {len}").into());
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(Row::from_samples(transport, "basic", len as u64, samples))
}

fn raw_row(len: usize, iters: usize, json: bool) -> Result<Row, CliError> {
    // An empty RPC still moves a 40-byte frame header each way.
    let wire = len.max(40);
    let server = EchoServer::start(wire, wire)?;
    let addr: SocketAddr = server.addr();
    let mut stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let out = vec![0x5Au8; wire];
    let mut back = vec![0u8; wire];
    let bar = super::progress_bar(json, BAR);
    bar.set_length(iters as u64);
    bar.set_message(format!("raw-tcp {len} B"));
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let started = Instant::now();
        stream.write_all(&out)?;
        stream.read_exact(&mut back)?;
        samples.push(started.elapsed());
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(stream);
    drop(server);
    Ok(Row::from_samples("raw-tcp", "-", len as u64, samples))
}

const BAR: &str = "{msg:>24} [{bar:40}] {pos}/{len}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_summarise_samples() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let row = Row::from_samples("tcp", "basic", 1_000, samples);
        assert_eq!(row.p50_us.round(), 50.0);
        assert_eq!(row.p99_us.round(), 99.0);
        // 100 echoes of 1000 bytes each way in 5050 µs.
        let expected = 2.0 * 1_000.0 * 100.0 / 5_050e-6 / 1e9;
        assert!((row.gbytes_per_s - expected).abs() < 1e-9);
        let json = row.json();
        assert_eq!(json["bench"], "rpc");
        assert_eq!(json["transport"], "tcp");
        assert_eq!(json["channel"], "basic");
        assert_eq!(json["payload_bytes"], 1_000);
    }
}
