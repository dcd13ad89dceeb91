//! The agent's I/O thread: one glommio executor that owns every pipe, the listener and
//! the timeout timer.
//!
//! Client pipes (one per destination, TensorPipe's `ClientPipe`) carry this worker's
//! requests out and their responses back; inbound pipes carry peers' requests in and
//! this worker's responses out. Each pipe has a reader task and a writer task, fed by a
//! local channel, so that a long write never blocks reads. A pipe that fails or closes
//! fails the calls pending on it and leaves the table; the next call to that peer opens
//! a new one (PyTorch never re-creates a pipe).
//!
//! Tensors of at least `min_channel_bytes` go over the pipe's negotiated channel (cma,
//! xth; see `super::channels`) instead of inline: the sender keeps each exported buffer
//! until the peer is done with it. A request's exports are released when its reply (or
//! error) arrives, even after the call timed out, or when its pipe fails; a response's
//! when the caller's `Ack` frame arrives or the inbound pipe ends (the core's
//! `rdzv_core::rpc::lending` rule, kept in a [`Ledger`]). The callee pulls a
//! request's tensors on the handler pool's thread before the handler runs; the caller
//! pulls a response's on the I/O thread when small and on glommio's blocking thread when
//! large, then acks. A failed pull fails the call with the channel, the peer and why.
//!
//! Timeouts are the core's [`TimeoutQueue`], driven by one timer task that sleeps until
//! the earliest deadline and is poked when a call is scheduled. A call that times out
//! leaves the pending table, so its late response is dropped.
//!
//! State lives in a `RefCell` that is never borrowed across an `.await`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use glommio::channels::local_channel::{self, LocalSender};
use glommio::task::JoinHandle;
use rdzv_core::negotiate::{accept_answer, answer_brochure, Negotiated, Role};
use rdzv_core::rpc::frame::{
    decode_frame, decode_handshake, Decoded, FrameKind, FrameLimits, Handshake,
};
use rdzv_core::rpc::lending::{must_ack, Ledger, Lender};
use rdzv_core::rpc::name::WorkerId;

use super::agent::FaultInjection;
use super::calls::{self, Pending, Reply};
use super::channels::{
    cpu_channel, FrameExports, PipeReader, ReceivedTensors, PULL_OFF_THREAD_BYTES,
};
use super::error::RpcError;
use super::lane::{self, Lane};
use super::message::{CallContext, Completion, Message};
use super::mpt::{self, MptLanes};
use super::shared::{Call, Command, Shared};
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

/// A request for the worker pool. `message` has no tensors yet: they are in `tensors`,
/// to be pulled (out-of-band ones) on the pool's thread before the handler runs.
pub(crate) struct Job {
    pub pipe: u64,
    pub ctx: CallContext,
    pub message: Message,
    pub tensors: ReceivedTensors,
}

/// A call's request, waiting for its pipe; its [`Pending`] entry (and timeout) exists
/// from the moment the I/O thread got the call, so a pipe that never opens cannot hold
/// a call past its timeout.
struct Outbound {
    message_id: u64,
    handler: String,
    message: Message,
}

enum ClientPipe {
    Connecting { id: u64, queued: Vec<Outbound> },
    Ready(ReadyPipe),
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

#[derive(Clone)]
struct ReadyPipe {
    id: u64,
    tx: Rc<LocalSender<OwnedFrame>>,
    negotiated: Negotiated,
    /// Where this pipe's responses' out-of-band tensors are read from.
    reader: Arc<PipeReader>,
    /// Set when the pipe's reader stops: a pull that was running then may have read
    /// buffers the peer released, so its result is refused.
    ended: Rc<Cell<bool>>,
}

struct InboundPipe {
    peer: String,
    tx: Rc<LocalSender<OwnedFrame>>,
    negotiated: Negotiated,
    /// Where this pipe's requests' out-of-band tensors are read from.
    reader: Arc<PipeReader>,
    /// Buffers lent by responses on this pipe, by message id, until the caller acks.
    exports: Ledger<FrameExports>,
}

#[derive(Default)]
struct IoState {
    client_pipes: HashMap<String, ClientPipe>,
    inbound: HashMap<u64, InboundPipe>,
    next_pipe: u64,
    /// Buffers lent by requests, by message id, with the client pipe they went on; held
    /// until the reply arrives or the pipe fails.
    request_exports: Ledger<(u64, FrameExports)>,
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
    writers: Rc<Cell<usize>>,
    faults: Faults,
}

/// The fault injection state: how many sends of each failing handler failed so far.
struct Faults {
    config: FaultInjection,
    failed: RefCell<HashMap<String, u32>>,
}

impl Faults {
    /// Whether this send of a request to `handler` must fail (and counts it).
    fn should_fail(&self, handler: &str) -> bool {
        if !self.config.fail_handlers.iter().any(|h| h == handler) {
            return false;
        }
        let mut failed = self.failed.borrow_mut();
        let count = failed.entry(handler.to_string()).or_insert(0);
        if *count < self.config.num_fail_sends {
            *count += 1;
            true
        } else {
            false
        }
    }

    /// How long to hold a request to `handler` before sending it.
    fn delay(&self, handler: &str) -> Option<Duration> {
        self.config
            .delays
            .iter()
            .find(|(h, _)| h == handler)
            .map(|&(_, d)| d)
    }
}

/// How long a graceful close waits for writers to flush their goodbyes.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

impl Io {
    /// Runs the I/O side until a [`Command::Close`]; `listeners` (one per transport) are
    /// already bound.
    pub async fn run(
        shared: Arc<Shared>,
        transports: Vec<Box<dyn Transport>>,
        listeners: Vec<Box<dyn Listener>>,
        jobs: Sender<Job>,
        faults: FaultInjection,
    ) {
        let io = Rc::new(Io {
            shared,
            transports,
            jobs: RefCell::new(Some(jobs)),
            tasks: RefCell::new(HashMap::new()),
            next_task: Cell::new(0),
            state: RefCell::new(IoState::default()),
            writers: Rc::new(Cell::new(0)),
            faults: Faults {
                config: faults,
                failed: RefCell::new(HashMap::new()),
            },
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
                    Command::Respond {
                        pipe,
                        message_id,
                        result,
                    } => io.respond(pipe, message_id, result),
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
        calls::complete(&self.shared, completion, result);
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
            .group()
            .peers
            .get(&call.peer)
            .map(|p| p.address.clone());
        let address = match address {
            Some(address) => address,
            None => {
                let name = call.peer.clone();
                return self.fail_unsent(call, RpcError::UnknownWorker { name });
            }
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
        let (pipe_id, ready, open) = match state.client_pipes.get(&peer) {
            Some(ClientPipe::Ready(pipe)) => (pipe.id, Some(pipe.clone()), false),
            Some(ClientPipe::Connecting { id, .. }) => (*id, None, false),
            None => {
                let id = state.next_pipe;
                state.next_pipe += 1;
                state.client_pipes.insert(
                    peer.clone(),
                    ClientPipe::Connecting {
                        id,
                        queued: Vec::new(),
                    },
                );
                (id, None, true)
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
        let outbound = Outbound {
            message_id,
            handler,
            message,
        };
        match ready {
            Some(pipe) => {
                drop(state);
                self.send_call(outbound, &pipe);
            }
            None => {
                if let Some(ClientPipe::Connecting { queued, .. }) =
                    state.client_pipes.get_mut(&peer)
                {
                    queued.push(outbound);
                }
                drop(state);
                if open {
                    self.spawn(Rc::clone(self).connect(pipe_id, peer, address));
                }
            }
        }
    }

    /// Sends a request whose call is pending (a call that timed out while its pipe
    /// was opening is skipped).
    fn send_call(self: &Rc<Self>, outbound: Outbound, pipe: &ReadyPipe) {
        let Outbound {
            message_id,
            handler,
            message,
        } = outbound;
        let Some(peer) = self.shared.calls_table.peer_of(message_id) else {
            return;
        };
        let mut frame = OwnedFrame {
            handler,
            metadata: message.metadata,
            payload: message.payload,
            ..OwnedFrame::empty(FrameKind::Request, message_id)
        };
        let mut exports = FrameExports::default();
        let built = lane::tensor_frame(
            &self.shared,
            &mut frame,
            &mut exports,
            message.tensors,
            &peer,
            // Executor pipes have no mpt lanes.
            (Role::Connector, &pipe.negotiated, false),
            false,
        );
        if let Err(e) = built {
            // Nothing was sent: fail this call only.
            if let Some(pending) = self.shared.calls_table.take(message_id) {
                self.complete(&pending.completion, Err(e));
            }
            return;
        }
        self.shared
            .calls_table
            .set_sent(message_id, lane::sent_bytes(&frame));
        if self.faults.should_fail(&frame.handler) {
            if let Some(pending) = self.shared.calls_table.take(message_id) {
                let handler = frame.handler.clone();
                self.fail_pending(pending, RpcError::InjectedFault { handler });
            }
            return;
        }
        if !exports.is_empty() {
            // Held until the reply arrives or the pipe fails.
            self.state.borrow_mut().request_exports.lend(
                Lender::Request,
                message_id,
                (pipe.id, exports),
            );
        }
        if let Some(delay) = self.faults.delay(&frame.handler) {
            let tx = Rc::clone(&pipe.tx);
            self.spawn(async move {
                glommio::timer::sleep(delay).await;
                // A pipe that closed meanwhile has failed the call already.
                let _ = tx.try_send(frame);
            });
            return;
        }
        if pipe.tx.try_send(frame).is_err() {
            self.pipe_ended(pipe.id, &peer, "the pipe's writer stopped".into());
        }
    }

    fn respond(&self, pipe: u64, message_id: u64, result: Result<Message, String>) {
        let state = self.state.borrow();
        let Some(inbound) = state.inbound.get(&pipe) else {
            drop(state);
            // An inbound lane answers from this thread. A pipe that neither this thread
            // nor the lanes know has ended while its handler ran (a reset, a crashed
            // peer, a timeout): nobody is waiting for the response, so it is dropped.
            // Handing it back to the lanes would bounce it through the mailbox forever.
            if lane::respond_on_lane(&self.shared, pipe, message_id, result).is_some() {
                tracing::debug!(
                    pipe,
                    message_id,
                    "a response for a pipe that has ended is dropped"
                );
            }
            return;
        };
        let (tx, peer, negotiated) = (
            Rc::clone(&inbound.tx),
            inbound.peer.clone(),
            inbound.negotiated,
        );
        drop(state);
        let (frame, exports) = lane::response_frame(
            &self.shared,
            message_id,
            result,
            &peer,
            (Role::Listener, &negotiated, false),
        );
        if !exports.is_empty() {
            // Held until the caller's ack, or the pipe's end.
            if let Some(inbound) = self.state.borrow_mut().inbound.get_mut(&pipe) {
                drop(inbound.exports.lend(Lender::Response, message_id, exports));
            }
        }
        let _ = tx.try_send(frame);
    }

    /// Fails every call pending on client pipe `pipe` with a broken-pipe error and
    /// forgets the pipe.
    fn pipe_ended(&self, pipe: u64, peer: &str, reason: String) {
        self.fail_pipe(pipe, peer, || RpcError::PipeBroken {
            peer: peer.to_string(),
            reason: reason.clone(),
        });
    }

    /// Fails every call pending on client pipe `pipe` with `error()` and forgets the
    /// pipe.
    fn fail_pipe(&self, pipe: u64, peer: &str, error: impl Fn() -> RpcError) {
        {
            let mut state = self.state.borrow_mut();
            let current = match state.client_pipes.get(peer) {
                Some(ClientPipe::Ready(p)) => p.id == pipe,
                Some(ClientPipe::Connecting { id, .. }) => *id == pipe,
                None => false,
            };
            if current {
                state.client_pipes.remove(peer);
            }
            // The callee can no longer read what the pipe's requests lent it.
            drop(state.request_exports.end_where(|(on, _)| *on == pipe));
        }
        for pending in self.shared.calls_table.take_pipe(pipe) {
            self.fail_pending(pending, error());
        }
    }

    fn fail_pending(&self, pending: Pending, error: RpcError) {
        calls::fail_pending(&self.shared, pending, error);
    }

    /// A response or error arrived on client pipe `pipe`. Only a call sent on that pipe
    /// can be answered there; anything else is late (timed out) or bogus and dropped.
    /// Either way the request's lent buffers are released (the callee read them before
    /// it answered), and a response's out-of-band tensors are pulled, then acked.
    fn on_reply(self: &Rc<Self>, pipe: &ReadyPipe, frame: IncomingFrame) {
        let message_id = frame.message_id;
        let needs_ack = must_ack(frame.kind, frame.tensors.iter().map(|(d, _)| d));
        // Released once this reply is handled: freeing a large buffer (munmap) must not
        // delay reading the response.
        let released = self.state.borrow_mut().request_exports.release_if(
            frame.kind,
            message_id,
            |(on, _)| *on == pipe.id,
        );
        let Some(pending) = self.shared.calls_table.take_reply(message_id, pipe.id) else {
            tracing::debug!(message_id, "late or unknown reply dropped");
            if needs_ack {
                // Nobody reads its tensors: let the callee release them.
                ack(pipe, message_id);
            }
            return;
        };
        let peer = pending.peer.clone();
        let job = match calls::reply(&self.shared, pending, frame, &pipe.negotiated, &pipe.reader) {
            Reply::Done { ack: needed } => {
                if needed {
                    ack(pipe, message_id);
                }
                if let Some((_, released)) = released {
                    released.recycle();
                }
                return;
            }
            Reply::Pull(job) => job,
        };
        // Pull, ack, complete; if the task is cancelled (the agent closes) the guard
        // fails the call instead of leaving its future hanging.
        let guard = PullGuard {
            io: Rc::clone(self),
            completion: Some(Arc::clone(job.completion())),
        };
        let pipe = pipe.clone();
        self.spawn(async move {
            let mut guard = guard;
            let (_, pulled) = if job.pull_bytes() >= PULL_OFF_THREAD_BYTES {
                glommio::executor().spawn_blocking(move || job.pull()).await
            } else {
                job.pull()
            };
            ack(&pipe, message_id);
            if let Some(completion) = guard.completion.take() {
                let pulled = match pulled {
                    Ok(_) if pipe.ended.get() => Err(RpcError::Channel {
                        channel: pipe.channel_name(),
                        peer,
                        reason: "the pipe ended while the response's tensors were being read; \
                                 the peer may have released them"
                            .into(),
                    }),
                    other => other,
                };
                guard.io.complete(&completion, pulled);
            }
            // The callee answered, so it read what the request lent.
            if let Some((_, released)) = released {
                released.recycle();
            }
        });
    }

    fn spawn_writer(
        self: &Rc<Self>,
        mut sender: Box<dyn FrameSender>,
    ) -> Rc<LocalSender<OwnedFrame>> {
        let (tx, rx) = local_channel::new_unbounded::<OwnedFrame>();
        let writers = Rc::clone(&self.writers);
        writers.set(writers.get() + 1);
        self.spawn(async move {
            while let Some(frame) = rx.recv().await {
                if let Err(e) = sender.send(frame).await {
                    tracing::debug!(error = %e, "RPC pipe write failed");
                    break;
                }
            }
            sender.close().await;
            writers.set(writers.get().saturating_sub(1));
        });
        Rc::new(tx)
    }

    /// Opens client pipe `id` to `peer`: connect, handshake, then drain the queued calls.
    /// Opens client pipe `id` to `peer`: connect, handshake, then send the queued calls.
    async fn connect(self: Rc<Self>, id: u64, peer: String, address: String) {
        match self.open_pipe(&peer, &address).await {
            Ok((sender, receiver, negotiated, mpt_token)) => {
                let current = matches!(
                    self.state.borrow().client_pipes.get(&peer),
                    Some(ClientPipe::Connecting { id: c, .. }) if *c == id
                );
                if !current {
                    // Reset or closed while connecting: its calls failed already, and
                    // dropping the halves closes the connection.
                    return;
                }
                {
                    let mut calls = self.shared.lock_calls();
                    calls
                        .pipe_transports
                        .insert(peer.clone(), negotiated.transport);
                    calls
                        .pipe_channels
                        .insert(peer.clone(), cpu_channel(&negotiated, Role::Connector));
                }
                let (sender, receiver) = if true {
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
                                    return self.fail_pipe(id, &peer, || RpcError::PipeBroken {
                                        peer: peer.clone(),
                                        reason: reason.clone(),
                                    });
                                }
                            }
                        }
                        _ => None,
                    };
                    match sender.into_blocking(receiver).await {
                        Ok(halves) => return self.client_lane(id, peer, negotiated, halves, mpt),
                        Err(NotBlocking::Unsupported(sender, receiver)) => (sender, receiver),
                        Err(NotBlocking::Failed(e)) => {
                            return self.pipe_ended(id, &peer, e.to_string());
                        }
                    }
                } else {
                    (sender, receiver)
                };
                let tx = self.spawn_writer(sender);
                let pipe = ReadyPipe {
                    id,
                    tx,
                    negotiated,
                    reader: Arc::new(PipeReader::default()),
                    ended: Rc::new(Cell::new(false)),
                };
                let queued = match self
                    .state
                    .borrow_mut()
                    .client_pipes
                    .insert(peer.clone(), ClientPipe::Ready(pipe.clone()))
                {
                    Some(ClientPipe::Connecting { queued, .. }) => queued,
                    _ => Vec::new(),
                };
                self.spawn(Rc::clone(&self).client_reader(pipe.clone(), peer, receiver));
                for outbound in queued {
                    self.send_call(outbound, &pipe);
                }
            }
            Err(failure) => {
                tracing::debug!(%peer, reason = %failure.reason, "opening an RPC pipe failed");
                self.fail_pipe(id, &peer, || failure.to_error(&peer));
            }
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
        let current = matches!(
            self.state.borrow().client_pipes.get(&peer),
            Some(ClientPipe::Connecting { id: c, .. }) if *c == id
        );
        if !current {
            // Reset or closed while it was taken off the executor.
            halves.stop.stop();
            if let Some(mpt) = mpt {
                mpt.shutdown();
            }
            return;
        }
        // The lane is registered before the executor forgets the pipe, so that no call
        // in between opens another one.
        let Some(lane) =
            Lane::start_client(&self.shared, id, peer.clone(), negotiated, halves, mpt)
        else {
            return self.pipe_ended(id, &peer, "this worker is shutting down".into());
        };
        let queued = match self.state.borrow_mut().client_pipes.remove(&peer) {
            Some(ClientPipe::Connecting { queued, .. }) => queued,
            _ => Vec::new(),
        };
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

    async fn client_reader(
        self: Rc<Self>,
        pipe: ReadyPipe,
        peer: String,
        mut receiver: Box<dyn FrameReceiver>,
    ) {
        let id = pipe.id;
        let reason = loop {
            match receiver.recv(FrameLimits::DEFAULT).await {
                Ok(Some(frame)) => match frame.kind {
                    FrameKind::Response | FrameKind::Error => self.on_reply(&pipe, frame),
                    FrameKind::Goodbye => {
                        break "the peer said goodbye (it is shutting down)".to_string()
                    }
                    other => {
                        break format!("the peer sent an unexpected {other} frame on a client pipe")
                    }
                },
                Ok(None) => break "the peer closed the pipe".to_string(),
                Err(e) => break e.to_string(),
            }
        };
        pipe.ended.set(true);
        self.pipe_ended(id, &peer, reason);
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
                let known = self.shared.group().peers.get(name).map(|p| p.id);
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
        let (sender, mut receiver) = if true {
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
                    return;
                }
                Err(NotBlocking::Unsupported(sender, receiver)) => (sender, receiver),
                Err(NotBlocking::Failed(e)) => {
                    tracing::debug!(%peer, error = %e, "an inbound RPC pipe failed");
                    return;
                }
            }
        } else {
            (sender, receiver)
        };
        let tx = self.spawn_writer(sender);
        self.state.borrow_mut().inbound.insert(
            pipe,
            InboundPipe {
                peer: peer.clone(),
                tx,
                negotiated,
                reader: Arc::new(PipeReader::default()),
                exports: Ledger::new(),
            },
        );
        loop {
            match receiver.recv(FrameLimits::DEFAULT).await {
                Ok(Some(frame)) if frame.kind == FrameKind::Request => {
                    self.dispatch(pipe, &peer, peer_id, frame)
                }
                Ok(Some(frame)) if frame.kind == FrameKind::Goodbye => break,
                Ok(Some(frame)) if frame.kind == FrameKind::Ack => {
                    // The caller read the response's out-of-band tensors.
                    let released = self
                        .state
                        .borrow_mut()
                        .inbound
                        .get_mut(&pipe)
                        .and_then(|inbound| inbound.exports.release(frame.kind, frame.message_id));
                    if let Some(released) = released {
                        released.recycle();
                    }
                }
                Ok(Some(frame)) => {
                    tracing::warn!(%peer, kind = %frame.kind, "unexpected frame on an inbound RPC pipe");
                    break;
                }
                Ok(None) => break,
                Err(e) => {
                    let expected = self.shared.lock_calls().shutting_down;
                    if !expected {
                        tracing::debug!(%peer, error = %e, "inbound RPC pipe failed");
                    }
                    break;
                }
            }
        }
        self.state.borrow_mut().inbound.remove(&pipe);
    }

    fn dispatch(&self, pipe: u64, peer: &str, peer_id: WorkerId, frame: IncomingFrame) {
        let jobs = self.jobs.borrow().clone();
        let respond = |message_id, result| self.respond(pipe, message_id, result);
        let Some((negotiated, reader)) = self
            .state
            .borrow()
            .inbound
            .get(&pipe)
            .map(|inbound| (inbound.negotiated, Arc::clone(&inbound.reader)))
        else {
            return;
        };
        match jobs {
            Some(jobs) => lane::serve_request(
                &self.shared,
                &jobs,
                (pipe, &negotiated, &reader),
                peer,
                peer_id,
                frame,
                respond,
            ),
            None => respond(frame.message_id, Err(self.shut_down_error().to_string())),
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
        let (client, inbound) = {
            let mut state = self.state.borrow_mut();
            let client: Vec<(String, ClientPipe)> = state.client_pipes.drain().collect();
            let inbound: Vec<InboundPipe> = state.inbound.drain().map(|(_, p)| p).collect();
            (client, inbound)
        };
        drop(inbound);
        for (peer, pipe) in client {
            match pipe {
                ClientPipe::Ready(ready) => {
                    self.pipe_ended(ready.id, &peer, "this worker reset its pipes".into())
                }
                ClientPipe::Connecting { id, .. } => {
                    self.pipe_ended(id, &peer, "this worker reset its pipes".into())
                }
            }
        }
    }

    async fn close(&self, goodbye: bool) {
        // Every call still pending, on lanes or not, fails as shut down (before the
        // lanes stop, whose readers would call it a broken pipe); the timer stops.
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
        for lane in &lanes {
            lane.stop();
        }
        let (client, mut inbound, lent) = {
            let mut state = self.state.borrow_mut();
            let client: Vec<ClientPipe> = state.client_pipes.drain().map(|(_, p)| p).collect();
            let inbound: Vec<InboundPipe> = state.inbound.drain().map(|(_, p)| p).collect();
            let lent = state.request_exports.end();
            (client, inbound, lent)
        };
        // Lent buffers are released last, once the pipes are closed, so that a peer
        // still reading them sees its pipe end first (and refuses what it read).
        let mut lent: Vec<FrameExports> = lent.into_iter().map(|(_, e)| e).collect();
        for pipe in &mut inbound {
            lent.extend(pipe.exports.end());
        }
        for pipe in client {
            match pipe {
                ClientPipe::Ready(ready) => {
                    if goodbye {
                        let _ = ready.tx.try_send(OwnedFrame::empty(FrameKind::Goodbye, 0));
                    }
                }
                // Its calls are in `pending`, failed below.
                ClientPipe::Connecting { .. } => {}
            }
        }
        if goodbye {
            for pipe in &inbound {
                let _ = pipe.tx.try_send(OwnedFrame::empty(FrameKind::Goodbye, 0));
            }
        }
        drop(inbound);
        for pending in pending {
            self.fail_pending(pending, self.shut_down_error());
        }
        for command in self.shared.mailbox.close_and_take() {
            if let Command::Call(call) = command {
                self.fail_unsent(call, self.shut_down_error());
            }
        }
        self.jobs.borrow_mut().take();
        if goodbye {
            let deadline = std::time::Instant::now() + FLUSH_WAIT;
            while self.writers.get() > 0 && std::time::Instant::now() < deadline {
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
        }
        let tasks: Vec<JoinHandle<()>> = self.tasks.borrow_mut().drain().map(|(_, t)| t).collect();
        for task in &tasks {
            task.cancel();
        }
        // Let the executor drop the cancelled tasks (and close their sockets).
        glommio::timer::sleep(Duration::from_millis(1)).await;
        drop(lent);
    }
}

impl ReadyPipe {
    /// The name of the channel the pipe uses for CPU tensors, for errors.
    fn channel_name(&self) -> &'static str {
        cpu_channel(&self.negotiated, Role::Connector).map_or("basic", |c| c.name())
    }
}

/// Fails a call whose response is being pulled if the pull's task is dropped before it
/// completes the call (the agent closed).
struct PullGuard {
    io: Rc<Io>,
    completion: Option<Arc<Completion>>,
}

impl Drop for PullGuard {
    fn drop(&mut self) {
        if let Some(completion) = self.completion.take() {
            self.io
                .complete(&completion, Err(self.io.shut_down_error()));
        }
    }
}

/// Tells the callee on `pipe` that the out-of-band tensors of its response
/// `message_id` were read (or will never be): it may release them. A pipe that is
/// gone needs no ack (its end releases them).
fn ack(pipe: &ReadyPipe, message_id: u64) {
    let _ = pipe
        .tx
        .try_send(OwnedFrame::empty(FrameKind::Ack, message_id));
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
