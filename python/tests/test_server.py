"""rdzv.StoreServer: start, serve, stop, refuse a taken port."""

from __future__ import annotations

import threading
import time

import pytest

import rdzv


def test_server_picks_a_free_port_serves_and_stops() -> None:
    srv = rdzv.StoreServer(host="127.0.0.1", port=0)
    assert srv.running
    assert 0 < srv.port < 65536
    assert srv.io in ("io-uring", "epoll")
    client = rdzv.Store("127.0.0.1", srv.port, timeout=5)
    client.set("k", b"v")
    assert client.get("k") == b"v"
    stats = srv.stats()
    assert stats["keys"] >= 1 and stats["connections"] >= 1
    srv.stop()
    assert not srv.running
    srv.stop()  # idempotent
    with pytest.raises(rdzv.StoreConnectionError):
        rdzv.Store("127.0.0.1", srv.port, timeout=0.3)
    with pytest.raises(rdzv.StoreServerError):
        srv.stats()


def test_server_as_context_manager_stops_on_exit() -> None:
    with rdzv.StoreServer(host="127.0.0.1", port=0, threads=2, io="epoll") as srv:
        assert srv.io == "epoll"
        rdzv.Store("127.0.0.1", srv.port, timeout=5).set("a", "b")
        port = srv.port
    assert not srv.running
    with pytest.raises(ConnectionError):
        rdzv.Store("127.0.0.1", port, timeout=0.3)


def test_dual_stack_default_host_none() -> None:
    with rdzv.StoreServer(host=None, port=0) as srv:
        assert srv.host is None
        assert rdzv.Store("127.0.0.1", srv.port, timeout=5).add("c", 2) == 2


def test_taken_port_raises_store_server_error(server: rdzv.StoreServer) -> None:
    with pytest.raises(rdzv.StoreServerError) as info:
        rdzv.StoreServer(host="127.0.0.1", port=server.port)
    assert isinstance(info.value, OSError)
    assert str(server.port) in str(info.value) or "in use" in str(info.value).lower()


def test_unknown_io_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown store I/O mode"):
        rdzv.StoreServer(port=0, io="kqueue")


def test_blocking_calls_release_the_gil(store: rdzv.Store) -> None:
    """A thread blocked in wait() must not stop this thread from running Python."""
    done = threading.Event()

    def waiter() -> None:
        store.clone().wait(["late"], timeout=10)
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    # While the waiter blocks in Rust, this thread keeps counting.
    deadline = time.monotonic() + 0.3
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    assert spins > 1000
    assert not done.is_set()
    store.set("late", b"1")
    thread.join(timeout=10)
    assert done.is_set()
