//! An inbound lane serving its peer's requests: the reader thread runs inline handlers
//! itself and hands the others to the worker pool as [`Job`]s, whose [`Responder`]
//! sends the response on the lane the request came on.

use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::Role;
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::pipe::{Closed, InboundEvent, PipeFrame};

use super::{Lane, Machine};
use crate::rpc::client::{Caller, RpcClient};
use crate::rpc::counters::JoinGate;
use crate::rpc::error::{CallError, PipeFailure};
use crate::rpc::handler::{run_handler, CallContext};
use crate::rpc::message::Message;
use crate::rpc::registry::Registry;
use crate::rpc::rref::RRefRuntime;
use crate::rpc::tensors::ReceivedTensors;
use crate::rpc::transport::IncomingFrame;

/// What an inbound lane serves requests with, beyond its [`LaneContext`]: the
/// handlers, the server call counts (`join` waits for them), the RRef runtime (told of
/// each `remote()` as it arrives) and the client that handlers call through.
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
    lane: Arc<Lane>,
}

impl Responder {
    /// Sends the response to request `message_id` from this thread.
    pub(crate) fn respond(&self, message_id: u64, result: Result<Message, String>) {
        self.lane.respond(message_id, result);
    }
}

pub(super) fn inbound_reader(
    server: &Server,
    spin: Duration,
    lane: &Arc<Lane>,
    peer_id: WorkerId,
    jobs: &Sender<Job>,
) {
    'read: loop {
        // Spinning here answers a waiting caller without a wake-up on this side.
        let frame = match lane.next_frame(spin) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => {
                if !server.gate.is_shutting_down() {
                    tracing::debug!(peer = %lane.peer, error = %e, "inbound RPC pipe failed");
                }
                break;
            }
        };
        let header = PipeFrame::new(
            frame.kind,
            frame.message_id,
            frame.tensors.iter().map(|(d, _)| d),
        );
        let events = match &mut *lane.machine() {
            Machine::Inbound(pipe) => {
                pipe.handle_frame(header);
                std::iter::from_fn(|| pipe.poll_event()).collect::<Vec<_>>()
            }
            Machine::Client(_) => break,
        };
        let mut frame = Some(frame);
        for event in events {
            match event {
                InboundEvent::Request { .. } => {
                    if let Some(frame) = frame.take() {
                        serve_request(server, jobs, lane, peer_id, frame);
                    }
                }
                // The caller read what the response lent: reuse it.
                InboundEvent::Release { buffers, .. } => buffers.recycle(),
                InboundEvent::Closed(Closed::Goodbye) => break 'read,
                InboundEvent::Closed(why) => {
                    tracing::warn!(peer = %lane.peer, reason = %why, "an inbound RPC pipe is closed");
                    break 'read;
                }
            }
        }
    }
    // Leaves the registry, stops, and gives up what responses lent.
    // An inbound lane has no calls of this worker pending on it.
    lane.end(PipeFailure::Closed);
}

/// Serves a request that arrived on inbound lane `lane` from the peer `peer_id`: an
/// inline handler runs here, after its tensors are pulled, and its response goes out
/// from here; any other goes to the worker pool, which pulls the tensors and answers
/// through the job's [`Responder`]. A request whose tensors cannot be read at all (a
/// channel that was not negotiated, a bad descriptor) fails at once; with the pool gone
/// the caller learns that this worker shut down.
fn serve_request(
    server: &Server,
    jobs: &Sender<Job>,
    lane: &Arc<Lane>,
    peer_id: WorkerId,
    frame: IncomingFrame,
) {
    let (negotiated, reader, peer) = (&lane.negotiated, &lane.reader, lane.peer.as_str());
    let respond = |id, result| lane.respond(id, result);
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
    let source = (reader, &lane.devices);
    let tensors =
        match ReceivedTensors::sort(frame.tensors, negotiated, Role::Listener, source, peer) {
            Ok(tensors) => tensors,
            Err(e) => return respond(ctx.message_id, Err(e.to_string())),
        };
    server.gate.server_call_started();
    if let Some(handler) = server
        .registry
        .handler(&ctx.handler)
        .filter(|h| h.runs_inline())
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
    if ctx.handler == rdzv_core::rpc::rref::wire::handler::REMOTE {
        Arc::clone(&server.rrefs).remote_call_arrived(peer_id, &message.payload);
    }
    let job = Job {
        responder: Responder {
            lane: Arc::clone(lane),
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
