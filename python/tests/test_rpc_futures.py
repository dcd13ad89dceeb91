"""rdzv.rpc's futures without torch (``rdzv.rpc.futures.Future``, ``wait_all``,
``collect_all``), and, where torch can be imported, that ``rpc_async`` hands out real
``torch.futures.Future`` objects. The calls themselves are tested in ``test_rpc.py``."""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any, List

import pytest

from rdzv.rpc import futures
from rdzv.rpc.futures import Future, collect_all, wait_all

HAS_TORCH = importlib.util.find_spec("torch") is not None


def completed_later(value: Any, delay: float = 0.05) -> Future:
    future: Future = Future()

    def complete() -> None:
        time.sleep(delay)
        future.set_result(value)

    threading.Thread(target=complete, daemon=True).start()
    return future


def test_wait_value_done() -> None:
    future = completed_later(5)
    assert not future.done()
    with pytest.raises(RuntimeError, match="before the future completed"):
        future.value()
    assert future.wait() == 5
    assert future.done() and future.value() == 5


def test_set_exception_is_raised_by_wait_and_value() -> None:
    future: Future = Future()
    future.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        future.wait()
    with pytest.raises(KeyError):
        future.value()
    with pytest.raises(TypeError):
        Future().set_exception("not an exception")  # type: ignore[arg-type]


def test_a_future_completes_once() -> None:
    future: Future = Future()
    future.set_result(1)
    with pytest.raises(RuntimeError, match="only be marked completed once"):
        future.set_result(2)
    with pytest.raises(RuntimeError, match="only be marked completed once"):
        future.set_exception(ValueError())
    assert future.wait() == 1


def test_then_chains_values_and_errors() -> None:
    first: Future = Future()
    chained = first.then(lambda f: f.value() + 1).then(lambda f: f.value() * 10)
    failing = first.then(lambda f: 1 / 0)
    recovered = failing.then(lambda f: "recovered" if isinstance(_error(f), ZeroDivisionError) else "no")
    first.set_result(1)
    assert chained.wait() == 20
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert recovered.wait() == "recovered"
    # On a completed future, the callback runs at once.
    assert first.then(lambda f: f.value() - 1).wait() == 0


def _error(future: Future) -> Any:
    try:
        future.value()
    except BaseException as e:
        return e
    return None


def test_add_done_callback_runs_once_and_ignores_errors() -> None:
    future: Future = Future()
    seen: List[Any] = []
    future.add_done_callback(lambda f: seen.append(f.value()))
    future.add_done_callback(lambda f: 1 / 0)  # logged, ignored
    future.add_done_callback(lambda f: seen.append("second"))
    future.set_result("v")
    future.add_done_callback(lambda f: seen.append("late"))
    assert seen == ["v", "second", "late"]


def test_collect_all_and_wait_all() -> None:
    pending = [completed_later(i, 0.01 * (3 - i)) for i in range(3)]
    everything = collect_all(pending)
    assert [f.value() for f in everything.wait()] == [0, 1, 2]
    assert wait_all([completed_later("a"), completed_later("b")]) == ["a", "b"]
    assert collect_all([]).wait() == []
    failed: Future = Future()
    failed.set_exception(ValueError("first"))
    later_failed: Future = Future()
    later_failed.set_exception(KeyError("second"))
    with pytest.raises(ValueError, match="first"):
        wait_all([completed_later(1), failed, later_failed])


def test_new_future_is_rdzvs_without_torch() -> None:
    if HAS_TORCH:
        pytest.skip("torch is importable here: new_future makes torch futures (tested below)")
    assert isinstance(futures.new_future(), Future)
    assert futures.torch_futures() is None


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed: rdzv's own Future is used")
def test_with_torch_rpc_async_futures_are_torch_futures() -> None:
    import torch

    future = futures.new_future()
    assert isinstance(future, torch.futures.Future)
    future.set_result(3)
    assert torch.futures.wait_all([future]) == [3]
    assert future.then(lambda f: f.value() + 1).wait() == 4
    assert wait_all([future]) == [3]
    assert [f.value() for f in collect_all([future]).wait()] == [3]
