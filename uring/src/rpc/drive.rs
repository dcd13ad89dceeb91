//! One driver for the core's machines over store operations: `join`'s and a dynamic
//! member's leave (`rdzv_core::rpc::shutdown`), and the group token's acquire and
//! release (`rdzv_core::rpc::token`). [`drive`] runs each [`Action`] against the store,
//! the call gate or the clock and hands the [`Outcome`] back, until the machine is done
//! or fails. The protocols themselves are the core's.

use std::time::Duration;

use rdzv_core::rpc::shutdown::{Action, Join, JoinError, Leave, Outcome};
use rdzv_core::rpc::store_keys::RpcKeys;
use rdzv_core::rpc::token::{TokenAcquire, TokenRelease};

use super::counters::JoinGate;
use super::error::{store_error, RpcError};
use crate::store::Store;

/// A core machine over store operations, driven alike.
pub(crate) trait StoreMachine {
    fn poll_action(&self) -> Action<'_>;
    fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError>;
    fn error(&self) -> Option<&JoinError>;
}

macro_rules! store_machine {
    ($($machine:ty),*) => {$(
        impl StoreMachine for $machine {
            fn poll_action(&self) -> Action<'_> {
                <$machine>::poll_action(self)
            }
            fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
                <$machine>::handle(self, outcome)
            }
            fn error(&self) -> Option<&JoinError> {
                <$machine>::error(self)
            }
        }
    )*};
}

store_machine!(Join, Leave, TokenAcquire, TokenRelease);

/// Runs `machine` for worker `worker` to its end: store actions on `store`, call-count
/// actions on `gate` (only `join` and a leave ask for them, and only they are given a
/// gate), pauses on this thread.
///
/// # Errors
/// [`RpcError::Store`] when a store operation fails; [`RpcError::Join`] when the machine
/// fails (or an action has nothing to run it); [`RpcError::ShutDown`] when it fails
/// without saying why.
pub(crate) fn drive(
    store: &dyn Store,
    gate: Option<&JoinGate>,
    worker: &str,
    machine: &mut impl StoreMachine,
) -> Result<(), RpcError> {
    enum Done {
        NoClientCalls,
        Held(u32),
        Released,
        Marked,
        Added(i64),
        Set,
        Waited,
        Got(Vec<u8>),
        Compared(Vec<u8>),
        Paused,
    }
    let failed = |source: JoinError| RpcError::Join {
        name: worker.to_string(),
        source: Box::new(source),
    };
    loop {
        let action = machine.poll_action();
        let needs_gate = || {
            failed(JoinError::UnexpectedOutcome {
                expected: action.name(),
                got: "nothing: this machine runs without the call gate",
            })
        };
        let done = match action {
            Action::AwaitNoClientCalls => {
                gate.ok_or_else(needs_gate)?.await_no_client_calls();
                Done::NoClientCalls
            }
            Action::HoldClientCalls => Done::Held(gate.ok_or_else(needs_gate)?.hold()),
            Action::ReleaseClientCalls => {
                gate.ok_or_else(needs_gate)?.release();
                Done::Released
            }
            Action::MarkShuttingDown => {
                gate.ok_or_else(needs_gate)?.mark_shutting_down();
                Done::Marked
            }
            Action::StoreAdd { key, delta } => {
                Done::Added(store.add(key, delta).map_err(store_error("add", key))?)
            }
            Action::StoreSet { key, value } => {
                store.set(key, value).map_err(store_error("set", key))?;
                Done::Set
            }
            Action::StoreWait { key } => {
                store.wait(&[key], None).map_err(store_error("wait", key))?;
                Done::Waited
            }
            Action::StoreGet { key } => Done::Got(store.get(key).map_err(store_error("get", key))?),
            Action::StoreCompareSet {
                key,
                expected,
                desired,
            } => Done::Compared(
                store
                    .compare_set(key, expected, desired)
                    .map_err(store_error("compare_set", key))?,
            ),
            Action::Pause { millis } => {
                std::thread::sleep(Duration::from_millis(millis));
                Done::Paused
            }
            Action::Done => return Ok(()),
            Action::Failed => {
                return Err(match machine.error() {
                    Some(e) => failed(e.clone()),
                    None => RpcError::ShutDown {
                        name: worker.to_string(),
                    },
                })
            }
        };
        let outcome = match &done {
            Done::NoClientCalls => Outcome::NoClientCalls,
            Done::Held(n) => Outcome::ClientCallsHeld(*n),
            Done::Released => Outcome::Released,
            Done::Marked => Outcome::MarkedShuttingDown,
            Done::Added(v) => Outcome::Added(*v),
            Done::Set => Outcome::Set,
            Done::Waited => Outcome::Waited,
            Done::Got(v) => Outcome::Got(v),
            Done::Compared(v) => Outcome::Compared(v),
            Done::Paused => Outcome::Paused,
        };
        machine.handle(outcome).map_err(failed)?;
    }
}

/// `_group_membership_management`'s acquire, for worker `worker`.
pub(crate) fn acquire_token(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
    worker: &str,
) -> Result<(), RpcError> {
    drive(store, None, worker, &mut TokenAcquire::new(keys, token))
}

/// `_group_membership_management`'s release, for worker `worker`.
pub(crate) fn release_token(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
    worker: &str,
) -> Result<(), RpcError> {
    drive(store, None, worker, &mut TokenRelease::new(keys, token))
}
