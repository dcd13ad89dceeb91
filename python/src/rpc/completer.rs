//! The thread that completes Python futures: an agent thread that finishes a call (a
//! pipe's reader, the timer, the I/O thread) only queues the result here and never waits
//! for the GIL, so that a busy interpreter delays no other pipe. This thread takes the GIL
//! for each result and calls the Python callback `rpc_async` was given with
//! `(error, None)` or `(None, (metadata, payload, buffers))`. It also hands the owner
//! values the agent lets go of to the `released` callback, the same way.

use crossbeam_channel::{unbounded as channel, Receiver, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;

use pyo3::prelude::*;

use rdzv_uring::rpc::{CallError, Message, RpcFuture};

use super::{errors, message};

/// A finished call and whom to tell (`None`: the `released` callback).
struct Done {
    result: Result<Message, CallError>,
    callback: Option<Py<PyAny>>,
}

/// The completing thread and its queue.
pub(crate) struct Completer {
    queue: Mutex<Option<Sender<Done>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Completer {
    /// Starts the thread, which calls `released` with every value given to
    /// [`release`](Self::release).
    ///
    /// # Errors
    /// The OS refused a thread.
    pub(crate) fn start(name: &str, released: Py<PyAny>) -> std::io::Result<Completer> {
        let (queue, done) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("rdzv-rpc-py-{name}"))
            .spawn(move || deliver_all(&done, &released))?;
        Ok(Completer {
            queue: Mutex::new(Some(queue)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Calls `released(None, message)` on the completing thread; returns at once, and
    /// does nothing after [`stop`](Self::stop).
    pub(crate) fn release(&self, message: Message) {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(queue) = queue.as_ref() {
            let _ = queue.send(Done {
                result: Ok(message),
                callback: None,
            });
        }
    }

    /// Calls `callback` (on the completing thread) once `future` completes.
    ///
    /// # Errors
    /// `RpcShutdownError` after [`stop`](Self::stop).
    pub(crate) fn watch(&self, future: RpcFuture, callback: Py<PyAny>) -> PyResult<()> {
        let queue = self
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| errors::usage("the RPC agent is shut down".into()))?;
        // The future `then` makes is never waited for: its callback hands the result on.
        drop(future.then(move |result| {
            // A send fails only once the thread is gone, at shutdown: the callback is
            // dropped with the result.
            let _ = queue.send(Done {
                result,
                callback: Some(callback),
            });
            Ok(Message::default())
        }));
        Ok(())
    }

    /// Stops taking calls and waits until every queued result is delivered. Call it
    /// without the GIL (the thread needs it). Called on the thread itself (`shutdown`
    /// in a future's callback), it does not wait: the thread ends after that callback.
    pub(crate) fn stop(&self) {
        drop(self.queue.lock().unwrap_or_else(|p| p.into_inner()).take());
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if thread
            .as_ref()
            .is_some_and(|t| t.thread().id() == std::thread::current().id())
        {
            return;
        }
        if let Some(thread) = thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread's loop: until every sender is gone. It stays attached to the interpreter
/// and lets the GIL go while it waits, so its Python thread state lives as long as it
/// does (attaching afresh for each result made and freed one every time: a new frame
/// stack mapped and unmapped per call).
fn deliver_all(done: &Receiver<Done>, released: &Py<PyAny>) {
    Python::attach(|py| {
        while let Ok(Done { result, callback }) = py.detach(|| done.recv()) {
            let callback = callback.as_ref().unwrap_or(released);
            let (error, value) = match result.map(|m| message::to_python(py, m)) {
                Ok(Ok(value)) => (py.None(), value.into_any().unbind()),
                Ok(Err(error)) => (error.into_value(py).into_any(), py.None()),
                Err(error) => (errors::call(&error).into_value(py).into_any(), py.None()),
            };
            if let Err(error) = callback.call1(py, (error, value)) {
                error.write_unraisable(py, Some(callback.bind(py)));
            }
        }
    });
}
