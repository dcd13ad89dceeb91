//! The agent's errors, split by what the caller can do about them (as h2 splits its
//! opaque `Error` from its `UserError`):
//!
//! * [`InitError`]: `init_rpc` and `RpcOptions::check` (fix an option, the rendezvous,
//!   the group; [`InitError::is_retryable`] for a store that could not be reached);
//! * [`CallError`]: a call (`rpc_sync`, an `rpc_async` future, `to_here`), with
//!   [`CallError::kind`], [`CallError::is_timeout`], [`CallError::is_remote`],
//!   [`CallError::is_retryable`] and [`CallError::peer`];
//! * [`ShutdownError`]: `join` and `shutdown`;
//! * [`UsageError`]: API misuse, returned directly by calls that fail only that way and
//!   carried in [`CallError::Usage`] by those that can also fail on the network.
//!
//! [`RpcError`] is any of the four, for callers that want one type; every public method
//! returns the specific one. [`TransportError`] is the transport seam's, formatted here
//! once. Each variant names the peer, key or option involved and, where there is one,
//! what to do about it. The only errors that stay text are a handler's, which travel on
//! the wire. A channel's failure is a [`ChannelFailure`] in [`CallError::Channel`], a
//! device runtime's a [`DeviceError`](crate::rpc::DeviceError) in [`CallError::Device`],
//! each with the underlying error as its source.

use std::io;

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::frame::{EncodeError, FrameError};

use crate::store::StoreError;

mod call;
mod channel;
mod init;
mod pipe;
mod shutdown;
mod usage;

pub use call::{CallError, CallErrorKind, RRefFailure, RRefWaitTimeout};
pub use channel::{ChannelCause, ChannelFailure};
pub use init::{DevicesError, InitError};
pub use pipe::{PipeFailure, SharedCause};
pub use shutdown::ShutdownError;
pub use usage::UsageError;

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
    /// A plugged-in transport cannot run in this process (no device, no library); the
    /// agent leaves it out and says why.
    #[error("the {transport} transport is not viable here: {}", error_chain(source.as_ref()))]
    Unavailable {
        /// The transport.
        transport: TransportKind,
        /// The plugin's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl TransportError {
    /// For `map_err`: a connect to `address` that failed ([`TransportError::Connect`]).
    pub fn connecting(address: &str) -> impl Fn(io::Error) -> TransportError + '_ {
        move |source| TransportError::Connect {
            address: address.to_string(),
            source,
        }
    }

    /// For `map_err`: an accept on `address` that failed ([`TransportError::Accept`]).
    pub fn accepting(address: &str) -> impl Fn(io::Error) -> TransportError + '_ {
        move |source| TransportError::Accept {
            address: address.to_string(),
            source,
        }
    }
}

/// `error` and every error in its `source()` chain, joined by ": ", each source left out
/// whose text the text before it has already (an error that quotes its cause, or is
/// `transparent`). `{e}` prints only the top error; this is the one place the agent, its
/// plugins and the CLI turn a whole chain into one line.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

/// A store operation of the start-up or shutdown protocol failed.
#[derive(Debug, thiserror::Error)]
#[error("RPC store {op} of key {key} failed: {source}")]
pub struct StoreOpError {
    /// The operation.
    pub op: &'static str,
    /// The key.
    pub key: String,
    /// Why.
    #[source]
    pub source: StoreError,
}

/// Any of the agent's errors, for a caller that wants one type (every method returns
/// the specific one, and each converts into this).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The agent could not start.
    #[error(transparent)]
    Init(#[from] InitError),
    /// A call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A graceful shutdown or `join` failed.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
    /// The API was used wrongly.
    #[error(transparent)]
    Usage(#[from] UsageError),
}

impl RpcError {
    /// Whether trying again may succeed (a call's or start-up's rule; a shutdown's or a
    /// misuse never).
    pub fn is_retryable(&self) -> bool {
        match self {
            RpcError::Init(e) => e.is_retryable(),
            RpcError::Call(e) => e.is_retryable(),
            RpcError::Shutdown(_) | RpcError::Usage(_) => false,
        }
    }
}

/// Turns a store failure of `op` on `key` into a [`StoreOpError`], which start-up and
/// shutdown errors convert from.
pub(crate) fn store_error<'k>(
    op: &'static str,
    key: &'k str,
) -> impl FnOnce(StoreError) -> StoreOpError + 'k {
    move |source| StoreOpError {
        op,
        key: key.to_string(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdzv_core::rpc::shutdown::JoinError;

    use super::*;

    fn store_failure() -> StoreOpError {
        store_error("get", "rpc/0/key")(StoreError::Timeout {
            keys: vec!["rpc/0/key".into()],
            ms: 5,
        })
    }

    #[test]
    fn init_errors_say_whether_to_fix_or_retry() {
        let option = InitError::InvalidOption {
            option: "num_worker_threads",
            reason: "must be at least 1".into(),
        };
        assert!(option.is_configuration() && !option.is_retryable());
        let store = InitError::from(store_failure());
        assert!(store.is_retryable() && !store.is_configuration());
        assert!(store
            .to_string()
            .starts_with("RPC store get of key rpc/0/key failed: "));
        let call = InitError::from(CallError::PipeBroken {
            peer: "bob".into(),
            reason: PipeFailure::Reset,
        });
        assert!(call.is_retryable());
        let usage_call = InitError::from(CallError::from(UsageError::BlockingInline));
        assert!(!usage_call.is_retryable());
        assert!(!RpcError::from(option).is_retryable());
    }

    #[test]
    fn shutdown_errors_name_what_is_missing() {
        let timeout = ShutdownError::JoinTimeout {
            name: "a".into(),
            timeout: Duration::from_millis(800),
            missing: vec!["b".into()],
        };
        assert!(timeout.is_timeout());
        assert_eq!(timeout.missing_workers(), ["b".to_string()]);
        assert!(timeout
            .to_string()
            .contains("did not reach the shutdown barrier: b"));
        let protocol = ShutdownError::Join {
            name: "a".into(),
            source: Box::new(JoinError::UnexpectedOutcome {
                expected: "Added",
                got: "Set",
            }),
        };
        assert!(!protocol.is_timeout() && protocol.missing_workers().is_empty());
        let store = ShutdownError::from(store_failure());
        assert!(matches!(store, ShutdownError::Store(_)));
        let text = timeout.to_string();
        assert_eq!(RpcError::from(timeout).to_string(), text);
        assert!(!RpcError::from(protocol).is_retryable());
    }

    #[derive(Debug, thiserror::Error)]
    #[error("no device")]
    struct NoDevice(#[source] io::Error);

    #[test]
    fn an_unavailable_plugin_transport_says_why_with_the_whole_chain() {
        let error = TransportError::Unavailable {
            transport: TransportKind::Ibv,
            source: Box::new(NoDevice(io::Error::other("ENODEV"))),
        };
        assert_eq!(
            error.to_string(),
            "the ibv transport is not viable here: no device: ENODEV"
        );
    }

    #[test]
    fn usage_errors_name_the_worker_they_are_about() {
        let unknown = UsageError::UnknownWorker { name: "x".into() };
        assert_eq!(unknown.peer(), Some("x"));
        assert_eq!(UsageError::UnknownWorkerId { id: 9 }.peer(), None);
        let call = CallError::from(unknown.clone());
        assert!(call.is_usage() && !call.is_retryable());
        assert_eq!(call.usage(), Some(&unknown));
        assert!(!RpcError::from(unknown).is_retryable());
    }
}
