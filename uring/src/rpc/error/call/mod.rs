//! [`CallError`]: what a call returns (`rpc_sync`, the future of `rpc_async`, an RRef's
//! `to_here`, a handler's own calls), with [`CallErrorKind`] saying what the caller can
//! do about it.

use std::time::Duration;

use rdzv_core::rpc::frame::EncodeError;
use rdzv_core::rpc::timeouts::RpcTimeoutError;

use super::{ChannelFailure, PipeFailure, UsageError};

mod rref;
pub use rref::RRefFailure;

/// What kind of failure a [`CallError`] is: small, `Copy`, for matching and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallErrorKind {
    /// The call (or a wait for calls) ran past its timeout.
    Timeout,
    /// The handler on the peer failed, or the peer refused the request.
    Remote,
    /// The pipe to the peer broke while the call was in flight.
    PipeBroken,
    /// The pipe to the peer could not be opened (connect refused, peer gone).
    Connect,
    /// The pipe handshake with the peer failed (the peers cannot agree on a pipe).
    Handshake,
    /// No negotiated channel serves a tensor's devices.
    NoChannel,
    /// Moving a tensor over a channel failed.
    Channel,
    /// The request or response could not be framed (too large, too many tensors).
    Encode,
    /// Fault injection failed the send on purpose.
    InjectedFault,
    /// The agent is shut down.
    ShutDown,
    /// A thread the call needed could not start.
    Resources,
    /// The API was used wrongly ([`UsageError`]).
    Usage,
}

impl CallErrorKind {
    /// Whether the same call may succeed if made again: a timeout, a broken pipe, a
    /// failed connect and an injected fault are transient (a new call opens a new pipe);
    /// everything else (the handler's own error, a handshake or channel the peers cannot
    /// agree on, an encode failure, a shut down agent, misuse) fails the same way again
    /// until something changes.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            CallErrorKind::Timeout
                | CallErrorKind::PipeBroken
                | CallErrorKind::Connect
                | CallErrorKind::InjectedFault
        )
    }
}

/// What an RRef test helper waited for and the counts it saw last, when it ran out of
/// time (PyTorch's texts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RRefWaitTimeout {
    /// `wait_until_owners_and_forks_on_rank`.
    #[error("Timed out waiting {timeout:?} for {owners} owners and {forks} forks on rank {rank}, had {had_owners} owners and {had_forks} forks")]
    OwnersAndForks {
        /// How long it waited.
        timeout: Duration,
        /// The owner RRefs waited for.
        owners: usize,
        /// The forks waited for.
        forks: usize,
        /// The rank asked.
        rank: i16,
        /// The owner RRefs it had last.
        had_owners: usize,
        /// The forks it had last.
        had_forks: usize,
    },
    /// `wait_until_pending_futures_and_users_flushed`.
    #[error("Timed out waiting {timeout:?} to flush pending futures and users, had {futures} pending RRef futures, {users} pending users and {calls} calls in flight")]
    Flush {
        /// How long it waited.
        timeout: Duration,
        /// RRef control messages unanswered last.
        futures: usize,
        /// Users unconfirmed last.
        users: usize,
        /// Calls in flight last.
        calls: u32,
    },
}

/// Why a call failed. [`kind`](Self::kind) classifies it; [`is_retryable`](
/// Self::is_retryable) says whether making the call again may succeed; [`peer`](
/// Self::peer) names the worker it was for.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The call ran past its timeout (PyTorch's text).
    #[error("{error}")]
    Timeout {
        /// The worker called.
        peer: String,
        /// The timeout.
        error: RpcTimeoutError,
    },
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
        /// Why.
        #[source]
        reason: PipeFailure,
    },
    /// The pipe handshake with the peer failed.
    #[error("RPC pipe handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer.
        peer: String,
        /// Why.
        #[source]
        reason: PipeFailure,
    },
    /// The pipe broke while the call was in flight; the next call re-creates it.
    #[error("the RPC pipe to {peer} broke while the call was in flight: {reason}; the next call to {peer} opens a new pipe")]
    PipeBroken {
        /// The peer.
        peer: String,
        /// Why.
        #[source]
        reason: PipeFailure,
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
    /// or was not negotiated): [`ChannelFailure`] says which, with the channel's own
    /// error as its source.
    #[error("tensor transfer over the {channel} channel with {peer} failed: {}{}", tensor_prefix(*index), super::error_chain(reason))]
    Channel {
        /// The channel.
        channel: &'static str,
        /// The peer worker.
        peer: String,
        /// The tensor's index in its message, when one tensor failed.
        index: Option<usize>,
        /// Why.
        #[source]
        reason: ChannelFailure,
    },
    /// A device runtime failed to move tensor `index` (staging it, lending or borrowing
    /// its memory, copying it): the runtime's own error, a
    /// [`DeviceError`](crate::rpc::DeviceError), is the source.
    #[error("tensor {index} over the {channel} channel with {peer}: {}", super::error_chain(source.as_ref()))]
    Device {
        /// The channel.
        channel: &'static str,
        /// The peer worker.
        peer: String,
        /// The tensor's index in its message.
        index: usize,
        /// The device runtime's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
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
    /// Fault injection failed the send on purpose (PyTorch's faulty agent's text).
    #[error("Send attempt failed intentionally for {handler}")]
    InjectedFault {
        /// The worker called.
        peer: String,
        /// The handler the request was for.
        handler: String,
    },
    /// The agent is shut down, or shut down while the call was pending.
    #[error("the RPC agent of worker {name} is shut down; the call did not complete")]
    ShutDown {
        /// This worker's name.
        name: String,
    },
    /// [`RpcAgent::wait_until_pending_futures_flushed`](crate::rpc::RpcAgent::wait_until_pending_futures_flushed)
    /// ran out of time.
    #[error("Timed out waiting to flush pending futures, had {pending} pending futures")]
    FlushTimeout {
        /// Calls still in flight.
        pending: u32,
    },
    /// An RRef test helper (`wait_until_owners_and_forks_on_rank`,
    /// `wait_until_pending_futures_and_users_flushed`) ran out of time.
    #[error(transparent)]
    RRefWait(RRefWaitTimeout),
    /// An RRef's value could not be had: its `remote()` call or handler failed, it was
    /// not ready in time, or the owner could not be reached ([`RRefFailure`], whose
    /// kind is this error's).
    #[error("RRef {rref} owned by {owner}: {reason}")]
    RRef {
        /// The RRef's id.
        rref: String,
        /// Its owner's worker name.
        owner: String,
        /// Why.
        #[source]
        reason: RRefFailure,
    },
    /// A thread the call needed could not start.
    #[error("cannot start {what}: {source}")]
    Resources {
        /// The thread.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The API was used wrongly.
    #[error(transparent)]
    Usage(#[from] UsageError),
}

impl CallError {
    /// What kind of failure this is.
    pub fn kind(&self) -> CallErrorKind {
        match self {
            CallError::Timeout { .. } | CallError::FlushTimeout { .. } | CallError::RRefWait(_) => {
                CallErrorKind::Timeout
            }
            CallError::Remote { .. } => CallErrorKind::Remote,
            CallError::Connect { .. } => CallErrorKind::Connect,
            CallError::Handshake { .. } => CallErrorKind::Handshake,
            CallError::PipeBroken { .. } => CallErrorKind::PipeBroken,
            CallError::NoChannel { .. } => CallErrorKind::NoChannel,
            CallError::Channel { .. } | CallError::Device { .. } => CallErrorKind::Channel,
            CallError::Encode { .. } => CallErrorKind::Encode,
            CallError::InjectedFault { .. } => CallErrorKind::InjectedFault,
            CallError::ShutDown { .. } => CallErrorKind::ShutDown,
            CallError::RRef { reason, .. } => reason.kind(),
            CallError::Resources { .. } => CallErrorKind::Resources,
            CallError::Usage(_) => CallErrorKind::Usage,
        }
    }

    /// Whether the call ran past its timeout.
    pub fn is_timeout(&self) -> bool {
        self.kind() == CallErrorKind::Timeout
    }

    /// Whether the peer answered with an error (its handler failed, or it refused the
    /// request): the peer is alive.
    pub fn is_remote(&self) -> bool {
        self.kind() == CallErrorKind::Remote
    }

    /// Whether making the same call again may succeed; see
    /// [`CallErrorKind::is_retryable`] for the rule.
    pub fn is_retryable(&self) -> bool {
        self.kind().is_retryable()
    }

    /// Whether the API was used wrongly ([`usage`](Self::usage) says how).
    pub fn is_usage(&self) -> bool {
        self.kind() == CallErrorKind::Usage
    }

    /// The misuse, for a [`CallErrorKind::Usage`] error.
    pub fn usage(&self) -> Option<&UsageError> {
        match self {
            CallError::Usage(e) => Some(e),
            _ => None,
        }
    }

    /// The worker the call was for, where the error knows it (a shut down agent names
    /// none: its name is this worker's).
    pub fn peer(&self) -> Option<&str> {
        match self {
            CallError::Timeout { peer, .. }
            | CallError::Remote { peer, .. }
            | CallError::Connect { peer, .. }
            | CallError::Handshake { peer, .. }
            | CallError::PipeBroken { peer, .. }
            | CallError::NoChannel { peer, .. }
            | CallError::Channel { peer, .. }
            | CallError::Device { peer, .. }
            | CallError::Encode { peer, .. }
            | CallError::InjectedFault { peer, .. } => Some(peer),
            CallError::RRef { owner, .. } => Some(owner),
            CallError::Usage(e) => e.peer(),
            CallError::ShutDown { .. }
            | CallError::FlushTimeout { .. }
            | CallError::RRefWait(_)
            | CallError::Resources { .. } => None,
        }
    }

    /// The remote handler's error text, for a [`CallErrorKind::Remote`] error from a
    /// call (not an RRef's).
    pub fn remote_message(&self) -> Option<&str> {
        match self {
            CallError::Remote { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// "tensor 3: " for tensor 3, nothing when no one tensor failed.
fn tensor_prefix(index: Option<usize>) -> String {
    index.map_or_else(String::new, |index| format!("tensor {index}: "))
}

#[cfg(test)]
mod tests;
