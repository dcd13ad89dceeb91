//! The pump: one thread per agent that sends what the RRef machine asks for, watches
//! those calls, feeds their outcomes back and keeps the machine's time.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::wire::WireKind;
use rdzv_core::rpc::rref::{ForkId, RRefId, RRefMessage, Transmit};
use rdzv_core::rpc::timeouts::Instant;

use super::{RRefs, State};
use crate::rpc::client::{Caller, RpcClient};
use crate::rpc::dispatch::Dispatch;
use crate::rpc::error::CallError;
use crate::rpc::message::{Message, RpcFuture};

/// The longest the pump sleeps without a reason to wake.
const PUMP_IDLE: Duration = Duration::from_millis(500);

/// What a call made for the machine (by the pump, or `remote()`) waits for.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sent {
    /// A control message to this worker: its response holds the `Ack`.
    Control { to: WorkerId },
    /// A `remote()` call to worker `to`: its failure fails the RRef's `to_here`, and its
    /// answer is the owner's `RemoteRet`, which confirms the user.
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
pub(super) struct Signal {
    woken: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    pub(super) fn notify(&self) {
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

impl RRefs {
    /// Starts the pump if it is not running.
    pub(super) fn ensure_pump(self: &Arc<Self>) {
        {
            let mut state = self.lock();
            if state.pump_started {
                return;
            }
            state.pump_started = true;
        }
        let weak = Arc::downgrade(self);
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

/// The pump: sends what the machine asks for, watches those calls, keeps time. It ends
/// when the runtime or the agent is gone.
///
/// Messages to one worker must arrive in the order they were sent. A call made while
/// the pipe to its peer is not open yet goes through the I/O thread, and a later call
/// made once the pipe is open goes straight onto it and can overtake the first (a
/// `FORK_REQUEST` held up there would then count a fork again after its
/// `USER_DELETE`). So while a call to a worker without an open pipe is in flight, the
/// pump holds back every later message to that worker, in order.
fn pump(weak: &Weak<RRefs>, signal: &Arc<Signal>) {
    let waker = Waker::from(Arc::clone(signal));
    let mut cx = Context::from_waker(&waker);
    // Each call with the worker it opened a pipe to, if it went out without one.
    let mut flight: Vec<(Sent, RpcFuture, Option<WorkerId>)> = Vec::new();
    let mut opening: HashSet<WorkerId> = HashSet::new();
    let mut held: VecDeque<Transmit> = VecDeque::new();
    loop {
        let sleep = {
            let Some(rrefs) = weak.upgrade() else {
                return;
            };
            let Some(agent) = rrefs.dispatch.upgrade() else {
                return;
            };
            held.extend(std::mem::take(&mut rrefs.lock().outbox));
            for transmit in std::mem::take(&mut held) {
                if opening.contains(&transmit.to) {
                    held.push_back(transmit);
                    continue;
                }
                let to = transmit.to;
                if let Some((sent, future, opened)) = send(&rrefs, &agent, transmit) {
                    if opened {
                        opening.insert(to);
                    }
                    flight.push((sent, future, opened.then_some(to)));
                }
            }
            drop(agent);
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
                .expire_waiters()
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
fn send(
    rrefs: &RRefs,
    agent: &Arc<Dispatch>,
    transmit: Transmit,
) -> Option<(Sent, RpcFuture, bool)> {
    let Some(to) = rrefs.worker_name(transmit.to) else {
        tracing::debug!(
            to = transmit.to.get(),
            "an RRef message for a worker that left the group is dropped"
        );
        return None;
    };
    let kind = transmit.message.wire_kind();
    let sent = match kind {
        WireKind::Control(_) => Sent::Control { to: transmit.to },
        WireKind::RemoteRet | WireKind::Ack => Sent::Plain,
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
    let opening = !agent.has_lane(&to);
    let future = RpcClient::new(Arc::clone(agent) as Arc<dyn Caller>).rpc_async(
        &to,
        kind.handler(),
        Message::from_payload(payload),
    );
    Some((sent, future, opening))
}

/// The `remote()` call that made the user `fork` of `rref` failed with `error`.
pub(super) fn remote_failed(
    state: &mut State,
    now: Instant,
    rref: RRefId,
    fork: ForkId,
    error: CallError,
) {
    state.failed.insert(fork, Arc::new(error));
    state.machine.remote_failed(now, rref, fork);
}

/// A call the pump sent, or a `remote()` call, completed.
pub(super) fn on_sent(
    state: &mut State,
    now: Instant,
    sent: Sent,
    result: Result<Message, CallError>,
) {
    match (sent, result) {
        (Sent::Control { to }, Ok(reply)) => match RRefMessage::from_bytes(&reply.payload) {
            Ok(ack @ RRefMessage::Ack { .. }) => state.machine.handle_message(now, to, ack),
            Ok(other) => tracing::warn!(
                ?other,
                "an RRef control message was answered with something other than its Ack"
            ),
            Err(e) => tracing::warn!(error = %e, "an RRef control message's answer is malformed"),
        },
        (Sent::RemoteCall { rref, fork, .. }, Err(e)) => remote_failed(state, now, rref, fork, e),
        (Sent::RemoteCall { rref, fork, to }, Ok(_)) => {
            // The owner answers the call once its handler has run: that is `RemoteRet`.
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
