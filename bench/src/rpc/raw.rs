//! The `raw-tcp` row: a plain TCP ping-pong between the two benchmark processes, the
//! physical limit the RPC rows are compared with.
//!
//! The serving side runs a [`RawEchoServer`] next to its RPC agents. Each client
//! connection announces its message length once (8 bytes, little-endian), then every
//! message of that length is read whole and written back, store-and-forward as an RPC
//! echo is. [`measure`] times one connection's round trips. An empty RPC payload still
//! moves a 40-byte frame header each way, so an empty raw payload pings 40 bytes.
//!
//! The measuring side also holds one *control* connection ([`hold_control`], announcing
//! [`CONTROL`] instead of a length) for the whole run: it carries no bytes, and when it
//! closes before the run is over the serving side knows that the measuring process is
//! gone ([`RawEchoServer::control_closed`]) instead of waiting for it.
//!
//! This module moves bytes over `std::net` sockets (`TCP_NODELAY`); it decides nothing
//! about what else the benchmark runs.

use std::io::{self, Read as _, Write as _};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use super::payload::Payload;
use super::row::{samples, Row, RunMode, NO_CHANNEL};
use crate::BenchError;

/// The transport name of the raw rows.
pub(super) const RAW_TCP: &str = "raw-tcp";
/// What an empty RPC moves each way: its frame header.
const EMPTY_FRAME_BYTES: usize = 40;
/// The largest message a client may announce; larger announcements close the connection
/// (the server listens on the network in two-host mode).
pub(super) const MAX_MESSAGE_BYTES: u64 = 1 << 30;

/// What a control connection announces instead of a message length.
const CONTROL: u64 = u64::MAX;

/// The echo side of the raw ping-pong: one thread accepting, one per connection.
#[derive(Debug)]
pub(super) struct RawEchoServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    control_closed: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RawEchoServer {
    /// Listens on `host` (an ephemeral port).
    pub(super) fn start(host: IpAddr) -> io::Result<RawEchoServer> {
        let listener = TcpListener::bind((host, 0))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let control_closed = Arc::new(AtomicBool::new(false));
        let closed = Arc::clone(&control_closed);
        let thread = std::thread::Builder::new()
            .name("rdzv-bench-raw".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stopping.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let closed = Arc::clone(&closed);
                    // Each connection ends when its client closes; errors end only it
                    // (the client reports its own side of them).
                    let _ = std::thread::Builder::new()
                        .name("rdzv-bench-raw-echo".into())
                        .spawn(move || {
                            if let Err(e) = serve(stream, &closed) {
                                tracing::debug!(error = %e, "raw echo connection ended");
                            }
                        });
                }
            })?;
        Ok(RawEchoServer {
            addr,
            stop,
            control_closed,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether a control connection was opened and has closed since.
    pub(super) fn control_closed(&self) -> bool {
        self.control_closed.load(Ordering::Acquire)
    }
}

impl Drop for RawEchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            // Wake the accept loop so that it sees the flag.
            let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
            let _ = thread.join();
        }
    }
}

fn serve(mut stream: TcpStream, control_closed: &AtomicBool) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut header = [0u8; 8];
    stream.read_exact(&mut header)?;
    let len = u64::from_le_bytes(header);
    if len == CONTROL {
        // Nothing is sent on it: any read returning is its end (EOF, reset, or bytes
        // that break the protocol).
        let _ = stream.read(&mut header);
        control_closed.store(true, Ordering::Release);
        return Ok(());
    }
    if len > MAX_MESSAGE_BYTES {
        let _ = stream.shutdown(Shutdown::Both);
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a client announced {len}-byte messages, above {MAX_MESSAGE_BYTES}"),
        ));
    }
    let len = usize::try_from(len).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut message = vec![0u8; len];
    loop {
        match stream.read_exact(&mut message) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        stream.write_all(&message)?;
    }
}

/// Opens the control connection to the echo server at `addr`; the run is over for the
/// serving side when it closes.
pub(super) fn hold_control(addr: SocketAddr) -> Result<TcpStream, BenchError> {
    let io = |what| move |source| BenchError::RawEcho { addr, what, source };
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(30)).map_err(io("connecting"))?;
    stream
        .write_all(&CONTROL.to_le_bytes())
        .map_err(io("opening the control connection"))?;
    Ok(stream)
}

/// Times `iters` ping-pongs of `len` payload bytes (at least an empty frame's 40) with
/// the echo server at `addr`, checking every echo.
pub(super) fn measure(
    addr: SocketAddr,
    len: usize,
    iters: usize,
    mode: RunMode,
    bar: &ProgressBar,
) -> Result<Row, BenchError> {
    let wire = len.max(EMPTY_FRAME_BYTES);
    let payload = Payload::new(wire);
    let io = |what| move |source| BenchError::RawEcho { addr, what, source };
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(30)).map_err(io("connecting"))?;
    stream
        .set_nodelay(true)
        .map_err(io("setting TCP_NODELAY"))?;
    stream
        .write_all(&(wire as u64).to_le_bytes())
        .map_err(io("sending the payload size"))?;
    let mut back = vec![0u8; wire];
    bar.set_message(format!("{RAW_TCP} {}", super::row::human_size(len as u64)));
    // One unrecorded round trip warms the connection up.
    let samples = samples(iters, Some(bar), |iter| {
        let out = payload.message(iter);
        let started = Instant::now();
        stream.write_all(&out).map_err(io("sending"))?;
        stream.read_exact(&mut back).map_err(io("receiving"))?;
        let took = started.elapsed();
        payload.verify(iter, &back, "the raw echo")?;
        Ok(took)
    })?;
    let _ = stream.shutdown(Shutdown::Both);
    Ok(Row::from_samples(
        RAW_TCP, NO_CHANNEL, mode, len as u64, samples,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_echo_server_serves_several_sizes_and_connections() {
        let server = RawEchoServer::start([127, 0, 0, 1].into()).unwrap();
        let bar = ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::hidden());
        for len in [0, 1, 100, 70_000] {
            let row = measure(server.addr(), len, 5, RunMode::Local, &bar).unwrap();
            assert_eq!(row.transport, RAW_TCP);
            assert_eq!(row.channel, NO_CHANNEL);
            assert_eq!(row.payload_bytes, len as u64);
            assert_eq!(row.iters, 5);
            assert!(row.p50_us > 0.0);
        }
        assert_eq!(bar.position(), 20);
    }

    #[test]
    fn an_oversized_announcement_closes_the_connection() {
        let server = RawEchoServer::start([127, 0, 0, 1].into()).unwrap();
        let mut stream = TcpStream::connect(server.addr()).unwrap();
        stream
            .write_all(&(MAX_MESSAGE_BYTES + 1).to_le_bytes())
            .unwrap();
        let mut byte = [0u8; 1];
        // Closed without an echo (EOF or reset), not a 1 GiB allocation.
        assert!(!matches!(stream.read(&mut byte), Ok(1)));
        drop(stream);
        assert!(!server.control_closed());
        drop(server);
    }

    #[test]
    fn closing_the_control_connection_is_noticed() {
        let server = RawEchoServer::start([127, 0, 0, 1].into()).unwrap();
        let control = hold_control(server.addr()).unwrap();
        let bar = ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::hidden());
        measure(server.addr(), 10, 3, RunMode::Local, &bar).unwrap();
        assert!(!server.control_closed());
        drop(control);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !server.control_closed() {
            assert!(
                Instant::now() < deadline,
                "the closed control connection went unnoticed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
