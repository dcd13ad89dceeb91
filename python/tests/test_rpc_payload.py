"""rdzv.rpc payloads without copies: large buffers are lent to the agent by address and
received buffers are handed to Python as ``ReceivedBuffer``\\ s that arrays wrap.

Workers are child processes, as in test_rpc.py (whose ``child_main`` and ``run_group``
this module reuses): rank 0 runs a scenario against rank 1 and prints what it saw. Each
scenario runs over shared memory with the ``cma`` channel (buffers lent to the peer) and
over TCP with the ``basic`` channel (buffers written inline from where they are), and
some over TCP with ``mpt`` (buffers striped over extra connections from where they are).
torch is not needed.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_rpc  # noqa: E402
from test_rpc import assert_all_true, echo, pattern, run_group  # noqa: E402

import dlpack_arrays  # noqa: E402
from dlpack_arrays import DLArray  # noqa: E402

from rdzv._rdzv import ReceivedBuffer  # noqa: E402
from rdzv.rpc import _serialize  # noqa: E402

PAIRS = {
    "shm": (["shm"], ["cma"]),
    "tcp": (["uv"], ["basic"]),
    "mpt": (["uv"], ["mpt_uv", "basic"]),
    "shm_basic": (["shm"], ["basic"]),
}

#: The transport and CPU channel each pair's pipe must negotiate (what the agent reports).
NEGOTIATED = {
    "shm": ("shm", "cma"),
    "tcp": ("tcp", "basic"),
    "mpt": ("tcp", "mpt"),
    "shm_basic": ("shm", "basic"),
}

# ---------------------------------------------------------------------------------------
# Functions the workers call on each other.


def digest_array(x: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def base_is_received(x: Any) -> bool:
    return _ends_at_received(x)


def bump_and_return(x: np.ndarray) -> np.ndarray:
    x += 1  # the received array is writable, as the bytearray used to be
    return x


class NoWayBack(dlpack_arrays.DLPackOnly):
    """A DLPack array whose module (this one) has no ``from_dlpack``: it arrives as numpy."""


class OnTheGpu:
    """A DLPack array that says it lives on CUDA device 0: the CPU cannot read it, so it
    travels by its own pickling (here, the bytes it holds)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("not readable from the CPU")

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (2, 0)

    def __reduce__(self) -> Any:
        return (OnTheGpu, (self.payload,))


def describe_dlpack(x: Any) -> Any:
    """What a DLPack array arrived as: its type and, for a ``DLArray``, its bytes'
    digest, dtype and shape."""
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    data = x.numpy() if isinstance(x, DLArray) else x
    return kind, digest_array(data), data.dtype.str, tuple(data.shape)


def _received_under(array: Any) -> Any:
    """The ``ReceivedBuffer`` at the end of ``array``'s ``base`` chain, or ``None``."""
    base = array
    for _ in range(8):
        if isinstance(base, ReceivedBuffer):
            return base
        base = getattr(base, "base", None)
        if base is None:
            return None
    return None


def _ends_at_received(array: Any) -> bool:
    return _received_under(array) is not None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------
# Scenarios, run by rank 0.

DTYPES = ["uint8", "int16", "int32", "float32", "float64", "complex128", "bool"]
SIZES = [0, 1, 1000, 16383, 16384, 65536 + 3, 1 << 20, 64 << 20]


def scenario_arrays(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    rng = np.random.default_rng(7)
    for dtype in DTYPES:
        for shape in [(0,), (5,), (3, 1000), (64, 65, 7), (512, 1024)]:
            if dtype == "bool":
                sent = rng.integers(0, 2, shape).astype(bool)
            else:
                sent = (rng.integers(0, 250, shape)).astype(dtype)
            back = rpc.rpc_sync("w1", echo, args=(sent,))
            seen[f"{dtype} {shape}"] = (
                isinstance(back, np.ndarray)
                and back.dtype == sent.dtype
                and back.shape == sent.shape
                and back.tobytes() == sent.tobytes()
            )
    return seen


def scenario_sizes(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    for n in SIZES:
        raw = pattern(n, n + 1)
        back = rpc.rpc_sync("w1", echo, args=(raw,))
        seen[f"numpy {n}"] = back.dtype == np.uint8 and np.array_equal(back, raw)
        data = raw.tobytes()
        back = rpc.rpc_sync("w1", echo, args=(data,))
        seen[f"bytes {n}"] = type(back) is bytes and back == data
        ba = bytearray(data)
        back = rpc.rpc_sync("w1", echo, args=(ba,))
        seen[f"bytearray {n}"] = type(back) is bytearray and back == ba
        view = memoryview(ba)
        back = rpc.rpc_sync("w1", echo, args=(view,))
        seen[f"memoryview {n}"] = type(back) is memoryview and back.tobytes() == data
    return seen


def scenario_layouts(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    big = np.arange(3 << 20, dtype=np.int32).reshape(1024, 3072)
    strided = big[::2, ::3]
    seen["non_contiguous"] = np.array_equal(rpc.rpc_sync("w1", echo, args=(strided,)), strided)
    fortran = np.asfortranarray(big)
    back = rpc.rpc_sync("w1", echo, args=(fortran,))
    seen["fortran"] = np.array_equal(back, fortran) and back.flags.f_contiguous
    readonly = np.arange(1 << 20, dtype=np.float64)
    readonly.flags.writeable = False
    seen["read_only_array"] = np.array_equal(rpc.rpc_sync("w1", echo, args=(readonly,)), readonly)
    data = pattern(1 << 20, 5).tobytes()
    view = memoryview(data)  # read-only, over bytes
    back = rpc.rpc_sync("w1", echo, args=(view,))
    seen["read_only_memoryview"] = back.tobytes() == data
    seen["digest"] = rpc.rpc_sync("w1", digest_array, args=(big,)) == digest_array(big)
    return seen


def scenario_no_copy(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    sent = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    back = rpc.rpc_sync("w1", echo, args=(sent,))
    seen["reply_base"] = _ends_at_received(back)
    seen["reply_writable"] = bool(back.flags.writeable)
    seen["request_base"] = rpc.rpc_sync("w1", base_is_received, args=(sent,))
    bumped = rpc.rpc_sync("w1", bump_and_return, args=(sent,))
    seen["remote_write"] = np.array_equal(bumped, sent + 1)
    # Small arrays arrive the same way.
    seen["small_base"] = _ends_at_received(rpc.rpc_sync("w1", echo, args=(np.ones(3),)))
    # The ReceivedBuffer under it says how long it is and copies out the same bytes.
    received = _received_under(back)
    seen["received_len"] = len(received) == back.nbytes
    seen["received_tobytes"] = received.tobytes() == back.tobytes()
    return seen


def scenario_sender_drops(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    futures = []
    expected = []
    for i in range(8):
        array = pattern(4 << 20, 100 + i)
        expected.append(array.copy())
        futures.append(rpc.rpc_async("w1", echo, args=(array,)))
        del array  # the agent keeps the memory alive while it sends
    gc.collect()
    results = [f.wait() for f in futures]
    seen["after_delete"] = all(np.array_equal(r, e) for r, e in zip(results, expected))
    data = pattern(8 << 20, 9).tobytes()
    future = rpc.rpc_async("w1", echo, args=(data,))
    copy = bytes(data)
    del data
    gc.collect()
    seen["bytes_after_delete"] = future.wait() == copy
    return seen


def scenario_in_flight(rpc: Any, world: int) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    arrays: List[np.ndarray] = [pattern((1 << 20) * (1 + i % 5) + i, i) for i in range(32)]
    futures = [rpc.rpc_async("w1", echo, args=((a, a[::-1].copy()),)) for a in arrays]
    ok = True
    for a, f in zip(arrays, futures):
        x, y = f.wait()
        ok = ok and np.array_equal(x, a) and np.array_equal(y, a[::-1])
    seen["many_in_flight"] = ok
    # Big buffers each way at once, from several threads.
    import threading

    errors: List[str] = []

    def hammer(seed: int) -> None:
        for k in range(4):
            a = pattern(6 << 20, seed * 10 + k)
            b = rpc.rpc_sync("w1", echo, args=(a,))
            if not np.array_equal(a, b):
                errors.append(f"thread {seed} call {k} came back different")

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen["threads"] = errors == [] or errors
    return seen


def scenario_memory(rpc: Any, world: int) -> Dict[str, Any]:
    array = pattern(8 << 20, 11)
    for _ in range(10):
        back = rpc.rpc_sync("w1", echo, args=(array,))
    del back
    gc.collect()
    before = _rss_bytes()
    ok = True
    for i in range(200):
        back = rpc.rpc_sync("w1", echo, args=(array,))
        if i % 50 == 0:
            ok = ok and np.array_equal(back, array)
        del back
    gc.collect()
    grown = _rss_bytes() - before
    # 200 round trips move 3.2 GiB; a leak of one buffer per call would be > 1 GiB.
    return {"equal": ok, "rss_growth_bounded": grown < (256 << 20) or f"grew {grown >> 20} MiB"}


def scenario_no_numpy(rpc: Any, world: int) -> Dict[str, Any]:
    """Sending and receiving on a worker where numpy is not imported: addresses come
    from ctypes (a read-only buffer that is not ``bytes`` is copied once), and received
    buffers become ctypes-backed views."""
    seen: Dict[str, Any] = {}
    data = bytes(range(256)) * 1024
    hidden = sys.modules["numpy"]
    sys.modules["numpy"] = None  # type: ignore[assignment]
    try:
        back = rpc.rpc_sync("w1", echo, args=(data,))
        seen["bytes"] = type(back) is bytes and back == data
        back = rpc.rpc_sync("w1", echo, args=(bytearray(data),))
        seen["bytearray"] = type(back) is bytearray and back == data
        back = rpc.rpc_sync("w1", echo, args=(memoryview(bytearray(data)).toreadonly(),))
        seen["read_only_view"] = type(back) is memoryview and back.tobytes() == data
        _, buffers = _serialize.dumps(memoryview(bytearray(data)))
        seen["lent_by_ctypes"] = _serialize.is_lent(buffers[0])
    finally:
        sys.modules["numpy"] = hidden
    return seen


def scenario_torch_tensors(rpc: Any, world: int) -> Dict[str, Any]:
    """CPU torch tensors of several dtypes and sizes (0 B to 64 MiB), a strided view, a
    tensor inside a dict, and which transport and channel carried them."""
    import torch

    seen: Dict[str, Any] = {}
    gen = torch.Generator().manual_seed(11)
    for dtype in [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                  torch.float32, torch.float64, torch.complex64, torch.bool]:
        for numel in [0, 7, 300_000, 8 << 20]:
            raw = torch.randint(0, 120, (numel,), generator=gen, dtype=torch.int64)
            sent = raw.to(dtype)
            back = rpc.rpc_sync("w1", echo, args=(sent,))
            seen[f"{dtype} x{numel}"] = (
                isinstance(back, torch.Tensor)
                and back.dtype == sent.dtype
                and back.shape == sent.shape
                and torch.equal(back, sent)
            )
    big = torch.arange(64 << 20, dtype=torch.uint8)  # wraps: 0..255 repeated
    seen["64 MiB"] = torch.equal(rpc.rpc_sync("w1", echo, args=(big,)), big)
    strided = torch.arange(3 << 20, dtype=torch.int32).reshape(1024, 3072)[::2, 1::3]
    back = rpc.rpc_sync("w1", echo, args=(strided,))
    seen["strided view"] = back.shape == strided.shape and torch.equal(back, strided)
    nested = {"w": torch.ones(5, 5), "b": [torch.zeros(3, dtype=torch.int8)], "n": 3}
    back = rpc.rpc_sync("w1", echo, args=(nested,))
    seen["in a dict"] = (
        set(back) == {"w", "b", "n"}
        and torch.equal(back["w"], nested["w"])
        and torch.equal(back["b"][0], nested["b"][0])
        and back["n"] == 3
    )
    agent = rpc._agent()
    seen["transport"] = agent.pipe_transport("w1")
    seen["channel"] = agent.pipe_channel("w1")
    seen["channel bytes"] = dict(agent.tensor_bytes_by_channel())
    return seen


def scenario_dlpack(rpc: Any, world: int) -> Dict[str, Any]:
    """Arrays of a library that speaks only DLPack (``dlpack_arrays``): several dtypes
    and shapes (0-d, empty, strided, 64 MiB) come back as that library's arrays, byte for
    byte; one whose library has no ``from_dlpack`` comes back as numpy; one on a GPU
    travels by its own pickling."""
    seen: Dict[str, Any] = {}
    rng = np.random.default_rng(5)
    cases = {
        "float32 (3, 1000)": rng.random((3, 1000), dtype=np.float32),
        "int64 0-d": np.array(7, dtype=np.int64),
        "uint8 empty": np.zeros((0, 4), dtype=np.uint8),
        "bool (65, 7)": rng.integers(0, 2, (65, 7)).astype(bool),
        "complex128 strided": (rng.random((200, 300)) + 1j)[::3, 1::2],
        "uint8 64 MiB": pattern(64 << 20, 3),
    }
    for name, data in cases.items():
        back = rpc.rpc_sync("w1", echo, args=(DLArray(data),))
        seen[f"{name} type"] = type(back) is DLArray
        if type(back) is DLArray:
            got = back.numpy()
            seen[f"{name} bytes"] = (
                got.dtype == data.dtype and got.shape == data.shape and np.array_equal(got, data)
            )
        kind, digest, dtype, shape = rpc.rpc_sync("w1", describe_dlpack, args=(DLArray(data),))
        seen[f"{name} at the callee"] = (
            kind == "dlpack_arrays.DLArray"
            and digest == digest_array(data)
            and dtype == data.dtype.str
            and shape == data.shape
        )
    nested = {"x": DLArray(np.arange(10.0)), "y": [DLArray(np.ones(3, dtype=np.int16))]}
    back = rpc.rpc_sync("w1", echo, args=(nested,))
    seen["in a dict"] = np.array_equal(back["x"].numpy(), np.arange(10.0)) and np.array_equal(
        back["y"][0].numpy(), np.ones(3, dtype=np.int16)
    )
    plain = np.arange(1 << 16, dtype=np.int32)
    back = rpc.rpc_sync("w1", echo, args=(NoWayBack(plain),))
    seen["no from_dlpack: numpy"] = type(back) is np.ndarray and np.array_equal(back, plain)
    back = rpc.rpc_sync("w1", echo, args=(OnTheGpu(b"device bytes"),))
    seen["gpu: own pickling"] = type(back) is OnTheGpu and back.payload == b"device bytes"
    return seen


SCENARIOS = {
    "dlpack": scenario_dlpack,
    "torch_tensors": scenario_torch_tensors,
    "no_numpy": scenario_no_numpy,
    "arrays": scenario_arrays,
    "sizes": scenario_sizes,
    "layouts": scenario_layouts,
    "no_copy": scenario_no_copy,
    "sender_drops": scenario_sender_drops,
    "in_flight": scenario_in_flight,
    "memory": scenario_memory,
}


def child_main(argv: List[str]) -> None:
    """A worker of ``scenario@pair``: test_rpc's worker, with the pair's transports."""
    name, pair = argv[0].split("@")
    import rdzv.rpc as rpc

    transports, channels = PAIRS[pair]
    original = rpc.TensorPipeRpcBackendOptions

    def options(**kwargs: Any) -> Any:
        return original(_transports=transports, _channels=channels, **kwargs)

    rpc.TensorPipeRpcBackendOptions = options  # type: ignore[assignment]
    try:
        test_rpc.child_main([name, *argv[1:]], scenarios=SCENARIOS, shuts_down=set())
    finally:
        rpc.TensorPipeRpcBackendOptions = original  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------
# The tests.


def run(children: Any, scenario: str, pair: str) -> Dict[str, Any]:
    return run_group(children, f"{scenario}@{pair}", 2, timeout=300, module="test_rpc_payload")[
        "result"
    ]


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_arrays_of_several_dtypes_and_shapes_echo_byte_for_byte(children: Any, pair: str) -> None:
    assert_all_true(run(children, "arrays", pair))


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_buffers_from_0_bytes_to_64_mib_echo_byte_for_byte(children: Any, pair: str) -> None:
    seen = run(children, "sizes", pair)
    assert {f"numpy {n}" for n in SIZES} <= set(seen)
    assert_all_true(seen)


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_non_contiguous_fortran_and_read_only_buffers(children: Any, pair: str) -> None:
    assert_all_true(run(children, "layouts", pair))


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_received_arrays_wrap_the_received_buffer(children: Any, pair: str) -> None:
    assert_all_true(run(children, "no_copy", pair))


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_buffers_survive_the_senders_delete(children: Any, pair: str) -> None:
    assert_all_true(run(children, "sender_drops", pair))


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_many_big_calls_in_flight_arrive_intact(children: Any, pair: str) -> None:
    assert_all_true(run(children, "in_flight", pair))


@pytest.mark.parametrize("pair", ["shm", "tcp"])
def test_dlpack_arrays_of_another_library_come_back_as_its_arrays(
    children: Any, pair: str
) -> None:
    assert_all_true(run(children, "dlpack", pair))


def test_a_worker_without_numpy_lends_by_ctypes(children: Any) -> None:
    assert_all_true(run(children, "no_numpy", "shm"))


@pytest.mark.parametrize("pair", ["mpt"])
def test_big_buffers_over_mpt(children: Any, pair: str) -> None:
    assert_all_true(run(children, "sizes", pair))
    assert_all_true(run(children, "in_flight", pair))


def test_memory_does_not_grow_over_200_round_trips_of_8_mib(children: Any) -> None:
    assert_all_true(run(children, "memory", "shm"))


# ---------------------------------------------------------------------------------------
# One process: the serializer's side of lending and receiving.


def test_large_buffers_are_lent_by_address_small_ones_copied() -> None:
    big = np.arange(1 << 16, dtype=np.float64)
    small = np.arange(10, dtype=np.float64)
    _, buffers = _serialize.dumps((big, small))
    lent, copied = buffers
    assert _serialize.is_lent(lent) and len(lent) == big.nbytes
    assert lent.address == big.__array_interface__["data"][0]
    assert isinstance(copied, memoryview) and copied.nbytes == small.nbytes
    # The owner keeps the array alive.
    del big
    gc.collect()
    assert np.frombuffer(lent.owner, dtype=np.float64)[-1] == (1 << 16) - 1


def test_a_read_only_bytes_buffer_is_lent_in_place() -> None:
    data = bytes(range(256)) * 256
    _, buffers = _serialize.dumps(memoryview(data))
    (lent,) = buffers
    assert _serialize.is_lent(lent) and lent.length == len(data)
    assert lent.address == ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert bytes(lent.owner) == data


def test_a_dlpack_array_is_lent_in_place_and_rebuilt_over_the_same_memory() -> None:
    data = np.arange(1 << 16, dtype=np.float64)
    sent = DLArray(data)
    payload, buffers = _serialize.dumps(sent)
    (lent,) = buffers
    assert _serialize.is_lent(lent) and lent.address == data.__array_interface__["data"][0]
    back = _serialize.loads(payload, buffers)
    assert type(back) is DLArray and np.shares_memory(back.numpy(), data)
    # A strided one is made contiguous (one copy) and keeps its shape.
    strided = np.arange(60, dtype=np.int8).reshape(6, 10)[:, ::3]
    back = _serialize.loads(*_serialize.dumps(DLArray(strided)))
    assert back.numpy().shape == (6, 4) and np.array_equal(back.numpy(), strided)


def test_a_dlpack_array_without_numpy_uses_its_own_pickling() -> None:
    """Without numpy imported, DLPack arrays are not looked into: one with no pickling
    of its own fails as pickle says, one with its own travels by it."""
    hidden = sys.modules["numpy"]
    sys.modules["numpy"] = None  # type: ignore[assignment]
    try:
        with pytest.raises(TypeError, match="only by DLPack"):
            _serialize.dumps(DLArray(hidden.arange(3)))
        back = _serialize.loads(*_serialize.dumps(OnTheGpu(b"x")))
        assert type(back) is OnTheGpu and back.payload == b"x"
    finally:
        sys.modules["numpy"] = hidden


def test_a_dlpack_type_that_is_gone_arrives_as_numpy() -> None:
    """The receiver looks for ``from_dlpack`` where the type lives; a module it cannot
    import leaves a numpy array over the bytes."""
    data = np.arange(12, dtype=np.uint16).reshape(3, 4)
    payload, buffers = _serialize.dumps(DLArray(data))
    payload = payload.replace(b"dlpack_arrays", b"no_such_lib_x")
    back = _serialize.loads(payload, buffers)
    assert type(back) is np.ndarray and np.array_equal(back, data)
    assert _serialize._dlpack_target("dlpack_arrays", "DLArray") is dlpack_arrays.from_dlpack


def test_a_cuda_tensor_is_refused_with_torchs_text() -> None:
    """A CUDA tensor is refused as torch refuses one no device map applies to (device
    maps are not applied from Python yet): pickled, it would land on its old device
    index. Only ``tensor.device`` is looked at, so a stand-in tensor serves here, where
    there is neither torch nor a GPU."""

    class Device:
        type = "cuda"

        def __str__(self) -> str:
            return "cuda:1"

    class OnCuda:
        device = Device()

    with pytest.raises(RuntimeError, match="only supports CPU tensors by default") as refused:
        _serialize._reduce_tensor(None, OnCuda())
    assert "tensor.cpu()" in str(refused.value) and "cuda:1" in str(refused.value)


def test_loads_takes_back_what_dumps_lent() -> None:
    value = {"a": np.arange(1 << 15, dtype=np.int64), "b": memoryview(bytearray(b"z" * 20000))}
    back = _serialize.loads(*_serialize.dumps(value))
    assert np.array_equal(back["a"], value["a"])
    assert bytes(back["b"]) == bytes(value["b"])


@pytest.mark.parametrize("pair", sorted(NEGOTIATED))
def test_torch_tensors_over_every_transport_and_channel(children: Any, pair: str) -> None:
    """CPU torch tensors over tcp/basic, shm/cma, shm/basic and tcp/mpt (the transports
    and channels this host has; ibv runs in the Soft-RoCE VM, CUDA on the GPU host)."""
    pytest.importorskip("torch", reason="torch is not installed: CPU torch tensors over each "
                        "transport and channel are checked where it is")
    seen = run(children, "torch_tensors", pair)
    transport, channel = NEGOTIATED[pair]
    assert (seen.pop("transport"), seen.pop("channel")) == (transport, channel)
    sent = seen.pop("channel bytes")
    assert sent.get(channel, 0) >= 64 << 20, f"{channel} carried {sent}"
    assert_all_true(seen)
