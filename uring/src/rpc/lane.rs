//! Pipes served by threads ("lanes"): the fast path of a call.
//!
//! Once a pipe's handshake is done on the I/O executor, its transport hands its halves
//! over ([`FrameSender::into_blocking`](super::transport::FrameSender::into_blocking):
//! tcp over a duplicated socket, shm's rings, ibv's queues to its link thread) and the
//! pipe becomes a lane:
//!
//! * a caller's thread encodes and sends its own request under the lane's send lock:
//!   no hand-off to the I/O thread and no wake-up of it;
//! * a caller waiting in `rpc_sync` then reads the lane itself (a non-blocking `recv`,
//!   or the shm ring) for `RpcOptions::wait_spin`, while the lane's reader thread sleeps
//!   in `poll(2)` without holding the receiver ([`Wake`]); the reply then costs no
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

use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::frame::{FrameKind, FrameLimits};
use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::pipe::{
    ClientEvent, ClientPipe, Closed, InboundEvent, InboundPipe, PipeFrame, ReadError, Refusal,
    Transmit,
};

use super::calls::{Pending, Reply};
use super::channels::{cpu_channel, FrameExports, PipeReader, ReceivedTensors, Streamed};
use super::client::{Caller, RpcClient};
use super::error::RpcError;
use super::error::TransportError;
use super::handler::{run_handler, CallContext};
use super::mailbox::Call;
use super::message::Completion;
use super::message::{mark_io_thread, Message};
use super::mpt::{MptLanes, LANES_TIMEOUT};
use super::outgoing::{response_frame, sent_bytes, tensor_frame};
use super::recycle;
use super::transport::{
    BlockingHalves, BlockingReceiver, BlockingSender, IncomingFrame, OwnedFrame, StopConnection,
    TryRecv, Wake,
};

mod shared;
pub(crate) use shared::Shared;

/// How long a polled lane's reader sleeps before it looks again; it wakes at once on
/// the peer's signal, a kick, the peer's end or a stop, so this only bounds the cost of
/// a missed signal.
const WAKE_POLL: Duration = Duration::from_millis(100);

/// One thread-served pipe.
pub(crate) struct Lane {
    pub id: u64,
    pub peer: String,
    pub negotiated: Negotiated,
    sender: Mutex<Box<dyn BlockingSender>>,
    /// The receiving half: held by the reader thread while it receives, and, on a
    /// polled lane (`wake`), by a caller reading its own reply while the reader sleeps.
    receiver: Mutex<Box<dyn BlockingReceiver>>,
    /// How the reader thread of a polled lane sleeps without holding `receiver`.
    wake: Option<Arc<dyn Wake>>,
    stop: Arc<dyn StopConnection>,
    /// Where the peer's out-of-band tensors are read from.
    reader: Arc<PipeReader>,
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
    Broken(String),
}

impl std::fmt::Display for SendFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendFailure::Injected { handler } => {
                write!(f, "Send attempt failed intentionally for {handler}")
            }
            SendFailure::Broken(reason) => f.write_str(reason),
        }
    }
}

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

fn lanes(shared: &Shared) -> MutexGuard<'_, Lanes> {
    shared.lanes.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    fn new(
        id: u64,
        peer: String,
        negotiated: Negotiated,
        halves: BlockingHalves,
        role: Role,
    ) -> Arc<Lane> {
        let BlockingHalves {
            sender,
            receiver,
            stop,
            wake,
        } = halves;
        Arc::new(Lane {
            id,
            peer,
            negotiated,
            sender: Mutex::new(sender),
            receiver: Mutex::new(receiver),
            wake,
            stop,
            reader: Arc::new(PipeReader::default()),
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
        mpt.fill(frame, &self.negotiated, self.role)
            .map_err(|reason| TransportError::Io {
                op: "receive mpt tensors from",
                peer: self.peer.clone(),
                source: std::io::Error::other(reason),
            })
    }

    /// Whether a waiting caller can read this lane itself.
    pub(crate) fn is_polled(&self) -> bool {
        self.wake.is_some()
    }

    fn receiver(&self) -> MutexGuard<'_, Box<dyn BlockingReceiver>> {
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

    /// Sends what the protocol owes the peer (acks, a goodbye). A lane that cannot send
    /// any more is ending: its end releases what the acks would have.
    fn flush(&self) {
        let transmits = self.machine().transmits();
        self.transmit(transmits);
    }

    /// Sends frames the protocol owes the peer (polled already).
    fn transmit(&self, transmits: Vec<Transmit>) {
        for transmit in transmits {
            let (kind, message_id) = transmit.frame();
            let _ = self.send(OwnedFrame::empty(kind, message_id));
        }
    }

    /// The caller is done with what reply `message_id` lent (read, or never to be
    /// read): the ack goes out, unless the lane ended meanwhile.
    fn done_reading(&self, message_id: u64) -> Result<(), ReadError> {
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

    /// The name of the channel this lane uses for CPU tensors, for errors.
    fn channel_name(&self, role: Role) -> &'static str {
        cpu_channel(&self.negotiated, role).map_or("basic", |c| c.name())
    }

    /// The next frame for the reader thread. A polled lane spins up to `spin` on the
    /// ring, then sleeps on its wake *without* holding the receiver, so that a caller
    /// may read meanwhile; any other lane receives, blocking.
    fn next_frame(&self, spin: Duration) -> Result<Option<IncomingFrame>, TransportError> {
        let Some(wake) = &self.wake else {
            let mut receiver = self.receiver();
            let mut frame = receiver.recv(FrameLimits::DEFAULT)?;
            if let Some(frame) = &mut frame {
                self.fill(frame)?;
            }
            return Ok(frame);
        };
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
                                        "the peer process is gone",
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
    /// at once on a lane that cannot be polled, or when another thread reads.
    pub(crate) fn read_own_reply(&self, shared: &Shared, completion: &Completion, spin: Duration) {
        let Some(wake) = &self.wake else { return };
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
                            ended = Some(e.to_string());
                            break;
                        }
                        if let Some(reason) = self.on_client_frame(shared, frame) {
                            ended = Some(reason);
                            break;
                        }
                    }
                    Ok(TryRecv::Empty) => std::hint::spin_loop(),
                    Ok(TryRecv::Closed) => {
                        ended = Some("the peer closed the pipe".to_string());
                        break;
                    }
                    Err(e) => {
                        ended = Some(e.to_string());
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
                self.end(shared, reason);
            }
            return;
        }
    }

    /// A frame that arrived on this client lane; `Some(reason)` when the lane ends. The
    /// pipe's machine decides (core's `rpc::pipe`): a reply to a call sent on this lane
    /// gives back what its request lent and completes the call; a response's
    /// out-of-band tensors are pulled here, then acked; anything else is dropped (and
    /// acked if it lent buffers).
    fn on_client_frame(&self, shared: &Shared, frame: IncomingFrame) -> Option<String> {
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
                Machine::Inbound(_) => return Some("a client frame on an inbound lane".into()),
            };
            (events, machine.transmits())
        };
        self.transmit(transmits);
        let mut frame = Some(frame);
        for event in events {
            match event {
                ClientEvent::Reply { released, lent, .. } => {
                    if let Some(frame) = frame.take() {
                        self.on_reply(shared, frame, lent);
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
                ClientEvent::Closed(why) => return Some(why.to_string()),
            }
        }
        None
    }

    /// Completes the call reply `frame` answers (if it still waits: it may have timed
    /// out); `lent`: the reply lent buffers, which are pulled (or not) and then acked.
    fn on_reply(&self, shared: &Shared, frame: IncomingFrame, lent: bool) {
        let message_id = frame.message_id;
        let Some(pending) = shared.calls_table.take_reply(message_id, self.id) else {
            tracing::debug!(message_id, "late reply dropped");
            if lent {
                // Nobody reads its tensors: let the callee release them.
                let _ = self.done_reading(message_id);
            }
            return;
        };
        let peer = pending.peer.clone();
        match shared
            .calls_table
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
                    (Err(ReadError::PipeEnded), Ok(_)) => Err(RpcError::Channel {
                        channel: self.channel_name(Role::Connector),
                        peer,
                        reason: ReadError::PipeEnded.to_string(),
                    }),
                    (_, pulled) => pulled,
                };
                shared.calls_table.complete(&completion, pulled);
            }
        }
    }

    /// Starts client lane `id` to `peer` and its reader thread; `None` (the halves
    /// dropped, the connection closed) when the registry is closed or the thread cannot
    /// start.
    pub(crate) fn start_client(
        shared: &Arc<Shared>,
        id: u64,
        peer: String,
        negotiated: Negotiated,
        halves: BlockingHalves,
        mpt: Option<MptLanes>,
    ) -> Option<Arc<Lane>> {
        let mut halves = halves;
        if let Some(faults) = &shared.faults {
            halves.sender = faults.wrap(halves.sender);
        }
        let lane = Lane::new(id, peer, negotiated, halves, Role::Connector);
        if let Some(mpt) = mpt {
            let _ = lane.mpt.set(mpt);
        }
        let registered = Arc::clone(&lane);
        Lane::start(
            shared,
            &lane,
            move |lanes| lanes.client.insert(registered.peer.clone(), registered),
            client_reader,
        )
        .then_some(lane)
    }

    /// Starts inbound lane `id` from `peer` and its reader thread, which serves the
    /// peer's requests (non-inline ones through `jobs`). With `mpt_token`, the reader
    /// first claims the pipe's mpt lanes that the peer opened with that token.
    pub(crate) fn start_inbound(
        shared: &Arc<Shared>,
        id: u64,
        peer: (String, WorkerId),
        negotiated: Negotiated,
        halves: BlockingHalves,
        jobs: Sender<Job>,
        mpt_token: Option<u64>,
    ) {
        let (name, peer_id) = peer;
        let lane = Lane::new(id, name, negotiated, halves, Role::Listener);
        let registered = Arc::clone(&lane);
        Lane::start(
            shared,
            &lane,
            move |lanes| lanes.inbound.insert(id, registered),
            move |shared, lane| {
                if let Some(token) = mpt_token {
                    if let Err(reason) = lane.claim_mpt(shared, token) {
                        tracing::warn!(peer = %lane.peer, %reason, "an inbound RPC pipe's mpt lanes did not arrive");
                        return lane.end(shared, reason);
                    }
                }
                inbound_reader(shared, lane, peer_id, &jobs);
            },
        );
    }

    /// Takes the mpt lanes the peer opened for this pipe with `token`.
    fn claim_mpt(&self, shared: &Shared, token: u64) -> Result<(), String> {
        let Some(setup) = &shared.mpt else {
            return Err("this worker runs no mpt lane listener".into());
        };
        let streams = setup
            .listener
            .claim(token, LANES_TIMEOUT)
            .map_err(|e| e.to_string())?;
        let lanes = MptLanes::new(streams)?;
        if self.is_ended() {
            lanes.shutdown();
            return Err("the pipe ended while its mpt lanes were opened".into());
        }
        let _ = self.mpt.set(lanes);
        Ok(())
    }

    /// Registers `lane` (with `register`, unless the registry is closed) and starts its
    /// reader thread running `read`; `false` (the lane stopped) when either fails.
    fn start(
        shared: &Arc<Shared>,
        lane: &Arc<Lane>,
        register: impl FnOnce(&mut Lanes) -> Option<Arc<Lane>>,
        read: impl FnOnce(&Arc<Shared>, &Arc<Lane>) + Send + 'static,
    ) -> bool {
        {
            let mut lanes = lanes(shared);
            if lanes.closed {
                lane.stop.stop();
                return false;
            }
            register(&mut lanes);
        }
        let thread_lane = Arc::clone(lane);
        let thread_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("rdzv-rpc-lane-{}", lane.id))
            .spawn(move || {
                mark_io_thread();
                read(&thread_shared, &thread_lane);
            });
        match spawned {
            Ok(_) => true,
            Err(e) => {
                lane.end(shared, format!("cannot start its reader thread: {e}"));
                false
            }
        }
    }

    /// Sends a call's request on this lane, from the caller's thread.
    pub(crate) fn call(self: &Arc<Self>, shared: &Shared, call: Call) {
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
            pipe: self.id,
            sent_bytes: 0,
            timeout,
            completion,
        };
        if let Err(pending) = shared.calls_table.register(message_id, pending) {
            let name = shared.me.name().to_string();
            shared
                .calls_table
                .complete(&pending.completion, Err(RpcError::ShutDown { name }));
            return;
        }
        self.send_request(shared, message_id, handler, message);
    }

    /// Sends the request of call `message_id`, already pending on this lane (a call
    /// that timed out meanwhile is skipped).
    pub(crate) fn send_request(
        &self,
        shared: &Shared,
        message_id: u64,
        handler: String,
        message: Message,
    ) {
        let mut frame = OwnedFrame {
            handler,
            metadata: message.metadata,
            payload: message.payload,
            ..OwnedFrame::empty(FrameKind::Request, message_id)
        };
        let mut exports = FrameExports::default();
        let built = tensor_frame(
            &shared.framer,
            &mut frame,
            &mut exports,
            message.tensors,
            &self.peer,
            (Role::Connector, &self.negotiated, self.streams()),
            false,
        );
        if let Err(e) = built {
            // Nothing was sent: this call alone fails.
            if let Some(pending) = shared.calls_table.take(message_id) {
                shared.calls_table.complete(&pending.completion, Err(e));
            }
            return;
        }
        shared.calls_table.set_sent(message_id, sent_bytes(&frame));
        let streamed = exports.take_streamed();
        // What it lends is held until the reply arrives or the lane ends.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = match &mut *self.machine() {
            Machine::Client(pipe) => pipe.send_request(message_id, lent).map_err(|r| r.reason),
            Machine::Inbound(_) => Err(Refusal::NotServing),
        };
        if let Err(refusal) = accepted {
            // Never sent: this call alone fails (what it would have lent is dropped).
            if let Some(pending) = shared.calls_table.take(message_id) {
                let error = RpcError::PipeBroken {
                    peer: self.peer.clone(),
                    reason: refusal.to_string(),
                };
                shared.calls_table.fail(pending, error);
            }
            return;
        }
        match self.send_with(frame, streamed) {
            Ok(_) => {}
            // Fault injection: this request alone fails, as if it had not been sent.
            Err(SendFailure::Injected { handler }) => {
                if let Machine::Client(pipe) = &mut *self.machine() {
                    drop(pipe.unsent(message_id));
                }
                if let Some(pending) = shared.calls_table.take(message_id) {
                    shared
                        .calls_table
                        .fail(pending, RpcError::InjectedFault { handler });
                }
            }
            Err(SendFailure::Broken(reason)) => self.end(shared, reason),
        }
    }

    /// Sends the response to request `message_id` of this inbound lane.
    pub(crate) fn respond(
        &self,
        shared: &Shared,
        message_id: u64,
        result: Result<Message, String>,
    ) {
        let (frame, mut exports) = response_frame(
            &shared.framer,
            message_id,
            result,
            &self.peer,
            (Role::Listener, &self.negotiated, self.streams()),
        );
        let streamed = exports.take_streamed();
        // What it lends is held until the caller's ack, or the lane's end.
        let lent = (!exports.is_empty()).then_some(exports);
        let accepted = match &mut *self.machine() {
            Machine::Inbound(pipe) => pipe.respond(message_id, lent).map_err(|r| r.reason),
            Machine::Client(_) => Err(Refusal::NotServing),
        };
        if let Err(refusal) = accepted {
            // The lane ended (or said goodbye) while the handler ran: nobody waits for
            // the response here, and what it would have lent was never seen.
            tracing::debug!(peer = %self.peer, message_id, %refusal, "an RPC response is dropped");
            return;
        }
        let sent = self.send_with(frame, streamed);
        if let Err(reason) = sent {
            tracing::debug!(peer = %self.peer, %reason, "an RPC response could not be sent");
            self.stop();
        }
    }

    /// Sends a goodbye (graceful shutdown); failures are expected then and ignored.
    pub(crate) fn goodbye(&self) {
        match &mut *self.machine() {
            Machine::Client(pipe) => pipe.goodbye(),
            Machine::Inbound(pipe) => pipe.goodbye(),
        }
        self.flush();
    }

    /// Ends the connection; the reader thread sees it and cleans up.
    pub(crate) fn stop(&self) {
        self.stop.stop();
        if let Some(mpt) = self.mpt.get() {
            mpt.shutdown();
        }
    }

    fn send(&self, frame: OwnedFrame) -> Result<u64, SendFailure> {
        self.send_with(frame, Vec::new())
    }

    /// Sends `frame` and then, under the same lock, the stripes of its `streamed` (mpt)
    /// tensors. The buffers the transport does not keep go back to the recycle pool.
    fn send_with(&self, frame: OwnedFrame, streamed: Streamed) -> Result<u64, SendFailure> {
        let mut sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        let (sent, back) = sender.send_owned(frame).map_err(|e| match e {
            TransportError::InjectedFault { handler } => SendFailure::Injected { handler },
            other => SendFailure::Broken(other.to_string()),
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
            None => Err("the frame has mpt tensors, but the pipe has no mpt lanes".into()),
        };
        drop(sender);
        if let Some(back) = back {
            recycle::give_all(back.tensor_data);
        }
        recycle::give_all(streamed.into_iter().map(|(_, data)| data).collect());
        pushed.map(|()| sent).map_err(SendFailure::Broken)
    }

    /// The lane failed or closed: it leaves the registry (if it is still there), its
    /// connection stops and the calls sent on it fail with `reason`.
    pub(crate) fn end(&self, shared: &Shared, reason: String) {
        {
            let mut lanes = lanes(shared);
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
        for pending in shared.calls_table.take_pipe(self.id) {
            let error = RpcError::PipeBroken {
                peer: self.peer.clone(),
                reason: reason.clone(),
            };
            shared.calls_table.fail(pending, error);
        }
    }
}

/// The client lane to `to`, if calls may take it (every tensor of `message` must go on
/// the `basic` channel, which a lane carries in its frames).
pub(crate) fn client_lane(shared: &Shared, to: &str) -> Option<Arc<Lane>> {
    lanes(shared).client(to)
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
    pub(crate) fn respond(
        &self,
        shared: &Shared,
        message_id: u64,
        result: Result<Message, String>,
    ) {
        self.lane.respond(shared, message_id, result);
    }
}

fn client_reader(shared: &Arc<Shared>, lane: &Arc<Lane>) {
    let reason = loop {
        // The client side does not spin: a waiting caller reads itself (polled lanes).
        match lane.next_frame(Duration::ZERO) {
            Ok(Some(frame)) => {
                if let Some(reason) = lane.on_client_frame(shared, frame) {
                    break reason;
                }
            }
            Ok(None) => break "the peer closed the pipe".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    lane.end(shared, reason);
}

fn inbound_reader(shared: &Arc<Shared>, lane: &Arc<Lane>, peer_id: WorkerId, jobs: &Sender<Job>) {
    'read: loop {
        // Spinning here answers a waiting caller without a wake-up on this side.
        let frame = match lane.next_frame(shared.wait_spin) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => {
                if !shared.gate.is_shutting_down() {
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
                        serve_request(shared, jobs, lane, peer_id, frame);
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
    lane.end(shared, "the inbound pipe ended".into());
}

/// Serves a request that arrived on inbound lane `lane` from the peer `peer_id`: an
/// inline handler runs here, after its tensors are pulled, and its response goes out
/// from here; any other goes to the worker pool, which pulls the tensors and answers
/// through the job's [`Responder`]. A request whose tensors cannot be read at all (a
/// channel that was not negotiated, a bad descriptor) fails at once; with the pool gone
/// the caller learns that this worker shut down.
fn serve_request(
    shared: &Arc<Shared>,
    jobs: &Sender<Job>,
    lane: &Arc<Lane>,
    peer_id: WorkerId,
    frame: IncomingFrame,
) {
    let (negotiated, reader, peer) = (&lane.negotiated, &lane.reader, lane.peer.as_str());
    let respond = |id, result| lane.respond(shared, id, result);
    let ctx = CallContext {
        caller: peer.to_string(),
        caller_id: peer_id,
        handler: frame.handler,
        message_id: frame.message_id,
        client: RpcClient::new(Arc::clone(shared) as Arc<dyn Caller>),
    };
    let message = Message {
        metadata: frame.metadata,
        payload: frame.payload,
        tensors: Vec::new(),
    };
    let source = (reader, &shared.devices);
    let tensors =
        match ReceivedTensors::sort(frame.tensors, negotiated, Role::Listener, source, peer) {
            Ok(tensors) => tensors,
            Err(e) => return respond(ctx.message_id, Err(e.to_string())),
        };
    shared.gate.server_call_started();
    if let Some(handler) = shared
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
        shared.gate.server_call_finished();
        respond(message_id, result);
        return;
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
        shared.gate.server_call_finished();
        let name = shared.me.name().to_string();
        respond(
            job.0.ctx.message_id,
            Err(RpcError::ShutDown { name }.to_string()),
        );
    }
}
