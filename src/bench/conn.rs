//! One TCPStore client connection driven by readiness events, for the load generators.
//!
//! [`StoreConn`] owns a non-blocking socket, an output buffer of encoded requests and an
//! input buffer of reply bytes. Requests are encoded and replies decoded by
//! `rdzv_core::store::codec`, so the load it makes is the real protocol and works against
//! any TCPStore server (rdzv's, PyTorch's libuv or legacy one). Each reply is decoded
//! knowing the request it answers ([`PendingReply`]), in the order the requests were sent.
//!
//! It does not decide what to send next or when (the throughput and storm drivers do),
//! and it never blocks: [`StoreConn::flush`] and [`StoreConn::fill`] stop at
//! `WouldBlock`, and the caller waits for the next readiness event.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::TcpStream;
use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::{CheckResponse, QueryType, Request, WaitResponse};

use super::BenchError;

/// `poll.poll`, reading an interruption by a signal (`EINTR`) as a wake-up with no
/// events: the drivers loop and poll again, as they do after a timeout.
pub(super) fn poll_events(
    poll: &mut mio::Poll,
    events: &mut mio::Events,
    timeout: Option<std::time::Duration>,
) -> io::Result<()> {
    match poll.poll(events, timeout) {
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {
            events.clear();
            Ok(())
        }
        other => other,
    }
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
    /// `CHECK`.
    Check(CheckResponse),
    /// Any other reply, by the query it answers.
    Other(QueryType),
}

impl Reply {
    fn from_view(view: &ResponseView<'_>, query: QueryType) -> Reply {
        match *view {
            ResponseView::Pong(nonce) => Reply::Pong(nonce),
            ResponseView::Int(n) => Reply::Int(n),
            ResponseView::Value(value) => Reply::Value { len: value.len() },
            ResponseView::Wait(wait) => Reply::Wait(wait),
            ResponseView::Check(check) => Reply::Check(check),
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

/// A non-blocking TCPStore client connection. See the [module docs](self).
#[derive(Debug)]
pub(super) struct StoreConn {
    stream: TcpStream,
    out: Vec<u8>,
    out_pos: usize,
    input: Vec<u8>,
    in_pos: usize,
    awaiting: VecDeque<PendingReply>,
    limits: Limits,
}

/// Size of the stack buffer each `read` goes through.
const READ_CHUNK: usize = 16 * 1024;

impl StoreConn {
    /// Starts a non-blocking connect to `addr`. Completion is reported by a writable
    /// event; check it with [`StoreConn::is_connected`].
    pub(super) fn connect(addr: SocketAddr, limits: Limits) -> io::Result<StoreConn> {
        let stream = TcpStream::connect(addr)?;
        Ok(StoreConn {
            stream,
            out: Vec::with_capacity(64),
            out_pos: 0,
            input: Vec::with_capacity(64),
            in_pos: 0,
            awaiting: VecDeque::with_capacity(2),
            limits,
        })
    }

    /// The socket, to register with a `mio::Poll`.
    pub(super) fn stream_mut(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Whether the non-blocking connect has completed: `Ok(false)` while it is in
    /// progress, an error if it failed (refused, reset, timed out).
    pub(super) fn is_connected(&mut self) -> io::Result<bool> {
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
    /// [`BenchError::Decode`] if the bytes are not a valid reply to the oldest request
    /// still owed one, [`BenchError::UnexpectedBytes`] if bytes arrived that answer
    /// nothing.
    pub(super) fn next_reply(&mut self) -> Result<Option<Reply>, BenchError> {
        let unread = self.input.get(self.in_pos..).unwrap_or_default();
        let Some(&pending) = self.awaiting.front() else {
            return if unread.is_empty() {
                Ok(None)
            } else {
                Err(BenchError::UnexpectedBytes { len: unread.len() })
            };
        };
        match codec::decode_response_view(pending, unread, &self.limits) {
            Ok(Decoded::Partial(_)) => Ok(None),
            Ok(Decoded::Complete(view, used)) => {
                let reply = Reply::from_view(&view, pending.query());
                self.in_pos += used;
                if self.in_pos == self.input.len() {
                    self.input.clear();
                    self.in_pos = 0;
                }
                self.awaiting.pop_front();
                Ok(Some(reply))
            }
            Err(source) => Err(BenchError::Decode {
                query: pending.query().name(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use rdzv_core::store::VALIDATION_MAGIC;

    fn wait_connected(conn: &mut StoreConn) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !conn.is_connected().expect("connect failed") {
            assert!(Instant::now() < deadline, "connect did not complete");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn sends_encoded_requests_and_decodes_split_replies_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conn = StoreConn::connect(addr, Limits::default()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn);

        conn.queue(&Request::Validate {
            magic: VALIDATION_MAGIC,
        });
        conn.queue(&Request::Add {
            key: b"/k",
            delta: 3,
        });
        conn.queue(&Request::Get { key: b"/k" });
        assert_eq!(conn.awaiting(), 2, "VALIDATE gets no reply");
        conn.flush().unwrap();
        assert!(!conn.has_unsent());

        let mut expected = Vec::new();
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode_into(&mut expected);
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
        let mut conn = StoreConn::connect(addr, Limits::default()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn);
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
        let mut conn = StoreConn::connect(addr, Limits::default()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        wait_connected(&mut conn);
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

    fn empty_keys() -> rdzv_core::store::KeyList<'static> {
        rdzv_core::store::KeyList::new(0, &[]).unwrap()
    }
}
