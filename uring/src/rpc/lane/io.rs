//! [`LaneIo`]: what both kinds of lane move bytes with, and nothing that depends on the
//! side a lane plays. It holds the pipe's connection (the sender under the send lock,
//! the receiver under the receive lock, the [`Control`] a sleeping reader waits on),
//! the pipe's mpt connections, where the peer's out-of-band tensors are read from, and the
//! worker's calls table and framer. It sends a frame with its mpt connections, receives the
//! next one (spinning, then sleeping without holding the receiver), and stops the
//! connection. It does not know the pipe's protocol: the lane types above it
//! ([`ClientLane`](super::client::ClientLane),
//! [`InboundLane`](super::inbound::InboundLane)) own their side's core machine and
//! decide what to send and what a frame means. Nor does it know the registry of lanes:
//! an ending lane leaves it through the [`LaneRegistry`] seam.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::frame::FrameLimits;
use rdzv_core::rpc::pipe::Transmit;

use crate::rpc::calls::Calls;
use crate::rpc::device::Devices;
use crate::rpc::error::{PipeFailure, TransportError};
use crate::rpc::mpt::{ConnectionsError, MptConnections};
use crate::rpc::outgoing::Framer;
use crate::rpc::recycle;
use crate::rpc::tensors::{cpu_channel, PipeReader, Streamed};
use crate::rpc::transport::{
    Connection, Control, FrameReceiver, FrameSender, IncomingFrame, OwnedFrame, TryRecv,
};

/// How long a polled lane's reader sleeps before it looks again; it wakes at once on
/// the peer's signal, a kick, the peer's end or a stop, so this only bounds the cost of
/// a missed signal.
const WAKE_POLL: Duration = Duration::from_millis(100);
/// How long a reader's spin for its next frame only spins; after that it yields the CPU
/// between polls, so that on a small host the threads its peer's reply (or this
/// process's other work) waits for can run: a Rust peer answers well within it.
const SPIN_THEN_YIELD: Duration = Duration::from_micros(5);

/// The registry of lanes, as an ending lane sees it: it leaves, if it is still there.
/// (The registry holds the lane types, so it lives above them.)
pub(crate) trait LaneRegistry: Send + Sync {
    /// Client lane `id` to `peer` leaves (a newer lane to `peer` stays).
    fn leave_client(&self, peer: &str, id: u64);
    /// Inbound lane `id` leaves.
    fn leave_inbound(&self, id: u64);
}

/// What every lane of a worker shares, handed to each at its start.
pub(crate) struct Shared<'a> {
    /// The calls in flight: those sent on a client lane wait there for their reply.
    pub calls: &'a Arc<Calls>,
    /// Builds the frames lanes send.
    pub framer: &'a Arc<Framer>,
    /// The worker's device runtimes.
    pub devices: &'a Devices,
    /// The registry of lanes, which a lane leaves when it ends.
    pub registry: Weak<dyn LaneRegistry>,
}

/// Why a lane could not send a frame.
pub(super) enum SendFailure {
    /// Fault injection failed this request alone; the lane is fine.
    Injected { handler: String },
    /// The lane is broken: why.
    Broken(PipeFailure),
}

impl std::fmt::Display for SendFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendFailure::Injected { handler } => {
                write!(f, "Send attempt failed intentionally for {handler}")
            }
            SendFailure::Broken(reason) => reason.fmt(f),
        }
    }
}

/// A thread-served pipe's I/O, shared by both lane types.
pub(crate) struct LaneIo {
    pub id: u64,
    pub peer: String,
    pub negotiated: Negotiated,
    sender: Mutex<Box<dyn FrameSender>>,
    /// The receiving half: held by the reader thread while it receives, and by a
    /// caller reading its own reply while the reader sleeps.
    receiver: Mutex<Box<dyn FrameReceiver>>,
    /// How the reader thread sleeps without holding `receiver`, is woken, and how the
    /// connection is stopped.
    control: Arc<dyn Control>,
    /// Where the peer's out-of-band tensors are read from.
    pub reader: Arc<PipeReader>,
    /// The worker's device runtimes (mpt reads device tensors' stripes into them).
    pub devices: Devices,
    /// Builds the frames this lane sends (requests and responses).
    pub framer: Arc<Framer>,
    /// The calls in flight.
    pub calls: Arc<Calls>,
    /// The registry of lanes, which this lane leaves when it ends.
    pub registry: Weak<dyn LaneRegistry>,
    /// The side this lane plays in its pipe's negotiation.
    role: Role,
    /// The pipe's mpt connections, when it negotiated mpt (set before the first frame is
    /// read or sent with mpt tensors).
    mpt: OnceLock<MptConnections>,
}

impl LaneIo {
    /// The I/O of pipe `id` to or from `peer`, which plays `role`, over `connection`.
    pub(super) fn new(
        (id, peer): (u64, String),
        negotiated: Negotiated,
        connection: Connection,
        role: Role,
        shared: Shared<'_>,
    ) -> LaneIo {
        let Connection {
            sender,
            receiver,
            control,
            ..
        } = connection;
        LaneIo {
            id,
            peer,
            negotiated,
            sender: Mutex::new(sender),
            receiver: Mutex::new(receiver),
            control,
            reader: Arc::new(PipeReader::default()),
            devices: shared.devices.clone(),
            framer: Arc::clone(shared.framer),
            calls: Arc::clone(shared.calls),
            registry: shared.registry,
            role,
            mpt: OnceLock::new(),
        }
    }

    /// Gives the pipe its mpt connections (once; a second set is dropped).
    pub(super) fn set_connections(&self, connections: MptConnections) {
        let _ = self.mpt.set(connections);
    }

    /// Whether this lane streams tensors over mpt connections.
    pub(super) fn streams(&self) -> bool {
        self.mpt.get().is_some()
    }

    /// The name of the channel this lane uses for CPU tensors, for errors.
    pub(super) fn channel_name(&self) -> &'static str {
        cpu_channel(&self.negotiated, self.role).map_or("basic", |c| c.name())
    }

    /// Reads the mpt tensors of `frame`, just received under the receive lock.
    fn fill(&self, frame: &mut IncomingFrame) -> Result<(), TransportError> {
        let Some(mpt) = self.mpt.get() else {
            // Refused per tensor when the frame is served: no stripe carries them.
            return Ok(());
        };
        mpt.fill(
            frame,
            (&self.negotiated, self.role),
            (&self.reader, &self.devices),
        )
        .map_err(|reason| TransportError::Io {
            op: "receive mpt tensors from",
            peer: self.peer.clone(),
            source: std::io::Error::other(reason),
        })
    }

    fn receiver(&self) -> MutexGuard<'_, Box<dyn FrameReceiver>> {
        self.receiver.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the connection; the reader thread sees it and cleans up.
    pub(crate) fn stop(&self) {
        self.control.stop();
        if let Some(mpt) = self.mpt.get() {
            mpt.shutdown();
        }
    }

    /// Sends frames the protocol owes the peer (polled already); a lane that cannot
    /// send any more is ending, and its end releases what they would have.
    pub(super) fn transmit(&self, transmits: Vec<Transmit>) {
        for transmit in transmits {
            let (kind, message_id) = transmit.frame();
            let _ = self.send(OwnedFrame::empty(kind, message_id));
        }
    }

    pub(super) fn send(&self, frame: OwnedFrame) -> Result<u64, SendFailure> {
        self.send_with(frame, Vec::new())
    }

    /// Sends `frame` and then, under the same lock, the stripes of its `streamed` (mpt)
    /// tensors. The buffers the transport does not keep go back to the recycle pool.
    pub(super) fn send_with(
        &self,
        frame: OwnedFrame,
        streamed: Streamed,
    ) -> Result<u64, SendFailure> {
        let mut sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        let (sent, back) = sender.send_owned(frame).map_err(|e| match e {
            TransportError::InjectedFault { handler } => SendFailure::Injected { handler },
            other => SendFailure::Broken(PipeFailure::transport(other)),
        })?;
        if streamed.is_empty() {
            drop(sender);
            if let Some(back) = back {
                recycle::give_all(back.tensor_data);
            }
            return Ok(sent);
        }
        let pushed = match self.mpt.get() {
            Some(mpt) => mpt.push(&streamed),
            None => Err(ConnectionsError::NoConnections),
        };
        drop(sender);
        if let Some(back) = back {
            recycle::give_all(back.tensor_data);
        }
        recycle::give_all(streamed.into_iter().map(|(_, data)| data).collect());
        pushed
            .map(|()| sent)
            .map_err(|e| SendFailure::Broken(PipeFailure::local(e)))
    }

    /// The next frame for the reader thread: it spins up to `spin` polling the
    /// receiver, then sleeps on the lane's control *without* holding the receiver, so
    /// that a caller may read meanwhile.
    pub(super) fn next_frame(
        &self,
        spin: Duration,
    ) -> Result<Option<IncomingFrame>, TransportError> {
        let wake = &self.control;
        let start = Instant::now();
        let mut spinning = !spin.is_zero();
        loop {
            {
                let mut receiver = self.receiver();
                match receiver.try_recv(FrameLimits::DEFAULT)? {
                    TryRecv::Frame(mut frame) => {
                        self.fill(&mut frame)?;
                        return Ok(Some(frame));
                    }
                    TryRecv::Closed => return Ok(None),
                    TryRecv::Empty => {}
                }
                let spun = start.elapsed();
                if spinning && spun >= spin {
                    spinning = false;
                }
                if !spinning {
                    if receiver.arm()? {
                        drop(receiver);
                        let gone = wake.wait(WAKE_POLL);
                        let mut receiver = self.receiver();
                        receiver.disarm();
                        if gone {
                            // What it published before it went is still delivered.
                            return match receiver.try_recv(FrameLimits::DEFAULT)? {
                                TryRecv::Frame(mut frame) => {
                                    self.fill(&mut frame)?;
                                    Ok(Some(frame))
                                }
                                TryRecv::Closed => Ok(None),
                                TryRecv::Empty => Err(TransportError::Io {
                                    op: "receive from",
                                    peer: self.peer.clone(),
                                    source: std::io::Error::new(
                                        std::io::ErrorKind::ConnectionAborted,
                                        // The control socket closed with the ring
                                        // not closed: the peer process died, or the
                                        // peer (or this side) stopped the pipe.
                                        "the pipe's control socket closed without a \
                                         goodbye (the peer process is gone, or the pipe \
                                         was stopped)",
                                    ),
                                }),
                            };
                        }
                    }
                    continue;
                }
                if spun >= SPIN_THEN_YIELD {
                    // A frame this late is a slow peer's (a Python handler's): give this
                    // CPU to whatever else may run on it while waiting for it.
                    drop(receiver);
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// A caller reads the lane itself while the reader thread sleeps, handing each
    /// frame to `on_frame` (`Some(reason)`: the lane ends), until `done` says so or
    /// `spin` has passed. Returns at once when another thread reads; `Some(reason)` when
    /// the lane must end.
    pub(super) fn read_while(
        &self,
        spin: Duration,
        done: impl Fn() -> bool,
        mut on_frame: impl FnMut(IncomingFrame) -> Option<PipeFailure>,
    ) -> Option<PipeFailure> {
        let wake = &self.control;
        let start = Instant::now();
        while !done() && start.elapsed() < spin {
            let Ok(mut receiver) = self.receiver.try_lock() else {
                std::hint::spin_loop();
                continue;
            };
            // The reader thread is asleep: the peer need not signal what we read.
            receiver.withdraw();
            let mut ended = None;
            let mut round = 0u32;
            while !done() {
                match receiver.try_recv(FrameLimits::DEFAULT) {
                    Ok(TryRecv::Frame(mut frame)) => {
                        if let Err(e) = self.fill(&mut frame) {
                            ended = Some(PipeFailure::transport(e));
                            break;
                        }
                        if let Some(reason) = on_frame(frame) {
                            ended = Some(reason);
                            break;
                        }
                    }
                    Ok(TryRecv::Empty) => std::hint::spin_loop(),
                    Ok(TryRecv::Closed) => {
                        ended = Some(PipeFailure::Closed);
                        break;
                    }
                    Err(e) => {
                        ended = Some(PipeFailure::transport(e));
                        break;
                    }
                }
                round = round.wrapping_add(1);
                if round.is_multiple_of(64) && start.elapsed() >= spin {
                    break;
                }
            }
            // Reading goes back to the reader thread: armed, the peer signals its next
            // frame; not armed, something is there already and the reader must look.
            let armed = ended.is_none() && receiver.arm().unwrap_or(false);
            drop(receiver);
            if !armed {
                wake.kick();
            }
            return ended;
        }
        None
    }
}
