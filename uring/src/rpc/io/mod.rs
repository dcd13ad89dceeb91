//! The agent's handshake thread: one executor ([`LocalExecutor`], a current-thread tokio
//! runtime on epoll: it needs no io_uring) that accepts and opens pipes.
//!
//! Client pipes (one per destination, TensorPipe's `ClientPipe`) carry this worker's
//! requests out and their responses back; inbound pipes carry peers' requests in and this
//! worker's responses out. This thread runs what comes before either carries a call: it
//! accepts connections ([`inbound`]), connects ([`client`]), runs the hello/answer
//! handshake (over the bootstrap transport, then again over the negotiated one: the
//! upgrade) and opens a client pipe's mpt connections; then it hands the connection to a
//! lane ([`super::lane`]), whose threads carry every frame after that, driven by the core's
//! pipe machine (`rdzv_core::rpc::pipe`). Connections come from the transports already
//! served by threads: a handshake's frames are small and go out at once, and the wait for
//! the peer's runs on a thread of its own (bounded in time, and stopped when the agent
//! closes; at most [`InboundHandshakes::max_in_flight`] for peers that connected here). Calls made while their pipe opens wait here (their deadline runs
//! in the call table from the start), and go out on the lane once it exists. A pipe that
//! fails to open fails its calls; the next call to that peer opens a new one (PyTorch never
//! re-creates a pipe).
//!
//! State lives in a `RefCell` that is never borrowed across an `.await`.
//!
//! [`LocalExecutor`]: super::transport::LocalExecutor

use crossbeam_channel::Sender;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::frame::FrameKind;
use rdzv_core::rpc::frame::{
    decode_frame, decode_handshake, Decoded, EncodeError, FrameError, FrameLimits, Handshake,
    HandshakeError,
};
use rdzv_core::rpc::name::WorkerInfo;
use tokio::task::JoinHandle;

use super::calls::Pending;
use super::counters::Counters;
use super::error::{CallError, PipeFailure, UsageError};
use super::lane::{self, Job, LaneContext, Server};
use super::mailbox::{Call, Command, Mailbox};
use super::message::{Completion, Message};
use super::offer::OfferSpec;
use super::options::InboundHandshakes;
use super::registry::Registry;
use super::transport::{recv_within, Connection, Control, IncomingFrame, OwnedFrame, Transport};
use crate::queue::on_thread;

mod client;
mod inbound;

/// A call's request, waiting for its pipe; its [`Pending`] entry (and timeout) exists
/// from the moment the I/O thread got the call, so a pipe that never opens cannot hold
/// a call past its timeout.
struct Outbound {
    message_id: u64,
    handler: String,
    message: Message,
}

/// A client pipe being opened, with the calls waiting for it.
struct Opening {
    id: u64,
    queued: Vec<Outbound>,
}

#[derive(Default)]
struct IoState {
    /// Client pipes being opened, by destination name (open ones are lanes).
    opening: HashMap<String, Opening>,
    next_pipe: u64,
    /// The connections whose handshake frame a thread waits for, stopped at close.
    handshaking: HashMap<u64, Arc<dyn Control>>,
    next_handshake: u64,
    /// Inbound pipes accepted whose handshake is not done (at most
    /// [`InboundHandshakes::max_in_flight`]).
    inbound_handshakes: usize,
}

/// What the I/O thread reads and feeds, from start-up.
pub(crate) struct IoPieces {
    pub me: WorkerInfo,
    /// Members join and leave (no world size): a hello from a stranger is accepted.
    pub dynamic: bool,
    pub offer: OfferSpec,
    /// The group (peers' addresses and ids).
    pub registry: Arc<Registry>,
    /// Commands for this thread.
    pub mailbox: Arc<Mailbox>,
    /// Pipe counts and negotiated choices.
    pub counters: Arc<Counters>,
    /// Where opened pipes go, and the calls table.
    pub lanes: Arc<LaneContext>,
    /// What inbound lanes serve requests with.
    pub server: Arc<Server>,
    /// The group secret peers prove in the handshake (`None`: none).
    pub secret: Option<Arc<[u8]>>,
    /// How long, and how many at once, peers that connected may take to finish their
    /// handshake.
    pub inbound_handshakes: InboundHandshakes,
}

pub(crate) struct Io {
    pieces: IoPieces,
    transports: Vec<Box<dyn Transport>>,
    /// Taken (dropped) at close, which lets the pool's threads exit.
    jobs: RefCell<Option<Sender<Job>>>,
    /// Every running task but the main loop, to cancel at close (so that their sockets
    /// close before the agent's shutdown returns, not when the executor goes).
    tasks: RefCell<HashMap<u64, JoinHandle<()>>>,
    next_task: Cell<u64>,
    state: RefCell<IoState>,
    /// Signalled when an inbound handshake ends, for an accept loop waiting at the cap.
    handshake_ended: tokio::sync::Notify,
}

/// A fresh nonce for a pipe's handshake (`rdzv_core::rpc::auth`), from the operating
/// system's random source.
///
/// # Errors
/// The random source's error, as text.
fn nonce() -> Result<rdzv_core::rpc::auth::Nonce, String> {
    let mut nonce = [0u8; rdzv_core::rpc::auth::NONCE_LEN];
    getrandom::fill(&mut nonce)
        .map_err(|e| format!("the operating system's random source failed: {e}"))?;
    Ok(nonce)
}

/// How long a graceful close waits for the lanes' goodbyes to go out.
const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// How long a client pipe waits for each of the listener's handshake frames (its answer,
/// then its word on the proof). Inbound pipes wait [`InboundHandshakes::timeout`].
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

impl Io {
    /// Runs the I/O side until a [`Command::Close`]; every transport is listening.
    pub(super) async fn run(
        pieces: IoPieces,
        transports: Vec<Box<dyn Transport>>,
        jobs: Sender<Job>,
    ) {
        let io = Rc::new(Io {
            pieces,
            transports,
            jobs: RefCell::new(Some(jobs)),
            tasks: RefCell::new(HashMap::new()),
            next_task: Cell::new(0),
            state: RefCell::new(IoState::default()),
            handshake_ended: tokio::sync::Notify::new(),
        });
        for index in 0..io.transports.len() {
            io.spawn(Rc::clone(&io).accept_loop(index));
        }
        loop {
            let commands = io.pieces.mailbox.pop_all().await;
            if commands.is_empty() {
                // Closed without a `Close` command: nothing more will come.
                return;
            }
            for command in commands {
                match command {
                    Command::Call(call) => io.start_call(call),
                    Command::ResetPipes => io.reset_pipes(),
                    Command::Close { goodbye } => {
                        io.close(goodbye).await;
                        return;
                    }
                }
            }
        }
    }

    /// Spawns a task that [`close`](Self::close) cancels if it is still running.
    fn spawn(self: &Rc<Self>, task: impl std::future::Future<Output = ()> + 'static) {
        let id = self.next_task.get();
        self.next_task.set(id + 1);
        let io = Rc::clone(self);
        let handle = tokio::task::spawn_local(async move {
            task.await;
            io.tasks.borrow_mut().remove(&id);
        });
        self.tasks.borrow_mut().insert(id, handle);
    }

    fn name(&self) -> &str {
        self.pieces.me.name()
    }

    fn shut_down_error(&self) -> CallError {
        CallError::ShutDown {
            name: self.name().to_string(),
        }
    }

    fn complete(&self, completion: &Arc<Completion>, result: Result<Message, CallError>) {
        self.pieces.lanes.calls.complete(completion, result);
    }

    /// Completes a call that never reached the pending table.
    fn fail_unsent(&self, call: Call, error: CallError) {
        self.complete(&call.completion, Err(error));
    }

    fn start_call(self: &Rc<Self>, call: Call) {
        // A lane opened since the caller looked: the call goes there.
        if let Some(lane) = lane::client_lane(&self.pieces.lanes.lanes, &call.peer) {
            lane.call(self.name(), call);
            return;
        }
        let address = self
            .pieces
            .registry
            .group()
            .peers
            .get(&call.peer)
            .map(|p| p.address.clone());
        let Some(address) = address else {
            let name = call.peer.clone();
            return self.fail_unsent(call, UsageError::UnknownWorker { name }.into());
        };
        let Call {
            message_id,
            peer,
            handler,
            message,
            timeout,
            completion,
        } = call;
        let mut state = self.state.borrow_mut();
        let (pipe_id, open) = match state.opening.get(&peer) {
            Some(opening) => (opening.id, false),
            None => {
                let id = state.next_pipe;
                state.next_pipe += 1;
                state.opening.insert(
                    peer.clone(),
                    Opening {
                        id,
                        queued: Vec::new(),
                    },
                );
                (id, true)
            }
        };
        let pending = Pending {
            peer: peer.clone(),
            handler: handler.clone(),
            pipe: pipe_id,
            sent_bytes: 0,
            timeout,
            completion,
        };
        if let Err(pending) = self.pieces.lanes.calls.register(message_id, pending) {
            drop(state);
            self.complete(&pending.completion, Err(self.shut_down_error()));
            return;
        }
        if let Some(opening) = state.opening.get_mut(&peer) {
            opening.queued.push(Outbound {
                message_id,
                handler,
                message,
            });
        }
        drop(state);
        if open {
            self.spawn(Rc::clone(self).connect(pipe_id, peer, address));
        }
    }

    /// Fails every call pending on client pipe `pipe` with a broken-pipe error and
    /// forgets the pipe.
    fn pipe_ended(&self, pipe: u64, peer: &str, reason: PipeFailure) {
        self.fail_pipe(pipe, peer, || CallError::PipeBroken {
            peer: peer.to_string(),
            reason: reason.clone(),
        });
    }

    /// Fails every call pending on client pipe `pipe` (still opening) with `error()`
    /// and forgets the pipe.
    fn fail_pipe(&self, pipe: u64, peer: &str, error: impl Fn() -> CallError) {
        {
            let mut state = self.state.borrow_mut();
            if state.opening.get(peer).is_some_and(|o| o.id == pipe) {
                state.opening.remove(peer);
            }
        }
        for pending in self.pieces.lanes.calls.take_pipe(pipe) {
            self.fail_pending(pending, error());
        }
    }

    fn fail_pending(&self, pending: Pending, error: CallError) {
        self.pieces.lanes.calls.fail(pending, error);
    }

    /// Whether client pipe `id` to `peer` is still the one being opened (not reset or
    /// closed meanwhile).
    fn still_opening(&self, id: u64, peer: &str) -> bool {
        self.state
            .borrow()
            .opening
            .get(peer)
            .is_some_and(|o| o.id == id)
    }

    fn reset_pipes(&self) {
        // Taken out first: an ending lane leaves the registry, which must not be locked.
        let lanes = lane::lock(&self.pieces.lanes.lanes).drain();
        lanes.end(&PipeFailure::Reset);
        let opening: Vec<(String, Opening)> = self.state.borrow_mut().opening.drain().collect();
        for (peer, opening) in opening {
            self.pipe_ended(opening.id, &peer, PipeFailure::Reset);
        }
    }

    async fn close(&self, goodbye: bool) {
        // Every call still pending, on lanes or waiting for one, fails as shut down
        // (before the lanes stop, whose readers would call it a broken pipe); the timer
        // stops.
        let pending = self.pieces.lanes.calls.close();
        let lanes = lane::lock(&self.pieces.lanes.lanes).close();
        if goodbye && !lanes.is_empty() {
            // Goodbyes go out from a thread of their own: a send may wait for a slow
            // peer, and the executor must not. After FLUSH_WAIT the lanes stop anyway
            // (which also ends a send still waiting).
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let farewell = lanes.clone();
            let spawned = std::thread::Builder::new()
                .name("rdzv-rpc-goodbye".into())
                .spawn(move || {
                    farewell.goodbye();
                    let _ = done_tx.send(());
                });
            if spawned.is_ok() {
                let deadline = std::time::Instant::now() + FLUSH_WAIT;
                while done_rx.try_recv().is_err() && std::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        // Each lane's reader thread sees its stop and ends the lane, which gives up
        // what it lent once the connection is closed.
        lanes.stop();
        // The calls of pipes still opening are in `pending`, failed below; handshakes
        // waiting on threads end.
        let handshaking: Vec<Arc<dyn Control>> = {
            let mut state = self.state.borrow_mut();
            state.opening.clear();
            state.handshaking.drain().map(|(_, c)| c).collect()
        };
        for control in handshaking {
            control.stop();
        }
        for pending in pending {
            self.fail_pending(pending, self.shut_down_error());
        }
        for command in self.pieces.mailbox.close_and_take() {
            if let Command::Call(call) = command {
                self.fail_unsent(call, self.shut_down_error());
            }
        }
        self.jobs.borrow_mut().take();
        let tasks: Vec<JoinHandle<()>> = self.tasks.borrow_mut().drain().map(|(_, t)| t).collect();
        for task in &tasks {
            task.abort();
        }
        // Let the executor drop the cancelled tasks (and close their sockets).
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

impl Io {
    /// Waits on a thread of its own for the next frame of `connection` (a handshake
    /// frame, under the handshake limits) for up to `timeout`; `None` when the peer
    /// closed it. The agent's close stops the wait.
    async fn receive_handshake(
        &self,
        mut connection: Connection,
        timeout: Duration,
    ) -> Result<(Connection, Option<IncomingFrame>), PipeFailure> {
        let id = {
            let mut state = self.state.borrow_mut();
            let id = state.next_handshake;
            state.next_handshake += 1;
            state
                .handshaking
                .insert(id, Arc::clone(&connection.control));
            id
        };
        let received = on_thread("rdzv-rpc-handshake", move || {
            let frame = recv_within(&mut connection, FrameLimits::HANDSHAKE, timeout);
            (connection, frame)
        })
        .await;
        self.state.borrow_mut().handshaking.remove(&id);
        match received {
            Ok((connection, Ok(frame))) => Ok((connection, frame)),
            Ok((_, Err(e))) => Err(PipeFailure::transport(e)),
            Err(e) => Err(PipeFailure::local(HandshakeThreadError(e))),
        }
    }
}

/// The thread that waits for a handshake frame could not run.
#[derive(Debug, thiserror::Error)]
#[error("cannot run the handshake's thread: {0}")]
struct HandshakeThreadError(#[source] std::io::Error);

/// Why a handshake frame could not be made or read.
#[derive(Debug, thiserror::Error)]
enum HandshakeFrameError {
    /// The handshake message could not be encoded.
    #[error("cannot encode the handshake: {0}")]
    Encode(#[source] EncodeError),
    /// The frame is not a valid frame.
    #[error("{0}")]
    Frame(#[source] FrameError),
    /// The frame ended early.
    #[error("the handshake frame is incomplete")]
    Incomplete,
    /// The frame's payload is not a handshake message.
    #[error("{0}")]
    Handshake(#[source] HandshakeError),
}

/// A handshake message as a frame.
fn handshake_frame(handshake: &Handshake<'_>) -> Result<OwnedFrame, HandshakeFrameError> {
    let mut bytes = Vec::new();
    handshake
        .encode_to_vec(&mut bytes)
        .map_err(HandshakeFrameError::Encode)?;
    let payload = bytes
        .get(rdzv_core::rpc::frame::HEADER_LEN..)
        .unwrap_or_default()
        .to_vec();
    Ok(OwnedFrame {
        payload,
        ..OwnedFrame::empty(FrameKind::Handshake, 0)
    })
}

/// Runs `f` on the handshake inside a received frame (re-framed so that the core does
/// every check it does on the wire).
fn with_handshake<T>(
    frame: &IncomingFrame,
    f: impl FnOnce(Handshake<'_>) -> T,
) -> Result<T, HandshakeFrameError> {
    let owned = OwnedFrame {
        payload: frame.payload.clone(),
        ..OwnedFrame::empty(frame.kind, frame.message_id)
    };
    let mut wire = owned.encode_head().map_err(HandshakeFrameError::Encode)?;
    wire.extend_from_slice(&owned.payload);
    match decode_frame(&wire, &FrameLimits::HANDSHAKE) {
        Ok(Decoded::Complete(decoded, _)) => decode_handshake(&decoded)
            .map(f)
            .map_err(HandshakeFrameError::Handshake),
        Ok(Decoded::Partial(_)) => Err(HandshakeFrameError::Incomplete),
        Err(e) => Err(HandshakeFrameError::Frame(e)),
    }
}
