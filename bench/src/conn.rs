//! One TCPStore client connection driven by readiness events, for the load generators,
//! and the `epoll` loop ([`Reactor`]) they wait on.
//!
//! A load generator cannot use the library's client (`rdzv_uring::store::tcp::TcpStore`):
//! that one blocks its thread for each request's reply. A storm or a throughput run keeps
//! thousands of connections open on a few threads, each with a request in flight, and
//! decides itself when each request goes out; so it drives non-blocking sockets from
//! readiness events, and only the protocol (the codec) is shared.
//!
//! [`StoreConn`] owns a non-blocking socket, an output buffer of encoded requests and an
//! input buffer of reply bytes. Requests are encoded and replies decoded by
//! `rdzv_core::store::codec`, so the load it makes is the real protocol and works against
//! any TCPStore server (rdzv's, PyTorch's libuv or legacy one). Each reply is decoded
//! knowing the request it answers ([`PendingReply`]), in the order the requests were sent.
//!
//! It also runs PyTorch's `CANCEL_WAIT` exchange for a `WAIT` whose deadline passed
//! ([`StoreConn::cancel_wait`]): the server may release the wait just before it sees the
//! cancel, so either `WAIT_CANCELED` comes alone, in the wait's place, or `STOP_WAITING`
//! comes first and `WAIT_CANCELED` after it. The caller sees one reply to the `WAIT`
//! either way: `STOP_WAITING` if it was released, `WAIT_CANCELED` if the cancel won.
//!
//! It does not decide what to send next or when (the throughput, storm and rendezvous
//! drivers do), and it never blocks: [`StoreConn::flush`] and [`StoreConn::fill`] stop at
//! `WouldBlock`, and the caller waits for the next readiness event.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use mio::net::TcpStream;
use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::{QueryType, Request, WaitResponse, VALIDATION_MAGIC};

use super::BenchError;

/// One `epoll` loop (`mio`) of store connections: what every load generator waits on.
pub(super) struct Reactor {
    poll: mio::Poll,
    events: mio::Events,
}

impl Reactor {
    /// An `epoll` instance that takes up to `capacity` events per wait.
    pub(super) fn new(capacity: usize) -> Result<Reactor, BenchError> {
        Ok(Reactor {
            poll: mio::Poll::new().map_err(BenchError::io("create an epoll instance"))?,
            events: mio::Events::with_capacity(capacity),
        })
    }

    /// Starts a connection to `addr` (see [`StoreConn::connect`]), its events reported
    /// under `token`.
    pub(super) fn connect(
        &self,
        addr: SocketAddr,
        limits: Limits,
        ping: Option<u32>,
        token: usize,
    ) -> io::Result<StoreConn> {
        let mut conn = StoreConn::connect(addr, limits, ping)?;
        self.register(&mut conn, token)?;
        Ok(conn)
    }

    /// Reports `conn`'s readiness under `token`.
    pub(super) fn register(&self, conn: &mut StoreConn, token: usize) -> io::Result<()> {
        let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
        self.poll
            .registry()
            .register(&mut conn.stream, mio::Token(token), interest)
    }

    /// Stops reporting `conn`'s readiness (it moves to another loop).
    pub(super) fn deregister(&self, conn: &mut StoreConn) -> Result<(), BenchError> {
        let registry = self.poll.registry();
        registry
            .deregister(&mut conn.stream)
            .map_err(BenchError::io("deregister a socket"))
    }

    /// The events of the next `timeout` at most. An interruption by a signal (`EINTR`)
    /// is a wake-up with no events: the drivers loop and wait again, as after a timeout.
    pub(super) fn wait(&mut self, timeout: Duration) -> Result<&mio::Events, BenchError> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => self.events.clear(),
            other => other.map_err(BenchError::io("wait for socket events"))?,
        }
        Ok(&self.events)
    }
}

/// `key` as the encoded one-key list of a `WAIT` or `CHECK`: its length (a little-endian
/// `u64`), then its bytes.
pub(super) fn one_key_list(key: &[u8]) -> Vec<u8> {
    [&(key.len() as u64).to_le_bytes()[..], key].concat()
}

/// A decoded reply, reduced to what the load generators look at (no borrowed bytes, no
/// allocation per reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reply {
    /// `PING`: the echoed nonce.
    Pong(u32),
    /// `ADD` (and other integer replies): the number.
    Int(i64),
    /// `GET`/`COMPARE_SET`: the value's length.
    Value {
        /// Bytes in the value.
        len: usize,
    },
    /// `WAIT`, `BARRIER`, `CANCEL_WAIT`.
    Wait(WaitResponse),
    /// Any other reply, by the query it answers.
    Other(QueryType),
}

impl Reply {
    /// The parts of `view`, the reply to `query`, that the load generators look at.
    pub(super) fn from_view(view: &ResponseView<'_>, query: QueryType) -> Reply {
        match *view {
            ResponseView::Pong(nonce) => Reply::Pong(nonce),
            ResponseView::Int(n) => Reply::Int(n),
            ResponseView::Value(value) => Reply::Value { len: value.len() },
            ResponseView::Wait(wait) => Reply::Wait(wait),
            _ => Reply::Other(query),
        }
    }
}

/// What [`StoreConn::fill`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fill {
    /// Everything readable was read; the socket is still open.
    Open,
    /// The server closed the connection (end of stream).
    Closed,
}

/// A step of [`StoreConn::pump`] that failed, and why.
#[derive(Debug)]
pub(super) struct PumpError {
    /// `connect`, `send` or `read`.
    pub(super) during: &'static str,
    pub(super) source: io::Error,
}

impl std::fmt::Display for PumpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.during, self.source)
    }
}

/// A non-blocking TCPStore client connection. See the [module docs](self).
#[derive(Debug)]
pub(super) struct StoreConn {
    stream: TcpStream,
    /// Whether the connect has completed (and the hello is queued).
    connected: bool,
    /// The nonce of the `PING` queued after `VALIDATE` once connected, if any.
    ping: Option<u32>,
    out: Vec<u8>,
    out_pos: usize,
    input: Vec<u8>,
    in_pos: usize,
    awaiting: VecDeque<PendingReply>,
    limits: Limits,
    cancel: Cancel,
}

/// Where the `CANCEL_WAIT` exchange stands (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    /// No `CANCEL_WAIT` is owed a reply.
    None,
    /// `CANCEL_WAIT` sent; the wait's reply has not come.
    Sent,
    /// `CANCEL_WAIT` sent, and the server released the wait before it saw it: its
    /// `WAIT_CANCELED` is still to come.
    ReleasedFirst,
}

/// Size of the stack buffer each `read` goes through.
const READ_CHUNK: usize = 16 * 1024;

impl StoreConn {
    /// Starts a non-blocking connect to `addr`. Completion is reported by a writable
    /// event, on which [`StoreConn::pump`] queues `VALIDATE` (PyTorch's servers close
    /// connections that do not start with it), then `PING ping` if asked.
    pub(super) fn connect(
        addr: SocketAddr,
        limits: Limits,
        ping: Option<u32>,
    ) -> io::Result<StoreConn> {
        Ok(Self::with_stream(TcpStream::connect(addr)?, limits, ping))
    }

    /// [`StoreConn::connect`] from local port `port` (of any local address), bound
    /// with `SO_REUSEADDR` so that a port an earlier connection left in `TIME_WAIT`
    /// binds again. `EADDRINUSE` when the port is taken.
    pub(super) fn connect_from(
        addr: SocketAddr,
        port: u16,
        limits: Limits,
        ping: Option<u32>,
    ) -> io::Result<StoreConn> {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_nonblocking(true)?;
        socket.set_reuse_address(true)?;
        let local: SocketAddr = match addr {
            SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
        };
        socket.bind(&local.into())?;
        match socket.connect(&addr.into()) {
            Ok(()) => {}
            // A non-blocking connect under way.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error()) => {}
            Err(e) => return Err(e),
        }
        let stream = TcpStream::from_std(std::net::TcpStream::from(socket));
        Ok(Self::with_stream(stream, limits, ping))
    }

    fn with_stream(stream: TcpStream, limits: Limits, ping: Option<u32>) -> StoreConn {
        StoreConn {
            stream,
            connected: false,
            ping,
            out: Vec::with_capacity(64),
            out_pos: 0,
            input: Vec::with_capacity(64),
            in_pos: 0,
            awaiting: VecDeque::with_capacity(2),
            limits,
            cancel: Cancel::None,
        }
    }

    /// Whether the connect has completed (see [`StoreConn::pump`]).
    pub(super) fn is_connected(&self) -> bool {
        self.connected
    }

    /// On a readiness event: once the connect has completed (`Ok(None)` before), sends
    /// what is queued and reads everything readable. The first event after the connect
    /// completed queues the hello (see [`StoreConn::connect`]).
    ///
    /// # Errors
    /// The step that failed: the connect (refused, reset, timed out), a send or a read.
    pub(super) fn pump(&mut self) -> Result<Option<Fill>, PumpError> {
        let fail = |during| move |source| PumpError { during, source };
        if !self.connected {
            if !self.connect_done().map_err(fail("connect"))? {
                return Ok(None);
            }
            self.connected = true;
            self.queue(&Request::Validate {
                magic: VALIDATION_MAGIC,
            });
            if let Some(nonce) = self.ping {
                self.queue(&Request::Ping { nonce });
            }
        }
        self.flush().map_err(fail("send"))?;
        self.fill().map(Some).map_err(fail("read"))
    }

    /// Whether the non-blocking connect has completed: `Ok(false)` while it is in
    /// progress, an error if it failed (refused, reset, timed out).
    fn connect_done(&mut self) -> io::Result<bool> {
        if let Some(error) = self.stream.take_error()? {
            return Err(error);
        }
        match self.stream.peer_addr() {
            Ok(_) => {
                // Latency is what is measured: never let Nagle hold a request back.
                self.stream.set_nodelay(true)?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Encodes `request` after whatever is still unsent and remembers the reply it will
    /// get, if any. Call [`StoreConn::flush`] to send it.
    pub(super) fn queue(&mut self, request: &Request<'_>) {
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        }
        request.encode_into(&mut self.out);
        if let Some(pending) = PendingReply::for_request(request) {
            self.awaiting.push_back(pending);
        }
    }

    /// Cancels the connection's `WAIT` (its deadline passed): queues `CANCEL_WAIT` and
    /// runs the exchange, so that the `WAIT` gets exactly one reply from
    /// [`StoreConn::next_response`]: `STOP_WAITING` if the server released it before it
    /// saw the cancel, `WAIT_CANCELED` if not. Does nothing while a cancel is under way.
    pub(super) fn cancel_wait(&mut self) {
        if self.cancel == Cancel::None {
            self.queue(&Request::CancelWait);
            self.cancel = Cancel::Sent;
        }
    }

    /// Whether a `CANCEL_WAIT` is still owed its reply.
    pub(super) fn cancelling(&self) -> bool {
        self.cancel != Cancel::None
    }

    /// How many replies are still owed.
    #[cfg(test)]
    pub(super) fn awaiting(&self) -> usize {
        self.awaiting.len()
    }

    /// Whether queued bytes are still unsent (wait for a writable event).
    pub(super) fn has_unsent(&self) -> bool {
        self.out_pos < self.out.len()
    }

    /// Writes queued bytes until they are all sent or the socket would block.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        while self.out_pos < self.out.len() {
            let unsent = self.out.get(self.out_pos..).unwrap_or_default();
            match self.stream.write(unsent) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.out.clear();
        self.out_pos = 0;
        Ok(())
    }

    /// Reads everything readable into the input buffer, as edge-triggered readiness
    /// needs: until `WouldBlock`, a short read (the queue is drained), or end of stream.
    pub(super) fn fill(&mut self) -> io::Result<Fill> {
        let mut chunk = [0u8; READ_CHUNK];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(Fill::Closed),
                Ok(n) => {
                    if self.in_pos == self.input.len() {
                        self.input.clear();
                        self.in_pos = 0;
                    }
                    self.input
                        .extend_from_slice(chunk.get(..n).unwrap_or_default());
                    if n < chunk.len() {
                        // A short read drained the receive queue: bytes arriving later
                        // raise a new edge. Skipping the read that would only say
                        // `WouldBlock` saves a third of the client's syscalls per
                        // operation (tokio clears readiness on short reads the same way).
                        return Ok(Fill::Open);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Fill::Open),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The next complete reply in the input buffer, or `None` if it has not all arrived.
    ///
    /// # Errors
    /// As [`StoreConn::next_response`].
    pub(super) fn next_reply(&mut self) -> Result<Option<Reply>, BenchError> {
        self.next_response(Reply::from_view)
    }

    /// The next complete reply, handed to `read` with the query it answers (to copy out
    /// what the caller needs), or `None` if it has not all arrived. The replies of a
    /// cancelled `WAIT` come out as one (see [`StoreConn::cancel_wait`]).
    ///
    /// # Errors
    /// [`BenchError::Decode`] if the bytes are not a valid reply to the oldest request
    /// still owed one, [`BenchError::UnexpectedBytes`] if bytes arrived that answer
    /// nothing, [`BenchError::UnexpectedReply`] if a `CANCEL_WAIT` is not answered by
    /// `WAIT_CANCELED`.
    pub(super) fn next_response<T>(
        &mut self,
        read: impl FnOnce(&ResponseView<'_>, QueryType) -> T,
    ) -> Result<Option<T>, BenchError> {
        loop {
            let unread = self.input.get(self.in_pos..).unwrap_or_default();
            let Some(&pending) = self.awaiting.front() else {
                return if unread.is_empty() {
                    Ok(None)
                } else {
                    Err(BenchError::UnexpectedBytes { len: unread.len() })
                };
            };
            let (view, used) = match codec::decode_response_view(pending, unread, &self.limits) {
                Ok(Decoded::Partial(_)) => return Ok(None),
                Ok(Decoded::Complete(view, used)) => (view, used),
                Err(source) => {
                    return Err(BenchError::Decode {
                        query: pending.query().name(),
                        source,
                    })
                }
            };
            let cancelled = match (self.cancel, pending.query(), view) {
                (Cancel::None, ..) => None,
                // The server released the wait before it saw the cancel: the cancel's
                // WAIT_CANCELED follows; answer the wait then.
                (Cancel::Sent, QueryType::Wait, ResponseView::Wait(WaitResponse::StopWaiting)) => {
                    self.cancel = Cancel::ReleasedFirst;
                    self.consume(used);
                    continue;
                }
                // The cancel's reply, in the wait's place: the wait's never comes.
                (Cancel::Sent, QueryType::Wait, ResponseView::Wait(WaitResponse::WaitCanceled)) => {
                    if let Some(at) = self
                        .awaiting
                        .iter()
                        .position(|p| p.query() == QueryType::CancelWait)
                    {
                        self.awaiting.remove(at);
                    }
                    Some(WaitResponse::WaitCanceled)
                }
                (_, QueryType::CancelWait, ResponseView::Wait(WaitResponse::WaitCanceled)) => {
                    Some(if self.cancel == Cancel::ReleasedFirst {
                        WaitResponse::StopWaiting
                    } else {
                        WaitResponse::WaitCanceled
                    })
                }
                (_, QueryType::CancelWait, _) => {
                    return Err(BenchError::UnexpectedReply {
                        query: "CANCEL_WAIT",
                        expected: "WAIT_CANCELED",
                    })
                }
                // A reply to something else sent before the cancel.
                _ => None,
            };
            let answer = match cancelled {
                Some(wait) => {
                    self.cancel = Cancel::None;
                    read(&ResponseView::Wait(wait), QueryType::Wait)
                }
                None => read(&view, pending.query()),
            };
            self.consume(used);
            return Ok(Some(answer));
        }
    }

    /// Drops the reply of `used` bytes at the front and the request it answered.
    fn consume(&mut self, used: usize) {
        self.in_pos += used;
        if self.in_pos == self.input.len() {
            self.input.clear();
            self.in_pos = 0;
        }
        self.awaiting.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use rdzv_core::store::VALIDATION_MAGIC;

    /// Waits for `conn`'s connect, and reads the VALIDATE it then sends off `server`.
    fn wait_connected(conn: &mut StoreConn, server: &mut std::net::TcpStream) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while conn.pump().expect("connect failed").is_none() {
            assert!(Instant::now() < deadline, "connect did not complete");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut hello = Vec::new();
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode_into(&mut hello);
        let mut got = vec![0u8; hello.len()];
        server.read_exact(&mut got).unwrap();
        assert_eq!(got, hello);
    }

    #[test]
    fn sends_encoded_requests_and_decodes_split_replies_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conn = StoreConn::connect(addr, Limits::default(), None).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn, &mut server);

        // VALIDATE went out once connected, and gets no reply.
        conn.queue(&Request::Add {
            key: b"/k",
            delta: 3,
        });
        conn.queue(&Request::Get { key: b"/k" });
        assert_eq!(conn.awaiting(), 2);
        conn.flush().unwrap();
        assert!(!conn.has_unsent());

        let mut expected = Vec::new();
        Request::Add {
            key: b"/k",
            delta: 3,
        }
        .encode_into(&mut expected);
        Request::Get { key: b"/k" }.encode_into(&mut expected);
        let mut got = vec![0u8; expected.len()];
        server.read_exact(&mut got).unwrap();
        assert_eq!(got, expected);

        // ADD reply (i64 3), then GET reply ("3"), delivered in awkward pieces.
        let mut replies = 3i64.to_le_bytes().to_vec();
        replies.extend_from_slice(&1u64.to_le_bytes());
        replies.push(b'3');
        let mut seen = Vec::new();
        for piece in replies.chunks(5) {
            server.write_all(piece).unwrap();
            server.flush().unwrap();
            std::thread::sleep(Duration::from_millis(2));
            conn.fill().unwrap();
            while let Some(reply) = conn.next_reply().unwrap() {
                seen.push(reply);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.len() < 2 && Instant::now() < deadline {
            conn.fill().unwrap();
            while let Some(reply) = conn.next_reply().unwrap() {
                seen.push(reply);
            }
        }
        assert_eq!(seen, [Reply::Int(3), Reply::Value { len: 1 }]);
        assert_eq!(conn.awaiting(), 0);
    }

    #[test]
    fn bytes_that_answer_nothing_are_an_error_and_eof_is_reported() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conn = StoreConn::connect(addr, Limits::default(), None).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn, &mut server);
        server.write_all(b"\x01").unwrap();
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut closed = false;
        while !closed && Instant::now() < deadline {
            closed = conn.fill().unwrap() == Fill::Closed;
        }
        assert!(closed);
        assert!(matches!(
            conn.next_reply(),
            Err(BenchError::UnexpectedBytes { len: 1 })
        ));
    }

    #[test]
    fn a_malformed_reply_names_the_query() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conn = StoreConn::connect(addr, Limits::default(), None).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn, &mut server);
        conn.queue(&Request::Wait { keys: empty_keys() });
        conn.flush().unwrap();
        // A WAIT reply is one byte, 0 or 1.
        server.write_all(&[7]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            conn.fill().unwrap();
            match conn.next_reply() {
                Ok(None) if Instant::now() < deadline => continue,
                Err(BenchError::Decode { query, .. }) => {
                    assert_eq!(query, "WAIT");
                    break;
                }
                other => panic!("expected a decode error, got {other:?}"),
            }
        }
    }

    /// A connection with a `WAIT` sent and cancelled, and the server's side of it.
    fn cancelled_wait() -> (StoreConn, std::net::TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut conn =
            StoreConn::connect(listener.local_addr().unwrap(), Limits::default(), None).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn, &mut server);
        conn.queue(&Request::Wait { keys: empty_keys() });
        conn.cancel_wait();
        conn.cancel_wait(); // a second cancel while one is under way sends nothing
        assert!(conn.cancelling());
        assert_eq!(conn.awaiting(), 2);
        conn.flush().unwrap();
        (conn, server)
    }

    /// Feeds `bytes` from the server and collects the replies until `want` came.
    fn replies_after(
        conn: &mut StoreConn,
        server: &mut std::net::TcpStream,
        bytes: &[u8],
        want: usize,
    ) -> Result<Vec<Reply>, BenchError> {
        server.write_all(bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = Vec::new();
        while seen.len() < want {
            assert!(
                Instant::now() < deadline,
                "replies did not arrive: {seen:?}"
            );
            conn.fill().unwrap();
            while let Some(reply) = conn.next_reply()? {
                seen.push(reply);
            }
        }
        Ok(seen)
    }

    #[test]
    fn a_cancel_that_wins_answers_the_wait_with_wait_canceled_once() {
        let (mut conn, mut server) = cancelled_wait();
        // WAIT_CANCELED alone, in the wait's place; then a later ADD's reply.
        conn.queue(&Request::Add {
            key: b"/k",
            delta: 1,
        });
        conn.flush().unwrap();
        let mut bytes = vec![1u8];
        bytes.extend_from_slice(&7i64.to_le_bytes());
        let seen = replies_after(&mut conn, &mut server, &bytes, 2).unwrap();
        assert_eq!(
            seen,
            [Reply::Wait(WaitResponse::WaitCanceled), Reply::Int(7)]
        );
        assert!(!conn.cancelling());
        assert_eq!(conn.awaiting(), 0);
    }

    #[test]
    fn a_release_before_the_cancel_answers_the_wait_with_stop_waiting_once() {
        let (mut conn, mut server) = cancelled_wait();
        // STOP_WAITING (the wait's), then WAIT_CANCELED (the cancel's).
        let seen = replies_after(&mut conn, &mut server, &[0, 1], 1).unwrap();
        assert_eq!(seen, [Reply::Wait(WaitResponse::StopWaiting)]);
        assert!(!conn.cancelling());
        assert_eq!(conn.awaiting(), 0);
        assert_eq!(conn.next_reply().unwrap(), None);
    }

    #[test]
    fn a_cancel_answered_by_stop_waiting_is_an_error() {
        let (mut conn, mut server) = cancelled_wait();
        let got = replies_after(&mut conn, &mut server, &[0, 0], 1);
        assert!(
            matches!(
                got,
                Err(BenchError::UnexpectedReply {
                    query: "CANCEL_WAIT",
                    ..
                })
            ),
            "{got:?}"
        );
    }

    fn empty_keys() -> rdzv_core::store::KeyList<'static> {
        rdzv_core::store::KeyList::new(0, &[]).unwrap()
    }
}
