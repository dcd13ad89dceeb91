"""rdzv.rendezvous for tcp://, env://, file:// and elastic://, with ranks in threads."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Dict, List

import pytest

import rdzv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, join: Callable[[int], rdzv.Rendezvous]) -> Dict[int, rdzv.Rendezvous]:
    """Runs `join(i)` for i in 0..n in threads; re-raises the first failure."""
    results: Dict[int, rdzv.Rendezvous] = {}
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = join(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def check_shared_store(results: Dict[int, rdzv.Rendezvous], world: int) -> None:
    assert sorted(r.rank for r in results.values()) == list(range(world))
    for i, r in results.items():
        assert r.world_size == world
        store, rank, world_size = r  # unpacks as torch's triplet
        assert (rank, world_size) == (r.rank, world)
        store.set(f"from/{rank}", str(rank))
    for r in results.values():
        assert sorted(r.store.multi_get([f"from/{i}" for i in range(world)])) == [
            str(i).encode() for i in range(world)
        ]


def test_tcp_rendezvous_rank0_hosts() -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    results = run_ranks(3, lambda i: rdzv.rendezvous(url, rank=i, world_size=3, timeout=30))
    check_shared_store(results, 3)
    assert all(r.elastic is None for r in results.values())


def test_env_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    results = run_ranks(2, lambda i: rdzv.rendezvous("env://", rank=i, world_size=2, timeout=30))
    check_shared_store(results, 2)


def test_file_rendezvous(tmp_path) -> None:
    url = f"file://{tmp_path / 'store'}"
    results = run_ranks(2, lambda i: rdzv.rendezvous(url, rank=i, world_size=2, timeout=30))
    check_shared_store(results, 2)


def test_elastic_rendezvous_url(server: rdzv.StoreServer) -> None:
    def join(i: int) -> rdzv.Rendezvous:
        return rdzv.rendezvous(
            f"elastic://127.0.0.1:{server.port}/url-run?nodes=2&last_call=100ms"
            f"&keep_alive_interval=200ms&node_id=n{i}",
            timeout=30,
        )

    results = run_ranks(2, join)
    check_shared_store(results, 2)
    for r in results.values():
        assert isinstance(r.elastic, rdzv.ElasticRendezvous)
        current = r.elastic.current()
        assert current is not None and current.rank == r.rank
    for r in results.values():
        assert r.elastic is not None and r.elastic.leave(timeout=10)


def test_unknown_scheme_and_bad_url_are_rendezvous_errors() -> None:
    with pytest.raises(rdzv.RendezvousError, match="No rendezvous handler for nope://"):
        rdzv.rendezvous("nope://x")
    with pytest.raises(rdzv.RendezvousError, match="port number missing"):
        rdzv.rendezvous("tcp://127.0.0.1", rank=0, world_size=1)


def test_tcp_rendezvous_times_out_without_peers() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(rdzv.RendezvousError) as info:
        rdzv.rendezvous(url, rank=0, world_size=2, timeout=0.5)
    assert isinstance(info.value, (rdzv.RendezvousTimeoutError, rdzv.RendezvousConnectionError))


def test_tcp_rank0_on_a_served_port_says_it_hosts_the_store(server: rdzv.StoreServer) -> None:
    # Rank 0 of tcp:// hosts the store, as torch's does: a URL naming a running server
    # cannot work, and the error says so and what to use (issue 36, item 4.4).
    with pytest.raises(rdzv.RendezvousConnectionError) as raised:
        rdzv.rendezvous(f"tcp://127.0.0.1:{server.port}?rank=0&world_size=1", timeout=5)
    text = str(raised.value)
    assert text.startswith(
        f"rank 0 hosts the store at 127.0.0.1:{server.port}; something already listens "
        "there: use a port nobody serves, or `rdzv.Store` to join an existing server ("
    ), text
    assert "\n" not in text, text
