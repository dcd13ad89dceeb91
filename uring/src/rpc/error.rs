//! The agent's errors: one variant per thing that can fail, each naming the peer, key or
//! option involved and, where there is one, what to do about it.

use std::io;
use std::time::Duration;

use rdzv_core::device_map::DeviceMapError;
use rdzv_core::negotiate::OfferError;
use rdzv_core::rpc::frame::{EncodeError, FrameError};
use rdzv_core::rpc::name::WorkerInfoError;
use rdzv_core::rpc::shutdown::JoinError;
use rdzv_core::rpc::store_keys::{
    DuplicateWorkerId, MixedGroupError, NameTableError, WorkerInfosError,
};
use rdzv_core::rpc::timeouts::RpcTimeoutError;

use crate::rendezvous::RendezvousError;
use crate::store::StoreError;

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The address is not one this transport can connect to.
    #[error("bad {transport} address '{address}': {reason}")]
    BadAddress {
        /// The transport.
        transport: &'static str,
        /// The address given.
        address: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Listening failed.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The local address.
        address: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Accepting a connection failed.
    #[error("accept on {address} failed: {source}")]
    Accept {
        /// The local address.
        address: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Connecting failed.
    #[error("cannot connect to {address}: {source}")]
    Connect {
        /// The peer's address.
        address: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A read or write on an open connection failed.
    #[error("{op} {peer} failed: {source}")]
    Io {
        /// "send to" or "receive from".
        op: &'static str,
        /// The peer's address.
        peer: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer sent bytes that are not a valid frame; the connection cannot be resynced.
    #[error("invalid frame from {peer}: {source}")]
    Frame {
        /// The peer's address.
        peer: String,
        /// What is wrong.
        #[source]
        source: FrameError,
    },
    /// The connection ended in the middle of a frame.
    #[error("{peer} closed the connection in the middle of a frame ({have} bytes of it received)")]
    Truncated {
        /// The peer's address.
        peer: String,
        /// Bytes of the partial frame.
        have: usize,
    },
    /// A frame could not be encoded.
    #[error("cannot encode a frame for {peer}: {source}")]
    Encode {
        /// The peer's address.
        peer: String,
        /// Why.
        #[source]
        source: EncodeError,
    },
    /// Fault injection ([`FaultInjection`](super::FaultInjection)) failed this send on
    /// purpose; the connection is fine and only this request fails.
    #[error("Send attempt failed intentionally for {handler}")]
    InjectedFault {
        /// The handler the request was for.
        handler: String,
    },
}

/// Why an RPC operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
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
    /// The RPC backend registry refused (unknown backend, name already registered).
    #[error("{0}")]
    Backend(String),
    /// The `transports` or `channels` option names an unknown or repeated backend.
    #[error("invalid RPC option {option}: {source}")]
    Backends {
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
    /// A store operation failed.
    #[error("RPC store {op} of key {key} failed: {source}")]
    Store {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: Box<StoreError>,
    },
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
    /// The agent's I/O thread could not start.
    #[error("cannot start the RPC I/O thread: {0}")]
    Executor(String),
    /// A transport failed outside any call (listening).
    #[error(transparent)]
    Transport(Box<TransportError>),
    /// No worker of that name is in the group.
    #[error("unknown destination worker {name}: it is not a member of this RPC group")]
    UnknownWorker {
        /// The name asked for.
        name: String,
    },
    /// No worker of that id is in the group.
    #[error("unknown worker id {id}: no member of this RPC group has it")]
    UnknownWorkerId {
        /// The id asked for.
        id: i64,
    },
    /// A future's callback ([`RpcFuture::then`](super::RpcFuture::then)) panicked.
    #[error("an RPC future's callback panicked: {what}")]
    CallbackPanicked {
        /// The panic's text.
        what: String,
    },
    /// A handler with that name is registered already.
    #[error("an RPC handler named {name} is already registered")]
    HandlerExists {
        /// The name.
        name: String,
    },
    /// The call ran past its timeout (PyTorch's text).
    #[error(transparent)]
    Timeout(Box<RpcTimeoutError>),
    /// The handler on the peer failed, or the peer refused the request.
    #[error("RPC {handler} on {peer} failed remotely: {message}")]
    Remote {
        /// The peer.
        peer: String,
        /// The handler called.
        handler: String,
        /// The peer's error text.
        message: String,
    },
    /// Opening a pipe to the peer failed.
    #[error("cannot open an RPC pipe to {peer} at {address}: {reason}; is {peer} still running?")]
    Connect {
        /// The peer.
        peer: String,
        /// Its published address.
        address: String,
        /// What the transport said.
        reason: String,
    },
    /// The pipe handshake with the peer failed.
    #[error("RPC pipe handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The pipe broke while the call was in flight; the next call re-creates it.
    #[error("the RPC pipe to {peer} broke while the call was in flight: {reason}; the next call to {peer} opens a new pipe")]
    PipeBroken {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A tensor cannot travel to the peer: no channel serves its devices.
    #[error("cannot send a tensor from {source_device} to {target_device} on {peer}: no negotiated channel serves that pair (CPU tensors go over xth, cma, mpt or basic; a pair with a CUDA device needs cuda_xth, cuda_ipc, cuda_gdr or cuda_basic on both workers and a CUDA runtime, RpcOptions::device_plugins, on each side that holds CUDA memory)")]
    NoChannel {
        /// The peer.
        peer: String,
        /// The local device, as text.
        source_device: String,
        /// The device on the peer, as text.
        target_device: String,
    },
    /// Moving a tensor over a channel failed: exporting it, or pulling it from the peer
    /// (the peer process is gone, the kernel refused the read, the descriptor is stale
    /// or was not negotiated).
    #[error("tensor transfer over the {channel} channel with {peer} failed: {reason}")]
    Channel {
        /// The channel.
        channel: &'static str,
        /// The peer worker.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The request or response could not be framed.
    #[error("cannot encode the RPC message for {peer}: {source}")]
    Encode {
        /// The peer.
        peer: String,
        /// Why.
        #[source]
        source: Box<EncodeError>,
    },
    /// A blocking wait ran on the agent's I/O thread (inside an inline handler).
    #[error("a blocking wait for an RPC result inside an inline handler (rpc::Inline) would stop this worker's I/O thread and deadlock; use rpc_async without waiting, or register the handler without Inline")]
    BlockingInline,
    /// Fault injection failed the send on purpose (PyTorch's faulty agent's text).
    #[error("Send attempt failed intentionally for {handler}")]
    InjectedFault {
        /// The handler the request was for.
        handler: String,
    },
    /// [`RpcAgent::wait_until_pending_futures_flushed`](super::RpcAgent::wait_until_pending_futures_flushed)
    /// ran out of time.
    #[error("Timed out waiting to flush pending futures, had {pending} pending futures")]
    FlushTimeout {
        /// Calls still in flight.
        pending: u32,
    },
    /// The agent is shut down, or shut down while the call was pending.
    #[error("the RPC agent of worker {name} is shut down; the call did not complete")]
    ShutDown {
        /// This worker's name.
        name: String,
    },
    /// The group's start-up failed (workers that did not publish in time).
    #[error(transparent)]
    Startup(Box<rdzv_core::rpc::startup::StartupError>),
    /// A graceful shutdown or `join` with a timeout ran out of time.
    #[error("graceful RPC shutdown of worker {name} timed out after {timeout:?}: {}", join_waiting_text(.missing))]
    JoinTimeout {
        /// This worker's name.
        name: String,
        /// The timeout.
        timeout: Duration,
        /// The workers that never reached the shutdown barrier (empty: all did, and
        /// calls were still in flight).
        missing: Vec<String>,
    },
    /// An RRef could not be used: its value could not be fetched, its `remote()` call or
    /// handler failed, or it cannot be forked or received.
    #[error("RRef {rref} owned by {owner}: {reason}")]
    RRef {
        /// The RRef's id.
        rref: String,
        /// Its owner's worker name.
        owner: String,
        /// Why.
        reason: String,
    },
    /// An RRef test helper (`wait_until_owners_and_forks_on_rank`,
    /// `wait_until_pending_futures_and_users_flushed`) ran out of time.
    #[error("{reason}")]
    RRefWait {
        /// PyTorch's text, with the counts seen last.
        reason: String,
    },
    /// The graceful shutdown protocol failed.
    #[error("graceful RPC shutdown of worker {name} failed: {source}")]
    Join {
        /// This worker's name.
        name: String,
        /// Why.
        #[source]
        source: Box<JoinError>,
    },
}

macro_rules! boxed_from {
    ($($source:ty => $variant:ident),* $(,)?) => {
        $(impl From<$source> for RpcError {
            fn from(e: $source) -> Self {
                RpcError::$variant(Box::new(e))
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
    RpcTimeoutError => Timeout,
}

/// Turns a store failure of `op` on `key` into [`RpcError::Store`].
fn join_waiting_text(missing: &[String]) -> String {
    if missing.is_empty() {
        "every worker reached the shutdown barrier, but calls were still in flight; give it more time or find the call that does not end".to_string()
    } else {
        format!(
            "workers that did not reach the shutdown barrier: {}; shut them down too (every worker of the group must call it)",
            missing.join(", ")
        )
    }
}

pub(crate) fn store_error<'k>(
    op: &'static str,
    key: &'k str,
) -> impl FnOnce(crate::store::StoreError) -> RpcError + 'k {
    move |source| RpcError::Store {
        op,
        key: key.to_string(),
        source: Box::new(source),
    }
}
