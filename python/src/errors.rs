//! The Rust errors as the exception classes of `rdzv/_errors.py`.
//!
//! The classes are Python (so that one class can derive from two bases, as
//! `StoreTimeoutError(StoreError, TimeoutError)` does); this module only picks the class
//! for an error and keeps the error's own text, which names what failed and where.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

use rdzv_core::rendezvous::elastic::ElasticErrorKind;
use rdzv_uring::rendezvous::elastic::ElasticFailure;
use rdzv_uring::rendezvous::{RendezvousError, StoreRole};
use rdzv_uring::server::ServerError;
use rdzv_uring::store::StoreError;

/// An exception of class `class` (a name in `rdzv._errors`) with `message`. The core's
/// rendezvous messages start with torch's class name (for the CLI's one line); Python
/// prints the class itself, so a message that starts with it loses that start.
pub(crate) fn raise(class: &str, message: String) -> PyErr {
    let message = match message
        .strip_prefix(class)
        .and_then(|rest| rest.strip_prefix(": "))
    {
        Some(rest) => rest.to_string(),
        None => message,
    };
    raise_from("rdzv._errors", class, message)
}

/// An exception of class `class`, a name in the Python module `module`, with `message`.
pub(crate) fn raise_from(module: &str, class: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let found = py
            .import(module)
            .and_then(|module| module.getattr(class))
            .and_then(|class| class.cast_into::<PyType>().map_err(PyErr::from));
        match found {
            Ok(class) => PyErr::from_type(class, message),
            Err(_) => PyRuntimeError::new_err(format!("{class}: {message}")),
        }
    })
}

/// The class of a store error: timeouts, connection failures, an empty queue, the rest.
pub(crate) fn store_class(error: &StoreError) -> &'static str {
    match error {
        StoreError::Timeout { .. }
        | StoreError::GetTimeout { .. }
        | StoreError::BarrierTimeout { .. } => "StoreTimeoutError",
        StoreError::ConnectTimeout { .. } | StoreError::Io { .. } | StoreError::Closed { .. } => {
            "StoreConnectionError"
        }
        StoreError::QueueEmpty => "StoreQueueEmptyError",
        _ => "StoreError",
    }
}

/// A store error as a Python exception.
pub(crate) fn store(error: StoreError) -> PyErr {
    raise(store_class(&error), error.to_string())
}

/// A server that could not start.
pub(crate) fn server(error: ServerError) -> PyErr {
    raise("StoreServerError", error.to_string())
}

/// A failed rendezvous: the class says whether it was closed, timed out, lost its store
/// or found foreign state.
pub(crate) fn rendezvous(error: RendezvousError) -> PyErr {
    if let Some(message) = port_taken(&error) {
        return raise("RendezvousConnectionError", message);
    }
    let class = match &error {
        RendezvousError::Store { source, .. } | RendezvousError::FileStore { source, .. } => {
            match store_class(source) {
                "StoreTimeoutError" => "RendezvousTimeoutError",
                _ => "RendezvousConnectionError",
            }
        }
        RendezvousError::Handler(inner) => match inner.downcast_ref::<ElasticFailure>() {
            Some(failure) => elastic_class(failure),
            None => "RendezvousError",
        },
        _ => "RendezvousError",
    };
    raise(class, error.to_string())
}

/// The class of an elastic rendezvous failure: torch's `Rendezvous*Error` name the Rust
/// handle gives it ([`ElasticFailure::kind`]).
pub(crate) fn elastic_class(failure: &ElasticFailure) -> &'static str {
    match failure.kind() {
        ElasticErrorKind::Closed => "RendezvousClosedError",
        ElasticErrorKind::Timeout => "RendezvousTimeoutError",
        ElasticErrorKind::Connection => "RendezvousConnectionError",
        ElasticErrorKind::State => "RendezvousStateError",
        ElasticErrorKind::GracefulExit => "RendezvousGracefulExitError",
        _ => "RendezvousError",
    }
}

/// An elastic rendezvous failure as a Python exception.
pub(crate) fn elastic(failure: ElasticFailure) -> PyErr {
    raise(elastic_class(&failure), failure.to_string())
}

/// Rank 0 of a `tcp://` or `env://` rendezvous hosts the store, as torch's does, so a URL
/// that names a running server (an `rdzv.StoreServer`, `rdzv store serve`) fails to bind:
/// the message says why and what to use instead.
fn port_taken(error: &RendezvousError) -> Option<String> {
    let RendezvousError::Store {
        role: StoreRole::Server,
        host,
        port,
        source: StoreError::Io { source, .. },
        ..
    } = error
    else {
        return None;
    };
    (source.kind() == std::io::ErrorKind::AddrInUse).then(|| {
        format!(
            "rank 0 hosts the store at {host}:{port}; something already listens there: use a \
             port nobody serves, or `rdzv.Store` to join an existing server ({source})"
        )
    })
}
