"""rdzv.rpc's ``remote`` and ``RRef``: values kept on their owner, fetched, changed
through the proxies, passed on to a third worker, counted and released; and the testing
helpers (``rdzv.rpc.testing``) that count them. Workers are child processes, as in
``test_rpc.py`` (whose harness this uses)."""

from __future__ import annotations

import time
from typing import Any, Dict

import test_rpc
from test_rpc import add, assert_all_true, fail, run_group


class Counter:
    def __init__(self, start: int) -> None:
        self.count = start

    def increment(self, by: int = 1) -> int:
        self.count += by
        return self.count

    def value(self) -> int:
        return self.count


def fetch(rref: Any) -> Any:
    """On a third worker: what an RRef passed to it says and holds."""
    return (rref.is_owner(), rref.owner_name(), rref.to_here().count)


def on_owner(rref: Any) -> Any:
    """On the owner: the RRef passed back to it is the owner's, with the live object."""
    return (rref.is_owner(), rref.local_value().increment(100))


def on_owner_via(rref: Any) -> int:
    """On a user: asks the owner to change the object through the RRef's proxy."""
    return rref.rpc_sync().increment(100)


def owned_count() -> int:
    from rdzv.rpc import _rref

    return len(_rref.OWNED)


def make_rref(to: str) -> Any:
    import rdzv.rpc as rpc

    return rpc.remote(to, Counter, args=(1,))


def wait_for(check: Any, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def scenario_rref(rpc: Any, world: int) -> Dict[str, Any]:
    from rdzv.rpc import testing

    seen: Dict[str, Any] = {}
    rref = rpc.remote("w1", add, args=(1, 2))
    seen["to_here"] = rref.to_here() == 3
    seen["owner"] = rref.owner() == rpc.WorkerInfo("w1", 1) and rref.owner_name() == "w1"
    seen["is_owner"] = rref.is_owner() is False
    seen["confirmed"] = wait_for(rref.confirmed_by_owner)
    try:
        rref.local_value()
        seen["local_value_user"] = "no exception"
    except RuntimeError as e:
        seen["local_value_user"] = "w1" in str(e)

    counter = rpc.remote("w1", Counter, args=(5,))
    seen["proxy_sync"] = counter.rpc_sync().increment(2) == 7
    seen["proxy_async"] = counter.rpc_async().increment().wait() == 8
    seen["proxy_remote"] = counter.remote().value().to_here() == 8
    seen["live_to_here"] = counter.to_here().count == 8
    seen["on_owner"] = rpc.rpc_sync("w1", on_owner, args=(counter,)) == (True, 108)
    seen["third_worker"] = rpc.rpc_sync("w2", fetch, args=(counter,)) == (False, "w1", 108)
    returned = rpc.rpc_sync("w2", make_rref, args=("w1",))
    seen["returned_rref"] = returned.owner_name() == "w1" and returned.to_here().count == 1

    failed = rpc.remote("w1", fail, args=("remote boom",))
    try:
        failed.to_here()
        seen["remote_exception"] = "no exception"
    except ValueError as e:
        seen["remote_exception"] = "remote boom" in str(e)

    mine = rpc.remote("w0", Counter, args=(3,))
    seen["self_owner"] = mine.is_owner() and mine.local_value().increment() == 4
    seen["self_to_here"] = mine.to_here().count == 4

    # RRef(value), torch's local owner RRef: the object itself, passed on like any RRef.
    held = Counter(20)
    local = rpc.RRef(held)
    seen["local_rref_holds_the_object"] = local.is_owner() and local.local_value() is held
    seen["local_rref_owner"] = local.owner() == rpc.get_worker_info()
    seen["local_rref_passed_on"] = rpc.rpc_sync("w2", fetch, args=(local,)) == (False, "w0", 20)
    seen["local_rref_back_to_owner"] = rpc.rpc_sync("w1", on_owner_via, args=(local,)) == 120
    del local, held

    # w1 owns rref, counter, returned's value and failed's.
    testing.wait_until_pending_futures_and_users_flushed()
    seen["owners"] = testing.get_num_owners_and_forks(1)[0] == 4
    del rref, counter, returned, failed, mine
    testing.wait_until_owners_and_forks_on_rank(0, 0, 1, timeout=20)
    seen["released_on_owner"] = wait_for(lambda: rpc.rpc_sync("w1", owned_count) == 0)
    seen["released_here"] = wait_for(lambda: owned_count() == 0)
    return seen


def die_later() -> None:
    import os
    import signal
    import threading

    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def scenario_node_failure(rpc: Any, world: int) -> Dict[str, Any]:
    from rdzv.rpc import testing

    rpc.rpc_sync("w1", die_later)
    text = testing.wait_until_node_failure(1, "w1", timeout=20)
    try:
        rpc.shutdown(graceful=False)
        shut = True
    except Exception as e:
        shut = str(e)
    return {"node_failure": "w1" in text, "shutdown": shut}


SCENARIOS = {"rref": scenario_rref, "node_failure": scenario_node_failure}


class DistInitCase:
    """A test class as torch's ``dist_utils.dist_init`` expects one."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.init_method = f"tcp://127.0.0.1:{port}"

    def run(self) -> Any:
        from rdzv.rpc import testing

        @testing.dist_init
        def body(case: "DistInitCase") -> Any:
            import rdzv.rpc as rpc

            peer = testing.worker_name((case.rank + 1) % case.world_size)
            got = rpc.rpc_sync(peer, add, args=(case.rank, 10))
            testing.wait_until_pending_futures_and_users_flushed()
            return {"call": got == case.rank + 10, "me": rpc.get_worker_info().name}

        return body(self)


def child_main(argv: Any) -> None:
    if argv[0] == "dist_init":
        import json

        import rdzv.rpc as rpc

        rank, world, port = int(argv[1]), int(argv[2]), int(argv[3])
        seen = DistInitCase(rank, world, port).run()
        seen["shut_down"] = _not_initialized(rpc)
        print(json.dumps({"rank": rank, "result": seen}), flush=True)
        return
    test_rpc.child_main(argv, SCENARIOS, {"node_failure"})


def _not_initialized(rpc: Any) -> bool:
    try:
        rpc.get_worker_info()
    except rpc.RpcUsageError:
        return True
    return False


def test_remote_rrefs_proxies_forks_and_release(children: Any) -> None:
    assert_all_true(run_group(children, "rref", 3, module="test_rpc_rref")["result"])


def test_wait_until_node_failure(children: Any) -> None:
    group = run_group(children, "node_failure", 2, module="test_rpc_rref", wait=[0])
    assert_all_true(group["result"])


def test_dist_init_runs_a_test_between_init_and_shutdown(children: Any) -> None:
    seen = run_group(children, "dist_init", 2, module="test_rpc_rref")["result"]
    assert seen == {"call": True, "me": "worker0", "shut_down": True}, seen
