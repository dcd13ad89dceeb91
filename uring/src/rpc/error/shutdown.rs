//! [`ShutdownError`]: what `join`, `join_with`, `shutdown` and `shutdown_with_timeout`
//! return.

use std::time::Duration;

use rdzv_core::rpc::shutdown::JoinError;

use super::{CallError, StoreOpError};

/// Why a graceful shutdown or `join` did not complete. The agent is closed anyway after
/// `shutdown`; after `join_with(false, ..)` it keeps running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShutdownError {
    /// The agent is shut down already (`join_with(false, ..)` needs a running agent).
    #[error("the RPC agent of worker {name} is shut down; the call did not complete")]
    ShutDown {
        /// This worker's name.
        name: String,
    },
    /// A store operation of the shutdown protocol failed.
    #[error(transparent)]
    Store(Box<StoreOpError>),
    /// The graceful shutdown protocol failed.
    #[error("graceful RPC shutdown of worker {name} failed: {source}")]
    Join {
        /// This worker's name.
        name: String,
        /// Why.
        #[source]
        source: Box<JoinError>,
    },
    /// The graceful shutdown or `join` ran out of time.
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
    /// A dynamic member's leave could not tell another member (its call failed).
    #[error(transparent)]
    Call(Box<CallError>),
}

impl ShutdownError {
    /// Whether the protocol ran out of time ([`ShutdownError::JoinTimeout`]).
    pub fn is_timeout(&self) -> bool {
        match self {
            ShutdownError::JoinTimeout { .. } => true,
            ShutdownError::Call(e) => e.is_timeout(),
            _ => false,
        }
    }

    /// The workers that never reached the shutdown barrier, for a timeout.
    pub fn missing_workers(&self) -> &[String] {
        match self {
            ShutdownError::JoinTimeout { missing, .. } => missing,
            _ => &[],
        }
    }
}

impl From<StoreOpError> for ShutdownError {
    fn from(e: StoreOpError) -> Self {
        ShutdownError::Store(Box::new(e))
    }
}

impl From<CallError> for ShutdownError {
    fn from(e: CallError) -> Self {
        ShutdownError::Call(Box::new(e))
    }
}

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
