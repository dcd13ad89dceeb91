//! The transport seam: what the agent needs from a way of moving frames between two
//! processes, and nothing more.
//!
//! A [`Transport`] has a kind, a *domain descriptor* (two endpoints can use it only if
//! their descriptors are equal: see `rdzv_core::negotiate`), can [`listen`] (giving the
//! address string peers connect to) and can [`connect`] to such an address. A
//! [`Connection`] moves whole frames and [`split`]s into a [`FrameSender`] and a
//! [`FrameReceiver`] so that a large write never stops reads (both peers writing 64 MiB
//! at each other must not deadlock).
//!
//! Every method runs on the agent's I/O executor ([`LocalExecutor`]: a current-thread
//! tokio runtime on epoll, no io_uring) and returns a local future. How the three
//! transports fit:
//!
//! * **tcp** ([`super::tcp`]): tokio sockets for the handshake, then the same socket in
//!   blocking mode for the lane (the same framing code over either); the
//!   core frame header is the length header, limits are checked before anything is
//!   allocated.
//! * **shm** ([`super::shm`] over `crate::transport::shm`): its connection is blocking
//!   and already split into sender and receiver halves; until the pipe becomes a lane, an
//!   adapter runs each half on its own thread and hands frames over through a channel,
//!   so the halves map one to one onto [`FrameSender`] and [`FrameReceiver`]. Its domain descriptor is its viability
//!   (boot id plus network namespace).
//! * **ibv** (`rdzv_rdma::ibv::transport`, plugged in through [`TransportPlugin`]):
//!   [`FrameSender::send`] takes the [`OwnedFrame`] *by value*, so the transport keeps
//!   the payload and tensor buffers (registered on the fly) until the peer has read
//!   them, and sends them zero-copy; the receiver learns every size from the header and
//!   descriptors (the core frame format puts them first), so the peer's RDMA READs land
//!   straight in the [`IncomingFrame`]'s buffers.
//!
//! A crate that depends on this one adds a transport with a [`TransportPlugin`] in
//! `RpcOptions::transport_plugins`: the agent opens it at start (or leaves it out, with
//! the plugin's reason logged, when it is not viable) and then treats it like the
//! built-in ones.
//!
//! Every transport hands a connection's halves over after the handshake
//! ([`FrameSender::into_blocking`]): the agent then serves the pipe from threads (a
//! "lane"); a transport that cannot is refused. tcp does it with the socket taken off
//! the runtime and the same framing code over blocking I/O; shm takes its
//! halves back from the adapter threads.
//!
//! A tensor on a channel other than `basic` reaches the seam only as its channel
//! descriptor (an entry of the frame's data section); the agent moves its bytes
//! (`super::channels`). The seam does not negotiate (the agent does, with the core),
//! retry, or know about calls, peers' names or timeouts.
//!
//! [`listen`]: Transport::listen
//! [`connect`]: Transport::connect
//! [`split`]: Connection::split

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::{
    EncodeError, Frame, FrameKind, FrameLimits, OutgoingFrame, TensorDescriptor,
};

use super::device::HostBytes;
use super::error::TransportError;

mod executor;
pub use executor::LocalExecutor;

/// The published-address format is the core's.
pub use rdzv_core::rpc::address::{address_for, join_addresses, ADDRESS_SEPARATOR};

/// A boxed future that stays on the executor that made it.
pub type LocalBoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// A way to move frames between processes.
pub trait Transport {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// The domain descriptor: peers can use this transport together only if theirs is
    /// equal.
    fn domain_descriptor(&self) -> &str;

    /// Starts listening; the listener's [`address`](Listener::address) is what peers pass
    /// to [`connect`](Transport::connect).
    ///
    /// # Errors
    /// [`TransportError::Listen`].
    fn listen(&self) -> Result<Box<dyn Listener>, TransportError>;

    /// Connects to a listener's address.
    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Box<dyn Connection>, TransportError>>;
}

/// A transport built outside this crate (e.g. `rdzv_rdma`'s ibv), handed to the agent
/// in `RpcOptions::transport_plugins`.
///
/// The agent calls [`open`](TransportPlugin::open) once per `init_rpc` when the plugin's
/// kind is among the transports it may offer; a plugin for a kind this crate implements
/// itself (`tcp`, `shm`) is refused.
pub trait TransportPlugin: Send + Sync {
    /// Which transport the plugin provides.
    fn kind(&self) -> TransportKind;

    /// The transport for a worker listening on `host`.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`], with the plugin's own error as its source, when
    /// the transport is not viable in this process (the agent logs it and leaves the
    /// transport out).
    fn open(&self, host: IpAddr) -> Result<Box<dyn Transport + Send>, TransportError>;
}

/// A listening endpoint.
pub trait Listener {
    /// The address peers connect to, e.g. `tcp://10.0.0.1:40123`.
    fn address(&self) -> &str;

    /// The next incoming connection.
    fn accept(&self) -> LocalBoxFuture<'_, Result<Box<dyn Connection>, TransportError>>;
}

/// An open connection that moves whole frames.
pub trait Connection {
    /// The peer's address, for messages.
    fn peer(&self) -> &str;

    /// Splits into independent halves.
    fn split(self: Box<Self>) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>);
}

/// The halves of a connection taken off the executor, for a pipe served by threads
/// (the agent's "lanes"): any thread may send under the pipe's lock, one thread receives,
/// and [`stop`](BlockingHalves::stop) wakes that thread from any other.
pub struct BlockingHalves {
    /// Sends whole frames, blocking.
    pub sender: Box<dyn BlockingSender>,
    /// Receives whole frames, blocking.
    pub receiver: Box<dyn BlockingReceiver>,
    /// Ends the connection both ways from any thread.
    pub stop: Arc<dyn StopConnection>,
    /// For a receiver that can be polled: how its reader thread sleeps.
    pub wake: Option<Arc<dyn Wake>>,
}

/// Sends whole frames from whichever thread holds it.
pub trait BlockingSender: Send {
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

/// Receives whole frames on the pipe's reader thread.
///
/// A receiver whose halves come with a [`Wake`] can also be polled without system
/// calls ([`try_recv`](Self::try_recv)), so that a caller waiting for its reply can read
/// it itself while the reader thread sleeps on the [`Wake`].
pub trait BlockingReceiver: Send {
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
    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        let _ = limits;
        Ok(TryRecv::Empty)
    }

    /// Announces that the reader is about to sleep on the [`Wake`]: `true` when armed
    /// (nothing is there; the peer signals the next frame), `false` when a frame or the
    /// end is already there (not armed).
    ///
    /// # Errors
    /// When the connection failed.
    fn arm(&mut self) -> Result<bool, TransportError> {
        Ok(false)
    }

    /// Withdraws [`arm`](Self::arm) after waking.
    fn disarm(&mut self) {}

    /// Withdraws [`arm`](Self::arm) without consuming the wake-up signal, for a reader
    /// that polls with [`try_recv`](Self::try_recv) meanwhile.
    fn withdraw(&mut self) {}
}

/// What [`BlockingReceiver::try_recv`] found.
#[derive(Debug)]
pub enum TryRecv {
    /// A whole frame.
    Frame(IncomingFrame),
    /// Nothing yet.
    Empty,
    /// The peer closed the connection between frames, or it was stopped.
    Closed,
}

/// Waits up to `timeout` until `first` or `second` is readable (or hung up); the events
/// of each. An interrupted or failed wait returns no events: callers look again.
pub(crate) fn poll_two(
    first: std::os::fd::BorrowedFd<'_>,
    second: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
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

/// Waits for a polled receiver's next frame without holding the receiver, and wakes
/// such a waiter.
pub trait Wake: Send + Sync {
    /// Blocks until the peer signalled (after [`BlockingReceiver::arm`]), [`kick`](
    /// Self::kick) was called, the peer is gone, or `timeout` passed; `true` when the
    /// peer's process is gone (what it sent before may still be there to receive).
    fn wait(&self, timeout: std::time::Duration) -> bool;

    /// Wakes the waiter.
    fn kick(&self);
}

/// Ends a blocking connection from any thread: the receiver returns, later sends fail,
/// and the peer sees the end of the stream.
pub trait StopConnection: Send + Sync {
    /// Stops the connection (idempotent).
    fn stop(&self);
}

/// The sending half of a connection.
pub trait FrameSender {
    /// Sends one frame; resolves to the bytes put on the wire once the transport no longer
    /// needs the frame's buffers.
    fn send(&mut self, frame: OwnedFrame) -> LocalBoxFuture<'_, Result<u64, TransportError>>;

    /// Closes the sending direction (the peer's receiver sees the end of the stream).
    fn close(&mut self) -> LocalBoxFuture<'_, ()>;

    /// Takes this half and `receiver` (the other half of the same connection) off the
    /// executor, to be served from threads; a transport that cannot gives both back
    /// ([`NotBlocking::Unsupported`]), and the agent then refuses the pipe: every pipe
    /// is served by threads after its handshake. Bytes or frames the receiver already
    /// buffered are kept.
    fn into_blocking(
        self: Box<Self>,
        receiver: Box<dyn FrameReceiver>,
    ) -> LocalBoxFuture<'static, IntoBlocking>;
}

/// What [`FrameSender::into_blocking`] gives.
pub type IntoBlocking = Result<BlockingHalves, NotBlocking>;

/// Why a connection stays on the executor.
pub enum NotBlocking {
    /// The transport serves its connections only on the executor: here are its halves.
    Unsupported(Box<dyn FrameSender>, Box<dyn FrameReceiver>),
    /// Taking the halves off failed; the connection is gone.
    Failed(TransportError),
}

/// The receiving half of a connection.
pub trait FrameReceiver {
    /// The next frame, checked against `limits` before its buffers are allocated;
    /// `Ok(None)` when the peer closed the connection between frames.
    fn recv(
        &mut self,
        limits: FrameLimits,
    ) -> LocalBoxFuture<'_, Result<Option<IncomingFrame>, TransportError>>;

    /// This half as [`Any`](std::any::Any), so that its own transport's
    /// [`FrameSender::into_blocking`] can take it back.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any>;
}

/// A frame to send, owning its parts so a transport can keep them until its write
/// completes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedFrame {
    /// The kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name (requests).
    pub handler: String,
    /// The metadata.
    pub metadata: Vec<u8>,
    /// The payload (the error text for errors, the postcard handshake for handshakes).
    pub payload: Vec<u8>,
    /// One descriptor per tensor.
    pub tensors: Vec<TensorDescriptor>,
    /// One entry per tensor, in order: the data of a `basic` tensor (a `cuda_basic`
    /// tensor's where its runtime staged it: [`HostBytes`]), the channel descriptor of
    /// any other (the core frame's data section).
    pub tensor_data: Vec<HostBytes>,
}

impl OwnedFrame {
    /// A frame of `kind` with every part empty.
    pub fn empty(kind: FrameKind, message_id: u64) -> OwnedFrame {
        OwnedFrame {
            kind,
            message_id,
            handler: String::new(),
            metadata: Vec::new(),
            payload: Vec::new(),
            tensors: Vec::new(),
            tensor_data: Vec::new(),
        }
    }

    /// Runs `f` with the core's borrowed view of this frame.
    pub fn with_outgoing<R>(&self, f: impl FnOnce(&OutgoingFrame<'_>) -> R) -> R {
        let data: Vec<&[u8]> = self.tensor_data.iter().map(HostBytes::as_slice).collect();
        let frame = OutgoingFrame {
            kind: self.kind,
            message_id: self.message_id,
            handler: &self.handler,
            metadata: &self.metadata,
            payload: &self.payload,
            tensors: &self.tensors,
            tensor_data: &data,
        };
        f(&frame)
    }

    /// The whole frame's size on the wire.
    pub fn encoded_len(&self) -> usize {
        self.with_outgoing(|frame| frame.encoded_len())
    }

    /// Checks the frame and writes its header and descriptors (the rest follows as the
    /// frame's own buffers).
    ///
    /// # Errors
    /// [`EncodeError`] if the core would not decode the frame.
    pub fn encode_head(&self) -> Result<Vec<u8>, EncodeError> {
        self.with_outgoing(|frame| {
            let mut head = vec![0; frame.head_len()];
            frame.encode_head(&mut head).map(|n| {
                head.truncate(n);
                head
            })
        })
    }

    /// The buffers that follow the head, in wire order.
    pub fn body(&self) -> impl Iterator<Item = &[u8]> + '_ {
        [
            self.handler.as_bytes(),
            self.metadata.as_slice(),
            self.payload.as_slice(),
        ]
        .into_iter()
        .chain(self.tensor_data.iter().map(HostBytes::as_slice))
    }
}

/// A received frame, owning its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingFrame {
    /// The kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name.
    pub handler: String,
    /// The metadata.
    pub metadata: Vec<u8>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Each tensor's descriptor and data-section entry: its bytes for a `basic` tensor,
    /// its channel descriptor for any other (the agent fetches the bytes over the
    /// channel).
    pub tensors: Vec<(TensorDescriptor, Vec<u8>)>,
    /// The frame's size on the wire, plus the stripes of its mpt tensors once a lane
    /// has read them.
    pub wire_len: u64,
}

impl IncomingFrame {
    /// Copies a decoded frame out of the receive buffer.
    pub fn from_frame(frame: &Frame<'_>) -> IncomingFrame {
        IncomingFrame {
            kind: frame.kind(),
            message_id: frame.message_id(),
            handler: frame.handler().to_string(),
            metadata: frame.metadata().to_vec(),
            payload: frame.payload().to_vec(),
            tensors: frame
                .tensors_with_data()
                .map(|(descriptor, data)| (descriptor, data.bytes().to_vec()))
                .collect(),
            wire_len: frame.as_bytes().len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdzv_core::device::Device;
    use rdzv_core::negotiate::ChannelKind;
    use rdzv_core::rpc::frame::{decode_frame, Decoded};

    #[test]
    fn owned_frame_round_trips_through_the_core_decoder() {
        let frame = OwnedFrame {
            handler: "echo".into(),
            metadata: vec![1],
            payload: b"hello".to_vec(),
            tensors: vec![
                TensorDescriptor::inline(Device::cpu(), Device::cpu(), 3),
                TensorDescriptor {
                    channel: ChannelKind::Cma,
                    channel_descriptor_len: 2,
                    ..TensorDescriptor::inline(Device::cpu(), Device::cpu(), 1 << 20)
                },
            ],
            tensor_data: vec![vec![9, 8, 7].into(), vec![1, 2].into()],
            ..OwnedFrame::empty(FrameKind::Request, 42)
        };
        let mut wire = frame
            .encode_head()
            .map_err(|e| e.to_string())
            .unwrap_or_default();
        for part in frame.body() {
            wire.extend_from_slice(part);
        }
        assert_eq!(wire.len(), frame.encoded_len());
        let decoded = match decode_frame(&wire, &FrameLimits::DEFAULT) {
            Ok(Decoded::Complete(f, n)) => {
                assert_eq!(n, wire.len());
                Ok::<_, String>(IncomingFrame::from_frame(&f))
            }
            other => Err(format!("{other:?}")),
        };
        let decoded = decoded.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decoded.kind, FrameKind::Request);
        assert_eq!(decoded.message_id, 42);
        assert_eq!(decoded.handler, "echo");
        assert_eq!(decoded.metadata, vec![1]);
        assert_eq!(decoded.payload, b"hello".to_vec());
        assert_eq!(decoded.tensors.len(), 2);
        assert_eq!(
            decoded.tensors.first().map(|t| t.1.clone()),
            Some(vec![9, 8, 7])
        );
        // A channel tensor's entry is its channel descriptor.
        assert_eq!(
            decoded.tensors.get(1).map(|t| (t.0.channel, t.1.clone())),
            Some((ChannelKind::Cma, vec![1, 2]))
        );
        assert_eq!(decoded.wire_len, wire.len() as u64);
    }

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

    #[test]
    fn inline_data_must_match_descriptors() {
        let frame = OwnedFrame {
            tensors: vec![TensorDescriptor::inline(Device::cpu(), Device::cpu(), 4)],
            tensor_data: vec![vec![1].into()],
            ..OwnedFrame::empty(FrameKind::Request, 1)
        };
        assert!(frame.encode_head().is_err());
    }
}
