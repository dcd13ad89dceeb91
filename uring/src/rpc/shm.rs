//! The `shm` transport behind the seam: [`crate::transport::shm`]'s blocking
//! connections, each half driven by a thread of its own that hands frames to and from
//! the agent's executor through a queue (glommio accepts wake-ups from other threads).
//!
//! - A listener runs one accept thread (the shm bootstrap, memfds over `SCM_RIGHTS`,
//!   happens there) and queues the connections for [`Listener::accept`].
//! - A connection's sending half is a thread that encodes each [`OwnedFrame`] into one
//!   shm message and sends it; [`FrameSender::send`] resolves as soon as the thread owns
//!   the frame (the frame is moved, so the caller's buffers are free), and a failure of
//!   the thread is reported by the next send.
//! - Its receiving half is a thread that receives whole messages into a bounded queue;
//!   [`FrameReceiver::recv`] decodes each with the core's decoder and the caller's
//!   [`FrameLimits`]. A message must be exactly one frame.
//!
//! Once the pipe's handshake is done, [`FrameSender::into_blocking`] takes both halves
//! back from their threads (with what the receiving thread had queued) and the agent
//! serves the pipe as a lane: blocking sends, [`TryRecv`]-style polling of the ring by a
//! waiting caller, and a [`Wake`] on the data eventfd and the control socket (whose end
//! means the peer process is gone) for the lane's reader thread. The threads above then
//! serve only the handshake.
//!
//! Addresses are `shm://@<abstract name>` (or `shm://<socket path>`). The domain
//! descriptor is [`viability`]'s `shm:<boot_id>_<netns>`: two workers negotiate shm only
//! on one host and in one network namespace.
//!
//! This module does not negotiate or decide anything about frames' meaning; large
//! tensors go through the ring like everything else (the `cma` and `xth` channels move
//! large tensors beside it; their descriptors travel in the frame).

use std::collections::VecDeque;
use std::os::fd::AsFd;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::time::Duration;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::{decode_frame, Decoded, Frame, FrameLimits, TensorDescriptor};

use super::error::TransportError;
use super::recycle;
use super::transport::poll_two;
use super::transport::{
    BlockingHalves, BlockingReceiver, BlockingSender, Connection, FrameReceiver, FrameSender,
    IncomingFrame, IntoBlocking, Listener, LocalBoxFuture, NotBlocking, OwnedFrame, StopConnection,
    Transport, TryRecv, Wake,
};
use crate::queue::{on_thread, Queue};
use crate::transport::shm::{
    viability, NotViable, ShmAddr, ShmConnection, ShmError, ShmListener, ShmOptions, ShmReceiver,
    ShmSender,
};

/// The scheme of shm addresses.
pub const SCHEME: &str = "shm://";
/// How many received messages wait for the agent before the receiving thread stops
/// reading (the peer then waits for room in its ring).
const RECEIVE_QUEUE: usize = 64;
/// How often a blocked receiving thread checks whether its half was dropped, handed back
/// or stopped.
const RECEIVE_POLL: Duration = Duration::from_millis(10);

/// Shared memory between processes on one host.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    descriptor: String,
    options: ShmOptions,
}

impl ShmTransport {
    /// The transport if shared memory works in this process ([`viability`]), with the
    /// default [`ShmOptions`].
    ///
    /// # Errors
    /// [`NotViable`] with the reason.
    pub fn new() -> Result<ShmTransport, NotViable> {
        Self::with_options(ShmOptions::default())
    }

    /// Like [`ShmTransport::new`] with chosen options.
    ///
    /// # Errors
    /// [`NotViable`] with the reason.
    pub fn with_options(options: ShmOptions) -> Result<ShmTransport, NotViable> {
        let descriptor = viability()?.as_str().to_string();
        Ok(ShmTransport {
            descriptor,
            options,
        })
    }
}

/// `shm://@name` (or `shm://path`) for a listener address.
pub fn format_address(addr: &ShmAddr) -> String {
    format!("{SCHEME}{addr}")
}

/// The listener address in `shm://@name` or `shm://path`.
///
/// # Errors
/// [`TransportError::BadAddress`] if it does not start with `shm://` or names nothing.
pub fn parse_address(address: &str) -> Result<ShmAddr, TransportError> {
    let bad = |reason| TransportError::BadAddress {
        transport: "shm",
        address: address.to_string(),
        reason,
    };
    let rest = address
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("it does not start with shm://"))?;
    if rest.is_empty() || rest == "@" {
        return Err(bad("expected shm://@<name> or shm://<path>"));
    }
    Ok(ShmAddr::parse(rest))
}

fn shm_io(error: ShmError) -> std::io::Error {
    std::io::Error::other(error)
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn domain_descriptor(&self) -> &str {
        &self.descriptor
    }

    fn listen(&self) -> Result<Box<dyn Listener>, TransportError> {
        let listener = ShmListener::bind_unnamed(self.options.clone()).map_err(|e| {
            TransportError::Listen {
                address: "an unnamed shm socket".into(),
                source: shm_io(e),
            }
        })?;
        let address = format_address(listener.local_addr());
        let listener = Arc::new(listener);
        let queue = Arc::new(Queue::new(usize::MAX));
        let thread_listener = Arc::clone(&listener);
        let thread_queue = Arc::clone(&queue);
        let shown = address.clone();
        std::thread::Builder::new()
            .name("rdzv-shm-accept".into())
            .spawn(move || accept_thread(&thread_listener, &thread_queue, &shown))
            .map_err(|source| TransportError::Listen {
                address: address.clone(),
                source,
            })?;
        Ok(Box::new(ShmTransportListener {
            listener,
            queue,
            address,
        }))
    }

    fn connect<'a>(
        &'a self,
        address: &'a str,
    ) -> LocalBoxFuture<'a, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let addr = parse_address(address)?;
            let options = self.options.clone();
            let connect_error = |source| TransportError::Connect {
                address: address.to_string(),
                source,
            };
            let connected = on_thread("rdzv-shm-connect", move || {
                ShmConnection::connect(&addr, options)
            })
            .await
            .map_err(connect_error)?;
            match connected {
                Ok(connection) => Ok(ShmPipe::boxed(connection, address.to_string())),
                Err(e) => Err(connect_error(shm_io(e))),
            }
        })
    }
}

/// Accepts until the listener is shut down, queueing connections (or errors).
fn accept_thread(
    listener: &ShmListener,
    queue: &Queue<Result<ShmConnection, ShmError>>,
    address: &str,
) {
    loop {
        let accepted = listener.accept();
        if queue.is_closed() {
            return;
        }
        if let Err(e) = &accepted {
            // Handshake failures concern one peer; anything else repeats: slow down.
            if !matches!(
                e,
                ShmError::Handshake { .. }
                    | ShmError::Rejected { .. }
                    | ShmError::NotSameHost { .. }
            ) {
                tracing::debug!(%address, error = %e, "shm accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if queue.push(accepted).is_err() {
            return;
        }
    }
}

struct ShmTransportListener {
    listener: Arc<ShmListener>,
    queue: Arc<Queue<Result<ShmConnection, ShmError>>>,
    address: String,
}

impl Listener for ShmTransportListener {
    fn address(&self) -> &str {
        &self.address
    }

    fn accept(&self) -> LocalBoxFuture<'_, Result<Box<dyn Connection>, TransportError>> {
        Box::pin(async move {
            let accept_error = |source| TransportError::Accept {
                address: self.address.clone(),
                source,
            };
            match self.queue.pop().await {
                Some(Ok(connection)) => {
                    let peer = connection
                        .peer_pid()
                        .map_or_else(|| "an shm peer".to_string(), |pid| format!("shm pid {pid}"));
                    Ok(ShmPipe::boxed(connection, peer))
                }
                Some(Err(e)) => Err(accept_error(shm_io(e))),
                None => Err(accept_error(std::io::Error::other(
                    "the listener is closed",
                ))),
            }
        })
    }
}

impl Drop for ShmTransportListener {
    fn drop(&mut self) {
        self.queue.close();
        // Wakes the accept thread: accept on a shut-down socket fails at once.
        if let Err(e) = rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both) {
            tracing::debug!(address = %self.address, error = %e, "shutting an shm listener down failed");
        }
    }
}

struct ShmPipe {
    connection: ShmConnection,
    peer: String,
}

impl ShmPipe {
    fn boxed(connection: ShmConnection, peer: String) -> Box<dyn Connection> {
        Box::new(ShmPipe { connection, peer })
    }
}

impl Connection for ShmPipe {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn split(self: Box<Self>) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>) {
        let ShmPipe { connection, peer } = *self;
        let (sender, receiver) = connection.split();
        let peer: Arc<str> = Arc::from(peer.as_str());
        (
            Box::new(ShmFrameSender::start(sender, Arc::clone(&peer))),
            Box::new(ShmFrameReceiver::start(receiver, peer)),
        )
    }
}

/// What the sending thread reports when it stops: its half, or why it failed.
type SendOutcome = Result<ShmSender, ShmError>;

struct ShmFrameSender {
    frames: Arc<Queue<OwnedFrame>>,
    /// Holds the thread's error (or its clean end) once it stopped.
    outcome: Arc<Queue<SendOutcome>>,
    peer: Arc<str>,
}

impl ShmFrameSender {
    fn start(sender: ShmSender, peer: Arc<str>) -> ShmFrameSender {
        let frames = Arc::new(Queue::new(usize::MAX));
        let outcome = Arc::new(Queue::new(1));
        let (thread_frames, thread_outcome) = (Arc::clone(&frames), Arc::clone(&outcome));
        let spawned = std::thread::Builder::new()
            .name("rdzv-shm-send".into())
            .spawn(move || {
                let result = send_thread(sender, &thread_frames);
                thread_frames.close();
                let _ = thread_outcome.push(result);
                thread_outcome.close();
            });
        if let Err(e) = spawned {
            frames.close();
            let _ = outcome.push(Err(ShmError::Syscall {
                op: "spawn an shm sending thread",
                source: e,
            }));
            outcome.close();
        }
        ShmFrameSender {
            frames,
            outcome,
            peer,
        }
    }

    fn stopped(&self) -> TransportError {
        let reason = match self.outcome.try_pop() {
            Some(Err(e)) => e.to_string(),
            _ => "the pipe is closed".to_string(),
        };
        TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::BrokenPipe, reason),
        }
    }
}

fn send_thread(mut sender: ShmSender, frames: &Queue<OwnedFrame>) -> SendOutcome {
    let mut buf = Vec::new();
    while let Some(frame) = frames.pop_blocking() {
        send_frame(&mut sender, &frame, &mut buf)?;
        recycle::give_all(frame.tensor_data);
    }
    Ok(sender)
}

/// Encodes `frame` into `buf` and sends it as one shm message.
fn send_frame(
    sender: &mut ShmSender,
    frame: &OwnedFrame,
    buf: &mut Vec<u8>,
) -> Result<(), ShmError> {
    let head = frame.encode_head().map_err(|e| ShmError::Handshake {
        detail: format!("cannot encode a frame: {e}"),
    })?;
    buf.clear();
    buf.reserve(frame.encoded_len());
    buf.extend_from_slice(&head);
    for part in frame.body() {
        buf.extend_from_slice(part);
    }
    sender.send(buf)?;
    if buf.capacity() > (1 << 20) {
        *buf = Vec::new();
    }
    Ok(())
}

impl FrameSender for ShmFrameSender {
    fn send(&mut self, frame: OwnedFrame) -> LocalBoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            // Refuse a frame the core would not decode here, with the frame's error.
            if let Err(source) = frame.encode_head() {
                return Err(TransportError::Encode {
                    peer: self.peer.to_string(),
                    source,
                });
            }
            let len = frame.encoded_len() as u64;
            match self.frames.push(frame) {
                Ok(()) => Ok(len),
                Err(_) => Err(self.stopped()),
            }
        })
    }

    fn close(&mut self) -> LocalBoxFuture<'_, ()> {
        Box::pin(async move {
            self.frames.close();
            // Wait until the queued frames are in the peer's ring.
            if let Some(Err(e)) = self.outcome.pop().await {
                tracing::debug!(peer = %self.peer, error = %e, "an shm pipe's sender failed");
            }
        })
    }

    fn into_blocking(
        self: Box<Self>,
        receiver: Box<dyn FrameReceiver>,
    ) -> LocalBoxFuture<'static, IntoBlocking> {
        Box::pin(async move {
            let peer = Arc::clone(&self.peer);
            let failed = |reason: String| {
                NotBlocking::Failed(TransportError::Io {
                    op: "take off the executor the shm pipe to",
                    peer: peer.to_string(),
                    source: std::io::Error::other(reason),
                })
            };
            let receiver = receiver
                .into_any()
                .downcast::<ShmFrameReceiver>()
                .map_err(|_| failed("the halves belong to different transports".into()))?;
            // Both threads hand their halves back: the sender once its queue is sent.
            self.frames.close();
            let sender = match self.outcome.pop().await {
                Some(Ok(sender)) => sender,
                Some(Err(e)) => return Err(failed(e.to_string())),
                None => return Err(failed("the sending thread stopped".into())),
            };
            let (shm_receiver, leftover) = receiver.hand_back().await.map_err(failed)?;
            let control = sender
                .control_fd()
                .try_clone_to_owned()
                .map_err(|e| failed(format!("duplicating the control socket: {e}")))?;
            let stopped = Arc::new(AtomicBool::new(false));
            let wake = ShmWake {
                data: shm_receiver
                    .data_event_fd()
                    .try_clone_to_owned()
                    .map_err(|e| failed(format!("duplicating the data eventfd: {e}")))?,
                control: shm_receiver
                    .control_fd()
                    .try_clone_to_owned()
                    .map_err(|e| failed(format!("duplicating the control socket: {e}")))?,
            };
            Ok(BlockingHalves {
                sender: Box::new(ShmThreadSender {
                    sender,
                    buf: Vec::new(),
                    peer: Arc::clone(&peer),
                }),
                receiver: Box::new(ShmThreadReceiver {
                    receiver: shm_receiver,
                    leftover,
                    peer,
                    stopped: Arc::clone(&stopped),
                    ended: false,
                }),
                stop: Arc::new(ShmStop { control, stopped }),
                wake: Some(Arc::new(wake)),
            })
        })
    }
}

/// The sending half of a thread-served shm pipe.
struct ShmThreadSender {
    sender: ShmSender,
    buf: Vec<u8>,
    peer: Arc<str>,
}

impl BlockingSender for ShmThreadSender {
    fn send(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        send_frame(&mut self.sender, frame, &mut self.buf).map_err(|e| TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source: shm_io(e),
        })?;
        Ok(frame.encoded_len() as u64)
    }
}

/// The receiving half of a thread-served shm pipe: first what the adapter thread had
/// received, then the ring.
struct ShmThreadReceiver {
    receiver: ShmReceiver,
    leftover: VecDeque<Received>,
    peer: Arc<str>,
    stopped: Arc<AtomicBool>,
    ended: bool,
}

impl BlockingReceiver for ShmThreadReceiver {
    fn try_recv(&mut self, limits: FrameLimits) -> Result<TryRecv, TransportError> {
        if self.ended {
            return Ok(TryRecv::Closed);
        }
        let received = match self.leftover.pop_front() {
            Some(received) => received,
            None => match self.receiver.try_recv() {
                Ok(Some(message)) => Ok(message),
                Ok(None) if self.stopped.load(Ordering::Acquire) => {
                    self.ended = true;
                    return Ok(TryRecv::Closed);
                }
                Ok(None) => return Ok(TryRecv::Empty),
                Err(e) => Err(e),
            },
        };
        match decode_message(received, limits, &self.peer) {
            Ok(Some(frame)) => Ok(TryRecv::Frame(frame)),
            Ok(None) => {
                self.ended = true;
                Ok(TryRecv::Closed)
            }
            Err(e) => {
                self.ended = true;
                Err(e)
            }
        }
    }

    fn arm(&mut self) -> Result<bool, TransportError> {
        if self.ended || !self.leftover.is_empty() || self.stopped.load(Ordering::Acquire) {
            return Ok(false);
        }
        self.receiver
            .arm_wakeup()
            .map_err(|e| self.message_error(e))
    }

    fn disarm(&mut self) {
        // Draining fails only on a broken eventfd; the next receive reports the pipe.
        let _ = self.receiver.disarm_wakeup();
    }

    fn withdraw(&mut self) {
        self.receiver.withdraw_wakeup();
    }

    fn recv(&mut self, limits: FrameLimits) -> Result<Option<IncomingFrame>, TransportError> {
        if self.ended {
            return Ok(None);
        }
        let received = match self.leftover.pop_front() {
            Some(received) => received,
            None => loop {
                if self.stopped.load(Ordering::Acquire) {
                    self.ended = true;
                    return Ok(None);
                }
                match self.receiver.recv_timeout(RECEIVE_POLL) {
                    Err(ShmError::Timeout { .. }) => continue,
                    other => break other,
                }
            },
        };
        let decoded = decode_message(received, limits, &self.peer);
        if !matches!(decoded, Ok(Some(_))) {
            self.ended = true;
        }
        decoded
    }
}

impl ShmThreadReceiver {
    fn message_error(&self, error: ShmError) -> TransportError {
        TransportError::Io {
            op: "receive from",
            peer: self.peer.to_string(),
            source: shm_io(error),
        }
    }
}

/// Sleeps on a thread-served shm pipe's data eventfd and control socket.
struct ShmWake {
    data: std::os::fd::OwnedFd,
    control: std::os::fd::OwnedFd,
}

impl Wake for ShmWake {
    fn wait(&self, timeout: Duration) -> bool {
        use std::os::fd::AsFd;
        let [_, control] = poll_two(self.data.as_fd(), self.control.as_fd(), timeout);
        // Nothing is ever sent on the control socket: readable means its end.
        control.intersects(
            rustix::event::PollFlags::IN
                | rustix::event::PollFlags::HUP
                | rustix::event::PollFlags::ERR,
        )
    }

    fn kick(&self) {
        // Fails only when the counter would overflow: it is signalled then anyway.
        let _ = rustix::io::write(&self.data, &1u64.to_ne_bytes());
    }
}

/// Stops a thread-served shm pipe: the control socket is shut down (the peer sees the
/// close) and the receiver sees the flag within [`RECEIVE_POLL`].
struct ShmStop {
    control: std::os::fd::OwnedFd,
    stopped: Arc<AtomicBool>,
}

impl StopConnection for ShmStop {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Fails only on a socket already shut down.
        let _ = rustix::net::shutdown(&self.control, rustix::net::Shutdown::Both);
    }
}

impl Drop for ShmFrameSender {
    fn drop(&mut self) {
        // The thread sends what is queued, then drops its half (the peer sees the close).
        self.frames.close();
    }
}

/// What the receiving thread hands over: a whole message, or why it stopped.
type Received = Result<Vec<u8>, ShmError>;

struct ShmFrameReceiver {
    messages: Arc<Queue<Received>>,
    /// Where the thread puts its half back when asked to (by closing `messages` with
    /// `hand_back` set).
    handed_back: Arc<Queue<ShmReceiver>>,
    hand_back: Arc<AtomicBool>,
    peer: Arc<str>,
    ended: bool,
}

impl ShmFrameReceiver {
    fn start(receiver: ShmReceiver, peer: Arc<str>) -> ShmFrameReceiver {
        let messages = Arc::new(Queue::new(RECEIVE_QUEUE));
        let handed_back = Arc::new(Queue::new(1));
        let hand_back = Arc::new(AtomicBool::new(false));
        let thread_messages = Arc::clone(&messages);
        let thread_handed_back = Arc::clone(&handed_back);
        let thread_hand_back = Arc::clone(&hand_back);
        let spawned = std::thread::Builder::new()
            .name("rdzv-shm-recv".into())
            .spawn(move || {
                if let Some(receiver) =
                    receive_thread(receiver, &thread_messages, &thread_hand_back)
                {
                    let _ = thread_handed_back.push(receiver);
                }
                thread_handed_back.close();
            });
        if let Err(e) = spawned {
            let _ = messages.push(Err(ShmError::Syscall {
                op: "spawn an shm receiving thread",
                source: e,
            }));
            messages.close();
            handed_back.close();
        }
        ShmFrameReceiver {
            messages,
            handed_back,
            hand_back,
            peer,
            ended: false,
        }
    }

    /// Stops the thread and takes its half back, with the messages it had received.
    async fn hand_back(self: Box<Self>) -> Result<(ShmReceiver, VecDeque<Received>), String> {
        self.hand_back.store(true, Ordering::Release);
        let receiver = self.handed_back.pop().await;
        let mut leftover = VecDeque::new();
        while let Some(received) = self.messages.try_pop() {
            leftover.push_back(received);
        }
        receiver
            .map(|r| (r, leftover))
            .ok_or_else(|| "the receiving thread stopped".to_string())
    }
}

/// Receives into `messages` until it is closed (the half is dropped: `None`) or
/// `hand_back` is set (the half is returned), checking both every [`RECEIVE_POLL`].
fn receive_thread(
    mut receiver: ShmReceiver,
    messages: &Queue<Received>,
    hand_back: &AtomicBool,
) -> Option<ShmReceiver> {
    loop {
        if hand_back.load(Ordering::Acquire) {
            return Some(receiver);
        }
        let received = match receiver.recv_timeout(RECEIVE_POLL) {
            Err(ShmError::Timeout { .. }) => {
                if messages.is_closed() {
                    return None;
                }
                continue;
            }
            other => other,
        };
        let last = received.is_err();
        if messages.push_blocking(received).is_err() || last {
            messages.close();
            return None;
        }
    }
}

impl FrameReceiver for ShmFrameReceiver {
    fn recv(
        &mut self,
        limits: FrameLimits,
    ) -> LocalBoxFuture<'_, Result<Option<IncomingFrame>, TransportError>> {
        Box::pin(async move {
            if self.ended {
                return Ok(None);
            }
            let received = match self.messages.pop().await {
                Some(received) => received,
                None => {
                    self.ended = true;
                    return Ok(None);
                }
            };
            let decoded = decode_message(received, limits, &self.peer);
            if !matches!(decoded, Ok(Some(_))) {
                self.ended = true;
            }
            decoded
        })
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// One received shm message (or the receiving error) as a frame: `Ok(None)` when the peer
/// closed. A message must hold exactly one frame.
fn decode_message(
    received: Received,
    limits: FrameLimits,
    peer: &str,
) -> Result<Option<IncomingFrame>, TransportError> {
    let io_error = |source| TransportError::Io {
        op: "receive from",
        peer: peer.to_string(),
        source,
    };
    let message = match received {
        Ok(message) => message,
        Err(ShmError::PeerClosed) => return Ok(None),
        Err(e) => return Err(io_error(shm_io(e))),
    };
    match decode_frame(&message, &limits) {
        Ok(Decoded::Complete(frame, used)) if used == message.len() => {
            let Some(plan) = in_place_plan(&frame, &message) else {
                return Ok(Some(IncomingFrame::from_frame(&frame)));
            };
            Ok(Some(plan.finish(message)))
        }
        Ok(Decoded::Complete(_, used)) => Err(io_error(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "an shm message of {} bytes holds a frame of {used} and more",
                message.len()
            ),
        ))),
        Ok(Decoded::Partial(_)) => Err(TransportError::Truncated {
            peer: peer.to_string(),
            have: message.len(),
        }),
        Err(source) => Err(TransportError::Frame {
            peer: peer.to_string(),
            source,
        }),
    }
}

/// Tensors at least this large are moved to the front of the received message, which
/// becomes their buffer, instead of being copied into a new one (no fresh pages).
const IN_PLACE_MIN: usize = 256 * 1024;

/// A received frame whose largest tensor keeps the message's buffer: every other part
/// is copied out first.
struct InPlacePlan {
    head: IncomingFrame,
    /// Where the largest tensor goes among `head.tensors`, its descriptor, and where its
    /// bytes are in the message.
    index: usize,
    descriptor: TensorDescriptor,
    range: std::ops::Range<usize>,
}

/// An [`InPlacePlan`] when the frame carries an inline tensor of at least
/// [`IN_PLACE_MIN`] bytes (the largest inline one keeps the buffer; channel descriptors
/// are copied like the other parts).
fn in_place_plan(frame: &Frame<'_>, message: &[u8]) -> Option<InPlacePlan> {
    let base = message.as_ptr() as usize;
    let parts: Vec<(TensorDescriptor, &[u8])> = frame
        .tensors_with_data()
        .map(|(descriptor, data)| (descriptor, data.bytes()))
        .collect();
    let (index, &(descriptor, data)) = parts
        .iter()
        .enumerate()
        .filter(|(_, (descriptor, _))| descriptor.is_inline())
        .max_by_key(|(_, (_, data))| data.len())?;
    if data.len() < IN_PLACE_MIN {
        return None;
    }
    let start = (data.as_ptr() as usize).checked_sub(base)?;
    let range = start..start.checked_add(data.len())?;
    // The slice must be the message's own bytes.
    if message.get(range.clone())?.as_ptr() != data.as_ptr() {
        return None;
    }
    let tensors = parts
        .iter()
        .enumerate()
        .map(|(i, &(d, bytes))| {
            (
                d,
                if i == index {
                    Vec::new()
                } else {
                    bytes.to_vec()
                },
            )
        })
        .collect();
    Some(InPlacePlan {
        head: IncomingFrame {
            kind: frame.kind(),
            message_id: frame.message_id(),
            handler: frame.handler().to_string(),
            metadata: frame.metadata().to_vec(),
            payload: frame.payload().to_vec(),
            tensors,
            wire_len: message.len() as u64,
        },
        index,
        descriptor,
        range,
    })
}

impl InPlacePlan {
    fn finish(self, mut message: Vec<u8>) -> IncomingFrame {
        let InPlacePlan {
            mut head,
            index,
            descriptor,
            range,
        } = self;
        let len = range.len();
        message.copy_within(range, 0);
        message.truncate(len);
        if let Some(slot) = head.tensors.get_mut(index) {
            *slot = (descriptor, message);
        }
        head
    }
}

impl Drop for ShmFrameReceiver {
    fn drop(&mut self) {
        // The thread sees it within `RECEIVE_POLL` and drops its half.
        self.messages.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdzv_core::device::Device;
    use rdzv_core::rpc::frame::FrameKind;

    #[test]
    fn addresses_round_trip() {
        let addr = ShmAddr::Abstract(b"rdzv-1f2e3".to_vec());
        let text = format_address(&addr);
        assert_eq!(text, "shm://@rdzv-1f2e3");
        assert_eq!(parse_address(&text).ok(), Some(addr));
        assert_eq!(
            parse_address("shm:///tmp/x.sock").ok(),
            Some(ShmAddr::Path("/tmp/x.sock".into()))
        );
        assert!(parse_address("tcp://127.0.0.1:1").is_err());
        assert!(parse_address("shm://").is_err());
        assert!(parse_address("shm://@").is_err());
    }

    fn tensor_frame(id: u64, len: usize) -> OwnedFrame {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        OwnedFrame {
            handler: "echo".into(),
            metadata: vec![7],
            payload: b"payload".to_vec(),
            tensors: vec![TensorDescriptor::inline(
                Device::cpu(),
                Device::cpu(),
                len as u64,
            )],
            tensor_data: vec![data.into()],
            ..OwnedFrame::empty(FrameKind::Request, id)
        }
    }

    fn run<T: 'static>(f: impl std::future::Future<Output = T> + 'static) -> T {
        glommio::LocalExecutorBuilder::default()
            .io_memory(1 << 20)
            .make()
            .map(|executor| executor.run(f))
            .unwrap_or_else(|e| panic!("executor: {e}"))
    }

    #[test]
    fn frames_cross_the_seam_both_ways_and_the_end_is_seen() {
        let outcome = run(async {
            let transport = ShmTransport::new().map_err(|e| e.to_string())?;
            assert_eq!(transport.kind(), TransportKind::Shm);
            assert!(transport.domain_descriptor().starts_with("shm:"));
            let listener = transport.listen().map_err(|e| e.to_string())?;
            let address = listener.address().to_string();
            assert!(address.starts_with(SCHEME), "{address}");
            let (client, server) =
                futures_lite::future::zip(transport.connect(&address), listener.accept()).await;
            let (mut tx, mut client_rx) = client.map_err(|e| e.to_string())?.split();
            let (mut server_tx, mut rx) = server.map_err(|e| e.to_string())?.split();
            for (id, len) in [(1u64, 0usize), (2, 1), (3, 1 << 20), (4, 5 << 20)] {
                let frame = tensor_frame(id, len);
                let sent = tx.send(frame.clone()).await.map_err(|e| e.to_string())?;
                assert_eq!(sent, frame.encoded_len() as u64);
                let got = rx
                    .recv(FrameLimits::DEFAULT)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("early end")?;
                assert_eq!(got.message_id, id);
                assert_eq!(got.handler, "echo");
                assert_eq!(got.payload, b"payload".to_vec());
                assert_eq!(got.wire_len, sent);
                let data = got.tensors.first().map(|t| t.1.clone()).unwrap_or_default();
                let sent: Vec<u8> = frame.tensor_data.iter().flat_map(|d| d.to_vec()).collect();
                assert!(data == sent, "tensor {id} differs");
            }
            // Several tensors, the largest (moved in place) in the middle.
            let parts = [
                vec![1u8, 2, 3],
                vec![9u8; IN_PLACE_MIN + 5],
                Vec::new(),
                vec![4u8; 70_000],
            ];
            let mut many = OwnedFrame::empty(FrameKind::Request, 6);
            for part in &parts {
                many.tensors.push(TensorDescriptor::inline(
                    Device::cpu(),
                    Device::cpu(),
                    part.len() as u64,
                ));
                many.tensor_data.push(part.clone().into());
            }
            tx.send(many).await.map_err(|e| e.to_string())?;
            let got = rx
                .recv(FrameLimits::DEFAULT)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("early end")?;
            let datas: Vec<Vec<u8>> = got.tensors.into_iter().map(|t| t.1).collect();
            assert!(datas == parts, "tensors differ");
            server_tx
                .send(OwnedFrame::empty(FrameKind::Goodbye, 0))
                .await
                .map_err(|e| e.to_string())?;
            let goodbye = client_rx.recv(FrameLimits::DEFAULT).await;
            assert!(matches!(goodbye, Ok(Some(f)) if f.kind == FrameKind::Goodbye));
            // Limits apply: a request is too big for the handshake limits.
            tx.send(tensor_frame(5, 16))
                .await
                .map_err(|e| e.to_string())?;
            assert!(rx.recv(FrameLimits::HANDSHAKE).await.is_err());
            tx.close().await;
            drop(tx);
            // The end of the stream, after which the receiver stays ended.
            assert!(matches!(rx.recv(FrameLimits::DEFAULT).await, Ok(None)));
            assert!(matches!(rx.recv(FrameLimits::DEFAULT).await, Ok(None)));
            Ok::<(), String>(())
        });
        assert_eq!(outcome, Ok(()));
    }

    #[test]
    fn connecting_to_nothing_fails() {
        let outcome = run(async {
            let transport = ShmTransport::new().map_err(|e| e.to_string())?;
            let result = transport
                .connect("shm://@rdzv-test-nobody-listens-here")
                .await;
            Ok::<bool, String>(matches!(result, Err(TransportError::Connect { .. })))
        });
        assert_eq!(outcome, Ok(true));
    }
}
