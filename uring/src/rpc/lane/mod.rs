//! Pipes served by threads ("lanes"): the fast path of a call.
//!
//! Once a pipe's handshake is done, its connection ([`Connection`]: tcp's blocking socket,
//! shm's rings, ibv's queues to its link thread) becomes a lane, of one of two types:
//!
//! * a [`ClientLane`] (this worker opened the pipe to call the peer): a caller's thread
//!   encodes and sends its own request under the lane's send lock (no hand-off to the
//!   I/O thread and no wake-up of it); a caller waiting in `rpc_sync` then reads the
//!   lane itself (a non-blocking `recv`, or the shm ring) for `RpcOptions::wait_spin`
//!   (while this lane's replies typically come within it: [`spin`]), while the lane's
//!   reader thread sleeps on its
//!   [`Control`](super::transport::Control) without holding the receiver, so the reply
//!   costs no thread wake-up at all; the reader thread completes the calls other
//!   replies answer (async calls, and sync ones past their spin);
//! * an [`InboundLane`] (the peer opened it to call this worker): its reader thread
//!   spins for `wait_spin` after each request (while requests typically follow within
//!   it), runs [`Inline`](super::Inline) handlers
//!   right away and sends their responses itself, runs handlers that
//!   [`run on readers`](super::Handler::runs_on_reader) (Python's) itself too when one of
//!   the `num_worker_threads` worker slots is free (a watcher thread starts another
//!   reader for the lane if one runs past [`STALL`]), and hands other requests to the
//!   worker pool, whose thread sends the response itself.
//!
//! Each owns its side of the pipe's protocol, the core's `rdzv_core::rpc::pipe` machine
//! ([`ClientPipe`](rdzv_core::rpc::pipe::ClientPipe) or
//! [`InboundPipe`](rdzv_core::rpc::pipe::InboundPipe)), over one shared I/O struct
//! ([`LaneIo`]), so a lane cannot be asked to do the other side's work. So a small call
//! costs what a plain ping-pong costs, instead of six thread hand-offs through the
//! executor. Nothing waits in a cycle: reader threads never wait for anything but their
//! receiver and their own lane's send lock, and a send only waits for the peer's
//! reader.
//!
//! Out-of-band tensors (cma, xth): a lane keeps what it lends until the reply (requests) or
//! the caller's `Ack` (responses), in its machine's ledger, and pulls what it is lent on
//! the thread that received the frame. `mpt` (see [`super::mpt`]): a tcp lane that
//! negotiated it pushes a frame's mpt tensors on its mpt connections under its send lock,
//! right after the frame, and reads them under its receive lock as soon as it has the
//! frame.
//!
//! Lanes share the [`Calls`](super::calls::Calls) table and timer with the calls still
//! waiting for their pipe to open. A lane that fails fails the calls sent on it and
//! leaves the registry; the next call opens a new pipe through the executor. Fault
//! injection wraps a client lane's sender (`super::faults`), so faulty workers run
//! lanes too.
//!
//! | file | does |
//! |---|---|
//! | `io` | [`LaneIo`]: the connection's halves, mpt connections, sending a frame, the reader's next frame, a caller reading the lane; the [`LaneRegistry`] seam an ending lane leaves by |
//! | `client` | [`ClientLane`]: requests from callers' threads, a caller reading its own reply, replies completing calls, acks |
//! | `inbound` | [`InboundLane`]: serving requests (inline handlers, handlers run on the reader, [`Job`]s for the pool, [`Responder`]), responses, the worker slots ([`Slots`]) |
//! | this one | the registry of lanes ([`Lanes`]), [`LaneContext`] (what starting a lane takes), starting a lane and its reader thread, the stall watcher ([`watch_stalls`]) |
//!
//! The files form layers: `io` below `client` and `inbound`, which know nothing of
//! each other, and this one on top (`uring/tests/rpc_layering.rs` checks it).

use crossbeam_channel::Sender;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rdzv_core::negotiate::Negotiated;
use rdzv_core::rpc::name::WorkerId;

use super::calls::Calls;
use super::device::Devices;
use super::error::PipeFailure;
use super::faults::Faults;
use super::message::mark_io_thread;
use super::mpt::{MptConnections, MptSetup};
use super::outgoing::Framer;
use super::transport::Connection;

mod client;
mod inbound;
mod io;
mod spin;
pub(crate) use client::ClientLane;
pub(crate) use inbound::{InboundLane, Job, Runner, Server, Slots, StallWatch, STALL};
use io::{LaneIo, LaneRegistry, Shared};

/// What starting a lane takes, assembled once by start-up: the registry of lanes, the
/// calls in flight and frame building, which each lane keeps from its start (so a lane
/// sends, answers and ends with nothing passed in), the device runtimes, the mpt
/// listener, fault injection and the spin. What serving a request needs beyond that
/// (the handlers, the call counts, the RRef runtime, the client handlers call through)
/// is [`Server`]'s; the group, the mailbox and message ids are the dispatcher's, a
/// layer up.
pub(crate) struct LaneContext {
    /// Every call in flight, and their timer.
    pub calls: Arc<Calls>,
    /// Builds outgoing frames; each lane holds it from its start.
    pub framer: Arc<Framer>,
    /// The pipes served by threads (each lane holds it weakly, to leave it).
    pub lanes: Arc<Mutex<Lanes>>,
    /// Faults to inject into client lanes' requests (tests), if any.
    pub faults: Option<Arc<Faults>>,
    /// The mpt stripe listener and stripe count, when this worker offers mpt.
    pub mpt: Option<Arc<MptSetup>>,
    /// The device runtimes (they lend, borrow and stage device memory).
    pub devices: Devices,
    /// `RpcOptions::wait_spin`.
    pub wait_spin: Duration,
}

impl LaneContext {
    /// What every lane started from this context shares.
    fn shared(&self) -> Shared<'_> {
        let lanes: Weak<Mutex<Lanes>> = Arc::downgrade(&self.lanes);
        let registry: Weak<dyn LaneRegistry> = lanes;
        Shared {
            calls: &self.calls,
            framer: &self.framer,
            devices: &self.devices,
            registry,
        }
    }
}

/// Every lane of a worker.
#[derive(Default)]
pub(crate) struct Lanes {
    /// Client lanes, by destination name.
    client: HashMap<String, Arc<ClientLane>>,
    /// Inbound lanes, by pipe id.
    inbound: HashMap<u64, Arc<InboundLane>>,
    /// Set at close: no lane starts after it.
    closed: bool,
}

impl Lanes {
    /// The client lane to `peer`.
    pub(crate) fn client(&self, peer: &str) -> Option<Arc<ClientLane>> {
        self.client.get(peer).cloned()
    }

    /// Closes the registry and takes every lane out.
    pub(crate) fn close(&mut self) -> TakenLanes {
        self.closed = true;
        self.drain()
    }

    /// Takes every lane out; later lanes may start (pipes reset).
    pub(crate) fn drain(&mut self) -> TakenLanes {
        TakenLanes {
            client: self.client.drain().map(|(_, l)| l).collect(),
            inbound: self.inbound.drain().map(|(_, l)| l).collect(),
        }
    }
}

impl LaneRegistry for Mutex<Lanes> {
    fn leave_client(&self, peer: &str, id: u64) {
        let mut lanes = lock(self);
        if lanes.client.get(peer).is_some_and(|l| l.io.id == id) {
            lanes.client.remove(peer);
        }
    }

    fn leave_inbound(&self, id: u64) {
        let mut lanes = lock(self);
        if lanes.inbound.get(&id).is_some_and(|l| l.io.id == id) {
            lanes.inbound.remove(&id);
        }
    }
}

/// Lanes taken out of the registry (at close or a reset), client lanes first.
#[derive(Clone)]
pub(crate) struct TakenLanes {
    client: Vec<Arc<ClientLane>>,
    inbound: Vec<Arc<InboundLane>>,
}

impl TakenLanes {
    pub(crate) fn is_empty(&self) -> bool {
        self.client.is_empty() && self.inbound.is_empty()
    }

    /// Each lane says goodbye (graceful shutdown).
    pub(crate) fn goodbye(&self) {
        self.client.iter().for_each(|lane| lane.goodbye());
        self.inbound.iter().for_each(|lane| lane.goodbye());
    }

    /// Each lane's connection stops; its reader thread ends it.
    pub(crate) fn stop(&self) {
        self.client.iter().for_each(|lane| lane.stop());
        self.inbound.iter().for_each(|lane| lane.stop());
    }

    /// Each lane ends now; the calls sent on client lanes fail with `reason`.
    pub(crate) fn end(&self, reason: &PipeFailure) {
        self.client.iter().for_each(|lane| lane.end(reason.clone()));
        self.inbound.iter().for_each(|lane| lane.end());
    }
}

/// The registry of lanes, locked.
pub(crate) fn lock(lanes: &Mutex<Lanes>) -> MutexGuard<'_, Lanes> {
    lanes.lock().unwrap_or_else(|p| p.into_inner())
}

/// The client lane to `to`, if there is one.
pub(crate) fn client_lane(lanes: &Mutex<Lanes>, to: &str) -> Option<Arc<ClientLane>> {
    lock(lanes).client(to)
}

/// A lane's reader thread could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start its reader thread: {0}")]
struct ReaderThreadError(#[source] std::io::Error);

/// Starts client lane `id` to `peer` and its reader thread; `None` (the halves
/// dropped, the connection closed) when the registry is closed or the thread cannot
/// start.
pub(crate) fn start_client(
    ctx: &LaneContext,
    (id, peer): (u64, String),
    negotiated: Negotiated,
    connection: Connection,
    connections: Option<MptConnections>,
) -> Option<Arc<ClientLane>> {
    let mut connection = connection;
    if let Some(faults) = &ctx.faults {
        connection.sender = faults.wrap(connection.sender);
    }
    let lane = ClientLane::new(
        (id, peer),
        negotiated,
        connection,
        connections,
        ctx.shared(),
    );
    let registered = Arc::clone(&lane);
    if !register(ctx, &lane.io, |lanes| {
        lanes.client.insert(registered.io.peer.clone(), registered);
    }) {
        return None;
    }
    let (reader, spin) = (Arc::clone(&lane), ctx.wait_spin);
    match spawn_reader(id, move || reader.read(spin)) {
        Ok(()) => Some(lane),
        Err(e) => {
            lane.end(PipeFailure::local(e));
            None
        }
    }
}

/// Starts inbound lane `id` from `peer` and its reader thread, which serves the peer's
/// requests with `server` (non-inline ones through `jobs`). With `mpt_token`, the
/// reader first claims the pipe's mpt connections that the peer opened with that token.
pub(crate) fn start_inbound(
    (ctx, server): (&LaneContext, &Arc<Server>),
    (id, peer): (u64, (String, WorkerId)),
    negotiated: Negotiated,
    connection: Connection,
    jobs: Sender<Job>,
    mpt_token: Option<u64>,
) {
    let shared = (ctx.shared(), server, ctx.wait_spin);
    let lane = InboundLane::new((id, peer), negotiated, connection, shared, jobs);
    let registered = Arc::clone(&lane);
    if !register(ctx, &lane.io, |lanes| {
        lanes.inbound.insert(id, registered);
    }) {
        return;
    }
    // The mpt listener, which only a lane that negotiated mpt reads.
    let mpt = mpt_token.and(ctx.mpt.clone());
    let reader = Arc::clone(&lane);
    let spawned = spawn_reader(id, move || {
        if let Some(token) = mpt_token {
            if let Err(reason) = reader.claim_connections(mpt.as_deref(), token) {
                tracing::warn!(peer = %reader.io.peer, %reason, "an inbound RPC pipe's mpt connections did not arrive");
                return reader.end();
            }
        }
        reader.serve();
    });
    if spawned.is_err() {
        lane.end();
    }
}

/// How often the watcher looks at readers running handlers, while some do.
const STALL_TICK: Duration = Duration::from_millis(1);
/// How long the watcher sleeps while no reader runs a handler, between checks that the
/// agent is still there.
const STALL_IDLE: Duration = Duration::from_secs(1);

/// Starts the thread that watches inbound lanes whose reader runs a handler itself
/// ([`Handler::runs_on_reader`](crate::rpc::Handler::runs_on_reader)): one whose handler
/// has run past [`STALL`] gets a new reader thread, so that its next requests are read
/// (and the calls they answer complete) while that handler blocks. It sleeps while no
/// reader runs a handler, and ends soon after the agent.
pub(crate) fn watch_stalls(ctx: &LaneContext, server: &Arc<Server>) -> std::io::Result<()> {
    let lanes = Arc::downgrade(&ctx.lanes);
    let weak = Arc::downgrade(server);
    let watcher = std::thread::Builder::new()
        .name("rdzv-rpc-stalls".into())
        .spawn(move || watch(&lanes, &weak))?;
    server.stall.set_watcher(watcher.thread().clone());
    Ok(())
}

/// The watcher's loop (see [`watch_stalls`]).
fn watch(lanes: &Weak<Mutex<Lanes>>, server: &Weak<Server>) {
    let stall = u64::try_from(STALL.as_nanos()).unwrap_or(u64::MAX);
    let running = |lanes: &Mutex<Lanes>| -> Vec<Arc<InboundLane>> {
        lock(lanes)
            .inbound
            .values()
            .filter(|lane| lane.runs_handler())
            .cloned()
            .collect()
    };
    loop {
        let armed = match server.upgrade() {
            Some(server) => server.stall.is_armed(),
            None => return,
        };
        if !armed {
            std::thread::park_timeout(STALL_IDLE);
            continue;
        }
        std::thread::sleep(STALL_TICK);
        let (Some(server), Some(lanes)) = (server.upgrade(), lanes.upgrade()) else {
            return;
        };
        let busy = running(&lanes);
        let now = server.stall.now();
        for lane in &busy {
            if !lane.take_over(now, stall) {
                continue;
            }
            tracing::debug!(peer = %lane.io.peer, "a handler run by an inbound RPC pipe's reader passed {STALL:?}; another thread reads the pipe on");
            let reader = Arc::clone(lane);
            if let Err(e) = spawn_reader(lane.io.id, move || reader.serve()) {
                // Its reader leaves once its handler returns: the pipe closes, the
                // peer's calls on it fail naming this worker, and its next call opens a
                // new one.
                tracing::warn!(peer = %lane.io.peer, error = %e, "no thread to read an inbound RPC pipe on while its handler runs; the pipe is closed");
                lane.end();
            }
        }
        if busy.is_empty() {
            // A run that began before this is seen below; one after it wakes the watcher.
            server.stall.disarm();
            if !running(&lanes).is_empty() {
                server.stall.rearm();
            }
        }
    }
}

/// Registers a lane (with `register`) unless the registry is closed; `false` (the
/// lane's connection stopped) when it is.
fn register(ctx: &LaneContext, io: &LaneIo, register: impl FnOnce(&mut Lanes)) -> bool {
    let mut lanes = lock(&ctx.lanes);
    if lanes.closed {
        io.stop();
        return false;
    }
    register(&mut lanes);
    true
}

/// Starts lane `id`'s reader thread running `read`.
fn spawn_reader(id: u64, read: impl FnOnce() + Send + 'static) -> Result<(), ReaderThreadError> {
    std::thread::Builder::new()
        .name(format!("rdzv-rpc-lane-{id}"))
        .spawn(move || {
            mark_io_thread();
            read();
        })
        .map(drop)
        .map_err(ReaderThreadError)
}
