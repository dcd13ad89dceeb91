//! [`RRefFailure`]: why an RRef's value could not be had, the reason of a
//! [`CallError::RRef`]. The call that failed (the `remote()` that creates the RRef, the
//! fetch that could not reach the owner) is carried as the source, with its kind; only
//! a handler's error and the owner's answer stay text, as they travel on the wire. It is
//! a part of `call` because the two hold each other.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::rref::wire::WireError;

use super::{CallError, CallErrorKind};

/// Why an RRef's value could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RRefFailure {
    /// Its `remote()` handler failed on the owner (the handler's text).
    #[error("its handler failed: {message}")]
    Handler {
        /// The handler's error text.
        message: String,
    },
    /// The value was not ready on the owner within the wait.
    #[error("the value is not ready after {timeout:?}")]
    NotReady {
        /// How long it was waited for.
        timeout: Duration,
    },
    /// The owner answered the fetch with an error (its text: not ready there, unknown).
    #[error("{message}")]
    Owner {
        /// The owner's text.
        message: String,
    },
    /// The `remote()` call that creates the RRef failed (PyTorch's text); that call's
    /// error is the source, and its kind the failure's.
    #[error("RRef creation via rpc.remote() failed ({source}), and it is possible that the RRef on the owner node does not exist; call remote() again")]
    CreationFailed {
        /// The `remote()` call's error, shared by every `to_here` that reports it.
        #[source]
        source: Arc<CallError>,
    },
    /// The fetch could not reach the owner; the call's error is the source.
    #[error("to_here could not reach the owner: {source}")]
    Unreachable {
        /// The fetch call's error.
        #[source]
        source: Box<CallError>,
    },
    /// A request about the RRef could not be encoded.
    #[error("{0}")]
    Encode(#[source] WireError),
    /// The RRef is its owner's and has no fork to fetch with (a runtime bug).
    #[error("an RRef with no fork is its owner's")]
    NoFork,
}

impl RRefFailure {
    /// What kind of failure it is: the call's for a failed `remote()` or an owner that
    /// could not be reached, a remote error for the handler's or the owner's text.
    pub fn kind(&self) -> CallErrorKind {
        match self {
            RRefFailure::Handler { .. } | RRefFailure::Owner { .. } => CallErrorKind::Remote,
            RRefFailure::NotReady { .. } => CallErrorKind::Timeout,
            RRefFailure::CreationFailed { source } => source.kind(),
            RRefFailure::Unreachable { source } => source.kind(),
            RRefFailure::Encode(_) => CallErrorKind::Encode,
            RRefFailure::NoFork => CallErrorKind::Usage,
        }
    }
}
