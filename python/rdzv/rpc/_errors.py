"""The exception classes of :mod:`rdzv.rpc`.

torch's RPC raises ``RuntimeError`` for its own failures, so every class here is one too
(``except RuntimeError`` keeps working); where a standard class says more, it is a base
as well: a timeout is a ``TimeoutError`` (its text contains torch's "RPC ran for more
than set timeout"), a lost or unreachable peer a ``ConnectionError`` (its text names the
worker), misuse a ``ValueError``. A Python exception raised by the remote function is
not one of these: it is re-raised at the caller as its own type.
"""

from __future__ import annotations

from .._errors import RdzvError

__all__ = [
    "RpcError",
    "RpcTimeoutError",
    "RpcConnectionError",
    "RpcRemoteError",
    "RpcShutdownError",
    "RpcUsageError",
    "RpcInitError",
]


class RpcError(RdzvError, RuntimeError):
    """An RPC failed (the message says which call, to which worker, and why)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call, or a graceful shutdown, ran past its timeout."""


class RpcConnectionError(RpcError, ConnectionError):
    """The pipe to a worker broke, or could not be opened: the worker is gone or
    unreachable. The message names it."""


class RpcRemoteError(RpcError):
    """The remote worker refused or failed the request outside the function itself
    (its interpreter was exiting, the request could not be read)."""


class RpcShutdownError(RpcError):
    """This worker's agent shut down while the call was pending."""


class RpcUsageError(RpcError, ValueError):
    """The API was used wrongly: an unknown worker, RPC not initialised, a bad option."""


class RpcInitError(RpcError):
    """``init_rpc`` failed: the rendezvous, the store or the options."""
