"""rdzv.ElasticRendezvous: nodes in threads and in separate processes, one SIGKILLed."""

from __future__ import annotations

import threading
import time

import pytest

import rdzv
from node_procs import kill_the_top_rank

FAST = dict(last_call_timeout=0.3, keep_alive_interval=0.2, keep_alive_max_attempt=3)


def node(server: rdzv.StoreServer, run_id: str, name: str, **kw) -> rdzv.ElasticRendezvous:
    settings = {**FAST, "join_timeout": 20, **kw}
    return rdzv.ElasticRendezvous("127.0.0.1", server.port, run_id, node_id=name, **settings)


def test_two_nodes_form_a_round_then_a_worker_failure_starts_the_next(
    server: rdzv.StoreServer,
) -> None:
    a = node(server, "wf", "a", min_nodes=2, max_nodes=2)
    b = node(server, "wf", "b", min_nodes=2, max_nodes=2)
    ra, rb = a.next_round(timeout=20), b.next_round(timeout=20)
    assert ra.round == rb.round
    assert {ra.rank, rb.rank} == {0, 1}
    assert ra.world_size == rb.world_size == 2
    assert ra.store_prefix == f"torch.rendezvous.wf.{ra.round}"
    # The round's store is shared between the members.
    a.round_store(ra).set("hello", b"a")
    assert b.round_store(rb).get("hello") == b"a"
    a.worker_failed()
    ra2, rb2 = a.next_round(after=ra.round, timeout=20), b.next_round(after=rb.round, timeout=20)
    assert ra2.round == rb2.round > ra.round
    assert {ra2.rank, rb2.rank} == {0, 1}
    assert a.leave(timeout=10) and b.leave(timeout=10)
    assert a.has_left


def test_rank_zeros_contact_comes_with_the_round_on_one_connection_per_node(
    server: rdzv.StoreServer,
) -> None:
    client = rdzv.Store("127.0.0.1", server.port, timeout=10)
    before = client.stats()["connections"]
    a = node(server, "contact", "a", min_nodes=2, max_nodes=2, contact="10.0.0.1:29500")
    b = node(server, "contact", "b", min_nodes=2, max_nodes=2)
    b.set_contact("10.0.0.2:29501")
    ra, rb = a.next_round(timeout=20), b.next_round(timeout=20)
    # The joining nodes hold one connection each: the handle opens its own on first use.
    assert client.stats()["connections"] - before == 2
    want = "10.0.0.1:29500" if ra.rank == 0 else "10.0.0.2:29501"
    assert ra.master == rb.master == want
    # Python's syntax, not Rust's (no Some("...")).
    assert repr(ra) == (
        f"Round(round={ra.round}, rank={ra.rank}, world_size=2, "
        f"store_prefix='torch.rendezvous.contact.{ra.round}', master='{want}')"
    )
    assert repr(a) == "ElasticRendezvous(node='a', run_id='contact', left=False)"
    assert a.is_closed() is False
    assert client.stats()["connections"] - before == 3
    assert a.leave(timeout=10) and b.leave(timeout=10)


def test_a_rejoining_rank_0_offers_a_fresh_port_with_contact_host(
    server: rdzv.StoreServer,
) -> None:
    # torchrun's MASTER_PORT: c10d picks a free port every round. A node rejoins on its
    # own as soon as its round ends, so contact_host picks the port at each arrival.
    a = node(server, "fresh", "a", min_nodes=2, max_nodes=2, contact_host="a.example")
    b = node(server, "fresh", "b", min_nodes=2, max_nodes=2, contact_host="b.example")
    masters = []
    after = None
    for _ in range(3):
        ra = a.next_round(after=after, timeout=20)
        rb = b.next_round(after=after, timeout=20)
        assert (ra.round, ra.rank, rb.rank) == (rb.round, 0, 1)
        assert ra.master == rb.master and ra.master.startswith("a.example:")
        masters.append(ra.master)
        after = ra.round
        b.worker_failed()
    assert len(set(masters)) == 3, masters
    with pytest.raises(ValueError, match="not both"):
        node(server, "fresh", "c", contact="x:1", contact_host="x")
    assert a.leave(timeout=10) and b.leave(timeout=10)


def test_join_timeout_is_a_rendezvous_timeout_error(server: rdzv.StoreServer) -> None:
    lonely = node(server, "alone", "x", min_nodes=2, max_nodes=2, join_timeout=0.5)
    with pytest.raises(rdzv.RendezvousTimeoutError) as info:
        lonely.next_round(timeout=10)
    assert isinstance(info.value, TimeoutError)
    # The class prints once (Python prints it), not again inside the message.
    assert str(info.value).startswith("node 'x' did not become a member"), info.value


def test_shutdown_closes_the_run_for_joiners(server: rdzv.StoreServer) -> None:
    a = node(server, "closing", "a")
    a.next_rendezvous()
    assert not a.is_closed()
    assert a.shutdown()
    assert a.has_left
    late = node(server, "closing", "late")
    assert late.is_closed()
    with pytest.raises(rdzv.RendezvousClosedError):
        late.next_rendezvous()


def test_a_node_that_left_raises_closed(server: rdzv.StoreServer) -> None:
    a = node(server, "gone", "a")
    first = a.next_round(timeout=20)
    assert a.leave(timeout=10)
    assert a.has_left
    with pytest.raises(rdzv.RendezvousClosedError, match="has left"):
        a.next_round(after=first.round, timeout=1)


def test_torchelastic_handler_api(server: rdzv.StoreServer) -> None:
    """next_rendezvous / num_nodes_waiting / set_closed, as torchrun's agent calls them."""
    a = node(server, "api", "a", min_nodes=2, max_nodes=3)
    b = node(server, "api", "b", min_nodes=2, max_nodes=3)
    rounds = {}
    threads = [
        threading.Thread(target=lambda n=n: rounds.__setitem__(n.node, n.next_rendezvous()))
        for n in (a, b)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.rank for r in rounds.values()) == [0, 1]
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    # A late node ends the round (there is room): the members see a node waiting.
    c = node(server, "api", "c", min_nodes=2, max_nodes=3)
    deadline = time.monotonic() + 20
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.num_nodes_waiting() >= 1
    later = {}
    threads = [
        threading.Thread(target=lambda n=n: later.__setitem__(n.node, n.next_rendezvous()))
        for n in (a, b, c)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.rank for r in later.values()) == [0, 1, 2]
    assert all(r.world_size == 3 for r in later.values())
    # Stable ranks: the first two keep theirs.
    assert later["a"].rank == rounds["a"].rank and later["b"].rank == rounds["b"].rank
    a.set_closed()
    assert b.is_closed()
    with pytest.raises(rdzv.RendezvousClosedError):
        b.next_rendezvous()


def test_bad_settings_are_value_errors(server: rdzv.StoreServer) -> None:
    with pytest.raises(ValueError):
        node(server, "bad", "a", min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError):
        node(server, "", "a")


def test_unreachable_store_is_a_rendezvous_connection_error() -> None:
    with rdzv.StoreServer(host="127.0.0.1", port=0) as srv:
        port = srv.port
    with pytest.raises(rdzv.RendezvousConnectionError) as info:
        rdzv.ElasticRendezvous("127.0.0.1", port, "r", timeout=0.3)
    assert isinstance(info.value, ConnectionError)


NODE = """
import json, sys
import rdzv
port, name = int(sys.argv[1]), sys.argv[2]
n = rdzv.ElasticRendezvous("127.0.0.1", port, "procs", min_nodes=2, max_nodes=3,
    node_id=name, join_timeout=30, last_call_timeout=1.0, keep_alive_interval=0.2,
    keep_alive_max_attempt=3)
r = n.next_round(timeout=30)
while True:
    print(json.dumps({"node": name, "round": r.round, "rank": r.rank, "world": r.world_size}),
          flush=True)
    r = n.next_round(after=r.round, timeout=30)
"""


def test_nodes_in_processes_one_sigkilled_the_rest_form_a_round_without_it(
    server: rdzv.StoreServer, children
) -> None:
    procs = [children.spawn(NODE, str(server.port), f"node{i}") for i in range(3)]
    _, _, elapsed = kill_the_top_rank(procs, 30)
    # Death is noticed after keep_alive_interval x keep_alive_max_attempt (0.6 s), plus
    # the last call (1 s); far below the join timeout.
    assert elapsed < 15, elapsed


def test_threads_share_nothing_but_the_server(server: rdzv.StoreServer) -> None:
    """Four nodes in threads of one process (each with its own connection)."""
    nodes = [node(server, "threads", f"t{i}", min_nodes=4, max_nodes=4) for i in range(4)]
    rounds = [None] * 4

    def wait(i: int) -> None:
        rounds[i] = nodes[i].next_round(timeout=20)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.rank for r in rounds) == [0, 1, 2, 3]
    for n in nodes:
        n.leave(timeout=10)
