"""Every rdzv.Store operation, against the in-process server."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import rdzv


def test_set_get_bytes_and_str(store: rdzv.Store) -> None:
    store.set("b", b"\x00\xffbytes")
    store.set("s", "text é")
    assert store.get("b") == b"\x00\xffbytes"
    assert store.get("s") == "text é".encode()
    store.set("b", bytearray(b"again"))
    assert store.get("b") == b"again"


def test_set_refuses_other_types(store: rdzv.Store) -> None:
    with pytest.raises(TypeError, match="bytes or str"):
        store.set("k", 12)  # type: ignore[arg-type]


def test_add_counts_from_zero_and_returns_new_value(store: rdzv.Store) -> None:
    assert store.add("n", 1) == 1
    assert store.add("n", 41) == 42
    assert store.add("n", -2) == 40
    assert store.get("n") == b"40"


def test_add_on_a_non_counter_is_a_store_error(store: rdzv.Store) -> None:
    store.set("text", b"not a number")
    with pytest.raises(rdzv.StoreError):
        store.clone().add("text", 1)


def test_compare_set_cases(store: rdzv.Store) -> None:
    # Missing key, expected empty: created.
    assert store.compare_set("cs", b"", b"first") == b"first"
    # Expected matches: replaced.
    assert store.compare_set("cs", b"first", b"second") == b"second"
    # Expected does not match: unchanged, the current value comes back.
    assert store.compare_set("cs", b"nope", b"third") == b"second"
    # Missing key, expected not empty: torch returns the expected value.
    assert store.compare_set("missing", b"x", b"y") == b"x"
    assert not store.check(["missing"])


def test_wait_check_and_timeout(store: rdzv.Store) -> None:
    assert not store.check(["w1", "w2"])
    store.set("w1", b"1")
    assert not store.check(["w1", "w2"])
    threading.Timer(0.1, lambda: store.clone().set("w2", b"2")).start()
    store.wait(["w1", "w2"], timeout=5)
    assert store.check(["w1", "w2"])
    with pytest.raises(rdzv.StoreTimeoutError) as info:
        store.wait(["never"], timeout=timedelta(milliseconds=100))
    assert isinstance(info.value, TimeoutError)
    assert "never" in str(info.value)


def test_get_waits_up_to_the_store_timeout(store: rdzv.Store) -> None:
    store.set_timeout(timedelta(milliseconds=150))
    assert store.timeout == pytest.approx(0.15)
    with pytest.raises(rdzv.StoreTimeoutError) as raised:
        store.get("absent")
    # It says the caller's get, the key as given (no leading "/"), and the timeout.
    assert str(raised.value) == (
        "get of key \"absent\": no such key after waiting 150 ms (the store's timeout; "
        "set_timeout() or Store(timeout=...) changes it)"
    )
    store.set_timeout(5)
    assert store.timeout == 5.0


def test_delete_key_and_num_keys(store: rdzv.Store) -> None:
    before = store.num_keys()
    store.set("d1", b"x")
    store.set("d2", b"y")
    assert store.num_keys() == before + 2
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert store.num_keys() == before + 1


def test_multi_get_and_multi_set(store: rdzv.Store) -> None:
    store.multi_set(["m1", "m2", "m3"], [b"a", "b", b"c"])
    assert store.multi_get(["m3", "m1", "m2"]) == [b"c", b"a", b"b"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["x", "y"], [b"1"])


def test_append(store: rdzv.Store) -> None:
    store.append("log", b"a")
    store.append("log", "b")
    store.append("log", b"c")
    assert store.get("log") == b"abc"


def test_queue_push_pop_len(store: rdzv.Store) -> None:
    assert store.queue_len("q") == 0
    store.queue_push("q", b"one")
    store.queue_push("q", "two")
    assert store.queue_len("q") == 2
    assert store.queue_pop("q") == b"one"
    assert store.queue_pop("q", block=False) == b"two"
    with pytest.raises(rdzv.StoreQueueEmptyError):
        store.queue_pop("q", block=False)
    threading.Timer(0.1, lambda: store.clone().queue_push("q", b"late")).start()
    assert store.queue_pop("q", block=True) == b"late"


def test_list_keys(store: rdzv.Store) -> None:
    store.set("lk/a", b"1")
    store.set("lk/b", b"2")
    keys = store.list_keys()
    assert {"lk/a", "lk/b"} <= set(keys)


def test_barrier_releases_all_callers(store: rdzv.Store) -> None:
    released = []

    def member(i: int) -> None:
        store.clone().barrier("bar", 3, timeout=10)
        released.append(i)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert sorted(released) == [0, 1, 2]


def test_clone_ping_and_stats(server: rdzv.StoreServer, store: rdzv.Store) -> None:
    other = store.clone()
    assert (other.host, other.port) == ("127.0.0.1", server.port)
    other.ping()
    before = store.stats()
    store.set("st", b"x")
    store.add("st2", 1)
    after = store.stats()
    assert after["requests"]["SET"] == before["requests"]["SET"] + 1
    assert after["requests"]["ADD"] == before["requests"]["ADD"] + 1
    assert after["bytes_in"] > before["bytes_in"]
    assert after["connections"] >= 2
    assert "Store(host=" in repr(store)


def test_a_torch_style_client_sees_the_same_keys(server: rdzv.StoreServer) -> None:
    a = rdzv.Store("127.0.0.1", server.port, timeout=5)
    b = rdzv.Store("localhost", server.port, timeout=5)
    a.set("shared", b"1")
    assert b.get("shared") == b"1"


def test_lost_server_is_a_connection_error() -> None:
    srv = rdzv.StoreServer(host="127.0.0.1", port=0)
    client = rdzv.Store("127.0.0.1", srv.port, timeout=5)
    client.set("k", b"v")
    srv.stop()
    with pytest.raises(rdzv.StoreConnectionError) as info:
        client.get("k")
    assert isinstance(info.value, ConnectionError)
