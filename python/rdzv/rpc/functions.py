"""``rdzv.rpc.functions.async_execution``, as torch has it.

A function decorated with it returns a future (``torch.futures.Future`` or
:class:`rdzv.rpc.futures.Future`), typically of a nested ``rpc_async`` chained with
``then``. Called through ``rpc_sync``, ``rpc_async`` or ``remote``, the callee answers
with the future's value once it completes, and the worker thread that ran the function
goes on to the next request meanwhile (the answer is sent from the thread that completes
the future). Called directly, it is the function itself.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Marks ``fn``, which returns a future, to answer RPCs when that future completes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # torch's attribute name, which its agent looks for too.
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def async_function(func: Any) -> Any:
    """The function ``async_execution`` wrapped, or ``None`` for any other callable."""
    return getattr(func, "_wrapped_async_rpc_function", None)
