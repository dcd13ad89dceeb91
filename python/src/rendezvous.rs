//! `rdzv.rendezvous(url)` and `rdzv.ElasticRendezvous`, the elastic rendezvous of one
//! node.
//!
//! `rendezvous` runs `rdzv_uring::rendezvous::rendezvous_with` with this process's
//! environment (`tcp://`, `env://`, `file://`, `elastic://`, `etcd://`).
//! `ElasticRendezvous` holds the Rust handle (`rdzv_uring::rendezvous::elastic::ElasticRendezvous`), whose driver
//! thread joins rounds, heartbeats and watches a peer without the GIL. The torchrun
//! handler (`rdzv/torchrun.py`) is built on it. Which node gets which rank, and when a
//! round closes, is the core's decision; this module only passes calls through.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use rdzv_core::rendezvous::elastic::{ElasticSettings, EtcdRendezvousUrl, NodeRange, RoundOutcome};
use rdzv_core::rendezvous::NodeParams;
use rdzv_core::rendezvous::StorePlan;
use rdzv_uring::rendezvous::elastic::{
    default_node_id, Contact, ElasticFailure, ElasticRendezvous,
};
use rdzv_uring::rendezvous::etcd::machine_store;
use rdzv_uring::rendezvous::{rendezvous_with, ProcessEnv, Rendezvous, RendezvousOptions};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::store::{Store, StoreError};

use crate::store::{py_repr, PyStore};
use crate::{duration, errors};

/// How long `next_round` waits without the GIL before it lets Python handle signals.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// ``rendezvous(url, rank=None, world_size=None, timeout=None)`` →
/// ``(store, rank, world_size, elastic)``: torch's ``rendezvous(url)`` (the Python
/// wrapper ``rdzv.rendezvous`` returns it as a ``Rendezvous`` object).
///
/// ``tcp://host:port?rank=R&world_size=N``, ``env://`` (``MASTER_ADDR``,
/// ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), ``file:///path?…``,
/// ``elastic://host:port/run_id?nodes=MIN:MAX&…`` and
/// ``etcd://HOST:PORT[,HOST:PORT…]/run_id?nodes=MIN:MAX&…``. ``timeout`` (default 30
/// minutes) bounds connecting and waiting for the peers. ``world_size`` is ``None`` when
/// not fixed; ``elastic`` is the node's ``ElasticRendezvous`` handle for ``elastic://``
/// and ``etcd://``, else ``None``. Blocks (without the GIL) until every rank has joined.
#[pyfunction]
#[pyo3(signature = (url, rank = None, world_size = None, timeout = None))]
pub(crate) fn rendezvous<'py>(
    py: Python<'py>,
    url: String,
    rank: Option<u32>,
    world_size: Option<u32>,
    timeout: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut options = RendezvousOptions::default();
    options.timeout = duration::optional("timeout", timeout, options.timeout)?;
    let env = ProcessEnv::snapshot();
    let outcome = py
        .detach(|| rendezvous_with(&url, NodeParams::Given { rank, world_size }, &env, &options))
        .map_err(errors::rendezvous)?;
    let what = describe(py, &outcome)?;
    let store = Py::new(
        py,
        PyStore::wrap(Arc::clone(&outcome.store), None).described(what),
    )?;
    let elastic = match outcome.elastic {
        Some(handle) => Some(Py::new(
            py,
            PyElasticRendezvous::from_handle(
                handle,
                RdzvStore::Ready {
                    store: Arc::clone(&outcome.store),
                    tcp: None,
                },
            ),
        )?),
        None => None,
    };
    (store, outcome.rank, outcome.world_size, elastic).into_pyobject(py)
}

/// What the store of a rendezvous is, for its `repr`: the TCPStore's host and port (and
/// prefix), the store file, or the elastic round's prefix.
fn describe(py: Python<'_>, outcome: &Rendezvous) -> PyResult<String> {
    let store = outcome.plan.as_ref().map(|plan| &plan.store);
    Ok(match (store, &outcome.elastic) {
        (Some(StorePlan::Tcp(tcp)), _) => {
            let mut what = format!("host={}, port={}", py_repr(py, &tcp.host)?, tcp.port);
            if let Some(prefix) = &tcp.prefix {
                what.push_str(&format!(", prefix={}", py_repr(py, prefix)?));
            }
            what
        }
        (Some(StorePlan::File(file)), _) => format!("file={}", py_repr(py, &file.path)?),
        (_, Some(elastic)) => match elastic.current() {
            Some(round) => format!("prefix={}", py_repr(py, &round.store_prefix)?),
            None => format!("run_id={}", py_repr(py, elastic.run_id())?),
        },
        _ => String::new(),
    })
}

/// One complete round of an elastic rendezvous, as this node sees it.
#[pyclass(module = "rdzv._rdzv", name = "Round", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct PyRound {
    /// The round number (0 first).
    #[pyo3(get)]
    round: u64,
    /// This node's rank in it, ``0 .. world_size``.
    #[pyo3(get)]
    rank: u32,
    /// How many nodes are members.
    #[pyo3(get)]
    world_size: u32,
    /// torch's store prefix of the round: ``torch.rendezvous.{run_id}.{round}``.
    #[pyo3(get)]
    store_prefix: String,
    /// Rank 0's contact (its ``set_contact`` text, e.g. ``"addr:port"`` for torch's
    /// ``MASTER_ADDR``/``MASTER_PORT``), or ``None`` when rank 0 gave none.
    #[pyo3(get)]
    master: Option<String>,
}

impl From<RoundOutcome> for PyRound {
    fn from(outcome: RoundOutcome) -> Self {
        PyRound {
            round: outcome.round,
            rank: outcome.rank,
            world_size: outcome.world_size,
            store_prefix: outcome.store_prefix,
            master: outcome.master,
        }
    }
}

#[pymethods]
impl PyRound {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let master = match &self.master {
            Some(master) => py_repr(py, master)?,
            None => "None".to_string(),
        };
        Ok(format!(
            "Round(round={}, rank={}, world_size={}, store_prefix={}, master={master})",
            self.round,
            self.rank,
            self.world_size,
            py_repr(py, &self.store_prefix)?
        ))
    }
}

/// One node of an elastic rendezvous (torchelastic's dynamic rendezvous semantics, at
/// O(1) store work per node).
///
/// ``ElasticRendezvous(host, port, run_id, min_nodes=1, max_nodes=None, node_id=None,
/// join_timeout=600, last_call_timeout=30, keep_alive_interval=5,
/// keep_alive_max_attempt=3, close_timeout=30, timeout=60, contact=None,
/// contact_host=None)`` connects to
/// the store at ``host:port`` (``timeout`` bounds connecting) and joins at once; a thread
/// of its own then joins rounds, heartbeats and watches a peer, on that one connection
/// (``store()``, ``is_closed()`` and a ``num_nodes_waiting()`` after a round ended open a
/// second one on first use). ``contact`` is what this node tells the others when it is
/// rank 0 (``set_contact``; every member gets it as ``Round.master``); ``contact_host``
/// offers ``contact_host:PORT`` instead, with a port free at each arrival, so that every
/// round's rank 0 offers a fresh ``MASTER_PORT`` (c10d picks one per round; a node
/// rejoins on its own as soon as its round ends, so a ``set_contact`` then may come a
/// round late). Durations are seconds or
/// ``timedelta``; the names are torchrun's ``--rdzv-conf`` keys.
///
/// Rounds contain only live nodes, and a node that survives a re-rendezvous keeps its rank
/// where it can. A node whose round ends (a member died, left, or its workers failed; a
/// node waits to join) rejoins the next round on its own. torchelastic's handler API:
/// ``next_rendezvous()``, ``num_nodes_waiting()``, ``is_closed()``, ``set_closed()``,
/// ``shutdown()``; lower level: ``next_round(after=r)``, ``current()``,
/// ``worker_failed()``, ``leave()``.
///
/// Errors: ``rdzv.RendezvousClosedError``, ``rdzv.RendezvousTimeoutError``,
/// ``rdzv.RendezvousConnectionError``, ``rdzv.RendezvousStateError``,
/// ``rdzv.RendezvousGracefulExitError`` (the run closed while this node waited outside
/// every round).
#[pyclass(module = "rdzv._rdzv", name = "ElasticRendezvous", frozen)]
pub(crate) struct PyElasticRendezvous {
    handle: Arc<ElasticRendezvous>,
    /// The store behind ``store()``.
    store: RdzvStore,
    /// `leave()` or `shutdown()` was called.
    left: AtomicBool,
}

/// The store client ``ElasticRendezvous.store()`` hands out.
enum RdzvStore {
    /// The rendezvous's own (``rdzv.rendezvous(url)``).
    Ready {
        store: Arc<dyn Store>,
        tcp: Option<Arc<TcpStore>>,
    },
    /// A second connection, opened on first use and shared with the handle: the driver
    /// thread's connection is the only one a join costs.
    Lazy(Arc<LazyTcp>),
}

/// A TCP client connected on first use.
struct LazyTcp {
    host: String,
    port: u16,
    timeout: Duration,
    opened: Mutex<Option<Arc<TcpStore>>>,
}

impl LazyTcp {
    fn get(&self) -> Result<Arc<TcpStore>, StoreError> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tcp) = &*opened {
            return Ok(Arc::clone(tcp));
        }
        let tcp = Arc::new(TcpStore::connect(&self.host, self.port, self.timeout)?);
        *opened = Some(Arc::clone(&tcp));
        Ok(tcp)
    }
}

impl PyElasticRendezvous {
    fn from_handle(handle: Arc<ElasticRendezvous>, store: RdzvStore) -> Self {
        PyElasticRendezvous {
            handle,
            store,
            left: AtomicBool::new(false),
        }
    }
}

#[pymethods]
impl PyElasticRendezvous {
    #[new]
    #[pyo3(signature = (
        host, port, run_id, min_nodes = 1, max_nodes = None, node_id = None,
        join_timeout = None, last_call_timeout = None, keep_alive_interval = None,
        keep_alive_max_attempt = None, close_timeout = None, timeout = None, contact = None,
        contact_host = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        run_id: String,
        min_nodes: u32,
        max_nodes: Option<u32>,
        node_id: Option<String>,
        join_timeout: Option<&Bound<'_, PyAny>>,
        last_call_timeout: Option<&Bound<'_, PyAny>>,
        keep_alive_interval: Option<&Bound<'_, PyAny>>,
        keep_alive_max_attempt: Option<u32>,
        close_timeout: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
        contact: Option<String>,
        contact_host: Option<String>,
    ) -> PyResult<Self> {
        let contact = contact_of(contact, contact_host)?;
        let nodes = NodeRange::new(min_nodes, max_nodes.unwrap_or(min_nodes))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let mut settings = ElasticSettings::new(run_id.clone(), nodes);
        settings.join_timeout =
            duration::optional("join_timeout", join_timeout, settings.join_timeout)?;
        settings.last_call =
            duration::optional("last_call_timeout", last_call_timeout, settings.last_call)?;
        settings.keep_alive_interval = duration::optional(
            "keep_alive_interval",
            keep_alive_interval,
            settings.keep_alive_interval,
        )?;
        settings.close_timeout =
            duration::optional("close_timeout", close_timeout, settings.close_timeout)?;
        if let Some(attempts) = keep_alive_max_attempt {
            settings.keep_alive_max_attempts = attempts;
        }
        settings
            .check()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let connect_timeout = duration::optional("timeout", timeout, Duration::from_secs(60))?;
        let node = node_id.unwrap_or_else(default_node_id);
        let lazy = Arc::new(LazyTcp {
            host: host.clone(),
            port,
            timeout: connect_timeout,
            opened: Mutex::new(None),
        });
        let handle = py.detach(|| {
            // One connection for the driver (no PING: its first request follows at once);
            // the handle's own opens on first use.
            let tcp = TcpStore::connect_without_ping(&host, port, connect_timeout).map_err(|e| {
                errors::raise(
                    "RendezvousConnectionError",
                    format!(
                        "elastic rendezvous '{run_id}': node '{node}' cannot connect to the store at {host}:{port}: {e}"
                    ),
                )
            })?;
            let shared = Arc::clone(&lazy);
            let connect = Box::new(move || shared.get().map(|tcp| tcp as Arc<dyn Store>));
            // The contact goes in before the driver starts, so that the first roster line
            // carries it (a `set_contact` after the start races the first arrival).
            ElasticRendezvous::start_lazy_with_contact(
                Box::new(tcp),
                connect,
                settings,
                node.clone(),
                contact,
            )
            .map_err(errors::elastic)
        })?;
        Ok(PyElasticRendezvous::from_handle(
            Arc::new(handle),
            RdzvStore::Lazy(lazy),
        ))
    }

    /// ``ElasticRendezvous.etcd(url, node_id=None, contact=None, contact_host=None)``: one node of the
    /// elastic rendezvous kept in an etcd cluster,
    /// ``etcd://HOST:PORT[,HOST:PORT…]/RUN_ID?nodes=MIN:MAX&…`` (the query keys of
    /// ``elastic://``, plus ``etcd_prefix``). It joins at once and returns without waiting
    /// for a round, like the constructor; ``node_id`` (else the URL's ``node_id``, else
    /// ``{host}_{pid}_0``), ``contact`` and ``contact_host`` as there. The rounds' stores
    /// (``round_store``) and ``store()`` are etcd keys under the URL's prefix.
    ///
    /// Raises ``ValueError`` for a URL it cannot parse; etcd being unreachable shows in
    /// ``next_rendezvous`` (``RendezvousConnectionError``, naming etcd and the endpoints).
    #[staticmethod]
    #[pyo3(signature = (url, node_id = None, contact = None, contact_host = None))]
    fn etcd(
        py: Python<'_>,
        url: &str,
        node_id: Option<String>,
        contact: Option<String>,
        contact_host: Option<String>,
    ) -> PyResult<Self> {
        let contact = contact_of(contact, contact_host)?;
        let parsed =
            EtcdRendezvousUrl::parse(url).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let node = node_id
            .or_else(|| parsed.elastic.node_id.clone())
            .unwrap_or_else(default_node_id);
        let store: Arc<dyn Store> = Arc::new(machine_store(&parsed));
        let settings = parsed.elastic.settings.clone();
        let handle = py.detach(|| {
            ElasticRendezvous::start_with_contact(Arc::clone(&store), settings, node, contact)
                .map_err(errors::elastic)
        })?;
        Ok(PyElasticRendezvous::from_handle(
            Arc::new(handle),
            RdzvStore::Ready { store, tcp: None },
        ))
    }

    /// This node's id (torch's node descriptor text, ``{host}_{pid}_{n}``, unless given).
    #[getter]
    fn node(&self) -> String {
        self.handle.node().to_string()
    }

    /// The run id.
    #[getter]
    fn run_id(&self) -> String {
        self.handle.run_id().to_string()
    }

    /// torchelastic's ``next_rendezvous``: the first call waits for this node's first
    /// round; a later call made while the round it returned last is still going (the
    /// agent restarts its workers) ends that round for everyone and waits for the next;
    /// a call after that round ended waits for the one that follows. Waits up to the join
    /// timeout, without the GIL.
    fn next_rendezvous(&self, py: Python<'_>) -> PyResult<PyRound> {
        let handle = Arc::clone(&self.handle);
        py.detach(move || handle.next_rendezvous())
            .map(PyRound::from)
            .map_err(errors::elastic)
    }

    /// torchelastic's ``num_nodes_waiting``: how many nodes wait to join a round after the
    /// one ``next_rendezvous`` returned last (at least 1 once that round is over); more
    /// than 0 tells the agent to restart its workers and call ``next_rendezvous``.
    fn num_nodes_waiting(&self, py: Python<'_>) -> PyResult<u32> {
        let handle = Arc::clone(&self.handle);
        py.detach(move || handle.num_nodes_waiting())
            .map_err(errors::elastic)
    }

    /// What this node tells the others when it is rank 0 (e.g. ``"addr:port"``): it goes
    /// with this node's next arrival, and rank 0's comes with every member's
    /// ``Round.master``, at no extra store request. Whitespace, ``,`` and ``;`` become
    /// ``?``.
    fn set_contact(&self, contact: &str) {
        self.handle.set_contact(contact);
    }

    /// Where the open round this node waits in stands, as one line ("round 2: 1 of min 2
    /// nodes; waiting for 1 more", "round 2: 3 nodes (min 2, max 4); last call ends in
    /// 12 s"), or ``None`` while it waits in no open round. Makes no store request.
    fn progress(&self) -> Option<String> {
        self.handle
            .open_round()
            .map(|open| open.line(std::time::Instant::now()))
    }

    /// Whether the run has been closed for good (by any node).
    fn is_closed(&self, py: Python<'_>) -> PyResult<bool> {
        let handle = Arc::clone(&self.handle);
        py.detach(move || handle.is_closed())
            .map_err(errors::elastic)
    }

    /// Closes the run for good, for every node (torch's ``set_closed``): every node's
    /// next ``next_rendezvous`` raises ``RendezvousClosedError``. Takes at most the
    /// close timeout.
    fn set_closed(&self, py: Python<'_>) -> PyResult<()> {
        let handle = Arc::clone(&self.handle);
        let result = py.detach(move || handle.set_closed());
        self.left.store(true, Ordering::Relaxed);
        result.map_err(errors::elastic)
    }

    /// torch's ``shutdown``: closes the run (``set_closed``) and stops this node's
    /// heartbeats. Returns whether closing succeeded within the close timeout.
    fn shutdown(&self, py: Python<'_>) -> bool {
        let handle = Arc::clone(&self.handle);
        self.left.store(true, Ordering::Relaxed);
        py.detach(move || handle.shutdown())
    }

    /// Waits for this node to be a member of a complete round later than ``after`` (any
    /// round for ``None``), up to ``timeout`` (default: the join timeout plus 5 s), and
    /// returns it. The GIL is released while it waits, and signals (Ctrl-C) are handled.
    #[pyo3(signature = (after = None, timeout = None))]
    fn next_round(
        &self,
        py: Python<'_>,
        after: Option<u64>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRound> {
        let timeout = duration::optional(
            "timeout",
            timeout,
            self.handle.settings().join_timeout + Duration::from_secs(5),
        )?;
        // Wait in slices, so that Ctrl-C and other signal handlers run (they run only
        // when this thread is back in Python).
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(SIGNAL_CHECK_INTERVAL);
            let handle = Arc::clone(&self.handle);
            match py.detach(move || handle.next_round(after, slice)) {
                Ok(round) => return Ok(PyRound::from(round)),
                Err(ElasticFailure::NotYet { .. }) if slice < left => {}
                Err(ElasticFailure::NotYet { node, .. }) => {
                    return Err(errors::raise(
                        "RendezvousTimeoutError",
                        format!(
                            "node '{node}': no new complete round of rendezvous '{}' within {:.1}s",
                            self.handle.run_id(),
                            timeout.as_secs_f64()
                        ),
                    ))
                }
                Err(failure) => return Err(errors::elastic(failure)),
            }
            py.check_signals()?;
        }
    }

    /// The round this node is a member of now, or ``None`` (between rounds).
    fn current(&self) -> Option<PyRound> {
        self.handle.current().map(PyRound::from)
    }

    /// ``(round, hot_spare)`` when this node arrived after ``round`` closed and waits for
    /// the next one (as a hot spare when the round was full), else ``None``.
    fn waiting(&self) -> Option<(u64, bool)> {
        self.handle.waiting()
    }

    /// A store client of ``round``'s keys: ``PrefixStore(round.store_prefix, store)``.
    fn round_store(&self, py: Python<'_>, round: &PyRound) -> PyResult<PyStore> {
        let outcome = RoundOutcome {
            round: round.round,
            rank: round.rank,
            world_size: round.world_size,
            store_prefix: round.store_prefix.clone(),
            master: round.master.clone(),
        };
        let handle = Arc::clone(&self.handle);
        let store = py
            .detach(move || handle.round_store(&outcome))
            .map_err(errors::elastic)?;
        Ok(PyStore::wrap(store, None))
    }

    /// A client of the rendezvous's store (the keys without a round prefix). The first
    /// call opens a connection of its own (the driver's is busy waiting).
    fn store(&self, py: Python<'_>) -> PyResult<PyStore> {
        match &self.store {
            RdzvStore::Ready { store, tcp } => Ok(PyStore::wrap(Arc::clone(store), tcp.clone())),
            RdzvStore::Lazy(lazy) => {
                let lazy = Arc::clone(lazy);
                let tcp = py.detach(move || lazy.get()).map_err(errors::store)?;
                Ok(PyStore::wrap(Arc::clone(&tcp) as Arc<dyn Store>, Some(tcp)))
            }
        }
    }

    /// This node's workers failed: the round ends for every member, and this node
    /// rejoins the next one (torchelastic's restart).
    fn worker_failed(&self) {
        self.handle.worker_failed();
    }

    /// Leaves the rendezvous (ending the round this node is a member of), waiting up to
    /// ``timeout`` seconds (default 30). Returns whether the driver finished in time.
    #[pyo3(signature = (timeout = None))]
    fn leave(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let timeout = duration::optional("timeout", timeout, Duration::from_secs(30))?;
        self.left.store(true, Ordering::Relaxed);
        let handle = Arc::clone(&self.handle);
        Ok(py.detach(move || handle.leave(timeout)))
    }

    /// Whether ``leave()``, ``set_closed()`` or ``shutdown()`` was called.
    #[getter]
    fn has_left(&self) -> bool {
        self.left.load(Ordering::Relaxed)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.leave(py, None)?;
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "ElasticRendezvous(node={}, run_id={}, left={})",
            py_repr(py, self.handle.node())?,
            py_repr(py, self.handle.run_id())?,
            if self.has_left() { "True" } else { "False" }
        ))
    }
}

/// The constructors' ``contact`` (fixed text) or ``contact_host`` (a free port at each
/// arrival); not both.
fn contact_of(contact: Option<String>, contact_host: Option<String>) -> PyResult<Option<Contact>> {
    match (contact, contact_host) {
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "give contact (the same text every round) or contact_host (HOST:a free port at each arrival), not both",
        )),
        (Some(text), None) => Ok(Some(Contact::Fixed(text))),
        (None, Some(host)) if host.is_empty() => Err(PyValueError::new_err(
            "contact_host is empty: give the address the other nodes reach this one by",
        )),
        (None, Some(host)) => Ok(Some(Contact::FreePort { host })),
        (None, None) => Ok(None),
    }
}
