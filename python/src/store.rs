//! `rdzv.Store`: a client of a TCPStore server (rdzv's or PyTorch's), with every
//! operation of c10d's `Store` under torch's Python names.
//!
//! Values go in as `bytes` or `str` (UTF-8, as torch's `set` takes) and come out as
//! `bytes`. Each call copies its arguments out of Python, releases the GIL, and runs the
//! blocking Rust client (`rdzv_uring::store`); what an operation means is decided by the
//! server, not here.

use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use rdzv_core::store::QueryType;
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::store::{Store, StoreError, DEFAULT_TIMEOUT};

use crate::{duration, errors};

/// A key-value store client, blocking, safe to share between threads.
///
/// ``Store(host, port, timeout=300.0)`` connects to the TCPStore server at
/// ``host:port`` (an ``rdzv.StoreServer``, ``rdzv store serve``, or PyTorch's own
/// ``TCPStore`` server), retrying until ``timeout`` (seconds or ``timedelta``), which is
/// also the default timeout of ``get`` and ``wait``. Keys are ``str``; values are
/// ``bytes`` or ``str``. Keys are stored as PyTorch's ``TCPStore`` stores them, so a
/// torch client of the same server sees the same keys.
///
/// Every blocking call releases the GIL. Errors: ``rdzv.StoreTimeoutError`` (also a
/// ``TimeoutError``), ``rdzv.StoreConnectionError`` (also a ``ConnectionError``),
/// ``rdzv.StoreQueueEmptyError``, and ``rdzv.StoreError`` for the rest.
#[pyclass(module = "rdzv._rdzv", name = "Store", frozen)]
pub(crate) struct PyStore {
    store: Arc<dyn Store>,
    /// The TCP client under `store`, for `ping`, `stats`, `host` and `port`.
    tcp: Option<Arc<TcpStore>>,
    /// What `repr` says between the parentheses, where `tcp` cannot say it.
    what: Option<String>,
}

impl PyStore {
    /// Wraps any store (a rendezvous may hand back a prefix or file store).
    pub(crate) fn wrap(store: Arc<dyn Store>, tcp: Option<Arc<TcpStore>>) -> Self {
        PyStore {
            store,
            tcp,
            what: None,
        }
    }

    /// Says what the store is in its `repr`, in Python's keyword form
    /// (`host='h', port=1, prefix='p'`).
    pub(crate) fn described(mut self, what: String) -> Self {
        self.what = Some(what);
        self
    }

    fn tcp(&self, what: &str) -> PyResult<&Arc<TcpStore>> {
        self.tcp.as_ref().ok_or_else(|| {
            errors::raise(
                "StoreError",
                format!(
                    "{what} needs a direct TCP store client; this store is a prefix or file store"
                ),
            )
        })
    }
}

/// `bytes` or `str` as bytes, copied so that the GIL can be released.
fn value_bytes(what: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(text.to_cow()?.as_bytes().to_vec());
    }
    if let Ok(bytes) = value.extract::<Vec<u8>>() {
        return Ok(bytes);
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be bytes or str, not {}",
        value
            .get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string())
    )))
}

fn keys_ref(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (host, port, timeout = None))]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let timeout = duration::optional("timeout", timeout, DEFAULT_TIMEOUT)?;
        let tcp = py
            .detach(|| TcpStore::connect(&host, port, timeout))
            .map_err(errors::store)?;
        let tcp = Arc::new(tcp);
        Ok(PyStore::wrap(Arc::clone(&tcp) as Arc<dyn Store>, Some(tcp)))
    }

    /// Sets ``key`` to ``value`` (``bytes`` or ``str``), waking anyone waiting for it.
    fn set(&self, py: Python<'_>, key: String, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = value_bytes("value", value)?;
        py.detach(|| self.store.set(&key, &value))
            .map_err(errors::store)
    }

    /// The value of ``key``, waiting up to the store's timeout for it to exist.
    fn get<'py>(&self, py: Python<'py>, key: String) -> PyResult<Bound<'py, PyBytes>> {
        let value = py
            .detach(|| self.store.get(&key))
            .map_err(|error| match error {
                // The client's get is a wait, then a read: its timeout names the wait and the
                // stored key (torch's text). Say what the caller did.
                StoreError::Timeout { ms, .. } | StoreError::GetTimeout { ms, .. } => {
                    errors::raise(
                        "StoreTimeoutError",
                        format!(
                    "get of key {key:?}: no such key after waiting {ms} ms (the store's timeout; \
                     set_timeout() or Store(timeout=...) changes it)"
                ),
                    )
                }
                other => errors::store(other),
            })?;
        Ok(PyBytes::new(py, &value))
    }

    /// Adds ``amount`` to the counter at ``key`` (a missing key counts as 0) and returns
    /// the new value. Counters are stored as decimal text, as torch stores them.
    fn add(&self, py: Python<'_>, key: String, amount: i64) -> PyResult<i64> {
        py.detach(|| self.store.add(&key, amount))
            .map_err(errors::store)
    }

    /// Sets ``key`` to ``desired`` if it holds ``expected`` (``b""``: if it is missing),
    /// and returns what the key holds afterwards (torch's ``compare_set``).
    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: String,
        expected: &Bound<'py, PyAny>,
        desired: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let expected = value_bytes("expected", expected)?;
        let desired = value_bytes("desired", desired)?;
        let now = py
            .detach(|| self.store.compare_set(&key, &expected, &desired))
            .map_err(errors::store)?;
        Ok(PyBytes::new(py, &now))
    }

    /// Waits until every key in ``keys`` exists, up to ``timeout`` (seconds or
    /// ``timedelta``; default: the store's timeout). Raises ``rdzv.StoreTimeoutError``.
    #[pyo3(signature = (keys, timeout = None))]
    fn wait(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let timeout = match timeout {
            Some(t) if !t.is_none() => Some(duration::from_py("timeout", t)?),
            _ => None,
        };
        py.detach(|| self.store.wait(&keys_ref(&keys), timeout))
            .map_err(errors::store)
    }

    /// Whether every key in ``keys`` exists, without waiting.
    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        py.detach(|| self.store.check(&keys_ref(&keys)))
            .map_err(errors::store)
    }

    /// Deletes ``key``; returns whether it existed.
    fn delete_key(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        py.detach(|| self.store.delete_key(&key))
            .map_err(errors::store)
    }

    /// How many keys the store holds (torch's count, which includes internal keys).
    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        py.detach(|| self.store.num_keys()).map_err(errors::store)
    }

    /// The values of ``keys``, in order, waiting for all of them.
    fn multi_get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let values = py
            .detach(|| self.store.multi_get(&keys_ref(&keys)))
            .map_err(errors::store)?;
        Ok(values.iter().map(|v| PyBytes::new(py, v)).collect())
    }

    /// Sets ``keys[i]`` to ``values[i]`` for every ``i``, in one request.
    fn multi_set(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let values: Vec<Vec<u8>> = values
            .try_iter()?
            .map(|v| v.and_then(|v| value_bytes("values[i]", &v)))
            .collect::<PyResult<_>>()?;
        if keys.len() != values.len() {
            return Err(PyValueError::new_err(format!(
                "multi_set: {} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        let pairs: Vec<(&str, &[u8])> = keys
            .iter()
            .map(String::as_str)
            .zip(values.iter().map(Vec::as_slice))
            .collect();
        py.detach(|| self.store.multi_set(&pairs))
            .map_err(errors::store)
    }

    /// Appends ``value`` to the value at ``key``, creating the key if missing.
    fn append(&self, py: Python<'_>, key: String, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = value_bytes("value", value)?;
        py.detach(|| self.store.append(&key, &value))
            .map_err(errors::store)
    }

    /// Pushes ``value`` onto the back of the queue ``key``.
    fn queue_push(&self, py: Python<'_>, key: String, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = value_bytes("value", value)?;
        py.detach(|| self.store.queue_push(&key, &value))
            .map_err(errors::store)
    }

    /// Pops the front of the queue ``key``. With ``block`` (the default) waits up to the
    /// store's timeout for an element; without, raises ``rdzv.StoreQueueEmptyError`` at
    /// once when the queue is empty.
    #[pyo3(signature = (key, block = true))]
    fn queue_pop<'py>(
        &self,
        py: Python<'py>,
        key: String,
        block: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let value = py
            .detach(|| self.store.queue_pop(&key, block))
            .map_err(errors::store)?;
        Ok(PyBytes::new(py, &value))
    }

    /// The length of the queue ``key`` (0 when it does not exist).
    fn queue_len(&self, py: Python<'_>, key: String) -> PyResult<i64> {
        py.detach(|| self.store.queue_len(&key))
            .map_err(errors::store)
    }

    /// Every user key in the store (torch's ``list_keys``).
    fn list_keys(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| self.store.list_keys()).map_err(errors::store)
    }

    /// Blocks until ``world_size`` callers have called ``barrier`` with ``key``, up to
    /// ``timeout`` (default: the store's timeout).
    #[pyo3(signature = (key, world_size, timeout = None))]
    fn barrier(
        &self,
        py: Python<'_>,
        key: String,
        world_size: i64,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let timeout = match timeout {
            Some(t) if !t.is_none() => Some(duration::from_py("timeout", t)?),
            _ => None,
        };
        py.detach(|| self.store.barrier(&key, world_size, timeout))
            .map_err(errors::store)
    }

    /// The default timeout of blocking calls, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.store.timeout().as_secs_f64()
    }

    /// Changes the default timeout of blocking calls (seconds or ``timedelta``).
    fn set_timeout(&self, timeout: &Bound<'_, PyAny>) -> PyResult<()> {
        self.store
            .set_timeout(duration::from_py("timeout", timeout)?);
        Ok(())
    }

    /// A new client of the same store, on a connection of its own.
    fn clone(&self, py: Python<'_>) -> PyResult<PyStore> {
        if let Some(tcp) = &self.tcp {
            let (host, port, timeout) = (tcp.host().to_string(), tcp.port(), tcp.timeout());
            let fresh = py
                .detach(|| TcpStore::connect(&host, port, timeout))
                .map_err(errors::store)?;
            let fresh = Arc::new(fresh);
            return Ok(PyStore::wrap(
                Arc::clone(&fresh) as Arc<dyn Store>,
                Some(fresh),
            ));
        }
        let store = py
            .detach(|| self.store.clone_store())
            .map_err(errors::store)?;
        Ok(PyStore {
            store: Arc::from(store),
            tcp: None,
            what: self.what.clone(),
        })
    }

    /// One round trip to the server (a ``PING``).
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        let tcp = self.tcp("ping")?;
        py.detach(|| tcp.ping()).map_err(errors::store)
    }

    /// The server's counters (rdzv's ``STATS`` query; PyTorch's server does not answer
    /// it): ``connections``, ``keys``, ``waiters``, ``queues``, ``bytes_in``,
    /// ``bytes_out``, ``uptime_ms``, and ``requests``, a dict from query name (``"SET"``,
    /// ``"ADD"``, …) to the number served.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let tcp = self.tcp("stats")?;
        let stats = py.detach(|| tcp.stats()).map_err(errors::store)?;
        let dict = PyDict::new(py);
        dict.set_item("connections", stats.connections)?;
        dict.set_item("keys", stats.keys)?;
        dict.set_item("waiters", stats.waiters)?;
        dict.set_item("queues", stats.queues)?;
        dict.set_item("bytes_in", stats.bytes_in)?;
        dict.set_item("bytes_out", stats.bytes_out)?;
        dict.set_item("uptime_ms", stats.uptime_ms)?;
        let requests = PyDict::new(py);
        for query in QueryType::ALL {
            requests.set_item(query.name(), stats.requests_of(query))?;
        }
        dict.set_item("requests", requests)?;
        Ok(dict)
    }

    /// The server's host, for a direct TCP client (else ``None``).
    #[getter]
    fn host(&self) -> Option<String> {
        self.tcp.as_ref().map(|t| t.host().to_string())
    }

    /// The server's port, for a direct TCP client (else ``None``).
    #[getter]
    fn port(&self) -> Option<u16> {
        self.tcp.as_ref().map(|t| t.port())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        match (&self.what, &self.tcp) {
            (Some(what), _) => Ok(format!("Store({what})")),
            (None, Some(tcp)) => Ok(format!(
                "Store(host={}, port={})",
                py_repr(py, tcp.host())?,
                tcp.port()
            )),
            (None, None) => Ok("Store()".to_string()),
        }
    }
}

/// `text` as Python's `repr` writes a `str` (`'A:1'`), not Rust's `Debug` (`"A:1"`).
pub(crate) fn py_repr(py: Python<'_>, text: &str) -> PyResult<String> {
    Ok(PyString::new(py, text).repr()?.to_cow()?.into_owned())
}
