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
