//! Timing of the shm transport between two processes: ping-pong latency of small
//! messages with spin-then-sleep wake-ups and with eventfd-only wake-ups (no spinning),
//! and streaming throughput of large messages.
//!
//! ```text
//! cargo run --release -p rdzv-uring --example shm_pingpong -- [round_trips] [stream_mib]
//! ```
//!
//! The process re-runs itself as the peer (`peer echo|sink ADDR SPIN_US`).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use rdzv_uring::shm::{ShmAddr, ShmConnection, ShmError, ShmListener, ShmOptions};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Size of a ping-pong message.
const SMALL: usize = 64;
/// Size of a streamed message.
const LARGE: usize = 1 << 20;

fn options(spin: Duration) -> ShmOptions {
    let mut options = ShmOptions::default();
    options.spin = spin;
    options
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, addr, spin_us] = args.as_slice() {
        if let Some(mode) = mode.strip_prefix("peer-") {
            let spin = Duration::from_micros(spin_us.parse()?);
            return peer(mode, &ShmAddr::parse(addr), spin);
        }
    }
    let round_trips: usize = args
        .first()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let stream_mib: usize = args.get(1).map(|a| a.parse()).transpose()?.unwrap_or(2048);

    println!("shm ping-pong, {SMALL}-byte messages, {round_trips} round trips, two processes");
    for (label, spin) in [
        ("spin 50us + eventfd", Duration::from_micros(50)),
        ("eventfd only       ", Duration::ZERO),
    ] {
        let (mut conn, child) = start("echo", spin)?;
        let mut samples = ping_pong(&mut conn, round_trips)?;
        drop(conn);
        finish(child)?;
        samples.sort_unstable_by(f64::total_cmp);
        println!(
            "  {label}: round trip p50 {:>7.2} us  p99 {:>7.2} us  (min {:.2} us)",
            percentile(&samples, 0.50),
            percentile(&samples, 0.99),
            percentile(&samples, 0.0),
        );
    }

    println!("shm streaming, {LARGE}-byte messages, {stream_mib} MiB, two processes");
    let (mut conn, child) = start("sink", Duration::from_micros(50))?;
    let message = vec![0xA5u8; LARGE];
    let start = Instant::now();
    for _ in 0..stream_mib {
        conn.send(&message)?;
    }
    conn.send(b"end")?;
    let done = conn.recv()?;
    let elapsed = start.elapsed();
    let received = u64::from_le_bytes(done.as_slice().try_into()?);
    drop(conn);
    finish(child)?;
    let bytes = (stream_mib * LARGE) as f64;
    println!(
        "  {:.2} GB/s ({:.0} MiB/s), {received} messages in {:.3} s",
        bytes / elapsed.as_secs_f64() / 1e9,
        bytes / elapsed.as_secs_f64() / (1 << 20) as f64,
        elapsed.as_secs_f64()
    );
    Ok(())
}

/// Listens, starts the peer process in `mode` and accepts it.
fn start(mode: &str, spin: Duration) -> Result<(ShmConnection, Child)> {
    let listener = ShmListener::bind_unnamed(options(spin))?;
    let child = Command::new(std::env::current_exe()?)
        .args([
            format!("peer-{mode}"),
            listener.local_addr().to_string(),
            spin.as_micros().to_string(),
        ])
        .spawn()?;
    Ok((listener.accept()?, child))
}

fn finish(mut child: Child) -> Result<()> {
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("peer process failed: {status}").into());
    }
    Ok(())
}

/// Round-trip times in microseconds, after a warm-up.
fn ping_pong(conn: &mut ShmConnection, round_trips: usize) -> Result<Vec<f64>> {
    let message = [0x5Au8; SMALL];
    let mut reply = [0u8; SMALL];
    for _ in 0..1000 {
        conn.send(&message)?;
        conn.recv_into(&mut reply)?;
    }
    let mut samples = Vec::with_capacity(round_trips);
    for _ in 0..round_trips {
        let start = Instant::now();
        conn.send(&message)?;
        let n = conn.recv_into(&mut reply)?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
        if n != SMALL || reply != message {
            return Err("echo mismatch".into());
        }
    }
    Ok(samples)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(index).copied().unwrap_or(f64::NAN)
}

/// The peer: `echo` returns every message; `sink` counts full-size messages and answers
/// the end marker with the count.
fn peer(mode: &str, addr: &ShmAddr, spin: Duration) -> Result<()> {
    let mut conn = ShmConnection::connect(addr, options(spin))?;
    let mut buf = vec![0u8; LARGE];
    match mode {
        "echo" => loop {
            match conn.recv_into(&mut buf) {
                Ok(n) => conn.send(buf.get(..n).ok_or("short buffer")?)?,
                Err(ShmError::PeerClosed) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        },
        "sink" => {
            let mut count = 0u64;
            // Full-size messages are counted; the short end marker asks for the count.
            while conn.recv_into(&mut buf)? == LARGE {
                count += 1;
            }
            conn.send(&count.to_le_bytes())?;
            match conn.recv() {
                Err(ShmError::PeerClosed) => Ok(()),
                other => Err(format!("expected the close, got {other:?}").into()),
            }
        }
        other => Err(format!("unknown peer mode {other}").into()),
    }
}
