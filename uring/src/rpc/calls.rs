//! The calls this worker has in flight, whichever thread sent them: one table of pending
//! calls keyed by message id, one deadline-ordered timeout queue (the core's
//! [`TimeoutQueue`]) and one timer thread that fails calls whose deadline passed.
//!
//! The I/O executor (for calls waiting for their pipe to open) and the lanes
//! ([`super::lane`]) register calls here, and lanes take them out when their reply
//! arrives, so that a reply, a timeout and a
//! broken pipe agree on who completes a call: whoever removes it from the table. A call
//! that timed out is gone from the table, so its late reply is dropped.
//!
//! This module owns no pipe; it completes futures and counts calls.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rdzv_core::negotiate::{Negotiated, Role};
use rdzv_core::rpc::frame::FrameKind;
use rdzv_core::rpc::timeouts::{Instant, RpcTimeout, TimeoutQueue};

use super::counters::{Counters, JoinGate};
use super::device::Devices;
use super::error::CallError;
use super::message::{Completion, Message};
use super::tensors::{PipeReader, ReceivedTensors};
use super::transport::IncomingFrame;

/// A call sent (or about to be) on pipe `pipe`, waiting for its reply.
pub(crate) struct Pending {
    pub peer: String,
    pub handler: String,
    pub pipe: u64,
    pub sent_bytes: u64,
    pub timeout: RpcTimeout,
    pub completion: Arc<Completion>,
}

#[derive(Default)]
struct Table {
    pending: HashMap<u64, Pending>,
    timeouts: TimeoutQueue<u64>,
    closed: bool,
    /// What the timer thread is doing, so that a new call wakes it only when its
    /// deadline comes before the timer's own wake-up.
    timer: TimerState,
}

/// What the timer thread is doing.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum TimerState {
    /// Running (or not started): it looks at the queue before it sleeps again.
    #[default]
    Running,
    /// Asleep until this time; it then looks at the queue whatever is in it.
    Until(Instant),
    /// Asleep with no deadline to wait for.
    Idle,
}

impl TimerState {
    /// Whether a call with `deadline` must wake the timer for it to fire in time.
    fn must_wake_for(self, deadline: Instant) -> bool {
        match self {
            TimerState::Running => false,
            TimerState::Until(wakes) => deadline < wakes,
            TimerState::Idle => true,
        }
    }
}

/// The pending calls and their timer, with what completing a call touches: the call
/// count (`gate`), the network data (`counters`) and the device runtimes that received
/// tensors may live in.
pub(crate) struct Calls {
    table: Mutex<Table>,
    /// Signalled when the earliest deadline may have moved earlier, or at close.
    timer: Condvar,
    epoch: std::time::Instant,
    /// This worker's name, for logs.
    worker: String,
    gate: Arc<JoinGate>,
    counters: Arc<Counters>,
    devices: Devices,
}

impl Calls {
    pub(crate) fn new(
        worker: &str,
        gate: Arc<JoinGate>,
        counters: Arc<Counters>,
        devices: Devices,
    ) -> Calls {
        Calls {
            table: Mutex::new(Table::default()),
            timer: Condvar::new(),
            epoch: std::time::Instant::now(),
            worker: worker.to_string(),
            gate,
            counters,
            devices,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Now, on the timeout queue's clock.
    pub(crate) fn now(&self) -> Instant {
        Instant::from_duration(self.epoch.elapsed())
    }

    /// Adds a call with its timeout; gives it back if the table is closed (the agent is
    /// shutting down).
    #[allow(clippy::result_large_err)]
    pub(crate) fn register(&self, message_id: u64, pending: Pending) -> Result<(), Pending> {
        let now = self.now();
        let mut table = self.lock();
        if table.closed {
            return Err(pending);
        }
        let timeout = pending.timeout;
        table.pending.insert(message_id, pending);
        if let Some(deadline) = table.timeouts.schedule(message_id, now, timeout) {
            // Back-to-back calls do not wake it: a call ends before the timer's wake-up,
            // which was set by an earlier call's deadline, and the next call's deadline
            // is later still.
            if table.timer.must_wake_for(deadline) {
                table.timer = TimerState::Running;
                self.timer.notify_one();
            }
        }
        Ok(())
    }

    /// Records how many bytes a pending call's request took on the wire.
    pub(crate) fn set_sent(&self, message_id: u64, bytes: u64) {
        if let Some(pending) = self.lock().pending.get_mut(&message_id) {
            pending.sent_bytes = bytes;
        }
    }

    /// Takes a call out (it failed before or while being sent).
    pub(crate) fn take(&self, message_id: u64) -> Option<Pending> {
        let mut table = self.lock();
        table.timeouts.cancel(message_id);
        table.pending.remove(&message_id)
    }

    /// Takes out the call a reply on pipe `pipe` answers; `None` for a late (timed out)
    /// or bogus reply, or one on another pipe than its call went out on.
    pub(crate) fn take_reply(&self, message_id: u64, pipe: u64) -> Option<Pending> {
        let mut table = self.lock();
        if table
            .pending
            .get(&message_id)
            .is_none_or(|p| p.pipe != pipe)
        {
            return None;
        }
        table.timeouts.cancel(message_id);
        table.pending.remove(&message_id)
    }

    /// Takes out every call sent on pipe `pipe`.
    pub(crate) fn take_pipe(&self, pipe: u64) -> Vec<Pending> {
        let mut table = self.lock();
        let ids: Vec<u64> = table
            .pending
            .iter()
            .filter(|(_, p)| p.pipe == pipe)
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                table.timeouts.cancel(id);
                table.pending.remove(&id)
            })
            .collect()
    }

    /// Closes the table (later registrations are refused), stops the timer and takes
    /// every call out.
    pub(crate) fn close(&self) -> Vec<Pending> {
        let mut table = self.lock();
        table.closed = true;
        table.timeouts = TimeoutQueue::new();
        let all = table.pending.drain().map(|(_, p)| p).collect();
        drop(table);
        self.timer.notify_all();
        all
    }

    /// Starts the timer thread: it sleeps until the earliest deadline and fails the
    /// calls whose deadline passed, until [`close`](Self::close).
    pub(crate) fn start_timer(self: &Arc<Self>) -> std::io::Result<JoinHandle<()>> {
        let calls = Arc::clone(self);
        std::thread::Builder::new()
            .name(format!("rdzv-rpc-timer-{}", self.worker))
            .spawn(move || calls.run_timer())
    }

    fn run_timer(&self) {
        let mut table = self.lock();
        loop {
            if table.closed {
                return;
            }
            let now = self.now();
            let mut expired = Vec::new();
            while let Some(id) = table.timeouts.poll_expired(now) {
                if let Some(pending) = table.pending.remove(&id) {
                    expired.push(pending);
                }
            }
            if !expired.is_empty() {
                drop(table);
                for pending in expired {
                    let error = CallError::Timeout {
                        peer: pending.peer.clone(),
                        error: pending.timeout.error(),
                    };
                    self.fail(pending, error);
                }
                table = self.lock();
                continue;
            }
            table = match table.timeouts.next_deadline() {
                None => {
                    table.timer = TimerState::Idle;
                    self.timer.wait(table).unwrap_or_else(|p| p.into_inner())
                }
                Some(deadline) => {
                    table.timer = TimerState::Until(deadline);
                    let wait = deadline.saturating_duration_since(now);
                    self.timer
                        .wait_timeout(table, wait)
                        .map(|(t, _)| t)
                        .unwrap_or_else(|p| p.into_inner().0)
                }
            };
            table.timer = TimerState::Running;
        }
    }
}

/// A reply matched to its call: what is left to do.
pub(crate) enum Reply {
    /// The call is completed (a reply that lent out-of-band tensors is then done with
    /// them: they were not read).
    Done,
    /// The reply's out-of-band tensors must be read first ([`PullReply::pull`], which
    /// blocks), then acked, then the call completed.
    Pull(PullReply),
}

/// A response whose out-of-band tensors are still to be read.
pub(crate) struct PullReply {
    completion: Arc<Completion>,
    metadata: Vec<u8>,
    payload: Vec<u8>,
    received: ReceivedTensors,
}

impl PullReply {
    /// Reads the tensors (blocking); the completion and the call's result.
    pub(super) fn pull(self) -> (Arc<Completion>, Result<Message, CallError>) {
        let PullReply {
            completion,
            metadata,
            payload,
            received,
        } = self;
        let result = received.pull().map(|tensors| Message {
            metadata,
            payload,
            tensors,
        });
        (completion, result)
    }
}

impl Calls {
    /// Completes a call and uncounts it. A failure nobody will see (the future was dropped,
    /// as `remote` does) is logged.
    pub(crate) fn complete(
        &self,
        completion: &Arc<Completion>,
        result: Result<Message, CallError>,
    ) {
        if let (Err(e), false) = (&result, completion.is_wanted()) {
            tracing::warn!(worker = %self.worker, error = %e, "an RPC whose result nobody waits for failed");
        }
        completion.complete_then(result, || self.gate.finish_client_call());
    }

    /// Fails a call, counting a network error against its peer.
    pub(crate) fn fail(&self, pending: Pending, error: CallError) {
        self.counters
            .network_error(pending.sent_bytes, &pending.peer);
        self.complete(&pending.completion, Err(error));
    }

    /// Handles the reply `frame` to call `pending`, which came on a pipe that negotiated
    /// `negotiated` and reads out-of-band tensors through `reader`: an error frame fails
    /// the call with the callee's text; a response completes it, unless it lent
    /// out-of-band tensors, which must be pulled first.
    pub(crate) fn reply(
        &self,
        pending: Pending,
        frame: IncomingFrame,
        negotiated: &Negotiated,
        reader: &Arc<PipeReader>,
    ) -> Reply {
        if frame.kind != FrameKind::Response {
            let error = CallError::Remote {
                peer: pending.peer.clone(),
                handler: pending.handler.clone(),
                message: String::from_utf8_lossy(&frame.payload).into_owned(),
            };
            self.fail(pending, error);
            return Reply::Done;
        }
        let IncomingFrame {
            metadata,
            payload,
            tensors,
            wire_len,
            ..
        } = frame;
        let source = (reader, &self.devices);
        let received = match ReceivedTensors::sort(
            tensors,
            negotiated,
            Role::Connector,
            source,
            &pending.peer,
        ) {
            Ok(received) => received,
            Err(e) => {
                self.fail(pending, e);
                return Reply::Done;
            }
        };
        self.counters.network_data(
            pending.sent_bytes,
            wire_len.saturating_add(received.pull_bytes()),
            &pending.peer,
        );
        if received.has_out_of_band() && !pending.completion.is_wanted() {
            // Nobody waits for this result (`remote`): nothing to read, just release. (A
            // future consumed by `then` is gone too, but its callback wants the result.)
            self.complete(&pending.completion, Ok(Message::default()));
            return Reply::Done;
        }
        if !received.has_out_of_band() {
            let result = received.pull().map(|tensors| Message {
                metadata,
                payload,
                tensors,
            });
            self.complete(&pending.completion, result);
            return Reply::Done;
        }
        Reply::Pull(PullReply {
            completion: pending.completion,
            metadata,
            payload,
            received,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Instant, TimerState};
    use std::time::Duration;

    #[test]
    fn only_an_earlier_deadline_or_an_idle_timer_needs_a_wake_up() {
        let at = |ms| Instant::from_duration(Duration::from_millis(ms));
        assert!(!TimerState::Running.must_wake_for(at(1)));
        assert!(TimerState::Idle.must_wake_for(at(60_000)));
        let sleeping = TimerState::Until(at(60_000));
        assert!(
            !sleeping.must_wake_for(at(60_001)),
            "a later call waits for it"
        );
        assert!(!sleeping.must_wake_for(at(60_000)));
        assert!(sleeping.must_wake_for(at(100)), "an earlier one wakes it");
    }
}
