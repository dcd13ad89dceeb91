//! A lane's receiving side: the reader thread's next frame (spinning, then sleeping on
//! a polled lane's wake without holding the receiver), a caller reading its own reply,
//! and a client lane's frames fed to the pipe's machine: replies complete their calls,
//! lent tensors are pulled, then acked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::Role;
use rdzv_core::rpc::frame::FrameLimits;
use rdzv_core::rpc::pipe::{ClientEvent, PipeFrame, ReadError};

use super::{Lane, Machine, WrongSide, WAKE_POLL};
use crate::rpc::calls::Reply;
use crate::rpc::error::{CallError, ChannelFailure, PipeFailure, TransportError};
use crate::rpc::message::Completion;
use crate::rpc::transport::{IncomingFrame, TryRecv};

impl Lane {
    /// The caller is done with what reply `message_id` lent (read, or never to be
    /// read): the ack goes out, unless the lane ended meanwhile.
    pub(super) fn done_reading(&self, message_id: u64) -> Result<(), ReadError> {
        let (done, transmits) = {
            let mut machine = self.machine();
            let done = match &mut *machine {
                Machine::Client(pipe) => pipe.done_reading(message_id),
                Machine::Inbound(_) => Err(ReadError::NotReading { message_id }),
            };
            (done, machine.transmits())
        };
        self.transmit(transmits);
        done
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
                if spinning && start.elapsed() >= spin {
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
            }
            std::hint::spin_loop();
        }
    }

    /// A caller waiting for `completion` reads the lane itself for up to `spin` while
    /// the reader thread sleeps: its reply then costs no thread wake-up at all. Returns
    /// at once when another thread reads.
    pub(crate) fn read_own_reply(&self, completion: &Completion, spin: Duration) {
        let wake = &self.control;
        let start = Instant::now();
        while !completion.is_done_relaxed() && start.elapsed() < spin {
            let Ok(mut receiver) = self.receiver.try_lock() else {
                std::hint::spin_loop();
                continue;
            };
            // The reader thread is asleep: the peer need not signal what we read.
            receiver.withdraw();
            let mut ended = None;
            let mut round = 0u32;
            while !completion.is_done_relaxed() {
                match receiver.try_recv(FrameLimits::DEFAULT) {
                    Ok(TryRecv::Frame(mut frame)) => {
                        if let Err(e) = self.fill(&mut frame) {
                            ended = Some(PipeFailure::transport(e));
                            break;
                        }
                        if let Some(reason) = self.on_client_frame(frame) {
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
            if let Some(reason) = ended {
                self.end(reason);
            }
            return;
        }
    }

    /// A frame that arrived on this client lane; `Some(reason)` when the lane ends. The
    /// pipe's machine decides (core's `rpc::pipe`): a reply to a call sent on this lane
    /// gives back what its request lent and completes the call; a response's
    /// out-of-band tensors are pulled here, then acked; anything else is dropped (and
    /// acked if it lent buffers).
    pub(super) fn on_client_frame(&self, frame: IncomingFrame) -> Option<PipeFailure> {
        let header = PipeFrame::new(
            frame.kind,
            frame.message_id,
            frame.tensors.iter().map(|(d, _)| d),
        );
        // One lock: the frame in, its events and the frames it owes the peer out.
        let (events, transmits) = {
            let mut machine = self.machine();
            let events = match &mut *machine {
                Machine::Client(pipe) => {
                    pipe.handle_frame(header);
                    std::iter::from_fn(|| pipe.poll_event()).collect::<Vec<_>>()
                }
                Machine::Inbound(_) => return Some(PipeFailure::protocol(WrongSide)),
            };
            (events, machine.transmits())
        };
        self.transmit(transmits);
        let mut frame = Some(frame);
        for event in events {
            match event {
                ClientEvent::Reply { released, lent, .. } => {
                    if let Some(frame) = frame.take() {
                        self.on_reply(frame, lent);
                    }
                    // The callee answered, so it read what the request lent.
                    if let Some(released) = released {
                        released.recycle();
                    }
                }
                ClientEvent::Unmatched { message_id, acked } => {
                    tracing::debug!(
                        message_id,
                        acked,
                        "a reply for no call on this pipe dropped"
                    );
                }
                ClientEvent::Closed(why) => return Some(PipeFailure::protocol(why)),
            }
        }
        None
    }

    /// Completes the call reply `frame` answers (if it still waits: it may have timed
    /// out); `lent`: the reply lent buffers, which are pulled (or not) and then acked.
    pub(super) fn on_reply(&self, frame: IncomingFrame, lent: bool) {
        let message_id = frame.message_id;
        let Some(pending) = self.calls.take_reply(message_id, self.id) else {
            tracing::debug!(message_id, "late reply dropped");
            if lent {
                // Nobody reads its tensors: let the callee release them.
                let _ = self.done_reading(message_id);
            }
            return;
        };
        let peer = pending.peer.clone();
        match self
            .calls
            .reply(pending, frame, &self.negotiated, &self.reader)
        {
            Reply::Done => {
                if lent {
                    let _ = self.done_reading(message_id);
                }
            }
            Reply::Pull(job) => {
                let (completion, pulled) = job.pull();
                let pulled = match (self.done_reading(message_id), pulled) {
                    (Err(ReadError::PipeEnded), Ok(_)) => Err(CallError::Channel {
                        channel: self.channel_name(Role::Connector),
                        peer,
                        index: None,
                        reason: ChannelFailure::Unread(ReadError::PipeEnded),
                    }),
                    (_, pulled) => pulled,
                };
                self.calls.complete(&completion, pulled);
            }
        }
    }
}

pub(super) fn client_reader(lane: &Arc<Lane>) {
    let reason = loop {
        // The client side does not spin: a waiting caller reads itself (polled lanes).
        match lane.next_frame(Duration::ZERO) {
            Ok(Some(frame)) => {
                if let Some(reason) = lane.on_client_frame(frame) {
                    break reason;
                }
            }
            Ok(None) => break PipeFailure::Closed,
            Err(e) => break PipeFailure::transport(e),
        }
    };
    lane.end(reason);
}
