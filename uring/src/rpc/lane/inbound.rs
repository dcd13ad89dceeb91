//! [`InboundLane`]: the side of a pipe that serves a peer's calls. Its reader thread
//! spins for `wait_spin` after each request, feeds every frame to the core's
//! [`InboundPipe`], runs inline handlers itself and sends their responses, and hands
//! the other requests to the worker pool as [`Job`]s, whose [`Responder`] sends the
//! response on the lane the request came on. The caller's ack releases what a response
//! lent. An inbound lane makes no call, so it has no way to send a request.

use crossbeam_channel::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::pipe::{Closed, InboundEvent, InboundPipe, PipeFrame, Transmit};
use rdzv_core::rpc::rref::wire::{handler, RemoteCallHeader};

use super::io::{LaneIo, Shared};
use super::spin::AdaptiveSpin;
use crate::rpc::client::{Caller, RpcClient};
use crate::rpc::counters::JoinGate;
use crate::rpc::error::CallError;
use crate::rpc::handler::{run_handler, CallContext};
use crate::rpc::message::Message;
use crate::rpc::mpt::{ConnectionsError, MptConnections, MptSetup, CONNECT_TIMEOUT};
use crate::rpc::outgoing::response_frame;
use crate::rpc::registry::Registry;
use crate::rpc::rref::RRefRuntime;
use crate::rpc::tensors::{FrameExports, ReceivedTensors};
use crate::rpc::transport::{Connection, IncomingFrame};

/// What an inbound lane serves requests with, beyond its lane context: the handlers,
/// the server call counts (`join` waits for them), the RRef runtime (told of each
/// `remote()` as it arrives) and the client that handlers call through.
pub(crate) struct Server {
    /// This worker's name (in errors).
    pub name: String,
    pub registry: Arc<Registry>,
    pub gate: Arc<JoinGate>,
    pub rrefs: Arc<dyn RRefRuntime>,
    /// What a handler's [`CallContext::client`] calls through.
    pub caller: Arc<dyn Caller>,
}

/// A request for the worker pool. `message` has no tensors yet: they are in `tensors`,
/// to be pulled (out-of-band ones) on the pool's thread before the handler runs; the
/// response goes to `responder`.
pub(crate) struct Job {
    pub responder: Responder,
    pub ctx: CallContext,
    pub message: Message,
    pub tensors: ReceivedTensors,
    /// When it was handed to the pool (the handler queue wait starts here).
    pub queued: Instant,
}

/// Where a request's response goes: the inbound lane it came on, captured when the
/// request was dispatched, so that answering it looks nothing up. A lane that ended
/// meanwhile (a reset, a crashed peer) refuses the response, which is dropped: nobody
/// waits for it there.
pub(crate) struct Responder {
    lane: Arc<InboundLane>,
}

impl Responder {
    /// Sends the response to request `message_id` from this thread.
    pub(crate) fn respond(&self, message_id: u64, result: Result<Message, String>) {
        self.lane.respond(message_id, result);
    }
}

/// A thread-served pipe a peer opened to call this worker.
pub(crate) struct InboundLane {
    pub io: LaneIo,
    /// The inbound side of the pipe's protocol (core's `rpc::pipe`): which requests are
    /// served, what is released on the caller's ack, and what responses lent until
    /// then (given up when the lane ends).
    machine: Mutex<InboundPipe<FrameExports>>,
    /// How long the reader spins for the next request after one, from how long the
    /// gaps between requests were.
    request_spin: AdaptiveSpin,
}

impl InboundLane {
    /// Inbound lane `id` from `peer` over `connection` (its reader not started yet).
    pub(super) fn new(
        (id, peer): (u64, String),
        negotiated: Negotiated,
        connection: Connection,
        shared: Shared<'_>,
    ) -> Arc<InboundLane> {
        Arc::new(InboundLane {
            io: LaneIo::new((id, peer), negotiated, connection, Role::Listener, shared),
            machine: Mutex::new(InboundPipe::new()),
            request_spin: AdaptiveSpin::default(),
        })
    }

    fn machine(&self) -> MutexGuard<'_, InboundPipe<FrameExports>> {
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The frames the protocol owes the peer.
    fn transmits(machine: &mut InboundPipe<FrameExports>) -> Vec<Transmit> {
        std::iter::from_fn(|| machine.poll_transmit()).collect()
    }

    /// Takes the mpt connections the peer opened for this pipe with `token`.
    pub(super) fn claim_connections(
        &self,
        setup: Option<&MptSetup>,
        token: u64,
    ) -> Result<(), ConnectionsError> {
        let Some(setup) = setup else {
            return Err(ConnectionsError::NoListener);
        };
        let streams = setup
            .listener
            .claim(token, CONNECT_TIMEOUT)
            .map_err(|source| ConnectionsError::Claim { source })?;
        let connections = MptConnections::new(streams)?;
        if self.machine().is_ended() {
            connections.shutdown();
            return Err(ConnectionsError::PipeEnded);
        }
        self.io.set_connections(connections);
        Ok(())
    }

    /// Sends the response to request `message_id` of this lane.
    pub(crate) fn respond(&self, message_id: u64, result: Result<Message, String>) {
        let io = &self.io;
        let (frame, mut exports) = response_frame(
            &io.framer,
            message_id,
            result,
            &io.peer,
            (Role::Listener, &io.negotiated, io.streams()),
        );
        let streamed = exports.take_streamed();
        // What it lends is held until the caller's ack, or the lane's end.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = self.machine().respond(message_id, lent);
        if let Err(refused) = accepted {
            // The lane ended (or said goodbye) while the handler ran: nobody waits for
            // the response here, and what it would have lent was never seen.
            let refusal = refused.reason;
            tracing::debug!(peer = %io.peer, message_id, %refusal, "an RPC response is dropped");
            return;
        }
        let sent = io.send_with(frame, streamed);
        if let Err(reason) = sent {
            tracing::debug!(peer = %io.peer, %reason, "an RPC response could not be sent");
            io.stop();
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

    /// The reader thread: serves the peer's requests with `server` (non-inline ones
    /// through `jobs`) until the pipe fails, closes or says goodbye, then ends the lane.
    /// Spinning for `spin` after each frame answers a waiting caller without a wake-up
    /// on this side.
    pub(super) fn serve(
        self: &Arc<Self>,
        server: &Server,
        spin: Duration,
        peer_id: WorkerId,
        jobs: &Sender<Job>,
    ) {
        'read: loop {
            let waiting = Instant::now();
            let spun = self.request_spin.spin(spin);
            let next = self.io.next_frame(spun);
            self.request_spin.record(spun, waiting.elapsed());
            let frame = match next {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    if !server.gate.is_shutting_down() {
                        tracing::debug!(peer = %self.io.peer, error = %e, "inbound RPC pipe failed");
                    }
                    break;
                }
            };
            let header = PipeFrame::new(
                frame.kind,
                frame.message_id,
                frame.tensors.iter().map(|(d, _)| d),
            );
            let events = {
                let mut machine = self.machine();
                machine.handle_frame(header);
                std::iter::from_fn(|| machine.poll_event()).collect::<Vec<_>>()
            };
            let mut frame = Some(frame);
            for event in events {
                match event {
                    InboundEvent::Request { .. } => {
                        if let Some(frame) = frame.take() {
                            self.serve_request(server, jobs, peer_id, frame);
                        }
                    }
                    // The caller read what the response lent: reuse it.
                    InboundEvent::Release { buffers, .. } => buffers.recycle(),
                    InboundEvent::Closed(Closed::Goodbye) => break 'read,
                    InboundEvent::Closed(why) => {
                        tracing::warn!(peer = %self.io.peer, reason = %why, "an inbound RPC pipe is closed");
                        break 'read;
                    }
                }
            }
        }
        self.end();
    }

    /// Serves a request that arrived on this lane from the peer `peer_id`: a `to_here`
    /// goes to the RRef runtime, which answers it from here or once its value exists; an
    /// inline handler (or a `remote()` of one) runs here, after its tensors are pulled,
    /// and its response goes out from here; any other goes to the worker pool, which
    /// pulls the tensors and answers through the job's [`Responder`]. A request whose tensors cannot be read at all (a
    /// channel that was not negotiated, a bad descriptor) fails at once; with the pool
    /// gone the caller learns that this worker shut down.
    fn serve_request(
        self: &Arc<Self>,
        server: &Server,
        jobs: &Sender<Job>,
        peer_id: WorkerId,
        frame: IncomingFrame,
    ) {
        let io = &self.io;
        let (negotiated, reader, peer) = (&io.negotiated, &io.reader, io.peer.as_str());
        let respond = |id, result| self.respond(id, result);
        let ctx = CallContext {
            caller: peer.to_string(),
            caller_id: peer_id,
            handler: frame.handler,
            message_id: frame.message_id,
            client: RpcClient::new(Arc::clone(&server.caller)),
        };
        let message = Message {
            metadata: frame.metadata,
            payload: frame.payload,
            tensors: Vec::new(),
        };
        let source = (reader, &io.devices);
        let tensors =
            match ReceivedTensors::sort(frame.tensors, negotiated, Role::Listener, source, peer) {
                Ok(tensors) => tensors,
                Err(e) => return respond(ctx.message_id, Err(e.to_string())),
            };
        server.gate.server_call_started();
        if ctx.handler == handler::FETCH {
            // Answered now or when its value is stored: it never needs the pool. (A value
            // already there is copied here: for a large tensor this lane reads its next
            // frame after that copy.)
            let (lane, id) = (Arc::clone(self), ctx.message_id);
            let respond = Box::new(move |result| lane.respond(id, result));
            server.rrefs.fetch_arrived(&message.payload, respond);
            return;
        }
        let remote = ctx.handler == handler::REMOTE;
        if remote {
            Arc::clone(&server.rrefs).remote_call_arrived(peer_id, &message.payload);
        }
        // A `remote()` of an inline handler runs inline too.
        let inline = |name: &str| server.registry.handler(name).filter(|h| h.runs_inline());
        let remote_inline = remote
            && RemoteCallHeader::split(&message.payload)
                .is_ok_and(|(header, _)| inline(&header.handler).is_some());
        if let Some(handler) = server
            .registry
            .handler(&ctx.handler)
            .filter(|h| remote_inline || h.runs_inline())
        {
            let message_id = ctx.message_id;
            let result = tensors
                .pull()
                .map_err(|e| e.to_string())
                .and_then(|tensors| {
                    run_handler(handler.as_ref(), &ctx, Message { tensors, ..message })
                });
            server.gate.server_call_finished();
            respond(message_id, result);
            return;
        }
        let job = Job {
            responder: Responder {
                lane: Arc::clone(self),
            },
            ctx,
            message,
            tensors,
            queued: Instant::now(),
        };
        if let Err(job) = jobs.send(job) {
            server.gate.server_call_finished();
            let name = server.name.clone();
            respond(
                job.0.ctx.message_id,
                Err(CallError::ShutDown { name }.to_string()),
            );
        }
    }

    /// Ends the connection; the reader thread sees it and ends the lane.
    pub(crate) fn stop(&self) {
        self.io.stop();
    }

    /// The lane failed or closed: it leaves the registry (if it is still there), its
    /// connection stops, and what its responses lent is given up. (No call of this
    /// worker waits on an inbound lane.)
    pub(crate) fn end(&self) {
        let io = &self.io;
        // Gone only with the agent's lane context, whose registry is then gone too.
        if let Some(registry) = io.registry.upgrade() {
            registry.leave_inbound(io.id);
        }
        let ended = self.machine().end();
        io.stop();
        // Given up last: the peer can no longer ask for them.
        drop(ended.lent);
    }
}
