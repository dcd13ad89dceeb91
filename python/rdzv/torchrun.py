"""``torchrun --rdzv-backend=rdzv``: rdzv's elastic rendezvous as a torchrun backend.

torchrun loads out-of-tree backends from the ``torchrun.handlers`` entry point group
(``torch/distributed/elastic/rendezvous/registry.py``): it calls the entry point with no
arguments (:func:`torchrun_handler`) and registers what that returns, a creator
``create(params) -> RendezvousHandler``, under the name ``rdzv``.

With ``--rdzv-endpoint=etcd://H1:P1,H2:P2,…`` the rendezvous is kept in that etcd
cluster instead, and rank 0's agent hosts the workers' store (:mod:`rdzv._etcd`; the
rest of this paragraph is about the store-server endpoint).

The handler runs the node on :class:`rdzv.ElasticRendezvous` (rdzv's store protocol,
O(1) store work per node) against an rdzv store server at ``--rdzv-endpoint``. The
agent hosts that server in-process when ``--rdzv-conf is_host=true``, or, without
``is_host``, when the endpoint names this host (as the c10d backend hosts its
TCPStore). The store it hands back is torch's own ``TCPStore`` client of that server, in
a ``PrefixStore`` per round, and errors are torch's own ``Rendezvous*Error`` classes.
``MASTER_ADDR`` and ``MASTER_PORT`` (``bootstrap_store_info``) come with the round: each
node joins with its address and a free port, and rank 0's reaches every member with the
world, where torch's ``RendezvousStoreInfo.build`` costs every rank two more requests.

``--rdzv-conf`` keys, named as torchrun names them: ``join_timeout`` (600 s),
``last_call_timeout`` (30 s), ``close_timeout`` (30 s), ``keep_alive_interval`` (5 s),
``keep_alive_max_attempt`` (3), ``read_timeout`` (60 s), ``is_host``, ``node_id``,
``server_threads``, and ``etcd_prefix`` (etcd endpoints only; default ``rdzv``).

torch is imported here only, and only when torchrun creates a handler.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable, List, Optional, Set, Tuple, TypedDict

from . import _errors, _etcd
from ._progress import wait_with_progress
from ._rdzv import ElasticRendezvous, Store, StoreServer

__all__ = ["torchrun_handler", "create_handler", "DEFAULT_PORT", "BACKEND"]

log = logging.getLogger(__name__)

#: torchelastic's default rendezvous port (the c10d backend's).
DEFAULT_PORT = 29400
#: The backend name torchrun is given (``--rdzv-backend=rdzv``).
BACKEND = "rdzv"

_KNOWN_CONF = {
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "is_host",
    "node_id",
    "server_threads",
    "etcd_prefix",
    # Set by torchrun itself, or meaningful only to other backends: accepted, unused.
    "timeout",
    "rank",
    "store_type",
    "use_libuv",
    "local_addr",
}


def torchrun_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: returns the creator torchrun registers."""
    return create_handler


def create_handler(params: Any) -> Any:
    """``create(params: RendezvousParameters) -> RendezvousHandler`` for torchrun."""
    handler = _handler_class()
    if _etcd.is_etcd_endpoint(params.endpoint):
        assert _ETCD_CLASS is not None
        return _ETCD_CLASS(Settings(params))
    return handler(params)


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> Tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too) as ``(host, port)``; an empty endpoint is
    ``localhost``. Raises ``ValueError`` naming the endpoint when the port is not one."""
    text = endpoint.strip()
    if not text:
        return "localhost", default_port
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"The rendezvous endpoint '{endpoint}' has an unclosed '['.")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(
            f"The port number of the rendezvous endpoint '{endpoint}' must be an integer "
            "between 0 and 65536."
        )
    return host, port


def is_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (torch's ``_matches_machine_hostname``)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::"):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(str(addr).startswith("127.") or addr == "::1" for addr in wanted):
        return True
    mine: Set[Any] = set()
    for name in names:
        try:
            mine.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return bool(wanted & mine)


def _seconds(params: Any, key: str, default: float) -> float:
    value = params.get(key, None)
    if value is None or value == "":
        return default
    if isinstance(value, timedelta):
        return value.total_seconds()
    try:
        seconds = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"The rendezvous configuration option '{key}' must be a number of seconds, "
            f"got {value!r}."
        ) from e
    if seconds <= 0:
        raise ValueError(f"The rendezvous configuration option '{key}' must be positive.")
    return seconds


class Timing(TypedDict):
    """The elastic rendezvous's timeouts, as keywords of both ``ElasticRendezvous`` and
    ``_etcd.rendezvous_url``."""

    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    keep_alive_interval: float
    keep_alive_max_attempt: int


class Settings:
    """What one handler reads from torchrun's ``RendezvousParameters``."""

    def __init__(self, params: Any) -> None:
        unknown = sorted(set(getattr(params, "config", {})) - _KNOWN_CONF)
        if unknown:
            raise ValueError(
                f"The rendezvous configuration options {unknown} are not known to the rdzv "
                f"backend; it reads {sorted(_KNOWN_CONF - {'timeout', 'rank', 'store_type', 'use_libuv', 'local_addr'})}."
            )
        self.run_id: str = params.run_id
        self.min_nodes: int = params.min_nodes
        self.max_nodes: int = params.max_nodes
        # etcd://H1:P1,H2:P2,...: the rendezvous in etcd, the store on rank 0's agent
        # (rdzv._etcd); else host:port of an rdzv store server.
        self.etcd_endpoints: Optional[List[str]] = None
        if _etcd.is_etcd_endpoint(params.endpoint):
            self.etcd_endpoints = _etcd.parse_etcd_endpoint(params.endpoint)
            self.host, self.port = "", 0
        else:
            self.host, self.port = parse_endpoint(params.endpoint)
        self.etcd_prefix: Optional[str] = params.get("etcd_prefix", None)
        self.join_timeout = _seconds(params, "join_timeout", 600.0)
        self.last_call_timeout = _seconds(params, "last_call_timeout", 30.0)
        self.close_timeout = _seconds(params, "close_timeout", 30.0)
        self.keep_alive_interval = _seconds(params, "keep_alive_interval", 5.0)
        self.keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
        self.read_timeout = _seconds(params, "read_timeout", 60.0)
        self.is_host: Optional[bool] = params.get_as_bool("is_host", None)
        self.node_id: Optional[str] = params.get("node_id", None)
        self.server_threads: Optional[int] = params.get_as_int("server_threads", None)
        self.local_addr: Optional[str] = getattr(params, "local_addr", None)

    def connect_timeout(self) -> float:
        """How long a client of the endpoint retries connecting: ``read_timeout``, but
        never past ``join_timeout`` (a join ends by then)."""
        return min(self.read_timeout, self.join_timeout)

    def timing(self) -> Timing:
        """The timeouts every node of the run must share."""
        return Timing(
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            close_timeout=self.close_timeout,
            keep_alive_interval=self.keep_alive_interval,
            keep_alive_max_attempt=self.keep_alive_max_attempt,
        )


def reach_server(settings: Settings) -> None:
    """Connects to the rdzv store server at the endpoint and hangs up, within
    :meth:`Settings.connect_timeout`: a server that is not there fails the join by
    ``join_timeout`` with one line, :class:`rdzv.RendezvousConnectionError`."""
    where = f"{settings.host}:{settings.port}"
    timeout = settings.connect_timeout()
    try:
        Store(settings.host, settings.port, timeout=timeout)
    except _errors.StoreError as e:
        raise _errors.RendezvousConnectionError(
            f"run '{settings.run_id}': no rdzv store server answered at {where} within "
            f"{timeout:g} s (join_timeout {settings.join_timeout:g} s, read_timeout "
            f"{settings.read_timeout:g} s): {str(e).rstrip('.')}. Start the agent that "
            f"hosts it (--rdzv-conf is_host=true) or `rdzv store serve --port "
            f"{settings.port}` there, or correct --rdzv-endpoint"
        ) from None


def _host_server(settings: Settings) -> Optional[StoreServer]:
    """The in-process rdzv server, when this agent hosts it (``is_host``, or the endpoint
    names this host and nobody here serves it yet)."""
    wanted = settings.is_host
    if wanted is False:
        return None
    if wanted is None and not is_this_host(settings.host):
        return None
    try:
        server = StoreServer(host=None, port=settings.port, threads=settings.server_threads)
    except _errors.StoreServerError as e:
        if wanted:
            raise
        # Another agent on this host serves the endpoint already (several agents per
        # host, as the c10d backend allows): be its client.
        log.info("rdzv: not hosting the rendezvous server on port %s: %s", settings.port, e)
        return None
    log.info("rdzv: hosting the rendezvous server on port %s", server.port)
    return server


_CLASS: Optional[type] = None
_ETCD_CLASS: Optional[type] = None


def _handler_class() -> type:
    """Builds the handler class on first use: it subclasses torch's ABC, so torch is
    imported here and nowhere else."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

    def torch_error(error: BaseException) -> BaseException:
        """An rdzv rendezvous error as torch's own class, with the same text."""
        classes = {
            _errors.RendezvousClosedError: api.RendezvousClosedError,
            _errors.RendezvousTimeoutError: api.RendezvousTimeoutError,
            _errors.RendezvousConnectionError: api.RendezvousConnectionError,
            _errors.RendezvousStateError: api.RendezvousStateError,
            _errors.RendezvousGracefulExitError: getattr(
                api, "RendezvousGracefulExitError", api.RendezvousClosedError
            ),
            _errors.StoreConnectionError: api.RendezvousConnectionError,
            _errors.StoreTimeoutError: api.RendezvousTimeoutError,
        }
        for ours, theirs in classes.items():
            if isinstance(error, ours):
                return theirs(str(error))
        return api.RendezvousError(str(error))

    class RdzvRendezvousHandler(api.RendezvousHandler):
        """torchrun's ``RendezvousHandler`` on rdzv's elastic rendezvous."""

        def __init__(self, params: Any) -> None:
            self._settings = Settings(params)
            self._server = _host_server(self._settings)
            self._node: Optional[ElasticRendezvous] = None
            self._round: Any = None
            self._tcp_store: Any = None
            self._closed = False
            # torch's client connects here, when torchrun creates the handler, as the
            # c10d backend's creator connects its TCPStore: not inside next_rendezvous.
            # Its connect resolves the server's address back to a name (a DNS query
            # where /etc/hosts has no line for it), which a busy resolver may drop and
            # retry only after 5 s; agents that all connect at the round's end would
            # wait for the slowest lookup.
            # A server that is not there fails here, by join_timeout, in one line: rdzv's
            # client tries first (torch's would retry for read_timeout, and its error
            # carries C++ frames).
            try:
                if self._server is None:
                    reach_server(self._settings)
                self._store()
            except _errors.RendezvousConnectionError as e:
                self._stop_server()
                raise api.RendezvousConnectionError(str(e)) from None
            except Exception as e:
                self._stop_server()
                raise api.RendezvousConnectionError(
                    f"torch's TCPStore client could not connect to the rdzv store server "
                    f"at {self._settings.host}:{self._port()} (run "
                    f"'{self._settings.run_id}'): {_errors.first_line(e)}"
                ) from None

        # --- RendezvousHandler -------------------------------------------------------

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            # Every round's rank 0 publishes a fresh MASTER_ADDR/MASTER_PORT (torch's
            # RendezvousStoreInfo.build), so no worker reads a previous attempt's keys.
            return False

        def get_run_id(self) -> str:
            return self._settings.run_id

        def next_rendezvous(self) -> Any:
            s = self._settings
            try:
                if self._closed:
                    raise _errors.RendezvousClosedError(f"the rendezvous '{s.run_id}' is closed")
                # The first call joins; a later one, made while the round it returned
                # is still going (our workers restart), ends that round for everyone.
                # Every arrival offers a port free then (contact_host), so each round's
                # rank 0 gives a fresh MASTER_PORT, as c10d does.
                round_ = wait_with_progress(self._join(), s.run_id)
            except (_errors.RendezvousError, _errors.StoreError) as e:
                raise torch_error(e) from e
            self._round = round_
            store = dist.PrefixStore(round_.store_prefix, self._store())
            bootstrap = _bootstrap(round_, store, s.local_addr)
            log.info(
                "rdzv: node %s is rank %s of %s in round %s of run %s",
                self._node.node if self._node is not None else "?",
                round_.rank,
                round_.world_size,
                round_.round,
                s.run_id,
            )
            return api.RendezvousInfo(store, round_.rank, round_.world_size, bootstrap)

        def is_closed(self) -> bool:
            if self._closed:
                return True
            try:
                return self._join().is_closed()
            except (_errors.RendezvousError, _errors.StoreError) as e:
                raise torch_error(e) from e

        def set_closed(self) -> None:
            self._closed = True
            try:
                self._join().set_closed()
            except (_errors.RendezvousError, _errors.StoreError) as e:
                raise torch_error(e) from e

        def num_nodes_waiting(self) -> int:
            node = self._node
            if node is None or self._round is None or node.has_left:
                return 0
            try:
                return node.num_nodes_waiting()
            except (_errors.RendezvousError, _errors.StoreError) as e:
                raise torch_error(e) from e

        def shutdown(self) -> bool:
            # As the c10d backend does: close the run for every node, so that a node
            # that finishes first does not make the others restart their workers.
            ok = True
            try:
                if not self._closed:
                    self._closed = True
                    ok = self._join().shutdown()
            except Exception as e:  # noqa: BLE001 - torch expects False, not a raise
                log.warning("rdzv: closing the rendezvous '%s' failed: %s", self.get_run_id(), e)
                ok = False
            finally:
                server, self._server = self._server, None
                if server is not None:
                    server.stop()
            return ok

        # --- internals ---------------------------------------------------------------

        def _join(self) -> ElasticRendezvous:
            if self._node is None:
                s = self._settings
                log.info(
                    "rdzv: joining run %s (nodes %s:%s); once %s have joined, the last call "
                    "waits up to %g s for more (last_call_timeout)",
                    s.run_id,
                    s.min_nodes,
                    s.max_nodes,
                    s.min_nodes,
                    s.last_call_timeout,
                )
                self._node = ElasticRendezvous(
                    s.host,
                    self._port(),
                    s.run_id,
                    min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    node_id=s.node_id or _node_id(s.local_addr),
                    timeout=s.connect_timeout(),
                    **s.timing(),
                    contact_host=s.local_addr or socket.getfqdn(),
                )
            return self._node

        def _stop_server(self) -> None:
            server, self._server = self._server, None
            if server is not None:
                server.stop()

        def _port(self) -> int:
            return self._server.port if self._server is not None else self._settings.port

        def _store(self) -> Any:
            if self._tcp_store is None:
                s = self._settings
                host = "127.0.0.1" if self._server is not None else s.host
                self._tcp_store = dist.TCPStore(
                    host,
                    self._port(),
                    is_master=False,
                    timeout=timedelta(seconds=s.read_timeout),
                    wait_for_workers=False,
                )
            return self._tcp_store

    def _bootstrap(round_: Any, store: Any, local_addr: Optional[str]) -> Any:
        """``MASTER_ADDR``/``MASTER_PORT``: rank 0's contact, which came with the round (no
        store request). Without one (a node of an older rdzv as rank 0), torch's
        ``RendezvousStoreInfo.build``: rank 0 publishes its address and a free port in the
        round's store and every rank reads them, in two requests per rank (one
        ``multi_get``, which waits for both keys) where torch's store has
        ``multi_get``/``multi_set``."""
        info = api.RendezvousStoreInfo
        master = getattr(round_, "master", None)
        if master:
            addr, _, port = master.rpartition(":")
            try:
                return info(master_addr=addr, master_port=int(port))
            except ValueError:
                log.warning("rdzv: rank 0's contact %r is not addr:port; using the store", master)
        rank = round_.rank
        if not (hasattr(store, "multi_get") and hasattr(store, "multi_set")):
            try:
                return info.build(rank, store, local_addr=local_addr)
            except TypeError:  # torch 2.4: build(rank, store)
                return info.build(rank, store)
        from torch.distributed.elastic.utils.distributed import get_free_port

        keys = [info.MASTER_ADDR_KEY, info.MASTER_PORT_KEY]
        if rank == 0:
            addr = local_addr or socket.getfqdn()
            store.multi_set(keys, [addr.encode("UTF-8"), str(get_free_port()).encode("UTF-8")])
        addr_value, port_value = store.multi_get(keys)
        return info(
            master_addr=addr_value.decode("UTF-8"),
            master_port=int(port_value.decode("UTF-8")),
        )

    global _ETCD_CLASS
    _ETCD_CLASS = _etcd.handler_class(RdzvRendezvousHandler, api, dist, torch_error)
    _CLASS = RdzvRendezvousHandler
    return _CLASS


def _node_id(local_addr: Optional[str]) -> str:
    """torch's node descriptor text: ``{host}_{pid}_0``."""
    return f"{local_addr or socket.getfqdn()}_{os.getpid()}_0"
