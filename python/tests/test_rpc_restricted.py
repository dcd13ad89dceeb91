"""rdzv.rpc's restricted mode: registered functions called by name, plain data and arrays,
and no pickle on a restricted worker, even for a peer that joined the group.

Workers are child processes started by each test (the pattern of ``test_rpc.py``): rank 1
runs in restricted mode (``init_rpc(..., restricted=True)``, or the options'
``restricted``) and serves the functions
registered below; rank 0 runs the scenario and prints one JSON line with what it saw.
The codec tests at the bottom need no agent. torch is not needed.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
from typing import Any, Dict, List

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import importlib, sys
sys.path.insert(0, {tests!r})
importlib.import_module({module!r}).child_main(sys.argv[1:])
"""

# ---------------------------------------------------------------------------------------
# Functions the restricted worker serves (registered on every worker, so that callers
# may pass the function object too).


def echo(x: Any) -> Any:
    return x


def add(a: Any, b: Any, scale: int = 1) -> Any:
    return (a + b) * scale


def fail(text: str) -> None:
    raise ValueError(text)


def describe(array: np.ndarray) -> Dict[str, Any]:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "sum": float(array.sum())}


def unregistered(x: Any) -> Any:
    return x


def register_all() -> None:
    import rdzv.rpc as rpc

    rpc.register("echo", echo)
    rpc.register("add", add)
    rpc.register("describe", describe)

    @rpc.registered("fail")
    def _fail(text: str) -> None:
        fail(text)


def _write_marker(path: str) -> None:
    with open(path, "w") as f:
        f.write("unpickled")


class Evil:
    """Pickles to a call of ``_write_marker``: unpickling it writes the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (_write_marker, (self.path,))


# ---------------------------------------------------------------------------------------
# Scenarios (rank 0).


def arrays() -> List[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal((3, 4)).astype(np.float32),
        np.arange(24, dtype=np.int64).reshape(2, 3, 4),
        np.array(5, dtype=np.int16),
        np.zeros((0, 3), dtype=np.float64),
        np.array([True, False, True]),
        np.arange(10, dtype=np.uint8)[::2],  # not contiguous
        (rng.standard_normal(5) + 1j).astype(np.complex64),
        np.arange(6, dtype=">i4"),  # big-endian: arrives as the same numbers
    ]


def scenario_values(rpc: Any) -> Dict[str, Any]:
    seen: Dict[str, Any] = {"restricted here": rpc.is_restricted()}
    values: List[Any] = [
        None,
        True,
        False,
        0,
        -(2**63),
        2**63 - 1,
        1.5,
        float("inf"),
        "",
        "héllo wörld",
        b"",
        b"\x00\x80\xff" * 1000,
        [1, [2, [3, []]]],
        {"a": 1, "b": {"c": [1.5, "x", None]}, 3: b"k"},
        (1, "two", (3.0,)),
    ]
    for i, value in enumerate(values):
        back = rpc.rpc_sync("w1", "echo", args=(value,))
        seen[f"value {i} {type(value).__name__}"] = back == value and type(back) is type(value)
    seen["bytearray arrives as bytes"] = rpc.rpc_sync("w1", "echo", args=(bytearray(b"ab"),)) == b"ab"
    seen["kwargs"] = rpc.rpc_sync("w1", "add", args=(2,), kwargs={"b": 3, "scale": 10}) == 50
    seen["by function object"] = rpc.rpc_sync("w1", add, args=(1, 2)) == 3
    seen["async"] = rpc.rpc_async("w1", "add", args=("a", "b")).wait() == "ab"
    for i, array in enumerate(arrays()):
        back = rpc.rpc_sync("w1", "echo", args=(array,))
        seen[f"array {i} {array.dtype}{array.shape}"] = (
            isinstance(back, np.ndarray)
            and back.dtype == array.dtype.newbyteorder("=")
            and back.shape == array.shape
            and back.tobytes() == np.ascontiguousarray(array, dtype=back.dtype).tobytes()
        )
    try:
        import torch
    except ImportError:
        torch = None  # without torch, numpy arrays only: no torch check is recorded
    if torch is not None:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            tensor = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
            back = rpc.rpc_sync("w1", "echo", args=(tensor,))
            seen[f"torch {dtype}"] = (
                isinstance(back, torch.Tensor)
                and back.dtype == dtype
                and back.shape == tensor.shape
                and torch.equal(back, tensor)
            )
    nested = rpc.rpc_sync("w1", "echo", args=({"x": [arrays()[0], {"y": arrays()[1]}]},))
    seen["arrays nested in a dict"] = np.array_equal(nested["x"][0], arrays()[0]) and np.array_equal(
        nested["x"][1]["y"], arrays()[1]
    )
    seen["array argument used remotely"] = rpc.rpc_sync("w1", "describe", args=(arrays()[1],)) == {
        "dtype": "int64",
        "shape": [2, 3, 4],
        "sum": float(np.arange(24).sum()),
    }

    try:
        rpc.rpc_sync("w1", "no_such_function", args=(1,))
        seen["unregistered refused"] = "no error"
    except Exception as e:
        text = str(e)
        seen["unregistered refused"] = "no_such_function" in text and "register" in text
    try:
        rpc.rpc_sync("w1", unregistered, args=(1,))
        seen["unregistered function object refused here"] = "no error"
    except ValueError as e:
        seen["unregistered function object refused here"] = "not registered" in str(e)
    try:
        rpc.rpc_sync("w1", "fail", args=("boom",))
        seen["remote exception"] = "no error"
    except ValueError as e:
        text = str(e)
        seen["remote exception"] = "On WorkerInfo(id=1, name=w1)" in text and "boom" in text
    try:
        rpc.rpc_sync("w1", "echo", args=(object(),))
        seen["unsupported type refused"] = "no error"
    except TypeError as e:
        seen["unsupported type refused"] = "object" in str(e)
    try:
        rpc.rpc_sync("w1", "echo", args=(2**64,))
        seen["int out of range refused"] = "no error"
    except ValueError as e:
        seen["int out of range refused"] = "out of range" in str(e)
    try:
        rpc.rpc_sync("w1", "echo", args=(np.array([object()]),))
        seen["object array refused"] = "no error"
    except TypeError as e:
        seen["object array refused"] = "dtype" in str(e)
    try:
        rpc.remote("w1", "echo", args=(1,))
        seen["remote() refused"] = "no error"
    except RuntimeError as e:
        seen["remote() refused"] = "restricted mode" in str(e)
    seen["still serving"] = rpc.rpc_sync("w1", "echo", args=("after",)) == "after"
    return seen


def scenario_pickle_refused(rpc: Any) -> Dict[str, Any]:
    """Rank 0 is not restricted: it sends pickles, to itself (which unpickles: the probe
    works) and to the restricted rank 1 (which must not)."""
    marker = os.environ["RDZV_TEST_MARKER"]
    seen: Dict[str, Any] = {"restricted here": rpc.is_restricted() is False}
    rpc.rpc_sync("w0", echo, args=(Evil(marker + ".self"),))
    seen["the probe writes its marker when unpickled"] = os.path.exists(marker + ".self")
    try:
        rpc.rpc_sync("w1", echo, args=(Evil(marker),))
        seen["pickled call refused"] = "no error"
    except RuntimeError as e:
        seen["pickled call refused"] = "restricted mode" in str(e) and "w1" in str(e)
    try:
        rpc.remote("w1", echo, args=(Evil(marker),)).to_here()
        seen["pickled remote() refused"] = "no error"
    except Exception as e:
        seen["pickled remote() refused"] = "restricted mode" in str(e)
    agent = rpc._agent()
    for i, junk in enumerate([b"", b"RDZV-R1", b"RDZV-R1C\x04echo\x08\xff\xff\xff\xff", b"\x80\x05."]):
        try:
            rpc._reply_value(agent.call("w1", b"", junk, [], 20))
            seen[f"junk {i} refused"] = "no error"
        except (RuntimeError, ValueError) as e:  # refused, or malformed (ValueError)
            seen[f"junk {i} refused"] = "restricted" in str(e)
    seen["no marker: nothing was unpickled"] = not os.path.exists(marker)
    # A non-restricted worker calls a registered function by name: a restricted call.
    seen["still serving by name"] = rpc.rpc_sync("w1", "add", args=(20, 22)) == 42
    return seen


SCENARIOS = {"values": scenario_values, "pickle_refused": scenario_pickle_refused}


def child_main(argv: List[str]) -> None:
    scenario, rank, port = argv[0], int(argv[1]), int(argv[2])
    import rdzv.rpc as rpc

    register_all()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=20,
        num_worker_threads=4,
        restricted=rank == 1 and scenario == "pickle_refused",
    )
    if rank == 1 and scenario == "pickle_refused":
        # Restricted through the options: RpcBackendOptions(restricted=True).
        rpc.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options)
    elif rank == 1:
        rpc.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options, restricted=True)
    else:
        if scenario == "values":
            os.environ["RDZV_RPC_RESTRICTED"] = "1"
        rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=options)
    result = SCENARIOS[scenario](rpc) if rank == 0 else None
    print(json.dumps({"rank": rank, "result": result}), flush=True)
    rpc.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(children: Any, scenario: str, timeout: float = 120) -> Dict[str, Any]:
    port = free_port()
    code = CHILD.format(tests=TESTS, module="test_rpc_restricted")
    procs = [children.spawn(code, scenario, str(r), str(port)) for r in range(2)]
    outputs = {}
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except Exception:
            raise AssertionError(f"worker {rank} of {scenario!r} did not finish in {timeout}s")
        assert proc.returncode == 0, f"worker {rank} failed:\n{err}"
        outputs[rank] = json.loads(out.strip().splitlines()[-1])
    return outputs[0]["result"]


def assert_all_true(seen: Dict[str, Any]) -> None:
    failed = {k: v for k, v in seen.items() if v is not True}
    assert not failed, failed


def test_registered_functions_with_values_and_arrays(children: Any) -> None:
    assert_all_true(run_group(children, "values"))


def test_a_pickled_call_is_refused_and_never_unpickled(
    children: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    marker = str(tmp_path / "unpickled")
    monkeypatch.setenv("RDZV_TEST_MARKER", marker)
    assert_all_true(run_group(children, "pickle_refused"))
    assert not os.path.exists(marker)


# ---------------------------------------------------------------------------------------
# The codec and the handler, in this process (no agent).


def test_serve_refuses_a_pickle_without_unpickling_it(tmp_path: Any) -> None:
    from rdzv.rpc import _restricted

    marker = tmp_path / "unpickled"
    payload = pickle.dumps((echo, (Evil(str(marker)),), {}), protocol=5)
    metadata, reply, buffers = _restricted.serve("WorkerInfo(id=1, name=w1)", payload, [])
    assert metadata == b"E" and buffers == []
    with pytest.raises(RuntimeError, match="restricted mode"):
        _restricted.reply_value(reply, [])
    assert not marker.exists()


def test_call_round_trip_and_limits() -> None:
    from rdzv import _rdzv
    from rdzv.rpc import _restricted

    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    payload, buffers = _restricted.dumps_call("f", (1, [array], {"k": b"v"}), {"x": None})
    assert payload.startswith(b"RDZV-R1") and len(buffers) == 1
    kind, name, args, kwargs = _rdzv.restricted_decode(
        payload, _restricted._tensor_maker([bytearray(b) for b in buffers])
    )
    assert (kind, name, kwargs) == ("call", "f", {"x": None})
    assert args[0] == 1 and args[2] == {"k": b"v"}
    assert np.array_equal(args[1][0], array) and args[1][0].dtype == array.dtype

    with pytest.raises(ValueError, match="does not start with"):
        _rdzv.restricted_decode(pickle.dumps(1), lambda *a: None)
    with pytest.raises(ValueError, match="truncated"):
        _rdzv.restricted_decode(payload[:-1], lambda *a: None)
    deep: Any = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        _restricted.dumps_call("f", (deep,), {})
    loop: List[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="deeper"):
        _restricted.dumps_call("f", (loop,), {})
    with pytest.raises(ValueError, match="printable"):
        _restricted.dumps_call("bad\nname", (), {})
    # A buffer of the wrong size for its dtype and shape is refused, not read past.
    with pytest.raises(ValueError, match="needs 96 bytes"):
        _rdzv.restricted_decode(payload, _restricted._tensor_maker([bytearray(8)]))
    with pytest.raises(ValueError, match="1 buffers|0 buffers"):
        _rdzv.restricted_decode(payload, _restricted._tensor_maker([]))


def test_numpy_scalars_arrive_as_the_numpy_scalars_they_were() -> None:
    from rdzv import _rdzv
    from rdzv.rpc import _restricted

    sent = [
        np.float32(1.5),
        np.float64(-2.25),  # a float subclass: still a numpy scalar
        np.int64(-7),
        np.uint8(255),
        np.bool_(True),
        np.complex64(1 - 2j),
        np.float16(0.5),
        np.array(3.0, dtype=">f8"),  # a 0-d array stays an array, in native order
        2.5,  # a plain float stays a float
    ]
    payload, buffers = _restricted.dumps_call("f", tuple(sent), {})
    _, _, args, _ = _rdzv.restricted_decode(
        payload, _restricted._tensor_maker([bytearray(b) for b in buffers])
    )
    assert len(args) == len(sent)
    for got, want in zip(args, sent):
        assert type(got) is type(want), (got, want)
        assert got == want
        if isinstance(want, (np.generic, np.ndarray)):
            assert got.dtype == want.dtype.newbyteorder("=")
    # Core's dtype list is the one Python checks against.
    assert _restricted._DTYPES == frozenset(_rdzv.RESTRICTED_DTYPES)
    assert "float32" in _rdzv.RESTRICTED_DTYPES
    with pytest.raises(TypeError, match="numpy scalar of dtype"):
        _restricted.dumps_call("f", (np.datetime64("2026-12-02"),), {})


def test_register_validates_names() -> None:
    import rdzv.rpc as rpc

    with pytest.raises(ValueError):
        rpc.register("", echo)
    with pytest.raises(ValueError):
        rpc.register("x" * 129, echo)
    with pytest.raises(TypeError):
        rpc.register("not_callable", 3)  # type: ignore[arg-type]
    rpc.register("test.echo", echo)
    assert rpc._restricted.name_of(echo) == "test.echo"
    rpc.unregister("test.echo")
    with pytest.raises(ValueError, match="not registered"):
        rpc._restricted.name_of(echo)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
