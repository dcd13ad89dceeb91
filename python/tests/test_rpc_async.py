"""``rdzv.rpc.functions.async_execution``: a remote function that answers with a future's
value when it completes, without holding a worker thread meanwhile; nested calls chained
with ``then``; errors through the future. Workers are child processes, as in
``test_rpc.py`` (whose harness this uses; each worker runs 4 handler threads)."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict

import test_rpc
from test_rpc import add, assert_all_true, run_group

from rdzv.rpc.functions import async_execution
from rdzv.rpc.futures import new_future


@async_execution
def chained_add(to: str, x: int) -> Any:
    import rdzv.rpc as rpc

    return rpc.rpc_async(to, add, args=(x, 1)).then(lambda f: f.value() * 2)


@async_execution
def sleep_then(seconds: float, value: Any) -> Any:
    future = new_future()
    threading.Timer(seconds, lambda: future.set_result(value)).start()
    return future


@async_execution
def failing_later() -> Any:
    future = new_future()
    threading.Timer(0.05, lambda: future.set_exception(KeyError("later"))).start()
    return future


@async_execution
def not_a_future() -> Any:
    return 42


def scenario_async(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    seen["chained"] = rpc.rpc_sync("w1", chained_add, args=("w2", 3)) == 8
    seen["direct_call_is_the_function"] = chained_add.__name__ == "chained_add"
    # Twice as many calls as w1 has handler threads, each pending 1 s: none holds a
    # thread, so all end in about 1 s, not 2.
    start = time.monotonic()
    futures = [rpc.rpc_async("w1", sleep_then, args=(1.0, i)) for i in range(8)]
    seen["values"] = rpc.wait_all(futures) == list(range(8))
    elapsed = time.monotonic() - start
    seen["no_thread_held"] = elapsed < 1.9 or elapsed
    try:
        rpc.rpc_sync("w1", failing_later)
        seen["error"] = "no exception"
    except KeyError as e:
        seen["error"] = "later" in str(e)
    try:
        rpc.rpc_sync("w1", not_a_future)
        seen["not_a_future"] = "no exception"
    except TypeError as e:
        seen["not_a_future"] = "must return a future" in str(e)
    seen["remote"] = rpc.remote("w1", chained_add, args=("w2", 10)).to_here() == 22
    seen["then_on_caller"] = (
        rpc.rpc_async("w1", add, args=(1, 2)).then(lambda f: f.value() + 1).then(
            lambda f: f.value() * 3
        ).wait()
        == 12
    )
    return seen


def child_main(argv: Any) -> None:
    test_rpc.child_main(argv, {"async": scenario_async}, set())


def test_async_execution_answers_later_without_a_thread(children: Any) -> None:
    assert_all_true(run_group(children, "async", 3, module="test_rpc_async")["result"])
