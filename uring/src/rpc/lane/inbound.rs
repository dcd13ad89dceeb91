//! [`InboundLane`]: the side of a pipe that serves a peer's calls. Its reader thread
//! spins for `wait_spin` after each request, feeds every frame to the core's
//! [`InboundPipe`], runs inline handlers itself and sends their responses, and hands
//! the other requests to the worker pool as [`Job`]s, whose [`Responder`] sends the
//! response on the lane the request came on. A handler that
//! [`runs_on_reader`](crate::rpc::Handler::runs_on_reader) (Python's) runs on the reader
//! too when a worker slot is free; if it runs past `STALL`, the lane's watcher
//! ([`StallWatch`], driven from `lane/mod.rs`) starts another thread that reads the lane
//! on, and the first thread ends once its handler returns. The caller's ack releases
//! what a response lent. An inbound lane makes no call, so it has no way to send a
//! request.

use crossbeam_channel::Sender;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::pipe::{Closed, InboundEvent, InboundPipe, PipeFrame, Transmit};
use rdzv_core::rpc::rref::wire::{handler, RemoteCallHeader};

use super::io::{LaneIo, Shared};
use super::spin::AdaptiveSpin;
use crate::rpc::client::{Caller, RpcClient};
use crate::rpc::counters::{Counters, JoinGate};
use crate::rpc::error::CallError;
use crate::rpc::handler::{
    placement, run_handler, run_handler_reply, CallContext, Placement, Reply,
};
use crate::rpc::message::{off_io_thread, on_io_thread, Message};
use crate::rpc::mpt::{ConnectionsError, MptConnections, MptSetup, CONNECT_TIMEOUT};
use crate::rpc::outgoing::response_frame;
use crate::rpc::registry::Registry;
use crate::rpc::rref::RRefRuntime;
use crate::rpc::tensors::{FrameExports, ReceivedTensors};
use crate::rpc::transport::{Connection, IncomingFrame};

/// What an inbound lane serves requests with, beyond its lane context: what runs
/// handlers, the RRef runtime (told of each `remote()` as it arrives), the client that
/// handlers call through, and the watcher of handlers run on readers.
pub(crate) struct Server {
    pub runner: Arc<Runner>,
    pub rrefs: Arc<dyn RRefRuntime>,
    /// What a handler's [`CallContext::client`] calls through.
    pub caller: Arc<dyn Caller>,
    /// Sees readers whose handler runs long.
    pub stall: StallWatch,
}

/// What running a request's handler reads, on a lane's reader or a pool thread: the
/// handlers, the server call counts (`join` waits for them), the pool's counters (busy
/// threads, queue wait) and the worker slots.
pub(crate) struct Runner {
    /// This worker's name (in errors).
    pub name: String,
    pub registry: Arc<Registry>,
    pub gate: Arc<JoinGate>,
    pub counters: Arc<Counters>,
    pub slots: Slots,
}

/// The `num_worker_threads` slots handlers run in, shared by the pool and the readers
/// that run handlers themselves: at most that many handlers run at once.
pub(crate) struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    pub(crate) fn new(slots: usize) -> Slots {
        Slots {
            free: Mutex::new(slots),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, usize> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a slot if one is free.
    fn try_take(&self) -> bool {
        let mut free = self.lock();
        let took = *free > 0;
        if took {
            *free -= 1;
        }
        took
    }

    /// Takes a slot, waiting for one (a pool thread).
    pub(crate) fn take(&self) {
        let mut free = self.lock();
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
    }

    /// Gives a slot back.
    pub(crate) fn give(&self) {
        *self.lock() += 1;
        self.freed.notify_one();
    }
}

/// How long a handler run on a lane's reader may go before another thread reads the lane
/// on.
pub(crate) const STALL: Duration = Duration::from_millis(2);

/// [`InboundLane::running`] once another thread reads the lane on.
const TAKEN_OVER: u64 = u64::MAX;

/// Whether some reader runs a handler, so that the watcher thread (`lane/mod.rs`) looks
/// every tick; it sleeps otherwise, and the first reader to run one wakes it.
pub(crate) struct StallWatch {
    /// The clock of [`InboundLane::running`].
    epoch: Instant,
    armed: AtomicBool,
    watcher: OnceLock<Thread>,
}

impl Default for StallWatch {
    fn default() -> Self {
        StallWatch {
            epoch: Instant::now(),
            armed: AtomicBool::new(false),
            watcher: OnceLock::new(),
        }
    }
}

impl StallWatch {
    /// Nanoseconds on this watch's clock, from 1.
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX - 1)
            .clamp(1, u64::MAX - 1)
    }

    /// The watcher thread, woken when a run starts while it sleeps.
    pub(super) fn set_watcher(&self, watcher: Thread) {
        let _ = self.watcher.set(watcher);
    }

    /// A reader began a run (after marking its lane): wakes the watcher if it sleeps.
    fn arm(&self) {
        if !self.armed.load(Ordering::SeqCst) && !self.armed.swap(true, Ordering::SeqCst) {
            if let Some(watcher) = self.watcher.get() {
                watcher.unpark();
            }
        }
    }

    pub(super) fn is_armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst)
    }

    /// The watcher saw no run; it looks once more after this, then sleeps.
    pub(super) fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The watcher's last look found a run after all.
    pub(super) fn rearm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
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

impl Job {
    /// Runs the job's handler (after pulling its out-of-band tensors) and sends its
    /// response, now or, for a handler that answers later, when its future completes.
    pub(crate) fn run(self, runner: &Runner) {
        let Job {
            responder,
            ctx,
            message,
            tensors,
            queued,
        } = self;
        // The handler queue wait (PyTorch's `agent.gil_average_wait_time_us`, measured
        // there around taking the GIL): from the hand-off to this thread taking the job.
        runner.counters.worker_busy(queued.elapsed());
        let reply = match (tensors.pull(), runner.registry.handler(&ctx.handler)) {
            (Err(e), _) => Reply::Now(Err(e.to_string())),
            (Ok(tensors), Some(handler)) => {
                run_handler_reply(handler.as_ref(), &ctx, Message { tensors, ..message })
            }
            (Ok(_), None) => Reply::Now(Err(format!(
                "no RPC handler named {} is registered on worker {}; register it before peers call it",
                ctx.handler, runner.name
            ))),
        };
        let message_id = ctx.message_id;
        match reply {
            Reply::Now(result) => {
                runner.gate.server_call_finished();
                runner.counters.worker_idle();
                responder.respond(message_id, result);
            }
            Reply::Later(future) => {
                // This thread goes on; the response leaves when the future completes.
                runner.gate.server_call_went_async();
                runner.counters.worker_idle();
                let gate = Arc::clone(&runner.gate);
                future.on_done(move |result| {
                    let send = move || {
                        gate.async_server_call_finished();
                        responder.respond(message_id, result.map_err(|e| e.to_string()));
                    };
                    // The future may complete on the I/O thread (a nested call that
                    // failed while its pipe was opening); a response's blocking send
                    // must not stall the handshakes there, so it leaves from a thread
                    // of its own.
                    if on_io_thread() {
                        respond_from_own_thread(Box::new(send));
                    } else {
                        send();
                    }
                });
            }
        }
    }
}

/// Runs `send` (a response) on a thread of its own, or here if none can start.
fn respond_from_own_thread(send: Box<dyn FnOnce() + Send>) {
    let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
    let spawned = std::thread::Builder::new()
        .name("rdzv-rpc-respond".into())
        .spawn(move || {
            if let Ok(send) = rx.recv() {
                send();
            }
        });
    match spawned {
        Ok(_) => {
            let _ = tx.send(send);
        }
        Err(e) => {
            tracing::debug!(%e, "no thread for an async response; sent from the I/O thread");
            send();
        }
    }
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
    /// How long the reader spins for the next request after one, from how many came
    /// within the spin.
    request_spin: AdaptiveSpin,
    /// While the thread that reads the lane runs a handler itself: when the run began
    /// ([`StallWatch`]'s clock), or [`TAKEN_OVER`] once another thread reads the lane on
    /// (until that one starts a run of its own); 0 otherwise. A run that ends and finds
    /// anything but its own start here was taken over.
    running: AtomicU64,
    /// What it serves requests with.
    server: Arc<Server>,
    /// The peer's worker id.
    peer_id: WorkerId,
    /// `RpcOptions::wait_spin`.
    spin: Duration,
    /// Where requests for the pool go; let go when the lane ends.
    jobs: Mutex<Option<Sender<Job>>>,
}

impl InboundLane {
    /// Inbound lane `id` from `peer` over `connection` (its reader not started yet),
    /// serving with `server` (non-inline requests through `jobs`); `spin`: how long its
    /// reader spins for the next request.
    pub(super) fn new(
        (id, (peer, peer_id)): (u64, (String, WorkerId)),
        negotiated: Negotiated,
        connection: Connection,
        (shared, server, spin): (Shared<'_>, &Arc<Server>, Duration),
        jobs: Sender<Job>,
    ) -> Arc<InboundLane> {
        Arc::new(InboundLane {
            io: LaneIo::new((id, peer), negotiated, connection, Role::Listener, shared),
            machine: Mutex::new(InboundPipe::new()),
            request_spin: AdaptiveSpin::default(),
            running: AtomicU64::new(0),
            server: Arc::clone(server),
            peer_id,
            spin,
            jobs: Mutex::new(Some(jobs)),
        })
    }

    /// Whether the reader runs a handler itself now (and no other thread reads on yet).
    pub(super) fn runs_handler(&self) -> bool {
        !matches!(self.running.load(Ordering::SeqCst), 0 | TAKEN_OVER)
    }

    /// When the reader's handler has run for `stall` nanoseconds by `now`: marks the
    /// lane as read on by another thread, which the caller then starts (or, if it cannot,
    /// ends the lane).
    pub(super) fn take_over(&self, now: u64, stall: u64) -> bool {
        let since = self.running.load(Ordering::SeqCst);
        if matches!(since, 0 | TAKEN_OVER) || now.saturating_sub(since) < stall {
            return false;
        }
        self.running
            .compare_exchange(since, TAKEN_OVER, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
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

    /// The reader thread: serves the peer's requests until the pipe fails, closes or
    /// says goodbye, then ends the lane; or, if another thread took over its reading
    /// while it ran a handler, returns once the handler did. Spinning for `wait_spin`
    /// after each frame answers a waiting caller without a wake-up on this side.
    pub(super) fn serve(self: &Arc<Self>) {
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(jobs) = jobs else {
            return self.end();
        };
        'read: loop {
            let waiting = Instant::now();
            let spun = self.request_spin.spin(self.spin);
            let next = self.io.next_frame(spun);
            self.request_spin.record(spun, waiting.elapsed());
            let frame = match next {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    if !self.server.runner.gate.is_shutting_down() {
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
            let mut taken_over = false;
            for event in events {
                match event {
                    InboundEvent::Request { .. } => {
                        if let Some(frame) = frame.take() {
                            taken_over |= self.serve_request(&jobs, frame);
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
            if taken_over {
                // Another thread reads the lane now, and ends it.
                return;
            }
        }
        self.end();
    }

    /// Serves a request that arrived on this lane: a `to_here` goes to the RRef runtime,
    /// which answers it from here or once its value exists; an inline handler (or a
    /// `remote()` of one) runs here, after its tensors are pulled, and its response goes
    /// out from here; a handler that runs on readers (or a `remote()` of one) runs here
    /// too if a worker slot is free; any other goes to the worker pool, which pulls the
    /// tensors and answers through the job's [`Responder`]. A request whose tensors
    /// cannot be read at all (a channel that was not negotiated, a bad descriptor) fails
    /// at once; with the pool gone the caller learns that this worker shut down.
    /// `true` when another thread took over reading this lane while the handler ran
    /// here.
    fn serve_request(self: &Arc<Self>, jobs: &Sender<Job>, frame: IncomingFrame) -> bool {
        let (io, server) = (&self.io, &*self.server);
        let runner = &*server.runner;
        let (negotiated, reader, peer) = (&io.negotiated, &io.reader, io.peer.as_str());
        let respond = |id, result| self.respond(id, result);
        let ctx = CallContext {
            caller: peer.to_string(),
            caller_id: self.peer_id,
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
                Err(e) => {
                    respond(ctx.message_id, Err(e.to_string()));
                    return false;
                }
            };
        runner.gate.server_call_started();
        if ctx.handler == handler::FETCH {
            // Answered now or when its value is stored: it never needs the pool. (A value
            // already there is copied here: for a large tensor this lane reads its next
            // frame after that copy.)
            let (lane, id) = (Arc::clone(self), ctx.message_id);
            let respond = Box::new(move |result| lane.respond(id, result));
            server.rrefs.fetch_arrived(&message.payload, respond);
            return false;
        }
        let remote = ctx.handler == handler::REMOTE;
        if remote {
            Arc::clone(&server.rrefs).remote_call_arrived(self.peer_id, &message.payload);
        }
        // Where the handler runs; a `remote()` runs where its handler would.
        let placed = |name: &str| runner.registry.handler(name).map(|h| placement(h.as_ref()));
        let placement = if remote {
            RemoteCallHeader::split(&message.payload)
                .ok()
                .and_then(|(header, _)| placed(&header.handler))
        } else {
            placed(&ctx.handler)
        };
        if placement == Some(Placement::Inline) {
            if let Some(handler) = runner.registry.handler(&ctx.handler) {
                let message_id = ctx.message_id;
                let result = tensors
                    .pull()
                    .map_err(|e| e.to_string())
                    .and_then(|tensors| {
                        run_handler(handler.as_ref(), &ctx, Message { tensors, ..message })
                    });
                runner.gate.server_call_finished();
                respond(message_id, result);
                return false;
            }
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
        if placement == Some(Placement::Reader) && runner.slots.try_take() {
            return self.run_here(job);
        }
        if let Err(job) = jobs.send(job) {
            runner.gate.server_call_finished();
            let name = runner.name.clone();
            respond(
                job.0.ctx.message_id,
                Err(CallError::ShutDown { name }.to_string()),
            );
        }
        false
    }

    /// Runs `job` on this reader, in the worker slot it took, watched: if it runs past
    /// [`STALL`], another thread reads the lane on. `true` when one did.
    fn run_here(self: &Arc<Self>, job: Job) -> bool {
        let stall = &self.server.stall;
        let since = stall.now();
        self.running.store(since, Ordering::SeqCst);
        stall.arm();
        // It may block: this lane is read on meanwhile if it does.
        off_io_thread(|| job.run(&self.server.runner));
        self.server.runner.slots.give();
        // Still this run's mark: no other thread reads on, and none will for this run.
        // Anything else (taken over, or the next reader's own run) means one does.
        self.running
            .compare_exchange(since, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
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
        // The pool ends once every lane and the I/O thread let go of its queue.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}
