//! The `tcp` transport on glommio (io_uring): `TCP_NODELAY` sockets whose frames are the
//! core's frame format, whose fixed header is the length header.
//!
//! Receiving reads into one buffer and lets the core's [`FrameDecoder`] check every
//! field against the [`FrameLimits`] as soon as it is complete; the buffer only grows by
//! what the decoder says is still missing, so a peer claiming a huge frame is refused
//! before anything of that size is allocated. When a frame carries many inline tensor
//! bytes, everything before them goes through the buffer (and the decoder's checks) and
//! the tensors are then read straight into their own buffers, without a copy. Sending writes small frames (up to
//! [`COALESCE_LIMIT`]) with one write and large ones as the head followed by the frame's
//! own buffers, without copying them.
//!
//! This module decides nothing about what frames mean.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::io::{
    AssertAsync, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf,
};
use glommio::net::{TcpListener, TcpStream};
use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::{
    Decoded, FrameDecoder, FrameLimits, Header, TensorDescriptor, DESCRIPTOR_LEN, HEADER_LEN,
};

use super::error::TransportError;
use super::recycle;
use super::transport::poll_two;
use super::transport::{
    BlockingHalves, BlockingReceiver, BlockingSender, Connection, FrameReceiver, FrameSender,
    IncomingFrame, IntoBlocking, Listener, LocalBoxFuture, NotBlocking, OwnedFrame, StopConnection,
    Transport, TryRecv, Wake,
};

/// The scheme of tcp addresses.
pub const SCHEME: &str = "tcp://";
/// The domain descriptor: any two TCP endpoints can try to talk.
pub const DOMAIN_DESCRIPTOR: &str = "tcp:*";
/// Frames up to this size are copied into one buffer and written at once.
pub const COALESCE_LIMIT: usize = 64 * 1024;
/// How much the receive buffer asks the kernel for at least.
const READ_CHUNK: usize = 64 * 1024;
/// A receive buffer above this size is shrunk back once it is drained.
const KEEP_BUFFER: usize = 1 << 20;
/// Frames with at least this many data-section bytes (inline tensors and channel
/// descriptors) have them read straight into each tensor's own buffer instead of
/// through the receive buffer.
const DIRECT_READ_MIN: u64 = 256 * 1024;

/// TCP on glommio, listening on one host address.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    host: IpAddr,
}

impl TcpTransport {
    /// A transport that listens on `host` (port chosen by the kernel).
    pub fn new(host: IpAddr) -> TcpTransport {
        TcpTransport { host }
    }
}

/// `tcp://host:port` for an address.
pub fn format_address(addr: SocketAddr) -> String {
    format!("{SCHEME}{addr}")
}

/// The socket address in `tcp://host:port`.
///
/// # Errors
/// [`TransportError::BadAddress`] if it is not that shape.
pub fn parse_address(address: &str) -> Result<SocketAddr, TransportError> {
    let bad = |reason| TransportError::BadAddress {
        transport: "tcp",
        address: address.to_string(),
        reason,
    };
    address
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("it does not start with tcp://"))?
        .parse()
        .map_err(|_| bad("expected tcp://<ip>:<port>"))
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn domain_descriptor(&self) -> &str {
        DOMAIN_DESCRIPTOR
    }

    fn listen(&self) -> Result<Box<dyn Listener>, TransportError> {
        let wanted = SocketAddr::new(self.host, 0);
        let listener = TcpListener::bind(wanted).map_err(|e| TransportError::Listen {
            address: wanted.to_string(),
            source: e.into(),
        })?;
        let local = listener.local_addr().map_err(|e| TransportError::Listen {
            address: wanted.to_string(),
            source: e.into(),
        })?;
        Ok(Box::new(TcpTransportListener {
            listener,
            address: format_address(local),
        }))
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let stream = TcpStream::connect(addr)
                .await
                .map_err(|e| TransportError::Connect {
                    address: address.to_string(),
                    source: e.into(),
                })?;
            Ok(TcpConnection::boxed(stream, address.to_string()))
        })
    }
}

struct TcpTransportListener {
    listener: TcpListener,
    address: String,
}

impl Listener for TcpTransportListener {
    fn address(&self) -> &str {
        &self.address
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let stream = self
                .listener
                .accept()
                .await
                .map_err(|e| TransportError::Accept {
                    address: self.address.clone(),
                    source: e.into(),
                })?;
            let peer = stream
                .peer_addr()
                .map_or_else(|_| "an unknown peer".to_string(), format_address);
            Ok(TcpConnection::boxed(stream, peer))
        })
    }
}

struct TcpConnection {
    stream: TcpStream,
    peer: String,
}

impl TcpConnection {
    fn boxed(stream: TcpStream, peer: String) -> Box<dyn Connection> {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "TCP_NODELAY failed");
        }
        Box::new(TcpConnection { stream, peer })
    }
}

impl Connection for TcpConnection {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn split(self: Box<Self>) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>) {
        let fd = self.stream.as_raw_fd();
        let (read, write) = futures_lite::io::split(self.stream);
        let peer: Arc<str> = Arc::from(self.peer.as_str());
        (
            Box::new(TcpSender {
                write,
                peer: Arc::clone(&peer),
                scratch: Vec::new(),
                fd,
            }),
            Box::new(TcpReceiver {
                read,
                peer,
                buf: Vec::new(),
                filled: 0,
            }),
        )
    }
}

/// The executor's halves.
type AsyncSender = TcpSender<WriteHalf<TcpStream>>;
type AsyncReceiver = TcpReceiver<ReadHalf<TcpStream>>;
/// The halves served by threads: the same code over a blocking socket.
type ThreadSender = TcpSender<AssertAsync<std::net::TcpStream>>;
type ThreadReceiver = TcpReceiver<AssertAsync<std::net::TcpStream>>;

/// How long a blocking send may make no progress before the pipe counts as broken: a
/// peer whose process stopped reading must not hold a caller's thread forever.
const STALLED_SEND: Duration = Duration::from_secs(30);

/// Stops a thread-served TCP pipe: `shutdown(2)` both ways wakes its reader.
struct TcpStop(std::net::TcpStream);

impl StopConnection for TcpStop {
    fn stop(&self) {
        // Fails only on a socket that is no longer connected: then it is stopped already.
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// Takes a connection's halves off the executor: a duplicate of the socket, blocking,
/// carries the bytes the receiver already buffered; glommio's halves are dropped.
fn thread_halves(
    sender: AsyncSender,
    receiver: AsyncReceiver,
) -> Result<BlockingHalves, TransportError> {
    let io_error = |op, source| TransportError::Io {
        op,
        peer: sender.peer.to_string(),
        source,
    };
    // SAFETY: `sender.fd` is the descriptor of the socket that `sender.write` and
    // `receiver.read` own; both are alive here, so it stays open while it is borrowed
    // (only to duplicate it).
    let borrowed = unsafe { BorrowedFd::borrow_raw(sender.fd) };
    let owned = borrowed
        .try_clone_to_owned()
        .map_err(|e| io_error("duplicate the socket of", e))?;
    let stream = std::net::TcpStream::from(owned);
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(STALLED_SEND)))
        .map_err(|e| io_error("configure the socket of", e))?;
    let stop = stream
        .try_clone()
        .map_err(|e| io_error("duplicate the socket of", e))?;
    let writer = stream
        .try_clone()
        .map_err(|e| io_error("duplicate the socket of", e))?;
    let wake = TcpWake {
        socket: std::os::fd::OwnedFd::from(
            stream
                .try_clone()
                .map_err(|e| io_error("duplicate the socket of", e))?,
        ),
        kick: rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| io_error("create an eventfd for", e.into()))?,
    };
    let TcpSender {
        peer,
        scratch,
        write,
        fd,
    } = sender;
    let TcpReceiver {
        buf, filled, read, ..
    } = receiver;
    drop((write, read));
    Ok(BlockingHalves {
        sender: Box::new(TcpSender {
            write: AssertAsync::new(writer),
            peer: Arc::clone(&peer),
            scratch,
            fd,
        }),
        receiver: Box::new(TcpReceiver {
            read: AssertAsync::new(stream),
            peer,
            buf,
            filled,
        }),
        stop: Arc::new(TcpStop(stop)),
        wake: Some(Arc::new(wake)),
    })
}

struct TcpSender<W> {
    write: W,
    peer: Arc<str>,
    scratch: Vec<u8>,
    /// The socket's descriptor, to take the pipe off the executor.
    fd: RawFd,
}

impl<W: AsyncWrite + Unpin> TcpSender<W> {
    fn io_error(&self, source: std::io::Error) -> TransportError {
        TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source,
        }
    }

    async fn send_frame(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        let head = frame
            .encode_head()
            .map_err(|source| TransportError::Encode {
                peer: self.peer.to_string(),
                source,
            })?;
        let total = frame.encoded_len();
        if total <= COALESCE_LIMIT {
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            out.extend_from_slice(&head);
            for part in frame.body() {
                out.extend_from_slice(part);
            }
            let written = self.write.write_all(&out).await;
            self.scratch = out;
            written.map_err(|e| self.io_error(e))?;
        } else {
            self.write
                .write_all(&head)
                .await
                .map_err(|e| self.io_error(e))?;
            for part in frame.body().filter(|p| !p.is_empty()) {
                self.write
                    .write_all(part)
                    .await
                    .map_err(|e| self.io_error(e))?;
            }
        }
        self.write.flush().await.map_err(|e| self.io_error(e))?;
        Ok(total as u64)
    }
}

impl BlockingSender for ThreadSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        futures_lite::future::block_on(self.send_frame(frame))
    }
}

impl ThreadReceiver {
    /// The first buffered frame, if it is complete.
    fn buffered_frame(
        &mut self,
        limits: FrameLimits,
    ) -> Result<Option<IncomingFrame>, TransportError> {
        if self.filled == 0 {
            return Ok(None);
        }
        let mut decoder = FrameDecoder::new(limits);
        match decoder.decode(self.pending()) {
            Ok(Decoded::Complete(frame, used)) => {
                let incoming = IncomingFrame::from_frame(&frame);
                self.consume(used);
                Ok(Some(incoming))
            }
            Ok(Decoded::Partial(_)) => Ok(None),
            Err(source) => Err(TransportError::Frame {
                peer: self.peer.to_string(),
                source,
            }),
        }
    }
}

impl BlockingReceiver for ThreadReceiver {
    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError> {
        futures_lite::future::block_on(self.recv_frame(limits))
    }

    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        if let Some(frame) = self.buffered_frame(limits)? {
            return Ok(TryRecv::Frame(frame));
        }
        if self.buf.len() < self.filled.saturating_add(READ_CHUNK) {
            self.buf.resize(self.filled.saturating_add(READ_CHUNK), 0);
        }
        let spare = self.buf.get_mut(self.filled..).unwrap_or_default();
        let read = rustix::net::recv(self.read.get_ref(), spare, rustix::net::RecvFlags::DONTWAIT);
        match read {
            Ok((0, _)) if self.filled == 0 => return Ok(TryRecv::Closed),
            Ok((0, _)) => {
                return Err(TransportError::Truncated {
                    peer: self.peer.to_string(),
                    have: self.filled,
                })
            }
            Ok((n, _)) => self.filled += n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) if self.filled == 0 => {
                return Ok(TryRecv::Empty)
            }
            // Part of a frame is here: below, wait for the rest.
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(errno) => {
                return Err(TransportError::Io {
                    op: "receive from",
                    peer: self.peer.to_string(),
                    source: errno.into(),
                })
            }
        }
        if let Some(frame) = self.buffered_frame(limits)? {
            return Ok(TryRecv::Frame(frame));
        }
        // A frame is arriving: the rest is on its way, wait for it.
        Ok(match self.recv(limits)? {
            Some(frame) => TryRecv::Frame(frame),
            None => TryRecv::Closed,
        })
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        // The socket's readiness is level-triggered: only buffered bytes need a look now.
        Ok(self.filled == 0)
    }
}

/// Sleeps on a thread-served TCP pipe's socket, and on an eventfd that kicks it.
struct TcpWake {
    socket: std::os::fd::OwnedFd,
    kick: std::os::fd::OwnedFd,
}

impl Wake for TcpWake {
    fn wait(&self, timeout: Duration) -> bool {
        use std::os::fd::AsFd;
        let [_, kick] = poll_two(self.socket.as_fd(), self.kick.as_fd(), timeout);
        if kick.contains(rustix::event::PollFlags::IN) {
            let mut counter = [0u8; 8];
            let _ = rustix::io::read(&self.kick, &mut counter);
        }
        // The end of the stream is seen by receiving it.
        false
    }

    fn kick(&self) {
        let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
    }
}

impl FrameSender for AsyncSender {
    fn send(&mut self, frame: OwnedFrame) -> LocalBoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let sent = self.send_frame(&frame).await;
            recycle::give_all(frame.tensor_data);
            sent
        })
    }

    fn close(&mut self) -> LocalBoxFuture<'_, ()> {
        Box::pin(async move {
            if let Err(e) = self.write.close().await {
                tracing::debug!(peer = %self.peer, error = %e, "closing a TCP pipe failed");
            }
        })
    }

    fn into_blocking(
        self: Box<Self>,
        receiver: Box<dyn FrameReceiver>,
    ) -> LocalBoxFuture<'static, IntoBlocking> {
        Box::pin(async move {
            match receiver.into_any().downcast::<AsyncReceiver>() {
                Ok(receiver) => thread_halves(*self, *receiver).map_err(NotBlocking::Failed),
                Err(_) => Err(NotBlocking::Failed(TransportError::Io {
                    op: "take off the executor the pipe to",
                    peer: self.peer.to_string(),
                    source: std::io::Error::other("the halves belong to different transports"),
                })),
            }
        })
    }
}

struct TcpReceiver<R> {
    read: R,
    peer: Arc<str>,
    buf: Vec<u8>,
    filled: usize,
}

impl<R> TcpReceiver<R> {
    fn pending(&self) -> &[u8] {
        self.buf.get(..self.filled).unwrap_or_default()
    }

    /// Drops the first `used` bytes.
    fn consume(&mut self, used: usize) {
        let used = used.min(self.filled);
        self.buf.copy_within(used..self.filled, 0);
        self.filled -= used;
        if self.buf.len() > KEEP_BUFFER && self.filled < READ_CHUNK {
            self.buf.truncate(READ_CHUNK.max(self.filled));
            self.buf.shrink_to_fit();
        }
    }
}

/// How a frame with large inline data is read: `fixed` bytes (header to payload)
/// through the buffer, then each tensor's data-section entry (its bytes, or its channel
/// descriptor) into its own buffer.
struct DirectPlan {
    header: Header,
    fixed: usize,
    tensors: Vec<TensorDescriptor>,
}

/// A [`DirectPlan`] if the header is known, its descriptors are all buffered, and the
/// frame's inline bytes are many.
fn direct_plan(header: Option<&Header>, pending: &[u8]) -> Option<DirectPlan> {
    let header = *header?;
    let count = usize::try_from(header.tensor_count).ok()?;
    let descriptors = pending.get(HEADER_LEN..HEADER_LEN + count.checked_mul(DESCRIPTOR_LEN)?)?;
    let tensors = descriptors
        .chunks_exact(DESCRIPTOR_LEN)
        .zip(0u32..)
        .map(|(bytes, i)| {
            let bytes: &[u8; DESCRIPTOR_LEN] = bytes.try_into().ok()?;
            TensorDescriptor::from_bytes(bytes, i).ok()
        })
        .collect::<Option<Vec<_>>>()?;
    let inline: u64 = tensors
        .iter()
        .map(TensorDescriptor::data_len)
        .fold(0u64, u64::saturating_add);
    if inline < DIRECT_READ_MIN {
        return None;
    }
    Some(DirectPlan {
        header,
        fixed: usize::try_from(header.fixed_len()).ok()?,
        tensors,
    })
}

impl<R: AsyncRead + Unpin> TcpReceiver<R> {
    /// Finishes a frame whose first `plan.fixed` bytes are buffered (and checked by the
    /// decoder): the inline tensors are read into their own buffers.
    async fn read_direct(&mut self, plan: DirectPlan) -> Result<IncomingFrame, TransportError> {
        let DirectPlan {
            header,
            fixed,
            tensors,
        } = plan;
        let truncated = |have: usize| TransportError::Truncated {
            peer: self.peer.to_string(),
            have,
        };
        let handler_start = HEADER_LEN + tensors.len() * DESCRIPTOR_LEN;
        let handler_end = handler_start + header.handler_len as usize;
        let metadata_end = handler_end + header.metadata_len as usize;
        let handler = self
            .buf
            .get(handler_start..handler_end)
            .and_then(|b| std::str::from_utf8(b).ok())
            .unwrap_or_default()
            .to_string();
        let metadata = self
            .buf
            .get(handler_end..metadata_end)
            .unwrap_or_default()
            .to_vec();
        let payload = self
            .buf
            .get(metadata_end..fixed)
            .unwrap_or_default()
            .to_vec();
        // Inline bytes that arrived with the fixed part (at most one read's worth).
        let mut early_at = fixed;
        let mut wire_len = fixed as u64;
        let mut received = Vec::with_capacity(tensors.len());
        for descriptor in tensors {
            let len = usize::try_from(descriptor.data_len()).map_err(|_| truncated(early_at))?;
            let mut data = recycle::try_take(len).map_err(|e| TransportError::Io {
                op: "receive a tensor from",
                peer: self.peer.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e),
            })?;
            let early = self.buf.get(early_at..self.filled).unwrap_or_default();
            let take = early.len().min(len);
            if let (Some(dst), Some(src)) = (data.get_mut(..take), early.get(..take)) {
                dst.copy_from_slice(src);
            }
            early_at += take;
            if let Some(rest) = data.get_mut(take..) {
                self.read.read_exact(rest).await.map_err(|source| {
                    if source.kind() == std::io::ErrorKind::UnexpectedEof {
                        truncated(early_at)
                    } else {
                        TransportError::Io {
                            op: "receive from",
                            peer: self.peer.to_string(),
                            source,
                        }
                    }
                })?;
            }
            wire_len += descriptor.data_len();
            received.push((descriptor, data));
        }
        // Buffered bytes past `early_at` are the next frame's.
        self.consume(early_at);
        Ok(IncomingFrame {
            kind: header.kind,
            message_id: header.message_id,
            handler,
            metadata,
            payload,
            tensors: received,
            wire_len,
        })
    }
}

impl FrameReceiver for AsyncReceiver {
    fn recv(
        &mut self,
        limits: FrameLimits,
    ) -> LocalBoxFuture<'_, Result<Option<IncomingFrame>, TransportError>> {
        Box::pin(self.recv_frame(limits))
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

impl<R: AsyncRead + Unpin> TcpReceiver<R> {
    /// The next frame, read as the module doc says.
    async fn recv_frame(
        &mut self,
        limits: FrameLimits,
    ) -> Result<Option<IncomingFrame>, TransportError> {
        {
            let mut decoder = FrameDecoder::new(limits);
            loop {
                let missing = if self.filled == 0 {
                    READ_CHUNK
                } else {
                    let peer = Arc::clone(&self.peer);
                    match decoder.decode(self.pending()) {
                        Ok(Decoded::Complete(frame, used)) => {
                            let incoming = IncomingFrame::from_frame(&frame);
                            self.consume(used);
                            return Ok(Some(incoming));
                        }
                        Ok(Decoded::Partial(missing)) => {
                            if let Some(plan) = direct_plan(decoder.header(), self.pending()) {
                                if self.filled >= plan.fixed {
                                    return self.read_direct(plan).await.map(Some);
                                }
                                // Read only up to the inline data.
                                plan.fixed - self.filled
                            } else {
                                missing
                            }
                        }
                        Err(source) => {
                            return Err(TransportError::Frame {
                                peer: peer.to_string(),
                                source,
                            })
                        }
                    }
                };
                // The decoder has checked every complete field against the limits, so
                // `missing` is a size the limits allow.
                let wanted = self.filled.saturating_add(missing.max(READ_CHUNK));
                if self.buf.len() < wanted {
                    self.buf.resize(wanted, 0);
                }
                let spare = self.buf.get_mut(self.filled..).unwrap_or_default();
                let n = self
                    .read
                    .read(spare)
                    .await
                    .map_err(|source| TransportError::Io {
                        op: "receive from",
                        peer: self.peer.to_string(),
                        source,
                    })?;
                if n == 0 {
                    return if self.filled == 0 {
                        Ok(None)
                    } else {
                        Err(TransportError::Truncated {
                            peer: self.peer.to_string(),
                            have: self.filled,
                        })
                    };
                }
                self.filled += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        let addr: SocketAddr = ([127, 0, 0, 1], 4242).into();
        let text = format_address(addr);
        assert_eq!(text, "tcp://127.0.0.1:4242");
        assert_eq!(parse_address(&text).ok(), Some(addr));
        let v6: SocketAddr = "[::1]:80".parse().unwrap_or(addr);
        assert_eq!(parse_address(&format_address(v6)).ok(), Some(v6));
        assert!(parse_address("uv://127.0.0.1:1").is_err());
        assert!(parse_address("tcp://localhost").is_err());
    }
}
