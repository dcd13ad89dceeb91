//! Graceful shutdown (`join`) as a state machine over store operations.
//!
//! PyTorch's `TensorPipeAgent::join` makes every worker of a static group wait until no
//! worker has a client call in flight, counting nested calls (made by a handler) and
//! follow-up calls (made by a future's callback). Each round:
//!
//! 1. wait until this worker has no client calls;
//! 2. a barrier (`syncCallCount` with 0 calls): nobody goes on before everyone is idle;
//! 3. freeze this worker's call count (PyTorch holds `callCountMutex_`, so no call can
//!    start or finish being counted) and run a second barrier adding that count to
//!    `ACTIVE_CALLS_ID_<n>`;
//! 4. if the group's total is zero: when shutting down, set `shuttingDown_` (EOFs are
//!    expected from now on) and run a third barrier so nobody closes pipes before
//!    everyone knows; then unfreeze and stop. Otherwise unfreeze and go round again.
//!
//! One barrier (`syncCallCount`) is: `add(ACTIVE_CALLS_ID_n, calls)`,
//! `add(PROCESS_COUNT_ID_n, 1)`; the worker whose add returns the world size sets
//! `READY_ID_n` (empty); everyone `wait`s for `READY_ID_n`, then `get`s
//! `ACTIVE_CALLS_ID_n`. `n` is a process-wide barrier counter whose first value is 1; the
//! machine starts from the value the caller gives and reports where it stopped.
//!
//! [`Join`] performs no I/O. Drive it quinn-style: [`Join::poll_action`] says what to do
//! next, the runtime does it (a store request, waiting on its call counter) and feeds the
//! result to [`Join::handle`]; every action except [`Action::Done`] and
//! [`Action::Failed`] is answered by exactly one [`Outcome`]. [`Leave`] is the dynamic
//! group's counterpart (`leaveGroup`): wait for no client calls, remove this worker from
//! `_ALL_WORKER_INFOS`, mark shutting down; the runtime must hold the group membership
//! token around it ([`super::store_keys::token_step`]).
//!
//! Why three barriers are enough: a call exists only while its client counts it, a call
//! can only start at a worker that is not frozen, and counts are frozen until the round's
//! total is read. So a call alive when the last worker froze was counted by its client,
//! and a total of zero means no call is alive anywhere; none can appear afterwards, since
//! only a live call (its handler or callback) or user code (which is in `join`) starts
//! one. The simulation in the tests checks exactly this.
//!
//! Store timeouts, retries and the agent's thread pool belong to the runtime.

use alloc::string::String;
use core::fmt;

use super::name::WorkerInfo;
pub use super::step::{Action, Outcome};
use super::store_keys::{remove_worker_info, BarrierKeys, RpcKeys, WorkerInfosError};
use crate::device::RejectedInput;
use crate::store::semantics::parse_counter;

/// Why a shutdown machine failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum JoinError {
    /// The outcome does not answer the pending action (a driver bug).
    UnexpectedOutcome {
        /// The pending action.
        expected: &'static str,
        /// The outcome given.
        got: &'static str,
    },
    /// `ACTIVE_CALLS_ID_n` does not hold a number (PyTorch's `std::stoi` throws).
    BadCounter {
        /// The key.
        key: String,
        /// Its value.
        value: RejectedInput,
    },
    /// More workers arrived at a barrier than the world has: another agent uses the same
    /// keys (same `rpc_prefix`, same barrier ids).
    TooManyArrivals {
        /// The `PROCESS_COUNT` key.
        key: String,
        /// The count returned.
        count: i64,
        /// The world size.
        world_size: i64,
    },
    /// The dynamic group's worker list could not be read or changed.
    WorkerList(WorkerInfosError),
    /// A join refused because an earlier one stopped part-way, or a graceful shutdown
    /// gave up ([`JoinSequence`]).
    OutOfStep(OutOfStep),
}

impl fmt::Display for JoinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JoinError::UnexpectedOutcome { expected, got } => write!(
                f,
                "RPC shutdown protocol misdriven: the pending action is '{expected}' but the \
                 outcome given is '{got}'"
            ),
            JoinError::BadCounter { key, value } => write!(
                f,
                "RPC shutdown barrier key {key} holds '{value}', which is not a call count"
            ),
            JoinError::TooManyArrivals {
                key,
                count,
                world_size,
            } => write!(
                f,
                "RPC shutdown barrier {key} counted {count} arrivals in a world of \
                 {world_size}: another agent is using the same store keys"
            ),
            JoinError::WorkerList(e) => e.fmt(f),
            JoinError::OutOfStep(e) => e.fmt(f),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for JoinError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SyncStep {
    AddActive,
    AddProcess,
    SetReady,
    Wait,
    Get,
}

/// One `syncCallCount`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Barrier {
    keys: BarrierKeys,
    calls: i64,
    step: SyncStep,
}

impl Barrier {
    fn action(&self) -> Action<'_> {
        match self.step {
            SyncStep::AddActive => Action::StoreAdd {
                key: &self.keys.active_calls,
                delta: self.calls,
            },
            SyncStep::AddProcess => Action::StoreAdd {
                key: &self.keys.process_count,
                delta: 1,
            },
            SyncStep::SetReady => Action::StoreSet {
                key: &self.keys.ready,
                value: &[],
            },
            SyncStep::Wait => Action::StoreWait {
                key: &self.keys.ready,
            },
            SyncStep::Get => Action::StoreGet {
                key: &self.keys.active_calls,
            },
        }
    }

    /// Advances; `Some(total)` once the barrier is complete.
    fn handle(&mut self, outcome: Outcome<'_>, world_size: i64) -> Result<Option<i64>, JoinError> {
        match (self.step, outcome) {
            (SyncStep::AddActive, Outcome::Added(_)) => self.step = SyncStep::AddProcess,
            (SyncStep::AddProcess, Outcome::Added(count)) => {
                if count > world_size {
                    return Err(JoinError::TooManyArrivals {
                        key: self.keys.process_count.clone(),
                        count,
                        world_size,
                    });
                }
                self.step = if count == world_size {
                    SyncStep::SetReady
                } else {
                    SyncStep::Wait
                };
            }
            (SyncStep::SetReady, Outcome::Set) => self.step = SyncStep::Wait,
            (SyncStep::Wait, Outcome::Waited) => self.step = SyncStep::Get,
            (SyncStep::Get, Outcome::Got(value)) => {
                return parse_counter(value)
                    .map(Some)
                    .map_err(|_| JoinError::BadCounter {
                        key: self.keys.active_calls.clone(),
                        value: RejectedInput::new(&String::from_utf8_lossy(value)),
                    });
            }
            (_, got) => {
                return Err(JoinError::UnexpectedOutcome {
                    expected: self.action().name(),
                    got: got.name(),
                })
            }
        }
        Ok(None)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    AwaitIdle,
    /// The barrier after everyone became idle.
    IdleBarrier(Barrier),
    Hold,
    /// The barrier that sums the frozen counts.
    CountBarrier(Barrier),
    MarkShuttingDown,
    /// The barrier after everyone marked shutting down.
    ShutdownBarrier(Barrier),
    Release {
        finished: bool,
    },
    Done,
    Failed,
}

/// `TensorPipeAgent::join` for a static group, sans-IO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Join {
    keys: RpcKeys,
    world_size: i64,
    shutdown: bool,
    next_barrier_id: u64,
    rounds: u32,
    last_total: Option<i64>,
    phase: Phase,
    error: Option<JoinError>,
}

impl Join {
    /// A join of a static group of `world_size` workers whose keys are `keys`, numbering
    /// its barriers from `first_barrier_id` (PyTorch's process-wide counter: 1 for the
    /// first barrier of the process). With `shutdown`, the agent is shutting down (the
    /// `join(shutdown=True)` of `rpc.shutdown`).
    pub fn new(keys: RpcKeys, world_size: u32, first_barrier_id: u64, shutdown: bool) -> Join {
        Join {
            keys,
            world_size: i64::from(world_size),
            shutdown,
            next_barrier_id: first_barrier_id,
            rounds: 0,
            last_total: None,
            phase: Phase::AwaitIdle,
            error: None,
        }
    }

    fn barrier(&mut self, calls: i64) -> Barrier {
        let keys = self.keys.barrier(self.next_barrier_id);
        self.next_barrier_id = self.next_barrier_id.saturating_add(1);
        Barrier {
            keys,
            calls,
            step: SyncStep::AddActive,
        }
    }

    /// What to do next.
    pub fn poll_action(&self) -> Action<'_> {
        match &self.phase {
            Phase::AwaitIdle => Action::AwaitNoClientCalls,
            Phase::IdleBarrier(b) | Phase::CountBarrier(b) | Phase::ShutdownBarrier(b) => {
                b.action()
            }
            Phase::Hold => Action::HoldClientCalls,
            Phase::MarkShuttingDown => Action::MarkShuttingDown,
            Phase::Release { .. } => Action::ReleaseClientCalls,
            Phase::Done => Action::Done,
            Phase::Failed => Action::Failed,
        }
    }

    /// Feeds the result of the action [`poll_action`](Self::poll_action) returned.
    ///
    /// # Errors
    /// [`JoinError`] if the outcome does not answer the action, the store holds nonsense,
    /// or another agent shares the keys. The machine is then [`Action::Failed`].
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        let result = self.step(outcome);
        if let Err(e) = &result {
            self.phase = Phase::Failed;
            self.error = Some(e.clone());
        }
        result
    }

    fn step(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        let world_size = self.world_size;
        let unexpected = |action: Action<'_>| JoinError::UnexpectedOutcome {
            expected: action.name(),
            got: outcome.name(),
        };
        let phase = core::mem::replace(&mut self.phase, Phase::Failed);
        self.phase = match (phase, outcome) {
            (Phase::AwaitIdle, Outcome::NoClientCalls) => Phase::IdleBarrier(self.barrier(0)),
            (Phase::IdleBarrier(mut b), o) => match b.handle(o, world_size)? {
                Some(_) => Phase::Hold,
                None => Phase::IdleBarrier(b),
            },
            (Phase::Hold, Outcome::ClientCallsHeld(calls)) => {
                Phase::CountBarrier(self.barrier(i64::from(calls)))
            }
            (Phase::CountBarrier(mut b), o) => match b.handle(o, world_size)? {
                Some(total) => {
                    self.last_total = Some(total);
                    if total != 0 {
                        Phase::Release { finished: false }
                    } else if self.shutdown {
                        Phase::MarkShuttingDown
                    } else {
                        Phase::Release { finished: true }
                    }
                }
                None => Phase::CountBarrier(b),
            },
            (Phase::MarkShuttingDown, Outcome::MarkedShuttingDown) => {
                Phase::ShutdownBarrier(self.barrier(0))
            }
            (Phase::ShutdownBarrier(mut b), o) => match b.handle(o, world_size)? {
                Some(_) => Phase::Release { finished: true },
                None => Phase::ShutdownBarrier(b),
            },
            (Phase::Release { finished }, Outcome::Released) => {
                self.rounds = self.rounds.saturating_add(1);
                if finished {
                    Phase::Done
                } else {
                    Phase::AwaitIdle
                }
            }
            (phase, _) => {
                self.phase = phase;
                return Err(unexpected(self.poll_action()));
            }
        };
        Ok(())
    }

    /// Whether the join finished.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Why it failed, if it did.
    pub fn error(&self) -> Option<&JoinError> {
        self.error.as_ref()
    }

    /// The id the next barrier of this process must use (store it in the process-wide
    /// counter once the join is over).
    pub fn next_barrier_id(&self) -> u64 {
        self.next_barrier_id
    }

    /// Rounds completed (each ends by reading the group's total).
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// The group's total of active client calls in the last count barrier.
    pub fn last_total(&self) -> Option<i64> {
        self.last_total
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LeavePhase {
    AwaitIdle,
    Get,
    Set(String),
    Mark,
    Done,
    Failed,
}

/// `TensorPipeAgent::leaveGroup` for a dynamic group, sans-IO: wait for no client calls,
/// remove this worker from `_ALL_WORKER_INFOS`, mark shutting down. Run it while holding
/// the group membership token for `leave`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leave {
    key: String,
    me: WorkerInfo,
    phase: LeavePhase,
    error: Option<JoinError>,
}

impl Leave {
    /// The leave of `me` from the group whose keys are `keys`.
    pub fn new(keys: &RpcKeys, me: WorkerInfo) -> Leave {
        Leave {
            key: keys.all_worker_infos(),
            me,
            phase: LeavePhase::AwaitIdle,
            error: None,
        }
    }

    /// What to do next.
    pub fn poll_action(&self) -> Action<'_> {
        match &self.phase {
            LeavePhase::AwaitIdle => Action::AwaitNoClientCalls,
            LeavePhase::Get => Action::StoreGet { key: &self.key },
            LeavePhase::Set(value) => Action::StoreSet {
                key: &self.key,
                value: value.as_bytes(),
            },
            LeavePhase::Mark => Action::MarkShuttingDown,
            LeavePhase::Done => Action::Done,
            LeavePhase::Failed => Action::Failed,
        }
    }

    /// Feeds the result of the pending action.
    ///
    /// # Errors
    /// [`JoinError::WorkerList`] if the list is unreadable or does not hold this worker,
    /// [`JoinError::UnexpectedOutcome`] for an outcome that does not answer the action.
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        let next = match (&self.phase, outcome) {
            (LeavePhase::AwaitIdle, Outcome::NoClientCalls) => Ok(LeavePhase::Get),
            (LeavePhase::Get, Outcome::Got(value)) => core::str::from_utf8(value)
                .map_err(|_| WorkerInfosError::NotUtf8)
                .and_then(|list| remove_worker_info(list, &self.me))
                .map(LeavePhase::Set)
                .map_err(JoinError::WorkerList),
            (LeavePhase::Set(_), Outcome::Set) => Ok(LeavePhase::Mark),
            (LeavePhase::Mark, Outcome::MarkedShuttingDown) => Ok(LeavePhase::Done),
            (_, got) => Err(JoinError::UnexpectedOutcome {
                expected: self.poll_action().name(),
                got: got.name(),
            }),
        };
        match next {
            Ok(phase) => {
                self.phase = phase;
                Ok(())
            }
            Err(e) => {
                self.phase = LeavePhase::Failed;
                self.error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Whether the leave finished.
    pub fn is_done(&self) -> bool {
        self.phase == LeavePhase::Done
    }

    /// Why it failed, if it did.
    pub fn error(&self) -> Option<&JoinError> {
        self.error.as_ref()
    }
}

mod sequence;
#[cfg(test)]
mod tests;

pub use sequence::{JoinSequence, OutOfStep};
