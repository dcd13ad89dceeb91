//! [`ClientLane`]: the side of a pipe that makes calls. A caller's thread sends its own
//! request under the lane's send lock and, in `rpc_sync`, reads its own reply for a
//! while; the lane's reader thread (which does not spin: a waiting caller reads itself)
//! completes the other replies. Every frame goes to the core's [`ClientPipe`]: a reply
//! completes the call it answers and gives back what the request lent; a reply's
//! out-of-band tensors are pulled on the thread that read it, then acked. A client lane
//! serves no request, so it has no way to answer one.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::frame::FrameKind;
use rdzv_core::rpc::pipe::{ClientEvent, ClientPipe, PipeFrame, ReadError, Transmit};

use super::io::{LaneIo, SendFailure, Shared};
use super::spin::AdaptiveSpin;
use crate::rpc::calls::{Pending, Reply};
use crate::rpc::error::{CallError, ChannelFailure, PipeFailure};
use crate::rpc::mailbox::Call;
use crate::rpc::message::{Message, RpcFuture};
use crate::rpc::mpt::MptConnections;
use crate::rpc::outgoing::{sent_bytes, tensor_frame};
use crate::rpc::tensors::FrameExports;
use crate::rpc::transport::{Connection, IncomingFrame, OwnedFrame};

/// A thread-served pipe this worker opened to call `peer`.
pub(crate) struct ClientLane {
    pub io: LaneIo,
    /// The client side of the pipe's protocol (core's `rpc::pipe`): which replies reach
    /// a call, what is acked, and what requests lent until their reply (given up when
    /// the lane ends).
    machine: Mutex<ClientPipe<FrameExports>>,
    /// How long a caller in `rpc_sync` spins on its reply, from how many replies came
    /// within the spin.
    reply_spin: AdaptiveSpin,
    /// How long the reader thread spins for the next frame after one it read itself
    /// (replies to `rpc_async` calls, which no caller reads), from how many came within
    /// the spin.
    next_spin: AdaptiveSpin,
}

impl ClientLane {
    /// Client lane `id` to `peer` over `connection` (its reader not started yet).
    pub(super) fn new(
        (id, peer): (u64, String),
        negotiated: Negotiated,
        connection: Connection,
        connections: Option<MptConnections>,
        shared: Shared<'_>,
    ) -> Arc<ClientLane> {
        let io = LaneIo::new((id, peer), negotiated, connection, Role::Connector, shared);
        if let Some(connections) = connections {
            io.set_connections(connections);
        }
        Arc::new(ClientLane {
            io,
            machine: Mutex::new(ClientPipe::new()),
            reply_spin: AdaptiveSpin::default(),
            next_spin: AdaptiveSpin::default(),
        })
    }

    fn machine(&self) -> MutexGuard<'_, ClientPipe<FrameExports>> {
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The frames the protocol owes the peer.
    fn transmits(machine: &mut ClientPipe<FrameExports>) -> Vec<Transmit> {
        std::iter::from_fn(|| machine.poll_transmit()).collect()
    }

    /// Sends a call's request on this lane, from the caller's thread.
    /// `me`: this worker's name, for the error if the calls table is closed.
    pub(crate) fn call(self: &Arc<Self>, me: &str, call: Call) {
        let Call {
            message_id,
            peer,
            handler,
            message,
            timeout,
            completion,
        } = call;
        let pending = Pending {
            peer,
            handler: handler.clone(),
            pipe: self.io.id,
            sent_bytes: 0,
            timeout,
            completion,
        };
        if let Err(pending) = self.io.calls.register(message_id, pending) {
            let name = me.to_string();
            self.io
                .calls
                .complete(&pending.completion, Err(CallError::ShutDown { name }));
            return;
        }
        self.send_request(message_id, handler, message);
    }

    /// Sends the request of call `message_id`, already pending on this lane (a call
    /// that timed out meanwhile is skipped).
    pub(crate) fn send_request(&self, message_id: u64, handler: String, message: Message) {
        let io = &self.io;
        let mut frame = OwnedFrame {
            handler,
            metadata: message.metadata,
            payload: message.payload,
            ..OwnedFrame::empty(FrameKind::Request, message_id)
        };
        let mut exports = FrameExports::default();
        let built = tensor_frame(
            &io.framer,
            &mut frame,
            &mut exports,
            message.tensors,
            &io.peer,
            (Role::Connector, &io.negotiated, io.streams()),
            false,
        );
        if let Err(e) = built {
            // Nothing was sent: this call alone fails.
            if let Some(pending) = io.calls.take(message_id) {
                io.calls.complete(&pending.completion, Err(e));
            }
            return;
        }
        io.calls.set_sent(message_id, sent_bytes(&frame));
        let streamed = exports.take_streamed();
        // What it lends is held until the reply arrives or the lane ends.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = self.machine().send_request(message_id, lent);
        if let Err(refused) = accepted {
            // Never sent: this call alone fails (what it would have lent is dropped).
            if let Some(pending) = io.calls.take(message_id) {
                let error = CallError::PipeBroken {
                    peer: io.peer.clone(),
                    reason: PipeFailure::protocol(refused.reason),
                };
                io.calls.fail(pending, error);
            }
            return;
        }
        match io.send_with(frame, streamed) {
            Ok(_) => {}
            // Fault injection: this request alone fails, as if it had not been sent.
            Err(SendFailure::Injected { handler }) => {
                drop(self.machine().unsent(message_id));
                if let Some(pending) = io.calls.take(message_id) {
                    let error = CallError::InjectedFault {
                        peer: pending.peer.clone(),
                        handler,
                    };
                    io.calls.fail(pending, error);
                }
            }
            Err(SendFailure::Broken(reason)) => self.end(reason),
        }
    }

    /// Sends a goodbye (graceful shutdown); failures are expected then and ignored.
    pub(crate) fn goodbye(&self) {
        let transmits = {
            let mut machine = self.machine();
            machine.goodbye();
            Self::transmits(&mut machine)
        };
        self.io.transmit(transmits);
    }

    /// Waits for the reply of the call `future` is for, sent on this lane: the caller
    /// reads the lane itself for up to `spin` (while replies typically come within it),
    /// then sleeps until the reader thread completes the call.
    pub(crate) fn wait_reply(
        &self,
        future: RpcFuture,
        spin: Duration,
    ) -> Result<Message, CallError> {
        let started = Instant::now();
        let spin = self.reply_spin.spin(spin);
        if !spin.is_zero() {
            let completion = future.completion();
            let ended = self.io.read_while(
                spin,
                || completion.is_done_relaxed(),
                |frame| self.on_frame(frame),
            );
            if let Some(reason) = ended {
                self.end(reason);
            }
        }
        let result = future.wait_sleeping();
        self.reply_spin.record(spin, started.elapsed());
        result
    }

    /// The caller is done with what reply `message_id` lent (read, or never to be
    /// read): the ack goes out, unless the lane ended meanwhile.
    fn done_reading(&self, message_id: u64) -> Result<(), ReadError> {
        let (done, transmits) = {
            let mut machine = self.machine();
            let done = machine.done_reading(message_id);
            (done, Self::transmits(&mut machine))
        };
        self.io.transmit(transmits);
        done
    }

    /// A frame that arrived on this lane; `Some(reason)` when the lane ends. The pipe's
    /// machine decides (core's `rpc::pipe`): a reply to a call sent on this lane gives
    /// back what its request lent and completes the call; a response's out-of-band
    /// tensors are pulled here, then acked; anything else is dropped (and acked if it
    /// lent buffers).
    fn on_frame(&self, frame: IncomingFrame) -> Option<PipeFailure> {
        let header = PipeFrame::new(
            frame.kind,
            frame.message_id,
            frame.tensors.iter().map(|(d, _)| d),
        );
        // One lock: the frame in, its events and the frames it owes the peer out.
        let (events, transmits) = {
            let mut machine = self.machine();
            machine.handle_frame(header);
            let events = std::iter::from_fn(|| machine.poll_event()).collect::<Vec<_>>();
            (events, Self::transmits(&mut machine))
        };
        self.io.transmit(transmits);
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
    fn on_reply(&self, frame: IncomingFrame, lent: bool) {
        let io = &self.io;
        let message_id = frame.message_id;
        let Some(pending) = io.calls.take_reply(message_id, io.id) else {
            tracing::debug!(message_id, "late reply dropped");
            if lent {
                // Nobody reads its tensors: let the callee release them.
                let _ = self.done_reading(message_id);
            }
            return;
        };
        let peer = pending.peer.clone();
        match io.calls.reply(pending, frame, &io.negotiated, &io.reader) {
            Reply::Done => {
                if lent {
                    let _ = self.done_reading(message_id);
                }
            }
            Reply::Pull(job) => {
                let (completion, pulled) = job.pull();
                let pulled = match (self.done_reading(message_id), pulled) {
                    (Err(ReadError::PipeEnded), Ok(_)) => Err(CallError::Channel {
                        channel: io.channel_name(),
                        peer,
                        index: None,
                        reason: ChannelFailure::Unread(ReadError::PipeEnded),
                    }),
                    (_, pulled) => pulled,
                };
                io.calls.complete(&completion, pulled);
            }
        }
    }

    /// The reader thread: receives until the pipe fails or closes, then ends the lane.
    /// It spins for up to `spin` only after a frame it read itself: a caller waiting in
    /// `rpc_sync` reads its own reply, but the replies of a burst of `rpc_async` calls
    /// come one after another, and catching the next one spinning spares the peer a
    /// wake-up and this thread a sleep per reply.
    pub(super) fn read(&self, spin: Duration) {
        let mut after_frame = false;
        let reason = loop {
            let waiting = Instant::now();
            let spun = if after_frame {
                self.next_spin.spin(spin)
            } else {
                Duration::ZERO
            };
            let next = self.io.next_frame(spun);
            self.next_spin.record(spun, waiting.elapsed());
            match next {
                Ok(Some(frame)) => {
                    after_frame = true;
                    if let Some(reason) = self.on_frame(frame) {
                        break reason;
                    }
                }
                Ok(None) => break PipeFailure::Closed,
                Err(e) => break PipeFailure::transport(e),
            }
        };
        self.end(reason);
    }

    /// Ends the connection; the reader thread sees it and ends the lane.
    pub(crate) fn stop(&self) {
        self.io.stop();
    }

    /// The lane failed or closed: it leaves the registry (if it is still there), its
    /// connection stops and the calls sent on it fail with `reason`.
    pub(crate) fn end(&self, reason: PipeFailure) {
        let io = &self.io;
        // Gone only with the agent's lane context, whose registry is then gone too.
        if let Some(registry) = io.registry.upgrade() {
            registry.leave_client(&io.peer, io.id);
        }
        let ended = self.machine().end();
        io.stop();
        // Given up last: the peer can no longer ask for them.
        drop(ended.lent);
        for pending in io.calls.take_pipe(io.id) {
            let error = CallError::PipeBroken {
                peer: io.peer.clone(),
                reason: reason.clone(),
            };
            io.calls.fail(pending, error);
        }
    }
}
