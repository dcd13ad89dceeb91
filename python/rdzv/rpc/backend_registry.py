"""The backend registry of ``torch.distributed.rpc.backend_registry``: ``BackendType``,
``register_backend``, ``backend_registered``, ``construct_rpc_backend_options`` and
``init_backend``.

``BackendType.TENSORPIPE`` (torch's default, and the name programs pass) starts rdzv's
agent. A registered backend's handlers are called as torch calls them, except that
``init_backend_handler`` gets ``(name, rank, world_size, rpc_backend_options)``: rdzv's
agents rendezvous through the options' ``init_method`` themselves, so there is no store
argument. ``init_rpc(backend=B)`` runs ``B``'s init handler.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Callable, NamedTuple

__all__ = [
    "BackendType",
    "BackendValue",
    "register_backend",
    "backend_registered",
    "construct_rpc_backend_options",
    "init_backend",
]


class BackendValue(NamedTuple):
    """What a backend is: how to build its options, and how to start it."""

    construct_rpc_backend_options_handler: Callable[..., Any]
    init_backend_handler: Callable[..., Any]


def _tensorpipe_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> Any:
    from .options import TensorPipeRpcBackendOptions

    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _tensorpipe_init(name: str, rank: int, world_size: Any, rpc_backend_options: Any) -> Any:
    from . import _start_agent

    return _start_agent(name, rank, world_size, rpc_backend_options)


_lock = threading.Lock()
BackendType: Any = enum.Enum(
    "BackendType", {"TENSORPIPE": BackendValue(_tensorpipe_options, _tensorpipe_init)}
)


def backend_registered(backend_name: str) -> bool:
    """Whether a backend of that name is registered."""
    return backend_name in BackendType.__members__


def register_backend(
    backend_name: str,
    construct_rpc_backend_options_handler: Callable[..., Any],
    init_backend_handler: Callable[..., Any],
) -> Any:
    """Registers a backend under ``backend_name`` and returns its ``BackendType``
    member. ``RuntimeError`` if the name is taken."""
    global BackendType
    with _lock:
        if backend_registered(backend_name):
            raise RuntimeError(f"RPC backend {backend_name}: already registered")
        members = {m.name: m.value for m in BackendType}
        members[backend_name] = BackendValue(
            construct_rpc_backend_options_handler, init_backend_handler
        )
        BackendType = enum.Enum("BackendType", members)  # type: ignore[misc]
        _republish()
        return BackendType[backend_name]


def _republish() -> None:
    """``rdzv.rpc.BackendType`` follows this module's."""
    import sys

    package = sys.modules.get(__package__ or "")
    if package is not None:
        package.BackendType = BackendType  # type: ignore[attr-defined]


def _member(backend: Any) -> Any:
    if isinstance(backend, str):
        return BackendType[backend]
    return BackendType[backend.name]


def construct_rpc_backend_options(
    backend: Any,
    rpc_timeout: float = 60.0,
    init_method: str = "env://",
    **kwargs: Any,
) -> Any:
    """The options of ``backend``, from its options handler."""
    return _member(backend).value.construct_rpc_backend_options_handler(
        rpc_timeout, init_method, **kwargs
    )


def init_backend(backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Starts ``backend`` with its init handler."""
    return _member(backend).value.init_backend_handler(*args, **kwargs)
