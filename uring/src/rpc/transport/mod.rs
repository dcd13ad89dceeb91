//! The transport seam: what the agent needs from a way of moving frames between two
//! processes, and nothing more. Four traits:
//!
//! - [`Transport`]: an endpoint, in quinn's `Endpoint` shape. It has a kind and a
//!   *domain descriptor* (two endpoints can use it only if their descriptors are equal:
//!   see `rdzv_core::negotiate`), [`listen`]s once (giving the address peers connect
//!   to), then [`accept`]s and [`connect`]s. Both give a [`Connection`]: its three
//!   halves, which different threads use at once.
//! - [`FrameSender`]: sends whole frames, blocking, from whichever thread holds the
//!   pipe's send lock.
//! - [`FrameReceiver`]: receives whole frames on the pipe's reader thread, or, polled
//!   without system calls, on a caller's thread waiting for its reply.
//! - [`Control`]: what any thread may do to the connection without either half: sleep
//!   until the receiver has something ([`Control::wait`]), wake that sleeper
//!   ([`Control::kick`]), and end the connection both ways ([`Control::stop`]).
//!
//! A transport built outside this crate (`rdzv_rdma`'s ibv) comes in as a
//! [`TransportPlugin`]: a kind and the function that opens the transport.
//!
//! `accept` and `connect` run on the agent's handshake executor ([`LocalExecutor`]: a
//! current-thread tokio runtime on epoll, no io_uring) and return local futures; what
//! they return is already served by threads. The handshake that follows runs on those
//! halves (`super::io`), and the same halves then carry the pipe as a lane. How the
//! three transports fit:
//!
//! * **tcp** ([`super::tcp_transport`]): tokio connects and accepts; the socket is then put in
//!   blocking mode, with the framing code (limits checked before anything is allocated),
//!   a poll on the socket and an eventfd for [`Control::wait`], and `shutdown(2)` for
//!   [`Control::stop`].
//! * **shm** ([`super::shm_transport`] over `crate::shm`): its connections are blocking
//!   and already split into sender and receiver; an accept thread runs the bootstrap
//!   (memfds over `SCM_RIGHTS`). Its domain descriptor is its viability (boot id plus
//!   network namespace).
//! * **ibv** (`rdzv_rdma::ibv::transport`): [`FrameSender::send_owned`] takes the
//!   [`OwnedFrame`] *by value*, so the transport keeps the payload and tensor buffers
//!   (registered on the fly) until the peer has read them, and sends them zero-copy; the
//!   receiver learns every size from the header and descriptors (the core frame format
//!   puts them first), so the peer's RDMA READs land straight in the
//!   [`IncomingFrame`]'s buffers.
//!
//! A tensor on a channel other than `basic` reaches the seam only as its channel
//! descriptor (an entry of the frame's data section); the agent moves its bytes
//! (`super::tensors`). The seam does not negotiate (the agent does, with the core),
//! retry, or know about calls, peers' names or timeouts.
//!
//! [`listen`]: Transport::listen
//! [`accept`]: Transport::accept
//! [`connect`]: Transport::connect

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::FrameLimits;

use super::device::HostBytes;
use super::error::TransportError;

mod executor;
mod listening;
pub use executor::LocalExecutor;
pub use listening::{accept_next, not_listening, Listening};

/// The published-address format is the core's.
pub use rdzv_core::rpc::address::{address_for, join_addresses, ADDRESS_SEPARATOR};

/// A boxed future that stays on the executor that made it.
pub type LocalBoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// A way to move frames between processes: one endpoint, which listens on one address
/// and connects to others.
pub trait Transport {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// The domain descriptor: peers can use this transport together only if theirs is
    /// equal.
    fn domain_descriptor(&self) -> &str;

    /// Starts listening (once; on the executor); the address peers pass to
    /// [`connect`](Transport::connect), e.g. `tcp://10.0.0.1:40123`. Dropping the
    /// transport stops listening.
    ///
    /// # Errors
    /// [`TransportError::Listen`].
    fn listen(&mut self) -> Result<String, TransportError>;

    /// The next incoming connection.
    ///
    /// # Errors
    /// [`TransportError::Accept`], also when [`listen`](Transport::listen) was not
    /// called.
    fn accept(&self) -> LocalBoxFuture<'_, Result<Connection, TransportError>>;

    /// Connects to a listener's address.
    ///
    /// # Errors
    /// [`TransportError::Connect`] or [`TransportError::BadAddress`].
    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Connection, TransportError>>;
}

/// A transport built outside this crate (e.g. `rdzv_rdma`'s ibv), handed to the agent
/// in `RpcOptions::transport_plugins`: its kind, and how to open it.
///
/// The agent opens it once per `init_rpc` when its kind is among the transports it may
/// offer; a plugin for a kind this crate implements itself (`tcp`, `shm`) is refused.
#[derive(Clone)]
pub struct TransportPlugin {
    kind: TransportKind,
    open: Arc<OpenTransport>,
}

/// How a [`TransportPlugin`] opens its transport for a worker listening on a host.
type OpenTransport =
    dyn Fn(IpAddr) -> Result<Box<dyn Transport + Send>, TransportError> + Send + Sync;

impl TransportPlugin {
    /// A plugin of `kind` that `open`s the transport for a worker listening on a host.
    /// `open` fails with [`TransportError::Unavailable`], the plugin's own error as its
    /// source, when the transport is not viable in this process (the agent logs it and
    /// leaves the transport out).
    pub fn new(
        kind: TransportKind,
        open: impl Fn(IpAddr) -> Result<Box<dyn Transport + Send>, TransportError>
            + Send
            + Sync
            + 'static,
    ) -> TransportPlugin {
        TransportPlugin {
            kind,
            open: Arc::new(open),
        }
    }

    /// Which transport the plugin provides.
    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    /// The transport for a worker listening on `host`.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] when it is not viable here.
    pub fn open(&self, host: IpAddr) -> Result<Box<dyn Transport + Send>, TransportError> {
        (self.open)(host)
    }
}

impl std::fmt::Debug for TransportPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.kind)
    }
}

/// An open connection, already served by threads: any thread may send under the
/// pipe's lock, one thread receives at a time, and any thread may use the [`Control`].
pub struct Connection {
    /// The peer's address, for messages.
    pub peer: String,
    /// Sends whole frames, blocking.
    pub sender: Box<dyn FrameSender>,
    /// Receives whole frames, blocking or polled.
    pub receiver: Box<dyn FrameReceiver>,
    /// Sleeps on, wakes and stops the connection from any thread.
    pub control: Arc<dyn Control>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// Sends whole frames from whichever thread holds it.
pub trait FrameSender: Send {
    /// Sends `frame`, blocking until the transport no longer needs its buffers; the bytes
    /// put on the wire.
    ///
    /// # Errors
    /// [`TransportError`] when the connection failed.
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError>;

    /// Sends a frame the transport may keep: one that moves buffers zero-copy (ibv)
    /// keeps them until the peer read them. The bytes put on the wire, and the frame
    /// back when the transport is done with it (its buffers can be reused).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    fn send_owned(
        &mut self,
        frame: OwnedFrame,
    ) -> Result<(u64, Option<OwnedFrame>), TransportError> {
        self.send(&frame).map(|sent| (sent, Some(frame)))
    }
}

/// Receives whole frames: blocking on the pipe's reader thread, or polled without system
/// calls ([`try_recv`](Self::try_recv)), so that a caller waiting for its reply can read
/// it itself while the reader thread sleeps on [`Control::wait`].
pub trait FrameReceiver: Send {
    /// The next frame (checked against `limits` before its buffers are allocated);
    /// `Ok(None)` when the peer closed the connection between frames or the connection
    /// was stopped.
    ///
    /// # Errors
    /// [`TransportError`] when the connection failed or the frame is invalid.
    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError>;

    /// The next frame if one is complete now, without waiting.
    ///
    /// # Errors
    /// As [`recv`](Self::recv).
    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError>;

    /// Announces that the reader is about to sleep on [`Control::wait`]: `true` when
    /// armed (nothing is there; the peer signals the next frame), `false` when a frame or
    /// the end is already there (not armed).
    ///
    /// # Errors
    /// When the connection failed.
    fn arm(&mut self) -> Result<bool, TransportError>;

    /// Withdraws [`arm`](Self::arm) after waking.
    fn disarm(&mut self) {}

    /// Withdraws [`arm`](Self::arm) without consuming the wake-up signal, for a reader
    /// that polls with [`try_recv`](Self::try_recv) meanwhile.
    fn withdraw(&mut self) {}

    /// This half as `Any`, for a transport's own test hooks.
    #[doc(hidden)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// What [`FrameReceiver::try_recv`] found.
#[derive(Debug)]
pub enum TryRecv {
    /// A whole frame.
    Frame(IncomingFrame),
    /// Nothing yet.
    Empty,
    /// The peer closed the connection between frames, or it was stopped.
    Closed,
}

/// What any thread may do to a connection without holding either half.
pub trait Control: Send + Sync {
    /// Blocks until the peer signalled (after [`FrameReceiver::arm`]),
    /// [`kick`](Self::kick) was called, the peer is gone, or `timeout` passed; `true`
    /// when the peer's process is gone (what it sent before may still be there to
    /// receive).
    fn wait(&self, timeout: Duration) -> bool;

    /// Wakes the thread in [`wait`](Self::wait).
    fn kick(&self);

    /// Ends the connection both ways (idempotent): the receiver returns, later sends
    /// fail, and the peer sees the end of the stream.
    fn stop(&self);
}

/// The next frame of `connection` within `timeout` (polled: the receiver sleeps on the
/// control between looks), `Ok(None)` when the peer closed it, and a timeout error when
/// nothing came: a pipe's handshake waits with this, on a thread of its own.
///
/// # Errors
/// As [`FrameReceiver::recv`], and [`TransportError::Io`] with `TimedOut`.
pub fn recv_within(
    connection: &mut Connection,
    limits: FrameLimits,
    timeout: Duration,
) -> Result<Option<IncomingFrame>, TransportError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match connection.receiver.try_recv(limits)? {
            TryRecv::Frame(frame) => return Ok(Some(frame)),
            TryRecv::Closed => return Ok(None),
            TryRecv::Empty => {}
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(TransportError::Io {
                op: "receive from",
                peer: connection.peer.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no frame within {timeout:?}"),
                ),
            });
        }
        if connection.receiver.arm()? {
            let gone = connection.control.wait(left.min(POLL_SLICE));
            connection.receiver.disarm();
            if gone {
                return match connection.receiver.try_recv(limits)? {
                    TryRecv::Frame(frame) => Ok(Some(frame)),
                    _ => Ok(None),
                };
            }
        }
    }
}

/// The longest single sleep of [`recv_within`]: a missed signal costs at most this.
const POLL_SLICE: Duration = Duration::from_millis(50);

/// Waits up to `timeout` until `first` or `second` is readable (or hung up); the events
/// of each. An interrupted or failed wait returns no events: callers look again.
pub(crate) fn poll_two(
    first: std::os::fd::BorrowedFd<'_>,
    second: std::os::fd::BorrowedFd<'_>,
    timeout: Duration,
) -> [rustix::event::PollFlags; 2] {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [
        PollFd::new(&first, PollFlags::IN),
        PollFd::new(&second, PollFlags::IN),
    ];
    let timeout = Timespec::try_from(timeout).ok();
    match poll(&mut fds, timeout.as_ref()) {
        Ok(_) => [fds[0].revents(), fds[1].revents()],
        Err(_) => [PollFlags::empty(); 2],
    }
}

/// A frame to send, owning its parts so a transport can keep them until its write
/// completes: the core's, whose data-section entries are [`HostBytes`] (a `cuda_basic`
/// tensor's where its runtime staged it).
pub type OwnedFrame = rdzv_core::rpc::frame::OwnedFrame<HostBytes>;

/// A received frame, owning its parts (the core's).
pub use rdzv_core::rpc::frame::IncomingFrame;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_addresses_carry_every_listener() {
        let published = join_addresses(["shm://@00a1f", "tcp://10.0.0.1:4000"]);
        assert_eq!(published, "shm://@00a1f;tcp://10.0.0.1:4000");
        assert_eq!(
            address_for(&published, TransportKind::Tcp),
            Some("tcp://10.0.0.1:4000")
        );
        assert_eq!(
            address_for(&published, TransportKind::Shm),
            Some("shm://@00a1f")
        );
        assert_eq!(address_for("tcp://10.0.0.1:4000", TransportKind::Shm), None);
        assert_eq!(address_for("tcpx://1", TransportKind::Tcp), None);
        assert_eq!(join_addresses(["tcp://1.2.3.4:5"]), "tcp://1.2.3.4:5");
    }
}
