//! [`InitError`]: what `init_rpc` (and `RpcOptions::check`) returns. Each variant says
//! what to fix: an option, the rendezvous, the store, the group's consistency, or this
//! host's resources.

use rdzv_core::device::DeviceType;
use rdzv_core::device_map::DeviceMapError;
use rdzv_core::negotiate::OfferError;
use rdzv_core::rpc::backend::{AlreadyRegistered, UnknownBackend};
use rdzv_core::rpc::name::WorkerInfoError;
use rdzv_core::rpc::shutdown::JoinError;
use rdzv_core::rpc::startup::StartupError;
use rdzv_core::rpc::store_keys::{
    DuplicateWorkerId, MixedGroupError, NameTableError, WorkerInfosError,
};

use super::{CallError, StoreOpError, TransportError};
use crate::rendezvous::RendezvousError;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The worker name or rank is invalid.
    #[error("invalid RPC worker: {0}")]
    InvalidWorker(#[source] Box<WorkerInfoError>),
    /// An option has a value the agent cannot use.
    #[error("invalid RPC option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong and what to use instead.
        reason: String,
    },
    /// `RpcOptions::device_plugins` holds a plugin the agent cannot take.
    #[error("invalid RPC option device_plugins: {0}")]
    DevicePlugins(#[source] DevicesError),
    /// A handler given in the options is reserved or given twice.
    #[error("an RPC handler named {name} is already registered")]
    HandlerExists {
        /// The name.
        name: String,
    },
    /// The RPC backend registry refused: the name is already registered.
    #[error("{0}")]
    Backend(#[source] AlreadyRegistered),
    /// No RPC backend of that name is registered.
    #[error("{0}")]
    UnknownBackend(#[source] UnknownBackend),
    /// The `transports` or `channels` option names an unknown or repeated transport or
    /// channel (the core's [`OfferError`]).
    #[error("invalid RPC option {option}: {source}")]
    Offer {
        /// `transports` or `channels`.
        option: &'static str,
        /// The core's complaint.
        #[source]
        source: Box<OfferError>,
    },
    /// The rendezvous through `init_method` failed.
    #[error("RPC rendezvous through {init_method} failed: {source}")]
    Rendezvous {
        /// The URL.
        init_method: String,
        /// Why.
        #[source]
        source: Box<RendezvousError>,
    },
    /// A store operation of the start-up failed.
    #[error(transparent)]
    Store(Box<StoreOpError>),
    /// The group mixes static and dynamic members.
    #[error(transparent)]
    MixedGroup(Box<MixedGroupError>),
    /// Two workers share a name or a rank, or a name read from the store is invalid.
    #[error(transparent)]
    Names(Box<NameTableError>),
    /// A dynamic member's rank is taken by another name.
    #[error(transparent)]
    DuplicateId(Box<DuplicateWorkerId>),
    /// The dynamic group's member list is malformed.
    #[error(transparent)]
    WorkerList(Box<WorkerInfosError>),
    /// A worker's device information read from the store does not decode.
    #[error("the device information of rank {rank} in the store is malformed ({reason}); is another program using the same store keys?")]
    BadDeviceInfo {
        /// The rank.
        rank: u32,
        /// What postcard said.
        reason: String,
    },
    /// The group's device maps are inconsistent.
    #[error(transparent)]
    DeviceMaps(Box<DeviceMapError>),
    /// A thread of the agent (its I/O thread and executor, the worker pool, the timer)
    /// could not start.
    #[error("cannot start the RPC {thread}: {source}")]
    Thread {
        /// Which thread.
        thread: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The agent's start-up broke one of its own rules: a bug of rdzv, to report.
    #[error("the RPC agent's start-up failed: {0} (a bug of rdzv; please report it)")]
    Internal(&'static str),
    /// Listening failed.
    #[error(transparent)]
    Transport(Box<TransportError>),
    /// The group's start-up failed (workers that did not publish in time).
    #[error(transparent)]
    Startup(Box<StartupError>),
    /// A dynamic member could not take or give back the group's membership token.
    #[error("the RPC group membership token of worker {name}: {source}")]
    Membership {
        /// This worker's name.
        name: String,
        /// Why.
        #[source]
        source: Box<JoinError>,
    },
    /// A start-up call to another member (a dynamic join's announcement) failed.
    #[error(transparent)]
    Call(Box<CallError>),
}

macro_rules! boxed_from {
    ($($source:ty => $variant:ident),* $(,)?) => {
        $(impl From<$source> for InitError {
            fn from(e: $source) -> Self {
                InitError::$variant(Box::new(e))
            }
        })*
    };
}

boxed_from! {
    MixedGroupError => MixedGroup,
    DuplicateWorkerId => DuplicateId,
    WorkerInfosError => WorkerList,
    NameTableError => Names,
    DeviceMapError => DeviceMaps,
    TransportError => Transport,
    StoreOpError => Store,
    CallError => Call,
}

impl InitError {
    /// Whether trying again later may succeed: the store or rendezvous could not be
    /// reached, or other workers did not publish in time. Everything else (options,
    /// names, device maps, backends) needs a change first.
    pub fn is_retryable(&self) -> bool {
        match self {
            InitError::Rendezvous { .. } | InitError::Store(_) | InitError::Startup(_) => true,
            InitError::Call(e) => e.is_retryable(),
            _ => false,
        }
    }

    /// Whether an option ([`RpcOptions`](crate::rpc::RpcOptions), the name, the rank,
    /// the backend) is what must change.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            InitError::InvalidWorker(_)
                | InitError::InvalidOption { .. }
                | InitError::DevicePlugins(_)
                | InitError::HandlerExists { .. }
                | InitError::Backend(_)
                | InitError::UnknownBackend(_)
                | InitError::Offer { .. }
        )
    }
}

/// Why the device plugins given in `RpcOptions::device_plugins` cannot be used (the
/// agent does not start). A CUDA plugin that fails to open is no such error: the agent
/// logs why and serves CPU memory only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DevicesError {
    /// A plugin for the CPU, which is built in.
    #[error("the CPU is built in and cannot be plugged in")]
    BuiltIn,
    /// A plugin for a device type the agent takes no runtime for.
    #[error("device type {kind} cannot be plugged in")]
    NotPluggable {
        /// The plugin's device type.
        kind: DeviceType,
    },
}
