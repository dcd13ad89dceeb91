//! [`PipeFailure`]: why a pipe to a peer could not open, or ended under calls in flight.

use std::sync::Arc;

use super::TransportError;

/// A cause shared by every call that fails with it.
pub type SharedCause = Arc<dyn std::error::Error + Send + Sync>;

/// Why a pipe to a peer could not open, or ended with calls in flight: the reason of
/// [`CallError::Connect`](super::CallError::Connect),
/// [`CallError::Handshake`](super::CallError::Handshake) and
/// [`CallError::PipeBroken`](super::CallError::PipeBroken). One failure fails every call
/// waiting on the pipe, so it is `Clone` and its sources are shared.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PipeFailure {
    /// The connection failed: connecting, sending or receiving.
    #[error("{0}")]
    Transport(#[source] Arc<TransportError>),
    /// The peer closed the pipe without a goodbye (its process may be gone).
    #[error("the peer closed the pipe")]
    Closed,
    /// The peer closed the pipe before it answered the handshake.
    #[error("the peer closed the pipe during the handshake")]
    ClosedInHandshake,
    /// This worker reset its pipes (`RpcAgent::reset_pipes`).
    #[error("this worker reset its pipes")]
    Reset,
    /// This worker is shutting down.
    #[error("this worker is shutting down")]
    ShuttingDown,
    /// The peer refused the pipe, with its reason as it sent it.
    #[error("refused: {0}")]
    Refused(String),
    /// The worker at the peer's published address is another one: the group's
    /// addresses are stale.
    #[error("the worker at {address} is {found}, not {expected}; the group's addresses are stale")]
    WrongPeer {
        /// The address connected to.
        address: String,
        /// Who answered.
        found: String,
        /// Who was expected.
        expected: String,
    },
    /// The handshake failed: a frame that is not a valid handshake, or a negotiation
    /// the two workers' offers do not allow.
    #[error("{0}")]
    Handshake(#[source] SharedCause),
    /// The pipe's protocol ended it or refused a frame on it (core's `rpc::pipe`).
    #[error("{0}")]
    Protocol(#[source] SharedCause),
    /// This worker could not run the pipe: no transport or address for the peer, a
    /// thread that could not start, its mpt connections.
    #[error("{0}")]
    Local(#[source] SharedCause),
}

impl PipeFailure {
    /// A transport failure.
    pub(crate) fn transport(error: TransportError) -> PipeFailure {
        PipeFailure::Transport(Arc::new(error))
    }

    /// A handshake failure caused by `error`.
    pub(crate) fn handshake(error: impl std::error::Error + Send + Sync + 'static) -> PipeFailure {
        PipeFailure::Handshake(Arc::new(error))
    }

    /// A protocol failure caused by `error`.
    pub(crate) fn protocol(error: impl std::error::Error + Send + Sync + 'static) -> PipeFailure {
        PipeFailure::Protocol(Arc::new(error))
    }

    /// A local failure caused by `error`.
    pub(crate) fn local(error: impl std::error::Error + Send + Sync + 'static) -> PipeFailure {
        PipeFailure::Local(Arc::new(error))
    }
}
