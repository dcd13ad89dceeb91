"""The exception classes: their bases, and that each failure raises the right one."""

from __future__ import annotations

import pytest

import rdzv


@pytest.mark.parametrize(
    "cls, bases",
    [
        (rdzv.StoreError, (rdzv.RdzvError,)),
        (rdzv.StoreTimeoutError, (rdzv.StoreError, TimeoutError)),
        (rdzv.StoreConnectionError, (rdzv.StoreError, ConnectionError)),
        (rdzv.StoreQueueEmptyError, (rdzv.StoreError,)),
        (rdzv.StoreServerError, (rdzv.RdzvError, OSError)),
        (rdzv.RendezvousError, (rdzv.RdzvError,)),
        (rdzv.RendezvousClosedError, (rdzv.RendezvousError,)),
        (rdzv.RendezvousTimeoutError, (rdzv.RendezvousError, TimeoutError)),
        (rdzv.RendezvousConnectionError, (rdzv.RendezvousError, ConnectionError)),
        (rdzv.RendezvousStateError, (rdzv.RendezvousError,)),
        (rdzv.RendezvousGracefulExitError, (rdzv.RendezvousError,)),
    ],
)
def test_class_hierarchy(cls: type, bases: tuple) -> None:
    for base in bases:
        assert issubclass(cls, base), (cls, base)
    assert issubclass(cls, Exception)
    assert cls.__doc__


def test_errors_raised_by_the_extension_are_these_classes(store: rdzv.Store) -> None:
    with pytest.raises(rdzv.StoreTimeoutError):
        store.wait(["nothing"], timeout=0.05)
    with pytest.raises(rdzv.StoreQueueEmptyError):
        store.queue_pop("empty", block=False)
    # Like PyTorch's server, rdzv's closes the connection of an ADD to a non-counter.
    store.set("word", b"abc")
    with pytest.raises(rdzv.StoreError):
        store.clone().add("word", 1)


def test_timeouts_must_be_seconds_or_timedelta(store: rdzv.Store) -> None:
    with pytest.raises(TypeError, match="timedelta"):
        store.wait(["k"], timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        store.set_timeout(-1)


def test_version_matches_the_package_metadata() -> None:
    from importlib import metadata

    assert rdzv.__version__ == metadata.version("rdzv")


def test_errors_print_under_the_public_module(store: rdzv.Store) -> None:
    for name in rdzv._errors.__all__:
        assert getattr(rdzv, name).__module__ == "rdzv", name
    with pytest.raises(rdzv.StoreTimeoutError) as raised:
        store.wait(["nothing"], timeout=0.05)
    assert type(raised.value).__module__ == "rdzv"
    assert "rdzv.StoreTimeoutError" in str(raised.getrepr())


def test_reprs_are_python_syntax(server: rdzv.StoreServer) -> None:
    assert repr(rdzv.Store("127.0.0.1", server.port, timeout=5)) == (
        f"Store(host='127.0.0.1', port={server.port})"
    )
    assert repr(server).startswith(f"StoreServer(host='127.0.0.1', port={server.port}, io='")
    assert repr(server).endswith(", running=True)")


def test_a_rendezvous_tcp_store_says_where_it_is() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = rdzv.rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", timeout=10)
    assert repr(r.store) == f"Store(host='127.0.0.1', port={port})"
