//! The RPC agent's errors as the exception classes of `rdzv/rpc/_errors.py`.
//!
//! The texts are the agent's own, which carry torch's where torch has one ("RPC ran for
//! more than set timeout", "Unknown destination worker" in words of its own); a timeout
//! also names the worker it was waiting for.

use pyo3::prelude::*;

use rdzv_uring::rpc::{CallError, CallErrorKind, InitError, ShutdownError};

use crate::errors::raise_from;

/// The module the classes live in.
const MODULE: &str = "rdzv.rpc._errors";

/// The class of a failed call, by what the caller can do about it.
fn call_class(error: &CallError) -> &'static str {
    match error.kind() {
        CallErrorKind::Timeout => "RpcTimeoutError",
        CallErrorKind::Remote => "RpcRemoteError",
        CallErrorKind::PipeBroken | CallErrorKind::Connect | CallErrorKind::Handshake => {
            "RpcConnectionError"
        }
        CallErrorKind::ShutDown => "RpcShutdownError",
        CallErrorKind::Usage => "RpcUsageError",
        _ => "RpcError",
    }
}

/// A failed call as a Python exception.
pub(crate) fn call(error: &CallError) -> PyErr {
    let text = match (error, error.peer()) {
        // The core's timeout text names no worker.
        (CallError::Timeout { .. }, Some(peer)) => format!("{error} (a call to worker {peer})"),
        _ => error.to_string(),
    };
    raise_from(MODULE, call_class(error), text)
}

/// A failed start-up as a Python exception.
pub(crate) fn init(error: &InitError) -> PyErr {
    let text = rdzv_uring::rpc::error_chain(error);
    raise_from(MODULE, "RpcInitError", text)
}

/// A failed shutdown as a Python exception.
pub(crate) fn shutdown(error: &ShutdownError) -> PyErr {
    let class = if error.is_timeout() {
        "RpcTimeoutError"
    } else {
        "RpcError"
    };
    raise_from(MODULE, class, error.to_string())
}

/// Misuse of the binding (an agent used after shutdown, a bad option).
pub(crate) fn usage(text: String) -> PyErr {
    raise_from(MODULE, "RpcUsageError", text)
}
