"""Restricted mode: calls by registered name, with plain data, and no pickle anywhere.

A restricted call names a function by the name it was registered under
(:func:`register`) and carries its arguments, its result and its exception as plain data
(``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``
with ``str`` or ``int`` keys, numpy arrays and scalars, and CPU torch tensors), encoded by
:mod:`rdzv_core::rpc::restricted` (``_rdzv.restricted_*``). Arrays and tensors travel out
of band, as the message's buffers, with their dtype and shape in the payload.

A worker in restricted mode checks a request's first bytes for ``RDZV-R1`` before anything
else and refuses anything else (a pickle is never unpickled), and refuses names nobody
registered. Any worker serves restricted calls of registered functions.
"""

from __future__ import annotations

import builtins
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

from .. import _rdzv
from ._serialize import _received as received_view

MAGIC: bytes = _rdzv.RESTRICTED_MAGIC
#: The environment variable that turns restricted mode on at ``init_rpc`` (``1``).
ENV = "RDZV_RPC_RESTRICTED"

_lock = threading.Lock()
_by_name: Dict[str, Callable[..., Any]] = {}
_by_function: Dict[Any, str] = {}

#: numpy's and torch's names of the dtypes a restricted message carries (core's list).
_DTYPES = frozenset(_rdzv.RESTRICTED_DTYPES)


def register(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Registers ``fn`` as ``name`` (1 to 128 printable ASCII characters): peers may call
    it by that name in restricted mode. Registering a name again replaces its function."""
    _rdzv.restricted_validate_name(name)
    if not callable(fn):
        raise TypeError(f"register({name!r}, ...): fn must be callable, not {type(fn).__name__}")
    with _lock:
        old = _by_name.get(name)
        if old is not None:
            _by_function.pop(old, None)
        _by_name[name] = fn
        try:
            _by_function[fn] = name
        except TypeError:  # unhashable callable: callable by name only
            pass
    return fn


def registered(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@registered("name")``: :func:`register` as a decorator."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return register(name, fn)

    return decorate


def unregister(name: str) -> None:
    """Forgets ``name`` (no error if it was not registered)."""
    with _lock:
        fn = _by_name.pop(name, None)
        if fn is not None:
            try:
                _by_function.pop(fn, None)
            except TypeError:
                pass


def name_of(func: Any) -> str:
    """The registered name a call of ``func`` (a name or a registered function) sends."""
    if isinstance(func, str):
        _rdzv.restricted_validate_name(func)
        return func
    try:
        with _lock:
            name = _by_function.get(func)
    except TypeError:
        name = None
    if name is None:
        raise ValueError(
            f"restricted-mode RPC calls functions by registered name; "
            f"{getattr(func, '__qualname__', repr(func))} is not registered here. "
            f"Register it on both workers with rdzv.rpc.register(name, fn) and pass the name."
        )
    return name


def _tensor_hook(obj: Any) -> Optional[Tuple[str, str, Tuple[int, ...], Any]]:
    """A numpy array or CPU torch tensor as ``(framework, dtype, shape, buffer)``; ``None``
    for anything else."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.generic):
        if obj.dtype.name not in _DTYPES:
            raise TypeError(
                f"restricted-mode RPC: numpy scalar of dtype {obj.dtype} is not carried "
                f"(one of {sorted(_DTYPES)})"
            )
        scalar = np.asarray(obj).astype(obj.dtype.newbyteorder("<"))
        return ("numpy-scalar", obj.dtype.name, (), memoryview(scalar.reshape(-1).view(np.uint8)))
    if np is not None and isinstance(obj, np.ndarray):
        if obj.dtype.name not in _DTYPES:
            raise TypeError(
                f"restricted-mode RPC: numpy dtype {obj.dtype} is not carried "
                f"(one of {sorted(_DTYPES)})"
            )
        # Not np.ascontiguousarray, which makes a 0-d array 1-d.
        array = obj if obj.flags.c_contiguous else obj.copy(order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        raw = memoryview(array.reshape(-1).view(np.uint8))
        return ("numpy", array.dtype.name, tuple(array.shape), raw)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).rsplit(".", 1)[-1]
        if (
            obj.device.type != "cpu"
            or obj.layout != torch.strided
            or obj.is_quantized
            or dtype not in _DTYPES
        ):
            raise TypeError(
                f"restricted-mode RPC carries dense CPU tensors of {sorted(_DTYPES)}, "
                f"not {obj.dtype} on {obj.device} ({obj.layout})"
            )
        raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ("torch", dtype, tuple(obj.shape), memoryview(raw))
    return None


def _tensor_maker(buffers: Sequence[Any]) -> Callable[[str, str, Tuple[int, ...], int], Any]:
    def make(framework: str, dtype: str, shape: Tuple[int, ...], index: int) -> Any:
        if index >= len(buffers):
            raise ValueError(
                f"restricted-mode RPC: tensor {index} referenced, the message has "
                f"{len(buffers)} buffers"
            )
        # A received buffer (a ReceivedBuffer) as a byte view over it, without a copy.
        buffer = received_view(buffers[index])
        count = 1
        for d in shape:
            count *= d
        if framework == "torch":
            import torch

            torch_dtype = getattr(torch, dtype)
            size = torch.empty((), dtype=torch_dtype).element_size()
            _check_size(buffer, count, size, dtype, shape)
            if count == 0:
                return torch.empty(shape, dtype=torch_dtype)
            return torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).reshape(shape)
        import numpy as np

        if dtype == "bfloat16":
            raise ValueError("restricted-mode RPC: numpy has no bfloat16 arrays")
        np_dtype = np.dtype(dtype).newbyteorder("<")
        _check_size(buffer, count, np_dtype.itemsize, dtype, shape)
        array = np.frombuffer(buffer, dtype=np_dtype).reshape(shape)
        if framework == "numpy-scalar":
            # The scalar's own value, in the native byte order (a copy of a few bytes).
            return array.astype(np.dtype(dtype))[()]
        return array

    return make


def _check_size(buffer: Any, count: int, size: int, dtype: str, shape: Tuple[int, ...]) -> None:
    have = len(memoryview(buffer))
    if have != count * size:
        raise ValueError(
            f"restricted-mode RPC: a {dtype} tensor of shape {shape} needs {count * size} "
            f"bytes, its buffer has {have}"
        )


def dumps_call(
    name: str, args: Optional[Sequence[Any]], kwargs: Optional[Dict[str, Any]]
) -> Tuple[bytes, List[Any]]:
    """A restricted call of ``name``: ``(payload, buffers)``."""
    return _rdzv.restricted_encode_call(name, tuple(args or ()), dict(kwargs or {}), _tensor_hook)


def is_restricted(payload: Any) -> bool:
    """Whether ``payload`` is in the restricted format (its first bytes only)."""
    return bytes(payload[: len(MAGIC)]) == MAGIC


def _exception_reply(type_name: str, message: str) -> Tuple[bytes, bytes, List[Any]]:
    return (b"E", _rdzv.restricted_encode_exception(type_name, message), [])


def refuse_unrestricted(me: str) -> Tuple[bytes, bytes, List[Any]]:
    """The reply to a request that is not in the restricted format (a pickled call, a
    ``remote()``): an error, without reading the request further."""
    return _exception_reply(
        "RuntimeError",
        f"On {me}:\nthis worker runs rdzv.rpc in restricted mode and accepts only calls of "
        f"registered functions by name (payloads starting with {MAGIC.decode()}); "
        f"it refused a request in another format (a pickled call or remote()) without "
        f"reading it. Call a registered function by name: rpc_sync(to, 'name', args=...).",
    )


def serve(me: str, payload: Any, buffers: Sequence[Any]) -> Tuple[bytes, bytes, List[Any]]:
    """Runs one restricted call on this worker: the reply's ``(metadata, payload,
    buffers)``; a refusal or the function's exception as an exception reply."""
    if not is_restricted(payload):
        return refuse_unrestricted(me)
    try:
        decoded = _rdzv.restricted_decode(bytes(payload), _tensor_maker(buffers))
        if decoded[0] != "call":
            raise ValueError(f"restricted-mode RPC: expected a call, got a {decoded[0]} payload")
        _, name, args, kwargs = cast(Tuple[str, str, Tuple[Any, ...], Dict[str, Any]], decoded)
        with _lock:
            fn = _by_name.get(name)
        if fn is None:
            raise LookupError(
                f"restricted-mode RPC: no function is registered as {name!r} on this worker; "
                f"register it with rdzv.rpc.register({name!r}, fn) before callers use it"
            )
        result = fn(*args, **kwargs)
        reply, out = _rdzv.restricted_encode_value(result, _tensor_hook)
    except BaseException as exc:  # the caller re-raises it; the worker goes on
        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return _exception_reply(type(exc).__qualname__, f"On {me}:\n{exc!r}\n{lines}")
    return (b"", reply, list(out))


def _exception(type_name: str, message: str) -> BaseException:
    """The exception a caller raises: the builtin exception class of that name (looked up
    in ``builtins`` only, never imported), else ``RuntimeError``, with the remote text."""
    kind = getattr(builtins, type_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return RuntimeError(f"{type_name}: {message}")


def reply_value(payload: Any, buffers: Sequence[Any]) -> Any:
    """A restricted reply's value, or raises its exception."""
    decoded = _rdzv.restricted_decode(bytes(payload), _tensor_maker(buffers))
    if decoded[0] == "value":
        return decoded[1]
    if decoded[0] == "exception":
        _, type_name, message = cast(Tuple[str, str, str], decoded)
        raise _exception(type_name, message)
    raise ValueError("restricted-mode RPC: a reply holds a call")
