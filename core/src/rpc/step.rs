//! The vocabulary of the agent's store-step machines ([`super::startup`],
//! [`super::shutdown`], [`super::token`]): the [`Action`] a machine asks the runtime for,
//! the [`Outcome`] the runtime answers with, and the [`StartupGroup`] that start-up
//! gathers and hands over.
//!
//! It decides nothing about any protocol: each machine says which actions it asks for,
//! in which order, and what an outcome means to it.

use alloc::string::String;
use alloc::vec::Vec;

use crate::device::Device;
use crate::device_map::{DeviceMaps, WorkerDevices};

use super::name::WorkerId;

/// One worker of the group, as start-up found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPeer {
    /// Its name.
    pub name: String,
    /// Its id (rank).
    pub id: WorkerId,
    /// Its published address.
    pub address: String,
    /// Its devices and device maps.
    pub devices: WorkerDevices,
}

/// What start-up gathers: every worker (this one included), in id order for a static
/// group and in list order (this worker last) for a dynamic one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StartupGroup {
    /// The workers.
    pub peers: Vec<GroupPeer>,
    /// The maps for sending responses, keyed by the worker whose requests they answer.
    pub reverse_device_maps: DeviceMaps,
    /// The devices this worker's agent uses (static groups; empty for a dynamic one).
    pub devices: Vec<Device>,
}

/// What the runtime must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Wait until this worker has no client calls in flight, then answer
    /// [`Outcome::NoClientCalls`].
    AwaitNoClientCalls,
    /// Freeze this worker's client call count (block sends and completions from changing
    /// it) and answer [`Outcome::ClientCallsHeld`] with its value.
    HoldClientCalls,
    /// Unfreeze the count; answer [`Outcome::Released`].
    ReleaseClientCalls,
    /// From now on, a peer closing a pipe is expected (PyTorch's `shuttingDown_`); answer
    /// [`Outcome::MarkedShuttingDown`].
    MarkShuttingDown,
    /// `store.add(key, delta)`; answer [`Outcome::Added`] with the new value.
    StoreAdd {
        /// The key.
        key: &'a str,
        /// The amount.
        delta: i64,
    },
    /// `store.set(key, value)`; answer [`Outcome::Set`].
    StoreSet {
        /// The key.
        key: &'a str,
        /// The value.
        value: &'a [u8],
    },
    /// `store.wait([key])`; answer [`Outcome::Waited`].
    StoreWait {
        /// The key.
        key: &'a str,
    },
    /// `store.get(key)`; answer [`Outcome::Got`].
    StoreGet {
        /// The key.
        key: &'a str,
    },
    /// `store.compare_set(key, expected, desired)`; answer [`Outcome::Compared`] with the
    /// value it returns (used by [`super::token`]).
    StoreCompareSet {
        /// The key.
        key: &'a str,
        /// The value it must hold for the set to happen.
        expected: &'a [u8],
        /// The value set.
        desired: &'a [u8],
    },
    /// Let this much time pass before the next action (a retry's back-off); answer
    /// [`Outcome::Paused`].
    Pause {
        /// How long, in milliseconds.
        millis: u64,
    },
    /// `store.wait(keys, timeout)`; answer [`Outcome::Waited`], or
    /// [`Outcome::TimedOut`] when the timeout passed first (used by
    /// [`super::startup`]).
    StoreWaitAll {
        /// The keys, all of which must exist.
        keys: &'a [String],
        /// How long to wait, in milliseconds.
        timeout_ms: u64,
    },
    /// `store.check([key])`; answer [`Outcome::Checked`].
    StoreCheck {
        /// The key.
        key: &'a str,
    },
    /// `store.barrier(key, world_size)`; answer [`Outcome::PassedBarrier`].
    StoreBarrier {
        /// The barrier key.
        key: &'a str,
        /// How many workers must arrive.
        world_size: i64,
    },
    /// Start the agent (its threads and listeners); answer [`Outcome::Listening`] with
    /// the address it publishes.
    Listen,
    /// Hand the group to the running agent; answer [`Outcome::Installed`].
    InstallGroup {
        /// The group.
        group: &'a StartupGroup,
    },
    /// Call `method` on worker `to` with `payload` and wait for its answer; answer
    /// [`Outcome::Called`].
    Call {
        /// The worker called.
        to: &'a str,
        /// The method (a reserved handler name).
        method: &'a str,
        /// The request payload.
        payload: &'a [u8],
    },
    /// Finished.
    Done,
    /// Failed; [`Join::error`](super::shutdown::Join::error) /
    /// [`Leave::error`](super::shutdown::Leave::error) says why. Nothing more will happen.
    Failed,
}

impl Action<'_> {
    /// A short name, for errors.
    pub const fn name(&self) -> &'static str {
        match self {
            Action::AwaitNoClientCalls => "await no client calls",
            Action::HoldClientCalls => "hold client calls",
            Action::ReleaseClientCalls => "release client calls",
            Action::MarkShuttingDown => "mark shutting down",
            Action::StoreAdd { .. } => "store add",
            Action::StoreSet { .. } => "store set",
            Action::StoreWait { .. } => "store wait",
            Action::StoreGet { .. } => "store get",
            Action::StoreCompareSet { .. } => "store compare_set",
            Action::Pause { .. } => "pause",
            Action::StoreWaitAll { .. } => "store wait (with a timeout)",
            Action::StoreCheck { .. } => "store check",
            Action::StoreBarrier { .. } => "store barrier",
            Action::Listen => "listen",
            Action::InstallGroup { .. } => "install the group",
            Action::Call { .. } => "call",
            Action::Done => "done",
            Action::Failed => "failed",
        }
    }
}

/// The result of an [`Action`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// This worker has no client calls in flight.
    NoClientCalls,
    /// The count is frozen at this many client calls.
    ClientCallsHeld(u32),
    /// The count is unfrozen.
    Released,
    /// Shutting down is marked.
    MarkedShuttingDown,
    /// The key's new value after an add.
    Added(i64),
    /// The set is done.
    Set,
    /// The key exists.
    Waited,
    /// The key's value.
    Got(&'a [u8]),
    /// The value a compare-set returned.
    Compared(&'a [u8]),
    /// The pause is over.
    Paused,
    /// A [`Action::StoreWaitAll`] ran out of time.
    TimedOut,
    /// Whether the checked key exists.
    Checked(bool),
    /// Every worker arrived at the barrier.
    PassedBarrier,
    /// The agent runs and publishes this address.
    Listening(&'a str),
    /// The agent holds the group.
    Installed,
    /// The call returned.
    Called,
}

impl Outcome<'_> {
    /// A short name, for errors.
    pub const fn name(&self) -> &'static str {
        match self {
            Outcome::NoClientCalls => "no client calls",
            Outcome::ClientCallsHeld(_) => "client calls held",
            Outcome::Released => "released",
            Outcome::MarkedShuttingDown => "marked shutting down",
            Outcome::Added(_) => "added",
            Outcome::Set => "set",
            Outcome::Waited => "waited",
            Outcome::Got(_) => "got",
            Outcome::Compared(_) => "compared",
            Outcome::Paused => "paused",
            Outcome::TimedOut => "timed out",
            Outcome::Checked(_) => "checked",
            Outcome::PassedBarrier => "passed the barrier",
            Outcome::Listening(_) => "listening",
            Outcome::Installed => "installed",
            Outcome::Called => "called",
        }
    }
}
