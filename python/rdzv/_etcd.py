"""``torchrun --rdzv-backend=rdzv --rdzv-endpoint=etcd://H1:P1,H2:P2,H3:P3``: the elastic
rendezvous kept in an etcd cluster, and the workers' store hosted by rank 0's agent.

What this module decides:

- **The endpoint.** ``etcd://HOST[:PORT][,HOST[:PORT]…]`` (port 2379 when missing) names
  the cluster; the run id is torchrun's ``--rdzv-id``, the node range its ``--nnodes``, and
  ``--rdzv-conf etcd_prefix=…`` the etcd key prefix (default ``rdzv``). They become the
  ``etcd://`` rendezvous URL of the Rust side (:func:`rendezvous_url`), which joins
  through etcd (leases, one transaction to close a round, watches).
- **The store after a round.** etcd keeps the rendezvous, not the job's traffic: as
  torch's c10d backend does (``bootstrap_store_info``, ``use_agent_store``), the agent of
  rank 0 hosts a store server in process (an rdzv :class:`~rdzv.StoreServer`, on every
  address of its node, port 0) and publishes ``addr:port`` in the round's etcd store
  (one put; every other agent reads it with one get, which waits on a watch). Every
  agent's ``RendezvousInfo.store`` is a client of that server under the round's prefix,
  and ``MASTER_ADDR``/``MASTER_PORT`` point at it. Each round gets a fresh server (the
  previous one stops): torch's workers keep their keys in the agent store without an
  attempt prefix, and a server kept across a worker restart handed the new workers the
  dead ones' gloo addresses (seen in ``test_etcd_worker_failure_restarts_with_max_restarts_1``).
  An agent that is no longer rank 0 stops its own; the handler's ``shutdown`` stops it.

What it deliberately does not decide: ranks, rounds, liveness and closing (the core's
elastic machine, through :class:`rdzv.ElasticRendezvous`), the etcd protocol (the Rust
``EtcdStore``), and the rest of torchrun's handler (:mod:`rdzv.torchrun`, which calls
:func:`handler_class`). The torch-free part (:class:`EtcdAgent`) is tested without torch.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, List, NamedTuple, Optional

from ._progress import wait_with_progress
from ._rdzv import ElasticRendezvous, StoreServer

__all__ = [
    "SCHEME",
    "DEFAULT_ETCD_PORT",
    "AGENT_STORE_KEY",
    "is_etcd_endpoint",
    "parse_etcd_endpoint",
    "rendezvous_url",
    "AgentRound",
    "EtcdAgent",
    "handler_class",
]

log = logging.getLogger(__name__)

#: The endpoint prefix that selects etcd.
SCHEME = "etcd://"
#: etcd's client port, when an endpoint names none.
DEFAULT_ETCD_PORT = 2379
#: The key, in each round's store (etcd ``/{prefix}/torch.rendezvous.{run_id}.{round}/``),
#: where rank 0's agent publishes its hosted store server as ``addr:port``.
AGENT_STORE_KEY = "rdzv.agent_store"

# How long an agent waits for rank 0's address before it looks whether the round still
# goes (seconds).
_PUBLISH_SLICE = 2.0

# Characters that would change the meaning of the URL the run id goes into.
_RUN_ID_FORBIDDEN = set("/?#&=%, \t\r\n")


def is_etcd_endpoint(endpoint: Optional[str]) -> bool:
    """Whether torchrun's ``--rdzv-endpoint`` names an etcd cluster (``etcd://…``)."""
    return bool(endpoint) and endpoint.strip().lower().startswith(SCHEME)  # type: ignore[union-attr]


def parse_etcd_endpoint(endpoint: str) -> List[str]:
    """``etcd://H1[:P1],H2[:P2],…`` (a trailing ``/`` allowed) as ``["H1:P1", …]``, with
    port 2379 where none is given. Raises ``ValueError`` naming the endpoint and the form
    when it is not one (a path or query: the run id is ``--rdzv-id``, options go in
    ``--rdzv-conf``)."""
    form = "etcd://HOST[:PORT][,HOST[:PORT]...]"
    text = endpoint.strip()
    if not is_etcd_endpoint(text):
        raise ValueError(f"The rendezvous endpoint '{endpoint}' is not of the form {form}.")
    rest = text[len(SCHEME) :].rstrip("/")
    if not rest or any(c in rest for c in "/?#@ "):
        raise ValueError(
            f"The rendezvous endpoint '{endpoint}' is not of the form {form}: the run id "
            "is --rdzv-id and the options go in --rdzv-conf."
        )
    endpoints = []
    for item in rest.split(","):
        if item.startswith("["):
            host, sep, tail = item[1:].partition("]")
            if not sep or not host:
                raise ValueError(f"The etcd endpoint '{item}' in '{endpoint}' is not [V6]:PORT.")
            host = f"[{host}]"
            port_text = tail[1:] if tail.startswith(":") else tail
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"The etcd endpoint '{item}' in '{endpoint}' has no host ({form}).")
        port = DEFAULT_ETCD_PORT
        if port_text:
            try:
                port = int(port_text)
            except ValueError:
                port = -1
            if not 0 < port < 65536:
                raise ValueError(
                    f"The etcd endpoint '{item}' in '{endpoint}' has no valid port "
                    "(1 to 65535)."
                )
        endpoints.append(f"{host}:{port}")
    return endpoints


def _seconds_text(seconds: float) -> str:
    """A duration as the URL takes it: whole seconds as ``30``, others as ``0.25``."""
    if float(seconds).is_integer():
        return str(int(seconds))
    return repr(float(seconds))


def rendezvous_url(
    endpoints: List[str],
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    *,
    join_timeout: float = 600.0,
    last_call_timeout: float = 30.0,
    close_timeout: float = 30.0,
    keep_alive_interval: float = 5.0,
    keep_alive_max_attempt: int = 3,
    read_timeout: float = 60.0,
    etcd_prefix: Optional[str] = None,
) -> str:
    """The ``etcd://`` rendezvous URL of one torchrun run (see ``rdzv.rendezvous``).
    Raises ``ValueError`` for a run id the URL cannot carry."""
    if not run_id or any(c in _RUN_ID_FORBIDDEN for c in run_id):
        raise ValueError(
            f"The run id {run_id!r} cannot be used with an etcd endpoint: it must be "
            "non-empty and have none of / ? # & = % , or whitespace."
        )
    query = [
        f"nodes={min_nodes}:{max_nodes}",
        f"join_timeout={_seconds_text(join_timeout)}",
        f"last_call_timeout={_seconds_text(last_call_timeout)}",
        f"close_timeout={_seconds_text(close_timeout)}",
        f"keep_alive_interval={_seconds_text(keep_alive_interval)}",
        f"keep_alive_max_attempt={keep_alive_max_attempt}",
        f"read_timeout={_seconds_text(read_timeout)}",
    ]
    if etcd_prefix:
        if any(c in _RUN_ID_FORBIDDEN for c in etcd_prefix):
            raise ValueError(
                f"The etcd prefix {etcd_prefix!r} must have none of / ? # & = % , or "
                "whitespace."
            )
        query.append(f"etcd_prefix={etcd_prefix}")
    return f"{SCHEME}{','.join(endpoints)}/{run_id}?{'&'.join(query)}"


class AgentRound(NamedTuple):
    """One round as an agent sees it, with the store server rank 0's agent hosts."""

    #: The round number.
    round: int
    #: This node's rank, and the number of nodes.
    rank: int
    world_size: int
    #: The round's store prefix (``torch.rendezvous.{run_id}.{round}``).
    store_prefix: str
    #: Rank 0's agent's store server, as the workers reach it (``MASTER_ADDR``/``PORT``).
    master_addr: str
    master_port: int
    #: Where this agent connects to it: loopback on rank 0's own node.
    connect_host: str


class EtcdAgent:
    """One agent of a torchrun run over etcd, without torch: joins the elastic rendezvous
    (``ElasticRendezvous.etcd``) on first use, and after each round hosts (rank 0) or
    finds (the others) the agents' store server. ``server_host`` is where a hosted server
    listens (``None``: every address); ``local_addr`` what rank 0 publishes (default:
    this host's FQDN, as torch's ``RendezvousStoreInfo.build``)."""

    def __init__(
        self,
        url: str,
        node_id: Optional[str] = None,
        local_addr: Optional[str] = None,
        server_threads: Optional[int] = None,
        server_host: Optional[str] = None,
    ) -> None:
        self.url = url
        self._node_id = node_id
        self._local_addr = local_addr
        self._server_threads = server_threads
        self._server_host = server_host
        self._node: Optional[ElasticRendezvous] = None
        self._server: Optional[StoreServer] = None

    @property
    def node(self) -> ElasticRendezvous:
        """The node's rendezvous handle (joins on first use)."""
        if self._node is None:
            self._node = ElasticRendezvous.etcd(self.url, node_id=self._node_id)
        return self._node

    @property
    def joined(self) -> bool:
        """Whether the node has joined (any method but ``stop_server`` joins)."""
        return self._node is not None

    @property
    def server(self) -> Optional[StoreServer]:
        """The store server this agent hosts now, if it is rank 0's."""
        return self._server

    def next_rendezvous(self) -> AgentRound:
        """torchelastic's ``next_rendezvous`` (ends the current round if it still goes),
        then the agents' store server of the new round. Raises rdzv's
        ``Rendezvous*Error``/``Store*Error`` (``StoreServerError`` when rank 0 cannot
        host)."""
        round_ = wait_with_progress(self.node, self.node.run_id)
        store = self.node.round_store(round_)
        if round_.rank == 0:
            server = self._host_server()
            addr = self._local_addr or socket.getfqdn()
            # One etcd put; every other agent's get waits for it on a watch.
            store.set(AGENT_STORE_KEY, f"{addr}:{server.port}")
            return AgentRound(
                round_.round, 0, round_.world_size, round_.store_prefix, addr, server.port,
                "127.0.0.1" if self._server_host is None else self._server_host,
            )
        # Rank 0 is another agent now: its workers no longer use this one's server.
        self.stop_server()
        published = self._published(store, round_)
        if published is None:
            # The round ended before rank 0 published (it died): on to the next one.
            return self.next_rendezvous()
        addr, _, port_text = published.rpartition(":")
        try:
            port = int(port_text)
        except ValueError:
            port = -1
        if not addr or not 0 < port < 65536:
            from ._errors import RendezvousStateError

            raise RendezvousStateError(
                f"rank 0 of round {round_.round} published "
                f"{published!r} under {round_.store_prefix}/{AGENT_STORE_KEY} in etcd, "
                "not addr:port; is every node on the same rdzv version?"
            )
        return AgentRound(
            round_.round, round_.rank, round_.world_size, round_.store_prefix, addr, port, addr
        )

    def _published(self, store: Any, round_: Any) -> Optional[str]:
        """Rank 0's ``addr:port``, waiting for it up to the store's timeout
        (``read_timeout``), or ``None`` once the round is over without it. One get, which
        waits on a watch; a wait that runs past a slice looks whether the round still
        goes, so an agent whose rank 0 died before publishing moves on with the others."""
        from ._errors import StoreTimeoutError

        timeout = store.timeout
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                store.set_timeout(max(0.05, min(_PUBLISH_SLICE, left)))
                try:
                    return store.get(AGENT_STORE_KEY).decode("utf-8", "replace")
                except StoreTimeoutError:
                    current = self.node.current()
                    if current is None or current.round != round_.round:
                        return None
                    if time.monotonic() >= deadline:
                        raise
        finally:
            # The round's store may share its timeout with the node's own store.
            store.set_timeout(timeout)

    def _host_server(self) -> StoreServer:
        """A fresh server for each round: the workers' keys are not prefixed by attempt
        (torch's ``_create_c10d_store`` with the agent store), so a server kept across a
        restart would hand the new workers the old ones' gloo addresses."""
        server = StoreServer(host=self._server_host, port=0, threads=self._server_threads)
        log.info("rdzv: rank 0's agent hosts the workers' store server on port %s", server.port)
        self.stop_server()
        self._server = server
        return server

    def stop_server(self) -> None:
        """Stops the server this agent hosts, if any."""
        server, self._server = self._server, None
        if server is not None:
            log.info("rdzv: stopping the agents' store server on port %s", server.port)
            server.stop()

    def close(self) -> bool:
        """torch's ``shutdown``: closes the run for every node (if joined) and stops the
        hosted server. Returns whether closing succeeded."""
        try:
            return self.node.shutdown() if self._node is not None else True
        finally:
            self.stop_server()


def use_agent_store() -> bool:
    """As torch's c10d handler answers it: the workers use the agents' store unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"


def handler_class(
    base: type, api: Any, dist: Any, torch_error: Callable[[BaseException], BaseException]
) -> type:
    """torchrun's handler over etcd: ``base`` (:mod:`rdzv.torchrun`'s handler) with the
    store and bootstrap of :class:`EtcdAgent`. ``api`` and ``dist`` are torch's modules."""
    from . import _errors

    class RdzvEtcdRendezvousHandler(base):  # type: ignore[misc, valid-type]
        """torchrun's ``RendezvousHandler`` on rdzv's elastic rendezvous in etcd."""

        def __init__(self, settings: Any) -> None:
            # Not base.__init__: there is no rendezvous server to host or connect to.
            s = settings
            if s.is_host is not None:
                log.warning(
                    "rdzv: is_host does not apply to an etcd endpoint (rank 0's agent hosts "
                    "the store); ignored"
                )
            self._settings = s
            self._server = None
            self._round: Optional[Any] = None
            self._tcp_store = None
            self._closed = False
            self._clients: dict = {}
            self._agent = EtcdAgent(
                rendezvous_url(
                    s.etcd_endpoints,
                    s.run_id,
                    s.min_nodes,
                    s.max_nodes,
                    read_timeout=s.read_timeout,
                    etcd_prefix=s.etcd_prefix,
                    **s.timing(),
                ),
                node_id=s.node_id or f"{s.local_addr or socket.getfqdn()}_{os.getpid()}_0",
                local_addr=s.local_addr,
                server_threads=s.server_threads,
            )

        @property
        def _node(self) -> Optional[ElasticRendezvous]:  # read by the base's methods
            return self._agent.node if self._agent.joined else None

        @property
        def use_agent_store(self) -> bool:
            return use_agent_store()

        def next_rendezvous(self) -> Any:
            s = self._settings
            try:
                if self._closed:
                    raise _errors.RendezvousClosedError(f"the rendezvous '{s.run_id}' is closed")
                info = self._agent.next_rendezvous()
            except (_errors.RendezvousError, _errors.StoreError) as e:
                raise torch_error(e) from e
            except _errors.StoreServerError as e:
                raise api.RendezvousError(
                    f"rank 0's agent cannot host the workers' store server: {e}"
                ) from e
            self._round = info
            store = dist.PrefixStore(info.store_prefix, self._client(info))
            if self.use_agent_store:
                bootstrap = api.RendezvousStoreInfo(
                    master_addr=info.master_addr, master_port=info.master_port
                )
            else:
                # The workers' rank 0 hosts their own TCPStore on a free port of its node.
                bootstrap = api.RendezvousStoreInfo.build(
                    info.rank, store, local_addr=s.local_addr
                )
            log.info(
                "rdzv: node %s is rank %s of %s in round %s of run %s (etcd); the agents' "
                "store is %s:%s",
                self._agent.node.node, info.rank, info.world_size, info.round, s.run_id,
                info.master_addr, info.master_port,
            )
            return api.RendezvousInfo(store, info.rank, info.world_size, bootstrap)

        def _join(self) -> ElasticRendezvous:
            return self._agent.node

        def _client(self, info: AgentRound) -> Any:
            """torch's TCPStore client of the round's server, kept while it stays."""
            where = (info.connect_host, info.master_port)
            client = self._clients.get(where)
            if client is None:
                self._clients.clear()
                try:
                    client = dist.TCPStore(
                        info.connect_host,
                        info.master_port,
                        is_master=False,
                        timeout=timedelta(seconds=self._settings.read_timeout),
                        wait_for_workers=False,
                    )
                except Exception as e:
                    raise api.RendezvousConnectionError(
                        f"torch's TCPStore client could not connect to rank 0's agent "
                        f"store at {info.master_addr}:{info.master_port} (round "
                        f"{info.round} of run '{self._settings.run_id}'): "
                        f"{_errors.first_line(e)}. Check that rank 0's node is reachable "
                        "on that address (--local-addr sets it)"
                    ) from None
                self._clients[where] = client
            return client

        def shutdown(self) -> bool:
            ok = True
            try:
                if not self._closed:
                    self._closed = True
                    ok = self._agent.node.shutdown() if self._agent.joined else True
            except Exception as e:  # noqa: BLE001 - torch expects False, not a raise
                log.warning("rdzv: closing the rendezvous '%s' failed: %s", self.get_run_id(), e)
                ok = False
            finally:
                self._agent.stop_server()
            return ok

    return RdzvEtcdRendezvousHandler
