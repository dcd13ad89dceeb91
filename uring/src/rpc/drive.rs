//! One driver for the core's machines over store operations: `join`'s and a dynamic
//! member's leave (`rdzv_core::rpc::shutdown`), and the group token's acquire and
//! release (`rdzv_core::rpc::token`), and the group's start-up
//! (`rdzv_core::rpc::startup`). [`drive`] runs each [`Action`] against the store, the
//! call gate, the starting agent ([`StartHost`]) or the clock and hands the [`Outcome`]
//! back, until the machine is done or fails. The protocols themselves are the core's.

use std::time::Duration;

use rdzv_core::rpc::shutdown::{Action, Join, JoinError, Leave, Outcome};
use rdzv_core::rpc::startup::{DynamicJoin, StartupError, StartupGroup, StaticInit};
use rdzv_core::rpc::store_keys::RpcKeys;
use rdzv_core::rpc::token::{TokenAcquire, TokenRelease};

use super::counters::JoinGate;
use super::error::{store_error, InitError, ShutdownError, StoreOpError};
use crate::store::{Store, StoreError};

/// A core machine over store operations, driven alike.
pub(crate) trait StoreMachine {
    /// Why it fails.
    type Error: Clone;
    fn poll_action(&self) -> Action<'_>;
    fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), Self::Error>;
    fn error(&self) -> Option<&Self::Error>;
    /// The error for an action this driver has nothing to run with.
    fn unexpected(expected: &'static str, got: &'static str) -> Self::Error;
}

/// An agent error that a machine's failure (`Src`) turns into: [`InitError`] for the
/// start-up and the token, [`ShutdownError`] for `join`, a leave and the token.
pub(crate) trait MachineFailure<Src>: From<StoreOpError> {
    /// The machine's error, for worker `worker`.
    fn machine(source: Src, worker: &str) -> Self;
    /// A machine that failed without saying why.
    fn no_reason(worker: &str) -> Self;
}

macro_rules! store_machine {
    ($error:ty, $unexpected:path; $($machine:ty),*) => {$(
        impl StoreMachine for $machine {
            type Error = $error;
            fn poll_action(&self) -> Action<'_> {
                <$machine>::poll_action(self)
            }
            fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), $error> {
                <$machine>::handle(self, outcome)
            }
            fn error(&self) -> Option<&$error> {
                <$machine>::error(self)
            }
            fn unexpected(expected: &'static str, got: &'static str) -> $error {
                $unexpected { expected, got }
            }
        }
    )*};
}

store_machine!(JoinError, JoinError::UnexpectedOutcome; Join, Leave, TokenAcquire, TokenRelease);
store_machine!(StartupError, StartupError::UnexpectedOutcome; StaticInit, DynamicJoin);

impl MachineFailure<JoinError> for ShutdownError {
    fn machine(source: JoinError, worker: &str) -> Self {
        ShutdownError::Join {
            name: worker.to_string(),
            source: Box::new(source),
        }
    }
    fn no_reason(worker: &str) -> Self {
        ShutdownError::ShutDown {
            name: worker.to_string(),
        }
    }
}

/// The group token, taken at a dynamic member's start.
impl MachineFailure<JoinError> for InitError {
    fn machine(source: JoinError, worker: &str) -> Self {
        InitError::Membership {
            name: worker.to_string(),
            source: Box::new(source),
        }
    }
    fn no_reason(_worker: &str) -> Self {
        InitError::Internal("the group token's machine failed without saying why")
    }
}

/// A start-up error as the variant `init_rpc` has always reported for it.
impl MachineFailure<StartupError> for InitError {
    fn machine(source: StartupError, _worker: &str) -> Self {
        match source {
            StartupError::Names(e) => e.into(),
            StartupError::DuplicateId(e) => e.into(),
            StartupError::WorkerList(e) => e.into(),
            StartupError::DeviceMaps(e) => e.into(),
            StartupError::BadDeviceInfo { rank, reason } => {
                InitError::BadDeviceInfo { rank, reason }
            }
            StartupError::WorldSize { world_size } => InitError::InvalidOption {
                option: "world_size",
                reason: format!("{world_size} workers exceed the worker id range"),
            },
            other => InitError::Startup(Box::new(other)),
        }
    }
    fn no_reason(worker: &str) -> Self {
        <InitError as MachineFailure<JoinError>>::no_reason(worker)
    }
}

/// What a start-up machine asks of the agent it starts.
pub(crate) trait StartHost {
    /// Why it fails ([`InitError`] for the agent's start).
    type Error;
    /// Starts the agent; returns the address it publishes.
    fn listen(&mut self) -> Result<String, Self::Error>;
    /// Hands the group to the running agent.
    fn install(&mut self, group: &StartupGroup) -> Result<(), Self::Error>;
    /// Calls `method` on worker `to` with `payload`.
    fn call(&mut self, to: &str, method: &str, payload: &[u8]) -> Result<(), Self::Error>;
}

/// Runs a start-up machine for worker `worker` to its end, with `host` for what is not
/// a store operation.
///
/// # Errors
/// As [`drive`], and whatever `host` fails with.
pub(crate) fn drive_start<M, E>(
    store: &dyn Store,
    host: &mut dyn StartHost<Error = E>,
    worker: &str,
    machine: &mut M,
) -> Result<(), E>
where
    M: StoreMachine,
    E: MachineFailure<M::Error>,
{
    run(store, None, Some(host), worker, machine)
}

/// Runs `machine` for worker `worker` to its end: store actions on `store`, call-count
/// actions on `gate` (only `join` and a leave ask for them, and only they are given a
/// gate), pauses on this thread.
///
/// # Errors
/// A [`StoreOpError`] when a store operation fails; the machine's error when it fails
/// (or an action has nothing to run it), each as `E` has it.
pub(crate) fn drive<M, E>(
    store: &dyn Store,
    gate: Option<&JoinGate>,
    worker: &str,
    machine: &mut M,
) -> Result<(), E>
where
    M: StoreMachine,
    E: MachineFailure<M::Error>,
{
    run(store, gate, None, worker, machine)
}

fn run<M, E>(
    store: &dyn Store,
    gate: Option<&JoinGate>,
    mut host: Option<&mut dyn StartHost<Error = E>>,
    worker: &str,
    machine: &mut M,
) -> Result<(), E>
where
    M: StoreMachine,
    E: MachineFailure<M::Error>,
{
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
        TimedOut,
        Checked(bool),
        PassedBarrier,
        Listening(String),
        Installed,
        Called,
    }
    let failed = |source: M::Error| E::machine(source, worker);
    loop {
        let action = machine.poll_action();
        let needs_gate = || {
            failed(M::unexpected(
                action.name(),
                "nothing: this machine runs without the call gate",
            ))
        };
        let needs_host = || {
            failed(M::unexpected(
                action.name(),
                "nothing: this machine runs without a starting agent",
            ))
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
            Action::StoreWaitAll { keys, timeout_ms } => {
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let timeout = Duration::from_millis(timeout_ms);
                match store.wait(&keys, Some(timeout)) {
                    Ok(()) => Done::Waited,
                    Err(StoreError::Timeout { .. } | StoreError::GetTimeout { .. }) => {
                        Done::TimedOut
                    }
                    Err(e) => return Err(store_error("wait", &keys.join(", "))(e).into()),
                }
            }
            Action::StoreCheck { key } => {
                Done::Checked(store.check(&[key]).map_err(store_error("check", key))?)
            }
            Action::StoreBarrier { key, world_size } => {
                store
                    .barrier(key, world_size, None)
                    .map_err(store_error("barrier", key))?;
                Done::PassedBarrier
            }
            Action::Listen => Done::Listening(host.as_mut().ok_or_else(needs_host)?.listen()?),
            Action::InstallGroup { group } => {
                host.as_mut().ok_or_else(needs_host)?.install(group)?;
                Done::Installed
            }
            Action::Call {
                to,
                method,
                payload,
            } => {
                host.as_mut()
                    .ok_or_else(needs_host)?
                    .call(to, method, payload)?;
                Done::Called
            }
            Action::Done => return Ok(()),
            Action::Failed => {
                return Err(match machine.error() {
                    Some(e) => failed(e.clone()),
                    None => E::no_reason(worker),
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
            Done::TimedOut => Outcome::TimedOut,
            Done::Checked(b) => Outcome::Checked(*b),
            Done::PassedBarrier => Outcome::PassedBarrier,
            Done::Listening(a) => Outcome::Listening(a),
            Done::Installed => Outcome::Installed,
            Done::Called => Outcome::Called,
        };
        machine.handle(outcome).map_err(failed)?;
    }
}

/// `_group_membership_management`'s acquire, for worker `worker`.
pub(crate) fn acquire_token<E: MachineFailure<JoinError>>(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
    worker: &str,
) -> Result<(), E> {
    drive(store, None, worker, &mut TokenAcquire::new(keys, token))
}

/// `_group_membership_management`'s release, for worker `worker`.
pub(crate) fn release_token<E: MachineFailure<JoinError>>(
    store: &dyn Store,
    keys: &RpcKeys,
    token: &str,
    worker: &str,
) -> Result<(), E> {
    drive(store, None, worker, &mut TokenRelease::new(keys, token))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdzv_core::device_map::{DeviceMaps, WorkerDevices};
    use rdzv_core::rpc::name::WorkerInfo;
    use rdzv_core::rpc::startup::{Stage, StartupError, StartupGroup, StaticInit};
    use rdzv_core::rpc::store_keys::RpcKeys;

    use super::{drive, drive_start, StartHost};
    use crate::rpc::error::InitError;
    use crate::store::hash::HashStore;
    use crate::store::Store;

    #[derive(Default)]
    struct Recorder {
        installed: Option<StartupGroup>,
    }

    impl StartHost for Recorder {
        type Error = InitError;
        fn listen(&mut self) -> Result<String, InitError> {
            Ok("tcp://127.0.0.1:1".to_string())
        }
        fn install(&mut self, group: &StartupGroup) -> Result<(), InitError> {
            self.installed = Some(group.clone());
            Ok(())
        }
        fn call(&mut self, _: &str, _: &str, _: &[u8]) -> Result<(), InitError> {
            Ok(())
        }
    }

    fn devices(name: &str) -> WorkerDevices {
        WorkerDevices {
            name: name.to_string(),
            device_count: 0,
            device_maps: DeviceMaps::new(),
            devices: Vec::new(),
        }
    }

    #[test]
    fn a_lone_static_worker_starts_and_meets_itself_at_the_barrier() {
        let store = HashStore::new();
        let keys = RpcKeys::new(0);
        let me = WorkerInfo::new("solo", 0).unwrap_or_else(|e| panic!("{e}"));
        let mut init = StaticInit::new(&keys, &me, 1, devices("solo"), 1_000);
        let mut host = Recorder::default();
        drive_start(&store, &mut host, "solo", &mut init).unwrap_or_else(|e| panic!("{e}"));
        let group = host.installed.unwrap_or_default();
        assert_eq!(group.peers.len(), 1);
        assert_eq!(
            store.get(&keys.address("solo")).ok().as_deref(),
            Some(&b"tcp://127.0.0.1:1"[..])
        );
    }

    #[test]
    fn a_store_timeout_becomes_an_error_naming_the_missing_ranks() {
        let store = HashStore::new();
        store.set_timeout(Duration::from_millis(50));
        let keys = RpcKeys::new(0);
        let me = WorkerInfo::new("w0", 0).unwrap_or_else(|e| panic!("{e}"));
        let mut init = StaticInit::new(&keys, &me, 3, devices("w0"), 50);
        // Rank 2 published its name; rank 1 never started.
        store
            .set(
                &keys.rank_name(rdzv_core::rpc::name::WorkerId::from(2)),
                b"w2",
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let error = drive_start(&store, &mut Recorder::default(), "w0", &mut init);
        match error {
            Err(InitError::Startup(e)) => {
                assert_eq!(
                    *e,
                    StartupError::Timeout {
                        stage: Stage::Names,
                        missing: vec![1],
                        timeout_ms: 50,
                    }
                );
            }
            other => panic!("expected a start-up timeout, got {other:?}"),
        }
    }

    #[test]
    fn a_start_up_machine_without_a_host_fails_saying_so() {
        let store = HashStore::new();
        let keys = RpcKeys::new(0);
        let me = WorkerInfo::new("solo", 0).unwrap_or_else(|e| panic!("{e}"));
        let mut init = StaticInit::new(&keys, &me, 1, devices("solo"), 1_000);
        let text = drive::<_, InitError>(&store, None, "solo", &mut init)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.contains("without a starting agent"), "{text}");
    }
}
