"""rdzv.rpc, stage by stage: calls, payloads, errors, timeouts, dead peers, shutdown.

Workers are child processes (2 to 3) started by each test; each runs ``child_main`` of
this module (so that the functions called remotely, defined here, unpickle on every
worker), prints one JSON line with what it checked, and dies with the test process
(``PR_SET_PDEATHSIG``, conftest's ``children``). Tests of one process (the serializer,
the options, futures) need no agent. torch is not needed; nothing here uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import importlib, sys
sys.path.insert(0, {tests!r})
importlib.import_module({module!r}).child_main(sys.argv[1:])
"""

# ---------------------------------------------------------------------------------------
# Functions the workers call on each other.


def echo(x: Any) -> Any:
    return x


def digest(x: Any) -> str:
    return hashlib.sha256(memoryview(x).cast("B") if not isinstance(x, bytes) else x).hexdigest()


def whoami_and(x: Any) -> Any:
    import rdzv.rpc as rpc

    return (rpc.get_worker_info().name, x)


def relay(to: str, x: Any) -> Any:
    import rdzv.rpc as rpc

    return (rpc.get_worker_info().name, rpc.rpc_sync(to, whoami_and, args=(x,)))


def fail(text: str) -> None:
    raise ValueError(text)


class CustomError(Exception):
    pass


class TwoArgError(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


def fail_custom(text: str) -> None:
    raise CustomError(text)


def fail_two_args() -> None:
    raise TwoArgError("a", "b")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def add(a: Any, b: Any, scale: int = 1) -> Any:
    return (a + b) * scale


# ---------------------------------------------------------------------------------------
# Scenarios: run by rank 0 (the other ranks serve), each returns what it saw.


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


SIZES = [0, 1, 4095, 4096, 65537, 1 << 20, (1 << 20) + 7, 64 << 20]


def scenario_payloads(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    for n in SIZES:
        raw = pattern(n, n)
        data = raw.tobytes()
        back = rpc.rpc_sync("w1", echo, args=(data,))
        seen[f"bytes {n}"] = type(back) is bytes and back == data
        seen[f"bytes digest {n}"] = rpc.rpc_sync("w1", digest, args=(data,)) == digest(data)
        ba = bytearray(data)
        back = rpc.rpc_sync("w1", echo, args=(ba,))
        seen[f"bytearray {n}"] = type(back) is bytearray and back == ba
        back = rpc.rpc_sync("w1", echo, args=(raw,))
        seen[f"numpy {n}"] = (
            isinstance(back, np.ndarray) and back.dtype == np.uint8 and np.array_equal(back, raw)
        )
        if n >= 8:
            floats = raw[: n // 8 * 8].view(np.float64).reshape(-1, 1)
            back = rpc.rpc_async("w1", echo, args=({"a": floats, "b": [data]},)).wait()
            seen[f"nested numpy {n}"] = (
                back["a"].shape == floats.shape
                and back["a"].tobytes() == floats.tobytes()
                and back["b"] == [data]
            )
    # A Fortran-ordered and a non-contiguous array keep their values.
    fortran = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    back = rpc.rpc_sync("w1", echo, args=(fortran,))
    seen["fortran"] = np.array_equal(back, fortran) and back.flags.f_contiguous
    strided = np.arange(100, dtype=np.int64)[::3]
    seen["strided"] = np.array_equal(rpc.rpc_sync("w1", echo, args=(strided,)), strided)
    return seen


def scenario_nested(rpc: Any, world: int) -> Dict[str, Any]:
    payload = pattern(1 << 20, 3).tobytes()
    got = rpc.rpc_sync("w1", relay, args=("w2", payload))
    async_got = rpc.rpc_async("w1", relay, args=("w2", b"small")).wait()
    return {
        "sync": got[0] == "w1" and got[1][0] == "w2" and got[1][1] == payload,
        "async": async_got == ("w1", ("w2", b"small")),
    }


def scenario_errors(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    try:
        rpc.rpc_sync("w1", fail, args=("boom",))
        seen["value_error"] = "no exception"
    except ValueError as e:
        text = str(e)
        seen["value_error"] = (
            "On WorkerInfo(id=1, name=w1)" in text
            and "boom" in text
            and "in fail" in text
            and "Traceback" in text
        )
    try:
        rpc.rpc_async("w1", fail_custom, args=("custom",)).wait()
        seen["custom"] = "no exception"
    except CustomError as e:
        seen["custom"] = "custom" in str(e)
    try:
        rpc.rpc_sync("w1", fail_two_args)
        seen["two_args"] = "no exception"
    except RuntimeError as e:
        seen["two_args"] = "TwoArgError" in str(e) and "Failed to create" in str(e)
    # The worker that raised serves the next call.
    seen["after"] = rpc.rpc_sync("w1", add, args=(2, 3), kwargs={"scale": 2}) == 10
    try:
        rpc.rpc_sync("nobody", echo, args=(1,))
        seen["unknown"] = "no exception"
    except rpc.RpcUsageError as e:
        seen["unknown"] = "nobody" in str(e) and isinstance(e, RuntimeError)
    try:
        rpc.rpc_sync("w1", lambda: 1)
        seen["unpicklable"] = "no exception"
    except Exception as e:  # pickle's own error, raised here before anything is sent
        seen["unpicklable"] = "lambda" in str(e) or "pickle" in str(e).lower()
    return seen


def scenario_timeout(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    start = time.monotonic()
    try:
        rpc.rpc_sync("w1", time.sleep, args=(5,), timeout=0.5)
        seen["sync"] = "no exception"
    except rpc.RpcTimeoutError as e:
        text = str(e)
        seen["sync"] = (
            "RPC ran for more than set timeout" in text
            and "w1" in text
            and isinstance(e, RuntimeError)
            and isinstance(e, TimeoutError)
        )
    seen["sync_fast"] = time.monotonic() - start < 3
    future = rpc.rpc_async("w1", time.sleep, args=(5,), timeout=0.3)
    try:
        future.wait()
        seen["async"] = "no exception"
    except TimeoutError as e:
        seen["async"] = "RPC ran for more than set timeout" in str(e)
    seen["after"] = rpc.rpc_sync("w1", echo, args=("still here",)) == "still here"
    return seen


def scenario_killed(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    seen["before"] = rpc.rpc_sync("w1", echo, args=(1,)) == 1
    start = time.monotonic()
    try:
        rpc.rpc_async("w1", die).wait()
        seen["mid_call"] = "no exception"
    except rpc.RpcError as e:
        seen["mid_call"] = "w1" in str(e)
        seen["mid_call_class"] = type(e).__name__
    seen["fast"] = time.monotonic() - start < 10
    try:
        rpc.rpc_sync("w1", echo, args=(1,), timeout=5)
        seen["after"] = "no exception"
    except rpc.RpcError as e:
        seen["after"] = "w1" in str(e)
    start = time.monotonic()
    try:
        rpc.shutdown(graceful=True, timeout=2)
        seen["shutdown"] = "no exception"
    except rpc.RpcTimeoutError:
        # It names w1 when the failed calls are uncounted by then; the agent may still
        # count the last one for a moment ("calls were still in flight").
        seen["shutdown"] = True
    seen["shutdown_fast"] = time.monotonic() - start < 10
    return seen


def scenario_never_joins(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    seen["call"] = rpc.rpc_sync("w1", echo, args=(7,)) == 7
    start = time.monotonic()
    try:
        rpc.shutdown(timeout=2)
        seen["shutdown"] = "no exception"
    except rpc.RpcTimeoutError as e:
        seen["shutdown"] = "w1" in str(e)
    seen["shutdown_time"] = time.monotonic() - start < 10
    try:
        rpc.rpc_sync("w1", echo, args=(1,))
        seen["after"] = "no exception"
    except rpc.RpcUsageError as e:
        seen["after"] = "not been initialized" in str(e)
    return seen


def scenario_api(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    me = rpc.get_worker_info()
    seen["me"] = me == rpc.WorkerInfo("w0", 0) and repr(me) == "WorkerInfo(id=0, name=w0)"
    w1 = rpc.get_worker_info("w1")
    seen["w1"] = (w1.name, w1.id) == ("w1", 1)
    seen["timeout"] = rpc.get_rpc_timeout() == 20.0
    seen["by_id"] = rpc.rpc_sync(1, add, args=(1, 2)) == 3
    seen["by_info"] = rpc.rpc_sync(w1, add, args=("a", "b")) == "ab"
    seen["self"] = rpc.rpc_sync("w0", add, args=(2, 2)) == 4
    seen["info_arg"] = rpc.rpc_sync("w1", echo, args=(w1,)) == w1
    futures = [rpc.rpc_async("w1", add, args=(i, i)) for i in range(64)]
    seen["in_flight"] = rpc.wait_all(futures) == [2 * i for i in range(64)]
    chained = rpc.rpc_async("w1", add, args=(1, 1)).then(lambda f: f.value() * 10)
    seen["then"] = chained.wait() == 20
    failed = rpc.rpc_async("w1", fail, args=("x",)).then(lambda f: f.value())
    # A callback that raises fails the chained future. rdzv's own Future keeps the
    # exception; a torch.futures.Future (when torch is importable) turns it into
    # RuntimeError("Got the following error when running the callback: ValueError: …"),
    # as it does under torch.distributed.rpc.
    torch_future = type(failed).__module__.startswith("torch")
    try:
        failed.wait()
        seen["then_error"] = "no exception"
    except ValueError:
        seen["then_error"] = not torch_future or "ValueError raised under torch"
    except RuntimeError as e:
        seen["then_error"] = (torch_future and "ValueError: On WorkerInfo(id=1, name=w1)" in str(e)) or str(e)
    collected = rpc.collect_all([rpc.rpc_async("w1", echo, args=(i,)) for i in range(3)])
    seen["collect_all"] = [f.value() for f in collected.wait()] == [0, 1, 2]
    return seen


def scenario_env(rpc: Any, world: int) -> Dict[str, Any]:
    return {"call": rpc.rpc_sync("w1", add, args=(40, 2)) == 42}


def scenario_shutdown_in_callback(rpc: Any, world: int) -> Dict[str, Any]:
    import threading

    done = threading.Event()
    errors: List[str] = []

    def shut(_: Any) -> None:
        try:
            rpc.shutdown(graceful=False)
        except Exception as e:
            errors.append(repr(e))
        done.set()

    rpc.rpc_async("w0", add, args=(1, 1)).add_done_callback(shut)
    return {"returned": done.wait(20), "errors": errors == [] or errors}


LEAVE = threading.Event()


def leave() -> None:
    LEAVE.set()


def member(rpc: Any, name: str) -> bool:
    try:
        rpc.get_worker_info(name)
        return True
    except rpc.RpcUsageError:
        return False


def until(check: Callable[[], bool], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def scenario_dynamic(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {"joined": until(lambda: member(rpc, "w1"))}
    seen["call"] = rpc.rpc_sync("w1", add, args=(1, 2)) == 3
    # w1 leaves first: rank 0 hosts the store the group's token lives in.
    rpc.rpc_sync("w1", leave)
    seen["left"] = until(lambda: not member(rpc, "w1"))
    return seen


GATE = threading.Event()


def wait_gate() -> bool:
    return GATE.wait(20)


def open_gate() -> None:
    GATE.set()


def threads_here() -> Any:
    names = []
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def scenario_blocked(rpc: Any, world: int) -> Dict[str, Any]:
    """Functions that block: one waiting for a later call on the same pipe is read past
    (the reader that runs it hands the pipe to another thread), blocked ones run side by
    side up to num_worker_threads (4 here), and the threads that took over end."""
    seen: Dict[str, Any] = {}
    start = time.monotonic()
    waiting = rpc.rpc_async("w1", wait_gate)
    rpc.rpc_sync("w1", open_gate)
    seen["read_past"] = waiting.wait() is True
    seen["read_past_fast"] = time.monotonic() - start < 10
    threads = rpc.rpc_sync("w1", threads_here)
    took = []
    for _ in range(5):
        start = time.monotonic()
        rpc.wait_all([rpc.rpc_async("w1", time.sleep, args=(0.2,)) for _ in range(8)])
        took.append(time.monotonic() - start)
    # 8 sleeps of 0.2 s in 4 slots: two rounds each time, not eight (nor one).
    seen["side_by_side"] = all(0.35 < t < 1.2 for t in took) or took
    # One reader per pipe reads on; the readers it took over from leave once their
    # function returned (a reply can reach us a moment before its thread is gone).
    settled = until(lambda: len(rpc.rpc_sync("w1", threads_here)) <= len(threads) + 2, 5)
    seen["threads_end"] = settled or (threads, rpc.rpc_sync("w1", threads_here))
    seen["after"] = rpc.rpc_sync("w1", echo, args=(5,)) == 5
    return seen


SCENARIOS: Dict[str, Callable[[Any, int], Dict[str, Any]]] = {
    "blocked": scenario_blocked,
    "payloads": scenario_payloads,
    "nested": scenario_nested,
    "errors": scenario_errors,
    "timeout": scenario_timeout,
    "killed": scenario_killed,
    "never_joins": scenario_never_joins,
    "api": scenario_api,
    "env": scenario_env,
    "file": scenario_env,
    "dynamic": scenario_dynamic,
    "shutdown_in_callback": scenario_shutdown_in_callback,
}
# Scenarios whose rank 0 shuts down itself; the other ranks of "never_joins" never do.
SHUTS_DOWN = {"killed", "never_joins", "shutdown_in_callback"}


def child_main(
    argv: List[str],
    scenarios: Optional[Dict[str, Callable[[Any, int], Dict[str, Any]]]] = None,
    shuts_down: Optional[set] = None,
) -> None:
    """A worker: joins the group, runs ``scenario`` on rank 0, prints what it saw, shuts
    down (unless the scenario does, or is about a worker that never does)."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    shuts_down = SHUTS_DOWN if shuts_down is None else shuts_down
    scenario, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    import rdzv.rpc as rpc

    if scenario == "env":
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
        options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=20)
        rpc.init_rpc(f"w{rank}", rpc_backend_options=options, world_size=world)
    else:
        init_method = f"tcp://127.0.0.1:{port}"
        if scenario == "file":
            init_method = f"file://{os.environ['RDZV_TEST_FILE_STORE']}"
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, rpc_timeout=20, num_worker_threads=4
        )
        static = None if scenario == "dynamic" else world
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=static, rpc_backend_options=options)
    result = scenarios[scenario](rpc, world) if rank == 0 else None
    print(json.dumps({"rank": rank, "result": result}), flush=True)
    if scenario == "never_joins" and rank != 0:
        time.sleep(3600)
    if scenario == "dynamic" and rank != 0:
        LEAVE.wait(60)
    if scenario not in shuts_down or rank != 0:
        rpc.shutdown()


# ---------------------------------------------------------------------------------------
# The tests.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(
    children: Any,
    scenario: str,
    world: int,
    timeout: float = 120,
    wait: Optional[List[int]] = None,
    module: str = "test_rpc",
) -> Dict[str, Any]:
    """Runs ``scenario`` (of ``module``'s ``child_main``) on ``world`` workers; rank 0's
    result once the ranks in ``wait`` (default: all) have exited cleanly."""
    port = free_port()
    code = CHILD.format(tests=TESTS, module=module)
    procs = [children.spawn(code, scenario, str(r), str(world), str(port)) for r in range(world)]
    waited = range(world) if wait is None else wait
    outputs: Dict[int, Any] = {}
    for rank in waited:
        try:
            out, err = procs[rank].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stuck = "\n".join(
                f"--- worker {r} ---\n{children.stacks_and_kill(p)}" for r, p in enumerate(procs)
            )
            raise AssertionError(
                f"worker {rank} of {scenario!r} did not finish in {timeout}s; stacks:\n{stuck}"
            )
        assert procs[rank].returncode == 0, f"worker {rank} failed:\n{err}"
        outputs[rank] = json.loads(out.strip().splitlines()[-1])
    return {"result": outputs[0]["result"], "procs": procs}


def assert_all_true(seen: Dict[str, Any]) -> None:
    failed = {k: v for k, v in seen.items() if v is not True and not k.endswith("_class")}
    assert not failed, failed


def test_payloads_from_0_bytes_to_64_mib_arrive_byte_for_byte(children: Any) -> None:
    seen = run_group(children, "payloads", 2)["result"]
    assert {f"bytes {n}" for n in SIZES} <= set(seen)
    assert_all_true(seen)


def test_nested_calls_a_to_b_to_c(children: Any) -> None:
    assert_all_true(run_group(children, "nested", 3)["result"])


def test_a_remote_exception_fails_that_call_only(children: Any) -> None:
    assert_all_true(run_group(children, "errors", 2)["result"])


def test_a_timeout_says_so_and_the_worker_goes_on(children: Any) -> None:
    assert_all_true(run_group(children, "timeout", 2)["result"])


def test_a_peer_killed_mid_call_is_named(children: Any) -> None:
    group = run_group(children, "killed", 2, wait=[0])
    assert_all_true(group["result"])
    victim = group["procs"][1]
    victim.wait(timeout=10)
    assert victim.returncode == -signal.SIGKILL


def test_shutdown_names_a_peer_that_never_joins(children: Any) -> None:
    assert_all_true(run_group(children, "never_joins", 2, wait=[0])["result"])


def test_blocking_functions_are_read_past_and_run_side_by_side(children: Any) -> None:
    assert_all_true(run_group(children, "blocked", 2)["result"])


def test_worker_infos_async_calls_and_futures(children: Any) -> None:
    assert_all_true(run_group(children, "api", 2)["result"])


def test_shutdown_from_a_future_callback_returns(children: Any) -> None:
    assert_all_true(run_group(children, "shutdown_in_callback", 1)["result"])


def test_env_init_method(children: Any) -> None:
    assert_all_true(run_group(children, "env", 2)["result"])


def test_a_dynamic_group_without_world_size(children: Any) -> None:
    assert_all_true(run_group(children, "dynamic", 2)["result"])


def test_file_init_method(children: Any, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("RDZV_TEST_FILE_STORE", str(tmp_path / "store"))
    assert_all_true(run_group(children, "file", 2)["result"])


# --- One process, no agent. -------------------------------------------------------------


def test_large_bytes_and_arrays_travel_out_of_band() -> None:
    from rdzv.rpc import _serialize

    big = b"x" * 100_000
    array = np.arange(50_000, dtype=np.float32)
    args, kwargs = _serialize.lift_call((big, [big], array), {"k": bytearray(big)})
    payload, buffers = _serialize.dumps((echo, args, kwargs))
    assert len(payload) < 1000, len(payload)
    assert sorted(len(b) for b in buffers) == [100_000, 100_000, 100_000, 200_000]
    func, args, kwargs = _serialize.loads(payload, [bytearray(b) for b in buffers])
    assert func is echo
    assert args[0] == big and type(args[0]) is bytes
    assert args[1] == [big]
    assert np.array_equal(args[2], array)
    assert kwargs == {"k": bytearray(big)}
    # Small bytes stay in the pickle.
    payload, buffers = _serialize.dumps(_serialize.lift(b"small"))
    assert buffers == [] and pickle_loads(payload) == b"small"


def pickle_loads(payload: bytes) -> Any:
    import pickle

    return pickle.loads(payload)


def test_remote_exception_types_resolve_or_fall_back() -> None:
    from rdzv.rpc._serialize import RemoteException

    assert type(RemoteException("m", "builtins", "KeyError").to_exception()) is KeyError
    missing = RemoteException("text", "no_such_module", "Error").to_exception()
    assert type(missing) is RuntimeError and "text" in str(missing)


def test_options_take_torch_names() -> None:
    import rdzv.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8,
        rpc_timeout=5,
        init_method="tcp://127.0.0.1:1234",
        device_maps={"w1": {0: 1}},
        devices=["cuda:0"],
        _transports=["uv"],
        _channels=["basic"],
    )
    assert options.num_worker_threads == 8 and options.rpc_timeout == 5.0
    assert options.device_maps == {"w1": {"cuda:0": "cuda:1"}}
    assert options.devices == ["cuda:0"]
    assert options._transports == ["uv"] and options.transports == ["uv"]
    assert options._channels == ["basic"]
    options.set_device_map("w1", {"cuda:2": "cuda:3"})
    assert options.device_maps["w1"] == {"cuda:0": "cuda:1", "cuda:2": "cuda:3"}
    with pytest.raises(ValueError, match="1-to-1"):
        options.set_device_map("w1", {0: 2})
    with pytest.raises(ValueError, match="1-to-1"):
        options.set_device_map("w2", {0: 5, 1: 5})
    assert isinstance(rpc.RpcBackendOptions(), rpc.RpcBackendOptions)
    assert rpc.RpcBackendOptions().init_method == "env://"


def test_calls_before_init_say_so() -> None:
    import rdzv.rpc as rpc

    with pytest.raises(rpc.RpcUsageError, match="not been initialized"):
        rpc.rpc_sync("w1", echo, args=(1,))
    with pytest.raises(RuntimeError, match="not been initialized"):
        rpc.get_worker_info()


def test_error_classes_are_runtime_errors() -> None:
    import rdzv
    import rdzv.rpc as rpc

    assert issubclass(rpc.RpcTimeoutError, RuntimeError)
    assert issubclass(rpc.RpcTimeoutError, TimeoutError)
    assert issubclass(rpc.RpcConnectionError, ConnectionError)
    assert issubclass(rpc.RpcError, rdzv.RdzvError)


def test_backend_registry_has_tensorpipe_and_takes_new_backends() -> None:
    import rdzv.rpc as rpc
    from rdzv.rpc import backend_registry

    assert backend_registry.backend_registered("TENSORPIPE")
    options = backend_registry.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, rpc_timeout=3, init_method="tcp://127.0.0.1:1", num_worker_threads=2
    )
    assert isinstance(options, rpc.TensorPipeRpcBackendOptions)
    assert (options.rpc_timeout, options.num_worker_threads) == (3.0, 2)
    started = []
    custom = backend_registry.register_backend(
        "RDZV_TEST_BACKEND",
        lambda rpc_timeout, init_method, **kw: ("options", rpc_timeout, init_method),
        lambda *args: started.append(args),
    )
    assert custom.name == "RDZV_TEST_BACKEND" and rpc.BackendType.RDZV_TEST_BACKEND is custom
    assert rpc.BackendType.TENSORPIPE.name == "TENSORPIPE"
    with pytest.raises(RuntimeError, match="already registered"):
        backend_registry.register_backend("RDZV_TEST_BACKEND", print, print)
    rpc.init_rpc("w0", backend=custom, rank=0, world_size=1)
    assert started == [("w0", 0, 1, ("options", 60.0, "env://"))]


def test_torch_cpu_tensors_travel_out_of_band_as_tensors() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: CPU tensors untested")
    from rdzv.rpc import _serialize

    tensors = [
        torch.arange(1000, dtype=torch.float32).reshape(10, 100),
        torch.zeros(0, dtype=torch.int64),
        torch.arange(12, dtype=torch.float64)[::2],
        torch.ones(3, requires_grad=True),
        torch.tensor(7.5),
    ]
    payload, buffers = _serialize.dumps(tensors)
    assert len(buffers) == len(tensors)
    back = _serialize.loads(payload, [bytearray(b) for b in buffers])
    for sent, got in zip(tensors, back):
        assert isinstance(got, torch.Tensor) and got.dtype == sent.dtype
        assert got.shape == sent.shape and torch.equal(got.detach(), sent.detach())
        assert got.requires_grad == sent.requires_grad
