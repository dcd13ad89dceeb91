//! The one handler that runs Python: `PYTHON_CALL` (torch's message type of the same
//! name), registered before the agent listens. It runs on the thread that read the
//! request, in one of the agent's `num_worker_threads` worker slots (on the worker pool
//! when none is free; another thread reads the pipe on if it runs past 2 ms:
//! `Handler::runs_on_reader`), and takes the GIL only to run the package's `serve`
//! function (`rdzv/rpc/__init__.py`), which unpickles `(func, args, kwargs)`, calls it and
//! pickles the result or the exception: a Python exception is a reply like any other, so
//! it fails that call only.
//!
//! An `@rpc.functions.async_execution` function answers later: `serve` then returns,
//! instead of the reply, a callable `attach(on_reply)` that calls `on_reply(reply)` once
//! the function's future completes. The pool thread goes on meanwhile; the response is
//! sent from the thread that completes the future.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyTuple};

use rdzv_uring::rpc::{CallContext, CallError, Handler, Message, Reply, RpcFuture, UsageError};

use super::message;

/// The handler name Python calls use.
pub(crate) const PYTHON_CALL: &str = "PYTHON_CALL";

/// Runs `serve(caller, (metadata, payload, buffers))` for each request.
pub(crate) struct PythonCall {
    pub(crate) serve: Py<PyAny>,
    /// Cleared when the interpreter exits (`atexit`): no handler takes the GIL then.
    pub(crate) interpreter_alive: Arc<AtomicBool>,
}

/// A reply from Python that could not become a message, as the call's error.
fn bad_reply(error: &PyErr) -> CallError {
    UsageError::InvalidArgument {
        argument: "the Python reply",
        reason: error.to_string(),
    }
    .into()
}

/// `on_reply(reply)` for `attach`: completes `future`'s promise with the reply, once.
fn on_reply<'py>(py: Python<'py>) -> PyResult<(Bound<'py, PyCFunction>, RpcFuture)> {
    let (future, promise) = RpcFuture::pending();
    let promise = Mutex::new(Some(promise));
    let callback = PyCFunction::new_closure(
        py,
        None,
        None,
        move |args: &Bound<'_, PyTuple>, _: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
            let result = message::from_tuple(&args.get_item(0)?).map_err(|e| bad_reply(&e));
            let promise = promise.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(promise) = promise {
                // Sending the response needs no GIL.
                args.py().detach(|| promise.complete(result));
            }
            Ok(())
        },
    )?;
    Ok((callback, future))
}

impl Handler for PythonCall {
    /// Python runs on the reader: a quick call costs no thread hand-off, and one that
    /// blocks (a nested `rpc_sync`, a lock) is read past.
    fn runs_on_reader(&self) -> bool {
        true
    }

    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        match self.reply(ctx, request) {
            Reply::Now(result) => result,
            Reply::Later(future) => future.wait().map_err(|e| e.to_string()),
        }
    }

    fn reply(&self, ctx: &CallContext, request: Message) -> Reply {
        if !self.interpreter_alive.load(Ordering::Acquire) {
            return Reply::Now(Err(format!(
                "{PYTHON_CALL} from {}: the Python interpreter of this worker is exiting",
                ctx.caller
            )));
        }
        // Agent threads keep their Python thread state from one call to the next.
        super::sys::keep_thread_state();
        Python::attach(|py| -> PyResult<Reply> {
            let arguments = message::to_python(py, request)?;
            let reply = self
                .serve
                .bind(py)
                .call1((ctx.caller.as_str(), arguments))?;
            if reply.cast::<PyTuple>().is_ok() {
                return Ok(Reply::Now(Ok(message::from_tuple(&reply)?)));
            }
            let (callback, future) = on_reply(py)?;
            reply.call1((callback,))?;
            Ok(Reply::Later(future))
        })
        .unwrap_or_else(|e: PyErr| {
            Reply::Now(Err(format!("{PYTHON_CALL} from {}: {e}", ctx.caller)))
        })
    }
}
