//! Pipes served by threads ("lanes"): the fast path of a call.
//!
//! Once a pipe's handshake is done, its connection ([`Connection`]: tcp's blocking socket,
//! shm's rings, ibv's queues to its link thread) becomes a lane:
//!
//! * a caller's thread encodes and sends its own request under the lane's send lock:
//!   no hand-off to the I/O thread and no wake-up of it;
//! * a caller waiting in `rpc_sync` then reads the lane itself (a non-blocking `recv`,
//!   or the shm ring) for `RpcOptions::wait_spin`, while the lane's reader thread sleeps
//!   on its [`Control`] without holding the receiver; the reply then costs no
//!   thread wake-up at all;
//! * the reader thread receives everything else: on a client lane it completes the
//!   calls replies answer (async calls, and sync ones past their spin); on an inbound
//!   lane it spins for `wait_spin` after each request, runs [`Inline`](super::Inline)
//!   handlers right away and sends their responses itself, and hands other requests to
//!   the worker pool, whose thread sends the response itself.
//!
//! So a small call costs what a plain ping-pong costs, instead of six thread hand-offs
//! through the executor. Nothing waits in a cycle: reader threads never wait for
//! anything but their receiver and their own lane's send lock, and a send only waits
//! for the peer's reader.
//!
//! Each lane feeds the frames it reads to its side of the pipe's protocol, the core's
//! `rdzv_core::rpc::pipe` machine ([`ClientPipe`] or [`InboundPipe`]), and executes
//! what it says: which reply completes which call, which buffers come back, what to
//! ack. Out-of-band tensors (cma, xth): a lane keeps what it lends until the reply
//! (requests) or the caller's `Ack` (responses), in its machine's ledger, and pulls
//! what it is lent on the thread that received the frame. `mpt` (see [`super::mpt`]):
//! a tcp lane that negotiated it pushes a frame's mpt tensors on its mpt
//! lanes under its send lock, right after the frame, and reads them under its receive
//! lock as soon as it has the frame.
//!
//! Lanes share the [`Calls`](super::calls::Calls) table and timer with the calls still
//! waiting for their pipe to open. A lane that fails fails the calls sent on it and
//! leaves the registry; the next call opens a new pipe through the executor. Fault injection wraps a client lane's sender
//! (`super::faults`), so faulty workers run lanes too.
//!
//! | file | does |
//! |---|---|
//! | this one | the [`Lane`], its pipe machine, the registry of lanes ([`Lanes`]), starting a lane's reader thread and ending a lane |
//! | `send` | requests from callers' threads, responses, the protocol's acks and goodbyes |
//! | `receive` | the reader's next frame, a caller reading its own reply, a client lane's replies |
//! | `serve` | an inbound lane's requests: inline handlers, [`Job`]s for the pool, [`Responder`] |
//! | `context` | [`LaneContext`], what starting a lane takes (the registry of lanes, the calls in flight, the framer, devices, mpt, faults, the spin); a lane keeps the registry (weakly), the calls and the framer, so it sends, answers and ends with nothing passed in |

use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::pipe::{ClientPipe, InboundPipe, Transmit};

use super::calls::Calls;
use super::device::Devices;
use super::error::TransportError;
use super::error::{CallError, PipeFailure};
use super::message::mark_io_thread;
use super::mpt::{LanesError, MptLanes, MptSetup, LANES_TIMEOUT};
use super::outgoing::Framer;
use super::tensors::{cpu_channel, FrameExports, PipeReader};
use super::transport::{Connection, Control, FrameReceiver, FrameSender, IncomingFrame};

mod context;
mod receive;
mod send;
mod serve;
pub(crate) use context::LaneContext;
use receive::client_reader;
use serve::inbound_reader;
pub(crate) use serve::{Job, Responder, Server};

/// How long a polled lane's reader sleeps before it looks again; it wakes at once on
/// the peer's signal, a kick, the peer's end or a stop, so this only bounds the cost of
/// a missed signal.
const WAKE_POLL: Duration = Duration::from_millis(100);

/// One thread-served pipe.
pub(crate) struct Lane {
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
    reader: Arc<PipeReader>,
    /// The worker's device runtimes (mpt reads device tensors' stripes into them).
    devices: Devices,
    /// Builds the frames this lane sends (requests and responses).
    framer: Arc<Framer>,
    /// The calls in flight: those sent on this lane wait there for their reply.
    calls: Arc<Calls>,
    /// The registry of lanes, which this lane leaves when it ends.
    registry: Weak<Mutex<Lanes>>,
    /// The pipe's protocol (core's `rpc::pipe`): which replies reach a call, what is
    /// acked, and the buffers lent to the peer until their reply or ack (given up when
    /// the lane ends).
    machine: Mutex<Machine>,
    /// The side this lane plays in its pipe's negotiation.
    role: Role,
    /// The pipe's mpt lanes, when it negotiated mpt (set before the first frame is
    /// read or sent with mpt tensors).
    mpt: OnceLock<MptLanes>,
}

/// Why a lane could not send a frame.
enum SendFailure {
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

/// A lane's reader thread could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start its reader thread: {0}")]
struct ReaderThreadError(#[source] std::io::Error);

/// A frame for the other side of a pipe reached a lane (a bug of this runtime).
#[derive(Debug, thiserror::Error)]
#[error("a client frame on an inbound lane")]
struct WrongSide;

/// A lane's side of its pipe's protocol.
enum Machine {
    Client(ClientPipe<FrameExports>),
    Inbound(InboundPipe<FrameExports>),
}

impl Machine {
    fn is_ended(&self) -> bool {
        match self {
            Machine::Client(pipe) => pipe.is_ended(),
            Machine::Inbound(pipe) => pipe.is_ended(),
        }
    }

    /// The frames the protocol owes the peer.
    fn transmits(&mut self) -> Vec<Transmit> {
        let mut out = Vec::new();
        loop {
            let next = match self {
                Machine::Client(pipe) => pipe.poll_transmit(),
                Machine::Inbound(pipe) => pipe.poll_transmit(),
            };
            match next {
                Some(transmit) => out.push(transmit),
                None => return out,
            }
        }
    }
}

/// Every lane of a worker.
#[derive(Default)]
pub(crate) struct Lanes {
    /// Client lanes, by destination name.
    client: HashMap<String, Arc<Lane>>,
    /// Inbound lanes, by pipe id.
    inbound: HashMap<u64, Arc<Lane>>,
    /// Set at close: no lane starts after it.
    closed: bool,
}

impl Lanes {
    /// The client lane to `peer`.
    pub(crate) fn client(&self, peer: &str) -> Option<Arc<Lane>> {
        self.client.get(peer).cloned()
    }

    /// Closes the registry and takes every lane out (client lanes first).
    pub(crate) fn close(&mut self) -> Vec<Arc<Lane>> {
        self.closed = true;
        let mut all: Vec<Arc<Lane>> = self.client.drain().map(|(_, l)| l).collect();
        all.extend(self.inbound.drain().map(|(_, l)| l));
        all
    }

    /// Takes every lane out; later lanes may start (pipes reset).
    pub(crate) fn drain(&mut self) -> Vec<Arc<Lane>> {
        let mut all: Vec<Arc<Lane>> = self.client.drain().map(|(_, l)| l).collect();
        all.extend(self.inbound.drain().map(|(_, l)| l));
        all
    }
}

/// The registry of lanes, locked.
pub(crate) fn lock(lanes: &Mutex<Lanes>) -> MutexGuard<'_, Lanes> {
    lanes.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    fn new(
        id: u64,
        peer: String,
        negotiated: Negotiated,
        connection: Connection,
        ctx: &LaneContext,
        role: Role,
    ) -> Arc<Lane> {
        let Connection {
            sender,
            receiver,
            control,
            ..
        } = connection;
        Arc::new(Lane {
            id,
            peer,
            negotiated,
            sender: Mutex::new(sender),
            receiver: Mutex::new(receiver),
            control,
            reader: Arc::new(PipeReader::default()),
            devices: ctx.devices.clone(),
            framer: Arc::clone(&ctx.framer),
            calls: Arc::clone(&ctx.calls),
            registry: Arc::downgrade(&ctx.lanes),
            machine: Mutex::new(match role {
                Role::Connector => Machine::Client(ClientPipe::new()),
                Role::Listener => Machine::Inbound(InboundPipe::new()),
            }),
            role,
            mpt: OnceLock::new(),
        })
    }

    /// Whether this lane streams tensors over mpt lanes.
    fn streams(&self) -> bool {
        self.mpt.get().is_some()
    }

    /// Reads the mpt tensors of `frame`, just received under the receive lock.
    fn fill(&self, frame: &mut IncomingFrame) -> Result<(), TransportError> {
        let Some(mpt) = self.mpt.get() else {
            // Refused per tensor when the frame is served: no lane carries them.
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

    fn machine(&self) -> MutexGuard<'_, Machine> {
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the lane ended: a pull that overlapped its end may have read buffers
    /// the peer released.
    fn is_ended(&self) -> bool {
        self.machine().is_ended()
    }

    /// The name of the channel this lane uses for CPU tensors, for errors.
    fn channel_name(&self, role: Role) -> &'static str {
        cpu_channel(&self.negotiated, role).map_or("basic", |c| c.name())
    }

    /// Starts client lane `id` to `peer` and its reader thread; `None` (the halves
    /// dropped, the connection closed) when the registry is closed or the thread cannot
    /// start.
    pub(crate) fn start_client(
        ctx: &LaneContext,
        id: u64,
        peer: String,
        negotiated: Negotiated,
        connection: Connection,
        mpt: Option<MptLanes>,
    ) -> Option<Arc<Lane>> {
        let mut connection = connection;
        if let Some(faults) = &ctx.faults {
            connection.sender = faults.wrap(connection.sender);
        }
        let lane = Lane::new(id, peer, negotiated, connection, ctx, Role::Connector);
        if let Some(mpt) = mpt {
            let _ = lane.mpt.set(mpt);
        }
        let registered = Arc::clone(&lane);
        Lane::start(
            ctx,
            &lane,
            move |lanes| lanes.client.insert(registered.peer.clone(), registered),
            client_reader,
        )
        .then_some(lane)
    }

    /// Starts inbound lane `id` from `peer` and its reader thread, which serves the
    /// peer's requests with `server` (non-inline ones through `jobs`). With `mpt_token`,
    /// the reader first claims the pipe's mpt lanes that the peer opened with that token.
    pub(crate) fn start_inbound(
        (ctx, server): (&LaneContext, &Arc<Server>),
        id: u64,
        peer: (String, WorkerId),
        negotiated: Negotiated,
        connection: Connection,
        jobs: Sender<Job>,
        mpt_token: Option<u64>,
    ) {
        let (name, peer_id) = peer;
        let lane = Lane::new(id, name, negotiated, connection, ctx, Role::Listener);
        let registered = Arc::clone(&lane);
        let server = Arc::clone(server);
        let spin = ctx.wait_spin;
        // The mpt listener, which only a lane that negotiated mpt reads.
        let mpt = mpt_token.and(ctx.mpt.clone());
        Lane::start(
            ctx,
            &lane,
            move |lanes| lanes.inbound.insert(id, registered),
            move |lane| {
                if let Some(token) = mpt_token {
                    if let Err(reason) = lane.claim_mpt(mpt.as_deref(), token) {
                        tracing::warn!(peer = %lane.peer, %reason, "an inbound RPC pipe's mpt lanes did not arrive");
                        return lane.end(PipeFailure::local(reason));
                    }
                }
                inbound_reader(&server, spin, lane, peer_id, &jobs);
            },
        );
    }

    /// Takes the mpt lanes the peer opened for this pipe with `token`.
    fn claim_mpt(&self, setup: Option<&MptSetup>, token: u64) -> Result<(), LanesError> {
        let Some(setup) = setup else {
            return Err(LanesError::NoListener);
        };
        let streams = setup
            .listener
            .claim(token, LANES_TIMEOUT)
            .map_err(|source| LanesError::Claim { source })?;
        let lanes = MptLanes::new(streams)?;
        if self.is_ended() {
            lanes.shutdown();
            return Err(LanesError::PipeEnded);
        }
        let _ = self.mpt.set(lanes);
        Ok(())
    }

    /// Registers `lane` (with `register`, unless the registry is closed) and starts its
    /// reader thread running `read`; `false` (the lane stopped) when either fails.
    fn start(
        ctx: &LaneContext,
        lane: &Arc<Lane>,
        register: impl FnOnce(&mut Lanes) -> Option<Arc<Lane>>,
        read: impl FnOnce(&Arc<Lane>) + Send + 'static,
    ) -> bool {
        {
            let mut lanes = lock(&ctx.lanes);
            if lanes.closed {
                lane.control.stop();
                return false;
            }
            register(&mut lanes);
        }
        let thread_lane = Arc::clone(lane);
        let spawned = std::thread::Builder::new()
            .name(format!("rdzv-rpc-lane-{}", lane.id))
            .spawn(move || {
                mark_io_thread();
                read(&thread_lane);
            });
        match spawned {
            Ok(_) => true,
            Err(e) => {
                lane.end(PipeFailure::local(ReaderThreadError(e)));
                false
            }
        }
    }

    /// Ends the connection; the reader thread sees it and cleans up.
    pub(crate) fn stop(&self) {
        self.control.stop();
        if let Some(mpt) = self.mpt.get() {
            mpt.shutdown();
        }
    }

    /// The lane failed or closed: it leaves the registry (if it is still there), its
    /// connection stops and the calls sent on it fail with `reason`.
    pub(crate) fn end(&self, reason: PipeFailure) {
        // Gone only with the agent's lane context, whose registry is then gone too.
        if let Some(registry) = self.registry.upgrade() {
            let mut lanes = lock(&registry);
            if lanes
                .client
                .get(&self.peer)
                .is_some_and(|l| l.id == self.id)
            {
                lanes.client.remove(&self.peer);
            }
            if lanes.inbound.get(&self.id).is_some_and(|l| l.id == self.id) {
                lanes.inbound.remove(&self.id);
            }
        }
        let ended = match &mut *self.machine() {
            Machine::Client(pipe) => pipe.end(),
            Machine::Inbound(pipe) => pipe.end(),
        };
        self.stop();
        // Given up last: the peer can no longer ask for them.
        drop(ended.lent);
        for pending in self.calls.take_pipe(self.id) {
            let error = CallError::PipeBroken {
                peer: self.peer.clone(),
                reason: reason.clone(),
            };
            self.calls.fail(pending, error);
        }
    }
}

/// The client lane to `to`, if calls may take it (every tensor of `message` must go on
/// the `basic` channel, which a lane carries in its frames).
pub(crate) fn client_lane(lanes: &Mutex<Lanes>, to: &str) -> Option<Arc<Lane>> {
    lock(lanes).client(to)
}
