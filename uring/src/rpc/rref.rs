//! Remote references ([`RRef`], PyTorch's `RRef`) on the agent: `remote()` returns one at
//! once, the owner keeps the handler's value, `to_here` fetches it, and an RRef travels
//! to a third worker as a fork. Every rule of the reference counting is core's
//! [`RRefContext`] (`rdzv_core::rpc::rref`); this module holds that machine behind one
//! lock, keeps the owner's values, moves the machine's messages and keeps its time.
//!
//! **How the messages travel.** Each machine message is an ordinary call of the agent
//! to a reserved handler (`__rdzv_rref_*`), its postcard bytes (core's
//! [`wire`](rdzv_core::rpc::rref::wire)) in the payload, rather than a new frame kind:
//! calls already have pipes, timeouts, the `join` count and fault injection, and a
//! new frame kind would have to be taught to every lane, the pipe machine and the
//! faulty sender, which other work is rewriting. The cost is a response frame per
//! message, which the protocol uses: a control message's `Ack` rides back in its
//! call's response (so answering never needs a call of its own, even while `join`
//! holds this worker's calls). The control handlers run [`Inline`] on
//! the inbound lane, so messages from one worker are handled in the order they were
//! sent, which the machine assumes (the pump, the only sender of machine messages,
//! holds back messages to a worker while a call to it is still opening the pipe, see
//! `pump`; what is not covered is a pipe that breaks with messages in flight while
//! the next pipe already delivers). There is one handler name per message kind
//! (`__rdzv_rref_fork_request`, `__rdzv_rref_child_accept`, `__rdzv_rref_user_delete`,
//! `__rdzv_rref_remote_ret`), so fault injection can fail each, by PyTorch's names
//! (`RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`, `RREF_USER_DELETE`; see `fault_alias`).
//!
//! **The calls.** `remote(to, handler, message)` sends `__rdzv_rref_remote` with the
//! RRef's ids in front of the payload; the owner's handler (on the worker pool) feeds
//! the machine the `RemoteCall` (the slot exists and `RemoteRet` goes back at once),
//! then runs `handler` and keeps its result (value or error text) keyed by RRef id.
//! `to_here` is a call to `__rdzv_rref_fetch`, answered from that table; if the value
//! is not there yet the request waits for it without holding a pool thread (an async
//! server call, answered when the value is stored or the caller's timeout is over).
//! `remote()` to this worker itself runs the handler on a thread of its own. An RRef goes to another worker as bytes made by [`RRef::fork_to`], which
//! the receiver turns back into an RRef with [`RpcClient::rref_from_fork`] (an RRef is
//! not a field of [`Message`]).
//!
//! **The pump.** One thread per agent, started with the first RRef, sends what the
//! machine asks for, polls those calls' futures (their wakers wake it), feeds back the
//! acks and the failures of `remote()` calls, and calls `handle_timeout` when
//! `poll_timeout` says. It holds the agent weakly and ends with it.
//!
//! | module | does |
//! |---|---|
//! | this one | the machine behind its lock, the owner's values, the reserved handlers, the pump |
//! | `handle` | [`RRef`] and `remote()`: what the application holds and calls |
//! | `debug` | debug counts, the `dist_utils` waits, `join`'s settling and leak report |
//!
//! **Shutdown.** A graceful `join` first settles RRefs (`settle_for_join`): it waits until every
//! user this worker holds is confirmed and every control message answered, releases
//! every user left (`release_all`), waits until the owners here are released too, and
//! then reports whatever could not be settled, by count and owner, in the log and in
//! [`RpcAgent::rref_shutdown_report`](super::RpcAgent::rref_shutdown_report).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::wire::{FetchRequest, RemoteCallHeader, WireKind};
use rdzv_core::rpc::rref::{
    ControlKind, DebugInfo, ForkData, ForkId, Leak, RRefContext, RRefEvent, RRefHandle, RRefId,
    RRefMessage, RetryOptions, Transmit, ValueOutcome,
};
use rdzv_core::rpc::timeouts::Instant;

use super::client::RpcClient;
use super::error::RpcError;
use super::lane::{self, Job, Responder};
use super::message::{run_handler, CallContext, Inline, Message, RpcFuture};
use super::shared::Shared;

mod debug;
mod handle;

pub(crate) use debug::settle_for_join;
pub use debug::{RRefLeak, RRefShutdownReport};
pub(crate) use handle::remote;
pub use handle::{RRef, UserRRef};

/// The `remote()` call.
pub(crate) const REMOTE: &str = "__rdzv_rref_remote";
/// `to_here`.
pub(crate) const FETCH: &str = "__rdzv_rref_fetch";
/// The owner's `RemoteRet`.
pub(crate) const REMOTE_RET: &str = "__rdzv_rref_remote_ret";
/// `RREF_FORK_REQUEST`.
pub(crate) const FORK_REQUEST: &str = "__rdzv_rref_fork_request";
/// `RREF_CHILD_ACCEPT`.
pub(crate) const CHILD_ACCEPT: &str = "__rdzv_rref_child_accept";
/// `RREF_USER_DELETE`.
pub(crate) const USER_DELETE: &str = "__rdzv_rref_user_delete";
/// An `Ack` sent on its own (the machine's acks normally ride in responses).
pub(crate) const ACK: &str = "__rdzv_rref_ack";
/// A worker's debug counts, for `wait_until_owners_and_forks_on_rank`.
pub(crate) const DEBUG_INFO: &str = "__rdzv_rref_debug_info";

/// The longest the pump sleeps without a reason to wake.
const PUMP_IDLE: Duration = Duration::from_millis(500);
/// How often the test helpers poll.
const HELPER_POLL: Duration = Duration::from_millis(20);

fn control_handler(kind: ControlKind) -> &'static str {
    match kind {
        ControlKind::ForkRequest => FORK_REQUEST,
        ControlKind::ChildAccept => CHILD_ACCEPT,
        ControlKind::UserDelete => USER_DELETE,
    }
}

/// PyTorch's message-type name for a reserved RRef handler, which fault injection
/// ([`FaultInjection::fail_handlers`](super::FaultInjection::fail_handlers)) may use
/// instead of the handler name: `RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`,
/// `RREF_USER_DELETE`.
pub(crate) fn fault_alias(handler: &str) -> Option<&'static str> {
    [
        ControlKind::ForkRequest,
        ControlKind::ChildAccept,
        ControlKind::UserDelete,
    ]
    .into_iter()
    .find(|&kind| control_handler(kind) == handler)
    .map(ControlKind::name)
}

/// What the pump is waiting for on a call it sent (or was handed).
#[derive(Debug, Clone, Copy)]
enum Sent {
    /// A control message to this worker: its response holds the `Ack`.
    Control { to: WorkerId },
    /// A `remote()` call to worker `to`: its failure fails the RRef's `to_here`, and its
    /// answer confirms the user as `RemoteRet` does (in case that message was lost).
    RemoteCall {
        rref: RRefId,
        fork: ForkId,
        to: WorkerId,
    },
    /// Anything else: a failure is only logged (the machine retries what matters).
    Plain,
}

/// Wakes the pump: a condition variable with a flag, and a [`Waker`] for futures.
#[derive(Debug, Default)]
struct Signal {
    woken: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    fn notify(&self) {
        *self.woken.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_one();
    }

    fn wait(&self, timeout: Duration) {
        let woken = self.woken.lock().unwrap_or_else(|p| p.into_inner());
        let (mut woken, _) = self
            .cv
            .wait_timeout_while(woken, timeout, |w| !*w)
            .unwrap_or_else(|p| p.into_inner());
        *woken = false;
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.notify();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.notify();
    }
}

struct State {
    machine: RRefContext,
    /// The owner's values: the handler's message, or its error text.
    values: HashMap<RRefId, Result<Message, String>>,
    /// `remote()` calls of this worker that failed, by RRef.
    failed: HashMap<RRefId, String>,
    /// Messages for the pump to send.
    outbox: VecDeque<Transmit>,
    /// Futures for the pump to watch (`remote()` calls).
    handed: Vec<(Sent, RpcFuture)>,
    pump_started: bool,
    report: Option<RRefShutdownReport>,
    /// `to_here` requests waiting on this owner for their value.
    waiters: Vec<Waiter>,
}

/// A `to_here` request answered when its value exists, or when its wait is over; it
/// holds no pool thread meanwhile (the call counts as an async server call).
struct Waiter {
    rref: RRefId,
    responder: Responder,
    message_id: u64,
    deadline: Option<std::time::Instant>,
    wait: Duration,
}

/// One worker's RRefs: the machine, the owner's values, the pump's signal.
pub(crate) struct RRefs {
    state: Mutex<State>,
    /// Signalled after every change of the machine or the values.
    changed: Condvar,
    signal: Arc<Signal>,
    epoch: std::time::Instant,
    retry: RetryOptions,
}

impl RRefs {
    /// The RRefs of worker `me`, retrying control messages as `retry` says.
    pub(crate) fn new(me: WorkerId, retry: RetryOptions) -> RRefs {
        RRefs {
            state: Mutex::new(State {
                machine: RRefContext::new(me, retry),
                values: HashMap::new(),
                failed: HashMap::new(),
                outbox: VecDeque::new(),
                handed: Vec::new(),
                pump_started: false,
                report: None,
                waiters: Vec::new(),
            }),
            changed: Condvar::new(),
            signal: Arc::new(Signal::default()),
            epoch: std::time::Instant::now(),
            retry,
        }
    }

    fn now(&self) -> Instant {
        Instant::from_duration(self.epoch.elapsed())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the state, then applies the machine's events, queues its messages
    /// (keeping back the `Ack` that `reply_to` names, which is returned), signals
    /// waiters and wakes the pump if there is anything to send.
    fn with<R>(
        &self,
        reply_to: Option<(WorkerId, ControlKind, ForkId)>,
        f: impl FnOnce(&mut State, Instant) -> R,
    ) -> (R, Option<RRefMessage>) {
        let now = self.now();
        let mut state = self.lock();
        let result = f(&mut state, now);
        let reply = drain(&mut state, reply_to);
        let wake = !state.outbox.is_empty() || !state.handed.is_empty();
        drop(state);
        self.changed.notify_all();
        if wake {
            self.signal.notify();
        }
        (result, reply)
    }

    fn update<R>(&self, f: impl FnOnce(&mut State, Instant) -> R) -> R {
        self.with(None, f).0
    }

    /// PyTorch's debug counts.
    pub(crate) fn debug_info(&self) -> DebugInfo {
        self.lock().machine.debug_info()
    }

    /// The report of the last graceful shutdown.
    pub(crate) fn report(&self) -> Option<RRefShutdownReport> {
        self.lock().report.clone()
    }

    /// Keeps a finished handler's result for `rref`, unless nothing references it, and
    /// answers the `to_here` requests waiting for it.
    fn store_value(&self, shared: &Shared, rref: RRefId, result: Result<Message, String>) {
        let answered = self.update(|state, _| {
            let (ready, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut state.waiters)
                .into_iter()
                .partition(|w| w.rref == rref);
            state.waiters = waiting;
            if state.machine.value_ready(rref, result.is_ok()) == ValueOutcome::Store {
                state.values.insert(rref, result.clone());
            }
            ready
        });
        for waiter in answered {
            answer(shared, waiter, result.clone());
        }
    }

    /// Answers the `to_here` requests whose wait is over; the earliest wait left.
    fn expire_waiters(&self, shared: &Shared) -> Option<std::time::Instant> {
        let now = std::time::Instant::now();
        let (expired, next) = {
            let mut state = self.lock();
            let (expired, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut state.waiters)
                .into_iter()
                .partition(|w| w.deadline.is_some_and(|d| d <= now));
            state.waiters = waiting;
            let next = state.waiters.iter().filter_map(|w| w.deadline).min();
            (expired, next)
        };
        for waiter in expired {
            let error = not_ready(shared, waiter.rref, waiter.wait);
            answer(shared, waiter, Err(error));
        }
        next
    }

    /// Waits until the owner's value of `rref` exists (its clone, or the handler's
    /// error text), at most until `deadline` (`None`: no limit).
    fn wait_value(
        &self,
        rref: RRefId,
        deadline: Option<std::time::Instant>,
    ) -> Result<Result<Message, String>, ()> {
        let mut state = self.lock();
        loop {
            if let Some(value) = state.values.get(&rref) {
                return Ok(value.clone());
            }
            state = match deadline {
                None => self.changed.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Err(());
                    }
                    self.changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Waits until `done` holds for the state, at most `timeout`; whether it held.
    fn wait_for(&self, timeout: Duration, done: impl Fn(&State) -> bool) -> bool {
        let state = self.lock();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |s| !done(s))
            .unwrap_or_else(|p| p.into_inner());
        done(&state)
    }

    /// The longest a control message keeps being retried: the sum of its waits.
    fn retry_window(&self) -> Duration {
        (0..=self.retry.max_retries.min(64))
            .map(|attempt| self.retry.delay(attempt))
            .fold(Duration::ZERO, Duration::saturating_add)
    }

    /// Starts the pump if it is not running.
    fn ensure_pump(&self, shared: &Arc<Shared>) {
        {
            let mut state = self.lock();
            if state.pump_started {
                return;
            }
            state.pump_started = true;
        }
        let weak = Arc::downgrade(shared);
        let signal = Arc::clone(&self.signal);
        let spawned = std::thread::Builder::new()
            .name("rdzv-rref-pump".into())
            .spawn(move || pump(&weak, &signal));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the RRef pump thread; RRef control messages will not be sent");
            self.lock().pump_started = false;
        }
    }
}

/// Sends a deferred `to_here`'s answer.
fn answer(shared: &Shared, waiter: Waiter, result: Result<Message, String>) {
    shared.lock_calls().metrics.calls.server_call_finished(true);
    waiter.responder.respond(shared, waiter.message_id, result);
}

fn not_ready(shared: &Shared, rref: RRefId, wait: Duration) -> String {
    format!(
        "the value of RRef {rref} is not ready on its owner {} after {wait:?}: its remote() \
         handler is still running, or its call never arrived",
        shared.me.name()
    )
}

/// The worker pool's hook for `to_here` on the owner: a request whose value exists is
/// answered at once; one whose value does not yet waits without a pool thread (an async
/// server call) until [`RRefs::store_value`] or its deadline. Every other job is given
/// back to run as usual.
pub(crate) fn take_fetch(shared: &Shared, job: Job) -> Option<Job> {
    if job.ctx.handler != FETCH {
        return Some(job);
    }
    let Job {
        responder,
        ctx,
        message,
        ..
    } = job;
    let finish_now = |result| {
        shared
            .lock_calls()
            .metrics
            .calls
            .server_call_finished(false);
        responder.respond(shared, ctx.message_id, result);
    };
    let request = match FetchRequest::from_bytes(&message.payload) {
        Ok(request) => request,
        Err(e) => {
            finish_now(Err(e.to_string()));
            return None;
        }
    };
    let wait = Duration::from_millis(request.wait_ms);
    let mut state = shared.rrefs.lock();
    if let Some(value) = state.values.get(&request.rref).cloned() {
        drop(state);
        finish_now(value);
        return None;
    }
    let deadline = (request.wait_ms != 0).then(|| std::time::Instant::now() + wait);
    shared.lock_calls().metrics.calls.server_call_went_async();
    state.waiters.push(Waiter {
        rref: request.rref,
        responder,
        message_id: ctx.message_id,
        deadline,
        wait,
    });
    drop(state);
    // The pump keeps the deadline.
    shared.rrefs.signal.notify();
    None
}

/// Applies the machine's events and moves its messages to the outbox, except the `Ack`
/// named by `reply_to`, which is returned.
fn drain(
    state: &mut State,
    reply_to: Option<(WorkerId, ControlKind, ForkId)>,
) -> Option<RRefMessage> {
    while let Some(event) = state.machine.poll_event() {
        match event {
            RRefEvent::DeleteValue { rref } => {
                state.values.remove(&rref);
            }
            RRefEvent::Confirmed { .. } => {}
            RRefEvent::GaveUp { to, kind, fork } => tracing::warn!(
                to = to.get(),
                %kind,
                %fork,
                "gave up retrying an RRef control message; what it protected leaks and is reported at shutdown"
            ),
        }
    }
    let mut reply = None;
    while let Some(transmit) = state.machine.poll_transmit() {
        match (reply_to, transmit.message) {
            (
                Some((to, kind, fork)),
                RRefMessage::Ack {
                    kind: k, fork: f, ..
                },
            ) if transmit.to == to && k == kind && f == fork => {
                reply = Some(transmit.message);
            }
            _ => state.outbox.push_back(transmit),
        }
    }
    reply
}

/// The name of worker `id`, if it is in the group.
fn worker_name(shared: &Shared, id: WorkerId) -> Option<String> {
    shared
        .group()
        .peers
        .iter()
        .find(|(_, peer)| peer.id == id)
        .map(|(name, _)| name.clone())
}

fn worker_id(shared: &Shared, name: &str) -> Result<WorkerId, RpcError> {
    shared
        .group()
        .peers
        .get(name)
        .map(|peer| peer.id)
        .ok_or_else(|| RpcError::UnknownWorker {
            name: name.to_string(),
        })
}

/// The pump: sends what the machine asks for, watches those calls, keeps time.
///
/// Messages to one worker must arrive in the order they were sent. A call made while
/// the pipe to its peer is not open yet goes through the I/O thread, and a later call
/// made once the pipe is open goes straight onto it and can overtake the first (a
/// `FORK_REQUEST` held up there would then count a fork again after its
/// `USER_DELETE`). So while a call to a worker without an open pipe is in flight, the
/// pump holds back every later message to that worker, in order.
fn pump(weak: &Weak<Shared>, signal: &Arc<Signal>) {
    let waker = Waker::from(Arc::clone(signal));
    let mut cx = Context::from_waker(&waker);
    // Each call with the worker it opened a pipe to, if it went out without one.
    let mut flight: Vec<(Sent, RpcFuture, Option<WorkerId>)> = Vec::new();
    let mut opening: HashSet<WorkerId> = HashSet::new();
    let mut held: VecDeque<Transmit> = VecDeque::new();
    loop {
        let sleep = {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let rrefs = &shared.rrefs;
            let (outbox, handed) = {
                let mut state = rrefs.lock();
                (
                    std::mem::take(&mut state.outbox),
                    std::mem::take(&mut state.handed),
                )
            };
            flight.extend(
                handed
                    .into_iter()
                    .map(|(sent, future)| (sent, future, None)),
            );
            held.extend(outbox);
            for transmit in std::mem::take(&mut held) {
                if opening.contains(&transmit.to) {
                    held.push_back(transmit);
                    continue;
                }
                let to = transmit.to;
                if let Some((sent, future, opened)) = send(&shared, transmit) {
                    if opened {
                        opening.insert(to);
                    }
                    flight.push((sent, future, opened.then_some(to)));
                }
            }
            let mut done = Vec::new();
            flight.retain_mut(
                |(sent, future, opened)| match Pin::new(future).poll(&mut cx) {
                    Poll::Ready(result) => {
                        if let Some(to) = opened {
                            opening.remove(to);
                        }
                        done.push((*sent, result));
                        false
                    }
                    Poll::Pending => true,
                },
            );
            let next = rrefs.update(|state, now| {
                for (sent, result) in done {
                    on_sent(state, now, sent, result);
                }
                state.machine.handle_timeout(now);
                state.machine.poll_timeout()
            });
            let waiter = rrefs
                .expire_waiters(&shared)
                .map(|at| at.saturating_duration_since(std::time::Instant::now()));
            let sendable = held.iter().any(|t| !opening.contains(&t.to));
            let more = sendable || !rrefs.lock().outbox.is_empty();
            let retry = next.map(|at| at.saturating_duration_since(rrefs.now()));
            match (retry, waiter) {
                _ if more => Duration::ZERO,
                (Some(a), Some(b)) => a.min(b).min(PUMP_IDLE).max(Duration::from_micros(100)),
                (Some(a), None) | (None, Some(a)) => {
                    a.min(PUMP_IDLE).max(Duration::from_micros(100))
                }
                (None, None) => PUMP_IDLE,
            }
        };
        if !sleep.is_zero() {
            signal.wait(sleep);
        }
    }
}

/// Sends one machine message as a call: the future to watch, and whether the call went
/// out with no pipe open to its peer.
fn send(shared: &Arc<Shared>, transmit: Transmit) -> Option<(Sent, RpcFuture, bool)> {
    let Some(to) = worker_name(shared, transmit.to) else {
        tracing::debug!(
            to = transmit.to.get(),
            "an RRef message for a worker that left the group is dropped"
        );
        return None;
    };
    let (handler, sent) = match transmit.message.wire_kind() {
        WireKind::Control(kind) => (control_handler(kind), Sent::Control { to: transmit.to }),
        WireKind::RemoteRet => (REMOTE_RET, Sent::Plain),
        WireKind::Ack => (ACK, Sent::Plain),
        // The `remote()` call itself carries it; the machine never asks for it.
        WireKind::RemoteCall => return None,
    };
    let payload = match transmit.message.to_bytes() {
        Ok(payload) => payload,
        Err(e) => {
            tracing::error!(error = %e, "cannot encode an RRef message");
            return None;
        }
    };
    let opening = lane::client_lane(shared, &to).is_none();
    let future =
        RpcClient::new(Arc::clone(shared)).rpc_async(&to, handler, Message::from_payload(payload));
    Some((sent, future, opening))
}

/// A call the pump sent (or was handed) completed.
fn on_sent(state: &mut State, now: Instant, sent: Sent, result: Result<Message, RpcError>) {
    match (sent, result) {
        (Sent::Control { to }, Ok(reply)) => match RRefMessage::from_bytes(&reply.payload) {
            Ok(ack @ RRefMessage::Ack { .. }) => state.machine.handle_message(now, to, ack),
            Ok(other) => tracing::warn!(
                ?other,
                "an RRef control message was answered with something other than its Ack"
            ),
            Err(e) => tracing::warn!(error = %e, "an RRef control message's answer is malformed"),
        },
        (Sent::RemoteCall { rref, .. }, Err(e)) => {
            state.failed.insert(rref, e.to_string());
        }
        (Sent::RemoteCall { rref, fork, to }, Ok(_)) => {
            // The owner handled the call before answering it: as good as `RemoteRet`.
            state
                .machine
                .handle_message(now, to, RRefMessage::RemoteRet { rref, fork });
        }
        (Sent::Control { .. } | Sent::Plain, Err(e)) => {
            // The machine sends a control message again at its retry time.
            tracing::debug!(error = %e, "an RRef message was not delivered");
        }
        (Sent::Plain, Ok(_)) => {}
    }
}

/// Registers the reserved handlers (the agent owns its handlers; they hold it weakly).
pub(crate) fn register_handlers(shared: &Arc<Shared>) {
    let mut handlers = shared.handlers.write().unwrap_or_else(|p| p.into_inner());
    let weak = Arc::downgrade(shared);
    let message = move |ctx: &CallContext, m: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        on_message(&shared, ctx, &m)
    };
    let message: Arc<dyn super::Handler> = Arc::new(Inline(message));
    for name in [REMOTE_RET, FORK_REQUEST, CHILD_ACCEPT, USER_DELETE, ACK] {
        handlers.insert(name.to_string(), Arc::clone(&message));
    }
    let weak = Arc::downgrade(shared);
    let remote = move |ctx: &CallContext, m: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        on_remote(&shared, ctx, m)
    };
    handlers.insert(REMOTE.to_string(), Arc::new(remote));
    let weak = Arc::downgrade(shared);
    let fetch = move |_: &CallContext, m: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        on_fetch(&shared, &m)
    };
    handlers.insert(FETCH.to_string(), Arc::new(fetch));
    let weak = Arc::downgrade(shared);
    let debug = move |_: &CallContext, _: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        Ok(Message::from_payload(encode_counts(
            &shared.rrefs.debug_info(),
        )))
    };
    handlers.insert(DEBUG_INFO.to_string(), Arc::new(Inline(debug)));
}

/// A machine message from `ctx.caller_id`; a control message's `Ack` is the response.
fn on_message(shared: &Arc<Shared>, ctx: &CallContext, m: &Message) -> Result<Message, String> {
    let message = RRefMessage::from_bytes(&m.payload).map_err(|e| e.to_string())?;
    let from = ctx.caller_id;
    let reply_to = match message {
        RRefMessage::Control { kind, fork, .. } => Some((from, kind, fork)),
        RRefMessage::RemoteCall { .. } => {
            return Err("a RemoteCall travels in the remote() call, not alone".into())
        }
        _ => None,
    };
    let ((), ack) = shared.rrefs.with(reply_to, |state, now| {
        state.machine.handle_message(now, from, message);
    });
    shared.rrefs.ensure_pump(shared);
    match ack {
        Some(ack) => ack
            .to_bytes()
            .map(Message::from_payload)
            .map_err(|e| e.to_string()),
        None => Ok(Message::default()),
    }
}

/// The owner's side of `remote()`: the slot, `RemoteRet`, then the handler's value.
fn on_remote(shared: &Arc<Shared>, ctx: &CallContext, m: Message) -> Result<Message, String> {
    let (header, payload) = RemoteCallHeader::split(&m.payload).map_err(|e| e.to_string())?;
    let RemoteCallHeader {
        rref,
        fork,
        handler,
    } = header;
    let payload = payload.to_vec();
    let from = ctx.caller_id;
    shared.rrefs.update(|state, now| {
        state
            .machine
            .handle_message(now, from, RRefMessage::RemoteCall { rref, fork });
    });
    shared.rrefs.ensure_pump(shared);
    let request = Message { payload, ..m };
    let result = run_user_handler(shared, ctx, &handler, request);
    shared.rrefs.store_value(shared, rref, result);
    Ok(Message::default())
}

/// Runs the application's `handler` for a `remote()` call.
fn run_user_handler(
    shared: &Shared,
    ctx: &CallContext,
    handler: &str,
    request: Message,
) -> Result<Message, String> {
    let found = (!handler.starts_with("__rdzv_"))
        .then(|| shared.handler(handler))
        .flatten();
    let Some(found) = found else {
        return Err(format!(
            "no RPC handler named {handler} is registered on worker {}; register it before \
             peers call remote() with it",
            shared.me.name()
        ));
    };
    let ctx = CallContext {
        handler: handler.to_string(),
        ..ctx.clone()
    };
    run_handler(found.as_ref(), &ctx, request)
}

/// `to_here` on the owner, where the pool's hook ([`take_fetch`]) did not serve it: the
/// value, waiting for it on this thread as the request allows.
fn on_fetch(shared: &Shared, m: &Message) -> Result<Message, String> {
    let request = FetchRequest::from_bytes(&m.payload).map_err(|e| e.to_string())?;
    let wait = Duration::from_millis(request.wait_ms);
    let deadline = (request.wait_ms != 0).then(|| std::time::Instant::now() + wait);
    match shared.rrefs.wait_value(request.rref, deadline) {
        Ok(value) => value,
        Err(()) => Err(not_ready(shared, request.rref, wait)),
    }
}

fn encode_counts(info: &DebugInfo) -> Vec<u8> {
    [
        info.num_owner_rrefs,
        info.num_pending_futures,
        info.num_pending_users,
        info.num_forks,
    ]
    .iter()
    .flat_map(|&n| (n as u64).to_le_bytes())
    .collect()
}

fn decode_counts(bytes: &[u8]) -> Option<DebugInfo> {
    let mut numbers = bytes
        .chunks_exact(8)
        .map(|c| <[u8; 8]>::try_from(c).ok().map(u64::from_le_bytes));
    let mut next = || {
        numbers
            .next()
            .flatten()
            .and_then(|n| usize::try_from(n).ok())
    };
    let info = DebugInfo {
        num_owner_rrefs: next()?,
        num_pending_futures: next()?,
        num_pending_users: next()?,
        num_forks: next()?,
    };
    (bytes.len() == 32).then_some(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_injection_names_the_control_messages_as_pytorch() {
        assert_eq!(fault_alias(FORK_REQUEST), Some("RREF_FORK_REQUEST"));
        assert_eq!(fault_alias(CHILD_ACCEPT), Some("RREF_CHILD_ACCEPT"));
        assert_eq!(fault_alias(USER_DELETE), Some("RREF_USER_DELETE"));
        assert_eq!(fault_alias(REMOTE_RET), None);
        assert_eq!(fault_alias("echo"), None);
    }

    #[test]
    fn counts_round_trip_and_bad_bytes_are_refused() {
        let info = DebugInfo {
            num_owner_rrefs: 3,
            num_pending_futures: 1,
            num_pending_users: 0,
            num_forks: 7,
        };
        assert_eq!(decode_counts(&encode_counts(&info)), Some(info));
        assert_eq!(decode_counts(&[0; 31]), None);
        assert_eq!(decode_counts(&[0; 40]), None);
    }

    #[test]
    fn the_ack_named_is_kept_back_for_the_response() {
        let owner = WorkerId::from(1);
        let child = WorkerId::from(2);
        let rref = RRefId {
            created_on: WorkerId::from(0),
            local_id: 0,
        };
        let fork = ForkId {
            created_on: WorkerId::from(0),
            local_id: 1,
        };
        let mut state = State {
            machine: RRefContext::new(owner, RetryOptions::default()),
            values: HashMap::new(),
            failed: HashMap::new(),
            outbox: VecDeque::new(),
            handed: Vec::new(),
            pump_started: false,
            report: None,
            waiters: Vec::new(),
        };
        let now = Instant::from_nanos(0);
        state.machine.handle_message(
            now,
            child,
            RRefMessage::Control {
                kind: ControlKind::ForkRequest,
                rref,
                fork,
            },
        );
        let reply = drain(&mut state, Some((child, ControlKind::ForkRequest, fork)));
        assert_eq!(
            reply,
            Some(RRefMessage::Ack {
                kind: ControlKind::ForkRequest,
                rref,
                fork
            })
        );
        assert!(state.outbox.is_empty());
        assert_eq!(state.machine.debug_info().num_forks, 1);
    }
}
