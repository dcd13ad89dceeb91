//! `rdzv._rdzv.RpcAgent`: rdzv's RPC agent (`rdzv_uring::rpc`) for `rdzv.rpc`, the Python
//! module with torch.distributed.rpc's API (`rdzv/rpc/`).
//!
//! Python pickles; this module moves bytes. A call is `(metadata, payload, buffers)`:
//! the pickle of `(func, args, kwargs)` and its out-of-band buffers, which become the
//! message's tensors ([`message`]). Every peer runs Python through one handler,
//! `PYTHON_CALL` ([`handler`]), on the agent's worker pool. Waits (start-up, `rpc_sync`,
//! shutdown) release the GIL; `rpc_async` results reach Python through one completing
//! thread ([`completer`]), so no agent thread ever waits for the GIL. Errors are the
//! classes of `rdzv/rpc/_errors.py` ([`errors`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use rdzv_core::device::Device;
use rdzv_core::device_map::{DeviceMap, DeviceMaps};
use rdzv_core::rpc::name::WorkerInfo;
use rdzv_uring::rpc::{init_rpc, RpcAgent, RpcOptions, RpcSecret};

mod completer;
mod errors;
mod handler;
mod message;
mod name;
mod received;
mod restricted;
mod rref;
mod sys;

use completer::Completer;
use handler::{PythonCall, PYTHON_CALL};
use rref::PyRRef;

/// How many times the agent's default wait spin a Python worker's lanes spin for a
/// reply or the next request (the spins turn themselves off on lanes whose waits run
/// longer: `rdzv_uring`'s `lane::spin`).
const PYTHON_SPIN_FACTOR: u32 = 4;

/// How long `shutdown` waits for the agent's threads to release their Python thread
/// states as they end.
const THREADS_END_WITHIN: Duration = Duration::from_secs(2);

/// A device name (`cpu`, `cuda:0`) from Python.
fn device(what: &str, name: &str) -> PyResult<Device> {
    name.parse()
        .map_err(|e| PyValueError::new_err(format!("{what}: {name:?} is not a device: {e}")))
}

/// A call timeout from Python: `None` or negative for the agent's default, zero for
/// none, else seconds.
fn call_timeout(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s < 0.0 => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s).map(Some).map_err(|_| {
            PyValueError::new_err(format!(
                "timeout must be a finite number of seconds, got {s}"
            ))
        }),
    }
}

/// A call's message and timeout from Python.
fn request(
    metadata: &Bound<'_, PyAny>,
    payload: &Bound<'_, PyAny>,
    buffers: &Bound<'_, PyAny>,
    timeout: Option<f64>,
) -> PyResult<(rdzv_uring::rpc::Message, Option<Duration>)> {
    Ok((
        message::from_python(metadata, payload, buffers)?,
        call_timeout(timeout)?,
    ))
}

/// A number of seconds from Python.
fn seconds(what: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, got {value}"
        ))
    })
}

/// `(name, id)` of a worker.
fn info(worker: &WorkerInfo) -> (String, i64) {
    (worker.name().to_string(), i64::from(worker.id().get()))
}

/// One worker's RPC agent. Made by [`start`](PyRpcAgent::start); `rdzv.rpc` keeps
/// the process's one.
#[pyclass(module = "rdzv._rdzv", name = "RpcAgent", frozen)]
pub(crate) struct PyRpcAgent {
    agent: RpcAgent,
    completer: Arc<Completer>,
    interpreter_alive: Arc<AtomicBool>,
    rpc_timeout: Duration,
}

impl Drop for PyRpcAgent {
    /// Dropped by Python without a shutdown: the agent closes without the GIL, which its
    /// threads may need to end (each releases the Python thread state it keeps as it
    /// exits), as `shutdown` closes it. After a shutdown this does nothing.
    fn drop(&mut self) {
        Python::attach(|py| {
            py.detach(|| {
                let _ = self.agent.shutdown(false);
                self.completer.stop();
                sys::wait_kept_thread_states_released(THREADS_END_WITHIN);
            });
        });
    }
}

#[pymethods]
impl PyRpcAgent {
    /// Joins the group through `init_method` and starts the agent (without the GIL until
    /// every worker of a static group has started). `serve(caller, (metadata, payload,
    /// buffers))` answers every Python call made to this worker with such a tuple.
    /// `device_maps` is `[(peer, [(local, remote), ...]), ...]` of device names.
    /// `released(None, (metadata, payload, buffers))` is called (on the completing
    /// thread) with every owner value of a `remote()` the agent lets go of. `secret`:
    /// `None` shares the group secret (`RpcSecret::Shared`), bytes give it, and
    /// `secret_disabled` runs without one.
    #[staticmethod]
    #[pyo3(signature = (name, rank, world_size, init_method, rpc_timeout, num_worker_threads,
        transports, channels, device_maps, devices, serve, released, secret = None,
        secret_disabled = false))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        name: String,
        rank: u32,
        world_size: Option<u32>,
        init_method: String,
        rpc_timeout: f64,
        num_worker_threads: usize,
        transports: Option<Vec<String>>,
        channels: Option<Vec<String>>,
        device_maps: Vec<(String, Vec<(String, String)>)>,
        devices: Vec<String>,
        serve: Py<PyAny>,
        released: Py<PyAny>,
        secret: Option<Vec<u8>>,
        secret_disabled: bool,
    ) -> PyResult<Self> {
        let rpc_timeout = Duration::try_from_secs_f64(rpc_timeout).map_err(|_| {
            PyValueError::new_err(format!(
                "rpc_timeout must be a finite number of seconds >= 0, got {rpc_timeout}"
            ))
        })?;
        let mut options = RpcOptions::new(init_method);
        options.rpc_timeout = rpc_timeout;
        options.num_worker_threads = num_worker_threads;
        // A Python call's reply takes 20–60 µs here, where the Rust default spin (50 µs,
        // none on one CPU) would stop spinning on every slow one.
        options.wait_spin *= PYTHON_SPIN_FACTOR;
        options.transports = transports;
        options.channels = channels;
        options.secret = match (secret, secret_disabled) {
            (_, true) => RpcSecret::Disabled,
            (Some(secret), false) => RpcSecret::Given(secret),
            (None, false) => RpcSecret::Shared,
        };
        let mut maps = DeviceMaps::new();
        for (peer, pairs) in device_maps {
            let mut map = DeviceMap::default();
            for (local, remote) in pairs {
                let what = format!("device_maps[{peer:?}]");
                map.insert(device(&what, &local)?, device(&what, &remote)?);
            }
            maps.insert(peer, map);
        }
        options.device_maps = maps;
        options.devices = devices
            .iter()
            .map(|d| device("devices", d))
            .collect::<PyResult<_>>()?;
        let interpreter_alive = Arc::new(AtomicBool::new(true));
        let handler = PythonCall {
            serve,
            interpreter_alive: Arc::clone(&interpreter_alive),
        };
        options = options.with_handler(PYTHON_CALL, handler);
        let completer = Arc::new(Completer::start(&name, released).map_err(|e| {
            errors::usage(format!(
                "cannot start the thread that completes futures: {e}"
            ))
        })?);
        let deliver = Arc::clone(&completer);
        options.on_value_released = Some(Arc::new(move |value| deliver.release(value)));
        let agent = py
            .detach(|| init_rpc(&name, rank, world_size, options))
            .map_err(|e| errors::init(&e))?;
        Ok(PyRpcAgent {
            agent,
            completer,
            interpreter_alive,
            rpc_timeout,
        })
    }

    /// How many inbound pipes this worker closed because the peer failed the handshake
    /// (a wrong or missing proof, a stranger, a malformed frame, or too slow).
    fn handshakes_refused(&self) -> u64 {
        self.agent.handshakes_refused()
    }

    /// The transport of the last client pipe opened to `peer` (`tcp`, `shm`, ...), or
    /// `None` before the first call to it.
    fn pipe_transport(&self, peer: &str) -> Option<&'static str> {
        self.agent.pipe_transport(peer).map(|k| k.name())
    }

    /// The channel that carries CPU tensors on the last client pipe to `peer` (`basic`,
    /// `cma`, `mpt`, ...), or `None` before the first call or when none does.
    fn pipe_channel(&self, peer: &str) -> Option<&'static str> {
        self.agent.pipe_channel(peer).map(|k| k.name())
    }

    /// The tensor bytes this worker sent, per channel name (requests and responses).
    fn tensor_bytes_by_channel(&self) -> Vec<(&'static str, u64)> {
        self.agent
            .tensor_bytes_by_channel()
            .into_iter()
            .map(|(k, n)| (k.name(), n))
            .collect()
    }

    /// Where peers reach this worker (`tcp://ip:port;...`, highest priority first).
    fn address(&self) -> String {
        self.agent.address().to_string()
    }

    /// This worker's `(name, id)`.
    fn me(&self) -> (String, i64) {
        info(self.agent.worker_info())
    }

    /// The group's size (`None` for a dynamic group).
    #[getter]
    fn world_size(&self) -> Option<u32> {
        self.agent.world_size()
    }

    /// The default call timeout, in seconds (0: none).
    #[getter]
    fn rpc_timeout(&self) -> f64 {
        self.rpc_timeout.as_secs_f64()
    }

    /// `(name, id)` of the member named `name`.
    fn worker_info(&self, name: &str) -> PyResult<(String, i64)> {
        self.agent
            .get_worker_info(name)
            .map(|w| info(&w))
            .map_err(|e| errors::usage(e.to_string()))
    }

    /// `(name, id)` of the member whose id is `id`.
    fn worker_info_by_id(&self, id: i64) -> PyResult<(String, i64)> {
        self.agent
            .get_worker_info_by_id(id)
            .map(|w| info(&w))
            .map_err(|e| errors::usage(e.to_string()))
    }

    /// Every member's `(name, id)`, in id order.
    fn worker_infos(&self) -> Vec<(String, i64)> {
        self.agent.worker_infos().iter().map(info).collect()
    }

    /// Calls `PYTHON_CALL` on `to` and waits (without the GIL): the reply's `(metadata,
    /// payload, buffers)`. `timeout`: seconds, 0 for none, `None` or negative for the
    /// default.
    #[pyo3(signature = (to, metadata, payload, buffers, timeout = None))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        to: &str,
        metadata: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        buffers: &Bound<'py, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let (request, timeout) = request(metadata, payload, buffers, timeout)?;
        let reply = py
            .detach(|| {
                self.agent
                    .rpc_sync_with_timeout(to, PYTHON_CALL, request, timeout)
            })
            .map_err(|e| errors::call(&e))?;
        message::to_python(py, reply)
    }

    /// Starts a call as [`call`](Self::call) does and returns at once; `on_done(error,
    /// reply)` runs on the completing thread when it ends.
    #[pyo3(signature = (to, metadata, payload, buffers, timeout, on_done))]
    fn call_async(
        &self,
        to: &str,
        metadata: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let (request, timeout) = request(metadata, payload, buffers, timeout)?;
        let future = self
            .agent
            .rpc_async_with_timeout(to, PYTHON_CALL, request, timeout);
        self.completer.watch(future, on_done)
    }

    /// `remote()`: runs the call on `to`, which keeps the result, and returns an RRef to
    /// it at once (failures come out of the value's fetch).
    #[pyo3(signature = (to, metadata, payload, buffers, timeout = None))]
    fn remote(
        &self,
        to: &str,
        metadata: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<PyRRef> {
        let (request, timeout) = request(metadata, payload, buffers, timeout)?;
        self.agent
            .remote_with_timeout(to, PYTHON_CALL, request, timeout)
            .map(|rref| PyRRef { rref })
            .map_err(|e| errors::call(&e))
    }

    /// The RRef that `fork` (from `RRef.fork_to` on another worker) stands for.
    fn rref_from_fork(&self, fork: &[u8]) -> PyResult<PyRRef> {
        self.agent
            .rref_from_fork(fork)
            .map(|rref| PyRRef { rref })
            .map_err(|e| errors::usage(e.to_string()))
    }

    /// This worker's RRef counts: `num_owner_rrefs`, `num_pending_futures`,
    /// `num_pending_users`, `num_forks` (as text, torch's `_rref_context_get_debug_info`).
    fn rref_debug_info(&self) -> Vec<(String, String)> {
        self.agent.rref_debug_info_map()
    }

    /// `(owners, forks)` on worker `rank` (over RPC unless it is this one).
    fn get_num_owners_and_forks(&self, py: Python<'_>, rank: i64) -> PyResult<(usize, usize)> {
        let id = worker_id(rank)?;
        py.detach(|| self.agent.get_num_owners_and_forks(id))
            .map_err(|e| errors::call(&e))
    }

    /// Waits until worker `rank` has `num_owners` owner RRefs and `num_forks` forks.
    fn wait_until_owners_and_forks_on_rank(
        &self,
        py: Python<'_>,
        num_owners: usize,
        num_forks: usize,
        rank: i64,
        timeout: f64,
    ) -> PyResult<()> {
        let id = worker_id(rank)?;
        let timeout = seconds("timeout", timeout)?;
        py.detach(|| {
            self.agent
                .wait_until_owners_and_forks_on_rank(num_owners, num_forks, id, timeout)
        })
        .map_err(|e| errors::call(&e))
    }

    /// Waits until no RRef message is unanswered, no user unconfirmed and no call in
    /// flight here.
    fn wait_until_pending_futures_and_users_flushed(
        &self,
        py: Python<'_>,
        timeout: f64,
    ) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        py.detach(|| {
            self.agent
                .wait_until_pending_futures_and_users_flushed(timeout)
        })
        .map_err(|e| errors::call(&e))
    }

    /// Probes worker `name` until a call to it fails for a reason other than its
    /// handler: that error's text, or `None` if it still answers after `timeout`.
    fn wait_until_node_failure(
        &self,
        py: Python<'_>,
        name: &str,
        timeout: f64,
    ) -> PyResult<Option<String>> {
        let timeout = seconds("timeout", timeout)?;
        Ok(py
            .detach(|| self.agent.wait_until_node_failure(name, timeout))
            .map(|e| e.to_string()))
    }

    /// `rpc.shutdown(graceful, timeout)`: graceful waits (without the GIL) until no
    /// worker of the group has a call in flight, at most `timeout` seconds (`None`: no
    /// limit); then the agent closes, and every result still queued reaches Python.
    #[pyo3(signature = (graceful = true, timeout = None))]
    fn shutdown(&self, py: Python<'_>, graceful: bool, timeout: Option<f64>) -> PyResult<()> {
        let timeout = match timeout {
            Some(t) if t > 0.0 => Some(Duration::try_from_secs_f64(t).map_err(|_| {
                PyValueError::new_err(format!(
                    "timeout must be a finite number of seconds, got {t}"
                ))
            })?),
            _ => None,
        };
        let result = py.detach(|| {
            let result = match timeout {
                Some(timeout) => self.agent.shutdown_with_timeout(graceful, timeout),
                None => self.agent.shutdown(graceful),
            };
            self.completer.stop();
            // The agent's threads end now; each releases its Python thread state first,
            // which must not overlap the interpreter's exit. (A handler still running
            // after a shutdown that was not graceful keeps its thread: not waited for.)
            sys::wait_kept_thread_states_released(THREADS_END_WITHIN);
            result
        });
        result.map_err(|e| errors::shutdown(&e))
    }

    /// Called at interpreter exit, agent or none: the agent's threads that end after
    /// this leave their Python thread states to the interpreter's finalisation.
    #[staticmethod]
    fn interpreter_exiting() {
        sys::interpreter_exiting();
    }

    /// Called at interpreter exit: handlers stop taking the GIL, and the agent closes.
    fn interpreter_exit(&self, py: Python<'_>) {
        self.interpreter_alive.store(false, Ordering::Release);
        sys::interpreter_exiting();
        py.detach(|| {
            let _ = self.agent.shutdown(false);
            self.completer.stop();
        });
    }
}

/// Adds the RPC classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRpcAgent>()?;
    m.add_class::<received::ReceivedBuffer>()?;
    m.add_class::<PyRRef>()?;
    m.add_function(wrap_pyfunction!(name::check_worker_name, m)?)?;
    restricted::register(m)
}

/// A worker id from Python.
fn worker_id(rank: i64) -> PyResult<rdzv_core::rpc::name::WorkerId> {
    rdzv_core::rpc::name::WorkerId::new(rank).map_err(|e| PyValueError::new_err(e.to_string()))
}
