"""How calls and results are pickled: protocol 5, with the bulk bytes out of band.

``dumps`` returns the pickle and a list of buffers. The buffers become the agent
message's tensors, which travel beside the pickle over the agent's channels (shared
memory, cross-memory attach, striped TCP), never copied into the pickle:

- numpy arrays (their protocol-5 reduction hands out a ``PickleBuffer``), ``PickleBuffer``
  objects and ``memoryview``\\ s, anywhere in the object;
- CPU ``torch.Tensor``\\ s anywhere in the object, when torch is imported (reduced by
  ``reducer_override``; the receiver gets a tensor of the same dtype, shape and
  ``requires_grad``); a CUDA tensor is refused with torch's text, device maps not being
  applied from Python yet;
- CPU DLPack arrays of other libraries (any object with ``__dlpack__`` and
  ``__dlpack_device__`` on a CPU device), when numpy is imported: taken as a numpy array
  over the same memory (``numpy.from_dlpack``, no copy). The receiver gets the sender's
  type back where that type, its module or its top-level package has a ``from_dlpack``
  (called with a numpy array over the received bytes), and a numpy array otherwise. A
  DLPack array on a GPU, or of a dtype numpy lacks, is pickled by its own reduction;
- ``bytes`` and ``bytearray`` of at least :data:`OUT_OF_BAND_BYTES`, when they are an
  argument, a keyword argument's value or the result, or an item of such a list, tuple or
  dict (of up to :data:`LIFTED_ITEMS` items). pickle writes these types in-band without
  consulting any hook, so only these positions are looked at; elsewhere they are pickled
  in-band.

The receiver gets the type that was sent: ``bytes`` stays ``bytes``, a numpy array a numpy
array, a tensor a tensor.

**No copies of large buffers.** An out-of-band buffer of at least :data:`LENT_BYTES` is
lent to the agent by address (``dumps`` lists it as a :func:`lent` buffer): the agent's
channels read it where it is, and its owner (a ``memoryview`` of it) keeps the memory
alive until the agent is done with it. As with torch.distributed.rpc, **do not
modify an array, tensor or buffer you passed to** ``rpc_sync``, ``rpc_async`` or
``remote`` **(or returned from a remote function) until the call has completed**: the
agent may still be reading it, and the peer would receive torn bytes. Deleting it is
fine. A read-only buffer whose address cannot be read (no numpy imported, and not a
``bytes`` object) is copied once. Smaller buffers are copied.

A received buffer is an ``rdzv._rdzv.ReceivedBuffer``, which owns the bytes the agent
received; ``loads`` hands it to the reconstructors as a ``uint8`` numpy array over it
(``numpy.asarray``, no copy; a ``memoryview`` by ctypes when numpy is not imported), so
received numpy arrays and torch tensors wrap the received memory, and their ``base``
chain ends at the ``ReceivedBuffer``. ``bytes`` and ``bytearray`` are copied out of it
once. When the last object over it goes, the agent reuses the memory for its next large
receive.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import pickle
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._rdzv import ReceivedBuffer as _ReceivedBuffer

__all__ = ["dumps", "loads", "lift", "lift_call", "dumps_exception", "RemoteException"]

#: ``bytes`` and ``bytearray`` at least this long travel out of band (where looked at).
OUT_OF_BAND_BYTES = 4096
#: Containers of at most this many items are looked into for ``bytes`` to lift.
LIFTED_ITEMS = 64
#: Out-of-band buffers at least this long are lent to the agent by address, not copied.
LENT_BYTES = 16 * 1024



def lent(address: int, length: int, owner: memoryview) -> Any:
    """An out-of-band buffer lent to the agent: a ctypes ``char`` array over the
    ``length`` bytes at ``address`` (so that it is bytes-like, ``len()`` included, like
    the views ``dumps`` lists), with attributes ``address``, ``length`` and ``owner`` (a
    ``memoryview`` of the bytes, which keeps them alive while the agent reads them in
    place)."""
    array: Any = (ctypes.c_char * length).from_address(address)
    array.address = address
    array.length = length
    array.owner = owner
    return array


def is_lent(buffer: Any) -> bool:
    """Whether ``buffer`` is one that :func:`lent` made."""
    return isinstance(buffer, ctypes.Array) and hasattr(buffer, "owner")


#: What ``dumps`` lists per buffer: a ``memoryview`` (copied by the agent) or a
#: :func:`lent` buffer.
Buffers = List[Any]


class _OutOfBand:
    """A ``bytes`` or ``bytearray`` to pickle out of band."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data


def _rebuild_bytes(buffer: Any) -> bytes:
    return bytes(buffer)


def _rebuild_bytearray(buffer: Any) -> bytearray:
    return buffer if type(buffer) is bytearray else bytearray(buffer)


def _rebuild_memoryview(buffer: Any) -> memoryview:
    return memoryview(buffer)


def _rebuild_tensor(buffer: Any, dtype: str, shape: Tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    torch_dtype = getattr(torch, dtype.rsplit(".", 1)[-1])
    if len(memoryview(buffer)) == 0:
        tensor = torch.empty(shape, dtype=torch_dtype)
    else:
        tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


#: DLPack device types whose memory the CPU reads: ``kDLCPU`` and ``kDLCUDAHost`` (pinned).
_DLPACK_HOST_DEVICES = (1, 3)


def _dlpack_target(module: str, qualname: str) -> Any:
    """The ``from_dlpack`` that makes a ``module.qualname`` from a numpy array: the
    type's own, its module's or its top-level package's; ``None`` when there is none (or
    the type cannot be imported here)."""
    try:
        found: Any = importlib.import_module(module)
    except Exception:
        return None
    places = []
    kind: Any = found
    try:
        for part in qualname.split("."):
            kind = getattr(kind, part)
        places.append(kind)
    except AttributeError:
        pass
    places.append(found)
    top = module.split(".", 1)[0]
    if top != module:
        places.append(sys.modules.get(top))
    for place in places:
        convert = getattr(place, "from_dlpack", None)
        if callable(convert):
            return convert
    return None


def _rebuild_dlpack(
    buffer: Any, dtype: str, shape: Tuple[int, ...], module: str, qualname: str
) -> Any:
    try:
        import numpy
    except ImportError as e:
        raise ImportError(
            f"a {module}.{qualname} array arrived (by DLPack), and numpy, which rebuilds it, "
            "is not installed here: pip install numpy"
        ) from e
    array = numpy.frombuffer(buffer, dtype=numpy.uint8).view(numpy.dtype(dtype)).reshape(shape)
    convert = _dlpack_target(module, qualname)
    return array if convert is None else convert(array)


def _reduce_dlpack(obj: Any) -> Any:
    """A CPU DLPack array as its bytes out of band (numpy's view of the same memory), or
    ``NotImplemented`` (the object's own reduction): no numpy, a device the CPU cannot
    read, a dtype numpy lacks."""
    numpy = sys.modules.get("numpy")
    if numpy is None or isinstance(obj, numpy.ndarray):
        return NotImplemented
    try:
        device = obj.__dlpack_device__()
        if int(device[0]) not in _DLPACK_HOST_DEVICES:
            return NotImplemented
        array = numpy.from_dlpack(obj)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
    except Exception:
        return NotImplemented
    kind = type(obj)
    raw = array.reshape(-1).view(numpy.uint8)
    return (
        _rebuild_dlpack,
        (
            pickle.PickleBuffer(raw),
            array.dtype.str,
            tuple(array.shape),
            kind.__module__,
            kind.__qualname__,
        ),
    )


#: What sending a CUDA tensor raises: torch's own text (where no device map applies), and
#: why none does here.
CUDA_TENSOR_REFUSED = (
    "TensorPipe RPC backend only supports CPU tensors by default, please move your "
    "tensors to CPU before sending them over RPC (tensor.cpu()). rdzv.rpc does not move "
    "CUDA tensors from Python yet, so device maps (set_device_map, device_maps) do not "
    "apply to them; got a tensor on {device}"
)


def _reduce_tensor(torch: Any, tensor: Any) -> Any:
    """A CPU tensor as its bytes out of band, or ``NotImplemented`` (torch's own
    reduction) for the rest: meta, sparse, quantized tensors and subclasses. A CUDA
    tensor is refused (``RuntimeError``), as torch refuses one no device map applies to:
    pickled, it would arrive on its old device index, whatever the device maps say."""
    if tensor.device.type == "cuda":
        raise RuntimeError(CUDA_TENSOR_REFUSED.format(device=tensor.device))
    if (
        tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return NotImplemented
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return (
        _rebuild_tensor,
        (pickle.PickleBuffer(raw), str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad),
    )


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _OutOfBand:
            data = obj.data
            rebuild = _rebuild_bytes if type(data) is bytes else _rebuild_bytearray
            return (rebuild, (pickle.PickleBuffer(data),))
        if kind is memoryview and obj.c_contiguous:
            return (_rebuild_memoryview, (pickle.PickleBuffer(obj),))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return _reduce_tensor(torch, obj)
        if getattr(kind, "__dlpack__", None) is not None:
            return _reduce_dlpack(obj)
        return NotImplemented


def _address(view: memoryview) -> Optional[int]:
    """The address of a contiguous byte view's first byte, or ``None`` if it cannot be
    read without a copy."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        return int(numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0])
    if not view.readonly:
        return ctypes.addressof((ctypes.c_char * view.nbytes).from_buffer(view))
    whole = view.obj
    if type(whole) is bytes and len(whole) == view.nbytes:
        # ctypes points a c_char_p at a bytes object's own buffer (no copy).
        return ctypes.cast(ctypes.c_char_p(whole), ctypes.c_void_p).value
    return None


def _lend(view: memoryview) -> Any:
    """A buffer for the agent: :func:`lent` for a large one, which the agent reads in
    place while its owner keeps it alive; the view itself (copied) for a small one."""
    length = view.nbytes
    if length < LENT_BYTES:
        return view
    address = _address(view)
    if address is None:
        copy = bytes(view)
        copied = ctypes.cast(ctypes.c_char_p(copy), ctypes.c_void_p).value
        if copied is None:  # a non-empty bytes object is never at address 0
            raise BufferError("a copied buffer has no address")
        return lent(copied, length, memoryview(copy))
    return lent(address, length, view)


def dumps(obj: Any) -> Tuple[bytes, Buffers]:
    """``obj`` pickled (protocol 5) and its out-of-band buffers: flat byte views (small
    ones) or :func:`lent` ones (see the module's docs)."""
    buffers: List[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return out.getvalue(), [_lend(b.raw()) for b in buffers]


def _ctypes_view(buffer: Any) -> memoryview:
    """A writable byte view of a ``ReceivedBuffer`` without numpy (it keeps the buffer
    alive)."""
    length = len(buffer)
    if length == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * length).from_address(buffer.__array_interface__["data"][0])
    array._rdzv_owner = buffer  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _received(buffer: Any) -> Any:
    """A received buffer as its reconstructor takes it: a ``ReceivedBuffer`` as a
    ``uint8`` array (or view) over it; a lent one from this process's own ``dumps`` as
    its view."""
    if type(buffer) is _ReceivedBuffer:
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            return numpy.asarray(buffer)
        return _ctypes_view(buffer)
    if is_lent(buffer):
        return buffer.owner
    return buffer


def loads(payload: bytes, buffers: Sequence[Any]) -> Any:
    """The object ``dumps`` made, its buffers given back in order (as the agent received
    them, or as ``dumps`` listed them)."""
    # Lazily: pickle asks for each buffer after loading its reconstructor, so numpy is
    # imported by then when the object holds numpy arrays.
    return pickle.loads(payload, buffers=map(_received, buffers))


def _lift_one(value: Any) -> Any:
    kind = type(value)
    if (kind is bytes or kind is bytearray) and len(value) >= OUT_OF_BAND_BYTES:
        return _OutOfBand(value)
    return value


def lift(value: Any) -> Any:
    """``value`` with its large ``bytes`` (itself, or items of a small list, tuple or
    dict) marked to travel out of band."""
    kind = type(value)
    if kind is tuple and len(value) <= LIFTED_ITEMS:
        return tuple(_lift_one(v) for v in value)
    if kind is list and len(value) <= LIFTED_ITEMS:
        return [_lift_one(v) for v in value]
    if kind is dict and len(value) <= LIFTED_ITEMS:
        return {k: _lift_one(v) for k, v in value.items()}
    return _lift_one(value)


def lift_call(
    args: Optional[Sequence[Any]], kwargs: Optional[Dict[str, Any]]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Positional and keyword arguments with their large ``bytes`` lifted."""
    return (
        tuple(lift(a) for a in (args or ())),
        {k: lift(v) for k, v in (kwargs or {}).items()},
    )


class RemoteException:
    """A remote function's exception, as torch sends it: the text (``On
    WorkerInfo(...):``, the repr and the remote traceback) and where its type lives."""

    __slots__ = ("msg", "module", "qualname")

    def __init__(self, msg: str, module: str, qualname: str) -> None:
        self.msg = msg
        self.module = module
        self.qualname = qualname

    def __reduce__(self) -> Any:
        return (RemoteException, (self.msg, self.module, self.qualname))

    def exception_type(self) -> type:
        """The exception's class on this side, or ``RuntimeError`` if it cannot be
        imported here."""
        try:
            found: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                found = getattr(found, part)
        except Exception:
            return RuntimeError
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
        return RuntimeError

    def to_exception(self) -> BaseException:
        """The exception to raise at the caller: the same type with the remote text, or a
        ``RuntimeError`` carrying it when the type cannot be made from one string."""
        kind = self.exception_type()
        # As torch's caller does (rpc/internal.py): the repr line's escapes ("\\n") read
        # as what they stand for; characters beyond Latin-1 survive the round trip.
        try:
            msg = self.msg.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError:
            msg = self.msg
        try:
            return kind(msg)
        except Exception as e:
            return RuntimeError(
                f"Failed to create original exception type {self.module}.{self.qualname}: "
                f"{e}. Original exception on remote side was {msg}"
            )


def dumps_exception(exc: BaseException, worker: str) -> Tuple[bytes, Buffers]:
    """``exc``, raised on ``worker`` (its ``WorkerInfo`` text), as a reply."""
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    msg = f"On {worker}:\n{exc!r}\n{lines}"
    kind = type(exc)
    return dumps(RemoteException(msg, kind.__module__, kind.__qualname__))
