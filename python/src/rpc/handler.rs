//! The one handler that runs Python: `PYTHON_CALL` (torch's message type of the same
//! name), registered before the agent listens. It runs on the agent's worker pool
//! (`num_worker_threads` threads) and takes the GIL only to run the package's `serve`
//! function (`rdzv/rpc/_serve.py`), which unpickles `(func, args, kwargs)`, calls it and
//! pickles the result or the exception: a Python exception is a reply like any other, so
//! it fails that call only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::prelude::*;

use rdzv_uring::rpc::{CallContext, Handler, Message};

use super::message;

/// The handler name Python calls use.
pub(crate) const PYTHON_CALL: &str = "PYTHON_CALL";

/// Runs `serve(caller, (metadata, payload, buffers))` for each request.
pub(crate) struct PythonCall {
    pub(crate) serve: Py<PyAny>,
    /// Cleared when the interpreter exits (`atexit`): no handler takes the GIL then.
    pub(crate) interpreter_alive: Arc<AtomicBool>,
}

impl Handler for PythonCall {
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        if !self.interpreter_alive.load(Ordering::Acquire) {
            return Err(format!(
                "{PYTHON_CALL} from {}: the Python interpreter of this worker is exiting",
                ctx.caller
            ));
        }
        Python::attach(|py| {
            let arguments = message::to_python(py, &request)?;
            drop(request);
            let reply = self
                .serve
                .bind(py)
                .call1((ctx.caller.as_str(), arguments))?;
            message::from_tuple(&reply)
        })
        .map_err(|e: PyErr| format!("{PYTHON_CALL} from {}: {e}", ctx.caller))
    }
}
