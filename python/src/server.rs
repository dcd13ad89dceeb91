//! `rdzv.StoreServer`: the Rust store server (`rdzv_uring::StoreServer`) running in this
//! Python process, as a context manager.
//!
//! The server's loops are Rust threads: they serve while Python runs (or waits) and never
//! take the GIL. This module starts and stops them; it does not choose how they serve.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use rdzv_uring::server::{IoMode, ServerOptions, StoreServer};

use crate::errors;
use crate::store::py_repr;

/// A store server speaking PyTorch's TCPStore protocol, run by this process.
///
/// ``StoreServer(host="0.0.0.0", port=0, threads=None, io="auto", multi_tenant=False)``
/// listens at once; ``port=0`` picks a free port (read it from ``.port``). ``host=None``
/// listens on every address, IPv6 and IPv4. ``threads`` is the number of event loops
/// (default: one per usable CPU, at most 16, and one on hosts of two CPUs or fewer).
/// ``io`` is ``"auto"`` (io_uring where the kernel allows it, else epoll),
/// ``"io-uring"`` or ``"epoll"``. With ``multi_tenant``, a second server on the same
/// port in this process shares the first one (PyTorch's ``multi_tenant``).
///
/// Any TCPStore client talks to it: ``rdzv.Store``, ``torch.distributed.TCPStore``
/// (``is_master=False``), ``rdzv store`` on the command line. Use it as a context manager,
/// or call ``stop()``; it also stops when garbage-collected.
///
/// Raises ``rdzv.StoreServerError`` when it cannot listen (port taken, bad host).
#[pyclass(module = "rdzv._rdzv", name = "StoreServer", frozen)]
pub(crate) struct PyStoreServer {
    server: Mutex<Option<StoreServer>>,
    host: Option<String>,
    port: u16,
    io: String,
}

impl PyStoreServer {
    fn running(&self) -> Option<StoreServer> {
        self.server
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

#[pymethods]
impl PyStoreServer {
    #[new]
    #[pyo3(signature = (host = Some("0.0.0.0".to_string()), port = 0, threads = None, io = "auto", multi_tenant = false))]
    fn new(
        py: Python<'_>,
        host: Option<String>,
        port: u16,
        threads: Option<usize>,
        io: &str,
        multi_tenant: bool,
    ) -> PyResult<Self> {
        let io_mode: IoMode = io.parse().map_err(PyValueError::new_err)?;
        let options = ServerOptions {
            host: host.clone(),
            port,
            threads: threads.unwrap_or(0),
            multi_tenant,
            io: io_mode,
            ..ServerOptions::default()
        };
        let server = py
            .detach(|| StoreServer::start(options))
            .map_err(errors::server)?;
        Ok(PyStoreServer {
            port: server.port(),
            io: server.io_mode().to_string(),
            host,
            server: Mutex::new(Some(server)),
        })
    }

    /// The port the server listens on (the one picked when created with ``port=0``).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// The host it was asked to listen on (``None``: every address).
    #[getter]
    fn host(&self) -> Option<String> {
        self.host.clone()
    }

    /// The event loop it runs on: ``"io-uring"`` or ``"epoll"``.
    #[getter]
    fn io(&self) -> String {
        self.io.clone()
    }

    /// Whether it still serves (``stop()`` not called yet).
    #[getter(running)]
    fn is_running(&self) -> bool {
        self.running().is_some()
    }

    /// What the server holds now: ``{"connections": …, "waiters": …, "keys": …}``.
    ///
    /// Raises ``rdzv.StoreServerError`` once stopped.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let server = self
            .running()
            .ok_or_else(|| errors::raise("StoreServerError", self.stopped_text()))?;
        let stats = server.stats();
        let dict = PyDict::new(py);
        dict.set_item("connections", stats.connections)?;
        dict.set_item("waiters", stats.waiters)?;
        dict.set_item("keys", stats.keys)?;
        Ok(dict)
    }

    /// Stops accepting, lets every connection receive the replies it is owed (up to 5 s)
    /// and waits for the loops to exit. Clients see their connection closed. Calling it
    /// again does nothing.
    fn stop(&self, py: Python<'_>) {
        let server = self
            .server
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(server) = server {
            py.detach(move || server.shutdown());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.stop(py);
        false
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "StoreServer(host={}, port={}, io={}, running={})",
            py_repr(py, self.host.as_deref().unwrap_or("::"))?,
            self.port,
            py_repr(py, &self.io)?,
            if self.running().is_some() {
                "True"
            } else {
                "False"
            }
        ))
    }
}

impl PyStoreServer {
    fn stopped_text(&self) -> String {
        format!("the store server on port {} is stopped", self.port)
    }
}
