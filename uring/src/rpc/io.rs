//! The agent's handshake thread: one glommio executor that accepts and opens pipes.
//!
//! Client pipes (one per destination, TensorPipe's `ClientPipe`) carry this worker's
//! requests out and their responses back; inbound pipes carry peers' requests in and
//! this worker's responses out. This thread runs what comes before either carries a
//! call: it accepts connections, connects, runs the hello/answer handshake (over the
//! bootstrap transport, then again over the negotiated one: the upgrade) and opens a
//! client pipe's mpt lanes; then it hands both halves of the connection to a lane
//! ([`super::lane`]), whose threads carry every frame after that, driven by the core's
//! pipe machine (`rdzv_core::rpc::pipe`). Calls made while their pipe opens wait here
//! (their deadline runs in the call table from the start), and go out on the lane once
//! it exists. A pipe that fails to open fails its calls; the next call to that peer
//! opens a new one (PyTorch never re-creates a pipe).
//!
//! State lives in a `RefCell` that is never borrowed across an `.await`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use glommio::task::JoinHandle;
use rdzv_core::negotiate::{accept_answer, answer_brochure, Negotiated, Role};
use rdzv_core::rpc::frame::FrameKind;
use rdzv_core::rpc::frame::{decode_frame, decode_handshake, Decoded, FrameLimits, Handshake};
use rdzv_core::rpc::name::WorkerId;

use super::calls::Pending;
use super::channels::cpu_channel;
use super::error::RpcError;
use super::lane::Shared;
use super::lane::{self, Job, Lane};
use super::mailbox::{Call, Command};
use super::message::{Completion, Message};
use super::mpt::{self, MptLanes};
use super::transport::{
    address_for, BlockingHalves, Connection, FrameReceiver, FrameSender, IncomingFrame, Listener,
    NotBlocking, OwnedFrame, Transport,
};

/// A pipe's halves after the handshake, what it negotiated, and the token to open its
/// mpt lanes with (when it has them).
type OpenedPipe = (
    Box<dyn FrameSender>,
    Box<dyn FrameReceiver>,
    Negotiated,
    Option<u64>,
);

/// The peer's name and id, the negotiation, and the token of the pipe's mpt lanes.
type Accepted = (String, WorkerId, Negotiated, u64);

/// A call's request, waiting for its pipe; its [`Pending`] entry (and timeout) exists
/// from the moment the I/O thread got the call, so a pipe that never opens cannot hold
/// a call past its timeout.
struct Outbound {
    message_id: u64,
    handler: String,
    message: Message,
}
/// Why a client pipe could not be opened; every call waiting for it fails with it.
#[derive(Debug, Clone)]
struct OpenFailure {
    address: String,
    reason: String,
    connecting: bool,
}
impl OpenFailure {
    fn to_error(&self, peer: &str) -> RpcError {
        if self.connecting {
            RpcError::Connect {
                peer: peer.to_string(),
                address: self.address.clone(),
                reason: self.reason.clone(),
            }
        } else {
            RpcError::Handshake {
                peer: peer.to_string(),
                reason: self.reason.clone(),
            }
        }
    }
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
}

pub(crate) struct Io {
    shared: Arc<Shared>,
    /// Highest priority first; the last one bootstraps every pipe.
    transports: Vec<Box<dyn Transport>>,
    /// Taken (dropped) at close, which lets the pool's threads exit.
    jobs: RefCell<Option<Sender<Job>>>,
    /// Every running task but the main loop, to cancel at close (an executor that
    /// returns does not drop the tasks left on it).
    tasks: RefCell<HashMap<u64, JoinHandle<()>>>,
    next_task: Cell<u64>,
    state: RefCell<IoState>,
}

/// How long a graceful close waits for the lanes' goodbyes to go out.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

impl Io {
    /// Runs the I/O side until a [`Command::Close`]; `listeners` (one per transport) are
    /// already bound.
    pub(super) async fn run(
        shared: Arc<Shared>,
        transports: Vec<Box<dyn Transport>>,
        listeners: Vec<Box<dyn Listener>>,
        jobs: Sender<Job>,
    ) {
        let io = Rc::new(Io {
            shared,
            transports,
            jobs: RefCell::new(Some(jobs)),
            tasks: RefCell::new(HashMap::new()),
            next_task: Cell::new(0),
            state: RefCell::new(IoState::default()),
        });
        for listener in listeners {
            io.spawn(Rc::clone(&io).accept_loop(listener));
        }
        loop {
            let commands = io.shared.mailbox.pop_all().await;
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
        let handle = glommio::spawn_local(async move {
            task.await;
            io.tasks.borrow_mut().remove(&id);
        })
        .detach();
        self.tasks.borrow_mut().insert(id, handle);
    }

    fn name(&self) -> &str {
        self.shared.me.name()
    }

    fn shut_down_error(&self) -> RpcError {
        RpcError::ShutDown {
            name: self.name().to_string(),
        }
    }

    fn complete(&self, completion: &Arc<Completion>, result: Result<Message, RpcError>) {
        self.shared.calls_table.complete(completion, result);
    }

    /// Completes a call that never reached the pending table.
    fn fail_unsent(&self, call: Call, error: RpcError) {
        self.complete(&call.completion, Err(error));
    }

    fn start_call(self: &Rc<Self>, call: Call) {
        // A lane opened since the caller looked: the call goes there.
        if let Some(lane) = lane::client_lane(&self.shared, &call.peer) {
            lane.call(&self.shared, call);
            return;
        }
        let address = self
            .shared
            .registry
            .group()
            .peers
            .get(&call.peer)
            .map(|p| p.address.clone());
        let Some(address) = address else {
            let name = call.peer.clone();
            return self.fail_unsent(call, RpcError::UnknownWorker { name });
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
        if let Err(pending) = self.shared.calls_table.register(message_id, pending) {
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
    fn pipe_ended(&self, pipe: u64, peer: &str, reason: String) {
        self.fail_pipe(pipe, peer, || RpcError::PipeBroken {
            peer: peer.to_string(),
            reason: reason.clone(),
        });
    }

    /// Fails every call pending on client pipe `pipe` (still opening) with `error()`
    /// and forgets the pipe.
    fn fail_pipe(&self, pipe: u64, peer: &str, error: impl Fn() -> RpcError) {
        {
            let mut state = self.state.borrow_mut();
            if state.opening.get(peer).is_some_and(|o| o.id == pipe) {
                state.opening.remove(peer);
            }
        }
        for pending in self.shared.calls_table.take_pipe(pipe) {
            self.fail_pending(pending, error());
        }
    }

    fn fail_pending(&self, pending: Pending, error: RpcError) {
        self.shared.calls_table.fail(pending, error);
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

    /// Opens client pipe `id` to `peer`: connect, handshake, mpt lanes, then the pipe
    /// becomes a lane and the queued calls go out on it.
    async fn connect(self: Rc<Self>, id: u64, peer: String, address: String) {
        let (sender, receiver, negotiated, mpt_token) = match self.open_pipe(&peer, &address).await
        {
            Ok(opened) => opened,
            Err(failure) => {
                tracing::debug!(%peer, reason = %failure.reason, "opening an RPC pipe failed");
                return self.fail_pipe(id, &peer, || failure.to_error(&peer));
            }
        };
        if !self.still_opening(id, &peer) {
            // Reset or closed while connecting: its calls failed already, and dropping
            // the halves closes the connection.
            return;
        }
        self.shared.counters.pipe_opened(
            &peer,
            negotiated.transport,
            cpu_channel(&negotiated, Role::Connector),
        );
        let mpt = match (mpt_token, &self.shared.mpt) {
            (Some(token), Some(setup)) => {
                let (published, lanes) = (address.clone(), setup.lanes);
                let opened = glommio::executor()
                    .spawn_blocking(move || mpt::connect(&published, token, lanes))
                    .await;
                match opened {
                    Ok(lanes) => Some(lanes),
                    Err(reason) => {
                        let reason = format!("cannot open its mpt lanes: {reason}");
                        tracing::debug!(%peer, %reason, "opening an RPC pipe failed");
                        return self.pipe_ended(id, &peer, reason);
                    }
                }
            }
            _ => None,
        };
        match sender.into_blocking(receiver).await {
            Ok(halves) => self.client_lane(id, peer, negotiated, halves, mpt),
            Err(NotBlocking::Unsupported(..)) => {
                if let Some(mpt) = mpt {
                    mpt.shutdown();
                }
                let reason = unthreaded(&negotiated);
                self.pipe_ended(id, &peer, reason)
            }
            Err(NotBlocking::Failed(e)) => self.pipe_ended(id, &peer, e.to_string()),
        }
    }

    /// Client pipe `id` to `peer` becomes a lane; the calls queued while it opened go
    /// out on it.
    fn client_lane(
        &self,
        id: u64,
        peer: String,
        negotiated: Negotiated,
        halves: BlockingHalves,
        mpt: Option<MptLanes>,
    ) {
        if !self.still_opening(id, &peer) {
            // Reset or closed while it was taken off the executor.
            halves.stop.stop();
            if let Some(mpt) = mpt {
                mpt.shutdown();
            }
            return;
        }
        // The lane is registered before this thread forgets the pipe, so that no call
        // in between opens another one.
        let Some(lane) =
            Lane::start_client(&self.shared, id, peer.clone(), negotiated, halves, mpt)
        else {
            return self.pipe_ended(id, &peer, "this worker is shutting down".into());
        };
        let queued = self
            .state
            .borrow_mut()
            .opening
            .remove(&peer)
            .map(|o| o.queued)
            .unwrap_or_default();
        for Outbound {
            message_id,
            handler,
            message,
        } in queued
        {
            lane.send_request(&self.shared, message_id, handler, message);
        }
    }
    /// Opens a pipe: the handshake over the bootstrap (lowest-priority) transport, then,
    /// if a better transport was negotiated, the handshake again over that one, whose
    /// halves replace the bootstrap connection. If the upgrade fails the bootstrap
    /// connection carries the pipe (without mpt lanes: the peer's side of it did not
    /// negotiate tcp).
    async fn open_pipe(&self, peer: &str, address: &str) -> Result<OpenedPipe, OpenFailure> {
        let Some(bootstrap) = self.transports.last() else {
            return Err(OpenFailure {
                address: address.to_string(),
                reason: "this worker runs no transport".into(),
                connecting: true,
            });
        };
        let (mut sender, receiver, negotiated, mpt_token) =
            self.handshake_over(&**bootstrap, peer, address).await?;
        if negotiated.transport == bootstrap.kind() {
            return Ok((sender, receiver, negotiated, mpt_token));
        }
        let upgraded = match self
            .transports
            .iter()
            .find(|t| t.kind() == negotiated.transport)
        {
            Some(better) => self
                .handshake_over(&**better, peer, address)
                .await
                .and_then(|(s, r, n, t)| {
                    if n.transport == better.kind() {
                        Ok((s, r, n, t))
                    } else {
                        Err(OpenFailure {
                            address: address.to_string(),
                            reason: format!(
                                "the handshake over {} negotiated {}",
                                better.kind(),
                                n.transport
                            ),
                            connecting: false,
                        })
                    }
                }),
            None => Err(OpenFailure {
                address: address.to_string(),
                reason: format!(
                    "negotiated {}, which this worker does not run",
                    negotiated.transport
                ),
                connecting: false,
            }),
        };
        match upgraded {
            Ok(pipe) => {
                sender.close().await;
                Ok(pipe)
            }
            Err(failure) => {
                tracing::warn!(
                    %peer,
                    transport = %negotiated.transport,
                    reason = %failure.reason,
                    "upgrading an RPC pipe failed; it stays on {}",
                    bootstrap.kind()
                );
                let negotiated = Negotiated {
                    transport: bootstrap.kind(),
                    ..negotiated
                };
                Ok((sender, receiver, negotiated, None))
            }
        }
    }

    /// Connects with `transport` to its listener in the peer's published `address` and
    /// runs the hello/answer handshake. The token comes back when the pipe is to open
    /// mpt lanes with it.
    async fn handshake_over(
        &self,
        transport: &dyn Transport,
        peer: &str,
        address: &str,
    ) -> Result<OpenedPipe, OpenFailure> {
        let Some(address) = address_for(address, transport.kind()) else {
            return Err(OpenFailure {
                address: address.to_string(),
                reason: format!("the worker publishes no {} address", transport.kind()),
                connecting: true,
            });
        };
        let failure = |connecting: bool, reason: String| OpenFailure {
            address: address.to_string(),
            reason,
            connecting,
        };
        let connection = transport
            .connect(address)
            .await
            .map_err(|e| failure(true, e.to_string()))?;
        let (mut sender, mut receiver) = connection.split();
        let handshake = |reason: String| failure(false, reason);
        let offer = self
            .shared
            .offer
            .offer()
            .map_err(|e| handshake(e.to_string()))?;
        let lanes_token = mpt::new_token();
        let hello = Handshake::Hello {
            name: self.name(),
            id: self.shared.me.id(),
            brochure: offer.brochure(),
            lanes_token,
        };
        sender
            .send(handshake_frame(&hello).map_err(handshake)?)
            .await
            .map_err(|e| handshake(e.to_string()))?;
        let reply = receiver
            .recv(FrameLimits::HANDSHAKE)
            .await
            .map_err(|e| handshake(e.to_string()))?
            .ok_or_else(|| handshake("the peer closed the pipe during the handshake".into()))?;
        let negotiated = with_handshake(&reply, |message| match message {
            Handshake::Answer { name, answer, .. } if name == peer => {
                accept_answer(&offer, &answer).map_err(|e| e.to_string())
            }
            Handshake::Answer { name, .. } => Err(format!(
                "the worker at {address} is {name}, not {peer}; the group's addresses are stale"
            )),
            Handshake::Refused { reason } => Err(format!("refused: {reason}")),
            Handshake::Hello { .. } => Err("the peer sent a hello, not an answer".into()),
        })
        .and_then(|r| r)
        .map_err(handshake)?;
        let mpt_token = mpt::uses_mpt(&negotiated, Role::Connector).then_some(lanes_token);
        Ok((sender, receiver, negotiated, mpt_token))
    }
    async fn accept_loop(self: Rc<Self>, listener: Box<dyn Listener>) {
        loop {
            match listener.accept().await {
                Ok(connection) => {
                    self.spawn(Rc::clone(&self).serve_inbound(connection));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "RPC accept failed");
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Answers a peer's hello; `Ok` carries the peer's name and id and the decision.
    fn answer_hello(
        &self,
        hello: &IncomingFrame,
        from: &str,
    ) -> (Result<Accepted, String>, Option<OwnedFrame>) {
        let offer = match self.shared.offer.offer() {
            Ok(offer) => offer,
            Err(e) => return (Err(e.to_string()), None),
        };
        let decided = with_handshake(hello, |handshake| match handshake {
            Handshake::Hello {
                name,
                id,
                brochure,
                lanes_token,
            } => {
                let known = self.shared.registry.group().peers.get(name).map(|p| p.id);
                // A dynamic group's newcomer connects before the members know it.
                if known != Some(id) && !self.shared.dynamic {
                    return Err(format!(
                        "worker {name} with id {id} is not a member of this group"
                    ));
                }
                let answer = answer_brochure(&offer, &brochure).map_err(|e| e.to_string())?;
                let reply = Handshake::Answer {
                    name: self.name(),
                    id: self.shared.me.id(),
                    answer,
                };
                let frame = handshake_frame(&reply)?;
                Ok((
                    name.to_string(),
                    id,
                    answer.negotiated(),
                    lanes_token,
                    frame,
                ))
            }
            _ => Err("the first frame of a pipe must be a hello".to_string()),
        });
        match decided {
            Ok(Ok((name, id, negotiated, token, frame))) => {
                (Ok((name, id, negotiated, token)), Some(frame))
            }
            Ok(Err(reason)) => {
                let refusal = handshake_frame(&Handshake::Refused { reason: &reason }).ok();
                (Err(reason), refusal)
            }
            Err(e) => (Err(format!("bad handshake from {from}: {e}")), None),
        }
    }

    /// Answers a peer's hello; the pipe then becomes an inbound lane.
    async fn serve_inbound(self: Rc<Self>, connection: Box<dyn Connection>) {
        let from = connection.peer().to_string();
        let (mut sender, mut receiver) = connection.split();
        let hello = match receiver.recv(FrameLimits::HANDSHAKE).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(%from, error = %e, "bad RPC handshake");
                return;
            }
        };
        let (decided, reply) = self.answer_hello(&hello, &from);
        if let Some(reply) = reply {
            if let Err(e) = sender.send(reply).await {
                tracing::debug!(%from, error = %e, "sending the RPC handshake answer failed");
                return;
            }
        }
        let (peer, peer_id, negotiated, lanes_token) = match decided {
            Ok(d) => d,
            Err(reason) => {
                tracing::warn!(%from, %reason, "refused an RPC pipe");
                sender.close().await;
                return;
            }
        };
        let pipe = {
            let mut state = self.state.borrow_mut();
            let id = state.next_pipe;
            state.next_pipe += 1;
            id
        };
        match sender.into_blocking(receiver).await {
            Ok(halves) => {
                let jobs = self.jobs.borrow().clone();
                match jobs {
                    Some(jobs) => Lane::start_inbound(
                        &self.shared,
                        pipe,
                        (peer, peer_id),
                        negotiated,
                        halves,
                        jobs,
                        mpt::uses_mpt(&negotiated, Role::Listener).then_some(lanes_token),
                    ),
                    None => halves.stop.stop(),
                }
            }
            Err(NotBlocking::Unsupported(mut sender, _)) => {
                let reason = unthreaded(&negotiated);
                tracing::warn!(%peer, %reason, "an inbound RPC pipe is refused");
                sender.close().await;
            }
            Err(NotBlocking::Failed(e)) => {
                tracing::debug!(%peer, error = %e, "an inbound RPC pipe failed");
            }
        }
    }

    fn reset_pipes(&self) {
        let lanes = self
            .shared
            .lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain();
        for lane in lanes {
            lane.end(&self.shared, "this worker reset its pipes".into());
        }
        let opening: Vec<(String, Opening)> = self.state.borrow_mut().opening.drain().collect();
        for (peer, opening) in opening {
            self.pipe_ended(opening.id, &peer, "this worker reset its pipes".into());
        }
    }

    async fn close(&self, goodbye: bool) {
        // Every call still pending, on lanes or waiting for one, fails as shut down
        // (before the lanes stop, whose readers would call it a broken pipe); the timer
        // stops.
        let pending = self.shared.calls_table.close();
        let lanes = self
            .shared
            .lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .close();
        if goodbye && !lanes.is_empty() {
            // Goodbyes go out from a thread of their own: a send may wait for a slow
            // peer, and the executor must not. After FLUSH_WAIT the lanes stop anyway
            // (which also ends a send still waiting).
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let farewell = lanes.clone();
            let spawned = std::thread::Builder::new()
                .name("rdzv-rpc-goodbye".into())
                .spawn(move || {
                    for lane in &farewell {
                        lane.goodbye();
                    }
                    let _ = done_tx.send(());
                });
            if spawned.is_ok() {
                let deadline = std::time::Instant::now() + FLUSH_WAIT;
                while done_rx.try_recv().is_err() && std::time::Instant::now() < deadline {
                    glommio::timer::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        // Each lane's reader thread sees its stop and ends the lane, which gives up
        // what it lent once the connection is closed.
        for lane in &lanes {
            lane.stop();
        }
        // The calls of pipes still opening are in `pending`, failed below.
        self.state.borrow_mut().opening.clear();
        for pending in pending {
            self.fail_pending(pending, self.shut_down_error());
        }
        for command in self.shared.mailbox.close_and_take() {
            if let Command::Call(call) = command {
                self.fail_unsent(call, self.shut_down_error());
            }
        }
        self.jobs.borrow_mut().take();
        let tasks: Vec<JoinHandle<()>> = self.tasks.borrow_mut().drain().map(|(_, t)| t).collect();
        for task in &tasks {
            task.cancel();
        }
        // Let the executor drop the cancelled tasks (and close their sockets).
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// Why a pipe over a transport that cannot hand its connection to threads is refused.
fn unthreaded(negotiated: &Negotiated) -> String {
    format!(
        "the {} transport cannot serve a pipe from threads (FrameSender::into_blocking), \
         which every RPC pipe needs",
        negotiated.transport
    )
}

/// A handshake message as a frame.
fn handshake_frame(handshake: &Handshake<'_>) -> Result<OwnedFrame, String> {
    let mut bytes = Vec::new();
    handshake
        .encode_to_vec(&mut bytes)
        .map_err(|e| e.to_string())?;
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
) -> Result<T, String> {
    let owned = OwnedFrame {
        payload: frame.payload.clone(),
        ..OwnedFrame::empty(frame.kind, frame.message_id)
    };
    let mut wire = owned.encode_head().map_err(|e| e.to_string())?;
    wire.extend_from_slice(&owned.payload);
    match decode_frame(&wire, &FrameLimits::HANDSHAKE) {
        Ok(Decoded::Complete(decoded, _)) => {
            decode_handshake(&decoded).map(f).map_err(|e| e.to_string())
        }
        Ok(Decoded::Partial(_)) => Err("the handshake frame is incomplete".into()),
        Err(e) => Err(e.to_string()),
    }
}
