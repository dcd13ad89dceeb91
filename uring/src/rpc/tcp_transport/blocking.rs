//! A tcp pipe served by threads: the socket in blocking mode, with the framing code; a
//! poll on the socket and an eventfd for the reader thread's sleep, and `shutdown(2)` to
//! stop it from any thread.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::frame::{Decoded, FrameDecoder, FrameLimits};

use super::framing::{TcpReceiver, TcpSender, READ_CHUNK};
use crate::rpc::error::TransportError;
use crate::rpc::transport::{
    poll_two, Connection, Control, FrameReceiver, FrameSender, IncomingFrame, OwnedFrame, TryRecv,
};

/// The halves served by threads: the framing code over a blocking socket.
type ThreadSender = TcpSender<std::net::TcpStream>;
type ThreadReceiver = TcpReceiver<std::net::TcpStream>;

/// How long a blocking send may make no progress before the pipe counts as broken: a
/// peer whose process stopped reading must not hold a caller's thread forever.
const STALLED_SEND: Duration = Duration::from_secs(30);

/// A partial frame of at least this many bytes is read to its end by blocking reads;
/// smaller ones are polled for (`try_recv` returns `Empty`), so that every wait on them
/// keeps its deadline.
const BLOCKING_REST_MIN: usize = 1 << 20;

/// A connected socket (taken off the executor that connected or accepted it) as a
/// connection served by threads.
pub(super) fn connection(
    stream: std::net::TcpStream,
    peer: String,
) -> Result<Connection, TransportError> {
    let io_error = |op, source| TransportError::Io {
        op,
        peer: peer.clone(),
        source,
    };
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "TCP_NODELAY failed");
    }
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(STALLED_SEND)))
        .map_err(|e| io_error("configure the socket of", e))?;
    let duplicate = |stream: &std::net::TcpStream| {
        stream
            .try_clone()
            .map_err(|e| io_error("duplicate the socket of", e))
    };
    let (writer, socket) = (duplicate(&stream)?, duplicate(&stream)?);
    let control = TcpControl {
        socket,
        kick: rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| io_error("create an eventfd for", e.into()))?,
    };
    let shared: Arc<str> = Arc::from(peer.as_str());
    Ok(Connection {
        sender: Box::new(TcpSender {
            write: writer,
            peer: Arc::clone(&shared),
            scratch: Vec::new(),
        }),
        receiver: Box::new(TcpReceiver {
            read: stream,
            peer: shared,
            buf: Vec::new(),
            filled: 0,
        }),
        control: Arc::new(control),
        peer,
    })
}

impl FrameSender for ThreadSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        self.send_frame(frame)
    }
}

impl ThreadReceiver {
    /// The first buffered frame, if it is complete; else how many more bytes it needs at
    /// least (0 when nothing is buffered).
    fn buffered_frame(
        &mut self,
        limits: FrameLimits,
    ) -> Result<Result<IncomingFrame, usize>, TransportError> {
        if self.filled == 0 {
            return Ok(Err(0));
        }
        let mut decoder = FrameDecoder::new(limits);
        match decoder.decode(self.pending()) {
            Ok(Decoded::Complete(frame, used)) => {
                let incoming = IncomingFrame::from_frame(&frame);
                self.consume(used);
                Ok(Ok(incoming))
            }
            Ok(Decoded::Partial(missing)) => Ok(Err(missing)),
            Err(source) => Err(TransportError::Frame {
                peer: self.peer.to_string(),
                source,
            }),
        }
    }
}

impl FrameReceiver for ThreadReceiver {
    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError> {
        self.recv_frame(limits)
    }

    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        if let Ok(frame) = self.buffered_frame(limits)? {
            return Ok(TryRecv::Frame(frame));
        }
        if self.buf.len() < self.filled.saturating_add(READ_CHUNK) {
            self.buf.resize(self.filled.saturating_add(READ_CHUNK), 0);
        }
        let spare = self.buf.get_mut(self.filled..).unwrap_or_default();
        let read = rustix::net::recv(&self.read, spare, rustix::net::RecvFlags::DONTWAIT);
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
        let missing = match self.buffered_frame(limits)? {
            Ok(frame) => return Ok(TryRecv::Frame(frame)),
            Err(missing) => missing,
        };
        // A small frame's rest is polled for like a new frame: a peer that dribbles one
        // (a stranger's handshake) holds no thread past its caller's deadline.
        if self.filled.saturating_add(missing) < BLOCKING_REST_MIN {
            return Ok(TryRecv::Empty);
        }
        // A big frame is arriving (its header has passed the limits): the rest is on its
        // way, read it with blocking reads, straight into its tensors where it can.
        Ok(match self.recv(limits)? {
            Some(frame) => TryRecv::Frame(frame),
            None => TryRecv::Closed,
        })
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        // The socket's readiness is level-triggered, and `try_recv` returned every
        // complete buffered frame: what is buffered now is part of a frame, whose next
        // bytes wake the wait.
        Ok(true)
    }
}

/// Sleeps on a thread-served TCP pipe's socket and on an eventfd that kicks it, and
/// stops the pipe with `shutdown(2)` both ways (which also wakes its reader).
struct TcpControl {
    socket: std::net::TcpStream,
    kick: std::os::fd::OwnedFd,
}

impl Control for TcpControl {
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

    fn stop(&self) {
        // Fails only on a socket that is no longer connected: then it is stopped already.
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}
