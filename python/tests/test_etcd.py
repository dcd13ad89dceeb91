"""The elastic rendezvous on etcd from Python, without torch: ``rdzv.rendezvous("etcd://…")``
and ``ElasticRendezvous.etcd`` in separate processes (one SIGKILLed), and the torch-free
half of the torchrun handler over etcd (``rdzv._etcd``: the URL, and the agents' store
server that rank 0's agent hosts).

The tests that talk to etcd need a running cluster: ``RDZV_ETCD_ENDPOINTS`` (comma-separated
``host:port``, as ``.ci/etcd-cluster.sh start DIR`` prints; ``.ci/run`` exports it), and
skip with that reason without it. Every run id is fresh, so a cluster can be reused.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import List

import pytest

import rdzv
from node_procs import kill_the_top_rank, read_line
from rdzv import _etcd

ENDPOINTS = os.environ.get("RDZV_ETCD_ENDPOINTS", "")
needs_etcd = pytest.mark.skipif(
    not ENDPOINTS,
    reason="RDZV_ETCD_ENDPOINTS is not set: no etcd cluster to test against "
    "(start one with .ci/etcd-cluster.sh start DIR and export what it prints)",
)

FAST = "last_call_timeout=0.5&keep_alive_interval=0.3&keep_alive_max_attempt=3&read_timeout=10"


def run_id(name: str) -> str:
    return f"py-{name}-{uuid.uuid4().hex[:10]}"


def url(run: str, nodes: str, extra: str = "") -> str:
    tail = f"&{extra}" if extra else ""
    return f"etcd://{ENDPOINTS}/{run}?nodes={nodes}&join_timeout=30&{FAST}{tail}"


# --- the endpoint and URL (no etcd needed) ----------------------------------------------


def test_etcd_endpoints_parse_with_the_default_port() -> None:
    assert _etcd.is_etcd_endpoint("etcd://a:1")
    assert _etcd.is_etcd_endpoint("ETCD://a:1")
    assert not _etcd.is_etcd_endpoint("a:1")
    assert not _etcd.is_etcd_endpoint("")
    assert _etcd.parse_etcd_endpoint("etcd://h1:2380,h2,[::1]:4/") == [
        "h1:2380",
        "h2:2379",
        "[::1]:4",
    ]


@pytest.mark.parametrize(
    "bad", ["etcd://", "etcd://h:x", "etcd://h:0", "etcd://h:1/run", "etcd://h:1?x=1", "etcd://,"]
)
def test_bad_etcd_endpoints_are_value_errors_naming_them(bad: str) -> None:
    with pytest.raises(ValueError, match="etcd"):
        _etcd.parse_etcd_endpoint(bad)


def test_the_rendezvous_url_carries_torchruns_settings() -> None:
    text = _etcd.rendezvous_url(
        ["a:1", "b:2"], "job", 2, 4, join_timeout=90, last_call_timeout=0.5,
        keep_alive_max_attempt=5, etcd_prefix="team",
    )
    assert text.startswith("etcd://a:1,b:2/job?nodes=2:4&join_timeout=90&")
    assert "last_call_timeout=0.5" in text
    assert "keep_alive_max_attempt=5" in text
    assert text.endswith("&etcd_prefix=team")
    with pytest.raises(ValueError, match="run id"):
        _etcd.rendezvous_url(["a:1"], "a/b", 1, 1)
    with pytest.raises(ValueError):
        rdzv.ElasticRendezvous.etcd("etcd://a:1/job?nodes=3:2")


def test_an_unreachable_cluster_fails_the_agent_naming_etcd() -> None:
    agent = _etcd.EtcdAgent(
        "etcd://127.0.0.1:1/unreachable?read_timeout=1&keep_alive_interval=1&join_timeout=20",
        node_id="n0",
    )
    started = time.monotonic()
    with pytest.raises(rdzv.RendezvousError) as info:
        agent.next_rendezvous()
    assert "etcd" in str(info.value) and "127.0.0.1:1" in str(info.value)
    assert time.monotonic() - started < 15
    assert agent.server is None
    agent.close()


# --- rendezvous("etcd://…") and ElasticRendezvous.etcd in processes -----------------------

RENDEZVOUS = """
import json, sys
import rdzv
r = rdzv.rendezvous(sys.argv[1])
store, rank, world = r
if rank == 0:
    store.set("from-rank-0", b"hello")
print(json.dumps({"rank": rank, "world": world, "got": store.get("from-rank-0").decode(),
                  "round": r.elastic.current().round}), flush=True)
"""


@needs_etcd
def test_rendezvous_url_forms_a_round_across_processes(children) -> None:
    run = run_id("url")
    procs = [
        children.spawn(RENDEZVOUS, url(run, "2:2", f"node_id=n{i}")) for i in range(2)
    ]
    got = [read_line(p, 40) for p in procs]
    assert sorted(g["rank"] for g in got) == [0, 1]
    assert all(g["world"] == 2 for g in got)
    # The round's store is etcd's, shared by both: rank 1 read what rank 0 wrote.
    assert all(g["got"] == "hello" for g in got)
    assert got[0]["round"] == got[1]["round"]
    for p in procs:
        assert p.wait(timeout=30) == 0, p.stderr.read()


NODE = """
import json, sys
import rdzv
n = rdzv.ElasticRendezvous.etcd(sys.argv[1], node_id=sys.argv[2])
r = n.next_round(timeout=40)
while True:
    print(json.dumps({"round": r.round, "rank": r.rank, "world": r.world_size}), flush=True)
    r = n.next_round(after=r.round, timeout=40)
"""


@needs_etcd
def test_nodes_in_processes_one_sigkilled_the_rest_form_the_next_round_without_it(
    children,
) -> None:
    run = run_id("kill")
    procs = [children.spawn(NODE, url(run, "2:3"), f"node{i}") for i in range(3)]
    _, _, elapsed = kill_the_top_rank(procs, 40)
    # The dead node's lease expires after keep_alive_interval x (attempts + 2) + 1 s
    # (2.5 s, which etcd grants as 3 s), then the last call (0.5 s): far below the join
    # timeout.
    assert elapsed < 20, elapsed


# --- the torchrun handler's torch-free half: rank 0's agent hosts the store -----------


def agents_round(agents: List[_etcd.EtcdAgent]) -> List[_etcd.AgentRound]:
    out: List = [None] * len(agents)
    errors: List[BaseException] = []

    def go(i: int) -> None:
        try:
            out[i] = agents[i].next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(r is not None for r in out)
    return out


@needs_etcd
def test_rank_zeros_agent_hosts_the_store_and_every_agent_finds_it() -> None:
    run = run_id("agent")
    agents = [
        _etcd.EtcdAgent(url(run, "2:2"), node_id=f"a{i}", local_addr="127.0.0.1")
        for i in range(2)
    ]
    try:
        first = agents_round(agents)
        assert sorted(r.rank for r in first) == [0, 1]
        host = next(a for a, r in zip(agents, first) if r.rank == 0)
        other = next(a for a, r in zip(agents, first) if r.rank != 0)
        assert host.server is not None and host.server.running
        assert other.server is None
        port = host.server.port
        # Every agent has rank 0's address and its server's port (MASTER_ADDR/PORT).
        assert {(r.master_addr, r.master_port) for r in first} == {("127.0.0.1", port)}
        # The server serves the round: what one agent writes there the other reads.
        mine = {r.rank: rdzv.Store(r.connect_host, r.master_port, timeout=10) for r in first}
        mine[1].set(f"{first[1].store_prefix}/k", b"v")
        assert mine[0].get(f"{first[0].store_prefix}/k") == b"v"
        # A next round (a worker restart): rank 0's agent hosts a fresh server (no key of
        # the last attempt's workers survives) and stops the old one.
        old = host.server
        second = agents_round(agents)
        assert second[0].round == second[1].round > first[0].round
        new_host = next(a for a, r in zip(agents, second) if r.rank == 0)
        server = new_host.server
        assert server is not None and server.running and server is not old
        assert not old.running
        assert {(r.master_addr, r.master_port) for r in second} == {("127.0.0.1", server.port)}
        assert not rdzv.Store("127.0.0.1", server.port, timeout=10).check(
            [f"{first[0].store_prefix}/k"]
        )
    finally:
        closed = [a.close() for a in agents]
    assert all(closed)
    # shutdown stops the hosted server; the run is closed for every node.
    assert not server.running
    late = _etcd.EtcdAgent(url(run, "2:2"), node_id="late")
    with pytest.raises(rdzv.RendezvousClosedError):
        late.next_rendezvous()
    late.close()


@needs_etcd
def test_an_agent_whose_rank_0_leaves_before_publishing_moves_on_to_the_next_round() -> None:
    run = run_id("silent")
    # A bare node (no agent: it never publishes a store) forms round 0 alone, so it keeps
    # rank 0 when the agent joins (ranks are stable).
    silent = rdzv.ElasticRendezvous.etcd(url(run, "1:2"), node_id="silent")
    first = silent.next_round(timeout=30)
    assert first.rank == 0
    agent = _etcd.EtcdAgent(url(run, "1:2"), node_id="agent", local_addr="127.0.0.1")
    got: List = []
    thread = threading.Thread(target=lambda: got.append(agent.next_rendezvous()))
    thread.start()
    try:
        shared = silent.next_round(after=first.round, timeout=30)
        assert (shared.rank, shared.world_size) == (0, 2)
        # Past one wait slice, so the agent has looked once and found the round going.
        time.sleep(_etcd._PUBLISH_SLICE + 1)
        assert not got
        assert silent.leave(timeout=10)
        thread.join(timeout=30)
        assert got, "the agent did not move on once rank 0 left"
        mine = got[0]
        assert mine.round > shared.round
        assert (mine.rank, mine.world_size) == (0, 1)
        assert agent.server is not None and mine.master_port == agent.server.port
    finally:
        agent.close()
        thread.join(timeout=30)
