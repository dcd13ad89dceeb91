//! The agent's RRef runtime: `remote()` returns an [`RRef`] at once, the owner keeps the
//! handler's value, `to_here` fetches it, and an RRef travels to a third worker as a
//! fork. Every rule of the reference counting is core's [`RRefContext`]
//! (`rdzv_core::rpc::rref`); this module holds that machine behind one lock, keeps the
//! owner's values, moves the machine's messages and keeps its time. The application's
//! handle is [`super::rref`], which reaches this runtime through the
//! [`RRefRuntime`] seam.
//!
//! **How the messages travel.** Each machine message is an ordinary call of the agent
//! to a reserved handler (`__rdzv_rref_*`, core's `wire::handler` names), its postcard bytes
//! (core's [`wire`](rdzv_core::rpc::rref::wire)) in the payload, rather than a new frame
//! kind: calls already have pipes, timeouts, the `join` count and fault injection, and
//! a new frame kind would have to be taught to every lane, the pipe machine and the
//! faulty sender. The cost is a response frame per message, which the protocol uses: a
//! control message's `Ack` rides back in its call's response (so answering never needs
//! a call of its own, even while `join` holds this worker's calls). The control
//! handlers run [`Inline`](super::handler::Inline) on the inbound lane, so messages from
//! one worker are handled in the order they were sent, which the machine assumes (the
//! pump, the only sender of machine messages, holds back messages to a worker while a
//! call to it is still opening the pipe, see `pump`; what is not covered is a pipe that
//! breaks with messages in flight while the next pipe already delivers). There is one
//! handler name per message kind, so fault injection can fail each, by PyTorch's names
//! (`RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`, `RREF_USER_DELETE`; see core's
//! `control_message_name`).
//!
//! **The calls.** `remote(to, handler, message)` sends `__rdzv_rref_remote` with the
//! RRef's ids in front of the payload. The owner feeds its machine the `RemoteCall`
//! when the request arrives, in pipe order, through the seam's `remote_call_arrived`
//! (the slot exists at once): the caller's later control messages on that pipe are
//! handled inline, and must not overtake the call while it waits in the pool's queue.
//! The reserved handler, on the worker pool (or inline, when `handler` is an inline
//! one), then runs `handler` and keeps its result (value or error text) keyed by RRef
//! id. The call's response is the machine's `RemoteRet`, as in PyTorch
//! (`assignOwnerRRef`; core's `handle_call` returns it rather than queuing it): sent once
//! the handler has run, it confirms the caller's user,
//! fed to the caller's machine on the thread that completes the call. `to_here` is a
//! call to `__rdzv_rref_fetch`, which the inbound lane hands to `fetch_arrived` on its
//! reader: answered from that table, or, if the value is not there yet, when it is
//! stored or the caller's timeout is over, holding no thread meanwhile (an async server
//! call). So a `remote()` and its `to_here` cost two round trips and, for a handler on
//! the pool, one hand-off to it. `remote()` to this worker itself runs the handler on
//! a thread of its own.
//!
//! **A failed `remote()` call** (the call itself, not its handler: the owner could not
//! be reached, the send failed, the call timed out) is PyTorch's best-effort error
//! handling: the failure is recorded on the user (core's `remote_failed`, and its error
//! here), so the user stops being pending and `join` does not wait for it or report it;
//! `to_here` and `fork_to` then fail with it, naming the owner; dropping the RRef still
//! sends `USER_DELETE`, in case the call reached the owner before failing. A failure
//! known when `remote()` returns (a send that failed at once, as fault injection's) is
//! recorded before it returns; one that comes later is recorded by the pump, and a
//! `to_here` already under way then fails with the owner's answer or its timeout, and
//! says that the call failed if it knows by then. A failing *handler* is not a failed
//! call: the owner keeps its error as the value, and `to_here` returns it. An RRef
//! goes to another worker as bytes made by [`RRef::fork_to`], which the receiver turns
//! back into an RRef with [`RpcClient::rref_from_fork`] (an RRef is not a field of
//! [`Message`]).
//!
//! **The pump.** One thread per agent, started with the first RRef, sends what the
//! machine asks for, polls those calls' futures (their wakers wake it), feeds back the
//! acks, and calls `handle_timeout` when `poll_timeout` says. It holds the runtime weakly and ends with the agent.
//!
//! | module | does |
//! |---|---|
//! | this one | the machine behind its lock, the owner's values, the waits on them |
//! | `users` | the [`RRefRuntime`] seam: `remote()`, forks, `to_here`, local drops |
//! | `serve` | the reserved handlers, and the pool's hook for `to_here` on the owner |
//! | `pump` | the thread that sends the machine's messages and keeps its time |
//! | `debug` | debug counts, the `dist_utils` waits, `join`'s settling and leak report |
//!
//! **Shutdown.** A graceful `join` first settles RRefs (`settle_for_join`): it waits
//! until every user this worker holds is confirmed and every control message answered,
//! releases every user left (`release_all`), waits until the owners here are released
//! too, and then reports whatever could not be settled, by count and owner, in the log
//! and in `RpcAgent::rref_shutdown_report`.
//!
//! **Ordering.** The runtime holds the agent's pieces it needs (the group and handlers,
//! the call counts) and the agent's dispatcher (what it calls through) only weakly: an
//! [`RRef`] kept after its agent is gone fails its calls with [`CallError::ShutDown`]
//! instead of keeping the agent alive.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rdzv_core::rpc::name::{WorkerId, WorkerInfo};
use rdzv_core::rpc::rref::{
    ForkId, RRefContext, RRefEvent, RRefId, RetryOptions, Transmit, ValueOutcome,
};
use rdzv_core::rpc::timeouts::Instant;

use super::client::{Caller, RpcClient};
use super::counters::JoinGate;
use super::dispatch::Dispatch;
use super::error::CallError;
use super::message::Message;
use super::options::ValueReleased;
use super::registry::Registry;
use super::rref::{RRefShutdownReport, Respond};

mod debug;
mod pump;
mod serve;
mod users;

pub(crate) use debug::{
    debug_info_of, settle_for_join, wait_until_owners_and_forks_on_rank,
    wait_until_pending_futures_and_users_flushed,
};
pub(crate) use serve::register_handlers;

use pump::Signal;

/// How often the test helpers poll.
const HELPER_POLL: Duration = Duration::from_millis(20);

struct State {
    machine: RRefContext,
    /// The owner's values: the handler's message, or its error text.
    values: HashMap<RRefId, Result<Message, String>>,
    /// Why the `remote()` call of each user here whose call failed did so (the call's
    /// error, the source of every `to_here` that reports it), by fork (kept while the
    /// machine holds the user).
    failed: HashMap<ForkId, Arc<CallError>>,
    /// Messages for the pump to send.
    outbox: VecDeque<Transmit>,
    pump_started: bool,
    report: Option<RRefShutdownReport>,
    /// `to_here` requests waiting on this owner for their value.
    waiters: Vec<Waiter>,
    /// Owner values let go of since the state was last unlocked, for `on_release`.
    released: Vec<Message>,
}

impl State {
    fn new(me: WorkerId, retry: RetryOptions) -> State {
        State {
            machine: RRefContext::new(me, retry),
            values: HashMap::new(),
            failed: HashMap::new(),
            outbox: VecDeque::new(),
            pump_started: false,
            report: None,
            waiters: Vec::new(),
            released: Vec::new(),
        }
    }
}

/// A `to_here` request answered when its value exists, or when its wait is over; it
/// holds no pool thread meanwhile (the call counts as an async server call).
struct Waiter {
    rref: RRefId,
    respond: Respond,
    deadline: Option<std::time::Instant>,
    wait: Duration,
}

/// One worker's RRefs: the machine, the owner's values, the pump's signal.
pub(crate) struct RRefs {
    me: WorkerInfo,
    /// The group (names and ids) and the handlers.
    registry: Arc<Registry>,
    /// The call counts (`to_here` waits are async server calls).
    gate: Arc<JoinGate>,
    /// The agent's dispatcher, for calls; gone once the agent is.
    dispatch: Weak<Dispatch>,
    state: Mutex<State>,
    /// Signalled after every change of the machine or the values.
    changed: Condvar,
    signal: Arc<Signal>,
    epoch: std::time::Instant,
    retry: RetryOptions,
    /// [`RpcOptions::on_value_released`](crate::rpc::RpcOptions::on_value_released).
    on_release: Option<ValueReleased>,
}

impl RRefs {
    /// The RRefs of worker `me` in the agent whose dispatcher is `dispatch` (being
    /// built: start-up makes both at once), retrying control messages as `retry` says.
    pub(crate) fn new(
        me: WorkerInfo,
        registry: Arc<Registry>,
        gate: Arc<JoinGate>,
        dispatch: Weak<Dispatch>,
        retry: RetryOptions,
        on_release: Option<ValueReleased>,
    ) -> RRefs {
        RRefs {
            state: Mutex::new(State::new(me.id(), retry)),
            me,
            registry,
            gate,
            dispatch,
            changed: Condvar::new(),
            signal: Arc::new(Signal::default()),
            epoch: std::time::Instant::now(),
            retry,
            on_release,
        }
    }

    fn now(&self) -> Instant {
        Instant::from_duration(self.epoch.elapsed())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The agent, unless it is gone.
    fn agent(&self) -> Result<Arc<Dispatch>, CallError> {
        self.dispatch.upgrade().ok_or_else(|| CallError::ShutDown {
            name: self.me.name().to_string(),
        })
    }

    /// A client of the agent.
    fn client(&self) -> Result<RpcClient, CallError> {
        Ok(RpcClient::new(self.agent()? as Arc<dyn Caller>))
    }

    /// Runs `f` on the state, then applies the machine's events, queues its messages,
    /// signals waiters and wakes the pump if there is anything to send.
    fn update<R>(&self, f: impl FnOnce(&mut State, Instant) -> R) -> R {
        let now = self.now();
        let mut state = self.lock();
        let result = f(&mut state, now);
        drain(&mut state);
        let wake = !state.outbox.is_empty();
        let released = std::mem::take(&mut state.released);
        drop(state);
        if let Some(on_release) = &self.on_release {
            released.into_iter().for_each(|value| on_release(value));
        }
        self.changed.notify_all();
        if wake {
            self.signal.notify();
        }
        result
    }

    /// The report of the last graceful shutdown.
    pub(crate) fn report(&self) -> Option<RRefShutdownReport> {
        self.lock().report.clone()
    }

    /// Keeps a finished handler's result for `rref`, unless nothing references it, and
    /// answers the `to_here` requests waiting for it.
    fn store_value(&self, rref: RRefId, result: Result<Message, String>) {
        let answered = self.update(|state, _| {
            let (ready, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut state.waiters)
                .into_iter()
                .partition(|w| w.rref == rref);
            state.waiters = waiting;
            if state.machine.value_ready(rref, result.is_ok()) == ValueOutcome::Store {
                state.values.insert(rref, result.clone());
            } else if let Ok(value) = &result {
                state.released.push(value.clone());
            }
            ready
        });
        for waiter in answered {
            self.answer(waiter, result.clone());
        }
    }

    /// Answers the `to_here` requests whose wait is over; the earliest wait left.
    fn expire_waiters(&self) -> Option<std::time::Instant> {
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
            let error = self.not_ready(waiter.rref, waiter.wait);
            self.answer(waiter, Err(error));
        }
        next
    }

    /// Sends a deferred `to_here`'s answer (an async server call ends).
    fn answer(&self, waiter: Waiter, result: Result<Message, String>) {
        self.gate.async_server_call_finished();
        match self.dispatch.upgrade() {
            Some(_agent) => (waiter.respond)(result),
            // The agent is gone, and its pipes with it: nobody waits for the answer.
            None => drop(waiter),
        }
    }

    fn not_ready(&self, rref: RRefId, wait: Duration) -> String {
        format!(
            "the value of RRef {rref} is not ready on its owner {} after {wait:?}: its \
             remote() handler is still running, or its call never arrived",
            self.me.name()
        )
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

    /// The name of worker `id`, if it is in the group.
    fn worker_name(&self, id: WorkerId) -> Option<String> {
        self.registry
            .group()
            .peers
            .iter()
            .find(|(_, peer)| peer.id == id)
            .map(|(name, _)| name.clone())
    }
}

/// Applies the machine's events and moves its messages to the outbox.
fn drain(state: &mut State) {
    while let Some(event) = state.machine.poll_event() {
        match event {
            RRefEvent::DeleteValue { rref } => {
                if let Some(Ok(value)) = state.values.remove(&rref) {
                    state.released.push(value);
                }
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
    if !state.failed.is_empty() {
        let machine = &state.machine;
        state.failed.retain(|fork, _| machine.holds_user(*fork));
    }
    while let Some(transmit) = state.machine.poll_transmit() {
        state.outbox.push_back(transmit);
    }
}
