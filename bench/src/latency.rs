//! One connection's round trip: a store `ADD`, and a raw TCP ping-pong of the same size.
//!
//! Both clients are blocking `std::net` sockets with `TCP_NODELAY`, one request in flight
//! (what a PyTorch client does), timed from just before `write` to just after the last
//! reply byte is read. The store client encodes `ADD` with `rdzv_core::store::codec` and
//! decodes the reply with it, so it works against any TCPStore server. The raw ping-pong
//! ([`EchoServer`] + [`RawPingPong`]) moves exactly as many bytes each way as the `ADD`
//! exchange over loopback, with a server thread that does nothing but `read` and `write`:
//! the floor any store's round trip can be compared with.
//!
//! This module times; it does not decide how long to run or how to interleave the two
//! (see `bench::run_latency`).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::{Request, VALIDATION_MAGIC};

use super::BenchError;

/// The reply to `ADD` is one little-endian `i64`.
pub(super) const ADD_REPLY_BYTES: usize = 8;

/// A blocking store connection (`TCP_NODELAY`, reads time out): one request at a time,
/// `VALIDATE` sent with the first.
#[derive(Debug)]
pub(super) struct BlockingConn {
    stream: TcpStream,
    out: Vec<u8>,
    input: Vec<u8>,
}

impl BlockingConn {
    /// Connects to `addr`; `what` names the connection in errors configuring it.
    pub(super) fn connect(
        addr: SocketAddr,
        timeout: Duration,
        what: &'static str,
    ) -> Result<BlockingConn, BenchError> {
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|source| BenchError::Connect { addr, source })?;
        let io = BenchError::io(what);
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        let mut out = Vec::with_capacity(64);
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode_into(&mut out);
        Ok(BlockingConn {
            stream,
            out,
            input: Vec::with_capacity(64),
        })
    }

    /// Sends `request` and reads its reply whole: what `read` takes from it, `None` for
    /// a reply of a shape the caller does not expect.
    pub(super) fn request<T>(
        &mut self,
        request: &Request<'_>,
        read: impl FnOnce(&ResponseView<'_>) -> Option<T>,
    ) -> Result<Option<T>, BenchError> {
        let query = request.query_type().name();
        let pending = PendingReply::for_request(request).ok_or(BenchError::UnexpectedReply {
            query,
            expected: "a query that has a reply",
        })?;
        request.encode_into(&mut self.out);
        let sent = self.stream.write_all(&self.out);
        self.out.clear();
        sent.map_err(BenchError::io("send a request"))?;
        self.input.clear();
        let mut chunk = [0u8; 256];
        loop {
            match codec::decode_response_view(pending, &self.input, &Limits::default()) {
                Ok(Decoded::Complete(_, used)) if used != self.input.len() => {
                    let len = self.input.len() - used;
                    return Err(BenchError::UnexpectedBytes { len });
                }
                Ok(Decoded::Complete(view, _)) => return Ok(read(&view)),
                Ok(Decoded::Partial(_)) => {}
                Err(source) => return Err(BenchError::Decode { query, source }),
            }
            let n = match self.stream.read(&mut chunk) {
                // A signal to this process (EINTR): read again.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                read => read.map_err(BenchError::io("read a reply"))?,
            };
            if n == 0 {
                return Err(BenchError::ServerClosed);
            }
            self.input
                .extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }
}

/// A blocking store client that times `ADD(key, 1)` round trips.
#[derive(Debug)]
pub(super) struct AddRoundTrip {
    conn: BlockingConn,
    key: Vec<u8>,
    last: i64,
}

impl AddRoundTrip {
    /// Connects to `addr`, validates, and checks with a `PING` that the server answers.
    pub(super) fn connect(
        addr: SocketAddr,
        key: Vec<u8>,
        timeout: Duration,
    ) -> Result<Self, BenchError> {
        let mut conn = BlockingConn::connect(addr, timeout, "configure the latency connection")?;
        let nonce = std::process::id();
        match conn.request(&Request::Ping { nonce }, |view| match view {
            ResponseView::Pong(echo) => Some(*echo),
            _ => None,
        })? {
            Some(echo) if echo == nonce => Ok(AddRoundTrip { conn, key, last: 0 }),
            _ => Err(BenchError::UnexpectedReply {
                query: "PING",
                expected: "the nonce echoed",
            }),
        }
    }

    /// How many bytes one `ADD` request takes on the wire.
    #[cfg(test)]
    pub(super) fn request_bytes(&self) -> usize {
        Request::Add {
            key: &self.key,
            delta: 1,
        }
        .encoded_len()
    }

    /// The counter value of the last `ADD`.
    #[cfg(test)]
    pub(super) fn last_value(&self) -> i64 {
        self.last
    }

    /// One `ADD(key, 1)`, timed.
    pub(super) fn round_trip(&mut self) -> Result<Duration, BenchError> {
        let start = Instant::now();
        let add = Request::Add {
            key: &self.key,
            delta: 1,
        };
        let value = self.conn.request(&add, |view| match view {
            ResponseView::Int(value) => Some(*value),
            _ => None,
        })?;
        let elapsed = start.elapsed();
        match value {
            Some(value) if self.last == 0 || self.last.checked_add(1) == Some(value) => {
                self.last = value;
                Ok(elapsed)
            }
            Some(_) => Err(BenchError::UnexpectedReply {
                query: "ADD",
                expected: "the previous value plus one (is another client adding?)",
            }),
            None => Err(BenchError::UnexpectedReply {
                query: "ADD",
                expected: "an integer",
            }),
        }
    }
}

/// A loopback server that answers every `request_bytes` it reads with `reply_bytes`
/// zero bytes: the least work a store could do for an `ADD`.
#[derive(Debug)]
pub(super) struct EchoServer {
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl EchoServer {
    /// Starts it on `127.0.0.1` (an ephemeral port) for one client.
    pub(super) fn start(
        request_bytes: usize,
        reply_bytes: usize,
    ) -> Result<EchoServer, BenchError> {
        let io = BenchError::io("start the raw ping-pong server");
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
        let addr = listener.local_addr().map_err(io)?;
        let thread = std::thread::Builder::new()
            .name("rdzv-bench-echo".into())
            .spawn(move || {
                if let Ok((stream, _)) = listener.accept() {
                    // Errors end the ping-pong; the client reports its own side of them.
                    let _ = serve_ping_pong(stream, request_bytes, reply_bytes);
                }
            })
            .map_err(io)?;
        Ok(EchoServer {
            addr,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if !thread.is_finished() {
                // Unblock an accept that never got its client; a finished ping-pong
                // has already returned (the client closed first).
                let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
            }
            let _ = thread.join();
        }
    }
}

fn serve_ping_pong(mut stream: TcpStream, request: usize, reply: usize) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut input = vec![0u8; request];
    let output = vec![0u8; reply];
    loop {
        match stream.read_exact(&mut input) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        stream.write_all(&output)?;
    }
}

/// The client half of the raw ping-pong.
#[derive(Debug)]
pub(super) struct RawPingPong {
    stream: TcpStream,
    request: Vec<u8>,
    reply: Vec<u8>,
}

impl RawPingPong {
    /// Connects to an [`EchoServer`] started with the same sizes.
    pub(super) fn connect(
        addr: SocketAddr,
        request_bytes: usize,
        reply_bytes: usize,
        timeout: Duration,
    ) -> Result<RawPingPong, BenchError> {
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|source| BenchError::Connect { addr, source })?;
        let io = BenchError::io("configure the ping-pong connection");
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        Ok(RawPingPong {
            stream,
            request: vec![0x5a; request_bytes],
            reply: vec![0; reply_bytes],
        })
    }

    /// One ping-pong, timed.
    pub(super) fn round_trip(&mut self) -> Result<Duration, BenchError> {
        let start = Instant::now();
        self.stream
            .write_all(&self.request)
            .map_err(BenchError::io("send a ping"))?;
        self.stream
            .read_exact(&mut self.reply)
            .map_err(BenchError::io("read a pong"))?;
        Ok(start.elapsed())
    }
}

impl Drop for RawPingPong {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_ping_pong_moves_the_requested_sizes() {
        let server = EchoServer::start(30, ADD_REPLY_BYTES).unwrap();
        let mut client =
            RawPingPong::connect(server.addr(), 30, ADD_REPLY_BYTES, Duration::from_secs(5))
                .unwrap();
        for _ in 0..10 {
            let took = client.round_trip().unwrap();
            assert!(took < Duration::from_secs(5));
        }
        drop(client);
        drop(server);
    }

    #[test]
    fn an_unused_echo_server_shuts_down() {
        let server = EchoServer::start(10, 8).unwrap();
        drop(server);
    }

    #[test]
    fn add_round_trip_counts_against_a_real_server() {
        let server = rdzv_uring::StoreServer::start(rdzv_uring::ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            ..rdzv_uring::ServerOptions::default()
        });
        let server = match server {
            Ok(s) => s,
            Err(e) => {
                eprintln!("SKIP: cannot start the io_uring store server here: {e}");
                return;
            }
        };
        let mut client = AddRoundTrip::connect(
            server.local_addr(),
            b"/bench/latency-test".to_vec(),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(client.request_bytes(), 1 + 8 + 19 + 8);
        for expected in 1..=20 {
            client.round_trip().unwrap();
            assert_eq!(client.last_value(), expected);
        }
        server.shutdown();
    }
}
